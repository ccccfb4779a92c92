//! The answers chosen once a request's bytes moved (or failed to): a put
//! whose blob file failed, a Commit of a put already gone, and the reply
//! headers of a Resolve and a Read from what was served.

use stowage_core::PinId;
use stowage_wire::{ErrorCode, Item, Placed, Response, RowsResolved};

use crate::tier::Served;

/// The answer to a put whose blob file on the disk tier failed (`e`):
/// nothing of it is kept. A full disk is a full unit (the client may wait
/// for room or go elsewhere), not a failed transfer.
pub fn disk_put_failed(e: &std::io::Error) -> (ErrorCode, String) {
    if crate::disk::is_disk_full(e) {
        (
            ErrorCode::Full,
            format!(
                "the unit's memory is full and its disk tier has no space left \
                 ({e}); nothing of this put is kept: clear rows, or give the disk \
                 tier room"
            ),
        )
    } else {
        (
            ErrorCode::Internal,
            format!("the put's blob file on the disk tier failed: {e}"),
        )
    }
}

/// A Commit's reply: a put answered Pending whose file then failed is
/// gone from the core, so an "unknown blob" answer says what happened to
/// it instead (`failed_put`: the disk tier's record of it, if any).
pub fn committed_reply(
    reply: Response,
    failed_put: impl FnOnce() -> Option<(ErrorCode, String)>,
) -> Response {
    match &reply {
        Response::Error {
            code: ErrorCode::UnknownBlob,
            ..
        } => match failed_put() {
            Some((code, message)) => Response::Error { code, message },
            None => reply,
        },
        _ => reply,
    }
}

/// The reply to a Resolve whose spilled values were brought back where
/// there was room (`served`, one per key); and the bytes it hands out of
/// the slab.
pub(crate) fn resolved_reply(
    pin: Option<PinId>,
    served: Vec<Option<Served>>,
    spares_back: bool,
) -> (Response, u64) {
    let bytes = served
        .iter()
        .map(|f| match f {
            Some(Served::Memory(l, _)) => l.len,
            Some(Served::Split(parts, _)) => parts.iter().map(|l| l.len).sum(),
            _ => 0,
        })
        .sum();
    let mut corrupt = Vec::new();
    let found = served
        .into_iter()
        .enumerate()
        .map(|(i, f)| match f? {
            Served::Memory(l, meta) => Some(Placed {
                offset: l.offset,
                len: l.len,
                meta,
                on_disk: false,
                parts: Vec::new(),
            }),
            Served::Split(parts, meta) => Some(Placed {
                offset: parts.first().map_or(0, |l| l.offset),
                len: parts.iter().map(|l| l.len).sum(),
                meta,
                on_disk: false,
                parts: parts.iter().map(|l| (l.offset, l.len)).collect(),
            }),
            Served::Disk { len, meta, .. } => Some(Placed {
                offset: 0,
                len,
                meta,
                on_disk: true,
                parts: Vec::new(),
            }),
            Served::Corrupt => {
                corrupt.push(i as u32);
                None
            }
        })
        .collect();
    (
        Response::Resolved {
            pin,
            found,
            corrupt,
            spares_back,
        },
        bytes,
    )
}

/// [`resolved_reply`] in columns, the reply to a ResolveRows: nothing
/// is built per value but its bytes in the columns.
pub(crate) fn resolved_rows_reply(
    pin: Option<PinId>,
    served: Vec<Option<Served>>,
    spares_back: bool,
) -> (Response, u64) {
    let n = served.len();
    let mut r = RowsResolved {
        pin,
        places: Vec::with_capacity(n * 16),
        metas: Vec::with_capacity(n * 8),
        meta_ends: Vec::with_capacity(n * 4),
        spares_back,
        ..RowsResolved::default()
    };
    let mut bytes = 0;
    for (i, f) in served.into_iter().enumerate() {
        let i = i as u32;
        match f {
            Some(Served::Memory(l, meta)) => {
                bytes += l.len;
                r.push(l.offset, l.len, &meta);
            }
            Some(Served::Split(parts, meta)) => {
                let len = parts.iter().map(|l| l.len).sum();
                bytes += len;
                r.push(parts.first().map_or(0, |l| l.offset), len, &meta);
                r.split
                    .push((i, parts.iter().map(|l| (l.offset, l.len)).collect()));
            }
            Some(Served::Disk { len, meta, .. }) => {
                r.push(0, len, &meta);
                r.on_disk.push(i);
            }
            Some(Served::Corrupt) => {
                r.push(0, 0, &[]);
                r.corrupt.push(i);
            }
            None => {
                r.push(0, 0, &[]);
                r.missing.push(i);
            }
        }
    }
    (Response::ResolvedRows(Box::new(r)), bytes)
}

/// The header of a Read's reply for the values `served` (one per key), and
/// the payload bytes that follow it.
pub(crate) fn data_reply(served: &[Option<Served>]) -> (Response, u64) {
    let mut corrupt = Vec::new();
    let items: Vec<Option<Item>> = served
        .iter()
        .enumerate()
        .map(|(i, s)| match s.as_ref()? {
            Served::Memory(l, meta) => Some(Item {
                len: l.len,
                meta: meta.clone(),
            }),
            Served::Split(parts, meta) => Some(Item {
                len: parts.iter().map(|l| l.len).sum(),
                meta: meta.clone(),
            }),
            Served::Disk { len, meta, .. } => Some(Item {
                len: *len,
                meta: meta.clone(),
            }),
            Served::Corrupt => {
                corrupt.push(i as u32);
                None
            }
        })
        .collect();
    let total = items.iter().flatten().map(|it| it.len).sum();
    (Response::Data { items, corrupt }, total)
}
