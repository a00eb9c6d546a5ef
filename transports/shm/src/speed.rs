//! What shm declares to the engine's cost model (ABI 1.2 `bandwidth_mbps`,
//! `latency_ns`), measured when the plugin is probed (once per boot and
//! configuration: the loader caches probe results).
//!
//! - bandwidth: memcpy on as many threads as shm copies with (the caller
//!   and its copy threads), over 64 MiB (memory, not cache), best of three
//!   rounds, times 0.8 (what shm is built to reach against that limit; the
//!   benchmark `scripts/bench-shm.sh` checks it);
//! - latency: a fixed 3 us, the p50 of one synchronous 4 KiB write through
//!   the engine measured on the development machines (1.6-3.4 us), of
//!   which the copy itself is a small part.
//!
//! A host too busy to measure at all declares 0 (unknown) rather than guess.

use std::time::Instant;

/// The fraction of the measured memcpy limit shm declares.
const SHARE_OF_LIMIT: f64 = 0.8;
/// The small-request latency shm declares.
pub const LATENCY_NS: u32 = 3_000;
/// Bytes copied per round (source and destination each).
const WORKING_SET: usize = 64 << 20;

/// Memory shm declares it sustains for one peer, in Mbit/s, and the
/// measurement it comes from.
pub struct Declared {
    pub bandwidth_mbps: u64,
    pub memcpy_gb_per_s: f64,
    pub copiers: usize,
}

/// Measures memcpy on `copiers` threads and derives the declaration.
pub fn measure(copiers: usize) -> Declared {
    let copiers = copiers.clamp(1, 256);
    let gbps = memcpy_gb_per_s(copiers).unwrap_or(0.0);
    Declared {
        bandwidth_mbps: (gbps * SHARE_OF_LIMIT * 8000.0) as u64,
        memcpy_gb_per_s: gbps,
        copiers,
    }
}

/// A populated anonymous mapping, unmapped on drop.
struct Scratch(*mut u8, usize);

impl Scratch {
    fn new(len: usize) -> Option<Scratch> {
        // SAFETY: a fresh private anonymous mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(Scratch(p.cast(), len))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer referenced.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}

fn memcpy_gb_per_s(threads: usize) -> Option<f64> {
    let src = Scratch::new(WORKING_SET)?;
    let dst = Scratch::new(WORKING_SET)?;
    let slice = WORKING_SET / threads;
    let (s, d) = (src.0 as usize, dst.0 as usize);
    let mut best = 0f64;
    for _ in 0..3 {
        let go = std::sync::Barrier::new(threads);
        // Each thread times its own copy; the round lasts from the first
        // start to the last end. (A clock read by a coordinating thread
        // after the barrier can be descheduled on a busy host while the
        // copies run, and then times almost nothing.)
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let go = &go;
                    scope.spawn(move || {
                        go.wait();
                        let start = Instant::now();
                        // SAFETY: disjoint slices of the two mappings,
                        // alive until the scope ends.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                (s + t * slice) as *const u8,
                                (d + t * slice) as *mut u8,
                                slice,
                            )
                        }
                        (start, Instant::now())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let first = spans.iter().map(|s| s.0).min()?;
        let last = spans.iter().map(|s| s.1).max()?;
        let secs = last.duration_since(first).as_secs_f64().max(1e-9);
        best = best.max((slice * spans.len()) as f64 / secs / 1e9);
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_declaration_is_measured_not_assumed() {
        let d = super::measure(2);
        assert!(d.memcpy_gb_per_s > 0.0);
        assert_eq!(d.bandwidth_mbps, (d.memcpy_gb_per_s * 0.8 * 8000.0) as u64);
        assert_eq!(d.copiers, 2);
    }
}
