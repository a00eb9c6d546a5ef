//! libferry from C: the examples (target and initiator, two processes)
//! built with the system compiler through pkg-config, once against the
//! shared library and once against the static one, and every misuse of the
//! API answered with a code and a message.

use ferry_tests::{built, c_compiler, repo_root, run_c_transfer};
use std::path::{Path, PathBuf};
use std::process::Command;

/// An install-like prefix (include/, lib/, lib/pkgconfig/ferry.pc) made of
/// links into the build tree, as packaging will lay it out.
fn dev_prefix() -> tempfile::TempDir {
    let prefix = tempfile::tempdir().unwrap();
    let p = prefix.path();
    std::fs::create_dir_all(p.join("include/ferry")).unwrap();
    std::fs::create_dir_all(p.join("lib/pkgconfig")).unwrap();
    let link = |from: PathBuf, to: PathBuf| std::os::unix::fs::symlink(from, to).unwrap();
    link(
        repo_root().join("capi/include/ferry.h"),
        p.join("include/ferry.h"),
    );
    link(
        repo_root().join("plugins-abi/include/ferry/plugin.h"),
        p.join("include/ferry/plugin.h"),
    );
    link(built("libferry.so"), p.join("lib/libferry.so"));
    link(built("libferry.a"), p.join("lib/libferry.a"));
    let pc = std::fs::read_to_string(repo_root().join("capi/ferry.pc.in"))
        .unwrap()
        .replace("@PREFIX@", &p.to_string_lossy())
        .replace("@LIBDIR@", "${prefix}/lib")
        .replace("@INCLUDEDIR@", "${prefix}/include")
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(p.join("lib/pkgconfig/ferry.pc"), pc).unwrap();
    prefix
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = Command::new("pkg-config")
        .args(args)
        .arg("ferry")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .expect("pkg-config is installed (scripts/test installs it)");
    assert!(
        out.status.success(),
        "pkg-config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Compiles C sources into an executable; `link` are the linker arguments.
fn compile(prefix: &Path, sources: &[PathBuf], out: &Path, link: &[String]) {
    let mut cmd = Command::new(c_compiler());
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .args(pkg_config(prefix, &["--cflags"]))
        .arg("-I")
        .arg(repo_root().join("examples/c"))
        .arg("-o")
        .arg(out)
        .args(sources)
        .args(link);
    let o = cmd.output().expect("run the C compiler");
    assert!(
        o.status.success(),
        "compiling {sources:?}:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn shared_link(prefix: &Path) -> Vec<String> {
    let mut args = pkg_config(prefix, &["--libs"]);
    args.push(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
    args
}

#[test]
fn c_examples_transfer_between_two_processes_with_the_shared_library() {
    let prefix = dev_prefix();
    let dir = tempfile::tempdir().unwrap();
    let ex = repo_root().join("examples/c");
    let link = shared_link(prefix.path());
    compile(
        prefix.path(),
        &[ex.join("target.c")],
        &dir.path().join("target"),
        &link,
    );
    compile(
        prefix.path(),
        &[ex.join("initiator.c")],
        &dir.path().join("initiator"),
        &link,
    );
    run_c_transfer(
        &mut Command::new(dir.path().join("target")),
        &mut Command::new(dir.path().join("initiator")),
    );
}

#[test]
fn the_static_library_links_and_works_too() {
    let prefix = dev_prefix();
    let dir = tempfile::tempdir().unwrap();
    let ex = repo_root().join("examples/c");
    let mut link = vec![prefix.path().join("lib/libferry.a").display().to_string()];
    link.extend(pkg_config(
        prefix.path(),
        &["--libs-only-other", "--static"],
    ));
    link.extend(["-lpthread", "-ldl", "-lm"].map(String::from));
    compile(
        prefix.path(),
        &[ex.join("initiator.c")],
        &dir.path().join("initiator-static"),
        &link,
    );
    let link_shared = shared_link(prefix.path());
    compile(
        prefix.path(),
        &[ex.join("target.c")],
        &dir.path().join("target"),
        &link_shared,
    );
    // A statically linked program has no libferry.so to find plugins beside:
    // FERRY_PLUGIN_PATH names them.
    let mut initiator = Command::new(dir.path().join("initiator-static"));
    initiator.env("FERRY_PLUGIN_PATH", ferry_tests::target_dir());
    run_c_transfer(&mut Command::new(dir.path().join("target")), &mut initiator);
}

#[test]
fn every_misuse_of_the_c_api_gets_a_code_and_a_message() {
    let prefix = dev_prefix();
    let dir = tempfile::tempdir().unwrap();
    compile(
        prefix.path(),
        &[repo_root().join("tests/c/misuse.c")],
        &dir.path().join("misuse"),
        &shared_link(prefix.path()),
    );
    let out = Command::new(dir.path().join("misuse")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
    assert!(
        stdout.contains("name of -999: FERRY_ERR_UNKNOWN"),
        "{stdout}"
    );
}
