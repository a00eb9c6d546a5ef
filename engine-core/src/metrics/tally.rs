//! A batch's counts on their way to its flows. Each completion adds to
//! its batch, under the lock the batch takes anyway; the batch adds what
//! it gathered to the shared flows when nothing is pending, and about
//! every [`FLUSH_NS`] while requests run. That is a few relaxed atomic adds
//! per batch, not per request: with copy threads finishing requests of one
//! batch on several cores, per-request adds to one flow's counters passed
//! their cache lines between cores on every completion.
//!
//! Latency is one sample per hand-over: the requests of one flow and size
//! class that one submit gave a transport, timed from the hand-over to the
//! last of them finishing (for a single request, its own latency). Timing
//! each request would read the clock once per request, and that read alone
//! costs more than the whole 2% budget of a 4 KiB request over shm on a
//! big host (17 ns of about 750 on the H200).

use super::flow::{size_class, Flow, Stamp};
use super::histogram::Samples;
use ferry_plugins_abi::ErrorCode;
use smallvec::SmallVec;
use std::sync::Arc;

/// About the longest a finished request's counts wait in its batch before
/// they show: short against `ferry top`'s one-second refresh.
pub const FLUSH_NS: u64 = 10_000_000;

/// Between two checks of the clock for [`FLUSH_NS`], at most this many
/// completions of small requests.
const CHECK_EVERY: u32 = 64;

/// Requests this large read the clock when they finish: against moving
/// them, the read is nothing.
const LARGE: u64 = 1 << 20;

/// A submission about to be handed over: the flow it counts in, its
/// bytes, and when it was handed over (read once per dispatch).
#[derive(Clone, Copy)]
pub struct Tally<'a> {
    pub flow: &'a Arc<Flow>,
    pub bytes: u64,
    pub started: Stamp,
}

/// What a completion group carries to its end: where in its batch's
/// tally it counts.
#[derive(Clone, Copy, Debug)]
pub struct GroupTally {
    entry: u32,
    bytes: u64,
}

/// How many of the last entries a new group looks through for its own.
const RECENT: usize = 8;

/// Counts of one hand-over's groups of one flow and size class.
struct Entry {
    flow: Arc<Flow>,
    class: usize,
    started: Stamp,
    /// Its groups not finished yet.
    pending: u32,
    /// Whether one of them succeeded (a hand-over that only failed has no
    /// latency to show).
    succeeded: bool,
    submissions: u64,
    requests: u64,
    bytes: u64,
    samples: Samples,
}

impl Entry {
    /// Its groups finished and what they counted went to the flow.
    fn spent(&self) -> bool {
        self.pending == 0 && self.submissions == 0 && self.samples.is_empty()
    }
}

/// One batch's counts not yet added to their flows.
#[derive(Default)]
pub struct BatchTally {
    /// Few: a batch mostly goes to one peer over one transport.
    entries: SmallVec<[Entry; 1]>,
    /// When counts were last added to the flows (or the first hand-over).
    flushed: Option<Stamp>,
    /// Completions since the clock was last read.
    unchecked: u32,
    held: bool,
}

impl BatchTally {
    /// Where a group submitted with `t` counts.
    pub fn add(&mut self, t: Tally<'_>) -> GroupTally {
        let class = size_class(t.bytes);
        let same =
            |e: &Entry| e.class == class && e.started == t.started && Arc::ptr_eq(&e.flow, t.flow);
        // A hand-over's entries are the last ones pushed, and mostly one.
        let last = self.entries.len().wrapping_sub(1);
        let found = match self.entries.last_mut() {
            Some(e) if same(e) => {
                e.pending += 1;
                return GroupTally {
                    entry: last as u32,
                    bytes: t.bytes,
                };
            }
            _ => {
                let recent = self.entries.len().saturating_sub(RECENT);
                self.entries[recent..]
                    .iter()
                    .rposition(same)
                    .map(|i| recent + i)
            }
        };
        let entry = match found {
            Some(i) => i,
            None => {
                let fresh = Entry {
                    flow: t.flow.clone(),
                    class,
                    started: t.started,
                    pending: 0,
                    succeeded: false,
                    submissions: 0,
                    requests: 0,
                    bytes: 0,
                    samples: Samples::default(),
                };
                // A batch reused for submit after submit keeps one entry.
                match self.entries.last_mut() {
                    Some(last) if last.spent() => *last = fresh,
                    _ => self.entries.push(fresh),
                }
                self.entries.len() - 1
            }
        };
        self.entries[entry].pending += 1;
        self.flushed.get_or_insert(t.started);
        GroupTally {
            entry: entry as u32,
            bytes: t.bytes,
        }
    }

    /// `requests` of group `g`, `bytes` of it, failed while the rest went
    /// on (Batch::fail_within): they count as failures now, and the group
    /// finishes with the rest.
    pub fn fail_part(&mut self, g: &mut GroupTally, requests: usize, bytes: u64, code: ErrorCode) {
        if let Some(e) = self.entries.get(g.entry as usize) {
            e.flow.fail_requests(requests, bytes, code);
        }
        g.bytes = g.bytes.saturating_sub(bytes);
    }

    /// A group of `requests` finished; `idle`: nothing else in the batch
    /// is pending. Failures are rare and go to their flow at once.
    pub fn finish(
        &mut self,
        g: GroupTally,
        requests: usize,
        failed: Option<ErrorCode>,
        idle: bool,
    ) {
        let Some(e) = self.entries.get_mut(g.entry as usize) else {
            return;
        };
        e.pending = e.pending.saturating_sub(1);
        match failed {
            Some(code) => e.flow.fail(requests, g.bytes, code),
            None => {
                e.submissions += 1;
                e.requests += requests as u64;
                e.bytes += g.bytes;
                e.succeeded = true;
                self.held = true;
            }
        }
        self.unchecked += 1;
        let last = e.pending == 0;
        if !(last || idle || g.bytes >= LARGE || self.unchecked >= CHECK_EVERY) {
            return;
        }
        let now = Stamp::now();
        self.unchecked = 0;
        if last && std::mem::take(&mut e.succeeded) {
            e.samples.record(e.started.ns_until(now));
            self.held = true;
        }
        let due = idle || self.flushed.is_none_or(|t| t.ns_until(now) >= FLUSH_NS);
        if self.held && due {
            self.flush();
            self.flushed = Some(now);
        }
    }

    fn flush(&mut self) {
        for e in &mut self.entries {
            if e.submissions > 0 {
                e.flow.add(
                    std::mem::take(&mut e.submissions),
                    std::mem::take(&mut e.requests),
                    std::mem::take(&mut e.bytes),
                );
            }
            if !e.samples.is_empty() {
                e.flow.latency(e.class).take(&mut e.samples);
            }
        }
        self.held = false;
    }
}

impl Drop for BatchTally {
    /// A batch dropped with counts gathered (its waiter gave up) still
    /// reports them.
    fn drop(&mut self) {
        if self.held {
            self.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::flow::{FlowLabels, Latencies, SIZE_CLASSES};
    use super::*;

    fn flow() -> Arc<Flow> {
        Arc::new(Flow::new(
            FlowLabels {
                transport: "shm".into(),
                device: "cpu:0".into(),
                peer: "p".into(),
                op: "write",
                memory: "host",
            },
            Arc::new(Latencies::new("shm", "write")),
        ))
    }

    fn tally(f: &Arc<Flow>, bytes: u64, started: Stamp) -> Tally<'_> {
        Tally {
            flow: f,
            bytes,
            started,
        }
    }

    fn latency_counts(f: &Flow) -> Vec<u64> {
        (0..SIZE_CLASSES.len())
            .map(|c| f.latency(c).snapshot().count)
            .collect()
    }

    #[test]
    fn counts_show_when_the_batch_is_idle_and_only_once() {
        let f = flow();
        let mut t = BatchTally::default();
        let now = Stamp::now();
        let small = t.add(tally(&f, 4096, now));
        let big = t.add(tally(&f, 1 << 20, now));
        let again = t.add(tally(&f, 4096, now));
        assert_eq!(t.entries.len(), 2, "one entry per flow and size class");
        t.finish(small, 2, None, false);
        t.finish(big, 1, None, false);
        assert_eq!(
            f.snapshot().requests,
            0,
            "not due: nothing idle, no time passed"
        );
        t.finish(again, 1, Some(ErrorCode::Timeout), true);
        assert_eq!(
            f.snapshot().failures.get("TIMEOUT"),
            Some(&1),
            "failures at once"
        );
        let s = f.snapshot();
        assert_eq!(
            (s.submissions, s.requests, s.bytes),
            (3, 3, 4096 + (1 << 20))
        );
        assert_eq!(
            latency_counts(&f),
            [1, 0, 1, 0, 0],
            "one sample per hand-over and class"
        );
        drop(t);
        assert_eq!(f.snapshot().requests, 3, "nothing counted twice");
    }

    #[test]
    fn each_hand_over_is_one_latency_sample_and_a_reused_batch_keeps_one_entry() {
        let f = flow();
        let mut t = BatchTally::default();
        for round in 0..5 {
            let started = Stamp::now();
            let groups: Vec<_> = (0..3).map(|_| t.add(tally(&f, 100, started))).collect();
            for (i, g) in groups.into_iter().enumerate() {
                t.finish(g, 1, None, i == 2);
            }
            assert_eq!(latency_counts(&f)[0], round + 1);
        }
        assert_eq!(t.entries.len(), 1);
        assert_eq!(f.snapshot().requests, 15);
    }

    #[test]
    fn a_hand_over_that_only_failed_has_no_latency() {
        let f = flow();
        let mut t = BatchTally::default();
        let g = t.add(tally(&f, 100, Stamp::now()));
        t.finish(g, 1, Some(ErrorCode::Connection), true);
        assert_eq!(latency_counts(&f), [0; 5]);
        assert_eq!(f.snapshot().failures.get("CONNECTION"), Some(&1));
    }

    #[test]
    fn a_dropped_batch_still_reports_what_it_gathered() {
        let f = flow();
        let mut t = BatchTally::default();
        let now = Stamp::now();
        let a = t.add(tally(&f, 10, now));
        let _never_finishes = t.add(tally(&f, 10, now));
        t.finish(a, 1, None, false);
        drop(t);
        assert_eq!(f.snapshot().bytes, 10);
    }
}
