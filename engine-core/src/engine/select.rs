//! Selection: which transport carries a request, and why.

use super::request::Scope;
use super::segments::{RemoteSegment, RemoteView};
use super::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::memory::LocalBuffer;
use crate::transport::Transport;
use ferry_plugins_abi::sys;

impl Shared {
    /// Picks the transport for one request and says why: the best-ranked
    /// transport that can move this memory to a peer in this scope, runs at
    /// the peer, has a key for the remote buffer, and does not decline this
    /// peer or buffer (asked once, remembered).
    /// The reason is only put into words when `explain` is set (for logs
    /// and `route`), which keeps the per-request path free of formatting.
    pub(crate) fn select(
        &self,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        view: &RemoteView,
        remote: usize,
        hint: Option<&str>,
        explain: bool,
    ) -> Result<(usize, String)> {
        let remote_buf = &view.buffers[remote];
        let mut candidates: Vec<(usize, (u8, u8))> = Vec::new();
        let mut rejected: Vec<String> = Vec::new();
        for (i, t) in self.transports.iter().enumerate() {
            if hint.is_some_and(|h| h != t.name) {
                continue;
            }
            let verdict = if local.device.is_some() && local.registration(i).is_none() {
                Some(format!(
                    "{} did not register this {} memory directly",
                    t.name, local.location
                ))
            } else if local.device.is_none() && t.mem_kinds & local.mem_kind == 0 {
                Some(format!("{} cannot move {} memory", t.name, local.location))
            } else if !crate::transport::scope_served(t.scopes, seg.scope.raw()) {
                Some(format!(
                    "{} cannot reach a peer on {}",
                    t.name,
                    seg.scope.as_str()
                ))
            } else if !view.endpoints.contains_key(&t.name) {
                Some(format!("{} does not run at the peer", t.name))
            } else if !remote_buf.keys.contains_key(&t.name) {
                Some(format!(
                    "{} did not register the peer's buffer at {:#x}",
                    t.name, remote_buf.addr
                ))
            } else {
                None
            };
            match verdict {
                Some(v) => rejected.push(v),
                None => candidates.push((i, rank(t))),
            }
        }
        candidates.sort_by_key(|(i, r)| (*r, *i));
        let mut chosen = None;
        for (i, _) in &candidates {
            let key = remote_buf
                .keys
                .get(&self.transports[*i].name)
                .map(|k| &k[..])
                .unwrap_or_default();
            match self.acceptance(seg, *i, key) {
                Ok(()) => {
                    chosen = Some(*i);
                    break;
                }
                Err(why) => rejected.push(format!("{} declined: {why}", self.transports[*i].name)),
            }
        }
        let Some(best) = chosen else {
            let what = match hint {
                Some(h) => format!("transport {h} was requested but cannot serve this request"),
                None => format!(
                    "no transport can move {} memory to {} ({})",
                    local.location,
                    seg.name,
                    seg.scope.as_str()
                ),
            };
            let code = if hint.is_some() {
                ErrorCode::Unsupported
            } else {
                ErrorCode::Unavailable
            };
            return Err(Error::new(
                code,
                format!(
                    "{what}: {}",
                    if rejected.is_empty() {
                        "this engine has no transport plugin that can move data (`ferry info` \
                         shows why each plugin is disabled; FERRY_PLUGIN_PATH adds directories)"
                            .to_string()
                    } else {
                        rejected.join("; ")
                    }
                ),
            ));
        };
        let t = &self.transports[best];
        if !explain {
            return Ok((best, String::new()));
        }
        if hint.is_some() {
            return Ok((best, format!("{} was requested", t.name)));
        }
        let mut reason = format!(
            "{} memory to {} memory on {}: {}",
            local.location,
            remote_buf.location,
            seg.scope.as_str(),
            rank_reason(t, seg.scope)
        );
        if let Some(r) = local.registration(best).filter(|_| local.device.is_some()) {
            let how = ferry_plugins_abi::caps::mem_kind_names(r.mem_kind).join(", ");
            reason.push_str(&format!(
                " (local {} memory registered as {how})",
                local.location
            ));
        }
        let others: Vec<&str> = candidates
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| *i != best && rank(&self.transports[*i]) >= rank(t))
            .map(|i| self.transports[i].name.as_str())
            .collect();
        if !others.is_empty() {
            reason.push_str(&format!("; preferred over {}", others.join(", ")));
        }
        if !rejected.is_empty() {
            reason.push_str(&format!("; not usable: {}", rejected.join("; ")));
        }
        Ok((best, reason))
    }

    /// Whether a transport serves this segment's buffer with `key`: asks
    /// the plugin once (connect, then accepts) and remembers the answer.
    fn acceptance(
        &self,
        seg: &RemoteSegment,
        transport: usize,
        key: &[u8],
    ) -> std::result::Result<(), String> {
        if let Some(v) = seg.verdicts.lock().get(&transport).and_then(|m| m.get(key)) {
            return v.clone();
        }
        let t = &self.transports[transport];
        let strip = |m: String| -> String {
            m.strip_prefix(&format!("{}: ", t.name))
                .map(str::to_string)
                .unwrap_or(m)
        };
        let verdict = match self.peer(seg, transport) {
            Ok(peer) => match t.accepts(&peer, key) {
                Ok(()) => Ok(()),
                Err(e) => Err(strip(e.message)),
            },
            // Other connection errors are the peer's state, not a refusal:
            // let the request try and report them.
            Err(e) if e.code != ErrorCode::Unavailable => return Ok(()),
            Err(e) => Err(strip(e.message)),
        };
        if let Err(why) = &verdict {
            log::info!(
                "segment {}: {} declined some of its buffers ({why}); using the next transport \
                 for them",
                seg.name,
                t.name
            );
        }
        seg.verdicts
            .lock()
            .entry(transport)
            .or_default()
            .insert(key.to_vec(), verdict.clone());
        verdict
    }
}

/// Lower is better: transports limited to one process beat those limited to
/// one host, which beat cross-host ones; among cross-host ones RDMA beats
/// vendor plugins, which beat TCP, the transport of last resort.
fn rank(t: &Transport) -> (u8, u8) {
    let locality = if t.scopes & (sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST) == 0 {
        0
    } else if t.scopes & sys::FERRY_SCOPE_CROSS_HOST == 0 {
        1
    } else {
        2
    };
    let kind = if t.name.starts_with("rdma") {
        0
    } else if t.name == "tcp" {
        2
    } else {
        1
    };
    (locality, kind)
}

fn rank_reason(t: &Transport, scope: Scope) -> String {
    match rank(t) {
        (0, _) => format!("{} copies within this process", t.name),
        (1, _) => format!(
            "{} is a same-host transport and the peer is on this host",
            t.name
        ),
        (_, 0) => format!("{} moves data by RDMA", t.name),
        (_, 2) => match scope {
            Scope::CrossHost => {
                format!("{} is the only cross-host transport both ends run", t.name)
            }
            _ => format!(
                "{} works between any two engines (no same-host transport can serve this)",
                t.name
            ),
        },
        _ => format!("{} is a vendor transport both ends run", t.name),
    }
}
