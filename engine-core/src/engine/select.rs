//! Selection: the engine's transports, and which of them carries a request
//! and why. A function of plain data (what each transport declares about
//! its devices, the local buffer, the peer's view, what the engine
//! measured) and of one question only a live peer can answer (does its
//! plugin accept this buffer), passed in; so it is tested with fake
//! transports and no sockets.
//!
//! Every transport that can serve a request gets an estimate of the time
//! it would take (`cost`), corrected where measurement contradicts what
//! its plugin declared (`measure`); the smallest wins, ties going to the
//! transport loaded first. Hysteresis keeps a route until another is
//! clearly better, and a transport close to the best that has not been
//! measured yet is tried on a few large hand-overs, so that measurement
//! can correct declarations. No transport's name decides anything here.

use super::cost::{self, Estimate, Figures, Link};
use super::measure::{Measured, Meter, BANDWIDTH_MIN_BYTES, MIN_SAMPLES};
use super::request::{Scope, SegmentId};
use super::segments::{RemoteSegment, RemoteView};
use crate::error::{Error, Result};
use crate::id_map::{IdMap, IdSet};
use crate::memory::{LocalBuffer, Visibility};
use crate::transport::Transport;
use ferry_loader::DeviceReport;
use ferry_plugins_abi::sys;
use ferry_topology::Topology;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::ops::Deref;
use std::sync::Arc;

/// A measurement this far (as a factor) from the figure used so far
/// replaces it.
const CONTRADICTION: f64 = 1.10;
/// The route in use is kept until another is estimated faster by this factor.
const SWITCH: f64 = 1.10;
/// Transports estimated within this factor of the best are measured.
const EXPLORE: f64 = 4.0;
/// Hand-overs given to a transport being measured before giving up on it.
const EXPLORE_TRIES: u32 = 3 * MIN_SAMPLES;

/// What selection reads of a transport.
pub(crate) trait Candidate {
    fn name(&self) -> &str;
    /// The `FERRY_MEM_*` bits it moves.
    fn mem_kinds(&self) -> u64;
    /// The `FERRY_SCOPE_*` bits it reaches.
    fn scopes(&self) -> u32;
    /// The devices its plugin reported, with what it declared of them.
    fn devices(&self) -> &[DeviceReport];
}

impl Candidate for Transport {
    fn name(&self) -> &str {
        &self.name
    }
    fn mem_kinds(&self) -> u64 {
        self.mem_kinds
    }
    fn scopes(&self) -> u32 {
        self.scopes
    }
    fn devices(&self) -> &[DeviceReport] {
        &self.devices
    }
}

impl<T: Candidate> Candidate for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn mem_kinds(&self) -> u64 {
        (**self).mem_kinds()
    }
    fn scopes(&self) -> u32 {
        (**self).scopes()
    }
    fn devices(&self) -> &[DeviceReport] {
        (**self).devices()
    }
}

/// Which routes share a decision: one peer, one kind of local memory,
/// small or large hand-overs (latency or bandwidth decides).
type RouteKey = (SegmentId, u64, bool);

/// The transports an engine started, in load order (an index into this
/// list names a transport everywhere in the engine), with what start-up
/// said about them.
pub(crate) struct Transports<T> {
    list: Vec<T>,
    /// Each transport's devices, placed in the topology.
    links: Vec<Vec<Link>>,
    /// Enabled transports that failed to start, with the error.
    pub(crate) failures: Vec<(String, Error)>,
    /// Each started transport's endpoint, as the descriptor announces it.
    pub(crate) endpoints: Vec<(String, Vec<u8>)>,
    /// What completions showed, per (segment, transport).
    pub(crate) meter: Arc<Meter>,
    /// (segment, transport) pairs whose route was logged.
    logged: Mutex<IdSet<(SegmentId, usize)>>,
    /// The transport each route uses now (for hysteresis).
    current: Mutex<IdMap<RouteKey, usize>>,
    /// Hand-overs given to each (segment, transport) to measure it.
    tries: Mutex<IdMap<(SegmentId, usize), u32>>,
    /// Whether measurements correct the declared figures (FERRY_SELECT);
    /// when not, routes follow the declarations alone and nothing is
    /// tried for the sake of measuring it.
    measured: bool,
    /// The transport requests prefer (`prefer`, FERRY_PREFER): chosen
    /// whenever it can serve a request that names no transport, whatever
    /// the estimates say. It never makes memory another transport moves
    /// directly go through staging: device memory it does not register is
    /// not a candidate for it, so the engine's own choice carries that.
    prefer: Option<usize>,
}

impl<T> Deref for Transports<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.list
    }
}

/// One request's question to selection.
pub(crate) struct Want<'a> {
    pub(crate) local: &'a LocalBuffer,
    pub(crate) segment: &'a RemoteSegment,
    pub(crate) view: &'a RemoteView,
    /// Index of the remote buffer in `view`.
    pub(crate) remote: usize,
    /// How many bytes the route carries at once (the request's length).
    pub(crate) bytes: u64,
    /// The transport the request asks for, if any.
    pub(crate) hint: Option<&'a str>,
    /// Put the reason into words (for logs and `route`), and change no
    /// state; otherwise the per-request path stays free of formatting.
    pub(crate) explain: bool,
}

/// A transport that can serve the request, and what it is expected to cost.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub(crate) transport: usize,
    /// From the declarations (or scope defaults) and the topology.
    pub(crate) estimate: Estimate,
    pub(crate) measured: Measured,
    /// The figures used: the estimate's, unless measurement contradicted them.
    pub(crate) used: Figures,
    pub(crate) seconds: f64,
}

impl Scored {
    fn corrected(&self) -> bool {
        self.used != self.estimate.path
    }
}

/// Why the winner won.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Basis {
    /// The smallest estimate.
    Fastest,
    /// The route in use, kept: no other is clearly faster.
    Kept,
    /// Being measured: close to the best, not measured yet.
    Measuring,
    /// The preferred transport (`prefer`), which can serve.
    Preferred,
}

/// Selection's answer: the transport, and (when asked to explain) why.
#[derive(Clone, Debug)]
pub(crate) struct Choice {
    pub(crate) transport: usize,
    pub(crate) reason: String,
    /// The chosen route's figures (`None` for a requested transport).
    pub(crate) scored: Option<Scored>,
}

impl<T: Candidate> Transports<T> {
    pub(crate) fn new(
        list: Vec<T>,
        failures: Vec<(String, Error)>,
        endpoints: Vec<(String, Vec<u8>)>,
    ) -> Transports<T> {
        let links = list
            .iter()
            .map(|t| {
                t.devices()
                    .iter()
                    .map(|d| Link::from_report(d, None, &[]))
                    .collect()
            })
            .collect();
        Transports {
            list,
            links,
            failures,
            endpoints,
            meter: Arc::new(Meter::default()),
            logged: Mutex::default(),
            current: Mutex::default(),
            tries: Mutex::default(),
            measured: true,
            prefer: None,
        }
    }

    /// The transport requests prefer: `name` exactly, else the first whose
    /// name starts with it ("rdma" for a vendor's "rdma-x"); `None` when
    /// no started transport is so named.
    pub(crate) fn preferring(mut self, name: Option<&str>) -> Transports<T> {
        self.prefer = name.filter(|n| !n.is_empty()).and_then(|n| {
            self.list
                .iter()
                .position(|t| t.name() == n)
                .or_else(|| self.list.iter().position(|t| t.name().starts_with(n)))
        });
        self
    }

    /// The preferred transport's index, if one runs.
    pub(crate) fn preferred(&self) -> Option<usize> {
        self.prefer
    }

    /// Whether measurements correct the declarations (FERRY_SELECT:
    /// `measured`, the default, or `declared`).
    pub(crate) fn measured(mut self, measured: bool) -> Transports<T> {
        self.measured = measured;
        self
    }

    /// Places each transport's devices in the topology (path classes from
    /// every memory location to each device that is a NIC).
    pub(crate) fn placed(mut self, topology: &Topology) -> Transports<T> {
        // The kernel's loopback interfaces (a transport's device named so
        // reaches only this host).
        let loopback: Vec<String> = ferry_plugins_abi::sdk::net::list()
            .unwrap_or_default()
            .into_iter()
            .filter(|i| i.loopback)
            .map(|i| i.name)
            .collect();
        self.links = self
            .list
            .iter()
            .map(|t| {
                t.devices()
                    .iter()
                    .map(|d| Link::from_report(d, Some(topology), &loopback))
                    .collect()
            })
            .collect();
        self
    }

    /// Whether the route (segment, transport) is to be logged: true once.
    pub(crate) fn first_use(&self, segment: SegmentId, transport: usize) -> bool {
        self.logged.lock().insert((segment, transport))
    }

    /// Picks the transport for one request and says why: of the transports
    /// that can move this memory to a peer in this scope, run at the peer,
    /// have a key for the remote buffer, and do not decline this peer or
    /// buffer (`accepts(transport, key)`, asked in order of preference
    /// until one accepts), the one estimated fastest.
    pub(crate) fn select(
        &self,
        want: &Want<'_>,
        mut accepts: impl FnMut(usize, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<Choice> {
        let Want {
            local,
            segment: seg,
            view,
            remote,
            bytes,
            hint,
            explain,
        } = *want;
        let remote_buf = &view.buffers[remote];
        let mut candidates: SmallVec<[Scored; 4]> = SmallVec::new();
        // Why each other transport cannot serve, in words only if nothing
        // can (the common case never formats them).
        let mut rejected: SmallVec<[(usize, Refusal); 4]> = SmallVec::new();
        for (i, t) in self.list.iter().enumerate() {
            let name = t.name();
            if hint.is_some_and(|h| h != name) {
                continue;
            }
            match self.refusal(i, want) {
                Some(r) => rejected.push((i, r)),
                None => candidates.push(self.score(i, local, seg.id, seg.scope, bytes)),
            }
        }
        let key: RouteKey = (seg.id, local.mem_kind, bytes >= BANDWIDTH_MIN_BYTES);
        let basis = self.order(&mut candidates, key, hint.is_some(), bytes);
        let mut chosen = None;
        for (n, c) in candidates.iter().enumerate() {
            let name = self.list[c.transport].name();
            let key = remote_buf
                .keys
                .get(name)
                .map(|k| &k[..])
                .unwrap_or_default();
            match accepts(c.transport, key) {
                Ok(()) => {
                    chosen = Some(n);
                    break;
                }
                Err(why) => rejected.push((c.transport, Refusal::Declined(why))),
            }
        }
        let explained = || -> Vec<String> {
            rejected
                .iter()
                .map(|(i, r)| r.explain(self.list[*i].name(), local, seg, remote_buf.addr))
                .collect()
        };
        let Some(best) = chosen else {
            return Err(nothing_serves(local, seg, hint, &explained()));
        };
        // A transport further down the list serves only because those
        // before it declined: it won as the fastest of the rest.
        let basis = if best == 0 { basis } else { Basis::Fastest };
        let won = candidates[best].clone();
        if !explain && hint.is_none() {
            self.remember(key, seg, &won, basis, &candidates);
        }
        let t = &self.list[won.transport];
        if !explain {
            return Ok(Choice {
                transport: won.transport,
                reason: String::new(),
                scored: Some(won),
            });
        }
        if hint.is_some() {
            return Ok(Choice {
                transport: won.transport,
                reason: format!("{} was requested", t.name()),
                scored: Some(won),
            });
        }
        let reason = self.explain(want, &won, basis, &candidates, &explained);
        Ok(Choice {
            transport: won.transport,
            reason,
            scored: Some(won),
        })
    }

    /// Why transport `i` cannot serve this request at all, or None.
    fn refusal(&self, i: usize, want: &Want<'_>) -> Option<Refusal> {
        let (t, local) = (&self.list[i], want.local);
        let name = t.name();
        if local.visibility == Visibility::Unregistered && local.registration(i).is_none() {
            Some(Refusal::NeedsRegistration)
        } else if local.device.is_some() && local.registration(i).is_none() {
            Some(Refusal::NotDirect)
        } else if local.device.is_none() && t.mem_kinds() & local.mem_kind == 0 {
            Some(Refusal::CannotMove)
        } else if !crate::transport::scope_served(t.scopes(), want.segment.scope.raw()) {
            Some(Refusal::CannotReach)
        } else if !want.view.endpoints.contains_key(name) {
            Some(Refusal::NotAtPeer)
        } else if !want.view.buffers[want.remote].keys.contains_key(name) {
            Some(Refusal::NoKey)
        } else {
            None
        }
    }

    /// The choice in words: the route, its estimate, why it won, how the
    /// local memory is registered, the others and why the rest cannot serve.
    fn explain(
        &self,
        want: &Want<'_>,
        won: &Scored,
        basis: Basis,
        candidates: &[Scored],
        explained: &dyn Fn() -> Vec<String>,
    ) -> String {
        let Want {
            local,
            segment: seg,
            view,
            remote,
            bytes,
            ..
        } = *want;
        let remote_buf = &view.buffers[remote];
        let t = &self.list[won.transport];
        let mut reason = format!(
            "{} memory to {} memory on {}: {} {}; {}",
            local.location,
            remote_buf.location,
            seg.scope.as_str(),
            t.name(),
            reach(t.scopes()),
            self.describe(won, bytes)
        );
        match basis {
            Basis::Fastest => {}
            Basis::Kept => reason.push_str(&format!(
                " (kept: no other route is estimated {:.0}% faster)",
                (SWITCH - 1.0) * 100.0
            )),
            Basis::Preferred => reason.push_str(" (preferred: the prefer setting names it)"),
            Basis::Measuring => reason.push_str(&format!(
                " (being measured: {} of {MIN_SAMPLES} samples; another route is estimated \
                 faster until measurement says otherwise)",
                won.measured.bandwidth_samples
            )),
        }
        if let Some(r) = local
            .registration(won.transport)
            .filter(|_| local.device.is_some())
        {
            let how = ferry_plugins_abi::caps::mem_kind_names(r.mem_kind).join(", ");
            reason.push_str(&format!(
                " (local {} memory registered as {how})",
                local.location
            ));
        }
        let others: Vec<String> = candidates
            .iter()
            .filter(|c| c.transport != won.transport)
            .map(|c| {
                format!(
                    "{} ({})",
                    self.list[c.transport].name(),
                    self.describe(c, bytes)
                )
            })
            .collect();
        if !others.is_empty() {
            reason.push_str(&format!("; preferred over {}", others.join(", ")));
        }
        let not_usable = explained();
        if !not_usable.is_empty() {
            reason.push_str(&format!("; not usable: {}", not_usable.join("; ")));
        }
        reason
    }

    /// Transport `i`'s estimate for this memory and size, corrected by what
    /// was measured toward this segment.
    fn score(
        &self,
        i: usize,
        local: &LocalBuffer,
        segment: SegmentId,
        scope: Scope,
        bytes: u64,
    ) -> Scored {
        let t = &self.list[i];
        // Device memory moves as its registration says; host memory as itself.
        let kind = match (local.device, local.registration(i)) {
            (Some(_), Some(r)) => r.mem_kind,
            _ => local.mem_kind,
        };
        let estimate = cost::estimate(
            &self.links[i],
            t.scopes(),
            kind,
            local.location,
            bytes,
            scope == Scope::CrossHost,
        );
        let measured = if self.measured {
            self.meter.get(segment, i)
        } else {
            Measured::default()
        };
        let mut used = estimate.path;
        if let Some(bw) = measured
            .bandwidth()
            .filter(|m| contradicts(*m, used.bandwidth_mbps))
        {
            used.bandwidth_mbps = bw;
        }
        if let Some(ns) = measured
            .latency()
            .filter(|m| contradicts(*m, used.latency_ns))
        {
            used.latency_ns = ns;
        }
        Scored {
            transport: i,
            seconds: used.seconds(bytes),
            estimate,
            measured,
            used,
        }
    }

    /// Puts the candidates in order of preference: fastest first (ties to
    /// the transport loaded first), then the route in use moved to the
    /// front unless another is clearly faster, then a transport being
    /// measured moved to the front.
    fn order(&self, candidates: &mut [Scored], key: RouteKey, hinted: bool, bytes: u64) -> Basis {
        candidates.sort_by(|a, b| {
            a.seconds
                .total_cmp(&b.seconds)
                .then(a.transport.cmp(&b.transport))
        });
        let Some(fastest) = candidates.first().map(|c| c.seconds) else {
            return Basis::Fastest;
        };
        if hinted {
            return Basis::Fastest;
        }
        if let Some(n) = self
            .prefer
            .and_then(|p| candidates.iter().position(|c| c.transport == p))
        {
            candidates[..=n].rotate_right(1);
            return Basis::Preferred;
        }
        if !self.measured {
            return Basis::Fastest;
        }
        // The fastest is measured by using it; once it is, the others
        // within reach are measured too, on large hand-overs only.
        if bytes >= BANDWIDTH_MIN_BYTES && candidates[0].measured.bandwidth_samples >= MIN_SAMPLES {
            let tries = self.tries.lock();
            let unmeasured = candidates.iter().position(|c| {
                c.measured.bandwidth_samples < MIN_SAMPLES
                    && c.seconds <= fastest * EXPLORE
                    && tries.get(&(key.0, c.transport)).copied().unwrap_or(0) < EXPLORE_TRIES
            });
            if let Some(n) = unmeasured {
                candidates[..=n].rotate_right(1);
                return Basis::Measuring;
            }
        }
        let current = self.current.lock().get(&key).copied();
        if let Some(n) = current
            .and_then(|t| candidates.iter().position(|c| c.transport == t))
            .filter(|n| *n > 0 && candidates[*n].seconds <= fastest * SWITCH)
        {
            candidates[..=n].rotate_right(1);
            return Basis::Kept;
        }
        Basis::Fastest
    }

    /// Records the route now in use for `key`, and says so once when it changes.
    fn remember(
        &self,
        key: RouteKey,
        seg: &RemoteSegment,
        won: &Scored,
        basis: Basis,
        all: &[Scored],
    ) {
        if basis == Basis::Measuring {
            *self
                .tries
                .lock()
                .entry((seg.id, won.transport))
                .or_default() += 1;
            return;
        }
        let before = self.current.lock().insert(key, won.transport);
        let Some(before) = before.filter(|b| *b != won.transport) else {
            return;
        };
        let old = all.iter().find(|c| c.transport == before);
        let size = if key.2 { "large" } else { "small" };
        log::info!(
            "segment {}: {size} transfers now go by {} ({}){}",
            seg.name,
            self.list[won.transport].name(),
            self.describe(won, 0),
            match old {
                Some(o) => format!(
                    " instead of {} ({})",
                    self.list[before].name(),
                    self.describe(o, 0)
                ),
                None => format!(
                    " instead of {}, which cannot serve them now",
                    self.list[before].name()
                ),
            }
        );
    }

    /// A route's figures for `Engine::route`; with `staged` (ends, bytes),
    /// as the host leg of device memory staged at that many ends.
    pub(crate) fn route_estimate(
        &self,
        c: &Scored,
        staged: Option<(u32, u64)>,
    ) -> super::request::RouteEstimate {
        let (used, seconds) = match staged {
            Some((ends, bytes)) => {
                let leg = Estimate {
                    path: c.used,
                    ..c.estimate.clone()
                };
                let s = cost::staged(&leg, ends, bytes);
                (s.path, s.seconds)
            }
            None => (c.used, c.seconds),
        };
        let m = &c.measured;
        super::request::RouteEstimate {
            seconds,
            bandwidth_mbps: used.bandwidth_mbps,
            latency_ns: used.latency_ns,
            declared: c.estimate.declared,
            device: c
                .estimate
                .device
                .and_then(|d| self.links[c.transport].get(d))
                .map(|l| l.device.clone()),
            measured_bandwidth_mbps: (m.bandwidth_samples > 0).then_some(m.bandwidth_mbps),
            bandwidth_samples: m.bandwidth_samples,
            measured_latency_ns: (m.latency_samples > 0).then_some(m.latency_ns),
            latency_samples: m.latency_samples,
        }
    }

    /// A route's figures in operator words: the estimate, the device and
    /// path class behind it, and the measured figures when they count.
    fn describe(&self, c: &Scored, bytes: u64) -> String {
        let e = &c.estimate;
        let mut s = String::new();
        if bytes > 0 {
            s.push_str(&format!(
                "estimated {} for {}: ",
                cost::micros(c.seconds * 1e9),
                cost::size(bytes)
            ));
        }
        let device = e
            .device
            .and_then(|d| self.links[c.transport].get(d))
            .map(|l| match e.class {
                Some(class) => format!(" over {} ({class})", l.device),
                None => format!(" over {}", l.device),
            })
            .unwrap_or_default();
        s.push_str(&format!(
            "{} {}, {}{device}",
            if e.declared {
                "declared"
            } else {
                "no figures declared, assumed"
            },
            cost::gbits(e.path.bandwidth_mbps),
            cost::micros(e.path.latency_ns)
        ));
        let m = &c.measured;
        if m.bandwidth_samples > 0 || m.latency_samples > 0 {
            let mut parts = Vec::new();
            if m.bandwidth_samples > 0 {
                parts.push(format!(
                    "{} over {} samples",
                    cost::gbits(m.bandwidth_mbps),
                    m.bandwidth_samples
                ));
            }
            if m.latency_samples > 0 {
                parts.push(format!(
                    "{} over {} samples",
                    cost::micros(m.latency_ns),
                    m.latency_samples
                ));
            }
            s.push_str(&format!(
                "; measured {}{}",
                parts.join(", "),
                if c.corrected() {
                    ", which replaces the declared figure"
                } else {
                    ""
                }
            ));
        }
        s
    }
}

/// Whether a measured figure is far enough from the one in use to replace it.
fn contradicts(measured: f64, used: f64) -> bool {
    measured > used * CONTRADICTION || measured * CONTRADICTION < used
}

/// What a transport reaches, from its scope bits.
fn reach(scopes: u32) -> &'static str {
    if scopes & sys::FERRY_SCOPE_CROSS_HOST != 0 {
        "reaches other hosts"
    } else if scopes & sys::FERRY_SCOPE_SAME_HOST != 0 {
        "reaches processes of this host"
    } else {
        "copies within this process"
    }
}

/// Whether transport `transport` (named `name`) serves this segment's
/// buffer with `key`: `ask` puts the question to the peer's plugin once
/// (`None`: the peer could not be asked, which is not a refusal and is not
/// remembered), and the answer is remembered for the segment.
pub(crate) fn acceptance(
    seg: &RemoteSegment,
    transport: usize,
    name: &str,
    key: &[u8],
    ask: impl FnOnce() -> Option<std::result::Result<(), String>>,
) -> std::result::Result<(), String> {
    if let Some(v) = seg.verdicts.lock().get(&transport).and_then(|m| m.get(key)) {
        return v.clone();
    }
    let Some(verdict) = ask() else {
        return Ok(());
    };
    if let Err(why) = &verdict {
        log::info!(
            "segment {}: {name} declined some of its buffers ({why}); using the next transport \
             for them",
            seg.name,
        );
    }
    seg.verdicts
        .lock()
        .entry(transport)
        .or_default()
        .insert(key.to_vec(), verdict.clone());
    verdict
}

/// Fake transports and the plain data selection reads, for unit tests
/// here and in planning: no plugin, no socket.
mod refusal;
use refusal::{nothing_serves, Refusal};

#[cfg(test)]
pub(crate) mod fakes;

#[cfg(test)]
mod tests;
