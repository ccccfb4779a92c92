//! Child processes of the examples that start them (`scale`,
//! `sessions`): started with pipes, stopped by their pids. Each example
//! takes this file in with `#[path]`.

use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Start `cmd` with its stdin and stdout piped (stderr inherited): the
/// child and its stdout; `what` says which failed to start.
pub(crate) fn spawn_piped(cmd: &mut Command, what: &str) -> Result<(Child, ChildStdout), String> {
    let mut c = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let stdout = c.stdout.take().ok_or("child stdout missing")?;
    Ok((c, stdout))
}

/// Wait for `c` to exit until `end`, looking every `poll`; past `end`,
/// SIGKILL it by its pid. It is reaped either way.
pub(crate) fn reap(c: &mut Child, end: Instant, poll: Duration) {
    loop {
        match c.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < end => std::thread::sleep(poll),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                break;
            }
        }
    }
}
