//! The segment descriptor: what an engine publishes about itself (identity,
//! each transport's endpoint, every registered buffer with each transport's
//! key) and what a peer fetches when it opens the segment.
//!
//! It arrives from the network, so decoding is bounded and every field is
//! checked before anything trusts it.

use crate::error::{Error, ErrorCode, Result};
use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// Version of the descriptor's shape; peers refuse others with a clear error.
pub const DESCRIPTOR_VERSION: u32 = 1;

/// Limits on what a peer's descriptor may contain.
pub const MAX_BUFFERS: usize = 1 << 20;
pub const MAX_TRANSPORTS: usize = 64;
/// Most block layouts a descriptor may list.
pub const MAX_LAYOUTS: usize = 4096;
pub const MAX_NAME_LEN: usize = 256;
pub const MAX_BLOB_LEN: usize = 64 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    pub version: u32,
    /// "host:port" (or a name in a metadata store).
    pub name: String,
    /// The engine's control address, "host:port" (staging sessions, plugin
    /// messages, descriptor reads). Empty in old descriptors: the name.
    #[serde(default)]
    pub control: String,
    /// Random per engine instance: a restarted peer has a new one.
    pub engine_id: String,
    /// Same value on every engine of one host (see `identity`).
    pub machine_id: String,
    /// Same value on every engine of one process.
    pub process_id: String,
    pub transports: Vec<TransportEndpoint>,
    /// Sorted by address, non-overlapping.
    pub buffers: Vec<BufferDescriptor>,
    /// The engine's metrics endpoint ("host:port"), when it serves one
    /// (FERRY_METRICS_LISTEN); what `ferry top SEGMENT` reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// Block layouts the engine registered (pools of equal blocks, named
    /// by index in transfers); none in older descriptors.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layouts: Vec<LayoutDescriptor>,
}

/// A block layout as peers see it: `count` blocks of `block_size` bytes,
/// block `i` at `base + i * stride`, inside one published buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutDescriptor {
    pub id: u32,
    pub base: u64,
    pub block_size: u64,
    pub stride: u64,
    pub count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportEndpoint {
    pub name: String,
    /// base64 of the bytes the transport's get_endpoint returned.
    pub endpoint: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDescriptor {
    pub addr: u64,
    pub len: u64,
    pub location: String,
    /// Per transport, base64 of the key its register_memory returned.
    pub keys: Vec<BufferKey>,
    /// Its place in registration order: 1 for the engine's first buffer,
    /// increasing (0 in descriptors of engines that did not say).
    #[serde(default)]
    pub order: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferKey {
    pub transport: String,
    pub key: String,
}

pub fn encode_blob(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn decode_blob(text: &str) -> Result<Vec<u8>> {
    if text.len() > MAX_BLOB_LEN * 4 / 3 + 4 {
        return Err(protocol("a key or endpoint in the descriptor is too long"));
    }
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| protocol(&format!("a key or endpoint is not valid base64: {e}")))
}

fn protocol(msg: &str) -> Error {
    Error::new(
        ErrorCode::Protocol,
        format!("bad segment descriptor: {msg}"),
    )
}

impl SegmentDescriptor {
    /// The buffer registered first (Mooncake's `get_first_buffer_address`),
    /// by registration order, not by address; without order numbers (an
    /// older peer), the lowest address.
    pub fn first_buffer(&self) -> Option<&BufferDescriptor> {
        self.buffers
            .iter()
            .enumerate()
            .min_by_key(|(i, b)| (b.order, *i))
            .map(|(_, b)| b)
    }

    /// Where the engine's control listener is.
    pub fn control_addr(&self) -> &str {
        if self.control.is_empty() {
            &self.name
        } else {
            &self.control
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and validates a descriptor received from a peer.
    pub fn from_json(bytes: &[u8]) -> Result<SegmentDescriptor> {
        let d: SegmentDescriptor = serde_json::from_slice(bytes)
            .map_err(|e| protocol(&format!("not the expected JSON ({e})")))?;
        d.validate()?;
        Ok(d)
    }

    /// Checks every bound a peer could break.
    pub fn validate(&self) -> Result<()> {
        if self.version != DESCRIPTOR_VERSION {
            return Err(Error::new(
                ErrorCode::Protocol,
                format!(
                    "the peer's segment descriptor is version {}, this Ferry reads version {}",
                    self.version, DESCRIPTOR_VERSION
                ),
            ));
        }
        for (what, s) in [
            ("name", &self.name),
            ("engine_id", &self.engine_id),
            ("machine_id", &self.machine_id),
            ("process_id", &self.process_id),
            ("metrics", self.metrics.as_ref().unwrap_or(&String::new())),
        ] {
            if s.len() > MAX_NAME_LEN {
                return Err(protocol(&format!(
                    "{what} is longer than {MAX_NAME_LEN} bytes"
                )));
            }
        }
        if self.transports.len() > MAX_TRANSPORTS {
            return Err(protocol("too many transports"));
        }
        for t in &self.transports {
            if t.name.is_empty() || t.name.len() > 64 {
                return Err(protocol("a transport name is empty or too long"));
            }
            decode_blob(&t.endpoint)?;
        }
        if self.layouts.len() > MAX_LAYOUTS {
            return Err(protocol("too many layouts"));
        }
        // Each layout's numbers are checked where it is used (an index
        // against its count, its blocks against the buffers).
        if self.buffers.len() > MAX_BUFFERS {
            return Err(protocol("too many buffers"));
        }
        let mut prev_end: u64 = 0;
        for (i, b) in self.buffers.iter().enumerate() {
            if b.len == 0 {
                return Err(protocol("a buffer has length 0"));
            }
            let end = b
                .addr
                .checked_add(b.len)
                .ok_or_else(|| protocol("a buffer wraps around the address space"))?;
            if i > 0 && b.addr < prev_end {
                return Err(protocol("buffers overlap or are not sorted by address"));
            }
            prev_end = end;
            if b.location.len() > 64 || b.keys.len() > MAX_TRANSPORTS {
                return Err(protocol("a buffer's location or key list is too long"));
            }
            for k in &b.keys {
                if k.transport.len() > 64 {
                    return Err(protocol("a transport name is too long"));
                }
                decode_blob(&k.key)?;
            }
        }
        Ok(())
    }

    /// The buffer containing all of `[addr, addr + len)`, if one does.
    pub fn buffer_containing(&self, addr: u64, len: u64) -> Option<&BufferDescriptor> {
        let end = addr.checked_add(len)?;
        let idx = self.buffers.partition_point(|b| b.addr <= addr);
        let b = self.buffers.get(idx.checked_sub(1)?)?;
        (end <= b.addr + b.len).then_some(b)
    }

    pub fn endpoint(&self, transport: &str) -> Option<Vec<u8>> {
        self.transports
            .iter()
            .find(|t| t.name == transport)
            .and_then(|t| decode_blob(&t.endpoint).ok())
    }
}

impl BufferDescriptor {
    pub fn key(&self, transport: &str) -> Option<Vec<u8>> {
        self.keys
            .iter()
            .find(|k| k.transport == transport)
            .and_then(|k| decode_blob(&k.key).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "127.0.0.1:1234".into(),
            control: String::new(),
            engine_id: "e".into(),
            machine_id: "m".into(),
            process_id: "p".into(),
            transports: vec![TransportEndpoint {
                name: "tcp".into(),
                endpoint: encode_blob(b"127.0.0.1:9"),
            }],
            metrics: None,
            layouts: Vec::new(),
            buffers: vec![
                BufferDescriptor {
                    addr: 0x1000,
                    len: 0x1000,
                    location: "cpu:0".into(),
                    keys: vec![],
                    order: 2,
                },
                BufferDescriptor {
                    addr: 0x2000,
                    len: 0x100,
                    location: "cpu:0".into(),
                    keys: vec![],
                    order: 1,
                },
            ],
        }
    }

    #[test]
    fn round_trip_and_lookups() {
        let d = sample();
        let back = SegmentDescriptor::from_json(&d.to_json()).unwrap();
        assert_eq!(back, d);
        assert_eq!(d.endpoint("tcp").unwrap(), b"127.0.0.1:9");
        assert_eq!(d.buffer_containing(0x1000, 0x1000).unwrap().addr, 0x1000);
        assert_eq!(d.buffer_containing(0x2000, 0x100).unwrap().addr, 0x2000);
        // Straddling two adjacent buffers is not "inside one".
        assert!(d.buffer_containing(0x1f00, 0x200).is_none());
        assert!(d.buffer_containing(0xfff, 2).is_none());
        assert!(d.buffer_containing(0x2000, 0x101).is_none());
        assert!(d.buffer_containing(u64::MAX, 2).is_none());
        // Registered first, though at the higher address.
        assert_eq!(d.first_buffer().unwrap().addr, 0x2000);
        let mut old = d.clone();
        for b in &mut old.buffers {
            b.order = 0;
        }
        assert_eq!(old.first_buffer().unwrap().addr, 0x1000);
    }

    #[test]
    fn hostile_descriptors_are_refused() {
        let mut d = sample();
        d.buffers[1].addr = 0x1800;
        assert!(d.validate().is_err(), "overlap");
        let mut d = sample();
        d.buffers[0].addr = u64::MAX - 1;
        assert!(d.validate().is_err(), "wrap");
        let mut d = sample();
        d.version = 9;
        assert!(d.validate().unwrap_err().message.contains("version 9"));
        let mut d = sample();
        d.transports[0].endpoint = "***".into();
        assert!(d.validate().is_err());
        assert!(SegmentDescriptor::from_json(b"{\"version\":1").is_err());
        assert!(SegmentDescriptor::from_json(&[0xff; 64]).is_err());
    }
}
