//! Hardware topology from sysfs alone: which NIC is closest to which memory.
//!
//! Without a driver library, Ferry reads the PCI tree, NUMA nodes, GPUs, RDMA
//! devices and network interfaces from sysfs, gives every (memory location,
//! NIC) pair a [`PathClass`] as `nvidia-smi topo -m` would, and ranks NICs for
//! each memory location: `cpu:N` per NUMA node, `cuda:N` per NVIDIA GPU,
//! `rocm:N` per AMD GPU.
//!
//! ```no_run
//! use ferry_core::topology::{Topology, TopologyConfig};
//! let topology = Topology::discover(&TopologyConfig::from_env())?;
//! for warning in topology.warnings() {
//!     eprintln!("topology: {warning}");
//! }
//! if let Some(best) = topology.preferred_nics("cuda:0").and_then(|list| list.first()) {
//!     println!("cuda:0 -> {} ({})", best.name, best.class);
//! }
//! # Ok::<(), ferry_core::topology::TopologyError>(())
//! ```
//!
//! # Decisions
//!
//! - **Sysfs root**: `FERRY_SYSFS_ROOT` replaces `/sys` for every read; every
//!   link is resolved with realpath and must stay inside the root, otherwise it
//!   is ignored with a warning. Missing pieces degrade discovery; only an
//!   unusable root or a bad topology file is an error ([`TopologyError`]).
//! - **Path classes**: from canonical PCI paths, by the lowest common ancestor
//!   of the two functions, never by counting '/' (see the `pci` module for how
//!   switches are counted): PIX for at most one switch, PXB for more, PHB when
//!   only the host bridge is shared, NODE for different host bridges on one
//!   NUMA node, SYS across nodes. `cpu:N` rows are PHB for NICs on node N and
//!   SYS for others (NODE for a CPU-less node's nearest CPU node).
//! - **Unknown NUMA** (`numa_node` = -1): on a single-node machine it is that
//!   node; otherwise it stays unknown and counts as "same node", so it can make
//!   a pair NODE but never SYS.
//! - **GPUs**: vendor 0x10de or 0x1002 with PCI class 0x03xx (or 0x12xx,
//!   processing accelerator). NVIDIA GPUs are `cuda:N` in PCI bus order with
//!   `CUDA_VISIBLE_DEVICES` applied (see the `visible` module; UUID entries
//!   cannot be resolved from sysfs, so the variable is then ignored with a
//!   warning). AMD GPUs are `rocm:N` so they never shift CUDA ordinals. GPU
//!   virtual functions are skipped.
//! - **NICs**: one [`Nic`] per RDMA device, whatever its port count (its
//!   state is its best port's); a two-function card is two NICs. Network
//!   interfaces on a PCI function that has an RDMA device are that device's
//!   `netdevs`; the others are NICs of kind `net`. Switchdev representors are
//!   not NICs. An SR-IOV VF is dropped when its PF is listed (unless
//!   `FERRY_NICS` names it), and kept when the PF is not visible.
//! - **Ranking** and spreading: see the `rank` module. `FERRY_NICS` filters
//!   (`nic_filter`), the topology file pins and adds (`override_file`).

mod class;
mod config;
mod discover;
mod error;
pub mod fixture;
mod model;
mod nic_discovery;
mod nic_filter;
pub mod override_file;
mod pci;
mod rank;
mod render;
mod sysfs;
mod visible;

use std::path::{Path, PathBuf};

pub use class::PathClass;
pub use config::{
    TopologyConfig, DEFAULT_SYSFS_ROOT, ENV_CUDA_VISIBLE_DEVICES, ENV_NICS, ENV_SYSFS_ROOT,
    ENV_TOPOLOGY_FILE,
};
pub use error::TopologyError;
pub use model::{
    Gpu, GpuVendor, LinkState, MemoryLocation, Nic, NicKind, NumaNode, RankedNic, RdmaPort,
};
pub use pci::{PciAddress, PciAddressParseError};

/// What discovery found, with every pair classified and every location ranked.
#[derive(Debug, Clone)]
pub struct Topology {
    sysfs_root: PathBuf,
    numa_nodes: Vec<NumaNode>,
    gpus: Vec<Gpu>,
    nics: Vec<Nic>,
    /// `cpu:N` rows, then GPUs.
    locations: Vec<String>,
    /// `classes[location][nic]`.
    classes: Vec<Vec<PathClass>>,
    /// `preferred[location]`, best first.
    preferred: Vec<Vec<RankedNic>>,
    warnings: Vec<String>,
}

impl Topology {
    /// A topology that knows nothing (no sysfs could be read).
    pub fn empty() -> Topology {
        Topology {
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            numa_nodes: Vec::new(),
            gpus: Vec::new(),
            nics: Vec::new(),
            locations: Vec::new(),
            classes: Vec::new(),
            preferred: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// Discovers the topology under `config.sysfs_root`. Logs only at debug
    /// level; the caller decides what to say about the result and the
    /// [`Topology::warnings`].
    pub fn discover(config: &TopologyConfig) -> Result<Topology, TopologyError> {
        discover::discover(config)
    }

    /// The canonical sysfs root that was read.
    pub fn sysfs_root(&self) -> &Path {
        &self.sysfs_root
    }

    /// NUMA nodes by id.
    pub fn numa_nodes(&self) -> &[NumaNode] {
        &self.numa_nodes
    }

    /// GPUs: `cuda:N` by ordinal, then `rocm:N`.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// NICs: RDMA devices, then network interfaces, each in natural name order.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Things an operator may want to know: links leaving the root, NIC names
    /// in `FERRY_NICS` that do not exist, unresolvable `CUDA_VISIBLE_DEVICES`
    /// entries, ...
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Memory location names: `cpu:N` for each NUMA node, then `cuda:N` and
    /// `rocm:N` for each GPU.
    pub fn locations(&self) -> impl Iterator<Item = &str> {
        self.locations.iter().map(String::as_str)
    }

    /// The GPU called `name` (`cuda:0`).
    pub fn gpu(&self, name: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| gpu.name == name)
    }

    /// The GPU at a PCI address (any spelling [`PciAddress`] parses).
    pub fn gpu_by_pci(&self, address: &PciAddress) -> Option<&Gpu> {
        self.gpus
            .iter()
            .find(|gpu| gpu.pci.as_ref() == Some(address))
    }

    /// The NIC called `name` (`mlx5_0`, `eth0`).
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|nic| nic.name == name)
    }

    /// The NIC that owns network interface `netdev` (an RDMA device for its
    /// netdevs, or the `net` NIC of that name).
    pub fn nic_by_netdev(&self, netdev: &str) -> Option<&Nic> {
        self.nics
            .iter()
            .find(|nic| nic.netdevs.iter().any(|name| name == netdev))
    }

    /// The NICs on a PCI function.
    pub fn nics_by_pci<'a>(&'a self, address: &'a PciAddress) -> impl Iterator<Item = &'a Nic> {
        self.nics
            .iter()
            .filter(move |nic| nic.pci.as_ref() == Some(address))
    }

    /// The class of the path between a memory location and a NIC; `None`
    /// when either name is unknown.
    pub fn path_class(&self, location: &str, nic: &str) -> Option<PathClass> {
        let row = self.locations.iter().position(|name| name == location)?;
        let column = self
            .nics
            .iter()
            .position(|candidate| candidate.name == nic)?;
        self.classes.get(row)?.get(column).copied()
    }

    /// The NICs for memory at `location`, best first (every NIC appears; down
    /// ones last). `None` when the location does not exist on this host.
    pub fn preferred_nics(&self, location: &str) -> Option<&[RankedNic]> {
        let row = self.locations.iter().position(|name| name == location)?;
        self.preferred.get(row).map(Vec::as_slice)
    }

    /// The chosen NIC for `location`: the first of its preferred list.
    pub fn preferred_nic(&self, location: &str) -> Option<&RankedNic> {
        self.preferred_nics(location)?.first()
    }
}
