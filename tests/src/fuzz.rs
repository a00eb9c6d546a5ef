//! Fuzz targets for every decoder of bytes that arrive from the network,
//! their seed inputs, and a small deterministic mutation driver.
//!
//! Each target takes arbitrary bytes, feeds them to one family of decoders
//! and checks what must hold: no panic, and where a decoder accepts its
//! input, that encoding the result and decoding it again gives the same
//! value (or the same bytes, for the canonical binary formats). The same
//! functions run under cargo-fuzz (`fuzz/`, nightly, coverage-guided, for
//! as long as you like) and in the test suite (`tests/fuzz.rs`, stable, a
//! few thousand mutations of the seeds per target, seconds).

use ferry_core::control::{self, MsgType, HEADER_LEN};
use ferry_core::descriptor::{
    encode_blob, BufferDescriptor, BufferKey, SegmentDescriptor, TransportEndpoint,
    DESCRIPTOR_VERSION,
};
use ferry_plugins_abi::sdk::auth::{self, Token};
use std::io::{Read, Write};

// The transports are plugins (cdylibs, each exporting the same entry
// symbol), so no binary can link two of them. Their wire modules depend on
// nothing else of their crate: the targets compile the very same sources.
#[path = "../../transports/cuda-ipc/src/wire.rs"]
pub mod cuda_ipc;
#[path = "../../transports/rdma/src/wire.rs"]
pub mod rdma;
#[path = "../../transports/shm/src/wire.rs"]
pub mod shm;
#[path = "../../transports/shm/src/endpoint.rs"]
pub mod shm_endpoint;
#[path = "../../transports/tcp/src/wire.rs"]
pub mod tcp;

/// A target: takes any bytes, returns how many of its decoders accepted
/// them (the bounded driver keeps accepted inputs to mutate further).
pub type Target = fn(&[u8]) -> usize;

/// Every target: its name (as cargo-fuzz knows it) and its function.
pub const TARGETS: &[(&str, Target)] = &[
    ("control_frame", control_frame),
    ("descriptor", descriptor),
    ("staging", staging),
    ("plugin_message", plugin_message),
    ("tcp_wire", tcp_wire),
    ("shm_wire", shm_wire),
    ("rdma_wire", rdma_wire),
    ("cuda_ipc_wire", cuda_ipc_wire),
    ("auth", auth_exchange),
    ("notify", notify),
];

// ---- targets ---------------------------------------------------------------

/// A control connection's byte stream: frames one after another, each body
/// handed to the decoder its type calls for.
pub fn control_frame(data: &[u8]) -> usize {
    let mut accepted = 0;
    let mut rest = data;
    for _ in 0..8 {
        let before = rest.len();
        match control::read_frame(&mut rest, "fuzz") {
            Ok((kind, body)) => {
                accepted += 1;
                assert_eq!(before - rest.len(), HEADER_LEN + body.len());
                let again = control::encode_frame(kind, &body);
                let mut header = [0u8; HEADER_LEN];
                header.copy_from_slice(&again[..HEADER_LEN]);
                assert_eq!(
                    control::decode_header(&header).expect("a frame re-encodes"),
                    (kind, body.len())
                );
                accepted += match kind {
                    MsgType::Descriptor => descriptor(&body),
                    MsgType::PluginRequest => plugin_message(&body),
                    MsgType::Notify => notify(&body),
                    MsgType::StageOpen
                    | MsgType::StageCopy
                    | MsgType::StageOpened
                    | MsgType::StageCopyList => staging(&body),
                    MsgType::Error => {
                        let e = control::decode_error("fuzz", &body);
                        assert!(e.message.len() < 8192);
                        usize::from(e.code != ferry_core::ErrorCode::Protocol)
                    }
                    _ => 0,
                };
            }
            Err(e) => {
                use ferry_core::ErrorCode::*;
                assert!(matches!(e.code, Protocol | Connection | Timeout), "{e}");
                break;
            }
        }
    }
    accepted
}

/// A segment descriptor (control plane reply, or an etcd value).
pub fn descriptor(data: &[u8]) -> usize {
    let Ok(d) = SegmentDescriptor::from_json(data) else {
        return 0;
    };
    let back = SegmentDescriptor::from_json(&d.to_json()).expect("a valid descriptor re-encodes");
    assert_eq!(back, d);
    for b in &d.buffers {
        assert!(d.buffer_containing(b.addr, b.len).is_some());
        for k in &b.keys {
            assert!(b.key(&k.transport).is_some());
        }
    }
    for t in &d.transports {
        assert!(d.endpoint(&t.name).is_some());
    }
    let _ = d.buffer_containing(u64::MAX, u64::MAX);
    let _ = d.buffer_containing(0, 1);
    1
}

/// The staging requests and reply (JSON on the control plane).
pub fn staging(data: &[u8]) -> usize {
    use ferry_core::engine::{
        decode_copy_list, decode_copy_request, decode_open_reply, decode_open_request,
        MAX_LIST_PIECES,
    };
    let mut accepted = 0;
    if let Ok(r) = decode_open_request(data) {
        accepted += 1;
        let again = decode_open_request(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!((again.slots, again.slot_len), (r.slots, r.slot_len));
        assert!((1..=16).contains(&r.slots) && r.slot_len > 0);
    }
    if let Ok(r) = decode_copy_request(data) {
        accepted += 1;
        let again = decode_copy_request(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(
            (again.to_device, again.slot, again.offset, again.len),
            (r.to_device, r.slot, r.offset, r.len)
        );
        assert!(r.len > 0 && r.offset.checked_add(r.len).is_some());
    }
    if let Ok(r) = decode_open_reply(data, 4096) {
        accepted += 1;
        assert!(!r.slots.is_empty() && r.slots.iter().all(|s| s.len >= 4096));
    }
    if let Ok(r) = decode_copy_list(data) {
        accepted += 1;
        // What decodes re-encodes to the same bytes, within every bound.
        assert_eq!(r.encode(), data);
        assert!((1..=MAX_LIST_PIECES).contains(&r.pieces.len()));
        assert!(r.pieces.iter().all(|p| p.len > 0
            && p.slot_offset.checked_add(p.len).is_some()
            && p.device_addr.checked_add(p.len).is_some()));
    }
    accepted
}

/// A batch's notification on the control plane: a decoded one re-encodes
/// to the same bytes and stays within the limits.
pub fn notify(data: &[u8]) -> usize {
    use ferry_core::notify::{decode_notify, encode_notify, Notify, MAX_NOTIFY_MSG};
    let Ok(n) = decode_notify(data) else {
        return 0;
    };
    assert!(n.msg.len() <= MAX_NOTIFY_MSG);
    let again = Notify::new(n.name.clone(), n.msg.clone()).expect("within the limits");
    assert_eq!(encode_notify(&n.peer, &again), data);
    1
}

/// A plugin message on the control plane, and the RDMA handshake it may
/// carry.
pub fn plugin_message(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok((transport, from, payload)) = control::decode_plugin_request(data) {
        accepted += 1;
        assert_eq!(
            control::encode_plugin_request(&transport, &from, payload),
            data
        );
        accepted += rdma_handshake(payload);
    }
    accepted + rdma_handshake(data)
}

fn rdma_handshake(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok(m) = rdma::Message::decode(data) {
        accepted += 1;
        let again = rdma::Message::decode(&serde_json::to_vec(&m).unwrap()).unwrap();
        assert_eq!(again, m);
    }
    for expected in [1, 2] {
        if let Ok(r) = rdma::ConnectReply::decode(data, expected) {
            accepted += 1;
            let again =
                rdma::ConnectReply::decode(&serde_json::to_vec(&r).unwrap(), expected).unwrap();
            assert_eq!(again, r);
        }
    }
    accepted
}

/// The TCP data path: frame headers, descriptors, statuses, the target's
/// hello, and the endpoint from the descriptor.
pub fn tcp_wire(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Some(hb) = data.first_chunk::<{ tcp::HEADER_LEN }>() {
        if let Ok(h) = tcp::Header::decode(hb) {
            accepted += 1;
            assert_eq!(tcp::Header::decode(&h.encode()), Ok(h));
            assert!(h.count >= 1 && h.count as usize <= tcp::MAX_DESCS);
            assert!(h.payload_len <= tcp::MAX_FRAME_PAYLOAD);
            let rest = &data[tcp::HEADER_LEN..];
            let n = (h.count as usize * tcp::DESC_LEN).min(rest.len());
            if let Ok(descs) = tcp::decode_descs(&h, &rest[..n]) {
                accepted += 1;
                assert_eq!(descs.len(), h.count as usize);
                let total: u64 = descs.iter().map(|d| d.len).sum();
                assert!(total <= tcp::MAX_FRAME_PAYLOAD);
                let mut out = Vec::new();
                tcp::encode_descs(&descs, &mut out);
                assert_eq!(out, &rest[..n]);
            }
        }
    }
    let statuses = tcp::decode_statuses(data);
    assert_eq!(statuses.len(), data.len() / tcp::STATUS_LEN);
    assert!(statuses
        .iter()
        .all(|s| *s == 0 || ferry_plugins_abi::ErrorCode::from_raw(*s).is_some()));
    if let Some(hello) = data.first_chunk::<{ tcp::HELLO_LEN }>() {
        if let Ok(i) = tcp::decode_hello(hello) {
            accepted += 1;
            assert_eq!(tcp::decode_hello(&tcp::encode_hello(i)), Ok(i));
        }
    }
    if let Ok((addr, instance)) = tcp::decode_endpoint(data) {
        accepted += 1;
        if let Some(i) = instance {
            let again = tcp::decode_endpoint(&tcp::encode_endpoint(&addr, i)).unwrap();
            assert_eq!(again, (addr, Some(i)));
        }
    }
    accepted
}

/// The shm side channel's messages, and its endpoint and key text.
pub fn shm_wire(data: &[u8]) -> usize {
    let mut accepted = 0;
    for chunk in data.chunks(shm::MSG_LEN) {
        if let Some(m) = shm::Msg::decode(chunk) {
            accepted += 1;
            assert_eq!(&m.encode()[..], chunk);
        }
    }
    if let Some(e) = shm_endpoint::Endpoint::decode(data) {
        accepted += 1;
        assert_eq!(shm_endpoint::Endpoint::decode(&e.encode()), Some(e));
    }
    if let Some(k) = shm_endpoint::Key::decode(data) {
        accepted += 1;
        assert_eq!(shm_endpoint::Key::decode(&k.encode()), Some(k));
        let (base, len) = k.range();
        assert!(len > 0 && base.checked_add(len).is_some());
    }
    accepted
}

/// The cuda-ipc transport's endpoint and key text and its socket frames
/// (requests, reply headers, pieces), as a peer's bytes.
pub fn cuda_ipc_wire(data: &[u8]) -> usize {
    use cuda_ipc as w;
    let mut accepted = 0;
    if let Some(e) = w::Endpoint::decode(data) {
        accepted += 1;
        assert_eq!(w::Endpoint::decode(&e.encode()), Some(e));
    }
    if let Some(k) = w::Key::decode(data) {
        accepted += 1;
        assert!(k.len > 0 && k.addr.checked_add(k.len).is_some());
        assert_eq!(w::Key::decode(&k.encode()), Some(k));
    }
    let mut pieces = Vec::new();
    let mut reply = None;
    for chunk in data.chunks(w::PIECE_LEN) {
        if let Ok(b) = <&[u8; w::REQUEST_LEN]>::try_from(&chunk[..chunk.len().min(w::REQUEST_LEN)])
        {
            if let Some(r) = w::Request::decode(b) {
                accepted += 1;
                assert_eq!(&r.encode(), b);
            }
        }
        if let Ok(b) = <&[u8; w::REPLY_LEN]>::try_from(&chunk[..chunk.len().min(w::REPLY_LEN)]) {
            if let Some(r) = w::Reply::decode(b) {
                accepted += 1;
                assert_eq!(w::Reply::decode(&r.encode()), Some(r));
                reply.get_or_insert(r);
            }
        }
        if let Ok(b) = <&[u8; w::PIECE_LEN]>::try_from(chunk) {
            if let Some(p) = w::Piece::decode(b) {
                accepted += 1;
                assert_eq!(w::Piece::decode(&p.encode()), Some(p));
                pieces.push(p);
            }
        }
    }
    if let Some(r) = reply {
        if w::check_pieces(&r, &pieces).is_ok() {
            accepted += 1;
            let first = pieces[0].start;
            let last = pieces[pieces.len() - 1];
            assert!(r.addr >= first && r.addr + r.len <= last.start + last.len);
        }
    }
    accepted
}

/// The RDMA plugin's endpoint, buffer keys and connection messages.
pub fn rdma_wire(data: &[u8]) -> usize {
    let mut accepted = 0;
    if let Ok(e) = rdma::Endpoint::decode(data) {
        accepted += 1;
        assert_eq!(rdma::Endpoint::decode(&e.encode()), Ok(e.clone()));
        assert!(!e.nics.is_empty() && e.nics.len() <= rdma::MAX_NICS);
    }
    for nics in [1, 4, rdma::MAX_NICS] {
        if let Ok(k) = rdma::BufferKey::decode(data, nics) {
            accepted += 1;
            assert_eq!(k.encode(), data);
            assert!(k.rkeys.iter().all(|(n, _)| (*n as usize) < nics));
            assert!(k.covers(k.addr, k.len));
        }
    }
    accepted + rdma_handshake(data)
}

/// The authentication exchange, with the fuzzer as the peer: with a token
/// this side never accepts (the fuzzer cannot know the token or predict
/// the nonce), and nothing panics either way.
pub fn auth_exchange(data: &[u8]) -> usize {
    let token = Token::new("fuzz-cluster-token");
    assert!(auth::accept(&mut Scripted::new(data), token.as_ref(), "control").is_err());
    assert!(auth::connect(&mut Scripted::new(data), token.as_ref(), "tcp", "fuzz").is_err());
    usize::from(auth::accept(&mut Scripted::new(data), None, "shm").is_ok())
        + usize::from(auth::connect(&mut Scripted::new(data), None, "control", "fuzz").is_ok())
}

/// A peer that sends `input` and swallows what it is sent.
struct Scripted<'a> {
    input: &'a [u8],
    sent: usize,
}

impl<'a> Scripted<'a> {
    fn new(input: &'a [u8]) -> Scripted<'a> {
        Scripted { input, sent: 0 }
    }
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sent += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// ---- seeds -----------------------------------------------------------------

fn sample_descriptor() -> SegmentDescriptor {
    SegmentDescriptor {
        version: DESCRIPTOR_VERSION,
        name: "10.0.0.1:7000".into(),
        control: "10.0.0.1:7000".into(),
        engine_id: "e-1".into(),
        machine_id: "m-1".into(),
        process_id: "p-1".into(),
        transports: vec![TransportEndpoint {
            name: "tcp".into(),
            endpoint: encode_blob(&tcp::encode_endpoint("10.0.0.1:7001", 0x1234)),
        }],
        metrics: None,
        layouts: Vec::new(),
        buffers: vec![
            BufferDescriptor {
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                location: "cpu:0".into(),
                keys: vec![BufferKey {
                    transport: "tcp".into(),
                    key: String::new(),
                }],
                order: 1,
            },
            BufferDescriptor {
                addr: 0x7f00_0010_0000,
                len: 4096,
                location: "cuda:0".into(),
                keys: vec![BufferKey {
                    transport: "rdma".into(),
                    key: encode_blob(&sample_rdma_key().encode()),
                }],
                order: 2,
            },
        ],
    }
}

fn sample_rdma_key() -> rdma::BufferKey {
    rdma::BufferKey {
        addr: 0x7f00_0010_0000,
        len: 4096,
        rkeys: vec![(0, 0x1234), (1, 0x5678)],
        ranked: vec![1, 0],
        best: 1,
        tiers: vec![0, 1],
    }
}

fn sample_rdma_messages() -> Vec<Vec<u8>> {
    let gid = rdma::gid_hex(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
    let endpoint = rdma::Endpoint {
        v: 1,
        engine: "abc123".into(),
        nics: vec![rdma::EndpointNic {
            name: "mlx5_0".into(),
            port: 1,
            lid: 7,
            gid: gid.clone(),
            link: "ib".into(),
            mtu: 5,
        }],
    };
    let connect = rdma::Message::Connect {
        engine: "abc123".into(),
        qps: vec![rdma::QpRequest {
            nic: "mlx5_0".into(),
            qpn: 0x123,
            lid: 7,
            gid: gid.clone(),
            mtu: 5,
            to: "mlx5_1".into(),
        }],
    };
    let reply = rdma::ConnectReply {
        qps: vec![
            rdma::QpReply::Ok {
                qpn: 0x456,
                lid: 9,
                gid,
                mtu: 4,
            },
            rdma::QpReply::Err {
                message: "no such NIC".into(),
            },
        ],
    };
    vec![
        endpoint.encode(),
        serde_json::to_vec(&connect).unwrap(),
        serde_json::to_vec(&reply).unwrap(),
        sample_rdma_key().encode(),
    ]
}

fn staging_bodies() -> Vec<Vec<u8>> {
    let slot = BufferDescriptor {
        addr: 0x10000,
        len: 4 << 20,
        location: "cpu:0".into(),
        keys: vec![],
        order: 0,
    };
    vec![
        br#"{"slots":4,"slot_len":4194304}"#.to_vec(),
        br#"{"to_device":true,"slot":1,"offset":4096,"len":65536,"device_addr":140000000000}"#
            .to_vec(),
        serde_json::to_vec(&ferry_core::engine::OpenReply {
            slots: vec![slot],
            copy_list: 1,
        })
        .unwrap(),
        ferry_core::engine::CopyListRequest {
            to_device: true,
            slot: 1,
            pieces: vec![
                ferry_core::engine::ListPiece {
                    slot_offset: 0,
                    device_addr: 140000000000,
                    len: 16384,
                },
                ferry_core::engine::ListPiece {
                    slot_offset: 16384,
                    device_addr: 140000065536,
                    len: 16384,
                },
            ],
        }
        .encode(),
    ]
}

fn tcp_frames() -> Vec<Vec<u8>> {
    let mut write = tcp::Header {
        kind: tcp::Kind::Write,
        flags: 0,
        count: 2,
        seq: 7,
        payload_len: 24,
    }
    .encode()
    .to_vec();
    tcp::encode_descs(
        &[
            tcp::Desc {
                addr: 0x1000,
                len: 8,
            },
            tcp::Desc {
                addr: 0x2000,
                len: 16,
            },
        ],
        &mut write,
    );
    write.extend_from_slice(&[0xab; 24]);
    let mut read = tcp::Header {
        kind: tcp::Kind::Read,
        flags: 0,
        count: 1,
        seq: 8,
        payload_len: 0,
    }
    .encode()
    .to_vec();
    tcp::encode_descs(
        &[tcp::Desc {
            addr: 0x1000,
            len: 4096,
        }],
        &mut read,
    );
    let mut response = tcp::Header {
        kind: tcp::Kind::Response,
        flags: 0,
        count: 2,
        seq: 8,
        payload_len: 0,
    }
    .encode()
    .to_vec();
    tcp::encode_statuses(
        &[0, ferry_plugins_abi::sys::FERRY_ERR_OUT_OF_BOUNDS],
        &mut response,
    );
    vec![
        write,
        read,
        response,
        tcp::encode_hello(0xfeed_beef).to_vec(),
        tcp::encode_endpoint("127.0.0.1:40000", 0xfeed_beef),
        tcp::encode_endpoint("[::1]:7", 1),
    ]
}

fn cuda_ipc_messages() -> Vec<Vec<u8>> {
    use cuda_ipc as w;
    let reply = w::Reply {
        op: w::OP_REPLY,
        status: 0,
        id: 9,
        addr: 0x20_0000,
        len: 0x30_0000,
        kind: w::KIND_VMM,
        count: 2,
    };
    let piece = |start| w::Piece {
        start,
        len: 0x20_0000,
        fd_offset: 0,
        has_fd: true,
        handle: [0; 64],
    };
    let mut frames = Vec::new();
    let mut r = reply.encode().to_vec();
    r.resize(w::PIECE_LEN, 0);
    frames.extend(r);
    frames.extend(piece(0x20_0000).encode());
    frames.extend(piece(0x40_0000).encode());
    vec![
        frames,
        w::Request {
            op: w::OP_OPEN,
            id: 3,
        }
        .encode()
        .to_vec(),
        w::Endpoint {
            pid: 4242,
            uid: 1000,
            pidns: 4026531836,
            ipcns: 4026531839,
            boot: vec![0xab; 16],
            socket: b"ferry-cuda-ipc-4242-0123456789abcdef".to_vec(),
        }
        .encode(),
        w::Key {
            id: 7,
            addr: 0x7f00_0000_0000,
            len: 1 << 30,
            memory: w::Memory::Device {
                gpu: "GPU-e0e1e2e3-e4e5-e6e7-e8e9-eaebecedeeef".into(),
            },
        }
        .encode(),
        b"host 8 1000 1000 shared".to_vec(),
    ]
}

fn shm_messages() -> Vec<Vec<u8>> {
    let mut both = shm::Msg {
        kind: shm::MAP,
        id: 1,
        a: 7,
        b: 0,
    }
    .encode()
    .to_vec();
    both.extend_from_slice(
        &shm::Msg {
            kind: shm::REVOKE,
            id: 2,
            a: 3,
            b: 7,
        }
        .encode(),
    );
    vec![
        both,
        shm_endpoint::Endpoint {
            pid: 4242,
            pidns: 4026531836,
            uid: 1000,
            socket: b"ferry-shm-0123456789abcdef".to_vec(),
            probe: 0x7fff_1234,
            cma: true,
        }
        .encode(),
        shm_endpoint::Key::Map {
            id: 3,
            token: 7,
            base: 0x7f00_0000_0000,
            len: 1 << 21,
            offset: 4096,
        }
        .encode(),
        shm_endpoint::Key::Cma {
            id: 4,
            base: 0x5000,
            len: 4096,
        }
        .encode(),
    ]
}

fn auth_messages() -> Vec<Vec<u8>> {
    // Well-shaped greetings, proofs and verdicts (the MACs cannot be right).
    let mut hello = b"FRYA\x01\x01\x00\x00".to_vec();
    hello.extend_from_slice(&[0x11; 32]);
    let mut proof = b"FRYB\x01\x01\x00\x00".to_vec();
    proof.extend_from_slice(&[0x22; 64]);
    let mut done = b"FRYD\x01\x00\x00\x00".to_vec();
    done.extend_from_slice(&[0x33; 32]);
    let mut no_token = b"FRYA\x01\x00\x00\x00".to_vec();
    no_token.extend_from_slice(&[0x44; 32]);
    let mut exchange = no_token.clone();
    exchange.extend_from_slice(&done);
    vec![
        hello.clone(),
        [hello, done.clone()].concat(),
        proof,
        exchange,
        [b"FRYB\x01\x00\x00\x00".to_vec(), vec![0; 64]].concat(),
    ]
}

/// Valid (or nearly valid) inputs for a target: where mutation starts.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut out = match target {
        "control_frame" => {
            let d = sample_descriptor();
            let mut frames = vec![
                control::encode_frame(MsgType::GetDescriptor, b"{}"),
                control::encode_frame(MsgType::Descriptor, &d.to_json()),
                control::encode_frame(MsgType::Error, br#"{"code":-5,"message":"out of bounds"}"#),
            ];
            for m in sample_rdma_messages() {
                frames.push(control::encode_frame(
                    MsgType::PluginRequest,
                    &control::encode_plugin_request("rdma", "10.0.0.2:7000", &m),
                ));
            }
            for (kind, body) in [
                MsgType::StageOpen,
                MsgType::StageCopy,
                MsgType::StageOpened,
                MsgType::StageCopyList,
            ]
            .into_iter()
            .zip(staging_bodies())
            {
                frames.push(control::encode_frame(kind, &body));
            }
            // Two frames back to back, as a connection carries them.
            let two = [frames[0].clone(), frames[2].clone()].concat();
            frames.push(two);
            frames
        }
        "descriptor" => {
            let mut d = sample_descriptor();
            let full = d.to_json();
            d.buffers.clear();
            vec![full, d.to_json()]
        }
        "staging" => staging_bodies(),
        "plugin_message" => sample_rdma_messages()
            .iter()
            .map(|m| control::encode_plugin_request("rdma", "10.0.0.2:7000", m))
            .collect(),
        "tcp_wire" => tcp_frames(),
        "shm_wire" => shm_messages(),
        "cuda_ipc_wire" => cuda_ipc_messages(),
        "rdma_wire" => sample_rdma_messages(),
        "auth" => auth_messages(),
        "notify" => {
            use ferry_core::notify::{encode_notify, Notify};
            vec![
                encode_notify(
                    "10.0.0.2:7000",
                    &Notify::new("kv", &b"blocks 1..9"[..]).unwrap(),
                ),
                encode_notify("", &Notify::new("", Vec::new()).unwrap()),
            ]
        }
        _ => Vec::new(),
    };
    out.push(Vec::new());
    out
}

/// Tokens the mutator inserts: JSON syntax and boundary numbers, field
/// names, and every magic of Ferry's protocols.
const DICTIONARY: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"null",
    b"true",
    b"-1",
    b"0",
    b"1e999",
    b"18446744073709551615",
    b"18446744073709551616",
    b"4294967296",
    b"\"\\u0000\"",
    b"\"version\"",
    b"\"buffers\"",
    b"\"addr\"",
    b"\"len\"",
    b"\"keys\"",
    b"\"transports\"",
    b"\"endpoint\"",
    b"\"slots\"",
    b"\"slot_len\"",
    b"\"offset\"",
    b"\"op\"",
    b"\"connect\"",
    b"\"qps\"",
    b"\"nics\"",
    b"\"gid\"",
    b"FRYC",
    b"FERY",
    b"FERH",
    b"FRK1",
    b"FRYA",
    b"FRYB",
    b"FRYD",
    b"ferry-shm/1",
    b"ferry-cuda-ipc/1",
    b"dev ",
    b"host ",
    b" GPU-",
    b" pid=",
    b"map ",
    b"cma ",
];

// ---- the mutation driver ---------------------------------------------------

/// xorshift64*: deterministic, so a failure reproduces from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    1024,
    1025,
    4096,
    0x7fff_ffff,
    0xffff_ffff,
    16 << 20,
    (16 << 20) + 1,
    64 << 20,
    (64 << 20) + 1,
    u64::MAX / 2,
    u64::MAX - 1,
    u64::MAX,
];

const MAX_INPUT: usize = 64 << 10;

/// One mutant of a random seed: one to four edits (bit flips, bytes,
/// boundary integers, insertions, deletions, duplications, splices with
/// another seed, truncation, dictionary tokens).
pub fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut d = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        let len = d.len();
        match rng.below(10) {
            0 if len > 0 => {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                d[i] = rng.next_u64() as u8;
            }
            2 if len > 0 => {
                let i = rng.below(len);
                d[i] = INTERESTING[rng.below(5)] as u8;
            }
            3 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let width = [2, 4, 8][rng.below(3)];
                let bytes = &v.to_le_bytes()[..width];
                if len >= width {
                    let i = rng.below(len - width + 1);
                    d[i..i + width].copy_from_slice(bytes);
                } else {
                    d.extend_from_slice(bytes);
                }
            }
            4 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let junk: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                d.splice(i..i, junk);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                d.drain(i..i + n);
            }
            6 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let copy = d[i..i + n].to_vec();
                let at = rng.below(len + 1);
                d.splice(at..at, copy);
            }
            7 => {
                let other = &seeds[rng.below(seeds.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                d.truncate(cut);
                d.extend_from_slice(&other[from..]);
            }
            8 if len > 0 => d.truncate(rng.below(len)),
            _ => {
                let token = DICTIONARY[rng.below(DICTIONARY.len())];
                let i = rng.below(len + 1);
                if rng.below(2) == 0 || i == len {
                    d.splice(i..i, token.iter().copied());
                } else {
                    let end = (i + token.len()).min(len);
                    d.splice(i..end, token.iter().copied());
                }
            }
        }
    }
    d.truncate(MAX_INPUT);
    d
}

/// What a bounded run did.
#[derive(Debug, Default)]
pub struct Stats {
    pub executions: usize,
    /// Inputs at least one decoder accepted.
    pub accepted: usize,
}

/// Runs `target` on every seed, then on `iterations` mutants; a mutant some
/// decoder accepted joins the pool, so edits compound where it matters. A
/// panic is re-raised with the input that caused it, in hex.
pub fn run_bounded(name: &str, target: Target, iterations: usize, seed: u64) -> Stats {
    let mut pool = seeds(name);
    let mut rng = Rng::new(seed);
    let mut stats = Stats::default();
    let check = |input: &[u8]| -> usize {
        match std::panic::catch_unwind(|| target(input)) {
            Ok(n) => n,
            Err(_) => {
                let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
                panic!(
                    "fuzz target {name} failed on {} bytes (driver seed {seed:#x}): {hex}",
                    input.len()
                );
            }
        }
    };
    for s in pool.clone() {
        stats.executions += 1;
        stats.accepted += usize::from(check(&s) > 0);
    }
    for _ in 0..iterations {
        let input = mutate(&mut rng, &pool);
        stats.executions += 1;
        if check(&input) > 0 {
            stats.accepted += 1;
            if pool.len() < 1024 {
                pool.push(input);
            } else {
                let i = rng.below(pool.len());
                pool[i] = input;
            }
        }
    }
    stats
}
