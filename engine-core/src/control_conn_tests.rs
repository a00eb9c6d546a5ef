use super::*;
use crate::control::MAX_BODY;
use crate::control_budget::BodyBudget;
use ferry_plugins_abi::sdk::auth::{self, Token};
use std::os::unix::net::UnixStream;

/// A server's and a client's session keys, from a real exchange.
fn sessions() -> (Session, Session) {
    let (a, b) = UnixStream::pair().unwrap();
    let token = Token::new("unit-test-token");
    let t2 = token.clone();
    let server = std::thread::spawn(move || {
        let mut a = a;
        auth::accept(&mut a, t2.as_ref(), "control").unwrap()
    });
    let mut b = b;
    let client = auth::connect(&mut b, token.as_ref(), "control", "test").unwrap();
    (server.join().unwrap(), client)
}

fn host() -> Source {
    Source::ip(std::net::Ipv4Addr::new(127, 0, 0, 2).into())
}

fn conn(budget: &BodyBudget) -> (Conn, Session) {
    let (server, client) = sessions();
    let c = Conn::new(
        "127.0.0.2:5000".into(),
        server,
        budget.hold(host()),
        Duration::from_millis(500),
        Duration::from_secs(60),
        Instant::now(),
    );
    (c, client)
}

fn sealed(client: &mut Session, kind: MsgType, body: &[u8]) -> Vec<u8> {
    let mut f = encode_frame(kind, body);
    let tag = client.send.seal(&[&f]);
    f.extend_from_slice(&tag);
    f
}

/// A socket as the loop sees it: at most `step` bytes per read, then
/// WouldBlock once what has "arrived" is read.
struct Trickle {
    data: Vec<u8>,
    arrived: usize,
    pos: usize,
    step: usize,
}

impl Trickle {
    fn new(data: Vec<u8>, step: usize) -> Trickle {
        Trickle {
            arrived: 0,
            data,
            pos: 0,
            step,
        }
    }

    fn arrive(&mut self, n: usize) {
        self.arrived = (self.arrived + n).min(self.data.len());
    }
}

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step).min(self.arrived - self.pos);
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[test]
fn a_frame_split_across_many_reads_arrives_whole_and_holds_only_what_came() {
    let budget = BodyBudget::default();
    let (mut c, mut client) = conn(&budget);
    let body: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    let mut wire = Trickle::new(sealed(&mut client, MsgType::PluginRequest, &body), 7);
    let now = Instant::now();
    // The header alone: it claims 300,000 bytes and holds none of them.
    wire.arrive(HEADER_LEN);
    assert!(matches!(c.read_from(&mut wire, now), Progress::Wait));
    assert_eq!(budget.in_use(), 0);
    assert!(c.idle_for(now).is_none(), "a frame has started");
    // The body comes in pieces: what is held is what came.
    let mut reads = 0;
    loop {
        wire.arrive(1000);
        reads += 1;
        match c.read_from(&mut wire, now) {
            Progress::Wait => {
                let came = wire.pos.saturating_sub(HEADER_LEN);
                assert_eq!(budget.in_use(), came);
            }
            Progress::Frame(kind, got, held) => {
                assert_eq!(kind, MsgType::PluginRequest);
                assert!(got == body);
                assert_eq!(held.bytes(), body.len());
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(reads > 300, "{reads}");
    // The body's bytes went with it; answered, the connection reads on.
    assert_eq!(budget.in_use(), 0);
    assert!(!c.wants_read(), "one request at a time");
    c.reply(MsgType::PluginReply, b"ok", now);
    let mut out = Vec::new();
    assert!(c.write_to(&mut out, now).unwrap());
    assert!(c.wants_read());
    // The reply is a sealed frame the client reads as ever.
    let header: [u8; HEADER_LEN] = out[..HEADER_LEN].try_into().unwrap();
    assert_eq!(decode_header(&header).unwrap(), (MsgType::PluginReply, 2));
    assert_eq!(&out[HEADER_LEN..HEADER_LEN + 2], b"ok");
    client
        .recv
        .open(&[&out[..HEADER_LEN + 2]], &out[HEADER_LEN + 2..])
        .unwrap();
}

#[test]
fn two_frames_in_one_read_are_taken_one_at_a_time() {
    let budget = BodyBudget::default();
    let (mut c, mut client) = conn(&budget);
    let mut bytes = sealed(&mut client, MsgType::GetDescriptor, b"{}");
    bytes.extend(sealed(&mut client, MsgType::Notify, b"hello"));
    let len = bytes.len();
    let mut wire = Trickle::new(bytes, usize::MAX);
    wire.arrive(len);
    let now = Instant::now();
    assert!(matches!(
        c.read_from(&mut wire, now),
        Progress::Frame(MsgType::GetDescriptor, _, _)
    ));
    assert!(matches!(c.read_from(&mut wire, now), Progress::Wait));
    c.reply(MsgType::Descriptor, b"{}", now);
    c.write_to(&mut Vec::new(), now).unwrap();
    match c.read_from(&mut wire, now) {
        Progress::Frame(MsgType::Notify, body, _) => assert_eq!(body, b"hello"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_bad_tag_closes_with_an_integrity_refusal() {
    let budget = BodyBudget::default();
    let (mut c, mut client) = conn(&budget);
    let mut bytes = sealed(&mut client, MsgType::GetDescriptor, b"{}");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    let mut wire = Trickle::new(bytes, 5);
    wire.arrive(usize::MAX);
    match c.read_from(&mut wire, Instant::now()) {
        Progress::Closed(f) => {
            assert_eq!(f.refusal, Some(Refusal::Integrity));
            assert!(f.error.message.contains("integrity check failed"), "{f:?}");
            assert!(
                !f.tell,
                "nothing is said on a connection that failed its tag"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_length_over_the_limit_closes_with_a_protocol_refusal() {
    let budget = BodyBudget::default();
    let (mut c, _client) = conn(&budget);
    let mut header = encode_frame(MsgType::GetDescriptor, b"");
    header[8..12].copy_from_slice(&((MAX_BODY + 1) as u32).to_le_bytes());
    let mut wire = Trickle::new(header, 3);
    wire.arrive(usize::MAX);
    match c.read_from(&mut wire, Instant::now()) {
        Progress::Closed(f) => {
            assert_eq!(f.refusal, Some(Refusal::Protocol));
            assert_eq!(f.error.code, ErrorCode::Protocol);
            assert!(f.error.message.contains("exceeds"), "{f:?}");
            assert!(f.tell);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(budget.in_use(), 0);
}

#[test]
fn a_frame_that_does_not_fit_waits_and_is_refused_busy_at_its_deadline() {
    // A share of 100 bytes per host, 80 of it taken by another frame.
    let budget = BodyBudget::new(1000, 100);
    let mut other = budget.hold(host());
    assert_eq!(other.grow(80), 80);
    let (mut c, mut client) = conn(&budget);
    let body = vec![7u8; 50];
    let mut wire = Trickle::new(sealed(&mut client, MsgType::Notify, &body), usize::MAX);
    wire.arrive(usize::MAX);
    let start = Instant::now();
    assert!(matches!(c.read_from(&mut wire, start), Progress::Stalled));
    assert!(c.stalled() && !c.wants_read());
    assert_eq!(budget.in_use(), 100);
    // Bytes given back: it goes on, and holds its whole body.
    drop(other);
    match c.read_from(&mut wire, start) {
        Progress::Frame(_, got, held) => {
            assert_eq!((got.len(), held.bytes()), (50, 50));
        }
        other => panic!("{other:?}"),
    }
    // The same wait past the frame deadline: refused BUSY.
    let (mut c, mut client) = conn(&budget);
    let mut hog = budget.hold(host());
    hog.grow(100);
    let mut wire = Trickle::new(sealed(&mut client, MsgType::Notify, &body), usize::MAX);
    wire.arrive(usize::MAX);
    assert!(matches!(c.read_from(&mut wire, start), Progress::Stalled));
    assert!(matches!(c.check(start), Due::Nothing));
    match c.check(start + Duration::from_millis(500)) {
        Due::Closed(f) => {
            assert_eq!(f.refusal, Some(Refusal::Busy));
            assert_eq!(f.error.code, ErrorCode::Busy);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_peer_too_slow_for_the_frame_deadline_is_refused_and_an_idle_one_closed() {
    let budget = BodyBudget::default();
    let (mut c, mut client) = conn(&budget);
    let start = Instant::now();
    let due = c.next_due().unwrap();
    assert!(due > start + Duration::from_secs(59));
    assert!(matches!(
        c.check(due - Duration::from_secs(1)),
        Due::Nothing
    ));
    assert!(matches!(c.check(due), Due::Idle));
    let mut wire = Trickle::new(sealed(&mut client, MsgType::Notify, b"abc"), usize::MAX);
    wire.arrive(HEADER_LEN + 1);
    assert!(matches!(c.read_from(&mut wire, start), Progress::Wait));
    match c.check(start + Duration::from_millis(500)) {
        Due::Closed(f) => assert_eq!(f.refusal, Some(Refusal::Protocol)),
        other => panic!("{other:?}"),
    }
}
