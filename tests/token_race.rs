//! Issue 34, item 2: another user could make a root engine use a token of
//! its choosing when root's token directory was somewhere that user can
//! write. uid nobody (through setpriv) swaps symbolic links and
//! directories in a loop while root loads its per-user token 100 times
//! through the engine's own code path (`user_token::load_or_create`, what
//! an engine with no token configured calls at start), twice:
//!
//! - `XDG_RUNTIME_DIR` a root-owned directory anybody may write (as
//!   `/tmp` is), in which nobody made `ferry/` first and swaps root's
//!   token with a link to its own: before the fix, some loads took the
//!   planted token; now every load is refused, naming `XDG_RUNTIME_DIR`;
//! - `XDG_CONFIG_HOME` such a directory: nobody swaps root's `ferry/`
//!   with a directory of its own and with a link to it: before the fix,
//!   some loads read the planted token through the swapped directory; now
//!   each load either uses root's token or refuses with the reason.
//!
//! Either way 0 of 100 loads take the attacker's token.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

const PLANTED: &str = "attacker-chosen-token-for-tests";
const LOADS: usize = 100;
const ATTACK_VAR: &str = "FERRY_TEST_TOKEN_ATTACK";
const LOADS_VAR: &str = "FERRY_TEST_TOKEN_LOADS";

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// This test binary, running only the test `name`, with `var` set.
fn helper(name: &str, var: &str, value: &Path) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(var, value);
    c
}

#[test]
fn another_user_cannot_plant_a_root_engines_token() {
    if let Some(why) = ferry_tests::cannot_switch_user() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let top = tempfile::tempdir().unwrap();
    chmod(top.path(), 0o755);
    // Root's, and anybody may write them (no sticky bit: nobody may rename
    // what root puts there).
    for d in ["run", "config", "lair"] {
        std::fs::create_dir(top.path().join(d)).unwrap();
        chmod(&top.path().join(d), 0o777);
    }
    let home = tempfile::tempdir().unwrap();

    let mut attacker = ferry_tests::as_nobody("token_attacker")
        .env(ATTACK_VAR, top.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = BufReader::new(attacker.stdout.take().unwrap()).lines();
    let ready = said
        .by_ref()
        .map_while(|l| l.ok())
        .any(|l| l.contains("ATTACKER ready"));
    assert!(ready, "the attacker did not start");

    let phases = [
        ("XDG_RUNTIME_DIR", top.path().join("run")),
        ("XDG_CONFIG_HOME", top.path().join("config")),
    ];
    let results: Vec<Loads> = phases
        .iter()
        .map(|(var, dir)| load_as_root(var, dir, home.path()))
        .collect();

    std::fs::write(top.path().join("stop"), "").unwrap();
    let rest: Vec<String> = said.map_while(|l| l.ok()).collect();
    let status = attacker.wait().unwrap();
    eprintln!("{}", rest.join("\n"));
    assert!(status.success(), "the attacker failed: {rest:?}");

    let taken: usize = results.iter().map(|r| r.planted).sum();
    assert_eq!(taken, 0, "root loads took the attacker's token");
    for ((var, _), r) in phases.iter().zip(&results) {
        for reason in &r.reasons {
            assert!(
                reason.contains("another user could choose the token")
                    || reason.contains("belongs to uid 65534")
                    || reason.contains("symbolic link"),
                "refused without the reason: {reason}"
            );
        }
        if *var == "XDG_RUNTIME_DIR" {
            // Anybody may write it: refused before anything in it is used.
            assert_eq!(r.own, 0);
            assert!(r
                .reasons
                .iter()
                .all(|r| r.contains("point XDG_RUNTIME_DIR")));
        }
    }
}

/// What root's loads got.
struct Loads {
    planted: usize,
    own: usize,
    /// Each distinct refusal.
    reasons: Vec<String>,
}

/// `LOADS` loads of root's token in a process with `var` = `dir`.
fn load_as_root(var: &str, dir: &Path, home: &Path) -> Loads {
    let out = helper("token_loads", LOADS_VAR, dir)
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("XDG_CONFIG_HOME")
        .env("HOME", home)
        .env(var, dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let loads: Vec<&str> = text
        .lines()
        .filter_map(|l| l.find("LOAD ").map(|i| &l[i + 5..]))
        .collect();
    assert_eq!(loads.len(), LOADS, "the loads did not run: {text}");
    let planted = loads.iter().filter(|l| l.starts_with("planted")).count();
    let own = loads.iter().filter(|l| l.starts_with("own")).count();
    let mut reasons: Vec<String> = loads
        .iter()
        .filter_map(|l| l.strip_prefix("refused "))
        .map(str::to_string)
        .collect();
    reasons.sort_unstable();
    reasons.dedup();
    eprintln!(
        "{var}={}: {planted} of {LOADS} took the planted token, {own} used root's, {} \
         refused: {reasons:#?}",
        dir.display(),
        LOADS - planted - own
    );
    Loads {
        planted,
        own,
        reasons,
    }
}

/// Root's side (run by the test above, as root, with one of the
/// variables set): loads the token `LOADS` times, one line per load.
#[test]
fn token_loads() {
    if std::env::var_os(LOADS_VAR).is_none() {
        return;
    }
    for _ in 0..LOADS {
        match ferry_core::user_token::load_or_create() {
            Ok((t, _)) if t.expose() == PLANTED => println!("LOAD planted"),
            Ok(_) => println!("LOAD own"),
            Err(e) => println!("LOAD refused {e}"),
        }
        // Let the attacker run between loads (two cores may be busy).
        std::thread::yield_now();
    }
}

/// `renameat2(RENAME_EXCHANGE)`: swaps two names at once.
fn exchange(a: &Path, b: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes()).unwrap();
    let b = std::ffi::CString::new(b.as_os_str().as_bytes()).unwrap();
    // SAFETY: both are NUL-terminated paths; AT_FDCWD is the working
    // directory.
    unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        ) == 0
    }
}

/// The attacker (run by the test above as uid nobody): plants its token,
/// then swaps names under root's token until told to stop.
#[test]
fn token_attacker() {
    let Some(top) = std::env::var_os(ATTACK_VAR).map(std::path::PathBuf::from) else {
        return;
    };
    assert_ne!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "the attacker must not be root"
    );
    let planted = top.join("lair/planted");
    std::fs::write(&planted, format!("{PLANTED}\n")).unwrap();
    chmod(&planted, 0o644);

    // XDG_RUNTIME_DIR: make ferry/ first, so root's token lands in a
    // directory nobody controls; then swap it with a link to the plant.
    let run_ferry = top.join("run/ferry");
    std::fs::create_dir(&run_ferry).unwrap();
    chmod(&run_ferry, 0o777);
    std::os::unix::fs::symlink(&planted, run_ferry.join("swap")).unwrap();

    // XDG_CONFIG_HOME: a ferry/ of nobody's holding the plant, and a link
    // to it, to swap with root's ferry/ once root made it.
    let evil = top.join("config/evil");
    std::fs::create_dir(&evil).unwrap();
    chmod(&evil, 0o755);
    std::os::unix::fs::symlink(&planted, evil.join("token")).unwrap();
    let evil_link = top.join("config/evil-link");
    std::os::unix::fs::symlink(&evil, &evil_link).unwrap();
    let config_ferry = top.join("config/ferry");

    println!("ATTACKER ready");
    let stop = top.join("stop");
    let token = run_ferry.join("token");
    let swap = run_ferry.join("swap");
    let (mut swaps, mut rounds) = (0u64, 0u64);
    // Bounded, so a stray attacker never outlives its test for long.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !stop.exists() && std::time::Instant::now() < until {
        rounds += 1;
        // Each pair leaves nobody's name in place for a moment, then
        // restores root's.
        for (a, b) in [
            (&token, &swap),
            (&config_ferry, &evil),
            (&config_ferry, &evil_link),
        ] {
            if exchange(a, b) {
                swaps += 1;
                exchange(a, b);
            }
        }
    }
    // The test may have stopped reading (it failed): not a second failure.
    use std::io::Write;
    let _ = writeln!(
        std::io::stdout(),
        "ATTACKER stopped after {rounds} rounds, {swaps} swaps"
    );
}
