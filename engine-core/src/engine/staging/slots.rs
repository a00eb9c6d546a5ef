//! Slots: pinned host memory cut into units, so that chunks smaller than a
//! slot share it; this engine's pool of them.

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// Units per slot: a chunk smaller than a slot takes only the units it
/// needs, so many small requests are in flight in the space of one chunk.
pub(crate) const UNITS: u32 = 16;

/// Space in a set of equal slots, in units, first fit.
pub(crate) struct Space {
    pub(crate) unit: u64,
    pub(crate) used: Vec<u32>,
}

/// A range of one slot: its index, byte offset and unit mask.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) slot: usize,
    pub(crate) offset: u64,
    pub(crate) mask: u32,
}

impl Space {
    pub(crate) fn new(slots: usize, unit: u64) -> Space {
        Space {
            unit,
            used: vec![0; slots],
        }
    }

    pub(crate) fn take(&mut self, len: u64) -> Option<Piece> {
        let n = len.div_ceil(self.unit).clamp(1, UNITS as u64) as u32;
        let run = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
        for (slot, used) in self.used.iter_mut().enumerate() {
            for first in 0..=(UNITS - n) {
                let mask = run << first;
                if *used & mask == 0 {
                    *used |= mask;
                    return Some(Piece {
                        slot,
                        offset: first as u64 * self.unit,
                        mask,
                    });
                }
            }
        }
        None
    }

    pub(crate) fn give(&mut self, p: Piece) {
        if let Some(used) = self.used.get_mut(p.slot) {
            *used &= !p.mask;
        }
    }
}

/// The unit and slot length that hold chunks of `chunk` bytes.
pub(crate) fn slot_geometry(chunk: u64) -> (u64, u64) {
    let unit = chunk.div_ceil(UNITS as u64).next_multiple_of(4096);
    (unit, unit * UNITS as u64)
}

/// Pinned host slots of this engine, used as local sources and destinations.
pub(crate) struct SlotPool {
    pub(crate) bases: Vec<u64>,
    pub(crate) space: Mutex<Space>,
    pub(crate) available: Condvar,
}

impl SlotPool {
    /// Room for `len` bytes; waits for it only when `wait` (a job that
    /// holds none must not wait on jobs that hold some, or jobs could
    /// deadlock).
    pub(crate) fn take(self: &Arc<Self>, len: u64, wait: bool) -> Option<LocalSlot> {
        let mut space = self.space.lock();
        loop {
            if let Some(piece) = space.take(len) {
                return Some(LocalSlot {
                    pool: self.clone(),
                    addr: self.bases[piece.slot] + piece.offset,
                    piece,
                });
            }
            if !wait {
                return None;
            }
            self.available.wait(&mut space);
        }
    }
}

pub(crate) struct LocalSlot {
    pub(crate) pool: Arc<SlotPool>,
    pub(crate) piece: Piece,
    pub(crate) addr: u64,
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        self.pool.space.lock().give(self.piece);
        self.pool.available.notify_all();
    }
}
