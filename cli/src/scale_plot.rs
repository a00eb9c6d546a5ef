//! `ferry bench scale-plot`: the results of `scripts/scale.sh` against the
//! number of peers, one line per file and mode (a: one target's cost with N
//! initiators; b: one initiator's cost with N targets).

use crate::plot::{self, Line};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// One result file of scale.sh (the fields the plots use).
#[derive(Deserialize)]
struct Run {
    /// The build's name in the legend (new, old, ...).
    label: String,
    points: Vec<Point>,
}

#[derive(Deserialize)]
struct Point {
    mode: String,
    n: u64,
    threads: f64,
    fds: f64,
    rss_per_conn_kib: Option<f64>,
    cpu_s_per_gb: Option<f64>,
    gb_per_s: f64,
}

/// The charts: file name, title, y axis, and the measure.
type Measure = fn(&Point) -> Option<f64>;
const CHARTS: [(&str, &str, &str, Measure); 5] = [
    (
        "scale-threads.svg",
        "Threads of the measured process",
        "threads",
        |p| Some(p.threads),
    ),
    ("scale-fds.svg", "Open file descriptors", "fds", |p| {
        Some(p.fds)
    }),
    (
        "scale-rss-per-conn.svg",
        "RSS per connection beyond the 1-peer run",
        "KiB per connection",
        |p| p.rss_per_conn_kib,
    ),
    (
        "scale-cpu-per-gb.svg",
        "CPU time of the measured process per GB moved",
        "CPU s / GB",
        |p| p.cpu_s_per_gb,
    ),
    (
        "scale-throughput.svg",
        "Aggregate throughput",
        "GB/s",
        |p| Some(p.gb_per_s),
    ),
];

pub fn plot(files: &[PathBuf], out: &Path) -> Result<(), String> {
    let mut runs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let run: Run = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a result of scripts/scale.sh ({e})", f.display()))?;
        runs.push(run);
    }
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    for (file, title, y, measure) in CHARTS {
        let mut lines = Vec::new();
        for run in &runs {
            for mode in ["a", "b"] {
                let points: Vec<(u64, f64)> = run
                    .points
                    .iter()
                    .filter(|p| p.mode == mode)
                    .filter_map(|p| measure(p).map(|v| (p.n, v)))
                    .collect();
                if !points.is_empty() {
                    lines.push(Line {
                        name: format!("{} {}", run.label, mode_name(mode)),
                        points,
                    });
                }
            }
        }
        if lines.is_empty() {
            continue;
        }
        let path = out.join(file);
        plot::count_chart(&path, title, "peers (N)", y, &lines)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn mode_name(mode: &str) -> &'static str {
    if mode == "a" {
        "(a: target, N initiators)"
    } else {
        "(b: initiator, N targets)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_file_becomes_one_chart_per_measure() {
        let dir = std::env::temp_dir().join(format!("ferry-scale-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("run.json");
        let point = |mode: &str, n: u64, per: &str| {
            format!(
                r#"{{"mode":"{mode}","n":{n},"threads":5,"fds":{},"rss_per_conn_kib":{per},"cpu_s_per_gb":0.2,"gb_per_s":2.5,"served":{n}}}"#,
                4 * n + 13
            )
        };
        let points = [
            point("a", 1, "null"),
            point("a", 16, "9.1"),
            point("b", 1, "null"),
        ];
        std::fs::write(
            &file,
            format!(r#"{{"label":"new","points":[{}]}}"#, points.join(",")),
        )
        .unwrap();
        plot(std::slice::from_ref(&file), &dir).unwrap();
        for (name, ..) in CHARTS {
            assert!(dir.join(name).exists(), "{name} was not drawn");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_result_says_so() {
        let dir = std::env::temp_dir().join(format!("ferry-scale-plot-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("other.json");
        std::fs::write(&file, r#"{"points": 3}"#).unwrap();
        let err = plot(std::slice::from_ref(&file), &dir).unwrap_err();
        assert!(err.contains("not a result of scripts/scale.sh"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
