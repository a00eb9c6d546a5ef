//! Which files on the search path are plugins, by their names alone: a
//! plugin's file name carries its kind and name, so shadowing and
//! FERRY_TRANSPORTS are decided before any plugin code runs.

use crate::config::{normalize_name, DirOrigin, SearchEntry};
use crate::report::PluginKind;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// A file that looks like a plugin by its name.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub(crate) path: PathBuf,
    pub(crate) origin: DirOrigin,
    pub(crate) kind: PluginKind,
    pub(crate) name: String,
}

/// `libferry_transport_tcp.so` -> (Transport, "tcp").
pub(crate) fn parse_file_name(file_name: &str) -> Option<(PluginKind, String)> {
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

/// Every plugin file on the search path, in search order.
pub(crate) fn discover(search_path: &[SearchEntry], warnings: &mut Vec<String>) -> Vec<Candidate> {
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
}
