//! `ferry bench initiator --pattern kv` against a `ferry bench target` over
//! tcp, briefly and with `--verify`, through both APIs and both ways: the
//! benchmark the KV-shaped figures come from must not break silently.
//! Nothing here is timed.

use ferry_tests::{ferry_bin, TargetProcess};
use std::process::{Command, Output};

fn kv_initiator(segment: &str, extra: &[&str]) -> Output {
    Command::new(ferry_bin())
        .args([
            "bench",
            "initiator",
            "--pattern",
            "kv",
            "--segment",
            segment,
        ])
        .args(["--block-size", "16K", "--duration", "0.2"])
        .args(extra)
        .env("FERRY_TRANSPORTS", "tcp")
        .output()
        .expect("run ferry bench initiator")
}

#[test]
fn kv_pattern_moves_verified_blocks_through_both_apis() {
    let target = TargetProcess::start(
        &["--buffer-size", "8M", "--layout-block", "4K,16K"],
        &[("FERRY_TRANSPORTS", "tcp")],
        &[],
    );
    for api in ["layout", "requests"] {
        for op in ["write", "read"] {
            let out = kv_initiator(
                &target.segment,
                &[
                    "--batch-bytes",
                    "1M",
                    "--api",
                    api,
                    "--op",
                    op,
                    "--verify",
                    "--json",
                ],
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{api} {op}: {stdout}\n{stderr}");
            let report: serde_json::Value = serde_json::from_str(stdout.trim())
                .unwrap_or_else(|e| panic!("{api} {op}: not one JSON object ({e}): {stdout}"));
            assert_eq!(report["pattern"], "kv", "{report}");
            assert_eq!(report["api"], api, "{report}");
            assert_eq!(report["op"], op, "{report}");
            assert_eq!(report["transport"], "tcp", "{report}");
            assert_eq!(report["verified"], true, "{report}");
            assert_eq!(report["blocks_per_batch"], 64, "{report}");
            assert_eq!(report["limit_kind"], "memcpy", "{report}");
            assert!(report["batches"].as_u64().unwrap_or(0) >= 1, "{report}");
            for key in [
                "gb_per_s",
                "blocks_per_s",
                "limit_gb_per_s",
                "ratio",
                "submit_p50_us",
            ] {
                assert!(report[key].as_f64().is_some(), "{key} missing: {report}");
            }
            for key in ["p50", "p99"] {
                assert!(report["latency_us"][key].as_f64().is_some(), "{report}");
            }
        }
    }
}

#[test]
fn kv_pattern_says_what_the_target_lacks() {
    // No layout of 16 KiB blocks: the layout API cannot name them.
    let target = TargetProcess::start(
        &["--buffer-size", "4M", "--layout-block", "4K"],
        &[("FERRY_TRANSPORTS", "tcp")],
        &[],
    );
    let out = kv_initiator(&target.segment, &["--blocks", "8", "--api", "layout"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--layout-block 16384"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // A batch larger than the target's pool.
    let out = kv_initiator(&target.segment, &["--api", "requests", "--blocks", "1000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("holds 256 blocks"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
