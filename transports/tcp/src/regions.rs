//! Memory this instance registered, as the target sees it: every request
//! from the network is checked here before a byte of it is touched.
//!
//! A request pins the region it touches for as long as the socket reads
//! into it or writes from it; unregistering first hides the region from new
//! requests, then waits for the pins to go.

use ferry_plugins_abi::sys;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub struct Region {
    pub addr: u64,
    pub len: u64,
    pins: AtomicUsize,
    closed: AtomicBool,
}

/// Keeps a region registered while I/O touches it.
pub struct Pin(Arc<Region>);

impl Drop for Pin {
    fn drop(&mut self) {
        self.0.pins.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
pub struct Regions {
    by_addr: RwLock<BTreeMap<u64, Arc<Region>>>,
    by_handle: RwLock<HashMap<u64, u64>>,
    next_handle: AtomicUsize,
}

impl Regions {
    pub fn register(&self, addr: u64, len: u64) -> Result<u64, String> {
        let end = addr
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or_else(|| "empty or wrapping range".to_string())?;
        let mut map = self.by_addr.write().unwrap_or_else(|e| e.into_inner());
        if let Some((_, r)) = map.range(..end).next_back() {
            if r.addr + r.len > addr {
                return Err(format!(
                    "[{addr:#x}, {end:#x}) overlaps a registered region"
                ));
            }
        }
        map.insert(
            addr,
            Arc::new(Region {
                addr,
                len,
                pins: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
            }),
        );
        let handle = self.next_handle.fetch_add(1, Ordering::SeqCst) as u64 + 1;
        self.by_handle
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle, addr);
        Ok(handle)
    }

    /// Hides the region, then waits (up to `wait`) for requests touching it.
    pub fn unregister(&self, handle: u64, wait: Duration) -> Result<(), String> {
        let addr = self
            .by_handle
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&handle)
            .ok_or_else(|| format!("no region with handle {handle}"))?;
        let region = self
            .by_addr
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&addr)
            .ok_or_else(|| format!("no region at {addr:#x}"))?;
        region.closed.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + wait;
        while region.pins.load(Ordering::SeqCst) != 0 {
            if Instant::now() > deadline {
                return Err(format!(
                    "requests from peers still touch [{addr:#x}, +{}) after {} ms",
                    region.len,
                    wait.as_millis()
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// Pins, under one look at the map, every registered region that holds
    /// one of `ranges` whole: the pins (one per region, however many
    /// ranges lie in it) and each range's status, `FERRY_OK` or why not.
    /// A frame of 4 KiB blocks touches one region thousands of times; a pin
    /// each would cost every I/O thread six atomic operations a block on
    /// cache lines they all share.
    pub fn pin_all(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> (Vec<Pin>, Vec<i32>) {
        let map = self.by_addr.read().unwrap_or_else(|e| e.into_inner());
        let mut pins: Vec<Pin> = Vec::new();
        // The region the last range fell in, and whether it was pinned.
        let mut last: Option<(&Arc<Region>, bool)> = None;
        let statuses = ranges
            .into_iter()
            .map(|(addr, len)| {
                let Some(end) = addr.checked_add(len) else {
                    return sys::FERRY_ERR_OUT_OF_BOUNDS;
                };
                let holds = |r: &Region| r.addr <= addr && end <= r.addr + r.len;
                let found = match last {
                    Some((r, ok)) if holds(r) => (r, ok),
                    _ => {
                        let Some((_, r)) = map.range(..=addr).next_back() else {
                            return sys::FERRY_ERR_OUT_OF_BOUNDS;
                        };
                        if !holds(r) {
                            return sys::FERRY_ERR_OUT_OF_BOUNDS;
                        }
                        let ok = match pins.iter().find(|p| Arc::ptr_eq(&p.0, r)) {
                            Some(_) => true,
                            None => {
                                r.pins.fetch_add(1, Ordering::SeqCst);
                                let pin = Pin(r.clone());
                                // An unregister that raced us wins.
                                let open = !r.closed.load(Ordering::SeqCst);
                                if open {
                                    pins.push(pin);
                                }
                                open
                            }
                        };
                        (r, ok)
                    }
                };
                last = Some(found);
                match found.1 {
                    true => sys::FERRY_OK,
                    false => sys::FERRY_ERR_OUT_OF_BOUNDS,
                }
            })
            .collect();
        (pins, statuses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ranges_inside_one_region_are_pinned() {
        let r = Regions::default();
        let h = r.register(0x1000, 0x1000).unwrap();
        r.register(0x2000, 0x1000).unwrap();
        assert!(r.register(0x1800, 0x10).is_err());
        let one = |addr, len| r.pin_all([(addr, len)]).1[0] == sys::FERRY_OK;
        assert!(one(0x1000, 0x1000));
        assert!(!one(0x1fff, 2), "straddles two regions");
        assert!(!one(0xfff, 1));
        assert!(!one(u64::MAX, 1));
        let pin = r.pin_all([(0x1000, 1)]).0;
        // Unregister waits for the pin; with a tiny wait it reports it.
        assert!(r.unregister(h, Duration::from_millis(5)).is_err());
        drop(pin);
        assert!(!one(0x1000, 1), "hidden once unregistering began");
    }

    #[test]
    fn a_frame_pins_each_region_once_and_refuses_what_lies_outside() {
        let r = Regions::default();
        let a = r.register(0x1000, 0x1000).unwrap();
        r.register(0x3000, 0x1000).unwrap();
        let ranges = [
            (0x1000, 0x100),
            (0x1f00, 0x100),
            (0x3000, 0x10),
            (0x1fff, 2),       // straddles the end of the first region
            (0x2000, 0x10),    // between regions
            (0x1800, 0x10),    // back in the first
            (u64::MAX - 1, 4), // wraps
            (0x3ff0, 0x10),
        ];
        let (pins, statuses) = r.pin_all(ranges);
        let (ok, out) = (sys::FERRY_OK, sys::FERRY_ERR_OUT_OF_BOUNDS);
        assert_eq!(statuses, [ok, ok, ok, out, out, ok, out, ok]);
        assert_eq!(pins.len(), 2, "one pin per region");
        // The pins hold the first region registered until they go.
        assert!(r.unregister(a, Duration::from_millis(5)).is_err());
        drop(pins);
        let (pins, statuses) = r.pin_all([(0x1000, 1), (0x3000, 1)]);
        assert_eq!(statuses, [out, ok], "hidden once unregistering began");
        assert_eq!(pins.len(), 1);
    }
}
