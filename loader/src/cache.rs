//! Probe results kept between processes, so a warm start spawns no probe
//! child and calls no probe. A result is reused only when everything it may
//! depend on is unchanged: the plugin file (path, size, mtime, inode, build
//! id), the libraries it mapped, this Ferry build, this boot of the host,
//! the shared library cache and loaded kernel modules, the environment
//! variables that matter (fingerprint.rs), and the host's answer to every
//! question the probe asked plus its NIC list (asked.rs). A probe that timed
//! out is probed again under a longer timeout.
//!
//! The file is JSON, written whole to a temporary file and renamed over the
//! old one under an advisory lock (concurrent writers merge, none corrupts
//! it); anything unreadable in it is dropped and rewritten. Where no
//! directory is writable the results stay in this process.

use crate::asked::{still_true, Asked};
use crate::config::CacheChoice;
use crate::discover::Candidate;
use crate::elf::ElfFacts;
use crate::fingerprint::{self, Digest, FileStamp};
use crate::host::HostServices;
use crate::protocol::MAX_LIBS;
use crate::report::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Raised when what a probe report holds changes (2: a GPU's facts), so
/// older entries are probed again rather than read without them.
const FORMAT: &str = "ferry-plugin-probes/2";
const FILE_NAME: &str = "plugin-probes.json";
/// Entries kept (newest first); a host has a handful of plugins, times the
/// configurations it runs them under.
const MAX_ENTRIES: usize = 256;
/// The largest cache file read.
const MAX_FILE: u64 = 8 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Entry {
    key: String,
    path: PathBuf,
    written: u64,
    libs: Vec<(PathBuf, FileStamp)>,
    asked: Vec<Asked>,
    outcome: Outcome,
}

impl Entry {
    fn sane(&self) -> bool {
        self.outcome.check().is_ok() && self.libs.len() <= MAX_LIBS && self.asked.len() <= 1024
    }

    /// Same plugin, same questions, same answers: the newer replaces the
    /// older. Results for other answers (two engines configured
    /// differently) are kept side by side, up to [`MAX_PER_KEY`].
    fn same_slot(&self, other: &Entry) -> bool {
        self.key == other.key && self.asked == other.asked
    }
}

/// Results kept per plugin file, for as many sets of answers.
const MAX_PER_KEY: usize = 8;

/// Adds `e` to `entries`: replaces its slot, and keeps at most
/// [`MAX_PER_KEY`] results for its key, the newest.
fn insert(entries: &mut Vec<Entry>, e: Entry) {
    entries.retain(|old| !old.same_slot(&e));
    let same_key = entries.iter().filter(|old| old.key == e.key).count();
    if same_key >= MAX_PER_KEY {
        if let Some(oldest) = entries
            .iter()
            .enumerate()
            .filter(|(_, old)| old.key == e.key)
            .min_by_key(|(_, old)| old.written)
            .map(|(i, _)| i)
        {
            entries.remove(oldest);
        }
    }
    entries.push(e);
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    format: String,
    entries: Vec<Entry>,
}

/// What this process remembers, cache file or not.
fn memo() -> &'static Mutex<Vec<Entry>> {
    static MEMO: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    MEMO.get_or_init(Default::default)
}

/// The cache as one discovery pass uses it.
pub(crate) struct Cache {
    on: bool,
    /// Where results are read from and written to, best first.
    files: Vec<PathBuf>,
    base: String,
    disk: OnceLock<Vec<Entry>>,
    stamps: Mutex<HashMap<PathBuf, Option<FileStamp>>>,
    fresh: Mutex<Vec<Entry>>,
    written_to: Mutex<Option<PathBuf>>,
}

impl Cache {
    pub(crate) fn open(choice: &CacheChoice) -> Cache {
        let (on, files) = match choice {
            CacheChoice::Off => (false, Vec::new()),
            CacheChoice::Path(p) => (true, vec![p.clone()]),
            CacheChoice::Auto => (true, default_files()),
        };
        let base = if on { base_key() } else { String::new() };
        Cache {
            on,
            files,
            base,
            disk: OnceLock::new(),
            stamps: Mutex::default(),
            fresh: Mutex::default(),
            written_to: Mutex::default(),
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        self.on
    }

    /// The file results live in: the one written, else the one read; `None`
    /// when there is neither (results stay in this process).
    pub(crate) fn file(&self) -> Option<PathBuf> {
        if let Some(p) = self
            .written_to
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Some(p);
        }
        self.files.iter().find(|f| f.exists()).cloned()
    }

    /// This plugin file's key (with everything else that must match).
    pub(crate) fn key(&self, cand: &Candidate, facts: &ElfFacts) -> String {
        let s = facts.stamp;
        Digest::new("plugin")
            .add(&self.base)
            .add(&cand.path.to_string_lossy())
            .add(cand.kind.as_str())
            .add(&cand.name)
            .add(&format!("{} {} {} {}", s.size, s.mtime_ns, s.dev, s.ino))
            .add(facts.build_id.as_deref().unwrap_or("-"))
            .finish()
    }

    /// A result still valid for this key, this host and this timeout.
    pub(crate) fn lookup(
        &self,
        key: &str,
        host: &dyn HostServices,
        timeout: Duration,
    ) -> Option<Outcome> {
        if !self.on {
            return None;
        }
        let valid = |e: &Entry| e.key == key && self.still_valid(e, host, timeout);
        let remembered = memo()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|e| valid(e))
            .map(|e| e.outcome.clone());
        if remembered.is_some() {
            return remembered;
        }
        let found = self.disk().iter().find(|e| valid(e))?.clone();
        remember(found.clone());
        Some(found.outcome)
    }

    fn still_valid(&self, e: &Entry, host: &dyn HostServices, timeout: Duration) -> bool {
        if let Some(limit) = e.outcome.timed_out_after_ms {
            if timeout.as_millis() > u128::from(limit) {
                return false;
            }
        }
        let libs_same = e.libs.iter().all(|(path, stamp)| {
            let mut stamps = self.stamps.lock().unwrap_or_else(PoisonError::into_inner);
            let now = *stamps
                .entry(path.clone())
                .or_insert_with(|| FileStamp::of_path(path));
            now == Some(*stamp)
        });
        libs_same && still_true(&e.asked, host)
    }

    /// Keeps a result (in this process at once; on disk at `flush`).
    pub(crate) fn store(
        &self,
        key: String,
        path: &Path,
        outcome: &Outcome,
        asked: Vec<Asked>,
        libs: &[PathBuf],
    ) {
        if !self.on {
            return;
        }
        let libs = libs
            .iter()
            .filter_map(|p| FileStamp::of_path(p).map(|s| (p.clone(), s)))
            .collect();
        let entry = Entry {
            key,
            path: path.to_path_buf(),
            written: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            libs,
            asked,
            outcome: outcome.clone(),
        };
        remember(entry.clone());
        self.fresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(entry);
    }

    /// Writes what this pass learned to the cache file.
    pub(crate) fn flush(&self) {
        let fresh = std::mem::take(&mut *self.fresh.lock().unwrap_or_else(PoisonError::into_inner));
        if fresh.is_empty() {
            return;
        }
        for file in &self.files {
            match write_merged(file, &fresh) {
                Ok(()) => {
                    *self
                        .written_to
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = Some(file.clone());
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Busy, not unwritable: the next start writes it.
                    log::debug!(
                        "plugin cache {}: {e}; not written this time",
                        file.display()
                    );
                    return;
                }
                Err(e) => log::debug!("plugin cache {}: {e}", file.display()),
            }
        }
        if !self.files.is_empty() {
            log::info!(
                "no writable place for the plugin cache ({}): probe results are kept in this \
                 process only",
                self.files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }

    fn disk(&self) -> &[Entry] {
        self.disk.get_or_init(|| {
            self.files
                .iter()
                .find_map(|f| read_file(f).ok().flatten())
                .unwrap_or_default()
        })
    }
}

fn remember(entry: Entry) {
    let mut m = memo().lock().unwrap_or_else(PoisonError::into_inner);
    insert(&mut m, entry);
    if m.len() > MAX_ENTRIES {
        m.remove(0);
    }
}

/// Everything the key of every plugin shares: this Ferry build, this host's
/// state, the environment.
fn base_key() -> String {
    let mut d = Digest::new(FORMAT);
    d.add(env!("CARGO_PKG_VERSION"))
        .add(&ferry_plugins_abi::abi_version());
    match crate::self_location::containing_object() {
        Some(p) => {
            d.add(&p.to_string_lossy());
            d.add_stamp(FileStamp::of_path(&p));
        }
        None => {
            d.add("-");
        }
    }
    fingerprint::add_system(&mut d);
    fingerprint::add_env(&mut d);
    d.finish()
}

/// `$XDG_CACHE_HOME/ferry` or `~/.cache/ferry`, then a private directory in
/// the temporary directory.
fn default_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let xdg = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    if let Some(dir) = xdg.or_else(|| home.map(|h| h.join(".cache"))) {
        files.push(dir.join("ferry").join(FILE_NAME));
    }
    // SAFETY: getuid cannot fail and has no side effects.
    let uid = unsafe { libc::getuid() };
    files.push(
        std::env::temp_dir()
            .join(format!("ferry-{uid}"))
            .join(FILE_NAME),
    );
    files
}

/// The entries of a cache file: `Ok(None)` when there is none.
fn read_file(path: &Path) -> std::io::Result<Option<Vec<Entry>>> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    // SAFETY: getuid cannot fail and has no side effects.
    if meta.uid() != unsafe { libc::getuid() } || meta.len() > MAX_FILE {
        log::info!(
            "ignoring the plugin cache {}: not this user's, or larger than {MAX_FILE} bytes",
            path.display()
        );
        return Ok(Some(Vec::new()));
    }
    let mut text = Vec::with_capacity(meta.len() as usize);
    f.take(MAX_FILE).read_to_end(&mut text)?;
    match serde_json::from_slice::<CacheFile>(&text) {
        Ok(c) if c.format == FORMAT => {
            Ok(Some(c.entries.into_iter().filter(Entry::sane).collect()))
        }
        Ok(_) => Ok(Some(Vec::new())),
        Err(e) => {
            log::info!(
                "the plugin cache {} is unreadable ({e}); it will be rewritten",
                path.display()
            );
            Ok(Some(Vec::new()))
        }
    }
}

/// Makes the cache directory (mode 0700); a directory in a shared place
/// must be ours and private.
fn make_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    // SAFETY: getuid cannot fail and has no side effects.
    let uid = unsafe { libc::getuid() };
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::other(format!(
            "{} is not a private directory of this user",
            dir.display()
        )));
    }
    Ok(())
}

/// Holds an advisory lock on `<file>.lock` for a read-merge-write.
struct FileLock(std::fs::File);

impl FileLock {
    fn take(file: &Path) -> std::io::Result<FileLock> {
        let lock_path = file.with_extension("lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(lock_path)?;
        let until = Instant::now() + Duration::from_millis(500);
        loop {
            // SAFETY: flock on a descriptor we own; no memory is involved.
            let r = unsafe {
                libc::flock(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    libc::LOCK_EX | libc::LOCK_NB,
                )
            };
            if r == 0 {
                return Ok(FileLock(f));
            }
            if Instant::now() >= until {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    "another process holds the cache lock",
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: unlocking a descriptor we own.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&self.0), libc::LOCK_UN) };
    }
}

/// Adds `fresh` to the file's entries (replacing older results for the same
/// plugin and questions, dropping those of files that are gone) and
/// replaces the file atomically.
fn write_merged(file: &Path, fresh: &[Entry]) -> std::io::Result<()> {
    let dir = file
        .parent()
        .ok_or_else(|| std::io::Error::other("no directory"))?;
    make_dir(dir)?;
    let _lock = FileLock::take(file)?;
    let mut entries = read_file(file)?.unwrap_or_default();
    for e in fresh {
        insert(&mut entries, e.clone());
    }
    entries.retain(|e| e.path.exists());
    if entries.len() > MAX_ENTRIES {
        entries.sort_by_key(|e| std::cmp::Reverse(e.written));
        entries.truncate(MAX_ENTRIES);
    }
    let text = serde_json::to_vec(&CacheFile {
        format: FORMAT.to_string(),
        entries,
    })
    .map_err(std::io::Error::other)?;
    let tmp = dir.join(format!(
        ".{FILE_NAME}.{}.{}.tmp",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.sync_data()?;
        std::fs::rename(&tmp, file)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Stage;

    fn entry(key: &str, path: &Path) -> Entry {
        Entry {
            key: key.into(),
            path: path.to_path_buf(),
            written: 1,
            libs: Vec::new(),
            asked: Vec::new(),
            outcome: Outcome::disabled(Stage::Probed, "no device".into()),
        }
    }

    #[test]
    fn writes_merge_and_corruption_is_survived() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub/plugin-probes.json");
        let plugin = dir.path().join("libferry_transport_x.so");
        std::fs::write(&plugin, "x").unwrap();
        write_merged(&file, &[entry("a", &plugin)]).unwrap();
        write_merged(&file, &[entry("b", &plugin)]).unwrap();
        let got = read_file(&file).unwrap().unwrap();
        assert_eq!(got.len(), 2);
        // Entries of files that are gone are dropped at the next write.
        write_merged(&file, &[entry("c", &dir.path().join("gone.so"))]).unwrap();
        assert_eq!(read_file(&file).unwrap().unwrap().len(), 2);

        std::fs::write(&file, b"{\"format\": \"ferry-plugin-probes/1\", \"entr").unwrap();
        assert_eq!(read_file(&file).unwrap().unwrap().len(), 0);
        write_merged(&file, &[entry("d", &plugin)]).unwrap();
        assert_eq!(read_file(&file).unwrap().unwrap().len(), 1);
        let mode = std::fs::metadata(&file).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn hostile_entries_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plugin-probes.json");
        let plugin = dir.path().join("libferry_transport_x.so");
        std::fs::write(&plugin, "x").unwrap();
        let mut bad = entry("a", &plugin);
        bad.outcome.version = Some("v".repeat(10_000));
        let text = serde_json::to_vec(&CacheFile {
            format: FORMAT.into(),
            entries: vec![bad, entry("b", &plugin)],
        })
        .unwrap();
        std::fs::write(&file, text).unwrap();
        let got = read_file(&file).unwrap().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].key, "b");
    }

    #[test]
    fn concurrent_writers_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plugin-probes.json");
        let plugin = dir.path().join("libferry_transport_x.so");
        std::fs::write(&plugin, "x").unwrap();
        std::thread::scope(|s| {
            for i in 0..8 {
                let (file, plugin) = (&file, &plugin);
                s.spawn(move || write_merged(file, &[entry(&format!("k{i}"), plugin)]).unwrap());
            }
        });
        assert_eq!(read_file(&file).unwrap().unwrap().len(), 8);
    }
}
