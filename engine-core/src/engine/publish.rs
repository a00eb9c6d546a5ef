//! What peers see of this engine: its segment descriptor (identity,
//! transport endpoints, published buffers), also stored in the metadata
//! store when there is one.
//!
//! Reaches in Shared: `layouts`, `memory`, `metrics`, `node`, `transports`.

use super::shared::Shared;
use crate::descriptor::{
    encode_blob, BufferDescriptor, BufferKey, SegmentDescriptor, TransportEndpoint,
    DESCRIPTOR_VERSION,
};
use crate::memory::{LocalBuffer, Visibility};

impl Shared {
    /// A buffer as peers see it; `order` is its registration number.
    pub(crate) fn buffer_descriptor(&self, b: &LocalBuffer, order: u64) -> BufferDescriptor {
        BufferDescriptor {
            addr: b.addr,
            len: b.len,
            location: b.location.to_string(),
            keys: b
                .registrations
                .iter()
                .map(|r| BufferKey {
                    transport: self.transports[r.transport].name.clone(),
                    key: encode_blob(&r.key),
                })
                .collect(),
            order,
        }
    }

    pub(crate) fn describe(&self) -> SegmentDescriptor {
        let buffers = self
            .memory
            .all_numbered()
            .iter()
            .filter(|(_, b)| b.visibility == Visibility::Published)
            .map(|(n, b)| self.buffer_descriptor(b, *n))
            .collect();
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: self.node.name.clone(),
            control: self.node.control_addr.clone(),
            engine_id: self.node.identity.engine_id.clone(),
            machine_id: self.node.identity.machine_id.clone(),
            process_id: self.node.identity.process_id.clone(),
            transports: self
                .transports
                .endpoints
                .iter()
                .map(|(name, e)| TransportEndpoint {
                    name: name.clone(),
                    endpoint: encode_blob(e),
                })
                .collect(),
            buffers,
            metrics: self.metrics.advertised(),
            layouts: self.layouts.descriptors(),
        }
    }

    /// Stores this engine's descriptor in the metadata store, if any.
    pub(crate) fn publish(&self) {
        self.node.publish(|| self.describe());
    }
}
