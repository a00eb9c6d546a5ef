//! `ferry bench sweep`: throughput and latency against block size over
//! every usable transport (and device memory when asked), with this
//! machine's limits measured in the same run; writes sweep.json and SVG
//! plots. `ferry bench metrics-overhead`: the same engine work with metrics
//! on and off, interleaved, in one run.

use crate::plot::{self, Line};
use crate::util::{human_size, percentile};
use crate::workbench::{machine_limit, Bench, TargetChild};
use ferry_core::{Location, Op};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

pub struct SweepArgs {
    pub out: PathBuf,
    pub blocks: Vec<u64>,
    pub duration: f64,
    pub transports: Option<Vec<String>>,
    pub device: Option<Location>,
}

#[derive(Serialize)]
struct Point {
    transport: String,
    /// Where the initiator's memory is: cpu, or the device.
    memory: String,
    op: &'static str,
    block_size: u64,
    batch_size: usize,
    gb_per_s: f64,
    ops_per_s: f64,
    /// Per batch, submit to completion.
    batch_latency_us: Percentiles,
    /// gb_per_s over the limit that applies (memcpy same host; tcp loopback
    /// for tcp).
    ratio_to_limit: f64,
}

#[derive(Serialize)]
struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
}

#[derive(Serialize)]
struct Limits {
    memcpy_gb_per_s: f64,
    tcp_loopback_gb_per_s: f64,
}

const BUFFER: u64 = 256 << 20;

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
    }
}

pub fn sweep(args: SweepArgs) -> Result<(), String> {
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    eprintln!("measuring this machine's limits (memcpy, TCP loopback)...");
    let limits = Limits {
        memcpy_gb_per_s: machine_limit("memcpy-limit", &["--duration", "1"])?,
        tcp_loopback_gb_per_s: machine_limit("tcp-limit", &["--duration", "1"])?,
    };
    eprintln!(
        "memcpy {:.2} GB/s, TCP loopback {:.2} GB/s",
        limits.memcpy_gb_per_s, limits.tcp_loopback_gb_per_s
    );
    let target = TargetChild::start(BUFFER)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut points = Vec::new();
    let mut memories: Vec<(String, Option<Location>)> = vec![("cpu".into(), None)];
    if let Some(d) = args.device {
        memories.push((d.to_string(), Some(d)));
    }
    for (memory, device) in memories {
        let bench = Bench::new(&target.segment, true, BUFFER, device)?;
        let transports: Vec<String> = bench
            .engine
            .transports()
            .into_iter()
            .filter(|t| args.transports.as_ref().is_none_or(|want| want.contains(t)))
            .collect();
        for t in &transports {
            // Device memory: the engine chooses (a host transport stages it).
            let hint = device.is_none().then_some(t.as_str());
            if let Err(e) = bench.usable(t) {
                eprintln!("{t}: not usable with this peer ({e}); skipped");
                continue;
            }
            if device.is_some() && t != &transports[0] {
                continue;
            }
            let label = if device.is_some() {
                "auto".to_string()
            } else {
                t.clone()
            };
            for op in [Op::Write, Op::Read] {
                for &block in &args.blocks {
                    let batch = bench.batch_fits(block, 256);
                    if batch == 0 {
                        continue;
                    }
                    let m = bench.run(op, hint, block, batch, duration)?;
                    let limit = if t == "tcp" {
                        limits.tcp_loopback_gb_per_s
                    } else {
                        limits.memcpy_gb_per_s
                    };
                    let p = Point {
                        transport: label.clone(),
                        memory: memory.clone(),
                        op: op_name(op),
                        block_size: block,
                        batch_size: batch,
                        gb_per_s: m.gb_per_s(),
                        ops_per_s: m.bytes as f64 / block as f64 / m.secs,
                        batch_latency_us: Percentiles {
                            p50: m.p(0.5),
                            p90: m.p(0.9),
                            p99: m.p(0.99),
                        },
                        ratio_to_limit: m.gb_per_s() / limit,
                    };
                    eprintln!(
                        "{:>4} {:>5} {:>5} {:>8} x {:<3} {:7.3} GB/s ({:.2} of limit) {:9.0} ops/s  batch p50 {:8.1} us p99 {:8.1} us",
                        p.transport,
                        p.memory,
                        p.op,
                        human_size(block),
                        batch,
                        p.gb_per_s,
                        p.ratio_to_limit,
                        p.ops_per_s,
                        p.batch_latency_us.p50,
                        p.batch_latency_us.p99
                    );
                    points.push(p);
                }
            }
        }
    }
    let json = serde_json::json!({
        "limits": limits,
        "duration_s": args.duration,
        "points": points,
        "metrics": bench_metrics_note(),
    });
    let json_path = args.out.join("sweep.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", json_path.display()))?;

    // One line per transport, memory and op.
    let mut lines: Vec<Line> = Vec::new();
    let mut lat_lines: Vec<Line> = Vec::new();
    for p in &points {
        let name = if p.memory == "cpu" {
            format!("{} {}", p.transport, p.op)
        } else {
            format!("{} {} ({})", p.transport, p.op, p.memory)
        };
        let find = |ls: &mut Vec<Line>| -> usize {
            match ls.iter().position(|l| l.name == name) {
                Some(i) => i,
                None => {
                    ls.push(Line {
                        name: name.clone(),
                        points: Vec::new(),
                    });
                    ls.len() - 1
                }
            }
        };
        let i = find(&mut lines);
        lines[i].points.push((p.block_size, p.gb_per_s));
        let i = find(&mut lat_lines);
        lat_lines[i]
            .points
            .push((p.block_size, p.batch_latency_us.p50 / p.batch_size as f64));
    }
    let limits_drawn = [
        (
            format!("memcpy limit {:.1} GB/s", limits.memcpy_gb_per_s),
            limits.memcpy_gb_per_s,
        ),
        (
            format!(
                "TCP loopback limit {:.1} GB/s",
                limits.tcp_loopback_gb_per_s
            ),
            limits.tcp_loopback_gb_per_s,
        ),
    ];
    let throughput = args.out.join("throughput.svg");
    plot::block_size_chart(
        &throughput,
        "Ferry: throughput vs block size",
        "GB/s",
        &lines,
        &limits_drawn,
        false,
    )?;
    let latency = args.out.join("latency.svg");
    plot::block_size_chart(
        &latency,
        "Ferry: batch latency per request (p50) vs block size",
        "us per request",
        &lat_lines,
        &[],
        true,
    )?;
    println!(
        "wrote {}, {} and {}",
        json_path.display(),
        throughput.display(),
        latency.display()
    );
    Ok(())
}

fn bench_metrics_note() -> &'static str {
    "batches of up to 256 requests, each followed by a gap of its own size (no coalescing); one thread; metrics on"
}

pub struct OverheadArgs {
    pub rounds: usize,
    pub duration: f64,
    pub transports: Vec<String>,
}

/// Throughput with metrics on and off, taking turns (on first in even
/// rounds, off first in odd ones) on one engine against one target: the
/// same connections and buffers, only counting differs.
pub fn metrics_overhead(args: OverheadArgs) -> Result<(), String> {
    let target = TargetChild::start(BUFFER)?;
    let bench = Bench::new(&target.segment, true, BUFFER, None)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut results = Vec::new();
    let cost_ns = metrics_cost_ns();
    println!(
        "metrics cost per submission (flow lookup, tally, completion), measured alone: {cost_ns:.0} ns, \
         and one read of the metrics' clock (once per hand-over): {:.0} ns",
        clock_read_ns()
    );
    println!("| transport | op | block x batch | metrics on GB/s | off GB/s | on/off, all rounds | on/off, median of rounds | on/off, bytes per CPU second | cost per request / request time |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for t in &args.transports {
        if let Err(e) = bench.usable(t) {
            eprintln!("{t}: not usable ({e}); skipped");
            continue;
        }
        for op in [Op::Write, Op::Read] {
            for (block, batch) in [(4u64 << 10, 256usize), (1 << 20, 32)] {
                let (mut on_b, mut on_s, mut off_b, mut off_s) = (0u64, 0f64, 0u64, 0f64);
                let (mut on_cpu, mut off_cpu) = (0f64, 0f64);
                let mut ratios = Vec::new();
                // Warm up (connections, page faults) before counting.
                bench.run(op, Some(t), block, batch, duration / 2)?;
                for r in 0..args.rounds {
                    let order = if r % 2 == 0 {
                        [true, false]
                    } else {
                        [false, true]
                    };
                    let mut pair = [0f64; 2];
                    for on in order {
                        bench.engine.set_metrics_enabled(on);
                        let m = bench.run(op, Some(t), block, batch, duration)?;
                        pair[on as usize] = m.gb_per_s();
                        if on {
                            on_b += m.bytes;
                            on_s += m.secs;
                            on_cpu += m.cpu_secs;
                        } else {
                            off_b += m.bytes;
                            off_s += m.secs;
                            off_cpu += m.cpu_secs;
                        }
                    }
                    ratios.push(pair[1] / pair[0]);
                }
                bench.engine.set_metrics_enabled(true);
                ratios.sort_by(|a, b| a.total_cmp(b));
                let median = percentile(&ratios, 0.5);
                let (g_on, g_off) = (on_b as f64 / on_s / 1e9, off_b as f64 / off_s / 1e9);
                // Time of one request with metrics off, and the share the
                // metrics path would add to it.
                let request_ns = block as f64 / g_off;
                let per_cpu = (on_b as f64 / on_cpu) / (off_b as f64 / off_cpu);
                println!(
                    "| {t} | {} | {} x {batch} | {g_on:.3} | {g_off:.3} | {:.3} | {median:.3} | {per_cpu:.3} | {:.4} |",
                    op_name(op),
                    human_size(block),
                    g_on / g_off,
                    cost_ns / request_ns
                );
                results.push(serde_json::json!({
                    "transport": t, "op": op_name(op), "block_size": block, "batch_size": batch,
                    "metrics_on_gb_per_s": g_on, "metrics_off_gb_per_s": g_off,
                    "ratio": g_on / g_off, "median_round_ratio": median,
                    "per_cpu_second_ratio": per_cpu,
                    "metrics_cost_ns": cost_ns, "request_ns": request_ns,
                    "rounds": args.rounds, "round_s": args.duration,
                }));
            }
        }
    }
    eprintln!("{}", serde_json::to_string(&results).unwrap_or_default());
    Ok(())
}

/// What one read of the metrics' clock costs, the best of many short runs.
fn clock_read_ns() -> f64 {
    use ferry_core::metrics::Stamp;
    const N: u32 = 25_600;
    let mut best = f64::MAX;
    for _ in 0..200 {
        let started = std::time::Instant::now();
        for _ in 0..N {
            std::hint::black_box(Stamp::now());
        }
        best = best.min(started.elapsed().as_nanos() as f64 / N as f64);
    }
    best
}

/// What the metrics path costs one submission, timed alone on this
/// thread as dispatch does it for a batch of 256: the flow (looked up once
/// per batch), the tally and its completion (a clock read, a few relaxed
/// atomic adds).
fn metrics_cost_ns() -> f64 {
    use ferry_core::metrics::{BatchTally, FlowCache, FlowKey, FlowLabels, Metrics, Stamp, Tally};
    let m = Metrics::new(true, Default::default());
    let key = FlowKey {
        transport: 0,
        segment: 1,
        op: 1,
        location: Location::Cpu(0),
        mem_kind: 1,
    };
    let labels = || FlowLabels {
        transport: "tcp".into(),
        device: "cpu:0".into(),
        peer: "peer".into(),
        op: "write",
        memory: "host",
    };
    const N: u32 = 25_600;
    // Short runs, the best of many: on a shared machine most long runs
    // are preempted somewhere.
    let mut best = f64::MAX;
    let mut groups = Vec::with_capacity(256);
    for _ in 0..200 {
        let started = std::time::Instant::now();
        // As batches of 256 go: the flow found once per batch, each
        // request tallied when handed over and when it finishes, the
        // hand-over timed and the counts added to the flow at the end.
        for _ in 0..N / 256 {
            let mut cache = FlowCache::default();
            let mut batch = BatchTally::default();
            let submitted = Stamp::now();
            groups.clear();
            for _ in 0..256 {
                if let Some(flow) = m.cached_flow(&mut cache, key, labels) {
                    groups.push(batch.add(Tally {
                        flow,
                        bytes: 4096,
                        started: submitted,
                    }));
                }
            }
            let last = groups.len().saturating_sub(1);
            for (i, g) in groups.iter().enumerate() {
                batch.finish(*g, 1, None, i == last);
            }
        }
        best = best.min(started.elapsed().as_nanos() as f64 / N as f64);
    }
    best
}
