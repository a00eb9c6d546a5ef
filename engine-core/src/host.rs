//! The services Ferry offers plugins (logging, configuration, topology),
//! implemented over the engine's configuration.

use ferry_loader::{config_env_var, HostServices};
use ferry_plugins_abi::sdk::Nic;
use ferry_plugins_abi::ErrorCode;
use std::collections::BTreeMap;

/// Host services backed by explicit settings, then the environment.
#[derive(Clone, Debug, Default)]
pub struct CoreHost {
    settings: BTreeMap<String, String>,
}

impl CoreHost {
    /// `settings` override the environment: key "tcp.connections" is looked
    /// up here first, then as FERRY_TCP_CONNECTIONS.
    pub fn new(settings: BTreeMap<String, String>) -> CoreHost {
        CoreHost { settings }
    }
}

impl HostServices for CoreHost {
    fn config(&self, key: &str) -> Option<String> {
        self.settings
            .get(key)
            .cloned()
            .or_else(|| std::env::var(config_env_var(key)).ok())
    }

    fn nics(&self, _location: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
        Ok(Vec::new())
    }
}
