//! The `claims` file of a checkpoint: the claims state of every registered
//! partition ([`stowage_core::PartitionClaims`]), taken with the entries in
//! one step of the core.
//!
//! ```text
//!  claims   postcard: its version (a varint), then each partition's name, samples,
//!           group size, rows in claim order, and per task its name, consumed rows
//!           and consumed count
//! ```
//!
//! It is listed in the manifest (size and xxh3) like every other file,
//! checked with them before anything is restored, and put back
//! ([`stowage_core::input::RestoreClaims`]) after the entries, so that the
//! rows it names are stored again. A checkpoint without it (written
//! before claims were kept) restores with no partition registered.
//! Leases in flight when the checkpoint was taken are not consumption:
//! their rows are claimable again after a restore. Waiting claims are not
//! kept.

use serde::{Deserialize, Serialize};
use stowage_core::{PartitionClaims, TaskClaims};

/// The file's name in the checkpoint directory.
pub(super) const CLAIMS: &str = "claims";
/// The version this build writes and reads.
const VERSION: u32 = 1;
/// Largest claims file a restore reads.
pub(super) const MAX_CLAIMS: u64 = 4 << 30;

#[derive(Serialize, Deserialize)]
struct SavedPart {
    partition: String,
    samples: u64,
    group_size: u32,
    order: Vec<u64>,
    tasks: Vec<SavedTask>,
}

#[derive(Serialize, Deserialize)]
struct SavedTask {
    name: String,
    consumed: Vec<u64>,
    consumed_total: u64,
}

/// The file's bytes for `parts`.
pub(crate) fn encode(parts: &[PartitionClaims]) -> Result<Vec<u8>, postcard::Error> {
    let saved: Vec<SavedPart> = parts
        .iter()
        .map(|p| SavedPart {
            partition: p.partition.clone(),
            samples: p.samples,
            group_size: p.group_size,
            order: p.order.clone(),
            tasks: p
                .tasks
                .iter()
                .map(|t| SavedTask {
                    name: t.name.clone(),
                    consumed: t.consumed.clone(),
                    consumed_total: t.consumed_total,
                })
                .collect(),
        })
        .collect();
    let mut out = postcard::to_allocvec(&VERSION)?;
    out.extend_from_slice(&postcard::to_allocvec(&saved)?);
    Ok(out)
}

/// The claims state in the file's `bytes`; why not, when they are not one
/// this build reads.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<PartitionClaims>, String> {
    let (version, rest) =
        postcard::take_from_bytes::<u32>(bytes).map_err(|e| format!("{CLAIMS} unreadable: {e}"))?;
    if version != VERSION {
        return Err(format!(
            "{CLAIMS} has version {version} (this build reads {VERSION})"
        ));
    }
    let (saved, left) = postcard::take_from_bytes::<Vec<SavedPart>>(rest)
        .map_err(|e| format!("{CLAIMS} unreadable: {e}"))?;
    if !left.is_empty() {
        return Err(format!("{CLAIMS} has {} bytes past its end", left.len()));
    }
    Ok(saved
        .into_iter()
        .map(|p| PartitionClaims {
            partition: p.partition,
            samples: p.samples,
            group_size: p.group_size,
            order: p.order,
            tasks: p
                .tasks
                .into_iter()
                .map(|t| TaskClaims {
                    name: t.name,
                    consumed: t.consumed,
                    consumed_total: t.consumed_total,
                })
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claims_file_round_trips_and_refuses_another_version() {
        let parts = vec![PartitionClaims {
            partition: "p".into(),
            samples: 8,
            group_size: 2,
            order: vec![3, 1, 2],
            tasks: vec![TaskClaims {
                name: "train".into(),
                consumed: vec![1, 3],
                consumed_total: 5,
            }],
        }];
        let bytes = encode(&parts).unwrap();
        assert_eq!(decode(&bytes).unwrap(), parts);
        let mut other = postcard::to_allocvec(&(VERSION + 1)).unwrap();
        other.extend_from_slice(&bytes[1..]);
        assert!(decode(&other).unwrap_err().contains("version"));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
