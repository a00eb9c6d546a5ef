//! What topology discovery reads from the environment, gathered in one place so
//! that discovery itself never touches the environment (tests stay
//! deterministic and can run in parallel).

use std::ffi::OsString;
use std::path::PathBuf;

/// Replaces "/sys" for every sysfs read. Default: `/sys`.
pub const ENV_SYSFS_ROOT: &str = "FERRY_SYSFS_ROOT";
/// NIC allow list (`mlx5_0,mlx5_1`) or deny list (`^mlx5_2`). Default: all NICs.
pub const ENV_NICS: &str = "FERRY_NICS";
/// JSON file that pins NIC preferences or adds what sysfs cannot show. Default: none.
pub const ENV_TOPOLOGY_FILE: &str = "FERRY_TOPOLOGY_FILE";
/// CUDA's own variable, honoured when numbering GPUs from sysfs.
pub const ENV_CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// The default sysfs root.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// Inputs of [`super::Topology::discover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyConfig {
    /// Where sysfs is mounted (`FERRY_SYSFS_ROOT`, default `/sys`).
    pub sysfs_root: PathBuf,
    /// `CUDA_VISIBLE_DEVICES` as set; `Some("")` hides every GPU, `None` shows all.
    pub cuda_visible_devices: Option<String>,
    /// `FERRY_NICS`: `a,b` keeps only those NICs, `^a,b` removes them.
    pub nic_filter: Option<String>,
    /// `FERRY_TOPOLOGY_FILE`: see [`super::override_file`] for its schema.
    pub topology_file: Option<PathBuf>,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        TopologyConfig::for_sysfs_root(DEFAULT_SYSFS_ROOT)
    }
}

impl TopologyConfig {
    /// A configuration reading `sysfs_root` with no GPU restriction, NIC
    /// filter or topology file: what tests and fixtures want.
    pub fn for_sysfs_root(sysfs_root: impl Into<PathBuf>) -> Self {
        TopologyConfig {
            sysfs_root: sysfs_root.into(),
            cuda_visible_devices: None,
            nic_filter: None,
            topology_file: None,
        }
    }

    /// Reads `FERRY_SYSFS_ROOT`, `CUDA_VISIBLE_DEVICES`, `FERRY_NICS` and
    /// `FERRY_TOPOLOGY_FILE` from the process environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var_os(name))
    }

    /// Like [`TopologyConfig::from_env`], with `lookup` standing in for the
    /// environment. Empty `FERRY_*` values count as unset; an empty
    /// `CUDA_VISIBLE_DEVICES` is kept, since it means "no GPU" to CUDA.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Self {
        let non_empty = |name: &str| lookup(name).filter(|value| !value.is_empty());
        TopologyConfig {
            sysfs_root: non_empty(ENV_SYSFS_ROOT)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_SYSFS_ROOT)),
            cuda_visible_devices: lookup(ENV_CUDA_VISIBLE_DEVICES)
                .map(|value| value.to_string_lossy().into_owned()),
            nic_filter: non_empty(ENV_NICS).map(|value| value.to_string_lossy().into_owned()),
            topology_file: non_empty(ENV_TOPOLOGY_FILE).map(PathBuf::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn reads_each_variable_and_defaults_to_sys() {
        let empty = TopologyConfig::from_lookup(|_| None);
        assert_eq!(empty, TopologyConfig::default());
        assert_eq!(empty.sysfs_root, PathBuf::from("/sys"));

        let env: HashMap<&str, &str> = [
            (ENV_SYSFS_ROOT, "/tmp/fake"),
            (ENV_CUDA_VISIBLE_DEVICES, ""),
            (ENV_NICS, "^mlx5_2"),
            (ENV_TOPOLOGY_FILE, "/etc/ferry/topo.json"),
        ]
        .into_iter()
        .collect();
        let config = TopologyConfig::from_lookup(|name| env.get(name).map(OsString::from));
        assert_eq!(config.sysfs_root, PathBuf::from("/tmp/fake"));
        assert_eq!(config.cuda_visible_devices.as_deref(), Some(""));
        assert_eq!(config.nic_filter.as_deref(), Some("^mlx5_2"));
        assert_eq!(
            config.topology_file,
            Some(PathBuf::from("/etc/ferry/topo.json"))
        );

        let blank = TopologyConfig::from_lookup(|name| {
            (name != ENV_CUDA_VISIBLE_DEVICES).then(|| OsString::from(""))
        });
        assert_eq!(blank, TopologyConfig::default());
    }
}
