//! The initiator's errors, in operator words.

use ferry_plugins_abi::sdk::PluginError;
use ferry_plugins_abi::ErrorCode;

pub(crate) fn cancelled(peer: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Cancelled,
        format!("tcp: the connection to {peer} was closed locally"),
    )
}

pub(crate) fn connection_error(peer: &str, what: &str, detail: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Connection,
        format!("tcp: {what} {peer}: {detail} (the peer died or dropped the connection?)"),
    )
}

pub(crate) fn integrity(
    peer: &str,
    e: &ferry_plugins_abi::sdk::auth::IntegrityError,
) -> PluginError {
    PluginError::new(ErrorCode::Protocol, format!("tcp: {peer}: {e}"))
}

pub(crate) fn protocol(peer: &str, detail: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Protocol,
        format!("tcp: {peer} broke the protocol: {detail}"),
    )
}

pub(crate) fn timed_out(peer: &str, what: &str, ms: u128) -> PluginError {
    PluginError::new(
        ErrorCode::Timeout,
        format!("tcp: {peer} {what} within {ms} ms; connection dropped"),
    )
}
