//! Ferry's CUDA IPC transport (`libferry_transport_cuda_ipc.so`): GPU memory
//! between processes of one host at device speed, and GPU memory to and
//! from a same-host peer's engine-allocated host memory, with no staging
//! hop. Copies run on the GPU's copy engines (cuMemcpyAsync on a few
//! streams per GPU, so the requests of a batch overlap); completion comes
//! from events that `progress` polls, with no thread per request.
//!
//! Export, per registration of device memory: a CUDA IPC handle
//! (cuIpcGetMemHandle) for cuMemAlloc memory (cudaMalloc, PyTorch's caching
//! allocator), else one POSIX fd per VMM chunk (cuMemExportToShareableHandle;
//! PyTorch's `expandable_segments:True`). Host memory is exported when the
//! engine allocated it in a file peers may map (`share_fd`). A peer opens a
//! registration once and caches it (`import`).
//!
//! Safety: handles and descriptors only travel over this instance's Unix
//! socket (`channel`), to authenticated peers of the same user (SO_PEERCRED);
//! the descriptor carries no handle. Unregistering revokes: every importer
//! closes its mapping before `unregister_memory` returns. A request outside
//! the registration the exporter reported is refused before any copy.
//!
//! Settings (engine configuration key, then environment variable):
//! - `cuda.library` / `FERRY_CUDA_LIBRARY`: the driver library (as the cuda
//!   device plugin).
//! - `cuda_ipc.streams` / `FERRY_CUDA_IPC_STREAMS`: copy streams per GPU
//!   (default 4).
//! - `cuda_ipc.copy` / `FERRY_CUDA_IPC_COPY`: how lists of copies (a block
//!   list, the requests of one submission for one GPU) move: `auto` (the
//!   copy kernel, one launch per list, where it loads and both ends are GPU
//!   memory; else cuMemcpyBatchAsync where the driver has it; else one
//!   cuMemcpyAsync per copy), or `kernel`, `batch`, `per-copy` to force one.

mod channel;
mod copies;
mod gpu;
mod import;
mod lists;
mod submit;
pub mod wire;

use channel::{Client, ClientEvents, Exported, Server};
use copies::Copies;
use ferry_cuda_driver::driver::{self, Driver};
use ferry_cuda_driver::method::CopySetting;
use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::{
    BlockList, Completer, Host, InitParams, LayoutList, MemRegion, PeerInfo, PluginError,
    PluginResult, ProbeDevice, ProbeReport, Registration, TransferRequest, TransportInstance,
};
use ferry_plugins_abi::{sys, ErrorCode};
use gpu::Gpus;
use import::{Import, IpcCache, OPEN_MAPPINGS};
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;
use wire::{Endpoint, Key, Memory, Piece};

pub struct CudaIpcTransport;

/// A small request's completion time we declare (queue a copy, record an
/// event, see it done from `progress`).
const LATENCY_NS: u32 = 15_000;

fn unavailable(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Unavailable, msg)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// 64 random bits from the kernel, for names others must not guess.
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into b.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    u64::from_le_bytes(b) | 1
}

fn boot_id() -> Vec<u8> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().replace('-', "").into_bytes())
        .unwrap_or_default()
        .into_iter()
        .take(64)
        .collect()
}

/// Opens and checks the driver for this transport.
fn open_driver(host: &Host<'_>) -> PluginResult<&'static Driver> {
    let configured = host
        .config("cuda.library")
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let d = driver::open(configured.as_deref())?;
    d.init()?;
    d.require_all()?;
    let missing = gpu::missing_functions(d);
    if !missing.is_empty() {
        return Err(unavailable(format!(
            "{} lacks {}: this driver cannot share GPU memory between processes",
            d.library,
            missing.join(", ")
        )));
    }
    Ok(d)
}

/// "cuda:0<->cuda:1 yes" pairs, for `ferry info`.
fn peer_matrix(gpus: &Gpus) -> String {
    let n = gpus.list.len();
    if n < 2 {
        return "one GPU: copies stay on it".into();
    }
    let mut rows = Vec::new();
    for a in 0..n {
        let row: Vec<&str> = (0..n)
            .map(|b| match (a == b, gpus.can_access_peer(a, b)) {
                (true, _) => "X",
                (false, true) => "ok",
                (false, false) => "no",
            })
            .collect();
        rows.push(format!("cuda:{}: {}", gpus.list[a].ordinal, row.join(" ")));
    }
    rows.join("; ")
}

impl ferry_plugins_abi::sdk::TransportPlugin for CudaIpcTransport {
    const NAME: &'static CStr = c"cuda-ipc";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr =
        c"GPU memory between processes of one host: CUDA IPC handles or VMM fds, copy engines";
    const BLOCK_LISTS: bool = true;
    const LAYOUT_LISTS: bool = true;
    type Instance = CudaIpcInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        let d = open_driver(host)?;
        let mut gpus = Gpus::new(d, 1)?;
        gpus.copy = CopySetting::parse("cuda_ipc.copy", host.config("cuda_ipc.copy").as_deref())?;
        if gpus.list.is_empty() {
            return Err(unavailable(format!(
                "no CUDA device visible ({})",
                driver::visible_devices()
            )));
        }
        report.set_capabilities(
            sys::FERRY_MEM_CUDA_IPC | sys::FERRY_MEM_HOST,
            sys::FERRY_SCOPE_SAME_HOST,
        );
        for (i, g) in gpus.list.iter().enumerate() {
            let name = format!("cuda:{}", g.ordinal);
            let detail = format!("{} ({}), copy engines", g.name, g.uuid);
            report.add_device(&ProbeDevice {
                name: &name,
                pci_bus_id: Some(&g.pci_bus_id),
                detail: Some(&detail),
                mem_kinds: sys::FERRY_MEM_CUDA_IPC | sys::FERRY_MEM_HOST,
                bandwidth_mbps: gpus.copy_bandwidth_mbps(i),
                latency_ns: LATENCY_NS,
                ..Default::default()
            });
        }
        report.add_note("peer access", &peer_matrix(&gpus));
        // Loads the kernel here, in the probe's process, so `ferry info`
        // says what this host's GPUs actually get.
        let (_, how) = gpus.list_method(0);
        report.add_note(
            "copies",
            &format!(
                "lists of GPU copies (cuda_ipc.copy={}): {how}; host memory by {}",
                gpus.copy.name(),
                if gpus.has_batch() {
                    "cuMemcpyBatchAsync"
                } else {
                    "one cuMemcpyAsync per copy"
                }
            ),
        );
        if !gpus.vmm {
            report.add_missing(
                "cuda-vmm",
                &format!(
                    "{} lacks cuMemExportToShareableHandle or the VMM calls: memory from \
                     cuMemCreate (PyTorch expandable_segments) is staged",
                    d.library
                ),
            );
        }
        report.add_note(
            "host memory",
            "a peer's host memory is reached directly when its engine allocated it \
             (allocate_memory); other host buffers go over shm or tcp",
        );
        Ok(())
    }

    fn init(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<CudaIpcInstance> {
        CudaIpcInstance::start(host, params, completer)
    }
}

ferry_plugins_abi::export_transport_plugin!(CudaIpcTransport);

/// What a local registration is, for accepts_pair and submit.
#[derive(Clone, Copy, Debug)]
enum LocalMemory {
    /// Device memory of GPU index `gpu` (into `Gpus::list`).
    Device(usize),
    Host,
}

#[derive(Clone, Copy, Debug)]
struct LocalReg {
    addr: u64,
    len: u64,
    memory: LocalMemory,
}

/// A count setting, or its default when unset or not a number (as the
/// other settings of this plugin are read).
fn number(host: &Host<'_>, key: &str, default: usize) -> usize {
    host.config(key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

type Exports = RwLock<HashMap<u64, Arc<Exported>>>;

pub struct CudaIpcInstance {
    host: Host<'static>,
    completer: Completer,
    gpus: Arc<Gpus>,
    endpoint: Endpoint,
    token: Option<ferry_plugins_abi::sdk::auth::Token>,
    timeout: Duration,
    connect_timeout: Duration,
    locals: RwLock<HashMap<u64, LocalReg>>,
    exports: Arc<Exports>,
    ipc_cache: Arc<IpcCache>,
    copies: Arc<Copies>,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
    next_id: AtomicU64,
    // Last: peers' connections to it close before the state above goes.
    server: Server,
}

impl CudaIpcInstance {
    fn start(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<CudaIpcInstance> {
        let d = open_driver(&host)?;
        let ms = |key: &str, default: u64| {
            Duration::from_millis(
                host.config(key)
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(default),
            )
        };
        let timeout = ms("timeout_ms", 15_000);
        let connect_timeout = ms("connect_timeout_ms", 5_000);
        let streams = host
            .config("cuda_ipc.streams")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(4);
        let mut gpus = Gpus::new(d, streams)?;
        gpus.copy = CopySetting::parse("cuda_ipc.copy", host.config("cuda_ipc.copy").as_deref())?;
        gpus.log = Some(host);
        let gpus = Arc::new(gpus);
        // SAFETY: getpid/getuid have no preconditions.
        let (pid, uid) = unsafe { (libc::getpid(), libc::getuid()) };
        let socket = format!("ferry-cuda-ipc-{pid}-{:016x}", random_u64()).into_bytes();
        let exports: Arc<Exports> = Arc::default();
        let lookup_exports = exports.clone();
        let lookup: Arc<channel::Lookup> = Arc::new(move |id| {
            lookup_exports
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&id)
                .cloned()
                .ok_or_else(|| {
                    PluginError::new(
                        ErrorCode::NotFound,
                        format!("registration {id} is not (or no longer) registered here"),
                    )
                })
        });
        let token = host
            .config("auth.token")
            .and_then(|t| ferry_plugins_abi::sdk::auth::Token::new(&t));
        let count_host = host;
        let refusals = Arc::new(
            admission::Refusals::new("cuda-ipc")
                .counted_by(move |r| count_host.count(r.counter(), None, 1)),
        );
        let log_host = host;
        let server = Server::start(
            &socket,
            lookup,
            channel::Admission {
                token: token.clone(),
                auth_timeout: ms("auth_timeout_ms", admission::DEFAULT_AUTH_TIMEOUT_MS),
                max_pending: number(&host, "auth.max_pending", admission::DEFAULT_MAX_PENDING),
                max_pending_per_source: number(
                    &host,
                    "auth.max_pending_per_host",
                    admission::DEFAULT_MAX_PENDING_PER_SOURCE,
                ),
                refusals,
                log: Arc::new(move |m: &str| log_host.warn(m)),
            },
        )
        .map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("cuda-ipc: cannot open its Unix socket: {e}"),
            )
        })?;
        let endpoint = Endpoint {
            pid,
            uid,
            pidns: ferry_plugins_abi::sdk::local::namespace("pid"),
            ipcns: ferry_plugins_abi::sdk::local::namespace("ipc"),
            boot: boot_id(),
            socket,
        };
        let (copies, poller) = Copies::start(gpus.clone(), completer).map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("cuda-ipc: cannot start its completion thread: {e}"),
            )
        })?;
        host.info(&format!(
            "cuda-ipc: ready for engine {} ({} GPU(s), {} copy streams each{}); lists of copies \
             (cuda_ipc.copy={}): {}",
            params.engine_name,
            gpus.list.len(),
            streams,
            if gpus.vmm { "" } else { "; no VMM export" },
            gpus.copy.name(),
            match (gpus.copy, gpus.has_batch()) {
                (CopySetting::Force(m), _) => m.name(),
                (CopySetting::Auto, true) =>
                    "the copy kernel where it loads, else cuMemcpyBatchAsync",
                (CopySetting::Auto, false) =>
                    "the copy kernel where it loads, else one cuMemcpyAsync per copy",
            }
        ));
        Ok(CudaIpcInstance {
            host,
            completer,
            gpus,
            endpoint,
            token,
            timeout,
            connect_timeout,
            locals: RwLock::default(),
            exports,
            ipc_cache: Arc::default(),
            copies,
            poller: Mutex::new(Some(poller)),
            next_id: AtomicU64::new(random_u64() >> 1),
            server,
        })
    }

    fn local(&self, handle: u64) -> Option<LocalReg> {
        self.locals
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&handle)
            .copied()
    }

    /// Whether requests between this local registration and the peer's
    /// key can be served, or why not.
    fn pair_verdict(&self, local: LocalMemory, key: &Key) -> Result<usize, String> {
        let remote_gpu = |gpu: &str| {
            self.gpus.by_uuid(gpu).ok_or_else(|| {
                format!(
                    "the peer's GPU {gpu} is not visible to this process ({})",
                    driver::visible_devices()
                )
            })
        };
        match (local, &key.memory) {
            (LocalMemory::Host, Memory::Host { .. }) => {
                Err("both buffers are host memory (cuda-ipc moves data to or from GPUs)".into())
            }
            (LocalMemory::Device(g), Memory::Device { gpu }) => {
                let r = remote_gpu(gpu)?;
                if self.gpus.can_access_peer(g, r) {
                    Ok(g)
                } else {
                    Err(format!(
                        "cuda:{} cannot access cuda:{} (cuDeviceCanAccessPeer says no: no \
                         NVLink or PCIe peer path)",
                        self.gpus.list[g].ordinal, self.gpus.list[r].ordinal
                    ))
                }
            }
            (LocalMemory::Device(_), Memory::Host { shared: false }) => Err(
                "the peer's host buffer is not memory its engine allocated, so it cannot be \
                 mapped here"
                    .into(),
            ),
            (LocalMemory::Device(g), Memory::Host { shared: true }) => Ok(g),
            (LocalMemory::Host, Memory::Device { gpu }) => remote_gpu(gpu),
        }
    }
}

impl Drop for CudaIpcInstance {
    fn drop(&mut self) {
        // Complete what is in flight before the mappings go.
        if let Some(p) = lock(&self.poller).take() {
            self.copies.shut_down(p);
        }
    }
}

/// A peer as this instance reaches it.
pub struct CudaIpcPeer {
    name: String,
    endpoint: Endpoint,
    same_process: bool,
    state: Arc<PeerState>,
    // Dropped last: closing it stops the reader thread that uses `state`.
    client: Client,
}

#[derive(Default)]
struct PeerState {
    imports: RwLock<HashMap<u64, Arc<Import>>>,
    /// Registrations the peer revoked: never opened again.
    revoked: Mutex<HashSet<u64>>,
}

impl PeerState {
    fn close_all(&self) {
        let all: Vec<Arc<Import>> = self
            .imports
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, i)| i)
            .collect();
        for i in all {
            i.close();
        }
    }
}

struct Events(Weak<PeerState>);

impl ClientEvents for Events {
    fn revoke(&self, id: u64) {
        let Some(state) = self.0.upgrade() else {
            return;
        };
        lock(&state.revoked).insert(id);
        let import = state
            .imports
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        if let Some(i) = import {
            // Closed now, not when the last in-flight copy drops its Arc.
            i.close();
        }
    }

    fn closed(&self) {
        if let Some(state) = self.0.upgrade() {
            state.close_all();
        }
    }
}

impl CudaIpcPeer {
    fn gone(&self) -> PluginError {
        PluginError::new(
            ErrorCode::Connection,
            format!(
                "cuda-ipc: {} (pid {}) has exited",
                self.name, self.endpoint.pid
            ),
        )
    }

    /// The peer's registration `key.id`, opened on first use, on GPU `gpu`
    /// (the one that runs the copies to and from it).
    fn import(&self, inst: &CudaIpcInstance, key: &Key, gpu: usize) -> PluginResult<Arc<Import>> {
        let import = self.open_cached(inst, key, gpu)?;
        // The key's claim about the memory must match what the exporter
        // shared under that registration, every time.
        let expected = match key.memory {
            Memory::Device { .. } => [wire::KIND_IPC, wire::KIND_VMM].contains(&import.kind),
            Memory::Host { .. } => import.kind == wire::KIND_HOST,
        };
        if !expected {
            return Err(PluginError::new(
                ErrorCode::Protocol,
                format!(
                    "cuda-ipc: {}: its key and its registration {} disagree on the kind of memory",
                    self.name, key.id
                ),
            ));
        }
        Ok(import)
    }

    fn open_cached(
        &self,
        inst: &CudaIpcInstance,
        key: &Key,
        gpu: usize,
    ) -> PluginResult<Arc<Import>> {
        if let Some(i) = self
            .state
            .imports
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key.id)
        {
            return Ok(i.clone());
        }
        if lock(&self.state.revoked).contains(&key.id) {
            return Err(import::revoked(key.id));
        }
        if self.client.is_dead() {
            return Err(self.gone());
        }
        let opened = self.client.open(key.id, inst.timeout).map_err(|e| {
            PluginError::new(e.code, format!("cuda-ipc: {}: {}", self.name, e.message))
        })?;
        // Opened in the context of the GPU that runs the copies: the driver
        // then enables peer access from it to the owner's GPU.
        let import = Arc::new(Import::open(
            &inst.gpus,
            gpu,
            self.same_process,
            opened,
            &inst.ipc_cache,
        )?);
        let mut imports = self
            .state
            .imports
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        // Revoked while we were opening it: close it again.
        if lock(&self.state.revoked).contains(&key.id) {
            drop(imports);
            import.close();
            return Err(import::revoked(key.id));
        }
        Ok(imports.entry(key.id).or_insert(import).clone())
    }
}

impl TransportInstance for CudaIpcInstance {
    type Peer = CudaIpcPeer;

    fn endpoint(&self) -> PluginResult<Vec<u8>> {
        Ok(self.endpoint.encode())
    }

    fn register_memory(&self, region: &MemRegion) -> PluginResult<Registration> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (memory, key_memory, export) = if region.mem_kind == sys::FERRY_MEM_CUDA_IPC {
            let gpu = region
                .device_ordinal
                .and_then(|o| self.gpus.by_ordinal(o))
                .ok_or_else(|| {
                    unavailable(format!(
                        "cuda-ipc: {} is not a GPU this process sees",
                        region.location
                    ))
                })?;
            let export = if region.local_only {
                None
            } else {
                let (kind, pieces, fds) = self
                    .gpus
                    .export(gpu, region.addr, region.len)
                    .map_err(|e| unavailable(format!("cuda-ipc: {}", e.message)))?;
                Some((kind, pieces, fds))
            };
            let uuid = self.gpus.list[gpu].uuid.clone();
            (
                LocalMemory::Device(gpu),
                Memory::Device { gpu: uuid },
                export,
            )
        } else if region.mem_kind == sys::FERRY_MEM_HOST {
            let export = match (region.share_fd, region.local_only) {
                (Some((fd, offset)), false) => {
                    // SAFETY: the engine owns fd and keeps it open for the
                    // call; we keep our own duplicate.
                    let dup = unsafe { BorrowedFd::borrow_raw(fd) }
                        .try_clone_to_owned()
                        .map_err(|e| {
                            PluginError::new(ErrorCode::Io, format!("cuda-ipc: dup: {e}"))
                        })?;
                    let piece = Piece {
                        start: region.addr,
                        len: region.len,
                        fd_offset: offset,
                        has_fd: true,
                        handle: [0; 64],
                    };
                    Some((wire::KIND_HOST, vec![piece], vec![dup]))
                }
                _ => None,
            };
            let shared = export.is_some();
            (LocalMemory::Host, Memory::Host { shared }, export)
        } else {
            return Err(PluginError::new(
                ErrorCode::Unsupported,
                "cuda-ipc registers device memory (FERRY_MEM_CUDA_IPC) and host memory only",
            ));
        };
        if let Some((kind, pieces, fds)) = export {
            let e = Exported {
                addr: region.addr,
                len: region.len,
                kind,
                pieces,
                fds,
            };
            self.exports
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(id, Arc::new(e));
        }
        self.locals
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                LocalReg {
                    addr: region.addr,
                    len: region.len,
                    memory,
                },
            );
        let key = Key {
            id,
            addr: region.addr,
            len: region.len,
            memory: key_memory,
        };
        Ok(Registration {
            handle: id,
            key: key.encode(),
        })
    }

    fn unregister_memory(&self, handle: u64) -> PluginResult<()> {
        let known = self
            .locals
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&handle)
            .is_some();
        if !known {
            return Err(PluginError::new(
                ErrorCode::NotFound,
                format!("cuda-ipc: no registration {handle}"),
            ));
        }
        let exported = self
            .exports
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&handle);
        if exported.is_some() {
            let missing = self.server.revoke(handle, self.timeout);
            if missing > 0 {
                self.host.warn(&format!(
                    "cuda-ipc: {missing} peer(s) did not confirm within {} ms that they closed a \
                     buffer being unregistered",
                    self.timeout.as_millis()
                ));
                return Err(PluginError::new(
                    ErrorCode::Busy,
                    format!("cuda-ipc: {missing} peer(s) may still have the buffer mapped"),
                ));
            }
        }
        Ok(())
    }

    fn connect(&self, peer: &PeerInfo) -> PluginResult<CudaIpcPeer> {
        let e = Endpoint::decode(&peer.endpoint).ok_or_else(|| {
            PluginError::new(
                ErrorCode::Protocol,
                format!("{}: its cuda-ipc endpoint is malformed", peer.name),
            )
        })?;
        let mine = &self.endpoint;
        let refuse = if e.boot != mine.boot {
            Some("it runs on another host (a different boot id)".to_string())
        } else if e.uid != mine.uid {
            Some(format!(
                "it runs as uid {}, this process as uid {}: CUDA handles go to the same user only",
                e.uid, mine.uid
            ))
        } else if e.ipcns != mine.ipcns || e.pidns != mine.pidns {
            Some("it runs in another IPC or PID namespace (another container)".to_string())
        } else {
            None
        };
        if let Some(why) = refuse {
            return Err(unavailable(format!("cuda-ipc: {}: {why}", peer.name)));
        }
        let state = Arc::new(PeerState::default());
        let client = Client::connect(
            &e.socket,
            e.pid,
            Arc::new(Events(Arc::downgrade(&state))),
            self.token.as_ref(),
            self.connect_timeout,
        )
        .map_err(|why| unavailable(format!("cuda-ipc: {}: {why}", peer.name)))?;
        Ok(CudaIpcPeer {
            name: peer.name.clone(),
            same_process: e.pid == mine.pid,
            endpoint: e,
            state,
            client,
        })
    }

    fn disconnect(&self, peer: CudaIpcPeer) {
        // Copies to its mappings finish before they close.
        peer.state.close_all();
        drop(peer);
    }

    fn accepts_pair(&self, peer: &CudaIpcPeer, local_mem: u64, key: &[u8]) -> PluginResult<()> {
        if peer.client.is_dead() {
            return Err(peer.gone());
        }
        let key = Key::decode(key).ok_or_else(|| unavailable("malformed cuda-ipc key"))?;
        let local = self
            .local(local_mem)
            .ok_or_else(|| unavailable("the local buffer is not registered with cuda-ipc"))?;
        let gpu = self.pair_verdict(local.memory, &key).map_err(unavailable)?;
        // Open it now: a registration this driver cannot map (a VMM layout
        // it refuses, a handle from a process it cannot reach) is declined
        // here, and the engine stages it, rather than failing the request.
        peer.import(self, &key, gpu).map(|_| ()).map_err(|e| {
            unavailable(format!(
                "cannot open the peer's registration {}: {}",
                key.id, e.message
            ))
        })
    }

    fn accepts(&self, peer: &CudaIpcPeer, key: &[u8]) -> PluginResult<()> {
        if peer.client.is_dead() {
            return Err(peer.gone());
        }
        Key::decode(key)
            .map(|_| ())
            .ok_or_else(|| unavailable("malformed cuda-ipc key"))
    }

    fn submit(&self, peer: &CudaIpcPeer, requests: &[TransferRequest<'_>]) -> PluginResult<()> {
        if peer.client.is_dead() {
            return Err(peer.gone());
        }
        let queued = self.queue(peer, requests);
        self.copies.add(queued);
        self.copies.progress();
        Ok(())
    }

    fn submit_blocks(&self, peer: &CudaIpcPeer, list: &BlockList<'_>) -> PluginResult<()> {
        if peer.client.is_dead() {
            return Err(peer.gone());
        }
        self.queue_blocks(peer, list)?;
        self.copies.progress();
        Ok(())
    }

    fn submit_layouts(&self, peer: &CudaIpcPeer, list: &LayoutList<'_>) -> PluginResult<()> {
        if peer.client.is_dead() {
            return Err(peer.gone());
        }
        self.queue_layouts(peer, list)?;
        self.copies.progress();
        Ok(())
    }

    fn progress(&self) -> usize {
        self.copies.progress()
    }

    fn describe_peer(&self, peer: &CudaIpcPeer) -> Option<String> {
        let imports = peer
            .state
            .imports
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        let lists = match self.gpus.list.is_empty() {
            true => String::new(),
            false => {
                let (method, how) = self.gpus.list_method(0);
                format!("; lists of GPU copies by {}: {how}", method.name())
            }
        };
        Some(format!(
            "cuda-ipc to pid {}{}: {} of its registrations open here, {} mappings open in this \
             process, {} opens asked{lists}",
            peer.endpoint.pid,
            if peer.same_process {
                " (this process: no mapping needed)"
            } else {
                ""
            },
            imports,
            OPEN_MAPPINGS.load(Ordering::SeqCst),
            peer.client.opens.load(Ordering::Relaxed)
        ))
    }
}
