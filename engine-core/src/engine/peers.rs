//! The live engine as planning sees it: descriptors re-read from peers,
//! plugins asked whether they serve a peer's buffer (connecting on first
//! use), and the planner over the engine's own state.

use super::plan::{Peers, Planner};
use super::segments::{RemoteSegment, RemoteView};
use super::select::acceptance;
use super::shared::Shared;
use crate::error::{ErrorCode, Result};
use crate::transport::Transport;
use std::sync::Arc;

impl Peers for Shared {
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
        let memo: Vec<u8> = match local_mem {
            Some(h) => [key, &h.to_le_bytes()[..]].concat(),
            None => key.to_vec(),
        };
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
