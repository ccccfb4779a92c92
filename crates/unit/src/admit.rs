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
//! kernel's SO_PEERCRED) and for a TCP peer on this host (the owner of
//! the peer's socket, which the kernel tells through `NETLINK_SOCK_DIAG`:
//! another local user does not share a source with the job by connecting
//! over loopback, from any 127.x address, nor by dialling one of the
//! host's own addresses, e.g. the node IP a unit listens on in a multi-node
//! Ray cluster); otherwise the peer's address (an IPv6 peer's /64 network).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Where a connection comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// A local user (a Unix-socket peer, or a same-host TCP peer whose
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
    /// The source of a TCP peer at `peer`, connected to `local`: the user
    /// that owns the peer's socket when the peer is on this host (its
    /// address is loopback, or the very address it dialled: a client on
    /// the host dialling one of the host's addresses, as with
    /// `listen.host = "node-ip"`, comes from that address), asked of the
    /// kernel in one `NETLINK_SOCK_DIAG` query; otherwise, or when the
    /// kernel does not name it, the peer's address.
    pub(crate) fn of_tcp(peer: SocketAddr, local: Option<SocketAddr>) -> Source {
        let ip = peer.ip().to_canonical();
        if let Some(local) = local.filter(|l| same_host(peer.ip(), l.ip())) {
            match sock_diag::owner_uid(peer, local) {
                Ok(Some(uid)) => return Source::Uid(uid),
                Ok(None) => unknown_local_peer(peer, local, None),
                Err(e) => unknown_local_peer(peer, local, Some(e)),
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

/// Whether a TCP peer at `peer` that reached us at `local` is on this
/// host: its address is loopback, or is the address it dialled (a host
/// sends to its own addresses from that address).
pub(crate) fn same_host(peer: IpAddr, local: IpAddr) -> bool {
    let (peer, local) = (peer.to_canonical(), local.to_canonical());
    peer.is_loopback() || (peer == local && !peer.is_unspecified())
}

/// Whether the kernel here names the owners of TCP sockets (asked once).
static DIAG_WORKS: OnceLock<bool> = OnceLock::new();
/// Whether the unit warned that it cannot.
static WARNED: AtomicBool = AtomicBool::new(false);

/// The kernel did not name the owner of a same-host peer's socket: warn
/// (once) unless the peer had merely closed it already, which the first
/// time is told apart by asking for the unit's own side of the connection
/// (one more query, once per process).
fn unknown_local_peer(peer: SocketAddr, local: SocketAddr, error: Option<std::io::Error>) {
    let why = match error {
        Some(e) => format!("the query failed: {e}"),
        None => {
            let works = *DIAG_WORKS
                .get_or_init(|| matches!(sock_diag::owner_uid(local, peer), Ok(Some(_))));
            if works {
                // The peer closed its socket before it was asked about.
                return;
            }
            "the kernel knows no TCP socket by its addresses (no inet_diag/tcp_diag module?)"
                .to_string()
        }
    };
    if !WARNED.swap(true, Ordering::SeqCst) {
        tracing::warn!(
            %peer,
            %local,
            reason = %why,
            "cannot tell which local user owns a same-host TCP peer's socket (NETLINK_SOCK_DIAG): \
             such peers are told apart by address only, so every local user connecting over TCP \
             shares one handshake share, and one of them can cut another's handshakes. Load the \
             inet_diag and tcp_diag kernel modules, allow NETLINK_SOCK_DIAG, or have local \
             clients use the Unix socket (warned once)"
        );
    }
}

pub(crate) use crate::metrics::Cut;

/// Count a connection while it is served (past its handshake): one of
/// the unit's served connections, given back when dropped.
pub(crate) struct Counted(pub(crate) Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
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
    pool: std::sync::Weak<Handshakes>,
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
        if let Some(pool) = self.pool.upgrade() {
            pool.leave(self.id);
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
        self: &Arc<Self>,
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
                pool: Arc::downgrade(self),
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
             (1 per connection, 2 per handshake, and 256 for client processes' pidfds, the serving \
             threads, the disk tier and checkpoints): \
             past it, accepts, spills and checkpoints fail. Raise the hard limit (ulimit -Hn, \
             LimitNOFILE= in a systemd unit, --ulimit nofile= for a container) or lower \
             --max-connections and --max-handshakes"
        );
    }
    Some((now, hard))
}

/// Descriptors a unit may take at its caps: a served connection holds its
/// socket (request rings hold none once handed over); a handshake its
/// socket and the pool's handle; plus one pidfd per client process that
/// maps the slab (shared by its sessions), the serving threads' epoll and
/// waker, the disk tier, checkpoints and listeners.
pub(crate) fn fds_needed(max_connections: usize, max_handshakes: usize) -> u64 {
    max_connections as u64 + 2 * max_handshakes as u64 + 256
}

mod sock_diag {
    //! One `SOCK_DIAG_BY_FAMILY` request for one TCP socket, by its four
    //! addresses; the kernel answers with its `inet_diag_msg`, whose
    //! `idiag_uid` is the socket's owner.
    use std::io;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    use std::time::Duration;

    use rustix::fd::OwnedFd;
    use rustix::net::netlink::{self, SocketAddrNetlink};
    use rustix::net::{
        recv, sendto, socket_with, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType,
    };

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    #[cfg(test)]
    const NLM_F_DUMP: u16 = 0x300;
    const NLMSG_ERROR: u16 = 2;
    const ENOENT: i32 = 2;
    const IPPROTO_TCP: u8 = 6;
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;
    /// nlmsghdr (16) + inet_diag_req_v2 (56).
    const REQ_LEN: usize = 16 + 56;
    /// Offset of the answer's inet_diag_sockid: nlmsghdr (16) + family,
    /// state, timer, retrans (4).
    const ID_AT: usize = 16 + 4;
    /// Offset of idiag_uid in the answer: ID_AT + sockid (48) + expires,
    /// rqueue, wqueue (12); idiag_inode follows it.
    const UID_AT: usize = ID_AT + 48 + 12;

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

    /// A request for the TCP sockets from `src` to `dst` (with `flags`).
    fn request(flags: u16, src: SocketAddr, dst: SocketAddr) -> [u8; REQ_LEN] {
        let mut req = [0u8; REQ_LEN];
        req[0..4].copy_from_slice(&(REQ_LEN as u32).to_ne_bytes());
        req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req[6..8].copy_from_slice(&flags.to_ne_bytes());
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
        req
    }

    /// Send `req` to the kernel; its first answer, into `buf`.
    fn ask<'b>(req: &[u8], buf: &'b mut [u8]) -> io::Result<&'b [u8]> {
        let fd: OwnedFd = socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::SOCK_DIAG),
        )?;
        rustix::net::sockopt::set_socket_timeout(
            &fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_millis(100)),
        )?;
        let kernel = SocketAddrNetlink::new(0, 0);
        sendto(&fd, req, SendFlags::empty(), &kernel)?;
        let (n, _) = recv(&fd, &mut *buf, RecvFlags::empty())?;
        Ok(&buf[..n.min(buf.len())])
    }

    fn malformed() -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, "a malformed sock_diag answer")
    }

    /// The socket address at `at` of an answer's sockid of `family`.
    fn addr_at(msg: &[u8], family: u8, port_at: usize, addr_at: usize) -> Option<SocketAddr> {
        let port = u16::from_be_bytes(msg.get(port_at..port_at + 2)?.try_into().ok()?);
        let a = msg.get(addr_at..addr_at + 16)?;
        let ip = match family {
            AF_INET => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&a[..4]).ok()?)),
            AF_INET6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(a).ok()?)),
            _ => return None,
        };
        Some(SocketAddr::new(ip.to_canonical(), port))
    }

    /// The uid that owns the live TCP socket from `src` to `dst` on this
    /// host (the peer's socket: `src` the peer, `dst` our side).
    /// `Ok(None)`: the kernel knows no such socket, or only a closing one
    /// that no process holds any more (a closed socket in TIME_WAIT is
    /// told as root's).
    pub(super) fn owner_uid(src: SocketAddr, dst: SocketAddr) -> io::Result<Option<u32>> {
        if family_of(&src) != family_of(&dst) {
            return Ok(None);
        }
        let mut buf = [0u8; 512];
        let msg = ask(&request(NLM_F_REQUEST, src, dst), &mut buf)?;
        let kind = u16::from_ne_bytes(msg.get(4..6).ok_or_else(malformed)?.try_into().unwrap());
        if kind == NLMSG_ERROR {
            let e = msg.get(16..20).ok_or_else(malformed)?;
            let e = -i32::from_ne_bytes(e.try_into().unwrap());
            return match e {
                ENOENT => Ok(None),
                e => Err(io::Error::from_raw_os_error(e)),
            };
        }
        if kind != SOCK_DIAG_BY_FAMILY {
            return Err(malformed());
        }
        // The socket it names must be the one asked for, not a listener
        // that a lookup of a foreign address and port may fall back to.
        let family = *msg.get(16).ok_or_else(malformed)?;
        let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
        let got_src = addr_at(msg, family, ID_AT, ID_AT + 4);
        let got_dst = addr_at(msg, family, ID_AT + 2, ID_AT + 20);
        if got_src != Some(canon(src)) || got_dst != Some(canon(dst)) {
            return Ok(None);
        }
        let word = |at: usize| -> io::Result<u32> {
            let b = msg.get(at..at + 4).ok_or_else(malformed)?;
            Ok(u32::from_ne_bytes(b.try_into().unwrap()))
        };
        let (uid, inode) = (word(UID_AT)?, word(UID_AT + 4)?);
        if inode == 0 {
            return Ok(None);
        }
        Ok(Some(uid))
    }

    /// Whether the kernel lists this host's IPv4 TCP sockets at all (it
    /// has inet_diag and tcp_diag).
    #[cfg(test)]
    pub(super) fn lists_tcp_sockets() -> io::Result<bool> {
        let any = SocketAddr::from(([0, 0, 0, 0], 0));
        let mut buf = [0u8; 8192];
        let msg = ask(&request(NLM_F_REQUEST | NLM_F_DUMP, any, any), &mut buf)?;
        let kind = u16::from_ne_bytes(msg.get(4..6).ok_or_else(malformed)?.try_into().unwrap());
        Ok(kind == SOCK_DIAG_BY_FAMILY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Why the kernel cannot be asked who owns a socket here, if it
    /// cannot (asked explicitly: a dump of all TCP sockets).
    fn no_sock_diag() -> Option<String> {
        match sock_diag::lists_tcp_sockets() {
            Ok(true) => None,
            Ok(false) => Some("the kernel lists no TCP sockets (no inet_diag/tcp_diag)".into()),
            Err(e) => Some(format!("no NETLINK_SOCK_DIAG here: {e}")),
        }
    }

    /// A peer connected from this process to a listener at `at` has the
    /// source of this process's user.
    fn assert_known_by_its_user(at: SocketAddr) {
        let l = std::net::TcpListener::bind(at).unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let me = rustix::process::getuid().as_raw();
        assert_eq!(
            Source::of_tcp(peer, s.local_addr().ok()),
            Source::Uid(me),
            "peer {peer}, local {:?}",
            s.local_addr()
        );
        drop(c);
    }

    #[test]
    fn a_loopback_tcp_peer_is_known_by_its_user() {
        if let Some(why) = no_sock_diag() {
            eprintln!("skipped: {why}");
            return;
        }
        assert_known_by_its_user("127.0.0.1:0".parse().unwrap());
        assert_known_by_its_user("127.0.0.2:0".parse().unwrap());
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            assert_known_by_its_user("[::1]:0".parse().unwrap());
        }
    }

    /// This network namespace's own IPv4 addresses other than loopback
    /// (the kernel's local routes: `/proc/net/fib_trie`), and its global
    /// IPv6 ones (`/proc/net/if_inet6`).
    fn own_non_loopback_addresses() -> Vec<IpAddr> {
        let mut out = Vec::new();
        let trie = std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default();
        let mut last: Option<IpAddr> = None;
        for line in trie.lines() {
            let t = line.trim();
            if let Some(a) = t.strip_prefix("|-- ") {
                last = a.parse().ok();
            } else if t.starts_with("/32 host LOCAL") {
                if let Some(a) = last.filter(|a| !a.is_loopback() && !out.contains(a)) {
                    out.push(a);
                }
            }
        }
        let v6 = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
        for line in v6.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            // Address, interface index, prefix length, scope (00: global).
            if f.len() >= 4 && f[3] == "00" {
                if let Ok(n) = u128::from_str_radix(f[0], 16) {
                    let a = IpAddr::V6(n.into());
                    if !a.is_loopback() {
                        out.push(a);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_same_host_peer_dialling_a_non_loopback_address_is_known_by_its_user() {
        if let Some(why) = no_sock_diag() {
            eprintln!("skipped: {why}");
            return;
        }
        let addrs = own_non_loopback_addresses();
        if addrs.is_empty() {
            eprintln!("skipped: this network namespace has no address but loopback");
        }
        // Only this namespace's own addresses: nothing leaves the host.
        for a in addrs {
            if std::net::TcpListener::bind(SocketAddr::new(a, 0)).is_err() {
                eprintln!("not bindable here: {a}");
                continue;
            }
            assert_known_by_its_user(SocketAddr::new(a, 0));
        }
    }

    #[test]
    fn a_peer_is_on_this_host_when_loopback_or_from_the_address_it_dialled() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        assert!(same_host(ip("127.0.0.1"), ip("127.0.0.1")));
        assert!(same_host(ip("127.0.0.5"), ip("127.0.0.1")));
        assert!(same_host(ip("::1"), ip("::1")));
        assert!(same_host(ip("::ffff:127.0.0.1"), ip("::ffff:127.0.0.1")));
        // A client on the host dialling the node's address comes from it.
        assert!(same_host(ip("10.0.0.5"), ip("10.0.0.5")));
        assert!(same_host(ip("::ffff:10.0.0.5"), ip("10.0.0.5")));
        assert!(same_host(ip("2001:db8::5"), ip("2001:db8::5")));
        // Anyone else is known by their address.
        assert!(!same_host(ip("10.0.0.6"), ip("10.0.0.5")));
        assert!(!same_host(ip("2001:db8::6"), ip("2001:db8::5")));
        assert!(!same_host(ip("0.0.0.0"), ip("0.0.0.0")));
    }

    #[test]
    fn a_remote_peer_is_not_asked_about_and_a_foreign_socket_is_unknown() {
        // A peer from elsewhere is known by its address (no query).
        let remote = Source::of_tcp(
            "10.9.9.9:40000".parse().unwrap(),
            Some("10.0.0.5:7000".parse().unwrap()),
        );
        assert_eq!(remote, Source::Ip("10.9.9.9".parse().unwrap()));
        if no_sock_diag().is_some() {
            return;
        }
        // A lookup whose source port is a listener's port names no socket
        // (the kernel's fallback to the listener is not taken for it).
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let src = SocketAddr::from(([127, 0, 0, 1], port));
        let dst = SocketAddr::from(([127, 0, 0, 1], 9));
        assert_eq!(sock_diag::owner_uid(src, dst).unwrap(), None);
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
