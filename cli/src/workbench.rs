//! What `ferry bench sweep` and `ferry bench metrics-overhead` share: a
//! target process, an initiator engine with its local buffer, a timed loop
//! of batches, and this machine's limits measured by child processes.

use crate::util::{percentile, Buffer};
use ferry_core::{Engine, EngineConfig, Op, Request, SegmentId};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `ferry bench target` in a child process, killed when dropped.
pub struct TargetChild {
    child: Child,
    pub segment: String,
}

impl TargetChild {
    pub fn start(buffer_size: u64) -> Result<TargetChild, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["bench", "target", "--allocate", "--buffer-size"])
            .arg(buffer_size.to_string())
            // The metrics endpoint is the initiator's to serve.
            .env_remove("FERRY_METRICS_LISTEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the target process: {e}"))?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("the target has no stdout")?;
        let _ = BufReader::new(stdout).read_line(&mut line);
        let segment = match line.strip_prefix("segment ") {
            Some(s) => s.trim().to_string(),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(
                    "the target process did not start (run `ferry bench target` to see why)".into(),
                );
            }
        };
        Ok(TargetChild { child, segment })
    }
}

impl Drop for TargetChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This machine's limit, from `ferry bench <mode> --json` in a child process.
pub fn machine_limit(mode: &str, args: &[&str]) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["bench", mode, "--json"])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("ferry bench {mode}: no JSON result ({e})"))?;
    v["gb_per_s"]
        .as_f64()
        .ok_or_else(|| format!("ferry bench {mode}: no gb_per_s"))
}

/// An initiator engine with a registered local buffer and a peer.
pub struct Bench {
    pub engine: Engine,
    pub seg: SegmentId,
    _local: Option<Buffer>,
    local_addr: u64,
    local_len: u64,
    remote_addr: u64,
    remote_len: u64,
}

/// One timed run.
pub struct Measured {
    pub bytes: u64,
    pub secs: f64,
    /// CPU time this process used meanwhile (every thread, user + system):
    /// on a shared machine a steadier measure of work than the wall clock.
    pub cpu_secs: f64,
    /// Per batch, submit to completion, sorted.
    pub batch_us: Vec<f64>,
}

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass; zeroed is a valid rusage.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

impl Measured {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9) / 1e9
    }

    pub fn p(&self, q: f64) -> f64 {
        percentile(&self.batch_us, q)
    }
}

impl Bench {
    /// An engine configured from the environment (`metrics` on or off),
    /// `local_len` bytes of local memory (device memory on `device`), and
    /// the target's segment opened.
    pub fn new(
        segment: &str,
        metrics: bool,
        local_len: u64,
        device: Option<ferry_core::Location>,
    ) -> Result<Bench, String> {
        let mut config = EngineConfig::from_env().map_err(|e| e.to_string())?;
        config.metrics = metrics;
        let engine = Engine::new(config).map_err(|e| e.to_string())?;
        let (local, local_addr) = match device {
            Some(loc) => (
                None,
                engine
                    .allocate_device(loc, local_len)
                    .map_err(|e| e.to_string())?,
            ),
            None => {
                let b = Buffer::new(local_len as usize)?;
                let a = b.addr();
                (Some(b), a)
            }
        };
        engine
            .register_memory(local_addr, local_len, None)
            .map_err(|e| e.to_string())?;
        let seg = engine.open_segment(segment).map_err(|e| e.to_string())?;
        let (remote_addr, remote_len) = engine
            .descriptor_of(seg)
            .map_err(|e| e.to_string())?
            .buffers
            .iter()
            .max_by_key(|b| b.len)
            .map(|b| (b.addr, b.len))
            .ok_or("the target registered no memory")?;
        Ok(Bench {
            engine,
            seg,
            _local: local,
            local_addr,
            local_len,
            remote_addr,
            remote_len,
        })
    }

    /// Requests per batch that fit: each request has a gap of its own size
    /// after it, so none coalesce (every request costs what a scattered
    /// KV-cache block costs).
    pub fn batch_fits(&self, block: u64, want: usize) -> usize {
        let room = self.local_len.min(self.remote_len) / (2 * block);
        want.min(room as usize)
    }

    /// Whether `transport` serves this peer (a single small request).
    pub fn usable(&self, transport: &str) -> Result<(), String> {
        let r = Request {
            transport: Some(transport.into()),
            ..Request::new(Op::Write, self.local_addr, self.seg, self.remote_addr, 4096)
        };
        self.engine.transfer_sync(&[r]).map_err(|e| e.to_string())
    }

    /// Batches of `batch` requests of `block` bytes for `duration`, one at
    /// a time.
    pub fn run(
        &self,
        op: Op,
        transport: Option<&str>,
        block: u64,
        batch: usize,
        duration: Duration,
    ) -> Result<Measured, String> {
        let slots = (self.local_len.min(self.remote_len) / (2 * block)).max(1);
        let mut k = 0u64;
        let mut bytes = 0;
        let mut batch_us = Vec::new();
        let cpu0 = cpu_seconds();
        let started = Instant::now();
        while started.elapsed() < duration {
            let reqs: Vec<Request> = (0..batch as u64)
                .map(|_| {
                    let off = (k % slots) * 2 * block;
                    k += 1;
                    Request {
                        transport: transport.map(Into::into),
                        ..Request::new(
                            op,
                            self.local_addr + off,
                            self.seg,
                            self.remote_addr + off,
                            block,
                        )
                    }
                })
                .collect();
            let t0 = Instant::now();
            self.engine
                .transfer_sync(&reqs)
                .map_err(|e| format!("a batch failed: {e}"))?;
            batch_us.push(t0.elapsed().as_secs_f64() * 1e6);
            bytes += block * batch as u64;
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu_secs = cpu_seconds() - cpu0;
        batch_us.sort_by(|a, b| a.total_cmp(b));
        Ok(Measured {
            bytes,
            secs,
            cpu_secs,
            batch_us,
        })
    }
}
