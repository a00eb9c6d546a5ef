//! The engine handle Python holds. Every call that may block (start,
//! registration, opening a segment, submitting, waiting) runs with the GIL
//! released, so other Python threads keep running while bytes move.
//!
//! Transport preference (Mooncake's `protocol`) is the engine's `prefer`
//! setting, the same rule for Rust, C and Python (engine-core's selection):
//! this module keeps no routing policy of its own.

use crate::addrs::{recycle, AddrList};
use crate::errors::{ferry_err, invalid};
use ferry_core::{
    BatchId, BatchStatus, BlockLayout, BlockTransfer, Engine, EngineConfig, Error, ErrorCode,
    Notify, NotifyStatus, Op, Request,
};
use parking_lot::RwLock;
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Duration;

/// (total, completed, failed, pending, first error as (index, code, name,
/// message)).
type StatusTuple = (
    usize,
    usize,
    usize,
    usize,
    Option<(usize, i32, &'static str, String)>,
);

fn status_tuple(s: BatchStatus) -> StatusTuple {
    (
        s.total,
        s.completed,
        s.failed,
        s.pending,
        s.first_error
            .map(|(i, e)| (i, e.code.as_raw(), e.code.name(), e.message)),
    )
}

fn parse_op(py: Python<'_>, op: &str) -> PyResult<Op> {
    match op {
        "read" | "READ" => Ok(Op::Read),
        "write" | "WRITE" => Ok(Op::Write),
        other => Err(invalid(
            py,
            format!("op {other:?}: expected \"read\" or \"write\""),
        )),
    }
}

/// A layout as Python sees it: (id, base, block_size, stride, count).
type LayoutTuple = (u32, u64, u64, u64, u64);

#[pyclass(name = "NativeEngine", module = "ferry", frozen)]
pub struct NativeEngine {
    engine: RwLock<Option<Arc<Engine>>>,
}

impl NativeEngine {
    fn get(&self, py: Python<'_>) -> PyResult<Arc<Engine>> {
        self.engine
            .read()
            .clone()
            .ok_or_else(|| invalid(py, "this engine is closed"))
    }

    /// Allocates a batch and submits `reqs` to it (with `notify` attached,
    /// if given); the batch is freed again when the submit is refused.
    fn submit_batch(
        &self,
        engine: &Engine,
        reqs: Vec<Request>,
        notify: Option<Notify>,
    ) -> Result<BatchId, Error> {
        let batch = engine.allocate_batch(reqs.len().max(1))?;
        let submitted = match &notify {
            Some(n) => engine.submit_with_notify(batch, &reqs, n.clone()),
            None => engine.submit(batch, &reqs),
        };
        match submitted {
            Ok(()) => Ok(batch),
            Err(e) => {
                let _ = engine.free_batch(batch);
                Err(e)
            }
        }
    }

    /// A transfer by layouts, submitted (its batch id) or waited for
    /// (`wait`: 0 once done), the GIL released.
    fn blocks(
        &self,
        py: Python<'_>,
        wait: bool,
        op: &str,
        segment: u64,
        (local, local_ids, remote, remote_ids): (u32, AddrList, u32, AddrList),
        transport: Option<String>,
    ) -> PyResult<u64> {
        let op = parse_op(py, op)?;
        let engine = self.get(py)?;
        let transport = transport.filter(|t| !t.is_empty());
        let done = py.detach(|| {
            let t = BlockTransfer {
                op,
                segment,
                local,
                local_ids: &local_ids.0,
                remote,
                remote_ids: &remote_ids.0,
                transport: transport.as_deref(),
            };
            if wait {
                return engine.transfer_blocks(&t).map(|()| 0);
            }
            let batch = engine.allocate_batch(local_ids.0.len().max(1))?;
            engine
                .submit_blocks(batch, &t)
                .map(|()| batch)
                .inspect_err(|_| drop(engine.free_batch(batch)))
        });
        // The engine keeps no reference to the index arrays once it returns.
        recycle(local_ids.0);
        recycle(remote_ids.0);
        done.map_err(|e| ferry_err(py, e))
    }

    fn requests(
        &self,
        py: Python<'_>,
        op: &str,
        segment: u64,
        (local, remote, lengths): (AddrList, AddrList, AddrList),
        transport: Option<String>,
        drop_empty: bool,
    ) -> PyResult<Vec<Request>> {
        let op = parse_op(py, op)?;
        let (local, remote, lengths) = (local.0, remote.0, lengths.0);
        if local.len() != remote.len() || local.len() != lengths.len() {
            return Err(invalid(
                py,
                format!(
                    "{} local addresses, {} remote addresses and {} lengths: one of each per request",
                    local.len(),
                    remote.len(),
                    lengths.len()
                ),
            ));
        }
        let transport: Option<std::sync::Arc<str>> =
            transport.filter(|t| !t.is_empty()).map(Into::into);
        let requests = local
            .iter()
            .zip(&remote)
            .zip(&lengths)
            // Mooncake completes a zero-length request at once, touching
            // nothing: its API asks for that (`drop_empty`).
            .filter(|(_, n)| !drop_empty || **n != 0)
            .map(|((&l, &r), &n)| {
                let mut req = Request::new(op, l, segment, r, n);
                req.transport = transport.clone();
                req
            })
            .collect();
        // Their memory serves this thread's next extraction, as `blocks`'s does.
        recycle(local);
        recycle(remote);
        recycle(lengths);
        Ok(requests)
    }
}

/// Waits for a batch and frees it; the first failed request is the error.
/// A batch still pending at the deadline stays allocated (its requests are
/// in flight) and the error says so.
fn finish(engine: &Engine, batch: BatchId, timeout: Duration) -> Result<(), Error> {
    let status = engine.wait(batch, timeout)?;
    if !status.is_done() {
        return Err(Error::new(
            ErrorCode::Timeout,
            match status.pending {
                0 => format!("the notification was not delivered within {timeout:?}"),
                n => format!(
                    "{n} of {} requests did not finish within {timeout:?}",
                    status.total
                ),
            },
        ));
    }
    let _ = engine.free_batch(batch);
    match (status.first_error, status.notify) {
        (Some((i, e)), _) => Err(Error::new(e.code, format!("request {i}: {}", e.message))),
        (None, Some(NotifyStatus::Failed(e))) => Err(e),
        _ => Ok(()),
    }
}

#[pymethods]
impl NativeEngine {
    /// Starts an engine: FERRY_* variables, then `options` (EngineConfig
    /// keys such as listen, hostname, metadata, name, transports, nics,
    /// timeout_ms, tcp.connections) on top. `prefer` names a transport
    /// requests use when it can serve them.
    #[new]
    #[pyo3(signature = (options, prefer = None))]
    fn new(
        py: Python<'_>,
        options: Vec<(String, String)>,
        prefer: Option<String>,
    ) -> PyResult<Self> {
        let engine = py
            .detach(move || -> Result<Engine, Error> {
                let mut config = EngineConfig::from_env()?;
                for (k, v) in &options {
                    config.set(k, v)?;
                }
                if let Some(p) = prefer.filter(|p| !p.is_empty()) {
                    config.set("prefer", &p)?;
                }
                Engine::new(config)
            })
            .map_err(|e| ferry_err(py, e))?;
        Ok(NativeEngine {
            engine: RwLock::new(Some(Arc::new(engine))),
        })
    }

    /// The name peers open this engine by: "host:port" (p2p) or its name in
    /// the metadata store.
    fn segment_name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.get(py)?.segment_name().to_string())
    }

    /// The control listener's port (Mooncake's "RPC port").
    fn control_port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.get(py)?.control_addr().port())
    }

    /// The engine's metrics as JSON (`Engine::metrics_json`).
    fn metrics_json(&self, py: Python<'_>) -> PyResult<String> {
        let e = self.get(py)?;
        Ok(py.detach(|| e.metrics_json()))
    }

    /// Transports that can move data, in load order.
    fn transports(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self.get(py)?.transports())
    }

    /// The transport requests prefer, if this engine runs it.
    #[getter]
    fn preferred(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self.get(py)?.preferred_transport())
    }

    #[pyo3(signature = (addr, length, location = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        location: Option<&str>,
    ) -> PyResult<()> {
        let location = location
            .filter(|l| !l.is_empty())
            .map(ferry_core::location::parse_location)
            .transpose()
            .map_err(|e| ferry_err(py, e))?;
        let engine = self.get(py)?;
        py.detach(|| engine.register_memory(addr, length, location))
            .map_err(|e| ferry_err(py, e))
    }

    fn unregister_memory(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let engine = self.get(py)?;
        py.detach(|| engine.unregister_memory(addr))
            .map_err(|e| ferry_err(py, e))
    }

    /// Allocates and registers host memory (shared with same-host peers
    /// when a transport can); returns its address.
    #[pyo3(signature = (length, numa_node = None))]
    fn allocate_memory(
        &self,
        py: Python<'_>,
        length: u64,
        numa_node: Option<u32>,
    ) -> PyResult<u64> {
        let engine = self.get(py)?;
        py.detach(|| engine.allocate_memory(length, numa_node))
            .map_err(|e| ferry_err(py, e))
    }

    fn free_memory(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let engine = self.get(py)?;
        py.detach(|| engine.free_memory(addr))
            .map_err(|e| ferry_err(py, e))
    }

    /// Opens a peer's segment by name (fetching its descriptor); the same
    /// name gives the same id.
    fn open_segment(&self, py: Python<'_>, name: String) -> PyResult<u64> {
        let engine = self.get(py)?;
        py.detach(|| engine.open_segment(&name))
            .map_err(|e| ferry_err(py, e))
    }

    fn close_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let engine = self.get(py)?;
        py.detach(|| engine.close_segment(segment))
            .map_err(|e| ferry_err(py, e))
    }

    /// Re-reads the peer's descriptor now (a liveness probe, too).
    fn refresh_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let engine = self.get(py)?;
        py.detach(|| engine.refresh_segment(segment))
            .map_err(|e| ferry_err(py, e))
    }

    /// The peer's registered buffers as last fetched: (addr, len, location).
    fn segment_buffers(&self, py: Python<'_>, segment: u64) -> PyResult<Vec<(u64, u64, String)>> {
        let d = self
            .get(py)?
            .descriptor_of(segment)
            .map_err(|e| ferry_err(py, e))?;
        Ok(d.buffers
            .into_iter()
            .map(|b| (b.addr, b.len, b.location))
            .collect())
    }

    /// Which transport would carry a request and why: (transport, reason).
    fn route(
        &self,
        py: Python<'_>,
        segment: u64,
        local: u64,
        remote: u64,
        length: u64,
    ) -> PyResult<(String, String)> {
        let engine = self.get(py)?;
        let r = py
            .detach(|| engine.route(segment, local, remote, length))
            .map_err(|e| ferry_err(py, e))?;
        Ok((r.transport, r.reason))
    }

    /// Submits one batch of reads or writes to one segment; returns its id.
    /// `local`, `remote` and `lengths` are lists of ints (or of objects
    /// with `__index__`) or 1-D arrays of 8-byte integers (`AddrList`).
    /// The requests are checked first: if any is invalid nothing is
    /// submitted and this raises. `drop_empty` drops zero-length requests
    /// (Mooncake's rule: they succeed at once).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, segment, local, remote, lengths, transport = None, drop_empty = false))]
    fn submit(
        &self,
        py: Python<'_>,
        op: &str,
        segment: u64,
        local: AddrList,
        remote: AddrList,
        lengths: AddrList,
        transport: Option<String>,
        drop_empty: bool,
    ) -> PyResult<u64> {
        let reqs = self.requests(
            py,
            op,
            segment,
            (local, remote, lengths),
            transport,
            drop_empty,
        )?;
        let engine = self.get(py)?;
        py.detach(|| self.submit_batch(&engine, reqs, None))
            .map_err(|e| ferry_err(py, e))
    }

    /// Submits one batch and waits for it (up to twice the engine's
    /// timeout, as `Engine::transfer_sync`); raises on the first failure.
    /// With `notify` (name, message), the peer receives it once all of the
    /// batch's data is in its memory, and this returns once the peer has
    /// it queued. Lists as `submit` takes them, `drop_empty` too.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, segment, local, remote, lengths, transport = None, notify = None, drop_empty = false))]
    fn transfer(
        &self,
        py: Python<'_>,
        op: &str,
        segment: u64,
        local: AddrList,
        remote: AddrList,
        lengths: AddrList,
        transport: Option<String>,
        notify: Option<(String, Vec<u8>)>,
        drop_empty: bool,
    ) -> PyResult<()> {
        let reqs = self.requests(
            py,
            op,
            segment,
            (local, remote, lengths),
            transport,
            drop_empty,
        )?;
        let notify = notify
            .map(|(name, msg)| Notify::new(name, msg))
            .transpose()
            .map_err(|e| ferry_err(py, e))?;
        let engine = self.get(py)?;
        if reqs.is_empty() {
            return match notify {
                Some(n) => py
                    .detach(|| engine.send_notify(segment, n))
                    .map_err(|e| ferry_err(py, e)),
                None => Ok(()),
            };
        }
        py.detach(|| {
            let batch = self.submit_batch(&engine, reqs, notify)?;
            finish(&engine, batch, engine.config().timeout * 2)
        })
        .map_err(|e| ferry_err(py, e))
    }

    /// Sends a notification (name, message) alone to a segment and waits
    /// until the peer has it queued.
    fn send_notify(
        &self,
        py: Python<'_>,
        segment: u64,
        name: String,
        msg: Vec<u8>,
    ) -> PyResult<()> {
        let notify = Notify::new(name, msg).map_err(|e| ferry_err(py, e))?;
        let engine = self.get(py)?;
        py.detach(|| engine.send_notify(segment, notify))
            .map_err(|e| ferry_err(py, e))
    }

    /// Every notification peers sent since the last call, oldest first, as
    /// (sender segment, name, message bytes); taking them empties the
    /// queue.
    fn take_notifies(&self, py: Python<'_>) -> PyResult<Vec<(String, String, Vec<u8>)>> {
        Ok(self
            .get(py)?
            .take_notifies()
            .into_iter()
            .map(|n| (n.peer, n.name, n.msg))
            .collect())
    }

    /// Notifications refused because the queue was full (the newest is
    /// refused and its sender told), since the engine started.
    fn notifies_dropped(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get(py)?.notifies_dropped())
    }

    /// The buffer the peer registered first (address, length), by
    /// registration order; None when it publishes none.
    fn first_buffer(&self, py: Python<'_>, segment: u64) -> PyResult<Option<(u64, u64)>> {
        self.get(py)?
            .first_buffer(segment)
            .map_err(|e| ferry_err(py, e))
    }

    /// Waits up to `timeout_s` (default: twice the engine's timeout) for a
    /// batch; returns its status (total, completed, failed, pending, first
    /// error as (index, code, name, message) or None).
    #[pyo3(signature = (batch, timeout_s = None))]
    fn wait(&self, py: Python<'_>, batch: u64, timeout_s: Option<f64>) -> PyResult<StatusTuple> {
        let engine = self.get(py)?;
        let timeout = match timeout_s {
            Some(t) if t.is_finite() && t >= 0.0 => Duration::from_secs_f64(t.min(1e9)),
            Some(t) => return Err(invalid(py, format!("timeout {t}: expected seconds >= 0"))),
            None => engine.config().timeout * 2,
        };
        py.detach(|| engine.wait(batch, timeout))
            .map(status_tuple)
            .map_err(|e| ferry_err(py, e))
    }

    /// A batch's status now, without waiting.
    fn batch_status(&self, py: Python<'_>, batch: u64) -> PyResult<StatusTuple> {
        let engine = self.get(py)?;
        py.detach(|| engine.batch_status(batch))
            .map(status_tuple)
            .map_err(|e| ferry_err(py, e))
    }

    /// Frees a finished batch.
    fn free_batch(&self, py: Python<'_>, batch: u64) -> PyResult<()> {
        self.get(py)?
            .free_batch(batch)
            .map_err(|e| ferry_err(py, e))
    }

    /// Registers a block layout over registered memory (`count` blocks of
    /// `block_size` bytes, block i at `base + i * stride`) and publishes
    /// it; returns its id.
    fn register_layout(
        &self,
        py: Python<'_>,
        base: u64,
        block_size: u64,
        stride: u64,
        count: u64,
    ) -> PyResult<u32> {
        let engine = self.get(py)?;
        py.detach(|| {
            engine.register_layout(BlockLayout {
                base,
                block_size,
                stride,
                count,
            })
        })
        .map_err(|e| ferry_err(py, e))
    }

    fn unregister_layout(&self, py: Python<'_>, layout: u32) -> PyResult<()> {
        let engine = self.get(py)?;
        py.detach(|| engine.unregister_layout(layout))
            .map_err(|e| ferry_err(py, e))
    }

    /// The peer's layouts as last fetched: (id, base, block_size, stride,
    /// count).
    fn segment_layouts(&self, py: Python<'_>, segment: u64) -> PyResult<Vec<LayoutTuple>> {
        let d = self
            .get(py)?
            .descriptor_of(segment)
            .map_err(|e| ferry_err(py, e))?;
        Ok(d.layouts
            .iter()
            .map(|l| (l.id, l.base, l.block_size, l.stride, l.count))
            .collect())
    }

    /// Submits blocks by index (block `local_ids[i]` of `local_layout` to
    /// or from block `remote_ids[i]` of the peer's `remote_layout`) as one
    /// batch; returns its id. Index lists are lists of ints or 1-D arrays
    /// of 8-byte integers (numpy, CPU torch), read with no Python per item.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, segment, local_layout, local_ids, remote_layout, remote_ids, transport = None))]
    fn submit_blocks(
        &self,
        py: Python<'_>,
        op: &str,
        segment: u64,
        local_layout: u32,
        local_ids: AddrList,
        remote_layout: u32,
        remote_ids: AddrList,
        transport: Option<String>,
    ) -> PyResult<u64> {
        let ids = (local_layout, local_ids, remote_layout, remote_ids);
        self.blocks(py, false, op, segment, ids, transport)
    }

    /// [`submit_blocks`] waited for (the GIL released); raises on the first
    /// failed block.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, segment, local_layout, local_ids, remote_layout, remote_ids, transport = None))]
    fn transfer_blocks(
        &self,
        py: Python<'_>,
        op: &str,
        segment: u64,
        local_layout: u32,
        local_ids: AddrList,
        remote_layout: u32,
        remote_ids: AddrList,
        transport: Option<String>,
    ) -> PyResult<()> {
        let ids = (local_layout, local_ids, remote_layout, remote_ids);
        self.blocks(py, true, op, segment, ids, transport).map(drop)
    }

    /// Stops the engine: its listener closes, peers can no longer reach its
    /// memory, transfers still in flight fail. Idempotent.
    fn close(&self, py: Python<'_>) {
        let engine = self.engine.write().take();
        if let Some(engine) = engine {
            // Dropping the last handle joins the engine's threads.
            py.detach(move || drop(engine));
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.engine.read().is_none()
    }
}
