//! Finds Ferry plugins, checks them before loading, loads and probes them,
//! and says why any of them is not used.
//!
//! Every plugin file goes through the same stages:
//!
//! ```text
//! discovered --(ELF check, dlopen, entry symbol, table check)--> loaded
//!            --(probe, within a timeout)--> probed --> enabled | disabled(reason)
//! discovered --(same name earlier in the search path)--> shadowed
//! discovered --(FERRY_TRANSPORTS)--> disabled("excluded by ...")
//! ```
//!
//! Nothing a plugin file can contain makes this crate panic or abort the
//! process before its own code runs: the ELF headers are checked before
//! dlopen, and every reason is kept for `ferry info`. The first time a
//! plugin's code runs (constructors, its entry function, probe) is in a
//! short-lived child process, the `ferry-probe` helper (isolate.rs, and
//! child.rs inside the helper): a plugin that crashes or hangs there is
//! disabled with the signal or the timeout as its reason and is never
//! loaded into the application. Results are cached (cache.rs), so a warm
//! start spawns nothing. Where no helper is installed, plugins are loaded
//! and probed in this process, one at a time, each announced in the log
//! first ("loading <path>", "probing <path>", at info).
//!
//! This crate sits between plugins-abi (below) and engine-core (above).
//!
//! Files, lowest first: `report` (what is said about a plugin), `config`,
//! `discover` (files by name), `elf`, `fingerprint`, `library` (dlopen and
//! the table), `probe`, `protocol` (child <-> application), `asked`,
//! `child`, `isolate`, `guard`, `helper`, `cache`, `set` (one pass), and
//! `escape` for printing plugin strings.

mod asked;
mod cache;
mod child;
mod config;
mod discover;
mod elf;
pub mod escape;
mod fingerprint;
mod guard;
mod helper;
mod host;
mod isolate;
mod library;
mod probe;
mod protocol;
mod report;
mod self_location;
mod set;

pub use child::helper_main as probe_helper_main;
pub use config::{
    normalize_name, CacheChoice, DirOrigin, HelperChoice, LoaderConfig, NameFilter, SearchEntry,
    DEFAULT_PROBE_TIMEOUT_MS,
};
pub use elf::parse_entry_symbol;
pub use helper::HELPER_NAME;
pub use host::{config_env_var, EnvHost, HostServices};
pub use library::{missing_device_functions, missing_transport_functions, LoadedLibrary};
pub use report::{
    Capabilities, DeviceReport, MemoryMethod, MissingCapability, Note, PluginKind, PluginReport,
    PluginState, ProbeSource, Stage,
};
pub use self_location::containing_object;
pub use set::{Isolation, Plugin, PluginSet, ProbeSetup};
