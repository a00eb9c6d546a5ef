//! Block lists (ABI 1.4) over shm: many blocks between one local buffer
//! and one buffer of the peer, as a KV cache moves them.
//!
//! Per list, not per block: one decode of the peer's key, one check of the
//! list's extent against the peer's registration (and our mapping of it),
//! one copy lock, one hand-off to the copy threads (each takes runs of
//! blocks) and one completion. Per block there is only its copy: a
//! streaming copy without its own fence on the mapped path (the copy
//! threads work out each block's addresses from the list itself), one
//! iovec of a process_vm_writev/readv of up to IOV_MAX blocks by
//! cross-memory attach.

use crate::copy::{self, Piece};
use crate::endpoint::Key;
use crate::{incomplete, ShmInstance, ShmPeer};
use ferry_plugins_abi::sdk::{block_extent, BlockList, PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::sync::atomic::Ordering;

/// Accepts a list: refused as a whole (nothing touched) when any block
/// lies outside the peer's buffer, else copied and completed once.
impl ShmInstance {
    /// Accepts a list (see the module's documentation).
    pub(crate) fn submit_list(&self, peer: &ShmPeer, list: &BlockList<'_>) -> PluginResult<()> {
        let inst = self;
        if peer.state.closed.load(Ordering::SeqCst) {
            return Err(peer.gone());
        }
        let (local_end, remote_end) = block_extent(list.blocks)?;
        if list.local_addr.checked_add(local_end).is_none() {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "shm: blocks up to {local_end:#x} past local {:#x} wrap around",
                    list.local_addr
                ),
            ));
        }
        let key = Key::decode_repeated(list.remote_key)
            .ok_or_else(|| PluginError::new(ErrorCode::Protocol, "shm: malformed key"))?;
        peer.ensure_usable(&key, inst.timeout)?;
        let mem = peer.state.copying.read().unwrap_or_else(|p| p.into_inner());
        let refused = || {
            PluginError::new(
                ErrorCode::OutOfBounds,
                format!(
                    "shm: blocks [{:#x}, +{remote_end}) are not all inside a buffer registered at \
                 {} (out of range, unregistered or revoked); nothing moved",
                    list.remote_addr, peer.name
                ),
            )
        };
        let (base, len) = key.range();
        let inside = list.remote_addr >= base
            && list
                .remote_addr
                .checked_add(remote_end)
                .is_some_and(|end| base.checked_add(len).is_some_and(|limit| end <= limit));
        if mem.revoked.contains(&key.id()) || !inside {
            return Err(refused());
        }
        // Where block offsets start on the remote side: in our mapping of the
        // peer's file, or in the peer's address space.
        let remote_start = match key {
            Key::Map {
                token,
                base,
                offset,
                ..
            } => {
                let mapping = mem.mappings.get(&token).ok_or_else(refused)?;
                let at = (list.remote_addr - base)
                    .checked_add(offset)
                    .filter(|at| at.checked_add(remote_end).is_some_and(|e| e <= mapping.len))
                    .ok_or_else(refused)?;
                mapping.base as u64 + at
            }
            Key::Cma { .. } => {
                peer.state.cma.clone().map_err(|why| {
                    PluginError::new(
                        ErrorCode::Unavailable,
                        format!("shm: cross-memory attach to {}: {why}", peer.name),
                    )
                })?;
                list.remote_addr
            }
        };
        let total = list
            .blocks
            .iter()
            .fold(0u64, |t, b| t.saturating_add(b.length));
        let pool = (copy::parts_for(total, 2) > 1)
            .then(|| inst.pools.near(inst.numa_node_of(list.local_mem)))
            .flatten();
        let copiers = pool.as_ref().map_or(1, |p| p.helpers() + 1);
        let parts = copy::parts_for(total, copiers);
        let result = match key {
            Key::Map { .. } => {
                // SAFETY: every remote range lies inside the mapping checked
                // above (block_extent bounds every block by `remote_end` from
                // `remote_start`), which the copy lock (`mem`) keeps mapped
                // until after the copies; the local ranges lie in the buffer
                // the engine checked the list against, or in memory the
                // application submitted unregistered
                // (FERRY_TRANSPORT_LOCAL_UNREGISTERED) that must stay valid
                // until completion.
                let finished = unsafe {
                    copy::mapped_blocks(
                        pool.as_deref(),
                        list.op,
                        (list.local_addr, remote_start),
                        (list.blocks, total),
                        parts,
                        inst.nontemporal,
                    )
                };
                if finished {
                    Ok(())
                } else {
                    Err(incomplete())
                }
            }
            Key::Cma { .. } => {
                let ends = (list.local_addr, remote_start);
                let pieces: Vec<Piece> = (list.blocks.iter().enumerate())
                    .map(|(k, b)| copy::block_piece(list.op, ends, k, b))
                    .collect();
                // SAFETY: the local ranges lie in the buffer the engine checked
                // the list against (or memory submitted unregistered that must
                // stay valid until completion); the kernel checks the remote
                // ones against the peer's address space.
                let failed =
                    unsafe { copy::cma(pool.as_deref(), peer.endpoint.pid, &pieces, parts) };
                match failed.into_iter().min_by_key(|(i, _)| *i) {
                    None => Ok(()),
                    Some((i, why)) => {
                        let p = &pieces[i];
                        let remote = list.remote_addr + list.blocks[i].remote_offset;
                        Err(inst.cma_error(peer, remote, p.len, why))
                    }
                }
            }
        };
        drop(mem);
        inst.completer
            .complete(list.token, result.as_ref().map(|_| ()));
        Ok(())
    }
}
