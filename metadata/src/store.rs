//! An engine's (or a tool's) handle on etcd: look segments up and list
//! them, and publish this engine's own through its keeper.

use super::auth::Credentials;
use super::config::MetadataConfig;
use super::gateway;
use super::keeper::Keeper;
use super::pool::Pool;
use super::tls::Tls;
use crate::error::{Error, ErrorCode, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct EtcdStore {
    pool: Arc<Pool>,
    keeper: Keeper,
    shown: String,
    /// "`<prefix>/segments/`"
    key_prefix: String,
    /// The deadline of every call.
    timeout: Duration,
}

impl EtcdStore {
    /// A store for `config`'s endpoints. Nothing is sent yet: a process
    /// that only looks segments up needs nothing else, and one whose etcd
    /// is down at start still starts (its calls say why they fail).
    pub fn connect(config: &MetadataConfig, timeout: Duration) -> Result<Arc<EtcdStore>> {
        let MetadataConfig::Etcd {
            endpoints,
            prefix,
            ttl_s,
            access,
        } = config
        else {
            return Err(Error::new(ErrorCode::Internal, "not an etcd configuration"));
        };
        let key_prefix = format!("{}/segments/", prefix.trim_end_matches('/'));
        let tls = Tls::load(access)?;
        let creds = Credentials::load(access)?;
        let pool = Arc::new(Pool::new(endpoints, tls, creds, key_prefix.clone()));
        let ttl_s = (*ttl_s).max(2);
        let shown = pool.shown();
        log::info!(
            "metadata: etcd at {shown} over {} (keys under {key_prefix}, lease {ttl_s} s \
             renewed every {:?}, {timeout:?} deadline per call)",
            pool.describe(),
            Duration::from_millis(ttl_s * 1000 / 3)
        );
        Ok(Arc::new(EtcdStore {
            keeper: Keeper::new(pool.clone(), key_prefix.clone(), ttl_s, timeout),
            pool,
            shown,
            key_prefix,
            timeout,
        }))
    }

    /// "host:port,host:port"
    pub fn endpoints(&self) -> &str {
        &self.shown
    }

    /// Stores (or replaces) a segment's descriptor under this engine's
    /// lease (see keeper.rs). An error leaves the keeper retrying.
    pub fn publish(&self, name: &str, descriptor: Vec<u8>) -> Result<()> {
        self.keeper.publish(name, descriptor)
    }

    /// A segment's descriptor, or None when no live engine has that name.
    pub fn fetch(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let key = format!("{}{name}", self.key_prefix);
        let found = gateway::range(
            &self.pool,
            key.as_bytes(),
            false,
            false,
            Instant::now() + self.timeout,
        )
        .map_err(|e| e.to_error(&format!("cannot look up segment {name:?} in etcd")))?;
        Ok(found.into_iter().next().map(|kv| kv.value))
    }

    /// Every segment stored under the prefix: (name, descriptor JSON).
    pub fn list(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let found = gateway::range(
            &self.pool,
            self.key_prefix.as_bytes(),
            true,
            false,
            Instant::now() + self.timeout,
        )
        .map_err(|e| e.to_error("cannot list segments in etcd"))?;
        Ok(found
            .into_iter()
            .filter_map(|kv| {
                let key = String::from_utf8(kv.key).ok()?;
                Some((key.strip_prefix(&self.key_prefix)?.to_string(), kv.value))
            })
            .collect())
    }

    /// Removes this engine's segments now (on a clean shutdown), rather
    /// than when the lease expires.
    pub fn withdraw(&self) {
        self.keeper.withdraw();
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.withdraw();
    }
}
