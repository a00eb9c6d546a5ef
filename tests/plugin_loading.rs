//! The loader against real plugin files: a C plugin built from the header
//! alone, and plugins that are wrong in every way the loader must explain.

use ferry_loader::{
    CacheChoice, EnvHost, HelperChoice, Isolation, LoaderConfig, NameFilter, PluginKind, PluginSet,
    PluginState, ProbeSource, Stage,
};
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

/// Only these directories, probed afresh (no cache).
fn only(dirs: &[&Path]) -> LoaderConfig {
    LoaderConfig {
        cache: CacheChoice::Off,
        ..LoaderConfig::only(dirs.iter().map(|d| d.to_path_buf()))
    }
}

fn load_from(dirs: &[&Path]) -> PluginSet {
    PluginSet::load(&only(dirs), Arc::new(EnvHost))
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
    assert_eq!(p.abi, Some(ferry_plugins_abi::abi_version()));
    assert_eq!(p.path, path);
    assert_eq!(p.probe_source, Some(ProbeSource::ChildProcess));
    assert_eq!(set.probing.isolation, Isolation::ChildProcess);
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
    let set = PluginSet::load(&only(&[dir.path()]), Arc::new(Settings));
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
        "its transport table says plugin ABI 7.0, but this Ferry speaks 1.",
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
    let mut config = only(&[dir.path()]);
    config.probe_timeout = Duration::from_millis(500);
    let set = PluginSet::load(&config, Arc::new(EnvHost));
    let p = plugin(&set, "hangs");
    assert_eq!(p.state, PluginState::Disabled);
    assert!(
        p.reason.contains("did not finish within 500 ms"),
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

    let mut config = only(&[dir.path()]);
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
    assert_eq!(v["abi_version"], ferry_plugins_abi::abi_version());
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

/// A host that answers one setting, for cache tests.
struct OneSetting(&'static str, Option<&'static str>);

impl ferry_loader::HostServices for OneSetting {
    fn config(&self, key: &str) -> Option<String> {
        (key == self.0)
            .then_some(self.1)
            .flatten()
            .map(str::to_string)
    }
    fn nics(
        &self,
        _: Option<&str>,
    ) -> Result<Vec<ferry_plugins_abi::sdk::Nic>, ferry_plugins_abi::ErrorCode> {
        Ok(Vec::new())
    }
}

#[test]
fn crashes_while_loading_or_probing_disable_the_plugin_and_this_process_lives_on() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    build_memcpy(d);
    build_variant(d, "probe-abort", &["-DPROBE_ABORT"]);
    build_variant(d, "probe-segv", &["-DPROBE_SEGV"]);
    build_variant(d, "ctor-abort", &["-DCTOR_ABORT"]);
    build_variant(d, "ctor-segv", &["-DCTOR_SEGV"]);
    build_variant(d, "incomplete", &["-DINCOMPLETE"]);
    build_variant(d, "null-table", &["-DNULL_TABLE"]);
    build_variant(d, "null-probe", &["-DNULL_PROBE"]);
    build_variant(d, "missing-symbol", &["-DMISSING_SYMBOL"]);
    let set = load_from(&[d]);
    for (name, stage, reason) in [
        ("probe-abort", Stage::Loaded, "probe crashed: SIGABRT"),
        ("probe-segv", Stage::Loaded, "probe crashed: SIGSEGV"),
        (
            "ctor-abort",
            Stage::Discovered,
            "loading it crashed: SIGABRT",
        ),
        (
            "ctor-segv",
            Stage::Discovered,
            "loading it crashed: SIGSEGV",
        ),
        (
            "incomplete",
            Stage::Discovered,
            "its table has init but not get_endpoint, register_memory, unregister_memory, \
             connect, disconnect, submit",
        ),
        (
            "null-table",
            Stage::Discovered,
            "its entry function returned no table",
        ),
        (
            "null-probe",
            Stage::Discovered,
            "its table has no probe function",
        ),
        (
            "missing-symbol",
            Stage::Discovered,
            "needs the symbol ferry_vendor_symbol_nobody_defines",
        ),
    ] {
        let p = plugin(&set, name);
        assert_eq!(p.state, PluginState::Disabled, "{name}: {}", p.reason);
        assert_eq!(p.stage, stage, "{name}: {}", p.reason);
        assert!(p.reason.contains(reason), "{name}: {}", p.reason);
        assert_eq!(p.probe_source, Some(ProbeSource::ChildProcess), "{name}");
    }
    // The crashed ones were never loaded here: the dynamic loader has no
    // trace of them in this process.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for name in ["probe_abort", "probe_segv", "ctor_abort", "ctor_segv"] {
        assert!(
            !maps.contains(&format!("libferry_transport_{name}.so")),
            "{name} is mapped into the host"
        );
    }
    assert_eq!(plugin(&set, "memcpy").state, PluginState::Enabled);
    assert_eq!(set.probing.probed_in_children, 9);
}

#[test]
fn a_warm_start_probes_nothing_and_a_change_of_answers_file_or_timeout_probes_again() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let path = build_memcpy(&plugins);
    build_variant(&plugins, "hangs", &["-DPROBE_HANGS"]);
    let mut config = LoaderConfig::only([plugins.clone()]);
    config.cache = CacheChoice::Path(dir.path().join("cache/probes.json"));
    config.probe_timeout = Duration::from_millis(400);
    let env: Arc<dyn ferry_loader::HostServices> = Arc::new(OneSetting("memcpy.disable", None));

    let cold = PluginSet::load(&config, env.clone());
    assert_eq!(cold.probing.probed_in_children, 2);
    assert_eq!(plugin(&cold, "memcpy").state, PluginState::Enabled);
    assert_eq!(
        cold.probing.cache.as_deref(),
        Some(dir.path().join("cache/probes.json").as_path())
    );

    let warm = PluginSet::load(&config, env.clone());
    assert_eq!(warm.probing.probed_in_children, 0);
    assert_eq!(warm.probing.from_cache, 2);
    let p = plugin(&warm, "memcpy");
    assert_eq!(p.state, PluginState::Enabled);
    assert_eq!(p.probe_source, Some(ProbeSource::Cache));
    assert_eq!(p.capabilities.memory, vec!["host"]);
    assert!(
        warm.find(PluginKind::Transport, "memcpy")
            .and_then(|p| p.library())
            .is_some(),
        "loaded for use all the same"
    );
    let hangs = plugin(&warm, "hangs");
    assert!(hangs.reason.contains("did not finish"), "{}", hangs.reason);

    // The same file, asked by a host that answers the probe's question
    // differently: probed again, with the new answer.
    let set = PluginSet::load(&config, Arc::new(OneSetting("memcpy.disable", Some("1"))));
    assert_eq!(set.probing.probed_in_children, 1);
    assert_eq!(
        plugin(&set, "memcpy").reason,
        "disabled by FERRY_MEMCPY_DISABLE=1"
    );
    // Both answers now have their result.
    let set = PluginSet::load(&config, env.clone());
    assert_eq!(set.probing.probed_in_children, 0);
    assert_eq!(plugin(&set, "memcpy").state, PluginState::Enabled);

    // A rebuilt plugin file is another plugin.
    drop(set);
    compile_shared(&[example_c_plugin()], &path, &["-O2"]);
    let set = PluginSet::load(&config, env.clone());
    assert_eq!(set.probing.probed_in_children, 1);
    assert_eq!(plugin(&set, "memcpy").state, PluginState::Enabled);

    // `ferry info --reprobe` probes everything again, except a plugin whose
    // probe timed out in this process.
    config.reprobe = true;
    let set = PluginSet::load(&config, env);
    assert_eq!(
        set.probing.probed_in_children, 1,
        "only memcpy: hangs timed out here"
    );
    assert!(plugin(&set, "hangs")
        .reason
        .contains("not probed again in this process"));
}

#[test]
fn a_corrupt_cache_file_is_replaced_and_an_unwritable_one_keeps_results_in_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    build_variant(&plugins, "corrupt-cache", &[]);
    let file = dir.path().join("probes.json");
    std::fs::write(
        &file,
        "{\"format\": \"ferry-plugin-probes/1\", \"entries\": [{\"key\"",
    )
    .unwrap();
    let mut config = LoaderConfig::only([plugins.clone()]);
    config.cache = CacheChoice::Path(file.clone());
    let set = load_from_config(&config);
    assert_eq!(plugin(&set, "corrupt-cache").state, PluginState::Enabled);
    let text = std::fs::read_to_string(&file).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).expect("rewritten whole");
    assert_eq!(v["entries"].as_array().unwrap().len(), 1);

    config.cache = CacheChoice::Path(PathBuf::from("/proc/ferry-no-such-dir/probes.json"));
    let set = load_from_config(&config);
    assert_eq!(plugin(&set, "corrupt-cache").state, PluginState::Enabled);
    assert!(set.probing.cache_on && set.probing.cache.is_none());
}

fn load_from_config(config: &LoaderConfig) -> PluginSet {
    PluginSet::load(config, Arc::new(EnvHost))
}

#[test]
fn probes_of_one_plugin_never_overlap_and_a_timed_out_one_is_not_probed_again() {
    for helper in [HelperChoice::Auto, HelperChoice::Off] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        build_variant(d, "exclusive", &["-DPROBE_EXCLUSIVE"]);
        build_variant(d, "slow", &["-DPROBE_SLOW_MS=1500"]);
        let lock = d.join("probe.lock").to_string_lossy().into_owned();
        let host: Arc<dyn ferry_loader::HostServices> = Arc::new(OneSetting(
            "exclusive.lock",
            Some(Box::leak(lock.into_boxed_str())),
        ));
        let mut config = only(&[d]);
        config.probe_helper = helper.clone();
        config.probe_timeout = Duration::from_millis(700);
        // Two engines starting at once, in two threads of this process.
        let sets: Vec<PluginSet> = std::thread::scope(|s| {
            let a = s.spawn(|| PluginSet::load(&config, host.clone()));
            let b = s.spawn(|| PluginSet::load(&config, host.clone()));
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        let mut timed_out = 0;
        for set in &sets {
            let p = plugin(set, "exclusive");
            assert_eq!(p.state, PluginState::Enabled, "{helper:?}: {}", p.reason);
            let slow = plugin(set, "slow");
            assert_eq!(slow.state, PluginState::Disabled);
            if !slow.reason.starts_with("not probed again in this process") {
                assert!(
                    slow.reason.contains("did not finish within 700 ms"),
                    "{helper:?}: {}",
                    slow.reason
                );
                timed_out += 1;
            }
        }
        assert_eq!(
            timed_out, 1,
            "{helper:?}: the second engine waited, then did not probe"
        );
        // Later engines do not probe it either.
        let again = PluginSet::load(&config, host.clone());
        assert!(plugin(&again, "slow")
            .reason
            .contains("not probed again in this process"));
    }
}

#[test]
fn without_the_helper_plugins_load_in_this_process_and_the_log_names_each_first() {
    let dir = tempfile::tempdir().unwrap();
    build_memcpy(dir.path());
    let mut config = only(&[dir.path()]);
    config.probe_helper = HelperChoice::Off;
    let set = load_from_config(&config);
    assert_eq!(set.probing.isolation, Isolation::ThisProcess);
    assert_eq!(
        set.probing.why_this_process.as_deref(),
        Some("FERRY_PLUGIN_PROBE_HELPER=off")
    );
    let p = plugin(&set, "memcpy");
    assert_eq!(p.state, PluginState::Enabled);
    assert_eq!(p.probe_source, Some(ProbeSource::ThisProcess));

    // A crashing probe then takes the host down, but the log said which
    // plugin was running.
    let segv = build_variant(dir.path(), "probe-segv", &["-DPROBE_SEGV"]);
    let out = Command::new(ferry_bin())
        .arg("info")
        .env("FERRY_PLUGIN_PATH", dir.path())
        .env("FERRY_PLUGIN_PROBE_HELPER", "off")
        .env("FERRY_PLUGIN_CACHE", "off")
        .env("FERRY_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a SIGSEGV in this process ends it");
    let last_probe = stderr
        .lines()
        .rfind(|l| l.contains("probing /") || l.contains("loading /"))
        .unwrap_or_else(|| panic!("nothing named the plugin before it ran:\n{stderr}"));
    assert!(
        last_probe.ends_with(&format!("probing {}", segv.display())),
        "{last_probe}\n{stderr}"
    );
}

#[test]
fn a_vendor_plugin_built_against_abi_1_1_loads_unchanged_and_moves_data() {
    let kit = repo_root().join("tests/plugins/c/abi-1.1");
    let dir = tempfile::tempdir().unwrap();
    let so = dir.path().join("libferry_transport_vendor11.so");
    // Its own copy of the 1.1 header, first on the include path.
    let mut cmd = Command::new(ferry_tests::c_compiler());
    let out = cmd
        .args([
            "-shared", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1",
        ])
        .arg(format!("-I{}", kit.display()))
        .arg("-o")
        .arg(&so)
        .arg(kit.join("vendor11_transport.c"))
        .arg("-lpthread")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let set = load_from(&[dir.path()]);
    let p = plugin(&set, "vendor11");
    assert_eq!(p.state, PluginState::Enabled, "{}", p.reason);
    assert_eq!(p.abi.as_deref(), Some("1.1"));

    let engine = |name: &str| {
        let mut c = ferry_core::EngineConfig::default();
        c.set("plugin_path", &dir.path().to_string_lossy()).unwrap();
        c.set("transports", "vendor11").unwrap();
        c.set("plugin_cache", "off").unwrap();
        ferry_core::Engine::new(c).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let (target, initiator) = (engine("target"), engine("initiator"));
    assert_eq!(initiator.transports(), vec!["vendor11"]);
    let mut remote = vec![0u8; 1 << 20];
    let local: Vec<u8> = (0..1 << 20).map(|i| (i * 7) as u8).collect();
    target
        .register_memory(remote.as_mut_ptr() as u64, remote.len() as u64, None)
        .unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    initiator
        .transfer_sync(&[ferry_core::Request::new(
            ferry_core::Op::Write,
            local.as_ptr() as u64,
            seg,
            remote.as_ptr() as u64,
            local.len() as u64,
        )])
        .unwrap();
    assert!(remote == local, "the data went through the 1.1 plugin");
}

#[test]
fn every_environment_variable_is_in_ferry_help_and_in_the_readme() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let table: std::collections::BTreeSet<String> = readme
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next().map(str::to_string))
        .filter(|v| {
            v.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .collect();
    let out = Command::new(ferry_bin()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let in_help: std::collections::BTreeSet<String> = help
        .split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        .filter(|w| w.starts_with("FERRY_") || w.starts_with("CUDA_"))
        .filter(|w| *w != "FERRY_VENDOR_OPTION")
        .map(str::to_string)
        .collect();
    assert!(table.len() > 30, "README's table: {table:?}");
    assert_eq!(
        table, in_help,
        "README's configuration table and `ferry --help` list different variables"
    );
    for v in [
        "FERRY_PLUGIN_PROBE_TIMEOUT_MS",
        "FERRY_PLUGIN_PROBE_HELPER",
        "FERRY_PLUGIN_CACHE",
    ] {
        assert!(table.contains(v), "{v} missing");
    }
}
