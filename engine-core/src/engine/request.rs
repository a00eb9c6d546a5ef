//! What an application asks of the engine (requests, operations) and what
//! it is told back about a route (where the peer is, which transport, why).

use ferry_plugins_abi::sys;
use ferry_topology::PathClass;
use std::net::IpAddr;
use std::sync::Arc;

/// Identifies an open remote segment within one engine.
pub type SegmentId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Remote -> local.
    Read,
    /// Local -> remote.
    Write,
}

impl Op {
    pub(crate) fn raw(self) -> u32 {
        match self {
            Op::Read => sys::FERRY_OP_READ,
            Op::Write => sys::FERRY_OP_WRITE,
        }
    }
}

/// One transfer between local memory and a remote segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub local_addr: u64,
    pub segment: SegmentId,
    pub remote_addr: u64,
    pub length: u64,
    /// Use this transport if it can serve the request (else an error).
    /// Shared: the requests of a batch that name one transport hold one
    /// string (`Some("tcp".into())`).
    pub transport: Option<Arc<str>>,
}

impl Request {
    pub fn new(op: Op, local_addr: u64, segment: SegmentId, remote_addr: u64, length: u64) -> Self {
        Request {
            op,
            local_addr,
            segment,
            remote_addr,
            length,
            transport: None,
        }
    }
}

/// Where a peer is, relative to this engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    SameProcess,
    SameHost,
    CrossHost,
}

impl Scope {
    pub(crate) fn raw(self) -> u32 {
        match self {
            Scope::SameProcess => sys::FERRY_SCOPE_SAME_PROCESS,
            Scope::SameHost => sys::FERRY_SCOPE_SAME_HOST,
            Scope::CrossHost => sys::FERRY_SCOPE_CROSS_HOST,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::SameProcess => "same process",
            Scope::SameHost => "same host",
            Scope::CrossHost => "another host",
        }
    }
}

/// Why a transport was chosen, for logs and `ferry demo`.
#[derive(Clone, Debug)]
pub struct Route {
    pub transport: String,
    pub scope: Scope,
    pub reason: String,
    /// The plugin's own description of how it reaches the peer.
    pub peer_detail: Option<String>,
    /// For socket transports: the interface the kernel routes through.
    pub nic: Option<RouteNic>,
    /// What the choice rests on: the estimate and the measured figures
    /// (`None` for a requested transport).
    pub estimate: Option<RouteEstimate>,
}

impl Route {
    /// The route as JSON, for the C API (`ferry_route_json`): transport,
    /// scope, reason, peer detail, and the estimate with the measured
    /// figures (null where unknown).
    pub fn to_json(&self) -> String {
        let estimate = self.estimate.as_ref().map(|e| {
            serde_json::json!({
                "seconds": e.seconds,
                "bandwidth_mbps": e.bandwidth_mbps,
                "latency_ns": e.latency_ns,
                "declared": e.declared,
                "device": e.device,
                "measured_bandwidth_mbps": e.measured_bandwidth_mbps,
                "bandwidth_samples": e.bandwidth_samples,
                "measured_latency_ns": e.measured_latency_ns,
                "latency_samples": e.latency_samples,
            })
        });
        serde_json::json!({
            "transport": self.transport,
            "scope": self.scope.as_str(),
            "reason": self.reason,
            "peer_detail": self.peer_detail,
            "interface": self.nic.as_ref().map(|n| n.interface.clone()),
            "estimate": estimate,
        })
        .to_string()
    }
}

/// The cost model's figures behind a route, and what the engine measured
/// on it; also in `reason`, in words.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteEstimate {
    /// Estimated time for the request, in seconds.
    pub seconds: f64,
    /// The path's figures used: declared (or the scope's defaults), or
    /// measured where measurement contradicted them.
    pub bandwidth_mbps: f64,
    pub latency_ns: f64,
    /// Whether the plugin declared the device's figures.
    pub declared: bool,
    /// The local device the route runs through, as its plugin named it.
    pub device: Option<String>,
    /// Measured throughput (Mbit/s) and latency (ns) toward this peer, with
    /// the number of samples behind each.
    pub measured_bandwidth_mbps: Option<f64>,
    pub bandwidth_samples: u32,
    pub measured_latency_ns: Option<f64>,
    pub latency_samples: u32,
}

/// The local interface toward a peer and where it sits in the topology.
#[derive(Clone, Debug)]
pub struct RouteNic {
    pub interface: String,
    pub local_ip: IpAddr,
    pub loopback: bool,
    /// The topology's NIC behind the interface (its PCI function), if any.
    pub nic: Option<String>,
    pub pci: Option<String>,
    /// Path class from the local buffer's location to that NIC.
    pub class: Option<PathClass>,
}
