//! Where to look for plugins and which transports the operator allows.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Why a directory is on the search path; shown by `ferry info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirOrigin {
    /// An entry of FERRY_PLUGIN_PATH.
    Env,
    /// `<dir of libferry.so or the ferry binary>/../lib/ferry/plugins`.
    BesideLibrary,
    /// The cargo target directory this binary was built in (development).
    DevBuild,
}

impl DirOrigin {
    pub fn as_str(self) -> &'static str {
        match self {
            DirOrigin::Env => "FERRY_PLUGIN_PATH",
            DirOrigin::BesideLibrary => "beside-library",
            DirOrigin::DevBuild => "dev-build",
        }
    }
}

/// One entry of the search path: a directory, or a plugin file named
/// directly on FERRY_PLUGIN_PATH.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SearchEntry {
    pub path: PathBuf,
    pub origin: DirOrigin,
    pub exists: bool,
}

/// An allow or deny list of names, NCCL/UCX style: `tcp,shm` allows only
/// those; `^rdma-peermem` allows everything else. Names compare with `-` and
/// `_` treated as equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameFilter {
    spec: String,
    deny: bool,
    names: Vec<String>,
}

impl NameFilter {
    /// Parses a list; `None` for an empty one (which filters nothing).
    pub fn parse(spec: &str) -> Option<NameFilter> {
        let spec = spec.trim();
        let (deny, body) = match spec.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, spec),
        };
        let names: Vec<String> = body
            .split(',')
            .map(|n| normalize_name(n.trim()))
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() && !deny {
            return None;
        }
        Some(NameFilter {
            spec: spec.to_string(),
            deny,
            names,
        })
    }

    pub fn allows(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| *n == normalize_name(name));
        listed != self.deny
    }

    /// The list as the operator wrote it.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    pub fn is_deny_list(&self) -> bool {
        self.deny
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Plugin names compare with `-` and `_` as the same character, because a
/// Rust crate `ferry-transport-rdma-peermem` builds
/// `libferry_transport_rdma_peermem.so`.
pub fn normalize_name(name: &str) -> String {
    name.to_ascii_lowercase().replace('_', "-")
}

/// Which ferry-probe helper loads and probes plugins in a child process
/// (FERRY_PLUGIN_PROBE_HELPER).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelperChoice {
    /// The one beside the plugins (`<prefix>/lib/ferry/ferry-probe`) or in
    /// the development build; in this process when there is none.
    Auto,
    /// This file.
    Path(PathBuf),
    /// None: load and probe in this process (debugging a plugin).
    Off,
}

impl HelperChoice {
    pub fn parse(value: &str) -> HelperChoice {
        match value.trim() {
            "" | "auto" => HelperChoice::Auto,
            "off" => HelperChoice::Off,
            p => HelperChoice::Path(PathBuf::from(p)),
        }
    }
}

/// Where probe results are kept between processes (FERRY_PLUGIN_CACHE).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheChoice {
    /// `$XDG_CACHE_HOME/ferry/plugin-probes.json` (`~/.cache/...`), else a
    /// private directory under /tmp, else this process only.
    Auto,
    /// This file.
    Path(PathBuf),
    /// No cache: every start probes every plugin.
    Off,
}

impl CacheChoice {
    pub fn parse(value: &str) -> CacheChoice {
        match value.trim() {
            "" | "auto" => CacheChoice::Auto,
            "off" => CacheChoice::Off,
            p => CacheChoice::Path(PathBuf::from(p)),
        }
    }
}

/// What the loader searches and filters. Build it from the environment with
/// [`LoaderConfig::from_env`] or by hand (tests, embedders).
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// FERRY_PLUGIN_PATH entries, searched first, in order.
    pub plugin_path: Vec<PathBuf>,
    /// Also search beside the library/binary and the development build.
    pub default_dirs: bool,
    /// FERRY_TRANSPORTS.
    pub transports: Option<NameFilter>,
    /// How long loading and probing one plugin may take before it is given
    /// up on (FERRY_PLUGIN_PROBE_TIMEOUT_MS).
    pub probe_timeout: std::time::Duration,
    /// FERRY_PLUGIN_PROBE_HELPER.
    pub probe_helper: HelperChoice,
    /// FERRY_PLUGIN_CACHE.
    pub cache: CacheChoice,
    /// Probe every plugin again even when the cache has a result (and
    /// replace it): `ferry info --reprobe`.
    pub reprobe: bool,
}

/// The default directories, no FERRY_PLUGIN_PATH, no filter: what
/// [`LoaderConfig::from_env`] gives with an empty environment.
impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            plugin_path: Vec::new(),
            default_dirs: true,
            transports: None,
            probe_timeout: std::time::Duration::from_millis(DEFAULT_PROBE_TIMEOUT_MS),
            probe_helper: HelperChoice::Auto,
            cache: CacheChoice::Auto,
            reprobe: false,
        }
    }
}

/// Default for FERRY_PLUGIN_PROBE_TIMEOUT_MS.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 10_000;

impl LoaderConfig {
    /// FERRY_PLUGIN_PATH (colon list), FERRY_TRANSPORTS,
    /// FERRY_PLUGIN_PROBE_TIMEOUT_MS (default 10000),
    /// FERRY_PLUGIN_PROBE_HELPER and FERRY_PLUGIN_CACHE (default `auto`),
    /// for programs that load plugins without an engine (an engine reads
    /// the same variables through engine-core's EngineConfig). Empty
    /// variables count as unset; a timeout that is not a number of
    /// milliseconds (1 to 3600000) is rejected with the reason, as the
    /// engine rejects it.
    pub fn from_env() -> Result<LoaderConfig, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let plugin_path = std::env::var_os("FERRY_PLUGIN_PATH")
            .map(|p| split_path_list(&p))
            .unwrap_or_default();
        let timeout_ms = match var("FERRY_PLUGIN_PROBE_TIMEOUT_MS") {
            None => DEFAULT_PROBE_TIMEOUT_MS,
            Some(v) => v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|ms| (1..=3_600_000).contains(ms))
                .ok_or_else(|| {
                    format!(
                        "FERRY_PLUGIN_PROBE_TIMEOUT_MS={v:?} rejected: expected a whole number \
                         of milliseconds, 1 to 3600000"
                    )
                })?,
        };
        Ok(LoaderConfig {
            plugin_path,
            default_dirs: true,
            transports: var("FERRY_TRANSPORTS").and_then(|s| NameFilter::parse(&s)),
            probe_timeout: std::time::Duration::from_millis(timeout_ms),
            probe_helper: var("FERRY_PLUGIN_PROBE_HELPER")
                .map_or(HelperChoice::Auto, |v| HelperChoice::parse(&v)),
            cache: var("FERRY_PLUGIN_CACHE").map_or(CacheChoice::Auto, |v| CacheChoice::parse(&v)),
            reprobe: false,
        })
    }

    /// Only the given directories, no defaults, no filter.
    pub fn only(dirs: impl IntoIterator<Item = PathBuf>) -> LoaderConfig {
        LoaderConfig {
            plugin_path: dirs.into_iter().collect(),
            default_dirs: false,
            ..LoaderConfig::default()
        }
    }

    /// The search path, in order, with duplicates removed.
    pub fn search_path(&self) -> Vec<SearchEntry> {
        let mut entries: Vec<SearchEntry> = Vec::new();
        let mut push = |path: PathBuf, origin: DirOrigin| {
            let key = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
            let seen = entries
                .iter()
                .any(|e| std::fs::canonicalize(&e.path).unwrap_or_else(|_| e.path.clone()) == key);
            if !seen {
                let exists = path.exists();
                entries.push(SearchEntry {
                    path,
                    origin,
                    exists,
                });
            }
        };
        for p in &self.plugin_path {
            push(p.clone(), DirOrigin::Env);
        }
        if self.default_dirs {
            if let Some(object) = crate::self_location::containing_object() {
                if let Some(dir) = object.parent() {
                    // <prefix>/bin/ferry and <prefix>/lib/libferry.so both
                    // find <prefix>/lib/ferry/plugins.
                    let prefix = dir.parent().unwrap_or(dir);
                    push(prefix.join("lib/ferry/plugins"), DirOrigin::BesideLibrary);
                    if let Some(dev) = dev_build_dir(dir) {
                        push(dev, DirOrigin::DevBuild);
                    }
                }
            }
        }
        entries
    }
}

fn split_path_list(list: &OsStr) -> Vec<PathBuf> {
    std::env::split_paths(list)
        .filter(|p| !p.as_os_str().is_empty())
        .collect()
}

/// A cargo target profile directory (`target/debug`) holds `.fingerprint`;
/// test binaries live one level down in `deps/`.
pub(crate) fn dev_build_dir(object_dir: &Path) -> Option<PathBuf> {
    let candidates = [Some(object_dir), object_dir.parent()];
    candidates
        .into_iter()
        .flatten()
        .find(|d| d.join(".fingerprint").is_dir())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_and_deny_lists() {
        let allow = NameFilter::parse("tcp, shm").unwrap();
        assert!(allow.allows("tcp") && allow.allows("shm") && !allow.allows("rdma"));
        let deny = NameFilter::parse("^rdma-peermem").unwrap();
        assert!(deny.allows("tcp") && !deny.allows("rdma_peermem"));
        assert!(NameFilter::parse("  ").is_none());
        assert!(NameFilter::parse("^").unwrap().allows("tcp"));
    }

    #[test]
    fn empty_path_entries_are_ignored() {
        let p = split_path_list(OsStr::new("/a::/b:"));
        assert_eq!(p, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
    }
}
