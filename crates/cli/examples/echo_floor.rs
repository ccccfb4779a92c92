//! The floor under `bench/client_procs.py`: the least a server can do for
//! a synchronous request and its reply over a Unix socket, so the op rate
//! of many client processes on few cores can be compared with what the
//! host allows at all (issue 37: Python clients beyond the cores).
//!
//! One thread, one epoll set, non-blocking stream sockets; a request is an
//! 8-byte header (`op: u32`, `len: u32`, little-endian) and `len` bytes:
//! op 1 (a put's shape) is answered with an 8-byte header, op 2 (a get's)
//! with a header and `len` bytes of zeros. Nothing is stored: the cost left
//! is the system calls, the wake-ups and the scheduling of the clients.
//!
//! ```text
//! cargo build --release -p stowage-cli --example echo_floor
//! target/release/examples/echo_floor /tmp/floor.sock
//! ```

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};

use rustix::event::epoll;

const LISTENER: u64 = u64::MAX;

struct Peer {
    sock: UnixStream,
    /// Bytes of the request being read.
    inbuf: Vec<u8>,
    /// Reply bytes not written yet.
    out: Vec<u8>,
}

impl Peer {
    /// Read what is there; answer each whole request. `Ok(false)`: closed.
    fn serve(&mut self) -> io::Result<bool> {
        let mut chunk = [0u8; 64 << 10];
        loop {
            match self.sock.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => self.inbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let mut at = 0;
        while self.inbuf.len() - at >= 8 {
            let op = u32::from_le_bytes(self.inbuf[at..at + 4].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(self.inbuf[at + 4..at + 8].try_into().expect("4 bytes"));
            let body = if op == 1 { len as usize } else { 0 };
            if self.inbuf.len() - at < 8 + body {
                break;
            }
            at += 8 + body;
            let reply = if op == 2 { len } else { 0 };
            self.out.extend_from_slice(&op.to_le_bytes());
            self.out.extend_from_slice(&reply.to_le_bytes());
            self.out.resize(self.out.len() + reply as usize, 0);
        }
        self.inbuf.drain(..at);
        self.flush()?;
        Ok(true)
    }

    fn flush(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            match self.sock.write(&self.out) {
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The client reads its whole reply before it asks
                    // again: wait for room rather than keep state.
                    std::thread::yield_now();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn main() -> io::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| io::Error::other("usage: echo_floor SOCKET_PATH"))?;
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    listener.set_nonblocking(true)?;
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
    epoll::add(
        &ep,
        &listener,
        epoll::EventData::new_u64(LISTENER),
        epoll::EventFlags::IN,
    )?;
    let mut peers: HashMap<u64, Peer> = HashMap::new();
    let mut next = 0u64;
    let mut events = Vec::with_capacity(256);
    loop {
        events.clear();
        match epoll::wait(&ep, rustix::buffer::spare_capacity(&mut events), None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        for ev in &events {
            let id = ev.data.u64();
            if id == LISTENER {
                while let Ok((sock, _)) = listener.accept() {
                    sock.set_nonblocking(true)?;
                    epoll::add(
                        &ep,
                        &sock,
                        epoll::EventData::new_u64(next),
                        epoll::EventFlags::IN,
                    )?;
                    peers.insert(
                        next,
                        Peer {
                            sock,
                            inbuf: Vec::new(),
                            out: Vec::new(),
                        },
                    );
                    next += 1;
                }
                continue;
            }
            let open = match peers.get_mut(&id) {
                Some(p) => p.serve().unwrap_or(false),
                None => continue,
            };
            if !open {
                if let Some(p) = peers.remove(&id) {
                    let _ = epoll::delete(&ep, &p.sock);
                }
            }
        }
    }
}
