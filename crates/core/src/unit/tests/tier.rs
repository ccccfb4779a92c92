//! The disk tier: spills, promotions, puts that go to disk.

use super::*;

pub(super) fn disk_core(cap: u64, disk: u64) -> UnitCore {
    let mut cfg = CoreConfig::new(cap);
    cfg.disk_capacity = disk;
    cfg.high_watermark = 0.5;
    cfg.low_watermark = 0.25;
    UnitCore::new(cfg).unwrap()
}

pub(super) fn put(c: &mut UnitCore, o: Owner, id: u128, row: u64, n: u64) -> Allocated {
    let a = c.alloc(o, BlobId(id), n, 1, t(0)).unwrap();
    let r = c
        .commit(o, "partition", BlobId(id), &[entry(row, "f", 0, n)])
        .unwrap();
    if a == Allocated::ToDisk {
        assert_eq!(r, Committed::Pending);
    } else {
        assert_eq!(r, Committed::Done);
    }
    a
}

#[test]
fn spill_oldest_first_then_promote() {
    let mut c = disk_core(4096, 1 << 20);
    let o = own(&mut c);
    put(&mut c, o, 1, 1, 1024);
    put(&mut c, o, 2, 2, 1024);
    assert!(
        c.spill_jobs().is_empty(),
        "at the high watermark, not past it"
    );
    put(&mut c, o, 3, 3, 1024);
    let jobs = c.spill_jobs();
    // 3 KiB used of 4: spill the oldest until at most 1 KiB remains.
    assert_eq!(
        jobs.iter().map(|j| j.blob).collect::<Vec<_>>(),
        vec![BlobId(1), BlobId(2)]
    );
    assert!(c.spill_jobs().is_empty(), "already being written");
    // Until written, reads are served from memory.
    let (pin, p) = c
        .resolve_places(o, "partition", &[Key::new(1, "f")], t(0))
        .unwrap();
    assert!(matches!(p[0], Some(Placement::Memory(_))));
    c.disk_written(BlobId(1), true);
    assert_eq!(c.stats().used, 3072, "pinned: memory kept");
    c.unpin(o, pin.unwrap()).unwrap();
    assert_eq!(c.stats().used, 2048, "unpinned: memory freed");
    c.disk_written(BlobId(2), true);
    let s = c.stats();
    assert_eq!((s.used, s.disk_used, s.spilled_blobs), (1024, 2048, 2));
    let (pin, p) = c
        .resolve_places(o, "partition", &[Key::new(1, "f")], t(0))
        .unwrap();
    assert_eq!(
        p[0],
        Some(Placement::Disk {
            blob: BlobId(1),
            offset: 0,
            len: 1024
        })
    );
    let off = c
        .promote_begin(BlobId(1))
        .expect("room below the watermark");
    assert_eq!(c.promote_begin(BlobId(1)), None, "one promotion at a time");
    c.promote_done(BlobId(1), true);
    let (_, p) = c
        .resolve_places(o, "partition", &[Key::new(1, "f")], t(0))
        .unwrap();
    assert_eq!(
        p[0],
        Some(Placement::Memory(SlabRange {
            offset: off,
            len: 1024
        }))
    );
    c.unpin(o, pin.unwrap()).unwrap();
    // Clearing a spilled row removes its file.
    assert!(c.take_effects().is_empty());
    c.clear_rows("partition", &[2]);
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(2))]);
    assert_eq!(c.stats().disk_used, 1024);
}

#[test]
fn puts_without_memory_go_to_disk_and_publish_when_durable() {
    let mut c = disk_core(2048, 4096);
    let o = own(&mut c);
    put(&mut c, o, 1, 1, 2048);
    assert_eq!(put(&mut c, o, 2, 2, 1000), Allocated::ToDisk);
    assert_eq!(
        c.resolve_places(o, "partition", &[Key::new(2, "f")], t(0))
            .unwrap()
            .1,
        vec![None],
        "not yet durable"
    );
    assert_eq!(
        c.commit(o, "partition", BlobId(2), &[]).unwrap(),
        Committed::Pending
    );
    c.disk_written(BlobId(2), true);
    assert_eq!(
        c.commit(o, "partition", BlobId(2), &[]).unwrap(),
        Committed::Done
    );
    assert!(matches!(
        c.resolve_places(o, "partition", &[Key::new(2, "f")], t(0))
            .unwrap()
            .1[0],
        Some(Placement::Disk { .. })
    ));
    // A failed disk write: the put never happened, its file goes.
    assert_eq!(put(&mut c, o, 3, 3, 1000), Allocated::ToDisk);
    c.disk_written(BlobId(3), false);
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(3))]);
    assert_eq!(
        c.commit(o, "partition", BlobId(3), &[]),
        Err(CoreError::UnknownBlob(BlobId(3)))
    );
    // Memory and disk both full: Full, nothing evicted.
    assert_eq!(put(&mut c, o, 4, 4, 3000), Allocated::ToDisk);
    c.disk_written(BlobId(4), true);
    assert!(matches!(
        c.alloc(o, BlobId(5), 200, 1, t(0)),
        Err(CoreError::Full { .. })
    ));
    assert_eq!(c.stats().entries, 3);
    // A blob freed while its file is written: the file goes afterwards.
    c.clear_rows("partition", &[4]);
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(4))]);
    assert_eq!(put(&mut c, o, 6, 6, 3000), Allocated::ToDisk);
    c.disk_written(BlobId(6), true);
    c.clear_rows("partition", &[6]);
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(6))]);
    assert_eq!(put(&mut c, o, 8, 8, 3000), Allocated::ToDisk);
    c.disk_written(BlobId(8), true);
    c.clear_rows("partition", &[8]);
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(8))]);
    assert_eq!(c.stats().disk_used, 1000);
    // A reservation on disk outlives any lease; its connection's end
    // drops it with its file.
    assert_eq!(
        c.alloc(o, BlobId(7), 100, 1, t(0)).unwrap(),
        Allocated::ToDisk
    );
    c.tick(t(60_000));
    assert!(c.take_effects().is_empty());
    c.detach(o, ConnEnd::Closed, t(60_000));
    assert_eq!(c.take_effects(), vec![Action::DeleteFile(BlobId(7))]);
}

#[test]
fn a_bare_commit_of_a_disk_reservation_is_refused_but_a_written_one_waits() {
    let mut c = disk_core(1024, 1 << 20);
    let o = own(&mut c);
    assert_eq!(c.alloc(o, BlobId(1), 2048, 1, t(0)), Ok(Allocated::ToDisk));
    let (partition, blob, entries) = ("p".to_owned(), BlobId(1), vec![entry(1, "f", 0, 2048)]);
    let bare = c.handle(
        t(0),
        Request {
            owner: o,
            op: op::Commit {
                partition: partition.clone(),
                blob,
                entries: entries.clone(),
            },
        },
    );
    assert!(
        matches!(&bare, Err(CoreError::Invalid(m)) if m.contains("send its bytes with Put")),
        "{bare:?}"
    );
    let written = c.handle(
        t(0),
        Request {
            owner: o,
            op: op::CommitWritten {
                partition,
                blob,
                entries,
            },
        },
    );
    assert!(matches!(written, Ok(Committed::Pending)), "{written:?}");
}
