//! Why a unit could not start (a leaf: every layer may refuse a start).

use std::io;

/// Why a unit could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("creating the slab: {0}")]
    Slab(io::Error),
    #[error("binding {what}: {err}")]
    Bind { what: String, err: io::Error },
    #[error("{0}")]
    Restore(String),
}
