//! The control listener: admission through the shared gate
//! (`sdk::gate`: one thread authenticates every new connection, the oldest
//! silent one evicted when the pre-auth pool is full), then serving
//! (`control_serve`: one I/O thread and a few workers for every
//! authenticated connection, never a thread each). Frames and the client
//! side are in `control`.
//!
//! Connections still authenticating have their own small pool and a short
//! deadline, apart from the [`MAX_CONNECTIONS`] authenticated ones (at most
//! `control_max_per_host` of one host), which they can never crowd out.
//! Every refusal is counted by kind ([`REFUSALS`]) and logged at most once
//! per interval.

pub use crate::control::ControlHandler;
use crate::control::Link;
use crate::control::MAX_BODIES_IN_FLIGHT;
use crate::control_budget::MAX_BODIES_PER_HOST;
use crate::control_serve::{Serve, ServeConfig, WORKERS};
use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sdk::admission::{Refusal, Refusals};
use ferry_plugins_abi::sdk::gate::{self, Gate, GateConfig};
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::sync::{Arc, LazyLock, Weak};

/// Authenticated control connections served at once; a newcomer beyond
/// takes the place of an idle one (of the host holding the most), or is
/// told BUSY.
pub const MAX_CONNECTIONS: usize = crate::config_keys::MAX_CONTROL_CONNECTIONS;

/// Every refusal by control listeners of this process, by kind (shared
/// with each listener's gate).
pub static REFUSALS: LazyLock<Arc<Refusals>> = LazyLock::new(|| Arc::new(Refusals::new("control")));

/// Refused or failed authentications on control listeners, process-wide
/// (for tests and reports): the refusals of kinds Auth and Timeout.
#[cfg(feature = "testing")]
pub static AUTH_REFUSED: AuthRefused = AuthRefused;

/// Reads as the count of failed authentications (see [`AUTH_REFUSED`]).
#[cfg(feature = "testing")]
pub struct AuthRefused;

#[cfg(feature = "testing")]
impl AuthRefused {
    pub fn load(&self, _order: std::sync::atomic::Ordering) -> usize {
        (REFUSALS.count(Refusal::Auth) + REFUSALS.count(Refusal::Timeout)) as usize
    }
}

fn refuse(kind: Refusal, detail: String) {
    REFUSALS.record(kind, || detail, |line| log::warn!("{line}"));
}

/// The engine's control listener. Dropping it stops the gate and the
/// serving threads, closing every connection.
pub struct ControlServer {
    addr: SocketAddr,
    // Declared first: dropped first, so nothing new is admitted while the
    // serving threads stop.
    _gate: Gate,
    _serve: Serve,
}

impl ControlServer {
    /// Binds the control listener ("127.0.0.1:0", "0.0.0.0:7000") without
    /// serving yet, so the engine knows its port before it starts plugins.
    pub fn bind(listen: &str) -> Result<TcpListener> {
        TcpListener::bind(listen).map_err(|e| {
            let code = if e.kind() == io::ErrorKind::AddrInUse {
                ErrorCode::Busy
            } else {
                ErrorCode::Io
            };
            Error::new(
                code,
                format!("cannot listen on {listen} for control connections: {e}"),
            )
        })
    }

    /// Serves `listener` until dropped.
    pub fn start(
        listener: TcpListener,
        handler: Weak<dyn ControlHandler>,
        link: &Link,
    ) -> Result<ControlServer> {
        let addr = listener.local_addr().map_err(|e| {
            Error::new(ErrorCode::Io, format!("cannot read the bound address: {e}"))
        })?;
        let no_thread =
            |e: io::Error| Error::new(ErrorCode::NoMemory, format!("cannot start a thread: {e}"));
        let serve = Serve::start(
            handler,
            ServeConfig {
                io_timeout: link.io_timeout,
                idle_timeout: link.idle_timeout,
                max_per_host: link.max_per_host,
                max_total: MAX_CONNECTIONS,
            },
            Arc::new(refuse),
        )
        .map_err(no_thread)?;
        let gate = Gate::start(
            OwnedFd::from(listener),
            "ferry-control",
            GateConfig {
                kind: "control",
                token: link.token.clone(),
                auth_timeout: link.auth_timeout,
                max_pending: link.max_pending,
                max_pending_per_source: link.max_pending_per_source,
            },
            Box::new(gate::classify_tcp),
            Box::new(serve.admitter()),
            REFUSALS.clone(),
            Arc::new(|line: &str| log::warn!("{line}")),
        )
        .map_err(no_thread)?;
        log::info!(
            "control listener on {addr}: one thread authenticates, one I/O thread and {WORKERS} \
             workers serve up to {MAX_CONNECTIONS} connections ({} per host; an idle one gives \
             way to a newcomer after 1 s); frame bodies held at most {} MiB ({} MiB per host)",
            link.max_per_host,
            MAX_BODIES_IN_FLIGHT >> 20,
            MAX_BODIES_PER_HOST >> 20,
        );
        Ok(ControlServer {
            addr,
            _gate: gate,
            _serve: serve,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}
