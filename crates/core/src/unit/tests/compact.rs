//! Blobs in pieces, compaction and the spare zone.

use super::{entry, own, t};
use crate::unit::*;

/// A 64 KiB unit without a spare zone holding 1 KiB blobs at every other
/// KiB (row i in blob i): 32 KiB free in 1 KiB holes.
fn holes() -> (UnitCore, Owner) {
    let mut cfg = CoreConfig::new(64 << 10);
    cfg.spare_budget = 0;
    cfg.compact_min_free = 1024;
    let mut c = UnitCore::new(cfg).unwrap();
    let o = own(&mut c);
    for i in 0..64u64 {
        c.alloc(o, BlobId(i.into()), 1024, 1, t(0)).unwrap();
        c.commit(o, "p", BlobId(i.into()), &[entry(i, "f", 0, 1024)])
            .unwrap();
    }
    let odd: Vec<u64> = (0..64).filter(|i| i % 2 == 1).collect();
    assert_eq!(c.clear_rows("p", &odd), 32);
    (c, o)
}

fn moves(c: &mut UnitCore) -> Vec<MoveJob> {
    let mut out = Vec::new();
    while let Some(a) = c.poll_action() {
        if let Action::Move(m) = a {
            out.push(m);
        }
    }
    out
}

#[test]
fn a_blob_larger_than_any_free_range_takes_pieces() {
    let (mut c, o) = holes();
    assert_eq!(c.stats().largest_free, 1024);
    let Allocated::Reserved { pieces } = c.alloc(o, BlobId(100), 10_000, 2, t(1)).unwrap() else {
        panic!("10,000 bytes fit 32 KiB of holes");
    };
    assert_eq!(pieces.len(), 10);
    c.commit(
        o,
        "p",
        BlobId(100),
        &[entry(100, "a", 0, 1000), entry(100, "b", 1000, 9000)],
    )
    .unwrap();
    let (pin, places) = c
        .resolve_places(o, "p", &[Key::new(100, "a"), Key::new(100, "b")], t(2))
        .unwrap();
    assert_eq!(
        places[0],
        Some(Place::Memory(Location {
            offset: pieces[0].0,
            len: 1000
        }))
    );
    let Some(Place::Split(parts)) = &places[1] else {
        panic!("9,000 bytes cross nine pieces: {:?}", places[1]);
    };
    assert_eq!(parts.iter().map(|l| l.len).sum::<u64>(), 9000);
    assert_eq!(parts[0].offset, pieces[0].0 + 1000);
    assert_eq!(c.stats().split_blobs, 1);
    c.unpin(o, pin.unwrap()).unwrap();
}

#[test]
fn compaction_moves_only_unpinned_blobs_and_switches_once_copied() {
    let (mut c, o) = holes();
    // Scattered: 32 KiB free, the largest range 1 KiB.
    let jobs = moves(&mut c);
    assert_eq!(jobs.len(), 1, "one move at a time");
    let job = jobs[0].clone();
    assert!(job.to < job.from[0].0, "moves down");
    // A reader pins the blob while it is copied: the move is abandoned,
    // the reader's range stays.
    let row = job.from[0].0 / 1024;
    let (pin, before) = c
        .resolve_places(o, "p", &[Key::new(row, "f")], t(3))
        .unwrap();
    assert_eq!(
        before[0],
        Some(Place::Memory(Location {
            offset: job.from[0].0,
            len: 1024
        }))
    );
    c.handle(
        t(4),
        Input::Moved {
            blob: job.blob,
            ok: true,
        },
    )
    .unwrap();
    assert_eq!(c.stats().compaction_moves, 0);
    assert_eq!(c.blob_pieces(job.blob), Some(job.from.clone()));
    c.unpin(o, pin.unwrap()).unwrap();
    // Unpinned, the next move of it is taken: the entry follows.
    let mut moved = 0;
    for _ in 0..64 {
        let Some(job) = moves(&mut c).pop() else {
            break;
        };
        c.handle(
            t(5),
            Input::Moved {
                blob: job.blob,
                ok: true,
            },
        )
        .unwrap();
        assert_eq!(c.blob_pieces(job.blob), Some(vec![(job.to, 1024)]));
        moved += 1;
    }
    let s = c.stats();
    assert!(moved > 0 && s.compaction_moves == moved, "{moved} {s:?}");
    assert_eq!(s.compaction_bytes, 1024 * moved);
    assert!(s.largest_free >= s.free_bytes / 2, "gathered: {s:?}");
    // Every value still resolves to one 1 KiB range.
    let keys: Vec<Key> = (0..64).step_by(2).map(|i| Key::new(i, "f")).collect();
    let (_, places) = c.resolve_places(o, "p", &keys, t(6)).unwrap();
    assert!(places
        .iter()
        .all(|p| matches!(p, Some(Place::Memory(l)) if l.len == 1024)));
}

#[test]
fn a_blob_cleared_while_it_moves_keeps_both_ranges_until_the_copy_reports() {
    let (mut c, _o) = holes();
    let job = moves(&mut c).pop().expect("a move");
    let row = job.from[0].0 / 1024;
    let free = c.stats().free_bytes;
    assert_eq!(c.clear_rows("p", &[row]), 1);
    assert_eq!(
        c.stats().free_bytes,
        free,
        "the compactor still reads and writes"
    );
    c.handle(
        t(1),
        Input::Moved {
            blob: job.blob,
            ok: true,
        },
    )
    .unwrap();
    assert_eq!(c.stats().free_bytes, free + 2048);
    assert_eq!(c.stats().compaction_moves, 0);
}

#[test]
fn spares_come_from_their_zone_and_stop_when_memory_is_short() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.spare_budget = 64 << 10;
    let mut c = UnitCore::new(cfg).unwrap();
    let o = own(&mut c);
    let zone = (1 << 20) - (64 << 10);
    let off = c.reserve_spare(o, BlobId(1), 4096, t(0)).unwrap().unwrap();
    assert!(off >= zone, "a spare lies in the spare zone");
    // Spares never leave the zone: 60 KiB left there.
    assert_eq!(c.reserve_spare(o, BlobId(2), 64 << 10, t(0)).unwrap(), None);
    // Data fills the data zone to under 1/8 free: memory is short.
    assert!(!c.spares_short());
    c.alloc(o, BlobId(3), 900 << 10, 1, t(0)).unwrap();
    c.commit(o, "p", BlobId(3), &[entry(3, "f", 0, 900 << 10)])
        .unwrap();
    assert!(c.spares_short());
    assert_eq!(c.reserve_spare(o, BlobId(4), 4096, t(0)).unwrap(), None);
    // A put that needs the spare's memory is Full, not Busy: an idle
    // client's spare is not waited for.
    let free = c.stats().free_bytes;
    assert!(matches!(
        c.alloc(o, BlobId(5), free + 64, 1, t(0)),
        Err(CoreError::Full { .. })
    ));
    // Data may borrow the spare zone's free ranges.
    let Allocated::Reserved { pieces } = c.alloc(o, BlobId(6), free, 1, t(0)).unwrap() else {
        panic!("fits the free bytes");
    };
    assert!(pieces.iter().any(|&(o, _)| o >= zone));
}
