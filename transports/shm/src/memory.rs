//! Shareable memory: allocations backed by a sealed memfd (huge pages when
//! the host has them), and a peer's mapping of one.
//!
//! The memfd is sealed against shrinking before anyone else sees it, so no
//! process can truncate it under a peer's mapping: a peer never takes SIGBUS
//! from memory Ferry shared. A peer refuses to map an fd that lacks the seal.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const HUGE_PAGE: u64 = 2 << 20;

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).unwrap_or(4096).max(4096)
}

/// Memory this instance allocated and can hand to peers.
pub struct Allocation {
    pub token: u64,
    pub addr: u64,
    pub len: u64,
    /// Bytes mapped (len rounded up to the page size used).
    pub mapped: u64,
    pub fd: OwnedFd,
    pub huge: bool,
}

// SAFETY: the mapping is owned by this struct and only unmapped in Drop; the
// raw address is plain data shared like a Vec<u8>'s pointer would be.
unsafe impl Send for Allocation {}
// SAFETY: as above.
unsafe impl Sync for Allocation {}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: addr/mapped describe the mapping made in `allocate`, which
        // nothing uses once the allocation is dropped (unregistered first).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.mapped as usize) };
    }
}

fn memfd(huge: bool) -> io::Result<OwnedFd> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: a NUL-terminated name; the returned fd is checked.
    let fd = unsafe { libc::memfd_create(c"ferry-shm".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn try_allocate(len: u64, huge: bool, token: u64) -> io::Result<Allocation> {
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
    // SAFETY: mapping `mapped` bytes of a file that is exactly that long and
    // sealed against shrinking; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    if !huge {
        // Transparent huge pages for shmem, where the host allows them.
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(ptr, mapped as usize, libc::MADV_HUGEPAGE) };
    }
    Ok(Allocation {
        token,
        addr: ptr as u64,
        len,
        mapped,
        fd,
        huge,
    })
}

/// Allocates `len` bytes; huge pages first when `hugepages` allows and the
/// host has free ones, else normal pages.
pub fn allocate(len: u64, hugepages: bool, token: u64) -> io::Result<Allocation> {
    if hugepages && len >= HUGE_PAGE {
        if let Ok(a) = try_allocate(len, true, token) {
            return Ok(a);
        }
    }
    try_allocate(len, false, token)
}

/// A peer's allocation mapped here.
#[derive(Debug)]
pub struct Mapping {
    pub base: *mut u8,
    pub len: u64,
}

// SAFETY: the mapping is owned by this struct (unmapped in Drop) and used
// only through bounds-checked copies.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len describe the mapping made in `map`.
        unsafe { libc::munmap(self.base.cast(), self.len as usize) };
    }
}

/// Maps `len` bytes of a peer's memfd, refusing one that could be truncated
/// under us or is shorter than announced.
pub fn map(fd: &OwnedFd, len: u64) -> Result<Mapping, String> {
    // SAFETY: F_GET_SEALS on a valid fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err("the peer's memory is not sealed against shrinking; refusing to map it".into());
    }
    // SAFETY: a zeroed stat is valid storage for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a valid fd into valid storage.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as u64) < len {
        return Err("the peer's memory is smaller than it announced".into());
    }
    // SAFETY: mapping at most the file's (sealed) size; result checked.
    // MAP_POPULATE fills the page tables now, once, instead of taking a
    // fault on the first touch of every page during transfers.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(format!("mmap: {}", io::Error::last_os_error()));
    }
    Ok(Mapping {
        base: ptr.cast(),
        len,
    })
}

/// Whether hugetlb pages are configured on this host.
pub fn hugetlb_pages() -> u64 {
    std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The kernel's policy for transparent huge pages on shared memory.
pub fn shmem_thp() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .find(|w| w.starts_with('['))
                .map(|w| w.trim_matches(['[', ']']).to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_sealed_and_mappable_by_fd() {
        let a = allocate(3 << 20, true, 1).unwrap();
        assert!(a.mapped >= a.len);
        // SAFETY: writing inside our own mapping.
        unsafe { *(a.addr as *mut u8).add(100) = 42 };
        let m = map(&a.fd, a.len).unwrap();
        // SAFETY: reading inside the second mapping of the same file.
        assert_eq!(unsafe { *m.base.add(100) }, 42);
        // SAFETY: ftruncate on our fd; the seal must refuse it.
        let rc = unsafe { libc::ftruncate(a.fd.as_raw_fd(), 0) };
        assert_ne!(rc, 0, "sealed memory cannot shrink");
        assert!(map(&a.fd, a.mapped * 2).is_err());
    }

    #[test]
    fn unsealed_files_are_refused() {
        let fd = memfd(false).unwrap();
        // SAFETY: sizing our own memfd.
        unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) };
        assert!(map(&fd, 4096).unwrap_err().contains("not sealed"));
    }
}
