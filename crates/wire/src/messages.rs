//! The messages: the envelope of every frame, requests (client → unit)
//! and responses (unit → client), and the structs they carry.

use serde::{Deserialize, Serialize};

use crate::{auth, BlobId, EntrySpec, ErrorCode, Homes, Key, Meta, PinId, Stats};

/// The header of a frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Chosen by the client; echoed in the reply.
    pub id: u64,
    pub body: T,
}

/// Client → unit. Requests that name keys or rows act in a **partition**
/// of the connection's namespace (e.g. one RL step's rows); partitions are
/// isolated from each other like namespaces are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// First message on a connection. `want_fd`: hand over the slab's memfd
    /// (Unix sockets only) so the client can copy bytes itself. `session`:
    /// join the session the unit gave at an earlier Hello (a client's
    /// connections to one unit form one session, which owns what they
    /// reserve and pin); `None` starts a new one.
    Hello {
        version: u16,
        namespace: String,
        want_fd: bool,
        session: Option<u128>,
    },
    /// Reserve `nbytes` for a blob of `n_entries` entries.
    Alloc {
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
    },
    /// Publish a reserved blob's entries (offsets relative to the blob).
    Commit {
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
    },
    /// Give up a reservation; `in_flight` when a transfer may still write.
    Abort {
        blob: BlobId,
        in_flight: bool,
    },
    /// Locate keys and pin their blobs. Every pin lasts until Unpin (by
    /// its session) or the end of the connection that took it; no lease
    /// ends it. `hold`: the pin is a view's, kept as long as its caller
    /// wants (not a get's, unpinned once copied out): what it keeps of a
    /// cleared or replaced value counts as used (a put short of memory is
    /// answered Full, naming the views, not Busy).
    Resolve {
        partition: String,
        keys: Vec<Key>,
        hold: bool,
    },
    /// Drop a pin. With `reply: false` the unit sends nothing back.
    Unpin {
        pin: PinId,
        reply: bool,
    },
    /// Clear whole rows (every field). Answered [`Response::Cleared`].
    ClearRows {
        partition: String,
        rows: Vec<u64>,
    },
    Stats,
    /// alloc + the blob's bytes (the frame's payload) + commit, in one
    /// request: the unit reads the payload straight into the slab.
    /// `timeout_ms`: the time left to the caller's deadline; a payload that
    /// stalls longer is cut off (and its range quarantined).
    Put {
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        timeout_ms: u64,
    },
    /// resolve + the values' bytes in the reply's payload + unpin.
    /// `timeout_ms`: a reader that does not take the reply within it is
    /// cut off.
    Read {
        partition: String,
        keys: Vec<Key>,
        timeout_ms: u64,
    },
    /// The rows of a partition and their fields.
    List {
        partition: String,
    },
    /// Clear every row of a partition. Answered [`Response::Cleared`].
    ClearPartition {
        partition: String,
    },
    /// The partitions of this namespace that hold data.
    ListPartitions,
    /// Write every committed value and the index to `dir` on the unit's
    /// host (all namespaces); answers metadata only. `dir` must lie under
    /// the checkpoint root the unit was started with. A checkpoint
    /// request: an admin, or any client of a unit with a shared secret.
    Checkpoint {
        dir: String,
    },
    /// Stop the unit within `timeout_ms`: abandon a checkpoint in progress
    /// if it does not finish in time, remove the disk directory, exit. An
    /// admin request.
    Shutdown {
        timeout_ms: u64,
    },
    /// First message to a unit with a shared secret: the client's fresh
    /// nonce. The unit answers [`Response::Challenge`]; a unit without a
    /// secret answers `Unauthorized` (a client that holds a secret talks
    /// to no unit that cannot prove it).
    Auth {
        client_nonce: auth::Nonce,
    },
    /// The client's proof of the secret for this connection's nonces
    /// ([`auth::Secret::client_proof`]). No reply when it is right (the
    /// client sends Hello right after it); `Unauthorized` and the end of
    /// the connection otherwise.
    Prove {
        client_proof: auth::Proof,
    },
    /// Commit (as [`Request::Commit`]) the bytes written into reservation
    /// `written` as blob `blob`, then reserve a *spare* of `spare_nbytes`
    /// for blob `spare`, held by this connection: the client writes its
    /// next put into it before it asks the unit anything, and commits that
    /// put with another CommitSpare naming the spare as `written`, so a
    /// same-host put costs one round trip. `written` is `blob` itself
    /// (reserved by Alloc) or a spare, whose commit names any number of
    /// entries within its size. Answered [`Response::CommittedSpare`]
    /// (`AlreadyCommitted` when `blob` was committed by an earlier try: the
    /// spare `written` is then given up); a commit that fails answers as
    /// Commit does and reserves nothing.
    CommitSpare {
        blob: BlobId,
        written: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        spare: BlobId,
        spare_nbytes: u64,
    },
    /// Ask how to reach this unit's slab with one-sided NIXL transfers:
    /// answered [`Response::NixlInfo`] by a unit that serves nixl
    /// (`stowage unit --nixl`), `InvalidRequest` by one that does not. The
    /// connection's holds then outlive its end until the unit has fenced
    /// the client's agent (docs/fencing.md): the client's WRITEs and READs
    /// touch them directly.
    ///
    /// `agent`: the client's NIXL agent name, and `agent_metadata` what the
    /// unit loads to reach it (its connection information), so that the
    /// unit can invalidate it once the agent's last connection has ended;
    /// both empty when the client cannot tell (its holds then wait out the
    /// unit's nixl quarantine alone).
    NixlInfo {
        agent: String,
        agent_metadata: Vec<u8>,
    },
    /// A connection that mapped the slab (`want_fd` on a Unix socket) asks
    /// for a request ring of `bytes` bytes ([`RING_MIN`] to [`RING_MAX`],
    /// a multiple of 4096): answered [`Response::Ring`] with the ring's
    /// memfd attached (SCM_RIGHTS, as Hello's slab), or an error by a unit
    /// that serves no rings (the client then never asks again on that
    /// connection). From then on the connection's requests may come
    /// through the ring (`stowage_shm::ring`), each entry one encoded
    /// frame without payload; they are the connection's requests exactly
    /// as if they came on its socket.
    OpenRing {
        bytes: u32,
    },
    /// No reply: "my ring has requests and you are parked" (sent on the
    /// socket when `Ring::submit` says the unit parked the ring).
    RingKick,
    /// Serve the checkpoint in `dir` on the unit's host (under its
    /// checkpoint root, as [`Request::Checkpoint`]'s, no link followed)
    /// from a temporary restore unit that this unit starts in its own
    /// process: the unit's own listeners' hosts, port 0, the same secret,
    /// memory sized from the checkpoint's files. Answered
    /// [`Response::Restore`] (also when there is nothing at `dir`: then
    /// `opened` is `None` and `missing` says what is missing). The
    /// restore unit stops at [`Request::CloseRestore`], when it has had no
    /// connection for a while, and with this unit. A checkpoint request:
    /// an admin, or any client of a unit with a shared secret.
    OpenRestore {
        dir: String,
    },
    /// Stop restore unit `id` (from [`Response::Restore`]). Answered
    /// `Done` (also when it is already gone).
    CloseRestore {
        id: u64,
    },
    /// Declare `tasks`, the consumers of `partition` that claim its rows
    /// ([`Request::Claim`]); `samples`: the rows the partition is expected
    /// to hold over all units (reported back by [`Request::ClaimStatus`]);
    /// `group_size` above 1: rows sharing a group (their field named
    /// [`GROUP_FIELD_PREFIX`](crate::GROUP_FIELD_PREFIX) + the group's id) are claimed whole.
    /// Idempotent; tasks add up. Answered `Done` (protocol 13).
    RegisterTasks {
        partition: String,
        tasks: Vec<String>,
        samples: u64,
        group_size: u32,
    },
    /// Lease up to `want` rows of `partition` that have every one of
    /// `fields` and that `task` has neither claimed nor leased, to this
    /// connection: answered [`Response::Claimed`]. When none is ready
    /// the answer waits up to `wait_ms` for one (0: answered at once, the
    /// lease then empty) — the only request whose answer waits for other
    /// clients, so never sent on a request ring. The lease is kept by
    /// [`Request::Settle`] on the same connection; it gives its rows back
    /// if the connection ends or the unit's claim lease passes first.
    ///
    /// With copies, `homes` names the homes whose rows this unit claims
    /// (it holds copies of other units' rows, which their claimers claim):
    /// the lease's rows are of those homes only, and the answer names each
    /// row's home.
    Claim {
        partition: String,
        task: String,
        fields: Vec<String>,
        want: u32,
        wait_ms: u32,
        homes: Option<Homes>,
    },
    /// Keep the rows `keep` of lease `lease` (they are claimed by its task
    /// for good) and give its others back. Answered [`Response::Settled`]
    /// with the rows kept: those still leased (not given back by a lease
    /// that ran out, nor cleared).
    Settle {
        lease: u64,
        keep: Vec<u64>,
    },
    /// How far `task` got through `partition` on this unit: answered
    /// [`Response::ClaimStatus`]. With copies, `homes` counts the
    /// consumption of those homes' rows only.
    ClaimStatus {
        partition: String,
        task: String,
        homes: Option<Homes>,
    },
    /// The claims state of this namespace's registered partitions on this
    /// unit, as a checkpoint keeps it (each partition's registration, its
    /// rows in claim order, each task's consumed rows and count; rows
    /// leased now are not consumed): answered [`Response::ClaimsState`],
    /// in the format of a checkpoint's `claims` file. What a load reads
    /// from the unit that restored a checkpoint's part.
    ClaimsState,
    /// Put back a claims state that [`Request::ClaimsState`] answered, in
    /// this namespace, over the rows this unit holds now (store them
    /// first): each partition it names loses its claims state here
    /// (leases, waiting claims) and takes the saved one; rows it names
    /// that this unit does not hold are left out. Answered `Done`.
    LoadClaims {
        state: Vec<u8>,
    },
    /// [`Request::Resolve`] of every field of `rows`, named once each: the
    /// keys are each field's rows in turn (`fields[0]` of every row, then
    /// `fields[1]`...), and so are the values of the Resolved reply. What
    /// a view of thousands of values sends (protocol 15).
    ResolveRows {
        partition: String,
        rows: Vec<u64>,
        fields: Vec<String>,
        hold: bool,
    },
    /// Open a repair window on this unit for `key` (the repairer's name
    /// for what it repairs, e.g. "group 3"): from now until
    /// [`Request::CloseRepair`] (or the end of the session), the unit
    /// remembers every row and partition of this namespace that is
    /// cleared, so that [`Request::RepairPut`] can refuse what was cleared
    /// after this point. Answered [`Response::RepairOpened`]; `Busy` when
    /// another session holds a window with the same key in the same
    /// namespace.
    OpenRepair {
        key: String,
    },
    /// Close window `window` (`Done`; an unknown window is `Done` too).
    CloseRepair {
        window: u64,
    },
    /// Put (payload = the blob's bytes, as [`Request::Put`]) whose entries
    /// are each stored only if this unit holds no value for the key and
    /// the key's row and partition were not cleared since `window` opened.
    /// Answered [`Response::Repaired`]; `InvalidRequest` when `window` is
    /// not open in this session; `Busy` when the window lost track of
    /// clears (the unit's cap on what it remembers) — the repairer then
    /// starts over with a new window. Never lands on the disk tier: a slab
    /// with no room answers `Full` (or `Busy`) as a put's alloc would.
    RepairPut {
        window: u64,
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        timeout_ms: u64,
    },
    /// [`Request::Checkpoint`] (same directory rules, same authorization,
    /// answered [`Response::Checkpointed`]) of one copy of each row: the
    /// index and values written keep only the rows whose home
    /// ([`home_unit`](crate::home_unit) over the row's fields in its
    /// partition, among `units` units) is one of `homes`; the info counts
    /// what was written. What a client with copies asks of each unit, so
    /// that a checkpoint holds every row once. `InvalidRequest` when
    /// `units` is 0 or a home is not below it.
    CheckpointHomes {
        dir: String,
        units: u32,
        homes: Vec<u32>,
    },
    /// A [`Request::Put`] (payload = the blob's bytes) that this unit also
    /// forwards to the other copies `to`, over tcp, as the bytes arrive
    /// (docs/replication.md#forwarding), down a chain: to the first of
    /// `to`, with the rest of `to` to forward on (the last gets a plain
    /// Put). The client sends the bytes once. `hop`: this unit's place in
    /// the chain (0 from the client; 1 + `hop` for the next; a unit
    /// serves each hop on a pool of its own, so a chain never waits on
    /// itself). Answered [`Response::Forwarded`] once this unit committed
    /// its copy and the rest of the chain answered (or failed); a refusal
    /// of this unit's own copy is answered as a Put's, and forwards
    /// nothing.
    ForwardPut {
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        timeout_ms: u64,
        to: Vec<Hop>,
        hop: u8,
    },
    /// Stop serving for good, if this unit is instance `instance`
    /// (docs/replication.md#fencing): a client took the unit as down on
    /// its directory's word (Ray says its actor is dead) while it may still
    /// serve. From before the answer on, every request is refused
    /// [`ErrorCode::Fenced`] and the unit exits. Answered
    /// [`Response::Done`]; `InvalidRequest` naming the instance when it is
    /// another; taken from an admin, or any client of a unit with a
    /// shared secret.
    Fence {
        instance: u128,
    },
    /// This connection speaks for plane view `epoch`, whose
    /// [`PlaneView::digest`] is `digest` (docs/replication.md#rejoining):
    /// from the answer on, the unit serves its requests that read or write
    /// rows only while its own view is that one, and refuses them
    /// [`ErrorCode::Stale`] otherwise (two views of one epoch, made by
    /// rejoins at once, are told apart by their digests). A connection that
    /// never sends it speaks for the first view (epoch 0, no members).
    /// Answered [`Response::View`] with the unit's view.
    Epoch {
        epoch: u64,
        digest: u64,
    },
    /// Take `view` as the plane's view if it is newer than the unit's (a
    /// higher epoch), or keep the unit's; answered [`Response::View`] with
    /// the unit's view after (`view` when it was taken or is the unit's
    /// already). A unit moved to a new view refuses, from before the
    /// answer, the row requests of every connection of an older epoch.
    /// Taken from an admin, or any client of a unit with a shared secret.
    SetView {
        view: PlaneView,
    },
    /// Copy the bytes of blob `blob`, reserved by this connection's session
    /// and written by the client (over its mapping of the slab), to the
    /// units of the other copies `to`, on this host: into each one's slab,
    /// mapped over its Unix socket (`addr`: an absolute path), committed
    /// there with `entries` in `partition` (docs/replication.md#forwarding).
    /// The client commits its own reservation after; the other copies
    /// never cross the client. Answered [`Response::Forwarded`] (`pending`
    /// false) naming the copies not committed, which the client writes
    /// itself; within `timeout_ms`.
    CopyReserved {
        blob: BlobId,
        partition: String,
        entries: Vec<EntrySpec>,
        timeout_ms: u64,
        to: Vec<Hop>,
    },
}

/// Which unit instances make up a plane, and since when
/// (docs/replication.md#rejoining): `epoch` counts the views, 0 the one
/// the plane started with (where `members` is empty: the directory's
/// units). `members[u]`: the instance that serves unit `u` now, and the
/// epoch of the view that took it in (0: it was there at the start). A
/// member taken in after the start holds only what was put since, until
/// a repair copies the rest to it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlaneView {
    pub epoch: u64,
    pub members: Vec<Member>,
}

impl PlaneView {
    /// A digest of the whole view (FNV-1a over its encoding): what a
    /// connection names besides the epoch, so that two views of one epoch
    /// never pass for each other.
    pub fn digest(&self) -> u64 {
        let bytes = postcard::to_allocvec(self).unwrap_or_default();
        bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }
}

/// One unit's place in a [`PlaneView`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Member {
    pub instance: Option<u128>,
    pub since: u64,
}

/// A copy a [`Request::ForwardPut`] is forwarded to: unit `unit` of the
/// plane (as the client numbers them, to name it in a failure) at the tcp
/// address `addr` (`ip:port`; for [`Request::CopyReserved`], the path of
/// its Unix socket), which must answer as instance `instance`
/// when the client knows it (another instance there fails that copy: the
/// client then finds the unit restarted, as its own put would).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hop {
    pub unit: u32,
    pub addr: String,
    pub instance: Option<u128>,
}

/// A copy of a [`Request::ForwardPut`] that is not committed: which
/// unit's, and why (the error its unit answered; `Internal` when the
/// forward could not reach it, or the connection failed on the way, as
/// `message` says).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCopy {
    pub unit: u32,
    pub code: ErrorCode,
    pub message: String,
}

/// Partitions whose name begins with this are a client's bookkeeping, not
/// rows (the marks of repaired copies): lists of partitions leave them
/// out, and a checkpoint of some homes does not write them (they describe
/// what a unit holds now, not data).
pub const RESERVED_PARTITION_PREFIX: &str = "\0stowage:";

/// Reply to [`Request::ClaimStatus`]: a task's progress on one unit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimProgress {
    /// Whether the task is registered for the partition here.
    pub registered: bool,
    /// The rows the partition was registered with (over all units).
    pub samples: u64,
    pub group_size: u32,
    /// Rows the task claimed for good (settled) on this unit.
    pub consumed: u64,
    /// Rows leased now, not settled yet.
    pub leased: u64,
}

/// The smallest ring a client may ask for ([`Request::OpenRing`]).
pub const RING_MIN: u32 = 4096;
/// The largest ring a client may ask for ([`Request::OpenRing`]).
pub const RING_MAX: u32 = 1 << 20;

/// A file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointFile {
    pub name: String,
    pub size: u64,
    pub xxh3: u64,
}

/// What a unit's checkpoint holds (metadata only).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub rows: u64,
    pub entries: u64,
    pub bytes: u64,
    pub files: Vec<CheckpointFile>,
    /// Checksum of the unit's MANIFEST file.
    pub manifest_xxh3: u64,
    /// The name of the host whose unit wrote (or restored) it.
    pub host: String,
    /// Where it is, relative to that unit's checkpoint root
    /// (`/`-separated names; empty when it was not asked under a root).
    pub stored: String,
}

/// Reply to [`Request::OpenRestore`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreReply {
    /// The name of the unit's host.
    pub host: String,
    /// The directory it looked at, on that host.
    pub path: String,
    /// The restore unit serving it; `None`: nothing there.
    pub opened: Option<RestoreSource>,
    /// What is missing, when `opened` is `None`.
    pub missing: String,
}

/// A restore unit a unit started ([`Request::OpenRestore`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreSource {
    /// Its id, for [`Request::CloseRestore`].
    pub id: u64,
    /// Its TCP address (`ip:port`; the IP is the unit's own listener's,
    /// which may be unspecified: then use the host the unit was reached
    /// at), if the unit listens on TCP.
    pub tcp: Option<String>,
    /// Its Unix socket, if the unit listens on one.
    pub uds: Option<String>,
    /// What it serves.
    pub info: CheckpointInfo,
}

/// A found key, placed: its value's placement in the slab (one range, or
/// its `parts`) and its metadata — the wire's form of the core's
/// `Placed`. `on_disk`: the value is only in the unit's disk tier (and the slab had
/// no room to bring it back): read it with [`Request::Read`]; `offset` is
/// then meaningless.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    pub offset: u64,
    pub len: u64,
    /// Encoded as a `Vec<u8>`; inline up to 32 bytes ([`Meta`]).
    pub meta: Meta,
    pub on_disk: bool,
    /// A value stored across pieces of the slab: (slab offset, bytes) of
    /// each part, in order (`offset` is then the first's). Empty for a
    /// value in one range, the usual case.
    pub parts: Vec<(u64, u64)>,
}

impl Placed {
    /// (slab offset, bytes) of each range the value lies in, in order.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        if self.parts.is_empty() {
            vec![(self.offset, self.len)]
        } else {
            self.parts.clone()
        }
    }
}

/// A value in a [`Response::Data`] payload: its length and metadata.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    pub len: u64,
    /// Encoded as a `Vec<u8>`; inline up to 32 bytes ([`Meta`]).
    pub meta: Meta,
}

/// Unit → client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Reply to Hello. `fd_attached`: the slab's memfd rides along with
    /// this frame as SCM_RIGHTS ancillary data.
    Hello {
        version: u16,
        /// Random per unit process: a restarted unit (empty memory) has a
        /// new one.
        instance_id: u128,
        slab_bytes: u64,
        fd_attached: bool,
        /// The session this connection belongs to (the one asked for, or
        /// a new one when that one is gone). Random, not guessable.
        session: u128,
    },
    /// Reply to Alloc: write the blob's bytes into these (slab offset,
    /// bytes) pieces, in order (one piece unless the slab's free memory is
    /// cut so that no single range holds the blob). `spares_back`: the
    /// unit is short of memory; give back the spares this connection holds.
    Allocated {
        pieces: Vec<(u64, u64)>,
        spares_back: bool,
    },
    /// Reply to Alloc: the slab has no room but the disk tier has; send the
    /// bytes with [`Request::Put`] (same blob id).
    ToDisk,
    /// Reply to Commit or Put of a blob going to disk: not durable yet;
    /// commit again shortly.
    Pending,
    AlreadyCommitted,
    /// Commit, Abort, Unpin and Put succeeded.
    Done,
    Resolved {
        pin: Option<PinId>,
        found: Vec<Option<Placed>>,
        /// Positions of keys whose blob's disk file is corrupt (their
        /// `found` is `None`).
        corrupt: Vec<u32>,
        /// As in [`Response::Allocated`].
        spares_back: bool,
    },
    /// Reply to ClearRows and ClearPartition: how many values (entries)
    /// were removed.
    Cleared {
        entries: u64,
    },
    /// Boxed: by far the largest reply, and a rare one.
    Stats(Box<Stats>),
    /// Reply to Read: each key's value (`None`: not found); the found
    /// values' bytes follow in the payload, in key order.
    Data {
        items: Vec<Option<Item>>,
        /// Positions of keys whose blob's disk file is corrupt (their
        /// item is `None`).
        corrupt: Vec<u32>,
    },
    /// Reply to List: (row, fields) pairs, rows ascending.
    Listed {
        rows: Vec<(u64, Vec<String>)>,
    },
    /// Reply to ListPartitions.
    Partitions {
        names: Vec<String>,
    },
    /// Reply to Checkpoint.
    Checkpointed(CheckpointInfo),
    /// Reply to Shutdown: what could not be done (empty: all went well).
    ShutDown {
        problems: Vec<String>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    /// Reply to Auth: the unit's fresh nonce, and its own proof of the
    /// secret for both nonces ([`auth::Secret::unit_proof`]), which the
    /// client checks before it proves anything.
    Challenge {
        unit_nonce: auth::Nonce,
        unit_proof: auth::Proof,
    },
    /// Reply to CommitSpare: the blob is published; `spare`: where the
    /// spare is, `None` when the slab had no room for it now.
    CommittedSpare {
        spare: Option<u64>,
        /// As in [`Response::Allocated`] (`spare` is then `None`).
        spares_back: bool,
    },
    /// Reply to NixlInfo: the unit's NIXL agent metadata (to load with
    /// `load_remote_md`) and the address its slab is registered at: a range
    /// at slab offset `o` is at `slab_addr + o` for the peer's transfers.
    NixlInfo {
        metadata: Vec<u8>,
        slab_addr: u64,
    },
    /// Reply to OpenRing: the ring's memfd (of `bytes` bytes) rides along
    /// with this frame as SCM_RIGHTS ancillary data.
    Ring {
        bytes: u32,
    },
    /// Written into a ring's completion queue in place of a reply (with
    /// the request's id) that does not fit there, or that carries a
    /// payload: the real reply to that id follows on the socket.
    OnSocket,
    /// Reply to OpenRestore (boxed: a rare reply).
    Restore(Box<RestoreReply>),
    /// Reply to Claim: the lease and its rows (none: nothing was ready
    /// within the wait; the lease is then 0); with the claim's `homes`,
    /// each row's home in `rows`' order (else empty).
    Claimed {
        lease: u64,
        rows: Vec<u64>,
        homes: Vec<u32>,
    },
    /// Reply to Settle: the rows kept.
    Settled {
        rows: Vec<u64>,
    },
    /// Reply to ClaimStatus.
    ClaimStatus(ClaimProgress),
    /// Reply to ClaimsState.
    ClaimsState {
        state: Vec<u8>,
    },
    /// Reply to [`Request::ResolveRows`]: its values in columns, in the
    /// order of its keys, each column one run of bytes (a view of
    /// thousands of values encodes and decodes no structure per value).
    /// Found values are pinned as [`Response::Resolved`]'s are.
    ResolvedRows(Box<RowsResolved>),
    /// Reply to [`Request::OpenRepair`].
    RepairOpened {
        window: u64,
    },
    /// Reply to [`Request::RepairPut`]: entries stored, and entries
    /// skipped (a value already there, or cleared since the window
    /// opened).
    Repaired {
        stored: u32,
        skipped: u32,
    },
    /// Reply to [`Request::ForwardPut`]: this unit committed its copy
    /// (`pending`: it is still being made durable on its disk tier, as
    /// [`Response::Pending`]); every copy down the chain is committed but
    /// those in `failed`, which the client writes itself.
    Forwarded {
        pending: bool,
        failed: Vec<FailedCopy>,
    },
    /// Reply to [`Request::Epoch`] and [`Request::SetView`]: the unit's
    /// view of the plane.
    View {
        view: PlaneView,
    },
}

/// The columns of a [`Response::ResolvedRows`]; read them with
/// [`RowsResolved::values`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowsResolved {
    pub pin: Option<PinId>,
    /// How many values (the request's rows times its fields).
    pub n: u32,
    /// Each value's slab offset and length, two little-endian u64s (16
    /// bytes per value; zeros for a value not found or corrupt; the
    /// length and zero offset of a value on disk).
    #[serde(with = "serde_bytes")]
    pub places: Vec<u8>,
    /// Each value's metadata, back to back.
    #[serde(with = "serde_bytes")]
    pub metas: Vec<u8>,
    /// Where each value's metadata ends in `metas`, a little-endian u32
    /// per value (it starts where the one before it ends).
    #[serde(with = "serde_bytes")]
    pub meta_ends: Vec<u8>,
    /// Positions of values not found.
    pub missing: Vec<u32>,
    /// Positions of values whose blob's disk file is corrupt.
    pub corrupt: Vec<u32>,
    /// Positions of values only on disk (no room in the slab for them).
    pub on_disk: Vec<u32>,
    /// Values stored across pieces of the slab: position, and (slab
    /// offset, bytes) of each part in order (its place is the first's
    /// offset and the total length).
    pub split: Vec<(u32, Vec<(u64, u64)>)>,
    /// As in [`Response::Allocated`].
    pub spares_back: bool,
}

/// One value of a [`RowsResolved`] as [`RowsResolved::values`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowValue<'a> {
    pub offset: u64,
    pub len: u64,
    pub meta: &'a [u8],
}

impl RowsResolved {
    /// Append a value's place and metadata (the unit, building the
    /// reply; positions are counted by the caller).
    pub fn push(&mut self, offset: u64, len: u64, meta: &[u8]) {
        self.places.extend_from_slice(&offset.to_le_bytes());
        self.places.extend_from_slice(&len.to_le_bytes());
        self.metas.extend_from_slice(meta);
        // Metadata is bounded far below 4 GiB per request (Limits).
        let end = u32::try_from(self.metas.len()).unwrap_or(u32::MAX);
        self.meta_ends.extend_from_slice(&end.to_le_bytes());
        self.n += 1;
    }

    /// The parts of each split value, by its position.
    pub fn split_parts(&self) -> std::collections::BTreeMap<u32, &[(u64, u64)]> {
        self.split.iter().map(|(i, p)| (*i, &p[..])).collect()
    }

    /// Every value in order, checked: the columns hold exactly `n`
    /// values, and each value's metadata lies in `metas`.
    pub fn values(&self) -> Result<impl Iterator<Item = RowValue<'_>> + '_, String> {
        let n = self.n as usize;
        if self.places.len() != n.saturating_mul(16) || self.meta_ends.len() != n.saturating_mul(4)
        {
            return Err(format!(
                "columns of {} and {} bytes for {n} values",
                self.places.len(),
                self.meta_ends.len()
            ));
        }
        let mut start = 0usize;
        for end in self.meta_ends.chunks_exact(4) {
            let end = u32::from_le_bytes(end.try_into().unwrap_or_default()) as usize;
            if end < start || end > self.metas.len() {
                return Err(format!("metadata ending at {end}, after {start}"));
            }
            start = end;
        }
        if self
            .missing
            .iter()
            .chain(&self.corrupt)
            .chain(&self.on_disk)
            .chain(self.split.iter().map(|(i, _)| i))
            .any(|&i| i as usize >= n)
        {
            return Err(format!("a position past the {n} values"));
        }
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        let mut start = 0usize;
        Ok(self
            .places
            .chunks_exact(16)
            .zip(self.meta_ends.chunks_exact(4))
            .map(move |(place, end)| {
                let end = u32::from_le_bytes(end.try_into().unwrap_or_default()) as usize;
                let meta = &self.metas[start..end];
                start = end;
                RowValue {
                    offset: u64_at(&place[..8]),
                    len: u64_at(&place[8..]),
                    meta,
                }
            }))
    }
}
