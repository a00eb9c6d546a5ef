//! Memory registered with an engine: where each buffer is, and what every
//! transport returned when it was registered there.

use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// One transport's registration of a buffer.
#[derive(Clone, Debug)]
pub struct TransportRegistration {
    /// Index into the engine's transport list.
    pub transport: usize,
    pub handle: u64,
    pub key: Vec<u8>,
    /// How the transport registered it: one `FERRY_MEM_*` bit (for device
    /// memory, DMA-BUF or nvidia-peermem).
    pub mem_kind: u64,
}

/// Who may see a registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// In the segment descriptor: any peer may read and write it.
    Published,
    /// Reachable by peers, but only announced to one (staging buffers).
    Hidden,
    /// A local source or destination only; no peer reaches it.
    LocalOnly,
}

#[derive(Debug)]
pub struct LocalBuffer {
    pub addr: u64,
    pub len: u64,
    pub location: Location,
    /// One `FERRY_MEM_*` bit for host memory; 0 for device memory, which
    /// moves as each transport registered it (`registrations`) or staged.
    pub mem_kind: u64,
    /// The device plugin owning the memory (index), for device memory.
    pub device: Option<usize>,
    pub visibility: Visibility,
    pub registrations: Vec<TransportRegistration>,
    /// Requests in flight that read or write this buffer locally.
    pub inflight: AtomicUsize,
}

impl LocalBuffer {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    pub fn registration(&self, transport: usize) -> Option<&TransportRegistration> {
        self.registrations.iter().find(|r| r.transport == transport)
    }
}

/// Registered buffers by start address; they never overlap.
#[derive(Default)]
pub struct MemoryRegistry {
    buffers: RwLock<BTreeMap<u64, Arc<LocalBuffer>>>,
}

impl MemoryRegistry {
    /// The buffer containing all of `[addr, addr + len)`.
    pub fn find(&self, addr: u64, len: u64) -> Option<Arc<LocalBuffer>> {
        let end = addr.checked_add(len)?;
        let map = self.buffers.read();
        let (_, b) = map.range(..=addr).next_back()?;
        (end <= b.end()).then(|| b.clone())
    }

    /// Fails when `[addr, addr + len)` overlaps a registered buffer.
    pub fn check_free(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr.checked_add(len).ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                "the buffer wraps around the address space",
            )
        })?;
        let map = self.buffers.read();
        if let Some((_, b)) = map.range(..end).next_back() {
            if b.end() > addr {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "[{addr:#x}, {end:#x}) overlaps the registered buffer [{:#x}, {:#x})",
                        b.addr,
                        b.end()
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn insert(&self, buffer: Arc<LocalBuffer>) {
        self.buffers.write().insert(buffer.addr, buffer);
    }

    pub fn remove(&self, addr: u64) -> Option<Arc<LocalBuffer>> {
        self.buffers.write().remove(&addr)
    }

    pub fn all(&self) -> Vec<Arc<LocalBuffer>> {
        self.buffers.read().values().cloned().collect()
    }
}
