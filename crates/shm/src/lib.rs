//! # stowage-shm: slabs in shared memory
//!
//! A unit's data lives in one [`Slab`]: a memfd, sized once, mapped shared
//! by the unit and by every same-host client that received its fd over the
//! unit's Unix socket ([`send_with_fd`] / [`recv_with_fd`], SCM_RIGHTS).
//! Clients then copy bytes in and out themselves — the shm transport is
//! one-sided, no unit CPU touches the payload.
//!
//! This is the only crate of stowage with `unsafe` code, all of it in
//! [`Slab`]'s accessors. What makes it sound is an ownership protocol kept
//! by the unit core rather than by the type system: a byte range is written
//! only by the one party holding its reservation, and read only while a pin
//! keeps it from being freed or reused. Concurrent access to one range by
//! two processes can therefore only happen through a protocol bug, and
//! would corrupt bytes, not the Rust program's memory: every access goes
//! through raw copies into or out of caller-owned buffers, bounds-checked
//! against the mapping, which never shrinks (the memfd is sealed against
//! shrinking where the kernel allows).

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::MmapRaw;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// A copy above this size is split over threads (see [`Slab::write`]).
pub const PARALLEL_COPY_MIN: usize = 8 << 20;

/// Clients pre-fault mappings of slabs up to this size (page tables of
/// larger slabs cost too much per client to fill eagerly).
pub const POPULATE_MAX: u64 = 8 << 30;

/// A range outside the slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBounds {
    pub offset: u64,
    pub len: u64,
    pub slab: u64,
}

impl std::fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "range {}+{} lies outside the slab of {} bytes",
            self.offset, self.len, self.slab
        )
    }
}

impl std::error::Error for OutOfBounds {}

/// Whether the slab's pages could be locked in memory.
#[derive(Debug)]
pub enum LockOutcome {
    Locked,
    NotLocked(io::Error),
}

/// A memfd-backed, shared, read-write mapping of fixed length.
pub struct Slab {
    map: MmapRaw,
    fd: OwnedFd,
    len: usize,
}

impl Slab {
    /// Create a slab of `len` bytes (a unit's memory). Pages are allocated
    /// lazily by the kernel; [`Slab::lock`] faults them in and pins them.
    pub fn create(name: &str, len: u64) -> io::Result<Self> {
        let len_usize = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len)?;
        // A client must never see the mapping shrink under it (SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Self::map(fd, len_usize, false)
    }

    /// Map a slab whose fd a unit handed over. Slabs up to
    /// [`POPULATE_MAX`] are mapped with their page tables filled in, so
    /// that copies never stop for a first-touch fault.
    pub fn open(fd: OwnedFd) -> io::Result<Self> {
        let st = rustix::fs::fstat(&fd)?;
        let len = usize::try_from(st.st_size).map_err(|_| io::ErrorKind::InvalidData)?;
        Self::map(fd, len, len as u64 <= POPULATE_MAX)
    }

    fn map(fd: OwnedFd, len: usize, populate: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty slab"));
        }
        let mut opts = memmap2::MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        let map = opts.map_raw(&fd)?;
        Ok(Self { map, fd, len })
    }

    /// Lock the pages in RAM (mlock). Fails without CAP_IPC_LOCK or a large
    /// enough RLIMIT_MEMLOCK; the slab then works unlocked.
    pub fn lock(&self) -> LockOutcome {
        match self.map.lock() {
            Ok(()) => LockOutcome::Locked,
            Err(e) => LockOutcome::NotLocked(e),
        }
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to hand to a client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, OutOfBounds> {
        let err = OutOfBounds {
            offset,
            len: len as u64,
            slab: self.len as u64,
        };
        let start = usize::try_from(offset).map_err(|_| err)?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(err),
        }
    }

    /// Copy `src` into the slab at `offset`. Large copies are split over
    /// the machine's cores. The caller must hold the range's reservation.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), OutOfBounds> {
        let start = self.check(offset, src.len())?;
        let base = self.map.as_mut_ptr() as usize + start;
        parallel_chunks(src.len(), |off, n| {
            // SAFETY: `check` proved [start, start + len) lies inside the
            // mapping, which lives as long as `self` and never shrinks
            // (sealed). The destination is raw shared memory, not a Rust
            // reference, and `src` is a caller-owned slice that cannot
            // overlap it (the mapping is never handed out as a slice).
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(off), (base + off) as *mut u8, n);
            }
        });
        Ok(())
    }

    /// Copy from the slab at `offset` into `dst`. The caller must hold a pin
    /// (or the reservation) of the range.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        let start = self.check(offset, dst.len())?;
        let base = self.map.as_ptr() as usize + start;
        let dst_base = dst.as_mut_ptr() as usize;
        parallel_chunks(dst.len(), |off, n| {
            // SAFETY: the source range is inside the mapping (`check`); the
            // destination is the caller's exclusive slice, split into
            // disjoint chunks, one per thread; the two cannot overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (base + off) as *const u8,
                    (dst_base + off) as *mut u8,
                    n,
                );
            }
        });
        Ok(())
    }

    /// Run `f` on the slab range as a mutable slice, e.g. to read a socket
    /// straight into it. The caller must hold the range's reservation, so
    /// that no one else writes or reads it meanwhile.
    pub fn with_mut<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, OutOfBounds> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds (`check`); the reservation protocol (see the
        // crate docs) gives this caller exclusive use of the range for the
        // duration of `f`, and the slice does not escape `f`.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(start), len) };
        Ok(f(slice))
    }

    /// Run `f` on the slab range as a shared slice, e.g. to write it to a
    /// socket. The caller must hold a pin of the range.
    pub fn with_ref<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, OutOfBounds> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds (`check`); the pin keeps the range from being
        // freed or reallocated, so no writer exists for the duration of `f`.
        let slice = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(start), len) };
        Ok(f(slice))
    }

    /// Run `f` on several slab ranges at once as I/O slices, e.g. to send
    /// many values with one vectored write. The caller must hold pins of
    /// every range.
    pub fn with_io_slices<R>(
        &self,
        ranges: &[(u64, usize)],
        f: impl FnOnce(&mut [io::IoSlice<'_>]) -> R,
    ) -> Result<R, OutOfBounds> {
        let mut slices = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            let start = self.check(offset, len)?;
            // SAFETY: in bounds (`check`); pinned ranges have no writer while
            // `f` runs, and the slices do not escape `f`.
            let s = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(start), len) };
            slices.push(io::IoSlice::new(s));
        }
        Ok(f(&mut slices))
    }

    /// The slab range as a slice, for zero-copy views. The caller must hold
    /// a pin of the range for as long as the borrow lives (a view keeps both
    /// the slab and the pin).
    pub fn pinned_slice(&self, offset: u64, len: usize) -> Result<&[u8], OutOfBounds> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds (`check`) of a mapping that lives as long as
        // `self` and never shrinks; the caller's pin keeps every writer away
        // from the range while the borrow lives.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(start), len) })
    }

    /// The mapping's address, for zero-copy views that keep a pin alive.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }
}

/// Run `copy(offset, len)` over `[0, total)`: inline for small sizes, split
/// over the available cores (at most 4) for large ones.
fn parallel_chunks(total: usize, copy: impl Fn(usize, usize) + Sync) {
    let threads = if total >= PARALLEL_COPY_MIN {
        std::thread::available_parallelism()
            .map(|n| n.get().min(4))
            .unwrap_or(1)
    } else {
        1
    };
    if threads <= 1 {
        copy(0, total);
        return;
    }
    // Chunks aligned to 4 KiB so threads do not share pages at the seams.
    let chunk = total.div_ceil(threads).div_ceil(4096) * 4096;
    std::thread::scope(|s| {
        let copy = &copy;
        for i in 1..threads {
            let off = i * chunk;
            if off < total {
                s.spawn(move || copy(off, chunk.min(total - off)));
            }
        }
        copy(0, chunk.min(total));
    });
}

/// Send `bytes` with `fd` attached (SCM_RIGHTS). Returns the bytes sent,
/// which may be fewer than `bytes.len()` on a stream socket.
pub fn send_with_fd(sock: impl AsFd, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("control buffer too small for one fd"));
    }
    let n = rustix::net::sendmsg(
        sock,
        &[io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(n)
}

/// Receive into `buf`, taking the first fd that rides along, if any.
pub fn recv_with_fd(sock: impl AsFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        sock,
        &mut [io::IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // Keep the first; any extra fd is closed as it drops.
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    Ok((msg.bytes, fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn write_read_and_bounds() {
        let s = Slab::create("test", 1 << 16).unwrap();
        s.write(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        s.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(s.write((1 << 16) - 2, b"abc").is_err());
        assert!(s.read(u64::MAX, &mut out).is_err());
        s.with_mut(0, 3, |b| b.copy_from_slice(b"xyz")).unwrap();
        assert_eq!(s.with_ref(0, 3, |b| b.to_vec()).unwrap(), b"xyz");
    }

    #[test]
    fn large_copies_split_over_threads_round_trip() {
        let n = PARALLEL_COPY_MIN * 2 + 12345;
        let s = Slab::create("test", n as u64 + 64).unwrap();
        let src: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        s.write(64, &src).unwrap();
        let mut dst = vec![0u8; n];
        s.read(64, &mut dst).unwrap();
        assert!(src == dst);
    }

    #[test]
    fn fd_passing_shares_the_slab() {
        let s = Slab::create("test", 4096).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(send_with_fd(&a, b"hi", s.fd()).unwrap(), 2);
        let mut buf = [0u8; 16];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hi");
        let other = Slab::open(fd.expect("fd attached")).unwrap();
        assert_eq!(other.len(), 4096);
        s.write(10, b"shared").unwrap();
        let mut out = [0u8; 6];
        other.read(10, &mut out).unwrap();
        assert_eq!(&out, b"shared");
    }
}
