//! Ferry's TCP transport plugin: moves host memory between engines over TCP
//! sockets. It needs nothing but a kernel with TCP, so it is the transport of
//! last resort on every node and the only cross-host one without RDMA.
//!
//! Loaded at run time as `libferry_transport_tcp.so` through the plugin ABI.

mod interfaces;

use ferry_plugins_abi::sdk::{Host, PluginError, PluginResult, ProbeDevice, ProbeReport};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use std::ffi::CStr;

pub struct TcpTransport;

impl ferry_plugins_abi::sdk::TransportPlugin for TcpTransport {
    const NAME: &'static CStr = c"tcp";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr = c"Host memory over TCP sockets; works on every host";

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        check_tcp_sockets()?;
        report.set_capabilities(
            sys::FERRY_MEM_HOST,
            sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST,
        );
        // The host's topology knows each interface's PCI function and NUMA
        // node; without it we still list the interfaces.
        let nics = host.nics(None).unwrap_or_default();
        let interfaces = interfaces::list().map_err(|e| {
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
            report.add_device(&ProbeDevice {
                name: &itf.name,
                pci_bus_id: nic.map(|n| n.pci_bus_id.as_str()).filter(|p| !p.is_empty()),
                numa_node: nic.and_then(|n| n.numa_node),
                detail: Some(&detail),
                mem_kinds: sys::FERRY_MEM_HOST,
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
}

ferry_plugins_abi::export_transport_plugin!(TcpTransport);

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
