//! The routes of a segment's small requests, remembered across submissions.
//!
//! Selection weighs every transport, asks the peer's plugin whether it
//! serves the buffer and reads what was measured: about a fifth of a 4 KiB
//! shared-memory request's time on the engine's side. A program that sends
//! the same kind of small request again and again gets the same answer, so
//! the answer is kept for the same remote buffer, local buffer, length and
//! requested transport, and selection runs again after [`REUSES`] uses: a
//! route that measurement would move moves within that many requests.
//! Large requests are always selected afresh (they are measured, explored,
//! and selection is nothing beside their copy).
//!
//! Entries hold their buffers weakly: a buffer deregistered (or a view
//! replaced after the peer restarted) never matches again, and its address
//! cannot be reused by another while the entry holds it.

use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::{Arc, Weak};

/// Uses of a remembered route before selection runs again.
pub(crate) const REUSES: u32 = 64;

/// Routes remembered per segment (the oldest gives way).
const ENTRIES: usize = 8;

/// A kind of request: what a route is chosen for.
pub(crate) struct Kind<'a, V, L> {
    pub(crate) view: &'a Arc<V>,
    /// Index of the remote buffer in the view.
    pub(crate) remote: usize,
    pub(crate) local: &'a Arc<L>,
    pub(crate) bytes: u64,
    pub(crate) hint: Option<&'a str>,
}

/// A remembered route: the kind it was chosen for, and the answer.
struct Entry<V, L> {
    view: Weak<V>,
    remote: usize,
    local: Weak<L>,
    bytes: u64,
    hint: Option<Box<str>>,
    transport: usize,
    key: Arc<[u8]>,
    /// Uses left before selection runs again.
    left: u32,
}

impl<V, L> Entry<V, L> {
    fn is(&self, k: &Kind<'_, V, L>) -> bool {
        self.remote == k.remote
            && self.bytes == k.bytes
            && Weak::as_ptr(&self.view) == Arc::as_ptr(k.view)
            && Weak::as_ptr(&self.local) == Arc::as_ptr(k.local)
            && self.hint.as_deref() == k.hint
    }
}

/// One segment's remembered routes: over remote views `V`, local buffers `L`.
pub(crate) struct RouteMemo<V, L> {
    entries: Mutex<SmallVec<[Entry<V, L>; 2]>>,
}

impl<V, L> Default for RouteMemo<V, L> {
    fn default() -> Self {
        RouteMemo {
            entries: Mutex::new(SmallVec::new()),
        }
    }
}

impl<V, L> RouteMemo<V, L> {
    /// The transport and remote key chosen for this kind of request, unless
    /// none was or its uses ran out.
    pub(crate) fn get(&self, kind: &Kind<'_, V, L>) -> Option<(usize, Arc<[u8]>)> {
        let mut entries = self.entries.lock();
        let e = entries.iter_mut().find(|e| e.is(kind))?;
        e.left = e.left.checked_sub(1)?;
        Some((e.transport, e.key.clone()))
    }

    /// Remembers what selection chose for this kind of request.
    pub(crate) fn put(&self, kind: &Kind<'_, V, L>, transport: usize, key: &Arc<[u8]>) {
        let mut entries = self.entries.lock();
        // Entries whose buffers are gone go first, then the oldest.
        entries.retain(|e| !e.is(kind) && e.view.strong_count() > 0 && e.local.strong_count() > 0);
        if entries.len() == ENTRIES {
            entries.remove(0);
        }
        entries.push(Entry {
            view: Arc::downgrade(kind.view),
            remote: kind.remote,
            local: Arc::downgrade(kind.local),
            bytes: kind.bytes,
            hint: kind.hint.map(Box::from),
            transport,
            key: key.clone(),
            left: REUSES,
        });
    }

    /// Forgets every route (a transport failed toward this peer).
    pub(crate) fn clear(&self) {
        self.entries.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind<'a>(
        view: &'a Arc<u8>,
        remote: usize,
        local: &'a Arc<u16>,
        bytes: u64,
    ) -> Kind<'a, u8, u16> {
        Kind {
            view,
            remote,
            local,
            bytes,
            hint: None,
        }
    }

    #[test]
    fn a_route_is_reused_a_bounded_number_of_times_and_only_for_its_own_kind() {
        let memo: RouteMemo<u8, u16> = RouteMemo::default();
        let (view, local) = (Arc::new(0u8), Arc::new(0u16));
        let key: Arc<[u8]> = Arc::from(&b"k"[..]);
        assert_eq!(memo.get(&kind(&view, 0, &local, 4096)), None);
        memo.put(&kind(&view, 0, &local, 4096), 1, &key);
        for _ in 0..REUSES {
            assert_eq!(
                memo.get(&kind(&view, 0, &local, 4096)),
                Some((1, key.clone()))
            );
        }
        // Used up: selection runs again, and its answer starts a new count.
        assert_eq!(memo.get(&kind(&view, 0, &local, 4096)), None);
        memo.put(&kind(&view, 0, &local, 4096), 2, &key);
        assert_eq!(
            memo.get(&kind(&view, 0, &local, 4096)),
            Some((2, key.clone()))
        );
        // Another length, buffer, hint or view is another kind.
        assert_eq!(memo.get(&kind(&view, 0, &local, 8192)), None);
        assert_eq!(memo.get(&kind(&view, 1, &local, 4096)), None);
        assert_eq!(
            memo.get(&Kind {
                hint: Some("tcp"),
                ..kind(&view, 0, &local, 4096)
            }),
            None
        );
        assert_eq!(memo.get(&kind(&view, 0, &Arc::new(0u16), 4096)), None);
        assert_eq!(memo.get(&kind(&Arc::new(0u8), 0, &local, 4096)), None);
        memo.clear();
        assert_eq!(memo.get(&kind(&view, 0, &local, 4096)), None);
    }

    #[test]
    fn a_dropped_buffer_never_matches_and_the_memo_stays_small() {
        let memo: RouteMemo<u8, u16> = RouteMemo::default();
        let view = Arc::new(0u8);
        let key: Arc<[u8]> = Arc::from(&b"k"[..]);
        let gone = Arc::new(0u16);
        memo.put(&kind(&view, 0, &gone, 4096), 1, &key);
        let at = Arc::as_ptr(&gone);
        drop(gone);
        // A new buffer cannot take the old one's place while the entry
        // holds it, so it is never mistaken for it.
        let fresh = Arc::new(0u16);
        assert_ne!(Arc::as_ptr(&fresh), at);
        assert_eq!(memo.get(&kind(&view, 0, &fresh, 4096)), None);
        let locals: Vec<Arc<u16>> = (0..3 * ENTRIES as u16).map(Arc::new).collect();
        for l in &locals {
            memo.put(&kind(&view, 0, l, 4096), 1, &key);
        }
        assert_eq!(memo.entries.lock().len(), ENTRIES);
        let last = locals.last().unwrap();
        assert_eq!(memo.get(&kind(&view, 0, last, 4096)), Some((1, key)));
    }
}
