//! A route as an operator sees it (`Engine::route`, `ferry demo`): which
//! transport would carry a request and why, including the host leg of
//! staged device memory, and which local interface the kernel uses to
//! reach the peer's host.
//!
//! Reaches in Shared: `segments`, `topology`, `transports`.

use super::request::{Route, RouteNic, SegmentId};
use super::segments::{remote_out_of_bounds, RemoteSegment};
use super::shared::Shared;
use crate::error::Result;
use crate::memory::LocalBuffer;
use ferry_plugins_abi::sys;

impl Shared {
    /// Which transport would carry a request from `local_addr` to this
    /// segment, and why.
    pub(crate) fn route(
        &self,
        segment: SegmentId,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
    ) -> Result<Route> {
        let planner = self.planner();
        let seg = self.segments.get(segment)?;
        let local = planner.local_buffer(0, local_addr, len)?;
        let view = seg.view.read().clone();
        let remote = view
            .find(remote_addr, len)
            .ok_or_else(|| remote_out_of_bounds(0, &seg, remote_addr, len, view.buffers.len()))?;
        let remote_on_device = !view.buffers[remote].location.starts_with("cpu");
        let (t, reason, estimate) = match planner
            .select(&local, &seg, &view, remote, len, None, true)
        {
            Ok(c) => {
                let estimate = c.scored.map(|s| self.transports.route_estimate(&s, None));
                (c.transport, c.reason, estimate)
            }
            Err(e) if local.device.is_none() && !remote_on_device => return Err(e),
            Err(direct) => {
                // Device memory that no transport moves directly is staged:
                // the host leg runs between pinned slots.
                let host_local = match local.device {
                    Some(_) => self.local_slot_buffer()?,
                    None => local.clone(),
                };
                let (v, idx) = if remote_on_device {
                    (self.remote_staging(&seg)?.view().clone(), 0)
                } else {
                    (view.clone(), remote)
                };
                let host = planner.select(&host_local, &seg, &v, idx, len, None, true)?;
                let (sides, ends) = match (local.device.is_some(), remote_on_device) {
                    (true, true) => ("on both sides", 2),
                    (true, false) => ("on this side", 1),
                    _ => ("at the peer", 1),
                };
                let estimate = host
                    .scored
                    .map(|s| self.transports.route_estimate(&s, Some((ends, len))));
                (
                    host.transport,
                    format!(
                        "{} memory to {} memory: no transport moves device memory directly here, \
                         so it is staged through pinned host memory {sides}, pipelined{}; host leg: {}; not direct: {}",
                        local.location,
                        view.buffers[remote].location,
                        estimate
                            .as_ref()
                            .map(|e| format!(
                                " (estimated {:.1} us with a device copy at each staged end)",
                                e.seconds * 1e6
                            ))
                            .unwrap_or_default(),
                        host.reason,
                        direct.message
                    ),
                    estimate,
                )
            }
        };
        let transport = &self.transports[t];
        let peer = seg.peer(t, transport).ok();
        // Socket transports go where the kernel routes: shown when the
        // interface the kernel picks is one of the transport's own devices
        // (a transport that picks its NICs itself names NICs, not
        // interfaces; same-host transports use none).
        let nic = if transport.scopes & sys::FERRY_SCOPE_CROSS_HOST == 0 {
            None
        } else {
            self.route_nic(&seg, &local)
                .filter(|n| transport.devices.iter().any(|d| d.name == n.interface))
        };
        Ok(Route {
            transport: transport.name.clone(),
            scope: seg.scope,
            reason,
            peer_detail: peer.and_then(|p| transport.describe(&p)),
            nic,
            estimate,
        })
    }

    /// The interface the kernel uses toward the segment's host, and its NIC.
    fn route_nic(&self, seg: &RemoteSegment, local: &LocalBuffer) -> Option<RouteNic> {
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
