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

/// How a staged run completes in its batch: as one group either way, so
/// that a list of 16,384 requests is not 16,384 groups (making and
/// finishing them cost a millisecond a batch each on an H100 host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion<'a> {
    /// The run's `n` requests succeed or fail together (a transfer by
    /// layouts completes once, as it does on a direct route).
    Once(usize),
    /// Each block carries the requests coalesced into it, given per block
    /// in order (a list of requests). A block that fails fails its own
    /// requests only; they all finish with the run's last block.
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
    /// Reserves the run's requests in `batch`, makes its completion group
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
        let tally = self.tally(
            &mut flows,
            None,
            first.op,
            &first.local,
            0,
            &first.segment,
            run.blocks.iter().map(|b| b.length).sum(),
        );
        let group = group_of(batch.add_group(start, total, first.local.clone(), tally));
        // As dispatch checks (unregistered_meanwhile): the group now counts
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
            batch.abort_group(group, e.clone());
            return Err(e);
        }
        // Where each block's requests start, for PerBlock (a failed block
        // fails those only).
        let mut at = start;
        let work = StagedWork {
            ends: vec![first.clone()],
            blocks: run
                .blocks
                .iter()
                .enumerate()
                .map(|(k, b)| {
                    let requests = match run.completion {
                        Completion::Once(_) => (0, 0),
                        Completion::PerBlock(counts) => {
                            let n = counts.get(k).copied().unwrap_or(0);
                            at += n;
                            // A batch holds under 2^24 requests (MAX_BATCH_REQUESTS).
                            ((at - n) as u32, n as u32)
                        }
                    };
                    StagedBlock {
                        group,
                        requests,
                        ends: 0,
                        local_addr: run.local_base + b.local_offset,
                        remote_addr: run.remote_base + b.remote_offset,
                        length: b.length,
                    }
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
