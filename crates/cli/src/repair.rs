//! `stowage repair`: give the rows of a plane with copies their copies
//! again after a unit's death, from the command line
//! (docs/replication.md#repair). Clients of the plane repair by
//! themselves in the background; this is the operator's pass (after the
//! clients that found the unit dead are gone, say), and the rebuild after
//! units were restarted from a one-copy checkpoint (`--rebuild`); with
//! `--rejoin UNIT`, a unit started again in a dead one's place is taken
//! back in first (docs/replication.md#rejoining).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Repaired, Secret, TransportChoice, UnitDirectory};

/// What to repair and how long to try.
pub struct RepairOptions<'a> {
    pub directory: &'a Path,
    pub namespace: &'a str,
    /// `--secret-file`/`STOWAGE_SECRET`; else the directory's.
    pub secret: Option<Secret>,
    /// Every row's copies from whichever copy holds it, not only the
    /// newcomers' (`Client::rebuild_copies`).
    pub rebuild: bool,
    /// Units to take back into the plane before the repair: the instance
    /// started again at each one's address rejoins (`Client::rejoin`).
    pub rejoin: Vec<usize>,
    /// Passes go on, a second apart, until nothing is left due or this
    /// has passed.
    pub within: Duration,
}

/// Run it, printing what was done to `out`. Whether nothing is left.
pub fn run(o: &RepairOptions<'_>, out: &mut dyn Write) -> Result<bool, String> {
    let d = UnitDirectory::from_file(o.directory)?;
    if d.replicas < 2 {
        return Err(format!(
            "{}: the plane keeps one copy of each row (replicas = {}): there is nothing to repair",
            o.directory.display(),
            d.replicas
        ));
    }
    let mut cfg = ClientConfig::new(
        o.namespace,
        d.addrs(TransportChoice::Auto, &stowage_client::host_id())?,
    );
    cfg.secret = match &o.secret {
        Some(s) => Some(s.clone()),
        None => d.secret()?,
    };
    cfg.replicas = d.replicas;
    cfg.hosts = d.units.iter().map(|u| u.host.clone()).collect();
    cfg.instances = d.instances();
    let c = Client::connect(cfg).map_err(|e| e.to_string())?;
    // Asking every unit finds the dead and the restarted: they are down
    // for this client, and their rows' copies placed anew.
    let _ = c.stats(c.deadline());
    let until = Instant::now() + o.within;
    for &unit in &o.rejoin {
        let r = c
            .rejoin(unit, until)
            .map_err(|e| format!("unit {unit} did not rejoin: {e}"))?;
        if r.already {
            writeln!(out, "unit {unit} is a member already (instance {:032x})", r.instance)
        } else {
            writeln!(
                out,
                "unit {unit} rejoined as instance {:032x}: the plane's view {} ({} units moved{}); {} values cleared on copies that left",
                r.instance,
                r.epoch,
                r.moved,
                if r.unreached.is_empty() {
                    String::new()
                } else {
                    format!(", {:?} not reached", r.unreached)
                },
                r.cleared
            )
        }
        .map_err(|e| e.to_string())?;
    }
    let mut all = Repaired::default();
    loop {
        let r = if o.rebuild {
            c.rebuild_copies(until)
        } else {
            c.repair(until)
        }
        .map_err(|e| e.to_string())?;
        all.done += r.done;
        all.values += r.values;
        all.bytes += r.bytes;
        all.skipped += r.skipped;
        all.left = r.left;
        all.errors = r.errors;
        let pending = if o.rebuild {
            r.left
        } else {
            c.repairs_pending()
        };
        if pending == 0 || Instant::now() >= until {
            break;
        }
        std::thread::sleep(
            Duration::from_secs(1).min(until.saturating_duration_since(Instant::now())),
        );
    }
    let w = |e: std::io::Error| e.to_string();
    writeln!(
        out,
        "{} {} pairs (a unit's rows and a copy): {} values, {} bytes copied; {} refused (there already, or cleared since they were read)",
        if o.rebuild { "rebuilt" } else { "repaired" },
        all.done,
        all.values,
        all.bytes,
        all.skipped
    )
    .map_err(w)?;
    if all.left > 0 {
        writeln!(out, "{} pairs left: {}", all.left, all.errors.join("; ")).map_err(w)?;
    }
    Ok(all.left == 0)
}
