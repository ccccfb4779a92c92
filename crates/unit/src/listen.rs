//! A unit's listeners: binding the Unix socket, accepting on it and on
//! TCP, the handshake pool's admission, and the cap on served
//! connections (a connection counts only once it proved itself).

use std::io;
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_wire::io::Socket;

use crate::reactor::Reactor;
use crate::shared::Shared;
use crate::{admit, conn};

/// Bind a Unix socket, replacing a stale socket file (one nobody listens
/// on) but never a live unit's.
pub(crate) fn bind_uds(path: &Path, allow_other_uids: bool) -> io::Result<UnixListener> {
    let l = bind_uds_file(path)?;
    // Only the owner may connect (unless other users are let in).
    let mode = if allow_other_uids { 0o666 } else { 0o600 };
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    Ok(l)
}

fn bind_uds_file(path: &Path) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another unit is serving on this socket",
                ));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path)
        }
        Err(e) => Err(e),
    }
}

/// Refuse a connection before serving it: one error frame, then close.
fn turn_away(mut s: impl io::Write, code: stowage_wire::ErrorCode, message: &str) {
    let mut out = Vec::new();
    let r = stowage_wire::Response::Error {
        code,
        message: message.to_owned(),
    };
    if stowage_wire::encode(0, &r, 0, &mut out).is_ok() {
        let _ = s.write_all(&out);
    }
}

/// Serve `stream` (on a worker of the reactor). It waits in the handshake pool
/// until it proves itself (see `admit.rs`): taking its place there may
/// cut the oldest handshake of its source, or of the source holding the
/// most.
fn spawn_conn(
    shared: &Arc<Shared>,
    reactor: &Reactor,
    stream: Socket,
    peer: conn::Peer,
    source: admit::Source,
) {
    let Some((ticket, cut)) = shared.conns.handshakes.admit(source, &stream) else {
        tracing::warn!(%source, "out of file descriptors: a connection was turned away");
        if let Some(m) = &shared.metrics {
            m.turned_away();
        }
        return;
    };
    if let Some((why, from)) = cut {
        if let Some(m) = &shared.metrics {
            m.handshake_cut(why);
        }
        tracing::debug!(source = %from, reason = ?why, "cut a handshake to admit a new connection");
    }
    let c = conn::open(shared.clone(), stream, peer, ticket, Instant::now());
    reactor.admit(c);
}

pub(crate) fn accept_uds(shared: Arc<Shared>, reactor: &Reactor, l: UnixListener) {
    for stream in l.incoming() {
        if shared.life.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let cred = rustix::net::sockopt::socket_peercred(&s).ok();
                let peer = conn::Peer {
                    uid: cred.map(|c| c.uid.as_raw()),
                    pid: cred.map(|c| c.pid.as_raw_nonzero().get()),
                };
                if !shared.settings.allow_other_uids && peer.uid != Some(shared.settings.uid) {
                    tracing::warn!(uid = ?peer.uid, pid = ?peer.pid, "refused a client of another user");
                    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                    turn_away(
                        s,
                        stowage_wire::ErrorCode::Unauthorized,
                        "this unit accepts only its own user's clients",
                    );
                    continue;
                }
                // Same-user peers prove themselves too before they are
                // served; a peer without credentials counts as one user.
                let source = admit::Source::Uid(peer.uid.unwrap_or(u32::MAX));
                spawn_conn(&shared, reactor, Socket::Unix(s), peer, source);
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the Unix socket failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

pub(crate) fn accept_tcp(shared: Arc<Shared>, reactor: &Reactor, l: TcpListener) {
    let local = l.local_addr().ok();
    for stream in l.incoming() {
        if shared.life.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let source = match s.peer_addr() {
                    // The accepted socket's own address: a listener on
                    // 0.0.0.0 answers on the address the peer dialled.
                    Ok(p) => admit::Source::of_tcp(p, s.local_addr().ok().or(local)),
                    Err(_) => continue, // already gone
                };
                spawn_conn(
                    &shared,
                    reactor,
                    Socket::Tcp(s),
                    conn::Peer::default(),
                    source,
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on TCP failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
