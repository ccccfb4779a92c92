//! The unit settings that are one [`UnitConfig`](crate::UnitConfig)
//! field each, written once: [`unit_settings_table!`] lists each with its
//! `stowage unit` flag (name, help, default) and the config file key that
//! sets it, and both front ends expand it (`stowage-cli`'s flag parser,
//! `stowage-cluster`'s config file mapping).

/// The settings of a unit that each set one [`UnitConfig`](crate::UnitConfig)
/// field, written once: `unit_settings_table!(then)` calls the macro `then`
/// with one entry per setting:
///
/// ```text
/// /// doc: the flag's help
/// #[arg(..)] flag: Type => field [= |v| expr] [, file section.key];
/// ```
///
/// `#[arg(..)]` is the flag's clap attribute (its default, its parser),
/// `flag` names the `stowage unit` option (`--flag-name`) and `Type` its
/// value; the option sets the [`UnitConfig`](crate::UnitConfig) field
/// `field` to its value, or to `expr` of it (`v`). `file section.key`,
/// when there, is the config file key (`[section] key`) whose value sets
/// the same field as it is. `stowage-cli` makes the options from it,
/// `stowage-cluster` the config file's mapping; what is more than one
/// field (listeners, the secret, the disk tier, NIXL, the metrics
/// endpoint) each front end says itself.
#[macro_export]
macro_rules! unit_settings_table {
    ($then:ident) => {
        $then! {
        /// Slab memory, e.g. 1GiB.
        #[arg(long, value_parser = $crate::parse_size, default_value = "1GiB")] memory: u64 => memory, file units.memory;
        /// A name for logs.
        #[arg(long, default_value = "unit-0")] name: String => name;
        /// A pin held longer is reported as overdue in stats (never taken
        /// from its holder: a paused client may resume its copy).
        #[arg(long, value_parser = $crate::parse_duration, default_value = "30s")] pin_lease: ::std::time::Duration => pin_lease, file units.pin_lease;
        /// An uncommitted reservation held longer is reported as overdue
        /// in stats (never taken from its holder).
        #[arg(long, value_parser = $crate::parse_duration, default_value = "30s")] reservation_lease: ::std::time::Duration => reservation_lease, file units.reservation_lease;
        /// Rows a claim leased and its client did not settle within this
        /// go back to the task (a consumer stopped mid-claim).
        #[arg(long, value_parser = $crate::parse_duration, default_value = "30s")] claim_lease: ::std::time::Duration => claim_lease;
        /// A repair window (docs/replication.md#repair) whose client sent
        /// nothing through it for this long may be taken over by another
        /// client repairing the same rows (the first one's later repair
        /// puts are refused): a repairer stopped mid-repair does not hold
        /// the repair up.
        #[arg(long, value_parser = $crate::parse_duration, default_value = "30s")] repair_window_lease: ::std::time::Duration => repair_window_lease;
        /// Quarantine of the range of a put stream the unit cut off.
        #[arg(long, value_parser = $crate::parse_duration, default_value = "5s")] quarantine: ::std::time::Duration => quarantine;
        /// Checkpoints are written only under this directory (without it,
        /// the unit takes none).
        #[arg(long)] checkpoint_root: Option<::std::path::PathBuf> => checkpoint_root, file units.checkpoint_root;
        /// Accept Unix-socket clients of other users (default: only this
        /// user's; a client that connects maps the slab).
        #[arg(long)] allow_other_uids: bool => allow_other_uids;
        /// Accept admin requests (shutdown, checkpoint) over TCP too
        /// (default: only same-user clients on the Unix socket).
        #[arg(long)] admin: bool => admin_tcp;
        /// Once a request frame has begun, the rest must arrive within this.
        #[arg(long, value_parser = $crate::parse_duration, default_value = "10s")] frame_timeout: ::std::time::Duration => frame_timeout, file timeouts.frame;
        /// Most connections served at once: those that proved the shared
        /// secret (or, without one, said Hello). Past it, a connection
        /// that proves itself is answered Busy.
        #[arg(long, default_value_t = 16384)] max_connections: usize => max_connections, file units.max_connections;
        /// Most client sessions at once; past it, a new session is
        /// answered Busy.
        #[arg(long, default_value_t = 16_384)] max_sessions: usize => max_sessions, file units.max_sessions;
        /// Threads that serve connections, each waiting on readiness
        /// events for its share of them (0: one per core).
        #[arg(long, default_value_t = 0)] threads: usize => threads, file units.threads;
        /// Most threads for blocking work (a tcp put's or get's bytes,
        /// disk reads, checkpoints, nixl setup); idle ones exit.
        #[arg(long, default_value_t = 8)] io_threads: usize => io_threads = |v| v.max(1);
        /// Most connections at once that have not proved themselves yet;
        /// they never take a served connection's slot. Past it, a new
        /// connection cuts the oldest handshake of the source holding the
        /// most.
        #[arg(long, default_value_t = 128)] max_handshakes: usize => max_handshakes, file units.max_handshakes;
        /// Most of those from one source (a local user, over the Unix
        /// socket or TCP from this host, loopback or a host address;
        /// otherwise an address, an IPv6 /64):
        /// past it, a new one cuts that source's oldest handshake.
        #[arg(long, default_value_t = 32)] max_handshakes_per_source: usize => max_handshakes_per_source, file units.max_handshakes_per_source;
        /// A connection must prove the shared secret and say Hello within
        /// this of its accept, or it is cut.
        #[arg(long, value_parser = $crate::parse_duration, default_value = "1s")] handshake_timeout: ::std::time::Duration => handshake_timeout, file timeouts.handshake;
        /// Most connections of one client session.
        #[arg(long, default_value_t = 64)] max_session_connections: usize => max_session_connections, file units.max_session_connections;
        /// Most reservations and pins one client session may hold at once.
        #[arg(long, default_value_t = 16384)] max_session_holds: usize => max_session_holds, file units.max_session_holds;
        /// Bytes the key index may take (default: a quarter of the memory,
        /// at least 64 MiB); commits past it answer UnitFull.
        #[arg(long, value_parser = $crate::parse_size)] index_budget: Option<u64> => index_budget;
        /// Bytes at the top of the slab that spares (reservations same-host
        /// clients keep for their next puts) come from; default 1/16 of
        /// the memory, at most half; 0: no spares.
        #[arg(long, value_parser = $crate::parse_size)] spare_budget: Option<u64> => spare_budget, file units.spare_budget;
        /// Bytes the unit may hold outside its slab for its connections
        /// (request headers being read, replies being written, their
        /// buffers; default: a quarter of the memory, at least 64 MiB, at
        /// most 1 GiB; small frames take a quarter of it again). When it
        /// is spent, connections wait before they read more; one that has
        /// waited 1s makes the unit cut the connection holding the most
        /// stalled bytes.
        #[arg(long, value_parser = $crate::parse_size)] outside_slab_budget: Option<u64> => outside_slab_budget, file units.outside_slab_budget;
        /// Compaction's budget: bytes it may copy (moving blobs nobody can
        /// touch, to gather free memory into ranges) per byte stored; 0
        /// turns compaction off.
        #[arg(long, default_value_t = 0.25)] compaction_ratio: f64 => compaction_ratio;
        /// Do not try to mlock the slab.
        #[arg(long)] no_mlock: bool => mlock = |v| !v;
        /// The slab's page mode: auto (hugetlb if the free huge pages hold
        /// the slab, else thp if shmem_enabled allows it, else 4k; never
        /// fails), hugetlb (MFD_HUGETLB: needs /proc/sys/vm/nr_hugepages;
        /// the slab rounds up to whole huge pages), thp (MADV_HUGEPAGE:
        /// needs /sys/kernel/mm/transparent_hugepage/shmem_enabled at
        /// advise or within_size) or 4k.
        #[arg(long, value_name = "MODE", default_value = "auto")] huge_pages: $crate::HugePages => huge_pages, file units.huge_pages;
        /// How long a serving thread polls for more requests after its
        /// last one before it sleeps in its readiness wait (0 disables
        /// adaptive polling). A same-host client's request ring stays
        /// polled this long, or four of that client's recent gaps between
        /// requests when that is longer (at most 500us), before it is
        /// parked.
        #[arg(long, value_parser = $crate::parse_duration, default_value = "50us")] spin: ::std::time::Duration => spin;
        /// Turn on a failpoint (tests): `disk-write` fails every disk write;
        /// `disk-sync` fails every blob file's last step (sync and rename),
        /// after a put to disk was answered Pending.
        #[arg(long)] failpoint: Vec<String> => failpoints;
        /// Serve the checkpoint in this directory (a unit's own
        /// subdirectory of a checkpoint); refuses an incomplete one.
        #[arg(long)] restore: Option<::std::path::PathBuf> => restore;
        /// Serve TCP without a shared secret, loopback included (refused
        /// otherwise): every local user, and anyone who reaches the
        /// address, can then read, overwrite and clear every value.
        #[arg(long)] insecure: bool => insecure, file auth.insecure;
        /// Record no metrics at all (no endpoint; stats carry no traffic
        /// counters).
        #[arg(long)] no_metrics: bool => metrics = |v| !v, file metrics.enabled;
        /// The metrics endpoint wants this bearer token (the file's one
        /// line, 16+ visible characters): a scrape without
        /// `Authorization: Bearer <token>` is answered 401, and one that
        /// shows it is never evicted for another connection (Prometheus:
        /// `authorization: {credentials_file: FILE}`).
        #[arg(long, value_name = "FILE")] metrics_token_file: Option<::std::path::PathBuf> => metrics_token_file, file metrics.token_file;
        }
    };
}
