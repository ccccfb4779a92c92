//! Bounds a frame is checked against while it is parsed, and why a
//! frame could not be parsed.

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
