//! This machine's own limits, measured the way benchmarks compare with
//! them: a memcpy of host memory, a copy between two device buffers.

use crate::util::Buffer;
use ferry_core::{Engine, Location};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes a benchmark cycles through on each side, so that it measures
/// memory rather than cache (the memcpy limit uses the same).
pub(crate) const WORKING_SET: u64 = 64 << 20;

/// GB/s of `threads` threads copying `block`-sized pieces of their own
/// slices of one working set at once, for `duration`.
pub(crate) fn memcpy_run(block: usize, duration: f64, threads: usize) -> Result<f64, String> {
    let per_thread = (WORKING_SET as usize).max(block);
    let slice = per_thread.min((1usize << 30) / threads).max(block);
    let src = Buffer::new(slice * threads)?;
    let mut dst = Buffer::new(slice * threads)?;
    let blocks = slice / block;
    // Blocks between looks at the clock: about 16 MiB, so stopping is prompt.
    let rounds = ((16usize << 20) / block).clamp(1, 64);
    let go = std::sync::Barrier::new(threads + 1);
    let bytes = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let started = std::thread::scope(|s| {
        for (from, to) in src
            .as_slice()
            .chunks_exact(slice)
            .zip(dst.as_mut_slice().chunks_exact_mut(slice))
        {
            let (go, bytes, stop) = (&go, &bytes, &stop);
            s.spawn(move || {
                go.wait();
                let (mut i, mut mine) = (0, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..rounds {
                        let off = (i % blocks) * block;
                        to[off..off + block].copy_from_slice(&from[off..off + block]);
                        i += 1;
                        mine += block as u64;
                    }
                }
                std::hint::black_box(&to[0]);
                bytes.fetch_add(mine, Ordering::Relaxed);
            });
        }
        go.wait();
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(duration));
        stop.store(true, Ordering::Relaxed);
        started
    });
    // Until the last thread stopped: it counted its last round too.
    Ok(bytes.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// GB/s of `threads` threads copying `total` bytes as `block`-sized blocks
/// from shuffled places of one buffer to shuffled places of another
/// (`order` gives both: block i goes from `order[i]` to `order[len - 1 - i]`;
/// thread t takes the t-th of `threads` equal runs of i), for `duration`:
/// what this machine's memory allows a scattered copy of that block size,
/// TLB misses and all, with no transport in the way. `order` must hold
/// distinct indices (a permutation or a sample of one).
pub(crate) fn scattered_memcpy(
    block: usize,
    order: &[u64],
    duration: f64,
    threads: usize,
) -> Result<f64, String> {
    let n = order.len();
    let top = order.iter().max().map_or(0, |&m| m as usize + 1);
    let mut distinct = order.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != n {
        return Err("scattered copy: block indices repeat".into());
    }
    let src = Buffer::new(block * top)?;
    let mut dst = Buffer::new(block * top)?;
    let (from, to) = (
        src.addr() as usize,
        dst.as_mut_slice().as_mut_ptr() as usize,
    );
    let threads = threads.clamp(1, n.max(1));
    let per = n.div_ceil(threads);
    let go = std::sync::Barrier::new(threads);
    let stop = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (go, stop, bytes) = (&go, &stop, &bytes);
            s.spawn(move || {
                let mine = t * per..((t + 1) * per).min(n);
                go.wait();
                let mut copied = 0u64;
                // Every thread copies its share at least once.
                loop {
                    for i in mine.clone() {
                        let (a, b) = (order[i] as usize * block, order[n - 1 - i] as usize * block);
                        // SAFETY: both buffers hold `top` blocks and every
                        // index is below `top`; the indices are distinct, so
                        // each destination block is written by one i of one
                        // thread only, and source and destination are
                        // different buffers.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                (from + a) as *const u8,
                                (to + b) as *mut u8,
                                block,
                            )
                        };
                        copied += block as u64;
                    }
                    if t == 0 && started.elapsed().as_secs_f64() >= duration {
                        stop.store(true, Ordering::Relaxed);
                    }
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                bytes.fetch_add(copied, Ordering::Relaxed);
            });
        }
    });
    std::hint::black_box(dst.as_slice()[0]);
    Ok(bytes.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// Copies of `size` bytes between two buffers of `device`, through its
/// plugin (cuMemcpyAsync device to device), in GB/s of bytes copied.
pub(crate) fn device_to_device(
    engine: &Engine,
    device: Location,
    size: u64,
    duration: f64,
) -> Result<f64, String> {
    let a = engine
        .allocate_device(device, size)
        .map_err(|e| e.to_string())?;
    let b = match engine.allocate_device(device, size) {
        Ok(b) => b,
        Err(e) => {
            let _ = engine.free_device(a);
            return Err(e.to_string());
        }
    };
    // One untimed copy first: the first touches the pages.
    // SAFETY: a and b are device allocations of `size` bytes made above.
    let mut result =
        unsafe { engine.copy_batch(device, &[(b, a, size)]) }.map_err(|e| e.to_string());
    let started = Instant::now();
    let mut bytes = 0u64;
    while result.is_ok() && (started.elapsed().as_secs_f64() < duration || bytes == 0) {
        // SAFETY: a and b are still the device allocations of `size` bytes
        // made above, freed only after this loop.
        result = unsafe { engine.copy_batch(device, &[(b, a, size), (a, b, size)]) }
            .map_err(|e| e.to_string());
        bytes += 2 * size;
    }
    let gbps = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    let _ = engine.free_device(a);
    let _ = engine.free_device(b);
    result.map(|()| gbps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scattered_copies_refuse_repeated_blocks_and_run_on_several_threads() {
        assert!(scattered_memcpy(4096, &[0, 2, 2], 0.01, 2).is_err());
        for threads in [1, 3, 4, 64] {
            let gbps = scattered_memcpy(4096, &[5, 1, 0, 3, 2, 4, 7, 8, 6], 0.01, threads).unwrap();
            assert!(gbps.is_finite() && gbps > 0.0, "{threads} threads: {gbps}");
        }
    }
}
