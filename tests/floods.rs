//! Floods of silent connections against the tcp data port and the control
//! port, reopened as fast as the target closes them (issue 34, finding 1):
//! from one address and from eight, real peers are still served, 3 of 3,
//! within their connect deadline. Before the gate evicted the oldest
//! pending connection, eight silent connections per address held the pool
//! for their whole auth deadline, and real peers got BUSY until theirs ran
//! out: 0 of 3.
//!
//! Authenticated peers cannot lock the control port either (issue 34,
//! finding 3): eight headers each claiming 16 MiB hold none of the body
//! budget, and 128 idle connections from one host take 32 places (its
//! share), not all 128.
//!
//! The attack lasts FERRY_FLOOD_SECS (3 s by default; the 60 s
//! with FERRY_FLOOD_SECS=60); FERRY_FLOOD_PER_SOURCE widens it.

use ferry_core::{Engine, EngineConfig, Op, Request};
use ferry_tests::listeners::{connect_from, tcp_data};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "cluster-secret-for-flood-tests";

fn engine(settings: &[(&str, &str)]) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", "tcp").unwrap();
    c.set("auth_token", TOKEN).unwrap();
    c.set("connect_timeout_ms", "5000").unwrap();
    for (k, v) in settings {
        c.set(k, v).unwrap();
    }
    Engine::new(c).unwrap()
}

/// Silent connections the attacker keeps open per address
/// (FERRY_FLOOD_PER_SOURCE, 8 by default: the pool's share of one source;
/// more makes every new one evict an older one at once).
fn flood_width() -> usize {
    std::env::var("FERRY_FLOOD_PER_SOURCE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

fn flood_secs() -> u64 {
    std::env::var("FERRY_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

/// Whether the target closed this connection (or sent anything: the
/// greeting, or BUSY; a silent attacker never answers).
fn closed(s: &TcpStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(s),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n <= 0 {
        return false;
    }
    let mut buf = [0u8; 128];
    // SAFETY: buf is writable for its length.
    let got = unsafe {
        libc::recv(
            pfd.fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    got <= 0 || pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Opens one attacking connection from a source.
type Opener = Arc<dyn Fn(std::net::Ipv4Addr) -> Option<TcpStream> + Send + Sync>;

/// Silent connections to `to`: they never answer the greeting.
fn silent(to: SocketAddr) -> Opener {
    Arc::new(move |src| connect_from(src, to))
}

/// Connections that authenticate (with the cluster's token) and then send
/// `after`, and nothing more.
fn authenticated(to: SocketAddr, after: Vec<u8>) -> Opener {
    use ferry_plugins_abi::sdk::{auth, deadline::DeadlineStream};
    use std::io::Write;
    Arc::new(move |src| {
        let s = connect_from(src, to)?;
        let token = auth::Token::new(TOKEN);
        let mut ds = DeadlineStream::new(&s, Duration::from_secs(5));
        auth::connect(&mut ds, token.as_ref(), "control", "target").ok()?;
        (&s).write_all(&after).ok()?;
        Some(s)
    })
}

/// A control header claiming a 16 MiB body (whose bytes never come).
fn header_claiming_16_mib() -> Vec<u8> {
    use ferry_core::control::{encode_frame, MsgType, MAX_BODY};
    let mut h = encode_frame(MsgType::GetDescriptor, b"");
    h[8..12].copy_from_slice(&(MAX_BODY as u32).to_le_bytes());
    h
}

/// Keeps `per_source` attacking connections open from each source,
/// reopening each as soon as the target closes it (or says anything),
/// until `stop`.
fn flood(
    sources: Vec<std::net::Ipv4Addr>,
    open: Opener,
    per_source: usize,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
) -> Vec<std::thread::JoinHandle<()>> {
    sources
        .into_iter()
        .map(|src| {
            let (stop, opened, open) = (stop.clone(), opened.clone(), open.clone());
            std::thread::spawn(move || {
                let mut held: Vec<Option<TcpStream>> = (0..per_source).map(|_| None).collect();
                while !stop.load(Ordering::SeqCst) {
                    for slot in held.iter_mut() {
                        if slot.as_ref().is_none_or(closed) {
                            *slot = open(src);
                            if slot.is_some() {
                                opened.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        })
        .collect()
}

/// 3 real peers, each with a fresh control connection and fresh data
/// connections made during the flood: how many moved their bytes.
fn real_peers_served(target: &Engine, secret: &[u8]) -> usize {
    let mut served = 0;
    for _ in 0..3 {
        let peer = engine(&[]);
        let mut back = vec![0u8; secret.len()];
        peer.register_memory(back.as_mut_ptr() as u64, back.len() as u64, None)
            .unwrap();
        let started = Instant::now();
        // The descriptor fetch (control port), then the data (tcp port).
        let r = peer.open_segment(target.segment_name()).and_then(|seg| {
            peer.transfer_sync(&[Request::new(
                Op::Read,
                back.as_mut_ptr() as u64,
                seg,
                secret.as_ptr() as u64,
                secret.len() as u64,
            )])
        });
        match r {
            Ok(()) if back == secret => served += 1,
            Ok(()) => eprintln!("a real peer read wrong bytes"),
            Err(e) => eprintln!(
                "a real peer was not served after {} ms: {e}",
                started.elapsed().as_millis()
            ),
        }
    }
    served
}

/// Which port of the target a flood aims at.
#[derive(Clone, Copy)]
enum Port {
    TcpData,
    Control,
}

/// A target serving `secret`, and its address for `port`.
fn target(secret: &[u8], port: Port) -> (Engine, SocketAddr) {
    let target = engine(&[]);
    target
        .register_memory(secret.as_ptr() as u64, secret.len() as u64, None)
        .unwrap();
    let to = match port {
        Port::TcpData => tcp_data(&target),
        Port::Control => target.segment_name().parse().unwrap(),
    };
    (target, to)
}

fn secret() -> Vec<u8> {
    (0..65536u32).map(|i| (i * 7) as u8).collect()
}

/// Real peers, 3 at a time, for FERRY_FLOOD_SECS while `threads` attack
/// `target`; asserts every one was served.
fn serve_through(
    what: &str,
    target: &Engine,
    secret: &[u8],
    threads: Vec<std::thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
) -> usize {
    let started = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let mut rounds = 0;
    let mut served = 0;
    loop {
        served += real_peers_served(target, secret);
        rounds += 1;
        if started.elapsed() >= Duration::from_secs(flood_secs()) {
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    eprintln!(
        "{what}: {served} of {} real peers served in {} s",
        rounds * 3,
        started.elapsed().as_secs()
    );
    assert_eq!(served, rounds * 3, "{what}: real peers locked out");
    served
}

fn run_flood(sources: Vec<std::net::Ipv4Addr>, port: Port) {
    let secret = secret();
    let (target, to) = target(&secret, port);
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let n_sources = sources.len();
    let threads = flood(
        sources,
        silent(to),
        flood_width(),
        stop.clone(),
        opened.clone(),
    );
    let what = match port {
        Port::TcpData => format!("tcp data port, {n_sources} source(s)"),
        Port::Control => format!("control port, {n_sources} source(s)"),
    };
    serve_through(&what, &target, &secret, threads, stop);
    let opened = opened.load(Ordering::Relaxed);
    eprintln!("{what}: the flood opened {opened} connections");
    assert!(
        opened > 8 * n_sources,
        "the flood never reopened anything ({opened} connections)"
    );
}

fn eight_sources() -> Vec<std::net::Ipv4Addr> {
    (2..10)
        .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i))
        .collect()
}

#[test]
fn a_reopening_flood_from_one_address_leaves_real_peers_served() {
    run_flood(vec![std::net::Ipv4Addr::LOCALHOST], Port::TcpData);
}

#[test]
fn a_reopening_flood_from_eight_addresses_leaves_real_peers_served() {
    run_flood(eight_sources(), Port::TcpData);
}

#[test]
fn a_reopening_control_flood_from_one_address_leaves_real_peers_served() {
    run_flood(vec![std::net::Ipv4Addr::LOCALHOST], Port::Control);
}

#[test]
fn a_reopening_control_flood_from_eight_addresses_leaves_real_peers_served() {
    run_flood(eight_sources(), Port::Control);
}

/// Eight authenticated connections from one host, each sending a header
/// that claims 16 MiB and then nothing (reopened when closed): the bodies'
/// budget is taken as bytes arrive, so they hold none of it, and peers
/// from another host are served. Before, each header took 16 MiB of the
/// 128 at once, and every other request was answered BUSY.
#[test]
fn headers_claiming_16_mib_each_hold_no_budget() {
    let secret = secret();
    let (target, to) = target(&secret, Port::Control);
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let threads = flood(
        vec![std::net::Ipv4Addr::new(127, 0, 0, 2)],
        authenticated(to, header_claiming_16_mib()),
        8,
        stop.clone(),
        opened.clone(),
    );
    // The eight are in place before the first peer comes.
    let started = Instant::now();
    while opened.load(Ordering::SeqCst) < 8 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(opened.load(Ordering::SeqCst) >= 8, "the hog never got in");
    serve_through(
        "eight 16 MiB headers from 127.0.0.2",
        &target,
        &secret,
        threads,
        stop,
    );
}

/// Idle authenticated connections held open from `hosts`, `each` per host.
fn hold_idle(to: SocketAddr, hosts: &[std::net::Ipv4Addr], each: usize) -> Vec<TcpStream> {
    let open = authenticated(to, Vec::new());
    let mut held = Vec::new();
    for h in hosts {
        held.extend((0..each).filter_map(|_| open(*h)));
    }
    held
}

/// Connections of `held` the target has not closed or told anything.
fn still_open(held: &[TcpStream]) -> usize {
    held.iter().filter(|s| !closed(s)).count()
}

/// 128 idle authenticated connections from one host (the listener's whole
/// cap) keep only that host's share (32), and peers from another host are
/// served; then 32 idle ones from each of four hosts fill the whole cap,
/// and each newcomer takes an idle one's place. Before, the first 128 took
/// every place and peers were answered BUSY until the idle timeout (120 s).
#[test]
fn idle_connections_from_one_host_cannot_take_every_place() {
    let secret = secret();
    let (target, to) = target(&secret, Port::Control);
    let one = hold_idle(to, &[std::net::Ipv4Addr::new(127, 0, 0, 2)], 128);
    std::thread::sleep(Duration::from_millis(300));
    let kept = still_open(&one);
    eprintln!(
        "128 idle connections from 127.0.0.2: {} authenticated, {kept} kept",
        one.len()
    );
    assert!(kept <= 32, "one host kept {kept} control connections");
    let stop = Arc::new(AtomicBool::new(false));
    serve_through(
        "128 idle connections from 127.0.0.2",
        &target,
        &secret,
        Vec::new(),
        stop,
    );
    drop(one);
    // Four hosts, 32 each: every place taken, all idle for over a second.
    let hosts: Vec<_> = (4..8)
        .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i))
        .collect();
    let four = hold_idle(to, &hosts, 32);
    std::thread::sleep(Duration::from_millis(1200));
    let stop = Arc::new(AtomicBool::new(false));
    serve_through(
        "32 idle connections from each of 4 hosts",
        &target,
        &secret,
        Vec::new(),
        stop,
    );
    eprintln!(
        "of the 128 idle connections of 4 hosts, {} are still open",
        still_open(&four)
    );
}
