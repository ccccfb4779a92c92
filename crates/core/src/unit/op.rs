//! A connection's requests, one type each, sent in a [`Request`](crate::Request) and
//! answered with [`Op::Answer`].

use super::input::Op;
use super::*;

/// An op type: its fields, its answer, and how the core applies it for
/// the connection that asks.
macro_rules! op {
    ($(#[$doc:meta])* $ty:ident {$($f:tt)*} => $answer:ty, $apply:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $ty {$($f)*}
        impl Op for $ty {
            type Answer = $answer;
            fn apply(
                self,
                core: &mut UnitCore,
                now: Time,
                owner: Owner,
                _: super::input::sealed::Token,
            ) -> Result<$answer, CoreError> {
                let apply: fn($ty, &mut UnitCore, Time, Owner) -> Result<$answer, CoreError> =
                    $apply;
                apply(self, core, now, owner)
            }
        }
    };
}

op! {
    /// Reserve `nbytes` for `blob`, held by the connection until it commits
    /// or aborts, or its connection ends. A retry answers the same; a blob
    /// committed since answers [`Allocated::AlreadyCommitted`]. When the
    /// slab has no room and the disk tier has, the blob is reserved on disk
    /// ([`Allocated::ToDisk`]): its bytes must come with the request
    /// ([`CommitWritten`]).
    Alloc { pub blob: BlobId, pub nbytes: u64, pub n_entries: u32 } => Allocated,
    |Alloc { blob, nbytes, n_entries }, core, now, owner| {
        core.alloc(owner, blob, nbytes, n_entries, now)
    }
}
op! {
    /// Reserve a spare: `nbytes` of slab memory for a put whose size and
    /// entries are not known yet. Answers its offset, or `None` when the
    /// slab has no room now — a spare is an offer, never an error for want
    /// of room.
    ReserveSpare { pub blob: BlobId, pub nbytes: u64 } => Option<u64>,
    |ReserveSpare { blob, nbytes }, core, now, owner| core.reserve_spare(owner, blob, nbytes, now)
}
op! {
    /// Give the spare `spare` the id `blob` of the put written into it.
    /// Answers whether it took the id (false, and the spare given up, when
    /// `blob` was committed by an earlier try).
    NameSpare { pub spare: BlobId, pub blob: BlobId } => bool,
    |NameSpare { spare, blob }, core, now, owner| core.name_spare(owner, spare, blob, now)
}
op! {
    /// Publish the entries of a reserved blob whose bytes the client
    /// wrote itself (or that were committed already). A blob reserved on
    /// the disk tier is refused: its bytes must come with a put.
    Commit { pub partition: String, pub blob: BlobId, pub entries: Vec<EntrySpec> } => Committed,
    |Commit { partition, blob, entries }, core, _, owner| {
        core.refuse_disk_reservation(owner, blob)?;
        core.commit(owner, &partition, blob, &entries)
    }
}
op! {
    /// [`Commit`] of a blob whose bytes the driver wrote (a put whose
    /// payload it streamed into the slab or the blob's file, a restored
    /// checkpoint): a blob reserved on disk answers [`Committed::Pending`]
    /// until its file is durable.
    CommitWritten {
        pub partition: String,
        pub blob: BlobId,
        pub entries: Vec<EntrySpec>,
    } => Committed,
    |CommitWritten { partition, blob, entries }, core, _, owner| {
        core.commit(owner, &partition, blob, &entries)
    }
}
op! {
    /// A put written into the spare `written`, committed as `blob`, and a
    /// new spare `spare` of `spare_nbytes` for the next put, in one step.
    CommitSpare {
        pub written: BlobId,
        pub blob: BlobId,
        pub partition: String,
        pub entries: Vec<EntrySpec>,
        pub spare: BlobId,
        pub spare_nbytes: u64,
    } => SpareCommitted,
    |op, core, now, owner| {
        core.refuse_disk_reservation(owner, op.blob)?;
        if !core.name_spare(owner, op.written, op.blob, now)? {
            return Ok(SpareCommitted::AlreadyCommitted);
        }
        Ok(match core.commit(owner, &op.partition, op.blob, &op.entries)? {
            Committed::Pending => SpareCommitted::Pending,
            Committed::Done => SpareCommitted::Committed {
                spare: core.reserve_spare(owner, op.spare, op.spare_nbytes, now)?,
            },
        })
    }
}
op! {
    /// Give up a reservation; with `in_flight` (a transfer may still write
    /// into it) its range is quarantined before reuse.
    Abort { pub blob: BlobId, pub in_flight: bool } => (),
    |Abort { blob, in_flight }, core, now, owner| core.abort(owner, blob, in_flight, now)
}
op! {
    /// Where `keys` of `partition` live, with their metadata; pins the
    /// blobs holding the found ones.
    Resolve { pub partition: String, pub keys: Vec<Key> } => Resolved,
    |Resolve { partition, keys }, core, now, owner| {
        let (pin, found) = core.resolve(owner, &partition, &keys, now)?;
        Ok(Resolved { pin, found })
    }
}
op! {
    /// Drop a pin (an unknown one is ignored).
    Unpin { pub pin: PinId } => (),
    |Unpin { pin }, core, _, owner| core.unpin(owner, pin)
}
op! {
    /// Remove every entry of the given rows. Answers the entries removed
    /// (a client's NUL-prefixed bookkeeping fields not counted).
    ClearRows { pub partition: String, pub rows: Vec<u64> } => u64,
    |ClearRows { partition, rows }, core, _, _| Ok(core.clear_rows(&partition, &rows))
}
op! {
    /// Remove every entry of `partition`. Answers the entries removed.
    ClearPartition { pub partition: String } => u64,
    |ClearPartition { partition }, core, _, _| Ok(core.clear_partition(&partition))
}

/// The answer to [`Resolve`].
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The pin, none when no key was found.
    pub pin: Option<PinId>,
    /// Each key's placement and metadata, in the order asked.
    pub found: Vec<Option<Placed>>,
}

/// The answer to [`CommitSpare`].
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
