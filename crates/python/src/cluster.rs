//! `_native.select_clusters`, `_native.plan_unit_nodes` (placement of
//! units over a job's clusters, [`stowage_cluster::placement`]) and
//! `_native.load_config`, `_native.resolve_listen_host` (the config file,
//! [`stowage_cluster::config`], which also checks a config given as a dict,
//! so that `stowage.ray` validates nothing itself). `stowage.placement` and `stowage.config`
//! wrap them.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};
use stowage_cluster::config::{parse_duration, Config, ConfigError, ListenHost};
use stowage_cluster::placement::{self, Placement};

use crate::errors::invalid;

const PLACEMENT: &str = "placement must be \"all\" or a list of cluster names";

fn type_name(ob: &Bound<'_, PyAny>) -> String {
    ob.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// `"all"` or an iterable of names.
fn placement_arg(ob: &Bound<'_, PyAny>) -> PyResult<Placement> {
    if let Ok(s) = ob.cast::<PyString>() {
        let s = s.to_cow()?;
        if s == "all" {
            return Ok(Placement::All);
        }
        return Err(invalid(format!(
            "{PLACEMENT}, not the string {s:?} (a list of one name is [{s:?}])"
        )));
    }
    let items = ob
        .try_iter()
        .map_err(|_| invalid(format!("{PLACEMENT}, not {}", type_name(ob))))?;
    let mut names = Vec::new();
    for item in items {
        let item = item?;
        let name = item.cast::<PyString>().map_err(|_| {
            invalid(format!(
                "{PLACEMENT}: a cluster name is a str, not {}",
                type_name(&item)
            ))
        })?;
        names.push(name.to_cow()?.into_owned());
    }
    let placement = Placement::Names(names);
    placement.validate().map_err(|e| invalid(e.to_string()))?;
    Ok(placement)
}

/// The clusters `placement` (`"all"` or a list of names) selects out of
/// `clusters_by_name` (name -> cluster object), each once, in the
/// mapping's order; one object under two names is one cluster (`is`).
/// Returns them and the notes worth logging.
#[pyfunction]
pub(crate) fn select_clusters<'py>(
    placement: &Bound<'py, PyAny>,
    clusters_by_name: &Bound<'py, PyAny>,
) -> PyResult<(Vec<Bound<'py, PyAny>>, Vec<String>)> {
    let placement = placement_arg(placement)?;
    let mapping = clusters_by_name.cast::<PyMapping>().map_err(|_| {
        invalid(format!(
            "clusters_by_name must be a mapping of cluster name -> cluster, not {}",
            type_name(clusters_by_name)
        ))
    })?;
    let mut objects: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut registrations: Vec<(String, usize)> = Vec::new();
    for item in mapping.items()?.iter() {
        let (name, cluster): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
        let name = name
            .cast::<PyString>()
            .map_err(|_| {
                invalid(format!(
                    "clusters_by_name: a cluster name is a str, not {}",
                    type_name(&name)
                ))
            })?
            .to_cow()?
            .into_owned();
        let key = match objects.iter().position(|o| o.is(&cluster)) {
            Some(k) => k,
            None => {
                objects.push(cluster);
                objects.len() - 1
            }
        };
        registrations.push((name, key));
    }
    let selection = placement::select_clusters(&placement, &registrations)
        .map_err(|e| invalid(e.to_string()))?;
    let clusters = selection
        .clusters
        .into_iter()
        .map(|k| objects[k].clone())
        .collect();
    Ok((clusters, selection.notes))
}

/// One node id per unit, round-robin over the nodes of `clusters` (each a
/// sequence of node-id strs) in order, each node once; `count=None`: two
/// per node.
#[pyfunction]
#[pyo3(signature = (clusters, count = None))]
pub(crate) fn plan_unit_nodes(
    clusters: &Bound<'_, PyAny>,
    count: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<String>> {
    let count = match count {
        None => None,
        Some(c) if c.is_none() => None,
        Some(c) => {
            let n = (!c.is_instance_of::<PyBool>())
                .then(|| c.extract::<i64>().ok())
                .flatten()
                .ok_or_else(|| {
                    invalid(format!(
                        "count must be an int or None, not {}",
                        type_name(c)
                    ))
                })?;
            Some(
                usize::try_from(n)
                    .map_err(|_| invalid(format!("count must be at least 1, got {n}")))?,
            )
        }
    };
    if clusters.is_instance_of::<PyString>() {
        return Err(invalid(
            "clusters must be a list of clusters (each a list of node ids), not a str",
        ));
    }
    let items = clusters.try_iter().map_err(|_| {
        invalid(format!(
            "clusters must be a list of clusters (each a list of node ids), not {}",
            type_name(clusters)
        ))
    })?;
    let mut nodes: Vec<Vec<String>> = Vec::new();
    for (i, cluster) in items.enumerate() {
        let cluster = cluster?;
        if cluster.is_instance_of::<PyString>() {
            return Err(invalid(format!(
                "cluster {i}: a list of node ids, not a str"
            )));
        }
        let ids = cluster.try_iter().map_err(|_| {
            invalid(format!(
                "cluster {i}: a list of node ids, not {}",
                type_name(&cluster)
            ))
        })?;
        let mut list = Vec::new();
        for id in ids {
            let id = id?;
            let s = id.cast::<PyString>().map_err(|_| {
                invalid(format!(
                    "cluster {i}: a node id is a str, not {}",
                    type_name(&id)
                ))
            })?;
            let s = s.to_cow()?;
            if s.is_empty() {
                return Err(invalid(format!("cluster {i}: a node id is empty")));
            }
            list.push(s.into_owned());
        }
        nodes.push(list);
    }
    placement::plan_unit_nodes(&nodes, count).map_err(|e| invalid(e.to_string()))
}

/// An `InvalidRequest` for a config error, with `file` and `key`
/// attributes (`key` None when the error is not about one key).
fn config_error(py: Python<'_>, e: ConfigError) -> PyErr {
    let (file, key) = match &e {
        ConfigError::Read { file, .. } => (file.display().to_string(), None),
        ConfigError::Invalid { file, key, .. } => (file.clone(), key.clone()),
    };
    let err = invalid(e.to_string());
    let value = err.value(py);
    // Setting attributes on a fresh exception cannot fail short of memory
    // exhaustion; the error is worth raising without them then.
    let _ = value.setattr("file", file);
    let _ = value.setattr("key", key);
    err
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn path_str(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.display().to_string())
}

/// The config as a dict of sections: every key present (None where unset
/// and without a default), sizes in bytes, durations in float seconds.
fn config_dict<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyDict>> {
    let units = PyDict::new(py);
    let u = &c.units;
    units.set_item("count", u.count)?;
    units.set_item("replicas", u.replicas)?;
    units.set_item("memory", u.memory)?;
    units.set_item("cpus", u.cpus)?;
    units.set_item("reservation_lease", secs(u.reservation_lease))?;
    units.set_item("pin_lease", secs(u.pin_lease))?;
    units.set_item("max_connections", u.max_connections)?;
    units.set_item("max_sessions", u.max_sessions)?;
    units.set_item("threads", u.threads)?;
    units.set_item("max_handshakes", u.max_handshakes)?;
    units.set_item("max_handshakes_per_source", u.max_handshakes_per_source)?;
    units.set_item("max_session_connections", u.max_session_connections)?;
    units.set_item("max_session_holds", u.max_session_holds)?;
    units.set_item("checkpoint_root", path_str(&u.checkpoint_root))?;
    units.set_item("nixl", u.nixl)?;
    units.set_item("require_rdma", u.require_rdma)?;
    match &u.disk {
        None => units.set_item("disk", py.None())?,
        Some(d) => {
            let disk = PyDict::new(py);
            disk.set_item("root", d.root.display().to_string())?;
            disk.set_item("capacity", d.capacity)?;
            disk.set_item("high_watermark", d.high_watermark)?;
            disk.set_item("low_watermark", d.low_watermark)?;
            units.set_item("disk", disk)?;
        }
    }

    let placement = PyDict::new(py);
    match &c.placement.clusters {
        Placement::All => placement.set_item("clusters", "all")?,
        Placement::Names(n) => placement.set_item("clusters", PyList::new(py, n)?)?,
    }

    let listen = PyDict::new(py);
    listen.set_item("host", c.listen.host.to_string())?;
    listen.set_item("tcp_port", c.listen.tcp_port)?;
    listen.set_item("unix_dir", path_str(&c.listen.unix_dir))?;

    let auth = PyDict::new(py);
    auth.set_item("secret_file", path_str(&c.auth.secret_file))?;
    auth.set_item("insecure", c.auth.insecure)?;

    let timeouts = PyDict::new(py);
    let t = &c.timeouts;
    timeouts.set_item("op", secs(t.op))?;
    timeouts.set_item("start", secs(t.start))?;
    timeouts.set_item("stop", secs(t.stop))?;
    timeouts.set_item("frame", secs(t.frame))?;
    timeouts.set_item("handshake", secs(t.handshake))?;

    let client = PyDict::new(py);
    client.set_item("namespace", &c.client.namespace)?;
    client.set_item("transport", c.client.transport.as_str())?;
    client.set_item("wait_for_memory", c.client.wait_for_memory.map(secs))?;

    let metrics = PyDict::new(py);
    metrics.set_item("enabled", c.metrics.enabled)?;
    metrics.set_item("listen", c.metrics.listen.to_string())?;
    metrics.set_item("token_file", path_str(&c.metrics.token_file))?;

    let d = PyDict::new(py);
    d.set_item("units", units)?;
    d.set_item("placement", placement)?;
    d.set_item("listen", listen)?;
    d.set_item("auth", auth)?;
    d.set_item("timeouts", timeouts)?;
    d.set_item("client", client)?;
    d.set_item("metrics", metrics)?;
    Ok(d)
}

/// Read the config file at `path`, or parse `text`, or take `mapping` (a
/// dict of sections), or (none) the defaults; return it as a dict of
/// sections. Raises InvalidRequest (with `file` and `key` attributes) for a
/// file that cannot be read, is not TOML, has an unknown key or a value out
/// of range.
#[pyfunction]
#[pyo3(signature = (path = None, text = None, mapping = None))]
pub(crate) fn load_config<'py>(
    py: Python<'py>,
    path: Option<PathBuf>,
    text: Option<String>,
    mapping: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = match (path, text, mapping) {
        (Some(p), None, None) => Config::from_file(&p),
        (None, Some(t), None) => Config::from_toml_str(&t),
        (None, None, Some(m)) => config_of_mapping(m)?,
        (None, None, None) => Ok(Config::default()),
        _ => {
            return Err(invalid(
                "give the config's path, its text or a mapping of sections, not both",
            ))
        }
    }
    .map_err(|e| config_error(py, e))?;
    config_dict(py, &cfg)
}

/// What a config given as a mapping is called in errors.
const MAPPING_SOURCE: &str = "<config>";

/// A config given as a mapping of sections: what a config file holds, or
/// what `load_config` returned (None: unset; sizes in bytes; durations in
/// seconds as numbers, or strings such as "30s"). It is checked as a file
/// is: an unknown section or key, a wrong type or a value out of range is
/// an error that names the key.
fn config_of_mapping(mapping: &Bound<'_, PyAny>) -> PyResult<Result<Config, ConfigError>> {
    let durations = duration_keys();
    let toml::Value::Table(table) = toml_value(mapping, "", &durations)?
        .unwrap_or_else(|| toml::Value::Table(toml::Table::new()))
    else {
        return Err(invalid(format!(
            "config must be a mapping of sections, not {}",
            type_name(mapping)
        )));
    };
    let cfg = serde_path_to_error::deserialize::<_, Config>(table).map_err(|e| {
        let key = e.path().to_string();
        ConfigError::Invalid {
            file: MAPPING_SOURCE.into(),
            key: (key != ".").then_some(key),
            line: None,
            message: e.into_inner().message().trim_end().to_string(),
        }
    });
    Ok(cfg.and_then(|c| c.validate().map(|()| c)))
}

/// The dotted keys whose values are durations: the keys of a config, with
/// its optional durations set, whose values serialize as duration strings.
fn duration_keys() -> Vec<String> {
    fn walk(v: &toml::Value, key: &str, out: &mut Vec<String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if key.is_empty() {
                        k.clone()
                    } else {
                        format!("{key}.{k}")
                    };
                    walk(v, &key, out);
                }
            }
            toml::Value::String(s) if parse_duration(s).is_ok() => out.push(key.to_string()),
            _ => {}
        }
    }
    let mut probe = Config::default();
    probe.client.wait_for_memory = Some(Duration::from_secs(1));
    let mut out = Vec::new();
    // A config always serializes (Config::to_toml_string relies on it too).
    if let Ok(v) = toml::Value::try_from(&probe) {
        walk(&v, "", &mut out);
    }
    out
}

/// `ob` as a TOML value (`None` for Python's None: the key is unset); a
/// number at one of `durations` becomes a duration string (seconds).
fn toml_value(
    ob: &Bound<'_, PyAny>,
    key: &str,
    durations: &[String],
) -> PyResult<Option<toml::Value>> {
    let bad = |what: String| {
        let at = if key.is_empty() {
            String::new()
        } else {
            format!("{key}: ")
        };
        invalid(format!("{MAPPING_SOURCE}: {at}{what}"))
    };
    if ob.is_none() {
        return Ok(None);
    }
    if let Ok(b) = ob.cast::<PyBool>() {
        return Ok(Some(toml::Value::Boolean(b.is_true())));
    }
    let number = ob.is_instance_of::<PyInt>() || ob.is_instance_of::<PyFloat>();
    if number && durations.iter().any(|d| d == key) {
        let secs: f64 = ob.extract()?;
        let d = Duration::try_from_secs_f64(secs)
            .map_err(|_| bad(format!("a duration in seconds is 0 or more, not {secs}")))?;
        return Ok(Some(toml::Value::String(format!("{}ns", d.as_nanos()))));
    }
    if ob.is_instance_of::<PyInt>() {
        let n: i64 = ob
            .extract()
            .map_err(|_| bad("an int out of range".into()))?;
        return Ok(Some(toml::Value::Integer(n)));
    }
    if let Ok(f) = ob.cast::<PyFloat>() {
        return Ok(Some(toml::Value::Float(f.value())));
    }
    if let Ok(s) = ob.cast::<PyString>() {
        return Ok(Some(toml::Value::String(s.to_cow()?.into_owned())));
    }
    if let Ok(m) = ob.cast::<PyMapping>() {
        let mut table = toml::Table::new();
        for item in m.items()?.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let k = k
                .cast::<PyString>()
                .map_err(|_| bad(format!("a key is a str, not {}", type_name(&k))))?
                .to_cow()?
                .into_owned();
            let sub = if key.is_empty() {
                k.clone()
            } else {
                format!("{key}.{k}")
            };
            if let Some(v) = toml_value(&v, &sub, durations)? {
                table.insert(k, v);
            }
        }
        return Ok(Some(toml::Value::Table(table)));
    }
    if let Ok(p) = ob.extract::<PathBuf>() {
        // An os.PathLike (a str was taken above).
        return Ok(Some(toml::Value::String(p.display().to_string())));
    }
    if ob.is_instance_of::<PyList>() || ob.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for (i, v) in ob.try_iter()?.enumerate() {
            let v = v?;
            match toml_value(&v, &format!("{key}[{i}]"), durations)? {
                Some(v) => items.push(v),
                None => return Err(bad(format!("item {i} is None"))),
            }
        }
        return Ok(Some(toml::Value::Array(items)));
    }
    Err(bad(format!(
        "a config value is a str, number, bool, list or table, not {}",
        type_name(ob)
    )))
}

/// The address to bind for a `listen.host` value: the address itself, or
/// for `"node-ip"` this node's address as other nodes reach it (127.0.0.1
/// when there is no route).
#[pyfunction]
pub(crate) fn resolve_listen_host(host: &str) -> PyResult<String> {
    let host: ListenHost = host.parse().map_err(invalid)?;
    Ok(host.resolve().to_string())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(select_clusters, m)?)?;
    m.add_function(wrap_pyfunction!(plan_unit_nodes, m)?)?;
    m.add_function(wrap_pyfunction!(load_config, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_listen_host, m)?)?;
    Ok(())
}
