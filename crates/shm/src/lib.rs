//! # stowage-shm: slabs in shared memory
//!
//! A unit's data lives in one [`Slab`]: a memfd, sized once, mapped shared
//! by the unit and by every same-host client that received its fd over the
//! unit's Unix socket ([`send_with_fd`] / [`recv_with_fd`], SCM_RIGHTS).
//! Clients then copy bytes in and out themselves — the shm transport is
//! one-sided, no unit CPU touches the payload.
//!
//! stowage's `unsafe` code lives in three places, every block with a
//! `// SAFETY:` comment (the workspace denies clippy's
//! `undocumented_unsafe_blocks`); every other crate forbids `unsafe`:
//! this crate, for the slab's mapping and fd passing, the request
//! rings' shared header and entries ([`ring`]) and the page that tells a
//! forked child it is one ([`fork`]); the Python
//! extension's `arrays.rs`, `client.rs` and `read_sinks.rs`, for numpy arrays over caller
//! memory, memory Rust owns or a unit's slab; and `stowage-nixl`'s
//! `imp.rs`, which implements the nixl binding's unsafe `MemoryRegion`
//! trait for a registered slab. Here, all of it is in [`Slab`]'s accessors. No accessor hands out a Rust reference into the
//! shared mapping: every access is a raw copy between the mapping and a
//! caller-owned buffer ([`Slab::write`], [`Slab::read`], the chunked
//! copies), or a system call given a raw pointer into it
//! ([`Slab::recv_into`], [`Slab::send_pieces`]), bounds-checked against the
//! mapping, which never shrinks (the memfd is sealed against shrinking
//! where the kernel allows). Another process that maps the same slab —
//! a same-host client is trusted with the unit's memory — can therefore
//! corrupt bytes by breaking the protocol, never this program's memory.
//! Which bytes are valid is the unit core's business (fencing: a range is
//! written only by the holder of its reservation and reused only when no
//! one can still touch it). Zero-copy views get a raw address
//! ([`Slab::range_ptr`]) and read through it under their own `unsafe`.
//!
//! A unit's slab is in one of three page modes ([`Slab::create_paged`],
//! [`HugePages`], [`PageMode`]): 4 KiB pages; transparent huge pages
//! (`MADV_HUGEPAGE` on the unit's mapping, and on every client's where the
//! host grants them on request); or a hugetlb memfd (`MFD_HUGETLB`, the
//! slab rounded up to whole huge pages, which clients recognise by its
//! filesystem and map whole). A new process's copies then fill one page
//! table entry per 2 MiB instead of 512.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;
use rustix::fs::{MemfdFlags, SealFlags};

pub mod fork;
mod memfd;
mod pages;
pub mod ring;
mod socket_io;

pub(crate) use memfd::check_memfd;
use memfd::check_slab_fd;
pub use memfd::{recv_with_fd, send_with_fd};
use pages::{is_hugetlb, rounded, HostPages};
pub use pages::{HugePages, PageMode};
pub use socket_io::Piece;

/// A copy of at least this size is split over threads (see [`Slab::write`]).
/// Measured on 2 cores with the units' pollers running: a 1 MiB put copied
/// on 2 threads took 260 us against 192 us on one; from 16 MiB, 2 threads
/// win (1.3x).
pub const PARALLEL_COPY_MIN: usize = 8 << 20;

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

/// A memfd-backed, shared, read-write mapping of fixed length.
pub struct Slab {
    map: MmapRaw,
    fd: OwnedFd,
    len: usize,
    mode: PageMode,
    /// For a slab a client mapped ([`Slab::open`]): one bit per [`CHUNK`]
    /// whose page tables this process has filled (a copy, or
    /// [`Slab::prepare`]).
    chunks: Option<Box<[AtomicU64]>>,
    /// For a slab a client mapped: one bit per [`PAGE`] that
    /// [`Slab::prepare`] filled for a range too small to fill its chunk.
    pages: Option<LazyBits>,
}

/// Whether bit `i` is set.
fn is_set(bits: &[AtomicU64], i: usize) -> bool {
    bits[i / 64].load(Ordering::Relaxed) & (1u64 << (i % 64)) != 0
}

/// Set bit `i`.
fn set(bits: &[AtomicU64], i: usize) {
    bits[i / 64].fetch_or(1u64 << (i % 64), Ordering::Relaxed);
}

/// Copies at least this large through a client's mapping fill the page
/// tables of the [`CHUNK`]s they reach first.
const FILL_MIN: usize = 256 << 10;
/// The unit in which [`Slab::prepare`] fills a small range's page tables,
/// once per mapping: filling pages already mapped costs about as much as
/// faulting them (16 mapped pages took 6 us here), so it is done once.
const CHUNK: usize = 64 << 10;
/// Ranges at least this large fill whole chunks (at most 4 times their
/// own pages, once); smaller ones fill only their own pages, once.
const CHUNK_FILL_MIN: usize = CHUNK / 2;
/// The unit in which [`Slab::prepare`] remembers a small range's pages as
/// filled (the host's page, or a part of one).
const PAGE: usize = 4 << 10;

/// A bitmap in a private anonymous mapping: the kernel supplies its pages
/// zeroed as they are first touched, so a large one (a bit per 4 KiB page
/// of a slab is 32 KiB per GiB) costs memory only where bits are set.
struct LazyBits {
    map: memmap2::MmapMut,
}

impl LazyBits {
    fn new(words: usize) -> io::Result<Self> {
        let map = memmap2::MmapMut::map_anon(words.max(1) * 8)?;
        Ok(Self { map })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is private to this process, page-aligned (so
        // aligned for u64), a whole number of words long, zero-filled (a
        // valid AtomicU64 is any u64), and lives as long as `self`; it is
        // only ever accessed through this slice of atomics (nothing takes
        // `&mut` of the map after `new`).
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), self.map.len() / 8)
        }
    }
}

impl Slab {
    /// Create a slab of `len` bytes on 4 KiB pages (no huge-page advice).
    /// Pages are allocated lazily by the kernel; [`Slab::fault_in`] faults
    /// them in (and pins them). A unit uses [`Slab::create_paged`].
    pub fn create(name: &str, len: u64) -> io::Result<Self> {
        Self::create_with(name, len, PageMode::Small)
    }

    /// Create a slab of at least `len` bytes in the page mode `want` asks
    /// for (see [`HugePages`]). Returns the slab and why its mode was
    /// chosen (one line, for the unit's log; [`Slab::page_mode`] says
    /// which). With hugetlb the slab's length is `len` rounded up to the
    /// huge page size ([`Slab::len`] is the length in effect). An explicit
    /// mode the host does not offer is an [`io::ErrorKind::Unsupported`]
    /// error naming the setting to change; [`HugePages::Auto`] never fails
    /// for want of huge pages.
    pub fn create_paged(name: &str, len: u64, want: HugePages) -> io::Result<(Self, String)> {
        let host = HostPages::read();
        let unavailable = |why: String| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("huge pages mode {want} is unavailable: {why}"),
            )
        };
        match want {
            HugePages::Off => Ok((
                Self::create_with(name, len, PageMode::Small)?,
                "4 KiB pages, as asked (huge pages 4k)".into(),
            )),
            HugePages::Hugetlb => {
                host.hugetlb_fits(len).map_err(unavailable)?;
                let s = Self::create_with(name, len, PageMode::Hugetlb).map_err(|e| {
                    unavailable(format!(
                        "hugetlb pages for {len} bytes could not be had ({e}): raise /proc/sys/vm/nr_hugepages"
                    ))
                })?;
                let why = format!(
                    "hugetlb pages of {} KiB, as asked{}",
                    host.huge_size >> 10,
                    rounded(len, s.len())
                );
                Ok((s, why))
            }
            HugePages::Thp => {
                host.thp_usable().map_err(unavailable)?;
                let why = format!(
                    "transparent huge pages, as asked (shmem_enabled is {})",
                    host.shmem_enabled
                );
                Ok((Self::create_with(name, len, PageMode::Thp)?, why))
            }
            HugePages::Auto => {
                let no_hugetlb = match host.hugetlb_fits(len) {
                    Ok(()) => match Self::create_with(name, len, PageMode::Hugetlb) {
                        Ok(s) => {
                            let why = format!(
                                "hugetlb pages of {} KiB: {} free huge pages hold the slab{}",
                                host.huge_size >> 10,
                                host.huge_free,
                                rounded(len, s.len())
                            );
                            return Ok((s, why));
                        }
                        Err(e) => format!("creating a hugetlb memfd failed: {e}"),
                    },
                    Err(why) => why,
                };
                match host.thp_usable() {
                    Ok(()) => Ok((
                        Self::create_with(name, len, PageMode::Thp)?,
                        format!(
                            "transparent huge pages: shmem_enabled is {}; not hugetlb: {no_hugetlb}",
                            host.shmem_enabled
                        ),
                    )),
                    Err(no_thp) => Ok((
                        Self::create_with(name, len, PageMode::Small)?,
                        format!("4 KiB pages: not hugetlb: {no_hugetlb}; not thp: {no_thp}"),
                    )),
                }
            }
        }
    }

    fn create_with(name: &str, len: u64, mode: PageMode) -> io::Result<Self> {
        let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let mut size = len;
        if mode == PageMode::Hugetlb {
            flags |= MemfdFlags::HUGETLB;
            // A hugetlb file is sized and mapped in whole huge pages only.
            let huge = HostPages::read().huge_size.max(4096);
            size = len.div_ceil(huge).saturating_mul(huge);
        }
        let len_usize = usize::try_from(size).map_err(|_| io::ErrorKind::InvalidInput)?;
        let fd = rustix::fs::memfd_create(name, flags)?;
        rustix::fs::ftruncate(&fd, size)?;
        // A client must never see the mapping shrink under it (SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Self::map(fd, len_usize, mode)
    }

    fn map(fd: OwnedFd, len: usize, mode: PageMode) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty slab"));
        }
        let map = memmap2::MmapOptions::new().len(len).map_raw(&fd)?;
        // Transparent huge pages: a first touch maps 2 MiB at once, in the
        // unit and in every client (each advises its own mapping). Only in
        // that mode: with shmem_enabled `never` the advice still cost a
        // fresh 64 KiB put about 20 us here.
        if mode == PageMode::Thp {
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(Self {
            map,
            fd,
            len,
            mode,
            chunks: None,
            pages: None,
        })
    }

    /// The page mode of this mapping (for a client's: what its fd and the
    /// host's settings say, see [`Slab::open`]).
    pub fn page_mode(&self) -> PageMode {
        self.mode
    }

    /// Fault in the pages of `offset..offset+len` (clamped to the slab),
    /// and with `lock` pin them (mlock), without changing their contents:
    /// safe while clients copy into the same pages. A unit runs this over
    /// its whole slab in the background after it starts serving, so a
    /// large slab is ready at once and its first-touch cost is paid off
    /// the request path (or by the first puts, where they come first).
    pub fn fault_in(&self, offset: u64, len: u64, lock: bool) -> io::Result<()> {
        let start = usize::try_from(offset.min(self.len as u64)).unwrap_or(self.len);
        let end = usize::try_from(offset.saturating_add(len))
            .unwrap_or(usize::MAX)
            .min(self.len);
        if end <= start {
            return Ok(());
        }
        if lock {
            let ptr = self.map.as_mut_ptr().wrapping_add(start);
            // SAFETY: the range lies within this live mapping (clamped
            // above); mlock faults pages in and pins them, never changing
            // their contents.
            unsafe { rustix::mm::mlock(ptr.cast(), end - start) }.map_err(io::Error::from)
        } else {
            self.populate(start, end - start)
        }
    }

    /// Fill the page tables of `[start, start + len)` writable, faulting in
    /// pages that have none, without changing contents.
    fn populate(&self, start: usize, len: usize) -> io::Result<()> {
        self.map
            .advise_range(memmap2::Advice::PopulateWrite, start, len)
    }

    /// Map a slab whose fd a unit handed over, with its page tables empty:
    /// the pages fault in on first touch, or through [`Slab::fault_in`].
    ///
    /// Copies through it of 256 KiB or more ([`Slab::write`],
    /// [`Slab::read`], [`Slab::range_ptr`]) fill the page tables of the
    /// 64 KiB chunks they touch first, each run of them in one
    /// `MADV_POPULATE_WRITE` (no change to contents): one system call
    /// instead of a page fault per page, which cost 2-3 us each on this
    /// class of VM.
    ///
    /// The fd must be what a unit hands over: a memfd of exactly `len`
    /// bytes (the size its Hello announced), sealed against shrinking,
    /// growing and further sealing. Anything else (another file, a memfd
    /// that could shrink under this mapping and raise SIGBUS) is refused
    /// with [`io::ErrorKind::PermissionDenied`] naming what was wrong.
    pub fn open(fd: OwnedFd, len: u64) -> io::Result<Self> {
        check_slab_fd(&fd, len)?;
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidData)?;
        // The client cannot know the unit's mode from Hello: a hugetlb
        // memfd says so itself (its length is then whole huge pages, as
        // the unit created it); otherwise this mapping asks for
        // transparent huge pages whenever the host grants them on request,
        // so a unit in thp mode gets them in every client too.
        let mode = if is_hugetlb(&fd) {
            PageMode::Hugetlb
        } else if HostPages::read().thp_on_request() {
            PageMode::Thp
        } else {
            PageMode::Small
        };
        let mut s = Self::map(fd, len, mode)?;
        let bits = |unit: usize| -> Box<[AtomicU64]> {
            (0..len.div_ceil(unit).div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect()
        };
        s.chunks = Some(bits(CHUNK));
        // Without it (no mapping to be had) small ranges fill every time.
        s.pages = LazyBits::new(len.div_ceil(PAGE).div_ceil(64)).ok();
        Ok(s)
    }

    /// Fill the page tables of the chunks of `[start, start + len)` not
    /// filled yet, each run in one call (client mappings only; failures
    /// only cost faults). Only the chunks the copy reaches: filling whole
    /// 2 MiB regions filled twice the pages a reader used where its values
    /// lie between others' (a unit holding copies of another's rows: 1 MiB
    /// gets took 1.2 to 1.7 times as long as with one copy).
    fn fill(&self, start: usize, len: usize) {
        let Some(chunks) = &self.chunks else { return };
        if len < FILL_MIN {
            // A small copy takes the faults of the few pages it touches:
            // filling whole chunks for it cost more when many clients
            // each write a little of every chunk.
            return;
        }
        self.fill_chunk_runs(chunks, start, len);
    }

    /// Fill this mapping's page tables for `[offset, offset + len)`, about
    /// to be written (a client's spare), in one call instead of a fault
    /// per page: a range of 32 KiB or more fills the 64 KiB chunks it
    /// reaches, once each (as its copy would); a smaller one its own 4 KiB
    /// pages, once each, unless every chunk it reaches is filled already
    /// (filling a whole chunk for a few pages cost more when many clients
    /// each write a little of every chunk; filling pages already mapped
    /// cost a system call per put of a small value). A mapping that is not
    /// a client's fills exactly the range, every time. Contents never
    /// change; failures, and page tables dropped since (the unit releasing
    /// the memory), only cost faults later.
    pub fn prepare(&self, offset: u64, len: u64) {
        let (Ok(start), Ok(n)) = (self.check(offset, len as usize), usize::try_from(len)) else {
            return;
        };
        if n >= FILL_MIN {
            self.fill(start, n);
        } else if n > 0 {
            match (&self.chunks, &self.pages) {
                (Some(chunks), Some(pages)) => self.fill_chunks(chunks, pages.words(), start, n),
                _ => {
                    let _ = self.populate(start, n);
                }
            }
        }
    }

    /// [`Slab::prepare`] of a range under [`FILL_MIN`] in a client's
    /// mapping.
    fn fill_chunks(&self, chunks: &[AtomicU64], pages: &[AtomicU64], start: usize, n: usize) {
        if n < CHUNK_FILL_MIN {
            let (first, last) = (start / CHUNK, (start + n - 1) / CHUNK);
            let (p0, p1) = (start / PAGE, (start + n - 1) / PAGE);
            if (first..=last).all(|c| is_set(chunks, c)) || (p0..=p1).all(|p| is_set(pages, p)) {
                return;
            }
            let _ = self.populate(start, n);
            (p0..=p1).for_each(|p| set(pages, p));
            return;
        }
        self.fill_chunk_runs(chunks, start, n);
    }

    /// Fill the chunks `[start, start + n)` reaches that are not filled
    /// yet: each run of them in one call, then marked.
    fn fill_chunk_runs(&self, chunks: &[AtomicU64], start: usize, n: usize) {
        let (first, last) = (start / CHUNK, (start + n - 1) / CHUNK);
        let mut c = first;
        while c <= last {
            if is_set(chunks, c) {
                c += 1;
                continue;
            }
            let run = c;
            while c <= last && !is_set(chunks, c) {
                c += 1;
            }
            let at = run * CHUNK;
            let _ = self.populate(at, (c * CHUNK).min(self.len) - at);
            (run..c).for_each(|k| set(chunks, k));
        }
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Where this process maps the slab: the address a one-sided transport
    /// registers (a NIXL agent), for peers to name ranges by.
    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
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
        self.fill(start, src.len());
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

    /// Copy `len` bytes of the slab from `from` to `to` (compaction moving
    /// a blob; the ranges may overlap). The caller must hold both ranges:
    /// nobody else writes either while it copies.
    pub fn copy_within(&self, from: u64, to: u64, len: usize) -> Result<(), OutOfBounds> {
        let src = self.check(from, len)?;
        let dst = self.check(to, len)?;
        let base = self.map.as_mut_ptr() as usize;
        // SAFETY: `check` proved both ranges lie inside the mapping, which
        // lives as long as `self` and never shrinks (sealed). Both are raw
        // shared memory, never Rust references; `ptr::copy` allows them to
        // overlap.
        unsafe {
            std::ptr::copy((base + src) as *const u8, (base + dst) as *mut u8, len);
        }
        Ok(())
    }

    /// Copy `len` bytes of this slab from `from` into another slab `dst` at
    /// `to` (a unit copying a put to the next copy's unit on its host).
    /// Large copies are split over the machine's cores. The caller should
    /// hold the source range (its reservation or a pin) and must hold the
    /// destination range's reservation.
    pub fn copy_to(&self, from: u64, dst: &Slab, to: u64, len: usize) -> Result<(), OutOfBounds> {
        let src = self.check(from, len)?;
        let at = dst.check(to, len)?;
        self.fill(src, len);
        dst.fill(at, len);
        let (src, at) = (
            self.map.as_ptr() as usize + src,
            dst.map.as_mut_ptr() as usize + at,
        );
        parallel_chunks(len, |off, n| {
            // SAFETY: `check` proved both ranges lie inside their mappings,
            // which live as long as `self` and `dst` and never shrink
            // (sealed). Both are raw shared memory, never Rust references.
            // `ptr::copy` allows them to overlap: two slabs are two memfds
            // mapped apart, but a client may name the copying unit's own
            // socket, or give its source range back mid-copy (then the
            // bytes are wrong, as it could make them through its own
            // mapping, and nothing worse).
            unsafe {
                std::ptr::copy((src + off) as *const u8, (at + off) as *mut u8, n);
            }
        });
        Ok(())
    }

    /// Copy `srcs`, back to back, into the slab from `offset` (a blob's
    /// values and padding). When they add up to [`PARALLEL_COPY_MIN`] or
    /// more, the whole range is split over the machine's cores (at most 4)
    /// regardless of where one source ends, so many small values copy as
    /// fast as one large one. The caller must hold the range's reservation.
    pub fn write_gather(&self, offset: u64, srcs: &[&[u8]]) -> Result<(), OutOfBounds> {
        let total: usize = srcs.iter().map(|s| s.len()).sum();
        let start = self.check(offset, total)?;
        if total < PARALLEL_COPY_MIN {
            let mut at = offset;
            for s in srcs {
                self.write(at, s)?;
                at += s.len() as u64;
            }
            return Ok(());
        }
        self.fill(start, total);
        // Where each source starts in the range.
        let mut starts = Vec::with_capacity(srcs.len());
        let mut acc = 0usize;
        for s in srcs {
            starts.push(acc);
            acc += s.len();
        }
        let base = self.map.as_mut_ptr() as usize + start;
        parallel_chunks(total, |off, n| {
            // The sources overlapping [off, off + n).
            let mut i = starts.partition_point(|&st| st <= off).saturating_sub(1);
            let end = off + n;
            while i < srcs.len() && starts[i] < end {
                let (s, st) = (srcs[i], starts[i]);
                let from = off.max(st);
                let to = end.min(st + s.len());
                if from < to {
                    // SAFETY: [from, to) lies within [0, total), which
                    // `check` proved is inside the mapping (alive for
                    // `self`, never shrinking); `from - st .. to - st` lies
                    // within source `s`. Chunks of different threads are
                    // disjoint, and the destination is raw shared memory,
                    // never a Rust reference, so it cannot overlap `s`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            s.as_ptr().add(from - st),
                            (base + from) as *mut u8,
                            to - from,
                        );
                    }
                }
                i += 1;
            }
        });
        Ok(())
    }

    /// Copy from the slab at `offset` into `dst`. The caller must hold a pin
    /// (or the reservation) of the range.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        let start = self.check(offset, dst.len())?;
        self.fill(start, dst.len());
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

    /// Copy many ranges out of the slab, each into its own buffer (a
    /// get's values). When they add up to [`PARALLEL_COPY_MIN`] or more,
    /// the buffers are shared out over the cores by bytes (a large one
    /// still splits itself, as in [`Slab::read`]). Every range is checked
    /// before anything is copied. The caller must hold pins (or the
    /// reservations) of the ranges.
    pub fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), OutOfBounds> {
        for (offset, dst) in &reads {
            self.check(*offset, dst.len())?;
        }
        let total: usize = reads.iter().map(|r| r.1.len()).sum();
        let threads = copy_threads(total).min(reads.len());
        if threads <= 1 {
            for (offset, dst) in reads {
                self.read(offset, dst)?;
            }
            return Ok(());
        }
        let per = total.div_ceil(threads).max(1);
        let mut groups: Vec<Vec<(u64, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
        let mut acc = 0usize;
        for r in reads {
            let g = (acc / per).min(threads - 1);
            acc += r.1.len();
            groups[g].push(r);
        }
        rayon::scope(|s| {
            for group in groups {
                s.spawn(move |_| {
                    for (offset, dst) in group {
                        // In bounds: checked above.
                        let _ = self.read(offset, dst);
                    }
                });
            }
        });
        Ok(())
    }

    /// Copy `len` bytes at `offset` to `sink` in pieces of at most
    /// `buf.len()` bytes, through the caller's `buf` (e.g. to write a range
    /// to a file and checksum it: the sink never sees a reference into
    /// shared memory; a caller that copies again and again keeps one
    /// buffer instead of allocating one per copy). An empty `buf` is taken
    /// as one byte long. The caller must hold a pin (or the reservation) of
    /// the range.
    pub fn copy_out_chunked<E>(
        &self,
        offset: u64,
        len: usize,
        buf: &mut [u8],
        mut sink: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, OutOfBounds> {
        self.check(offset, len)?;
        let mut one = [0u8; 1];
        let buf = if buf.is_empty() { &mut one[..] } else { buf };
        let mut at = 0usize;
        while at < len {
            let n = (len - at).min(buf.len());
            self.read(offset + at as u64, &mut buf[..n])?;
            if let Err(e) = sink(&buf[..n]) {
                return Ok(Err(e));
            }
            at += n;
        }
        Ok(Ok(()))
    }

    /// Fill `len` bytes at `offset` from `source` in pieces of at most
    /// `chunk` bytes, through one heap buffer: `source(buf)` fills `buf`
    /// whole. The caller must hold the range's reservation.
    pub fn copy_in_chunked<E>(
        &self,
        offset: u64,
        len: usize,
        chunk: usize,
        mut source: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, OutOfBounds> {
        self.check(offset, len)?;
        let mut buf = vec![0u8; chunk.max(1).min(len.max(1))];
        let mut at = 0usize;
        while at < len {
            let n = (len - at).min(buf.len());
            if let Err(e) = source(at as u64, &mut buf[..n]) {
                return Ok(Err(e));
            }
            self.write(offset + at as u64, &buf[..n])?;
            at += n;
        }
        Ok(Ok(()))
    }

    /// The address of `[offset, offset + len)` in this mapping, for
    /// zero-copy views (numpy arrays over pinned values). Getting it is
    /// safe; reading through it is the caller's `unsafe`, sound only while
    /// a pin of the range is held and the mapping lives.
    pub fn range_ptr(&self, offset: u64, len: usize) -> Result<*const u8, OutOfBounds> {
        let start = self.check(offset, len)?;
        self.fill(start, len);
        Ok((self.map.as_ptr() as usize + start) as *const u8)
    }
}

/// Copy `src` into `dst` (equal lengths) the way the slab's copies go:
/// split over [`copy_threads`] threads of the same pool, or over `threads`
/// when given. For benchmarks: the memcpy limit at the thread count stowage
/// copies with, without a thread started per copy.
pub fn copy_split(dst: &mut [u8], src: &[u8], threads: Option<usize>) {
    assert_eq!(dst.len(), src.len(), "copy_split needs equal lengths");
    let threads = threads.unwrap_or_else(|| copy_threads(src.len())).max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads).div_ceil(4096).max(1) * 4096;
    rayon::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move |_| d.copy_from_slice(c));
        }
    });
}

/// How many threads a copy of `total` bytes is split over.
pub fn copy_threads(total: usize) -> usize {
    if total >= PARALLEL_COPY_MIN {
        rayon::current_num_threads().clamp(1, 4)
    } else {
        1
    }
}

/// Run `copy(offset, len)` over `[0, total)`: inline for small sizes, split
/// over the available cores (at most 4) for large ones, on rayon's pool
/// (no thread started per copy: that cost 20-40 us here).
fn parallel_chunks(total: usize, copy: impl Fn(usize, usize) + Sync) {
    let threads = copy_threads(total);
    if threads <= 1 {
        copy(0, total);
        return;
    }
    // Chunks aligned to 4 KiB so threads do not share pages at the seams.
    let chunk = total.div_ceil(threads).div_ceil(4096) * 4096;
    rayon::scope(|s| {
        let copy = &copy;
        for i in 1..threads {
            let off = i * chunk;
            if off < total {
                s.spawn(move |_| copy(off, chunk.min(total - off)));
            }
        }
        copy(0, chunk.min(total));
    });
}

#[cfg(test)]
mod tests;
