use super::*;
use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;

fn uid() -> libc::uid_t {
    euid()
}

/// A configuration directory at `p`, as `XDG_CONFIG_HOME` would choose it.
fn config_base(p: &Path) -> Base {
    Base {
        path: p.to_path_buf(),
        var: "XDG_CONFIG_HOME",
        opened: None,
    }
}

fn load(p: &Path) -> Result<(Token, PathBuf)> {
    load_or_create_in(config_base(p), uid())
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Gives `p` to uid nobody, or None when this process cannot (not root).
fn give_away(p: &Path) -> Option<()> {
    if uid() != 0 {
        eprintln!("SKIPPED: needs root to give a file to another user");
        return None;
    }
    std::os::unix::fs::lchown(p, Some(65534), Some(65534)).unwrap();
    Some(())
}

/// An environment holding only `vars`.
fn env_of(vars: &[(&'static str, &Path)]) -> impl Fn(&str) -> Option<OsString> {
    let vars: Vec<(&str, OsString)> = vars
        .iter()
        .map(|(k, v)| (*k, v.as_os_str().to_os_string()))
        .collect();
    move |k| {
        vars.iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.clone())
    }
}

fn assert_refused(r: Result<impl std::fmt::Debug>, needles: &[&str]) {
    let e = r.unwrap_err();
    assert_eq!(e.code, ErrorCode::Permission, "{e}");
    for n in needles {
        assert!(e.message.contains(n), "{n:?} not in: {e}");
    }
}

#[test]
fn created_once_private_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let (token, path) = load(dir.path()).unwrap();
    assert_eq!(path, dir.path().join("ferry/token"));
    assert_eq!(token.expose().len(), 64);
    let file = std::fs::symlink_metadata(&path).unwrap();
    assert!(file.is_file());
    assert_eq!(file.mode() & 0o777, 0o600);
    let ferry = std::fs::symlink_metadata(dir.path().join("ferry")).unwrap();
    assert_eq!(ferry.mode() & 0o777, 0o700);
    let (again, _) = load(dir.path()).unwrap();
    assert_eq!(again.expose(), token.expose());
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path().join("ferry"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [OsStr::new("token")]);
}

#[test]
fn an_existing_private_token_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let ferry = dir.path().join("ferry");
    std::fs::create_dir(&ferry).unwrap();
    chmod(&ferry, 0o700);
    std::fs::write(ferry.join("token"), "abc\nignored\n").unwrap();
    chmod(&ferry.join("token"), 0o600);
    assert_eq!(load(dir.path()).unwrap().0.expose(), "abc");
    // A 0755 directory (made by hand) is fine: only writing matters.
    chmod(&ferry, 0o755);
    assert_eq!(load(dir.path()).unwrap().0.expose(), "abc");
}

#[test]
fn racing_creators_agree() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| load(dir.path()).unwrap().0.expose()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(tokens.iter().all(|t| *t == tokens[0]), "{tokens:?}");
}

#[test]
fn a_token_others_may_read_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = load(dir.path()).unwrap();
    chmod(&path, 0o644);
    assert_refused(
        load(dir.path()),
        &["mode 644", "chmod 600", "FERRY_AUTH_TOKEN"],
    );
    chmod(&path, 0o600);
    assert!(load(dir.path()).is_ok());
}

#[test]
fn a_token_that_is_a_symbolic_link_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ferry = dir.path().join("ferry");
    std::fs::create_dir(&ferry).unwrap();
    chmod(&ferry, 0o700);
    // Even to a file that would pass every check.
    let real = dir.path().join("elsewhere");
    std::fs::write(&real, "planted\n").unwrap();
    chmod(&real, 0o600);
    std::os::unix::fs::symlink(&real, ferry.join("token")).unwrap();
    assert_refused(load(dir.path()), &["ferry/token", "symbolic link"]);
}

#[test]
fn a_token_that_is_not_a_regular_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ferry = dir.path().join("ferry");
    std::fs::create_dir_all(ferry.join("token")).unwrap();
    chmod(&ferry, 0o700);
    assert_refused(load(dir.path()), &["not a regular file"]);
    // A FIFO neither blocks the open nor passes.
    std::fs::remove_dir(ferry.join("token")).unwrap();
    let fifo = CString::new(ferry.join("token").as_os_str().as_bytes()).unwrap();
    // SAFETY: fifo is a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    assert_refused(load(dir.path()), &["not a regular file"]);
}

#[test]
fn an_empty_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = load(dir.path()).unwrap();
    std::fs::write(&path, "\n").unwrap();
    assert_refused(load(dir.path()), &["is empty"]);
}

#[test]
fn a_token_of_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = load(dir.path()).unwrap();
    if give_away(&path).is_none() {
        return;
    }
    assert_refused(load(dir.path()), &["belongs to uid 65534"]);
}

#[test]
fn a_token_directory_others_may_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _) = load(dir.path()).unwrap();
    let ferry = dir.path().join("ferry");
    for mode in [0o777, 0o770, 0o1777] {
        chmod(&ferry, mode);
        assert_refused(
            load(dir.path()),
            &[
                &ferry.display().to_string(),
                &format!("group or others may write it (mode {mode:o})"),
                "chmod 700 it, or point XDG_CONFIG_HOME at",
            ],
        );
    }
}

#[test]
fn a_token_directory_that_is_a_symbolic_link_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    chmod(&real, 0o700);
    std::os::unix::fs::symlink(&real, dir.path().join("ferry")).unwrap();
    assert_refused(
        load(dir.path()),
        &[
            "ferry: is a symbolic link",
            "remove it, or point XDG_CONFIG_HOME",
        ],
    );
}

#[test]
fn a_token_directory_that_is_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ferry"), "").unwrap();
    assert_refused(load(dir.path()), &["ferry: is not a directory"]);
}

#[test]
fn a_token_directory_of_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ferry = dir.path().join("ferry");
    std::fs::create_dir(&ferry).unwrap();
    chmod(&ferry, 0o700);
    if give_away(&ferry).is_none() {
        return;
    }
    assert_refused(load(dir.path()), &["belongs to uid 65534", "ferry"]);
}

#[test]
fn a_runtime_directory_others_may_write_is_refused() {
    let run = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    for mode in [0o777, 0o1777, 0o720] {
        chmod(run.path(), mode);
        let env = env_of(&[
            ("XDG_RUNTIME_DIR", run.path()),
            ("XDG_CONFIG_HOME", config.path()),
        ]);
        assert_refused(
            locate(&env, uid()).map(|b| b.path),
            &[
                &run.path().display().to_string(),
                &format!("group or others may write it (mode {mode:o})"),
                "token; point XDG_RUNTIME_DIR at",
            ],
        );
    }
}

#[test]
fn a_private_runtime_directory_is_used() {
    let run = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    chmod(run.path(), 0o700);
    let env = env_of(&[
        ("XDG_RUNTIME_DIR", run.path()),
        ("XDG_CONFIG_HOME", config.path()),
    ]);
    let base = locate(&env, uid()).unwrap();
    assert_eq!(base.path, run.path());
    let (_, path) = load_or_create_in(base, uid()).unwrap();
    assert_eq!(path, run.path().join("ferry/token"));
}

#[test]
fn a_runtime_directory_not_ours_or_absent_falls_back() {
    let config = tempfile::tempdir().unwrap();
    let missing = config.path().join("missing");
    let env = env_of(&[
        ("XDG_RUNTIME_DIR", &missing),
        ("XDG_CONFIG_HOME", config.path()),
    ]);
    assert_eq!(locate(&env, uid()).unwrap().path, config.path());
    // Another user's (as `sudo` keeps the caller's), even one anybody may
    // write: not used, and not an error.
    let run = tempfile::tempdir().unwrap();
    chmod(run.path(), 0o777);
    if give_away(run.path()).is_none() {
        return;
    }
    let env = env_of(&[
        ("XDG_RUNTIME_DIR", run.path()),
        ("XDG_CONFIG_HOME", config.path()),
    ]);
    let base = locate(&env, uid()).unwrap();
    assert_eq!(
        (base.path.as_path(), base.var),
        (config.path(), "XDG_CONFIG_HOME")
    );
}
