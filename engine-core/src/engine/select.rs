//! Selection: the engine's transports, and which of them carries a request
//! and why. A function of plain data (what each transport declares, the
//! local buffer, the peer's view) and of one question only a live peer can
//! answer (does its plugin accept this buffer), passed in; so it is tested
//! with fake transports and no sockets.

use super::request::{Scope, SegmentId};
use super::segments::{RemoteSegment, RemoteView};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::LocalBuffer;
use crate::transport::Transport;
use ferry_plugins_abi::sys;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::ops::Deref;
use std::sync::Arc;

/// What selection reads of a transport.
pub(crate) trait Candidate {
    fn name(&self) -> &str;
    /// The `FERRY_MEM_*` bits it moves.
    fn mem_kinds(&self) -> u64;
    /// The `FERRY_SCOPE_*` bits it reaches.
    fn scopes(&self) -> u32;
}

impl Candidate for Transport {
    fn name(&self) -> &str {
        &self.name
    }
    fn mem_kinds(&self) -> u64 {
        self.mem_kinds
    }
    fn scopes(&self) -> u32 {
        self.scopes
    }
}

impl<T: Candidate> Candidate for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn mem_kinds(&self) -> u64 {
        (**self).mem_kinds()
    }
    fn scopes(&self) -> u32 {
        (**self).scopes()
    }
}

/// The transports an engine started, in load order (an index into this
/// list names a transport everywhere in the engine), with what start-up
/// said about them.
pub(crate) struct Transports<T> {
    list: Vec<T>,
    /// Enabled transports that failed to start, with the error.
    pub(crate) failures: Vec<(String, Error)>,
    /// Each started transport's endpoint, as the descriptor announces it.
    pub(crate) endpoints: Vec<(String, Vec<u8>)>,
    /// (segment, transport) pairs whose route was logged.
    logged: Mutex<HashSet<(SegmentId, usize)>>,
}

impl<T> Deref for Transports<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.list
    }
}

/// One request's question to selection.
pub(crate) struct Want<'a> {
    pub(crate) local: &'a LocalBuffer,
    pub(crate) segment: &'a RemoteSegment,
    pub(crate) view: &'a RemoteView,
    /// Index of the remote buffer in `view`.
    pub(crate) remote: usize,
    /// The transport the request asks for, if any.
    pub(crate) hint: Option<&'a str>,
    /// Put the reason into words (for logs and `route`); otherwise the
    /// per-request path stays free of formatting.
    pub(crate) explain: bool,
}

impl<T: Candidate> Transports<T> {
    pub(crate) fn new(
        list: Vec<T>,
        failures: Vec<(String, Error)>,
        endpoints: Vec<(String, Vec<u8>)>,
    ) -> Transports<T> {
        Transports {
            list,
            failures,
            endpoints,
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// Whether the route (segment, transport) is to be logged: true once.
    pub(crate) fn first_use(&self, segment: SegmentId, transport: usize) -> bool {
        self.logged.lock().insert((segment, transport))
    }

    /// Picks the transport for one request and says why: the best-ranked
    /// transport that can move this memory to a peer in this scope, runs at
    /// the peer, has a key for the remote buffer, and does not decline this
    /// peer or buffer (`accepts(transport, key)`, asked in rank order until
    /// one accepts).
    pub(crate) fn select(
        &self,
        want: &Want<'_>,
        mut accepts: impl FnMut(usize, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<(usize, String)> {
        let Want {
            local,
            segment: seg,
            view,
            remote,
            hint,
            explain,
        } = *want;
        let remote_buf = &view.buffers[remote];
        let mut candidates: Vec<(usize, (u8, u8))> = Vec::new();
        let mut rejected: Vec<String> = Vec::new();
        for (i, t) in self.list.iter().enumerate() {
            let name = t.name();
            if hint.is_some_and(|h| h != name) {
                continue;
            }
            let verdict = if local.device.is_some() && local.registration(i).is_none() {
                Some(format!(
                    "{name} did not register this {} memory directly",
                    local.location
                ))
            } else if local.device.is_none() && t.mem_kinds() & local.mem_kind == 0 {
                Some(format!("{name} cannot move {} memory", local.location))
            } else if !crate::transport::scope_served(t.scopes(), seg.scope.raw()) {
                Some(format!(
                    "{name} cannot reach a peer on {}",
                    seg.scope.as_str()
                ))
            } else if !view.endpoints.contains_key(name) {
                Some(format!("{name} does not run at the peer"))
            } else if !remote_buf.keys.contains_key(name) {
                Some(format!(
                    "{name} did not register the peer's buffer at {:#x}",
                    remote_buf.addr
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
            let name = self.list[*i].name();
            let key = remote_buf
                .keys
                .get(name)
                .map(|k| &k[..])
                .unwrap_or_default();
            match accepts(*i, key) {
                Ok(()) => {
                    chosen = Some(*i);
                    break;
                }
                Err(why) => rejected.push(format!("{name} declined: {why}")),
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
        let t = &self.list[best];
        if !explain {
            return Ok((best, String::new()));
        }
        if hint.is_some() {
            return Ok((best, format!("{} was requested", t.name())));
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
            .filter(|i| *i != best && rank(&self.list[*i]) >= rank(t))
            .map(|i| self.list[i].name())
            .collect();
        if !others.is_empty() {
            reason.push_str(&format!("; preferred over {}", others.join(", ")));
        }
        if !rejected.is_empty() {
            reason.push_str(&format!("; not usable: {}", rejected.join("; ")));
        }
        Ok((best, reason))
    }
}

/// Whether transport `transport` (named `name`) serves this segment's
/// buffer with `key`: `ask` puts the question to the peer's plugin once
/// (`None`: the peer could not be asked, which is not a refusal and is not
/// remembered), and the answer is remembered for the segment.
pub(crate) fn acceptance(
    seg: &RemoteSegment,
    transport: usize,
    name: &str,
    key: &[u8],
    ask: impl FnOnce() -> Option<std::result::Result<(), String>>,
) -> std::result::Result<(), String> {
    if let Some(v) = seg.verdicts.lock().get(&transport).and_then(|m| m.get(key)) {
        return v.clone();
    }
    let Some(verdict) = ask() else {
        return Ok(());
    };
    if let Err(why) = &verdict {
        log::info!(
            "segment {}: {name} declined some of its buffers ({why}); using the next transport \
             for them",
            seg.name,
        );
    }
    seg.verdicts
        .lock()
        .entry(transport)
        .or_default()
        .insert(key.to_vec(), verdict.clone());
    verdict
}

/// Lower is better: transports limited to one process beat those limited to
/// one host, which beat cross-host ones; among cross-host ones RDMA beats
/// vendor plugins, which beat TCP, the transport of last resort.
pub(crate) fn rank(t: &impl Candidate) -> (u8, u8) {
    let scopes = t.scopes();
    let locality = if scopes & (sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST) == 0 {
        0
    } else if scopes & sys::FERRY_SCOPE_CROSS_HOST == 0 {
        1
    } else {
        2
    };
    let kind = if t.name().starts_with("rdma") {
        0
    } else if t.name() == "tcp" {
        2
    } else {
        1
    };
    (locality, kind)
}

fn rank_reason(t: &impl Candidate, scope: Scope) -> String {
    let name = t.name();
    match rank(t) {
        (0, _) => format!("{name} copies within this process"),
        (1, _) => format!("{name} is a same-host transport and the peer is on this host"),
        (_, 0) => format!("{name} moves data by RDMA"),
        (_, 2) => match scope {
            Scope::CrossHost => {
                format!("{name} is the only cross-host transport both ends run")
            }
            _ => format!(
                "{name} works between any two engines (no same-host transport can serve this)"
            ),
        },
        _ => format!("{name} is a vendor transport both ends run"),
    }
}
