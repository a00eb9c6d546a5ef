//! The SDK for plugins written in Rust.
//!
//! A Rust plugin implements [`TransportPlugin`] (or [`DevicePlugin`]) with
//! safe code and exports it with [`export_transport_plugin!`]
//! (or [`export_device_plugin!`]). The macro generates the C entry symbol and
//! a table of `extern "C"` trampolines; every trampoline runs the plugin's code
//! inside [`boundary`], which turns a returned [`PluginError`] into a status
//! code plus message and a panic into `FERRY_ERR_PANIC` plus the panic's
//! message. No unwinding ever crosses the ABI.
//!
//! ```ignore
//! struct Tcp;
//! impl ferry_plugins_abi::sdk::TransportPlugin for Tcp {
//!     const NAME: &'static CStr = c"tcp";
//!     const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
//!     const DESCRIPTION: &'static CStr = c"TCP sockets";
//!     fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> { Ok(()) }
//! }
//! ferry_plugins_abi::export_transport_plugin!(Tcp);
//! ```

pub mod admission;
pub mod auth;
mod blocks;
mod boundary;
pub mod deadline;
mod device;
mod device_info;
pub mod gate;
mod host;
mod layouts;
pub mod local;
pub mod net;
mod op;
mod transport;
pub use blocks::*;
pub use boundary::*;
pub use device::*;
pub use device_info::*;
pub use host::*;
pub use layouts::*;
pub use op::*;
pub use transport::*;
