//! Correction by measurement: per (peer segment, transport), an
//! exponentially weighted moving average of the throughput and latency
//! that completions show. Each hand-over of requests to a transport (one
//! `submit` call) is one sample, taken when its last request completes:
//! small ones (at most [`LATENCY_MAX_BYTES`]) time the latency, large ones
//! (at least [`BANDWIDTH_MIN_BYTES`]) the throughput, net of that latency.
//! Failed hand-overs are not samples, nor is the first hand-over to a
//! transport for a peer: it pays once for what later ones reuse
//! (connections, the peer's memory mapped, handles opened).

use super::request::SegmentId;
use crate::batch::GroupObserver;
use crate::id_map::IdMap;
use crate::metrics::Stamp;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Hand-overs up to this size time the latency.
pub(crate) const LATENCY_MAX_BYTES: u64 = 64 << 10;
/// Hand-overs from this size on time the throughput.
pub(crate) const BANDWIDTH_MIN_BYTES: u64 = 256 << 10;
/// Samples before a figure counts.
pub(crate) const MIN_SAMPLES: u32 = 3;
/// Weight of a new sample in the average.
const ALPHA: f64 = 0.3;

/// What the engine measured on one (segment, transport).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Measured {
    pub(crate) bandwidth_mbps: f64,
    pub(crate) bandwidth_samples: u32,
    pub(crate) latency_ns: f64,
    pub(crate) latency_samples: u32,
    /// The first hand-over finished (and was left out).
    warmed: bool,
}

impl Measured {
    /// The throughput, once enough samples back it.
    pub(crate) fn bandwidth(&self) -> Option<f64> {
        (self.bandwidth_samples >= MIN_SAMPLES).then_some(self.bandwidth_mbps)
    }

    /// The latency, once enough samples back it.
    pub(crate) fn latency(&self) -> Option<f64> {
        (self.latency_samples >= MIN_SAMPLES).then_some(self.latency_ns)
    }

    fn add(&mut self, bytes: u64, elapsed: Duration) {
        if !self.warmed {
            self.warmed = true;
            return;
        }
        let ns = elapsed.as_nanos().max(1) as f64;
        if bytes <= LATENCY_MAX_BYTES {
            self.latency_ns = ewma(self.latency_ns, ns, self.latency_samples);
            self.latency_samples = self.latency_samples.saturating_add(1);
        }
        if bytes >= BANDWIDTH_MIN_BYTES {
            // The time the bytes took, without the fixed part (at most half
            // of it, so that a noisy latency cannot make the rate absurd).
            let fixed = if self.latency_samples > 0 {
                self.latency_ns.min(ns / 2.0)
            } else {
                0.0
            };
            let mbps = bytes as f64 * 8.0 / ((ns - fixed) * 1e-9) / 1e6;
            self.bandwidth_mbps = ewma(self.bandwidth_mbps, mbps, self.bandwidth_samples);
            self.bandwidth_samples = self.bandwidth_samples.saturating_add(1);
        }
    }
}

fn ewma(average: f64, sample: f64, count: u32) -> f64 {
    if count == 0 {
        sample
    } else {
        average + ALPHA * (sample - average)
    }
}

/// The measurements of one engine.
#[derive(Default)]
pub(crate) struct Meter {
    table: Mutex<IdMap<(SegmentId, usize), Measured>>,
}

impl Meter {
    pub(crate) fn record(&self, segment: SegmentId, transport: usize, bytes: u64, took: Duration) {
        self.table
            .lock()
            .entry((segment, transport))
            .or_default()
            .add(bytes, took);
    }

    pub(crate) fn get(&self, segment: SegmentId, transport: usize) -> Measured {
        self.table
            .lock()
            .get(&(segment, transport))
            .copied()
            .unwrap_or_default()
    }
}

/// One hand-over in flight: its completion groups report here, and the
/// last one records the sample.
pub(crate) struct Flight {
    meter: Arc<Meter>,
    segment: SegmentId,
    transport: usize,
    bytes: u64,
    /// On the metrics' clock (the TSC where it can be trusted): two reads
    /// per hand-over, cheaper than the OS clock's.
    started: Stamp,
    left: AtomicUsize,
    failed: AtomicBool,
}

impl Flight {
    /// A hand-over of `groups` completion groups, `bytes` in all, starting now.
    pub(crate) fn start(
        meter: Arc<Meter>,
        segment: SegmentId,
        transport: usize,
        groups: usize,
        bytes: u64,
    ) -> Arc<Flight> {
        Arc::new(Flight {
            meter,
            segment,
            transport,
            bytes,
            started: Stamp::now(),
            left: AtomicUsize::new(groups),
            failed: AtomicBool::new(false),
        })
    }
}

impl GroupObserver for Flight {
    fn finished(&self, ok: bool) {
        if !ok {
            self.failed.store(true, Ordering::Relaxed);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 && !self.failed.load(Ordering::Relaxed) {
            self.meter.record(
                self.segment,
                self.transport,
                self.bytes,
                Duration::from_nanos(self.started.elapsed_ns()),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn large_hand_overs_time_throughput_and_small_ones_latency() {
        let m = Meter::default();
        // The first hand-over pays for set-up: left out.
        m.record(1, 0, 1_000_000, 100 * MS);
        assert_eq!(m.get(1, 0).bandwidth_samples, 0);
        // 1 MB in a millisecond: 8 Gbit/s; not trusted before three samples.
        m.record(1, 0, 1_000_000, MS);
        m.record(1, 0, 1_000_000, MS);
        assert_eq!(m.get(1, 0).bandwidth(), None);
        m.record(1, 0, 1_000_000, MS);
        let bw = m.get(1, 0).bandwidth().unwrap();
        assert!((bw - 8_000.0).abs() < 1.0, "{bw}");
        assert_eq!(m.get(1, 0).latency(), None);
        for _ in 0..3 {
            m.record(1, 0, 4096, Duration::from_micros(20));
        }
        assert!((m.get(1, 0).latency().unwrap() - 20_000.0).abs() < 1.0);
        // Another transport, another segment: nothing known.
        assert_eq!(m.get(1, 1), Measured::default());
        assert_eq!(m.get(2, 0), Measured::default());
    }

    #[test]
    fn the_average_moves_towards_new_samples() {
        let m = Meter::default();
        for _ in 0..3 {
            m.record(1, 0, 1_000_000, MS);
        }
        m.record(1, 0, 1_000_000, 2 * MS);
        let bw = m.get(1, 0).bandwidth().unwrap();
        assert!(bw < 8_000.0 && bw > 4_000.0, "{bw}");
    }

    #[test]
    fn a_flight_records_once_when_its_last_group_finishes_and_not_after_a_failure() {
        let meter = Arc::new(Meter::default());
        meter.record(7, 2, 1 << 20, MS); // the left-out first hand-over
        let f = Flight::start(meter.clone(), 7, 2, 3, 1 << 20);
        f.finished(true);
        f.finished(true);
        assert_eq!(meter.get(7, 2).bandwidth_samples, 0);
        f.finished(true);
        assert_eq!(meter.get(7, 2).bandwidth_samples, 1);

        let f = Flight::start(meter.clone(), 7, 2, 2, 1 << 20);
        f.finished(false);
        f.finished(true);
        assert_eq!(meter.get(7, 2).bandwidth_samples, 1);
    }
}
