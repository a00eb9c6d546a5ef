//! Transport plugins in Rust: the safe traits and the trampolines that the
//! export macro puts in the C table.

use super::blocks::BlockList;
use super::boundary::{boundary, catch, to_cstring_lossy, PluginError, PluginResult};
use super::host::{Host, ProbeReport};
use super::layouts::LayoutList;
use super::op::Op;
use crate::status::ErrorCode;
use crate::sys;
use crate::versioned::read_plain;
use std::ffi::{c_char, c_void, CStr};

/// A transport plugin written in Rust.
pub trait TransportPlugin: 'static {
    /// Lower case `[a-z0-9-]`; the file must be `libferry_transport_<NAME>.so`.
    const NAME: &'static CStr;
    const VERSION: &'static CStr;
    const DESCRIPTION: &'static CStr;
    /// `FERRY_TRANSPORT_*` facts about the data path (ABI 1.3), e.g.
    /// [`sys::FERRY_TRANSPORT_LOCAL_UNREGISTERED`] for a transport whose
    /// submit reads and writes local memory it never registered.
    const FLAGS: u64 = 0;
    /// Whether the instance moves block lists itself
    /// ([`TransportInstance::submit_blocks`], ABI 1.4): the table then
    /// carries `submit_blocks`, else the engine sends single requests.
    const BLOCK_LISTS: bool = false;
    /// Whether the instance moves blocks by layout and index itself
    /// ([`TransportInstance::submit_layouts`], ABI 1.5): the table then
    /// carries `submit_layouts`, else the engine builds a block list.
    const LAYOUT_LISTS: bool = false;

    /// One instance per engine. Probe-only plugins use [`NoDataPath`].
    type Instance: TransportInstance;

    /// What this plugin could do on this host, without side effects.
    /// Return `Err(PluginError::unavailable(..))` when it cleanly cannot run.
    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()>;

    /// Creates the instance for one engine. `host` stays valid until the
    /// instance is dropped. Probe-only plugins keep the default.
    fn init(
        _host: Host<'static>,
        _params: InitParams,
        _completer: Completer,
    ) -> PluginResult<Self::Instance> {
        Err(PluginError::new(
            ErrorCode::Unsupported,
            "this plugin has no data path",
        ))
    }
}

/// What the engine tells a new instance.
#[derive(Clone, Debug)]
pub struct InitParams {
    pub engine_name: String,
    pub listen_host: String,
}

/// A buffer being registered.
#[derive(Clone, Debug)]
pub struct MemRegion {
    pub addr: u64,
    pub len: u64,
    pub mem_kind: u64,
    pub location: String,
    pub numa_node: Option<u32>,
    pub device_ordinal: Option<u32>,
    pub dmabuf_fd: Option<i32>,
    /// `addr`'s offset inside the DMA-BUF (with `dmabuf_fd`).
    pub dmabuf_offset: u64,
    /// Only a local buffer: peers must not reach it.
    pub local_only: bool,
    /// Host memory the engine allocated: a file (memfd) holding it that
    /// same-host peers may map, owned by the engine (dup it to keep it), and
    /// `addr`'s offset inside it (ABI 1.2).
    pub share_fd: Option<(i32, u64)>,
}

/// The outcome of registering a buffer.
#[derive(Clone, Debug, Default)]
pub struct Registration {
    /// Passed back as `local_mem` and to `unregister_memory`.
    pub handle: u64,
    /// Published to peers in the segment descriptor (rkeys...).
    pub key: Vec<u8>,
}

/// A peer, from its segment descriptor.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub name: String,
    /// One `FERRY_SCOPE_*` bit.
    pub scope: u32,
    pub endpoint: Vec<u8>,
}

/// One transfer, borrowed for the duration of `submit`.
#[derive(Clone, Copy, Debug)]
pub struct TransferRequest<'a> {
    pub op: Op,
    pub local_addr: u64,
    pub local_mem: u64,
    pub remote_addr: u64,
    pub length: u64,
    pub remote_key: &'a [u8],
    pub token: u64,
}

/// Hands results back to the engine; cheap to clone, usable from any thread.
#[derive(Clone, Copy)]
pub struct Completer {
    ctx: usize,
    complete: sys::ferry_complete_fn,
}

// SAFETY: plugin.h requires the engine's completion function to accept calls
// from any thread for as long as the instance lives; ctx is only passed back.
unsafe impl Send for Completer {}
// SAFETY: &Completer only calls the completion function, which plugin.h
// requires to accept concurrent calls; ctx is never dereferenced here.
unsafe impl Sync for Completer {}

impl Completer {
    /// Reports the result of the request that carried `token`.
    pub fn complete(&self, token: u64, result: Result<(), &PluginError>) {
        match result {
            // SAFETY: see the Send/Sync argument; a null message is allowed.
            Ok(()) => unsafe {
                (self.complete)(
                    self.ctx as *mut c_void,
                    token,
                    sys::FERRY_OK,
                    std::ptr::null(),
                )
            },
            Err(e) => {
                let msg = to_cstring_lossy(&e.message);
                // SAFETY: msg is NUL-terminated and outlives the call.
                unsafe {
                    (self.complete)(
                        self.ctx as *mut c_void,
                        token,
                        e.code.as_raw(),
                        msg.as_ptr(),
                    )
                }
            }
        }
    }
}

/// One transport instance: what an engine talks to.
pub trait TransportInstance: Send + Sync + 'static {
    type Peer: Send + Sync + 'static;

    fn endpoint(&self) -> PluginResult<Vec<u8>>;
    fn register_memory(&self, region: &MemRegion) -> PluginResult<Registration>;
    fn unregister_memory(&self, handle: u64) -> PluginResult<()>;
    fn connect(&self, peer: &PeerInfo) -> PluginResult<Self::Peer>;
    /// Fails whatever is in flight to this peer. The default just drops it.
    fn disconnect(&self, peer: Self::Peer) {
        drop(peer)
    }
    /// Accepts every request (each completed exactly once through the
    /// [`Completer`]) or none (the error).
    fn submit(&self, peer: &Self::Peer, requests: &[TransferRequest<'_>]) -> PluginResult<()>;
    /// Accepts a block list, completed once through the [`Completer`]
    /// with `list.token` (set [`TransportPlugin::BLOCK_LISTS`] to be asked).
    /// Every block must be checked against the local registration and the
    /// peer's buffer before anything moves.
    fn submit_blocks(&self, _peer: &Self::Peer, _list: &BlockList<'_>) -> PluginResult<()> {
        Err(PluginError::new(
            ErrorCode::Unsupported,
            "this transport takes no block lists",
        ))
    }
    /// Accepts blocks by layout and index, completed once through the
    /// [`Completer`] with `list.token` (set
    /// [`TransportPlugin::LAYOUT_LISTS`] to be asked). Both layouts'
    /// extents and every index must be checked before anything moves.
    fn submit_layouts(&self, _peer: &Self::Peer, _list: &LayoutList<'_>) -> PluginResult<()> {
        Err(PluginError::new(
            ErrorCode::Unsupported,
            "this transport takes no layout lists",
        ))
    }
    fn describe_peer(&self, _peer: &Self::Peer) -> Option<String> {
        None
    }
    /// Completes, without blocking, what has already arrived; returns how
    /// many requests it completed. Called by threads waiting on a batch.
    fn progress(&self) -> usize {
        0
    }
    /// Allocates host memory this transport shares best; `None` when it
    /// has no such memory (the engine then allocates plainly).
    fn allocate_memory(&self, _len: u64, _numa_node: Option<u32>) -> Option<PluginResult<u64>> {
        None
    }
    /// Whether a peer's buffer with this key can be served; refuse with
    /// `ErrorCode::Unavailable` and the reason (the engine routes elsewhere).
    fn accepts(&self, _peer: &Self::Peer, _remote_key: &[u8]) -> PluginResult<()> {
        Ok(())
    }
    /// Whether requests between the local buffer `local_mem` (a handle from
    /// `register_memory`) and the peer's buffer with this key can be
    /// served. The default asks [`TransportInstance::accepts`].
    fn accepts_pair(
        &self,
        peer: &Self::Peer,
        _local_mem: u64,
        remote_key: &[u8],
    ) -> PluginResult<()> {
        self.accepts(peer, remote_key)
    }
    /// Frees memory from [`TransportInstance::allocate_memory`].
    fn free_memory(&self, _addr: u64) -> PluginResult<()> {
        Err(PluginError::new(
            ErrorCode::NotFound,
            "this transport allocated no memory",
        ))
    }
    /// Answers a message the same-named transport of engine `from` sent
    /// with [`Host::peer_request`]: the reply (at most
    /// [`sys::FERRY_PEER_MSG_MAX`] bytes) or an error for the sender. `from`
    /// is what the sender claims; every byte of `body` is untrusted.
    fn on_peer_request(&self, _from: &str, _body: &[u8]) -> PluginResult<Vec<u8>> {
        Err(PluginError::new(
            ErrorCode::Unsupported,
            "this transport answers no plugin messages",
        ))
    }
}

/// The instance type of a probe-only plugin; export it with
/// `export_transport_plugin!(P, probe_only)` so its table has no data path.
pub enum NoDataPath {}

impl TransportInstance for NoDataPath {
    type Peer = ();
    fn endpoint(&self) -> PluginResult<Vec<u8>> {
        match *self {}
    }
    fn register_memory(&self, _: &MemRegion) -> PluginResult<Registration> {
        match *self {}
    }
    fn unregister_memory(&self, _: u64) -> PluginResult<()> {
        match *self {}
    }
    fn connect(&self, _: &PeerInfo) -> PluginResult<()> {
        match *self {}
    }
    fn submit(&self, _: &(), _: &[TransferRequest<'_>]) -> PluginResult<()> {
        match *self {}
    }
}

fn invalid(what: &str) -> PluginError {
    PluginError::new(ErrorCode::InvalidArgument, format!("{what} is null"))
}

/// # Safety
/// `s` must be null or NUL-terminated and valid for the call.
unsafe fn owned_str(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: `s` is non-null (checked above), so the `# Safety` section makes it
    // NUL-terminated and readable through the NUL for this call; the CStr is copied into
    // a String before we return. Callers pass plugin.h strings: init's engine_name and
    // listen_host, a region's location, a peer's name, on_peer_request's `from`.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// # Safety
/// `ptr` must be null or valid for `len` bytes for the call.
unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: `ptr` is non-null and `len` > 0 (checked above), so the `# Safety` section
    // makes it valid for `len` byte reads for the call (u8: no alignment); the callers
    // (connect, submit, accepts, accepts_pair, on_peer_request trampolines) keep the slice
    // within the host's call, for which plugin.h keeps those (ptr, len) pairs valid.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// Copies `data` into a caller buffer with the "*len is the full length"
/// rule of plugin.h.
///
/// # Safety
/// `buf` must be null or writable for `cap` bytes; `len` null or valid.
unsafe fn copy_out(data: &[u8], buf: *mut u8, cap: usize, len: *mut usize) {
    if !len.is_null() {
        // SAFETY: `len` is non-null (checked just above), and the `# Safety` section's second
        // requirement makes a non-null `len` valid and aligned for one usize write: it is
        // plugin.h's size_t out-pointer (*len, *key_len or *reply_len) of the host's call.
        unsafe { *len = data.len() };
    }
    if !buf.is_null() && data.len() <= cap {
        // SAFETY: buf is writable for cap >= data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len()) };
    }
}

/// # Safety
/// `instance` must be a pointer produced by `init_trampoline::<P>`.
unsafe fn instance<'a, P: TransportPlugin>(instance: *mut c_void) -> PluginResult<&'a P::Instance> {
    // SAFETY: init boxed a P::Instance behind this pointer; it lives until fini.
    unsafe { instance.cast::<P::Instance>().cast_const().as_ref() }
        .ok_or_else(|| invalid("instance"))
}

/// # Safety
/// `peer` is null or what connect returned for this plugin, not yet
/// disconnected.
unsafe fn peer_of<'a, P: TransportPlugin>(peer: *mut c_void) -> PluginResult<&'a PeerOf<P>> {
    // SAFETY: connect boxed a PeerOf<P> behind this pointer; it lives until
    // disconnect.
    unsafe { peer.cast::<PeerOf<P>>().cast_const().as_ref() }.ok_or_else(|| invalid("peer"))
}

/// # Safety
/// Called by the host through the table with the contract of plugin.h.
pub unsafe extern "C" fn transport_probe_trampoline<P: TransportPlugin>(
    host: *const sys::ferry_host_services_t,
    sink: *const sys::ferry_probe_sink_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: the host passes pointers valid for this call.
    unsafe {
        boundary(err, || {
            let host = Host::from_raw(host)?;
            let mut report = ProbeReport::from_raw(sink)?;
            P::probe(&host, &mut report)
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`]; `host` and `params` stay valid until fini.
pub unsafe extern "C" fn init_trampoline<P: TransportPlugin>(
    host: *const sys::ferry_host_services_t,
    params: *const sys::ferry_transport_init_params_t,
    out: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: plugin.h (init) keeps `host`, `params` and their strings valid until fini returns,
    // and fini drops the instance holding Host<'static>; `host`, `params` and `out` are
    // null-checked before use (from_raw, read_plain, is_null), the two tables copied to their
    // producer's struct_size (plugin.h); `err` is null or a live errbuf.
    unsafe {
        boundary(err, || {
            let host: Host<'static> = Host::from_raw(host)?;
            let params = read_plain(params).ok_or_else(|| invalid("init params"))?;
            if out.is_null() {
                return Err(invalid("instance out-pointer"));
            }
            let complete = params
                .complete
                .ok_or_else(|| invalid("completion function"))?;
            let completer = Completer {
                ctx: params.completion_ctx as usize,
                complete,
            };
            let init = InitParams {
                engine_name: owned_str(params.engine_name),
                listen_host: owned_str(params.listen_host),
            };
            let inst = P::init(host, init, completer)?;
            *out = Box::into_raw(Box::new(inst)).cast::<c_void>();
            Ok(())
        })
    }
}

/// # Safety
/// `instance` came from init and is not used again.
pub unsafe extern "C" fn fini_trampoline<P: TransportPlugin>(instance: *mut c_void) {
    let _ = catch(|| {
        if !instance.is_null() {
            // SAFETY: init produced this Box; the host calls fini once.
            drop(unsafe { Box::from_raw(instance.cast::<P::Instance>()) });
        }
        Ok(())
    });
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn get_endpoint_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `inst` is null (instance refuses it) or the live instance init returned (plugin.h:
    // init makes it, fini frees it); plugin.h (get_endpoint) gives `buf` `cap` writable bytes and
    // `len` as out-pointer, what copy_out needs; `err` is null or a live errbuf for `boundary`.
    unsafe {
        boundary(err, || {
            let data = instance::<P>(inst)?.endpoint()?;
            copy_out(&data, buf, cap, len);
            Ok(())
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn register_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    region: *const sys::ferry_mem_region_t,
    handle: *mut u64,
    key: *mut u8,
    key_cap: usize,
    key_len: *mut usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: plugin.h (register_memory): `region` (null-checked, copied to its struct_size by
    // read_plain) and its `location` are valid, ABI 1.1/1.2 fields used only if it covers them; `handle` is checked non-null;
    // `key`/`key_len` suit copy_out (key_cap bytes); `inst` null or init's, `err` null or live.
    unsafe {
        boundary(err, || {
            let r = read_plain(region).ok_or_else(|| invalid("region"))?;
            if handle.is_null() {
                return Err(invalid("handle out-pointer"));
            }
            let region = MemRegion {
                addr: r.addr,
                len: r.len,
                mem_kind: r.mem_kind,
                location: owned_str(r.location),
                numa_node: u32::try_from(r.numa_node).ok(),
                device_ordinal: u32::try_from(r.device_ordinal).ok(),
                dmabuf_fd: (r.dmabuf_fd >= 0).then_some(r.dmabuf_fd),
                dmabuf_offset: if crate::has_field!(&r, sys::ferry_mem_region_t, dmabuf_offset) {
                    r.dmabuf_offset
                } else {
                    0
                },
                local_only: r.flags & sys::FERRY_REGION_LOCAL_ONLY != 0,
                share_fd: if r.struct_size as usize
                    >= std::mem::offset_of!(sys::ferry_mem_region_t, share_offset) + 8
                    && r.share_fd >= 0
                {
                    Some((r.share_fd, r.share_offset))
                } else {
                    None
                },
            };
            let reg = instance::<P>(inst)?.register_memory(&region)?;
            *handle = reg.handle;
            copy_out(&reg.key, key, key_cap, key_len);
            Ok(())
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn unregister_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    handle: u64,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `inst` is null (instance refuses it) or the live instance init returned (plugin.h:
    // init makes it, fini frees it); `handle` is a plain number; `err` is null or a live errbuf,
    // which `boundary` handles.
    unsafe { boundary(err, || instance::<P>(inst)?.unregister_memory(handle)) }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn connect_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *const sys::ferry_peer_info_t,
    out: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `peer` is null-checked and copied to its struct_size (read_plain) and, with its
    // `name` string and `endpoint_len` bytes at `endpoint`, valid for the call (plugin.h,
    // connect), copied before it returns; `out` is
    // checked non-null; `inst` null or init's live instance; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            let p = read_plain(peer).ok_or_else(|| invalid("peer"))?;
            if out.is_null() {
                return Err(invalid("peer out-pointer"));
            }
            let info = PeerInfo {
                name: owned_str(p.name),
                scope: p.scope,
                endpoint: bytes(p.endpoint, p.endpoint_len).to_vec(),
            };
            let handle = instance::<P>(inst)?.connect(&info)?;
            *out = Box::into_raw(Box::new(handle)).cast::<c_void>();
            Ok(())
        })
    }
}

type PeerOf<P> = <<P as TransportPlugin>::Instance as TransportInstance>::Peer;

/// # Safety
/// `peer` came from connect on this instance and is not used again.
pub unsafe extern "C" fn disconnect_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
) {
    let _ = catch(|| {
        if peer.is_null() {
            return Ok(());
        }
        // SAFETY: connect produced this Box; the host disconnects once.
        let peer = unsafe { Box::from_raw(peer.cast::<PeerOf<P>>()) };
        // SAFETY: `inst` is null (instance refuses it) or the live instance this plugin's init
        // returned, which plugin.h's engine passes until fini frees it.
        unsafe { instance::<P>(inst) }?.disconnect(*peer);
        Ok(())
    });
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn submit_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    requests: *const sys::ferry_transfer_request_t,
    count: usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `requests` holds `count` entries (null-checked if count > 0) whose remote_key is
    // null or valid for remote_key_len bytes, for the call (plugin.h, submit), borrowed until
    // submit returns; `peer` null or connect's live handle, `inst` init's; `err` null or live.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            if requests.is_null() && count > 0 {
                return Err(invalid("requests"));
            }
            let raw = if count == 0 {
                &[][..]
            } else {
                std::slice::from_raw_parts(requests, count)
            };
            let mut reqs = Vec::with_capacity(raw.len());
            for r in raw {
                let op = Op::from_raw(r.op)?;
                reqs.push(TransferRequest {
                    op,
                    local_addr: r.local_addr,
                    local_mem: r.local_mem,
                    remote_addr: r.remote_addr,
                    length: r.length,
                    remote_key: bytes(r.remote_key, r.remote_key_len),
                    token: r.token,
                });
            }
            instance::<P>(inst)?.submit(peer, &reqs)
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn submit_blocks_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    list: *const sys::ferry_block_list_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `list` is null-checked and, with its key and `count` blocks, valid for the call
    // (plugin.h, ferry_block_list_t), as BlockList::from_raw needs for a borrow ending with
    // submit_blocks; `peer` null or connect's live handle, `inst` init's; `err` null or live.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            let raw = list.as_ref().ok_or_else(|| invalid("list"))?;
            let list = BlockList::from_raw(raw)?;
            instance::<P>(inst)?.submit_blocks(peer, &list)
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn submit_layouts_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    list: *const sys::ferry_layout_list_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `list` (null-checked), its key and both `count`-entry id arrays are valid for the
    // call (plugin.h, ferry_layout_list_t), as LayoutList::from_raw needs for a borrow ending
    // with submit_layouts; `peer` null or connect's, `inst` null or init's; `err` null or live.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            let raw = list.as_ref().ok_or_else(|| invalid("list"))?;
            let list = LayoutList::from_raw(raw)?;
            instance::<P>(inst)?.submit_layouts(peer, &list)
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn describe_peer_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: plugin.h (describe_peer) gives `buf` `cap` writable bytes and `len` as out-pointer;
    // both are null-checked, and `buf` gets data.len() <= cap bytes or one NUL (cap > 0); `peer`
    // null or connect's live handle, `inst` init's; `err` null or live.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            let text = instance::<P>(inst)?.describe_peer(peer).unwrap_or_default();
            let mut data = text.into_bytes();
            data.push(0);
            if !len.is_null() {
                *len = data.len() - 1;
            }
            if !buf.is_null() && data.len() <= cap {
                std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), data.len());
            } else if !buf.is_null() && cap > 0 {
                *buf = 0;
            }
            Ok(())
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn progress_trampoline<P: TransportPlugin>(inst: *mut c_void) -> i32 {
    // SAFETY: `inst` is null (instance refuses it) or the live instance this plugin's init
    // returned, which plugin.h's engine passes to progress until fini frees it.
    catch(|| Ok(unsafe { instance::<P>(inst) }?.progress()))
        .map(|n| i32::try_from(n).unwrap_or(i32::MAX))
        .unwrap_or(0)
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn allocate_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    len: u64,
    numa_node: i32,
    addr: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `addr` is checked non-null before the write and is allocate_memory's out-pointer
    // (plugin.h); `inst` is null (instance refuses it) or the live instance init returned (init
    // makes it, fini frees it); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            if addr.is_null() {
                return Err(invalid("addr out-pointer"));
            }
            let got = instance::<P>(inst)?
                .allocate_memory(len, u32::try_from(numa_node).ok())
                .unwrap_or_else(|| {
                    Err(PluginError::new(
                        ErrorCode::Unsupported,
                        "this transport does not allocate memory",
                    ))
                })?;
            *addr = got as *mut c_void;
            Ok(())
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn free_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    addr: *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `inst` is null (instance refuses it) or the live instance init returned (plugin.h:
    // init makes it, fini frees it); `addr` is only passed on as a number, never dereferenced
    // here; `err` is null or a live errbuf, which `boundary` handles.
    unsafe { boundary(err, || instance::<P>(inst)?.free_memory(addr as u64)) }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn accepts_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    key: *const u8,
    key_len: usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `key` is null or valid for `key_len` bytes for the call (plugin.h, accepts), and
    // the slice `bytes` makes of it ends with this call; `peer` is null (peer_of refuses it) or
    // connect's live handle, `inst` null or init's live instance; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            instance::<P>(inst)?.accepts(peer, bytes(key, key_len))
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
pub unsafe extern "C" fn accepts_pair_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    peer: *mut c_void,
    local_mem: u64,
    key: *const u8,
    key_len: usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `key` is null or valid for `key_len` bytes for the call (plugin.h, accepts_pair),
    // and the slice `bytes` makes of it ends with this call; `peer` is null (peer_of refuses it)
    // or connect's live handle, `inst` null or init's live instance; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            let peer = peer_of::<P>(peer)?;
            instance::<P>(inst)?.accepts_pair(peer, local_mem, bytes(key, key_len))
        })
    }
}

/// # Safety
/// As [`transport_probe_trampoline`].
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn on_peer_request_trampoline<P: TransportPlugin>(
    inst: *mut c_void,
    from: *const c_char,
    body: *const u8,
    body_len: usize,
    reply: *mut u8,
    reply_cap: usize,
    reply_len: *mut usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: plugin.h (on_peer_request) makes `from` a C string and `body` valid for `body_len`
    // bytes, and gives `reply` `reply_cap` bytes and `reply_len` as out-pointer, for copy_out
    // after the reply is checked to fit; `inst` null or init's live instance; `err` null or live.
    unsafe {
        boundary(err, || {
            let from = owned_str(from);
            let data = instance::<P>(inst)?.on_peer_request(&from, bytes(body, body_len))?;
            if data.len() > reply_cap.min(sys::FERRY_PEER_MSG_MAX) {
                return Err(PluginError::new(
                    ErrorCode::Internal,
                    format!(
                        "a reply of {} bytes exceeds the plugin message limit",
                        data.len()
                    ),
                ));
            }
            copy_out(&data, reply, reply_cap, reply_len);
            Ok(())
        })
    }
}

/// The v1 table for a Rust transport plugin with a data path.
pub const fn transport_table_v1<P: TransportPlugin>() -> sys::ferry_transport_plugin_v1_t {
    sys::ferry_transport_plugin_v1_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_transport_plugin_v1_t>(),
        name: P::NAME.as_ptr(),
        version: P::VERSION.as_ptr(),
        description: P::DESCRIPTION.as_ptr(),
        probe: Some(transport_probe_trampoline::<P>),
        init: Some(init_trampoline::<P>),
        fini: Some(fini_trampoline::<P>),
        get_endpoint: Some(get_endpoint_trampoline::<P>),
        register_memory: Some(register_trampoline::<P>),
        unregister_memory: Some(unregister_trampoline::<P>),
        connect: Some(connect_trampoline::<P>),
        disconnect: Some(disconnect_trampoline::<P>),
        submit: Some(submit_trampoline::<P>),
        describe_peer: Some(describe_peer_trampoline::<P>),
        progress: Some(progress_trampoline::<P>),
        allocate_memory: Some(allocate_trampoline::<P>),
        free_memory: Some(free_trampoline::<P>),
        accepts: Some(accepts_trampoline::<P>),
        on_peer_request: Some(on_peer_request_trampoline::<P>),
        accepts_pair: Some(accepts_pair_trampoline::<P>),
        flags: P::FLAGS,
        submit_blocks: if P::BLOCK_LISTS {
            Some(submit_blocks_trampoline::<P>)
        } else {
            None
        },
        submit_layouts: if P::LAYOUT_LISTS {
            Some(submit_layouts_trampoline::<P>)
        } else {
            None
        },
    }
}

/// The v1 table for a probe-only Rust transport plugin.
pub const fn transport_table_v1_probe_only<P: TransportPlugin>() -> sys::ferry_transport_plugin_v1_t
{
    sys::ferry_transport_plugin_v1_t {
        init: None,
        fini: None,
        get_endpoint: None,
        register_memory: None,
        unregister_memory: None,
        connect: None,
        disconnect: None,
        submit: None,
        describe_peer: None,
        progress: None,
        allocate_memory: None,
        free_memory: None,
        accepts: None,
        on_peer_request: None,
        accepts_pair: None,
        submit_blocks: None,
        submit_layouts: None,
        ..transport_table_v1::<P>()
    }
}

/// Exports a [`TransportPlugin`] as `ferry_transport_plugin_v1`. With
/// `probe_only`, the table carries no data path.
#[macro_export]
macro_rules! export_transport_plugin {
    ($plugin:ty) => {
        $crate::export_transport_plugin!(@table $plugin, transport_table_v1);
    };
    ($plugin:ty, probe_only) => {
        $crate::export_transport_plugin!(@table $plugin, transport_table_v1_probe_only);
    };
    (@table $plugin:ty, $table:ident) => {
        /// Entry point of this Ferry transport plugin (ABI v1).
        #[unsafe(no_mangle)]
        pub extern "C" fn ferry_transport_plugin_v1(
        ) -> *const $crate::sys::ferry_transport_plugin_v1_t {
            static TABLE: $crate::sys::ferry_transport_plugin_v1_t =
                $crate::sdk::$table::<$plugin>();
            &TABLE
        }
    };
}
