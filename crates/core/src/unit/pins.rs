//! Resolving keys to places, pins and snapshots: [`op::Resolve`] and
//! [`op::Unpin`] are applied here, with leaf helpers only.

use super::input::apply_op;
use super::*;

apply_op!(op::Resolve => Resolved, |op::Resolve { partition, keys, view }, core, now, owner| {
    let (pin, found) = core.resolve(owner, &partition, &keys, view, now)?;
    Ok(Resolved { pin, found })
});
apply_op!(op::Unpin => (), |op::Unpin { pin }, core, _, owner| core.unpin(owner, pin));

impl UnitCore {
    /// The next pin id: a keyed hash of a counter, so ids are neither
    /// sequential nor guessable without the key.
    pub(super) fn new_pin_id(&mut self) -> PinId {
        loop {
            self.holds.pin_counter += 1;
            let mut h =
                siphasher::sip::SipHasher13::new_with_keys(self.cfg.id_key.0, self.cfg.id_key.1);
            std::hash::Hasher::write_u64(&mut h, self.holds.pin_counter);
            let id = PinId(std::hash::Hasher::finish(&h));
            if id.0 != 0 && !self.holds.pins.contains_key(&id) {
                return id;
            }
        }
    }

    /// Where `keys` of partition `partition` live; pins the blobs holding the found
    /// ones for `owner` (until it unpins, or its connection ends). Missing
    /// keys are `None`. The pin is `None` when no key was found.
    #[allow(clippy::type_complexity)]
    pub(super) fn resolve(
        &mut self,
        owner: Owner,
        partition: &str,
        keys: &Keys,
        view: bool,
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Placed>>), CoreError> {
        self.check_owner(owner)?;
        self.check_holds(owner.session, 0)?;
        let rows = self.index.parts.get(partition);
        let blobs_map = &self.blobs;
        let mut blobs = Vec::new();
        // The values of one put share a blob: it is looked up once per run
        // of them, and its id kept once (pin_blobs sorts and dedups what
        // is left).
        let mut last: Option<(BlobId, &Blob)> = None;
        let mut place = |e: &Entry| {
            let b = match last {
                Some((id, b)) if id == e.blob => b,
                _ => {
                    let b = blobs_map.get(&e.blob)?;
                    last = Some((e.blob, b));
                    blobs.push(e.blob);
                    b
                }
            };
            let place = match &b.region {
                Some(r) => Placement::of(r, e.offset, e.len),
                None => Placement::Disk {
                    blob: e.blob,
                    offset: e.offset,
                    len: e.len,
                },
            };
            Some((place, e.meta.clone()))
        };
        let found = match keys {
            Keys::List(keys) => keys
                .iter()
                .map(|k| place(rows?.get(&k.row)?.get(&k.field)?))
                .collect(),
            Keys::Grid { rows: ids, fields } => {
                // Each row looked up once; the answer is field-major, as
                // the keys are, written in order.
                let of_rows: Vec<_> = ids.iter().map(|id| rows.and_then(|r| r.get(id))).collect();
                let mut found = Vec::with_capacity(keys.len());
                for field in fields {
                    for row in &of_rows {
                        found.push(row.and_then(|r| r.get(field)).and_then(&mut place));
                    }
                }
                found
            }
        };
        if blobs.is_empty() {
            return Ok((None, found));
        }
        Ok((Some(self.pin_blobs(owner, blobs, view, now)), found))
    }

    pub(super) fn pin_blobs(
        &mut self,
        owner: Owner,
        mut blobs: Vec<BlobId>,
        view: bool,
        now: Time,
    ) -> PinId {
        blobs.sort_unstable();
        blobs.dedup();
        for id in &blobs {
            if let Some(Blob {
                state: State::Committed { pins, .. },
                ..
            }) = self.blobs.get_mut(id)
            {
                *pins += 1;
            }
        }
        let pin = self.new_pin_id();
        self.holds.pins.insert(
            pin,
            Pin {
                blobs,
                holder: Holder {
                    session: owner.session,
                    conn: Some(owner.conn),
                    since: now,
                    kept: Kept::Open,
                },
                view,
            },
        );
        if let Some(s) = self.holds.sessions.get_mut(&owner.session) {
            s.pins.insert(pin);
        }
        pin
    }

    /// Every committed entry of every partition, with their blobs pinned
    /// (held) so that their bytes stay while a checkpoint copies them, and
    /// the claims state of every registered partition.
    pub(super) fn snapshot(&mut self, now: Time) -> Snapshot {
        let mut entries = Vec::with_capacity(self.index.entries as usize);
        let mut blob_ids = Vec::new();
        for (partition, rows) in &self.index.parts {
            for (row, fields) in rows {
                for (field, e) in fields {
                    entries.push(SnapshotEntry {
                        partition: partition.clone(),
                        key: Key::new(*row, field.clone()),
                        blob: e.blob,
                        offset: e.offset,
                        len: e.len,
                        meta: e.meta.to_vec(),
                    });
                    blob_ids.push(e.blob);
                }
            }
        }
        blob_ids.sort_unstable();
        blob_ids.dedup();
        let blobs = blob_ids
            .iter()
            .filter_map(|id| {
                let b = self.blobs.get(id)?;
                let place = match &b.region {
                    Some(r) => Placement::of(r, 0, b.nbytes),
                    None => Placement::Disk {
                        blob: *id,
                        offset: 0,
                        len: b.nbytes,
                    },
                };
                Some((*id, b.nbytes, place))
            })
            .collect();
        let pin = (!blob_ids.is_empty()).then(|| self.pin_blobs(Owner::UNIT, blob_ids, false, now));
        Snapshot {
            pin,
            entries,
            blobs,
            claims: self.claims_snapshot(),
        }
    }

    /// Drop a pin. Unknown pins (already dropped) are ignored; another
    /// session's pin is refused.
    pub(super) fn unpin(&mut self, owner: Owner, pin: PinId) -> Result<(), CoreError> {
        let Some(p) = self.holds.pins.get(&pin) else {
            return Ok(());
        };
        p.holder
            .check(owner, || "the pin belongs to another session".into())?;
        if let Some(s) = self.holds.sessions.get_mut(&owner.session) {
            s.pins.remove(&pin);
        }
        self.drop_pin(pin);
        Ok(())
    }

    /// Drop a pin whose session record is handled by the caller.
    pub(super) fn drop_pin(&mut self, pin: PinId) {
        if let Some(p) = self.holds.pins.remove(&pin) {
            if let Some(s) = self.holds.sessions.get_mut(&p.holder.session) {
                s.pins.remove(&pin);
            }
            for blob in p.blobs {
                // Only a blob left unpinned with no entry, or spilled, may
                // give memory back now (the release module's business).
                let idle = match self.blobs.get_mut(&blob) {
                    Some(Blob {
                        state: State::Committed { pins, live },
                        disk,
                        ..
                    }) => {
                        *pins -= 1;
                        *pins == 0 && (*live == 0 || *disk == Disk::Durable)
                    }
                    _ => false,
                };
                if idle {
                    self.maybe_free(blob);
                    self.maybe_release_memory(blob);
                }
            }
        }
    }
}
