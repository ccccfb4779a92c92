//! Frames: the prefix, encoding a header, and parsing one.

use serde::{de::DeserializeOwned, Serialize};

use crate::{Envelope, Limits, WireError};

/// Bytes of the frame prefix.
pub const PREFIX_LEN: usize = 12;

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
