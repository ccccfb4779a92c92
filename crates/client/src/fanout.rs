//! Every unit's part of a call at once, on the calling thread.
//!
//! A unit's part of a call is one `async` function that reads from top to
//! bottom: send a request, [`turn`], take the reply, send the next, …
//! [`all_at_once`] polls the parts of all units in turn: each runs until it
//! has sent a request and awaits [`turn`], then the next unit's part runs,
//! so every unit works on its request while this thread serves the others,
//! and a call waits for the slowest unit, not the sum of them. A reply is
//! then taken with a blocking read (bounded by the call's deadline): the
//! parts need no reactor, no waker and no thread of their own. With one
//! part, [`turn`] does not stop at all.
//!
//! A part that must wait for a time (a unit answered Busy) awaits
//! [`pause_until`]: the others go on meanwhile, and when every part left
//! is waiting so, the thread sleeps until the first is due.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// What the parts of the [`all_at_once`] running on this thread asked for
/// during one pass over them.
#[derive(Clone, Copy, Default)]
struct Pass {
    /// Only one part: [`turn`] does not stop.
    alone: bool,
    /// A part stopped at a [`turn`]: poll again at once.
    again: bool,
    /// The earliest instant a part waiting in [`pause_until`] is due.
    until: Option<Instant>,
}

thread_local! {
    static PASS: Cell<Pass> = const {
        Cell::new(Pass {
            alone: true,
            again: false,
            until: None,
        })
    };
}

/// Run every part to its end, all at once (see the module docs); their
/// results in the order of `parts`.
pub(crate) fn all_at_once<F: Future>(parts: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut parts: Vec<Pin<Box<F>>> = parts.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = parts.iter().map(|_| None).collect();
    let mut cx = Context::from_waker(Waker::noop());
    let mut left = parts.len();
    // A part's own call of all_at_once (none does today) keeps the state
    // of this one.
    let outer = PASS.get();
    while left > 0 {
        PASS.set(Pass {
            alone: left == 1,
            again: false,
            until: None,
        });
        for (part, done) in parts.iter_mut().zip(out.iter_mut()) {
            if done.is_some() {
                continue;
            }
            if let Poll::Ready(v) = part.as_mut().poll(&mut cx) {
                *done = Some(v);
                left -= 1;
            }
        }
        let pass = PASS.get();
        if left > 0 && !pass.again {
            // Every part left waits for a time: sleep until the first is due.
            if let Some(at) = pass.until {
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
            }
        }
    }
    PASS.set(outer);
    out.into_iter().flatten().collect()
}

/// Whether the part running now is the only one left of its call (or no
/// call of [`all_at_once`] runs on this thread): it may block.
pub(crate) fn alone() -> bool {
    PASS.get().alone
}

/// Let the other units' parts run: this one has sent a request and is
/// about to wait for its reply. No stop when the part runs alone.
pub(crate) fn turn() -> impl Future<Output = ()> {
    struct Turn(bool);
    impl Future for Turn {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            let mut pass = PASS.get();
            if self.0 || pass.alone {
                return Poll::Ready(());
            }
            self.0 = true;
            pass.again = true;
            PASS.set(pass);
            Poll::Pending
        }
    }
    Turn(false)
}

/// Wait until `at`, while the other units' parts go on (alone, on the
/// spot).
pub(crate) fn pause_until(at: Instant) -> impl Future<Output = ()> {
    struct Pause(Instant);
    impl Future for Pause {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            let now = Instant::now();
            if now >= self.0 {
                return Poll::Ready(());
            }
            let mut pass = PASS.get();
            if pass.alone {
                // Nothing else to run meanwhile: wait here.
                std::thread::sleep(self.0 - now);
                return Poll::Ready(());
            }
            pass.until = Some(pass.until.map_or(self.0, |u| u.min(self.0)));
            PASS.set(pass);
            Poll::Pending
        }
    }
    Pause(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::time::Duration;

    #[test]
    fn parts_take_turns_and_results_keep_their_order() {
        let log = RefCell::new(Vec::new());
        let out = all_at_once((0..3).map(|i| {
            let log = &log;
            async move {
                log.borrow_mut().push((i, "send"));
                turn().await;
                log.borrow_mut().push((i, "reply"));
                i * 10
            }
        }));
        assert_eq!(out, vec![0, 10, 20]);
        // Every part sent before any took its reply.
        let log = log.into_inner();
        assert!(log[..3].iter().all(|(_, s)| *s == "send"), "{log:?}");
        assert!(log[3..].iter().all(|(_, s)| *s == "reply"), "{log:?}");
    }

    #[test]
    fn a_part_alone_never_stops() {
        let polls = Cell::new(0);
        let part = async {
            turn().await;
            turn().await;
            7
        };
        struct Counted<'a, F>(Pin<Box<F>>, &'a Cell<u32>);
        impl<F: Future> Future for Counted<'_, F> {
            type Output = F::Output;
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
                self.1.set(self.1.get() + 1);
                self.0.as_mut().poll(cx)
            }
        }
        assert_eq!(all_at_once([Counted(Box::pin(part), &polls)]), vec![7]);
        assert_eq!(polls.get(), 1);
    }

    #[test]
    fn a_paused_part_lets_the_others_finish_first() {
        let order = RefCell::new(Vec::new());
        let later = Instant::now() + Duration::from_millis(20);
        all_at_once((0..2).map(|i| {
            let order = &order;
            async move {
                if i == 0 {
                    pause_until(later).await;
                }
                order.borrow_mut().push(i);
            }
        }));
        assert!(Instant::now() >= later);
        assert_eq!(order.into_inner(), vec![1, 0]);
    }
}
