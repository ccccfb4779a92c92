//! The `claims` file of a checkpoint: the claims state of every registered
//! partition ([`stowage_core::PartitionClaims`]), taken with the entries in
//! one step of the core.
//!
//! ```text
//!  claims   postcard: its version (a varint), then each partition's name, samples,
//!           group size, rows in claim order, and per task its name, consumed rows,
//!           consumed count and (version 2) its counts of rows consumed per home
//! ```
//!
//! Version 1 (no counts per home) is read too: its counts per home are none.
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
/// The version this build writes (it reads 1 too).
const VERSION: u32 = 2;
/// Largest claims file a restore reads.
pub(super) const MAX_CLAIMS: u64 = 4 << 30;

#[derive(Serialize, Deserialize)]
struct SavedPart<T> {
    partition: String,
    samples: u64,
    group_size: u32,
    order: Vec<u64>,
    tasks: Vec<T>,
}

#[derive(Serialize, Deserialize)]
struct SavedTask {
    name: String,
    consumed: Vec<u64>,
    consumed_total: u64,
    by_home: Vec<(u32, u64)>,
}

/// A task as version 1 saved it.
#[derive(Serialize, Deserialize)]
struct SavedTaskV1 {
    name: String,
    consumed: Vec<u64>,
    consumed_total: u64,
}

impl From<SavedTaskV1> for SavedTask {
    fn from(t: SavedTaskV1) -> Self {
        SavedTask {
            name: t.name,
            consumed: t.consumed,
            consumed_total: t.consumed_total,
            by_home: Vec::new(),
        }
    }
}

/// The parts of `rest` (after the version), each task read as `T`.
fn take_parts<T>(rest: &[u8]) -> Result<Vec<SavedPart<SavedTask>>, String>
where
    T: for<'de> Deserialize<'de> + Into<SavedTask>,
{
    let (saved, left) = postcard::take_from_bytes::<Vec<SavedPart<T>>>(rest)
        .map_err(|e| format!("{CLAIMS} unreadable: {e}"))?;
    if !left.is_empty() {
        return Err(format!("{CLAIMS} has {} bytes past its end", left.len()));
    }
    Ok(saved
        .into_iter()
        .map(|p| SavedPart {
            partition: p.partition,
            samples: p.samples,
            group_size: p.group_size,
            order: p.order,
            tasks: p.tasks.into_iter().map(Into::into).collect(),
        })
        .collect())
}

/// The file's bytes for `parts`.
pub(crate) fn encode(parts: &[PartitionClaims]) -> Result<Vec<u8>, postcard::Error> {
    let saved: Vec<SavedPart<SavedTask>> = parts
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
                    by_home: t.by_home.clone(),
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
    let saved = match version {
        1 => take_parts::<SavedTaskV1>(rest)?,
        VERSION => take_parts::<SavedTask>(rest)?,
        _ => {
            return Err(format!(
                "{CLAIMS} has version {version} (this build reads 1 and {VERSION})"
            ))
        }
    };
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
                    by_home: t.by_home,
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
                by_home: vec![(0, 2), (3, 1)],
            }],
        }];
        let bytes = encode(&parts).unwrap();
        assert_eq!(decode(&bytes).unwrap(), parts);
        // A version 1 file reads with no counts per home.
        let v1 = vec![SavedPart {
            partition: "p".to_owned(),
            samples: 8,
            group_size: 2,
            order: vec![3, 1, 2],
            tasks: vec![SavedTaskV1 {
                name: "train".into(),
                consumed: vec![1, 3],
                consumed_total: 5,
            }],
        }];
        let mut old = postcard::to_allocvec(&1u32).unwrap();
        old.extend_from_slice(&postcard::to_allocvec(&v1).unwrap());
        let mut want = parts.clone();
        want[0].tasks[0].by_home.clear();
        assert_eq!(decode(&old).unwrap(), want);
        let mut other = postcard::to_allocvec(&(VERSION + 1)).unwrap();
        other.extend_from_slice(&bytes[1..]);
        assert!(decode(&other).unwrap_err().contains("version"));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
