//! What one small put and get cost the Rust client, without Python: the
//! round trip to a unit's process over its request ring, the client
//! library and the unit's handling, with a value too small for its copy
//! to count (issue 24: where a 64 KiB op from Python goes).
//!
//! Starts one unit (shm, the `stowage` binary beside this example), then
//! per round times `--calls` calls (after 1,000 untimed) of each of, in
//! one loop:
//!
//! - `blob put` / `blob get`: the blob API (`put_many` of one value,
//!   `get_into` of it), as `stowage bench` times its single ops;
//! - `rows put` / `rows get`: the rows × fields API that the Python
//!   package calls (`put` of a dense column of one row, `get_tensors_into`
//!   it), on the same unit.
//!
//! and prints each round's p50 in microseconds and the median over rounds.
//! Compare with `bench/latency_budget.py` (the same calls from Python).
//!
//! ```text
//! cargo run --release -p stowage-cli --example small_call -- [--bytes 64] [--rounds 5] [--calls 20000]
//! ```

use std::time::Instant;

use clap::Parser;
use stowage_cli::bench::quantile;
use stowage_client::{
    BlobPut, Client, ClientConfig, Column, DType, EntrySpec, Key, RowKey, Sink, SliceSink, Tensor,
    TensorAsk, DEFAULT_PARTITION,
};
use stowage_local::{LocalOptions, LocalPlane};

/// The Rust client's 64-byte put and get, blob and rows API, one unit.
#[derive(Parser)]
struct Args {
    /// Value size in bytes.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    bytes: u64,
    /// Rounds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Timed calls of each kind per round (after 1,000 untimed).
    #[arg(long, default_value_t = 20000, value_parser = clap::value_parser!(u64).range(1..))]
    calls: u64,
}

/// A rows get's sink: one buffer, the size of the value.
struct One<'a>(&'a mut [u8]);

impl<'x> Sink<TensorAsk<'x>> for One<'_> {
    fn slot(&mut self, _: TensorAsk<'x>) -> Result<&mut [u8], String> {
        Ok(&mut self.0[..])
    }
}

fn main() {
    let args = Args::parse();
    let (size, calls) = (args.bytes as usize, args.calls as usize);
    let stowage = stowage_cli::bench::stowage_binary(None).unwrap_or_else(|e| panic!("{e}"));
    let mut opts = LocalOptions::new(1, 256 << 20);
    opts.command = vec![stowage.into(), "unit".into()];
    let plane = LocalPlane::start(&opts).expect("starting a unit");
    let mut cfg = ClientConfig::new("small-call", plane.uds_addrs());
    cfg.secret = plane.secret().cloned();
    let client = Client::connect(cfg).expect("connecting over shm");
    let value: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut out = vec![0u8; size];
    const KEYS: u64 = 64;
    let names = ["blob put", "blob get", "rows put", "rows get"];
    let mut got: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..args.rounds {
        let mut t: Vec<Vec<f64>> = vec![Vec::with_capacity(calls); names.len()];
        for i in 0..(1000 + calls) as u64 {
            let row = i % KEYS;
            let key = Key::new(row, "v");
            let t0 = Instant::now();
            client
                .put_many(
                    &[BlobPut {
                        unit: 0,
                        partition: DEFAULT_PARTITION,
                        blob: stowage_client::new_blob_id(),
                        segments: vec![&value],
                        entries: vec![EntrySpec {
                            key: key.clone(),
                            offset: 0,
                            len: size as u64,
                            meta: Vec::new(),
                        }],
                    }],
                    client.deadline(),
                )
                .expect("blob put");
            let t1 = Instant::now();
            let mut bufs = [&mut out[..]];
            let mut sink = SliceSink::new(&mut bufs);
            client
                .get_into(DEFAULT_PARTITION, &[(0, key)], &mut sink, client.deadline())
                .expect("blob get");
            let t2 = Instant::now();
            let keys = [RowKey::Index(row)];
            let column = Tensor::new(DType::U8, vec![1, size as u64], &value).expect("a tensor");
            client
                .put(
                    "p",
                    &keys,
                    &[("v", Column::Dense(column))],
                    Some(0),
                    client.deadline(),
                )
                .expect("rows put");
            let t3 = Instant::now();
            client
                .get_tensors_into(
                    "p",
                    &keys,
                    &["v"],
                    Some(0),
                    &mut One(&mut out),
                    client.deadline(),
                )
                .expect("rows get");
            let t4 = Instant::now();
            if i >= 1000 {
                for (k, (a, b)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4)]
                    .into_iter()
                    .enumerate()
                {
                    t[k].push((b - a).as_secs_f64() * 1e6);
                }
            }
            if row == KEYS - 1 {
                // Untimed: the next pass puts new values, not replacements.
                let rows: Vec<u64> = (0..KEYS).collect();
                let row_keys: Vec<RowKey> = rows.iter().map(|&r| RowKey::Index(r)).collect();
                client.clear_rows(&rows, client.deadline()).expect("clear");
                client
                    .clear("p", &row_keys, Some(0), client.deadline())
                    .expect("clear");
            }
        }
        assert_eq!(out, value, "the value read back differs from the one put");
        for (k, v) in t.iter_mut().enumerate() {
            got[k].push(quantile(v, 0.5));
        }
    }
    println!("{size} bytes, 1 unit over shm, p50 of {calls} calls per round, us");
    for (name, v) in names.iter().zip(&got) {
        let rounds: Vec<String> = v.iter().map(|x| format!("{x:6.2}")).collect();
        let mut sorted = v.clone();
        println!(
            "{name:9} {} | median {:6.2}",
            rounds.join(" "),
            quantile(&mut sorted, 0.5)
        );
    }
}
