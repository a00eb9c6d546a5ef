//! The simulated machines: which kinds a cluster of N holds, each kind's
//! sysfs fixture, and the verbs emulator's device file written from that
//! fixture (one emulated NIC per RDMA device the tree shows, with GUIDs and
//! LIDs unique in the run, so hosts are told apart on the fabric).

use ferry_core::topology::{PathClass, Topology, TopologyConfig};
use ferry_topology_fixtures::{self as fixture, SysfsBuilder};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// DGX-class: 8 GPUs (the fake GPU plugin), 8 InfiniBand compute NICs
    /// and 4 RoCE storage ports.
    Gpu,
    /// Two sockets, one RoCE NIC each, no GPU.
    CpuRdma,
    /// A cloud VM: virtio-net only.
    Tcp,
}

impl Kind {
    pub fn fixture(self) -> &'static str {
        match self {
            Kind::Gpu => "dgx-h100",
            Kind::CpuRdma => "no-gpu",
            Kind::Tcp => "cloud-vm",
        }
    }

    pub fn stem(self) -> &'static str {
        match self {
            Kind::Gpu => "gpu",
            Kind::CpuRdma => "cpu",
            Kind::Tcp => "vm",
        }
    }
}

/// The mix of N hosts: half GPU hosts, a quarter CPU hosts with RDMA, the
/// rest TCP-only VMs (8: 4 + 2 + 2; 4: 2 + 1 + 1).
pub fn mix(n: usize) -> Vec<Kind> {
    let gpu = (n / 2).max(1);
    let cpu = (n / 4).max(1);
    let tcp = n.saturating_sub(gpu + cpu).max(1);
    std::iter::repeat_n(Kind::Gpu, gpu)
        .chain(std::iter::repeat_n(Kind::CpuRdma, cpu))
        .chain(std::iter::repeat_n(Kind::Tcp, tcp))
        .collect()
}

/// A cloud VM (the `flat-vm` fixture's shape without its passthrough GPUs
/// and NICs): one root bus, numa_node -1, a virtio-net interface named
/// like the veth the simulation gives it.
fn cloud_vm() -> SysfsBuilder {
    SysfsBuilder::new()
        .numa_node(0, "0-7")
        .host_bridge("0000:00", -1)
        .virtio_net("eth0", "0000:00:03.0", 0)
}

/// An emulated RDMA NIC of one host.
#[derive(Clone, Debug)]
pub struct RdmaNic {
    pub name: String,
    /// "InfiniBand" or "Ethernet", as sysfs says.
    pub link: String,
    pub guid: u64,
}

/// One simulated machine: its fixture, as the driver reads it for the rules.
pub struct Machine {
    pub kind: Kind,
    /// `<dir>/sys` (the sysfs tree) and `<dir>/verbs.conf`.
    pub dir: PathBuf,
    pub topology: Topology,
    pub rdma: Vec<RdmaNic>,
}

impl Machine {
    /// Writes the fixture of host number `index` into `dir`.
    pub fn write(kind: Kind, index: usize, dir: &Path) -> Result<Machine, String> {
        let sys = dir.join("sys");
        let builder = match kind {
            Kind::Tcp => cloud_vm(),
            k => {
                fixture::named(k.fixture()).ok_or_else(|| format!("no fixture {}", k.fixture()))?
            }
        };
        builder
            .write(&sys)
            .map_err(|e| format!("writing the {} fixture: {e}", kind.fixture()))?;
        let (conf, rdma) = verbs_conf(&sys, index)?;
        std::fs::write(dir.join("verbs.conf"), conf).map_err(|e| format!("verbs.conf: {e}"))?;
        let topology = Topology::discover(&TopologyConfig::for_sysfs_root(&sys))
            .map_err(|e| format!("topology of {}: {e}", sys.display()))?;
        Ok(Machine {
            kind,
            dir: dir.to_path_buf(),
            topology,
            rdma,
        })
    }

    /// Memory locations the host's node registers a buffer at.
    pub fn locations(&self) -> (Vec<String>, Vec<String>) {
        let mut cpus: Vec<String> = self
            .topology
            .numa_nodes()
            .iter()
            .filter(|n| n.has_cpus())
            .map(|n| format!("cpu:{}", n.id))
            .collect();
        if cpus.is_empty() {
            cpus.push("cpu:0".into());
        }
        let gpus = if self.kind == Kind::Gpu {
            (0..self.topology.gpus().len())
                .map(|i| format!("cuda:{i}"))
                .collect()
        } else {
            Vec::new()
        };
        (cpus, gpus)
    }

    pub fn link_layers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.rdma.iter().map(|n| n.link.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// The NICs the fixture ranks nearest to `location` among those that
    /// share a link layer with `peer_links`: the smallest path class, then
    /// the fastest, all that tie.
    pub fn nearest(&self, location: &str, peer_links: &[String]) -> Vec<String> {
        self.nearest_without(location, peer_links, &[])
    }

    /// As [`Machine::nearest`], leaving out the NICs in `failed`.
    pub fn nearest_without(
        &self,
        location: &str,
        peer_links: &[String],
        failed: &[String],
    ) -> Vec<String> {
        let key = |n: &RdmaNic| {
            let nic = self.topology.nic(&n.name);
            let class = self
                .topology
                .path_class(location, &n.name)
                .unwrap_or(PathClass::Unknown);
            let speed = nic.and_then(|t| t.speed_mbps).unwrap_or(0);
            (class, std::cmp::Reverse(speed))
        };
        let usable: Vec<&RdmaNic> = self
            .rdma
            .iter()
            .filter(|n| peer_links.contains(&n.link) && !failed.contains(&n.name))
            .collect();
        let Some(best) = usable.iter().map(|n| key(n)).min() else {
            return Vec::new();
        };
        let mut out: Vec<String> = usable
            .iter()
            .filter(|n| key(n) == best)
            .map(|n| n.name.clone())
            .collect();
        out.sort();
        out
    }

    /// The path class from `location` to `nic` ("PIX", ...).
    pub fn class(&self, location: &str, nic: &str) -> Option<PathClass> {
        self.topology.path_class(location, nic)
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The emulator's device file for the RDMA devices of the tree at `sys`:
/// PCI function, link layer, speed and width, port state as the tree says;
/// node GUID 02c9:03<host>:00<nic>, LID 0x<host><nic> + 1 on InfiniBand, and
/// on RoCE a v2 GID holding an IPv4 address of the host's storage subnet.
fn verbs_conf(sys: &Path, host: usize) -> Result<(String, Vec<RdmaNic>), String> {
    let class = sys.join("class/infiniband");
    let mut names: Vec<String> = std::fs::read_dir(&class)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort_by_key(|n| {
        let digits: String = n.chars().filter(char::is_ascii_digit).collect();
        (digits.parse::<u32>().unwrap_or(0), n.clone())
    });
    let mut conf = String::from(
        "# Written by ferry-cluster from this host's sysfs fixture: one emulated NIC per RDMA device.\n",
    );
    let mut nics = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let dev = class.join(name);
        let pci = std::fs::canonicalize(dev.join("device"))
            .ok()
            .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
            .ok_or_else(|| format!("{}: no device link", dev.display()))?;
        let port = dev.join("ports/1");
        let link = read(&port.join("link_layer"));
        let rate = read(&port.join("rate"));
        // "400 Gb/sec (4X NDR)"
        let (width, speed) = rate
            .split_once('(')
            .and_then(|(_, r)| r.trim_end_matches(')').split_once(' '))
            .map(|(w, s)| (w.to_string(), s.to_string()))
            .unwrap_or_else(|| ("4X".into(), "EDR".into()));
        let state = if read(&port.join("state")).contains("ACTIVE") {
            "ACTIVE"
        } else {
            "DOWN"
        };
        let guid: u64 = 0x02c9_0300_0000_0000 | ((host as u64) << 24) | ((i as u64) << 8);
        let g = format!(
            "{:04x}:{:04x}:{:04x}:{:04x}",
            guid >> 48,
            (guid >> 32) & 0xffff,
            (guid >> 16) & 0xffff,
            guid & 0xffff
        );
        let _ = writeln!(conf, "\n[{name}]\npci = {pci}\nguid = {g}");
        let _ = writeln!(conf, "port1.link_layer = {link}\nport1.speed = {speed}");
        let _ = writeln!(conf, "port1.width = {width}\nport1.state = {state}");
        if link == "InfiniBand" {
            let _ = writeln!(conf, "port1.lid = {:#x}", (host + 1) * 0x40 + i + 1);
        } else {
            let _ = writeln!(conf, "port1.gid1 = ::ffff:10.78.{host}.{} RoCEv2", i + 1);
        }
        nics.push(RdmaNic {
            name: name.clone(),
            link,
            guid,
        });
    }
    Ok((conf, nics))
}
