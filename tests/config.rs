//! One configuration path and one info report, seen from outside: the same
//! settings reach the same keys from the environment, from C
//! (`ferry_config_set` / `ferry_config_get`) and in `ferry info --json`; a
//! bad value is rejected with its reason everywhere; and `ferry info --json`
//! equals C's `ferry_info_json()` (tests/c/config.c). Python's side is
//! python/tests/test_config.py.

use ferry_core::config::KEYS;
use ferry_tests::{built, c_compiler, ferry_bin, repo_root, target_dir, write_fixture};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// tests/c/config.c, linked against target/debug/libferry.so directly (not
/// through a copy), so libferry finds plugins where the `ferry` binary
/// beside it does.
fn c_program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = target_dir().join("ferry-test-c");
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("config");
        let lib = built("libferry.so");
        let libdir = lib.parent().unwrap();
        let out = Command::new(c_compiler())
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
            .arg(repo_root().join("capi/include"))
            .arg("-I")
            .arg(repo_root().join("plugins-abi/include"))
            .arg("-o")
            .arg(&exe)
            .arg(repo_root().join("tests/c/config.c"))
            .arg(format!("-L{}", libdir.display()))
            .arg("-lferry")
            .arg(format!("-Wl,-rpath,{}", libdir.display()))
            .output()
            .expect("run the C compiler");
        assert!(
            out.status.success(),
            "compiling tests/c/config.c:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
}

/// `cmd` with no FERRY_* variable of the caller's, then `env`.
fn with_env<'a>(mut cmd: Command, env: impl IntoIterator<Item = (&'a str, String)>) -> Command {
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("FERRY_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env);
    cmd
}

fn run(mut cmd: Command) -> Output {
    cmd.output().expect("run a test program")
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A valid value for every engine key; paths inside `dir`.
fn samples(dir: &Path) -> Vec<(&'static str, String)> {
    let token = dir.join("token");
    std::fs::write(&token, "from-file\n").unwrap();
    let p = |name: &str| dir.join(name).display().to_string();
    let values: BTreeMap<&str, String> = [
        ("listen", "127.0.0.1:0".to_string()),
        ("hostname", "node-1".into()),
        ("timeout_ms", "250".into()),
        ("connect_timeout_ms", "100".into()),
        ("idle_timeout_s", "30".into()),
        ("spin_us", "0".into()),
        ("gpu_direct", "off".into()),
        ("staging_chunk", "16M".into()),
        ("staging_depth", "8".into()),
        ("plugin_path", p("plugins")),
        ("transports", "^rdma".into()),
        ("plugin_probe_timeout_ms", "5000".into()),
        ("plugin_probe_helper", "auto".into()),
        ("plugin_cache", "off".into()),
        ("sysfs_root", p("sys")),
        ("nics", "^mlx5_2".into()),
        ("topology_file", p("topology.json")),
        ("metadata", "etcds://127.0.0.1:2379".into()),
        ("metadata_prefix", "/cluster-a".into()),
        ("metadata_ttl_s", "30".into()),
        // Any readable file: the contents are checked when a store connects.
        ("metadata_cacert", token.display().to_string()),
        ("metadata_cert", token.display().to_string()),
        ("metadata_key", token.display().to_string()),
        ("metadata_user", "ferry".into()),
        ("metadata_password_file", token.display().to_string()),
        ("name", "prefill-0".into()),
        ("auth_token_file", token.display().to_string()),
        ("auth_token", "s3cret".into()),
        ("auth", "required".into()),
        ("select", "declared".into()),
        ("prefer", "tcp".into()),
        ("metrics", "off".into()),
        ("hugepages", "off".into()),
        ("metrics_listen", "127.0.0.1:9464".into()),
        ("auth_timeout_ms", "750".into()),
        ("auth_max_pending", "32".into()),
        ("auth_max_pending_per_host", "4".into()),
        ("control_max_per_host", "16".into()),
        ("integrity", "payload".into()),
    ]
    .into_iter()
    .collect();
    // In KEYS order: a store before its prefix.
    KEYS.iter()
        .map(|k| {
            let v = values
                .get(k.key)
                .unwrap_or_else(|| panic!("no sample for key {}", k.key));
            (k.key, v.clone())
        })
        .collect()
}

fn env_var(key: &str) -> &'static str {
    KEYS.iter().find(|k| k.key == key).unwrap().env
}

/// "KEY=VALUE" lines of the C program as a map.
fn parse_get(o: &Output) -> BTreeMap<String, String> {
    assert!(o.status.success(), "{}", text(o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn info_cli(env: Vec<(&str, String)>) -> Value {
    let mut cmd = Command::new(ferry_bin());
    cmd.args(["info", "--json"]);
    let o = run(with_env(cmd, env));
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).expect("ferry info --json is JSON")
}

#[test]
fn every_key_reads_the_same_from_the_environment_c_and_ferry_info() {
    let dir = tempfile::tempdir().unwrap();
    let samples = samples(dir.path());
    let keys: Vec<String> = samples.iter().map(|(k, _)| k.to_string()).collect();
    let env: Vec<(&str, String)> = samples
        .iter()
        .map(|(k, v)| (env_var(k), v.clone()))
        .collect();

    let mut by_env = Command::new(c_program());
    by_env.arg("get").args(&keys);
    let by_env = parse_get(&run(with_env(by_env, env.clone())));

    let mut by_set = Command::new(c_program());
    by_set
        .arg("get")
        .args(&keys)
        .arg("--")
        .args(samples.iter().map(|(k, v)| format!("{k}={v}")));
    let by_set = parse_get(&run(with_env(by_set, [])));

    assert_eq!(by_env.len(), KEYS.len());
    assert_eq!(by_env, by_set, "environment and ferry_config_set disagree");
    assert_eq!(by_env["staging_chunk"], "16777216");
    assert_eq!(by_env["gpu_direct"], "off");
    assert_eq!(by_env["auth_token"], "(set)", "a secret is never echoed");

    let info = info_cli(env);
    let config = info["config"].as_object().expect("info has config");
    for (k, v) in &by_env {
        assert_eq!(
            config[k].as_str(),
            Some(v.as_str()),
            "ferry info config.{k}"
        );
    }
    assert_eq!(info["gpu_direct"]["policy"], "off");
}

#[test]
fn bad_values_are_rejected_with_the_reason_from_every_side() {
    for (key, bad) in [
        ("gpu_direct", "yes"),
        ("staging_chunk", "1K"),
        ("staging_depth", "17"),
        ("plugin_probe_timeout_ms", "soon"),
        ("idle_timeout_s", "0"),
    ] {
        let var = env_var(key);
        // C, by name: a code and a message naming the key and the value.
        let mut set = Command::new(c_program());
        set.args(["get", key, "--", &format!("{key}={bad}")]);
        let o = run(with_env(set, []));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !o.status.success()
                && out.starts_with("ERR FERRY_ERR_INVALID_ARGUMENT ")
                && out.contains(&format!("setting {key} = \"{bad}\" rejected")),
            "C set {key}={bad}: {}",
            text(&o)
        );
        // C, from the environment: ferry_config_new names the variable.
        let mut new = Command::new(c_program());
        new.args(["get", key]);
        let o = run(with_env(new, [(var, bad.to_string())]));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.starts_with("ERR FERRY_ERR_INVALID_ARGUMENT ") && out.contains(var),
            "C {var}={bad}: {}",
            text(&o)
        );
        // C's info report and the CLI refuse to report on a bad setting.
        let mut info = Command::new(c_program());
        info.arg("info");
        let o = run(with_env(info, [(var, bad.to_string())]));
        assert!(
            String::from_utf8_lossy(&o.stdout).starts_with("ERR FERRY_ERR_INVALID_ARGUMENT "),
            "C info with {var}={bad}: {}",
            text(&o)
        );
        let mut cli = Command::new(ferry_bin());
        cli.args(["info", "--json"]);
        let o = run(with_env(cli, [(var, bad.to_string())]));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.code() == Some(1) && err.contains(var) && err.contains("rejected"),
            "ferry info with {var}={bad}: {}",
            text(&o)
        );
    }
    // An unknown key is refused by name; an unknown key read back is NOT_FOUND.
    let mut set = Command::new(c_program());
    set.args(["get", "listen", "--", "colour=blue"]);
    let o = run(with_env(set, []));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("unknown option \"colour\""),
        "{}",
        text(&o)
    );
    let mut get = Command::new(c_program());
    get.args(["get", "colour"]);
    let o = run(with_env(get, []));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("ERR FERRY_ERR_NOT_FOUND "),
        "{}",
        text(&o)
    );
}

/// Drops what differs between two runs of the same report: time spent
/// loading and probing each plugin, and what a probe measured (a declared
/// bandwidth taken from a memcpy at probe time, and the detail that states
/// it).
fn without_timings(mut v: Value) -> Value {
    if let Some(plugins) = v["plugins"].as_array_mut() {
        for p in plugins {
            if let Some(p) = p.as_object_mut() {
                p.remove("load_us");
                p.remove("probe_us");
                if let Some(devices) = p.get_mut("devices").and_then(Value::as_array_mut) {
                    for d in devices.iter_mut().filter_map(Value::as_object_mut) {
                        d.remove("bandwidth_mbps");
                        d.remove("detail");
                    }
                }
            }
        }
    }
    v
}

#[test]
fn ferry_info_json_equals_the_c_report() {
    let dir = tempfile::tempdir().unwrap();
    let sys = dir.path().join("sys");
    write_fixture("dgx-h100", &sys);
    // No cache: both runs probe every plugin in a child, so even the
    // probing counts must agree.
    let env = vec![
        ("FERRY_SYSFS_ROOT", sys.display().to_string()),
        ("FERRY_PLUGIN_CACHE", "off".to_string()),
        ("FERRY_STAGING_DEPTH", "8".to_string()),
        ("FERRY_GPU_DIRECT", "peermem".to_string()),
        ("FERRY_TRANSPORTS", "tcp,shm,rdma".to_string()),
    ];
    let cli = info_cli(env.clone());
    let mut c = Command::new(c_program());
    c.arg("info");
    let o = run(with_env(c, env));
    assert!(o.status.success(), "{}", text(&o));
    let c: Value = serde_json::from_slice(&o.stdout).expect("ferry_info_json is JSON");
    assert!(
        !cli["plugins"].as_array().unwrap().is_empty(),
        "no plugin found: nothing was compared"
    );
    assert!(
        !cli["gpus"].as_array().unwrap().is_empty(),
        "the fixture has GPUs"
    );
    assert_eq!(cli["config"]["staging_depth"], "8");
    assert_eq!(without_timings(cli), without_timings(c));
}
