//! `ferry bench scale-initiator`: one engine against many targets at once
//! (issue 32's scale harness, `scripts/scale.sh`). Requests of one block
//! size are spread over every target that answered: each batch gives
//! `per_peer` requests to each of the next targets in turn, so a batch has
//! the same size whatever the number of targets, and every target keeps its
//! connections open while the batches go round.
//!
//! The throughput figure covers a window the caller chooses, so that a
//! script measuring another process can sample it over the same seconds:
//! with `--window-file`, the command prints `ready` once every target had
//! its first batch, keeps moving data, and counts the bytes of batches that
//! complete between the two Unix times the file holds (`START END`); it
//! stops 1.5 s after END.

use crate::bench::{largest_buffer, run_batch};
use crate::util::{human_size, Buffer};
use ferry_core::{Engine, EngineConfig, Op, Request, SegmentId};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub struct ScaleArgs {
    /// Segment names (host:port) of the targets.
    pub segments: Vec<String>,
    pub op: Op,
    pub block_size: u64,
    /// Requests per batch, in all.
    pub batch_size: usize,
    /// Consecutive requests of a batch that go to one target.
    pub per_peer: usize,
    pub threads: usize,
    /// Local registered memory, split between the threads.
    pub buffer_size: u64,
    /// Seconds to run; with a window file, how long to wait for it.
    pub duration: f64,
    pub window_file: Option<PathBuf>,
    pub json: bool,
}

/// A target that answered: its segment and its largest buffer, cut into
/// every other block (a gap after each, so the engine never merges two
/// requests into one).
#[derive(Clone, Copy)]
struct Peer {
    seg: SegmentId,
    base: u64,
    slots: u64,
}

#[derive(Serialize)]
struct Refused {
    segment: String,
    reason: String,
}

#[derive(Serialize)]
struct Report {
    op: &'static str,
    block_size: u64,
    batch_size: usize,
    per_peer: usize,
    threads: usize,
    peers: usize,
    served: usize,
    refused: Vec<Refused>,
    /// The counted window: Unix times, and its length in seconds.
    window_start: f64,
    window_end: f64,
    window_s: f64,
    /// Bytes of batches that completed within the window.
    bytes: u64,
    gb_per_s: f64,
}

/// Seconds the traffic goes on after the counted window.
const LINGER_S: f64 = 1.5;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Reads `START END` (Unix seconds) from the window file, once it exists
/// and holds both.
fn read_window(path: &PathBuf) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse::<f64>());
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) if b > a => Some((a, b)),
        _ => None,
    }
}

/// The run's `index`-th request: runs of `per_peer` go to each target in
/// turn; each target's requests move through its slots (every other block),
/// the local ones through the thread's `local.1` slots from `local.0`.
fn place(peers: &[Peer], per_peer: u64, local: (u64, u64), block: u64, index: u64) -> Placement {
    let peer = &peers[((index / per_peer) % peers.len() as u64) as usize];
    let round = index / (per_peer * peers.len() as u64) * per_peer + index % per_peer;
    Placement {
        seg: peer.seg,
        local: local.0 + (index % local.1) * block,
        remote: peer.base + (round % peer.slots) * 2 * block,
    }
}

struct Placement {
    seg: SegmentId,
    local: u64,
    remote: u64,
}

pub fn scale_initiator(args: ScaleArgs) -> Result<(), String> {
    if args.segments.is_empty() {
        return Err("give the targets' segments (--segments host:port,host:port,...)".into());
    }
    if args.block_size == 0 || args.batch_size == 0 || args.per_peer == 0 || args.threads == 0 {
        return Err("--block-size, --batch-size, --per-peer and --threads must be positive".into());
    }
    let per_thread = args.buffer_size / args.threads as u64;
    if per_thread < args.block_size {
        return Err(format!(
            "--buffer-size {} is too small for {} threads of {} blocks",
            human_size(args.buffer_size),
            args.threads,
            human_size(args.block_size)
        ));
    }
    let engine = Arc::new(
        Engine::new(EngineConfig::from_env().map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?,
    );
    let local = Buffer::new(args.buffer_size as usize)?;
    engine
        .register_memory(local.addr(), args.buffer_size, None)
        .map_err(|e| e.to_string())?;
    let local_slots = per_thread / args.block_size;
    let timeout = engine.config().timeout * 2;

    // Every target gets one batch of its own first: it connects (all of
    // `tcp.connections` when the batch fills that many frames) and it says
    // whether the target serves us. One that does not is left out, with why.
    let mut peers = Vec::new();
    let mut refused = Vec::new();
    for name in &args.segments {
        match first_batch(&engine, name, &args, local.addr(), local_slots, timeout) {
            Ok(p) => peers.push(p),
            Err(reason) => {
                eprintln!("ferry bench scale-initiator: {name} not served: {reason}");
                refused.push(Refused {
                    segment: name.clone(),
                    reason,
                });
            }
        }
    }
    if peers.is_empty() {
        return Err(format!(
            "none of the {} targets served a batch (the first: {})",
            args.segments.len(),
            refused.first().map(|r| r.reason.as_str()).unwrap_or("")
        ));
    }
    if args.window_file.is_some() {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "ready {} {}", peers.len(), refused.len());
        let _ = out.flush();
    }

    let stop = Arc::new(AtomicBool::new(false));
    let counted = Arc::new(AtomicU64::new(0));
    // (start, end) of the counted window; until the file says, none.
    let window: Arc<Mutex<Option<(f64, f64)>>> = Arc::default();
    let failure: Arc<Mutex<Option<String>>> = Arc::default();
    let peers = Arc::new(peers);
    let mut workers = Vec::new();
    for t in 0..args.threads as u64 {
        let (engine, stop, counted, window, failure, peers) = (
            engine.clone(),
            stop.clone(),
            counted.clone(),
            window.clone(),
            failure.clone(),
            peers.clone(),
        );
        let (op, block, batch, per_peer) = (
            args.op,
            args.block_size,
            args.batch_size as u64,
            args.per_peer as u64,
        );
        let local_base = local.addr() + t * local_slots * block;
        workers.push(std::thread::spawn(move || {
            let mut reqs: Vec<Request> = (0..batch)
                .map(|_| Request::new(op, local_base, peers[0].seg, peers[0].base, block))
                .collect();
            // Threads start at different places in the round.
            let mut next = t * batch;
            while !stop.load(Ordering::Relaxed) {
                for r in reqs.iter_mut() {
                    let p = place(&peers, per_peer, (local_base, local_slots), block, next);
                    (r.segment, r.local_addr, r.remote_addr) = (p.seg, p.local, p.remote);
                    next += 1;
                }
                if let Err(e) = run_batch(&engine, &reqs, timeout) {
                    failure
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
                let now = unix_now();
                let w = *window.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((start, end)) = w {
                    if now >= start && now <= end {
                        counted.fetch_add(batch * block, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    // Without a window file, the window is the run itself.
    let started = Instant::now();
    if args.window_file.is_none() {
        let start = unix_now();
        *window.lock().unwrap_or_else(|p| p.into_inner()) = Some((start, start + args.duration));
    }
    let result = loop {
        // Hundreds of these may share a few cores: look rarely.
        std::thread::sleep(Duration::from_millis(100));
        if stop.load(Ordering::Relaxed) {
            break Ok(());
        }
        let w = *window.lock().unwrap_or_else(|p| p.into_inner());
        match (w, &args.window_file) {
            // A little past the end, so a process sampled at END still
            // sees every peer at work.
            (Some((_, end)), _) if unix_now() > end + LINGER_S => break Ok(()),
            (Some(_), _) => {}
            (None, Some(path)) => {
                if let Some(found) = read_window(path) {
                    *window.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
                } else if started.elapsed().as_secs_f64() > args.duration {
                    break Err(format!(
                        "no window in {} after {:.0} s (it holds START END, Unix seconds)",
                        path.display(),
                        args.duration
                    ));
                }
            }
            (None, None) => unreachable!("the window is set above without a file"),
        }
    };
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    result?;
    if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(format!("a batch failed: {e}"));
    }
    let (start, end) = window
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or((0.0, 0.0));
    let bytes = counted.load(Ordering::Relaxed);
    let report = Report {
        op: match args.op {
            Op::Read => "read",
            Op::Write => "write",
        },
        block_size: args.block_size,
        batch_size: args.batch_size,
        per_peer: args.per_peer,
        threads: args.threads,
        peers: args.segments.len(),
        served: peers.len(),
        refused,
        window_start: start,
        window_end: end,
        window_s: end - start,
        bytes,
        gb_per_s: bytes as f64 / (end - start).max(1e-9) / 1e9,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{} {} blocks over {} of {} targets ({} refused), {} per batch, {} thread(s): \
             {:.3} GB/s over {:.1} s",
            report.op,
            human_size(report.block_size),
            report.served,
            report.peers,
            report.refused.len(),
            report.batch_size,
            report.threads,
            report.gb_per_s,
            report.window_s
        );
    }
    Ok(())
}

/// Opens `name` and moves one batch of `per_peer` requests to it.
fn first_batch(
    engine: &Engine,
    name: &str,
    args: &ScaleArgs,
    local: u64,
    local_slots: u64,
    timeout: Duration,
) -> Result<Peer, String> {
    let seg = engine.open_segment(name).map_err(|e| e.to_string())?;
    let (base, len) = largest_buffer(engine, seg)?;
    let slots = len / (2 * args.block_size);
    if slots == 0 {
        return Err(format!(
            "its buffer ({}) holds no two {} blocks",
            human_size(len),
            human_size(args.block_size)
        ));
    }
    let peer = Peer { seg, base, slots };
    let reqs: Vec<Request> = (0..args.per_peer as u64)
        .map(|k| {
            let p = place(
                &[peer],
                args.per_peer as u64,
                (local, local_slots),
                args.block_size,
                k,
            );
            Request::new(args.op, p.local, p.seg, p.remote, args.block_size)
        })
        .collect();
    run_batch(engine, &reqs, timeout).map(|_| peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: u64) -> Vec<Peer> {
        (0..n)
            .map(|i| Peer {
                seg: i,
                base: 1 << 40,
                slots: 8,
            })
            .collect()
    }

    #[test]
    fn requests_go_round_the_targets_in_runs_of_per_peer() {
        let p = peers(3);
        let segs: Vec<u64> = (0..12).map(|i| place(&p, 2, (0, 4), 64, i).seg).collect();
        assert_eq!(segs, [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn no_two_requests_to_one_target_are_adjacent() {
        let p = peers(2);
        let mut remotes: Vec<u64> = (0..16)
            .map(|i| place(&p, 4, (0, 4), 64, i))
            .filter(|x| x.seg == 0)
            .map(|x| x.remote)
            .collect();
        remotes.sort();
        remotes.dedup();
        assert_eq!(remotes.len(), 8, "each slot once before wrapping");
        assert!(remotes.windows(2).all(|w| w[1] - w[0] >= 128));
    }

    #[test]
    fn local_slots_cycle_within_the_thread_share() {
        let p = peers(1);
        let locals: Vec<u64> = (0..6)
            .map(|i| place(&p, 4, (4096, 3), 64, i).local)
            .collect();
        assert_eq!(locals, [4096, 4160, 4224, 4096, 4160, 4224]);
    }
}
