//! A soak run: mixed writes and reads with verification between two engines
//! in two processes, for a fixed time, reporting throughput over time and
//! both processes' memory (RSS). `scripts/soak.sh` runs it (not in CI).
//!
//!     ferry-soak [--duration S] [--interval S] [--transport tcp|shm]
//!                [--threads N] [--region BYTES]
//!
//! The driver starts itself again as the target (`ferry-soak target BYTES
//! ALLOCATE`), a separate process serving one buffer, which also answers
//! `hash ADDR LEN` on stdin with a hash of its own memory there.
//!
//! Each initiator thread owns a slice of the target's buffer. A round picks
//! a block size (4 KiB to 4 MiB), writes a batch of blocks into random
//! distinct slots of its slice from a random offset of a large random
//! source buffer, then reads the same slots back into another buffer and
//! compares: every write that reported success is read back and verified.
//! About once a second thread 0 also asks the target to hash one slot it
//! wrote, in the target's own memory, and compares with the source. Any
//! failed batch or mismatch is counted; the run fails unless there are none.

use ferry_core::{Engine, EngineConfig, Op, Request};
use std::hash::Hasher;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BLOCKS: [u64; 5] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
const BATCH: u64 = 16;
/// Source data: writes take their bytes from random offsets of this.
const SOURCE_LEN: usize = 64 << 20;

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("ferry-soak: {msg}");
    std::process::exit(1);
}

fn hash(bytes: &[u8]) -> u64 {
    // SipHash with fixed keys: the same in both processes of one build.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    h.write(bytes);
    h.finish()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// An anonymous mapping (zeroed), freed on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain memory region; threads coordinate through the engine.
unsafe impl Send for Mapping {}
// SAFETY: &Mapping exposes only the pointer and length; threads write
// disjoint ranges through the engine, never through Rust references.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> Mapping {
        // SAFETY: a fresh anonymous mapping, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            die(format!("cannot map {len} bytes"));
        }
        Mapping {
            ptr: ptr.cast(),
            len,
        }
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn target(len: u64, allocate: bool) {
    let config = EngineConfig::from_env().unwrap_or_else(|e| die(e));
    let engine = Engine::new(config).unwrap_or_else(|e| die(e));
    let mapping;
    let addr = if allocate {
        engine.allocate_memory(len, None).unwrap_or_else(|e| die(e))
    } else {
        mapping = Mapping::new(len as usize);
        // Touch every page, so RSS at start includes the buffer.
        // SAFETY: our own mapping of `len` bytes.
        unsafe { std::ptr::write_bytes(mapping.ptr, 0, len as usize) };
        engine
            .register_memory(mapping.addr(), len, None)
            .unwrap_or_else(|e| die(e));
        mapping.addr()
    };
    println!("segment {} {addr} {len}", engine.segment_name());
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        match (line.split_whitespace().next(), w.as_slice()) {
            (Some("hash"), [a, l]) if *a >= addr && a + l <= addr + len => {
                // SAFETY: inside our registered buffer; the initiator does not
                // write this range while it asks.
                let bytes = unsafe { std::slice::from_raw_parts(*a as *const u8, *l as usize) };
                println!("hash {}", hash(bytes));
            }
            (Some("quit"), _) => break,
            _ => println!("error {line:?}"),
        }
        let _ = std::io::stdout().flush();
    }
}

struct Totals {
    moved: AtomicU64,
    verified: AtomicU64,
    ops: AtomicU64,
    errors: AtomicU64,
    mismatches: AtomicU64,
    target_checks: AtomicU64,
}

struct TargetLink {
    stdin: ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
}

impl TargetLink {
    fn hash(&mut self, addr: u64, len: u64) -> Option<u64> {
        writeln!(self.stdin, "hash {addr} {len}").ok()?;
        self.stdin.flush().ok()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).ok()?;
        line.trim().strip_prefix("hash ")?.parse().ok()
    }
}

#[allow(clippy::too_many_arguments)]
fn worker(
    t: u64,
    engine: Arc<Engine>,
    seg: u64,
    remote: u64,
    region: u64,
    source: Arc<Mapping>,
    totals: Arc<Totals>,
    stop: Arc<AtomicBool>,
    link: Option<Arc<Mutex<TargetLink>>>,
    back: Arc<Mapping>,
) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let timeout = engine.config().timeout * 2;
    let mut last_check = Instant::now();
    // SAFETY: the source is filled before the workers start and never
    // written again.
    let src = unsafe { std::slice::from_raw_parts(source.ptr, source.len) };
    while !stop.load(Ordering::Relaxed) {
        let block = BLOCKS[rng.below(BLOCKS.len() as u64) as usize];
        let slots = region / block;
        let n = BATCH.min(slots);
        // Distinct slots: a random start and stride coprime to `slots`
        // would do; simplest is a random start, consecutive slots spaced.
        let start = rng.below(slots);
        let spacing = (slots / n).max(1);
        let picks: Vec<u64> = (0..n).map(|i| (start + i * spacing) % slots).collect();
        let offsets: Vec<u64> = (0..n)
            .map(|_| rng.below((SOURCE_LEN as u64 - block) / 64) * 64)
            .collect();
        let writes: Vec<Request> = picks
            .iter()
            .zip(&offsets)
            .map(|(s, o)| {
                Request::new(Op::Write, source.addr() + o, seg, remote + s * block, block)
            })
            .collect();
        let bytes = n * block;
        if let Err(e) = run(&engine, &writes, timeout) {
            totals.errors.fetch_add(1, Ordering::Relaxed);
            eprintln!("write batch failed: {e}");
            continue;
        }
        totals.moved.fetch_add(bytes, Ordering::Relaxed);
        totals.ops.fetch_add(n, Ordering::Relaxed);
        let reads: Vec<Request> = picks
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Request::new(
                    Op::Read,
                    back.addr() + i as u64 * block,
                    seg,
                    remote + s * block,
                    block,
                )
            })
            .collect();
        if let Err(e) = run(&engine, &reads, timeout) {
            totals.errors.fetch_add(1, Ordering::Relaxed);
            eprintln!("read batch failed: {e}");
            continue;
        }
        totals.moved.fetch_add(bytes, Ordering::Relaxed);
        totals.ops.fetch_add(n, Ordering::Relaxed);
        // SAFETY: no transfer into `back` is in flight now.
        let got = unsafe { std::slice::from_raw_parts(back.ptr, bytes as usize) };
        for (i, o) in offsets.iter().enumerate() {
            let b = block as usize;
            if got[i * b..(i + 1) * b] != src[*o as usize..*o as usize + b] {
                totals.mismatches.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "MISMATCH: thread {t}, slot {} of {block} bytes read back differs",
                    picks[i]
                );
            } else {
                totals.verified.fetch_add(block, Ordering::Relaxed);
            }
        }
        if let Some(link) = &link {
            if last_check.elapsed() >= Duration::from_secs(1) {
                last_check = Instant::now();
                let (s, o) = (picks[0], offsets[0] as usize);
                let want = hash(&src[o..o + block as usize]);
                let got = link
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .hash(remote + s * block, block);
                if got == Some(want) {
                    totals.target_checks.fetch_add(1, Ordering::Relaxed);
                } else {
                    totals.mismatches.fetch_add(1, Ordering::Relaxed);
                    eprintln!("MISMATCH at the target: slot {s} of {block} bytes ({got:?})");
                }
            }
        }
    }
}

fn run(engine: &Engine, reqs: &[Request], timeout: Duration) -> Result<(), String> {
    let batch = engine
        .allocate_batch(reqs.len())
        .map_err(|e| e.to_string())?;
    let status = engine
        .submit(batch, reqs)
        .and_then(|_| engine.wait(batch, timeout));
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            let _ = engine.wait(batch, timeout);
            let _ = engine.free_batch(batch);
            return Err(e.to_string());
        }
    };
    if !status.is_done() {
        return Err(format!(
            "{} requests pending after {timeout:?}",
            status.pending
        ));
    }
    let _ = engine.free_batch(batch);
    match status.first_error {
        Some((i, e)) => Err(format!("request {i}: {e}")),
        None => Ok(()),
    }
}

fn main() {
    ferry_core::init_logging();
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("target") {
        let len = args
            .get(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(256 << 20);
        target(len, args.get(3).map(String::as_str) == Some("allocate"));
        return;
    }
    let mut duration = 600.0f64;
    let mut interval = 10.0f64;
    let mut transport = "tcp".to_string();
    let mut threads = 2u64;
    let mut region: u64 = 64 << 20;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .unwrap_or_else(|| die(format!("{a} needs a value")))
        };
        match a.as_str() {
            "--duration" => duration = val().parse().unwrap_or_else(|e| die(e)),
            "--interval" => interval = val().parse().unwrap_or_else(|e| die(e)),
            "--transport" => transport = val(),
            "--threads" => threads = val().parse().unwrap_or_else(|e| die(e)),
            "--region" => region = val().parse().unwrap_or_else(|e| die(e)),
            other => die(format!("unknown argument {other}")),
        }
    }
    if region < BLOCKS[BLOCKS.len() - 1] * BATCH || threads == 0 {
        die("--region must hold 16 blocks of 4 MiB and --threads be positive");
    }
    let total = region * threads;
    let exe = std::env::current_exe().unwrap_or_else(|e| die(e));
    let mut child: Child = Command::new(exe)
        .args(["target", &total.to_string()])
        .arg(if transport == "shm" {
            "allocate"
        } else {
            "plain"
        })
        .env("FERRY_TRANSPORTS", &transport)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| die(format!("cannot start the target: {e}")));
    let mut stdout = BufReader::new(child.stdout.take().unwrap_or_else(|| die("no stdout")));
    let mut line = String::new();
    stdout
        .read_line(&mut line)
        .unwrap_or_else(|e| die(format!("the target said nothing: {e}")));
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (segment, remote) = match parts.as_slice() {
        ["segment", name, addr, _] => (name.to_string(), addr.parse::<u64>().unwrap_or(0)),
        _ => die(format!("the target said {line:?}")),
    };
    let link = Arc::new(Mutex::new(TargetLink {
        stdin: child.stdin.take().unwrap_or_else(|| die("no stdin")),
        stdout,
    }));
    let mut config = EngineConfig::from_env().unwrap_or_else(|e| die(e));
    config
        .set("transports", &transport)
        .unwrap_or_else(|e| die(e));
    let engine = Arc::new(Engine::new(config).unwrap_or_else(|e| die(e)));
    let seg = engine.open_segment(&segment).unwrap_or_else(|e| die(e));
    let source = Arc::new(Mapping::new(SOURCE_LEN));
    {
        let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
        // SAFETY: our own mapping, not yet shared.
        let s = unsafe { std::slice::from_raw_parts_mut(source.ptr, SOURCE_LEN) };
        for c in s.chunks_exact_mut(8) {
            c.copy_from_slice(&rng.next().to_le_bytes());
        }
    }
    engine
        .register_memory(source.addr(), SOURCE_LEN as u64, None)
        .unwrap_or_else(|e| die(e));
    let route = engine
        .route(seg, source.addr(), remote, 4096)
        .unwrap_or_else(|e| die(e));
    // Each thread reads back into a buffer of its own, registered now so
    // that RSS at start includes every buffer.
    let backs: Vec<Arc<Mapping>> = (0..threads)
        .map(|_| {
            let b = Mapping::new((BATCH * BLOCKS[BLOCKS.len() - 1]) as usize);
            // SAFETY: our own mapping; touch its pages.
            unsafe { std::ptr::write_bytes(b.ptr, 0, b.len) };
            engine
                .register_memory(b.addr(), b.len as u64, None)
                .unwrap_or_else(|e| die(e));
            Arc::new(b)
        })
        .collect();
    let (me, them) = (std::process::id(), child.id());
    let rss_start = (rss_kib(me), rss_kib(them));
    println!(
        "soak: {transport} ({}), {threads} threads, {} MiB of target memory, blocks 4 KiB..4 MiB \
         x {BATCH} per batch, {duration} s",
        route.reason,
        total >> 20
    );
    println!(
        "RSS at start: initiator {} KiB, target {} KiB",
        rss_start.0, rss_start.1
    );
    let totals = Arc::new(Totals {
        moved: AtomicU64::new(0),
        verified: AtomicU64::new(0),
        ops: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        mismatches: AtomicU64::new(0),
        target_checks: AtomicU64::new(0),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (engine, source, totals, stop) =
                (engine.clone(), source.clone(), totals.clone(), stop.clone());
            let link = (t == 0).then(|| link.clone());
            let back = backs[t as usize].clone();
            std::thread::spawn(move || {
                worker(
                    t,
                    engine,
                    seg,
                    remote + t * region,
                    region,
                    source,
                    totals,
                    stop,
                    link,
                    back,
                )
            })
        })
        .collect();
    println!(
        "  elapsed_s   GB_moved  GB/s(interval)        ops  errors  rss_init_KiB  rss_target_KiB"
    );
    let mut last = (Instant::now(), 0u64);
    let mut next = interval;
    let mut rss_first: Option<(u64, u64)> = None;
    let mut rss_end = rss_start;
    while started.elapsed().as_secs_f64() < duration {
        std::thread::sleep(Duration::from_millis(100));
        let e = started.elapsed().as_secs_f64();
        if e >= next || e >= duration {
            next += interval;
            let moved = totals.moved.load(Ordering::Relaxed);
            let dt = last.0.elapsed().as_secs_f64();
            rss_end = (rss_kib(me), rss_kib(them));
            rss_first.get_or_insert(rss_end);
            println!(
                "  {e:9.1} {:10.2} {:15.3} {:10} {:7} {:13} {:15}",
                moved as f64 / 1e9,
                (moved - last.1) as f64 / dt / 1e9,
                totals.ops.load(Ordering::Relaxed),
                totals.errors.load(Ordering::Relaxed) + totals.mismatches.load(Ordering::Relaxed),
                rss_end.0,
                rss_end.1
            );
            let _ = std::io::stdout().flush();
            last = (Instant::now(), moved);
        }
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        let _ = w.join();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let rss_first = rss_first.unwrap_or(rss_end);
    let moved = totals.moved.load(Ordering::Relaxed);
    let verified = totals.verified.load(Ordering::Relaxed);
    let errors = totals.errors.load(Ordering::Relaxed);
    let mismatches = totals.mismatches.load(Ordering::Relaxed);
    println!(
        "RSS at end (last report, still running): initiator {} KiB ({:+} KiB since start, \
         {:+} KiB since the first report), target {} KiB ({:+} KiB since start, {:+} KiB since \
         the first report)",
        rss_end.0,
        rss_end.0 as i64 - rss_start.0 as i64,
        rss_end.0 as i64 - rss_first.0 as i64,
        rss_end.1,
        rss_end.1 as i64 - rss_start.1 as i64,
        rss_end.1 as i64 - rss_first.1 as i64
    );
    println!(
        "total: {:.1} s, {moved} bytes moved ({:.2} GB, {:.3} GB/s), {verified} bytes written \
         and verified by read-back ({:.2} GB), {} checks in the target's memory, {} requests, \
         {errors} failed batches, {mismatches} mismatches",
        elapsed,
        moved as f64 / 1e9,
        moved as f64 / elapsed / 1e9,
        verified as f64 / 1e9,
        totals.target_checks.load(Ordering::Relaxed),
        totals.ops.load(Ordering::Relaxed),
    );
    if let Ok(mut l) = link.lock() {
        let _ = writeln!(l.stdin, "quit");
    }
    let _ = child.wait();
    for b in &backs {
        let _ = engine.unregister_memory(b.addr());
    }
    let _ = engine.unregister_memory(source.addr());
    if errors + mismatches > 0 {
        println!("FAILED");
        std::process::exit(1);
    }
    println!("OK: every write that reported success was read back intact");
}
