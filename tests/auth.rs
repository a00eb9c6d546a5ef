//! The cluster token (FERRY_AUTH_TOKEN): engines that share it move data
//! over every transport; a peer without it, or with another, is refused on
//! the control plane and on data connections before anything it sends is
//! parsed; a listener other hosts can reach needs a token (or FERRY_AUTH=off).

use ferry_core::{Engine, EngineConfig, ErrorCode, Op, Request};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn engine(transports: &str, token: Option<&str>) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", transports).unwrap();
    c.set("timeout_ms", "3000").unwrap();
    c.set("connect_timeout_ms", "500").unwrap();
    match token {
        Some("off") => c.set("auth", "off").unwrap(),
        Some(t) => c.set("auth_token", t).unwrap(),
        // No token configured: this user's token.
        None => {}
    }
    Engine::new(c).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

#[test]
fn engines_sharing_a_token_move_data_over_every_transport() {
    for transports in ["tcp", "shm"] {
        let target = engine(transports, Some("s3cret-cluster-token"));
        let initiator = engine(transports, Some("s3cret-cluster-token"));
        const LEN: usize = 4 << 20;
        let remote = target.allocate_memory(LEN as u64, None).unwrap();
        let src = pattern(LEN, 3);
        let mut back = vec![0u8; LEN];
        initiator
            .register_memory(src.as_ptr() as u64, LEN as u64, None)
            .unwrap();
        initiator
            .register_memory(back.as_mut_ptr() as u64, LEN as u64, None)
            .unwrap();
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        initiator
            .transfer_sync(&[Request::new(
                Op::Write,
                src.as_ptr() as u64,
                seg,
                remote,
                LEN as u64,
            )])
            .unwrap();
        initiator
            .transfer_sync(&[Request::new(
                Op::Read,
                back.as_mut_ptr() as u64,
                seg,
                remote,
                LEN as u64,
            )])
            .unwrap();
        assert!(back == src, "{transports}");
        let route = initiator
            .route(seg, src.as_ptr() as u64, remote, LEN as u64)
            .unwrap();
        assert_eq!(route.transport, transports);
    }
}

#[test]
fn a_peer_with_another_token_or_none_is_refused_with_a_clear_error() {
    let target = engine("tcp", Some("right-token"));
    for (token, expect) in [
        (Some("wrong-token"), "tokens differ"),
        // This user's token is not the cluster's.
        (None, "tokens differ"),
        (Some("off"), "requires an auth token"),
    ] {
        let initiator = engine("tcp", token);
        let e = initiator.open_segment(target.segment_name()).unwrap_err();
        assert_eq!(e.code, ErrorCode::Permission, "{e}");
        assert!(e.message.contains(expect), "{e}");
    }
    // A peer with a token refuses a target that has none.
    let open = engine("tcp", Some("off"));
    let initiator = engine("tcp", Some("right-token"));
    let e = initiator.open_segment(open.segment_name()).unwrap_err();
    assert!(e.message.contains("does not authenticate"), "{e}");
}

/// Connections that do not complete the exchange — silence, garbage, a
/// plain request frame, an HTTP request — get nothing: no descriptor, no
/// memory. Counts what was tried and what was refused.
#[test]
fn unauthenticated_connections_are_refused_before_any_request_is_parsed() {
    let target = engine("tcp,shm", Some("right-token"));
    let secret = pattern(1 << 20, 99);
    target
        .register_memory(secret.as_ptr() as u64, secret.len() as u64, None)
        .unwrap();
    let control = target.segment_name().to_string();
    let data = {
        let d = target.descriptor();
        let t = d.transports.iter().find(|t| t.name == "tcp").unwrap();
        let raw = ferry_core::descriptor::decode_blob(&t.endpoint).unwrap();
        // "host:port instance"
        let text = String::from_utf8(raw).unwrap();
        text.split(' ').next().unwrap().to_string()
    };
    // A GetDescriptor frame as an old or hostile client would send it.
    let mut get = Vec::new();
    get.extend_from_slice(b"FRYC");
    get.extend_from_slice(&[1, 0, 1, 0]);
    get.extend_from_slice(&2u32.to_le_bytes());
    get.extend_from_slice(b"{}");
    let attempts: Vec<Vec<u8>> = vec![
        get.clone(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0u8; 4096],
        vec![0xff; 72],
        // A well-formed proof with a MAC made without the token.
        {
            let mut p = b"FRYB\x01\x01\x00\x00".to_vec();
            p.extend_from_slice(&[7u8; 64]);
            p
        },
    ];
    // The shm side channel: an abstract Unix socket named in the endpoint.
    let shm_socket = {
        let d = target.descriptor();
        let t = d.transports.iter().find(|t| t.name == "shm").unwrap();
        let raw = ferry_core::descriptor::decode_blob(&t.endpoint).unwrap();
        ferry_tests::fuzz::shm_endpoint::Endpoint::decode(&raw)
            .unwrap()
            .socket
    };
    // A MAP request (kind 1) for the secret, as a peer that skipped the
    // exchange would send it.
    let map = ferry_tests::fuzz::shm::Msg {
        kind: 1,
        id: 1,
        a: secret.as_ptr() as u64,
        b: secret.len() as u64,
    }
    .encode()
    .to_vec();
    enum To<'a> {
        Tcp(&'a str),
        Unix(&'a [u8]),
    }
    let mut tried = 0;
    let mut refused = 0;
    for to in [To::Tcp(&control), To::Tcp(&data), To::Unix(&shm_socket)] {
        for a in attempts.iter().chain([&map]) {
            tried += 1;
            let mut got = Vec::new();
            match &to {
                To::Tcp(addr) => {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let _ = s.write_all(a);
                    let _ = s.read_to_end(&mut got);
                }
                To::Unix(name) => got = seqpacket_exchange(name, a),
            }
            // All a stranger may see: the 40-byte greeting (sent before
            // anything is read) and a verdict.
            let leaked = !got.starts_with(b"FRYA")
                || got.len() > 80
                || got.windows(4).any(|w| w == b"FRYC")
                || got
                    .windows(16)
                    .any(|w| secret.windows(16).next().is_some_and(|s| s == w));
            if !leaked {
                refused += 1;
            }
        }
    }
    eprintln!("unauthenticated connections: {tried} tried, {refused} refused");
    assert_eq!(tried, refused);
    assert!(
        ferry_core::control_server::AUTH_REFUSED.load(std::sync::atomic::Ordering::SeqCst) >= 5
    );
    // The target still serves its peers.
    let peer = engine("tcp", Some("right-token"));
    let seg = peer.open_segment(&control).unwrap();
    let mut back = vec![0u8; 4096];
    peer.register_memory(back.as_mut_ptr() as u64, 4096, None)
        .unwrap();
    peer.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg,
        secret.as_ptr() as u64,
        4096,
    )])
    .unwrap();
    assert!(back[..] == secret[..4096]);
}

#[test]
fn a_listener_other_hosts_can_reach_needs_a_token_or_an_explicit_off() {
    let mut c = EngineConfig::default();
    c.set("listen", "0.0.0.0:0").unwrap();
    c.set("transports", "tcp").unwrap();
    let e = Engine::new(c.clone())
        .err()
        .expect("refused without a token");
    assert_eq!(e.code, ErrorCode::Permission);
    assert!(e.message.contains("FERRY_AUTH_TOKEN"), "{e}");
    let mut off = c.clone();
    off.set("auth", "off").unwrap();
    Engine::new(off).expect("FERRY_AUTH=off starts");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "from-a-file\n").unwrap();
    let mut with = c;
    with.set("auth_token_file", file.to_str().unwrap()).unwrap();
    Engine::new(with).expect("a token file starts");
    let mut bad = EngineConfig::default();
    let e = bad
        .set("auth_token_file", "/nonexistent/token")
        .unwrap_err();
    assert!(e.message.contains("/nonexistent/token"), "{e}");
}

/// Connects a SOCK_SEQPACKET socket (what the shm side channel listens on)
/// to an abstract Unix name, sends `msg` and collects what comes back until
/// the other end closes (or 5 s pass).
fn seqpacket_exchange(name: &[u8], msg: &[u8]) -> Vec<u8> {
    use std::io::Write;
    assert!(name.len() < 107, "an abstract name of {} bytes", name.len());
    let mut s = ferry_tests::listeners::Seq::connect(name).expect("connect");
    // A failed send is fine here (the peer may already have closed).
    let _ = s.write(msg);
    ferry_tests::listeners::read_to_close(&mut s)
}
