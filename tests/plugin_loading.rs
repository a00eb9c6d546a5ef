//! The loader against real plugin files: a C plugin built from the header
//! alone, and plugins that are wrong in every way the loader must explain.

use ferry_loader::{EnvHost, LoaderConfig, NameFilter, PluginKind, PluginSet, PluginState, Stage};
use ferry_tests::{built, compile_shared, ferry_bin, repo_root};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

fn example_c_plugin() -> PathBuf {
    repo_root().join("examples/c-plugin/memcpy_transport.c")
}

fn misbehaving_c() -> PathBuf {
    repo_root().join("tests/plugins/c/misbehaving.c")
}

/// Builds the example C plugin into `dir`.
fn build_memcpy(dir: &Path) -> PathBuf {
    let out = dir.join("libferry_transport_memcpy.so");
    compile_shared(&[example_c_plugin()], &out, &[]);
    out
}

/// Builds one variant of the misbehaving plugin as libferry_transport_<name>.so.
fn build_variant(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let out = dir.join(format!("libferry_transport_{name}.so"));
    let name_define = format!("-DPLUGIN_NAME=\"{name}\"");
    let mut args: Vec<&str> = vec![&name_define];
    args.extend_from_slice(defines);
    compile_shared(&[misbehaving_c()], &out, &args);
    out
}

fn load_from(dirs: &[&Path]) -> PluginSet {
    PluginSet::load(
        &LoaderConfig::only(dirs.iter().map(|d| d.to_path_buf())),
        Arc::new(EnvHost),
    )
}

fn plugin<'a>(set: &'a PluginSet, name: &str) -> &'a ferry_loader::PluginReport {
    &set.plugins
        .iter()
        .find(|p| p.report.name == name)
        .unwrap_or_else(|| panic!("plugin {name} not discovered"))
        .report
}

#[test]
fn c_plugin_built_from_the_header_alone_is_discovered_probed_and_enabled() {
    let dir = tempfile::tempdir().unwrap();
    let path = build_memcpy(dir.path());
    let set = load_from(&[dir.path()]);
    assert_eq!(set.plugins.len(), 1);
    let p = plugin(&set, "memcpy");
    assert_eq!(p.state, PluginState::Enabled, "reason: {}", p.reason);
    assert_eq!(p.stage, Stage::Probed);
    assert_eq!(p.kind, PluginKind::Transport);
    assert_eq!(p.version.as_deref(), Some("1.0.0"));
    assert_eq!(p.abi.as_deref(), Some("1.1"));
    assert_eq!(p.path, path);
    assert_eq!(
        p.description.as_deref(),
        Some("Example C plugin: host memory within one process, by memcpy")
    );
    assert_eq!(p.capabilities.memory, vec!["host"]);
    assert_eq!(p.capabilities.scopes, vec!["same-process"]);
    assert_eq!(p.devices.len(), 1);
    assert_eq!(p.devices[0].name, "cpu");
    assert_eq!(p.missing.len(), 1);
    assert_eq!(p.missing[0].capability, "same-host");
    assert_eq!(p.notes[0].key, "written-in");
    let lib = set.plugins[0]
        .library()
        .expect("enabled plugins keep their library");
    assert!(lib.transport_table().is_some());
}

#[test]
fn c_plugin_reads_configuration_through_the_host_services() {
    struct Settings;
    impl ferry_loader::HostServices for Settings {
        fn config(&self, key: &str) -> Option<String> {
            (key == "memcpy.disable").then(|| "1".to_string())
        }
        fn nics(
            &self,
            _: Option<&str>,
        ) -> Result<Vec<ferry_plugins_abi::sdk::Nic>, ferry_plugins_abi::ErrorCode> {
            Ok(Vec::new())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    build_memcpy(dir.path());
    let set = PluginSet::load(
        &LoaderConfig::only([dir.path().to_path_buf()]),
        Arc::new(Settings),
    );
    let p = plugin(&set, "memcpy");
    assert_eq!(p.state, PluginState::Disabled);
    assert_eq!(p.reason, "disabled by FERRY_MEMCPY_DISABLE=1");
}

#[test]
fn every_bad_plugin_gets_its_own_reason_and_the_good_one_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = build_memcpy(d);

    std::fs::write(
        d.join("libferry_transport_notelf.so"),
        "#!/bin/sh\necho I am a script\n",
    )
    .unwrap();

    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(
        d.join("libferry_transport_truncated.so"),
        &bytes[..bytes.len() / 3],
    )
    .unwrap();

    build_variant(d, "noentry", &["-DNO_ENTRY"]);
    build_variant(d, "nextabi", &["-DENTRY_V2_ONLY"]);
    build_variant(d, "oldtable", &["-DTABLE_ABI_MAJOR=7"]);
    build_variant(d, "probefails", &["-DPROBE_FAILS"]);
    build_variant(d, "unavailable", &["-DPROBE_UNAVAILABLE"]);
    // The table says "other" but the file says "wrongname".
    let wrong = d.join("libferry_transport_wrongname.so");
    compile_shared(&[misbehaving_c()], &wrong, &["-DPLUGIN_NAME=\"other\""]);

    // A plugin linked against a library that is then removed.
    let depdir = tempfile::tempdir().unwrap();
    compile_shared(
        &[repo_root().join("tests/plugins/c/testdep.c")],
        &depdir.path().join("libferrytestdep.so"),
        &[],
    );
    let libdir = format!("-L{}", depdir.path().display());
    build_variant(
        d,
        "needsdep",
        &["-DNEEDS_TESTDEP", &libdir, "-lferrytestdep"],
    );
    drop(depdir);

    // A Rust plugin whose probe panics.
    std::fs::copy(
        built("libferry_test_plugin_panics.so"),
        d.join("libferry_transport_panics.so"),
    )
    .unwrap();

    // A file that does not follow the naming convention is not a candidate.
    std::fs::write(d.join("README.txt"), "not a plugin").unwrap();

    let set = load_from(&[d]);
    let names: Vec<&str> = set.plugins.iter().map(|p| p.report.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "memcpy",
            "needsdep",
            "nextabi",
            "noentry",
            "notelf",
            "oldtable",
            "panics",
            "probefails",
            "truncated",
            "unavailable",
            "wrongname"
        ]
    );
    let expect = |name: &str, stage: Stage, needle: &str| {
        let p = plugin(&set, name);
        assert_eq!(p.state, PluginState::Disabled, "{name}: {}", p.reason);
        assert_eq!(p.stage, stage, "{name}: {}", p.reason);
        assert!(
            p.reason.contains(needle),
            "{name}: reason {:?} should contain {needle:?}",
            p.reason
        );
    };
    expect(
        "notelf",
        Stage::Discovered,
        "not an ELF shared object (the file starts with \"#!/bin/s\")",
    );
    expect("truncated", Stage::Discovered, "truncated");
    expect(
        "noentry",
        Stage::Discovered,
        "exports no ferry_transport_plugin_v1 entry symbol",
    );
    expect(
        "nextabi",
        Stage::Discovered,
        "built for plugin ABI v2 (it exports ferry_transport_plugin_v2)",
    );
    expect(
        "oldtable",
        Stage::Discovered,
        "its transport table says plugin ABI 7.0, but this Ferry speaks 1.1",
    );
    expect("needsdep", Stage::Discovered, "needs libferrytestdep.so,");
    expect(
        "probefails",
        Stage::Probed,
        "probe failed with FERRY_ERR_IO (-16): cannot open /dev/vendor0: Permission denied",
    );
    expect("unavailable", Stage::Probed, "no vendor NIC on this host");
    expect(
        "panics",
        Stage::Probed,
        "probe panicked: probe exploded on purpose",
    );
    expect(
        "wrongname",
        Stage::Discovered,
        "it calls itself 'other' but its file name says 'wrongname'",
    );

    let good = plugin(&set, "memcpy");
    assert_eq!(good.state, PluginState::Enabled, "{}", good.reason);
    assert_eq!(set.enabled(PluginKind::Transport).count(), 1);
}

#[test]
fn a_plugin_of_the_same_name_later_in_the_path_is_shadowed() {
    let first = tempfile::tempdir().unwrap();
    let second = tempfile::tempdir().unwrap();
    let first_path = build_memcpy(first.path());
    build_memcpy(second.path());
    let set = load_from(&[first.path(), second.path()]);
    assert_eq!(set.plugins.len(), 2);
    assert_eq!(set.plugins[0].report.state, PluginState::Enabled);
    let shadowed = &set.plugins[1].report;
    assert_eq!(shadowed.state, PluginState::Shadowed);
    assert!(
        shadowed
            .reason
            .contains(&format!("shadowed by {}", first_path.display())),
        "{}",
        shadowed.reason
    );
    // Never loaded: it did not get past discovery.
    assert_eq!(shadowed.stage, Stage::Discovered);
    assert!(shadowed.version.is_none());
}

#[test]
fn the_same_directory_twice_is_one_plugin_not_a_shadowing_pair() {
    let dir = tempfile::tempdir().unwrap();
    build_memcpy(dir.path());
    let set = load_from(&[dir.path(), dir.path()]);
    assert_eq!(set.plugins.len(), 1);
    assert_eq!(set.search_path.len(), 1);
}

#[test]
fn a_probe_that_never_returns_is_given_up_on() {
    let dir = tempfile::tempdir().unwrap();
    build_variant(dir.path(), "hangs", &["-DPROBE_HANGS"]);
    let mut config = LoaderConfig::only([dir.path().to_path_buf()]);
    config.probe_timeout = Duration::from_millis(200);
    let set = PluginSet::load(&config, Arc::new(EnvHost));
    let p = plugin(&set, "hangs");
    assert_eq!(p.state, PluginState::Disabled);
    assert!(
        p.reason.contains("did not return within 200 ms"),
        "{}",
        p.reason
    );
    assert!(set.plugins[0].library().is_none());
}

#[test]
fn ferry_transports_allow_and_deny_lists() {
    let dir = tempfile::tempdir().unwrap();
    build_memcpy(dir.path());
    build_variant(dir.path(), "other", &[]);

    let mut config = LoaderConfig::only([dir.path().to_path_buf()]);
    config.transports = NameFilter::parse("^memcpy");
    let set = PluginSet::load(&config, Arc::new(EnvHost));
    let p = plugin(&set, "memcpy");
    assert_eq!(p.state, PluginState::Disabled);
    assert_eq!(p.reason, "excluded by FERRY_TRANSPORTS=^memcpy");
    assert_eq!(plugin(&set, "other").state, PluginState::Enabled);

    config.transports = NameFilter::parse("memcpy,rdma");
    let set = PluginSet::load(&config, Arc::new(EnvHost));
    assert_eq!(plugin(&set, "memcpy").state, PluginState::Enabled);
    assert_eq!(plugin(&set, "other").state, PluginState::Disabled);
    assert_eq!(set.warnings.len(), 1);
    assert!(set.warnings[0].contains("names 'rdma', which no plugin file provides"));
}

fn run_ferry_info(plugin_path: &str, json: bool) -> (std::process::ExitStatus, String) {
    let mut cmd = Command::new(ferry_bin());
    cmd.arg("info")
        .env("FERRY_PLUGIN_PATH", plugin_path)
        .env_remove("FERRY_TRANSPORTS")
        .env_remove("FERRY_LOG");
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run ferry info");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn ferry_info_json_has_the_documented_shape() {
    let dir = tempfile::tempdir().unwrap();
    build_memcpy(dir.path());
    std::fs::write(dir.path().join("libferry_transport_junk.so"), "junk").unwrap();
    let (status, stdout) = run_ferry_info(&dir.path().to_string_lossy(), true);
    assert!(
        status.success(),
        "ferry info exits 0 whatever the plugins' states"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("valid JSON");
    assert_eq!(v["ferry_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["abi_version"], "1.1");
    let search = v["search_path"].as_array().expect("search_path array");
    assert_eq!(search[0]["path"], dir.path().to_string_lossy().as_ref());
    assert_eq!(search[0]["origin"], "env");
    assert_eq!(search[0]["exists"], true);
    let plugins = v["plugins"].as_array().expect("plugins array");
    for p in plugins {
        for key in [
            "name",
            "kind",
            "state",
            "stage",
            "reason",
            "path",
            "origin",
            "version",
            "description",
            "abi",
            "capabilities",
            "devices",
            "missing",
            "notes",
        ] {
            assert!(p.get(key).is_some(), "plugin entry lacks {key}: {p}");
        }
        assert!(p["capabilities"]["memory"].is_array());
        assert!(p["capabilities"]["scopes"].is_array());
    }
    let memcpy = plugins.iter().find(|p| p["name"] == "memcpy").unwrap();
    assert_eq!(memcpy["state"], "enabled");
    assert_eq!(memcpy["kind"], "transport");
    assert_eq!(memcpy["version"], "1.0.0");
    assert_eq!(memcpy["capabilities"]["memory"][0], "host");
    let junk = plugins.iter().find(|p| p["name"] == "junk").unwrap();
    assert_eq!(junk["state"], "disabled");
    assert!(junk["version"].is_null());
    assert!(junk["reason"]
        .as_str()
        .unwrap()
        .starts_with("not an ELF shared object"));
    // The workspace's own TCP plugin is found in the development build.
    let tcp = plugins
        .iter()
        .find(|p| p["name"] == "tcp")
        .expect("tcp plugin");
    assert_eq!(tcp["state"], "enabled", "{tcp}");
    assert_eq!(tcp["origin"], "dev-build");
}

#[test]
fn ferry_info_text_names_every_plugin_and_exits_zero_with_a_bad_path() {
    let (status, stdout) = run_ferry_info("/nonexistent/ferry-plugins", false);
    assert!(status.success());
    assert!(stdout.contains("/nonexistent/ferry-plugins  [FERRY_PLUGIN_PATH, does not exist]"));
    assert!(stdout.contains("tcp"), "{stdout}");
    assert!(stdout.contains("enabled"), "{stdout}");
}
