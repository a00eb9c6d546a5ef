//! Block layouts: a pool of equal blocks (a KV cache's blocks of one layer),
//! registered once as base, block size, stride and count, published with
//! the segment, and named by index afterwards. A transfer by layouts is two
//! arrays of block indices, checked and turned into a block list here,
//! with no per-block lookup of buffers or routes.

use crate::descriptor::{LayoutDescriptor, MAX_LAYOUTS};
use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sys::{ferry_block_t, ferry_layout_list_t};
use parking_lot::Mutex;

/// Identifies a layout within the engine that registered it.
pub type LayoutId = u32;

/// `count` blocks of `block_size` bytes, block `i` at `base + i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    pub base: u64,
    pub block_size: u64,
    pub stride: u64,
    pub count: u64,
}

impl BlockLayout {
    /// A layout of `count` adjacent blocks (stride = block size).
    pub fn contiguous(base: u64, block_size: u64, count: u64) -> BlockLayout {
        BlockLayout {
            base,
            block_size,
            stride: block_size,
            count,
        }
    }

    /// The bytes from `base` to the end of the last block, or why the
    /// layout is not one (empty blocks, overlapping blocks, overflow).
    pub fn extent(&self) -> Result<u64> {
        let bad = |why: &str| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "layout (base {:#x}, block {} bytes, stride {}, {} blocks): {why}",
                    self.base, self.block_size, self.stride, self.count
                ),
            )
        };
        if self.block_size == 0 || self.count == 0 {
            return Err(bad("blocks and their count must be > 0"));
        }
        if self.count > 1 && self.stride < self.block_size {
            return Err(bad("the stride is shorter than a block, so blocks overlap"));
        }
        let extent = (self.count - 1)
            .checked_mul(self.stride)
            .and_then(|s| s.checked_add(self.block_size))
            .filter(|e| self.base.checked_add(*e).is_some())
            .ok_or_else(|| bad("it runs past the end of the address space"))?;
        Ok(extent)
    }

    /// Block `id`'s offset from `base` (the caller checked `id < count`).
    fn offset(&self, id: u64) -> u64 {
        id * self.stride
    }

    pub(crate) fn to_descriptor(self, id: LayoutId) -> LayoutDescriptor {
        LayoutDescriptor {
            id,
            base: self.base,
            block_size: self.block_size,
            stride: self.stride,
            count: self.count,
        }
    }

    pub(crate) fn from_descriptor(d: &LayoutDescriptor) -> BlockLayout {
        BlockLayout {
            base: d.base,
            block_size: d.block_size,
            stride: d.stride,
            count: d.count,
        }
    }
}

/// The layouts this engine registered, by id.
#[derive(Default)]
pub(crate) struct Layouts {
    list: Mutex<(LayoutId, Vec<(LayoutId, BlockLayout)>)>,
}

impl Layouts {
    pub(crate) fn add(&self, layout: BlockLayout) -> Result<LayoutId> {
        let mut l = self.list.lock();
        if l.1.len() >= MAX_LAYOUTS {
            return Err(Error::new(
                ErrorCode::NoMemory,
                format!("this engine already has {MAX_LAYOUTS} layouts: remove one first"),
            ));
        }
        l.0 = l.0.wrapping_add(1).max(1);
        let id = l.0;
        l.1.push((id, layout));
        Ok(id)
    }

    pub(crate) fn remove(&self, id: LayoutId) -> Result<BlockLayout> {
        let mut l = self.list.lock();
        let i =
            l.1.iter()
                .position(|(k, _)| *k == id)
                .ok_or_else(|| unknown(id, "this engine"))?;
        Ok(l.1.remove(i).1)
    }

    pub(crate) fn get(&self, id: LayoutId) -> Result<BlockLayout> {
        self.list
            .lock()
            .1
            .iter()
            .find(|(k, _)| *k == id)
            .map(|(_, l)| *l)
            .ok_or_else(|| unknown(id, "this engine"))
    }

    pub(crate) fn descriptors(&self) -> Vec<LayoutDescriptor> {
        self.list
            .lock()
            .1
            .iter()
            .map(|(id, l)| l.to_descriptor(*id))
            .collect()
    }
}

pub(crate) fn unknown(id: LayoutId, whose: &str) -> Error {
    Error::new(
        ErrorCode::NotFound,
        format!("layout {id} is not registered with {whose}"),
    )
}

/// The first index in `ids` that is `count` or more, as an error naming
/// `side`'s layout.
fn check_ids(ids: &[u64], count: u64, side: &str) -> Result<()> {
    // A max over the array (vectorised); the position is looked up only
    // when one is out of range.
    if ferry_plugins_abi::sdk::max_index(ids) < count {
        return Ok(());
    }
    let i = ids.iter().position(|&id| id >= count).unwrap_or(0);
    Err(Error::new(
        ErrorCode::OutOfBounds,
        format!(
            "block {i}: {side} index {} is outside its layout of {count} blocks; nothing was moved",
            ids[i]
        ),
    ))
}

/// The block list for moving `local_ids[i]` of `local` to or from
/// `remote_ids[i]` of `remote` (offsets from each layout's base), with
/// blocks adjacent on both sides coalesced; or why not (lengths differ,
/// an index out of range, block sizes that differ).
#[cfg(test)]
pub(crate) fn block_list(
    local: &BlockLayout,
    local_ids: &[u64],
    remote: &BlockLayout,
    remote_ids: &[u64],
) -> Result<Vec<ferry_block_t>> {
    check_transfer(local, local_ids, remote, remote_ids)?;
    Ok(checked_block_list(local, local_ids, remote, remote_ids))
}

/// Whether `local_ids[i]` of `local` can move to or from `remote_ids[i]`
/// of `remote`, or why not (lengths differ, an index out of range, block
/// sizes that differ): one max over each array, no per-block branch.
pub(crate) fn check_transfer(
    local: &BlockLayout,
    local_ids: &[u64],
    remote: &BlockLayout,
    remote_ids: &[u64],
) -> Result<()> {
    if local_ids.len() != remote_ids.len() {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "{} local and {} remote block indices: one of each per block",
                local_ids.len(),
                remote_ids.len()
            ),
        ));
    }
    if local.block_size != remote.block_size {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "the local layout's blocks are {} bytes and the remote layout's {}: a block \
                 moves whole, so they must be equal",
                local.block_size, remote.block_size
            ),
        ));
    }
    check_ids(local_ids, local.count, "the local")?;
    check_ids(remote_ids, remote.count, "the remote")
}

/// [`block_list`] of a transfer [`check_transfer`] passed.
pub(crate) fn checked_block_list(
    local: &BlockLayout,
    local_ids: &[u64],
    remote: &BlockLayout,
    remote_ids: &[u64],
) -> Vec<ferry_block_t> {
    let len = local.block_size;
    let mut blocks = spare_blocks(local_ids.len());
    for (&l, &r) in local_ids.iter().zip(remote_ids) {
        let (lo, ro) = (local.offset(l), remote.offset(r));
        if let Some(prev) = blocks.last_mut() {
            if prev.local_offset + prev.length == lo && prev.remote_offset + prev.length == ro {
                prev.length += len;
                continue;
            }
        }
        blocks.push(ferry_block_t {
            local_offset: lo,
            remote_offset: ro,
            length: len,
        });
    }
    blocks
}

/// The layout list for moving `local_ids[i]` of `local` to or from
/// `remote_ids[i]` of `remote`, for a transfer [`check_transfer`] passed;
/// the arrays are borrowed, not copied (alive while it is handed over).
/// Its token and local handle are filled in with its completion group.
pub(crate) fn layout_list(
    op: u32,
    local: &BlockLayout,
    local_ids: &[u64],
    remote: &BlockLayout,
    remote_ids: &[u64],
    remote_key: &[u8],
) -> ferry_layout_list_t {
    ferry_layout_list_t {
        op,
        reserved: 0,
        local_base: local.base,
        local_stride: local.stride,
        local_blocks: local.count,
        local_mem: 0,
        remote_base: remote.base,
        remote_stride: remote.stride,
        remote_blocks: remote.count,
        remote_key: remote_key.as_ptr(),
        remote_key_len: remote_key.len(),
        block_size: local.block_size,
        local_ids: local_ids.as_ptr(),
        remote_ids: remote_ids.as_ptr(),
        count: local_ids.len(),
        token: 0,
    }
}

/// Block lists' memory, kept for the next lists: a list of 65,536 blocks
/// is 1.5 MiB, which the allocator maps and unmaps (page faults, zeroing)
/// on every transfer when it is freed. Shared by every thread, because a
/// list kept for its retry (retry.rs) is let go on whichever thread
/// completes it.
static SPARE: Mutex<Vec<Vec<ferry_block_t>>> = Mutex::new(Vec::new());

/// Most blocks a kept list holds (24 MiB).
const SPARE_MAX: usize = 1 << 20;

/// How many lists are kept: one per batch in flight at a time, for a few.
const SPARES: usize = 4;

/// An empty list with room for `n` blocks, reusing a kept one.
pub(crate) fn spare_blocks(n: usize) -> Vec<ferry_block_t> {
    let mut v = SPARE.lock().pop().unwrap_or_default();
    v.clear();
    v.reserve(n);
    v
}

/// Keeps a list's memory for a next list.
pub(crate) fn recycle_blocks(v: Vec<ferry_block_t>) {
    if v.capacity() == 0 || v.capacity() > SPARE_MAX {
        return;
    }
    let mut spare = SPARE.lock();
    if spare.len() < SPARES {
        spare.push(v);
    } else if let Some(least) = spare.iter_mut().min_by_key(|k| k.capacity()) {
        if least.capacity() < v.capacity() {
            let freed = std::mem::replace(least, v);
            drop(spare);
            drop(freed); // outside the lock
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: BlockLayout = BlockLayout {
        base: 0x1000,
        block_size: 16,
        stride: 64,
        count: 8,
    };

    #[test]
    fn extent_covers_the_last_block_only() {
        assert_eq!(L.extent().unwrap(), 7 * 64 + 16);
        assert_eq!(BlockLayout::contiguous(0, 4096, 4).extent().unwrap(), 16384);
    }

    #[test]
    fn bad_layouts_say_why() {
        let overlap = BlockLayout { stride: 8, ..L };
        assert!(overlap.extent().unwrap_err().message.contains("overlap"));
        let empty = BlockLayout { count: 0, ..L };
        assert!(empty.extent().is_err());
        let wraps = BlockLayout {
            base: u64::MAX - 100,
            ..L
        };
        assert!(wraps
            .extent()
            .unwrap_err()
            .message
            .contains("address space"));
        // A peer's stride that would wrap the offsets of later blocks.
        let huge = BlockLayout {
            stride: u64::MAX / 2,
            count: 3,
            ..L
        };
        assert!(huge.extent().is_err());
        // One block needs no stride.
        assert!(BlockLayout {
            stride: 0,
            count: 1,
            ..L
        }
        .extent()
        .is_ok());
    }

    #[test]
    fn adjacent_blocks_on_both_sides_coalesce() {
        let c = BlockLayout::contiguous(0, 16, 8);
        let list = block_list(&c, &[0, 1, 2, 5, 7], &c, &[3, 4, 5, 1, 2]).unwrap();
        let got: Vec<_> = list
            .iter()
            .map(|b| (b.local_offset, b.remote_offset, b.length))
            .collect();
        assert_eq!(got, [(0, 48, 48), (80, 16, 16), (112, 32, 16)]);
        // Strided layouts never coalesce (gaps between blocks).
        assert_eq!(block_list(&L, &[0, 1], &L, &[0, 1]).unwrap().len(), 2);
    }

    #[test]
    fn out_of_range_indices_are_named_and_nothing_is_built() {
        let e = block_list(&L, &[0, 8], &L, &[0, 1]).unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert!(
            e.message.contains("block 1: the local index 8"),
            "{}",
            e.message
        );
        let e = block_list(&L, &[0, 1], &L, &[9, 1]).unwrap_err();
        assert!(
            e.message.contains("block 0: the remote index 9"),
            "{}",
            e.message
        );
        assert!(block_list(&L, &[0], &L, &[0, 1]).is_err());
        let other = BlockLayout {
            block_size: 32,
            ..L
        };
        assert!(block_list(&L, &[0], &other, &[0]).is_err());
    }

    #[test]
    fn registry_hands_out_ids_and_forgets_removed_ones() {
        let r = Layouts::default();
        let a = r.add(L).unwrap();
        let b = r.add(L).unwrap();
        assert_ne!(a, b);
        assert_eq!(r.get(a).unwrap(), L);
        r.remove(a).unwrap();
        assert_eq!(r.get(a).unwrap_err().code, ErrorCode::NotFound);
        assert_eq!(r.descriptors().len(), 1);
    }
}
