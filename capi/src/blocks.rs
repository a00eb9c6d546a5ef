//! Block layouts: a pool registered once, transfers by block index (the
//! shape of a KV cache), as arrays.

use crate::boundary::{invalid, obj};
use crate::engine::ferry_engine;
use crate::types::*;
use ferry_core::{BlockLayout, BlockTransfer, Error, ErrorCode, Op};
use ferry_plugins_abi::sys;

/// Registers a block layout over memory registered with `engine`: `count`
/// blocks of `block_size` bytes, block i at `base + i * stride`. Peers see
/// it with the segment and name its blocks by index; `*out` is its id.
///
/// # Safety
/// `engine` valid; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_layout_register(
    engine: *const ferry_engine,
    base: *mut std::ffi::c_void,
    block_size: u64,
    stride: u64,
    count: u64,
    out: *mut u32,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        let id = e.inner.register_layout(BlockLayout {
            base: base as u64,
            block_size,
            stride,
            count,
        })?;
        // SAFETY: checked non-null.
        unsafe { *out = id };
        Ok(())
    })
}

/// Withdraws a layout registered with `engine`.
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_layout_unregister(
    engine: *const ferry_engine,
    layout: u32,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        e.inner.unregister_layout(layout)
    })
}

/// Adds `count` blocks to a batch and starts them: block `local_ids[i]` of
/// local layout `local_layout` moves to (FERRY_OP_WRITE) or from
/// (FERRY_OP_READ) block `remote_ids[i]` of the segment's layout
/// `remote_layout`; request i of the batch is block i. An index out of
/// range, an unknown layout or block sizes that differ fail the call and
/// nothing is submitted.
///
/// # Safety
/// `engine` valid; `local_ids` and `remote_ids` valid for `count` elements.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_batch_submit_blocks(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    op: u32,
    segment: ferry_segment_id,
    local_layout: u32,
    local_ids: *const u64,
    remote_layout: u32,
    remote_ids: *const u64,
    count: usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        let op = match op {
            sys::FERRY_OP_READ => Op::Read,
            sys::FERRY_OP_WRITE => Op::Write,
            other => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("op {other} is neither FERRY_OP_READ nor FERRY_OP_WRITE"),
                ))
            }
        };
        if count == 0 {
            return Ok(());
        }
        if local_ids.is_null() || remote_ids.is_null() {
            return Err(invalid("local_ids or remote_ids"));
        }
        // SAFETY: count > 0 and both arrays are non-null (checked above); ferry.h
        // (ferry_batch_submit_blocks) makes each valid for `count` u64s, and the slices are
        // borrowed only by the BlockTransfer that submit_blocks reads during this call.
        let (local_ids, remote_ids) = unsafe {
            (
                std::slice::from_raw_parts(local_ids, count),
                std::slice::from_raw_parts(remote_ids, count),
            )
        };
        e.inner.submit_blocks(
            batch,
            &BlockTransfer {
                op,
                segment,
                local: local_layout,
                local_ids,
                remote: remote_layout,
                remote_ids,
                transport: None,
            },
        )
    })
}
