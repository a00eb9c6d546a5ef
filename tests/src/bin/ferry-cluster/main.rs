//! A mixed cluster on one machine (scripts/cluster-sim.sh): each host a
//! network + IPC + UTS namespace on a bridge, with its own sysfs fixture,
//! the verbs emulator where its fixture has RDMA NICs and the fake GPU
//! plugin where it has GPUs; one etcd; every host running the same node
//! program with the same settings. Prints the all-to-all matrix with every
//! cell checked by rules (rules.rs), then the faults, the scale figures
//! and the bad-input cases, and exits non-zero if anything was wrong.
//!
//!     ferry-cluster [--hosts N] [--short] [--cell BYTES]
//!
//! `--short`: N = 4 by default, small cells, one fault (a host SIGKILLed:
//! its segment leaves etcd, requests to it fail cleanly, the rest carry
//! on). Exit status 77 (and a line saying why) where namespaces cannot be
//! made here. FERRY_CLUSTER_LOGS=DIR keeps every node's log (FERRY_LOG=info:
//! each decision; FERRY_CLUSTER_LOG=debug for more) in DIR.

mod etcd;
mod faults;
mod hosts;
mod matrix;
mod netns;
mod node;
mod rules;

use hosts::{Kind, Machine};
use node::{Launch, Node};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Exit status for "cannot run here" (automake's SKIP).
pub const SKIP: i32 = 77;

pub struct Host {
    pub name: String,
    pub machine: Machine,
    pub ns: String,
    pub node: Option<Node>,
    /// Whether the rules expect rdma to run here (false only for the
    /// broken-plugin host).
    pub rdma: bool,
    /// Settings this host gets beyond everyone's (bad-input hosts only).
    pub env_extra: Vec<(String, String)>,
}

pub struct Opts {
    pub hosts: usize,
    pub short: bool,
    pub cell: u64,
    /// Engines registered in etcd in all (several per host).
    pub engines: usize,
    pub ttl_s: u64,
}

/// Everything of one run.
pub struct Cluster {
    pub run: netns::Run,
    pub etcd: etcd::Etcd,
    pub hosts: Vec<Host>,
    pub env: Vec<(String, String)>,
    pub node_bin: PathBuf,
    pub mount_point: PathBuf,
    pub opts: Opts,
    pub extra_per_host: usize,
    next_octet: u8,
    next_seed: u64,
    pub failures: Vec<String>,
}

fn parse_args() -> Result<Opts, String> {
    let mut hosts = None;
    let mut short = false;
    let mut cell = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--hosts" => {
                hosts = Some(
                    args.next()
                        .and_then(|v| v.parse::<usize>().ok())
                        .filter(|n| (3..=64).contains(n))
                        .ok_or("--hosts takes a number from 3 to 64")?,
                )
            }
            "--short" => short = true,
            "--cell" => {
                cell = Some(
                    args.next()
                        .and_then(|v| v.parse::<u64>().ok())
                        .filter(|n| *n >= 4096 && n % 4096 == 0)
                        .ok_or("--cell takes a byte count, a multiple of 4096")?,
                )
            }
            "-h" | "--help" => {
                println!("usage: ferry-cluster [--hosts N] [--short] [--cell BYTES]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(Opts {
        hosts: hosts.unwrap_or(if short { 4 } else { 8 }),
        short,
        cell: cell.unwrap_or(if short { 4 << 20 } else { 8 << 20 }),
        engines: 32,
        ttl_s: if short { 2 } else { 3 },
    })
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ferry-cluster: {e}");
            std::process::exit(2);
        }
    };
    if let Some(why) = netns::unavailable() {
        println!("SKIPPED: the cluster simulation needs network namespaces: {why}");
        std::process::exit(SKIP);
    }
    let code = match Cluster::start(opts) {
        Ok(mut c) => {
            c.script();
            c.finish()
        }
        Err(e) => {
            eprintln!("ferry-cluster: {e}");
            netns::cleanup();
            1
        }
    };
    netns::cleanup();
    std::process::exit(code);
}

/// The directory the driver runs from (target/release): the node program
/// and the plugins are there.
pub fn build_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."))
}

fn random_token() -> String {
    ferry_core::identity::random_hex() + &ferry_core::identity::random_hex()
}

pub fn section(title: &str) {
    println!("\n## {title}\n");
}

impl Cluster {
    fn start(opts: Opts) -> Result<Cluster, String> {
        let run = netns::Run::start()?;
        std::fs::create_dir_all(run.dir.join("logs")).map_err(|e| e.to_string())?;
        let build = build_dir();
        let node_bin = build.join("ferry-cluster-node");
        let fakegpu = build.join("libferry_test_device_fakegpu.so");
        for f in [&node_bin, &fakegpu] {
            if !f.exists() {
                return Err(format!(
                    "{} is missing: build the workspace first (scripts/cluster-sim.sh does)",
                    f.display()
                ));
            }
        }
        // The fake GPU as every host's "cuda" plugin; it finds its GPUs in
        // the host's fixture, so a host without GPUs has none.
        let plugins = run.dir.join("plugins");
        let lib = run.dir.join("lib");
        for d in [&plugins, &lib] {
            std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
        }
        std::fs::copy(&fakegpu, plugins.join("libferry_device_cuda.so"))
            .map_err(|e| format!("copying the fake GPU plugin: {e}"))?;
        ferry_tests::build_verbs_emulator(&lib);
        let mount_point = run.dir.join("host");
        std::fs::create_dir_all(&mount_point).map_err(|e| e.to_string())?;

        let mut c = Cluster {
            etcd: etcd::Etcd::start(&run, 2)?,
            run,
            hosts: Vec::new(),
            env: Vec::new(),
            node_bin,
            mount_point,
            extra_per_host: 0,
            next_octet: 10,
            next_seed: 1,
            failures: Vec::new(),
            opts,
        };
        let host = |p: &str| c.mount_point.join(p).display().to_string();
        c.env = vec![
            ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
            ("FERRY_METADATA".into(), c.etcd.url()),
            ("FERRY_METADATA_TTL_S".into(), c.opts.ttl_s.to_string()),
            ("FERRY_LISTEN".into(), "0.0.0.0:0".into()),
            ("FERRY_AUTH_TOKEN".into(), random_token()),
            ("FERRY_PLUGIN_PATH".into(), plugins.display().to_string()),
            ("FERRY_FAKEGPU_DEVICES".into(), "sysfs".into()),
            ("FERRY_SYSFS_ROOT".into(), host("sys")),
            ("FERRY_VERBS_EMU_CONFIG".into(), host("verbs.conf")),
            (
                "FERRY_VERBS_EMU_DIR".into(),
                c.run.fabric.display().to_string(),
            ),
            ("LD_LIBRARY_PATH".into(), lib.display().to_string()),
            // The emulated NICs move bytes at whatever speed this machine's
            // cores allow, which says nothing of the NICs the fixtures
            // describe: the rules check the choice the declarations make
            // (measured correction is tested in tests/selection.rs).
            ("FERRY_SELECT".into(), "declared".into()),
            (
                "FERRY_LOG".into(),
                std::env::var("FERRY_CLUSTER_LOG").unwrap_or_else(|_| "info".into()),
            ),
        ];
        c.extra_per_host = c.opts.engines.div_ceil(c.opts.hosts).saturating_sub(1);
        for (i, kind) in hosts::mix(c.opts.hosts).into_iter().enumerate() {
            let n = c.hosts.iter().filter(|h| h.machine.kind == kind).count();
            let name = format!("{}{n}", kind.stem());
            c.add_host(&name, kind, i, Vec::new())?;
        }
        Ok(c)
    }

    /// A host's namespace and fixture (its node is not started).
    pub fn add_host(
        &mut self,
        name: &str,
        kind: Kind,
        index: usize,
        env_extra: Vec<(String, String)>,
    ) -> Result<usize, String> {
        let ns = self.run.add_host(name, self.next_octet)?;
        self.next_octet += 1;
        let machine = Machine::write(kind, index, &self.run.dir.join("hosts").join(name))?;
        self.hosts.push(Host {
            name: name.to_string(),
            rdma: !machine.rdma.is_empty(),
            machine,
            ns,
            node: None,
            env_extra,
        });
        Ok(self.hosts.len() - 1)
    }

    /// Starts host `i`'s node (with `extra` scale engines).
    pub fn start_node(&mut self, i: usize, extra: usize) -> Result<(), String> {
        let h = &self.hosts[i];
        let node = Node::start(&Launch {
            bin: &self.node_bin,
            ns: &h.ns,
            hostname: &h.name,
            fixture: &h.machine.dir,
            mount_point: &self.mount_point,
            env: &self.env,
            env_extra: &h.env_extra,
            cell: self.opts.cell,
            extra_engines: extra,
            log: self.run.dir.join("logs").join(format!("{}.log", h.name)),
        })?;
        self.hosts[i].node = Some(node);
        Ok(())
    }

    pub fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed
    }

    pub fn fail(&mut self, what: String) {
        println!("FAILED: {what}");
        self.failures.push(what);
    }

    /// Runs the cells and prints them; returns how many were wrong.
    pub fn matrix(&mut self, cells: &[matrix::Cell]) -> usize {
        println!("{}", matrix::header());
        let mut wrong = 0;
        for cell in cells {
            let seed = self.seed();
            let row = matrix::run(&mut self.hosts, cell, seed);
            println!("{}", matrix::line(&self.hosts, &row));
            if !row.wrong.is_empty() {
                wrong += 1;
                let what = format!(
                    "{} -> {} ({} -> {}): {}",
                    self.hosts[cell.from].name,
                    self.hosts[cell.to].name,
                    cell.local,
                    cell.remote,
                    row.wrong.join("; ")
                );
                self.failures.push(what);
            }
        }
        println!("\n{} cells, {} wrong", cells.len(), wrong);
        wrong
    }

    fn script(&mut self) {
        section(&format!(
            "cluster: {} hosts, one etcd, run {}",
            self.hosts.len(),
            self.run.prefix
        ));
        for h in &self.hosts {
            let (cpus, gpus) = h.machine.locations();
            println!(
                "{:<6} {}.{:<4} fixture {:<9} {} NUMA nodes, {} GPUs, RDMA NICs: {}",
                h.name,
                netns::SUBNET,
                self.hosts
                    .iter()
                    .position(|x| x.name == h.name)
                    .unwrap_or(0)
                    + 10,
                h.machine.kind.fixture(),
                cpus.len(),
                gpus.len(),
                if h.machine.rdma.is_empty() {
                    "none".to_string()
                } else {
                    h.machine
                        .rdma
                        .iter()
                        .map(|n| {
                            format!(
                                "{} ({})",
                                n.name,
                                if n.link == "InfiniBand" { "IB" } else { "RoCE" }
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            );
        }
        println!(
            "every node: the same binaries and settings ({}); its own fixture at {}",
            self.env
                .iter()
                .filter(|(k, _)| k.starts_with("FERRY_") && k != "FERRY_AUTH_TOKEN")
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
            self.mount_point.display()
        );

        println!(
            "this machine's memcpy: {:.2} GB/s (one thread, 64 MiB; the emulated NICs and the \
             veths move bytes with copies, so GB/s below are fractions of it)",
            memcpy_gbps()
        );

        // Start-up: every node at once, then the first complete matrix.
        let t0 = Instant::now();
        let extra = self.extra_per_host;
        let results: Vec<Result<Node, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .hosts
                .iter()
                .map(|h| {
                    let launch = Launch {
                        bin: &self.node_bin,
                        ns: &h.ns,
                        hostname: &h.name,
                        fixture: &h.machine.dir,
                        mount_point: &self.mount_point,
                        env: &self.env,
                        env_extra: &h.env_extra,
                        cell: self.opts.cell,
                        extra_engines: extra,
                        log: self.run.dir.join("logs").join(format!("{}.log", h.name)),
                    };
                    s.spawn(move || Node::start(&launch))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("start thread panicked".into()))
                })
                .collect()
        });
        let mut started = true;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(n) => self.hosts[i].node = Some(n),
                Err(e) => {
                    self.fail(format!("start: {e}"));
                    started = false;
                }
            }
        }
        if !started {
            return;
        }
        let ready = t0.elapsed();
        section("nodes");
        for h in &self.hosts {
            let r = &h.node.as_ref().map(|n| n.ready.clone()).unwrap_or_default();
            println!(
                "{:<6} ready in {:>6.0} ms ({} engines), transports {}",
                h.name,
                r["all_ms"].as_f64().unwrap_or(0.0),
                r["engines"],
                r["transports"]
            );
            for p in r["not_enabled"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["state"] != "shadowed")
            {
                println!(
                    "         {} {}: {} ({})",
                    p["kind"].as_str().unwrap_or(""),
                    p["name"].as_str().unwrap_or(""),
                    p["state"].as_str().unwrap_or(""),
                    p["reason"].as_str().unwrap_or("")
                );
            }
        }

        section("all-to-all matrix: write, read back, verified at both ends");
        let all: Vec<usize> = (0..self.hosts.len()).collect();
        let cells = matrix::cells(&self.hosts, &all);
        self.matrix(&cells);
        let complete = t0.elapsed();
        println!(
            "\nstart-up: all {} nodes ready after {:.2} s; first complete matrix after {:.2} s",
            self.hosts.len(),
            ready.as_secs_f64(),
            complete.as_secs_f64()
        );

        faults::scale(self);
        if self.opts.short {
            faults::kill_host(self, false);
            return;
        }
        faults::nic_failure(self);
        faults::kill_host(self, true);
        faults::etcd_outage(self);
        faults::bad_token(self);
        faults::broken_plugin(self);
    }

    fn finish(mut self) -> i32 {
        for h in &mut self.hosts {
            if let Some(n) = h.node.take() {
                n.quit();
            }
        }
        self.etcd.stop();
        // The nodes' and etcd's logs (every decision at info), kept where
        // FERRY_CLUSTER_LOGS says; the run's directory goes at cleanup.
        let kept = std::env::var_os("FERRY_CLUSTER_LOGS").map(PathBuf::from);
        if let Some(dir) = &kept {
            let _ = std::fs::remove_dir_all(dir);
            let copied = std::fs::create_dir_all(dir).and_then(|_| {
                for e in std::fs::read_dir(self.run.dir.join("logs"))?.flatten() {
                    std::fs::copy(e.path(), dir.join(e.file_name()))?;
                }
                Ok(())
            });
            if let Err(e) = copied {
                eprintln!("cannot keep the logs in {}: {e}", dir.display());
            }
        }
        section("result");
        if self.failures.is_empty() {
            println!("every check passed");
            0
        } else {
            println!("{} checks failed:", self.failures.len());
            for f in &self.failures {
                println!("  - {f}");
            }
            match &kept {
                Some(d) => println!("(the nodes' logs: {})", d.display()),
                None => println!("(set FERRY_CLUSTER_LOGS=DIR to keep the nodes' logs)"),
            }
            1
        }
    }
}

/// This machine's single-thread memcpy bandwidth, best of five.
fn memcpy_gbps() -> f64 {
    let len = 64 << 20;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    len as f64 / best / 1e9
}

/// Percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub const GUARD: Duration = Duration::from_secs(120);
