//! The per-user token: what an engine uses when no token is configured, so
//! that processes of one user trust each other with no setup and other
//! users of the host are refused.
//!
//! The file is `$XDG_RUNTIME_DIR/ferry/token` when that directory is set
//! and ours, else `$XDG_CONFIG_HOME/ferry/token` (or `~/.config/ferry/token`).
//! It holds 32 random bytes in hex, mode 0600 in a 0700 directory. It is
//! created atomically: written whole under a temporary name, then linked to
//! its final name, which fails if another process won the race (whose file
//! is then used). A file another user owns, or one others may read, is
//! refused with the reason, never used.

use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sdk::auth::Token;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where this user's token lives (the file may not exist yet).
pub fn path() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let owned_dir = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.is_dir() && m.uid() == uid)
            .unwrap_or(false)
    };
    if let Some(run) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        if run.is_absolute() && owned_dir(&run) {
            return Ok(run.join("ferry").join("token"));
        }
    }
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .or_else(|| passwd_home(uid))
                .map(|h| h.join(".config"))
        })
        .ok_or_else(|| {
            Error::new(
                ErrorCode::Permission,
                "no token configured and nowhere to keep a per-user one (neither \
                 XDG_RUNTIME_DIR, XDG_CONFIG_HOME, HOME nor a home directory in the user \
                 database): set FERRY_AUTH_TOKEN or \
                 FERRY_AUTH_TOKEN_FILE, or FERRY_AUTH=off to let every local user in",
            )
        })?;
    Ok(config.join("ferry").join("token"))
}

/// The user's home directory from the user database (a service or a
/// clean environment may have no HOME).
fn passwd_home(uid: libc::uid_t) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
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
    let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
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

/// Reads this user's token, creating it first when there is none.
pub fn load_or_create() -> Result<(Token, PathBuf)> {
    let path = path()?;
    let dir = path
        .parent()
        .ok_or_else(|| refused(&path, "has no directory"))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| refused(&path, format!("cannot create its directory: {e}")))?;
    if let Some(token) = read(&path)? {
        return Ok((token, path));
    }
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| refused(&path, format!("no random numbers: {e}")))?;
    let text: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = dir.join(format!(".token.{}.tmp", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    })();
    let linked = written.and_then(|()| std::fs::hard_link(&tmp, &path));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            log::info!(
                "no auth token configured: created this user's token {} (processes of this \
                 user trust each other; other users are refused)",
                path.display()
            );
        }
        // Another process created it first: use theirs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(refused(&path, format!("cannot create it: {e}"))),
    }
    match read(&path)? {
        Some(token) => Ok((token, path)),
        None => Err(refused(&path, "vanished while being created")),
    }
}

/// The token in `path`, None when there is no file; refuses a file that
/// is not ours or that others may read or write.
fn read(path: &Path) -> Result<Option<Token>> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(refused(path, e)),
    };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if !meta.is_file() {
        return Err(refused(path, "is not a regular file"));
    }
    if meta.uid() != uid {
        return Err(refused(
            path,
            format!("belongs to uid {}, not to this user ({uid})", meta.uid()),
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(refused(
            path,
            format!(
                "others may read or write it (mode {:o}); chmod 600 it",
                meta.permissions().mode() & 0o777
            ),
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| refused(path, e))?;
    Token::new(text.lines().next().unwrap_or(""))
        .map(Some)
        .ok_or_else(|| refused(path, "is empty"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ferry").join("token");
        // Exercise the parts that do not read the environment.
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        assert!(read(&path).unwrap().is_none());
        std::fs::write(&path, "abc\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read(&path).unwrap_err();
        assert!(e.message.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read(&path).unwrap().is_some());
    }
}
