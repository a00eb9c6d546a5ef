//! Layout lists (ABI 1.5): blocks of two block layouts named by index, so
//! a transport that computes addresses where the bytes move (a GPU kernel
//! reading the index arrays) gets the arrays as the application gave
//! them, with no list of 24-byte blocks built, read and rewritten per
//! block on the way.

use super::blocks::Block;
use super::boundary::PluginError;
use super::op::Op;
use crate::status::ErrorCode;
use crate::sys;

/// The largest of `ids` (0 for none): what an index array is checked by,
/// once per transfer. Eight running maxima, so the loop vectorises, and
/// AVX2 where the CPU has it (x86-64's baseline, SSE2, has no 64-bit
/// compare: 65,536 indices took ~50 us each side on the dev machine).
pub fn max_index(ids: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above, and AVX2 is the
        // only feature max_index_avx2 is compiled for; it reads `ids`
        // through safe slice code only.
        return unsafe { max_index_avx2(ids) };
    }
    max_index_plain(ids)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_index_avx2(ids: &[u64]) -> u64 {
    max_index_plain(ids)
}

#[inline(always)]
fn max_index_plain(ids: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = ids.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = (*m).max(x);
        }
    }
    lanes
        .into_iter()
        .chain(rest.iter().copied())
        .max()
        .unwrap_or(0)
}

/// One side of a layout list: block `i` at `base + i * stride`, `blocks`
/// of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub base: u64,
    pub stride: u64,
    pub blocks: u64,
}

impl Layout {
    /// Bytes from `base` to the end of the last block of `block_size`
    /// bytes, or `None` when that overflows the address space.
    pub fn extent(&self, block_size: u64) -> Option<u64> {
        self.blocks
            .checked_sub(1)?
            .checked_mul(self.stride)?
            .checked_add(block_size)
            .filter(|e| self.base.checked_add(*e).is_some())
    }
}

/// A layout list, borrowed for the duration of `submit_layouts`. Its
/// layouts' extents are known not to overflow; its indices are checked
/// by [`LayoutList::check_indices`].
#[derive(Clone, Copy, Debug)]
pub struct LayoutList<'a> {
    pub op: Op,
    pub local: Layout,
    pub local_mem: u64,
    pub remote: Layout,
    pub remote_key: &'a [u8],
    pub block_size: u64,
    pub local_ids: &'a [u64],
    pub remote_ids: &'a [u64],
    pub token: u64,
}

impl<'a> LayoutList<'a> {
    /// The list behind a raw one, or why it is none (no blocks, empty
    /// blocks, a layout that runs past the end of the address space).
    ///
    /// # Safety
    /// `raw.remote_key` must be null or valid for `remote_key_len` bytes,
    /// and `raw.local_ids` and `raw.remote_ids` valid for `count` entries
    /// each, for `'a`.
    pub unsafe fn from_raw(raw: &sys::ferry_layout_list_t) -> Result<LayoutList<'a>, PluginError> {
        let op = Op::from_raw(raw.op)?;
        let bad = |why: &str| PluginError::new(ErrorCode::InvalidArgument, why.to_string());
        if raw.local_ids.is_null() || raw.remote_ids.is_null() || raw.count == 0 {
            return Err(bad("a layout list without blocks"));
        }
        if raw.block_size == 0 {
            return Err(bad("a layout list of empty blocks"));
        }
        let local = Layout {
            base: raw.local_base,
            stride: raw.local_stride,
            blocks: raw.local_blocks,
        };
        let remote = Layout {
            base: raw.remote_base,
            stride: raw.remote_stride,
            blocks: raw.remote_blocks,
        };
        for (side, l) in [("local", local), ("remote", remote)] {
            if l.extent(raw.block_size).is_none() {
                return Err(PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "the {side} layout (base {:#x}, stride {}, {} blocks of {} bytes) is \
                         empty or runs past the end of the address space",
                        l.base, l.stride, l.blocks, raw.block_size
                    ),
                ));
            }
        }
        // SAFETY: `local_ids` is non-null and `count` > 0 (checked above), and
        // the `# Safety` section makes it valid for `count` u64 reads for 'a: what
        // submit_layouts_trampoline passes on from plugin.h (ferry_layout_list_t:
        // the arrays stay valid for the duration of submit_layouts); it is aligned
        // as any C `const uint64_t *` is (the engine's layout_list: a `&[u64]`).
        let local_ids = unsafe { std::slice::from_raw_parts(raw.local_ids, raw.count) };
        // SAFETY: `remote_ids` is non-null (checked above), and the `# Safety`
        // section makes it valid for `count` u64 reads for 'a too: the same
        // plugin.h duration and C `const uint64_t *` alignment, and the engine
        // (check_transfer) refuses arrays of unequal length before building it.
        let remote_ids = unsafe { std::slice::from_raw_parts(raw.remote_ids, raw.count) };
        let remote_key = if raw.remote_key.is_null() || raw.remote_key_len == 0 {
            &[][..]
        } else {
            // SAFETY: `remote_key` is non-null here, and the `# Safety` section's
            // first requirement makes a non-null key valid for `remote_key_len`
            // bytes for 'a: the engine points it at the peer's key bytes, which
            // it holds while submit_layouts runs. u8 needs no alignment.
            unsafe { std::slice::from_raw_parts(raw.remote_key, raw.remote_key_len) }
        };
        Ok(LayoutList {
            op,
            local,
            local_mem: raw.local_mem,
            remote,
            remote_key,
            block_size: raw.block_size,
            local_ids,
            remote_ids,
            token: raw.token,
        })
    }

    /// Every index below its layout's block count, or the error naming the
    /// first that is not. One max over each array (it vectorises); the
    /// position is looked up only when one is out of range.
    pub fn check_indices(&self) -> Result<(), PluginError> {
        for (side, ids, layout) in [
            ("local", self.local_ids, self.local),
            ("remote", self.remote_ids, self.remote),
        ] {
            if max_index(ids) < layout.blocks {
                continue;
            }
            let i = ids.iter().position(|&id| id >= layout.blocks).unwrap_or(0);
            return Err(PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "block {i}: the {side} index {} is outside its layout of {} blocks; nothing \
                     was moved",
                    ids[i], layout.blocks
                ),
            ));
        }
        Ok(())
    }

    /// The same blocks as a block list relative to the two bases (for a
    /// path that moves block lists), after [`LayoutList::check_indices`].
    pub fn to_blocks(&self, into: &mut Vec<Block>) {
        into.clear();
        into.extend(
            self.local_ids
                .iter()
                .zip(self.remote_ids)
                .map(|(&l, &r)| Block {
                    local_offset: l * self.local.stride,
                    remote_offset: r * self.remote.stride,
                    length: self.block_size,
                }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list<'a>(l: &'a [u64], r: &'a [u64]) -> LayoutList<'a> {
        LayoutList {
            op: Op::Write,
            local: Layout {
                base: 0x1000,
                stride: 64,
                blocks: 4,
            },
            local_mem: 1,
            remote: Layout {
                base: 0,
                stride: 32,
                blocks: 8,
            },
            remote_key: &[],
            block_size: 16,
            local_ids: l,
            remote_ids: r,
            token: 7,
        }
    }

    #[test]
    fn the_largest_index_is_found_wherever_it_is() {
        assert_eq!(max_index(&[]), 0);
        for n in [1usize, 7, 8, 9, 64, 1000] {
            for at in [0, n / 2, n - 1] {
                let mut v: Vec<u64> = (0..n as u64).map(|i| i % 5).collect();
                v[at] = u64::MAX - 1;
                assert_eq!(max_index(&v), u64::MAX - 1, "n {n}, at {at}");
                assert_eq!(max_index_plain(&v), u64::MAX - 1);
            }
        }
    }

    #[test]
    fn extent_ends_at_the_last_block() {
        let l = Layout {
            base: 0,
            stride: 64,
            blocks: 4,
        };
        assert_eq!(l.extent(16), Some(3 * 64 + 16));
        assert_eq!(Layout { blocks: 0, ..l }.extent(16), None);
        let huge = Layout {
            base: u64::MAX - 10,
            ..l
        };
        assert_eq!(huge.extent(16), None);
    }

    #[test]
    fn the_first_index_out_of_range_is_named() {
        assert!(list(&[0, 3], &[7, 0]).check_indices().is_ok());
        let e = list(&[0, 4], &[0, 0]).check_indices().unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert!(
            e.message.contains("block 1: the local index 4"),
            "{}",
            e.message
        );
        let e = list(&[0, 1], &[8, 0]).check_indices().unwrap_err();
        assert!(
            e.message.contains("block 0: the remote index 8"),
            "{}",
            e.message
        );
    }

    #[test]
    fn blocks_are_offsets_from_the_bases() {
        let mut v = Vec::new();
        list(&[2, 0], &[1, 5]).to_blocks(&mut v);
        let got: Vec<_> = v
            .iter()
            .map(|b| (b.local_offset, b.remote_offset, b.length))
            .collect();
        assert_eq!(got, [(128, 32, 16), (0, 160, 16)]);
    }

    #[test]
    fn raw_lists_without_blocks_or_with_wrapping_layouts_are_refused() {
        let ids = [0u64];
        let mut raw = sys::ferry_layout_list_t {
            op: sys::FERRY_OP_WRITE,
            reserved: 0,
            local_base: 0,
            local_stride: 16,
            local_blocks: 1,
            local_mem: 0,
            remote_base: 0,
            remote_stride: 16,
            remote_blocks: 1,
            remote_key: std::ptr::null(),
            remote_key_len: 0,
            block_size: 16,
            local_ids: ids.as_ptr(),
            remote_ids: ids.as_ptr(),
            count: 1,
            token: 0,
        };
        // SAFETY: the arrays are valid for `count` entries; no key.
        assert!(unsafe { LayoutList::from_raw(&raw) }.is_ok());
        raw.remote_stride = u64::MAX / 2;
        raw.remote_blocks = 3;
        // SAFETY: `raw` still points both index arrays at the live one-entry `ids` with count 1
        // and has a null key; only the remote stride and block count changed.
        assert!(unsafe { LayoutList::from_raw(&raw) }.is_err());
        raw.remote_blocks = 1;
        raw.count = 0;
        // SAFETY: count 0: nothing is read.
        assert!(unsafe { LayoutList::from_raw(&raw) }.is_err());
    }
}
