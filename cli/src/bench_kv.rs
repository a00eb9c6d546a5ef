//! `ferry bench initiator --pattern kv`: KV-cache-shaped batches. Each batch
//! moves N blocks of S bytes from shuffled local blocks to shuffled remote
//! blocks (a fixed-seed sample per batch, so no two neighbours coalesce by
//! accident), either as one block-layout transfer (`submit_blocks`, the
//! arrays a serving stack's block table gives) or as N requests (the list
//! API). Reports GB/s, blocks/s, batch latency, the CPU time of the submit
//! call alone, and the same run's contiguous copy of the batch's bytes as
//! the limit (device to device with `--device`, memcpy for host memory).

use crate::limits::{device_to_device, memcpy_run, scattered_memcpy, WORKING_SET};
use crate::util::{fill_pattern, human_size, percentile, Buffer};
use ferry_core::{BlockLayout, BlockTransfer, Engine, EngineConfig, LayoutId, Location, Op};
use ferry_core::{Request, SegmentId};
use serde::Serialize;
use std::time::{Duration, Instant};

/// How the initiator hands a batch to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvApi {
    /// One `submit_blocks` of two index arrays per batch.
    Layout,
    /// N requests of addresses per batch (the list API).
    Requests,
}

impl KvApi {
    fn name(self) -> &'static str {
        match self {
            KvApi::Layout => "layout",
            KvApi::Requests => "requests",
        }
    }
}

pub struct KvArgs {
    pub segment: String,
    pub op: Op,
    pub block_size: u64,
    /// Blocks per batch; else `batch_bytes / block_size`.
    pub blocks: Option<u64>,
    pub batch_bytes: Option<u64>,
    pub api: KvApi,
    pub duration: f64,
    pub json: bool,
    pub transport: Option<String>,
    pub device: Option<Location>,
    /// Write a pattern, read it back by other pairs, compare, before timing.
    pub verify: bool,
}

/// Batches of distinct index samples cycled through: enough that a batch
/// does not reuse its predecessor's placement, few enough to build up
/// front (the timed loop allocates nothing for addresses).
const PLACEMENTS: u64 = 4;

const DEFAULT_BATCH_BYTES: u64 = 256 << 20;

/// xorshift64*: reproducible, and enough for shuffling.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        // The high bits of the product, scaled: no modulo bias worth naming.
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) as u128 * n as u128) >> 64) as u64
    }
}

/// `n` distinct indices out of `0..pool`, in random order (a partial
/// Fisher-Yates shuffle, seeded).
pub(crate) fn sample(pool: u64, n: u64, seed: u64) -> Vec<u64> {
    let mut all: Vec<u64> = (0..pool).collect();
    let mut rng = Rng::new(seed);
    for i in 0..n.min(pool) {
        let j = i + rng.below(pool - i);
        all.swap(i as usize, j as usize);
    }
    all.truncate(n as usize);
    all
}

/// Where a pool of blocks lives, on either side.
#[derive(Clone, Copy)]
struct Pool {
    /// A layout of blocks of the benchmark's size, when one is registered.
    layout: Option<LayoutId>,
    base: u64,
    stride: u64,
    count: u64,
}

impl Pool {
    fn addr(&self, id: u64) -> u64 {
        self.base + id * self.stride
    }
}

/// One batch's placement: local block `local[i]` <-> remote block `remote[i]`.
struct Placement {
    local: Vec<u64>,
    remote: Vec<u64>,
    /// The same as requests, for the list API.
    requests: Vec<Request>,
}

struct Bench<'a> {
    engine: &'a Engine,
    seg: SegmentId,
    api: KvApi,
    block: u64,
    local: Pool,
    remote: Pool,
    transport: Option<&'a str>,
    timeout: Duration,
}

impl Bench<'_> {
    fn requests(&self, op: Op, local: &[u64], remote: &[u64]) -> Vec<Request> {
        let hint: Option<std::sync::Arc<str>> = self.transport.map(Into::into);
        local
            .iter()
            .zip(remote)
            .map(|(&l, &r)| {
                let mut q = Request::new(
                    op,
                    self.local.addr(l),
                    self.seg,
                    self.remote.addr(r),
                    self.block,
                );
                q.transport = hint.clone();
                q
            })
            .collect()
    }

    /// One batch, waited for: (time of the submit call, time to completion).
    fn run(
        &self,
        op: Op,
        local: &[u64],
        remote: &[u64],
        requests: &[Request],
    ) -> Result<(Duration, Duration), String> {
        let t0 = Instant::now();
        let batch = self
            .engine
            .allocate_batch(local.len())
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        let submitted = match (self.api, self.local.layout, self.remote.layout) {
            (KvApi::Layout, Some(l), Some(r)) => self.engine.submit_blocks(
                batch,
                &BlockTransfer {
                    op,
                    segment: self.seg,
                    local: l,
                    local_ids: local,
                    remote: r,
                    remote_ids: remote,
                    transport: self.transport,
                },
            ),
            _ => self.engine.submit(batch, requests),
        };
        let submit = t1.elapsed();
        let status = submitted
            .and_then(|()| self.engine.wait(batch, self.timeout))
            .map_err(|e| e.to_string());
        let elapsed = t0.elapsed();
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                let _ = self.engine.wait(batch, self.timeout);
                let _ = self.engine.free_batch(batch);
                return Err(e);
            }
        };
        if !status.is_done() {
            return Err(format!(
                "{} of {} blocks still pending after {:?}",
                status.pending,
                local.len(),
                self.timeout
            ));
        }
        let _ = self.engine.free_batch(batch);
        match status.first_error {
            Some((i, e)) => Err(format!("block {i}: {e}")),
            None => Ok((submit, elapsed)),
        }
    }
}

/// The local side's memory: host memory here, or device memory with a
/// host buffer to fill and inspect it through.
struct Local<'a> {
    engine: &'a Engine,
    host: Option<Buffer>,
    device: Option<u64>,
    addr: u64,
    len: u64,
}

impl<'a> Local<'a> {
    fn new(engine: &'a Engine, device: Option<Location>, len: u64) -> Result<Local<'a>, String> {
        let (host, dev, addr) = match device {
            Some(loc) => {
                let a = engine
                    .allocate_device(loc, len)
                    .map_err(|e| e.to_string())?;
                (None, Some(a), a)
            }
            None => {
                let b = Buffer::new(len as usize)?;
                let a = b.addr();
                (Some(b), None, a)
            }
        };
        let local = Local {
            engine,
            host,
            device: dev,
            addr,
            len,
        };
        engine
            .register_memory(addr, len, None)
            .map_err(|e| e.to_string())?;
        Ok(local)
    }

    /// Sets the whole buffer to `data` (its length).
    fn load(&mut self, data: &Buffer) -> Result<(), String> {
        match (&mut self.host, self.device) {
            (Some(h), _) => {
                h.as_mut_slice().copy_from_slice(data.as_slice());
                Ok(())
            }
            // SAFETY: dev is a device allocation of `len` bytes and data a
            // host buffer of as many; no transfer is in flight.
            (None, Some(dev)) => unsafe { self.engine.copy_memory(dev, data.addr(), self.len) }
                .map_err(|e| e.to_string()),
            (None, None) => Err("no local memory".into()),
        }
    }

    /// The buffer's bytes, copied into `into` for device memory.
    fn view<'b>(&'b self, into: &'b mut Buffer) -> Result<&'b [u8], String> {
        match (&self.host, self.device) {
            (Some(h), _) => Ok(h.as_slice()),
            (None, Some(dev)) => {
                // SAFETY: as in load, the other way.
                unsafe { self.engine.copy_memory(into.addr(), dev, self.len) }
                    .map_err(|e| e.to_string())?;
                Ok(into.as_slice())
            }
            (None, None) => Err("no local memory".into()),
        }
    }
}

impl Drop for Local<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.addr);
        if let Some(dev) = self.device {
            let _ = self.engine.free_device(dev);
        }
    }
}

/// Writes a pattern by the first placement, clears the local blocks, reads
/// the remote blocks back into the local blocks shifted by one pair (so a
/// consistent mix-up of pairs on both ways shows), and compares every local
/// block with what must be there.
fn verify(bench: &Bench<'_>, local: &mut Local<'_>, p: &Placement) -> Result<(), String> {
    let s = bench.block as usize;
    let mut pattern = Buffer::new(local.len as usize)?;
    fill_pattern(pattern.as_mut_slice(), 0x6b76);
    local.load(&pattern)?;
    let write = bench.requests(Op::Write, &p.local, &p.remote);
    bench
        .run(Op::Write, &p.local, &p.remote, &write)
        .map_err(|e| format!("verify: the pattern's write failed: {e}"))?;
    let mut scratch = Buffer::new(local.len as usize)?;
    local.load(&scratch)?;
    let mut shifted = p.local.clone();
    shifted.rotate_left(1);
    let read = bench.requests(Op::Read, &shifted, &p.remote);
    bench
        .run(Op::Read, &shifted, &p.remote, &read)
        .map_err(|e| format!("verify: the read back failed: {e}"))?;
    let got = local.view(&mut scratch)?;
    // Local block shifted[i] must hold what local block p.local[i] held.
    let mut expect: Vec<Option<u64>> = vec![None; (local.len / bench.block) as usize];
    for (&dst, &src) in shifted.iter().zip(&p.local) {
        expect[dst as usize] = Some(src);
    }
    let zero = vec![0u8; s];
    let (mut bad, mut first) = (0u64, None);
    for (blk, want) in expect.iter().enumerate() {
        let have = &got[blk * s..(blk + 1) * s];
        let ok = match want {
            Some(src) => have == &pattern.as_slice()[*src as usize * s..(*src as usize + 1) * s],
            None => have == &zero[..],
        };
        if !ok {
            bad += 1;
            first.get_or_insert((blk, *want));
        }
    }
    match first {
        None => Ok(()),
        Some((blk, Some(src))) => Err(format!(
            "verify: {bad} of {} local blocks hold the wrong bytes after a write and a read \
             back; first: local block {blk} should hold local block {src}'s pattern",
            expect.len()
        )),
        Some((blk, None)) => Err(format!(
            "verify: {bad} local blocks hold the wrong bytes; first: local block {blk}, which \
             no transfer should have touched"
        )),
    }
}

#[derive(Serialize)]
struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    samples: usize,
}

impl Percentiles {
    fn of(mut v: Vec<f64>) -> Percentiles {
        v.sort_by(|a, b| a.total_cmp(b));
        Percentiles {
            p50: percentile(&v, 0.5),
            p90: percentile(&v, 0.9),
            p99: percentile(&v, 0.99),
            max: v.last().copied().unwrap_or(0.0),
            samples: v.len(),
        }
    }
}

struct Limit {
    kind: &'static str,
    gb_per_s: f64,
}

#[derive(Serialize)]
struct KvReport {
    pattern: &'static str,
    api: &'static str,
    op: &'static str,
    transport: String,
    device: Option<String>,
    block_size: u64,
    blocks_per_batch: u64,
    batch_bytes: u64,
    duration_s: f64,
    batches: usize,
    bytes: u64,
    gb_per_s: f64,
    blocks_per_s: f64,
    /// The same as blocks_per_s, under the name the other patterns use.
    ops_per_s: f64,
    /// Per batch: from allocating it to its completion.
    latency_us: Percentiles,
    /// The submit call alone (CPU time to issue a batch, no waiting); flat,
    /// so that scripts matching `"p50":` find the batch latency's.
    submit_p50_us: f64,
    submit_p99_us: f64,
    submit_max_us: f64,
    /// "device-to-device" (the same device, one contiguous copy of the
    /// batch's bytes) or "memcpy" (one thread, the batch's bytes at once),
    /// measured right after the timed batches.
    limit_kind: &'static str,
    limit_gb_per_s: f64,
    /// Host memory: one thread copying the batch's blocks between shuffled
    /// places of two buffers (no transport), GB/s.
    scattered_memcpy_gb_per_s: Option<f64>,
    /// The same copy split over `scattered_threads` threads (one per CPU
    /// this process may use, as shm's copy threads are by default), GB/s.
    scattered_memcpy_parallel_gb_per_s: Option<f64>,
    scattered_threads: Option<usize>,
    /// gb_per_s / limit_gb_per_s.
    ratio: f64,
    verified: bool,
}

pub fn initiator(args: KvArgs) -> Result<(), String> {
    let s = args.block_size;
    if s == 0 {
        return Err("--block-size must be positive".into());
    }
    let n = match (args.blocks, args.batch_bytes) {
        (Some(_), Some(_)) => return Err("give --blocks or --batch-bytes, not both".into()),
        (Some(n), None) => n,
        (None, b) => b.unwrap_or(DEFAULT_BATCH_BYTES) / s,
    };
    if n == 0 {
        return Err(format!(
            "a batch must hold at least one block of {}",
            human_size(s)
        ));
    }
    let batch_bytes = n
        .checked_mul(s)
        .ok_or("--blocks x --block-size is too large")?;
    let engine = Engine::new(EngineConfig::from_env().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let seg = engine
        .open_segment(&args.segment)
        .map_err(|e| e.to_string())?;
    let d = engine.descriptor_of(seg).map_err(|e| e.to_string())?;
    let remote = match d
        .layouts
        .iter()
        .filter(|l| l.block_size == s)
        .max_by_key(|l| l.count)
    {
        Some(l) => Pool {
            layout: Some(l.id),
            base: l.base,
            stride: l.stride,
            count: l.count,
        },
        None if args.api == KvApi::Layout => {
            return Err(format!(
                "the target publishes no layout of {} blocks (it has {}): start it with \
                 --layout-block {}, or use --api requests",
                human_size(s),
                if d.layouts.is_empty() {
                    "none".to_string()
                } else {
                    d.layouts
                        .iter()
                        .map(|l| human_size(l.block_size))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                s
            ))
        }
        None => {
            let b = d
                .buffers
                .iter()
                .max_by_key(|b| b.len)
                .ok_or("the target registered no memory")?;
            Pool {
                layout: None,
                base: b.addr,
                stride: s,
                count: b.len / s,
            }
        }
    };
    if remote.count < n {
        return Err(format!(
            "the target's pool holds {} blocks of {}, and a batch needs {n} distinct ones: \
             give the target a larger --buffer-size, or use fewer --blocks",
            remote.count,
            human_size(s)
        ));
    }
    // The local pool: at least the batch, and at least the working set
    // other benchmarks cycle through, so blocks come from memory.
    let local_count = n.max(WORKING_SET / s);
    let mut local = Local::new(&engine, args.device, local_count * s)?;
    let local_layout = engine
        .register_layout(BlockLayout::contiguous(local.addr, s, local_count))
        .map_err(|e| format!("cannot register the local layout: {e}"))?;
    let bench = Bench {
        engine: &engine,
        seg,
        api: args.api,
        block: s,
        local: Pool {
            layout: Some(local_layout),
            base: local.addr,
            stride: s,
            count: local_count,
        },
        remote,
        transport: args.transport.as_deref(),
        timeout: engine.config().timeout * 2,
    };
    let placements: Vec<Placement> = (0..PLACEMENTS)
        .map(|k| {
            let l = sample(local_count, n, 2 * k + 1);
            let r = sample(remote.count, n, 2 * k + 2);
            let requests = match args.api {
                KvApi::Requests => bench.requests(args.op, &l, &r),
                KvApi::Layout => Vec::new(),
            };
            Placement {
                local: l,
                remote: r,
                requests,
            }
        })
        .collect();
    let transport = route_name(&engine, &bench, &args);

    // Untimed first: the check, or one batch (connecting and mapping the
    // peer's memory are not part of the figure).
    if args.verify {
        verify(&bench, &mut local, &placements[0])?;
    } else {
        let p = &placements[0];
        bench
            .run(args.op, &p.local, &p.remote, &p.requests)
            .map_err(|e| format!("the first batch failed: {e}"))?;
    }
    let (mut latency, mut submit) = (Vec::new(), Vec::new());
    let started = Instant::now();
    let mut k = 0usize;
    while latency.is_empty() || started.elapsed().as_secs_f64() < args.duration {
        let p = &placements[k % placements.len()];
        k += 1;
        let (sub, all) = bench
            .run(args.op, &p.local, &p.remote, &p.requests)
            .map_err(|e| format!("a batch failed: {e}"))?;
        submit.push(sub.as_secs_f64() * 1e6);
        latency.push(all.as_secs_f64() * 1e6);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bytes = batch_bytes * latency.len() as u64;
    let _ = engine.unregister_layout(local_layout);
    drop(local);

    // The same run's limit: one contiguous copy of the batch's bytes.
    let limit_s = args.duration.clamp(0.2, 1.0);
    let limit = match args.device {
        Some(dev) => Limit {
            kind: "device-to-device",
            gb_per_s: device_to_device(&engine, dev, batch_bytes, limit_s)?,
        },
        None => Limit {
            kind: "memcpy",
            gb_per_s: memcpy_run(batch_bytes as usize, limit_s, 1)?,
        },
    };
    // Host memory: the same blocks copied scattered by one thread and by
    // one thread per CPU, the memory system's own cost of this block size
    // (compare its ratio across block sizes with the transport's).
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    let (scattered, parallel) = match args.device {
        Some(_) => (None, None),
        None => {
            let order = sample(n, n, 3);
            (
                Some(scattered_memcpy(s as usize, &order, limit_s, 1)?),
                Some(scattered_memcpy(s as usize, &order, limit_s, cpus)?),
            )
        }
    };
    let gb_per_s = bytes as f64 / elapsed / 1e9;
    let submit = Percentiles::of(submit);
    let blocks_per_s = (n * latency.len() as u64) as f64 / elapsed;
    let report = KvReport {
        pattern: "kv",
        api: args.api.name(),
        op: match args.op {
            Op::Read => "read",
            Op::Write => "write",
        },
        transport,
        device: args.device.map(|d| d.to_string()),
        block_size: s,
        blocks_per_batch: n,
        batch_bytes,
        duration_s: elapsed,
        batches: latency.len(),
        bytes,
        gb_per_s,
        blocks_per_s,
        ops_per_s: blocks_per_s,
        latency_us: Percentiles::of(latency),
        submit_p50_us: submit.p50,
        submit_p99_us: submit.p99,
        submit_max_us: submit.max,
        limit_kind: limit.kind,
        limit_gb_per_s: limit.gb_per_s,
        scattered_memcpy_gb_per_s: scattered,
        scattered_memcpy_parallel_gb_per_s: parallel,
        scattered_threads: parallel.map(|_| cpus),
        ratio: if limit.gb_per_s > 0.0 {
            gb_per_s / limit.gb_per_s
        } else {
            0.0
        },
        verified: args.verify,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "kv {} {} x {n} shuffled blocks per batch ({}), {} API, over {}: {:.3} GB/s, \
             {:.0} blocks/s, batch latency p50 {:.1} us p99 {:.1} us, submit call p50 {:.1} us \
             p99 {:.1} us; limit {} of {} {:.2} GB/s, ratio {:.3}{}",
            report.op,
            human_size(s),
            human_size(batch_bytes),
            report.api,
            report.transport,
            report.gb_per_s,
            report.blocks_per_s,
            report.latency_us.p50,
            report.latency_us.p99,
            report.submit_p50_us,
            report.submit_p99_us,
            report.limit_kind,
            human_size(batch_bytes),
            report.limit_gb_per_s,
            report.ratio,
            if args.verify { "; verified" } else { "" }
        );
    }
    Ok(())
}

/// The transport the blocks take, as the initiator's report names it
/// (device memory no transport takes is staged through a host route).
fn route_name(engine: &Engine, bench: &Bench<'_>, args: &KvArgs) -> String {
    if let Some(t) = &args.transport {
        return t.clone();
    }
    match engine.route(bench.seg, bench.local.base, bench.remote.base, bench.block) {
        Ok(r) => r.transport,
        Err(_) if args.device.is_some() => {
            // Ask for a host buffer's route to the same peer.
            let probe = Buffer::new(bench.block as usize);
            let t = probe
                .ok()
                .and_then(|b| {
                    engine.register_memory(b.addr(), bench.block, None).ok()?;
                    let t = engine
                        .route(bench.seg, b.addr(), bench.remote.base, bench.block)
                        .map(|r| r.transport)
                        .ok();
                    let _ = engine.unregister_memory(b.addr());
                    t
                })
                .unwrap_or_else(|| "?".into());
            format!("{t}+staging")
        }
        Err(_) => "?".into(),
    }
}

/// The target's side: a layout of `block`-byte blocks (stride = block)
/// over its whole buffer for each size asked, so initiators can name its
/// blocks by index; returns the lines to print after the segment line.
pub fn register_target_layouts(
    engine: &Engine,
    addr: u64,
    len: u64,
    blocks: &[u64],
) -> Result<String, String> {
    let mut lines = String::new();
    for &b in blocks {
        if b == 0 || b > len {
            return Err(format!(
                "--layout-block {b}: a block must be from 1 byte to the buffer's {}",
                human_size(len)
            ));
        }
        let id = engine
            .register_layout(BlockLayout::contiguous(addr, b, len / b))
            .map_err(|e| format!("cannot register a layout of {} blocks: {e}", human_size(b)))?;
        lines.push_str(&format!("layout {id} block {b} count {}\n", len / b));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_distinct_reproducible_and_in_range() {
        let a = sample(1000, 300, 7);
        assert_eq!(a, sample(1000, 300, 7));
        assert_ne!(a, sample(1000, 300, 8));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 300);
        assert!(a.iter().all(|&i| i < 1000));
        // A whole pool is a permutation.
        let mut all = sample(64, 64, 1);
        all.sort_unstable();
        assert_eq!(all, (0..64).collect::<Vec<_>>());
    }
}
