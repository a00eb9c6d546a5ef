//! A peer's keys made usable before a copy, outside the copy lock (the
//! socket reader may need it meanwhile): a mapped key's memfd mapped once,
//! a cross-memory key's registration confirmed live once per connection.

use crate::endpoint::Key;
use crate::{memory, ShmPeer};
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::sync::Arc;
use std::time::Duration;

impl ShmPeer {
    /// Makes `key` usable for copies: maps a mapped key's memory, or
    /// confirms a cross-memory key's registration still exists.
    pub(crate) fn ensure_usable(&self, key: &Key, timeout: Duration) -> PluginResult<()> {
        match *key {
            Key::Map { token, .. } => self.ensure_mapped(token, timeout),
            Key::Cma { id, .. } => self.ensure_live(id, timeout),
        }
    }

    /// The mapping of allocation `token`, mapping it on first use. Called
    /// without the copy lock (the socket reader may need it meanwhile).
    fn ensure_mapped(&self, token: u64, timeout: Duration) -> PluginResult<()> {
        if self
            .state
            .copying
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .mappings
            .contains_key(&token)
        {
            return Ok(());
        }
        let (fd, len) = self.client.map(token, timeout).map_err(|e| {
            PluginError::new(ErrorCode::OutOfBounds, format!("shm: {}: {e}", self.name))
        })?;
        let mapping = memory::map(&fd, len).map_err(|e| {
            PluginError::new(ErrorCode::Protocol, format!("shm: {}: {e}", self.name))
        })?;
        self.state
            .copying
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .mappings
            .entry(token)
            .or_insert_with(|| Arc::new(mapping));
        Ok(())
    }

    /// Asks the owner, once per connection, whether a cross-memory key's
    /// registration still exists. A revocation reaches only connections
    /// the owner lists, so a key read before this connection opened (a
    /// stale descriptor) could name memory unregistered since: gone, it
    /// counts as revoked, and its requests are refused.
    fn ensure_live(&self, id: u64, timeout: Duration) -> PluginResult<()> {
        {
            let mem = self.state.copying.read().unwrap_or_else(|p| p.into_inner());
            if mem.live.contains(&id) || mem.revoked.contains(&id) {
                return Ok(());
            }
        }
        let live = self.client.live(id, timeout).map_err(|e| {
            PluginError::new(ErrorCode::Connection, format!("shm: {}: {e}", self.name))
        })?;
        let mut mem = self
            .state
            .copying
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if live {
            mem.live.insert(id);
        } else {
            mem.revoked.insert(id);
        }
        Ok(())
    }
}
