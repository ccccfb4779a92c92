//! # stowage-cluster: where a job's units go, and the config file
//!
//! * [`placement`]: the clusters a placement names
//!   ([`placement::select_clusters`]; `"all"` or a list of names, a cluster
//!   registered under two names being one cluster) and one node per unit,
//!   round-robin over their nodes ([`placement::plan_unit_nodes`]).
//! * [`config`]: the one TOML config file ([`config::Config`]): units,
//!   placement, listen addresses, auth, timeouts and client defaults,
//!   documented key by key in docs/config.md.
//!
//! Both are exposed to Python as `stowage.placement` and `stowage.config`.

#![forbid(unsafe_code)]

pub mod config;
pub mod placement;

pub use config::{Config, ConfigError};
pub use placement::{plan_unit_nodes, select_clusters, Placement, PlacementError, Selection};
