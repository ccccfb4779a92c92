//! The metrics endpoint: a minimal HTTP/1.x responder that answers
//! `GET /metrics` with the unit's metrics in the Prometheus text format,
//! 404 for any other path, 405 for any other method, and closes every
//! connection after one answer.
//!
//! It is deliberately small rather than a general HTTP server (no
//! keep-alive, no chunked bodies, no request bodies): a scraper is all it
//! serves. One thread serves every connection from one poll loop, so
//! what it holds is bounded: at most [`MAX_CLIENTS`] connections, each
//! with a request head of at most [`MAX_HEAD`] (larger is answered 431)
//! and one answer. A connection must send its request head within
//! [`REQUEST_TIMEOUT`] and take the answer within the same time, or it is
//! dropped.
//!
//! Nobody can hold the endpoint from its owner's scraper (another local
//! user may connect to it too): when every place is taken, a new
//! connection takes the place of the oldest one that has not sent a whole
//! request yet (else of the oldest still taking its answer), so
//! connections that are opened and left silent, or re-opened as fast as
//! they are cut, cannot keep a scraper that sends its request at once
//! from being served. With a bearer token (`--metrics-token-file`,
//! `metrics.token_file`), a request must carry `Authorization: Bearer
//! <token>` (as Prometheus's `authorization` scrape option sends it) or
//! is answered 401, and a connection that showed the token is never
//! evicted for another.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use prometheus_client::registry::Registry;

/// Most connections held at once.
pub const MAX_CLIENTS: usize = 64;
/// Most connections accepted in one turn of the loop before the requests
/// of those already held are read: a connection is evicted only after
/// `MAX_CLIENTS` newer ones, several turns after it arrived.
const ACCEPTS_PER_TURN: usize = 8;
/// Largest request line plus headers.
pub const MAX_HEAD: usize = 8 << 10;
/// Time a client has to send its request head, and to take the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the loop looks whether the unit is stopping.
const TICK: Duration = Duration::from_millis(100);
const LISTENER: Token = Token(usize::MAX);

/// Bind the metrics listener.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
}

/// Serve scrapes until the unit stops (`stopping`). `token`: the bearer
/// token every request must carry, if any.
pub(crate) fn accept(
    stopping: impl Fn() -> bool,
    l: TcpListener,
    registry: Arc<Registry>,
    token: Option<Arc<str>>,
) {
    if let Err(e) = serve(&stopping, l, &registry, token.as_deref()) {
        tracing::error!(error = %e, "the metrics endpoint stopped");
    }
}

/// One connection.
struct Client {
    s: TcpStream,
    /// When it was accepted (the oldest is evicted first).
    since: Instant,
    /// By when its head must be in, or (answering) its answer taken.
    deadline: Instant,
    head: Vec<u8>,
    /// The answer, once the head is in; `sent` of it written.
    out: Option<Vec<u8>>,
    sent: usize,
    /// It showed the bearer token (never evicted for another).
    shown: bool,
}

/// What became of a connection after it made progress.
enum Progress {
    /// Waiting for more of its head, or for room to write its answer.
    Waiting,
    /// Answered (or gone): close it.
    Done,
}

fn serve(
    stopping: &impl Fn() -> bool,
    l: TcpListener,
    registry: &Registry,
    token: Option<&str>,
) -> io::Result<()> {
    l.set_nonblocking(true)?;
    let mut l = mio::net::TcpListener::from_std(l);
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut l, LISTENER, Interest::READABLE)?;
    let mut events = Events::with_capacity(MAX_CLIENTS + 1);
    let mut clients: Vec<Option<Client>> = (0..MAX_CLIENTS).map(|_| None).collect();
    // Connections may wait at the listener (readiness is edge-triggered:
    // once seen, it is ours to drain).
    let mut pending = false;
    loop {
        if stopping() {
            return Ok(());
        }
        let now = Instant::now();
        let mut wait = clients
            .iter()
            .flatten()
            .map(|c| c.deadline.saturating_duration_since(now))
            .fold(TICK, Duration::min);
        if pending {
            wait = Duration::ZERO;
        }
        match poll.poll(&mut events, Some(wait)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        // Those held first: a request that has come in is served before
        // newer connections may evict it.
        for ev in events.iter() {
            if ev.token() == LISTENER {
                pending = true;
                continue;
            }
            let i = ev.token().0;
            if let Some(c) = clients.get_mut(i).and_then(Option::as_mut) {
                if matches!(progress(c, registry, token), Progress::Done) {
                    close(&poll, &mut clients[i]);
                }
            }
        }
        if pending {
            pending = accept_some(&poll, &l, &mut clients, registry, token)?;
        }
        let now = Instant::now();
        for slot in clients.iter_mut() {
            if slot.as_ref().is_some_and(|c| c.deadline <= now) {
                close(&poll, slot); // too slow: dropped without an answer
            }
        }
    }
}

/// Accept up to [`ACCEPTS_PER_TURN`] connections; whether more may wait.
fn accept_some(
    poll: &Poll,
    l: &mio::net::TcpListener,
    clients: &mut [Option<Client>],
    registry: &Registry,
    token: Option<&str>,
) -> io::Result<bool> {
    for _ in 0..ACCEPTS_PER_TURN {
        let mut s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // Out of fds, or a connection reset before it was accepted:
            // try again next turn (the loop sleeps at most a tick).
            Err(_) => return Ok(false),
        };
        let i = match clients.iter().position(Option::is_none) {
            Some(i) => i,
            None => match victim(clients) {
                Some(v) => {
                    close(poll, &mut clients[v]);
                    v
                }
                None => continue, // every place holds a token: dropped
            },
        };
        poll.registry()
            .register(&mut s, Token(i), Interest::READABLE | Interest::WRITABLE)?;
        let now = Instant::now();
        let mut c = Client {
            s,
            since: now,
            deadline: now + REQUEST_TIMEOUT,
            head: Vec::new(),
            out: None,
            sent: 0,
            shown: false,
        };
        // Its head may be in already.
        match progress(&mut c, registry, token) {
            Progress::Waiting => clients[i] = Some(c),
            Progress::Done => {
                let _ = poll.registry().deregister(&mut c.s);
            }
        }
    }
    Ok(true)
}

/// The connection a new one takes the place of: the oldest that has not
/// sent a whole request, else the oldest still taking its answer; never
/// one that showed the token.
fn victim(clients: &[Option<Client>]) -> Option<usize> {
    clients
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
        .filter(|(_, c)| !c.shown)
        .min_by_key(|(_, c)| (c.out.is_some(), c.since))
        .map(|(i, _)| i)
}

fn close(poll: &Poll, slot: &mut Option<Client>) {
    if let Some(mut c) = slot.take() {
        let _ = poll.registry().deregister(&mut c.s);
    }
}

/// Read what there is of `c`'s head; once it is whole, make the answer
/// and write what the socket takes.
fn progress(c: &mut Client, registry: &Registry, token: Option<&str>) -> Progress {
    if c.out.is_none() {
        let mut buf = [0u8; 1024];
        let head = loop {
            if let Some(end) = find_head_end(&c.head) {
                c.head.truncate(end);
                break Some(&c.head[..]);
            }
            if c.head.len() >= MAX_HEAD {
                break None;
            }
            let room = (MAX_HEAD - c.head.len()).min(buf.len());
            match c.s.read(&mut buf[..room]) {
                Ok(0) => return Progress::Done,
                Ok(n) => c.head.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Waiting,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Progress::Done,
            }
        };
        let (out, shown) = answer(head, registry, token);
        c.shown = shown;
        c.out = Some(out);
        c.head = Vec::new();
        c.deadline = Instant::now() + REQUEST_TIMEOUT;
    }
    let Some(out) = &c.out else {
        return Progress::Waiting;
    };
    while c.sent < out.len() {
        match c.s.write(&out[c.sent..]) {
            Ok(0) => return Progress::Done,
            Ok(n) => c.sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Waiting,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Progress::Done,
        }
    }
    let _ = c.s.shutdown(std::net::Shutdown::Write);
    Progress::Done
}

/// The answer to a request `head` (`None`: too large), and whether it
/// showed the token.
fn answer(head: Option<&[u8]>, registry: &Registry, token: Option<&str>) -> (Vec<u8>, bool) {
    let Some(head) = head else {
        return (
            respond(431, "text/plain", b"request head too large\n"),
            false,
        );
    };
    let Ok(head) = std::str::from_utf8(head) else {
        return (respond(400, "text/plain", b"bad request\n"), false);
    };
    let mut lines = head.lines();
    let mut parts = lines.next().unwrap_or("").split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return (respond(400, "text/plain", b"bad request\n"), false);
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return (respond(400, "text/plain", b"bad request\n"), false);
    }
    let shown = token.is_some_and(|t| lines.any(|l| shows_token(l, t)));
    if token.is_some() && !shown {
        return (
            respond(401, "text/plain", b"this endpoint needs its bearer token\n"),
            false,
        );
    }
    let path = target.split('?').next().unwrap_or("");
    if path != "/metrics" {
        return (
            respond(404, "text/plain", b"not found: try /metrics\n"),
            shown,
        );
    }
    if method != "GET" {
        return (respond(405, "text/plain", b"only GET\n"), shown);
    }
    let body = crate::metrics::render(registry);
    (
        respond(
            200,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            body.as_bytes(),
        ),
        shown,
    )
}

/// Whether the header `line` is `Authorization: Bearer <token>` (the
/// name and the scheme in any case).
fn shows_token(line: &str, token: &str) -> bool {
    let Some((name, value)) = line.split_once(':') else {
        return false;
    };
    if !name.trim().eq_ignore_ascii_case("authorization") {
        return false;
    }
    let value = value.trim();
    let Some((scheme, given)) = value.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && same(given.trim().as_bytes(), token.as_bytes())
}

/// `a == b` in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Where the request head ends (after the blank line), if it has.
fn find_head_end(b: &[u8]) -> Option<usize> {
    b.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .or_else(|| b.windows(2).position(|w| w == b"\n\n").map(|p| p + 2))
}

fn respond(code: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let challenge = if code == 401 {
        "WWW-Authenticate: Bearer\r\n"
    } else {
        ""
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{challenge}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The bearer token in `path`: its contents without surrounding
/// whitespace (a trailing newline), which must be 16 to 4096 visible
/// ASCII characters.
pub(crate) fn read_token(path: &std::path::Path) -> Result<Arc<str>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the metrics token file {}: {e}", path.display()))?;
    let t = text.trim();
    if t.len() < 16 || t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "the metrics token file {} must hold one token of 16 to 4096 visible ASCII \
             characters (e.g. `openssl rand -hex 32`)",
            path.display()
        ));
    }
    Ok(Arc::from(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_at_the_blank_line() {
        assert_eq!(
            find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"),
            Some(27)
        );
        assert_eq!(find_head_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    #[test]
    fn the_token_is_shown_only_as_a_bearer_authorization() {
        let t = "0123456789abcdef";
        assert!(shows_token("Authorization: Bearer 0123456789abcdef", t));
        assert!(shows_token("authorization:bearer  0123456789abcdef ", t));
        assert!(!shows_token("Authorization: Bearer 0123456789abcdeF", t));
        assert!(!shows_token("Authorization: Bearer 0123456789abcde", t));
        assert!(!shows_token("Authorization: Basic 0123456789abcdef", t));
        assert!(!shows_token("X-Authorization: Bearer 0123456789abcdef", t));
        assert!(!shows_token("Authorization 0123456789abcdef", t));
    }

    fn held(since_ms: u64, answering: bool, shown: bool, base: Instant) -> Option<Client> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        Some(Client {
            s: TcpStream::from_std(s),
            since: base + Duration::from_millis(since_ms),
            deadline: base + REQUEST_TIMEOUT,
            head: Vec::new(),
            out: answering.then(Vec::new),
            sent: 0,
            shown,
        })
    }

    #[test]
    fn the_oldest_without_a_whole_request_is_evicted_first_and_a_token_never() {
        let b = Instant::now();
        // Oldest is answering; the oldest still reading is evicted.
        let cs = vec![
            held(0, true, false, b),
            held(5, false, false, b),
            None,
            held(3, false, false, b),
        ];
        assert_eq!(victim(&cs), Some(3));
        // None reading: the oldest answering one.
        let cs = vec![held(4, true, false, b), held(2, true, false, b)];
        assert_eq!(victim(&cs), Some(1));
        // One that showed the token stays, even the oldest reading one.
        let cs = vec![held(0, false, true, b), held(9, true, false, b)];
        assert_eq!(victim(&cs), Some(1));
        let cs = vec![held(0, false, true, b), held(1, true, true, b)];
        assert_eq!(victim(&cs), None);
    }

    #[test]
    fn a_request_without_the_token_is_answered_401() {
        let r = Registry::default();
        let (out, shown) = answer(
            Some(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            &r,
            Some("0123456789abcdef"),
        );
        assert!(!shown);
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with("HTTP/1.1 401 "), "{out}");
        assert!(out.contains("WWW-Authenticate: Bearer"), "{out}");
        let (out, shown) = answer(
            Some(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer 0123456789abcdef\r\n\r\n"),
            &r,
            Some("0123456789abcdef"),
        );
        assert!(shown);
        assert!(out.starts_with(b"HTTP/1.1 200 "));
        let (out, shown) = answer(Some(b"GET /metrics HTTP/1.1\r\n\r\n"), &r, None);
        assert!(!shown);
        assert!(out.starts_with(b"HTTP/1.1 200 "));
    }
}
