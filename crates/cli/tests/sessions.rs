//! A unit serves thousands of client sessions from a fixed set of
//! threads: each session is a connection's state, not a thread. Real
//! unit processes, raw protocol connections.

mod common;

use std::time::Duration;

use common::*;
use stowage_client::Key;
use stowage_wire::{Request, Response};

const MIB: u64 = 1 << 20;

/// More sessions than the thread-per-connection unit could hold (it
/// refused connections past 1,024), each its own connection: all are
/// served, by at most twice the cores and 16 threads, and a client's put
/// and get go through meanwhile.
#[test]
fn thousands_of_sessions_are_served_by_a_fixed_set_of_threads() {
    const SESSIONS: usize = 2000;
    assert!(
        raise_nofile() >= SESSIONS as u64 + 200,
        "this test needs {} open files",
        SESSIONS + 200
    );
    let (p, _) = plane(1, 64 * MIB, &[]);
    let pid = p.units[0].pid();
    let sock = p.units[0].uds.clone();
    let mut sessions: Vec<Raw> = (0..SESSIONS).map(|_| Raw::hello(&sock, "ns")).collect();
    for (i, r) in sessions.iter_mut().enumerate() {
        let resp = r.call(&Request::List {
            partition: "p".into(),
        });
        assert!(
            matches!(resp, Response::Listed { .. }),
            "session {i}: {resp:?}"
        );
    }
    let threads = proc_status(pid, "Threads");
    assert!(
        threads <= thread_bound(),
        "the unit runs {threads} threads for {SESSIONS} sessions"
    );
    for kind in [Kind::Shm, Kind::Tcp] {
        let c = client(&p, kind, Duration::from_secs(5));
        let v = vec![3u8; 4096];
        c.put_rows(&[(Key::new(5, "f"), &v)], c.deadline()).unwrap();
        assert_eq!(
            c.get_rows(&[Key::new(5, "f")], c.deadline()).unwrap(),
            vec![v],
            "{kind:?}"
        );
    }
    // Every session is still served, in turn.
    for (i, r) in sessions.iter_mut().enumerate().rev() {
        let resp = r.call(&Request::List {
            partition: "p".into(),
        });
        assert!(
            matches!(resp, Response::Listed { .. }),
            "session {i}: {resp:?}"
        );
    }
}

/// The session cap (`--max-sessions`) turns a new session away Busy,
/// with the cap named; sessions that end make room again.
#[test]
fn past_the_session_cap_a_new_session_is_told_busy() {
    let (p, _) = plane(1, 16 * MIB, &["--max-sessions", "3"]);
    let sock = p.units[0].uds.clone();
    let mut held: Vec<Raw> = (0..3).map(|_| Raw::hello(&sock, "ns")).collect();
    let mut r = Raw::connect(&sock);
    let resp = r.call(&Request::Hello {
        version: stowage_wire::PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd: false,
        session: None,
    });
    match resp {
        Response::Error { code, message } => {
            assert_eq!(code, stowage_wire::ErrorCode::Busy);
            assert!(message.contains("max-sessions"), "{message}");
        }
        other => panic!("a fourth session was let in: {other:?}"),
    }
    assert!(r.closed());
    // One ends (it held nothing): a new one gets in.
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mut r = Raw::connect(&sock);
        let resp = r.call(&Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: false,
            session: None,
        });
        if matches!(resp, Response::Hello { .. }) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no room after a session ended: {resp:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fair service: a session that pipelines requests as fast as it can and
/// never reads its replies is served a quantum at a time, then waits for
/// its socket; another session's puts and gets go through meanwhile, and
/// the flooder is cut once its replies have waited past the frame timeout.
#[test]
fn a_session_that_never_reads_its_replies_starves_no_one() {
    use std::io::Write;
    let (p, _) = plane(1, 16 * MIB, &["--frame-timeout", "2s"]);
    let sock = p.units[0].uds.clone();
    let mut flooder = Raw::hello(&sock, "ns");
    let mut frame = Vec::new();
    for id in 0..20_000u64 {
        stowage_wire::encode(
            1000 + id,
            &Request::List {
                partition: "p".into(),
            },
            0,
            &mut frame,
        )
        .unwrap();
    }
    flooder
        .s
        .set_write_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let writer = std::thread::spawn(move || {
        // Until the unit stops reading (its replies are not taken) or cuts it.
        let _ = flooder.s.write_all(&frame);
        flooder
    });
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    let v = vec![4u8; 4096];
    for i in 0..200u64 {
        c.put_rows(&[(Key::new(i, "f"), &v)], c.deadline()).unwrap();
        assert_eq!(
            c.get_rows(&[Key::new(i, "f")], c.deadline()).unwrap(),
            vec![v.clone()]
        );
    }
    let mut flooder = writer.join().unwrap();
    // Its replies were never taken: cut at the frame timeout (2 s). Read
    // what it was sent only after that: the unit ends the stream before
    // every request was answered.
    std::thread::sleep(Duration::from_secs(3));
    flooder
        .s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut answered = 0;
    while let Some(e) = flooder.recv() {
        assert!(matches!(e.body, Response::Listed { .. }), "{:?}", e.body);
        answered += 1;
    }
    // The end of the stream, not a read timing out.
    assert!(
        flooder.closed(),
        "a session that never read its replies kept its connection"
    );
    assert!(
        answered < 20_000,
        "a session that never read its replies was answered in full"
    );
}
