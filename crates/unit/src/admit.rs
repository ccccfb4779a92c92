//! Admission: connections that have proved nothing yet never take a
//! proven session's slot.
//!
//! A new connection first waits in the *handshake pool* (its own small
//! cap, [`crate::UnitConfig::max_handshakes`], and a cap per source,
//! [`crate::UnitConfig::max_handshakes_per_source`]) for at most the
//! handshake timeout. Only once it proved the shared secret (or, on a unit
//! without one, said Hello) does it move to the pool of served connections
//! (`max_connections`); if that is full then, it is answered Busy.
//!
//! A new connection is never turned away from the handshake pool: when
//! its source has its share, that source's oldest handshake is cut; when
//! the pool is full, the oldest handshake of the source holding the most
//! is. So a client that proves itself promptly always gets through: to
//! cut its handshake, someone must open more connections *from its own
//! source* than its share within the time it takes to prove the secret,
//! and the unit accepts one connection at a time. Re-opening idle
//! connections, however many, only cuts one's own.
//!
//! The source of a connection: its user for a Unix-socket peer (the
//! kernel's SO_PEERCRED) and for a loopback TCP peer (the owner of the
//! peer's socket, which the kernel tells through `NETLINK_SOCK_DIAG`:
//! another local user does not share a source with the job by connecting
//! over loopback, from any 127.x address); otherwise the peer's address
//! (an IPv6 peer's /64 network).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where a connection comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// A local user (a Unix-socket peer, or a loopback TCP peer whose
    /// socket the kernel names).
    Uid(u32),
    /// A TCP peer's address; an IPv6 peer's /64 network.
    Ip(IpAddr),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Uid(u) => write!(f, "uid {u}"),
            Source::Ip(a) => write!(f, "{a}"),
        }
    }
}

impl Source {
    /// The source of a TCP peer at `peer`, connected to `local`.
    pub(crate) fn of_tcp(peer: SocketAddr, local: Option<SocketAddr>) -> Source {
        let ip = peer.ip().to_canonical();
        if ip.is_loopback() {
            if let Some(uid) = local.and_then(|l| loopback_peer_uid(peer, l)) {
                return Source::Uid(uid);
            }
        }
        match ip {
            IpAddr::V6(a) => {
                let net = u128::from(a) & !((1u128 << 64) - 1);
                Source::Ip(IpAddr::V6(net.into()))
            }
            v4 => Source::Ip(v4),
        }
    }
}

/// Why a handshake was cut before it finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Cut {
    /// Its source opened more connections than its share.
    Source = 1,
    /// The pool was full and its source held the most.
    Pool = 2,
}

/// The handshake pool.
pub(crate) struct Handshakes {
    pub(crate) max: usize,
    pub(crate) per_source: usize,
    inner: Mutex<Pool>,
}

#[derive(Default)]
struct Pool {
    next: u64,
    live: HashMap<u64, Pending>,
}

struct Pending {
    source: Source,
    since: Instant,
    /// Another handle on its socket, to wake its thread when it is cut.
    fd: OwnedFd,
    cut: Arc<AtomicU8>,
}

/// A connection's place in the handshake pool, left when it is dropped or
/// [`Handshakes::prove`]d.
pub(crate) struct Ticket {
    id: u64,
    pub(crate) source: Source,
    cut: Arc<AtomicU8>,
    pool: std::sync::Weak<crate::Shared>,
}

impl Ticket {
    /// Why the handshake was cut (`None`: it was not).
    pub(crate) fn cut(&self) -> Option<Cut> {
        match self.cut.load(Ordering::SeqCst) {
            1 => Some(Cut::Source),
            2 => Some(Cut::Pool),
            _ => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(sh) = self.pool.upgrade() {
            sh.handshakes.leave(self.id);
        }
    }
}

fn lock(m: &Mutex<Pool>) -> std::sync::MutexGuard<'_, Pool> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Handshakes {
    pub(crate) fn new(max: usize, per_source: usize) -> Handshakes {
        Handshakes {
            max: max.max(1),
            per_source: per_source.max(1),
            inner: Mutex::new(Pool::default()),
        }
    }

    /// Connections in their handshake now.
    pub(crate) fn len(&self) -> usize {
        lock(&self.inner).live.len()
    }

    /// Take a place for a new connection on `socket` from `source`,
    /// cutting the oldest handshake of its source (when that source has
    /// its share) or of the source holding the most (when the pool is
    /// full). `None`: the socket could not be duplicated (out of fds).
    pub(crate) fn admit(
        &self,
        shared: &Arc<crate::Shared>,
        source: Source,
        socket: &impl AsFd,
    ) -> Option<(Ticket, Option<(Cut, Source)>)> {
        let fd = socket.as_fd().try_clone_to_owned().ok()?;
        let cut = Arc::new(AtomicU8::new(0));
        let mut p = lock(&self.inner);
        let mut from_source = 0;
        let mut counts: HashMap<Source, usize> = HashMap::new();
        for q in p.live.values() {
            *counts.entry(q.source).or_default() += 1;
            if q.source == source {
                from_source += 1;
            }
        }
        let victim = if from_source >= self.per_source {
            Some((Cut::Source, source))
        } else if p.live.len() >= self.max {
            // The source with the most (ties: the one with the oldest).
            let most = counts.values().copied().max().unwrap_or(0);
            p.live
                .values()
                .filter(|q| counts.get(&q.source) == Some(&most))
                .min_by_key(|q| q.since)
                .map(|q| (Cut::Pool, q.source))
        } else {
            None
        };
        let evicted = victim.and_then(|(why, src)| {
            let id = p
                .live
                .iter()
                .filter(|(_, q)| q.source == src)
                .min_by_key(|(id, q)| (q.since, **id))
                .map(|(id, _)| *id)?;
            let q = p.live.remove(&id)?;
            q.cut.store(why as u8, Ordering::SeqCst);
            // Its thread sees the end of the stream at its next read and
            // answers Busy itself (only it writes on its socket).
            let _ = rustix::net::shutdown(&q.fd, rustix::net::Shutdown::Read);
            Some((why, src))
        });
        let id = p.next;
        p.next += 1;
        p.live.insert(
            id,
            Pending {
                source,
                since: Instant::now(),
                fd,
                cut: cut.clone(),
            },
        );
        drop(p);
        Some((
            Ticket {
                id,
                source,
                cut,
                pool: Arc::downgrade(shared),
            },
            evicted,
        ))
    }

    /// The connection of `ticket` proved itself: it leaves the pool.
    /// `false`: it had been cut meanwhile.
    pub(crate) fn prove(&self, ticket: &Ticket) -> bool {
        lock(&self.inner).live.remove(&ticket.id).is_some()
    }

    fn leave(&self, id: u64) {
        let gone = lock(&self.inner).live.remove(&id);
        drop(gone);
    }
}

/// Listen on TCP at `addr` with a deep accept queue (the system's most,
/// `net.core.somaxconn`, rather than std's 128): under a flood of connects
/// a client's connect then waits its turn in the queue instead of having
/// its SYN dropped and resent a second (then three, then seven) later.
pub(crate) fn bind_tcp(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use rustix::net::{bind, listen, socket_with, sockopt, AddressFamily, SocketFlags, SocketType};
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let fd = socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    // As std does: a restarted unit may bind its port again at once.
    sockopt::set_socket_reuseaddr(&fd, true)?;
    bind(&fd, &addr)?;
    // The kernel takes at most net.core.somaxconn (4096 by default).
    listen(&fd, 4096)?;
    Ok(std::net::TcpListener::from(fd))
}

/// Raise this process's soft limit on open files to its hard limit, and
/// warn when even that is too low for `need` descriptors. Returns the
/// limits (soft, hard) after, when they are known.
pub(crate) fn raise_nofile(name: &str, need: u64) -> Option<(u64, u64)> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let hard = lim.maximum.unwrap_or(u64::MAX);
    let soft = lim.current.unwrap_or(u64::MAX);
    let mut now = soft;
    if soft < hard {
        let raised = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            },
        );
        match raised {
            Ok(()) => {
                now = hard;
                tracing::info!(unit = %name, from = soft, to = hard, "raised the open-file limit (RLIMIT_NOFILE) to its hard limit");
            }
            Err(e) => {
                tracing::warn!(unit = %name, soft, hard, error = %e, "could not raise the open-file limit (RLIMIT_NOFILE)");
            }
        }
    }
    if now < need {
        tracing::warn!(
            unit = %name,
            limit = now,
            need,
            "the open-file limit (RLIMIT_NOFILE) is below what this unit's connection caps may take \
             (3 per connection and per handshake, and 64 for the disk tier, pidfds and checkpoints): \
             past it, accepts, spills and checkpoints fail. Raise the hard limit (ulimit -Hn, \
             LimitNOFILE= in a systemd unit, --ulimit nofile= for a container) or lower \
             --max-connections and --max-handshakes"
        );
    }
    Some((now, hard))
}

/// Descriptors a unit may take at its caps: a served connection holds its
/// socket, its writer's handle and, for a peer that maps the slab, its
/// session's pidfd; a handshake its socket, its writer's handle and the
/// pool's handle; plus the disk tier, checkpoints and listeners.
pub(crate) fn fds_needed(max_connections: usize, max_handshakes: usize) -> u64 {
    3 * (max_connections as u64 + max_handshakes as u64) + 64
}

/// The uid that owns the socket at `peer` connected to our `local`, both
/// on loopback: asked of the kernel (`NETLINK_SOCK_DIAG`, one exact
/// lookup). `None` when the kernel does not say.
fn loopback_peer_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    sock_diag::owner_uid(peer, local)
}

mod sock_diag {
    //! One `SOCK_DIAG_BY_FAMILY` request for one TCP socket, by its four
    //! addresses; the kernel answers with its `inet_diag_msg`, whose
    //! `idiag_uid` is the socket's owner.
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use rustix::net::netlink::{self, SocketAddrNetlink};
    use rustix::net::{
        recv, sendto, socket_with, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType,
    };

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    const IPPROTO_TCP: u8 = 6;
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;
    /// nlmsghdr (16) + inet_diag_req_v2 (56).
    const REQ_LEN: usize = 16 + 56;
    /// Offset of idiag_uid in the answer: nlmsghdr (16) + family, state,
    /// timer, retrans (4) + sockid (48) + expires, rqueue, wqueue (12).
    const UID_AT: usize = 16 + 4 + 48 + 12;

    /// An address as the kernel keeps it: IPv4 peers of an IPv4 socket
    /// stay IPv4; a v4-mapped address of an IPv6 socket stays IPv6.
    fn family_of(a: &SocketAddr) -> u8 {
        match a.ip() {
            IpAddr::V4(_) => AF_INET,
            IpAddr::V6(_) => AF_INET6,
        }
    }

    fn addr_bytes(a: &SocketAddr) -> [u8; 16] {
        let mut b = [0u8; 16];
        match a.ip() {
            IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
            IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
        }
        b
    }

    pub(super) fn owner_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
        if family_of(&peer) != family_of(&local) {
            return None;
        }
        // The peer's socket: its source is our peer, its destination us.
        let (src, dst) = (peer, local);
        let mut req = [0u8; REQ_LEN];
        req[0..4].copy_from_slice(&(REQ_LEN as u32).to_ne_bytes());
        req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        req[8..12].copy_from_slice(&1u32.to_ne_bytes()); // sequence
        let r = &mut req[16..];
        r[0] = family_of(&src);
        r[1] = IPPROTO_TCP;
        r[2] = 0; // ext
        r[3] = 0; // pad
        r[4..8].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
                                                          // inet_diag_sockid: ports big-endian, then addresses, if, cookie.
        r[8..10].copy_from_slice(&src.port().to_be_bytes());
        r[10..12].copy_from_slice(&dst.port().to_be_bytes());
        r[12..28].copy_from_slice(&addr_bytes(&src));
        r[28..44].copy_from_slice(&addr_bytes(&dst));
        r[44..48].copy_from_slice(&0u32.to_ne_bytes()); // interface
        r[48..56].copy_from_slice(&[0xff; 8]); // no cookie
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::SOCK_DIAG),
        )
        .ok()?;
        rustix::net::sockopt::set_socket_timeout(
            &fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_millis(100)),
        )
        .ok()?;
        let kernel = SocketAddrNetlink::new(0, 0);
        sendto(&fd, &req, SendFlags::empty(), &kernel).ok()?;
        let mut buf = [0u8; 512];
        let (n, _) = recv(&fd, &mut buf[..], RecvFlags::empty()).ok()?;
        let msg = buf.get(..n)?;
        let kind = u16::from_ne_bytes(msg.get(4..6)?.try_into().ok()?);
        if kind == NLMSG_ERROR || kind != SOCK_DIAG_BY_FAMILY {
            return None;
        }
        let uid = msg.get(UID_AT..UID_AT + 4)?;
        Some(u32::from_ne_bytes(uid.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_tcp_peer_is_known_by_its_user() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let me = rustix::process::getuid().as_raw();
        let src = Source::of_tcp(peer, s.local_addr().ok());
        // Kernels without inet_diag do not say: the address stands in.
        assert!(
            src == Source::Uid(me) || src == Source::Ip(peer.ip()),
            "{src:?}"
        );
        drop(c);
    }

    #[test]
    fn ipv6_peers_are_grouped_by_their_network() {
        let a = Source::of_tcp("[2001:db8::1]:5".parse().unwrap(), None);
        let b = Source::of_tcp("[2001:db8::ffff:2]:6".parse().unwrap(), None);
        let c = Source::of_tcp("[2001:db8:0:1::1]:6".parse().unwrap(), None);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let v4 = Source::of_tcp("[::ffff:10.1.2.3]:7".parse().unwrap(), None);
        assert_eq!(v4, Source::Ip("10.1.2.3".parse().unwrap()));
    }
}
