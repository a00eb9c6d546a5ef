//! The topology file (`FERRY_TOPOLOGY_FILE`): pins NIC preferences and adds
//! what sysfs cannot show (NICs and GPUs in VMs, NUMA placement a hypervisor
//! hides, a NIC bound to vfio-pci that has no RDMA or net device).
//!
//! # Schema
//!
//! A JSON object; every key is optional and unknown keys are errors (a typo
//! must not silently do nothing):
//!
//! ```json
//! {
//!   "nics": [
//!     {"name": "mlx5_0", "kind": "rdma", "pci": "0000:00:06.0", "numa": 0,
//!      "state": "active", "speed_mbps": 200000, "netdevs": ["ib0"]}
//!   ],
//!   "gpus": [
//!     {"name": "cuda:0", "pci": "0000:00:04.0", "numa": 0}
//!   ],
//!   "preferred": {
//!     "cuda:0": ["mlx5_1", "mlx5_0"],
//!     "cpu:0": ["mlx5_0"]
//!   }
//! }
//! ```
//!
//! - `nics[]`: `name` is required. A name sysfs already shows updates that NIC
//!   with the fields given; a new name adds a NIC and then needs `kind`
//!   (`"rdma"` or `"net"`). `pci` (a PCI address) places the NIC in the PCI
//!   tree when sysfs has that function, so its path classes are computed like
//!   any other; `numa` (-1 = unknown) overrides the node. `state` is one of
//!   `active`, `down`, `init`, `armed`, `unknown` (default for new NICs:
//!   `unknown`, which counts as usable). `netdevs` lists its interfaces.
//! - `gpus[]`: `name` is `cuda:N` or `rocm:N` *after* `CUDA_VISIBLE_DEVICES`
//!   (the ordinal the application uses). An existing GPU is updated, a new
//!   one added; `pci` and `numa` as for NICs.
//! - `preferred`: per memory location (`cpu:N`, `cuda:N`, `rocm:N`), NICs that
//!   come first, in this order; the other NICs follow in computed order. Every
//!   name must be a NIC in sysfs or in `nics` (else an error). NICs whose
//!   ports are down still go last, with a warning. A location this host does
//!   not have is a warning, so one file can serve several hosts.
//!
//! Errors name the file: missing or unreadable, invalid JSON or a wrong type
//! (with line and column), or an impossible value.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::TopologyError;
use super::model::{LinkState, MemoryLocation, NicKind};
use super::pci::PciAddress;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    #[serde(default)]
    nics: Vec<NicSpec>,
    #[serde(default)]
    gpus: Vec<GpuSpec>,
    #[serde(default)]
    preferred: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NicSpec {
    name: String,
    kind: Option<KindSpec>,
    pci: Option<String>,
    numa: Option<i64>,
    state: Option<StateSpec>,
    speed_mbps: Option<u64>,
    netdevs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuSpec {
    name: String,
    pci: Option<String>,
    numa: Option<i64>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum KindSpec {
    Rdma,
    Net,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StateSpec {
    Active,
    Armed,
    Init,
    Down,
    Unknown,
}

/// A NIC entry, validated.
#[derive(Debug, Clone)]
pub(crate) struct FileNic {
    pub name: String,
    pub kind: Option<NicKind>,
    pub pci: Option<PciAddress>,
    /// `Some(None)`: the file says "unknown" (-1).
    pub numa: Option<Option<u32>>,
    pub state: Option<LinkState>,
    pub speed_mbps: Option<u64>,
    pub netdevs: Option<Vec<String>>,
}

/// A GPU entry, validated.
#[derive(Debug, Clone)]
pub(crate) struct FileGpu {
    pub location: MemoryLocation,
    pub pci: Option<PciAddress>,
    pub numa: Option<Option<u32>>,
}

/// A parsed and validated topology file.
#[derive(Debug, Clone)]
pub(crate) struct TopologyFile {
    pub path: PathBuf,
    pub nics: Vec<FileNic>,
    pub gpus: Vec<FileGpu>,
    /// Pins, by location, in the order given.
    pub preferred: Vec<(MemoryLocation, Vec<String>)>,
}

impl TopologyFile {
    /// Reads and validates the file at `path`.
    pub(crate) fn load(path: &Path) -> Result<Self, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            TopologyError::TopologyFileUnreadable {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Self::parse(path, &text)
    }

    /// Validates `text` as the content of the file at `path`.
    pub(crate) fn parse(path: &Path, text: &str) -> Result<Self, TopologyError> {
        // serde would also take a struct from a JSON array; a file is an object.
        let body = text.trim_start();
        if !body.is_empty() && !body.starts_with('{') {
            let before = &text[..text.len() - body.len()];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |newline| newline + 1) + 1;
            return Err(TopologyError::TopologyFileSyntax {
                path: path.to_path_buf(),
                line,
                column,
                message: "expected a JSON object ({ ... }) at the top level".to_string(),
            });
        }
        let spec: FileSpec =
            serde_json::from_str(text).map_err(|error| syntax_error(path, &error))?;
        let invalid = |message: String| TopologyError::TopologyFileInvalid {
            path: path.to_path_buf(),
            message,
        };
        let parse_pci = |what: &str, text: &str| {
            text.parse::<PciAddress>()
                .map_err(|error| invalid(format!("{what}: {error}")))
        };
        let numa = |value: i64| u32::try_from(value).ok();

        let mut nics = Vec::with_capacity(spec.nics.len());
        for (index, nic) in spec.nics.into_iter().enumerate() {
            let what = format!("nics[{index}] (\"{}\")", nic.name);
            if nic.name.trim().is_empty() || nic.name.contains(',') {
                return Err(invalid(format!(
                    "{what}: a NIC name must be non-empty and have no comma"
                )));
            }
            if nics.iter().any(|seen: &FileNic| seen.name == nic.name) {
                return Err(invalid(format!("{what}: NIC {} is listed twice", nic.name)));
            }
            nics.push(FileNic {
                pci: nic
                    .pci
                    .as_deref()
                    .map(|text| parse_pci(&what, text))
                    .transpose()?,
                name: nic.name,
                kind: nic.kind.map(|kind| match kind {
                    KindSpec::Rdma => NicKind::Rdma,
                    KindSpec::Net => NicKind::Net,
                }),
                numa: nic.numa.map(numa),
                state: nic.state.map(|state| match state {
                    StateSpec::Active => LinkState::Active,
                    StateSpec::Armed => LinkState::Armed,
                    StateSpec::Init => LinkState::Init,
                    StateSpec::Down => LinkState::Down,
                    StateSpec::Unknown => LinkState::Unknown,
                }),
                speed_mbps: nic.speed_mbps,
                netdevs: nic.netdevs,
            });
        }

        let mut gpus = Vec::with_capacity(spec.gpus.len());
        for (index, gpu) in spec.gpus.into_iter().enumerate() {
            let what = format!("gpus[{index}] (\"{}\")", gpu.name);
            let location = match gpu.name.parse::<MemoryLocation>() {
                Ok(location @ (MemoryLocation::Cuda(_) | MemoryLocation::Rocm(_))) => location,
                _ => return Err(invalid(format!("{what}: a GPU name is cuda:N or rocm:N"))),
            };
            if gpus.iter().any(|seen: &FileGpu| seen.location == location) {
                return Err(invalid(format!("{what}: {location} is listed twice")));
            }
            gpus.push(FileGpu {
                location,
                pci: gpu
                    .pci
                    .as_deref()
                    .map(|text| parse_pci(&what, text))
                    .transpose()?,
                numa: gpu.numa.map(numa),
            });
        }

        let mut preferred = Vec::with_capacity(spec.preferred.len());
        for (location_name, names) in spec.preferred {
            let location = location_name
                .parse::<MemoryLocation>()
                .map_err(|error| invalid(format!("\"preferred\": {error}")))?;
            for (position, name) in names.iter().enumerate() {
                if names[..position].contains(name) {
                    return Err(invalid(format!(
                        "\"preferred\" for {location} lists {name} twice"
                    )));
                }
            }
            preferred.push((location, names));
        }

        Ok(TopologyFile {
            path: path.to_path_buf(),
            nics,
            gpus,
            preferred,
        })
    }

    /// An error about this file.
    pub(crate) fn invalid(&self, message: String) -> TopologyError {
        TopologyError::TopologyFileInvalid {
            path: self.path.clone(),
            message,
        }
    }
}

fn syntax_error(path: &Path, error: &serde_json::Error) -> TopologyError {
    let full = error.to_string();
    // serde_json appends the position, which the error reports on its own.
    let suffix = format!(" at line {} column {}", error.line(), error.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
    TopologyError::TopologyFileSyntax {
        path: path.to_path_buf(),
        line: error.line(),
        column: error.column(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TopologyFile, TopologyError> {
        TopologyFile::parse(Path::new("/etc/ferry/topo.json"), text)
    }

    #[test]
    fn accepts_the_documented_example() {
        let file = parse(
            r#"{
              "nics": [{"name": "mlx5_0", "kind": "rdma", "pci": "0000:00:06.0", "numa": 0,
                        "state": "active", "speed_mbps": 200000, "netdevs": ["ib0"]},
                       {"name": "eth9", "numa": -1}],
              "gpus": [{"name": "cuda:0", "pci": "0000:00:04.0", "numa": 0}],
              "preferred": {"cuda:0": ["mlx5_1", "mlx5_0"], "cpu:0": ["mlx5_0"]}
            }"#,
        )
        .expect("valid file");
        assert_eq!(file.nics.len(), 2);
        assert_eq!(file.nics[1].numa, Some(None));
        assert_eq!(file.gpus[0].location, MemoryLocation::Cuda(0));
        assert_eq!(file.preferred.len(), 2);
        assert!(parse("{}").is_ok());
    }

    #[test]
    fn errors_name_the_file_and_the_place() {
        let error = parse("{\n  \"nics\": [{\"name\": \"x\", \"numa\": \"zero\"}]\n}")
            .expect_err("wrong type");
        let text = error.to_string();
        assert!(text.contains("/etc/ferry/topo.json"), "{text}");
        assert!(text.contains("line 2"), "{text}");
        assert!(matches!(
            error,
            TopologyError::TopologyFileSyntax { line: 2, .. }
        ));

        let typo = parse(r#"{"prefered": {}}"#)
            .expect_err("unknown key")
            .to_string();
        assert!(typo.contains("prefered"), "{typo}");
        let array = parse("\n  []").expect_err("array");
        assert!(matches!(
            array,
            TopologyError::TopologyFileSyntax {
                line: 2,
                column: 3,
                ..
            }
        ));
        let truncated = parse(r#"{"nics": ["#).expect_err("truncated").to_string();
        assert!(truncated.contains("line 1"), "{truncated}");

        for (text, needle) in [
            (r#"{"nics": [{"name": "a", "pci": "nope"}]}"#, "nope"),
            (r#"{"nics": [{"name": "a"}, {"name": "a"}]}"#, "twice"),
            (
                r#"{"nics": [{"name": "a", "kind": "infiniband"}]}"#,
                "infiniband",
            ),
            (r#"{"gpus": [{"name": "gpu0"}]}"#, "cuda:N"),
            (r#"{"preferred": {"cuda0": ["a"]}}"#, "cuda0"),
            (r#"{"preferred": {"cuda:0": ["a", "a"]}}"#, "twice"),
        ] {
            let message = parse(text).expect_err(text).to_string();
            assert!(message.contains(needle), "{text}: {message}");
            assert!(message.contains("/etc/ferry/topo.json"), "{message}");
        }
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let error = TopologyFile::load(Path::new("/nonexistent/ferry-topo.json"))
            .expect_err("missing")
            .to_string();
        assert!(error.contains("/nonexistent/ferry-topo.json"), "{error}");
        assert!(error.contains("FERRY_TOPOLOGY_FILE"), "{error}");
    }
}
