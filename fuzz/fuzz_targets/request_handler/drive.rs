//! Driving the core: every input through its one entry point, the actions
//! it asks for (as the server's `Shared::drive` takes them), compaction
//! moves, and the simulated clients' and driver's view of the shadow slab.

use super::*;

impl H {
    /// One input through the core's one entry point, then what it asks of
    /// the driver ([`H::drive`]).
    pub(crate) fn input<I: CoreInput>(&mut self, input: I) -> Result<I::Answer, CoreError> {
        let r = self.core.handle(self.now, input);
        self.drive();
        r
    }

    /// An input answered with the holds it released.
    pub(crate) fn released<I: CoreInput<Answer = u64>>(&mut self, input: I) -> u64 {
        let what = format!("{input:?}");
        match self.input(input) {
            Ok(n) => n,
            other => panic!("{what} answered {other:?}"),
        }
    }

    /// What the server's driver (`Shared::drive`) does after every input:
    /// take every action the core asks for and carry it out. A file is
    /// removed; a spill job goes to the spiller, whose write finishes at a
    /// `Flush` step; a process is watched until its session no longer
    /// holds anything with no connection open.
    pub(crate) fn drive(&mut self) {
        while let Some(a) = self.core.poll_action() {
            match a {
                Action::DeleteFile(b) => {
                    self.files.remove(&b);
                }
                Action::Spill(j) => {
                    self.note("spill_job");
                    assert!(self.disk, "spill job without a disk tier");
                    assert!(
                        self.core.blob_pieces(j.blob).as_ref() == Some(&j.pieces)
                            && j.pieces.iter().map(|p| p.1).sum::<u64>() >= j.nbytes,
                        "spill job {j:?} does not read its blob's pieces"
                    );
                    if j.pieces.len() > 1 {
                        self.note("spill_of_pieces");
                    }
                    self.flushes.push(FlushJob::Spill {
                        blob: j.blob,
                        pieces: j.pieces,
                        nbytes: j.nbytes,
                    });
                }
                Action::Move(j) => {
                    self.note("move_job");
                    self.check_move(&j);
                    self.moving = Some(j);
                    if self.move_mode & 1 == 1 {
                        self.writes += 1;
                        let ok = self.move_mode & 2 == 0 || !self.writes.is_multiple_of(4);
                        self.finish_move(ok);
                    }
                }
                Action::CheckProcess(s) => {
                    self.note("check_process");
                    assert!(
                        self.core.is_orphaned(s),
                        "asked to watch the process of {s:?}, which is not left holding something with no connection"
                    );
                    self.watched.insert(s);
                }
                Action::SessionEnded(s) => {
                    self.note("session_ended");
                    assert!(
                        !self.core.has_session(s),
                        "{s:?} reported ended while the core still has it"
                    );
                }
                // The steps send no claim, so no claim waits for an answer.
                Action::Claimed(r) => panic!("a claim answered that nobody made: {r:?}"),
            }
        }
        let core = &self.core;
        self.watched.retain(|s| core.is_orphaned(*s));
    }

    /// Every session the core may know of (the unit's own included).
    fn sessions(&self) -> Vec<SessionId> {
        let mut v: Vec<SessionId> = self.slots.iter().filter_map(|s| s.session).collect();
        v.push(Owner::UNIT.session);
        v
    }

    /// A move handed out: it reads a committed blob nobody may touch (no
    /// reservation, no pin: its pieces are in no session's ranges), and
    /// writes a range the core holds for it alone, which no session may
    /// touch either.
    fn check_move(&mut self, j: &MoveJob) {
        assert!(
            self.moving.is_none(),
            "a second move {j:?} while one is under way"
        );
        assert_eq!(
            self.core.move_under_way(),
            Some((j.blob, j.to)),
            "the move under way"
        );
        assert_eq!(
            self.core.blob_pieces(j.blob).as_ref(),
            Some(&j.from),
            "move {j:?} does not read its blob's pieces"
        );
        let len = rounded(j.nbytes);
        assert!(
            j.to.is_multiple_of(ALIGN) && j.to + len <= CAP,
            "move {j:?} targets a range outside the slab"
        );
        assert!(
            self.core
                .regions()
                .any(|(b, o, l)| b == j.blob && o == j.to && l == len),
            "the target of {j:?} is not held for its blob"
        );
        for s in self.sessions() {
            for r in self.core.session_ranges(s) {
                assert!(
                    !overlaps(r, (j.to, len)),
                    "move {j:?} writes {r:?}, which {s:?} may touch"
                );
                for &p in &j.from {
                    assert!(
                        !overlaps(r, p),
                        "move {j:?} of a blob {s:?} may touch ({r:?})"
                    );
                }
            }
        }
        if j.from.len() > 1 {
            self.note("move_gathers_pieces");
        }
    }

    /// The driver copies the blob of the move under way and reports it
    /// (`ok`: the copy is complete). Then every committed value reads
    /// back exactly, wherever its blob now is.
    pub(crate) fn finish_move(&mut self, ok: bool) {
        let Some(j) = self.moving.take() else { return };
        let len = rounded(j.nbytes);
        let target = (j.to, len);
        let held = self
            .core
            .regions()
            .any(|(b, o, l)| b == j.blob && (o, l) == target)
            || self.core.held_ranges().contains(&target);
        assert!(
            held,
            "move {j:?} reports into a range no longer held for it"
        );
        for s in self.sessions() {
            for r in self.core.session_ranges(s) {
                assert!(
                    !overlaps(r, target),
                    "the copy of {j:?} lands in {r:?}, which {s:?} may touch"
                );
            }
        }
        let bytes = self.pieces_bytes(&j.from, 0, j.nbytes);
        let n = if ok { bytes.len() } else { bytes.len() / 2 };
        self.slab[j.to as usize..j.to as usize + n].copy_from_slice(&bytes[..n]);
        let before = self.core.stats().compaction_moves;
        match self
            .core
            .handle(self.now, core_input::Moved { blob: j.blob, ok })
        {
            Ok(()) => {}
            other => panic!("Moved of {:?} answered {other:?}", j.blob),
        }
        if self.core.stats().compaction_moves > before {
            assert!(ok, "a failed move of {:?} was taken", j.blob);
            assert_eq!(
                self.core.blob_pieces(j.blob),
                Some(vec![target]),
                "the moved blob's pieces"
            );
            self.note("move_done");
        } else {
            self.note("move_not_taken");
        }
        // Once the step is done (the shadow may be behind the core until
        // then: a move can come out of the drive of a request whose answer
        // the shadow has not taken in yet).
        self.verify_values = true;
    }

    /// Every committed key of every partition resolves (for the unit) to
    /// exactly its committed bytes; the pin is dropped at once.
    pub(crate) fn verify_all_values(&mut self) {
        let scopes: Vec<(String, Vec<Key>)> = self
            .keys
            .iter()
            .map(|(sc, rows)| {
                let keys = rows
                    .iter()
                    .flat_map(|(r, f)| f.keys().map(|f| Key::new(*r, f.clone())))
                    .collect();
                (sc.clone(), keys)
            })
            .collect();
        for (sc, keys) in scopes {
            let op = core_op::Resolve {
                partition: sc.clone(),
                keys: keys.clone().into(),
                view: false,
            };
            let (pin, found) = match self.core.handle(
                self.now,
                CoreRequest {
                    owner: Owner::UNIT,
                    op,
                },
            ) {
                Ok(r) => (r.pin, r.found),
                other => panic!("the unit's resolve of {sc:?} answered {other:?}"),
            };
            self.check_found(&sc, &keys, pin, &found);
            if let Some(pin) = pin {
                let unpin = CoreRequest {
                    owner: Owner::UNIT,
                    op: core_op::Unpin { pin },
                };
                self.core
                    .handle(self.now, unpin)
                    .expect("the unit unpins its own pin");
            }
        }
    }

    /// Bytes `offset..offset + len` of a blob in `pieces`.
    pub(crate) fn pieces_bytes(&self, pieces: &[(u64, u64)], offset: u64, len: u64) -> Vec<u8> {
        locate(pieces, offset, len)
            .into_iter()
            .flat_map(|(o, l)| self.slab[o as usize..(o + l) as usize].iter().copied())
            .collect()
    }

    /// A writer writes fresh bytes over the first `len` bytes of `pieces`.
    pub(crate) fn write_pieces(&mut self, pieces: &[(u64, u64)], len: u64) {
        for (o, l) in locate(pieces, 0, len) {
            self.write_slab(o, l);
        }
    }

    /// A connection by selector: slot `x % 3`, then one of its connections.
    pub(crate) fn conn(&self, x: u8) -> Option<(usize, usize)> {
        let slot = x as usize % SLOTS;
        let n = self.slots[slot].conns.len();
        (n > 0).then(|| (slot, (x as usize / SLOTS) % n))
    }

    /// Bytes a writer puts somewhere: different for every write.
    pub(crate) fn pattern(&mut self, len: usize) -> Vec<u8> {
        self.writes += 1;
        let w = self.writes.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (0..len)
            .map(|i| (w.wrapping_add((i as u64).wrapping_mul(0x2545_f491)) >> 29) as u8)
            .collect()
    }

    fn write_slab(&mut self, offset: u64, len: u64) {
        assert!(
            offset + len <= CAP,
            "write of {len} at {offset} outside the slab"
        );
        let p = self.pattern(len as usize);
        self.slab[offset as usize..(offset + len) as usize].copy_from_slice(&p);
    }

    pub(crate) fn read_place(&self, place: &Placement) -> Vec<u8> {
        match *place {
            Placement::Memory(l) => {
                assert!(
                    l.offset.checked_add(l.len).is_some_and(|e| e <= CAP),
                    "location {l:?} outside the slab"
                );
                self.slab[l.offset as usize..(l.offset + l.len) as usize].to_vec()
            }
            Placement::Split(ref parts) => {
                assert!(
                    parts.len() >= 2 && parts.iter().all(|l| l.len > 0),
                    "a split place of fewer than two parts, or an empty one: {place:?}"
                );
                parts
                    .iter()
                    .flat_map(|l| {
                        assert!(
                            l.offset.checked_add(l.len).is_some_and(|e| e <= CAP),
                            "location {l:?} outside the slab"
                        );
                        self.slab[l.offset as usize..(l.offset + l.len) as usize].iter()
                    })
                    .copied()
                    .collect()
            }
            Placement::Disk { blob, offset, len } => {
                let f = self
                    .files
                    .get(&blob)
                    .unwrap_or_else(|| panic!("{place:?}: blob {blob:?} has no disk file"));
                let end = offset.checked_add(len).filter(|e| *e <= f.len() as u64);
                let end = end.unwrap_or_else(|| {
                    panic!(
                        "{place:?} outside blob {blob:?}'s file of {} bytes",
                        f.len()
                    )
                });
                f[offset as usize..end as usize].to_vec()
            }
        }
    }
}
