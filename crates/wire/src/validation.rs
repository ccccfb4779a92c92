//! What a request may hold: counts and name lengths checked against
//! [`Limits`] once it is decoded.

use crate::{Limits, Request, WireError, RING_MAX, RING_MIN};

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
        let homes = |h: &Option<crate::Homes>| match h {
            None => Ok(()),
            Some(h) if h.units == 0 || h.of.iter().any(|&u| u >= h.units) => {
                Err(WireError::Malformed(format!(
                    "homes {:?} are not units of a plane of {}",
                    h.of, h.units
                )))
            }
            Some(h) => count("homes", h.of.len()),
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
            }
            | Request::RepairPut {
                entries,
                partition: p,
                ..
            }
            | Request::ForwardPut {
                entries,
                partition: p,
                ..
            }
            | Request::CopyReserved {
                entries,
                partition: p,
                ..
            } => {
                if let Request::ForwardPut { to, hop, .. } = self {
                    hops(to, *hop, Reach::Tcp)?;
                }
                if let Request::CopyReserved { to, .. } = self {
                    hops(to, 0, Reach::Unix)?;
                }
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
            Request::ResolveRows {
                partition: p,
                rows,
                fields,
                ..
            } => {
                partition(p)?;
                count("keys", rows.len().saturating_mul(fields.len()))?;
                fields.iter().try_for_each(|f| name("field name bytes", f))
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
            Request::CheckpointHomes { dir, homes, .. } => {
                name("checkpoint path bytes", dir)?;
                count("homes", homes.len())
            }
            Request::Shutdown { .. } => Ok(()),
            Request::OpenRepair { key } => name("repair key bytes", key),
            Request::RegisterTasks {
                partition: p,
                tasks,
                ..
            } => {
                partition(p)?;
                count("tasks", tasks.len())?;
                tasks.iter().try_for_each(|t| name("task name bytes", t))
            }
            Request::Claim {
                partition: p,
                task,
                fields,
                homes: h,
                ..
            } => {
                partition(p)?;
                homes(h)?;
                name("task name bytes", task)?;
                count("fields", fields.len())?;
                fields.iter().try_for_each(|f| name("field name bytes", f))
            }
            Request::Settle { keep, .. } => count("rows", keep.len()),
            Request::LoadClaims { .. } | Request::ClaimsState => Ok(()),
            Request::ClaimStatus {
                partition: p,
                task,
                homes: h,
            } => {
                partition(p)?;
                homes(h)?;
                name("task name bytes", task)
            }
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
            | Request::CloseRestore { .. }
            | Request::CloseRepair { .. }
            | Request::Fence { .. }
            | Request::Epoch { .. } => Ok(()),
            Request::SetView { view } => {
                if view.members.len() > crate::MAX_MEMBERS {
                    return Err(WireError::Malformed(format!(
                        "a plane view of {} units: at most {} are named",
                        view.members.len(),
                        crate::MAX_MEMBERS
                    )));
                }
                Ok(())
            }
        }
    }

    /// Whether the request reads or writes rows, so that a unit serves it
    /// only on a connection that speaks for the unit's view of the plane
    /// ([`Request::Epoch`]): everything but the connection's set-up, the
    /// unit's statistics and administration, and letting go of what the
    /// connection holds (aborts, unpins, a repair window's close).
    pub fn needs_view(&self) -> bool {
        !matches!(
            self,
            Request::Hello { .. }
                | Request::Auth { .. }
                | Request::Prove { .. }
                | Request::Abort { .. }
                | Request::Unpin { .. }
                | Request::Stats
                | Request::Shutdown { .. }
                | Request::NixlInfo { .. }
                | Request::OpenRing { .. }
                | Request::RingKick
                | Request::OpenRestore { .. }
                | Request::CloseRestore { .. }
                | Request::CloseRepair { .. }
                | Request::Fence { .. }
                | Request::Epoch { .. }
                | Request::SetView { .. }
        )
    }

    /// Whether a frame of this request may carry a payload (only
    /// [`Request::Put`]'s, [`Request::RepairPut`]'s and
    /// [`Request::ForwardPut`]'s do; any other with
    /// a payload is invalid).
    pub fn carries_payload(&self) -> bool {
        matches!(
            self,
            Request::Put { .. } | Request::RepairPut { .. } | Request::ForwardPut { .. }
        )
    }

    /// Whether the answer may wait for other clients (a [`Request::Claim`]
    /// with a wait): such a request never goes on a request ring, whose
    /// replies come back in order.
    pub fn may_wait(&self) -> bool {
        matches!(self, Request::Claim { wait_ms, .. } if *wait_ms > 0)
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

/// The most copies a [`Request::ForwardPut`] forwards to, down its
/// whole chain.
pub const MAX_HOPS: usize = 7;

/// A [`Request::ForwardPut`]'s copies: 1 to [`MAX_HOPS`] with the hops
/// before it, each a distinct unit at an `ip:port` address.
/// How the copies of a forwarded put are reached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Over tcp, at `ip:port` ([`Request::ForwardPut`]).
    Tcp,
    /// Over a Unix socket of this host, at an absolute path
    /// ([`Request::CopyReserved`]).
    Unix,
}

/// Most bytes of a Unix socket's path (`sun_path`, its NUL included).
const UNIX_PATH_MAX: usize = 107;

fn hops(to: &[crate::Hop], hop: u8, reach: Reach) -> Result<(), WireError> {
    if to.is_empty() || to.len() + usize::from(hop) > MAX_HOPS {
        return Err(WireError::Malformed(format!(
            "a forwarded put to {} copies at hop {hop}: 1 to {MAX_HOPS} copies down a chain",
            to.len()
        )));
    }
    for (i, h) in to.iter().enumerate() {
        let reachable = match reach {
            Reach::Tcp => h.addr.len() <= 64 && h.addr.parse::<std::net::SocketAddr>().is_ok(),
            Reach::Unix => {
                h.addr.len() <= UNIX_PATH_MAX && h.addr.starts_with('/') && !h.addr.contains('\0')
            }
        };
        if !reachable {
            return Err(WireError::Malformed(format!(
                "copy {} of a forwarded put is not at {}",
                h.unit,
                match reach {
                    Reach::Tcp => "an ip:port address",
                    Reach::Unix => "the absolute path of a Unix socket",
                }
            )));
        }
        if to[..i].iter().any(|o| o.unit == h.unit) {
            return Err(WireError::Malformed(format!(
                "unit {} named twice in a forwarded put",
                h.unit
            )));
        }
    }
    Ok(())
}

/// Separates namespace and partition in the unit's index; not allowed in
/// partition names.
pub const PARTITION_SEPARATOR: char = '\u{1f}';
