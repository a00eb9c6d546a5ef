//! A latency histogram cheap enough for every completion: fixed buckets
//! (powers of two of a microsecond). Batches gather their samples in
//! [`Samples`] and add them in one go: relaxed atomic adds per batch.

use std::sync::atomic::{AtomicU64, Ordering};

/// Buckets with an upper bound: 1 us, 2 us, 4 us, ... 2^(BOUNDS-1) us
/// (about 8.4 s); one more bucket holds what is slower.
pub const BOUNDS: usize = 24;

/// The upper bound of bucket `i`, in seconds.
pub fn bound_seconds(i: usize) -> f64 {
    (1u64 << i) as f64 * 1e-6
}

#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS + 1],
    sum_ns: AtomicU64,
}

/// A histogram as it reads now, cumulative as Prometheus wants it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HistogramSnapshot {
    /// (upper bound in seconds, samples at or below it), ascending.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

/// Samples not yet added to a histogram: plain numbers, owned by one
/// batch.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    buckets: [u32; BOUNDS + 1],
    sum_ns: u64,
}

impl Samples {
    pub fn record(&mut self, ns: u64) {
        self.buckets[bucket_of(ns)] += 1;
        self.sum_ns += ns;
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.iter().all(|n| *n == 0)
    }
}

/// The bucket that holds `ns`: the first whose bound is not below it.
fn bucket_of(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 {
        return 0;
    }
    // ceil(log2(us)): the smallest i with 2^i >= us.
    ((64 - (us - 1).leading_zeros()) as usize).min(BOUNDS)
}

impl Histogram {
    /// Adds `samples` and clears them.
    pub fn take(&self, samples: &mut Samples) {
        for (b, n) in self.buckets.iter().zip(&mut samples.buckets) {
            if *n > 0 {
                b.fetch_add(u64::from(std::mem::take(n)), Ordering::Relaxed);
            }
        }
        self.sum_ns
            .fetch_add(std::mem::take(&mut samples.sum_ns), Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut total = 0;
        let mut buckets = Vec::with_capacity(BOUNDS);
        for (i, b) in self.buckets.iter().enumerate() {
            total += b.load(Ordering::Relaxed);
            if i < BOUNDS {
                buckets.push((bound_seconds(i), total));
            }
        }
        HistogramSnapshot {
            buckets,
            count: total,
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_land_in_the_first_bucket_not_below_them() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1000), 0);
        assert_eq!(bucket_of(1001), 1);
        assert_eq!(bucket_of(2000), 1);
        assert_eq!(bucket_of(3000), 2);
        assert_eq!(bucket_of(1_000_000), 10); // 1 ms <= 1024 us
        assert_eq!(bucket_of(u64::MAX), BOUNDS);
    }

    #[test]
    fn snapshots_are_cumulative_and_count_everything() {
        let h = Histogram::default();
        let mut samples = Samples::default();
        for ns in [500, 1500, 1500, 40_000_000_000] {
            samples.record(ns);
        }
        h.take(&mut samples);
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.buckets[0], (1e-6, 1));
        assert_eq!(s.buckets[1].1, 3);
        assert_eq!(
            s.buckets.last().unwrap().1,
            3,
            "the slow one is only in +Inf"
        );
        assert!((s.sum_seconds - 40.0000035).abs() < 1e-9);
    }

    #[test]
    fn taking_samples_clears_them() {
        let h = Histogram::default();
        let mut samples = Samples::default();
        samples.record(1500);
        h.take(&mut samples);
        assert!(samples.is_empty());
        h.take(&mut samples);
        let s = h.snapshot();
        assert_eq!((s.count, s.buckets[1].1), (1, 1), "nothing added twice");
        assert!((s.sum_seconds - 1.5e-6).abs() < 1e-12);
    }
}
