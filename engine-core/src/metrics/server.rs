//! The HTTP endpoint (FERRY_METRICS_LISTEN): `GET /metrics` in Prometheus
//! text, `GET /metrics.json` as JSON. Off unless configured. One thread,
//! over tiny_http; it stops when the engine drops.

use crate::error::{Error, ErrorCode, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Answers a path with (content type, body), or `None` for 404.
pub type Handler = Arc<dyn Fn(&str) -> Option<(&'static str, String)> + Send + Sync>;

pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `listen` ("host:port") and serves `handler` from a thread.
    pub fn start(listen: &str, handler: Handler) -> Result<MetricsServer> {
        let server = tiny_http::Server::http(listen).map_err(|e| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!("metrics endpoint (FERRY_METRICS_LISTEN) {listen:?}: cannot listen: {e}"),
            )
        })?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| Error::new(ErrorCode::Internal, "metrics endpoint has no IP address"))?;
        let server = Arc::new(server);
        let s = server.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-metrics".into())
            .spawn(move || serve(&s, &handler))
            .map_err(|e| {
                Error::new(
                    ErrorCode::NoMemory,
                    format!("cannot start the metrics thread: {e}"),
                )
            })?;
        log::info!("metrics: Prometheus text at http://{addr}/metrics, JSON at /metrics.json");
        Ok(MetricsServer {
            server,
            addr,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

fn serve(server: &tiny_http::Server, handler: &Handler) {
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let answer = match (request.method(), handler(&path)) {
            (tiny_http::Method::Get, Some((ct, body))) => {
                let r = tiny_http::Response::from_string(body);
                match tiny_http::Header::from_bytes(&b"Content-Type"[..], ct.as_bytes()) {
                    Ok(h) => r.with_header(h),
                    Err(()) => r,
                }
            }
            (tiny_http::Method::Get, None) => tiny_http::Response::from_string(
                "not found: try /metrics (Prometheus text) or /metrics.json\n",
            )
            .with_status_code(404),
            _ => tiny_http::Response::from_string("only GET is served\n").with_status_code(405),
        };
        // A client that went away is its own problem; keep serving.
        let _ = request.respond(answer);
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
