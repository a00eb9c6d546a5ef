//! The release artifact, as a user gets it: the tarball of
//! packaging/build.sh unpacked into a fresh temporary prefix, used with a
//! clean environment (`PATH` only) and nothing from this repository.
//!
//! - `bin/ferry info` finds the plugins beside it, also after the prefix
//!   moves; FERRY_PLUGIN_PATH puts vendor directories in front. It finds the
//!   ferry-probe helper in lib/ferry/ too, so a vendor plugin that crashes
//!   in its probe is disabled, not the host.
//! - Every shipped ELF file needs glibc 2.28 at most; the tarball is small
//!   enough to carry; no shipped text file names the build machine's paths.
//! - The C examples, built with `pkg-config --cflags --libs ferry` and with
//!   CMake's `find_package(ferry)`, move data between two processes.
//! - The plugin kit builds with `make` against the tarball alone and its
//!   plugin shows up in `ferry info`, from FERRY_PLUGIN_PATH and from the
//!   plugins directory.
//!
//! The tarball is $FERRY_TARBALL (scripts/test builds it first) or, when that
//! is unset, built here by packaging/build.sh. When the build tools cannot be
//! installed (no PyPI: build.sh exits 3, or scripts/test sets
//! FERRY_PACKAGING_SKIP), every test here says so loudly and passes.

use ferry_tests::{c_compiler, repo_root, run_c_transfer};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The only variable the programs under test get.
const CLEAN_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// The glibc floor of the artifact.
const GLIBC_FLOOR: &str = "2.28";
/// What can still be carried to the GPU machine with the device tool.
const MAX_TARBALL_BYTES: u64 = 60 << 20;

/// The tarball under test, or None (after a loud message) when it cannot be
/// built on this machine.
fn tarball() -> Option<&'static Path> {
    static TARBALL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let result = TARBALL.get_or_init(|| {
        if let Ok(reason) = std::env::var("FERRY_PACKAGING_SKIP") {
            return Err(reason);
        }
        if let Some(given) = std::env::var_os("FERRY_TARBALL") {
            let path = repo_root().join(given);
            assert!(
                path.is_file(),
                "FERRY_TARBALL={} is not a file",
                path.display()
            );
            return Ok(path);
        }
        let out = Command::new(repo_root().join("packaging/build.sh"))
            .current_dir(repo_root())
            .output()
            .expect("run packaging/build.sh");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status.code() {
            Some(0) => Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
            Some(3) => Err(format!("packaging/build.sh cannot get its tools: {stderr}")),
            _ => panic!("packaging/build.sh failed:\n{stderr}"),
        }
    });
    match result {
        Ok(path) => Some(path),
        Err(reason) => {
            eprintln!("\n!!! SKIPPED: the release tarball cannot be built here: {reason}\n");
            None
        }
    }
}

/// Unpacks the tarball under `parent` and returns the prefix it holds.
fn unpack(tarball: &Path, parent: &Path) -> PathBuf {
    std::fs::create_dir_all(parent).unwrap();
    let out = Command::new("tar")
        .arg("-xzf")
        .arg(tarball)
        .arg("-C")
        .arg(parent)
        .output()
        .expect("run tar");
    assert!(
        out.status.success(),
        "tar: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let entries: Vec<PathBuf> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "one top directory in the tarball: {entries:?}"
    );
    let prefix = entries.into_iter().next().unwrap();
    let name = prefix.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        tarball.file_name().unwrap().to_string_lossy() == format!("{name}.tar.gz"),
        "top directory {name} matches the tarball's name"
    );
    prefix
}

/// A command with a clean environment: PATH and nothing else.
fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear().env("PATH", CLEAN_PATH);
    cmd
}

/// Runs a command, panicking with its output unless it succeeds.
fn run_ok(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `<prefix>/bin/ferry info --json` with a clean environment plus `envs`.
fn ferry_info(prefix: &Path, envs: &[(&str, &Path)]) -> Value {
    let mut cmd = clean(prefix.join("bin/ferry"));
    cmd.args(["info", "--json"]);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    serde_json::from_str(&run_ok(&mut cmd)).expect("ferry info --json prints JSON")
}

fn plugin<'a>(info: &'a Value, name: &str) -> &'a Value {
    info["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("ferry info lists no plugin {name}: {info:#}"))
}

fn same_file(a: &Path, b: &Path) -> bool {
    std::fs::canonicalize(a).ok() == std::fs::canonicalize(b).ok()
}

fn search_path(info: &Value) -> Vec<(PathBuf, String)> {
    info["search_path"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                PathBuf::from(e["path"].as_str().unwrap()),
                e["origin"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn shipped_plugins(prefix: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(prefix.join("lib/ferry/plugins"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// What ferry info must say about the plugins of an unpacked prefix.
fn assert_finds_its_own_plugins(prefix: &Path, info: &Value) {
    let plugin_dir = prefix.join("lib/ferry/plugins");
    let path = search_path(info);
    assert_eq!(
        path.len(),
        1,
        "only the plugins beside the binary: {path:?}"
    );
    assert!(same_file(&path[0].0, &plugin_dir), "{path:?}");
    assert_eq!(path[0].1, "beside-library");
    let listed = info["plugins"].as_array().unwrap();
    assert_eq!(listed.len(), shipped_plugins(prefix).len(), "{info:#}");
    for p in listed {
        assert_eq!(p["origin"], "beside-library", "{p:#}");
        assert!(
            same_file(
                Path::new(p["path"].as_str().unwrap()),
                &plugin_dir.join(file_name(p))
            ),
            "{p:#}"
        );
    }
    for name in ["tcp", "shm"] {
        assert_eq!(plugin(info, name)["state"], "enabled", "{info:#}");
    }
    // Probed first in a child process: the helper ships beside the plugins.
    let probing = &info["probing"];
    assert_eq!(probing["isolation"], "child-process", "{probing:#}");
    assert!(
        same_file(
            Path::new(probing["helper"].as_str().unwrap_or("")),
            &prefix.join("lib/ferry/ferry-probe")
        ),
        "{probing:#}"
    );
    let cuda = plugin(info, "cuda");
    if !Path::new("/dev/nvidiactl").exists() {
        // No NVIDIA driver here: present, loaded, and disabled with a reason.
        assert_eq!(cuda["state"], "disabled", "{cuda:#}");
        assert_eq!(cuda["stage"], "probed", "{cuda:#}");
        assert!(
            cuda["reason"].as_str().unwrap().contains("libcuda"),
            "{cuda:#}"
        );
    }
}

fn file_name(p: &Value) -> String {
    Path::new(p["path"].as_str().unwrap())
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn unpacked_anywhere_ferry_info_finds_the_plugins_beside_it_with_a_clean_environment() {
    let Some(tarball) = tarball() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prefix = unpack(tarball, &tmp.path().join("first/place"));

    let shipped = shipped_plugins(&prefix);
    for must in [
        "libferry_transport_tcp.so",
        "libferry_transport_shm.so",
        "libferry_device_cuda.so",
    ] {
        assert!(
            shipped.iter().any(|s| s == must),
            "{must} shipped: {shipped:?}"
        );
    }
    for s in &shipped {
        assert!(
            s.starts_with("libferry_transport_") || s.starts_with("libferry_device_"),
            "only plugins, no test plugins, in lib/ferry/plugins: {shipped:?}"
        );
    }

    let info = ferry_info(&prefix, &[]);
    assert_finds_its_own_plugins(&prefix, &info);

    // The manifest lists each shipped plugin with the version and ABI that
    // ferry info reads from it.
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(prefix.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["glibc_floor"], GLIBC_FLOOR);
    assert_eq!(manifest["version"], info["ferry_version"]);
    assert_eq!(manifest["plugin_abi"], info["abi_version"]);
    let listed = manifest["plugins"].as_array().unwrap();
    assert_eq!(listed.len(), shipped.len(), "{manifest:#}");
    for m in listed {
        let p = plugin(&info, m["name"].as_str().unwrap());
        assert_eq!(m["kind"], p["kind"]);
        assert_eq!(m["version"], p["version"]);
        assert_eq!(m["abi"], p["abi"]);
        assert_eq!(m["file"], format!("lib/ferry/plugins/{}", file_name(p)));
    }

    // The human report too.
    let text = run_ok(clean(prefix.join("bin/ferry")).arg("info"));
    assert!(text.contains("[beside-library]"), "{text}");

    // Moved elsewhere, it follows.
    let moved = tmp.path().join("moved/elsewhere/ferry");
    std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
    std::fs::rename(&prefix, &moved).unwrap();
    assert_finds_its_own_plugins(&moved, &ferry_info(&moved, &[]));

    // FERRY_PLUGIN_PATH puts vendor directories in front.
    let vendor = tmp.path().join("vendor");
    std::fs::create_dir_all(&vendor).unwrap();
    let info = ferry_info(&moved, &[("FERRY_PLUGIN_PATH", &vendor)]);
    let path = search_path(&info);
    assert_eq!(path.len(), 2, "{path:?}");
    assert!(
        same_file(&path[0].0, &vendor) && path[0].1 == "env",
        "{path:?}"
    );
    assert!(
        same_file(&path[1].0, &moved.join("lib/ferry/plugins")) && path[1].1 == "beside-library",
        "{path:?}"
    );
}

#[test]
fn every_shipped_elf_needs_glibc_2_28_at_most_and_the_tarball_can_travel() {
    let Some(tarball) = tarball() else { return };
    let size = std::fs::metadata(tarball).unwrap().len();
    assert!(
        size < MAX_TARBALL_BYTES,
        "{} is {size} bytes; it must stay under {MAX_TARBALL_BYTES} to be carried",
        tarball.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let prefix = unpack(tarball, tmp.path());
    let out = run_ok(
        Command::new(repo_root().join("packaging/check-glibc.sh"))
            .args(["--floor", GLIBC_FLOOR, "--tsv"])
            .arg(&prefix),
    );
    let mut checked: Vec<String> = Vec::new();
    for line in out.lines() {
        let (file, version) = line.split_once('\t').expect("path<TAB>version");
        let rel = Path::new(file)
            .strip_prefix(&prefix)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let parts: Vec<u32> = version.split('.').map(|n| n.parse().unwrap()).collect();
        assert!(parts <= vec![2, 28], "{rel} needs GLIBC_{version}");
        checked.push(rel);
    }
    let mut expected = vec![
        "bin/ferry".to_string(),
        "lib/libferry.so".to_string(),
        "lib/ferry/ferry-probe".to_string(),
    ];
    expected.extend(
        shipped_plugins(&prefix)
            .into_iter()
            .map(|p| format!("lib/ferry/plugins/{p}")),
    );
    expected.sort();
    checked.sort();
    assert_eq!(checked, expected, "every shipped ELF file is checked");

    // Nothing shipped names where it was built: the prefix can move.
    let build_root = repo_root().to_string_lossy().into_owned();
    for entry in walk(&prefix) {
        let text = std::fs::read(&entry).unwrap();
        if text.starts_with(b"\x7fELF") || text.starts_with(b"!<arch>") {
            continue;
        }
        let text = String::from_utf8_lossy(&text);
        assert!(
            !text.contains(&build_root),
            "{} names the build tree {build_root}",
            entry.display()
        );
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = run_ok(
        clean("pkg-config")
            .args(args)
            .arg("ferry")
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")),
    );
    out.split_whitespace().map(str::to_string).collect()
}

fn compile_c(source: &Path, out: &Path, flags: &[String]) {
    run_ok(
        clean(c_compiler())
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
            .arg(out)
            .arg(source)
            .args(flags),
    );
}

#[test]
fn c_programs_built_with_pkg_config_transfer_between_two_processes() {
    let Some(tarball) = tarball() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prefix = unpack(tarball, &tmp.path().join("prefix"));
    let examples = prefix.join("share/ferry/examples/c");
    let bin = tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();

    // Shared: the documented command line, with the rpath pkg-config gives.
    let mut flags = pkg_config(&prefix, &["--cflags", "--libs"]);
    let libdir = pkg_config(&prefix, &["--variable=libdir"]).join(" ");
    assert!(
        same_file(Path::new(&libdir), &prefix.join("lib")),
        "libdir {libdir}"
    );
    flags.push(format!("-Wl,-rpath,{libdir}"));
    for p in ["target", "initiator"] {
        compile_c(&examples.join(format!("{p}.c")), &bin.join(p), &flags);
    }
    // Nothing but PATH: libferry.so through the rpath, the plugins beside it.
    run_c_transfer(
        &mut clean(bin.join("target")),
        &mut clean(bin.join("initiator")),
    );

    // Static: libferry.a in place of -lferry. The program has no library to
    // find plugins beside; placed in <prefix>/bin, it finds them from there.
    let mut static_flags = pkg_config(&prefix, &["--cflags", "--libs", "--static"]);
    for f in static_flags.iter_mut() {
        if f == "-lferry" {
            *f = prefix.join("lib/libferry.a").to_string_lossy().into_owned();
        }
    }
    let static_initiator = prefix.join("bin/initiator-static");
    compile_c(
        &examples.join("initiator.c"),
        &static_initiator,
        &static_flags,
    );
    run_c_transfer(
        &mut clean(bin.join("target")),
        &mut clean(&static_initiator),
    );
}

#[test]
fn a_cmake_project_finds_ferry_with_find_package() {
    let Some(tarball) = tarball() else { return };
    if Command::new("cmake").arg("--version").output().is_err() {
        eprintln!(
            "\n!!! SKIPPED: cmake is not installed, so find_package(ferry) is untested \
             (scripts/test installs it: apt-get install cmake)\n"
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prefix = unpack(tarball, &tmp.path().join("prefix"));
    let build = tmp.path().join("build");
    run_ok(
        clean("cmake")
            .arg("-S")
            .arg(prefix.join("share/ferry/examples/c"))
            .arg("-B")
            .arg(&build)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
            .arg(format!("-DCMAKE_C_COMPILER={}", c_compiler()))
            .arg("-DCMAKE_C_FLAGS=-Wall -Wextra -Werror"),
    );
    run_ok(clean("cmake").arg("--build").arg(&build));
    run_c_transfer(
        &mut clean(build.join("target")),
        &mut clean(build.join("initiator")),
    );
}

#[test]
fn the_plugin_kit_builds_with_make_against_the_tarball_alone_and_shows_in_ferry_info() {
    let Some(tarball) = tarball() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prefix = unpack(tarball, &tmp.path().join("prefix"));
    let kit = prefix.join("share/ferry/plugin-kit");
    run_ok(clean("make").arg("-s").arg("-C").arg(&kit));
    let built = kit.join("libferry_transport_memcpy.so");
    assert!(built.is_file(), "make built {}", built.display());

    // From a vendor directory on FERRY_PLUGIN_PATH, in front of Ferry's own.
    let vendor = tmp.path().join("vendor");
    std::fs::create_dir_all(&vendor).unwrap();
    std::fs::copy(&built, vendor.join("libferry_transport_memcpy.so")).unwrap();
    let info = ferry_info(&prefix, &[("FERRY_PLUGIN_PATH", &vendor)]);
    let memcpy = plugin(&info, "memcpy");
    assert_eq!(memcpy["origin"], "env", "{memcpy:#}");
    assert_eq!(memcpy["state"], "enabled", "{memcpy:#}");

    // Dropped into the plugins directory: found with no variable at all.
    run_ok(clean("make").arg("-s").arg("-C").arg(&kit).arg("install"));
    let info = ferry_info(&prefix, &[]);
    let memcpy = plugin(&info, "memcpy");
    assert_eq!(memcpy["origin"], "beside-library", "{memcpy:#}");
    assert_eq!(memcpy["state"], "enabled", "{memcpy:#}");
    assert_eq!(memcpy["version"], "1.0.0", "{memcpy:#}");
    assert_eq!(memcpy["abi"], info["abi_version"], "{memcpy:#}");
    assert_eq!(plugin(&info, "tcp")["state"], "enabled");

    // A vendor plugin that crashes in its probe, built against the
    // tarball's header: disabled with the signal, and ferry lives on.
    let segv = vendor.join("libferry_transport_crashes.so");
    let out = Command::new(c_compiler())
        .args(["-shared", "-fPIC", "-std=c11", "-O1", "-DPROBE_SEGV"])
        .arg("-DPLUGIN_NAME=\"crashes\"")
        .arg(format!("-I{}", prefix.join("include").display()))
        .arg("-o")
        .arg(&segv)
        .arg(repo_root().join("tests/plugins/c/misbehaving.c"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = ferry_info(&prefix, &[("FERRY_PLUGIN_PATH", &vendor)]);
    let crashes = plugin(&info, "crashes");
    assert_eq!(crashes["state"], "disabled", "{crashes:#}");
    assert!(
        crashes["reason"]
            .as_str()
            .unwrap()
            .starts_with("probe crashed: SIGSEGV"),
        "{crashes:#}"
    );
}
