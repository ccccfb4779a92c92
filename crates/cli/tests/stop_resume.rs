//! A process stopped (SIGSTOP) and continued while it waits on a socket
//! read with a timeout: Linux fails such a read with EINTR even when the
//! process has no signal handler (signal(7)). The reads the client and the
//! unit wait in — a frame read through `SpinReader`, the receive of a
//! Hello or ring reply with the slab's fd (`recv_with_fd`) — read again
//! within their deadline instead of failing the call.
//!
//! The waiting side is this test binary re-run as a child process
//! (`stop_resume_child`); the parent stops and continues it while it waits,
//! then sends what it waits for.

mod common;

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use stowage_wire::io::{Socket, SpinReader};

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} failed");
}

/// Not a test on its own: the waiting side. `STOWAGE_STOP_RESUME=path,how`:
/// connects to `path`, prints `READY`, then waits for 8 bytes with a 20 s
/// timeout, `how` = `fd` through `recv_with_fd`, `frame` through a
/// `SpinReader` with a deadline; prints `GOT <n>` or `ERR <error>`.
#[test]
#[ignore = "a helper process of the stop and resume tests"]
fn stop_resume_child() {
    let spec = std::env::var("STOWAGE_STOP_RESUME").expect("run only by the stop-resume tests");
    let (path, how) = spec.split_once(',').unwrap();
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let r = match how {
        "fd" => {
            let mut buf = [0u8; 8];
            stowage_shm::recv_with_fd(&s, &mut buf).map(|(n, _)| n)
        }
        _ => {
            let mut r = SpinReader::new(Socket::Unix(s), Duration::ZERO);
            r.deadline = Some(Instant::now() + Duration::from_secs(20));
            let mut buf = [0u8; 8];
            std::io::Read::read(&mut r, &mut buf)
        }
    };
    match r {
        Ok(n) => println!("GOT {n}"),
        Err(e) => println!("ERR {e}"),
    }
    std::io::stdout().flush().unwrap();
}

fn stopped_and_continued_while_waiting(how: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let listener = UnixListener::bind(&path).unwrap();
    let spec = format!("{},{how}", path.display());
    let mut child = helper_child("stop_resume_child", ("STOWAGE_STOP_RESUME", &spec));
    let lines = stdout_lines(&mut child);
    let reap = Reap(child);
    let pid = reap.0.id();
    let (peer, _) = listener.accept().unwrap();
    // libtest prints its own lines before the child's.
    let end = Instant::now() + Duration::from_secs(30);
    while !lines
        .recv_timeout(end.saturating_duration_since(Instant::now()))
        .expect("the child says READY")
        .contains("READY")
    {}
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(150)); // blocked in its read
        signal(pid, "-STOP");
        assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
        std::thread::sleep(Duration::from_millis(50));
        signal(pid, "-CONT");
    }
    std::thread::sleep(Duration::from_millis(100));
    match how {
        "fd" => {
            use std::os::fd::AsFd;
            stowage_shm::send_with_fd(&peer, b"12345678", listener.as_fd()).unwrap();
        }
        _ => (&peer).write_all(b"12345678").unwrap(),
    }
    let end = Instant::now() + Duration::from_secs(30);
    let got = loop {
        let left = end.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains("GOT") || l.contains("ERR") => break l,
            Ok(_) => {}
            Err(e) => panic!("the child printed no result ({e})"),
        }
    };
    assert!(got.contains("GOT 8"), "{how}: {got}");
    drop(reap);
}

#[test]
fn a_receive_with_an_fd_survives_a_stop_and_resume() {
    stopped_and_continued_while_waiting("fd");
}

#[test]
fn a_frame_read_survives_a_stop_and_resume() {
    stopped_and_continued_while_waiting("frame");
}
