//! How fast a repair gives a killed unit's rows their second copy again
//! (docs/replication.md#repair), against a memory copy of the same bytes
//! in the same run.
//!
//! Per round: three units (the `stowage` binary beside this example),
//! 2 copies of every row; a writer process puts `--total` MiB of values
//! of `--size` MiB; unit 1 is killed; a new process (this program again)
//! connects, is told unit 1 is gone, and runs one repair pass
//! ([`Client::repair`], default repair rate), which copies unit 0's rows
//! to unit 2 and unit 1's rows from unit 2 to unit 0: two thirds of
//! what was put. It prints the bytes repaired per second, and, in the
//! same process, the rate of a copy of that many cold bytes between two
//! buffers.
//!
//! ```text
//! cargo build --release -p stowage-cli --bin stowage --example repair_rate
//! target/release/examples/repair_rate [--rounds 3] [--total 512] [--size 1] [--transport shm|tcp]
//! ```

use std::process::Command;
use std::time::{Duration, Instant};

use stowage_cli::bench::{arg, quantile};
use stowage_client::{Client, ClientConfig, Column, DType, RowKey, Secret, Tensor, UnitAddr};
use stowage_local::{LocalOptions, LocalPlane};

const MIB: usize = 1 << 20;

fn client(addrs: &str, secret: &str, shm: bool) -> Client {
    let addrs: Vec<UnitAddr> = addrs.split(',').map(|s| s.parse().unwrap()).collect();
    let mut cfg = ClientConfig::new("repair-rate", addrs);
    cfg.secret = Some(Secret::from_file(std::path::Path::new(secret)).unwrap());
    cfg.shm = shm;
    cfg.replicas = 2;
    cfg.timeout = Duration::from_secs(120);
    Client::connect(cfg).unwrap()
}

/// `child put ADDRS SECRET SHM SIZE TOTAL`: put the values.
/// `child repair ADDRS SECRET SHM`: repair, print `bytes seconds memcpy_seconds`.
fn child(a: &[String]) {
    let (role, addrs, secret, shm) = (&a[0], &a[1], &a[2], a[3] == "shm");
    let c = client(addrs, secret, shm);
    if role == "put" {
        let size: usize = a[4].parse().unwrap();
        let total: usize = a[5].parse().unwrap();
        let buf: Vec<u8> = (0..total).map(|i| (i * 31 / 7) as u8).collect();
        for (i, chunk) in buf.chunks(size).enumerate() {
            let t = Tensor {
                dtype: DType::U8,
                shape: vec![chunk.len() as u64],
                data: chunk,
            };
            let col = Column::Jagged(vec![t]);
            c.put(
                "p",
                &[RowKey::Index(i as u64)],
                &[("tokens", col)],
                None,
                c.deadline(),
            )
            .expect("put");
        }
        return;
    }
    c.unit_gone(1);
    let t0 = Instant::now();
    let r = c.repair(c.deadline()).expect("repair");
    let secs = t0.elapsed().as_secs_f64();
    assert!(r.left == 0 && r.skipped == 0, "{r:?}");
    // The same bytes copied between two cold buffers.
    let n = r.bytes as usize;
    let src: Vec<u8> = (0..n).map(|i| (i * 13) as u8).collect();
    let mut dst = vec![0u8; n];
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let copy = t0.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    println!("{} {secs} {copy}", r.bytes);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(&args[2..]);
    }
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let total = arg(&args, "--total", "512").parse::<usize>().unwrap() * MIB;
    let size = arg(&args, "--size", "1").parse::<usize>().unwrap() * MIB;
    let transport = arg(&args, "--transport", "shm");
    let stowage = stowage_cli::bench::stowage_binary(None).unwrap_or_else(|e| panic!("{e}"));
    let exe = std::env::current_exe().unwrap();
    let run = |a: Vec<String>| -> String {
        let out = Command::new(&exe).arg("child").args(&a).output().unwrap();
        assert!(
            out.status.success(),
            "{a:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (mut rate, mut ratio) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut opts = LocalOptions::new(3, (2 * total + (64 << 20)) as u64);
        opts.command = vec![stowage.clone().into(), "unit".into()];
        let mut plane = LocalPlane::start(&opts).expect("starting three units");
        let secret = plane.private_dir().join("secret").display().to_string();
        let addrs = if transport == "shm" {
            plane.uds_addrs()
        } else {
            plane.tcp_addrs()
        };
        let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        let addrs = addrs.join(",");
        let common = |role: &str| {
            vec![
                role.into(),
                addrs.clone(),
                secret.clone(),
                transport.clone(),
            ]
        };
        let mut put = common("put");
        put.extend([size.to_string(), total.to_string()]);
        run(put);
        plane.kill9(1);
        let out = run(common("repair"));
        let f: Vec<f64> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
        rate.push(f[0] / f[1] / 1e9);
        ratio.push(f[1] / f[2]);
        plane.stop();
    }
    let (r, x) = (quantile(&mut rate, 0.5), quantile(&mut ratio, 0.5));
    println!(
        "{transport}, {} MiB values, {} MiB put with 2 copies on 3 units, unit 1 killed; median over {rounds} rounds:",
        size / MIB,
        total / MIB
    );
    println!(
        "repair {r:.2} GB/s [{:.2}-{:.2}] of the bytes it copied; {x:.1}x the time of a memory copy of those bytes",
        rate[0],
        rate[rate.len() - 1]
    );
}
