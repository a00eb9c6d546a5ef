//! The staging state of one engine: its chunk size and depth, the slots it
//! lent to peers, its own slot pool and idle copy streams.

use super::protocol::{MAX_SLOTS, MAX_SLOT_LEN};
use super::slots::SlotPool;
use crate::device::Stream;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

// The settings' limits (config.rs) fit the staging protocol's.
const _: () = assert!(crate::config::MAX_STAGING_CHUNK <= MAX_SLOT_LEN);
const _: () = assert!(crate::config::MAX_STAGING_DEPTH <= MAX_SLOTS);

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
    /// A copy stream per (device plugin, ordinal).
    pub(crate) streams: HashMap<(usize, u32), Stream>,
}

impl Staging {
    /// Staging with `chunk` bytes per chunk and `depth` chunks in flight
    /// (EngineConfig's staging_chunk and staging_depth, checked there).
    pub(crate) fn new(chunk: u64, depth: usize) -> Staging {
        Staging {
            chunk,
            depth,
            sessions: Mutex::new(HashMap::new()),
            lent: Mutex::new(0),
            local: Mutex::new(None),
            streams: Mutex::new(HashMap::new()),
        }
    }
}

/// Most bytes of slots one engine lends to all its peers together.
pub(crate) const MAX_LENT: u64 = 2 << 30;
