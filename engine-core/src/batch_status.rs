//! What a caller reads of a batch: each request's state, the batch's
//! summary and its notification's fate (batch.rs keeps them).

use crate::error::Error;

/// The state of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Pending,
    Completed,
    Failed(Error),
}

/// A summary of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// Requests submitted so far.
    pub total: usize,
    pub completed: usize,
    pub failed: usize,
    pub pending: usize,
    /// The first request that failed, by index, and why.
    pub first_error: Option<(usize, Error)>,
    /// The batch's notification to its peer, if it carries one.
    pub notify: Option<NotifyStatus>,
}

impl BatchStatus {
    /// Every request finished, and the notification (if any) was
    /// delivered or failed.
    pub fn is_done(&self) -> bool {
        self.pending == 0 && self.notify != Some(NotifyStatus::Pending)
    }

    pub fn succeeded(&self) -> bool {
        self.is_done() && self.failed == 0 && !matches!(self.notify, Some(NotifyStatus::Failed(_)))
    }
}

/// What became of a batch's notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotifyStatus {
    /// Requests still in flight, or the message on its way.
    Pending,
    /// The peer has it queued for its application.
    Delivered,
    /// Not delivered: a request failed (the data did not all land, so the
    /// message was not sent), the peer was unreachable, or it refused.
    Failed(Error),
}
