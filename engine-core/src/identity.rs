//! Who an engine is: a random id per engine instance, an id shared by every
//! engine of one process, and one shared by every engine that can reach the
//! same host resources.
//!
//! The machine id is the kernel's boot id (one per booted kernel, so two
//! containers on one host share it while two hosts never do) plus the inode
//! of the IPC namespace: engines in containers with separate IPC namespaces
//! cannot share System V / POSIX shared memory, so they are treated as
//! different machines for same-host transports. The process id adds the PID
//! namespace and the process start time, so a recycled PID is not mistaken
//! for the old process.

use std::fs;

/// Every id of one engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub engine_id: String,
    pub machine_id: String,
    pub process_id: String,
}

impl Identity {
    pub fn new() -> Identity {
        Identity {
            engine_id: random_hex(),
            machine_id: machine_id(),
            process_id: process_id(),
        }
    }
}

impl Default for Identity {
    fn default() -> Self {
        Identity::new()
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn namespace_inode(kind: &str) -> String {
    fs::read_link(format!("/proc/self/ns/{kind}"))
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            s.split('[')
                .nth(1)
                .map(|rest| rest.trim_end_matches(']').to_string())
        })
        .unwrap_or_else(|| "?".to_string())
}

/// `<boot id>/ipc:<inode>`; without a boot id, the hostname stands in.
pub fn machine_id() -> String {
    let boot = read_trimmed("/proc/sys/kernel/random/boot_id")
        .or_else(|| read_trimmed("/etc/hostname"))
        .unwrap_or_else(|| "unknown-boot".to_string());
    format!("{boot}/ipc:{}", namespace_inode("ipc"))
}

/// `pid:<pidns inode>:<pid>:<start time in clock ticks>`.
pub fn process_id() -> String {
    let pid = std::process::id();
    // Field 22 of /proc/self/stat is the start time; the command name (field
    // 2) may contain spaces, so split after its closing parenthesis.
    let start = read_trimmed("/proc/self/stat")
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_string();
            rest.split_whitespace().nth(19).map(str::to_string)
        })
        .unwrap_or_else(|| "0".to_string());
    format!("pid:{}:{pid}:{start}", namespace_inode("pid"))
}

/// 16 random hex digits from the kernel's generator.
pub fn random_hex() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most bytes.len() bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        // Not cryptographic: only needs to differ between engine instances.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        bytes = (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_within_a_process_and_engines_differ() {
        let a = Identity::new();
        let b = Identity::new();
        assert_eq!(a.machine_id, b.machine_id);
        assert_eq!(a.process_id, b.process_id);
        assert_ne!(a.engine_id, b.engine_id);
        assert!(a.process_id.contains(&format!(":{}:", std::process::id())));
    }
}
