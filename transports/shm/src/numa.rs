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
    // SAFETY: as above, for the calling thread (pid 0).
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

/// The NUMA node of the CPU the calling thread runs on (0 when unknown).
pub fn current_node() -> u32 {
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(NODE_ROOT) else {
        return 0;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let list = std::fs::read_to_string(e.path().join("cpulist")).unwrap_or_default();
        if parse_cpulist(&list).contains(&(cpu as usize)) {
            return n;
        }
    }
    0
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
        assert!(!node_cpus(current_node()).is_empty());
    }
}
