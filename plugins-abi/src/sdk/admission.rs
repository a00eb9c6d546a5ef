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
//!   hostile connections costs one log line per interval, not one each;
//!   a hook ([`Refusals::counted_by`]) hands every refusal on as it is
//!   counted (a plugin passes it to the host's `count` service as
//!   `refused_<cause>`, which the engine exports as
//!   `ferry_refusals_total{listener, cause}`).

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
    /// It did not finish the exchange within the deadline (or, once
    /// served, a message it had begun).
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
/// Every kind, in the order of its number.
pub const ALL: [Refusal; KINDS] = [
    Refusal::Busy,
    Refusal::PerSource,
    Refusal::Auth,
    Refusal::Timeout,
    Refusal::Integrity,
    Refusal::PeerUser,
    Refusal::Full,
    Refusal::Protocol,
];
/// Short machine names: metric labels (`cause`) and counter names
/// (`refused_<cause>`). Never renamed: dashboards and alerts use them.
const CAUSES: [&str; KINDS] = [
    "busy",
    "per_source",
    "auth",
    "timeout",
    "integrity",
    "peer_user",
    "full",
    "protocol",
];
/// Counter names a plugin reports through the host's `count` service.
const COUNTERS: [&std::ffi::CStr; KINDS] = [
    c"refused_busy",
    c"refused_per_source",
    c"refused_auth",
    c"refused_timeout",
    c"refused_integrity",
    c"refused_peer_user",
    c"refused_full",
    c"refused_protocol",
];
/// The prefix of those counter names.
pub const COUNTER_PREFIX: &str = "refused_";
/// Human names, for log lines.
const NAMES: [&str; KINDS] = [
    "busy",
    "too many from one source",
    "wrong or missing token",
    "too slow (to authenticate, or mid-message)",
    "integrity check failed",
    "another user",
    "at the connection cap",
    "protocol violation",
];

impl Refusal {
    /// In words, for log lines ("wrong or missing token").
    pub fn name(self) -> &'static str {
        NAMES[self as usize]
    }

    /// The short machine name ("auth", "peer_user"): a metric label.
    pub fn cause(self) -> &'static str {
        CAUSES[self as usize]
    }

    /// The counter a plugin reports it as ("refused_auth").
    pub fn counter(self) -> &'static std::ffi::CStr {
        COUNTERS[self as usize]
    }

    /// The kind of a short machine name.
    pub fn from_cause(cause: &str) -> Option<Refusal> {
        CAUSES.iter().position(|c| *c == cause).map(|i| ALL[i])
    }
}

/// Called with every refusal as it is counted.
pub type Hook = Box<dyn Fn(Refusal) + Send + Sync>;

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
    hook: Option<Hook>,
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
            hook: None,
        }
    }

    /// Also hands every refusal to `hook` as it is counted (a plugin
    /// reports it through the host's `count` service:
    /// `move |r| host.count(r.counter(), None, 1)`).
    pub fn counted_by(mut self, hook: impl Fn(Refusal) + Send + Sync + 'static) -> Refusals {
        self.hook = Some(Box::new(hook));
        self
    }

    /// The listener's name in log lines.
    pub fn listener(&self) -> &'static str {
        self.what
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
        if let Some(hook) = &self.hook {
            hook(kind);
        }
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

    #[test]
    fn the_hook_sees_every_refusal_and_causes_have_short_names() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let r = Refusals::with_interval("test", Duration::from_secs(3600))
            .counted_by(move |k| s2.lock().unwrap().push(k));
        for k in ALL {
            r.record(k, String::new, |_| {});
        }
        r.record(Refusal::Auth, String::new, |_| {});
        assert_eq!(seen.lock().unwrap().len(), KINDS + 1);
        for (i, k) in ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
            assert_eq!(Refusal::from_cause(k.cause()), Some(*k));
            assert_eq!(
                k.counter().to_str().unwrap(),
                format!("{COUNTER_PREFIX}{}", k.cause())
            );
            assert!(k
                .cause()
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_'));
        }
        assert_eq!(Refusal::from_cause("nope"), None);
    }
}
