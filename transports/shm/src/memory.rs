//! Shareable memory as shm sees it: whether this host can make it (memfd),
//! a peer's memfd mapped here, and the files of registrations shared with
//! peers.
//!
//! The engine allocates the memory (engine-core's `shared_memory`) and seals
//! the memfd against shrinking before anyone else sees it, so no process can
//! truncate it under a peer's mapping: a peer never takes SIGBUS from memory
//! Ferry shared. A peer refuses to map an fd that lacks the seal.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A new memfd that allows sealing.
pub fn memfd() -> io::Result<OwnedFd> {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a NUL-terminated name; the returned fd is checked.
    let fd = unsafe { libc::memfd_create(c"ferry-shm".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The file of a registration peers may map: our own duplicate of the
/// engine's memfd (so it outlives nothing it should not) and its size.
pub struct SharedFile {
    pub fd: OwnedFd,
    pub len: u64,
}

impl SharedFile {
    /// Duplicates `fd` (borrowed from the engine for the call).
    pub fn dup(fd: i32) -> io::Result<SharedFile> {
        // SAFETY: F_DUPFD_CLOEXEC on a descriptor the engine keeps open for
        // the call; the result is checked.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(dup) };
        // SAFETY: a zeroed stat is valid storage for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a valid fd into valid storage.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedFile {
            fd,
            len: st.st_size as u64,
        })
    }
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
// SAFETY: shared references only copy through bounds-checked ranges of a
// mapping that lives as long as the struct.
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

    fn sealed(len: u64) -> OwnedFd {
        let fd = memfd().unwrap();
        // SAFETY: sizing and sealing our own memfd.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            assert_eq!(
                libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
                0
            );
        }
        fd
    }

    #[test]
    fn sealed_files_map_and_share() {
        let fd = sealed(3 << 20);
        let a = map(&fd, 3 << 20).unwrap();
        let shared = SharedFile::dup(fd.as_raw_fd()).unwrap();
        assert_eq!(shared.len, 3 << 20);
        let b = map(&shared.fd, shared.len).unwrap();
        // SAFETY: inside both mappings of the same file.
        unsafe {
            *a.base.add(100) = 42;
            assert_eq!(*b.base.add(100), 42);
        }
        assert!(map(&fd, 6 << 20).is_err());
    }

    #[test]
    fn unsealed_files_are_refused() {
        let fd = memfd().unwrap();
        // SAFETY: sizing our own memfd.
        unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) };
        assert!(map(&fd, 4096).unwrap_err().contains("not sealed"));
    }
}
