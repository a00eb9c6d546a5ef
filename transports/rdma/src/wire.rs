//! What travels between RDMA instances: the endpoint in the segment
//! descriptor, the key of each registered buffer, and the connection
//! messages exchanged through plugin messaging. Everything decoded here
//! comes from a peer and is checked field by field; nothing panics.

use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use serde::{Deserialize, Serialize};

/// Most NICs an endpoint may list (and so an index in a key may name).
pub const MAX_NICS: usize = 64;
/// Most queue pairs one connect message may ask for.
pub const MAX_QPS_PER_MESSAGE: usize = 64;

fn protocol(what: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Protocol, what)
}

/// One NIC as the endpoint publishes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointNic {
    pub name: String,
    pub port: u8,
    pub lid: u16,
    /// 32 hex digits.
    pub gid: String,
    /// "ib" or "eth".
    pub link: String,
    /// `ibv_mtu` value, 1..=5.
    pub mtu: u32,
}

/// An instance's endpoint: its id and its NICs (index = position).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub v: u32,
    /// Random per instance: responders are keyed by it.
    pub engine: String,
    pub nics: Vec<EndpointNic>,
}

pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

pub fn gid_hex(gid: &[u8; 16]) -> String {
    gid.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn parse_gid(s: &str) -> PluginResult<[u8; 16]> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(protocol(format!("bad GID {:?}", truncate(s))));
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| protocol("bad GID"))?;
    }
    Ok(out)
}

fn truncate(s: &str) -> String {
    s.chars().take(48).collect()
}

impl EndpointNic {
    pub fn check(&self) -> PluginResult<()> {
        if !valid_name(&self.name) {
            return Err(protocol(format!("bad NIC name {:?}", truncate(&self.name))));
        }
        if self.port == 0 {
            return Err(protocol(format!("{}: port 0", self.name)));
        }
        parse_gid(&self.gid)?;
        if self.link != "ib" && self.link != "eth" {
            return Err(protocol(format!("{}: bad link layer", self.name)));
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(protocol(format!("{}: bad MTU {}", self.name, self.mtu)));
        }
        Ok(())
    }
}

impl Endpoint {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and checks a peer's endpoint.
    pub fn decode(bytes: &[u8]) -> PluginResult<Endpoint> {
        if bytes.len() > 64 * 1024 {
            return Err(protocol("rdma endpoint too large"));
        }
        let e: Endpoint = serde_json::from_slice(bytes)
            .map_err(|e| protocol(format!("not an rdma endpoint: {e}")))?;
        if e.v != 1 {
            return Err(protocol(format!(
                "rdma endpoint version {} is not supported",
                e.v
            )));
        }
        if !valid_name(&e.engine) {
            return Err(protocol("bad engine id in the rdma endpoint"));
        }
        if e.nics.is_empty() || e.nics.len() > MAX_NICS {
            return Err(protocol(format!(
                "an rdma endpoint with {} NICs",
                e.nics.len()
            )));
        }
        for n in &e.nics {
            n.check()?;
        }
        Ok(e)
    }
}

/// The key of a registered buffer, as peers receive it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferKey {
    pub addr: u64,
    pub len: u64,
    /// (NIC index in the owner's endpoint, rkey) for every NIC that
    /// registered the buffer.
    pub rkeys: Vec<(u8, u32)>,
    /// The owner's NICs for this buffer, best first; the first `best` of
    /// them are equally close (the rails).
    pub ranked: Vec<u8>,
    pub best: u8,
    /// Per entry of `ranked`, its tier: equally close NICs share one. May
    /// be empty (keys of older peers end after `ranked`).
    pub tiers: Vec<u8>,
}

const KEY_MAGIC: &[u8; 4] = b"FRK1";

impl BufferKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + self.rkeys.len() * 5 + self.ranked.len());
        out.extend_from_slice(KEY_MAGIC);
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.push(self.rkeys.len() as u8);
        for (nic, rkey) in &self.rkeys {
            out.push(*nic);
            out.extend_from_slice(&rkey.to_le_bytes());
        }
        out.push(self.best);
        out.push(self.ranked.len() as u8);
        out.extend_from_slice(&self.ranked);
        if self.tiers.len() == self.ranked.len() {
            out.extend_from_slice(&self.tiers);
        }
        out
    }

    /// Decodes a peer's key; `nics` is how many NICs its endpoint lists.
    pub fn decode(bytes: &[u8], nics: usize) -> PluginResult<BufferKey> {
        let bad = |what: &str| protocol(format!("malformed rdma key: {what}"));
        let mut r = Reader(bytes);
        if r.take(4)? != KEY_MAGIC {
            return Err(bad("not an rdma key"));
        }
        let addr = r.u64()?;
        let len = r.u64()?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(bad("bad range"));
        }
        let n = r.u8()? as usize;
        if n == 0 || n > MAX_NICS {
            return Err(bad("no NIC"));
        }
        let mut rkeys = Vec::with_capacity(n);
        for _ in 0..n {
            let nic = r.u8()?;
            let rkey = r.u32()?;
            if nic as usize >= nics || rkeys.iter().any(|(x, _)| *x == nic) {
                return Err(bad("NIC index"));
            }
            rkeys.push((nic, rkey));
        }
        let best = r.u8()?;
        let m = r.u8()? as usize;
        if m > MAX_NICS {
            return Err(bad("ranking"));
        }
        let ranked = r.take(m)?.to_vec();
        if ranked.iter().any(|x| !rkeys.iter().any(|(n, _)| n == x)) || best as usize > m {
            return Err(bad("ranking"));
        }
        let tiers = match r.0.len() {
            0 => Vec::new(),
            n if n == m => r.take(m)?.to_vec(),
            _ => return Err(bad("trailing bytes")),
        };
        Ok(BufferKey {
            addr,
            len,
            rkeys,
            ranked,
            best,
            tiers,
        })
    }

    pub fn rkey(&self, nic: u8) -> Option<u32> {
        self.rkeys.iter().find(|(n, _)| *n == nic).map(|(_, k)| *k)
    }

    /// Whether `[addr, addr + len)` lies inside the buffer.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> PluginResult<&'a [u8]> {
        if self.0.len() < n {
            return Err(protocol("malformed rdma key: truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> PluginResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> PluginResult<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> PluginResult<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// One queue pair the initiator asks the target to create and connect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpRequest {
    /// The initiator's NIC (by name) and queue pair.
    pub nic: String,
    pub qpn: u32,
    pub lid: u16,
    pub gid: String,
    pub mtu: u32,
    /// The target's NIC to create it on.
    pub to: String,
}

/// A plugin message from an initiator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Message {
    Connect { engine: String, qps: Vec<QpRequest> },
}

/// The target's answer to one queue pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QpReply {
    Ok {
        qpn: u32,
        lid: u16,
        gid: String,
        mtu: u32,
    },
    Err {
        message: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectReply {
    pub qps: Vec<QpReply>,
}

impl Message {
    pub fn decode(body: &[u8]) -> PluginResult<Message> {
        let m: Message =
            serde_json::from_slice(body).map_err(|e| protocol(format!("bad rdma message: {e}")))?;
        match &m {
            Message::Connect { engine, qps } => {
                if !valid_name(engine) {
                    return Err(protocol("bad engine id"));
                }
                if qps.is_empty() || qps.len() > MAX_QPS_PER_MESSAGE {
                    return Err(protocol(format!(
                        "a connect message for {} queue pairs",
                        qps.len()
                    )));
                }
                for q in qps {
                    q.check()?;
                }
            }
        }
        Ok(m)
    }
}

impl QpRequest {
    pub fn check(&self) -> PluginResult<()> {
        if !valid_name(&self.nic) || !valid_name(&self.to) {
            return Err(protocol("bad NIC name"));
        }
        check_qp_address(self.qpn, &self.gid, self.mtu)
    }
}

fn check_qp_address(qpn: u32, gid: &str, mtu: u32) -> PluginResult<()> {
    if qpn == 0 || qpn > 0x00ff_ffff {
        return Err(protocol(format!("bad queue pair number {qpn:#x}")));
    }
    parse_gid(gid)?;
    if !(1..=5).contains(&mtu) {
        return Err(protocol(format!("bad MTU {mtu}")));
    }
    Ok(())
}

impl ConnectReply {
    pub fn decode(body: &[u8], expected: usize) -> PluginResult<ConnectReply> {
        let r: ConnectReply =
            serde_json::from_slice(body).map_err(|e| protocol(format!("bad rdma reply: {e}")))?;
        if r.qps.len() != expected {
            return Err(protocol(format!(
                "the peer answered {} of {expected} queue pairs",
                r.qps.len()
            )));
        }
        for q in &r.qps {
            match q {
                QpReply::Ok { qpn, gid, mtu, .. } => check_qp_address(*qpn, gid, *mtu)?,
                QpReply::Err { message } if message.len() > 4096 => {
                    return Err(protocol("an overlong error in the rdma reply"))
                }
                QpReply::Err { .. } => {}
            }
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str) -> EndpointNic {
        EndpointNic {
            name: name.into(),
            port: 1,
            lid: 0x11,
            gid: gid_hex(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]),
            link: "ib".into(),
            mtu: 5,
        }
    }

    #[test]
    fn endpoints_round_trip_and_garbage_is_refused() {
        let e = Endpoint {
            v: 1,
            engine: "abc123".into(),
            nics: vec![nic("mlx5_0"), nic("mlx5_3")],
        };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        let mut bad = e.clone();
        bad.nics[0].gid = "zz".into();
        assert!(Endpoint::decode(&bad.encode()).is_err());
        let mut bad = e.clone();
        bad.nics[1].mtu = 9;
        assert!(Endpoint::decode(&bad.encode()).is_err());
        let mut bad = e.clone();
        bad.nics[0].name = "../../etc".into();
        assert!(Endpoint::decode(&bad.encode()).is_err());
        let mut bad = e;
        bad.nics.clear();
        assert!(Endpoint::decode(&bad.encode()).is_err());
        for junk in [&b""[..], b"{", b"[]", b"\xff\xfe", b"{\"v\":1}"] {
            assert_eq!(
                Endpoint::decode(junk).unwrap_err().code,
                ErrorCode::Protocol
            );
        }
    }

    #[test]
    fn keys_round_trip_and_every_truncation_is_an_error() {
        let k = BufferKey {
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
            rkeys: vec![(0, 0x1234), (3, 0xabcd)],
            ranked: vec![3, 0],
            best: 1,
            tiers: vec![0, 1],
        };
        let bytes = k.encode();
        assert_eq!(BufferKey::decode(&bytes, 4).unwrap(), k);
        // Without its tiers it is an older peer's key; any other cut is an error.
        let old = bytes.len() - k.tiers.len();
        for n in 0..bytes.len() {
            match BufferKey::decode(&bytes[..n], 4) {
                Ok(d) => assert!(
                    n == old && d.tiers.is_empty() && d.ranked == k.ranked,
                    "{n}"
                ),
                Err(_) => assert_ne!(n, old),
            }
        }
        // NIC 3 does not exist in an endpoint with 2 NICs.
        assert!(BufferKey::decode(&bytes, 2).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(BufferKey::decode(&long, 4).is_err());
        assert!(k.covers(k.addr, k.len));
        assert!(!k.covers(k.addr, k.len + 1));
        assert!(!k.covers(k.addr - 1, 1));
        assert!(!k.covers(u64::MAX, 2));
    }

    #[test]
    fn connect_messages_are_checked() {
        let q = QpRequest {
            nic: "mlx5_0".into(),
            qpn: 0x123,
            lid: 1,
            gid: gid_hex(&[1; 16]),
            mtu: 5,
            to: "mlx5_3".into(),
        };
        let m = Message::Connect {
            engine: "e1".into(),
            qps: vec![q.clone()],
        };
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(Message::decode(&bytes).unwrap(), m);
        for bad in [
            QpRequest {
                qpn: 0,
                ..q.clone()
            },
            QpRequest {
                qpn: 1 << 24,
                ..q.clone()
            },
            QpRequest {
                mtu: 0,
                ..q.clone()
            },
            QpRequest {
                gid: "00".into(),
                ..q.clone()
            },
            QpRequest {
                to: "".into(),
                ..q.clone()
            },
        ] {
            let m = Message::Connect {
                engine: "e1".into(),
                qps: vec![bad],
            };
            assert!(Message::decode(&serde_json::to_vec(&m).unwrap()).is_err());
        }
        let many = Message::Connect {
            engine: "e1".into(),
            qps: vec![q; MAX_QPS_PER_MESSAGE + 1],
        };
        assert!(Message::decode(&serde_json::to_vec(&many).unwrap()).is_err());
        assert!(Message::decode(b"{\"op\":\"explode\"}").is_err());
        let reply = ConnectReply {
            qps: vec![QpReply::Err {
                message: "no such NIC".into(),
            }],
        };
        let bytes = serde_json::to_vec(&reply).unwrap();
        assert_eq!(ConnectReply::decode(&bytes, 1).unwrap(), reply);
        assert!(ConnectReply::decode(&bytes, 2).is_err());
    }
}
