//! The local data plane's demonstration workload: GRPO-shaped RL steps on
//! the rows × fields API, every byte checked, figures printed at the end.
//!
//! One step of RL post-training: rollout workers put `input_ids` (int64),
//! `generation_logprobs` (bf16) and `token_mask` (int32) for every row;
//! logprob workers read `input_ids` and write `prev_logprobs` back; the
//! trainer reads all four columns; the step's partition is cleared.

use std::time::{Duration, Instant};

use stowage_client::{Client, Column, DType, OwnedTensor, RowKey, Sink, Tensor, TensorAsk};

/// Shape of the workload.
#[derive(Clone, Debug)]
pub struct Workload {
    /// RL steps to run.
    pub steps: usize,
    /// Rows (samples) per step.
    pub rows: usize,
    /// Sequence lengths are drawn uniformly from this range (tokens).
    pub min_tokens: usize,
    pub max_tokens: usize,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub bytes_put: u64,
    pub bytes_got: u64,
    pub values: u64,
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
            self.values,
            self.values as f64 / total.as_secs_f64().max(1e-9),
        );
    }
}

/// A deterministic generator (xorshift), so every run checks the same data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Columns of one step, owned: (field, dtype, per-row bytes).
struct StepData {
    keys: Vec<RowKey>,
    columns: Vec<(&'static str, DType, Vec<Vec<u8>>)>,
}

impl StepData {
    fn column(&self, field: &str) -> Column<'_> {
        let (_, dtype, values) = self
            .columns
            .iter()
            .find(|(f, _, _)| *f == field)
            .expect("workload fields are fixed");
        Column::Jagged(
            values
                .iter()
                .map(|v| Tensor {
                    dtype: *dtype,
                    shape: vec![(v.len() / dtype.itemsize()) as u64],
                    data: v,
                })
                .collect(),
        )
    }

    fn check(&self, fields: &[&str], got: &Buffers) -> Result<u64, String> {
        let mut bytes = 0;
        for (i, f) in fields.iter().enumerate() {
            let (_, dtype, want) = self
                .columns
                .iter()
                .find(|(name, _, _)| name == f)
                .ok_or_else(|| format!("unknown field {f}"))?;
            for (r, t) in got.0[i].iter().enumerate() {
                if t.dtype != *dtype || t.data != want[r] {
                    return Err(format!("{}@{f} read back different bytes", self.keys[r]));
                }
                bytes += t.data.len() as u64;
            }
        }
        Ok(bytes)
    }
}

/// Reader-side buffers, `[field][row]`, reused from step to step the way a
/// trainer reuses its input buffers (so that the figures measure the data
/// plane, not the allocator's page faults).
#[derive(Default)]
struct Buffers(Vec<Vec<OwnedTensor>>);

impl Buffers {
    fn prepare(&mut self, fields: usize, rows: usize) {
        self.0.resize_with(fields, Vec::new);
        for f in &mut self.0 {
            f.resize_with(rows, || OwnedTensor {
                dtype: DType::U8,
                shape: Vec::new(),
                data: Vec::new(),
            });
        }
    }
}

impl Sink<TensorAsk<'_>> for Buffers {
    fn slot(&mut self, ask: TensorAsk<'_>) -> Result<&mut [u8], String> {
        let TensorAsk {
            field,
            row,
            dtype,
            shape,
        } = ask;
        let t = &mut self.0[field][row];
        let len = dtype
            .nbytes(shape)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or("value larger than memory")?;
        t.dtype = dtype;
        t.shape.clear();
        t.shape.extend_from_slice(shape);
        t.data.resize(len, 0);
        Ok(&mut t.data)
    }
}

/// Run `w` against `client`, checking every value read back.
pub fn run(client: &Client, w: &Workload) -> Result<Report, String> {
    let mut report = Report::default();
    let mut bufs = Buffers::default();
    let mut rng = Rng(0x5eed_0f57_0a9e);
    let span = w.max_tokens.saturating_sub(w.min_tokens) + 1;
    for step in 0..w.steps {
        let partition = format!("step-{step}");
        let lens: Vec<usize> = (0..w.rows)
            .map(|_| w.min_tokens + (rng.next() as usize) % span)
            .collect();
        let mut col = |dtype: DType| -> Vec<Vec<u8>> {
            lens.iter()
                .map(|&n| rng.bytes(n * dtype.itemsize()))
                .collect()
        };
        let data = StepData {
            keys: (0..w.rows)
                .map(|i| RowKey::Name(format!("uid_{step}_{i}")))
                .collect(),
            columns: vec![
                ("input_ids", DType::I64, col(DType::I64)),
                ("generation_logprobs", DType::BF16, col(DType::BF16)),
                ("token_mask", DType::I32, col(DType::I32)),
                ("prev_logprobs", DType::BF16, col(DType::BF16)),
            ],
        };
        let bytes_of = |fields: &[&str]| -> u64 {
            data.columns
                .iter()
                .filter(|(f, _, _)| fields.contains(f))
                .flat_map(|(_, _, v)| v.iter().map(|x| x.len() as u64))
                .sum()
        };
        let err = |what: &str, e: stowage_client::Error| format!("step {step}: {what}: {e}");

        // Rollout: generation writes three columns.
        let rollout = ["input_ids", "generation_logprobs", "token_mask"];
        let cols: Vec<(&str, Column<'_>)> = rollout.iter().map(|f| (*f, data.column(f))).collect();
        let t = Instant::now();
        client
            .put(&partition, &data.keys, &cols, None, client.deadline())
            .map_err(|e| err("rollout put", e))?;
        report.put_time += t.elapsed();
        report.bytes_put += bytes_of(&rollout);
        report.values += (rollout.len() * w.rows) as u64;

        // Logprob workers read the tokens and write a column back.
        bufs.prepare(1, w.rows);
        let t = Instant::now();
        client
            .get_tensors_into(
                &partition,
                &data.keys,
                &["input_ids"],
                None,
                &mut bufs,
                client.deadline(),
            )
            .map_err(|e| err("logprob read", e))?;
        report.get_time += t.elapsed();
        report.bytes_got += data.check(&["input_ids"], &bufs)?;
        let t = Instant::now();
        client
            .put(
                &partition,
                &data.keys,
                &[("prev_logprobs", data.column("prev_logprobs"))],
                None,
                client.deadline(),
            )
            .map_err(|e| err("logprob write-back", e))?;
        report.put_time += t.elapsed();
        report.bytes_put += bytes_of(&["prev_logprobs"]);
        report.values += (2 * w.rows) as u64;

        // The trainer reads every column.
        let all = [
            "input_ids",
            "generation_logprobs",
            "token_mask",
            "prev_logprobs",
        ];
        bufs.prepare(all.len(), w.rows);
        let t = Instant::now();
        client
            .get_tensors_into(
                &partition,
                &data.keys,
                &all,
                None,
                &mut bufs,
                client.deadline(),
            )
            .map_err(|e| err("trainer read", e))?;
        report.get_time += t.elapsed();
        report.bytes_got += data.check(&all, &bufs)?;
        report.values += (all.len() * w.rows) as u64;

        let t = Instant::now();
        client
            .clear_partition(&partition, client.deadline())
            .map_err(|e| err("clear", e))?;
        report.clear_time += t.elapsed();
    }
    Ok(report)
}
