//! The etcd members one store talks to, and fail-over between them.
//!
//! Every call is an HTTP/1.1 POST of JSON to etcd's v3 gateway
//! (`/v3/kv/range`, ...; etcd 3.4 and newer serve it on the client port)
//! with a deadline. A call goes to the member that answered last; one that
//! fails is marked down and the call moves on to the next member, within
//! the same deadline:
//!
//! - members that answered last come first, then those not tried yet (or
//!   re-probed), then those marked down: the ones that answered (without a
//!   leader, or slowly) before the ones that did not answer at all, which
//!   may still be starting. A down member is skipped while any other can
//!   serve; when its back-off (250 ms doubling to 5 s) is over it is
//!   re-probed (the keeper asks it for its status each round);
//! - the member that answered last gets half of the time left while other
//!   members remain, any other an equal share (a member still catching up
//!   after a restart may hang until its share is over); members that
//!   answered but could not serve are asked (status, local to the member)
//!   whether they have a leader, so that the error can say "no quorum";
//! - no call waits longer than its deadline: every connect, read and the
//!   gateway's own gRPC deadline are cut to the time left;
//! - etcds:// is the same over TLS (tls.rs); with an etcd user, each call
//!   carries its token, got first and again when etcd refuses it (once
//!   per call; auth.rs).

use super::auth::{self, Credentials};
use super::failure::{CallError, Failure};
use super::tls::{self, Tls};
use parking_lot::Mutex;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Largest reply read (a segment list of thousands of descriptors fits).
const MAX_REPLY: u64 = 64 << 20;
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Time a status probe may take at most (it is answered locally).
const PROBE: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not used yet.
    Unknown,
    /// Its last call succeeded.
    Good,
    /// Its last call failed; skipped until `retry_at` unless nothing else
    /// is left.
    Down,
}

struct Health {
    state: State,
    failures: u32,
    retry_at: Instant,
    /// When it went down (the longest-down member is re-probed first).
    since: Instant,
    /// Whether it answered when it last failed (it had no leader, or was
    /// slow): such a member is tried before one that did not answer at
    /// all, which may be restarting.
    answered: bool,
}

struct Member {
    /// "http://host:port" or "https://host:port"
    url: String,
    /// "host:port", as errors and logs name it.
    shown: String,
}

pub struct Pool {
    agent: ureq::Agent,
    members: Vec<Member>,
    health: Mutex<Vec<Health>>,
    /// The member that answered last.
    preferred: Mutex<usize>,
    /// etcds://: the certificates, and how to say why a handshake failed.
    tls: Option<Tls>,
    /// The etcd user Ferry authenticates as, and its token.
    creds: Option<Credentials>,
    /// The keys Ferry works on ("/ferry/segments/"), for messages.
    keys: String,
}

/// What one POST to one member gave.
enum Outcome {
    Ok(Value),
    /// A definite answer from etcd: (gRPC code, message).
    Refused(i64, String),
    Failed(Failure),
}

impl Pool {
    /// `endpoints` are "http://host:port" ("https://" with `tls`). No
    /// network I/O here.
    pub fn new(
        endpoints: &[String],
        tls: Option<Tls>,
        creds: Option<Credentials>,
        keys: String,
    ) -> Pool {
        let mut builder = ureq::Agent::config_builder()
            // Replies with an error status carry etcd's reason: read them.
            .http_status_as_error(false)
            .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
            .max_idle_connections_per_host(4);
        if let Some(t) = &tls {
            builder = builder.tls_config(t.config.clone());
        }
        let agent: ureq::Agent = builder.build().into();
        let now = Instant::now();
        let members: Vec<Member> = endpoints
            .iter()
            .map(|u| Member {
                url: u.trim_end_matches('/').to_string(),
                shown: u
                    .split_once("://")
                    .map_or(u.as_str(), |(_, hp)| hp)
                    .trim_end_matches('/')
                    .to_string(),
            })
            .collect();
        let n = members.len().max(1);
        Pool {
            agent,
            health: Mutex::new(
                (0..members.len())
                    .map(|_| Health {
                        state: State::Unknown,
                        failures: 0,
                        retry_at: now,
                        since: now,
                        answered: false,
                    })
                    .collect(),
            ),
            // Processes start on different members, so that a cluster's
            // engines spread their load.
            preferred: Mutex::new(std::process::id() as usize % n),
            members,
            tls,
            creds,
            keys,
        }
    }

    /// "TLS (...), etcd user \"ferry\"" for the start-up log line.
    pub fn describe(&self) -> String {
        let mut parts = vec![self
            .tls
            .as_ref()
            .map_or_else(|| "plain HTTP".to_string(), Tls::describe)];
        if let Some(c) = &self.creds {
            parts.push(format!("etcd user {:?}", c.user));
        }
        parts.join(", ")
    }

    /// "host:port,host:port" for messages.
    pub fn shown(&self) -> String {
        self.members
            .iter()
            .map(|m| m.shown.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The order in which members are tried now.
    fn order(&self) -> Vec<usize> {
        let now = Instant::now();
        let preferred = *self.preferred.lock();
        let health = self.health.lock();
        let n = health.len();
        let mut order: Vec<usize> = (0..n).map(|k| (preferred + k) % n).collect();
        // Stable: ties keep the rotation that starts at the preferred one.
        order.sort_by_key(|&i| {
            let h = &health[i];
            match h.state {
                State::Good => (0, Duration::ZERO),
                State::Unknown => (1, Duration::ZERO),
                // Down: those that answered (without a leader, or slowly)
                // before those that did not answer at all, which may still
                // be starting; back-off over before back-off running.
                State::Down => {
                    let rank = 2 + 2 * u8::from(!h.answered);
                    if h.retry_at <= now {
                        (rank, Duration::MAX - (now - h.since))
                    } else {
                        (rank + 1, h.retry_at - now)
                    }
                }
            }
        });
        order
    }

    fn state(&self, i: usize) -> State {
        self.health.lock()[i].state
    }

    fn mark_good(&self, i: usize) {
        let mut health = self.health.lock();
        let h = &mut health[i];
        if h.failures > 0 {
            log::info!(
                "metadata: etcd endpoint {} answers again",
                self.members[i].shown
            );
        }
        h.state = State::Good;
        h.failures = 0;
    }

    fn mark_down(&self, i: usize, answered: bool) {
        let now = Instant::now();
        let mut health = self.health.lock();
        let h = &mut health[i];
        h.answered = answered;
        if h.state != State::Down {
            h.since = now;
        }
        h.state = State::Down;
        h.failures = h.failures.saturating_add(1);
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (h.failures - 1).min(5))
            .min(MAX_BACKOFF);
        h.retry_at = now + backoff;
    }

    /// POSTs `body` to `path` ("/v3/kv/range") on the first member that
    /// serves it, within `deadline`; as the etcd user when there is one,
    /// with a new token when etcd refuses the one it had (once).
    pub fn call(&self, path: &str, body: &Value, deadline: Instant) -> Result<Value, CallError> {
        let mut result = self.call_authenticated(path, &body.to_string(), deadline);
        if let Err(CallError::Etcd { code, message, .. }) = &mut result {
            if let Some(m) = auth::explain(self.creds.as_ref(), &self.keys, *code, message) {
                *message = m;
            }
        }
        result
    }

    fn call_authenticated(
        &self,
        path: &str,
        body: &str,
        deadline: Instant,
    ) -> Result<Value, CallError> {
        match &self.creds {
            None => self.call_as(path, body, deadline, None),
            Some(creds) => {
                let token = self.token(creds, deadline)?;
                match self.call_as(path, body, deadline, token.as_deref()) {
                    Err(CallError::Etcd { code, message, .. })
                        if auth::token_refused(code, &message)
                            || (token.is_none() && auth::user_required(code, &message)) =>
                    {
                        log::debug!("metadata: etcd refused the token ({message}); a new one");
                        {
                            let mut t = creds.token.lock();
                            if *t == token {
                                *t = None;
                            }
                        }
                        creds
                            .auth_off
                            .store(false, std::sync::atomic::Ordering::Relaxed);
                        let token = self.token(creds, deadline)?;
                        self.call_as(path, body, deadline, token.as_deref())
                    }
                    r => r,
                }
            }
        }
    }

    /// The token to send: the one held, or a new one from etcd; None when
    /// etcd has authentication off.
    fn token(&self, creds: &Credentials, deadline: Instant) -> Result<Option<String>, CallError> {
        use std::sync::atomic::Ordering;
        let mut held = creds.token.lock();
        if held.is_some() {
            return Ok(held.clone());
        }
        if creds.auth_off.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let body = creds.request().to_string();
        match self.call_as("/v3/auth/authenticate", &body, deadline, None) {
            Ok(v) => match v.get("token").and_then(Value::as_str) {
                Some(t) if !t.is_empty() => {
                    *held = Some(t.to_string());
                    Ok(held.clone())
                }
                _ => Err(CallError::Etcd {
                    endpoint: self.shown(),
                    code: 0,
                    message: "malformed authenticate reply (no token)".into(),
                }),
            },
            Err(CallError::Etcd { code, message, .. })
                if code == auth::GRPC_FAILED_PRECONDITION
                    && message.contains("authentication is not enabled") =>
            {
                if !creds.auth_off.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "metadata: etcd user {:?} configured, but etcd has authentication off \
                         (etcdctl auth enable): calls go without a token",
                        creds.user
                    );
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn call_as(
        &self,
        path: &str,
        body: &str,
        deadline: Instant,
        token: Option<&str>,
    ) -> Result<Value, CallError> {
        let started = Instant::now();
        let order = self.order();
        let previous = *self.preferred.lock();
        let mut attempts: Vec<(usize, Failure)> = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let left = deadline - now;
            let others = order.len() - k - 1;
            // The member that answered last gets half of the time left,
            // any other an equal share (one restarting may hang until its
            // share is over); the last keeps a tenth to ask members that
            // failed whether they have a leader.
            let budget = match (others, self.state(i)) {
                (0, _) => left - (left / 10).min(PROBE),
                (_, State::Good) => left / 2,
                _ => left / (others as u32 + 1),
            };
            let connect = left / (others as u32 + 1);
            let attempt = Instant::now();
            let outcome = self.post(i, path, body, budget, connect, token);
            if let Outcome::Failed(f) = &outcome {
                log::debug!(
                    "metadata: {path} on etcd endpoint {}: {f} after {:?} (of {budget:?})",
                    self.members[i].shown,
                    attempt.elapsed()
                );
            }
            match outcome {
                Outcome::Ok(v) => {
                    self.mark_good(i);
                    if i != previous {
                        *self.preferred.lock() = i;
                        if let Some((_, f)) = attempts.iter().find(|(a, _)| *a == previous) {
                            log::warn!(
                                "metadata: etcd endpoint {} {f}, using {}",
                                self.members[previous].shown,
                                self.members[i].shown
                            );
                        }
                    }
                    return Ok(v);
                }
                Outcome::Refused(code, message) => {
                    self.mark_good(i);
                    return Err(CallError::Etcd {
                        endpoint: self.members[i].shown.clone(),
                        code,
                        message,
                    });
                }
                Outcome::Failed(f) => {
                    self.mark_down(i, f.reachable());
                    attempts.push((i, f));
                }
            }
        }
        // Members that answered but could not serve: have they a leader at
        // all? (Their own status, answered locally.)
        for (i, f) in attempts.iter_mut() {
            if matches!(f, Failure::TimedOut | Failure::Unavailable(_))
                && self.leader_known(*i, deadline) == Some(false)
            {
                *f = Failure::NoLeader;
            }
        }
        let tried: Vec<usize> = attempts.iter().map(|(i, _)| *i).collect();
        Err(CallError::Failed {
            attempts: attempts
                .into_iter()
                .map(|(i, f)| (self.members[i].shown.clone(), f))
                .collect(),
            untried: order
                .iter()
                .filter(|i| !tried.contains(i))
                .map(|&i| self.members[i].shown.clone())
                .collect(),
            deadline: deadline.saturating_duration_since(started),
        })
    }

    /// Asks members marked down whose back-off is over whether they serve
    /// again (the keeper does this each round, so that a member that came
    /// back is known before it is needed).
    pub fn reprobe(&self, deadline: Instant) {
        let now = Instant::now();
        let due: Vec<usize> = {
            let health = self.health.lock();
            (0..health.len())
                .filter(|&i| health[i].state == State::Down && health[i].retry_at <= now)
                .collect()
        };
        for i in due {
            match self.leader_known(i, deadline) {
                // Eligible again; "answers again" once a call succeeds.
                Some(true) => self.health.lock()[i].state = State::Unknown,
                known => self.mark_down(i, known.is_some()),
            }
        }
    }

    /// Member `i`'s own view (maintenance status): Some(true) when it knows
    /// a leader, Some(false) when it answers without one, None when it does
    /// not answer in time.
    fn leader_known(&self, i: usize, deadline: Instant) -> Option<bool> {
        let left = deadline.checked_duration_since(Instant::now())?;
        let t = left.min(PROBE);
        // Status needs no token: etcd answers it for anyone it lets in.
        match self.post(i, "/v3/maintenance/status", "{}", t, t, None) {
            Outcome::Ok(v) => Some(v.get("leader").and_then(int).is_some_and(|l| l != 0)),
            _ => None,
        }
    }

    fn post(
        &self,
        i: usize,
        path: &str,
        body: &str,
        budget: Duration,
        connect: Duration,
        token: Option<&str>,
    ) -> Outcome {
        if budget.is_zero() {
            return Outcome::Failed(Failure::TimedOut);
        }
        let url = format!("{}{path}", self.members[i].url);
        // The gateway gives etcd this deadline, so that etcd gives up on
        // the request when we do.
        let grpc_ms = (budget.as_millis() * 9 / 10).max(1);
        let mut request = self
            .agent
            .post(&url)
            .header("Content-Type", "application/json")
            .header("Grpc-Timeout", format!("{grpc_ms}m"));
        if let Some(t) = token {
            // The gateway hands "Authorization" to etcd as the token.
            request = request.header("Authorization", t);
        }
        let sent = request
            .config()
            .timeout_global(Some(budget))
            .timeout_connect(Some(connect.min(budget)))
            .build()
            .send(body);
        let mut reply = match sent {
            Ok(r) => r,
            Err(e) => return Outcome::Failed(self.transport_failure(i, e, budget)),
        };
        let status = reply.status().as_u16();
        let bytes = match reply
            .body_mut()
            .with_config()
            .limit(MAX_REPLY)
            .read_to_vec()
        {
            Ok(b) => b,
            Err(ureq::Error::BodyExceedsLimit(_)) => {
                return Outcome::Refused(0, format!("reply larger than {} MiB", MAX_REPLY >> 20))
            }
            Err(e) => return Outcome::Failed(self.transport_failure(i, e, budget)),
        };
        let json: Option<Value> = serde_json::from_slice(&bytes).ok();
        match (status, json) {
            (200, Some(v)) => match stream_error(&v) {
                Some((code, message)) => classify(code, message),
                None => Outcome::Ok(v),
            },
            (_, Some(v)) => match stream_error(&v).or_else(|| flat_error(&v)) {
                Some((code, message)) => classify(code, message),
                None => Outcome::Failed(Failure::NotGateway(format!(
                    "HTTP {status} for POST {path}"
                ))),
            },
            // etcd 3.4.22 and newer (3.5.5) refuse gateway requests whose
            // client certificate has a Common Name: etcd would take it
            // for a user name, which the gateway cannot pass on.
            (400, None) if bytes.starts_with(b"CommonName of client") => {
                Outcome::Failed(Failure::Tls(
                    "refused Ferry's client certificate because it has a Common Name (etcd's \
                     JSON gateway takes no CN-based users): issue one with an empty CN and \
                     authenticate with FERRY_METADATA_USER"
                        .into(),
                ))
            }
            (status, None) => Outcome::Failed(Failure::NotGateway(format!(
                "HTTP {status} for POST {path}"
            ))),
        }
    }

    fn transport_failure(&self, i: usize, e: ureq::Error, budget: Duration) -> Failure {
        match (&self.tls, tls::rustls_error(&e)) {
            (Some(t), Some(r)) => Failure::Tls(t.cause(r)),
            (None, Some(r)) => Failure::Tls(format!("TLS failed ({r})")),
            (Some(t), None) => match transport_failure(e) {
                // Closed on us: a refused client certificate looks like
                // this; ask the member itself, within a share of the time.
                Failure::Unreachable(why)
                    if why.starts_with("connection ")
                        && why != "connection refused"
                        && why != "connection timed out" =>
                {
                    match t.diagnose(&self.members[i].shown, (budget / 4).min(PROBE)) {
                        Some(cause) => Failure::Tls(cause),
                        None => Failure::Unreachable(why),
                    }
                }
                f => f,
            },
            (None, None) => transport_failure(e),
        }
    }
}

/// An int64 of a gateway reply: JSON carries them as strings ("123").
pub fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s
            .parse()
            .ok()
            .or_else(|| s.parse::<u64>().ok().map(|u| u as i64)),
        Value::Number(n) => n.as_i64().or_else(|| n.as_u64().map(|u| u as i64)),
        _ => None,
    }
}

/// A unary call's error: `{"error": ..., "code": 14, "message": ...}`.
fn flat_error(v: &Value) -> Option<(i64, String)> {
    let code = v.get("code").and_then(int)?;
    let message = v
        .get("message")
        .or_else(|| v.get("error"))
        .and_then(Value::as_str)
        .unwrap_or("no message");
    Some((code, message.to_string()))
}

/// A streamed reply (lease keep-alive) carries its error inside:
/// `{"error": {"grpc_code": 14, "message": ...}}`.
fn stream_error(v: &Value) -> Option<(i64, String)> {
    let e = v.get("error").filter(|e| e.is_object())?;
    Some((
        e.get("grpc_code").and_then(int).unwrap_or(0),
        e.get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message")
            .to_string(),
    ))
}

/// gRPC codes that another member may not share go to fail-over; the rest
/// are etcd's definite answer.
fn classify(code: i64, message: String) -> Outcome {
    match code {
        // DEADLINE_EXCEEDED: the share of the deadline ran out there.
        4 => Outcome::Failed(Failure::TimedOut),
        // UNAVAILABLE (no leader, leader changed, request timed out),
        // UNKNOWN (the gateway's own context ending), CANCELLED, ABORTED,
        // and no code at all.
        14 | 2 | 1 | 10 | 0 => Outcome::Failed(Failure::Unavailable(message)),
        _ => Outcome::Refused(code, message),
    }
}

fn transport_failure(e: ureq::Error) -> Failure {
    match e {
        ureq::Error::Timeout(ureq::Timeout::Connect) => {
            Failure::Unreachable("connection timed out".into())
        }
        ureq::Error::Timeout(_) => Failure::TimedOut,
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => Failure::TimedOut,
        ureq::Error::Io(io) => Failure::Unreachable(io_reason(&io)),
        ureq::Error::ConnectionFailed => Failure::Unreachable("connection failed".into()),
        ureq::Error::HostNotFound => Failure::Unreachable("host not found".into()),
        other => Failure::Unreachable(other.to_string()),
    }
}

/// "connection refused", not "Connection refused (os error 111)".
fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "connection refused".into(),
        ConnectionReset => "connection reset".into(),
        ConnectionAborted => "connection aborted".into(),
        UnexpectedEof => "connection closed".into(),
        BrokenPipe => "connection closed".into(),
        _ => e.to_string(),
    }
}
