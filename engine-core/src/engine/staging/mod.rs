//! Staging: device memory moved by transports that can only move host
//! memory (TCP, shm), through pinned host bounce buffers, pipelined.
//!
//! On the initiator, device memory is copied to or from local pinned slots
//! (registered local-only). On the target, a peer opens a staging session on
//! a control connection: the target lends it a few pinned slots, reachable
//! by the host transports but announced to that peer only, and copies
//! between a slot and its device memory when asked (StageCopy). The session,
//! and its slots, end with the connection.
//!
//! A write of device memory to device memory, per chunk:
//! device -> local slot (copy), local slot -> remote slot (transport),
//! remote slot -> remote device (StageCopy). Up to `depth` chunks are in
//! flight, so the copy of chunk i+1 overlaps the transfer of chunk i.

mod initiator;
mod job;
mod mover;
mod protocol;
mod slots;
mod state;
mod steps;
mod target;

pub use protocol::{
    decode_copy_list, decode_copy_request, decode_open_reply, decode_open_request, CopyListRequest,
    CopyRequest, ListPiece, OpenReply, OpenRequest, MAX_LIST_PIECES,
};
pub(crate) use state::Staging;
