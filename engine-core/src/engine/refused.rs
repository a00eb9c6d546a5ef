//! Requests a peer refused as outside its registered memory, waiting for
//! their one retry (retry.rs): what each one was, and the queue a retry
//! thread takes them from, a round at a time.

use super::layouts::recycle_blocks;
use super::request::{Op, SegmentId};
use crate::batch::BatchTable;
use crate::error::Error;
use crate::transport::CompletionSink;
use ferry_plugins_abi::sys::ferry_block_t;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// What a retry needs of a request handed to a transport: plain values,
/// so that completion groups holding it keep no segment or peer alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sent {
    pub(crate) segment: SegmentId,
    pub(crate) transport: usize,
    pub(crate) op: Op,
    pub(crate) local_addr: u64,
    /// The transport's handle of the local buffer (0 for none).
    pub(crate) local_mem: u64,
    pub(crate) remote_addr: u64,
    pub(crate) length: u64,
}

/// The blocks of a list handed over as one, kept for its retry (offsets
/// from its `Sent`'s local and remote addresses), and how its requests lie
/// on them; their memory goes back to the spare lists (layouts.rs) once
/// nothing holds them.
pub(crate) struct SentBlocks {
    pub(crate) blocks: Vec<ferry_block_t>,
    pub(crate) requests: BlockRequests,
}

impl Drop for SentBlocks {
    fn drop(&mut self) {
        recycle_blocks(std::mem::take(&mut self.blocks));
    }
}

/// How the requests of a block list's completion group lie on its blocks,
/// in order: what a retry needs to serve the blocks the peer still
/// registers and fail only the requests of the others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum BlockRequests {
    /// Its requests succeed or fail together (a transfer by layouts).
    #[default]
    Whole,
    /// Block k carries the group's request k.
    One,
    /// Block k carries the group's next `counts[k]` requests (adjacent
    /// requests coalesced into it).
    Counts(Vec<u32>),
}

impl BlockRequests {
    /// Requests per block of `per_block` (in order): One, with nothing
    /// kept, when each block carries one.
    pub(crate) fn from_counts(per_block: impl Iterator<Item = usize> + Clone) -> Self {
        if per_block.clone().all(|n| n == 1) {
            return BlockRequests::One;
        }
        BlockRequests::Counts(
            per_block
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
                .collect(),
        )
    }

    /// The (first request from the group's first, count) of each block in
    /// order; None for a list whose requests go together.
    pub(crate) fn ranges(&self, blocks: usize) -> Option<Vec<(usize, usize)>> {
        match self {
            BlockRequests::Whole => None,
            BlockRequests::One => Some((0..blocks).map(|k| (k, 1)).collect()),
            BlockRequests::Counts(c) if c.len() == blocks => {
                let mut first = 0;
                Some(
                    c.iter()
                        .map(|&n| {
                            let r = (first, n as usize);
                            first += n as usize;
                            r
                        })
                        .collect(),
                )
            }
            BlockRequests::Counts(_) => None,
        }
    }
}

/// A refused request, or block list: its completion group (by token) is
/// still pending.
pub(crate) struct Refused {
    /// For a list: its local and remote bases, and the remote span of its
    /// blocks as the length.
    pub(crate) sent: Sent,
    /// The list's blocks; None for a single request.
    pub(crate) blocks: Option<Arc<SentBlocks>>,
    pub(crate) token: u64,
    pub(crate) error: Error,
}

/// An engine's refused requests, and whether a thread is retrying them.
/// Its batches' groups reach it, so it holds their table weakly.
pub(crate) struct RefusedQueue {
    batches: Weak<BatchTable>,
    /// Waiting requests; true while a thread takes them.
    queue: Mutex<(Vec<Refused>, bool)>,
}

impl RefusedQueue {
    pub(crate) fn new(batches: &Arc<BatchTable>) -> RefusedQueue {
        RefusedQueue {
            batches: Arc::downgrade(batches),
            queue: Mutex::new((Vec::new(), false)),
        }
    }

    /// Queues `r`. True when no thread takes the queue: the caller starts
    /// one, which calls [`RefusedQueue::next_round`] until it returns None.
    pub(crate) fn push(&self, r: Refused) -> bool {
        let mut q = self.queue.lock();
        q.0.push(r);
        !std::mem::replace(&mut q.1, true)
    }

    /// Every request refused so far; None, once none waits (the thread
    /// then stops, and the next refusal starts another).
    pub(crate) fn next_round(&self) -> Option<Vec<Refused>> {
        let mut q = self.queue.lock();
        if q.0.is_empty() {
            q.1 = false;
            return None;
        }
        Some(std::mem::take(&mut q.0))
    }

    /// Finishes a refused request's group with `e`, for good.
    pub(crate) fn fail(&self, token: u64, e: Error) {
        if let Some(batches) = self.batches.upgrade() {
            batches.complete(token, Err(e));
        }
    }

    /// Fails every waiting request with its refusal, and `why` it was not
    /// retried (no thread could take them).
    pub(crate) fn fail_waiting(&self, why: &str) {
        let waiting = {
            let mut q = self.queue.lock();
            q.1 = false;
            std::mem::take(&mut q.0)
        };
        for r in waiting {
            let message = format!("{} (not retried: {why})", r.error.message);
            self.fail(r.token, Error::new(r.error.code, message));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    fn refused(token: u64) -> Refused {
        Refused {
            sent: Sent {
                segment: 1,
                transport: 0,
                op: Op::Write,
                local_addr: 0x1000,
                local_mem: 0,
                remote_addr: 0x2000,
                length: 64,
            },
            blocks: None,
            token,
            error: Error::new(ErrorCode::OutOfBounds, "revoked"),
        }
    }

    #[test]
    fn a_lists_requests_lie_on_its_blocks_in_order() {
        let one = BlockRequests::from_counts([1, 1, 1].into_iter());
        assert_eq!(one, BlockRequests::One);
        assert_eq!(one.ranges(3), Some(vec![(0, 1), (1, 1), (2, 1)]));
        let coalesced = BlockRequests::from_counts([2, 1, 3].into_iter());
        assert_eq!(coalesced.ranges(3), Some(vec![(0, 2), (2, 1), (3, 3)]));
        assert_eq!(coalesced.ranges(2), None, "counts for other blocks");
        assert_eq!(BlockRequests::Whole.ranges(3), None);
    }

    #[test]
    fn one_thread_takes_the_queue_in_rounds_and_the_next_refusal_starts_another() {
        let q = RefusedQueue::new(&Arc::new(BatchTable::default()));
        assert!(q.push(refused(1)), "the first refusal starts a thread");
        assert!(!q.push(refused(2)), "one is taking the queue");
        let round = q.next_round().unwrap();
        assert_eq!(round.iter().map(|r| r.token).collect::<Vec<_>>(), [1, 2]);
        // Refused while the thread retries the first round: the next one.
        assert!(!q.push(refused(3)));
        assert_eq!(q.next_round().unwrap().len(), 1);
        assert!(q.next_round().is_none());
        assert!(q.push(refused(4)), "the thread stopped: another starts");
        q.fail_waiting("no thread");
        assert!(q.next_round().is_none());
        assert!(q.push(refused(5)));
    }
}
