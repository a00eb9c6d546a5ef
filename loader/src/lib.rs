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
//! dlopen, and every reason is kept for `ferry info`. Once a plugin's code
//! runs (constructors, its entry function, probe) it is trusted not to crash
//! the process; Rust plugins built with the SDK cannot unwind into the host.
//!
//! This crate sits between plugins-abi (below) and engine-core (above).

mod config;
mod elf;
mod host;
mod self_location;

pub use config::{
    normalize_name, DirOrigin, LoaderConfig, NameFilter, SearchEntry, DEFAULT_PROBE_TIMEOUT_MS,
};
pub use elf::parse_entry_symbol;
pub use host::{config_env_var, EnvHost, HostServices};
pub use self_location::containing_object;

use ferry_plugins_abi::sys;
use ferry_plugins_abi::{caps, has_field, ErrorCode};
use host::ServicesTable;
use serde::Serialize;
use std::ffi::{c_char, c_void, CStr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginKind {
    Transport,
    Device,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Transport => "transport",
            PluginKind::Device => "device",
        }
    }

    fn entry_symbol_v1(self) -> &'static str {
        match self {
            PluginKind::Transport => sys::FERRY_TRANSPORT_PLUGIN_V1_SYMBOL,
            PluginKind::Device => sys::FERRY_DEVICE_PLUGIN_V1_SYMBOL,
        }
    }
}

/// Where a plugin ended up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginState {
    Enabled,
    Disabled,
    Shadowed,
}

impl PluginState {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginState::Enabled => "enabled",
            PluginState::Disabled => "disabled",
            PluginState::Shadowed => "shadowed",
        }
    }
}

/// How far a plugin got before its final state was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Discovered,
    Loaded,
    Probed,
}

/// A device a plugin said it would use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceReport {
    pub name: String,
    pub pci: Option<String>,
    pub numa: Option<i32>,
    pub detail: Option<String>,
    pub memory: Vec<String>,
    /// The `FERRY_MEM_*` bits behind `memory`.
    #[serde(skip)]
    pub mem_bits: u64,
    /// What the device sustains for one peer, Mbit/s, as the plugin declared
    /// it (ABI 1.2); `None`: not declared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth_mbps: Option<u64>,
    /// A small request's completion time, ns, as declared (ABI 1.2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u32>,
}

/// A capability the host lacks, with the plugin's reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MissingCapability {
    pub capability: String,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Note {
    pub key: String,
    pub value: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    pub memory: Vec<String>,
    pub scopes: Vec<String>,
    #[serde(skip)]
    pub mem_bits: u64,
    #[serde(skip)]
    pub scope_bits: u32,
}

/// Everything `ferry info` says about one plugin file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PluginReport {
    pub name: String,
    pub kind: PluginKind,
    pub state: PluginState,
    pub stage: Stage,
    pub reason: String,
    pub path: PathBuf,
    pub origin: DirOrigin,
    pub version: Option<String>,
    pub description: Option<String>,
    pub abi: Option<String>,
    pub capabilities: Capabilities,
    pub devices: Vec<DeviceReport>,
    pub missing: Vec<MissingCapability>,
    pub notes: Vec<Note>,
    pub load_us: Option<u64>,
    pub probe_us: Option<u64>,
}

/// A plugin's table, by kind.
#[derive(Clone, Copy)]
enum Table {
    Transport(*const sys::ferry_transport_plugin_v1_t),
    Device(*const sys::ferry_device_plugin_v1_t),
}

/// A loaded plugin library with its validated table and its services table.
/// Dropping the last reference unloads the library.
pub struct LoadedLibrary {
    table: Table,
    services: ServicesTable,
    // Declared last: the library is closed only after everything above,
    // which may point into it, is dropped.
    _library: libloading::Library,
}

// SAFETY: the table is immutable static data inside the library, which stays
// loaded as long as this struct lives; the ABI requires plugins to accept
// calls from any thread (plugin.h, "Threads").
unsafe impl Send for LoadedLibrary {}
// SAFETY: as above.
unsafe impl Sync for LoadedLibrary {}

impl LoadedLibrary {
    /// The transport table, validated to be ABI v1 and at least v1.0's size.
    pub fn transport_table(&self) -> Option<&sys::ferry_transport_plugin_v1_t> {
        match self.table {
            // SAFETY: validated non-null when loaded and kept alive by _library.
            Table::Transport(t) => Some(unsafe { &*t }),
            Table::Device(_) => None,
        }
    }

    /// The device table, validated to be ABI v1 and at least v1.0's size.
    pub fn device_table(&self) -> Option<&sys::ferry_device_plugin_v1_t> {
        match self.table {
            // SAFETY: validated non-null when loaded and kept alive by _library.
            Table::Device(t) => Some(unsafe { &*t }),
            Table::Transport(_) => None,
        }
    }

    /// The services table this plugin was given; valid while `self` lives.
    pub fn services(&self) -> *const sys::ferry_host_services_t {
        self.services.as_ptr()
    }
}

/// One plugin file, its report, and (when enabled) the loaded library.
pub struct Plugin {
    pub report: PluginReport,
    library: Option<Arc<LoadedLibrary>>,
}

impl Plugin {
    pub fn is_enabled(&self) -> bool {
        self.report.state == PluginState::Enabled
    }

    /// The library, for enabled plugins.
    pub fn library(&self) -> Option<&Arc<LoadedLibrary>> {
        self.library.as_ref()
    }
}

/// The outcome of one discovery pass.
pub struct PluginSet {
    pub search_path: Vec<SearchEntry>,
    pub transports_filter: Option<String>,
    pub plugins: Vec<Plugin>,
    pub warnings: Vec<String>,
}

impl PluginSet {
    /// Discovers, checks, loads and probes every plugin on the search path.
    /// Never fails: every problem becomes a plugin's reason or a warning.
    pub fn load(config: &LoaderConfig, host: Arc<dyn HostServices>) -> PluginSet {
        let search_path = config.search_path();
        let mut warnings = Vec::new();
        let candidates = discover(&search_path, &mut warnings);
        let mut plugins: Vec<Plugin> = Vec::with_capacity(candidates.len());
        for cand in candidates {
            let plugin = decide(&cand, &plugins, config, &host);
            log_decision(&plugin.report);
            plugins.push(plugin);
        }
        if let Some(filter) = &config.transports {
            if !filter.is_deny_list() {
                for name in filter.names() {
                    let known = plugins.iter().any(|p| {
                        p.report.kind == PluginKind::Transport
                            && normalize_name(&p.report.name) == *name
                    });
                    if !known {
                        let w = format!(
                            "FERRY_TRANSPORTS={} names '{name}', which no plugin file provides",
                            filter.spec()
                        );
                        log::warn!("{w}");
                        warnings.push(w);
                    }
                }
            }
        }
        PluginSet {
            search_path,
            transports_filter: config.transports.as_ref().map(|f| f.spec().to_string()),
            plugins,
            warnings,
        }
    }

    pub fn enabled(&self, kind: PluginKind) -> impl Iterator<Item = &Plugin> {
        self.plugins
            .iter()
            .filter(move |p| p.is_enabled() && p.report.kind == kind)
    }

    pub fn find(&self, kind: PluginKind, name: &str) -> Option<&Plugin> {
        let name = normalize_name(name);
        self.plugins
            .iter()
            .find(|p| p.report.kind == kind && normalize_name(&p.report.name) == name)
    }
}

fn log_decision(r: &PluginReport) {
    log::info!(
        "{} plugin '{}' {}: {} ({})",
        r.kind.as_str(),
        r.name,
        r.state.as_str(),
        r.reason,
        r.path.display()
    );
}

/// A file that looks like a plugin by its name.
#[derive(Clone, Debug)]
struct Candidate {
    path: PathBuf,
    origin: DirOrigin,
    kind: PluginKind,
    name: String,
}

/// `libferry_transport_tcp.so` -> (Transport, "tcp").
fn parse_file_name(file_name: &str) -> Option<(PluginKind, String)> {
    let stem = file_name.strip_prefix("libferry_")?.strip_suffix(".so")?;
    let (kind, name) = if let Some(n) = stem.strip_prefix("transport_") {
        (PluginKind::Transport, n)
    } else if let Some(n) = stem.strip_prefix("device_") {
        (PluginKind::Device, n)
    } else {
        return None;
    };
    if name.is_empty() {
        return None;
    }
    Some((kind, normalize_name(name)))
}

fn discover(search_path: &[SearchEntry], warnings: &mut Vec<String>) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut seen_files: Vec<(u64, u64)> = Vec::new();
    let mut add = |path: PathBuf, origin: DirOrigin, out: &mut Vec<Candidate>| {
        let Some(file_name) = path.file_name().and_then(|f| f.to_str()) else {
            return false;
        };
        let Some((kind, name)) = parse_file_name(file_name) else {
            return false;
        };
        // The same file reached twice (a directory listed twice, a symlink)
        // is one plugin, not a shadowing pair.
        if let Ok(meta) = std::fs::metadata(&path) {
            let id = (meta.dev(), meta.ino());
            if seen_files.contains(&id) {
                return true;
            }
            seen_files.push(id);
        }
        out.push(Candidate {
            path,
            origin,
            kind,
            name,
        });
        true
    };
    for entry in search_path.iter().filter(|e| e.exists) {
        if entry.path.is_file() {
            if !add(entry.path.clone(), entry.origin, &mut out) {
                let w = format!(
                    "{} is on FERRY_PLUGIN_PATH but its name is not \
                     libferry_transport_<name>.so or libferry_device_<name>.so; skipped",
                    entry.path.display()
                );
                log::warn!("{w}");
                warnings.push(w);
            }
            continue;
        }
        let read = match std::fs::read_dir(&entry.path) {
            Ok(r) => r,
            Err(e) => {
                let w = format!("cannot list {}: {e}", entry.path.display());
                log::warn!("{w}");
                warnings.push(w);
                continue;
            }
        };
        let mut files: Vec<PathBuf> = read
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for f in files {
            if !add(f.clone(), entry.origin, &mut out) {
                log::debug!("ignoring {} (not named like a plugin)", f.display());
            }
        }
    }
    out
}

fn report_for(cand: &Candidate, state: PluginState, stage: Stage, reason: String) -> PluginReport {
    PluginReport {
        name: cand.name.clone(),
        kind: cand.kind,
        state,
        stage,
        reason,
        path: cand.path.clone(),
        origin: cand.origin,
        version: None,
        description: None,
        abi: None,
        capabilities: Capabilities::default(),
        devices: Vec::new(),
        missing: Vec::new(),
        notes: Vec::new(),
        load_us: None,
        probe_us: None,
    }
}

fn disabled(cand: &Candidate, stage: Stage, reason: String) -> Plugin {
    Plugin {
        report: report_for(cand, PluginState::Disabled, stage, reason),
        library: None,
    }
}

fn decide(
    cand: &Candidate,
    earlier: &[Plugin],
    config: &LoaderConfig,
    host: &Arc<dyn HostServices>,
) -> Plugin {
    if let Some(first) = earlier
        .iter()
        .find(|p| p.report.kind == cand.kind && normalize_name(&p.report.name) == cand.name)
    {
        return Plugin {
            report: report_for(
                cand,
                PluginState::Shadowed,
                Stage::Discovered,
                format!(
                    "shadowed by {}, a {} plugin of the same name earlier in the search path",
                    first.report.path.display(),
                    cand.kind.as_str()
                ),
            ),
            library: None,
        };
    }
    if cand.kind == PluginKind::Transport {
        if let Some(filter) = &config.transports {
            if !filter.allows(&cand.name) {
                return disabled(
                    cand,
                    Stage::Discovered,
                    format!("excluded by FERRY_TRANSPORTS={}", filter.spec()),
                );
            }
        }
    }

    let started = Instant::now();
    let loaded = match load(cand, host) {
        Ok(l) => l,
        Err(reason) => return disabled(cand, Stage::Discovered, reason),
    };
    let load_us = elapsed_us(started);
    let mut report = report_for(cand, PluginState::Disabled, Stage::Loaded, String::new());
    report.load_us = Some(load_us);
    let (version, description, abi) = table_strings(&loaded);
    report.version = Some(version);
    report.description = Some(description);
    report.abi = Some(abi);

    let started = Instant::now();
    let outcome = probe_with_timeout(&loaded, config.probe_timeout);
    report.probe_us = Some(elapsed_us(started));
    match outcome {
        ProbeOutcome::TimedOut => {
            report.reason = format!(
                "probe did not return within {} ms (FERRY_PLUGIN_PROBE_TIMEOUT_MS); \
                 the plugin is not used",
                config.probe_timeout.as_millis()
            );
            // The probe thread still runs plugin code: keep the library
            // loaded (the thread holds a reference) and hand out nothing.
            Plugin {
                report,
                library: None,
            }
        }
        ProbeOutcome::Returned {
            status,
            message,
            findings,
        } => {
            report.stage = Stage::Probed;
            report.capabilities = Capabilities {
                memory: caps::mem_kind_names(findings.mem_kinds),
                scopes: caps::scope_names(findings.scopes),
                mem_bits: findings.mem_kinds,
                scope_bits: findings.scopes,
            };
            report.devices = findings.devices;
            report.missing = findings.missing;
            report.notes = findings.notes;
            if status == sys::FERRY_OK {
                report.state = PluginState::Enabled;
                report.reason = enabled_reason(&report);
                Plugin {
                    report,
                    library: Some(loaded),
                }
            } else {
                let message = if message.is_empty() {
                    "(the plugin gave no reason)".to_string()
                } else {
                    message
                };
                report.reason = match ErrorCode::from_raw(status) {
                    Some(ErrorCode::Unavailable) => message,
                    Some(ErrorCode::Panic) => {
                        format!("probe panicked: {}", strip_panic_prefix(&message))
                    }
                    Some(code) => format!("probe failed with {code}: {message}"),
                    None => format!("probe failed with unknown status {status}: {message}"),
                };
                Plugin {
                    report,
                    library: None,
                }
            }
        }
    }
}

fn strip_panic_prefix(msg: &str) -> &str {
    msg.strip_prefix("plugin panicked: ").unwrap_or(msg)
}

fn enabled_reason(r: &PluginReport) -> String {
    let mut parts = vec!["probe passed".to_string()];
    if !r.capabilities.memory.is_empty() {
        parts.push(format!("moves {} memory", r.capabilities.memory.join("/")));
    }
    if !r.capabilities.scopes.is_empty() {
        parts.push(format!("reaches {} peers", r.capabilities.scopes.join("/")));
    }
    match r.devices.len() {
        0 => {}
        1 => parts.push("1 device".into()),
        n => parts.push(format!("{n} devices")),
    }
    parts.join("; ")
}

fn elapsed_us(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// An error and its sources as one line: libloading puts dlerror()'s text
/// in the source, not in the top-level message.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

/// Explains a dlopen failure in operator words.
fn explain_dlopen_error(msg: &str, path: &Path) -> String {
    const NO_FILE: &str = ": cannot open shared object file";
    if let Some(idx) = msg.find(NO_FILE) {
        let before = &msg[..idx];
        let lib = before.rsplit(": ").next().unwrap_or(before).trim();
        let ours = path.to_string_lossy();
        if !lib.is_empty() && lib != ours {
            return format!(
                "needs {lib}, which is not installed on this host or not on the library \
                 search path (`ldd {}` lists what is missing)",
                path.display()
            );
        }
    }
    if let Some(idx) = msg.find("undefined symbol: ") {
        let sym = msg[idx + "undefined symbol: ".len()..]
            .split([' ', ','])
            .next()
            .unwrap_or("");
        return format!(
            "needs the symbol {sym}, which none of its libraries provide \
             (built against a different version of a dependency?)"
        );
    }
    if msg.contains("version `GLIBC_") {
        return format!("needs a newer C library than this host has: {msg}");
    }
    format!("the dynamic loader refused it: {msg}")
}

/// Opens the file and validates its table. `Err` carries the reason.
fn load(cand: &Candidate, host: &Arc<dyn HostServices>) -> Result<Arc<LoadedLibrary>, String> {
    let facts = elf::inspect(&cand.path)?;
    let wanted = cand.kind.entry_symbol_v1();
    if !facts.entry_symbols.iter().any(|s| s == wanted) {
        return Err(missing_entry_reason(cand, &facts.entry_symbols));
    }

    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    // SAFETY: loading a library runs its constructors; that is the trust we
    // extend to a plugin once its file passed the ELF checks above.
    let library = unsafe { libloading::os::unix::Library::open(Some(&cand.path), flags) }
        .map_err(|e| explain_dlopen_error(&error_chain(&e), &cand.path))?;
    let library: libloading::Library = library.into();

    let symbol_name = format!("{wanted}\0");
    let entry_addr: *const c_void = match cand.kind {
        PluginKind::Transport => {
            // SAFETY: the symbol has the entry function's type per plugin.h.
            let f = unsafe {
                library.get::<sys::ferry_transport_plugin_v1_entry_fn>(symbol_name.as_bytes())
            }
            .map_err(|e| format!("cannot resolve {wanted}: {e}"))?;
            *f as *const c_void
        }
        PluginKind::Device => {
            // SAFETY: the symbol has the entry function's type per plugin.h.
            let f = unsafe {
                library.get::<sys::ferry_device_plugin_v1_entry_fn>(symbol_name.as_bytes())
            }
            .map_err(|e| format!("cannot resolve {wanted}: {e}"))?;
            *f as *const c_void
        }
    };
    check_symbol_lives_in(entry_addr, &cand.path, wanted)?;

    let table = match cand.kind {
        PluginKind::Transport => {
            // SAFETY: entry_addr is the plugin's entry function, resolved
            // from this library, with the signature plugin.h declares.
            let entry: sys::ferry_transport_plugin_v1_entry_fn =
                unsafe { std::mem::transmute(entry_addr) };
            // SAFETY: calling the plugin's side-effect-free entry function.
            let t = unsafe { entry() };
            // SAFETY: a non-null table pointer stays valid while loaded.
            let t_ref = unsafe { t.as_ref() }.ok_or("its entry function returned no table")?;
            check_header(&t_ref.hdr, cand.kind)?;
            if !has_field!(t_ref, sys::ferry_transport_plugin_v1_t, probe) {
                return Err(format!(
                    "its table is {} bytes, too small for plugin ABI 1.0",
                    t_ref.hdr.struct_size
                ));
            }
            check_strings(t_ref.name, t_ref.version, t_ref.probe.is_some(), cand)?;
            Table::Transport(t)
        }
        PluginKind::Device => {
            // SAFETY: as for transports.
            let entry: sys::ferry_device_plugin_v1_entry_fn =
                unsafe { std::mem::transmute(entry_addr) };
            // SAFETY: calling the plugin's side-effect-free entry function.
            let t = unsafe { entry() };
            // SAFETY: a non-null table pointer stays valid while loaded.
            let t_ref = unsafe { t.as_ref() }.ok_or("its entry function returned no table")?;
            check_header(&t_ref.hdr, cand.kind)?;
            if !has_field!(t_ref, sys::ferry_device_plugin_v1_t, probe) {
                return Err(format!(
                    "its table is {} bytes, too small for plugin ABI 1.0",
                    t_ref.hdr.struct_size
                ));
            }
            check_strings(t_ref.name, t_ref.version, t_ref.probe.is_some(), cand)?;
            Table::Device(t)
        }
    };
    Ok(Arc::new(LoadedLibrary {
        table,
        services: ServicesTable::new(&cand.name, host.clone()),
        _library: library,
    }))
}

fn missing_entry_reason(cand: &Candidate, found: &[String]) -> String {
    let wanted = cand.kind.entry_symbol_v1();
    let same_kind: Vec<(&str, u32)> = found
        .iter()
        .filter_map(|s| parse_entry_symbol(s))
        .filter(|(k, _)| *k == cand.kind.as_str())
        .collect();
    if let Some((_, major)) = same_kind.first() {
        return format!(
            "built for plugin ABI v{major} (it exports ferry_{}_plugin_v{major}); this Ferry \
             speaks ABI v{}: use a build of the plugin for this Ferry",
            cand.kind.as_str(),
            sys::FERRY_PLUGIN_ABI_MAJOR
        );
    }
    if let Some(other) = found.first() {
        return format!(
            "its file name says {} plugin but it exports {other}; rename the file to match \
             what it is",
            cand.kind.as_str()
        );
    }
    format!(
        "exports no {wanted} entry symbol, so it is not a Ferry {} plugin \
         (`nm -D --defined-only` shows what it exports)",
        cand.kind.as_str()
    )
}

fn check_header(hdr: &sys::ferry_abi_header_t, kind: PluginKind) -> Result<(), String> {
    if hdr.abi_major != sys::FERRY_PLUGIN_ABI_MAJOR {
        return Err(format!(
            "its {} table says plugin ABI {}.{}, but this Ferry speaks {}.{} and the major \
             versions must match",
            kind.as_str(),
            hdr.abi_major,
            hdr.abi_minor,
            sys::FERRY_PLUGIN_ABI_MAJOR,
            sys::FERRY_PLUGIN_ABI_MINOR
        ));
    }
    Ok(())
}

/// Reads a plugin-provided C string, bounded in what we keep.
///
/// # Safety
/// `s` must be null or a NUL-terminated string that stays valid.
unsafe fn plugin_str(s: *const c_char) -> Option<String> {
    if s.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per the ABI.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    Some(text.chars().take(256).collect())
}

fn check_strings(
    name: *const c_char,
    version: *const c_char,
    has_probe: bool,
    cand: &Candidate,
) -> Result<(), String> {
    // SAFETY: strings in a validated table are C strings per the ABI.
    let name = unsafe { plugin_str(name) }.ok_or("its table has no name")?;
    // SAFETY: as above.
    if unsafe { plugin_str(version) }.is_none() {
        return Err("its table has no version".into());
    }
    if !has_probe {
        return Err("its table has no probe function (required)".into());
    }
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !valid {
        return Err(format!(
            "it calls itself {name:?}; a plugin name is 1-64 characters of a-z, 0-9, '-'"
        ));
    }
    if normalize_name(&name) != cand.name {
        return Err(format!(
            "it calls itself '{name}' but its file name says '{}'; rename the file to \
             libferry_{}_{name}.so",
            cand.name,
            cand.kind.as_str()
        ));
    }
    Ok(())
}

fn check_symbol_lives_in(addr: *const c_void, path: &Path, symbol: &str) -> Result<(), String> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables into `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) } != 0;
    if !ok || info.dli_fname.is_null() {
        return Err(format!("cannot tell which file defines {symbol}"));
    }
    // SAFETY: dladdr gave a NUL-terminated name owned by the loader.
    let fname = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    let same = match (std::fs::metadata(&fname), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(format!(
            "{symbol} resolves to {fname}, not to this file; refusing a plugin whose entry \
             point lives elsewhere"
        ))
    }
}

fn table_strings(lib: &LoadedLibrary) -> (String, String, String) {
    let (hdr, version, description) = match (lib.transport_table(), lib.device_table()) {
        (Some(t), _) => (t.hdr, t.version, t.description),
        (None, Some(t)) => (t.hdr, t.version, t.description),
        (None, None) => return Default::default(),
    };
    // SAFETY: strings of a validated table are C strings or null.
    let version = unsafe { plugin_str(version) }.unwrap_or_default();
    // SAFETY: as above.
    let description = unsafe { plugin_str(description) }.unwrap_or_default();
    (
        version,
        description,
        format!("{}.{}", hdr.abi_major, hdr.abi_minor),
    )
}

/// What probe reported through the sink.
#[derive(Default)]
struct ProbeFindings {
    mem_kinds: u64,
    scopes: u32,
    devices: Vec<DeviceReport>,
    missing: Vec<MissingCapability>,
    notes: Vec<Note>,
}

/// Bounds on what a probe may report, so a runaway plugin cannot exhaust
/// memory through the sink.
const MAX_PROBE_ITEMS: usize = 4096;

enum ProbeOutcome {
    Returned {
        status: sys::ferry_status_t,
        message: String,
        findings: ProbeFindings,
    },
    TimedOut,
}

fn probe_with_timeout(lib: &Arc<LoadedLibrary>, timeout: Duration) -> ProbeOutcome {
    let (tx, rx) = mpsc::channel();
    let lib2 = lib.clone();
    let spawned = std::thread::Builder::new()
        .name("ferry-probe".into())
        .spawn(move || {
            let outcome = run_probe(&lib2);
            let _ = tx.send(outcome);
        });
    if let Err(e) = spawned {
        // No thread to spare: probe on this one, without the timeout.
        log::debug!("cannot start a probe thread ({e}); probing inline");
        return run_probe(lib);
    }
    match rx.recv_timeout(timeout) {
        Ok(outcome) => outcome,
        Err(_) => ProbeOutcome::TimedOut,
    }
}

fn run_probe(lib: &LoadedLibrary) -> ProbeOutcome {
    let probe = match lib.table {
        Table::Transport(_) => lib.transport_table().and_then(|t| t.probe),
        Table::Device(_) => lib.device_table().and_then(|t| t.probe),
    };
    let Some(probe) = probe else {
        return ProbeOutcome::Returned {
            status: sys::FERRY_ERR_ABI_MISMATCH,
            message: "no probe function".into(),
            findings: ProbeFindings::default(),
        };
    };
    let findings = Mutex::new(ProbeFindings::default());
    let sink = sys::ferry_probe_sink_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_probe_sink_t>(),
        ctx: (&findings as *const Mutex<ProbeFindings>)
            .cast_mut()
            .cast::<c_void>(),
        set_capabilities: Some(sink_set_capabilities),
        add_device: Some(sink_add_device),
        add_missing: Some(sink_add_missing),
        add_note: Some(sink_add_note),
    };
    let mut buf = vec![0u8; 2048];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr().cast::<c_char>(),
        cap: buf.len(),
    };
    // SAFETY: every pointer handed to probe (services, sink, err) is valid for
    // the whole call: services lives in `lib`, sink/findings/buf on this stack.
    let status = unsafe { probe(lib.services(), &sink, &mut err) };
    // Whatever the plugin wrote, keep it inside the buffer.
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    let message = CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    let findings = findings.into_inner().unwrap_or_else(|e| e.into_inner());
    ProbeOutcome::Returned {
        status,
        message: message.trim().to_string(),
        findings,
    }
}

/// # Safety
/// `ctx` must be the sink ctx set up by `run_probe`.
unsafe fn findings<'a>(ctx: *mut c_void) -> Option<&'a Mutex<ProbeFindings>> {
    // SAFETY: ctx points at the Mutex on run_probe's stack, alive for the
    // whole probe call, which is the only time the sink may be used.
    unsafe { ctx.cast::<Mutex<ProbeFindings>>().cast_const().as_ref() }
}

/// # Safety
/// `s` must be null or a NUL-terminated string.
unsafe fn sink_str(s: *const c_char) -> Option<String> {
    // SAFETY: forwarded contract.
    unsafe { plugin_str(s) }
}

unsafe extern "C" fn sink_set_capabilities(ctx: *mut c_void, mem_kinds: u64, scopes: u32) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink.
        if let Some(f) = unsafe { findings(ctx) } {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            f.mem_kinds = mem_kinds;
            f.scopes = scopes;
        }
    }));
}

unsafe extern "C" fn sink_add_device(ctx: *mut c_void, device: *const sys::ferry_probe_device_t) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; device is null or valid for the call.
        let (Some(f), Some(d)) = (unsafe { findings(ctx) }, unsafe { device.as_ref() }) else {
            return;
        };
        // ABI 1.0 devices end at mem_kinds; the 1.2 fields are read only
        // when the plugin's struct covers them.
        let covers = |end: usize| d.struct_size as usize >= end;
        if !covers(std::mem::offset_of!(sys::ferry_probe_device_t, mem_kinds) + 8) {
            return;
        }
        let declared = covers(std::mem::offset_of!(sys::ferry_probe_device_t, latency_ns) + 4);
        // SAFETY: the device's strings are null or C strings per the ABI.
        let name = unsafe { sink_str(d.name) };
        let Some(name) = name else { return };
        let report = DeviceReport {
            name,
            // SAFETY: as above.
            pci: unsafe { sink_str(d.pci_bus_id) },
            numa: (d.numa_node >= 0).then_some(d.numa_node),
            // SAFETY: as above.
            detail: unsafe { sink_str(d.detail) },
            memory: caps::mem_kind_names(d.mem_kinds),
            mem_bits: d.mem_kinds,
            bandwidth_mbps: (declared && d.bandwidth_mbps > 0).then_some(d.bandwidth_mbps),
            latency_ns: (declared && d.latency_ns > 0).then_some(d.latency_ns),
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.devices.len() < MAX_PROBE_ITEMS {
            f.devices.push(report);
        }
    }));
}

unsafe extern "C" fn sink_add_missing(
    ctx: *mut c_void,
    capability: *const c_char,
    reason: *const c_char,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; strings are C strings per the ABI.
        let (Some(f), Some(capability), Some(reason)) = (
            unsafe { findings(ctx) },
            unsafe { sink_str(capability) },
            unsafe { sink_str(reason) },
        ) else {
            return;
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.missing.len() < MAX_PROBE_ITEMS {
            f.missing.push(MissingCapability { capability, reason });
        }
    }));
}

unsafe extern "C" fn sink_add_note(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; strings are C strings per the ABI.
        let (Some(f), Some(key), Some(value)) =
            (unsafe { findings(ctx) }, unsafe { sink_str(key) }, unsafe {
                sink_str(value)
            })
        else {
            return;
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.notes.len() < MAX_PROBE_ITEMS {
            f.notes.push(Note { key, value });
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names() {
        assert_eq!(
            parse_file_name("libferry_transport_tcp.so"),
            Some((PluginKind::Transport, "tcp".into()))
        );
        assert_eq!(
            parse_file_name("libferry_transport_rdma_peermem.so"),
            Some((PluginKind::Transport, "rdma-peermem".into()))
        );
        assert_eq!(
            parse_file_name("libferry_device_cuda.so"),
            Some((PluginKind::Device, "cuda".into()))
        );
        assert_eq!(parse_file_name("libferry.so"), None);
        assert_eq!(parse_file_name("libferry_transport_.so"), None);
        assert_eq!(parse_file_name("libferry_test_plugin_panics.so"), None);
        assert_eq!(parse_file_name("libferry_transport_tcp.so.1"), None);
    }

    #[test]
    fn dlopen_errors_name_the_missing_library() {
        let p = Path::new("/x/libferry_transport_a.so");
        let r = explain_dlopen_error(
            "libfoo.so.1: cannot open shared object file: No such file or directory",
            p,
        );
        assert!(r.starts_with("needs libfoo.so.1,"), "{r}");
        let r = explain_dlopen_error("/x/libferry_transport_a.so: undefined symbol: bar_v2", p);
        assert!(r.contains("needs the symbol bar_v2"), "{r}");
    }
}
