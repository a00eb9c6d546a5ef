use super::*;
use crate::sdk::auth::{self, AuthError};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

fn token() -> Token {
    Token::new("gate-test-token").unwrap()
}

/// A gate on loopback whose admitted connections are counted (and kept
/// open in `held`).
fn gate(max_pending: usize, per_source: usize, timeout_ms: u64) -> (Gate, u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let admitted = Arc::new(AtomicUsize::new(0));
    let held: Arc<Mutex<Vec<OwnedFd>>> = Arc::default();
    let (a2, h2) = (admitted.clone(), held.clone());
    let g = Gate::start(
        OwnedFd::from(listener),
        "gate-test",
        GateConfig {
            kind: "tcp",
            token: Some(token()),
            auth_timeout: Duration::from_millis(timeout_ms),
            max_pending,
            max_pending_per_source: per_source,
        },
        Box::new(classify_tcp),
        Box::new(move |a: Admitted| {
            a2.fetch_add(1, Ordering::SeqCst);
            h2.lock().unwrap().push(a.fd);
        }),
        Arc::new(Refusals::new("test")),
        Arc::new(|_: &str| {}),
    )
    .unwrap();
    (g, port, admitted)
}

/// A real client: connects and proves itself, retrying on BUSY until its
/// deadline.
fn real_client(port: u16, within: Duration) -> Result<(), AuthError> {
    let started = Instant::now();
    loop {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut d = crate::sdk::deadline::DeadlineStream::new(&s, Duration::from_secs(2));
        match auth::connect(&mut d, Some(&token()), "tcp", "gate") {
            Ok(_) => return Ok(()),
            Err(AuthError::Busy(_)) if started.elapsed() < within => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(e),
        }
    }
}

#[test]
fn a_proven_peer_is_admitted_and_a_wrong_token_is_not() {
    let (_g, port, admitted) = gate(8, 4, 1000);
    real_client(port, Duration::from_secs(2)).unwrap();
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut d = crate::sdk::deadline::DeadlineStream::new(&s, Duration::from_secs(2));
    let wrong = Token::new("another").unwrap();
    let e = auth::connect(&mut d, Some(&wrong), "tcp", "gate").unwrap_err();
    assert!(matches!(e, AuthError::Refused(_)), "{e:?}");
    assert_eq!(admitted.load(Ordering::SeqCst), 1);
}

#[test]
fn silent_connections_reopened_as_fast_as_closed_do_not_lock_real_peers_out() {
    // A small pool, a long deadline: without eviction of the oldest, eight
    // silent connections would hold the door for the whole deadline.
    let (_g, port, admitted) = gate(8, 8, 5000);
    let stop = Arc::new(AtomicBool::new(false));
    let mut flooders = Vec::new();
    for _ in 0..2 {
        let stop = stop.clone();
        flooders.push(std::thread::spawn(move || {
            let mut held: VecDeque<TcpStream> = VecDeque::new();
            let mut opened = 0usize;
            while !stop.load(Ordering::SeqCst) {
                if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                    held.push_back(s);
                    opened += 1;
                }
                if held.len() > 16 {
                    held.pop_front();
                }
            }
            opened
        }));
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut served = 0;
    for _ in 0..3 {
        if real_client(port, Duration::from_secs(5)).is_ok() {
            served += 1;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let opened: usize = flooders.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(opened > 16, "the flood opened only {opened} connections");
    assert_eq!(served, 3, "{served} of 3 real peers served under the flood");
    assert_eq!(admitted.load(Ordering::SeqCst), 3);
}

#[test]
fn a_silent_connection_is_closed_at_the_deadline() {
    let (_g, port, _) = gate(8, 8, 100);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 64];
    use std::io::Read;
    let mut got = 0;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => panic!("the gate kept a silent connection past its deadline: {e}"),
        }
    }
    assert_eq!(got, HELLO_LEN, "only the greeting, then closed");
}

#[test]
fn garbage_gets_the_greeting_then_a_clean_close() {
    use std::io::{Read, Write};
    let (_g, port, admitted) = gate(8, 8, 1000);
    for n in [1usize, 27, 72, 4096, 65536] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(&vec![0xffu8; n]);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let r = s.read_to_end(&mut reply);
        assert!(
            r.is_ok(),
            "{n} bytes of garbage: {r:?} after {} bytes",
            reply.len()
        );
        assert_eq!(reply.len(), HELLO_LEN, "{n} bytes of garbage");
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 0);
}

/// A gate whose classifier refuses everyone with `kind`.
fn refusing_gate(kind: Refusal) -> (Gate, u16, Arc<Refusals>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let refusals = Arc::new(Refusals::new("test"));
    let g = Gate::start(
        OwnedFd::from(listener),
        "gate-test",
        GateConfig {
            kind: "tcp",
            token: Some(token()),
            auth_timeout: Duration::from_millis(1000),
            max_pending: 8,
            max_pending_per_source: 8,
        },
        Box::new(move |_: &OwnedFd| Err((kind, "refused by the test".to_string()))),
        Box::new(|_: Admitted| {}),
        refusals.clone(),
        Arc::new(|_: &str| {}),
    )
    .unwrap();
    (g, port, refusals)
}

#[test]
fn a_classifier_refusing_for_room_says_busy_and_for_who_says_nothing() {
    use std::io::Read;
    let (_g, port, refusals) = refusing_gate(Refusal::Full);
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut d = crate::sdk::deadline::DeadlineStream::new(&s, Duration::from_secs(2));
    let e = auth::connect(&mut d, Some(&token()), "tcp", "gate").unwrap_err();
    assert!(matches!(e, AuthError::Busy(_)), "{e:?}");
    assert_eq!(refusals.count(Refusal::Full), 1);
    let (_g, port, refusals) = refusing_gate(Refusal::PeerUser);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "another user learns nothing: {got:?}");
    assert_eq!(refusals.count(Refusal::PeerUser), 1);
}
