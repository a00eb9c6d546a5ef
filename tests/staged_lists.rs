//! Staged gather and scatter with the real cuda device plugin on the CUDA
//! emulator (tests/cuda-emulator, a test-only libcuda.so.1 that runs the
//! copy kernel's lists on the CPU): small GPU blocks over tcp and shm are
//! packed into one slot run by one list copy, sent as one host transfer
//! and scattered by one list copy on the peer; every byte lands where it
//! was sent; a block the peer no longer serves fails only its request.
//!
//! Each scenario runs as an `#[ignore]`d test of this binary in a child
//! process (`child()`) with FERRY_CUDA_LIBRARY pointing at the emulator
//! (the environment is the plugin's only way to find it); both engines
//! live in that child. Nothing here depends on timing.

use ferry_core::{Engine, EngineConfig, Location, Op, Request, RequestStatus};
use ferry_tests::{built, child_output, child_test, pattern, shuffled};
use std::path::Path;
use std::time::Duration;

const CHILD: &str = "FERRY_STAGED_LISTS_TEST_CHILD";

fn emulator() -> &'static Path {
    ferry_tests::cuda_emulator()
}

/// Runs the ignored test `name` in a child process with the emulator, the
/// host transport `transports` only (so device memory is staged) and
/// `extra`; fails with its output if it fails.
fn child(name: &str, transports: &str, extra: &[(&str, &str)]) -> String {
    built("libferry_device_cuda.so");
    built(&format!("libferry_transport_{transports}.so"));
    let mut cmd = child_test(name);
    cmd.env(CHILD, "1")
        .env("FERRY_CUDA_LIBRARY", emulator())
        .env("FERRY_TRANSPORTS", transports)
        .env("FERRY_TIMEOUT_MS", "10000")
        .env("RUST_LOG", "info")
        .env("FERRY_LOG", "info");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    child_output(cmd, name)
}

#[test]
fn shuffled_blocks_of_several_sizes_land_right_over_tcp_by_one_launch_per_run() {
    let out = child("scenario_shuffled", "tcp", &[("EXPECT", "kernel")]);
    assert!(
        out.contains("by the copy kernel, one launch per list"),
        "{out}"
    );
}

#[test]
fn shuffled_blocks_of_several_sizes_land_right_over_shm_by_one_launch_per_run() {
    child("scenario_shuffled", "shm", &[("EXPECT", "kernel")]);
}

#[test]
fn a_job_of_several_windows_alternates_two_sessions_and_lands_right() {
    // 256 KiB chunks, 1 in flight: a window of 256 KiB, so each batch of
    // 4 KiB and 16 KiB blocks (0.8 and 1.5 MiB) opens two sessions with
    // the peer, a slot each, and its packed runs alternate between them.
    let out = child(
        "scenario_shuffled",
        "tcp",
        &[
            ("EXPECT", "kernel"),
            ("FERRY_STAGING_CHUNK", "256K"),
            ("FERRY_STAGING_DEPTH", "1"),
            ("SMALL_ONLY", "1"),
            ("FERRY_LOG", "info,ferry_core::engine::staging::job=debug"),
        ],
    );
    assert!(out.contains("2 staging session(s) of 1 slots"), "{out}");
}

#[test]
fn without_the_copy_kernel_packed_runs_move_by_the_batched_copy() {
    let out = child(
        "scenario_shuffled",
        "tcp",
        &[("EXPECT", "batch"), ("FERRY_CUDA_EMU_NO_KERNEL", "1")],
    );
    assert!(out.contains("the copy kernel cannot load"), "{out}");
}

#[test]
fn gathers_still_in_flight_are_polled_while_other_chunks_move() {
    // Every stream reads as busy for 2 ms after work is queued on it: the
    // staging job asks (stream_query, ABI 1.7) rather than waits, and every
    // block still lands where it was sent.
    child(
        "scenario_shuffled",
        "tcp",
        &[
            ("EXPECT", "kernel"),
            ("EXPECT_POLLED", "1"),
            ("FERRY_CUDA_EMU_STREAM_DELAY_US", "2000"),
        ],
    );
}

#[test]
fn a_batch_mixing_small_large_and_host_requests_lands_right() {
    child("scenario_mixed", "tcp", &[]);
}

#[test]
fn a_block_the_peer_no_longer_serves_fails_only_its_request() {
    child("scenario_stale", "tcp", &[]);
}

// ---- the child's side ------------------------------------------------------

fn engine() -> Engine {
    Engine::new(EngineConfig::from_env().unwrap()).unwrap()
}

/// The emulator's count of copy calls: 0 cuMemcpyAsync, 1 kernel launches,
/// 2 cuMemcpyBatchAsync; 4 counts cuStreamQuery's "not ready" answers.
fn emu_calls(kind: i32) -> i64 {
    let path = std::ffi::CString::new(std::env::var("FERRY_CUDA_LIBRARY").unwrap()).unwrap();
    // SAFETY: RTLD_NOLOAD only finds the emulator the plugin already
    // loaded (or fails, asserted); the symbol is `long (int)` and the
    // handle is closed once, after the call.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the emulator is not loaded");
        let f = libc::dlsym(h, c"ferry_cuda_emu_calls".as_ptr());
        assert!(!f.is_null());
        let f: extern "C" fn(i32) -> libc::c_long = std::mem::transmute(f);
        let n = f(kind);
        libc::dlclose(h);
        n as i64
    }
}

fn device(e: &Engine, len: u64) -> u64 {
    let addr = e.allocate_device(Location::Cuda(0), len).unwrap();
    e.register_memory(addr, len, None).unwrap();
    addr
}

fn fill(e: &Engine, addr: u64, data: &[u8]) {
    // SAFETY: data is a live slice; addr is device memory of at least its length.
    unsafe { e.copy_memory(addr, data.as_ptr() as u64, data.len() as u64) }.unwrap();
}

fn read(e: &Engine, addr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: out is a live Vec of len bytes; addr is device memory.
    unsafe { e.copy_memory(out.as_mut_ptr() as u64, addr, len) }.unwrap();
    out
}

/// Device operations (of `kind`s) while `f` runs.
fn counted(kinds: &[i32], f: impl FnOnce()) -> i64 {
    let before: i64 = kinds.iter().map(|&k| emu_calls(k)).sum();
    f();
    kinds.iter().map(|&k| emu_calls(k)).sum::<i64>() - before
}

#[test]
#[ignore]
fn scenario_shuffled() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let list_kind = match std::env::var("EXPECT").unwrap().as_str() {
        "kernel" => 1,
        _ => 2,
    };
    let target = engine();
    let initiator = engine();
    assert_eq!(initiator.gpus().len(), 1, "the emulated GPU is found");
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    // 4 KiB, 16 KiB and an odd size (packed runs align each block); with
    // SMALL_ONLY, the first two (the counts below hold for small chunks).
    let sizes = [(4096u64, 200u64), (16 << 10, 96), ((64 << 10) + 100, 40)];
    let take = match std::env::var_os("SMALL_ONLY") {
        Some(_) => 2,
        None => sizes.len(),
    };
    for (seed, (block, n)) in sizes.into_iter().take(take).enumerate() {
        let len = block * n;
        let remote = device(&target, len);
        let src = device(&initiator, len);
        let dst = device(&initiator, len);
        let data = pattern(len as usize, seed as u64 + 1);
        fill(&initiator, src, &data);
        fill(&target, remote, &vec![0u8; len as usize]);
        fill(&initiator, dst, &vec![0u8; len as usize]);
        let (local, far) = (shuffled(n, seed as u64 + 7), shuffled(n, seed as u64 + 11));
        let block_at = |base: u64, k: u64| base + k * block;

        // Writes: local block local[i] -> remote block far[i].
        let writes: Vec<Request> = (0..n as usize)
            .map(|i| {
                Request::new(
                    Op::Write,
                    block_at(src, local[i]),
                    seg,
                    block_at(remote, far[i]),
                    block,
                )
            })
            .collect();
        let per_copy = emu_calls(0);
        let lists = counted(&[list_kind], || initiator.transfer_sync(&writes).unwrap());
        // A run per chunk on each side, far fewer than one per block, and
        // no block copied on its own.
        assert!(lists >= 2, "{block}: {lists} list copies");
        assert!(
            lists * 4 <= n as i64,
            "{block}: {lists} list copies for {n} blocks"
        );
        // Single copies only to cross PCIe for a list through the GPU's
        // scratch (the cuda plugin's bounce): a few per list, never one
        // per block.
        let copies = emu_calls(0) - per_copy;
        assert!(
            copies <= lists && copies * 4 <= n as i64,
            "{block}: {copies} single copies for {lists} lists of {n} blocks"
        );
        let landed = read(&target, remote, len);
        for i in 0..n as usize {
            let (l, f) = (
                local[i] as usize * block as usize,
                far[i] as usize * block as usize,
            );
            assert!(
                landed[f..f + block as usize] == data[l..l + block as usize],
                "{block}: block {i} written to the wrong place or garbled"
            );
        }

        // Reads, the other way round: remote block far[i] -> dst block i's
        // mirror, so dst ends up equal to what src was, in another order.
        let reads: Vec<Request> = (0..n as usize)
            .map(|i| {
                Request::new(
                    Op::Read,
                    block_at(dst, local[i]),
                    seg,
                    block_at(remote, far[i]),
                    block,
                )
            })
            .collect();
        let lists = counted(&[list_kind], || initiator.transfer_sync(&reads).unwrap());
        assert!(lists >= 2 && lists * 4 <= n as i64, "{block}: {lists}");
        assert!(
            read(&initiator, dst, len) == data,
            "{block}: read back garbled"
        );
    }
    if std::env::var_os("EXPECT_POLLED").is_some() {
        let busy = emu_calls(4);
        assert!(busy > 0, "no stream was ever found still busy: {busy}");
    }
}

#[test]
#[ignore]
fn scenario_stale() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let target = engine();
    let initiator = engine();
    const BLOCK: u64 = 16 << 10;
    const N: u64 = 32;
    let kept = device(&target, N * BLOCK);
    let gone = device(&target, N * BLOCK);
    let src = device(&initiator, 2 * N * BLOCK);
    let data = pattern((2 * N * BLOCK) as usize, 5);
    fill(&initiator, src, &data);
    fill(&target, kept, &vec![0u8; (N * BLOCK) as usize]);
    // The initiator reads the descriptor with both; then one goes.
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    target.unregister_memory(gone).unwrap();
    // Blocks alternate between the two, so every packed run holds both.
    let far = shuffled(N, 3);
    let requests: Vec<Request> = (0..2 * N)
        .map(|i| {
            let base = if i % 2 == 0 { kept } else { gone };
            Request::new(
                Op::Write,
                src + i * BLOCK,
                seg,
                base + far[(i / 2) as usize] * BLOCK,
                BLOCK,
            )
        })
        .collect();
    let batch = initiator.allocate_batch(requests.len()).unwrap();
    initiator.submit(batch, &requests).unwrap();
    let status = initiator.wait(batch, Duration::from_secs(60)).unwrap();
    assert!(status.is_done());
    for i in 0..requests.len() {
        match initiator.request_status(batch, i).unwrap() {
            RequestStatus::Completed => assert!(i % 2 == 0, "request {i} into the gone buffer"),
            RequestStatus::Failed(e) => {
                assert!(i % 2 == 1, "request {i} into the kept buffer failed: {e}");
                assert_eq!(e.code, ferry_core::ErrorCode::OutOfBounds, "{e}");
                assert!(e.message.contains("not inside device memory"), "{e}");
            }
            RequestStatus::Pending => panic!("request {i} still pending"),
        }
    }
    initiator.free_batch(batch).unwrap();
    let landed = read(&target, kept, N * BLOCK);
    for k in 0..N {
        let (i, f) = ((2 * k * BLOCK) as usize, (far[k as usize] * BLOCK) as usize);
        assert!(landed[f..f + BLOCK as usize] == data[i..i + BLOCK as usize]);
    }
}

/// One batch of small device blocks, a request larger than a chunk in the
/// middle, small requests into the peer's host memory (not packed: they
/// need no scatter there) and blocks of odd sizes: packed runs end where
/// a request cannot join them, and every byte lands where it was sent.
#[test]
#[ignore]
fn scenario_mixed() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let target = engine();
    let initiator = engine();
    const LEN: u64 = 16 << 20;
    let remote = device(&target, LEN);
    let remote_host = target.allocate_memory(LEN, None).unwrap();
    let src = device(&initiator, LEN);
    let data = pattern(LEN as usize, 77);
    fill(&initiator, src, &data);
    fill(&target, remote, &vec![0u8; LEN as usize]);
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    // (source offset, destination base, destination offset, length)
    let mut moves: Vec<(u64, u64, u64, u64)> = Vec::new();
    let mut at = 0u64;
    let mut push = |moves: &mut Vec<_>, dst: u64, dst_off: u64, len: u64| {
        moves.push((at, dst, dst_off, len));
        at += len;
    };
    for k in 0..40u64 {
        push(&mut moves, remote, (39 - k) * 20_000, 20_000 - k * 7);
    }
    push(&mut moves, remote, 1 << 20, 5 << 20); // larger than a chunk
    for k in 0..20u64 {
        push(&mut moves, remote_host, k * 8192, 4096 + k);
    }
    for k in 0..30u64 {
        push(&mut moves, remote, (7 << 20) + k * 65536, 16384);
    }
    let requests: Vec<Request> = moves
        .iter()
        .map(|&(s, d, o, l)| Request::new(Op::Write, src + s, seg, d + o, l))
        .collect();
    initiator.transfer_sync(&requests).unwrap();
    let landed = read(&target, remote, LEN);
    // SAFETY: remote_host is LEN bytes the target allocated and keeps.
    let host = unsafe { std::slice::from_raw_parts(remote_host as *const u8, LEN as usize) };
    for (i, &(s, d, o, l)) in moves.iter().enumerate() {
        let got = if d == remote { &landed[..] } else { host };
        assert!(
            got[o as usize..(o + l) as usize] == data[s as usize..(s + l) as usize],
            "request {i} ({l} bytes) garbled"
        );
    }
}
