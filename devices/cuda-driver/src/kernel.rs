//! The scattered-copy kernel: `copy.ptx` (from kernels/copy.cu) loaded
//! into a GPU's context on first use, and the ring of descriptors it reads.
//!
//! A list goes to the GPU as descriptors written into a pinned host ring
//! (cuMemHostAlloc) and uploaded with cuMemcpyHtoDAsync on the stream that
//! then launches the kernel, so one list is one upload and one launch
//! whatever its length. The ring and its device twin are allocated once per
//! GPU; a slot is reused only after the event recorded behind its launch
//! fired, so nothing is allocated per launch.
//!
//! Blocks of two layouts by index (`launch_layouts`) skip the descriptors:
//! the ring carries the two index arrays as they came, and the kernel's
//! second entry computes every block's addresses and pieces.

use crate::driver::*;
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::collections::VecDeque;
use std::ffi::{c_void, CStr};
use std::sync::{Mutex, PoisonError};

/// The PTX, NUL-terminated as cuModuleLoadData wants it.
const PTX: &str = concat!(include_str!("copy.ptx"), "\0");
/// Its entry point (the emulator recognises the module by this name).
const ENTRY: &CStr = c"ferry_copy_list";
/// The entry point that moves blocks of two layouts by index.
const LAYOUTS_ENTRY: &CStr = c"ferry_copy_layouts";
/// Entries longer than this are split on the host: one warp moves one
/// piece, so a list of a few large blocks still keeps every SM busy.
pub const PIECE: u64 = 32 << 10;
/// Descriptors in the ring (24 bytes each: 3 MiB pinned, 3 MiB on the GPU).
const RING: usize = 1 << 17;
/// Threads per block (the kernel's __launch_bounds__), eight warps.
const THREADS: u32 = 256;
const WARPS: usize = THREADS as usize / 32;

/// One copy as the kernel reads it (`struct ferry_copy` in copy.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Desc {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// The kernel loaded in one GPU's context.
pub struct Kernel {
    module: CUmodule,
    function: CUfunction,
    layouts: CUfunction,
    ring: Mutex<Ring>,
}

/// Blocks of two layouts by index, as [`Kernel::launch_layouts`] moves
/// them: block `i` is `block` bytes from `src_base + src_ids[i] *
/// src_stride` to `dst_base + dst_ids[i] * dst_stride`.
#[derive(Clone, Copy, Debug)]
pub struct LayoutCopy<'a> {
    pub src_base: u64,
    pub src_stride: u64,
    pub dst_base: u64,
    pub dst_stride: u64,
    pub block: u64,
    pub src_ids: &'a [u64],
    pub dst_ids: &'a [u64],
}

/// Most blocks one layout launch takes: both index arrays fill the ring.
const RING_IDS: usize = RING * std::mem::size_of::<Desc>() / 16;

struct Ring {
    host: *mut Desc,
    dev: CUdeviceptr,
    /// Slots [start, end) of launches not known to be done, oldest first,
    /// with the event recorded behind each.
    used: VecDeque<(usize, usize, CUevent)>,
    spare: Vec<CUevent>,
}

// SAFETY: the handles are process-wide driver objects of one context,
// used only with that context current; the ring's memory is touched only
// under its mutex.
unsafe impl Send for Kernel {}
// SAFETY: shared references use the handles only with their context
// current and touch the ring's memory only under its mutex.
unsafe impl Sync for Kernel {}

/// How many descriptors `copies` become once long ones are split.
pub fn pieces(copies: &[Desc]) -> usize {
    copies.iter().map(|c| c.len.div_ceil(PIECE) as usize).sum()
}

impl Kernel {
    /// Loads the PTX and allocates the ring, in GPU context that the caller
    /// made current; the error says why the kernel cannot serve here.
    pub fn load(d: &Driver) -> PluginResult<Kernel> {
        let load = d.function(d.api.cu_module_load_data, "cuModuleLoadData")?;
        let get = d.function(d.api.cu_module_get_function, "cuModuleGetFunction")?;
        d.function(d.api.cu_launch_kernel, "cuLaunchKernel")?;
        d.function(d.api.cu_memcpy_htod_async, "cuMemcpyHtoDAsync_v2")?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: PTX is NUL-terminated text; module is a valid out-pointer.
        d.check("cuModuleLoadData", unsafe {
            load(&mut module, PTX.as_ptr().cast())
        })?;
        let mut function: CUfunction = std::ptr::null_mut();
        // SAFETY: module was loaded above; ENTRY is NUL-terminated.
        let r = unsafe { get(&mut function, module, ENTRY.as_ptr()) };
        let mut layouts: CUfunction = std::ptr::null_mut();
        let r = d.check("cuModuleGetFunction", r).and_then(|()| {
            // SAFETY: module was loaded above; LAYOUTS_ENTRY is
            // NUL-terminated; layouts is a valid out-pointer.
            d.check("cuModuleGetFunction", unsafe {
                get(&mut layouts, module, LAYOUTS_ENTRY.as_ptr())
            })
        });
        let mut k = Kernel {
            module,
            function,
            layouts,
            ring: Mutex::new(Ring {
                host: std::ptr::null_mut(),
                dev: 0,
                used: VecDeque::new(),
                spare: Vec::new(),
            }),
        };
        let bytes = RING * std::mem::size_of::<Desc>();
        let alloc = d.function(d.api.cu_mem_alloc, "cuMemAlloc_v2")?;
        let host_alloc = d.function(d.api.cu_mem_host_alloc, "cuMemHostAlloc")?;
        let ring = k.ring.get_mut().unwrap_or_else(PoisonError::into_inner);
        let result = r.and_then(|()| {
            let mut host: *mut c_void = std::ptr::null_mut();
            // SAFETY: host is a valid out-pointer; freed in `free`.
            d.check("cuMemHostAlloc", unsafe {
                host_alloc(&mut host, bytes, CU_MEMHOSTALLOC_PORTABLE)
            })?;
            ring.host = host.cast();
            // SAFETY: ring.dev is a valid out-pointer; freed in `free`.
            d.check("cuMemAlloc", unsafe { alloc(&mut ring.dev, bytes) })
        });
        if let Err(e) = result {
            k.free(d);
            return Err(e);
        }
        Ok(k)
    }

    /// Releases the module and the ring, in this GPU's context, made
    /// current by the caller after every launch finished.
    pub fn free(&self, d: &Driver) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        if let (false, Some(f)) = (ring.host.is_null(), d.api.cu_mem_free_host) {
            // SAFETY: from cuMemHostAlloc in `load`, freed once (nulled).
            unsafe { f(ring.host.cast()) };
            ring.host = std::ptr::null_mut();
        }
        if let (true, Some(f)) = (ring.dev != 0, d.api.cu_mem_free) {
            // SAFETY: from cuMemAlloc in `load`, freed once (zeroed).
            unsafe { f(ring.dev) };
            ring.dev = 0;
        }
        if let Some(destroy) = d.api.cu_event_destroy {
            let events: Vec<CUevent> = ring.used.drain(..).map(|u| u.2).collect();
            for e in events.into_iter().chain(ring.spare.drain(..)) {
                // SAFETY: events of this context, idle, destroyed once.
                unsafe { destroy(e) };
            }
        }
        if let (false, Some(f)) = (self.module.is_null(), d.api.cu_module_unload) {
            // SAFETY: loaded in `load`; nothing launches it any more.
            unsafe { f(self.module) };
        }
    }

    /// Queues every copy of `copies` on `stream` (of this kernel's context,
    /// current): long ones split, at most RING descriptors per launch.
    ///
    /// # Safety
    /// `stream` belongs to this kernel's context, which is current; every
    /// copy's ranges are GPU memory this context reaches, checked by the
    /// caller against live registrations and mappings, and stay so until
    /// the stream has run the launch.
    pub unsafe fn launch(&self, d: &Driver, stream: CUstream, copies: &[Desc]) -> PluginResult<()> {
        let htod = d.function(d.api.cu_memcpy_htod_async, "cuMemcpyHtoDAsync_v2")?;
        let launch = d.function(d.api.cu_launch_kernel, "cuLaunchKernel")?;
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let mut left = pieces(copies);
        let mut entries = copies.iter().copied();
        let mut current: Option<Desc> = None;
        while left > 0 {
            let n = left.min(RING);
            let at = ring.reserve(d, n)?;
            for i in 0..n {
                let c = match current.take() {
                    Some(c) => c,
                    None => entries.next().ok_or_else(|| {
                        PluginError::new(ErrorCode::Internal, "copy list ended early")
                    })?,
                };
                let piece = c.len.min(PIECE);
                if c.len > piece {
                    current = Some(Desc {
                        src: c.src + piece,
                        dst: c.dst + piece,
                        len: c.len - piece,
                    });
                }
                let desc = Desc {
                    src: c.src,
                    dst: c.dst,
                    len: piece,
                };
                // SAFETY: at + i < RING (reserve gave n free slots from
                // at); the slot's previous launch finished (its event fired).
                unsafe { ring.host.add(at + i).write(desc) };
            }
            let bytes = n * std::mem::size_of::<Desc>();
            let mut list = ring.dev + (at * std::mem::size_of::<Desc>()) as u64;
            // SAFETY: both ranges are this ring's, bytes long, inside it; the
            // host side is pinned and left alone until the event behind the
            // launch fires; the stream is the current context's (contract).
            d.check("cuMemcpyHtoDAsync", unsafe {
                htod(list, ring.host.add(at).cast(), bytes, stream)
            })?;
            let mut count = n as u32;
            let mut params = [
                (&mut list as *mut CUdeviceptr).cast::<c_void>(),
                (&mut count as *mut u32).cast::<c_void>(),
            ];
            let blocks = n.div_ceil(WARPS).min(65_535) as u32;
            // SAFETY: the function takes (const ferry_copy *, unsigned int),
            // the two pointers params holds, alive for the call; every
            // descriptor's ranges are what this function's contract makes
            // the caller vouch for, on a stream of the current context.
            d.check("cuLaunchKernel", unsafe {
                launch(
                    self.function,
                    blocks,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })?;
            ring.commit(d, at, n, stream)?;
            left -= n;
        }
        Ok(())
    }
}

impl Kernel {
    /// Queues the blocks of `l` on `stream` (of this kernel's context,
    /// current): both index arrays copied into the ring and uploaded, one
    /// launch per RING_IDS blocks; the GPU computes every address and
    /// splits blocks longer than PIECE.
    ///
    /// # Safety
    /// As [`Kernel::launch`], for every block's two ranges: the caller
    /// checked both layouts' extents against live registrations and
    /// mappings and every index against its layout (`src_ids` and
    /// `dst_ids` are equally long).
    pub unsafe fn launch_layouts(
        &self,
        d: &Driver,
        stream: CUstream,
        l: &LayoutCopy<'_>,
    ) -> PluginResult<()> {
        if l.src_ids.len() != l.dst_ids.len() || l.block == 0 {
            return Err(PluginError::new(
                ErrorCode::Internal,
                "a layout copy's index arrays differ in length, or its blocks are empty",
            ));
        }
        let htod = d.function(d.api.cu_memcpy_htod_async, "cuMemcpyHtoDAsync_v2")?;
        let launch = d.function(d.api.cu_launch_kernel, "cuLaunchKernel")?;
        let pieces = u32::try_from(l.block.div_ceil(PIECE)).map_err(|_| {
            PluginError::new(ErrorCode::InvalidArgument, "a block of more than 128 TiB")
        })?;
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        for (src, dst) in l.src_ids.chunks(RING_IDS).zip(l.dst_ids.chunks(RING_IDS)) {
            let m = src.len();
            // Slots of 24 bytes holding 2 * m indices of 8 bytes.
            let slots = (2 * m).div_ceil(3);
            let at = ring.reserve(d, slots)?;
            let ids = ring.host.wrapping_add(at).cast::<u64>();
            // SAFETY: slots [at, at + slots) are free (reserve), inside the
            // ring, 8-byte aligned (a page-aligned ring, 24-byte slots) and
            // hold 2 * m u64s; the source arrays are m long and are the
            // caller's, not the ring.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), ids, m);
                std::ptr::copy_nonoverlapping(dst.as_ptr(), ids.add(m), m);
            }
            let mut src_list = ring.dev + (at * std::mem::size_of::<Desc>()) as u64;
            let mut dst_list = src_list + (m * 8) as u64;
            // SAFETY: both ranges are this ring's, 16 * m bytes from slot
            // at, inside it; the host side is pinned and left alone until
            // the event behind the launch fires; the stream is the current
            // context's (contract).
            d.check("cuMemcpyHtoDAsync", unsafe {
                htod(src_list, ids.cast(), 16 * m, stream)
            })?;
            let (mut src_base, mut src_stride, mut dst_base, mut dst_stride) =
                (l.src_base, l.src_stride, l.dst_base, l.dst_stride);
            let (mut block, mut piece) = (l.block, PIECE);
            let (mut count, mut pieces) = (m as u32, pieces);
            let mut params = [
                (&mut src_list as *mut CUdeviceptr).cast::<c_void>(),
                (&mut dst_list as *mut CUdeviceptr).cast::<c_void>(),
                (&mut src_base as *mut u64).cast::<c_void>(),
                (&mut src_stride as *mut u64).cast::<c_void>(),
                (&mut dst_base as *mut u64).cast::<c_void>(),
                (&mut dst_stride as *mut u64).cast::<c_void>(),
                (&mut block as *mut u64).cast::<c_void>(),
                (&mut piece as *mut u64).cast::<c_void>(),
                (&mut count as *mut u32).cast::<c_void>(),
                (&mut pieces as *mut u32).cast::<c_void>(),
            ];
            let items = m as u64 * u64::from(pieces);
            let blocks = items.div_ceil(WARPS as u64).min(65_535) as u32;
            // SAFETY: ferry_copy_layouts takes (const u64 *, const u64 *,
            // u64 x 6, unsigned int x 2), the ten pointers params holds,
            // alive for the call; every block's ranges are what this
            // function's contract makes the caller vouch for, on a stream
            // of the current context.
            d.check("cuLaunchKernel", unsafe {
                launch(
                    self.layouts,
                    blocks,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })?;
            ring.commit(d, at, slots, stream)?;
        }
        Ok(())
    }
}

impl Ring {
    /// `n` (<= RING) free slots in a row, waiting for the oldest launches
    /// to finish when the ring is full.
    fn reserve(&mut self, d: &Driver, n: usize) -> PluginResult<usize> {
        let query = d.function(d.api.cu_event_query, "cuEventQuery")?;
        let sync = d.function(d.api.cu_event_synchronize, "cuEventSynchronize")?;
        loop {
            while let Some(&(_, _, e)) = self.used.front() {
                // SAFETY: an event of this context, recorded by commit.
                if unsafe { query(e) } != CUDA_SUCCESS {
                    break;
                }
                self.used.pop_front();
                self.spare.push(e);
            }
            let (Some(&(tail, _, oldest)), Some(&(_, head, _))) =
                (self.used.front(), self.used.back())
            else {
                return Ok(0);
            };
            if head > tail {
                if RING - head >= n {
                    return Ok(head);
                }
                if tail >= n {
                    return Ok(0);
                }
            } else if tail - head >= n {
                return Ok(head);
            }
            // SAFETY: `oldest` is an event of this context recorded by
            // commit and not yet reclaimed; waiting on it touches no memory.
            d.check("cuEventSynchronize", unsafe { sync(oldest) })?;
        }
    }

    /// Marks slots [at, at + n) used until an event recorded now fires.
    fn commit(&mut self, d: &Driver, at: usize, n: usize, stream: CUstream) -> PluginResult<()> {
        let record = d.function(d.api.cu_event_record, "cuEventRecord")?;
        let event = match self.spare.pop() {
            Some(e) => e,
            None => {
                let create = d.function(d.api.cu_event_create, "cuEventCreate")?;
                let mut e: CUevent = std::ptr::null_mut();
                // SAFETY: e is a valid out-pointer; the context is current.
                d.check("cuEventCreate", unsafe {
                    create(&mut e, CU_EVENT_DISABLE_TIMING)
                })?;
                e
            }
        };
        // SAFETY: event and stream belong to the current context.
        let r = unsafe { record(event, stream) };
        if r != CUDA_SUCCESS {
            // Without the event the slots cannot be known free: wait for
            // the stream, then they are.
            if let Some(sync) = d.api.cu_stream_synchronize {
                // SAFETY: a stream of the current context.
                let _ = unsafe { sync(stream) };
            }
            self.spare.push(event);
            return Err(d.error("cuEventRecord", r));
        }
        self.used.push_back((at, at + n, event));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_copies_count_as_pieces() {
        let c = |len| Desc {
            src: 0,
            dst: 0,
            len,
        };
        assert_eq!(
            pieces(&[c(1), c(PIECE), c(PIECE + 1), c(4 * PIECE)]),
            1 + 1 + 2 + 4
        );
    }

    #[test]
    fn the_descriptor_is_what_the_kernel_reads() {
        assert_eq!(std::mem::size_of::<Desc>(), 24);
        assert!(PTX.contains(".entry ferry_copy_list("));
        assert!(PTX.contains(".param .u64 ferry_copy_list_param_0"));
        assert!(PTX.contains(".param .u32 ferry_copy_list_param_1"));
        // ferry_copy_layouts: two id arrays, six u64s, two u32s.
        assert!(PTX.contains(".entry ferry_copy_layouts("));
        for i in 0..8 {
            assert!(PTX.contains(&format!(".param .u64 ferry_copy_layouts_param_{i}")));
        }
        assert!(PTX.contains(".param .u32 ferry_copy_layouts_param_8"));
        assert!(PTX.contains(".param .u32 ferry_copy_layouts_param_9"));
        assert!(!PTX.contains("ferry_copy_layouts_param_10"));
    }
}
