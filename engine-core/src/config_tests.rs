//! The configuration rules: every key reached by name and by its variable
//! alike, bad values rejected with the reason, nothing clamped or defaulted.

use super::*;
use std::collections::HashMap;

/// (key, a value it accepts, how `get` shows it, values it rejects).
fn samples(token_file: &str) -> Vec<(&'static str, String, String, Vec<&'static str>)> {
    let s = |v: &str| v.to_string();
    vec![
        (
            "listen",
            s("0.0.0.0:7000"),
            s("0.0.0.0:7000"),
            vec!["7000", "a b:1"],
        ),
        ("hostname", s("node-1"), s("node-1"), vec![]),
        (
            "timeout_ms",
            s("250"),
            s("250"),
            vec!["0", "soon", "-5", "1.5", "99999999999"],
        ),
        ("connect_timeout_ms", s("100"), s("100"), vec!["0", "x"]),
        ("idle_timeout_s", s("30"), s("30"), vec!["0", "86401", "x"]),
        ("spin_us", s("0"), s("0"), vec!["-1", "1000001", "fast"]),
        (
            "gpu_direct",
            s("dmabuf"),
            s("dmabuf"),
            vec!["yes", "rdma", "1"],
        ),
        (
            "staging_chunk",
            s("16M"),
            s("16777216"),
            vec!["1K", "128M", "4X", "", "lots"],
        ),
        ("staging_depth", s("8"), s("8"), vec!["0", "17", "four"]),
        ("select", s("declared"), s("declared"), vec!["fastest"]),
        ("prefer", s(" tcp "), s("tcp"), vec!["tcp shm"]),
        ("metrics", s("off"), s("off"), vec!["sometimes"]),
        ("hugepages", s("off"), s("off"), vec!["0", "sometimes"]),
        (
            "metrics_listen",
            s("127.0.0.1:9464"),
            s("127.0.0.1:9464"),
            vec![],
        ),
        (
            "plugin_path",
            s("/opt/a:/opt/b"),
            s("/opt/a:/opt/b"),
            vec![],
        ),
        ("transports", s("^rdma"), s("^rdma"), vec![]),
        (
            "plugin_probe_timeout_ms",
            s("500"),
            s("500"),
            vec!["0", "x"],
        ),
        ("plugin_probe_helper", s("off"), s("off"), vec![]),
        ("plugin_cache", s("/tmp/c.json"), s("/tmp/c.json"), vec![]),
        ("sysfs_root", s("/tmp/fake-sys"), s("/tmp/fake-sys"), vec![]),
        ("nics", s("^mlx5_2"), s("^mlx5_2"), vec![]),
        ("topology_file", s("/etc/t.json"), s("/etc/t.json"), vec![]),
        (
            "metadata",
            s("etcd://10.0.0.1:2379"),
            s("etcd://10.0.0.1:2379"),
            vec!["zk://a:1", "etcd://"],
        ),
        (
            "metadata_prefix",
            s("/cluster-a/"),
            s("/cluster-a"),
            vec!["a b"],
        ),
        ("metadata_ttl_s", s("30"), s("30"), vec!["1", "3601", "x"]),
        (
            "metadata_cacert",
            s(token_file),
            s(token_file),
            vec!["/nonexistent/ca.crt"],
        ),
        (
            "metadata_cert",
            s(token_file),
            s(token_file),
            vec!["/nonexistent/c.crt"],
        ),
        (
            "metadata_key",
            s(token_file),
            s(token_file),
            vec!["/nonexistent/c.key"],
        ),
        ("metadata_user", s("ferry"), s("ferry"), vec!["a\u{1}"]),
        (
            "metadata_password_file",
            s(token_file),
            s(token_file),
            vec!["/nonexistent/pw"],
        ),
        ("name", s("prefill-0"), s("prefill-0"), vec!["a/b", "\u{1}"]),
        (
            "auth_token_file",
            s(token_file),
            s(token_file),
            vec!["/nonexistent/token"],
        ),
        ("auth_token", s("s3cret"), s("(set)"), vec![]),
        ("auth", s("off"), s("off"), vec!["maybe"]),
        ("auth_timeout_ms", s("250"), s("250"), vec!["0", "soon"]),
        ("auth_max_pending", s("16"), s("16"), vec!["0", "many"]),
        ("auth_max_pending_per_host", s("2"), s("2"), vec!["0", "-1"]),
        (
            "control_max_per_host",
            s("4"),
            s("4"),
            vec!["0", "129", "x"],
        ),
        ("integrity", s("payload"), s("payload"), vec!["full"]),
    ]
}

fn token_file() -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), "from-file\nignored\n").unwrap();
    f
}

/// A configuration on which `key` can be set (the etcd keys need a store).
fn base_for(key: &str) -> EngineConfig {
    let mut c = EngineConfig::default();
    if key.starts_with("metadata_") {
        c.set("metadata", "etcd://127.0.0.1:2379").unwrap();
    }
    c
}

#[test]
fn every_key_is_sampled_and_listed_once() {
    let f = token_file();
    let sampled: Vec<_> = samples(&f.path().display().to_string())
        .iter()
        .map(|s| s.0)
        .collect();
    let listed: Vec<_> = KEYS.iter().map(|k| k.key).collect();
    assert_eq!(sampled, listed);
    let mut envs: Vec<_> = KEYS.iter().map(|k| k.env).collect();
    envs.sort();
    envs.dedup();
    assert_eq!(envs.len(), KEYS.len(), "two keys share a variable");
    for k in KEYS {
        assert_eq!(k.env, ferry_loader::config_env_var(k.key), "{}", k.key);
    }
}

#[test]
fn each_key_reads_the_same_from_its_name_and_its_variable() {
    let f = token_file();
    for (key, value, shown, _) in samples(&f.path().display().to_string()) {
        let mut by_name = base_for(key);
        by_name.set(key, &value).unwrap();
        assert_eq!(by_name.get(key).unwrap(), shown, "{key} by name");

        let env_var = KEYS.iter().find(|k| k.key == key).unwrap().env;
        let mut env: HashMap<&str, String> = HashMap::new();
        if key.starts_with("metadata_") {
            env.insert("FERRY_METADATA", "etcd://127.0.0.1:2379".into());
        }
        env.insert(env_var, value.clone());
        let by_env = EngineConfig::from_lookup(|n| env.get(n).map(OsString::from)).unwrap();
        assert_eq!(by_env.get(key).unwrap(), shown, "{key} from {env_var}");
        assert_eq!(by_env.effective(), by_name.effective(), "{key}");
    }
}

#[test]
fn bad_values_are_rejected_with_the_reason_and_change_nothing() {
    let f = token_file();
    for (key, _, _, bads) in samples(&f.path().display().to_string()) {
        for bad in bads {
            let mut c = base_for(key);
            let before = c.effective();
            let e = c
                .set(key, bad)
                .expect_err(&format!("{key} = {bad:?} accepted"));
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{key} = {bad:?}");
            assert!(
                e.message.contains(key) && e.message.contains("rejected"),
                "{key} = {bad:?}: {}",
                e.message
            );
            assert_eq!(
                c.effective(),
                before,
                "{key} = {bad:?} changed the configuration"
            );
        }
    }
}

#[test]
fn a_bad_variable_is_an_error_naming_the_variable() {
    for (var, value) in [
        ("FERRY_GPU_DIRECT", "yes"),
        ("FERRY_STAGING_CHUNK", "1K"),
        ("FERRY_STAGING_DEPTH", "100"),
        ("FERRY_PLUGIN_PROBE_TIMEOUT_MS", "soon"),
        ("FERRY_TIMEOUT_MS", "0"),
    ] {
        let e = EngineConfig::from_lookup(|n| (n == var).then(|| OsString::from(value)))
            .expect_err(var);
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(
            e.message.contains(var) && e.message.contains(value),
            "{}",
            e.message
        );
    }
    let not_utf8 = {
        use std::os::unix::ffi::OsStringExt;
        OsString::from_vec(vec![0xff, 0xfe])
    };
    let e =
        EngineConfig::from_lookup(|n| (n == "FERRY_LISTEN").then(|| not_utf8.clone())).unwrap_err();
    assert!(e.message.contains("FERRY_LISTEN") && e.message.contains("UTF-8"));
}

#[test]
fn empty_variables_count_as_unset() {
    let c = EngineConfig::from_lookup(|n| n.starts_with("FERRY_").then(OsString::new)).unwrap();
    assert_eq!(c.effective(), EngineConfig::default().effective());
}

#[test]
fn cuda_visible_devices_stays_cudas_own() {
    let c =
        EngineConfig::from_lookup(|n| (n == "CUDA_VISIBLE_DEVICES").then(|| "1,0".into())).unwrap();
    assert_eq!(c.topology.cuda_visible_devices.as_deref(), Some("1,0"));
}

#[test]
fn unknown_keys_are_rejected_and_plugin_settings_kept() {
    let mut c = EngineConfig::default();
    let e = c.set("colour", "blue").unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    assert!(e.message.contains("unknown option") && e.message.contains("staging_depth"));
    assert!(c.set(".x", "1").is_err() && c.set("x.", "1").is_err());
    c.set("tcp.connections", "3").unwrap();
    assert_eq!(c.get("tcp.connections").unwrap(), "3");
    assert_eq!(c.get("vendor.token").unwrap_err().code, ErrorCode::NotFound);
    c.set("vendor.token", "hidden").unwrap();
    assert_eq!(c.get("vendor.token").unwrap(), "(set)");
    assert_eq!(c.effective()["tcp.connections"], "3");
}

#[test]
fn the_engine_hands_plugins_its_own_values() {
    let mut c = EngineConfig::default();
    c.set("timeout_ms", "250").unwrap();
    c.set("sysfs_root", "/tmp/fake-sys").unwrap();
    c.set("auth_token", "s3cret").unwrap();
    c.set("tcp.connections", "2").unwrap();
    let s = c.plugin_settings(Some("10.0.0.5"));
    assert_eq!(s["timeout_ms"], "250");
    assert_eq!(s["connect_timeout_ms"], "5000");
    assert_eq!(s["idle_timeout_s"], "120");
    assert_eq!(s["sysfs_root"], "/tmp/fake-sys");
    assert_eq!(s["hostname"], "10.0.0.5");
    assert_eq!(s["auth.token"], "s3cret");
    assert_eq!(s["tcp.connections"], "2");
    assert!(!c.plugin_settings(None).contains_key("hostname"));
}

#[test]
fn every_variable_is_documented() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md"),
    )
    .unwrap();
    for k in KEYS {
        assert!(
            doc.contains(&format!("`{}`", k.env)) && doc.contains(&format!("`{}`", k.key)),
            "docs/configuration.md lacks {} / {}",
            k.env,
            k.key
        );
    }
}
