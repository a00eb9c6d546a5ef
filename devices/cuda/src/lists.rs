//! Lists of copies on one stream (ABI 1.5 `copy_list_async`): how staging
//! gathers many small blocks of device memory into one pinned slot and
//! scatters them out of one. One launch of the copy kernel when every end
//! is memory the kernel reaches (device memory of the stream's GPU, pinned
//! host memory mapped at its own address), else the driver's batched copy,
//! else one cuMemcpyAsync per copy; lists of large pieces (512 KiB on
//! average) go to the copy engines. A kernel list whose one side is pinned
//! host memory crosses PCIe by the copy engines through device scratch
//! (bounce.rs). `cuda.copy` (FERRY_CUDA_COPY) forces one method; forced,
//! the kernel never bounces.

use crate::bounce::{self, Bounce, HostEnds};
use crate::instance::{CudaInstance, CudaStream};
use ferry_cuda_driver::batch;
use ferry_cuda_driver::kernel::{Desc, Kernel};
pub use ferry_cuda_driver::method::{CopySetting, Method};
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::sys::ferry_device_copy_t;
use ferry_plugins_abi::ErrorCode;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;

/// How staging's lists will move with this driver and setting, for
/// `ferry info` (probe loads nothing: the kernel's loading is tried at
/// first use, and a failure is logged then).
pub(crate) fn describe(driver: &ferry_cuda_driver::driver::Driver, copy: CopySetting) -> String {
    let api = &driver.api;
    let kernel = api.cu_module_load_data.is_some()
        && api.cu_launch_kernel.is_some()
        && api.cu_memcpy_htod_async.is_some();
    let engines = if api.cu_memcpy_batch_async.is_some() {
        "cuMemcpyBatchAsync"
    } else {
        "one cuMemcpyAsync per copy (no cuMemcpyBatchAsync, CUDA < 12.8)"
    };
    match copy {
        CopySetting::Force(Method::Kernel) => {
            "the copy kernel, one launch per list (cuda.copy=kernel)".into()
        }
        CopySetting::Force(Method::Batch) => format!("{engines} (cuda.copy=batch)"),
        CopySetting::Force(Method::PerCopy) => {
            "one cuMemcpyAsync per copy (cuda.copy=per-copy)".into()
        }
        CopySetting::Auto if kernel => format!(
            "the copy kernel, one launch per list of small pieces (its PTX is loaded at first \
             use), across PCIe in one copy through device scratch where one side is pinned host \
             memory; lists of 512 KiB+ pieces, and any the kernel cannot reach, by {engines}"
        ),
        CopySetting::Auto => format!("{engines} (this driver cannot launch the copy kernel)"),
    }
}

/// Pieces from this size up, on average, go to the copy engines in auto
/// mode: a copy call costs a few microseconds, which a 512 KiB piece
/// amortises (the kernel is for lists of many small ones).
const LARGE_PIECE: u64 = 512 << 10;

fn large_pieces(descs: &[Desc]) -> bool {
    let total: u64 = descs.iter().map(|c| c.len).fold(0, u64::saturating_add);
    total / descs.len().max(1) as u64 >= LARGE_PIECE
}

/// The copies as the kernel and the driver take them: each non-empty and
/// not wrapping, or the list is refused before anything is queued. Checked
/// first, then copied in one pass: collecting `Result`s element by element
/// cost 15-30 ns a copy, a quarter of a 512-block list's queuing.
fn descriptors(copies: &[ferry_device_copy_t]) -> PluginResult<Vec<Desc>> {
    let fits = |c: &ferry_device_copy_t| {
        c.len > 0
            && c.src.checked_add(c.len).is_some()
            && c.dst.checked_add(c.len).is_some()
            && usize::try_from(c.len).is_ok()
    };
    if let Some(i) = copies.iter().position(|c| !fits(c)) {
        let c = &copies[i];
        return Err(PluginError::new(
            ErrorCode::InvalidArgument,
            format!(
                "copy_list_async: copy {i} ({} bytes {:#x} -> {:#x}) is empty or wraps",
                c.len, c.src, c.dst
            ),
        ));
    }
    Ok(copies
        .iter()
        .map(|c| Desc {
            src: c.src,
            dst: c.dst,
            len: c.len,
        })
        .collect())
}

impl CudaInstance {
    /// Queues `copies` on `stream` as one device operation where it can.
    pub(crate) fn copy_list(
        &self,
        stream: &CudaStream,
        copies: &[ferry_device_copy_t],
    ) -> PluginResult<()> {
        let descs = descriptors(copies)?;
        if descs.is_empty() {
            return Ok(());
        }
        // Which host memory the kernel reaches: read once per list.
        let host = Ranges::new(self.mapped_host());
        let (method, ends) = self.list_method(stream.ordinal, &descs, &host)?;
        let d = self.driver;
        let _current = stream.ctx.enter()?;
        // SAFETY: the stream is alive (borrowed), not the legacy default
        // stream, and its context is current. Every end was checked: for
        // the kernel, by kernel_reaches against the driver's own answer
        // (device memory of this stream's GPU) and this instance's mapped
        // pinned memory; for the driver's copies the driver validates each
        // range itself and fails the call rather than touching memory it
        // does not know. The engine keeps the ranges alive until
        // stream_sync (the ABI's contract).
        let queued = unsafe {
            match method {
                Method::Kernel => match self.kernel(stream.ordinal) {
                    Ok(k) => match self.bounce_plan(&descs, ends, &host) {
                        Some(b) => self.bounced(k, stream, &descs, &b),
                        None => k.launch(d, stream.raw, &descs),
                    },
                    Err(why) => Err(PluginError::new(ErrorCode::Unavailable, why)),
                },
                Method::Batch => batch::copy_batch(d, stream.raw, &descs),
                Method::PerCopy => batch::copy_each(d, stream.raw, &descs),
            }
        };
        queued.map_err(|mut e| {
            e.message.push_str(&format!(
                " ({} copies by {} on a cuda:{} stream)",
                descs.len(),
                method.name(),
                stream.ordinal
            ));
            e
        })
    }

    /// Whether a kernel list crosses PCIe through scratch (bounce.rs): in
    /// auto mode only (cuda.copy=kernel keeps the kernel's own loads and
    /// stores, to compare).
    fn bounce_plan(&self, descs: &[Desc], ends: Option<HostEnds>, host: &Ranges) -> Option<Bounce> {
        if self.copy != CopySetting::Auto {
            return None;
        }
        bounce::plan(descs, ends?, |addr, len| host.contains(addr, addr + len))
    }

    /// Queues a bounced list: the host span into scratch and the kernel
    /// from there, or the kernel into scratch and the runs out of it.
    ///
    /// # Safety
    /// As `copy_list`'s queued block: the stream's context is current and
    /// every end was checked.
    unsafe fn bounced(
        &self,
        k: &Kernel,
        stream: &CudaStream,
        descs: &[Desc],
        b: &Bounce,
    ) -> PluginResult<()> {
        let d = self.driver;
        let mut scratch = stream
            .scratch
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the stream's context is current (caller); the scratch is
        // this stream's, held locked until every step is queued.
        let base = unsafe { scratch.reserve(d, stream.raw, b.span()) }?;
        let list = b.rebase(descs, base);
        // SAFETY: the scratch holds span bytes from base; the host span or
        // runs lie in one mapped pinned allocation each (bounce::plan), the
        // device ends were checked by kernel_reaches; all on this stream,
        // in order, so the kernel reads what the copy in brought and the
        // copies out read what the kernel wrote.
        unsafe {
            match b {
                Bounce::In { start, len } => {
                    batch::copy_each(
                        d,
                        stream.raw,
                        &[Desc {
                            src: *start,
                            dst: base,
                            len: *len,
                        }],
                    )?;
                    k.launch(d, stream.raw, &list)
                }
                Bounce::Out { start, runs, .. } => {
                    k.launch(d, stream.raw, &list)?;
                    let out: Vec<Desc> = runs
                        .iter()
                        .map(|&(addr, len)| Desc {
                            src: base + (addr - start),
                            dst: addr,
                            len,
                        })
                        .collect();
                    batch::copy_each(d, stream.raw, &out)
                }
            }
        }
    }

    fn has_batch(&self) -> bool {
        self.driver.api.cu_memcpy_batch_async.is_some()
    }

    /// How this list moves on GPU `ordinal`, and for the kernel, which of
    /// its ends are pinned host memory.
    fn list_method(
        &self,
        ordinal: u32,
        descs: &[Desc],
        host: &Ranges,
    ) -> PluginResult<(Method, Option<HostEnds>)> {
        let engines = if self.has_batch() {
            Method::Batch
        } else {
            Method::PerCopy
        };
        Ok(match self.copy {
            CopySetting::Force(Method::PerCopy) => (Method::PerCopy, None),
            CopySetting::Force(Method::Batch) if self.has_batch() => (Method::Batch, None),
            CopySetting::Force(Method::Batch) => {
                return Err(PluginError::new(
                    ErrorCode::Unsupported,
                    format!(
                        "cuda.copy=batch, but {} has no cuMemcpyBatchAsync (CUDA 12.8+)",
                        self.driver.library
                    ),
                ))
            }
            CopySetting::Force(Method::Kernel) => {
                self.kernel(ordinal).map_err(|why| {
                    PluginError::new(
                        ErrorCode::Unavailable,
                        format!("cuda.copy=kernel, but the copy kernel cannot load: {why}"),
                    )
                })?;
                let Some(ends) = self.kernel_reaches(ordinal, descs, host) else {
                    return Err(PluginError::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "cuda.copy=kernel, but a list reaches memory the copy kernel cannot \
                             on cuda:{ordinal} (neither its device memory nor mapped pinned host \
                             memory)"
                        ),
                    ));
                };
                (Method::Kernel, Some(ends))
            }
            CopySetting::Auto if descs.len() == 1 => (Method::PerCopy, None),
            // Large pieces: the copy engines move them at full speed in a
            // few calls, leaving the SMs to the application.
            CopySetting::Auto if large_pieces(descs) => (engines, None),
            CopySetting::Auto => {
                if self.kernel(ordinal).is_ok() {
                    if let Some(ends) = self.kernel_reaches(ordinal, descs, host) {
                        return Ok((Method::Kernel, Some(ends)));
                    }
                    if !self.said_list_fallback.swap(true, Ordering::Relaxed) {
                        self.host.info(&format!(
                            "cuda:{ordinal}: a list of copies reaches memory the copy kernel \
                             cannot (not this GPU's, or host memory not mapped for it); such \
                             lists move by {}",
                            match engines {
                                Method::Batch => "cuMemcpyBatchAsync",
                                _ => "one cuMemcpyAsync per copy",
                            }
                        ));
                    }
                }
                (engines, None)
            }
        })
    }

    /// The copy kernel in GPU `ordinal`'s context, loaded on first use (the
    /// reason it cannot be is kept and logged once).
    fn kernel(&self, ordinal: u32) -> Result<&Kernel, String> {
        let device = self
            .devices
            .get(ordinal as usize)
            .ok_or_else(|| format!("no CUDA device {ordinal}"))?;
        let loaded = device.kernel.get_or_init(|| {
            let loaded = self
                .context(ordinal)
                .and_then(|c| c.enter())
                .and_then(|_current| Kernel::load(self.driver))
                .map_err(|e| e.message);
            match &loaded {
                Ok(_) => self.host.info(&format!(
                    "cuda:{ordinal}: staging gathers and scatters small blocks by the copy \
                     kernel, one launch per list{} (cuda.copy={})",
                    if self.copy == CopySetting::Auto {
                        ", and crosses PCIe by the copy engines through device scratch"
                    } else {
                        ""
                    },
                    self.copy.name()
                )),
                Err(why) => self.host.info(&format!(
                    "cuda:{ordinal}: the copy kernel cannot load ({why}); staging's lists of \
                     copies move by {}",
                    if self.has_batch() {
                        "cuMemcpyBatchAsync"
                    } else {
                        "one cuMemcpyAsync per copy"
                    }
                )),
            }
            loaded
        });
        loaded.as_ref().map_err(Clone::clone)
    }

    /// Whether every end of every copy is memory the kernel reaches on GPU
    /// `ordinal`: device memory of that GPU (the driver says so, and the
    /// whole range lies in one allocation) or pinned host memory of this
    /// instance mapped at its own address; if so, how many ends of each
    /// side are host memory (bounce.rs plans with them, so it never asks
    /// the host ranges about device addresses, which miss every range). A
    /// KV pool is one allocation, so the driver is asked about a list's
    /// first block and rarely again.
    fn kernel_reaches(&self, ordinal: u32, descs: &[Desc], host: &Ranges) -> Option<HostEnds> {
        let mut device = Ranges::new(Vec::new());
        let mut ends = HostEnds::default();
        let mut reaches = |addr: u64, len: u64| -> Option<bool> {
            let end = addr + len; // no wrap: checked by descriptors()
            if device.contains(addr, end) {
                return Some(false);
            }
            if host.contains(addr, end) {
                return Some(true);
            }
            device.push(self.device_range(ordinal, addr, len)?);
            Some(false)
        };
        for c in descs {
            ends.src += usize::from(reaches(c.src, c.len)?);
            ends.dst += usize::from(reaches(c.dst, c.len)?);
        }
        Some(ends)
    }
}

impl CudaInstance {
    /// This instance's pinned host memory mapped for the devices, as
    /// [start, end) ranges.
    fn mapped_host(&self) -> Vec<(u64, u64)> {
        let mut host: Vec<(u64, u64)> = Vec::new();
        for table in [&self.pinned_memory, &self.registered_memory] {
            let table = table.lock().unwrap_or_else(PoisonError::into_inner);
            host.extend(
                table
                    .iter()
                    .filter(|(_, a)| a.mapped)
                    .filter_map(|(&base, a)| Some((base, base.checked_add(a.len)?))),
            );
        }
        host
    }
}

/// [start, end) ranges, looked up with the last one found first: a list's
/// ends lie mostly in one or two allocations (a KV pool, a slot), and a
/// scan of every pinned range for each of 1,024 ends cost tens of
/// microseconds a list.
struct Ranges {
    list: Vec<(u64, u64)>,
    last: std::cell::Cell<usize>,
}

impl Ranges {
    fn new(list: Vec<(u64, u64)>) -> Ranges {
        Ranges {
            list,
            last: std::cell::Cell::new(0),
        }
    }

    fn push(&mut self, range: (u64, u64)) {
        self.list.push(range);
    }

    /// Whether [addr, end) lies inside one of the ranges.
    fn contains(&self, addr: u64, end: u64) -> bool {
        let holds = |&(s, e): &(u64, u64)| s <= addr && end <= e;
        if self.list.get(self.last.get()).is_some_and(holds) {
            return true;
        }
        match self.list.iter().rposition(holds) {
            Some(i) => {
                self.last.set(i);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_find_the_one_holding_a_span_whichever_was_last() {
        let r = Ranges::new(vec![(0x1000, 0x2000), (0x8000, 0x9000)]);
        assert!(r.contains(0x8000, 0x9000));
        assert!(
            r.contains(0x1000, 0x1800),
            "the last hit is tried first, then the rest"
        );
        assert!(r.contains(0x8800, 0x8900));
        assert!(
            !r.contains(0x1800, 0x8100),
            "a span across two ranges is in neither"
        );
        assert!(!r.contains(0x2000, 0x2001));
        assert!(!Ranges::new(Vec::new()).contains(0, 1));
    }

    #[test]
    fn the_setting_takes_four_words() {
        let parse = |v| CopySetting::parse(crate::instance::COPY_KEY, v);
        assert_eq!(parse(None).unwrap(), CopySetting::Auto);
        assert_eq!(
            parse(Some(" per-copy ")).unwrap(),
            CopySetting::Force(Method::PerCopy)
        );
        let e = parse(Some("dma")).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(e
            .message
            .contains("cuda.copy=\"dma\": expected auto, kernel, batch or per-copy"));
    }

    #[test]
    fn large_pieces_are_half_a_mebibyte_on_average() {
        let d = |len| Desc {
            src: 0,
            dst: 0,
            len,
        };
        assert!(large_pieces(&[d(1 << 20), d(1 << 20)]));
        assert!(large_pieces(&[d(1 << 20), d(0)]));
        assert!(!large_pieces(&[d(1 << 20), d(16 << 10), d(16 << 10)]));
        assert!(!large_pieces(&[d(16 << 10); 256]));
        assert!(!large_pieces(&[]));
    }

    #[test]
    fn empty_or_wrapping_copies_refuse_the_whole_list() {
        let c = |src, dst, len| ferry_device_copy_t { src, dst, len };
        assert_eq!(descriptors(&[c(0x1000, 0x2000, 16)]).unwrap().len(), 1);
        for bad in [
            c(0x1000, 0x2000, 0),
            c(u64::MAX, 0x2000, 2),
            c(0x1000, u64::MAX - 1, 4),
        ] {
            let e = descriptors(&[c(0x1000, 0x2000, 16), bad]).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidArgument);
            assert!(e.message.contains("copy 1"), "{}", e.message);
        }
    }
}
