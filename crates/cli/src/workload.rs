//! The local data plane's demonstration workload: RL-step-shaped rounds of
//! put, two reads and a clear, with figures printed at the end.

use std::time::{Duration, Instant};

use stowage_client::{Client, Key, SliceSink};

/// Shape of the workload.
#[derive(Clone, Debug)]
pub struct Workload {
    /// RL steps to run.
    pub steps: usize,
    /// Rows written per step.
    pub rows: usize,
    /// Fields per row.
    pub fields: Vec<String>,
    /// Bytes per value.
    pub value_bytes: usize,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub bytes_put: u64,
    pub bytes_got: u64,
    pub ops: u64,
    pub put_time: Duration,
    pub get_time: Duration,
    pub clear_time: Duration,
}

impl Report {
    pub fn print(&self, label: &str) {
        let gbps = |b: u64, t: Duration| b as f64 / t.as_secs_f64().max(1e-9) / 1e9;
        let total = self.put_time + self.get_time + self.clear_time;
        println!(
            "{label}: put {} in {:.1} ms ({:.2} GB/s); get {} in {:.1} ms ({:.2} GB/s); clear {:.1} ms; {} values, {:.0} values/s",
            bytesize::ByteSize(self.bytes_put).display().iec(),
            self.put_time.as_secs_f64() * 1e3,
            gbps(self.bytes_put, self.put_time),
            bytesize::ByteSize(self.bytes_got).display().iec(),
            self.get_time.as_secs_f64() * 1e3,
            gbps(self.bytes_got, self.get_time),
            self.clear_time.as_secs_f64() * 1e3,
            self.ops,
            self.ops as f64 / total.as_secs_f64().max(1e-9),
        );
    }
}

/// Run `w` against `client`, checking every value read back.
pub fn run(client: &Client, w: &Workload) -> Result<Report, String> {
    let mut report = Report::default();
    let mut data = Vec::with_capacity(w.rows * w.fields.len());
    let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
    for step in 0..w.steps {
        let base = (step * w.rows) as u64;
        data.clear();
        for r in 0..w.rows as u64 {
            for (f, name) in w.fields.iter().enumerate() {
                let seed = (base + r) as usize * 31 + f;
                let v: Vec<u8> = (0..w.value_bytes).map(|i| (seed + i) as u8).collect();
                data.push((Key::new(base + r, name.clone()), v));
            }
        }
        let values: Vec<(Key, &[u8])> = data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_slice()))
            .collect();
        let keys: Vec<Key> = data.iter().map(|(k, _)| k.clone()).collect();

        let t = Instant::now();
        client
            .put_rows(&values, client.deadline())
            .map_err(|e| format!("step {step}: put: {e}"))?;
        report.put_time += t.elapsed();
        report.bytes_put += (values.len() * w.value_bytes) as u64;
        report.ops += values.len() as u64;

        // Two reader groups, as logprob workers and trainer ranks do, each
        // reading into its own preallocated buffer (as into a tensor).
        let placed: Vec<(usize, Key)> = keys
            .iter()
            .map(|k| (client.unit_of_row(k.row), k.clone()))
            .collect();
        for out in [&mut out_a, &mut out_b] {
            out.resize(data.len() * w.value_bytes, 0);
            let mut bufs: Vec<&mut [u8]> = out.chunks_mut(w.value_bytes.max(1)).collect();
            bufs.resize_with(data.len(), Default::default);
            let t = Instant::now();
            let mut sink = SliceSink::new(&mut bufs);
            client
                .get_into(
                    stowage_client::DEFAULT_PARTITION,
                    &placed,
                    &mut sink,
                    client.deadline(),
                )
                .map_err(|e| format!("step {step}: get: {e}"))?;
            report.get_time += t.elapsed();
            report.bytes_got += sink.lens.iter().sum::<u64>();
            report.ops += data.len() as u64;
            for ((k, want), have) in data.iter().zip(out.chunks(w.value_bytes.max(1))) {
                if want[..] != have[..want.len()] {
                    return Err(format!("step {step}: {k} read back different bytes"));
                }
            }
        }

        let rows: Vec<u64> = (base..base + w.rows as u64).collect();
        let t = Instant::now();
        client
            .clear_rows(&rows, client.deadline())
            .map_err(|e| format!("step {step}: clear: {e}"))?;
        report.clear_time += t.elapsed();
    }
    Ok(report)
}
