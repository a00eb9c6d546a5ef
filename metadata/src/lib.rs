//! Where segments are found by name: peer to peer (the default: a segment's
//! name is its control address, "host:port", and nothing else runs), or an
//! etcd cluster (FERRY_METADATA=etcd://host:port[,host:port...]).
//!
//! With etcd, an engine stores its descriptor under
//! `<prefix>/segments/<name>` with a lease it keeps alive, so a dead
//! engine's segment disappears when the lease expires (FERRY_METADATA_TTL_S).
//! Registering or unregistering memory publishes the descriptor again.
//! Peers do not watch: they read a descriptor when they open a segment and
//! read it again when a request falls outside the buffers they know ("re-read
//! on a miss"), the only moment a stale copy matters — a buffer that was
//! unregistered is refused by its owner anyway.
//!
//! Ferry speaks to etcd through its v3 JSON gateway over HTTP/1.1 (plain,
//! or TLS with etcds://: rustls, no OpenSSL), synchronously (no async
//! runtime, no protoc at build time), as an etcd user when one is set, and
//! chooses the member itself, failing over within each call's deadline.
//!
//! | file | its one job |
//! |---|---|
//! | config.rs | FERRY_METADATA and its settings |
//! | pool.rs | the members: HTTP, health, order, fail-over, deadlines, the token |
//! | tls.rs | etcds://: CA, client certificate and key; why a handshake failed |
//! | auth.rs | etcd users: password file, token, refusals in an operator's words |
//! | gateway.rs | etcd's operations as gateway JSON, replies checked |
//! | failure.rs | why a call to the members failed, in an operator's words |
//! | keeper.rs | this engine's registration: lease, writes, read-back |
//! | store.rs | the handle engines and tools use: look-ups, listing, publishing |
//! | error.rs | the error every call returns: a shared code and a message |

mod auth;
mod config;
mod error;
mod failure;
mod gateway;
mod keeper;
mod pool;
mod store;
mod tls;

pub use config::{EtcdAccess, MetadataConfig, DEFAULT_PREFIX, DEFAULT_TTL_S};
pub use error::{Error, ErrorCode, Result};
pub use store::EtcdStore;
