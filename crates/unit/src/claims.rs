//! Answers to claims that waited ([`Answers`]): a connection whose claim
//! the core keeps waiting gets its answer later, when a put makes rows
//! ready or the wait ends, from whichever thread drove the core then.
//! The serving worker that holds the connection leaves a mailbox here;
//! the driver posts the core's answer into it. Either may come first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stowage_core::ConnId;
use stowage_wire::Response;

/// Hands an answer to the worker serving the connection.
pub(crate) type Mailbox = Box<dyn FnOnce(Response) + Send>;

/// An answer that came before its mailbox is kept this long at most (a
/// connection that ended meanwhile never leaves one).
const EARLY_KEPT: Duration = Duration::from_secs(60);

/// The mailboxes of connections whose claim waits, and answers that came
/// before their mailbox.
#[derive(Default)]
pub(crate) struct Answers {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    boxes: HashMap<ConnId, Mailbox>,
    early: HashMap<ConnId, (Response, Instant)>,
}

impl Answers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connection `conn` waits for its claim's answer: it goes into `mailbox`
    /// (at once, when it came already).
    pub(crate) fn wait(&self, conn: ConnId, mailbox: Mailbox) {
        let mut i = self.lock();
        match i.early.remove(&conn) {
            Some((r, _)) => {
                drop(i);
                mailbox(r);
            }
            None => {
                i.boxes.insert(conn, mailbox);
            }
        }
    }

    /// The core answered `conn`'s waiting claim.
    pub(crate) fn answer(&self, conn: ConnId, r: Response) {
        let mut i = self.lock();
        match i.boxes.remove(&conn) {
            Some(mailbox) => {
                drop(i);
                mailbox(r);
            }
            None => {
                let now = Instant::now();
                i.early
                    .retain(|_, (_, at)| now.duration_since(*at) < EARLY_KEPT);
                i.early.insert(conn, (r, now));
            }
        }
    }

    /// `conn` ended: nothing waits for it any more.
    pub(crate) fn forget(&self, conn: ConnId) {
        let mut i = self.lock();
        i.boxes.remove(&conn);
        i.early.remove(&conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn claimed(lease: u64) -> Response {
        Response::Claimed {
            lease,
            rows: vec![lease],
            homes: vec![],
        }
    }

    #[test]
    fn an_answer_reaches_its_mailbox_whichever_comes_first() {
        let a = Answers::default();
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        a.wait(ConnId(1), Box::new(move |r| t.send(r).unwrap()));
        a.answer(ConnId(1), claimed(1));
        assert_eq!(rx.try_recv().unwrap(), claimed(1));
        // The answer first, then the mailbox.
        a.answer(ConnId(2), claimed(2));
        assert!(rx.try_recv().is_err());
        a.wait(ConnId(2), Box::new(move |r| tx.send(r).unwrap()));
        assert_eq!(rx.try_recv().unwrap(), claimed(2));
    }

    #[test]
    fn a_forgotten_connection_gets_nothing() {
        let a = Answers::default();
        let (tx, rx) = mpsc::channel();
        a.answer(ConnId(3), claimed(3));
        a.forget(ConnId(3));
        a.wait(ConnId(3), Box::new(move |r| tx.send(r).unwrap()));
        assert!(rx.try_recv().is_err());
        a.forget(ConnId(3));
        a.answer(ConnId(3), claimed(4));
        assert!(rx.try_recv().is_err());
    }
}
