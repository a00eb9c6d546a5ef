//! The target side: the data listener. Connections are accepted and
//! authenticated by a gate (`sdk::gate`: one thread for every pending
//! handshake, the oldest silent one evicted when the pre-auth pool is
//! full), counted against the caps on served connections (in all and per
//! peer host), sent the hello, and handed to the I/O loops, which serve
//! their frames against registered memory only (target_conn.rs).
//!
//! No thread per connection: a target serving a thousand connections runs
//! the gate's thread and the instance's I/O threads.

use crate::reactor::{Reactor, Registration};
use crate::regions::Regions;
use crate::target_conn::{Logs, ServeConfig, ServedConn};
use crate::wire;
use ferry_plugins_abi::sdk::admission::{Refusal, Refusals};
use ferry_plugins_abi::sdk::auth::Token;
use ferry_plugins_abi::sdk::gate::{self, Admitted, Gate, GateConfig};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Incoming data connections served at once; more are refused after
/// authentication (tcp.max_connections).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Of those, from one peer host (tcp.max_connections_per_host).
pub const DEFAULT_MAX_CONNECTIONS_PER_HOST: usize = 256;

pub struct TargetConfig {
    /// A frame must arrive, and its response leave, within this.
    pub timeout: Duration,
    /// A connection with no frame for this long is closed.
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_host: usize,
    /// Sent in the hello after authentication (and in the endpoint).
    pub instance: u64,
    /// Deadline of a new connection's whole authentication (auth_timeout_ms).
    pub auth_timeout: Duration,
    /// Connections authenticating at once: in all, and per source.
    pub max_pending: usize,
    pub max_pending_per_source: usize,
    /// FERRY_INTEGRITY=payload: frames whose payload is not tagged are
    /// refused (and responses to tagged requests are tagged either way).
    pub require_payload_tag: bool,
    /// The cluster's token (`auth.token`): a connection that does not prove
    /// it knows it is closed before any frame is read.
    pub token: Option<Token>,
    /// How long an I/O loop polls for a connection's next frame after a
    /// response (tcp.spin_us).
    pub spin: Duration,
}

/// Served connections, in all and per peer host.
#[derive(Default)]
struct Served {
    total: usize,
    by_host: HashMap<IpAddr, usize>,
}

/// A served connection's place under the caps; released when it goes.
struct Place {
    served: Arc<Mutex<Served>>,
    ip: IpAddr,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut s = self.served.lock().unwrap_or_else(|p| p.into_inner());
        s.total = s.total.saturating_sub(1);
        if let Some(n) = s.by_host.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                s.by_host.remove(&self.ip);
            }
        }
    }
}

type Live = Arc<Mutex<Vec<(Registration, Weak<ServedConn>)>>>;

pub struct Target {
    addr: SocketAddr,
    gate: Option<Gate>,
    live: Live,
}

impl Target {
    pub fn start(
        bind: &str,
        regions: Arc<Regions>,
        config: TargetConfig,
        reactor: Arc<Reactor>,
        refusals: Arc<Refusals>,
        logs: Logs,
    ) -> std::io::Result<Target> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let live: Live = Arc::default();
        let served: Arc<Mutex<Served>> = Arc::default();
        let serve = Arc::new(ServeConfig {
            timeout: config.timeout,
            idle_timeout: config.idle_timeout,
            require_payload_tag: config.require_payload_tag,
            spin: config.spin,
        });
        let (live2, refusals2, logs2) = (live.clone(), refusals.clone(), logs.clone());
        let (max_total, max_host, instance, timeout) = (
            config.max_connections,
            config.max_connections_per_host,
            config.instance,
            config.timeout,
        );
        let on_admit = move |a: Admitted| {
            let Admitted {
                fd, peer, session, ..
            } = a;
            let stream = TcpStream::from(fd);
            let Ok(peer_addr) = stream.peer_addr() else {
                return;
            };
            let place = match admit(&served, peer_addr.ip(), max_total, max_host) {
                Ok(p) => p,
                Err((kind, why)) => {
                    refusals2.record(kind, || format!("{peer}: {why}"), |l| (logs2.warn)(l));
                    return;
                }
            };
            let mut session = session;
            let hello = wire::encode_hello(instance);
            let tag = session.send.seal(&[&hello]);
            let mut out = hello.to_vec();
            out.extend_from_slice(&tag);
            // The hello is the first thing this side sends after the
            // exchange: the socket's empty buffer takes it whole.
            if !send_now(&stream, &out, timeout) || stream.set_nodelay(true).is_err() {
                return;
            }
            let reg = reactor.place();
            let conn = Arc::new(ServedConn::new(
                stream,
                peer_addr,
                session,
                regions.clone(),
                serve.clone(),
                refusals2.clone(),
                logs2.clone(),
                Box::new(place),
            ));
            let want = conn.first_want();
            let mut list = live2.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|(_, w)| w.strong_count() > 0);
            list.push((reg.clone(), Arc::downgrade(&conn)));
            drop(list);
            reg.start(conn, want);
        };
        let gate = Gate::start(
            OwnedFd::from(listener),
            "ferry-tcp-gate",
            GateConfig {
                kind: "tcp",
                token: config.token.clone(),
                auth_timeout: config.auth_timeout,
                max_pending: config.max_pending,
                max_pending_per_source: config.max_pending_per_source,
            },
            Box::new(gate::classify_tcp),
            Box::new(on_admit),
            refusals,
            logs.warn,
        )?;
        Ok(Target {
            addr,
            gate: Some(gate),
            live,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // No new connections, then every served one closes (its peer fails
        // what it has in flight) and leaves its loop.
        drop(self.gate.take());
        let live = std::mem::take(&mut *self.live.lock().unwrap_or_else(|p| p.into_inner()));
        for (reg, conn) in live {
            if let Some(c) = conn.upgrade() {
                c.shutdown();
            }
            reg.remove();
        }
    }
}

/// Counts an authenticated connection against the caps on served ones
/// (in all and per peer host), or says which cap it would pass.
fn admit(
    served: &Arc<Mutex<Served>>,
    ip: IpAddr,
    max_total: usize,
    max_host: usize,
) -> Result<Place, (Refusal, String)> {
    let mut s = served.lock().unwrap_or_else(|p| p.into_inner());
    if s.total >= max_total {
        return Err((
            Refusal::Full,
            format!("{max_total} data connections are served (tcp.max_connections)"),
        ));
    }
    let from_host = s.by_host.get(&ip).copied().unwrap_or(0);
    if from_host >= max_host {
        return Err((
            Refusal::PerSource,
            format!(
                "{from_host} data connections from that host are served \
                 (tcp.max_connections_per_host)"
            ),
        ));
    }
    s.total += 1;
    *s.by_host.entry(ip).or_insert(0) += 1;
    Ok(Place {
        served: served.clone(),
        ip,
    })
}

/// Sends a few bytes that must go now (into an empty socket buffer).
fn send_now(stream: &TcpStream, bytes: &[u8], timeout: Duration) -> bool {
    use std::io::Write;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(timeout.max(Duration::from_millis(1))));
    let ok = (&mut &*stream).write_all(bytes).is_ok();
    ok && stream.set_nonblocking(true).is_ok()
}
