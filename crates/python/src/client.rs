//! `_native.Client`: rows of numpy arrays over [`stowage_client::Client`].
//!
//! Calls take row keys (ints or strs), field names and arrays already
//! normalised by the Python layer (torch tensors arrive as numpy arrays
//! over the same memory, bfloat16 tensors as `("bfloat16", int16 array)`).
//! Every transfer runs with the GIL released.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use stowage_client::{
    Client as Inner, ClientConfig, Column, DType, Error as ClientError, Secret, Tensor, UnitAddr,
};

use crate::arrays::{array_over, descr_for, ArrayBytes, HostBuf, OwnedBytes};
use crate::dicts::{checkpoint_dict, stats_dict};
use crate::errors::{invalid, to_py};
use crate::read_sinks::{nbytes, split_copies, AllocSink, Dest, OutSink, ReadData};
use crate::row_keys::{key_object, row_keys};
use crate::view_calls::Descrs;

/// A connection-pooling client of a set of units (see `stowage.connect`).
/// Safe to share between threads; calls from several threads run at once.
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct Client {
    inner: Mutex<Option<Arc<Inner>>>,
    timeout: Duration,
    /// Whether every unit is reached through shared memory (get_view).
    pub(crate) shm: bool,
    /// Whether Unix-socket units are reached through shared memory.
    shm_enabled: bool,
    addrs: Vec<String>,
    /// The namespace every request acts in.
    namespace: String,
    /// Copies of every row ([`ClientConfig::replicas`]).
    replicas: usize,
    /// The key that authenticates TransferQueue's pickled cells (see
    /// [`Client::cell_key`]), derived from the secret at connect; the
    /// secret itself stays in the connection config.
    cell_key: Option<[u8; 32]>,
}

/// The label of the key derived for TransferQueue's pickled cells: that key
/// is HMAC-SHA-256(secret, label), so a cell tag never uses the secret
/// itself, and a cell key cannot prove the secret at a connect (whose
/// proofs are HMACs under the secret over other labels).
const CELL_KEY_LABEL: &[u8] = b"stowage tq cell key v1";

fn cell_key(secret: &Secret) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(secret.expose())
        .expect("HMAC takes a key of any length");
    m.update(CELL_KEY_LABEL);
    m.finalize().into_bytes().into()
}

/// A shared secret from bytes or a str (its UTF-8 bytes).
pub(crate) fn secret_arg(ob: &Bound<'_, PyAny>) -> PyResult<Secret> {
    let bytes: Vec<u8> = if let Ok(b) = ob.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else if let Ok(s) = ob.cast::<PyString>() {
        s.extract::<String>()?.into_bytes()
    } else {
        return Err(invalid("secret must be bytes or a str"));
    };
    Secret::from_bytes(bytes).map_err(|e| invalid(e.to_string()))
}

/// A column as given: one array split along axis 0, or one per row.
enum Source<'py> {
    Dense(ArrayBytes<'py>),
    Jagged(Vec<ArrayBytes<'py>>),
}

impl Client {
    pub(crate) fn client(&self) -> PyResult<Arc<Inner>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| invalid("the data plane is closed"))
    }

    pub(crate) fn deadline(&self, timeout: Option<f64>) -> PyResult<Instant> {
        let t = match timeout {
            None => self.timeout,
            Some(s) => Duration::try_from_secs_f64(s)
                .map_err(|_| invalid("timeout must be a non-negative number of seconds"))?,
        };
        Ok(Instant::now() + t)
    }
}

#[pymethods]
impl Client {
    /// A client of `units` (`unix:/path` for shared memory on this host,
    /// `tcp:host:port` otherwise) in `namespace`. Opens no connection: each
    /// unit's first is opened by the first call that touches it, and a
    /// unit that cannot be reached fails that call (`check_units` reaches
    /// every unit at once). `timeout`: the default
    /// deadline of every call, in seconds. `shm=False` streams bytes
    /// through Unix sockets instead of copying through shared memory.
    /// `secret` (bytes or str): the units' shared secret, proved at every
    /// connect (None: no secret; the environment is not read here).
    /// `instances`: the instance id (32 hex digits) each unit is expected
    /// to be, from a directory. `liveness`: `f(unit_index) -> "dead" |
    /// "alive" | "unknown"`, asked only after an operation on that unit
    /// failed. `nixl`: reach the units not reached over shared memory with
    /// one-sided NIXL transfers where they serve it (tcp where they do
    /// not); `require_rdma`: refuse to run nixl unless UCX is held to RDMA
    /// transports. `replicas`: copies of every row, each on another unit
    /// (1 to the number of units); every client of a plane must use the
    /// same number. `hosts`: each unit's host, from a directory (copies go
    /// on distinct hosts when there are enough).
    #[new]
    #[pyo3(signature = (units, namespace = "default".to_string(), timeout = 30.0, shm = true, wait_for_memory = None, secret = None, instances = None, liveness = None, nixl = false, require_rdma = true, replicas = 1, hosts = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        units: Vec<String>,
        namespace: String,
        timeout: f64,
        shm: bool,
        wait_for_memory: Option<f64>,
        secret: Option<&Bound<'_, PyAny>>,
        instances: Option<Vec<Option<String>>>,
        liveness: Option<Py<PyAny>>,
        nixl: bool,
        require_rdma: bool,
        replicas: i64,
        hosts: Option<Vec<Option<String>>>,
    ) -> PyResult<Self> {
        crate::logbridge::install();
        let secret = secret.map(secret_arg).transpose()?;
        let addrs = units
            .iter()
            .map(|u| u.parse::<UnitAddr>().map_err(invalid))
            .collect::<PyResult<Vec<_>>>()?;
        let derived = secret.as_ref().map(cell_key);
        let all_shm = shm && addrs.iter().all(|a| matches!(a, UnitAddr::Unix(_)));
        let mut cfg = ClientConfig::new(namespace.clone(), addrs.clone());
        cfg.timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|_| invalid("timeout must be a non-negative number of seconds"))?;
        cfg.shm = shm;
        cfg.wait_for_memory = wait_for_memory
            .map(Duration::try_from_secs_f64)
            .transpose()
            .map_err(|_| invalid("wait_for_memory must be a non-negative number of seconds"))?;
        cfg.secret = secret;
        // 0 and more than the units are refused by connect, naming both.
        cfg.replicas = usize::try_from(replicas)
            .map_err(|_| invalid(format!("replicas must be at least 1, got {replicas}")))?;
        if nixl {
            cfg.nixl = Some(stowage_client::NixlOptions {
                require_rdma,
                ..Default::default()
            });
        }
        if let Some(ids) = instances {
            cfg.instances = crate::directory::instance_ids(&ids, addrs.len())?;
        }
        cfg.hosts = hosts.unwrap_or_default();
        if let Some(callable) = liveness {
            if !callable.bind(py).is_callable() {
                return Err(invalid("liveness must be a callable f(unit_index) -> str"));
            }
            cfg.directory = Arc::new(crate::directory::PyLiveness::new(callable));
        }
        let (timeout, replicas) = (cfg.timeout, cfg.replicas);
        let client = py
            .detach(move || Inner::connect(cfg))
            .map_err(|e| to_py(py, e, &[]))?;
        let client = Arc::new(client);
        // With copies: newcomers' repairs run in the background.
        stowage_client::repair_in_background(&client);
        Ok(Self {
            inner: Mutex::new(Some(client)),
            timeout,
            shm: all_shm,
            shm_enabled: shm,
            addrs: addrs.iter().map(|a| a.to_string()).collect(),
            namespace,
            replicas,
            cell_key: derived,
        })
    }

    /// Drop the connections. Arrays from `get_view` stay valid until they
    /// are garbage-collected. Further calls raise InvalidRequest.
    fn close(&self) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// The unit addresses, in order.
    #[getter]
    fn units(&self) -> Vec<String> {
        self.addrs.clone()
    }

    /// The namespace every request acts in.
    #[getter]
    fn namespace(&self) -> String {
        self.namespace.clone()
    }

    /// Whether every unit is reached through shared memory.
    #[getter]
    fn shm(&self) -> bool {
        self.shm
    }

    /// Copies of every row, each on another unit.
    #[getter]
    fn replicas(&self) -> usize {
        self.replicas
    }

    /// Units whose rows' copies share a host (the plane has too few).
    fn copies_short_of_hosts(&self) -> PyResult<usize> {
        Ok(self.client()?.copies_short_of_hosts())
    }

    /// The key (32 bytes) that authenticates the TransferQueue backend's
    /// pickled cells: HMAC-SHA-256(secret, b"stowage tq cell key v1"),
    /// never the secret itself. None when the client has no secret.
    fn cell_key<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.cell_key.as_ref().map(|k| PyBytes::new(py, k))
    }

    /// Put rows: `columns` is a list of `(field, column)` where a column is
    /// one array whose first axis has one entry per key, or a list of one
    /// array per key.
    /// `groups`: one group id per key; rows of a group are claimed whole
    /// (`register_tasks`) and live on the group's unit (`unit_of`) unless
    /// `unit` is given: read and clear them with that unit.
    #[pyo3(signature = (partition, keys, columns, unit = None, timeout = None, groups = None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        partition: &str,
        keys: &Bound<'_, PyAny>,
        columns: &Bound<'_, PyAny>,
        unit: Option<usize>,
        timeout: Option<f64>,
        groups: Option<Vec<String>>,
    ) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let keys = row_keys(keys)?;
        let mut sources: Vec<(String, Source<'_>)> = Vec::new();
        for item in columns.try_iter()? {
            let item = item?;
            let (name, col): (String, Bound<'_, PyAny>) = item
                .extract()
                .map_err(|_| invalid("columns must be (field, column) pairs"))?;
            // Column lengths are checked by the client's put, for every
            // caller alike.
            let src = if let Ok(list) = col.cast::<PyList>() {
                let arrays = list
                    .iter()
                    .enumerate()
                    .map(|(i, a)| ArrayBytes::new(&a, &|| format!("column {name:?} row {i}")))
                    .collect::<PyResult<Vec<_>>>()?;
                Source::Jagged(arrays)
            } else {
                Source::Dense(ArrayBytes::new(&col, &|| format!("column {name:?}"))?)
            };
            sources.push((name, src));
        }
        // Each array's shape moves into its tensor (no copy per value).
        fn tensor<'a>(a: &'a mut ArrayBytes<'_>) -> Tensor<'a> {
            let shape = std::mem::take(&mut a.shape);
            let a: &'a ArrayBytes<'_> = a;
            Tensor {
                dtype: a.dtype,
                shape,
                data: a.bytes(),
            }
        }
        let columns: Vec<(&str, Column<'_>)> = sources
            .iter_mut()
            .map(|(name, s)| {
                let col = match s {
                    Source::Dense(a) => Column::Dense(tensor(a)),
                    Source::Jagged(v) => Column::Jagged(v.iter_mut().map(tensor).collect()),
                };
                (name.as_str(), col)
            })
            .collect();
        let client = self.client()?;
        py.detach(|| {
            client.put_grouped(
                partition,
                &keys,
                groups.as_deref(),
                &columns,
                unit,
                deadline,
            )
        })
        .map_err(|e| to_py(py, e, &keys))
    }

    /// The unit the row named `name`, or the rows of group `name`, live on.
    fn unit_of(&self, name: &str) -> PyResult<usize> {
        Ok(self.client()?.unit_of(name))
    }

    /// Declare the consumer `tasks` of `partition` on every unit:
    /// `samples` rows expected in all; with `group_size`, rows put with
    /// `groups` are claimed in whole groups. Idempotent.
    #[pyo3(signature = (partition, tasks, samples, group_size = None, timeout = None))]
    fn register_tasks(
        &self,
        py: Python<'_>,
        partition: &str,
        tasks: Vec<String>,
        samples: u64,
        group_size: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let g = group_size.unwrap_or(0);
        py.detach(|| client.register_tasks(partition, &tasks, samples, g, deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// Claim for `task` up to `count` rows of `partition` that have all of
    /// `fields`: each row once per task, over every client. `block`: wait
    /// (woken by the units) until a row is ready, raising `Timeout` at
    /// `timeout`; else `[]` when none is. Returns the rows' keys.
    #[pyo3(signature = (partition, task, fields, count, block = true, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn claim<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        task: &str,
        fields: Vec<String>,
        count: u32,
        block: bool,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let rows = py
            .detach(|| client.claim(partition, task, &fields, count, block, deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        rows.iter().map(|k| key_object(py, k)).collect()
    }

    /// `task`'s progress through `partition`, summed over the units:
    /// `registered` (0 or 1), `samples`, `group_size`, `consumed` (rows
    /// claimed for good), `leased` (rows being claimed now).
    #[pyo3(signature = (partition, task, timeout = None))]
    fn claim_status<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        task: &str,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let p = py
            .detach(|| client.claim_status(partition, task, deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        let d = PyDict::new(py);
        d.set_item("registered", u64::from(p.registered))?;
        d.set_item("samples", p.samples)?;
        d.set_item("group_size", p.group_size)?;
        d.set_item("consumed", p.consumed)?;
        d.set_item("leased", p.leased)?;
        Ok(d)
    }

    /// The claims state of this namespace on unit `unit`, as bytes (a
    /// checkpoint's `claims` format): what `load_claims` puts back on a
    /// unit holding the same rows.
    #[pyo3(signature = (unit, timeout = None))]
    fn claims_state<'py>(
        &self,
        py: Python<'py>,
        unit: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let state = py
            .detach(|| client.claims_state(unit, deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        Ok(PyBytes::new(py, &state))
    }

    /// Put back on unit `unit` a claims state `claims_state` answered,
    /// over the rows the unit holds now: each partition it names takes
    /// the saved registration and consumption there.
    #[pyo3(signature = (unit, state, timeout = None))]
    fn load_claims(
        &self,
        py: Python<'_>,
        unit: usize,
        state: Vec<u8>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        py.detach(|| client.load_claims(unit, &state, deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// Get rows: a list (per field) of lists (per row) of new arrays with
    /// the dtype and shape that was put. `raw_bfloat16`: bfloat16 values
    /// come back as 2-byte void arrays (`V2`), for callers that
    /// reinterpret them without ml_dtypes.
    #[pyo3(signature = (partition, keys, fields, unit = None, timeout = None, raw_bfloat16 = false))]
    #[allow(clippy::too_many_arguments)]
    fn get<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        keys: &Bound<'py, PyAny>,
        fields: Vec<String>,
        unit: Option<usize>,
        timeout: Option<f64>,
        raw_bfloat16: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let deadline = self.deadline(timeout)?;
        let keys = row_keys(keys)?;
        let names: Vec<&str> = fields.iter().map(String::as_str).collect();
        let client = self.client()?;
        let mut sink = AllocSink::new(fields.len(), keys.len());
        py.detach(|| client.get_tensors_into(partition, &keys, &names, unit, &mut sink, deadline))
            .map_err(|e| to_py(py, e, &keys))?;
        let bases = sink
            .batches
            .into_iter()
            .map(|b| {
                let len = b.len();
                Bound::new(py, OwnedBytes::new(b)).map(|o| (o, len))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let out = PyList::empty(py);
        for (f, rows) in sink.values.into_iter().enumerate() {
            let list = PyList::empty(py);
            for (r, t) in rows.into_iter().enumerate() {
                let t = t.ok_or_else(|| {
                    invalid(format!("field {:?} row {r}: no value delivered", fields[f]))
                })?;
                let (base, ptr, len) = match t.data {
                    ReadData::Own(d) => {
                        let len = d.len();
                        let base = Bound::new(py, OwnedBytes::new(d))?;
                        let ptr = base.get().as_mut_ptr();
                        (base, ptr, len)
                    }
                    ReadData::Shared { buf, offset, len } => {
                        let (base, size) = &bases[buf];
                        if offset + len > *size {
                            return Err(invalid(format!(
                                "field {:?} row {r}: outside its batch buffer",
                                fields[f]
                            )));
                        }
                        (
                            base.clone(),
                            base.get().as_mut_ptr().wrapping_add(offset),
                            len,
                        )
                    }
                };
                if nbytes(t.dtype, &t.shape) != Some(len) {
                    return Err(invalid(format!(
                        "field {:?} row {r}: {len} bytes do not make a {} {:?} array",
                        fields[f],
                        t.dtype.name(),
                        t.shape
                    )));
                }
                let descr = descr_for(py, t.dtype, raw_bfloat16)?;
                // SAFETY: `ptr` is `len` bytes inside the memory `base`
                // owns (checked above: exactly the array's bytes), which
                // lives as long as the array; the arrays over one batch
                // buffer cover disjoint ranges of it.
                let a = unsafe { array_over(py, descr, &t.shape, ptr, true, base.into_any())? };
                list.append(a)?;
            }
            out.append(list)?;
        }
        Ok(out)
    }

    /// Get rows into caller arrays: `outs[i]` for `fields[i]` is a list of
    /// one array per row, or one array whose first axis has one entry per
    /// row. Every array must be C-contiguous and writeable, of the value's
    /// dtype and exactly its size. On error, arrays may be partly written.
    #[pyo3(signature = (partition, keys, fields, outs, unit = None, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn get_into(
        &self,
        py: Python<'_>,
        partition: &str,
        keys: &Bound<'_, PyAny>,
        fields: Vec<String>,
        outs: Vec<Bound<'_, PyAny>>,
        unit: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let keys = row_keys(keys)?;
        let n = keys.len();
        if outs.len() != fields.len() {
            return Err(invalid(format!(
                "{} out arrays for {} fields",
                outs.len(),
                fields.len()
            )));
        }
        // Holds the arrays (and so their memory) until the call returns.
        let mut held: Vec<ArrayBytes<'_>> = Vec::new();
        let mut dests = Vec::with_capacity(fields.len());
        for (name, out) in fields.iter().zip(&outs) {
            let what = |i: Option<usize>| match i {
                Some(i) => format!("out[{name:?}] row {i}"),
                None => format!("out[{name:?}]"),
            };
            let writable = |a: &ArrayBytes<'_>, i: Option<usize>| {
                if a.writeable() {
                    Ok(())
                } else {
                    Err(invalid(format!("{}: the array is read-only", what(i))))
                }
            };
            let dest = if let Ok(list) = out.cast::<PyList>() {
                if list.len() != n {
                    return Err(invalid(format!(
                        "{} has {} arrays for {n} keys",
                        what(None),
                        list.len()
                    )));
                }
                let mut dtype = None;
                let mut rows = Vec::with_capacity(n);
                for (i, a) in list.iter().enumerate() {
                    let a = ArrayBytes::new(&a, &|| what(Some(i)))?;
                    writable(&a, Some(i))?;
                    if dtype.is_some_and(|d| d != a.dtype) {
                        return Err(invalid(format!(
                            "{}: arrays of different dtypes",
                            what(None)
                        )));
                    }
                    dtype = Some(a.dtype);
                    rows.push((a.dtype, a.dest(0, a.len())));
                    held.push(a);
                }
                // Per-row dtypes are all equal (checked above).
                Dest {
                    dtype: dtype.unwrap_or(DType::U8),
                    rows: rows.into_iter().map(|(_, d)| d).collect(),
                }
            } else {
                let a = ArrayBytes::new(out, &|| what(None))?;
                writable(&a, None)?;
                if a.shape.first() != Some(&(n as u64)) {
                    return Err(invalid(format!(
                        "{}: a dense out array needs its first axis to be {n} (one entry per key), its shape is {:?}",
                        what(None),
                        a.shape
                    )));
                }
                let row = a.len().checked_div(n).unwrap_or(0);
                let d = Dest {
                    dtype: a.dtype,
                    rows: (0..n).map(|i| a.dest(i * row, row)).collect(),
                };
                held.push(a);
                d
            };
            dests.push(dest);
        }
        // Two destinations sharing memory would be two writers of it.
        let mut ranges: Vec<(usize, usize)> = dests
            .iter()
            .flat_map(|d| d.rows.iter().filter(|r| r.len() > 0).map(|r| r.range()))
            .collect();
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(invalid(
                "out arrays overlap (the same memory for two values)",
            ));
        }
        let names: Vec<&str> = fields.iter().map(String::as_str).collect();
        let mut sink = OutSink {
            dests,
            fields: fields.clone(),
            error: None,
        };
        let client = self.client()?;
        let r = py.detach(|| {
            client.get_tensors_into(partition, &keys, &names, unit, &mut sink, deadline)
        });
        drop(held);
        if let Some(m) = sink.error {
            return Err(invalid(m));
        }
        r.map_err(|e| to_py(py, e, &keys))
    }

    /// Read-only arrays over the values in the units' slabs (no copy):
    /// a list (per field) of lists (per row). The values stay pinned (the
    /// units keep them in place even if the rows are cleared) until every
    /// array of the call is garbage-collected. Shared-memory units only.
    /// A value the unit stored split across pieces of its slab (it was
    /// larger than any free range when put) is not one range of memory:
    /// it comes back as a copy, a new writeable array exactly as `get`
    /// returns it (copied once, with the GIL released).
    #[pyo3(signature = (partition, keys, fields, unit = None, timeout = None, raw_bfloat16 = false))]
    #[allow(clippy::too_many_arguments)]
    fn get_view<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        keys: &Bound<'py, PyAny>,
        fields: Vec<String>,
        unit: Option<usize>,
        timeout: Option<f64>,
        raw_bfloat16: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let (pins, mut copies) = self.view(
            py,
            keys,
            &fields,
            unit,
            timeout,
            Box::new(|client, keys, names, unit, deadline| {
                let view = client.view(partition, keys, names, unit, deadline)?;
                let copies = split_copies(&view)?;
                Ok((view, copies))
            }),
        )?;
        let Some(view) = pins.get().view.as_ref() else {
            return Err(invalid("the view is gone"));
        };
        let base = pins.as_any();
        let mut descrs = Descrs::new(raw_bfloat16);
        let mut out = Vec::with_capacity(view.fields());
        for (f, name) in fields.iter().enumerate().take(view.fields()) {
            let values = view.field(f);
            let mut arrays = Vec::with_capacity(values.len());
            for (r, t) in values.iter().enumerate() {
                let descr = descrs.get(py, t.dtype)?;
                // The value's bytes were checked to make its shape (the
                // client's view checks every value).
                if let Some(buf) = copies.remove(&(f, r)) {
                    let base = Bound::new(py, OwnedBytes::new(buf))?;
                    let ptr = base.get().as_mut_ptr();
                    // SAFETY: `ptr` is the bytes `base` owns (exactly the
                    // value's: `split_copies` read that many), which lives
                    // as long as the array; nothing else reads or writes
                    // them.
                    let a = unsafe { array_over(py, descr, &t.shape, ptr, true, base.into_any())? };
                    arrays.push(a);
                    continue;
                }
                let Some((ptr, _)) = view.as_ptr(t) else {
                    return Err(invalid(format!(
                        "field {name:?} row {r}: the value lies outside its unit's slab"
                    )));
                };
                // SAFETY: the view's memory stays mapped and pinned while
                // `pins` lives; the array keeps `pins` alive and is
                // read-only; its bytes make its shape (checked by the view).
                let a = unsafe {
                    array_over(py, descr, &t.shape, ptr as *mut u8, false, base.clone())?
                };
                arrays.push(a);
            }
            out.push(PyList::new(py, arrays)?);
        }
        PyList::new(py, out)
    }

    /// The values of a view packed a field at a time, per unit: a list of
    /// `(unit, rows, values, offsets)`, one per unit that holds some of
    /// the keys (unit order). `rows`: int64 positions in `keys` of that
    /// unit's rows, in the order of `keys`; `values[f]`: field `f`'s
    /// values of those rows back to back along the first axis; `offsets[f]`:
    /// int64, `len(rows) + 1` positions along that axis. A field's values
    /// that lie back to back in one range of the unit's slab (as a put of
    /// those rows in that order lays them) are a read-only array over
    /// them, pinned like `get_view`'s; others are copied (with the GIL
    /// released) into a new writeable array.
    #[pyo3(signature = (partition, keys, fields, unit = None, timeout = None, raw_bfloat16 = false))]
    #[allow(clippy::too_many_arguments)]
    fn get_packed_view<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        keys: &Bound<'py, PyAny>,
        fields: Vec<String>,
        unit: Option<usize>,
        timeout: Option<f64>,
        raw_bfloat16: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let (pins, (chunks, mut copies)) = self.view(
            py,
            keys,
            &fields,
            unit,
            timeout,
            Box::new(|client, keys, names, unit, deadline| {
                let (view, chunks) = client.packed_view(partition, keys, names, unit, deadline)?;
                let mut copies = std::collections::BTreeMap::new();
                for (c, chunk) in chunks.iter().enumerate() {
                    for (f, p) in chunk.fields.iter().enumerate() {
                        if p.in_place() {
                            continue;
                        }
                        let mut buf = HostBuf::new(p.len).map_err(|e| {
                            ClientError::InvalidRequest(format!("cannot map {} bytes: {e}", p.len))
                        })?;
                        view.read_packed_into(chunk, f, &mut buf)?;
                        copies.insert((c, f), buf);
                    }
                }
                Ok((view, (chunks, copies)))
            }),
        )?;
        let Some(view) = pins.get().view.as_ref() else {
            return Err(invalid("the view is gone"));
        };
        let mut descrs = Descrs::new(raw_bfloat16);
        let mut out = Vec::with_capacity(chunks.len());
        for (c, chunk) in chunks.iter().enumerate() {
            let rows: Vec<i64> = chunk.rows.iter().map(|&r| r as i64).collect();
            let mut values = Vec::with_capacity(chunk.fields.len());
            let mut offsets = Vec::with_capacity(chunk.fields.len());
            for (f, p) in chunk.fields.iter().enumerate() {
                let descr = descrs.get(py, p.dtype)?;
                let shape = p.shape();
                let a = if let Some(buf) = copies.remove(&(c, f)) {
                    let base = Bound::new(py, OwnedBytes::new(buf))?;
                    let ptr = base.get().as_mut_ptr();
                    // SAFETY: `ptr` is the `p.len` bytes `base` owns (the
                    // packed values: their dims make exactly that many),
                    // which lives as long as the array; nothing else reads
                    // or writes them.
                    unsafe { array_over(py, descr, &shape, ptr, true, base.into_any())? }
                } else {
                    let Some((ptr, _)) = view.packed_ptr(chunk, p) else {
                        return Err(invalid(format!(
                            "field {:?}: the values lie outside their unit's slab",
                            fields[f]
                        )));
                    };
                    // SAFETY: the view's memory stays mapped and pinned
                    // while `pins` lives; the array keeps `pins` alive and
                    // is read-only; the packed values' bytes make its shape
                    // (each value's were checked by the view).
                    unsafe {
                        array_over(
                            py,
                            descr,
                            &shape,
                            ptr as *mut u8,
                            false,
                            pins.clone().into_any(),
                        )?
                    }
                };
                values.push(a);
                let o: Vec<i64> = p.offsets.iter().map(|&o| o as i64).collect();
                offsets.push(numpy::PyArray1::from_vec(py, o));
            }
            out.push((
                chunk.unit,
                numpy::PyArray1::from_vec(py, rows),
                PyList::new(py, values)?,
                PyList::new(py, offsets)?,
            ));
        }
        PyList::new(py, out)
    }

    /// Clear rows (every field of each key in `partition`). Returns the
    /// number of entries removed.
    #[pyo3(signature = (partition, keys, unit = None, timeout = None))]
    fn clear(
        &self,
        py: Python<'_>,
        partition: &str,
        keys: &Bound<'_, PyAny>,
        unit: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<u64> {
        let deadline = self.deadline(timeout)?;
        let keys = row_keys(keys)?;
        let client = self.client()?;
        py.detach(|| client.clear(partition, &keys, unit, deadline))
            .map_err(|e| to_py(py, e, &keys))
    }

    /// Clear every row of `partition` on every unit. Returns the number of
    /// entries removed.
    #[pyo3(signature = (partition, timeout = None))]
    fn clear_partition(
        &self,
        py: Python<'_>,
        partition: &str,
        timeout: Option<f64>,
    ) -> PyResult<u64> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        py.detach(|| client.clear_partition(partition, deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// The rows of `partition`: a dict from key to its field names.
    #[pyo3(signature = (partition, timeout = None))]
    fn list<'py>(
        &self,
        py: Python<'py>,
        partition: &str,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let rows = py
            .detach(|| client.list(partition, deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        let d = PyDict::new(py);
        for (k, fields) in rows {
            d.set_item(key_object(py, &k)?, fields)?;
        }
        Ok(d)
    }

    /// The partitions of this namespace that hold data, sorted.
    #[pyo3(signature = (timeout = None))]
    fn partitions(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Vec<String>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        py.detach(|| client.partitions(deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// This client's own counters (operations, retries, waits, bytes,
    /// each unit's latency) as JSON.
    fn metrics_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.client()?.metrics()).map_err(|e| invalid(e.to_string()))
    }

    /// This client's metrics in the Prometheus text format.
    fn metrics_text(&self) -> PyResult<String> {
        let mut r = prometheus_client::registry::Registry::default();
        self.client()?.register_metrics(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &r)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(out)
    }

    /// Every unit's counters, in unit order.
    #[pyo3(signature = (timeout = None))]
    fn stats<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let all = py.detach(|| client.stats(deadline));
        let out = PyList::empty(py);
        for (u, s) in all.into_iter().enumerate() {
            let s = s.map_err(|e| to_py(py, e, &[]))?;
            let d = stats_dict(py, &s)?;
            // How this client reaches the unit: shm, nixl or tcp.
            d.set_item("transport", client.transport(u))?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Open (and keep) a connection to every unit, in unit order: raises
    /// as the first unit that cannot be reached fails (Unreachable,
    /// Timeout, Unauthorized).
    #[pyo3(signature = (timeout = None))]
    fn check_units(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        py.detach(|| client.check_units(deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// Every unit writes its data and index to `dir/unit-<i>` on its own
    /// host; returns per unit the metadata (rows, entries, bytes, files
    /// with sizes and checksums, the manifest's checksum).
    #[pyo3(signature = (dir, timeout = None))]
    fn checkpoint<'py>(
        &self,
        py: Python<'py>,
        dir: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let infos = py
            .detach(|| client.checkpoint(std::path::Path::new(&dir), deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        let out = PyList::empty(py);
        for info in infos {
            out.append(checkpoint_dict(py, info)?)?;
        }
        Ok(out)
    }

    /// Ask unit `unit` to serve the checkpoint in `dir` (on its own host,
    /// under its checkpoint root) from a restore unit it starts in its own
    /// process. Returns a dict: `host` (the unit's host name), `path` (the
    /// directory it looked at there), and either `missing` (what is not
    /// there; nothing was started) or `id` (for `close_restore`), `info`
    /// (what it restored, as `checkpoint` gives it) and `client` (a
    /// Client of the restore unit in `namespace`, with this client's
    /// secret).
    #[pyo3(signature = (unit, dir, namespace, timeout = None))]
    fn open_restore<'py>(
        &self,
        py: Python<'py>,
        unit: usize,
        dir: String,
        namespace: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        let reply = py
            .detach(|| client.open_restore(unit, &dir, deadline))
            .map_err(|e| to_py(py, e, &[]))?;
        let d = PyDict::new(py);
        d.set_item("host", &reply.host)?;
        d.set_item("path", &reply.path)?;
        let Some(src) = reply.opened else {
            d.set_item("missing", &reply.missing)?;
            return Ok(d);
        };
        d.set_item("id", src.id)?;
        let opened = client
            .restore_address(unit, &src)
            .and_then(|addr| Ok((addr.clone(), client.sibling(vec![addr], &namespace)?)));
        let (addr, restored) = match opened {
            Ok(x) => x,
            Err(e) => {
                let _ = py.detach(|| client.close_restore(unit, src.id, deadline));
                return Err(to_py(py, e, &[]));
            }
        };
        d.set_item("address", addr.to_string())?;
        d.set_item("info", checkpoint_dict(py, src.info)?)?;
        let shm = matches!(addr, UnitAddr::Unix(_)) && self.shm_enabled;
        let c = Client {
            replicas: restored.replicas(),
            inner: Mutex::new(Some(Arc::new(restored))),
            timeout: self.timeout,
            shm,
            shm_enabled: self.shm_enabled,
            addrs: vec![addr.to_string()],
            namespace: namespace.clone(),
            cell_key: self.cell_key,
        };
        d.set_item("client", Py::new(py, c)?)?;
        Ok(d)
    }

    /// Stop restore unit `id` of unit `unit` (from `open_restore`).
    #[pyo3(signature = (unit, id, timeout = None))]
    fn close_restore(
        &self,
        py: Python<'_>,
        unit: usize,
        id: u64,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = self.deadline(timeout)?;
        let client = self.client()?;
        py.detach(|| client.close_restore(unit, id, deadline))
            .map_err(|e| to_py(py, e, &[]))
    }

    /// Stop every unit within `timeout` seconds; never raises. Returns per
    /// unit the list of what could not be done.
    #[pyo3(signature = (timeout = 30.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> Vec<Vec<String>> {
        let Ok(client) = self.client() else {
            return Vec::new();
        };
        let t = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::from_secs(30));
        py.detach(|| client.shutdown(t))
    }
}
