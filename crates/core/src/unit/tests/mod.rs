use super::*;

mod compact;
mod repair;
mod tier;
use tier::{disk_core, put};

/// The calls these tests make, over the one entry point.
impl UnitCore {
    fn tick(&mut self, now: Time) -> u64 {
        match self.handle(now, input::Timeout) {
            Ok(n) => n,
            other => panic!("Timeout answered {other:?}"),
        }
    }

    fn next_deadline(&self) -> Option<Time> {
        self.poll_timeout()
    }

    /// The file removals queued (other actions stay queued).
    fn take_effects(&mut self) -> Vec<Action> {
        let (deletes, rest): (Vec<Action>, Vec<Action>) = std::mem::take(&mut self.actions)
            .into_iter()
            .partition(|a| matches!(a, Action::DeleteFile(_)));
        self.actions = rest.into();
        deletes
    }

    #[allow(clippy::type_complexity)]
    fn resolve_places(
        &mut self,
        owner: Owner,
        partition: &str,
        keys: &[Key],
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Placement>>), CoreError> {
        let (pin, found) = self.resolve(owner, partition, &keys.to_vec().into(), false, now)?;
        Ok((pin, found.into_iter().map(|f| f.map(|(p, _)| p)).collect()))
    }

    /// [`UnitCore::resolve_places`] for a view: the pin lasts as long as
    /// its holder wants.
    fn view_places(&mut self, owner: Owner, partition: &str, keys: &[Key]) -> Option<PinId> {
        self.resolve(owner, partition, &keys.to_vec().into(), true, t(0))
            .unwrap()
            .0
    }
}

fn own(c: &mut UnitCore) -> Owner {
    let s = c.open_session();
    c.attach(s, true).unwrap()
}

fn core(cap: u64) -> UnitCore {
    UnitCore::new(CoreConfig::new(cap)).unwrap()
}

fn t(ms: u64) -> Time {
    Duration::from_millis(ms)
}

fn entry(row: u64, field: &str, offset: u64, len: u64) -> EntrySpec {
    EntrySpec {
        key: Key::new(row, field),
        offset,
        len,
        meta: vec![row as u8],
    }
}

#[test]
fn alloc_is_idempotent_and_commit_publishes() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    let b = BlobId(7);
    let Allocated::Reserved { pieces } = c.alloc(o, b, 100, 2, t(0)).unwrap() else {
        panic!("expected a reservation");
    };
    assert_eq!(pieces.len(), 1, "an empty slab holds it in one range");
    let offset = pieces[0].0;
    assert_eq!(
        c.alloc(o, b, 100, 2, t(1)).unwrap(),
        Allocated::Reserved { pieces }
    );
    c.commit(
        o,
        "partition",
        b,
        &[entry(1, "a", 0, 40), entry(1, "b", 40, 60)],
    )
    .unwrap();
    c.commit(o, "partition", b, &[]).unwrap(); // idempotent, whatever it names
    assert_eq!(
        c.alloc(o, b, 100, 2, t(2)).unwrap(),
        Allocated::AlreadyCommitted
    );
    let (pin, locs) = c
        .resolve_places(o, "partition", &[Key::new(1, "b"), Key::new(2, "a")], t(3))
        .unwrap();
    assert_eq!(
        locs[0],
        Some(Placement::Memory(SlabRange {
            offset: offset + 40,
            len: 60
        }))
    );
    assert_eq!(locs[1], None);
    c.unpin(o, pin.unwrap()).unwrap();
    assert_eq!(c.stats().entries, 2);
    assert_eq!(c.clear_rows("partition", &[1]), 2);
    assert_eq!(c.stats().used, 0);
    assert_eq!(
        c.alloc(o, b, 100, 2, t(4)).unwrap(),
        Allocated::AlreadyCommitted
    );
    c.commit(o, "partition", b, &[entry(9, "a", 0, 1)]).unwrap();
    assert_eq!(
        c.stats().entries,
        0,
        "a late commit retry publishes nothing"
    );
}

#[test]
fn metadata_listing_and_held_pins() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 16, 3, t(0)).unwrap();
    c.commit(
        o,
        "p",
        BlobId(1),
        &[
            entry(5, "b", 0, 8),
            entry(5, "a", 8, 8),
            entry(2, "a", 0, 0),
        ],
    )
    .unwrap();
    assert_eq!(
        c.list("p"),
        vec![
            (2, vec!["a".to_string()]),
            (5, vec!["a".to_string(), "b".to_string()])
        ]
    );
    assert_eq!(c.partitions(""), vec!["p".to_string()]);
    let (pin, found) = c
        .resolve(o, "p", &vec![Key::new(5, "a")].into(), false, t(0))
        .unwrap();
    assert_eq!(found[0].as_ref().map(|(_, m)| m.to_vec()), Some(vec![5]));
    c.clear_rows("p", &[5, 2]);
    // A held pin outlives any lease, and keeps the blob.
    c.tick(t(3_600_000));
    assert_eq!(c.stats().pins, 1);
    assert_eq!(c.stats().blobs, 1);
    c.unpin(o, pin.unwrap()).unwrap();
    assert_eq!(c.stats().used, 0);
}

/// A resolve of every field of some rows answers what the list of those
/// keys, field by field, answers: the same places and metadata in the
/// same order, missing rows and fields `None`, one pin for both.
#[test]
fn a_grid_of_rows_and_fields_resolves_as_its_list_of_keys() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 24, 3, t(0)).unwrap();
    c.commit(
        o,
        "p",
        BlobId(1),
        &[
            entry(5, "a", 0, 8),
            entry(5, "b", 8, 8),
            entry(2, "a", 16, 8),
        ],
    )
    .unwrap();
    let rows = vec![2, 7, 5];
    let fields = vec!["a".to_string(), "b".to_string(), "c".to_string()];
    let list: Vec<Key> = fields
        .iter()
        .flat_map(|f| rows.iter().map(move |&r| Key::new(r, f.as_str())))
        .collect();
    let (pin_l, by_list) = c.resolve(o, "p", &list.into(), true, t(0)).unwrap();
    let grid = Keys::Grid { rows, fields };
    let (pin_g, by_grid) = c.resolve(o, "p", &grid, true, t(0)).unwrap();
    assert_eq!(by_grid, by_list);
    let found: Vec<bool> = by_grid.iter().map(Option::is_some).collect();
    // a of 2, 7, 5; b of 2, 7, 5; c of none.
    assert_eq!(
        found,
        [true, false, true, false, false, true, false, false, false]
    );
    assert_eq!(c.stats().pins, 2);
    c.unpin(o, pin_l.unwrap()).unwrap();
    c.unpin(o, pin_g.unwrap()).unwrap();
    let (pin, none) = c.resolve(o, "q", &grid, true, t(0)).unwrap();
    assert!(pin.is_none() && none.iter().all(Option::is_none) && none.len() == 9);
    let empty = Keys::Grid {
        rows: vec![],
        fields: vec!["a".into()],
    };
    assert_eq!(empty.get(0), None);
    assert_eq!(grid.get(4), Some((7, "b")));
}

#[test]
fn a_spare_takes_the_puts_id_and_shrinks_to_its_entries() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    let spare = BlobId(100);
    let offset = c.reserve_spare(o, spare, 4096, t(0)).unwrap().unwrap();
    assert_eq!(c.reserve_spare(o, spare, 4096, t(1)).unwrap(), Some(offset));
    assert_eq!(c.stats().reserved_bytes, 4096);
    // The put's own id, with any number of entries within the spare.
    let put = BlobId(7);
    assert!(c.name_spare(o, spare, put, t(2)).unwrap());
    let r = c
        .commit(
            o,
            "partition",
            put,
            &[entry(1, "a", 0, 1000), entry(2, "a", 1000, 500)],
        )
        .unwrap();
    assert_eq!(r, Committed::Done);
    assert_eq!(
        c.blob_size(put),
        Some(1500),
        "spills and checkpoints move 1,500 bytes"
    );
    assert_eq!(c.blob_size(spare), None);
    assert_eq!(c.stats().reserved_bytes, 0);
    assert_eq!(
        c.stats().used,
        4096,
        "the whole range stays held until freed"
    );
    let (pin, locs) = c
        .resolve_places(o, "partition", &[Key::new(2, "a")], t(3))
        .unwrap();
    assert_eq!(
        locs[0],
        Some(Placement::Memory(SlabRange {
            offset: offset + 1000,
            len: 500
        }))
    );
    c.unpin(o, pin.unwrap()).unwrap();
    // A retry of the put (same id) finds it committed.
    assert_eq!(
        c.alloc(o, put, 1500, 2, t(4)).unwrap(),
        Allocated::AlreadyCommitted
    );
    assert_eq!(c.clear_rows("partition", &[1, 2]), 2);
    assert_eq!(c.stats().used, 0);
}

#[test]
fn a_spare_is_memory_only_and_never_an_error_for_want_of_room() {
    let mut c = disk_core(1 << 16, 1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 1 << 16, 1, t(0)).unwrap();
    // The slab is full and the disk has room: a put would go to disk,
    // a spare is simply not given.
    assert_eq!(c.reserve_spare(o, BlobId(2), 4096, t(0)).unwrap(), None);
    assert_eq!(c.stats().disk_used, 0);
    assert_eq!(c.stats().reserved_bytes, 1 << 16);
}

#[test]
fn only_its_session_names_a_spare_and_a_committed_put_gives_it_up() {
    let mut c = core(1 << 20);
    let (a, b) = (own(&mut c), own(&mut c));
    c.reserve_spare(a, BlobId(10), 4096, t(0)).unwrap().unwrap();
    assert!(matches!(
        c.name_spare(b, BlobId(10), BlobId(11), t(0)),
        Err(CoreError::NotOwner(_))
    ));
    assert!(matches!(
        c.name_spare(a, BlobId(99), BlobId(11), t(0)),
        Err(CoreError::UnknownBlob(_))
    ));
    // An Alloc reservation is not a spare.
    c.alloc(a, BlobId(12), 64, 1, t(0)).unwrap();
    assert!(matches!(
        c.name_spare(a, BlobId(12), BlobId(13), t(0)),
        Err(CoreError::Invalid(_))
    ));
    // The put's id is reserved already: refused, nothing moves.
    assert!(matches!(
        c.name_spare(a, BlobId(10), BlobId(12), t(0)),
        Err(CoreError::Invalid(_))
    ));
    // The put was committed by an earlier try: the spare is given up.
    c.commit(a, "partition", BlobId(12), &[entry(1, "f", 0, 64)])
        .unwrap();
    let before = c.stats().reserved_bytes;
    assert!(!c.name_spare(a, BlobId(10), BlobId(12), t(1)).unwrap());
    assert_eq!(c.stats().reserved_bytes, before - 4096);
    assert_eq!(c.stats().entries, 1);
}

#[test]
fn a_cut_peer_keeps_its_spares_until_its_session_is_gone() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    let offset = c.reserve_spare(o, BlobId(5), 8192, t(0)).unwrap().unwrap();
    // The unit cut the connection of a peer that maps the slab: it may
    // still be writing into its spare, so the range is not reused.
    c.detach(o, ConnEnd::Cut, t(1));
    assert_eq!(c.stats().reserved_bytes, 8192);
    let o2 = own(&mut c);
    let mut granted = 0;
    for i in 0..15 {
        if let Some(off) = c.reserve_spare(o2, BlobId(200 + i), 8192, t(2)).unwrap() {
            granted += 1;
            assert!(
                off + 8192 <= offset || off >= offset + 8192,
                "overlaps the kept spare"
            );
        }
    }
    // The spare zone is 1/16 of the slab (64 KiB): 8 spares of 8 KiB, one
    // of them the cut peer's.
    assert_eq!(granted, 7);
    c.session_gone(o.session, t(3));
    assert_eq!(c.stats().reserved_bytes, granted * 8192);
    // A connection the peer closed gives its spares back at once.
    c.detach(o2, ConnEnd::Closed, t(4));
    assert_eq!(c.stats().reserved_bytes, 0);
    assert_eq!(c.stats().used, 0);
    assert_eq!(c.stats().free_bytes, 1 << 20);
}

/// The sessions the core has forgotten, as its actions say (other
/// actions stay queued).
fn ended_sessions(c: &mut UnitCore) -> Vec<SessionId> {
    let (ended, rest): (Vec<Action>, Vec<Action>) = std::mem::take(&mut c.actions)
        .into_iter()
        .partition(|a| matches!(a, Action::SessionEnded(_)));
    c.actions = rest.into();
    ended
        .into_iter()
        .map(|a| match a {
            Action::SessionEnded(s) => s,
            _ => unreachable!(),
        })
        .collect()
}

/// Whenever the core forgets a session it says so, once, so that the
/// driver can drop what it keeps for it (a client process's pidfd): its
/// last connection closed with nothing held; the process of a cut one
/// exited; never while a connection or a hold is left.
#[test]
fn a_forgotten_session_is_reported_once() {
    let mut c = core(1 << 20);
    // Two connections, one closed: the session lives on.
    let a = own(&mut c);
    let a2 = c.attach(a.session, true).unwrap();
    c.detach(a, ConnEnd::Closed, t(0));
    assert!(ended_sessions(&mut c).is_empty());
    c.detach(a2, ConnEnd::Closed, t(0));
    assert_eq!(ended_sessions(&mut c), vec![a.session]);
    assert!(!c.has_session(a.session));
    // Cut while it maps the slab and holds a spare: kept until its
    // process is gone.
    let b = own(&mut c);
    c.reserve_spare(b, BlobId(5), 8192, t(1)).unwrap().unwrap();
    c.detach(b, ConnEnd::Cut, t(1));
    assert!(ended_sessions(&mut c).is_empty());
    assert!(c.has_session(b.session));
    assert_eq!(c.handle(t(2), input::ProcessExited(b.session)), Ok(1));
    assert_eq!(ended_sessions(&mut c), vec![b.session]);
    // Gone already: nothing more to say.
    assert_eq!(c.handle(t(3), input::ProcessExited(b.session)), Ok(0));
    c.detach(a2, ConnEnd::Closed, t(3));
    assert!(ended_sessions(&mut c).is_empty());
}

#[test]
fn snapshots_pin_every_committed_blob() {
    let mut c = disk_core(4096, 1 << 20);
    let o = own(&mut c);
    put(&mut c, o, 1, 1, 100);
    put(&mut c, o, 2, 2, 100);
    let snap = c.snapshot(t(0));
    assert_eq!(snap.entries.len(), 2);
    assert_eq!(snap.blobs.len(), 2);
    c.clear_rows("partition", &[1, 2]);
    assert_eq!(c.stats().blobs, 2, "pinned by the snapshot");
    assert!(c.unpin(o, snap.pin.unwrap()).is_err(), "the unit's pin");
    c.unpin(Owner::UNIT, snap.pin.unwrap()).unwrap();
    assert_eq!(c.stats().blobs, 0);
}

#[test]
fn namespaces_are_isolated() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 8, 1, t(0)).unwrap();
    c.commit(o, "a", BlobId(1), &[entry(0, "x", 0, 8)]).unwrap();
    assert_eq!(
        c.resolve_places(o, "b", &[Key::new(0, "x")], t(0))
            .unwrap()
            .1,
        vec![None]
    );
    assert_eq!(c.clear_rows("b", &[0]), 0);
    assert_eq!(c.stats().entries, 1);
}

#[test]
fn full_and_busy_are_answers() {
    let mut c = core(4096);
    let o = own(&mut c);
    assert!(matches!(
        c.alloc(o, BlobId(1), 8192, 0, t(0)),
        Err(CoreError::Full { .. })
    ));
    c.alloc(o, BlobId(2), 4096, 0, t(0)).unwrap();
    // The reservation will expire: retrying makes sense.
    assert!(matches!(
        c.alloc(o, BlobId(3), 64, 0, t(0)),
        Err(CoreError::Busy { .. })
    ));
    c.commit(o, "partition", BlobId(2), &[]).unwrap(); // no entries: freed at once
    c.alloc(o, BlobId(3), 4096, 1, t(0)).unwrap();
    c.commit(o, "partition", BlobId(3), &[entry(0, "f", 0, 4096)])
        .unwrap();
    assert!(matches!(
        c.alloc(o, BlobId(4), 64, 0, t(0)),
        Err(CoreError::Full { .. })
    ));
}

/// A put short of memory is Busy only for the puts under way at its first
/// refusal (their commit may replace values, or they may abort): a
/// reservation taken after it counts as used, since a commit keeps its
/// memory. Counting every reservation kept a put on a nearly full unit
/// that other writers keep putting to Busy until its deadline (issue 37):
/// here the retry at 5 ms was answered Busy again for a reservation taken
/// at 4 ms. Another put, first refused after that reservation, waits for it.
#[test]
fn a_refused_put_waits_only_for_the_puts_under_way_at_its_first_refusal() {
    const K: u64 = 1 << 10;
    let mut c = core(64 * K);
    let writer = own(&mut c);
    let asker = own(&mut c);
    c.alloc(writer, BlobId(1), 32 * K, 1, t(0)).unwrap();
    c.commit(writer, "p", BlobId(1), &[entry(0, "f", 0, 32 * K)])
        .unwrap();
    // A put under way; the asker's put of 24 KiB finds 16 KiB free.
    c.alloc(writer, BlobId(2), 16 * K, 1, t(1)).unwrap();
    let busy = |reclaimable| CoreError::Busy {
        needed: 24 * K,
        reclaimable,
    };
    assert_eq!(
        c.alloc(asker, BlobId(10), 24 * K, 1, t(2)),
        Err(busy(16 * K))
    );
    // Asked again while that put is still under way: Busy still.
    assert_eq!(
        c.alloc(asker, BlobId(10), 24 * K, 1, t(3)),
        Err(busy(16 * K))
    );
    // It commits (its memory stays used); a row is cleared, and a new put
    // takes the room.
    c.commit(writer, "p", BlobId(2), &[entry(1, "f", 0, 16 * K)])
        .unwrap();
    assert_eq!(c.clear_rows("p", &[0]), 1);
    c.alloc(writer, BlobId(3), 32 * K, 1, t(4)).unwrap();
    // The put under way at the asker's first refusal has ended: the one
    // taken since counts as used, and the asker's put is Full at once.
    let full = CoreError::Full {
        needed: 24 * K,
        free: 16 * K,
        capacity: 64 * K,
        held: Held {
            reservations: 32 * K,
            ..Held::default()
        },
    };
    assert_eq!(c.alloc(asker, BlobId(10), 24 * K, 1, t(5)), Err(full));
    // Another put, first refused now, waits for that reservation.
    assert_eq!(
        c.alloc(asker, BlobId(11), 24 * K, 1, t(5)),
        Err(busy(32 * K))
    );
    // It aborts: both go in when asked again (the first, answered Full,
    // asks afresh).
    c.abort(writer, BlobId(3), false, t(6)).unwrap();
    assert!(matches!(
        c.alloc(asker, BlobId(11), 24 * K, 1, t(7)),
        Ok(Allocated::Reserved { .. })
    ));
    assert!(matches!(
        c.alloc(asker, BlobId(10), 24 * K, 1, t(7)),
        Ok(Allocated::Reserved { .. })
    ));
    assert_eq!(c.refusals.len(), 0, "a put that went in is forgotten");
}

/// The first refusals a unit remembers are bounded: puts answered Busy and
/// never asked again (their clients gave up) are forgotten, oldest first.
#[test]
fn first_refusals_are_bounded() {
    let mut c = core(4096);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 4096, 1, t(0)).unwrap();
    let n = super::full::REMEMBERED_REFUSALS as u128;
    for id in 0..n + 10 {
        assert!(matches!(
            c.alloc(o, BlobId(100 + id), 64, 1, t(1)),
            Err(CoreError::Busy { .. })
        ));
    }
    assert_eq!(c.refusals.len(), n as usize);
    // The reservation of 0 ms gives way to one of 2 ms. Remembered (first
    // refused at 1 ms), a put would count the new one as used: Full. The
    // oldest was forgotten: asked again at 3 ms, it is first refused anew,
    // and waits for the reservation that existed then: Busy.
    c.abort(o, BlobId(1), false, t(2)).unwrap();
    c.alloc(o, BlobId(2), 4096, 1, t(2)).unwrap();
    assert!(matches!(
        c.alloc(o, BlobId(100 + n + 9), 64, 1, t(3)),
        Err(CoreError::Full { .. })
    ));
    assert!(matches!(
        c.alloc(o, BlobId(100), 64, 1, t(3)),
        Err(CoreError::Busy { .. })
    ));
    // Still bounded (the queue behind the map evicts its oldest entry).
    assert!(c.refusals.len() <= n as usize);
}

/// Memory that views of cleared or replaced values hold is used: Full at
/// once, naming the views (and the asker's own), not Busy; the same bytes
/// held by a read (which copies out and unpins) are Busy.
#[test]
fn views_of_cleared_values_are_full_reads_are_busy() {
    const K48: u64 = 48 << 10;
    let mut c = core(1 << 16);
    let viewer = own(&mut c);
    let writer = own(&mut c);
    let put = |c: &mut UnitCore, blob: u128, row: u64| {
        c.alloc(writer, BlobId(blob), K48, 1, t(0)).map(|_| {
            c.commit(writer, "p", BlobId(blob), &[entry(row, "f", 0, K48)])
                .unwrap();
        })
    };
    // A value viewed, then cleared: only the view keeps its bytes.
    put(&mut c, 1, 0).unwrap();
    let view = c.view_places(viewer, "p", &[Key::new(0, "f")]).unwrap();
    assert_eq!(c.clear_rows("p", &[0]), 1);
    let full = |viewed_by_asker: u64| CoreError::Full {
        needed: K48,
        free: 16 << 10,
        capacity: 1 << 16,
        held: Held {
            views: K48,
            own_views: viewed_by_asker,
            ..Held::default()
        },
    };
    let e = c.alloc(writer, BlobId(2), K48, 1, t(0)).unwrap_err();
    assert_eq!(e, full(0));
    assert!(
        e.to_string()
            .contains("views of cleared or replaced values")
            && !e.to_string().contains("own views"),
        "{e}"
    );
    // The viewer's own put is told the views are its own.
    let e = c.alloc(viewer, BlobId(3), K48, 1, t(0)).unwrap_err();
    assert_eq!(e, full(K48));
    assert!(e.to_string().contains("own views"), "{e}");
    // The view dropped: the put goes in.
    c.unpin(viewer, view).unwrap();
    put(&mut c, 2, 1).unwrap();
    // A value a read pins, replaced under it: its bytes come back when the
    // read ends (Busy). With a view beside the read: Full.
    let (read, _) = c
        .resolve_places(viewer, "p", &[Key::new(1, "f")], t(0))
        .unwrap();
    let read = read.unwrap();
    let e = c.alloc(writer, BlobId(4), K48, 1, t(0)).unwrap_err();
    assert!(
        matches!(e, CoreError::Full { held, .. } if held == Held::default()),
        "{e:?}"
    );
    assert_eq!(c.clear_rows("p", &[1]), 1);
    assert_eq!(
        c.alloc(writer, BlobId(4), K48, 1, t(0)),
        Err(CoreError::Busy {
            needed: K48,
            reclaimable: K48
        })
    );
    let view = c.view_places(writer, "p", &[Key::new(1, "f")]);
    assert_eq!(view, None, "a cleared value is not found");
    c.unpin(viewer, read).unwrap();
    put(&mut c, 4, 2).unwrap();
    let view = c.view_places(viewer, "p", &[Key::new(2, "f")]).unwrap();
    let (read, _) = c
        .resolve_places(writer, "p", &[Key::new(2, "f")], t(0))
        .unwrap();
    assert_eq!(c.clear_rows("p", &[2]), 1);
    assert_eq!(
        c.alloc(writer, BlobId(5), K48, 1, t(0)).unwrap_err(),
        full(0)
    );
    c.unpin(writer, read.unwrap()).unwrap();
    c.unpin(viewer, view).unwrap();
    put(&mut c, 5, 3).unwrap();
}

#[test]
fn replace_keeps_pinned_old_value_until_unpinned() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 8, 1, t(0)).unwrap();
    c.commit(o, "partition", BlobId(1), &[entry(0, "f", 0, 8)])
        .unwrap();
    let (pin, old) = c
        .resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    c.alloc(o, BlobId(2), 8, 1, t(0)).unwrap();
    c.commit(o, "partition", BlobId(2), &[entry(0, "f", 0, 8)])
        .unwrap();
    assert_eq!(c.stats().entries, 1);
    assert_eq!(c.stats().blobs, 2, "old blob still pinned");
    let (_, new) = c
        .resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    assert_ne!(old, new);
    c.unpin(o, pin.unwrap()).unwrap();
    assert!(c.regions().all(|(id, _, _)| id != BlobId(1)));
}

#[test]
fn no_timer_takes_a_hold_only_its_connection_or_session_ends_it() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 100, 1, t(0)).unwrap();
    c.alloc(o, BlobId(2), 100, 1, t(0)).unwrap();
    c.commit(o, "partition", BlobId(2), &[entry(0, "f", 0, 100)])
        .unwrap();
    c.resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    c.clear_rows("partition", &[0]);
    // A paused client: an hour later its holds are all still there,
    // reported as overdue.
    c.tick(t(3_600_000));
    let s = c.stats_at(t(3_600_000));
    // `used` is stored data: the cleared blob a reader still pins; the
    // reservation is held beside it.
    assert_eq!((s.pins, s.blobs, s.used), (1, 2, 128));
    assert_eq!(s.reserved_bytes, 128);
    assert_eq!(s.capacity - s.free_bytes, 256);
    assert_eq!(s.overdue_holds, 2);
    assert_eq!(s.sessions.len(), 1);
    assert_eq!(s.sessions[0].held_bytes, 228);
    assert_eq!(s.sessions[0].oldest_hold_ms, 3_600_000);
    // Cut by the unit, the peer maps the slab: the session keeps them.
    c.detach(o, ConnEnd::Cut, t(3_600_000));
    assert_eq!(c.stats().used, 128);
    assert_eq!(c.stats().free_bytes, (1 << 20) - 256);
    assert_eq!(c.orphaned_sessions(), vec![o.session]);
    // The same session reconnects and takes its reservation over.
    let o2 = c.attach(o.session, true).unwrap();
    assert!(matches!(
        c.alloc(o2, BlobId(1), 100, 1, t(1)),
        Ok(Allocated::Reserved { .. })
    ));
    c.detach(o2, ConnEnd::Cut, t(1));
    // Its process is gone: everything goes, with no quarantine.
    c.session_gone(o.session, t(3_600_000));
    assert_eq!(c.stats().used, 0);
    assert_eq!(c.stats().free_bytes, 1 << 20);
    assert_eq!(
        c.commit(o, "partition", BlobId(1), &[entry(0, "f", 0, 1)]),
        Err(CoreError::UnknownBlob(BlobId(1)))
    );
    assert!(c.orphaned_sessions().is_empty());
    assert_eq!(c.next_deadline(), None);
}

/// A one-sided (nixl) peer's holds outlive its connection's end, a
/// clean close included, until the driver fenced its endpoint and the
/// nixl quarantine then passed; or until its process is gone. A peer
/// that also maps the slab is never released by a timer.
#[test]
fn one_sided_holds_wait_for_the_fence_and_its_quarantine() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.nixl_quarantine = Duration::from_secs(3);
    let mut c = UnitCore::new(cfg).unwrap();
    for (i, end) in [(0, ConnEnd::Closed), (10, ConnEnd::Cut)] {
        let s = c.open_session();
        let o = c.attach(s, false).unwrap();
        c.make_one_sided(o).unwrap();
        c.alloc(o, BlobId(i + 1), 100, 1, t(0)).unwrap();
        c.alloc(o, BlobId(i + 2), 100, 1, t(0)).unwrap();
        c.commit(o, "partition", BlobId(i + 2), &[entry(0, "f", 0, 100)])
            .unwrap();
        c.resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
            .unwrap();
        c.clear_rows("partition", &[0]);
        // The connection ends (a FIN or RST from the network reads
        // as a close): nothing is released, by any time.
        assert_eq!(c.detach(o, end, t(10)), 0, "{end:?}");
        c.tick(t(3_600_000));
        let st = c.stats_at(t(3_600_000));
        assert_eq!(
            (st.pins, st.used, st.reserved_bytes, st.free_bytes),
            (1, 128, 128, (1 << 20) - 256),
            "{end:?}"
        );
        assert_eq!(st.sessions[0].orphaned, 2);
        assert_eq!(c.orphaned_sessions(), vec![s]);
        assert_eq!(c.next_deadline(), None);
        // Fenced: released once the nixl quarantine has passed.
        assert_eq!(c.fence(s, t(3_600_000)), 2);
        assert_eq!(c.next_deadline(), Some(t(3_603_000)));
        assert_eq!(c.tick(t(3_602_999)), 0);
        assert_eq!(c.stats().used, 128);
        assert_eq!(c.stats().free_bytes, (1 << 20) - 256);
        assert_eq!(c.tick(t(3_603_000)), 2);
        let st = c.stats();
        assert_eq!(
            (st.pins, st.used, st.reserved_bytes, st.free_bytes),
            (0, 0, 0, 1 << 20),
            "{end:?}"
        );
        assert!(!c.has_session(s) && c.orphaned_sessions().is_empty());
        assert_eq!(c.next_deadline(), None);
    }

    // Taken over by a retry of the same session before the quarantine
    // ends: the hold is its again, and the fence's timer skips it.
    let s = c.open_session();
    let o = c.attach(s, false).unwrap();
    c.make_one_sided(o).unwrap();
    c.alloc(o, BlobId(3), 100, 1, t(0)).unwrap();
    c.detach(o, ConnEnd::Closed, t(0));
    c.fence(s, t(0));
    let o2 = c.attach(s, false).unwrap();
    c.make_one_sided(o2).unwrap();
    assert!(matches!(
        c.alloc(o2, BlobId(3), 100, 1, t(1)),
        Ok(Allocated::Reserved { .. })
    ));
    assert_eq!(c.tick(t(10_000)), 0);
    assert_eq!(c.stats().reserved_bytes, 128);
    // Its process gone: released at once, fenced or not.
    c.detach(o2, ConnEnd::Closed, t(10_000));
    assert_eq!(c.stats().reserved_bytes, 128);
    assert_eq!(c.session_gone(s, t(10_000)), 1);
    assert_eq!(c.stats().used, 0);

    // A one-sided peer that also maps the slab: a fence never
    // releases what it holds, only its process's end.
    let s = c.open_session();
    let o = c.attach(s, true).unwrap();
    c.make_one_sided(o).unwrap();
    c.alloc(o, BlobId(4), 100, 1, t(0)).unwrap();
    c.detach(o, ConnEnd::Closed, t(0));
    assert_eq!(c.fence(s, t(0)), 0);
    c.tick(t(3_600_000));
    assert_eq!(c.stats().reserved_bytes, 128);
    c.session_gone(s, t(3_600_000));
    assert_eq!(c.stats().used, 0);

    // Without make_one_sided, a closed connection's holds go at once.
    let s = c.open_session();
    let o = c.attach(s, false).unwrap();
    c.alloc(o, BlobId(5), 100, 1, t(0)).unwrap();
    assert_eq!(c.detach(o, ConnEnd::Closed, t(0)), 1);
    assert_eq!(c.stats().used, 0);
}

#[test]
fn ownership_is_enforced() {
    let mut c = core(1 << 20);
    let a = own(&mut c);
    let b = own(&mut c);
    let a2 = c.attach(a.session, true).unwrap();
    c.alloc(a, BlobId(1), 64, 1, t(0)).unwrap();
    // Another session may neither take, commit nor abort it.
    assert!(matches!(
        c.alloc(b, BlobId(1), 64, 1, t(0)),
        Err(CoreError::NotOwner(_))
    ));
    assert!(matches!(
        c.commit(b, "partition", BlobId(1), &[entry(0, "f", 0, 64)]),
        Err(CoreError::NotOwner(_))
    ));
    assert!(matches!(
        c.abort(b, BlobId(1), false, t(0)),
        Err(CoreError::NotOwner(_))
    ));
    // Another open connection of the same session waits (Busy).
    assert!(matches!(
        c.alloc(a2, BlobId(1), 64, 1, t(0)),
        Err(CoreError::Busy { .. })
    ));
    c.commit(a, "partition", BlobId(1), &[entry(0, "f", 0, 64)])
        .unwrap();
    let (pin, _) = c
        .resolve_places(a, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    let pin = pin.unwrap();
    assert!(matches!(c.unpin(b, pin), Err(CoreError::NotOwner(_))));
    assert_eq!(c.stats().pins, 1);
    // Pin ids are not sequential.
    let (p2, _) = c
        .resolve_places(a, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    let p2 = p2.unwrap();
    assert!(p2.0.abs_diff(pin.0) > 1 << 20, "{pin:?} then {p2:?}");
    // A detached connection can do nothing.
    c.detach(b, ConnEnd::Closed, t(0));
    assert!(matches!(
        c.alloc(b, BlobId(9), 64, 1, t(0)),
        Err(CoreError::NotOwner(_))
    ));
    // The peer closing its connection releases what it held.
    c.detach(a, ConnEnd::Closed, t(0));
    assert_eq!(c.stats().pins, 0);
}

#[test]
fn a_cut_stream_is_quarantined_and_its_blob_id_reusable() {
    let mut c = core(1 << 20);
    let s = c.open_session();
    let tcp = c.attach(s, false).unwrap();
    c.alloc(tcp, BlobId(1), 100, 1, t(0)).unwrap();
    c.detach(tcp, ConnEnd::Cut, t(0));
    assert_eq!(c.stats().quarantined_bytes, 128);
    // A session with no connection and no hold is forgotten; the
    // retry, on a new connection of a new session, reserves afresh.
    assert!(!c.has_session(s));
    let s2 = c.open_session();
    let tcp2 = c.attach(s2, false).unwrap();
    assert!(matches!(
        c.alloc(tcp2, BlobId(1), 100, 1, t(1)),
        Ok(Allocated::Reserved { .. })
    ));
    c.commit(tcp2, "partition", BlobId(1), &[entry(0, "f", 0, 100)])
        .unwrap();
    c.tick(t(5_000));
    assert_eq!(c.stats().used, 128);
}

#[test]
fn index_budget_answers_full() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.index_budget = 3 * (ENTRY_OVERHEAD + 1);
    let mut c = UnitCore::new(cfg).unwrap();
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 0, 4, t(0)).unwrap();
    let four: Vec<EntrySpec> = (0..4)
        .map(|r| EntrySpec {
            key: Key::new(r, "f"),
            offset: 0,
            len: 0,
            meta: vec![],
        })
        .collect();
    assert!(matches!(
        c.commit(o, "partition", BlobId(1), four.as_slice()),
        Err(CoreError::Full { .. })
    ));
    c.abort(o, BlobId(1), false, t(0)).unwrap();
    c.alloc(o, BlobId(2), 0, 3, t(0)).unwrap();
    c.commit(o, "partition", BlobId(2), &four[..3]).unwrap();
    assert_eq!(c.stats().index_bytes, 3 * (ENTRY_OVERHEAD + 1));
    c.clear_rows("partition", &[0, 1, 2]);
    assert_eq!(c.stats().index_bytes, 0);
}

#[test]
fn session_holds_are_capped() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.max_session_holds = 3;
    let mut c = UnitCore::new(cfg).unwrap();
    let o = own(&mut c);
    let other = own(&mut c);
    c.alloc(o, BlobId(1), 64, 1, t(0)).unwrap();
    c.commit(o, "partition", BlobId(1), &[entry(0, "f", 0, 64)])
        .unwrap();
    c.alloc(o, BlobId(2), 64, 1, t(0)).unwrap();
    c.resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    c.resolve_places(o, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
    assert!(matches!(
        c.resolve_places(o, "partition", &[Key::new(0, "f")], t(0)),
        Err(CoreError::Busy { .. })
    ));
    assert!(matches!(
        c.alloc(o, BlobId(3), 64, 1, t(0)),
        Err(CoreError::Busy { .. })
    ));
    // A retry of a reservation it already holds is not a new hold.
    assert!(c.alloc(o, BlobId(2), 64, 1, t(0)).is_ok());
    // Another session is not affected.
    c.resolve_places(other, "partition", &[Key::new(0, "f")], t(0))
        .unwrap();
}

#[test]
fn session_connections_are_capped() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.max_session_conns = 2;
    let mut c = UnitCore::new(cfg).unwrap();
    let s = c.open_session();
    let a = c.attach(s, true).unwrap();
    c.attach(s, true).unwrap();
    assert!(matches!(c.attach(s, true), Err(CoreError::Busy { .. })));
    c.detach(a, ConnEnd::Closed, t(0));
    c.attach(s, true).unwrap();
}

#[test]
fn abort_in_flight_quarantines() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 100, 0, t(0)).unwrap();
    c.abort(o, BlobId(1), true, t(0)).unwrap();
    assert_eq!(c.stats().quarantined_bytes, 128);
    c.alloc(o, BlobId(2), 100, 0, t(0)).unwrap();
    c.abort(o, BlobId(2), false, t(0)).unwrap();
    assert_eq!(c.stats().free_bytes, (1 << 20) - 128);
    assert_eq!(c.stats().used, 0, "a quarantined range is no stored data");
    c.tick(t(5_000));
    assert_eq!(c.stats().free_bytes, 1 << 20);
    assert_eq!(c.stats().quarantined_bytes, 0);
}

#[test]
fn absurd_sizes_are_full_not_a_wrap() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    for n in [u64::MAX, u64::MAX - 63, 1 << 63] {
        assert!(matches!(
            c.alloc(o, BlobId(1), n, 1, t(0)),
            Err(CoreError::Full { .. })
        ));
    }
    assert_eq!(c.stats().used, 0);
}

#[test]
fn bad_commits_are_invalid() {
    let mut c = core(1 << 20);
    let o = own(&mut c);
    c.alloc(o, BlobId(1), 10, 1, t(0)).unwrap();
    assert!(matches!(
        c.commit(o, "partition", BlobId(1), &[entry(0, "f", 5, 6)]),
        Err(CoreError::Invalid(_))
    ));
    assert!(matches!(
        c.commit(o, "partition", BlobId(1), &[]),
        Err(CoreError::Invalid(_))
    ));
    assert!(matches!(
        c.commit(o, "partition", BlobId(9), &[]),
        Err(CoreError::UnknownBlob(_))
    ));
    c.commit(o, "partition", BlobId(1), &[entry(0, "f", 0, 10)])
        .unwrap();
}
