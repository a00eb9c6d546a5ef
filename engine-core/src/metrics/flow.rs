//! Flows: requests of one transport, local device, peer, op and memory
//! kind. Each keeps relaxed atomic counters, found once per batch and
//! added to by batches (`tally`), and shares a latency histogram per
//! (transport, op) and size class.

use super::histogram::Histogram;
use super::snapshot::{FlowCounts, LatencyCounts};
use ferry_plugins_abi::ErrorCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

/// The clock submissions are timed by (calibrated once per process).
static CLOCK: LazyLock<quanta::Clock> = LazyLock::new(quanta::Clock::new);

/// A moment on the metrics' clock: the CPU's time-stamp counter where it
/// is invariant, else the OS's monotonic clock (quanta decides).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp(u64);

impl Stamp {
    pub fn now() -> Stamp {
        Stamp(CLOCK.raw())
    }

    /// Nanoseconds from this moment to now.
    pub fn elapsed_ns(self) -> u64 {
        self.ns_until(Stamp::now())
    }

    /// Nanoseconds from this moment to `later` (0 if it is not later).
    pub fn ns_until(self, later: Stamp) -> u64 {
        CLOCK.delta_as_nanos(self.0, later.0)
    }
}

/// Size classes of one submission: (largest length, label).
pub const SIZE_CLASSES: [(u64, &str); 5] = [
    (4 << 10, "0-4KiB"),
    (64 << 10, "4-64KiB"),
    (1 << 20, "64KiB-1MiB"),
    (16 << 20, "1-16MiB"),
    (u64::MAX, "16MiB+"),
];

/// The index of `len`'s class in [`SIZE_CLASSES`] (their bounds are 4 KiB
/// times powers of 16: a shift, not a search, on every request).
pub fn size_class(len: u64) -> usize {
    if len <= 4096 {
        return 0;
    }
    // ceil(log2(len)) is 13 or more here; each class spans 4 more.
    let bits = 64 - (len - 1).leading_zeros() as usize;
    ((bits - 9) / 4).min(SIZE_CLASSES.len() - 1)
}

const CODES: usize = ErrorCode::ALL.len();

fn code_index(code: ErrorCode) -> usize {
    ErrorCode::ALL
        .iter()
        .position(|c| *c == code)
        .unwrap_or(CODES - 1)
}

/// What a flow's series are labelled with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FlowLabels {
    pub transport: String,
    pub device: String,
    pub peer: String,
    pub op: &'static str,
    pub memory: &'static str,
}

/// Latency histograms of one (transport, op), one per size class.
#[derive(Debug)]
pub struct Latencies {
    pub transport: String,
    pub op: &'static str,
    by_size: [Histogram; SIZE_CLASSES.len()],
}

impl Latencies {
    pub fn new(transport: &str, op: &'static str) -> Latencies {
        Latencies {
            transport: transport.to_string(),
            op,
            by_size: Default::default(),
        }
    }

    /// The histograms that hold samples.
    pub fn snapshot(&self) -> Vec<LatencyCounts> {
        self.by_size
            .iter()
            .zip(SIZE_CLASSES)
            .map(|(h, (_, size))| (h.snapshot(), size))
            .filter(|(h, _)| h.count > 0)
            .map(|(histogram, size)| LatencyCounts {
                transport: self.transport.clone(),
                op: self.op.to_string(),
                size: size.to_string(),
                histogram,
            })
            .collect()
    }
}

#[derive(Debug)]
pub struct Flow {
    pub labels: FlowLabels,
    requests: AtomicU64,
    bytes: AtomicU64,
    submissions: AtomicU64,
    failures: [AtomicU64; CODES],
    failed_bytes: AtomicU64,
    latency: Arc<Latencies>,
}

impl Flow {
    pub fn new(labels: FlowLabels, latency: Arc<Latencies>) -> Flow {
        Flow {
            labels,
            requests: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
            failures: Default::default(),
            failed_bytes: AtomicU64::new(0),
            latency,
        }
    }

    /// Adds what a batch gathered: `submissions` that finished, of
    /// `requests` user requests and `bytes` in all.
    pub fn add(&self, submissions: u64, requests: u64, bytes: u64) {
        self.submissions.fetch_add(submissions, Ordering::Relaxed);
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// One submission of `requests` user requests and `bytes` failed with
    /// `code`.
    pub fn fail(&self, requests: usize, bytes: u64, code: ErrorCode) {
        self.submissions.fetch_add(1, Ordering::Relaxed);
        self.fail_requests(requests, bytes, code);
    }

    /// Failed requests of a submission that is counted apart (the rest of
    /// it went on).
    pub fn fail_requests(&self, requests: usize, bytes: u64, code: ErrorCode) {
        self.failures[code_index(code)].fetch_add(requests as u64, Ordering::Relaxed);
        self.failed_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The latency histogram of submissions in size class `class`.
    pub fn latency(&self, class: usize) -> &Histogram {
        &self.latency.by_size[class.min(SIZE_CLASSES.len() - 1)]
    }

    pub fn snapshot(&self) -> FlowCounts {
        let l = &self.labels;
        FlowCounts {
            transport: l.transport.clone(),
            device: l.device.clone(),
            peer: l.peer.clone(),
            op: l.op.to_string(),
            memory: l.memory.to_string(),
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            submissions: self.submissions.load(Ordering::Relaxed),
            failures: ErrorCode::ALL
                .iter()
                .zip(&self.failures)
                .map(|(c, n)| (c.name().to_string(), n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            failed_bytes: self.failed_bytes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow() -> Flow {
        Flow::new(
            FlowLabels {
                transport: "tcp".into(),
                device: "cpu:0".into(),
                peer: "p".into(),
                op: "write",
                memory: "host",
            },
            Arc::new(Latencies::new("tcp", "write")),
        )
    }

    #[test]
    fn successes_and_failures_count_apart() {
        let f = flow();
        let mut one = super::super::histogram::Samples::default();
        one.record(1000);
        f.add(1, 3, 3 << 12);
        f.latency(size_class(3 << 12)).take(&mut one.clone());
        f.add(1, 1, 1 << 20);
        f.latency(size_class(1 << 20)).take(&mut one);
        f.fail(2, 100, ErrorCode::OutOfBounds);
        let s = f.snapshot();
        assert_eq!(
            (s.requests, s.bytes, s.submissions),
            (4, (3 << 12) + (1 << 20), 3)
        );
        assert_eq!(s.failures.get("OUT_OF_BOUNDS"), Some(&2));
        assert_eq!(s.failed_bytes, 100);
        let l = f.latency.snapshot();
        let sizes: Vec<_> = l
            .iter()
            .map(|l| (l.size.as_str(), l.histogram.count))
            .collect();
        assert_eq!(sizes, [("4-64KiB", 1), ("64KiB-1MiB", 1)]);
    }

    #[test]
    fn size_classes_include_their_upper_bound() {
        assert_eq!(size_class(1), 0);
        assert_eq!(size_class(4096), 0);
        assert_eq!(size_class(4097), 1);
        assert_eq!(size_class(1 << 20), 2);
        assert_eq!(size_class(u64::MAX), 4);
        let by_table = |len: u64| {
            SIZE_CLASSES
                .iter()
                .position(|(max, _)| len <= *max)
                .unwrap()
        };
        for (max, _) in &SIZE_CLASSES[..4] {
            for len in [max - 1, *max, max + 1, max / 2 + 1] {
                assert_eq!(size_class(len), by_table(len), "{len}");
            }
        }
    }
}
