//! `ferry bench`: throughput, ops/s and latency percentiles between two
//! engines, shaped like Mooncake's transfer_engine_bench, and the machine's
//! own limits measured the same way (`tcp-limit`, in tcp_limit.rs).

use crate::limits::{device_to_device, memcpy_run, WORKING_SET};
use crate::util::{human_size, percentile, Buffer};
use ferry_core::{BatchStatus, Engine, EngineConfig, Location, Op, Request, SegmentId};
use serde::Serialize;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct TargetArgs {
    pub listen: Option<String>,
    pub buffer_size: u64,
    pub duration: Option<f64>,
    /// Serve memory the engine allocates (shareable by same-host transports)
    /// instead of plain application memory.
    pub allocate: bool,
    /// Serve device memory instead.
    pub device: Option<Location>,
    /// Block sizes to publish a layout of the whole buffer for (kv pattern).
    pub layout_blocks: Vec<u64>,
}

pub fn target(args: TargetArgs) -> Result<(), String> {
    let mut config = EngineConfig::from_env().map_err(|e| e.to_string())?;
    if let Some(l) = args.listen {
        config.listen = l;
    }
    let engine = Engine::new(config).map_err(|e| e.to_string())?;
    // Device memory, the engine's own memory, or plain application memory.
    let (addr, _buffer) = if let Some(loc) = args.device {
        let a = engine
            .allocate_device(loc, args.buffer_size)
            .map_err(|e| e.to_string())?;
        engine
            .register_memory(a, args.buffer_size, None)
            .map_err(|e| e.to_string())?;
        (a, None)
    } else if args.allocate {
        let a = engine
            .allocate_memory(args.buffer_size, None)
            .map_err(|e| e.to_string())?;
        (a, None)
    } else {
        let buffer = Buffer::new(args.buffer_size as usize)?;
        engine
            .register_memory(buffer.addr(), args.buffer_size, None)
            .map_err(|e| e.to_string())?;
        (buffer.addr(), Some(buffer))
    };
    let layouts = crate::bench_kv::register_target_layouts(
        &engine,
        addr,
        args.buffer_size,
        &args.layout_blocks,
    )?;
    // One write: callers that read only the first line may close the pipe
    // right after it.
    let _ = std::io::stdout()
        .write_all(format!("segment {}\n{layouts}", engine.segment_name()).as_bytes());
    let _ = std::io::stdout().flush();
    eprintln!(
        "ferry bench target: serving {} of {} memory at {}; transports: {}. Stop with Ctrl-C.",
        human_size(args.buffer_size),
        match (args.device, args.allocate) {
            (Some(loc), _) => format!("{loc} device"),
            (None, true) => "engine-allocated".into(),
            (None, false) => "application".into(),
        },
        engine.segment_name(),
        engine.transports().join(", ")
    );
    let started = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        if args
            .duration
            .is_some_and(|d| started.elapsed().as_secs_f64() > d)
        {
            return Ok(());
        }
    }
}

pub struct InitiatorArgs {
    pub segment: String,
    pub op: Op,
    pub block_size: u64,
    pub batch_size: usize,
    pub threads: usize,
    pub duration: f64,
    pub json: bool,
    pub transport: Option<String>,
    /// Local buffers in device memory instead of host memory.
    pub device: Option<Location>,
}

#[derive(Serialize)]
struct Latency {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    samples: usize,
}

#[derive(Serialize)]
struct Report {
    op: &'static str,
    transport: String,
    block_size: u64,
    batch_size: usize,
    threads: usize,
    duration_s: f64,
    bytes: u64,
    gb_per_s: f64,
    ops_per_s: f64,
    /// Per request: from its batch's submission to the batch's completion.
    latency_us: Latency,
}

pub fn initiator(args: InitiatorArgs) -> Result<(), String> {
    if args.block_size == 0 || args.batch_size == 0 || args.threads == 0 {
        return Err("--block-size, --batch-size and --threads must be positive".into());
    }
    let engine = Arc::new(
        Engine::new(EngineConfig::from_env().map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?,
    );
    let seg = engine
        .open_segment(&args.segment)
        .map_err(|e| e.to_string())?;
    let remote = largest_buffer(&engine, seg)?;
    // Each thread works in its own slice of the remote buffer, cycling
    // through it; its local buffer holds one batch.
    let window = remote.1 / args.threads as u64;
    let per_batch = args.block_size * args.batch_size as u64;
    if window < args.block_size {
        return Err(format!(
            "the target's buffer ({}) is too small for {} threads of {} blocks",
            human_size(remote.1),
            args.threads,
            human_size(args.block_size)
        ));
    }
    // Each batch moves on through the remote window and through a local
    // buffer of at least WORKING_SET, so transfers touch memory, not cache,
    // like the memcpy limit they are compared with.
    let slots = (window / args.block_size).max(1);
    let local_slots = (per_batch.max(WORKING_SET) / args.block_size)
        .min(slots)
        .max(1);
    let local_len = local_slots * args.block_size;
    let local_total = local_len * args.threads as u64;
    let host_local = Buffer::new(local_total as usize)?;
    let local_addr = match args.device {
        Some(loc) => engine
            .allocate_device(loc, local_total)
            .map_err(|e| e.to_string())?,
        None => host_local.addr(),
    };
    engine
        .register_memory(local_addr, local_total, None)
        .map_err(|e| e.to_string())?;
    // Device memory is staged through host memory: report the host route.
    let transport = match engine.route(seg, local_addr, remote.0, args.block_size) {
        Ok(route) => args.transport.clone().unwrap_or(route.transport),
        Err(_) if args.device.is_some() => {
            let _ = engine.register_memory(host_local.addr(), local_total, None);
            let t = engine
                .route(seg, host_local.addr(), remote.0, args.block_size)
                .map(|r| r.transport)
                .unwrap_or_else(|_| "?".into());
            format!("{t}+staging")
        }
        Err(e) => return Err(e.to_string()),
    };

    // One untimed batch first: connecting, and mapping the peer's memory
    // (shm maps a whole allocation once), are not part of the figure.
    let warm: Vec<Request> = (0..(args.batch_size as u64).min(slots))
        .map(|k| {
            let mut r = Request::new(
                args.op,
                local_addr + (k % local_slots) * args.block_size,
                seg,
                remote.0 + k * args.block_size,
                args.block_size,
            );
            r.transport = args.transport.as_deref().map(Into::into);
            r
        })
        .collect();
    run_batch(&engine, &warm, engine.config().timeout * 2)
        .map_err(|e| format!("the first batch failed: {e}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::<f64>::new()));
    let failure: Arc<Mutex<Option<String>>> = Arc::default();
    let started = Instant::now();
    let mut workers = Vec::new();
    for t in 0..args.threads as u64 {
        let hint: Option<Arc<str>> = args.transport.as_deref().map(Into::into);
        let (op, block) = (args.op, args.block_size);
        let (local_base, remote_base) = (local_addr + t * local_len, remote.0 + t * window);
        let batch_size = args.batch_size as u64;
        // Batch n's addresses, written into the same requests every time:
        // the timed loop allocates nothing of its own.
        let place = move |n: u64, reqs: &mut [Request]| {
            for (i, r) in (0u64..).zip(reqs.iter_mut()) {
                let k = n * batch_size + i;
                r.local_addr = local_base + (k % local_slots) * block;
                r.remote_addr = remote_base + (k % slots) * block;
            }
        };
        let mut reqs: Vec<Request> = (0..batch_size)
            .map(|_| {
                let mut r = Request::new(op, local_base, seg, remote_base, block);
                r.transport = hint.clone();
                r
            })
            .collect();
        let (engine, stop, bytes, latencies, failure) = (
            engine.clone(),
            stop.clone(),
            bytes.clone(),
            latencies.clone(),
            failure.clone(),
        );
        let timeout = engine.config().timeout * 2;
        workers.push(std::thread::spawn(move || {
            let mut mine = Vec::with_capacity(1 << 16);
            let batch_bytes = block * batch_size;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                place(n, &mut reqs);
                n += 1;
                let result = run_batch(&engine, &reqs, timeout);
                match result {
                    Ok(elapsed) => {
                        mine.push(elapsed.as_secs_f64() * 1e6);
                        bytes.fetch_add(batch_bytes, Ordering::Relaxed);
                    }
                    Err(e) => {
                        failure
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
            latencies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(mine);
        }));
    }
    let mut last = (Instant::now(), 0u64);
    while started.elapsed().as_secs_f64() < args.duration && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100).min(Duration::from_secs_f64(
            (args.duration - started.elapsed().as_secs_f64()).max(0.0),
        )));
        if last.0.elapsed() >= Duration::from_secs(1) {
            let now = bytes.load(Ordering::Relaxed);
            let dt = last.0.elapsed().as_secs_f64();
            eprintln!(
                "  {:5.1} s  {:7.3} GB/s  {:9.0} ops/s",
                started.elapsed().as_secs_f64(),
                (now - last.1) as f64 / dt / 1e9,
                (now - last.1) as f64 / args.block_size as f64 / dt
            );
            last = (Instant::now(), now);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(format!("a batch failed: {e}"));
    }
    // The automatic choice may have moved as the engine measured: report
    // the route it ended on.
    let transport = match (&args.transport, args.device) {
        (None, None) => engine
            .route(seg, local_addr, remote.0, args.block_size)
            .map(|r| r.transport)
            .unwrap_or(transport),
        _ => transport,
    };
    let total = bytes.load(Ordering::Relaxed);
    let mut lat = std::mem::take(&mut *latencies.lock().unwrap_or_else(|p| p.into_inner()));
    lat.sort_by(|a, b| a.total_cmp(b));
    let report = Report {
        op: match args.op {
            Op::Read => "read",
            Op::Write => "write",
        },
        transport,
        block_size: args.block_size,
        batch_size: args.batch_size,
        threads: args.threads,
        duration_s: elapsed,
        bytes: total,
        gb_per_s: total as f64 / elapsed / 1e9,
        ops_per_s: total as f64 / args.block_size as f64 / elapsed,
        latency_us: Latency {
            p50: percentile(&lat, 0.5),
            p90: percentile(&lat, 0.9),
            p99: percentile(&lat, 0.99),
            max: lat.last().copied().unwrap_or(0.0),
            samples: lat.len(),
        },
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{} {} x {} per batch, {} thread(s), over {}: {:.3} GB/s, {:.0} ops/s, \
             latency p50 {:.1} us p90 {:.1} us p99 {:.1} us",
            report.op,
            human_size(report.block_size),
            report.batch_size,
            report.threads,
            report.transport,
            report.gb_per_s,
            report.ops_per_s,
            report.latency_us.p50,
            report.latency_us.p90,
            report.latency_us.p99
        );
    }
    Ok(())
}

/// The largest buffer the peer behind `seg` registered: (address, length).
pub(crate) fn largest_buffer(engine: &Engine, seg: SegmentId) -> Result<(u64, u64), String> {
    engine
        .descriptor_of(seg)
        .map_err(|e| e.to_string())?
        .buffers
        .iter()
        .max_by_key(|b| b.len)
        .map(|b| (b.addr, b.len))
        .ok_or_else(|| "the target registered no memory".to_string())
}

/// Submits `reqs` as one batch and waits for all of it: the time it took,
/// or the first failure (a request's error, or requests still pending
/// after `timeout`).
pub(crate) fn run_batch(
    engine: &Engine,
    reqs: &[Request],
    timeout: Duration,
) -> Result<Duration, String> {
    let t0 = Instant::now();
    let batch = engine
        .allocate_batch(reqs.len())
        .map_err(|e| e.to_string())?;
    let status: Result<BatchStatus, String> = engine
        .submit(batch, reqs)
        .and_then(|_| engine.wait(batch, timeout))
        .map_err(|e| e.to_string());
    let elapsed = t0.elapsed();
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            let _ = engine.wait(batch, timeout);
            let _ = engine.free_batch(batch);
            return Err(e);
        }
    };
    if !status.is_done() {
        return Err(format!(
            "{} requests still pending after {timeout:?}",
            status.pending
        ));
    }
    let _ = engine.free_batch(batch);
    match status.first_error {
        Some((i, e)) => Err(format!("request {i}: {e}")),
        None => Ok(elapsed),
    }
}

/// memcpy bandwidth at one block size: the limit a same-host transport is
/// compared with, on one thread and on `threads` threads in the same run
/// (each copying its own slice, all at once). Copies a working set (64 MiB
/// per thread, at most 1 GiB, and never less than one block) so that large
/// blocks do not all sit in cache, in `block` pieces for `duration` each.
pub fn memcpy_limit(block: u64, duration: f64, threads: usize, json: bool) -> Result<(), String> {
    if block == 0 || threads == 0 || threads > 1024 {
        return Err("--block must be positive and --threads from 1 to 1024".into());
    }
    let single = memcpy_run(block as usize, duration, 1)?;
    let multi = if threads > 1 {
        memcpy_run(block as usize, duration, threads)?
    } else {
        single
    };
    if json {
        println!(
            "{}",
            serde_json::json!({"limit": "memcpy", "block_size": block, "gb_per_s": single,
                "threads": threads, "threads_gb_per_s": multi})
        );
    } else {
        println!(
            "memcpy of {} blocks: {single:.2} GB/s on 1 thread, {multi:.2} GB/s on {threads}",
            human_size(block)
        );
    }
    Ok(())
}

/// Pinned host <-> device copy bandwidth of `device`, through its plugin:
/// the limit staged transfers are compared with.
pub fn device_limit(
    device: Location,
    block: u64,
    duration: f64,
    dtod: Option<u64>,
    json: bool,
) -> Result<(), String> {
    let engine = Engine::new(EngineConfig::from_env().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let total = WORKING_SET.max(block);
    let host = engine.allocate_pinned(total).map_err(|e| e.to_string())?;
    let dev = engine
        .allocate_device(device, total)
        .map_err(|e| e.to_string())?;
    let mut results = Vec::new();
    for (name, to_device) in [("host_to_device", true), ("device_to_host", false)] {
        let started = Instant::now();
        let mut bytes = 0u64;
        while started.elapsed().as_secs_f64() < duration {
            let copies: Vec<(u64, u64, u64)> = (0..total / block)
                .map(|i| {
                    let off = i * block;
                    if to_device {
                        (dev + off, host + off, block)
                    } else {
                        (host + off, dev + off, block)
                    }
                })
                .collect();
            // SAFETY: host and dev are allocations of `total` bytes made above.
            unsafe { engine.copy_batch(device, &copies) }.map_err(|e| e.to_string())?;
            bytes += total;
        }
        results.push((name, bytes as f64 / started.elapsed().as_secs_f64() / 1e9));
    }
    let _ = engine.free_device(dev);
    engine.free_pinned(host);
    let d2d = match dtod {
        Some(size) => Some(device_to_device(&engine, device, size, duration)?),
        None => None,
    };
    if json {
        let mut v = serde_json::json!({"limit": "pinned-copy", "device": device.to_string(), "block_size": block,
            "host_to_device_gb_per_s": results[0].1, "device_to_host_gb_per_s": results[1].1});
        if let (Some(g), Some(size)) = (d2d, dtod) {
            v["device_to_device_gb_per_s"] = serde_json::json!(g);
            v["device_to_device_size"] = serde_json::json!(size);
        }
        println!("{v}");
    } else {
        println!(
            "{device}: pinned host -> device {:.2} GB/s, device -> host {:.2} GB/s ({} copies)",
            results[0].1,
            results[1].1,
            human_size(block)
        );
        if let (Some(g), Some(size)) = (d2d, dtod) {
            println!(
                "{device}: device -> device {g:.2} GB/s ({} copies on the device)",
                human_size(size)
            );
        }
    }
    Ok(())
}

/// Checks a device end to end through the engine: allocation, pointer
/// classification, DMA-BUF export, pinned memory, copies with a checksum.
pub fn device_check(device: Location) -> Result<(), String> {
    let engine = Engine::new(EngineConfig::from_env().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let Some(gpu) = engine.gpus().iter().find(|g| g.location == device) else {
        return Err(format!(
            "no {device}: the engines sees {} device(s); `ferry info` says why",
            engine.gpus().len()
        ));
    };
    println!(
        "{device}: {} at PCI {} (uuid {}), {} of memory, GPUDirect RDMA {:?}, DMA-BUF {:?}",
        gpu.info.name,
        gpu.info.pci_bus_id,
        gpu.info.uuid,
        human_size(gpu.info.total_memory),
        gpu.info.gpu_direct_rdma,
        gpu.info.dmabuf
    );
    let len: u64 = 64 << 20;
    let dev = engine
        .allocate_device(device, len)
        .map_err(|e| e.to_string())?;
    engine
        .register_memory(dev, len, None)
        .map_err(|e| e.to_string())?;
    let d = engine.descriptor();
    let registered = d
        .buffers
        .iter()
        .find(|b| b.addr == dev)
        .map(|b| b.location.clone());
    println!(
        "registered {} of device memory at {dev:#x}: location {}",
        human_size(len),
        registered.unwrap_or_default()
    );
    let exported = engine.export_dmabuf(dev, len);
    let export_failed = exported.is_err() && gpu.info.dmabuf == Some(true);
    match exported {
        Ok((fd, offset)) => {
            use std::os::fd::AsRawFd;
            // SAFETY: fstat on the fd we own, into a zeroed stat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstat on the fd we own, writing into `st`, a valid stat.
            let size = if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 {
                st.st_size
            } else {
                -1
            };
            println!(
                "DMA-BUF exported: fd {} for {} bytes at offset {offset} (the fd's size: {size})",
                fd.as_raw_fd(),
                len
            );
        }
        Err(e) => println!("DMA-BUF export failed: {e}"),
    }
    let mut pattern = Buffer::new(len as usize)?;
    crate::util::fill_pattern(pattern.as_mut_slice(), 42);
    let want = crate::util::crc32(pattern.as_slice());
    let back = Buffer::new(len as usize)?;
    // SAFETY: all three ranges are `len`-byte allocations of this process.
    unsafe {
        engine
            .copy_memory(dev, pattern.addr(), len)
            .map_err(|e| e.to_string())?;
        engine
            .copy_memory(back.addr(), dev, len)
            .map_err(|e| e.to_string())?;
    }
    let got = crate::util::crc32(back.as_slice());
    println!(
        "host -> {device} -> host copy: crc32 {got:08x} {} {want:08x}",
        if got == want { "==" } else { "!=" }
    );
    let _ = engine.unregister_memory(dev);
    let _ = engine.free_device(dev);
    if got != want {
        Err("the copy through the device changed the data".into())
    } else if export_failed {
        Err("the GPU supports DMA-BUF but the export failed".into())
    } else {
        Ok(())
    }
}

/// The RDMA plugin's GPU memory path up to where a NIC is needed: device
/// memory is allocated, exported as DMA-BUF by the device plugin and
/// registered with ibv_reg_dmabuf_mr on every NIC the rdma plugin uses
/// (on a host without RDMA NICs, run it against the verbs emulator: see
/// tests/gpu/run.sh). A write from that memory to a host buffer follows; it
/// moves data where the NIC (or the emulator) can reach the GPU memory and
/// fails cleanly where it cannot. Succeeds when the DMA-BUF registration did.
pub fn rdma_check(device: Location) -> Result<(), String> {
    let config = || EngineConfig::from_env().map_err(|e| e.to_string());
    let engine = Engine::new(config()?).map_err(|e| e.to_string())?;
    if !engine.transports().iter().any(|t| t == "rdma") {
        let why = engine
            .plugins()
            .plugins
            .iter()
            .find(|p| p.report.name == "rdma")
            .map(|p| p.report.reason.clone())
            .or_else(|| {
                engine
                    .transport_failures()
                    .iter()
                    .find(|(n, _)| n == "rdma")
                    .map(|(_, e)| e.to_string())
            })
            .unwrap_or_else(|| "no rdma plugin was found".into());
        return Err(format!("the rdma transport is not running: {why}"));
    }
    let Some(gpu) = engine.gpus().iter().find(|g| g.location == device) else {
        return Err(format!(
            "no {device}: the engine sees {} device(s); `ferry info` says why",
            engine.gpus().len()
        ));
    };
    println!(
        "{device}: {} at PCI {}, GPUDirect RDMA {:?}, DMA-BUF {:?}",
        gpu.info.name, gpu.info.pci_bus_id, gpu.info.gpu_direct_rdma, gpu.info.dmabuf
    );
    println!(
        "decision for {device} memory: {}",
        engine.gpu_direct(device).unwrap_or_else(|| "none".into())
    );
    let len: u64 = 64 << 20;
    let dev = engine
        .allocate_device(device, len)
        .map_err(|e| e.to_string())?;
    engine
        .register_memory(dev, len, None)
        .map_err(|e| e.to_string())?;
    let how: Vec<String> = engine
        .registrations(dev)
        .map_err(|e| e.to_string())?
        .iter()
        .map(|(t, kind)| format!("{t} as {kind}"))
        .collect();
    let dmabuf = engine
        .registrations(dev)
        .map_err(|e| e.to_string())?
        .iter()
        .any(|(_, kind)| kind == "cuda-dmabuf");
    println!(
        "registered {} of {device} memory at {dev:#x}: {}",
        human_size(len),
        if how.is_empty() {
            "no transport registered it directly (staged)".to_string()
        } else {
            how.join("; ")
        }
    );
    // A write from the GPU to host memory of a second engine.
    let target = Engine::new(config()?).map_err(|e| e.to_string())?;
    let host = Buffer::new(len as usize)?;
    target
        .register_memory(host.addr(), len, None)
        .map_err(|e| e.to_string())?;
    let mut pattern = Buffer::new(len as usize)?;
    crate::util::fill_pattern(pattern.as_mut_slice(), 7);
    // SAFETY: pattern and dev are `len`-byte allocations of this process.
    unsafe { engine.copy_memory(dev, pattern.addr(), len) }.map_err(|e| e.to_string())?;
    let seg = engine
        .open_segment(target.segment_name())
        .map_err(|e| e.to_string())?;
    let moved = engine.transfer_sync(&[Request::new(Op::Write, dev, seg, host.addr(), len)]);
    let verified = match &moved {
        Ok(()) => {
            let ok = crate::util::crc32(host.as_slice()) == crate::util::crc32(pattern.as_slice());
            println!(
                "write {device} -> host over rdma: {}",
                if ok {
                    "every byte arrived"
                } else {
                    "DATA DIFFERS"
                }
            );
            ok
        }
        Err(e) => {
            println!(
                "write {device} -> host over rdma failed, as it must where no NIC can reach GPU \
                 memory (the verbs emulator cannot map a real GPU's DMA-BUF): {e}"
            );
            true
        }
    };
    let _ = engine.unregister_memory(dev);
    let _ = engine.free_device(dev);
    if !dmabuf {
        Err(format!(
            "{device} memory was not registered by DMA-BUF through rdma"
        ))
    } else if !verified {
        Err("the write arrived with different data".into())
    } else {
        Ok(())
    }
}
