//! The RDMA transport's real code, driven against the verbs emulator
//! (tests/verbs-emulator, a test-only libibverbs.so.1) on a DGX-like fake
//! sysfs tree: processes with eight emulated NICs, transfers verified both
//! ways, NIC choice from the topology, a NIC failing mid-transfer, forged
//! keys, memory registered again under load, a vanishing peer, GPU memory
//! by DMA-BUF (the fake GPU plugin), and hostile plugin messages.
//!
//! libibverbs is loaded when the plugin loads, through the dynamic loader's
//! search path, so the emulator must be on LD_LIBRARY_PATH when a process
//! starts: each scenario runs as an `#[ignore]`d test of this binary in a
//! child process with that environment (`child()`), which starts its own
//! targets (`ferry bench target`) with the same environment. The parent test
//! only builds the emulator, writes the sysfs tree and checks the child's
//! exit status. Nothing here depends on timing.

use ferry_core::transport::{CompletionSink, RegionSpec, Transport};
use ferry_core::{Engine, EngineConfig, ErrorCode, Location, Op, Request, SegmentId};
use ferry_plugins_abi::sys;
use ferry_tests::ordering::{notifications_follow_their_data, Shape};
use ferry_tests::{
    build_verbs_emulator, built, child_output, child_test, ferry_bin, repo_root, write_fixture,
    TargetProcess,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const CHILD: &str = "FERRY_RDMA_TEST_CHILD";
const MIB: u64 = 1 << 20;

// ---- the parent's side: emulator, sysfs tree, child processes ----------

struct Emu {
    _dir: tempfile::TempDir,
    lib_dir: PathBuf,
    sysfs: PathBuf,
    /// The same tree with nvidia-peermem "loaded".
    sysfs_peermem: PathBuf,
}

fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let lib_dir = dir.path().join("lib");
        std::fs::create_dir_all(&lib_dir).unwrap();
        build_verbs_emulator(&lib_dir);
        let sysfs = dir.path().join("dgx");
        write_fixture("dgx-h100", &sysfs);
        let sysfs_peermem = dir.path().join("dgx-peermem");
        write_fixture("dgx-h100", &sysfs_peermem);
        std::fs::create_dir_all(sysfs_peermem.join("module/nvidia_peermem")).unwrap();
        Emu {
            _dir: dir,
            lib_dir,
            sysfs,
            sysfs_peermem,
        }
    })
}

/// A plugin directory holding the fake GPU as the "cuda" device plugin.
fn fake_gpu_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            built("libferry_test_device_fakegpu.so"),
            dir.path().join("libferry_device_cuda.so"),
        )
        .unwrap();
        dir
    })
    .path()
}

/// The environment of one scenario's processes: the emulator, its device
/// file, a private fabric directory, the fake DGX sysfs, rdma only.
fn emu_env(fabric: &Path) -> Vec<(String, String)> {
    let e = emu();
    vec![
        ("LD_LIBRARY_PATH".into(), e.lib_dir.display().to_string()),
        (
            "FERRY_VERBS_EMU_CONFIG".into(),
            repo_root()
                .join("tests/verbs-emulator/dgx-h100.conf")
                .display()
                .to_string(),
        ),
        ("FERRY_VERBS_EMU_DIR".into(), fabric.display().to_string()),
        ("FERRY_SYSFS_ROOT".into(), e.sysfs.display().to_string()),
        ("FERRY_TRANSPORTS".into(), "rdma".into()),
        ("FERRY_TIMEOUT_MS".into(), "10000".into()),
        ("FERRY_VERBS_EMU_FAULTS".into(), String::new()),
    ]
}

/// Runs the ignored test `name` of this binary in a child process with the
/// emulator's environment plus `extra`, and fails with its output if it does.
fn child(name: &str, extra: &[(&str, &str)]) -> String {
    let fabric = tempfile::tempdir().unwrap();
    let mut cmd = child_test(name);
    cmd.env(CHILD, "1");
    for (k, v) in emu_env(fabric.path()) {
        cmd.env(k, v);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let text = child_output(cmd, name);
    if std::env::var_os("FERRY_RDMA_TEST_SHOW").is_some() {
        eprintln!("{text}");
    }
    text
}

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

// ---- the child's side ---------------------------------------------------

/// Keeps every log line (the plugin's decisions) for assertions, and
/// prints it.
struct Capture;
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let line = format!("{} {}: {}", r.level(), r.target(), r.args());
            eprintln!("{line}");
            LINES.lock().unwrap().push(line);
        }
    }
    fn flush(&self) {}
}

fn capture_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = log::set_logger(&Capture);
        log::set_max_level(log::LevelFilter::Info);
    });
}

fn logs() -> String {
    LINES.lock().unwrap().join("\n")
}

fn engine(settings: &[(&str, &str)]) -> Engine {
    let mut c = EngineConfig::from_env().unwrap();
    for (k, v) in settings {
        c.set(k, v).unwrap();
    }
    Engine::new(c).unwrap()
}

fn target(args: &[&str], env: &[(&str, &str)]) -> TargetProcess {
    TargetProcess::start(args, env, &[])
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect()
}

fn remote(e: &Engine, seg: SegmentId) -> (u64, u64) {
    let d = e.descriptor_of(seg).unwrap();
    (d.buffers[0].addr, d.buffers[0].len)
}

/// Registers a pattern of `len` bytes and a buffer as long (at `location`),
/// writes the pattern to `raddr`, reads it back and checks it. Returns both,
/// registered, so they outlive the checks that follow.
fn round_trip(
    e: &Engine,
    seg: SegmentId,
    raddr: u64,
    len: u64,
    seed: u8,
    location: Option<Location>,
    what: &str,
) -> (Vec<u8>, Vec<u8>) {
    let src = pattern(len as usize, seed);
    let mut back = vec![0u8; len as usize];
    e.register_memory(src.as_ptr() as u64, len, location)
        .unwrap();
    e.register_memory(back.as_mut_ptr() as u64, len, location)
        .unwrap();
    let (s, b) = (src.as_ptr() as u64, back.as_mut_ptr() as u64);
    e.transfer_sync(&[Request::new(Op::Write, s, seg, raddr, len)])
        .unwrap();
    e.transfer_sync(&[Request::new(Op::Read, b, seg, raddr, len)])
        .unwrap();
    assert!(back == src, "{what}");
    (src, back)
}

/// Bytes each local NIC carried to this segment, from the plugin's own
/// description of the peer ("mlx5_0 1048576 B in 1 slices").
fn carried(e: &Engine, seg: SegmentId, local: u64, raddr: u64) -> HashMap<String, u64> {
    let detail = e
        .route(seg, local, raddr, 1)
        .unwrap()
        .peer_detail
        .unwrap_or_default();
    let mut out = HashMap::new();
    if let Some(sent) = detail.split("sent through ").nth(1) {
        for part in sent.split(';').next().unwrap_or("").split(", ") {
            let mut w = part.split_whitespace();
            if let (Some(nic), Some(bytes)) = (w.next(), w.next()) {
                if let Ok(b) = bytes.parse() {
                    out.insert(nic.to_string(), b);
                }
            }
        }
    }
    out
}

fn used(map: &HashMap<String, u64>) -> Vec<String> {
    let mut v: Vec<String> = map
        .iter()
        .filter(|(_, b)| **b > 0)
        .map(|(n, _)| n.clone())
        .collect();
    v.sort();
    v
}

fn names(list: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

// ---- scenarios ---------------------------------------------------------

#[test]
fn ferry_demo_over_rdma_verifies_every_byte_both_ways_between_two_processes() {
    let fabric = tempfile::tempdir().unwrap();
    let out = Command::new(ferry_bin())
        .args(["demo", "--size", "64M", "--block", "4M"])
        .envs(emu_env(fabric.path()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("transport  rdma ("), "{stdout}");
    assert!(stdout.contains("target's checksum"), "{stdout}");
    assert!(
        stdout.contains("OK: every byte arrived and came back intact."),
        "{stdout}"
    );
}

#[test]
fn nics_follow_the_topology_and_64_mib_uses_every_preferred_nic() {
    child("child_nics_follow_the_topology", &[]);
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_nics_follow_the_topology() {
    if !in_child() {
        return;
    }
    let t = target(&["--buffer-size", "64M"], &[]);
    // A 64 MiB write and read-back from host memory on NUMA node 0: sliced
    // over all four NICs the topology ranks first for cpu:0.
    let e = engine(&[]);
    let seg = e.open_segment(&t.segment).unwrap();
    let (raddr, rlen) = remote(&e, seg);
    assert_eq!(rlen, 64 * MIB);
    let (src, _back) = round_trip(
        &e,
        seg,
        raddr,
        rlen,
        1,
        Some(Location::Cpu(0)),
        "64 MiB written and read back over RDMA",
    );
    let by_nic = carried(&e, seg, src.as_ptr() as u64, raddr);
    assert_eq!(
        used(&by_nic),
        names(&["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"]),
        "{by_nic:?}"
    );
    assert_eq!(by_nic.values().sum::<u64>(), 2 * rlen);

    // One rail: exactly the NIC ranked first for the buffer's NUMA node.
    let one = engine(&[("rdma.rails", "1")]);
    let seg1 = one.open_segment(&t.segment).unwrap();
    let node1 = pattern(4 << 20, 2);
    one.register_memory(node1.as_ptr() as u64, 4 << 20, Some(Location::Cpu(1)))
        .unwrap();
    one.transfer_sync(&[Request::new(
        Op::Write,
        node1.as_ptr() as u64,
        seg1,
        raddr,
        4 << 20,
    )])
    .unwrap();
    let by_nic = carried(&one, seg1, node1.as_ptr() as u64, raddr);
    assert_eq!(used(&by_nic), names(&["mlx5_6"]), "cpu:1 -> {by_nic:?}");
    let node0 = pattern(4 << 20, 3);
    one.register_memory(node0.as_ptr() as u64, 4 << 20, Some(Location::Cpu(0)))
        .unwrap();
    one.transfer_sync(&[Request::new(
        Op::Write,
        node0.as_ptr() as u64,
        seg1,
        raddr,
        4 << 20,
    )])
    .unwrap();
    let by_nic = carried(&one, seg1, node0.as_ptr() as u64, raddr);
    assert_eq!(
        used(&by_nic),
        names(&["mlx5_0", "mlx5_6"]),
        "cpu:0 then -> {by_nic:?}"
    );
    let mut back = vec![0u8; 4 << 20];
    one.register_memory(back.as_mut_ptr() as u64, 4 << 20, None)
        .unwrap();
    one.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg1,
        raddr,
        4 << 20,
    )])
    .unwrap();
    assert!(back == node0);
}

#[test]
fn an_injected_nic_failure_mid_transfer_completes_on_the_other_nics() {
    child(
        "child_nic_failure_mid_transfer",
        // mlx5_3's port dies after 4 work requests; mlx5_4 fails every 7th.
        &[(
            "FERRY_VERBS_EMU_FAULTS",
            "mlx5_3:port_down_after=4;mlx5_4:wc_error_every=7",
        )],
    );
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_nic_failure_mid_transfer() {
    if !in_child() {
        return;
    }
    capture_logs();
    // The fault is this process's: the target's NICs stay healthy.
    let t = target(&["--buffer-size", "64M"], &[("FERRY_VERBS_EMU_FAULTS", "")]);
    let e = engine(&[]);
    let seg = e.open_segment(&t.segment).unwrap();
    let (raddr, rlen) = remote(&e, seg);
    // mlx5_3's port goes down after its 4th work request, in the middle of
    // this write: its remaining slices move to the other NICs.
    let (src, _back) = round_trip(
        &e,
        seg,
        raddr,
        rlen,
        7,
        None,
        "every byte arrived despite the failure",
    );
    let detail = e
        .route(seg, src.as_ptr() as u64, raddr, 1)
        .unwrap()
        .peer_detail
        .unwrap();
    assert!(detail.contains("retried on another NIC pair"), "{detail}");
    let by_nic = carried(&e, seg, src.as_ptr() as u64, raddr);
    for nic in ["mlx5_0", "mlx5_4", "mlx5_5"] {
        assert!(by_nic.get(nic).copied().unwrap_or(0) > 0, "{by_nic:?}");
    }
    assert!(
        by_nic.get("mlx5_3").copied().unwrap_or(0) <= 4 * MIB,
        "{by_nic:?}"
    );
    let logs = logs();
    assert!(
        logs.contains("mlx5_3 port 1 is down") && logs.contains("pausing mlx5_3"),
        "{logs}"
    );
    assert!(logs.contains("continue on"), "{logs}");
    // The engine's metrics carry the plugin's counts.
    let plugins = e.metrics().plugins;
    let count = |name: &str, device: &str| {
        plugins
            .iter()
            .find(|p| p.plugin == "rdma" && p.name == name && p.device == device)
            .map_or(0, |p| p.value)
    };
    assert!(count("nic_pauses", "mlx5_3") >= 1, "{plugins:?}");
    assert!(count("slice_retries", "") >= 1, "{plugins:?}");
}

#[test]
fn forged_keys_fail_at_the_initiator_and_the_target_is_unharmed() {
    child("child_forged_keys", &[]);
}

/// Records completions from a transport used without an engine.
#[derive(Default)]
struct Recorder(Mutex<HashMap<u64, Result<(), ferry_core::Error>>>);

impl CompletionSink for Recorder {
    fn complete(&self, token: u64, result: Result<(), ferry_core::Error>) {
        self.0.lock().unwrap().insert(token, result);
    }
}

fn wait_for(t: &Transport, rec: &Recorder, token: u64) -> Result<(), ferry_core::Error> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(r) = rec.0.lock().unwrap().remove(&token) {
            return r;
        }
        assert!(Instant::now() < deadline, "no completion for {token}");
        t.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// (addr, len, [(nic, rkey)], rest) of an rdma key (see transports/rdma/src/wire.rs).
fn split_key(k: &[u8]) -> (u64, u64, Vec<(u8, u32)>, Vec<u8>) {
    assert_eq!(&k[..4], b"FRK1");
    let addr = u64::from_le_bytes(k[4..12].try_into().unwrap());
    let len = u64::from_le_bytes(k[12..20].try_into().unwrap());
    let n = k[20] as usize;
    let mut rkeys = Vec::new();
    for i in 0..n {
        let at = 21 + i * 5;
        rkeys.push((
            k[at],
            u32::from_le_bytes(k[at + 1..at + 5].try_into().unwrap()),
        ));
    }
    (addr, len, rkeys, k[21 + n * 5..].to_vec())
}

fn join_key(addr: u64, len: u64, rkeys: &[(u8, u32)], rest: &[u8]) -> Vec<u8> {
    let mut k = b"FRK1".to_vec();
    k.extend_from_slice(&addr.to_le_bytes());
    k.extend_from_slice(&len.to_le_bytes());
    k.push(rkeys.len() as u8);
    for (n, r) in rkeys {
        k.push(*n);
        k.extend_from_slice(&r.to_le_bytes());
    }
    k.extend_from_slice(rest);
    k
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_forged_keys() {
    if !in_child() {
        return;
    }
    let t = target(&["--buffer-size", "4M"], &[]);
    let e = engine(&[]);
    let seg = e.open_segment(&t.segment).unwrap();
    let (raddr, rlen) = remote(&e, seg);
    let known = pattern(rlen as usize, 9);
    let mut back = vec![0u8; rlen as usize];
    e.register_memory(known.as_ptr() as u64, rlen, None)
        .unwrap();
    e.register_memory(back.as_mut_ptr() as u64, rlen, None)
        .unwrap();
    e.transfer_sync(&[Request::new(
        Op::Write,
        known.as_ptr() as u64,
        seg,
        raddr,
        rlen,
    )])
    .unwrap();

    // The rdma plugin driven through its C ABI without an engine, with the
    // target's real endpoint and keys, then forged ones.
    let d = e.descriptor_of(seg).unwrap();
    let endpoint = d.endpoint("rdma").unwrap();
    let key = d.buffers[0].key("rdma").unwrap();
    let config = EngineConfig::from_env().unwrap();
    let topology = Arc::new(ferry_core::topology::Topology::discover(&config.topology).unwrap());
    let host = ferry_core::host::CoreHost::new(config.plugin_settings(None), Some(topology))
        .for_engine(
            "forger:1",
            ferry_core::control::Link::new(
                Duration::from_secs(5),
                Duration::from_secs(10),
                ferry_tests::user_token(),
            ),
            Default::default(),
        );
    let set = ferry_core::load_plugins(&config.loader, host);
    let plugin = set
        .enabled(ferry_core::loader::PluginKind::Transport)
        .find(|p| p.report.name == "rdma")
        .expect("rdma enabled");
    let rec = Arc::new(Recorder::default());
    let raw = Arc::new(
        Transport::init(plugin, "forger:1", "127.0.0.1", rec.clone())
            .unwrap()
            .unwrap(),
    );
    let peer = raw
        .connect(&t.segment, sys::FERRY_SCOPE_SAME_HOST, &endpoint)
        .unwrap();
    let junk = vec![0xeeu8; 64 << 10];
    let (handle, _) = raw
        .register(&RegionSpec {
            addr: junk.as_ptr() as u64,
            len: junk.len() as u64,
            mem_kind: sys::FERRY_MEM_HOST,
            location: "cpu:0",
            numa_node: Some(0),
            device_ordinal: None,
            dmabuf: None,
            local_only: false,
            share: None,
        })
        .unwrap();
    let request = |op: u32, remote_addr: u64, length: u64, key: &[u8], token: u64| {
        sys::ferry_transfer_request_t {
            op,
            reserved: 0,
            local_addr: junk.as_ptr() as u64,
            local_mem: handle,
            remote_addr,
            length,
            remote_key: key.as_ptr(),
            remote_key_len: key.len(),
            token,
        }
    };
    let (kaddr, klen, rkeys, rest) = split_key(&key);
    assert_eq!((kaddr, klen), (raddr, rlen));

    // 1. Every rkey wrong: the target's NIC refuses, the initiator hears it.
    let bad: Vec<(u8, u32)> = rkeys.iter().map(|(n, r)| (*n, r ^ 0x0101_0101)).collect();
    let forged = join_key(kaddr, klen, &bad, &rest);
    raw.submit(
        &peer,
        &[request(sys::FERRY_OP_WRITE, raddr, 64 << 10, &forged, 1)],
    )
    .unwrap();
    let e1 = wait_for(&raw, &rec, 1).unwrap_err();
    assert_eq!(e1.code, ErrorCode::OutOfBounds, "{e1}");
    assert!(e1.message.contains("IBV_WC_REM_ACCESS_ERR"), "{e1}");

    // 2. A key claiming more than was registered: the NIC checks the range.
    let long = join_key(kaddr, klen * 2, &rkeys, &rest);
    raw.submit(
        &peer,
        &[request(
            sys::FERRY_OP_WRITE,
            raddr + rlen - 4096,
            8192,
            &long,
            2,
        )],
    )
    .unwrap();
    let e2 = wait_for(&raw, &rec, 2).unwrap_err();
    assert_eq!(e2.code, ErrorCode::OutOfBounds, "{e2}");
    raw.submit(
        &peer,
        &[request(sys::FERRY_OP_READ, raddr + rlen, 4096, &long, 3)],
    )
    .unwrap();
    assert_eq!(
        wait_for(&raw, &rec, 3).unwrap_err().code,
        ErrorCode::OutOfBounds
    );

    // 3. Outside the key it was given: refused before anything is posted.
    let err = raw
        .submit(
            &peer,
            &[request(
                sys::FERRY_OP_WRITE,
                raddr + rlen - 4096,
                8192,
                &key,
                4,
            )],
        )
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds, "{err}");
    let err = raw
        .submit(
            &peer,
            &[request(
                sys::FERRY_OP_WRITE,
                raddr,
                4096,
                b"FRK1 garbage",
                5,
            )],
        )
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Protocol, "{err}");

    // The target is unharmed: every byte as written, and it still serves.
    e.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg,
        raddr,
        rlen,
    )])
    .unwrap();
    assert!(back == known, "the target's memory is untouched");
    raw.submit(
        &peer,
        &[request(sys::FERRY_OP_WRITE, raddr, 64 << 10, &key, 6)],
    )
    .unwrap();
    wait_for(&raw, &rec, 6).unwrap();
    e.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg,
        raddr,
        64 << 10,
    )])
    .unwrap();
    assert!(back[..64 << 10].iter().all(|b| *b == 0xee));
    drop(peer);
    raw.unregister(handle).unwrap();
}

#[test]
fn notifications_arrive_after_their_data_over_rdma() {
    child("child_notify", &[]);
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_notify() {
    if !in_child() {
        return;
    }
    let target = engine(&[]);
    let initiator = engine(&[]);
    let shape = Shape {
        batches: 48,
        per_batch: 4,
        size: 256 << 10,
        register_source: true,
    };
    let remote = vec![0u8; shape.bytes() as usize];
    let raddr = remote.as_ptr() as u64;
    target.register_memory(raddr, shape.bytes(), None).unwrap();
    let read = |addr: u64, len: usize| {
        let mut out = vec![0u8; len];
        // SAFETY: [addr, +len) lies inside `remote`, alive for the check.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
        out
    };
    let n = notifications_follow_their_data(&target, &initiator, raddr, &read, shape);
    assert_eq!(n, shape.batches);
    // rdma needs local memory registered, and says so.
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let loose = vec![1u8; 4096];
    let e = initiator
        .transfer_sync(&[Request::new(
            Op::Write,
            loose.as_ptr() as u64,
            seg,
            raddr,
            4096,
        )])
        .unwrap_err();
    assert!(e.message.contains("register_memory first"), "{e}");
    assert!(e.message.contains("rdma"), "{e}");
    drop(remote);
}

#[test]
fn registering_the_same_memory_again_fails_nothing_after_it() {
    child("child_register_again", &[]);
}

/// vLLM's sleep and wake-up over RDMA: the target deregisters its memory
/// region and registers the same addresses again (new rkeys) with writes in
/// flight; the initiator reads the new keys and retries, so nothing
/// submitted after a re-registration fails.
#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_register_again() {
    if !in_child() {
        return;
    }
    let target = engine(&[]);
    let initiator = Arc::new(engine(&[]));
    let seen = ferry_tests::reregister::register_again_under_load(&target, &initiator, 8);
    assert_eq!(seen.swaps, 8);
}

#[test]
fn a_vanished_peer_fails_its_requests_without_hanging() {
    child("child_vanished_peer", &[]);
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_vanished_peer() {
    if !in_child() {
        return;
    }
    let mut t = target(&["--buffer-size", "4M"], &[]);
    let healthy = target(&["--buffer-size", "4M"], &[]);
    let e = engine(&[("timeout_ms", "3000")]);
    let seg = e.open_segment(&t.segment).unwrap();
    let other = e.open_segment(&healthy.segment).unwrap();
    let (raddr, _) = remote(&e, seg);
    let (oaddr, _) = remote(&e, other);
    let local = pattern(4 << 20, 5);
    e.register_memory(local.as_ptr() as u64, 4 << 20, None)
        .unwrap();
    let write = |s, a| Request::new(Op::Write, local.as_ptr() as u64, s, a, 4 << 20);
    e.transfer_sync(&[write(seg, raddr)]).unwrap();
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let err = e.transfer_sync(&[write(seg, raddr)]).unwrap_err();
    assert!(
        matches!(err.code, ErrorCode::Connection | ErrorCode::Timeout),
        "{err}"
    );
    // Other peers are not affected.
    e.transfer_sync(&[write(other, oaddr)]).unwrap();
}

#[test]
fn gpu_memory_is_registered_by_dmabuf_and_moved_directly() {
    child(
        "child_gpu_dmabuf",
        &[
            ("FERRY_FAKEGPU_DEVICES", "2"),
            ("FERRY_FAKEGPU_PCI", "0000:1b:00.0,0000:43:00.0"),
            ("FERRY_PLUGIN_PATH", fake_gpu_dir().to_str().unwrap()),
        ],
    );
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_gpu_dmabuf() {
    if !in_child() {
        return;
    }
    capture_logs();
    // Both ends hold GPU memory on cuda:1, whose PCIe switch holds mlx5_3.
    let t = target(&["--buffer-size", "16M", "--device", "cuda:1"], &[]);
    let e = engine(&[]);
    assert_eq!(e.gpus().len(), 2);
    let seg = e.open_segment(&t.segment).unwrap();
    let d = e.descriptor_of(seg).unwrap();
    assert_eq!(d.buffers[0].location, "cuda:1");
    assert!(
        d.buffers[0].key("rdma").is_some(),
        "the target registered it directly"
    );
    let (raddr, rlen) = (d.buffers[0].addr, d.buffers[0].len);
    let gpu = e.allocate_device(Location::Cuda(1), rlen).unwrap();
    let gpu2 = e.allocate_device(Location::Cuda(1), rlen).unwrap();
    e.register_memory(gpu, rlen, None).unwrap();
    e.register_memory(gpu2, rlen, None).unwrap();
    assert_eq!(
        e.registrations(gpu).unwrap(),
        vec![("rdma".to_string(), "cuda-dmabuf".to_string())]
    );
    let host = pattern(rlen as usize, 11);
    // SAFETY: host is a live Vec of rlen bytes; gpu is device memory.
    unsafe { e.copy_memory(gpu, host.as_ptr() as u64, rlen) }.unwrap();
    let route = e.route(seg, gpu, raddr, rlen).unwrap();
    assert_eq!(route.transport, "rdma");
    assert!(
        route.reason.contains("registered as cuda-dmabuf") && !route.reason.contains("staged"),
        "{}",
        route.reason
    );
    e.transfer_sync(&[Request::new(Op::Write, gpu, seg, raddr, rlen)])
        .unwrap();
    e.transfer_sync(&[Request::new(Op::Read, gpu2, seg, raddr, rlen)])
        .unwrap();
    let mut back = vec![0u8; rlen as usize];
    // SAFETY: back is a live Vec of rlen bytes; gpu2 is device memory.
    unsafe { e.copy_memory(back.as_mut_ptr() as u64, gpu2, rlen) }.unwrap();
    assert!(back == host, "GPU -> GPU -> GPU by DMA-BUF, every byte");
    assert_eq!(
        used(&carried(&e, seg, gpu, raddr)),
        names(&["mlx5_3"]),
        "the NIC on cuda:1's switch"
    );
    let logs = logs();
    assert!(
        logs.contains("rdma: cuda:1 memory is registered by DMA-BUF (trial registration succeeded"),
        "{logs}"
    );
}

#[test]
fn a_refused_dmabuf_registration_falls_back_to_peermem_then_staging() {
    child(
        "child_gpu_fallback",
        &[
            ("FERRY_FAKEGPU_DMABUF_FD", "pipe"),
            ("FERRY_PLUGIN_PATH", fake_gpu_dir().to_str().unwrap()),
            ("FERRY_SYSFS_ROOT", emu().sysfs_peermem.to_str().unwrap()),
        ],
    );
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_gpu_fallback() {
    if !in_child() {
        return;
    }
    capture_logs();
    let t = target(&["--buffer-size", "16M"], &[]);
    let e = engine(&[]);
    let gpu = e.allocate_device(Location::Cuda(0), 16 * MIB).unwrap();
    e.register_memory(gpu, 16 * MIB, None).unwrap();
    // DMA-BUF was chosen (the GPU, libibverbs and the NICs say yes), the
    // trial registration failed (the exported fd is no dma-buf), so did
    // nvidia-peermem (the NIC cannot pin this memory): staged.
    assert!(e.registrations(gpu).unwrap().is_empty());
    let logs = logs();
    assert!(
        logs.contains("registering cuda:0 memory by DMA-BUF failed")
            && logs.contains("falling back to nvidia-peermem"),
        "{logs}"
    );
    assert!(
        logs.contains("registering cuda:0 memory by nvidia-peermem failed")
            && logs.contains("falling back to staging through pinned host memory"),
        "{logs}"
    );
    let seg = e.open_segment(&t.segment).unwrap();
    let (raddr, _) = remote(&e, seg);
    let host = pattern(16 << 20, 13);
    // SAFETY: host is a live Vec; gpu is device memory of that size.
    unsafe { e.copy_memory(gpu, host.as_ptr() as u64, 16 * MIB) }.unwrap();
    let route = e.route(seg, gpu, raddr, 16 * MIB).unwrap();
    assert!(route.reason.contains("staged"), "{}", route.reason);
    e.transfer_sync(&[Request::new(Op::Write, gpu, seg, raddr, 16 * MIB)])
        .unwrap();
    let mut back = vec![0u8; 16 << 20];
    e.register_memory(back.as_mut_ptr() as u64, 16 * MIB, None)
        .unwrap();
    e.transfer_sync(&[Request::new(
        Op::Read,
        back.as_mut_ptr() as u64,
        seg,
        raddr,
        16 * MIB,
    )])
    .unwrap();
    assert!(back == host, "staged over rdma, every byte");
}

#[test]
fn roce_nics_are_addressed_by_gid_with_a_sensible_overridable_index() {
    // The DGX's two Ethernet ports (mlx5_1, mlx5_2 on the fixture's NUMA
    // node 0), as RoCE with a v1, a v2 link-local and a v2 IPv4 GID each.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("roce.conf");
    let mut text = String::new();
    for (name, pci, n) in [("mlx5_1", "0000:29:00.0", 7), ("mlx5_2", "0000:29:00.1", 8)] {
        text.push_str(&format!(
            "[{name}]\npci = {pci}\nport1.link_layer = Ethernet\nport1.speed = HDR\n\
             port1.gid0 = fe80::a:{n} RoCEv1\nport1.gid1 = fe80::a:{n} RoCEv2\n\
             port1.gid3 = ::ffff:10.0.0.{n} RoCEv2\n\n"
        ));
    }
    std::fs::write(&conf, text).unwrap();
    child(
        "child_roce",
        &[("FERRY_VERBS_EMU_CONFIG", conf.to_str().unwrap())],
    );
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_roce() {
    if !in_child() {
        return;
    }
    capture_logs();
    let t = target(&["--buffer-size", "8M"], &[]);
    for gid_index in [None, Some("1")] {
        let e = match gid_index {
            None => engine(&[]),
            Some(i) => engine(&[("rdma.gid_index", i)]),
        };
        let seg = e.open_segment(&t.segment).unwrap();
        let (raddr, rlen) = remote(&e, seg);
        let (src, _back) = round_trip(&e, seg, raddr, rlen, 21, None, "RoCE round trip");
        assert_eq!(
            used(&carried(&e, seg, src.as_ptr() as u64, raddr)),
            names(&["mlx5_1", "mlx5_2"])
        );
    }
    let logs = logs();
    // By default the RoCE v2 GID holding an IPv4 address; the setting wins.
    assert!(logs.contains("mlx5_1 (RoCE port 1, GID 3"), "{logs}");
    assert!(logs.contains("mlx5_1 (RoCE port 1, GID 1"), "{logs}");
}

#[test]
fn hostile_plugin_messages_are_refused_and_the_target_keeps_serving() {
    child("child_hostile_messages", &[]);
}

#[test]
#[ignore = "runs in a child process with the verbs emulator (see child())"]
fn child_hostile_messages() {
    if !in_child() {
        return;
    }
    let t = target(&["--buffer-size", "4M"], &[]);
    let send = |body: &[u8]| {
        ferry_core::control::plugin_request(
            &t.segment,
            "rdma",
            "evil:1",
            body,
            &ferry_core::control::Link::new(
                Duration::from_secs(5),
                Duration::from_secs(10),
                ferry_tests::user_token(),
            ),
        )
    };
    let gid = "fe80000000000000b83fd20300a10000";
    let qp = |qpn: u64, to: &str| {
        format!(r#"{{"nic":"x","qpn":{qpn},"lid":1,"gid":"{gid}","mtu":5,"to":"{to}"}}"#)
    };
    for body in [
        "".to_string(),
        "{".to_string(),
        "\u{0}\u{1}".to_string(),
        r#"{"op":"connect"}"#.to_string(),
        r#"{"op":"connect","engine":"e","qps":[]}"#.to_string(),
        format!(
            r#"{{"op":"connect","engine":"../x","qps":[{}]}}"#,
            qp(5, "mlx5_0")
        ),
        format!(
            r#"{{"op":"connect","engine":"e","qps":[{}]}}"#,
            qp(0, "mlx5_0")
        ),
        format!(
            r#"{{"op":"connect","engine":"e","qps":[{}]}}"#,
            qp(1 << 24, "mlx5_0")
        ),
        format!(
            r#"{{"op":"connect","engine":"e","qps":[{}]}}"#,
            qp(u64::MAX, "mlx5_0")
        ),
        format!(
            r#"{{"op":"connect","engine":"e","qps":[{}]}}"#,
            vec![qp(7, "mlx5_0"); 65].join(",")
        ),
        r#"{"op":"drop_tables"}"#.to_string(),
        "x".repeat(60_000),
    ] {
        let e = send(body.as_bytes()).unwrap_err();
        assert_eq!(e.code, ErrorCode::Protocol, "{body:.80}: {e}");
    }
    // Well formed, but for a NIC the target does not have: answered per
    // queue pair, nothing created.
    let reply = send(
        format!(
            r#"{{"op":"connect","engine":"e","qps":[{}]}}"#,
            qp(9, "mlx5_99")
        )
        .as_bytes(),
    )
    .unwrap();
    let text = String::from_utf8_lossy(&reply);
    assert!(text.contains("no RDMA NIC mlx5_99"), "{text}");
    // An unknown transport at the peer.
    let e = ferry_core::control::plugin_request(
        &t.segment,
        "nope",
        "evil:1",
        b"{}",
        &ferry_core::control::Link::new(
            Duration::from_secs(5),
            Duration::from_secs(10),
            ferry_tests::user_token(),
        ),
    )
    .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    // The target still serves.
    let eng = engine(&[]);
    let seg = eng.open_segment(&t.segment).unwrap();
    let (raddr, _) = remote(&eng, seg);
    round_trip(
        &eng,
        seg,
        raddr,
        1 << 20,
        4,
        None,
        "served after hostile messages",
    );
}

fn info(env: &[(String, String)]) -> (String, serde_json::Value) {
    let text = Command::new(ferry_bin())
        .arg("info")
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    assert!(text.status.success());
    let json = Command::new(ferry_bin())
        .args(["info", "--json"])
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&text.stdout).into_owned(),
        serde_json::from_slice(&json.stdout).unwrap(),
    )
}

fn rdma_plugin(json: &serde_json::Value) -> serde_json::Value {
    json["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "rdma")
        .cloned()
        .expect("the rdma plugin is listed")
}

#[test]
fn ferry_info_shows_rdma_and_both_gpu_methods_with_reasons() {
    let fabric = tempfile::tempdir().unwrap();
    let env = emu_env(fabric.path());
    let (text, json) = info(&env);
    let p = rdma_plugin(&json);
    assert_eq!(p["state"], "enabled", "{text}");
    assert_eq!(p["devices"].as_array().unwrap().len(), 8, "{text}");
    assert!(
        text.contains("memory cuda-dmabuf: available: ibv_reg_dmabuf_mr is taken by mlx5_0"),
        "{text}"
    );
    assert!(
        text.contains("memory cuda-peermem: unavailable: nvidia-peermem is not loaded"),
        "{text}"
    );
    assert!(
        text.contains("transport for GPU memory: rdma (cuda-dmabuf)"),
        "{text}"
    );

    // A GPU (the fake one) next to these NICs: DMA-BUF, nothing skipped.
    let mut with_gpu = env.clone();
    with_gpu.push((
        "FERRY_PLUGIN_PATH".into(),
        fake_gpu_dir().display().to_string(),
    ));
    let (text, json) = info(&with_gpu);
    let g0 = &json["gpus"][0];
    assert_eq!(g0["registration"]["method"], "DMA-BUF", "{text}");
    assert_eq!(g0["nearest_nics"][0]["name"], "mlx5_0", "{text}");

    // With nvidia-peermem loaded, both methods are on.
    let mut with_peermem = env.clone();
    with_peermem.push((
        "FERRY_SYSFS_ROOT".into(),
        emu().sysfs_peermem.display().to_string(),
    ));
    let (text, _) = info(&with_peermem);
    assert!(
        text.contains("memory cuda-peermem: available: nvidia-peermem is loaded"),
        "{text}"
    );

    // A host whose kernel has no RDMA: libibverbs loads, lists nothing.
    let mut no_kernel = env.clone();
    no_kernel.push(("FERRY_VERBS_EMU_FAULTS".into(), "no_uverbs".into()));
    let (text, json) = info(&no_kernel);
    let p = rdma_plugin(&json);
    assert_eq!(p["state"], "disabled");
    assert!(
        p["reason"]
            .as_str()
            .unwrap()
            .starts_with("libibverbs loads, but there is no RDMA device"),
        "{text}"
    );
    assert!(
        text.contains("memory cuda-dmabuf: unavailable: no RDMA device"),
        "{text}"
    );
    assert!(
        text.contains("transport for GPU memory: none: the rdma transport is disabled"),
        "{text}"
    );

    // The emulator with no NIC configured.
    let mut none: Vec<(String, String)> = env
        .iter()
        .filter(|(k, _)| k != "FERRY_VERBS_EMU_CONFIG")
        .cloned()
        .collect();
    none.push(("FERRY_VERBS_EMU_CONFIG".into(), "/nonexistent".into()));
    let (text, json) = info(&none);
    assert_eq!(rdma_plugin(&json)["state"], "disabled", "{text}");
}

#[test]
fn ferry_info_without_the_emulator_says_why_rdma_is_off() {
    // This host's own libibverbs (if any): no RDMA device here.
    let (text, json) = info(&[]);
    let p = rdma_plugin(&json);
    assert_eq!(p["state"], "disabled", "{text}");
    let reason = p["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("libibverbs.so.1 not found")
            || reason.starts_with("libibverbs loads, but"),
        "{reason}"
    );
}

#[test]
fn the_plugin_does_not_link_libibverbs() {
    let so = built("libferry_transport_rdma.so");
    let out = Command::new("readelf").arg("-d").arg(&so).output();
    let Ok(out) = out else {
        eprintln!("readelf not found; skipped");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("NEEDED"), "{text}");
    assert!(!text.contains("libibverbs"), "{text}");
}
