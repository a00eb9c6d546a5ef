//! The matrix of bad plugins, each dropped on FERRY_PLUGIN_PATH and run
//! against the three kinds of host Ferry has: `ferry info` (JSON, cold
//! cache; text, warm cache), `ferry demo` (two processes) and a C program
//! that embeds libferry.so (tests/c/embed.c). Every case must leave the host
//! alive (exit status 0), list the plugin with the right state, stage and
//! reason, keep every plugin string off the terminal unescaped, and leave
//! the demo and the embedded transfer working.
//!
//! The plugins come from tests/plugins/c/misbehaving.c, compiled at test
//! time. Each case is its own test, so the harness runs them side by side.

use ferry_tests::{built, c_compiler, compile_shared, ferry_bin, repo_root, target_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

struct Case {
    /// The plugin's name (its file is libferry_transport_<name>.so).
    name: &'static str,
    defines: &'static [&'static str],
    state: &'static str,
    stage: &'static str,
    /// Part of the reason, exactly as the JSON gives it.
    reason: &'static str,
    /// FERRY_PLUGIN_PROBE_TIMEOUT_MS for the hosts of this case.
    timeout_ms: Option<u32>,
}

/// The embedding program, compiled once per run against target/debug.
fn embed_program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = target_dir().join("ferry-test-c");
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("embed");
        let lib = built("libferry.so");
        let libdir = lib.parent().unwrap();
        let out = Command::new(c_compiler())
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
            .arg(repo_root().join("capi/include"))
            .arg("-I")
            .arg(repo_root().join("plugins-abi/include"))
            .arg("-o")
            .arg(&exe)
            .arg(repo_root().join("tests/c/embed.c"))
            .arg(format!("-L{}", libdir.display()))
            .arg("-lferry")
            .arg(format!("-Wl,-rpath,{}", libdir.display()))
            .output()
            .expect("run the C compiler");
        assert!(
            out.status.success(),
            "compiling tests/c/embed.c:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
}

fn build(case: &Case, dir: &Path) -> PathBuf {
    let out = dir.join(format!(
        "libferry_transport_{}.so",
        case.name.replace('-', "_")
    ));
    let name = format!("-DPLUGIN_NAME=\"{}\"", case.name);
    let mut args = vec![name.as_str()];
    args.extend_from_slice(case.defines);
    compile_shared(
        &[repo_root().join("tests/plugins/c/misbehaving.c")],
        &out,
        &args,
    );
    out
}

/// A host process with the case's plugins and a cache file of its own.
fn host(mut cmd: Command, case: &Case, plugins: &Path, cache: &Path) -> Output {
    cmd.env("FERRY_PLUGIN_PATH", plugins)
        .env("FERRY_PLUGIN_CACHE", cache)
        .env("FERRY_LOG", "info")
        .env_remove("FERRY_TRANSPORTS")
        .env_remove("FERRY_PLUGIN_PROBE_HELPER");
    match case.timeout_ms {
        Some(ms) => cmd.env("FERRY_PLUGIN_PROBE_TIMEOUT_MS", ms.to_string()),
        None => cmd.env_remove("FERRY_PLUGIN_PROBE_TIMEOUT_MS"),
    };
    cmd.output().expect("start the host")
}

/// The host lived and exited 0; no escape character reached its output.
fn alive(what: &str, out: &Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what}: the host did not survive ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for (stream, text) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !text.contains('\x1b') && !text.contains('\x07') && !text.contains('\u{202e}'),
            "{what}: a raw escape reached {stream}:\n{text:?}"
        );
    }
    (stdout, stderr)
}

fn plugin_entry<'a>(info: &'a Value, name: &str, path: &Path) -> &'a Value {
    info["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .find(|p| p["name"] == name && Path::new(p["path"].as_str().unwrap_or("")) == path)
        .unwrap_or_else(|| panic!("{name} not listed: {info:#}"))
}

fn check_entry(what: &str, case: &Case, p: &Value) {
    assert_eq!(p["state"], case.state, "{what}: {p:#}");
    assert_eq!(p["stage"], case.stage, "{what}: {p:#}");
    let reason = p["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains(case.reason),
        "{what}: reason {reason:?} should contain {:?}",
        case.reason
    );
}

fn run(case: Case) {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let path = build(&case, &plugins);

    // ferry info --json, cold: every plugin goes through a probe child.
    let cache = dir.path().join("info-cache.json");
    let mut cmd = Command::new(ferry_bin());
    cmd.args(["info", "--json"]);
    let (stdout, _) = alive("ferry info --json", &host(cmd, &case, &plugins, &cache));
    let info: Value = serde_json::from_str(&stdout).expect("ferry info prints JSON");
    assert_eq!(info["probing"]["isolation"], "child-process", "{info:#}");
    assert_eq!(info["probing"]["from_cache"], 0, "{info:#}");
    let entry = plugin_entry(&info, case.name, &path);
    check_entry("ferry info --json", &case, entry);
    if case.state != "shadowed" {
        assert_eq!(entry["probe_source"], "child-process", "{entry:#}");
    }

    // ferry info, warm: nothing probed again, strings escaped.
    let mut cmd = Command::new(ferry_bin());
    cmd.arg("info");
    let (text, _) = alive("ferry info", &host(cmd, &case, &plugins, &cache));
    assert!(
        text.contains("0 probed in child processes, 0 in this process"),
        "a warm start probes nothing:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(case.name) && l.contains(&*path.to_string_lossy()))
        .unwrap_or_else(|| panic!("ferry info lists no {}:\n{text}", case.name));
    assert!(line.contains(case.state), "{line}\n{text}");

    // ferry demo: a real transfer between two processes, both hosts.
    let mut cmd = Command::new(ferry_bin());
    cmd.args(["demo", "--size", "4M", "--block", "1M"]);
    let demo_cache = dir.path().join("demo-cache.json");
    let (demo, _) = alive("ferry demo", &host(cmd, &case, &plugins, &demo_cache));
    assert!(demo.contains("OK: every byte arrived"), "{demo}");
    assert!(
        demo.lines()
            .any(|l| l.contains(&format!(" {} ", case.name)) && l.contains(case.state)),
        "ferry demo lists {} as {}:\n{demo}",
        case.name,
        case.state
    );

    // A C program embedding libferry.so: lists the plugin, moves data.
    let embed_cache = dir.path().join("embed-cache.json");
    let (out, _) = alive(
        "embedding C program",
        &host(Command::new(embed_program()), &case, &plugins, &embed_cache),
    );
    let json = out
        .lines()
        .find_map(|l| l.strip_prefix("INFO "))
        .unwrap_or_else(|| panic!("no INFO line:\n{out}"));
    let info: Value = serde_json::from_str(json).expect("ferry_info_json gives JSON");
    check_entry(
        "embedding C program",
        &case,
        plugin_entry(&info, case.name, &path),
    );
    assert!(out.contains("TRANSFER OK"), "{out}");

    extra_checks(&case, &info, &text, &demo);
}

/// What some cases show beyond state and reason.
fn extra_checks(case: &Case, info: &Value, text: &str, demo: &str) {
    match case.name {
        "escapes" => {
            // JSON keeps the plugin's strings exact...
            let p = info["plugins"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == "escapes")
                .unwrap();
            assert_eq!(p["version"], "1.0\x1b[2J");
            assert_eq!(
                p["reason"],
                "\x1b[2J\x1b[Hall clear\n      why: enabled, trust me"
            );
            assert_eq!(p["notes"][0]["key"], "title\x1b]0;pwned\x07");
            // ...the terminal gets them escaped, and no forged line.
            assert!(text.contains("1.0\\x1b[2J"), "{text}");
            assert!(
                text.contains("evil\\n      why: forged line\\x1b]0;pwned\\x07"),
                "{text}"
            );
            assert!(
                text.contains("\\x1b[2J\\x1b[Hall clear\\n      why: enabled"),
                "{text}"
            );
            assert!(text.contains("abc\\u{202e}fed"), "{text}");
            for forged in ["why: forged", "why: enabled, trust me"] {
                assert!(
                    !text.lines().any(|l| l.trim_start().starts_with(forged)),
                    "a plugin forged a line of ferry info:\n{text}"
                );
                assert!(
                    !demo.lines().any(|l| l.trim_start().starts_with(forged)),
                    "a plugin forged a line of ferry demo:\n{demo}"
                );
            }
        }
        "tcp" => {
            let warnings = info["warnings"].as_array().expect("warnings");
            assert!(
                warnings.iter().any(|w| {
                    let w = w.as_str().unwrap_or("");
                    w.contains("transport plugin 'tcp'") && w.contains("in place of Ferry's own")
                }),
                "shadowing a built-in is a top-level warning: {warnings:?}"
            );
            let builtin = info["plugins"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == "tcp" && p["origin"] == "dev-build")
                .expect("Ferry's own tcp is listed");
            assert_eq!(builtin["state"], "shadowed");
            assert!(text.contains("Warnings:"), "{text}");
            assert!(text.contains("in place of Ferry's own"), "{text}");
            assert!(text.contains("shadows: "), "{text}");
        }
        _ => {}
    }
}

macro_rules! cases {
    ($($test:ident: $case:expr;)*) => {$(
        #[test]
        fn $test() {
            run($case);
        }
    )*};
}

cases! {
    wrong_abi_major: Case {
        name: "wrong-abi", defines: &["-DTABLE_ABI_MAJOR=7"], state: "disabled",
        stage: "discovered", reason: "its transport table says plugin ABI 7.0", timeout_ms: None,
    };
    newer_major_only: Case {
        name: "next-major", defines: &["-DENTRY_V2_ONLY"], state: "disabled",
        stage: "discovered", reason: "built for plugin ABI v2", timeout_ms: None,
    };
    missing_entry_symbol: Case {
        name: "no-entry", defines: &["-DNO_ENTRY"], state: "disabled", stage: "discovered",
        reason: "exports no ferry_transport_plugin_v1 entry symbol", timeout_ms: None,
    };
    missing_symbol: Case {
        name: "missing-symbol", defines: &["-DMISSING_SYMBOL"], state: "disabled",
        stage: "discovered", reason: "needs the symbol ferry_vendor_symbol_nobody_defines",
        timeout_ms: None,
    };
    null_table: Case {
        name: "null-table", defines: &["-DNULL_TABLE"], state: "disabled", stage: "discovered",
        reason: "its entry function returned no table", timeout_ms: None,
    };
    null_probe: Case {
        name: "null-probe", defines: &["-DNULL_PROBE"], state: "disabled", stage: "discovered",
        reason: "its table has no probe function (required)", timeout_ms: None,
    };
    incomplete_data_path: Case {
        name: "incomplete", defines: &["-DINCOMPLETE"], state: "disabled", stage: "discovered",
        reason: "its table has init but not get_endpoint, register_memory, unregister_memory, \
                 connect, disconnect, submit",
        timeout_ms: None,
    };
    abort_in_probe: Case {
        name: "probe-abort", defines: &["-DPROBE_ABORT"], state: "disabled", stage: "loaded",
        reason: "probe crashed: SIGABRT", timeout_ms: None,
    };
    segv_in_probe: Case {
        name: "probe-segv", defines: &["-DPROBE_SEGV"], state: "disabled", stage: "loaded",
        reason: "probe crashed: SIGSEGV", timeout_ms: None,
    };
    abort_in_constructor: Case {
        name: "ctor-abort", defines: &["-DCTOR_ABORT"], state: "disabled", stage: "discovered",
        reason: "loading it crashed: SIGABRT", timeout_ms: None,
    };
    segv_in_constructor: Case {
        name: "ctor-segv", defines: &["-DCTOR_SEGV"], state: "disabled", stage: "discovered",
        reason: "loading it crashed: SIGSEGV", timeout_ms: None,
    };
    probe_that_hangs: Case {
        name: "probe-hangs", defines: &["-DPROBE_HANGS"], state: "disabled", stage: "loaded",
        reason: "its probe did not finish within 2000 ms", timeout_ms: Some(2000),
    };
    probe_that_times_out_then_returns: Case {
        name: "probe-slow", defines: &["-DPROBE_SLOW_MS=5000"], state: "disabled",
        stage: "loaded", reason: "its probe did not finish within 2000 ms",
        timeout_ms: Some(2000),
    };
    escape_codes_in_strings: Case {
        name: "escapes", defines: &["-DESCAPES"], state: "disabled", stage: "probed",
        reason: "all clear", timeout_ms: None,
    };
    same_named_shadow_of_a_builtin: Case {
        name: "tcp", defines: &[], state: "enabled", stage: "probed",
        reason: "probe passed", timeout_ms: None,
    };
}
