//! Where a buffer lives: `cpu:N` (host memory on NUMA node N) or `cuda:N`.

use crate::error::{Error, ErrorCode, Result};
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// Host memory; the NUMA node when known.
    Cpu(Option<u32>),
    /// Memory of CUDA device N.
    Cuda(u32),
}

impl Location {
    pub fn is_host(self) -> bool {
        matches!(self, Location::Cpu(_))
    }

    pub fn numa_node(self) -> Option<u32> {
        match self {
            Location::Cpu(n) => n,
            Location::Cuda(_) => None,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Cpu(Some(n)) => write!(f, "cpu:{n}"),
            Location::Cpu(None) => write!(f, "cpu"),
            Location::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Location {
    type Err = Error;

    /// `cpu`, `cpu:N`, `cuda:N`.
    fn from_str(s: &str) -> Result<Location> {
        let bad = || {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("location {s:?} is not one of cpu, cpu:N, cuda:N"),
            )
        };
        let s_trim = s.trim();
        if s_trim == "cpu" {
            return Ok(Location::Cpu(None));
        }
        let (kind, n) = s_trim.split_once(':').ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        match kind {
            "cpu" => Ok(Location::Cpu(Some(n))),
            "cuda" => Ok(Location::Cuda(n)),
            _ => Err(bad()),
        }
    }
}

/// The NUMA node of the page holding `addr`, from get_mempolicy(2). The page
/// is faulted in if it was never touched. `None` when the kernel will not
/// say (no NUMA support, seccomp).
pub fn numa_node_of(addr: *const u8) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE|MPOL_F_ADDR writes one int into
    // `node` and only inspects (never writes) the page at addr; no nodemask.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc == 0 {
        u32::try_from(node).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        for s in ["cpu:0", "cpu:3", "cuda:7", "cpu"] {
            assert_eq!(s.parse::<Location>().unwrap().to_string(), s);
        }
        for s in ["gpu:0", "cuda", "cuda:-1", "cpu:x", ""] {
            assert!(s.parse::<Location>().is_err(), "{s}");
        }
    }

    #[test]
    fn host_memory_has_a_numa_node_here() {
        let v = vec![1u8; 8192];
        // On a kernel without NUMA this is None; it must not be garbage.
        if let Some(n) = numa_node_of(v.as_ptr()) {
            assert!(n < 1024);
        }
    }
}
