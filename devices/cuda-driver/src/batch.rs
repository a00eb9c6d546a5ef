//! The driver's batched copy (cuMemcpyBatchAsync, CUDA 12.8+): many copies
//! in one call, each still its own DMA, for where the copy kernel cannot
//! load or cannot reach both ends (host memory), and one cuMemcpyAsync per
//! copy where the driver has no batched copy either.

use crate::driver::*;
use crate::kernel::Desc;
use ferry_plugins_abi::sdk::PluginResult;

/// Queues `copies` on `stream` (its context current) in one
/// cuMemcpyBatchAsync.
///
/// # Safety
/// `stream` belongs to the current context and is not the legacy default
/// stream; every copy's ranges are memory this context reaches, checked by
/// the caller against live registrations and mappings, and stay so until
/// the stream has run the copies.
pub unsafe fn copy_batch(d: &Driver, stream: CUstream, copies: &[Desc]) -> PluginResult<()> {
    let f = d.function(d.api.cu_memcpy_batch_async, "cuMemcpyBatchAsync")?;
    let mut dsts: Vec<CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
    let mut srcs: Vec<CUdeviceptr> = copies.iter().map(|c| c.src).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
    // One attribute for every copy: sources read in stream order.
    let mut attrs = [CUmemcpyAttributes {
        src_access_order: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        ..Default::default()
    }];
    let mut attr_index = [0usize];
    let mut failed = usize::MAX;
    // SAFETY: the three arrays hold copies.len() entries, attrs and its
    // index one each, all alive for the call (the driver copies what it
    // keeps); the ranges and the stream are as this function's contract
    // requires of its caller.
    let r = unsafe {
        f(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            attrs.as_mut_ptr(),
            attr_index.as_mut_ptr(),
            1,
            &mut failed,
            stream,
        )
    };
    if r != CUDA_SUCCESS && failed < copies.len() {
        let c = copies[failed];
        return Err(d.error(
            &format!(
                "cuMemcpyBatchAsync (copy {failed}: {:#x} -> {:#x}, {} bytes)",
                c.src, c.dst, c.len
            ),
            r,
        ));
    }
    d.check("cuMemcpyBatchAsync", r)
}

/// Queues `copies` on `stream` (its context current), one cuMemcpyAsync each.
///
/// # Safety
/// As for [`copy_batch`].
pub unsafe fn copy_each(d: &Driver, stream: CUstream, copies: &[Desc]) -> PluginResult<()> {
    let memcpy = d.function(d.api.cu_memcpy_async, "cuMemcpyAsync")?;
    for c in copies {
        // SAFETY: dst and src are ranges this function's caller vouches
        // for (unified addressing: the driver finds the direction), on a
        // stream of the current context, as its contract requires.
        d.check("cuMemcpyAsync", unsafe {
            memcpy(c.dst, c.src, c.len as usize, stream)
        })?;
    }
    Ok(())
}
