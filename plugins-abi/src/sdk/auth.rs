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
//! server -> client  DONE   "FRYD" ver result(0 ok, 3 busy, else refused) 0 0  mac_s[32]   40 bytes
//! mac_c = HMAC(token, "ferry-auth-v1/client/" kind || nonce_s || nonce_c)
//! mac_s = HMAC(token, "ferry-auth-v1/server/" kind || nonce_c || nonce_s)
//! ```
//!
//! Policy: a server with a token refuses a client without the right one; a
//! client with a token refuses a server that has none or proves the wrong
//! one; two sides without a token proceed (FERRY_AUTH=off).
//! Every read has the caller's deadline (socket timeouts).
//!
//! A server too busy to take the connection answers a HELLO with flag 2
//! (busy) and a zero nonce, then closes: the client reports BUSY (and may
//! retry) instead of "not a Ferry peer".
//!
//! **The session.** The exchange alone proves who opened the connection,
//! not who sends what follows: an on-path relay could pass it through and
//! then speak for either side. So both sides derive per-connection keys
//! (HKDF-SHA256, RFC 5869) from the token and both nonces, and every
//! message after the exchange carries a tag:
//!
//! ```text
//! keys = HKDF-SHA256(ikm = token, salt = nonce_s || nonce_c,
//!                    info = "ferry-session-v1/" kind)  -> 128 bytes:
//!        client->server frames | server->client frames |
//!        client->server payload | server->client payload     (32 bytes each)
//! tag  = HMAC-SHA256(direction's frame key, seq u64 LE || message)[..16]
//! ```
//!
//! `seq` counts the messages of one direction from 0 and is never sent: a
//! message injected, replayed, reordered, dropped or altered fails its tag,
//! and the receiver closes the connection. Without a token (FERRY_AUTH=off)
//! the keys come from the nonces alone, which anyone on the path saw: tags
//! then catch corruption, not an attacker.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::io::{Read, Write};
use subtle::ConstantTimeEq;

const VERSION: u8 = 1;
const NONCE: usize = 32;
const MAC: usize = 32;
/// Bytes of HELLO and DONE.
pub const HELLO_LEN: usize = 8 + NONCE;
/// Bytes of PROOF.
pub const PROOF_LEN: usize = 8 + NONCE + MAC;

/// Bytes of a message tag.
pub const TAG_LEN: usize = 16;
/// A message tag (a truncated HMAC-SHA256).
pub type Tag = [u8; TAG_LEN];
/// HELLO flag: the server requires a token.
const FLAG_TOKEN: u8 = 1;
/// HELLO flag: the server is too busy to take this connection.
const FLAG_BUSY: u8 = 2;
/// DONE's result when the server evicted the connection as busy.
const RESULT_BUSY: u8 = 3;

/// The shared secret. Its bytes are never logged or sent: `Debug` and
/// `Display` print a placeholder, so a struct holding one can derive
/// `Debug` safely.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
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
    /// The server is too busy to take another connection now; try again.
    Busy(String),
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::Refused(s) | AuthError::Protocol(s) | AuthError::Busy(s) => f.write_str(s),
        }
    }
}

/// A message after the exchange failed its tag: injected, replayed,
/// reordered or altered on the way. The connection must be closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntegrityError;

impl fmt::Display for IntegrityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "integrity check failed: a message was altered, injected, replayed or reordered on \
             the way (a relay between the engines?); the connection is closed",
        )
    }
}

impl std::error::Error for IntegrityError {}

/// One direction of an authenticated connection: its keys and the number
/// of the next message.
#[derive(Clone)]
pub struct Direction {
    frame: Hmac<Sha256>,
    payload: Hmac<Sha256>,
    seq: u64,
}

impl fmt::Debug for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Direction {{ seq: {}, keys: <redacted> }}", self.seq)
    }
}

fn truncate(full: &[u8]) -> Tag {
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(&full[..TAG_LEN]);
    t
}

impl Direction {
    fn new(frame_key: &[u8], payload_key: &[u8]) -> Direction {
        let key = |k: &[u8]| {
            <Hmac<Sha256> as Mac>::new_from_slice(k)
                .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"))
        };
        Direction {
            frame: key(frame_key),
            payload: key(payload_key),
            seq: 0,
        }
    }

    /// The number the next message will carry.
    pub fn next_seq(&self) -> u64 {
        self.seq
    }

    fn tag_at(&self, seq: u64, parts: &[&[u8]]) -> Tag {
        // The keyed state is cloned, not re-keyed: two compressions saved
        // per message.
        let mut m = self.frame.clone();
        m.update(&seq.to_le_bytes());
        for p in parts {
            m.update(p);
        }
        truncate(&m.finalize().into_bytes())
    }

    /// The tag of the next message sent (the concatenation of `parts`).
    pub fn seal(&mut self, parts: &[&[u8]]) -> Tag {
        let t = self.tag_at(self.seq, parts);
        self.seq += 1;
        t
    }

    /// Checks the tag of the next message received, in constant time.
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), IntegrityError> {
        let want = self.tag_at(self.seq, parts);
        if tag.len() != TAG_LEN || !bool::from(want.ct_eq(tag)) {
            return Err(IntegrityError);
        }
        self.seq += 1;
        Ok(())
    }

    /// A running tag over the payload of message `seq` (FERRY_INTEGRITY=
    /// payload), under this direction's payload key.
    pub fn payload(&self, seq: u64) -> PayloadTag {
        let mut m = self.payload.clone();
        m.update(&seq.to_le_bytes());
        PayloadTag(m)
    }
}

/// A payload's tag, fed as its bytes go by.
pub struct PayloadTag(Hmac<Sha256>);

impl PayloadTag {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> Tag {
        truncate(&self.0.finalize().into_bytes())
    }

    /// Checks the tag the peer sent, in constant time.
    pub fn verify(self, tag: &[u8]) -> Result<(), IntegrityError> {
        let want = self.finish();
        if tag.len() == TAG_LEN && bool::from(want.ct_eq(tag)) {
            Ok(())
        } else {
            Err(IntegrityError)
        }
    }
}

/// The keys of an authenticated connection, one [`Direction`] each way.
#[derive(Clone, Debug)]
pub struct Session {
    pub send: Direction,
    pub recv: Direction,
}

impl Session {
    fn derive(
        token: Option<&Token>,
        kind: &str,
        nonce_s: &[u8],
        nonce_c: &[u8],
        is_server: bool,
    ) -> Session {
        let mut salt = Vec::with_capacity(2 * NONCE);
        salt.extend_from_slice(nonce_s);
        salt.extend_from_slice(nonce_c);
        let ikm = token.map(|t| t.0.as_slice()).unwrap_or(&[]);
        let hk = hkdf::Hkdf::<Sha256>::new(Some(&salt), ikm);
        let mut okm = [0u8; 128];
        let info = format!("ferry-session-v1/{kind}");
        hk.expand(info.as_bytes(), &mut okm)
            .unwrap_or_else(|_| unreachable!("128 bytes is within HKDF-SHA256's output limit"));
        let c2s = Direction::new(&okm[0..32], &okm[64..96]);
        let s2c = Direction::new(&okm[32..64], &okm[96..128]);
        if is_server {
            Session {
                send: s2c,
                recv: c2s,
            }
        } else {
            Session {
                send: c2s,
                recv: s2c,
            }
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

/// The server side of the exchange without I/O, so an event loop can drive
/// many at once: [`ServerExchange::start`] gives the HELLO to send, and
/// [`ServerExchange::finish`] takes the peer's PROOF and gives the DONE to
/// send with the verdict.
pub struct ServerExchange {
    token: Option<Token>,
    kind: &'static str,
    nonce_s: [u8; NONCE],
}

impl ServerExchange {
    /// A new exchange for a connection of `kind` ("control", "tcp", "shm")
    /// and the HELLO that opens it.
    pub fn start(
        token: Option<&Token>,
        kind: &'static str,
    ) -> Result<(ServerExchange, [u8; HELLO_LEN]), AuthError> {
        let nonce_s = nonce()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(&header(
            b"FRYA",
            if token.is_some() { FLAG_TOKEN } else { 0 },
        ));
        hello[8..].copy_from_slice(&nonce_s);
        Ok((
            ServerExchange {
                token: token.cloned(),
                kind,
                nonce_s,
            },
            hello,
        ))
    }

    /// Checks the peer's PROOF: the DONE to send (a refused peer learns it
    /// was refused, nothing else) and the session, or why it was refused.
    pub fn finish(
        self,
        proof: &[u8; PROOF_LEN],
    ) -> (Option<[u8; HELLO_LEN]>, Result<Session, AuthError>) {
        let mut done = [0u8; HELLO_LEN];
        let flags = match check_header(proof, b"FRYB", "proof") {
            Ok(f) => f,
            // Not a proof: no answer.
            Err(e) => return (None, Err(e)),
        };
        let nonce_c = &proof[8..8 + NONCE];
        let mac_c = &proof[8 + NONCE..];
        let (result, mac_s, verdict) = match &self.token {
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
                if mac(token, "client", self.kind, &self.nonce_s, nonce_c)
                    .verify_slice(mac_c)
                    .is_ok()
                {
                    let mut out = [0u8; MAC];
                    out.copy_from_slice(
                        &mac(token, "server", self.kind, nonce_c, &self.nonce_s)
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
        done[..8].copy_from_slice(&header(b"FRYD", result));
        done[8..].copy_from_slice(&mac_s);
        let session = verdict.map(|()| {
            Session::derive(self.token.as_ref(), self.kind, &self.nonce_s, nonce_c, true)
        });
        (Some(done), session)
    }
}

/// The server side: runs the exchange on a freshly accepted connection.
/// `kind` names the protocol ("control", "tcp", "shm").
pub fn accept<S: Read + Write>(
    stream: &mut S,
    token: Option<&Token>,
    kind: &'static str,
) -> Result<Session, AuthError> {
    let (exchange, hello) = ServerExchange::start(token, kind)?;
    stream.write_all(&hello).map_err(|e| io("sending", e))?;
    let mut proof = [0u8; PROOF_LEN];
    stream
        .read_exact(&mut proof)
        .map_err(|e| io("reading the peer's proof", e))?;
    let (done, verdict) = exchange.finish(&proof);
    // A refused peer learns it was refused; nothing else.
    let sent = match done {
        Some(done) => stream.write_all(&done),
        None => Ok(()),
    };
    let session = verdict?;
    sent.map_err(|e| io("sending the verdict", e))?;
    Ok(session)
}

/// The greeting that tells a client this server is too busy to take its
/// connection (the caller then closes).
pub fn busy_hello() -> [u8; HELLO_LEN] {
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(&header(b"FRYA", FLAG_BUSY));
    hello
}

/// The verdict that tells a client, after the greeting, that the server
/// turned it away as busy (it was the oldest of a full pool): it may retry.
pub fn busy_done() -> [u8; HELLO_LEN] {
    let mut done = [0u8; HELLO_LEN];
    done[..8].copy_from_slice(&header(b"FRYD", RESULT_BUSY));
    done
}

/// Tells a client this server is too busy to take its connection (sent
/// instead of the greeting; the caller then closes).
pub fn refuse_busy<S: Write>(stream: &mut S) {
    let _ = stream.write_all(&busy_hello());
}

/// The client side: runs the exchange on a fresh connection to `peer`.
pub fn connect<S: Read + Write>(
    stream: &mut S,
    token: Option<&Token>,
    kind: &str,
    peer: &str,
) -> Result<Session, AuthError> {
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| io(&format!("reading {peer}'s greeting"), e))?;
    let flags = check_header(&hello, b"FRYA", "greeting")?;
    if flags & FLAG_BUSY != 0 {
        return Err(AuthError::Busy(format!(
            "{peer} is busy (too many connections being set up); try again"
        )));
    }
    let nonce_s = &hello[8..];
    let requires = flags & FLAG_TOKEN != 0;
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
    if result == RESULT_BUSY {
        return Err(AuthError::Busy(format!(
            "{peer} is busy (too many connections being set up); try again"
        )));
    }
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
    Ok(Session::derive(token, kind, nonce_s, &nonce_c, false))
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
        let t = std::thread::spawn(move || accept(&mut a, st.as_ref(), "test").map(|_| ()));
        let c = connect(&mut b, ct.as_ref(), "test", "peer").map(|_| ());
        drop(b);
        (t.join().unwrap(), c)
    }

    fn sessions(server: Option<&str>, client: Option<&str>) -> (Session, Session) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let st = server.and_then(Token::new);
        let ct = client.and_then(Token::new);
        let t = std::thread::spawn(move || accept(&mut a, st.as_ref(), "test").unwrap());
        let c = connect(&mut b, ct.as_ref(), "test", "peer").unwrap();
        (t.join().unwrap(), c)
    }

    #[test]
    fn both_ends_derive_the_same_keys_and_catch_tampering_replay_and_reordering() {
        let (mut s, mut c) = sessions(Some("secret"), Some("secret"));
        let t0 = c.send.seal(&[b"hello", b" world"]);
        let t1 = c.send.seal(&[b"second"]);
        // Split differently, same bytes: the same message.
        assert_eq!(s.recv.open(&[b"hello world"], &t0), Ok(()));
        // Reordered: message 1's tag does not pass as message 2's, and a
        // replay of message 0 fails where message 1 is expected.
        let mut s2 = s.clone();
        assert_eq!(s2.recv.open(&[b"hello world"], &t0), Err(IntegrityError));
        assert_eq!(s.recv.open(&[b"secont"], &t1), Err(IntegrityError));
        assert_eq!(s.recv.open(&[b"second"], &t1), Ok(()));
        // The directions have different keys: a client's tag reflected back
        // fails.
        let t = s.send.seal(&[b"x"]);
        let mut c2 = c.clone();
        assert_eq!(c.recv.open(&[b"x"], &t), Ok(()));
        let reflected = c2.send.seal(&[b"x"]);
        assert_ne!(reflected, t);
        // Payload tags bind the message number.
        let mut p = c.send.payload(5);
        p.update(b"data");
        let tag = p.finish();
        let mut q = s.recv.payload(5);
        q.update(b"da");
        q.update(b"ta");
        assert_eq!(q.verify(&tag), Ok(()));
        let mut q = s.recv.payload(6);
        q.update(b"data");
        assert_eq!(q.verify(&tag), Err(IntegrityError));
        // Another connection with the same token has other keys.
        let (mut s3, _) = sessions(Some("secret"), Some("secret"));
        let mut c4 = sessions(Some("secret"), Some("secret")).1;
        let t = c4.send.seal(&[b"m"]);
        assert_eq!(s3.recv.open(&[b"m"], &t), Err(IntegrityError));
    }

    #[test]
    fn a_busy_server_is_reported_as_busy() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        refuse_busy(&mut a);
        drop(a);
        let e = connect(&mut b, None, "test", "peer").unwrap_err();
        assert!(matches!(e, AuthError::Busy(_)), "{e:?}");
        assert!(e.to_string().contains("busy"));
    }

    #[test]
    fn the_token_never_prints() {
        let t = Token::new("s3cret-value").unwrap();
        assert!(!format!("{t:?} {t}").contains("s3cret"));
        let (s, _) = sessions(Some("s3cret-value"), Some("s3cret-value"));
        assert!(!format!("{s:?}").contains("s3cret"));
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

/// What a tag costs, for docs/security.md (run in release:
/// `cargo test --release -p ferry-plugins-abi --lib tag_cost -- --ignored --nocapture`).
/// Prints; asserts nothing about time.
#[cfg(test)]
mod cost {
    use super::*;

    #[test]
    #[ignore]
    fn tag_cost() {
        let t = Token::new("cost").unwrap();
        let mut d = Session::derive(Some(&t), "tcp", &[1; 32], &[2; 32], false).send;
        // A 4 KiB x 256 request's header and descriptors, its response's
        // header and statuses, and payloads.
        for (what, len, reps) in [
            ("request header + 256 descriptors", 32 + 256 * 16, 20_000u32),
            ("response header + 256 statuses", 32 + 256 * 4, 20_000),
            ("request header + 1 descriptor", 48, 200_000),
            ("1 MiB payload", 1 << 20, 200),
        ] {
            let buf = vec![7u8; len];
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(d.seal(&[&buf]));
                }
                best = best.min(start.elapsed().as_secs_f64() / f64::from(reps));
            }
            println!(
                "TAGCOST {what}: {:.2} us per tag, {:.2} GB/s",
                best * 1e6,
                len as f64 / best / 1e9
            );
        }
    }
}
