use super::super::request::{Scope, SegmentId};
use super::super::segments::RemoteSegment;
use super::Candidate;
use crate::descriptor::{
    encode_blob, BufferDescriptor, BufferKey, SegmentDescriptor, TransportEndpoint,
    DESCRIPTOR_VERSION,
};
use crate::location::Location;
use crate::memory::{LocalBuffer, TransportRegistration, Visibility};
use ferry_loader::DeviceReport;
use ferry_plugins_abi::sys;
use std::sync::Arc;

pub(crate) const HOST: u64 = sys::FERRY_MEM_HOST;
pub(crate) const SAME_HOST: u32 = sys::FERRY_SCOPE_SAME_HOST;
pub(crate) const ANY_HOST: u32 = sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST;
pub(crate) const CROSS_HOST: u32 = sys::FERRY_SCOPE_CROSS_HOST;

/// A transport as selection sees it: what it declares.
pub(crate) struct FakeTransport {
    pub(crate) name: &'static str,
    pub(crate) mem_kinds: u64,
    pub(crate) scopes: u32,
    pub(crate) devices: Vec<DeviceReport>,
}

impl Candidate for FakeTransport {
    fn name(&self) -> &str {
        self.name
    }
    fn mem_kinds(&self) -> u64 {
        self.mem_kinds
    }
    fn scopes(&self) -> u32 {
        self.scopes
    }
    fn devices(&self) -> &[DeviceReport] {
        &self.devices
    }
}

/// A transport that declares no device (an ABI 1.0 or 1.1 plugin).
pub(crate) fn fake(name: &'static str, mem_kinds: u64, scopes: u32) -> FakeTransport {
    FakeTransport {
        name,
        mem_kinds,
        scopes,
        devices: Vec::new(),
    }
}

/// A transport with one device declaring `mbps` and `latency_ns` for the
/// memory kinds it moves.
pub(crate) fn declaring(
    name: &'static str,
    mem_kinds: u64,
    scopes: u32,
    mbps: u64,
    latency_ns: u32,
) -> FakeTransport {
    FakeTransport {
        devices: vec![DeviceReport {
            name: format!("{name}0"),
            pci: None,
            numa: None,
            detail: None,
            memory: Vec::new(),
            mem_bits: mem_kinds,
            bandwidth_mbps: Some(mbps),
            latency_ns: Some(latency_ns),
            gpu: None,
        }],
        ..fake(name, mem_kinds, scopes)
    }
}

/// tcp (any host), shm (same host), rdma (any host), declaring figures
/// like the real ones.
pub(crate) fn usual() -> Vec<FakeTransport> {
    vec![
        declaring("tcp", HOST, ANY_HOST, 25_000, 30_000),
        declaring("shm", HOST, SAME_HOST, 100_000, 2_000),
        declaring(
            "rdma",
            HOST | sys::FERRY_MEM_CUDA_DMABUF,
            ANY_HOST,
            200_000,
            3_000,
        ),
    ]
}

fn registrations(transports: &[usize], mem_kind: u64) -> Vec<TransportRegistration> {
    transports
        .iter()
        .map(|&t| TransportRegistration {
            transport: t,
            handle: t as u64 + 1,
            key: vec![t as u8],
            mem_kind,
        })
        .collect()
}

/// Host memory on NUMA node 0, registered with `transports`.
pub(crate) fn host_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
    Arc::new(LocalBuffer {
        addr,
        len,
        location: Location::Cpu(0),
        mem_kind: HOST,
        device: None,
        visibility: Visibility::Published,
        registrations: registrations(transports, HOST),
        inflight: Default::default(),
    })
}

/// Memory of cuda:0, registered directly (DMA-BUF) with `transports`.
pub(crate) fn device_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
    Arc::new(LocalBuffer {
        addr,
        len,
        location: Location::Cuda(0),
        mem_kind: 0,
        device: Some(0),
        visibility: Visibility::Published,
        registrations: registrations(transports, sys::FERRY_MEM_CUDA_DMABUF),
        inflight: Default::default(),
    })
}

/// A peer's descriptor: the transports it runs, and its buffers
/// (address, length, location, the transports that registered it).
pub(crate) fn descriptor(
    engine_id: &str,
    transports: &[&str],
    buffers: &[(u64, u64, &str, &[&str])],
) -> SegmentDescriptor {
    SegmentDescriptor {
        version: DESCRIPTOR_VERSION,
        name: "peer:1".into(),
        control: String::new(),
        engine_id: engine_id.into(),
        machine_id: "m".into(),
        process_id: "p".into(),
        transports: transports
            .iter()
            .map(|t| TransportEndpoint {
                name: t.to_string(),
                endpoint: encode_blob(t.as_bytes()),
            })
            .collect(),
        buffers: buffers
            .iter()
            .map(|(addr, len, location, keys)| BufferDescriptor {
                addr: *addr,
                len: *len,
                location: location.to_string(),
                keys: keys
                    .iter()
                    .map(|t| BufferKey {
                        transport: t.to_string(),
                        key: encode_blob(format!("{t}@{addr:#x}").as_bytes()),
                    })
                    .collect(),
                order: 0,
            })
            .collect(),
        metrics: None,
        layouts: Vec::new(),
    }
}

pub(crate) fn segment(id: SegmentId, scope: Scope, d: SegmentDescriptor) -> Arc<RemoteSegment> {
    Arc::new(RemoteSegment::new(id, "peer:1", scope, d))
}
