//! The engine: registered memory, remote segments, batches, and the choice
//! of transport for each request.
//!
//! An engine loads plugins, starts an instance of every enabled transport,
//! and serves its segment descriptor on a control listener whose address is
//! the segment name ("host:port"). Opening a peer's segment fetches the
//! peer's descriptor; submitting a batch checks every request against local
//! and remote registered memory, picks a transport, coalesces adjacent
//! requests, and hands them to the transports, which complete them.
//!
//! The files, lower floors first (a file names only files above it in this
//! list, never one below):
//! - `request`: what applications ask (requests) and are told (routes);
//! - `node`: who this engine is to peers, the metadata store;
//! - `layouts`: block layouts and the block lists made from their indices;
//! - `segments`: peers' segments, their views and connections;
//! - `refused`: requests a peer refused, waiting for their retry;
//! - `cost`: how long a route would take, from what transports declare;
//! - `measure`: what completions showed, per peer and transport;
//! - `select`: the transports and which one serves a request, and why;
//! - `plan`: a batch checked, routed and coalesced, before anything moves;
//! - `devices`, `ladder`, `allocations`: devices and what memory an address
//!   is, the GPU-direct ladder, memory the engine allocates;
//! - `staging/{protocol,slots,state}`: staging's messages, slots and state;
//! - `shared`: the state all of the above make up, behind one `Arc`;
//! - `registration`, `publish`, `peers`, `retry`, `dispatch`, `staged_run`,
//!   `request_run`, `submit`, `blocks`, `notify`,
//!   `route`, `staging/{target,initiator,job}`: what the engine does with it;
//! - `observe`: the metrics as the engine reads them out, and its endpoint;
//! - `startup` and `api`: `Engine::new` and the rest of the public API.

mod allocations;
mod api;
mod blocks;
mod cost;
mod devices;
mod dispatch;
mod ladder;
mod layouts;
mod measure;
mod node;
mod notify;
mod observe;
mod peers;
mod plan;
mod publish;
mod refused;
mod registration;
mod request;
mod request_run;
mod retry;
mod route;
mod route_memo;
mod segments;
mod select;
mod shared;
mod staged_run;
mod staging;
mod startup;
mod submit;

pub use crate::gpu::Gpu;
pub use crate::host::PeerControls;
pub use api::Engine;
pub use blocks::BlockTransfer;
pub use layouts::{BlockLayout, LayoutId};
pub use node::list_segments;
pub use request::{Op, Request, Route, RouteEstimate, RouteNic, Scope, SegmentId};
/// The staging requests peers send on the control plane, and their
/// decoders (exercised by the fuzz targets).
pub use staging::{
    decode_copy_list, decode_copy_request, decode_open_reply, decode_open_request, CopyListRequest,
    CopyRequest, ListPiece, OpenReply, OpenRequest, MAX_LIST_PIECES,
};
