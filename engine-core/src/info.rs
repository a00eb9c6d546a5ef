//! What `ferry info` reports: this build's versions, where plugins were
//! looked for, and every plugin file with its state and the reason for it.
//! The JSON shape is documented in docs/info-json.md; keep the two in step.

use ferry_loader::{PluginReport, PluginSet, PluginState, SearchEntry};
use serde::Serialize;
use std::fmt::Write as _;

/// Ferry's own version.
pub const FERRY_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Clone, Debug, Serialize)]
pub struct InfoReport {
    pub ferry_version: String,
    pub abi_version: String,
    pub search_path: Vec<SearchEntry>,
    pub transports_filter: Option<String>,
    pub plugins: Vec<PluginReport>,
    pub warnings: Vec<String>,
}

impl InfoReport {
    pub fn from_plugins(set: &PluginSet) -> InfoReport {
        InfoReport {
            ferry_version: FERRY_VERSION.to_string(),
            abi_version: ferry_plugins_abi::abi_version(),
            search_path: set.search_path.clone(),
            transports_filter: set.transports_filter.clone(),
            plugins: set.plugins.iter().map(|p| p.report.clone()).collect(),
            warnings: set.warnings.clone(),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(
            |e| serde_json::json!({ "error": format!("cannot serialise the report: {e}") }),
        )
    }

    /// The human-readable report.
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
            let _ = writeln!(out, "FERRY_TRANSPORTS={f}");
        }
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
        if !self.warnings.is_empty() {
            let _ = writeln!(out, "\nWarnings:");
            for w in &self.warnings {
                let _ = writeln!(out, "  - {w}");
            }
        }
        out
    }
}

fn render_plugin(out: &mut String, p: &PluginReport) {
    let _ = writeln!(
        out,
        "\n  {:<12} {:<9} {:<8} {:<9} {}",
        p.name,
        p.kind.as_str(),
        p.version.as_deref().unwrap_or("-"),
        p.state.as_str(),
        p.path.display()
    );
    if let Some(d) = p.description.as_deref().filter(|d| !d.is_empty()) {
        let _ = writeln!(out, "      {d}");
    }
    let _ = writeln!(out, "      {}: {}", reason_label(p.state), p.reason);
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
        let mut line = format!("      device {}", d.name);
        if let Some(pci) = &d.pci {
            let _ = write!(line, "  pci {pci}");
        }
        if let Some(numa) = d.numa {
            let _ = write!(line, "  numa {numa}");
        }
        if let Some(detail) = &d.detail {
            let _ = write!(line, "  {detail}");
        }
        let _ = writeln!(out, "{line}");
    }
    for m in &p.missing {
        let _ = writeln!(out, "      lacks {}: {}", m.capability, m.reason);
    }
    for n in &p.notes {
        let _ = writeln!(out, "      {}: {}", n.key, n.value);
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
