//! Ferry's shared-memory transport plugin: host memory between processes of
//! one host, without the network stack.
//!
//! Two ways in, decided per buffer (each buffer's key says which):
//! - **mapped**: memory the engine allocated through this plugin is a sealed
//!   memfd; a peer gets the fd over the instances' Unix socket, maps it once
//!   and copies with plain loads and stores. Needs no ptrace permission.
//! - **cross-memory attach**: any other registered memory is read or
//!   written with process_vm_readv/writev, batched into one system call per
//!   batch. Needs the kernel's permission (same user, Yama, seccomp); when a
//!   peer cannot get it, `accepts` says why and the engine uses the next
//!   transport (TCP).
//!
//! Same-host peers only: the engine offers shm for peers whose machine id
//! (boot id and IPC namespace) equals ours, and `connect` checks that the
//! peer's socket is reachable (same network namespace) and belongs to the
//! advertised process.
//!
//! Safety of the target: a peer only maps allocations with a live
//! registration and only copies into ranges the engine checked against the
//! target's descriptor. Unregistering tells every peer (REVOKE) and waits
//! until each confirms it has stopped touching the buffer; a revoked
//! registration is never served again. Only processes of this user (and of
//! `shm.allowed_uids`) may connect to the socket (SO_PEERCRED, checked
//! before anything is read), and they must prove the token. Cross-memory
//! attach needs ptrace-level permission, with which a process could write to
//! the target anyway.

mod channel;
mod cma;
mod endpoint;
mod memory;
mod wire;

use channel::{Client, ClientEvents, Server};
use endpoint::{Endpoint, Key};
use ferry_plugins_abi::sdk::{
    Completer, Host, InitParams, MemRegion, Op, PeerInfo, PluginError, PluginResult, ProbeDevice,
    ProbeReport, Registration, TransferRequest, TransportInstance,
};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use memory::{Allocation, Mapping};
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

pub struct ShmTransport;

/// The handle of a local-only registration (nothing to undo).
const LOCAL_ONLY_HANDLE: u64 = u64::MAX;

fn unavailable(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Unavailable, msg)
}

fn setting_on(host: &Host<'_>, key: &str) -> bool {
    !matches!(
        host.config(key).as_deref().map(str::trim),
        Some("off" | "0" | "false" | "no")
    )
}

fn pid_namespace() -> u64 {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            s.split('[').nth(1)?.trim_end_matches(']').parse().ok()
        })
        .unwrap_or(0)
}

/// shm.allowed_uids (FERRY_SHM_ALLOWED_UIDS): users besides this one whose
/// processes may connect to this engine's shm socket, comma-separated.
fn allowed_uids(host: &Host<'_>) -> PluginResult<Vec<u32>> {
    let Some(list) = host.config("shm.allowed_uids") else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            u.parse::<u32>().map_err(|_| {
                PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!("shm.allowed_uids: {u:?} is not a numeric uid"),
                )
            })
        })
        .collect()
}

/// 64 random bits from the kernel, for names and tokens others must not guess.
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into b.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    u64::from_le_bytes(b) | 1
}

impl ferry_plugins_abi::sdk::TransportPlugin for ShmTransport {
    const NAME: &'static CStr = c"shm";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr =
        c"Host memory between processes of one host: mapped memfd or cross-memory attach";
    type Instance = ShmInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        // Mapped memory needs memfd and a Unix socket: try both.
        let alloc = memory::allocate(4096, false, 1)
            .map_err(|e| unavailable(format!("cannot create shareable memory (memfd): {e}")))?;
        drop(alloc);
        report.set_capabilities(sys::FERRY_MEM_HOST, sys::FERRY_SCOPE_SAME_HOST);
        let huge = memory::hugetlb_pages();
        let detail = format!(
            "mapped memfd (sealed); huge pages: {} hugetlb pages configured, shmem THP '{}'",
            huge,
            memory::shmem_thp()
        );
        report.add_device(&ProbeDevice {
            name: "memfd",
            detail: Some(&detail),
            mem_kinds: sys::FERRY_MEM_HOST,
            ..Default::default()
        });
        if huge == 0 {
            report.add_missing(
                "hugetlb",
                "no hugetlb pages configured (vm.nr_hugepages=0): allocations use normal pages",
            );
        }
        let cma = if !setting_on(host, "shm.cma") {
            Err("turned off by FERRY_SHM_CMA=off".to_string())
        } else {
            cma::syscalls_allowed().and_then(|()| match cma::yama_scope() {
                Some(3) => Err("Yama ptrace_scope=3 forbids it".to_string()),
                Some(2) => {
                    Err("Yama ptrace_scope=2 allows it only with CAP_SYS_PTRACE".to_string())
                }
                _ => Ok(()),
            })
        };
        match cma {
            Ok(()) => report.add_note(
                "cross-memory-attach",
                &format!(
                    "available for peers of the same user (Yama ptrace_scope={})",
                    cma::yama_scope().map_or("absent".to_string(), |s| s.to_string())
                ),
            ),
            Err(why) => report.add_missing(
                "cross-memory-attach",
                &format!("{why}; only memory allocated through Ferry goes over shm"),
            ),
        }
        Ok(())
    }

    fn init(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<ShmInstance> {
        ShmInstance::start(host, params, completer)
    }
}

ferry_plugins_abi::export_transport_plugin!(ShmTransport);

/// One registered buffer.
struct Region {
    key: Key,
}

/// State shared by the instance and its socket server.
#[derive(Default)]
struct Owned {
    /// Allocations by address.
    allocations: HashMap<u64, Arc<Allocation>>,
    /// Registrations by handle.
    regions: HashMap<u64, Region>,
}

impl Owned {
    fn allocation_containing(&self, addr: u64, len: u64) -> Option<&Arc<Allocation>> {
        self.allocations
            .values()
            .find(|a| addr >= a.addr && addr.saturating_add(len) <= a.addr + a.len)
    }

    /// The fd behind `token`, while some registration still uses it.
    fn shared_fd(&self, token: u64) -> Option<(i32, u64)> {
        let live = self
            .regions
            .values()
            .any(|r| matches!(r.key, Key::Map { token: t, .. } if t == token));
        if !live {
            return None;
        }
        self.allocations
            .values()
            .find(|a| a.token == token)
            .map(|a| (a.fd.as_raw_fd(), a.mapped))
    }
}

pub struct ShmInstance {
    host: Host<'static>,
    token: Option<ferry_plugins_abi::sdk::auth::Token>,
    auth_timeout: Duration,
    completer: Completer,
    timeout: Duration,
    hugepages: bool,
    endpoint: Endpoint,
    owned: Arc<RwLock<Owned>>,
    next_id: AtomicU64,
    // Last: peers' connections to it close before the state above goes.
    server: Server,
}

impl ShmInstance {
    fn start(host: Host<'static>, params: InitParams, completer: Completer) -> PluginResult<Self> {
        let cma = setting_on(&host, "shm.cma");
        let hugepages = setting_on(&host, "shm.hugepages");
        let timeout = Duration::from_millis(
            host.config("timeout_ms")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(15_000),
        );
        if cma && cma::yama_scope() == Some(1) {
            // Yama ptrace_scope=1 lets only descendants attach; let peers of
            // the same user attach for cross-memory copies.
            // SAFETY: prctl with integer arguments only.
            unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
            host.info(
                "shm: let processes of this user attach for cross-memory copies (Yama \
                 ptrace_scope=1); FERRY_SHM_CMA=off keeps this process closed",
            );
        }
        // SAFETY: getpid/getuid have no preconditions.
        let (pid, uid) = unsafe { (libc::getpid(), libc::getuid()) };
        let name = format!("ferry-shm-{pid}-{:016x}", random_u64()).into_bytes();
        let owned: Arc<RwLock<Owned>> = Arc::default();
        let lookup_state = owned.clone();
        let lookup: Arc<channel::Lookup> = Arc::new(move |token| {
            lookup_state
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .shared_fd(token)
        });
        let token = host
            .config("auth.token")
            .and_then(|t| ferry_plugins_abi::sdk::auth::Token::new(&t));
        let auth_timeout = Duration::from_millis(
            host.config("connect_timeout_ms")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(5_000),
        );
        let log_host = host;
        let server = Server::start(
            name.clone(),
            lookup,
            channel::Admission {
                token: token.clone(),
                auth_timeout: Duration::from_millis(
                    host.config("auth_timeout_ms")
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(ferry_plugins_abi::sdk::admission::DEFAULT_AUTH_TIMEOUT_MS),
                ),
                allowed_uids: allowed_uids(&host)?,
                log: Arc::new(move |m: &str| log_host.warn(m)),
            },
        )
        .map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("shm: cannot open its Unix socket: {e}"),
            )
        })?;
        let endpoint = Endpoint {
            pid,
            pidns: pid_namespace(),
            uid,
            socket: name,
            probe: &cma::PROBE_BYTE as *const u8 as u64,
            cma,
        };
        host.info(&format!(
            "shm: ready for engine {} (cross-memory attach {})",
            params.engine_name,
            if cma { "offered" } else { "off" }
        ));
        Ok(ShmInstance {
            host,
            token,
            auth_timeout,
            completer,
            timeout,
            hugepages,
            endpoint,
            owned,
            next_id: AtomicU64::new(random_u64() >> 1),
            server,
        })
    }

    fn owned_mut(&self) -> std::sync::RwLockWriteGuard<'_, Owned> {
        self.owned.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// A peer as this instance reaches it.
pub struct ShmPeer {
    name: String,
    endpoint: Endpoint,
    state: Arc<PeerState>,
    // Dropped last: closing it stops the reader thread that uses `state`.
    client: Client,
}

/// What copies and the socket reader share.
struct PeerState {
    /// Copies hold it shared; a revocation takes it exclusively, so it waits
    /// for copies in progress and no copy starts during it.
    copying: RwLock<PeerMemory>,
    /// Whether cross-memory attach to this peer is allowed, or why not.
    cma: Result<(), String>,
    closed: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct PeerMemory {
    /// Mapped allocations, by token.
    mappings: HashMap<u64, Arc<Mapping>>,
    /// Registration ids the peer revoked: never served again.
    revoked: HashSet<u64>,
}

struct Events(Weak<PeerState>);

impl ClientEvents for Events {
    fn revoke(&self, id: u64, token: u64) {
        if let Some(state) = self.0.upgrade() {
            let mut mem = state.copying.write().unwrap_or_else(|p| p.into_inner());
            mem.revoked.insert(id);
            if token != 0 {
                mem.mappings.remove(&token);
            }
        }
    }

    fn closed(&self) {
        if let Some(state) = self.0.upgrade() {
            state.closed.store(true, Ordering::SeqCst);
            let mut mem = state.copying.write().unwrap_or_else(|p| p.into_inner());
            mem.mappings.clear();
        }
    }
}

impl ShmPeer {
    fn gone(&self) -> PluginError {
        PluginError::new(
            ErrorCode::Connection,
            format!("shm: {} (pid {}) has exited", self.name, self.endpoint.pid),
        )
    }

    /// The mapping of allocation `token`, mapping it on first use. Called
    /// without the copy lock (the socket reader may need it meanwhile).
    fn ensure_mapped(&self, token: u64, timeout: Duration) -> PluginResult<()> {
        if self
            .state
            .copying
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .mappings
            .contains_key(&token)
        {
            return Ok(());
        }
        let (fd, len) = self.client.map(token, timeout).map_err(|e| {
            PluginError::new(ErrorCode::OutOfBounds, format!("shm: {}: {e}", self.name))
        })?;
        let mapping = memory::map(&fd, len).map_err(|e| {
            PluginError::new(ErrorCode::Protocol, format!("shm: {}: {e}", self.name))
        })?;
        self.state
            .copying
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .mappings
            .entry(token)
            .or_insert_with(|| Arc::new(mapping));
        Ok(())
    }
}

fn refused_range(r: &TransferRequest<'_>) -> PluginError {
    PluginError::new(
        ErrorCode::OutOfBounds,
        format!(
            "shm: [{:#x}, +{}) is no longer registered at the peer (unregistered or revoked)",
            r.remote_addr, r.length
        ),
    )
}

impl TransportInstance for ShmInstance {
    type Peer = ShmPeer;

    fn endpoint(&self) -> PluginResult<Vec<u8>> {
        Ok(self.endpoint.encode())
    }

    fn allocate_memory(&self, len: u64, _numa_node: Option<u32>) -> Option<PluginResult<u64>> {
        let token = random_u64();
        Some(match memory::allocate(len, self.hugepages, token) {
            Ok(a) => {
                let addr = a.addr;
                self.host.debug(&format!(
                    "shm: allocated {len} bytes at {addr:#x} ({})",
                    if a.huge { "huge pages" } else { "normal pages" }
                ));
                self.owned_mut().allocations.insert(addr, Arc::new(a));
                Ok(addr)
            }
            Err(e) => Err(PluginError::new(
                ErrorCode::NoMemory,
                format!("shm: cannot allocate {len} bytes of shareable memory: {e}"),
            )),
        })
    }

    fn free_memory(&self, addr: u64) -> PluginResult<()> {
        let mut owned = self.owned_mut();
        let a = owned.allocations.get(&addr).cloned().ok_or_else(|| {
            PluginError::new(
                ErrorCode::NotFound,
                format!("shm allocated nothing at {addr:#x}"),
            )
        })?;
        let used = owned
            .regions
            .values()
            .any(|r| matches!(r.key, Key::Map { token, .. } if token == a.token));
        if used {
            return Err(PluginError::new(
                ErrorCode::Busy,
                format!("memory at {addr:#x} is still registered"),
            ));
        }
        owned.allocations.remove(&addr);
        Ok(())
    }

    fn register_memory(&self, region: &MemRegion) -> PluginResult<Registration> {
        if region.mem_kind != sys::FERRY_MEM_HOST {
            return Err(PluginError::new(
                ErrorCode::Unsupported,
                "shm moves host memory only",
            ));
        }
        if region.local_only {
            // Copies from or into it happen in this process only.
            return Ok(Registration {
                handle: LOCAL_ONLY_HANDLE,
                key: Vec::new(),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let mut owned = self.owned_mut();
        let key = match owned.allocation_containing(region.addr, region.len) {
            Some(a) => Key::Map {
                id,
                token: a.token,
                base: a.addr,
                len: a.len,
            },
            None => Key::Cma {
                id,
                base: region.addr,
                len: region.len,
            },
        };
        owned.regions.insert(id, Region { key });
        Ok(Registration {
            handle: id,
            key: key.encode(),
        })
    }

    fn unregister_memory(&self, handle: u64) -> PluginResult<()> {
        if handle == LOCAL_ONLY_HANDLE {
            return Ok(());
        }
        let region = self.owned_mut().regions.remove(&handle).ok_or_else(|| {
            PluginError::new(ErrorCode::NotFound, format!("no registration {handle}"))
        })?;
        let token = match region.key {
            Key::Map { token, .. } => token,
            Key::Cma { .. } => 0,
        };
        let missing = self.server.revoke(region.key.id(), token, self.timeout);
        if missing > 0 {
            self.host.warn(&format!(
                "shm: {missing} peer(s) did not confirm within {} ms that they stopped using a \
                 buffer being unregistered",
                self.timeout.as_millis()
            ));
            if token == 0 {
                return Err(PluginError::new(
                    ErrorCode::Busy,
                    format!("{missing} peer(s) may still be copying into the buffer"),
                ));
            }
        }
        Ok(())
    }

    fn connect(&self, peer: &PeerInfo) -> PluginResult<ShmPeer> {
        let endpoint = Endpoint::decode(&peer.endpoint).ok_or_else(|| {
            PluginError::new(
                ErrorCode::Protocol,
                format!("{}: its shm endpoint is malformed", peer.name),
            )
        })?;
        let state = Arc::new(PeerState {
            copying: RwLock::default(),
            cma: self.cma_verdict(&endpoint),
            closed: Default::default(),
        });
        let client = Client::connect(
            &endpoint.socket,
            endpoint.pid,
            Arc::new(Events(Arc::downgrade(&state))),
            self.token.as_ref(),
            self.auth_timeout,
        )
        .map_err(|e| unavailable(format!("{} {e}", peer.name)))?;
        if let Err(why) = &state.cma {
            self.host.info(&format!(
                "shm: {}: cross-memory attach unavailable ({why}); only its Ferry-allocated \
                 memory goes over shm",
                peer.name
            ));
        }
        Ok(ShmPeer {
            name: peer.name.clone(),
            endpoint,
            state,
            client,
        })
    }

    fn accepts(&self, peer: &ShmPeer, key: &[u8]) -> PluginResult<()> {
        match Key::decode(key) {
            Some(Key::Map { .. }) if peer.client.is_dead() => Err(peer.gone()),
            Some(Key::Map { .. }) => Ok(()),
            Some(Key::Cma { .. }) => {
                peer.state.cma.clone().map_err(|why| {
                    unavailable(format!("cross-memory attach to {}: {why}", peer.name))
                })
            }
            None => Err(unavailable("malformed shm key")),
        }
    }

    fn submit(&self, peer: &ShmPeer, requests: &[TransferRequest<'_>]) -> PluginResult<()> {
        if peer.state.closed.load(Ordering::SeqCst) {
            return Err(peer.gone());
        }
        let keys: Vec<Option<Key>> = requests.iter().map(|r| Key::decode(r.remote_key)).collect();
        // Map what is not mapped yet, before taking the copy lock.
        for key in keys.iter().flatten() {
            if let Key::Map { token, .. } = key {
                peer.ensure_mapped(*token, self.timeout)?;
            }
        }
        let mem = peer.state.copying.read().unwrap_or_else(|p| p.into_inner());
        let mut cma_batch: Vec<usize> = Vec::new();
        for (i, (r, key)) in requests.iter().zip(&keys).enumerate() {
            let result = match key {
                None => Err(PluginError::new(ErrorCode::Protocol, "malformed shm key")),
                Some(k) if mem.revoked.contains(&k.id()) => Err(refused_range(r)),
                Some(Key::Map {
                    token, base, len, ..
                }) => copy_mapped(&mem, r, *token, *base, *len),
                Some(Key::Cma { .. }) => {
                    cma_batch.push(i);
                    continue;
                }
            };
            self.completer
                .complete(r.token, result.as_ref().map(|_| ()));
        }
        if !cma_batch.is_empty() {
            self.copy_cma(peer, requests, &cma_batch);
        }
        Ok(())
    }

    fn describe_peer(&self, peer: &ShmPeer) -> Option<String> {
        Some(format!(
            "shm to pid {}: mapped memfd for Ferry-allocated memory; cross-memory attach {}",
            peer.endpoint.pid,
            match &peer.state.cma {
                Ok(()) => "for other memory".to_string(),
                Err(why) => format!("unavailable ({why})"),
            }
        ))
    }
}

/// Copies one request through a mapping of the peer's allocation.
fn copy_mapped(
    mem: &PeerMemory,
    r: &TransferRequest<'_>,
    token: u64,
    base: u64,
    len: u64,
) -> PluginResult<()> {
    let mapping = mem.mappings.get(&token).ok_or_else(|| refused_range(r))?;
    let off = r
        .remote_addr
        .checked_sub(base)
        .ok_or_else(|| refused_range(r))?;
    let end = off.checked_add(r.length).ok_or_else(|| refused_range(r))?;
    if end > len.min(mapping.len) {
        return Err(refused_range(r));
    }
    let remote = mapping.base.wrapping_add(off as usize);
    let local = r.local_addr as *mut u8;
    // SAFETY: [off, end) lies inside the mapping, which the copy lock keeps
    // mapped; the local range lies in a buffer the engine checked is
    // registered here and keeps registered while the request is in flight.
    // ptr::copy tolerates the two ranges aliasing (same process, same file).
    unsafe {
        match r.op {
            Op::Write => std::ptr::copy(local.cast_const(), remote, r.length as usize),
            Op::Read => std::ptr::copy(remote.cast_const(), local, r.length as usize),
        }
    }
    Ok(())
}

const IOV_MAX: usize = 1024;

impl ShmInstance {
    fn cma_verdict(&self, e: &Endpoint) -> Result<(), String> {
        if !e.cma {
            return Err("the peer turned it off (FERRY_SHM_CMA=off)".into());
        }
        if !self.endpoint.cma {
            return Err("turned off here (FERRY_SHM_CMA=off)".into());
        }
        if e.pidns != self.endpoint.pidns {
            return Err(
                "the peer is in another PID namespace, so its pid means nothing here".into(),
            );
        }
        let mut byte = 0u8;
        // SAFETY: reading one byte into a local; the remote address is
        // checked by the kernel.
        match unsafe { cma::transfer(e.pid, false, &mut byte, e.probe, 1) } {
            Ok(1) if byte == 0x5a => Ok(()),
            Ok(_) => Err("the peer's probe byte did not read back (a different process?)".into()),
            Err(err) => Err(cma::explain_refusal(&err, e.uid)),
        }
    }

    /// Copies the cross-memory-attach requests `idx`, one system call per
    /// run of up to IOV_MAX requests of the same operation.
    fn copy_cma(&self, peer: &ShmPeer, requests: &[TransferRequest<'_>], idx: &[usize]) {
        let mut start = 0;
        while start < idx.len() {
            let op = requests[idx[start]].op;
            let mut end = start;
            while end < idx.len() && end - start < IOV_MAX && requests[idx[end]].op == op {
                end += 1;
            }
            let run = &idx[start..end];
            let iov = |addr: u64, len: u64| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len as usize,
            };
            let local: Vec<libc::iovec> = run
                .iter()
                .map(|&i| iov(requests[i].local_addr, requests[i].length))
                .collect();
            let remote: Vec<libc::iovec> = run
                .iter()
                .map(|&i| iov(requests[i].remote_addr, requests[i].length))
                .collect();
            // SAFETY: every local iovec is a range of a buffer the engine
            // registered and keeps registered while the request is in flight.
            let moved =
                unsafe { cma::vectored(peer.endpoint.pid, op == Op::Write, &local, &remote) };
            let mut done: u64 = match &moved {
                Ok(n) => *n as u64,
                Err(_) => 0,
            };
            for &i in run {
                let r = &requests[i];
                let result = if done >= r.length {
                    done -= r.length;
                    Ok(())
                } else {
                    done = 0;
                    Err(match &moved {
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => peer.gone(),
                        Err(e) if e.raw_os_error() == Some(libc::EPERM) => PluginError::new(
                            ErrorCode::Permission,
                            format!("shm: {}", cma::explain_refusal(e, peer.endpoint.uid)),
                        ),
                        Err(e) => PluginError::new(
                            ErrorCode::OutOfBounds,
                            format!(
                                "shm: cross-memory copy of [{:#x}, +{}) at {} failed: {e}",
                                r.remote_addr, r.length, peer.name
                            ),
                        ),
                        Ok(_) => PluginError::new(
                            ErrorCode::OutOfBounds,
                            format!(
                                "shm: [{:#x}, +{}) is not mapped in {} any more",
                                r.remote_addr, r.length, peer.name
                            ),
                        ),
                    })
                };
                self.completer
                    .complete(r.token, result.as_ref().map(|_| ()));
            }
            start = end;
        }
    }
}
