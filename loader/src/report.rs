//! What the loader says about each plugin file, and the outcome of loading
//! and probing one, wherever that ran (a child process, this process, the
//! cache). An [`Outcome`] crosses process boundaries and is stored on disk,
//! so it is checked as hostile input whenever it is read back.

use crate::config::DirOrigin;
use ferry_plugins_abi::caps;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Discovered,
    Loaded,
    Probed,
}

/// Where a plugin's probe result came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbeSource {
    /// Loaded and probed now, in a child process (the ferry-probe helper).
    ChildProcess,
    /// Loaded and probed now, in this process (no helper).
    ThisProcess,
    /// A result an earlier probe of the same file, on this boot, with the
    /// same configuration, left in the cache.
    Cache,
}

impl ProbeSource {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeSource::ChildProcess => "probed in a child process",
            ProbeSource::ThisProcess => "probed in this process",
            ProbeSource::Cache => "cached probe result",
        }
    }
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
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bandwidth_mbps: Option<u64>,
    /// A small request's completion time, ns, as declared (ABI 1.2).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub latency_ns: Option<u32>,
    /// A device plugin's GPU as device_info would describe it (ABI 1.6);
    /// `ferry info` shows it in its GPU section.
    #[serde(skip)]
    pub gpu: Option<ferry_plugins_abi::sdk::DeviceInfo>,
}

/// A capability the host lacks, with the plugin's reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingCapability {
    pub capability: String,
    pub reason: String,
}

/// One way a plugin registers a kind of memory, and whether it works here
/// (ABI 1.5): what the engine decides GPU-memory registration from, by the
/// bit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryMethod {
    /// One FERRY_MEM_* bit.
    #[serde(rename = "bit")]
    pub kind: u64,
    /// The bit's name (`cuda-dmabuf`, ...), for people.
    pub memory: String,
    pub available: bool,
    /// How it works, or why it does not.
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    pub memory_methods: Vec<MemoryMethod>,
    pub notes: Vec<Note>,
    pub load_us: Option<u64>,
    pub probe_us: Option<u64>,
    /// Where the probe result came from; null when it never got that far.
    pub probe_source: Option<ProbeSource>,
    /// Files of the same kind and name later in the search path that this
    /// plugin hides.
    pub shadows: Vec<PathBuf>,
}

/// Longest plugin string kept (names, versions, device details...).
pub const MAX_PLUGIN_STRING: usize = 256;
/// Longest reason kept: ours, with the plugin's message inside.
pub const MAX_REASON: usize = 4096;
/// Most devices, missing capabilities or notes kept from one probe, so a
/// runaway plugin cannot exhaust memory through the sink.
pub const MAX_PROBE_ITEMS: usize = 4096;

/// A device as a probe reported it, with its memory kinds as bits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbedDevice {
    pub name: String,
    pub pci: Option<String>,
    pub numa: Option<i32>,
    pub detail: Option<String>,
    pub mem_kinds: u64,
    /// Declared by ABI 1.2 plugins; absent in older cache entries.
    #[serde(default)]
    pub bandwidth_mbps: Option<u64>,
    #[serde(default)]
    pub latency_ns: Option<u32>,
    /// A device plugin's GPU, as device_info would describe it (ABI 1.6).
    #[serde(default)]
    pub gpu: Option<ferry_plugins_abi::sdk::DeviceInfo>,
}

/// What loading and probing one plugin file produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub enabled: bool,
    pub stage: Stage,
    pub reason: String,
    pub version: Option<String>,
    pub description: Option<String>,
    pub abi: Option<String>,
    pub mem_kinds: u64,
    pub scopes: u32,
    pub devices: Vec<ProbedDevice>,
    pub missing: Vec<MissingCapability>,
    /// Absent in cache entries of plugins probed before ABI 1.5.
    #[serde(default)]
    pub memory_methods: Vec<MemoryMethod>,
    pub notes: Vec<Note>,
    pub load_us: Option<u64>,
    pub probe_us: Option<u64>,
    /// For a probe that did not finish in time: the limit it had (ms). A
    /// later start with a longer limit probes again.
    pub timed_out_after_ms: Option<u64>,
}

impl Outcome {
    /// A plugin refused before or while loading, or by its probe.
    pub fn disabled(stage: Stage, reason: String) -> Outcome {
        Outcome {
            enabled: false,
            stage,
            reason,
            version: None,
            description: None,
            abi: None,
            mem_kinds: 0,
            scopes: 0,
            devices: Vec::new(),
            missing: Vec::new(),
            memory_methods: Vec::new(),
            notes: Vec::new(),
            load_us: None,
            probe_us: None,
            timed_out_after_ms: None,
        }
    }

    /// Checks an outcome read from a child process or the cache: every
    /// string and list within the bounds this process would have kept
    /// itself, and an enabled plugin must have been probed. `Err` says what
    /// is wrong.
    pub fn check(&self) -> Result<(), String> {
        let short = |what: &str, s: &str| {
            if s.chars().count() > MAX_PLUGIN_STRING {
                Err(format!("{what} longer than {MAX_PLUGIN_STRING} characters"))
            } else {
                Ok(())
            }
        };
        if self.reason.chars().count() > MAX_REASON {
            return Err(format!("reason longer than {MAX_REASON} characters"));
        }
        for (what, s) in [
            ("version", &self.version),
            ("description", &self.description),
            ("abi", &self.abi),
        ] {
            if let Some(s) = s {
                short(what, s)?;
            }
        }
        if self.devices.len() > MAX_PROBE_ITEMS
            || self.missing.len() > MAX_PROBE_ITEMS
            || self.notes.len() > MAX_PROBE_ITEMS
            || self.memory_methods.len() > MAX_PROBE_ITEMS
        {
            return Err(format!("more than {MAX_PROBE_ITEMS} items in a list"));
        }
        for d in &self.devices {
            short("device name", &d.name)?;
            for s in [&d.pci, &d.detail].into_iter().flatten() {
                short("device field", s)?;
            }
            if let Some(g) = &d.gpu {
                for s in [&g.name, &g.pci_bus_id, &g.uuid] {
                    short("GPU field", s)?;
                }
            }
        }
        for m in &self.missing {
            short("capability", &m.capability)?;
            short("capability reason", &m.reason)?;
        }
        for m in &self.memory_methods {
            if m.kind.count_ones() != 1 {
                return Err(format!(
                    "a memory method of {:#x}, not one memory kind",
                    m.kind
                ));
            }
            short("memory method", &m.memory)?;
            short("memory method detail", &m.detail)?;
        }
        for n in &self.notes {
            short("note key", &n.key)?;
            short("note value", &n.value)?;
        }
        if self.enabled && self.stage != Stage::Probed {
            return Err("an enabled plugin that was not probed".into());
        }
        Ok(())
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: caps::mem_kind_names(self.mem_kinds),
            scopes: caps::scope_names(self.scopes),
            mem_bits: self.mem_kinds,
            scope_bits: self.scopes,
        }
    }

    pub(crate) fn device_reports(&self) -> Vec<DeviceReport> {
        self.devices
            .iter()
            .map(|d| DeviceReport {
                name: d.name.clone(),
                pci: d.pci.clone(),
                numa: d.numa,
                detail: d.detail.clone(),
                memory: caps::mem_kind_names(d.mem_kinds),
                mem_bits: d.mem_kinds,
                bandwidth_mbps: d.bandwidth_mbps,
                latency_ns: d.latency_ns,
                gpu: d.gpu.clone(),
            })
            .collect()
    }
}

/// Keeps at most `max` characters of a plugin string.
pub fn bounded(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_out_of_bounds_are_refused() {
        let mut o = Outcome::disabled(Stage::Probed, "no".into());
        assert!(o.check().is_ok());
        o.version = Some("x".repeat(MAX_PLUGIN_STRING + 1));
        assert!(o.check().unwrap_err().contains("version"));
        let mut o = Outcome::disabled(Stage::Loaded, "x".into());
        o.enabled = true;
        assert!(o.check().is_err());
    }
}
