//! Who gets a listener's time before proving itself, and how refusals are
//! reported: shared by the control plane and every transport's listener.
//!
//! - [`PreAuthPool`]: connections still authenticating get their own small
//!   pool, per source and in total, apart from the caps on served
//!   connections, so unauthenticated ones can never take the places of
//!   authenticated peers. Each such connection has a short deadline
//!   (FERRY_AUTH_TIMEOUT_MS, 1 s by default); one that finds the pool full is
//!   told BUSY and closed at once.
//! - [`Refusals`]: every refusal is counted by kind, and logged at most once
//!   per interval with the counts since the last line, so a flood of
//!   hostile connections costs one log line per interval, not one each.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections authenticating at once, in all (auth.max_pending).
pub const DEFAULT_MAX_PENDING: usize = 64;
/// Of those, from one source (auth.max_pending_per_host).
pub const DEFAULT_MAX_PENDING_PER_SOURCE: usize = 8;
/// How long a new connection has to complete the exchange (auth_timeout_ms).
pub const DEFAULT_AUTH_TIMEOUT_MS: u64 = 1000;
/// At most one refusal line per this interval and listener.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why a connection was refused or closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Refusal {
    /// The pre-authentication pool (total) was full.
    Busy = 0,
    /// Its source had too many connections authenticating (or served).
    PerSource = 1,
    /// It did not prove it knows the token (or proved the wrong one).
    Auth = 2,
    /// It did not finish the exchange within the deadline.
    Timeout = 3,
    /// A message after the exchange failed its tag.
    Integrity = 4,
    /// The peer process is another user (SO_PEERCRED).
    PeerUser = 5,
    /// The served connections were at their cap.
    Full = 6,
    /// It broke the protocol (malformed, unsolicited, over a limit).
    Protocol = 7,
}

const KINDS: usize = 8;
const NAMES: [&str; KINDS] = [
    "busy",
    "too many from one source",
    "wrong or missing token",
    "too slow to authenticate",
    "integrity check failed",
    "another user",
    "at the connection cap",
    "protocol violation",
];

impl Refusal {
    pub fn name(self) -> &'static str {
        NAMES[self as usize]
    }
}

struct LogState {
    last: Option<Instant>,
    since: [u64; KINDS],
}

/// Refusal counts of one listener and their throttled log.
pub struct Refusals {
    what: &'static str,
    counts: [AtomicU64; KINDS],
    log: Mutex<LogState>,
    interval: Duration,
}

impl Refusals {
    /// `what` names the listener in log lines ("control", "tcp", "shm").
    pub fn new(what: &'static str) -> Refusals {
        Refusals::with_interval(what, LOG_INTERVAL)
    }

    pub fn with_interval(what: &'static str, interval: Duration) -> Refusals {
        Refusals {
            what,
            counts: Default::default(),
            log: Mutex::new(LogState {
                last: None,
                since: [0; KINDS],
            }),
            interval,
        }
    }

    /// Refusals of `kind` so far.
    pub fn count(&self, kind: Refusal) -> u64 {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }

    /// All refusals so far.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Counts one refusal and, at most once per interval, hands `log` one
    /// line with the counts since the last line and this refusal's detail.
    pub fn record(&self, kind: Refusal, detail: impl FnOnce() -> String, log: impl FnOnce(&str)) {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        let mut st = self.log.lock().unwrap_or_else(|p| p.into_inner());
        st.since[kind as usize] += 1;
        if st.last.is_some_and(|t| t.elapsed() < self.interval) {
            return;
        }
        let total: u64 = st.since.iter().sum();
        let parts: Vec<String> = st
            .since
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| format!("{n} {}", NAMES[i]))
            .collect();
        let window = match st.last {
            None => String::new(),
            Some(t) => format!(" in the last {} s", t.elapsed().as_secs().max(1)),
        };
        st.last = Some(Instant::now());
        st.since = [0; KINDS];
        drop(st);
        log(&format!(
            "{}: refused {total} connection(s){window} ({}); latest: {}; at most one such line \
             every {} s",
            self.what,
            parts.join(", "),
            detail(),
            self.interval.as_secs()
        ));
    }
}

/// A source for per-source caps: an IPv4 address, an IPv6 /64 (one host
/// usually owns a whole /64), or any other key (a uid).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Ip(IpAddr),
    Other(u64),
}

impl Source {
    pub fn ip(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::Ip(IpAddr::V4(v4)),
                None => {
                    let s = v6.segments();
                    Source::Ip(IpAddr::V6(std::net::Ipv6Addr::new(
                        s[0], s[1], s[2], s[3], 0, 0, 0, 0,
                    )))
                }
            },
            v4 => Source::Ip(v4),
        }
    }
}

#[derive(Default)]
struct PoolState {
    total: usize,
    by_source: HashMap<Source, usize>,
}

/// The pool of connections still authenticating.
#[derive(Clone)]
pub struct PreAuthPool {
    state: Arc<Mutex<PoolState>>,
    max_total: usize,
    max_per_source: usize,
}

/// A place in the pool; released when dropped (authenticated or not).
pub struct PreAuthSlot {
    pool: PreAuthPool,
    source: Source,
}

impl PreAuthPool {
    pub fn new(max_total: usize, max_per_source: usize) -> PreAuthPool {
        PreAuthPool {
            state: Arc::default(),
            max_total: max_total.max(1),
            max_per_source: max_per_source.max(1),
        }
    }

    /// A place for a new connection from `source`, or why there is none.
    pub fn enter(&self, source: Source) -> Result<PreAuthSlot, Refusal> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let from = st.by_source.get(&source).copied().unwrap_or(0);
        if from >= self.max_per_source {
            return Err(Refusal::PerSource);
        }
        if st.total >= self.max_total {
            return Err(Refusal::Busy);
        }
        st.total += 1;
        *st.by_source.entry(source).or_insert(0) += 1;
        Ok(PreAuthSlot {
            pool: self.clone(),
            source,
        })
    }

    /// Connections authenticating now.
    pub fn pending(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).total
    }
}

impl Drop for PreAuthSlot {
    fn drop(&mut self) {
        let mut st = self.pool.state.lock().unwrap_or_else(|p| p.into_inner());
        st.total = st.total.saturating_sub(1);
        if let Some(n) = st.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                st.by_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_caps_each_source_and_the_total_and_frees_on_drop() {
        let pool = PreAuthPool::new(3, 2);
        let a = Source::ip("127.0.0.2".parse().unwrap());
        let b = Source::ip("127.0.0.3".parse().unwrap());
        let a1 = pool.enter(a).unwrap();
        let _a2 = pool.enter(a).unwrap();
        assert_eq!(pool.enter(a).err(), Some(Refusal::PerSource));
        let _b1 = pool.enter(b).unwrap();
        assert_eq!(pool.enter(b).err(), Some(Refusal::Busy));
        drop(a1);
        assert!(pool.enter(b).is_ok());
        // One IPv6 host is one source however many addresses of its /64 it uses.
        let x = Source::ip("2001:db8::1".parse().unwrap());
        let y = Source::ip("2001:db8::2".parse().unwrap());
        assert_eq!(x, y);
    }

    #[test]
    fn refusals_are_counted_each_and_logged_once_per_interval() {
        let r = Refusals::with_interval("test", Duration::from_secs(3600));
        let mut lines = Vec::new();
        for i in 0..770 {
            r.record(
                if i % 2 == 0 {
                    Refusal::Auth
                } else {
                    Refusal::Busy
                },
                || format!("from peer {i}"),
                |l| lines.push(l.to_string()),
            );
        }
        assert_eq!(r.total(), 770);
        assert_eq!(r.count(Refusal::Auth), 385);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("refused 1 connection"), "{lines:?}");
        let r = Refusals::with_interval("test", Duration::ZERO);
        let mut n = 0;
        r.record(Refusal::Auth, String::new, |_| n += 1);
        r.record(Refusal::Auth, String::new, |_| n += 1);
        assert_eq!(n, 2);
    }
}
