//! The shm transport between processes of this host: both ways in (memory
//! the engine allocated, mapped; application memory, by cross-memory
//! attach), a peer that exits while mapped, unregistering during transfers,
//! and a refused cross-memory attach falling back to TCP.

use ferry_core::{Engine, EngineConfig, ErrorCode, Op, Request};
use ferry_tests::{ferry_bin, TargetProcess};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn engine(transports: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", transports).unwrap();
    c.set("timeout_ms", "5000").unwrap();
    Engine::new(c).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(13)
                .wrapping_add(seed ^ (i >> 12) as u8)
        })
        .collect()
}

fn shm_target(allocate: bool, envs: &[(&str, &str)]) -> TargetProcess {
    let mut args = vec!["--buffer-size", "64M"];
    if allocate {
        args.push("--allocate");
    }
    let mut all = vec![("FERRY_TRANSPORTS", "shm,tcp")];
    all.extend_from_slice(envs);
    TargetProcess::start(&args, &all, &[])
}

#[test]
fn both_ways_in_move_verified_data_at_every_size() {
    for allocate in [true, false] {
        let target = shm_target(allocate, &[]);
        let e = engine("shm,tcp");
        let seg = e.open_segment(&target.segment).unwrap();
        let d = e.descriptor_of(seg).unwrap();
        let (remote, remote_len) = (d.buffers[0].addr, d.buffers[0].len);
        let key = String::from_utf8(d.buffers[0].key("shm").unwrap()).unwrap();
        assert!(
            key.starts_with(if allocate { "map " } else { "cma " }),
            "{key}"
        );
        const LEN: usize = 32 << 20;
        let src = pattern(LEN, allocate as u8);
        let mut back = vec![0u8; LEN];
        e.register_memory(src.as_ptr() as u64, LEN as u64, None)
            .unwrap();
        e.register_memory(back.as_mut_ptr() as u64, LEN as u64, None)
            .unwrap();
        let route = e.route(seg, src.as_ptr() as u64, remote, 4096).unwrap();
        assert_eq!(route.transport, "shm", "{}", route.reason);
        assert!(route.nic.is_none(), "shm uses no NIC");
        for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20] {
            let count = (LEN / size).min(64).min(remote_len as usize / size);
            let reqs: Vec<Request> = (0..count)
                .map(|i| {
                    Request::new(
                        Op::Write,
                        src.as_ptr() as u64 + (i * size) as u64,
                        seg,
                        remote + (i * size) as u64,
                        size as u64,
                    )
                })
                .collect();
            e.transfer_sync(&reqs).unwrap();
            let reads: Vec<Request> = reqs
                .iter()
                .map(|r| Request {
                    op: Op::Read,
                    local_addr: back.as_ptr() as u64 + (r.local_addr - src.as_ptr() as u64),
                    ..r.clone()
                })
                .collect();
            e.transfer_sync(&reads).unwrap();
            let n = count * size;
            assert!(back[..n] == src[..n], "allocate={allocate} size={size}");
            back[..n].fill(0);
        }
    }
}

#[test]
fn a_peer_that_exits_while_mapped_fails_requests_and_nothing_crashes() {
    let mut target = shm_target(true, &[]);
    let e = engine("shm");
    let seg = e.open_segment(&target.segment).unwrap();
    let remote = e.descriptor_of(seg).unwrap().buffers[0].addr;
    let local = vec![9u8; 1 << 20];
    e.register_memory(local.as_ptr() as u64, 1 << 20, None)
        .unwrap();
    let write = Request::new(Op::Write, local.as_ptr() as u64, seg, remote, 1 << 20);
    e.transfer_sync(std::slice::from_ref(&write)).unwrap(); // now mapped
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    // The peer is gone: requests fail (the mapping is dropped), none hangs.
    std::thread::sleep(Duration::from_millis(200));
    let err = e.transfer_sync(&[write]).unwrap_err();
    assert!(
        matches!(
            err.code,
            ErrorCode::Connection | ErrorCode::OutOfBounds | ErrorCode::Unavailable
        ),
        "{err}"
    );
}

#[test]
fn unregistering_during_transfers_has_a_defined_result() {
    // Both engines in this process; shm only, so nothing else is chosen.
    let target = engine("shm");
    let initiator = Arc::new(engine("shm"));
    let len: u64 = 16 << 20;
    let remote = target.allocate_memory(len, None).unwrap();
    let local = vec![1u8; len as usize];
    initiator
        .register_memory(local.as_ptr() as u64, len, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (i2, s2, laddr) = (initiator.clone(), stop.clone(), local.as_ptr() as u64);
    let writer = std::thread::spawn(move || {
        let (mut ok, mut refused) = (0, 0);
        while !s2.load(Ordering::SeqCst) {
            let reqs: Vec<Request> = (0..16)
                .map(|i| {
                    Request::new(
                        Op::Write,
                        laddr + i * (1 << 20),
                        seg,
                        remote + i * (1 << 20),
                        1 << 20,
                    )
                })
                .collect();
            match i2.transfer_sync(&reqs) {
                Ok(()) => ok += 1,
                Err(e) => {
                    assert!(
                        matches!(e.code, ErrorCode::OutOfBounds | ErrorCode::Unavailable),
                        "{e}"
                    );
                    refused += 1;
                }
            }
        }
        (ok, refused)
    });
    std::thread::sleep(Duration::from_millis(150));
    // Returns once every peer confirmed it stopped touching the buffer.
    target.free_memory(remote).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    stop.store(true, Ordering::SeqCst);
    let (ok, refused) = writer.join().unwrap();
    assert!(ok > 0, "some batches finished before the unregister");
    assert!(refused > 0, "batches after the unregister were refused");
}

/// Whether this test runs as root, able to start processes as other users.
fn root_with_setpriv() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("setpriv").arg("--version").output().is_ok()
}

#[test]
fn a_refused_cross_memory_attach_falls_back_to_tcp_and_says_why() {
    if root_with_setpriv() {
        // The kernel's own refusal: target and initiator run as two
        // different unprivileged users, so neither may attach to the other.
        let target_as = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ];
        // Two users share a cluster token (a per-user one would differ),
        // and the targets let the other user's processes reach their shm
        // socket (shm.allowed_uids): only one user is let in by default
        // (tests/security.rs), and here the kernel's refusal is the point.
        let token = ("FERRY_AUTH_TOKEN", "shm-test-cluster-token");
        let plain = TargetProcess::start(
            &["--buffer-size", "16M"],
            &[
                ("FERRY_TRANSPORTS", "shm,tcp"),
                token,
                ("FERRY_SHM_ALLOWED_UIDS", "65533"),
            ],
            &target_as,
        );
        let mapped = TargetProcess::start(
            &["--buffer-size", "16M", "--allocate"],
            &[
                ("FERRY_TRANSPORTS", "shm,tcp"),
                token,
                ("FERRY_SHM_ALLOWED_UIDS", "65533"),
            ],
            &target_as,
        );
        for (target, want, why) in [(&plain, "tcp", "uid 65534"), (&mapped, "shm", "using shm")] {
            let out = Command::new("setpriv")
                .args(["--reuid=65533", "--regid=65533", "--clear-groups"])
                .arg(ferry_bin())
                .args(["bench", "initiator", "--segment", &target.segment])
                .args([
                    "--block-size",
                    "64K",
                    "--batch-size",
                    "8",
                    "--duration",
                    "0.3",
                    "--json",
                ])
                .env("FERRY_TRANSPORTS", "shm,tcp")
                .env(token.0, token.1)
                .env("FERRY_LOG", "info")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{stdout}\n{stderr}");
            assert!(
                stdout.contains(&format!("\"transport\":\"{want}\"")),
                "{stdout}\n{stderr}"
            );
            assert!(stderr.contains(why), "{stderr}");
            if want == "tcp" {
                assert!(stderr.contains("cross-memory attach"), "{stderr}");
            }
        }
    } else {
        // Without root, the target refuses on its side (FERRY_SHM_CMA=off).
        let target = shm_target(false, &[("FERRY_SHM_CMA", "off")]);
        let e = engine("shm,tcp");
        let seg = e.open_segment(&target.segment).unwrap();
        let remote = e.descriptor_of(seg).unwrap().buffers[0].addr;
        let local = vec![3u8; 4096];
        e.register_memory(local.as_ptr() as u64, 4096, None)
            .unwrap();
        let route = e.route(seg, local.as_ptr() as u64, remote, 4096).unwrap();
        assert_eq!(route.transport, "tcp");
        assert!(
            route.reason.contains("shm declined") && route.reason.contains("FERRY_SHM_CMA=off"),
            "{}",
            route.reason
        );
        e.transfer_sync(&[Request::new(
            Op::Write,
            local.as_ptr() as u64,
            seg,
            remote,
            4096,
        )])
        .unwrap();
    }
}
