//! A peer's registration as this process sees it: opened once (over the
//! peer's socket), cached, and closed when the peer revokes it, when the
//! peer goes away, or when the connection is dropped.
//!
//! cuMemAlloc memory arrives as one IPC handle for the whole allocation the
//! buffer lies in; several registrations in one allocation (sub-allocations
//! of a caching allocator) share one opened handle, which is closed when
//! the last of them goes (the driver refuses to open a handle twice in one
//! process). VMM memory arrives as one descriptor per chunk, mapped
//! contiguously in a reservation of our own. Host memory arrives as a
//! descriptor of the file that holds it, mapped and pinned once.

use crate::channel::Opened;
use crate::gpu::Gpus;
use crate::wire::{KIND_HOST, KIND_IPC, KIND_VMM};
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, Weak};

/// Mappings of peers' memory open in this process (IPC handles, VMM
/// reservations, host files), for `describe_peer` and leak checks.
pub static OPEN_MAPPINGS: AtomicI64 = AtomicI64::new(0);

/// An opened IPC handle, shared by every registration inside its allocation.
pub struct IpcBase {
    gpus: Arc<Gpus>,
    gpu: usize,
    ptr: u64,
}

impl Drop for IpcBase {
    fn drop(&mut self) {
        let _ = self.gpus.close_ipc(self.gpu, self.ptr);
        OPEN_MAPPINGS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Opened IPC handles by handle bytes (one per allocation, process-wide
/// for this instance).
pub type IpcCache = Mutex<HashMap<[u8; 64], Weak<IpcBase>>>;

enum Mapped {
    /// The peer is this process: its addresses are ours.
    SameProcess,
    Ipc {
        /// The exporter's address of the allocation's start.
        remote_base: u64,
        base: Arc<IpcBase>,
    },
    Vmm {
        remote_base: u64,
        va: u64,
        total: u64,
    },
    Host {
        remote_base: u64,
        /// The mapping and its length (page aligned), and where
        /// `remote_base` lies in it.
        map: u64,
        map_len: u64,
        skip: u64,
        pinned: bool,
    },
}

/// One peer registration, opened.
pub struct Import {
    pub id: u64,
    /// The registered range at the exporter (its word, checked against the
    /// pieces it sent).
    pub addr: u64,
    pub len: u64,
    /// How the exporter shared it (wire::KIND_*).
    pub kind: u32,
    /// The local GPU that opened it (and runs copies to and from it when the
    /// local buffer is host memory).
    pub gpu: usize,
    gpus: Arc<Gpus>,
    /// `None` once closed: nothing is served from it again.
    mapped: RwLock<Option<Mapped>>,
}

fn protocol(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Protocol, msg)
}

impl Import {
    /// Opens what the peer sent, on local GPU `gpu`.
    pub fn open(
        gpus: &Arc<Gpus>,
        gpu: usize,
        same_process: bool,
        opened: Opened,
        cache: &IpcCache,
    ) -> PluginResult<Import> {
        let Opened { reply, pieces, fds } = opened;
        let first = pieces[0];
        let mapped = if same_process {
            Mapped::SameProcess
        } else {
            match reply.kind {
                KIND_IPC => {
                    let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
                    let base = match cache.get(&first.handle).and_then(Weak::upgrade) {
                        Some(b) => b,
                        None => {
                            let ptr = gpus.open_ipc(gpu, &first.handle)?;
                            OPEN_MAPPINGS.fetch_add(1, Ordering::SeqCst);
                            let b = Arc::new(IpcBase {
                                gpus: gpus.clone(),
                                gpu,
                                ptr,
                            });
                            cache.retain(|_, w| w.strong_count() > 0);
                            cache.insert(first.handle, Arc::downgrade(&b));
                            b
                        }
                    };
                    Mapped::Ipc {
                        remote_base: first.start,
                        base,
                    }
                }
                KIND_VMM => {
                    let (va, total) = gpus.map_vmm(gpu, &pieces, &fds)?;
                    OPEN_MAPPINGS.fetch_add(1, Ordering::SeqCst);
                    Mapped::Vmm {
                        remote_base: first.start,
                        va,
                        total,
                    }
                }
                KIND_HOST => {
                    let fd = fds
                        .first()
                        .ok_or_else(|| protocol("no file for host memory"))?;
                    map_host(
                        gpus,
                        gpu,
                        fd.as_raw_fd(),
                        first.start,
                        first.len,
                        first.fd_offset,
                    )?
                }
                _ => return Err(protocol("unknown kind of registration")),
            }
        };
        Ok(Import {
            id: reply.id,
            addr: reply.addr,
            len: reply.len,
            kind: reply.kind,
            gpu,
            gpus: gpus.clone(),
            mapped: RwLock::new(Some(mapped)),
        })
    }

    /// Whether the peer's memory is GPU memory (which the copy kernel
    /// reaches), not host memory.
    pub fn is_device(&self) -> bool {
        self.kind != KIND_HOST
    }

    /// The mapping, held open (a revocation waits) until the view drops:
    /// copies that use its addresses are queued before that.
    pub fn view(&self) -> PluginResult<View<'_>> {
        let guard = self.mapped.read().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            return Err(revoked(self.id));
        }
        Ok(View {
            import: self,
            guard,
        })
    }

    /// Closes the mapping after every copy queued on it finished; later
    /// requests are refused.
    pub fn close(&self) {
        let mut guard = self.mapped.write().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            return;
        }
        // Copies already queued may still touch the mapping.
        self.gpus.sync_all();
        if let Some(m) = guard.take() {
            self.unmap(m);
        }
    }

    fn unmap(&self, m: Mapped) {
        match m {
            Mapped::SameProcess | Mapped::Ipc { .. } => {}
            Mapped::Vmm { va, total, .. } => {
                let _ = self.gpus.unmap_vmm(self.gpu, va, total);
                OPEN_MAPPINGS.fetch_sub(1, Ordering::SeqCst);
            }
            Mapped::Host {
                map,
                map_len,
                pinned,
                ..
            } => {
                if pinned {
                    let _ = self.gpus.unpin(self.gpu, map);
                }
                // SAFETY: map/map_len is the mapping map_host made; nothing
                // uses it any more (the write lock is held, streams synced).
                unsafe { libc::munmap(map as *mut libc::c_void, map_len as usize) };
                OPEN_MAPPINGS.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// An import's mapping, held open.
pub struct View<'a> {
    import: &'a Import,
    guard: RwLockReadGuard<'a, Option<Mapped>>,
}

impl View<'_> {
    /// This process's address of the peer's `[remote_addr, + len)`, which
    /// must lie inside the registration the exporter reported.
    pub fn local(&self, remote_addr: u64, len: u64) -> PluginResult<u64> {
        let i = self.import;
        let end = remote_addr.checked_add(len);
        if remote_addr < i.addr || end.is_none_or(|e| e > i.addr + i.len) {
            return Err(PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "cuda-ipc: [{remote_addr:#x}, +{len}) is outside the peer's registration \
                     [{:#x}, +{}); nothing was copied",
                    i.addr, i.len
                ),
            ));
        }
        Ok(match self.guard.as_ref() {
            None => return Err(revoked(i.id)),
            Some(Mapped::SameProcess) => remote_addr,
            Some(Mapped::Ipc { remote_base, base }) => base.ptr + (remote_addr - remote_base),
            Some(Mapped::Vmm {
                remote_base, va, ..
            }) => va + (remote_addr - remote_base),
            Some(Mapped::Host {
                remote_base,
                map,
                skip,
                ..
            }) => map + skip + (remote_addr - remote_base),
        })
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        self.close();
    }
}

pub fn revoked(id: u64) -> PluginError {
    PluginError::new(
        ErrorCode::OutOfBounds,
        format!(
            "cuda-ipc: the peer's registration {id} is no longer registered (unregistered or \
             revoked); nothing was copied"
        ),
    )
}

fn map_host(
    gpus: &Gpus,
    gpu: usize,
    fd: i32,
    start: u64,
    len: u64,
    offset: u64,
) -> PluginResult<Mapped> {
    // SAFETY: a zeroed stat is a valid value; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is a descriptor we own; st is a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(PluginError::new(
            ErrorCode::Io,
            format!(
                "fstat of the peer's file: {}",
                std::io::Error::last_os_error()
            ),
        ));
    }
    let end = offset
        .checked_add(len)
        .ok_or_else(|| protocol("the peer's host range overflows"))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || end > st.st_size as u64 {
        return Err(protocol(format!(
            "the peer's host memory [{offset:#x}, +{len}) is not inside its file of {} bytes",
            st.st_size
        )));
    }
    // SAFETY: sysconf has no preconditions.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
    let skip = offset % page;
    let map_len = (skip + len).div_ceil(page) * page;
    // SAFETY: a fresh shared mapping of a file we hold, inside its size
    // (checked above); the kernel picks the address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            (offset - skip) as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(PluginError::new(
            ErrorCode::Io,
            format!(
                "cannot map the peer's host memory: {}",
                std::io::Error::last_os_error()
            ),
        ));
    }
    OPEN_MAPPINGS.fetch_add(1, Ordering::SeqCst);
    let map = p as u64;
    // Pinned, the GPU's copy engines reach it directly at full speed; if
    // the driver refuses, copies still work, staged by the driver.
    let pinned = gpus.pin(gpu, map, map_len).is_ok();
    Ok(Mapped::Host {
        remote_base: start,
        map,
        map_len,
        skip,
        pinned,
    })
}
