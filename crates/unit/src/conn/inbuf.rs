//! A connection's input buffer: bytes read from its socket and not yet
//! taken. Its memory is taken when bytes arrive and given back once they
//! are all taken, so an idle connection holds none (thousands of idle
//! sessions cost their sockets, not their buffers).
//!
//! The serving threads fill it without blocking ([`InBuf::recv_ready`]);
//! the blocking pool reads through it as a reader of the socket would
//! (`Read`/`BufRead`, bounded by the [`SpinReader`]'s deadline).

use std::io::{self, BufRead, Read};
use std::os::fd::AsFd;

use stowage_wire::io::SpinReader;
use stowage_wire::{FramePrefix, Limits, PREFIX_LEN};

/// Bytes one non-blocking read asks for at most.
const READ_STEP: usize = 64 << 10;
/// The buffer a blocking fill asks for.
const FILL: usize = 64 << 10;

pub(crate) struct InBuf {
    pub(crate) src: SpinReader,
    buf: Vec<u8>,
    pos: usize,
}

/// What the buffer holds of the next frame.
pub(crate) enum Next {
    /// Nothing.
    Empty,
    /// Part of a frame.
    Partial,
    /// A whole prefix and header (or a prefix the limits refuse): reading
    /// them takes no socket read.
    Frame,
}

impl InBuf {
    pub(crate) fn new(src: SpinReader) -> Self {
        Self {
            src,
            buf: Vec::new(),
            pos: 0,
        }
    }

    pub(crate) fn get_mut(&mut self) -> &mut SpinReader {
        &mut self.src
    }

    /// The bytes read and not yet taken.
    pub(crate) fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// Give the memory back when every byte was taken.
    pub(crate) fn release_if_empty(&mut self) {
        if self.pos >= self.buf.len() {
            self.buf = Vec::new();
            self.pos = 0;
        }
    }

    /// The bytes of memory it holds.
    pub(crate) fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// A buffer grown past `keep` by a large frame that was taken: give
    /// the memory back, keeping only the bytes not taken yet.
    pub(crate) fn shrink(&mut self, keep: usize) {
        if self.buf.capacity() > keep && self.buf.len() - self.pos <= keep / 2 {
            self.buf.drain(..self.pos);
            self.pos = 0;
            if self.buf.is_empty() {
                self.buf = Vec::new();
            } else {
                self.buf.shrink_to_fit();
            }
        }
    }

    /// The bytes of the frame at the front (its prefix and header) once
    /// its prefix is here; 0 before, or when the limits refuse it.
    pub(crate) fn frame_len(&self, limits: &Limits) -> usize {
        let b = self.buffer();
        let Some(prefix) = b.get(..PREFIX_LEN) else {
            return 0;
        };
        let mut p = [0u8; PREFIX_LEN];
        p.copy_from_slice(prefix);
        match FramePrefix::parse(&p, limits) {
            Ok(f) => PREFIX_LEN + f.header_len as usize,
            Err(_) => 0,
        }
    }

    /// How many bytes the next [`InBuf::recv_ready`] asks for, and the
    /// capacity the buffer has then: it grows by doubling, never past
    /// the frame at its front (`frame`, when known), so a header takes
    /// memory as its bytes come and no more than it needs.
    pub(crate) fn plan_read(&self, want: usize, frame: usize) -> (usize, usize) {
        let kept = self.buf.len() - self.pos;
        let step = want.max(4096).min(READ_STEP.max(kept));
        let need = kept + step;
        let cap = self.buf.capacity();
        if need <= cap {
            return (step, cap);
        }
        let mut grown = need.max(cap.saturating_mul(2));
        if frame > need {
            grown = grown.min(frame);
        } else {
            grown = need;
        }
        (step, grown)
    }

    /// What the buffered bytes hold of the next frame under `limits`.
    pub(crate) fn next(&self, limits: &Limits) -> Next {
        let b = self.buffer();
        if b.is_empty() {
            return Next::Empty;
        }
        let Some(prefix) = b.get(..PREFIX_LEN) else {
            return Next::Partial;
        };
        let mut p = [0u8; PREFIX_LEN];
        p.copy_from_slice(prefix);
        match FramePrefix::parse(&p, limits) {
            // The reader refuses it from the buffer.
            Err(_) => Next::Frame,
            Ok(f) if b.len() - PREFIX_LEN >= f.header_len as usize => Next::Frame,
            Ok(_) => Next::Partial,
        }
    }

    /// Read what the socket has now, without blocking: `Ok(0)` is the end
    /// of the stream, `WouldBlock` that nothing is there. At most
    /// `READ_STEP` bytes, or as many as it holds already (a large header
    /// takes memory as its bytes come, never as its prefix announces).
    /// `plan`: what [`InBuf::plan_read`] said (the bytes to ask for, the
    /// capacity to grow to).
    pub(crate) fn recv_ready(&mut self, (step, cap): (usize, usize)) -> io::Result<usize> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let at = self.buf.len();
        if cap > self.buf.capacity() {
            self.buf.reserve_exact(cap - at);
        }
        self.buf.resize(at + step, 0);
        let got = rustix::net::recv(
            self.src.socket.as_fd(),
            &mut self.buf[at..],
            rustix::net::RecvFlags::DONTWAIT,
        );
        match got {
            Ok((n, _)) => {
                self.buf.truncate(at + n);
                Ok(n)
            }
            Err(e) => {
                self.buf.truncate(at);
                if self.buf.is_empty() {
                    self.buf = Vec::new();
                }
                Err(e.into())
            }
        }
    }

    /// Bytes the frame at the front still lacks (its prefix, then its
    /// header), to size the next read; 0 when unknown.
    pub(crate) fn lacking(&self, limits: &Limits) -> usize {
        let b = self.buffer();
        let Some(prefix) = b.get(..PREFIX_LEN) else {
            return PREFIX_LEN - b.len();
        };
        let mut p = [0u8; PREFIX_LEN];
        p.copy_from_slice(prefix);
        match FramePrefix::parse(&p, limits) {
            Ok(f) => (PREFIX_LEN + f.header_len as usize).saturating_sub(b.len()),
            Err(_) => 0,
        }
    }
}

impl Read for InBuf {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.buf.len() && out.len() >= FILL {
            // A large read goes straight from the socket.
            return self.src.read(out);
        }
        let n = {
            let b = self.fill_buf()?;
            let n = b.len().min(out.len());
            out[..n].copy_from_slice(&b[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for InBuf {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos >= self.buf.len() {
            self.buf.resize(FILL, 0);
            self.pos = 0;
            match self.src.read(&mut self.buf) {
                Ok(n) => self.buf.truncate(n),
                Err(e) => {
                    self.buf.clear();
                    return Err(e);
                }
            }
        }
        Ok(&self.buf[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.buf.len());
    }
}
