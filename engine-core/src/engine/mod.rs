//! The engine: registered memory, remote segments, batches, and the choice
//! of transport for each request.
//!
//! An engine loads plugins, starts an instance of every enabled transport,
//! and serves its segment descriptor on a control listener whose address is
//! the segment name ("host:port"). Opening a peer's segment fetches the
//! peer's descriptor; submitting a batch checks every request against local
//! and remote registered memory, picks a transport, coalesces adjacent
//! requests, and hands them to the transports, which complete them.

mod allocations;
mod api;
mod devices;
mod publish;
mod registration;
mod request;
mod route;
mod segments;
mod select;
mod shared;
mod staging;
mod startup;
mod submit;

pub use crate::host::PeerControls;
pub use api::Engine;
pub(crate) use devices::discover_gpus;
pub use devices::Gpu;
pub use request::{Op, Request, Route, RouteNic, Scope, SegmentId};
pub use segments::list_segments;
/// The staging requests peers send on the control plane, and their
/// decoders (exercised by the fuzz targets).
pub use staging::{
    decode_copy_request, decode_open_reply, decode_open_request, CopyRequest, OpenReply,
    OpenRequest,
};
