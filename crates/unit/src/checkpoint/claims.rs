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

/// One claims state for every unit of a plane with copies, from the states
/// of a checkpoint's parts (each a unit's `ClaimsState` bytes): per partition,
/// its registration (the parts must agree on its group size), its rows in
/// the order the parts had them (each row once, the first part's place),
/// and per task the union of the rows consumed, the most rows any part
/// counted settled, and per home the most rows any part counted consumed
/// (its claimer's count, or a copy's by the marks it got). Loaded into
/// every unit, it gives each the consumption of every row it may come to
/// claim (a unit claims for another home once that home's claimer is
/// down), whichever part held it (docs/replication.md#checkpoints).
pub fn merge(states: &[&[u8]]) -> Result<Vec<u8>, String> {
    let mut out: Vec<PartitionClaims> = Vec::new();
    for state in states {
        for p in decode(state)? {
            let Some(m) = out.iter_mut().find(|m| m.partition == p.partition) else {
                out.push(p);
                continue;
            };
            if m.group_size != p.group_size {
                return Err(format!(
                    "partition {:?} has groups of {} in one part and {} in another",
                    p.partition, m.group_size, p.group_size
                ));
            }
            m.samples = m.samples.max(p.samples);
            let seen: std::collections::HashSet<u64> = m.order.iter().copied().collect();
            m.order
                .extend(p.order.into_iter().filter(|r| !seen.contains(r)));
            for t in p.tasks {
                let Some(mt) = m.tasks.iter_mut().find(|mt| mt.name == t.name) else {
                    m.tasks.push(t);
                    continue;
                };
                mt.consumed.extend(t.consumed);
                mt.consumed.sort_unstable();
                mt.consumed.dedup();
                mt.consumed_total = mt.consumed_total.max(t.consumed_total);
                for (home, n) in t.by_home {
                    match mt.by_home.iter_mut().find(|(h, _)| *h == home) {
                        Some((_, c)) => *c = (*c).max(n),
                        None => mt.by_home.push((home, n)),
                    }
                }
                mt.by_home.sort_unstable();
            }
        }
    }
    out.sort_unstable_by(|a, b| a.partition.cmp(&b.partition));
    encode(&out).map_err(|e| format!("the merged claims state: {e}"))
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

    #[test]
    fn merged_states_hold_every_parts_consumption_for_every_unit() {
        let part = |order: Vec<u64>, consumed: Vec<u64>, total, by_home: Vec<(u32, u64)>| {
            encode(&[PartitionClaims {
                partition: "p".into(),
                samples: 6,
                group_size: 1,
                order,
                tasks: vec![TaskClaims {
                    name: "train".into(),
                    consumed,
                    consumed_total: total,
                    by_home,
                }],
            }])
            .unwrap()
        };
        // Unit 0 claimed two of its rows; unit 1 one of its own, and got
        // the marks of unit 0's (it holds their copies); another task and
        // partition only on unit 1.
        let zero = part(vec![0, 2, 4], vec![0, 2], 2, vec![(0, 2)]);
        let mut one_parts =
            decode(&part(vec![1, 3, 5], vec![0, 1, 2], 1, vec![(0, 2), (1, 1)])).unwrap();
        one_parts[0].tasks.push(TaskClaims {
            name: "reward".into(),
            consumed: vec![3],
            consumed_total: 1,
            by_home: vec![(1, 1)],
        });
        one_parts.push(PartitionClaims {
            partition: "q".into(),
            samples: 1,
            group_size: 1,
            order: vec![9],
            tasks: Vec::new(),
        });
        let one = encode(&one_parts).unwrap();
        let merged = decode(&merge(&[&zero, &one]).unwrap()).unwrap();
        assert_eq!(merged.len(), 2);
        let p = &merged[0];
        assert_eq!((p.partition.as_str(), p.samples), ("p", 6));
        assert_eq!(p.order, [0, 2, 4, 1, 3, 5]);
        assert_eq!(p.tasks.len(), 2);
        let train = &p.tasks[0];
        assert_eq!(train.consumed, [0, 1, 2]);
        assert_eq!(train.consumed_total, 2);
        assert_eq!(train.by_home, [(0, 2), (1, 1)]);
        assert_eq!(p.tasks[1].consumed, [3]);
        assert_eq!(merged[1].partition, "q");
        // Merging one state changes nothing; parts that disagree on a
        // group size are refused.
        assert_eq!(
            decode(&merge(&[&zero]).unwrap()).unwrap(),
            decode(&zero).unwrap()
        );
        let mut grouped = decode(&zero).unwrap();
        grouped[0].group_size = 2;
        let grouped = encode(&grouped).unwrap();
        assert!(merge(&[&zero, &grouped])
            .unwrap_err()
            .contains("groups of 1"));
        assert!(merge(&[b"junk"]).is_err());
    }
}
