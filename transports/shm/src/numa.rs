//! Where copy threads run: the CPUs of a NUMA node (from sysfs) that this
//! process may use, the node a CPU belongs to, and pinning a thread there.
//!
//! Hosts without NUMA information (no /sys/devices/system/node) count as one
//! node 0 holding every CPU this process may use.

use std::collections::BTreeSet;

const NODE_ROOT: &str = "/sys/devices/system/node";

/// Parses a kernel CPU list ("0-3,8,10-11").
pub fn parse_cpulist(s: &str) -> BTreeSet<usize> {
    let mut cpus = BTreeSet::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>(), b.trim().parse::<usize>()),
            None => (part.trim().parse(), part.trim().parse()),
        };
        if let (Ok(lo), Ok(hi)) = (lo, hi) {
            // A hostile or corrupt list cannot make us build a huge set.
            cpus.extend((lo..=hi.min(lo + 4096)).take_while(|c| *c < 65536));
        }
    }
    cpus
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> BTreeSet<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
    // writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed, which the
    // kernel writes at most; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return BTreeSet::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads a bit of the set, c < CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// The CPUs of `node` this process may use; every allowed CPU when the
/// host does not describe its nodes.
pub fn node_cpus(node: u32) -> BTreeSet<usize> {
    let allowed = allowed_cpus();
    match std::fs::read_to_string(format!("{NODE_ROOT}/node{node}/cpulist")) {
        Ok(list) => {
            let mine: BTreeSet<usize> = parse_cpulist(&list)
                .intersection(&allowed)
                .copied()
                .collect();
            if mine.is_empty() {
                allowed
            } else {
                mine
            }
        }
        Err(_) => allowed,
    }
}

/// Which node each CPU belongs to, read once.
pub struct NodeMap {
    /// Node of CPU i; CPUs sysfs does not place count as node 0.
    cpu_node: Vec<u32>,
    nodes: BTreeSet<u32>,
}

impl NodeMap {
    pub fn read() -> NodeMap {
        let mut map = NodeMap {
            cpu_node: Vec::new(),
            nodes: BTreeSet::new(),
        };
        for e in std::fs::read_dir(NODE_ROOT).into_iter().flatten().flatten() {
            let name = e.file_name();
            let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            map.nodes.insert(n);
            let list = std::fs::read_to_string(e.path().join("cpulist")).unwrap_or_default();
            for cpu in parse_cpulist(&list) {
                if map.cpu_node.len() <= cpu {
                    map.cpu_node.resize(cpu + 1, 0);
                }
                map.cpu_node[cpu] = n;
            }
        }
        map
    }

    /// `node` when this host has it, else the node of the CPU the calling
    /// thread runs on (0 when unknown).
    pub fn resolve(&self, node: Option<u32>) -> u32 {
        match node {
            Some(n) if self.nodes.contains(&n) => n,
            _ => {
                // SAFETY: sched_getcpu has no preconditions.
                let cpu = unsafe { libc::sched_getcpu() };
                usize::try_from(cpu)
                    .ok()
                    .and_then(|c| self.cpu_node.get(c).copied())
                    .unwrap_or(0)
            }
        }
    }
}

/// Lets the calling thread run only on `cpus` (ignored when empty or when
/// the kernel refuses: placement is an optimisation, never a failure).
pub fn pin_current_thread(cpus: &BTreeSet<usize>) {
    if cpus.is_empty() {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: c < CPU_SETSIZE, so the bit lies inside the set.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: sched_setaffinity for the calling thread with a valid set.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_garbage_is_ignored() {
        let v = |s: &str| parse_cpulist(s).into_iter().collect::<Vec<_>>();
        assert_eq!(v("0-3,8,10-11\n"), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(v(""), Vec::<usize>::new());
        assert_eq!(v("x,2,5-a"), [2]);
        assert!(parse_cpulist("0-18446744073709551615").len() <= 4097);
    }

    #[test]
    fn this_process_has_cpus_on_its_node() {
        assert!(!allowed_cpus().is_empty());
        let map = NodeMap::read();
        assert!(!node_cpus(map.resolve(None)).is_empty());
        assert_eq!(map.resolve(Some(100_000)), map.resolve(None));
    }
}
