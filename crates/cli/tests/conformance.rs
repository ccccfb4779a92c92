//! The transport conformance suite: the same tests, against real unit
//! processes, over the shm and the tcp transport.

mod common;

use std::time::{Duration, Instant};

use common::{client, data_bytes, pattern, plane, Kind};
use rustix::process::Signal;
use stowage_client::{Error, Key, SliceSink};

common::both_transports!(
    round_trips_from_1_byte_to_64_mib,
    batch_of_10000_small_entries,
    full_until_a_clear_makes_room,
    kill9_mid_get_loses_only_that_units_keys,
    stopped_unit_times_out_within_the_deadline,
    replaced_values_and_missing_keys,
);

const MIB: u64 = 1 << 20;

fn round_trips_from_1_byte_to_64_mib(kind: Kind) {
    let (p, _) = plane(2, 200 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(60));
    let sizes = [
        0usize,
        1,
        63,
        64,
        65,
        4096,
        65543,
        1 << 20,
        (16 << 20) + 1,
        64 << 20,
    ];
    // One at a time.
    for (i, &size) in sizes.iter().enumerate() {
        let key = Key::new(i as u64, "v");
        let v = pattern(i as u64, 1, size);
        c.put_rows(&[(key.clone(), &v)], c.deadline()).unwrap();
        let got = c
            .get_rows(std::slice::from_ref(&key), c.deadline())
            .unwrap();
        assert!(got[0] == v, "size {size} read back different bytes");
        // Into a caller buffer larger than the value.
        let mut buf = vec![0xEEu8; size + 10];
        let mut bufs = [&mut buf[..]];
        let mut sink = SliceSink::new(&mut bufs);
        c.get_into(
            stowage_client::DEFAULT_PARTITION,
            &[(c.unit_of_row(key.row), key.clone())],
            &mut sink,
            c.deadline(),
        )
        .unwrap();
        assert_eq!(sink.lens[0], size as u64);
        assert!(buf[..size] == v[..]);
        assert!(
            buf[size..].iter().all(|&b| b == 0xEE),
            "wrote past the value"
        );
        // Into values the transport may lend (over nixl: zero-copy, in
        // the client's registered receive pool).
        let got = c
            .get_values(
                stowage_client::DEFAULT_PARTITION,
                &[(c.unit_of_row(key.row), key)],
                c.deadline(),
            )
            .unwrap();
        check_values(kind, &got, std::slice::from_ref(&v));
    }
    c.clear_rows(&(0..sizes.len() as u64).collect::<Vec<_>>(), c.deadline())
        .unwrap();
    // All at once: one blob per unit, both units in one round.
    let values: Vec<(Key, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| (Key::new(100 + i as u64, "w"), pattern(i as u64, 2, s)))
        .collect();
    let refs: Vec<(Key, &[u8])> = values
        .iter()
        .map(|(k, v)| (k.clone(), v.as_slice()))
        .collect();
    c.put_rows(&refs, c.deadline()).unwrap();
    let keys: Vec<Key> = values.iter().map(|(k, _)| k.clone()).collect();
    let got = c.get_rows(&keys, c.deadline()).unwrap();
    for ((k, want), have) in values.iter().zip(&got) {
        assert!(want == have, "{k} read back different bytes");
    }
    let placed: Vec<(usize, Key)> = keys
        .iter()
        .map(|k| (c.unit_of_row(k.row), k.clone()))
        .collect();
    let lent = c
        .get_values(stowage_client::DEFAULT_PARTITION, &placed, c.deadline())
        .unwrap();
    let wants: Vec<Vec<u8>> = values.iter().map(|(_, v)| v.clone()).collect();
    check_values(kind, &lent, &wants);
    let removed = c
        .clear_rows(
            &keys.iter().map(|k| k.row).collect::<Vec<_>>(),
            c.deadline(),
        )
        .unwrap();
    assert_eq!(removed, sizes.len() as u64);
    for s in c.stats(c.deadline()) {
        let s = s.unwrap();
        assert_eq!((s.entries, data_bytes(&s), s.pins), (0, 0, 0), "{s:?}");
    }
    // Lent values are the caller's own: the rows cleared and their memory
    // written again, they read as they were.
    for (i, &size) in sizes.iter().enumerate() {
        let key = Key::new(200 + i as u64, "w");
        c.put_rows(&[(key, &vec![0x5Au8; size])], c.deadline())
            .unwrap();
    }
    check_values(kind, &lent, &wants);
}

/// `got` holds exactly `want`; over nixl each non-empty value is lent
/// (zero-copy) and 64-byte aligned, over shm and tcp each is its own.
fn check_values(kind: Kind, got: &[stowage_client::Value], want: &[Vec<u8>]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g[..] == w[..],
            "value {i} ({} bytes) read back different bytes",
            w.len()
        );
        match g {
            stowage_client::Value::Lent(..) => {
                assert_eq!(kind, Kind::Nixl, "value {i} lent over {kind:?}");
                assert_eq!(
                    g.as_ptr() as usize % 64,
                    0,
                    "value {i} is not 64-byte aligned"
                );
            }
            stowage_client::Value::Owned(_) => assert!(
                kind != Kind::Nixl || w.is_empty(),
                "value {i} ({} bytes) over nixl was copied, not lent",
                w.len()
            ),
        }
    }
}

fn batch_of_10000_small_entries(kind: Kind) {
    let (p, _) = plane(2, 64 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(60));
    let values: Vec<(Key, Vec<u8>)> = (0..10_000u64)
        .map(|r| {
            let field = if r % 2 == 0 {
                "input_ids"
            } else {
                "advantages"
            };
            (Key::new(r / 2, field), pattern(r, 3, (r % 97) as usize + 1))
        })
        .collect();
    let refs: Vec<(Key, &[u8])> = values
        .iter()
        .map(|(k, v)| (k.clone(), v.as_slice()))
        .collect();
    c.put_rows(&refs, c.deadline()).unwrap();
    let stats: Vec<_> = c
        .stats(c.deadline())
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(stats.iter().map(|s| s.entries).sum::<u64>(), 10_000);
    assert_eq!(stats.iter().map(|s| s.rows).sum::<u64>(), 5_000);
    assert!(
        stats.iter().all(|s| s.blobs == 1),
        "one blob per unit: {stats:?}"
    );
    let keys: Vec<Key> = values.iter().map(|(k, _)| k.clone()).collect();
    let got = c.get_rows(&keys, c.deadline()).unwrap();
    assert_eq!(got.len(), 10_000);
    for ((k, want), have) in values.iter().zip(&got) {
        assert!(want == have, "{k} read back different bytes");
    }
    let rows: Vec<u64> = (0..5_000).collect();
    assert_eq!(c.clear_rows(&rows, c.deadline()).unwrap(), 10_000);
    assert!(c
        .stats(c.deadline())
        .into_iter()
        .all(|s| data_bytes(&s.unwrap()) == 0));
}

fn full_until_a_clear_makes_room(kind: Kind) {
    let (p, _) = plane(2, 8 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(10));
    let v = pattern(0, 4, MIB as usize);
    let mut stored = Vec::new();
    let err = loop {
        // Even rows live on unit 0.
        let key = Key::new(2 * stored.len() as u64, "big");
        match c.put_rows(&[(key.clone(), &v)], c.deadline()) {
            Ok(()) => stored.push(key),
            Err(e) => break e,
        }
        assert!(stored.len() <= 8, "an 8 MiB unit took more than 8 MiB");
    };
    assert!(matches!(err, Error::UnitFull { unit: 0, .. }), "{err:?}");
    assert!(stored.len() >= 6, "only {} MiB fit in 8 MiB", stored.len());
    // Nothing stored was lost by the refusal, and the other unit is fine.
    let got = c.get_rows(&stored, c.deadline()).unwrap();
    assert!(got.iter().all(|g| *g == v));
    c.put_rows(&[(Key::new(1, "big"), &v)], c.deadline())
        .unwrap();
    // A clear makes room again.
    c.clear_rows(&[stored[0].row, stored[1].row], c.deadline())
        .unwrap();
    let again = Key::new(1000, "big");
    c.put_rows(&[(again.clone(), &v)], c.deadline()).unwrap();
    assert!(c.get_rows(&[again], c.deadline()).unwrap()[0] == v);
}

fn kill9_mid_get_loses_only_that_units_keys(kind: Kind) {
    let (mut p, _) = plane(2, 160 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(20));
    let values: Vec<(Key, Vec<u8>)> = (0..32u64)
        .map(|r| (Key::new(r, "logprobs"), pattern(r, 5, 4 << 20)))
        .collect();
    let refs: Vec<(Key, &[u8])> = values
        .iter()
        .map(|(k, v)| (k.clone(), v.as_slice()))
        .collect();
    c.put_rows(&refs, c.deadline()).unwrap();
    let unit0: Vec<Key> = values
        .iter()
        .filter(|(k, _)| k.row % 2 == 0)
        .map(|(k, _)| k.clone())
        .collect();
    let unit1: Vec<(Key, Vec<u8>)> = values
        .iter()
        .filter(|(k, _)| k.row % 2 == 1)
        .cloned()
        .collect();

    let failure = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let end = Instant::now() + Duration::from_secs(15);
            let mut ok_reads = 0;
            let placed: Vec<(usize, Key)> = unit0.iter().map(|k| (0, k.clone())).collect();
            while Instant::now() < end {
                // Into fresh vectors and into values the transport may lend
                // (over nixl, a READ into the receive pool), in turn.
                let read = if ok_reads % 2 == 0 {
                    c.get_rows(&unit0, c.deadline()).map(drop)
                } else {
                    c.get_values(stowage_client::DEFAULT_PARTITION, &placed, c.deadline())
                        .map(drop)
                };
                match read {
                    Ok(()) => ok_reads += 1,
                    Err(e) => return (ok_reads, Some(e)),
                }
            }
            (ok_reads, None)
        });
        std::thread::sleep(Duration::from_millis(100));
        p.kill9(0);
        reader.join().unwrap()
    });
    let (_, err) = failure;
    match err {
        Some(Error::LostKeys { unit: 0, keys, .. }) => assert_eq!(keys, unit0),
        other => panic!("expected LostKeys for unit 0, got {other:?}"),
    }
    // Later reads of the dead unit's keys: LostKeys again, promptly.
    let t = Instant::now();
    assert!(matches!(
        c.get_rows(&unit0[..1], c.deadline()),
        Err(Error::LostKeys { unit: 0, .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(5));
    // The other unit's keys still read back.
    let keys1: Vec<Key> = unit1.iter().map(|(k, _)| k.clone()).collect();
    let got = c.get_rows(&keys1, c.deadline()).unwrap();
    for ((k, want), have) in unit1.iter().zip(&got) {
        assert!(want == have, "{k} changed");
    }
    // Clearing rows of a dead unit succeeds: they are gone already.
    let all: Vec<u64> = (0..32).collect();
    assert_eq!(c.clear_rows(&all, c.deadline()).unwrap(), 16);
}

fn stopped_unit_times_out_within_the_deadline(kind: Kind) {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let deadline = Duration::from_millis(700);
    let c = client(&p, kind, deadline);
    let v = pattern(0, 6, 1000);
    c.put_rows(
        &[
            (Key::new(0, "a"), &v),
            (Key::new(1, "a"), &v),
            (Key::new(3, "a"), &v),
        ],
        c.deadline(),
    )
    .unwrap();
    p.units[0].signal(Signal::STOP).unwrap();
    // kill(2) returns before the target has stopped: wait until the kernel
    // reports it stopped.
    assert!(common::eventually(Duration::from_secs(5), || {
        common::is_stopped(p.units[0].pid())
    }));
    // Generous margin: these machines are shared; the point is that the
    // call is bounded by the deadline, not by the stopped unit.
    let margin = Duration::from_millis(1500);
    let t = Instant::now();
    let r = c.get_rows(&[Key::new(0, "a")], c.deadline()).map(|_| ());
    assert!(
        matches!(r, Err(Error::Timeout { unit: Some(0), .. })),
        "{r:?}"
    );
    assert!(
        t.elapsed() < deadline + margin,
        "get took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    let r = c.put_rows(&[(Key::new(2, "a"), &v)], c.deadline());
    assert!(
        matches!(r, Err(Error::Timeout { unit: Some(0), .. })),
        "{r:?}"
    );
    assert!(
        t.elapsed() < deadline + margin,
        "put took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    let r = c.clear_rows(&[0, 1], c.deadline());
    assert!(matches!(&r, Err(e) if e.is_retryable()), "{r:?}");
    assert!(
        t.elapsed() < deadline + margin,
        "clear took {:?}",
        t.elapsed()
    );
    // The other unit is unaffected. (The clear asked it to clear row 1 at
    // the same time as unit 0 its row 0: row 3 is the one left to read.)
    assert!(c.get_rows(&[Key::new(3, "a")], c.deadline()).unwrap()[0] == v);
    // Resumed, the unit still has its data.
    p.units[0].signal(Signal::CONT).unwrap();
    let c2 = client(&p, kind, Duration::from_secs(10));
    assert!(c2.get_rows(&[Key::new(0, "a")], c2.deadline()).unwrap()[0] == v);
}

fn replaced_values_and_missing_keys(kind: Kind) {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(10));
    let old = pattern(1, 7, 5000);
    let new = pattern(2, 7, 300);
    c.put_rows(
        &[(Key::new(3, "x"), &old), (Key::new(4, "x"), &old)],
        c.deadline(),
    )
    .unwrap();
    // A later stage adds a field to existing rows and replaces one value.
    c.put_rows(
        &[(Key::new(3, "x"), &new), (Key::new(3, "ref"), &new)],
        c.deadline(),
    )
    .unwrap();
    let got = c
        .get_rows(
            &[Key::new(3, "x"), Key::new(3, "ref"), Key::new(4, "x")],
            c.deadline(),
        )
        .unwrap();
    assert!(got[0] == new && got[1] == new && got[2] == old);
    // Every missing key is named, and nothing else.
    match c.get_rows(
        &[
            Key::new(3, "x"),
            Key::new(5, "x"),
            Key::new(4, "nope"),
            Key::new(6, "y"),
        ],
        c.deadline(),
    ) {
        Err(Error::NotFound { mut keys, .. }) => {
            keys.sort();
            assert_eq!(
                keys,
                vec![Key::new(4, "nope"), Key::new(5, "x"), Key::new(6, "y")]
            );
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    // A clear is row-wide.
    assert_eq!(c.clear_rows(&[3], c.deadline()).unwrap(), 2);
    assert!(matches!(
        c.get_rows(&[Key::new(3, "ref")], c.deadline()),
        Err(Error::NotFound { .. })
    ));
    // The replaced value's memory was freed: only row 4's blob remains.
    let used: u64 = c
        .stats(c.deadline())
        .into_iter()
        .map(|s| data_bytes(&s.unwrap()))
        .sum();
    assert_eq!(used, 5056, "one 5000-byte blob rounded to 64");
}
