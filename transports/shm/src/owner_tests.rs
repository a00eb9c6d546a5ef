//! One serving thread for every peer: a peer that never reads its answers
//! holds one and stops being read, and the others are served meanwhile.

use super::*;
use crate::channel::{self, Client, ClientEvents};
use ferry_plugins_abi::sdk::auth;
use std::io::{Read, Write};
use std::os::fd::RawFd;

struct Quiet;

impl ClientEvents for Quiet {
    fn revoke(&self, _id: u64, _token: u64) {}
    fn closed(&self) {}
}

fn token() -> Option<Token> {
    Token::new("shm-owner-test")
}

/// One packet per call, for the exchange.
struct Packets(RawFd);

impl Read for Packets {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::recv(self.0, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Write for Packets {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: buf is readable for its length; no SIGPIPE.
        let n = unsafe { libc::send(self.0, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_peer_that_never_reads_holds_one_answer_and_blocks_no_one() {
    let name = format!("ferry-shm-owner-test-{}", std::process::id()).into_bytes();
    let refusals = Arc::new(Refusals::new("shm"));
    let _server = Server::start(
        channel::listen(&name).unwrap(),
        Arc::new(|_| None),
        Arc::new(|_| false),
        Admission {
            token: token(),
            auth_timeout: Duration::from_secs(2),
            max_pending: 8,
            max_pending_per_source: 8,
            allowed_uids: Vec::new(),
            refusals: refusals.clone(),
            log: Arc::new(|_: &str| {}),
        },
    )
    .unwrap();
    let pid = std::process::id() as i32;
    // The greedy peer: MAP after MAP, never reading an answer, until its
    // own socket takes no more.
    let greedy = channel::open(&name, pid).unwrap();
    auth::connect(
        &mut Packets(greedy.as_raw_fd()),
        token().as_ref(),
        "shm",
        "owner",
    )
    .unwrap();
    let map = Msg {
        kind: MAP,
        id: 1,
        a: 7,
        b: 0,
    }
    .encode();
    let mut sent = 0u64;
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        // SAFETY: map is readable for its length; MSG_DONTWAIT never blocks.
        let n = unsafe {
            libc::send(
                greedy.as_raw_fd(),
                map.as_ptr().cast(),
                map.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            // Full: the owner stopped reading it (one answer held).
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: send from `map`, a live buffer of map.len() bytes, on a
            // socket this test owns.
            let again = unsafe {
                libc::send(
                    greedy.as_raw_fd(),
                    map.as_ptr().cast(),
                    map.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if again < 0 {
                break;
            }
        }
        sent += 1;
    }
    assert!(
        Instant::now() < until,
        "the owner kept reading a peer that never reads ({sent} MAPs)"
    );
    // Another peer is served meanwhile.
    let c = Client::connect(
        &name,
        pid,
        Arc::new(Quiet),
        token().as_ref(),
        Duration::from_secs(5),
    )
    .unwrap();
    let e = c.map(7, Duration::from_secs(5)).err().unwrap();
    assert!(e.contains("no longer shares"), "{e}");
    // The slow reader was only paused, not dropped: once it reads, every
    // MAP it sent is answered (a server that blocked on it would have
    // hung up on it instead, after its send deadline).
    let mut answered = 0u64;
    let mut buf = [0u8; crate::wire::MSG_LEN];
    let until = Instant::now() + Duration::from_secs(10);
    while answered < sent && Instant::now() < until {
        // SAFETY: buf is writable for its length; the socket's receive
        // timeout bounds the call.
        let n = unsafe { libc::recv(greedy.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n == 0 {
            break;
        }
        if n == buf.len() as isize {
            assert_eq!(Msg::decode(&buf).map(|m| m.kind), Some(MAP_ERR));
            answered += 1;
        }
    }
    eprintln!(
        "a peer that never reads sent {sent} MAPs before the owner stopped reading it; once it \
         read, {answered} were answered"
    );
    assert_eq!(answered, sent, "the slow reader was dropped");
    assert_eq!(refusals.total(), 0);
}
