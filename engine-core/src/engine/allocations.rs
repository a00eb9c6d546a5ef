//! Memory the engine allocates for the application (`allocate_memory`):
//! from the first transport that shares it (shm maps it into same-host
//! peers), else an anonymous mapping; and its release.

use crate::error::{Error, ErrorCode, Result};
use crate::transport::Transport;
use std::sync::Arc;

/// Who allocated a buffer handed out by `allocate_memory`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Allocation {
    /// A transport's shareable memory (transport index).
    Transport(usize),
    /// A plain anonymous mapping of this many bytes.
    Anonymous(u64),
}

impl Allocation {
    /// `len` bytes (near `numa_node` when given) from the first transport
    /// that allocates memory, else from the kernel.
    pub(crate) fn obtain(
        transports: &[Arc<Transport>],
        len: u64,
        numa_node: Option<u32>,
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
        Ok((anonymous_map(len)?, Allocation::Anonymous(len)))
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
            // SAFETY: addr/len describe a mapping anonymous_map made and that
            // nothing references any more (the caller unregistered it).
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
