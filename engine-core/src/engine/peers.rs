//! The live engine as planning sees it: descriptors re-read from peers,
//! plugins asked whether they serve a peer's buffer (connecting on first
//! use), unregistered local memory classified, and the planner over the
//! engine's own state.
//!
//! Reaches in Shared: `devices`, `memory`, `segments`, `transports`.

use super::plan::{Peers, Planner};
use super::segments::{RemoteSegment, RemoteView};
use super::select::acceptance;
use super::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, TransportRegistration, Visibility};
use crate::transport::Transport;
use smallvec::SmallVec;
use std::sync::Arc;

impl Peers for Shared {
    fn unregistered_local(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
        let not_registered = |why: String| {
            Error::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: local range [{addr:#x}, {:#x}) is not registered with this \
                     engine{why}",
                    addr.saturating_add(len)
                ),
            )
        };
        if addr == 0 || addr.checked_add(len).is_none() {
            return Err(not_registered(" (a null or wrapping address)".into()));
        }
        let takers: Vec<usize> = (0..self.transports.len())
            .filter(|&t| self.transports[t].local_unregistered)
            .collect();
        if takers.is_empty() {
            return Err(not_registered(format!(
                ": register it with register_memory first (the transports here need local \
                 memory registered: {})",
                self.transports
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        // Device memory first (the CPU may not touch it), then whether the
        // range's ends are this process's memory at all.
        let (location, mem_kind, device) = self.devices.classify(addr, len, None)?;
        if device.is_none()
            && [addr, addr + len - 1]
                .iter()
                .any(|&a| crate::location::is_mapped(a) == Some(false))
        {
            return Err(not_registered(
                " and is not mapped memory of this process".into(),
            ));
        }
        if device.is_some() {
            return Err(not_registered(format!(
                ": {location} memory must be registered with register_memory first"
            )));
        }
        Ok(Arc::new(LocalBuffer {
            addr,
            len,
            location,
            mem_kind,
            device: None,
            visibility: Visibility::Unregistered,
            registrations: takers
                .into_iter()
                .map(|transport| TransportRegistration {
                    transport,
                    handle: 0,
                    key: Vec::new(),
                    mem_kind,
                })
                .collect(),
            inflight: Default::default(),
        }))
    }

    fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>> {
        self.segments.refresh(seg, &self.node)
    }

    fn accepts(
        &self,
        seg: &RemoteSegment,
        transport: usize,
        local_mem: Option<u64>,
        key: &[u8],
    ) -> std::result::Result<(), String> {
        let t = &self.transports[transport];
        // The verdict is per pair when the local buffer is registered with
        // the transport (the plugin's accepts_pair), else per remote key.
        let mut memo: SmallVec<[u8; 128]> = SmallVec::from_slice(key);
        if let Some(h) = local_mem {
            memo.extend_from_slice(&h.to_le_bytes());
        }
        acceptance(seg, transport, &t.name, &memo, || {
            let strip = |m: String| -> String {
                m.strip_prefix(&format!("{}: ", t.name))
                    .map(str::to_string)
                    .unwrap_or(m)
            };
            match seg.peer(transport, t) {
                Ok(peer) => Some(
                    match local_mem {
                        Some(h) => t.accepts_pair(&peer, h, key),
                        None => t.accepts(&peer, key),
                    }
                    .map_err(|e| strip(e.message)),
                ),
                // Other connection errors are the peer's state, not a
                // refusal: let the request try and report them.
                Err(e) if e.code != ErrorCode::Unavailable => None,
                Err(e) => Some(Err(strip(e.message))),
            }
        })
    }
}

impl Shared {
    /// Plans requests over this engine's transports, memory and segments.
    pub(crate) fn planner(&self) -> Planner<'_, Arc<Transport>> {
        Planner {
            transports: &self.transports,
            memory: &self.memory,
            segments: &self.segments,
            peers: self,
            has_devices: !self.devices.plugins.is_empty(),
        }
    }
}
