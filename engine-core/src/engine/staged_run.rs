//! A run whose route is staging: requests between one pair of buffers
//! (request_run.rs) or a transfer by layouts (blocks.rs) whose first block
//! the planner sent to staging. Every block is then staged too, since
//! whether a transport serves depends on the buffers, not on the block.
//! So the blocks become staging items at once, from their offsets, with
//! no planning per block (16,384 staged blocks cost 4.7 ms of planning on
//! an H100 host, most of a batch's submit time), and one staging job runs
//! them. Also where a staging job is started for any submission.
//!
//! Reaches in Shared: none.

use super::dispatch::Flows;
use super::plan::{StagedBlock, StagedItem, StagedWork};
use super::shared::Shared;
use crate::batch::{group_of, Batch};
use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sys::ferry_block_t;
use std::sync::Arc;

/// How a staged run completes in its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion<'a> {
    /// One group for the run's `n` requests (a transfer by layouts
    /// completes once, as it does on a direct route).
    Once(usize),
    /// One group per block, over the requests coalesced into it, given
    /// per block in order (a list of requests: a block that fails fails
    /// its own requests only).
    PerBlock(&'a [usize]),
}

/// The blocks of a staged run: offsets from `local_base` and
/// `remote_base`.
pub(crate) struct StagedRun<'a> {
    /// The planner's item for the first block: buffers, peer, direction
    /// and transport hint, which every block shares.
    pub(crate) first: &'a StagedItem,
    pub(crate) local_base: u64,
    pub(crate) remote_base: u64,
    pub(crate) blocks: &'a [ferry_block_t],
    pub(crate) completion: Completion<'a>,
}

impl Shared {
    /// Reserves the run's requests in `batch`, makes its completion groups
    /// and starts a staging job for its blocks. Fails, with nothing
    /// started, when the local buffer was unregistered meanwhile.
    pub(crate) fn submit_staged_run(
        self: &Arc<Self>,
        batch: &Arc<Batch>,
        run: &StagedRun<'_>,
    ) -> Result<()> {
        let first = &run.first.ends;
        let total: usize = match run.completion {
            Completion::Once(n) => n,
            Completion::PerBlock(counts) => counts.iter().sum(),
        };
        let start = batch.reserve(total)?;
        let mut flows = Flows::new();
        // One group of `count` requests from `at`, carrying `bytes`.
        let mut add = |at: usize, count: usize, bytes: u64| {
            let tally = self.tally(
                &mut flows,
                None,
                first.op,
                &first.local,
                0,
                &first.segment,
                bytes,
            );
            group_of(batch.add_group(at, count, first.local.clone(), tally))
        };
        let groups: Vec<usize> = match run.completion {
            // The staging job completes it once, with its last block.
            Completion::Once(_) => {
                vec![add(start, total, run.blocks.iter().map(|b| b.length).sum())]
            }
            Completion::PerBlock(counts) => {
                batch.reserve_groups(run.blocks.len());
                let mut at = start;
                run.blocks
                    .iter()
                    .zip(counts)
                    .map(|(b, &n)| {
                        at += n;
                        add(at - n, n, b.length)
                    })
                    .collect()
            }
        };
        // As dispatch checks (unregistered_meanwhile): the groups now count
        // in the buffer's inflight, so either it is still registered and
        // its unregister waits for them, or nothing starts.
        if !self.still_registered(&first.local) {
            let e = Error::new(
                ErrorCode::OutOfBounds,
                format!(
                    "the local buffer at {:#x} was unregistered while the blocks were being \
                     submitted",
                    first.local.addr
                ),
            );
            for &g in &groups {
                batch.abort_group(g, e.clone());
            }
            return Err(e);
        }
        let group = |k: usize| match run.completion {
            Completion::Once(_) => groups[0],
            Completion::PerBlock(_) => groups[k],
        };
        let work = StagedWork {
            ends: vec![first.clone()],
            blocks: run
                .blocks
                .iter()
                .enumerate()
                .map(|(k, b)| StagedBlock {
                    group: group(k),
                    ends: 0,
                    local_addr: run.local_base + b.local_offset,
                    remote_addr: run.remote_base + b.remote_offset,
                    length: b.length,
                })
                .collect(),
        };
        self.start_staging(batch, work);
        Ok(())
    }

    /// Runs `work` on a staging thread of its own; when none can start,
    /// each block's group fails.
    pub(crate) fn start_staging(self: &Arc<Self>, batch: &Arc<Batch>, work: StagedWork) {
        if work.blocks.is_empty() {
            return;
        }
        let (me, b) = (self.clone(), batch.clone());
        let mut groups: Vec<usize> = work.blocks.iter().map(|it| it.group).collect();
        // A run's items share one group, completed once.
        groups.dedup();
        let spawned = std::thread::Builder::new()
            .name("ferry-staging".into())
            .spawn(move || me.run_staged(b, work));
        if let Err(e) = spawned {
            let e = Error::new(
                ErrorCode::NoMemory,
                format!("cannot start a staging thread: {e}"),
            );
            for g in groups {
                batch.complete_group(g, Err(e.clone()));
            }
        }
    }
}
