//! Which file holds the running Ferry code: libferry.so when a program links
//! the C library, the `ferry` binary otherwise. Plugins are looked for beside
//! it, so an unpacked tarball works wherever it is unpacked.

use std::ffi::{c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The absolute path of the object (shared library or executable) that
/// contains this function (looked up once per process).
pub fn containing_object() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    FOUND.get_or_init(find).clone()
}

fn find() -> Option<PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    let here = find as fn() -> Option<PathBuf> as *const c_void;
    // SAFETY: dladdr only reads the loader's tables; `info` is a valid,
    // writable Dl_info and `here` is an address inside this object.
    let found = unsafe { libc::dladdr(here, &mut info) } != 0;
    if found && !info.dli_fname.is_null() {
        // SAFETY: dladdr returned a NUL-terminated name owned by the dynamic
        // loader, valid while the object stays loaded (it is us).
        let name = unsafe { CStr::from_ptr(info.dli_fname) };
        let path = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
        // The main executable is reported by the name it was started with,
        // which may be relative to a directory we have since left.
        if path.is_absolute() {
            return Some(std::fs::canonicalize(&path).unwrap_or(path));
        }
    }
    std::env::current_exe()
        .ok()
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
}
