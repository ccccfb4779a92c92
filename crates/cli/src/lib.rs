//! # stowage-cli: the `stowage` command
//!
//! * `stowage unit` runs one storage unit (see `stowage-unit`).
//! * `stowage local` starts a local data plane ([`local::LocalPlane`]: N
//!   unit processes on this machine), runs the demonstration
//!   [`workload`] against it and prints what it did and how fast.
//! * `stowage bench` measures put/get against memcpy and raw TCP
//!   ([`bench`]).
//! * `stowage stats` prints every unit's counters; `stowage status`
//!   ([`status`]) every unit's state and traffic at a glance.
//!
//! The library half exists so that integration tests and benchmarks start
//! local planes the same way the command does.

#![forbid(unsafe_code)]

pub mod bench;
pub mod cli;
pub mod local;
pub mod status;
pub mod workload;

/// Parse a byte size: `1GiB`, `256MiB`, `64KiB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("not a size: {s:?} ({e}); use e.g. 256MiB or 1GiB"))
}

/// Parse a duration: `30s`, `500ms`, `2m`.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("not a duration: {s:?} ({e})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert_eq!(parse_duration("500ms").unwrap().as_millis(), 500);
        assert!(parse_duration("soon").is_err());
    }
}
