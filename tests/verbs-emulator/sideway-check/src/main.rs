//! Drives the verbs emulator through sideway, the crate Ferry's RDMA plugin
//! will use: sideway -> rdma-mummy-sys (static "mummy" rdma-core) ->
//! dlopen("libibverbs.so.1") -> the emulator, found by LD_LIBRARY_PATH.
//!
//! `sideway-check` runs, for each API generation (ibv_post_send +
//! ibv_poll_cq, then ibv_qp_ex + ibv_cq_ex), against a target process it
//! spawns (`sideway-check target <device>`): connect two RC QPs, RDMA WRITE
//! and READ verified by checksum, a bad rkey (REM_ACCESS_ERR, target memory
//! unchanged), a wrong transition, the DMA-BUF probe, and the target's death.
//! `sideway-check list` prints what sideway sees (used against the real
//! libibverbs too). Exits non-zero on the first failure.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    GenericCompletionQueue, PollCompletionQueueError, WorkCompletionOperationType,
    WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionErrorKind};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, ModifyQueuePairErrorKind, PostSendGuard, QueuePair, QueuePairAttribute,
    QueuePairAttributeMask, QueuePairState, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

type Res<T> = Result<T, String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!("{}:{}: {}", file!(), line!(), format!($($fmt)*)));
        }
    };
}

const TARGET_LEN: usize = 1 << 20;

fn fnv(data: &[u8]) -> u64 {
    data.iter()
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100000001b3))
}

fn fill(data: &mut [u8], seed: u32) {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
}

/// Everything one side needs to reach the other.
struct Endpoint {
    qpn: u32,
    lid: u16,
    gid: Gid,
    addr: u64,
    rkey: u32,
}

impl Endpoint {
    fn line(&self) -> String {
        let gid: String = self.gid.raw.iter().map(|b| format!("{b:02x}")).collect();
        format!("{} {} {} {} {}", self.qpn, self.lid, gid, self.addr, self.rkey)
    }

    fn parse(line: &str) -> Res<Self> {
        let f: Vec<&str> = line.split_whitespace().collect();
        ensure!(f.len() == 5, "bad endpoint line {line:?}");
        let mut gid = Gid::default();
        for (i, b) in gid.raw.iter_mut().enumerate() {
            *b = u8::from_str_radix(&f[2][2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        let n = |s: &str| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
        Ok(Endpoint {
            qpn: n(f[0])? as u32,
            lid: n(f[1])? as u16,
            gid,
            addr: n(f[3])?,
            rkey: n(f[4])? as u32,
        })
    }
}

/// One side's verbs objects. Field order is drop order: the QP before its
/// CQ, the MR before the buffer it covers. (The PD holds the context.)
struct Side {
    qp: GenericQueuePair,
    cq: GenericCompletionQueue,
    mr: Arc<MemoryRegion>,
    pd: Arc<ProtectionDomain>,
    buf: Vec<u8>,
    lid: u16,
    gid: Gid,
}

fn open(name: &str) -> Res<Arc<DeviceContext>> {
    let list = DeviceList::new().map_err(|e| format!("DeviceList::new: {e:?}"))?;
    let device = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| format!("no device {name}"))?;
    device.open().map_err(|e| format!("open {name}: {e:?}"))
}

fn side(name: &str, len: usize, extended: bool) -> Res<Side> {
    let ctx = open(name)?;
    let port = ctx.query_port(1).map_err(|e| format!("query_port: {e:?}"))?;
    let gid = ctx.query_gid(1, 0).map_err(|e| format!("query_gid: {e:?}"))?;
    let pd = ctx.alloc_pd().map_err(|e| format!("alloc_pd: {e:?}"))?;
    let mut buf = vec![0u8; len];
    let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
    // SAFETY: buf's heap block does not move when buf moves into Side, and
    // Side drops mr before buf, so the registration never outlives the memory.
    let mr = unsafe { pd.reg_mr(buf.as_mut_ptr() as usize, len, access) }
        .map_err(|e| format!("reg_mr: {e:?}"))?;
    let mut cq_builder = ctx.create_cq_builder();
    cq_builder.setup_cqe(64);
    let cq: GenericCompletionQueue = if extended {
        cq_builder.build_ex().map_err(|e| format!("create_cq_ex: {e:?}"))?.into()
    } else {
        cq_builder.build().map_err(|e| format!("create_cq: {e:?}"))?.into()
    };
    let mut qp_builder = pd.create_qp_builder();
    qp_builder
        .setup_max_send_wr(32)
        .setup_max_send_sge(2)
        .setup_send_cq(cq.clone())
        .setup_recv_cq(cq.clone());
    let mut qp: GenericQueuePair = if extended {
        qp_builder.build_ex().map_err(|e| format!("create_qp_ex: {e:?}"))?.into()
    } else {
        qp_builder.build().map_err(|e| format!("create_qp: {e:?}"))?.into()
    };
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(1)
        .setup_access_flags(access);
    qp.modify(&attr).map_err(|e| format!("INIT: {e:?}"))?;
    Ok(Side { qp, cq, mr, pd, buf, lid: port.lid(), gid })
}

impl Side {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            qpn: self.qp.qp_number(),
            lid: self.lid,
            gid: self.gid,
            addr: self.buf.as_ptr() as u64,
            rkey: self.mr.rkey(),
        }
    }

    /// RTR then RTS towards `peer`, addressed by GID (GRH) or by LID.
    fn connect(&mut self, peer: &Endpoint, by_gid: bool) -> Res<()> {
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid).setup_port(1).setup_service_level(0);
        if by_gid {
            ah.setup_grh(&peer.gid, 0, 0, 1, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu4096)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(0)
            .setup_max_dest_read_atomic(16)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp.modify(&attr).map_err(|e| format!("RTR: {e:?}"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(0)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(16);
        self.qp.modify(&attr).map_err(|e| format!("RTS: {e:?}"))
    }

    /// Posts one signaled WRITE or READ and returns (status, opcode, wr_id).
    fn rdma(&mut self, write: bool, off: usize, len: u32, raddr: u64, rkey: u32) -> Res<(u32, u32)> {
        let wr_id = 0x5eed_0000 + u64::from(len);
        let laddr = self.buf.as_ptr() as u64 + off as u64;
        let lkey = self.mr.lkey();
        let mut guard = self.qp.start_post_send();
        let wr = guard.construct_wr(wr_id, WorkRequestFlags::Signaled);
        let handle = if write { wr.setup_write(rkey, raddr) } else { wr.setup_read(rkey, raddr) };
        // SAFETY: [laddr, laddr+len) lies in self.buf, registered as self.mr.
        unsafe { handle.setup_sge(lkey, laddr, len) };
        guard.post().map_err(|e| format!("post: {e:?}"))?;

        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.cq.start_poll() {
                Ok(mut poller) => {
                    let wc = poller.next().ok_or("empty poller")?;
                    ensure!(wc.wr_id() == wr_id, "wr_id {} != {}", wc.wr_id(), wr_id);
                    return Ok((wc.status(), wc.opcode()));
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
                Err(e) => return Err(format!("poll: {e:?}")),
            }
            ensure!(Instant::now() < deadline, "no completion within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn hw_state(&self) -> Res<QueuePairState> {
        let (attr, _) = self
            .qp
            .query(QueuePairAttributeMask::State)
            .map_err(|e| format!("query_qp: {e:?}"))?;
        Ok(attr.state())
    }
}

// ---- target process -------------------------------------------------------

fn target(device: &str) -> Res<()> {
    let mut me = side(device, TARGET_LEN, false)?;
    fill(&mut me.buf, 1);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    writeln!(out, "{}", me.endpoint().line()).map_err(|e| e.to_string())?;
    let mut lines = stdin.lock().lines();
    let peer = Endpoint::parse(&lines.next().ok_or("no peer")?.map_err(|e| e.to_string())?)?;
    me.connect(&peer, true)?;
    writeln!(out, "ready").map_err(|e| e.to_string())?;
    for line in lines {
        let line = line.map_err(|e| e.to_string())?;
        let f: Vec<&str> = line.split_whitespace().collect();
        let reply = match f.as_slice() {
            ["csum", off, len] => {
                let off: usize = off.parse().map_err(|_| "off")?;
                let len: usize = len.parse().map_err(|_| "len")?;
                fnv(&me.buf[off..off + len]).to_string()
            }
            ["fill", seed] => {
                fill(&mut me.buf, seed.parse().map_err(|_| "seed")?);
                "ok".into()
            }
            ["state"] => format!("{:?}", me.hw_state()?),
            ["quit"] => return Ok(()),
            _ => return Err(format!("bad command {line:?}")),
        };
        writeln!(out, "{reply}").map_err(|e| e.to_string())?;
    }
    Ok(())
}

// ---- initiator -------------------------------------------------------------

struct Target {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Target {
    fn spawn(device: &str) -> Res<Self> {
        let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .args(["target", device])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn target: {e}"))?;
        let to = child.stdin.take().ok_or("stdin")?;
        let from = BufReader::new(child.stdout.take().ok_or("stdout")?);
        Ok(Target { child, to, from })
    }

    fn ask(&mut self, line: &str) -> Res<String> {
        writeln!(self.to, "{line}").map_err(|e| e.to_string())?;
        self.read()
    }

    fn read(&mut self) -> Res<String> {
        let mut s = String::new();
        self.from.read_line(&mut s).map_err(|e| e.to_string())?;
        ensure!(!s.is_empty(), "target closed its pipe");
        Ok(s.trim().to_string())
    }

    fn csum(&mut self, off: usize, len: usize) -> Res<u64> {
        self.ask(&format!("csum {off} {len}"))?.parse().map_err(|e| format!("csum: {e}"))
    }
}

const SUCCESS: u32 = WorkCompletionStatus::Success as u32;

fn run_generation(extended: bool) -> Res<()> {
    let label = if extended { "ibv_qp_ex + ibv_cq_ex" } else { "ibv_post_send + ibv_poll_cq" };
    let mut t = Target::spawn("mlx5_0")?;
    let remote = Endpoint::parse(&t.read()?)?;
    let mut me = side("mlx5_3", 2 << 20, extended)?;
    writeln!(t.to, "{}", me.endpoint().line()).map_err(|e| e.to_string())?;
    me.connect(&remote, !extended)?; // GRH for one generation, LID for the other
    ensure!(t.read()? == "ready", "target not ready");

    for (i, &(len, off)) in [(1u32, 0usize), (4096, 4095), (65539, 70000), (TARGET_LEN as u32, 0)]
        .iter()
        .enumerate()
    {
        fill(&mut me.buf[..len as usize], 20 + i as u32);
        let (status, opcode) = me.rdma(true, 0, len, remote.addr + off as u64, remote.rkey)?;
        ensure!(status == SUCCESS, "WRITE {len}: status {status}");
        ensure!(opcode == WorkCompletionOperationType::Write as u32, "WRITE opcode {opcode}");
        ensure!(t.csum(off, len as usize)? == fnv(&me.buf[..len as usize]), "WRITE {len} data");
    }
    t.ask("fill 99")?;
    for &(len, off) in &[(1u32, 5usize), (8192, 12345), (TARGET_LEN as u32, 0)] {
        let want = t.csum(off, len as usize)?;
        me.buf[4096..4096 + len as usize].fill(0);
        let (status, opcode) = me.rdma(false, 4096, len, remote.addr + off as u64, remote.rkey)?;
        ensure!(status == SUCCESS, "READ {len}: status {status}");
        ensure!(opcode == WorkCompletionOperationType::Read as u32, "READ opcode {opcode}");
        ensure!(fnv(&me.buf[4096..4096 + len as usize]) == want, "READ {len} data");
    }
    println!("[{label}] RDMA WRITE and READ, 1 B .. 1 MiB, verified by checksum");

    let before = t.csum(0, TARGET_LEN)?;
    let (status, _) = me.rdma(true, 0, 4096, remote.addr, remote.rkey ^ 0x0101_0101)?;
    ensure!(
        status == WorkCompletionStatus::RemoteAccessError as u32,
        "bad rkey: status {status}"
    );
    ensure!(t.csum(0, TARGET_LEN)? == before, "bad rkey: target memory changed");
    ensure!(me.hw_state()? == QueuePairState::Error, "requester QP not in ERR");
    ensure!(t.ask("state")? == "Error", "responder QP not in ERR");
    println!("[{label}] bad rkey -> IBV_WC_REM_ACCESS_ERR, target unchanged, both QPs in ERR");

    // A wrong transition on a fresh QP: sideway reports it as InvalidTransition.
    let mut fresh = side("mlx5_3", 4096, extended)?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToSend);
    match fresh.qp.modify(&attr) {
        Err(e) => match e.0 {
            ModifyQueuePairErrorKind::InvalidTransition { .. } => {}
            other => return Err(format!("INIT -> RTS gave {other:?}")),
        },
        Ok(()) => return Err("INIT -> RTS succeeded".into()),
    }
    println!("[{label}] INIT -> RTS -> EINVAL (sideway: InvalidTransition)");

    // The DMA-BUF probe Ferry makes: fd -1 answers EBADF where supported.
    // SAFETY: fd -1 never names memory; the call must fail.
    match unsafe { fresh.pd.reg_dmabuf_mr(0, 4096, 0, -1, AccessFlags::LocalWrite) } {
        Err(e) => match &e.0 {
            RegisterMemoryRegionErrorKind::Ibverbs(io) if io.raw_os_error() == Some(libc::EBADF) => {}
            other => return Err(format!("dmabuf probe: {other:?}")),
        },
        Ok(_) => return Err("dmabuf probe with fd -1 succeeded".into()),
    }
    println!("[{label}] reg_dmabuf_mr(fd=-1) -> EBADF (DMA-BUF supported)");
    drop(fresh);

    // The target dies: a fresh connection to it retries and gives up.
    t.child.kill().map_err(|e| e.to_string())?;
    t.child.wait().map_err(|e| e.to_string())?;
    let mut again = side("mlx5_3", 4096, extended)?;
    again.connect(&remote, true)?;
    let (status, _) = again.rdma(true, 0, 64, remote.addr, remote.rkey)?;
    ensure!(
        status == WorkCompletionStatus::RetryCounterExceededError as u32,
        "dead target: status {status}"
    );
    println!("[{label}] target killed -> IBV_WC_RETRY_EXC_ERR");
    Ok(())
}

fn list() -> Res<()> {
    let devices = DeviceList::new().map_err(|e| format!("DeviceList::new: {e:?}"))?;
    println!("{} RDMA device(s)", devices.len());
    for d in &devices {
        let ctx = d.open().map_err(|e| format!("open: {e:?}"))?;
        let attr = ctx.query_device().map_err(|e| format!("{e:?}"))?;
        let port = ctx.query_port(1).map_err(|e| format!("{e:?}"))?;
        let gids = ctx.query_gid_table().map_err(|e| format!("{e:?}"))?;
        println!(
            "  {} guid {} ports {} fw {} port1 {:?} {:?} lid {} {:?} {:?} gid[0] {}",
            d.name(),
            d.guid(),
            attr.phys_port_cnt(),
            attr.firmware_version(),
            port.port_state(),
            port.link_layer(),
            port.lid(),
            port.active_mtu(),
            port.active_speed(),
            gids.first().map(|g| g.gid().to_string()).unwrap_or_default(),
        );
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1).map(String::as_str) {
        Some("target") => target(args.get(2).map(String::as_str).unwrap_or("mlx5_0")),
        Some("list") => list(),
        None => list().and_then(|()| run_generation(false)).and_then(|()| run_generation(true)),
        Some(other) => Err(format!("unknown mode {other}")),
    };
    if let Err(e) = result {
        eprintln!("sideway-check: FAIL {e}");
        std::process::exit(1);
    }
    if args.len() == 1 {
        println!("sideway-check: all passed");
    }
}
