//! Ferry's engine: it resolves which memory a buffer is and which NICs are
//! near it, offers plugins their host services, selects a transport for each
//! request and moves bytes through it.
//!
//! Layering: plugins-abi < loader, topology, metadata < engine-core <
//! capi / cli / python. Nothing here calls upward.
//!
//! ```no_run
//! use ferry_core::{Engine, EngineConfig, Op, Request};
//! let target = Engine::new(EngineConfig::from_env()?)?;
//! let initiator = Engine::new(EngineConfig::from_env()?)?;
//! let mut remote = vec![0u8; 4096];
//! let local = vec![7u8; 4096];
//! target.register_memory(remote.as_mut_ptr() as u64, 4096, None)?;
//! initiator.register_memory(local.as_ptr() as u64, 4096, None)?;
//! let seg = initiator.open_segment(target.segment_name())?;
//! initiator.transfer_sync(&[Request::new(Op::Write, local.as_ptr() as u64, seg,
//!                                        remote.as_ptr() as u64, 4096)])?;
//! # Ok::<(), ferry_core::Error>(())
//! ```

pub mod batch;
mod batch_status;
pub mod config;
mod config_keys;
#[cfg(feature = "testing")]
pub mod control;
#[cfg(not(feature = "testing"))]
mod control;
mod control_budget;
mod control_conn;
mod control_serve;
#[cfg(feature = "testing")]
pub mod control_server;
#[cfg(not(feature = "testing"))]
mod control_server;
mod counters;
#[cfg(feature = "testing")]
pub mod descriptor;
#[cfg(not(feature = "testing"))]
mod descriptor;
mod device;
pub mod engine;
pub mod error;
mod gpu;
mod gpudirect;
#[cfg(feature = "testing")]
pub mod host;
#[cfg(not(feature = "testing"))]
mod host;
mod host_plan;
mod id_map;
#[cfg(feature = "testing")]
pub mod identity;
#[cfg(not(feature = "testing"))]
mod identity;
pub mod info;
pub mod location;
mod memory;
pub mod metrics;
pub mod notify;
mod shared_memory;
#[cfg(feature = "testing")]
pub mod transport;
#[cfg(not(feature = "testing"))]
mod transport;
pub mod user_token;

pub use batch::{BatchId, BatchStatus, NotifyStatus, RequestStatus};
pub use config::EngineConfig;
pub use engine::{
    BlockLayout, BlockTransfer, Engine, LayoutId, Op, Request, Route, RouteEstimate, RouteNic,
    Scope, SegmentId,
};
pub use error::{Error, ErrorCode, Result};
pub use ferry_loader as loader;
pub use ferry_metadata as metadata;
pub use ferry_topology as topology;
pub use host::load_plugins;
pub use location::Location;
pub use notify::{Notification, Notify};

/// Logging to stderr, filtered by FERRY_LOG (env_logger syntax, default
/// `warn`), with millisecond timestamps: what the `ferry` binary, the C
/// API, the Python module and the test programs set up. Once per process;
/// a logger the application installed first stays (this one is then not
/// installed).
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ =
            env_logger::Builder::from_env(env_logger::Env::new().filter_or("FERRY_LOG", "warn"))
                .format_timestamp_millis()
                .try_init();
    });
}
