//! Same-host side channels for plugins: abstract Unix sockets (no file to
//! clean up, private to the network namespace), the credentials of the
//! process at the other end (SO_PEERCRED), and file descriptors passed with
//! a message (SCM_RIGHTS), so a plugin can hand a peer a memfd or a CUDA
//! VMM handle without a file on disk.
//!
//! Framing is the caller's: these helpers move whole fixed-length frames
//! over a stream socket, with the descriptors attached to a frame arriving
//! with it.

use super::admission::{Refusal, Source};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

/// The most descriptors one frame carries (the kernel allows 253).
pub const MAX_FDS: usize = 16;

/// Who is at the other end of a Unix socket, as the kernel says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// Listens on the abstract socket `name` (no leading NUL).
pub fn listen(name: &[u8]) -> io::Result<UnixListener> {
    UnixListener::bind_addr(&SocketAddr::from_abstract_name(name)?)
}

/// Connects to the abstract socket `name`, with `timeout` on every read
/// and write of the connection.
pub fn connect(name: &[u8], timeout: Duration) -> io::Result<UnixStream> {
    let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name)?)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

/// The process at the other end of `s`, as of when it connected.
pub fn peer_credentials(s: &UnixStream) -> io::Result<Credentials> {
    peer_cred_fd(s.as_raw_fd())
}

/// A gate's classifier (`sdk::gate::Classify`) for a same-host listener:
/// the kernel names the connecting process (SO_PEERCRED) before anything is
/// read or sent; this process's own user and `allowed` pass, with the uid
/// as their source, and anyone else is refused as another user. `rule` ends
/// the refusal's line: who may connect, in the operator's words ("only uid
/// 1000 and shm.allowed_uids may connect").
#[allow(clippy::type_complexity)]
pub fn classify_by_user(
    allowed: Vec<u32>,
    rule: String,
) -> impl Fn(&OwnedFd) -> Result<(Source, String), (Refusal, String)> + Send + 'static {
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    move |fd: &OwnedFd| match peer_cred_fd(fd.as_raw_fd()) {
        Ok(c) if c.uid == own || allowed.contains(&c.uid) => Ok((
            Source::Other(u64::from(c.uid)),
            format!("pid {} of uid {}", c.pid, c.uid),
        )),
        Ok(c) => Err((
            Refusal::PeerUser,
            format!("pid {} of uid {} ({rule})", c.pid, c.uid),
        )),
        Err(e) => Err((
            Refusal::PeerUser,
            format!("a process the kernel cannot name ({e})"),
        )),
    }
}

fn peer_cred_fd(fd: RawFd) -> io::Result<Credentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred is a valid ucred of the length passed; the kernel writes
    // at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Credentials {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Space for the control message of `MAX_FDS` descriptors, aligned for
/// cmsghdr.
#[repr(C, align(8))]
struct ControlBuf([u8; 128]);

/// Sends `frame` whole, with `fds` attached to its first byte.
pub fn send_frame(s: &UnixStream, frame: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("at most {MAX_FDS} descriptors per frame"),
        ));
    }
    let mut sent = 0;
    let mut control = ControlBuf([0; 128]);
    while sent < frame.len() {
        let mut iov = libc::iovec {
            iov_base: frame[sent..].as_ptr() as *mut libc::c_void,
            iov_len: frame.len() - sent,
        };
        // SAFETY: a zeroed msghdr is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if sent == 0 && !fds.is_empty() {
            let bytes = std::mem::size_of_val(fds) as u32;
            // SAFETY: CMSG_SPACE is arithmetic.
            let space = unsafe { libc::CMSG_SPACE(bytes) } as usize;
            msg.msg_control = control.0.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: msg_control points to `space` <= 128 bytes we own,
            // aligned for cmsghdr, so CMSG_FIRSTHDR is non-null and the
            // header and the descriptors fit.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
                std::ptr::copy_nonoverlapping(
                    fds.as_ptr(),
                    libc::CMSG_DATA(c).cast::<RawFd>(),
                    fds.len(),
                );
            }
        }
        // SAFETY: msg points to live buffers for the call.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

/// Reads one frame of exactly `frame.len()` bytes and the descriptors that
/// came with it (any number up to `MAX_FDS`; more are closed and refused).
/// `Ok(None)` when the peer closed the connection before the first byte.
pub fn recv_frame(s: &UnixStream, frame: &mut [u8]) -> io::Result<Option<Vec<OwnedFd>>> {
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut too_many = false;
    // A socket timeout in the middle of a frame is waited out (up to this
    // many times): the rest is on its way, and dropping the part read would
    // lose the frame boundary.
    let mut stalls = 0;
    while got < frame.len() {
        let mut control = ControlBuf([0; 128]);
        let mut iov = libc::iovec {
            iov_base: frame[got..].as_mut_ptr().cast(),
            iov_len: frame.len() - got,
        };
        // SAFETY: a zeroed msghdr is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = control.0.len() as _;
        // SAFETY: msg points to live buffers for the call; CLOEXEC so a
        // received descriptor never leaks into a child process.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            let timed_out = matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            if e.kind() == io::ErrorKind::Interrupted || (timed_out && got > 0 && stalls < 100) {
                stalls += 1;
                continue;
            }
            return Err(e);
        }
        // Take ownership of every descriptor that arrived, first, so none
        // leaks whatever happens next.
        // SAFETY: the kernel filled msg_control with msg_controllen bytes
        // of well-formed cmsghdrs; CMSG_NXTHDR stays inside them.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let header = libc::CMSG_LEN(0) as usize;
                    let count = ((*c).cmsg_len as usize).saturating_sub(header)
                        / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned(data.add(i));
                        if fd >= 0 {
                            // A descriptor the kernel just installed for us.
                            fds.push(OwnedFd::from_raw_fd(fd));
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            too_many = true;
        }
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection in the middle of a message",
            ));
        }
        got += n as usize;
    }
    if too_many || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer sent more than {MAX_FDS} descriptors with one message"),
        ));
    }
    Ok(Some(fds))
}

/// The inode of one of this process's namespaces ("pid", "ipc", "net"), 0
/// when it cannot be read.
pub fn namespace(kind: &str) -> u64 {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            s.split('[').nth(1)?.trim_end_matches(']').parse().ok()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};

    #[test]
    fn frames_carry_descriptors_and_credentials() {
        let name = format!("ferry-local-test-{}", std::process::id());
        let listener = listen(name.as_bytes()).unwrap();
        let client = connect(name.as_bytes(), Duration::from_secs(5)).unwrap();
        let (server, _) = listener.accept().unwrap();
        let cred = peer_credentials(&server).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        // SAFETY: getuid has no preconditions.
        assert_eq!(cred.uid, unsafe { libc::getuid() });

        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"hello").unwrap();
        file.rewind().unwrap();
        send_frame(&client, &[7u8; 40], &[file.as_raw_fd()]).unwrap();
        send_frame(&client, &[9u8; 40], &[]).unwrap();
        let mut frame = [0u8; 40];
        let fds = recv_frame(&server, &mut frame).unwrap().unwrap();
        assert_eq!(frame, [7u8; 40]);
        assert_eq!(fds.len(), 1);
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut std::fs::File::from(fds.into_iter().next().unwrap()),
            &mut text,
        )
        .unwrap();
        assert_eq!(text, "hello");
        let fds = recv_frame(&server, &mut frame).unwrap().unwrap();
        assert_eq!((frame, fds.len()), ([9u8; 40], 0));
        drop(client);
        assert!(recv_frame(&server, &mut frame).unwrap().is_none());
        assert!(namespace("pid") != 0);
    }
}
