//! The metrics' tests.

use super::*;
use std::time::Duration;
use stowage_wire::ErrorCode;

#[test]
fn histogram_buckets_by_upper_bound() {
    let h = Histogram::new(&LATENCY_BOUNDS);
    h.observe(Duration::from_micros(10)); // le 10 µs
    h.observe(Duration::from_micros(11)); // le 25 µs
    h.observe(Duration::from_secs(60)); // +Inf
    assert_eq!(h.buckets[0].load(Relaxed), 1);
    assert_eq!(h.buckets[1].load(Relaxed), 1);
    assert_eq!(h.buckets[LATENCY_BOUNDS.len()].load(Relaxed), 1);
    assert_eq!(h.count(), 3);
}

#[test]
fn totals_count_open_and_closed_connections_once() {
    let m = UnitMetrics::default();
    let c = Arc::new(PathCounters::default());
    lock(&m.live).push(c.clone());
    c.op(Op::Put, true, Duration::from_micros(10));
    c.op(Op::Put, false, Duration::from_micros(30));
    c.count(Op::Unpin, true);
    c.bytes_in(Transport::Shm, 5);
    c.bytes_out(Transport::Tcp, 7);
    let check = |m: &UnitMetrics| {
        let t = m.path_totals();
        assert_eq!(t.answered[Op::Put as usize], [1, 1]);
        assert_eq!(t.answered[Op::Unpin as usize], [1, 0]);
        assert_eq!(t.latency[Op::Put as usize].0[..3], [1, 0, 1]);
        assert_eq!(t.latency[Op::Put as usize].1, 40_000);
        assert_eq!(m.traffic(), (3, 5, 7));
    };
    check(&m);
    // What a thread ending does (ThreadCounters::drop).
    {
        let mut live = lock(&m.live);
        c.add_to(&m.closed);
        live.retain(|x| !Arc::ptr_eq(x, &c));
    }
    check(&m);
}

#[test]
fn every_op_has_a_name() {
    assert_eq!(Op::ForwardPut as usize, OPS - 1);
    assert_eq!(OP_NAMES[Op::ForwardPut as usize], "forward_put");
    assert_eq!(OP_NAMES[Op::RepairPut as usize], "repair_put");
    assert_eq!(OP_NAMES[Op::Claim as usize], "claim");
    assert_eq!(OP_NAMES.len(), OPS);
    assert_eq!(code_index(ErrorCode::Stale), CODES - 1);
    assert_eq!(CODE_NAMES[code_index(ErrorCode::Fenced)], "fenced");
    assert_eq!(CODE_NAMES[code_index(ErrorCode::Stale)], "stale");
}
