//! The per-user token: what an engine uses when no token is configured, so
//! that processes of one user trust each other with no setup and other
//! users of the host are refused.
//!
//! The file is `$XDG_RUNTIME_DIR/ferry/token` when that directory is set
//! and ours, else `$XDG_CONFIG_HOME/ferry/token` (or `~/.config/ferry/token`).
//! It holds 32 random bytes in hex, mode 0600 in a 0700 directory.
//!
//! Nobody else may choose the token, so nothing is trusted by path between
//! a check and its use: `XDG_RUNTIME_DIR` (when ours) and the `ferry/`
//! directory are opened, checked through the descriptor (ours, not
//! writable by group or others) and everything after happens relative to
//! that descriptor; the file is opened with `O_NOFOLLOW` and the opened
//! file is checked (a regular file of ours that nobody else may read or
//! write). A new token is written whole under a temporary name created with
//! `O_CREAT|O_EXCL|O_NOFOLLOW` (mode 0600), then linked to its final name,
//! which fails if another process won the race (whose file is then opened
//! and checked the same way). Anything unfit is refused with the reason,
//! never used.

use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sdk::auth::Token;
use std::ffi::{CStr, CString, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const DIR_NAME: &CStr = c"ferry";
const FILE_NAME: &CStr = c"token";
/// The most of a token file read: a token is one short line.
const MAX_FILE: u64 = 4096;

/// The directory the token's `ferry/` directory lives in, and the variable
/// that chose it (what to change when it is unfit).
struct Base {
    path: PathBuf,
    var: &'static str,
    /// Opened and checked while choosing it (`XDG_RUNTIME_DIR`); a
    /// configuration directory is created and opened when used.
    opened: Option<File>,
}

/// The `ferry/` directory, opened and checked; what is done in it is done
/// relative to this descriptor, so renaming or replacing the path after
/// the check changes nothing.
struct TokenDir {
    file: File,
    path: PathBuf,
    var: &'static str,
}

impl TokenDir {
    fn token_path(&self) -> PathBuf {
        self.path.join("token")
    }
}

/// Where this user's token lives (the file may not exist yet).
pub fn path() -> Result<PathBuf> {
    let base = locate(&|k| std::env::var_os(k), euid())?;
    Ok(base.path.join("ferry").join("token"))
}

/// Reads this user's token, creating it first when there is none.
pub fn load_or_create() -> Result<(Token, PathBuf)> {
    let uid = euid();
    load_or_create_in(locate(&|k| std::env::var_os(k), uid)?, uid)
}

fn euid() -> libc::uid_t {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Chooses the base directory from `env`: `XDG_RUNTIME_DIR` when it is set
/// and ours (refused when group or others may write it), else the
/// configuration directory.
fn locate(env: &dyn Fn(&str) -> Option<OsString>, uid: libc::uid_t) -> Result<Base> {
    if let Some(run) = env("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
    {
        // Absent, not a directory or another user's (sudo keeps the
        // caller's): not ours to use; the configuration directory is.
        if let Ok(dir) = open_dir(&run) {
            if dir.metadata().is_ok_and(|m| m.uid() == uid) {
                check_dir(&dir, &run, "XDG_RUNTIME_DIR", uid, false)?;
                return Ok(Base {
                    path: run,
                    var: "XDG_RUNTIME_DIR",
                    opened: Some(dir),
                });
            }
        }
    }
    let (path, var) = match env("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
    {
        Some(p) => (p, "XDG_CONFIG_HOME"),
        None => env("HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| passwd_home(uid))
            .map(|h| (h.join(".config"), "HOME"))
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::Permission,
                    "no token configured and nowhere to keep a per-user one (neither \
                     XDG_RUNTIME_DIR, XDG_CONFIG_HOME, HOME nor a home directory in the user \
                     database): set FERRY_AUTH_TOKEN or \
                     FERRY_AUTH_TOKEN_FILE, or FERRY_AUTH=off to let every local user in",
                )
            })?,
    };
    Ok(Base {
        path,
        var,
        opened: None,
    })
}

/// The user's home directory from the user database (a service or a
/// clean environment may have no HOME).
fn passwd_home(uid: libc::uid_t) -> Option<PathBuf> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a zeroed passwd is valid storage.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into pw and buf (of the given length) only,
    // and sets out to &pw on success.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() || pw.pw_dir.is_null() {
        return None;
    }
    // SAFETY: pw_dir points at a NUL-terminated string inside buf.
    let dir = unsafe { CStr::from_ptr(pw.pw_dir) };
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes()));
    path.is_absolute().then_some(path)
}

fn refused(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorCode::Permission,
        format!(
            "per-user token {}: {why} (set FERRY_AUTH_TOKEN or FERRY_AUTH_TOKEN_FILE to use \
             another token, or FERRY_AUTH=off)",
            path.display()
        ),
    )
}

/// A directory unfit to hold the token: names it, what is wrong, what to
/// do about it (`fix`, for a directory of Ferry's own) and the variable
/// that chose it.
fn unfit_dir(path: &Path, var: &str, why: impl std::fmt::Display, fix: Option<&str>) -> Error {
    let fix = fix.map(|f| format!("{f}, or ")).unwrap_or_default();
    Error::new(
        ErrorCode::Permission,
        format!(
            "per-user token directory {}: {why}, so another user could choose the token; \
             {fix}point {var} at a directory only this user can write, or set \
             FERRY_AUTH_TOKEN or FERRY_AUTH_TOKEN_FILE, or FERRY_AUTH=off",
            path.display()
        ),
    )
}

/// Refuses a directory (already opened) that is not ours or that group or
/// others may write; `ferry` when it is the `ferry/` directory (which the
/// user may remove or chmod), not one the environment named.
fn check_dir(dir: &File, path: &Path, var: &str, uid: libc::uid_t, ferry: bool) -> Result<()> {
    let meta = dir.metadata().map_err(|e| {
        Error::new(
            ErrorCode::Permission,
            format!("per-user token directory {}: {e}", path.display()),
        )
    })?;
    let remove = ferry.then_some("remove it");
    if !meta.is_dir() {
        return Err(unfit_dir(path, var, "is not a directory", remove));
    }
    if meta.uid() != uid {
        return Err(unfit_dir(
            path,
            var,
            format!("belongs to uid {}, not to this user ({uid})", meta.uid()),
            remove,
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unfit_dir(
            path,
            var,
            format!(
                "group or others may write it (mode {:o})",
                meta.mode() & 0o7777
            ),
            ferry.then_some("chmod 700 it"),
        ));
    }
    Ok(())
}

fn load_or_create_in(base: Base, uid: libc::uid_t) -> Result<(Token, PathBuf)> {
    let dir = token_dir(base, uid)?;
    let path = dir.token_path();
    if let Some(token) = read_in(&dir, uid)? {
        return Ok((token, path));
    }
    if create_in(&dir)? {
        log::info!(
            "no auth token configured: created this user's token {} (processes of this \
             user trust each other; other users are refused)",
            path.display()
        );
    }
    match read_in(&dir, uid)? {
        Some(token) => Ok((token, path)),
        None => Err(refused(&path, "vanished while being created")),
    }
}

/// Opens (creating it, mode 0700, when missing) and checks `base/ferry`.
fn token_dir(base: Base, uid: libc::uid_t) -> Result<TokenDir> {
    let path = base.path.join("ferry");
    let token = path.join("token");
    let base_dir = match base.opened {
        Some(d) => d,
        None => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&base.path)
                .map_err(|e| refused(&token, format!("cannot create its directory: {e}")))?;
            open_dir(&base.path)
                .map_err(|e| refused(&token, format!("cannot open its directory: {e}")))?
        }
    };
    // SAFETY: DIR_NAME is NUL-terminated; base_dir is an open descriptor.
    let rc = unsafe { libc::mkdirat(base_dir.as_raw_fd(), DIR_NAME.as_ptr(), 0o700) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(refused(&token, format!("cannot create its directory: {e}")));
        }
    }
    let file =
        open_at(&base_dir, DIR_NAME, dir_flags(true), 0).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP | libc::ENOTDIR) if is_link(&base_dir, DIR_NAME) => {
                unfit_dir(&path, base.var, "is a symbolic link", Some("remove it"))
            }
            Some(libc::ELOOP | libc::ENOTDIR) => {
                unfit_dir(&path, base.var, "is not a directory", Some("remove it"))
            }
            _ => refused(&token, format!("cannot open its directory: {e}")),
        })?;
    check_dir(&file, &path, base.var, uid, true)?;
    Ok(TokenDir {
        file,
        path,
        var: base.var,
    })
}

/// Whether `name` in `dir` is a symbolic link (to explain a refusal).
fn is_link(dir: &File, name: &CStr) -> bool {
    // SAFETY: a zeroed stat is valid storage.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: name is NUL-terminated; dir is an open descriptor; fstatat
    // writes st only.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    rc == 0 && st.st_mode & libc::S_IFMT == libc::S_IFLNK
}

fn dir_flags(nofollow: bool) -> libc::c_int {
    let nofollow = if nofollow { libc::O_NOFOLLOW } else { 0 };
    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | nofollow
}

/// Opens the directory `path`, following symbolic links in it (the
/// directory reached is what gets checked).
fn open_dir(path: &Path) -> std::io::Result<File> {
    let name = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: name is NUL-terminated; AT_FDCWD names the working directory.
    let fd = unsafe { libc::openat(libc::AT_FDCWD, name.as_ptr(), dir_flags(false)) };
    owned(fd)
}

/// `openat(dir, name, flags, mode)` as an owned file.
fn open_at(
    dir: &File,
    name: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> std::io::Result<File> {
    // SAFETY: name is NUL-terminated; dir is an open descriptor; mode is
    // read only when flags hold O_CREAT.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode as libc::c_uint) };
    owned(fd)
}

fn owned(fd: libc::c_int) -> std::io::Result<File> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by openat, so it is open and nothing
    // else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The token in `dir`, None when there is no file; refuses a symbolic
/// link, and an opened file that is not a regular file of ours, or that
/// others may read or write.
fn read_in(dir: &TokenDir, uid: libc::uid_t) -> Result<Option<Token>> {
    let path = dir.token_path();
    // O_NONBLOCK: a FIFO put there fails the checks below instead of
    // blocking the open.
    let flags =
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK;
    let mut file = match open_at(&dir.file, FILE_NAME, flags, 0) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refused(&path, "is a symbolic link; remove it"))
        }
        Err(e) => return Err(refused(&path, e)),
    };
    let meta = file.metadata().map_err(|e| refused(&path, e))?;
    if !meta.is_file() {
        return Err(refused(&path, "is not a regular file"));
    }
    if meta.uid() != uid {
        return Err(refused(
            &path,
            format!("belongs to uid {}, not to this user ({uid})", meta.uid()),
        ));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refused(
            &path,
            format!(
                "others may read or write it (mode {:o}); chmod 600 it",
                meta.mode() & 0o777
            ),
        ));
    }
    let mut raw = Vec::new();
    (&mut file)
        .take(MAX_FILE)
        .read_to_end(&mut raw)
        .map_err(|e| refused(&path, e))?;
    let text = std::str::from_utf8(&raw).map_err(|_| refused(&path, "is not text"))?;
    Token::new(text.lines().next().unwrap_or(""))
        .map(Some)
        .ok_or_else(|| refused(&path, "is empty"))
}

/// Writes a new token into `dir`: true when it is ours, false when another
/// process linked its own first (then theirs is the one to read).
fn create_in(dir: &TokenDir) -> Result<bool> {
    let path = dir.token_path();
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| refused(&path, format!("no random numbers: {e}")))?;
    let text: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    // Unique per process and per call, so threads racing in one process do
    // not share a temporary file either.
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = CString::new(format!(
        ".token.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
    .map_err(|_| refused(&path, "bad temporary name"))?;
    let d = dir.file.as_raw_fd();
    // SAFETY: tmp is NUL-terminated; d is an open directory descriptor.
    unsafe { libc::unlinkat(d, tmp.as_ptr(), 0) };
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let written = open_at(&dir.file, &tmp, flags, 0o600).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    });
    let linked = written.and_then(|()| {
        // SAFETY: both names are NUL-terminated; d is an open directory
        // descriptor; flags 0 links the name itself.
        let rc = unsafe { libc::linkat(d, tmp.as_ptr(), d, FILE_NAME.as_ptr(), 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    });
    // SAFETY: d is the directory fd opened above and still open; tmp is a
    // NUL-terminated name; unlinkat reads nothing else.
    unsafe { libc::unlinkat(d, tmp.as_ptr(), 0) };
    match linked {
        Ok(()) => Ok(true),
        // Another process created it first: use theirs (checked like any).
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(refused(
            &path,
            format!(
                "cannot create it: {e} (in {}, chosen by {})",
                dir.path.display(),
                dir.var
            ),
        )),
    }
}

#[cfg(test)]
#[path = "user_token_tests.rs"]
mod tests;
