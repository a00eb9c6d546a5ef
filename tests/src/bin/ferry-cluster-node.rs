//! One host of the cluster simulation (scripts/cluster-sim.sh, driven by
//! `ferry-cluster`): an engine configured by FERRY_* variables alone, which
//! registers one buffer per memory location its host has (`cpu:N` for each
//! NUMA node of the topology, `cuda:N` for each GPU a device plugin
//! reports), registers in etcd under NAME, and answers commands on stdin,
//! one JSON line each on stdout:
//!
//!     ferry-cluster-node NAME CELL_BYTES [EXTRA_ENGINES]
//!
//! Each buffer holds three cells of CELL_BYTES: an inbox peers write to, a
//! source and a read-back area. EXTRA_ENGINES more engines (NAME.1, ...)
//! each register a small buffer and only serve, for the scale figures.
//!
//! - `xfer PEER LOCAL REMOTE SEED`: writes pattern(SEED) from this host's
//!   LOCAL buffer (cpu:0, cuda:3, ...) into PEER's inbox at REMOTE, reads it
//!   back, compares; says which transport, NICs (bytes per NIC at both
//!   ends) and path class carried it, and the time each way.
//! - `check LOCATION SEED`: whether this host's inbox at LOCATION holds
//!   pattern(SEED).
//! - `open NAME`: opens NAME afresh (forgetting an open handle); time taken.
//! - `lookup ROUNDS NAME...`: opens and closes each name ROUNDS times
//!   (from a scale engine, which holds nothing open); the latency of every
//!   open, in microseconds.
//! - `gone NAME TIMEOUT_MS`: waits until NAME is no longer listed in etcd.
//! - `segments`: the names etcd lists.
//! - `quit`.

use ferry_core::{Engine, EngineConfig, ErrorCode, Location, Op, Request, SegmentId};
use ferry_tests::pattern;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

/// A registered buffer of three cells: inbox, source, read-back.
struct Buffer {
    location: Location,
    addr: u64,
    on_device: bool,
    /// Host memory backing a `cpu:N` buffer.
    _host: Option<Vec<u8>>,
}

struct Node {
    engine: Engine,
    /// The scale engines (they serve; the first also runs lookups, so
    /// lookups never close a segment the main engine holds open).
    others: Vec<Engine>,
    cell: u64,
    buffers: Vec<Buffer>,
    open: HashMap<String, SegmentId>,
    /// Peers whose last request failed: refreshed (re-read by name) first.
    failed: HashSet<String>,
}

fn say(v: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn fail(e: &ferry_core::Error) -> Value {
    json!({"ok": false, "code": e.code.name(), "error": e.message})
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(name), Some(cell)) = (args.get(1), args.get(2).and_then(|s| s.parse::<u64>().ok()))
    else {
        eprintln!("usage: ferry-cluster-node NAME CELL_BYTES [EXTRA_ENGINES]");
        std::process::exit(2);
    };
    let extra: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(0);
    ferry_core::init_logging();
    let started = Instant::now();
    let engine = match start(name) {
        Ok(e) => e,
        Err(e) => {
            say(json!({"event": "fatal", "code": e.code.name(), "error": e.message}));
            std::process::exit(1);
        }
    };
    let buffers = match register(&engine, cell) {
        Ok(b) => b,
        Err(e) => {
            say(json!({"event": "fatal", "code": e.code.name(), "error": e.message}));
            std::process::exit(1);
        }
    };
    let ready_ms = started.elapsed().as_secs_f64() * 1e3;
    // The scale engines: they serve and stay registered, nothing more.
    let mut others = Vec::new();
    let mut small = Vec::new();
    for i in 1..=extra {
        match start(&format!("{name}.{i}")) {
            Ok(e) => {
                let mut b = vec![0u8; 1 << 20];
                if let Err(err) = e.register_memory(b.as_mut_ptr() as u64, b.len() as u64, None) {
                    say(json!({"event": "fatal", "code": err.code.name(), "error": err.message}));
                    std::process::exit(1);
                }
                small.push(b);
                others.push(e);
            }
            Err(e) => {
                say(json!({"event": "fatal", "code": e.code.name(), "error": e.message}));
                std::process::exit(1);
            }
        }
    }
    let plugins: Vec<Value> = engine
        .plugins()
        .plugins
        .iter()
        .filter(|p| !p.is_enabled())
        .map(|p| {
            json!({"name": p.report.name, "kind": p.report.kind.as_str(),
                   "state": p.report.state.as_str(), "reason": p.report.reason})
        })
        .collect();
    let failures: Vec<Value> = engine
        .transport_failures()
        .iter()
        .map(|(n, e)| json!({"name": n, "error": e.to_string()}))
        .collect();
    say(json!({
        "event": "ready",
        "name": engine.segment_name(),
        "ready_ms": ready_ms,
        "all_ms": started.elapsed().as_secs_f64() * 1e3,
        "transports": engine.transports(),
        "not_enabled": plugins,
        "transport_failures": failures,
        "locations": buffers.iter().map(|b| b.location.to_string()).collect::<Vec<_>>(),
        "engines": 1 + others.len(),
    }));
    let mut node = Node {
        engine,
        others,
        cell,
        buffers,
        open: HashMap::new(),
        failed: HashSet::new(),
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["xfer", peer, local, remote, seed] => node.xfer(peer, local, remote, seed),
            ["check", location, seed] => node.check(location, seed),
            ["open", peer] => node.reopen(peer),
            ["lookup", rounds, names @ ..] => node.lookup(rounds, names),
            ["gone", peer, ms] => node.gone(peer, ms),
            ["segments"] => match node.engine.list_segments() {
                Ok(list) => {
                    json!({"ok": true, "names": list.into_iter().map(|(n, _)| n).collect::<Vec<_>>()})
                }
                Err(e) => fail(&e),
            },
            ["quit"] => break,
            _ => {
                json!({"ok": false, "code": "INVALID_ARGUMENT", "error": format!("unknown command {line:?}")})
            }
        };
        say(reply);
    }
    drop(node);
    drop(small);
}

fn start(name: &str) -> ferry_core::Result<Engine> {
    let mut config = EngineConfig::from_env()?;
    config.set("name", name)?;
    Engine::new(config)
}

/// One buffer per NUMA node with CPUs and per GPU.
fn register(engine: &Engine, cell: u64) -> ferry_core::Result<Vec<Buffer>> {
    let len = 3 * cell;
    let mut out = Vec::new();
    let mut nodes: Vec<u32> = engine
        .topology()
        .numa_nodes()
        .iter()
        .filter(|n| n.has_cpus())
        .map(|n| n.id)
        .collect();
    if nodes.is_empty() {
        nodes.push(0);
    }
    for n in nodes {
        let mut host = vec![0u8; len as usize];
        let addr = host.as_mut_ptr() as u64;
        engine.register_memory(addr, len, Some(Location::Cpu(n)))?;
        out.push(Buffer {
            location: Location::Cpu(n),
            addr,
            on_device: false,
            _host: Some(host),
        });
    }
    for gpu in engine.gpus().to_vec() {
        let addr = engine.allocate_device(gpu.location, len)?;
        engine.register_memory(addr, len, None)?;
        out.push(Buffer {
            location: gpu.location,
            addr,
            on_device: true,
            _host: None,
        });
    }
    Ok(out)
}

/// Bytes per NIC, from the rdma plugin's description of a peer: the part
/// after `prefix` ("sent through " or "at the peer: "), "mlx5_0 1048576 B
/// in 1 slices, ...".
fn nic_bytes(detail: &str, prefix: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for part in detail.split("; ") {
        let Some(list) = part.strip_prefix(prefix) else {
            continue;
        };
        for entry in list.split(", ") {
            let mut w = entry.split_whitespace();
            if let (Some(nic), Some(bytes)) = (w.next(), w.next()) {
                if let Ok(b) = bytes.parse() {
                    out.insert(nic.to_string(), b);
                }
            }
        }
    }
    out
}

fn retried(detail: &str) -> u64 {
    detail
        .split("; ")
        .find_map(|p| p.strip_suffix(" slices retried on another NIC pair"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn delta(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

impl Node {
    fn buffer(&self, location: &str) -> Option<&Buffer> {
        self.buffers
            .iter()
            .find(|b| b.location.to_string() == location)
    }

    fn segment(&mut self, peer: &str) -> ferry_core::Result<SegmentId> {
        if let Some(seg) = self.open.get(peer).copied() {
            if self.failed.remove(peer) {
                // Its last request failed: it may have restarted with new
                // memory, or left; read its descriptor again by name.
                self.engine.refresh_segment(seg)?;
            }
            return Ok(seg);
        }
        let seg = self.engine.open_segment(peer)?;
        self.open.insert(peer.to_string(), seg);
        Ok(seg)
    }

    /// Writes `bytes` into this host's memory at `addr` (device or host).
    fn fill(&self, addr: u64, on_device: bool, bytes: &[u8]) -> ferry_core::Result<()> {
        if on_device {
            // SAFETY: addr is a registered cell of `bytes.len()` bytes of
            // our device memory; nothing transfers into it now.
            unsafe {
                self.engine
                    .copy_memory(addr, bytes.as_ptr() as u64, bytes.len() as u64)
            }
        } else {
            // SAFETY: addr is a registered cell of `bytes.len()` bytes of host
            // memory this node owns; nothing transfers into it now.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
            Ok(())
        }
    }

    /// Reads `len` bytes of this host's memory at `addr`.
    fn read(&self, addr: u64, on_device: bool, len: u64) -> ferry_core::Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        if on_device {
            // SAFETY: addr is a registered cell of len bytes of our device
            // memory; no transfer writes it now.
            unsafe {
                self.engine
                    .copy_memory(out.as_mut_ptr() as u64, addr, len)?
            };
        } else {
            // SAFETY: addr is a registered cell of len bytes of host memory
            // this node owns; no transfer writes it now.
            unsafe {
                std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len())
            };
        }
        Ok(out)
    }

    fn xfer(&mut self, peer: &str, local: &str, remote: &str, seed: &str) -> Value {
        let Ok(seed) = seed.parse::<u64>() else {
            return json!({"ok": false, "code": "INVALID_ARGUMENT", "error": "seed"});
        };
        let Some(buf) = self.buffer(local) else {
            return json!({"ok": false, "code": "INVALID_ARGUMENT", "error": format!("no local buffer at {local}")});
        };
        let (src, back, on_device) = (
            buf.addr + self.cell,
            buf.addr + 2 * self.cell,
            buf.on_device,
        );
        let want = pattern(self.cell as usize, seed);
        if let Err(e) = self.fill(src, on_device, &want) {
            return fail(&e);
        }
        match self.xfer_inner(peer, remote, src, back, on_device, &want) {
            Ok(v) => v,
            Err(e) => {
                self.failed.insert(peer.to_string());
                fail(&e)
            }
        }
    }

    fn xfer_inner(
        &mut self,
        peer: &str,
        remote: &str,
        src: u64,
        back: u64,
        on_device: bool,
        want: &[u8],
    ) -> ferry_core::Result<Value> {
        let seg = self.segment(peer)?;
        let d = self.engine.descriptor_of(seg)?;
        let Some(rbuf) = d.buffers.iter().find(|b| b.location == remote) else {
            return Ok(json!({"ok": false, "code": "NOT_FOUND",
                "error": format!("{peer} has no buffer at {remote}")}));
        };
        let raddr = rbuf.addr;
        let len = self.cell;
        let route = self.engine.route(seg, src, raddr, len)?;
        let detail = |e: &Engine| {
            e.route(seg, src, raddr, len)
                .ok()
                .and_then(|r| r.peer_detail)
                .unwrap_or_default()
        };
        let before = detail(&self.engine);
        let t0 = Instant::now();
        self.engine
            .transfer_sync(&[Request::new(Op::Write, src, seg, raddr, len)])?;
        let write_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        self.engine
            .transfer_sync(&[Request::new(Op::Read, back, seg, raddr, len)])?;
        let read_s = t1.elapsed().as_secs_f64();
        let after = detail(&self.engine);
        let got = self.read(back, on_device, len)?;
        let verified = got == want;
        let local_nics = delta(
            &nic_bytes(&after, "sent through "),
            &nic_bytes(&before, "sent through "),
        );
        let remote_nics = delta(
            &nic_bytes(&after, "at the peer: "),
            &nic_bytes(&before, "at the peer: "),
        );
        let (interface, class) = match &route.nic {
            Some(n) => (
                Some(n.interface.clone()),
                n.class.map(|c| c.as_str().to_string()),
            ),
            None => (None, None),
        };
        Ok(json!({
            "ok": verified,
            "error": if verified { Value::Null } else { json!("read back differs from what was written") },
            "transport": route.transport,
            "reason": route.reason,
            "staged": route.reason.contains("staged"),
            "local_nics": local_nics,
            "remote_nics": remote_nics,
            "retried": retried(&after).saturating_sub(retried(&before)),
            "interface": interface,
            "class": class,
            "write_s": write_s,
            "read_s": read_s,
            "bytes": len,
        }))
    }

    fn check(&self, location: &str, seed: &str) -> Value {
        let (Some(buf), Ok(seed)) = (self.buffer(location), seed.parse::<u64>()) else {
            return json!({"ok": false, "code": "INVALID_ARGUMENT", "error": "location or seed"});
        };
        match self.read(buf.addr, buf.on_device, self.cell) {
            Ok(got) => {
                let ok = got == pattern(self.cell as usize, seed);
                json!({"ok": ok, "error": if ok { Value::Null } else { json!("inbox differs from what the peer wrote") }})
            }
            Err(e) => fail(&e),
        }
    }

    fn reopen(&mut self, peer: &str) -> Value {
        if let Some(seg) = self.open.remove(peer) {
            let _ = self.engine.close_segment(seg);
        }
        self.failed.remove(peer);
        let t = Instant::now();
        match self.engine.open_segment(peer) {
            Ok(seg) => {
                self.open.insert(peer.to_string(), seg);
                json!({"ok": true, "ms": t.elapsed().as_secs_f64() * 1e3})
            }
            Err(e) => {
                let mut v = fail(&e);
                v["ms"] = json!(t.elapsed().as_secs_f64() * 1e3);
                v
            }
        }
    }

    fn lookup(&self, rounds: &str, names: &[&str]) -> Value {
        let rounds: usize = rounds.parse().unwrap_or(1);
        let mut us = Vec::with_capacity(rounds * names.len());
        let (engine, held): (&Engine, Vec<SegmentId>) = match self.others.first() {
            Some(e) => (e, Vec::new()),
            None => (&self.engine, self.open.values().copied().collect()),
        };
        for _ in 0..rounds {
            for name in names {
                let t = Instant::now();
                match engine.open_segment(name) {
                    Ok(seg) if held.contains(&seg) => {}
                    Ok(seg) => {
                        us.push(t.elapsed().as_secs_f64() * 1e6);
                        let _ = engine.close_segment(seg);
                    }
                    Err(e) => {
                        let mut v = fail(&e);
                        v["name"] = json!(name);
                        return v;
                    }
                }
            }
        }
        json!({"ok": true, "us": us})
    }

    fn gone(&self, peer: &str, ms: &str) -> Value {
        let limit = Duration::from_millis(ms.parse().unwrap_or(30_000));
        let t = Instant::now();
        loop {
            match self.engine.list_segments() {
                Ok(list) if !list.iter().any(|(n, _)| n == peer) => {
                    return json!({"ok": true, "ms": t.elapsed().as_secs_f64() * 1e3});
                }
                Ok(_) => {}
                Err(e) if e.code == ErrorCode::Connection => {}
                Err(e) => return fail(&e),
            }
            if t.elapsed() > limit {
                return json!({"ok": false, "code": "TIMEOUT",
                    "error": format!("{peer} still listed after {} ms", limit.as_millis())});
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
