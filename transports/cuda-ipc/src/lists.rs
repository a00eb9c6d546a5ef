//! Lists of copies on one GPU: one launch of the copy kernel where it loads
//! and both ends are GPU memory, else the driver's batched copy where it
//! exists, else one cuMemcpyAsync per copy; one event behind the whole
//! list either way. `cuda_ipc.copy` (FERRY_CUDA_IPC_COPY) forces one.

use crate::batch;
use crate::gpu::{Event, Gpus};
use crate::kernel::{Desc, Kernel};
use crate::method::{CopySetting, Method};
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;

impl Gpus {
    /// Whether the driver has the batched copy.
    pub fn has_batch(&self) -> bool {
        self.driver.api.cu_memcpy_batch_async.is_some()
    }

    /// What lists move by on GPU `gpu` when both ends are GPU memory, with
    /// the reason; loads the kernel there (once) unless a setting rules it
    /// out. For `ferry info`, the first use's log line and describe_peer.
    pub fn list_method(&self, gpu: usize) -> (Method, String) {
        let fallback = |why: &str| {
            if self.has_batch() {
                (Method::Batch, format!("cuMemcpyBatchAsync ({why})"))
            } else {
                (
                    Method::PerCopy,
                    format!(
                        "one cuMemcpyAsync per copy ({why}; no cuMemcpyBatchAsync, CUDA < 12.8)"
                    ),
                )
            }
        };
        match self.copy {
            CopySetting::Force(Method::PerCopy) => (
                Method::PerCopy,
                "one cuMemcpyAsync per copy (cuda_ipc.copy=per-copy)".into(),
            ),
            CopySetting::Force(Method::Batch) if self.has_batch() => (
                Method::Batch,
                "cuMemcpyBatchAsync (cuda_ipc.copy=batch)".into(),
            ),
            CopySetting::Force(Method::Batch) => fallback("cuda_ipc.copy=batch"),
            CopySetting::Auto | CopySetting::Force(Method::Kernel) => match self.kernel(gpu) {
                Ok(_) => (
                    Method::Kernel,
                    "the copy kernel, one launch per list (ferry_copy_list PTX)".into(),
                ),
                Err(why) => fallback(&format!("the copy kernel cannot load: {why}")),
            },
        }
    }

    /// The kernel in GPU `gpu`'s context, loaded on first use (the reason
    /// it cannot be is kept and logged once).
    fn kernel(&self, gpu: usize) -> Result<&Kernel, String> {
        let g = &self.list[gpu];
        let loaded = g.kernel.get_or_init(|| {
            let loaded = self
                .context(gpu)
                .and_then(|c| c.enter())
                .and_then(|_current| Kernel::load(self.driver))
                .map_err(|e| e.message);
            if let Some(host) = &self.log {
                match &loaded {
                    Ok(_) => host.info(&format!(
                        "cuda-ipc: cuda:{}: lists of GPU copies move by the copy kernel, one \
                         launch each (cuda_ipc.copy={})",
                        g.ordinal,
                        self.copy.name()
                    )),
                    Err(why) => host.warn(&format!(
                        "cuda-ipc: cuda:{}: the copy kernel cannot load ({why}); lists move by {}",
                        g.ordinal,
                        if self.has_batch() {
                            "cuMemcpyBatchAsync"
                        } else {
                            "one cuMemcpyAsync per copy"
                        }
                    )),
                }
            }
            loaded
        });
        loaded.as_ref().map_err(Clone::clone)
    }

    /// Queues `copies` on one of GPU `gpu`'s streams and one event behind
    /// them all. `device_only`: both ends of every copy are GPU memory
    /// (the kernel reaches nothing else).
    pub fn copy_list(&self, gpu: usize, copies: &[Desc], device_only: bool) -> PluginResult<Event> {
        let d = self.driver;
        let stream = self.next_stream(gpu)?;
        let method = match (self.copy, device_only, copies.len()) {
            (CopySetting::Force(Method::Kernel), true, _) => {
                self.kernel(gpu).map_err(|why| {
                    PluginError::new(
                        ErrorCode::Unavailable,
                        format!(
                            "cuda-ipc: cuda_ipc.copy=kernel, but the kernel cannot load: {why}"
                        ),
                    )
                })?;
                Method::Kernel
            }
            (CopySetting::Force(Method::Batch), _, _) if self.has_batch() => Method::Batch,
            (CopySetting::Force(Method::Batch), _, _) => {
                return Err(PluginError::new(
                    ErrorCode::Unsupported,
                    format!(
                        "cuda-ipc: cuda_ipc.copy=batch, but {} has no cuMemcpyBatchAsync (CUDA \
                         12.8+)",
                        d.library
                    ),
                ))
            }
            (CopySetting::Force(Method::PerCopy), _, _) | (_, _, 1) => Method::PerCopy,
            (_, true, _) if self.kernel(gpu).is_ok() => Method::Kernel,
            _ if self.has_batch() => Method::Batch,
            _ => Method::PerCopy,
        };
        let _current = self.context(gpu)?.enter()?;
        let event = self.event(gpu)?;
        let queued = match method {
            Method::Kernel => match self.kernel(gpu) {
                Ok(k) => k.launch(d, stream, copies),
                Err(why) => Err(PluginError::new(ErrorCode::Unavailable, why)),
            },
            Method::Batch => batch::copy_batch(d, stream, copies),
            Method::PerCopy => batch::copy_each(d, stream, copies),
        };
        if let Err(e) = queued.and_then(|()| self.record(gpu, event, stream)) {
            // What was queued may still run: wait for it before the event
            // goes back (and before the caller fails the requests).
            let _ = self.sync_streams(gpu);
            self.recycle(event);
            return Err(e);
        }
        Ok(event)
    }
}
