//! The staging messages of the control plane (StageOpen, StageOpened,
//! StageCopy) and their decoders, which check every bound.

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
    fn lent_slots_are_1_to_16_and_as_large_as_asked() {
        let slot = |len: u64| BufferDescriptor {
            addr: 0x1000,
            len,
            location: "cpu:0".into(),
            keys: Vec::new(),
            order: 0,
        };
        let reply =
            |slots: Vec<BufferDescriptor>| serde_json::to_vec(&OpenReply { slots }).unwrap();
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
