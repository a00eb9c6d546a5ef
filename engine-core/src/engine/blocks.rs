//! Transfers by block layout: a pool's layout is registered once, and a
//! transfer names blocks by index on both sides. The indices are checked
//! and turned into one block list; the route is chosen once for the whole
//! list (its buffers are the same for every block); a transport that takes
//! block lists gets it in one call and completes it once, and any other
//! gets the blocks as requests in one call, completed as one group.
//!
//! Reaches in Shared: `batches`, `layouts`, `memory`, `node`, `segments`, `transports`.

use super::dispatch::{BlockGroup, Flows};
use super::layouts::{
    check_transfer, checked_block_list, layout_list, recycle_blocks, unknown, BlockLayout, LayoutId,
};
use super::plan::StagedItem;
use super::refused::BlockRequests;
use super::request::{Op, Request, SegmentId};
use super::request_run::staged_bounds;
use super::segments::RemoteSegment;
use super::shared::Shared;
use super::staged_run::{Completion, StagedRun};
use crate::batch::{Batch, BatchId};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::Visibility;
use std::sync::Arc;

/// One transfer by layouts.
#[derive(Clone, Copy, Debug)]
pub struct BlockTransfer<'a> {
    pub op: Op,
    pub segment: SegmentId,
    pub local: LayoutId,
    pub local_ids: &'a [u64],
    pub remote: LayoutId,
    pub remote_ids: &'a [u64],
    /// Use this transport if it can serve the blocks (else an error).
    pub transport: Option<&'a str>,
}

impl Shared {
    /// Registers a layout of registered memory and publishes it.
    pub(crate) fn register_layout(&self, layout: BlockLayout) -> Result<LayoutId> {
        let extent = layout.extent()?;
        match self.memory.find(layout.base, extent) {
            Some(b) if b.visibility == Visibility::Published => {}
            _ => {
                return Err(Error::new(
                    ErrorCode::OutOfBounds,
                    format!(
                        "layout [{:#x}, {:#x}) is not inside one buffer registered with this \
                         engine: register the pool's memory first",
                        layout.base,
                        layout.base + extent
                    ),
                ))
            }
        }
        let id = self.layouts.add(layout)?;
        self.publish();
        Ok(id)
    }

    pub(crate) fn unregister_layout(&self, id: LayoutId) -> Result<()> {
        self.layouts.remove(id)?;
        self.publish();
        Ok(())
    }

    /// A peer's layout by id, re-reading its descriptor once when it is
    /// not (yet) known.
    fn remote_layout(&self, seg: &RemoteSegment, id: LayoutId) -> Result<BlockLayout> {
        let find = |seg: &RemoteSegment| {
            seg.view
                .read()
                .descriptor
                .layouts
                .iter()
                .find(|l| l.id == id)
                .map(BlockLayout::from_descriptor)
        };
        let found = match find(seg) {
            Some(l) => l,
            None => {
                self.segments.refresh(seg, &self.node)?;
                find(seg).ok_or_else(|| unknown(id, &format!("segment {}", seg.name)))?
            }
        };
        // A peer's numbers are checked before any block offset is computed
        // from them (an overflowing stride must not wrap into other memory).
        found.extent().map_err(|e| {
            Error::new(
                ErrorCode::Protocol,
                format!(
                    "segment {} publishes layout {id} as {}",
                    seg.name, e.message
                ),
            )
        })?;
        Ok(found)
    }

    /// Adds the blocks of `t` to a batch and starts them: one request per
    /// block index pair, in order. Nothing is submitted when an index is out
    /// of range or a layout is unknown.
    pub(crate) fn submit_blocks(
        self: &Arc<Self>,
        batch_id: BatchId,
        t: &BlockTransfer<'_>,
    ) -> Result<()> {
        let batch = self.batches.get(batch_id)?;
        let local = self.layouts.get(t.local)?;
        let seg = self.segments.get(t.segment)?;
        let remote = self.remote_layout(&seg, t.remote)?;
        check_transfer(&local, t.local_ids, &remote, t.remote_ids)?;
        let (Some(&first_local), Some(&first_remote)) = (t.local_ids.first(), t.remote_ids.first())
        else {
            return Ok(());
        };
        // The route of the first block is the route of every block when
        // both layouts lie inside the buffers it was found in.
        let mut probe = Request::new(
            t.op,
            local.base + first_local * local.stride,
            t.segment,
            remote.base + first_remote * remote.stride,
            local.block_size,
        );
        probe.transport = t.transport.map(Arc::from);
        let plan = self.planner().plan(std::slice::from_ref(&probe), None)?;
        let whole = plan.routed.first().filter(|p| {
            let view = seg.view.read().clone();
            let remote_ok = remote
                .extent()
                .ok()
                .and_then(|e| view.find(remote.base, e))
                .and_then(|i| {
                    view.buffers[i]
                        .keys
                        .get(self.transports[p.transport].name.as_str())
                })
                .is_some_and(|k| **k == *p.remote_key);
            let local_ok = local
                .extent()
                .is_ok_and(|e| local.base >= p.local.addr && local.base + e <= p.local.end());
            remote_ok && local_ok
        });
        let Some(p) = whole else {
            if let [(_, first)] = plan.staged.as_slice() {
                // Staged, both layouts inside the buffers of the first
                // block: every block is staged as it is (staged_run.rs).
                if let Some(done) = self.submit_staged_layouts(&batch, first, t, &local, &remote) {
                    return done;
                }
            }
            // Layouts across several buffers: one request per (coalesced)
            // block, each planned.
            let blocks = checked_block_list(&local, t.local_ids, &remote, t.remote_ids);
            let requests: Vec<Request> = blocks
                .iter()
                .map(|b| {
                    let mut r = Request::new(
                        t.op,
                        local.base + b.local_offset,
                        t.segment,
                        remote.base + b.remote_offset,
                        b.length,
                    );
                    r.transport = probe.transport.clone();
                    r
                })
                .collect();
            return self.submit(batch_id, &requests);
        };
        let start = batch.reserve(t.local_ids.len())?;
        let transport = &self.transports[p.transport];
        let group = BlockGroup {
            start,
            requests: t.local_ids.len(),
            segment: &p.segment,
            transport: p.transport,
            op: t.op,
            local: &p.local,
            local_base: local.base,
            remote_base: remote.base,
            remote_key: &p.remote_key,
            // A transport without block lists gets the same blocks as
            // single requests, in one call, under one completion group.
            single_requests: !transport.takes_block_lists(),
            retry: plan.retry,
            // A transfer by layouts succeeds or fails as one.
            requests_per_block: BlockRequests::Whole,
        };
        let list = if transport.takes_layout_lists() {
            // The transport computes the addresses where the bytes move
            // (cuda-ipc: on the GPU): the index arrays go as they are.
            let layouts = layout_list(
                t.op.raw(),
                &local,
                t.local_ids,
                &remote,
                t.remote_ids,
                &p.remote_key,
            );
            let bytes = t.local_ids.len() as u64 * local.block_size;
            self.layout_group(&batch, &mut Flows::new(), group, layouts, bytes)
        } else {
            let blocks = checked_block_list(&local, t.local_ids, &remote, t.remote_ids);
            self.block_group(&batch, &mut Flows::new(), group, blocks)
        };
        self.hand_over_if_registered(&batch, list, &p.local, |addr| {
            format!(
                "the local buffer at {addr:#x} was unregistered while the blocks were being \
                 submitted"
            )
        })
    }

    /// A transfer by layouts whose first block is staged, as one staged
    /// run completing once; None when a layout reaches past the buffers of
    /// the first block (each block is then planned alone).
    fn submit_staged_layouts(
        self: &Arc<Self>,
        batch: &Arc<Batch>,
        first: &StagedItem,
        t: &BlockTransfer<'_>,
        local: &BlockLayout,
        remote: &BlockLayout,
    ) -> Option<Result<()>> {
        let bounds = staged_bounds(first)?;
        let inside = |l: &BlockLayout, start: u64, end: u64| {
            l.extent()
                .ok()
                .and_then(|e| l.base.checked_add(e))
                .is_some_and(|e| l.base >= start && e <= end)
        };
        if !inside(local, bounds.local, bounds.local_end)
            || !inside(remote, bounds.remote, bounds.remote_end)
        {
            return None;
        }
        let blocks = checked_block_list(local, t.local_ids, remote, t.remote_ids);
        let run = StagedRun {
            first,
            local_base: local.base,
            remote_base: remote.base,
            blocks: &blocks,
            completion: Completion::Once(t.local_ids.len()),
        };
        let done = self.submit_staged_run(batch, &run);
        recycle_blocks(blocks);
        Some(done)
    }
}
