//! The TCP transport's wire format. Every integer is little endian.
//!
//! ```text
//! request  = header(kind WRITE|READ) descriptor{count} tag payload(WRITE only) [ptag]
//! response = header(kind RESPONSE)   status{count}     tag payload(READ only)  [ptag]
//!
//! header     = magic u32 "FERY" | version u8 | kind u8 | flags u16 |
//!              count u32 | reserved u32 | seq u64 | payload_len u64   (32 bytes)
//! descriptor = remote_addr u64 | len u64                              (16 bytes)
//! status     = i32 (FERRY_OK or a FERRY_ERR_* code)                   (4 bytes)
//! tag        = the session tag of header and descriptors (or statuses) (16 bytes)
//! ptag       = the payload's tag, when flags has FLAG_PAYLOAD_TAG: on a
//!              WRITE request, and on every response to a tagged request
//!              (over its payload, empty for a WRITE's)              (16 bytes)
//! ```
//!
//! Tags are `sdk::auth`'s: under the session keys of this connection and
//! the direction's message number, so a relay that passed the
//! authentication through can neither inject, replay, reorder nor alter a
//! frame's header or descriptors: the receiver closes the connection. The
//! payload is covered only with FERRY_INTEGRITY=payload (the flag is inside
//! the tagged header, so it cannot be stripped); it is checked after it
//! landed, so a tampered WRITE is detected and reported, not prevented.
//!
//! Before any frame, right after authentication, the target says which
//! instance it is (tagged, as message 0 of its direction), and the
//! endpoint peers find in the segment descriptor names that instance, so a
//! client whose segment was opened on an earlier instance (the peer
//! restarted on the same port) is refused instead of reading or writing
//! the new instance's memory:
//!
//! ```text
//! hello    = magic "FERH" | version u8 | 0 u8 | 0 u16 | instance u64 | tag (32 bytes)
//! endpoint = "host:port instance-in-16-hex-digits"
//! ```
//!
//! A WRITE's payload is the concatenation of its descriptors' bytes. A
//! READ's response payload is the concatenation of the bytes of the
//! descriptors whose status is FERRY_OK, in order. Responses come back in
//! the order requests were sent on a connection; `seq` lets each side check.
//! Decoding never trusts a length before checking it against the limits.

use ferry_plugins_abi::sys;

pub const MAGIC: u32 = u32::from_le_bytes(*b"FERY");
/// 2: frames carry session tags.
pub const VERSION: u8 = 2;
pub const HEADER_LEN: usize = 32;
pub use ferry_plugins_abi::sdk::auth::TAG_LEN;
/// Header flag: a payload tag follows the payload.
pub const FLAG_PAYLOAD_TAG: u16 = 1;
/// Response flag: the request's payload failed its tag at the target (the
/// target closes the connection after this response).
pub const FLAG_INTEGRITY_FAILED: u16 = 2;
pub const DESC_LEN: usize = 16;
pub const STATUS_LEN: usize = 4;
/// Most descriptors in one frame (the kernel's IOV_MAX).
pub const MAX_DESCS: usize = 1024;
/// Most payload bytes in one frame; larger requests are split.
pub const MAX_FRAME_PAYLOAD: u64 = 64 << 20;
/// The largest frame on the wire: header, descriptors (or statuses), payload.
pub const MAX_FRAME_BYTES: u64 =
    HEADER_LEN as u64 + (MAX_DESCS * DESC_LEN) as u64 + MAX_FRAME_PAYLOAD;
pub const HELLO_MAGIC: [u8; 4] = *b"FERH";
pub const HELLO_LEN: usize = 16;
/// Longest endpoint text accepted from a descriptor.
pub const MAX_ENDPOINT_LEN: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Write = 1,
    Read = 2,
    Response = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// FLAG_PAYLOAD_TAG or 0.
    pub flags: u16,
    pub count: u32,
    pub seq: u64,
    pub payload_len: u64,
}

/// Why bytes from the network were refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and checks a header: magic, version, kind, count limits, and
    /// payload limits for its kind.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(WireError(format!(
                "not a Ferry TCP frame (magic {magic:#010x})"
            )));
        }
        if b[4] != VERSION {
            return Err(WireError(format!(
                "TCP frame version {} is not supported (this side speaks {VERSION})",
                b[4]
            )));
        }
        let kind = match b[5] {
            1 => Kind::Write,
            2 => Kind::Read,
            3 => Kind::Response,
            k => return Err(WireError(format!("unknown TCP frame kind {k}"))),
        };
        let flags = u16::from_le_bytes([b[6], b[7]]);
        let known = match kind {
            Kind::Response => FLAG_PAYLOAD_TAG | FLAG_INTEGRITY_FAILED,
            _ => FLAG_PAYLOAD_TAG,
        };
        if flags & !known != 0 {
            return Err(WireError(format!("unknown TCP frame flags {flags:#x}")));
        }
        let count = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if count == 0 || count as usize > MAX_DESCS {
            return Err(WireError(format!(
                "a frame with {count} entries (allowed: 1 to {MAX_DESCS})"
            )));
        }
        let seq = u64::from_le_bytes(b[16..24].try_into().unwrap_or([0; 8]));
        let payload_len = u64::from_le_bytes(b[24..32].try_into().unwrap_or([0; 8]));
        if payload_len > MAX_FRAME_PAYLOAD {
            return Err(WireError(format!(
                "a frame payload of {payload_len} bytes exceeds {MAX_FRAME_PAYLOAD}"
            )));
        }
        if kind == Kind::Read && payload_len != 0 {
            return Err(WireError("a READ request carries a payload".into()));
        }
        Ok(Header {
            kind,
            flags,
            count,
            seq,
            payload_len,
        })
    }

    pub fn payload_tagged(&self) -> bool {
        self.flags & FLAG_PAYLOAD_TAG != 0
    }

    /// Bytes of a response to this header that follow the header itself.
    pub fn response_rest(&self) -> u64 {
        u64::from(self.count) * STATUS_LEN as u64
            + TAG_LEN as u64
            + self.payload_len
            + if self.payload_tagged() {
                TAG_LEN as u64
            } else {
                0
            }
    }
}

/// The target's hello: its instance.
pub fn encode_hello(instance: u64) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC);
    b[4] = VERSION;
    b[8..16].copy_from_slice(&instance.to_le_bytes());
    b
}

pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<u64, WireError> {
    if b[0..4] != HELLO_MAGIC {
        return Err(WireError(
            "the peer did not greet as a Ferry TCP target".into(),
        ));
    }
    if b[4] != VERSION {
        return Err(WireError(format!(
            "TCP target version {} is not supported (this side speaks {VERSION})",
            b[4]
        )));
    }
    Ok(u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])))
}

/// The endpoint a target publishes: where it listens, and its instance.
pub fn encode_endpoint(addr: &str, instance: u64) -> Vec<u8> {
    format!("{addr} {instance:016x}").into_bytes()
}

/// A peer's endpoint: its "host:port" and, when given, its instance.
pub fn decode_endpoint(bytes: &[u8]) -> Result<(String, Option<u64>), WireError> {
    let bad = || WireError("the tcp endpoint is not \"host:port instance\"".into());
    let text = std::str::from_utf8(bytes)
        .ok()
        .filter(|t| !t.is_empty() && t.len() <= MAX_ENDPOINT_LEN)
        .ok_or_else(bad)?;
    let mut parts = text.split(' ');
    let addr = parts.next().filter(|a| !a.is_empty()).ok_or_else(bad)?;
    let instance = match parts.next() {
        None => None,
        Some(hex) if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Some(u64::from_str_radix(hex, 16).map_err(|_| bad())?)
        }
        Some(_) => return Err(bad()),
    };
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok((addr.to_string(), instance))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u64,
}

pub fn encode_descs(descs: &[Desc], out: &mut Vec<u8>) {
    for d in descs {
        out.extend_from_slice(&d.addr.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
}

/// Decodes the descriptors of a request and checks them against its header:
/// no empty or wrapping range, and (for writes) a payload length equal to
/// their sum; a read may ask for at most `MAX_FRAME_PAYLOAD` bytes.
pub fn decode_descs(header: &Header, bytes: &[u8]) -> Result<Vec<Desc>, WireError> {
    if bytes.len() != header.count as usize * DESC_LEN {
        return Err(WireError("descriptor block has the wrong length".into()));
    }
    let mut descs = Vec::with_capacity(header.count as usize);
    let mut total: u64 = 0;
    for chunk in bytes.chunks_exact(DESC_LEN) {
        let addr = u64::from_le_bytes(chunk[0..8].try_into().unwrap_or([0; 8]));
        let len = u64::from_le_bytes(chunk[8..16].try_into().unwrap_or([0; 8]));
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(WireError(format!(
                "descriptor [{addr:#x}, +{len}) is empty or wraps"
            )));
        }
        total = total
            .checked_add(len)
            .filter(|t| *t <= MAX_FRAME_PAYLOAD)
            .ok_or_else(|| WireError("descriptors add up to more than a frame allows".into()))?;
        descs.push(Desc { addr, len });
    }
    if header.kind == Kind::Write && total != header.payload_len {
        return Err(WireError(format!(
            "WRITE payload is {} bytes but its descriptors add up to {total}",
            header.payload_len
        )));
    }
    Ok(descs)
}

pub fn encode_statuses(statuses: &[i32], out: &mut Vec<u8>) {
    for s in statuses {
        out.extend_from_slice(&s.to_le_bytes());
    }
}

/// Decodes statuses, mapping values that are not known codes to
/// `FERRY_ERR_PROTOCOL` so a peer cannot smuggle arbitrary numbers upward.
pub fn decode_statuses(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(STATUS_LEN)
        .map(|c| {
            let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if v == sys::FERRY_OK || ferry_plugins_abi::ErrorCode::from_raw(v).is_some() {
                v
            } else {
                sys::FERRY_ERR_PROTOCOL
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind, count: u32, payload_len: u64) -> Header {
        Header {
            kind,
            flags: 0,
            count,
            seq: 7,
            payload_len,
        }
    }

    #[test]
    fn headers_round_trip() {
        let h = header(Kind::Write, 3, 300);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let t = Header {
            flags: FLAG_PAYLOAD_TAG,
            ..h
        };
        assert!(Header::decode(&t.encode()).unwrap().payload_tagged());
    }

    #[test]
    fn hostile_headers_are_refused() {
        let good = header(Kind::Write, 1, 10).encode();
        let mut b = good;
        b[0] ^= 1;
        assert!(Header::decode(&b).unwrap_err().0.contains("magic"));
        let mut b = good;
        b[4] = 1;
        assert!(Header::decode(&b).unwrap_err().0.contains("version 1"));
        let mut b = good;
        b[6] = 0x80;
        assert!(Header::decode(&b).unwrap_err().0.contains("flags"));
        let mut b = good;
        b[5] = 9;
        assert!(Header::decode(&b).is_err());
        assert!(Header::decode(&header(Kind::Write, 0, 0).encode()).is_err());
        assert!(Header::decode(&header(Kind::Write, 1025, 0).encode()).is_err());
        assert!(Header::decode(&header(Kind::Write, 1, MAX_FRAME_PAYLOAD + 1).encode()).is_err());
        assert!(Header::decode(&header(Kind::Read, 1, 1).encode()).is_err());
    }

    #[test]
    fn descriptors_must_add_up_and_not_wrap() {
        let h = header(Kind::Write, 2, 30);
        let mut b = Vec::new();
        encode_descs(
            &[Desc { addr: 100, len: 10 }, Desc { addr: 200, len: 20 }],
            &mut b,
        );
        assert_eq!(decode_descs(&h, &b).unwrap().len(), 2);
        let wrong_total = header(Kind::Write, 2, 31);
        assert!(decode_descs(&wrong_total, &b).is_err());
        let mut wrap = Vec::new();
        encode_descs(
            &[Desc {
                addr: u64::MAX,
                len: 2,
            }],
            &mut wrap,
        );
        assert!(decode_descs(&header(Kind::Read, 1, 0), &wrap).is_err());
        let mut empty = Vec::new();
        encode_descs(&[Desc { addr: 1, len: 0 }], &mut empty);
        assert!(decode_descs(&header(Kind::Read, 1, 0), &empty).is_err());
        assert!(decode_descs(&h, &b[..16]).is_err());
    }

    #[test]
    fn hellos_and_endpoints_round_trip() {
        assert_eq!(decode_hello(&encode_hello(0xfeed)).unwrap(), 0xfeed);
        let mut bad = encode_hello(1);
        bad[0] = b'X';
        assert!(decode_hello(&bad).is_err());
        let e = encode_endpoint("127.0.0.1:9000", 0xabc);
        assert_eq!(
            decode_endpoint(&e).unwrap(),
            ("127.0.0.1:9000".to_string(), Some(0xabc))
        );
        assert_eq!(
            decode_endpoint(b"[::1]:7").unwrap(),
            ("[::1]:7".to_string(), None)
        );
        for bad in [
            &b""[..],
            b" 0000000000000001",
            b"a:1 12",
            b"a:1 000000000000000g",
            b"a:1 0000000000000001 x",
            b"\xff",
        ] {
            assert!(decode_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn unknown_status_values_become_protocol_errors() {
        let mut b = Vec::new();
        encode_statuses(&[0, sys::FERRY_ERR_OUT_OF_BOUNDS, -999, 5], &mut b);
        assert_eq!(
            decode_statuses(&b),
            vec![
                0,
                sys::FERRY_ERR_OUT_OF_BOUNDS,
                sys::FERRY_ERR_PROTOCOL,
                sys::FERRY_ERR_PROTOCOL
            ]
        );
    }
}
