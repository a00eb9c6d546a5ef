//! The staging messages of the control plane (StageOpen, StageOpened,
//! StageCopy, StageCopyList) and their decoders, which check every bound.

use crate::descriptor::BufferDescriptor;
use crate::error::{Error, ErrorCode, Result};
use serde::{Deserialize, Serialize};

pub(crate) const MAX_SLOTS: usize = 16;
pub(crate) const MAX_SLOT_LEN: u64 = 64 << 20;

/// A peer asks for a staging session: `slots` slots of `slot_len` bytes.
#[derive(Debug, Serialize, Deserialize)]
pub struct OpenRequest {
    pub slots: usize,
    pub slot_len: u64,
}

/// The lent slots, as buffers of a segment descriptor.
#[derive(Debug, Serialize, Deserialize)]
pub struct OpenReply {
    pub slots: Vec<BufferDescriptor>,
    /// The StageCopyList version the lender speaks; absent (0) from an
    /// engine that has none, which then gets one StageCopy per request.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub copy_list: u8,
}

fn is_zero(v: &u8) -> bool {
    *v == 0
}

/// A peer asks for a copy between one of its lent slots and device memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct CopyRequest {
    /// Slot to device memory when true, device memory to slot otherwise.
    pub to_device: bool,
    pub slot: usize,
    pub offset: u64,
    pub len: u64,
    pub device_addr: u64,
}

/// The answer to StageCopy and StageCopyList (StageDone): where the
/// copy's time went at the peer, in microseconds, for the initiator's
/// account of a job. Absent from an older engine (`{}`), and only ever
/// summed into a debug line: never trusted for anything else.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct CopyDone {
    /// Decoding the request and checking it against slots and registrations.
    #[serde(default)]
    pub check_us: u64,
    /// Queuing the device copies.
    #[serde(default)]
    pub queue_us: u64,
    /// Waiting for the device to finish them.
    #[serde(default)]
    pub wait_us: u64,
}

impl CopyDone {
    /// A reply's body; what cannot be read counts as nothing spent.
    pub(crate) fn decode(body: &[u8]) -> CopyDone {
        serde_json::from_slice(body).unwrap_or_default()
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        format!(
            "{{\"check_us\":{},\"queue_us\":{},\"wait_us\":{}}}",
            self.check_us, self.queue_us, self.wait_us
        )
        .into_bytes()
    }
}

/// The StageCopyList wire version this engine speaks.
pub(crate) const COPY_LIST_VERSION: u8 = 1;
/// Most pieces in one StageCopyList (24 bytes each on the wire).
pub const MAX_LIST_PIECES: usize = 16384;
const LIST_HEADER: usize = 12;
const LIST_PIECE: usize = 24;

/// One piece of a packed run: `len` bytes at `slot_offset` in the slot,
/// from or to `device_addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListPiece {
    pub slot_offset: u64,
    pub device_addr: u64,
    pub len: u64,
}

/// A peer asks for many copies between one of its lent slots and device
/// memory as one device operation: the scatter of a packed run it sent
/// (`to_device`), or the gather of one it will read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyListRequest {
    pub to_device: bool,
    pub slot: usize,
    pub pieces: Vec<ListPiece>,
}

impl CopyListRequest {
    /// The body: version, direction, reserved, slot and count (12 bytes,
    /// little-endian), then 24 bytes per piece.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LIST_HEADER + LIST_PIECE * self.pieces.len());
        out.push(COPY_LIST_VERSION);
        out.push(u8::from(self.to_device));
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(self.slot as u32).to_le_bytes());
        out.extend_from_slice(&(self.pieces.len() as u32).to_le_bytes());
        for p in &self.pieces {
            out.extend_from_slice(&p.slot_offset.to_le_bytes());
            out.extend_from_slice(&p.device_addr.to_le_bytes());
            out.extend_from_slice(&p.len.to_le_bytes());
        }
        out
    }
}

/// Decodes a peer's StageCopyList body: a known version, 1 to
/// MAX_LIST_PIECES pieces, each non-empty and wrapping on neither side
/// (the caller checks them against the slot and its registrations).
pub fn decode_copy_list(body: &[u8]) -> Result<CopyListRequest> {
    let header = body
        .get(..LIST_HEADER)
        .ok_or_else(|| bad("a copy list shorter than its header"))?;
    if header[0] != COPY_LIST_VERSION {
        return Err(bad(&format!(
            "copy list version {} (this engine speaks {COPY_LIST_VERSION})",
            header[0]
        )));
    }
    let to_device = match header[1] {
        0 => false,
        1 => true,
        _ => return Err(bad("copy list direction is neither 0 nor 1")),
    };
    if header[2..4] != [0, 0] {
        return Err(bad("copy list reserved bytes are not zero"));
    }
    let word = |at: usize| {
        u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let slot = word(4) as usize;
    let count = word(8) as usize;
    if count == 0 || count > MAX_LIST_PIECES {
        return Err(bad(&format!(
            "a copy list of {count} pieces (1 to {MAX_LIST_PIECES})"
        )));
    }
    let rest = &body[LIST_HEADER..];
    if rest.len() != count * LIST_PIECE {
        return Err(bad(&format!(
            "a copy list of {count} pieces carries {} bytes of them",
            rest.len()
        )));
    }
    let u64_at = |b: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let pieces = rest
        .chunks_exact(LIST_PIECE)
        .enumerate()
        .map(|(i, b)| {
            let p = ListPiece {
                slot_offset: u64_at(b, 0),
                device_addr: u64_at(b, 8),
                len: u64_at(b, 16),
            };
            if p.len == 0
                || p.slot_offset.checked_add(p.len).is_none()
                || p.device_addr.checked_add(p.len).is_none()
            {
                return Err(bad(&format!("copy list piece {i} is empty or wraps")));
            }
            Ok(p)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(CopyListRequest {
        to_device,
        slot,
        pieces,
    })
}

/// Decodes a peer's StageOpen body and checks its bounds.
pub fn decode_open_request(body: &[u8]) -> Result<OpenRequest> {
    let req: OpenRequest =
        serde_json::from_slice(body).map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
    if req.slots == 0 || req.slots > MAX_SLOTS || req.slot_len == 0 || req.slot_len > MAX_SLOT_LEN {
        return Err(bad("slot count or size out of range"));
    }
    Ok(req)
}

/// Decodes a peer's StageCopy body: a non-empty range that does not wrap
/// (the caller checks it against the slot).
pub fn decode_copy_request(body: &[u8]) -> Result<CopyRequest> {
    let req: CopyRequest =
        serde_json::from_slice(body).map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
    if req.len == 0
        || req.offset.checked_add(req.len).is_none()
        || req.device_addr.checked_add(req.len).is_none()
    {
        return Err(bad("empty or wrapping range"));
    }
    Ok(req)
}

/// Decodes the slots a peer lent (StageOpened): 1 to 16 of at least
/// `slot_len` bytes each (the caller validates them as a descriptor).
pub fn decode_open_reply(body: &[u8], slot_len: u64) -> Result<OpenReply> {
    let reply: OpenReply = serde_json::from_slice(body).map_err(|e| {
        Error::new(
            ErrorCode::Protocol,
            format!("malformed staging slots ({e})"),
        )
    })?;
    if reply.slots.is_empty() || reply.slots.len() > MAX_SLOTS {
        return Err(Error::new(
            ErrorCode::Protocol,
            "the peer lent no usable staging slots",
        ));
    }
    if reply.slots.iter().any(|b| b.len < slot_len) {
        return Err(Error::new(
            ErrorCode::Protocol,
            "the peer lent staging slots smaller than asked",
        ));
    }
    Ok(reply)
}

pub(crate) fn bad(msg: &str) -> Error {
    Error::new(ErrorCode::Protocol, format!("bad staging request: {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_asks_for_1_to_16_slots_of_at_most_64_mib() {
        let open = |slots: usize, slot_len: u64| {
            decode_open_request(format!(r#"{{"slots":{slots},"slot_len":{slot_len}}}"#).as_bytes())
        };
        assert!(open(4, 4 << 20).is_ok());
        assert!(open(16, 64 << 20).is_ok());
        for (slots, len) in [(0, 4096), (17, 4096), (4, 0), (4, (64 << 20) + 1)] {
            let e = open(slots, len).unwrap_err();
            assert_eq!(e.code, ErrorCode::Protocol);
            assert!(e.message.contains("out of range"), "{}", e.message);
        }
        assert!(decode_open_request(b"{\"slots\":-1}").is_err());
    }

    #[test]
    fn a_copy_is_a_non_empty_range_that_does_not_wrap() {
        let copy = |offset: u64, len: u64, device_addr: u64| {
            decode_copy_request(
                format!(
                    r#"{{"to_device":true,"slot":0,"offset":{offset},"len":{len},"device_addr":{device_addr}}}"#
                )
                .as_bytes(),
            )
        };
        assert_eq!(copy(4096, 8192, 0x1000).unwrap().len, 8192);
        assert!(copy(0, 0, 0x1000).is_err());
        assert!(copy(u64::MAX, 1, 0x1000).is_err());
        assert!(copy(0, 2, u64::MAX).is_err());
    }

    #[test]
    fn a_copy_list_round_trips_and_every_bad_body_is_refused() {
        let list = CopyListRequest {
            to_device: true,
            slot: 3,
            pieces: vec![
                ListPiece {
                    slot_offset: 0,
                    device_addr: 0x7f00_0000_0000,
                    len: 16384,
                },
                ListPiece {
                    slot_offset: 16384,
                    device_addr: 0x7f00_0010_0000,
                    len: 4096,
                },
            ],
        };
        let body = list.encode();
        assert_eq!(body.len(), 12 + 2 * 24);
        assert_eq!(decode_copy_list(&body).unwrap(), list);
        let refused = |b: &[u8], why: &str| {
            let e = decode_copy_list(b).unwrap_err();
            assert_eq!(e.code, ErrorCode::Protocol);
            assert!(e.message.contains(why), "{}", e.message);
        };
        refused(&body[..11], "shorter than its header");
        refused(&body[..body.len() - 1], "carries 47 bytes");
        refused(&[body.clone(), vec![0]].concat(), "carries 49 bytes");
        let mut v = body.clone();
        v[0] = 2;
        refused(&v, "version 2");
        let mut v = body.clone();
        v[1] = 7;
        refused(&v, "direction");
        let mut v = body.clone();
        v[3] = 1;
        refused(&v, "reserved");
        let mut v = body.clone();
        v[8..12].copy_from_slice(&0u32.to_le_bytes());
        refused(&v[..12], "of 0 pieces");
        let mut v = body.clone();
        v[8..12].copy_from_slice(&(MAX_LIST_PIECES as u32 + 1).to_le_bytes());
        refused(&v, "pieces (1 to");
        // An empty piece, and pieces that wrap on either side.
        for (field, value) in [(16, 0u64), (0, u64::MAX), (8, u64::MAX - 10)] {
            let mut v = body.clone();
            v[12 + 24 + field..12 + 24 + field + 8].copy_from_slice(&value.to_le_bytes());
            refused(&v, "piece 1 is empty or wraps");
        }
    }

    #[test]
    fn lent_slots_are_1_to_16_and_as_large_as_asked() {
        let slot = |len: u64| BufferDescriptor {
            addr: 0x1000,
            len,
            location: "cpu:0".into(),
            keys: Vec::new(),
            order: 0,
        };
        let reply = |slots: Vec<BufferDescriptor>| {
            serde_json::to_vec(&OpenReply {
                slots,
                copy_list: 0,
            })
            .unwrap()
        };
        assert_eq!(
            decode_open_reply(&reply(vec![slot(8192)]), 4096)
                .unwrap()
                .slots
                .len(),
            1
        );
        assert!(decode_open_reply(&reply(Vec::new()), 4096).is_err());
        assert!(decode_open_reply(&reply(vec![slot(8192); 17]), 4096).is_err());
        let e = decode_open_reply(&reply(vec![slot(8192), slot(2048)]), 4096).unwrap_err();
        assert!(e.message.contains("smaller than asked"), "{}", e.message);
        assert!(decode_open_reply(b"[]", 4096).is_err());
    }
}
