//! Memory the engine allocates for the application (`allocate_memory`):
//! from the first transport that allocates memory of its own, else a sealed
//! memfd mapping (`shared_memory`) that same-host transports can share with
//! peers; and its release.

use crate::error::{Error, ErrorCode, Result};
use crate::shared_memory::SharedMemory;
use crate::transport::Transport;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// Who allocated a buffer handed out by `allocate_memory`.
#[derive(Debug)]
pub(crate) enum Allocation {
    /// A transport's own memory (transport index).
    Transport(usize),
    /// The engine's shareable memory.
    Shared(SharedMemory),
}

impl Allocation {
    /// `len` bytes (near `numa_node` when given) from the first transport
    /// that allocates memory, else shareable memory of the engine's own
    /// (huge pages unless `hugepages` is false).
    pub(crate) fn obtain(
        transports: &[Arc<Transport>],
        len: u64,
        numa_node: Option<u32>,
        hugepages: bool,
    ) -> Result<(u64, Allocation)> {
        if len == 0 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "cannot allocate 0 bytes",
            ));
        }
        for (i, t) in transports.iter().enumerate() {
            match t.allocate(len, numa_node) {
                None => continue,
                Some(Ok(addr)) => return Ok((addr, Allocation::Transport(i))),
                Some(Err(e)) => log::warn!("{}: cannot allocate {len} bytes: {e}", t.name),
            }
        }
        let memory = SharedMemory::allocate(len, numa_node, hugepages)?;
        log::debug!(
            "allocated {len} bytes of shareable memory at {:#x} ({})",
            memory.addr,
            if memory.huge {
                "huge pages"
            } else {
                "normal pages"
            }
        );
        Ok((memory.addr, Allocation::Shared(memory)))
    }

    /// The file holding `[addr, +len)`, when this allocation is shareable
    /// memory that contains it: a duplicate fd and `addr`'s offset in it.
    pub(crate) fn share(&self, addr: u64, len: u64) -> Option<(OwnedFd, u64)> {
        match self {
            Allocation::Shared(m) => m.share(addr, len),
            Allocation::Transport(_) => None,
        }
    }

    /// Gives the memory at `addr` back to whoever allocated it. Nothing may
    /// reference it any more (it is unregistered).
    pub(crate) fn release(self, addr: u64, transports: &[Arc<Transport>]) {
        match self {
            Allocation::Transport(i) => {
                if let Err(e) = transports[i].free(addr) {
                    log::warn!("freeing {addr:#x}: {e}");
                }
            }
            // Unmapped (and the file closed) by its Drop.
            Allocation::Shared(memory) => drop(memory),
        }
    }
}
