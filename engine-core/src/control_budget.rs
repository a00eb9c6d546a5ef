//! The control listener's budget for frame bodies: bytes are reserved as
//! they arrive, never when a header claims them, within a total
//! ([`MAX_BODIES_IN_FLIGHT`]) and a share per host ([`MAX_BODIES_PER_HOST`]),
//! so eight headers claiming 16 MiB each hold nothing, and one host cannot
//! take what the others need. A reservation is given back when its body is
//! dropped (the request answered, or the connection closed).

use crate::control::{MAX_BODIES_IN_FLIGHT, MAX_BODY};
use ferry_plugins_abi::sdk::admission::Source;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Body bytes one host's connections may hold at once (two maximal frames).
pub(crate) const MAX_BODIES_PER_HOST: usize = 2 * MAX_BODY;

#[derive(Default, Debug)]
struct Usage {
    total: usize,
    by_host: HashMap<Source, usize>,
}

/// The body bytes held by one listener, in total and per host.
#[derive(Clone, Debug)]
pub(crate) struct BodyBudget {
    usage: Arc<Mutex<Usage>>,
    total: usize,
    per_host: usize,
}

/// Bytes reserved for one host; given back when dropped.
#[derive(Debug)]
pub(crate) struct Held {
    budget: BodyBudget,
    host: Source,
    bytes: usize,
}

impl Default for BodyBudget {
    fn default() -> Self {
        BodyBudget::new(MAX_BODIES_IN_FLIGHT, MAX_BODIES_PER_HOST)
    }
}

impl BodyBudget {
    pub(crate) fn new(total: usize, per_host: usize) -> BodyBudget {
        BodyBudget {
            usage: Arc::default(),
            total,
            per_host,
        }
    }

    /// An empty reservation for `host`, to grow as bytes arrive.
    pub(crate) fn hold(&self, host: Source) -> Held {
        Held {
            budget: self.clone(),
            host,
            bytes: 0,
        }
    }

    /// Bytes held now, in all.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        self.lock().total
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Held {
    /// Reserves up to `want` more bytes: as many as both the total and the
    /// host's share still allow (0 when either is spent).
    pub(crate) fn grow(&mut self, want: usize) -> usize {
        let b = &self.budget;
        let mut u = b.lock();
        let host_now = u.by_host.get(&self.host).copied().unwrap_or(0);
        let room = b
            .total
            .saturating_sub(u.total)
            .min(b.per_host.saturating_sub(host_now));
        let got = want.min(room);
        if got > 0 {
            u.total += got;
            *u.by_host.entry(self.host).or_insert(0) += got;
            self.bytes += got;
        }
        got
    }

    /// Gives back what is reserved beyond `bytes`.
    pub(crate) fn shrink_to(&mut self, bytes: usize) {
        if bytes >= self.bytes {
            return;
        }
        let extra = self.bytes - bytes;
        self.bytes = bytes;
        let mut u = self.budget.lock();
        u.total = u.total.saturating_sub(extra);
        if let Some(n) = u.by_host.get_mut(&self.host) {
            *n = n.saturating_sub(extra);
            if *n == 0 {
                u.by_host.remove(&self.host);
            }
        }
    }

    /// The host it reserves for.
    pub(crate) fn host(&self) -> Source {
        self.host
    }

    /// Bytes reserved.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Moves this reservation into a new one (which goes with a finished
    /// body) and leaves this one empty.
    pub(crate) fn split_off(&mut self) -> Held {
        let bytes = std::mem::take(&mut self.bytes);
        Held {
            budget: self.budget.clone(),
            host: self.host,
            bytes,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(i: u8) -> Source {
        Source::ip(std::net::Ipv4Addr::new(127, 0, 0, i).into())
    }

    #[test]
    fn a_claim_holds_nothing_and_bytes_are_capped_per_host_and_in_total() {
        let b = BodyBudget::new(100, 40);
        // Holding a reservation costs nothing until it grows.
        let idle: Vec<Held> = (0..8).map(|_| b.hold(host(2))).collect();
        assert_eq!(b.in_use(), 0);
        let mut a1 = b.hold(host(2));
        let mut a2 = b.hold(host(2));
        assert_eq!(a1.grow(30), 30);
        // The host's share is 40: 10 more, then nothing.
        assert_eq!(a2.grow(30), 10);
        assert_eq!(a2.grow(1), 0);
        // Other hosts still get theirs, up to the total.
        let mut c = b.hold(host(3));
        let mut d = b.hold(host(4));
        assert_eq!(c.grow(40), 40);
        assert_eq!(d.grow(40), 20);
        assert_eq!(b.in_use(), 100);
        // Given back when dropped, to whoever asks next.
        drop(a1);
        assert_eq!(b.in_use(), 70);
        assert_eq!(d.grow(40), 20);
        let mut e = b.hold(host(5));
        assert_eq!(e.grow(100), 10);
        assert_eq!(a2.grow(100), 0, "the total is spent");
        drop(idle);
        drop((a2, c, d, e));
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn a_finished_body_takes_its_bytes_along() {
        let b = BodyBudget::new(100, 100);
        let mut h = b.hold(host(2));
        h.grow(60);
        let body = h.split_off();
        assert_eq!((h.bytes(), body.bytes(), b.in_use()), (0, 60, 60));
        h.grow(30);
        h.shrink_to(10);
        assert_eq!((h.bytes(), b.in_use()), (10, 70));
        drop(h);
        assert_eq!(b.in_use(), 60);
        drop(body);
        assert_eq!(b.in_use(), 0);
    }
}
