//! # Request rings: same-host requests without a system call per op
//!
//! A [`Ring`] is one memfd, sized once and sealed (like a slab), mapped
//! `MAP_SHARED` by a unit and by one client process. The client writes
//! requests into the submission ring (SQ) and the unit writes replies
//! into the completion ring (CQ); while both sides are busy neither makes
//! a system call.
//!
//! ```text
//!  0    sq_tail  u64  (client writes)      one 64-byte line each
//!  64   sq_head  u64  (unit writes)
//!  128  cq_tail  u64  (unit writes), cq_seq u32 at 136: the futex word
//!  192  cq_head  u64  (client writes)
//!  256  unit_parked    u32
//!  320  client_waiting u32
//!  384  SQ bytes (capacity C), then CQ bytes (capacity C)
//! ```
//!
//! Each byte ring holds entries back to back: `len: u32` then `len` bytes,
//! padded to 8. An entry that would cross the ring's end is written at its
//! start instead, after a wrap marker (`len` = `u32::MAX`) where it would
//! have begun. Indices are free-running byte counters (`u64`), published
//! with Release and read with Acquire. Entries are opaque: the caller puts
//! an encoded wire frame in each.
//!
//! **Trust.** Each side keeps its own indices in private memory and only
//! ever stores them into the header, never reads them back: the other
//! side's indices and bytes are checked before anything is copied (the
//! unit does not trust a client: [`Ring::take_request`] copies an entry
//! into private memory and answers [`RingCorrupt`] for any inconsistency,
//! never panics or reads outside the mapping).
//!
//! **Wake-ups** (io_uring's NEED_WAKEUP pattern). A unit idle on a ring
//! [`Ring::park`]s it: `unit_parked` = 1, a SeqCst fence, then a last look
//! at the SQ. A client publishes `sq_tail`, fences, and when it finds
//! `unit_parked` set it swaps it to 0 and [`Ring::submit`] returns `true`:
//! the caller then kicks the unit over its socket. A client that waits for
//! a reply spins briefly, then sets `client_waiting`, looks again, and
//! sleeps on a futex over `cq_seq` (shared, not `FUTEX_PRIVATE`: the page
//! is mapped by two processes); [`Ring::post_reply`] wakes it when
//! `client_waiting` is set. Busy rings cost no system call either way.
//!
//! Each side's methods may be called from any thread (each side's private
//! state is behind its own lock); a ring has one client and one unit.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::thread::futex;

/// The default size of a ring's memfd (header and both byte rings).
pub const RING_BYTES: usize = 16 << 10;

const SQ_TAIL: usize = 0;
const SQ_HEAD: usize = 64;
const CQ_TAIL: usize = 128;
/// The futex word: the low 32 bits of `cq_tail`, stored after it.
const CQ_SEQ: usize = 136;
const CQ_HEAD: usize = 192;
const UNIT_PARKED: usize = 256;
const CLIENT_WAITING: usize = 320;
/// Bytes of the header; the byte rings follow.
const HEADER: usize = 384;
/// The smallest ring: room for a header and two byte rings of 256 bytes.
const MIN_BYTES: usize = HEADER + 512;
/// `len` of a wrap marker.
const WRAP: u32 = u32::MAX;
/// Entries are padded to this.
const ALIGN: usize = 8;

/// No room in the ring now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingFull;

impl std::fmt::Display for RingFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the ring has no room for the entry now")
    }
}

impl std::error::Error for RingFull {}

/// The other side broke the ring's layout (what was wrong).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingCorrupt(pub String);

impl std::fmt::Display for RingCorrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the ring is corrupt: {}", self.0)
    }
}

impl std::error::Error for RingCorrupt {}

/// One side's own indices, kept in private memory.
#[derive(Default)]
struct Own {
    /// Bytes this side published into the ring it writes (its tail).
    produced: u64,
    /// Bytes this side took from the ring it reads (its head).
    consumed: u64,
}

/// One of the two byte rings.
#[derive(Clone, Copy)]
struct Lane {
    /// Where its bytes start in the mapping.
    data: usize,
    /// Header offsets of its tail (the producer's) and head (the
    /// consumer's).
    tail: usize,
    head: usize,
}

const SQ: Lane = Lane {
    data: HEADER,
    tail: SQ_TAIL,
    head: SQ_HEAD,
};

/// A request/reply ring shared by a unit and one client. See the module
/// docs.
pub struct Ring {
    map: MmapRaw,
    bytes: usize,
    /// Bytes of each byte ring (a multiple of [`ALIGN`]).
    cap: usize,
    max_entry: usize,
    /// The client's sq_tail and cq_head.
    client: Mutex<Own>,
    /// The unit's cq_tail and sq_head.
    unit: Mutex<Own>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("bytes", &self.bytes)
            .field("max_entry", &self.max_entry)
            .finish()
    }
}

fn padded(len: usize) -> usize {
    (4 + len).div_ceil(ALIGN) * ALIGN
}

impl Ring {
    /// The unit's side: a new sealed memfd of `bytes` bytes (at least 896,
    /// the header and two small rings), mapped. The fd goes to the client
    /// (SCM_RIGHTS); the unit may close it once sent.
    pub fn create(bytes: usize) -> io::Result<(Ring, OwnedFd)> {
        Self::check_size(bytes)?;
        let fd = rustix::fs::memfd_create(
            "stowage-ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, bytes as u64)?;
        // The client must never see the mapping shrink under it (SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let ring = Self::map(&fd, bytes)?;
        Ok((ring, fd))
    }

    /// The client's side: map the ring a unit handed over. The fd must be a
    /// memfd of exactly `bytes` bytes, sealed against shrinking, growing
    /// and further sealing (refused with
    /// [`io::ErrorKind::PermissionDenied`] otherwise).
    pub fn open(fd: OwnedFd, bytes: usize) -> io::Result<Ring> {
        Self::check_size(bytes)?;
        crate::check_memfd(&fd, bytes as u64, "ring")?;
        let ring = Self::map(&fd, bytes)?;
        // A client may map a ring the unit has used before (never today):
        // start from what the header says, checked as the unit's indices
        // are checked on every use.
        {
            let mut own = lock(&ring.client);
            own.produced = ring.word64(SQ_TAIL).load(Ordering::Acquire);
            own.consumed = ring.word64(CQ_HEAD).load(Ordering::Acquire);
        }
        Ok(ring)
    }

    fn check_size(bytes: usize) -> io::Result<()> {
        if bytes < MIN_BYTES || bytes > u32::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a ring of {bytes} bytes: rings hold {MIN_BYTES} bytes to 4 GiB"),
            ));
        }
        Ok(())
    }

    fn map(fd: &OwnedFd, bytes: usize) -> io::Result<Ring> {
        let map = memmap2::MmapOptions::new().len(bytes).map_raw(fd)?;
        let cap = (bytes - HEADER) / 2 / ALIGN * ALIGN;
        // An entry of at most half a ring always fits an empty ring
        // wherever its tail is (after a wrap marker if need be).
        let max_entry = cap / 2 / ALIGN * ALIGN - 4;
        Ok(Ring {
            map,
            bytes,
            cap,
            max_entry,
            client: Mutex::new(Own::default()),
            unit: Mutex::new(Own::default()),
        })
    }

    /// The size of the ring's memfd.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The largest entry either direction can ever hold.
    pub fn max_entry(&self) -> usize {
        self.max_entry
    }

    fn cq(&self) -> Lane {
        Lane {
            data: HEADER + self.cap,
            tail: CQ_TAIL,
            head: CQ_HEAD,
        }
    }

    fn word64(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= HEADER);
        // SAFETY: `offset` is one of the header's constants: 8-aligned
        // (the mapping is page-aligned) and inside the mapping, which
        // lives as long as `self` (the reference cannot outlive it). The
        // other process only ever touches these bytes as atomics too; a
        // hostile one can store any value, which every reader checks.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn word32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= self.bytes);
        // SAFETY: every caller passes a 4-aligned offset inside the
        // mapping (a header constant, or an entry's start within a byte
        // ring: a multiple of 8 at most `cap - 8` past the ring's start);
        // the mapping lives as long as `self`. Shared words are only
        // accessed as atomics by either side.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// Write `entry` into `lane` at the producer's position `own`:
    /// publish it (Release) or answer RingFull. `head` is the consumer's,
    /// read from the other side: one that claims more than the ring holds
    /// leaves no room.
    fn produce(&self, lane: Lane, tail: &mut u64, entry: &[u8]) -> Result<(), RingFull> {
        if entry.len() > self.max_entry {
            return Err(RingFull);
        }
        let cap = self.cap as u64;
        let head = self.word64(lane.head).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > cap {
            return Err(RingFull);
        }
        let room = (cap - used) as usize;
        let size = padded(entry.len());
        let at = (*tail % cap) as usize;
        let skip = if at + size > self.cap {
            self.cap - at
        } else {
            0
        };
        if skip + size > room {
            return Err(RingFull);
        }
        let start = if skip > 0 {
            self.word32(lane.data + at).store(WRAP, Ordering::Relaxed);
            0
        } else {
            at
        };
        self.word32(lane.data + start)
            .store(entry.len() as u32, Ordering::Relaxed);
        // SAFETY: [start + 4, start + 4 + len) lies inside this byte ring
        // (start + size <= cap, checked above) and so inside the mapping,
        // which lives as long as `self`. The destination is raw shared
        // memory, never a Rust reference; `entry` is the caller's and
        // cannot overlap it. The consumer reads these bytes only after the
        // Release store of the tail below.
        unsafe {
            std::ptr::copy_nonoverlapping(
                entry.as_ptr(),
                self.map.as_mut_ptr().add(lane.data + start + 4),
                entry.len(),
            );
        }
        *tail = tail.wrapping_add((skip + size) as u64);
        self.word64(lane.tail).store(*tail, Ordering::Release);
        Ok(())
    }

    /// Take the next entry of `lane` into `out` (private memory), from the
    /// consumer's position `head`. Everything the producer wrote is
    /// checked: its tail against `head` and the capacity, each length
    /// against [`Ring::max_entry`] and the bytes published, wrap markers
    /// against the ring's end.
    fn consume(&self, lane: Lane, head: &mut u64, out: &mut Vec<u8>) -> Result<bool, RingCorrupt> {
        let cap = self.cap as u64;
        let tail = self.word64(lane.tail).load(Ordering::Acquire);
        let mut avail = tail.wrapping_sub(*head);
        if avail == 0 {
            return Ok(false);
        }
        if avail > cap || !avail.is_multiple_of(ALIGN as u64) {
            return Err(RingCorrupt(format!(
                "tail {tail} against head {} of a ring of {cap} bytes",
                *head
            )));
        }
        let mut pos = *head;
        let mut at = (pos % cap) as usize;
        let mut len = self.word32(lane.data + at).load(Ordering::Relaxed);
        if len == WRAP {
            let skip = (self.cap - at) as u64;
            if at == 0 || skip >= avail {
                return Err(RingCorrupt(format!(
                    "a wrap marker at {at} with {avail} bytes published"
                )));
            }
            pos = pos.wrapping_add(skip);
            avail -= skip;
            at = 0;
            len = self.word32(lane.data).load(Ordering::Relaxed);
        }
        let len = len as usize;
        if len > self.max_entry {
            return Err(RingCorrupt(format!(
                "an entry of {len} bytes (at most {})",
                self.max_entry
            )));
        }
        let size = padded(len);
        if size as u64 > avail || at + size > self.cap {
            return Err(RingCorrupt(format!(
                "an entry of {len} bytes at {at} with {avail} bytes published"
            )));
        }
        out.clear();
        out.reserve(len);
        // SAFETY: [at + 4, at + 4 + len) lies inside this byte ring
        // (at + size <= cap, checked above) and so inside the mapping,
        // which lives as long as `self`; `out` has room for `len` bytes
        // (reserved) and is private memory, which cannot overlap the
        // mapping. The source is raw shared memory read once into `out`:
        // whatever the other process writes meanwhile, only `out` is
        // decoded.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(lane.data + at + 4),
                out.as_mut_ptr(),
                len,
            );
            out.set_len(len);
        }
        *head = pos.wrapping_add(size as u64);
        self.word64(lane.head).store(*head, Ordering::Release);
        Ok(true)
    }

    // ---- client side ----

    /// Submit a request entry (client side). `Ok(true)`: the unit is
    /// parked; the caller must kick it (a `RingKick` on the connection's
    /// socket). `Err(RingFull)`: no room now (or an entry longer than
    /// [`Ring::max_entry`]).
    pub fn submit(&self, entry: &[u8]) -> Result<bool, RingFull> {
        let mut own = lock(&self.client);
        self.produce(SQ, &mut own.produced, entry)?;
        drop(own);
        // Pairs with the fence in `park`: either the unit sees this entry
        // in its last look, or this sees `unit_parked`.
        fence(Ordering::SeqCst);
        let parked = self.word32(UNIT_PARKED);
        Ok(parked.load(Ordering::Relaxed) != 0 && parked.swap(0, Ordering::AcqRel) != 0)
    }

    /// Take the next reply entry into `out` (client side). `Ok(false)`:
    /// none now.
    pub fn take_reply(&self, out: &mut Vec<u8>) -> Result<bool, RingCorrupt> {
        let mut own = lock(&self.client);
        let lane = self.cq();
        self.consume(lane, &mut own.consumed, out)
    }

    fn reply_ready(&self) -> bool {
        let head = lock(&self.client).consumed;
        self.word64(CQ_TAIL).load(Ordering::Acquire) != head
    }

    /// Wait until a reply is there (client side): spin (yielding) for up
    /// to `spin`, then sleep on the ring's futex until a reply comes or
    /// `deadline` passes. `true`: a reply is there.
    pub fn wait_reply(&self, deadline: Instant, spin: Duration) -> bool {
        self.wait_reply_with(deadline, spin, || {
            std::thread::yield_now();
            true
        })
    }

    /// [`Ring::wait_reply`], with `pause` between polls instead of a plain
    /// yield: it gives the core away, and `false` from it ends the spin at
    /// once (the caller found its core wanted by others).
    pub fn wait_reply_with(
        &self,
        deadline: Instant,
        spin: Duration,
        mut pause: impl FnMut() -> bool,
    ) -> bool {
        let start = Instant::now();
        loop {
            if self.reply_ready() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if now.duration_since(start) >= spin || !pause() {
                break;
            }
        }
        let seq = self.word32(CQ_SEQ);
        let waiting = self.word32(CLIENT_WAITING);
        loop {
            // Read the futex word before the last look: a reply posted
            // after it changes the word, so the wait returns at once.
            let seen = seq.load(Ordering::Acquire);
            waiting.store(1, Ordering::Relaxed);
            // Pairs with the fence in `post_reply`: either the unit sees
            // `client_waiting` and wakes this, or this sees its reply.
            fence(Ordering::SeqCst);
            if self.reply_ready() {
                waiting.store(0, Ordering::Relaxed);
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                waiting.store(0, Ordering::Relaxed);
                return false;
            }
            let timeout = rustix::thread::futex::Timespec::try_from(left).ok();
            // Not PRIVATE: the word is in a page mapped by two processes.
            // EAGAIN (the word moved), EINTR and the timeout all end in a
            // new look.
            let _ = futex::wait(seq, futex::Flags::empty(), seen, timeout.as_ref());
        }
    }

    // ---- unit side: nothing the client wrote is trusted ----

    /// Take the next request entry into `out` (unit side), a copy in
    /// private memory. `Ok(false)`: none now. Any inconsistency in what the
    /// client wrote (a tail behind the head or past it by more than the
    /// ring holds, a length past [`Ring::max_entry`], a bad wrap marker, a
    /// CQ head the unit never reached) is `Err`.
    pub fn take_request(&self, out: &mut Vec<u8>) -> Result<bool, RingCorrupt> {
        let mut own = lock(&self.unit);
        let cq_head = self.word64(CQ_HEAD).load(Ordering::Acquire);
        if own.produced.wrapping_sub(cq_head) > self.cap as u64
            || !cq_head.is_multiple_of(ALIGN as u64)
        {
            return Err(RingCorrupt(format!(
                "the client's cq_head {cq_head} against cq_tail {}",
                own.produced
            )));
        }
        self.consume(SQ, &mut own.consumed, out)
    }

    /// The largest entry [`Ring::post_reply`] would take now (0: none).
    pub fn reply_room(&self) -> usize {
        let own = lock(&self.unit);
        let cap = self.cap as u64;
        let head = self.word64(CQ_HEAD).load(Ordering::Acquire);
        let used = own.produced.wrapping_sub(head);
        if used > cap {
            return 0;
        }
        let room = (cap - used) as usize;
        let to_end = self.cap - (own.produced % cap) as usize;
        let size = room.min(to_end).max(room.saturating_sub(to_end)) / ALIGN * ALIGN;
        if size < ALIGN {
            return 0;
        }
        (size - 4).min(self.max_entry)
    }

    /// Publish a reply entry (unit side), then wake the client if it
    /// sleeps on the ring.
    pub fn post_reply(&self, entry: &[u8]) -> Result<(), RingFull> {
        let mut own = lock(&self.unit);
        let lane = self.cq();
        self.produce(lane, &mut own.produced, entry)?;
        // The futex word follows cq_tail (the client waits on it).
        self.word32(CQ_SEQ)
            .store(own.produced as u32, Ordering::Release);
        drop(own);
        fence(Ordering::SeqCst);
        if self.word32(CLIENT_WAITING).load(Ordering::Relaxed) != 0 {
            let _ = futex::wake(self.word32(CQ_SEQ), futex::Flags::empty(), u32::MAX);
        }
        Ok(())
    }

    /// The unit goes idle on this ring: `true` when it is parked (the
    /// client will kick it at its next submit), `false` when requests
    /// arrived meanwhile (the ring is not parked: keep serving).
    pub fn park(&self) -> bool {
        let parked = self.word32(UNIT_PARKED);
        parked.store(1, Ordering::Relaxed);
        // Pairs with the fence in `submit`.
        fence(Ordering::SeqCst);
        if self.has_request() {
            parked.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Whether the client has published requests the unit has not taken
    /// (or broke the ring: [`Ring::take_request`] then says how).
    pub fn has_request(&self) -> bool {
        let head = lock(&self.unit).consumed;
        self.word64(SQ_TAIL).load(Ordering::Acquire) != head
    }

    /// Overwrite mapping bytes from `offset` (hostile-client tests).
    #[cfg(test)]
    fn scribble(&self, offset: usize, bytes: &[u8]) {
        let n = bytes.len().min(self.bytes.saturating_sub(offset));
        // SAFETY: [offset, offset + n) is clamped to the mapping, which
        // lives as long as `self`; raw shared memory, never a reference.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.as_mut_ptr().add(offset), n);
        }
    }
}

/// A side's lock: its state is two counters, consistent even if a holder
/// panicked.
fn lock(m: &Mutex<Own>) -> std::sync::MutexGuard<'_, Own> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    fn pair(bytes: usize) -> (Ring, Ring) {
        let (unit, fd) = Ring::create(bytes).unwrap();
        let client = Ring::open(fd, bytes).unwrap();
        (unit, client)
    }

    fn entry(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
    }

    #[test]
    fn sizes_are_checked() {
        assert!(Ring::create(100).is_err());
        let (_, fd) = Ring::create(RING_BYTES).unwrap();
        // Another size than the memfd's is refused.
        let err = Ring::open(fd, RING_BYTES * 2).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        // An unsealed memfd is refused.
        let fd = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(Ring::open(fd, 4096).is_err());
        let (r, _) = Ring::create(4096).unwrap();
        assert_eq!(r.bytes(), 4096);
        // Half of each byte ring of (4096 - 384) / 2 = 1856 bytes.
        assert_eq!(r.max_entry(), 928 - 4);
    }

    /// Entries of every size, through both rings, wrapping many times:
    /// each comes out as it went in, in order; a full ring says so.
    #[test]
    fn entries_of_every_size_wrap_around() {
        let (unit, client) = pair(4096);
        let max = client.max_entry();
        let mut out = Vec::new();
        let mut i = 0usize;
        // One at a time, every size.
        for len in (0..=max).chain((0..=max).rev()) {
            let e = entry(i, len);
            assert!(!client.submit(&e).unwrap(), "nobody parked");
            assert!(unit.has_request());
            assert!(unit.take_request(&mut out).unwrap());
            assert_eq!(out, e);
            assert!(!unit.take_request(&mut out).unwrap());
            let r = entry(i + 1, max - len);
            assert!(unit.reply_room() >= r.len());
            unit.post_reply(&r).unwrap();
            assert!(client.take_reply(&mut out).unwrap());
            assert_eq!(out, r);
            assert!(!client.take_reply(&mut out).unwrap());
            i += 1;
        }
        // Many in flight: fill until full, drain in order, many rounds of
        // mixed sizes.
        for round in 0..200 {
            let mut sent = Vec::new();
            loop {
                let e = entry(i, (i * 37 + round) % (max + 1));
                match client.submit(&e) {
                    Ok(_) => sent.push(e),
                    Err(RingFull) => break,
                }
                i += 1;
            }
            assert!(!sent.is_empty());
            for e in &sent {
                assert!(unit.take_request(&mut out).unwrap());
                assert_eq!(&out, e);
                let room = unit.reply_room();
                let r = entry(i, e.len().min(room));
                unit.post_reply(&r).unwrap();
                assert!(client.take_reply(&mut out).unwrap());
                assert_eq!(out, r);
            }
            assert!(!unit.has_request());
        }
        // Too long never fits.
        assert_eq!(client.submit(&vec![0; max + 1]), Err(RingFull));
        assert_eq!(unit.post_reply(&vec![0; max + 1]), Err(RingFull));
    }

    /// reply_room is exactly the largest entry post_reply takes.
    #[test]
    fn reply_room_is_exact() {
        let (unit, client) = pair(4096);
        let mut out = Vec::new();
        for k in 0..3000usize {
            let room = unit.reply_room();
            if room < unit.max_entry() {
                // One byte more than the room does not fit.
                assert_eq!(unit.post_reply(&vec![1; room + 1]), Err(RingFull));
            }
            if room > 0 && !k.is_multiple_of(3) {
                // The room itself, or less, fits.
                let len = if k.is_multiple_of(2) {
                    room
                } else {
                    room.min(k * 13 % 700)
                };
                unit.post_reply(&entry(k, len)).unwrap();
            } else if client.take_reply(&mut out).unwrap() {
                assert!(out.len() <= unit.max_entry());
            }
        }
    }

    /// The NEED_WAKEUP handshake: a parked unit is reported once, by the
    /// submit that finds it parked.
    #[test]
    fn a_parked_unit_is_kicked_once() {
        let (unit, client) = pair(RING_BYTES);
        let mut out = Vec::new();
        assert!(unit.park());
        assert!(client.submit(b"one").unwrap());
        // The kick cleared the flag: no second kick for a second entry.
        assert!(!client.submit(b"two").unwrap());
        assert!(!unit.park(), "requests are waiting");
        assert!(unit.take_request(&mut out).unwrap());
        assert!(unit.take_request(&mut out).unwrap());
        assert_eq!(out, b"two");
        assert!(unit.park());
    }

    /// A second mapping of the same fd acts as the client, on another
    /// thread, with futex waits on both sides' terms.
    #[test]
    fn a_second_mapping_serves_as_the_client() {
        let (unit, fd) = Ring::create(RING_BYTES).unwrap();
        let client = Ring::open(fd.try_clone().unwrap(), RING_BYTES).unwrap();
        drop(fd);
        let unit = Arc::new(unit);
        let deadline = Instant::now() + Duration::from_secs(60);
        let server = {
            let unit = unit.clone();
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut served = 0usize;
                while served < 2000 && Instant::now() < deadline {
                    if unit.take_request(&mut req).unwrap() {
                        req.reverse();
                        while unit.post_reply(&req).is_err() {
                            std::thread::yield_now();
                        }
                        served += 1;
                        if served.is_multiple_of(100) {
                            // Make the client sleep on the futex.
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    } else {
                        std::thread::yield_now();
                    }
                }
                served
            })
        };
        let mut out = Vec::new();
        for i in 0..2000 {
            let e = entry(i, i % 300);
            client.submit(&e).unwrap();
            assert!(client.wait_reply(deadline, Duration::ZERO), "reply {i}");
            assert!(client.take_reply(&mut out).unwrap());
            let mut want = e.clone();
            want.reverse();
            assert_eq!(out, want);
        }
        assert_eq!(server.join().unwrap(), 2000);
    }

    /// A reply that never comes: wait_reply ends at its deadline.
    #[test]
    fn waiting_ends_at_the_deadline() {
        let (_unit, client) = pair(4096);
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(!client.wait_reply(deadline, Duration::from_millis(1)));
        assert!(Instant::now() >= deadline);
    }

    const CHILD_ENV: &str = "STOWAGE_RING_TEST_CHILD";
    const ROUND_TRIPS: usize = 10_000;

    /// The client half of `ten_thousand_round_trips_across_processes`:
    /// maps the ring from an inherited fd, submits, kicks over the
    /// inherited socket when told to, futex-waits for each reply.
    /// Returns at once unless the parent started it.
    #[test]
    fn cross_process_child() {
        let Ok(spec) = std::env::var(CHILD_ENV) else {
            return;
        };
        let nums: Vec<usize> = spec.split(',').map(|s| s.parse().unwrap()).collect();
        let [ring_fd, sock_fd, bytes] = nums[..] else {
            panic!("bad {CHILD_ENV}: {spec}")
        };
        // Reopen the inherited fds through /proc (no raw fd adoption).
        let open = |n: usize| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/self/fd/{n}"))
                .unwrap()
        };
        let ring = Ring::open(OwnedFd::from(open(ring_fd)), bytes).unwrap();
        // A socket cannot be reopened through /proc: adopt it.
        use std::os::fd::FromRawFd;
        let sock_fd = i32::try_from(sock_fd).unwrap();
        // SAFETY: the parent left this fd open (not CLOEXEC) for this
        // process, where nothing else owns or closes it.
        let mut kick = UnixStream::from(unsafe { OwnedFd::from_raw_fd(sock_fd) });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut out = Vec::new();
        for i in 0..ROUND_TRIPS {
            let e = entry(i, i % (ring.max_entry() + 1));
            loop {
                match ring.submit(&e) {
                    Ok(true) => {
                        kick.write_all(&[1]).unwrap();
                        break;
                    }
                    Ok(false) => break,
                    Err(RingFull) => {
                        assert!(Instant::now() < deadline, "the ring stayed full");
                        std::thread::yield_now();
                    }
                }
            }
            // Half spin first, half sleep on the futex at once.
            let spin = Duration::from_micros(if i.is_multiple_of(2) { 50 } else { 0 });
            assert!(ring.wait_reply(deadline, spin), "no reply to {i}");
            assert!(ring.take_reply(&mut out).unwrap());
            assert_eq!(out.len(), 8, "reply {i}");
            assert_eq!(out, (i as u64 ^ 0xa5a5).to_le_bytes(), "reply {i}");
        }
    }

    /// A child process maps the ring from an inherited fd and makes 10,000
    /// round trips with this process as the unit, which parks when idle
    /// and is kicked over a socket pair.
    #[test]
    fn ten_thousand_round_trips_across_processes() {
        let bytes = RING_BYTES;
        let (ring, fd) = Ring::create(bytes).unwrap();
        let (mine, theirs) = UnixStream::pair().unwrap();
        // Inheritable copies (dup clears CLOEXEC), closed once spawned.
        let ring_fd = rustix::io::dup(&fd).unwrap();
        let sock_fd = rustix::io::dup(&theirs).unwrap();
        use std::os::fd::AsRawFd;
        let spec = format!("{},{},{bytes}", ring_fd.as_raw_fd(), sock_fd.as_raw_fd());
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "ring::tests::cross_process_child", "--nocapture"])
            .env(CHILD_ENV, spec)
            .spawn()
            .unwrap();
        drop((ring_fd, sock_fd, theirs, fd));
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut kicks = mine;
        kicks
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut req = Vec::new();
        let mut served = 0usize;
        let mut parks = 0usize;
        let mut done = false;
        while !done && Instant::now() < deadline {
            // Serve what is there, spinning a little before parking.
            let spin_until = Instant::now() + Duration::from_micros(20);
            let mut idle = true;
            while Instant::now() < spin_until || !idle {
                idle = true;
                if ring.take_request(&mut req).unwrap() {
                    idle = false;
                    assert_eq!(req, entry(served, served % (ring.max_entry() + 1)));
                    ring.post_reply(&(served as u64 ^ 0xa5a5).to_le_bytes())
                        .unwrap();
                    served += 1;
                    if served == ROUND_TRIPS {
                        done = true;
                        break;
                    }
                    if served.is_multiple_of(1000) {
                        // Slow down: the client sleeps on the futex.
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            if done {
                break;
            }
            if ring.park() {
                parks += 1;
                let mut b = [0u8; 64];
                match kicks.read(&mut b) {
                    Ok(0) => break, // the child is gone
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        if child.try_wait().unwrap().is_some() {
                            // Gone early: take what is left, then stop.
                            done = !ring.has_request();
                        }
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        // Stop the child by its pid whatever happened, then reap it.
        let status = match child.try_wait().unwrap() {
            Some(s) => s,
            None => {
                let wait_until = Instant::now() + Duration::from_secs(10);
                loop {
                    if let Some(s) = child.try_wait().unwrap() {
                        break s;
                    }
                    if Instant::now() > wait_until {
                        child.kill().unwrap();
                        break child.wait().unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        assert!(status.success(), "child: {status}");
        assert_eq!(served, ROUND_TRIPS);
        assert!(parks > 0, "the unit never parked");
    }

    /// What a hostile client can do to the header and the SQ.
    #[derive(Debug, Clone)]
    enum Act {
        /// Write bytes over the header or the SQ.
        Scribble(usize, Vec<u8>),
        /// Submit a well-formed entry.
        Submit(Vec<u8>),
        /// The unit takes a request (and replies to it if it can).
        Serve,
        Park,
    }

    fn act() -> impl proptest::strategy::Strategy<Value = Act> {
        use proptest::prelude::*;
        let sq_end = HEADER + (4096 - HEADER) / 2 / ALIGN * ALIGN;
        prop_oneof![
            (0..sq_end, proptest::collection::vec(any::<u8>(), 1..24))
                .prop_map(|(o, b)| Act::Scribble(o, b)),
            // Aligned index-sized scribbles, near plausible values.
            (0..6usize, 0..4096u64, any::<bool>()).prop_map(|(line, v, neg)| {
                let v = if neg { v.wrapping_neg() } else { v };
                Act::Scribble(line * 64, v.to_le_bytes().to_vec())
            }),
            proptest::collection::vec(any::<u8>(), 0..1000).prop_map(Act::Submit),
            Just(Act::Serve),
            Just(Act::Serve),
            Just(Act::Park),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// A client that scribbles over the header and the SQ never makes
        /// the unit side panic or read outside the ring: it gets entries no
        /// longer than max_entry, or RingCorrupt.
        #[test]
        fn a_hostile_client_only_corrupts_its_ring(acts in proptest::collection::vec(act(), 1..60)) {
            let (unit, client) = pair(4096);
            let mut out = Vec::new();
            for a in acts {
                match a {
                    Act::Scribble(o, b) => client.scribble(o, &b),
                    Act::Submit(e) => { let _ = client.submit(&e); }
                    Act::Serve => {
                        for _ in 0..4 {
                            match unit.take_request(&mut out) {
                                Ok(true) => {
                                    proptest::prop_assert!(out.len() <= unit.max_entry());
                                    let room = unit.reply_room();
                                    proptest::prop_assert!(room <= unit.max_entry());
                                    if room > 0 && room >= out.len() {
                                        proptest::prop_assert!(unit.post_reply(&out).is_ok());
                                    }
                                }
                                Ok(false) | Err(_) => break,
                            }
                        }
                    }
                    Act::Park => { let _ = unit.park(); let _ = unit.has_request(); }
                }
            }
        }

        /// The client side checks the unit's writes the same way: a unit
        /// that scribbles over the header and the CQ gets the client a
        /// RingCorrupt, never a panic or a read outside the ring.
        #[test]
        fn a_broken_unit_only_corrupts_its_ring(
            acts in proptest::collection::vec(
                (0..4096usize, proptest::collection::vec(proptest::num::u8::ANY, 1..24), 0..700usize),
                1..60,
            )
        ) {
            let (unit, client) = pair(4096);
            let mut out = Vec::new();
            let now = Instant::now();
            for (offset, bytes, len) in acts {
                let _ = unit.post_reply(&entry(offset, len));
                if offset % 3 == 0 {
                    unit.scribble(offset, &bytes);
                }
                let _ = client.submit(&bytes);
                let _ = client.wait_reply(now, Duration::ZERO);
                if let Ok(true) = client.take_reply(&mut out) {
                    proptest::prop_assert!(out.len() <= client.max_entry());
                }
            }
        }
    }
}
