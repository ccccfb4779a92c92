//! The one way to drive the core, in the shape of quinn-proto: every input
//! goes in through [`UnitCore::handle`], with the driver's clock; every
//! output comes out by polling — [`UnitCore::poll_action`] for the I/O the
//! driver does on the core's behalf, [`UnitCore::poll_timeout`] for the
//! next instant the core needs [`Input::Timeout`]. Read-only queries
//! (stats, listings, sizes) are `&self` accessors.

use super::*;

/// Everything that changes the core.
#[derive(Clone, Debug)]
pub enum Input {
    /// A new session, with no connection yet: [`Answer::Session`].
    OpenSession,
    /// A new connection of `session` ([`Answer::Attached`]). `mapped`: its
    /// peer maps the slab and copies into or out of it by itself (a
    /// Unix-socket peer). Busy when the session has
    /// [`CoreConfig::max_session_conns`] connections already.
    Attach { session: SessionId, mapped: bool },
    /// The peer of this connection maps the slab from now on.
    MakeMapped(Owner),
    /// The peer of this connection moves bytes with one-sided transfers
    /// (nixl) from now on: what it holds when its connection ends, however
    /// it ends, stays with its session until [`Input::ProcessExited`], or
    /// [`Input::Fenced`] and then [`CoreConfig::nixl_quarantine`].
    MakeOneSided(Owner),
    /// A request of a connection.
    Request { owner: Owner, op: Op },
    /// A connection ended; [`Answer::Released`] counts the holds released
    /// now (see the crate docs for which are kept, and until when).
    ConnEnded { owner: Owner, end: ConnEnd },
    /// The session's process is certainly gone (its pid exited): release
    /// everything it holds ([`Answer::Released`]).
    ProcessExited(SessionId),
    /// The one-sided endpoint of the session's peer is fenced: the driver
    /// invalidated the peer's NIXL agent (or could not, and says so). Every
    /// hold of the session whose connection ended is released once
    /// [`CoreConfig::nixl_quarantine`] has passed. [`Answer::Released`]
    /// counts the holds that now wait.
    Fenced(SessionId),
    /// Every committed entry, with the blobs that hold them pinned for the
    /// unit ([`Owner::UNIT`]) until it unpins: [`Answer::Snapshot`].
    Snapshot,
    /// A reader that pinned a spilled blob wants it back in the slab:
    /// [`Answer::Promoting`] with the range to fill from its file (when the
    /// slab has room below the high watermark), to report with
    /// [`Input::Promoted`]; `None`: read it from disk instead.
    Promote(BlobId),
    /// The driver filled (`ok`) or failed to fill a promotion's range.
    Promoted { blob: BlobId, ok: bool },
    /// The driver finished writing a blob's file (`ok`: complete and
    /// synced): a [`SpillJob`], a put answered [`Allocated::ToDisk`], a
    /// restored checkpoint's blob. For a spill the memory copy is freed
    /// (once unpinned); for a blob reserved on disk, its entries are
    /// published (if it was committed). A report of a blob with no write
    /// under way is ignored.
    DiskWritten { blob: BlobId, ok: bool },
    /// The driver copied (`ok`) or failed to copy the blob of an
    /// [`Action::Move`]. A report of a blob with no move under way is
    /// ignored.
    Moved { blob: BlobId, ok: bool },
    /// The time [`UnitCore::poll_timeout`] named has come (or passed):
    /// quarantines that ended release their ranges, fenced holds whose
    /// quarantine ended are released ([`Answer::Released`]).
    Timeout,
}

/// A connection's request.
#[derive(Clone, Debug)]
pub enum Op {
    /// Reserve `nbytes` for `blob`, held by the connection until it commits
    /// or aborts, or its connection ends: [`Answer::Allocated`]. A retry
    /// answers the same; a blob committed since answers
    /// [`Allocated::AlreadyCommitted`]. When the slab has no room and the
    /// disk tier has, the blob is reserved on disk ([`Allocated::ToDisk`]):
    /// its bytes must come with the request ([`Op::CommitWritten`]).
    Alloc {
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
    },
    /// Reserve a spare: `nbytes` of slab memory for a put whose size and
    /// entries are not known yet ([`Answer::Spare`]; `None` when the slab
    /// has no room now — a spare is an offer, never an error for want of
    /// room).
    ReserveSpare { blob: BlobId, nbytes: u64 },
    /// Give the spare `spare` the id `blob` of the put written into it
    /// ([`Answer::Named`]: false, and the spare given up, when `blob` was
    /// committed by an earlier try).
    NameSpare { spare: BlobId, blob: BlobId },
    /// Publish the entries of a reserved blob whose bytes the client
    /// wrote itself (or that were committed already):
    /// [`Answer::Committed`]. A blob reserved on the disk tier is refused:
    /// its bytes must come with a put.
    Commit {
        partition: String,
        blob: BlobId,
        entries: Vec<EntrySpec>,
    },
    /// [`Op::Commit`] of a blob whose bytes the driver wrote (a put whose
    /// payload it streamed into the slab or the blob's file, a restored
    /// checkpoint): a blob reserved on disk answers
    /// [`Committed::Pending`] until its file is durable.
    CommitWritten {
        partition: String,
        blob: BlobId,
        entries: Vec<EntrySpec>,
    },
    /// A put written into the spare `written`, committed as `blob`, and a
    /// new spare `spare` of `spare_nbytes` for the next put, in one step:
    /// [`Answer::SpareCommitted`].
    CommitSpare {
        written: BlobId,
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        spare: BlobId,
        spare_nbytes: u64,
    },
    /// Give up a reservation; with `in_flight` (a transfer may still write
    /// into it) its range is quarantined before reuse.
    Abort { blob: BlobId, in_flight: bool },
    /// Where `keys` of `partition` live, with their metadata; pins the
    /// blobs holding the found ones: [`Answer::Resolved`].
    Resolve { partition: String, keys: Vec<Key> },
    /// Drop a pin (an unknown one is ignored).
    Unpin { pin: PinId },
    /// Remove every entry of the given rows: [`Answer::Cleared`].
    ClearRows { partition: String, rows: Vec<u64> },
    /// Remove every entry of `partition`: [`Answer::Cleared`].
    ClearPartition { partition: String },
}

/// What [`UnitCore::handle`] answers.
#[derive(Clone, Debug)]
pub enum Answer {
    /// Done; nothing to say.
    Done,
    Session(SessionId),
    Attached(Owner),
    Allocated(Allocated),
    /// The spare's offset, or none for want of room.
    Spare(Option<u64>),
    /// Whether the spare took the put's id (false: it was committed).
    Named(bool),
    Committed(Committed),
    SpareCommitted(SpareCommitted),
    /// The pin (none when no key was found) and each key's place.
    Resolved {
        pin: Option<PinId>,
        found: Vec<Option<Located>>,
    },
    /// Entries removed (a client's NUL-prefixed bookkeeping fields not
    /// counted).
    Cleared(u64),
    /// Holds (reservations and pins) released, or, for
    /// [`Input::Fenced`], now waiting out the nixl quarantine.
    Released(u64),
    Snapshot(Snapshot),
    /// The slab offset of a promotion's range, or none.
    Promoting(Option<u64>),
}

/// The answer to [`Op::CommitSpare`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpareCommitted {
    /// `blob` was committed by an earlier try: nothing was published, and
    /// the spare written into was given up.
    AlreadyCommitted,
    /// The blob's file is still being made durable: ask again.
    Pending,
    /// Published; the next spare's offset (none for want of room).
    Committed { spare: Option<u64> },
}

/// I/O the driver does for the core, taken with [`UnitCore::poll_action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Copy a blob from the slab to its disk file, then report
    /// [`Input::DiskWritten`]. If the blob is freed meanwhile its range is
    /// kept until then (the driver reads it alone), and its file is deleted
    /// through an [`Action::DeleteFile`] after the report.
    Spill(SpillJob),
    /// The blob is gone: remove its disk file.
    DeleteFile(BlobId),
    /// Compaction: copy the blob's bytes to the range named (nobody can
    /// touch either while the copy runs), then report [`Input::Moved`].
    /// One move is under way at a time; see the `compact` module for the
    /// fencing rule.
    Move(MoveJob),
    /// The session holds something although none of its connections is
    /// open: watch its process, and report [`Input::ProcessExited`] once it
    /// has certainly exited. Asked again each time the session is left so.
    CheckProcess(SessionId),
}

impl UnitCore {
    /// Apply one input at `now` (the driver's clock, never going back).
    pub fn handle(&mut self, now: Time, input: Input) -> Result<Answer, CoreError> {
        // Any input may change what should spill.
        self.spill_dirty = true;
        self.last_input = now;
        Ok(match input {
            Input::OpenSession => Answer::Session(self.open_session()),
            Input::Attach { session, mapped } => Answer::Attached(self.attach(session, mapped)?),
            Input::MakeMapped(owner) => {
                self.make_mapped(owner)?;
                Answer::Done
            }
            Input::MakeOneSided(owner) => {
                self.make_one_sided(owner)?;
                Answer::Done
            }
            Input::Request { owner, op } => return self.request(now, owner, op),
            Input::ConnEnded { owner, end } => Answer::Released(self.detach(owner, end, now)),
            Input::ProcessExited(session) => Answer::Released(self.session_gone(session, now)),
            Input::Fenced(session) => Answer::Released(self.fence(session, now)),
            Input::Snapshot => Answer::Snapshot(self.snapshot(now)),
            Input::Promote(blob) => Answer::Promoting(self.promote_begin(blob)),
            Input::Promoted { blob, ok } => {
                self.promote_done(blob, ok);
                Answer::Done
            }
            Input::DiskWritten { blob, ok } => {
                self.disk_written(blob, ok);
                Answer::Done
            }
            Input::Moved { blob, ok } => {
                self.moved(blob, ok);
                Answer::Done
            }
            Input::Timeout => Answer::Released(self.expire(now)),
        })
    }

    fn request(&mut self, now: Time, owner: Owner, op: Op) -> Result<Answer, CoreError> {
        Ok(match op {
            Op::Alloc {
                blob,
                nbytes,
                n_entries,
            } => Answer::Allocated(self.alloc(owner, blob, nbytes, n_entries, now)?),
            Op::ReserveSpare { blob, nbytes } => {
                Answer::Spare(self.reserve_spare(owner, blob, nbytes, now)?)
            }
            Op::NameSpare { spare, blob } => {
                Answer::Named(self.name_spare(owner, spare, blob, now)?)
            }
            Op::Commit {
                partition,
                blob,
                entries,
            } => {
                self.refuse_disk_reservation(owner, blob)?;
                Answer::Committed(self.commit(owner, &partition, blob, &entries)?)
            }
            Op::CommitWritten {
                partition,
                blob,
                entries,
            } => Answer::Committed(self.commit(owner, &partition, blob, &entries)?),
            Op::CommitSpare {
                written,
                blob,
                partition,
                entries,
                spare,
                spare_nbytes,
            } => {
                self.refuse_disk_reservation(owner, blob)?;
                Answer::SpareCommitted(if !self.name_spare(owner, written, blob, now)? {
                    SpareCommitted::AlreadyCommitted
                } else {
                    match self.commit(owner, &partition, blob, &entries)? {
                        Committed::Pending => SpareCommitted::Pending,
                        Committed::Done => SpareCommitted::Committed {
                            spare: self.reserve_spare(owner, spare, spare_nbytes, now)?,
                        },
                    }
                })
            }
            Op::Abort { blob, in_flight } => {
                self.abort(owner, blob, in_flight, now)?;
                Answer::Done
            }
            Op::Resolve { partition, keys } => {
                let (pin, found) = self.resolve(owner, &partition, &keys, now)?;
                Answer::Resolved { pin, found }
            }
            Op::Unpin { pin } => {
                self.unpin(owner, pin)?;
                Answer::Done
            }
            Op::ClearRows { partition, rows } => {
                Answer::Cleared(self.clear_rows(&partition, &rows))
            }
            Op::ClearPartition { partition } => Answer::Cleared(self.clear_partition(&partition)),
        })
    }

    /// The next thing the driver must do for the core, if any. Spills are
    /// worked out here, once per input, while the slab is past its high
    /// watermark.
    pub fn poll_action(&mut self) -> Option<Action> {
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if self.spill_dirty {
            self.spill_dirty = false;
            if self.needs_spill() {
                for job in self.spill_jobs() {
                    self.actions.push_back(Action::Spill(job));
                }
            }
        }
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        self.next_move().map(Action::Move)
    }

    /// The next instant the core needs [`Input::Timeout`] (a quarantine or
    /// a fenced hold's nixl quarantine ends), or none. Nothing else is ever
    /// reclaimed by time.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.next_expiry()
    }
}
