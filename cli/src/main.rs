//! `ferry`: thin glue over Ferry's libraries for operators.
//!
//! Logging goes to stderr and follows FERRY_LOG (env_logger syntax, e.g.
//! `FERRY_LOG=info` or `FERRY_LOG=ferry=debug`); the default shows warnings.

mod bench;
mod bench_kv;
mod bench_scale;
mod demo;
mod limits;
mod plot;
mod scale_plot;
mod sweep;
mod tcp_limit;
mod top;
mod util;
mod workbench;

use clap::{Parser, Subcommand, ValueEnum};
use ferry_core::topology::Topology;
use ferry_core::{Location, Op};
use ferry_topology_fixtures as fixture;
use std::path::PathBuf;
use std::process::ExitCode;

/// Every variable, as README.md's configuration table lists them (a test
/// keeps the two in step).
const ENVIRONMENT: &str = "\
Environment (defaults, and each one's EngineConfig key, in docs/configuration.md; a
value a setting does not accept stops the command with the reason; `ferry info`
shows the settings in effect):
 Plugins
  FERRY_PLUGIN_PATH              colon list of plugin directories or files, searched first
  FERRY_TRANSPORTS               allow list (tcp,shm) or deny list (^rdma) of transports
  FERRY_PLUGIN_PROBE_TIMEOUT_MS  loading and probing one plugin may take this long (10000)
  FERRY_PLUGIN_PROBE_HELPER      auto (ferry-probe beside the plugins), off (probe in this
                                 process), or the helper's path
  FERRY_PLUGIN_CACHE             auto (~/.cache/ferry/plugin-probes.json), off, or a file
 Engine
  FERRY_LISTEN                   control listener address (127.0.0.1:0)
  FERRY_HOSTNAME                 host part of this engine's segment name
  FERRY_NAME                     name registered in the metadata store
  FERRY_TIMEOUT_MS               deadline of every network wait (15000)
  FERRY_CONNECT_TIMEOUT_MS       deadline of a connection attempt (5000)
  FERRY_IDLE_TIMEOUT_S           idle connections are closed after this (120)
  FERRY_SPIN_US                  a waiting thread polls this long before sleeping (100)
  FERRY_AUTH_TOKEN               the cluster's shared secret
  FERRY_AUTH_TOKEN_FILE          read the token from this file's first line
  FERRY_AUTH                     required (default) or off
  FERRY_AUTH_TIMEOUT_MS          a new connection must authenticate within this (1000)
  FERRY_AUTH_MAX_PENDING         connections authenticating at once per listener (64)
  FERRY_AUTH_MAX_PENDING_PER_HOST  of those, from one address (8)
  FERRY_CONTROL_MAX_PER_HOST     control connections served from one host (32 of 128)
  FERRY_INTEGRITY                headers (default) or payload: tag TCP payloads too
  FERRY_METADATA                 p2p (default), etcd:// or etcds://host:port[,host:port...]
  FERRY_METADATA_PREFIX          etcd key prefix (/ferry)
  FERRY_METADATA_TTL_S           etcd lease of an engine's entry (10)
  FERRY_METADATA_CACERT          etcds://: the CA of etcd's certificates (also _CERT, _KEY)
  FERRY_METADATA_USER            etcd user (its password from a file: docs/metadata.md)
  FERRY_SELECT                   measured (default) or declared: ignore what transfers measure
  FERRY_PREFER                   a transport requests take wherever it serves them (e.g. tcp)
  FERRY_METRICS                  on (default) or off: count nothing per request
  FERRY_HUGEPAGES                on (default), or off: allocate_memory uses normal pages
  FERRY_METRICS_LISTEN           serve Prometheus metrics at host:port (none)
 Topology and GPUs
  FERRY_SYSFS_ROOT               read topology from this tree instead of /sys
  FERRY_NICS                     allow (mlx5_0,mlx5_1) or deny (^mlx5_2) list of NICs
  FERRY_TOPOLOGY_FILE            JSON file that pins or adds topology
  CUDA_VISIBLE_DEVICES           GPU ordinals as CUDA numbers them
  FERRY_GPU_DIRECT               auto, dmabuf, peermem or off
  FERRY_STAGING_CHUNK            staging chunk for device memory (4 MiB)
  FERRY_STAGING_DEPTH            staged chunks in flight per job (4)
  FERRY_CUDA_LIBRARY             the CUDA driver library (libcuda.so.1)
 Transports
  FERRY_TCP_CONNECTIONS          TCP connections per peer (one per I/O thread, >= 4)
  FERRY_TCP_FRAME_BYTES          bytes of requests per TCP frame (4194304)
  FERRY_TCP_STRIPE_BYTES         requests of twice this are striped (1048576)
  FERRY_TCP_SPIN_US              a target connection polls this long (50)
  FERRY_TCP_IO_THREADS           threads driving all TCP connections (auto: NIC's NUMA node, <= 8)
  FERRY_TCP_PORT                 TCP data listener port (0: any)
  FERRY_TCP_MAX_CONNECTIONS      TCP data connections a target serves (1024)
  FERRY_TCP_MAX_CONNECTIONS_PER_HOST  of those, from one host (256)
  FERRY_TCP_ADVERTISE            host:port peers connect to for data (behind a NAT or proxy)
  FERRY_SHM_CMA                  on, or off: no cross-memory attach
  FERRY_SHM_COPY_THREADS         threads per large shm copy (auto: the NUMA node's CPUs)
  FERRY_SHM_NONTEMPORAL          on, off, or bytes from which streaming stores are used
  FERRY_SHM_ALLOWED_UIDS         other users whose processes may use this engine's shm socket
  FERRY_RDMA_SLICE_BYTES         RDMA slice size (1048576)
  FERRY_RDMA_RAILS               NIC pairs per request (0: all equally close)
  FERRY_RDMA_GID_INDEX           GID index on RoCE ports (chosen)
  FERRY_RDMA_QUEUE_DEPTH         work requests in flight per queue pair (128)
  FERRY_RDMA_PAUSE_MS            first pause of a failing NIC (1000)
 Logging
  FERRY_LOG                      log filter (warn), e.g. info or ferry=debug
A plugin setting vendor.option is read from the engine's configuration, then from
FERRY_VENDOR_OPTION.";

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Ferry moves KV-cache blocks and tensors between GPU and host memory across a cluster.",
    long_about = "Ferry moves KV-cache blocks and tensors between GPU and host memory across a \
cluster. Plugins (transports such as tcp, shm, rdma; devices such as cuda) are found at run \
time, so one build runs on every node.",
    after_long_help = ENVIRONMENT
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum OpArg {
    Read,
    Write,
}

impl From<OpArg> for Op {
    fn from(op: OpArg) -> Op {
        match op {
            OpArg::Read => Op::Read,
            OpArg::Write => Op::Write,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PatternArg {
    Seq,
    Kv,
}

#[derive(Clone, Copy, ValueEnum)]
enum ApiArg {
    Layout,
    Requests,
}

#[derive(Subcommand)]
enum Command {
    /// Show this build, the plugin search path and every plugin with its state and why.
    ///
    /// Exit status is 0 whatever the plugins' states: a disabled plugin is information,
    /// not a failure.
    Info {
        /// Print JSON (shape documented in docs/info-json.md).
        #[arg(long)]
        json: bool,
        /// Probe every plugin again (in child processes) instead of using
        /// cached results, and cache the new ones.
        #[arg(long)]
        reprobe: bool,
    },
    /// Show which NIC is closest to which memory, as `nvidia-smi topo -m` would.
    Topology {
        /// Print JSON: numa_nodes, gpus, nics, paths, preferred.
        #[arg(long)]
        json: bool,
        /// Write a named fake sysfs tree (for tests) into this directory and exit.
        #[arg(long, hide = true, value_names = ["NAME", "DIR"], num_args = 2)]
        write_fixture: Option<Vec<String>>,
    },
    /// List the segments registered in the metadata store (FERRY_METADATA).
    Segments {
        /// Print JSON: name, engine id, control address, transports, buffers.
        #[arg(long)]
        json: bool,
    },
    /// A real transfer between two engines in two processes on this host,
    /// saying what was chosen and why, then verifying every byte.
    Demo {
        /// Bytes to write and read back.
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// Size of each request.
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        block: u64,
        /// Move device memory (e.g. cuda:0) on both sides instead of host memory.
        #[arg(long, value_parser = parse_location)]
        device: Option<Location>,
        #[arg(long, hide = true)]
        role: Option<String>,
    },
    /// A live view of a running engine: throughput per transport, device
    /// and peer, failures, refusals, route changes (from its metrics
    /// endpoint, FERRY_METRICS_LISTEN). q quits.
    Top {
        /// The engine's segment (its descriptor names its metrics endpoint).
        #[arg(required_unless_present = "metrics", conflicts_with = "metrics")]
        segment: Option<String>,
        /// The metrics endpoint: host:port or a URL.
        #[arg(long)]
        metrics: Option<String>,
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Exit after this many refreshes (for scripts and screenshots).
        #[arg(long, hide = true)]
        frames: Option<u64>,
    },
    /// Measure throughput, ops/s and latency between two engines.
    Bench {
        #[command(subcommand)]
        mode: BenchMode,
    },
}

#[derive(Subcommand)]
enum BenchMode {
    /// Serve a buffer; prints `segment NAME` on its first line (then
    /// `layout ID block SIZE count N` per --layout-block).
    Target {
        /// Control listener address; its port is in the segment name.
        #[arg(long)]
        listen: Option<String>,
        #[arg(long, default_value = "1G", value_parser = parse_size)]
        buffer_size: u64,
        /// Exit after this many seconds (default: run until killed).
        #[arg(long)]
        duration: Option<f64>,
        /// Serve memory the engine allocates (shm maps it into peers) rather
        /// than plain application memory (shm reaches it by cross-memory attach).
        #[arg(long)]
        allocate: bool,
        /// Serve device memory (e.g. cuda:0) instead of host memory.
        #[arg(long, value_parser = parse_location)]
        device: Option<Location>,
        /// Publish a block layout of the whole buffer in blocks of this size
        /// (comma separated for several), for `initiator --pattern kv`.
        #[arg(long, value_delimiter = ',', value_parser = parse_size)]
        layout_block: Vec<u64>,
    },
    /// Drive reads or writes against a target and report.
    Initiator {
        /// The target's segment name (host:port).
        #[arg(long)]
        segment: String,
        #[arg(long, value_enum, default_value = "write")]
        op: OpArg,
        #[arg(long, default_value = "64K", value_parser = parse_size)]
        block_size: u64,
        /// Requests per batch.
        #[arg(long, default_value_t = 256)]
        batch_size: usize,
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Seconds to run.
        #[arg(long, default_value_t = 5.0)]
        duration: f64,
        /// Use this transport (else the engine chooses).
        #[arg(long)]
        transport: Option<String>,
        /// Move device memory (e.g. cuda:0) on this side instead of host memory.
        #[arg(long, value_parser = parse_location)]
        device: Option<Location>,
        /// Print one JSON object (gb_per_s, ops_per_s, latency_us{p50,p90,p99}, ...).
        #[arg(long)]
        json: bool,
        /// seq: blocks in order, --batch-size per batch; kv: KV-cache-shaped
        /// batches of --blocks (or --batch-bytes) blocks from shuffled local
        /// to shuffled remote blocks, with the same run's contiguous copy
        /// as the limit (device to device with --device, else memcpy).
        #[arg(long, value_enum, default_value = "seq")]
        pattern: PatternArg,
        /// kv: blocks per batch.
        #[arg(long, conflicts_with = "batch_bytes")]
        blocks: Option<u64>,
        /// kv: bytes per batch, in blocks of --block-size (default 256M).
        #[arg(long, value_parser = parse_size)]
        batch_bytes: Option<u64>,
        /// kv: one block-layout transfer per batch (the target needs
        /// --layout-block of this size), or one request per block.
        #[arg(long, value_enum, default_value = "layout")]
        api: ApiArg,
        /// kv: before timing, write a pattern, read it back by other block
        /// pairs and compare every local block.
        #[arg(long)]
        verify: bool,
    },
    /// One engine against many targets at once (scripts/scale.sh): runs of
    /// --per-peer requests go to each target in turn, --batch-size per batch.
    ScaleInitiator {
        /// The targets' segment names (host:port), comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        segments: Vec<String>,
        #[arg(long, value_enum, default_value = "write")]
        op: OpArg,
        #[arg(long, default_value = "64K", value_parser = parse_size)]
        block_size: u64,
        /// Requests per batch.
        #[arg(long, default_value_t = 256)]
        batch_size: usize,
        /// Consecutive requests of a batch that go to one target.
        #[arg(long, default_value_t = 16)]
        per_peer: usize,
        /// Submitting threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Local registered memory (split between the threads).
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        buffer_size: u64,
        /// Seconds to run; with --window-file, how long to wait for the window.
        #[arg(long, default_value_t = 5.0)]
        duration: f64,
        /// Print `ready SERVED REFUSED` once every target had a batch, then
        /// count only batches completing between the Unix times this file
        /// will hold (`START END`), and stop at END.
        #[arg(long)]
        window_file: Option<PathBuf>,
        /// Print one JSON object (served, refused, bytes, gb_per_s, ...).
        #[arg(long)]
        json: bool,
    },
    /// Plots scale.sh results (target/scale/*.json) against the number of
    /// peers, one line per file: threads, RSS per connection, CPU s per GB, GB/s.
    ScalePlot {
        /// Result files of scripts/scale.sh (one line each, named by their label).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Directory for the SVG files.
        #[arg(long, default_value = "target/scale")]
        out: PathBuf,
    },
    /// This machine's single-stream TCP loopback limit, for ratios.
    TcpLimit {
        #[arg(long, default_value_t = 3.0)]
        duration: f64,
        #[arg(long, default_value = "1M", value_parser = parse_size)]
        block: u64,
        #[arg(long)]
        json: bool,
        /// Move the blocks from and to shuffled places of a buffer of this
        /// size on both sides (writev/readv of up to 1,024 blocks), the
        /// kernel's own cost of scattered blocks.
        #[arg(long, value_parser = parse_size)]
        scatter: Option<u64>,
    },
    /// This machine's memcpy bandwidth on one thread and on --threads
    /// threads (same run), for same-host ratios.
    MemcpyLimit {
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        block: u64,
        #[arg(long, default_value_t = 2.0)]
        duration: f64,
        /// Threads of the second measurement (the shm copy threads to compare with).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long)]
        json: bool,
    },
    /// Pinned host <-> device copy bandwidth, for staged-transfer ratios;
    /// with --dtod, also a device-to-device copy of that size on the same
    /// device (the limit of same-host GPU transports such as cuda-ipc).
    DeviceLimit {
        #[arg(long, value_parser = parse_location, default_value = "cuda:0")]
        device: Location,
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        block: u64,
        #[arg(long, default_value_t = 2.0)]
        duration: f64,
        /// Also time device-to-device copies of this size (e.g. 1G).
        #[arg(long, value_parser = parse_size)]
        dtod: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Checks a device end to end: allocation, classification, DMA-BUF, copies.
    DeviceCheck {
        #[arg(long, value_parser = parse_location, default_value = "cuda:0")]
        device: Location,
    },
    /// GPU memory through the rdma plugin: DMA-BUF export and
    /// ibv_reg_dmabuf_mr on its NICs (emulated ones on hosts without RDMA).
    #[command(hide = true)]
    RdmaCheck {
        #[arg(long, value_parser = parse_location, default_value = "cuda:0")]
        device: Location,
    },
    /// Throughput and latency against block size over every usable
    /// transport, with this machine's limits from the same run: writes
    /// sweep.json, throughput.svg and latency.svg.
    Sweep {
        /// Directory for the results.
        #[arg(long, default_value = "ferry-sweep")]
        out: PathBuf,
        /// Block sizes, comma separated.
        #[arg(long, default_value = "4K,16K,64K,256K,1M,4M,16M", value_delimiter = ',', value_parser = parse_size)]
        blocks: Vec<u64>,
        /// Seconds per point.
        #[arg(long, default_value_t = 1.0)]
        duration: f64,
        /// Only these transports (comma separated; default every usable one).
        #[arg(long, value_delimiter = ',')]
        transports: Option<Vec<String>>,
        /// Also sweep with local memory on this device (e.g. cuda:0).
        #[arg(long, value_parser = parse_location)]
        device: Option<Location>,
    },
    /// Throughput with metrics on and off (FERRY_METRICS), interleaved in
    /// one run, at 4 KiB x 256 and 1 MiB x 32.
    MetricsOverhead {
        /// Rounds of each (on and off take turns).
        #[arg(long, default_value_t = 30)]
        rounds: usize,
        /// Seconds per round.
        #[arg(long, default_value_t = 0.2)]
        duration: f64,
        #[arg(long, default_value = "tcp,shm", value_delimiter = ',')]
        transports: Vec<String>,
    },
    #[command(hide = true)]
    TcpSink {
        #[arg(long)]
        connect: String,
        #[arg(long, default_value = "1M", value_parser = parse_size)]
        block: u64,
        #[arg(long, value_parser = parse_size)]
        scatter: Option<u64>,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    util::parse_size(s)
}

fn parse_location(s: &str) -> Result<Location, String> {
    ferry_core::location::parse_location(s).map_err(|e| e.message)
}

fn main() -> ExitCode {
    ferry_core::init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { json, reprobe } => info(json, reprobe),
        Command::Topology {
            json,
            write_fixture,
        } => topology(json, write_fixture),
        Command::Segments { json } => segments(json),
        Command::Demo {
            size,
            block,
            device,
            role,
        } => match role.as_deref() {
            Some("target") => demo::run_target(size, device),
            Some(other) => Err(format!("unknown demo role {other:?}")),
            None => demo::run(demo::DemoArgs {
                size,
                block,
                device,
            }),
        },
        Command::Bench { mode } => match mode {
            BenchMode::Target {
                listen,
                buffer_size,
                duration,
                allocate,
                device,
                layout_block,
            } => bench::target(bench::TargetArgs {
                listen,
                buffer_size,
                duration,
                allocate,
                device,
                layout_blocks: layout_block,
            }),
            BenchMode::MemcpyLimit {
                block,
                duration,
                threads,
                json,
            } => bench::memcpy_limit(block, duration, threads, json),
            BenchMode::Initiator {
                segment,
                op,
                block_size,
                batch_size: _,
                threads,
                duration,
                transport,
                device,
                json,
                pattern: PatternArg::Kv,
                blocks,
                batch_bytes,
                api,
                verify,
            } => {
                if threads != 1 {
                    Err("--pattern kv runs one submitting thread: leave --threads at 1".into())
                } else {
                    bench_kv::initiator(bench_kv::KvArgs {
                        segment,
                        op: op.into(),
                        block_size,
                        blocks,
                        batch_bytes,
                        api: match api {
                            ApiArg::Layout => bench_kv::KvApi::Layout,
                            ApiArg::Requests => bench_kv::KvApi::Requests,
                        },
                        duration,
                        json,
                        transport,
                        device,
                        verify,
                    })
                }
            }
            BenchMode::Initiator {
                segment,
                op,
                block_size,
                batch_size,
                threads,
                duration,
                transport,
                device,
                json,
                pattern: PatternArg::Seq,
                verify: false,
                ..
            } => bench::initiator(bench::InitiatorArgs {
                segment,
                op: match op {
                    OpArg::Read => Op::Read,
                    OpArg::Write => Op::Write,
                },
                block_size,
                batch_size,
                threads,
                duration,
                json,
                transport,
                device,
            }),
            BenchMode::Initiator {
                pattern: PatternArg::Seq,
                ..
            } => Err(
                "--verify checks --pattern kv runs (`ferry demo` checks sequential ones)".into(),
            ),
            BenchMode::TcpLimit {
                duration,
                block,
                json,
                scatter,
            } => tcp_limit::tcp_limit(duration, block as usize, scatter, json),
            BenchMode::TcpSink {
                connect,
                block,
                scatter,
            } => tcp_limit::tcp_sink(&connect, block as usize, scatter),
            BenchMode::ScaleInitiator {
                segments,
                op,
                block_size,
                batch_size,
                per_peer,
                threads,
                buffer_size,
                duration,
                window_file,
                json,
            } => bench_scale::scale_initiator(bench_scale::ScaleArgs {
                segments,
                op: op.into(),
                block_size,
                batch_size,
                per_peer,
                threads,
                buffer_size,
                duration,
                window_file,
                json,
            }),
            BenchMode::ScalePlot { files, out } => scale_plot::plot(&files, &out),
            BenchMode::DeviceLimit {
                device,
                block,
                duration,
                dtod,
                json,
            } => bench::device_limit(device, block, duration, dtod, json),
            BenchMode::DeviceCheck { device } => bench::device_check(device),
            BenchMode::RdmaCheck { device } => bench::rdma_check(device),
            BenchMode::Sweep {
                out,
                blocks,
                duration,
                transports,
                device,
            } => sweep::sweep(sweep::SweepArgs {
                out,
                blocks,
                duration,
                transports,
                device,
            }),
            BenchMode::MetricsOverhead {
                rounds,
                duration,
                transports,
            } => sweep::metrics_overhead(sweep::OverheadArgs {
                rounds,
                duration,
                transports,
            }),
        },
        Command::Top {
            segment,
            metrics,
            interval,
            frames,
        } => top_url(segment, metrics).and_then(|url| {
            top::run(top::TopArgs {
                url,
                interval: std::time::Duration::from_secs_f64(interval.clamp(0.1, 3600.0)),
                frames,
            })
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: {e}");
            ExitCode::from(1)
        }
    }
}

fn discover_topology() -> Result<Topology, String> {
    let config = ferry_core::EngineConfig::from_env().map_err(|e| e.to_string())?;
    Topology::discover(&config.topology).map_err(|e| e.to_string())
}

fn info(json: bool, reprobe: bool) -> Result<(), String> {
    let report = ferry_core::info::report_from_env(reprobe).map_err(|e| e.to_string())?;
    if json {
        let text = report.to_json_text(true).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{}", report.render_text());
    }
    Ok(())
}

fn segments(json: bool) -> Result<(), String> {
    let config = ferry_core::EngineConfig::from_env().map_err(|e| e.to_string())?;
    let store = match &config.metadata {
        ferry_core::metadata::MetadataConfig::P2p => None,
        m => Some(
            ferry_core::metadata::EtcdStore::connect(m, config.connect_timeout)
                .map_err(|e| e.to_string())?,
        ),
    };
    let list = ferry_core::engine::list_segments(store.as_deref()).map_err(|e| e.to_string())?;
    if json {
        let items: Vec<serde_json::Value> = list
            .iter()
            .map(|(name, d)| {
                serde_json::json!({
                    "name": name,
                    "engine_id": d.engine_id,
                    "control": d.control_addr(),
                    "transports": d.transports.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
                    "buffers": d.buffers.len(),
                    "bytes": d.buffers.iter().map(|b| b.len).sum::<u64>(),
                })
            })
            .collect();
        let text = serde_json::to_string_pretty(&items).map_err(|e| e.to_string())?;
        println!("{text}");
        return Ok(());
    }
    if list.is_empty() {
        println!("no segments registered");
    }
    for (name, d) in &list {
        println!(
            "{name:<24} engine {}  control {}  transports {}  {} buffers, {} bytes",
            d.engine_id,
            d.control_addr(),
            d.transports
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            d.buffers.len(),
            d.buffers.iter().map(|b| b.len).sum::<u64>()
        );
    }
    Ok(())
}

fn topology(json: bool, write_fixture: Option<Vec<String>>) -> Result<(), String> {
    if let Some(args) = write_fixture {
        let (name, dir) = (&args[0], PathBuf::from(&args[1]));
        let builder = fixture::named(name)
            .ok_or_else(|| format!("no fixture {name:?}; known: {}", fixture::NAMES.join(", ")))?;
        return builder
            .write(&dir)
            .map_err(|e| format!("writing {}: {e}", dir.display()));
    }
    let topology = discover_topology()?;
    if json {
        let text = serde_json::to_string_pretty(&topology.to_json()).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{}", topology.render_matrix());
        for w in topology.warnings() {
            eprintln!("warning: {w}");
        }
    }
    Ok(())
}

/// The metrics URL `ferry top` reads: given, or from the segment's
/// descriptor (an engine with FERRY_METRICS_LISTEN announces it).
fn top_url(segment: Option<String>, metrics: Option<String>) -> Result<String, String> {
    if let Some(m) = metrics {
        return Ok(top::metrics_url(&m));
    }
    let segment = segment.ok_or("give a segment or --metrics URL")?;
    let mut config = ferry_core::EngineConfig::from_env().map_err(|e| e.to_string())?;
    config.metrics = false;
    let engine = ferry_core::Engine::new(config).map_err(|e| e.to_string())?;
    let seg = engine.open_segment(&segment).map_err(|e| e.to_string())?;
    let d = engine.descriptor_of(seg).map_err(|e| e.to_string())?;
    d.metrics.map(|m| top::metrics_url(&m)).ok_or_else(|| {
        format!(
            "segment {segment} announces no metrics endpoint: start it with \
             FERRY_METRICS_LISTEN=host:port, or give --metrics URL"
        )
    })
}
