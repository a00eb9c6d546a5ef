//! Helpers for Ferry's cross-crate tests: where the built binaries and
//! plugins are, and how to compile C against Ferry's headers.
//!
//! These tests use what `cargo build --workspace` produced (the `ferry`
//! binary, plugin .so files); `scripts/test` builds it first.

pub mod etcd;
pub mod fuzz;
pub mod listeners;
pub mod node;
pub mod ordering;
pub mod reregister;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// The cargo profile directory the test binary runs from (target/debug).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary has a directory");
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps has a parent").to_path_buf()
    } else {
        deps.to_path_buf()
    }
}

/// A file `cargo build --workspace` produces, or a panic saying so.
pub fn built(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace` before the tests (scripts/test does)",
        path.display()
    );
    path
}

/// The `ferry` binary.
pub fn ferry_bin() -> PathBuf {
    built("ferry")
}

/// The directory holding ferry/plugin.h.
pub fn plugin_include_dir() -> PathBuf {
    repo_root().join("plugins-abi/include")
}

/// The system C compiler: $CC or cc.
pub fn c_compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// Compiles C sources into a shared object with the plugin header on the
/// include path, panicking with the compiler's output on failure.
pub fn compile_shared(sources: &[PathBuf], out: &Path, extra: &[&str]) {
    let mut cmd = Command::new(c_compiler());
    cmd.args([
        "-shared", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1",
    ])
    .arg("-I")
    .arg(plugin_include_dir())
    .arg("-o")
    .arg(out)
    .args(sources)
    .args(extra);
    let output = cmd.output().expect("run the C compiler (is cc installed?)");
    assert!(
        output.status.success(),
        "C compile of {:?} failed:\n{}",
        sources,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A `ferry bench target` in its own process, killed when dropped.
pub struct TargetProcess {
    pub child: Child,
    pub segment: String,
}

impl TargetProcess {
    /// Runs `ferry bench target <args>` (through `wrapper`, e.g. setpriv,
    /// when given) and waits for its `segment NAME` line.
    pub fn start(args: &[&str], envs: &[(&str, &str)], wrapper: &[&str]) -> TargetProcess {
        let mut cmd = match wrapper.split_first() {
            Some((w, rest)) => {
                let mut c = Command::new(w);
                c.args(rest).arg(ferry_bin());
                c
            }
            None => Command::new(ferry_bin()),
        };
        cmd.args(["bench", "target"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start ferry bench target");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the segment line");
        let segment = line
            .strip_prefix("segment ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .trim()
            .to_string();
        TargetProcess { child, segment }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// rdma-core's headers for building the verbs emulator: the system's
/// (libibverbs-dev), else the copy rdma-mummy-sys vendors in the cargo
/// registry.
pub fn verbs_include_dir() -> Option<PathBuf> {
    if Path::new("/usr/include/infiniband/verbs.h").exists() {
        return Some(PathBuf::from("/usr/include"));
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(home.join("registry/src"))
        .ok()?
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("rdma-mummy-sys-"))
        })
        .map(|p| p.join("rdma-core-mummy/include"))
        .filter(|p| p.join("infiniband/verbs.h").exists())
        .collect();
    found.sort();
    found.pop()
}

/// Builds tests/verbs-emulator (a test-only libibverbs.so.1) into `out`
/// with the C compiler, as its README shows; returns the library's path.
pub fn build_verbs_emulator(out: &Path) -> PathBuf {
    let src = repo_root().join("tests/verbs-emulator");
    let include = verbs_include_dir()
        .expect("no infiniband/verbs.h: apt-get install libibverbs-dev (scripts/test does)");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(src.join("src"))
        .expect("tests/verbs-emulator/src")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "c"))
        .collect();
    sources.sort();
    let lib = out.join("libibverbs.so.1");
    let output = Command::new(c_compiler())
        .args([
            "-std=gnu11",
            "-O1",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
        ])
        .arg(format!("-I{}", include.display()))
        .args(["-Wl,-soname,libibverbs.so.1"])
        .arg(format!(
            "-Wl,--version-script={}",
            src.join("libibverbs.map").display()
        ))
        .arg("-o")
        .arg(&lib)
        .args(&sources)
        .arg("-lpthread")
        .output()
        .expect("run the C compiler (is cc installed?)");
    assert!(
        output.status.success(),
        "building the verbs emulator failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    lib
}

/// Writes one of Ferry's fake sysfs trees (`ferry topology --write-fixture`).
pub fn write_fixture(name: &str, dir: &Path) {
    let out = Command::new(ferry_bin())
        .args(["topology", "--write-fixture", name])
        .arg(dir)
        .output()
        .expect("run ferry topology --write-fixture");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A real two-process transfer between the C examples (examples/c): starts
/// `target` (a command for target.c's binary, environment already set), runs
/// `initiator` (initiator.c's) against the segment it prints, and checks the
/// initiator's write, refused out-of-bounds request and read-back, and the
/// data at the target. Panics with both programs' output on any failure.
pub fn run_c_transfer(target: &mut Command, initiator: &mut Command) {
    let mut t = target
        .arg("8388608")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the C target");
    let mut lines = BufReader::new(t.stdout.take().expect("stdout")).lines();
    let first = lines
        .next()
        .expect("the target prints its segment")
        .expect("read the target's output");
    let parts: Vec<&str> = first.split_whitespace().collect();
    assert!(
        parts.len() == 4 && parts[0] == "SEGMENT",
        "target said {first:?}"
    );
    let out = initiator
        .args([parts[1], parts[2], parts[3]])
        .output()
        .expect("run the C initiator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "initiator failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("WROTE 8 requests"), "{stdout}");
    // The route the C API reports: the estimate and, after a batch of 1 MiB
    // hand-overs, what the engine measured.
    let route = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ROUTE "))
        .expect("the initiator prints its route");
    assert!(
        route.contains("\"estimate\":{") && route.contains("\"measured_bandwidth_mbps\":"),
        "{route}"
    );
    assert!(
        stdout.contains("OUT_OF_BOUNDS FERRY_ERR_OUT_OF_BOUNDS: "),
        "{stdout}"
    );
    assert!(stdout.trim_end().ends_with("OK"), "{stdout}");
    let local = stdout
        .lines()
        .find_map(|l| l.strip_prefix("LOCAL "))
        .expect("the initiator prints its checksum")
        .to_string();
    let stdin = t.stdin.as_mut().expect("stdin");
    writeln!(stdin, "checksum").expect("ask the target for its checksum");
    stdin.flush().expect("flush");
    let at_target = lines
        .next()
        .expect("the target answers")
        .expect("read the target's answer");
    assert_eq!(
        at_target,
        format!("CHECKSUM {local} NOTIFY initiator:written"),
        "data and the batch's notification at the target"
    );
    drop(t.stdin.take());
    assert!(t.wait().expect("wait for the target").success());
}

/// A plugin directory holding the fake GPU (tests/plugins/fakegpu) as the
/// "cuda" device plugin, shadowing the real one when searched first.
pub fn fake_gpu_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::copy(
        built("libferry_test_device_fakegpu.so"),
        dir.path().join("libferry_device_cuda.so"),
    )
    .expect("copy the fake GPU plugin");
    dir
}

/// The test data of processes that check each other's memory
/// (ferry-test-node, the fault suite): a xorshift stream from `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Why this process cannot run another as uid nobody (`setpriv`), or None
/// when it can: it must be root, and util-linux's setpriv installed. Tests
/// that need another user skip with this reason.
pub fn cannot_switch_user() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root to run a process as uid nobody (setpriv)");
    }
    if std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some("setpriv (util-linux) is not installed");
    }
    None
}

/// Why another user cannot load what `path` holds, if a folder on its way
/// is closed to others (a checkout under a private /root, as on a fresh
/// machine's root account): tests that run a process as uid nobody skip
/// then, saying so.
pub fn closed_to_others(path: &std::path::Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors().skip(1).find_map(|dir| {
        let mode = std::fs::metadata(dir).ok()?.permissions().mode();
        (mode & 0o001 == 0).then(|| {
            format!(
                "{} is closed to other users (mode {:o}): uid nobody cannot load {}",
                dir.display(),
                mode & 0o777,
                path.display()
            )
        })
    })
}

/// This test binary's ignored test `name`, to run alone in a child process
/// (the caller adds the child's environment); [`child_output`] runs it.
pub fn child_test(name: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    c
}

/// Runs a [`child_test`] command; its stdout and stderr, after failing
/// with them unless the child ran its one test and it passed.
pub fn child_output(mut cmd: Command, name: &str) -> String {
    let out = cmd.output().expect("run the child test");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {name} did not run:\n{text}"
    );
    text
}

/// This test binary's test `name`, run alone as uid and gid 65534 (nobody,
/// no groups) through setpriv: how the isolation tests play another user.
/// Callers check [`cannot_switch_user`] first.
pub fn as_nobody(name: &str) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
        "--",
    ])
    .arg(std::env::current_exe().unwrap())
    .args(["--exact", name, "--nocapture", "--test-threads", "1"]);
    c
}

/// The CUDA emulator (tests/cuda-emulator), a test-only libcuda.so.1,
/// compiled once per test process; its path.
pub fn cuda_emulator() -> &'static std::path::Path {
    static LIB: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    &LIB.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("libcuda.so.1");
        let src = repo_root().join("tests/cuda-emulator/libcuda.c");
        let o = std::process::Command::new(c_compiler())
            .args([
                "-shared",
                "-fPIC",
                "-std=gnu11",
                "-O1",
                "-Wall",
                "-Wextra",
                "-Werror",
            ])
            .args(["-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o"])
            .arg(&out)
            .arg(&src)
            .arg("-lpthread")
            .output()
            .expect("run the C compiler");
        assert!(
            o.status.success(),
            "building the CUDA emulator failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        (dir, out)
    })
    .1
}

/// A loopback TCP port free a moment ago, for a process that starts (or
/// restarts) on it later. It is taken from below the kernel's ephemeral
/// range, so a listener or connection that binds port 0 meanwhile, in this
/// process or another, is never handed the same port (that race once let
/// an engine's data listener take a planned etcd member's port).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(2048, 65535);
    let (first, span) = (1024u32, low - 1024);
    // Processes of one test run start at different places, then walk on.
    let seed = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let port = first + (seed + NEXT.fetch_add(7919, Ordering::Relaxed)) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free loopback port below {low}");
}

/// This user's token, as an engine with no token configured uses it (for
/// tests that speak the control protocol themselves).
pub fn user_token() -> Option<ferry_plugins_abi::sdk::auth::Token> {
    ferry_core::user_token::load_or_create()
        .ok()
        .map(|(t, _)| t)
}

/// A permutation of 0..n from a fixed seed (xorshift; no dependency for
/// shuffling): blocks in an order nothing coalesces by accident.
pub fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Builds the example C plugin (the vendor template, which moves host
/// memory between engines of one process) into a fresh directory.
pub fn memcpy_plugin_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    compile_shared(
        &[repo_root().join("examples/c-plugin/memcpy_transport.c")],
        &dir.path().join("libferry_transport_memcpy.so"),
        &["-lpthread"],
    );
    dir
}
