//! Arbitrary bytes into `decode_frame::<Request>` and `decode_frame::<Response>`
//! with the default `Limits`; every frame that parses must re-encode to a
//! frame that decodes to the same envelope and payload.

#![no_main]

use libfuzzer_sys::fuzz_target;
use stowage_wire::Limits;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    common::check(data, &Limits::default());
});
