//! Where segments are found by name: peer to peer (the default: a segment's
//! name is its control address, "host:port", and nothing else runs), or an
//! etcd cluster (FERRY_METADATA=etcd://host:port[,host:port...]).
//!
//! With etcd, an engine stores its descriptor under
//! `<prefix>/segments/<name>` with a lease it keeps alive, so a dead
//! engine's segment disappears when the lease expires (FERRY_METADATA_TTL_S).
//! Registering or unregistering memory publishes the descriptor again.
//! Peers do not watch: they read a descriptor when they open a segment and
//! read it again when a request falls outside the buffers they know ("re-read
//! on a miss"), the only moment a stale copy matters — a buffer that was
//! unregistered is refused by its owner anyway. No watch stream per peer,
//! and nothing to resynchronise after an etcd outage.
//!
//! If etcd goes away, transfers to segments already open keep working (they
//! need only the peers); a keeper task retries with back-off and, when etcd
//! is back (even wiped), grants a new lease and stores the descriptor again.

use crate::error::{Error, ErrorCode, Result};
use etcd_client::{Client, ConnectOptions, GetOptions, PutOptions};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// Default for FERRY_METADATA_PREFIX.
pub const DEFAULT_PREFIX: &str = "/ferry";
/// Default for FERRY_METADATA_TTL_S.
pub const DEFAULT_TTL_S: u64 = 10;

/// Which metadata store an engine uses.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum MetadataConfig {
    /// Segment names are control addresses; nothing else runs.
    #[default]
    P2p,
    /// An etcd cluster: its endpoints ("http://host:port").
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
        ttl_s: u64,
    },
}

impl MetadataConfig {
    /// Parses FERRY_METADATA: `p2p` (also empty or `P2PHANDSHAKE`, the
    /// reference engine's word) or `etcd://host:port[,host:port...]`.
    pub fn parse(text: &str) -> Result<MetadataConfig> {
        let t = text.trim();
        if t.is_empty() || t.eq_ignore_ascii_case("p2p") || t.eq_ignore_ascii_case("P2PHANDSHAKE") {
            return Ok(MetadataConfig::P2p);
        }
        let Some(rest) = t.strip_prefix("etcd://") else {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("metadata store {t:?}: expected p2p or etcd://host:port[,host:port...]"),
            ));
        };
        let mut endpoints = Vec::new();
        for e in rest.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let e = e.trim_end_matches('/');
            let (host, port) = e.rsplit_once(':').ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("etcd endpoint {e:?}: expected host:port"),
                )
            })?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("etcd endpoint {e:?}: expected host:port"),
                ));
            }
            endpoints.push(format!("http://{e}"));
        }
        if endpoints.is_empty() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "etcd:// names no endpoint",
            ));
        }
        Ok(MetadataConfig::Etcd {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            ttl_s: DEFAULT_TTL_S,
        })
    }

    pub fn is_p2p(&self) -> bool {
        *self == MetadataConfig::P2p
    }
}

/// What this engine keeps published, and the lease that keeps it alive.
struct Published {
    /// Segment name -> descriptor JSON.
    entries: Vec<(String, Vec<u8>)>,
    /// The live lease, or None while etcd is unreachable.
    lease: Option<i64>,
    /// Entries changed while they could not be stored.
    dirty: bool,
    /// False while the keeper cannot reach etcd: publishing then leaves the
    /// work to the keeper instead of waiting for a timeout.
    reachable: bool,
}

/// An engine's connection to etcd.
pub struct EtcdStore {
    runtime: tokio::runtime::Runtime,
    client: Client,
    endpoints: String,
    prefix: String,
    ttl_s: u64,
    timeout: Duration,
    state: Arc<Mutex<Published>>,
    stop: tokio::sync::watch::Sender<bool>,
}

fn etcd_error(what: &str, endpoints: &str, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorCode::Connection,
        format!("{what} etcd at {endpoints}: {e}"),
    )
}

impl EtcdStore {
    /// Connects and checks that etcd answers; an engine that asked for etcd
    /// and cannot reach it does not start.
    pub fn connect(config: &MetadataConfig, timeout: Duration) -> Result<Arc<EtcdStore>> {
        let MetadataConfig::Etcd {
            endpoints,
            prefix,
            ttl_s,
        } = config
        else {
            return Err(Error::new(ErrorCode::Internal, "not an etcd configuration"));
        };
        let shown = endpoints
            .iter()
            .map(|e| e.trim_start_matches("http://"))
            .collect::<Vec<_>>()
            .join(",");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferry-etcd")
            .enable_all()
            .build()
            .map_err(|e| Error::new(ErrorCode::NoMemory, format!("etcd runtime: {e}")))?;
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let client = runtime.block_on(async {
            let connected = tokio::time::timeout(
                timeout * 2,
                Client::connect(endpoints.clone(), Some(options)),
            )
            .await
            .map_err(|_| etcd_error("cannot reach", &shown, "timed out"))?
            .map_err(|e| etcd_error("cannot reach", &shown, e))?;
            let mut probe = connected.clone();
            tokio::time::timeout(timeout * 2, probe.status())
                .await
                .map_err(|_| etcd_error("cannot reach", &shown, "timed out"))?
                .map_err(|e| etcd_error("cannot reach", &shown, e))?;
            Ok::<_, Error>(connected)
        })?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let store = Arc::new(EtcdStore {
            runtime,
            client,
            endpoints: shown,
            prefix: prefix.trim_end_matches('/').to_string(),
            ttl_s: (*ttl_s).max(2),
            timeout,
            state: Arc::new(Mutex::new(Published {
                entries: Vec::new(),
                lease: None,
                dirty: false,
                reachable: true,
            })),
            stop,
        });
        store.runtime.spawn(keeper(
            store.client.clone(),
            store.state.clone(),
            store.key_prefix(),
            store.ttl_s,
            store.endpoints.clone(),
            stopped,
        ));
        log::info!(
            "metadata: etcd at {} (keys under {}/, lease {} s)",
            store.endpoints,
            store.prefix,
            store.ttl_s
        );
        Ok(store)
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    fn key_prefix(&self) -> String {
        format!("{}/segments/", self.prefix)
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.key_prefix())
    }

    /// Stores (or replaces) a segment's descriptor under this engine's
    /// lease. Waits for etcd when it is up; when it is not, the keeper
    /// stores it once etcd is back.
    pub fn publish(&self, name: &str, descriptor: Vec<u8>) -> Result<()> {
        let lease = {
            let mut st = self.state.lock();
            match st.entries.iter_mut().find(|(n, _)| n == name) {
                Some(e) => e.1 = descriptor.clone(),
                None => st.entries.push((name.to_string(), descriptor.clone())),
            }
            st.dirty = true;
            if !st.reachable {
                return Err(etcd_error(
                    "cannot register with",
                    &self.endpoints,
                    "unreachable; registering again when it is back",
                ));
            }
            st.lease
        };
        let mut client = self.client.clone();
        let lease = match lease {
            Some(l) => l,
            None => {
                // First publication, or etcd was lost: grant now if it answers.
                let granted = self.runtime.block_on(async {
                    tokio::time::timeout(self.timeout, client.lease_grant(self.ttl_s as i64, None))
                        .await
                });
                match granted {
                    Ok(Ok(r)) => {
                        self.state.lock().lease = Some(r.id());
                        r.id()
                    }
                    Ok(Err(e)) => {
                        return Err(etcd_error("cannot register with", &self.endpoints, e))
                    }
                    Err(_) => {
                        return Err(etcd_error(
                            "cannot register with",
                            &self.endpoints,
                            "timed out",
                        ))
                    }
                }
            }
        };
        let key = self.key(name);
        let put = self.runtime.block_on(async {
            tokio::time::timeout(
                self.timeout,
                client.put(key, descriptor, Some(PutOptions::new().with_lease(lease))),
            )
            .await
        });
        match put {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(etcd_error(
                "cannot store a descriptor in",
                &self.endpoints,
                e,
            )),
            Err(_) => Err(etcd_error(
                "cannot store a descriptor in",
                &self.endpoints,
                "timed out",
            )),
        }
    }

    /// A segment's descriptor, or None when no live engine has that name.
    pub fn fetch(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let mut client = self.client.clone();
        let key = self.key(name);
        let got = self
            .runtime
            .block_on(async { tokio::time::timeout(self.timeout, client.get(key, None)).await });
        match got {
            Ok(Ok(r)) => Ok(r.kvs().first().map(|kv| kv.value().to_vec())),
            Ok(Err(e)) => Err(etcd_error("cannot read from", &self.endpoints, e)),
            Err(_) => Err(etcd_error("cannot read from", &self.endpoints, "timed out")),
        }
    }

    /// Every segment stored under the prefix: (name, descriptor JSON).
    pub fn list(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let mut client = self.client.clone();
        let prefix = self.key_prefix();
        let got = self.runtime.block_on(async {
            tokio::time::timeout(
                self.timeout,
                client.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await
        });
        let r = match got {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Err(etcd_error("cannot read from", &self.endpoints, e)),
            Err(_) => return Err(etcd_error("cannot read from", &self.endpoints, "timed out")),
        };
        Ok(r.kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                Some((key.strip_prefix(&prefix)?.to_string(), kv.value().to_vec()))
            })
            .collect())
    }

    /// Removes this engine's segments now (on a clean shutdown), rather
    /// than when the lease expires.
    pub fn withdraw(&self) {
        let lease = {
            let mut st = self.state.lock();
            st.entries.clear();
            st.lease.take()
        };
        let _ = self.stop.send(true);
        if let Some(id) = lease {
            let mut client = self.client.clone();
            let _ = self.runtime.block_on(async {
                tokio::time::timeout(self.timeout, client.lease_revoke(id)).await
            });
        }
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.withdraw();
    }
}

/// Keeps the lease alive; when etcd is lost, retries with back-off and
/// stores every entry again under a new lease once it answers.
async fn keeper(
    mut client: Client,
    state: Arc<Mutex<Published>>,
    prefix: String,
    ttl_s: u64,
    endpoints: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let tick = Duration::from_millis((ttl_s * 1000 / 3).max(500));
    let mut backoff = Duration::from_millis(250);
    let mut lost = false;
    loop {
        if *stop.borrow() {
            return;
        }
        let step = refresh(&mut client, &state, &prefix, ttl_s).await;
        let wait = match step {
            Ok(()) => {
                state.lock().reachable = true;
                if lost {
                    log::info!("metadata: etcd at {endpoints} is back; segments registered again");
                    lost = false;
                }
                backoff = Duration::from_millis(250);
                tick
            }
            Err(e) => {
                state.lock().reachable = false;
                if !lost {
                    log::warn!(
                        "metadata: lost etcd at {endpoints} ({e}); transfers to open segments \
                         continue, registration is retried"
                    );
                    lost = true;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                backoff
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One round of the keeper: renew the lease (or grant one and store every
/// entry when it is gone or the entries changed).
async fn refresh(
    client: &mut Client,
    state: &Mutex<Published>,
    prefix: &str,
    ttl_s: u64,
) -> std::result::Result<(), String> {
    let timeout = Duration::from_secs(ttl_s.clamp(1, 5));
    let (lease, dirty, entries) = {
        let st = state.lock();
        (st.lease, st.dirty, st.entries.clone())
    };
    if entries.is_empty() {
        return Ok(());
    }
    let alive = match lease {
        Some(id) => {
            let renewed = tokio::time::timeout(timeout, async {
                let (mut keeper, mut stream) = client.lease_keep_alive(id).await?;
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            // A TTL of 0 or "lease not found" means etcd no longer knows the
            // lease (it expired, or etcd lost its data): grant a new one. An
            // unreachable etcd fails the grant below as well.
            matches!(renewed, Ok(Ok(Some(r))) if r.ttl() > 0)
        }
        None => false,
    };
    if !alive {
        state.lock().lease = None;
    }
    if alive && !dirty {
        return Ok(());
    }
    let id = if alive {
        lease.unwrap_or_default()
    } else {
        let r = tokio::time::timeout(timeout, client.lease_grant(ttl_s as i64, None))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| e.to_string())?;
        state.lock().lease = Some(r.id());
        r.id()
    };
    for (name, value) in entries {
        tokio::time::timeout(
            timeout,
            client.put(
                format!("{prefix}{name}"),
                value,
                Some(PutOptions::new().with_lease(id)),
            ),
        )
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    }
    state.lock().dirty = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_urls() {
        assert!(MetadataConfig::parse("").unwrap().is_p2p());
        assert!(MetadataConfig::parse("P2PHANDSHAKE").unwrap().is_p2p());
        match MetadataConfig::parse("etcd://10.0.0.1:2379, 10.0.0.2:2379/").unwrap() {
            MetadataConfig::Etcd { endpoints, .. } => {
                assert_eq!(endpoints, ["http://10.0.0.1:2379", "http://10.0.0.2:2379"])
            }
            other => panic!("{other:?}"),
        }
        for bad in [
            "etcd://",
            "etcd://host",
            "etcd://host:port",
            "zk://a:1",
            "etcd://:1",
        ] {
            assert!(MetadataConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
