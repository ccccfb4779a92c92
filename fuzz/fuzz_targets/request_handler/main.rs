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

// The harness by concern; `H` (the shadow) and the step dispatch are here.
mod check; // the invariants checked after every step
mod disk; // the driver's file writes, spills, promotions, checkpoint
mod drive; // inputs into the core, the actions it asks for, moves, the shadow slab
mod input; // the fuzz input and how its bytes map to sizes, keys, entries
mod replies; // what a reply changes in the shadow; Resolve and Read checks
mod requests; // an Op through validate and the handler; Put as the server does it
mod sessions; // attach, detach, process exits, scribbles

use input::*;

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
