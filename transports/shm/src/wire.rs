//! The messages of the side channel between shm instances (see
//! `channel`): every one is 32 bytes, little endian:
//!
//! ```text
//! kind u32 | zero u32 | id u64 | a u64 | b u64
//! MAP        a = allocation token                  (peer -> owner)
//! MAP_OK     a = token, b = length, memfd attached (owner -> peer)
//! MAP_ERR    a = token                             (owner -> peer)
//! REVOKE     a = registration id, b = token or 0   (owner -> peer)
//! REVOKE_ACK the REVOKE's fields echoed            (peer -> owner)
//! LIVE       a = registration id                   (peer -> owner)
//! LIVE_OK    a = registration id, still registered (owner -> peer)
//! LIVE_ERR   a = registration id, gone             (owner -> peer)
//! ```
//!
//! Decoding checks the length and the zero field; what a kind means to a
//! side is for that side to check (anything unexpected closes the channel).

pub const MSG_LEN: usize = 32;
pub const MAP: u32 = 1;
pub const MAP_OK: u32 = 2;
pub const MAP_ERR: u32 = 3;
pub const REVOKE: u32 = 4;
pub const REVOKE_ACK: u32 = 5;
pub const LIVE: u32 = 6;
pub const LIVE_OK: u32 = 7;
pub const LIVE_ERR: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    pub kind: u32,
    pub id: u64,
    pub a: u64,
    pub b: u64,
}

impl Msg {
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut m = [0u8; MSG_LEN];
        m[0..4].copy_from_slice(&self.kind.to_le_bytes());
        m[8..16].copy_from_slice(&self.id.to_le_bytes());
        m[16..24].copy_from_slice(&self.a.to_le_bytes());
        m[24..32].copy_from_slice(&self.b.to_le_bytes());
        m
    }

    /// A message from exactly [`MSG_LEN`] bytes whose reserved field is
    /// zero and whose kind is known; None otherwise.
    pub fn decode(m: &[u8]) -> Option<Msg> {
        if m.len() != MSG_LEN || m[4..8] != [0; 4] {
            return None;
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&m[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let kind = u32::from_le_bytes([m[0], m[1], m[2], m[3]]);
        if !(MAP..=LIVE_ERR).contains(&kind) {
            return None;
        }
        Some(Msg {
            kind,
            id: u64_at(8),
            a: u64_at(16),
            b: u64_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let m = Msg {
            kind: REVOKE,
            id: 9,
            a: 0x1000,
            b: 42,
        };
        assert_eq!(Msg::decode(&m.encode()), Some(m));
        assert_eq!(Msg::decode(&m.encode()[..31]), None);
        let mut bad = m.encode();
        bad[5] = 1;
        assert_eq!(Msg::decode(&bad), None);
        let mut bad = m.encode();
        bad[0] = 9;
        assert_eq!(Msg::decode(&bad), None);
    }
}
