//! What the re-executed children run: `--child` (sessions held),
//! `--fg-child` (the foreground loop, for bench/scale_sim.py) and
//! `--flood-child` (a flood from another user).

use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stowage_client::{Client, Secret, UnitAddr};

use crate::flood::Flood;
use crate::foreground::{foreground, quantile};
use crate::{arg, client_config, one_line, put_get, raise_nofile, value, Res, VALUE};

/// The secret's hex (or an empty line: none) from the first line of stdin.
pub(crate) fn read_secret(stdin: &mut impl BufRead) -> Res<Option<Secret>> {
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    match line.trim() {
        "" => Ok(None),
        hex => Secret::from_hex(hex, "the parent's secret")
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

/// `--child --addr ADDR [--addr ADDR].. --sessions N --tag T --openers K
/// --timeout SECS`; the secret's hex (or an empty line) on stdin. Each
/// session is one client of every unit given that puts and gets one value
/// on each (so it holds a session on each, lazy connects or not). Prints
/// one line `OPENED ok=.. failed=.. secs=.. nofile=.. first_error=..`,
/// then holds its clients until stdin says `stop` or closes.
pub(crate) fn child(args: &[String]) -> Res<()> {
    let mut addrs = Vec::new();
    let (mut sessions, mut tag, mut openers, mut timeout) = (1000usize, 0u64, 32usize, 5.0f64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--addr" => addrs.push(value(a, &mut it)?.parse::<UnitAddr>()?),
            "--sessions" => sessions = arg(a, &mut it)?,
            "--tag" => tag = arg(a, &mut it)?,
            "--openers" => openers = arg(a, &mut it)?,
            "--timeout" => timeout = arg(a, &mut it)?,
            o => return Err(format!("child: unknown argument {o:?}")),
        }
    }
    if addrs.is_empty() {
        return Err("child: --addr missing".into());
    }
    let units = addrs.len() as u64;
    let mut stdin = BufReader::new(std::io::stdin());
    let secret = read_secret(&mut stdin)?;
    let nofile = raise_nofile();
    let timeout = Duration::from_secs_f64(timeout);
    let next = AtomicUsize::new(0);
    let failed = AtomicU64::new(0);
    let first_error = Mutex::new(None::<String>);
    let held = Mutex::new(Vec::with_capacity(sessions));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..openers.clamp(1, sessions.max(1)) {
            s.spawn(|| {
                let value = vec![(tag % 251) as u8; VALUE];
                let mut out = vec![0u8; VALUE];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= sessions {
                        return;
                    }
                    // Rows `units` apart from each other's: one on each unit.
                    let first = ((tag + 1) << 32) + i as u64 * units;
                    let r = Client::connect(client_config(&addrs, secret.as_ref(), timeout))
                        .map_err(|e| format!("connect: {e}"))
                        .and_then(|c| {
                            (first..first + units)
                                .try_for_each(|row| put_get(&c, row, &value, &mut out))
                                .map(|()| c)
                        });
                    match r {
                        Ok(c) => held.lock().unwrap_or_else(|p| p.into_inner()).push(c),
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            first_error
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    let held = held.into_inner().unwrap_or_else(|p| p.into_inner());
    let first = first_error
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_default();
    println!(
        "OPENED ok={} failed={} secs={:.1} nofile={nofile} first_error={}",
        held.len(),
        failed.load(Ordering::Relaxed),
        t.elapsed().as_secs_f64(),
        one_line(&first)
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Idle, holding every session, until told to stop (or the parent is gone).
    let mut line = String::new();
    loop {
        line.clear();
        match stdin.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "stop" => break,
            Ok(_) => {}
        }
    }
    // The sockets close with the process.
    std::process::exit(0);
}

/// `--fg-child --addr ADDR [--addr ADDR].. --seconds S --timeout SECS`;
/// the secret's hex (or an empty line) on stdin. One client of every unit
/// given runs the foreground loop (rows spread over the units) and prints
/// `FG ops=.. secs=.. op_p50=.. op_p99=.. pair_p50=.. pair_p99=..
/// errors=.. first_error=..` (latencies in µs). For bench/scale_sim.py.
pub(crate) fn fg_child(args: &[String]) -> Res<()> {
    let (mut addrs, mut secs, mut timeout) = (Vec::new(), 5.0f64, 5.0f64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--addr" => addrs.push(value(a, &mut it)?.parse::<UnitAddr>()?),
            "--seconds" => secs = arg(a, &mut it)?,
            "--timeout" => timeout = arg(a, &mut it)?,
            o => return Err(format!("fg-child: unknown argument {o:?}")),
        }
    }
    if addrs.is_empty() {
        return Err("fg-child: --addr missing".into());
    }
    let secret = read_secret(&mut BufReader::new(std::io::stdin()))?;
    let timeout = Duration::from_secs_f64(timeout);
    let c = Client::connect(client_config(&addrs, secret.as_ref(), timeout))
        .map_err(|e| format!("connect: {e}"))?;
    let mut fg = foreground(&c, secs);
    println!(
        "FG ops={} secs={:.3} op_p50={:.1} op_p99={:.1} pair_p50={:.1} pair_p99={:.1} errors={} first_error={}",
        fg.ops,
        fg.secs,
        quantile(&mut fg.op_lat, 0.5),
        quantile(&mut fg.op_lat, 0.99),
        quantile(&mut fg.pair_lat, 0.5),
        quantile(&mut fg.pair_lat, 0.99),
        fg.errors,
        one_line(fg.first_error.as_deref().unwrap_or(""))
    );
    Ok(())
}

/// `--flood-child --tcp ADDR --conns N`: the flood (see `Flood::start`)
/// from this process; prints `FLOOD open=.. reopened=.. failed=..` every
/// 200 ms until stdin says `stop` or closes.
pub(crate) fn flood_child(args: &[String]) -> Res<()> {
    let (mut addr, mut n) = (None, 1000usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--tcp" => addr = Some(arg(a, &mut it)?),
            "--conns" => n = arg(a, &mut it)?,
            o => return Err(format!("flood-child: unknown argument {o:?}")),
        }
    }
    raise_nofile();
    let flood = Flood::start(addr.ok_or("flood-child: --tcp missing")?, n);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if line.trim() == "stop" => break,
                Ok(_) => {}
            }
        }
        d.store(true, Ordering::Relaxed);
    });
    while !done.load(Ordering::Relaxed) {
        println!(
            "FLOOD open={} reopened={} failed={}",
            flood.open.load(Ordering::Relaxed),
            flood.reopened.load(Ordering::Relaxed),
            flood.connect_errors.load(Ordering::Relaxed)
        );
        if std::io::stdout().flush().is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(flood);
    Ok(())
}
