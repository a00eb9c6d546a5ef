//! Lists of copies on one GPU: one launch of the copy kernel where it loads
//! and both ends are GPU memory, else the driver's batched copy where it
//! exists, else one cuMemcpyAsync per copy; one event behind the whole
//! list either way. `cuda_ipc.copy` (FERRY_CUDA_IPC_COPY) forces one.

use crate::gpu::{Event, Gpus};
use ferry_cuda_driver::batch;
use ferry_cuda_driver::kernel::{Desc, Kernel, LayoutCopy};
use ferry_cuda_driver::method::{CopySetting, Method};
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
                         launch each, and transfers by block layout read their index arrays \
                         on the GPU (cuda_ipc.copy={})",
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
    ///
    /// # Safety
    /// As [`Gpus::queue_copies`]: every copy's local range lies in a live
    /// local registration (check_local) and its remote range in an open
    /// import's mapping (View::local), whose View the caller holds until
    /// this returns (Import::close then syncs every stream before it can
    /// unmap).
    pub unsafe fn copy_list(
        &self,
        gpu: usize,
        copies: &[Desc],
        device_only: bool,
    ) -> PluginResult<Event> {
        let method = self.method(gpu, device_only, copies.len())?;
        // SAFETY: queue_copies asks exactly what this fn's `# Safety` section
        // makes the caller vouch for: every range checked against a live
        // registration or mapping that stays open until the event fires.
        unsafe { self.queue_copies(gpu, method, Copies::List(copies)) }
    }

    /// Queues blocks of two layouts by index on one of GPU `gpu`'s streams
    /// and one event behind them: one launch of the layout kernel where
    /// lists move by the kernel, else the same blocks as a list of copies
    /// (the batched or per-copy paths, as `cuda_ipc.copy` says).
    ///
    /// # Safety
    /// The caller checked every index against its layout (check_indices),
    /// the local layout's extent against a live local registration and the
    /// remote one against an open import's mapping (View::local), and holds
    /// that View until this returns.
    pub unsafe fn copy_layouts(
        &self,
        gpu: usize,
        l: &LayoutCopy<'_>,
        device_only: bool,
    ) -> PluginResult<Event> {
        let method = self.method(gpu, device_only, l.src_ids.len())?;
        if method == Method::Kernel {
            // SAFETY: the kernel computes each block from the layouts, and
            // every block lies inside an extent the caller checked (this fn's
            // `# Safety`), with the View held so Import::close syncs the
            // streams before it can unmap.
            return unsafe { self.queue_copies(gpu, method, Copies::Layouts(l)) };
        }
        let copies: Vec<Desc> = l
            .src_ids
            .iter()
            .zip(l.dst_ids)
            .map(|(&s, &d)| Desc {
                src: l.src_base + s * l.src_stride,
                dst: l.dst_base + d * l.dst_stride,
                len: l.block,
            })
            .collect();
        // SAFETY: `copies` are exactly the layouts' blocks, each inside an
        // extent the caller checked against the local registration or the
        // peer's mapping, indices included (this fn's `# Safety`), with the
        // mapping's View held until we return.
        unsafe { self.queue_copies(gpu, method, Copies::List(&copies)) }
    }

    /// How a list of `n` copies moves on GPU `gpu`, or why none of the
    /// forced ways can.
    fn method(&self, gpu: usize, device_only: bool, n: usize) -> PluginResult<Method> {
        let d = self.driver;
        Ok(match (self.copy, device_only, n) {
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
        })
    }

    /// Queues `copies` by `method` on the next stream of GPU `gpu` and an
    /// event behind them.
    ///
    /// # Safety
    /// Every copy's ranges are GPU memory (or host memory the GPU maps)
    /// checked against live registrations and mappings that stay open until
    /// the returned event fires; the kernel only where both ends are GPU
    /// memory.
    unsafe fn queue_copies(
        &self,
        gpu: usize,
        method: Method,
        copies: Copies<'_>,
    ) -> PluginResult<Event> {
        let d = self.driver;
        let stream = self.next_stream(gpu)?;
        let _current = self.context(gpu)?.enter()?;
        let event = self.event(gpu)?;
        // SAFETY: the stream is one of this GPU's, whose context `_current`
        // made current; every copy's ranges were checked by the callers
        // (submit.rs) against the live local registration and the peer's
        // mapping, which the returned event's InFlight keeps open until the
        // stream has run them. That is what all three calls require.
        let queued = unsafe {
            match (method, copies) {
                (Method::Kernel, c) => match (self.kernel(gpu), c) {
                    (Ok(k), Copies::List(list)) => k.launch(d, stream, list),
                    (Ok(k), Copies::Layouts(l)) => k.launch_layouts(d, stream, l),
                    (Err(why), _) => Err(PluginError::new(ErrorCode::Unavailable, why)),
                },
                (Method::Batch, Copies::List(list)) => batch::copy_batch(d, stream, list),
                (Method::PerCopy, Copies::List(list)) => batch::copy_each(d, stream, list),
                (_, Copies::Layouts(_)) => Err(PluginError::new(
                    ErrorCode::Internal,
                    "cuda-ipc: layouts reach only the kernel",
                )),
            }
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

/// What one queueing moves: a list of copies, or blocks of two layouts.
#[derive(Clone, Copy)]
enum Copies<'a> {
    List(&'a [Desc]),
    Layouts(&'a LayoutCopy<'a>),
}
