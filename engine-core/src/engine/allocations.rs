//! Memory the engine allocates for the application (`allocate_memory`):
//! from the transport that shares it best, else an anonymous mapping;
//! registered on allocation, released on free or with the engine.

use super::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::Visibility;

/// Who allocated a buffer handed out by `allocate_memory`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Allocation {
    /// A transport's shareable memory (transport index).
    Transport(usize),
    /// A plain anonymous mapping of this many bytes.
    Anonymous(u64),
}

impl Shared {
    pub(crate) fn allocate_memory(&self, len: u64, numa_node: Option<u32>) -> Result<u64> {
        self.allocate(len, numa_node, Visibility::Published)
    }

    pub(crate) fn allocate(
        &self,
        len: u64,
        numa_node: Option<u32>,
        visibility: Visibility,
    ) -> Result<u64> {
        if len == 0 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "cannot allocate 0 bytes",
            ));
        }
        let mut found = None;
        for (i, t) in self.transports.iter().enumerate() {
            match t.allocate(len, numa_node) {
                None => continue,
                Some(Ok(addr)) => {
                    found = Some((addr, Allocation::Transport(i)));
                    break;
                }
                Some(Err(e)) => log::warn!("{}: cannot allocate {len} bytes: {e}", t.name),
            }
        }
        let (addr, owner) = match found {
            Some(f) => f,
            None => (anonymous_map(len)?, Allocation::Anonymous(len)),
        };
        let location = numa_node.map(Location::Cpu);
        if let Err(e) = self.register(addr, len, location, visibility) {
            self.release(addr, owner);
            return Err(e);
        }
        self.allocations.lock().insert(addr, owner);
        Ok(addr)
    }

    pub(crate) fn free_memory(&self, addr: u64) -> Result<()> {
        let owner = self.allocations.lock().get(&addr).copied().ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("{addr:#x} was not returned by allocate_memory (or is freed already)"),
            )
        })?;
        self.unregister_memory(addr)?;
        self.allocations.lock().remove(&addr);
        self.release(addr, owner);
        Ok(())
    }

    pub(crate) fn release(&self, addr: u64, owner: Allocation) {
        match owner {
            Allocation::Transport(i) => {
                if let Err(e) = self.transports[i].free(addr) {
                    log::warn!("freeing {addr:#x}: {e}");
                }
            }
            // SAFETY: addr/len describe a mapping anonymous_map made and that
            // nothing references any more (unregistered above).
            Allocation::Anonymous(len) => unsafe {
                libc::munmap(addr as *mut libc::c_void, len as usize);
            },
        }
    }
}

/// A private anonymous mapping of `len` bytes.
fn anonymous_map(len: u64) -> Result<u64> {
    let len = usize::try_from(len)
        .map_err(|_| Error::new(ErrorCode::InvalidArgument, "allocation too large"))?;
    // SAFETY: a fresh anonymous mapping; the result is checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::new(
            ErrorCode::NoMemory,
            format!(
                "cannot allocate {len} bytes: {}",
                std::io::Error::last_os_error()
            ),
        ));
    }
    Ok(ptr as u64)
}
