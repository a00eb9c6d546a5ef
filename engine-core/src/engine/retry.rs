//! Requests a peer refused as outside its registered memory, retried once.
//!
//! A peer that unregisters a buffer and registers the same addresses again
//! (vLLM's sleep and wake-up, a weight update) publishes a new key for it,
//! and its transports refuse the old one for good: shm and cuda-ipc revoke
//! the registration id, RDMA NICs the rkey, each reporting
//! FERRY_ERR_OUT_OF_BOUNDS. Such a refusal does not fail the request: its
//! group is handed here (batch.rs's `Retry`), the peer's descriptor is read
//! again (once per round for every request refused before the read began,
//! so each one sees what the peer registered after its refusal), and the
//! request is submitted again on the same transport and completion group
//! with the key the peer now publishes for its range. The second result is
//! final: a request is retried once. A block list (requests between one
//! pair of buffers, handed over as one) is retried the same way, as a
//! whole: it keeps its blocks until it completes. Where no one buffer of
//! the new view holds all its blocks (the peer registered a smaller one,
//! or two), a list of requests is served in part: the blocks inside
//! buffers the peer registers now go again, a list per buffer under the
//! same group, and the requests of the others fail, each with its own
//! status (a transfer by layouts fails whole: its requests go together).
//! The new view serves
//! later submissions too, and replacing a view drops the segment's
//! remembered routes and acceptance verdicts (segments.rs), so none keeps
//! the revoked key.
//!
//! Reaches in Shared: `batches`, `node`, `segments`, `transports`.

use super::layouts::spare_blocks;
use super::plan::Pending;
use super::refused::{BlockRequests, Refused, RefusedQueue, Sent, SentBlocks};
use super::request::SegmentId;
use super::segments::{RemoteSegment, RemoteView};
use super::shared::Shared;
use crate::batch::Retry;
use crate::error::{Error, ErrorCode, Result};
use crate::transport::CompletionSink;
use ferry_plugins_abi::sys;
use smallvec::SmallVec;
use std::sync::{Arc, Weak};

/// One dispatch's routed requests, kept for a retry of any the peer
/// refuses.
pub(crate) struct Resend {
    engine: Weak<Shared>,
    queue: Arc<RefusedQueue>,
    sent: SmallVec<[Sent; 1]>,
}

impl Resend {
    pub(crate) fn new(engine: &Arc<Shared>, routed: &[Pending]) -> Resend {
        Resend {
            engine: Arc::downgrade(engine),
            queue: engine.refused.clone(),
            sent: routed
                .iter()
                .map(|p| Sent {
                    segment: p.segment.id,
                    transport: p.transport,
                    op: p.op,
                    local_addr: p.local_addr,
                    local_mem: p.local.registration(p.transport).map_or(0, |r| r.handle),
                    remote_addr: p.remote_addr,
                    length: p.length,
                })
                .collect(),
        }
    }
}

impl Retry for Resend {
    fn retry(self: Arc<Self>, token: u64, index: usize, error: Error) {
        let Some(&sent) = self.sent.get(index) else {
            return self.queue.fail(token, error);
        };
        let refused = Refused {
            sent,
            blocks: None,
            token,
            error,
        };
        queue_refused(&self.engine, &self.queue, refused);
    }
}

/// A block list handed over as one, kept for one retry: its blocks lie
/// inside one buffer of the peer, and a refused list is submitted again as
/// a list, with the key the peer publishes for that range now, or in part
/// (see the module's documentation).
pub(crate) struct ResendList {
    engine: Weak<Shared>,
    queue: Arc<RefusedQueue>,
    /// Its local and remote bases; the length is worked out from the blocks
    /// when it is refused.
    sent: Sent,
    blocks: Arc<SentBlocks>,
}

impl ResendList {
    /// Takes `blocks` (offsets from `sent`'s addresses) for as long as the
    /// list may be retried, and how its group's requests lie on them.
    pub(crate) fn new(
        engine: &Arc<Shared>,
        sent: Sent,
        blocks: Vec<sys::ferry_block_t>,
        requests: BlockRequests,
    ) -> Self {
        ResendList {
            engine: Arc::downgrade(engine),
            queue: engine.refused.clone(),
            sent,
            blocks: Arc::new(SentBlocks { blocks, requests }),
        }
    }

    pub(crate) fn blocks(&self) -> &[sys::ferry_block_t] {
        &self.blocks.blocks
    }
}

impl Retry for ResendList {
    fn retry(self: Arc<Self>, token: u64, _index: usize, error: Error) {
        let span = self
            .blocks()
            .iter()
            .map(|b| b.remote_offset.saturating_add(b.length))
            .max()
            .unwrap_or(0);
        let refused = Refused {
            sent: Sent {
                length: span,
                ..self.sent
            },
            blocks: Some(self.blocks.clone()),
            token,
            error,
        };
        queue_refused(&self.engine, &self.queue, refused);
    }
}

/// Queues a refusal, starting the thread that retries the queue's rounds
/// when none runs.
fn queue_refused(engine: &Weak<Shared>, queue: &Arc<RefusedQueue>, refused: Refused) {
    if !queue.push(refused) {
        return;
    }
    let (engine, taken) = (engine.clone(), queue.clone());
    let spawned = std::thread::Builder::new()
        .name("ferry-retry".into())
        .spawn(move || {
            while let Some(round) = taken.next_round() {
                match engine.upgrade() {
                    Some(shared) => shared.retry_round(round),
                    None => round.into_iter().for_each(|r| taken.fail(r.token, r.error)),
                }
            }
        });
    if let Err(e) = spawned {
        queue.fail_waiting(&format!("cannot start a thread: {e}"));
    }
}

/// One request or block list to submit again: what was sent, its blocks
/// for a list, its completion token and the key it now carries.
type Resent = (Sent, Option<Arc<SentBlocks>>, u64, Arc<[u8]>);

/// Requests and lists to submit again to one (segment, transport).
type Again = ((SegmentId, usize), SmallVec<[Resent; 4]>);

/// A sub-list of a list served in part: the index of the peer's buffer
/// holding its blocks, that buffer's key, and the blocks.
type Part = (usize, Arc<[u8]>, Vec<sys::ferry_block_t>);

/// A segment and its view just read, or why it could not be read.
type Seen = Result<(Arc<RemoteSegment>, Arc<RemoteView>)>;

impl Shared {
    /// Reads again the descriptor of every segment in `round` (each request
    /// in it was refused before this point) and submits each request again
    /// with the key its range has now, or fails it saying why not.
    fn retry_round(&self, round: Vec<Refused>) {
        let mut views: SmallVec<[(SegmentId, Seen); 1]> = SmallVec::new();
        let mut again: SmallVec<[Again; 1]> = SmallVec::new();
        for r in &round {
            let s = r.sent;
            let seen = match views.iter().find(|(id, _)| *id == s.segment) {
                Some((_, v)) => v.clone(),
                None => {
                    let v = self.segments.get(s.segment).and_then(|seg| {
                        let n = round.iter().filter(|o| o.sent.segment == s.segment).count();
                        log::info!(
                            "segment {}: {n} requests refused as outside its registered memory \
                             ({}); reading its descriptor again to retry them once",
                            seg.name,
                            r.error.message
                        );
                        let view = self.segments.refresh(&seg, &self.node)?;
                        Ok((seg, view))
                    });
                    views.push((s.segment, v.clone()));
                    v
                }
            };
            if let (Some(blocks), Ok((seg, view))) = (&r.blocks, &seen) {
                if view.find(s.remote_addr, s.length).is_none() {
                    if let Some(ranges) = blocks.requests.ranges(blocks.blocks.len()) {
                        self.serve_in_part(r, blocks, &ranges, seg, view, &mut again);
                        continue;
                    }
                }
            }
            match self.current_key(&s, seen, &r.error) {
                Ok(key) => resend(&mut again, (s, r.blocks.clone(), r.token, key)),
                Err(e) => self.batches.complete(r.token, Err(e)),
            }
        }
        for ((segment, transport), list) in again {
            self.submit_again(segment, transport, &list);
        }
    }

    /// A refused list of requests no one buffer of the peer's new `view`
    /// holds: its blocks inside buffers the peer registers now for the
    /// list's transport go again, a list per buffer under the list's group
    /// (queued on `again`), and the requests of the other blocks fail, each
    /// range of them with its own error, when the group completes.
    fn serve_in_part(
        &self,
        r: &Refused,
        blocks: &SentBlocks,
        ranges: &[(usize, usize)],
        seg: &RemoteSegment,
        view: &RemoteView,
        again: &mut SmallVec<[Again; 1]>,
    ) {
        let s = r.sent;
        let name = self.transports[s.transport].name.as_str();
        let outside = Error::new(
            r.error.code,
            format!(
                "{}; segment {} no longer registers this request's remote range with {name} \
                 (its descriptor, read again after the refusal, has {} buffers)",
                r.error.message,
                seg.name,
                view.buffers.len()
            ),
        );
        let mut parts: SmallVec<[Part; 2]> = SmallVec::new();
        let mut failed: Vec<(usize, usize, u64, Error)> = Vec::new();
        for (b, &(first, n)) in blocks.blocks.iter().zip(ranges) {
            let addr = s.remote_addr.saturating_add(b.remote_offset);
            let held = view
                .find(addr, b.length)
                .and_then(|i| Some((i, view.buffers[i].keys.get(name)?)));
            let Some((i, key)) = held else {
                match failed.last_mut() {
                    Some((at, m, bytes, _)) if *at + *m == first => {
                        *m += n;
                        *bytes += b.length;
                    }
                    _ => failed.push((first, n, b.length, outside.clone())),
                }
                continue;
            };
            let block = sys::ferry_block_t {
                local_offset: b.local_offset,
                remote_offset: addr - view.buffers[i].addr,
                length: b.length,
            };
            match parts.iter_mut().find(|(j, ..)| *j == i) {
                Some((.., list)) => list.push(block),
                None => {
                    // Room for every block in the first part only: a peer
                    // may now register many small buffers.
                    let mut list = spare_blocks(if parts.is_empty() {
                        blocks.blocks.len()
                    } else {
                        0
                    });
                    list.push(block);
                    parts.push((i, key.clone(), list));
                }
            }
        }
        let served: usize = parts.iter().map(|(.., l)| l.len()).sum();
        log::info!(
            "segment {}: {served} of a refused list's {} blocks lie in buffers it registers \
             now and go again; the requests of the other {} fail",
            seg.name,
            blocks.blocks.len(),
            blocks.blocks.len() - served
        );
        // No part: nothing goes again. Otherwise the group now ends with
        // its parts' completions (false only were it already done).
        if parts.is_empty() || !self.batches.split_group(r.token, parts.len(), failed) {
            return self.batches.complete(r.token, Err(outside));
        }
        for (i, key, list) in parts {
            let buffer = &view.buffers[i];
            let sent = Sent {
                remote_addr: buffer.addr,
                length: buffer.len,
                ..s
            };
            let blocks = SentBlocks {
                blocks: list,
                requests: BlockRequests::Whole,
            };
            resend(again, (sent, Some(Arc::new(blocks)), r.token, key));
        }
    }

    /// The key the peer publishes now for the remote range and transport of
    /// `s`, in its view just read; or the refusal, saying why it stands.
    fn current_key(&self, s: &Sent, seen: Seen, refused: &Error) -> Result<Arc<[u8]>> {
        let fail = |why: String| Error::new(refused.code, format!("{}; {why}", refused.message));
        let (seg, view) = seen.map_err(|e| {
            fail(format!(
                "reading the peer's descriptor again to retry failed: {e}"
            ))
        })?;
        let range = format!(
            "[{:#x}, {:#x})",
            s.remote_addr,
            s.remote_addr.saturating_add(s.length)
        );
        let Some(b) = view.find(s.remote_addr, s.length) else {
            return Err(fail(format!(
                "segment {} no longer registers {range} (its descriptor, read again after the \
                 refusal, has {} buffers)",
                seg.name,
                view.buffers.len()
            )));
        };
        let name = &self.transports[s.transport].name;
        view.buffers[b].keys.get(name).cloned().ok_or_else(|| {
            fail(format!(
                "segment {} registers {range} again, but not with {name}",
                seg.name
            ))
        })
    }

    /// Submits refused requests and lists of one (segment, transport)
    /// again, with the keys read just now, under their own completion
    /// groups.
    fn submit_again(&self, segment: SegmentId, transport: usize, list: &[Resent]) {
        let raw: SmallVec<[sys::ferry_transfer_request_t; 4]> = list
            .iter()
            .filter(|(_, blocks, ..)| blocks.is_none())
            .map(|(s, _, token, key)| sys::ferry_transfer_request_t {
                op: s.op.raw(),
                reserved: 0,
                local_addr: s.local_addr,
                local_mem: s.local_mem,
                remote_addr: s.remote_addr,
                length: s.length,
                remote_key: key.as_ptr(),
                remote_key_len: key.len(),
                token: *token,
            })
            .collect();
        let t = &self.transports[transport];
        let fail_all = |e: &Error| {
            for (_, _, token, _) in list {
                self.batches.complete(*token, Err(retry_failed(e)));
            }
        };
        let seg = match self.segments.get(segment) {
            Ok(seg) => seg,
            Err(e) => return fail_all(&e),
        };
        let broken = |e: &Error| {
            if e.code == ErrorCode::Connection {
                seg.forget_peer(transport);
            }
        };
        let peer = match seg.peer(transport, t) {
            Ok(peer) => peer,
            Err(e) => {
                broken(&e);
                return fail_all(&e);
            }
        };
        if !raw.is_empty() {
            if let Err(e) = t.submit(&peer, &raw) {
                broken(&e);
                for r in &raw {
                    self.batches.complete(r.token, Err(retry_failed(&e)));
                }
            }
        }
        for (s, blocks, token, key) in list {
            let Some(blocks) = blocks else { continue };
            let raw = sys::ferry_block_list_t {
                op: s.op.raw(),
                reserved: 0,
                local_addr: s.local_addr,
                local_mem: s.local_mem,
                remote_addr: s.remote_addr,
                remote_key: key.as_ptr(),
                remote_key_len: key.len(),
                blocks: blocks.blocks.as_ptr(),
                count: blocks.blocks.len(),
                token: *token,
            };
            if let Err(e) = t.submit_blocks(&peer, &raw) {
                broken(&e);
                self.batches.complete(*token, Err(retry_failed(&e)));
            }
        }
    }
}

/// Queues `resent` to be submitted again with the others of its (segment,
/// transport).
fn resend(again: &mut SmallVec<[Again; 1]>, resent: Resent) {
    let target = (resent.0.segment, resent.0.transport);
    match again.iter_mut().find(|(k, _)| *k == target) {
        Some((_, list)) => list.push(resent),
        None => again.push((target, smallvec::smallvec![resent])),
    }
}

/// What a retry's own failure says.
fn retry_failed(e: &Error) -> Error {
    Error::new(e.code, format!("retrying a refused request: {}", e.message))
}
