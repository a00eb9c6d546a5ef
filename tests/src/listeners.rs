//! Reaching an engine's listeners as an attacker would, for the tests of
//! admission and refusals (tests/security.rs, floods.rs, refusals.rs,
//! floods_shm.rs): the tcp data address and shm socket from the descriptor,
//! TCP connections from a chosen source address, a raw SOCK_SEQPACKET
//! connection speaking the exchange, the refusal counts as the metrics
//! endpoint renders them, and warn lines captured from `log`.

use ferry_core::Engine;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The tcp data address of `e`.
pub fn tcp_data(e: &Engine) -> SocketAddr {
    let d = e.descriptor();
    let t = d.transports.iter().find(|t| t.name == "tcp").unwrap();
    let raw = ferry_core::descriptor::decode_blob(&t.endpoint).unwrap();
    String::from_utf8(raw)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// A TCP connection from `source` (bound before connecting) to `to`.
pub fn connect_from(source: std::net::Ipv4Addr, to: SocketAddr) -> Option<std::net::TcpStream> {
    if source == std::net::Ipv4Addr::LOCALHOST {
        return std::net::TcpStream::connect_timeout(&to, Duration::from_millis(500)).ok();
    }
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else { return None };
    // SAFETY: plain socket calls on a descriptor we own; the addresses are
    // valid sockaddr_in values of their size.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let stream = std::net::TcpStream::from_raw_fd(fd);
        let sa = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        let local = sa(source, 0);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return None;
        }
        let remote = sa(*to.ip(), to.port());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            return None;
        }
        Some(stream)
    }
}

/// The shm socket of `e` (an abstract Unix name).
pub fn shm_socket(e: &Engine) -> Vec<u8> {
    let d = e.descriptor();
    let t = d.transports.iter().find(|t| t.name == "shm").unwrap();
    let raw = ferry_core::descriptor::decode_blob(&t.endpoint).unwrap();
    crate::fuzz::shm_endpoint::Endpoint::decode(&raw)
        .unwrap()
        .socket
}

/// A SOCK_SEQPACKET connection to an abstract Unix name, as a byte stream
/// for the exchange (one packet per write); reads wait at most 5 s.
pub struct Seq(pub OwnedFd);

impl Seq {
    pub fn connect(name: &[u8]) -> std::io::Result<Seq> {
        // SAFETY: plain socket(2); checked before use.
        let fd =
            unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a zeroed sockaddr_un is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path[1..].iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
        let tv = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        // SAFETY: valid fd, an address of `len` bytes, a timeval of its size.
        unsafe {
            if libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len as libc::socklen_t,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
        Ok(Seq(fd))
    }
}

impl Read for Seq {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Write for Seq {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // SAFETY: buf is readable for its length; no SIGPIPE.
        let n = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Reads until the peer closes (or 5 s pass): the bytes it sent.
pub fn read_to_close(s: &mut impl Read) -> Vec<u8> {
    let mut all = Vec::new();
    // Room for any packet of the exchange: a SOCK_SEQPACKET read cuts a
    // longer one short.
    let mut buf = [0u8; 4096];
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    all
}

/// `ferry_refusals_total{listener, cause}` as `e`'s metrics endpoint
/// renders it (0 when the series is absent).
pub fn refusals(e: &Engine, listener: &str, cause: &str) -> u64 {
    let want = format!("ferry_refusals_total{{listener=\"{listener}\",cause=\"{cause}\"}} ");
    e.metrics_prometheus()
        .lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (up to 10 s: not a timing assertion, a bound on a hang) until
/// `cond` holds; returns whether it did.
pub fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Keeps every warn line (and worse), as "LEVEL target: message".
struct Capture;
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let line = format!("{} {}: {}", r.level(), r.target(), r.args());
            eprintln!("{line}");
            LINES.lock().unwrap_or_else(|p| p.into_inner()).push(line);
        }
    }
    fn flush(&self) {}
}

/// Starts capturing warn lines (once per process).
pub fn capture_warnings() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = log::set_logger(&Capture);
        log::set_max_level(log::LevelFilter::Warn);
    });
}

/// The warn lines captured so far.
pub fn warnings() -> Vec<String> {
    LINES.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
