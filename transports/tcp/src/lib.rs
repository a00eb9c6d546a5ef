//! Ferry's TCP transport plugin: moves host memory between engines over TCP
//! sockets. It needs nothing but a kernel with TCP, so it is the transport of
//! last resort on every node and the only cross-host one without RDMA.
//!
//! Loaded at run time as `libferry_transport_tcp.so` through the plugin ABI.

mod entries;
mod errors;
mod initiator;
mod peer;
mod reactor;
mod regions;
mod response;
mod sockio;
mod target;
mod target_conn;
pub mod wire;

use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::{
    BlockList, Completer, Host, InitParams, MemRegion, PeerInfo, PluginError, PluginResult,
    ProbeDevice, ProbeReport, Registration, TransferRequest, TransportInstance,
};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use initiator::Settings;
use peer::{ConnRegistry, TcpPeer};
use reactor::Reactor;
use regions::Regions;
use std::ffi::CStr;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;
use target::{Target, TargetConfig};

/// Defaults of the settings a host may give (key -> FERRY_ variable).
/// Connections per peer at least (default_connections: one per I/O thread).
pub const DEFAULT_CONNECTIONS: usize = 4;
pub const DEFAULT_FRAME_BYTES: u64 = 4 << 20;
pub const DEFAULT_STRIPE_BYTES: u64 = 1 << 20;
pub const DEFAULT_SPIN_US: u64 = 50;
/// Idle timeout when the host gives none (idle_timeout_s).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 120;
/// The handle of a local-only registration (nothing to undo).
const LOCAL_ONLY_HANDLE: u64 = u64::MAX;

pub struct TcpTransport;

impl ferry_plugins_abi::sdk::TransportPlugin for TcpTransport {
    const NAME: &'static CStr = c"tcp";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr = c"Host memory over TCP sockets; works on every host";
    // Local memory is only read by send and written by recv: it needs no
    // registration (Mooncake's TCP transport takes any local buffer).
    const FLAGS: u64 = ferry_plugins_abi::sys::FERRY_TRANSPORT_LOCAL_UNREGISTERED;
    // A block list travels as frames of many blocks, completed once
    // (peer.rs); the target checks every block as it does every request.
    const BLOCK_LISTS: bool = true;
    type Instance = TcpInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        check_tcp_sockets()?;
        report.set_capabilities(
            sys::FERRY_MEM_HOST,
            sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST,
        );
        // The host's topology knows each interface's PCI function and NUMA
        // node; without it we still list the interfaces.
        let nics = host.nics(None).unwrap_or_default();
        let interfaces = ferry_plugins_abi::sdk::net::list().map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("cannot list network interfaces: {e}"),
            )
        })?;
        for itf in &interfaces {
            let nic = nics
                .iter()
                .find(|n| n.netdev == itf.name || n.name == itf.name);
            let mut detail = itf.addresses.join(", ");
            if itf.loopback {
                detail.push_str(" (loopback: same-host peers only)");
            }
            let (bandwidth_mbps, latency_ns) = declared_link(
                itf.loopback,
                nic.map(|n| n.speed_mbps)
                    .filter(|s| *s > 0)
                    .or_else(|| sysfs_speed_mbps(&itf.name)),
            );
            report.add_device(&ProbeDevice {
                name: &itf.name,
                pci_bus_id: nic.map(|n| n.pci_bus_id.as_str()).filter(|p| !p.is_empty()),
                numa_node: nic.and_then(|n| n.numa_node),
                detail: Some(&detail),
                mem_kinds: sys::FERRY_MEM_HOST,
                bandwidth_mbps,
                latency_ns,
                ..Default::default()
            });
        }
        if !interfaces.iter().any(|i| !i.loopback) {
            report.add_missing(
                "cross-host",
                "no network interface other than loopback is up with an address",
            );
        }
        Ok(())
    }

    fn init(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<TcpInstance> {
        TcpInstance::start(host, params, completer)
    }
}

ferry_plugins_abi::export_transport_plugin!(TcpTransport);

/// What tcp declares for one interface (plugin.h, ferry_probe_device_t):
/// a NIC's link speed, the ceiling of what the striped connections reach,
/// with a kernel stack's round trip at each end; loopback is bound by the
/// kernel's copies (a few GB/s per connection, striped), declared low, as
/// the engine's measurements correct it. An interface whose speed the
/// kernel does not report (virtio, some bonds) declares no bandwidth, and
/// the engine assumes its conservative default.
fn declared_link(loopback: bool, speed_mbps: Option<u64>) -> (u64, u32) {
    const LOOPBACK_MBPS: u64 = 40_000;
    const LOOPBACK_LATENCY_NS: u32 = 20_000;
    const NIC_LATENCY_NS: u32 = 30_000;
    if loopback {
        (LOOPBACK_MBPS, LOOPBACK_LATENCY_NS)
    } else {
        (speed_mbps.unwrap_or(0), NIC_LATENCY_NS)
    }
}

/// The link speed the kernel reports for an interface, in Mbit/s (`None`
/// when down, virtual, or unknown: the file reads -1 or cannot be read).
fn sysfs_speed_mbps(interface: &str) -> Option<u64> {
    if interface.contains('/') || interface.starts_with('.') {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{interface}/speed"))
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
}

/// One engine's TCP transport: a data listener serving registered memory,
/// and peers reached through their own connections.
pub struct TcpInstance {
    host: Host<'static>,
    completer: Completer,
    settings: Arc<Settings>,
    regions: Arc<Regions>,
    target: Target,
    /// "host:port instance" (wire::encode_endpoint).
    endpoint: Vec<u8>,
    conns: Arc<ConnRegistry>,
    /// The I/O threads driving every connection, served and opened; last,
    /// so the target and the peers leave them before they stop.
    reactor: Arc<Reactor>,
}

impl TcpInstance {
    fn start(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<TcpInstance> {
        let ms = |key: &str, default: u64| -> PluginResult<Duration> {
            host.setting(key, default).map(Duration::from_millis)
        };
        let io_threads = match host.setting("tcp.io_threads", 0usize)? {
            0 => default_io_threads(&host),
            n => n.min(256),
        };
        // 0 (unset): one connection per I/O thread, at least
        // DEFAULT_CONNECTIONS; see default_connections.
        let connections = match host.setting("tcp.connections", 0usize)? {
            0 => default_connections(io_threads),
            n => n,
        };
        if !(1..=64).contains(&connections) {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!("tcp.connections = {connections}: use 1 to 64"),
            ));
        }
        let settings = Arc::new(Settings {
            connections,
            frame_bytes: host
                .setting("tcp.frame_bytes", DEFAULT_FRAME_BYTES)?
                .clamp(4096, wire::MAX_FRAME_PAYLOAD),
            stripe_bytes: host
                .setting("tcp.stripe_bytes", DEFAULT_STRIPE_BYTES)?
                .max(4096),
            timeout: ms("timeout_ms", 15_000)?,
            connect_timeout: ms("connect_timeout_ms", 5_000)?,
            idle_timeout: Duration::from_secs(
                host.setting("idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S)?
                    .max(1),
            ),
            token: host
                .config("auth.token")
                .and_then(|t| ferry_plugins_abi::sdk::auth::Token::new(&t)),
            payload_integrity: payload_integrity(&host)?,
        });
        if settings.payload_integrity {
            host.info(
                "tcp: FERRY_INTEGRITY=payload: every frame's payload is tagged too (costs \
                 throughput; see docs/security.md)",
            );
        }
        let regions = Arc::new(Regions::default());
        let bind_ip: IpAddr = params
            .listen_host
            .parse()
            .unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let port: u16 = host.setting("tcp.port", 0)?;
        let (warn_host, debug_host) = (host, host);
        let logs = target_conn::Logs {
            warn: Arc::new(move |m: &str| warn_host.warn(m)),
            debug: Arc::new(move |m: &str| debug_host.debug(m)),
        };
        let reactor = Arc::new(Reactor::start(io_threads, "ferry-tcp-io").map_err(|e| {
            PluginError::new(
                ErrorCode::NoMemory,
                format!("tcp: cannot start {io_threads} I/O threads: {e}"),
            )
        })?);
        let instance = random_instance();
        let target = Target::start(
            &SocketAddr::new(bind_ip, port).to_string(),
            regions.clone(),
            TargetConfig {
                timeout: settings.timeout,
                idle_timeout: settings.idle_timeout,
                max_connections: host
                    .setting("tcp.max_connections", target::DEFAULT_MAX_CONNECTIONS)?
                    .max(1),
                max_connections_per_host: host
                    .setting(
                        "tcp.max_connections_per_host",
                        target::DEFAULT_MAX_CONNECTIONS_PER_HOST,
                    )?
                    .max(1),
                instance,
                auth_timeout: ms("auth_timeout_ms", admission::DEFAULT_AUTH_TIMEOUT_MS)?,
                max_pending: host.setting("auth.max_pending", admission::DEFAULT_MAX_PENDING)?,
                max_pending_per_source: host.setting(
                    "auth.max_pending_per_host",
                    admission::DEFAULT_MAX_PENDING_PER_SOURCE,
                )?,
                require_payload_tag: settings.payload_integrity,
                token: settings.token.clone(),
                spin: Duration::from_micros(host.setting("tcp.spin_us", DEFAULT_SPIN_US)?),
            },
            reactor.clone(),
            Arc::new(
                admission::Refusals::new("tcp")
                    .counted_by(move |r| host.count(r.counter(), None, 1)),
            ),
            logs,
        )
        .map_err(|e| {
            PluginError::new(
                ErrorCode::Io,
                format!("cannot listen for TCP data connections on {bind_ip}:{port}: {e}"),
            )
        })?;
        // Peers reach us at the engine's advertised host when we listen on
        // every interface: the engine's `hostname`, else the host part of
        // its name (an etcd name has none).
        let advertised_ip = if bind_ip.is_unspecified() {
            host.config("hostname")
                .into_iter()
                .chain(
                    params
                        .engine_name
                        .rsplit_once(':')
                        .map(|(h, _)| h.to_string()),
                )
                .find_map(|h| resolve(&h))
                .unwrap_or(bind_ip)
        } else {
            bind_ip
        };
        if advertised_ip.is_unspecified() {
            host.warn(&format!(
                "tcp: listening on {bind_ip} but no address to advertise: peers on other hosts \
                 cannot connect (set FERRY_HOSTNAME)"
            ));
        }
        // tcp.advertise (FERRY_TCP_ADVERTISE): the "host:port" peers are to
        // connect to instead, when a NAT, port forward or proxy stands in
        // front of this listener.
        let advertised = match host
            .config("tcp.advertise")
            .filter(|a| !a.trim().is_empty())
        {
            Some(a) => {
                let a = a.trim().to_string();
                if a.len() > wire::MAX_ENDPOINT_LEN - 17 || a.contains(' ') || !a.contains(':') {
                    return Err(PluginError::new(
                        ErrorCode::InvalidArgument,
                        format!("tcp.advertise {a:?}: expected host:port"),
                    ));
                }
                a
            }
            None => SocketAddr::new(advertised_ip, target.local_addr().port()).to_string(),
        };
        let endpoint = wire::encode_endpoint(&advertised, instance);
        host.info(&format!(
            "tcp: serving data on {} for engine {} ({} connections per peer, {} I/O threads)",
            advertised,
            params.engine_name,
            settings.connections,
            reactor.threads()
        ));
        Ok(TcpInstance {
            host,
            completer,
            settings,
            regions,
            target,
            endpoint,
            conns: Arc::default(),
            reactor,
        })
    }
}

impl TransportInstance for TcpInstance {
    type Peer = TcpPeer;

    fn endpoint(&self) -> PluginResult<Vec<u8>> {
        Ok(self.endpoint.clone())
    }

    fn register_memory(&self, region: &MemRegion) -> PluginResult<Registration> {
        if region.mem_kind != sys::FERRY_MEM_HOST {
            return Err(PluginError::new(
                ErrorCode::Unsupported,
                "tcp moves host memory only",
            ));
        }
        if region.local_only {
            // Sent from or received into by this side only: peers never
            // reach it, so the target does not know it.
            return Ok(Registration {
                handle: LOCAL_ONLY_HANDLE,
                key: Vec::new(),
            });
        }
        let handle = self
            .regions
            .register(region.addr, region.len)
            .map_err(|e| PluginError::new(ErrorCode::InvalidArgument, e))?;
        Ok(Registration {
            handle,
            key: Vec::new(),
        })
    }

    fn unregister_memory(&self, handle: u64) -> PluginResult<()> {
        if handle == LOCAL_ONLY_HANDLE {
            return Ok(());
        }
        // A peer's frame holds its region at most one timeout.
        let wait = self.settings.timeout * 2 + Duration::from_secs(1);
        self.regions
            .unregister(handle, wait)
            .map_err(|e| PluginError::new(ErrorCode::Busy, e))
    }

    fn connect(&self, peer: &PeerInfo) -> PluginResult<TcpPeer> {
        let (text, instance) = wire::decode_endpoint(&peer.endpoint)
            .map_err(|e| PluginError::new(ErrorCode::Protocol, format!("{}: {e}", peer.name)))?;
        let addr = text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                PluginError::new(
                    ErrorCode::NotFound,
                    format!("{}: cannot resolve its tcp endpoint {text:?}", peer.name),
                )
            })?;
        self.host
            .debug(&format!("tcp: peer {} at {addr}", peer.name));
        Ok(TcpPeer::new(
            peer.name.clone(),
            addr,
            instance,
            self.settings.clone(),
            self.completer,
            self.conns.clone(),
            self.reactor.clone(),
        ))
    }

    fn submit(&self, peer: &TcpPeer, requests: &[TransferRequest<'_>]) -> PluginResult<()> {
        peer.submit(requests)
    }

    fn submit_blocks(&self, peer: &TcpPeer, list: &BlockList<'_>) -> PluginResult<()> {
        peer.submit_blocks(list)
    }

    fn describe_peer(&self, peer: &TcpPeer) -> Option<String> {
        Some(peer.describe())
    }

    fn progress(&self) -> usize {
        self.conns.progress()
    }
}

impl Drop for TcpInstance {
    fn drop(&mut self) {
        self.host.debug(&format!(
            "tcp: stopping the data listener {}",
            self.target.local_addr()
        ));
    }
}

/// Connections per peer when tcp.connections is not set: one per I/O
/// thread, at least DEFAULT_CONNECTIONS and at most 64. A connection
/// carries one frame at a time and each end moves it on one thread, so
/// fewer connections than I/O threads leave threads idle: on a 16-core
/// H100 host (8 I/O threads) loopback tcp moved 256 MiB batches at 9-10
/// GB/s over 4 connections and 15-16 GB/s over 8 (1 MiB blocks; 6-7
/// against 9-11 GB/s with 4 KiB blocks), docs/benchmarks.md.
fn default_connections(io_threads: usize) -> usize {
    io_threads.clamp(DEFAULT_CONNECTIONS, 64)
}

/// I/O threads when tcp.io_threads is not set: the cores this process may
/// run on in the NUMA node of the first NIC that reports one (else all of
/// them), at most 8: one loop moves several GB/s, and more threads only
/// add wake-ups.
fn default_io_threads(host: &Host<'_>) -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    let node = host
        .nics(None)
        .unwrap_or_default()
        .iter()
        .find_map(|n| n.numa_node);
    let in_node = node
        .and_then(|n| {
            std::fs::read_to_string(format!("/sys/devices/system/node/node{n}/cpulist")).ok()
        })
        .map(|list| cpulist_len(&list))
        .filter(|n| *n > 0);
    in_node.unwrap_or(allowed).min(allowed).clamp(1, 8)
}

/// The number of CPUs in a kernel cpulist ("0-3,8-11").
fn cpulist_len(list: &str) -> usize {
    list.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|part| match part.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 0,
            },
            None => usize::from(part.parse::<usize>().is_ok()),
        })
        .sum()
}

/// FERRY_INTEGRITY (setting `integrity`): `headers` (the default: every
/// frame's header and descriptors are tagged) or `payload` (the payload
/// too).
fn payload_integrity(host: &Host<'_>) -> PluginResult<bool> {
    match host.config("integrity").as_deref().map(str::trim) {
        None | Some("" | "headers") => Ok(false),
        Some("payload") => Ok(true),
        Some(other) => Err(PluginError::new(
            ErrorCode::InvalidArgument,
            format!("FERRY_INTEGRITY={other:?}: expected headers or payload"),
        )),
    }
}

/// The address of `host` (an IP address, or a name resolved now).
fn resolve(host: &str) -> Option<IpAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(ip).filter(|ip| !ip.is_unspecified());
    }
    use std::net::ToSocketAddrs;
    (host, 0u16)
        .to_socket_addrs()
        .ok()?
        .map(|a| a.ip())
        .find(|ip| !ip.is_unspecified())
}

/// A random number naming this instance (its data listener), so peers can
/// tell it from an earlier one on the same port.
fn random_instance() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == b.len() as isize {
        return u64::from_le_bytes(b);
    }
    // No entropy source: the time and the process still differ per start.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

/// Creates and closes a TCP socket: proves the kernel and our seccomp/
/// container profile allow TCP without binding or connecting anything.
fn check_tcp_sockets() -> PluginResult<()> {
    // SAFETY: socket() has no memory-safety preconditions.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(PluginError::unavailable(format!(
            "this host refuses TCP sockets: {e}"
        )));
    }
    // SAFETY: fd is a socket we just created and own.
    unsafe { libc::close(fd) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_follow_the_io_threads_within_bounds() {
        assert_eq!(default_connections(1), DEFAULT_CONNECTIONS);
        assert_eq!(default_connections(8), 8);
        assert_eq!(default_connections(256), 64);
        assert_eq!(cpulist_len("0-3,8-11"), 8);
        assert_eq!(cpulist_len("5"), 1);
        assert_eq!(cpulist_len("3-1,x"), 0);
    }
}
