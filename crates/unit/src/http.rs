//! The metrics endpoint: a minimal blocking HTTP/1.x responder that
//! answers `GET /metrics` with the unit's metrics in the Prometheus text
//! format, 404 for any other path, 405 for any other method, and closes
//! every connection after one answer.
//!
//! It is deliberately small rather than a general HTTP server (no
//! keep-alive, no chunked bodies, no request bodies): a scraper is all it
//! serves. A client cannot hold it: at most [`MAX_CLIENTS`] connections
//! are served at once (others are closed at accept), a request head
//! larger than [`MAX_HEAD`] is answered 431, and each connection must send
//! its request head within [`REQUEST_TIMEOUT`] and take the answer within
//! the same time, or it is dropped.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

/// Most scrapes served at once.
pub const MAX_CLIENTS: usize = 8;
/// Largest request line plus headers.
pub const MAX_HEAD: usize = 8 << 10;
/// Time a client has to send its request head, and to take the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Bind the metrics listener.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
}

/// Accept scrapes until the unit stops (`stopping`).
pub(crate) fn accept(stopping: impl Fn() -> bool, l: TcpListener, registry: Arc<Registry>) {
    let active = Arc::new(AtomicUsize::new(0));
    for stream in l.incoming() {
        if stopping() {
            return;
        }
        let Ok(s) = stream else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            active.fetch_sub(1, Ordering::SeqCst);
            drop(s);
            continue;
        }
        let (active2, registry) = (active.clone(), registry.clone());
        let spawned = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                let _ = answer(s, &registry);
                active2.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Read one request head (bounded in size and time) and answer it.
fn answer(mut s: TcpStream, registry: &Registry) -> io::Result<()> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    s.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let complete = loop {
        if let Some(end) = find_head_end(&head) {
            head.truncate(end);
            break true;
        }
        if head.len() >= MAX_HEAD {
            break false;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(()); // too slow: dropped without an answer
        }
        s.set_read_timeout(Some(left))?;
        let n = match s.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Ok(()),
        };
        head.extend_from_slice(&buf[..n]);
    };
    if !complete {
        return respond(&mut s, 431, "text/plain", b"request head too large\n");
    }
    let Ok(head) = std::str::from_utf8(&head) else {
        return respond(&mut s, 400, "text/plain", b"bad request\n");
    };
    let mut parts = head.lines().next().unwrap_or("").split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return respond(&mut s, 400, "text/plain", b"bad request\n");
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return respond(&mut s, 400, "text/plain", b"bad request\n");
    }
    let path = target.split('?').next().unwrap_or("");
    if path != "/metrics" {
        return respond(&mut s, 404, "text/plain", b"not found: try /metrics\n");
    }
    if method != "GET" {
        return respond(&mut s, 405, "text/plain", b"only GET\n");
    }
    let body = crate::metrics::render(registry);
    respond(
        &mut s,
        200,
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        body.as_bytes(),
    )
}

/// Where the request head ends (after the blank line), if it has.
fn find_head_end(b: &[u8]) -> Option<usize> {
    b.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .or_else(|| b.windows(2).position(|w| w == b"\n\n").map(|p| p + 2))
}

fn respond(s: &mut TcpStream, code: u16, content_type: &str, body: &[u8]) -> io::Result<()> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    let _ = s.shutdown(std::net::Shutdown::Write);
    Ok(())
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
}
