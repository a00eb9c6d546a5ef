//! Engines in separate processes: the demo, a peer killed in the middle of a
//! batch, and garbage thrown at the control and data ports.

use ferry_core::{Engine, EngineConfig, ErrorCode, Op, Request};
use ferry_tests::{ferry_bin, TargetProcess};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

fn target(buffer: &str) -> TargetProcess {
    TargetProcess::start(
        &["--buffer-size", buffer],
        &[("FERRY_TRANSPORTS", "tcp")],
        &[],
    )
}

fn engine(timeout_ms: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", "tcp").unwrap();
    c.set("timeout_ms", timeout_ms).unwrap();
    Engine::new(c).unwrap()
}

fn remote_buffer(e: &Engine, seg: u64) -> (u64, u64) {
    let d = e.descriptor_of(seg).unwrap();
    (d.buffers[0].addr, d.buffers[0].len)
}

#[test]
fn ferry_demo_moves_and_verifies_data_between_two_processes() {
    let out = Command::new(ferry_bin())
        .args(["demo", "--size", "32M", "--block", "1M"])
        .env("FERRY_TRANSPORTS", "tcp")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("transport  tcp ("), "{stdout}");
    assert!(stdout.contains("NIC        lo"), "{stdout}");
    assert!(
        stdout.contains("OK: every byte arrived and came back intact."),
        "{stdout}"
    );
}

#[test]
fn a_peer_killed_mid_batch_fails_it_in_time_and_other_peers_keep_working() {
    let mut doomed = target("64M");
    let healthy = target("16M");
    let e = engine("3000");
    let local = vec![0x42u8; 4 << 20];
    e.register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = e.open_segment(&doomed.segment).unwrap();
    let other = e.open_segment(&healthy.segment).unwrap();
    let (remote, _) = remote_buffer(&e, seg);

    // 2 GiB of writes: far more than can finish before the kill.
    let reqs: Vec<Request> = (0..512)
        .map(|_| Request::new(Op::Write, local.as_ptr() as u64, seg, remote, 4 << 20))
        .collect();
    let batch = e.allocate_batch(reqs.len()).unwrap();
    e.submit(batch, &reqs).unwrap();
    // Killed at once: 2 GiB cannot land in the time a kill takes, however
    // loaded the machine (a sleep here once let the whole batch finish).
    doomed.child.kill().unwrap();
    let started = Instant::now();
    let status = e.wait(batch, Duration::from_secs(20)).unwrap();
    assert!(status.is_done(), "no hang: {status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(status.failed > 0, "{status:?}");
    let (_, err) = status.first_error.clone().unwrap();
    assert!(
        matches!(err.code, ErrorCode::Connection | ErrorCode::Timeout),
        "{err}"
    );
    e.free_batch(batch).unwrap();

    // The other peer is unaffected.
    let (r2, _) = remote_buffer(&e, other);
    e.transfer_sync(&[Request::new(
        Op::Write,
        local.as_ptr() as u64,
        other,
        r2,
        1 << 20,
    )])
    .unwrap();
    // And the dead one now fails fast instead of hanging.
    let err = e
        .transfer_sync(&[Request::new(
            Op::Write,
            local.as_ptr() as u64,
            seg,
            remote,
            4096,
        )])
        .unwrap_err();
    assert!(
        matches!(err.code, ErrorCode::Connection | ErrorCode::Timeout),
        "{err}"
    );
}

#[test]
fn garbage_on_the_control_and_data_ports_is_refused_and_the_target_keeps_serving() {
    let target = target("16M");
    let e = engine("3000");
    let local = vec![7u8; 1 << 20];
    e.register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = e.open_segment(&target.segment).unwrap();
    let descriptor = e.descriptor_of(seg).unwrap();
    // "host:port instance"
    let endpoint = String::from_utf8(descriptor.endpoint("tcp").unwrap()).unwrap();
    let data_port = endpoint.split(' ').next().unwrap().to_string();

    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut junk = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect()
    };
    let mut payloads: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0u8; 64],
        vec![0xffu8; 4096],
    ];
    for n in [1, 15, 16, 17, 31, 32, 33, 48, 1000, 65536] {
        payloads.push(junk(n));
    }
    // Well-formed headers with hostile contents.
    let mut hostile = Vec::new();
    hostile.extend_from_slice(b"FERY\x01\x01\x00\x00");
    hostile.extend_from_slice(&1u32.to_le_bytes());
    hostile.extend_from_slice(&0u32.to_le_bytes());
    hostile.extend_from_slice(&1u64.to_le_bytes());
    hostile.extend_from_slice(&(u64::MAX).to_le_bytes());
    payloads.push(hostile);
    let mut claims = Vec::new();
    claims.extend_from_slice(b"FRYC\x01\x00\x01\x00");
    claims.extend_from_slice(&u32::MAX.to_le_bytes());
    claims.extend_from_slice(&0u32.to_le_bytes());
    payloads.push(claims);

    for port in [target.segment.as_str(), data_port.as_str()] {
        for p in &payloads {
            let mut s = TcpStream::connect(port).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = s.write_all(p);
            let _ = s.shutdown(std::net::Shutdown::Write);
            // The peer answers with at most an error frame, then closes.
            let mut reply = Vec::new();
            let r = s.read_to_end(&mut reply);
            assert!(r.is_ok(), "{port}: no close within 5 s after garbage");
            assert!(
                reply.len() < 4096,
                "{port}: unexpected {} bytes",
                reply.len()
            );
        }
    }
    // Still serving, memory intact where nobody wrote.
    let (remote, len) = remote_buffer(&e, seg);
    let mut back = vec![1u8; len as usize];
    e.register_memory(back.as_mut_ptr() as u64, len, None)
        .unwrap();
    e.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg,
        remote,
        len,
    )])
    .unwrap();
    assert!(
        back.iter().all(|b| *b == 0),
        "garbage changed target memory"
    );
    e.transfer_sync(&[Request::new(
        Op::Write,
        local.as_ptr() as u64,
        seg,
        remote,
        1 << 20,
    )])
    .unwrap();
}
