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

    /// Pins the registered region containing all of `[addr, addr + len)`,
    /// or says why not (a `FERRY_ERR_*` code).
    pub fn pin(&self, addr: u64, len: u64) -> Result<Pin, i32> {
        let end = addr.checked_add(len).ok_or(sys::FERRY_ERR_OUT_OF_BOUNDS)?;
        let map = self.by_addr.read().unwrap_or_else(|e| e.into_inner());
        let (_, region) = map
            .range(..=addr)
            .next_back()
            .ok_or(sys::FERRY_ERR_OUT_OF_BOUNDS)?;
        if end > region.addr + region.len {
            return Err(sys::FERRY_ERR_OUT_OF_BOUNDS);
        }
        region.pins.fetch_add(1, Ordering::SeqCst);
        let pin = Pin(region.clone());
        // An unregister that raced us wins: give the pin back.
        if region.closed.load(Ordering::SeqCst) {
            return Err(sys::FERRY_ERR_OUT_OF_BOUNDS);
        }
        Ok(pin)
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
        assert!(r.pin(0x1000, 0x1000).is_ok());
        assert!(r.pin(0x1fff, 2).is_err(), "straddles two regions");
        assert!(r.pin(0xfff, 1).is_err());
        assert!(r.pin(u64::MAX, 1).is_err());
        let pin = r.pin(0x1000, 1).unwrap();
        // Unregister waits for the pin; with a tiny wait it reports it.
        assert!(r.unregister(h, Duration::from_millis(5)).is_err());
        drop(pin);
        assert!(r.pin(0x1000, 1).is_err(), "hidden once unregistering began");
    }
}
