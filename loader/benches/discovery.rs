//! Cold discovery + load + probe of every plugin, as a process start sees it.
//!
//! Each sample is a fresh child process (this binary re-executed with
//! `--child`) that runs one `PluginSet::load` with the configuration from
//! the environment and reports how long it took; a warm, in-process reload
//! would only measure dlopen's reference counting. Files come from the page
//! cache, so this is "cold process", not "cold disk".
//!
//!     cargo build --release --workspace && cargo bench -p ferry-loader --bench discovery
//!
//! FERRY_PLUGIN_PATH adds plugins to the workspace's own (target/release);
//! FERRY_BENCH_SAMPLES sets the number of processes (default 50).

use ferry_loader::{EnvHost, LoaderConfig, PluginSet, PluginState};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

fn child() {
    let started = Instant::now();
    let set = PluginSet::load(&LoaderConfig::from_env(), Arc::new(EnvHost));
    let total_us = started.elapsed().as_micros();
    let enabled = set
        .plugins
        .iter()
        .filter(|p| p.report.state == PluginState::Enabled)
        .count();
    println!("{total_us} {} {enabled}", set.plugins.len());
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

fn main() {
    if std::env::args().any(|a| a == "--child") {
        child();
        return;
    }
    let samples: usize = std::env::var("FERRY_BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let exe = std::env::current_exe().expect("current_exe");
    let mut totals = Vec::with_capacity(samples);
    let mut plugin_lines = Vec::new();
    let mut found = 0;
    for i in 0..samples {
        let out = Command::new(&exe)
            .arg("--child")
            .output()
            .expect("run the child");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut lines = text.lines();
        let first: Vec<u128> = lines
            .next()
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        if first.len() != 3 {
            eprintln!("child printed nothing useful: {text}");
            std::process::exit(1);
        }
        totals.push(first[0]);
        found = first[1];
        if i == 0 {
            plugin_lines = lines.map(str::to_string).collect();
        }
    }
    if found == 0 {
        eprintln!(
            "no plugins found: build them first (cargo build --release --workspace) or set \
             FERRY_PLUGIN_PATH"
        );
        std::process::exit(1);
    }
    totals.sort_unstable();
    println!(
        "discovery+load+probe, cold process, {found} plugin files, {samples} samples: \
         median {} us, p90 {} us, min {} us, max {} us",
        percentile(&totals, 0.5),
        percentile(&totals, 0.9),
        totals[0],
        totals[totals.len() - 1]
    );
    println!("first sample, per plugin (load us, probe us):");
    for l in plugin_lines {
        println!("  {l}");
    }
}
