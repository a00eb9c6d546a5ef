//! A peer of the initiator, as the data path uses it: its endpoint
//! decoded, the NIC pairs (rails) that reach it for a given memory, its
//! buffer keys (decoded once, cached), and its queue pairs, one per NIC
//! pair, created on demand through plugin messaging and cached; with the
//! small state checks of channels and requests. Requests, slices and what
//! happens when one fails are in datapath.rs.

use crate::health::Health;
use crate::rails::{self, Pair};
use crate::state::{Channel, Inner, Peer, Region, RemoteNic, Req};
use crate::verbs::{Link, Qp, QpAddress};
use crate::wire::{self, BufferKey, ConnectReply, Endpoint, Message, QpReply, QpRequest};
use ferry_plugins_abi::sdk::{PeerInfo, PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Keys remembered per peer (decoded once).
const MAX_CACHED_KEYS: usize = 65536;

impl Channel {
    pub(crate) fn usable(&self) -> bool {
        !self.broken.load(Ordering::Acquire)
    }

    pub(crate) fn break_it(&self) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.qp.lock().set_error();
        }
    }
}

impl Req {
    pub(crate) fn failed(&self) -> bool {
        self.error.lock().is_some()
    }
}

impl Peer {
    pub fn new(inner: &Arc<Inner>, info: &PeerInfo) -> PluginResult<Arc<Peer>> {
        let endpoint = Endpoint::decode(&info.endpoint)
            .map_err(|e| PluginError::new(e.code, format!("{}: {}", info.name, e.message)))?;
        let remote: Vec<RemoteNic> = endpoint
            .nics
            .iter()
            .map(|n| RemoteNic {
                name: n.name.clone(),
                link: if n.link == "eth" {
                    Link::Ethernet
                } else {
                    Link::InfiniBand
                },
            })
            .collect();
        if !inner
            .nics
            .iter()
            .any(|l| remote.iter().any(|r| r.link == l.link()))
        {
            return Err(PluginError::new(
                ErrorCode::Unavailable,
                format!(
                    "{}: no NIC here shares a link layer with the peer's ({})",
                    info.name,
                    remote
                        .iter()
                        .map(|r| format!("{} {}", r.name, r.link.as_str()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let n = inner.nics.len();
        let nr = remote.len();
        let peer = Arc::new(Peer {
            name: info.name.clone(),
            remote_health: (0..remote.len()).map(|_| Health::default()).collect(),
            remote,
            channels: Mutex::new(HashMap::new()),
            connect_lock: Mutex::new(()),
            keys: Mutex::new(HashMap::new()),
            sent: (0..n).map(|_| AtomicU64::new(0)).collect(),
            slices: (0..n).map(|_| AtomicU64::new(0)).collect(),
            remote_sent: (0..nr).map(|_| AtomicU64::new(0)).collect(),
            remote_slices: (0..nr).map(|_| AtomicU64::new(0)).collect(),
            retried: AtomicU64::new(0),
            cursor: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        });
        let mut peers = inner.peers.lock();
        peers.retain(|p| p.strong_count() > 0);
        peers.push(Arc::downgrade(&peer));
        Ok(peer)
    }

    pub(crate) fn compatible(&self, inner: &Inner) -> impl Fn(usize, u8) -> bool + '_ {
        let links: Vec<Link> = inner.nics.iter().map(|n| n.link()).collect();
        move |l: usize, r: u8| {
            links
                .get(l)
                .is_some_and(|ll| self.remote.get(r as usize).is_some_and(|rr| rr.link == *ll))
        }
    }

    pub(crate) fn key(&self, bytes: &[u8]) -> PluginResult<Arc<BufferKey>> {
        if let Some(k) = self.keys.lock().get(bytes) {
            return Ok(k.clone());
        }
        let k = Arc::new(
            BufferKey::decode(bytes, self.remote.len())
                .map_err(|e| PluginError::new(e.code, format!("{}: {}", self.name, e.message)))?,
        );
        let mut keys = self.keys.lock();
        if keys.len() >= MAX_CACHED_KEYS {
            keys.clear();
        }
        keys.insert(bytes.to_vec(), k.clone());
        Ok(k)
    }

    /// Whether this peer's buffer with `key` can be reached from here.
    pub fn accepts(&self, inner: &Inner, key: &[u8]) -> PluginResult<()> {
        let k = self.key(key)?;
        let compatible = self.compatible(inner);
        let reachable = k
            .rkeys
            .iter()
            .any(|(r, _)| (0..inner.nics.len()).any(|l| compatible(l, *r)));
        if reachable {
            Ok(())
        } else {
            Err(PluginError::new(
                ErrorCode::Unavailable,
                "none of this engine's NICs shares a link layer with the NICs that registered the \
                 peer's buffer",
            ))
        }
    }

    /// The rails for local memory `region` and the peer's buffer `key`.
    pub(crate) fn rails_for(
        &self,
        inner: &Inner,
        region: &Region,
        key: &BufferKey,
        now: Instant,
    ) -> Vec<Pair> {
        let compatible = self.compatible(inner);
        let remote_all: Vec<u8> = if key.ranked.is_empty() {
            key.rkeys.iter().map(|(n, _)| *n).collect()
        } else {
            key.ranked.clone()
        };
        let (ranked, tiers, best) = if key.ranked.is_empty() {
            (&remote_all[..], &[][..], 0)
        } else {
            (&key.ranked[..], &key.tiers[..], key.best as usize)
        };
        // This side's closest NICs that reach a NIC holding the buffer,
        // then the peer's closest NICs that those reach; paused NICs left
        // out while that leaves any (a failed NIC at one end does not idle
        // its partner at the other, and its slices go to the next closest).
        let pick = |skip_paused: bool| {
            let local_ok = |l: usize| !(skip_paused && inner.nics[l].health.paused(now));
            let remote_ok = |r: u8| {
                !(skip_paused
                    && self
                        .remote_health
                        .get(r as usize)
                        .is_some_and(|h| h.paused(now)))
            };
            let local = rails::first_tier(&region.ranked, &region.tiers, region.best, |l| {
                local_ok(l)
                    && remote_all
                        .iter()
                        .any(|r| remote_ok(*r) && compatible(l, *r))
            });
            let remote = rails::first_tier(ranked, tiers, best, |r| {
                remote_ok(r) && local.iter().any(|l| compatible(*l, r))
            });
            let others: Vec<u8> = remote_all
                .iter()
                .copied()
                .filter(|r| remote_ok(*r))
                .collect();
            rails::rails(&local, &remote, &others, &compatible, inner.settings.rails)
        };
        let healthy = pick(true);
        if healthy.is_empty() {
            pick(false)
        } else {
            healthy
        }
    }

    pub(crate) fn pair_paused(&self, inner: &Inner, p: Pair, now: Instant) -> bool {
        inner.nics[p.0].health.paused(now)
            || self
                .remote_health
                .get(p.1 as usize)
                .is_some_and(|h| h.paused(now))
    }

    pub(crate) fn pair_name(&self, inner: &Inner, p: Pair) -> String {
        format!(
            "{}->{}",
            inner.nics[p.0].name,
            self.remote
                .get(p.1 as usize)
                .map_or("?", |r| r.name.as_str())
        )
    }

    /// Queue pairs for `pairs`, created and connected with one plugin
    /// message for all that are missing. The outer error means the peer's
    /// transport could not be reached at all.
    pub(crate) fn channels(
        &self,
        inner: &Inner,
        pairs: &[Pair],
    ) -> PluginResult<HashMap<Pair, Result<Arc<Channel>, String>>> {
        let mut out = HashMap::new();
        let mut need = Vec::new();
        {
            let chans = self.channels.lock();
            for p in pairs {
                match chans.get(p) {
                    Some(c) if c.usable() => {
                        out.insert(*p, Ok(c.clone()));
                    }
                    _ => {
                        if !need.contains(p) {
                            need.push(*p)
                        }
                    }
                }
            }
        }
        if need.is_empty() {
            return Ok(out);
        }
        let _connecting = self.connect_lock.lock();
        // Another thread may have connected them meanwhile.
        {
            let chans = self.channels.lock();
            need.retain(|p| match chans.get(p) {
                Some(c) if c.usable() => {
                    out.insert(*p, Ok(c.clone()));
                    false
                }
                _ => true,
            });
        }
        for chunk in need.chunks(wire::MAX_QPS_PER_MESSAGE) {
            let mut created = Vec::new();
            let mut asks = Vec::new();
            for p in chunk {
                let nic = &inner.nics[p.0];
                let Some(remote) = self.remote.get(p.1 as usize) else {
                    out.insert(*p, Err("no such NIC at the peer".to_string()));
                    continue;
                };
                match Qp::create(
                    &nic.dev.pd,
                    &nic.dev.cq,
                    &nic.port,
                    inner.settings.queue_depth,
                ) {
                    Ok(qp) => {
                        asks.push(QpRequest {
                            nic: nic.name.clone(),
                            qpn: qp.qpn,
                            lid: nic.lid,
                            gid: wire::gid_hex(&nic.gid),
                            mtu: nic.port.mtu,
                            to: remote.name.clone(),
                        });
                        created.push((*p, qp));
                    }
                    Err(e) => {
                        out.insert(*p, Err(format!("{}: {e}", nic.name)));
                    }
                }
            }
            if asks.is_empty() {
                continue;
            }
            let body = serde_json::to_vec(&Message::Connect {
                engine: inner.engine_id.clone(),
                qps: asks,
            })
            .map_err(|e| {
                PluginError::new(
                    ErrorCode::Internal,
                    format!("encoding a connect message: {e}"),
                )
            })?;
            let reply = inner.host.peer_request(&self.name, &body).map_err(|e| {
                PluginError::new(
                    e.code,
                    format!(
                        "cannot set up RDMA queue pairs with {}: {}",
                        self.name, e.message
                    ),
                )
            })?;
            let reply = ConnectReply::decode(&reply, created.len())
                .map_err(|e| PluginError::new(e.code, format!("{}: {}", self.name, e.message)))?;
            for ((p, mut qp), answer) in created.into_iter().zip(reply.qps) {
                let nic = &inner.nics[p.0];
                let result = match answer {
                    QpReply::Ok { qpn, lid, gid, mtu } => wire::parse_gid(&gid)
                        .map_err(|e| e.message)
                        .and_then(|gid| qp.connect(&nic.port, &QpAddress { qpn, lid, gid, mtu })),
                    QpReply::Err { message } => Err(format!("the peer refused: {message}")),
                };
                match result {
                    Ok(()) => {
                        let ch = Arc::new(Channel {
                            qp: Mutex::new(qp),
                            outstanding: AtomicUsize::new(0),
                            broken: AtomicBool::new(false),
                            depth: inner.settings.queue_depth as usize,
                        });
                        inner.host.debug(&format!(
                            "rdma: queue pair {} connected to {} ({})",
                            self.pair_name(inner, p),
                            self.name,
                            ch.qp.lock().qpn
                        ));
                        self.channels.lock().insert(p, ch.clone());
                        out.insert(p, Ok(ch));
                    }
                    Err(e) => {
                        out.insert(p, Err(e));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Fails what is in flight to this peer (its queue pairs go to ERR and
    /// flush) and refuses new requests.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let chans: Vec<Arc<Channel>> = self.channels.lock().drain().map(|(_, c)| c).collect();
        for c in chans {
            c.break_it();
        }
    }

    pub fn describe(&self, inner: &Inner) -> String {
        let now = Instant::now();
        let mut parts = vec![format!(
            "rdma to {}: {} queue pairs",
            self.name,
            self.channels.lock().len()
        )];
        let sent: Vec<String> = inner
            .nics
            .iter()
            .enumerate()
            .filter(|(i, _)| self.slices[*i].load(Ordering::Relaxed) > 0)
            .map(|(i, n)| {
                format!(
                    "{} {} B in {} slices",
                    n.name,
                    self.sent[i].load(Ordering::Relaxed),
                    self.slices[i].load(Ordering::Relaxed)
                )
            })
            .collect();
        parts.push(format!(
            "sent through {}",
            if sent.is_empty() {
                "no NIC yet".to_string()
            } else {
                sent.join(", ")
            }
        ));
        let at_peer: Vec<String> = self
            .remote
            .iter()
            .enumerate()
            .filter(|(i, _)| self.remote_slices[*i].load(Ordering::Relaxed) > 0)
            .map(|(i, n)| {
                format!(
                    "{} {} B in {} slices",
                    n.name,
                    self.remote_sent[i].load(Ordering::Relaxed),
                    self.remote_slices[i].load(Ordering::Relaxed)
                )
            })
            .collect();
        if !at_peer.is_empty() {
            parts.push(format!("at the peer: {}", at_peer.join(", ")));
        }
        let retried = self.retried.load(Ordering::Relaxed);
        if retried > 0 {
            parts.push(format!("{retried} slices retried on another NIC pair"));
        }
        for n in &inner.nics {
            if let Some(d) = n.health.describe(now) {
                parts.push(format!("{} {d}", n.name));
            }
        }
        for (i, h) in self.remote_health.iter().enumerate() {
            if let Some(d) = h.describe(now) {
                parts.push(format!("peer's {} {d}", self.remote[i].name));
            }
        }
        parts.join("; ")
    }
}
