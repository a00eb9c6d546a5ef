//! Ferry's engine: it resolves which memory a buffer is and which NICs are
//! near it, offers plugins their host services, and (as the data-path work
//! lands) selects a transport and moves bytes.
//!
//! Layering: plugins-abi < loader < engine-core < capi / cli. Nothing here
//! calls upward.

pub mod error;
pub mod host;
pub mod info;

pub use error::{Error, ErrorCode, Result};
pub use ferry_loader as loader;

use std::sync::Arc;

/// Loads every plugin the configuration finds, with host services backed by
/// `host`. Never fails; see each plugin's state and reason.
pub fn load_plugins(config: &loader::LoaderConfig, host: host::CoreHost) -> loader::PluginSet {
    loader::PluginSet::load(config, Arc::new(host))
}
