//! Why a transport cannot serve a request, and the error when none can:
//! the words selection gives a user.

use crate::engine::segments::RemoteSegment;
use crate::error::{Error, ErrorCode};
use crate::memory::LocalBuffer;

/// Why a transport cannot serve a request.
pub(super) enum Refusal {
    NeedsRegistration,
    NotDirect,
    CannotMove,
    CannotReach,
    NotAtPeer,
    NoKey,
    /// The peer's plugin said no, and why.
    Declined(String),
}

impl Refusal {
    /// In words, for transport `name`, local buffer `local`, segment `seg`
    /// and the peer's buffer at `remote`.
    pub(super) fn explain(
        &self,
        name: &str,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        remote: u64,
    ) -> String {
        match self {
            Refusal::NeedsRegistration => format!(
                "{name} needs local memory registered (register [{:#x}, {:#x}) with \
                 register_memory first)",
                local.addr,
                local.end()
            ),
            Refusal::NotDirect => format!(
                "{name} did not register this {} memory directly",
                local.location
            ),
            Refusal::CannotMove => format!("{name} cannot move {} memory", local.location),
            Refusal::CannotReach => format!("{name} cannot reach a peer on {}", seg.scope.as_str()),
            Refusal::NotAtPeer => format!("{name} does not run at the peer"),
            Refusal::NoKey => format!("{name} did not register the peer's buffer at {remote:#x}"),
            Refusal::Declined(why) => format!("{name} declined: {why}"),
        }
    }
}

/// The error when no transport serves a request (`hint`: the one asked
/// for), with why each was refused.
pub(super) fn nothing_serves(
    local: &LocalBuffer,
    seg: &RemoteSegment,
    hint: Option<&str>,
    rejected: &[String],
) -> Error {
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
    Error::new(
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
    )
}
