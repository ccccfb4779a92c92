use super::*;

fn err(text: &str) -> ConfigError {
    match Config::from_toml_str(text) {
        Ok(c) => panic!("{text:?} parsed: {c:?}"),
        Err(e) => e,
    }
}

#[test]
fn empty_file_is_the_default() {
    assert_eq!(Config::from_toml_str("").unwrap(), Config::default());
    let d = Config::default();
    assert_eq!(d.units.count, None);
    assert_eq!(d.units.replicas, 1);
    assert_eq!(d.units.memory, 1 << 30);
    assert_eq!(d.units.cpus, 0.0);
    assert_eq!(d.units.reservation_lease, Duration::from_secs(30));
    assert_eq!(d.units.pin_lease, Duration::from_secs(30));
    assert_eq!(d.units.max_connections, 16384);
    assert_eq!(d.units.max_sessions, 16_384);
    assert_eq!(d.units.max_handshakes, 128);
    assert_eq!(d.units.max_handshakes_per_source, 32);
    assert_eq!(d.timeouts.handshake, Duration::from_secs(1));
    assert_eq!(d.units.max_session_connections, 64);
    assert_eq!(d.units.max_session_holds, 16384);
    assert_eq!(d.units.disk, None);
    assert_eq!(d.placement.clusters, Placement::All);
    assert_eq!(
        d.listen.host,
        ListenHost::Addr("127.0.0.1".parse().unwrap())
    );
    assert_eq!(d.listen.tcp_port, 0);
    assert_eq!(d.listen.unix_dir, None);
    assert_eq!(d.auth, AuthSection::default());
    assert!(!d.auth.insecure);
    assert_eq!(d.timeouts.op, Duration::from_secs(30));
    assert_eq!(d.timeouts.start, Duration::from_secs(120));
    assert_eq!(d.timeouts.stop, Duration::from_secs(30));
    assert_eq!(d.timeouts.frame, Duration::from_secs(10));
    assert_eq!(d.client.namespace, "default");
    assert_eq!(d.client.transport, Transport::Auto);
    assert_eq!(d.client.wait_for_memory, None);
    d.validate().unwrap();
}

#[test]
fn values_parse() {
    let c = Config::from_toml_str(
        r#"
            [units]
            count = 6
            replicas = 3
            memory = "512MiB"
            cpus = 0.5
            reservation_lease = "1m"
            pin_lease = "1500ms"
            max_connections = 10
            max_session_connections = 5
            max_session_holds = 100
            checkpoint_root = "/ckpt"
            [units.disk]
            root = "/local/stowage"
            capacity = 1073741824
            high_watermark = 1
            low_watermark = 0.5
            [placement]
            clusters = ["train", "teacher:big"]
            [listen]
            host = "node-ip"
            tcp_port = 7000
            unix_dir = "/run/stowage"
            [auth]
            secret_file = "/etc/stowage/secret"
            [timeouts]
            op = "45s"
            start = "5m"
            stop = "10s"
            frame = "2s"
            [client]
            namespace = "run-7"
            transport = "tcp"
            wait_for_memory = "20s"
            "#,
    )
    .unwrap();
    assert_eq!(c.units.count, Some(6));
    assert_eq!(c.units.replicas, 3);
    assert_eq!(c.units.memory, 512 << 20);
    assert_eq!(c.units.cpus, 0.5);
    assert_eq!(c.units.reservation_lease, Duration::from_secs(60));
    assert_eq!(c.units.pin_lease, Duration::from_millis(1500));
    assert_eq!(c.units.checkpoint_root, Some("/ckpt".into()));
    let d = c.units.disk.as_ref().unwrap();
    assert_eq!(d.root, PathBuf::from("/local/stowage"));
    assert_eq!(d.capacity, 1 << 30);
    assert_eq!((d.high_watermark, d.low_watermark), (1.0, 0.5));
    assert_eq!(
        c.placement.clusters,
        Placement::names(["train", "teacher:big"])
    );
    assert_eq!(c.listen.host, ListenHost::NodeIp);
    assert_eq!(c.listen.tcp_port, 7000);
    assert_eq!(c.listen.unix_dir, Some("/run/stowage".into()));
    assert_eq!(c.auth.secret_file, Some("/etc/stowage/secret".into()));
    assert_eq!(c.timeouts.start, Duration::from_secs(300));
    assert_eq!(c.timeouts.frame, Duration::from_secs(2));
    assert_eq!(c.client.namespace, "run-7");
    assert_eq!(c.client.transport, Transport::Tcp);
    assert_eq!(c.client.wait_for_memory, Some(Duration::from_secs(20)));

    // Written back and read again: the same config.
    let again = Config::from_toml_str(&c.to_toml_string()).unwrap();
    assert_eq!(again, c);
    assert_eq!(
        Config::from_toml_str(&Config::default().to_toml_string()).unwrap(),
        Config::default()
    );
}

#[test]
fn disk_section_defaults() {
    let c = Config::from_toml_str("[units.disk]\nroot = \"/d\"\n").unwrap();
    let d = c.units.disk.unwrap();
    assert_eq!(d.capacity, 20 << 30);
    assert_eq!((d.high_watermark, d.low_watermark), (0.9, 0.8));
    // A disk section needs its root.
    let e = err("[units.disk]\ncapacity = \"1GiB\"\n");
    assert_eq!(e.key(), Some("units.disk"), "{e}");
    assert!(e.to_string().contains("root"), "{e}");
}

/// Invalid files: the key each error must name and a phrase of its
/// message.
#[test]
fn errors_name_the_key() {
    // One case a line: (the file, the key its error names, a phrase of it).
    #[rustfmt::skip]
    let cases: &[(&str, &str, &str)] = &[
        ("[units]\nmemroy = \"1GiB\"\n", "units.memroy", "unknown field `memroy`"),
        ("[unit]\nmemory = 1\n", "unit", "unknown field `unit`"),
        ("typo = 1\n", "typo", "unknown field `typo`"),
        ("[units.disk]\nroot = \"/d\"\ncapacty = 1\n", "units.disk.capacty", "unknown field"),
        ("[units]\nmemory = \"lots\"\n", "units.memory", "not a size"),
        ("[units]\nmemory = -5\n", "units.memory", "negative"),
        ("[units]\nmemory = 0\n", "units.memory", "more than 0"),
        ("[units]\nmemory = true\n", "units.memory", "expected a size"),
        ("[units]\ncount = 0\n", "units.count", "at least 1"),
        ("[units]\ncount = -1\n", "units.count", ""),
        ("[units]\ncount = \"4\"\n", "units.count", ""),
        ("[units]\ncpus = -1\n", "units.cpus", "0 or more"),
        ("[units]\nreplicas = 0\n", "units.replicas", "at least 1"),
        ("[units]\nreplicas = -2\n", "units.replicas", "expected usize"),
        ("[units]\nreplicas = 1.5\n", "units.replicas", "expected usize"),
        ("[units]\nreplicas = \"2\"\n", "units.replicas", "expected usize"),
        ("[units]\ncount = 2\nreplicas = 3\n", "units.replicas", "3 copies of every row need at least 3 units, but units.count is 2"),
        ("[units]\npin_lease = 30\n", "units.pin_lease", "duration string"),
        ("[units]\npin_lease = \"soon\"\n", "units.pin_lease", "not a duration"),
        ("[units]\nreservation_lease = \"0s\"\n", "units.reservation_lease", "longer than 0"),
        ("[units]\nmax_connections = 0\n", "units.max_connections", "at least 1"),
        ("[units]\nmax_session_connections = 0\n", "units.max_session_connections", "at least 1"),
        ("[units]\nmax_handshakes = 0\n", "units.max_handshakes", "at least 1"),
        ("[units]\nmax_handshakes_per_source = 0\n", "units.max_handshakes_per_source", "at least 1"),
        ("[timeouts]\nhandshake = \"0s\"\n", "timeouts.handshake", "longer than 0"),
        ("[units]\nmax_session_holds = 0\n", "units.max_session_holds", "at least 1"),
        ("[units]\ncheckpoint_root = \"ckpt\"\n", "units.checkpoint_root", "absolute"),
        ("[units]\nhuge_pages = \"big\"\n", "units.huge_pages", "expected auto, hugetlb, thp or 4k"),
        ("[units.disk]\nroot = \"rel/dir\"\n", "units.disk.root", "absolute"),
        ("[units.disk]\nroot = \"/d\"\ncapacity = 0\n", "units.disk.capacity", "more than 0"),
        ("[units.disk]\nroot = \"/d\"\nhigh_watermark = 1.5\n", "units.disk.high_watermark", "(0, 1]"),
        ("[units.disk]\nroot = \"/d\"\nhigh_watermark = 0\n", "units.disk.high_watermark", "(0, 1]"),
        ("[units.disk]\nroot = \"/d\"\nlow_watermark = 0\n", "units.disk.low_watermark", "(0, 1]"),
        ("[units.disk]\nroot = \"/d\"\nlow_watermark = 0.9\n", "units.disk.low_watermark", "below"),
        ("[units.disk]\nroot = \"/d\"\nhigh_watermark = 0.5\nlow_watermark = 0.6\n", "units.disk.low_watermark", "below"),
        ("[placement]\nclusters = \"train\"\n", "placement.clusters", "[\"train\"]"),
        ("[placement]\nclusters = []\n", "placement.clusters", "names no cluster"),
        ("[placement]\nclusters = [\"\"]\n", "placement.clusters", "empty"),
        ("[placement]\nclusters = [1]\n", "placement.clusters", "list of cluster names"),
        ("[listen]\nhost = \"localhost\"\n", "listen.host", "not a listen host"),
        ("[listen]\nhost = \"node_ip\"\n", "listen.host", "node-ip"),
        ("[listen]\ntcp_port = 70000\n", "listen.tcp_port", ""),
        ("[listen]\nunix_dir = \"run\"\n", "listen.unix_dir", "absolute"),
        ("[auth]\nsecret_file = \"secret\"\n", "auth.secret_file", "absolute"),
        ("[auth]\nsecret_file = \"/s\"\ninsecure = true\n", "auth.insecure", "secret_file"),
        ("[auth]\ninsecure = \"yes\"\n", "auth.insecure", ""),
        ("[timeouts]\nop = \"0s\"\n", "timeouts.op", "longer than 0"),
        ("[timeouts]\nstart = 120\n", "timeouts.start", "duration string"),
        ("[timeouts]\nstop = \"0ms\"\n", "timeouts.stop", "longer than 0"),
        ("[timeouts]\nframe = \"ten seconds\"\n", "timeouts.frame", "not a duration"),
        ("[timeouts]\nconnect = \"1s\"\n", "timeouts.connect", "unknown field"),
        ("[client]\nnamespace = \"\"\n", "client.namespace", "empty"),
        ("[client]\ntransport = \"rdma\"\n", "client.transport", "unknown variant `rdma`"),
        ("[client]\nwait_for_memory = 5\n", "client.wait_for_memory", "duration string"),
    ];
    for (text, key, phrase) in cases {
        let e = err(text);
        assert_eq!(e.key(), Some(*key), "{text:?}: {e}");
        let msg = e.to_string();
        assert!(msg.starts_with(TEXT_SOURCE), "{text:?}: {msg}");
        assert!(msg.contains(&format!("{key}: ")), "{text:?}: {msg}");
        assert!(msg.contains(phrase), "{text:?}: {msg} lacks {phrase:?}");
    }
}

/// `units.replicas` against the units a plane has: as many copies as
/// units is the most; the count the file sets is checked as it is read,
/// the count a launcher plans (two per node) when it starts.
#[test]
fn replicas_need_a_unit_each() {
    let c = Config::from_toml_str("[units]\ncount = 3\nreplicas = 3\n").unwrap();
    assert_eq!((c.units.count, c.units.replicas), (Some(3), 3));
    let c = Config::from_toml_str("[units]\nreplicas = 4\n").unwrap();
    assert_eq!(c.units.replicas, 4);
    c.units.check_replicas(4).unwrap();
    c.units.check_replicas(9).unwrap();
    let e = c.units.check_replicas(3).unwrap_err();
    assert_eq!(
        e,
        "units.replicas = 4 needs at least 4 units, but the plane has 3"
    );
    // A config built in code is checked as a file is.
    let mut built = Config::default();
    built.units.replicas = 0;
    let e = built.validate().unwrap_err();
    assert_eq!(e.key(), Some("units.replicas"), "{e}");
    // The error points at the value.
    let e = err("[units]\ncount = 2\nreplicas = 5\n");
    assert!(
        e.to_string()
            .starts_with("<config text>:3:12: units.replicas: "),
        "{e}"
    );
}

#[test]
fn syntax_errors_have_a_position() {
    let e = err("[units]\nmemory = \"1GiB\"\ncount = [\n");
    let ConfigError::Invalid { line, key, .. } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(*key, None);
    assert_eq!(line.map(|(l, _)| l), Some(3), "{e}");
    #[rustfmt::skip]
    let cases = [
        // A value error points at the value.
        ("[units]\n\nmemory = \"lots\"\n", "<config text>:3:10: units.memory: "),
        // So does a value out of range, in a section or in a dotted key.
        ("[units.disk]\nroot = \"/d\"\n  low_watermark = 0.95\n", "<config text>:3:19: units.disk.low_watermark: must be below"),
        ("units.disk = { root = \"/d\", high_watermark = 2.0 }\n", "<config text>:1:46: units.disk.high_watermark: "),
        // A rule about a key the file leaves out: no position.
        ("[units.disk]\nroot = \"/d\"\nhigh_watermark = 0.5\n", "<config text>: units.disk.low_watermark: "),
    ];
    for (text, start) in cases {
        let e = err(text);
        assert!(e.to_string().starts_with(start), "{e}");
    }
}

#[test]
fn files_are_named_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stowage.toml");
    let e = Config::from_file(&path).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(
        e.to_string().starts_with(&path.display().to_string()),
        "{e}"
    );
    std::fs::write(&path, "[listen]\ntcp_prot = 1\n").unwrap();
    let e = Config::from_file(&path).unwrap_err();
    assert_eq!(e.key(), Some("listen.tcp_prot"));
    assert!(
        e.to_string()
            .starts_with(&format!("{}:2:1: listen.tcp_prot: ", path.display())),
        "{e}"
    );
    std::fs::write(&path, "[listen]\ntcp_port = 9000\n").unwrap();
    assert_eq!(Config::from_file(&path).unwrap().listen.tcp_port, 9000);
}

#[test]
fn the_secret_comes_from_the_named_file_and_never_shows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, "config-secret-0123456789\n").unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let text = format!("[auth]\nsecret_file = {:?}\n", path.display().to_string());
    let c = Config::from_toml_str(&text).unwrap();
    let u = c.unit_config(0, None, None).unwrap();
    let s = u.secret.expect("a secret");
    assert_eq!(s.expose(), b"config-secret-0123456789");
    assert!(!format!("{s:?} {c:?}").contains("config-secret"));
    // A secret file others can read is refused, naming the key.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let e = c.unit_config(0, None, None).unwrap_err();
    assert_eq!(e.key(), Some("auth.secret_file"), "{e}");
    assert!(!e.to_string().contains("config-secret"), "{e}");
    // insecure: no secret at all.
    let c = Config::from_toml_str("[auth]\ninsecure = true\n").unwrap();
    let u = c.unit_config(0, None, None).unwrap();
    assert!(u.secret.is_none() && u.insecure);
}

#[test]
fn unit_config_takes_the_units_settings() {
    let c = Config::from_toml_str(
        r#"
            [units]
            memory = "64MiB"
            reservation_lease = "7s"
            pin_lease = "8s"
            max_connections = 9
            max_handshakes = 12
            max_handshakes_per_source = 4
            max_session_connections = 3
            max_session_holds = 11
            checkpoint_root = "/ckpt"
            [units.disk]
            root = "/disk"
            capacity = "2GiB"
            high_watermark = 0.7
            low_watermark = 0.6
            [timeouts]
            frame = "3s"
            handshake = "250ms"
            "#,
    )
    .unwrap();
    let tcp: SocketAddr = "10.0.0.5:7001".parse().unwrap();
    let u = c
        .unit_config(3, Some(tcp), Some("/run/u3.sock".into()))
        .unwrap();
    assert_eq!(u.name, "unit-3");
    assert_eq!(u.memory, 64 << 20);
    assert_eq!(u.tcp, Some(tcp));
    assert_eq!(u.uds, Some(PathBuf::from("/run/u3.sock")));
    assert_eq!(u.reservation_lease, Duration::from_secs(7));
    assert_eq!(u.pin_lease, Duration::from_secs(8));
    assert_eq!(u.max_connections, 9);
    assert_eq!((u.max_handshakes, u.max_handshakes_per_source), (12, 4));
    assert_eq!(u.handshake_timeout, Duration::from_millis(250));
    assert_eq!(u.max_session_connections, 3);
    assert_eq!(u.max_session_holds, 11);
    assert_eq!(u.checkpoint_root, Some(PathBuf::from("/ckpt")));
    assert_eq!(u.disk, Some((PathBuf::from("/disk"), 2 << 30)));
    assert_eq!((u.high_watermark, u.low_watermark), (0.7, 0.6));
    assert_eq!(u.frame_timeout, Duration::from_secs(3));
    // What the file does not cover keeps the unit's defaults.
    let base = UnitConfig::new("x", 1);
    assert_eq!(u.quarantine, base.quarantine);
    assert_eq!(u.mlock, base.mlock);
    assert_eq!(u.allow_other_uids, base.allow_other_uids);
    assert_eq!(u.admin_tcp, base.admin_tcp);

    // The default config gives the unit's own defaults, and no listeners
    // unless given.
    let u = Config::default().unit_config(0, None, None).unwrap();
    assert_eq!(u.name, "unit-0");
    assert_eq!((u.tcp, u.uds.clone()), (None, None));
    assert_eq!(u.memory, 1 << 30);
    assert_eq!(u.disk, None);
    assert_eq!(u.reservation_lease, base.reservation_lease);
    assert_eq!(u.frame_timeout, base.frame_timeout);
    assert_eq!(u.max_connections, base.max_connections);
}

#[test]
fn listen_host_resolves() {
    let c = Config::from_toml_str("[listen]\nhost = \"0.0.0.0\"\n").unwrap();
    assert_eq!(c.resolve_listen_host(), IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let c = Config::from_toml_str("[listen]\nhost = \"::1\"\n").unwrap();
    assert_eq!(c.resolve_listen_host(), "::1".parse::<IpAddr>().unwrap());
    assert_eq!(
        Config::default().resolve_listen_host(),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    // "node-ip": an address of this host, so a listener can bind it.
    let c = Config::from_toml_str("[listen]\nhost = \"node-ip\"\n").unwrap();
    let ip = c.resolve_listen_host();
    assert!(!ip.is_unspecified());
    let l = std::net::TcpListener::bind((ip, 0)).unwrap();
    assert_eq!(l.local_addr().unwrap().ip(), ip);
}

#[test]
fn sizes_and_durations() {
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
    assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
    assert!(parse_size("1 gig").is_err());
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("1m 30s").unwrap(), Duration::from_secs(90));
    assert!(parse_duration("30").is_err());
}
