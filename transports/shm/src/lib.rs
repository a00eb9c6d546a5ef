//! Ferry's shared-memory transport plugin: host memory between processes of
//! one host, without the network stack.
//!
//! Two ways in, decided per buffer (each buffer's key says which):
//! - **mapped**: memory the engine allocated is a sealed memfd, which the
//!   engine hands over at registration (`share_fd`); a peer gets the fd over
//!   the instances' Unix socket, maps it once and copies with plain loads
//!   and stores (non-temporal stores for large parts). Needs no ptrace
//!   permission.
//! - **cross-memory attach**: any other registered memory is read or
//!   written with process_vm_readv/writev, batched into one system call per
//!   stretch of requests.
//!
//! Large submissions are split over a pool of copy threads near the memory
//! (one pool per NUMA node, shared by all peers); small ones are copied on
//! the submitting thread. Needs the kernel's permission (same user, Yama, seccomp); when a
//!   peer cannot get it, `accepts` says why and the engine uses the next
//!   transport (TCP).
//!
//! Same-host peers only: the engine offers shm for peers whose machine id
//! (boot id and IPC namespace) equals ours, and `connect` checks that the
//! peer's socket is reachable (same network namespace) and belongs to the
//! advertised process.
//!
//! Safety of the target: a peer only gets the file of a live registration
//! and only copies into ranges the engine checked against the target's
//! descriptor (and this plugin against the buffer's key). Unregistering tells every peer (REVOKE) and waits
//! until each confirms it has stopped touching the buffer; a revoked
//! registration is never served again. A connection copies nothing until
//! the owner has answered on it (so it is listed for revocations), and
//! asks once whether a cross-memory key's registration still exists (LIVE)
//! before its first copy under it: a key read before the connection
//! opened may name memory unregistered since. Only processes of this user (and of
//! `shm.allowed_uids`) may connect to the socket (SO_PEERCRED, checked
//! before anything is read), and they must prove the token. Cross-memory
//! attach needs ptrace-level permission, with which a process could write to
//! the target anyway.

mod blocks;
mod channel;
mod cma;
mod copy;
mod endpoint;
mod memory;
mod numa;
mod owner;
mod peer_keys;
mod pool;
mod speed;
mod wire;

use channel::{Client, ClientEvents};
use copy::{NonTemporal, Piece};
use endpoint::{Endpoint, Key};
use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::{
    BlockList, Completer, Host, InitParams, MemRegion, PeerInfo, PluginError, PluginResult,
    ProbeDevice, ProbeReport, Registration, TransferRequest, TransportInstance,
};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use memory::{Mapping, SharedFile};
use owner::Server;
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
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
    // Local memory is only an address for memcpy or process_vm_readv/
    // writev: it needs no registration.
    const FLAGS: u64 = ferry_plugins_abi::sys::FERRY_TRANSPORT_LOCAL_UNREGISTERED;
    // A block list is checked once against the peer's buffer, copied as
    // runs of blocks over the copy threads and completed once (blocks.rs).
    const BLOCK_LISTS: bool = true;
    type Instance = ShmInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        // Mapped memory needs memfd.
        memory::memfd()
            .map_err(|e| unavailable(format!("cannot create shareable memory (memfd): {e}")))?;
        report.set_capabilities(sys::FERRY_MEM_HOST, sys::FERRY_SCOPE_SAME_HOST);
        let huge = memory::hugetlb_pages();
        let copiers = pool::Copiers::parse(host.config("shm.copy_threads").as_deref())
            .map_err(|e| PluginError::new(ErrorCode::InvalidArgument, e))?
            .for_node(numa::NodeMap::read().resolve(None));
        let declared = speed::measure(copiers);
        let detail = format!(
            "mapped memfd (sealed); huge pages: {} hugetlb pages configured, shmem THP '{}'; \
             copies on {} thread(s); declares {:.1} GB/s (0.8 x memcpy on {} thread(s), {:.1} GB/s \
             measured now) and {} us",
            huge,
            memory::shmem_thp(),
            declared.copiers,
            declared.bandwidth_mbps as f64 / 8000.0,
            declared.copiers,
            declared.memcpy_gb_per_s,
            speed::LATENCY_NS / 1000
        );
        report.add_device(&ProbeDevice {
            name: "memfd",
            detail: Some(&detail),
            mem_kinds: sys::FERRY_MEM_HOST,
            bandwidth_mbps: declared.bandwidth_mbps,
            latency_ns: speed::LATENCY_NS,
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
    /// The NUMA node of its memory, when known: copies run near it.
    numa_node: Option<u32>,
    /// Memory the engine allocated: the file peers map (Key::Map).
    file: Option<SharedFile>,
}

/// State shared by the instance and its socket server.
#[derive(Default)]
struct Owned {
    /// Registrations by handle.
    regions: HashMap<u64, Region>,
}

impl Owned {
    /// A duplicate of the file behind `token`, and its size, while its
    /// registration lives.
    fn shared_fd(&self, token: u64) -> Option<(std::os::fd::OwnedFd, u64)> {
        self.regions.values().find_map(|r| match (&r.key, &r.file) {
            (Key::Map { token: t, .. }, Some(f)) if *t == token => {
                Some((f.fd.try_clone().ok()?, f.len))
            }
            _ => None,
        })
    }
}

pub struct ShmInstance {
    host: Host<'static>,
    token: Option<ferry_plugins_abi::sdk::auth::Token>,
    auth_timeout: Duration,
    completer: Completer,
    timeout: Duration,
    nontemporal: NonTemporal,
    pools: pool::Pools,
    endpoint: Endpoint,
    owned: Arc<RwLock<Owned>>,
    next_id: AtomicU64,
    // Last: peers' connections to it close before the state above goes.
    server: Server,
}

impl ShmInstance {
    fn start(host: Host<'static>, params: InitParams, completer: Completer) -> PluginResult<Self> {
        let cma = setting_on(&host, "shm.cma");
        let bad = |e: String| PluginError::new(ErrorCode::InvalidArgument, e);
        let copiers =
            pool::Copiers::parse(host.config("shm.copy_threads").as_deref()).map_err(bad)?;
        let nontemporal =
            NonTemporal::parse(host.config("shm.nontemporal").as_deref()).map_err(bad)?;
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
        let (log_host, count_host) = (host, host);
        let refusals = Arc::new(
            admission::Refusals::new("shm")
                .counted_by(move |r| count_host.count(r.counter(), None, 1)),
        );
        let listener = channel::listen(&name).map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("shm: cannot open its Unix socket: {e}"),
            )
        })?;
        let live_state = owned.clone();
        let live: Arc<channel::Live> = Arc::new(move |id| {
            live_state
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .regions
                .values()
                .any(|r| r.key.id() == id)
        });
        let server = Server::start(
            listener,
            lookup,
            live,
            owner::Admission {
                token: token.clone(),
                auth_timeout: Duration::from_millis(
                    host.setting("auth_timeout_ms", admission::DEFAULT_AUTH_TIMEOUT_MS)?,
                ),
                max_pending: host.setting("auth.max_pending", admission::DEFAULT_MAX_PENDING)?,
                max_pending_per_source: host.setting(
                    "auth.max_pending_per_host",
                    admission::DEFAULT_MAX_PENDING_PER_SOURCE,
                )?,
                allowed_uids: allowed_uids(&host)?,
                refusals,
                log: Arc::new(move |m: &str| log_host.warn(m)),
            },
        )
        .map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("shm: cannot serve its Unix socket: {e}"),
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
        let log = host;
        let pools = pool::Pools::new(copiers, Box::new(move |line: &str| log.info(line)));
        Ok(ShmInstance {
            host,
            token,
            auth_timeout,
            completer,
            timeout,
            nontemporal,
            pools,
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
    /// Mapped allocations, by token: looked up for every request, so by
    /// FxHash (a peer choosing colliding tokens slows only its own lookups).
    mappings: rustc_hash::FxHashMap<u64, Arc<Mapping>>,
    /// Registration ids the peer revoked: never served again.
    revoked: HashSet<u64>,
    /// Cross-memory registrations the peer confirmed live on this
    /// connection: from then on its revocations reach us.
    live: HashSet<u64>,
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
        // Memory the engine allocated comes with its file: peers map it.
        // Anything else (or a file that does not hold the range) is reached
        // by cross-memory attach.
        let shared = region
            .share_fd
            .and_then(|(fd, offset)| match SharedFile::dup(fd) {
                Ok(f)
                    if offset
                        .checked_add(region.len)
                        .is_some_and(|end| end <= f.len) =>
                {
                    Some((f, offset))
                }
                Ok(_) => {
                    self.host.warn(&format!(
                        "shm: the engine's file for [{:#x}, +{}) is shorter than the buffer; \
                         peers reach it by cross-memory attach",
                        region.addr, region.len
                    ));
                    None
                }
                Err(e) => {
                    self.host.warn(&format!(
                        "shm: cannot keep the engine's file for [{:#x}, +{}) ({e}); peers \
                         reach it by cross-memory attach",
                        region.addr, region.len
                    ));
                    None
                }
            });
        let (key, file) = match shared {
            Some((file, offset)) => (
                Key::Map {
                    id,
                    token: random_u64(),
                    base: region.addr,
                    len: region.len,
                    offset,
                },
                Some(file),
            ),
            None => (
                Key::Cma {
                    id,
                    base: region.addr,
                    len: region.len,
                },
                None,
            ),
        };
        self.owned_mut().regions.insert(
            id,
            Region {
                key,
                numa_node: region.numa_node,
                file,
            },
        );
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
        // Requests of a batch mostly name the same buffer: decode a key once
        // per run of requests that repeat it, and map what is not mapped yet
        // before taking the copy lock.
        let mut keys: SmallVec<[Option<Key>; 8]> = SmallVec::with_capacity(requests.len());
        let mut last: Option<(&[u8], Option<Key>)> = None;
        for r in requests {
            let key = match last {
                Some((bytes, key)) if bytes == r.remote_key => key,
                _ => {
                    let key = Key::decode_repeated(r.remote_key);
                    if let Some(k) = &key {
                        peer.ensure_usable(k, self.timeout)?;
                    }
                    last = Some((r.remote_key, key));
                    key
                }
            };
            keys.push(key);
        }
        let mem = peer.state.copying.read().unwrap_or_else(|p| p.into_inner());
        let (mut mapped, mut cma): (SmallVec<[Piece; 8]>, SmallVec<[Piece; 8]>) =
            Default::default();
        let (mut mapped_bytes, mut cma_bytes) = (0u64, 0u64);
        for (i, (r, key)) in requests.iter().zip(&keys).enumerate() {
            let piece = |remote| Piece {
                req: i,
                op: r.op,
                local: r.local_addr,
                remote,
                len: r.length,
            };
            let refused = match key {
                None => Some(PluginError::new(ErrorCode::Protocol, "malformed shm key")),
                Some(k) if mem.revoked.contains(&k.id()) || !within(k, r) => Some(refused_range(r)),
                Some(Key::Map {
                    token,
                    base,
                    offset,
                    ..
                }) => match mapped_address(&mem, r, *token, *base, *offset) {
                    Ok(at) => {
                        mapped.push(piece(at));
                        mapped_bytes += r.length;
                        None
                    }
                    Err(e) => Some(e),
                },
                Some(Key::Cma { .. }) => {
                    cma.push(piece(r.remote_addr));
                    cma_bytes += r.length;
                    None
                }
            };
            if let Some(e) = refused {
                self.completer.complete(r.token, Err(&e));
            }
        }
        // Large submissions are split over the copy threads near the local
        // memory; small ones stay on this thread.
        let pool = (copy::parts_for(mapped_bytes.max(cma_bytes), 2) > 1)
            .then(|| self.pools.near(self.numa_node(requests)))
            .flatten();
        let copiers = pool.as_ref().map_or(1, |p| p.helpers() + 1);
        let mut failed: HashMap<usize, PluginError> = HashMap::new();
        // SAFETY: every mapped piece's remote range was checked inside a
        // mapping that the copy lock (`mem`) keeps mapped until after the
        // copies; every local range lies in a buffer the engine checked is
        // registered here and keeps registered while the request is in flight,
        // or (FERRY_TRANSPORT_LOCAL_UNREGISTERED) in memory the application
        // submitted unregistered, which the engine checked is mapped in this
        // process and whose API requires it to stay valid until completion.
        let finished = unsafe {
            copy::mapped(
                pool.as_deref(),
                &mapped,
                copy::parts_for(mapped_bytes, copiers),
                self.nontemporal,
            )
        };
        if !finished {
            for p in &mapped {
                failed.insert(p.req, incomplete());
            }
        }
        if !cma.is_empty() {
            // SAFETY: the local ranges lie in buffers the engine keeps
            // registered while the requests are in flight (or memory submitted
            // unregistered, valid until completion); the kernel checks the
            // remote ones against the peer's address space.
            let cma_failed = unsafe {
                copy::cma(
                    pool.as_deref(),
                    peer.endpoint.pid,
                    &cma,
                    copy::parts_for(cma_bytes, copiers),
                )
            };
            for (req, why) in cma_failed {
                failed.entry(req).or_insert_with(|| {
                    let r = &requests[req];
                    self.cma_error(peer, r.remote_addr, r.length, why)
                });
            }
        }
        drop(mem);
        for p in mapped.iter().chain(&cma) {
            let r = &requests[p.req];
            self.completer
                .complete(r.token, failed.get(&p.req).map_or(Ok(()), Err));
        }
        Ok(())
    }

    fn submit_blocks(&self, peer: &ShmPeer, list: &BlockList<'_>) -> PluginResult<()> {
        self.submit_list(peer, list)
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

/// Whether the request's remote range lies inside the buffer of its key.
fn within(key: &Key, r: &TransferRequest<'_>) -> bool {
    let (base, len) = key.range();
    r.remote_addr >= base
        && r.remote_addr
            .checked_add(r.length)
            .is_some_and(|end| end <= base + len)
}

/// Where the request's remote range is in our mapping of the peer's file
/// `token` (whose byte `offset` is the peer's address `base`).
fn mapped_address(
    mem: &PeerMemory,
    r: &TransferRequest<'_>,
    token: u64,
    base: u64,
    offset: u64,
) -> PluginResult<u64> {
    let mapping = mem.mappings.get(&token).ok_or_else(|| refused_range(r))?;
    let off = r
        .remote_addr
        .checked_sub(base)
        .and_then(|o| o.checked_add(offset))
        .ok_or_else(|| refused_range(r))?;
    let end = off.checked_add(r.length).ok_or_else(|| refused_range(r))?;
    if end > mapping.len {
        return Err(refused_range(r));
    }
    Ok(mapping.base as u64 + off)
}

fn incomplete() -> PluginError {
    PluginError::new(
        ErrorCode::Internal,
        "shm: a copy thread stopped before finishing its part",
    )
}

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

    /// The NUMA node of the first request's local buffer, when known.
    fn numa_node(&self, requests: &[TransferRequest<'_>]) -> Option<u32> {
        self.numa_node_of(requests.first()?.local_mem)
    }

    /// The NUMA node of the local registration `handle`, when known.
    fn numa_node_of(&self, handle: u64) -> Option<u32> {
        self.owned
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .regions
            .get(&handle)?
            .numa_node
    }

    /// A failed cross-memory copy of the peer's `[remote, +len)`, in words.
    fn cma_error(&self, peer: &ShmPeer, remote: u64, len: u64, why: copy::Failure) -> PluginError {
        match why {
            copy::Failure::Refused(e) if e.raw_os_error() == Some(libc::ESRCH) => peer.gone(),
            copy::Failure::Refused(e) if e.raw_os_error() == Some(libc::EPERM) => PluginError::new(
                ErrorCode::Permission,
                format!("shm: {}", cma::explain_refusal(&e, peer.endpoint.uid)),
            ),
            copy::Failure::Refused(e) => PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "shm: cross-memory copy of [{remote:#x}, +{len}) at {} failed: {e}",
                    peer.name
                ),
            ),
            copy::Failure::Short => PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "shm: [{remote:#x}, +{len}) is not mapped in {} any more",
                    peer.name
                ),
            ),
            copy::Failure::Incomplete => incomplete(),
        }
    }
}
