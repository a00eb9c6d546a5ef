//! Where a buffer lives (`cpu:N`, `cuda:N`, `rocm:N`, the topology's
//! [`ferry_topology::MemoryLocation`]) and how host memory's NUMA node is found.

use crate::error::{Error, ErrorCode, Result};
pub use ferry_topology::MemoryLocation as Location;

/// Parses `cpu:N`, `cuda:N` or `rocm:N` into a [`Location`].
pub fn parse_location(text: &str) -> Result<Location> {
    text.trim()
        .parse()
        .map_err(|e: String| Error::new(ErrorCode::InvalidArgument, e))
}

/// The NUMA node of host memory at `addr`, when the kernel says.
pub fn host_location(addr: u64) -> Location {
    // Without NUMA support every page is on node 0.
    Location::Cpu(numa_node_of(addr).unwrap_or(0))
}

/// The NUMA node of the page holding `addr`, from get_mempolicy(2). The page
/// is faulted in if it was never touched. `None` when the kernel will not
/// say (no NUMA support, seccomp).
pub fn numa_node_of(addr: u64) -> Option<u32> {
    node_policy(addr)
        .ok()
        .and_then(|node| u32::try_from(node).ok())
}

/// Whether the page holding `addr` is mapped in this process: `Some(false)`
/// when the kernel says it is not (get_mempolicy's EFAULT), `None` when it
/// will not say.
pub fn is_mapped(addr: u64) -> Option<bool> {
    match node_policy(addr) {
        Ok(_) => Some(true),
        Err(e) if e.raw_os_error() == Some(libc::EFAULT) => Some(false),
        Err(_) => None,
    }
}

/// get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) for `addr`: the node of its
/// page, or the kernel's error (EFAULT for an unmapped address).
fn node_policy(addr: u64) -> std::io::Result<libc::c_int> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE|MPOL_F_ADDR writes one int into
    // `node`; the kernel looks up addr itself and fails cleanly (EFAULT) for
    // an unmapped address, so no pointer is dereferenced on our side.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as libc::c_ulong,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc == 0 {
        Ok(node)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        for s in ["cpu:0", "cpu:3", "cuda:7", "rocm:1"] {
            assert_eq!(parse_location(s).unwrap().to_string(), s);
        }
        for s in ["gpu:0", "cuda", "cuda:-1", "cpu:x", "", "cpu"] {
            assert_eq!(
                parse_location(s).unwrap_err().code,
                ErrorCode::InvalidArgument,
                "{s}"
            );
        }
    }

    #[test]
    fn unmapped_pages_are_told_apart() {
        let v = vec![1u8; 8192];
        assert_ne!(is_mapped(v.as_ptr() as u64), Some(false));
        assert_ne!(is_mapped(0x10), Some(true));
    }

    #[test]
    fn host_memory_has_a_numa_node() {
        let v = vec![1u8; 8192];
        let Location::Cpu(n) = host_location(v.as_ptr() as u64) else {
            panic!("host memory is cpu:N");
        };
        assert!(n < 4096);
    }
}
