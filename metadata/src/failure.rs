//! Why an etcd call failed, in the words an operator needs: which members
//! were reachable, whether any had a leader, and whether the deadline ran
//! out before every member was tried.

use crate::error::{Error, ErrorCode};
use std::fmt;
use std::time::Duration;

/// What one member did with one attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No connection, or it broke before a reply (the member is down, or
    /// the address is wrong).
    Unreachable(String),
    /// It answers, and says it has no leader (the cluster lost quorum, or
    /// is electing one).
    NoLeader,
    /// It answers, but did not finish within the share of the deadline it
    /// was given.
    TimedOut,
    /// It answers, but not as etcd's v3 JSON gateway does.
    NotGateway(String),
    /// It answers that it cannot serve now (etcd's "unavailable").
    Unavailable(String),
    /// TLS with it failed (etcds://): which certificate was refused, by
    /// which side, and why ("it ..."; tls.rs).
    Tls(String),
}

impl Failure {
    /// Whether the member answered at all.
    pub fn reachable(&self) -> bool {
        !matches!(self, Failure::Unreachable(_))
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Unreachable(why) => write!(f, "unreachable ({why})"),
            Failure::NoLeader => write!(f, "has no leader"),
            Failure::TimedOut => write!(f, "did not answer in time"),
            Failure::NotGateway(why) => write!(
                f,
                "is not an etcd v3 JSON gateway ({why}; Ferry needs etcd 3.4 or newer, whose \
                 client port serves /v3/)"
            ),
            Failure::Unavailable(why) => write!(f, "cannot serve now ({why})"),
            Failure::Tls(why) => write!(f, "{why}"),
        }
    }
}

/// Why a call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// A member answered with a definite error (gRPC code and message):
    /// another member would say the same.
    Etcd {
        endpoint: String,
        code: i64,
        message: String,
    },
    /// No member could serve it: each one tried, with what it did, and the
    /// members that the deadline left untried.
    Failed {
        attempts: Vec<(String, Failure)>,
        untried: Vec<String>,
        deadline: Duration,
    },
}

/// etcd's gRPC code for "not found" (an unknown lease).
pub const GRPC_NOT_FOUND: i64 = 5;

impl CallError {
    pub fn is_not_found(&self) -> bool {
        matches!(self, CallError::Etcd { code, .. } if *code == GRPC_NOT_FOUND)
    }

    /// The engine's error: `what` failed, and why.
    pub fn to_error(&self, what: &str) -> Error {
        let (code, why) = self.cause();
        Error::new(code, format!("{what}: {why}"))
    }

    /// Why, without saying what failed.
    pub fn cause_text(&self) -> String {
        self.cause().1
    }

    fn cause(&self) -> (ErrorCode, String) {
        match self {
            CallError::Etcd {
                endpoint,
                code,
                message,
            } => {
                let c = if *code == GRPC_NOT_FOUND {
                    ErrorCode::NotFound
                } else if super::auth::is_denial(*code, message) {
                    ErrorCode::Permission
                } else {
                    ErrorCode::Protocol
                };
                (c, format!("etcd at {endpoint} refused it: {message}"))
            }
            CallError::Failed {
                attempts,
                untried,
                deadline,
            } => {
                let total = attempts.len() + untried.len();
                let reachable = attempts.iter().filter(|(_, f)| f.reachable()).count();
                let mut parts: Vec<String> =
                    attempts.iter().map(|(e, f)| format!("{e} {f}")).collect();
                parts.extend(untried.iter().map(|e| format!("{e} not tried")));
                let members = parts.join("; ");
                let ms = deadline.as_millis();
                if !untried.is_empty() {
                    (
                        ErrorCode::Timeout,
                        format!("etcd did not answer within the {ms} ms deadline ({members})"),
                    )
                } else if attempts.iter().any(|(_, f)| matches!(f, Failure::Tls(_)))
                    && attempts
                        .iter()
                        .all(|(_, f)| matches!(f, Failure::Tls(_) | Failure::Unreachable(_)))
                {
                    // Every member that answered refused TLS: no member
                    // will serve until a certificate or setting changes.
                    (
                        ErrorCode::Permission,
                        format!("TLS with etcd failed ({members})"),
                    )
                } else if reachable == 0 {
                    (
                        ErrorCode::Connection,
                        format!("cannot reach etcd (0 of {total} members reachable: {members})"),
                    )
                } else if attempts.iter().any(|(_, f)| *f == Failure::NoLeader)
                    || reachable * 2 <= total
                {
                    (
                        ErrorCode::Unavailable,
                        format!(
                            "etcd has no quorum ({reachable} of {total} members reachable: \
                             {members})"
                        ),
                    )
                } else if attempts
                    .iter()
                    .all(|(_, f)| matches!(f, Failure::NotGateway(_) | Failure::Unreachable(_)))
                {
                    (ErrorCode::Protocol, format!("etcd: {members}"))
                } else {
                    (
                        ErrorCode::Timeout,
                        format!("etcd did not answer within the {ms} ms deadline ({members})"),
                    )
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(attempts: &[(&str, Failure)], untried: &[&str]) -> Error {
        CallError::Failed {
            attempts: attempts
                .iter()
                .map(|(e, f)| (e.to_string(), f.clone()))
                .collect(),
            untried: untried.iter().map(|e| e.to_string()).collect(),
            deadline: Duration::from_millis(2000),
        }
        .to_error("cannot list segments")
    }

    #[test]
    fn errors_name_the_cause() {
        let refused = || Failure::Unreachable("connection refused".into());
        let e = failed(
            &[
                ("a:1", Failure::NoLeader),
                ("b:2", refused()),
                ("c:3", refused()),
            ],
            &[],
        );
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert_eq!(
            e.message,
            "cannot list segments: etcd has no quorum (1 of 3 members reachable: a:1 has no \
             leader; b:2 unreachable (connection refused); c:3 unreachable (connection refused))"
        );
        let e = failed(&[("a:1", refused())], &[]);
        assert_eq!(e.code, ErrorCode::Connection);
        assert!(e
            .message
            .contains("cannot reach etcd (0 of 1 members reachable: a:1 unreachable"));
        let e = failed(&[("a:1", Failure::TimedOut)], &["b:2"]);
        assert_eq!(e.code, ErrorCode::Timeout);
        assert!(e
            .message
            .contains("2000 ms deadline (a:1 did not answer in time; b:2 not tried)"));
        let e = failed(
            &[
                ("a:1", Failure::TimedOut),
                ("b:2", refused()),
                ("c:3", refused()),
            ],
            &[],
        );
        assert!(e.message.contains("no quorum (1 of 3"), "{}", e.message);
        let e = failed(&[("a:1", Failure::NotGateway("HTTP 404".into()))], &[]);
        assert_eq!(e.code, ErrorCode::Protocol);
        assert!(e.message.contains("etcd 3.4 or newer"));
    }
}
