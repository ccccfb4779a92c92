//! A unit's metrics: counters and histograms recorded on the request path,
//! and gauges read from the core at scrape time, exposed in the Prometheus
//! text format (`prometheus-client`'s encoder) on `GET /metrics`
//! (`http`). Every metric is listed in docs/metrics.md.
//!
//! Recording is a few relaxed atomic adds into arrays fixed at start: no
//! lock, no allocation, no label lookup per request. The registry holds
//! one [`Collector`] that encodes these atomics and the core's
//! [`stowage_wire::Stats`] when scraped.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

mod record;
#[cfg(test)]
mod tests;

pub(crate) use record::*;
pub use record::{recording_cost, Histogram, UnitMetrics};

/// What a scrape reads of a unit besides the counters it recorded.
pub(crate) struct Scrape {
    pub(crate) stats: stowage_wire::Stats,
    /// The spill threshold, as a fraction of the slab.
    pub(crate) high_watermark: f64,
    /// Connections served, and still in their handshake.
    pub(crate) connections: usize,
    pub(crate) handshakes: usize,
    pub(crate) metrics: Option<Arc<UnitMetrics>>,
    pub(crate) started: Instant,
    pub(crate) instance_id: u128,
}

/// Reads a unit for a scrape (`None`: the unit is gone).
pub(crate) type Source = Box<dyn Fn() -> Option<Scrape> + Send + Sync>;

/// The registry of a unit: its metrics under the `stowage_` prefix, each
/// with the label `unit` (the unit's name), read from `source` when
/// scraped.
pub(crate) fn registry(source: Source, name: &str) -> Registry {
    let mut r = Registry::with_prefix_and_labels(
        "stowage",
        [(
            std::borrow::Cow::Borrowed("unit"),
            std::borrow::Cow::Owned(name.to_owned()),
        )]
        .into_iter(),
    );
    r.register_collector(Box::new(UnitCollector { source }));
    r
}

/// Encodes a unit's metrics at scrape time. Reads the unit through
/// `source`, which holds it weakly: a stopped unit's registry encodes
/// nothing.
struct UnitCollector {
    source: Source,
}

impl std::fmt::Debug for UnitCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnitCollector").finish_non_exhaustive()
    }
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// A value of a family with one label: an `f64` is a gauge's, a `u64` a
/// counter's.
trait Labelled: Copy {
    const TYPE: MetricType;
    fn encode(self, m: MetricEncoder) -> fmt::Result;
}

impl Labelled for f64 {
    const TYPE: MetricType = MetricType::Gauge;
    fn encode(self, m: MetricEncoder) -> fmt::Result {
        ConstGauge::new(self).encode(m)
    }
}

impl Labelled for u64 {
    const TYPE: MetricType = MetricType::Counter;
    fn encode(self, m: MetricEncoder) -> fmt::Result {
        ConstCounter::new(self).encode(m)
    }
}

/// One family with one label: gauges or counters, by the values' type.
fn family<V: Labelled>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[(&str, V)],
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, V::TYPE)?;
    for (l, v) in values {
        let labels = [(label, *l)];
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The values of `counts`, each with its label value from `names`.
fn loaded<'n>(names: &[&'n str], counts: &[AtomicU64]) -> Vec<(&'n str, u64)> {
    names
        .iter()
        .zip(counts)
        .map(|(n, c)| (*n, c.load(Relaxed)))
        .collect()
}

impl Collector for UnitCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let Some(sh) = (self.source)() else {
            return Ok(());
        };
        let s = sh.stats;
        let cap = s.capacity as f64;
        let f = |v: u64| v as f64;

        // Memory.
        gauge(
            &mut e,
            "slab_capacity_bytes",
            "Bytes of the unit's slab.",
            cap,
        )?;
        family(
            &mut e,
            "slab_bytes",
            "Slab bytes by state: used (stored data: committed blobs), reserved (puts being written), spares (reservations clients keep for their next puts), quarantined, free; pinned (stored data someone reads, part of used).",
            "state",
            &[
                ("used", f(s.used)),
                ("reserved", f(s.reserved_bytes.saturating_sub(s.spare_bytes))),
                ("spares", f(s.spare_bytes)),
                ("quarantined", f(s.quarantined_bytes)),
                ("pinned", f(s.pinned_bytes)),
                ("free", f(s.free_bytes)),
            ],
        )?;
        gauge(
            &mut e,
            "slab_largest_free_bytes",
            "The largest free range of the slab: a put's part larger than it is stored in pieces.",
            f(s.largest_free),
        )?;
        gauge(
            &mut e,
            "slab_spare_budget_bytes",
            "Bytes of the slab's spare zone, where spares come from.",
            f(s.spare_budget),
        )?;
        gauge(
            &mut e,
            "slab_split_blobs",
            "Blobs stored in more than one piece of the slab.",
            f(s.split_blobs),
        )?;
        counter(
            &mut e,
            "compaction_moves",
            "Blobs compaction moved to gather free memory into ranges.",
            s.compaction_moves,
        )?;
        counter(
            &mut e,
            "compaction_bytes",
            "Bytes compaction copied.",
            s.compaction_bytes,
        )?;
        counter(
            &mut e,
            "compaction_micros",
            "Time compaction spent copying, in microseconds.",
            s.compaction_micros,
        )?;
        let mode = s.page_mode.as_str();
        family(
            &mut e,
            "slab_page_mode",
            "The slab's page mode: 1 for the mode in effect (4k, thp: transparent huge pages, hugetlb), 0 for the others.",
            "mode",
            &stowage_shm::PageMode::ALL.map(|m| (m.name(), f(u64::from(m.name() == mode)))),
        )?;
        gauge(
            &mut e,
            "slab_high_watermark_bytes",
            "Past this many used slab bytes the unit spills committed blobs to its disk tier.",
            sh.high_watermark * cap,
        )?;
        gauge(
            &mut e,
            "index_bytes",
            "Bytes the key index takes (commits past the index budget answer UnitFull).",
            f(s.index_bytes),
        )?;
        gauge(
            &mut e,
            "outside_slab_bytes",
            "Bytes the unit holds outside its slab for its connections: request headers being read, replies being written, their buffers.",
            f(s.outside_slab_bytes),
        )?;
        gauge(
            &mut e,
            "outside_slab_limit_bytes",
            "The most bytes held outside the slab before connections' reads wait: --outside-slab-budget and its headroom for small frames (a quarter of it).",
            f(s.outside_slab_limit),
        )?;
        counter(
            &mut e,
            "outside_slab_waits",
            "Times a connection's read waited because the budget for memory outside the slab was spent (backpressure).",
            s.outside_slab_waits,
        )?;
        counter(
            &mut e,
            "outside_slab_cuts",
            "Connections cut because the budget for memory outside the slab was spent and a connection had waited for it past the grace (the holder of the most stalled bytes first).",
            s.outside_slab_cuts,
        )?;
        // Disk tier.
        gauge(
            &mut e,
            "disk_capacity_bytes",
            "Bytes of the disk tier (0: no disk tier).",
            f(s.disk_capacity),
        )?;
        family(
            &mut e,
            "disk_bytes",
            "Disk tier bytes: used (files written or being written) and free.",
            "state",
            &[
                ("used", f(s.disk_used)),
                ("free", f(s.disk_capacity.saturating_sub(s.disk_used))),
            ],
        )?;
        // Contents.
        gauge(
            &mut e,
            "blobs",
            "Blobs (reserved, committed, spilled).",
            f(s.blobs),
        )?;
        gauge(
            &mut e,
            "spilled_blobs",
            "Blobs whose bytes are only on the disk tier.",
            f(s.spilled_blobs),
        )?;
        gauge(&mut e, "entries", "Committed values (keys).", f(s.entries))?;
        gauge(&mut e, "rows", "Rows holding values.", f(s.rows))?;
        gauge(
            &mut e,
            "partitions",
            "Partitions holding rows (over every namespace).",
            f(s.partitions),
        )?;
        // Holds.
        let (reservations, pins, orphaned) = s.sessions.iter().fold((0u64, 0u64, 0u64), |a, x| {
            (
                a.0 + u64::from(x.reservations),
                a.1 + u64::from(x.pins),
                a.2 + u64::from(x.orphaned),
            )
        });
        gauge(&mut e, "pins", "Pins held (blobs being read).", f(s.pins))?;
        family(
            &mut e,
            "holds",
            "Reservations and pins held by client sessions.",
            "kind",
            &[("reservation", f(reservations)), ("pin", f(pins))],
        )?;
        gauge(
            &mut e,
            "held_bytes",
            "Bytes held by client sessions: reserved ranges and pinned blobs.",
            f(s.held_bytes),
        )?;
        let oldest = s
            .sessions
            .iter()
            .map(|x| x.oldest_hold_ms)
            .max()
            .unwrap_or(0);
        gauge(
            &mut e,
            "oldest_hold_age_seconds",
            "Age of the oldest reservation or pin of any session (0: none).",
            oldest as f64 / 1e3,
        )?;
        gauge(
            &mut e,
            "overdue_holds",
            "Holds older than their lease: reported, never reclaimed while their holder may touch them.",
            f(s.overdue_holds),
        )?;
        gauge(
            &mut e,
            "orphaned_holds",
            "Holds of cut connections of clients that map the slab, kept until their process exits.",
            f(orphaned),
        )?;
        // Sessions and connections.
        gauge(
            &mut e,
            "sessions",
            "Client sessions with at least one open connection.",
            s.sessions.iter().filter(|x| x.connections > 0).count() as f64,
        )?;
        gauge(
            &mut e,
            "connections",
            "Connections being served (past their handshake).",
            sh.connections as f64,
        )?;
        gauge(
            &mut e,
            "handshakes",
            "Connections waiting to prove themselves (see --max-handshakes).",
            sh.handshakes as f64,
        )?;
        let Some(m) = sh.metrics.as_ref() else {
            return Ok(());
        };
        counter(
            &mut e,
            "sessions_opened",
            "Client sessions opened since start.",
            m.sessions_opened.load(Relaxed),
        )?;
        let path = m.path_totals();
        // Requests.
        {
            let mut d = e.encode_descriptor(
                "operations",
                "Requests answered, by kind (op) and outcome (ok, error).",
                None,
                MetricType::Counter,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                let answered = path.answered[i];
                for (j, outcome) in ["ok", "error"].iter().enumerate() {
                    let v = answered[j];
                    let labels = [("op", *name), ("outcome", *outcome)];
                    ConstCounter::new(v).encode(d.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut d = e.encode_descriptor(
                "operation_duration_seconds",
                "Time from a request's first byte to its answer (for puts and gets, the whole transfer), by kind; unpin is not timed.",
                None,
                MetricType::Histogram,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                let labels = [("op", *name)];
                let (per, sum_ns) = &path.latency[i];
                encode_histogram(&LATENCY_BOUNDS, per, *sum_ns, d.encode_family(&labels)?)?;
            }
        }
        let errors = loaded(&CODE_NAMES, &m.errors);
        family(
            &mut e,
            "errors",
            "Error answers, by kind (the wire error code).",
            "kind",
            &errors,
        )?;
        counter(
            &mut e,
            "busy_answers",
            "Busy answers: requests told to retry shortly, and connections refused past the connection cap.",
            m.busy.load(Relaxed),
        )?;
        counter(
            &mut e,
            "connections_refused",
            "Connections refused Busy once they proved themselves because the unit served --max-connections already or held --max-sessions sessions (or, at accept, for want of file descriptors).",
            m.turned_away.load(Relaxed),
        )?;
        counter(
            &mut e,
            "rings_opened",
            "Request rings made: same-host connections that pass requests and replies through shared memory instead of their socket.",
            m.rings_opened.load(Relaxed),
        )?;
        counter(
            &mut e,
            "ring_requests",
            "Requests served through request rings.",
            m.ring_requests.load(Relaxed),
        )?;
        let cut = loaded(&HANDSHAKE_CUT_NAMES, &m.handshakes_cut);
        family(
            &mut e,
            "handshakes_cut",
            "Connections cut before they proved themselves, by reason (source_limit: their source opened more than --max-handshakes-per-source; pool_full: --max-handshakes were waiting and their source held the most; timeout: no proof within --handshake-timeout).",
            "reason",
            &cut,
        )?;
        {
            let mut d = e.encode_descriptor(
                "transferred_bytes",
                "Value bytes moved, by transport (shm: copied by the client through its mapping of the slab; uds, tcp: streamed by the unit) and direction (in: put, out: get).",
                None,
                MetricType::Counter,
            )?;
            for (i, t) in TRANSPORT_NAMES.iter().enumerate() {
                for (j, dir) in ["in", "out"].iter().enumerate() {
                    let labels = [("transport", *t), ("direction", *dir)];
                    ConstCounter::new(path.bytes[i][j]).encode(d.encode_family(&labels)?)?;
                }
            }
        }
        let reclaimed = loaded(&RECLAIM_NAMES, &m.reclaimed);
        family(
            &mut e,
            "reclaimed_holds",
            "Reservations and pins released because their holder went away, by how (closed: the peer closed its connection or died; cut: the unit cut a tcp peer; process_exited: a cut shm peer's process exited).",
            "reason",
            &reclaimed,
        )?;
        // Disk tier traffic.
        counter(
            &mut e,
            "spilled_bytes",
            "Bytes copied from the slab to the disk tier past the high watermark.",
            m.spilled_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "spill_batches",
            "Spill batches written (each a run of the spiller past the high watermark).",
            m.spill_batches.load(Relaxed),
        )?;
        counter(
            &mut e,
            "disk_put_bytes",
            "Bytes of puts written straight to the disk tier (the slab had no room).",
            m.disk_put_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "promoted_bytes",
            "Bytes of spilled blobs brought back into the slab for a reader.",
            m.promoted_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "disk_streamed_bytes",
            "Bytes read from the disk tier for a get without bringing them back into the slab.",
            m.disk_streamed_bytes.load(Relaxed),
        )?;
        family(
            &mut e,
            "disk_io_bytes",
            "Disk tier I/O bytes, by direction.",
            "direction",
            &[("write", s.disk_write_bytes), ("read", s.disk_read_bytes)],
        )?;
        {
            let mut d = e.encode_descriptor(
                "disk_io_seconds",
                "Time spent in disk tier I/O, by direction.",
                None,
                MetricType::Counter,
            )?;
            for (dir, us) in [("write", s.disk_write_micros), ("read", s.disk_read_micros)] {
                let labels = [("direction", dir)];
                ConstCounter::new(us as f64 / 1e6).encode(d.encode_family(&labels)?)?;
            }
        }
        family(
            &mut e,
            "repaired_values",
            "Values of repair puts (a repairer copying rows into this unit), by outcome (stored; skipped: a value was there already, or its row or partition was cleared since the repair window opened).",
            "outcome",
            &[
                ("stored", m.repaired[0].load(Relaxed)),
                ("skipped", m.repaired[1].load(Relaxed)),
            ],
        )?;
        family(
            &mut e,
            "forwarded_copies",
            "Copies of puts this unit forwarded to the next unit of their chain (docs/replication.md#forwarding), by outcome (committed; failed: the client writes that copy itself).",
            "outcome",
            &[
                ("committed", m.forwarded[0].load(Relaxed)),
                ("failed", m.forwarded[1].load(Relaxed)),
            ],
        )?;
        counter(
            &mut e,
            "forwarded_bytes",
            "Bytes this unit forwarded to the next unit of a put's chain, where that unit committed them.",
            m.forwarded_bytes.load(Relaxed),
        )?;
        // Checkpoints.
        family(
            &mut e,
            "checkpoints",
            "Checkpoints written, by outcome.",
            "outcome",
            &[
                ("ok", m.checkpoints[0].load(Relaxed)),
                ("error", m.checkpoints[1].load(Relaxed)),
            ],
        )?;
        m.checkpoint_seconds.encode(e.encode_descriptor(
            "checkpoint_duration_seconds",
            "Time to write a checkpoint.",
            None,
            MetricType::Histogram,
        )?)?;
        gauge(
            &mut e,
            "uptime_seconds",
            "Seconds since the unit started.",
            sh.started.elapsed().as_secs_f64(),
        )?;
        let instance = format!("{:032x}", sh.instance_id);
        let mut d = e.encode_descriptor(
            "unit",
            "The unit's instance id (a new one after every restart).",
            None,
            MetricType::Info,
        )?;
        d.encode_info(&[("instance", instance.as_str())])?;
        Ok(())
    }
}

/// The registry in the Prometheus text format.
pub(crate) fn render(r: &Registry) -> String {
    let mut out = String::with_capacity(16 << 10);
    if prometheus_client::encoding::prometheus_text::encode(&mut out, r).is_err() {
        out.clear();
    }
    out
}
