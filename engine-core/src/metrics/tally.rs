//! A batch's counts on their way to its flows. Each completion adds to
//! its batch, under the lock the batch takes anyway; the batch adds what
//! it gathered to the shared flows when nothing is pending, and at least
//! every [`FLUSH_NS`] while requests run. That is a few relaxed atomic adds
//! per batch, not per request: with copy threads finishing requests of one
//! batch on several cores, per-request adds to one flow's counters passed
//! their cache lines between cores on every completion.

use super::flow::{size_class, Flow, Stamp};
use super::histogram::Samples;
use ferry_plugins_abi::ErrorCode;
use std::sync::Arc;

/// Longest a finished request's counts wait in its batch before they
/// show: short against `ferry top`'s one-second refresh.
pub const FLUSH_NS: u64 = 10_000_000;

/// A submission about to be handed over: the flow it counts in, its
/// bytes, and when it started (read once per dispatch: a clock read per
/// request would cost more than the counting).
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
    started: Stamp,
}

/// Counts of one flow and size class, gathered by one batch.
struct Entry {
    flow: Arc<Flow>,
    class: usize,
    submissions: u64,
    requests: u64,
    bytes: u64,
    samples: Samples,
}

/// One batch's counts not yet added to their flows.
#[derive(Default)]
pub struct BatchTally {
    /// Few: a batch mostly goes to one peer over one transport.
    entries: Vec<Entry>,
    /// When counts were last added to the flows (or the first submission).
    flushed: Option<Stamp>,
    held: bool,
}

impl BatchTally {
    /// Where a group submitted with `t` counts.
    pub fn add(&mut self, t: Tally<'_>) -> GroupTally {
        let class = size_class(t.bytes);
        let found = self
            .entries
            .iter()
            .position(|e| e.class == class && Arc::ptr_eq(&e.flow, t.flow));
        let entry = found.unwrap_or_else(|| {
            self.entries.push(Entry {
                flow: t.flow.clone(),
                class,
                submissions: 0,
                requests: 0,
                bytes: 0,
                samples: Samples::default(),
            });
            self.entries.len() - 1
        });
        self.flushed.get_or_insert(t.started);
        GroupTally {
            entry: entry as u32,
            bytes: t.bytes,
            started: t.started,
        }
    }

    /// A group of `requests` finished at `now`. Failures are rare and go
    /// to their flow at once.
    pub fn finish(
        &mut self,
        g: GroupTally,
        requests: usize,
        failed: Option<ErrorCode>,
        now: Stamp,
    ) {
        let Some(e) = self.entries.get_mut(g.entry as usize) else {
            return;
        };
        match failed {
            Some(code) => e.flow.fail(requests, g.bytes, code),
            None => {
                e.submissions += 1;
                e.requests += requests as u64;
                e.bytes += g.bytes;
                e.samples.record(g.started.ns_until(now));
                self.held = true;
            }
        }
    }

    /// Adds the gathered counts to their flows when the batch has nothing
    /// pending (`idle`) or they have waited [`FLUSH_NS`].
    pub fn flush_if_due(&mut self, idle: bool, now: Stamp) {
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
    use super::super::flow::{Latencies, SIZE_CLASSES};
    use super::super::FlowLabels;
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

    #[test]
    fn counts_show_when_the_batch_is_idle_and_only_once() {
        let f = flow();
        let mut t = BatchTally::default();
        let now = Stamp::now();
        let small = t.add(Tally {
            flow: &f,
            bytes: 4096,
            started: now,
        });
        let big = t.add(Tally {
            flow: &f,
            bytes: 1 << 20,
            started: now,
        });
        let again = t.add(Tally {
            flow: &f,
            bytes: 4096,
            started: now,
        });
        assert_eq!(t.entries.len(), 2, "one entry per flow and size class");
        t.finish(small, 2, None, now);
        t.finish(big, 1, None, now);
        t.flush_if_due(false, now);
        assert_eq!(
            f.snapshot().requests,
            0,
            "not due: nothing idle, no time passed"
        );
        t.finish(again, 1, Some(ErrorCode::Timeout), now);
        assert_eq!(
            f.snapshot().failures.get("TIMEOUT"),
            Some(&1),
            "failures at once"
        );
        t.flush_if_due(true, now);
        t.flush_if_due(true, now);
        let s = f.snapshot();
        assert_eq!(
            (s.submissions, s.requests, s.bytes),
            (3, 3, 4096 + (1 << 20))
        );
        let counts: Vec<u64> = (0..SIZE_CLASSES.len())
            .map(|c| f.latency(c).snapshot().count)
            .collect();
        assert_eq!(counts, [1, 0, 1, 0, 0]);
    }

    #[test]
    fn a_dropped_batch_still_reports_what_it_gathered() {
        let f = flow();
        let mut t = BatchTally::default();
        let now = Stamp::now();
        let g = t.add(Tally {
            flow: &f,
            bytes: 10,
            started: now,
        });
        t.finish(g, 1, None, now);
        drop(t);
        assert_eq!(f.snapshot().bytes, 10);
    }
}
