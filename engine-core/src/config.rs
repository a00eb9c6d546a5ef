//! Engine configuration: the one path by which every setting reaches an
//! engine. Each setting is a key (`timeout_ms`) with an environment variable
//! (`FERRY_TIMEOUT_MS`), listed once in [`KEYS`]; the environment, the C API
//! (`ferry_config_set`), Python (`ferry.Engine(settings=...)`) and Rust
//! ([`EngineConfig::set`]) all go through [`EngineConfig::set`], so a value
//! means the same thing and is checked the same way whichever way it came.
//!
//! One rule for bad values: [`EngineConfig::set`] rejects them with
//! FERRY_ERR_INVALID_ARGUMENT and a message naming the setting, the value
//! and what it accepts. Nothing is silently defaulted or clamped. An empty
//! environment variable counts as unset.
//!
//! Keys with a dot (`tcp.connections`) are plugin settings: kept as text and
//! handed to plugins, which check them (plugin.h documents the keys the
//! engine itself hands over). What stays outside this path, and why, is in
//! docs/configuration.md ("Environment only").

use crate::error::{Error, ErrorCode, Result};
use crate::gpudirect::Policy;
use ferry_loader::{CacheChoice, HelperChoice, LoaderConfig, NameFilter};
use ferry_metadata::MetadataConfig;
use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::auth::Token;
use ferry_topology::{TopologyConfig, ENV_CUDA_VISIBLE_DEVICES};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::config_keys::*;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where the control listener binds (FERRY_LISTEN); its port becomes the
    /// segment name's port. Use 0.0.0.0:PORT for peers on other hosts.
    pub listen: String,
    /// The host part of the segment name (FERRY_HOSTNAME); by default the
    /// listen address, or this host's first non-loopback IPv4 address when
    /// listening on all interfaces.
    pub hostname: Option<String>,
    /// Deadline of every network wait (FERRY_TIMEOUT_MS).
    pub timeout: Duration,
    /// Deadline of a connection attempt (FERRY_CONNECT_TIMEOUT_MS).
    pub connect_timeout: Duration,
    /// A connection this engine serves (control, TCP data) that carries no
    /// request for this long is closed (FERRY_IDLE_TIMEOUT_S); connections
    /// this engine opens are dropped after half of it and remade on demand.
    pub idle_timeout: Duration,
    /// How long a thread waiting for a batch polls (completing what arrives
    /// itself) before it sleeps (FERRY_SPIN_US; 0 sleeps at once).
    pub spin: Duration,
    /// How GPU memory is registered for RDMA (FERRY_GPU_DIRECT).
    pub gpu_direct: Policy,
    /// Bytes per staged chunk (FERRY_STAGING_CHUNK).
    pub staging_chunk: u64,
    /// Staged chunks in flight per job (FERRY_STAGING_DEPTH).
    pub staging_depth: usize,
    /// Plugin settings ("tcp.connections" = "4"); override FERRY_TCP_CONNECTIONS.
    pub settings: BTreeMap<String, String>,
    pub loader: LoaderConfig,
    /// Where topology comes from (FERRY_SYSFS_ROOT, FERRY_NICS,
    /// FERRY_TOPOLOGY_FILE, CUDA_VISIBLE_DEVICES).
    pub topology: TopologyConfig,
    /// Where segments are found by name (FERRY_METADATA): peer to peer, or
    /// etcd with a key prefix (FERRY_METADATA_PREFIX) and a lease TTL
    /// (FERRY_METADATA_TTL_S).
    pub metadata: MetadataConfig,
    /// The name this engine registers under in a metadata store
    /// (FERRY_NAME); by default its control address, "host:port".
    pub name: Option<String>,
    /// The cluster's shared secret (FERRY_AUTH_TOKEN, or the first line of
    /// FERRY_AUTH_TOKEN_FILE): every control and data connection proves it
    /// knows it, both ways.
    pub auth_token: Option<Token>,
    /// The file the token was read from (FERRY_AUTH_TOKEN_FILE), if it was.
    pub auth_token_file: Option<PathBuf>,
    /// FERRY_AUTH=off: no token at all: every peer that can reach a
    /// listener is served (by default an engine with no token configured
    /// uses this user's token, `user_token`, and a listener other hosts can
    /// reach needs a configured one).
    pub auth_off: bool,
    /// A new connection must authenticate within this
    /// (FERRY_AUTH_TIMEOUT_MS, 1000).
    pub auth_timeout: Duration,
    /// Connections authenticating at once per listener, in all and per
    /// source address (FERRY_AUTH_MAX_PENDING 64,
    /// FERRY_AUTH_MAX_PENDING_PER_HOST 8); more are answered BUSY.
    pub auth_max_pending: usize,
    pub auth_max_pending_per_host: usize,
    /// Authenticated control connections served from one host
    /// (FERRY_CONTROL_MAX_PER_HOST, 32, of the listener's 128): at the cap
    /// a newcomer takes the place of that host's longest-idle connection
    /// (idle 1 s at least), or is answered BUSY.
    pub control_max_per_host: usize,
    /// FERRY_SELECT=declared: routes follow the plugins' declared figures
    /// only, never what transfers measured (measured by default).
    pub select_measured: bool,
    /// FERRY_PREFER: the transport requests prefer when it can serve them
    /// (Mooncake's `protocol`); `None`: the engine's choice alone.
    pub prefer: Option<String>,
    /// FERRY_METRICS=off: count nothing per request (on by default).
    pub metrics: bool,
    /// FERRY_HUGEPAGES=off: memory the engine allocates uses normal pages
    /// even where hugetlb pages are configured (on by default).
    pub hugepages: bool,
    /// Where the metrics endpoint listens (FERRY_METRICS_LISTEN, e.g.
    /// 127.0.0.1:9464); none by default.
    pub metrics_listen: Option<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: DEFAULT_LISTEN.to_string(),
            hostname: None,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            connect_timeout: Duration::from_millis(DEFAULT_CONNECT_TIMEOUT_MS),
            idle_timeout: Duration::from_secs(DEFAULT_IDLE_TIMEOUT_S),
            spin: Duration::from_micros(DEFAULT_SPIN_US),
            gpu_direct: Policy::Auto,
            staging_chunk: DEFAULT_STAGING_CHUNK,
            staging_depth: DEFAULT_STAGING_DEPTH,
            settings: BTreeMap::new(),
            loader: LoaderConfig::default(),
            topology: TopologyConfig::default(),
            metadata: MetadataConfig::P2p,
            name: None,
            auth_token: None,
            auth_token_file: None,
            auth_off: false,
            auth_timeout: Duration::from_millis(admission::DEFAULT_AUTH_TIMEOUT_MS),
            auth_max_pending: admission::DEFAULT_MAX_PENDING,
            auth_max_pending_per_host: admission::DEFAULT_MAX_PENDING_PER_SOURCE,
            control_max_per_host: DEFAULT_CONTROL_MAX_PER_HOST,
            select_measured: true,
            prefer: None,
            metrics: true,
            hugepages: true,
            metrics_listen: None,
        }
    }
}

fn bad(key: &str, value: &str, expected: &str) -> Error {
    Error::new(
        ErrorCode::InvalidArgument,
        format!("setting {key} = {value:?} rejected: expected {expected}"),
    )
}

/// A whole number in `range`, or the reason it is not.
fn number<T>(key: &str, value: &str, range: std::ops::RangeInclusive<T>, unit: &str) -> Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    value
        .trim()
        .parse::<T>()
        .ok()
        .filter(|v| range.contains(v))
        .ok_or_else(|| {
            bad(
                key,
                value,
                &format!(
                    "a whole number of {unit}, {} to {}",
                    range.start(),
                    range.end()
                ),
            )
        })
}

/// Parses sizes such as `4096`, `64K`, `1M`, `1G`, `16MiB` (powers of 1024).
pub fn parse_size_text(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// `etcd://a:1,b:2` (or `etcds://`) for an etcd store, `p2p` otherwise.
fn metadata_text(m: &MetadataConfig) -> String {
    match m {
        MetadataConfig::P2p => "p2p".into(),
        MetadataConfig::Etcd {
            endpoints, access, ..
        } => format!(
            "{}://{}",
            if access.tls { "etcds" } else { "etcd" },
            endpoints
                .iter()
                .map(|e| e.split_once("://").map_or(e.as_str(), |(_, hp)| hp))
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

fn choice_text(auto: bool, off: bool, path: Option<&PathBuf>) -> String {
    match (auto, off, path) {
        (true, _, _) => "auto".into(),
        (_, true, _) => "off".into(),
        (_, _, Some(p)) => p.display().to_string(),
        _ => String::new(),
    }
}

/// Whether a plugin setting's value is a secret (shown as `(set)`).
fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.ends_with("token") || k.ends_with("secret") || k.ends_with("password")
}

impl EngineConfig {
    /// Defaults overridden by every FERRY_* variable of [`KEYS`] that is set
    /// and not empty, each checked as [`EngineConfig::set`] checks it: the
    /// first bad one is the error, naming the variable.
    pub fn from_env() -> Result<EngineConfig> {
        EngineConfig::from_lookup(|name| std::env::var_os(name))
    }

    /// Like [`EngineConfig::from_env`], with `lookup` standing in for the
    /// environment (tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<EngineConfig> {
        let mut c = EngineConfig::default();
        // CUDA's own variable, environment only: it is CUDA's setting.
        c.topology.cuda_visible_devices =
            lookup(ENV_CUDA_VISIBLE_DEVICES).map(|value| value.to_string_lossy().into_owned());
        for k in KEYS {
            let Some(raw) = lookup(k.env).filter(|v| !v.is_empty()) else {
                continue;
            };
            let value = raw.into_string().map_err(|raw| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("{}={raw:?} rejected: not UTF-8 text", k.env),
                )
            })?;
            c.set(k.key, &value).map_err(|e| {
                Error::new(e.code, format!("{} (from {}={value:?})", e.message, k.env))
            })?;
        }
        Ok(c)
    }

    /// A setting as plugins see it (`shm.hugepages`): set here, else the
    /// environment's FERRY_SHM_HUGEPAGES.
    pub fn setting(&self, key: &str) -> Option<String> {
        self.settings
            .get(key)
            .cloned()
            .or_else(|| std::env::var(ferry_loader::config_env_var(key)).ok())
    }

    /// Sets one option by name (a key of [`KEYS`], or a plugin setting such
    /// as `tcp.connections`). A value the key does not accept is rejected
    /// with FERRY_ERR_INVALID_ARGUMENT and the reason; the configuration is
    /// then unchanged.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let v = value.trim();
        let handled = self.set_engine(key, value, v)?
            || self.set_metadata(key, value, v)?
            || self.set_auth(key, value, v)?
            || self.set_discovery(key, value, v)?;
        if handled {
            return Ok(());
        }
        match key {
            k if k.contains('.') && !k.starts_with('.') && !k.ends_with('.') => {
                self.settings.insert(k.to_string(), value.to_string());
            }
            _ => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "unknown option {key:?}: expected one of {}, or a plugin setting such as \
                         tcp.connections",
                        KEYS.iter().map(|k| k.key).collect::<Vec<_>>().join(", ")
                    ),
                ))
            }
        }
        Ok(())
    }

    /// The engine's own settings: addresses, timeouts, staging, selection,
    /// metrics, admission limits.
    /// `Ok(false)`: not one of these keys.
    fn set_engine(&mut self, key: &str, value: &str, v: &str) -> Result<bool> {
        match key {
            "listen" => {
                if v.is_empty() || v.contains(char::is_whitespace) || !v.contains(':') {
                    return Err(bad(key, value, "host:port, e.g. 0.0.0.0:7000"));
                }
                self.listen = v.to_string()
            }
            "hostname" => self.hostname = Some(v.to_string()).filter(|v| !v.is_empty()),
            "timeout_ms" => {
                self.timeout =
                    Duration::from_millis(number(key, value, 1..=86_400_000, "milliseconds")?)
            }
            "connect_timeout_ms" => {
                self.connect_timeout =
                    Duration::from_millis(number(key, value, 1..=86_400_000, "milliseconds")?)
            }
            "idle_timeout_s" => {
                self.idle_timeout = Duration::from_secs(number(key, value, 1..=86_400, "seconds")?)
            }
            "spin_us" => {
                self.spin =
                    Duration::from_micros(number(key, value, 0..=1_000_000, "microseconds")?)
            }
            "gpu_direct" => {
                self.gpu_direct =
                    Policy::parse(v).map_err(|_| bad(key, value, "auto, dmabuf, peermem or off"))?
            }
            "staging_chunk" => {
                self.staging_chunk = parse_size_text(v)
                    .filter(|n| (MIN_STAGING_CHUNK..=MAX_STAGING_CHUNK).contains(n))
                    .ok_or_else(|| bad(key, value, "a size from 64K to 64M, e.g. 4M"))?
            }
            "staging_depth" => {
                self.staging_depth = number(key, value, 1..=MAX_STAGING_DEPTH, "chunks")?
            }
            "prefer" => {
                if v.contains(|c: char| c.is_whitespace() || c.is_control()) {
                    return Err(bad(key, value, "a transport name such as tcp, or empty"));
                }
                self.prefer = Some(v.to_string()).filter(|v| !v.is_empty())
            }
            "select" => {
                self.select_measured = match value.trim() {
                    "" | "measured" => true,
                    "declared" => false,
                    _ => return Err(bad(key, value, "measured or declared")),
                }
            }
            "metrics" => {
                self.metrics = match value.trim() {
                    "" | "on" => true,
                    "off" => false,
                    _ => return Err(bad(key, value, "on or off")),
                }
            }
            "hugepages" => {
                self.hugepages = match value.trim() {
                    "" | "on" => true,
                    "off" => false,
                    _ => return Err(bad(key, value, "on or off")),
                }
            }
            "metrics_listen" => {
                self.metrics_listen = Some(value.trim().to_string()).filter(|v| !v.is_empty())
            }
            "control_max_per_host" => {
                self.control_max_per_host = number(
                    key,
                    value,
                    1..=crate::config_keys::MAX_CONTROL_CONNECTIONS,
                    "connections",
                )?
            }
            // Read by the transports.
            "integrity" => {
                if v != "headers" && v != "payload" {
                    return Err(bad(key, value, "headers or payload"));
                }
                self.settings.insert("integrity".into(), v.to_string());
            }
            "name" => {
                if v.is_empty() || v.len() > 200 || v.chars().any(|c| c.is_control() || c == '/') {
                    return Err(bad(
                        key,
                        value,
                        "a segment name of 1 to 200 characters, no '/' or control characters",
                    ));
                }
                self.name = Some(v.to_string());
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The metadata store and its etcd options.
    /// `Ok(false)`: not one of these keys.
    fn set_metadata(&mut self, key: &str, value: &str, v: &str) -> Result<bool> {
        match key {
            "metadata" => {
                // Keep a prefix or TTL set before the store.
                let new = MetadataConfig::parse(value).map_err(|e| {
                    bad(
                        key,
                        value,
                        &format!("p2p or etcd://host:port ({})", e.message),
                    )
                })?;
                let old = std::mem::replace(&mut self.metadata, new);
                if let (
                    MetadataConfig::Etcd {
                        prefix,
                        ttl_s,
                        access,
                        ..
                    },
                    MetadataConfig::Etcd {
                        prefix: p,
                        ttl_s: t,
                        access: a,
                        ..
                    },
                ) = (&mut self.metadata, old)
                {
                    *prefix = p;
                    *ttl_s = t;
                    // The scheme comes with the new store; files and user stay.
                    *access = ferry_metadata::EtcdAccess {
                        tls: access.tls,
                        ..a
                    };
                }
            }
            "metadata_prefix"
            | "metadata_ttl_s"
            | "metadata_cacert"
            | "metadata_cert"
            | "metadata_key"
            | "metadata_user"
            | "metadata_password_file" => {
                let MetadataConfig::Etcd {
                    prefix,
                    ttl_s,
                    access,
                    ..
                } = &mut self.metadata
                else {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "setting {key} = {value:?} rejected: it applies to a metadata store; \
                             set metadata (FERRY_METADATA) to etcd://host:port first"
                        ),
                    ));
                };
                // A file must be readable now, so that a typo is caught here
                // (its contents are checked when the store connects).
                let file = || -> Result<Option<PathBuf>> {
                    if v.is_empty() {
                        return Ok(None);
                    }
                    match std::fs::File::open(v) {
                        Ok(_) => Ok(Some(PathBuf::from(v))),
                        Err(e) => Err(Error::new(
                            ErrorCode::InvalidArgument,
                            format!("setting {key} = {value:?} rejected: cannot read it: {e}"),
                        )),
                    }
                };
                match key {
                    "metadata_cacert" => access.cacert = file()?,
                    "metadata_cert" => access.cert = file()?,
                    "metadata_key" => access.key = file()?,
                    "metadata_password_file" => access.password_file = file()?,
                    "metadata_user" => {
                        if v.chars().any(|c| c.is_control()) {
                            return Err(bad(key, value, "an etcd user name"));
                        }
                        access.user = Some(v.to_string()).filter(|v| !v.is_empty());
                    }
                    _ => {}
                }
                if key == "metadata_prefix" {
                    if v.is_empty() || v.contains(char::is_whitespace) {
                        return Err(bad(key, value, "a key prefix such as /ferry/cluster-a"));
                    }
                    *prefix = format!("/{}", v.trim_matches('/'));
                } else if key == "metadata_ttl_s" {
                    *ttl_s = number(key, value, 2..=3600, "seconds")?;
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The cluster token and the admission of connections.
    /// `Ok(false)`: not one of these keys.
    fn set_auth(&mut self, key: &str, value: &str, v: &str) -> Result<bool> {
        match key {
            "auth_token" => self.auth_token = Token::new(value),
            "auth_token_file" => {
                let text = std::fs::read_to_string(v).map_err(|e| {
                    Error::new(
                        ErrorCode::InvalidArgument,
                        format!("setting {key} = {value:?} rejected: cannot read it: {e}"),
                    )
                })?;
                self.auth_token = Some(Token::new(text.lines().next().unwrap_or("")).ok_or_else(
                    || {
                        bad(
                            key,
                            value,
                            "a file whose first line is the token (it is empty)",
                        )
                    },
                )?);
                self.auth_token_file = Some(PathBuf::from(v));
            }
            "auth_timeout_ms" => {
                self.auth_timeout =
                    Duration::from_millis(number(key, value, 1..=600_000, "milliseconds")?)
            }
            "auth_max_pending" => {
                self.auth_max_pending = number(key, value, 1..=100_000, "connections")?
            }
            "auth_max_pending_per_host" => {
                self.auth_max_pending_per_host = number(key, value, 1..=100_000, "connections")?
            }
            "auth" => {
                self.auth_off = match v {
                    "off" => true,
                    "" | "on" | "required" => false,
                    _ => return Err(bad(key, value, "required or off")),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Where plugins and the topology come from.
    /// `Ok(false)`: not one of these keys.
    fn set_discovery(&mut self, key: &str, value: &str, v: &str) -> Result<bool> {
        match key {
            "plugin_path" => {
                let mut dirs: Vec<_> = std::env::split_paths(value)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect();
                dirs.extend(std::mem::take(&mut self.loader.plugin_path));
                self.loader.plugin_path = dirs;
            }
            "transports" => self.loader.transports = NameFilter::parse(value),
            "plugin_probe_timeout_ms" => {
                self.loader.probe_timeout =
                    Duration::from_millis(number(key, value, 1..=3_600_000, "milliseconds")?)
            }
            "plugin_probe_helper" => self.loader.probe_helper = HelperChoice::parse(value),
            "plugin_cache" => self.loader.cache = CacheChoice::parse(value),
            "nics" => self.topology.nic_filter = Some(v.to_string()).filter(|v| !v.is_empty()),
            "sysfs_root" => {
                self.topology.sysfs_root = if v.is_empty() {
                    PathBuf::from(ferry_topology::DEFAULT_SYSFS_ROOT)
                } else {
                    PathBuf::from(v)
                }
            }
            "topology_file" => {
                self.topology.topology_file = Some(PathBuf::from(v)).filter(|_| !v.is_empty())
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// One option's value as text, in the form [`EngineConfig::set`]
    /// accepts (secrets as `(set)`, never their text; unset ones empty).
    /// FERRY_ERR_NOT_FOUND for a key that is neither an engine setting nor
    /// a plugin setting set here.
    pub fn get(&self, key: &str) -> Result<String> {
        let etcd = match &self.metadata {
            MetadataConfig::Etcd { prefix, ttl_s, .. } => Some((prefix.clone(), *ttl_s)),
            MetadataConfig::P2p => None,
        };
        let access = match &self.metadata {
            MetadataConfig::Etcd { access, .. } => access.clone(),
            MetadataConfig::P2p => Default::default(),
        };
        let path_text = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        Ok(match key {
            "listen" => self.listen.clone(),
            "hostname" => self.hostname.clone().unwrap_or_default(),
            "timeout_ms" => self.timeout.as_millis().to_string(),
            "connect_timeout_ms" => self.connect_timeout.as_millis().to_string(),
            "idle_timeout_s" => self.idle_timeout.as_secs().to_string(),
            "spin_us" => self.spin.as_micros().to_string(),
            "gpu_direct" => self.gpu_direct.as_str().to_string(),
            "staging_chunk" => self.staging_chunk.to_string(),
            "staging_depth" => self.staging_depth.to_string(),
            "prefer" => self.prefer.clone().unwrap_or_default(),
            "select" => ["declared", "measured"][usize::from(self.select_measured)].into(),
            "metrics" => if self.metrics { "on" } else { "off" }.to_string(),
            "hugepages" => if self.hugepages { "on" } else { "off" }.to_string(),
            "metrics_listen" => self.metrics_listen.clone().unwrap_or_default(),
            "plugin_path" => std::env::join_paths(&self.loader.plugin_path)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            "transports" => self
                .loader
                .transports
                .as_ref()
                .map(|f| f.spec().to_string())
                .unwrap_or_default(),
            "plugin_probe_timeout_ms" => self.loader.probe_timeout.as_millis().to_string(),
            "plugin_probe_helper" => match &self.loader.probe_helper {
                HelperChoice::Auto => choice_text(true, false, None),
                HelperChoice::Off => choice_text(false, true, None),
                HelperChoice::Path(p) => choice_text(false, false, Some(p)),
            },
            "plugin_cache" => match &self.loader.cache {
                CacheChoice::Auto => choice_text(true, false, None),
                CacheChoice::Off => choice_text(false, true, None),
                CacheChoice::Path(p) => choice_text(false, false, Some(p)),
            },
            "sysfs_root" => self.topology.sysfs_root.display().to_string(),
            "nics" => self.topology.nic_filter.clone().unwrap_or_default(),
            "topology_file" => path_text(&self.topology.topology_file),
            "metadata" => metadata_text(&self.metadata),
            "metadata_prefix" => etcd.map(|(p, _)| p).unwrap_or_default(),
            "metadata_ttl_s" => etcd.map(|(_, t)| t.to_string()).unwrap_or_default(),
            "metadata_cacert" => path_text(&access.cacert),
            "metadata_cert" => path_text(&access.cert),
            "metadata_key" => path_text(&access.key),
            "metadata_user" => access.user.clone().unwrap_or_default(),
            "metadata_password_file" => path_text(&access.password_file),
            "name" => self.name.clone().unwrap_or_default(),
            "auth_token_file" => path_text(&self.auth_token_file),
            "auth_token" => if self.auth_token.is_some() {
                "(set)"
            } else {
                ""
            }
            .to_string(),
            "auth" => if self.auth_off { "off" } else { "required" }.to_string(),
            "auth_timeout_ms" => self.auth_timeout.as_millis().to_string(),
            "auth_max_pending" => self.auth_max_pending.to_string(),
            "auth_max_pending_per_host" => self.auth_max_pending_per_host.to_string(),
            "control_max_per_host" => self.control_max_per_host.to_string(),
            "integrity" => self
                .settings
                .get("integrity")
                .cloned()
                .unwrap_or_else(|| "headers".into()),
            k => match self.settings.get(k) {
                Some(_) if secret_key(k) => "(set)".to_string(),
                Some(v) => v.clone(),
                None => {
                    return Err(Error::new(
                        ErrorCode::NotFound,
                        format!(
                        "no option {k:?}: neither an engine setting nor a plugin setting set here"
                    ),
                    ))
                }
            },
        })
    }

    /// Every engine setting and every plugin setting set here, as
    /// [`EngineConfig::get`] shows them: what `ferry info` reports.
    pub fn effective(&self) -> BTreeMap<String, String> {
        KEYS.iter()
            .map(|k| k.key.to_string())
            .chain(self.settings.keys().cloned())
            .filter_map(|k| self.get(&k).ok().map(|v| (k, v)))
            .collect()
    }

    /// The settings of [`EngineConfig::effective`] that differ from the
    /// defaults, as `key=value` text (what the engine logs at start and
    /// `ferry info` lists).
    pub fn changed(&self) -> Vec<(String, String)> {
        let defaults = EngineConfig::default().effective();
        self.effective()
            .into_iter()
            .filter(|(k, v)| defaults.get(k) != Some(v))
            .collect()
    }

    /// The settings the engine hands its plugins (plugin.h, "Settings the
    /// engine hands to plugins"): the plugin settings given here, and the
    /// engine's own `timeout_ms`, `connect_timeout_ms`, `idle_timeout_s`,
    /// `sysfs_root`, `hostname` (`advertised`, the host peers reach this
    /// engine at) and `auth.token`.
    pub fn plugin_settings(&self, advertised: Option<&str>) -> BTreeMap<String, String> {
        let mut settings = self.settings.clone();
        for key in [
            "timeout_ms",
            "connect_timeout_ms",
            "idle_timeout_s",
            "sysfs_root",
            "auth_timeout_ms",
        ] {
            if let Ok(v) = self.get(key) {
                settings.entry(key.to_string()).or_insert(v);
            }
        }
        // The pre-auth pool of every plugin's listener.
        settings
            .entry("auth.max_pending".into())
            .or_insert_with(|| self.auth_max_pending.to_string());
        settings
            .entry("auth.max_pending_per_host".into())
            .or_insert_with(|| self.auth_max_pending_per_host.to_string());
        if let Some(host) = advertised
            .map(str::to_string)
            .or_else(|| self.hostname.clone())
        {
            settings.entry("hostname".into()).or_insert(host);
        }
        // Plugins authenticate their own connections with the same token.
        if let Some(t) = &self.auth_token {
            settings.insert("auth.token".into(), t.expose());
        }
        settings
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
