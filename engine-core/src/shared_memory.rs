//! Host memory the engine hands out (`allocate_memory`) as a sealed memfd
//! mapping, so that same-host transports can give peers the file
//! (`ferry_mem_region_t.share_fd` / `share_offset`, ABI 1.2) and peers map
//! it with no ptrace permission.
//!
//! The file is sealed against shrinking and growing before anyone else sees
//! it, so no process can truncate it under a peer's mapping (no SIGBUS).
//! hugetlb pages when the host has free ones (FERRY_SHM_HUGEPAGES=off: never),
//! else transparent huge pages where shmem allows them; bound to the NUMA
//! node asked for, when one is.

use crate::error::{Error, ErrorCode, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const HUGE_PAGE: u64 = 2 << 20;

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).unwrap_or(4096).max(4096)
}

/// One allocation: the mapping, and the memfd that holds it.
#[derive(Debug)]
pub struct SharedMemory {
    pub addr: u64,
    /// Bytes mapped: the file's size (len rounded up to the page size used).
    pub mapped: u64,
    pub huge: bool,
    fd: OwnedFd,
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: addr/mapped describe the mapping made in `allocate`; the
        // engine drops an allocation only once nothing is registered in it.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.mapped as usize) };
    }
}

impl SharedMemory {
    /// `len` bytes; huge pages first when `hugepages` allows and the host
    /// has free ones, near `numa_node` when given.
    pub fn allocate(len: u64, numa_node: Option<u32>, hugepages: bool) -> Result<SharedMemory> {
        if len == 0 || usize::try_from(len).is_err() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("cannot allocate {len} bytes"),
            ));
        }
        let attempt = if hugepages && len >= HUGE_PAGE {
            try_allocate(len, true, numa_node).or_else(|_| try_allocate(len, false, numa_node))
        } else {
            try_allocate(len, false, numa_node)
        };
        attempt.map_err(|e| {
            Error::new(
                ErrorCode::NoMemory,
                format!("cannot allocate {len} bytes of shareable memory (memfd): {e}"),
            )
        })
    }

    /// The file behind `[addr, +len)` when it lies inside this allocation:
    /// a duplicate of the memfd (the caller's to close) and `addr`'s offset
    /// in it.
    pub fn share(&self, addr: u64, len: u64) -> Option<(OwnedFd, u64)> {
        let inside = addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.mapped);
        if !inside {
            return None;
        }
        // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own; checked below.
        let dup = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor we own.
        Some((unsafe { OwnedFd::from_raw_fd(dup) }, addr - self.addr))
    }
}

fn memfd(huge: bool) -> io::Result<OwnedFd> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: a NUL-terminated name; the returned fd is checked.
    let fd = unsafe { libc::memfd_create(c"ferry-shared".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Binds `[ptr, +len)` to `node` before its pages exist (best effort: a
/// kernel without NUMA support keeps its default policy).
fn bind(ptr: *mut libc::c_void, len: u64, node: u32) {
    const MPOL_PREFERRED: libc::c_long = 1;
    if node >= 1024 {
        return;
    }
    let mut mask = [0u64; 16];
    mask[(node / 64) as usize] |= 1 << (node % 64);
    // SAFETY: mbind on our own fresh mapping with a mask of 1024 bits.
    unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr,
            len as libc::c_ulong,
            MPOL_PREFERRED,
            mask.as_ptr(),
            1024 as libc::c_ulong,
            0 as libc::c_uint,
        )
    };
}

fn try_allocate(len: u64, huge: bool, numa_node: Option<u32>) -> io::Result<SharedMemory> {
    let unit = if huge { HUGE_PAGE } else { page_size() };
    let mapped = len.div_ceil(unit) * unit;
    let fd = memfd(huge)?;
    // SAFETY: fd is a valid memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), mapped as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a valid fd with an int argument.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: mapping `mapped` bytes of a file exactly that long and sealed
    // against shrinking; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let memory = SharedMemory {
        addr: ptr as u64,
        mapped,
        huge,
        fd,
    };
    if let Some(node) = numa_node {
        bind(ptr, mapped, node);
    }
    if !huge {
        // Transparent huge pages for shmem, where the host allows them.
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(ptr, mapped as usize, libc::MADV_HUGEPAGE) };
    }
    // Pages now, once (and where the policy says), not on the first touch
    // of every page during transfers. A hugetlb pool that runs dry fails
    // here rather than with SIGBUS later.
    // SAFETY: populating our own mapping.
    let rc = unsafe { libc::madvise(ptr, mapped as usize, libc::MADV_POPULATE_WRITE) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if huge || e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e); // `memory` unmaps on drop
        }
        // Kernels before 5.14 lack MADV_POPULATE_WRITE: touch every page.
        for off in (0..mapped).step_by(page_size() as usize) {
            // SAFETY: inside our own writable mapping.
            unsafe { std::ptr::write_volatile((memory.addr + off) as *mut u8, 0) };
        }
    }
    Ok(memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_sealed_shareable_files() {
        let a = SharedMemory::allocate(3 << 20, Some(0), true).unwrap();
        assert!(a.mapped >= 3 << 20);
        // SAFETY: writing inside our own mapping.
        unsafe { *(a.addr as *mut u8).add(4096 + 100) = 42 };
        let (fd, off) = a.share(a.addr + 4096, 200).unwrap();
        assert_eq!(off, 4096);
        // SAFETY: ftruncate on our duplicate; the seal must refuse it.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
        let mut byte = 0u8;
        // SAFETY: pread of one byte of the file into a local.
        let n = unsafe { libc::pread(fd.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, 4196) };
        assert_eq!((n, byte), (1, 42));
        assert!(a.share(a.addr + a.mapped - 1, 2).is_none());
        assert!(a.share(a.addr - 1, 1).is_none());
        assert!(SharedMemory::allocate(0, None, false).is_err());
    }
}
