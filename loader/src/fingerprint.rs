//! What a probe's result depends on besides the plugin's own answers: the
//! file itself, the libraries it mapped, this boot of the host, the shared
//! library cache and loaded kernel modules, and the environment. The cache
//! keys every result on these (cache.rs); they are cheap to recompute, so a
//! warm start checks them all.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::collections::BTreeSet;
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A file as it was: a rewrite, a replacement or a touch changes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileStamp {
    pub size: u64,
    pub mtime_ns: i64,
    pub dev: u64,
    pub ino: u64,
}

impl FileStamp {
    pub fn of(meta: &Metadata) -> FileStamp {
        FileStamp {
            size: meta.size(),
            mtime_ns: meta.mtime().saturating_mul(1_000_000_000) + meta.mtime_nsec(),
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }

    /// The file's stamp now, following symlinks; `None` when it is gone.
    pub fn of_path(path: &Path) -> Option<FileStamp> {
        std::fs::metadata(path).ok().map(|m| FileStamp::of(&m))
    }
}

/// A SHA-256 over length-prefixed parts, as 32 hex digits (128 bits): keys
/// and digests of answers, which may hold secrets (an auth token a plugin
/// read), so only the digest is ever written down.
#[derive(Clone)]
pub(crate) struct Digest(Sha256);

impl Digest {
    pub(crate) fn new(domain: &str) -> Digest {
        let mut d = Digest(Sha256::new());
        d.add(domain);
        d
    }

    pub(crate) fn add(&mut self, part: &str) -> &mut Digest {
        self.add_bytes(part.as_bytes())
    }

    pub(crate) fn add_bytes(&mut self, part: &[u8]) -> &mut Digest {
        self.0.update((part.len() as u64).to_le_bytes());
        self.0.update(part);
        self
    }

    pub(crate) fn add_stamp(&mut self, stamp: Option<FileStamp>) -> &mut Digest {
        match stamp {
            Some(s) => self.add(&format!("{} {} {} {}", s.size, s.mtime_ns, s.dev, s.ino)),
            None => self.add("-"),
        }
    }

    pub(crate) fn finish(&self) -> String {
        let full = self.0.clone().finalize();
        full[..16].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// This boot of the host (/proc/sys/kernel/random/boot_id).
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().chars().take(64).collect())
        .unwrap_or_default()
}

/// The host's state a probe may depend on without asking Ferry: this boot,
/// the shared library cache (ldconfig runs when a library is installed) and
/// the kernel modules loaded (nvidia_peermem, ib_uverbs, ...).
pub(crate) fn add_system(d: &mut Digest) {
    d.add(&boot_id());
    d.add_stamp(FileStamp::of_path(Path::new("/etc/ld.so.cache")));
    let modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    for line in modules.lines() {
        // "name size refcount users state address": name and size say which
        // module (and which build of it); the rest changes as it is used.
        let mut f = line.split_whitespace();
        d.add(f.next().unwrap_or(""));
        d.add(f.next().unwrap_or(""));
    }
}

/// Whether an environment variable can change what a plugin or the
/// libraries it loads find: Ferry's own settings (except the loader's, which
/// act before any plugin runs), GPU and RDMA libraries' variables, and the
/// dynamic loader's search path.
fn env_matters(name: &str) -> bool {
    const LOADER_OWN: &[&str] = &[
        "FERRY_LOG",
        "FERRY_PLUGIN_PATH",
        "FERRY_PLUGIN_CACHE",
        "FERRY_PLUGIN_PROBE_HELPER",
        "FERRY_PLUGIN_PROBE_TIMEOUT_MS",
        "FERRY_TRANSPORTS",
    ];
    const PREFIXES: &[&str] = &[
        "FERRY_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "RDMAV_", "IBV_", "MLX",
    ];
    if LOADER_OWN.contains(&name) {
        return false;
    }
    PREFIXES.iter().any(|p| name.starts_with(p))
        || name == "LD_LIBRARY_PATH"
        || name == "LD_PRELOAD"
}

/// The environment variables that matter, sorted, into `d`.
pub(crate) fn add_env(d: &mut Digest) {
    let mut vars: Vec<(String, Vec<u8>)> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            env_matters(&k).then(|| {
                (
                    k,
                    std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()).to_vec(),
                )
            })
        })
        .collect();
    vars.sort();
    for (k, v) in vars {
        d.add(&k);
        d.add_bytes(&v);
    }
}

/// Files this process has mapped (libraries, mostly), from /proc/self/maps.
pub(crate) fn mapped_files() -> BTreeSet<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return BTreeSet::new();
    };
    maps.lines()
        .filter_map(|line| {
            // address perms offset dev inode path
            let mut f = line.splitn(6, ' ');
            let inode = f.nth(4)?;
            let path = f.next()?.trim_start();
            (inode != "0" && path.starts_with('/') && !path.ends_with(" (deleted)"))
                .then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_separate_their_parts() {
        let a = Digest::new("t").add("ab").add("c").finish();
        let b = Digest::new("t").add("a").add("bc").finish();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn the_loader_own_variables_do_not_matter_to_a_probe() {
        assert!(env_matters("FERRY_TCP_CONNECTIONS"));
        assert!(env_matters("CUDA_VISIBLE_DEVICES"));
        assert!(env_matters("FERRY_SYSFS_ROOT"));
        assert!(env_matters("LD_LIBRARY_PATH"));
        assert!(!env_matters("FERRY_LOG"));
        assert!(!env_matters("FERRY_PLUGIN_PROBE_TIMEOUT_MS"));
        assert!(!env_matters("HOME"));
    }

    #[test]
    fn this_process_maps_its_own_c_library() {
        let files = mapped_files();
        assert!(
            files.iter().any(|p| p.to_string_lossy().contains("libc")),
            "{files:?}"
        );
    }
}
