//! Notifications out and in: a batch's message sent to its peer once the
//! batch's data has landed, and the messages peers sent this engine.
//!
//! Why the message never arrives before the data, on every transport: the
//! engine sends it only after every request of the batch has completed,
//! and a transport completes a request only once its bytes are in the
//! peer's memory: tcp when the target has received them into the buffer
//! and answered; shm when its memcpy or process_vm_writev has returned
//! (the copy itself is the write, done by this process or the kernel before
//! completion); rdma when the RC queue pair's completion arrives, which the
//! responder acknowledges only after placing the data; staged device memory
//! when the peer has synchronized its device copy and answered StageDone.
//! So by the time the message is even sent, the data is in place; the
//! message then travels over a control connection (TCP), which the target
//! reads after that, and the syscalls and locks between the writes and the
//! target's read of the message order memory for its threads. (A GPU kernel
//! reading device memory that a NIC wrote needs the usual GPU-direct flush;
//! that is the consumer's, as with any RDMA write.) A failed request means
//! the data did not all land: the message is then not sent, and the batch
//! reports why.
//!
//! One thread per engine ("ferry-notify", started on first use; see
//! [`Notifier`](crate::notify::Notifier)) sends the messages, in the order
//! their batches finished, over control connections it keeps per peer; the
//! receiving side queues them in the engine's bounded inbox (its drop
//! policy is in crate::notify).
//!
//! Reaches in Shared: `batches`, `config`, `node`, `notifier`, `segments`.

use super::request::{Request, SegmentId};
use super::segments::RemoteSegment;
use super::shared::Shared;
use crate::batch::{Batch, BatchId};
use crate::control::MsgType;
use crate::error::{Error, ErrorCode, Result};
use crate::notify::{decode_notify, encode_notify, Notification, Notify, Outgoing};
use std::sync::mpsc;
use std::sync::Arc;

impl Shared {
    /// Submits `requests` to a batch and attaches `notify`, which goes to
    /// the requests' peer once all of the batch's requests have finished.
    pub(crate) fn submit_with_notify(
        self: &Arc<Self>,
        batch_id: BatchId,
        requests: &[Request],
        notify: Notify,
    ) -> Result<()> {
        let batch = self.batches.get(batch_id)?;
        let first = requests.first().ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                "a notification goes to the peer of its batch's requests, and there are none \
                 (send_notify sends one alone)",
            )
        })?;
        if let Some(other) = requests.iter().find(|r| r.segment != first.segment) {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "a notification goes to one peer, but the requests name segments {} and {} \
                     (submit them in one batch per peer)",
                    first.segment, other.segment
                ),
            ));
        }
        let seg = self.segments.get(first.segment)?;
        batch.check_takes_requests()?;
        self.submit(batch_id, requests)?;
        self.attach_notify(&batch, &seg, notify)
    }

    /// Sends `notify` to a segment alone (no data) and waits until it was
    /// delivered or failed.
    pub(crate) fn send_notify(self: &Arc<Self>, segment: SegmentId, notify: Notify) -> Result<()> {
        let seg = self.segments.get(segment)?;
        let batch = self.batches.allocate(1)?;
        self.attach_notify(&batch, &seg, notify)?;
        let status = self.wait(&batch, self.config.timeout * 2);
        let _ = self.batches.free(batch.id);
        match status.notify {
            Some(crate::batch::NotifyStatus::Failed(e)) => Err(e),
            Some(crate::batch::NotifyStatus::Delivered) => Ok(()),
            _ => Err(Error::new(
                ErrorCode::Timeout,
                format!("notification to {} not delivered in time", seg.name),
            )),
        }
    }

    fn attach_notify(&self, batch: &Arc<Batch>, seg: &RemoteSegment, notify: Notify) -> Result<()> {
        let job = Outgoing {
            batch: Arc::downgrade(batch),
            peer: seg.name.clone(),
            control: seg.view.read().descriptor.control_addr().to_string(),
            body: encode_notify(&self.node.name, &notify),
        };
        let tx = self.notifier.outbox(&self.node.link)?;
        let weak = Arc::downgrade(batch);
        batch.attach_notify(Box::new(move |first_error| {
            let failed = match first_error {
                Some((i, e)) => Error::new(
                    e.code,
                    format!(
                        "notification to {} not sent: request {i} failed, so not all of the \
                         batch's data reached the peer ({})",
                        job.peer, e.message
                    ),
                ),
                None => match tx.send(job) {
                    Ok(()) => return,
                    Err(mpsc::SendError(job)) => Error::new(
                        ErrorCode::Internal,
                        format!(
                            "notification to {} not sent: the notification thread ended",
                            job.peer
                        ),
                    ),
                },
            };
            if let Some(b) = weak.upgrade() {
                b.finish_notify(Err(failed));
            }
        }))
    }

    /// A peer's notification arrived on the control plane: queue it for
    /// the application, or refuse it (BUSY) when the inbox is full.
    pub(crate) fn receive_notify(&self, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let n: Notification = decode_notify(body)?;
        self.notifier.inbox.push(n)?;
        Ok((MsgType::NotifyAck, Vec::new()))
    }
}
