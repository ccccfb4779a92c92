//! Rust log events (`tracing`) to Python's `logging`: a unit running in
//! this process, the client and the local plane log to the logger
//! `stowage` (children `stowage.unit`, `stowage.client`, `stowage.cli`, …),
//! so an application configures them as any other Python logger.
//!
//! The level comes from `RUST_LOG` when set, else the command line's
//! default (warnings, and the units' lifecycle at info). Events are
//! handed to one forwarding thread through a bounded queue: the thread
//! that logs never waits for the GIL (it may hold a unit's lock, which a
//! Python thread holding the GIL may be waiting for); when the queue is
//! full, events are dropped and counted in the next one forwarded.
//!
//! Installed by the first object that can log (a client, a local plane, an
//! in-process unit) or by `stowage._native.route_logs()`, and only when
//! this process has no `tracing` subscriber yet: `python -m stowage ...`
//! sets its own (stderr, text or JSON) first and keeps it.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Once;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// One event, ready for Python.
struct Record {
    logger: String,
    level: u8,
    message: String,
    fields: Vec<(&'static str, String)>,
}

struct PyLogLayer {
    tx: SyncSender<Record>,
    dropped: AtomicU64,
}

#[derive(Default)]
struct Fields {
    message: String,
    fields: Vec<(&'static str, String)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            self.fields.push((field.name(), value.to_owned()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields.push((field.name(), format!("{value:?}")));
        }
    }
}

/// Python's level numbers.
fn py_level(l: &Level) -> u8 {
    match *l {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        _ => 5,
    }
}

/// `stowage_unit::conn` → `stowage.unit`.
fn logger_name(target: &str) -> String {
    let krate = target.split("::").next().unwrap_or(target);
    match krate.strip_prefix("stowage_") {
        Some(rest) => format!("stowage.{rest}"),
        None => format!("stowage.{krate}"),
    }
}

impl<S: Subscriber> Layer<S> for PyLogLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let mut message = f.message;
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let _ = write!(message, " ({dropped} earlier log events dropped)");
        }
        let r = Record {
            logger: logger_name(event.metadata().target()),
            level: py_level(event.metadata().level()),
            message,
            fields: f.fields,
        };
        if let Err(TrySendError::Full(_)) = self.tx.try_send(r) {
            self.dropped.fetch_add(1 + dropped, Ordering::Relaxed);
        }
    }
}

/// Hand records to `logging.getLogger(name).log(level, text, extra=...)`:
/// the text is the message and its fields (`key=value`); the fields are
/// also in `extra` as the record's `stowage` attribute (a dict).
fn forward(rx: std::sync::mpsc::Receiver<Record>) {
    while let Ok(r) = rx.recv() {
        Python::attach(|py| {
            let _ = (|| -> PyResult<()> {
                let logging = py.import("logging")?;
                let logger = logging.call_method1("getLogger", (r.logger.as_str(),))?;
                if !logger
                    .call_method1("isEnabledFor", (r.level,))?
                    .extract::<bool>()?
                {
                    return Ok(());
                }
                let mut text = r.message.clone();
                let fields = PyDict::new(py);
                for (k, v) in &r.fields {
                    let _ = write!(text, " {k}={v}");
                    fields.set_item(*k, v)?;
                }
                let extra = PyDict::new(py);
                extra.set_item("stowage", fields)?;
                let kwargs = PyDict::new(py);
                kwargs.set_item("extra", extra)?;
                logger.call_method("log", (r.level, text), Some(&kwargs))?;
                Ok(())
            })();
        });
    }
}

static INSTALL: Once = Once::new();

/// Route this process's Rust log events to Python's `logging` (once; not
/// when a `tracing` subscriber is set already).
pub(crate) fn install() {
    INSTALL.call_once(|| {
        let (tx, rx) = sync_channel(4096);
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(stowage_cli::cli::DEFAULT_LOG_FILTER)
        });
        let layer = PyLogLayer {
            tx,
            dropped: AtomicU64::new(0),
        };
        let installed = tracing_subscriber::registry()
            .with(layer.with_filter(filter))
            .try_init()
            .is_ok();
        if installed {
            let _ = std::thread::Builder::new()
                .name("stowage-log".into())
                .spawn(move || forward(rx));
        }
    });
}

/// `stowage._native.route_logs()`: route Rust log events to `logging` now.
#[pyfunction]
pub(crate) fn route_logs() {
    install();
}
