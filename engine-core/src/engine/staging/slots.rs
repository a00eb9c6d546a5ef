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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_holds_one_chunk_or_many_small_pieces() {
        let (unit, slot) = slot_geometry(4 << 20);
        assert_eq!((unit, slot), (256 << 10, 4 << 20));
        // Units are whole pages, so a slot may exceed the chunk a little.
        let (unit, slot) = slot_geometry(1_000_000);
        assert_eq!(unit % 4096, 0);
        assert!((1_000_000..1_000_000 + 16 * 4096).contains(&slot));

        let mut space = Space::new(2, 4096);
        let whole = space.take(16 * 4096).unwrap();
        assert_eq!(
            (whole.slot, whole.offset, whole.mask),
            (0, 0, u32::from(u16::MAX))
        );
        // Small pieces fill the second slot, first fit, a unit at least.
        let a = space.take(1).unwrap();
        let b = space.take(3 * 4096).unwrap();
        assert_eq!((a.slot, a.offset), (1, 0));
        assert_eq!((b.slot, b.offset, b.mask), (1, 4096, 0b1110));
        // 12 units are left in slot 1: 13 do not fit anywhere.
        assert!(space.take(13 * 4096).is_none());
        let c = space.take(12 * 4096).unwrap();
        assert_eq!((c.slot, c.offset), (1, 4 * 4096));
        assert!(space.take(1).is_none());
        // Given back, the room is taken again.
        space.give(b);
        let d = space.take(2 * 4096).unwrap();
        assert_eq!((d.slot, d.offset), (1, 4096));
        space.give(whole);
        assert_eq!(space.take(16 * 4096).unwrap().slot, 0);
    }

    #[test]
    fn a_pool_hands_out_room_and_takes_it_back_when_dropped() {
        let pool = Arc::new(SlotPool {
            bases: vec![0x10_0000, 0x20_0000],
            space: Mutex::new(Space::new(2, 4096)),
            available: Condvar::new(),
        });
        let first = pool.take(16 * 4096, false).unwrap();
        let second = pool.take(4096, false).unwrap();
        assert_eq!((first.addr, second.addr), (0x10_0000, 0x20_0000));
        let third = pool.take(4096, false).unwrap();
        assert_eq!(third.addr, 0x20_0000 + 4096);
        assert!(pool.take(16 * 4096, false).is_none());
        drop(first);
        assert_eq!(pool.take(16 * 4096, false).unwrap().addr, 0x10_0000);
    }

    #[test]
    fn a_waiting_taker_wakes_when_room_is_given_back() {
        let pool = Arc::new(SlotPool {
            bases: vec![0x10_0000],
            space: Mutex::new(Space::new(1, 4096)),
            available: Condvar::new(),
        });
        let held = pool.take(16 * 4096, false).unwrap();
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.take(4096, true).map(|s| s.addr))
        };
        drop(held);
        assert_eq!(waiter.join().unwrap(), Some(0x10_0000));
    }
}
