//! One engine's RDMA instance: its NICs, its registered memory, the queue
//! pairs peers asked it to create (it is their target), the settings, and
//! the thread that polls completion queues.

use crate::datapath;
use crate::health::Health;
use crate::state::{
    Inner, Nic, Peer, Region, Responder, Responders, Settings, DEFAULT_PAUSE_MS,
    DEFAULT_QUEUE_DEPTH, DEFAULT_SLICE_BYTES,
};
use crate::verbs::{self, Device, Link, Mr, PortInfo, Qp, QpAddress};
use crate::wire::{self, BufferKey, ConnectReply, Endpoint, EndpointNic, Message, QpReply};
use ferry_plugins_abi::sdk::{
    Completer, Host, InitParams, MemRegion, PluginError, PluginResult, Registration,
};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Work completions one CQ holds (the sum of all its QPs' outstanding WRs
/// stays below this).
const CQ_ENTRIES: u32 = 4096;
/// Queue pairs peers may have this instance create; the oldest goes first.
const MAX_RESPONDERS: usize = 4096;
impl Settings {
    pub fn from_host(host: &Host<'_>) -> PluginResult<Settings> {
        let slice_bytes: u64 = host.setting("rdma.slice_bytes", DEFAULT_SLICE_BYTES)?;
        if !(4096..=1 << 30).contains(&slice_bytes) {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!("rdma.slice_bytes = {slice_bytes}: use 4096 to 1073741824"),
            ));
        }
        let rails: usize = host.setting("rdma.rails", 0)?;
        if rails > 64 {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!("rdma.rails = {rails}: use 0 (all equally close NICs) to 64"),
            ));
        }
        let gid_index = match host
            .config("rdma.gid_index")
            .filter(|v| !v.trim().is_empty())
        {
            None => None,
            Some(v) => Some(v.trim().parse::<u8>().map_err(|_| {
                PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!("rdma.gid_index = {v:?}: use a GID table index, 0 to 255"),
                )
            })?),
        };
        let queue_depth: u32 = host.setting("rdma.queue_depth", DEFAULT_QUEUE_DEPTH)?;
        if !(1..=4096).contains(&queue_depth) {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!("rdma.queue_depth = {queue_depth}: use 1 to 4096"),
            ));
        }
        Ok(Settings {
            slice_bytes,
            rails,
            gid_index,
            queue_depth,
            pause: Duration::from_millis(host.setting("rdma.pause_ms", DEFAULT_PAUSE_MS)?.max(1)),
            timeout: Duration::from_millis(host.setting("timeout_ms", 15_000u64)?.max(1)),
        })
    }
}

fn random_id() -> String {
    let mut buf = [0u8; 8];
    // SAFETY: buf is writable for its length; getrandom writes at most that.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        buf = (t ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// The GID index to use on a port: the setting, else on RoCE the first
/// RoCE v2 GID holding an IPv4 address, else RoCE v2 IPv6 (not link-local),
/// else any RoCE v2, else the first GID.
fn choose_gid(
    port: &verbs::PortFacts,
    forced: Option<u8>,
) -> Result<(u8, [u8; 16], String), String> {
    if let Some(i) = forced {
        return port
            .gids
            .iter()
            .find(|(idx, _, _)| *idx == i)
            .map(|(idx, g, _)| (*idx, g.raw, "FERRY_RDMA_GID_INDEX".to_string()))
            .ok_or_else(|| {
                format!(
                    "FERRY_RDMA_GID_INDEX={i}: port {} has no GID there",
                    port.num
                )
            });
    }
    let v4 = |g: &[u8; 16]| g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff;
    let link_local = |g: &[u8; 16]| g[0] == 0xfe && g[1] & 0xc0 == 0x80;
    if port.link == Link::Ethernet {
        let pick = |f: &dyn Fn(&(u8, sideway::ibverbs::address::Gid, bool)) -> bool, why: &str| {
            port.gids
                .iter()
                .find(|e| f(e))
                .map(|(i, g, _)| (*i, g.raw, why.to_string()))
        };
        if let Some(x) = pick(&|(_, g, v2)| *v2 && v4(&g.raw), "RoCE v2, IPv4")
            .or_else(|| pick(&|(_, g, v2)| *v2 && !link_local(&g.raw), "RoCE v2, IPv6"))
            .or_else(|| pick(&|(_, _, v2)| *v2, "RoCE v2"))
        {
            return Ok(x);
        }
    }
    port.gids
        .first()
        .map(|(i, g, _)| (*i, g.raw, "the first GID".to_string()))
        .ok_or_else(|| format!("port {} has no GID", port.num))
}

impl Inner {
    pub fn start(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<Arc<Inner>> {
        let settings = Settings::from_host(&host)?;
        let names = verbs::device_names()
            .map_err(|e| PluginError::unavailable(verbs::no_device_reason(&e)))?;
        // The engine's topology (FERRY_NICS, a topology file) decides which
        // NICs exist; with no RDMA NIC in it, every verbs device counts.
        let topo: Vec<String> = host
            .nics(None)
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.kind == sys::FERRY_NIC_KIND_RDMA)
            .map(|n| n.name)
            .collect();
        let mut nics = Vec::new();
        let mut skipped = Vec::new();
        for name in names {
            if nics.len() >= wire::MAX_NICS {
                skipped.push(format!("{name} (more than {} NICs)", wire::MAX_NICS));
                continue;
            }
            if !topo.is_empty() && !topo.contains(&name) {
                skipped.push(format!(
                    "{name} (not in the topology: FERRY_NICS or a topology file removed it)"
                ));
                continue;
            }
            match open_nic(&name, &settings) {
                Ok(n) => nics.push(n),
                Err(why) => skipped.push(format!("{name} ({why})")),
            }
        }
        if nics.is_empty() {
            return Err(PluginError::unavailable(format!(
                "no usable RDMA NIC: {}",
                skipped.join("; ")
            )));
        }
        let endpoint = Endpoint {
            v: 1,
            engine: random_id(),
            nics: nics
                .iter()
                .map(|n| EndpointNic {
                    name: n.name.clone(),
                    port: n.port.port,
                    lid: n.lid,
                    gid: wire::gid_hex(&n.gid),
                    link: match n.link() {
                        Link::InfiniBand => "ib".into(),
                        Link::Ethernet => "eth".into(),
                    },
                    mtu: n.port.mtu,
                })
                .collect(),
        };
        host.info(&format!(
            "rdma: engine {} uses {}{}",
            params.engine_name,
            nics.iter()
                .map(|n| format!(
                    "{} ({} port {}, {}GID {}, DMA-BUF {})",
                    n.name,
                    n.link().as_str(),
                    n.port.port,
                    if n.link() == Link::InfiniBand {
                        format!("LID {:#x}, ", n.lid)
                    } else {
                        String::new()
                    },
                    n.port.gid_index,
                    if n.dmabuf.is_ok() { "yes" } else { "no" }
                ))
                .collect::<Vec<_>>()
                .join(", "),
            if skipped.is_empty() {
                String::new()
            } else {
                format!("; not using {}", skipped.join(", "))
            }
        ));
        let inner = Arc::new(Inner {
            engine_id: endpoint.engine.clone(),
            engine_name: params.engine_name,
            host,
            completer,
            settings,
            nics,
            endpoint,
            regions: RwLock::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            inflight: Mutex::new(HashMap::new()),
            next_wr: AtomicU64::new(1),
            retries: Mutex::new(VecDeque::new()),
            peers: Mutex::new(Vec::new()),
            responders: Mutex::new(Responders::default()),
            logged: Mutex::new(HashSet::new()),
            wake: (Mutex::new(false), Condvar::new()),
            stop: AtomicBool::new(false),
            poller: Mutex::new(None),
            completed: AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name("ferry-rdma-poll".into())
            .spawn(move || {
                // Nothing in the loop should panic; if something does, the
                // thread ends quietly and waiting threads' progress() still
                // polls.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll_loop(weak)));
            })
            .map_err(|e| {
                PluginError::new(
                    ErrorCode::NoMemory,
                    format!("cannot start the rdma poller thread: {e}"),
                )
            })?;
        *inner.poller.lock() = Some(handle);
        Ok(inner)
    }

    // ---- memory ------------------------------------------------------

    pub fn register(&self, r: &MemRegion) -> PluginResult<Registration> {
        if r.len == 0 || r.addr.checked_add(r.len).is_none() {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                "empty or wrapping range",
            ));
        }
        let remote = !r.local_only;
        let method = match r.mem_kind {
            sys::FERRY_MEM_HOST => "host memory",
            sys::FERRY_MEM_CUDA_DMABUF => "DMA-BUF",
            sys::FERRY_MEM_CUDA_PEERMEM => "nvidia-peermem",
            _ => {
                return Err(PluginError::new(
                    ErrorCode::Unsupported,
                    "rdma registers host memory, or device memory by DMA-BUF or nvidia-peermem",
                ))
            }
        };
        if r.mem_kind == sys::FERRY_MEM_CUDA_DMABUF && r.dmabuf_fd.is_none() {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                "DMA-BUF registration without an fd",
            ));
        }
        let mut mrs: Vec<Option<Mr>> = Vec::with_capacity(self.nics.len());
        let mut refusals = Vec::new();
        for nic in &self.nics {
            let got = match (r.mem_kind, r.dmabuf_fd) {
                (sys::FERRY_MEM_CUDA_DMABUF, Some(fd)) => {
                    if let Err(why) = &nic.dmabuf {
                        refusals.push(format!("{}: {why}", nic.name));
                        mrs.push(None);
                        continue;
                    }
                    // SAFETY: the engine passes a DMA-BUF of the device
                    // memory [addr, +len) that stays allocated until it
                    // unregisters the buffer (plugin.h), which drops the MR.
                    unsafe {
                        verbs::reg_dmabuf_mr(
                            &nic.dev.pd,
                            r.dmabuf_offset,
                            r.len,
                            r.addr,
                            fd,
                            remote,
                        )
                    }
                }
                // SAFETY: the engine guarantees [addr, +len) stays mapped
                // until it unregisters the buffer, which drops the MR.
                _ => unsafe { verbs::reg_mr(&nic.dev.pd, r.addr, r.len, remote) },
            };
            match got {
                Ok(mr) => mrs.push(Some(mr)),
                Err(e) => {
                    let hint = match (r.mem_kind, e.raw_os_error()) {
                        (sys::FERRY_MEM_CUDA_PEERMEM, Some(libc::EFAULT)) => {
                            " (the NIC could not map GPU memory: is nvidia-peermem loaded?)"
                        }
                        (sys::FERRY_MEM_CUDA_DMABUF, Some(libc::EOPNOTSUPP)) => {
                            " (the NIC or its driver does not take DMA-BUF)"
                        }
                        (sys::FERRY_MEM_HOST, Some(libc::ENOMEM)) => {
                            " (locked-memory limit? raise `ulimit -l`)"
                        }
                        _ => "",
                    };
                    refusals.push(format!("{}: {e}{hint}", nic.name));
                    mrs.push(None);
                }
            }
        }
        if mrs.iter().all(Option::is_none) {
            let code = if r.mem_kind == sys::FERRY_MEM_HOST {
                ErrorCode::Io
            } else {
                ErrorCode::Unavailable
            };
            return Err(PluginError::new(
                code,
                format!(
                    "registering {} at {:#x} (+{}) by {method} failed on every NIC: {}",
                    r.location,
                    r.addr,
                    r.len,
                    refusals.join("; ")
                ),
            ));
        }
        if !refusals.is_empty() {
            self.info_once(format!("refused:{}:{method}", r.location), || {
                format!(
                    "rdma: {} memory registered by {method} on some NICs only; not on {}",
                    r.location,
                    refusals.join("; ")
                )
            });
        }
        let (ranked, best, tiers, classes) = self.rank_for(&r.location, &mrs);
        let region = Arc::new(Region {
            addr: r.addr,
            len: r.len,
            location: r.location.clone(),
            mrs,
            ranked,
            best,
            tiers,
        });
        self.info_once(format!("rails:{}:{method}", r.location), || {
            let rails: Vec<&str> = region.ranked[..region.best]
                .iter()
                .map(|i| self.nics[*i].name.as_str())
                .collect();
            format!(
                "rdma: {} memory ({method}) goes through {} ({}){}",
                r.location,
                rails.join(", "),
                classes,
                if region.ranked.len() > region.best {
                    format!(
                        "; if those fail: {}",
                        region.ranked[region.best..]
                            .iter()
                            .map(|i| self.nics[*i].name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                } else {
                    String::new()
                }
            )
        });
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let key = if remote {
            BufferKey {
                addr: r.addr,
                len: r.len,
                rkeys: region
                    .mrs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, m)| Some((i as u8, m.as_ref()?.rkey())))
                    .collect(),
                ranked: region.ranked.iter().map(|i| *i as u8).collect(),
                best: region.best as u8,
                tiers: region.tiers.clone(),
            }
            .encode()
        } else {
            // Local-only memory has no remote rights and no key.
            Vec::new()
        };
        self.regions.write().insert(handle, region);
        Ok(Registration { handle, key })
    }

    /// Local NICs for memory at `location`, closest first (those that
    /// registered it), how many are equally close, each one's tier (equally
    /// close NICs share one), and the path classes in words.
    fn rank_for(&self, location: &str, mrs: &[Option<Mr>]) -> (Vec<usize>, usize, Vec<u8>, String) {
        let registered = |i: &usize| mrs.get(*i).is_some_and(Option::is_some);
        let topo = self.host.nics(Some(location)).unwrap_or_default();
        let mut ranked: Vec<(usize, u32, u64)> = Vec::new();
        for t in &topo {
            if let Some(i) = self.nics.iter().position(|n| n.name == t.name) {
                if registered(&i) && !ranked.iter().any(|(x, _, _)| *x == i) {
                    let active = t.port_state != sys::FERRY_PORT_DOWN;
                    // Down ports rank last whatever their class.
                    let class = if active { t.path_class } else { u32::MAX };
                    ranked.push((i, class, t.speed_mbps));
                }
            }
        }
        let known = !ranked.is_empty();
        for i in 0..self.nics.len() {
            if registered(&i) && !ranked.iter().any(|(x, _, _)| *x == i) {
                ranked.push((i, u32::MAX - 1, 0));
            }
        }
        let best = match ranked.first() {
            Some(&(_, c, s)) => ranked
                .iter()
                .take_while(|(_, c2, s2)| *c2 == c && *s2 == s)
                .count(),
            None => 0,
        };
        let classes = if known {
            let name = |c: u32| match c {
                sys::FERRY_PATH_PIX => "PIX",
                sys::FERRY_PATH_PXB => "PXB",
                sys::FERRY_PATH_PHB => "PHB",
                sys::FERRY_PATH_NODE => "NODE",
                sys::FERRY_PATH_SYS => "SYS",
                _ => "?",
            };
            format!(
                "{} from {location}: the closest RDMA NICs by the topology",
                name(ranked[0].1)
            )
        } else {
            format!("the topology does not place {location}: every NIC, in discovery order")
        };
        let mut tiers = Vec::with_capacity(ranked.len());
        for (k, (_, c, s)) in ranked.iter().enumerate() {
            let tier = match k.checked_sub(1).map(|p| &ranked[p]) {
                None => 0,
                Some((_, pc, ps)) if pc == c && ps == s => tiers[k - 1],
                Some(_) => tiers[k - 1] + 1u8,
            };
            tiers.push(tier);
        }
        (
            ranked.into_iter().map(|(i, _, _)| i).collect(),
            best.max(1),
            tiers,
            classes,
        )
    }

    pub fn unregister(&self, handle: u64) -> PluginResult<()> {
        match self.regions.write().remove(&handle) {
            // Dropping the region deregisters its MRs (once no slice holds
            // it: the engine unregisters only when none is in flight).
            Some(_) => Ok(()),
            None => Err(PluginError::new(
                ErrorCode::NotFound,
                format!("no rdma registration {handle}"),
            )),
        }
    }

    // ---- target side: queue pairs peers ask for -----------------------

    pub fn on_peer_request(&self, from: &str, body: &[u8]) -> PluginResult<Vec<u8>> {
        let Message::Connect { engine, qps } = Message::decode(body)?;
        let mut replies = Vec::with_capacity(qps.len());
        for q in &qps {
            let reply = match self.respond(&engine, q) {
                Ok(addr) => QpReply::Ok {
                    qpn: addr.qpn,
                    lid: addr.lid,
                    gid: wire::gid_hex(&addr.gid),
                    mtu: addr.mtu,
                },
                Err(e) => {
                    self.host.debug(&format!(
                        "rdma: refused a queue pair for {from} ({} -> {}): {}",
                        q.nic, q.to, e.message
                    ));
                    QpReply::Err { message: e.message }
                }
            };
            replies.push(reply);
        }
        serde_json::to_vec(&ConnectReply { qps: replies })
            .map_err(|e| PluginError::new(ErrorCode::Internal, format!("encoding the reply: {e}")))
    }

    /// Creates and connects the target's end of one queue pair.
    fn respond(&self, engine: &str, q: &wire::QpRequest) -> PluginResult<QpAddress> {
        let (i, nic) = self
            .nics
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == q.to)
            .ok_or_else(|| {
                PluginError::new(
                    ErrorCode::NotFound,
                    format!("this engine has no RDMA NIC {}", q.to),
                )
            })?;
        let remote = QpAddress {
            qpn: q.qpn,
            lid: q.lid,
            gid: wire::parse_gid(&q.gid)?,
            mtu: q.mtu,
        };
        let mut qp = Qp::create(&nic.dev.pd, &nic.dev.cq, &nic.port, 1)
            .map_err(|e| PluginError::new(ErrorCode::NoMemory, format!("{}: {e}", nic.name)))?;
        qp.connect(&nic.port, &remote)
            .map_err(|e| PluginError::new(ErrorCode::Connection, format!("{}: {e}", nic.name)))?;
        let mine = QpAddress {
            qpn: qp.qpn,
            lid: nic.lid,
            gid: nic.gid,
            mtu: nic.port.mtu.min(q.mtu),
        };
        let key = (engine.to_string(), q.nic.clone(), i);
        let mut r = self.responders.lock();
        // A new queue pair for the same NIC pair replaces the old one: the
        // initiator only reconnects when its end broke.
        if let Some(old) = r.by_key.remove(&key) {
            r.order.remove(&old.seq);
        }
        while r.by_key.len() >= MAX_RESPONDERS {
            let Some((_, oldest)) = r.order.pop_first() else {
                break;
            };
            r.by_key.remove(&oldest);
        }
        let seq = r.next;
        r.next += 1;
        r.order.insert(seq, key.clone());
        r.by_key.insert(key, Responder { seq, _qp: qp });
        Ok(mine)
    }

    // ---- data path -----------------------------------------------------

    pub fn submit(
        self: &Arc<Self>,
        peer: &Arc<Peer>,
        requests: &[ferry_plugins_abi::sdk::TransferRequest<'_>],
    ) -> PluginResult<()> {
        datapath::submit(self, peer, requests)
    }

    /// Completes what has arrived, on the calling thread.
    pub fn progress(&self) -> usize {
        let mut wcs = Vec::new();
        for (i, nic) in self.nics.iter().enumerate() {
            wcs.clear();
            if nic.dev.cq.poll(&mut wcs, 256, false) > 0 {
                for wc in &wcs {
                    datapath::on_completion(self, i, *wc);
                }
                datapath::drain_backlog(self, i);
            }
        }
        if !self.retries.lock().is_empty() {
            self.wake_poller();
        }
        self.completed.swap(0, Ordering::Relaxed)
    }

    /// Stops the poller, fails whatever is still in flight, and lets the
    /// queue pairs go (fini).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake_poller();
        if let Some(t) = self.poller.lock().take() {
            let _ = t.join();
        }
        datapath::fail_everything(self, "the rdma transport is shutting down");
        self.responders.lock().by_key.clear();
    }
}

fn open_nic(name: &str, settings: &Settings) -> Result<Nic, String> {
    let (dev, facts) = Device::open(name, CQ_ENTRIES)?;
    let port = facts.ports.iter().find(|p| p.active).ok_or_else(|| {
        format!(
            "no active port: {}",
            facts
                .ports
                .iter()
                .map(|p| format!("port {} {}", p.num, verbs::port_state_name(p.state)))
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let (gid_index, gid, _why) = choose_gid(port, settings.gid_index)?;
    let dmabuf = verbs::dmabuf_probe(&dev.pd);
    let cq_budget = dev.cq.capacity.saturating_sub(1).max(1) as usize;
    Ok(Nic {
        name: name.to_string(),
        port: PortInfo {
            port: port.num,
            link: port.link,
            gid_index,
            mtu: port.active_mtu.clamp(1, 5),
            max_rd_atomic: facts.max_rd_atomic,
        },
        lid: port.lid,
        gid,
        dmabuf,
        health: Health::default(),
        outstanding: AtomicUsize::new(0),
        backlog: Mutex::new(VecDeque::new()),
        cq_budget,
        dev,
    })
}

/// The poller thread: polls every CQ, moves failed slices to other NIC
/// pairs, posts what waited for room, and fails slices past the timeout.
/// It sleeps when nothing is in flight.
fn poll_loop(weak: Weak<Inner>) {
    let mut idle_rounds: u32 = 0;
    let mut last_scan = Instant::now();
    let mut wcs = Vec::new();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stopping() {
            return;
        }
        let mut work = 0usize;
        for (i, nic) in inner.nics.iter().enumerate() {
            wcs.clear();
            let n = nic.dev.cq.poll(&mut wcs, 256, false);
            for wc in &wcs {
                datapath::on_completion(&inner, i, *wc);
            }
            work += n;
            work += datapath::drain_backlog(&inner, i);
        }
        work += datapath::run_retries(&inner);
        if last_scan.elapsed() >= Duration::from_millis(50) {
            datapath::check_timeouts(&inner);
            last_scan = Instant::now();
        }
        let busy = !inner.inflight.lock().is_empty()
            || inner.nics.iter().any(|n| !n.backlog.lock().is_empty());
        if work > 0 {
            idle_rounds = 0;
            continue;
        }
        idle_rounds = idle_rounds.saturating_add(1);
        let (lock, cv) = &inner.wake;
        let mut woken = lock.lock();
        if !*woken {
            let wait = if busy {
                // Completions are coming: poll again soon, backing off to 1 ms.
                Duration::from_micros((10u64 << idle_rounds.min(7)).min(1000))
            } else {
                Duration::from_millis(100)
            };
            cv.wait_for(&mut woken, wait);
        }
        *woken = false;
        drop(woken);
        drop(inner);
    }
}
