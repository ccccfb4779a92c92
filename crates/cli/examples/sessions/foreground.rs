//! The foreground loop: 4 KiB puts and gets on one client, timed.

use std::time::Instant;

use stowage_client::{Client, Key, SliceSink, DEFAULT_PARTITION};

use crate::{one_line, CLEAR_EVERY, VALUE};

pub(crate) fn quantile(v: &mut [f32], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    f64::from(v[((v.len() - 1) as f64 * q).round() as usize])
}

/// What the foreground loop saw.
pub(crate) struct Fg {
    pub(crate) ops: u64,
    pub(crate) secs: f64,
    /// One put or one get, µs.
    pub(crate) op_lat: Vec<f32>,
    /// One put and its get, µs.
    pub(crate) pair_lat: Vec<f32>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

impl Fg {
    pub(crate) fn show(&mut self) -> String {
        format!(
            "{} ops in {:.1} s ({:.0} op/s); one op p50 {:.1} us p99 {:.1} us; put+get p50 {:.1} us p99 {:.1} us; errors {}{}",
            self.ops,
            self.secs,
            self.ops as f64 / self.secs,
            quantile(&mut self.op_lat, 0.5),
            quantile(&mut self.op_lat, 0.99),
            quantile(&mut self.pair_lat, 0.5),
            quantile(&mut self.pair_lat, 0.99),
            self.errors,
            self.first_error
                .as_ref()
                .map(|e| format!(" (first: {})", one_line(e)))
                .unwrap_or_default()
        )
    }

    pub(crate) fn pair_p99_ms(&mut self) -> f64 {
        quantile(&mut self.pair_lat, 0.99) / 1e3
    }
}

/// 4 KiB put + get on `c` for `secs`, every 16 rows cleared (untimed).
pub(crate) fn foreground(c: &Client, secs: f64) -> Fg {
    let value = vec![0x5au8; VALUE];
    let mut out = vec![0u8; VALUE];
    let mut fg = Fg {
        ops: 0,
        secs: 0.0,
        op_lat: Vec::with_capacity(1 << 16),
        pair_lat: Vec::with_capacity(1 << 15),
        errors: 0,
        first_error: None,
    };
    let fail = |fg: &mut Fg, e: String| {
        fg.errors += 1;
        fg.first_error.get_or_insert(e);
    };
    let t = Instant::now();
    let mut row = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        let key = Key::new(row, "fg");
        let t0 = Instant::now();
        match c.put_rows(&[(key.clone(), &value)], c.deadline()) {
            Err(e) => fail(&mut fg, format!("put: {e}")),
            Ok(()) => {
                let t1 = Instant::now();
                fg.ops += 1;
                fg.op_lat.push((t1 - t0).as_secs_f32() * 1e6);
                let mut bufs = [&mut out[..]];
                let mut sink = SliceSink::new(&mut bufs);
                let unit = c.unit_of_row(row);
                match c.get_into(DEFAULT_PARTITION, &[(unit, key)], &mut sink, c.deadline()) {
                    Err(e) => fail(&mut fg, format!("get: {e}")),
                    Ok(_) => {
                        let t2 = Instant::now();
                        fg.ops += 1;
                        fg.op_lat.push((t2 - t1).as_secs_f32() * 1e6);
                        fg.pair_lat.push((t2 - t0).as_secs_f32() * 1e6);
                    }
                }
            }
        }
        row += 1;
        if row.is_multiple_of(CLEAR_EVERY) {
            let rows: Vec<u64> = (row - CLEAR_EVERY..row).collect();
            if let Err(e) = c.clear_rows(&rows, c.deadline()) {
                fail(&mut fg, format!("clear: {e}"));
            }
        }
    }
    fg.secs = t.elapsed().as_secs_f64();
    let rows: Vec<u64> = (row - row % CLEAR_EVERY..row).collect();
    if !rows.is_empty() {
        let _ = c.clear_rows(&rows, c.deadline());
    }
    fg
}
