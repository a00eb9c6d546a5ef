//! Scatter/gather socket I/O without blocking: bytes go straight between
//! the socket and the caller's memory (readv/writev style), never through
//! an intermediate buffer; a call moves what the socket takes now, and the
//! caller's state machine picks up where it stopped.

use std::io;
use std::os::fd::RawFd;

const IOV_MAX: usize = 1024;

/// A list of memory ranges consumed front to back.
pub struct IoSlices {
    iov: Vec<libc::iovec>,
    idx: usize,
    remaining: usize,
}

// SAFETY: the iovecs point at memory whose owner (the engine's registered
// buffers, the application's unregistered local buffers, which the engine's
// API requires to stay valid until their requests complete, or buffers owned
// next to the IoSlices) keeps it valid while the I/O runs; the kernel, not
// this code, dereferences them (a bad one is EFAULT); IoSlices itself is only
// plain data.
unsafe impl Send for IoSlices {}

impl IoSlices {
    pub fn new() -> IoSlices {
        IoSlices {
            iov: Vec::new(),
            idx: 0,
            remaining: 0,
        }
    }

    /// Adds a range. The caller keeps the memory valid until the I/O is done.
    pub fn push(&mut self, ptr: *const u8, len: usize) {
        if len == 0 {
            return;
        }
        self.iov.push(libc::iovec {
            iov_base: ptr.cast_mut().cast(),
            iov_len: len,
        });
        self.remaining += len;
    }

    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Bytes still to move.
    pub fn len(&self) -> usize {
        self.remaining
    }

    fn advance(&mut self, mut n: usize) {
        self.remaining -= n;
        while n > 0 {
            let v = &mut self.iov[self.idx];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.idx += 1;
            } else {
                // SAFETY: n < iov_len, so the new base stays inside the range.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }

    fn window(&mut self) -> (*mut libc::iovec, usize) {
        let rest = &mut self.iov[self.idx..];
        (rest.as_mut_ptr(), rest.len().min(IOV_MAX))
    }
}

impl Default for IoSlices {
    fn default() -> Self {
        IoSlices::new()
    }
}

/// One sendmsg; returns bytes sent (0 with `WouldBlock` mapped to Ok(0)).
pub fn send_some(fd: RawFd, s: &mut IoSlices, dontwait: bool) -> io::Result<usize> {
    if s.is_done() {
        return Ok(0);
    }
    let (iov, n) = s.window();
    // SAFETY: a zeroed msghdr is valid; we set only the iovec fields.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = n as _;
    let mut flags = libc::MSG_NOSIGNAL;
    if dontwait {
        flags |= libc::MSG_DONTWAIT;
    }
    // SAFETY: msg points at n valid iovecs describing readable memory.
    let rc = unsafe { libc::sendmsg(fd, &msg, flags) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    s.advance(rc as usize);
    Ok(rc as usize)
}

/// One recvmsg; Ok(0) when nothing arrived within the socket's tick.
pub fn recv_some(fd: RawFd, s: &mut IoSlices, dontwait: bool) -> io::Result<usize> {
    if s.is_done() {
        return Ok(0);
    }
    let (iov, n) = s.window();
    // SAFETY: a zeroed msghdr is valid; we set only the iovec fields.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = n as _;
    let flags = if dontwait { libc::MSG_DONTWAIT } else { 0 };
    // SAFETY: msg points at n valid iovecs describing writable memory.
    let rc = unsafe { libc::recvmsg(fd, &mut msg, flags) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    if rc == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the connection",
        ));
    }
    s.advance(rc as usize);
    Ok(rc as usize)
}

/// Readies a connected socket for the I/O loops: TCP_NODELAY (frames are
/// whole when written) and non-blocking.
pub fn configure(stream: &std::net::TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_nonblocking(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advancing_across_ranges() {
        let a = [0u8; 10];
        let b = [0u8; 5];
        let mut s = IoSlices::new();
        s.push(a.as_ptr(), a.len());
        s.push(b.as_ptr(), 0);
        s.push(b.as_ptr(), b.len());
        assert_eq!(s.len(), 15);
        s.advance(12);
        assert_eq!(s.len(), 3);
        assert_eq!(s.idx, 1);
        assert_eq!(s.iov[1].iov_len, 3);
        s.advance(3);
        assert!(s.is_done());
    }
}
