//! `ferry demo`: a real transfer between two engines in two processes on
//! this host, explaining every choice on the way.
//!
//! The parent is the initiator; it starts itself again as the target
//! (`ferry demo --role target`), which registers a buffer, prints its segment
//! name, and answers "checksum" on stdin with the CRC32 of its buffer, so
//! the data is verified where it landed, not only after reading it back.

use crate::util::{crc32, fill_pattern, human_size, Buffer};
use ferry_core::loader::escape::for_terminal as esc;
use ferry_core::loader::{PluginKind, PluginState};
use ferry_core::{Engine, EngineConfig, Location, Op, Request};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct DemoArgs {
    pub size: u64,
    pub block: u64,
    /// Move device memory (e.g. cuda:0) on both sides instead of host memory.
    pub device: Option<Location>,
}

fn engine() -> Result<Engine, String> {
    let config = EngineConfig::from_env().map_err(|e| e.to_string())?;
    Engine::new(config).map_err(|e| format!("cannot start an engine: {e}"))
}

/// The target process: serve a buffer the engine allocates (so a same-host
/// transport can share it best), or device memory, until stdin closes.
pub fn run_target(size: u64, device: Option<Location>) -> Result<(), String> {
    let engine = engine()?;
    let addr = match device {
        Some(loc) => {
            let a = engine
                .allocate_device(loc, size)
                .map_err(|e| e.to_string())?;
            engine
                .register_memory(a, size, None)
                .map_err(|e| e.to_string())?;
            a
        }
        None => engine
            .allocate_memory(size, None)
            .map_err(|e| e.to_string())?,
    };
    println!("SEGMENT {}", engine.segment_name());
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim() == "checksum" {
            let sum = checksum(&engine, addr, size)?;
            println!("CHECKSUM {sum:08x}");
            let _ = std::io::stdout().flush();
        }
    }
    match device {
        Some(_) => {
            let _ = engine.unregister_memory(addr);
            engine.free_device(addr).map_err(|e| e.to_string())
        }
        None => engine.free_memory(addr).map_err(|e| e.to_string()),
    }
}

/// CRC32 of memory this engine knows (host or device: copied out first).
fn checksum(engine: &Engine, addr: u64, size: u64) -> Result<u32, String> {
    let mut host = vec![0u8; size as usize];
    // SAFETY: addr holds `size` bytes this process registered, and no
    // transfer writes it while we read (the demo runs steps in order).
    unsafe { engine.copy_memory(host.as_mut_ptr() as u64, addr, size) }
        .map_err(|e| e.to_string())?;
    Ok(crc32(&host))
}

struct TargetProcess {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl TargetProcess {
    fn start(size: u64, device: Option<Location>) -> Result<(TargetProcess, String), String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
        let mut cmd = Command::new(exe);
        cmd.args(["demo", "--role", "target", "--size", &size.to_string()]);
        if let Some(d) = device {
            cmd.args(["--device", &d.to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the target process: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout from the target")?;
        let mut t = TargetProcess {
            child,
            lines: BufReader::new(stdout).lines(),
        };
        let name = t.expect("SEGMENT ")?;
        Ok((t, name))
    }

    fn expect(&mut self, prefix: &str) -> Result<String, String> {
        match self.lines.next() {
            Some(Ok(line)) if line.starts_with(prefix) => Ok(line[prefix.len()..].to_string()),
            Some(Ok(line)) => Err(format!("the target said {line:?}")),
            _ => Err("the target process exited early (see its messages above)".into()),
        }
    }

    fn checksum(&mut self) -> Result<u32, String> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin to the target")?;
        writeln!(stdin, "checksum").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        let hex = self.expect("CHECKSUM ")?;
        u32::from_str_radix(hex.trim(), 16).map_err(|e| e.to_string())
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn transfer(
    engine: &Engine,
    op: Op,
    local: u64,
    seg: u64,
    remote: u64,
    size: u64,
    block: u64,
) -> Result<Duration, String> {
    let reqs: Vec<Request> = (0..size / block)
        .map(|i| Request::new(op, local + i * block, seg, remote + i * block, block))
        .collect();
    let started = Instant::now();
    engine.transfer_sync(&reqs).map_err(|e| e.to_string())?;
    Ok(started.elapsed())
}

pub fn run(args: DemoArgs) -> Result<(), String> {
    let DemoArgs {
        size,
        block,
        device,
    } = args;
    if size == 0 || block == 0 || size % block != 0 {
        return Err("--size must be a non-zero multiple of --block".into());
    }
    println!("Ferry demo: a target and an initiator, two processes on this host.\n");
    let (mut target, segment) = TargetProcess::start(size, device)?;
    let engine = engine()?;
    println!(
        "  target     pid {:<7} segment {segment}",
        target.child.id()
    );
    println!(
        "  initiator  pid {:<7} segment {}",
        std::process::id(),
        engine.segment_name()
    );

    println!("\nPlugins loaded on this host:");
    for p in &engine.plugins().plugins {
        let r = &p.report;
        let mark = match r.state {
            PluginState::Enabled => "+",
            _ => "-",
        };
        // Plugin strings are data: escaped, so none can drive the terminal.
        println!(
            "  {mark} {:<10} {:<9} {:<8} {}: {}",
            r.name,
            r.kind.as_str(),
            r.state.as_str(),
            esc(r.version.as_deref().unwrap_or("-")),
            esc(&r.reason)
        );
    }
    for w in &engine.plugins().warnings {
        println!("  ! {}", esc(w));
    }
    if engine.plugins().enabled(PluginKind::Transport).count() == 0 {
        return Err("no transport plugin is enabled; `ferry info` says why".into());
    }
    for (name, e) in engine.transport_failures() {
        println!("  ! {name} failed to start: {}", esc(&e.to_string()));
    }

    let topo = engine.topology();
    println!(
        "\nTopology (sysfs): {} NUMA node(s), {} GPU(s), NICs: {}",
        topo.numa_nodes().len(),
        topo.gpus().len(),
        if topo.nics().is_empty() {
            "none".to_string()
        } else {
            topo.nics()
                .iter()
                .map(|n| {
                    format!(
                        "{} ({}{})",
                        n.name,
                        n.kind.as_str(),
                        n.pci.map(|p| format!(", {p}")).unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        }
    );

    let mut pattern = Buffer::new(size as usize)?;
    fill_pattern(pattern.as_mut_slice(), 0x5eed);
    let want = crc32(pattern.as_slice());
    // Host buffers, or device buffers filled from the host pattern.
    let (src, dst, _host_bufs) = match device {
        Some(loc) => {
            let s = engine
                .allocate_device(loc, size)
                .map_err(|e| e.to_string())?;
            let d = engine
                .allocate_device(loc, size)
                .map_err(|e| e.to_string())?;
            // SAFETY: pattern holds `size` bytes; s is device memory of that size.
            unsafe { engine.copy_memory(s, pattern.addr(), size) }.map_err(|e| e.to_string())?;
            (s, d, None)
        }
        None => {
            let d = Buffer::new(size as usize)?;
            let (s, dd) = (pattern.addr(), d.addr());
            (s, dd, Some(d))
        }
    };
    for b in [src, dst] {
        engine
            .register_memory(b, size, None)
            .map_err(|e| e.to_string())?;
    }
    let seg = engine.open_segment(&segment).map_err(|e| e.to_string())?;
    let remote = engine
        .descriptor_of(seg)
        .map_err(|e| e.to_string())?
        .buffers
        .first()
        .map(|b| b.addr)
        .ok_or("the target registered no buffer")?;
    let kind = match device {
        Some(d) => format!("{d} memory"),
        None => "host memory".to_string(),
    };
    println!("\nRoute for {} of {kind} to {segment}:", human_size(size));
    let route = engine
        .route(seg, src, remote, block)
        .map_err(|e| e.to_string())?;
    println!("  transport  {} ({})", route.transport, esc(&route.reason));
    if let Some(detail) = &route.peer_detail {
        println!("  path       {detail}");
    }
    match &route.nic {
        Some(n) if n.loopback => println!(
            "  NIC        {} ({}): loopback, the peer is on this host; no PCI path is involved",
            n.interface, n.local_ip
        ),
        Some(n) => println!(
            "  NIC        {} ({}){}{}",
            n.interface,
            n.local_ip,
            n.pci
                .as_deref()
                .map(|p| format!(", PCI {p}"))
                .unwrap_or_default(),
            n.class
                .map(|c| format!(
                    ", path class {} from the buffer ({})",
                    c.as_str(),
                    c.description()
                ))
                .unwrap_or_default()
        ),
        None => {}
    }

    println!();
    let t = transfer(&engine, Op::Write, src, seg, remote, size, block)?;
    println!(
        "Write {} in {} requests of {}: {:.3} s, {:.2} GB/s",
        human_size(size),
        size / block,
        human_size(block),
        t.as_secs_f64(),
        gbps(size, t)
    );
    let at_target = target.checksum()?;
    let ok_write = at_target == want;
    println!(
        "  target's checksum {at_target:08x} {} initiator's {want:08x}",
        if ok_write { "==" } else { "!=" }
    );
    let t = transfer(&engine, Op::Read, dst, seg, remote, size, block)?;
    let got = checksum(&engine, dst, size)?;
    let ok_read = got == want;
    println!(
        "Read back {}: {:.3} s, {:.2} GB/s\n  checksum {got:08x} {} {want:08x}",
        human_size(size),
        t.as_secs_f64(),
        gbps(size, t),
        if ok_read { "==" } else { "!=" }
    );
    // Transports that pick their own NICs (rdma) say where the bytes went.
    if route.nic.is_none() {
        if let Some(detail) = engine
            .route(seg, src, remote, block)
            .ok()
            .and_then(|r| r.peer_detail)
        {
            println!("  carried by {detail}");
        }
    }
    if device.is_some() {
        for b in [src, dst] {
            let _ = engine.unregister_memory(b);
            let _ = engine.free_device(b);
        }
    }
    if ok_write && ok_read {
        println!("\nOK: every byte arrived and came back intact.");
        Ok(())
    } else {
        Err("data corrupted in transfer".into())
    }
}
