//! Floods of the shm socket (issue 34): a process of another user (uid
//! nobody, through setpriv) reopening connections as fast as they are
//! closed, and silent connections of this user reopened as fast as the
//! owner evicts them, at once. Three real shm initiators are still served,
//! 3 of 3, within their connect deadline: the other user is closed at
//! accept (SO_PEERCRED, before a byte is read) and silent connections of
//! this user only ever evict each other from the pre-auth pool, while a
//! real peer's proof arrives within a round trip (and a peer told BUSY
//! asks again).
//!
//! The attack lasts FERRY_FLOOD_SECS (3 s by default). The other-user
//! flood needs root and setpriv; without them it is skipped with the
//! reason printed, and the same-user flood runs alone.

use ferry_core::{Engine, EngineConfig, Op, Request};
use ferry_tests::listeners::{read_to_close, refusals, shm_socket, Seq};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "cluster-secret-for-shm-flood-tests";

fn engine() -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", "shm").unwrap();
    c.set("auth_token", TOKEN).unwrap();
    c.set("connect_timeout_ms", "5000").unwrap();
    Engine::new(c).unwrap()
}

fn flood_secs() -> u64 {
    std::env::var("FERRY_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

/// Run as uid nobody by the test below: reconnects to the shm socket named
/// in FERRY_TEST_SHM_FLOOD ("hex seconds") until the time is up, and
/// prints how many connections it opened and how many gave it any byte.
#[test]
fn other_user_flood_child() {
    let Ok(spec) = std::env::var("FERRY_TEST_SHM_FLOOD") else {
        return;
    };
    let (hex, secs) = spec.split_once(' ').unwrap();
    let name: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let until = Instant::now() + Duration::from_secs(secs.parse().unwrap());
    let (mut opened, mut answered) = (0u64, 0u64);
    while Instant::now() < until {
        if let Ok(mut s) = Seq::connect(&name) {
            opened += 1;
            if !read_to_close(&mut s).is_empty() {
                answered += 1;
            }
        }
    }
    println!("FLOOD opened {opened} answered {answered}");
}

/// Starts the other-user flood, or says why it cannot run.
fn other_user_flood(name: &[u8], secs: u64) -> Option<std::process::Child> {
    if let Some(why) = ferry_tests::cannot_switch_user() {
        eprintln!("SKIPPED the other-user flood: {why}");
        return None;
    }
    let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
    Some(
        ferry_tests::as_nobody("other_user_flood_child")
            .env("FERRY_TEST_SHM_FLOOD", format!("{hex} {secs}"))
            .env("HOME", "/nonexistent")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// A real initiator: a fresh engine writes 4 KiB over shm into the
/// target's buffer and reads it back.
fn real_initiator(target: &Engine, remote: u64, seed: u8) -> Result<(), String> {
    let e = engine();
    let src = ferry_tests::pattern(4096, u64::from(seed));
    let mut back = vec![0u8; 4096];
    e.register_memory(src.as_ptr() as u64, 4096, None)
        .map_err(|x| x.to_string())?;
    e.register_memory(back.as_mut_ptr() as u64, 4096, None)
        .map_err(|x| x.to_string())?;
    let seg = e
        .open_segment(target.segment_name())
        .map_err(|x| x.to_string())?;
    let req = |op, local: u64| Request {
        transport: Some("shm".into()),
        ..Request::new(op, local, seg, remote, 4096)
    };
    e.transfer_sync(&[req(Op::Write, src.as_ptr() as u64)])
        .map_err(|x| x.to_string())?;
    e.transfer_sync(&[req(Op::Read, back.as_mut_ptr() as u64)])
        .map_err(|x| x.to_string())?;
    if back != src {
        return Err("the bytes read back differ".into());
    }
    Ok(())
}

#[test]
fn real_shm_peers_are_served_through_floods_of_the_socket() {
    let secs = flood_secs();
    let target = engine();
    let remote = target.allocate_memory(4096, None).unwrap();
    let name = shm_socket(&target);
    let other = other_user_flood(&name, secs);
    let stop = Arc::new(AtomicBool::new(false));
    let silent: Vec<_> = (0..2)
        .map(|_| {
            let (stop, name) = (stop.clone(), name.clone());
            std::thread::spawn(move || {
                let mut held: VecDeque<Seq> = VecDeque::new();
                let mut opened = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(s) = Seq::connect(&name) {
                        held.push_back(s);
                        opened += 1;
                    }
                    if held.len() > 16 {
                        held.pop_front();
                    }
                }
                opened
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let mut served = 0;
    for i in 0..3u8 {
        match real_initiator(&target, remote, i) {
            Ok(()) => served += 1,
            Err(e) => eprintln!("real initiator {i}: {e}"),
        }
    }
    let took = started.elapsed();
    // The flood lasts its time whatever the initiators took.
    if let Some(left) = Duration::from_secs(secs).checked_sub(started.elapsed()) {
        std::thread::sleep(left);
    }
    stop.store(true, Ordering::SeqCst);
    let opened: u64 = silent.into_iter().map(|t| t.join().unwrap()).sum();
    let other_text = other.map(|c| {
        let out = c.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    });
    let count = |cause| refusals(&target, "shm", cause);
    eprintln!(
        "{served} of 3 real shm initiators served in {took:?} while {opened} silent \
         connections of this user were opened; other user: {}; refusals: busy {} per_source {} \
         timeout {} peer_user {}",
        other_text
            .as_deref()
            .and_then(|t| t.lines().find(|l| l.contains("FLOOD ")))
            .unwrap_or("skipped"),
        count("busy"),
        count("per_source"),
        count("timeout"),
        count("peer_user"),
    );
    assert_eq!(served, 3, "{served} of 3 real shm initiators served");
    assert!(
        opened > 16,
        "the silent flood opened only {opened} connections"
    );
    assert!(
        count("busy") + count("per_source") > 0,
        "the silent flood never filled the pool"
    );
    if let Some(text) = other_text {
        let line = text
            .lines()
            .find(|l| l.contains("FLOOD "))
            .unwrap_or_else(|| panic!("the other-user flood did not run: {text}"));
        assert!(
            line.contains(" answered 0"),
            "the other user got bytes: {line}"
        );
        assert!(count("peer_user") > 0, "no peer_user refusal counted");
    }
}
