//! The unit's request handler past the frame decoder, driven by sequences of
//! steps from three sessions (each up to two connections, Unix (mapped) or
//! tcp): requests through `Request::validate` and `handler::handle` as the
//! connection loop sends them (Put and Read too: the target carries out the
//! handler's plan as the connection does and reports back through
//! `put_landed`, `put_abandoned` and `read_sent`), shm copies by mapped
//! clients into what they were handed, time advances and timeouts,
//! connection ends (closed or cut), reconnects, process exits, disk writes
//! and promotions. Every other input reaches the core as the server's
//! driver sends it, through its one entry point (`UnitCore::handle`), and
//! after each one the target takes every action the core asks for
//! (`poll_action`: files to delete, blobs to spill, processes to watch,
//! compaction moves), as the server's `Shared::drive` does. A move is
//! copied and reported at once, or later (a `Move` step), while sessions
//! go on putting, reading, pinning and clearing.
//!
//! The slab is small and puts are large enough (up to 3/4 of it) that
//! free memory gets cut into holes: puts then take several pieces, values
//! are split across them (`Placement::Split`), and compaction moves blobs.
//!
//! A shadow model keeps what each session was handed and has not released,
//! every committed key's bytes, and a shadow slab and disk files that the
//! simulated clients and driver write into. After every step the target
//! checks (and panics with a message on a violation):
//!
//! 1. the slab ranges of live blobs and held ranges are aligned, inside the
//!    slab and pairwise disjoint, and the stats counters agree with them and
//!    with the shadow (free bytes, largest free range, stored data, reserved
//!    bytes, pins, entries, rows, index bytes, per-session holds,
//!    connections and orphaned holds); an Alloc is refused for want of room
//!    only when its bytes exceed the free memory, however it is cut;
//! 2. fencing: every range a session may touch is a live blob's range of its
//!    own; a range reserved by one session is never one another session may
//!    touch; and everything the shadow says a session still holds is still
//!    the core's allocation for that session;
//! 3. reads: every Resolve or Read returns, for each key, exactly the bytes
//!    and metadata committed last under that key (or nothing when the key
//!    has no value), the bytes a pin holds never change until it is
//!    released, and a checkpoint snapshot lists exactly the shadow's keys
//!    with their bytes — although mapped clients keep scribbling over their
//!    own reservations, also long after they were paused and cut off;
//! 4. ownership: Commit, Abort, Unpin (and Alloc) of another session's
//!    reservation or pin answer the handler's code for the core's NotOwner
//!    and change nothing;
//! 5. the driver is asked what it must do: a session left holding something
//!    with no connection open was handed out to watch
//!    (`Action::CheckProcess`), a spill job reads its blob's pieces, a move
//!    reads a blob no session may touch (no reservation, no pin) and writes
//!    a range no session may touch, and after it reports every committed
//!    value reads back exactly; and a timeout leaves no deadline at or
//!    before now (`poll_timeout`);
//! 6. no panic in the core or the handler for any input.
//!
//! See fuzz/README.md for how to run it.

#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use stowage_core::{
    input as core_input, op as core_op, Action, BlobId, ConnEnd, CoreConfig, CoreError, EntrySpec,
    Input as CoreInput, Key, MoveJob, Owner, PinId, Placed, Placement, Request as CoreRequest,
    SessionId, Snapshot, Stats, Time, UnitCore,
};
use stowage_unit::handler::{self, error_response, scope, Asker, Dest, Plan};
use stowage_wire::{ErrorCode, Limits, Request, Response, PROTOCOL_VERSION};

/// Slab bytes: small, so that Full and Busy happen.
const CAP: u64 = 64 << 10;
/// Disk tier bytes, when the input turns it on.
const DISK: u64 = 96 << 10;
const ALIGN: u64 = 64;
const SLOTS: usize = 3;
/// Connections per session (also the core's cap, so that attach answers Busy).
const MAX_CONNS: usize = 2;
const MAX_STEPS: usize = 256;
const QUARANTINE: Duration = Duration::from_secs(5);
const NAMESPACES: [&str; 2] = ["a", "b"];
const PARTITIONS: [&str; 3] = ["", "p", "q"];
/// `"\0name"`: a hidden bookkeeping field (not counted by ClearRows).
const FIELDS: [&str; 4] = ["a", "b", "\0name", ""];

// ---------------------------------------------------------------------------
// The input.

#[derive(Arbitrary, Debug)]
struct Input {
    disk: bool,
    small_index: bool,
    /// How the driver carries out compaction moves: bit 0, the copy and
    /// report come at once (else at a later `Move` step); bit 1, some
    /// reports say the copy failed; bit 2, compaction waits for the
    /// default scatter (largest free range under half the free bytes).
    move_mode: u8,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// A request from a connection, through validate and the handler.
    Req {
        conn: u8,
        op: Op,
    },
    /// A mapped client copies bytes into one of its reservations (also when
    /// all its connections were cut: its process may still run).
    Scribble {
        slot: u8,
        which: u8,
        partial: bool,
    },
    /// Time passes; with `wake`, every mapped client then finishes all its
    /// copies at once (a paused process resuming).
    Advance {
        dt: Dt,
        wake: bool,
    },
    /// The driver's timer delivers `input::Timeout` (when `poll_timeout`
    /// said, or late, or early).
    Timeout,
    Detach {
        conn: u8,
        cut: bool,
    },
    /// A new connection of the slot's session (a new session if it has none),
    /// saying namespace `namespace` in its Hello.
    Attach {
        slot: u8,
        mapped: bool,
        namespace: u8,
    },
    /// The slot's process is gone (`input::ProcessExited`; with
    /// `close_first`, after its connections closed).
    ProcessExited {
        slot: u8,
        close_first: bool,
    },
    /// A Put, planned by the handler and carried out as the server does.
    Put {
        conn: u8,
        blob: u8,
        partition: u8,
        size: u16,
        entries: Vec<EntryOp>,
        end: PutEnd,
    },
    /// A Read, planned by the handler and carried out as the server does;
    /// `cut`: the reader stalled and
    /// was cut off after the reply.
    Read {
        conn: u8,
        partition: u8,
        keys: Vec<KeyOp>,
        known: Option<u8>,
        cut: bool,
    },
    /// The driver finishes one file write (a spill job the core handed out,
    /// or a put to disk): `input::DiskWritten`.
    Flush {
        which: u8,
        ok: bool,
    },
    /// The driver starts bringing a spilled blob back into the slab (one
    /// with a disk file, picked by `blob`): `input::Promote`.
    Promote {
        blob: u8,
    },
    /// ... and finishes copying into it: `input::Promoted`.
    Promoted {
        which: u8,
        ok: bool,
    },
    /// A checkpoint's snapshot, checked against the shadow, then unpinned.
    Checkpoint,
    /// The driver finishes the compaction move under way (copies the
    /// blob's bytes, reports `input::Moved`).
    Move {
        ok: bool,
    },
    /// Churn that cuts the free memory into holes: `count` puts of `size`
    /// (each one value on its own row), then every other row cleared.
    Churn {
        conn: u8,
        partition: u8,
        count: u8,
        size: u16,
    },
}

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        blob: u8,
        size: u16,
        n_entries: u8,
    },
    /// `fit`: entry count and ranges fitted to what the session reserved.
    Commit {
        blob: u8,
        partition: u8,
        entries: Vec<EntryOp>,
        fit: bool,
    },
    Abort {
        blob: u8,
        in_flight: bool,
    },
    /// `known`: the partition and keys are picked among committed ones.
    Resolve {
        partition: u8,
        keys: Vec<KeyOp>,
        hold: bool,
        known: Option<u8>,
    },
    Unpin {
        pin: u8,
        reply: bool,
    },
    ClearRows {
        partition: u8,
        rows: Vec<u8>,
    },
    List {
        partition: u8,
    },
    ClearPartition {
        partition: u8,
    },
    ListPartitions,
    Stats,
    Hello,
    Shutdown,
    /// Open (or, `close`, close restore `id`) a restore unit: the
    /// connection's business, nothing of the core's.
    Restore {
        close: bool,
        id: u8,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct EntryOp {
    row: u8,
    field: u8,
    off: u8,
    len: u8,
    meta: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct KeyOp {
    row: u8,
    field: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Dt {
    Zero,
    Millis(u8),
    Secs(u8),
    Quarantine,
    Hours(u8),
}

#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
enum PutEnd {
    Complete,
    /// The payload stalled past its deadline: cut, range quarantined.
    Cut,
    /// The peer closed mid-payload.
    Closed,
}

fn size(x: u16) -> u64 {
    match x % 16 {
        // Large: up to 3/4 of the slab, often more than its largest hole.
        12 | 13 => u64::from(x >> 4) * 12,
        14 => 0,
        15 => match (x >> 4) % 4 {
            0 => CAP,
            1 => CAP + 1,
            2 => u64::MAX,
            _ => 1 << 40,
        },
        _ => u64::from(x >> 4) * 5, // up to ~20 KiB
    }
}

fn rounded(n: u64) -> u64 {
    n.div_ceil(ALIGN).max(1).saturating_mul(ALIGN)
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
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

fn blob_id(x: u8) -> BlobId {
    BlobId(u128::from(x % 16))
}

fn partition(x: u8) -> String {
    if x == 255 {
        "x\u{1f}y".into() // refused by validate
    } else {
        PARTITIONS[x as usize % PARTITIONS.len()].into()
    }
}

fn field(x: u8) -> String {
    if x == 255 {
        "f".repeat(1025) // refused by validate
    } else {
        FIELDS[x as usize % FIELDS.len()].into()
    }
}

fn row(x: u8) -> u64 {
    if x == 255 {
        u64::MAX
    } else {
        u64::from(x % 8)
    }
}

fn key(k: KeyOp) -> Key {
    Key::new(row(k.row), field(k.field))
}

/// An entry; with `n`, its range scaled into a blob of `n` bytes.
fn entry(e: EntryOp, n: Option<u64>) -> EntrySpec {
    let (offset, len) = match n {
        Some(n) if n < u64::MAX / 256 => {
            let offset = n * u64::from(e.off) / 255;
            (offset, (n * u64::from(e.len) / 255).min(n - offset))
        }
        _ => (u64::from(e.off), u64::from(e.len)),
    };
    EntrySpec {
        key: Key::new(row(e.row), field(e.field)),
        offset,
        len,
        meta: vec![e.meta; (e.meta % 4) as usize],
    }
}

fn entries(ops: &[EntryOp], n: Option<u64>, count: Option<u32>) -> Vec<EntrySpec> {
    let mut v: Vec<EntrySpec> = ops.iter().map(|e| entry(*e, n)).collect();
    if let Some(c) = count {
        let c = c as usize;
        v.truncate(c);
        let mut i = 0u8;
        while v.len() < c {
            let base = ops
                .get(i as usize % ops.len().max(1))
                .copied()
                .unwrap_or(EntryOp {
                    row: i,
                    field: 0,
                    off: 0,
                    len: 255,
                    meta: 0,
                });
            v.push(entry(
                EntryOp {
                    row: base.row.wrapping_add(i),
                    ..base
                },
                n,
            ));
            i = i.wrapping_add(1);
        }
    }
    v
}

// ---------------------------------------------------------------------------
// The shadow.

#[derive(Clone, Copy, Debug)]
struct Conn {
    owner: Owner,
    /// The namespace its Hello said (every partition it names lies in it).
    namespace: &'static str,
}

#[derive(Debug, Default)]
struct Slot {
    /// The session of this client process, while the core may know it.
    session: Option<SessionId>,
    /// Its connections are Unix-socket ones: the process maps the slab.
    /// (The server only joins a connection to a session of the same peer
    /// pid, so a session's connections are all mapped or all tcp.)
    mapped: bool,
    conns: Vec<Conn>,
}

/// A reservation handed to a session.
#[derive(Clone, Debug)]
struct Res {
    session: SessionId,
    /// The connection holding it; `None` once the unit cut it.
    conn: Option<stowage_core::ConnId>,
    nbytes: u64,
    n_entries: u32,
    /// (slab offset, bytes) of each piece, in order; `None`: reserved on
    /// disk.
    at: Option<Vec<(u64, u64)>>,
}

/// A pin handed to a session, with the bytes it read.
#[derive(Clone, Debug)]
struct PinRec {
    session: SessionId,
    conn: Option<stowage_core::ConnId>,
    reads: Vec<(Placement, Vec<u8>)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Val {
    bytes: Vec<u8>,
    meta: Vec<u8>,
}

#[derive(Clone, Debug)]
enum FlushJob {
    Spill {
        blob: BlobId,
        pieces: Vec<(u64, u64)>,
        nbytes: u64,
    },
    Put {
        blob: BlobId,
    },
}

type Index = BTreeMap<String, BTreeMap<u64, BTreeMap<String, Val>>>;

struct H {
    core: UnitCore,
    disk: bool,
    now: Time,
    slab: Vec<u8>,
    files: BTreeMap<BlobId, Vec<u8>>,
    slots: [Slot; SLOTS],
    res: BTreeMap<BlobId, Res>,
    pins: BTreeMap<PinId, PinRec>,
    seen_pins: Vec<PinId>,
    keys: Index,
    /// Blobs whose commit answered Pending: published when their file is.
    pending: BTreeMap<BlobId, (String, Vec<EntrySpec>)>,
    /// File writes under way: spill jobs the core handed out, puts to disk.
    flushes: Vec<FlushJob>,
    promos: Vec<(BlobId, u64, Vec<u8>)>,
    /// The compaction move handed out and not yet reported (one at a time).
    moving: Option<MoveJob>,
    move_mode: u8,
    /// Free slab bytes just before the request being handled.
    free_before: u64,
    /// A move reported: every value is read back after the step.
    verify_values: bool,
    /// Sessions whose process the core asked to watch
    /// (`Action::CheckProcess`) and that still hold something with no
    /// connection open (the server's timer forgets the others).
    watched: BTreeSet<SessionId>,
    writes: u64,
    /// Event counts, printed per input when `RH_STATS` is set (to see what
    /// a corpus reaches: `request_handler corpus/request_handler -runs=0`).
    seen: BTreeMap<&'static str, u64>,
    disk_reads: std::cell::Cell<u64>,
    /// Values read across pieces (`Placement::Split`).
    split_reads: std::cell::Cell<u64>,
}

fn code(r: &Response) -> Option<ErrorCode> {
    match r {
        Response::Error { code, .. } => Some(*code),
        _ => None,
    }
}

/// The code the handler answers when the core refuses a request of
/// another session's reservation or pin (`CoreError::NotOwner`).
fn not_owner() -> ErrorCode {
    code(&error_response(&CoreError::NotOwner(String::new())))
        .expect("a core refusal is an error response")
}

impl H {
    fn new(input: &Input) -> Self {
        let mut cfg = CoreConfig::new(CAP);
        cfg.max_session_conns = MAX_CONNS;
        cfg.quarantine = QUARANTINE;
        if input.disk {
            cfg.disk_capacity = DISK;
            cfg.high_watermark = 0.5;
            cfg.low_watermark = 0.25;
        }
        if input.small_index {
            cfg.index_budget = 2048;
        }
        // Compaction runs in this small slab (its default threshold is
        // 64 KiB free), mostly as soon as any hole cuts the free memory (so
        // that short runs reach it), sometimes at the default ratio.
        cfg.compact_min_free = 1024;
        if input.move_mode & 4 == 0 {
            cfg.compact_below = 0.95;
        }
        let core = UnitCore::new(cfg).expect("valid config");
        let mut h = H {
            core,
            disk: input.disk,
            now: Duration::ZERO,
            slab: vec![0u8; CAP as usize],
            files: BTreeMap::new(),
            slots: Default::default(),
            res: BTreeMap::new(),
            pins: BTreeMap::new(),
            seen_pins: Vec::new(),
            keys: BTreeMap::new(),
            pending: BTreeMap::new(),
            flushes: Vec::new(),
            promos: Vec::new(),
            moving: None,
            move_mode: input.move_mode,
            free_before: 0,
            verify_values: false,
            watched: BTreeSet::new(),
            writes: 0,
            seen: BTreeMap::new(),
            disk_reads: Default::default(),
            split_reads: Default::default(),
        };
        // Two mapped clients and a tcp one, connected.
        for (i, mapped) in [true, true, false].into_iter().enumerate() {
            h.attach(i, mapped, i as u8);
        }
        h
    }

    fn note(&mut self, what: &'static str) {
        *self.seen.entry(what).or_default() += 1;
    }

    // -- driving the core ---------------------------------------------------

    /// One input through the core's one entry point, then what it asks of
    /// the driver ([`H::drive`]).
    fn input<I: CoreInput>(&mut self, input: I) -> Result<I::Answer, CoreError> {
        let r = self.core.handle(self.now, input);
        self.drive();
        r
    }

    /// An input answered with the holds it released.
    fn released<I: CoreInput<Answer = u64>>(&mut self, input: I) -> u64 {
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
    fn drive(&mut self) {
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
    fn finish_move(&mut self, ok: bool) {
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
    fn verify_all_values(&mut self) {
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
                keys: keys.clone(),
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
    fn pieces_bytes(&self, pieces: &[(u64, u64)], offset: u64, len: u64) -> Vec<u8> {
        locate(pieces, offset, len)
            .into_iter()
            .flat_map(|(o, l)| self.slab[o as usize..(o + l) as usize].iter().copied())
            .collect()
    }

    /// A writer writes fresh bytes over the first `len` bytes of `pieces`.
    fn write_pieces(&mut self, pieces: &[(u64, u64)], len: u64) {
        for (o, l) in locate(pieces, 0, len) {
            self.write_slab(o, l);
        }
    }

    /// A connection by selector: slot `x % 3`, then one of its connections.
    fn conn(&self, x: u8) -> Option<(usize, usize)> {
        let slot = x as usize % SLOTS;
        let n = self.slots[slot].conns.len();
        (n > 0).then(|| (slot, (x as usize / SLOTS) % n))
    }

    /// Bytes a writer puts somewhere: different for every write.
    fn pattern(&mut self, len: usize) -> Vec<u8> {
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

    fn read_place(&self, place: &Placement) -> Vec<u8> {
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

    // -- sessions and connections ------------------------------------------

    fn attach(&mut self, slot: usize, mapped: bool, namespace: u8) {
        let namespace = NAMESPACES[namespace as usize % NAMESPACES.len()];
        let s = match self.slots[slot].session {
            Some(s) => s,
            None => {
                let s = match self.input(core_input::OpenSession) {
                    Ok(s) => s,
                    other => panic!("OpenSession answered {other:?}"),
                };
                self.slots[slot].session = Some(s);
                self.slots[slot].mapped = mapped;
                s
            }
        };
        let mapped = self.slots[slot].mapped;
        let full = self.slots[slot].conns.len() >= MAX_CONNS;
        match self.input(core_input::Attach { session: s, mapped }) {
            Ok(owner) => {
                assert!(!full, "attach past the session's connection cap succeeded");
                assert_eq!(owner.session, s);
                self.slots[slot].conns.push(Conn { owner, namespace });
            }
            Err(CoreError::Busy { .. }) => {
                assert!(
                    full,
                    "attach refused with {} connections",
                    self.slots[slot].conns.len()
                )
            }
            Err(e) => panic!("attach to live session {s:?} failed: {e}"),
        }
    }

    /// A connection ends; mirror what the core releases.
    fn detach(&mut self, slot: usize, i: usize, end: ConnEnd) {
        let c = self.slots[slot].conns.remove(i);
        let mapped = self.slots[slot].mapped;
        let keep = end == ConnEnd::Cut && mapped;
        let mine = |s: SessionId, conn: Option<stowage_core::ConnId>| {
            s == c.owner.session && conn == Some(c.owner.conn)
        };
        let held = self
            .res
            .values()
            .filter(|r| mine(r.session, r.conn))
            .count()
            + self
                .pins
                .values()
                .filter(|p| mine(p.session, p.conn))
                .count();
        let n = self.released(core_input::ConnEnded {
            owner: c.owner,
            end,
        });
        assert_eq!(
            n,
            if keep { 0 } else { held as u64 },
            "holds released by the {end:?} end of {:?}",
            c.owner
        );
        self.note(match (end, mapped) {
            (ConnEnd::Cut, true) => "detach_cut_mapped",
            (ConnEnd::Cut, false) => "detach_cut_tcp",
            _ => "detach_closed",
        });
        if keep {
            for r in self.res.values_mut().filter(|r| mine(r.session, r.conn)) {
                r.conn = None;
            }
            for p in self.pins.values_mut().filter(|p| mine(p.session, p.conn)) {
                p.conn = None;
            }
        } else {
            self.res.retain(|_, r| !mine(r.session, r.conn));
            self.pins.retain(|_, p| !mine(p.session, p.conn));
        }
        self.forget_if_gone(slot);
    }

    fn holds(&self, s: SessionId) -> bool {
        self.res.values().any(|r| r.session == s) || self.pins.values().any(|p| p.session == s)
    }

    /// The core forgets a session with no connection and no hold: so does
    /// the server's session table (a later Hello starts a new one).
    fn forget_if_gone(&mut self, slot: usize) {
        if let Some(s) = self.slots[slot].session {
            if self.slots[slot].conns.is_empty() && !self.holds(s) {
                assert!(
                    !self.core.has_session(s),
                    "session {s:?} with no connection and no hold is still known"
                );
                self.slots[slot].session = None;
            }
        }
    }

    /// The slot's process exits. The server reports it for a watched
    /// session (no connection open, something held); the core takes it
    /// in any state.
    fn process_exited(&mut self, slot: usize, close_first: bool) {
        let Some(s) = self.slots[slot].session else {
            return;
        };
        if close_first {
            while !self.slots[slot].conns.is_empty() {
                self.detach(slot, 0, ConnEnd::Closed);
            }
            // Nothing held: the core forgot it with its last connection.
            let Some(s) = self.slots[slot].session else {
                return;
            };
            assert!(
                self.watched.contains(&s),
                "{s:?} holds something with no connection, unwatched"
            );
        }
        self.note(if self.watched.contains(&s) {
            "process_exited_watched"
        } else {
            "process_exited"
        });
        let held = self.res.values().filter(|r| r.session == s).count()
            + self.pins.values().filter(|p| p.session == s).count();
        let n = self.released(core_input::ProcessExited(s));
        assert_eq!(n, held as u64, "holds released by the exit of {s:?}");
        self.res.retain(|_, r| r.session != s);
        self.pins.retain(|_, p| p.session != s);
        // Its sockets close too.
        for c in std::mem::take(&mut self.slots[slot].conns) {
            let n = self.released(core_input::ConnEnded {
                owner: c.owner,
                end: ConnEnd::Closed,
            });
            assert_eq!(n, 0, "a connection of exited {s:?} released holds");
        }
        assert!(
            !self.core.has_session(s),
            "session {s:?} outlived its process's exit"
        );
        assert!(
            !self.watched.contains(&s),
            "{s:?} still watched after its exit"
        );
        self.slots[slot].session = None;
    }

    /// A mapped client copies into its `which`-th reservation in the slab.
    fn scribble(&mut self, slot: usize, which: usize, partial: bool) {
        let Some(s) = self.slots[slot].session.filter(|_| self.slots[slot].mapped) else {
            return;
        };
        let mine: Vec<(Vec<(u64, u64)>, u64)> = self
            .res
            .values()
            .filter(|r| r.session == s)
            .filter_map(|r| Some((r.at.clone()?, r.nbytes)))
            .collect();
        if mine.is_empty() {
            return;
        }
        let (pieces, n) = &mine[which % mine.len()];
        self.write_pieces(pieces, if partial { n / 2 } else { *n });
        self.note("scribble");
        if self.slots[slot].conns.is_empty() {
            self.note("scribble_by_cut_session");
        }
    }

    // -- requests ----------------------------------------------------------

    fn request(&mut self, x: u8, op: Op) {
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
    fn lookup(
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
    fn send(&mut self, slot: usize, i: usize, req: Request, read_cut: bool) {
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
            | Plan::Checkpoint { .. }
            | Plan::OpenRestore { .. }
            | Plan::CloseRestore { .. } => return,
            // A connection's own ring: nothing of the core's.
            Plan::OpenRing { .. } | Plan::RingKick => return,
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

    fn allocated(&mut self, o: Owner, blob: BlobId, nbytes: u64, n_entries: u32, r: &Response) {
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

    fn committed(&mut self, o: Owner, sc: &str, blob: BlobId, entries: &[EntrySpec], r: &Response) {
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

    fn aborted(&mut self, o: Owner, blob: BlobId, r: &Response) {
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

    fn publish(&mut self, sc: &str, entries: &[EntrySpec], src: &[u8]) {
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
    fn clear(&mut self, sc: &str, rows: Option<Vec<u64>>) -> u64 {
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
    fn check_found(
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
                    assert_eq!(meta, &v.meta, "{sc:?} {k}: metadata");
                    reads.push((place.clone(), got));
                }
            }
        }
        reads
    }

    fn resolved(
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
    fn read(
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

    /// A Put as the server carries out the handler's plan: `handle`
    /// reserves, the payload goes into the slab (or the blob's file), then
    /// `handler::put_landed` commits; a payload that stops midway goes to
    /// `handler::put_abandoned` and ends the connection.
    fn put(&mut self, x: u8, blob: u8, p: u8, sz: u16, ops: &[EntryOp], end: PutEnd) {
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

    // -- the driver's disk work --------------------------------------------

    /// A file write finishes: `input::DiskWritten`, never refused.
    fn disk_written(&mut self, blob: BlobId, ok: bool) {
        match self.input(core_input::DiskWritten { blob, ok }) {
            Ok(()) => {}
            other => panic!("DiskWritten of {blob:?} answered {other:?}"),
        }
    }

    fn flush(&mut self, which: usize, ok: bool) {
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

    fn promote(&mut self, blob: u8) {
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

    fn promoted(&mut self, which: usize, ok: bool) {
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
    fn checkpoint(&mut self) {
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

    // -- invariants --------------------------------------------------------

    fn check(&self) {
        let st: Stats = self.core.stats_at(self.now);
        let cap = self.core.capacity();
        assert_eq!(st.capacity, cap);

        // 1. Disjoint, aligned ranges inside the slab; what is not free is
        //    their sum.
        let regions: Vec<(BlobId, u64, u64)> = self.core.regions().collect();
        let held = self.core.held_ranges();
        let mut all: Vec<(u64, u64)> = regions
            .iter()
            .map(|(_, o, l)| (*o, *l))
            .chain(held.iter().copied())
            .collect();
        all.sort_unstable();
        let mut end = 0u64;
        let mut sum = 0u64;
        for &(off, len) in &all {
            assert!(
                len > 0 && off % ALIGN == 0 && len % ALIGN == 0,
                "range {off}+{len}"
            );
            assert!(
                off.checked_add(len).is_some_and(|e| e <= cap),
                "range {off}+{len} outside the slab"
            );
            assert!(
                off >= end,
                "ranges overlap at {off} (previous ends at {end}): {all:?}"
            );
            end = off + len;
            sum += len;
        }
        assert_eq!(
            st.capacity - st.free_bytes,
            sum,
            "allocated bytes vs the sum of live and held ranges"
        );
        // The free ranges: the gaps, cut at the spare zone's start.
        let split = cap - st.spare_budget;
        let mut largest = 0u64;
        let mut at = 0u64;
        for &(off, len) in all.iter().chain(std::iter::once(&(cap, 0))) {
            if off > at {
                let gap = if at < split && off > split {
                    (split - at).max(off - split)
                } else {
                    off - at
                };
                largest = largest.max(gap);
            }
            at = at.max(off + len);
        }
        assert_eq!(st.largest_free, largest, "the largest free range");
        // `used` is stored data: the live ranges that are neither
        // reservations nor a promotion's or a move's target.
        let targets: u64 = regions
            .iter()
            .filter(|(b, o, l)| {
                self.core.move_under_way() == Some((*b, *o))
                    || self.promos.iter().any(|(pb, po, bytes)| {
                        pb == b && po == o && rounded(bytes.len() as u64) == *l
                    })
            })
            .map(|r| r.2)
            .sum();
        let live: u64 = regions.iter().map(|r| r.2).sum();
        assert_eq!(
            st.used,
            live - st.reserved_bytes - targets,
            "used vs the stored blobs' ranges"
        );
        let quarantine_ok = st.quarantined_bytes <= held.iter().map(|r| r.1).sum::<u64>();
        assert!(quarantine_ok, "quarantined bytes exceed the held ranges");
        let reserved: u64 = self
            .res
            .values()
            .filter(|r| r.at.is_some())
            .map(|r| rounded(r.nbytes))
            .sum();
        assert_eq!(
            st.reserved_bytes, reserved,
            "reserved bytes vs the reservations handed out"
        );
        assert_eq!(
            st.pins,
            self.pins.len() as u64,
            "pins vs the pins handed out"
        );
        let entries: u64 = self
            .keys
            .values()
            .flat_map(|r| r.values())
            .map(|f| f.len() as u64)
            .sum();
        let rows: u64 = self.keys.values().map(|r| r.len() as u64).sum();
        let index: u64 = self
            .keys
            .values()
            .flat_map(|r| r.values())
            .flat_map(|f| f.iter())
            // The core's ENTRY_OVERHEAD (96) per entry, plus name and metadata.
            .map(|(name, v)| 96 + name.len() as u64 + v.meta.len() as u64)
            .sum();
        assert_eq!(
            (st.entries, st.rows, st.index_bytes),
            (entries, rows, index),
            "entries, rows, index bytes"
        );

        // Each shadow reservation in the slab is still its blob's range.
        for (b, r) in &self.res {
            if let Some(pieces) = &r.at {
                assert_eq!(
                    self.core.blob_pieces(*b).as_ref(),
                    Some(pieces),
                    "{b:?}, reserved by {:?} in {pieces:?}, is no longer its allocation",
                    r.session
                );
            }
        }

        // 2. Sessions: what the core says each holds, and fencing.
        let mut orphaned = Vec::new();
        let mut live_ranges = Vec::new();
        for slot in &self.slots {
            let Some(s) = slot.session else { continue };
            let my_res: Vec<&Res> = self.res.values().filter(|r| r.session == s).collect();
            let my_pins: Vec<&PinRec> = self.pins.values().filter(|p| p.session == s).collect();
            let holds = !my_res.is_empty() || !my_pins.is_empty();
            assert!(
                self.core.has_session(s),
                "session {s:?} ({} conns, holds: {holds}) forgotten",
                slot.conns.len()
            );
            if slot.conns.is_empty() && holds {
                orphaned.push(s);
            }
            let ss = st
                .sessions
                .iter()
                .find(|x| x.session == s.0)
                .unwrap_or_else(|| panic!("session {s:?} missing from stats"));
            let o = my_res.iter().filter(|r| r.conn.is_none()).count()
                + my_pins.iter().filter(|p| p.conn.is_none()).count();
            assert_eq!(
                (
                    ss.connections as usize,
                    ss.reservations as usize,
                    ss.pins as usize,
                    ss.orphaned as usize
                ),
                (slot.conns.len(), my_res.len(), my_pins.len(), o),
                "session {s:?}: (connections, reservations, pins, orphaned holds)"
            );
            let ranges = self.core.session_ranges(s);
            for &(off, len) in &ranges {
                assert!(
                    regions.iter().any(|&(_, o, l)| o == off && l == len),
                    "session {s:?} may touch {off}+{len}, which is no live blob's range"
                );
            }
            let covered = |off: u64, len: u64| {
                len == 0 || ranges.iter().any(|&(o, l)| o <= off && off + len <= o + l)
            };
            for r in &my_res {
                for &(off, len) in r.at.iter().flatten() {
                    assert!(
                        covered(off, len),
                        "session {s:?}'s reservation at {off}+{len} not held for it"
                    );
                }
            }
            for p in &my_pins {
                for (place, _) in &p.reads {
                    let parts = match place {
                        Placement::Memory(l) => vec![*l],
                        Placement::Split(parts) => parts.clone(),
                        Placement::Disk { .. } => Vec::new(),
                    };
                    for l in parts {
                        assert!(
                            covered(l.offset, l.len),
                            "session {s:?}'s pinned {l:?} not held for it"
                        );
                    }
                }
            }
            live_ranges.push((s, ranges));
        }
        for (b, r) in &self.res {
            for &(off, len) in r.at.iter().flatten() {
                for (t, ranges) in &live_ranges {
                    if *t == r.session {
                        continue;
                    }
                    for &(o, l) in ranges {
                        assert!(
                            o + l <= off || off + len <= o,
                            "{b:?} reserved by {:?} at {off}+{len} overlaps {o}+{l} that {t:?} may touch",
                            r.session
                        );
                    }
                }
            }
        }
        let mut core_orphans = self.core.orphaned_sessions();
        core_orphans.sort_unstable();
        orphaned.sort_unstable();
        assert_eq!(core_orphans, orphaned, "orphaned sessions");
        // The driver was asked to watch each one's process.
        let watched: Vec<SessionId> = self.watched.iter().copied().collect();
        assert_eq!(watched, orphaned, "sessions whose process is watched");

        // The core needs waking exactly while a range is quarantined (no
        // peer here is one-sided, so no fenced hold waits).
        assert_eq!(
            self.core.poll_timeout().is_some(),
            st.quarantined_bytes > 0,
            "poll_timeout {:?} with {} bytes quarantined",
            self.core.poll_timeout(),
            st.quarantined_bytes
        );

        // 3. Pinned bytes never change until unpinned.
        for (id, p) in &self.pins {
            for (place, bytes) in &p.reads {
                assert!(
                    &self.read_place(place) == bytes,
                    "bytes at {place:?} pinned by {id:?} of {:?} changed",
                    p.session
                );
            }
        }
    }

    fn run(&mut self, step: Step) {
        match step {
            Step::Req { conn, op } => self.request(conn, op),
            Step::Scribble {
                slot,
                which,
                partial,
            } => self.scribble(slot as usize % SLOTS, which as usize, partial),
            Step::Advance { dt, wake } => {
                self.now += match dt {
                    Dt::Zero => Duration::ZERO,
                    Dt::Millis(m) => Duration::from_millis(u64::from(m)),
                    Dt::Secs(s) => Duration::from_secs(u64::from(s)),
                    Dt::Quarantine => QUARANTINE,
                    Dt::Hours(h) => Duration::from_secs(3600 * u64::from(h % 8 + 1)),
                };
                if wake {
                    for slot in 0..SLOTS {
                        let n = self.slots[slot]
                            .session
                            .map_or(0, |s| self.res.values().filter(|r| r.session == s).count());
                        for which in 0..n {
                            self.scribble(slot, which, false);
                        }
                    }
                }
            }
            Step::Timeout => {
                if self.core.stats().quarantined_bytes > 0 {
                    self.note("timeout_with_quarantine");
                }
                if self.core.poll_timeout().is_some_and(|t| t <= self.now) {
                    self.note("timeout_due");
                }
                let n = self.released(core_input::Timeout);
                assert_eq!(n, 0, "a timeout released holds, with no one-sided peer");
                let next = self.core.poll_timeout();
                assert!(
                    next.is_none_or(|t| t > self.now),
                    "after a timeout at {:?} the core wants one at {next:?}",
                    self.now
                );
            }
            Step::Detach { conn, cut } => {
                if let Some((slot, i)) = self.conn(conn) {
                    self.detach(slot, i, if cut { ConnEnd::Cut } else { ConnEnd::Closed });
                }
            }
            Step::Attach {
                slot,
                mapped,
                namespace,
            } => self.attach(slot as usize % SLOTS, mapped, namespace),
            Step::ProcessExited { slot, close_first } => {
                self.process_exited(slot as usize % SLOTS, close_first)
            }
            Step::Put {
                conn,
                blob,
                partition,
                size,
                entries,
                end,
            } => self.put(conn, blob, partition, size, &entries, end),
            Step::Read {
                conn,
                partition: p,
                keys,
                known,
                cut,
            } => {
                if let Some((slot, i)) = self.conn(conn) {
                    let namespace = self.slots[slot].conns[i].namespace;
                    let (partition, keys) = self.lookup(namespace, p, &keys, known);
                    let req = Request::Read {
                        partition,
                        keys,
                        timeout_ms: 1000,
                    };
                    self.send(slot, i, req, cut);
                }
            }
            Step::Flush { which, ok } => self.flush(which as usize, ok),
            Step::Promote { blob } => self.promote(blob),
            Step::Promoted { which, ok } => self.promoted(which as usize, ok),
            Step::Checkpoint => self.checkpoint(),
            Step::Churn {
                conn,
                partition,
                count,
                size,
            } => {
                let n = count % 8 + 2;
                for i in 0..n {
                    let e = EntryOp {
                        row: i,
                        field: 0,
                        off: 0,
                        len: 255,
                        meta: i,
                    };
                    let blob = count.wrapping_add(i);
                    self.put(conn, blob, partition, size, &[e], PutEnd::Complete);
                    if std::mem::take(&mut self.verify_values) {
                        self.verify_all_values();
                    }
                    self.check();
                }
                self.note("churn");
                let rows: Vec<u8> = (0..n).step_by(2).collect();
                self.request(conn, Op::ClearRows { partition, rows });
            }
            Step::Move { ok } => {
                if self.moving.is_some() {
                    self.note("move_later");
                }
                self.finish_move(ok);
                self.drive();
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let mut h = H::new(&input);
    h.check();
    for step in input.steps.into_iter().take(MAX_STEPS) {
        h.run(step);
        if std::mem::take(&mut h.verify_values) {
            h.verify_all_values();
        }
        h.check();
        if h.core.stats().quarantined_bytes > 0 {
            h.note("steps_with_quarantine");
        }
        if h.slots
            .iter()
            .any(|s| s.session.is_some() && s.conns.is_empty())
        {
            h.note("steps_with_orphaned_session");
        }
    }
    h.checkpoint();
    h.check();
    static STATS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *STATS.get_or_init(|| std::env::var_os("RH_STATS").is_some()) {
        let d = h.disk_reads.get();
        if d > 0 {
            h.seen.insert("found_on_disk", d);
        }
        let d = h.split_reads.get();
        if d > 0 {
            h.seen.insert("found_split", d);
        }
        let line: Vec<String> = h.seen.iter().map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("RH {}", line.join(" "));
    }
});
