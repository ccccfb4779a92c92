//! Directory files: where the units of a data plane listen, written by
//! whoever started them (the Ray launcher, `stowage local`) and read by
//! every client, on any host.
//!
//! ```json
//! {"stowage_directory": 1, "replicas": 1,
//!  "units": [{"index": 0, "node": "…", "host": "…",
//!             "uds": "unix:/tmp/…/unit.sock", "tcp": "tcp:10.0.0.2:40123",
//!             "instance_id": "0123…", "pid": 1234, "ray": {…}}]}
//! ```
//!
//! Each client picks a transport per unit: shared memory when the unit runs
//! on the same host as the client (same [`host_id`]) and has a Unix socket,
//! tcp otherwise. Keys a client does not know (such as `ray`, the
//! launcher's liveness source) are kept as they are.
//!
//! A directory carries the plane's number of copies of every row
//! (`"replicas"`, [`ClientConfig::replicas`]), which every client of the
//! plane must use; a directory written without it means 1.
//!
//! A directory may carry the units' shared secret (`"secret_hex"`: its
//! bytes as lowercase hex digits), which a client then proves unless it
//! was given a secret of its own. A directory file that holds one is
//! written owner-only ([`UnitDirectory::write_file`]: mode 0600, created
//! new and renamed into place) and refused when read if group or others
//! may read it ([`UnitDirectory::from_file`]), as a secret file is.

use std::path::Path;

use serde::{Deserialize, Serialize};

use stowage_wire::auth::Secret;

use crate::conn::UnitAddr;
#[cfg(doc)]
use crate::ClientConfig;

/// The format version this client reads and writes.
pub const DIRECTORY_VERSION: u32 = 1;

/// The units of one data plane, unit `i` at `units[i]`. Its `Debug`
/// never shows the secret.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitDirectory {
    /// Always [`DIRECTORY_VERSION`].
    pub stowage_directory: u32,
    pub units: Vec<UnitEntry>,
    /// Copies of every row, each on another unit
    /// ([`ClientConfig::replicas`]): every client of the plane uses this
    /// number. 1 to the number of units; 1 when the directory does not
    /// say (one written before the key was).
    #[serde(default = "one_replica")]
    pub replicas: usize,
    /// The units' shared secret as lowercase hex digits
    /// ([`Secret::to_hex`]), if the launcher hands it over this way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_hex: Option<String>,
}

impl std::fmt::Debug for UnitDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitDirectory")
            .field("stowage_directory", &self.stowage_directory)
            .field("units", &self.units)
            .field("replicas", &self.replicas)
            .field(
                "secret_hex",
                &self.secret_hex.as_ref().map(|_| format_args!("<redacted>")),
            )
            .finish()
    }
}

fn one_replica() -> usize {
    1
}

/// One unit of a directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitEntry {
    /// Its position: rows and blobs are placed by this index.
    pub index: usize,
    /// The node it runs on, as its launcher names nodes (a Ray node id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The [`host_id`] of its process: clients with the same one use its
    /// Unix socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Its Unix socket (`unix:/path`), for clients on the same host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uds: Option<String>,
    /// Its TCP address (`tcp:ip:port`), for everyone else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<String>,
    /// The unit instance the directory was written for (32 hex digits): a
    /// client that finds another instance there reports its keys lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// Its process id on its host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Everything else (a launcher's own keys, such as `ray`).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Which transport a client uses for a unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory for units on this host, tcp for the others.
    #[default]
    Auto,
    /// Shared memory only: a unit on another host is an error.
    Shm,
    /// tcp for every unit, even on this host.
    Tcp,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            _ => Err(format!(
                "transport must be 'auto', 'shm' or 'tcp', not {s:?}"
            )),
        }
    }
}

/// This process's host, as directories name it: the kernel's boot id with
/// the network and mount namespaces. Two processes with the same id can
/// reach each other's Unix sockets and share memory; a container or a
/// network namespace of its own counts as another host.
pub fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-boot".into());
    let ns = |name: &str| {
        std::fs::metadata(format!("/proc/self/ns/{name}"))
            .map(|m| m.ino().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    format!("{boot}/net:{}/mnt:{}", ns("net"), ns("mnt"))
}

impl UnitDirectory {
    /// Parse and check a directory: the version, unit indexes `0..n` each
    /// once, at least one address per unit, addresses and instance ids
    /// well formed.
    pub fn parse(json: &str) -> Result<Self, String> {
        let d: UnitDirectory =
            serde_json::from_str(json).map_err(|e| format!("not a stowage directory: {e}"))?;
        d.check()?;
        Ok(d)
    }

    /// [`UnitDirectory::parse`] of a file. A file that holds a secret
    /// must be owner-only: one that group or others may read or write is
    /// refused (`chmod 600`), as a secret file is.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let cannot = |e: std::io::Error| format!("cannot read the directory file {shown}: {e}");
        let mut f = std::fs::File::open(path).map_err(cannot)?;
        let mode = f.metadata().map_err(cannot)?.permissions().mode() & 0o777;
        let mut text = String::new();
        f.read_to_string(&mut text).map_err(cannot)?;
        let d = Self::parse(&text)
            .map_err(|e| format!("cannot read the directory file {shown}: {e}"))?;
        if d.secret_hex.is_some() && mode & 0o077 != 0 {
            return Err(format!(
                "the directory file {shown} holds the units' shared secret but may be read or \
                 written by other users (mode {mode:03o}); make it owner-only: chmod 600 {shown}"
            ));
        }
        Ok(d)
    }

    /// Write the directory to `path`: a new file (mode 0600 when it holds
    /// a secret, else 0644 less the umask) written in full, then renamed
    /// over `path`, so no reader ever sees a partial file and a secret is
    /// never in a file others may read.
    pub fn write_file(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mode = if self.secret_hex.is_some() {
            0o600
        } else {
            0o644
        };
        let name = path
            .file_name()
            .ok_or_else(|| std::io::Error::other(format!("{} names no file", path.display())))?;
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
        let tmp = path.with_file_name(format!(
            ".{}.{:016x}.tmp",
            name.to_string_lossy(),
            u64::from_le_bytes(nonce)
        ));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&tmp)?;
            f.write_all(self.to_json().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// The units' shared secret the directory carries, if any.
    pub fn secret(&self) -> Result<Option<Secret>, String> {
        self.secret_hex
            .as_deref()
            .map(|h| Secret::from_hex(h, "in the directory"))
            .transpose()
            .map_err(|e| e.to_string())
    }

    /// The directory as JSON.
    pub fn to_json(&self) -> String {
        // A directory holds only strings, numbers and maps: it always
        // serializes.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    fn check(&self) -> Result<(), String> {
        if self.stowage_directory != DIRECTORY_VERSION {
            return Err(format!(
                "directory format {} is not supported (this client reads {DIRECTORY_VERSION})",
                self.stowage_directory
            ));
        }
        if self.units.is_empty() {
            return Err("the directory lists no units".into());
        }
        if self.replicas == 0 || self.replicas > self.units.len() {
            return Err(format!(
                "the directory's replicas = {} for {} units: each copy of a row needs a unit \
                 of its own (1 to {})",
                self.replicas,
                self.units.len(),
                self.units.len()
            ));
        }
        for (i, u) in self.units.iter().enumerate() {
            if u.index != i {
                return Err(format!(
                    "unit entries must be in index order 0..{}: entry {i} has index {}",
                    self.units.len(),
                    u.index
                ));
            }
            if u.uds.is_none() && u.tcp.is_none() {
                return Err(format!("unit {i} has no address (neither uds nor tcp)"));
            }
            if let Some(a) = &u.uds {
                match a.parse::<UnitAddr>() {
                    Ok(UnitAddr::Unix(_)) => {}
                    _ => return Err(format!("unit {i}: uds {a:?} is not unix:/path")),
                }
            }
            if let Some(a) = &u.tcp {
                match a.parse::<UnitAddr>() {
                    Ok(UnitAddr::Tcp(_)) => {}
                    _ => return Err(format!("unit {i}: tcp {a:?} is not tcp:ip:port")),
                }
            }
            u.instance()?;
        }
        Ok(())
    }

    /// The address of every unit for a client on host `local_host`.
    pub fn addrs(
        &self,
        choice: TransportChoice,
        local_host: &str,
    ) -> Result<Vec<UnitAddr>, String> {
        self.units
            .iter()
            .map(|u| u.addr(choice, local_host))
            .collect()
    }

    /// The instance each unit had when the directory was written.
    pub fn instances(&self) -> Vec<Option<u128>> {
        // Checked by parse.
        self.units
            .iter()
            .map(|u| u.instance().ok().flatten())
            .collect()
    }
}

impl UnitEntry {
    /// Whether the unit runs on host `local_host` and can be reached
    /// through its Unix socket.
    pub fn same_host(&self, local_host: &str) -> bool {
        self.uds.is_some() && self.host.as_deref() == Some(local_host)
    }

    /// The address a client on `local_host` uses.
    pub fn addr(&self, choice: TransportChoice, local_host: &str) -> Result<UnitAddr, String> {
        let pick = |a: &Option<String>| a.as_deref().map(|s| s.parse::<UnitAddr>());
        let same = self.same_host(local_host);
        let chosen = match choice {
            TransportChoice::Auto if same => pick(&self.uds),
            TransportChoice::Auto => pick(&self.tcp),
            TransportChoice::Shm if same => pick(&self.uds),
            TransportChoice::Shm => {
                return Err(format!(
                    "unit {} runs on another host ({}): shared memory needs the same host; use transport 'auto' or 'tcp'",
                    self.index,
                    self.node.as_deref().or(self.host.as_deref()).unwrap_or("unknown")
                ))
            }
            TransportChoice::Tcp => pick(&self.tcp),
        };
        match chosen {
            Some(r) => r,
            None => Err(format!(
                "unit {} has no tcp address, and this client is not on its host",
                self.index
            )),
        }
    }

    /// Its instance id, if the directory gives one.
    pub fn instance(&self) -> Result<Option<u128>, String> {
        match &self.instance_id {
            None => Ok(None),
            Some(s) => u128::from_str_radix(s, 16).map(Some).map_err(|_| {
                format!(
                    "unit {}: instance_id {s:?} is not 32 hex digits",
                    self.index
                )
            }),
        }
    }
}

/// An instance id as directories write it.
pub fn instance_hex(id: u128) -> String {
    format!("{id:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: usize, host: &str) -> UnitEntry {
        UnitEntry {
            index: i,
            node: Some(format!("node-{i}")),
            host: Some(host.into()),
            uds: Some(format!("unix:/tmp/u{i}.sock")),
            tcp: Some(format!("tcp:10.0.0.{}:4000", i + 1)),
            instance_id: Some(instance_hex(0xabc + i as u128)),
            pid: Some(100 + i as u32),
            extra: Default::default(),
        }
    }

    #[test]
    fn round_trip_keeps_unknown_keys() {
        let text = r#"{"stowage_directory": 1, "units": [
            {"index": 0, "host": "h", "uds": "unix:/tmp/a.sock", "tcp": "tcp:127.0.0.1:5",
             "instance_id": "000000000000000000000000000000ff",
             "ray": {"actor_id": "abc", "namespace": null}}]}"#;
        let d = UnitDirectory::parse(text).unwrap();
        assert_eq!(d.units[0].extra["ray"]["actor_id"], "abc");
        assert_eq!(d.instances(), vec![Some(0xff)]);
        let again = UnitDirectory::parse(&d.to_json()).unwrap();
        assert_eq!(again, d);
    }

    #[test]
    fn replicas_are_carried_and_default_to_one() {
        // A directory written before the key: one copy.
        let old = r#"{"stowage_directory": 1, "units": [{"index": 0, "tcp": "tcp:127.0.0.1:5"}]}"#;
        let d = UnitDirectory::parse(old).unwrap();
        assert_eq!(d.replicas, 1);
        assert!(d.to_json().contains("\"replicas\": 1"), "{}", d.to_json());
        let two = UnitDirectory {
            stowage_directory: 1,
            units: vec![entry(0, "here"), entry(1, "there"), entry(2, "there")],
            replicas: 2,
            secret_hex: None,
        };
        let back = UnitDirectory::parse(&two.to_json()).unwrap();
        assert_eq!(back.replicas, 2);
        assert_eq!(back, two);
        assert!(format!("{two:?}").contains("replicas: 2"));
        // More copies than units, or none: refused, naming both numbers.
        for (n, want) in [
            (4, "replicas = 4 for 3 units"),
            (0, "replicas = 0 for 3 units"),
        ] {
            let bad = UnitDirectory {
                replicas: n,
                ..two.clone()
            };
            let e = UnitDirectory::parse(&bad.to_json()).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let e = UnitDirectory::parse(
            r#"{"stowage_directory": 1, "replicas": -1, "units": [{"index": 0, "tcp": "tcp:127.0.0.1:5"}]}"#,
        )
        .unwrap_err();
        assert!(e.contains("not a stowage directory"), "{e}");
    }

    #[test]
    fn transport_is_chosen_per_unit() {
        let d = UnitDirectory {
            stowage_directory: 1,
            units: vec![entry(0, "here"), entry(1, "there")],
            replicas: 2,
            secret_hex: None,
        };
        let auto = d.addrs(TransportChoice::Auto, "here").unwrap();
        assert_eq!(auto[0], "unix:/tmp/u0.sock".parse().unwrap());
        assert_eq!(auto[1], "tcp:10.0.0.2:4000".parse().unwrap());
        let tcp = d.addrs(TransportChoice::Tcp, "here").unwrap();
        assert!(tcp.iter().all(|a| matches!(a, UnitAddr::Tcp(_))));
        let err = d.addrs(TransportChoice::Shm, "here").unwrap_err();
        assert!(
            err.contains("unit 1 runs on another host (node-1)"),
            "{err}"
        );
        // Another host and no tcp address: nothing to reach it by.
        let mut lone = entry(0, "there");
        lone.tcp = None;
        assert!(lone.addr(TransportChoice::Auto, "here").is_err());
    }

    #[test]
    fn bad_directories_are_refused_with_reasons() {
        let cases = [
            (r#"{"stowage_directory": 2, "units": []}"#, "format 2"),
            (r#"{"stowage_directory": 1, "units": []}"#, "no units"),
            (
                r#"{"stowage_directory": 1, "units": [{"index": 1, "tcp": "tcp:127.0.0.1:1"}]}"#,
                "index order",
            ),
            (
                r#"{"stowage_directory": 1, "units": [{"index": 0}]}"#,
                "no address",
            ),
            (
                r#"{"stowage_directory": 1, "units": [{"index": 0, "uds": "tcp:127.0.0.1:1"}]}"#,
                "not unix:",
            ),
            (
                r#"{"stowage_directory": 1, "units": [{"index": 0, "tcp": "/tmp/x"}]}"#,
                "not tcp:",
            ),
            (
                r#"{"stowage_directory": 1, "units": [{"index": 0, "tcp": "tcp:127.0.0.1:1", "instance_id": "zz"}]}"#,
                "hex",
            ),
            ("[1, 2]", "not a stowage directory"),
        ];
        for (text, want) in cases {
            let err = UnitDirectory::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn host_id_names_this_host_and_its_namespaces() {
        let h = host_id();
        assert_eq!(h, host_id());
        assert!(h.contains("/net:") && h.contains("/mnt:"), "{h}");
        assert!(!h.starts_with("unknown-boot"), "{h}");
    }

    #[test]
    fn a_directory_with_a_secret_is_written_owner_only_and_read_only_so() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!(
            "stowage-directory-test-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("units.json");
        let secret = Secret::generate().unwrap();
        let d = UnitDirectory {
            stowage_directory: 1,
            units: vec![entry(0, "here")],
            replicas: 1,
            secret_hex: Some(secret.to_hex()),
        };
        // A file already there, readable by all, is replaced, not reused.
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        d.write_file(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let back = UnitDirectory::from_file(&path).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.secret().unwrap().unwrap().expose(), secret.expose());
        // Opened up: refused, naming the fix.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = UnitDirectory::from_file(&path).unwrap_err();
        assert!(e.contains("chmod 600") && e.contains("644"), "{e}");
        // Without a secret the file may be shared.
        let open = UnitDirectory {
            secret_hex: None,
            ..d
        };
        open.write_file(&path).unwrap();
        UnitDirectory::from_file(&path).unwrap();
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debug_output_never_shows_the_secret() {
        let secret = Secret::generate().unwrap();
        let hex = secret.to_hex();
        let d = UnitDirectory {
            stowage_directory: 1,
            units: vec![entry(0, "here")],
            replicas: 1,
            secret_hex: Some(hex.clone()),
        };
        for shown in [format!("{d:?}"), format!("{d:#?}")] {
            assert!(!shown.contains(&hex), "{shown}");
            assert!(shown.contains("<redacted>"), "{shown}");
            assert!(shown.contains("unix:/tmp/u0.sock"), "{shown}");
        }
        assert!(format!("{d:?}").contains("secret_hex: Some(<redacted>)"));
        let none = UnitDirectory {
            secret_hex: None,
            ..d
        };
        assert!(format!("{none:?}").contains("secret_hex: None"));
    }
}
