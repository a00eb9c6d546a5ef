//! Block lists (ABI 1.4): many blocks between one local buffer and one
//! peer buffer, handed to a transport in one call and completed once. This
//! is how a KV cache moves: thousands of small blocks of two pools, where a
//! call, a check and a completion per block would cost more than the bytes.

use super::boundary::PluginError;
use super::op::Op;
use crate::status::ErrorCode;
use crate::sys;

/// One block: `length` bytes at `local_addr + local_offset` and at the
/// peer's `remote_addr + remote_offset`.
pub type Block = sys::ferry_block_t;

/// A block list, borrowed for the duration of `submit_blocks`.
#[derive(Clone, Copy, Debug)]
pub struct BlockList<'a> {
    pub op: Op,
    pub local_addr: u64,
    pub local_mem: u64,
    pub remote_addr: u64,
    pub remote_key: &'a [u8],
    pub blocks: &'a [Block],
    pub token: u64,
}

/// The ranges a list touches, relative to its bases: the end of the
/// furthest local and remote block (so one check against each buffer
/// covers every block), or the error naming the first block whose range
/// overflows or is empty.
pub fn block_extent(blocks: &[Block]) -> Result<(u64, u64), PluginError> {
    let (mut local_end, mut remote_end) = (0u64, 0u64);
    for (i, b) in blocks.iter().enumerate() {
        let l = b.local_offset.checked_add(b.length);
        let r = b.remote_offset.checked_add(b.length);
        match (l, r, b.length) {
            (Some(l), Some(r), 1..) => {
                local_end = local_end.max(l);
                remote_end = remote_end.max(r);
            }
            _ => {
                return Err(PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "block {i}: offsets {:#x}/{:#x} with length {} is no range",
                        b.local_offset, b.remote_offset, b.length
                    ),
                ))
            }
        }
    }
    Ok((local_end, remote_end))
}

impl<'a> BlockList<'a> {
    /// The list behind a raw one.
    ///
    /// # Safety
    /// `raw.remote_key` must be null or valid for `remote_key_len` bytes,
    /// and `raw.blocks` valid for `count` blocks, for `'a`.
    pub unsafe fn from_raw(raw: &sys::ferry_block_list_t) -> Result<BlockList<'a>, PluginError> {
        let op = Op::from_raw(raw.op)?;
        if raw.blocks.is_null() || raw.count == 0 {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                "a block list without blocks",
            ));
        }
        // SAFETY: `blocks` is non-null and `count` > 0 (checked above), and the
        // `# Safety` section makes it valid for `count` ferry_block_t reads for
        // 'a: what submit_blocks_trampoline passes on from plugin.h
        // (ferry_block_list_t: blocks stays valid for the duration of
        // submit_blocks); it is aligned as any C `const ferry_block_t *` is (the
        // engine points it at a Vec<ferry_block_t>).
        let blocks = unsafe { std::slice::from_raw_parts(raw.blocks, raw.count) };
        let remote_key = if raw.remote_key.is_null() || raw.remote_key_len == 0 {
            &[][..]
        } else {
            // SAFETY: `remote_key` is non-null here, and the `# Safety` section's
            // first requirement makes a non-null key valid for `remote_key_len`
            // bytes for 'a: the engine points it at the peer's key bytes, which
            // its list group holds while submit_blocks runs. u8 needs no alignment.
            unsafe { std::slice::from_raw_parts(raw.remote_key, raw.remote_key_len) }
        };
        Ok(BlockList {
            op,
            local_addr: raw.local_addr,
            local_mem: raw.local_mem,
            remote_addr: raw.remote_addr,
            remote_key,
            blocks,
            token: raw.token,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(l: u64, r: u64, n: u64) -> Block {
        Block {
            local_offset: l,
            remote_offset: r,
            length: n,
        }
    }

    #[test]
    fn extent_is_the_furthest_end_on_each_side() {
        let list = [b(0, 4096, 4096), b(8192, 0, 4096), b(4096, 65536, 16)];
        assert_eq!(block_extent(&list).unwrap(), (12288, 65552));
    }

    #[test]
    fn empty_or_overflowing_blocks_are_refused() {
        assert!(block_extent(&[b(0, 0, 0)]).is_err());
        let e = block_extent(&[b(0, 0, 1), b(u64::MAX, 0, 2)]).unwrap_err();
        assert!(e.message.contains("block 1"), "{}", e.message);
    }
}
