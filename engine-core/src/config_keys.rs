//! The engine's settings as a table: every key, its environment variable,
//! its default and what it does (the one list behind `ferry --help`, the
//! README's table and EngineConfig), and the defaults' values.

/// Default for FERRY_LISTEN: loopback only, any free port.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";
/// Default for FERRY_TIMEOUT_MS: how long a network wait may take.
pub const DEFAULT_TIMEOUT_MS: u64 = 15_000;
/// Default for FERRY_CONNECT_TIMEOUT_MS.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Default for FERRY_IDLE_TIMEOUT_S: a control or data connection with no
/// request for this long is closed (clients reconnect when they need it).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 120;
/// Default for FERRY_CONTROL_MAX_PER_HOST: authenticated control
/// connections served from one host (of the listener's 128).
pub const DEFAULT_CONTROL_MAX_PER_HOST: usize = 32;
/// Authenticated control connections one engine serves at once (the
/// largest control_max_per_host).
pub const MAX_CONTROL_CONNECTIONS: usize = 128;
/// Default for FERRY_SPIN_US: how long a waiting thread polls before sleeping.
pub const DEFAULT_SPIN_US: u64 = 100;
/// Default for FERRY_STAGING_CHUNK: bytes per staged chunk. 8 MiB, not 4:
/// a packed run of small blocks costs the peer one list and one launch
/// whatever its size, so 512 blocks of 16 KiB share them rather than 256
/// (on an H100, staged 16 KiB blocks went from 0.63-0.67 of the 1 MiB
/// speed to 0.80-0.94, and 1 MiB blocks lost nothing; docs/benchmarks.md).
pub const DEFAULT_STAGING_CHUNK: u64 = 8 << 20;
/// Default for FERRY_STAGING_DEPTH: chunks in flight per staged job (and
/// slots a peer lends a job: depth x chunk = 48 MiB; the initiator pins
/// twice that). 6, measured against 4 and 8 with 8 MiB chunks.
pub const DEFAULT_STAGING_DEPTH: usize = 6;
/// Smallest FERRY_STAGING_CHUNK.
pub const MIN_STAGING_CHUNK: u64 = 64 << 10;
/// Largest FERRY_STAGING_CHUNK (the staging protocol's largest slot).
pub const MAX_STAGING_CHUNK: u64 = 64 << 20;
/// Largest FERRY_STAGING_DEPTH (the staging protocol's most slots).
pub const MAX_STAGING_DEPTH: usize = 16;

/// One setting: its key, its environment variable, its default (as text)
/// and what it does.
#[derive(Clone, Copy, Debug)]
pub struct Key {
    pub key: &'static str,
    pub env: &'static str,
    pub default: &'static str,
    pub help: &'static str,
}

const fn key(
    key: &'static str,
    env: &'static str,
    default: &'static str,
    help: &'static str,
) -> Key {
    Key {
        key,
        env,
        default,
        help,
    }
}

/// Every engine setting, in the order the environment is applied (a
/// metadata store before its prefix and TTL; a token file before a token,
/// so FERRY_AUTH_TOKEN wins when both are set). A table: short rows stay
/// on one line.
#[rustfmt::skip]
pub const KEYS: &[Key] = &[
    key(
        "listen",
        "FERRY_LISTEN",
        DEFAULT_LISTEN,
        "where the control listener binds (host:port)",
    ),
    key(
        "hostname",
        "FERRY_HOSTNAME",
        "",
        "the host part of the segment name (default: the listen address)",
    ),
    key(
        "timeout_ms",
        "FERRY_TIMEOUT_MS",
        "15000",
        "deadline of every network wait, milliseconds",
    ),
    key(
        "connect_timeout_ms",
        "FERRY_CONNECT_TIMEOUT_MS",
        "5000",
        "deadline of a connection attempt, milliseconds",
    ),
    key(
        "idle_timeout_s",
        "FERRY_IDLE_TIMEOUT_S",
        "120",
        "idle connections are closed after this, seconds (1 to 86400)",
    ),
    key(
        "spin_us",
        "FERRY_SPIN_US",
        "100",
        "how long a waiting thread polls before sleeping, microseconds (0 to 1000000)",
    ),
    key(
        "gpu_direct",
        "FERRY_GPU_DIRECT",
        "auto",
        "GPU memory registration for RDMA: auto, dmabuf, peermem or off",
    ),
    key(
        "staging_chunk",
        "FERRY_STAGING_CHUNK",
        "4M",
        "bytes per staged chunk, 64K to 64M (suffixes K, M, G)",
    ),
    key(
        "staging_depth",
        "FERRY_STAGING_DEPTH",
        "4",
        "staged chunks in flight per job, 1 to 16",
    ),
    key("select", "FERRY_SELECT", "measured", "routes: measured, or declared only"),
    key(
        "prefer",
        "FERRY_PREFER",
        "",
        "transport requests prefer where it serves them (never staging device memory)",
    ),
    key("metrics", "FERRY_METRICS", "on", "per-request counting: on or off"),
    key("hugepages", "FERRY_HUGEPAGES", "on", "allocate_memory on huge pages when there are any: on or off"),
    key("metrics_listen", "FERRY_METRICS_LISTEN", "", "metrics endpoint, host:port"),
    key(
        "plugin_path",
        "FERRY_PLUGIN_PATH",
        "",
        "plugin directories or files searched first (colon list)",
    ),
    key(
        "transports",
        "FERRY_TRANSPORTS",
        "",
        "allow list (tcp,shm) or deny list (^rdma) of transports",
    ),
    key(
        "plugin_probe_timeout_ms",
        "FERRY_PLUGIN_PROBE_TIMEOUT_MS",
        "10000",
        "how long loading and probing one plugin may take, milliseconds",
    ),
    key(
        "plugin_probe_helper",
        "FERRY_PLUGIN_PROBE_HELPER",
        "auto",
        "the ferry-probe helper: auto, off (probe in this process) or a path",
    ),
    key(
        "plugin_cache",
        "FERRY_PLUGIN_CACHE",
        "auto",
        "the probe result cache: auto, off or a file",
    ),
    key(
        "sysfs_root",
        "FERRY_SYSFS_ROOT",
        "/sys",
        "where sysfs is read (fake trees in tests)",
    ),
    key(
        "nics",
        "FERRY_NICS",
        "",
        "allow list (mlx5_0,mlx5_1) or deny list (^mlx5_2) of NICs",
    ),
    key(
        "topology_file",
        "FERRY_TOPOLOGY_FILE",
        "",
        "a JSON file that pins or fills in topology",
    ),
    key(
        "metadata",
        "FERRY_METADATA",
        "p2p",
        "where segments are found by name: p2p, etcd://host:port[,host:port] or etcds:// (TLS)",
    ),
    key(
        "metadata_prefix",
        "FERRY_METADATA_PREFIX",
        "/ferry",
        "key prefix in etcd",
    ),
    key(
        "metadata_ttl_s",
        "FERRY_METADATA_TTL_S",
        "10",
        "lease TTL in etcd, seconds (2 to 3600)",
    ),
    // Named as etcdctl's --cacert, --cert, --key and --user.
    key(
        "metadata_cacert",
        "FERRY_METADATA_CACERT",
        "",
        "etcds://: CA bundle that signed etcd's certificates (default: the system's)",
    ),
    key(
        "metadata_cert",
        "FERRY_METADATA_CERT",
        "",
        "etcds://: Ferry's client certificate (PEM), for etcd's --client-cert-auth",
    ),
    key("metadata_key", "FERRY_METADATA_KEY", "", "etcds://: the client certificate's key (PEM)"),
    key("metadata_user", "FERRY_METADATA_USER", "", "the etcd user Ferry authenticates as"),
    key(
        "metadata_password_file",
        "FERRY_METADATA_PASSWORD_FILE",
        "",
        "a file whose first line is the etcd user's password",
    ),
    key(
        "name",
        "FERRY_NAME",
        "",
        "the name this engine registers under in a metadata store",
    ),
    key(
        "auth_token_file",
        "FERRY_AUTH_TOKEN_FILE",
        "",
        "a file whose first line is the cluster token",
    ),
    key(
        "auth_token",
        "FERRY_AUTH_TOKEN",
        "",
        "the cluster's shared secret",
    ),
    key(
        "auth",
        "FERRY_AUTH",
        "required",
        "required, or off for no token at all (by default this user's token, and a \
         non-loopback listener needs a configured one)",
    ),
    key("auth_timeout_ms", "FERRY_AUTH_TIMEOUT_MS", "1000", "authentication deadline"),
    key("auth_max_pending", "FERRY_AUTH_MAX_PENDING", "64", "connections authenticating"),
    key("auth_max_pending_per_host", "FERRY_AUTH_MAX_PENDING_PER_HOST", "8", "per source"),
    key(
        "control_max_per_host",
        "FERRY_CONTROL_MAX_PER_HOST",
        "32",
        "authenticated control connections served from one host (of 128)",
    ),
    key("integrity", "FERRY_INTEGRITY", "headers", "headers, or payload too"),
];
