//! What the initiator tracks per request: an entry per descriptor sent,
//! completed once (a request split over connections reports when its last
//! part does), and the frames in flight that carry them.

use crate::wire::Kind;
use ferry_plugins_abi::sdk::{Completer, PluginError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Completion of one request split into parts: the last part reports.
pub(crate) struct Split {
    pub(crate) token: u64,
    pub(crate) remaining: AtomicUsize,
    pub(crate) error: Mutex<Option<PluginError>>,
}

pub(crate) enum Done {
    Token(u64),
    Part(std::sync::Arc<Split>),
}

pub(crate) struct Entry {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    pub(crate) done: Done,
}

impl Entry {
    pub(crate) fn finish(self, completer: &Completer, result: Result<(), PluginError>) {
        match self.done {
            Done::Token(t) => completer.complete(t, result.as_ref().map(|_| ())),
            Done::Part(split) => {
                if let Err(e) = result {
                    let mut slot = split.error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
                if split.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
                    let err = split.error.lock().unwrap_or_else(|p| p.into_inner()).take();
                    completer.complete(split.token, err.as_ref().map_or(Ok(()), Err));
                }
            }
        }
    }
}

/// A frame sent and not yet answered.
pub(crate) struct Inflight {
    pub(crate) seq: u64,
    pub(crate) kind: Kind,
    pub(crate) entries: Vec<Entry>,
    pub(crate) enqueued: Instant,
    /// It moves enough that the I/O loop reads for it at once rather than
    /// leave it to a waiting caller first.
    pub(crate) eager: bool,
}
