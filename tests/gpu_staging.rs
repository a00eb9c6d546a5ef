//! Device memory moved by host-only transports (TCP, shm) through staging,
//! with a fake GPU plugin whose device memory the CPU cannot touch: any code
//! path that dereferences a device pointer crashes this test.

use ferry_core::{Engine, EngineConfig, Location, Op, Request};
use ferry_tests::fake_gpu_dir;

/// A plugin directory holding the fake GPU as the "cuda" device plugin.
fn engine(plugins: &std::path::Path, transports: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("plugin_path", plugins.to_str().unwrap()).unwrap();
    c.set("transports", transports).unwrap();
    Engine::new(c).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(7)
                .wrapping_add(seed ^ (i >> 16) as u8)
        })
        .collect()
}

#[test]
fn gpu_to_gpu_writes_and_reads_over_tcp_and_shm_are_staged_and_verified() {
    let plugins = fake_gpu_dir();
    for transports in ["tcp", "shm"] {
        let target = engine(plugins.path(), transports);
        let initiator = engine(plugins.path(), transports);
        assert_eq!(initiator.gpus().len(), 1, "the fake GPU is found");
        const LEN: u64 = 24 << 20; // not a multiple of the 4 MiB chunk
        let remote = target.allocate_device(Location::Cuda(0), LEN).unwrap();
        target.register_memory(remote, LEN, None).unwrap();
        let d = target.descriptor();
        assert_eq!(
            d.buffers[0].location, "cuda:0",
            "device memory is recognised"
        );

        let src = initiator.allocate_device(Location::Cuda(0), LEN).unwrap();
        let dst = initiator.allocate_device(Location::Cuda(0), LEN).unwrap();
        initiator.register_memory(src, LEN, None).unwrap();
        initiator
            .register_memory(dst, LEN, Some(Location::Cuda(0)))
            .unwrap();
        let host = pattern(LEN as usize, transports.len() as u8);
        // SAFETY: host is a live Vec of LEN bytes; src is device memory.
        unsafe { initiator.copy_memory(src, host.as_ptr() as u64, LEN) }.unwrap();

        let seg = initiator.open_segment(target.segment_name()).unwrap();
        initiator
            .transfer_sync(&[Request::new(Op::Write, src, seg, remote, LEN)])
            .unwrap();
        initiator
            .transfer_sync(&[Request::new(Op::Read, dst, seg, remote, LEN)])
            .unwrap();
        let mut back = vec![0u8; LEN as usize];
        // SAFETY: back is a live Vec of LEN bytes; dst is device memory.
        unsafe { initiator.copy_memory(back.as_mut_ptr() as u64, dst, LEN) }.unwrap();
        assert!(back == host, "GPU -> GPU -> GPU over {transports}");
        // The metrics show it staged: one flow per op, every byte.
        let m = initiator.metrics();
        for op in ["write", "read"] {
            let f = m
                .flows
                .iter()
                .find(|f| f.op == op && f.transport == "staging")
                .expect("a staged flow");
            assert_eq!(
                (f.transport.as_str(), f.device.as_str(), f.memory.as_str()),
                ("staging", "cuda:0", "staged"),
                "{f:?}"
            );
            assert_eq!((f.requests, f.bytes), (1, LEN), "{f:?}");
            // Its host legs, over the transport, from the staging slots.
            let legs: u64 = m
                .flows
                .iter()
                .filter(|f| f.op == op && f.memory == "staging_slot")
                .inspect(|f| assert_eq!(f.transport, transports, "{f:?}"))
                .map(|f| f.bytes)
                .sum();
            assert_eq!(legs, LEN, "{op}");
        }
        assert!(
            m.registered
                .iter()
                .any(|r| r.device == "cuda:0" && r.memory == "staged"),
            "{:?}",
            m.registered
        );

        // Host <-> device too, and a request inside the device buffer.
        let mut h2 = vec![0u8; 1 << 20];
        initiator
            .register_memory(h2.as_mut_ptr() as u64, 1 << 20, None)
            .unwrap();
        initiator
            .transfer_sync(&[Request::new(
                Op::Read,
                h2.as_mut_ptr() as u64,
                seg,
                remote + 12345,
                1 << 20,
            )])
            .unwrap();
        assert!(h2[..] == host[12345..12345 + (1 << 20)]);
    }
}

/// A staged request that names a transport has its host legs carried by
/// that transport, not by the fastest (shm here): `--transport tcp` once
/// measured shm.
#[test]
fn a_staged_request_that_names_a_transport_moves_its_host_legs_over_it() {
    let plugins = fake_gpu_dir();
    let target = engine(plugins.path(), "shm,tcp");
    let initiator = engine(plugins.path(), "shm,tcp");
    const LEN: u64 = 6 << 20;
    let remote = target.allocate_device(Location::Cuda(0), LEN).unwrap();
    target.register_memory(remote, LEN, None).unwrap();
    let src = initiator.allocate_device(Location::Cuda(0), LEN).unwrap();
    initiator.register_memory(src, LEN, None).unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    for (hint, block) in [(None, LEN), (Some("tcp"), LEN), (Some("tcp"), 64 << 10)] {
        let requests: Vec<Request> = (0..LEN / block)
            .map(|k| {
                let mut r =
                    Request::new(Op::Write, src + k * block, seg, remote + k * block, block);
                r.transport = hint.map(Into::into);
                r
            })
            .collect();
        let before = legs_by_transport(&initiator);
        initiator.transfer_sync(&requests).unwrap();
        let after = legs_by_transport(&initiator);
        let moved = |t: &str| after.get(t).unwrap_or(&0) - before.get(t).unwrap_or(&0);
        match hint {
            Some(t) => assert_eq!(moved(t), LEN, "{hint:?}, {block}-byte blocks: {after:?}"),
            None => assert_eq!(moved("shm") + moved("tcp"), LEN, "{after:?}"),
        }
    }
}

/// Bytes of staging's host legs (flows from staging slots), by transport.
fn legs_by_transport(e: &Engine) -> std::collections::HashMap<String, u64> {
    let mut by = std::collections::HashMap::new();
    for f in e.metrics().flows {
        if f.memory == "staging_slot" {
            *by.entry(f.transport.clone()).or_insert(0) += f.bytes;
        }
    }
    by
}

/// Many threads staging small and large requests to one peer at once: each
/// job gets its own staging session, small requests share slot space, and
/// every byte lands where it was sent.
#[test]
fn concurrent_staged_jobs_with_small_and_large_requests_stay_intact() {
    let plugins = fake_gpu_dir();
    let target = engine(plugins.path(), "tcp");
    let initiator = std::sync::Arc::new(engine(plugins.path(), "tcp"));
    const PER: u64 = 6 << 20;
    const THREADS: u64 = 4;
    let remote = target
        .allocate_device(Location::Cuda(0), PER * THREADS)
        .unwrap();
    target.register_memory(remote, PER * THREADS, None).unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let initiator = initiator.clone();
            std::thread::spawn(move || {
                let src = initiator.allocate_device(Location::Cuda(0), PER).unwrap();
                let dst = initiator.allocate_device(Location::Cuda(0), PER).unwrap();
                initiator.register_memory(src, PER, None).unwrap();
                initiator.register_memory(dst, PER, None).unwrap();
                let host = pattern(PER as usize, t as u8 + 1);
                // SAFETY: host is a live Vec of PER bytes; src is device memory.
                unsafe { initiator.copy_memory(src, host.as_ptr() as u64, PER) }.unwrap();
                let base = remote + t * PER;
                // 4 KiB, 100 KiB, 1 MiB pieces, then the rest in one request.
                let mut cuts = vec![0u64, 4096, 4096 + 100_000, 4096 + 100_000 + (1 << 20)];
                cuts.push(PER);
                let reqs = |op| {
                    cuts.windows(2)
                        .map(|w| {
                            let (s, l) = (w[0], w[1] - w[0]);
                            let local = if op == Op::Write { src } else { dst };
                            Request::new(op, local + s, seg, base + s, l)
                        })
                        .collect::<Vec<_>>()
                };
                for _ in 0..3 {
                    initiator.transfer_sync(&reqs(Op::Write)).unwrap();
                    initiator.transfer_sync(&reqs(Op::Read)).unwrap();
                }
                let mut back = vec![0u8; PER as usize];
                // SAFETY: back is a live Vec of PER bytes; dst is device memory.
                unsafe { initiator.copy_memory(back.as_mut_ptr() as u64, dst, PER) }.unwrap();
                assert!(back == host, "thread {t}: data came back changed");
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Staging requests are network input: a peer that asks for too much,
/// names slots or device memory it was not given, or sends garbage gets an
/// error reply and the target keeps serving.
#[test]
fn hostile_staging_requests_are_refused_and_the_target_keeps_serving() {
    use ferry_core::control::{ControlClient, MsgType};
    use std::time::Duration;
    let plugins = fake_gpu_dir();
    let target = engine(plugins.path(), "tcp");
    let dev = target.allocate_device(Location::Cuda(0), 1 << 20).unwrap();
    target.register_memory(dev, 1 << 20, None).unwrap();
    let unregistered = target.allocate_device(Location::Cuda(0), 1 << 20).unwrap();
    let name = target.segment_name().to_string();
    let t = Duration::from_secs(5);
    let link = ferry_core::control::Link::new(t, t, ferry_tests::user_token());
    let mut c = ControlClient::connect(&name, &link).unwrap();
    let refused = |c: &mut ControlClient, kind, body: &str| -> String {
        match c.call(kind, body.as_bytes()) {
            Ok(r) => panic!("{body}: accepted ({r:?})"),
            Err(e) => e.to_string(),
        }
    };
    let copy = |slot: u64, offset: u64, len: u64, addr: u64| {
        format!(
            r#"{{"to_device":true,"slot":{slot},"offset":{offset},"len":{len},"device_addr":{addr}}}"#
        )
    };
    // No session yet.
    let e = refused(&mut c, MsgType::StageCopy, &copy(0, 0, 4096, dev));
    assert!(e.contains("no staging session"), "{e}");
    // Too many slots, too large, garbage.
    let e = refused(
        &mut c,
        MsgType::StageOpen,
        r#"{"slots":100000,"slot_len":4096}"#,
    );
    assert!(e.contains("out of range"), "{e}");
    let e = refused(
        &mut c,
        MsgType::StageOpen,
        r#"{"slots":1,"slot_len":1099511627776}"#,
    );
    assert!(e.contains("out of range"), "{e}");
    let e = refused(&mut c, MsgType::StageOpen, "\u{0}\u{1}not json");
    assert!(e.contains("JSON"), "{e}");
    // A real session, then copies outside it.
    let (kind, _) = c
        .call(MsgType::StageOpen, br#"{"slots":2,"slot_len":65536}"#)
        .unwrap();
    assert_eq!(kind, MsgType::StageOpened);
    let e = refused(&mut c, MsgType::StageCopy, &copy(2, 0, 4096, dev));
    assert!(e.contains("no such slot"), "{e}");
    let e = refused(&mut c, MsgType::StageCopy, &copy(0, 65000, 4096, dev));
    assert!(e.contains("outside the slot"), "{e}");
    let e = refused(
        &mut c,
        MsgType::StageCopy,
        &copy(0, u64::MAX - 10, 4096, dev),
    );
    assert!(e.contains("wrap") || e.contains("outside"), "{e}");
    let e = refused(&mut c, MsgType::StageCopy, &copy(0, 0, 4096, unregistered));
    assert!(e.contains("not inside device memory registered"), "{e}");
    let e = refused(
        &mut c,
        MsgType::StageCopy,
        &copy(0, 0, 4096, dev + (1 << 20) - 100),
    );
    assert!(e.contains("not inside device memory registered"), "{e}");
    // The same connection still works for a good copy.
    let (kind, _) = c
        .call(MsgType::StageCopy, copy(0, 0, 4096, dev).as_bytes())
        .unwrap();
    assert_eq!(kind, MsgType::StageDone);
    // Asking for more than the target lends in all is refused. Each grant
    // allocates 1 GiB of slots, which took the debug build over 5 s on 2
    // loaded cores once: these calls wait longer.
    let slow =
        ferry_core::control::Link::new(t, Duration::from_secs(60), ferry_tests::user_token());
    let mut many = Vec::new();
    let e = loop {
        let mut c = ControlClient::connect(&name, &slow).unwrap();
        match c.call(MsgType::StageOpen, br#"{"slots":16,"slot_len":67108864}"#) {
            Ok(_) => many.push(c),
            Err(e) => break e.to_string(),
        }
        assert!(many.len() < 16, "the target lends without limit");
    };
    assert!(e.contains("capacity"), "{e}");
    drop(many);
    // And a real transfer still goes through afterwards.
    let initiator = engine(plugins.path(), "tcp");
    let src = initiator
        .allocate_device(Location::Cuda(0), 1 << 20)
        .unwrap();
    initiator.register_memory(src, 1 << 20, None).unwrap();
    let seg = initiator.open_segment(&name).unwrap();
    initiator
        .transfer_sync(&[Request::new(Op::Write, src, seg, dev, 1 << 20)])
        .unwrap();
}

/// A peer's StageCopyList is network input too: a list with one piece
/// outside the slot or outside device memory registered here, an unknown
/// version or a short body is refused whole, naming the piece, and the
/// good pieces of it touch nothing; a good list then scatters its pieces.
#[test]
fn a_hostile_copy_list_is_refused_whole_and_touches_nothing() {
    use ferry_core::control::{ControlClient, MsgType};
    use ferry_core::engine::{CopyListRequest, ListPiece};
    use std::time::Duration;
    let plugins = fake_gpu_dir();
    let target = engine(plugins.path(), "tcp");
    const LEN: u64 = 1 << 20;
    let dev = target.allocate_device(Location::Cuda(0), LEN).unwrap();
    target.register_memory(dev, LEN, None).unwrap();
    let unregistered = target.allocate_device(Location::Cuda(0), LEN).unwrap();
    let before = pattern(LEN as usize, 9);
    // SAFETY: before is a live Vec of LEN bytes; dev is device memory.
    unsafe { target.copy_memory(dev, before.as_ptr() as u64, LEN) }.unwrap();
    let name = target.segment_name().to_string();
    let t = Duration::from_secs(5);
    let link = ferry_core::control::Link::new(t, t, ferry_tests::user_token());
    let mut c = ControlClient::connect(&name, &link).unwrap();
    let (kind, _) = c
        .call(MsgType::StageOpen, br#"{"slots":2,"slot_len":65536}"#)
        .unwrap();
    assert_eq!(kind, MsgType::StageOpened);
    let piece = |slot_offset: u64, device_addr: u64, len: u64| ListPiece {
        slot_offset,
        device_addr,
        len,
    };
    let list = |slot: usize, pieces: Vec<ListPiece>| {
        CopyListRequest {
            to_device: true,
            slot,
            pieces,
        }
        .encode()
    };
    let good = piece(0, dev + 8192, 4096);
    let mut refused = |body: Vec<u8>, why: &str, code: ferry_core::ErrorCode| {
        let e = c
            .call(MsgType::StageCopyList, &body)
            .expect_err("a bad list was accepted");
        assert_eq!(e.code, code, "{e}");
        assert!(e.message.contains(why), "{why}: {e}");
    };
    use ferry_core::ErrorCode::{OutOfBounds, Protocol};
    refused(list(2, vec![good]), "no such slot", Protocol);
    refused(
        list(0, vec![good, piece(65000, dev, 4096)]),
        "piece 1 falls outside the slot",
        Protocol,
    );
    refused(
        list(0, vec![good, piece(4096, unregistered, 4096)]),
        "piece 1: [",
        OutOfBounds,
    );
    refused(
        list(0, vec![good, piece(4096, dev + LEN - 100, 4096)]),
        "not inside device memory registered here",
        OutOfBounds,
    );
    let mut v = list(0, vec![good]);
    v[0] = 9;
    refused(v, "version 9", Protocol);
    let v = list(0, vec![good, good]);
    refused(v[..v.len() - 3].to_vec(), "carries 45 bytes", Protocol);
    // The good piece of every refused list touched nothing.
    let mut now = vec![0u8; LEN as usize];
    // SAFETY: now is a live Vec of LEN bytes; dev is device memory.
    unsafe { target.copy_memory(now.as_mut_ptr() as u64, dev, LEN) }.unwrap();
    assert!(now == before, "a refused list moved bytes");
    // A good list on the same connection scatters the (zeroed) slot.
    let (kind, _) = c
        .call(
            MsgType::StageCopyList,
            &list(0, vec![good, piece(4096, dev + 65536, 100)]),
        )
        .unwrap();
    assert_eq!(kind, MsgType::StageDone);
    // SAFETY: `now` is still a live Vec of LEN bytes and `dev` the LEN bytes of device memory
    // allocated above; the list's copies finished (StageDone), so no transfer writes `now`.
    unsafe { target.copy_memory(now.as_mut_ptr() as u64, dev, LEN) }.unwrap();
    assert!(now[8192..12288].iter().all(|&b| b == 0));
    assert!(now[65536..65636].iter().all(|&b| b == 0));
    assert!(now[..8192] == before[..8192] && now[12288..65536] == before[12288..65536]);
}
