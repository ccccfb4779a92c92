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
//! extension's `arrays.rs` and `client.rs`, for numpy arrays over caller
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
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

pub mod fork;
pub mod ring;

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
    /// For a slab a client mapped ([`Slab::open`]): one bit per
    /// [`REGION`] whose page tables this process has filled.
    filled: Option<Box<[AtomicU64]>>,
    /// For a slab a client mapped: one bit per [`CHUNK`] whose page tables
    /// [`Slab::prepare`] has filled (a filled region's chunks count too).
    chunks: Option<Box<[AtomicU64]>>,
    /// For a slab a client mapped: one bit per [`PAGE`] that
    /// [`Slab::prepare`] filled for a range too small to fill its chunk.
    pages: Option<LazyBits>,
}

/// The unit in which a client's mapping fills its page tables.
const REGION: usize = 2 << 20;
/// Copies at least this large fill the page tables of their regions first.
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
            filled: None,
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
    /// [`Slab::read`], [`Slab::range_ptr`]) fill the page tables of each
    /// 2 MiB region they touch first, in one `MADV_POPULATE_WRITE` (no
    /// change to contents): one system call instead of up to 512 page
    /// faults, which cost 2-3 us each on this class of VM.
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
        s.filled = Some(bits(REGION));
        s.chunks = Some(bits(CHUNK));
        // Without it (no mapping to be had) small ranges fill every time.
        s.pages = LazyBits::new(len.div_ceil(PAGE).div_ceil(64)).ok();
        Ok(s)
    }

    /// Fill the page tables of the regions of `[start, start + len)` not
    /// filled yet (client mappings only; failures only cost faults).
    fn fill(&self, start: usize, len: usize) {
        let Some(bits) = &self.filled else { return };
        if len < FILL_MIN {
            // A small copy takes the faults of the few pages it touches:
            // filling whole regions for it cost more when many clients
            // each write a little of every region.
            return;
        }
        for r in start / REGION..=(start + len - 1) / REGION {
            let (word, bit) = (r / 64, 1u64 << (r % 64));
            if bits[word].load(Ordering::Relaxed) & bit != 0 {
                continue;
            }
            let at = r * REGION;
            let _ = self.populate(at, REGION.min(self.len - at));
            bits[word].fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// Fill this mapping's page tables for `[offset, offset + len)`, about
    /// to be written (a client's spare), in one call instead of a fault
    /// per page: a range of 256 KiB or more fills the 2 MiB regions it
    /// reaches, once each (as its copy would); one of 32 KiB or more the
    /// 64 KiB chunks it reaches, once each; a smaller one its own 4 KiB
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
            match (&self.filled, &self.chunks, &self.pages) {
                (Some(regions), Some(chunks), Some(pages)) => {
                    self.fill_chunks(regions, chunks, pages.words(), start, n)
                }
                _ => {
                    let _ = self.populate(start, n);
                }
            }
        }
    }

    /// [`Slab::prepare`] of a range under [`FILL_MIN`] in a client's
    /// mapping. A chunk counts as filled when its bit is set or its region
    /// was filled.
    fn fill_chunks(
        &self,
        regions: &[AtomicU64],
        chunks: &[AtomicU64],
        pages: &[AtomicU64],
        start: usize,
        n: usize,
    ) {
        let is_set = |bits: &[AtomicU64], i: usize| {
            bits[i / 64].load(Ordering::Relaxed) & (1u64 << (i % 64)) != 0
        };
        let set = |bits: &[AtomicU64], i: usize| {
            bits[i / 64].fetch_or(1u64 << (i % 64), Ordering::Relaxed);
        };
        let filled = |c: usize| is_set(chunks, c) || is_set(regions, c * CHUNK / REGION);
        let (first, last) = (start / CHUNK, (start + n - 1) / CHUNK);
        if n < CHUNK_FILL_MIN {
            let (p0, p1) = (start / PAGE, (start + n - 1) / PAGE);
            if (first..=last).all(filled) || (p0..=p1).all(|p| is_set(pages, p)) {
                return;
            }
            let _ = self.populate(start, n);
            (p0..=p1).for_each(|p| set(pages, p));
            return;
        }
        // Each run of chunks not filled yet, in one call, then marked.
        let mut c = first;
        while c <= last {
            if filled(c) {
                c += 1;
                continue;
            }
            let run = c;
            while c <= last && !filled(c) {
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

    /// Copy `len` bytes at `offset` to `sink` in pieces of at most `chunk`
    /// bytes, through one heap buffer (e.g. to write a range to a file and
    /// checksum it: the sink never sees a reference into shared memory).
    /// The caller must hold a pin (or the reservation) of the range.
    pub fn copy_out_chunked<E>(
        &self,
        offset: u64,
        len: usize,
        chunk: usize,
        mut sink: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<Result<(), E>, OutOfBounds> {
        self.check(offset, len)?;
        let mut buf = vec![0u8; chunk.max(1).min(len.max(1))];
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

    /// Receive exactly `len` bytes from the stream socket `sock` straight
    /// into the slab at `offset` (no intermediate buffer). Blocking, and
    /// bounded as a whole by `deadline` (`TimedOut` once it passes: each
    /// blocking receive gets the time left as the socket's receive timeout,
    /// so a peer that trickles bytes cannot stretch it); `UnexpectedEof`
    /// when the peer closes first. Returns whether it changed the socket's
    /// receive timeout (only before a receive that would block). The caller must
    /// hold the range's reservation, and is the only one that writes it.
    ///
    /// Adaptive polling: when no bytes are waiting, it polls without
    /// blocking for up to `spin` before it blocks (a blocking wake-up costs
    /// tens of microseconds on a VM, and a stream arrives in many pieces).
    pub fn recv_into(
        &self,
        sock: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        spin: std::time::Duration,
        deadline: Option<std::time::Instant>,
    ) -> io::Result<bool> {
        let start = self.check(offset, len).map_err(io::Error::other)?;
        let mut changed = false;
        let base = self.map.as_mut_ptr() as usize + start;
        let mut done = 0usize;
        let mut polling_since: Option<std::time::Instant> = None;
        while done < len {
            let poll = !spin.is_zero() && polling_since.is_none_or(|t| t.elapsed() < spin);
            let flags = if poll { libc::MSG_DONTWAIT } else { 0 };
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                if !poll {
                    rustix::net::sockopt::set_socket_timeout(
                        sock,
                        rustix::net::sockopt::Timeout::Recv,
                        Some(left),
                    )?;
                    changed = true;
                }
            }
            // SAFETY: [start + done, start + len) lies inside the mapping
            // (`check`), which lives as long as `self` and never shrinks.
            // The kernel writes through the raw pointer; no Rust reference
            // to the shared memory is made, so a misbehaving process that
            // also maps it can corrupt bytes but not this program.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    (base + done) as *mut libc::c_void,
                    len - done,
                    flags,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => {
                    done += n as usize;
                    polling_since = None;
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => {}
                        io::ErrorKind::WouldBlock if poll => {
                            polling_since.get_or_insert_with(std::time::Instant::now);
                            std::hint::spin_loop();
                        }
                        io::ErrorKind::WouldBlock if deadline.is_some() => {
                            return Err(io::ErrorKind::TimedOut.into())
                        }
                        _ => return Err(e),
                    }
                }
            }
        }
        // Whether the socket's receive timeout was changed.
        Ok(changed)
    }

    /// Send `pieces` (heap bytes and slab ranges, in order) on the stream
    /// socket `sock` with as few vectored writes as possible, each bounded
    /// by the time left to `deadline` (`TimedOut` once it passes). Slab
    /// ranges go from the mapping to the kernel by raw pointer. The caller
    /// must hold pins of the slab ranges. Returns whether it changed the
    /// socket's send timeout (only when a send had to wait).
    pub fn send_pieces(
        &self,
        sock: BorrowedFd<'_>,
        pieces: &[Piece<'_>],
        deadline: std::time::Instant,
    ) -> io::Result<bool> {
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(pieces.len());
        for p in pieces {
            let (ptr, len) = match *p {
                Piece::Heap(b) => (b.as_ptr() as usize, b.len()),
                Piece::Slab { offset, len } => {
                    let start = self.check(offset, len).map_err(io::Error::other)?;
                    (self.map.as_ptr() as usize + start, len)
                }
            };
            if len > 0 {
                iov.push(libc::iovec {
                    iov_base: ptr as *mut libc::c_void,
                    iov_len: len,
                });
            }
        }
        let mut first = 0usize;
        // The first send does not wait (what fits in the socket's buffer
        // goes at once, with no timeout to set); later ones block, each
        // bounded by the time left.
        let mut blocking = false;
        let mut changed = false;
        while first < iov.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            if blocking {
                rustix::net::sockopt::set_socket_timeout(
                    sock,
                    rustix::net::sockopt::Timeout::Send,
                    Some(left),
                )?;
                changed = true;
            }
            let n = (iov.len() - first).min(1024);
            // SAFETY: every iovec names either a caller's slice, borrowed
            // for this call, or a range inside the mapping (`check`), which
            // lives as long as `self`; the kernel only reads them. The
            // message header points at those iovecs and nothing else.
            let sent = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov[first..].as_mut_ptr();
                msg.msg_iovlen = n as _;
                let flags = libc::MSG_NOSIGNAL | if blocking { 0 } else { libc::MSG_DONTWAIT };
                libc::sendmsg(sock.as_raw_fd(), &msg, flags)
            };
            if sent < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock if !blocking => {
                        blocking = true;
                        continue;
                    }
                    io::ErrorKind::WouldBlock => return Err(io::ErrorKind::TimedOut.into()),
                    _ => return Err(e),
                }
            }
            blocking = true;
            if sent == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let mut sent = sent as usize;
            while sent > 0 && first < iov.len() {
                let v = &mut iov[first];
                if sent >= v.iov_len {
                    sent -= v.iov_len;
                    first += 1;
                } else {
                    v.iov_base = (v.iov_base as usize + sent) as *mut libc::c_void;
                    v.iov_len -= sent;
                    sent = 0;
                }
            }
        }
        // Whether the socket's send timeout was changed.
        Ok(changed)
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

/// A piece of a message [`Slab::send_pieces`] sends.
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    /// Bytes of the caller's.
    Heap(&'a [u8]),
    /// A range of the slab.
    Slab { offset: u64, len: usize },
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

/// The page mode a unit asks for its slab (`--huge-pages`,
/// `units.huge_pages`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// The best the host offers: hugetlb when its free huge pages hold
    /// the whole slab, else transparent huge pages when shmem_enabled
    /// grants them on request, else 4 KiB pages. Never fails a start.
    #[default]
    Auto,
    /// A hugetlb memfd (`MFD_HUGETLB`): needs free huge pages
    /// (`/proc/sys/vm/nr_hugepages`); the slab rounds up to whole huge
    /// pages.
    Hugetlb,
    /// A plain memfd with `MADV_HUGEPAGE` on every mapping: needs
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` to be
    /// `advise`, `within_size`, `always` or `force`.
    Thp,
    /// 4 KiB pages.
    Off,
}

impl std::str::FromStr for HugePages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "hugetlb" => Ok(Self::Hugetlb),
            "thp" => Ok(Self::Thp),
            "4k" | "off" => Ok(Self::Off),
            other => Err(format!(
                "huge pages mode {other:?}: expected auto, hugetlb, thp or 4k"
            )),
        }
    }
}

impl std::fmt::Display for HugePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Hugetlb => "hugetlb",
            Self::Thp => "thp",
            Self::Off => "4k",
        })
    }
}

/// The page mode a slab is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageMode {
    /// 4 KiB pages.
    Small,
    /// Transparent huge pages advised on the mapping.
    Thp,
    /// A hugetlb memfd.
    Hugetlb,
}

impl PageMode {
    /// Every mode, in the order metrics list them.
    pub const ALL: [PageMode; 3] = [PageMode::Small, PageMode::Thp, PageMode::Hugetlb];

    /// Its name in stats, metrics and `stowage status`: `4k`, `thp`,
    /// `hugetlb`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Small => "4k",
            Self::Thp => "thp",
            Self::Hugetlb => "hugetlb",
        }
    }
}

impl std::fmt::Display for PageMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// What the host offers: its default huge page size and free huge pages
/// (`/proc/meminfo`), and the shmem THP setting.
struct HostPages {
    huge_size: u64,
    /// Free huge pages not reserved by another mapping.
    huge_free: u64,
    /// The selected word of shmem_enabled (`never` when unreadable).
    shmem_enabled: String,
}

impl HostPages {
    fn read() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let shmem = std::fs::read_to_string(SHMEM_ENABLED).unwrap_or_default();
        HostPages {
            huge_size: field("Hugepagesize:") << 10,
            huge_free: field("HugePages_Free:").saturating_sub(field("HugePages_Rsvd:")),
            shmem_enabled: shmem
                .split_whitespace()
                .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
                .unwrap_or("never")
                .to_string(),
        }
    }

    /// Whether the free huge pages hold a slab of `len` bytes; if not, why.
    fn hugetlb_fits(&self, len: u64) -> Result<(), String> {
        if self.huge_size == 0 {
            return Err("the host has no hugetlb pages (no Hugepagesize in /proc/meminfo)".into());
        }
        let need = len.div_ceil(self.huge_size);
        if self.huge_free < need {
            return Err(format!(
                "{} free hugetlb pages of {} KiB, the slab needs {need}: raise /proc/sys/vm/nr_hugepages",
                self.huge_free,
                self.huge_size >> 10
            ));
        }
        Ok(())
    }

    /// Whether a mapping that asks gets transparent huge pages for shared
    /// memory.
    fn thp_on_request(&self) -> bool {
        matches!(
            self.shmem_enabled.as_str(),
            "advise" | "within_size" | "always" | "force"
        )
    }

    fn thp_usable(&self) -> Result<(), String> {
        if self.thp_on_request() {
            Ok(())
        } else {
            Err(format!(
                "{SHMEM_ENABLED} is {}: set it to advise (or within_size)",
                self.shmem_enabled
            ))
        }
    }
}

/// ", rounded up from LEN" when hugetlb made the slab larger.
fn rounded(asked: u64, got: u64) -> String {
    if got > asked {
        format!("; the slab rounds up from {asked} to {got} bytes")
    } else {
        String::new()
    }
}

/// Whether `fd` is a file on hugetlbfs (a hugetlb memfd).
fn is_hugetlb(fd: &OwnedFd) -> bool {
    const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;
    rustix::fs::fstatfs(fd).is_ok_and(|st| st.f_type as u64 == HUGETLBFS_MAGIC)
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

/// Refuse an fd that is not a unit's slab: a memfd (a shared-memory file
/// that takes seals) of `len` bytes sealed against shrinking, growing and
/// further sealing.
fn check_slab_fd(fd: &OwnedFd, len: u64) -> io::Result<()> {
    check_memfd(fd, len, "slab")
}

/// Refuse anything but a memfd of exactly `len` bytes sealed against
/// shrinking, growing and further sealing (`what`: the unit's slab or a
/// ring, for the error).
pub(crate) fn check_memfd(fd: &OwnedFd, len: u64, what: &str) -> io::Result<()> {
    let refuse = |why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the unit's {what} fd is refused: {why}"),
        ))
    };
    let st = rustix::fs::fstat(fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return refuse("it is not a memfd (not a regular file)".into());
    }
    // Only shared-memory files (memfd) take seals; any other file answers
    // EINVAL.
    let seals = match rustix::fs::fcntl_get_seals(fd) {
        Ok(s) => s,
        Err(e) => return refuse(format!("it is not a sealed memfd ({e})")),
    };
    let want = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    if !seals.contains(want) {
        return refuse(format!(
            "its seals are {seals:?}, not SHRINK | GROW | SEAL: it could shrink under this mapping"
        ));
    }
    if u64::try_from(st.st_size).ok() != Some(len) {
        return refuse(format!(
            "it holds {} bytes, not the {len} the unit announced",
            st.st_size
        ));
    }
    Ok(())
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

    /// Whether this process has a page-table entry for each 4 KiB page of
    /// `[addr, addr + len)` (/proc/self/pagemap, bit 63: present).
    fn present(addr: usize, len: usize) -> Vec<bool> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
        f.seek(SeekFrom::Start((addr / 4096 * 8) as u64)).unwrap();
        let mut raw = vec![0u8; len / 4096 * 8];
        f.read_exact(&mut raw).unwrap();
        raw.chunks(8)
            .map(|e| u64::from_le_bytes(e.try_into().unwrap()) >> 63 == 1)
            .collect()
    }

    #[test]
    fn prepare_fills_a_small_range_once_per_chunk() {
        let len: u64 = 8 << 20;
        let s = Slab::create("prep", len).unwrap();
        s.fault_in(0, len, false).unwrap();
        let lazy = Slab::open(s.fd().try_clone_to_owned().unwrap(), len).unwrap();
        if lazy.page_mode() != PageMode::Small {
            return; // huge pages map 2 MiB at a time: no 4 KiB pages to see
        }
        let base = lazy.addr();
        let all = |from: usize, to: usize, want: bool| {
            present(base + from, to - from).iter().all(|&p| p == want)
        };
        // Drop this mapping's page tables (the memory stays in the memfd).
        let drop_tables = || {
            // SAFETY: a shared mapping of a memfd: MADV_DONTNEED drops this
            // process's page-table entries only; the contents stay in the
            // file and later touches fault them back in.
            unsafe {
                lazy.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, 0, len as usize)
                    .unwrap()
            }
        };
        let c = CHUNK;
        assert!(all(0, 1 << 20, false), "mapped lazily");
        // A few pages in a chunk nothing filled: exactly those pages.
        lazy.prepare(c as u64 + 1000, 5000);
        assert!(all(c, c + 2 * 4096, true));
        assert!(all(c + 2 * 4096, 2 * c, false));
        // 32 KiB or more: the whole chunk, and it is marked filled.
        lazy.prepare(c as u64 + 1000, 40_000);
        assert!(all(c, 2 * c, true));
        assert!(all(0, c, false) && all(2 * c, 4 * c, false));
        // A filled chunk is not filled again, by a large range or a small
        // one; a large range reaching into chunk 2 fills chunk 2 only.
        drop_tables();
        assert!(all(c, 2 * c, false));
        lazy.prepare(c as u64 + 1000, 40_000);
        lazy.prepare(c as u64 + 1000, 5000);
        assert!(all(c, 2 * c, false), "filled twice");
        lazy.prepare(2 * c as u64 - 8192, 40_000);
        assert!(all(c, 2 * c, false));
        assert!(all(2 * c, 3 * c, true));
        // A small range in a chunk not filled: its pages, once each (the
        // tables dropped since, filled again by the copy's faults); a
        // range reaching a page not filled yet fills its pages.
        drop_tables();
        lazy.prepare(3 * c as u64, 4096);
        assert!(all(3 * c, 3 * c + 4096, true));
        assert!(all(3 * c + 4096, 4 * c, false));
        drop_tables();
        lazy.prepare(3 * c as u64, 4096);
        lazy.prepare(3 * c as u64 + 100, 3000);
        assert!(all(3 * c, 4 * c, false), "a page filled twice");
        lazy.prepare(3 * c as u64 + 4000, 5000);
        assert!(all(3 * c, 3 * c + 3 * 4096, true));
        assert!(all(3 * c + 3 * 4096, 4 * c, false));
        // A region filled by a large copy counts for its chunks.
        let mut big = vec![0u8; FILL_MIN];
        lazy.read(4 << 20, &mut big).unwrap();
        drop_tables();
        lazy.prepare((4 << 20) + 3 * c as u64, 100);
        lazy.prepare((4 << 20) + 5 * c as u64, 40_000);
        assert!(all(4 << 20, 6 << 20, false));
    }

    #[test]
    fn faulting_in_keeps_contents_and_clamps_to_the_slab() {
        let len = 8 << 20;
        let s = Slab::create("fault", len).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        s.write(0, &data[..(len / 2) as usize]).unwrap();
        // Faulting in written and unwritten pages, with and without mlock
        // (which may be refused without CAP_IPC_LOCK), past the end too.
        s.fault_in(0, len / 4, false).unwrap();
        let _ = s.fault_in(len / 4, len, true);
        s.fault_in(len - 4096, 1 << 30, false).unwrap();
        s.fault_in(len + 4096, 4096, false).unwrap();
        let mut out = vec![0u8; len as usize];
        s.read(0, &mut out).unwrap();
        assert!(out[..(len / 2) as usize] == data[..(len / 2) as usize]);
        assert!(out[(len / 2) as usize..].iter().all(|&b| b == 0));
        // A client's mapping of the same memory fills its page tables as
        // copies reach each region: the same bytes, both ways.
        let lazy = Slab::open(s.fd().try_clone_to_owned().unwrap(), s.len()).unwrap();
        let mut back = vec![0u8; 3 << 20];
        lazy.read(1 << 20, &mut back).unwrap();
        assert!(back == out[1 << 20..4 << 20]);
        lazy.write(len - 10, b"0123456789").unwrap();
        s.read(len - 10, &mut back[..10]).unwrap();
        assert_eq!(&back[..10], b"0123456789");
        assert!(lazy.range_ptr(len - 1, 1).is_ok());
    }

    #[test]
    fn page_modes_parse_and_auto_never_fails() {
        for (s, m) in [
            ("auto", HugePages::Auto),
            ("hugetlb", HugePages::Hugetlb),
            ("thp", HugePages::Thp),
            ("4k", HugePages::Off),
        ] {
            assert_eq!(s.parse::<HugePages>().unwrap(), m);
            assert_eq!(m.to_string(), s);
        }
        assert!("huge"
            .parse::<HugePages>()
            .unwrap_err()
            .contains("auto, hugetlb, thp or 4k"));
        // Whatever the host offers, auto starts, says why, and a client's
        // mapping of its fd sees the same bytes.
        let (s, why) = Slab::create_paged("auto", 3 << 20, HugePages::Auto).unwrap();
        assert!(s.len() >= 3 << 20, "{why}");
        assert!(
            why.starts_with(match s.page_mode() {
                PageMode::Small => "4 KiB pages",
                PageMode::Thp => "transparent huge pages",
                PageMode::Hugetlb => "hugetlb pages",
            }),
            "{why}"
        );
        s.write(12345, b"paged").unwrap();
        let c = Slab::open(s.fd().try_clone_to_owned().unwrap(), s.len()).unwrap();
        let mut out = [0u8; 5];
        c.read(12345, &mut out).unwrap();
        assert_eq!(&out, b"paged");
        assert_eq!(
            c.page_mode() == PageMode::Hugetlb,
            s.page_mode() == PageMode::Hugetlb
        );
        let (s, _) = Slab::create_paged("4k", 4096, HugePages::Off).unwrap();
        assert_eq!((s.page_mode(), s.len()), (PageMode::Small, 4096));
        // An explicit mode the host lacks names the setting to change.
        let host = HostPages::read();
        if host.hugetlb_fits(1 << 40).is_err() {
            let e = Slab::create_paged("big", 1 << 40, HugePages::Hugetlb)
                .err()
                .unwrap();
            assert_eq!(e.kind(), io::ErrorKind::Unsupported);
            assert!(e.to_string().contains("nr_hugepages"), "{e}");
        }
    }

    #[test]
    fn write_read_and_bounds() {
        let s = Slab::create("test", 1 << 16).unwrap();
        s.write(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        s.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(s.write((1 << 16) - 2, b"abc").is_err());
        assert!(s.read(u64::MAX, &mut out).is_err());
        // Chunked copies through the heap.
        let src: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        s.copy_in_chunked(10, 1000, 64, |at, buf| {
            buf.copy_from_slice(&src[at as usize..at as usize + buf.len()]);
            Ok::<(), ()>(())
        })
        .unwrap()
        .unwrap();
        let mut back = Vec::new();
        s.copy_out_chunked(10, 1000, 96, |c| {
            back.extend_from_slice(c);
            Ok::<(), ()>(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(back, src);
        assert!(s
            .copy_out_chunked(1 << 16, 1, 8, |_| Ok::<(), ()>(()))
            .is_err());
        assert!(s.range_ptr(u64::MAX, 1).is_err());
    }

    #[test]
    fn sockets_move_bytes_straight_to_and_from_the_slab() {
        let s = Slab::create("test", 1 << 20).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let src: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
        s.write(4096, &src).unwrap();
        let head = b"head".to_vec();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 4 + 300_000];
            std::io::Read::read_exact(&mut &b, &mut got).unwrap();
            // And back into the slab, at another offset.
            (got, b)
        });
        s.send_pieces(
            a.as_fd(),
            &[
                Piece::Heap(&head),
                Piece::Slab {
                    offset: 4096,
                    len: 300_000,
                },
            ],
            deadline,
        )
        .unwrap();
        let (got, b) = reader.join().unwrap();
        assert_eq!(&got[..4], b"head");
        assert!(got[4..] == src[..]);
        let writer = std::thread::spawn(move || {
            std::io::Write::write_all(&mut &a, &src).unwrap();
            (a, src)
        });
        s.recv_into(
            b.as_fd(),
            500_000,
            300_000,
            std::time::Duration::from_micros(50),
            Some(deadline),
        )
        .unwrap();
        let (a, src) = writer.join().unwrap();
        let mut back = vec![0u8; 300_000];
        s.read(500_000, &mut back).unwrap();
        assert!(back == src);
        // A peer that closes early: UnexpectedEof.
        std::io::Write::write_all(&mut &a, b"abc").unwrap();
        drop(a);
        let e = s
            .recv_into(b.as_fd(), 0, 10, std::time::Duration::ZERO, None)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        // Out of bounds: refused before any system call.
        assert!(s
            .recv_into(b.as_fd(), 1 << 20, 1, std::time::Duration::ZERO, None)
            .is_err());
        // A peer that trickles: cut off at the deadline as a whole.
        let (c, d) = UnixStream::pair().unwrap();
        let trickle = std::thread::spawn(move || {
            for _ in 0..20 {
                if std::io::Write::write_all(&mut &c, b"x").is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
        let t = std::time::Instant::now();
        let e = s
            .recv_into(
                d.as_fd(),
                0,
                100,
                std::time::Duration::ZERO,
                Some(t + std::time::Duration::from_millis(300)),
            )
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < std::time::Duration::from_millis(700));
        drop(d);
        trickle.join().unwrap();
    }

    #[test]
    fn gathered_writes_land_back_to_back_split_or_not() {
        let slab = Slab::create("gather", 64 << 20).unwrap();
        // Many odd-sized sources, large enough in all to be split over
        // threads, and a few small ones that are not.
        let srcs: Vec<Vec<u8>> = (0..700u32)
            .map(|i| {
                (0..(i as usize * 37) % 40_000 + 1)
                    .map(|j| (i as usize * 7 + j) as u8)
                    .collect()
            })
            .collect();
        let refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        let total: usize = refs.iter().map(|s| s.len()).sum();
        assert!(total >= PARALLEL_COPY_MIN);
        for (offset, n) in [(4096u64, refs.len()), (1u64 << 25, 3)] {
            slab.write_gather(offset, &refs[..n]).unwrap();
            let want: Vec<u8> = refs[..n].concat();
            let mut got = vec![0u8; want.len()];
            slab.read(offset, &mut got).unwrap();
            assert!(got == want, "{n} sources at {offset}");
        }
        assert!(slab.write_gather(64 << 20, &refs[..1]).is_err());
    }

    #[test]
    fn scattered_reads_fill_every_buffer_split_or_not() {
        let slab = Slab::create("scatter", 64 << 20).unwrap();
        let bytes: Vec<u8> = (0..(24usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
        slab.write(0, &bytes).unwrap();
        for count in [2usize, 5, 700] {
            let lens: Vec<usize> = (0..count)
                .map(|i| (i * 7919) % 30_000 + 1 + (16 << 20) / count)
                .collect();
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
            let offs: Vec<u64> = (0..count).map(|i| (i as u64 * 4099) % (4 << 20)).collect();
            let reads = offs
                .iter()
                .copied()
                .zip(bufs.iter_mut().map(Vec::as_mut_slice))
                .collect();
            slab.read_scatter(reads).unwrap();
            for ((o, b), n) in offs.iter().zip(&bufs).zip(&lens) {
                assert!(
                    b[..] == bytes[*o as usize..*o as usize + n],
                    "{count} reads"
                );
            }
        }
        let mut tail = vec![0u8; 2];
        assert!(slab
            .read_scatter(vec![
                (0, vec![0u8; 1].as_mut_slice()),
                ((64 << 20) - 1, tail.as_mut_slice())
            ])
            .is_err());
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
        let other = Slab::open(fd.expect("fd attached"), s.len()).unwrap();
        assert_eq!(other.len(), 4096);
        s.write(10, b"shared").unwrap();
        let mut out = [0u8; 6];
        other.read(10, &mut out).unwrap();
        assert_eq!(&out, b"shared");
    }

    #[test]
    fn open_refuses_fds_that_are_not_a_sealed_slab_of_the_announced_size() {
        let msg = |r: io::Result<Slab>| match r {
            Ok(_) => panic!("an unfit fd was mapped"),
            Err(e) => {
                assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
                e.to_string()
            }
        };
        // A regular file.
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let n = f.metadata().unwrap().len();
        let e = msg(Slab::open(f.into(), n));
        assert!(e.contains("not a sealed memfd"), "{e}");
        // A memfd nobody sealed: it could shrink under the mapping.
        let m =
            rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&m, 4096).unwrap();
        let e = msg(Slab::open(m, 4096));
        assert!(e.contains("SHRINK | GROW | SEAL"), "{e}");
        // A real slab of another size than announced.
        let s = Slab::create("sized", 8192).unwrap();
        let e = msg(Slab::open(s.fd().try_clone_to_owned().unwrap(), 4096));
        assert!(e.contains("8192") && e.contains("4096"), "{e}");
        assert!(Slab::open(s.fd().try_clone_to_owned().unwrap(), 8192).is_ok());
    }
}
