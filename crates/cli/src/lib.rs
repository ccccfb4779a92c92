//! # stowage-cli: the `stowage` command
//!
//! * `stowage unit` runs one storage unit (see `stowage-unit`).
//! * `stowage local` starts a local data plane ([`stowage_local::LocalPlane`]: N
//!   unit processes on this machine), runs the demonstration
//!   [`workload`] against it and prints what it did and how fast.
//! * `stowage bench` measures put/get against memcpy and raw TCP
//!   ([`bench`](mod@bench)).
//! * `stowage stats` prints every unit's counters; `stowage status`
//!   ([`status`]) every unit's state and traffic at a glance.
//! * `stowage repair` ([`repair`](mod@repair)) gives the rows of a plane with
//!   copies their copies again after a unit's death.
//!
//! The library half exists so that integration tests and benchmarks start
//! local planes the same way the command does.

#![forbid(unsafe_code)]

pub mod bench;
pub mod cli;
pub mod repair;
pub mod status;
mod unit;
pub mod workload;

pub use stowage_config::{parse_duration, parse_size};
