//! As `frame_decoder`, with tight `Limits` so that inputs reach the
//! header-size, payload-size, count, name-length and metadata-length
//! refusals.

#![no_main]

use libfuzzer_sys::fuzz_target;
use stowage_wire::Limits;

#[path = "common.rs"]
mod common;

const LIMITS: Limits = Limits {
    max_header: 256,
    max_keys: 4,
    max_name: 8,
    max_payload: 1024,
    max_meta: 8,
};

fuzz_target!(|data: &[u8]| {
    common::check(data, &LIMITS);
});
