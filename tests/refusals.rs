//! Refusals are visible (issue 34): every cause a listener can be made to
//! refuse for, provoked on the tcp data port and the shm socket of a fresh
//! engine, shows as one warn line naming it (the first refusal of a
//! listener is logged at once; later ones at most once per 10 s) and as
//! `ferry_refusals_total{listener, cause}` in the engine's metrics text.
//!
//! Not here: `full` on shm (1,024 peers), `integrity` on shm (its messages
//! carry no tags), `peer_user` on tcp (no such check), and cuda-ipc (no GPU
//! on the machines that run this suite).

use ferry_core::{Engine, EngineConfig};
use ferry_plugins_abi::sdk::admission::Refusal;
use ferry_plugins_abi::sdk::auth;
use ferry_plugins_abi::sdk::deadline::DeadlineStream;
use ferry_tests::fuzz::tcp as wire;
use ferry_tests::listeners::{
    capture_warnings, eventually, read_to_close, refusals, shm_socket, tcp_data, warnings, Seq,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

const TOKEN: &str = "cluster-secret-for-refusal-tests";

/// One test at a time: they share the captured log.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    let guard = ONE.lock().unwrap_or_else(|p| p.into_inner());
    capture_warnings();
    guard
}

fn engine(settings: &[(&str, &str)]) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", "tcp,shm").unwrap();
    c.set("auth_token", TOKEN).unwrap();
    c.set("auth_timeout_ms", "3000").unwrap();
    for (k, v) in settings {
        c.set(k, v).unwrap();
    }
    Engine::new(c).unwrap()
}

/// `e`'s `listener` counted a refusal of `kind` in its metrics, and said so
/// in a warn line (after `mark`, the number of lines before the attempt).
fn assert_refused(e: &Engine, listener: &str, kind: Refusal, mark: usize) {
    assert!(
        eventually(|| refusals(e, listener, kind.cause()) >= 1),
        "{listener}: no {} refusal in the metrics:\n{}",
        kind.cause(),
        e.metrics_prometheus()
    );
    let target = format!("ferry::plugin::{listener}:");
    let prefix = format!("{listener}: refused ");
    // The line follows the count by a moment (the same call writes both).
    let line = || {
        let lines = warnings();
        lines[mark.min(lines.len())..]
            .iter()
            .find(|l| {
                l.starts_with("WARN ")
                    && l.contains(&target)
                    && l.contains(&prefix)
                    && l.contains(kind.name())
            })
            .cloned()
    };
    let found = eventually(|| line().is_some()).then(line).flatten();
    assert!(
        found.is_some(),
        "{listener}: no warn line for {:?} ({}) among {:?}",
        kind,
        kind.name(),
        &warnings()[mark..]
    );
    eprintln!(
        "{listener} {}: counted {}, logged: {}",
        kind.cause(),
        refusals(e, listener, kind.cause()),
        found.unwrap()
    );
}

fn token() -> Option<auth::Token> {
    auth::Token::new(TOKEN)
}

fn tcp(e: &Engine) -> TcpStream {
    let s = TcpStream::connect(tcp_data(e)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// An authenticated tcp data connection, past the target's hello.
fn tcp_authenticated(e: &Engine) -> TcpStream {
    let mut s = tcp(e);
    auth::connect(
        &mut DeadlineStream::new(&s, Duration::from_secs(5)),
        token().as_ref(),
        "tcp",
        "target",
    )
    .unwrap();
    let mut hello = [0u8; wire::HELLO_LEN + auth::TAG_LEN];
    s.read_exact(&mut hello).unwrap();
    s
}

fn shm(e: &Engine) -> Seq {
    Seq::connect(&shm_socket(e)).unwrap()
}

#[test]
fn a_wrong_token_is_counted_and_logged() {
    let _one = serial();
    let e = engine(&[]);
    let mark = warnings().len();
    let wrong = auth::Token::new("not-the-cluster-token");
    let s = tcp(&e);
    let r = auth::connect(
        &mut DeadlineStream::new(&s, Duration::from_secs(5)),
        wrong.as_ref(),
        "tcp",
        "target",
    );
    assert!(matches!(r, Err(auth::AuthError::Refused(_))), "{r:?}");
    assert_refused(&e, "tcp", Refusal::Auth, mark);
    let mark = warnings().len();
    let r = auth::connect(&mut shm(&e), wrong.as_ref(), "shm", "target");
    assert!(matches!(r, Err(auth::AuthError::Refused(_))), "{r:?}");
    assert_refused(&e, "shm", Refusal::Auth, mark);
    // The control listener's refusals are in the same family (its counts
    // are the process's, so only the count is checked here).
    let before = refusals(&e, "control", "auth");
    let s = TcpStream::connect(e.segment_name()).unwrap();
    let r = auth::connect(
        &mut DeadlineStream::new(&s, Duration::from_secs(5)),
        wrong.as_ref(),
        "control",
        "target",
    );
    assert!(matches!(r, Err(auth::AuthError::Refused(_))), "{r:?}");
    assert!(
        eventually(|| refusals(&e, "control", "auth") > before),
        "{}",
        e.metrics_prometheus()
    );
}

#[test]
fn a_silent_connection_is_counted_and_logged_as_a_timeout() {
    let _one = serial();
    let e = engine(&[("auth_timeout_ms", "200")]);
    let mark = warnings().len();
    // The greeting, then nothing from us, then the close.
    assert_eq!(read_to_close(&mut tcp(&e)).len(), auth::HELLO_LEN);
    assert_refused(&e, "tcp", Refusal::Timeout, mark);
    let mark = warnings().len();
    assert_eq!(read_to_close(&mut shm(&e)).len(), auth::HELLO_LEN);
    assert_refused(&e, "shm", Refusal::Timeout, mark);
}

/// Three silent connections where the pool holds two: the first is evicted
/// (told BUSY) for the third.
fn evict_one<S: Read>(mut open: impl FnMut() -> S) {
    let mut conns: Vec<S> = (0..3)
        .map(|_| {
            let mut s = open();
            let mut hello = [0u8; auth::HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            s
        })
        .collect();
    let mut busy = [0u8; auth::HELLO_LEN];
    conns[0].read_exact(&mut busy).unwrap();
    assert_eq!(&busy[..4], b"FRYD", "the evicted one is told why");
    assert_eq!(busy[5], 3, "busy");
}

#[test]
fn a_full_pre_auth_pool_is_counted_and_logged_as_busy() {
    let _one = serial();
    let e = engine(&[
        ("auth_max_pending", "2"),
        ("auth_max_pending_per_host", "8"),
    ]);
    let mark = warnings().len();
    evict_one(|| tcp(&e));
    assert_refused(&e, "tcp", Refusal::Busy, mark);
    let mark = warnings().len();
    evict_one(|| shm(&e));
    assert_refused(&e, "shm", Refusal::Busy, mark);
}

#[test]
fn one_source_over_its_share_is_counted_and_logged_as_per_source() {
    let _one = serial();
    let e = engine(&[
        ("auth_max_pending", "8"),
        ("auth_max_pending_per_host", "2"),
    ]);
    let mark = warnings().len();
    evict_one(|| tcp(&e));
    assert_refused(&e, "tcp", Refusal::PerSource, mark);
    let mark = warnings().len();
    evict_one(|| shm(&e));
    assert_refused(&e, "shm", Refusal::PerSource, mark);
}

#[test]
fn a_protocol_violation_after_authentication_is_counted_and_logged() {
    let _one = serial();
    let e = engine(&[]);
    let mark = warnings().len();
    let mut s = tcp_authenticated(&e);
    // As many bytes as the smallest frame: a header that is not one.
    s.write_all(&[0xAB; wire::HEADER_LEN + wire::DESC_LEN + auth::TAG_LEN])
        .unwrap();
    assert!(read_to_close(&mut s).is_empty());
    assert_refused(&e, "tcp", Refusal::Protocol, mark);
    // shm: a confirmation of a revocation never sent.
    let mark = warnings().len();
    let mut s = shm(&e);
    auth::connect(&mut s, token().as_ref(), "shm", "target").unwrap();
    let ack = ferry_tests::fuzz::shm::Msg {
        kind: ferry_tests::fuzz::shm::REVOKE_ACK,
        id: 7,
        a: 0,
        b: 0,
    };
    s.write_all(&ack.encode()).unwrap();
    assert!(read_to_close(&mut s).is_empty());
    assert_refused(&e, "shm", Refusal::Protocol, mark);
}

#[test]
fn a_frame_with_a_forged_tag_is_counted_and_logged_as_integrity() {
    let _one = serial();
    let e = engine(&[]);
    let mark = warnings().len();
    let mut s = tcp_authenticated(&e);
    let header = wire::Header {
        kind: wire::Kind::Read,
        flags: 0,
        count: 1,
        seq: 0,
        payload_len: 0,
    };
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(&0x1000u64.to_le_bytes());
    frame.extend_from_slice(&64u64.to_le_bytes());
    frame.extend_from_slice(&[0u8; auth::TAG_LEN]);
    s.write_all(&frame).unwrap();
    assert!(read_to_close(&mut s).is_empty(), "nothing answered");
    assert_refused(&e, "tcp", Refusal::Integrity, mark);
}

#[test]
fn a_connection_over_the_served_cap_is_counted_and_logged_as_full() {
    let _one = serial();
    let e = engine(&[("tcp.max_connections", "1")]);
    let mark = warnings().len();
    let _served = tcp_authenticated(&e);
    let mut s = tcp(&e);
    auth::connect(
        &mut DeadlineStream::new(&s, Duration::from_secs(5)),
        token().as_ref(),
        "tcp",
        "target",
    )
    .unwrap();
    assert!(read_to_close(&mut s).is_empty(), "closed without a hello");
    assert_refused(&e, "tcp", Refusal::Full, mark);
}

/// Run as uid nobody by the test below: connects to the shm socket named
/// (in hex) by FERRY_TEST_SHM_SOCKET and prints what it got.
#[test]
fn peer_user_child() {
    let Ok(hex) = std::env::var("FERRY_TEST_SHM_SOCKET") else {
        return;
    };
    let name: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    match Seq::connect(&name) {
        Err(e) => println!("CHILD shm: refused at connect ({e})"),
        Ok(mut s) => println!("CHILD shm: got {} bytes", read_to_close(&mut s).len()),
    }
}

#[test]
fn another_user_is_counted_and_logged_as_peer_user() {
    if let Some(why) = ferry_tests::cannot_switch_user() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let _one = serial();
    let e = engine(&[]);
    let mark = warnings().len();
    let hex: String = shm_socket(&e).iter().map(|b| format!("{b:02x}")).collect();
    let out = ferry_tests::as_nobody("peer_user_child")
        .env("FERRY_TEST_SHM_SOCKET", &hex)
        .env("HOME", "/nonexistent")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("CHILD shm: got 0 bytes"),
        "uid nobody got something: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_refused(&e, "shm", Refusal::PeerUser, mark);
}
