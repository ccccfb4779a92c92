//! `stowage status`: every unit at a glance — state, memory and disk in
//! use, rows, pins, and the operations and bytes per second over the last
//! interval — one line per unit and a total; `--watch` redraws it in
//! place, `--json` prints it for scripts.
//!
//! Each unit is asked by its own worker thread, and the answer waited for
//! only until the timeout: a unit that does not answer (stopped, hung, or
//! its host gone) shows as unreachable when the timeout is up, and a
//! worker stuck on it holds nothing else back.

use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;
use stowage_client::{Client, ClientConfig, Error, Secret, Stats, UnitAddr};

/// What `stowage status` is asked to do.
#[derive(Clone, Debug)]
pub struct StatusOptions {
    pub units: Vec<UnitAddr>,
    /// The instance each unit should be (from a directory): another one
    /// there is shown as restarted.
    pub expected: Vec<Option<u128>>,
    pub secret: Option<Secret>,
    /// Rates are over this interval (two samples this far apart).
    pub interval: Duration,
    /// A unit that has not answered within this is unreachable.
    pub timeout: Duration,
    pub watch: bool,
    pub json: bool,
    /// Copies of every row (from a directory; 1 otherwise).
    pub replicas: usize,
    /// Each unit's host (from a directory; empty: unknown).
    pub hosts: Vec<Option<String>>,
    /// With copies and a unit down: the namespace whose rows short of a
    /// copy are counted.
    pub namespace: String,
}

/// One unit's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Answering.
    Up,
    /// Answering, but turning work away (Busy answers over the interval,
    /// or its connection cap reached).
    Busy,
    /// Not answering within the timeout, or not there.
    Unreachable,
    /// Another instance than the directory names (or than was seen
    /// before): the unit restarted and lost what it held.
    Restarted,
}

/// One unit's line.
#[derive(Clone, Debug, Serialize)]
pub struct UnitStatus {
    pub index: usize,
    pub address: String,
    pub state: State,
    /// 32 hex digits.
    pub instance: Option<String>,
    pub memory_used: u64,
    pub memory_capacity: u64,
    pub disk_used: u64,
    pub disk_capacity: u64,
    pub rows: u64,
    pub pins: u64,
    /// Whether the unit serves one-sided NIXL transfers (`--nixl`).
    pub serves_nixl: bool,
    /// The slab's page mode (`4k`, `thp`, `hugetlb`; empty for a unit
    /// that predates it or is unreachable).
    pub page_mode: String,
    /// Slab bytes held by reservations (spares included) and quarantine,
    /// beside `memory_used` (stored data); of them, spares.
    pub memory_held: u64,
    pub spare_bytes: u64,
    /// Free slab bytes and the largest free range.
    pub memory_free: u64,
    pub largest_free: u64,
    /// Compaction since the unit started: moves and bytes.
    pub compaction_moves: u64,
    pub compaction_bytes: u64,
    /// Over the last interval; `None` until two samples were taken.
    pub ops_per_s: Option<f64>,
    pub bytes_per_s: Option<f64>,
    pub busy_per_s: Option<f64>,
    /// Why it is unreachable.
    pub error: Option<String>,
}

/// The total line.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Total {
    pub units: usize,
    pub up: usize,
    pub busy: usize,
    pub unreachable: usize,
    pub restarted: usize,
    pub memory_used: u64,
    pub memory_capacity: u64,
    pub disk_used: u64,
    pub disk_capacity: u64,
    pub rows: u64,
    pub pins: u64,
    pub ops_per_s: f64,
    pub bytes_per_s: f64,
}

/// One report: what `--json` prints (one object a line with `--watch`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub interval_s: f64,
    pub units: Vec<UnitStatus>,
    pub total: Total,
    /// With more than one copy of every row: where they stand.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copies: Option<CopiesStatus>,
}

/// The copies of a plane's rows (docs/replication.md).
#[derive(Clone, Debug, Serialize)]
pub struct CopiesStatus {
    /// Copies of every row.
    pub replicas: usize,
    /// Units whose rows' copies share a host (the plane has too few).
    pub short_of_hosts: usize,
    /// Units whose rows have a copy on a unit not up now (unreachable or
    /// restarted): those rows have fewer copies than asked.
    pub short_of_a_copy: Vec<usize>,
    /// Of their rows in the namespace asked, those that lack the copy
    /// (a repair copies them: docs/replication.md#repair), or why they
    /// could not be counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lacking: Option<Lacking>,
}

/// Rows and values short of a copy ([`stowage_client::Client::under_replicated`]).
#[derive(Clone, Debug, Serialize)]
pub struct Lacking {
    pub namespace: String,
    pub rows: u64,
    pub values: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Count what the units that took the copies of `down` units' rows lack,
/// as a client of the plane that takes those units as gone sees it (it
/// lists, and copies nothing).
fn lacking(opts: &StatusOptions, down: &[usize]) -> Lacking {
    let mut out = Lacking {
        namespace: opts.namespace.clone(),
        rows: 0,
        values: 0,
        error: None,
    };
    let mut cfg = ClientConfig::new(opts.namespace.clone(), opts.units.clone());
    cfg.secret = opts.secret.clone();
    cfg.replicas = opts.replicas;
    cfg.hosts = opts.hosts.clone();
    cfg.timeout = opts.timeout;
    let counted = Client::connect(cfg).and_then(|c| {
        for &u in down {
            c.unit_gone(u);
        }
        c.under_replicated(c.deadline())
    });
    match counted {
        Ok(short) => {
            out.rows = short.iter().map(|s| s.rows).sum();
            out.values = short.iter().map(|s| s.values).sum();
        }
        Err(e) => out.error = Some(e.to_string()),
    }
    out
}

impl CopiesStatus {
    fn of(opts: &StatusOptions, units: &[UnitStatus]) -> Option<CopiesStatus> {
        if opts.replicas <= 1 || opts.replicas > units.len() {
            return None;
        }
        let (sets, short_of_hosts) =
            stowage_client::copy_sets(units.len(), opts.replicas, &opts.hosts);
        let down = |u: usize| matches!(units[u].state, State::Unreachable | State::Restarted);
        let short_of_a_copy: Vec<usize> = (0..units.len())
            .filter(|&u| sets[u].iter().any(|&c| down(c)))
            .collect();
        let gone: Vec<usize> = (0..units.len()).filter(|&u| down(u)).collect();
        let lacking = (!gone.is_empty() && gone.len() < units.len()).then(|| lacking(opts, &gone));
        Some(CopiesStatus {
            replicas: opts.replicas,
            short_of_hosts,
            short_of_a_copy,
            lacking,
        })
    }

    fn render(&self) -> String {
        let mut s = format!("copies: {} of every row", self.replicas);
        if self.short_of_hosts > 0 {
            s += &format!(
                "; {} units' copies share a host (too few hosts: a host's loss may take every copy of their rows)",
                self.short_of_hosts
            );
        } else {
            s += ", on distinct hosts where the directory names them";
        }
        if !self.short_of_a_copy.is_empty() {
            let list: Vec<String> = self.short_of_a_copy.iter().map(|u| u.to_string()).collect();
            s += &format!(
                "; the rows of units {} are short of a copy (a unit holding one is down)",
                list.join(", ")
            );
        }
        match &self.lacking {
            Some(Lacking {
                error: Some(e),
                namespace,
                ..
            }) => s += &format!("; rows lacking a copy in namespace {namespace:?}: not counted ({e})"),
            Some(l) => {
                s += &format!(
                    "; in namespace {:?}, {} rows ({} values) lack that copy until a client of the plane repairs them",
                    l.namespace, l.rows, l.values
                )
            }
            None => {}
        }
        s + "\n"
    }
}

/// A sample from a worker.
enum Sample {
    Stats {
        at: Instant,
        stats: Box<Stats>,
        instance: Option<u128>,
    },
    /// Connected, but turned away (the unit's connection cap).
    Busy(String),
    Failed(String),
}

/// A worker: asks its unit whenever told, over a connection it keeps.
fn worker(
    index: usize,
    addr: UnitAddr,
    secret: Option<Secret>,
    timeout: Duration,
    rx: mpsc::Receiver<u64>,
    tx: mpsc::Sender<(usize, u64, Sample)>,
) {
    let mut client: Option<Client> = None;
    while let Ok(round) = rx.recv() {
        let sample = match &client {
            Some(c) => ask(c, timeout),
            None => {
                let mut cfg = ClientConfig::new("default", vec![addr.clone()]);
                cfg.shm = false;
                cfg.secret = secret.clone();
                cfg.timeout = timeout;
                match Client::connect(cfg) {
                    Ok(c) => {
                        let s = ask(&c, timeout);
                        client = Some(c);
                        s
                    }
                    Err(e) => failed(e),
                }
            }
        };
        if !matches!(sample, Sample::Stats { .. }) {
            client = None; // a fresh connection next time
        }
        if tx.send((index, round, sample)).is_err() {
            return;
        }
    }
}

fn ask(c: &Client, timeout: Duration) -> Sample {
    let deadline = Instant::now() + timeout;
    match c.stats(deadline).pop() {
        Some(Ok(stats)) => Sample::Stats {
            at: Instant::now(),
            stats: Box::new(stats),
            instance: c.instance_id(0),
        },
        Some(Err(e)) => failed(e),
        None => Sample::Failed("no answer".into()),
    }
}

fn failed(e: Error) -> Sample {
    let text = match e {
        // Each worker's client has one unit: its index there means nothing.
        Error::Unreachable { reason, .. } => format!("unreachable: {reason}"),
        e => e.to_string().replace("unit 0 at ", "the unit at "),
    };
    // The unit's connection cap: it answered, with Busy.
    if text.contains("too many connections") {
        Sample::Busy(text)
    } else {
        Sample::Failed(text)
    }
}

/// The last sample of each unit, for rates.
#[derive(Clone)]
struct Last {
    at: Instant,
    stats: Stats,
    instance: Option<u128>,
}

/// Run `stowage status`: print the report (once, or every interval with
/// `watch`) on `out`.
pub fn run(opts: &StatusOptions, out: &mut dyn Write) -> Result<(), String> {
    if opts.units.is_empty() {
        return Err("no units given".into());
    }
    let (tx, rx) = mpsc::channel();
    let mut asks = Vec::new();
    for (i, a) in opts.units.iter().enumerate() {
        let (atx, arx) = mpsc::channel();
        asks.push(atx);
        let (tx, addr, secret, timeout) =
            (tx.clone(), a.clone(), opts.secret.clone(), opts.timeout);
        std::thread::Builder::new()
            .name(format!("status-{i}"))
            .spawn(move || worker(i, addr, secret, timeout, arx, tx))
            .map_err(|e| e.to_string())?;
    }
    drop(tx);
    let n = opts.units.len();
    let mut last: Vec<Option<Last>> = vec![None; n];
    // The first instance seen at each unit (without a directory).
    let mut seen: Vec<Option<u128>> = opts.expected.clone();
    seen.resize(n, None);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut round = 0u64;
    loop {
        let start = Instant::now();
        for a in &asks {
            // A worker still stuck on an earlier round picks this up late;
            // its late answers are told apart by their round.
            let _ = a.send(round);
        }
        let mut got: Vec<Option<Sample>> = (0..n).map(|_| None).collect();
        let until = start + opts.timeout;
        let mut missing = n;
        while missing > 0 {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((i, r, s)) if r == round && got[i].is_none() => {
                    got[i] = Some(s);
                    missing -= 1;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let mut units = Vec::with_capacity(n);
        for (i, g) in got.into_iter().enumerate() {
            let address = opts.units[i].to_string();
            let mut u = UnitStatus {
                index: i,
                address,
                state: State::Unreachable,
                instance: None,
                memory_used: 0,
                memory_capacity: 0,
                disk_used: 0,
                disk_capacity: 0,
                rows: 0,
                pins: 0,
                serves_nixl: false,
                page_mode: String::new(),
                memory_held: 0,
                spare_bytes: 0,
                memory_free: 0,
                largest_free: 0,
                compaction_moves: 0,
                compaction_bytes: 0,
                ops_per_s: None,
                bytes_per_s: None,
                busy_per_s: None,
                error: None,
            };
            match g {
                None => {
                    u.error = Some(format!("no answer within {:?}", opts.timeout));
                    last[i] = None;
                }
                Some(Sample::Failed(e)) => {
                    u.error = Some(e);
                    last[i] = None;
                }
                Some(Sample::Busy(e)) => {
                    u.state = State::Busy;
                    u.error = Some(e);
                }
                Some(Sample::Stats {
                    at,
                    stats,
                    instance,
                }) => {
                    u.state = State::Up;
                    u.instance = instance.map(|x| format!("{x:032x}"));
                    u.memory_used = stats.used;
                    u.memory_capacity = stats.capacity;
                    u.disk_used = stats.disk_used;
                    u.disk_capacity = stats.disk_capacity;
                    u.rows = stats.rows;
                    u.pins = stats.pins;
                    u.serves_nixl = stats.serves_nixl;
                    u.page_mode = stats.page_mode.clone();
                    u.memory_held = stats.reserved_bytes + stats.quarantined_bytes;
                    u.spare_bytes = stats.spare_bytes;
                    u.memory_free = stats.free_bytes;
                    u.largest_free = stats.largest_free;
                    u.compaction_moves = stats.compaction_moves;
                    u.compaction_bytes = stats.compaction_bytes;
                    let restarted = match (seen[i], instance) {
                        (Some(want), Some(got)) => want != got,
                        _ => false,
                    };
                    if seen[i].is_none() {
                        seen[i] = instance;
                    }
                    if let Some(prev) = last[i].as_ref().filter(|p| p.instance == instance) {
                        let dt = at.duration_since(prev.at).as_secs_f64().max(1e-6);
                        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
                        u.ops_per_s = Some(d(stats.ops, prev.stats.ops));
                        u.bytes_per_s = Some(d(
                            stats.bytes_in + stats.bytes_out,
                            prev.stats.bytes_in + prev.stats.bytes_out,
                        ));
                        let busy = d(stats.busy, prev.stats.busy);
                        u.busy_per_s = Some(busy);
                        if busy > 0.0 {
                            u.state = State::Busy;
                        }
                    }
                    if restarted {
                        u.state = State::Restarted;
                    }
                    last[i] = Some(Last {
                        at,
                        stats: *stats,
                        instance,
                    });
                }
            }
            units.push(u);
        }
        if round == 0 && !opts.interval.is_zero() {
            // The first sample only starts the interval.
            round += 1;
            std::thread::sleep(opts.interval.saturating_sub(start.elapsed()));
            continue;
        }
        let report = Report {
            interval_s: opts.interval.as_secs_f64(),
            total: total(&units),
            copies: CopiesStatus::of(opts, &units),
            units,
        };
        if opts.json {
            let line = serde_json::to_string(&report).map_err(|e| e.to_string())?;
            writeln!(out, "{line}").map_err(|e| e.to_string())?;
        } else {
            if opts.watch && tty {
                // Home, clear: redraw in place.
                write!(out, "\x1b[H\x1b[2J").map_err(|e| e.to_string())?;
            }
            write!(out, "{}", render(&report)).map_err(|e| e.to_string())?;
        }
        out.flush().map_err(|e| e.to_string())?;
        if !opts.watch {
            return Ok(());
        }
        round += 1;
        std::thread::sleep(opts.interval.saturating_sub(start.elapsed()));
    }
}

fn total(units: &[UnitStatus]) -> Total {
    let mut t = Total {
        units: units.len(),
        ..Total::default()
    };
    for u in units {
        match u.state {
            State::Up => t.up += 1,
            State::Busy => t.busy += 1,
            State::Unreachable => t.unreachable += 1,
            State::Restarted => t.restarted += 1,
        }
        t.memory_used += u.memory_used;
        t.memory_capacity += u.memory_capacity;
        t.disk_used += u.disk_used;
        t.disk_capacity += u.disk_capacity;
        t.rows += u.rows;
        t.pins += u.pins;
        t.ops_per_s += u.ops_per_s.unwrap_or(0.0);
        t.bytes_per_s += u.bytes_per_s.unwrap_or(0.0);
    }
    t
}

/// `[#####-----]`: `used` of `total` in `width` cells.
fn bar(used: u64, total: u64, width: usize) -> String {
    let filled = if total == 0 {
        0
    } else {
        ((used as f64 / total as f64) * width as f64).round() as usize
    }
    .min(width);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

fn size(b: u64) -> String {
    bytesize::ByteSize(b).display().iec_short().to_string()
}

fn pct(used: u64, total: u64) -> String {
    if total == 0 {
        "-".into()
    } else {
        format!("{:.0}%", used as f64 * 100.0 / total as f64)
    }
}

fn rate(r: Option<f64>, scale: f64, prec: usize) -> String {
    match r {
        Some(r) => format!("{:.*}", prec, r / scale),
        None => "-".into(),
    }
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let addr_w = r
        .units
        .iter()
        .map(|u| u.address.len())
        .max()
        .unwrap_or(7)
        .clamp(7, 60);
    let mut s = format!(
        "{:<5} {:<addr_w$} {:<11} {:<12} {:>4} {:>19} {:>19} {:>19} {:>9} {:>19} {:>9} {:>6} {:>9} {:>7} {:>6} {:>7}\n",
        "unit",
        "address",
        "state",
        "memory",
        "",
        "used/total",
        "free/largest",
        "held/spares",
        "moved",
        "disk used/total",
        "rows",
        "pins",
        "ops/s",
        "GB/s",
        "serves",
        "pages"
    );
    for u in &r.units {
        let disk = if u.disk_capacity == 0 {
            "-".to_string()
        } else {
            format!("{}/{}", size(u.disk_used), size(u.disk_capacity))
        };
        let (mem, memp, used) = if u.state == State::Unreachable {
            (String::new(), String::new(), "-".to_string())
        } else {
            (
                bar(u.memory_used, u.memory_capacity, 10),
                pct(u.memory_used, u.memory_capacity),
                format!("{}/{}", size(u.memory_used), size(u.memory_capacity)),
            )
        };
        let (free, held, moved) = if u.state == State::Unreachable {
            ("-".to_string(), "-".to_string(), "-".to_string())
        } else {
            (
                format!("{}/{}", size(u.memory_free), size(u.largest_free)),
                format!("{}/{}", size(u.memory_held), size(u.spare_bytes)),
                size(u.compaction_bytes),
            )
        };
        let state = match u.state {
            State::Up => "up",
            State::Busy => "busy",
            State::Unreachable => "unreachable",
            State::Restarted => "restarted",
        };
        s += &format!(
            "{:<5} {:<addr_w$} {:<11} {:<12} {:>4} {:>19} {:>19} {:>19} {:>9} {:>19} {:>9} {:>6} {:>9} {:>7} {:>6} {:>7}\n",
            u.index,
            u.address,
            state,
            mem,
            memp,
            used,
            free,
            held,
            moved,
            if u.state == State::Unreachable {
                "-".into()
            } else {
                disk
            },
            u.rows,
            u.pins,
            rate(u.ops_per_s, 1.0, 1),
            rate(u.bytes_per_s, 1e9, 3),
            if u.serves_nixl { "nixl" } else { "-" },
            if u.page_mode.is_empty() {
                "-"
            } else {
                &u.page_mode
            },
        );
        if let (State::Unreachable | State::Busy, Some(e)) = (u.state, &u.error) {
            s += &format!("      {e}\n");
        }
    }
    let t = &r.total;
    let states = [
        (t.up, "up"),
        (t.busy, "busy"),
        (t.unreachable, "unreachable"),
        (t.restarted, "restarted"),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, w)| format!("{n} {w}"))
    .collect::<Vec<_>>()
    .join(", ");
    let disk = if t.disk_capacity == 0 {
        "-".to_string()
    } else {
        format!("{}/{}", size(t.disk_used), size(t.disk_capacity))
    };
    s += &format!(
        "{:<5} {:<addr_w$} {:<11} {:<12} {:>4} {:>19} {:>19} {:>9} {:>6} {:>9} {:>7}\n",
        "total",
        format!("{} units: {states}", t.units),
        "",
        bar(t.memory_used, t.memory_capacity, 10),
        pct(t.memory_used, t.memory_capacity),
        format!("{}/{}", size(t.memory_used), size(t.memory_capacity)),
        disk,
        t.rows,
        t.pins,
        format!("{:.1}", t.ops_per_s),
        format!("{:.3}", t.bytes_per_s / 1e9),
    );
    if let Some(c) = &r.copies {
        s += &c.render();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_fill_in_proportion() {
        assert_eq!(bar(0, 100, 10), "[----------]");
        assert_eq!(bar(50, 100, 10), "[#####-----]");
        assert_eq!(bar(100, 100, 10), "[##########]");
        assert_eq!(bar(5, 0, 4), "[----]");
    }
}
