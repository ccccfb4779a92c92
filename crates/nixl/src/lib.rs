//! One-sided transfers over NIXL (UCX): what stowage's `nixl` transport
//! moves bytes with.
//!
//! * A unit creates one [`Agent`], registers its slab once
//!   ([`Agent::register_slab`]) and hands its [`Agent::metadata`] and the
//!   slab's address to every client that asks (the wire's `NixlInfo`).
//! * A client creates one [`Agent`] per process-wide client, loads each
//!   unit's metadata ([`Agent::load_remote`]) and registers one
//!   [`Staging`] buffer per connection, grown when a call needs more and
//!   never registered per call.
//! * A transfer is one [`Agent::post`] of every range of a call between the
//!   staging buffer and the unit's slab, completed by polling
//!   ([`Transfer::wait`]) within the caller's deadline. A transfer that has
//!   not completed is never dropped while it may still run: it keeps its
//!   staging buffer, and the caller keeps the unit connection that holds
//!   the remote range (the fencing rules, docs/fencing.md).
//!
//! Built without the `nixl` feature, every constructor answers
//! [`NixlError::NotBuilt`]: the rest of stowage builds and runs without
//! NIXL, libclang or UCX.

use std::time::Instant;

/// Why NIXL could not be used or a transfer failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NixlError {
    #[error("this stowage was built without the nixl feature (cargo --features nixl)")]
    NotBuilt,
    #[error(
        "the NIXL library could not be loaded: put the directory of libnixl_capi.so on \
         LD_LIBRARY_PATH (the nixl-cu12 wheel carries it; see docs/nixl.md)"
    )]
    NotLoaded,
    /// `require_rdma` is on and UCX may run over tcp.
    #[error("{0}")]
    NotRdma(String),
    #[error("nixl {what}: {detail}")]
    Failed { what: &'static str, detail: String },
}

/// The UCX transports that move bytes without the CPU: InfiniBand and
/// RoCE verbs (rc, ud, dc and their accelerated forms), plus what UCX
/// needs beside them on one host (self, shared memory, cma, CUDA copies).
const RDMA_TLS: &[&str] = &[
    "rc",
    "rc_v",
    "rc_x",
    "rc_verbs",
    "rc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
    "ud_verbs",
    "ud_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "ib",
    "self",
    "sm",
    "shm",
    "cma",
    "knem",
    "xpmem",
    "posix",
    "sysv",
    "cuda_copy",
    "cuda_ipc",
    "gdr_copy",
    "rocm_copy",
    "rocm_ipc",
];

/// Whether UCX is held to RDMA transports, as `UCX_TLS` tells it: `Ok` when
/// every name it lists is an RDMA (or same-host) transport. Unset, `all`,
/// `tcp` or a `^`-exclusion list let UCX fall back to tcp, which moves
/// every byte through the kernel on both hosts' CPUs.
pub fn check_rdma(ucx_tls: Option<&str>) -> Result<(), NixlError> {
    let refuse = |why: String| {
        Err(NixlError::NotRdma(format!(
            "require_rdma is on and {why}: set UCX_TLS to RDMA transports (for example \
             UCX_TLS=rc,ud,sm,self) or turn require_rdma off to run nixl over UCX tcp \
             (tests, hosts without RDMA NICs)"
        )))
    };
    let Some(tls) = ucx_tls.map(str::trim).filter(|t| !t.is_empty()) else {
        return refuse("UCX_TLS is not set (UCX may pick tcp)".into());
    };
    if tls.starts_with('^') {
        return refuse(format!("UCX_TLS={tls} only excludes transports"));
    }
    for t in tls.split(',').map(str::trim) {
        if !RDMA_TLS.contains(&t) {
            return refuse(format!(
                "UCX_TLS names {t:?}, which is not an RDMA transport"
            ));
        }
    }
    Ok(())
}

/// A transfer's direction, seen from the agent that posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Local staging → remote memory.
    Write,
    /// Remote memory → local staging.
    Read,
}

/// How a wait for a transfer ended without success.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WaitError {
    /// Still running at the deadline: it may still land.
    #[error("the transfer had not completed at the deadline")]
    Deadline,
    /// NIXL reported the transfer failed (the peer died, the link broke).
    /// Whether some bytes were moved is unknown.
    #[error("{0}")]
    Failed(NixlError),
}

/// One range of a transfer: `len` bytes at `local` (an offset in the
/// staging buffer) and at `remote` (an address in the peer's registered
/// memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub local: usize,
    pub remote: u64,
    pub len: usize,
}

#[cfg(feature = "nixl")]
mod imp;
#[cfg(feature = "nixl")]
pub use imp::{Agent, Registered, SlabRegistration, Staging, Transfer};

#[cfg(not(feature = "nixl"))]
mod none;
#[cfg(not(feature = "nixl"))]
pub use none::{Agent, Registered, SlabRegistration, Staging, Transfer};

/// How long a unit's NIXL progress thread sleeps between rounds. NIXL's
/// default (no sleep) takes a core per agent: on a 2-core VM it made every
/// transfer wait for the CPU (a 1 MiB put took 3.7 ms, 0.33 ms with a
/// sleep). 20 µs, 50 µs and 1 ms gave the same put and get latency over
/// UCX tcp+cma and over tcp alone, and 1 ms costs an idle unit 3% of a
/// core.
pub const UNIT_PROGRESS: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether this build has the nixl path.
pub const BUILT: bool = cfg!(feature = "nixl");

/// Poll `poll` until it reports completion or failure, or `deadline`.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
fn wait_until(
    deadline: Instant,
    mut poll: impl FnMut() -> Result<bool, NixlError>,
) -> Result<(), WaitError> {
    let mut spins = 0u32;
    loop {
        match poll() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(WaitError::Failed(e)),
        }
        if Instant::now() >= deadline {
            return Err(WaitError::Deadline);
        }
        // Poll hot for a few microseconds (a cma copy finishes in the
        // post), then yield the core.
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 4096 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_is_required_of_ucx_tls() {
        assert!(check_rdma(Some("rc,ud,sm,self")).is_ok());
        assert!(check_rdma(Some(" rc_x , self ")).is_ok());
        for bad in [
            None,
            Some(""),
            Some("tcp"),
            Some("rc,tcp"),
            Some("all"),
            Some("^tcp"),
        ] {
            let e = check_rdma(bad).unwrap_err();
            assert!(matches!(e, NixlError::NotRdma(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains("require_rdma"), "{e}");
        }
    }

    #[test]
    fn waits_end_at_the_deadline_or_the_first_answer() {
        let t = Instant::now();
        let r = wait_until(t + std::time::Duration::from_millis(30), || Ok(false));
        assert!(matches!(r, Err(WaitError::Deadline)));
        assert!(t.elapsed() >= std::time::Duration::from_millis(30));
        let mut n = 0;
        let r = wait_until(t + std::time::Duration::from_secs(5), || {
            n += 1;
            Ok(n == 100)
        });
        assert!(r.is_ok() && n == 100);
        let r = wait_until(t + std::time::Duration::from_secs(5), || {
            Err(NixlError::Failed {
                what: "x",
                detail: "y".into(),
            })
        });
        assert!(matches!(r, Err(WaitError::Failed(_))));
    }
}
