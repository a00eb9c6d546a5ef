//! A device's primary context, retained and made current for the length
//! of a call (the previous one put back), as every user of the driver here
//! works: in the context the CUDA runtime and PyTorch use.

use crate::driver::*;
use ferry_plugins_abi::sdk::PluginResult;

/// A retained primary context; released when the last holder drops it.
pub struct PrimaryContext {
    driver: &'static Driver,
    device: CUdevice,
    raw: CUcontext,
}

// SAFETY: a CUcontext is a process-wide handle; the driver API is thread
// safe and lets any thread make a context current, several at once.
unsafe impl Send for PrimaryContext {}
// SAFETY: shared access only passes the handle to the driver, which is
// thread safe; the handle is never mutated after retain.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(driver: &'static Driver, device: CUdevice) -> PluginResult<PrimaryContext> {
        let f = driver.function(
            driver.api.cu_device_primary_ctx_retain,
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut raw: CUcontext = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; device came from cuDeviceGet.
        driver.check("cuDevicePrimaryCtxRetain", unsafe { f(&mut raw, device) })?;
        Ok(PrimaryContext {
            driver,
            device,
            raw,
        })
    }

    /// Makes this context current on the calling thread until the guard
    /// drops, which restores the previous one.
    pub fn enter(&self) -> PluginResult<Current> {
        let d = self.driver;
        let get = d.function(d.api.cu_ctx_get_current, "cuCtxGetCurrent")?;
        let set = d.function(d.api.cu_ctx_set_current, "cuCtxSetCurrent")?;
        let mut previous: CUcontext = std::ptr::null_mut();
        // SAFETY: previous is a valid out-pointer.
        d.check("cuCtxGetCurrent", unsafe { get(&mut previous) })?;
        if previous == self.raw {
            return Ok(Current {
                driver: d,
                restore: None,
            });
        }
        // SAFETY: raw is a retained primary context, alive while self is.
        d.check("cuCtxSetCurrent", unsafe { set(self.raw) })?;
        Ok(Current {
            driver: d,
            restore: Some(previous),
        })
    }
}

impl PrimaryContext {
    /// The device this context belongs to.
    pub fn device(&self) -> CUdevice {
        self.device
    }

    /// The driver it came from.
    pub fn driver(&self) -> &'static Driver {
        self.driver
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        if let Some(f) = self.driver.api.cu_device_primary_ctx_release {
            // SAFETY: balances the retain in PrimaryContext::retain; nothing
            // of ours uses the context after this (streams and allocations
            // hold an Arc or were freed by the instance's Drop).
            let _ = unsafe { f(self.device) };
        }
    }
}

/// Restores the thread's previous context when dropped.
pub struct Current {
    driver: &'static Driver,
    restore: Option<CUcontext>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if let (Some(previous), Some(set)) = (self.restore, self.driver.api.cu_ctx_set_current) {
            // SAFETY: previous was current on this thread a moment ago (or
            // null, which unbinds); the application owns it.
            let _ = unsafe { set(previous) };
        }
    }
}
