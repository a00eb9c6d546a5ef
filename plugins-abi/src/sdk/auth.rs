//! Mutual challenge-response authentication for every connection Ferry
//! opens (control plane, transport data connections), by a token the
//! cluster shares (FERRY_AUTH_TOKEN or FERRY_AUTH_TOKEN_FILE; plugins read
//! the setting `auth.token`). The token never crosses the wire: each side
//! proves it knows the token with HMAC-SHA256 over both sides' fresh
//! nonces, so a recorded exchange cannot be replayed, and over the kind of
//! connection, so a proof for one protocol cannot be reflected into another.
//!
//! The exchange, before any other byte of the connection:
//!
//! ```text
//! server -> client  HELLO  "FRYA" ver flags(1: token required) 0 0  nonce_s[32]   40 bytes
//! client -> server  PROOF  "FRYB" ver flags(1: has token)      0 0  nonce_c[32] mac_c[32]  72 bytes
//! server -> client  DONE   "FRYD" ver result(0 ok, else refused) 0 0  mac_s[32]   40 bytes
//! mac_c = HMAC(token, "ferry-auth-v1/client/" kind || nonce_s || nonce_c)
//! mac_s = HMAC(token, "ferry-auth-v1/server/" kind || nonce_c || nonce_s)
//! ```
//!
//! Policy: a server with a token refuses a client without the right one; a
//! client with a token refuses a server that has none or proves the wrong
//! one; two sides without a token proceed (loopback, or FERRY_AUTH=off).
//! Every read has the caller's deadline (socket timeouts).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::io::{Read, Write};

const VERSION: u8 = 1;
const NONCE: usize = 32;
const MAC: usize = 32;
/// Bytes of HELLO and DONE.
pub const HELLO_LEN: usize = 8 + NONCE;
/// Bytes of PROOF.
pub const PROOF_LEN: usize = 8 + NONCE + MAC;

/// The shared secret. Its bytes are never logged or sent.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token from its text (surrounding whitespace ignored); None when
    /// empty.
    pub fn new(text: &str) -> Option<Token> {
        let t = text.trim();
        (!t.is_empty()).then(|| Token(t.as_bytes().to_vec()))
    }

    /// The secret's text, to hand to this process's plugins (setting
    /// `auth.token`); never log it or send it.
    pub fn expose(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }
}

/// Why authentication failed, in operator words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// The peer does not know the token (or has none while we require one).
    Refused(String),
    /// The peer sent something that is not this exchange, or I/O failed.
    Protocol(String),
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::Refused(s) | AuthError::Protocol(s) => f.write_str(s),
        }
    }
}

fn nonce() -> Result<[u8; NONCE], AuthError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)
        .map_err(|e| AuthError::Protocol(format!("no random numbers for a nonce: {e}")))?;
    Ok(n)
}

fn mac(token: &Token, role: &str, kind: &str, first: &[u8], second: &[u8]) -> Hmac<Sha256> {
    // new_from_slice accepts keys of any length for HMAC.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&token.0)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    m.update(b"ferry-auth-v1/");
    m.update(role.as_bytes());
    m.update(b"/");
    m.update(kind.as_bytes());
    m.update(first);
    m.update(second);
    m
}

fn io(what: &str, e: std::io::Error) -> AuthError {
    AuthError::Protocol(format!("authentication: {what}: {e}"))
}

fn header(magic: &[u8; 4], flags: u8) -> [u8; 8] {
    [magic[0], magic[1], magic[2], magic[3], VERSION, flags, 0, 0]
}

fn check_header(got: &[u8], magic: &[u8; 4], what: &str) -> Result<u8, AuthError> {
    if &got[..4] != magic {
        return Err(AuthError::Protocol(format!(
            "authentication: the peer did not send a {what} (not a Ferry peer, or one older \
             than authentication)"
        )));
    }
    if got[4] != VERSION {
        return Err(AuthError::Protocol(format!(
            "authentication: the peer speaks version {} of the exchange, this engine {VERSION}",
            got[4]
        )));
    }
    Ok(got[5])
}

/// The server side: runs the exchange on a freshly accepted connection.
/// `kind` names the protocol ("control", "tcp", "shm").
pub fn accept<S: Read + Write>(
    stream: &mut S,
    token: Option<&Token>,
    kind: &str,
) -> Result<(), AuthError> {
    let nonce_s = nonce()?;
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(&header(b"FRYA", u8::from(token.is_some())));
    hello[8..].copy_from_slice(&nonce_s);
    stream.write_all(&hello).map_err(|e| io("sending", e))?;
    let mut proof = [0u8; PROOF_LEN];
    stream
        .read_exact(&mut proof)
        .map_err(|e| io("reading the peer's proof", e))?;
    let flags = check_header(&proof, b"FRYB", "proof")?;
    let nonce_c = &proof[8..8 + NONCE];
    let mac_c = &proof[8 + NONCE..];
    let (result, mac_s, verdict) = match token {
        None => (0u8, [0u8; MAC], Ok(())),
        Some(_) if flags & 1 == 0 => (
            2,
            [0u8; MAC],
            Err(AuthError::Refused(
                "refused a peer without an auth token (this engine requires FERRY_AUTH_TOKEN)"
                    .into(),
            )),
        ),
        Some(token) => {
            if mac(token, "client", kind, &nonce_s, nonce_c)
                .verify_slice(mac_c)
                .is_ok()
            {
                let mut out = [0u8; MAC];
                out.copy_from_slice(
                    &mac(token, "server", kind, nonce_c, &nonce_s)
                        .finalize()
                        .into_bytes(),
                );
                (0, out, Ok(()))
            } else {
                (
                    1,
                    [0u8; MAC],
                    Err(AuthError::Refused(
                        "refused a peer with the wrong auth token".into(),
                    )),
                )
            }
        }
    };
    let mut done = [0u8; HELLO_LEN];
    done[..8].copy_from_slice(&header(b"FRYD", result));
    done[8..].copy_from_slice(&mac_s);
    // A refused peer learns it was refused; nothing else.
    let _ = stream.write_all(&done);
    verdict
}

/// The client side: runs the exchange on a fresh connection to `peer`.
pub fn connect<S: Read + Write>(
    stream: &mut S,
    token: Option<&Token>,
    kind: &str,
    peer: &str,
) -> Result<(), AuthError> {
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| io(&format!("reading {peer}'s greeting"), e))?;
    let flags = check_header(&hello, b"FRYA", "greeting")?;
    let nonce_s = &hello[8..];
    let requires = flags & 1 != 0;
    match (requires, token) {
        (true, None) => {
            return Err(AuthError::Refused(format!(
                "{peer} requires an auth token and this engine has none (set FERRY_AUTH_TOKEN \
                 or FERRY_AUTH_TOKEN_FILE to the cluster's token)"
            )))
        }
        (false, Some(_)) => {
            return Err(AuthError::Refused(format!(
                "{peer} does not authenticate (it has no auth token); refusing it because this \
                 engine has one"
            )))
        }
        _ => {}
    }
    let nonce_c = nonce()?;
    let mut proof = [0u8; PROOF_LEN];
    proof[..8].copy_from_slice(&header(b"FRYB", u8::from(token.is_some())));
    proof[8..8 + NONCE].copy_from_slice(&nonce_c);
    if let Some(t) = token {
        proof[8 + NONCE..].copy_from_slice(
            &mac(t, "client", kind, nonce_s, &nonce_c)
                .finalize()
                .into_bytes(),
        );
    }
    stream.write_all(&proof).map_err(|e| io("sending", e))?;
    let mut done = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut done)
        .map_err(|e| io(&format!("reading {peer}'s answer"), e))?;
    let result = check_header(&done, b"FRYD", "verdict")?;
    if result != 0 {
        return Err(AuthError::Refused(format!(
            "{peer} refused this engine's auth token (the tokens differ)"
        )));
    }
    if let Some(t) = token {
        if mac(t, "server", kind, &nonce_c, nonce_s)
            .verify_slice(&done[8..])
            .is_err()
        {
            return Err(AuthError::Refused(format!(
                "{peer} could not prove it knows the auth token; refusing it"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn run(
        server: Option<&str>,
        client: Option<&str>,
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let st = server.and_then(Token::new);
        let ct = client.and_then(Token::new);
        let t = std::thread::spawn(move || accept(&mut a, st.as_ref(), "test"));
        let c = connect(&mut b, ct.as_ref(), "test", "peer");
        drop(b);
        (t.join().unwrap(), c)
    }

    #[test]
    fn both_sides_must_agree() {
        let (s, c) = run(Some("secret"), Some("secret"));
        assert_eq!((s, c), (Ok(()), Ok(())));
        let (s, c) = run(None, None);
        assert_eq!((s, c), (Ok(()), Ok(())));
        let (s, c) = run(Some("secret"), Some("other"));
        assert!(matches!(s, Err(AuthError::Refused(_))), "{s:?}");
        assert!(c.unwrap_err().to_string().contains("tokens differ"));
        let (_, c) = run(Some("secret"), None);
        assert!(c
            .unwrap_err()
            .to_string()
            .contains("requires an auth token"));
        let (_, c) = run(None, Some("secret"));
        assert!(c.unwrap_err().to_string().contains("does not authenticate"));
    }

    #[test]
    fn a_proof_for_one_kind_does_not_pass_for_another() {
        let t = Token::new("secret").unwrap();
        let a = mac(&t, "client", "tcp", b"n1", b"n2")
            .finalize()
            .into_bytes();
        let b = mac(&t, "client", "control", b"n1", b"n2")
            .finalize()
            .into_bytes();
        let s = mac(&t, "server", "tcp", b"n1", b"n2")
            .finalize()
            .into_bytes();
        assert_ne!(a, b);
        assert_ne!(a, s);
    }

    #[test]
    fn garbage_is_a_protocol_error_not_a_panic() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let tok = Token::new("x");
            accept(&mut a, tok.as_ref(), "test")
        });
        let mut hello = [0u8; HELLO_LEN];
        b.read_exact(&mut hello).unwrap();
        b.write_all(&[0xAB; PROOF_LEN]).unwrap();
        assert!(matches!(t.join().unwrap(), Err(AuthError::Protocol(_))));
        // A client reading garbage.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(b"GET / HTTP/1.1\r\nHost: example\r\nAccept: */*\r\n\r\n")
            .unwrap();
        let r = connect(&mut b, None, "test", "peer");
        assert!(matches!(r, Err(AuthError::Protocol(_))), "{r:?}");
    }
}
