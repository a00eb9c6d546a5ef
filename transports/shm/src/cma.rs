//! Cross-memory attach: process_vm_readv/writev between processes of one
//! host, and the reasons the kernel may refuse it, in operator words.
//!
//! The kernel allows it when the caller may ptrace the target
//! (PTRACE_MODE_ATTACH_REALCREDS): same user and not blocked by Yama's
//! ptrace_scope, or CAP_SYS_PTRACE. Container seccomp profiles often block
//! the two system calls outright.

use std::io;

/// The byte peers read to learn whether they may attach to us.
pub static PROBE_BYTE: u8 = 0x5a;

/// Yama's ptrace_scope (0-3), when Yama is there.
pub fn yama_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Whether this process may use the system calls at all (a seccomp filter
/// may forbid them): reads one of our own bytes through them.
pub fn syscalls_allowed() -> Result<(), String> {
    let mut byte = 0u8;
    // SAFETY: reading one byte of our own static into a local.
    let n = unsafe {
        transfer(
            libc::getpid(),
            false,
            &mut byte,
            &PROBE_BYTE as *const u8 as u64,
            1,
        )
    };
    match n {
        Ok(1) => Ok(()),
        Ok(_) => Err("process_vm_readv moved nothing".into()),
        Err(e) => Err(format!(
            "process_vm_readv is refused even on this process ({e}): a seccomp filter (container \
             profile) forbids it"
        )),
    }
}

/// Why the kernel refused to let us attach to `pid` (uid `peer_uid`).
pub fn explain_refusal(e: &io::Error, peer_uid: u32) -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let mut why = format!("the kernel refused cross-memory attach ({e})");
    if peer_uid != uid {
        why.push_str(&format!(
            ": the peer runs as uid {peer_uid} and this process as uid {uid} (attach needs the \
             same user or CAP_SYS_PTRACE)"
        ));
    } else {
        match yama_scope() {
            Some(1) => why.push_str(
                ": Yama ptrace_scope=1 lets a process attach only to its descendants unless the \
                 target allows it; the peer's shm plugin allows it unless FERRY_SHM_CMA=off",
            ),
            Some(2) => why.push_str(": Yama ptrace_scope=2 requires CAP_SYS_PTRACE"),
            Some(3) => why.push_str(": Yama ptrace_scope=3 forbids attaching altogether"),
            _ => why.push_str(
                ": the peer is not dumpable, or a security module (SELinux, AppArmor) denies it",
            ),
        }
    }
    why
}

/// Moves `len` bytes between `local` here and `remote` in `pid`.
/// Returns the bytes moved.
///
/// # Safety
/// `local` must be valid for `len` bytes (writable when reading).
pub unsafe fn transfer(
    pid: i32,
    write: bool,
    local: *mut u8,
    remote: u64,
    len: usize,
) -> io::Result<usize> {
    let liov = libc::iovec {
        iov_base: local.cast(),
        iov_len: len,
    };
    let riov = libc::iovec {
        iov_base: remote as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: vectored requires every local iovec valid for the call
    // (writable when reading); the only one, `liov`, is `local` for `len`
    // bytes, which the `# Safety` section makes valid (writable when reading).
    // `riov` only names addresses in `pid`, which the kernel checks (EFAULT);
    // this process never dereferences them.
    unsafe { vectored(pid, write, &[liov], &[riov]) }
}

/// One process_vm_readv/writev over matching local and remote iovecs.
///
/// # Safety
/// Every local iovec must describe memory valid for the call (writable when
/// reading).
pub unsafe fn vectored(
    pid: i32,
    write: bool,
    local: &[libc::iovec],
    remote: &[libc::iovec],
) -> io::Result<usize> {
    // SAFETY: both iovec arrays are live slices whose lengths we pass; the
    // kernel writes (reading) or reads (writing) only the memory the local
    // iovecs describe, which the `# Safety` section makes valid for the call
    // (writable when reading), and checks the remote iovecs against `pid`'s
    // address space (EFAULT if unmapped) without this process touching them.
    let n = unsafe {
        if write {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        } else {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_ourselves_works_unless_seccomp_forbids_it() {
        if syscalls_allowed().is_err() {
            return;
        }
        let src = [1u8, 2, 3, 4];
        let mut dst = [0u8; 4];
        // SAFETY: dst is a writable local array of 4 bytes.
        let n = unsafe {
            transfer(
                std::process::id() as i32,
                false,
                dst.as_mut_ptr(),
                src.as_ptr() as u64,
                4,
            )
        }
        .unwrap();
        assert_eq!((n, dst), (4, src));
    }
}
