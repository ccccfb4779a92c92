//! Extents, compaction and the spare zone, step by step.

use super::*;

/// A 64 KiB unit (its spare zone the top 4 KiB) whose data zone holds 60
/// committed 1 KiB blobs, rows 0..60 of partition "p", then every even
/// row cleared: 30 KiB of data in 1 KiB holes.
fn holed(compact_min_free: u64) -> (UnitCore, Owner) {
    let mut cfg = CoreConfig::new(64 << 10);
    cfg.compact_min_free = compact_min_free;
    let mut c = UnitCore::new(cfg).unwrap();
    let o = own(&mut c);
    for i in 0..60u64 {
        let b = BlobId(u128::from(i) + 1);
        assert_eq!(
            c.alloc(o, b, 1024, 1, t(0)).unwrap(),
            Allocated::Reserved {
                pieces: vec![(i * 1024, 1024)]
            }
        );
        c.commit(o, "p", b, &[entry(i, "f", 0, 1024)]).unwrap();
    }
    let even: Vec<u64> = (0..60).step_by(2).collect();
    assert_eq!(c.clear_rows("p", &even), 30);
    (c, o)
}

#[test]
fn holes_hold_a_put_in_pieces_and_a_value_across_them() {
    let (mut c, o) = holed(u64::MAX);
    let st = c.stats();
    assert_eq!(st.used, 30 << 10, "stored data only");
    assert_eq!(st.free_bytes, 34 << 10);
    assert_eq!(st.largest_free, 4 << 10, "the spare zone, whole");
    assert_eq!(st.spare_budget, 4 << 10);
    // 20 KiB: more than any free range, less than the free bytes.
    let Allocated::Reserved { pieces } = c.alloc(o, BlobId(100), 20 << 10, 2, t(1)).unwrap() else {
        panic!("a put that fits the free memory was refused");
    };
    assert_eq!(pieces.len(), 20, "twenty 1 KiB holes of the data zone");
    assert!(pieces
        .iter()
        .all(|&(off, len)| len == 1024 && off < 60 << 10));
    c.commit(
        o,
        "p",
        BlobId(100),
        &[entry(100, "a", 1000, 100), entry(100, "b", 2048, 1024)],
    )
    .unwrap();
    let (pin, found) = c
        .resolve_places(o, "p", &[Key::new(100, "a"), Key::new(100, "b")], t(2))
        .unwrap();
    assert_eq!(
        found[0],
        Some(Placement::Split(vec![
            SlabRange {
                offset: pieces[0].0 + 1000,
                len: 24
            },
            SlabRange {
                offset: pieces[1].0,
                len: 76
            },
        ])),
        "a value across two pieces"
    );
    assert_eq!(
        found[1],
        Some(Placement::Memory(SlabRange {
            offset: pieces[2].0,
            len: 1024
        })),
        "a value that fills one piece"
    );
    c.unpin(o, pin.unwrap()).unwrap();
    let st = c.stats();
    assert_eq!((st.split_blobs, st.used), (1, 50 << 10));
    assert_eq!(st.free_bytes, 14 << 10);
}

fn next_move(c: &mut UnitCore) -> MoveJob {
    match c.poll_action() {
        Some(Action::Move(j)) => j,
        other => panic!("expected a move, got {other:?}"),
    }
}

fn moved(c: &mut UnitCore, blob: BlobId, ok: bool) {
    assert!(matches!(c.handle(t(5), input::Moved { blob, ok }), Ok(())));
}

#[test]
fn compaction_moves_only_what_nobody_can_touch() {
    let (mut c, o) = holed(1024);
    // The highest blob (row 59) moves to the lowest hole.
    let j = next_move(&mut c);
    assert_eq!(
        (j.blob, j.from.clone(), j.to, j.nbytes),
        (BlobId(60), vec![(59 << 10, 1024)], 0, 1024)
    );
    assert_eq!(c.move_under_way(), Some((BlobId(60), 0)));
    assert!(c.poll_action().is_none(), "one move at a time");
    // A reader pins it while the driver copies: it reads the old range,
    // which therefore stays; the target goes back.
    let (pin, found) = c
        .resolve_places(o, "p", &[Key::new(59, "f")], t(1))
        .unwrap();
    assert_eq!(
        found[0],
        Some(Placement::Memory(SlabRange {
            offset: 59 << 10,
            len: 1024
        }))
    );
    moved(&mut c, BlobId(60), true);
    assert_eq!(c.blob_pieces(BlobId(60)), Some(vec![(59 << 10, 1024)]));
    assert!(
        c.regions().all(|(_, off, _)| off != 0),
        "the target is free"
    );
    assert_eq!(c.stats().compaction_moves, 0);
    // A failed copy changes nothing either.
    c.unpin(o, pin.unwrap()).unwrap();
    let j = next_move(&mut c);
    assert_eq!(j.blob, BlobId(60));
    moved(&mut c, BlobId(60), false);
    assert_eq!(c.blob_pieces(BlobId(60)), Some(vec![(59 << 10, 1024)]));
    // Untouched, it moves: its values follow it.
    let j = next_move(&mut c);
    moved(&mut c, j.blob, true);
    assert_eq!(c.blob_pieces(BlobId(60)), Some(vec![(0, 1024)]));
    let (pin, found) = c
        .resolve_places(o, "p", &[Key::new(59, "f")], t(6))
        .unwrap();
    assert_eq!(
        found[0],
        Some(Placement::Memory(SlabRange {
            offset: 0,
            len: 1024
        }))
    );
    c.unpin(o, pin.unwrap()).unwrap();
    let st = c.stats();
    assert_eq!((st.compaction_moves, st.compaction_bytes), (1, 1024));
    assert_eq!(st.free_bytes, 34 << 10);
    // A blob cleared while it copies: both ranges stay held until the
    // driver reports, then both go.
    let j = next_move(&mut c);
    assert_eq!(
        (j.blob, j.to),
        (BlobId(58), 2 << 10),
        "row 57, the next highest"
    );
    c.clear_rows("p", &[57]);
    assert_eq!(
        c.held_ranges(),
        vec![(57 << 10, 1024), (2 << 10, 1024)],
        "the old range and the target of a freed blob's move"
    );
    assert_eq!(c.stats().free_bytes, 33 << 10);
    moved(&mut c, BlobId(58), true);
    assert!(c.held_ranges().is_empty(), "{:?}", c.held_ranges());
    assert_eq!(c.stats().free_bytes, 35 << 10);
    assert_eq!(c.stats().compaction_moves, 1);
    assert_eq!(c.move_under_way(), None);
}

#[test]
fn a_reserved_blob_never_moves() {
    let (mut c, o) = holed(1024);
    // Row 59's blob is gone; a writer's reservation takes the top of the
    // data zone instead (the one 2 KiB hole): the highest committed blob
    // moves, never the reservation, and not into what it may touch.
    c.clear_rows("p", &[59]);
    assert_eq!(
        c.alloc(o, BlobId(200), 2048, 1, t(1)).unwrap(),
        Allocated::Reserved {
            pieces: vec![(58 << 10, 2048)]
        }
    );
    let j = next_move(&mut c);
    assert_eq!((j.blob, j.to), (BlobId(58), 0), "row 57");
    for (off, len) in c.session_ranges(o.session) {
        assert!(off + len <= j.to || j.to + 1024 <= off);
    }
    assert_eq!(c.session_ranges(o.session), vec![(58 << 10, 2048)]);
}

#[test]
fn spares_come_from_their_zone_and_stop_when_memory_runs_short() {
    let cap: u64 = 1 << 20;
    let zone = cap / 16;
    let mut c = core(cap);
    let o = own(&mut c);
    let off = c.reserve_spare(o, BlobId(1), 4096, t(0)).unwrap().unwrap();
    assert!(off >= cap - zone, "a spare at {off}, below the spare zone");
    assert_eq!(c.stats().used, 0, "a spare is no stored data");
    // Data fills the data zone until less than an eighth of the slab is
    // free there: no more spares.
    let big = cap - zone - (100 << 10);
    c.alloc(o, BlobId(2), big, 1, t(0)).unwrap();
    c.commit(o, "p", BlobId(2), &[entry(0, "f", 0, 1)]).unwrap();
    assert!(c.spares_short());
    assert_eq!(c.reserve_spare(o, BlobId(3), 4096, t(0)).unwrap(), None);
    // A put of every free byte left borrows the spare zone's free range.
    let free = c.stats().free_bytes;
    assert_eq!(free, (100 << 10) + zone - 4096);
    let Allocated::Reserved { pieces } = c.alloc(o, BlobId(4), free, 1, t(0)).unwrap() else {
        panic!("a put of the free bytes was refused");
    };
    assert_eq!(pieces.len(), 2);
    c.commit(o, "p", BlobId(4), &[entry(1, "f", 0, 1)]).unwrap();
    // Only the idle spare is left: a put does not wait for it.
    assert_eq!(
        c.alloc(o, BlobId(5), 64, 1, t(0)),
        Err(CoreError::Full {
            needed: 64,
            free: 0,
            capacity: cap,
            held: Held {
                spares: 4096,
                ..Held::default()
            },
        })
    );
}
