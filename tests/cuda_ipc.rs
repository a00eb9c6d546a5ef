//! The cuda-ipc transport's real code, and the real cuda device plugin,
//! driven against the CUDA emulator (tests/cuda-emulator, a test-only
//! libcuda.so.1 whose "device memory" other processes can open) in two
//! processes: cuMemAlloc memory by IPC handle and VMM memory by fd per
//! chunk, sub-allocations sharing one opened handle, revocation on
//! unregister, declines with their reasons (and staging instead), a peer
//! that dies, and every mapping closed afterwards (counted by the emulator).
//!
//! Each scenario runs as an `#[ignore]`d test of this binary in a child
//! process (`child()`) with FERRY_CUDA_LIBRARY pointing at the emulator;
//! that child starts the target, another child of this binary, with the
//! same environment, and talks to it over its stdin/stdout. Nothing here
//! depends on timing.

use ferry_core::{Engine, EngineConfig, Location, Op, Request, SegmentId};
use ferry_tests::{built, child_output, child_test, pattern};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

const CHILD: &str = "FERRY_CUDA_IPC_TEST_CHILD";
const MIB: u64 = 1 << 20;
/// The target's device allocation: two registrations live in it.
const TARGET_ALLOC: u64 = 12 * MIB;
/// First registration: [base, +5 MiB); second: [base + 6 MiB + 4 KiB, +5 MiB).
const FIRST: (u64, u64) = (0, 5 * MIB);
const SECOND: (u64, u64) = (6 * MIB + 4096, 5 * MIB);

// ---- the parent's side ---------------------------------------------------

fn emulator() -> &'static Path {
    ferry_tests::cuda_emulator()
}

/// Runs the ignored test `name` in a child process with the emulator and
/// `extra`; fails with its output if it fails.
fn child(name: &str, extra: &[(&str, &str)]) -> String {
    // The plugins must have been built (scripts/test builds the workspace).
    built("libferry_transport_cuda_ipc.so");
    built("libferry_device_cuda.so");
    let mut cmd = child_test(name);
    cmd.env(CHILD, "1")
        .env("FERRY_CUDA_LIBRARY", emulator())
        .env("FERRY_TRANSPORTS", "cuda-ipc,tcp")
        .env("FERRY_TIMEOUT_MS", "10000")
        .env("RUST_LOG", "info");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    child_output(cmd, name)
}

#[test]
fn cumemalloc_memory_by_ipc_handle() {
    child("scenario_direct", &[]);
}

#[test]
fn vmm_memory_by_fd_per_chunk() {
    // 1 MiB chunks: each registration spans several; the second starts inside one.
    child(
        "scenario_direct",
        &[("FERRY_CUDA_EMU_VMM_CHUNK", "1048576")],
    );
}

#[test]
fn completions_come_from_polled_events() {
    child(
        "scenario_direct",
        &[("FERRY_CUDA_EMU_COPY_DELAY_US", "2000")],
    );
}

#[test]
fn vmm_memory_without_a_shareable_handle_is_declined_and_staged() {
    child(
        "scenario_staged",
        &[
            ("FERRY_CUDA_EMU_VMM_CHUNK", "1048576"),
            ("FERRY_CUDA_EMU_NO_POSIX_FD", "1"),
            ("EXPECT", "cuda-ipc did not register"),
        ],
    );
}

#[test]
fn gpus_without_peer_access_are_declined_and_staged() {
    child(
        "scenario_staged",
        &[
            ("FERRY_CUDA_EMU_DEVICES", "2"),
            ("FERRY_CUDA_EMU_PEER", "0"),
            ("TARGET_GPU", "1"),
            ("EXPECT", "cuda:0 cannot access cuda:1"),
        ],
    );
}

#[test]
fn gpus_with_peer_access_copy_directly() {
    child(
        "scenario_direct",
        &[("FERRY_CUDA_EMU_DEVICES", "2"), ("TARGET_GPU", "1")],
    );
}

#[test]
fn a_peer_that_dies_fails_requests_and_releases_its_imports() {
    child("scenario_peer_dies", &[]);
}

/// A peer run by another user (uid nobody) with the cluster's token: the
/// control plane lets it in, cuda-ipc does not (CUDA handles go only to
/// this user's processes), so the transfer is staged over tcp.
#[test]
fn a_peer_of_another_user_is_declined_and_staged() {
    if let Some(why) = ferry_tests::cannot_switch_user()
        .map(str::to_string)
        .or_else(|| ferry_tests::closed_to_others(&built("libferry_device_cuda.so")))
    {
        eprintln!("SKIPPED: {why}");
        return;
    }
    // The target, as nobody, loads the emulator from its (private) folder.
    let dir = emulator().parent().unwrap();
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    child(
        "scenario_staged",
        &[
            ("FERRY_AUTH_TOKEN", "cuda-ipc-test-shared-token"),
            ("FERRY_PLUGIN_CACHE", "off"),
            ("TARGET_UID", "65534"),
            ("EXPECT", "uid 65534"),
        ],
    );
}

#[test]
fn host_memory_the_peer_did_not_allocate_is_declined() {
    child("scenario_host_declined", &[]);
}

#[test]
fn without_a_driver_the_plugin_is_disabled_with_the_reason() {
    let out = Command::new(ferry_tests::ferry_bin())
        .arg("info")
        .env("FERRY_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
        .env("FERRY_PLUGIN_CACHE", "off")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("cuda-ipc"))
        .unwrap_or_else(|| panic!("ferry info does not list cuda-ipc:\n{text}"));
    assert!(
        text.contains("FERRY_CUDA_LIBRARY=/nonexistent/libcuda.so.1: no such file"),
        "{line}\n{text}"
    );
}

// ---- the target process -------------------------------------------------

/// The target: one device allocation (on TARGET_GPU) holding two
/// registrations, filled with known data. Prints `ready NAME FIRST SECOND`,
/// then answers `unregister ADDR` and `check ADDR LEN SEED` until stdin closes.
#[test]
#[ignore]
fn target_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let e = engine();
    let gpu: u32 = std::env::var("TARGET_GPU")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let base = e
        .allocate_device(Location::Cuda(gpu), TARGET_ALLOC)
        .unwrap();
    let fill = pattern(TARGET_ALLOC as usize, 7);
    // SAFETY: fill is a live Vec of TARGET_ALLOC bytes; base device memory as long.
    unsafe { e.copy_memory(base, fill.as_ptr() as u64, TARGET_ALLOC) }.unwrap();
    for (off, len) in [FIRST, SECOND] {
        e.register_memory(base + off, len, None).unwrap();
    }
    println!(
        "ready {} {} {}",
        e.segment_name(),
        base + FIRST.0,
        base + SECOND.0
    );
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split(' ').collect();
        let reply = match words[..] {
            ["unregister", addr] => match e.unregister_memory(addr.parse().unwrap()) {
                Ok(()) => "ok".to_string(),
                Err(err) => format!("error {err}"),
            },
            ["check", addr, len, seed] => {
                let (addr, len): (u64, u64) = (addr.parse().unwrap(), len.parse().unwrap());
                let mut back = vec![0u8; len as usize];
                // SAFETY: back is live for len bytes; addr is our device memory.
                unsafe { e.copy_memory(back.as_mut_ptr() as u64, addr, len) }.unwrap();
                let want = pattern(len as usize, seed.parse().unwrap());
                if back == want { "ok" } else { "bad" }.to_string()
            }
            ["hash", addr, len] => {
                let (addr, len): (u64, u64) = (addr.parse().unwrap(), len.parse().unwrap());
                let mut back = vec![0u8; len as usize];
                // SAFETY: back is live for len bytes; addr is our device memory.
                unsafe { e.copy_memory(back.as_mut_ptr() as u64, addr, len) }.unwrap();
                format!("ok {:016x}", fnv(&back))
            }
            ["layout", base, block, stride, count] => {
                let n = |w: &str| w.parse::<u64>().unwrap();
                let l = ferry_core::BlockLayout {
                    base: n(base),
                    block_size: n(block),
                    stride: n(stride),
                    count: n(count),
                };
                match e.register_layout(l) {
                    Ok(id) => format!("ok {id}"),
                    Err(err) => format!("error {err}"),
                }
            }
            _ => "unknown".to_string(),
        };
        println!("{reply}");
        std::io::stdout().flush().unwrap();
    }
}

// ---- the initiator's side ------------------------------------------------

fn engine() -> Engine {
    Engine::new(EngineConfig::from_env().unwrap()).unwrap()
}

struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
    first: u64,
    second: u64,
}

impl Target {
    /// The target process, as TARGET_UID when that is set (through setpriv).
    fn start() -> Target {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match std::env::var("TARGET_UID") {
            Ok(uid) => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid", &uid, "--regid", &uid, "--clear-groups", "--"])
                    .arg(&exe)
                    .env("HOME", "/nonexistent");
                c
            }
            Err(_) => Command::new(&exe),
        };
        let mut child = cmd
            .args([
                "target_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        // The test harness prints "test target_process ... " before it.
        let ready = loop {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "the target exited"
            );
            if let Some(at) = line.find("ready ") {
                break line[at..].to_string();
            }
        };
        let w: Vec<&str> = ready.split_whitespace().collect();
        Target {
            name: w[1].to_string(),
            first: w[2].parse().unwrap(),
            second: w[3].parse().unwrap(),
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        let mut reply = String::new();
        loop {
            reply.clear();
            assert!(
                self.stdout.read_line(&mut reply).unwrap() > 0,
                "the target exited"
            );
            let r = reply.trim();
            if r == "ok"
                || r.starts_with("ok ")
                || r == "bad"
                || r.starts_with("error")
                || r == "unknown"
            {
                return r.to_string();
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What this process has open of other processes' GPU memory, by the
/// emulator's count.
fn open_imports() -> i32 {
    let path = std::ffi::CString::new(std::env::var("FERRY_CUDA_LIBRARY").unwrap()).unwrap();
    // SAFETY: RTLD_NOLOAD only finds the emulator the plugins already
    // loaded (no initialisers run); the symbol has this C signature.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the emulator is not loaded");
        let f = libc::dlsym(h, c"ferry_cuda_emu_open_imports".as_ptr());
        assert!(!f.is_null());
        let f: extern "C" fn() -> i32 = std::mem::transmute(f);
        let n = f();
        libc::dlclose(h);
        n
    }
}

/// A device buffer of `len` bytes on cuda:0, registered.
fn device_buffer(e: &Engine, len: u64) -> u64 {
    let a = e.allocate_device(Location::Cuda(0), len).unwrap();
    e.register_memory(a, len, None).unwrap();
    a
}

fn fill(e: &Engine, addr: u64, data: &[u8]) {
    // SAFETY: data is live; addr is device memory of at least its length.
    unsafe { e.copy_memory(addr, data.as_ptr() as u64, data.len() as u64) }.unwrap();
}

fn read(e: &Engine, addr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: out is live for len bytes; addr is device memory as long.
    unsafe { e.copy_memory(out.as_mut_ptr() as u64, addr, len) }.unwrap();
    out
}

/// Writes to and reads from both registrations in 1 MiB and 256 KiB
/// requests, checks the data on both sides, then revokes.
#[test]
#[ignore]
fn scenario_direct() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let mut t = Target::start();
    let e = engine();
    let seg: SegmentId = e.open_segment(&t.name).unwrap();
    let len = FIRST.1;
    let src = device_buffer(&e, len);
    let dst = device_buffer(&e, len);
    let data = pattern(len as usize, 11);
    fill(&e, src, &data);

    let route = e.route(seg, src, t.first, len).unwrap();
    assert_eq!(route.transport, "cuda-ipc", "{}", route.reason);
    for (remote, block, seed) in [(t.first, MIB, 11u64), (t.second, 256 * 1024, 12)] {
        let data = pattern(len as usize, seed);
        fill(&e, src, &data);
        let reqs = |op, local| {
            (0..len / block)
                .map(|i| Request::new(op, local + i * block, seg, remote + i * block, block))
                .collect::<Vec<_>>()
        };
        e.transfer_sync(&reqs(Op::Write, src)).unwrap();
        assert_eq!(
            t.ask(&format!("check {remote} {len} {seed}")),
            "ok",
            "written at the target"
        );
        e.transfer_sync(&reqs(Op::Read, dst)).unwrap();
        assert!(read(&e, dst, len) == data, "read back");
    }
    // A request inside a registration, at an odd offset.
    e.transfer_sync(&[Request::new(
        Op::Read,
        dst + 3,
        seg,
        t.second + 12345,
        77_777,
    )])
    .unwrap();
    let back = read(&e, dst + 3, 77_777);
    assert!(back[..] == pattern(len as usize, 12)[12345..12345 + 77_777]);

    // Both registrations are open here; cuMemAlloc memory shares one
    // opened handle (the emulator refuses a second open, as the driver does).
    let detail = e
        .route(seg, src, t.first, len)
        .unwrap()
        .peer_detail
        .unwrap();
    assert!(
        detail.contains("2 of its registrations open here"),
        "{detail}"
    );
    let vmm = std::env::var_os("FERRY_CUDA_EMU_VMM_CHUNK").is_some();
    let opened = open_imports();
    if vmm {
        // 1 MiB chunks: [0, 5 MiB) is five, [6 MiB + 4 KiB, +5 MiB) six.
        assert_eq!(opened, 11, "one mapped chunk per VMM chunk covered");
    } else {
        assert_eq!(opened, 1, "one IPC handle for both sub-allocations");
    }

    // Unregister revokes: the first goes, the second still works; then both.
    assert_eq!(t.ask(&format!("unregister {}", t.first)), "ok");
    let err = e
        .transfer_sync(&[Request::new(Op::Write, src, seg, t.first, 4096)])
        .unwrap_err();
    assert!(
        err.message.contains("not inside") || err.message.contains("no longer registered"),
        "{err}"
    );
    e.transfer_sync(&[Request::new(Op::Write, src, seg, t.second, 4096)])
        .unwrap();
    assert_eq!(t.ask(&format!("unregister {}", t.second)), "ok");
    assert_eq!(open_imports(), 0, "every mapping closed once revoked");
    drop(t);
}

/// The target's buffer cannot be served directly (EXPECT says why): the
/// route says so, and the data still arrives, staged.
#[test]
#[ignore]
fn scenario_staged() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let expect = std::env::var("EXPECT").unwrap();
    let mut t = Target::start();
    let e = engine();
    let seg = e.open_segment(&t.name).unwrap();
    let len = 2 * MIB;
    let src = device_buffer(&e, len);
    let data = pattern(len as usize, 21);
    fill(&e, src, &data);
    let route = e.route(seg, src, t.first, len).unwrap();
    assert_eq!(route.transport, "tcp", "{}", route.reason);
    assert!(route.reason.contains("staged"), "{}", route.reason);
    assert!(route.reason.contains(&expect), "{}", route.reason);
    e.transfer_sync(&[Request::new(Op::Write, src, seg, t.first, len)])
        .unwrap();
    assert_eq!(t.ask(&format!("check {} {len} 21", t.first)), "ok");
    assert_eq!(open_imports(), 0);
}

/// The target is killed: requests fail with a clear error (no hang), and
/// what was opened of its memory is closed.
#[test]
#[ignore]
fn scenario_peer_dies() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let mut t = Target::start();
    let e = engine();
    let seg = e.open_segment(&t.name).unwrap();
    let src = device_buffer(&e, MIB);
    e.transfer_sync(&[Request::new(Op::Write, src, seg, t.first, MIB)])
        .unwrap();
    assert_eq!(open_imports(), 1);
    // Killed with a batch in flight: the batch ends (its requests done or
    // failed with a reason), it does not hang.
    let batch = e.allocate_batch(64).unwrap();
    let many: Vec<Request> = (0..64)
        .map(|i| Request::new(Op::Write, src, seg, t.first + (i % 4) * MIB, MIB))
        .collect();
    e.submit(batch, &many).unwrap();
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let st = e.wait(batch, std::time::Duration::from_secs(20)).unwrap();
    assert!(st.is_done(), "a batch in flight when the peer died: {st:?}");
    if let Some((_, err)) = &st.first_error {
        eprintln!("the batch in flight failed cleanly: {err}");
    }
    e.free_batch(batch).unwrap();
    let mut closed = false;
    for _ in 0..200 {
        if open_imports() == 0 {
            closed = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    assert!(closed, "the import of a dead peer's memory was closed");
    let err = e
        .transfer_sync(&[Request::new(Op::Write, src, seg, t.first, MIB)])
        .unwrap_err();
    let m = err.to_string();
    assert!(
        m.contains("exited")
            || m.contains("connect")
            || m.contains("refused")
            || m.contains("reach"),
        "{m}"
    );
}

/// Host memory the peer registered but did not allocate through its engine
/// cannot be mapped: device -> that memory is declined with the reason.
#[test]
#[ignore]
fn scenario_host_declined() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let target = engine();
    let mut host = vec![0u8; MIB as usize];
    target
        .register_memory(host.as_mut_ptr() as u64, MIB, None)
        .unwrap();
    let e = engine();
    let seg = e.open_segment(target.segment_name()).unwrap();
    let src = device_buffer(&e, MIB);
    let data = pattern(MIB as usize, 5);
    fill(&e, src, &data);
    let route = e.route(seg, src, host.as_ptr() as u64, MIB).unwrap();
    assert!(
        route.reason.contains("not memory its engine allocated"),
        "{}",
        route.reason
    );
    e.transfer_sync(&[Request::new(Op::Write, src, seg, host.as_ptr() as u64, MIB)])
        .unwrap();
    assert!(host == data);

    // And host memory of this side to a peer's device memory goes direct.
    let dev = device_buffer(&target, MIB);
    let mut local = pattern(MIB as usize, 6);
    e.register_memory(local.as_mut_ptr() as u64, MIB, None)
        .unwrap();
    e.refresh_segment(seg).unwrap();
    let route = e.route(seg, local.as_ptr() as u64, dev, MIB).unwrap();
    assert_eq!(route.transport, "cuda-ipc", "{}", route.reason);
    e.transfer_sync(&[Request::new(
        Op::Write,
        local.as_ptr() as u64,
        seg,
        dev,
        MIB,
    )])
    .unwrap();
    assert!(read(&target, dev, MIB) == local);
}

#[test]
fn forged_and_stale_keys_and_ranges_outside_are_refused_and_nothing_is_touched() {
    child("scenario_forged", &[]);
}

/// Records completions from a transport used without an engine.
#[derive(Default)]
struct Recorder(std::sync::Mutex<std::collections::HashMap<u64, Result<(), ferry_core::Error>>>);

impl ferry_core::transport::CompletionSink for Recorder {
    fn complete(&self, token: u64, result: Result<(), ferry_core::Error>) {
        self.0.lock().unwrap().insert(token, result);
    }
}

/// The cuda-ipc plugin driven through its C ABI without an engine, with the
/// target's real endpoint and keys, then forged ones.
#[test]
#[ignore]
fn scenario_forged() {
    use ferry_core::transport::{RegionSpec, Transport};
    use ferry_core::ErrorCode;
    use ferry_plugins_abi::sys;
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let mut t = Target::start();
    let e = engine();
    let seg = e.open_segment(&t.name).unwrap();
    let d = e.descriptor_of(seg).unwrap();
    let endpoint = d.endpoint("cuda-ipc").unwrap();
    let first = d.buffers.iter().find(|b| b.addr == t.first).unwrap();
    let key = first.key("cuda-ipc").unwrap();

    // The forger is this user's process: it knows this user's token.
    let token = ferry_tests::user_token();
    let settings = token
        .iter()
        .map(|t| ("auth.token".to_string(), t.expose()))
        .collect();
    let host = ferry_core::host::CoreHost::new(settings, None).for_engine(
        "forger:1",
        ferry_core::control::Link::new(Duration::from_secs(5), Duration::from_secs(10), token),
        Default::default(),
    );
    let set = ferry_core::load_plugins(
        &ferry_core::loader::LoaderConfig::from_env().expect("loader settings"),
        host,
    );
    let plugin = set
        .enabled(ferry_core::loader::PluginKind::Transport)
        .find(|p| p.report.name == "cuda-ipc")
        .expect("cuda-ipc enabled");
    let rec = Arc::new(Recorder::default());
    let raw = Arc::new(
        Transport::init(plugin, "forger:1", "127.0.0.1", rec.clone())
            .unwrap()
            .unwrap(),
    );
    let peer = raw
        .connect(&t.name, sys::FERRY_SCOPE_SAME_HOST, &endpoint)
        .unwrap();
    let local = e.allocate_device(Location::Cuda(0), MIB).unwrap();
    let (handle, _) = raw
        .register(&RegionSpec {
            addr: local,
            len: MIB,
            mem_kind: sys::FERRY_MEM_CUDA_IPC,
            location: "cuda:0",
            numa_node: None,
            device_ordinal: Some(0),
            dmabuf: None,
            local_only: false,
            share: None,
        })
        .unwrap();
    let run = |remote_addr: u64, length: u64, key: &[u8], token: u64| {
        let r = sys::ferry_transfer_request_t {
            op: sys::FERRY_OP_WRITE,
            reserved: 0,
            local_addr: local,
            local_mem: handle,
            remote_addr,
            length,
            remote_key: key.as_ptr(),
            remote_key_len: key.len(),
            token,
        };
        raw.submit(&peer, &[r]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(r) = rec.0.lock().unwrap().remove(&token) {
                return r;
            }
            assert!(Instant::now() < deadline, "no completion for {token}");
            raw.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let text = String::from_utf8(key.to_vec()).unwrap();
    let words: Vec<&str> = text.split(' ').collect();
    let (id, addr, len): (u64, u64, u64) = (
        words[1].parse().unwrap(),
        u64::from_str_radix(words[2], 16).unwrap(),
        u64::from_str_radix(words[3], 16).unwrap(),
    );
    assert_eq!((addr, len), (t.first, FIRST.1));
    let with =
        |id: u64, len: u64, rest: &str| format!("dev {id} {addr:x} {len:x} {rest}").into_bytes();

    // 1. A registration the target never made.
    let err = run(t.first, 4096, &with(id ^ 0x5555, len, words[4]), 1).unwrap_err();
    assert_eq!(err.code, ErrorCode::NotFound, "{err}");
    assert!(
        err.message.contains("not (or no longer) registered"),
        "{err}"
    );
    // 2. The real registration, a key claiming more than was registered: the
    //    target's own word on the range decides.
    let long = with(id, len * 2, words[4]);
    let err = run(t.first + len - 4096, 8192, &long, 2).unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    let err = run(t.first + len, 4096, &long, 3).unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    // 3. A key that says host memory for device memory.
    let lying = format!("host {id} {addr:x} {len:x} shared").into_bytes();
    let err = run(t.first, 4096, &lying, 4).unwrap_err();
    assert!(
        err.message.contains("disagree") || err.message.contains("host memory"),
        "{err}"
    );
    // 4. Garbage.
    let err = run(t.first, 4096, b"\xff\x00garbage", 5).unwrap_err();
    assert_eq!(err.code, ErrorCode::Protocol, "{err}");
    // Nothing was written at the target.
    assert_eq!(t.ask(&format!("check {} {} 7", t.first, FIRST.1)), "ok");
    // 5. The real key works; once unregistered (revoked), it is stale.
    run(t.first, 4096, &key, 6).unwrap();
    assert_eq!(open_imports(), 1);
    assert_eq!(t.ask(&format!("unregister {}", t.first)), "ok");
    assert_eq!(open_imports(), 0, "revoked before unregister returned");
    let err = run(t.first, 4096, &key, 7).unwrap_err();
    assert!(err.message.contains("no longer registered"), "{err}");
    raw.unregister(handle).unwrap();
    drop(peer);
}

/// FNV-1a, to compare a buffer at the target with the one expected here.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The emulator's count of copy calls: 0 cuMemcpyAsync, 1 kernel launches,
/// 2 cuMemcpyBatchAsync.
fn emu_calls(kind: i32) -> i64 {
    let path = std::ffi::CString::new(std::env::var("FERRY_CUDA_LIBRARY").unwrap()).unwrap();
    // SAFETY: as in open_imports; the symbol is long (int).
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

#[test]
fn block_lists_and_many_request_submits_by_the_copy_kernel() {
    let out = child(
        "scenario_lists",
        &[("EXPECT_COPY", "kernel"), ("FERRY_LOG", "info")],
    );
    assert!(
        out.contains("move by the copy kernel"),
        "logged once: {out}"
    );
}

#[test]
fn block_lists_and_many_request_submits_by_the_batched_copy() {
    child(
        "scenario_lists",
        &[("FERRY_CUDA_IPC_COPY", "batch"), ("EXPECT_COPY", "batch")],
    );
}

#[test]
fn block_lists_and_many_request_submits_one_copy_each() {
    child(
        "scenario_lists",
        &[
            ("FERRY_CUDA_IPC_COPY", "per-copy"),
            ("EXPECT_COPY", "per-copy"),
        ],
    );
}

#[test]
fn where_the_kernel_cannot_load_lists_take_the_batched_copy() {
    let out = child(
        "scenario_lists",
        &[("FERRY_CUDA_EMU_NO_KERNEL", "1"), ("EXPECT_COPY", "batch")],
    );
    assert!(out.contains("the copy kernel cannot load"), "{out}");
}

#[test]
fn a_forced_kernel_that_cannot_load_fails_with_the_reason() {
    child(
        "scenario_forced_kernel_missing",
        &[
            ("FERRY_CUDA_EMU_NO_KERNEL", "1"),
            ("FERRY_CUDA_IPC_COPY", "kernel"),
        ],
    );
}

/// The cuda-ipc plugin without an engine, connected to the target, with
/// a registered local device buffer of FIRST's length.
struct Raw {
    raw: std::sync::Arc<ferry_core::transport::Transport>,
    peer: ferry_core::transport::PeerHandle,
    rec: std::sync::Arc<Recorder>,
    key: Vec<u8>,
}

impl Raw {
    fn open(t: &Target, e: &Engine) -> Raw {
        use ferry_core::transport::Transport;
        use ferry_plugins_abi::sys;
        use std::sync::Arc;
        use std::time::Duration;
        let seg = e.open_segment(&t.name).unwrap();
        let d = e.descriptor_of(seg).unwrap();
        let endpoint = d.endpoint("cuda-ipc").unwrap();
        let first = d.buffers.iter().find(|b| b.addr == t.first).unwrap();
        let key = first.key("cuda-ipc").unwrap().to_vec();
        let token = ferry_tests::user_token();
        let mut settings: Vec<(String, String)> = token
            .iter()
            .map(|t| ("auth.token".to_string(), t.expose()))
            .collect();
        if let Ok(v) = std::env::var("FERRY_CUDA_IPC_COPY") {
            settings.push(("cuda_ipc.copy".into(), v));
        }
        let host = ferry_core::host::CoreHost::new(settings.into_iter().collect(), None)
            .for_engine(
                "lists:1",
                ferry_core::control::Link::new(
                    Duration::from_secs(5),
                    Duration::from_secs(10),
                    token,
                ),
                Default::default(),
            );
        let set = ferry_core::load_plugins(
            &ferry_core::loader::LoaderConfig::from_env().expect("loader settings"),
            host,
        );
        let plugin = set
            .enabled(ferry_core::loader::PluginKind::Transport)
            .find(|p| p.report.name == "cuda-ipc")
            .expect("cuda-ipc enabled");
        let rec = Arc::new(Recorder::default());
        let raw = Arc::new(
            Transport::init(plugin, "lists:1", "127.0.0.1", rec.clone())
                .unwrap()
                .unwrap(),
        );
        assert!(raw.takes_block_lists());
        let peer = raw
            .connect(&t.name, sys::FERRY_SCOPE_SAME_HOST, &endpoint)
            .unwrap();
        Raw {
            raw,
            peer,
            rec,
            key,
        }
    }

    /// A device buffer of `len` bytes on cuda:0 registered with the plugin.
    fn buffer(&self, e: &Engine, len: u64) -> (u64, u64) {
        use ferry_plugins_abi::sys;
        let addr = e.allocate_device(Location::Cuda(0), len).unwrap();
        let (handle, _) = self
            .raw
            .register(&ferry_core::transport::RegionSpec {
                addr,
                len,
                mem_kind: sys::FERRY_MEM_CUDA_IPC,
                location: "cuda:0",
                numa_node: None,
                device_ordinal: Some(0),
                dmabuf: None,
                local_only: false,
                share: None,
            })
            .unwrap();
        (addr, handle)
    }

    fn wait(&self, token: u64) -> Result<(), ferry_core::Error> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Some(r) = self.rec.0.lock().unwrap().remove(&token) {
                return r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no completion for {token}"
            );
            self.raw.progress();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn blocks(
        &self,
        op: u32,
        local: (u64, u64),
        remote: u64,
        blocks: &[ferry_plugins_abi::sys::ferry_block_t],
        token: u64,
    ) -> Result<(), ferry_core::Error> {
        let list = ferry_plugins_abi::sys::ferry_block_list_t {
            op,
            reserved: 0,
            local_addr: local.0,
            local_mem: local.1,
            remote_addr: remote,
            remote_key: self.key.as_ptr(),
            remote_key_len: self.key.len(),
            blocks: blocks.as_ptr(),
            count: blocks.len(),
            token,
        };
        self.raw.submit_blocks(&self.peer, &list)?;
        self.wait(token)
    }
}

/// One side of a layout list: (base, stride, block count).
type Side = (u64, u64, u64);

impl Raw {
    /// Blocks `ids.0[i]` of the local layout to or from `ids.1[i]` of the
    /// peer's, through the plugin's submit_layouts, waited for.
    fn layouts(
        &self,
        op: u32,
        local: (Side, u64),
        remote: Side,
        block_size: u64,
        ids: (&[u64], &[u64]),
        token: u64,
    ) -> Result<(), ferry_core::Error> {
        let list = ferry_plugins_abi::sys::ferry_layout_list_t {
            op,
            reserved: 0,
            local_base: local.0 .0,
            local_stride: local.0 .1,
            local_blocks: local.0 .2,
            local_mem: local.1,
            remote_base: remote.0,
            remote_stride: remote.1,
            remote_blocks: remote.2,
            remote_key: self.key.as_ptr(),
            remote_key_len: self.key.len(),
            block_size,
            local_ids: ids.0.as_ptr(),
            remote_ids: ids.1.as_ptr(),
            count: ids.0.len(),
            token,
        };
        self.raw.submit_layouts(&self.peer, &list)?;
        self.wait(token)
    }
}

fn block(l: u64, r: u64, n: u64) -> ferry_plugins_abi::sys::ferry_block_t {
    ferry_plugins_abi::sys::ferry_block_t {
        local_offset: l,
        remote_offset: r,
        length: n,
    }
}

/// Block lists written and read through the plugin's submit_blocks, and a
/// many-request submit with bad requests among good ones, verified byte
/// for byte at both ends; the emulator's counts show how the lists moved
/// (EXPECT_COPY: kernel, batch or per-copy).
#[test]
#[ignore]
fn scenario_lists() {
    use ferry_core::ErrorCode;
    use ferry_plugins_abi::sys;
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let expect = std::env::var("EXPECT_COPY").unwrap();
    let mut t = Target::start();
    let e = engine();
    let r = Raw::open(&t, &e);
    let len = FIRST.1;
    let src = r.buffer(&e, len);
    let dst = r.buffer(&e, len);
    let data = pattern(len as usize, 31);
    fill(&e, src.0, &data);
    fill(&e, dst.0, &vec![0u8; len as usize]);
    // What the target holds: its fill from its allocation's start.
    let mut remote = pattern(TARGET_ALLOC as usize, 7)[..len as usize].to_vec();
    let apply = |to: &mut [u8], from: &[u8], blocks: &[sys::ferry_block_t], write: bool| {
        for b in blocks {
            let (l, rr, n) = (
                b.local_offset as usize,
                b.remote_offset as usize,
                b.length as usize,
            );
            if write {
                to[rr..rr + n].copy_from_slice(&from[l..l + n]);
            } else {
                to[l..l + n].copy_from_slice(&from[rr..rr + n]);
            }
        }
    };
    // 4 KiB blocks shuffled over the first 4 MiB on both sides, then odd
    // lengths and offsets and one block longer than the kernel's piece in
    // the last MiB.
    let slots = 4 * MIB / 4096;
    let (ls, rs) = (
        ferry_tests::shuffled(slots, 3),
        ferry_tests::shuffled(slots, 5),
    );
    let mut list: Vec<sys::ferry_block_t> = (0..slots as usize / 2)
        .map(|i| block(ls[i] * 4096, rs[i] * 4096, 4096))
        .collect();
    let tail = 4 * MIB;
    list.extend([
        block(tail + 3, tail + 3, 77),
        block(tail + 101, tail + 5000, 4093),
        block(tail + 10_000, tail + 10_008, 1),
        block(tail + 20_000, tail + 20_004, 12_345),
        block(tail + 65_536, tail + 131_072, 300 * 1024 + 9),
    ]);
    let calls = || [emu_calls(0), emu_calls(1), emu_calls(2)];
    let before = calls();
    r.blocks(sys::FERRY_OP_WRITE, src, t.first, &list, 1)
        .unwrap();
    let after = calls();
    apply(&mut remote, &data, &list, true);
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        format!("ok {:016x}", fnv(&remote)),
        "the blocks written, and nothing else"
    );
    let moved = [
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
    ];
    let want = match expect.as_str() {
        "kernel" => [0, 1, 0],
        "batch" => [0, 0, 1],
        _ => [list.len() as i64, 0, 0],
    };
    assert_eq!(
        moved, want,
        "copy calls (memcpy, launches, batches) for one list"
    );
    // Read them back into zeros: reads as writes.
    r.blocks(sys::FERRY_OP_READ, dst, t.first, &list, 2)
        .unwrap();
    let mut local = vec![0u8; len as usize];
    apply(&mut local, &remote, &list, false);
    assert!(read(&e, dst.0, len) == local, "the blocks read");

    // A list with one block outside the peer's registration, or outside
    // the local one, or empty, is refused whole: nothing moves.
    let before = calls();
    for (bad, code) in [
        (block(0, len - 4096, 4097), ErrorCode::OutOfBounds),
        (block(len - 1, 0, 2), ErrorCode::OutOfBounds),
        (block(0, 0, 0), ErrorCode::InvalidArgument),
    ] {
        let mut mixed = list[..64].to_vec();
        mixed.insert(10, bad);
        let err = r
            .blocks(sys::FERRY_OP_WRITE, (src.0, src.1), t.first, &mixed, 3)
            .unwrap_err();
        assert_eq!(err.code, code, "{err}");
        assert!(
            r.rec.0.lock().unwrap().is_empty(),
            "a refused list completes nothing"
        );
    }
    assert_eq!(calls(), before, "nothing was queued");
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        format!("ok {:016x}", fnv(&remote)),
        "nothing was touched"
    );

    // A many-request submit: good requests with bad ones among them
    // (outside the peer's registration, outside the local one, a key that
    // does not decode, breaking the run); each completes with its own
    // status, the good ones land, all in one list.
    let data2 = pattern(len as usize, 41);
    fill(&e, src.0, &data2);
    let mut reqs = Vec::new();
    let mut good = Vec::new();
    let garbage = b"\xff\x00garbage".to_vec();
    for i in 0..64u64 {
        let (l, rr) = (ls[i as usize] * 4096, rs[i as usize] * 4096);
        let (key, laddr, raddr, token): (&[u8], u64, u64, u64) = match i {
            7 => (&r.key, src.0 + l, t.first + len - 100, 100 + i),
            20 => (&r.key, src.0 + len - 100, t.first + rr, 100 + i),
            33 => (&garbage, src.0 + l, t.first + rr, 100 + i),
            _ => {
                good.push(block(l, rr, 4096));
                (&r.key, src.0 + l, t.first + rr, 100 + i)
            }
        };
        reqs.push(sys::ferry_transfer_request_t {
            op: sys::FERRY_OP_WRITE,
            reserved: 0,
            local_addr: laddr,
            local_mem: src.1,
            remote_addr: raddr,
            length: 4096,
            remote_key: key.as_ptr(),
            remote_key_len: key.len(),
            token,
        });
    }
    let before = calls();
    r.raw.submit(&r.peer, &reqs).unwrap();
    for req in &reqs {
        let result = r.wait(req.token);
        match req.token - 100 {
            7 | 20 => assert_eq!(result.unwrap_err().code, ErrorCode::OutOfBounds),
            33 => assert_eq!(result.unwrap_err().code, ErrorCode::Protocol),
            i => result.unwrap_or_else(|e| panic!("request {i}: {e}")),
        }
    }
    let after = calls();
    let moved = [
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
    ];
    let want = match expect.as_str() {
        "kernel" => [0, 1, 0],
        "batch" => [0, 0, 1],
        _ => [good.len() as i64, 0, 0],
    };
    assert_eq!(moved, want, "copy calls for one submission");
    apply(&mut remote, &data2, &good, true);
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        format!("ok {:016x}", fnv(&remote)),
        "the good requests landed, the bad ones did not"
    );
    // Blocks by layout and index (submit_layouts): strided layouts on both
    // sides, 4 KiB blocks and blocks longer than the kernel's piece (odd
    // lengths, unaligned bases), written and read back, as the indices say.
    assert!(r.raw.takes_layout_lists());
    let data3 = pattern(len as usize, 53);
    fill(&e, src.0, &data3);
    fill(&e, dst.0, &vec![0u8; len as usize]);
    let all = || [emu_calls(0), emu_calls(1), emu_calls(2), emu_calls(3)];
    for (n, (block_size, lstride, rstride, rbase)) in [
        (4096u64, 8192u64, 12_288u64, 100u64),
        (40 * 1024 + 12, 40 * 1024 + 12, 45 * 1024, 7),
    ]
    .into_iter()
    .enumerate()
    {
        let lcount = (4 * MIB - block_size) / lstride + 1;
        let rcount = (4 * MIB - rbase - block_size) / rstride + 1;
        let count = lcount.min(rcount) * 2 / 3;
        let lids: Vec<u64> =
            ferry_tests::shuffled(lcount, 11 + n as u64)[..count as usize].to_vec();
        let rids: Vec<u64> =
            ferry_tests::shuffled(rcount, 13 + n as u64)[..count as usize].to_vec();
        let as_blocks: Vec<sys::ferry_block_t> = lids
            .iter()
            .zip(&rids)
            .map(|(&l, &rr)| block(l * lstride, rbase + rr * rstride, block_size))
            .collect();
        let local_side = |b: (u64, u64)| ((b.0, lstride, lcount), b.1);
        let remote_side = (t.first + rbase, rstride, rcount);
        let before = all();
        r.layouts(
            sys::FERRY_OP_WRITE,
            local_side(src),
            remote_side,
            block_size,
            (&lids, &rids),
            200 + n as u64,
        )
        .unwrap();
        let after = all();
        apply(&mut remote, &data3, &as_blocks, true);
        assert_eq!(
            t.ask(&format!("hash {} {len}", t.first)),
            format!("ok {:016x}", fnv(&remote)),
            "the blocks written where the indices say, and nothing else"
        );
        let moved: Vec<i64> = (0..4).map(|k| after[k] - before[k]).collect();
        let want = match expect.as_str() {
            "kernel" => vec![0, 0, 0, 1],
            "batch" => vec![0, 0, 1, 0],
            _ => vec![count as i64, 0, 0, 0],
        };
        assert_eq!(
            moved, want,
            "copy calls (memcpy, list launches, batches, layout launches)"
        );
        r.layouts(
            sys::FERRY_OP_READ,
            local_side(dst),
            remote_side,
            block_size,
            (&lids, &rids),
            210 + n as u64,
        )
        .unwrap();
        let mut want_local = vec![0u8; len as usize];
        apply(&mut want_local, &remote, &as_blocks, false);
        assert!(
            read(&e, dst.0, len) == want_local,
            "the blocks read where the indices say, and nothing else"
        );
        // Zeros again for the next case.
        fill(&e, dst.0, &vec![0u8; len as usize]);

        // An index past its layout, or a layout that runs past the peer's
        // registration, is refused whole before anything moves.
        let before = all();
        let mut bad_local = lids.clone();
        bad_local[count as usize / 2] = lcount;
        let mut bad_remote = rids.clone();
        bad_remote[0] = rcount + 5;
        // Its last block ends past the peer's registration of `len` bytes.
        let too_long = (t.first + rbase, rstride, len / rstride + 2);
        for (ids, side, code, what) in [
            (
                (&bad_local[..], &rids[..]),
                remote_side,
                ErrorCode::OutOfBounds,
                "the local index",
            ),
            (
                (&lids[..], &bad_remote[..]),
                remote_side,
                ErrorCode::OutOfBounds,
                "the remote index",
            ),
            (
                (&lids[..], &rids[..]),
                too_long,
                ErrorCode::OutOfBounds,
                "outside",
            ),
        ] {
            let err = r
                .layouts(
                    sys::FERRY_OP_WRITE,
                    local_side(src),
                    side,
                    block_size,
                    ids,
                    220,
                )
                .expect_err(what);
            assert_eq!(err.code, code, "{err}");
            assert!(err.message.contains(what), "{err}");
            assert!(
                r.rec.0.lock().unwrap().is_empty(),
                "a refused layout list completes nothing"
            );
        }
        assert_eq!(all(), before, "nothing was queued");
        assert_eq!(
            t.ask(&format!("hash {} {len}", t.first)),
            format!("ok {:016x}", fnv(&remote)),
            "nothing was touched"
        );
    }
    let detail = r.raw.describe(&r.peer).unwrap_or_default();
    assert!(detail.contains("lists of GPU copies by"), "{detail}");
    drop(r);
    drop(t);
}

#[test]
fn blocks_by_layout_through_the_engine_by_the_kernel() {
    child("scenario_layouts", &[]);
}

#[test]
fn blocks_by_layout_through_the_engine_one_copy_each() {
    child("scenario_layouts", &[("FERRY_CUDA_IPC_COPY", "per-copy")]);
}

/// Engine::transfer_blocks over cuda-ipc: the layouts and index arrays
/// reach the plugin (ABI 1.5) and the bytes land where the indices say,
/// written and read back; an index out of range is refused, nothing moved.
#[test]
#[ignore]
fn scenario_layouts() {
    use ferry_core::{BlockLayout, BlockTransfer, ErrorCode};
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let mut t = Target::start();
    let e = engine();
    let seg: SegmentId = e.open_segment(&t.name).unwrap();
    let len = FIRST.1;
    let (block, lstride, rstride) = (4096 + 8, 8192u64, 12_288u64);
    let lcount = (len - block) / lstride + 1;
    let rcount = (len - block) / rstride + 1;
    let reply = t.ask(&format!("layout {} {block} {rstride} {rcount}", t.first));
    let remote: u32 = reply
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("{reply}"))
        .parse()
        .unwrap();
    let src = device_buffer(&e, len);
    let dst = device_buffer(&e, len);
    let layout = |base| BlockLayout {
        base,
        block_size: block,
        stride: lstride,
        count: lcount,
    };
    let (ls, ld) = (
        e.register_layout(layout(src)).unwrap(),
        e.register_layout(layout(dst)).unwrap(),
    );
    let data = pattern(len as usize, 61);
    fill(&e, src, &data);
    fill(&e, dst, &vec![0u8; len as usize]);
    let n = lcount.min(rcount) as usize / 2;
    let lids = ferry_tests::shuffled(lcount, 17)[..n].to_vec();
    let rids = ferry_tests::shuffled(rcount, 19)[..n].to_vec();
    let transfer = |op, local, local_ids: &[u64], remote_ids: &[u64]| {
        e.transfer_blocks(&BlockTransfer {
            op,
            segment: seg,
            local,
            local_ids,
            remote,
            remote_ids,
            transport: None,
        })
    };
    let mut want_remote = pattern(TARGET_ALLOC as usize, 7)[..len as usize].to_vec();
    let mut want_local = vec![0u8; len as usize];
    for (&l, &r) in lids.iter().zip(&rids) {
        let (l, r, b) = (
            (l * lstride) as usize,
            (r * rstride) as usize,
            block as usize,
        );
        want_remote[r..r + b].copy_from_slice(&data[l..l + b]);
        want_local[l..l + b].copy_from_slice(&data[l..l + b]);
    }
    transfer(Op::Write, ls, &lids, &rids).unwrap();
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        format!("ok {:016x}", fnv(&want_remote)),
        "the blocks written where the indices say, and nothing else"
    );
    transfer(Op::Read, ld, &lids, &rids).unwrap();
    assert!(read(&e, dst, len) == want_local, "the blocks read back");
    let mut bad = rids.clone();
    bad[n / 2] = rcount;
    let err = transfer(Op::Write, ls, &lids, &bad).unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        format!("ok {:016x}", fnv(&want_remote)),
        "nothing was touched"
    );
    drop(t);
}

/// cuda_ipc.copy=kernel where the kernel cannot load: a list fails with
/// the reason (no silent fallback), and `describe` says so.
#[test]
#[ignore]
fn scenario_forced_kernel_missing() {
    use ferry_plugins_abi::sys;
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let t = Target::start();
    let e = engine();
    let r = Raw::open(&t, &e);
    let src = r.buffer(&e, MIB);
    let list = [block(0, 0, 4096), block(8192, 4096, 4096)];
    let err = r
        .blocks(sys::FERRY_OP_WRITE, src, t.first, &list, 1)
        .unwrap_err();
    assert!(err.message.contains("cuda_ipc.copy=kernel"), "{err}");
    assert_eq!(emu_calls(1), 0);
}

#[test]
fn request_lists_between_one_pair_of_buffers_go_as_one_list() {
    child("scenario_request_lists", &[]);
}

/// Many small requests through the engine (Rust's `submit`, what the C and
/// Python lists become): shuffled 4 KiB blocks between one local buffer and
/// one of the peer's registrations move in one launch and land where each
/// request says; a batch with one request outside the peer's registration
/// is refused whole, naming it, with nothing touched; a batch spanning both
/// of the peer's registrations still completes, request by request.
#[test]
#[ignore]
fn scenario_request_lists() {
    use ferry_core::ErrorCode;
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    ferry_core::init_logging();
    let mut t = Target::start();
    let e = engine();
    let seg: SegmentId = e.open_segment(&t.name).unwrap();
    let len = FIRST.1;
    let src = device_buffer(&e, len);
    let data = pattern(len as usize, 23);
    fill(&e, src, &data);
    let mut remote = pattern(TARGET_ALLOC as usize, 7)[..len as usize].to_vec();
    let slots = len / 4096;
    let (ls, rs) = (
        ferry_tests::shuffled(slots, 9),
        ferry_tests::shuffled(slots, 13),
    );
    let n = slots as usize / 2;
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            Request::new(
                Op::Write,
                src + ls[i] * 4096,
                seg,
                t.first + rs[i] * 4096,
                4096,
            )
        })
        .collect();
    let launches = emu_calls(1);
    e.transfer_sync(&reqs).unwrap();
    assert_eq!(emu_calls(1) - launches, 1, "one launch for the batch");
    for i in 0..n {
        let (l, r) = (ls[i] as usize * 4096, rs[i] as usize * 4096);
        remote[r..r + 4096].copy_from_slice(&data[l..l + 4096]);
    }
    let hash = format!("ok {:016x}", fnv(&remote));
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        hash,
        "each block where its request said"
    );

    // Read back into zeros through other local blocks.
    let dst = device_buffer(&e, len);
    fill(&e, dst, &vec![0u8; len as usize]);
    let back: Vec<Request> = (0..n)
        .map(|i| {
            Request::new(
                Op::Read,
                dst + ls[n + i] * 4096,
                seg,
                t.first + rs[i] * 4096,
                4096,
            )
        })
        .collect();
    e.transfer_sync(&back).unwrap();
    let got = read(&e, dst, len);
    for i in 0..n {
        let (l, r) = (ls[n + i] as usize * 4096, rs[i] as usize * 4096);
        assert!(
            got[l..l + 4096] == remote[r..r + 4096],
            "block {i} read back"
        );
    }

    // One request past the peer's registration: the batch is refused,
    // naming it, and nothing moves.
    let mut bad = reqs[..64].to_vec();
    bad[40].remote_addr = t.first + len - 100;
    let before = [emu_calls(0), emu_calls(1), emu_calls(2)];
    let err = e.transfer_sync(&bad).unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    assert!(err.message.contains("request 40"), "{err}");
    assert_eq!(
        [emu_calls(0), emu_calls(1), emu_calls(2)],
        before,
        "nothing queued"
    );
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        hash,
        "nothing touched"
    );

    // One past the local buffer: the same.
    let mut bad = reqs[..64].to_vec();
    bad[3].local_addr = src + len - 1;
    let err = e.transfer_sync(&bad).unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    assert_eq!(
        t.ask(&format!("hash {} {len}", t.first)),
        hash,
        "nothing touched"
    );

    // Half to each of the peer's registrations: not one run, still moved.
    let data2 = pattern(len as usize, 29);
    fill(&e, src, &data2);
    let mixed: Vec<Request> = (0..64u64)
        .map(|i| {
            let remote = if i % 2 == 0 { t.first } else { t.second };
            Request::new(Op::Write, src + i * 4096, seg, remote + i * 4096, 4096)
        })
        .collect();
    e.transfer_sync(&mixed).unwrap();
    let back = read(&e, src, 64 * 4096);
    assert!(back == data2[..64 * 4096], "source intact");
    let mut second = pattern(TARGET_ALLOC as usize, 7)
        [SECOND.0 as usize..(SECOND.0 + SECOND.1) as usize]
        .to_vec();
    for i in (1..64usize).step_by(2) {
        second[i * 4096..(i + 1) * 4096].copy_from_slice(&data2[i * 4096..(i + 1) * 4096]);
    }
    assert_eq!(
        t.ask(&format!("hash {} {}", t.second, SECOND.1)),
        format!("ok {:016x}", fnv(&second)),
        "the odd requests in the second registration"
    );
    drop(t);
}
