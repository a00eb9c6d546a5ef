//! The initiator's data path: requests cut into slices over the rails of a
//! peer (peer.rs: its queue pairs, one per NIC pair, created on demand
//! through plugin messaging and cached), completions, and what happens when a slice
//! fails: access errors fail the request (another NIC would be refused
//! too); path errors move the slice to another NIC pair and count against
//! the NICs, which are paused with a back-off when they keep failing.

use crate::health::Verdict;
use crate::rails::{self, Pair};
use crate::state::{Channel, Inner, Peer, Req, Slice, LOCAL_PAUSE_AFTER, REMOTE_PAUSE_AFTER};
use crate::verbs::{self, RdmaOp, Wc};
use ferry_plugins_abi::sdk::{Op, PluginError, PluginResult, TransferRequest};
use ferry_plugins_abi::ErrorCode;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most NIC pairs one slice tries before its request fails.
const MAX_ATTEMPTS: usize = 8;
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// Accepts requests: every one completes through the completer, unless
/// this returns an error (then none was accepted).
pub fn submit(
    inner: &Arc<Inner>,
    peer: &Arc<Peer>,
    requests: &[TransferRequest<'_>],
) -> PluginResult<()> {
    if peer.closed.load(Ordering::SeqCst) {
        return Err(PluginError::new(
            ErrorCode::Connection,
            format!("{}: disconnected", peer.name),
        ));
    }
    let now = Instant::now();
    let slice_bytes = inner.settings.slice_bytes;
    let mut plan: Vec<Slice> = Vec::new();
    let mut reqs: Vec<(Arc<Req>, usize)> = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let region = inner.region(r.local_mem).ok_or_else(|| {
            PluginError::new(
                ErrorCode::InvalidArgument,
                format!("request {i}: its local buffer is not registered with rdma"),
            )
        })?;
        if r.length == 0 || !region.covers(r.local_addr, r.length) {
            return Err(PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: local range [{:#x}, +{}) is outside its registered buffer",
                    r.local_addr, r.length
                ),
            ));
        }
        let key = peer.key(r.remote_key)?;
        if !key.covers(r.remote_addr, r.length) {
            return Err(PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: remote range [{:#x}, +{}) is outside the buffer {} registered \
                     [{:#x}, +{})",
                    r.remote_addr, r.length, peer.name, key.addr, key.len
                ),
            ));
        }
        let rails = peer.rails_for(inner, &region, &key, now);
        if rails.is_empty() {
            return Err(PluginError::new(
                ErrorCode::Unavailable,
                format!("request {i}: no NIC pair links this buffer to the peer's"),
            ));
        }
        inner.info_once(
            format!("route:{}:{}:{:?}", peer.name, region.location, rails),
            || {
                format!(
                    "rdma: {} memory to {}: NIC pairs {} ({} slices)",
                    region.location,
                    peer.name,
                    rails
                        .iter()
                        .map(|p| peer.pair_name(inner, *p))
                        .collect::<Vec<_>>()
                        .join(", "),
                    human(slice_bytes)
                )
            },
        );
        let rails = Arc::new(rails);
        let n = r.length.div_ceil(slice_bytes) as usize;
        let start = peer.cursor.fetch_add(n, Ordering::Relaxed);
        let req = Arc::new(Req {
            token: r.token,
            remaining: AtomicUsize::new(n),
            error: Mutex::new(None),
        });
        reqs.push((req.clone(), n));
        let op = match r.op {
            Op::Write => RdmaOp::Write,
            Op::Read => RdmaOp::Read,
        };
        for k in 0..n {
            let off = k as u64 * slice_bytes;
            let len = (r.length - off).min(slice_bytes) as u32;
            plan.push(Slice {
                req: req.clone(),
                peer: peer.clone(),
                op,
                local: region.clone(),
                local_addr: r.local_addr + off,
                key: key.clone(),
                remote_addr: r.remote_addr + off,
                len,
                rails: rails.clone(),
                pair: rails[(start + k) % rails.len()],
                tried: Vec::new(),
                channel: None,
                posted: None,
                last_error: None,
            });
        }
    }
    let mut pairs: Vec<Pair> = plan.iter().map(|s| s.pair).collect();
    pairs.sort_unstable();
    pairs.dedup();
    // The peer's transport unreachable: nothing is accepted.
    let channels = peer.channels(inner, &pairs)?;
    for mut s in plan {
        match channels.get(&s.pair) {
            Some(Ok(c)) => {
                s.channel = Some(c.clone());
                post_or_queue(inner, s);
            }
            Some(Err(why)) => {
                let why = format!("{}: {why}", peer.pair_name(inner, s.pair));
                record_failure(inner, &peer.clone(), s.pair, &why, false);
                s.tried.push(s.pair);
                s.last_error = Some(why);
                inner.retries.lock().push_back(s);
            }
            None => {
                s.last_error = Some("no queue pair".into());
                inner.retries.lock().push_back(s);
            }
        }
    }
    if !inner.retries.lock().is_empty() {
        inner.wake_poller();
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// Posts a slice on its channel, or queues it on its NIC when the queue
/// pair or the NIC's completion queue is full.
fn post_or_queue(inner: &Inner, mut s: Slice) {
    if s.req.failed() || inner.stopping() {
        finish(inner, s, None);
        return;
    }
    let Some(ch) = s.channel.clone().filter(|c| c.usable()) else {
        inner.retries.lock().push_back(s);
        inner.wake_poller();
        return;
    };
    let nic = &inner.nics[s.pair.0];
    let has_room = ch.outstanding.load(Ordering::Acquire) < ch.depth
        && nic.outstanding.load(Ordering::Acquire) < nic.cq_budget;
    if !has_room {
        nic.backlog.lock().push_back(s);
        return;
    }
    let (Some(lkey), Some(rkey)) = (s.local.lkey(s.pair.0), s.key.rkey(s.pair.1)) else {
        // Not registered on this pair's NICs: try another pair.
        s.tried.push(s.pair);
        s.last_error = Some(format!(
            "{} lacks a registration",
            s.peer.pair_name(inner, s.pair)
        ));
        inner.retries.lock().push_back(s);
        inner.wake_poller();
        return;
    };
    let wr_id = inner.next_wr.fetch_add(1, Ordering::Relaxed);
    let (op, laddr, len, raddr) = (s.op, s.local_addr, s.len, s.remote_addr);
    s.posted = Some(Instant::now());
    ch.outstanding.fetch_add(1, Ordering::AcqRel);
    nic.outstanding.fetch_add(1, Ordering::AcqRel);
    // In the table before posting: the completion may be polled by another
    // thread before post returns.
    inner.inflight.lock().insert(wr_id, s);
    // SAFETY: [laddr, +len) lies in the local region (checked in submit)
    // registered under lkey; the slice in `inflight` keeps the region, and
    // so its MR, alive until the completion is polled.
    let posted = unsafe { ch.qp.lock().post(wr_id, op, laddr, lkey, len, raddr, rkey) };
    if let Err(e) = posted {
        let Some(mut s) = inner.inflight.lock().remove(&wr_id) else {
            return;
        };
        ch.outstanding.fetch_sub(1, Ordering::AcqRel);
        nic.outstanding.fetch_sub(1, Ordering::AcqRel);
        let why = format!("posting on {}: {e}", s.peer.pair_name(inner, s.pair));
        ch.break_it();
        s.tried.push(s.pair);
        s.last_error = Some(why);
        inner.retries.lock().push_back(s);
        inner.wake_poller();
    }
}

/// Posts what waited on NIC `nic` while there is room; returns how many.
pub fn drain_backlog(inner: &Inner, nic: usize) -> usize {
    let n = &inner.nics[nic];
    let mut posted = 0;
    loop {
        let Some(s) = n.backlog.lock().pop_front() else {
            break;
        };
        let room = s
            .channel
            .as_ref()
            .is_none_or(|c| !c.usable() || c.outstanding.load(Ordering::Acquire) < c.depth)
            && n.outstanding.load(Ordering::Acquire) < n.cq_budget;
        if !room && !s.req.failed() && !inner.stopping() {
            n.backlog.lock().push_front(s);
            break;
        }
        post_or_queue(inner, s);
        posted += 1;
    }
    posted
}

/// One work completion from NIC `nic`'s completion queue.
pub fn on_completion(inner: &Inner, nic: usize, wc: Wc) {
    let Some(mut s) = inner.inflight.lock().remove(&wc.wr_id) else {
        return;
    };
    let ch = s.channel.clone();
    if let Some(c) = &ch {
        c.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
    inner.nics[nic].outstanding.fetch_sub(1, Ordering::AcqRel);
    let peer = s.peer.clone();
    let pair = s.pair;
    if wc.status == verbs::WC_SUCCESS {
        peer.sent[pair.0].fetch_add(u64::from(s.len), Ordering::Relaxed);
        peer.slices[pair.0].fetch_add(1, Ordering::Relaxed);
        if let Some(b) = peer.remote_sent.get(pair.1 as usize) {
            b.fetch_add(u64::from(s.len), Ordering::Relaxed);
        }
        if let Some(n) = peer.remote_slices.get(pair.1 as usize) {
            n.fetch_add(1, Ordering::Relaxed);
        }
        if inner.nics[pair.0].health.success() {
            inner.host.info(&format!(
                "rdma: {} works again; it carries slices again",
                inner.nics[pair.0].name
            ));
        }
        if let Some(h) = peer.remote_health.get(pair.1 as usize) {
            h.success();
        }
        finish(inner, s, None);
        return;
    }
    if let Some(c) = &ch {
        c.break_it();
    }
    if inner.stopping() || peer.closed.load(Ordering::SeqCst) {
        let e = PluginError::new(
            ErrorCode::Cancelled,
            format!(
                "{}: the request was cancelled (disconnect or shutdown)",
                peer.name
            ),
        );
        finish(inner, s, Some(e));
        return;
    }
    if wc.status == verbs::WC_WR_FLUSH_ERR {
        // Flushed because its queue pair broke: not this slice's fault.
        inner.retries.lock().push_back(s);
        inner.wake_poller();
        return;
    }
    let why = format!(
        "{} on {}, vendor error {:#x}",
        verbs::wc_status_name(wc.status),
        peer.pair_name(inner, pair),
        wc.vendor_err
    );
    match wc.status {
        // The peer's NIC refused the access itself: every NIC would.
        verbs::WC_REM_ACCESS_ERR | verbs::WC_REM_INV_REQ_ERR | verbs::WC_REM_OP_ERR => {
            let e = PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "{} refused [{:#x}, +{}) of its buffer: {why} (the buffer was unregistered or \
                     re-registered since its key was read, or the range is outside it; the \
                     target's memory is untouched)",
                    peer.name, s.remote_addr, s.len
                ),
            );
            finish(inner, s, Some(e));
        }
        // Local protection/length errors: a bug or unmappable memory here.
        verbs::WC_LOC_LEN_ERR
        | verbs::WC_LOC_QP_OP_ERR
        | verbs::WC_LOC_PROT_ERR
        | verbs::WC_LOC_ACCESS_ERR => {
            let e = PluginError::new(
                ErrorCode::Io,
                format!(
                    "the local NIC refused [{:#x}, +{}): {why} (local memory not accessible to \
                     the NIC, e.g. GPU memory it cannot map)",
                    s.local_addr, s.len
                ),
            );
            finish(inner, s, Some(e));
        }
        _ => {
            record_failure(inner, &peer, pair, &why, true);
            s.tried.push(pair);
            s.last_error = Some(why);
            inner.retries.lock().push_back(s);
            inner.wake_poller();
        }
    }
}

/// Counts a NIC pause in the engine's metrics (`nic_pauses` per local NIC,
/// `peer_nic_pauses` per peer NIC). Pauses are rare: the name is built only
/// then.
fn count_pause(inner: &Inner, counter: &std::ffi::CStr, nic: &str) {
    if let Ok(name) = std::ffi::CString::new(nic) {
        inner.host.count(counter, Some(&name), 1);
    }
}

/// A failure on a NIC pair: the local NIC when its port is down (or it
/// keeps failing), else the peer's NIC, paused after failing repeatedly.
fn record_failure(inner: &Inner, peer: &Arc<Peer>, pair: Pair, why: &str, data: bool) {
    let nic = &inner.nics[pair.0];
    let base = inner.settings.pause;
    let port_down = data && verbs::port_active(&nic.dev.ctx, nic.port.port) == Some(false);

    if port_down {
        if let Verdict::Paused(d) = nic.health.failure(why, 1, base, MAX_PAUSE) {
            count_pause(inner, c"nic_pauses", &nic.name);
            inner.host.warn(&format!(
                "rdma: {} port {} is down ({why}); pausing {} for {:.1} s (back-off doubles while \
                 it keeps failing, up to 60 s); its slices move to the other NICs",
                nic.name,
                nic.port.port,
                nic.name,
                d.as_secs_f64(),
            ));
        }
        return;
    }
    if let Some(h) = peer.remote_health.get(pair.1 as usize) {
        if let Verdict::Paused(d) = h.failure(why, REMOTE_PAUSE_AFTER, base, MAX_PAUSE) {
            count_pause(
                inner,
                c"peer_nic_pauses",
                &peer.remote[pair.1 as usize].name,
            );
            inner.host.warn(&format!(
                "rdma: {}'s NIC {} failed {REMOTE_PAUSE_AFTER} times in a row from here (last: \
                 {why}); not using it for {:.1} s (back-off doubles while it keeps failing)",
                peer.name,
                peer.remote[pair.1 as usize].name,
                d.as_secs_f64()
            ));
        }
    }
    if let Verdict::Paused(d) = nic.health.failure(why, LOCAL_PAUSE_AFTER, base, MAX_PAUSE) {
        count_pause(inner, c"nic_pauses", &nic.name);
        inner.host.warn(&format!(
            "rdma: {} failed {LOCAL_PAUSE_AFTER} times in a row (last: {why}); pausing it for \
             {:.1} s (back-off doubles while it keeps failing); its slices move to the other NICs",
            nic.name,
            d.as_secs_f64(),
        ));
    }
}

/// Moves slices that failed (or whose queue pair broke) to another NIC
/// pair. Runs on the poller thread: it may have to connect.
pub fn run_retries(inner: &Inner) -> usize {
    let batch: Vec<Slice> = inner.retries.lock().drain(..).collect();
    let n = batch.len();
    if n > 0 {
        inner.host.count(c"slice_retries", None, n as u64);
    }
    for s in batch {
        retry(inner, s);
    }
    n
}

fn retry(inner: &Inner, mut s: Slice) {
    loop {
        if s.req.failed() || inner.stopping() {
            finish(inner, s, None);
            return;
        }
        let peer = s.peer.clone();
        if peer.closed.load(Ordering::SeqCst) {
            let e = PluginError::new(ErrorCode::Cancelled, format!("{}: disconnected", peer.name));
            finish(inner, s, Some(e));
            return;
        }
        if s.tried.len() >= MAX_ATTEMPTS {
            let e = give_up(&s);
            finish(inner, s, Some(e));
            return;
        }
        // The same pair again when only its queue pair broke (a flush),
        // else the next untried pair, healthy ones first.
        let compatible = peer.compatible(inner);
        let remote_all: Vec<u8> = if s.key.ranked.is_empty() {
            s.key.rkeys.iter().map(|(n, _)| *n).collect()
        } else {
            s.key.ranked.clone()
        };
        let candidates = rails::candidates(&s.rails, &s.local.ranked, &remote_all, &compatible);
        let now = Instant::now();
        let untried: Vec<Pair> = candidates
            .into_iter()
            .filter(|p| !s.tried.contains(p))
            .collect();
        let next = untried
            .iter()
            .copied()
            .find(|p| !peer.pair_paused(inner, *p, now))
            .or_else(|| untried.first().copied());
        let Some(next) = next else {
            let e = give_up(&s);
            finish(inner, s, Some(e));
            return;
        };
        if next != s.pair {
            peer.retried.fetch_add(1, Ordering::Relaxed);
            inner.info_once(
                format!("moved:{}:{:?}:{:?}", peer.name, s.pair, next),
                || {
                    format!(
                        "rdma: slices to {} that failed ({}) continue on {}",
                        peer.name,
                        s.last_error.clone().unwrap_or_else(|| format!(
                            "{}: its queue pair broke",
                            peer.pair_name(inner, s.pair)
                        )),
                        peer.pair_name(inner, next)
                    )
                },
            );
        }
        s.pair = next;
        match peer.channels(inner, &[next]) {
            Err(e) => {
                finish(inner, s, Some(e));
                return;
            }
            Ok(mut m) => match m.remove(&next) {
                Some(Ok(c)) => {
                    s.channel = Some(c);
                    post_or_queue(inner, s);
                    return;
                }
                other => {
                    let why = match other {
                        Some(Err(w)) => w,
                        _ => "no queue pair".to_string(),
                    };
                    let why = format!("{}: {why}", peer.pair_name(inner, next));
                    record_failure(inner, &peer, next, &why, false);
                    s.tried.push(next);
                    s.last_error = Some(why);
                }
            },
        }
    }
}

fn give_up(s: &Slice) -> PluginError {
    PluginError::new(
        ErrorCode::Connection,
        format!(
            "{} could not be reached on any of {} NIC pairs tried (last: {})",
            s.peer.name,
            s.tried.len(),
            s.last_error.as_deref().unwrap_or("no usable NIC pair")
        ),
    )
}

/// One slice is done (or given up): the request completes when its last
/// slice is.
fn finish(inner: &Inner, s: Slice, error: Option<PluginError>) {
    let req = s.req.clone();
    // The slice's hold on the region (and its MRs) ends before the engine
    // hears of the completion and may unregister the memory.
    drop(s);
    if let Some(e) = error {
        let mut g = req.error.lock();
        if g.is_none() {
            *g = Some(e);
        }
    }
    if req.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        let result = req.error.lock().clone();
        inner
            .completer
            .complete(req.token, result.as_ref().map_or(Ok(()), Err));
        inner.completed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Fails requests whose slices saw no completion within the timeout: their
/// queue pairs go to ERR, which flushes them.
pub fn check_timeouts(inner: &Inner) {
    let timeout = inner.settings.timeout;
    let now = Instant::now();
    struct Stale {
        id: u64,
        ch: Arc<Channel>,
        req: Arc<Req>,
        what: String,
        force: bool,
    }
    let mut stale: Vec<Stale> = Vec::new();
    for (id, s) in inner.inflight.lock().iter() {
        let Some(t) = s.posted else { continue };
        let age = now.saturating_duration_since(t);
        if age > timeout {
            if let Some(c) = &s.channel {
                stale.push(Stale {
                    id: *id,
                    ch: c.clone(),
                    req: s.req.clone(),
                    what: s.peer.pair_name(inner, s.pair) + " to " + &s.peer.name,
                    force: age > timeout * 2 + Duration::from_secs(1),
                });
            }
        }
    }
    for Stale {
        id,
        ch,
        req,
        what,
        force,
    } in stale
    {
        {
            let mut g = req.error.lock();
            if g.is_none() {
                *g = Some(PluginError::new(
                    ErrorCode::Timeout,
                    format!(
                        "no completion within {} ms on {what}: the peer or the fabric stopped \
                         answering",
                        timeout.as_millis()
                    ),
                ));
            }
        }
        ch.break_it();
        if force {
            // The NIC never flushed it: give up on the work request.
            let gone = inner.inflight.lock().remove(&id);
            if let Some(s) = gone {
                ch.outstanding.fetch_sub(1, Ordering::AcqRel);
                inner.nics[s.pair.0]
                    .outstanding
                    .fetch_sub(1, Ordering::AcqRel);
                finish(inner, s, None);
            }
        }
    }
}

/// Shutdown: every queue pair to ERR, flushes collected for a moment, and
/// whatever is left failed.
pub fn fail_everything(inner: &Inner, why: &str) {
    let peers: Vec<Arc<Peer>> = inner
        .peers
        .lock()
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    for p in &peers {
        p.close();
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut wcs = Vec::new();
    while !inner.inflight.lock().is_empty() && Instant::now() < deadline {
        for (i, nic) in inner.nics.iter().enumerate() {
            wcs.clear();
            nic.dev.cq.poll(&mut wcs, 256, true);
            for wc in &wcs {
                on_completion(inner, i, *wc);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut left: Vec<Slice> = inner.inflight.lock().drain().map(|(_, s)| s).collect();
    left.extend(inner.retries.lock().drain(..));
    for n in &inner.nics {
        left.extend(n.backlog.lock().drain(..));
    }
    for s in left {
        let e = PluginError::new(ErrorCode::Cancelled, why.to_string());
        finish(inner, s, Some(e));
    }
}
