//! The connection's request ring against a fake unit: a thread that says
//! Hello with a slab, serves its socket and, when asked, a ring.

use super::*;
use std::io::BufRead;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};

use stowage_wire::{Item, Key, PinId};

/// How the fake unit behaves.
#[derive(Clone, Copy, Default)]
struct Mode {
    /// Serve OpenRing (otherwise: answer an error, as a unit without
    /// rings does).
    rings: bool,
    /// A reply too large or with a payload goes on the socket before its
    /// OnSocket marker is posted (otherwise after).
    socket_first: bool,
    /// Answer the first ring request with an entry that is not a frame.
    garbage: bool,
    /// End the connection at the first ring request, without answering.
    die: bool,
    /// Never answer ring requests.
    silent: bool,
}

/// What the fake unit saw.
#[derive(Debug, Default)]
struct Seen {
    socket: usize,
    ring: usize,
    opens: usize,
    kicks: usize,
}

static PEERS: AtomicUsize = AtomicUsize::new(0);

fn spawn_peer(mode: Mode) -> (PathBuf, std::thread::JoinHandle<Seen>) {
    let dir = std::env::temp_dir().join(format!(
        "stowage-ring-client-{}-{}",
        std::process::id(),
        PEERS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("unit.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let t = std::thread::spawn(move || {
        let seen = peer(listener, mode);
        let _ = std::fs::remove_dir_all(&dir);
        seen
    });
    (path, t)
}

/// The fake unit's answer to a request: a reply and its payload, or
/// nothing (no reply).
fn answer(req: Request) -> Option<(Response, Vec<u8>)> {
    Some(match req {
        Request::List { partition } => (
            Response::Listed {
                rows: vec![(7, vec![partition])],
            },
            Vec::new(),
        ),
        Request::Read { keys, .. } => (
            Response::Data {
                items: keys
                    .iter()
                    .map(|_| {
                        Some(Item {
                            len: 3,
                            meta: Default::default(),
                        })
                    })
                    .collect(),
                corrupt: vec![],
            },
            b"abc".repeat(keys.len()),
        ),
        Request::Unpin { reply: false, .. } => return None,
        Request::Unpin { reply: true, .. } => (Response::Done, Vec::new()),
        _ => (
            Response::Error {
                code: ErrorCode::InvalidRequest,
                message: "not served here".into(),
            },
            Vec::new(),
        ),
    })
}

fn frame(id: u64, r: &Response, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode(id, r, payload.len() as u64, &mut out).unwrap();
    out.extend_from_slice(payload);
    out
}

fn peer(listener: UnixListener, mode: Mode) -> Seen {
    let (sock, _) = listener.accept().unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(sock.try_clone().unwrap());
    let mut w = sock.try_clone().unwrap();
    let slab = Slab::create("peer", 1 << 20).unwrap();
    let limits = Limits::default();
    let mut ring: Option<Ring> = None;
    let mut seen = Seen::default();
    let mut entry = Vec::new();
    let stop = Instant::now() + Duration::from_secs(60);
    while Instant::now() < stop {
        if let Some(r) = &ring {
            if r.take_request(&mut entry).unwrap() {
                seen.ring += 1;
                let (f, _) = stowage_wire::decode_frame::<Request>(&entry, &limits)
                    .unwrap()
                    .unwrap();
                let id = f.envelope.id;
                if mode.die {
                    return seen;
                }
                if mode.silent {
                    continue;
                }
                if mode.garbage {
                    r.post_reply(b"not a frame at all").unwrap();
                    continue;
                }
                let Some((resp, payload)) = answer(f.envelope.body) else {
                    continue;
                };
                let bytes = frame(id, &resp, &[]);
                // Every fifth reply goes on the socket too, as large ones
                // would.
                if payload.is_empty() && seen.ring % 5 != 0 && bytes.len() <= r.reply_room() {
                    r.post_reply(&bytes).unwrap();
                } else {
                    let marker = frame(id, &Response::OnSocket, &[]);
                    if mode.socket_first {
                        w.write_all(&frame(id, &resp, &payload)).unwrap();
                        if seen.ring < 40 {
                            // Late enough that the client, done waiting
                            // on the ring, reads the reply off the socket
                            // first and then meets its marker.
                            std::thread::sleep(RING_SOCKET_CHECK * 2);
                        }
                        r.post_reply(&marker).unwrap();
                    } else {
                        r.post_reply(&marker).unwrap();
                        w.write_all(&frame(id, &resp, &payload)).unwrap();
                    }
                }
                continue;
            }
            if !r.park() {
                continue;
            }
        }
        if reader.buffer().is_empty() {
            use rustix::event::{PollFd, PollFlags};
            let mut fds = [PollFd::new(&sock, PollFlags::IN)];
            let t = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            if rustix::event::poll(&mut fds, Some(&t)).unwrap_or(0) == 0 {
                continue;
            }
        }
        if reader.fill_buf().map(|b| b.is_empty()).unwrap_or(true) {
            break; // the client is gone
        }
        let Ok(Some(prefix)) = read_prefix(&mut reader, &limits) else {
            break;
        };
        let mut scratch = Vec::new();
        let env: Envelope<Request> = read_header(&mut reader, &prefix, &mut scratch).unwrap();
        match env.body {
            Request::Hello { .. } => {
                let hello = Response::Hello {
                    version: PROTOCOL_VERSION,
                    instance_id: 1,
                    slab_bytes: slab.len(),
                    fd_attached: true,
                    session: 2,
                };
                let bytes = frame(env.id, &hello, &[]);
                let n = stowage_shm::send_with_fd(&w, &bytes, slab.fd()).unwrap();
                w.write_all(&bytes[n..]).unwrap();
            }
            Request::RingKick => seen.kicks += 1,
            Request::OpenRing { bytes } => {
                seen.opens += 1;
                if mode.rings {
                    let (r, fd) = Ring::create(bytes as usize).unwrap();
                    // A new ring starts parked: the first request kicks.
                    assert!(r.park());
                    let reply = frame(env.id, &Response::Ring { bytes }, &[]);
                    let n = stowage_shm::send_with_fd(&w, &reply, fd.as_fd()).unwrap();
                    w.write_all(&reply[n..]).unwrap();
                    ring = Some(r);
                } else {
                    let no = Response::Error {
                        code: ErrorCode::InvalidRequest,
                        message: "unexpected request OpenRing".into(),
                    };
                    w.write_all(&frame(env.id, &no, &[])).unwrap();
                }
            }
            other => {
                seen.socket += 1;
                if let Some((resp, payload)) = answer(other) {
                    w.write_all(&frame(env.id, &resp, &payload)).unwrap();
                }
            }
        }
    }
    seen
}

use std::os::fd::AsFd;

fn connect(path: &std::path::Path) -> Conn {
    Conn::connect(
        &UnitAddr::Unix(path.to_owned()),
        "ns",
        true,
        None,
        None,
        Duration::from_micros(20),
        None,
        Instant::now() + Duration::from_secs(10),
    )
    .unwrap()
}

/// `n` calls of each kind a connection makes: Lists (answered in the
/// ring or on the socket), Reads (their payload always on the socket) and
/// Unpins without reply; every answer checked.
fn workload(c: &mut Conn, n: u64) {
    for i in 0..n {
        let d = Instant::now() + Duration::from_secs(10);
        if i % 7 == 3 {
            let unpin = Request::Unpin {
                pin: PinId(i),
                reply: false,
            };
            c.send(&unpin, &mut [], d).unwrap();
        }
        if i % 10 == 9 {
            let read = Request::Read {
                partition: "p".into(),
                keys: vec![Key::new(i, "f"), Key::new(i, "g")],
                timeout_ms: 1000,
            };
            let id = c.send(&read, &mut [], d).unwrap();
            match c.recv(id, d).unwrap() {
                Response::Data { items, .. } => assert_eq!(items.len(), 2),
                other => panic!("{other:?}"),
            }
            let mut got = [0u8; 6];
            c.read_payload(&mut got, d).unwrap();
            assert_eq!(&got, b"abcabc");
        } else {
            let list = Request::List {
                partition: format!("p{i}"),
            };
            let id = c.send(&list, &mut [], d).unwrap();
            assert_eq!(
                c.recv(id, d).unwrap(),
                Response::Listed {
                    rows: vec![(7, vec![format!("p{i}")])]
                }
            );
        }
    }
}

fn on_ring(c: &Conn) -> bool {
    matches!(c.ring, RingState::On(_))
}

#[test]
fn requests_move_to_the_ring_after_sixteen_round_trips() {
    for socket_first in [false, true] {
        let (path, peer) = spawn_peer(Mode {
            rings: true,
            socket_first,
            ..Mode::default()
        });
        let mut c = connect(&path);
        workload(&mut c, 300);
        assert!(on_ring(&c));
        // A request too large for the ring goes on the socket.
        let d = Instant::now() + Duration::from_secs(10);
        let long = "x".repeat(RING_BYTES);
        let id = c
            .send(
                &Request::List {
                    partition: long.clone(),
                },
                &mut [],
                d,
            )
            .unwrap();
        assert_eq!(
            c.recv(id, d).unwrap(),
            Response::Listed {
                rows: vec![(7, vec![long])]
            }
        );
        drop(c);
        let seen = peer.join().unwrap();
        assert_eq!(seen.opens, 1, "{seen:?}");
        // 16 round trips before the ring (and the Unpins among them), and
        // the long request.
        assert!((17..=21).contains(&seen.socket), "{seen:?}");
        assert!(seen.ring >= 300 - 16, "{seen:?}");
        // A new ring is parked: the first request kicked it at least.
        assert!(seen.kicks >= 1, "{seen:?}");
    }
}

#[test]
fn a_unit_without_rings_is_asked_once_and_keeps_the_socket() {
    let (path, peer) = spawn_peer(Mode::default());
    let mut c = connect(&path);
    workload(&mut c, 100);
    assert!(!on_ring(&c));
    drop(c);
    let seen = peer.join().unwrap();
    assert_eq!(seen.opens, 1, "{seen:?}");
    assert_eq!(seen.ring, 0, "{seen:?}");
    assert!(seen.socket >= 100, "{seen:?}");
}

/// Past its sixteen round trips, a connection asks for the ring at its
/// next request; then fails as the unit makes it fail.
fn with_ring(mode: Mode) -> (Conn, std::thread::JoinHandle<Seen>) {
    let (path, peer) = spawn_peer(Mode {
        rings: true,
        ..mode
    });
    let mut c = connect(&path);
    workload(&mut c, RING_AFTER as u64);
    (c, peer)
}

fn list(c: &mut Conn, deadline: Instant) -> Result<Response, ConnError> {
    let id = c.send(
        &Request::List {
            partition: "x".into(),
        },
        &mut [],
        deadline,
    )?;
    assert!(on_ring(c));
    c.recv(id, deadline)
}

#[test]
fn an_entry_that_is_not_a_frame_is_a_protocol_error() {
    let (mut c, peer) = with_ring(Mode {
        garbage: true,
        ..Mode::default()
    });
    let r = list(&mut c, Instant::now() + Duration::from_secs(10));
    assert!(matches!(r, Err(ConnError::Protocol(_))), "{r:?}");
    drop(c);
    peer.join().unwrap();
}

#[test]
fn a_unit_that_ends_while_a_request_waits_on_the_ring_is_noticed() {
    let (mut c, peer) = with_ring(Mode {
        die: true,
        ..Mode::default()
    });
    // Long before this deadline: the socket says the unit is gone.
    let r = list(&mut c, Instant::now() + Duration::from_secs(60));
    assert!(matches!(r, Err(ConnError::Broken(_))), "{r:?}");
    peer.join().unwrap();
}

#[test]
fn a_ring_request_unanswered_times_out_at_its_deadline() {
    let (mut c, peer) = with_ring(Mode {
        silent: true,
        ..Mode::default()
    });
    let deadline = Instant::now() + Duration::from_millis(200);
    let r = list(&mut c, deadline);
    assert!(matches!(r, Err(ConnError::Timeout)), "{r:?}");
    assert!(Instant::now() >= deadline);
    drop(c);
    let seen = peer.join().unwrap();
    assert_eq!(seen.ring, 1, "{seen:?}");
}

#[test]
fn rings_are_off_only_when_the_environment_says_0() {
    assert!(rings_from_env(None));
    assert!(rings_from_env(Some("1")));
    assert!(!rings_from_env(Some("0")));
    assert!(!rings_from_env(Some(" 0 ")));
}
