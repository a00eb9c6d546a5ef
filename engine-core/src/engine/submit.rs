//! Submitting a batch: requests between one pair of buffers as one block
//! list (request_run.rs), or staged from their offsets (staged_run.rs);
//! else plan every request, dispatch the plan to the transports, and start
//! a staging job for what must be staged.
//!
//! Reaches in Shared: `batches`, `metrics`.

use super::plan::StagedWork;
use super::request::Request;
use super::shared::Shared;
use crate::batch::BatchId;
use crate::error::Result;
use std::sync::Arc;

impl Shared {
    pub(crate) fn submit(self: &Arc<Self>, batch_id: BatchId, requests: &[Request]) -> Result<()> {
        let batch = self.batches.get(batch_id)?;
        if requests.is_empty() {
            return Ok(());
        }
        // Requests between one pair of buffers: one block list (request_run.rs).
        if let Some(done) = self.submit_run(&batch, requests) {
            return done;
        }
        let plan = self
            .planner()
            .plan(requests, None)
            .inspect_err(|e| self.metrics.refused(e.code, requests.len()))?;
        let staged = self.dispatch(&batch, plan)?;
        self.start_staging(&batch, StagedWork::from_items(staged));
        Ok(())
    }
}
