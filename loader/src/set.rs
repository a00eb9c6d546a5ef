//! One discovery pass: every plugin file on the search path, checked,
//! loaded and probed (in a ferry-probe child when the helper is there, else
//! in this process), or its result taken from the cache, and its state
//! decided with a reason.

use crate::asked::RecordingHost;
use crate::cache::Cache;
use crate::config::{normalize_name, DirOrigin, LoaderConfig, SearchEntry};
use crate::discover::{discover, Candidate};
use crate::elf::{self, ElfFacts};
use crate::escape::for_terminal;
use crate::guard::{self, ProbeTurn};
use crate::host::HostServices;
use crate::isolate::{self, ChildResult};
use crate::library::{self, LoadedLibrary};
use crate::report::{
    Capabilities, Outcome, PluginKind, PluginReport, PluginState, ProbeSource, Stage,
};
use crate::{fingerprint, helper, probe};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

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

/// Where plugins are first loaded and probed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    /// In a short-lived child process (ferry-probe): a crash there
    /// disables the plugin and the application lives on.
    ChildProcess,
    /// In this process: a plugin that crashes takes it down.
    ThisProcess,
}

/// How this pass loaded and probed plugins, for `ferry info`.
#[derive(Clone, Debug, Serialize)]
pub struct ProbeSetup {
    pub isolation: Isolation,
    /// The ferry-probe helper, with child-process isolation.
    pub helper: Option<PathBuf>,
    /// Why plugins are probed in this process, when they are.
    pub why_this_process: Option<String>,
    /// Whether probe results are reused (FERRY_PLUGIN_CACHE is not `off`).
    pub cache_on: bool,
    /// The cache file; null when the cache is off or no place was writable
    /// (results then stay in this process).
    pub cache: Option<PathBuf>,
    /// Plugins probed in child processes, in this process, and taken from
    /// the cache, in this pass.
    pub probed_in_children: usize,
    pub probed_in_this_process: usize,
    pub from_cache: usize,
}

/// The outcome of one discovery pass.
pub struct PluginSet {
    pub search_path: Vec<SearchEntry>,
    pub transports_filter: Option<String>,
    pub plugins: Vec<Plugin>,
    pub warnings: Vec<String>,
    pub probing: ProbeSetup,
}

/// A plugin file waiting for its outcome.
struct Pending {
    cand: Candidate,
    facts: ElfFacts,
    /// Files of the same kind and name later in the search path.
    shadows: Vec<PathBuf>,
}

/// What resolving one pending plugin gave.
struct Resolved {
    outcome: Outcome,
    source: ProbeSource,
    /// Loaded in this process already (probed here).
    library: Option<Arc<LoadedLibrary>>,
}

enum Slot {
    Done(Box<Plugin>),
    Pending(Pending),
}

/// What every resolution of one pass shares.
struct Pass<'a> {
    config: &'a LoaderConfig,
    host: &'a Arc<dyn HostServices>,
    helper: Option<PathBuf>,
    cache: Cache,
    warnings: Mutex<Vec<String>>,
}

impl PluginSet {
    /// Discovers, checks, loads and probes every plugin on the search path.
    /// Never fails: every problem becomes a plugin's reason or a warning.
    pub fn load(config: &LoaderConfig, host: Arc<dyn HostServices>) -> PluginSet {
        let search_path = config.search_path();
        let mut warnings = Vec::new();
        let candidates = discover(&search_path, &mut warnings);
        let (helper, why_this_process) = match helper::locate(&config.probe_helper) {
            Ok(h) => (Some(h), None),
            Err(why) => (None, Some(why)),
        };

        let mut slots: Vec<Slot> = Vec::with_capacity(candidates.len());
        for cand in candidates {
            let slot = match first_decision(&cand, &mut slots, config, &mut warnings) {
                Some(p) => Slot::Done(Box::new(p)),
                None => match elf::inspect(&cand.path) {
                    Ok(facts) => Slot::Pending(Pending {
                        cand,
                        facts,
                        shadows: Vec::new(),
                    }),
                    Err(reason) => Slot::Done(Box::new(disabled(&cand, Stage::Discovered, reason))),
                },
            };
            slots.push(slot);
        }

        let pass = Pass {
            config,
            host: &host,
            helper: helper.clone(),
            cache: Cache::open(&config.cache),
            warnings: Mutex::new(Vec::new()),
        };
        let pending: Vec<&Pending> = slots
            .iter()
            .filter_map(|s| match s {
                Slot::Pending(p) => Some(p),
                Slot::Done(_) => None,
            })
            .collect();
        let resolved: Vec<Resolved> = if pass.helper.is_some() && pending.len() > 1 {
            // Children run side by side: a cold start waits for the slowest
            // plugin, not for the sum of them.
            std::thread::scope(|s| {
                let handles: Vec<_> = pending
                    .iter()
                    .map(|p| s.spawn(|| pass.resolve(p)))
                    .collect();
                handles
                    .into_iter()
                    .zip(&pending)
                    .map(|(h, p)| {
                        h.join().unwrap_or_else(|_| Resolved {
                            outcome: Outcome::disabled(
                                Stage::Discovered,
                                format!("internal error while probing {}", p.cand.path.display()),
                            ),
                            source: ProbeSource::ThisProcess,
                            library: None,
                        })
                    })
                    .collect()
            })
        } else {
            pending.iter().map(|p| pass.resolve(p)).collect()
        };
        pass.cache.flush();

        let mut probing = ProbeSetup {
            isolation: if helper.is_some() {
                Isolation::ChildProcess
            } else {
                Isolation::ThisProcess
            },
            helper,
            why_this_process,
            cache_on: pass.cache.is_on(),
            cache: pass.cache.is_on().then(|| pass.cache.file()).flatten(),
            probed_in_children: 0,
            probed_in_this_process: 0,
            from_cache: 0,
        };
        let mut resolved = resolved.into_iter();
        let mut plugins: Vec<Plugin> = Vec::with_capacity(slots.len());
        for slot in slots {
            let plugin = match slot {
                Slot::Done(p) => *p,
                Slot::Pending(p) => {
                    let Some(r) = resolved.next() else { break };
                    match r.source {
                        ProbeSource::ChildProcess => probing.probed_in_children += 1,
                        ProbeSource::ThisProcess => probing.probed_in_this_process += 1,
                        ProbeSource::Cache => probing.from_cache += 1,
                    }
                    pass.finish(&p, r)
                }
            };
            log_decision(&plugin.report);
            plugins.push(plugin);
        }
        warnings.extend(std::mem::take(
            &mut *pass.warnings.lock().unwrap_or_else(PoisonError::into_inner),
        ));
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
            probing,
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

/// Shadowed or excluded, decided by names alone; `None` when the file must
/// be looked at.
fn first_decision(
    cand: &Candidate,
    earlier: &mut [Slot],
    config: &LoaderConfig,
    warnings: &mut Vec<String>,
) -> Option<Plugin> {
    let first = earlier.iter_mut().find(|s| {
        let (kind, name) = match s {
            Slot::Done(p) => (p.report.kind, &p.report.name),
            Slot::Pending(p) => (p.cand.kind, &p.cand.name),
        };
        kind == cand.kind && normalize_name(name) == cand.name
    });
    if let Some(slot) = first {
        let (first_path, first_origin) = match slot {
            Slot::Done(p) => {
                p.report.shadows.push(cand.path.clone());
                (p.report.path.clone(), p.report.origin)
            }
            Slot::Pending(p) => {
                p.shadows.push(cand.path.clone());
                (p.cand.path.clone(), p.cand.origin)
            }
        };
        let ours = matches!(cand.origin, DirOrigin::BesideLibrary | DirOrigin::DevBuild);
        let w = format!(
            "{} plugin '{}': {} ({}) is used{}, and {} ({}) is not loaded",
            cand.kind.as_str(),
            cand.name,
            first_path.display(),
            first_origin.as_str(),
            if ours && first_origin == DirOrigin::Env {
                " in place of Ferry's own"
            } else {
                ""
            },
            cand.path.display(),
            cand.origin.as_str()
        );
        log::warn!("{w}");
        warnings.push(w);
        return Some(Plugin {
            report: report_for(
                cand,
                PluginState::Shadowed,
                Stage::Discovered,
                format!(
                    "shadowed by {}, a {} plugin of the same name earlier in the search path",
                    first_path.display(),
                    cand.kind.as_str()
                ),
            ),
            library: None,
        });
    }
    if cand.kind == PluginKind::Transport {
        if let Some(filter) = &config.transports {
            if !filter.allows(&cand.name) {
                return Some(disabled(
                    cand,
                    Stage::Discovered,
                    format!("excluded by FERRY_TRANSPORTS={}", filter.spec()),
                ));
            }
        }
    }
    None
}

impl Pass<'_> {
    fn warn(&self, w: String) {
        log::warn!("{w}");
        let mut ws = self.warnings.lock().unwrap_or_else(PoisonError::into_inner);
        if !ws.contains(&w) {
            ws.push(w);
        }
    }

    fn resolve(&self, p: &Pending) -> Resolved {
        let turn = ProbeTurn::wait(p.facts.stamp);
        let _held = turn.hold();
        if let Some(reason) = guard::timed_out_before(&p.facts.stamp) {
            let mut outcome = Outcome::disabled(
                Stage::Loaded,
                format!("not probed again in this process: earlier, {reason}"),
            );
            outcome.timed_out_after_ms = None;
            return Resolved {
                outcome,
                source: ProbeSource::Cache,
                library: None,
            };
        }
        let key = self.cache.key(&p.cand, &p.facts);
        let timeout = self.config.probe_timeout;
        if !self.config.reprobe {
            if let Some(outcome) = self.cache.lookup(&key, &**self.host, timeout) {
                return Resolved {
                    outcome,
                    source: ProbeSource::Cache,
                    library: None,
                };
            }
        }
        if let Some(helper) = &self.helper {
            match isolate::probe_in_child(helper, &p.cand, self.host, timeout) {
                ChildResult::Done {
                    outcome,
                    asked,
                    libs,
                } => {
                    if outcome.timed_out_after_ms.is_some() {
                        guard::mark_timed_out(p.facts.stamp, &outcome.reason);
                    }
                    if let Some(asked) = asked {
                        self.cache.store(key, &p.cand.path, &outcome, asked, &libs);
                    }
                    return Resolved {
                        outcome: *outcome,
                        source: ProbeSource::ChildProcess,
                        library: None,
                    };
                }
                ChildResult::HelperFailed(why) => self.warn(format!(
                    "the plugin probe helper failed ({}); plugins are loaded and probed in this \
                     process instead, where one that crashes takes the process down",
                    for_terminal(&why)
                )),
            }
        }
        self.in_this_process(p, key, timeout)
    }

    fn in_this_process(&self, p: &Pending, key: String, timeout: Duration) -> Resolved {
        let _alone = guard::in_process_lock();
        let path = p.cand.path.display();
        let recording = Arc::new(RecordingHost::new(self.host.clone()));
        let as_host: Arc<dyn HostServices> = recording.clone();
        let before = fingerprint::mapped_files();
        log::info!("loading {path}");
        let started = Instant::now();
        let lib = match library::open(&p.cand, &p.facts, &as_host) {
            Ok(l) => l,
            Err(reason) => {
                let outcome = Outcome::disabled(Stage::Discovered, reason);
                if let Some(asked) = recording.stop() {
                    self.cache.store(key, &p.cand.path, &outcome, asked, &[]);
                }
                return Resolved {
                    outcome,
                    source: ProbeSource::ThisProcess,
                    library: None,
                };
            }
        };
        let load_us = probe::elapsed_us(started);
        log::info!("probing {path}");
        let Some(outcome) = probe::probe_outcome_within(&lib, load_us, timeout) else {
            let outcome = probe::timed_out(
                timeout,
                Stage::Loaded,
                Some(load_us),
                Some(lib.strings()),
                "the plugin is not used (its probe may still be running in this process)",
            );
            guard::mark_timed_out(p.facts.stamp, &outcome.reason);
            if let Some(asked) = recording.stop() {
                self.cache.store(key, &p.cand.path, &outcome, asked, &[]);
            }
            return Resolved {
                outcome,
                source: ProbeSource::ThisProcess,
                library: None,
            };
        };
        let libs: Vec<PathBuf> = fingerprint::mapped_files()
            .difference(&before)
            .cloned()
            .collect();
        if let Some(asked) = recording.stop() {
            self.cache.store(key, &p.cand.path, &outcome, asked, &libs);
        }
        let library = outcome.enabled.then_some(lib);
        Resolved {
            outcome,
            source: ProbeSource::ThisProcess,
            library,
        }
    }

    /// The plugin's report; an enabled plugin probed elsewhere is loaded
    /// into this process now.
    fn finish(&self, p: &Pending, r: Resolved) -> Plugin {
        let mut report = report_for(
            &p.cand,
            PluginState::Disabled,
            r.outcome.stage,
            String::new(),
        );
        report.reason = r.outcome.reason.clone();
        report.version = r.outcome.version.clone();
        report.description = r.outcome.description.clone();
        report.abi = r.outcome.abi.clone();
        report.capabilities = r.outcome.capabilities();
        report.devices = r.outcome.device_reports();
        report.missing = r.outcome.missing.clone();
        report.memory_methods = r.outcome.memory_methods.clone();
        report.notes = r.outcome.notes.clone();
        report.load_us = r.outcome.load_us;
        report.probe_us = r.outcome.probe_us;
        report.probe_source = Some(r.source);
        report.shadows = p.shadows.clone();
        if !r.outcome.enabled {
            return Plugin {
                report,
                library: None,
            };
        }
        let library = match r.library {
            Some(l) => Ok(l),
            None => {
                if self.helper.is_some() {
                    log::debug!("loading {} (its probe passed)", p.cand.path.display());
                } else {
                    log::info!("loading {}", p.cand.path.display());
                }
                let started = Instant::now();
                let opened = library::open(&p.cand, &p.facts, self.host);
                report.load_us = Some(probe::elapsed_us(started));
                opened
            }
        };
        match library {
            Ok(lib) => {
                report.state = PluginState::Enabled;
                Plugin {
                    report,
                    library: Some(lib),
                }
            }
            Err(reason) => {
                report.stage = Stage::Discovered;
                report.reason = format!(
                    "passed its probe ({}), but loading it into this process failed: {reason}",
                    r.source.as_str()
                );
                Plugin {
                    report,
                    library: None,
                }
            }
        }
    }
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
        memory_methods: Vec::new(),
        notes: Vec::new(),
        load_us: None,
        probe_us: None,
        probe_source: None,
        shadows: Vec::new(),
    }
}

fn disabled(cand: &Candidate, stage: Stage, reason: String) -> Plugin {
    Plugin {
        report: report_for(cand, PluginState::Disabled, stage, reason),
        library: None,
    }
}

fn log_decision(r: &PluginReport) {
    log::info!(
        "{} plugin '{}' {}: {} ({}{})",
        r.kind.as_str(),
        r.name,
        r.state.as_str(),
        for_terminal(&r.reason),
        r.path.display(),
        r.probe_source
            .map(|s| format!(", {}", s.as_str()))
            .unwrap_or_default()
    );
}
