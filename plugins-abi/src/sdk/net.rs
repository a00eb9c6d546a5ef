//! The host's network interfaces that are up and have an address: what a
//! socket-based transport can use, and which interface carries a route.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::net::{Ipv4Addr, Ipv6Addr};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub loopback: bool,
    pub addresses: Vec<String>,
}

/// Interfaces that are up and carry an IPv4 or IPv6 address, by name.
pub fn list() -> std::io::Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut by_name: BTreeMap<String, Interface> = BTreeMap::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let flags = ifa.ifa_flags;
        if flags & libc::IFF_UP as u32 == 0 || ifa.ifa_name.is_null() || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated name owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family
        // tells its real type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let addr = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means the storage is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).to_string()
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means the storage is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                Ipv6Addr::from(sin6.sin6_addr.s6_addr).to_string()
            }
            _ => continue,
        };
        by_name
            .entry(name.clone())
            .or_insert_with(|| Interface {
                name,
                loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
                addresses: Vec::new(),
            })
            .addresses
            .push(addr);
    }
    // SAFETY: head came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(by_name.into_values().collect())
}

/// The interface holding `ip`, if one does.
pub fn interface_with(ip: std::net::IpAddr) -> Option<Interface> {
    list().ok()?.into_iter().find(|i| {
        i.addresses
            .iter()
            .any(|a| a.parse::<std::net::IpAddr>().ok() == Some(ip))
    })
}

/// The local address the kernel would use to reach `peer`, found without
/// sending anything (connecting a UDP socket only picks the route).
pub fn source_address_toward(peer: std::net::SocketAddr) -> Option<std::net::IpAddr> {
    let bind = if peer.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let sock = std::net::UdpSocket::bind(bind).ok()?;
    sock.connect(peer).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed_and_found_by_address() {
        let lo = interface_with("127.0.0.1".parse().unwrap()).expect("loopback interface");
        assert!(lo.loopback);
        let src = source_address_toward("127.0.0.1:9".parse().unwrap()).unwrap();
        assert!(src.is_loopback());
    }
}
