//! What `ferry info` reports: this build's versions, the settings in
//! effect, where plugins were looked for, every plugin file with its state
//! and the reason for it, and GPUs with their registration decision.
//! [`report`] builds it; `ferry info`, `ferry_info_json()` (C) and
//! `ferry.info()` (Python) all call it and nothing else, so they agree.
//! The JSON shape is documented in docs/info-json.md; keep the two in step.

use crate::config::EngineConfig;
use crate::gpudirect::{self, HostFacts, Policy};
use crate::host_plan::{HostPlan, PlannedGpu};
use ferry_loader::escape::for_terminal as esc;
use ferry_loader::{
    Isolation, PluginKind, PluginReport, PluginSet, PluginState, ProbeSetup, SearchEntry,
};
use ferry_topology::{Gpu as TopoGpu, Topology};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// Ferry's own version.
pub const FERRY_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Clone, Debug, Serialize)]
pub struct InfoReport {
    pub ferry_version: String,
    pub abi_version: String,
    /// Every engine setting in effect (EngineConfig::effective: secrets as
    /// "(set)"), and the plugin settings given.
    pub config: BTreeMap<String, String>,
    pub search_path: Vec<SearchEntry>,
    pub transports_filter: Option<String>,
    /// Where plugins were loaded and probed (a child process or this one)
    /// and the cache of results.
    pub probing: ProbeSetup,
    pub plugins: Vec<PluginReport>,
    /// GPUs and how their memory would be registered (see `with_gpus`).
    pub gpus: Vec<GpuReport>,
    pub gpu_direct: Option<GpuDirectReport>,
    pub warnings: Vec<String>,
}

/// The `ferry info` report for an engine configured by `config`: topology
/// from its sysfs root, plugins loaded and probed as an engine would load
/// them (the same search path, filter and settings), GPUs and the
/// GPU-direct decision under its `gpu_direct` policy, and warnings about
/// settings that expose memory. `reprobe` ignores cached probe results.
/// The one source of `ferry info`, `ferry_info_json()` and `ferry.info()`.
pub fn report(config: &EngineConfig, reprobe: bool) -> InfoReport {
    let mut warnings = Vec::new();
    let topology = match Topology::discover(&config.topology) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            warnings.push(format!("topology: {e}"));
            None
        }
    };
    let loader = ferry_loader::LoaderConfig {
        reprobe,
        ..config.loader.clone()
    };
    let host = crate::host::CoreHost::new(config.plugin_settings(None), topology.clone());
    let set = crate::host::load_plugins(&loader, host);
    let mut report =
        InfoReport::from_plugins(&set).with_gpus(&set, topology.as_deref(), config.gpu_direct);
    report.config = config.effective();
    report.warnings.extend(warnings);
    report.warnings.extend(security_warnings(config));
    report
}

/// [`report`] for the engine the environment configures: a FERRY_* value
/// that is rejected is the error (with its reason), not a report of some
/// other configuration.
pub fn report_from_env(reprobe: bool) -> crate::Result<InfoReport> {
    Ok(report(&EngineConfig::from_env()?, reprobe))
}

/// What these settings would expose: a listener other hosts can reach
/// without an auth token.
fn security_warnings(config: &EngineConfig) -> Vec<String> {
    let host = config
        .listen
        .rsplit_once(':')
        .map_or(config.listen.as_str(), |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match (loopback, config.auth_token.is_some(), config.auth_off) {
        (false, false, true) => vec![format!(
            "FERRY_LISTEN={} is reachable from other hosts and FERRY_AUTH=off: engines accept \
             anyone who can reach the port (set FERRY_AUTH_TOKEN)",
            config.listen
        )],
        (false, false, false) => vec![format!(
            "FERRY_LISTEN={} is reachable from other hosts and no FERRY_AUTH_TOKEN is set: \
             engines will refuse to start until one is (or FERRY_AUTH=off)",
            config.listen
        )],
        (true, false, true) => vec![
            "FERRY_AUTH=off: every local user's processes can read and write the memory \
             engines register (unset it to use this user's token)"
                .to_string(),
        ],
        _ => Vec::new(),
    }
}

impl InfoReport {
    pub fn from_plugins(set: &PluginSet) -> InfoReport {
        InfoReport {
            ferry_version: FERRY_VERSION.to_string(),
            abi_version: ferry_plugins_abi::abi_version(),
            config: BTreeMap::new(),
            search_path: set.search_path.clone(),
            transports_filter: set.transports_filter.clone(),
            probing: set.probing.clone(),
            plugins: set.plugins.iter().map(|p| p.report.clone()).collect(),
            gpus: Vec::new(),
            gpu_direct: None,
            warnings: set.warnings.clone(),
        }
    }

    /// The report as JSON text: plugin strings exact, and characters a
    /// terminal would act on written as `\uXXXX` escapes.
    pub fn to_json_text(&self, pretty: bool) -> crate::Result<String> {
        ferry_loader::escape::to_json(self, pretty).map_err(|e| {
            crate::Error::new(
                crate::ErrorCode::Internal,
                format!("cannot serialise the report: {e}"),
            )
        })
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(
            |e| serde_json::json!({ "error": format!("cannot serialise the report: {e}") }),
        )
    }

    /// The human-readable report. Every string that came from a plugin is
    /// escaped: a plugin cannot move the cursor, clear the screen or forge a
    /// line of this report.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "Ferry {}, plugin ABI {}",
            self.ferry_version, self.abi_version
        );
        let _ = writeln!(out, "\nPlugin search path (first match of a name wins):");
        if self.search_path.is_empty() {
            let _ = writeln!(out, "  (empty)");
        }
        for (i, e) in self.search_path.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {}. {}  [{}{}]",
                i + 1,
                e.path.display(),
                e.origin.as_str(),
                if e.exists { "" } else { ", does not exist" }
            );
        }
        if let Some(f) = &self.transports_filter {
            let _ = writeln!(out, "FERRY_TRANSPORTS={}", esc(f));
        }
        render_settings(&mut out, &self.config);
        render_probing(&mut out, &self.probing);
        let enabled = self
            .plugins
            .iter()
            .filter(|p| p.state == PluginState::Enabled)
            .count();
        let _ = writeln!(
            out,
            "\nPlugins: {} found, {} enabled",
            self.plugins.len(),
            enabled
        );
        if self.plugins.is_empty() {
            let _ = writeln!(
                out,
                "  none: put plugins in one of the directories above or name them in \
                 FERRY_PLUGIN_PATH"
            );
        }
        for p in &self.plugins {
            render_plugin(&mut out, p);
        }
        render_gpus(&mut out, self);
        if !self.warnings.is_empty() {
            let _ = writeln!(out, "\nWarnings:");
            for w in &self.warnings {
                let _ = writeln!(out, "  - {}", esc(w));
            }
        }
        out
    }
}

/// The settings that differ from the defaults (all of them are in the JSON).
fn render_settings(out: &mut String, config: &BTreeMap<String, String>) {
    let defaults = EngineConfig::default().effective();
    let changed: Vec<_> = config
        .iter()
        .filter(|(k, v)| defaults.get(*k) != Some(*v))
        .collect();
    if changed.is_empty() {
        let _ = writeln!(out, "\nSettings: all defaults (docs/configuration.md)");
        return;
    }
    let _ = writeln!(out, "\nSettings other than the defaults:");
    for (k, v) in changed {
        let _ = writeln!(out, "  {k} = {}", esc(v));
    }
}

fn render_probing(out: &mut String, p: &ProbeSetup) {
    match (p.isolation, &p.helper) {
        (Isolation::ChildProcess, Some(h)) => {
            let _ = writeln!(
                out,
                "\nPlugins are first loaded and probed in a child process ({}): one that \
                 crashes or hangs is disabled, not this process.",
                h.display()
            );
        }
        _ => {
            let _ = writeln!(
                out,
                "\nPlugins are loaded and probed in this process ({}): one that crashes takes \
                 the process down; FERRY_LOG=info names each plugin before Ferry calls into it.",
                esc(p.why_this_process.as_deref().unwrap_or("no helper"))
            );
        }
    }
    let counts = format!(
        "this run: {} probed in child processes, {} in this process, {} from the cache",
        p.probed_in_children, p.probed_in_this_process, p.from_cache
    );
    match (&p.cache, p.cache_on) {
        (Some(c), true) => {
            let _ = writeln!(
                out,
                "Probe results are cached in {} ({counts}; `ferry info --reprobe` probes again).",
                esc(&c.to_string_lossy())
            );
        }
        (None, true) => {
            let _ = writeln!(
                out,
                "Probe results are kept in this process only: no writable cache file ({counts})."
            );
        }
        (_, false) => {
            let _ = writeln!(
                out,
                "Probe results are not cached: FERRY_PLUGIN_CACHE=off ({counts})."
            );
        }
    }
}

fn render_plugin(out: &mut String, p: &PluginReport) {
    let _ = writeln!(
        out,
        "\n  {:<12} {:<9} {:<8} {:<9} {}",
        p.name,
        p.kind.as_str(),
        esc(p.version.as_deref().unwrap_or("-")),
        p.state.as_str(),
        esc(&p.path.to_string_lossy())
    );
    if let Some(d) = p.description.as_deref().filter(|d| !d.is_empty()) {
        let _ = writeln!(out, "      {}", esc(d));
    }
    let _ = writeln!(out, "      {}: {}", reason_label(p.state), esc(&p.reason));
    for s in &p.shadows {
        let _ = writeln!(out, "      shadows: {}", esc(&s.to_string_lossy()));
    }
    let caps = &p.capabilities;
    if !caps.memory.is_empty() || !caps.scopes.is_empty() {
        let _ = writeln!(
            out,
            "      memory: {}   peers: {}",
            join_or_dash(&caps.memory),
            join_or_dash(&caps.scopes)
        );
    }
    for d in &p.devices {
        let mut line = format!("      device {}", esc(&d.name));
        if let Some(pci) = &d.pci {
            let _ = write!(line, "  pci {}", esc(pci));
        }
        if let Some(numa) = d.numa {
            let _ = write!(line, "  numa {numa}");
        }
        if let Some(detail) = &d.detail {
            let _ = write!(line, "  {}", esc(detail));
        }
        let _ = writeln!(out, "{line}");
    }
    for m in &p.missing {
        let _ = writeln!(
            out,
            "      lacks {}: {}",
            esc(&m.capability),
            esc(&m.reason)
        );
    }
    for m in &p.memory_methods {
        let _ = writeln!(
            out,
            "      memory {}: {}: {}",
            esc(&m.memory),
            if m.available {
                "available"
            } else {
                "unavailable"
            },
            esc(&m.detail)
        );
    }
    for n in &p.notes {
        let _ = writeln!(out, "      {}: {}", esc(&n.key), esc(&n.value));
    }
}

fn reason_label(state: PluginState) -> &'static str {
    match state {
        PluginState::Enabled => "why",
        PluginState::Disabled => "why not",
        PluginState::Shadowed => "why not",
    }
}

fn join_or_dash(items: &[String]) -> String {
    if items.is_empty() {
        "-".into()
    } else {
        items.join(", ")
    }
}

/// One GPU in `ferry info`.
#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    /// "cuda:0", as the driver numbers it (PCI bus order without a driver).
    pub name: String,
    pub model: Option<String>,
    pub pci: Option<String>,
    pub numa: Option<u32>,
    pub uuid: Option<String>,
    /// Where this came from: the device plugin, or sysfs alone.
    pub source: String,
    pub gpu_direct_rdma: Option<bool>,
    pub dmabuf: Option<bool>,
    /// Closest NICs first, with their path class.
    pub nearest_nics: Vec<NicRank>,
    /// How its memory would be registered for RDMA, and why not better.
    pub registration: Registration,
}

#[derive(Clone, Debug, Serialize)]
pub struct NicRank {
    pub name: String,
    pub kind: String,
    pub class: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Registration {
    /// The method once a transport can register GPU memory.
    pub method: String,
    /// The method the engine uses now under the same plugins, topology and
    /// settings (`method`, or staging while no transport can take it).
    pub in_use: String,
    /// Why this method (what makes it possible).
    pub reason: String,
    pub skipped: Vec<Skipped>,
    /// What applies today, when it differs from the method (no RDMA NIC).
    pub note: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub method: String,
    pub reason: String,
}

/// The host-wide facts behind every GPU's decision.
#[derive(Clone, Debug, Serialize)]
pub struct GpuDirectReport {
    pub policy: String,
    /// Always null: a gpu_direct value that is not a policy is rejected
    /// with its reason before any report (kept: fields are only added).
    pub policy_warning: Option<String>,
    /// Deprecated (the transport's words now, kept because fields are only
    /// added): what `methods` says of nvidia-peermem when it is available,
    /// else null.
    pub peermem: Option<String>,
    /// Deprecated, as `peermem`: what `methods` says of DMA-BUF.
    pub libibverbs: String,
    /// How GPU memory can be registered directly, as the transports
    /// reported it at probe: DMA-BUF and nvidia-peermem, each available or
    /// not with the words of the transport that said so.
    pub methods: Vec<MethodReport>,
    /// Which enabled transport registers GPU memory directly, or why none.
    pub transport: String,
}

/// One direct GPU-memory registration method, as the transports reported it.
#[derive(Clone, Debug, Serialize)]
pub struct MethodReport {
    /// `cuda-dmabuf` or `cuda-peermem`.
    pub memory: String,
    pub available: bool,
    /// "`<transport>`: how", or why not.
    pub detail: String,
}

impl InfoReport {
    /// Adds the GPUs of the start-up plan (host_plan.rs): as the enabled
    /// device plugins' probes described them (the driver's numbering; no
    /// plugin is started), else from sysfs alone; each with its nearest
    /// NICs and the GPU-direct decision the engine will take.
    pub fn with_gpus(
        mut self,
        set: &PluginSet,
        topology: Option<&Topology>,
        policy: Policy,
    ) -> InfoReport {
        let placeholder = Topology::empty();
        let reports: Vec<&PluginReport> = set.plugins.iter().map(|p| &p.report).collect();
        let plan = HostPlan::new(&reports, topology.unwrap_or(&placeholder), policy);
        self.gpu_direct = Some(gpu_direct_report(set, &plan.host, policy));
        for p in &plan.gpus {
            let g = &p.gpu;
            self.gpus.push(GpuReport {
                name: g.location.to_string(),
                model: Some(g.info.name.clone()),
                pci: Some(g.info.pci_bus_id.clone()),
                numa: topology
                    .and_then(|t| t.gpu(&p.topology_name))
                    .and_then(|tg| tg.numa),
                uuid: Some(g.info.uuid.clone()).filter(|u| !u.is_empty()),
                source: format!("{} driver", p.plugin),
                gpu_direct_rdma: g.info.gpu_direct_rdma,
                dmabuf: g.info.dmabuf,
                nearest_nics: nearest_nics(topology, &p.topology_name),
                registration: registration(p, &plan.host),
            });
        }
        if plan.gpus.is_empty() {
            if let Some(t) = topology {
                for tg in t.gpus() {
                    self.gpus.push(sysfs_gpu(t, tg));
                }
            }
        }
        self
    }
}

/// The host's GPU-direct facts as info shows them: the policy, each
/// method's availability, and which transports register GPU memory.
fn gpu_direct_report(set: &PluginSet, host: &HostFacts, policy: Policy) -> GpuDirectReport {
    let method = |memory: &str, fact: &Result<String, String>| MethodReport {
        memory: memory.to_string(),
        available: fact.is_ok(),
        detail: fact.clone().unwrap_or_else(|why| why),
    };
    GpuDirectReport {
        policy: policy.as_str().to_string(),
        policy_warning: None,
        peermem: host.peermem.clone().ok(),
        libibverbs: host.dmabuf.clone().unwrap_or_else(|why| why),
        methods: vec![
            method("cuda-dmabuf", &host.dmabuf),
            method("cuda-peermem", &host.peermem),
        ],
        transport: match &host.no_transport {
            None => set
                .enabled(PluginKind::Transport)
                .filter_map(|p| {
                    let direct = p.report.capabilities.mem_bits & gpudirect::DIRECT;
                    (direct != 0).then(|| {
                        format!(
                            "{} ({})",
                            p.report.name,
                            ferry_plugins_abi::caps::mem_kind_names(direct).join(", ")
                        )
                    })
                })
                .collect::<Vec<_>>()
                .join(", "),
            Some(why) => format!("none: {why}"),
        },
    }
}

/// The four NICs nearest `loc` in the topology, best first.
fn nearest_nics(topology: Option<&Topology>, loc: &str) -> Vec<NicRank> {
    let Some(t) = topology else {
        return Vec::new();
    };
    t.preferred_nics(loc)
        .unwrap_or_default()
        .iter()
        .take(4)
        .map(|r| NicRank {
            name: r.name.clone(),
            kind: t.nic(&r.name).map_or("?", |n| n.kind.as_str()).to_string(),
            class: r.class.as_str().to_string(),
        })
        .collect()
}

/// A planned GPU's GPU-direct decision: the method it gets once a
/// transport can register GPU memory (an RDMA NIC), the one in use today,
/// and, when they differ, a note saying why.
fn registration(p: &PlannedGpu, host: &HostFacts) -> Registration {
    let d = &p.with_direct_transport;
    let today = &p.decision;
    let pair = p.nic.as_ref();
    let reason = match d.method {
        gpudirect::Method::DmaBuf => format!(
            "the GPU supports DMA-BUF (attribute 124), the driver exports it \
             (cuMemGetHandleForAddressRange), and {}",
            host.dmabuf.as_deref().unwrap_or_else(|why| why)
        ),
        gpudirect::Method::PeerMem => format!(
            "the GPU supports GPUDirect RDMA (attribute 116), and {}",
            host.peermem.as_deref().unwrap_or_else(|why| why)
        ),
        gpudirect::Method::Staged => {
            "every transport can move it through pinned host memory".to_string()
        }
    };
    let note = if d.method == gpudirect::Method::Staged {
        None
    } else if today.method == gpudirect::Method::Staged {
        let why = host.no_transport.clone().unwrap_or_else(|| {
            today
                .skipped
                .first()
                .map_or_else(String::new, |(_, w)| w.clone())
        });
        Some(format!(
            "staged through pinned host memory until a transport can register GPU \
             memory ({why})"
        ))
    } else if pair.is_none() {
        Some(
            "no RDMA NIC on this host yet: until one is present, transfers of this \
             GPU's memory are staged through pinned host memory"
                .to_string(),
        )
    } else {
        None
    };
    Registration {
        method: d.method.as_str().to_string(),
        in_use: today.method.as_str().to_string(),
        reason,
        note,
        skipped: d
            .skipped
            .iter()
            .map(|(m, why)| Skipped {
                method: m.as_str().to_string(),
                reason: why.clone(),
            })
            .collect(),
    }
}

/// A GPU known from sysfs alone (no driver plugin): staged, and why.
fn sysfs_gpu(t: &Topology, tg: &TopoGpu) -> GpuReport {
    let staged = gpudirect::Method::Staged.as_str().to_string();
    GpuReport {
        name: tg.name.clone(),
        model: None,
        pci: tg.pci.map(|p| p.to_string()),
        numa: tg.numa,
        uuid: None,
        source: "sysfs (no GPU driver loaded: ordinals in PCI bus order)".into(),
        gpu_direct_rdma: None,
        dmabuf: None,
        nearest_nics: nearest_nics(Some(t), &tg.name),
        registration: Registration {
            method: staged.clone(),
            in_use: staged,
            reason: "every transport can move it through pinned host memory".into(),
            note: None,
            skipped: vec![Skipped {
                method: "GPUDirect".into(),
                reason: "no GPU driver plugin is enabled (see the cuda plugin's reason above)"
                    .into(),
            }],
        },
    }
}

fn render_gpus(out: &mut String, report: &InfoReport) {
    if let Some(g) = &report.gpu_direct {
        let _ = writeln!(
            out,
            "\nGPU memory for RDMA: FERRY_GPU_DIRECT={}",
            esc(&g.policy)
        );
        for m in &g.methods {
            let _ = writeln!(
                out,
                "  {}: {}: {}",
                m.memory,
                if m.available {
                    "available"
                } else {
                    "unavailable"
                },
                esc(&m.detail)
            );
        }
        let _ = writeln!(out, "  transport for GPU memory: {}", esc(&g.transport));
    }
    if report.gpus.is_empty() {
        let _ = writeln!(out, "GPUs: none");
        return;
    }
    let _ = writeln!(out, "GPUs: {}", report.gpus.len());
    let yes_no = |v: Option<bool>| match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "?",
    };
    for g in &report.gpus {
        let _ = writeln!(
            out,
            "  {:<8} {}  pci {}  numa {}  [{}]",
            esc(&g.name),
            esc(g.model.as_deref().unwrap_or("-")),
            esc(g.pci.as_deref().unwrap_or("-")),
            g.numa.map_or("-".to_string(), |n| n.to_string()),
            esc(&g.source)
        );
        if g.model.is_some() {
            let _ = writeln!(
                out,
                "      GPUDirect RDMA: {}   DMA-BUF: {}",
                yes_no(g.gpu_direct_rdma),
                yes_no(g.dmabuf)
            );
        }
        let nics: Vec<String> = g
            .nearest_nics
            .iter()
            .map(|n| format!("{} ({} {})", esc(&n.name), n.kind, n.class))
            .collect();
        let _ = writeln!(
            out,
            "      nearest NICs: {}",
            if nics.is_empty() {
                "none".to_string()
            } else {
                nics.join(", ")
            }
        );
        let r = &g.registration;
        let _ = writeln!(out, "      registration: {} ({})", r.method, esc(&r.reason));
        for s in &r.skipped {
            let _ = writeln!(out, "        not {}: {}", s.method, esc(&s.reason));
        }
        if let Some(n) = &r.note {
            let _ = writeln!(out, "        today: {}", esc(n));
        }
    }
}
