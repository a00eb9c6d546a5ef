//! The side channel without a GPU: admission through the gate, and an
//! authenticated peer served after it.

use super::*;
use ferry_plugins_abi::sdk::admission::Refusal;
use std::io::Read;

struct Quiet;

impl ClientEvents for Quiet {
    fn revoke(&self, _id: u64) {}
    fn closed(&self) {}
}

fn token() -> Option<Token> {
    Token::new("cuda-ipc-channel-test")
}

/// A server whose every lookup fails (no GPU here), with its refusals.
fn server(auth_ms: u64) -> (Server, Vec<u8>, Arc<Refusals>) {
    let name = format!("ferry-cuda-ipc-test-{}-{auth_ms}", std::process::id()).into_bytes();
    let lookup: Arc<Lookup> = Arc::new(|id| {
        Err(PluginError::new(
            ErrorCode::NotFound,
            format!("registration {id} is not registered here"),
        ))
    });
    let refusals = Arc::new(Refusals::new("cuda-ipc"));
    let s = Server::start(
        &name,
        lookup,
        Admission {
            token: token(),
            auth_timeout: Duration::from_millis(auth_ms),
            max_pending: 8,
            max_pending_per_source: 8,
            refusals: refusals.clone(),
            log: Arc::new(|_: &str| {}),
        },
    )
    .unwrap();
    (s, name, refusals)
}

fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn a_proven_peer_is_served_after_the_gate() {
    let (_s, name, refusals) = server(1000);
    let pid = std::process::id() as i32;
    let c = Client::connect(
        &name,
        pid,
        Arc::new(Quiet),
        token().as_ref(),
        Duration::from_secs(5),
    )
    .unwrap();
    let e = c.open(42, Duration::from_secs(5)).err().unwrap();
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    assert!(e.message.contains("registration 42"), "{e:?}");
    assert_eq!(refusals.total(), 0);
}

#[test]
fn a_wrong_token_and_a_silent_peer_are_refused_and_counted() {
    let (_s, name, refusals) = server(150);
    let pid = std::process::id() as i32;
    let wrong = Token::new("another");
    let e = Client::connect(
        &name,
        pid,
        Arc::new(Quiet),
        wrong.as_ref(),
        Duration::from_secs(5),
    )
    .err()
    .unwrap();
    assert!(e.contains("authentication failed"), "{e}");
    assert!(eventually(|| refusals.count(Refusal::Auth) == 1));
    // Silent after the greeting: closed at the whole exchange's deadline.
    let mut s = local::connect(&name, Duration::from_secs(5)).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert_eq!(got.len(), auth::HELLO_LEN, "the greeting, then the close");
    assert!(eventually(|| refusals.count(Refusal::Timeout) == 1));
}
