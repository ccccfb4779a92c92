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

mod codes;
mod frame;
mod limits;
mod messages;
mod request_ref;
mod stats;
mod validation;

pub use codes::ErrorCode;
pub use frame::{decode_frame, decode_header, encode, Frame, FramePrefix, PREFIX_LEN};
pub use limits::{Limits, WireError};
pub use messages::{
    CheckpointFile, CheckpointInfo, ClaimProgress, Envelope, FailedCopy, Hop, Item, Member, Placed,
    PlaneView, Request, Response, RestoreReply, RestoreSource, RowValue, RowsResolved,
    RESERVED_PARTITION_PREFIX, RING_MAX, RING_MIN,
};
pub use request_ref::RequestRef;
pub use stats::Stats;
pub use stowage_core::home::{
    consumed_field, consumed_of, home_unit, Homes, CONSUMED_FIELD_PREFIX, GROUP_FIELD_PREFIX,
    UNIT_FIELD_PREFIX,
};
pub use stowage_core::{BlobId, EntrySpec, Key, Meta, PinId, SessionStats};
pub use validation::{MAX_HOPS, PARTITION_SEPARATOR};

/// The protocol this build speaks. A unit refuses any other. Version 3
/// added the shared-secret handshake; version 4 the traffic counters at
/// the end of [`Stats`] (an older client could not decode them); version 5
/// [`Request::CommitSpare`] and the spare counters of [`Stats`]; version 6
/// [`Request::NixlInfo`]; version 7 the client's NIXL agent in
/// [`Request::NixlInfo`] (its name and connection metadata, so that the unit
/// can fence that agent when its connections end); version 8
/// [`ErrorCode::NotOwner`] (an older client could not decode it); version 9
/// blobs in pieces ([`Response::Allocated`]'s `pieces`, [`Placed`]'s
/// `parts`), the unit's call to give spares back (`spares_back`) and the
/// allocator's and compaction's counters in [`Stats`]; version 10 request
/// rings ([`Request::OpenRing`], [`Request::RingKick`], [`Response::Ring`],
/// [`Response::OnSocket`]); version 11 checkpoints across hosts: the
/// unit's host and the part's place under its checkpoint root in
/// [`CheckpointInfo`], and restores a unit opens on its own host
/// ([`Request::OpenRestore`], [`Request::CloseRestore`],
/// [`Response::Restore`]); version 12 [`Stats`] as the core's counters
/// (one field, first) and then the server's own; version 13 claims
/// ([`Request::RegisterTasks`], [`Request::Claim`], [`Request::Settle`],
/// [`Request::ClaimStatus`] and their replies); version 14 claims in
/// checkpoint loads ([`Request::ClaimsState`], [`Request::LoadClaims`],
/// [`Response::ClaimsState`]); version 15 a resolve of every field of
/// some rows, each row and field named once ([`Request::ResolveRows`]);
/// version 16 the unit's memory outside its slab at the end of [`Stats`]
/// (`outside_slab_bytes`, `outside_slab_limit`, `outside_slab_waits`,
/// `outside_slab_cuts`; an older client could not decode them). The
/// repair requests ([`Request::OpenRepair`], [`Request::CloseRepair`],
/// [`Request::RepairPut`] and their replies) were appended within 16: no
/// variant moved, and a unit that predates them refuses them as requests
/// it cannot decode; so was [`Request::CheckpointHomes`]. Version 17:
/// claims with copies (`homes` in [`Request::Claim`] and
/// [`Request::ClaimStatus`], and in [`Response::Claimed`]). Version 18:
/// puts the unit forwards to the other copies ([`Request::ForwardPut`],
/// [`Response::Forwarded`]), and fencing a unit taken as down
/// ([`Request::Fence`], [`ErrorCode::Fenced`]). Version 19: plane views,
/// which let a restarted unit rejoin ([`Request::Epoch`],
/// [`Request::SetView`], [`Response::View`], [`ErrorCode::Stale`]).
pub const PROTOCOL_VERSION: u16 = 19;

/// Most units a [`PlaneView`] names.
pub const MAX_MEMBERS: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{de::DeserializeOwned, Serialize};

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
                entries: vec![e.clone()],
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
            Request::RegisterTasks {
                partition: "step-1".into(),
                tasks: vec!["train".into(), "reward".into()],
                samples: 512,
                group_size: 8,
            },
            Request::Claim {
                partition: "step-1".into(),
                task: "train".into(),
                fields: vec!["input_ids".into(), "advantages".into()],
                want: 64,
                wait_ms: 1000,
                homes: None,
            },
            Request::Claim {
                partition: "step-1".into(),
                task: "train".into(),
                fields: vec!["input_ids".into()],
                want: 8,
                wait_ms: 0,
                homes: Some(Homes {
                    units: 4,
                    of: vec![1, 2],
                }),
            },
            Request::Settle {
                lease: 9,
                keep: vec![1, 2, 3],
            },
            Request::ClaimStatus {
                partition: "step-1".into(),
                task: "train".into(),
                homes: None,
            },
            Request::ClaimStatus {
                partition: "step-1".into(),
                task: "train".into(),
                homes: Some(Homes {
                    units: 3,
                    of: vec![0],
                }),
            },
            Request::ClaimsState,
            Request::LoadClaims {
                state: vec![1, 0, 7],
            },
            Request::ResolveRows {
                partition: "p".into(),
                rows: vec![0, u64::MAX],
                fields: vec!["input_ids".into(), String::new()],
                hold: false,
            },
            Request::OpenRepair {
                key: "group 3".into(),
            },
            Request::CloseRepair { window: u64::MAX },
            Request::RepairPut {
                window: 4,
                blob: BlobId(11),
                partition: "p".into(),
                entries: vec![e.clone(), e],
                timeout_ms: 5_000,
            },
            Request::CheckpointHomes {
                dir: "step-1/unit-2".into(),
                units: 4,
                homes: vec![1, 2],
            },
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
                    Some(Placed {
                        offset: 64,
                        len: 10,
                        meta: vec![9u8].into(),
                        on_disk: true,
                        parts: Vec::new(),
                    }),
                    Some(Placed {
                        offset: 64,
                        len: 100,
                        meta: Meta::default(),
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
                core: stowage_core::Stats {
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
                    partitions: 23,
                    pinned_bytes: 24,
                    spares: 25,
                    spare_bytes: 26,
                    free_bytes: 1 << 20,
                    largest_free: 4096,
                    spare_budget: 65536,
                    compaction_moves: 3,
                    compaction_bytes: 12288,
                    split_blobs: 2,
                    claims: 27,
                    claim_waits: 28,
                    leases_expired: 29,
                },
                disk_write_bytes: 12,
                disk_write_micros: 13,
                disk_read_bytes: 14,
                disk_read_micros: 15,
                ops: 19,
                bytes_in: 20,
                bytes_out: 21,
                busy: 22,
                serves_nixl: true,
                page_mode: "thp".into(),
                compaction_micros: 900,
                outside_slab_bytes: 30,
                outside_slab_limit: 31,
                outside_slab_waits: 32,
                outside_slab_cuts: 33,
            })),
            Response::Data {
                items: vec![
                    Some(Item {
                        len: 3,
                        meta: Meta::default(),
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
            Response::Claimed {
                lease: 4,
                rows: vec![7, 1 << 63],
                homes: vec![],
            },
            Response::Claimed {
                lease: 5,
                rows: vec![7, 9],
                homes: vec![1, 2],
            },
            Response::Settled { rows: vec![7] },
            Response::ClaimStatus(ClaimProgress {
                registered: true,
                samples: 512,
                group_size: 8,
                consumed: 100,
                leased: 8,
            }),
            Response::ClaimsState {
                state: vec![1, 2, 3],
            },
            Response::ResolvedRows(Box::new(rows_resolved())),
            Response::RepairOpened { window: 7 },
            Response::Repaired {
                stored: 3,
                skipped: u32::MAX,
            },
        ]
    }

    /// Three values: one found (metadata [3, 1, 9]), one missing, one split.
    fn rows_resolved() -> RowsResolved {
        let mut r = RowsResolved {
            pin: Some(PinId(4)),
            missing: vec![1],
            split: vec![(2, vec![(4096, 8), (0, 8)])],
            spares_back: true,
            ..RowsResolved::default()
        };
        r.push(1 << 33, 24, &[3, 1, 9]);
        r.push(0, 0, &[]);
        r.push(4096, 16, &[3, 1, 2]);
        r
    }

    #[test]
    fn rows_resolved_reads_back_its_values_and_refuses_bad_columns() {
        let r = rows_resolved();
        let got: Vec<RowValue<'_>> = r.values().unwrap().collect();
        assert_eq!(
            got,
            [
                RowValue {
                    offset: 1 << 33,
                    len: 24,
                    meta: &[3, 1, 9]
                },
                RowValue {
                    offset: 0,
                    len: 0,
                    meta: &[]
                },
                RowValue {
                    offset: 4096,
                    len: 16,
                    meta: &[3, 1, 2]
                },
            ]
        );
        let mut short = r.clone();
        short.places.pop();
        assert!(short.values().is_err());
        let mut more = r.clone();
        more.n = 4;
        assert!(more.values().is_err());
        let mut past = r.clone();
        past.meta_ends[8..].copy_from_slice(&7u32.to_le_bytes());
        assert!(past.values().is_err(), "metadata past its column");
        let mut back = r.clone();
        back.meta_ends[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(back.values().is_err(), "metadata ending before it starts");
        let mut beyond = r;
        beyond.on_disk = vec![3];
        assert!(beyond.values().is_err(), "a position past the values");
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

    /// A borrowed Commit, Put, CommitSpare, Resolve or RepairPut is the owned one's bytes:
    /// the unit decodes it as the owned request.
    #[test]
    fn borrowed_requests_encode_as_owned_ones() {
        let mut seen = 0;
        for r in all_requests() {
            let borrowed = match &r {
                Request::Commit {
                    blob,
                    partition,
                    entries,
                } => RequestRef::Commit {
                    blob: *blob,
                    partition,
                    entries,
                },
                Request::Put {
                    blob,
                    partition,
                    entries,
                    timeout_ms,
                } => RequestRef::Put {
                    blob: *blob,
                    partition,
                    entries,
                    timeout_ms: *timeout_ms,
                },
                Request::CommitSpare {
                    blob,
                    written,
                    partition,
                    entries,
                    spare,
                    spare_nbytes,
                } => RequestRef::CommitSpare {
                    blob: *blob,
                    written: *written,
                    partition,
                    entries,
                    spare: *spare,
                    spare_nbytes: *spare_nbytes,
                },
                Request::Resolve {
                    partition,
                    keys,
                    hold,
                } => RequestRef::Resolve {
                    partition,
                    keys,
                    hold: *hold,
                },
                Request::RepairPut {
                    window,
                    blob,
                    partition,
                    entries,
                    timeout_ms,
                } => RequestRef::RepairPut {
                    window: *window,
                    blob: *blob,
                    partition,
                    entries,
                    timeout_ms: *timeout_ms,
                },
                _ => continue,
            };
            seen += 1;
            let (mut owned, mut by_ref) = (Vec::new(), Vec::new());
            encode(7, &r, 0, &mut owned).unwrap();
            encode(7, &borrowed, 0, &mut by_ref).unwrap();
            assert_eq!(by_ref, owned, "{r:?}");
            let back: Envelope<Request> = decode_header(&by_ref[PREFIX_LEN..]).unwrap();
            assert_eq!(back.body, r);
        }
        assert_eq!(seen, 5);
    }

    /// Placed and Item keep the bytes they had when their metadata was a
    /// `Vec<u8>` (protocol 14).
    #[test]
    fn inline_metadata_keeps_the_bytes_of_a_vec() {
        #[derive(Serialize)]
        struct OldPlaced {
            offset: u64,
            len: u64,
            meta: Vec<u8>,
            on_disk: bool,
            parts: Vec<(u64, u64)>,
        }
        #[derive(Serialize)]
        struct OldItem {
            len: u64,
            meta: Vec<u8>,
        }
        for meta in [vec![], vec![4, 1, 0x80, 0x04], vec![7; 33], vec![1; 300]] {
            let new = Placed {
                offset: 1 << 40,
                len: 512,
                meta: Meta::from(&meta[..]),
                on_disk: false,
                parts: vec![(64, 256), (1024, 256)],
            };
            let old = OldPlaced {
                offset: 1 << 40,
                len: 512,
                meta: meta.clone(),
                on_disk: false,
                parts: vec![(64, 256), (1024, 256)],
            };
            let bytes = postcard::to_stdvec(&old).unwrap();
            assert_eq!(postcard::to_stdvec(&new).unwrap(), bytes);
            assert_eq!(postcard::from_bytes::<Placed>(&bytes).unwrap(), new);
            let item = Item {
                len: 9,
                meta: Meta::from(&meta[..]),
            };
            let old = OldItem { len: 9, meta };
            assert_eq!(
                postcard::to_stdvec(&item).unwrap(),
                postcard::to_stdvec(&old).unwrap()
            );
        }
    }

    #[test]
    fn borrowed_rows_and_fields_encode_as_the_owned_request() {
        let rows = [3, 0, 1 << 40];
        let fields = ["input_ids", "", "mask"];
        for (rows, fields) in [
            (&rows[..], &fields[..]),
            (&rows[..0], &fields[..]),
            (&rows[..], &fields[..0]),
        ] {
            let owned = Request::ResolveRows {
                partition: "p".into(),
                rows: rows.to_vec(),
                fields: fields.iter().map(|f| f.to_string()).collect(),
                hold: true,
            };
            let borrowed = RequestRef::ResolveRows {
                partition: "p",
                rows,
                fields,
                hold: true,
            };
            let (mut a, mut b) = (Vec::new(), Vec::new());
            encode(9, &owned, 0, &mut a).unwrap();
            encode(9, &borrowed, 0, &mut b).unwrap();
            assert_eq!(a, b);
            let back: Envelope<Request> = decode_header(&b[PREFIX_LEN..]).unwrap();
            assert_eq!(back.body, owned);
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
        // Claims (protocol 13).
        let claim = Request::Claim {
            partition: String::new(),
            task: String::new(),
            fields: vec![],
            want: 1,
            wait_ms: 0,
            homes: None,
        };
        assert_eq!(index(postcard::to_stdvec(&claim).unwrap()), 24);
        let claimed = Response::Claimed {
            lease: 0,
            rows: vec![],
            homes: vec![],
        };
        assert_eq!(index(postcard::to_stdvec(&claimed).unwrap()), 21);
        // Repair windows, appended at the end (no variant moved).
        let open = Request::OpenRepair { key: String::new() };
        assert_eq!(index(postcard::to_stdvec(&open).unwrap()), 30);
        let close = Request::CloseRepair { window: 0 };
        assert_eq!(index(postcard::to_stdvec(&close).unwrap()), 31);
        let opened = Response::RepairOpened { window: 0 };
        assert_eq!(index(postcard::to_stdvec(&opened).unwrap()), 26);
        let repaired = Response::Repaired {
            stored: 0,
            skipped: 0,
        };
        assert_eq!(index(postcard::to_stdvec(&repaired).unwrap()), 27);
        // A checkpoint of some homes' rows, after the repair windows.
        let homes = Request::CheckpointHomes {
            dir: String::new(),
            units: 1,
            homes: vec![],
        };
        assert_eq!(index(postcard::to_stdvec(&homes).unwrap()), 33);
    }

    /// Only a claim that waits may wait; it never goes on a ring.
    #[test]
    fn only_a_claim_with_a_wait_may_wait() {
        let claim = |wait_ms| Request::Claim {
            partition: "p".into(),
            task: "t".into(),
            fields: vec!["f".into()],
            want: 4,
            wait_ms,
            homes: None,
        };
        assert!(claim(10).may_wait());
        assert!(!claim(0).may_wait());
        for r in all_requests() {
            assert_eq!(
                r.may_wait(),
                matches!(r, Request::Claim { wait_ms, .. } if wait_ms > 0)
            );
        }
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
        for r in all_requests() {
            assert_eq!(
                r.carries_payload(),
                matches!(r, Request::Put { .. } | Request::RepairPut { .. })
            );
        }
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
        // A grid's keys are its rows times its fields, counted without
        // overflow (2 x 2 is past 2; so is any product past usize).
        let grid = |rows: Vec<u64>, fields: &[&str]| Request::ResolveRows {
            partition: String::new(),
            rows,
            fields: fields.iter().map(|f| f.to_string()).collect(),
            hold: true,
        };
        assert!(grid(vec![1, 2], &["a"]).validate(&limits).is_ok());
        assert!(matches!(
            grid(vec![1, 2], &["a", "b"]).validate(&limits),
            Err(WireError::TooMany { what: "keys", .. })
        ));
        assert!(grid(vec![1], &["long-name"]).validate(&limits).is_err());
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
