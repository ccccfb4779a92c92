//! The input: the steps a fuzz input decodes to, and how their bytes map
//! to sizes, keys, partitions and entries.

use super::*;

#[derive(Arbitrary, Debug)]
pub(crate) struct Input {
    pub(crate) disk: bool,
    pub(crate) small_index: bool,
    /// How the driver carries out compaction moves: bit 0, the copy and
    /// report come at once (else at a later `Move` step); bit 1, some
    /// reports say the copy failed; bit 2, compaction waits for the
    /// default scatter (largest free range under half the free bytes).
    pub(crate) move_mode: u8,
    pub(crate) steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
pub(crate) enum Step {
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
pub(crate) enum Op {
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
pub(crate) struct EntryOp {
    pub(crate) row: u8,
    pub(crate) field: u8,
    pub(crate) off: u8,
    pub(crate) len: u8,
    pub(crate) meta: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub(crate) struct KeyOp {
    pub(crate) row: u8,
    pub(crate) field: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub(crate) enum Dt {
    Zero,
    Millis(u8),
    Secs(u8),
    Quarantine,
    Hours(u8),
}

#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutEnd {
    Complete,
    /// The payload stalled past its deadline: cut, range quarantined.
    Cut,
    /// The peer closed mid-payload.
    Closed,
}

pub(crate) fn size(x: u16) -> u64 {
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

pub(crate) fn blob_id(x: u8) -> BlobId {
    BlobId(u128::from(x % 16))
}

pub(crate) fn partition(x: u8) -> String {
    if x == 255 {
        "x\u{1f}y".into() // refused by validate
    } else {
        PARTITIONS[x as usize % PARTITIONS.len()].into()
    }
}

pub(crate) fn field(x: u8) -> String {
    if x == 255 {
        "f".repeat(1025) // refused by validate
    } else {
        FIELDS[x as usize % FIELDS.len()].into()
    }
}

pub(crate) fn row(x: u8) -> u64 {
    if x == 255 {
        u64::MAX
    } else {
        u64::from(x % 8)
    }
}

pub(crate) fn key(k: KeyOp) -> Key {
    Key::new(row(k.row), field(k.field))
}

/// An entry; with `n`, its range scaled into a blob of `n` bytes.
pub(crate) fn entry(e: EntryOp, n: Option<u64>) -> EntrySpec {
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

pub(crate) fn entries(ops: &[EntryOp], n: Option<u64>, count: Option<u32>) -> Vec<EntrySpec> {
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
