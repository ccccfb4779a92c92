//! The inputs of the core, one type each, and the type each is answered
//! with ([`Input::Answer`]): [`UnitCore::handle`] takes any of them and
//! gives back exactly what that input answers, so a driver never meets an
//! answer it did not ask for. A connection's requests are
//! [`Request`]s carrying one of the [`op`](crate::op) types.

use super::*;

/// Only the core applies inputs: a type outside it cannot be named, so
/// neither [`Input`] nor [`Op`] can be implemented or applied elsewhere.
pub(super) mod sealed {
    #[derive(Clone, Copy, Debug)]
    pub struct Token;
}
use sealed::Token;

/// Something that changes the core, applied by [`UnitCore::handle`].
pub trait Input: std::fmt::Debug {
    /// What the core answers to it.
    type Answer;
    #[doc(hidden)]
    fn apply(self, core: &mut UnitCore, now: Time, _: Token) -> Result<Self::Answer, CoreError>;
}

/// A connection's request, carried by a [`Request`].
pub trait Op: std::fmt::Debug {
    /// What the core answers to it.
    type Answer;
    #[doc(hidden)]
    fn apply(
        self,
        core: &mut UnitCore,
        now: Time,
        owner: Owner,
        _: Token,
    ) -> Result<Self::Answer, CoreError>;
}

/// A request of a connection: `op` on behalf of `owner`, answered with
/// what the op answers.
#[derive(Clone, Debug)]
pub struct Request<O> {
    pub owner: Owner,
    pub op: O,
}

/// How an [`op`](crate::op) type applies: `apply_op!(Ty => Answer, |op,
/// core, now, owner| ...)`, written in the module that owns what it
/// changes, so that [`UnitCore::handle`] goes into that one module.
macro_rules! apply_op {
    ($ty:path => $answer:ty, $apply:expr) => {
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
pub(super) use apply_op;

/// An input type: its fields, its answer, and how the core applies it.
macro_rules! input {
    // A driver's report of its work on a blob: `ok` or not, answered with
    // nothing, applied by the named method.
    ($(#[$doc:meta])* report $ty:ident => $method:ident) => {
        input! {
            $(#[$doc])*
            $ty { pub blob: BlobId, pub ok: bool } => (),
            |$ty { blob, ok }, core, _| {
                core.$method(blob, ok);
                Ok(())
            }
        }
    };
    ($(#[$doc:meta])* $ty:ident => $answer:ty, $apply:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty;
        input!(@impl $ty => $answer, $apply);
    };
    ($(#[$doc:meta])* $ty:ident ($($f:tt)*) => $answer:ty, $apply:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty($($f)*);
        input!(@impl $ty => $answer, $apply);
    };
    ($(#[$doc:meta])* $ty:ident {$($f:tt)*} => $answer:ty, $apply:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $ty {$($f)*}
        input!(@impl $ty => $answer, $apply);
    };
    (@impl $ty:ident => $answer:ty, $apply:expr) => {
        impl Input for $ty {
            type Answer = $answer;
            fn apply(self, core: &mut UnitCore, now: Time, _: Token) -> Result<$answer, CoreError> {
                let apply: fn($ty, &mut UnitCore, Time) -> Result<$answer, CoreError> = $apply;
                apply(self, core, now)
            }
        }
    };
}

input! {
    /// A new session, with no connection yet: its id.
    OpenSession => SessionId, |_, core, _| Ok(core.open_session())
}
input! {
    /// A new connection of `session`: its [`Owner`]. `mapped`: its peer
    /// maps the slab and copies into or out of it by itself (a Unix-socket
    /// peer). Busy when the session has [`CoreConfig::max_session_conns`]
    /// connections already.
    Attach { pub session: SessionId, pub mapped: bool } => Owner,
    |Attach { session, mapped }, core, _| core.attach(session, mapped)
}
input! {
    /// The peer of this connection maps the slab from now on.
    MakeMapped(pub Owner) => (), |MakeMapped(owner), core, _| core.make_mapped(owner)
}
input! {
    /// The peer of this connection moves bytes with one-sided transfers
    /// (nixl) from now on: what it holds when its connection ends, however
    /// it ends, stays with its session until [`ProcessExited`], or
    /// [`Fenced`] and then [`CoreConfig::nixl_quarantine`].
    MakeOneSided(pub Owner) => (), |MakeOneSided(owner), core, _| core.make_one_sided(owner)
}
input! {
    /// A connection ended; answers the holds released now (see the crate
    /// docs for which are kept, and until when).
    ConnEnded { pub owner: Owner, pub end: ConnEnd } => u64,
    |ConnEnded { owner, end }, core, now| Ok(core.detach(owner, end, now))
}
input! {
    /// The session's process is certainly gone (its pid exited): release
    /// everything it holds; answers the holds released.
    ProcessExited(pub SessionId) => u64,
    |ProcessExited(session), core, now| Ok(core.session_gone(session, now))
}
input! {
    /// The one-sided endpoint of the session's peer is fenced: the driver
    /// invalidated the peer's NIXL agent (or could not, and says so). Every
    /// hold of the session whose connection ended is released once
    /// [`CoreConfig::nixl_quarantine`] has passed. Answers the holds that
    /// now wait.
    Fenced(pub SessionId) => u64, |Fenced(session), core, now| Ok(core.fence(session, now))
}
input! {
    /// Every committed entry, with the blobs that hold them pinned for the
    /// unit ([`Owner::UNIT`]) until it unpins.
    TakeSnapshot => Snapshot, |_, core, now| Ok(core.snapshot(now))
}
input! {
    /// The claims state of every registered partition, as a [`Snapshot`]
    /// takes it ([`Snapshot::claims`]), without the entries.
    TakeClaims => Vec<PartitionClaims>, |_, core, _| Ok(core.claims_snapshot())
}

/// Put back the claims state a [`Snapshot`] took ([`Snapshot::claims`]),
/// over the entries restored before it: registrations, the rows' order,
/// each task's consumed rows and counter. A partition already registered
/// loses its claims state (leases, waiting claims) first. Invalid, with
/// nothing changed, when a partition or a task is given twice, a task's
/// name is empty, or a partition has more tasks than one may register.
#[derive(Clone, Debug)]
pub struct RestoreClaims(pub Vec<PartitionClaims>);

impl Input for RestoreClaims {
    type Answer = ();
    fn apply(self, core: &mut UnitCore, _: Time, _: Token) -> Result<(), CoreError> {
        core.restore_claims(self.0)
    }
}

input! {
    /// A reader that pinned a spilled blob wants it back in the slab:
    /// answers the slab offset of the range to fill from its file (when
    /// the slab has room below the high watermark), to report with
    /// [`Promoted`]; `None`: read it from disk instead.
    Promote(pub BlobId) => Option<u64>, |Promote(blob), core, _| Ok(core.promote_begin(blob))
}
input! {
    /// The driver filled (`ok`) or failed to fill a promotion's range.
    report Promoted => promote_done
}
input! {
    /// The driver finished writing a blob's file (`ok`: complete and
    /// synced): a [`SpillJob`], a put answered [`Allocated::ToDisk`], a
    /// restored checkpoint's blob. For a spill the memory copy is freed
    /// (once unpinned); for a blob reserved on disk, its entries are
    /// published (if it was committed). A report of a blob with no write
    /// under way is ignored.
    report DiskWritten => disk_written
}
input! {
    /// The driver copied (`ok`) or failed to copy the blob of an
    /// [`Action::Move`]. A report of a blob with no move under way is
    /// ignored.
    report Moved => moved
}
input! {
    /// The time [`UnitCore::poll_timeout`] named has come (or passed):
    /// quarantines that ended release their ranges, fenced holds whose
    /// quarantine ended are released; waiting claims whose `wait_until`
    /// came are answered empty and expired claim leases give their rows
    /// back ([`op::Claim`]). Answers the holds released.
    Timeout => u64, |_, core, now| Ok(core.expire(now))
}
