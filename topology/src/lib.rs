//! Hardware topology from sysfs alone: which NIC is closest to which memory.
//!
//! Without a driver library, Ferry reads the PCI tree, NUMA nodes, GPUs, RDMA
//! devices and network interfaces from sysfs, gives every (memory location,
//! NIC) pair a [`PathClass`] as `nvidia-smi topo -m` would, and ranks NICs for
//! each memory location: `cpu:N` per NUMA node, `cuda:N` per NVIDIA GPU,
//! `rocm:N` per AMD GPU.
//!
//! ```no_run
//! use ferry_topology::{Topology, TopologyConfig};
//! let topology = Topology::discover(&TopologyConfig::from_env())?;
//! for warning in topology.warnings() {
//!     eprintln!("topology: {warning}");
//! }
//! if let Some(best) = topology.preferred_nics("cuda:0").and_then(|list| list.first()) {
//!     println!("cuda:0 -> {} ({})", best.name, best.class);
//! }
//! # Ok::<(), ferry_topology::TopologyError>(())
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
mod model;
mod nic_discovery;
mod nic_filter;
pub mod override_file;
mod pci;
mod rank;
mod render;
mod scan;
mod sysfs;
mod visible;

pub use class::PathClass;
pub use config::{
    TopologyConfig, DEFAULT_SYSFS_ROOT, ENV_CUDA_VISIBLE_DEVICES, ENV_NICS, ENV_SYSFS_ROOT,
    ENV_TOPOLOGY_FILE,
};
pub use error::TopologyError;
pub use model::{
    Gpu, GpuVendor, LinkState, MemoryLocation, Nic, NicKind, NumaNode, RankedNic, RdmaPort,
    Topology,
};
pub use pci::{PciAddress, PciAddressParseError};
