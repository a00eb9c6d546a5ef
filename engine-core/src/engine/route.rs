//! The route toward a peer as an operator sees it: which local interface
//! the kernel uses to reach the peer's host, and where that NIC sits.

use super::request::RouteNic;
use super::segments::RemoteSegment;
use super::shared::Shared;
use crate::memory::LocalBuffer;

impl Shared {
    /// The interface the kernel uses toward the segment's host, and its NIC.
    pub(crate) fn route_nic(&self, seg: &RemoteSegment, local: &LocalBuffer) -> Option<RouteNic> {
        use std::net::ToSocketAddrs;
        let control = seg.view.read().descriptor.control_addr().to_string();
        let peer = control.to_socket_addrs().ok()?.next()?;
        let local_ip = ferry_plugins_abi::sdk::net::source_address_toward(peer)?;
        let itf = ferry_plugins_abi::sdk::net::interface_with(local_ip)?;
        let nic = self
            .topology
            .nic_by_netdev(&itf.name)
            .or_else(|| self.topology.nic(&itf.name));
        let location = local.location.to_string();
        Some(RouteNic {
            interface: itf.name.clone(),
            local_ip,
            loopback: itf.loopback,
            nic: nic.map(|n| n.name.clone()),
            pci: nic.and_then(|n| n.pci.map(|p| p.to_string())),
            class: nic.and_then(|n| self.topology.path_class(&location, &n.name)),
        })
    }
}
