//! Every byte cuda-ipc exchanges with a peer, and its checks: the endpoint
//! and the keys (short text in the segment descriptor), and the frames of
//! the instances' Unix socket. Peers are hostile until checked: every
//! decoder returns `None` (or an error) for anything malformed, and never
//! panics or allocates more than a frame's fixed bound.
//!
//! endpoint: `ferry-cuda-ipc/1 pid=<pid> uid=<uid> pidns=<inode> ipcns=<inode> boot=<hex> sock=<hex>`
//! key:      `dev <id> <addr> <len> <gpu-uuid>`   device memory of that GPU
//!           `host <id> <addr> <len> shared`      host memory in a file peers may map
//!           `host <id> <addr> <len> private`     host memory no peer can map
//!
//! Socket frames (little endian), after the authentication exchange:
//!
//! ```text
//! client -> server  OPEN        op=1 id                       16 bytes
//!                   REVOKE_ACK  op=3 id                       16 bytes
//! server -> client  REPLY       op=2 status id addr len kind count   40 bytes, then
//!                   `count` PIECEs (each with its fd, if any), or, when status
//!                   is not 0, `count` bytes of message (at most MAX_MESSAGE)
//!                   REVOKE      op=4 0 id 0 0 0 0             40 bytes
//! PIECE             start len fd_offset has_fd handle[64]     96 bytes
//! ```

/// What the endpoint says about the instance that published it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub pid: i32,
    pub uid: u32,
    pub pidns: u64,
    pub ipcns: u64,
    /// The host's boot id: two processes with different ones are on
    /// different hosts (or different boots of one).
    pub boot: Vec<u8>,
    /// Abstract Unix socket name, without the leading NUL.
    pub socket: Vec<u8>,
}

const ENDPOINT_MAGIC: &str = "ferry-cuda-ipc/1";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 200 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl Endpoint {
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{ENDPOINT_MAGIC} pid={} uid={} pidns={} ipcns={} boot={} sock={}",
            self.pid,
            self.uid,
            self.pidns,
            self.ipcns,
            hex(&self.boot),
            hex(&self.socket)
        )
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<Endpoint> {
        let text = std::str::from_utf8(bytes).ok().filter(|t| t.len() < 512)?;
        let mut parts = text.split(' ');
        if parts.next()? != ENDPOINT_MAGIC {
            return None;
        }
        let (mut pid, mut uid, mut pidns, mut ipcns, mut boot, mut socket) =
            (None, None, None, None, None, None);
        for p in parts {
            let (k, v) = p.split_once('=')?;
            match k {
                "pid" => pid = v.parse::<i32>().ok().filter(|p| *p > 0),
                "uid" => uid = v.parse().ok(),
                "pidns" => pidns = v.parse().ok(),
                "ipcns" => ipcns = v.parse().ok(),
                "boot" => boot = unhex(v).filter(|b| b.len() <= 64),
                "sock" => socket = unhex(v).filter(|s| !s.is_empty() && s.len() <= 100),
                _ => {}
            }
        }
        Some(Endpoint {
            pid: pid?,
            uid: uid?,
            pidns: pidns?,
            ipcns: ipcns?,
            boot: boot?,
            socket: socket?,
        })
    }
}

/// What memory a key names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Device memory of the GPU with this UUID ("GPU-...").
    Device { gpu: String },
    /// Host memory; `shared` when it lives in a file the peer may map.
    Host { shared: bool },
}

/// A registered buffer as peers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    /// The registration: a revoked id is never served again.
    pub id: u64,
    pub addr: u64,
    pub len: u64,
    pub memory: Memory,
}

impl Key {
    pub fn encode(&self) -> Vec<u8> {
        match &self.memory {
            Memory::Device { gpu } => {
                format!("dev {} {:x} {:x} {gpu}", self.id, self.addr, self.len)
            }
            Memory::Host { shared } => format!(
                "host {} {:x} {:x} {}",
                self.id,
                self.addr,
                self.len,
                if *shared { "shared" } else { "private" }
            ),
        }
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<Key> {
        let text = std::str::from_utf8(bytes).ok().filter(|t| t.len() < 256)?;
        let mut p = text.split(' ');
        let kind = p.next()?;
        let id = p.next()?.parse().ok()?;
        let addr = u64::from_str_radix(p.next()?, 16).ok()?;
        let len = u64::from_str_radix(p.next()?, 16).ok()?;
        let last = p.next()?;
        if p.next().is_some() || len == 0 || addr.checked_add(len).is_none() {
            return None;
        }
        let memory = match kind {
            "dev" if valid_uuid(last) => Memory::Device {
                gpu: last.to_string(),
            },
            "host" => Memory::Host {
                shared: match last {
                    "shared" => true,
                    "private" => false,
                    _ => return None,
                },
            },
            _ => return None,
        };
        Some(Key {
            id,
            addr,
            len,
            memory,
        })
    }
}

/// "GPU-" and hex digits and dashes, as the driver prints UUIDs.
fn valid_uuid(s: &str) -> bool {
    s.len() <= 64
        && s.strip_prefix("GPU-").is_some_and(|rest| {
            !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        })
}

pub const OP_OPEN: u32 = 1;
pub const OP_REPLY: u32 = 2;
pub const OP_REVOKE_ACK: u32 = 3;
pub const OP_REVOKE: u32 = 4;

pub const REQUEST_LEN: usize = 16;
pub const REPLY_LEN: usize = 40;
pub const PIECE_LEN: usize = 96;
/// The most pieces one registration is exported as (VMM memory mapped in
/// chunks: 1 GiB in 2 MiB chunks is 512).
pub const MAX_PIECES: u32 = 65536;
/// The longest error message a reply carries.
pub const MAX_MESSAGE: u32 = 1024;

/// A client's frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: u32,
    pub id: u64,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..4].copy_from_slice(&self.op.to_le_bytes());
        b[8..].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REQUEST_LEN]) -> Option<Request> {
        let op = u32::from_le_bytes(b[..4].try_into().ok()?);
        if !matches!(op, OP_OPEN | OP_REVOKE_ACK) || b[4..8] != [0; 4] {
            return None;
        }
        Some(Request {
            op,
            id: u64::from_le_bytes(b[8..].try_into().ok()?),
        })
    }
}

/// How an exported registration is opened.
pub const KIND_IPC: u32 = 1;
pub const KIND_VMM: u32 = 2;
pub const KIND_HOST: u32 = 3;

/// A server's frame header: a reply to OPEN, or a revocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub op: u32,
    /// 0, or a negative Ferry error code (the message follows).
    pub status: i32,
    pub id: u64,
    /// The registered range.
    pub addr: u64,
    pub len: u64,
    /// KIND_*.
    pub kind: u32,
    /// Pieces that follow (or message bytes, when status is not 0).
    pub count: u32,
}

impl Reply {
    pub fn revoke(id: u64) -> Reply {
        Reply {
            op: OP_REVOKE,
            status: 0,
            id,
            addr: 0,
            len: 0,
            kind: 0,
            count: 0,
        }
    }

    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let mut b = [0u8; REPLY_LEN];
        b[..4].copy_from_slice(&self.op.to_le_bytes());
        b[4..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.kind.to_le_bytes());
        b[36..40].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REPLY_LEN]) -> Option<Reply> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let r = Reply {
            op: u32_at(0),
            status: u32_at(4) as i32,
            id: u64_at(8),
            addr: u64_at(16),
            len: u64_at(24),
            kind: u32_at(32),
            count: u32_at(36),
        };
        let ok = match r.op {
            OP_REVOKE => true,
            OP_REPLY if r.status != 0 => r.status < 0 && r.count <= MAX_MESSAGE,
            OP_REPLY => {
                matches!(r.kind, KIND_IPC | KIND_VMM | KIND_HOST)
                    && (1..=MAX_PIECES).contains(&r.count)
                    && r.len > 0
                    && r.addr.checked_add(r.len).is_some()
                    && (r.kind == KIND_VMM || r.count == 1)
            }
            _ => false,
        };
        ok.then_some(r)
    }
}

/// One part of an exported registration: an allocation to open (by the
/// IPC handle, or by the descriptor sent with it) that holds
/// `[start, start + len)` of the exporter's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub start: u64,
    pub len: u64,
    /// Where `start` lies in the descriptor's file or allocation.
    pub fd_offset: u64,
    pub has_fd: bool,
    pub handle: [u8; 64],
}

impl Piece {
    pub fn encode(&self) -> [u8; PIECE_LEN] {
        let mut b = [0u8; PIECE_LEN];
        b[..8].copy_from_slice(&self.start.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.fd_offset.to_le_bytes());
        b[24] = u8::from(self.has_fd);
        b[32..].copy_from_slice(&self.handle);
        b
    }

    pub fn decode(b: &[u8; PIECE_LEN]) -> Option<Piece> {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if b[25..32] != [0; 7] {
            return None;
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[32..]);
        let p = Piece {
            start: u64_at(0),
            len: u64_at(8),
            fd_offset: u64_at(16),
            has_fd: match b[24] {
                0 => false,
                1 => true,
                _ => return None,
            },
            handle,
        };
        (p.len > 0
            && p.start.checked_add(p.len).is_some()
            && p.fd_offset.checked_add(p.len).is_some())
        .then_some(p)
    }
}

/// Checks that pieces (already decoded) are what a reply promised: of one
/// kind's shape, contiguous and in order, and covering the registered range.
pub fn check_pieces(reply: &Reply, pieces: &[Piece]) -> Result<(), String> {
    let (Some(first), Some(last)) = (pieces.first(), pieces.last()) else {
        return Err("no pieces".into());
    };
    for w in pieces.windows(2) {
        if w[0].start + w[0].len != w[1].start {
            return Err("pieces are not contiguous".into());
        }
    }
    for p in pieces {
        let wants_fd = reply.kind != KIND_IPC;
        if p.has_fd != wants_fd {
            return Err("a piece carries the wrong kind of handle".into());
        }
    }
    let end = last.start + last.len;
    if reply.addr < first.start || reply.addr + reply.len > end {
        return Err(format!(
            "the registered range [{:#x}, +{}) is not inside its pieces [{:#x}, {end:#x})",
            reply.addr, reply.len, first.start
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_keys_round_trip() {
        let e = Endpoint {
            pid: 42,
            uid: 1000,
            pidns: 4026531836,
            ipcns: 4026531839,
            boot: vec![1, 2, 3],
            socket: b"ferry-cuda-ipc-42-x".to_vec(),
        };
        assert_eq!(Endpoint::decode(&e.encode()), Some(e));
        for k in [
            Key {
                id: 7,
                addr: 0x7f00_0000_0000,
                len: 1 << 30,
                memory: Memory::Device {
                    gpu: "GPU-00112233-4455-6677-8899-aabbccddeeff".into(),
                },
            },
            Key {
                id: 8,
                addr: 0x1000,
                len: 4096,
                memory: Memory::Host { shared: true },
            },
            Key {
                id: 9,
                addr: 0x1000,
                len: 1,
                memory: Memory::Host { shared: false },
            },
        ] {
            assert_eq!(Key::decode(&k.encode()), Some(k));
        }
    }

    #[test]
    fn malformed_input_is_refused() {
        for bad in [
            &b""[..],
            b"dev 1 10 0 GPU-00",
            b"dev 1 ffffffffffffffff 2 GPU-00",
            b"dev 1 10 10 GPU-",
            b"dev 1 10 10 GPU-zz",
            b"host 1 10 10 maybe",
            b"host 1 10 10 shared extra",
            b"\xff\xfe",
            b"map 1 2 3 4",
        ] {
            assert_eq!(Key::decode(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(Endpoint::decode(b"ferry-cuda-ipc/1 pid=0 uid=1"), None);
        assert_eq!(Endpoint::decode(b"ferry-shm/1 pid=3"), None);
        assert_eq!(Request::decode(&[0xff; REQUEST_LEN]), None);
        let mut r = Reply {
            op: OP_REPLY,
            status: 0,
            id: 1,
            addr: 0x1000,
            len: 10,
            kind: KIND_IPC,
            count: 2,
        };
        assert_eq!(
            Reply::decode(&r.encode()),
            None,
            "an IPC handle is one piece"
        );
        r.count = 1;
        assert_eq!(Reply::decode(&r.encode()), Some(r));
        r.count = MAX_PIECES + 1;
        r.kind = KIND_VMM;
        assert_eq!(Reply::decode(&r.encode()), None);
        r.status = 5;
        assert_eq!(Reply::decode(&r.encode()), None);
    }

    #[test]
    fn pieces_must_cover_the_registration() {
        let piece = |start, len| Piece {
            start,
            len,
            fd_offset: 0,
            has_fd: true,
            handle: [0; 64],
        };
        let reply = Reply {
            op: OP_REPLY,
            status: 0,
            id: 1,
            addr: 0x1800,
            len: 0x1000,
            kind: KIND_VMM,
            count: 2,
        };
        assert!(check_pieces(&reply, &[piece(0x1000, 0x1000), piece(0x2000, 0x1000)]).is_ok());
        assert!(check_pieces(&reply, &[piece(0x1000, 0x1000)]).is_err());
        assert!(check_pieces(&reply, &[piece(0x1000, 0x1000), piece(0x2400, 0x1000)]).is_err());
        assert!(check_pieces(&reply, &[]).is_err());
        let p = piece(0x1000, 0x2000);
        assert_eq!(Piece::decode(&p.encode()), Some(p));
    }
}
