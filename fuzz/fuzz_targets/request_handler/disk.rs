//! The driver's disk work: file writes finishing, spills, promotions and
//! the checkpoint snapshot.

use super::*;

impl H {
    /// A file write finishes: `input::DiskWritten`, never refused.
    fn disk_written(&mut self, blob: BlobId, ok: bool) {
        match self.input(core_input::DiskWritten { blob, ok }) {
            Ok(()) => {}
            other => panic!("DiskWritten of {blob:?} answered {other:?}"),
        }
    }

    pub(crate) fn flush(&mut self, which: usize, ok: bool) {
        if self.flushes.is_empty() {
            return;
        }
        match self.flushes.remove(which % self.flushes.len()) {
            FlushJob::Spill {
                blob,
                pieces,
                nbytes,
            } => {
                // The driver reads the range until it reports.
                self.note("flush_spill");
                if ok {
                    let bytes = self.pieces_bytes(&pieces, 0, nbytes);
                    self.files.insert(blob, bytes);
                }
                self.disk_written(blob, ok);
            }
            FlushJob::Put { blob } => {
                // The file as written: the report may free the blob at
                // once (a put with no entry), and the driver then removes
                // its file.
                let src = self.files.get(&blob).cloned();
                self.disk_written(blob, ok);
                let pending = self.pending.remove(&blob);
                self.note("flush_put");
                if ok {
                    let (sc, entries) =
                        pending.unwrap_or_else(|| panic!("flushed put {blob:?} was not pending"));
                    let src = src.unwrap_or_else(|| panic!("flushed put {blob:?} has no file"));
                    self.publish(&sc, &entries, &src);
                }
            }
        }
    }

    pub(crate) fn promote(&mut self, blob: u8) {
        let with_file: Vec<BlobId> = self.files.keys().copied().collect();
        let blob = match with_file.len() {
            0 => blob_id(blob),
            n => with_file[blob as usize % n],
        };
        let at = match self.input(core_input::Promote(blob)) {
            Ok(at) => at,
            other => panic!("Promote of {blob:?} answered {other:?}"),
        };
        if let Some(off) = at {
            // The driver opens the file now (it may be deleted meanwhile).
            let bytes = self
                .files
                .get(&blob)
                .unwrap_or_else(|| panic!("promoting {blob:?}, which has no file"))
                .clone();
            assert!(
                off % ALIGN == 0 && off + bytes.len() as u64 <= CAP,
                "promotion of {blob:?} to {off}"
            );
            self.promos.push((blob, off, bytes));
            self.note("promote_begin");
        }
    }

    pub(crate) fn promoted(&mut self, which: usize, ok: bool) {
        if self.promos.is_empty() {
            return;
        }
        let (blob, off, bytes) = self.promos.remove(which % self.promos.len());
        // The copy happens until the driver reports: write it last.
        let n = if ok { bytes.len() } else { bytes.len() / 2 };
        self.slab[off as usize..off as usize + n].copy_from_slice(&bytes[..n]);
        match self.input(core_input::Promoted { blob, ok }) {
            Ok(()) => {}
            other => panic!("Promoted of {blob:?} answered {other:?}"),
        }
        self.note("promote_done");
    }

    /// A checkpoint's snapshot: exactly the shadow's keys, with their bytes.
    pub(crate) fn checkpoint(&mut self) {
        let snap: Snapshot = match self.input(core_input::TakeSnapshot) {
            Ok(s) => s,
            other => panic!("Snapshot answered {other:?}"),
        };
        let mut got: Index = BTreeMap::new();
        let places: BTreeMap<BlobId, (u64, Placement)> = snap
            .blobs
            .iter()
            .map(|(b, n, p)| (*b, (*n, p.clone())))
            .collect();
        for e in &snap.entries {
            let (n, place) = places
                .get(&e.blob)
                .unwrap_or_else(|| panic!("snapshot entry of unlisted blob {:?}", e.blob));
            assert!(
                e.offset.checked_add(e.len).is_some_and(|end| end <= *n),
                "snapshot entry outside its blob"
            );
            let bytes = match place {
                Placement::Memory(_) | Placement::Split(_) => {
                    let whole = self.read_place(place);
                    assert_eq!(whole.len() as u64, *n, "snapshot place of {:?}", e.blob);
                    whole[e.offset as usize..(e.offset + e.len) as usize].to_vec()
                }
                Placement::Disk { blob, .. } => self.read_place(&Placement::Disk {
                    blob: *blob,
                    offset: e.offset,
                    len: e.len,
                }),
            };
            let old = got
                .entry(e.partition.clone())
                .or_default()
                .entry(e.key.row)
                .or_default()
                .insert(
                    e.key.field.clone(),
                    Val {
                        bytes,
                        meta: e.meta.clone(),
                    },
                );
            assert!(
                old.is_none(),
                "snapshot lists {:?} {} twice",
                e.partition,
                e.key
            );
        }
        let mut want = self.keys.clone();
        want.retain(|_, rows| !rows.is_empty());
        if got != want {
            let flat = |i: &Index| -> BTreeMap<(String, u64, String), Val> {
                i.iter()
                    .flat_map(|(p, rows)| {
                        rows.iter().flat_map(move |(r, f)| {
                            f.iter()
                                .map(move |(f, v)| ((p.clone(), *r, f.clone()), v.clone()))
                        })
                    })
                    .collect()
            };
            let (g, w) = (flat(&got), flat(&want));
            let keys: BTreeSet<_> = g.keys().chain(w.keys()).collect();
            for k in keys {
                let (a, b) = (g.get(k), w.get(k));
                if a != b {
                    panic!(
                        "checkpoint snapshot: {k:?} is {:?}, committed {:?} (same bytes: {})",
                        a.map(|v| (v.bytes.len(), &v.meta)),
                        b.map(|v| (v.bytes.len(), &v.meta)),
                        a.map(|v| &v.bytes) == b.map(|v| &v.bytes),
                    );
                }
            }
        }
        if !snap.entries.is_empty() {
            self.note("checkpoint_entries");
        }
        if let Some(pin) = snap.pin {
            let unpin = CoreRequest {
                owner: Owner::UNIT,
                op: core_op::Unpin { pin },
            };
            self.input(unpin).expect("the unit unpins its snapshot");
        }
    }
}
