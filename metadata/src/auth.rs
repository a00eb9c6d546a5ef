//! etcd users: the user name and the password (read from its file when
//! the store connects, never from the command line, never logged), the
//! token etcd hands out for them (/v3/auth/authenticate), and etcd's
//! refusals told in an operator's words.
//!
//! etcd expires tokens (simple tokens after --auth-token-ttl without use,
//! on each member separately; JWTs at their expiry) and invalidates them
//! when users or roles change: a call refused with an invalid token
//! authenticates again and is retried once (pool.rs).

use super::config::EtcdAccess;
use crate::error::{Error, ErrorCode, Result};
use parking_lot::Mutex;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

/// etcd's gRPC codes Ferry tells apart here.
pub const GRPC_INVALID_ARGUMENT: i64 = 3;
pub const GRPC_PERMISSION_DENIED: i64 = 7;
pub const GRPC_FAILED_PRECONDITION: i64 = 9;
pub const GRPC_UNAUTHENTICATED: i64 = 16;

pub struct Credentials {
    pub user: String,
    password: String,
    file: PathBuf,
    /// The token in use; None before the first call or after etcd
    /// refused it. Held while authenticating, so that threads that find
    /// none wait for one token instead of asking for one each.
    pub token: Mutex<Option<String>>,
    /// etcd answered that authentication is not enabled (logged once).
    pub auth_off: AtomicBool,
}

// Never the password.
impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password_file", &self.file)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// The user of `access`, with its password read from its file; None
    /// when no user is set.
    pub fn load(access: &EtcdAccess) -> Result<Option<Credentials>> {
        let bad = |m: String| Error::new(ErrorCode::InvalidArgument, m);
        let (user, file) = match (&access.user, &access.password_file) {
            (None, None) => return Ok(None),
            (Some(u), Some(f)) => (u.clone(), f.clone()),
            (Some(_), None) => {
                return Err(bad(
                    "FERRY_METADATA_USER is set without \
                     FERRY_METADATA_PASSWORD_FILE (a file whose first line is its password)"
                        .into(),
                ))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "FERRY_METADATA_PASSWORD_FILE is set without FERRY_METADATA_USER".into(),
                ))
            }
        };
        let text = std::fs::read_to_string(&file).map_err(|e| {
            bad(format!(
                "cannot read etcd password file {}: {e}",
                file.display()
            ))
        })?;
        let password = text.lines().next().unwrap_or("").to_string();
        if password.is_empty() {
            return Err(bad(format!(
                "etcd password file {}: its first line is empty",
                file.display()
            )));
        }
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(&file) {
                if m.permissions().mode() & 0o077 != 0 {
                    log::warn!(
                        "metadata: etcd password file {} can be read by other users (mode \
                         {:o}); chmod 600 it",
                        file.display(),
                        m.permissions().mode() & 0o777
                    );
                }
            }
        }
        Ok(Some(Credentials {
            user,
            password,
            file,
            token: Mutex::new(None),
            auth_off: AtomicBool::new(false),
        }))
    }

    /// The body of /v3/auth/authenticate.
    pub fn request(&self) -> serde_json::Value {
        serde_json::json!({ "name": self.user, "password": self.password })
    }
}

/// Whether etcd refused the token itself (expired, or issued before a
/// change of users or roles): a new one may serve.
pub fn token_refused(code: i64, message: &str) -> bool {
    (code == GRPC_UNAUTHENTICATED && message.contains("invalid auth token"))
        || message.contains("revision of auth store is old")
}

/// Whether etcd asks for a user it was not given.
pub fn user_required(code: i64, message: &str) -> bool {
    code == GRPC_INVALID_ARGUMENT && message.contains("user name is empty")
}

/// Whether a refusal is about who Ferry is or what it may do (the error's
/// code is then PERMISSION).
pub fn is_denial(code: i64, message: &str) -> bool {
    matches!(code, GRPC_PERMISSION_DENIED | GRPC_UNAUTHENTICATED)
        || (code == GRPC_INVALID_ARGUMENT
            && (message.contains("authentication failed")
                || message.contains("user name is empty")))
}

/// etcd's refusal in words that say what to change. `keys`: the range
/// Ferry works on ("/ferry/segments/").
pub fn explain(
    creds: Option<&Credentials>,
    keys: &str,
    code: i64,
    message: &str,
) -> Option<String> {
    let user = creds.map(|c| c.user.as_str());
    if code == GRPC_INVALID_ARGUMENT && message.contains("authentication failed") {
        let file = creds.map_or_else(String::new, |c| format!(", from {}", c.file.display()));
        return Some(format!(
            "wrong password for etcd user {:?}, or no such user (password{file}; etcd: \
             {message})",
            user.unwrap_or_default()
        ));
    }
    if user_required(code, message) {
        return Some(format!(
            "etcd has authentication enabled and Ferry gave no user: set FERRY_METADATA_USER \
             and FERRY_METADATA_PASSWORD_FILE (etcd: {message})"
        ));
    }
    if code == GRPC_PERMISSION_DENIED {
        return Some(match user {
            Some(u) => format!(
                "permission denied: etcd user {u:?} may not read and write keys under {keys} \
                 (grant one of its roles readwrite on that prefix: etcdctl role \
                 grant-permission ROLE readwrite {keys} --prefix=true; etcd: {message})"
            ),
            None => format!("permission denied on keys under {keys} (etcd: {message})"),
        });
    }
    if token_refused(code, message) {
        return Some(format!(
            "etcd refused the token it had just given user {:?} (etcd: {message})",
            user.unwrap_or_default()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_say_what_to_change() {
        let creds = Credentials {
            user: "ferry".into(),
            password: "s3cret".into(),
            file: "/etc/ferry/etcd-password".into(),
            token: Mutex::new(None),
            auth_off: AtomicBool::new(false),
        };
        assert!(!format!("{creds:?}").contains("s3cret"));
        let e = explain(
            Some(&creds),
            "/ferry/segments/",
            3,
            "etcdserver: authentication failed, invalid user ID or password",
        )
        .unwrap();
        assert!(
            e.starts_with("wrong password for etcd user \"ferry\""),
            "{e}"
        );
        assert!(e.contains("/etc/ferry/etcd-password") && !e.contains("s3cret"));
        let e = explain(
            Some(&creds),
            "/ferry/segments/",
            7,
            "etcdserver: permission denied",
        );
        assert!(e
            .unwrap()
            .contains("\"ferry\" may not read and write keys under /ferry/"));
        let e = explain(None, "/f/", 3, "etcdserver: user name is empty").unwrap();
        assert!(e.contains("set FERRY_METADATA_USER"), "{e}");
        assert!(token_refused(16, "etcdserver: invalid auth token"));
        assert!(token_refused(
            3,
            "etcdserver: revision of auth store is old"
        ));
        assert!(!token_refused(7, "etcdserver: permission denied"));
        assert!(is_denial(7, "") && !is_denial(3, "etcdserver: key is not provided"));
        assert_eq!(
            explain(None, "/f/", 5, "etcdserver: requested lease not found"),
            None
        );
    }
}
