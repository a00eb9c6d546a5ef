//! Discovery + load + probe of every plugin, as a process start sees it.
//!
//! Each sample is a fresh child process (this binary re-executed with
//! `--child`) that runs one `PluginSet::load` with the configuration from
//! the environment and reports how long it took; a warm, in-process reload
//! would only measure dlopen's reference counting. Files come from the page
//! cache, so "cold" below means "cold probe cache", not "cold disk".
//!
//! Three ways of starting, each measured over the same number of processes:
//!
//! - warm cache: results of an earlier start are reused; no probe runs,
//!   no child process is spawned (the usual start);
//! - cold cache: every plugin is loaded and probed in a ferry-probe child
//!   process, the children side by side (the first start after a boot, an
//!   upgrade or a configuration change);
//! - in this process, no cache: FERRY_PLUGIN_PROBE_HELPER=off and
//!   FERRY_PLUGIN_CACHE=off, every plugin loaded and probed in the
//!   starting process itself, as Ferry did before probes were isolated.
//!
//!     cargo build --release --workspace && cargo bench -p ferry-loader --bench discovery
//!
//! FERRY_PLUGIN_PATH adds plugins to the workspace's own (target/release);
//! FERRY_BENCH_SAMPLES sets the number of processes per way (default 50).

use ferry_loader::{EnvHost, LoaderConfig, PluginSet, PluginState};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

fn child() {
    let started = Instant::now();
    let config = LoaderConfig::from_env().unwrap_or_else(|e| {
        eprintln!("discovery: {e}");
        std::process::exit(2)
    });
    let set = PluginSet::load(&config, Arc::new(EnvHost));
    let total_us = started.elapsed().as_micros();
    let enabled = set
        .plugins
        .iter()
        .filter(|p| p.report.state == PluginState::Enabled)
        .count();
    println!(
        "{total_us} {} {enabled} {} {} {}",
        set.plugins.len(),
        set.probing.probed_in_children,
        set.probing.probed_in_this_process,
        set.probing.from_cache
    );
    for p in &set.plugins {
        println!(
            "plugin {} {} {} {}",
            p.report.name,
            p.report.state.as_str(),
            p.report.load_us.unwrap_or(0),
            p.report.probe_us.unwrap_or(0)
        );
    }
}

fn percentile(sorted: &[u128], p: f64) -> u128 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

struct Sample {
    total_us: u128,
    found: u128,
    in_children: u128,
    in_process: u128,
    cached: u128,
    plugin_lines: Vec<String>,
}

fn sample(env: &[(&str, &str)]) -> Sample {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(&exe);
    cmd.arg("--child");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the child");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let first: Vec<u128> = lines
        .next()
        .unwrap_or("")
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect();
    if first.len() != 6 {
        eprintln!("child printed nothing useful: {text}");
        std::process::exit(1);
    }
    Sample {
        total_us: first[0],
        found: first[1],
        in_children: first[3],
        in_process: first[4],
        cached: first[5],
        plugin_lines: lines.map(str::to_string).collect(),
    }
}

/// Runs `samples` processes with `env` and prints one line; the median.
fn measure(what: &str, samples: usize, env: &[(&str, &str)]) -> u128 {
    let mut totals = Vec::with_capacity(samples);
    let mut first = None;
    for _ in 0..samples {
        let s = sample(env);
        totals.push(s.total_us);
        first.get_or_insert(s);
    }
    let first = first.expect("at least one sample");
    if first.found == 0 {
        eprintln!(
            "no plugins found: build them first (cargo build --release --workspace) or set \
             FERRY_PLUGIN_PATH"
        );
        std::process::exit(1);
    }
    totals.sort_unstable();
    let median = percentile(&totals, 0.5);
    println!(
        "{what}: {} plugin files, {samples} processes: median {median} us, p90 {} us, \
         min {} us, max {} us (probed in children {}, in the process {}, from the cache {})",
        first.found,
        percentile(&totals, 0.9),
        totals[0],
        totals[totals.len() - 1],
        first.in_children,
        first.in_process,
        first.cached,
    );
    for l in &first.plugin_lines {
        println!("    {l}  (load us, probe us)");
    }
    median
}

fn main() {
    if std::env::args().any(|a| a == "--child") {
        child();
        return;
    }
    let samples: usize = std::env::var("FERRY_BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cache = dir.path().join("plugin-probes.json");
    let cache = cache.to_str().expect("a UTF-8 temporary path");
    // One start fills the cache.
    sample(&[("FERRY_PLUGIN_CACHE", cache)]);
    let warm = measure("warm cache", samples, &[("FERRY_PLUGIN_CACHE", cache)]);
    let cold = measure(
        "cold cache, probes in child processes",
        samples,
        &[("FERRY_PLUGIN_CACHE", "off")],
    );
    let inline = measure(
        "no cache, probes in this process",
        samples,
        &[
            ("FERRY_PLUGIN_CACHE", "off"),
            ("FERRY_PLUGIN_PROBE_HELPER", "off"),
        ],
    );
    println!(
        "medians: warm {warm} us, cold {cold} us, in-process {inline} us; warm / in-process \
         = {:.2}, cold / in-process = {:.2}",
        warm as f64 / inline as f64,
        cold as f64 / inline as f64
    );
}
