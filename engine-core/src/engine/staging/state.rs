//! The staging state of one engine: its chunk size and depth, the slots it
//! lent to peers, its own slot pool and idle copy streams.

use super::protocol::{MAX_SLOTS, MAX_SLOT_LEN};
use super::slots::SlotPool;
use crate::device::Stream;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Default for FERRY_STAGING_CHUNK: bytes per staged chunk.
pub const DEFAULT_CHUNK: u64 = 4 << 20;
/// Default for FERRY_STAGING_DEPTH: chunks in flight per staged job.
pub const DEFAULT_DEPTH: usize = 4;

/// Staging state of one engine: its configuration, the sessions peers
/// opened here, its own pool of local slots and of copy streams.
pub(crate) struct Staging {
    pub(crate) chunk: u64,
    pub(crate) depth: usize,
    pub(crate) sessions: Mutex<HashMap<u64, Arc<Mutex<Session>>>>,
    /// Bytes lent to peers, all sessions together.
    pub(crate) lent: Mutex<u64>,
    pub(crate) local: Mutex<Option<Arc<SlotPool>>>,
    pub(crate) streams: Mutex<HashMap<(usize, u32), Vec<Stream>>>,
}

/// Slots lent to one peer on one control connection.
pub(crate) struct Session {
    pub(crate) slots: Vec<(u64, u64)>,
    pub(crate) streams: HashMap<usize, Stream>,
}

impl Staging {
    pub(crate) fn from_env() -> Staging {
        let num = |var: &str, default: u64| {
            std::env::var(var)
                .ok()
                .and_then(|v| crate::config::parse_size_text(&v))
                .unwrap_or(default)
        };
        Staging {
            chunk: num("FERRY_STAGING_CHUNK", DEFAULT_CHUNK).clamp(64 << 10, MAX_SLOT_LEN),
            depth: (num("FERRY_STAGING_DEPTH", DEFAULT_DEPTH as u64) as usize).clamp(1, MAX_SLOTS),
            sessions: Mutex::new(HashMap::new()),
            lent: Mutex::new(0),
            local: Mutex::new(None),
            streams: Mutex::new(HashMap::new()),
        }
    }
}

/// Most bytes of slots one engine lends to all its peers together.
pub(crate) const MAX_LENT: u64 = 2 << 30;
