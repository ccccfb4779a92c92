//! Helpers of the free-memory tests (free_memory.rs, compaction.rs):
//! distinct values that are cheap to make in a debug build, and the client
//! processes those tests spawn (this test binary re-run as a helper, as
//! fencing.rs does): idle clients holding spares, a reader holding a pin
//! through a view, and a reader or writer to pause mid-copy.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Column, DType, Key, RowKey, Tensor, UnitAddr};
use stowage_local::LocalPlane;

use super::{child_secret, is_stopped, stdout_lines, Raw};

/// Fill `buf` with the bytes of value `id`: a 4 KiB block of
/// [`super::pattern`] repeated, each block stamped with (`id`, its index),
/// so that two values, or two places of one value, never read alike.
pub fn fill_value(id: u64, buf: &mut [u8]) {
    let block = super::pattern(id, 0x5EED, 4096);
    for (i, chunk) in buf.chunks_mut(4096).enumerate() {
        let n = chunk.len();
        chunk.copy_from_slice(&block[..n]);
        let stamp = ((id << 32) | i as u64).to_le_bytes();
        let m = n.min(8);
        chunk[..m].copy_from_slice(&stamp[..m]);
    }
}

/// Value `id`, `len` bytes ([`fill_value`]).
pub fn value_of(id: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_value(id, &mut v);
    v
}

/// Whether `got` is exactly value `id` of `len` bytes.
pub fn is_value(got: &[u8], id: u64, len: usize) -> bool {
    got.len() == len && got == value_of(id, len).as_slice()
}

/// [`super::helper_child_of`] with a piped stdin: the child runs until
/// the test closes it (a [`super::Reap`] does on drop), see
/// [`wait_for_stdin_to_close`].
pub fn helper_child_with_stdin(p: &LocalPlane, name: &str, env: (&str, &str)) -> Child {
    super::helper_command(p, name, env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("helper process starts")
}

/// In a helper child: wait until stdin closes (the test lets go of it),
/// at most `within`.
pub fn wait_for_stdin_to_close(within: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(within);
}

fn say(line: &str) {
    println!("{line}");
    std::io::stdout().flush().unwrap();
}

/// A client of the unit at `addr` for a helper child (the plane's secret
/// from its environment).
fn child_client(addr: &str, timeout: Duration, spare_max: Option<u64>) -> Client {
    let mut cfg = ClientConfig::new("free", vec![addr.parse::<UnitAddr>().unwrap()]);
    cfg.secret = child_secret();
    cfg.timeout = timeout;
    if let Some(s) = spare_max {
        cfg.spare_max = s;
    }
    Client::connect(cfg).unwrap()
}

/// Sizes of the puts an idle client makes before it idles: one of each
/// spare class a user's small puts commonly use.
pub const IDLE_PUTS: [usize; 4] = [512 << 10, 1 << 20, 2 << 20, 4 << 20];

/// The body of an idle client (`STOWAGE_IDLE=addr,n`): a same-host client
/// with the default configuration puts [`IDLE_PUTS`] (rows `n*8..`), one
/// put each, clears them, prints `IDLE`, and stays connected until stdin
/// closes (at most 180 s).
pub fn idle_child_main() {
    let spec = std::env::var("STOWAGE_IDLE").expect("run only by the free-memory tests");
    let (addr, n) = spec.split_once(',').expect("addr,n");
    let n: u64 = n.parse().unwrap();
    let c = child_client(addr, Duration::from_secs(30), None);
    let rows: Vec<u64> = (0..IDLE_PUTS.len() as u64).map(|k| n * 8 + k).collect();
    for (&row, &len) in rows.iter().zip(&IDLE_PUTS) {
        let v = value_of(row, len);
        c.put_rows(&[(Key::new(row, "v"), &v)], c.deadline())
            .unwrap();
    }
    c.clear_rows(&rows, c.deadline()).unwrap();
    say("IDLE");
    wait_for_stdin_to_close(Duration::from_secs(180));
}

/// Value id of the pin holder's value.
pub const PIN_ID: u64 = 0x9111;

/// The body of a pin holder (`STOWAGE_PIN=addr,len`): puts `len` bytes
/// (value [`PIN_ID`]) into partition "pin" (rows × fields API, row 0,
/// field "v"), views it (a pin held as long as the view), prints
/// `PINNED`, and once stdin closes (at most 180 s) checks the view's bytes
/// again: `RESULT ok`, or `RESULT changed` if they moved under it.
pub fn pin_child_main() {
    let spec = std::env::var("STOWAGE_PIN").expect("run only by the free-memory tests");
    let (addr, len) = spec.split_once(',').expect("addr,len");
    let len: usize = len.parse().unwrap();
    let c = Arc::new(child_client(addr, Duration::from_secs(30), Some(0)));
    let v = value_of(PIN_ID, len);
    let col = Column::Dense(Tensor::new(DType::U8, vec![1, len as u64], &v).unwrap());
    let key = [RowKey::Index(0)];
    c.put("pin", &key, &[("v", col)], None, c.deadline())
        .unwrap();
    let view = c.view("pin", &key, &["v"], None, c.deadline()).unwrap();
    let t = view.field(0)[0].clone();
    assert!(view.to_vec(&t) == v, "the view does not read the value");
    say("PINNED");
    wait_for_stdin_to_close(Duration::from_secs(180));
    if view.to_vec(&t) == v {
        say("RESULT ok");
    } else {
        say("RESULT changed");
    }
}

/// The body of a client to pause mid-copy (`STOWAGE_COPY=role,transport,
/// addr,row,id,len,timeout_ms`, transport `shm`, `tcp` or `nixl`; spares
/// off): `put` writes value `id` of `len` bytes
/// into row `row` (field "v"); `get` reads that row and checks every byte.
/// Prints `READY` just before its call, then `RESULT ok`, `RESULT err
/// <error>`, or `RESULT changed` if a get returned other bytes.
pub fn copy_child_main() {
    let spec = std::env::var("STOWAGE_COPY").expect("run only by the free-memory tests");
    let f: Vec<&str> = spec.split(',').collect();
    let (role, transport, addr) = (f[0], f[1], f[2]);
    let (row, id, len, timeout_ms): (u64, u64, usize, u64) = (
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
        f[5].parse().unwrap(),
        f[6].parse().unwrap(),
    );
    let mut cfg = ClientConfig::new("free", vec![addr.parse::<UnitAddr>().unwrap()]);
    cfg.secret = child_secret();
    cfg.timeout = Duration::from_millis(timeout_ms);
    cfg.spare_max = 0;
    if transport == "nixl" {
        cfg.nixl = Some(super::nixl_options());
    }
    let c = Client::connect(cfg).unwrap();
    // Connecting is lazy: reach the unit before READY (the test's clock
    // for stopping this child starts there), and learn its transport.
    c.check_units(c.deadline()).unwrap();
    if transport == "nixl" {
        assert_eq!(c.transport(0), Some("nixl"));
    }
    let v = value_of(id, len);
    let key = Key::new(row, "v");
    say("READY");
    let result = if role == "put" {
        c.put_rows(&[(key, &v)], c.deadline())
            .map(|()| "ok".to_string())
    } else {
        c.get_rows(&[key], c.deadline()).map(|got| {
            if got[0] == v {
                "ok".to_string()
            } else {
                "changed".to_string()
            }
        })
    };
    match result {
        Ok(r) => say(&format!("RESULT {r}")),
        Err(e) => say(&format!("RESULT err {e}")),
    }
}

/// A helper child the test pauses and resumes by its pid; killed and
/// reaped on drop.
pub struct Helper {
    pub child: Child,
    pub lines: Receiver<String>,
}

impl Helper {
    /// Start helper test `name` (stdin piped) with `env`.
    pub fn start(p: &LocalPlane, name: &str, env: (&str, &str)) -> Helper {
        let mut child = helper_child_with_stdin(p, name, env);
        let lines = stdout_lines(&mut child);
        Helper { child, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The first line holding `word`, from `word` on; panics after
    /// `within`, with what the child printed.
    pub fn expect_line(&self, word: &str, within: Duration) -> String {
        let end = Instant::now() + within;
        let mut seen = Vec::new();
        loop {
            match self
                .lines
                .recv_timeout(end.saturating_duration_since(Instant::now()))
            {
                // libtest may print "test name ... " before it.
                Ok(l) if l.contains(word) => return l[l.find(word).unwrap()..].to_string(),
                Ok(l) => seen.push(l),
                Err(e) => panic!("the child never printed {word:?} ({e}); it printed {seen:?}"),
            }
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {} failed", self.pid());
    }

    /// SIGSTOP, and wait (bounded) until it is stopped.
    pub fn pause(&self) {
        self.signal("-STOP");
        let pid = self.pid();
        assert!(
            super::eventually(Duration::from_secs(5), || is_stopped(pid)),
            "{pid} did not stop"
        );
    }

    /// Stop the child as soon as `during` says its transfer is under way
    /// (polling the unit's counters); whether it was caught, stopped, with
    /// the transfer still under way (not if it exited first).
    pub fn stop_during(
        &self,
        watcher: &mut Raw,
        during: impl Fn(&stowage_wire::Stats) -> bool,
    ) -> bool {
        let end = Instant::now() + Duration::from_secs(30);
        let pid = self.pid();
        while Instant::now() < end && !has_exited(pid) {
            if during(&super::stats(watcher)) {
                self.signal("-STOP");
                assert!(super::eventually(Duration::from_secs(5), || is_stopped(
                    pid
                )
                    || has_exited(pid)));
                return is_stopped(pid) && during(&super::stats(watcher));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        false
    }

    /// Close its stdin (a child waiting on it goes on) and return its
    /// `RESULT` line (within 60 s).
    pub fn result(&mut self) -> String {
        drop(self.child.stdin.take());
        let r = self.expect_line("RESULT", Duration::from_secs(60));
        let end = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether process `pid` has exited (a zombie not yet reaped, or gone).
pub fn has_exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true)
}

/// A sink that reads one value into a buffer the caller made beforehand
/// (`Client::get_into`).
pub struct IntoBuffer(pub Vec<u8>);

impl<'a> stowage_client::Sink<stowage_client::ValueAsk<'a>> for IntoBuffer {
    fn slot(&mut self, ask: stowage_client::ValueAsk<'a>) -> Result<&mut [u8], String> {
        if ask.index != 0 || ask.len != self.0.len() as u64 {
            return Err(format!(
                "asked for value {} of {} bytes; the buffer holds {}",
                ask.index,
                ask.len,
                self.0.len()
            ));
        }
        Ok(&mut self.0)
    }
}
