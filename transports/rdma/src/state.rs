//! The state of one rdma instance, shared by its control side (instance.rs:
//! NICs, memory registration, queue pairs peers ask for) and its data path
//! (datapath.rs: peers, slices, completions): the types both name, one
//! floor below both.

use crate::health::Health;
use crate::rails::Pair;
use crate::verbs::{Device, Link, Mr, PortInfo, Qp, RdmaOp};
use crate::wire::{BufferKey, Endpoint};
use ferry_plugins_abi::sdk::{Completer, Host, PluginError};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Defaults of the settings (key -> FERRY_ variable).
pub const DEFAULT_SLICE_BYTES: u64 = 1 << 20;
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;
pub const DEFAULT_PAUSE_MS: u64 = 1000;
/// Failures in a row that pause a peer's NIC / one of ours.
pub const REMOTE_PAUSE_AFTER: u32 = 3;
pub const LOCAL_PAUSE_AFTER: u32 = 6;

/// The plugin's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// rdma.slice_bytes: requests are cut into slices of this size.
    pub slice_bytes: u64,
    /// rdma.rails: NIC pairs per request (0: all equally close NICs).
    pub rails: usize,
    /// rdma.gid_index: the GID index on RoCE ports (None: chosen).
    pub gid_index: Option<u8>,
    /// rdma.queue_depth: work requests in flight per queue pair.
    pub queue_depth: u32,
    /// rdma.pause_ms: first pause of a failing NIC (doubles, up to 60 s).
    pub pause: Duration,
    pub timeout: Duration,
}

/// One NIC this instance uses.
pub struct Nic {
    pub name: String,
    pub dev: Device,
    pub port: PortInfo,
    pub lid: u16,
    pub gid: [u8; 16],
    pub dmabuf: Result<(), String>,
    pub health: Health,
    /// Work requests posted on this NIC and not yet completed.
    pub outstanding: AtomicUsize,
    /// Slices waiting for room on this NIC (its CQ or a queue pair).
    pub backlog: Mutex<VecDeque<Slice>>,
    pub cq_budget: usize,
}

impl Nic {
    pub fn link(&self) -> Link {
        self.port.link
    }
}

/// Memory registered with this instance.
pub struct Region {
    pub addr: u64,
    pub len: u64,
    pub location: String,
    /// By local NIC index.
    pub mrs: Vec<Option<Mr>>,
    /// Local NICs that registered it, closest first; the first `best` are
    /// equally close (the rails).
    pub ranked: Vec<usize>,
    pub best: usize,
    /// Per entry of `ranked`: equally close NICs share a tier (0 first).
    pub tiers: Vec<u8>,
}

impl Region {
    pub fn lkey(&self, nic: usize) -> Option<u32> {
        self.mrs.get(nic).and_then(|m| m.as_ref()).map(Mr::lkey)
    }

    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A queue pair a peer asked us to create: we are its target.
pub(crate) struct Responder {
    pub(crate) seq: u64,
    pub(crate) _qp: Qp,
}

#[derive(Default)]
pub(crate) struct Responders {
    pub(crate) by_key: HashMap<(String, String, usize), Responder>,
    pub(crate) order: BTreeMap<u64, (String, String, usize)>,
    pub(crate) next: u64,
}

pub struct Inner {
    pub host: Host<'static>,
    pub completer: Completer,
    pub settings: Settings,
    pub engine_name: String,
    pub engine_id: String,
    pub nics: Vec<Nic>,
    pub endpoint: Endpoint,
    pub(crate) regions: RwLock<HashMap<u64, Arc<Region>>>,
    pub(crate) next_handle: AtomicU64,
    /// Posted slices by work request id.
    pub inflight: Mutex<HashMap<u64, Slice>>,
    pub next_wr: AtomicU64,
    /// Slices to move to another NIC pair (done by the poller thread,
    /// which may have to connect).
    pub retries: Mutex<VecDeque<Slice>>,
    pub peers: Mutex<Vec<Weak<Peer>>>,
    pub(crate) responders: Mutex<Responders>,
    pub(crate) logged: Mutex<HashSet<String>>,
    pub(crate) wake: (Mutex<bool>, Condvar),
    pub(crate) stop: AtomicBool,
    pub(crate) poller: Mutex<Option<JoinHandle<()>>>,
    /// Requests completed since progress() last looked.
    pub completed: AtomicUsize,
}

/// A NIC of the peer, from its endpoint.
pub(crate) struct RemoteNic {
    pub(crate) name: String,
    pub(crate) link: Link,
}

/// One RC queue pair to the peer, between two of the NICs.
pub struct Channel {
    pub(crate) qp: Mutex<Qp>,
    pub(crate) outstanding: AtomicUsize,
    pub(crate) broken: AtomicBool,
    pub(crate) depth: usize,
}

/// A peer this instance sends to.
pub struct Peer {
    pub name: String,
    pub(crate) remote: Vec<RemoteNic>,
    pub(crate) channels: Mutex<HashMap<Pair, Arc<Channel>>>,
    pub(crate) connect_lock: Mutex<()>,
    pub(crate) keys: Mutex<HashMap<Vec<u8>, Arc<BufferKey>>>,
    pub(crate) remote_health: Vec<Health>,
    /// Bytes and slices completed per local NIC, and per NIC of the peer.
    pub(crate) sent: Vec<AtomicU64>,
    pub(crate) slices: Vec<AtomicU64>,
    pub(crate) remote_sent: Vec<AtomicU64>,
    pub(crate) remote_slices: Vec<AtomicU64>,
    pub(crate) retried: AtomicU64,
    pub(crate) cursor: AtomicUsize,
    pub(crate) closed: AtomicBool,
}

/// One request as the engine gave it.
pub struct Req {
    pub(crate) token: u64,
    pub(crate) remaining: AtomicUsize,
    pub(crate) error: Mutex<Option<PluginError>>,
}

/// A piece of a request on one NIC pair: one work request.
pub struct Slice {
    pub(crate) req: Arc<Req>,
    pub(crate) peer: Arc<Peer>,
    pub(crate) op: RdmaOp,
    pub(crate) local: Arc<Region>,
    pub(crate) local_addr: u64,
    pub(crate) key: Arc<BufferKey>,
    pub(crate) remote_addr: u64,
    pub(crate) len: u32,
    pub(crate) rails: Arc<Vec<Pair>>,
    pub(crate) pair: Pair,
    pub(crate) tried: Vec<Pair>,
    pub(crate) channel: Option<Arc<Channel>>,
    pub(crate) posted: Option<Instant>,
    pub(crate) last_error: Option<String>,
}

impl Inner {
    /// Logs `msg` at info the first time `key` is seen.
    pub fn info_once(&self, key: String, msg: impl FnOnce() -> String) {
        if self.logged.lock().insert(key) {
            self.host.info(&msg());
        }
    }

    pub fn wake_poller(&self) {
        let (lock, cv) = &self.wake;
        *lock.lock() = true;
        cv.notify_one();
    }

    pub fn region(&self, handle: u64) -> Option<Arc<Region>> {
        self.regions.read().get(&handle).cloned()
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}
