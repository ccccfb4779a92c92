//! What a new process's first copies through a unit's slab cost on this
//! host, against a copy of the same bytes between cold, faulted-in buffers
//! (issue 37: "1 MiB from a fresh process").
//!
//! A slab is created and faulted in as a unit does. Then, per round, with
//! `--count` values of `--value` bytes at consecutive offsets (as a fresh
//! process's puts land in a unit that has room):
//!
//! - `memcpy`: copies from a cold source to a cold destination, both
//!   faulted in beforehand (the limit the benchmarks compare with);
//! - `write, new mapping`: [`Slab::write`] through a mapping just made
//!   ([`Slab::open`], what a client gets), which fills the page tables of
//!   each 2 MiB region it reaches first in one `MADV_POPULATE_WRITE`;
//! - `write, tables filled`: the same through a mapping whose page tables
//!   were filled before the clock started ([`Slab::fault_in`] of it all):
//!   the copy alone;
//! - `read, new mapping` / `read, tables filled`: the same for reads into a
//!   faulted-in destination.
//!
//! The gap between a new mapping and a filled one is the kernel filling
//! page tables (4 KiB pages unless the host gives the slab huge pages):
//! no client code runs in it.
//!
//! ```text
//! cargo run --release -p stowage-shm --example first_touch -- [--value-kib 1024] [--count 128] [--rounds 5]
//! ```

use std::time::Instant;

use stowage_shm::Slab;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> std::io::Result<()> {
    let value = arg("--value-kib", 1024) << 10;
    let count = arg("--count", 128);
    let rounds = arg("--rounds", 5).max(1);
    let total = value * count;
    // Room for the slab's values and for cold offsets in the buffers.
    let unit = Slab::create("stowage-first-touch", (total * 2) as u64)?;
    unit.fault_in(0, unit.len(), false)?;
    let src = vec![7u8; total * 2];
    let mut dst = vec![1u8; total * 2];
    let mut rows: [Vec<f64>; 5] = Default::default();
    for round in 0..rounds {
        // Each round moves to bytes the last one did not touch.
        let cold = (round % 2) * total;
        let t = Instant::now();
        for i in 0..count {
            let (s, d) = (cold + i * value, total - cold + i * value);
            dst[d..d + value].copy_from_slice(&src[s..s + value]);
        }
        rows[0].push(t.elapsed().as_secs_f64());
        for filled in [false, true] {
            let fd = unit.fd().try_clone_to_owned()?;
            let client = Slab::open(fd, unit.len())?;
            if filled {
                client.fault_in(0, client.len(), false)?;
            }
            let t = Instant::now();
            for i in 0..count {
                let s = cold + i * value;
                client
                    .write((i * value) as u64, &src[s..s + value])
                    .map_err(std::io::Error::other)?;
            }
            rows[1 + usize::from(filled)].push(t.elapsed().as_secs_f64());
            drop(client);
            let fd = unit.fd().try_clone_to_owned()?;
            let client = Slab::open(fd, unit.len())?;
            if filled {
                client.fault_in(0, client.len(), false)?;
            }
            let t = Instant::now();
            for i in 0..count {
                let d = total - cold + i * value;
                client
                    .read((i * value) as u64, &mut dst[d..d + value])
                    .map_err(std::io::Error::other)?;
            }
            rows[3 + usize::from(filled)].push(t.elapsed().as_secs_f64());
        }
    }
    let copy = median(rows[0].clone());
    println!(
        "{count} values of {} KiB, slab pages: {:?}; median of {rounds} rounds",
        value >> 10,
        unit.page_mode()
    );
    println!("{:<24} {:>10} {:>8}", "", "us/value", "x memcpy");
    let names = [
        "memcpy (cold, faulted)",
        "write, new mapping",
        "write, tables filled",
        "read, new mapping",
        "read, tables filled",
    ];
    for (name, times) in names.iter().zip(rows) {
        let t = median(times);
        println!(
            "{name:<24} {:>10.1} {:>7.2}x",
            t / count as f64 * 1e6,
            copy / t
        );
    }
    Ok(())
}
