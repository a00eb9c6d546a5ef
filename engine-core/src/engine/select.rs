//! Selection: the engine's transports, and which of them carries a request
//! and why. A function of plain data (what each transport declares, the
//! local buffer, the peer's view) and of one question only a live peer can
//! answer (does its plugin accept this buffer), passed in; so it is tested
//! with fake transports and no sockets.

use super::request::{Scope, SegmentId};
use super::segments::{RemoteSegment, RemoteView};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, Visibility};
use crate::transport::Transport;
use ferry_plugins_abi::sys;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::ops::Deref;
use std::sync::Arc;

/// What selection reads of a transport.
pub(crate) trait Candidate {
    fn name(&self) -> &str;
    /// The `FERRY_MEM_*` bits it moves.
    fn mem_kinds(&self) -> u64;
    /// The `FERRY_SCOPE_*` bits it reaches.
    fn scopes(&self) -> u32;
}

impl Candidate for Transport {
    fn name(&self) -> &str {
        &self.name
    }
    fn mem_kinds(&self) -> u64 {
        self.mem_kinds
    }
    fn scopes(&self) -> u32 {
        self.scopes
    }
}

impl<T: Candidate> Candidate for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn mem_kinds(&self) -> u64 {
        (**self).mem_kinds()
    }
    fn scopes(&self) -> u32 {
        (**self).scopes()
    }
}

/// The transports an engine started, in load order (an index into this
/// list names a transport everywhere in the engine), with what start-up
/// said about them.
pub(crate) struct Transports<T> {
    list: Vec<T>,
    /// Enabled transports that failed to start, with the error.
    pub(crate) failures: Vec<(String, Error)>,
    /// Each started transport's endpoint, as the descriptor announces it.
    pub(crate) endpoints: Vec<(String, Vec<u8>)>,
    /// (segment, transport) pairs whose route was logged.
    logged: Mutex<HashSet<(SegmentId, usize)>>,
}

impl<T> Deref for Transports<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.list
    }
}

/// One request's question to selection.
pub(crate) struct Want<'a> {
    pub(crate) local: &'a LocalBuffer,
    pub(crate) segment: &'a RemoteSegment,
    pub(crate) view: &'a RemoteView,
    /// Index of the remote buffer in `view`.
    pub(crate) remote: usize,
    /// The transport the request asks for, if any.
    pub(crate) hint: Option<&'a str>,
    /// Put the reason into words (for logs and `route`); otherwise the
    /// per-request path stays free of formatting.
    pub(crate) explain: bool,
}

impl<T: Candidate> Transports<T> {
    pub(crate) fn new(
        list: Vec<T>,
        failures: Vec<(String, Error)>,
        endpoints: Vec<(String, Vec<u8>)>,
    ) -> Transports<T> {
        Transports {
            list,
            failures,
            endpoints,
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// Whether the route (segment, transport) is to be logged: true once.
    pub(crate) fn first_use(&self, segment: SegmentId, transport: usize) -> bool {
        self.logged.lock().insert((segment, transport))
    }

    /// Picks the transport for one request and says why: the best-ranked
    /// transport that can move this memory to a peer in this scope, runs at
    /// the peer, has a key for the remote buffer, and does not decline this
    /// peer or buffer (`accepts(transport, key)`, asked in rank order until
    /// one accepts).
    pub(crate) fn select(
        &self,
        want: &Want<'_>,
        mut accepts: impl FnMut(usize, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<(usize, String)> {
        let Want {
            local,
            segment: seg,
            view,
            remote,
            hint,
            explain,
        } = *want;
        let remote_buf = &view.buffers[remote];
        let mut candidates: Vec<(usize, (u8, u8))> = Vec::new();
        let mut rejected: Vec<String> = Vec::new();
        for (i, t) in self.list.iter().enumerate() {
            let name = t.name();
            if hint.is_some_and(|h| h != name) {
                continue;
            }
            let verdict = if local.visibility == Visibility::Unregistered
                && local.registration(i).is_none()
            {
                Some(format!(
                    "{name} needs local memory registered (register [{:#x}, {:#x}) with \
                     register_memory first)",
                    local.addr,
                    local.end()
                ))
            } else if local.device.is_some() && local.registration(i).is_none() {
                Some(format!(
                    "{name} did not register this {} memory directly",
                    local.location
                ))
            } else if local.device.is_none() && t.mem_kinds() & local.mem_kind == 0 {
                Some(format!("{name} cannot move {} memory", local.location))
            } else if !crate::transport::scope_served(t.scopes(), seg.scope.raw()) {
                Some(format!(
                    "{name} cannot reach a peer on {}",
                    seg.scope.as_str()
                ))
            } else if !view.endpoints.contains_key(name) {
                Some(format!("{name} does not run at the peer"))
            } else if !remote_buf.keys.contains_key(name) {
                Some(format!(
                    "{name} did not register the peer's buffer at {:#x}",
                    remote_buf.addr
                ))
            } else {
                None
            };
            match verdict {
                Some(v) => rejected.push(v),
                None => candidates.push((i, rank(t))),
            }
        }
        candidates.sort_by_key(|(i, r)| (*r, *i));
        let mut chosen = None;
        for (i, _) in &candidates {
            let name = self.list[*i].name();
            let key = remote_buf
                .keys
                .get(name)
                .map(|k| &k[..])
                .unwrap_or_default();
            match accepts(*i, key) {
                Ok(()) => {
                    chosen = Some(*i);
                    break;
                }
                Err(why) => rejected.push(format!("{name} declined: {why}")),
            }
        }
        let Some(best) = chosen else {
            let what = match hint {
                Some(h) => format!("transport {h} was requested but cannot serve this request"),
                None => format!(
                    "no transport can move {} memory to {} ({})",
                    local.location,
                    seg.name,
                    seg.scope.as_str()
                ),
            };
            let code = if hint.is_some() {
                ErrorCode::Unsupported
            } else {
                ErrorCode::Unavailable
            };
            return Err(Error::new(
                code,
                format!(
                    "{what}: {}",
                    if rejected.is_empty() {
                        "this engine has no transport plugin that can move data (`ferry info` \
                         shows why each plugin is disabled; FERRY_PLUGIN_PATH adds directories)"
                            .to_string()
                    } else {
                        rejected.join("; ")
                    }
                ),
            ));
        };
        let t = &self.list[best];
        if !explain {
            return Ok((best, String::new()));
        }
        if hint.is_some() {
            return Ok((best, format!("{} was requested", t.name())));
        }
        let mut reason = format!(
            "{} memory to {} memory on {}: {}",
            local.location,
            remote_buf.location,
            seg.scope.as_str(),
            rank_reason(t, seg.scope)
        );
        if let Some(r) = local.registration(best).filter(|_| local.device.is_some()) {
            let how = ferry_plugins_abi::caps::mem_kind_names(r.mem_kind).join(", ");
            reason.push_str(&format!(
                " (local {} memory registered as {how})",
                local.location
            ));
        }
        let others: Vec<&str> = candidates
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| *i != best && rank(&self.list[*i]) >= rank(t))
            .map(|i| self.list[i].name())
            .collect();
        if !others.is_empty() {
            reason.push_str(&format!("; preferred over {}", others.join(", ")));
        }
        if !rejected.is_empty() {
            reason.push_str(&format!("; not usable: {}", rejected.join("; ")));
        }
        Ok((best, reason))
    }
}

/// Whether transport `transport` (named `name`) serves this segment's
/// buffer with `key`: `ask` puts the question to the peer's plugin once
/// (`None`: the peer could not be asked, which is not a refusal and is not
/// remembered), and the answer is remembered for the segment.
pub(crate) fn acceptance(
    seg: &RemoteSegment,
    transport: usize,
    name: &str,
    key: &[u8],
    ask: impl FnOnce() -> Option<std::result::Result<(), String>>,
) -> std::result::Result<(), String> {
    if let Some(v) = seg.verdicts.lock().get(&transport).and_then(|m| m.get(key)) {
        return v.clone();
    }
    let Some(verdict) = ask() else {
        return Ok(());
    };
    if let Err(why) = &verdict {
        log::info!(
            "segment {}: {name} declined some of its buffers ({why}); using the next transport \
             for them",
            seg.name,
        );
    }
    seg.verdicts
        .lock()
        .entry(transport)
        .or_default()
        .insert(key.to_vec(), verdict.clone());
    verdict
}

/// Lower is better: transports limited to one process beat those limited to
/// one host, which beat cross-host ones; among cross-host ones RDMA beats
/// vendor plugins, which beat TCP, the transport of last resort.
pub(crate) fn rank(t: &impl Candidate) -> (u8, u8) {
    let scopes = t.scopes();
    let locality = if scopes & (sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST) == 0 {
        0
    } else if scopes & sys::FERRY_SCOPE_CROSS_HOST == 0 {
        1
    } else {
        2
    };
    let kind = if t.name().starts_with("rdma") {
        0
    } else if t.name() == "tcp" {
        2
    } else {
        1
    };
    (locality, kind)
}

fn rank_reason(t: &impl Candidate, scope: Scope) -> String {
    let name = t.name();
    match rank(t) {
        (0, _) => format!("{name} copies within this process"),
        (1, _) => format!("{name} is a same-host transport and the peer is on this host"),
        (_, 0) => format!("{name} moves data by RDMA"),
        (_, 2) => match scope {
            Scope::CrossHost => {
                format!("{name} is the only cross-host transport both ends run")
            }
            _ => format!(
                "{name} works between any two engines (no same-host transport can serve this)"
            ),
        },
        _ => format!("{name} is a vendor transport both ends run"),
    }
}

/// Fake transports and the plain data selection reads, for unit tests
/// here and in planning: no plugin, no socket.
#[cfg(test)]
pub(crate) mod fakes {
    use super::super::request::{Scope, SegmentId};
    use super::super::segments::RemoteSegment;
    use super::Candidate;
    use crate::descriptor::{
        encode_blob, BufferDescriptor, BufferKey, SegmentDescriptor, TransportEndpoint,
        DESCRIPTOR_VERSION,
    };
    use crate::location::Location;
    use crate::memory::{LocalBuffer, TransportRegistration, Visibility};
    use ferry_plugins_abi::sys;
    use std::sync::Arc;

    pub(crate) const HOST: u64 = sys::FERRY_MEM_HOST;
    pub(crate) const SAME_HOST: u32 = sys::FERRY_SCOPE_SAME_HOST;
    pub(crate) const ANY_HOST: u32 = sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST;
    pub(crate) const CROSS_HOST: u32 = sys::FERRY_SCOPE_CROSS_HOST;

    /// A transport as selection sees it: what it declares.
    pub(crate) struct FakeTransport {
        pub(crate) name: &'static str,
        pub(crate) mem_kinds: u64,
        pub(crate) scopes: u32,
    }

    impl Candidate for FakeTransport {
        fn name(&self) -> &str {
            self.name
        }
        fn mem_kinds(&self) -> u64 {
            self.mem_kinds
        }
        fn scopes(&self) -> u32 {
            self.scopes
        }
    }

    pub(crate) fn fake(name: &'static str, mem_kinds: u64, scopes: u32) -> FakeTransport {
        FakeTransport {
            name,
            mem_kinds,
            scopes,
        }
    }

    /// tcp (any host), shm (same host), rdma (any host), as the real ones
    /// declare themselves.
    pub(crate) fn usual() -> Vec<FakeTransport> {
        vec![
            fake("tcp", HOST, ANY_HOST),
            fake("shm", HOST, SAME_HOST),
            fake("rdma", HOST | sys::FERRY_MEM_CUDA_DMABUF, ANY_HOST),
        ]
    }

    fn registrations(transports: &[usize], mem_kind: u64) -> Vec<TransportRegistration> {
        transports
            .iter()
            .map(|&t| TransportRegistration {
                transport: t,
                handle: t as u64 + 1,
                key: vec![t as u8],
                mem_kind,
            })
            .collect()
    }

    /// Host memory on NUMA node 0, registered with `transports`.
    pub(crate) fn host_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
        Arc::new(LocalBuffer {
            addr,
            len,
            location: Location::Cpu(0),
            mem_kind: HOST,
            device: None,
            visibility: Visibility::Published,
            registrations: registrations(transports, HOST),
            inflight: Default::default(),
        })
    }

    /// Memory of cuda:0, registered directly (DMA-BUF) with `transports`.
    pub(crate) fn device_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
        Arc::new(LocalBuffer {
            addr,
            len,
            location: Location::Cuda(0),
            mem_kind: sys::FERRY_MEM_CUDA_STAGED,
            device: Some(0),
            visibility: Visibility::Published,
            registrations: registrations(transports, sys::FERRY_MEM_CUDA_DMABUF),
            inflight: Default::default(),
        })
    }

    /// A peer's descriptor: the transports it runs, and its buffers
    /// (address, length, location, the transports that registered it).
    pub(crate) fn descriptor(
        engine_id: &str,
        transports: &[&str],
        buffers: &[(u64, u64, &str, &[&str])],
    ) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "peer:1".into(),
            control: String::new(),
            engine_id: engine_id.into(),
            machine_id: "m".into(),
            process_id: "p".into(),
            transports: transports
                .iter()
                .map(|t| TransportEndpoint {
                    name: t.to_string(),
                    endpoint: encode_blob(t.as_bytes()),
                })
                .collect(),
            buffers: buffers
                .iter()
                .map(|(addr, len, location, keys)| BufferDescriptor {
                    addr: *addr,
                    len: *len,
                    location: location.to_string(),
                    keys: keys
                        .iter()
                        .map(|t| BufferKey {
                            transport: t.to_string(),
                            key: encode_blob(format!("{t}@{addr:#x}").as_bytes()),
                        })
                        .collect(),
                    order: 0,
                })
                .collect(),
        }
    }

    pub(crate) fn segment(id: SegmentId, scope: Scope, d: SegmentDescriptor) -> Arc<RemoteSegment> {
        Arc::new(RemoteSegment::new(id, "peer:1", scope, d))
    }
}

#[cfg(test)]
mod tests {
    use super::fakes::*;
    use super::*;
    use std::cell::Cell;

    const ALL: &[&str] = &["tcp", "shm", "rdma"];

    fn pick(
        transports: &Transports<FakeTransport>,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        hint: Option<&str>,
    ) -> Result<(usize, String)> {
        let view = seg.view.read().clone();
        let want = Want {
            local,
            segment: seg,
            view: &view,
            remote: 0,
            hint,
            explain: true,
        };
        transports.select(&want, |_, _| Ok(()))
    }

    fn with(list: Vec<FakeTransport>) -> Transports<FakeTransport> {
        Transports::new(list, Vec::new(), Vec::new())
    }

    #[test]
    fn a_same_host_peer_gets_the_same_host_transport() {
        let t = with(usual());
        let d = descriptor("e", ALL, &[(0x1000, 4096, "cpu:0", ALL)]);
        let seg = segment(1, Scope::SameHost, d);
        let (best, why) = pick(&t, &host_buffer(0x9000, 4096, &[0, 1, 2]), &seg, None).unwrap();
        assert_eq!(t[best].name, "shm");
        assert!(why.contains("same-host transport"), "{why}");
        assert!(why.contains("preferred over rdma, tcp"), "{why}");
    }

    #[test]
    fn a_cross_host_peer_gets_rdma_then_a_vendor_transport_then_tcp() {
        let mut list = usual();
        list.push(fake("acme", HOST, CROSS_HOST));
        let t = with(list);
        let local = host_buffer(0x9000, 4096, &[0, 1, 2, 3]);
        let everything = &["tcp", "shm", "rdma", "acme"];
        let d = descriptor("e", everything, &[(0x1000, 4096, "cpu:0", everything)]);
        let (best, why) = pick(&t, &local, &segment(1, Scope::CrossHost, d), None).unwrap();
        assert_eq!(t[best].name, "rdma");
        assert!(
            why.contains("shm cannot reach a peer on another host"),
            "{why}"
        );

        let no_rdma = &["tcp", "acme"];
        let d = descriptor("e", no_rdma, &[(0x1000, 4096, "cpu:0", no_rdma)]);
        let (best, why) = pick(&t, &local, &segment(1, Scope::CrossHost, d), None).unwrap();
        assert_eq!(t[best].name, "acme");
        assert!(why.contains("rdma does not run at the peer"), "{why}");

        let only_tcp_key = &["tcp"];
        let d = descriptor("e", everything, &[(0x1000, 4096, "cpu:0", only_tcp_key)]);
        let (best, why) = pick(&t, &local, &segment(1, Scope::CrossHost, d), None).unwrap();
        assert_eq!(t[best].name, "tcp");
        assert!(why.contains("only cross-host transport"), "{why}");
        assert!(
            why.contains("rdma did not register the peer's buffer at 0x1000"),
            "{why}"
        );
    }

    #[test]
    fn a_transport_that_declines_gives_way_to_the_next() {
        let t = with(usual());
        let d = descriptor("e", ALL, &[(0x1000, 4096, "cpu:0", ALL)]);
        let seg = segment(1, Scope::CrossHost, d);
        let view = seg.view.read().clone();
        let local = host_buffer(0x9000, 4096, &[0, 1, 2]);
        let want = Want {
            local: &local,
            segment: &seg,
            view: &view,
            remote: 0,
            hint: None,
            explain: true,
        };
        let mut asked = Vec::new();
        let (best, why) = t
            .select(&want, |i, key| {
                asked.push((i, key.to_vec()));
                if i == 2 {
                    Err("no route to the peer's NIC".into())
                } else {
                    Ok(())
                }
            })
            .unwrap();
        assert_eq!(t[best].name, "tcp");
        assert!(
            why.contains("rdma declined: no route to the peer's NIC"),
            "{why}"
        );
        // In rank order, each with its key for the remote buffer.
        assert_eq!(
            asked,
            vec![(2, b"rdma@0x1000".to_vec()), (0, b"tcp@0x1000".to_vec())]
        );
    }

    #[test]
    fn a_requested_transport_is_used_or_refused() {
        let t = with(usual());
        let d = descriptor("e", ALL, &[(0x1000, 4096, "cpu:0", ALL)]);
        let seg = segment(1, Scope::CrossHost, d);
        let local = host_buffer(0x9000, 4096, &[0, 1, 2]);
        let (best, why) = pick(&t, &local, &seg, Some("tcp")).unwrap();
        assert_eq!((t[best].name, why.as_str()), ("tcp", "tcp was requested"));
        let e = pick(&t, &local, &seg, Some("shm")).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unsupported);
        assert!(
            e.message
                .starts_with("transport shm was requested but cannot serve this request"),
            "{}",
            e.message
        );
    }

    #[test]
    fn when_nothing_serves_every_reason_is_given() {
        let t = with(vec![
            fake("tcp", HOST, ANY_HOST),
            fake("gpu-only", sys::FERRY_MEM_CUDA_DMABUF, ANY_HOST),
        ]);
        let d = descriptor(
            "e",
            &["gpu-only"],
            &[(0x1000, 4096, "cpu:0", &["gpu-only"])],
        );
        let seg = segment(1, Scope::CrossHost, d);
        let e = pick(&t, &host_buffer(0x9000, 4096, &[0]), &seg, None).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(
            e.message.contains("tcp does not run at the peer")
                && e.message.contains("gpu-only cannot move cpu:0 memory"),
            "{}",
            e.message
        );

        let none = with(Vec::new());
        let e = pick(&none, &host_buffer(0x9000, 4096, &[]), &seg, None).unwrap_err();
        assert!(
            e.message.contains("no transport plugin that can move data"),
            "{}",
            e.message
        );
    }

    #[test]
    fn device_memory_goes_only_to_transports_that_registered_it() {
        let t = with(usual());
        let d = descriptor("e", ALL, &[(0x1000, 4096, "cpu:0", ALL)]);
        let seg = segment(1, Scope::SameHost, d);
        let (best, why) = pick(&t, &device_buffer(0x9000, 4096, &[2]), &seg, None).unwrap();
        assert_eq!(t[best].name, "rdma");
        assert!(
            why.contains("shm did not register this cuda:0 memory directly"),
            "{why}"
        );
        assert!(
            why.contains("local cuda:0 memory registered as cuda-dmabuf"),
            "{why}"
        );
        let e = pick(&t, &device_buffer(0x9000, 4096, &[]), &seg, None).unwrap_err();
        assert_eq!(e.code, ErrorCode::Unavailable);
    }

    #[test]
    fn the_per_request_path_does_not_explain() {
        let t = with(usual());
        let d = descriptor("e", ALL, &[(0x1000, 4096, "cpu:0", ALL)]);
        let seg = segment(1, Scope::SameHost, d);
        let view = seg.view.read().clone();
        let local = host_buffer(0x9000, 4096, &[0, 1, 2]);
        let want = Want {
            local: &local,
            segment: &seg,
            view: &view,
            remote: 0,
            hint: None,
            explain: false,
        };
        assert_eq!(t.select(&want, |_, _| Ok(())).unwrap(), (1, String::new()));
    }

    #[test]
    fn a_peer_is_asked_once_per_key_and_a_peer_that_cannot_be_asked_is_not_remembered() {
        let seg = segment(1, Scope::CrossHost, descriptor("e", ALL, &[]));
        let asked = Cell::new(0);
        let ask = |answer: Option<std::result::Result<(), String>>| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                answer
            }
        };
        // Unreachable for now: let the request try, and ask again later.
        assert_eq!(acceptance(&seg, 2, "rdma", b"k", ask(None)), Ok(()));
        let no = Err("too far".to_string());
        assert_eq!(acceptance(&seg, 2, "rdma", b"k", ask(Some(no.clone()))), no);
        assert_eq!(acceptance(&seg, 2, "rdma", b"k", ask(Some(Ok(())))), no);
        assert_eq!(asked.get(), 2);
        // Another key, or another transport, is another question.
        assert_eq!(
            acceptance(&seg, 2, "rdma", b"k2", ask(Some(Ok(())))),
            Ok(())
        );
        assert_eq!(acceptance(&seg, 0, "tcp", b"k", ask(Some(Ok(())))), Ok(()));
        assert_eq!(asked.get(), 4);
        // A restarted peer is asked again.
        seg.replace_view(descriptor("restarted", ALL, &[]));
        assert_eq!(acceptance(&seg, 2, "rdma", b"k", ask(Some(Ok(())))), Ok(()));
        assert_eq!(asked.get(), 5);
    }

    #[test]
    fn ranks_order_scope_first_then_kind() {
        let r = |name, scopes| rank(&fake(name, HOST, scopes));
        let in_process = r("loopback", sys::FERRY_SCOPE_SAME_PROCESS);
        let shm = r("shm", SAME_HOST);
        let rdma = r("rdma", ANY_HOST);
        let vendor = r("acme", ANY_HOST);
        let tcp = r("tcp", ANY_HOST);
        assert!(in_process < shm && shm < rdma && rdma < vendor && vendor < tcp);
    }
}
