//! A submission whose requests all lie between one pair of buffers (the
//! shape of a KV-cache transfer given as lists of addresses): routed once,
//! by its first request, and each request then checked by two range
//! comparisons instead of lookups and selection, the lot handed over as
//! one block list under one completion group, as a transfer by block
//! layouts is (blocks.rs). Anything else, or anything in doubt, goes the
//! general way (plan, dispatch), which then says what is wrong with which
//! request.
//!
//! Reaches in Shared: `transports`.

use super::dispatch::{BlockGroup, Flows};
use super::layouts::{recycle_blocks, spare_blocks};
use super::plan::{Pending, StagedItem};
use super::refused::BlockRequests;
use super::request::Request;
use super::shared::Shared;
use super::staged_run::{Completion, StagedRun};
use crate::batch::Batch;
use crate::error::Result;
use crate::memory::Visibility;
use ferry_plugins_abi::sys;
use std::sync::Arc;

/// Fewer requests than this go the general way: one block list is worth
/// its set-up only for a run.
pub(crate) const RUN_MIN: usize = 2;

/// The buffers a run lies in: `[local, local_end)` here, `[remote,
/// remote_end)` at the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunBounds {
    pub(crate) local: u64,
    pub(crate) local_end: u64,
    pub(crate) remote: u64,
    pub(crate) remote_end: u64,
}

/// The block list for `requests` (offsets from `b.local` and `b.remote`,
/// requests adjacent on both sides coalesced), when every one has the
/// first's op, segment and transport hint, a length, and lies inside the
/// bounds; `None` at the first that does not. With `counts`, how many
/// requests each block carries, in order.
pub(crate) fn run_blocks(
    requests: &[Request],
    b: RunBounds,
    mut counts: Option<&mut Vec<usize>>,
) -> Option<Vec<sys::ferry_block_t>> {
    let first = requests.first()?;
    let mut blocks = spare_blocks(requests.len());
    for r in requests {
        let fits = r.length != 0
            && r.op == first.op
            && r.segment == first.segment
            && r.local_addr >= b.local
            && r.remote_addr >= b.remote
            && r.local_addr
                .checked_add(r.length)
                .is_some_and(|e| e <= b.local_end)
            && r.remote_addr
                .checked_add(r.length)
                .is_some_and(|e| e <= b.remote_end)
            && r.transport == first.transport;
        if !fits {
            recycle_blocks(blocks);
            return None;
        }
        let (lo, ro) = (r.local_addr - b.local, r.remote_addr - b.remote);
        if let Some(prev) = blocks.last_mut() {
            if prev.local_offset + prev.length == lo && prev.remote_offset + prev.length == ro {
                prev.length += r.length;
                if let Some(n) = counts.as_deref_mut().and_then(|c| c.last_mut()) {
                    *n += 1;
                }
                continue;
            }
        }
        blocks.push(sys::ferry_block_t {
            local_offset: lo,
            remote_offset: ro,
            length: r.length,
        });
        if let Some(c) = counts.as_deref_mut() {
            c.push(1);
        }
    }
    Some(blocks)
}

/// How many of `requests` each of `blocks` (their [`run_blocks`], adjacent
/// ones coalesced, in order) carries.
fn coalesced_counts(requests: &[Request], blocks: &[sys::ferry_block_t]) -> Vec<u32> {
    let mut lengths = requests.iter().map(|r| r.length);
    blocks
        .iter()
        .map(|b| {
            let (mut n, mut sum) = (0u32, 0u64);
            while sum < b.length {
                let Some(l) = lengths.next() else { break };
                sum += l;
                n += 1;
            }
            n
        })
        .collect()
}

impl Shared {
    /// Submits `requests` as one block list when they form one run (see
    /// the module's documentation): `None` when they do not, with nothing
    /// reserved or handed over.
    pub(crate) fn submit_run(
        self: &Arc<Self>,
        batch: &Arc<Batch>,
        requests: &[Request],
    ) -> Option<Result<()>> {
        if requests.len() < RUN_MIN || requests[0].length == 0 {
            return None;
        }
        // The first request routed as any other; an error is left to the
        // general way, which names the request.
        let plan = self
            .planner()
            .plan(std::slice::from_ref(&requests[0]), None)
            .ok()?;
        if let [(_, first)] = plan.staged.as_slice() {
            return self.submit_staged_requests(batch, first, requests);
        }
        let p = plan.routed.first()?;
        let bounds = self.run_bounds(p)?;
        let blocks = run_blocks(requests, bounds, None)?;
        let per_block = if !plan.retry {
            BlockRequests::Whole
        } else if blocks.len() == requests.len() {
            BlockRequests::One
        } else {
            BlockRequests::Counts(coalesced_counts(requests, &blocks))
        };
        let start = match batch.reserve(requests.len()) {
            Ok(s) => s,
            Err(e) => {
                recycle_blocks(blocks);
                return Some(Err(e));
            }
        };
        let list = self.block_group(
            batch,
            &mut Flows::new(),
            BlockGroup {
                start,
                requests: requests.len(),
                segment: &p.segment,
                transport: p.transport,
                op: p.op,
                local: &p.local,
                local_base: bounds.local,
                remote_base: bounds.remote,
                remote_key: &p.remote_key,
                single_requests: false,
                retry: plan.retry,
                requests_per_block: per_block,
            },
            blocks,
        );
        let handed = self.hand_over_if_registered(batch, list, &p.local, |addr| {
            format!(
                "request 0: the local buffer at {addr:#x} was unregistered while the request \
                 was being submitted"
            )
        });
        Some(handed)
    }

    /// A run whose first request the planner staged: every request
    /// between the same two buffers is staged as it is (staged_run.rs),
    /// one group whose blocks each fail their own requests only.
    fn submit_staged_requests(
        self: &Arc<Self>,
        batch: &Arc<Batch>,
        first: &StagedItem,
        requests: &[Request],
    ) -> Option<Result<()>> {
        let bounds = staged_bounds(first)?;
        let mut counts = Vec::with_capacity(requests.len());
        let blocks = run_blocks(requests, bounds, Some(&mut counts))?;
        let run = StagedRun {
            first,
            local_base: bounds.local,
            remote_base: bounds.remote,
            blocks: &blocks,
            completion: Completion::PerBlock(&counts),
        };
        let done = self.submit_staged_run(batch, &run);
        recycle_blocks(blocks);
        Some(done)
    }

    /// The buffers the first request of a run was routed between, when a
    /// run between them may go as one block list: its transport takes
    /// lists, the local buffer is registered, and the peer's buffer is the
    /// one whose key the route carries.
    fn run_bounds(&self, p: &Pending) -> Option<RunBounds> {
        let t = &self.transports[p.transport];
        if !t.takes_block_lists() || p.local.visibility == Visibility::Unregistered {
            return None;
        }
        let view = p.segment.view.read().clone();
        let i = view.find(p.remote_addr, p.length)?;
        let buffer = &view.buffers[i];
        if buffer.keys.get(t.name.as_str()).map(|k| &**k) != Some(&*p.remote_key) {
            return None;
        }
        Some(RunBounds {
            local: p.local.addr,
            local_end: p.local.end(),
            remote: buffer.addr,
            remote_end: buffer.addr.checked_add(buffer.len)?,
        })
    }
}

/// The buffers a staged item lies between: its local buffer, and the
/// peer's published buffer holding its remote range.
pub(crate) fn staged_bounds(it: &StagedItem) -> Option<RunBounds> {
    let view = it.ends.segment.view.read().clone();
    let buffer = &view.buffers[view.find(it.remote_addr, it.length)?];
    Some(RunBounds {
        local: it.ends.local.addr,
        local_end: it.ends.local.end(),
        remote: buffer.addr,
        remote_end: buffer.addr.checked_add(buffer.len)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::Op;

    const B: RunBounds = RunBounds {
        local: 0x10_0000,
        local_end: 0x20_0000,
        remote: 0x1000,
        remote_end: 0x11000,
    };

    fn req(l: u64, r: u64, n: u64) -> Request {
        Request::new(Op::Write, B.local + l, 7, B.remote + r, n)
    }

    #[test]
    fn a_run_becomes_offsets_with_neighbours_coalesced() {
        let reqs = [
            req(0x3000, 0x0, 0x1000),
            req(0x4000, 0x1000, 0x1000), // continues both sides
            req(0x0, 0x8000, 0x1000),
            req(0x2000, 0x9000, 0x800), // continues the remote side only
        ];
        let blocks = run_blocks(&reqs, B, None).unwrap();
        let got: Vec<_> = blocks
            .iter()
            .map(|b| (b.local_offset, b.remote_offset, b.length))
            .collect();
        assert_eq!(
            got,
            [
                (0x3000, 0x0, 0x2000),
                (0x0, 0x8000, 0x1000),
                (0x2000, 0x9000, 0x800)
            ]
        );
        // How many requests each block carries, counted as the run goes
        // and afterwards from the lengths (a refused list's retry).
        let mut counts = Vec::new();
        run_blocks(&reqs, B, Some(&mut counts)).unwrap();
        assert_eq!(counts, [2, 1, 1]);
        assert_eq!(coalesced_counts(&reqs, &blocks), [2, 1, 1]);
    }

    #[test]
    fn anything_outside_or_unlike_the_first_is_not_a_run() {
        let good = req(0, 0, 0x1000);
        let mut other_op = req(0x1000, 0x1000, 16);
        other_op.op = Op::Read;
        let mut other_segment = req(0x1000, 0x1000, 16);
        other_segment.segment = 8;
        let mut hinted = req(0x1000, 0x1000, 16);
        hinted.transport = Some("tcp".into());
        for bad in [
            req(0x1000, 0x10000 - 8, 16), // past the peer's buffer
            req(0x10_0000 - 8, 0, 16),    // past the local one
            Request::new(Op::Write, B.local - 1, 7, B.remote, 2), // before it
            Request::new(Op::Write, B.local, 7, B.remote - 1, 2), // before the peer's
            Request::new(Op::Write, u64::MAX - 1, 7, B.remote, 4), // wraps
            req(0x1000, 0x1000, 0),       // empty
            other_op,
            other_segment,
            hinted,
        ] {
            assert!(
                run_blocks(&[good.clone(), bad.clone()], B, None).is_none(),
                "{bad:?}"
            );
        }
        assert!(run_blocks(&[good.clone(), good], B, None).is_some());
    }
}
