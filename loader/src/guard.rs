//! Process-wide rules for probing one plugin file, whatever the number of
//! engines: one probe at a time (plugin.h promises it), and a file whose
//! probe timed out is never probed again in this process (the abandoned
//! probe may still be running; a second one would wait just as long).

use crate::fingerprint::FileStamp;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

/// A plugin file, as it is now: a replaced or rebuilt file is another one.
pub(crate) type FileKey = FileStamp;

fn locks() -> &'static Mutex<HashMap<FileKey, Arc<Mutex<()>>>> {
    static LOCKS: OnceLock<Mutex<HashMap<FileKey, Arc<Mutex<()>>>>> = OnceLock::new();
    LOCKS.get_or_init(Default::default)
}

fn timed_out() -> &'static Mutex<HashMap<FileKey, String>> {
    static TIMED_OUT: OnceLock<Mutex<HashMap<FileKey, String>>> = OnceLock::new();
    TIMED_OUT.get_or_init(Default::default)
}

/// Held while one plugin file is looked up, probed and recorded.
pub(crate) struct ProbeTurn {
    lock: Arc<Mutex<()>>,
}

impl ProbeTurn {
    /// Waits for any other probe of this file in this process to finish.
    pub(crate) fn wait(key: FileKey) -> ProbeTurn {
        let lock = locks()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_default()
            .clone();
        ProbeTurn { lock }
    }

    pub(crate) fn hold(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Remembers that this file's probe timed out, with the reason given.
pub(crate) fn mark_timed_out(key: FileKey, reason: &str) {
    timed_out()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key, reason.to_string());
}

/// The reason this file's probe timed out earlier in this process, if it did.
pub(crate) fn timed_out_before(key: &FileKey) -> Option<String> {
    timed_out()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(key)
        .cloned()
}

/// Serialises probes that run in this process (no helper): at most one
/// plugin's code runs under the loader at a time, so "probing <path>" in the
/// log names the plugin that was running when a crash came.
pub(crate) fn in_process_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}
