//! This process's id without a system call per look: kept in a private
//! page that the kernel hands a child of `fork` zero-filled
//! (`MADV_WIPEONFORK`, Linux 4.14), so a child sees 0, looks its own id
//! up once and keeps it there. Where the kernel lacks the advice (or the
//! page cannot be mapped), every look is a `getpid`.
//!
//! The page is set up without a lock (a fork while another thread held
//! one would leave it held in the child): the first callers race to
//! publish theirs, the losers unmap their own.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use memmap2::MmapMut;

/// Where the page is not there: the look is a `getpid`.
const UNAVAILABLE: *mut AtomicU32 = std::ptr::dangling_mut();

/// The page's word, once set up: null until the first look,
/// [`UNAVAILABLE`] where it could not be.
static WORD: AtomicPtr<AtomicU32> = AtomicPtr::new(std::ptr::null_mut());

/// This process's id: `std::process::id()`, answered by a load from the
/// second look on, and again after each fork once the child has looked
/// it up.
pub fn process_id() -> u32 {
    let Some(word) = word() else {
        return std::process::id();
    };
    match word.load(Ordering::Relaxed) {
        0 => {
            // A fresh page: the first look, or the first in a forked
            // child. Racing threads store the same id.
            let pid = std::process::id();
            word.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

/// The page's word, set up on the first call.
fn word() -> Option<&'static AtomicU32> {
    let mut p = WORD.load(Ordering::Acquire);
    if p.is_null() {
        let made = wiped_on_fork().unwrap_or(UNAVAILABLE);
        p = match WORD.compare_exchange(
            std::ptr::null_mut(),
            made,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => made,
            Err(theirs) => {
                if made != UNAVAILABLE {
                    // SAFETY: `made` is the start of the page-sized
                    // mapping `wiped_on_fork` mapped and leaked, which no
                    // one else ever saw (publishing it failed).
                    let _ = unsafe { rustix::mm::munmap(made.cast(), LEN) };
                }
                theirs
            }
        };
    }
    if p == UNAVAILABLE {
        return None;
    }
    // SAFETY: `p` is the start of a page-sized, page-aligned private
    // mapping that is never unmapped once published (leaked above): valid
    // for the life of the process, aligned for a u32, and only ever
    // accessed as this atomic. The kernel replaces it with a zero page in
    // a child at fork, which is a new process: within one process its
    // contents change only through this atomic.
    Some(unsafe { &*p })
}

/// The mapping's length: one page wherever pages are 4 KiB or larger
/// (the kernel rounds every call's length up to whole pages).
const LEN: usize = 4096;

/// A zeroed private page marked `MADV_WIPEONFORK`, leaked: its word.
fn wiped_on_fork() -> Option<*mut AtomicU32> {
    let mut map = MmapMut::map_anon(LEN).ok()?;
    let ptr = map.as_mut_ptr();
    // SAFETY: `ptr..ptr + LEN` is exactly the mapping made above, alive
    // (and borrowed by nothing) during the call; the advice changes what a
    // child of a later fork sees there, not this process's contents.
    let advised =
        unsafe { rustix::mm::madvise(ptr.cast(), LEN, rustix::mm::Advice::LinuxWipeOnFork) };
    if advised.is_err() {
        return None; // dropping `map` unmaps it
    }
    std::mem::forget(map);
    Some(ptr.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_id_is_getpid() {
        assert_eq!(process_id(), std::process::id());
        assert_eq!(process_id(), std::process::id());
        assert!(
            word().is_some(),
            "this kernel should have MADV_WIPEONFORK (Linux 4.14 and later)"
        );
    }

    #[test]
    fn a_forked_child_sees_its_own_id() {
        let parent = process_id();
        let word = word().expect("MADV_WIPEONFORK");
        assert_eq!(word.load(Ordering::Relaxed), parent);
        let (mut read, mut write) = std::io::pipe().expect("pipe");
        // SAFETY: the child calls only what is safe after a fork of a
        // multi-threaded process: an atomic load and store, getpid, write
        // and _exit (no allocation, no lock).
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let before = word.load(Ordering::Relaxed);
            let id = process_id();
            let mut msg = [0u8; 8];
            msg[..4].copy_from_slice(&before.to_le_bytes());
            msg[4..].copy_from_slice(&id.to_le_bytes());
            let _ = std::io::Write::write(&mut write, &msg);
            // SAFETY: ends the child at once, running nothing of the
            // parent's (no destructors, no test harness).
            unsafe { libc::_exit(0) };
        }
        drop(write);
        let mut msg = [0u8; 8];
        let n = std::io::Read::read(&mut read, &mut msg).expect("the child's report");
        let mut status = 0;
        // SAFETY: waits for the child forked above, by its pid.
        let waited = unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(waited, child);
        assert_eq!(n, 8, "the child wrote no report");
        let before = u32::from_le_bytes(msg[..4].try_into().unwrap());
        let id = u32::from_le_bytes(msg[4..].try_into().unwrap());
        assert_eq!(
            before, 0,
            "the child saw its parent's page, not a wiped one"
        );
        assert_eq!(id, child as u32, "the child's process_id is not its pid");
        assert_eq!(process_id(), parent);
    }
}
