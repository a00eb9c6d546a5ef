//! The thinnest layer over verbs: everything that touches sideway (and so
//! libibverbs) lives here, with every `unsafe` block argued.
//!
//! sideway has panicking paths: `From<u32>` conversions of enums a newer
//! driver may extend (port speed, MTU, GID type) and `assert_eq!` in the
//! `Drop` of queue pairs and completion queues. This module never calls the
//! conversions (it reads the raw attribute structs) and keeps every object
//! whose `Drop` may assert inside [`Quiet`], which contains such a panic
//! instead of letting it unwind (or abort, during another unwind).

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionErrorKind};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use std::io;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Holds a verbs object whose `Drop` may panic (sideway asserts that the
/// destroy call returned 0) and contains that panic: the object is then
/// leaked, which is all a failed destroy can mean anyway.
pub struct Quiet<T>(ManuallyDrop<T>);

impl<T> Quiet<T> {
    pub fn new(value: T) -> Quiet<T> {
        Quiet(ManuallyDrop::new(value))
    }
}

impl<T> std::ops::Deref for Quiet<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Quiet<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T> Drop for Quiet<T> {
    fn drop(&mut self) {
        let inner = &mut self.0;
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the value is dropped exactly once, here, and never
            // touched again (self is being dropped).
            unsafe { ManuallyDrop::drop(inner) }
        }));
    }
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    InfiniBand,
    Ethernet,
}

impl Link {
    pub fn as_str(self) -> &'static str {
        match self {
            Link::InfiniBand => "InfiniBand",
            Link::Ethernet => "RoCE",
        }
    }
}

// Raw values from <infiniband/verbs.h>, read instead of sideway's
// panicking conversions.
const PORT_ACTIVE: u32 = 4;
const LINK_LAYER_ETHERNET: u8 = 2;

/// What `ibv_get_device_list` said.
pub enum ListError {
    /// ENOSYS: rdma-core found no kernel RDMA support (no ib_uverbs).
    NoKernelSupport,
    Other(io::Error),
}

/// The names of the RDMA devices libibverbs lists.
pub fn device_names() -> Result<Vec<String>, ListError> {
    let list = DeviceList::new().map_err(|e| {
        let io = io_of_list(&e);
        if io.raw_os_error() == Some(libc::ENOSYS) {
            ListError::NoKernelSupport
        } else {
            ListError::Other(io)
        }
    })?;
    Ok(list.iter().map(|d| d.name()).collect())
}

fn io_of_list(e: &sideway::ibverbs::device::GetDeviceListError) -> io::Error {
    use sideway::ibverbs::device::GetDeviceListErrorKind;
    match &e.0 {
        GetDeviceListErrorKind::Ibverbs(io) => {
            io::Error::from_raw_os_error(io.raw_os_error().unwrap_or(libc::EIO))
        }
        #[allow(unreachable_patterns)]
        _ => io::Error::other(e.to_string()),
    }
}

/// Opens a device by name.
pub fn open(name: &str) -> Result<Arc<DeviceContext>, String> {
    let list =
        DeviceList::new().map_err(|e| format!("listing RDMA devices: {}", io_of_list(&e)))?;
    let device = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| format!("no RDMA device {name}"))?;
    device
        .open()
        .map_err(|e| format!("cannot open {name}: {}", describe_error(&e)))
}

fn describe_error(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// One port as verbs describes it.
#[derive(Clone, Debug)]
pub struct PortFacts {
    pub num: u8,
    pub active: bool,
    pub state: u32,
    pub link: Link,
    pub lid: u16,
    /// `ibv_mtu` value (1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    pub speed_gbps: f64,
    /// (index, GID, RoCE v2) of every non-zero GID.
    pub gids: Vec<(u8, Gid, bool)>,
}

/// A device's facts, read without side effects.
#[derive(Clone, Debug)]
pub struct DeviceFacts {
    pub name: String,
    pub guid: u64,
    pub ports: Vec<PortFacts>,
    pub max_rd_atomic: u8,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
}

fn speed_gbps(speed: u8, width: u8) -> f64 {
    let lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => 0.0,
    };
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => 0.0,
    };
    lane * lanes
}

/// Reads a device's ports and GIDs (at most 256 per port).
pub fn facts(ctx: &Arc<DeviceContext>, name: &str) -> Result<DeviceFacts, String> {
    let dev = ctx
        .query_device()
        .map_err(|e| format!("{name}: ibv_query_device: {}", describe_error(&e)))?;
    let raw = &dev.attr.orig_attr;
    let mut ports = Vec::new();
    for num in 1..=raw.phys_port_cnt {
        let p = ctx
            .query_port(num)
            .map_err(|e| format!("{name}: ibv_query_port({num}): {}", describe_error(&e)))?;
        let a = &p.attr;
        let link = if a.link_layer == LINK_LAYER_ETHERNET {
            Link::Ethernet
        } else {
            Link::InfiniBand
        };
        let mut gids = Vec::new();
        let table = u32::try_from(a.gid_tbl_len).unwrap_or(0).min(256);
        for index in 0..table {
            let Ok(gid) = ctx.query_gid(num, index) else {
                continue;
            };
            if gid.raw == [0u8; 16] {
                continue;
            }
            let v2 = ctx
                .query_gid_type(num, index)
                .map(|t| t == 1)
                .unwrap_or(false);
            gids.push((index as u8, gid, v2));
        }
        ports.push(PortFacts {
            num,
            active: a.state == PORT_ACTIVE,
            state: a.state,
            link,
            lid: a.lid,
            active_mtu: a.active_mtu,
            speed_gbps: speed_gbps(a.active_speed, a.active_width),
            gids,
        });
    }
    Ok(DeviceFacts {
        name: name.to_string(),
        guid: dev.attr.orig_attr.node_guid,
        ports,
        max_rd_atomic: u8::try_from(raw.max_qp_rd_atom.clamp(1, 16)).unwrap_or(1),
        max_qp_wr: u32::try_from(raw.max_qp_wr.max(1)).unwrap_or(1),
        max_cqe: u32::try_from(raw.max_cqe.max(1)).unwrap_or(1),
    })
}

/// Whether a port is active now.
pub fn port_active(ctx: &DeviceContext, port: u8) -> Option<bool> {
    ctx.query_port(port)
        .ok()
        .map(|p| p.attr.state == PORT_ACTIVE)
}

pub fn port_state_name(state: u32) -> &'static str {
    match state {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "UNKNOWN",
    }
}

/// The DMA-BUF probe (docs/gpu.md): `ibv_reg_dmabuf_mr` with fd -1
/// answers EBADF where the NIC and kernel take DMA-BUF.
pub fn dmabuf_probe(pd: &Arc<ProtectionDomain>) -> Result<(), String> {
    // SAFETY: fd -1 names no memory; the call can only fail, and a
    // registration it might return anyway is dropped (deregistered) at once.
    let r = unsafe { pd.reg_dmabuf_mr(0, 4096, 0, -1, AccessFlags::LocalWrite) };
    match r {
        Ok(_) => Ok(()),
        Err(e) => match &e.0 {
            RegisterMemoryRegionErrorKind::Ibverbs(io) => match io.raw_os_error() {
                Some(libc::EBADF) => Ok(()),
                Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT) => Err(format!(
                    "the NIC or its kernel driver does not take DMA-BUF (ibv_reg_dmabuf_mr: {io})"
                )),
                _ => Err(format!("the DMA-BUF probe failed unexpectedly: {io}")),
            },
            other => Err(format!("the DMA-BUF probe failed unexpectedly: {other}")),
        },
    }
}

/// A registered memory region.
pub struct Mr(Arc<MemoryRegion>);

impl Mr {
    pub fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.0.rkey()
    }
}

/// Access rights of a registration.
pub fn access(remote: bool) -> AccessFlags {
    if remote {
        AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
    } else {
        AccessFlags::LocalWrite
    }
}

fn reg_error(e: &sideway::ibverbs::memory_region::RegisterMemoryRegionError) -> io::Error {
    match &e.0 {
        RegisterMemoryRegionErrorKind::Ibverbs(io) => {
            io::Error::from_raw_os_error(io.raw_os_error().unwrap_or(libc::EIO))
        }
        other => io::Error::other(other.to_string()),
    }
}

/// Registers `[addr, addr + len)` of this process (host memory, or device
/// memory through nvidia-peermem).
///
/// # Safety
/// The range must stay mapped until the returned region is dropped.
pub unsafe fn reg_mr(
    pd: &Arc<ProtectionDomain>,
    addr: u64,
    len: u64,
    remote: bool,
) -> io::Result<Mr> {
    let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: sideway's reg_mr asks that [addr, +len) be valid and stay accessible while the
    // MR lives. ibv_reg_mr pins the pages for the NIC's DMA (failing, EFAULT, if any is not
    // mapped now), and the `# Safety` section keeps the range mapped until the returned Mr
    // drops, which instance.rs's register_memory ties to the engine's unregister_memory.
    unsafe { pd.reg_mr(addr as usize, len, access(remote)) }
        .map(Mr)
        .map_err(|e| reg_error(&e))
}

/// Registers a DMA-BUF range: WRs address it by `iova`.
///
/// # Safety
/// `fd` must be a DMA-BUF (or a memfd standing in for one) whose buffer
/// covers `[offset, offset + len)` and stays allocated until the returned
/// region is dropped.
pub unsafe fn reg_dmabuf_mr(
    pd: &Arc<ProtectionDomain>,
    offset: u64,
    len: u64,
    iova: u64,
    fd: i32,
    remote: bool,
) -> io::Result<Mr> {
    let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: sideway's reg_dmabuf_mr asks for a real DMA-BUF fd whose buffer stays valid over
    // [offset, +len); the `# Safety` section makes `fd` a DMA-BUF (or memfd) covering exactly
    // that and allocated until the returned Mr drops. `iova` is only the address WRs use, and
    // a provider that refuses it or the access flags fails the call instead.
    unsafe { pd.reg_dmabuf_mr(offset, len, iova, fd, access(remote)) }
        .map(Mr)
        .map_err(|e| reg_error(&e))
}

/// A completion queue, polled by one thread at a time.
pub struct Cq {
    cq: Quiet<Arc<BasicCompletionQueue>>,
    lock: parking_lot::Mutex<()>,
    pub capacity: u32,
}

/// One work completion.
#[derive(Clone, Copy, Debug)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub vendor_err: u32,
}

impl Cq {
    pub fn new(ctx: &Arc<DeviceContext>, entries: u32) -> Result<Cq, String> {
        let mut builder = ctx.create_cq_builder();
        builder.setup_cqe(entries);
        let cq = builder
            .build()
            .map_err(|e| format!("ibv_create_cq({entries}): {}", describe_error(&e)))?;
        Ok(Cq {
            cq: Quiet::new(cq),
            lock: parking_lot::Mutex::new(()),
            capacity: entries,
        })
    }

    /// Appends up to `max` completions to `out`; returns how many. Another
    /// thread already polling makes this return 0 at once (`wait` false).
    pub fn poll(&self, out: &mut Vec<Wc>, max: usize, wait: bool) -> usize {
        let _guard = if wait {
            self.lock.lock()
        } else {
            match self.lock.try_lock() {
                Some(g) => g,
                None => return 0,
            }
        };
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return 0,
            Err(_) => return 0,
        };
        let before = out.len();
        for wc in poller.take(max) {
            out.push(Wc {
                wr_id: wc.wr_id(),
                status: wc.status(),
                vendor_err: wc.vendor_err(),
            });
        }
        out.len() - before
    }
}

/// The address of the other end of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpAddress {
    pub qpn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// `ibv_mtu` value, 1..=5.
    pub mtu: u32,
}

/// What a local port needs to connect a queue pair.
#[derive(Clone, Copy, Debug)]
pub struct PortInfo {
    pub port: u8,
    pub link: Link,
    pub gid_index: u8,
    pub mtu: u32,
    pub max_rd_atomic: u8,
}

fn mtu_of(v: u32) -> Mtu {
    match v {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// Operations a queue pair carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    Write,
    Read,
}

/// An RC queue pair.
pub struct Qp {
    qp: Quiet<BasicQueuePair>,
    pub qpn: u32,
}

impl Qp {
    /// Creates an RC queue pair on `pd` and moves it to INIT with rights
    /// for peers to write and read registered memory (the MRs still decide).
    pub fn create(
        pd: &Arc<ProtectionDomain>,
        cq: &Cq,
        port: &PortInfo,
        depth: u32,
    ) -> Result<Qp, String> {
        let mut builder = pd.create_qp_builder();
        builder
            .setup_max_send_wr(depth)
            .setup_max_send_sge(1)
            .setup_max_recv_wr(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .setup_send_cq(Arc::clone(&cq.cq))
            .setup_recv_cq(Arc::clone(&cq.cq));
        let qp = builder
            .build()
            .map_err(|e| format!("ibv_create_qp: {}", describe_error(&e)))?;
        let mut qp = Quiet::new(qp);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&attr)
            .map_err(|e| format!("queue pair to INIT: {}", describe_error(&e)))?;
        let qpn = qp.qp_number();
        Ok(Qp { qp, qpn })
    }

    /// RTR then RTS toward `remote`: by LID on InfiniBand, by GID (GRH) on
    /// RoCE or when the remote has no LID.
    pub fn connect(&mut self, port: &PortInfo, remote: &QpAddress) -> Result<(), String> {
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(port.port)
            .setup_service_level(0);
        if port.link == Link::Ethernet || remote.lid == 0 {
            ah.setup_grh(&Gid { raw: remote.gid }, 0, port.gid_index, 64, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_of(remote.mtu.min(port.mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(0)
            .setup_max_dest_read_atomic(port.max_rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| format!("queue pair to RTR: {}", describe_error(&e)))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(0)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(port.max_rd_atomic);
        self.qp
            .modify(&attr)
            .map_err(|e| format!("queue pair to RTS: {}", describe_error(&e)))
    }

    /// Moves the queue pair to ERR: everything posted completes (flushed),
    /// and no more DMA happens through it.
    pub fn set_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        let _ = self.qp.modify(&attr);
    }

    /// Posts one signaled RDMA WRITE or READ.
    ///
    /// # Safety
    /// `[local_addr, +len)` must lie inside the registration `lkey` names,
    /// which must stay registered until the completion is polled.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post(
        &mut self,
        wr_id: u64,
        op: RdmaOp,
        local_addr: u64,
        lkey: u32,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> io::Result<()> {
        let mut guard = self.qp.start_post_send();
        let wr = guard.construct_wr(wr_id, WorkRequestFlags::Signaled);
        let handle = match op {
            RdmaOp::Write => wr.setup_write(rkey, remote_addr),
            RdmaOp::Read => wr.setup_read(rkey, remote_addr),
        };
        // SAFETY: setup_sge leaves the buffer's lifetime to us: the NIC reads or writes
        // [local_addr, +len) until the completion, and the `# Safety` section puts that range
        // inside the registration `lkey` names, kept registered until the completion is
        // polled (datapath.rs holds the region in `inflight` until then).
        unsafe { handle.setup_sge(lkey, local_addr, len) };
        guard.post().map_err(|e| {
            use sideway::ibverbs::queue_pair::PostSendError as E;
            let io = match &e {
                E::Ibverbs(io)
                | E::InvalidWorkRequest(io)
                | E::InvalidQueuePair(io)
                | E::NotEnoughResources(io) => io,
                #[allow(unreachable_patterns)]
                _ => return io::Error::other(e.to_string()),
            };
            io::Error::from_raw_os_error(io.raw_os_error().unwrap_or(libc::EIO))
        })
    }
}

/// An opened device: its context, one protection domain and one
/// completion queue shared by all of this instance's queue pairs on it.
pub struct Device {
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    pub cq: Cq,
}

impl Device {
    pub fn open(name: &str, cq_entries: u32) -> Result<(Device, DeviceFacts), String> {
        let ctx = open(name)?;
        let facts = facts(&ctx, name)?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| format!("{name}: ibv_alloc_pd: {}", describe_error(&e)))?;
        let cq =
            Cq::new(&ctx, cq_entries.min(facts.max_cqe)).map_err(|e| format!("{name}: {e}"))?;
        Ok((Device { ctx, pd, cq }, facts))
    }
}

/// `ibv_wc_status` names, for messages.
pub fn wc_status_name(status: u32) -> &'static str {
    match status {
        0 => "IBV_WC_SUCCESS",
        1 => "IBV_WC_LOC_LEN_ERR",
        2 => "IBV_WC_LOC_QP_OP_ERR",
        3 => "IBV_WC_LOC_EEC_OP_ERR",
        4 => "IBV_WC_LOC_PROT_ERR",
        5 => "IBV_WC_WR_FLUSH_ERR",
        6 => "IBV_WC_MW_BIND_ERR",
        7 => "IBV_WC_BAD_RESP_ERR",
        8 => "IBV_WC_LOC_ACCESS_ERR",
        9 => "IBV_WC_REM_INV_REQ_ERR",
        10 => "IBV_WC_REM_ACCESS_ERR",
        11 => "IBV_WC_REM_OP_ERR",
        12 => "IBV_WC_RETRY_EXC_ERR",
        13 => "IBV_WC_RNR_RETRY_EXC_ERR",
        14 => "IBV_WC_LOC_RDD_VIOL_ERR",
        15 => "IBV_WC_REM_INV_RD_REQ_ERR",
        16 => "IBV_WC_REM_ABORT_ERR",
        17 => "IBV_WC_INV_EECN_ERR",
        18 => "IBV_WC_INV_EEC_STATE_ERR",
        19 => "IBV_WC_FATAL_ERR",
        20 => "IBV_WC_RESP_TIMEOUT_ERR",
        21 => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_(unknown)",
    }
}

pub const WC_SUCCESS: u32 = 0;
pub const WC_LOC_LEN_ERR: u32 = 1;
pub const WC_LOC_QP_OP_ERR: u32 = 2;
pub const WC_LOC_PROT_ERR: u32 = 4;
pub const WC_WR_FLUSH_ERR: u32 = 5;
pub const WC_LOC_ACCESS_ERR: u32 = 8;
pub const WC_REM_INV_REQ_ERR: u32 = 9;
pub const WC_REM_ACCESS_ERR: u32 = 10;
pub const WC_REM_OP_ERR: u32 = 11;

/// "no RDMA device" in operator words, from what libibverbs said.
pub fn no_device_reason(e: &ListError) -> String {
    match e {
        ListError::NoKernelSupport => "libibverbs loads, but there is no RDMA device: the \
             kernel offers no RDMA support here (ibv_get_device_list: ENOSYS; no ib_uverbs \
             module, or no RDMA NIC)"
            .to_string(),
        ListError::Other(io) => {
            format!("libibverbs loads, but listing RDMA devices failed: {io}")
        }
    }
}
