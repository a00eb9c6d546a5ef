use super::*;
use crate::descriptor::SegmentDescriptor;
use crate::engine::request::Scope;
use crate::engine::select::fakes::*;
use crate::memory::Visibility;
use parking_lot::Mutex;

const LOCAL: u64 = 0x10_0000;
const REMOTE: u64 = 0x1000;

/// Peers answered from tables: what a refresh reads, who declines.
#[derive(Default)]
struct FakePeers {
    /// The descriptor a refresh reads (none: the peer is unreachable).
    reread: Mutex<Option<SegmentDescriptor>>,
    refreshes: Mutex<usize>,
    declined: Vec<usize>,
    asked: Mutex<usize>,
}

impl Peers for FakePeers {
    fn unregistered_local(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
        match addr {
            // Below LOCAL: memory tcp (transport 0) moves unregistered.
            a if a < LOCAL => Ok(unregistered_host_buffer(addr, len, &[0])),
            _ => Err(Error::new(
                ErrorCode::OutOfBounds,
                format!("request {i}: not registered"),
            )),
        }
    }
    fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>> {
        *self.refreshes.lock() += 1;
        match self.reread.lock().clone() {
            Some(d) => Ok(seg.replace_view(d)),
            None => Err(Error::new(ErrorCode::Connection, "unreachable")),
        }
    }
    fn accepts(
        &self,
        _seg: &RemoteSegment,
        transport: usize,
        _local_mem: Option<u64>,
        _key: &[u8],
    ) -> std::result::Result<(), String> {
        *self.asked.lock() += 1;
        match self.declined.contains(&transport) {
            true => Err("declined".into()),
            false => Ok(()),
        }
    }
}

/// An engine's state without an engine: fake transports, registered
/// local memory, and segment 1 (a same-host peer) open.
struct World {
    transports: Transports<FakeTransport>,
    memory: MemoryRegistry,
    segments: Segments,
    peers: FakePeers,
}

impl World {
    fn new(transports: Vec<FakeTransport>, peer: SegmentDescriptor) -> World {
        let segments = Segments::new(Default::default());
        segments.insert(segment(1, Scope::SameHost, peer));
        World {
            transports: Transports::new(transports, Vec::new(), Vec::new()),
            memory: MemoryRegistry::default(),
            segments,
            peers: FakePeers::default(),
        }
    }

    fn planner(&self) -> Planner<'_, FakeTransport> {
        Planner {
            transports: &self.transports,
            memory: &self.memory,
            segments: &self.segments,
            peers: &self.peers,
            has_devices: true,
        }
    }

    fn plan(&self, requests: &[Request]) -> Result<Plan> {
        self.planner().plan(requests, None)
    }
}

/// tcp and shm at both ends; the peer has two adjacent host buffers of
/// 64 KiB; 1 MiB of local host memory is registered with both.
fn world() -> World {
    let both: &[&str] = &["tcp", "shm"];
    let peer = descriptor(
        "e1",
        both,
        &[
            (REMOTE, 64 << 10, "cpu:0", both),
            (REMOTE + (64 << 10), 64 << 10, "cpu:0", both),
        ],
    );
    let w = World::new(
        vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
        peer,
    );
    w.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
    w
}

fn write(local: u64, remote: u64, len: u64) -> Request {
    Request::new(Op::Write, LOCAL + local, 1, REMOTE + remote, len)
}

fn shape(plan: &Plan) -> Vec<(usize, usize, u64, u64, usize)> {
    plan.routed
        .iter()
        .map(|p| {
            (
                p.first,
                p.count,
                p.local_addr - LOCAL,
                p.length,
                p.transport,
            )
        })
        .collect()
}

#[test]
fn adjacent_requests_become_one() {
    let w = world();
    let plan = w
        .plan(&[
            write(0, 0, 4096),
            write(4096, 4096, 4096),
            write(8192, 8192, 4096),
            write(65536, 16384, 4096),
        ])
        .unwrap();
    assert_eq!(plan.requests, 4);
    assert!(plan.staged.is_empty());
    // Both to shm (the same-host transport).
    assert_eq!(
        shape(&plan),
        vec![(0, 3, 0, 12288, 1), (3, 1, 65536, 4096, 1)]
    );
    assert_eq!(&plan.routed[0].remote_key[..], b"shm@0x1000");
}

#[test]
fn requests_are_not_joined_across_an_op_a_buffer_or_a_transport() {
    let w = world();
    let read = Request::new(Op::Read, LOCAL + 4096, 1, REMOTE + 4096, 4096);
    let plan = w.plan(&[write(0, 0, 4096), read]).unwrap();
    assert_eq!(plan.routed.len(), 2);
    // Contiguous on both sides, but in two remote buffers.
    let edge = (64 << 10) - 4096;
    let plan = w
        .plan(&[write(0, edge, 4096), write(4096, edge + 4096, 4096)])
        .unwrap();
    assert_eq!(plan.routed.len(), 2);
    assert_ne!(plan.routed[0].remote_key, plan.routed[1].remote_key);
    let mut by_tcp = write(4096, 4096, 4096);
    by_tcp.transport = Some("tcp".into());
    let plan = w.plan(&[write(0, 0, 4096), by_tcp]).unwrap();
    assert_eq!(
        shape(&plan),
        vec![(0, 1, 0, 4096, 1), (1, 1, 4096, 4096, 0)]
    );
}

#[test]
fn zero_length_requests_move_nothing_and_check_nothing() {
    let w = world();
    let mut nowhere = write(0, 0, 0);
    nowhere.segment = 7;
    nowhere.local_addr = 1;
    let plan = w
        .plan(&[write(0, 0, 0), write(0, 0, 4096), nowhere])
        .unwrap();
    assert_eq!(plan.empty, vec![0, 2]);
    assert_eq!(shape(&plan), vec![(1, 1, 0, 4096, 1)]);
}

#[test]
fn unregistered_local_memory_goes_to_a_transport_that_needs_no_registration() {
    let w = world();
    // shm ranks first between same-host peers, but needs registration
    // in this table: tcp takes it.
    let r = Request::new(Op::Write, 0x8000, 1, REMOTE, 4096);
    let plan = w.plan(&[r]).unwrap();
    assert_eq!(plan.routed.len(), 1);
    assert_eq!(plan.routed[0].transport, 0);
    // Straddling the end of a registered buffer is still an error.
    let e = w.plan(&[write((1 << 20) - 4096, 0, 8192)]).err().unwrap();
    assert!(e.message.contains("runs past its end"), "{}", e.message);
    // Only tcp's "registration" stands for it: with tcp asked to
    // decline, selection says shm needs the memory registered.
    let mut w = world();
    w.peers.declined = vec![0];
    let e = w.plan(&[r_at(0x8000)]).err().unwrap();
    assert!(
        e.message.contains("shm needs local memory registered"),
        "{}",
        e.message
    );
}

/// Host memory registered nowhere; `transports` take it as it is.
fn unregistered_host_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
    Arc::new(LocalBuffer {
        addr,
        len,
        location: crate::location::Location::Cpu(0),
        mem_kind: HOST,
        device: None,
        visibility: Visibility::Unregistered,
        registrations: transports
            .iter()
            .map(|&transport| crate::memory::TransportRegistration {
                transport,
                handle: 0,
                key: Vec::new(),
                mem_kind: HOST,
            })
            .collect(),
        inflight: Default::default(),
    })
}

fn r_at(addr: u64) -> Request {
    Request::new(Op::Write, addr, 1, REMOTE, 4096)
}

#[test]
fn one_bad_request_fails_the_whole_plan() {
    let w = world();
    let e = w.plan(&[write((1 << 20) - 4096, 0, 8192)]).err().unwrap();
    assert_eq!(e.code, ErrorCode::OutOfBounds);
    assert!(
        e.message.starts_with("request 0: local range"),
        "{}",
        e.message
    );
    let mut elsewhere = write(0, 0, 4096);
    elsewhere.segment = 7;
    assert_eq!(
        w.plan(&[elsewhere]).err().unwrap().code,
        ErrorCode::NotFound
    );
    let mut by_rdma = write(0, 0, 4096);
    by_rdma.transport = Some("rdma".into());
    let e = w.plan(&[by_rdma]).err().unwrap();
    assert_eq!(e.code, ErrorCode::Unsupported);
    assert!(
        e.message.starts_with("request 0: transport rdma"),
        "{}",
        e.message
    );
}

#[test]
fn a_range_outside_the_peers_buffers_is_looked_up_again_once() {
    let w = world();
    let beyond = write(0, 128 << 10, 4096);
    let e = w.plan(&[beyond.clone(), beyond.clone()]).err().unwrap();
    assert_eq!(e.code, ErrorCode::OutOfBounds);
    assert!(e.message.contains("it has 2 buffers"), "{}", e.message);
    assert_eq!(*w.peers.refreshes.lock(), 1);
    // The peer registered more memory meanwhile.
    let all: &[&str] = &["tcp", "shm"];
    *w.peers.reread.lock() = Some(descriptor("e1", all, &[(REMOTE, 256 << 10, "cpu:0", all)]));
    let plan = w.plan(&[beyond.clone(), write(4096, (128 << 10) + 4096, 4096)]);
    assert_eq!(shape(&plan.unwrap()), vec![(0, 2, 0, 8192, 1)]);
    assert_eq!(*w.peers.refreshes.lock(), 2);
}

#[test]
fn a_segment_whose_connection_failed_is_read_again_first() {
    let w = world();
    let seg = w.segments.get(1).unwrap();
    seg.stale.store(true, Ordering::Relaxed);
    // Unreachable still: the old view serves.
    assert_eq!(w.plan(&[write(0, 0, 4096)]).unwrap().routed.len(), 1);
    assert_eq!(*w.peers.refreshes.lock(), 1);
    assert!(!seg.stale.load(Ordering::Relaxed));
    // Restarted without the buffer: the request fails on the new view,
    // not on the old process's memory.
    seg.stale.store(true, Ordering::Relaxed);
    *w.peers.reread.lock() = Some(descriptor("e2", &["tcp", "shm"], &[]));
    let e = w.plan(&[write(0, 0, 4096)]).err().unwrap();
    assert_eq!(e.code, ErrorCode::OutOfBounds);
    assert_eq!(*w.peers.refreshes.lock(), 2);
}

#[test]
fn device_memory_no_transport_moves_directly_is_staged() {
    let gpu = &["tcp", "shm"];
    let peer = descriptor(
        "e1",
        gpu,
        &[
            (REMOTE, 64 << 10, "cpu:0", gpu),
            (0x100_0000, 1 << 20, "cuda:0", &[]),
        ],
    );
    let w = World::new(
        vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
        peer,
    );
    w.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
    w.memory.insert(device_buffer(0x800_0000, 1 << 20, &[]));
    let plan = w
        .plan(&[
            // Local device memory to a host buffer.
            Request::new(Op::Write, 0x800_0000, 1, REMOTE, 4096),
            // Local host memory to the peer's device memory.
            Request::new(Op::Read, LOCAL, 1, 0x100_0000, 8192),
            // Host to host: routed as usual.
            write(8192, 8192, 4096),
        ])
        .unwrap();
    assert_eq!(shape(&plan), vec![(2, 1, 8192, 4096, 1)]);
    let staged: Vec<(usize, bool, u64)> = plan
        .staged
        .iter()
        .map(|(i, it)| (*i, it.ends.remote_on_device, it.length))
        .collect();
    assert_eq!(staged, vec![(0, false, 4096), (1, true, 8192)]);
}

#[test]
fn a_run_of_requests_between_the_same_buffers_is_routed_once() {
    let w = world();
    let run: Vec<Request> = (0..8).map(|k| write(k * 8192, k * 8192, 4096)).collect();
    let plan = w.plan(&run).unwrap();
    assert_eq!(plan.routed.len(), 8);
    // One selection (one question to the peer), and one more to put the
    // first use of the route into words for the log.
    assert_eq!(*w.peers.asked.lock(), 2);
    // Later submissions of the same kind reuse it (one use each) until
    // its uses run out; then selection runs again.
    for _ in 0..super::super::route_memo::REUSES {
        w.plan(&run).unwrap();
    }
    assert_eq!(*w.peers.asked.lock(), 2);
    w.plan(&run).unwrap();
    assert_eq!(*w.peers.asked.lock(), 3);
    // Another length is another kind; a large request is selected
    // every time.
    w.plan(&[write(0, 0, 2048)]).unwrap();
    assert_eq!(*w.peers.asked.lock(), 4);
    let both: &[&str] = &["tcp", "shm"];
    let big = World::new(
        vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
        descriptor("e1", both, &[(REMOTE, 1 << 20, "cpu:0", both)]),
    );
    big.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
    let large = [Request::new(Op::Write, LOCAL, 1, REMOTE, 256 << 10)];
    big.plan(&large).unwrap();
    let first = *big.peers.asked.lock();
    for n in 1..=3 {
        big.plan(&large).unwrap();
        assert_eq!(*big.peers.asked.lock(), first + n);
    }
}

#[test]
fn a_declined_transport_is_passed_over() {
    let mut w = world();
    w.peers.declined = vec![1];
    let plan = w.plan(&[write(0, 0, 4096)]).unwrap();
    assert_eq!(shape(&plan), vec![(0, 1, 0, 4096, 0)]);
    assert_eq!(&plan.routed[0].remote_key[..], b"tcp@0x1000");
}

#[test]
fn staging_slots_replace_the_peers_buffers() {
    let w = world();
    let slots = Arc::new(RemoteView::new(descriptor(
        "e1",
        &["tcp", "shm"],
        &[(0x5000_0000, 1 << 20, "cpu:0", &["tcp"])],
    )));
    let leg = Request::new(Op::Write, LOCAL, 1, 0x5000_0000, 4096);
    let plan = w.planner().plan(&[leg], Some(&slots)).unwrap();
    assert_eq!(shape(&plan), vec![(0, 1, 0, 4096, 0)]);
    assert_eq!(&plan.routed[0].remote_key[..], b"tcp@0x50000000");
    // Outside the slots: no second look at the peer's descriptor.
    let e = w
        .planner()
        .plan(&[write(0, 0, 4096)], Some(&slots))
        .err()
        .unwrap();
    assert_eq!(e.code, ErrorCode::OutOfBounds);
    assert_eq!(*w.peers.refreshes.lock(), 0);
}
