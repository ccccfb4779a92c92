//! Requests: an `Op` into a wire request, through `Request::validate` and
//! `handler::handle`, the reply checked against the shadow; a Put carried
//! out as the server does.

use super::*;

impl H {
    pub(crate) fn request(&mut self, x: u8, op: Op) {
        let Some((slot, i)) = self.conn(x) else {
            return;
        };
        let c = self.slots[slot].conns[i];
        let req = match op {
            Op::Alloc {
                blob,
                size: sz,
                n_entries,
            } => Request::Alloc {
                blob: blob_id(blob),
                nbytes: size(sz),
                n_entries: if n_entries == 255 {
                    1 << 21 // refused by validate
                } else {
                    u32::from(n_entries % 5)
                },
            },
            Op::Commit {
                blob,
                partition: p,
                entries: e,
                fit,
            } => {
                let b = blob_id(blob);
                let r = self.res.get(&b).filter(|_| fit);
                Request::Commit {
                    blob: b,
                    partition: partition(p),
                    entries: entries(&e, r.map(|r| r.nbytes), r.map(|r| r.n_entries)),
                }
            }
            Op::Abort { blob, in_flight } => Request::Abort {
                blob: blob_id(blob),
                in_flight,
            },
            Op::Resolve {
                partition: p,
                keys,
                hold,
                known,
            } => {
                let (partition, keys) = self.lookup(c.namespace, p, &keys, known);
                Request::Resolve {
                    partition,
                    keys,
                    hold,
                }
            }
            Op::Unpin { pin, reply } => Request::Unpin {
                pin: match self.seen_pins.len() {
                    n if n > 0 && pin < 240 => self.seen_pins[n - 1 - pin as usize % n],
                    _ => PinId(u64::from(pin).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                },
                reply,
            },
            Op::ClearRows { partition: p, rows } => Request::ClearRows {
                partition: partition(p),
                rows: rows.iter().map(|r| row(*r)).collect(),
            },
            Op::List { partition: p } => Request::List {
                partition: partition(p),
            },
            Op::ClearPartition { partition: p } => Request::ClearPartition {
                partition: partition(p),
            },
            Op::ListPartitions => Request::ListPartitions,
            Op::Stats => Request::Stats,
            Op::Hello => Request::Hello {
                version: PROTOCOL_VERSION,
                namespace: c.namespace.into(),
                want_fd: true,
                session: None,
            },
            Op::Shutdown => Request::Shutdown { timeout_ms: 0 },
            Op::Restore { close: true, id } => Request::CloseRestore { id: u64::from(id) },
            Op::Restore { close: false, id } => Request::OpenRestore {
                dir: format!("step-{id}/stowage/unit-0"),
            },
        };
        self.send(slot, i, req, false);
    }

    /// The partition and keys of a Resolve or Read: as given, or (`known`)
    /// a committed partition of `namespace` and keys it holds, and the
    /// given keys after them.
    pub(crate) fn lookup(
        &self,
        namespace: &str,
        p: u8,
        keys: &[KeyOp],
        known: Option<u8>,
    ) -> (String, Vec<Key>) {
        let given = keys.iter().map(|k| key(*k));
        let prefix = scope(namespace, "");
        let scopes: Vec<(&String, _)> = self
            .keys
            .iter()
            .filter(|(k, rows)| k.starts_with(&prefix) && !rows.is_empty())
            .collect();
        match known {
            Some(w) if !scopes.is_empty() => {
                let (sc, rows) = scopes[w as usize % scopes.len()];
                let all: Vec<Key> = rows
                    .iter()
                    .flat_map(|(r, f)| f.keys().map(|f| Key::new(*r, f.clone())))
                    .collect();
                let skip = (w as usize / 8) % all.len();
                let mut ks: Vec<Key> = all.into_iter().skip(skip).take(6).collect();
                ks.extend(given);
                (sc[prefix.len()..].to_owned(), ks)
            }
            _ => (partition(p), given.collect()),
        }
    }

    /// What the connection loop does with a request: validate (an invalid
    /// one ends the connection, cut by the unit), then the handler.
    pub(crate) fn send(&mut self, slot: usize, i: usize, req: Request, read_cut: bool) {
        let c = self.slots[slot].conns[i];
        let o = c.owner;
        if req.validate(&Limits::default()).is_err() {
            self.detach(slot, i, ConnEnd::Cut);
            return;
        }
        let before = self.core.stats_at(self.now);
        let pending_alloc = match &req {
            Request::Alloc {
                blob,
                nbytes,
                n_entries,
            } => Some((*blob, *nbytes, *n_entries)),
            _ => None,
        };
        let commit = match &req {
            Request::Commit {
                blob,
                partition,
                entries,
            } => Some((*blob, scope(c.namespace, partition), entries.clone())),
            _ => None,
        };
        let abort = match &req {
            Request::Abort { blob, .. } => Some(*blob),
            _ => None,
        };
        let unpin = match &req {
            Request::Unpin { pin, .. } => Some(*pin),
            _ => None,
        };
        let resolve = match &req {
            Request::Resolve {
                partition, keys, ..
            }
            | Request::Read {
                partition, keys, ..
            } => Some((scope(c.namespace, partition), keys.clone())),
            _ => None,
        };
        let is_read = matches!(req, Request::Read { .. });
        let clear = match &req {
            Request::ClearRows { partition, rows } => {
                Some((scope(c.namespace, partition), Some(rows.clone())))
            }
            Request::ClearPartition { partition } => Some((scope(c.namespace, partition), None)),
            _ => None,
        };
        let list = match &req {
            Request::List { partition } => Some(scope(c.namespace, partition)),
            _ => None,
        };
        let list_partitions = matches!(req, Request::ListPartitions);

        let asker = Asker {
            hello: Some((o, c.namespace)),
            admin: true,
            checkpoints: true,
            stopping: false,
            fenced: false,
            stale: false,
        };
        self.free_before = before.free_bytes;
        let plan = handler::handle(|| &mut self.core, &asker, req, 0, self.now);
        self.drive();

        let resp = match plan {
            Plan::Reply(r) => Some(r),
            // As the connection does: an unknown blob would name a pending
            // put whose file failed, had the disk tier kept one (the
            // target keeps none, so the reply stands).
            Plan::Committed { reply, .. } => Some(handler::committed_reply(reply, || None)),
            Plan::Silent => None,
            Plan::Wait => panic!("a claim waits, but the steps send none"),
            Plan::Resolved { pin, found, .. } => {
                let (sc, keys) = resolve.expect("Resolved answers a Resolve");
                self.resolved(o, &sc, &keys, pin, &found);
                return;
            }
            Plan::Send(read) => {
                let (sc, keys) = resolve.expect("Send answers a Read");
                self.read(slot, i, &sc, &keys, read, read_cut);
                return;
            }
            Plan::Stats => {
                let _ = self.core.stats_at(self.now);
                return;
            }
            // A second Hello: the unit refuses it and cuts the connection.
            Plan::Refuse(_) | Plan::Close { .. } => {
                self.detach(slot, i, ConnEnd::Cut);
                return;
            }
            Plan::Shutdown { .. }
            | Plan::Fence { .. }
            | Plan::Checkpoint { .. }
            | Plan::OpenRestore { .. }
            | Plan::CloseRestore { .. } => return,
            // A connection's own ring, or its view of the plane: nothing of
            // the core's. (No step sends a CopyReserved: a copy into another
            // unit's slab happens outside the core, after its plan.)
            Plan::OpenRing { .. }
            | Plan::RingKick
            | Plan::Epoch { .. }
            | Plan::SetView { .. }
            | Plan::CopyOut(_) => return,
            p @ (Plan::Drain { .. }
            | Plan::Receive(_)
            | Plan::Hello { .. }
            | Plan::NixlInfo { .. }) => {
                panic!("the handler planned {p:?} for a request that is no Put")
            }
        };
        if is_read {
            panic!("Read by an attached connection refused: {resp:?}");
        }
        if let Some(Response::Error { code, .. }) = &resp {
            self.note(match *code {
                c if c == not_owner() => "err_not_owner",
                ErrorCode::Busy => "err_busy",
                ErrorCode::Full => "err_full",
                ErrorCode::UnknownBlob => "err_unknown_blob",
                ErrorCode::InvalidRequest => "err_invalid",
                _ => "err_other",
            });
        }
        if let Some(Response::Error { code, message }) = &resp {
            if *code == not_owner() {
                assert_eq!(
                    before,
                    self.core.stats_at(self.now),
                    "a request answered {code:?} ({message}) changed the unit"
                );
            }
        }
        if let Some((blob, nbytes, n_entries)) = pending_alloc {
            let r = resp.expect("Alloc always replies");
            self.allocated(o, blob, nbytes, n_entries, &r);
        } else if let Some((blob, sc, entries)) = commit {
            let r = resp.expect("Commit always replies");
            // Its bytes must come with a Put: the core refuses the bare
            // commit of a blob its session reserved on disk.
            let on_disk = self
                .res
                .get(&blob)
                .is_some_and(|p| p.session == o.session && p.at.is_none());
            if on_disk {
                assert_eq!(
                    code(&r),
                    Some(ErrorCode::InvalidRequest),
                    "a bare Commit of {blob:?}, reserved on disk, answered {r:?}"
                );
                self.note("commit_of_disk_refused");
            }
            self.committed(o, &sc, blob, &entries, &r);
        } else if let Some(blob) = abort {
            let r = resp.expect("Abort always replies");
            self.aborted(o, blob, &r);
        } else if let Some(pin) = unpin {
            let other = self.pins.get(&pin).is_some_and(|p| p.session != o.session);
            match resp.as_ref().and_then(code) {
                Some(c) if c == not_owner() => {
                    assert!(other, "Unpin of own or unknown pin {pin:?}: {c:?}")
                }
                Some(c) => panic!("Unpin {pin:?} answered {c:?}"),
                None => {
                    assert!(!other, "Unpin of another session's pin {pin:?} succeeded");
                    assert!(
                        matches!(resp, None | Some(Response::Done)),
                        "Unpin: {resp:?}"
                    );
                    self.pins.remove(&pin);
                }
            }
        } else if let Some((sc, rows)) = clear {
            let Some(Response::Cleared { entries }) = resp else {
                panic!("ClearRows/ClearPartition answered {resp:?}");
            };
            let expect = self.clear(&sc, rows);
            assert_eq!(entries, expect, "cleared entries of {sc:?}");
        } else if let Some(sc) = list {
            let Some(Response::Listed { rows }) = resp else {
                panic!("List answered {resp:?}");
            };
            let expect: Vec<(u64, Vec<String>)> = self
                .keys
                .get(&sc)
                .map(|r| {
                    r.iter()
                        .map(|(row, f)| (*row, f.keys().cloned().collect()))
                        .collect()
                })
                .unwrap_or_default();
            assert_eq!(rows, expect, "List of {sc:?}");
        } else if list_partitions {
            let Some(Response::Partitions { names }) = resp else {
                panic!("ListPartitions answered {resp:?}");
            };
            let prefix = scope(c.namespace, "");
            let expect: Vec<String> = self
                .keys
                .keys()
                .filter_map(|k| k.strip_prefix(&prefix).map(str::to_owned))
                .collect();
            assert_eq!(names, expect, "ListPartitions of {:?}", c.namespace);
        } else {
            panic!("no check for reply {resp:?}");
        }
    }

    /// A Put as the server carries out the handler's plan: `handle`
    /// reserves, the payload goes into the slab (or the blob's file), then
    /// `handler::put_landed` commits; a payload that stops midway goes to
    /// `handler::put_abandoned` and ends the connection.
    pub(crate) fn put(&mut self, x: u8, blob: u8, p: u8, sz: u16, ops: &[EntryOp], end: PutEnd) {
        let Some((slot, i)) = self.conn(x) else {
            return;
        };
        let c = self.slots[slot].conns[i];
        let o = c.owner;
        let nbytes = size(sz);
        let blob = blob_id(blob);
        let n = (nbytes <= CAP).then_some(nbytes);
        let entries = entries(ops, n, None);
        let n_entries = entries.len() as u32;
        let req = Request::Put {
            blob,
            partition: partition(p),
            entries,
            timeout_ms: 1000,
        };
        if req.validate(&Limits::default()).is_err() {
            self.detach(slot, i, ConnEnd::Cut);
            return;
        }
        let asker = Asker {
            hello: Some((o, c.namespace)),
            admin: true,
            checkpoints: true,
            stopping: false,
            fenced: false,
            stale: false,
        };
        self.free_before = self.core.stats().free_bytes;
        let plan = handler::handle(|| &mut self.core, &asker, req, nbytes, self.now);
        self.drive();
        let conn_end = if end == PutEnd::Cut {
            ConnEnd::Cut
        } else {
            ConnEnd::Closed
        };
        let put = match plan {
            // Refused before its bytes: the server drains the payload
            // first; a payload that stops midway ends the connection.
            Plan::Drain { reply, .. } => {
                self.allocated(o, blob, nbytes, n_entries, &reply);
                if end != PutEnd::Complete {
                    self.detach(slot, i, conn_end);
                }
                return;
            }
            Plan::Receive(put) => put,
            p => panic!("the handler planned {p:?} for a Put"),
        };
        let r = match &put.into {
            Dest::Slab { pieces } => Response::Allocated {
                pieces: pieces.clone(),
                spares_back: false,
            },
            Dest::Disk => Response::ToDisk,
            Dest::Nowhere => Response::AlreadyCommitted,
        };
        self.allocated(o, blob, nbytes, n_entries, &r);
        let landed = |h: &mut H, mut put: handler::Put| {
            // put_landed takes the partition and entries for its commit.
            let (sc, entries) = (put.partition.clone(), put.entries.clone());
            let r = handler::put_landed(&mut h.core, &mut put);
            h.drive();
            h.committed(o, &sc, blob, &entries, &r);
            if code(&r).is_some() {
                // The handler aborted it (as a client's Abort would).
                h.aborted(o, blob, &Response::Done);
            }
            r
        };
        let stop = |h: &mut H, put: handler::Put| {
            let r = match handler::put_abandoned(&mut h.core, &put, end == PutEnd::Cut, h.now) {
                Ok(()) => Response::Done,
                Err(e) => error_response(&e),
            };
            h.drive();
            h.aborted(o, blob, &r);
            h.detach(slot, i, conn_end);
        };
        match put.into.clone() {
            Dest::Slab { pieces } => {
                if end != PutEnd::Complete {
                    self.write_pieces(&pieces, nbytes / 2);
                    return stop(self, put);
                }
                self.write_pieces(&pieces, nbytes);
                landed(self, put);
            }
            Dest::Disk => {
                if end != PutEnd::Complete {
                    return stop(self, put);
                }
                let bytes = self.pattern(nbytes as usize);
                self.files.insert(blob, bytes);
                if landed(self, put) == Response::Pending {
                    self.flushes.push(FlushJob::Put { blob });
                }
            }
            Dest::Nowhere if end != PutEnd::Complete => self.detach(slot, i, conn_end),
            Dest::Nowhere => {
                landed(self, put);
            }
        }
    }
}
