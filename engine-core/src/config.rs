//! Engine configuration: from code, from FERRY_* variables, or both (code
//! wins). Every setting here is documented in the README with its default.

use crate::error::{Error, ErrorCode, Result};
use crate::metadata::MetadataConfig;
use crate::topology::TopologyConfig;
use ferry_loader::{CacheChoice, HelperChoice, LoaderConfig, NameFilter};
use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::auth::Token;
use std::collections::BTreeMap;
use std::time::Duration;

/// Default for FERRY_LISTEN: loopback only, any free port.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";
/// Default for FERRY_TIMEOUT_MS: how long a network wait may take.
pub const DEFAULT_TIMEOUT_MS: u64 = 15_000;
/// Default for FERRY_CONNECT_TIMEOUT_MS.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Default for FERRY_IDLE_TIMEOUT_S: a control or data connection with no
/// request for this long is closed (clients reconnect when they need it).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 120;
/// Default for FERRY_SPIN_US: how long a waiting thread polls before sleeping.
pub const DEFAULT_SPIN_US: u64 = 100;

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
            settings: BTreeMap::new(),
            loader: LoaderConfig::default(),
            topology: TopologyConfig::default(),
            metadata: MetadataConfig::P2p,
            name: None,
            auth_token: None,
            auth_off: false,
            auth_timeout: Duration::from_millis(admission::DEFAULT_AUTH_TIMEOUT_MS),
            auth_max_pending: admission::DEFAULT_MAX_PENDING,
            auth_max_pending_per_host: admission::DEFAULT_MAX_PENDING_PER_SOURCE,
        }
    }
}

fn parse_ms(var: &str, value: &str) -> Result<Duration> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|v| *v > 0)
        .map(Duration::from_millis)
        .ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("{var}={value:?} is not a positive number of milliseconds"),
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

fn parse_seconds(var: &str, value: &str) -> Result<Duration> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|v| (1..=86_400).contains(v))
        .map(Duration::from_secs)
        .ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("{var}={value:?} is not a number of seconds (1 to 86400)"),
            )
        })
}

fn parse_us(var: &str, value: &str) -> Result<Duration> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|v| *v <= 1_000_000)
        .map(Duration::from_micros)
        .ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("{var}={value:?} is not a number of microseconds (0 to 1000000)"),
            )
        })
}

impl EngineConfig {
    /// Defaults overridden by FERRY_LISTEN, FERRY_HOSTNAME, FERRY_TIMEOUT_MS,
    /// FERRY_CONNECT_TIMEOUT_MS and the loader's variables.
    pub fn from_env() -> Result<EngineConfig> {
        let mut c = EngineConfig {
            loader: LoaderConfig::from_env(),
            topology: TopologyConfig::from_env(),
            ..EngineConfig::default()
        };
        if let Ok(v) = std::env::var("FERRY_LISTEN") {
            c.listen = v;
        }
        if let Ok(v) = std::env::var("FERRY_HOSTNAME") {
            if !v.trim().is_empty() {
                c.hostname = Some(v.trim().to_string());
            }
        }
        if let Ok(v) = std::env::var("FERRY_TIMEOUT_MS") {
            c.timeout = parse_ms("FERRY_TIMEOUT_MS", &v)?;
        }
        if let Ok(v) = std::env::var("FERRY_CONNECT_TIMEOUT_MS") {
            c.connect_timeout = parse_ms("FERRY_CONNECT_TIMEOUT_MS", &v)?;
        }
        if let Ok(v) = std::env::var("FERRY_SPIN_US") {
            c.spin = parse_us("FERRY_SPIN_US", &v)?;
        }
        if let Ok(v) = std::env::var("FERRY_METADATA") {
            c.set("metadata", &v)?;
        }
        for (var, key) in [
            ("FERRY_IDLE_TIMEOUT_S", "idle_timeout_s"),
            ("FERRY_METADATA_PREFIX", "metadata_prefix"),
            ("FERRY_METADATA_TTL_S", "metadata_ttl_s"),
            ("FERRY_NAME", "name"),
            ("FERRY_AUTH_TOKEN_FILE", "auth_token_file"),
            ("FERRY_AUTH_TOKEN", "auth_token"),
            ("FERRY_AUTH", "auth"),
            ("FERRY_AUTH_TIMEOUT_MS", "auth_timeout_ms"),
            ("FERRY_AUTH_MAX_PENDING", "auth_max_pending"),
            (
                "FERRY_AUTH_MAX_PENDING_PER_HOST",
                "auth_max_pending_per_host",
            ),
        ] {
            if let Ok(v) = std::env::var(var) {
                c.set(key, &v)?;
            }
        }
        Ok(c)
    }

    /// Sets one option by name, as the C API and tools do: `listen`,
    /// `hostname`, `timeout_ms`, `connect_timeout_ms`, `plugin_path`
    /// (colon list, searched first), `transports` (allow/deny list), or a
    /// plugin setting such as `tcp.connections`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "listen" => self.listen = value.to_string(),
            "hostname" => self.hostname = Some(value.to_string()).filter(|v| !v.is_empty()),
            "timeout_ms" => self.timeout = parse_ms("timeout_ms", value)?,
            "connect_timeout_ms" => self.connect_timeout = parse_ms("connect_timeout_ms", value)?,
            "idle_timeout_s" => self.idle_timeout = parse_seconds("idle_timeout_s", value)?,
            "spin_us" => self.spin = parse_us("spin_us", value)?,
            "metadata" => {
                // Keep a prefix or TTL set before the store.
                let old = std::mem::take(&mut self.metadata);
                self.metadata = MetadataConfig::parse(value)?;
                if let (
                    MetadataConfig::Etcd { prefix, ttl_s, .. },
                    MetadataConfig::Etcd {
                        prefix: p,
                        ttl_s: t,
                        ..
                    },
                ) = (&mut self.metadata, old)
                {
                    *prefix = p;
                    *ttl_s = t;
                }
            }
            "metadata_prefix" | "metadata_ttl_s" => {
                if let MetadataConfig::Etcd { prefix, ttl_s, .. } = &mut self.metadata {
                    if key == "metadata_prefix" {
                        let v = value.trim();
                        if v.is_empty() || v.contains(char::is_whitespace) {
                            return Err(Error::new(
                                ErrorCode::InvalidArgument,
                                format!("metadata_prefix {value:?}: expected a key prefix such as /ferry/cluster-a"),
                            ));
                        }
                        *prefix = format!("/{}", v.trim_matches('/'));
                    } else {
                        *ttl_s = value
                            .trim()
                            .parse::<u64>()
                            .ok()
                            .filter(|t| (2..=3600).contains(t))
                            .ok_or_else(|| {
                                Error::new(
                                    ErrorCode::InvalidArgument,
                                    format!(
                                        "metadata_ttl_s {value:?}: expected seconds, 2 to 3600"
                                    ),
                                )
                            })?;
                    }
                } else {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("{key} applies to a metadata store: set metadata (FERRY_METADATA) to etcd://host:port first"),
                    ));
                }
            }
            "auth_token" => self.auth_token = Token::new(value),
            "auth_token_file" => {
                let text = std::fs::read_to_string(value).map_err(|e| {
                    Error::new(
                        ErrorCode::InvalidArgument,
                        format!("auth token file {value}: {e}"),
                    )
                })?;
                self.auth_token = Some(
                    Token::new(text.lines().next().unwrap_or("")).ok_or_else(|| {
                        Error::new(
                            ErrorCode::InvalidArgument,
                            format!("auth token file {value} is empty"),
                        )
                    })?,
                );
            }
            "auth_timeout_ms" => self.auth_timeout = parse_ms("auth_timeout_ms", value)?,
            // FERRY_INTEGRITY, read by the transports: headers or payload.
            "integrity" => match value.trim() {
                "headers" | "payload" => {
                    self.settings.insert("integrity".into(), value.trim().into());
                }
                other => {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("integrity {other:?}: expected headers or payload"),
                    ))
                }
            },
            "auth_max_pending" | "auth_max_pending_per_host" => {
                let n = value
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=100_000).contains(n))
                    .ok_or_else(|| {
                        Error::new(
                            ErrorCode::InvalidArgument,
                            format!("{key} {value:?}: expected a count, 1 to 100000"),
                        )
                    })?;
                if key == "auth_max_pending" {
                    self.auth_max_pending = n;
                } else {
                    self.auth_max_pending_per_host = n;
                }
            }
            "auth" => {
                self.auth_off = match value.trim() {
                    "off" => true,
                    "" | "on" | "required" => false,
                    other => {
                        return Err(Error::new(
                            ErrorCode::InvalidArgument,
                            format!("auth {other:?}: expected required or off"),
                        ))
                    }
                }
            }
            "name" => {
                let v = value.trim();
                if v.is_empty() || v.len() > 200 || v.chars().any(|c| c.is_control() || c == '/') {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("segment name {value:?}: 1 to 200 characters, no '/' or control characters"),
                    ));
                }
                self.name = Some(v.to_string());
            }
            "plugin_path" => {
                let mut dirs: Vec<_> = std::env::split_paths(value)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect();
                dirs.extend(std::mem::take(&mut self.loader.plugin_path));
                self.loader.plugin_path = dirs;
            }
            "transports" => self.loader.transports = NameFilter::parse(value),
            "plugin_probe_timeout_ms" => {
                self.loader.probe_timeout = parse_ms("plugin_probe_timeout_ms", value)?
            }
            "plugin_probe_helper" => self.loader.probe_helper = HelperChoice::parse(value),
            "plugin_cache" => self.loader.cache = CacheChoice::parse(value),
            "nics" => self.topology.nic_filter = Some(value.to_string()).filter(|v| !v.is_empty()),
            "sysfs_root" => self.topology.sysfs_root = value.into(),
            "topology_file" => {
                self.topology.topology_file = Some(value.into()).filter(|_| !value.is_empty())
            }
            k if k.contains('.') && !k.starts_with('.') && !k.ends_with('.') => {
                self.settings.insert(k.to_string(), value.to_string());
            }
            _ => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "unknown option {key:?}: expected listen, hostname, timeout_ms, \
                         connect_timeout_ms, idle_timeout_s, spin_us, plugin_path, transports, \
                         plugin_probe_timeout_ms, plugin_probe_helper, plugin_cache, nics, sysfs_root, \
                         topology_file, metadata, metadata_prefix, metadata_ttl_s, name, auth_token, \
                         auth_token_file, auth, auth_timeout_ms, auth_max_pending, \
                         auth_max_pending_per_host, integrity, \
                         or a plugin setting such as tcp.connections"
                    ),
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_by_name() {
        let mut c = EngineConfig::default();
        c.set("timeout_ms", "250").unwrap();
        assert_eq!(c.timeout, Duration::from_millis(250));
        c.set("tcp.connections", "3").unwrap();
        assert_eq!(c.settings["tcp.connections"], "3");
        c.set("transports", "^rdma").unwrap();
        assert!(!c.loader.transports.as_ref().unwrap().allows("rdma"));
        assert!(c.set("timeout_ms", "soon").is_err());
        assert!(c.set("timeout_ms", "0").is_err());
        c.set("idle_timeout_s", "30").unwrap();
        assert_eq!(c.idle_timeout, Duration::from_secs(30));
        assert!(c.set("idle_timeout_s", "0").is_err());
        assert!(c
            .set("colour", "blue")
            .unwrap_err()
            .message
            .contains("unknown option"));
    }
}
