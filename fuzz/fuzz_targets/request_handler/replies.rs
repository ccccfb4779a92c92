//! What a reply changes in the shadow (a reservation handed out, a commit,
//! an abort, a clear) and the checks of what Resolve and Read return.

use super::*;

impl H {
    pub(crate) fn allocated(
        &mut self,
        o: Owner,
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
        r: &Response,
    ) {
        let prior = self.res.get(&blob).cloned();
        let prior = prior.as_ref();
        let same = prior.is_some_and(|p| p.nbytes == nbytes && p.n_entries == n_entries);
        let other = prior.is_some_and(|p| p.session != o.session);
        let held_elsewhere =
            prior.is_some_and(|p| p.session == o.session && p.conn.is_some_and(|c| c != o.conn));
        let at = match r {
            Response::Allocated { pieces, .. } => Some(Some(pieces.clone())),
            Response::ToDisk => Some(None),
            Response::AlreadyCommitted => {
                assert!(
                    prior.is_none(),
                    "reserved blob {blob:?} answered AlreadyCommitted"
                );
                None
            }
            Response::Error { code, message } => {
                match *code {
                    c if c == not_owner() => assert!(
                        other && same,
                        "Alloc {blob:?} answered {c:?} ({message}); shadow {prior:?}"
                    ),
                    ErrorCode::Busy if same && !other => assert!(
                        held_elsewhere,
                        "Alloc retry of {blob:?} answered Busy ({message}); shadow {prior:?}"
                    ),
                    ErrorCode::Busy | ErrorCode::Full => {
                        assert!(
                            prior.is_none(),
                            "Alloc {blob:?}: {code:?}; shadow {prior:?}"
                        );
                        // A put goes in whenever the free memory holds it,
                        // however that memory is cut.
                        assert!(
                            rounded(nbytes) > self.free_before,
                            "Alloc {blob:?} of {nbytes} bytes refused ({code:?}: {message}) \
                             with {} bytes free",
                            self.free_before
                        );
                    }
                    ErrorCode::InvalidRequest => assert!(
                        prior.is_some() && !same,
                        "Alloc {blob:?} answered invalid ({message}); shadow {prior:?}"
                    ),
                    c => panic!("Alloc {blob:?} answered {c:?} ({message})"),
                }
                None
            }
            r => panic!("Alloc answered {r:?}"),
        };
        if other && same {
            assert!(
                code(r) == Some(not_owner()),
                "Alloc of another session's {blob:?}: {r:?}"
            );
        }
        let Some(at) = at else { return };
        self.note(if at.is_some() {
            "alloc_slab"
        } else {
            "alloc_disk"
        });
        if let Some(pieces) = &at {
            for &(off, len) in pieces {
                assert!(
                    off % ALIGN == 0 && len > 0 && off.checked_add(len).is_some_and(|e| e <= CAP),
                    "Alloc {blob:?} of {nbytes} in {pieces:?}: unaligned or outside the slab"
                );
            }
            assert_eq!(
                pieces.iter().map(|p| p.1).sum::<u64>(),
                rounded(nbytes),
                "Alloc {blob:?} of {nbytes}: pieces {pieces:?}"
            );
            if pieces.len() > 1 {
                self.note("alloc_in_pieces");
            }
        } else {
            assert!(self.disk, "ToDisk without a disk tier");
            if prior.is_none() {
                assert!(
                    rounded(nbytes) > self.free_before,
                    "Alloc {blob:?} of {nbytes} sent to disk with {} bytes free",
                    self.free_before
                );
            }
        }
        if let Some(p) = prior {
            assert!(
                p.session == o.session && same && !held_elsewhere,
                "Alloc {blob:?} handed out again: {r:?}; shadow {p:?}"
            );
            assert_eq!(p.at, at, "an Alloc retry of {blob:?} moved it");
        }
        self.res.insert(
            blob,
            Res {
                session: o.session,
                conn: Some(o.conn),
                nbytes,
                n_entries,
                at,
            },
        );
    }

    pub(crate) fn committed(
        &mut self,
        o: Owner,
        sc: &str,
        blob: BlobId,
        entries: &[EntrySpec],
        r: &Response,
    ) {
        let prior = self.res.get(&blob).cloned();
        let other = prior.as_ref().is_some_and(|p| p.session != o.session);
        let mine = prior.clone().filter(|p| p.session == o.session);
        assert_eq!(
            code(r) == Some(not_owner()),
            other,
            "Commit {blob:?} answered {r:?}; shadow {prior:?}"
        );
        match r {
            Response::Done => {
                let Some(p) = mine else { return };
                self.note("commit_published");
                self.res.remove(&blob);
                let src = match &p.at {
                    Some(pieces) => self.pieces_bytes(pieces, 0, p.nbytes),
                    None => panic!("Commit of {blob:?} reserved on disk answered Done"),
                };
                self.publish(sc, entries, &src);
            }
            Response::Pending => {
                assert!(self.disk, "Pending without a disk tier");
                let Some(p) = mine else { return };
                assert!(
                    p.at.is_none(),
                    "Commit of {blob:?} in the slab answered Pending"
                );
                self.res.remove(&blob);
                self.pending.insert(blob, (sc.to_owned(), entries.to_vec()));
            }
            Response::Error { code, message } => match *code {
                c if c == not_owner() => {}
                ErrorCode::UnknownBlob => {
                    assert!(
                        prior.is_none(),
                        "Commit {blob:?}: unknown ({message}); shadow {prior:?}"
                    )
                }
                ErrorCode::InvalidRequest | ErrorCode::Full => {
                    assert!(
                        mine.is_some(),
                        "Commit {blob:?}: {code:?} ({message}) of no reservation"
                    )
                }
                c => panic!("Commit answered {c:?} ({message})"),
            },
            r => panic!("Commit answered {r:?}"),
        }
    }

    pub(crate) fn aborted(&mut self, o: Owner, blob: BlobId, r: &Response) {
        let prior = self.res.get(&blob).cloned();
        let other = prior.as_ref().is_some_and(|p| p.session != o.session);
        match r {
            Response::Done => {
                assert!(!other, "Abort of another session's {blob:?} succeeded");
                self.res.remove(&blob);
            }
            Response::Error { code, .. } if *code == not_owner() => {
                assert!(other, "Abort of {blob:?} answered {r:?}; shadow {prior:?}")
            }
            r => panic!("Abort answered {r:?}"),
        }
    }

    pub(crate) fn publish(&mut self, sc: &str, entries: &[EntrySpec], src: &[u8]) {
        let rows = self.keys.entry(sc.to_owned()).or_default();
        for e in entries {
            let bytes = src[e.offset as usize..(e.offset + e.len) as usize].to_vec();
            rows.entry(e.key.row).or_default().insert(
                e.key.field.clone(),
                Val {
                    bytes,
                    meta: e.meta.clone(),
                },
            );
        }
    }

    /// Clear rows (all with `None`); the count excludes hidden fields.
    pub(crate) fn clear(&mut self, sc: &str, rows: Option<Vec<u64>>) -> u64 {
        let Some(index) = self.keys.get_mut(sc) else {
            return 0;
        };
        let rows = rows.unwrap_or_else(|| index.keys().copied().collect());
        let mut n = 0;
        for r in rows {
            if let Some(fields) = index.remove(&r) {
                n += fields.keys().filter(|f| !f.starts_with('\0')).count() as u64;
            }
        }
        if index.is_empty() {
            self.keys.remove(sc);
        }
        n
    }

    /// Check a resolve's answer against the shadow; the bytes read.
    pub(crate) fn check_found(
        &self,
        sc: &str,
        keys: &[Key],
        pin: Option<PinId>,
        found: &[Option<Placed>],
    ) -> Vec<(Placement, Vec<u8>)> {
        assert_eq!(
            found.len(),
            keys.len(),
            "resolve answered for another number of keys"
        );
        assert_eq!(
            pin.is_some(),
            found.iter().any(Option::is_some),
            "a pin iff something was found"
        );
        let mut reads = Vec::new();
        for (k, f) in keys.iter().zip(found) {
            let want = self.keys.get(sc).and_then(|r| r.get(&k.row)?.get(&k.field));
            match (f, want) {
                (None, None) => {}
                (Some((place, _)), None) => {
                    panic!("{sc:?} {k} has no value but resolved to {place:?}")
                }
                (None, Some(v)) => {
                    panic!(
                        "{sc:?} {k} committed ({} bytes) but not found",
                        v.bytes.len()
                    )
                }
                (Some((place, meta)), Some(v)) => {
                    if matches!(place, Placement::Disk { .. }) {
                        self.disk_reads.set(self.disk_reads.get() + 1);
                    }
                    if matches!(place, Placement::Split(_)) {
                        self.split_reads.set(self.split_reads.get() + 1);
                    }
                    let got = self.read_place(place);
                    assert!(
                        got == v.bytes,
                        "{sc:?} {k} at {place:?} reads other bytes than committed"
                    );
                    assert_eq!(meta.as_slice(), &v.meta[..], "{sc:?} {k}: metadata");
                    reads.push((place.clone(), got));
                }
            }
        }
        reads
    }

    pub(crate) fn resolved(
        &mut self,
        o: Owner,
        sc: &str,
        keys: &[Key],
        pin: Option<PinId>,
        found: &[Option<Placed>],
    ) {
        let reads = self.check_found(sc, keys, pin, found);
        self.note("resolve");
        if !reads.is_empty() {
            self.note("resolve_found");
        }
        if let Some(p) = pin {
            assert!(!self.pins.contains_key(&p), "pin id {p:?} handed out twice");
            self.pins.insert(
                p,
                PinRec {
                    session: o.session,
                    conn: Some(o.conn),
                    reads,
                },
            );
            self.seen_pins.push(p);
            if self.seen_pins.len() > 32 {
                self.seen_pins.remove(0);
            }
        }
    }

    /// A Read as the server carries out the handler's plan: the pinned
    /// values are sent, then `handler::read_sent` unpins; a reader that
    /// stalls is cut off after the pin is dropped.
    pub(crate) fn read(
        &mut self,
        slot: usize,
        i: usize,
        sc: &str,
        keys: &[Key],
        read: handler::Read,
        cut: bool,
    ) {
        if !self.check_found(sc, keys, read.pin, &read.found).is_empty() {
            self.note("read_found");
        }
        if read.pin.is_some() {
            // The core's answer is not checked here: a pin left behind
            // shows up in the counters that `check` compares.
            handler::read_sent(&mut self.core, &read, self.now);
            self.drive();
        }
        if cut {
            self.detach(slot, i, ConnEnd::Cut);
        }
    }
}
