//! Control calls: stats, checkpoints and restores, shutdown, and one
//! request to one unit or to every unit.

use std::time::{Duration, Instant};

use stowage_wire::{Request, Response};

use crate::classify::unexpected;
use crate::{metrics, Client, ClientConfig, Error, Result, UnitAddr};
use crate::{CheckpointInfo, RestoreReply, RestoreSource, Stats};

impl Client {
    /// Every unit's counters.
    pub fn stats(&self, deadline: Instant) -> Vec<Result<Stats>> {
        let timer = metrics::OpTimer::start();
        let reqs = (0..self.units.len()).map(|u| (u, Request::Stats)).collect();
        let all = self
            .call_units(reqs, deadline)
            .into_iter()
            .map(|(unit, r)| match r? {
                Response::Stats(s) => Ok(*s),
                other => Err(unexpected(unit, other)),
            })
            .collect::<Vec<_>>();
        let ok = all.iter().all(|r| r.is_ok());
        self.metrics
            .op(metrics::ClientOp::Control, ok, timer.took());
        all
    }

    /// Ask every unit to write a checkpoint of everything it holds to
    /// `dir/unit-<i>` on its own host (bytes never pass through this
    /// client). Returns each unit's metadata, in unit order; a unit started
    /// with `--restore dir/unit-<i>` serves the same keys.
    ///
    /// With copies ([`ClientConfig::replicas`] over 1) the checkpoint
    /// keeps **one copy of each row**: unit `u` writes only the rows of
    /// the units whose *source* it is (the first of their copies now that
    /// holds all their rows: one of their first placement, or a newcomer
    /// this client repaired), by the rows' homes
    /// ([`stowage_wire::home_unit`]); a unit that is the source of none
    /// still writes its (empty) part. A unit this client knows to be down
    /// is asked nothing and writes no part: its place in the result is an
    /// info of 0 rows, entries and bytes, no files, and an empty `host`
    /// and `stored`. The rows of a unit with no whole copy left are not
    /// written (they are lost anyway). To restore, start every unit with
    /// `--restore dir/unit-<i>` (a unit that was down, empty) and run
    /// [`Client::rebuild_copies`] before the plane serves
    /// (docs/replication.md).
    pub fn checkpoint(
        &self,
        dir: &std::path::Path,
        deadline: Instant,
    ) -> Result<Vec<CheckpointInfo>> {
        let n = self.units.len();
        let part = |u: usize| dir.join(format!("unit-{u}")).to_string_lossy().into_owned();
        if self.replicas() > 1 {
            // A newcomer another client filled is a source too.
            self.learn_marks(deadline);
        }
        let reqs: Vec<(usize, Request)> = if self.replicas() > 1 {
            self.copies
                .sources_up()
                .into_iter()
                .map(|(u, homes)| {
                    let req = Request::CheckpointHomes {
                        dir: part(u),
                        units: n as u32,
                        homes,
                    };
                    (u, req)
                })
                .collect()
        } else {
            (0..n)
                .map(|u| (u, Request::Checkpoint { dir: part(u) }))
                .collect()
        };
        let mut out: Vec<CheckpointInfo> = (0..n).map(|_| down_unit_part()).collect();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r? {
                Response::Checkpointed(info) => out[unit] = info,
                other => return Err(unexpected(unit, other)),
            }
        }
        Ok(out)
    }

    /// Ask unit `unit` to serve the checkpoint in `dir` (on the unit's
    /// host, under its checkpoint root) from a restore unit it starts in
    /// its own process (a checkpoint request: this client must be an admin
    /// of the unit, or the unit must have a shared secret). The reply says
    /// where the restore unit listens ([`Client::restore_address`]) and
    /// what it serves, or, with `opened` `None`, what is missing there.
    /// Close it with [`Client::close_restore`] (it also stops by itself
    /// after a while without connections, and with its unit).
    pub fn open_restore(&self, unit: usize, dir: &str, deadline: Instant) -> Result<RestoreReply> {
        let req = Request::OpenRestore { dir: dir.into() };
        match self.call_one(unit, req, deadline)? {
            Response::Restore(r) => Ok(*r),
            other => Err(unexpected(unit, other)),
        }
    }

    /// Stop restore unit `id` of unit `unit` ([`Client::open_restore`]).
    pub fn close_restore(&self, unit: usize, id: u64, deadline: Instant) -> Result<()> {
        match self.call_one(unit, Request::CloseRestore { id }, deadline)? {
            Response::Done => Ok(()),
            other => Err(unexpected(unit, other)),
        }
    }

    /// Where this client reaches restore unit `src` of unit `unit`: its
    /// Unix socket when this client reaches the unit by its own, else its
    /// TCP port at the host this client reaches the unit at (the restore
    /// unit listens where the unit does).
    pub fn restore_address(&self, unit: usize, src: &RestoreSource) -> Result<UnitAddr> {
        let own = &self
            .units
            .get(unit)
            .ok_or_else(|| Error::InvalidRequest(format!("no unit {unit}")))?
            .addr;
        if let (UnitAddr::Unix(_), Some(p)) = (own, &src.uds) {
            return Ok(UnitAddr::Unix(p.into()));
        }
        let tcp: std::net::SocketAddr = src
            .tcp
            .as_deref()
            .ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "unit {unit}'s restore unit listens on no address this client can reach"
                ))
            })?
            .parse()
            .map_err(|e| Error::InvalidRequest(format!("restore unit address: {e}")))?;
        let ip = match own {
            UnitAddr::Tcp(a) => a.ip(),
            UnitAddr::Unix(_) if tcp.ip().is_unspecified() => {
                std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
            }
            UnitAddr::Unix(_) => tcp.ip(),
        };
        Ok(UnitAddr::Tcp(std::net::SocketAddr::new(ip, tcp.port())))
    }

    /// A client of `units` in `namespace` with this client's secret,
    /// timeout and transport settings (e.g. of restore units).
    pub fn sibling(&self, units: Vec<UnitAddr>, namespace: &str) -> Result<Client> {
        let mut cfg = ClientConfig::new(namespace, units);
        cfg.timeout = self.cfg.timeout;
        cfg.shm = self.cfg.shm;
        cfg.spin = self.cfg.spin;
        cfg.secret = self.cfg.secret.clone();
        cfg.max_unit_conns = self.cfg.max_unit_conns;
        cfg.rings = self.cfg.rings;
        cfg.ring_after = self.cfg.ring_after;
        Client::connect(cfg)
    }

    /// Stop every unit within `timeout`: a unit abandons a checkpoint that
    /// does not finish in time, removes its disk directory and exits.
    /// Never fails: returns, per unit, what could not be done (a unit that
    /// is already gone reports nothing).
    pub fn shutdown(&self, timeout: Duration) -> Vec<Vec<String>> {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let deadline = Instant::now() + timeout + Duration::from_secs(1);
        let reqs = (0..self.units.len())
            .map(|u| (u, Request::Shutdown { timeout_ms: ms }))
            .collect();
        let mut out = vec![Vec::new(); self.units.len()];
        for (unit, r) in self.call_units(reqs, deadline) {
            out[unit] = match r {
                Ok(Response::ShutDown { problems }) => problems,
                Ok(other) => vec![format!("unexpected reply {other:?}")],
                Err(Error::LostKeys { .. }) => Vec::new(),
                Err(e) => vec![e.to_string()],
            };
            self.forget_instance(unit, None);
        }
        out
    }
}

/// The place of a unit that was down in a checkpoint's result: it wrote
/// nothing.
fn down_unit_part() -> CheckpointInfo {
    CheckpointInfo {
        rows: 0,
        entries: 0,
        bytes: 0,
        files: Vec::new(),
        manifest_xxh3: 0,
        host: String::new(),
        stored: String::new(),
    }
}
