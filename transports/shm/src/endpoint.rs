//! What a peer learns about this instance (the endpoint) and about each
//! registered buffer (its key). Both are short text; parsing treats them as
//! hostile input.
//!
//! endpoint: `ferry-shm/1 pid=<pid> pidns=<inode> uid=<uid> sock=<hex> probe=<hex> cma=<on|off>`
//! key:      `map <id> <token> <base> <len> <offset>`  (memory the engine
//!                                            allocated: the registered range
//!                                            [base, base + len) lies at
//!                                            <offset> in the file <token>)
//!           `cma <id> <base> <len>`          (any other memory: cross-memory attach)
//!
//! `id` names one registration; a revoked id is never served again, and a
//! new registration of the same memory gets a new id.

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub pid: i32,
    pub pidns: u64,
    pub uid: u32,
    /// Abstract Unix socket name, without the leading NUL.
    pub socket: Vec<u8>,
    /// Address of a byte in the peer that cross-memory attach may read, to
    /// learn whether the kernel allows it.
    pub probe: u64,
    /// Whether the peer lets others attach to it.
    pub cma: bool,
}

const MAGIC: &str = "ferry-shm/1";

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
            "{MAGIC} pid={} pidns={} uid={} sock={} probe={:x} cma={}",
            self.pid,
            self.pidns,
            self.uid,
            hex(&self.socket),
            self.probe,
            if self.cma { "on" } else { "off" }
        )
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<Endpoint> {
        let text = std::str::from_utf8(bytes).ok().filter(|t| t.len() < 512)?;
        let mut parts = text.split(' ');
        if parts.next()? != MAGIC {
            return None;
        }
        let (mut pid, mut pidns, mut uid, mut socket, mut probe, mut cma) =
            (None, None, None, None, None, None);
        for p in parts {
            let (k, v) = p.split_once('=')?;
            match k {
                "pid" => pid = v.parse::<i32>().ok().filter(|p| *p > 0),
                "pidns" => pidns = v.parse().ok(),
                "uid" => uid = v.parse().ok(),
                "sock" => socket = unhex(v).filter(|s| !s.is_empty() && s.len() <= 100),
                "probe" => probe = u64::from_str_radix(v, 16).ok(),
                "cma" => cma = Some(v == "on"),
                _ => {}
            }
        }
        Some(Endpoint {
            pid: pid?,
            pidns: pidns?,
            uid: uid?,
            socket: socket?,
            probe: probe?,
            cma: cma?,
        })
    }
}

/// How a peer's buffer can be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    /// Memory the peer's engine allocated: map the file by token; the
    /// buffer starts `offset` bytes into it.
    Map {
        id: u64,
        token: u64,
        base: u64,
        len: u64,
        offset: u64,
    },
    /// Any other memory of the peer: cross-memory attach.
    Cma { id: u64, base: u64, len: u64 },
}

impl Key {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Key::Map {
                id,
                token,
                base,
                len,
                offset,
            } => format!("map {id:x} {token:x} {base:x} {len:x} {offset:x}"),
            Key::Cma { id, base, len } => format!("cma {id:x} {base:x} {len:x}"),
        }
        .into_bytes()
    }

    /// As [`Key::decode`], remembering this thread's last key: one
    /// submitting thread mostly names the same buffer submit after submit,
    /// and parsing its key cost several percent of a 4 KiB request.
    pub fn decode_repeated(bytes: &[u8]) -> Option<Key> {
        thread_local! {
            static LAST: std::cell::RefCell<(Vec<u8>, Option<Key>)> =
                const { std::cell::RefCell::new((Vec::new(), None)) };
        }
        LAST.with_borrow_mut(|(last, key)| {
            if last.as_slice() != bytes || last.is_empty() {
                *key = Key::decode(bytes);
                last.clear();
                last.extend_from_slice(bytes);
            }
            *key
        })
    }

    pub fn decode(bytes: &[u8]) -> Option<Key> {
        let text = std::str::from_utf8(bytes).ok().filter(|t| t.len() < 128)?;
        // Decoded for every request: the fields in place, no allocation.
        let mut fields = [""; 6];
        let mut n = 0;
        for field in text.split(' ') {
            *fields.get_mut(n)? = field;
            n += 1;
        }
        let num = |s: &str| u64::from_str_radix(s, 16).ok();
        let key = match &fields[..n] {
            ["map", i, t, b, l, o] => Key::Map {
                id: num(i)?,
                token: num(t)?,
                base: num(b)?,
                len: num(l)?,
                offset: num(o).filter(|o| o.checked_add(num(l).unwrap_or(0)).is_some())?,
            },
            ["cma", i, b, l] => Key::Cma {
                id: num(i)?,
                base: num(b)?,
                len: num(l)?,
            },
            _ => return None,
        };
        let (base, len) = key.range();
        (len > 0 && base.checked_add(len).is_some()).then_some(key)
    }

    pub fn range(&self) -> (u64, u64) {
        match *self {
            Key::Map { base, len, .. } | Key::Cma { base, len, .. } => (base, len),
        }
    }

    pub fn id(&self) -> u64 {
        match *self {
            Key::Map { id, .. } | Key::Cma { id, .. } => id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_hostile_text() {
        let e = Endpoint {
            pid: 42,
            pidns: 4026531836,
            uid: 1000,
            socket: b"ferry-shm-abc".to_vec(),
            probe: 0x7fff_0000,
            cma: true,
        };
        assert_eq!(Endpoint::decode(&e.encode()), Some(e));
        for bad in [
            &b""[..],
            b"ferry-shm/2 pid=1",
            b"ferry-shm/1 pid=0 pidns=1 uid=0 sock=61 probe=0 cma=on",
            b"ferry-shm/1 pid=1 pidns=1 uid=0 sock=6 probe=0 cma=on",
            b"\xff\xfe",
        ] {
            assert_eq!(Endpoint::decode(bad), None, "{bad:?}");
        }
        for k in [
            Key::Map {
                id: 3,
                token: 7,
                base: 0x1000,
                len: 0x2000,
                offset: 0x3000,
            },
            Key::Cma {
                id: 4,
                base: 0x5000,
                len: 1,
            },
        ] {
            assert_eq!(Key::decode(&k.encode()), Some(k));
        }
        assert_eq!(Key::decode(b"cma 1 ffffffffffffffff 2"), None);
        // The remembered key follows the bytes, good or bad.
        let k = Key::Cma {
            id: 7,
            base: 0x1000,
            len: 0x2000,
        };
        assert_eq!(Key::decode_repeated(&k.encode()), Some(k));
        assert_eq!(Key::decode_repeated(&k.encode()), Some(k));
        assert_eq!(Key::decode_repeated(b"cma 1 10 0"), None);
        assert_eq!(Key::decode_repeated(b""), None);
        assert_eq!(Key::decode_repeated(&k.encode()), Some(k));
        assert_eq!(Key::decode(b"cma 1 10 0"), None);
        assert_eq!(Key::decode(b"map 1 2"), None);
        assert_eq!(Key::decode(b"map 1 2 1000 10 ffffffffffffffff"), None);
    }
}
