//! Loading one plugin file into a process: dlopen, the entry symbol (which
//! must live in that very file), and the table it returns, checked before
//! anything else of the plugin is called. It runs in the ferry-probe child
//! first; in the application only once that child said the plugin is fine.

use crate::discover::Candidate;
use crate::elf::{parse_entry_symbol, ElfFacts};
use crate::host::{HostServices, ServicesTable};
use crate::report::{bounded, PluginKind, MAX_PLUGIN_STRING};
use ferry_plugins_abi::has_field;
use ferry_plugins_abi::sys;
use ferry_plugins_abi::versioned::{read_plain, Plain};
use std::ffi::{c_char, c_void, CStr};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

impl PluginKind {
    pub(crate) fn entry_symbol_v1(self) -> &'static str {
        match self {
            PluginKind::Transport => sys::FERRY_TRANSPORT_PLUGIN_V1_SYMBOL,
            PluginKind::Device => sys::FERRY_DEVICE_PLUGIN_V1_SYMBOL,
        }
    }
}

/// A plugin's table, by kind: this process's copy of it (`copy_table`).
enum Table {
    Transport(Box<sys::ferry_transport_plugin_v1_t>),
    Device(Box<sys::ferry_device_plugin_v1_t>),
}

/// This process's copy of a plugin's table, as long as this Ferry's struct:
/// the bytes the plugin's `struct_size` covers, zero beyond (absent fields
/// read as NULL, None, 0), by `versioned::read_plain`. A plugin built for
/// an older minor version has a shorter table, so a reference to its own
/// table would reach past its end; the copy's header keeps the plugin's
/// `struct_size`, so `has_field!` still says what the plugin has.
///
/// # Safety
/// `t` is null or points to a table whose header is readable and which is
/// readable for its header's `struct_size` bytes (plugin.h's rule for
/// every versioned struct), for the duration of the call.
unsafe fn copy_table<T: Plain>(t: *const T) -> Result<Box<T>, String> {
    // SAFETY: this function's contract is read_plain's.
    unsafe { read_plain(t) }
        .map(Box::new)
        .ok_or_else(|| "its entry function returned no table".into())
}

/// A loaded plugin library with its validated table and its services table.
/// Dropping the last reference unloads the library.
pub struct LoadedLibrary {
    table: Table,
    services: ServicesTable,
    // Declared last: the library is closed only after everything above,
    // which may point into it, is dropped.
    _library: libloading::Library,
}

// SAFETY: the table is this struct's own immutable copy, whose pointers
// lead into the library, which stays loaded as long as this struct lives;
// the ABI requires plugins to accept calls from any thread (plugin.h,
// "Threads").
unsafe impl Send for LoadedLibrary {}
// SAFETY: shared access only reads the immutable table copy, and the ABI
// requires plugins to accept concurrent calls from any thread (plugin.h,
// "Threads").
unsafe impl Sync for LoadedLibrary {}

impl LoadedLibrary {
    /// The transport table, validated to be ABI v1 and at least v1.0's size.
    pub fn transport_table(&self) -> Option<&sys::ferry_transport_plugin_v1_t> {
        match &self.table {
            Table::Transport(t) => Some(t),
            Table::Device(_) => None,
        }
    }

    /// The device table, validated to be ABI v1 and at least v1.0's size.
    pub fn device_table(&self) -> Option<&sys::ferry_device_plugin_v1_t> {
        match &self.table {
            Table::Device(t) => Some(t),
            Table::Transport(_) => None,
        }
    }

    /// The services table this plugin was given; valid while `self` lives.
    pub fn services(&self) -> *const sys::ferry_host_services_t {
        self.services.as_ptr()
    }

    /// The table's version and description strings, and its ABI "major.minor".
    pub(crate) fn strings(&self) -> (String, String, String) {
        let (hdr, version, description) = match (self.transport_table(), self.device_table()) {
            (Some(t), _) => (t.hdr, t.version, t.description),
            (None, Some(t)) => (t.hdr, t.version, t.description),
            (None, None) => return Default::default(),
        };
        // SAFETY: strings of a validated table are C strings or null.
        let version = unsafe { plugin_str(version) }.unwrap_or_default();
        // SAFETY: the same validated table: its description is null or a C
        // string inside the library, which stays loaded while `self` lives.
        let description = unsafe { plugin_str(description) }.unwrap_or_default();
        (
            version,
            description,
            format!("{}.{}", hdr.abi_major, hdr.abi_minor),
        )
    }

    /// The probe function (validated present when loaded).
    pub(crate) fn probe_fn(&self) -> Option<sys::ferry_probe_fn> {
        match self.table {
            Table::Transport(_) => self.transport_table().and_then(|t| t.probe),
            Table::Device(_) => self.device_table().and_then(|t| t.probe),
        }
    }
}

/// The functions a transport table with `init` lacks, of those plugin.h
/// requires once `init` is set (empty when complete, or without `init`: a
/// probe-only plugin).
pub fn missing_transport_functions(t: &sys::ferry_transport_plugin_v1_t) -> Vec<&'static str> {
    if !has_field!(t, sys::ferry_transport_plugin_v1_t, init) || t.init.is_none() {
        return Vec::new();
    }
    macro_rules! absent {
        ($($f:ident),*) => {{
            let mut v = Vec::new();
            $(if !has_field!(t, sys::ferry_transport_plugin_v1_t, $f) || t.$f.is_none() {
                v.push(stringify!($f));
            })*
            v
        }};
    }
    absent!(
        fini,
        get_endpoint,
        register_memory,
        unregister_memory,
        connect,
        disconnect,
        submit
    )
}

/// As [`missing_transport_functions`], for device tables.
pub fn missing_device_functions(t: &sys::ferry_device_plugin_v1_t) -> Vec<&'static str> {
    if !has_field!(t, sys::ferry_device_plugin_v1_t, init) || t.init.is_none() {
        return Vec::new();
    }
    macro_rules! absent {
        ($($f:ident),*) => {{
            let mut v = Vec::new();
            $(if !has_field!(t, sys::ferry_device_plugin_v1_t, $f) || t.$f.is_none() {
                v.push(stringify!($f));
            })*
            v
        }};
    }
    absent!(
        fini,
        device_count,
        device_info,
        query_pointer,
        alloc_pinned,
        free_pinned,
        alloc_device,
        free_device,
        stream_create,
        stream_destroy,
        copy_async,
        stream_sync
    )
}

/// Opens the file (whose ELF headers `facts` describe) and validates its
/// table. `Err` carries the reason.
pub(crate) fn open(
    cand: &Candidate,
    facts: &ElfFacts,
    host: &Arc<dyn HostServices>,
) -> Result<Arc<LoadedLibrary>, String> {
    let wanted = cand.kind.entry_symbol_v1();
    if !facts.entry_symbols.iter().any(|s| s == wanted) {
        return Err(missing_entry_reason(cand, &facts.entry_symbols));
    }

    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    // SAFETY: loading a library runs its constructors; that is the trust we
    // extend to a plugin once its file passed the ELF checks (and, with the
    // ferry-probe helper, once a child process survived loading it).
    let library = unsafe { libloading::os::unix::Library::open(Some(&cand.path), flags) }
        .map_err(|e| explain_dlopen_error(&error_chain(&e), &cand.path))?;
    let library: libloading::Library = library.into();

    let symbol_name = format!("{wanted}\0");
    let entry_addr: *const c_void = match cand.kind {
        PluginKind::Transport => {
            // SAFETY: the symbol has the entry function's type per plugin.h.
            let f = unsafe {
                library.get::<sys::ferry_transport_plugin_v1_entry_fn>(symbol_name.as_bytes())
            }
            .map_err(|e| format!("cannot resolve {wanted}: {e}"))?;
            *f as *const c_void
        }
        PluginKind::Device => {
            // SAFETY: the symbol has the entry function's type per plugin.h.
            let f = unsafe {
                library.get::<sys::ferry_device_plugin_v1_entry_fn>(symbol_name.as_bytes())
            }
            .map_err(|e| format!("cannot resolve {wanted}: {e}"))?;
            *f as *const c_void
        }
    };
    check_symbol_lives_in(entry_addr, &cand.path, wanted)?;

    let table = match cand.kind {
        PluginKind::Transport => {
            // SAFETY: entry_addr is the plugin's entry function, resolved
            // from this library, with the signature plugin.h declares.
            let entry: sys::ferry_transport_plugin_v1_entry_fn =
                unsafe { std::mem::transmute(entry_addr) };
            // SAFETY: calling the plugin's side-effect-free entry function.
            let t = unsafe { entry() };
            // SAFETY: plugin.h makes the table null or readable for its
            // struct_size, in the library, loaded for this whole function.
            let t_ref = unsafe { copy_table(t) }?;
            check_header(&t_ref.hdr, cand.kind)?;
            if !has_field!(&*t_ref, sys::ferry_transport_plugin_v1_t, probe) {
                return Err(format!(
                    "its table is {} bytes, too small for plugin ABI 1.0",
                    t_ref.hdr.struct_size
                ));
            }
            check_strings(t_ref.name, t_ref.version, t_ref.probe.is_some(), cand)?;
            check_complete(&missing_transport_functions(&t_ref), cand.kind)?;
            Table::Transport(t_ref)
        }
        PluginKind::Device => {
            // SAFETY: as for transports.
            let entry: sys::ferry_device_plugin_v1_entry_fn =
                unsafe { std::mem::transmute(entry_addr) };
            // SAFETY: calling the plugin's side-effect-free entry function.
            let t = unsafe { entry() };
            // SAFETY: as for transports: null or readable for struct_size.
            let t_ref = unsafe { copy_table(t) }?;
            check_header(&t_ref.hdr, cand.kind)?;
            if !has_field!(&*t_ref, sys::ferry_device_plugin_v1_t, probe) {
                return Err(format!(
                    "its table is {} bytes, too small for plugin ABI 1.0",
                    t_ref.hdr.struct_size
                ));
            }
            check_strings(t_ref.name, t_ref.version, t_ref.probe.is_some(), cand)?;
            check_complete(&missing_device_functions(&t_ref), cand.kind)?;
            Table::Device(t_ref)
        }
    };
    Ok(Arc::new(LoadedLibrary {
        table,
        services: ServicesTable::new(&cand.name, host.clone()),
        _library: library,
    }))
}

fn check_complete(missing: &[&str], kind: PluginKind) -> Result<(), String> {
    if missing.is_empty() {
        return Ok(());
    }
    let what = match kind {
        PluginKind::Transport => "data path",
        PluginKind::Device => "device interface",
    };
    Err(format!(
        "its table has init but not {} (plugin.h requires the whole {what} once init is \
         set; a plugin without init is listed as probe-only)",
        missing.join(", ")
    ))
}

fn missing_entry_reason(cand: &Candidate, found: &[String]) -> String {
    let wanted = cand.kind.entry_symbol_v1();
    let same_kind: Vec<(&str, u32)> = found
        .iter()
        .filter_map(|s| parse_entry_symbol(s))
        .filter(|(k, _)| *k == cand.kind.as_str())
        .collect();
    if let Some((_, major)) = same_kind.first() {
        return format!(
            "built for plugin ABI v{major} (it exports ferry_{}_plugin_v{major}); this Ferry \
             speaks ABI v{}: use a build of the plugin for this Ferry",
            cand.kind.as_str(),
            sys::FERRY_PLUGIN_ABI_MAJOR
        );
    }
    if let Some(other) = found.first() {
        return format!(
            "its file name says {} plugin but it exports {other}; rename the file to match \
             what it is",
            cand.kind.as_str()
        );
    }
    format!(
        "exports no {wanted} entry symbol, so it is not a Ferry {} plugin \
         (`nm -D --defined-only` shows what it exports)",
        cand.kind.as_str()
    )
}

fn check_header(hdr: &sys::ferry_abi_header_t, kind: PluginKind) -> Result<(), String> {
    if hdr.abi_major != sys::FERRY_PLUGIN_ABI_MAJOR {
        return Err(format!(
            "its {} table says plugin ABI {}.{}, but this Ferry speaks {}.{} and the major \
             versions must match",
            kind.as_str(),
            hdr.abi_major,
            hdr.abi_minor,
            sys::FERRY_PLUGIN_ABI_MAJOR,
            sys::FERRY_PLUGIN_ABI_MINOR
        ));
    }
    Ok(())
}

/// Reads a plugin-provided C string, bounded in what we keep.
///
/// # Safety
/// `s` must be null or a NUL-terminated string that stays valid.
pub(crate) unsafe fn plugin_str(s: *const c_char) -> Option<String> {
    if s.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per the ABI.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    Some(bounded(&text, MAX_PLUGIN_STRING))
}

fn check_strings(
    name: *const c_char,
    version: *const c_char,
    has_probe: bool,
    cand: &Candidate,
) -> Result<(), String> {
    // SAFETY: strings in a validated table are C strings per the ABI.
    let name = unsafe { plugin_str(name) }.ok_or("its table has no name")?;
    // SAFETY: the same validated table: its version is null or a C string
    // per the ABI, inside the library the caller holds loaded.
    if unsafe { plugin_str(version) }.is_none() {
        return Err("its table has no version".into());
    }
    if !has_probe {
        return Err("its table has no probe function (required)".into());
    }
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !valid {
        return Err(format!(
            "it calls itself {name:?}; a plugin name is 1-64 characters of a-z, 0-9, '-'"
        ));
    }
    if crate::config::normalize_name(&name) != cand.name {
        return Err(format!(
            "it calls itself '{name}' but its file name says '{}'; rename the file to \
             libferry_{}_{name}.so",
            cand.name,
            cand.kind.as_str()
        ));
    }
    Ok(())
}

fn check_symbol_lives_in(addr: *const c_void, path: &Path, symbol: &str) -> Result<(), String> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables into `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) } != 0;
    if !ok || info.dli_fname.is_null() {
        return Err(format!("cannot tell which file defines {symbol}"));
    }
    // SAFETY: dladdr gave a NUL-terminated name owned by the loader.
    let fname = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    let same = match (std::fs::metadata(&fname), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(format!(
            "{symbol} resolves to {fname}, not to this file; refusing a plugin whose entry \
             point lives elsewhere"
        ))
    }
}

/// An error and its sources as one line: libloading puts dlerror()'s text
/// in the source, not in the top-level message.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

/// Explains a dlopen failure in operator words.
fn explain_dlopen_error(msg: &str, path: &Path) -> String {
    const NO_FILE: &str = ": cannot open shared object file";
    if let Some(idx) = msg.find(NO_FILE) {
        let before = &msg[..idx];
        let lib = before.rsplit(": ").next().unwrap_or(before).trim();
        let ours = path.to_string_lossy();
        if !lib.is_empty() && lib != ours {
            return format!(
                "needs {lib}, which is not installed on this host or not on the library \
                 search path (`ldd {}` lists what is missing)",
                path.display()
            );
        }
    }
    if let Some(idx) = msg.find("undefined symbol: ") {
        let sym = msg[idx + "undefined symbol: ".len()..]
            .split([' ', ','])
            .next()
            .unwrap_or("");
        return format!(
            "needs the symbol {sym}, which none of its libraries provide \
             (built against a different version of a dependency?)"
        );
    }
    if msg.contains("version `GLIBC_") {
        return format!("needs a newer C library than this host has: {msg}");
    }
    format!("the dynamic loader refused it: {msg}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlopen_errors_name_the_missing_library() {
        let p = Path::new("/x/libferry_transport_a.so");
        let r = explain_dlopen_error(
            "libfoo.so.1: cannot open shared object file: No such file or directory",
            p,
        );
        assert!(r.starts_with("needs libfoo.so.1,"), "{r}");
        let r = explain_dlopen_error("/x/libferry_transport_a.so: undefined symbol: bar_v2", p);
        assert!(r.contains("needs the symbol bar_v2"), "{r}");
    }
}
