//! # stowage-wire: the control protocol between clients and storage units
//!
//! Every message travels in a **frame**:
//!
//! ```text
//!  ┌────────────────┬─────────────────┬──────────────────────────────┬──────────────┐
//!  │ header_len u32 │ payload_len u64 │ header: postcard(Envelope)   │ payload bytes │
//!  └────────────────┴─────────────────┴──────────────────────────────┴──────────────┘
//!        little-endian prefix (12 bytes)
//! ```
//!
//! The header is an [`Envelope`]: a request id chosen by the client (the
//! reply carries the same id, so many requests can be in flight on one
//! connection) and a [`Request`] or [`Response`]. The payload carries raw
//! value bytes where a message has them ([`Request::Put`]'s blob,
//! [`Response::Data`]'s values), so bytes go between the socket and the
//! slab without being re-encoded.
//!
//! Parsing checks every length before allocating: the prefix against
//! [`Limits`] (a frame longer than the limit is refused before its header
//! is read), the header by postcard against the header's own length (serde
//! preallocates sequences only cautiously), and then counts and string
//! lengths with [`Request::validate`].
//!
//! The first request on a connection is [`Request::Hello`], carrying
//! [`PROTOCOL_VERSION`] and the namespace every later request acts in —
//! or, with a unit started with a shared secret, the handshake before it
//! ([`Request::Auth`], [`Response::Challenge`], [`Request::Prove`]; see
//! [`auth`]). Handshake frames are small and carry no payload
//! ([`Limits::handshake`]). Enum variants are only ever appended, and any
//! incompatible change bumps the version.
//!
//! A same-host connection may also carry requests through a shared-memory
//! ring ([`Request::OpenRing`]): each ring entry is exactly one encoded
//! frame (prefix and header, [`encode`] with `payload_len` 0), parsed with
//! [`decode_frame`]; a reply that does not fit the ring, or has a payload,
//! is announced there with [`Response::OnSocket`] and sent on the socket.

#![forbid(unsafe_code)]

use serde::{de::DeserializeOwned, Deserialize, Serialize};
pub use stowage_core::{BlobId, EntrySpec, Key, Location, PinId, Stats};

/// The protocol this build speaks. A unit refuses any other. Version 3
/// added the shared-secret handshake; version 4 the traffic counters at
/// the end of [`Stats`] (an older client could not decode them); version 5
/// [`Request::CommitSpare`] and the spare counters of [`Stats`]; version 6
/// [`Request::NixlInfo`]; version 7 the client's NIXL agent in
/// [`Request::NixlInfo`] (its name and connection metadata, so that the unit
/// can fence that agent when its connections end); version 8
/// [`ErrorCode::NotOwner`] (an older client could not decode it); version 9
/// blobs in pieces ([`Response::Allocated`]'s `pieces`, [`Found`]'s
/// `parts`), the unit's call to give spares back (`spares_back`) and the
/// allocator's and compaction's counters in [`Stats`]; version 10 request
/// rings ([`Request::OpenRing`], [`Request::RingKick`], [`Response::Ring`],
/// [`Response::OnSocket`]); version 11 checkpoints across hosts: the
/// unit's host and the part's place under its checkpoint root in
/// [`CheckpointInfo`], and restores a unit opens on its own host
/// ([`Request::OpenRestore`], [`Request::CloseRestore`],
/// [`Response::Restore`]).
pub const PROTOCOL_VERSION: u16 = 11;

/// Bytes of the frame prefix.
pub const PREFIX_LEN: usize = 12;

/// Bounds checked while parsing. Defaults suit RL batches (10^5 keys per
/// request) with ample margin.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest encoded header. Default 64 MiB.
    pub max_header: u32,
    /// Largest payload. Default 64 GiB (payloads are streamed to the slab,
    /// never buffered whole; the unit also refuses a blob larger than its
    /// slab).
    pub max_payload: u64,
    /// Most keys, entries or rows in one request. Default 2^20.
    pub max_keys: usize,
    /// Longest field name, namespace or partition, in bytes. Default 1024.
    pub max_name: usize,
    /// Most metadata bytes per entry. Default 1024.
    pub max_meta: usize,
}

impl Limits {
    /// The limits of a frame before a connection's Hello was served: a
    /// handshake frame (Auth, Prove, Hello) is small and has no payload,
    /// so an unauthenticated peer cannot make the unit read more.
    pub fn handshake(&self) -> Limits {
        let hello = u32::try_from(self.max_name)
            .unwrap_or(u32::MAX)
            .saturating_add(256);
        Limits {
            max_header: self.max_header.min(hello),
            max_payload: 0,
            ..*self
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header: 64 << 20,
            max_payload: 64 << 30,
            max_keys: 1 << 20,
            max_name: 1024,
            max_meta: 1024,
        }
    }
}

/// Why a frame could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("frame header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge { len: u32, max: u32 },
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge { len: u64, max: u64 },
    #[error("malformed frame header: {0}")]
    Malformed(String),
    #[error("{what}: {count} exceeds the limit of {max}")]
    TooMany {
        what: &'static str,
        count: usize,
        max: usize,
    },
    #[error("frame is truncated")]
    Truncated,
}

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
    /// ends it. `hold` is kept for the wire layout and ignored.
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

/// A found key: where its bytes are in the slab, and its metadata.
/// `on_disk`: the value is only in the unit's disk tier (and the slab had
/// no room to bring it back): read it with [`Request::Read`]; `offset` is
/// then meaningless.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Found {
    pub offset: u64,
    pub len: u64,
    pub meta: Vec<u8>,
    pub on_disk: bool,
    /// A value stored across pieces of the slab: (slab offset, bytes) of
    /// each part, in order (`offset` is then the first's). Empty for a
    /// value in one range, the usual case.
    pub parts: Vec<(u64, u64)>,
}

impl Found {
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
    pub meta: Vec<u8>,
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
        found: Vec<Option<Found>>,
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
}

/// Error classes a unit reports. Only ever appended to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Not enough memory, now or after pending reclamation.
    Full,
    /// Memory will free up shortly; retry with backoff.
    Busy,
    /// The blob is not reserved: never allocated, already committed or
    /// aborted, or given up when the session that held it ended (no timer
    /// takes a reservation away; docs/fencing.md).
    UnknownBlob,
    /// Malformed or contradictory request.
    InvalidRequest,
    /// The protocol versions differ.
    VersionMismatch,
    /// The connection did not say Hello first, did not prove the unit's
    /// shared secret, or was refused.
    Unauthorized,
    /// The unit failed internally (I/O); the request may be retried.
    Internal,
    /// The request names a reservation or pin that another session holds
    /// (the connection itself is accepted: see [`ErrorCode::Unauthorized`]).
    NotOwner,
}

impl Request {
    /// Check counts and name lengths against `limits`.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        let count = |what, n: usize| {
            if n > limits.max_keys {
                Err(WireError::TooMany {
                    what,
                    count: n,
                    max: limits.max_keys,
                })
            } else {
                Ok(())
            }
        };
        let name = |what, s: &str| {
            if s.len() > limits.max_name {
                Err(WireError::TooMany {
                    what,
                    count: s.len(),
                    max: limits.max_name,
                })
            } else {
                Ok(())
            }
        };
        let partition = |p: &str| {
            name("partition name bytes", p)?;
            if p.contains(PARTITION_SEPARATOR) {
                return Err(WireError::Malformed(
                    "partition names may not contain U+001F".into(),
                ));
            }
            Ok(())
        };
        match self {
            Request::Hello { namespace, .. } => {
                name("namespace bytes", namespace)?;
                if namespace.contains(PARTITION_SEPARATOR) {
                    return Err(WireError::Malformed(
                        "namespace names may not contain U+001F".into(),
                    ));
                }
                Ok(())
            }
            Request::Alloc {
                n_entries, nbytes, ..
            } => {
                if *nbytes > limits.max_payload {
                    return Err(WireError::PayloadTooLarge {
                        len: *nbytes,
                        max: limits.max_payload,
                    });
                }
                count("entries", *n_entries as usize)
            }
            Request::CommitSpare { spare_nbytes, .. } if *spare_nbytes > limits.max_payload => {
                Err(WireError::PayloadTooLarge {
                    len: *spare_nbytes,
                    max: limits.max_payload,
                })
            }
            Request::Commit {
                entries,
                partition: p,
                ..
            }
            | Request::CommitSpare {
                entries,
                partition: p,
                ..
            }
            | Request::Put {
                entries,
                partition: p,
                ..
            } => {
                partition(p)?;
                count("entries", entries.len())?;
                // Their lengths add up within 64 bits (a blob holds them
                // all), so that no one sums them past it.
                if entries
                    .iter()
                    .try_fold(0u64, |sum, e| sum.checked_add(e.len))
                    .is_none()
                {
                    return Err(WireError::Malformed(
                        "the entries' lengths add up past 2^64 bytes".into(),
                    ));
                }
                entries.iter().try_for_each(|e| {
                    name("field name bytes", &e.key.field)?;
                    if e.offset.checked_add(e.len).is_none() {
                        return Err(WireError::Malformed(format!(
                            "entry {} at {}+{} overflows",
                            e.key, e.offset, e.len
                        )));
                    }
                    if e.meta.len() > limits.max_meta {
                        return Err(WireError::TooMany {
                            what: "metadata bytes",
                            count: e.meta.len(),
                            max: limits.max_meta,
                        });
                    }
                    Ok(())
                })
            }
            Request::Resolve {
                keys, partition: p, ..
            }
            | Request::Read {
                keys, partition: p, ..
            } => {
                partition(p)?;
                count("keys", keys.len())?;
                keys.iter()
                    .try_for_each(|k| name("field name bytes", &k.field))
            }
            Request::ClearRows { rows, partition: p } => {
                partition(p)?;
                count("rows", rows.len())
            }
            Request::List { partition: p } | Request::ClearPartition { partition: p } => {
                partition(p)
            }
            Request::Checkpoint { dir } | Request::OpenRestore { dir } => {
                name("checkpoint path bytes", dir)
            }
            Request::Shutdown { .. } => Ok(()),
            Request::OpenRing { bytes } => {
                if !(RING_MIN..=RING_MAX).contains(bytes) || bytes % 4096 != 0 {
                    return Err(WireError::Malformed(format!(
                        "a ring of {bytes} bytes: rings hold {RING_MIN} to {RING_MAX} bytes, in whole 4 KiB pages"
                    )));
                }
                Ok(())
            }
            Request::Abort { .. }
            | Request::Unpin { .. }
            | Request::Stats
            | Request::NixlInfo { .. }
            | Request::ListPartitions
            | Request::Auth { .. }
            | Request::Prove { .. }
            | Request::RingKick
            | Request::CloseRestore { .. } => Ok(()),
        }
    }

    /// Whether a frame of this request may carry a payload (only
    /// [`Request::Put`]'s does; any other with a payload is invalid).
    pub fn carries_payload(&self) -> bool {
        matches!(self, Request::Put { .. })
    }

    /// Whether the unit answers this request once the connection is
    /// open ([`Request::RingKick`] and an Unpin with `reply: false` are not
    /// answered; a ring needs no room in its completion queue for them).
    pub fn expects_reply(&self) -> bool {
        !matches!(
            self,
            Request::RingKick | Request::Unpin { reply: false, .. }
        )
    }
}

/// Separates namespace and partition in the unit's index; not allowed in
/// partition names.
pub const PARTITION_SEPARATOR: char = '\u{1f}';

/// The parsed frame prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramePrefix {
    pub header_len: u32,
    pub payload_len: u64,
}

impl FramePrefix {
    /// Parse and bound-check a prefix.
    pub fn parse(bytes: &[u8; PREFIX_LEN], limits: &Limits) -> Result<Self, WireError> {
        let header_len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let mut p = [0u8; 8];
        p.copy_from_slice(&bytes[4..12]);
        let payload_len = u64::from_le_bytes(p);
        if header_len > limits.max_header {
            return Err(WireError::HeaderTooLarge {
                len: header_len,
                max: limits.max_header,
            });
        }
        if header_len == 0 {
            return Err(WireError::Malformed("empty header".into()));
        }
        if payload_len > limits.max_payload {
            return Err(WireError::PayloadTooLarge {
                len: payload_len,
                max: limits.max_payload,
            });
        }
        Ok(Self {
            header_len,
            payload_len,
        })
    }
}

/// Append a frame's prefix and header to `out`; the caller sends
/// `payload_len` payload bytes after it.
pub fn encode<T: Serialize>(
    id: u64,
    body: &T,
    payload_len: u64,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; PREFIX_LEN]);
    let env = EnvelopeRef { id, body };
    let buf = std::mem::take(out);
    let mut buf =
        postcard::to_extend(&env, buf).map_err(|e| WireError::Malformed(e.to_string()))?;
    let header_len = u32::try_from(buf.len() - start - PREFIX_LEN)
        .map_err(|_| WireError::Malformed("header over 4 GiB".into()))?;
    buf[start..start + 4].copy_from_slice(&header_len.to_le_bytes());
    buf[start + 4..start + 12].copy_from_slice(&payload_len.to_le_bytes());
    *out = buf;
    Ok(())
}

#[derive(Serialize)]
struct EnvelopeRef<'a, T> {
    id: u64,
    body: &'a T,
}

/// Decode a header of `prefix.header_len` bytes.
pub fn decode_header<T: DeserializeOwned>(bytes: &[u8]) -> Result<Envelope<T>, WireError> {
    let (env, rest): (Envelope<T>, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Malformed(format!(
            "{} trailing bytes after the header",
            rest.len()
        )));
    }
    Ok(env)
}

/// A whole frame parsed from a buffer (tests and the fuzzer; servers read
/// the prefix, header and payload from the socket separately).
#[derive(Debug, PartialEq, Eq)]
pub struct Frame<'a, T> {
    pub envelope: Envelope<T>,
    pub payload: &'a [u8],
}

/// Parse one frame from the front of `buf`: `Ok(None)` when more bytes are
/// needed, the frame and the bytes it took otherwise.
pub fn decode_frame<'a, T: DeserializeOwned>(
    buf: &'a [u8],
    limits: &Limits,
) -> Result<Option<(Frame<'a, T>, usize)>, WireError> {
    let Some(prefix) = buf.get(..PREFIX_LEN) else {
        return Ok(None);
    };
    let mut p = [0u8; PREFIX_LEN];
    p.copy_from_slice(prefix);
    let prefix = FramePrefix::parse(&p, limits)?;
    let header_end = PREFIX_LEN + prefix.header_len as usize;
    let Some(header) = buf.get(PREFIX_LEN..header_end) else {
        return Ok(None);
    };
    let envelope = decode_header(header)?;
    let Some(end) = usize::try_from(prefix.payload_len)
        .ok()
        .and_then(|n| header_end.checked_add(n))
    else {
        return Err(WireError::PayloadTooLarge {
            len: prefix.payload_len,
            max: limits.max_payload,
        });
    };
    let Some(payload) = buf.get(header_end..end) else {
        return Ok(None);
    };
    Ok(Some((Frame { envelope, payload }, end)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(row: u64, f: &str) -> Key {
        Key::new(row, f)
    }

    fn all_requests() -> Vec<Request> {
        let e = EntrySpec {
            key: key(3, "input_ids"),
            offset: 64,
            len: 100,
            meta: vec![1, 2, 3],
        };
        vec![
            Request::Hello {
                version: PROTOCOL_VERSION,
                namespace: "run-1".into(),
                want_fd: true,
                session: Some(u128::MAX),
            },
            Request::Alloc {
                blob: BlobId(u128::MAX - 1),
                nbytes: 1 << 36,
                n_entries: 7,
            },
            Request::Commit {
                blob: BlobId(5),
                partition: "step-3".into(),
                entries: vec![e.clone(), e.clone()],
            },
            Request::Abort {
                blob: BlobId(5),
                in_flight: true,
            },
            Request::Resolve {
                partition: String::new(),
                keys: vec![key(0, ""), key(u64::MAX, "x")],
                hold: true,
            },
            Request::Unpin {
                pin: PinId(9),
                reply: false,
            },
            Request::ClearRows {
                partition: "p".into(),
                rows: vec![0, 1, u64::MAX],
            },
            Request::Stats,
            Request::Put {
                blob: BlobId(1),
                partition: "p".into(),
                entries: vec![e],
                timeout_ms: 30_000,
            },
            Request::Read {
                partition: "p".into(),
                keys: vec![key(1, "a")],
                timeout_ms: 1,
            },
            Request::List {
                partition: "p".into(),
            },
            Request::ClearPartition {
                partition: "p".into(),
            },
            Request::ListPartitions,
            Request::Checkpoint {
                dir: "/tmp/ckpt/unit-0".into(),
            },
            Request::Shutdown { timeout_ms: 5000 },
            Request::Auth {
                client_nonce: [0xab; 32],
            },
            Request::Prove {
                client_proof: [0xcd; 32],
            },
            Request::CommitSpare {
                blob: BlobId(5),
                written: BlobId(6),
                partition: "step-1".into(),
                entries: vec![EntrySpec {
                    key: Key::new(1, "f"),
                    offset: 0,
                    len: 9,
                    meta: vec![1],
                }],
                spare: BlobId(7),
                spare_nbytes: 65536,
            },
            Request::NixlInfo {
                agent: "stowage-client-1-00ff".into(),
                agent_metadata: vec![3; 200],
            },
            Request::OpenRing { bytes: 16 << 10 },
            Request::RingKick,
            Request::OpenRestore {
                dir: "step-1/stowage/unit-0".into(),
            },
            Request::CloseRestore { id: 7 },
        ]
    }

    fn all_responses() -> Vec<Response> {
        vec![
            Response::Hello {
                version: 1,
                instance_id: 0xdead_beef_u128 << 64,
                slab_bytes: 1 << 30,
                fd_attached: true,
                session: 7,
            },
            Response::Allocated {
                pieces: vec![(4096, 64)],
                spares_back: false,
            },
            Response::Allocated {
                pieces: vec![(4096, 64), (1 << 20, 1 << 20)],
                spares_back: true,
            },
            Response::CommittedSpare {
                spare: Some(8192),
                spares_back: false,
            },
            Response::CommittedSpare {
                spare: None,
                spares_back: true,
            },
            Response::NixlInfo {
                metadata: vec![7; 400],
                slab_addr: 0x7f00_0000_0000,
            },
            Response::AlreadyCommitted,
            Response::Done,
            Response::Resolved {
                pin: Some(PinId(3)),
                found: vec![
                    None,
                    Some(Found {
                        offset: 64,
                        len: 10,
                        meta: vec![9],
                        on_disk: true,
                        parts: Vec::new(),
                    }),
                    Some(Found {
                        offset: 64,
                        len: 100,
                        meta: vec![],
                        on_disk: false,
                        parts: vec![(64, 36), (4096, 64)],
                    }),
                ],
                corrupt: vec![0],
                spares_back: false,
            },
            Response::ToDisk,
            Response::Pending,
            Response::Cleared { entries: 12 },
            Response::Stats(Box::new(Stats {
                capacity: 1,
                used: 2,
                reserved_bytes: 3,
                quarantined_bytes: 4,
                blobs: 5,
                entries: 6,
                rows: 7,
                pins: 8,
                disk_capacity: 9,
                disk_used: 10,
                spilled_blobs: 11,
                disk_write_bytes: 12,
                disk_write_micros: 13,
                disk_read_bytes: 14,
                disk_read_micros: 15,
                index_bytes: 16,
                held_bytes: 17,
                overdue_holds: 18,
                sessions: vec![stowage_core::SessionStats {
                    session: 1,
                    connections: 2,
                    reservations: 3,
                    pins: 4,
                    held_bytes: 5,
                    oldest_hold_ms: 6,
                    orphaned: 7,
                    spares: 8,
                }],
                ops: 19,
                bytes_in: 20,
                bytes_out: 21,
                busy: 22,
                partitions: 23,
                pinned_bytes: 24,
                spares: 25,
                spare_bytes: 26,
                serves_nixl: true,
                page_mode: "thp".into(),
                free_bytes: 1 << 20,
                largest_free: 4096,
                spare_budget: 65536,
                compaction_moves: 3,
                compaction_bytes: 12288,
                split_blobs: 2,
                compaction_micros: 900,
            })),
            Response::Data {
                items: vec![
                    Some(Item {
                        len: 3,
                        meta: vec![],
                    }),
                    None,
                ],
                corrupt: vec![1],
            },
            Response::Listed {
                rows: vec![(1, vec!["a".into(), "b".into()])],
            },
            Response::Partitions {
                names: vec!["p".into()],
            },
            Response::Checkpointed(CheckpointInfo {
                rows: 1,
                entries: 2,
                bytes: 3,
                files: vec![CheckpointFile {
                    name: "index".into(),
                    size: 4,
                    xxh3: 5,
                }],
                manifest_xxh3: 6,
                host: "h".into(),
                stored: "a/b".into(),
            }),
            Response::ShutDown {
                problems: vec!["x".into()],
            },
            Response::Error {
                code: ErrorCode::Busy,
                message: "later".into(),
            },
            Response::Challenge {
                unit_nonce: [1; 32],
                unit_proof: [2; 32],
            },
            Response::Ring { bytes: 4096 },
            Response::OnSocket,
            Response::Restore(Box::new(RestoreReply {
                host: "h".into(),
                path: "/r/a".into(),
                opened: Some(RestoreSource {
                    id: 3,
                    tcp: Some("10.0.0.1:7000".into()),
                    uds: None,
                    info: CheckpointInfo {
                        rows: 1,
                        entries: 1,
                        bytes: 1,
                        files: vec![],
                        manifest_xxh3: 2,
                        host: "h".into(),
                        stored: String::new(),
                    },
                }),
                missing: String::new(),
            })),
            Response::Restore(Box::new(RestoreReply {
                host: "h".into(),
                path: "/r/b".into(),
                opened: None,
                missing: "no directory".into(),
            })),
        ]
    }

    fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(msg: T) {
        let mut buf = Vec::new();
        encode(42, &msg, 3, &mut buf).unwrap();
        buf.extend_from_slice(b"abc");
        let (frame, used) = decode_frame::<T>(&buf, &Limits::default())
            .unwrap()
            .unwrap();
        assert_eq!(used, buf.len());
        assert_eq!(frame.envelope, Envelope { id: 42, body: msg });
        assert_eq!(frame.payload, b"abc");
        // Every strict prefix asks for more bytes, never errors or panics.
        for cut in 0..buf.len() {
            assert!(decode_frame::<T>(&buf[..cut], &Limits::default())
                .unwrap()
                .is_none());
        }
    }

    #[test]
    fn every_request_round_trips() {
        for r in all_requests() {
            r.validate(&Limits::default()).unwrap();
            round_trip(r);
        }
    }

    #[test]
    fn every_response_round_trips() {
        for r in all_responses() {
            round_trip(r);
        }
    }

    /// postcard encodes an enum variant as its index: renaming a variant
    /// keeps the protocol, moving one breaks it. The clear requests and
    /// their reply keep the places of the ReleaseRows, DropPartition and
    /// Released they were called before (protocol 7).
    #[test]
    fn variants_keep_their_encoded_index() {
        let index = |bytes: Vec<u8>| bytes[0];
        let clear_rows = Request::ClearRows {
            partition: String::new(),
            rows: vec![],
        };
        let clear_partition = Request::ClearPartition {
            partition: String::new(),
        };
        assert_eq!(index(postcard::to_stdvec(&clear_rows).unwrap()), 6);
        assert_eq!(index(postcard::to_stdvec(&clear_partition).unwrap()), 11);
        let cleared = Response::Cleared { entries: 0 };
        assert_eq!(index(postcard::to_stdvec(&cleared).unwrap()), 7);
        // The ring messages (protocol 10).
        let open = Request::OpenRing { bytes: 4096 };
        assert_eq!(index(postcard::to_stdvec(&open).unwrap()), 19);
        assert_eq!(index(postcard::to_stdvec(&Request::RingKick).unwrap()), 20);
        let ring = Response::Ring { bytes: 4096 };
        assert_eq!(index(postcard::to_stdvec(&ring).unwrap()), 18);
        assert_eq!(index(postcard::to_stdvec(&Response::OnSocket).unwrap()), 19);
        // Restores on the unit's host (protocol 11).
        let open = Request::OpenRestore { dir: String::new() };
        assert_eq!(index(postcard::to_stdvec(&open).unwrap()), 21);
        let close = Request::CloseRestore { id: 0 };
        assert_eq!(index(postcard::to_stdvec(&close).unwrap()), 22);
        let reply = Response::Restore(Box::new(RestoreReply {
            host: String::new(),
            path: String::new(),
            opened: None,
            missing: String::new(),
        }));
        assert_eq!(index(postcard::to_stdvec(&reply).unwrap()), 20);
    }

    #[test]
    fn ring_sizes_are_checked() {
        let l = Limits::default();
        for ok in [RING_MIN, 16 << 10, RING_MAX] {
            Request::OpenRing { bytes: ok }.validate(&l).unwrap();
        }
        for bad in [0, 4095, RING_MIN + 1, 12_000, RING_MAX + 4096, u32::MAX] {
            assert!(matches!(
                Request::OpenRing { bytes: bad }.validate(&l),
                Err(WireError::Malformed(_))
            ));
        }
        assert!(!Request::OpenRing { bytes: 4096 }.carries_payload());
        assert!(!Request::RingKick.carries_payload());
        assert!(!Request::RingKick.expects_reply());
        assert!(Request::OpenRing { bytes: 4096 }.expects_reply());
    }

    /// A ring entry is one frame without payload: it parses whole, and
    /// only whole.
    #[test]
    fn ring_entries_are_frames_without_payload() {
        let mut entry = Vec::new();
        encode(7, &Response::OnSocket, 0, &mut entry).unwrap();
        let (frame, used) = decode_frame::<Response>(&entry, &Limits::default())
            .unwrap()
            .unwrap();
        assert_eq!(used, entry.len());
        assert_eq!(frame.envelope.id, 7);
        assert_eq!(frame.envelope.body, Response::OnSocket);
        assert!(frame.payload.is_empty());
    }

    #[test]
    fn oversized_prefixes_are_refused_before_reading() {
        let limits = Limits {
            max_header: 100,
            max_payload: 1000,
            ..Limits::default()
        };
        let mut p = [0u8; PREFIX_LEN];
        p[..4].copy_from_slice(&101u32.to_le_bytes());
        assert_eq!(
            FramePrefix::parse(&p, &limits),
            Err(WireError::HeaderTooLarge { len: 101, max: 100 })
        );
        p[..4].copy_from_slice(&10u32.to_le_bytes());
        p[4..].copy_from_slice(&1001u64.to_le_bytes());
        assert_eq!(
            FramePrefix::parse(&p, &limits),
            Err(WireError::PayloadTooLarge {
                len: 1001,
                max: 1000
            })
        );
    }

    #[test]
    fn garbage_headers_are_malformed() {
        let mut buf = vec![0u8; PREFIX_LEN];
        buf[..4].copy_from_slice(&4u32.to_le_bytes());
        buf.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(
            decode_frame::<Request>(&buf, &Limits::default()),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn counts_are_limited() {
        let limits = Limits {
            max_keys: 2,
            max_name: 4,
            ..Limits::default()
        };
        let r = Request::ClearRows {
            partition: String::new(),
            rows: vec![1, 2, 3],
        };
        assert!(matches!(
            r.validate(&limits),
            Err(WireError::TooMany { what: "rows", .. })
        ));
        let r = Request::Resolve {
            partition: String::new(),
            keys: vec![key(1, "long-name")],
            hold: false,
        };
        assert!(r.validate(&limits).is_err());
        let r = Request::List {
            partition: "a\u{1f}b".into(),
        };
        assert!(r.validate(&limits).is_err());
        let r = Request::Alloc {
            blob: BlobId(1),
            nbytes: u64::MAX,
            n_entries: 1,
        };
        assert!(matches!(
            r.validate(&limits),
            Err(WireError::PayloadTooLarge { .. })
        ));
        let r = Request::Commit {
            blob: BlobId(1),
            partition: String::new(),
            entries: vec![EntrySpec {
                key: key(0, "f"),
                offset: u64::MAX,
                len: 2,
                meta: vec![],
            }],
        };
        assert!(matches!(r.validate(&limits), Err(WireError::Malformed(_))));
        let r = Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "a\u{1f}".into(),
            want_fd: false,
            session: None,
        };
        assert!(matches!(r.validate(&limits), Err(WireError::Malformed(_))));
    }

    #[test]
    fn handshake_frames_are_small_and_carry_no_payload() {
        let l = Limits::default().handshake();
        assert_eq!((l.max_header, l.max_payload), (1024 + 256, 0));
        // The largest Hello fits; anything with a payload does not.
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "n".repeat(1024),
            want_fd: true,
            session: Some(u128::MAX),
        };
        let mut buf = Vec::new();
        encode(u64::MAX, &hello, 0, &mut buf).unwrap();
        assert!(decode_frame::<Request>(&buf, &l).unwrap().is_some());
        let mut buf = Vec::new();
        encode(1, &Request::Stats, 1, &mut buf).unwrap();
        buf.push(0);
        assert!(matches!(
            decode_frame::<Request>(&buf, &l),
            Err(WireError::PayloadTooLarge { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = decode_frame::<Request>(&bytes, &Limits::default());
            let _ = decode_frame::<Response>(&bytes, &Limits::default());
        }
    }
}

pub mod auth;
pub mod io;
