//! Free memory is usable memory (issue 23), with real unit and client
//! processes: a put goes in whenever the unit's free memory holds it,
//! however that memory is cut (holes between stored values, spares of idle
//! clients) and however small the values; a value larger than the largest
//! free range round-trips byte for byte.
//!
//! The other client processes are this test binary re-run as helpers
//! (`idle_child`, `pin_child`; see common/memory.rs). The compaction tests,
//! and those reading the counters that came with it, are in
//! compaction.rs.

mod common;

use std::time::Duration;

use common::memory::{fill_value, is_value, value_of, Helper, IntoBuffer, IDLE_PUTS};
use common::*;
use stowage_client::{Client, ClientConfig, Error, Key, DEFAULT_PARTITION};
use stowage_local::LocalPlane;

const MIB: usize = 1 << 20;

/// Not a test on its own: an idle client of `idle_clients_...`.
#[test]
#[ignore = "a helper process of the free-memory tests"]
fn idle_child() {
    common::memory::idle_child_main();
}

/// Not a test on its own: the pin holder of `a_value_larger_...`.
#[test]
#[ignore = "a helper process of the free-memory tests"]
fn pin_child() {
    common::memory::pin_child_main();
}

/// A client of unit 0 with spares off: the slab then holds nothing of it
/// but its data, so that the test knows how memory is cut.
fn plain_client(p: &LocalPlane, kind: Kind) -> Client {
    let addr = match kind {
        Kind::Shm => p.uds_addrs(),
        _ => p.tcp_addrs(),
    };
    let mut cfg = ClientConfig::new("free", addr);
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(30);
    cfg.spare_max = 0;
    if kind == Kind::Nixl {
        cfg.nixl = Some(nixl_options());
    }
    let c = Client::connect(cfg).expect("client connects");
    if kind == Kind::Nixl {
        // Connecting is lazy: the transport is known once the unit is reached.
        c.check_units(c.deadline()).expect("the unit answers");
        assert_eq!(c.transport(0), Some("nixl"));
    }
    c
}

fn unit_stats(c: &Client) -> stowage_client::Stats {
    c.stats(c.deadline()).remove(0).expect("stats")
}

/// The counters a failure here is about, without every session's.
fn brief(s: &stowage_client::Stats) -> String {
    format!(
        "capacity {} used {} reserved {} spares {} ({} bytes) entries {} blobs {} pins {}",
        s.capacity, s.used, s.reserved_bytes, s.spares, s.spare_bytes, s.entries, s.blobs, s.pins
    )
}

/// One put per row (value `row`, `len` bytes), in order.
fn put_each(c: &Client, rows: impl IntoIterator<Item = u64>, len: usize) {
    let mut buf = vec![0u8; len];
    for row in rows {
        fill_value(row, &mut buf);
        if let Err(e) = c.put_rows(&[(Key::new(row, "v"), &buf)], c.deadline()) {
            panic!("put of row {row}: {e}; {}", brief(&unit_stats(c)));
        }
    }
}

/// ONE put of every row of `rows` (value `row`, `len` bytes each).
fn put_batch(c: &Client, rows: &[u64], len: usize) -> stowage_client::Result<()> {
    let mut all = vec![0u8; rows.len() * len];
    for (&row, chunk) in rows.iter().zip(all.chunks_mut(len)) {
        fill_value(row, chunk);
    }
    let values: Vec<(Key, &[u8])> = rows
        .iter()
        .zip(all.chunks(len))
        .map(|(&row, bytes)| (Key::new(row, "v"), bytes))
        .collect();
    c.put_rows(&values, c.deadline())
}

/// Every row of `rows` reads back exactly (value `row`, `len` bytes).
fn check_rows(c: &Client, rows: &[u64], len: usize) {
    for some in rows.chunks(16) {
        let keys: Vec<Key> = some.iter().map(|&r| Key::new(r, "v")).collect();
        let got = c.get_rows(&keys, c.deadline()).expect("get");
        for (&row, v) in some.iter().zip(&got) {
            assert!(
                is_value(v, row, len),
                "row {row} does not read back exactly"
            );
        }
    }
}

/// 400 puts of 1 MiB from row `base`, every other one cleared: 200 MiB
/// stored in 1 MiB pieces with 1 MiB holes between. The rows kept.
fn holes(c: &Client, base: u64) -> Vec<u64> {
    put_each(c, base..base + 400, MIB);
    let odd: Vec<u64> = (base..base + 400).filter(|r| r % 2 == 1).collect();
    assert_eq!(c.clear_rows(&odd, c.deadline()).unwrap(), 200);
    (base..base + 400).filter(|r| r % 2 == 0).collect()
}

/// Issue 23's first measurement: a 512 MiB unit with 200 MiB stored in
/// 1 MiB pieces, every other MiB free, takes ONE put of 250 values of
/// 1 MiB; cleared and cut the same way again, one put of 300 MiB. Every
/// value reads back exactly.
#[test]
fn a_put_goes_into_holes_that_hold_it() {
    let (p, _) = plane(1, 512 * MIB as u64, &[]);
    // A user's client: spares on (the default).
    let c = client(&p, Kind::Shm, Duration::from_secs(30));

    let kept = holes(&c, 0);
    let s = unit_stats(&c);
    eprintln!("holes: {}", brief(&s));
    let batch: Vec<u64> = (1000..1250).collect();
    if let Err(e) = put_batch(&c, &batch, MIB) {
        panic!(
            "one put of 250 MiB into a 512 MiB unit holding 200 MiB (every other MiB free) \
             was refused: {e}; {}",
            brief(&unit_stats(&c))
        );
    }
    check_rows(&c, &kept, MIB);
    check_rows(&c, &batch, MIB);

    // Everything cleared; the same holes again, and 300 MiB in one put.
    let all: Vec<u64> = kept.iter().chain(&batch).copied().collect();
    assert_eq!(c.clear_rows(&all, c.deadline()).unwrap(), 450);
    let kept = holes(&c, 2000);
    let batch: Vec<u64> = (3000..3300).collect();
    if let Err(e) = put_batch(&c, &batch, MIB) {
        panic!(
            "one put of 300 MiB into a 512 MiB unit holding 200 MiB (every other MiB free) \
             was refused: {e}; {}",
            brief(&unit_stats(&c))
        );
    }
    check_rows(&c, &kept, MIB);
    check_rows(&c, &batch, MIB);
    let all: Vec<u64> = kept.iter().chain(&batch).copied().collect();
    assert_eq!(c.clear_rows(&all, c.deadline()).unwrap(), 500);
    assert_eq!(unit_stats(&c).entries, 0);
}

/// Issue 23's second measurement: a 256 MiB unit holding no rows, with 24
/// client processes connected and idle, each having put and cleared a few
/// values of 512 KiB to 4 MiB (the spares they keep for their next puts).
/// A 128 MiB put from another process goes in within its default
/// deadline, and `used` is 0 whenever no rows are stored (spares are
/// reported beside it, in `spare_bytes`).
#[test]
fn idle_clients_spares_never_refuse_a_put_nor_count_as_used() {
    let (p, _) = plane(1, 256 * MIB as u64, &[]);
    let addr = p.uds_addrs()[0].to_string();
    let idle: Vec<Helper> = (0..24)
        .map(|n| Helper::start(&p, "idle_child", ("STOWAGE_IDLE", &format!("{addr},{n}"))))
        .collect();
    for h in &idle {
        h.expect_line("IDLE", Duration::from_secs(60));
    }
    // Another process's client, as a user makes it (default deadline,
    // spares on).
    let mut cfg = ClientConfig::new("free", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    let c = Client::connect(cfg).expect("client connects");
    let s = unit_stats(&c);
    eprintln!(
        "24 idle clients ({} bytes of puts each): {}",
        IDLE_PUTS.iter().sum::<usize>(),
        brief(&s)
    );
    assert_eq!(s.entries, 0, "the idle clients cleared their rows");

    let big = value_of(0xB16, 128 * MIB);
    if let Err(e) = c.put_rows(&[(Key::new(9999, "v"), &big)], c.deadline()) {
        panic!(
            "a 128 MiB put into a 256 MiB unit holding no rows, beside 24 idle clients, \
             failed: {e}; {}",
            brief(&unit_stats(&c))
        );
    }
    let got = c.get_rows(&[Key::new(9999, "v")], c.deadline()).unwrap();
    assert!(
        got[0] == big,
        "the 128 MiB value does not read back exactly"
    );
    drop(got);
    c.clear_rows(&[9999], c.deadline()).unwrap();

    let s = unit_stats(&c);
    assert_eq!(s.entries, 0);
    assert_eq!(
        s.used,
        0,
        "no rows are stored, yet `used` is not 0 (spares belong in spare_bytes): {}",
        brief(&s)
    );

    // Every idle client stopped by its pid: their spares go back.
    drop(idle);
    assert!(
        eventually(Duration::from_secs(10), || unit_stats(&c).spare_bytes == 0),
        "the stopped clients' spares were not given back: {}",
        brief(&unit_stats(&c))
    );
}

/// Issue 23's third measurement: the number of live values is bounded by
/// memory, not by bookkeeping sized at start. A 16 MiB unit takes 20,000
/// puts of 64 bytes (1.25 MiB of data).
#[test]
fn small_values_are_bounded_by_memory_not_by_a_table() {
    const N: u64 = 20_000;
    let (p, _) = plane(1, 16 * MIB as u64, &[]);
    let c = client(&p, Kind::Shm, Duration::from_secs(30));
    for row in 0..N {
        let v = pattern(row, 64, 64);
        if let Err(e) = c.put_rows(&[(Key::new(row, "v"), &v)], c.deadline()) {
            panic!(
                "put {} of {N} 64-byte values into a 16 MiB unit was refused: {e}; {}",
                row + 1,
                brief(&unit_stats(&c))
            );
        }
    }
    assert_eq!(unit_stats(&c).entries, N);
    let sample: Vec<u64> = (0..N).step_by(97).chain([N - 1]).collect();
    let keys: Vec<Key> = sample.iter().map(|&r| Key::new(r, "v")).collect();
    let got = c.get_rows(&keys, c.deadline()).unwrap();
    for (&row, v) in sample.iter().zip(&got) {
        assert!(*v == pattern(row, 64, 64), "row {row} does not read back");
    }
}

common::both_transports!(a_value_larger_than_the_largest_free_range_round_trips);

/// A 64 MiB unit filled with 1 MiB values, every other one cleared (no
/// free range larger than a MiB or two), while another process holds a
/// pin on a value (a view) and is paused by SIGSTOP: one 20 MiB value
/// goes in, reads back byte for byte into a buffer of the caller's and as
/// a new vector, and the paused holder's bytes never changed.
fn a_value_larger_than_the_largest_free_range_round_trips(kind: Kind) {
    let (p, _) = plane(1, 64 * MIB as u64, &[]);
    let addr = p.uds_addrs()[0].to_string();
    let mut pin = Helper::start(&p, "pin_child", ("STOWAGE_PIN", &format!("{addr},{MIB}")));
    pin.expect_line("PINNED", Duration::from_secs(30));
    pin.pause();

    let filler = plain_client(&p, Kind::Shm);
    let mut rows = Vec::new();
    let mut buf = vec![0u8; MIB];
    for row in 0..64u64 {
        fill_value(row, &mut buf);
        match filler.put_rows(&[(Key::new(row, "v"), &buf)], filler.deadline()) {
            Ok(()) => rows.push(row),
            Err(Error::UnitFull { .. }) => break,
            Err(e) => panic!("put of row {row}: {e}"),
        }
    }
    assert!(rows.len() >= 48, "only {} MiB went in", rows.len());
    let odd: Vec<u64> = rows.iter().copied().filter(|r| r % 2 == 1).collect();
    filler.clear_rows(&odd, filler.deadline()).unwrap();
    let kept: Vec<u64> = rows.iter().copied().filter(|r| r % 2 == 0).collect();
    eprintln!("fragmented: {}", brief(&unit_stats(&filler)));

    let c = plain_client(&p, kind);
    const BIG: usize = 20 * MIB;
    let key = Key::new(1000, "v");
    let big = value_of(0x20_000, BIG);
    if let Err(e) = c.put_rows(&[(key.clone(), &big)], c.deadline()) {
        panic!(
            "a 20 MiB value into a unit with {} MiB cleared in 1 MiB holes was refused: {e}; {}",
            odd.len(),
            brief(&unit_stats(&c))
        );
    }
    let mut into = IntoBuffer(vec![0u8; BIG]);
    c.get_into(
        DEFAULT_PARTITION,
        &[(0, key.clone())],
        &mut into,
        c.deadline(),
    )
    .unwrap();
    assert!(into.0 == big, "the 20 MiB value read into a buffer differs");
    let got = c.get_rows(&[key], c.deadline()).unwrap();
    assert!(got[0] == big, "the 20 MiB value read as a vector differs");
    check_rows(&c, &kept, MIB);

    pin.signal("-CONT");
    assert_eq!(
        pin.result(),
        "RESULT ok",
        "the paused holder's pinned bytes changed"
    );
}

/// A client that holds spares gives them back on its next call once the
/// unit is short of memory (the reply says `spares_back`), and the unit
/// offers none while it is.
#[test]
fn spares_are_given_back_when_memory_runs_short() {
    let (p, _) = plane(1, 64 * MIB as u64, &[]);
    let mut cfg = ClientConfig::new("spares", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(30);
    let holder = Client::connect(cfg).expect("client connects");
    // Small puts leave the holder with spares (one per size class).
    put_each(&holder, 0..3, 256 << 10);
    put_each(&holder, 3..6, 64 << 10);
    let s = unit_stats(&holder);
    assert!(s.spares > 0, "no spares to give back: {}", brief(&s));
    // Another client (no spares) fills the slab to under 1/8 free (so the
    // data zone is too).
    let other = plain_client(&p, Kind::Shm);
    let mut row = 100;
    while unit_stats(&other).free_bytes >= s.capacity / 8 {
        put_each(&other, row..row + 1, MIB);
        row += 1;
    }
    // The holder's next call is told to give its spares back.
    let got = holder
        .get_rows(&[Key::new(0, "v")], holder.deadline())
        .expect("get");
    assert!(is_value(&got[0], 0, 256 << 10));
    let s = unit_stats(&holder);
    assert_eq!(
        (s.spares, s.spare_bytes),
        (0, 0),
        "spares kept while memory is short: {}",
        brief(&s)
    );
    // And while memory is short a put leaves none behind.
    put_each(&holder, 6..7, 64 << 10);
    let s = unit_stats(&holder);
    assert_eq!(
        s.spares,
        0,
        "a spare offered while memory is short: {}",
        brief(&s)
    );
}
