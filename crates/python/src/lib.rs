//! # stowage-python: the extension module `stowage._native`
//!
//! A thin layer over [`stowage_client`] and [`stowage_cli`]; the Python
//! package `stowage` (`python/stowage`) builds its API on top of it.
//!
//! * `main` runs the `stowage` command line (`python -m stowage ...`).
//! * [`local::LocalPlane`] starts unit processes on this machine.
//! * [`unit::Unit`] runs a unit inside this process, on its own threads
//!   (what a Ray actor of `stowage.ray` holds).
//! * [`client::Client`] puts, gets and clears rows of numpy arrays. Array
//!   memory goes to Rust as it is (no copy on the Python side); every
//!   transfer runs with the GIL released.
//! * The exceptions ([`errors`]) mirror [`stowage_client::Error`].
//! * [`logbridge`]: Rust log events to Python's `logging` (logger
//!   `stowage`).
//! * [`cluster`]: placement of units over a job's clusters and the config
//!   file (`stowage.placement`, `stowage.config`).

// The crate has no public Rust API (Python reaches its private modules
// through PyO3): its reference is built with --document-private-items
// (scripts/docs), where these links resolve.
#![allow(rustdoc::private_intra_doc_links)]

use pyo3::prelude::*;

mod arrays;
mod client;
mod cluster;
mod dicts;
mod directory;
mod errors;
mod local;
mod logbridge;
mod read_sinks;
mod repair;
mod row_keys;
mod unit;
mod view_calls;

/// Run the `stowage` command line with `argv` (the first item is the
/// program name) and return its exit status. The GIL is released while it
/// runs (a unit runs until its stdin closes or the process is killed).
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || exit_status(stowage_cli::cli::main_with_args(argv)))
}

/// `ExitCode` cannot be inspected, only compared: the command line exits
/// with 0 (success), 1 (failure) or 2 (usage error).
fn exit_status(code: std::process::ExitCode) -> i32 {
    use std::process::ExitCode;
    if code == ExitCode::SUCCESS {
        0
    } else if code == ExitCode::from(2) {
        2
    } else {
        1
    }
}

/// The extension's own allocations (a get or view makes several per
/// value: keys, metadata, shapes) come from mimalloc: glibc's malloc and
/// free were a third of a 3,072-value view here. Python's and numpy's own
/// memory is untouched.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_class::<client::Client>()?;
    m.add_class::<local::LocalPlane>()?;
    m.add_function(wrap_pyfunction!(directory::host_id, m)?)?;
    m.add_function(wrap_pyfunction!(directory::resolve_directory, m)?)?;
    m.add_function(wrap_pyfunction!(directory::generate_secret, m)?)?;
    m.add_function(wrap_pyfunction!(directory::read_directory_file, m)?)?;
    m.add_function(wrap_pyfunction!(directory::write_directory_file, m)?)?;
    m.add_function(wrap_pyfunction!(directory::directory_secret, m)?)?;
    m.add_function(wrap_pyfunction!(directory::directory_replicas, m)?)?;
    m.add_function(wrap_pyfunction!(directory::directory_hosts, m)?)?;
    m.add_class::<unit::Unit>()?;
    m.add_function(wrap_pyfunction!(repair::repair, m)?)?;
    m.add_function(wrap_pyfunction!(repair::rebuild_copies, m)?)?;
    m.add_function(wrap_pyfunction!(repair::under_replicated, m)?)?;
    m.add_function(wrap_pyfunction!(repair::rejoin, m)?)?;
    m.add_function(wrap_pyfunction!(repair::merge_claims_states, m)?)?;
    m.add_function(wrap_pyfunction!(logbridge::route_logs, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::host_empty, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::host_cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::set_host_cache, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::copy, m)?)?;
    errors::register(m)?;
    cluster::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
