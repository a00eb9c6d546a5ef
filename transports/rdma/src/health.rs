//! NIC health: consecutive failures, and a pause with exponential back-off
//! for a NIC that keeps failing. Time only decides when a paused NIC is
//! tried again; correctness never depends on it.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    consecutive: u32,
    paused_until: Option<Instant>,
    backoff: Duration,
    last: String,
}

#[derive(Default)]
pub struct Health(Mutex<State>);

/// What a failure did.
pub enum Verdict {
    /// Counted; not (newly) paused.
    Counted,
    /// Paused for this long (the back-off doubles each time).
    Paused(Duration),
}

impl Health {
    pub fn paused(&self, now: Instant) -> bool {
        self.0.lock().paused_until.is_some_and(|t| now < t)
    }

    /// Records a failure; pauses after `threshold` in a row, for `base`
    /// doubling up to `max` while the NIC keeps failing.
    pub fn failure(&self, why: &str, threshold: u32, base: Duration, max: Duration) -> Verdict {
        let mut s = self.0.lock();
        s.consecutive = s.consecutive.saturating_add(1);
        s.last = why.to_string();
        let now = Instant::now();
        if s.paused_until.is_some_and(|t| now < t) {
            return Verdict::Counted;
        }
        if s.consecutive >= threshold {
            s.backoff = if s.backoff.is_zero() {
                base
            } else {
                (s.backoff * 2).min(max)
            };
            s.paused_until = Some(now + s.backoff);
            return Verdict::Paused(s.backoff);
        }
        Verdict::Counted
    }

    /// Records a success; true when the NIC had been paused (it recovered).
    pub fn success(&self) -> bool {
        let mut s = self.0.lock();
        let was = s.paused_until.is_some();
        s.consecutive = 0;
        s.paused_until = None;
        s.backoff = Duration::ZERO;
        was
    }

    /// "paused 1.0 s more (last: ...)" or None.
    pub fn describe(&self, now: Instant) -> Option<String> {
        let s = self.0.lock();
        let t = s.paused_until.filter(|t| now < *t)?;
        Some(format!(
            "paused for {:.1} s more after {} failures in a row (last: {})",
            (t - now).as_secs_f64(),
            s.consecutive,
            s.last
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_after_the_threshold_and_backs_off() {
        let h = Health::default();
        let (base, max) = (Duration::from_secs(60), Duration::from_secs(200));
        assert!(matches!(h.failure("x", 3, base, max), Verdict::Counted));
        assert!(matches!(h.failure("x", 3, base, max), Verdict::Counted));
        assert!(matches!(h.failure("x", 3, base, max), Verdict::Paused(d) if d == base));
        assert!(h.paused(Instant::now()));
        // Failures while paused only count.
        assert!(matches!(h.failure("x", 3, base, max), Verdict::Counted));
        assert!(h.describe(Instant::now()).unwrap().contains("4 failures"));
        assert!(h.success());
        assert!(!h.paused(Instant::now()));
        assert!(!h.success());
    }
}
