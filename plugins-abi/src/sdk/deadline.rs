//! Blocking socket I/O under one deadline for a whole exchange, and a check
//! for idle connections the peer has closed.
//!
//! A socket timeout (SO_RCVTIMEO) bounds each call, not a message: a peer
//! sending one byte just before each timeout could hold a connection (and
//! its thread) for as long as it likes. [`DeadlineStream`] re-arms the
//! socket timeout before every call with the time left, so a message (a
//! handshake, a control frame) either completes by its deadline or fails
//! with `TimedOut`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// A borrowed TCP stream whose reads and writes all finish by one instant.
pub struct DeadlineStream<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> DeadlineStream<'a> {
    /// Reads and writes on `stream` must be done within `timeout` from now.
    pub fn new(stream: &'a TcpStream, timeout: Duration) -> DeadlineStream<'a> {
        DeadlineStream {
            stream,
            deadline: Instant::now() + timeout,
        }
    }

    /// Starts a new exchange: `timeout` from now.
    pub fn restart(&mut self, timeout: Duration) {
        self.deadline = Instant::now() + timeout;
    }

    /// Time left, or a `TimedOut` error once the deadline has passed.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        // A zero socket timeout means "wait forever": never set one.
        Ok(left.max(Duration::from_millis(1)))
    }
}

fn timed_out(e: io::Error) -> io::Error {
    // The socket timeout ending a call is this exchange's deadline.
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
    } else {
        e
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.stream).read(buf).map_err(timed_out)
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Waits up to `timeout` for `fd` to become readable (data, end of stream
/// or an error). Returns false when nothing arrived in time.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return rc != 0;
    }
}

/// Whether a connection with nothing outstanding has been closed (or
/// written to) by its peer: an idle connection should have nothing to
/// read, so any input, end of stream or error means it cannot be reused.
pub fn idle_connection_is_dead(stream: &impl AsRawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd; a zero timeout never blocks.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    rc != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_trickling_peer_cannot_stretch_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // Nothing is sent until the client has checked that an idle
            // connection reads as alive.
            let _ = wait.recv();
            // One byte every 50 ms: each read finishes, the whole never does.
            for _ in 0..40 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let client = TcpStream::connect(addr).unwrap();
        assert!(!idle_connection_is_dead(&client));
        go.send(()).unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 100];
        let err = DeadlineStream::new(&client, Duration::from_millis(300))
            .read_exact(&mut buf)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_secs(1));
        writer.join().unwrap();
        // The writer is gone: the idle connection reads as dead.
        assert!(idle_connection_is_dead(&client));
    }
}
