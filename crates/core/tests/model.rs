//! Model-based test of [`UnitCore`], with sessions, pauses and fencing.
//!
//! Random sequences of operations run against a small unit (32 KiB) and,
//! side by side, against a plain model of what the unit should hold. A
//! `Vec<u8>` stands in for the slab: whoever may write a range (a client
//! copying into its reservation, the unit streaming a tcp put into it, a cut
//! stream whose last bytes land in a quarantined range, a promotion copying
//! a file back) writes fresh bytes over it, at any time the model says it
//! still may. If the core ever hands out a range that someone may still
//! touch, a later check reads changed bytes.
//!
//! ## Sessions and fencing
//!
//! The unit serves three session slots. Each slot holds at most one live
//! session (a client process) with up to two connections
//! ([`MAX_SESSION_CONNS`]; a third `attach` answers Busy); a connection is
//! *direct* (shm: the client itself copies into its reservations and reads
//! its pinned ranges) or not (tcp: the unit's own thread copies). Every
//! reservation and pin has a holder: its session and the connection that
//! took it, or no connection once the unit cut a direct one. The model
//! follows the rules of the core (see the crate docs), and the test checks
//! that they hold:
//!
//! * only the holding session may commit, abort or unpin (any of its
//!   connections); another session gets `NotOwner` and nothing changes; a
//!   detached connection may neither alloc nor resolve (`NotOwner`);
//! * a retried alloc from another open connection of the same session is
//!   Busy while the holding connection is open, and takes the reservation
//!   over once that connection was cut;
//! * a connection the peer closed releases everything it held at once; one
//!   the unit cut releases its pins and quarantines its reservations (the
//!   range, for [`QUARANTINE_MS`]; the blob id is forgotten, so a retry
//!   reserves afresh) when the peer is not direct, and keeps everything
//!   with the session (orphaned) when it is, until `session_gone` or a
//!   takeover;
//! * a *one-sided* connection (nixl, `make_one_sided`: the client moves
//!   bytes with transfers the unit never sees) keeps what it holds however
//!   it ends, a clean close included, until `session_gone`, a takeover, or
//!   (for a peer that does not also map the slab) a `fence` of its session
//!   followed by the nixl quarantine ([`NIXL_QUARANTINE_MS`]), at whose end
//!   a tick releases it;
//! * no timer ever ends a hold: pauses of minutes and hours (with ticks)
//!   only end quarantines; holds older than their lease are *reported*
//!   (`stats_at(now).overdue_holds`).
//!
//! The fence invariant, checked after every step: every range a session may
//! still touch (its reservations and the blobs it pinned, whether its
//! connection is open or was cut) is exactly one of the ranges the unit
//! holds, overlapping no other (no other blob, promotion, quarantine or
//! spill source), and is what `session_ranges` reports; its bytes change
//! only by its own writer (a reservation reads back what its writer last
//! wrote; a pinned value reads back what its reader read when it pinned).
//! Scripted ops drive the worst cases through it: a *paused writer* (a
//! direct client reserves, maybe has its connection cut, pauses for minutes
//! or hours, others put meanwhile, then it resumes and writes its whole
//! reservation: every other value must still read back exactly), a *paused
//! reader* (a direct client pins values, maybe is cut, their rows are
//! released and rewritten by others over a long pause: its pinned bytes
//! must not change), and, with a disk tier, a *late promotion* (the driver
//! copies a file back into the slab while the blob's reader lets go and its
//! row is cleared; others put; the late copy must land in no one's bytes).
//! Other ops pause at random too: time jumps by minutes or hours between
//! any two requests, and any writer that may still write does so at any
//! point.
//!
//! ## The disk tier
//!
//! [`unit_core_matches_model`] runs the unit without a disk tier,
//! [`unit_core_with_disk_matches_model`] with one (a 16 KiB slab, a 24 KiB
//! disk, watermarks 0.75 / 0.5, and more puts than releases, so that both
//! fill up). With the disk tier the test also plays the driver, against a
//! simulated disk (a map `BlobId → Vec<u8>` of files):
//!
//! * a put answered `ToDisk` has its bytes written to its file at once (the
//!   client streams them); the file is then "being synced" until a later
//!   `Complete` op reports `disk_written(blob, ok)` (mostly ok);
//! * after every input the driver polls the core's actions: the spill jobs
//!   it hands out must be exactly what the watermarks call for; each is
//!   written (its slab bytes copied into the file when the write finishes)
//!   by a later `Spill` or `Complete` op, ok or failed;
//!   a blob freed meanwhile keeps its slab range until the write reports;
//! * a resolve that finds values on disk sometimes promotes their blob:
//!   `promote_begin`, copy the file into the slab range, `promote_done`, at
//!   once (ok or failed) or later, with or without a pin of the driver's
//!   own (the unit's); a blob freed meanwhile keeps its promotion range
//!   until `promote_done`, and the late copy must land in no one's bytes;
//! * stray reports (`disk_written` / `promote_done` of a blob with nothing
//!   in flight) must change nothing;
//! * after every op the driver polls the core's actions and removes the
//!   files they name. A `DeleteFile` for a put still being synced cancels
//!   that put's write (the driver stops writing and will not report it).
//!
//! ## Extents and compaction
//!
//! A blob's slab range is one or more pieces, as the core answered them
//! (`Allocated::Reserved { pieces }`): the model writes and reads a blob's
//! bytes through its pieces in order, a value crossing pieces is found as
//! `Placement::Split` (its parts read back concatenated), and spill jobs read
//! the pieces they name. The slab is cut into holes by clears, so that
//! puts take several pieces. Every alloc is checked against the free
//! memory: it is refused (Busy, Full) or sent to disk only when its
//! rounded size exceeds the free bytes (capacity minus everything held:
//! blobs, reservations, quarantines, spills, promotions and moves under
//! way), and in particular, when no session holds a reservation or pin, a
//! put whose bytes fit the free memory is always reserved; it is in one
//! piece exactly when some free range holds it.
//!
//! The test also plays the driver for compaction (the cases lower
//! `compact_min_free` so that it runs in this small slab). A move handed
//! out by `poll_action` must read a committed blob that no one can touch
//! (unpinned, not being spilled or promoted, its pieces as the model has
//! them), gain something (gather pieces, or move down), and target a range
//! that overlaps nothing held and no range a session may touch. The driver
//! copies the bytes and reports `input::Moved` at once or later (often
//! with the copy made at once and the report later: the target must then
//! be unchanged when it reports), mostly ok; meanwhile other ops run:
//! puts, clears (the blob freed: both ranges stay held until the report),
//! resolves that pin the very blob (`Op::MoveRace`: a reader that pinned
//! it during the copy keeps its range and bytes; the move is abandoned).
//! After a report the blob is in its new range only if nobody touched it,
//! and every value reads back exactly (check 2). Stats count the moves and
//! their bytes as the model does.
//!
//! ## Properties checked after every operation (see [`Harness::check`])
//!
//! 1. Space is never handed out twice: the ranges of `core.regions()` and
//!    `core.held_ranges()` are aligned, pairwise disjoint, inside the
//!    capacity, and exactly the ranges the model says the unit holds (no
//!    leak, no early free). The core may drop the memory copy of a blob on
//!    its own only when the blob is committed, durable on disk and unpinned.
//! 2. Every key of the model resolves to where its blob is and reads back
//!    the exact committed bytes, from the simulated slab or file; other
//!    keys (and every key of another namespace) resolve to `None` without
//!    a pin.
//! 3. Every pin the unit still holds (by an open connection, orphaned by a
//!    cut, the unit's own) still sees its values' bytes.
//! 4. The counters of `stats()` and `stats_at(now)` match the model: stored
//!    data (`used`), free bytes and the largest free range (the zones are
//!    not merged), reserved and quarantined bytes, blobs in pieces,
//!    compaction moves and bytes, blobs, entries, pins, disk use, index
//!    bytes, and per session its open
//!    connections, reservations, pins, held bytes, oldest hold, orphaned
//!    holds and the number of overdue holds.
//! 5. The simulated disk holds exactly the files the model expects.
//! 6. The core's effects are exactly the file removals the model predicts,
//!    and none names a file still needed.
//! 7. The fence invariant above; `orphaned_sessions()` and `has_session`
//!    match the model (a session is forgotten once it has no connection and
//!    holds nothing); `next_deadline()` is the end of the first quarantine
//!    or nixl quarantine.
//!
//! Each operation's answer is also checked against the model's prediction
//! (Reserved / ToDisk / AlreadyCommitted / Invalid / UnknownBlob / NotOwner
//! / Busy / Full and their numbers, Done vs Pending, the count returned by
//! clear_rows, which spill jobs may be handed out, ...). A commit past the
//! index byte budget ([`INDEX_BUDGET`]) answers Full and changes nothing.
//!
//! At the end every in-flight write and promotion finishes, the unit's pins
//! go, every connection closes, every orphaned session is declared gone,
//! every row is released and time runs past every quarantine: the unit must
//! be empty again (no session, no byte, pin, entry, blob or file left, no
//! timer) and able to hand out its whole capacity in one piece.
//!
//! Both tests assert that their cases, together, reached every session path
//! (cuts of both kinds, session deaths, NotOwner refusals, Busy retries,
//! takeovers, long pauses, resumed paused writers and readers, ...) and
//! every extent and compaction path (puts in pieces, split values, moves
//! done, failed, abandoned for a pin, of freed blobs, raced by readers),
//! and the disk test every disk-tier path, so that a change of the
//! generator cannot quietly stop testing one. A path some run misses by
//! chance sends it into another run with a fresh seed, three runs at most.
//! `PROPTEST_CASES=20000` runs a longer soak.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use stowage_core::{
    input, Action, Allocated, BlobId, Committed, ConnEnd, CoreConfig, CoreError, EntrySpec, Held,
    Input, Key, MoveJob, Owner, PinId, Placed, Placement, Request, SessionId, SessionStats,
    SlabRange, Snapshot, SnapshotEntry, SpillJob, Stats, Time, UnitCore,
};

/// The calls this test makes, each one input through the core's one entry
/// point ([`UnitCore::handle`]) with its answer unpacked.
trait Drive {
    fn input<I: Input>(&mut self, now: Time, input: I) -> Result<I::Answer, CoreError>;

    fn request<O: stowage_core::Op>(
        &mut self,
        owner: Owner,
        op: O,
        now: Time,
    ) -> Result<O::Answer, CoreError> {
        self.input(now, Request { owner, op })
    }

    fn released<I: Input<Answer = u64>>(&mut self, now: Time, input: I) -> u64 {
        match self.input(now, input) {
            Ok(n) => n,
            other => panic!("answered {other:?}"),
        }
    }

    fn open_session(&mut self) -> SessionId {
        match self.input(Time::ZERO, input::OpenSession) {
            Ok(s) => s,
            other => panic!("OpenSession answered {other:?}"),
        }
    }

    fn attach(&mut self, session: SessionId, mapped: bool) -> Result<Owner, CoreError> {
        self.input(Time::ZERO, input::Attach { session, mapped })
    }

    fn make_one_sided(&mut self, owner: Owner) -> Result<(), CoreError> {
        self.input(Time::ZERO, input::MakeOneSided(owner))
            .map(|_| ())
    }

    fn detach(&mut self, owner: Owner, end: ConnEnd, now: Time) -> u64 {
        self.released(now, input::ConnEnded { owner, end })
    }

    fn session_gone(&mut self, session: SessionId, now: Time) -> u64 {
        self.released(now, input::ProcessExited(session))
    }

    fn fence(&mut self, session: SessionId, now: Time) -> u64 {
        self.released(now, input::Fenced(session))
    }

    fn tick(&mut self, now: Time) -> u64 {
        self.released(now, input::Timeout)
    }

    fn alloc(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
        now: Time,
    ) -> Result<Allocated, CoreError> {
        let op = stowage_core::op::Alloc {
            blob,
            nbytes,
            n_entries,
        };
        self.request(owner, op, now)
    }

    /// A commit of bytes the driver wrote (the model's puts write their
    /// bytes themselves, disk reservations included).
    fn commit(
        &mut self,
        owner: Owner,
        partition: &str,
        blob: BlobId,
        entries: &[EntrySpec],
    ) -> Result<Committed, CoreError> {
        let op = stowage_core::op::CommitWritten {
            partition: partition.to_owned(),
            blob,
            entries: entries.to_vec(),
        };
        self.request(owner, op, Time::ZERO)
    }

    fn abort(
        &mut self,
        owner: Owner,
        blob: BlobId,
        in_flight: bool,
        now: Time,
    ) -> Result<(), CoreError> {
        self.request(owner, stowage_core::op::Abort { blob, in_flight }, now)
            .map(|_| ())
    }

    #[allow(clippy::type_complexity)]
    fn resolve_with_meta(
        &mut self,
        owner: Owner,
        partition: &str,
        keys: &[Key],
        view: bool,
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Placed>>), CoreError> {
        let op = stowage_core::op::Resolve {
            partition: partition.to_owned(),
            keys: keys.to_vec().into(),
            view,
        };
        self.request(owner, op, now).map(|r| (r.pin, r.found))
    }

    #[allow(clippy::type_complexity)]
    fn resolve(
        &mut self,
        owner: Owner,
        partition: &str,
        keys: &[Key],
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Placement>>), CoreError> {
        let (pin, found) = self.resolve_with_meta(owner, partition, keys, false, now)?;
        Ok((pin, found.into_iter().map(|f| f.map(|(p, _)| p)).collect()))
    }

    fn unpin(&mut self, owner: Owner, pin: PinId) -> Result<(), CoreError> {
        self.request(owner, stowage_core::op::Unpin { pin }, Time::ZERO)
            .map(|_| ())
    }

    fn clear_rows(&mut self, partition: &str, rows: &[u64]) -> u64 {
        let op = stowage_core::op::ClearRows {
            partition: partition.to_owned(),
            rows: rows.to_vec(),
        };
        match self.request(Owner::UNIT, op, Time::ZERO) {
            Ok(n) => n,
            other => panic!("ClearRows answered {other:?}"),
        }
    }

    fn snapshot(&mut self, now: Time) -> Snapshot {
        match self.input(now, input::TakeSnapshot) {
            Ok(s) => s,
            other => panic!("Snapshot answered {other:?}"),
        }
    }

    fn disk_written(&mut self, blob: BlobId, ok: bool) {
        self.input(Time::ZERO, input::DiskWritten { blob, ok })
            .expect("a disk report is never refused");
    }

    fn promote_begin(&mut self, blob: BlobId) -> Option<u64> {
        match self.input(Time::ZERO, input::Promote(blob)) {
            Ok(p) => p,
            other => panic!("Promote answered {other:?}"),
        }
    }

    fn promote_done(&mut self, blob: BlobId, ok: bool) {
        self.input(Time::ZERO, input::Promoted { blob, ok })
            .expect("a promotion report is never refused");
    }

    fn moved(&mut self, blob: BlobId, ok: bool) {
        self.input(Time::ZERO, input::Moved { blob, ok })
            .expect("a move report is never refused");
    }

    fn next_deadline(&self) -> Option<Time>;

    /// Every action queued: the files to delete, the spill jobs, the
    /// sessions whose process to watch, the compaction moves.
    #[allow(clippy::type_complexity)]
    fn actions(&mut self) -> (Vec<BlobId>, Vec<SpillJob>, Vec<SessionId>, Vec<MoveJob>);
}

impl Drive for UnitCore {
    fn input<I: Input>(&mut self, now: Time, input: I) -> Result<I::Answer, CoreError> {
        self.handle(now, input)
    }

    fn next_deadline(&self) -> Option<Time> {
        self.poll_timeout()
    }

    #[allow(clippy::type_complexity)]
    fn actions(&mut self) -> (Vec<BlobId>, Vec<SpillJob>, Vec<SessionId>, Vec<MoveJob>) {
        let (mut deletes, mut spills, mut watch, mut moves) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        while let Some(a) = self.poll_action() {
            match a {
                Action::DeleteFile(b) => deletes.push(b),
                Action::Spill(j) => spills.push(j),
                Action::CheckProcess(s) => watch.push(s),
                Action::Move(m) => moves.push(m),
                Action::Claimed(r) => panic!("no claim was made, yet one was answered: {r:?}"),
                Action::SessionEnded(_) => {}
            }
        }
        (deletes, spills, watch, moves)
    }
}

/// Slab of the test without a disk tier.
const CAP: u64 = 32 * 1024;
/// Slab and disk tier of the disk test: small, so that both fill up often.
const DISK_TEST_CAP: u64 = 16 * 1024;
const DISK_CAP: u64 = 24 * 1024;
const HIGH_WATERMARK: f64 = 0.75;
const LOW_WATERMARK: f64 = 0.5;
const ALIGN: u64 = 64;
/// Leases only decide which holds `stats_at` reports as overdue.
const RESERVATION_LEASE_MS: u64 = 20;
const PIN_LEASE_MS: u64 = 15;
const QUARANTINE_MS: u64 = 5;
/// `CoreConfig::nixl_quarantine` of the test: how long the holds of a
/// one-sided peer's ended connections stay once `fence` is called.
const NIXL_QUARANTINE_MS: u64 = 7;
/// Blob ids come from a small pool so that ids get retried and reused
/// (also by other sessions).
const N_BLOBS: u8 = 24;
const ROWS: u64 = 8;
const FIELDS: [&str; 3] = ["a", "b", "c"];
const NS: &str = "ns";
const MAX_BLOB: u64 = 8 * 1024;
/// Session slots: at most this many client processes at a time.
const SLOTS: usize = 3;
/// `CoreConfig::max_session_conns` of the test.
const MAX_SESSION_CONNS: usize = 2;
/// Index bytes an entry costs beyond its field name and metadata
/// (`stowage_core`'s `ENTRY_OVERHEAD`, not exported; the `index_bytes`
/// counter checks that the two agree).
const ENTRY_OVERHEAD: u64 = 96;
/// The index byte budget: about 12 of the 24 keys, so that commits past it
/// happen.
const INDEX_BUDGET: u64 = 12 * (ENTRY_OVERHEAD + 1 + 3);
const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 60 * MINUTE_MS;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn rounded(nbytes: u64) -> u64 {
    nbytes.div_ceil(ALIGN).max(1) * ALIGN
}

fn blob_id(i: u8) -> BlobId {
    BlobId(u128::from(i % N_BLOBS) + 1)
}

fn key(row: u64, field: usize) -> Key {
    Key::new(row, FIELDS[field % FIELDS.len()])
}

fn all_keys() -> Vec<Key> {
    (0..ROWS)
        .flat_map(|r| (0..FIELDS.len()).map(move |f| key(r, f)))
        .collect()
}

fn entry_cost(e: &EntrySpec) -> u64 {
    ENTRY_OVERHEAD + e.key.field.len() as u64 + e.meta.len() as u64
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// A blob's slab range: (offset, bytes) of each piece, in the order of the
/// blob's bytes, as the core answered them.
type Pieces = Vec<(u64, u64)>;

/// The spare zone's bytes at the top of a slab of `cap` (the core's
/// default budget, 1/16 of the slab, rounded down to the alignment).
fn spare_budget(cap: u64) -> u64 {
    (cap / 16 / ALIGN * ALIGN).min(cap / 2 / ALIGN * ALIGN)
}

/// Where bytes `offset..offset + len` of a blob in `pieces` lie: (slab
/// offset, bytes) of each part, in order.
fn locate(pieces: &[(u64, u64)], mut offset: u64, len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut left = len;
    for &(start, plen) in pieces {
        if left == 0 {
            break;
        }
        if offset >= plen {
            offset -= plen;
            continue;
        }
        let n = (plen - offset).min(left);
        out.push((start + offset, n));
        left -= n;
        offset = 0;
    }
    out
}

/// The place the core should answer for bytes `offset..offset + len` of a
/// blob in `pieces`: one range, or its parts when it crosses pieces; a
/// zero-length value where it would start.
fn place_in(pieces: &[(u64, u64)], offset: u64, len: u64) -> Placement {
    let parts = locate(pieces, offset, len);
    match parts.as_slice() {
        [] => {
            let mut at = offset;
            let mut start = None;
            for &(o, l) in pieces {
                if at < l {
                    start = Some(o + at);
                    break;
                }
                at -= l;
            }
            let (o, l) = pieces[pieces.len() - 1];
            Placement::Memory(SlabRange {
                offset: start.unwrap_or(o + l),
                len: 0,
            })
        }
        [(o, l)] => Placement::Memory(SlabRange {
            offset: *o,
            len: *l,
        }),
        _ => Placement::Split(
            parts
                .into_iter()
                .map(|(offset, len)| SlabRange { offset, len })
                .collect(),
        ),
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Alloc a blob of the pool (new, retried or reused id) from a
    /// connection (`who`; now and then a detached one).
    Alloc {
        who: u8,
        blob: u8,
        size: u64,
        n: u32,
    },
    /// Retry an alloc: same parameters for a reserved blob, from its
    /// holding connection (same answer), another connection of its session
    /// (Busy, or a takeover after a cut; reconnecting if need be) or
    /// another session (NotOwner); any parameters for a committed one
    /// (AlreadyCommitted); the same parameters for a put answered Busy for
    /// memory (Busy again only for the reservations of its first refusal).
    Retry {
        who: u8,
        pick: u8,
    },
    /// Commit a blob, preferably one the test reserved, mostly from its
    /// session. `entries` are (row, field, offset seed, length seed);
    /// `fault` sometimes makes the commit invalid.
    Commit {
        who: u8,
        pick: u8,
        entries: Vec<(u64, usize, u16, u16)>,
        fault: u8,
    },
    Abort {
        who: u8,
        pick: u8,
        in_flight: bool,
    },
    /// A writer that may still write does: a client (maybe paused for
    /// hours, maybe cut) into its reservation, the unit into a tcp put, a
    /// cut stream into its quarantined range.
    Scribble {
        pick: u8,
    },
    /// Resolve keys from a connection. With a disk tier, `promote` says
    /// what the driver does with blobs found on disk: nothing, promote at
    /// once, promote later (`0x20`: holding a pin of its own), or promote
    /// and fail.
    Resolve {
        who: u8,
        keys: Vec<(u64, usize)>,
        promote: u8,
    },
    /// A snapshot: every entry, its blobs pinned by the unit.
    Snapshot,
    /// Unpin a live pin (mostly from its session), or (`stale`) one already
    /// unpinned or never handed out.
    Unpin {
        who: u8,
        pick: usize,
        stale: bool,
    },
    ClearRows {
        rows: Vec<u64>,
    },
    /// Advance the virtual clock by anything from a millisecond to two days
    /// (a paused process, a stalled driver), then (mostly) tick.
    Advance {
        ms: u64,
        tick: bool,
    },
    /// Open a connection in a slot (a new session if the slot has none);
    /// `stale`: attach to a session that is gone (Invalid); `one_sided`:
    /// its peer then moves bytes with one-sided transfers (nixl,
    /// `make_one_sided`).
    Attach {
        slot: u8,
        direct: bool,
        stale: bool,
        one_sided: bool,
    },
    /// The driver fenced a session's one-sided endpoint (invalidated its
    /// peer's NIXL agent): what its ended one-sided connections hold goes
    /// once the nixl quarantine has passed.
    Fence {
        pick: u8,
    },
    /// A connection ends: closed by its peer, or cut by the unit. Now and
    /// then one that already ended (nothing changes). With `fence`, the
    /// driver then fences the session at once if its ended one-sided
    /// connections left holds, as the unit does when a nixl agent's last
    /// connection ends.
    Detach {
        who: u8,
        cut: bool,
        fence: bool,
    },
    /// A session's process is gone: mostly an orphaned one (its connections
    /// were cut), sometimes one with only direct connections left open, or
    /// one already gone (nothing changes).
    SessionGone {
        pick: u8,
    },
    /// The paused writer: a direct client reserves, is maybe cut, pauses
    /// for `pause` ms while other sessions put `others` (blob size, row,
    /// field), resumes and writes its whole reservation; `then` it stays,
    /// completes (taking its reservation over if cut) or ends.
    PausedWriter {
        slot: u8,
        size: u64,
        cut: bool,
        pause: u64,
        others: Vec<(u64, u64, usize)>,
        then: u8,
    },
    /// The paused reader: a direct client pins `keys` (the driver maybe
    /// promoting those on disk meanwhile), is maybe cut, the rows are
    /// released and other sessions put `others` over a pause of `pause` ms;
    /// then its pinned bytes must be unchanged; `then` it stays, unpins or
    /// ends.
    PausedReader {
        slot: u8,
        keys: Vec<(u64, usize)>,
        cut: bool,
        pause: u64,
        others: Vec<(u64, u64, usize)>,
        then: u8,
    },
    /// A late promotion copy (a paused driver): the driver spills to make
    /// room, a reader pins a value found on disk and the driver starts
    /// promoting its blob with no pin of its own; the row is released and
    /// the reader's hold ends (`end`: unpin, close, cut, or kept) before
    /// the copy lands, while other sessions put `others`.
    LatePromotion {
        who: u8,
        pick: u8,
        end: u8,
        others: Vec<(u64, u64, usize)>,
    },
    /// The driver asks for spill jobs; job `i` is written at once or later
    /// (`plan[i % 4].0`), and succeeds or fails (`plan[i % 4].1`).
    Spill {
        plan: Vec<(bool, bool)>,
    },
    /// A reader races a compaction move: while the driver copies a blob
    /// (a move handed out and not reported yet), a direct client pins one
    /// of its values; `then` says what happens before the copy lands (the
    /// row is cleared, the reader lets go, others put `others`, the blob's
    /// bytes spill). A reader still holding its pin when the move reports
    /// keeps reading the same range and bytes: the blob did not move.
    MoveRace {
        slot: u8,
        then: u8,
        others: Vec<(u64, u64, usize)>,
    },
    /// One in-flight disk write, promotion or move finishes.
    Complete {
        pick: u8,
        ok: bool,
    },
    /// A stray report: `disk_written`, `promote_done` or `moved` of a blob
    /// that has nothing in flight changes nothing.
    Stray {
        pick: u8,
        ok: bool,
        promote: bool,
    },
}

/// A pause: mostly milliseconds, sometimes minutes, sometimes hours.
fn pause_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..25,
        2 => 1_000u64..10 * MINUTE_MS,
        1 => HOUR_MS..48 * HOUR_MS,
    ]
}

/// Operations of a case. With a disk tier, puts and commits come more
/// often and releases less, so that the slab fills past the high watermark
/// and the disk fills up too.
fn op_strategy(disk: bool) -> impl Strategy<Value = Op> {
    // Now and then larger than a slab (Full; with a disk tier, maybe ToDisk).
    let size = prop_oneof![12 => 0..=MAX_BLOB, 4 => 0u64..130, 1 => 2 * MAX_BLOB..6 * MAX_BLOB];
    let small = prop_oneof![1 => 0..=MAX_BLOB / 2, 1 => 0u64..130];
    let (put, release, advance, driver) = if disk { (6, 1, 2, 3) } else { (4, 2, 3, 1) };
    // Without a disk tier there is nothing to promote: a no-op, rarely.
    let late = if disk { 2 } else { 1 };
    let others = prop::collection::vec((small.clone(), 0..ROWS, 0..FIELDS.len()), 1..4);
    let others_race = others.clone();
    prop_oneof![
        put => (any::<u8>(), 0..N_BLOBS, size.clone(), 0u32..4)
            .prop_map(|(who, blob, size, n)| Op::Alloc { who, blob, size, n }),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(who, pick)| Op::Retry { who, pick }),
        put + 1 => (
            any::<u8>(),
            any::<u8>(),
            prop::collection::vec((0..ROWS, 0..FIELDS.len(), any::<u16>(), any::<u16>()), 4),
            any::<u8>(),
        )
            .prop_map(|(who, pick, entries, fault)| Op::Commit { who, pick, entries, fault }),
        1 => (any::<u8>(), any::<u8>(), any::<bool>())
            .prop_map(|(who, pick, in_flight)| Op::Abort { who, pick, in_flight }),
        2 => any::<u8>().prop_map(|pick| Op::Scribble { pick }),
        3 => (
            any::<u8>(),
            prop::collection::vec((0..ROWS, 0..FIELDS.len()), 1..5),
            any::<u8>(),
        )
            .prop_map(|(who, keys, promote)| Op::Resolve { who, keys, promote }),
        1 => Just(Op::Snapshot),
        3 => (any::<u8>(), any::<usize>(), prop::bool::weighted(0.15))
            .prop_map(|(who, pick, stale)| Op::Unpin { who, pick, stale }),
        release => prop::collection::vec(0..ROWS + 1, 0..4).prop_map(|rows| Op::ClearRows { rows }),
        advance => (pause_strategy(), prop::bool::weighted(0.8))
            .prop_map(|(ms, tick)| Op::Advance { ms, tick }),
        2 => (any::<u8>(), any::<bool>(), prop::bool::weighted(0.1), prop::bool::weighted(0.3))
            .prop_map(|(slot, direct, stale, one_sided)| Op::Attach { slot, direct, stale, one_sided }),
        1 => any::<u8>().prop_map(|pick| Op::Fence { pick }),
        2 => (any::<u8>(), any::<bool>(), any::<bool>())
            .prop_map(|(who, cut, fence)| Op::Detach { who, cut, fence }),
        1 => any::<u8>().prop_map(|pick| Op::SessionGone { pick }),
        1 => (
            any::<u8>(),
            small.clone(),
            any::<bool>(),
            prop_oneof![1 => MINUTE_MS..10 * MINUTE_MS, 2 => HOUR_MS..48 * HOUR_MS],
            others.clone(),
            any::<u8>(),
        )
            .prop_map(|(slot, size, cut, pause, others, then)| Op::PausedWriter {
                slot, size, cut, pause, others, then
            }),
        1 => (
            any::<u8>(),
            prop::collection::vec((0..ROWS, 0..FIELDS.len()), 1..3),
            any::<bool>(),
            prop_oneof![1 => MINUTE_MS..10 * MINUTE_MS, 2 => HOUR_MS..48 * HOUR_MS],
            others.clone(),
            any::<u8>(),
        )
            .prop_map(|(slot, keys, cut, pause, others, then)| Op::PausedReader {
                slot, keys, cut, pause, others, then
            }),
        late => (any::<u8>(), any::<u8>(), any::<u8>(), others)
            .prop_map(|(who, pick, end, others)| Op::LatePromotion { who, pick, end, others }),
        driver => prop::collection::vec((any::<bool>(), prop::bool::weighted(0.85)), 4)
            .prop_map(|plan| Op::Spill { plan }),
        driver => (any::<u8>(), prop::bool::weighted(0.85)).prop_map(|(pick, ok)| Op::Complete { pick, ok }),
        2 => (any::<u8>(), any::<u8>(), others_race)
            .prop_map(|(slot, then, others)| Op::MoveRace { slot, then, others }),
        1 => (any::<u8>(), any::<bool>(), any::<bool>())
            .prop_map(|(pick, ok, promote)| Op::Stray { pick, ok, promote }),
    ]
}

/// Who holds a reservation or pin: a session, and the connection that
/// took it (`None` once the unit cut that direct connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MHolder {
    session: SessionId,
    conn: Option<stowage_core::ConnId>,
    since: Time,
    /// Once its connection ended: kept until the session is gone
    /// (`None`), or a one-sided peer's, until fenced (`Some(None)`) and
    /// then until a time (`Some(Some(t))`).
    fenced: Option<Option<Time>>,
}

impl MHolder {
    fn of(owner: Owner, now: Time) -> Self {
        Self {
            session: owner.session,
            conn: Some(owner.conn),
            since: now,
            fenced: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum MState {
    /// Reserved: in the slab (the blob has a region) or on disk (it has
    /// none).
    Reserved {
        holder: MHolder,
        n: u32,
    },
    /// Committed while its file was still being synced: published once the
    /// file is reported durable.
    PendingDisk {
        specs: Vec<EntrySpec>,
    },
    Committed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MDisk {
    None,
    /// Its file is being written: a put being synced, or a spill.
    Writing,
    Durable,
}

#[derive(Clone, Debug)]
struct MBlob {
    /// Its slab range, in pieces (their lengths add up to the rounded
    /// size); `None` while only on disk.
    region: Option<Pieces>,
    /// A slab range being filled from disk by a promotion.
    promoting: Option<(u64, u64)>,
    /// The range compaction is copying it to (a move handed out, not yet
    /// reported).
    moving: Option<(u64, u64)>,
    nbytes: u64,
    state: MState,
    disk: MDisk,
    /// Publication order (spilling takes the oldest first).
    seq: u64,
    /// Its bytes: what its writer last wrote over its whole range while
    /// reserved in the slab; of its file for a put to disk (from alloc
    /// on); of its slab range once committed for a put to memory.
    content: Vec<u8>,
}

#[derive(Clone, Debug)]
struct MValue {
    blob: BlobId,
    /// Offset in the blob.
    offset: u64,
    len: u64,
    meta: Vec<u8>,
    bytes: Vec<u8>,
}

#[derive(Clone, Debug)]
struct MPin {
    blobs: BTreeSet<BlobId>,
    holder: MHolder,
    /// A view's pin: held as long as its holder wants (what it keeps of a
    /// cleared value counts as used), not a read's.
    view: bool,
    /// What the pin's holder was told, and the bytes it read there.
    snapshots: Vec<(Placement, Vec<u8>)>,
}

#[derive(Clone, Copy, Debug)]
struct MConn {
    owner: Owner,
    /// Shm: the client maps the slab and copies itself.
    direct: bool,
    /// Nixl: the client moves bytes with one-sided transfers.
    one_sided: bool,
}

#[derive(Clone, Debug)]
struct MSession {
    id: SessionId,
    /// Open connections.
    conns: Vec<MConn>,
}

/// Something the simulated driver has in flight.
#[derive(Clone, Debug)]
enum Job {
    /// A put's file, written at alloc, being synced.
    Put { blob: BlobId },
    /// A spill: the slab range is copied into the file when it finishes.
    Spill {
        blob: BlobId,
        pieces: Pieces,
        nbytes: u64,
    },
    /// A compaction move: `nbytes` of the blob's pieces `from` are copied
    /// to `to` (already, `copied`, or when it finishes), then reported.
    Move {
        blob: BlobId,
        from: Pieces,
        to: u64,
        nbytes: u64,
        copied: bool,
    },
    /// A promotion: the file's bytes (read at its start) land in the slab
    /// range when it finishes.
    Promote {
        blob: BlobId,
        offset: u64,
        bytes: Vec<u8>,
        /// The driver's own pin on the blob until then, if it took one.
        pin: Option<PinId>,
    },
}

impl Job {
    fn blob(&self) -> BlobId {
        match self {
            Job::Put { blob }
            | Job::Spill { blob, .. }
            | Job::Promote { blob, .. }
            | Job::Move { blob, .. } => *blob,
        }
    }
}

/// What a range the unit holds is, per the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    Blob(BlobId),
    Promoting(BlobId),
    Quarantined,
    /// The promotion range of a blob freed mid-promotion.
    OrphanPromotion(BlobId),
    /// The slab range a spill of a freed blob still reads.
    OrphanSpill(BlobId),
    /// The range a move copies a blob to.
    Moving(BlobId),
    /// Both ranges of a move whose blob was freed while it copied.
    OrphanMove(BlobId),
}

/// How often the interesting events happened, over a whole run.
type Coverage = BTreeMap<&'static str, u64>;

struct Harness {
    core: UnitCore,
    /// Slab bytes.
    cap: u64,
    /// 0: no disk tier.
    disk_cap: u64,
    /// The simulated slab.
    slab: Vec<u8>,
    /// The simulated disk: one file per blob.
    files: BTreeMap<BlobId, Vec<u8>>,
    /// What the simulated driver has in flight.
    jobs: Vec<Job>,
    now: Time,
    rng: u64,
    /// The live session of each slot.
    sessions: Vec<Option<MSession>>,
    /// Connections that ended (or whose session is gone).
    dead_owners: Vec<Owner>,
    /// Sessions gone or forgotten.
    dead_sessions: Vec<SessionId>,
    /// Every blob the unit should hold, by state.
    blobs: BTreeMap<BlobId, MBlob>,
    /// Quarantined ranges: (offset, len, until).
    quarantine: Vec<(u64, u64, Time)>,
    /// Blob ids whose reservation was quarantined (a cut stream): a retry
    /// reserves afresh.
    cut_ids: BTreeSet<BlobId>,
    /// Promotion ranges of blobs freed mid-promotion, held until
    /// `promote_done`.
    orphan_promotions: BTreeMap<BlobId, (u64, u64)>,
    /// Blobs freed while their spill was being written: their file goes and
    /// their slab range is freed once the write reports back (their bytes
    /// still count as disk used).
    orphans: BTreeMap<BlobId, (u64, Option<Pieces>)>,
    /// Moves whose blob was freed while the driver copied: its old pieces
    /// and the target stay held until the move reports.
    orphan_moves: BTreeMap<BlobId, (Pieces, (u64, u64))>,
    /// Compaction's moves and bytes, as the core should count them.
    compaction_moves: u64,
    compaction_bytes: u64,
    /// Committed values of `NS`.
    values: BTreeMap<Key, MValue>,
    /// Pins the unit should still hold.
    pins: BTreeMap<PinId, MPin>,
    /// Pins unpinned or dropped: unpinning them again must change nothing.
    dead_pins: Vec<PinId>,
    /// Pins the driver holds for promotions in flight (not a reader's to
    /// drop).
    driver_pins: BTreeSet<PinId>,
    /// Committed blobs since freed: the unit remembers them, so a retried
    /// alloc answers AlreadyCommitted and a retried commit succeeds.
    freed_commits: BTreeSet<BlobId>,
    /// Puts answered Busy for memory, by blob id: the time of their first
    /// refusal (and their size and entry count, for a retry). Such a put is
    /// Busy only for the reservations held by then (newer ones count as
    /// used); forgotten once it is reserved or Full.
    first_refusals: BTreeMap<BlobId, (Time, u64, u32)>,
    /// File removals the current op must produce.
    expect_deletes: Vec<BlobId>,
    seq: u64,
    /// Ids of the scripted ops' blobs, outside the pool.
    next_private: u128,
    cov: Coverage,
}

impl Harness {
    fn new(seed: u64, disk: bool) -> Result<Self, TestCaseError> {
        let (cap, disk_cap) = if disk {
            (DISK_TEST_CAP, DISK_CAP)
        } else {
            (CAP, 0)
        };
        let mut cfg = CoreConfig {
            capacity: cap,
            reservation_lease: ms(RESERVATION_LEASE_MS),
            pin_lease: ms(PIN_LEASE_MS),
            quarantine: ms(QUARANTINE_MS),
            nixl_quarantine: ms(NIXL_QUARANTINE_MS),
            index_budget: INDEX_BUDGET,
            max_session_conns: MAX_SESSION_CONNS,
            id_key: (seed, seed.rotate_left(17) ^ 0x5eed),
            disk_capacity: disk_cap,
            ..CoreConfig::new(cap)
        };
        if disk {
            cfg.high_watermark = HIGH_WATERMARK;
            cfg.low_watermark = LOW_WATERMARK;
        }
        // Compaction runs in this small slab (its default threshold is
        // 64 KiB free), sometimes with a cap on the blobs it moves.
        cfg.compact_min_free = [0, 512, 2048][(seed >> 8) as usize % 3];
        if (seed >> 12) & 3 == 0 {
            cfg.compact_max_move = MAX_BLOB / 4;
        }
        let mut h = Self {
            core: UnitCore::new(cfg).expect("valid config"),
            cap,
            disk_cap,
            slab: vec![0; cap as usize],
            files: BTreeMap::new(),
            jobs: Vec::new(),
            now: Duration::ZERO,
            rng: seed,
            sessions: vec![None; SLOTS],
            dead_owners: Vec::new(),
            dead_sessions: Vec::new(),
            blobs: BTreeMap::new(),
            quarantine: Vec::new(),
            cut_ids: BTreeSet::new(),
            orphan_promotions: BTreeMap::new(),
            orphans: BTreeMap::new(),
            orphan_moves: BTreeMap::new(),
            compaction_moves: 0,
            compaction_bytes: 0,
            values: BTreeMap::new(),
            pins: BTreeMap::new(),
            dead_pins: Vec::new(),
            driver_pins: BTreeSet::new(),
            freed_commits: BTreeSet::new(),
            first_refusals: BTreeMap::new(),
            expect_deletes: Vec::new(),
            seq: 0,
            next_private: 1 << 20,
            cov: Coverage::new(),
        };
        // One connection per slot to start with: direct, tcp, and either.
        for slot in 0..SLOTS {
            let direct = slot == 0 || slot == 2 && seed & 1 == 1;
            h.attach(slot, direct)?;
        }
        Ok(h)
    }

    fn count(&mut self, event: &'static str) {
        *self.cov.entry(event).or_default() += 1;
    }

    /// A pseudo-random number from the case's stream (the simulated
    /// driver's choices).
    fn roll(&mut self) -> u64 {
        let b = self.fresh(8);
        u64::from_le_bytes(b.try_into().unwrap())
    }

    /// Fresh bytes (splitmix64 stream).
    fn fresh(&mut self, len: u64) -> Vec<u8> {
        let mut out = vec![0u8; len as usize];
        let mut state = self.rng;
        for chunk in out.chunks_mut(8) {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        self.rng = state;
        out
    }

    /// Someone writes fresh bytes over `[offset, offset + len)`.
    fn scribble(&mut self, offset: u64, len: u64) {
        let bytes = self.fresh(len);
        self.slab[offset as usize..(offset + len) as usize].copy_from_slice(&bytes);
    }

    /// The writer of reserved blob `id` writes its whole range (every
    /// piece, in order).
    fn scribble_blob(&mut self, id: BlobId) {
        let Some(pieces) = self.blobs.get(&id).and_then(|b| b.region.clone()) else {
            return;
        };
        let len = pieces.iter().map(|p| p.1).sum();
        let bytes = self.fresh(len);
        self.write_pieces(&pieces, &bytes);
        self.blobs.get_mut(&id).unwrap().content = bytes;
    }

    fn slab_bytes(&self, offset: u64, len: u64) -> &[u8] {
        &self.slab[offset as usize..(offset + len) as usize]
    }

    /// Bytes `offset..offset + len` of a blob in `pieces`.
    fn pieces_bytes(&self, pieces: &[(u64, u64)], offset: u64, len: u64) -> Vec<u8> {
        locate(pieces, offset, len)
            .into_iter()
            .flat_map(|(o, l)| self.slab_bytes(o, l).iter().copied())
            .collect()
    }

    /// Write `bytes` over the start of a blob in `pieces`.
    fn write_pieces(&mut self, pieces: &[(u64, u64)], bytes: &[u8]) {
        let mut at = 0usize;
        for (o, l) in locate(pieces, 0, bytes.len() as u64) {
            self.slab[o as usize..(o + l) as usize].copy_from_slice(&bytes[at..at + l as usize]);
            at += l as usize;
        }
    }

    /// The bytes at `place` (a missing file or a range past its end:
    /// `None`); a split value's parts, concatenated.
    fn read(&self, place: &Placement) -> Option<Vec<u8>> {
        match place {
            Placement::Memory(l) => Some(self.slab_bytes(l.offset, l.len).to_vec()),
            Placement::Split(parts) => {
                if parts.len() < 2 || parts.iter().any(|l| l.len == 0) {
                    // A split place names two parts or more, none empty.
                    return None;
                }
                Some(
                    parts
                        .iter()
                        .flat_map(|l| self.slab_bytes(l.offset, l.len).iter().copied())
                        .collect(),
                )
            }
            Placement::Disk { blob, offset, len } => self
                .files
                .get(blob)?
                .get(*offset as usize..(offset + len) as usize)
                .map(<[u8]>::to_vec),
        }
    }

    /// Where the value should be found now.
    fn place(&self, v: &MValue) -> Placement {
        match self.blobs.get(&v.blob).and_then(|b| b.region.as_ref()) {
            Some(pieces) => place_in(pieces, v.offset, v.len),
            None => Placement::Disk {
                blob: v.blob,
                offset: v.offset,
                len: v.len,
            },
        }
    }

    // ---- sessions -------------------------------------------------------

    fn slot_of(&self, session: SessionId) -> Option<usize> {
        self.sessions
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.id == session))
    }

    fn live_sessions(&self) -> impl Iterator<Item = &MSession> {
        self.sessions.iter().flatten()
    }

    /// Sessions holding a reservation or pin that waits for a fence.
    fn sessions_awaiting_fence(&self) -> impl Iterator<Item = SessionId> + '_ {
        let reserved = self.blobs.values().filter_map(|b| match b.state {
            MState::Reserved { holder, .. } => Some(holder),
            _ => None,
        });
        let waiting: BTreeSet<SessionId> = reserved
            .chain(self.pins.values().map(|p| p.holder))
            .filter(|h| h.fenced == Some(None))
            .map(|h| h.session)
            .collect();
        waiting.into_iter()
    }

    fn conn(&self, owner: Owner) -> Option<MConn> {
        self.live_sessions()
            .flat_map(|s| s.conns.iter())
            .find(|c| c.owner == owner)
            .copied()
    }

    /// Whether `owner` may make requests (an open connection, or the unit).
    fn is_live(&self, owner: Owner) -> bool {
        owner == Owner::UNIT || self.conn(owner).is_some()
    }

    fn live_owners(&self) -> Vec<Owner> {
        self.live_sessions()
            .flat_map(|s| s.conns.iter().map(|c| c.owner))
            .collect()
    }

    /// The `pick`-th open connection of any session.
    fn live_owner(&self, pick: u8) -> Option<Owner> {
        let all = self.live_owners();
        (!all.is_empty()).then(|| all[usize::from(pick) % all.len()])
    }

    /// An open connection of `session` (the unit for its own session).
    fn owner_of_session(&self, session: SessionId, pick: u8) -> Option<Owner> {
        if session == Owner::UNIT.session {
            return Some(Owner::UNIT);
        }
        let s = self.live_sessions().find(|s| s.id == session)?;
        (!s.conns.is_empty()).then(|| s.conns[usize::from(pick) % s.conns.len()].owner)
    }

    /// Who sends a request about something `session` holds: mostly one of
    /// its own connections, sometimes anyone's (another session: NotOwner).
    fn requester(&self, who: u8, session: Option<SessionId>) -> Option<Owner> {
        match who % 8 {
            0..=5 => session
                .and_then(|s| self.owner_of_session(s, who / 8))
                .or_else(|| self.live_owner(who / 8)),
            _ => self.live_owner(who / 8),
        }
    }

    /// Mostly an open connection, now and then (`who % 16 == 15`) one that
    /// ended.
    fn any_owner(&self, who: u8) -> Option<Owner> {
        if who % 16 == 15 && !self.dead_owners.is_empty() {
            return Some(self.dead_owners[usize::from(who / 16) % self.dead_owners.len()]);
        }
        self.live_owner(who)
    }

    /// Reservations and pins `session` holds.
    fn holds_of(&self, session: SessionId) -> usize {
        let reservations = self
            .blobs
            .values()
            .filter(
                |b| matches!(b.state, MState::Reserved { holder, .. } if holder.session == session),
            )
            .count();
        reservations
            + self
                .pins
                .values()
                .filter(|p| p.holder.session == session)
                .count()
    }

    /// Sessions whose connections are all gone but which hold something.
    fn orphaned_sessions(&self) -> Vec<SessionId> {
        let mut v: Vec<SessionId> = self
            .live_sessions()
            .filter(|s| s.conns.is_empty() && self.holds_of(s.id) > 0)
            .map(|s| s.id)
            .collect();
        v.sort();
        v
    }

    /// A session with no connection and no hold is forgotten.
    fn maybe_forget(&mut self, session: SessionId) {
        let Some(slot) = self.slot_of(session) else {
            return;
        };
        if self.sessions[slot].as_ref().unwrap().conns.is_empty() && self.holds_of(session) == 0 {
            self.sessions[slot] = None;
            self.dead_sessions.push(session);
            self.count("session forgotten");
        }
    }

    /// Open a connection in `slot` (a new session there if it has none).
    /// `None`: the session has its maximum of connections (Busy).
    fn attach(&mut self, slot: usize, direct: bool) -> Result<Option<Owner>, TestCaseError> {
        let (session, n_conns) = match &self.sessions[slot] {
            Some(s) => (s.id, s.conns.len()),
            None => {
                let id = self.core.open_session();
                prop_assert!(
                    id != Owner::UNIT.session
                        && !self.dead_sessions.contains(&id)
                        && self.slot_of(id).is_none(),
                    "session id {:?} handed out twice",
                    id
                );
                prop_assert!(self.core.has_session(id), "a new session does not exist");
                self.sessions[slot] = Some(MSession {
                    id,
                    conns: Vec::new(),
                });
                self.count("session opened");
                (id, 0)
            }
        };
        let got = self.core.attach(session, direct);
        if n_conns >= MAX_SESSION_CONNS {
            prop_assert_eq!(
                got,
                Err(CoreError::Busy {
                    needed: 0,
                    reclaimable: 0
                }),
                "attach past the connection cap"
            );
            self.count("attach refused: connection cap");
            return Ok(None);
        }
        let owner = match got {
            Ok(o) => o,
            Err(e) => return Err(TestCaseError::fail(format!("attach to {session:?}: {e:?}"))),
        };
        prop_assert_eq!(owner.session, session);
        prop_assert!(
            owner != Owner::UNIT
                && !self.dead_owners.contains(&owner)
                && self.conn(owner).is_none(),
            "connection {:?} handed out twice",
            owner
        );
        self.sessions[slot].as_mut().unwrap().conns.push(MConn {
            owner,
            direct,
            one_sided: false,
        });
        Ok(Some(owner))
    }

    /// The peer of `owner` moves bytes with one-sided transfers from now on.
    fn make_one_sided(&mut self, owner: Owner) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.core.make_one_sided(owner), Ok(()));
        let slot = self.slot_of(owner.session).unwrap();
        let c = self.sessions[slot]
            .as_mut()
            .unwrap()
            .conns
            .iter_mut()
            .find(|c| c.owner == owner)
            .unwrap();
        c.one_sided = true;
        self.count("one-sided connection");
        Ok(())
    }

    /// The driver fenced `session`'s one-sided endpoint: the holds of its
    /// ended one-sided connections go once the nixl quarantine has passed.
    fn fence(&mut self, session: SessionId) -> Result<(), TestCaseError> {
        let got = self.core.fence(session, self.now);
        let until = self.now + ms(NIXL_QUARANTINE_MS);
        let mut n = 0u64;
        for b in self.blobs.values_mut() {
            if let MState::Reserved { holder, .. } = &mut b.state {
                if holder.session == session && holder.fenced == Some(None) {
                    holder.fenced = Some(Some(until));
                    n += 1;
                }
            }
        }
        for p in self.pins.values_mut() {
            if p.holder.session == session && p.holder.fenced == Some(None) {
                p.holder.fenced = Some(Some(until));
                n += 1;
            }
        }
        prop_assert_eq!(got, n, "holds fenced of {:?}", session);
        if n > 0 {
            self.count("fence: holds wait out the nixl quarantine");
        }
        Ok(())
    }

    /// When the first fenced hold is released.
    fn first_fenced(&self) -> Option<Time> {
        let reserved = self.blobs.values().filter_map(|b| match b.state {
            MState::Reserved { holder, .. } => holder.fenced.flatten(),
            _ => None,
        });
        let pinned = self.pins.values().filter_map(|p| p.holder.fenced.flatten());
        reserved.chain(pinned).min()
    }

    /// A direct connection in `slot` (opening one if there is none).
    fn direct_conn(&mut self, slot: usize) -> Result<Option<Owner>, TestCaseError> {
        if let Some(c) = self.sessions[slot]
            .as_ref()
            .and_then(|s| s.conns.iter().find(|c| c.direct))
        {
            return Ok(Some(c.owner));
        }
        self.attach(slot, true)
    }

    /// An open connection of `session` other than `except`; reconnects
    /// (attaches a new one, `direct` or not) if there is none.
    fn other_conn_of(
        &mut self,
        session: SessionId,
        except: Option<Owner>,
        direct: bool,
    ) -> Result<Option<Owner>, TestCaseError> {
        let Some(slot) = self.slot_of(session) else {
            return Ok(None);
        };
        if let Some(c) = self.sessions[slot]
            .as_ref()
            .unwrap()
            .conns
            .iter()
            .find(|c| Some(c.owner) != except)
        {
            return Ok(Some(c.owner));
        }
        let got = self.attach(slot, direct)?;
        if got.is_some() {
            self.count("reconnect");
        }
        Ok(got)
    }

    /// An open connection of a session other than `session` (opening one
    /// in another slot if there is none).
    fn other_session_owner(
        &mut self,
        session: SessionId,
        pick: u8,
    ) -> Result<Option<Owner>, TestCaseError> {
        let others: Vec<Owner> = self
            .live_sessions()
            .filter(|s| s.id != session)
            .flat_map(|s| s.conns.iter().map(|c| c.owner))
            .collect();
        if !others.is_empty() {
            return Ok(Some(others[usize::from(pick) % others.len()]));
        }
        let mine = self.slot_of(session);
        for k in 0..SLOTS {
            let slot = (usize::from(pick) + k) % SLOTS;
            if Some(slot) != mine {
                if let Some(o) = self.attach(slot, pick & 1 == 0)? {
                    return Ok(Some(o));
                }
            }
        }
        Ok(None)
    }

    /// A connection ends. See the crate docs for what goes with it.
    fn detach(&mut self, who: Owner, end: ConnEnd) -> Result<(), TestCaseError> {
        self.core.detach(who, end, self.now);
        let Some(slot) = self.slot_of(who.session) else {
            self.count("detach of an ended connection");
            return Ok(());
        };
        let sess = self.sessions[slot].as_mut().unwrap();
        let Some(i) = sess.conns.iter().position(|c| c.owner == who) else {
            self.count("detach of an ended connection");
            return Ok(());
        };
        let conn = sess.conns.remove(i);
        self.dead_owners.push(who);
        // `Some(fenced)`: kept; a one-sided peer's however it ended (a
        // network's close proves nothing of its transfers), until fenced
        // unless it also maps the slab; a direct peer's when cut, until its
        // process is gone.
        let keep: Option<Option<Option<Time>>> = if conn.one_sided {
            Some(if conn.direct { None } else { Some(None) })
        } else if end == ConnEnd::Cut && conn.direct {
            Some(None)
        } else {
            None
        };
        let held = |h: &MHolder| h.session == who.session && h.conn == Some(who.conn);
        let reservations: Vec<BlobId> = self
            .blobs
            .iter()
            .filter(|(_, b)| matches!(&b.state, MState::Reserved { holder, .. } if held(holder)))
            .map(|(id, _)| *id)
            .collect();
        let pins: Vec<PinId> = self
            .pins
            .iter()
            .filter(|(_, p)| held(&p.holder))
            .map(|(id, _)| *id)
            .collect();
        let holds = reservations.len() + pins.len();
        match (end, conn.direct) {
            (ConnEnd::Closed, _) => self.count("detach closed"),
            (ConnEnd::Cut, true) => self.count("detach cut direct"),
            (ConnEnd::Cut, false) => self.count("detach cut stream"),
        }
        if holds > 0 {
            self.count(match (end, keep) {
                (ConnEnd::Closed, Some(Some(_))) => "closed one-sided: holds kept until fenced",
                (ConnEnd::Cut, Some(Some(_))) => "cut one-sided: holds kept until fenced",
                (ConnEnd::Closed, Some(None)) => {
                    "closed one-sided mapping peer: holds kept until it is gone"
                }
                (ConnEnd::Cut, Some(None)) => "cut direct: holds kept for the session",
                (ConnEnd::Closed, None) => "closed: holds released",
                (ConnEnd::Cut, None) => "cut stream: holds released",
            });
        }
        for id in reservations {
            if let Some(fenced) = keep {
                if let MState::Reserved { holder, .. } = &mut self.blobs.get_mut(&id).unwrap().state
                {
                    holder.conn = None;
                    holder.fenced = fenced;
                }
            } else {
                self.release_reservation(id, end == ConnEnd::Cut);
            }
        }
        for pin in pins {
            if let Some(fenced) = keep {
                let h = &mut self.pins.get_mut(&pin).unwrap().holder;
                h.conn = None;
                h.fenced = fenced;
            } else {
                self.pins.remove(&pin);
                self.dead_pins.push(pin);
            }
        }
        self.gc();
        self.maybe_forget(who.session);
        Ok(())
    }

    /// The session's process is gone: everything it holds goes, with no
    /// quarantine.
    fn session_gone(&mut self, session: SessionId) {
        self.core.session_gone(session, self.now);
        let Some(slot) = self.slot_of(session) else {
            self.count("session gone again");
            return;
        };
        let s = self.sessions[slot].take().unwrap();
        self.count("session gone");
        if !s.conns.is_empty() {
            self.count("session gone with direct connections open");
        }
        self.dead_owners.extend(s.conns.iter().map(|c| c.owner));
        self.dead_sessions.push(session);
        let reservations: Vec<BlobId> = self
            .blobs
            .iter()
            .filter(|(_, b)| matches!(&b.state, MState::Reserved { holder, .. } if holder.session == session))
            .map(|(id, _)| *id)
            .collect();
        let pins: Vec<PinId> = self
            .pins
            .iter()
            .filter(|(_, p)| p.holder.session == session)
            .map(|(id, _)| *id)
            .collect();
        if reservations.len() + pins.len() > 0 {
            self.count("session gone: holds released");
        }
        for id in reservations {
            self.release_reservation(id, false);
        }
        for pin in pins {
            self.pins.remove(&pin);
            self.dead_pins.push(pin);
        }
        self.gc();
    }

    /// A client process exits: the unit sees its tcp connections close
    /// (their streams end with them), then its exit (`session_gone`), which
    /// releases what its cut or still open direct connections held.
    fn process_gone(&mut self, session: SessionId) -> Result<(), TestCaseError> {
        let tcp: Vec<Owner> = self
            .live_sessions()
            .filter(|s| s.id == session)
            .flat_map(|s| s.conns.iter().filter(|c| !c.direct).map(|c| c.owner))
            .collect();
        for o in tcp {
            self.detach(o, ConnEnd::Closed)?;
        }
        self.session_gone(session);
        Ok(())
    }

    /// A reservation ends without commit: its range is freed, or
    /// quarantined when a transfer may still write (`in_flight`); one on
    /// disk goes with its file.
    fn release_reservation(&mut self, id: BlobId, in_flight: bool) {
        let b = self.blobs.remove(&id).unwrap();
        match b.region {
            Some(pieces) => {
                if in_flight {
                    let until = self.now + ms(QUARANTINE_MS);
                    self.quarantine
                        .extend(pieces.iter().map(|&(off, len)| (off, len, until)));
                    self.cut_ids.insert(id);
                    self.count("range quarantined");
                }
            }
            None => self.expect_deletes.push(id),
        }
    }

    // ---- ranges ---------------------------------------------------------

    /// Every piece of every blob's slab range (and promotion and move
    /// target) the unit should hold: (blob, offset, len).
    fn model_regions(&self) -> BTreeSet<(BlobId, u64, u64)> {
        self.blobs
            .iter()
            .flat_map(|(id, b)| {
                b.region
                    .iter()
                    .flatten()
                    .chain(b.promoting.iter())
                    .chain(b.moving.iter())
                    .map(move |&(off, len)| (*id, off, len))
            })
            .collect()
    }

    /// Every other range the unit should hold: quarantined ranges, ranges
    /// of finished blobs a spill still reads or a promotion still writes.
    fn model_held(&self) -> Vec<(u64, u64, Use)> {
        let mut v: Vec<(u64, u64, Use)> = self
            .quarantine
            .iter()
            .map(|&(off, len, _)| (off, len, Use::Quarantined))
            .chain(
                self.orphan_promotions
                    .iter()
                    .map(|(id, &(off, len))| (off, len, Use::OrphanPromotion(*id))),
            )
            .chain(self.orphans.iter().flat_map(|(id, (_, r))| {
                r.iter()
                    .flatten()
                    .map(|&(off, len)| (off, len, Use::OrphanSpill(*id)))
            }))
            .chain(self.orphan_moves.iter().flat_map(|(id, (old, to))| {
                old.iter()
                    .chain(std::iter::once(to))
                    .map(|&(off, len)| (off, len, Use::OrphanMove(*id)))
            }))
            .collect();
        v.sort_unstable_by_key(|&(off, len, _)| (off, len));
        v
    }

    /// Every range the unit should hold, and what it is.
    fn occupied(&self) -> Vec<(u64, u64, Use)> {
        let mut v: Vec<(u64, u64, Use)> = self
            .blobs
            .iter()
            .flat_map(|(id, b)| {
                b.region
                    .iter()
                    .flatten()
                    .map(|&(off, len)| (off, len, Use::Blob(*id)))
                    .chain(
                        b.promoting
                            .map(|(off, len)| (off, len, Use::Promoting(*id))),
                    )
                    .chain(b.moving.map(|(off, len)| (off, len, Use::Moving(*id))))
                    .collect::<Vec<_>>()
            })
            .chain(self.model_held())
            .collect();
        v.sort_unstable_by_key(|&(off, len, _)| (off, len));
        v
    }

    /// Slab bytes held, for any reason: capacity minus the free bytes.
    fn allocated(&self) -> u64 {
        self.occupied().iter().map(|r| r.1).sum()
    }

    /// Slab bytes of stored data (`Stats::used`): committed blobs in
    /// memory, cleared ones a reader still pins included.
    fn stored(&self) -> u64 {
        self.blobs
            .values()
            .filter(|b| b.state == MState::Committed)
            .filter_map(|b| b.region.as_ref())
            .map(|r| r.iter().map(|p| p.1).sum::<u64>())
            .sum()
    }

    /// The free ranges of the slab, per the model: the gaps between held
    /// ranges, cut at the boundary of the data and spare zones (the
    /// allocator never merges across it).
    fn free_ranges(&self) -> Vec<(u64, u64)> {
        let split = self.cap - spare_budget(self.cap);
        let mut gaps = Vec::new();
        let mut at = 0;
        let mut push = |from: u64, to: u64| {
            for (a, b) in [(from, to.min(split)), (from.max(split), to)] {
                if b > a {
                    gaps.push((a, b - a));
                }
            }
        };
        for (off, len, _) in self.occupied() {
            if off > at {
                push(at, off);
            }
            at = at.max(off + len);
        }
        push(at, self.cap);
        gaps
    }

    fn reserved_bytes(&self) -> u64 {
        self.blobs
            .values()
            .filter(|b| matches!(b.state, MState::Reserved { .. }))
            .filter_map(|b| b.region.as_ref())
            .map(|r| r.iter().map(|p| p.1).sum::<u64>())
            .sum()
    }

    /// Slab bytes of reservations taken at or before `t`.
    fn reserved_bytes_since(&self, t: Time) -> u64 {
        self.blobs
            .values()
            .filter(|b| matches!(b.state, MState::Reserved { holder, .. } if holder.since <= t))
            .filter_map(|b| b.region.as_ref())
            .map(|r| r.iter().map(|p| p.1).sum::<u64>())
            .sum()
    }

    fn quarantined_bytes(&self) -> u64 {
        self.quarantine.iter().map(|q| q.1).sum()
    }

    /// Slab bytes of blobs whose spill is being written.
    fn spilling_bytes(&self) -> u64 {
        self.blobs
            .values()
            .filter(|b| b.disk == MDisk::Writing)
            .filter_map(|b| b.region.as_ref())
            .map(|r| r.iter().map(|p| p.1).sum::<u64>())
            .sum()
    }

    /// Slab bytes of committed blobs no entry refers to any more (only
    /// pins keep them), not being spilled: (those a client's view pins,
    /// of those the ones `session`'s own views pin, those only reads and
    /// the unit's pins keep — they come back without a session's say).
    fn cleared_pinned(&self, session: SessionId) -> (u64, u64, u64) {
        let live: BTreeSet<BlobId> = self.values.values().map(|v| v.blob).collect();
        let (mut views, mut own, mut reads) = (0, 0, 0);
        for (id, b) in &self.blobs {
            if b.state != MState::Committed || live.contains(id) || b.disk == MDisk::Writing {
                continue;
            }
            let Some(r) = &b.region else { continue };
            let len = r.iter().map(|p| p.1).sum::<u64>();
            let viewers: Vec<SessionId> = self
                .pins
                .values()
                .filter(|p| p.view && p.blobs.contains(id))
                .map(|p| p.holder.session)
                .collect();
            if viewers.is_empty() {
                reads += len;
            } else {
                views += len;
                if viewers.contains(&session) {
                    own += len;
                }
            }
        }
        (views, own, reads)
    }

    /// Slab bytes compaction holds: the targets of moves under way, and
    /// both ranges of a move whose blob was freed meanwhile.
    fn moving_bytes(&self) -> u64 {
        let moves: u64 = self
            .blobs
            .values()
            .filter_map(|b| b.moving)
            .map(|m| m.1)
            .sum();
        let orphans: u64 = self
            .orphan_moves
            .values()
            .map(|(old, to)| old.iter().map(|p| p.1).sum::<u64>() + to.1)
            .sum();
        moves + orphans
    }

    fn disk_used(&self) -> u64 {
        let blobs: u64 = self
            .blobs
            .values()
            .filter(|b| b.disk != MDisk::None)
            .map(|b| b.nbytes)
            .sum();
        blobs + self.orphans.values().map(|o| o.0).sum::<u64>()
    }

    fn disk_free(&self) -> u64 {
        self.disk_cap.saturating_sub(self.disk_used())
    }

    fn index_bytes(&self) -> u64 {
        self.values
            .iter()
            .map(|(k, v)| ENTRY_OVERHEAD + k.field.len() as u64 + v.meta.len() as u64)
            .sum()
    }

    fn pinned(&self, id: BlobId) -> bool {
        self.pins.values().any(|p| p.blobs.contains(&id))
    }

    /// The largest free range of the slab (either zone), per the model.
    fn largest_gap(&self) -> u64 {
        self.free_ranges().iter().map(|g| g.1).max().unwrap_or(0)
    }

    /// `[offset, offset + len)` is aligned, inside the slab and overlaps no
    /// range the model says the unit holds (reservations of paused or cut
    /// clients, pinned blobs, quarantines, orphaned spills and promotions).
    fn check_new_range(
        &self,
        what: &str,
        id: BlobId,
        offset: u64,
        len: u64,
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            offset.is_multiple_of(ALIGN) && offset + len <= self.cap,
            "{} of {:?}: region {}+{} misaligned or outside the slab",
            what,
            id,
            offset,
            len
        );
        for (off, l, u) in self.occupied() {
            let holder = match u {
                Use::Blob(b) => self.blobs.get(&b).map(|b| format!("{:?}", b.state)),
                _ => None,
            };
            prop_assert!(
                !overlap((offset, len), (off, l)),
                "{} of {:?} got {}+{}, overlapping {:?} at {}+{} ({:?})",
                what,
                id,
                offset,
                len,
                u,
                off,
                l,
                holder
            );
        }
        Ok(())
    }

    /// Blobs in `state` (by a predicate), for picking targets.
    fn blobs_where(&self, f: impl Fn(&MState) -> bool) -> Vec<BlobId> {
        self.blobs
            .iter()
            .filter(|(_, b)| f(&b.state))
            .map(|(id, _)| *id)
            .collect()
    }

    /// A committed blob is freed once no value and no pin refers to it: its
    /// file goes (at once if durable, once its spill reports if written,
    /// and its slab range with it); a promotion range it had is held until
    /// the promotion reports.
    fn gc(&mut self) {
        let mut held: BTreeSet<BlobId> = self.values.values().map(|v| v.blob).collect();
        for p in self.pins.values() {
            held.extend(p.blobs.iter().copied());
        }
        let freed: Vec<BlobId> = self
            .blobs
            .iter()
            .filter(|(id, b)| b.state == MState::Committed && !held.contains(id))
            .map(|(id, _)| *id)
            .collect();
        for id in freed {
            let b = self.blobs.remove(&id).unwrap();
            self.freed_commits.insert(id);
            if let Some(r) = b.promoting {
                self.count("promotion range of a freed blob held");
                self.orphan_promotions.insert(id, r);
            }
            match b.disk {
                MDisk::None => {}
                MDisk::Durable => self.expect_deletes.push(id),
                MDisk::Writing => {
                    self.count("orphaned spill");
                    self.orphans.insert(id, (b.nbytes, b.region.clone()));
                }
            }
            if let Some(to) = b.moving {
                // The driver still reads the old pieces and writes the
                // target: both stay held until the move reports.
                self.count("move: blob freed while it copied");
                let old = b.region.clone().unwrap_or_default();
                self.orphan_moves.insert(id, (old, to));
            }
        }
    }

    /// Publish `specs` of blob `id` (committed in memory, or durable on
    /// disk).
    fn publish(&mut self, id: BlobId, specs: &[EntrySpec]) {
        self.seq += 1;
        let seq = self.seq;
        let b = self.blobs.get(&id).unwrap();
        let content = match &b.region {
            Some(pieces) => self.pieces_bytes(pieces, 0, b.nbytes),
            None => b.content.clone(),
        };
        // In entry order: a later entry of the same key wins.
        for e in specs {
            let bytes = content[e.offset as usize..(e.offset + e.len) as usize].to_vec();
            self.values.insert(
                e.key.clone(),
                MValue {
                    blob: id,
                    offset: e.offset,
                    len: e.len,
                    meta: e.meta.clone(),
                    bytes,
                },
            );
        }
        let b = self.blobs.get_mut(&id).unwrap();
        b.state = MState::Committed;
        b.seq = seq;
        b.content = content;
        self.gc();
    }

    // ---- operations -----------------------------------------------------

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        self.apply_op(op)?;
        self.settle_effects()
    }

    fn apply_op(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Alloc { who, blob, size, n } => {
                let Some(o) = self.any_owner(*who) else {
                    return Ok(());
                };
                self.alloc(o, blob_id(*blob), *size, *n)
            }
            Op::Retry { who, pick } => self.retry(*who, *pick),
            Op::Commit {
                who,
                pick,
                entries,
                fault,
            } => {
                let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
                // Mostly a blob the test reserved; sometimes any id of the
                // pool (committed, pending, quarantined, unknown).
                let id = if pick % 8 != 0 && !reserved.is_empty() {
                    reserved[usize::from(*pick / 8) % reserved.len()]
                } else {
                    blob_id(*pick / 8)
                };
                let (nbytes, n, session) = match self.blobs.get(&id) {
                    Some(MBlob {
                        nbytes,
                        state: MState::Reserved { n, holder },
                        ..
                    }) => (*nbytes, *n as usize, Some(holder.session)),
                    _ => (64, usize::from(fault % 4), None),
                };
                let Some(o) = self.requester(*who, session) else {
                    return Ok(());
                };
                let mut specs: Vec<EntrySpec> = entries
                    .iter()
                    .map(|&(row, field, off, l)| {
                        let offset = u64::from(off) % (nbytes + 1);
                        let len = u64::from(l) % (nbytes - offset + 1);
                        EntrySpec {
                            key: key(row, field),
                            offset,
                            len,
                            // 0 to 5 bytes: entries cost the index different amounts.
                            meta: vec![row as u8, field as u8, off as u8, 7, 7][..(l % 6) as usize]
                                .to_vec(),
                        }
                    })
                    .collect();
                match fault % 16 {
                    0 => specs.truncate(n + 1), // one entry too many
                    1 if n > 0 => {
                        specs.truncate(n);
                        // The last entry ends one byte past the blob.
                        let last = &mut specs[n - 1];
                        last.len = last.len.max(1);
                        last.offset = nbytes + 1 - last.len;
                    }
                    _ => specs.truncate(n),
                }
                self.commit(o, id, &specs)
            }
            Op::Abort {
                who,
                pick,
                in_flight,
            } => {
                let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
                let id = if pick % 4 != 0 && !reserved.is_empty() {
                    reserved[usize::from(*pick / 4) % reserved.len()]
                } else {
                    blob_id(*pick / 4)
                };
                let session = match self.blobs.get(&id) {
                    Some(MBlob {
                        state: MState::Reserved { holder, .. },
                        ..
                    }) => Some(holder.session),
                    _ => None,
                };
                let Some(o) = self.requester(*who, session) else {
                    return Ok(());
                };
                self.abort(o, id, *in_flight)
            }
            Op::Scribble { pick } => {
                let reserved: Vec<BlobId> = self
                    .blobs
                    .iter()
                    .filter(|(_, b)| {
                        matches!(b.state, MState::Reserved { .. }) && b.region.is_some()
                    })
                    .map(|(id, _)| *id)
                    .collect();
                let n = reserved.len() + self.quarantine.len();
                if n == 0 {
                    return Ok(());
                }
                let i = usize::from(*pick) % n;
                if i < reserved.len() {
                    let id = reserved[i];
                    if let MState::Reserved { holder, .. } = self.blobs[&id].state {
                        if holder.conn.is_none() {
                            self.count("cut client writes its reservation");
                        }
                    }
                    self.scribble_blob(id);
                } else {
                    let (off, len, _) = self.quarantine[i - reserved.len()];
                    self.count("cut stream writes its quarantined range");
                    self.scribble(off, len);
                }
                Ok(())
            }
            Op::Resolve { who, keys, promote } => {
                let Some(o) = self.any_owner(*who) else {
                    return Ok(());
                };
                let keys: Vec<Key> = keys.iter().map(|&(r, f)| key(r, f)).collect();
                self.resolve_and_pin(o, &keys, *promote).map(|_| ())
            }
            Op::Snapshot => self.snapshot(),
            Op::Unpin { who, pick, stale } => {
                let readers: Vec<PinId> = self
                    .pins
                    .keys()
                    .filter(|p| !self.driver_pins.contains(p))
                    .copied()
                    .collect();
                if *stale || readers.is_empty() {
                    let pin = if self.dead_pins.is_empty() || pick % 4 == 0 {
                        PinId(u64::MAX - (*pick as u64 % 1000))
                    } else {
                        self.dead_pins[pick % self.dead_pins.len()]
                    };
                    prop_assert!(!self.pins.contains_key(&pin));
                    let o = self.live_owner(*who).unwrap_or(Owner::UNIT);
                    self.unpin(o, pin)
                } else {
                    let pin = readers[pick % readers.len()];
                    let session = self.pins[&pin].holder.session;
                    let Some(o) = self.requester(*who, Some(session)) else {
                        return Ok(());
                    };
                    self.unpin(o, pin)
                }
            }
            Op::ClearRows { rows } => self.clear_rows(rows),
            Op::Advance { ms: d, tick } => {
                if *tick {
                    self.advance(ms(*d));
                } else {
                    self.now += ms(*d);
                }
                Ok(())
            }
            Op::Attach {
                slot,
                direct,
                stale,
                one_sided,
            } => {
                if *stale && !self.dead_sessions.is_empty() {
                    let s = self.dead_sessions[usize::from(*slot) % self.dead_sessions.len()];
                    let got = self.core.attach(s, *direct);
                    prop_assert!(
                        matches!(got, Err(CoreError::Invalid(_))),
                        "attach to gone session {:?}: {:?}",
                        s,
                        got
                    );
                    self.count("attach refused: session gone");
                    return Ok(());
                }
                match self.attach(usize::from(*slot) % SLOTS, *direct)? {
                    Some(o) if *one_sided => self.make_one_sided(o),
                    _ => Ok(()),
                }
            }
            Op::Fence { pick } => {
                // Half the time a session whose holds wait for a fence (a
                // closed one-sided peer's), or the quarantine that follows
                // a fence is reached in too few runs to count on; else any.
                let waiting: Vec<SessionId> = self.sessions_awaiting_fence().collect();
                let live: Vec<SessionId> = if pick % 2 == 0 && !waiting.is_empty() {
                    waiting
                } else {
                    self.live_sessions().map(|s| s.id).collect()
                };
                if live.is_empty() {
                    return Ok(());
                }
                self.fence(live[usize::from(*pick / 2) % live.len()])
            }
            Op::Detach { who, cut, fence } => {
                let Some(o) = self.any_owner(*who) else {
                    return Ok(());
                };
                let end = if *cut { ConnEnd::Cut } else { ConnEnd::Closed };
                self.detach(o, end)?;
                if *fence && self.sessions_awaiting_fence().any(|s| s == o.session) {
                    self.fence(o.session)?;
                }
                Ok(())
            }
            Op::SessionGone { pick } => {
                if pick % 8 == 7 && !self.dead_sessions.is_empty() {
                    let s = self.dead_sessions[usize::from(*pick / 8) % self.dead_sessions.len()];
                    self.session_gone(s);
                    return Ok(());
                }
                // As the driver: sessions whose connections were all cut,
                // whose process it found gone; sometimes a process that
                // died with direct connections still open (the unit saw
                // its exit before their end). Never one with a tcp
                // connection open: the unit's own thread may be copying.
                let candidates: Vec<SessionId> = if pick % 4 == 3 {
                    self.live_sessions()
                        .filter(|s| s.conns.iter().all(|c| c.direct))
                        .map(|s| s.id)
                        .collect()
                } else {
                    self.orphaned_sessions()
                };
                if candidates.is_empty() {
                    return Ok(());
                }
                self.session_gone(candidates[usize::from(*pick / 4) % candidates.len()]);
                Ok(())
            }
            Op::PausedWriter {
                slot,
                size,
                cut,
                pause,
                others,
                then,
            } => self.paused_writer(
                usize::from(*slot) % SLOTS,
                *size,
                *cut,
                *pause,
                others,
                *then,
            ),
            Op::PausedReader {
                slot,
                keys,
                cut,
                pause,
                others,
                then,
            } => {
                let keys: Vec<Key> = keys.iter().map(|&(r, f)| key(r, f)).collect();
                self.paused_reader(
                    usize::from(*slot) % SLOTS,
                    &keys,
                    *cut,
                    *pause,
                    others,
                    *then,
                )
            }
            Op::LatePromotion {
                who,
                pick,
                end,
                others,
            } => self.late_promotion(*who, *pick, *end, others),
            Op::Spill { plan } => self.spill(plan),
            Op::MoveRace { slot, then, others } => {
                self.move_race(usize::from(*slot) % SLOTS, *then, others)
            }
            Op::Complete { pick, ok } => {
                if !self.jobs.is_empty() {
                    let job = self.jobs.remove(usize::from(*pick) % self.jobs.len());
                    self.complete(job, *ok)?;
                }
                Ok(())
            }
            Op::Stray { pick, ok, promote } => {
                let id = blob_id(*pick);
                if self.jobs.iter().any(|j| j.blob() == id) {
                    return Ok(());
                }
                let stats = self.core.stats();
                let regions: BTreeSet<_> = self.core.regions().collect();
                let held = self.core.held_ranges();
                if *pick & 0x80 != 0 {
                    self.core.moved(id, *ok);
                } else if *promote {
                    self.core.promote_done(id, *ok);
                } else {
                    self.core.disk_written(id, *ok);
                }
                prop_assert_eq!(self.core.stats(), stats, "a stray report changed the unit");
                prop_assert_eq!(
                    self.core.regions().collect::<BTreeSet<_>>(),
                    regions,
                    "a stray report changed the regions"
                );
                prop_assert_eq!(
                    self.core.held_ranges(),
                    held,
                    "a stray report changed the held ranges"
                );
                Ok(())
            }
        }
    }

    fn retry(&mut self, who: u8, pick: u8) -> Result<(), TestCaseError> {
        let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
        let committed =
            self.blobs_where(|s| matches!(s, MState::Committed | MState::PendingDisk { .. }));
        if pick % 4 == 3 && !self.first_refusals.is_empty() {
            // A put answered Busy for memory asks again (the same blob).
            let i = usize::from(pick / 4) % self.first_refusals.len();
            let (&id, &(_, nbytes, n)) = self.first_refusals.iter().nth(i).unwrap();
            let Some(o) = self.live_owner(who) else {
                return Ok(());
            };
            self.alloc(o, id, nbytes, n)
        } else if pick.is_multiple_of(2) && !reserved.is_empty() {
            let id = reserved[usize::from(pick / 2) % reserved.len()];
            let b = &self.blobs[&id];
            let MState::Reserved { holder, n } = b.state else {
                unreachable!()
            };
            let nbytes = b.nbytes;
            let holding = holder.conn.map(|conn| Owner {
                session: holder.session,
                conn,
            });
            let requester = match who % 4 {
                // The holding connection asks again (its reply was lost).
                0 => holding,
                // The client retries on another connection of its session
                // (reconnecting if it has none open).
                1 | 2 => self.other_conn_of(holder.session, holding, who & 0x10 != 0)?,
                // Another session names the same blob id.
                _ => self.other_session_owner(holder.session, who / 4)?,
            };
            let Some(o) = requester.or_else(|| self.live_owner(who)) else {
                return Ok(());
            };
            self.alloc(o, id, nbytes, n)
        } else if !committed.is_empty() {
            let id = committed[usize::from(pick / 2) % committed.len()];
            let Some(o) = self.live_owner(who) else {
                return Ok(());
            };
            self.alloc(o, id, u64::from(pick) * 7, u32::from(pick % 4))
        } else {
            let Some(o) = self.live_owner(who) else {
                return Ok(());
            };
            self.alloc(o, blob_id(pick), u64::from(pick) * 7, 1)
        }
    }

    fn alloc(&mut self, who: Owner, id: BlobId, nbytes: u64, n: u32) -> Result<(), TestCaseError> {
        let got = self.core.alloc(who, id, nbytes, n, self.now);
        if !self.is_live(who) {
            prop_assert!(
                matches!(got, Err(CoreError::NotOwner(_))),
                "alloc of {:?} from ended connection {:?}: {:?}",
                id,
                who,
                got
            );
            self.count("not owner: request of an ended connection");
            return Ok(());
        }
        let existing = self
            .blobs
            .get(&id)
            .map(|b| (b.region.clone(), b.nbytes, b.state.clone()));
        match existing {
            Some((region, nb, MState::Reserved { holder, n: nn })) if nb == nbytes && nn == n => {
                if holder.session != who.session {
                    prop_assert!(
                        matches!(got, Err(CoreError::NotOwner(_))),
                        "alloc of {:?}, reserved by {:?}, from {:?}: {:?}",
                        id,
                        holder,
                        who,
                        got
                    );
                    self.count("not owner: alloc of another session's reservation");
                    return Ok(());
                }
                if holder.conn.is_some_and(|c| c != who.conn) {
                    prop_assert_eq!(
                        got,
                        Err(CoreError::Busy {
                            needed: nbytes,
                            reclaimable: 0
                        }),
                        "retry of {:?} on another connection while its holder's is open",
                        id
                    );
                    self.count("busy: retry while the holding connection is open");
                    return Ok(());
                }
                // The same connection's retry (same answer), or a retry
                // after its connection was cut: taken over.
                let want = match region {
                    Some(pieces) => Allocated::Reserved { pieces },
                    None => Allocated::ToDisk,
                };
                prop_assert_eq!(got, Ok(want), "retried alloc of {:?}", id);
                if holder.conn.is_none() {
                    self.count("takeover of a cut connection's reservation");
                } else {
                    self.count("retry on the holding connection");
                }
                if let MState::Reserved { holder, .. } = &mut self.blobs.get_mut(&id).unwrap().state
                {
                    holder.conn = Some(who.conn);
                    holder.fenced = None;
                }
                // The client writes its bytes again.
                self.scribble_blob(id);
            }
            Some((_, _, MState::Reserved { .. })) => {
                prop_assert!(
                    matches!(got, Err(CoreError::Invalid(_))),
                    "alloc of {:?} reserved with other params: {:?}",
                    id,
                    got
                );
            }
            Some((_, _, MState::Committed | MState::PendingDisk { .. })) => {
                prop_assert_eq!(
                    got,
                    Ok(Allocated::AlreadyCommitted),
                    "alloc of committed {:?}",
                    id
                );
            }
            None if self.freed_commits.contains(&id) => {
                prop_assert_eq!(
                    got,
                    Ok(Allocated::AlreadyCommitted),
                    "alloc of committed-then-freed {:?}",
                    id
                );
            }
            None => {
                let len = rounded(nbytes);
                let free = self.cap - self.allocated();
                let largest = self.largest_gap();
                // Nothing is held by any session (no reservation, spare or
                // pin): the issue's invariant applies in its plain form.
                let nothing_held = self.pins.is_empty()
                    && !self
                        .blobs
                        .values()
                        .any(|b| matches!(b.state, MState::Reserved { .. }));
                // Reservations and quarantines may end; spills under way
                // give their memory back once written, cleared blobs that
                // only reads keep once unpinned, moves once they report.
                // Cleared blobs that views keep are used: their holders
                // let go when they want. Of reservations, a put waits only
                // for those held at its first refusal (a commit keeps its
                // memory: newer ones count as used).
                let (views, own_views, reads) = self.cleared_pinned(who.session);
                let compaction = self.moving_bytes();
                let first = self.first_refusals.get(&id).map_or(self.now, |r| r.0);
                let waited = self.reserved_bytes_since(first);
                let newer = self.reserved_bytes() - waited;
                let reclaimable =
                    waited + self.quarantined_bytes() + self.spilling_bytes() + reads + compaction;
                let fits_disk = self.disk_cap > 0 && nbytes <= self.disk_free();
                let holder = MHolder::of(who, self.now);
                if len <= free && nothing_held {
                    // A put whose bytes fit the free memory never fails or
                    // waits for room when no session holds anything.
                    prop_assert!(
                        matches!(got, Ok(Allocated::Reserved { .. })),
                        "alloc of {} bytes with {} free and nothing held answered {:?}",
                        len,
                        free,
                        got
                    );
                    self.count("put that fits the free memory with nothing held");
                    if len > largest {
                        self.count("put larger than any free range, nothing held: in pieces");
                    }
                }
                if got.is_ok() {
                    self.first_refusals.remove(&id);
                }
                match got {
                    Ok(Allocated::Reserved { pieces }) => {
                        prop_assert!(
                            len <= free,
                            "alloc of {} bytes with only {} free",
                            len,
                            free
                        );
                        prop_assert!(
                            !pieces.is_empty()
                                && pieces.iter().all(|p| p.1 > 0)
                                && pieces.iter().map(|p| p.1).sum::<u64>() == len,
                            "alloc of {} bytes answered pieces {:?}",
                            len,
                            pieces
                        );
                        // One piece whenever a free range holds it whole.
                        prop_assert_eq!(
                            pieces.len() == 1,
                            largest >= len,
                            "alloc of {} bytes in {} pieces with a free range of {}",
                            len,
                            pieces.len(),
                            largest
                        );
                        for (k, &(off, l)) in pieces.iter().enumerate() {
                            self.check_new_range("alloc", id, off, l)?;
                            for &other in &pieces[..k] {
                                prop_assert!(
                                    !overlap((off, l), other),
                                    "alloc of {:?}: pieces {:?} overlap",
                                    id,
                                    pieces
                                );
                            }
                        }
                        if pieces.len() > 1 {
                            self.count("alloc in pieces");
                        }
                        if self.cut_ids.remove(&id) {
                            self.count("retry after a cut stream reserves afresh");
                        }
                        self.blobs.insert(
                            id,
                            MBlob {
                                region: Some(pieces),
                                promoting: None,
                                moving: None,
                                nbytes,
                                state: MState::Reserved { holder, n },
                                disk: MDisk::None,
                                seq: 0,
                                content: Vec::new(),
                            },
                        );
                        // The client (or the unit, for tcp) writes its bytes
                        // right away.
                        self.scribble_blob(id);
                    }
                    Ok(Allocated::AlreadyCommitted) => {
                        prop_assert!(false, "AlreadyCommitted for unknown blob {:?}", id);
                    }
                    Ok(Allocated::ToDisk) => {
                        prop_assert!(self.disk_cap > 0, "ToDisk without a disk tier for {:?}", id);
                        prop_assert!(
                            fits_disk,
                            "alloc of {} bytes sent to disk with {} free there",
                            nbytes,
                            self.disk_free()
                        );
                        // No spurious trip to disk: the slab's free memory,
                        // however cut, could not hold it.
                        prop_assert!(
                            len > free,
                            "alloc of {} bytes sent to disk with {} bytes free in the slab",
                            len,
                            free
                        );
                        prop_assert!(
                            !self.files.contains_key(&id),
                            "a file for {:?} exists before its put",
                            id
                        );
                        self.count("put to disk");
                        // The client streams its bytes; the driver writes the file.
                        let content = self.fresh(nbytes);
                        self.files.insert(id, content.clone());
                        self.blobs.insert(
                            id,
                            MBlob {
                                region: None,
                                promoting: None,
                                moving: None,
                                nbytes,
                                state: MState::Reserved { holder, n },
                                disk: MDisk::Writing,
                                seq: 0,
                                content,
                            },
                        );
                        self.jobs.push(Job::Put { blob: id });
                    }
                    Err(e) => {
                        // Full (or Busy) only when the disk has no room either.
                        prop_assert!(
                            !fits_disk,
                            "alloc of {} bytes refused ({:?}) with {} bytes free on disk",
                            nbytes,
                            e,
                            self.disk_free()
                        );
                        if self.disk_cap > 0 {
                            self.count("refused with disk full");
                        }
                        // No spurious refusal: a put goes in whenever the
                        // free memory can hold it, however it is cut (in
                        // pieces: this slab never needs too many).
                        prop_assert!(
                            len > free,
                            "alloc of {} bytes refused ({:?}) with {} bytes free (largest range {})",
                            len,
                            e,
                            free,
                            largest
                        );
                        let expected =
                            if len <= self.cap && free + reclaimable >= len && reclaimable > 0 {
                                CoreError::Busy {
                                    needed: nbytes,
                                    reclaimable,
                                }
                            } else {
                                CoreError::Full {
                                    needed: nbytes,
                                    free,
                                    capacity: self.cap,
                                    held: Held {
                                        views,
                                        own_views,
                                        reservations: self.reserved_bytes(),
                                        spares: 0,
                                        compaction,
                                    },
                                }
                            };
                        match &expected {
                            CoreError::Busy { .. } => {
                                if self.first_refusals.insert(id, (first, nbytes, n)).is_some() {
                                    self.count("busy again: a put under way at its first refusal");
                                }
                            }
                            _ => {
                                if self.first_refusals.remove(&id).is_some()
                                    && len <= self.cap
                                    && free + reclaimable + newer >= len
                                {
                                    self.count(
                                        "full, not busy: reservations newer than its first refusal",
                                    );
                                }
                            }
                        }
                        self.count(match &expected {
                            CoreError::Busy { .. } => "alloc busy",
                            CoreError::Full { held, .. } if held.views > 0 => {
                                "alloc full: views of cleared values hold memory"
                            }
                            _ => "alloc full",
                        });
                        prop_assert_eq!(&e, &expected, "refused alloc of {} bytes", nbytes);
                    }
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, who: Owner, id: BlobId, specs: &[EntrySpec]) -> Result<(), TestCaseError> {
        let got = self.core.commit(who, NS, id, specs);
        if !self.blobs.contains_key(&id) && self.freed_commits.contains(&id) {
            prop_assert_eq!(
                got,
                Ok(Committed::Done),
                "commit retry of committed-then-freed {:?}",
                id
            );
            return Ok(());
        }
        let Some(b) = self.blobs.get(&id) else {
            // Never allocated, aborted, released with its connection or
            // session, quarantined (a cut stream), or a put whose disk
            // write failed.
            prop_assert_eq!(got, Err(CoreError::UnknownBlob(id)), "commit of {:?}", id);
            return Ok(());
        };
        match &b.state {
            MState::Committed => {
                prop_assert_eq!(got, Ok(Committed::Done), "idempotent commit of {:?}", id);
            }
            MState::PendingDisk { .. } => {
                prop_assert_eq!(got, Ok(Committed::Pending), "commit of pending {:?}", id);
            }
            MState::Reserved { holder, n } => {
                if holder.session != who.session {
                    prop_assert!(
                        matches!(got, Err(CoreError::NotOwner(_))),
                        "commit of {:?}, reserved by {:?}, from {:?}: {:?}",
                        id,
                        holder,
                        who,
                        got
                    );
                    self.count("not owner: commit");
                    return Ok(());
                }
                let other_conn = holder.conn != Some(who.conn);
                let nbytes = b.nbytes;
                let (region, disk) = (b.region.is_some(), b.disk);
                let valid = specs.len() == *n as usize
                    && specs
                        .iter()
                        .all(|e| e.offset.checked_add(e.len).is_some_and(|end| end <= nbytes));
                if !valid {
                    prop_assert!(
                        matches!(got, Err(CoreError::Invalid(_))),
                        "invalid commit of {:?} ({} bytes, {} entries) {:?}: {:?}",
                        id,
                        nbytes,
                        n,
                        specs,
                        got
                    );
                    return Ok(());
                }
                let cost: u64 = specs.iter().map(entry_cost).sum();
                let index = self.index_bytes();
                if index + cost > INDEX_BUDGET {
                    prop_assert_eq!(
                        got,
                        Err(CoreError::Full {
                            needed: cost,
                            free: INDEX_BUDGET.saturating_sub(index),
                            capacity: INDEX_BUDGET,
                            held: Held::default(),
                        }),
                        "commit of {:?} past the index budget",
                        id
                    );
                    self.count("commit refused: index budget");
                    return Ok(());
                }
                if other_conn {
                    self.count("commit from another connection of the session");
                }
                if !region && disk == MDisk::Writing {
                    // Its file is not durable yet: nothing is visible before.
                    prop_assert_eq!(got, Ok(Committed::Pending), "commit of {:?} on disk", id);
                    self.count("commit pending");
                    self.blobs.get_mut(&id).unwrap().state = MState::PendingDisk {
                        specs: specs.to_vec(),
                    };
                } else {
                    prop_assert_eq!(got, Ok(Committed::Done), "commit of reserved {:?}", id);
                    if !region {
                        self.count("commit of a durable put");
                    }
                    self.publish(id, specs);
                }
            }
        }
        Ok(())
    }

    fn abort(&mut self, who: Owner, id: BlobId, in_flight: bool) -> Result<(), TestCaseError> {
        let got = self.core.abort(who, id, in_flight, self.now);
        match self.blobs.get(&id).map(|b| &b.state) {
            Some(MState::Reserved { holder, .. }) if holder.session != who.session => {
                prop_assert!(
                    matches!(got, Err(CoreError::NotOwner(_))),
                    "abort of {:?}, reserved by {:?}, from {:?}: {:?}",
                    id,
                    holder,
                    who,
                    got
                );
                self.count("not owner: abort");
            }
            Some(MState::Reserved { holder, .. }) => {
                if holder.conn.is_none() {
                    self.count("abort of a cut connection's reservation");
                }
                prop_assert_eq!(got, Ok(()), "abort of {:?}", id);
                self.release_reservation(id, in_flight);
            }
            // A committed or unknown blob is left alone.
            _ => prop_assert_eq!(got, Ok(()), "abort of unreserved {:?}", id),
        }
        Ok(())
    }

    fn unpin(&mut self, who: Owner, pin: PinId) -> Result<(), TestCaseError> {
        let got = self.core.unpin(who, pin);
        match self.pins.get(&pin) {
            None => prop_assert_eq!(got, Ok(()), "unpin of unknown {:?}", pin),
            Some(p) if p.holder.session != who.session => {
                prop_assert!(
                    matches!(got, Err(CoreError::NotOwner(_))),
                    "unpin of {:?}, held by {:?}, from {:?}: {:?}",
                    pin,
                    p.holder,
                    who,
                    got
                );
                self.count("not owner: unpin");
            }
            Some(p) => {
                if p.holder.conn.is_none() {
                    self.count("unpin of a cut connection's pin");
                }
                prop_assert_eq!(got, Ok(()), "unpin of {:?}", pin);
                self.pins.remove(&pin);
                self.dead_pins.push(pin);
                self.gc();
            }
        }
        Ok(())
    }

    fn clear_rows(&mut self, rows: &[u64]) -> Result<(), TestCaseError> {
        let set: BTreeSet<u64> = rows.iter().copied().collect();
        let expected = self.values.keys().filter(|k| set.contains(&k.row)).count() as u64;
        let got = self.core.clear_rows(NS, rows);
        prop_assert_eq!(got, expected, "clear_rows({:?}) count", rows);
        self.values.retain(|k, _| !set.contains(&k.row));
        self.gc();
        Ok(())
    }

    /// Resolve `keys` from `who`, check the answer, keep the pin, and maybe
    /// promote the blobs found on disk.
    fn resolve_and_pin(
        &mut self,
        who: Owner,
        keys: &[Key],
        promote: u8,
    ) -> Result<Option<PinId>, TestCaseError> {
        // Bit 0x40 of `promote`: a view's pin (a client's only).
        let view = promote & 0x40 != 0 && who != Owner::UNIT;
        let got = self.core.resolve_with_meta(who, NS, keys, view, self.now);
        if !self.is_live(who) {
            prop_assert!(
                matches!(got, Err(CoreError::NotOwner(_))),
                "resolve from ended connection {:?}: {:?}",
                who,
                got
            );
            self.count("not owner: request of an ended connection");
            return Ok(None);
        }
        let (pin, found) = match got {
            Ok(x) => x,
            Err(e) => return Err(TestCaseError::fail(format!("resolve from {who:?}: {e:?}"))),
        };
        prop_assert_eq!(found.len(), keys.len());
        let mut blobs = BTreeSet::new();
        let mut snapshots = Vec::new();
        let mut on_disk = BTreeMap::new();
        let mut split = false;
        for (k, f) in keys.iter().zip(&found) {
            match self.values.get(k) {
                None => prop_assert_eq!(f, &None, "key {} not committed", k),
                Some(v) => {
                    let place = self.place(v);
                    prop_assert_eq!(
                        f,
                        &Some((place.clone(), stowage_core::Meta::from(&v.meta[..]))),
                        "place of {}",
                        k
                    );
                    prop_assert_eq!(
                        self.read(&place),
                        Some(v.bytes.clone()),
                        "bytes of {} at {:?}",
                        k,
                        place
                    );
                    blobs.insert(v.blob);
                    split |= matches!(place, Placement::Split(_));
                    if let Placement::Disk { blob, .. } = place {
                        on_disk.entry(blob).or_insert_with(|| k.clone());
                    }
                    snapshots.push((place, v.bytes.clone()));
                }
            }
        }
        if !on_disk.is_empty() {
            self.count("resolve found a value on disk");
        }
        if split {
            self.count("value read in parts across pieces");
        }
        if blobs.is_empty() {
            prop_assert_eq!(pin, None, "pin without a found key");
            return Ok(None);
        }
        let Some(pin) = pin else {
            return Err(TestCaseError::fail("no pin although keys were found"));
        };
        prop_assert!(
            pin.0 != 0 && !self.pins.contains_key(&pin) && !self.dead_pins.contains(&pin),
            "pin id {:?} handed out twice",
            pin
        );
        self.pins.insert(
            pin,
            MPin {
                blobs,
                holder: MHolder::of(who, self.now),
                view,
                snapshots,
            },
        );
        // The reader's pin holds the blobs while they are promoted.
        for (blob, k) in on_disk {
            match promote % 4 {
                0 => {}
                1 => self.promote(blob, &k, Some(true), false)?,
                2 => self.promote(blob, &k, None, promote & 0x20 != 0)?,
                _ => self.promote(blob, &k, Some(promote & 0x10 != 0), false)?,
            }
        }
        Ok(Some(pin))
    }

    /// Promote `blob` (found under key `k`): at once (`Some(ok)`) or later
    /// (`None`; with `driver_pin` the driver pins the blob meanwhile, else
    /// the blob may be freed before the copy lands).
    fn promote(
        &mut self,
        blob: BlobId,
        k: &Key,
        now: Option<bool>,
        driver_pin: bool,
    ) -> Result<(), TestCaseError> {
        let b = self.blobs[&blob].clone();
        let len = rounded(b.nbytes);
        let eligible = b.region.is_none() && b.promoting.is_none() && b.disk == MDisk::Durable;
        let room = (self.allocated() + len) as f64 <= HIGH_WATERMARK * self.cap as f64;
        let got = self.core.promote_begin(blob);
        let Some(offset) = got else {
            if eligible && room {
                let gap = self.largest_gap();
                prop_assert!(
                    gap < 2 * len,
                    "promotion of {:?} ({} bytes) refused with a free range of {}",
                    blob,
                    len,
                    gap
                );
            }
            return Ok(());
        };
        prop_assert!(
            eligible,
            "promote_begin({:?}) answered {} for a blob not only on disk: {:?}",
            blob,
            offset,
            b
        );
        prop_assert!(
            room,
            "promotion of {:?} ({} bytes) past the high watermark with {} used",
            blob,
            len,
            self.allocated()
        );
        self.check_new_range("promotion", blob, offset, len)?;
        self.blobs.get_mut(&blob).unwrap().promoting = Some((offset, len));
        let Some(bytes) = self.files.get(&blob).cloned() else {
            return Err(TestCaseError::fail(format!(
                "no file to promote {blob:?} from"
            )));
        };
        match now {
            Some(ok) => {
                let job = Job::Promote {
                    blob,
                    offset,
                    bytes,
                    pin: None,
                };
                self.complete(job, ok)
            }
            None => {
                self.count("promotion in flight");
                let pin = if driver_pin {
                    let pin = self.resolve_and_pin(Owner::UNIT, std::slice::from_ref(k), 0)?;
                    prop_assert!(pin.is_some(), "the driver could not pin {:?}", blob);
                    self.driver_pins.extend(pin);
                    pin
                } else {
                    None
                };
                self.jobs.push(Job::Promote {
                    blob,
                    offset,
                    bytes,
                    pin,
                });
                Ok(())
            }
        }
    }

    fn snapshot(&mut self) -> Result<(), TestCaseError> {
        let snap = self.core.snapshot(self.now);
        let mut entries = snap.entries.clone();
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let expected: Vec<SnapshotEntry> = self
            .values
            .iter()
            .map(|(k, v)| SnapshotEntry {
                partition: NS.to_string(),
                key: k.clone(),
                blob: v.blob,
                offset: v.offset,
                len: v.len,
                meta: v.meta.clone(),
            })
            .collect();
        prop_assert_eq!(&entries, &expected, "snapshot entries");
        let ids: BTreeSet<BlobId> = self.values.values().map(|v| v.blob).collect();
        let mut blobs = snap.blobs.clone();
        blobs.sort_by_key(|b| b.0);
        let mut want = Vec::new();
        for id in &ids {
            let b = &self.blobs[id];
            let place = match &b.region {
                Some(pieces) => place_in(pieces, 0, b.nbytes),
                None => Placement::Disk {
                    blob: *id,
                    offset: 0,
                    len: b.nbytes,
                },
            };
            prop_assert_eq!(
                self.read(&place),
                Some(b.content.clone()),
                "bytes of snapshot blob {:?} at {:?}",
                id,
                place
            );
            want.push((*id, b.nbytes, place));
        }
        prop_assert_eq!(&blobs, &want, "snapshot blobs");
        if ids.iter().any(|id| self.blobs[id].region.is_none()) {
            self.count("snapshot with blobs on disk");
        }
        prop_assert_eq!(snap.pin.is_some(), !ids.is_empty(), "snapshot pin");
        if let Some(pin) = snap.pin {
            prop_assert!(
                pin.0 != 0 && !self.pins.contains_key(&pin) && !self.dead_pins.contains(&pin),
                "pin id {:?} handed out twice",
                pin
            );
            let snapshots = self
                .values
                .values()
                .map(|v| (self.place(v), v.bytes.clone()))
                .collect();
            // The unit's own pin (a checkpoint): no session may drop it.
            self.pins.insert(
                pin,
                MPin {
                    blobs: ids,
                    holder: MHolder::of(Owner::UNIT, self.now),
                    view: false,
                    snapshots,
                },
            );
        }
        Ok(())
    }

    /// A put by `who`: alloc blob `id` of `nbytes` with one entry, key `k`
    /// over the whole blob, and commit it (if reserved).
    fn put(&mut self, who: Owner, id: BlobId, nbytes: u64, k: Key) -> Result<(), TestCaseError> {
        self.alloc(who, id, nbytes, 1)?;
        let reserved = self.blobs.get(&id).is_some_and(
            |b| matches!(b.state, MState::Reserved { holder, .. } if holder.session == who.session),
        );
        if reserved {
            let spec = EntrySpec {
                meta: vec![k.row as u8, 0xEE],
                key: k,
                offset: 0,
                len: nbytes,
            };
            self.commit(who, id, &[spec])?;
        }
        Ok(())
    }

    fn private_id(&mut self) -> BlobId {
        self.next_private += 1;
        BlobId(self.next_private)
    }

    /// Settle effects and check everything, naming the step on failure.
    fn step(&mut self, what: &str) -> Result<(), TestCaseError> {
        self.settle_effects()
            .and_then(|()| self.check())
            .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))
    }

    /// The paused writer (see [`Op::PausedWriter`]).
    fn paused_writer(
        &mut self,
        slot: usize,
        size: u64,
        cut: bool,
        pause: u64,
        others: &[(u64, u64, usize)],
        then: u8,
    ) -> Result<(), TestCaseError> {
        let Some(w) = self.direct_conn(slot)? else {
            self.count("paused writer: no direct connection");
            return Ok(());
        };
        let id = self.private_id();
        self.alloc(w, id, size, 1)?;
        let range = match self.blobs.get(&id) {
            Some(MBlob {
                region: Some(r),
                state: MState::Reserved { .. },
                ..
            }) => r.clone(),
            _ => {
                self.count("paused writer: no room in the slab");
                return Ok(());
            }
        };
        self.step("paused writer reserved")?;
        if cut {
            self.detach(w, ConnEnd::Cut)?;
            self.step("paused writer cut")?;
        }
        // It pauses: a debugger, a frozen cgroup, swap.
        self.advance(ms(pause));
        self.step("paused writer pauses")?;
        // Other sessions put meanwhile: they get Busy, Full or a disjoint
        // range, never the paused writer's.
        for (i, &(osize, row, field)) in others.iter().enumerate() {
            let Some(o) = self.other_session_owner(w.session, (i as u8).wrapping_add(then))? else {
                break;
            };
            let oid = self.private_id();
            self.put(o, oid, osize, key(row, field))?;
            prop_assert!(
                self.blobs
                    .get(&id)
                    .is_some_and(|b| b.region.as_ref() == Some(&range)
                        && matches!(b.state, MState::Reserved { .. })),
                "the paused writer lost its reservation {:?}",
                range
            );
            if let Some(r) = self.blobs.get(&oid).and_then(|b| b.region.as_ref()) {
                for &p in r {
                    prop_assert!(
                        !range.iter().any(|&q| overlap(p, q)),
                        "another session's put got {:?}, overlapping the paused writer's {:?}",
                        r,
                        range
                    );
                }
            }
            self.step("another session puts while the writer is paused")?;
        }
        // It resumes and writes its whole reservation: no other value may
        // change (the check reads every one back).
        self.scribble_blob(id);
        self.count(if cut {
            "paused writer resumed after its connection was cut"
        } else {
            "paused writer resumed"
        });
        if pause >= HOUR_MS {
            self.count("paused writer resumed after hours");
        }
        self.step("the paused writer resumed")?;
        let spec = EntrySpec {
            key: key(u64::from(then) % ROWS, usize::from(then)),
            offset: 0,
            len: size,
            meta: vec![then],
        };
        match then % 3 {
            // It stays, still holding its reservation.
            0 => {}
            // It completes its put: after a cut, on a new connection that
            // takes the reservation over.
            1 => {
                let o = if cut {
                    self.other_conn_of(w.session, None, true)?
                } else {
                    Some(w)
                };
                if let Some(o) = o {
                    if cut {
                        self.alloc(o, id, size, 1)?;
                    }
                    self.commit(o, id, &[spec])?;
                }
            }
            // It ends: its process is gone, or it gives up the put.
            _ => {
                if cut {
                    self.process_gone(w.session)?;
                } else {
                    self.abort(w, id, then & 8 != 0)?;
                }
            }
        }
        Ok(())
    }

    /// The paused reader (see [`Op::PausedReader`]).
    fn paused_reader(
        &mut self,
        slot: usize,
        keys: &[Key],
        cut: bool,
        pause: u64,
        others: &[(u64, u64, usize)],
        then: u8,
    ) -> Result<(), TestCaseError> {
        let Some(r) = self.direct_conn(slot)? else {
            self.count("paused reader: no direct connection");
            return Ok(());
        };
        if !keys.iter().any(|k| self.values.contains_key(k)) {
            // Something to read first.
            let id = self.private_id();
            let size = others.first().map_or(100, |o| o.0);
            self.put(r, id, size, keys[0].clone())?;
            self.step("a value for the paused reader")?;
        }
        // With a disk tier, values found on disk are sometimes promoted
        // while the reader pauses, with no pin of the driver's: if the
        // reader's pin goes before the copy lands, the range stays held.
        let promote = if then & 0x40 != 0 { 2 } else { 0 };
        let Some(pin) = self.resolve_and_pin(r, keys, promote)? else {
            self.count("paused reader: nothing to read");
            return Ok(());
        };
        self.step("paused reader pinned")?;
        if cut {
            self.detach(r, ConnEnd::Cut)?;
            self.step("paused reader cut")?;
        }
        // Its values are released, it pauses, others put (the same keys
        // among them).
        let rows: Vec<u64> = keys.iter().map(|k| k.row).collect();
        self.clear_rows(&rows)?;
        self.step("the paused reader's rows released")?;
        self.advance(ms(pause));
        self.step("paused reader pauses")?;
        for (i, &(osize, row, field)) in others.iter().enumerate() {
            let Some(o) = self.other_session_owner(r.session, (i as u8).wrapping_add(then))? else {
                break;
            };
            let oid = self.private_id();
            let k = if i == 0 {
                keys[0].clone()
            } else {
                key(row, field)
            };
            self.put(o, oid, osize, k)?;
            self.step("another session puts while the reader is paused")?;
        }
        // It resumes and reads its pinned ranges: unchanged.
        let Some(p) = self.pins.get(&pin) else {
            return Err(TestCaseError::fail(format!(
                "the paused reader's pin {pin:?} is gone"
            )));
        };
        for (place, bytes) in &p.snapshots {
            prop_assert_eq!(
                self.read(place),
                Some(bytes.clone()),
                "the paused reader's bytes at {:?} changed",
                place
            );
        }
        self.count(if cut {
            "paused reader read unchanged bytes after its connection was cut"
        } else {
            "paused reader read unchanged bytes"
        });
        match then % 3 {
            0 => {}
            // It is done: unpins (after a cut, from a new connection).
            1 => {
                let o = if cut {
                    self.other_conn_of(r.session, None, true)?
                } else {
                    Some(r)
                };
                if let Some(o) = o {
                    self.unpin(o, pin)?;
                }
            }
            _ => {
                if cut {
                    self.process_gone(r.session)?;
                } else {
                    self.detach(r, ConnEnd::Closed)?;
                }
            }
        }
        Ok(())
    }

    /// A late promotion copy (see [`Op::LatePromotion`]).
    fn late_promotion(
        &mut self,
        who: u8,
        pick: u8,
        end: u8,
        others: &[(u64, u64, usize)],
    ) -> Result<(), TestCaseError> {
        if self.disk_cap == 0 {
            return Ok(());
        }
        // Room below the high watermark: the driver spills first.
        self.spill(&[(true, true)])?;
        self.step("a spill before a promotion")?;
        let on_disk: Vec<Key> = self
            .values
            .iter()
            .filter(|(_, v)| {
                self.blobs[&v.blob].region.is_none() && self.blobs[&v.blob].promoting.is_none()
            })
            .map(|(k, _)| k.clone())
            .collect();
        if on_disk.is_empty() {
            self.count("late promotion: nothing on disk");
            return Ok(());
        }
        let k = on_disk[usize::from(pick) % on_disk.len()].clone();
        let Some(r) = self.live_owner(who) else {
            return Ok(());
        };
        let blob = self.values[&k].blob;
        let Some(pin) = self.resolve_and_pin(r, std::slice::from_ref(&k), 2)? else {
            return Err(TestCaseError::fail(format!("no pin for {k} on disk")));
        };
        let promoting = |jobs: &[Job]| {
            jobs.iter()
                .position(|j| matches!(j, Job::Promote { blob: b, .. } if *b == blob))
        };
        if promoting(&self.jobs).is_none() {
            self.count("late promotion: no room");
            return Ok(());
        }
        self.step("a promotion starts")?;
        // The row goes and the reader's hold ends before the copy lands.
        self.clear_rows(&[k.row])?;
        self.step("the promoted row is released")?;
        match end % 4 {
            0 => self.unpin(r, pin)?,
            1 => self.detach(r, ConnEnd::Closed)?,
            2 => {
                self.detach(r, ConnEnd::Cut)?;
                // A direct reader keeps its pin until its process is gone.
                if self.pins.contains_key(&pin) {
                    self.process_gone(r.session)?;
                }
            }
            _ => {}
        }
        self.step("the reader's hold ends")?;
        // Others put meanwhile: never into the range being copied into.
        for (n, &(size, row, field)) in others.iter().enumerate() {
            let Some(o) = self.live_owner(who.wrapping_add(n as u8 + 1)) else {
                break;
            };
            let id = self.private_id();
            self.put(o, id, size, key(row, field))?;
            self.step("a put while the promotion copies")?;
        }
        // The copy lands, late.
        let Some(i) = promoting(&self.jobs) else {
            return Err(TestCaseError::fail(format!(
                "the promotion of {blob:?} vanished"
            )));
        };
        let job = self.jobs.remove(i);
        self.complete(job, true)
    }

    /// A reader races a compaction move (see [`Op::MoveRace`]).
    fn move_race(
        &mut self,
        slot: usize,
        then: u8,
        others: &[(u64, u64, usize)],
    ) -> Result<(), TestCaseError> {
        let moving = self.jobs.iter().find_map(|j| match j {
            Job::Move { blob, .. } if self.blobs.contains_key(blob) => Some(*blob),
            _ => None,
        });
        let Some(blob) = moving else {
            self.count("move race: no move under way");
            return Ok(());
        };
        let keys: Vec<Key> = self
            .values
            .iter()
            .filter(|(_, v)| v.blob == blob)
            .map(|(k, _)| k.clone())
            .take(2)
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        let Some(r) = self.direct_conn(slot)? else {
            return Ok(());
        };
        let before = self.blobs[&blob].region.clone();
        let Some(pin) = self.resolve_and_pin(r, &keys, 0)? else {
            return Err(TestCaseError::fail(format!(
                "no pin for {keys:?} of moving {blob:?}"
            )));
        };
        self.step("a reader pins a blob while it moves")?;
        match then % 4 {
            // It keeps reading.
            0 => {}
            // Its rows are cleared: the pin alone keeps the blob.
            1 => {
                let rows: Vec<u64> = keys.iter().map(|k| k.row).collect();
                self.clear_rows(&rows)?;
                self.step("the moving blob's rows are cleared")?;
            }
            // Others put meanwhile (the same keys among them).
            2 => {
                for (i, &(size, row, field)) in others.iter().enumerate() {
                    let Some(o) =
                        self.other_session_owner(r.session, then.wrapping_add(i as u8))?
                    else {
                        break;
                    };
                    let id = self.private_id();
                    let k = if i == 0 {
                        keys[0].clone()
                    } else {
                        key(row, field)
                    };
                    self.put(o, id, size, k)?;
                    self.step("a put while a pinned blob's move copies")?;
                }
            }
            // It lets go before the copy lands: the move may then go on.
            _ => {
                self.unpin(r, pin)?;
                self.step("the reader lets go before the move reports")?;
            }
        }
        let Some(i) = self
            .jobs
            .iter()
            .position(|j| matches!(j, Job::Move { blob: b, .. } if *b == blob))
        else {
            return Err(TestCaseError::fail(format!(
                "the move of {blob:?} vanished"
            )));
        };
        let job = self.jobs.remove(i);
        self.complete(job, true)?;
        if let Some(p) = self.pins.get(&pin) {
            // The fence: a pinned blob does not move; its reader reads the
            // same range and the same bytes.
            prop_assert_eq!(
                self.core.blob_pieces(blob),
                before,
                "a blob moved while {:?} pinned it",
                pin
            );
            for (place, bytes) in &p.snapshots {
                prop_assert_eq!(
                    self.read(place),
                    Some(bytes.clone()),
                    "the reader's bytes at {:?} changed by a move",
                    place
                );
            }
            self.count("move race: the pinned reader's range did not move");
        } else if self.blobs.get(&blob).and_then(|b| b.region.clone()) != before {
            self.count("move race: the reader let go and the blob moved");
        }
        self.step("the move reports while a reader raced it")?;
        if then & 0x10 != 0 && self.pins.contains_key(&pin) && self.is_live(r) {
            self.unpin(r, pin)?;
        }
        Ok(())
    }

    // ---- the driver -----------------------------------------------------

    /// The driver runs the spill jobs it was handed (at once, or later).
    fn spill(&mut self, plan: &[(bool, bool)]) -> Result<(), TestCaseError> {
        if plan.is_empty() {
            return Ok(());
        }
        let (mut i, mut k) = (0, 0);
        while i < self.jobs.len() {
            if matches!(self.jobs[i], Job::Spill { .. }) {
                let (now, ok) = plan[k % plan.len()];
                k += 1;
                if now {
                    let job = self.jobs.remove(i);
                    self.complete(job, ok)?;
                    continue;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// The spill jobs the core handed out when polled after an input
    /// (`before`: its regions before the poll; `new_moves`: the move
    /// targets the same poll handed out after the spills, already in the
    /// model): exactly what the watermarks call for, oldest first. They run
    /// later ([`Op::Spill`], [`Op::Complete`]).
    fn check_spills(
        &mut self,
        before: BTreeSet<(BlobId, u64, u64)>,
        new_moves: &BTreeSet<(BlobId, u64, u64)>,
        jobs: Vec<SpillJob>,
    ) -> Result<(), TestCaseError> {
        // Spills are worked out before a move of the same poll reserves
        // its target.
        let fresh: u64 = new_moves.iter().map(|m| m.2).sum();
        let used = self.allocated() - fresh;
        if self.disk_cap == 0 || used as f64 <= HIGH_WATERMARK * self.cap as f64 {
            prop_assert!(
                jobs.is_empty(),
                "spill jobs {:?} with {} of {} used (disk {})",
                jobs,
                used,
                self.cap,
                self.disk_cap
            );
            prop_assert_eq!(
                self.core.regions().collect::<BTreeSet<_>>(),
                before.union(new_moves).copied().collect::<BTreeSet<_>>(),
                "a poll below the high watermark changed the regions (other than by a move)"
            );
            return Ok(());
        }
        let mut last_seq = 0;
        let mut moved = 0u64;
        for j in &jobs {
            let b = self.blobs.get(&j.blob);
            prop_assert!(
                b.is_some_and(|b| b.state == MState::Committed
                    && b.disk == MDisk::None
                    && b.moving.is_none()
                    && b.region.as_ref() == Some(&j.pieces)
                    && b.nbytes == j.nbytes),
                "spill job {:?} for {:?}",
                j,
                b
            );
            prop_assert!(!self.pinned(j.blob), "spill job {:?} of a pinned blob", j);
            let b = self.blobs.get_mut(&j.blob).unwrap();
            prop_assert!(b.seq > last_seq, "spill jobs not oldest first: {:?}", jobs);
            last_seq = b.seq;
            b.disk = MDisk::Writing;
            moved = moved.max(b.region.as_ref().unwrap().iter().map(|p| p.1).sum());
        }
        // Memory copies of durable blobs may go too (all their pieces).
        let kept: BTreeSet<_> = self.core.regions().collect();
        let mut dropped: BTreeMap<BlobId, u64> = BTreeMap::new();
        for (id, off, len) in &before {
            if !kept.contains(&(*id, *off, *len)) {
                *dropped.entry(*id).or_default() += *len;
            }
        }
        for len in dropped.into_values() {
            moved = moved.max(len);
        }
        self.reconcile()?;
        prop_assert!(
            self.disk_used() <= self.disk_cap,
            "spilling filled the disk past its capacity"
        );
        // It stops at the low watermark (counting writes under way as done),
        // or when nothing more can go.
        let target = (LOW_WATERMARK * self.cap as f64) as u64;
        let projected = self.allocated() - fresh - self.spilling_bytes();
        if projected > target {
            let free = self.disk_free();
            for (id, b) in &self.blobs {
                let candidate = b.state == MState::Committed
                    && b.region.is_some()
                    && (b.moving.is_none() || new_moves.iter().any(|m| m.0 == *id))
                    && !self.pinned(*id)
                    && (b.disk == MDisk::Durable || b.disk == MDisk::None && b.nbytes <= free);
                prop_assert!(
                    !candidate,
                    "spilling stopped at {} bytes (target {}) though {:?} could go: {:?}",
                    projected,
                    target,
                    id,
                    b
                );
            }
        }
        if moved > 0 {
            prop_assert!(
                projected + moved > target,
                "spilled more than needed: {} bytes left (target {})",
                projected,
                target
            );
        }
        for j in &jobs {
            self.count("spill");
            self.jobs.push(Job::Spill {
                blob: j.blob,
                pieces: j.pieces.clone(),
                nbytes: j.nbytes,
            });
        }
        Ok(())
    }

    /// The driver finishes `job` and reports it.
    fn complete(&mut self, job: Job, ok: bool) -> Result<(), TestCaseError> {
        match job {
            Job::Put { blob } => {
                if !ok {
                    // A partial file.
                    if let Some(f) = self.files.get_mut(&blob) {
                        f.truncate(f.len() / 2);
                    }
                }
                self.core.disk_written(blob, ok);
                let b = self.blobs.get(&blob);
                prop_assert!(
                    b.is_some_and(|b| b.region.is_none()
                        && b.disk == MDisk::Writing
                        && matches!(
                            b.state,
                            MState::Reserved { .. } | MState::PendingDisk { .. }
                        )),
                    "a put's write of {:?} finished, but the model has {:?}",
                    blob,
                    b
                );
                if !ok {
                    // The put never happened; its holder holds it no more.
                    self.count("put failed");
                    let b = self.blobs.remove(&blob).unwrap();
                    self.expect_deletes.push(blob);
                    if let MState::Reserved { holder, .. } = b.state {
                        if holder.conn.is_none() {
                            self.count("put of a cut connection failed");
                        }
                        self.maybe_forget(holder.session);
                    }
                    return Ok(());
                }
                let b = self.blobs.get_mut(&blob).unwrap();
                b.disk = MDisk::Durable;
                if let MState::PendingDisk { specs } = b.state.clone() {
                    // Visible from now on.
                    self.count("pending put published");
                    self.publish(blob, &specs);
                }
            }
            Job::Spill {
                blob,
                pieces,
                nbytes,
            } => {
                let bytes = if ok {
                    self.pieces_bytes(&pieces, 0, nbytes)
                } else {
                    self.fresh(nbytes / 2)
                };
                prop_assert!(
                    !self.files.contains_key(&blob),
                    "spill of {:?} over an existing file",
                    blob
                );
                self.files.insert(blob, bytes);
                self.core.disk_written(blob, ok);
                if let Some((_, r)) = self.orphans.remove(&blob) {
                    // Freed while written: the file goes now, and the range
                    // it read from is freed.
                    prop_assert_eq!(r, Some(pieces), "orphaned spill range");
                    self.expect_deletes.push(blob);
                    return Ok(());
                }
                let pinned = self.pinned(blob);
                let b = self.blobs.get_mut(&blob);
                prop_assert!(
                    b.as_ref().is_some_and(|b| b.state == MState::Committed
                        && b.disk == MDisk::Writing
                        && b.region.as_ref() == Some(&pieces)),
                    "a spill of {:?} finished, but the model has {:?}",
                    blob,
                    b
                );
                let b = b.unwrap();
                if !ok {
                    // Still in memory; the partial file goes.
                    b.disk = MDisk::None;
                    self.expect_deletes.push(blob);
                    self.count("spill failed");
                    return Ok(());
                }
                b.disk = MDisk::Durable;
                if !pinned {
                    // Its memory is freed at once.
                    let r = b.region.take().unwrap();
                    prop_assert!(
                        !self
                            .core
                            .regions()
                            .any(|x| r.iter().any(|p| x == (blob, p.0, p.1))),
                        "memory of unpinned {:?} kept after its spill was written",
                        blob
                    );
                }
                self.count("spill written");
            }
            Job::Promote {
                blob,
                offset,
                bytes,
                pin,
            } => {
                // The copy lands in the range (or, failing, some of it).
                if ok {
                    self.slab[offset as usize..offset as usize + bytes.len()]
                        .copy_from_slice(&bytes);
                } else {
                    self.scribble(offset, rounded(bytes.len() as u64));
                }
                self.core.promote_done(blob, ok);
                match self.blobs.get_mut(&blob) {
                    Some(b) if b.promoting.is_some_and(|p| p.0 == offset) => {
                        let p = b.promoting.take();
                        if ok && b.region.is_none() {
                            b.region = p.map(|p| vec![p]);
                            self.count("promoted");
                        }
                    }
                    b => {
                        // Only without the driver's pin can the blob go
                        // while promoted; its range was held until now, so
                        // the late copy above landed in no one's bytes.
                        prop_assert!(
                            pin.is_none(),
                            "promotion of {:?} finished though the driver pinned it: {:?}",
                            blob,
                            b
                        );
                        let r = self.orphan_promotions.remove(&blob);
                        prop_assert_eq!(
                            r.map(|r| r.0),
                            Some(offset),
                            "promotion of freed {:?} finished without a held range",
                            blob
                        );
                        self.count("late promotion copy of a freed blob");
                    }
                }
                if let Some(pin) = pin {
                    self.driver_pins.remove(&pin);
                    self.unpin(Owner::UNIT, pin)?;
                }
            }
            Job::Move {
                blob,
                from,
                to,
                nbytes,
                copied,
            } => self.finish_move(blob, &from, to, nbytes, copied, ok)?,
        }
        Ok(())
    }

    /// Every slab range a session (the unit's own included) may touch.
    fn all_session_ranges(&self) -> Vec<(u64, u64)> {
        let mut ids: Vec<SessionId> = self.live_sessions().map(|s| s.id).collect();
        ids.push(Owner::UNIT.session);
        ids.into_iter()
            .flat_map(|id| self.model_session_ranges(id))
            .collect()
    }

    /// The driver was handed compaction moves (at most one, polled after
    /// an input): the model's blob gets its target, as the core's does.
    fn begin_moves(
        &mut self,
        moves: &[MoveJob],
    ) -> Result<BTreeSet<(BlobId, u64, u64)>, TestCaseError> {
        prop_assert!(
            moves.len() <= 1
                && (moves.is_empty() || !self.jobs.iter().any(|j| matches!(j, Job::Move { .. }))),
            "more than one move under way: {:?}, jobs {:?}",
            moves,
            self.jobs
        );
        let mut targets = BTreeSet::new();
        for m in moves {
            let len = rounded(m.nbytes);
            let b = self.blobs.get_mut(&m.blob);
            prop_assert!(
                b.as_ref().is_some_and(|b| b.moving.is_none()),
                "move {:?} of a blob the model has as {:?}",
                m,
                b
            );
            b.unwrap().moving = Some((m.to, len));
            targets.insert((m.blob, m.to, len));
        }
        Ok(targets)
    }

    /// Check a move the core handed out (once the spills of the same poll
    /// are in the model), then run it: at once, or later (a job), with
    /// the copy made now or when it reports.
    fn check_moves(&mut self, moves: Vec<MoveJob>) -> Result<(), TestCaseError> {
        for m in moves {
            let len = rounded(m.nbytes);
            let pinned = self.pinned(m.blob);
            let b = self.blobs[&m.blob].clone();
            // The fencing rule: only a committed blob that nobody can
            // touch moves (no pin, no reservation, no spill or promotion
            // under way).
            prop_assert!(
                b.state == MState::Committed
                    && !pinned
                    && b.disk != MDisk::Writing
                    && b.promoting.is_none()
                    && b.nbytes == m.nbytes
                    && b.region.as_ref() == Some(&m.from),
                "move {:?} of a blob someone may touch (pinned {}): {:?}",
                m,
                pinned,
                b
            );
            prop_assert!(
                len <= self.core.config().compact_max_move,
                "move {:?} of a blob larger than compact_max_move",
                m
            );
            // It gathers a blob in pieces into one range, or moves it down.
            prop_assert!(
                m.from.len() > 1 || m.to < m.from[0].0,
                "move {:?} gains nothing",
                m
            );
            // Its target overlaps nothing held: no other blob's piece, no
            // session's range, no quarantine, no orphaned range.
            self.blobs.get_mut(&m.blob).unwrap().moving = None;
            let fresh = self.check_new_range("move target", m.blob, m.to, len);
            self.blobs.get_mut(&m.blob).unwrap().moving = Some((m.to, len));
            fresh?;
            for r in self.all_session_ranges() {
                prop_assert!(
                    !overlap(r, (m.to, len)),
                    "move {:?} targets {:?}, a range a session may touch",
                    m,
                    r
                );
            }
            self.count("move handed out");
            if m.from.len() > 1 {
                self.count("move gathers a blob in pieces");
            }
            let roll = self.roll();
            let ok = !roll.is_multiple_of(8);
            let copy_now = roll % 10 < 7;
            if copy_now {
                let bytes = self.pieces_bytes(&m.from, 0, m.nbytes);
                self.slab[m.to as usize..(m.to + m.nbytes) as usize].copy_from_slice(&bytes);
            }
            let job = Job::Move {
                blob: m.blob,
                from: m.from,
                to: m.to,
                nbytes: m.nbytes,
                copied: copy_now,
            };
            if (roll >> 8) % 10 < 4 {
                self.complete(job, ok)?;
            } else {
                self.count("move reported later");
                self.jobs.push(job);
            }
        }
        Ok(())
    }

    /// The driver finishes a move (copying now unless it did already) and
    /// reports it; the blob switches to its new range only if nobody
    /// touched it meanwhile.
    fn finish_move(
        &mut self,
        blob: BlobId,
        from: &[(u64, u64)],
        to: u64,
        nbytes: u64,
        copied: bool,
        ok: bool,
    ) -> Result<(), TestCaseError> {
        let len = rounded(nbytes);
        let target = (to, len);
        let held = self.blobs.get(&blob).and_then(|b| b.moving) == Some(target)
            || self.orphan_moves.get(&blob).is_some_and(|o| o.1 == target);
        prop_assert!(
            held,
            "move of {:?} reports, but its target {:?} is no longer held for it",
            blob,
            target
        );
        // The move writes no range a session may touch.
        for r in self.all_session_ranges() {
            prop_assert!(
                !overlap(r, target),
                "the copy of {:?} into {:?} lands in a range a session may touch {:?}",
                blob,
                target,
                r
            );
        }
        let source = self.pieces_bytes(from, 0, nbytes);
        if copied {
            // Nobody wrote into the target (nor the source) since the copy.
            prop_assert!(
                self.slab_bytes(to, nbytes) == &source[..],
                "the target {:?} of the move of {:?} changed while it copied",
                target,
                blob
            );
        } else if ok {
            self.slab[to as usize..(to + nbytes) as usize].copy_from_slice(&source);
        }
        if !ok {
            // A failed copy leaves anything in the target.
            self.scribble(to, len);
        }
        self.core.moved(blob, ok);
        if let Some((old, _)) = self.orphan_moves.remove(&blob) {
            prop_assert_eq!(&old[..], from, "the old pieces of the freed {:?}", blob);
            self.count("move of a freed blob: both ranges released");
            return Ok(());
        }
        let pinned = self.pinned(blob);
        let Some(b) = self.blobs.get_mut(&blob) else {
            return Err(TestCaseError::fail(format!(
                "move of {blob:?} reports, but the model has no blob"
            )));
        };
        prop_assert_eq!(
            b.region.as_deref(),
            Some(from),
            "pieces of moving {:?}",
            blob
        );
        b.moving = None;
        let untouched = ok && b.state == MState::Committed && !pinned && b.disk != MDisk::Writing;
        if untouched {
            b.region = Some(vec![target]);
            self.compaction_moves += 1;
            self.compaction_bytes += nbytes;
            self.count("move done: the blob's values follow it");
        } else if !ok {
            self.count("move failed: the blob stays");
        } else {
            self.count("move abandoned: the blob was pinned while it copied");
        }
        Ok(())
    }

    /// Time passes (a pause of any length), and the driver ticks: only
    /// quarantines end. No hold ends by time.
    fn advance(&mut self, d: Duration) {
        self.now += d;
        if d >= ms(MINUTE_MS) {
            self.count(if d >= ms(HOUR_MS) {
                "pause of an hour or more"
            } else {
                "pause of minutes"
            });
            if self
                .blobs
                .values()
                .any(|b| matches!(b.state, MState::Reserved { .. }))
                || self
                    .pins
                    .values()
                    .any(|p| p.holder.session != Owner::UNIT.session)
            {
                self.count("holds outlive a long pause");
            }
        }
        let now = self.now;
        let released = self.core.tick(now);
        self.quarantine.retain(|q| q.2 > now);
        // Fenced holds whose nixl quarantine is over go (no further
        // quarantine: nothing of their transfers can land any more).
        let due = |h: &MHolder| matches!(h.fenced, Some(Some(t)) if t <= now);
        let reservations: Vec<(BlobId, SessionId)> = self
            .blobs
            .iter()
            .filter_map(|(id, b)| match b.state {
                MState::Reserved { holder, .. } if due(&holder) => Some((*id, holder.session)),
                _ => None,
            })
            .collect();
        let pins: Vec<(PinId, SessionId)> = self
            .pins
            .iter()
            .filter(|(_, p)| due(&p.holder))
            .map(|(id, p)| (*id, p.holder.session))
            .collect();
        let n = (reservations.len() + pins.len()) as u64;
        let mut sessions = BTreeSet::new();
        for (id, session) in reservations {
            self.release_reservation(id, false);
            sessions.insert(session);
        }
        for (pin, session) in pins {
            self.pins.remove(&pin);
            self.dead_pins.push(pin);
            sessions.insert(session);
        }
        assert_eq!(released, n, "holds released by the tick");
        if n > 0 {
            self.count("nixl quarantine over: holds released");
            self.gc();
            for s in sessions {
                self.maybe_forget(s);
            }
        }
    }

    /// Take the core's effects: exactly the removals the model expects, none
    /// of a file still needed. The driver removes the files, and stops
    /// writing (without reporting) a put whose file goes.
    fn settle_effects(&mut self) -> Result<(), TestCaseError> {
        // The core may have dropped memory copies of durable blobs on its
        // own (an unpin): the model learns of it before judging the spills
        // the core works out from its own use.
        self.reconcile()?;
        let before: BTreeSet<_> = self.core.regions().collect();
        let (mut got, spills, watch, moves) = self.core.actions();
        let new_moves = self.begin_moves(&moves)?;
        for s in watch {
            // Asked when the session's last connection ended with holds
            // kept; it may have been declared gone since, in the same op.
            prop_assert!(s != Owner::UNIT.session, "asked to watch the unit itself");
            self.count("asked to watch a process");
        }
        got.sort_unstable();
        let mut want = std::mem::take(&mut self.expect_deletes);
        want.sort_unstable();
        for b in &got {
            let live = self.values.values().any(|v| v.blob == *b);
            let pinned = self.pinned(*b);
            let in_memory = self.blobs.get(b).is_some_and(|mb| mb.region.is_some());
            prop_assert!(
                !(live || pinned) || in_memory,
                "DeleteFile({:?}) while {} still refers to it and its bytes are only on disk",
                b,
                if live { "a live entry" } else { "a pin" }
            );
            let read_on_disk = self.pins.values().any(|p| {
                p.snapshots
                    .iter()
                    .any(|(place, _)| matches!(place, Placement::Disk { blob, .. } if blob == b))
            });
            prop_assert!(
                !read_on_disk,
                "DeleteFile({:?}) while a pin reads it from its file",
                b
            );
            prop_assert!(
                !self
                    .jobs
                    .iter()
                    .any(|j| matches!(j, Job::Spill { blob, .. } if blob == b)),
                "DeleteFile({:?}) while its spill is still being written: the file would come back",
                b
            );
        }
        prop_assert_eq!(&got, &want, "DeleteFile effects");
        for b in got {
            prop_assert!(
                self.files.remove(&b).is_some(),
                "DeleteFile({:?}) names no file",
                b
            );
            self.jobs
                .retain(|j| !matches!(j, Job::Put { blob } if *blob == b));
        }
        self.check_spills(before, &new_moves, spills)?;
        self.check_moves(moves)
    }

    /// The core may drop the memory copy of a committed, durable, unpinned
    /// blob on its own (spilling, unpinning); anything else about its
    /// ranges must match the model exactly.
    fn reconcile(&mut self) -> Result<(), TestCaseError> {
        let core: BTreeSet<(BlobId, u64, u64)> = self.core.regions().collect();
        let ids: Vec<BlobId> = self.blobs.keys().copied().collect();
        for id in ids {
            let b = &self.blobs[&id];
            let Some(pieces) = &b.region else { continue };
            if pieces
                .iter()
                .all(|&(off, len)| core.contains(&(id, off, len)))
            {
                continue;
            }
            prop_assert!(
                b.state == MState::Committed
                    && b.disk == MDisk::Durable
                    && !self.pinned(id)
                    && b.moving.is_none()
                    && pieces
                        .iter()
                        .all(|&(off, len)| !core.contains(&(id, off, len))),
                "the core dropped the range {:?} of {:?} ({:?}, disk {:?}, pinned {}, moving {:?})",
                pieces,
                id,
                b.state,
                b.disk,
                self.pinned(id),
                b.moving
            );
            self.count("memory copy dropped");
            self.blobs.get_mut(&id).unwrap().region = None;
        }
        prop_assert_eq!(
            &core,
            &self.model_regions(),
            "ranges held by the core vs the model ({:?})",
            self.blobs
        );
        let mut held = self.core.held_ranges();
        held.sort_unstable();
        let want: Vec<(u64, u64)> = self.model_held().iter().map(|&(o, l, _)| (o, l)).collect();
        prop_assert_eq!(
            &held,
            &want,
            "held ranges (quarantines, orphaned spills, promotions and moves) of the core vs the model"
        );
        Ok(())
    }

    /// The slab ranges `session` may touch, per the model: its reserved
    /// ranges, and the range of every blob its pins hold (once per pin).
    fn model_session_ranges(&self, session: SessionId) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .blobs
            .values()
            .filter(
                |b| matches!(b.state, MState::Reserved { holder, .. } if holder.session == session),
            )
            .filter_map(|b| b.region.clone())
            .flatten()
            .collect();
        for p in self.pins.values().filter(|p| p.holder.session == session) {
            v.extend(
                p.blobs
                    .iter()
                    .filter_map(|b| self.blobs.get(b)?.region.clone())
                    .flatten(),
            );
        }
        v.sort_unstable();
        v
    }

    /// Per-session stats the unit should report at `now`, the bytes they
    /// hold in all, the number of overdue holds, and the bytes of their
    /// pinned blobs.
    fn expected_sessions(&self) -> (Vec<SessionStats>, u64, u64, u64) {
        let mut ids: Vec<(SessionId, u32)> = self
            .live_sessions()
            .map(|s| (s.id, s.conns.len() as u32))
            .collect();
        ids.push((Owner::UNIT.session, 0));
        let mut out = Vec::new();
        let mut held = 0;
        let mut overdue = 0;
        let mut pinned = 0;
        for (id, connections) in ids {
            let mut st = SessionStats {
                session: id.0,
                connections,
                ..SessionStats::default()
            };
            let mut oldest: Option<Time> = None;
            let mut note = |h: &MHolder, lease: u64, st: &mut SessionStats| {
                oldest = Some(oldest.map_or(h.since, |o| o.min(h.since)));
                if self.now.saturating_sub(h.since) > ms(lease) {
                    overdue += 1;
                }
                if h.conn.is_none() {
                    st.orphaned += 1;
                }
            };
            for b in self.blobs.values() {
                if let MState::Reserved { holder, .. } = &b.state {
                    if holder.session == id {
                        st.reservations += 1;
                        st.held_bytes +=
                            b.region.as_ref().map_or(0, |r| r.iter().map(|p| p.1).sum());
                        note(holder, RESERVATION_LEASE_MS, &mut st);
                    }
                }
            }
            for p in self.pins.values().filter(|p| p.holder.session == id) {
                st.pins += 1;
                let bytes = p
                    .blobs
                    .iter()
                    .filter_map(|b| self.blobs.get(b))
                    .map(|b| b.nbytes)
                    .sum::<u64>();
                st.held_bytes += bytes;
                pinned += bytes;
                note(&p.holder, PIN_LEASE_MS, &mut st);
            }
            if id == Owner::UNIT.session && st.pins == 0 {
                continue;
            }
            if st.connections == 0 && st.reservations == 0 && st.pins == 0 {
                continue;
            }
            st.oldest_hold_ms = oldest.map_or(0, |o| self.now.saturating_sub(o).as_millis() as u64);
            held += st.held_bytes;
            out.push(st);
        }
        out.sort_by_key(|s| s.session);
        (out, held, overdue, pinned)
    }

    /// The fence (see the crate docs): what each session may touch is what
    /// the core says, each range one the unit holds, overlapping no other.
    fn check_fences(&mut self) -> Result<(), TestCaseError> {
        let mut all: Vec<(u64, u64)> = self
            .core
            .regions()
            .map(|(_, off, len)| (off, len))
            .chain(self.core.held_ranges())
            .collect();
        all.sort_unstable();
        let mut ids: Vec<SessionId> = self.live_sessions().map(|s| s.id).collect();
        ids.push(Owner::UNIT.session);
        let mut touched_by_cut = false;
        for id in ids {
            let mut got = self.core.session_ranges(id);
            got.sort_unstable();
            let want = self.model_session_ranges(id);
            prop_assert_eq!(&got, &want, "ranges session {:?} may touch", id);
            let mut mine = want;
            mine.dedup();
            for r in mine {
                let same = all.iter().filter(|&&x| x == r).count();
                prop_assert_eq!(
                    same,
                    1,
                    "range {:?} of session {:?} is not one range the unit holds",
                    r,
                    id
                );
                let other = all.iter().find(|&&x| x != r && overlap(x, r));
                prop_assert!(
                    other.is_none(),
                    "range {:?} that session {:?} may touch overlaps {:?}",
                    r,
                    id,
                    other
                );
            }
            if self.slot_of(id).is_some_and(|s| {
                self.sessions[s]
                    .as_ref()
                    .is_some_and(|s| s.conns.is_empty())
            }) {
                touched_by_cut = true;
            }
        }
        if touched_by_cut {
            self.count("fence checked with an orphaned session");
        }
        for &id in &self.dead_sessions {
            prop_assert!(
                !self.core.has_session(id),
                "session {:?} is gone but the unit still knows it",
                id
            );
            prop_assert!(
                self.core.session_ranges(id).is_empty(),
                "gone session {:?} still has ranges",
                id
            );
        }
        for s in self.live_sessions() {
            prop_assert!(self.core.has_session(s.id), "session {:?} lost", s.id);
        }
        prop_assert_eq!(
            {
                let mut v = self.core.orphaned_sessions();
                v.sort();
                v
            },
            self.orphaned_sessions(),
            "orphaned sessions"
        );
        // Reservations read back what their writer last wrote: no one else
        // wrote into them.
        for (id, b) in &self.blobs {
            if let (MState::Reserved { holder, .. }, Some(pieces)) = (&b.state, &b.region) {
                let len = pieces.iter().map(|p| p.1).sum();
                prop_assert!(
                    self.pieces_bytes(pieces, 0, len) == b.content,
                    "reservation {:?} at {:?} of {:?} was written by someone else",
                    id,
                    pieces,
                    holder
                );
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        // 1. Regions: aligned, inside the slab, pairwise disjoint, and
        //    exactly the blobs and held ranges of the model.
        self.reconcile()?;
        let mut ranges: Vec<(u64, u64)> = self
            .core
            .regions()
            .map(|(_, off, len)| (off, len))
            .chain(self.core.held_ranges())
            .collect();
        ranges.sort_unstable();
        for &(off, len) in &ranges {
            prop_assert!(
                off % ALIGN == 0 && len > 0 && off + len <= self.cap,
                "range {}+{} is misaligned or outside the slab",
                off,
                len
            );
        }
        for w in ranges.windows(2) {
            prop_assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "ranges overlap: {:?} and {:?}",
                w[0],
                w[1]
            );
        }

        // 4. Counters.
        let rows: BTreeSet<u64> = self.values.keys().map(|k| k.row).collect();
        let allocated = self.allocated();
        let expected = Stats {
            capacity: self.cap,
            used: self.stored(),
            free_bytes: self.cap - allocated,
            largest_free: self.largest_gap(),
            spare_budget: spare_budget(self.cap),
            compaction_moves: self.compaction_moves,
            compaction_bytes: self.compaction_bytes,
            split_blobs: self
                .blobs
                .values()
                .filter(|b| b.state == MState::Committed)
                .filter(|b| b.region.as_ref().is_some_and(|r| r.len() > 1))
                .count() as u64,
            reserved_bytes: self.reserved_bytes(),
            quarantined_bytes: self.quarantined_bytes(),
            blobs: self.blobs.len() as u64,
            entries: self.values.len() as u64,
            rows: rows.len() as u64,
            pins: self.pins.len() as u64,
            disk_capacity: self.disk_cap,
            disk_used: self.disk_used(),
            spilled_blobs: self
                .blobs
                .values()
                .filter(|b| b.region.is_none() && b.disk == MDisk::Durable)
                .count() as u64,
            index_bytes: self.index_bytes(),
            // Every value is in the one namespace NS.
            partitions: u64::from(!self.values.is_empty()),
            // Anything else (I/O and traffic counters the server keeps;
            // what sessions hold, in stats_at) is 0 in the core's plain
            // stats.
            ..Stats::default()
        };
        let stats = self.core.stats();
        prop_assert!(
            stats.disk_used <= self.disk_cap,
            "disk_used {} over the disk's capacity {}",
            stats.disk_used,
            self.disk_cap
        );
        prop_assert_eq!(&stats, &expected, "stats");
        let (sessions, held_bytes, overdue_holds, pinned_bytes) = self.expected_sessions();
        if overdue_holds > 0 {
            self.count("overdue holds reported");
        }
        let expected = Stats {
            sessions,
            held_bytes,
            overdue_holds,
            pinned_bytes,
            ..expected
        };
        prop_assert_eq!(&self.core.stats_at(self.now), &expected, "stats_at");
        let quarantined = self.quarantine.iter().map(|q| q.2).min();
        let first = match (quarantined, self.first_fenced()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        prop_assert_eq!(self.core.next_deadline(), first, "next deadline");

        // 5. The files: exactly those of durable blobs and puts being
        //    synced, with their blobs' bytes; memory and disk agree.
        let want_files: BTreeSet<BlobId> = self
            .blobs
            .iter()
            .filter(|(_, b)| {
                b.disk == MDisk::Durable || b.disk == MDisk::Writing && b.region.is_none()
            })
            .map(|(id, _)| *id)
            .collect();
        let files: BTreeSet<BlobId> = self.files.keys().copied().collect();
        prop_assert_eq!(&files, &want_files, "files on the simulated disk");
        for (id, b) in &self.blobs {
            if let Some(f) = self.files.get(id) {
                prop_assert!(
                    f == &b.content,
                    "file of {:?} ({:?}) has other bytes",
                    id,
                    b.state
                );
            }
            if let (MState::Committed, Some(pieces)) = (&b.state, &b.region) {
                prop_assert!(
                    self.pieces_bytes(pieces, 0, b.nbytes) == b.content,
                    "slab bytes of committed {:?} at {:?} changed",
                    id,
                    pieces
                );
            }
        }

        // 7. The fence.
        self.check_fences()?;

        // 2. Every committed key reads back exactly; others are absent.
        let keys = all_keys();
        let (pin, locs) = self
            .core
            .resolve(Owner::UNIT, NS, &keys, self.now)
            .map_err(|e| TestCaseError::fail(format!("the check's resolve: {e:?}")))?;
        for (k, loc) in keys.iter().zip(&locs) {
            match self.values.get(k) {
                None => prop_assert_eq!(
                    loc,
                    &None,
                    "key {} resolves but was never committed (or is not durable yet) or was released",
                    k
                ),
                Some(v) => {
                    let place = self.place(v);
                    prop_assert_eq!(loc.as_ref(), Some(&place), "place of {}", k);
                    prop_assert_eq!(
                        self.read(&place),
                        Some(v.bytes.clone()),
                        "bytes of {} at {:?} changed since commit",
                        k,
                        place
                    );
                }
            }
        }
        prop_assert_eq!(
            pin.is_some(),
            !self.values.is_empty(),
            "pin of the check resolve"
        );
        if let Some(pin) = pin {
            prop_assert!(!self.pins.contains_key(&pin) && !self.dead_pins.contains(&pin));
            prop_assert_eq!(self.core.unpin(Owner::UNIT, pin), Ok(()));
            self.dead_pins.push(pin);
        }
        let (pin, locs) = self
            .core
            .resolve(Owner::UNIT, "other", &keys, self.now)
            .map_err(|e| TestCaseError::fail(format!("the check's resolve: {e:?}")))?;
        prop_assert!(
            pin.is_none() && locs.iter().all(Option::is_none),
            "namespaces leak"
        );
        prop_assert_eq!(
            self.core.stats().pins,
            self.pins.len() as u64,
            "pins after check resolve"
        );

        // 3. Pinned bytes neither move nor change while the unit holds the
        //    pin, in the slab or in the file, whoever holds it.
        for (id, p) in &self.pins {
            for (place, snap) in &p.snapshots {
                prop_assert_eq!(
                    self.read(place),
                    Some(snap.clone()),
                    "pinned bytes at {:?} of {:?} ({:?}) changed",
                    place,
                    id,
                    p.holder
                );
            }
        }
        // The check's unpin may let memory copies go; it removes no file.
        self.reconcile()?;
        self.settle_effects()
    }

    /// Finish every write and promotion, end every connection and session,
    /// release everything, let every quarantine end: the unit must be empty
    /// and whole again, and the simulated disk empty.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        while !self.jobs.is_empty() {
            let job = self.jobs.remove(0);
            self.complete(job, true)?;
            self.step("a job finishes")?;
        }
        // The unit's own pins (checkpoints) go.
        let unit_pins: Vec<PinId> = self
            .pins
            .iter()
            .filter(|(_, p)| p.holder.session == Owner::UNIT.session)
            .map(|(id, _)| *id)
            .collect();
        for pin in unit_pins {
            self.unpin(Owner::UNIT, pin)?;
        }
        self.step("the unit's pins go")?;
        // Every client closes its connections: what they hold goes.
        for slot in 0..SLOTS {
            while let Some(o) = self.sessions[slot]
                .as_ref()
                .and_then(|s| s.conns.first())
                .map(|c| c.owner)
            {
                self.detach(o, ConnEnd::Closed)?;
                self.step("a connection closes")?;
            }
        }
        // Holds of cut connections stay until their process is gone.
        let mut orphaned = self.core.orphaned_sessions();
        orphaned.sort();
        let mut live: Vec<SessionId> = self.live_sessions().map(|s| s.id).collect();
        live.sort();
        prop_assert_eq!(&orphaned, &live, "sessions left holding after every close");
        for s in orphaned {
            self.session_gone(s);
            self.step("an orphaned session is gone")?;
        }
        prop_assert!(self.sessions.iter().all(Option::is_none));
        prop_assert!(self.pins.is_empty(), "pins left: {:?}", self.pins);
        let rows: Vec<u64> = (0..ROWS).collect();
        self.clear_rows(&rows)?;
        self.step("every row released")?;
        // Spills handed out along the way (polled after each of these
        // steps) finish too.
        while !self.jobs.is_empty() {
            let job = self.jobs.remove(0);
            self.complete(job, true)?;
            self.step("a late job finishes")?;
        }
        // Past every quarantine.
        self.advance(ms(QUARANTINE_MS));
        self.step("past every quarantine")?;
        let s = self.core.stats_at(self.now);
        prop_assert_eq!(s.used, 0, "bytes leaked: {:?}", s);
        prop_assert_eq!(s.pins, 0, "pins leaked: {:?}", s);
        prop_assert_eq!(s.entries, 0, "entries leaked: {:?}", s);
        prop_assert_eq!(s.blobs, 0, "blobs leaked: {:?}", s);
        prop_assert_eq!(s.rows, 0);
        prop_assert_eq!(s.reserved_bytes, 0);
        prop_assert_eq!(s.quarantined_bytes, 0);
        prop_assert_eq!(s.index_bytes, 0);
        prop_assert_eq!(s.held_bytes, 0);
        prop_assert!(s.sessions.is_empty(), "sessions left: {:?}", s.sessions);
        prop_assert_eq!(s.disk_used, 0, "disk bytes leaked: {:?}", s);
        prop_assert_eq!(s.spilled_blobs, 0);
        prop_assert!(
            self.orphans.is_empty()
                && self.orphan_promotions.is_empty()
                && self.orphan_moves.is_empty(),
            "orphan writes left: {:?} {:?} {:?}",
            self.orphans,
            self.orphan_promotions,
            self.orphan_moves
        );
        prop_assert_eq!(s.free_bytes, self.cap, "free bytes of an empty unit");
        prop_assert_eq!(self.core.move_under_way(), None, "a move left under way");
        prop_assert!(
            self.files.is_empty(),
            "orphan files left on disk: {:?}",
            self.files.keys().collect::<Vec<_>>()
        );
        prop_assert_eq!(self.core.regions().count(), 0);
        prop_assert!(self.core.held_ranges().is_empty());
        prop_assert!(self.core.orphaned_sessions().is_empty());
        prop_assert_eq!(self.core.next_deadline(), None, "timers left");
        // The freed ranges coalesced: the data zone fits in one piece, and
        // the whole slab in two (the data zone, then the spare zone).
        let whole = BlobId(u128::MAX);
        let session = self.core.open_session();
        let o = self
            .core
            .attach(session, true)
            .map_err(|e| TestCaseError::fail(format!("attach: {e:?}")))?;
        let split = self.cap - spare_budget(self.cap);
        prop_assert_eq!(
            self.core.alloc(o, whole, split, 0, self.now),
            Ok(Allocated::Reserved {
                pieces: vec![(0, split)]
            }),
            "the data zone after everything was freed"
        );
        prop_assert_eq!(self.core.abort(o, whole, false, self.now), Ok(()));
        prop_assert_eq!(
            self.core.alloc(o, whole, self.cap, 0, self.now),
            Ok(Allocated::Reserved {
                pieces: vec![(0, split), (split, self.cap - split)]
            }),
            "whole slab after everything was freed"
        );
        prop_assert_eq!(self.core.abort(o, whole, false, self.now), Ok(()));
        self.core.detach(o, ConnEnd::Closed, self.now);
        prop_assert!(!self.core.has_session(session), "an idle session kept");
        prop_assert_eq!(self.core.stats().used, 0);
        Ok(())
    }
}

/// One case: run `ops` against a fresh unit (with or without a disk tier)
/// and the model, checking after every op, then wind everything down.
fn run_case(seed: u64, ops: &[Op], disk: bool) -> Result<Coverage, TestCaseError> {
    let mut h = Harness::new(seed, disk)?;
    h.check()?;
    for (i, op) in ops.iter().enumerate() {
        h.apply(op)
            .map_err(|e| TestCaseError::fail(format!("op #{i} {op:?}: {e}")))?;
        h.check().map_err(|e| {
            TestCaseError::fail(format!("after op #{i} {op:?} at {:?}: {e}", h.now))
        })?;
    }
    h.finish()
        .map_err(|e| TestCaseError::fail(format!("finish: {e}")))?;
    Ok(h.cov)
}

/// Cases per test: `PROPTEST_CASES` if set (a soak), else 5000 in an
/// optimised build (about 25 s for both tests on two cores) and 400 in a
/// debug one (CI's; about 30 s on two cores).
fn config() -> ProptestConfig {
    let default = if cfg!(debug_assertions) { 400 } else { 5000 };
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(default),
        // Keep this test a single file: no regression files next to it.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn case_strategy(disk: bool) -> impl Strategy<Value = (u64, Vec<Op>)> {
    (
        any::<u64>(),
        prop::collection::vec(op_strategy(disk), 1..200),
    )
}

/// Session and fencing events every run must reach.
const SESSION_EVENTS: &[&str] = &[
    "session opened",
    "session forgotten",
    "attach refused: connection cap",
    "attach refused: session gone",
    "detach closed",
    "detach cut direct",
    "detach cut stream",
    "closed: holds released",
    "cut direct: holds kept for the session",
    "cut stream: holds released",
    "one-sided connection",
    "closed one-sided: holds kept until fenced",
    "fence: holds wait out the nixl quarantine",
    "nixl quarantine over: holds released",
    "range quarantined",
    "retry after a cut stream reserves afresh",
    "session gone",
    "session gone: holds released",
    "session gone with direct connections open",
    "not owner: alloc of another session's reservation",
    "not owner: commit",
    "not owner: abort",
    "not owner: unpin",
    "not owner: request of an ended connection",
    "busy: retry while the holding connection is open",
    "busy again: a put under way at its first refusal",
    "takeover of a cut connection's reservation",
    "retry on the holding connection",
    "commit from another connection of the session",
    "abort of a cut connection's reservation",
    "unpin of a cut connection's pin",
    "cut client writes its reservation",
    "cut stream writes its quarantined range",
    "pause of minutes",
    "pause of an hour or more",
    "holds outlive a long pause",
    "overdue holds reported",
    "fence checked with an orphaned session",
    "paused writer resumed",
    "paused writer resumed after its connection was cut",
    "paused writer resumed after hours",
    "paused reader read unchanged bytes",
    "paused reader read unchanged bytes after its connection was cut",
    "commit refused: index budget",
    "alloc busy",
    "alloc full",
    "alloc full: views of cleared values hold memory",
];

/// Extents and compaction: events both tests must reach.
const COMPACTION_EVENTS: &[&str] = &[
    "alloc in pieces",
    "value read in parts across pieces",
    "put that fits the free memory with nothing held",
    "put larger than any free range, nothing held: in pieces",
    "move handed out",
    "move gathers a blob in pieces",
    "move reported later",
    "move done: the blob's values follow it",
    "move abandoned: the blob was pinned while it copied",
    "move failed: the blob stays",
    "move: blob freed while it copied",
    "move of a freed blob: both ranges released",
    "move race: the pinned reader's range did not move",
    "move race: the reader let go and the blob moved",
];

/// Disk-tier events the disk test must reach.
const DISK_EVENTS: &[&str] = &[
    "put to disk",
    "commit pending",
    "commit of a durable put",
    "pending put published",
    "put failed",
    "spill",
    "spill written",
    "spill failed",
    "orphaned spill",
    "memory copy dropped",
    "resolve found a value on disk",
    "promoted",
    "promotion in flight",
    "promotion range of a freed blob held",
    "late promotion copy of a freed blob",
    "snapshot with blobs on disk",
    "refused with disk full",
];

fn run(disk: bool) {
    let total = RefCell::new(Coverage::new());
    // The generator does reach every path. A path reached a handful of
    // times per run may miss one run by chance: another run (a fresh seed,
    // every case checked again against the model) must then reach it, at
    // most `ROUNDS` runs in all.
    const ROUNDS: usize = 3;
    let events: Vec<&str> = SESSION_EVENTS
        .iter()
        .chain(COMPACTION_EVENTS)
        .chain(if disk { DISK_EVENTS } else { &[] })
        .copied()
        .collect();
    for round in 1..=ROUNDS {
        let mut runner = TestRunner::new(config());
        if let Err(e) = runner.run(&case_strategy(disk), |(seed, ops)| {
            let cov = run_case(seed, &ops, disk)?;
            let mut total = total.borrow_mut();
            for (k, n) in cov {
                *total.entry(k).or_default() += n;
            }
            Ok(())
        }) {
            panic!("{e}");
        }
        let total = total.borrow();
        eprintln!(
            "events over {round} run(s) ({} disk tier):",
            if disk { "with a" } else { "without" }
        );
        for (k, n) in total.iter() {
            eprintln!("  {n:>8}  {k}");
        }
        let missed: Vec<&str> = events
            .iter()
            .copied()
            .filter(|e| total.get(*e).copied().unwrap_or(0) == 0)
            .collect();
        if missed.is_empty() {
            return;
        }
        assert!(
            round < ROUNDS,
            "no case of {ROUNDS} runs reached {missed:?}: {total:?}"
        );
        eprintln!("not reached yet, another run: {missed:?}");
    }
}

#[test]
fn unit_core_matches_model() {
    run(false);
}

#[test]
fn unit_core_with_disk_matches_model() {
    run(true);
}

/// Regression test: when a blob is freed while a promotion of it is in
/// flight (its reader unpinned, its row cleared meanwhile), the range
/// handed out by `promote_begin` must stay allocated until `promote_done`,
/// or the next alloc gets it and the driver's late copy overwrites the new
/// owner's bytes.
#[test]
fn late_promotion_copy_overwrites_a_reused_range() {
    let t = ms;
    let mut cfg = CoreConfig::new(4096);
    cfg.disk_capacity = 1 << 20;
    cfg.high_watermark = 0.5;
    cfg.low_watermark = 0.25;
    let mut c = UnitCore::new(cfg).unwrap();
    let s = c.open_session();
    let o = c.attach(s, true).unwrap();
    let put = |c: &mut UnitCore, id: u128, row: u64| {
        assert!(matches!(
            c.alloc(o, BlobId(id), 1024, 1, t(0)),
            Ok(Allocated::Reserved { .. })
        ));
        let e = EntrySpec {
            key: Key::new(row, "f"),
            offset: 0,
            len: 1024,
            meta: vec![],
        };
        assert_eq!(c.commit(o, NS, BlobId(id), &[e]), Ok(Committed::Done));
    };
    put(&mut c, 1, 1);
    put(&mut c, 2, 2);
    put(&mut c, 3, 3);
    // Past the high watermark: blob 1 spills, its memory goes.
    let jobs = c.actions().1;
    assert_eq!(jobs[0].blob, BlobId(1));
    for j in &jobs {
        c.disk_written(j.blob, true);
    }
    // A reader finds row 1 on disk (pinned) and the driver starts
    // promoting it.
    let (pin, found) = c.resolve(o, NS, &[Key::new(1, "f")], t(0)).unwrap();
    assert!(matches!(found[0], Some(Placement::Disk { .. })));
    let promoting = c.promote_begin(BlobId(1)).expect("room to promote");
    // Meanwhile row 1 is cleared and the reader unpins.
    c.clear_rows(NS, &[1]);
    c.unpin(o, pin.unwrap()).unwrap();
    assert_eq!(c.actions().0, vec![BlobId(1)]);
    // The copy has not landed yet (no promote_done): its range must not be
    // handed out again.
    let got = c.alloc(o, BlobId(4), 1024, 0, t(1000));
    if let Ok(Allocated::Reserved { pieces }) = got {
        for (offset, len) in pieces {
            assert!(
                offset + len <= promoting || promoting + 1024 <= offset,
                "alloc got {offset}+{len} while the promotion into {promoting}+1024 is still copying"
            );
        }
    }
    assert_eq!(c.held_ranges(), vec![(promoting, 1024)]);
    let held: u64 = c.regions().map(|(_, _, len)| len).sum();
    let st = c.stats();
    assert_eq!(
        st.capacity - st.free_bytes,
        held + 1024,
        "the promoting range is still held"
    );
    c.promote_done(BlobId(1), true);
    assert!(c.regions().all(|(id, _, _)| id != BlobId(1)));
    assert!(c.held_ranges().is_empty());
    let held: u64 = c.regions().map(|(_, _, len)| len).sum();
    let st = c.stats();
    assert_eq!(
        st.capacity - st.free_bytes,
        held,
        "the orphaned range was freed on promote_done"
    );
}

/// Regression test: a put to disk whose write fails is dropped, and its
/// session must hold it no more. The core once left the blob id in the
/// session's reservation set: the session was never forgotten, showed up
/// as orphaned, and when another session later reserved the same blob id,
/// the first session's death released the second one's reservation while
/// its writer was still copying into it.
#[test]
fn a_failed_disk_put_leaves_no_hold_behind() {
    let t = ms;
    let mut cfg = CoreConfig::new(4096);
    cfg.disk_capacity = 1 << 20;
    let mut c = UnitCore::new(cfg).unwrap();
    let sa = c.open_session();
    let a = c.attach(sa, true).unwrap();
    let sb = c.open_session();
    let b = c.attach(sb, true).unwrap();
    // The slab is full: A's put of blob 1 goes to disk, and its write fails.
    assert!(matches!(
        c.alloc(a, BlobId(10), 4096, 0, t(0)),
        Ok(Allocated::Reserved { .. })
    ));
    assert_eq!(c.alloc(a, BlobId(1), 1000, 1, t(0)), Ok(Allocated::ToDisk));
    c.disk_written(BlobId(1), false);
    assert_eq!(c.actions().0, vec![BlobId(1)]);
    assert_eq!(c.abort(a, BlobId(10), false, t(0)), Ok(()));
    let s = c.stats_at(t(0));
    assert_eq!(
        (s.sessions[0].session, s.sessions[0].reservations),
        (sa.0, 0)
    );
    // Session B reserves the same blob id (ids are the clients' choice).
    let Ok(Allocated::Reserved { pieces }) = c.alloc(b, BlobId(1), 100, 1, t(0)) else {
        panic!("B's reservation");
    };
    let offset = pieces[0].0;
    assert_eq!(pieces, vec![(offset, 128)]);
    assert_eq!(c.session_ranges(sa), vec![], "A may touch B's range");
    // A's connection is cut and its process goes: A holds nothing.
    c.detach(a, ConnEnd::Cut, t(0));
    assert!(
        c.orphaned_sessions().is_empty(),
        "a session that holds nothing is not orphaned"
    );
    assert!(
        !c.has_session(sa),
        "a session with nothing left is forgotten"
    );
    c.session_gone(sa, t(0));
    // B's reservation is still B's: its range is held, its commit works.
    assert_eq!(c.session_ranges(sb), vec![(offset, 128)]);
    let e = EntrySpec {
        key: Key::new(0, "f"),
        offset: 0,
        len: 100,
        meta: vec![],
    };
    assert_eq!(c.commit(b, NS, BlobId(1), &[e]), Ok(Committed::Done));
}

/// Regression test: Busy's `reclaimable` counts each range once. A blob
/// whose spill is being written, pinned and then cleared, is both "spilling"
/// and "kept only by pins"; the core once added its range twice.
#[test]
fn busy_counts_a_pinned_cleared_spilling_blob_once() {
    let t = ms;
    let mut cfg = CoreConfig::new(4096);
    cfg.disk_capacity = 2100;
    cfg.high_watermark = 0.5;
    cfg.low_watermark = 0.25;
    let mut c = UnitCore::new(cfg).unwrap();
    let s = c.open_session();
    let o = c.attach(s, true).unwrap();
    for id in 1..=3u64 {
        assert!(matches!(
            c.alloc(o, BlobId(id.into()), 1024, 1, t(0)),
            Ok(Allocated::Reserved { .. })
        ));
        let e = EntrySpec {
            key: Key::new(id, "f"),
            offset: 0,
            len: 1024,
            meta: vec![],
        };
        assert_eq!(
            c.commit(o, NS, BlobId(id.into()), &[e]),
            Ok(Committed::Done)
        );
    }
    let jobs: Vec<BlobId> = c.actions().1.iter().map(|j| j.blob).collect();
    assert_eq!(jobs, vec![BlobId(1), BlobId(2)]);
    // Blob 1 is pinned, then cleared, while its spill is written.
    let (pin, _) = c.resolve(o, NS, &[Key::new(1, "f")], t(0)).unwrap();
    assert!(pin.is_some());
    c.clear_rows(NS, &[1]);
    // No room in the slab (1 KiB free) nor on the disk (52 bytes free):
    // the two spills give back 2 KiB.
    assert_eq!(
        c.alloc(o, BlobId(9), 2000, 1, t(0)),
        Err(CoreError::Busy {
            needed: 2000,
            reclaimable: 2048
        })
    );
}
