//! [`RequestRef`]: requests that borrow what they carry, encoded as the
//! owned [`Request`] of the same name.

use serde::Serialize;

#[cfg(doc)]
use crate::Request;
use crate::{BlobId, EntrySpec, Hop, Key};

/// A [`Request`] that carries a put's entries, or a resolve's keys, by
/// reference: it encodes to exactly the bytes of the [`Request`] variant
/// of the same name (the unit decodes it as that), without copying every
/// entry's key and metadata first. For calls of many values.
#[derive(Clone, Copy, Debug)]
pub enum RequestRef<'a> {
    /// [`Request::Commit`].
    Commit {
        blob: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
    },
    /// [`Request::Put`].
    Put {
        blob: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
        timeout_ms: u64,
    },
    /// [`Request::Resolve`].
    Resolve {
        partition: &'a str,
        keys: &'a [Key],
        hold: bool,
    },
    /// [`Request::ResolveRows`], from borrowed rows and field names.
    ResolveRows {
        partition: &'a str,
        rows: &'a [u64],
        fields: &'a [&'a str],
        hold: bool,
    },
    /// [`Request::CommitSpare`].
    CommitSpare {
        blob: BlobId,
        written: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
        spare: BlobId,
        spare_nbytes: u64,
    },
    /// [`Request::RepairPut`].
    RepairPut {
        window: u64,
        blob: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
        timeout_ms: u64,
    },
    /// [`Request::ForwardPut`].
    ForwardPut {
        blob: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
        timeout_ms: u64,
        to: &'a [Hop],
        hop: u8,
    },
    /// [`Request::CopyReserved`].
    CopyReserved {
        blob: BlobId,
        partition: &'a str,
        entries: &'a [EntrySpec],
        timeout_ms: u64,
        to: &'a [Hop],
    },
}

impl RequestRef<'_> {
    /// The index serde gives the variant in [`Request`] (its place in the
    /// enum; `borrowed_requests_encode_as_owned_ones` checks each).
    fn variant(&self) -> (u32, &'static str) {
        match self {
            RequestRef::Commit { .. } => (2, "Commit"),
            RequestRef::Resolve { .. } => (4, "Resolve"),
            RequestRef::Put { .. } => (8, "Put"),
            RequestRef::CommitSpare { .. } => (17, "CommitSpare"),
            RequestRef::ResolveRows { .. } => (29, "ResolveRows"),
            RequestRef::RepairPut { .. } => (32, "RepairPut"),
            RequestRef::ForwardPut { .. } => (34, "ForwardPut"),
            RequestRef::CopyReserved { .. } => (38, "CopyReserved"),
        }
    }
}

impl Serialize for RequestRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStructVariant;
        let (index, name) = self.variant();
        match *self {
            RequestRef::Commit {
                blob,
                partition,
                entries,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 3)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.end()
            }
            RequestRef::Put {
                blob,
                partition,
                entries,
                timeout_ms,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 4)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.serialize_field("timeout_ms", &timeout_ms)?;
                v.end()
            }
            RequestRef::Resolve {
                partition,
                keys,
                hold,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 3)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("keys", keys)?;
                v.serialize_field("hold", &hold)?;
                v.end()
            }
            RequestRef::ResolveRows {
                partition,
                rows,
                fields,
                hold,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 4)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("rows", rows)?;
                v.serialize_field("fields", fields)?;
                v.serialize_field("hold", &hold)?;
                v.end()
            }
            RequestRef::CommitSpare {
                blob,
                written,
                partition,
                entries,
                spare,
                spare_nbytes,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 6)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("written", &written)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.serialize_field("spare", &spare)?;
                v.serialize_field("spare_nbytes", &spare_nbytes)?;
                v.end()
            }
            RequestRef::RepairPut {
                window,
                blob,
                partition,
                entries,
                timeout_ms,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 5)?;
                v.serialize_field("window", &window)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.serialize_field("timeout_ms", &timeout_ms)?;
                v.end()
            }
            RequestRef::ForwardPut {
                blob,
                partition,
                entries,
                timeout_ms,
                to,
                hop,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 6)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.serialize_field("timeout_ms", &timeout_ms)?;
                v.serialize_field("to", to)?;
                v.serialize_field("hop", &hop)?;
                v.end()
            }
            RequestRef::CopyReserved {
                blob,
                partition,
                entries,
                timeout_ms,
                to,
            } => {
                let mut v = s.serialize_struct_variant("Request", index, name, 5)?;
                v.serialize_field("blob", &blob)?;
                v.serialize_field("partition", partition)?;
                v.serialize_field("entries", entries)?;
                v.serialize_field("timeout_ms", &timeout_ms)?;
                v.serialize_field("to", to)?;
                v.end()
            }
        }
    }
}
