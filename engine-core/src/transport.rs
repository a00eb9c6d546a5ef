//! One transport plugin instance, wrapped so that the rest of the engine
//! calls safe methods: every call passes valid pointers and an error buffer,
//! and every failure comes back as an [`Error`] with the plugin's message.

use crate::error::{Error, ErrorCode, Result};
use ferry_loader::{LoadedLibrary, Plugin};
use ferry_plugins_abi::sdk::to_cstring_lossy;
use ferry_plugins_abi::sys;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Arc;

/// A buffer to register with a transport.
#[derive(Clone, Copy, Debug)]
pub struct RegionSpec<'a> {
    pub addr: u64,
    pub len: u64,
    /// One `FERRY_MEM_*` bit: how the transport should register it.
    pub mem_kind: u64,
    pub location: &'a str,
    pub numa_node: Option<u32>,
    pub device_ordinal: Option<u32>,
    /// For `FERRY_MEM_CUDA_DMABUF`: the fd (borrowed for the call) and
    /// `addr`'s offset inside the exported buffer.
    pub dmabuf: Option<(i32, u64)>,
    pub local_only: bool,
    /// Host memory the engine allocated: the memfd holding it (borrowed
    /// for the call) and `addr`'s offset inside it.
    pub share: Option<(i32, u64)>,
}

/// Receives completions from plugins; implemented by the batch table.
pub trait CompletionSink: Send + Sync + 'static {
    fn complete(&self, token: u64, result: std::result::Result<(), Error>);
}

/// Storage that must outlive the plugin instance: the init parameters and
/// the strings they point to.
struct InitStorage {
    _engine_name: CString,
    _listen_host: CString,
    params: sys::ferry_transport_init_params_t,
}

pub struct Transport {
    pub name: String,
    pub mem_kinds: u64,
    pub scopes: u32,
    /// The devices the plugin reported from probe, with what it declared
    /// of each (ABI 1.2: bandwidth, latency, memory kinds).
    pub devices: Vec<ferry_loader::DeviceReport>,
    /// Its submit moves local memory never registered with it
    /// (`FERRY_TRANSPORT_LOCAL_UNREGISTERED`, ABI 1.3).
    pub local_unregistered: bool,
    /// Keeps the plugin loaded: `table` points into it.
    _library: Arc<LoadedLibrary>,
    // Points into `_library`, which stays loaded as long as self.
    table: *const sys::ferry_transport_plugin_v1_t,
    instance: *mut c_void,
    // Kept alive until fini has returned (see Drop).
    _init: Box<InitStorage>,
    sink: *const Arc<dyn CompletionSink>,
}

// SAFETY: the instance pointer is only passed to the plugin, which plugin.h
// requires to accept calls from any thread; the other fields are immutable
// after init or are Send + Sync themselves.
unsafe impl Send for Transport {}
// SAFETY: shared access passes the instance pointer to the plugin, which
// plugin.h requires to accept concurrent calls; the other fields are only
// read after init, or are Sync themselves.
unsafe impl Sync for Transport {}

/// An opaque peer handle from `connect`; disconnected when dropped.
pub struct PeerHandle {
    transport: Arc<Transport>,
    handle: *mut c_void,
}

// SAFETY: as for Transport: the handle is only passed back to the plugin.
unsafe impl Send for PeerHandle {}
// SAFETY: shared access only passes the handle back to the plugin, which
// plugin.h requires to accept concurrent calls on one peer.
unsafe impl Sync for PeerHandle {}

impl Drop for PeerHandle {
    fn drop(&mut self) {
        if let Some(disconnect) = self.transport.table().disconnect {
            // SAFETY: handle came from this instance's connect and is
            // disconnected exactly once.
            unsafe { disconnect(self.transport.instance, self.handle) };
        }
    }
}

#[cfg(feature = "testing")]
impl PeerHandle {
    pub fn transport(&self) -> &Arc<Transport> {
        &self.transport
    }
}

struct ErrBuf {
    buf: Vec<u8>,
}

impl ErrBuf {
    fn new() -> ErrBuf {
        ErrBuf {
            buf: vec![0u8; 1024],
        }
    }

    fn raw(&mut self) -> sys::ferry_errbuf_t {
        sys::ferry_errbuf_t {
            msg: self.buf.as_mut_ptr().cast::<c_char>(),
            cap: self.buf.len(),
        }
    }

    fn error(&mut self, plugin: &str, what: &str, status: sys::ferry_status_t) -> Error {
        if let Some(last) = self.buf.last_mut() {
            *last = 0;
        }
        // A plugin's message is data: escaped before it can reach a terminal.
        let msg = CStr::from_bytes_until_nul(&self.buf)
            .map(|c| ferry_loader::escape::for_terminal(&c.to_string_lossy()).into_owned())
            .unwrap_or_default();
        let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Plugin);
        let msg = if msg.is_empty() {
            format!("{plugin}: {what} failed ({code})")
        } else if msg.starts_with(&format!("{plugin}:")) {
            msg
        } else {
            format!("{plugin}: {msg}")
        };
        Error::new(code, msg)
    }
}

unsafe extern "C" fn complete_trampoline(
    ctx: *mut c_void,
    token: u64,
    status: sys::ferry_status_t,
    msg: *const c_char,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx is the boxed Arc we handed to init; it stays alive
        // until after fini returns (Transport::drop), and plugins may only
        // complete until then.
        let Some(sink) = (unsafe { ctx.cast::<Arc<dyn CompletionSink>>().cast_const().as_ref() })
        else {
            return;
        };
        let result = if status == sys::FERRY_OK {
            Ok(())
        } else {
            let text = if msg.is_null() {
                String::new()
            } else {
                // SAFETY: a non-null message is a C string valid for the call.
                let raw: String = unsafe { CStr::from_ptr(msg) }
                    .to_string_lossy()
                    .chars()
                    .take(1024)
                    .collect();
                ferry_loader::escape::for_terminal(&raw).into_owned()
            };
            let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Plugin);
            Err(Error::new(code, text))
        };
        sink.complete(token, result);
    }));
}

/// Copies variable-size output with plugin.h's "call again if *len > cap" rule.
fn sized_output(
    mut call: impl FnMut(*mut u8, usize, &mut usize) -> std::result::Result<(), Error>,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    for _ in 0..4 {
        let mut len = 0usize;
        call(buf.as_mut_ptr(), buf.len(), &mut len)?;
        if len <= buf.len() {
            buf.truncate(len);
            return Ok(buf);
        }
        if len > crate::descriptor::MAX_BLOB_LEN {
            return Err(Error::new(
                ErrorCode::Plugin,
                format!(
                    "a plugin returned {len} bytes, more than the {} allowed",
                    crate::descriptor::MAX_BLOB_LEN
                ),
            ));
        }
        buf.resize(len, 0);
    }
    Err(Error::new(
        ErrorCode::Plugin,
        "a plugin kept changing its output size",
    ))
}

impl Transport {
    /// Creates an instance of an enabled transport plugin, or `None` when it
    /// is probe-only (no data path).
    pub fn init(
        plugin: &Plugin,
        engine_name: &str,
        listen_host: &str,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Option<Transport>> {
        let Some(library) = plugin.library().cloned() else {
            return Ok(None);
        };
        let Some(table) = library.transport_table() else {
            return Ok(None);
        };
        // A table too short to hold the data path is a probe-only plugin.
        if !ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, submit) {
            return Ok(None);
        }
        let Some(init) = table.init else {
            return Ok(None);
        };
        let name = plugin.report.name.clone();
        // The loader disables such a plugin when it loads it; this only
        // guards the calls below.
        let missing = ferry_loader::missing_transport_functions(table);
        if !missing.is_empty() {
            return Err(Error::new(
                ErrorCode::AbiMismatch,
                format!("transport {name} has init but not {}", missing.join(", ")),
            ));
        }
        let sink = Box::into_raw(Box::new(sink));
        let engine_name = to_cstring_lossy(engine_name);
        let listen_host = to_cstring_lossy(listen_host);
        let storage = Box::new(InitStorage {
            params: sys::ferry_transport_init_params_t {
                hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_transport_init_params_t>(),
                engine_name: engine_name.as_ptr(),
                listen_host: listen_host.as_ptr(),
                completion_ctx: sink.cast::<c_void>(),
                complete: Some(complete_trampoline),
            },
            _engine_name: engine_name,
            _listen_host: listen_host,
        });
        let mut instance: *mut c_void = std::ptr::null_mut();
        let mut err = ErrBuf::new();
        let mut raw_err = err.raw();
        // SAFETY: services and params live until fini (kept in `library`
        // and `storage`); instance and err are valid out-pointers.
        let status = unsafe {
            init(
                library.services(),
                &storage.params,
                &mut instance,
                &mut raw_err,
            )
        };
        if status != sys::FERRY_OK || instance.is_null() {
            // SAFETY: init failed, so the plugin holds no reference to sink.
            drop(unsafe { Box::from_raw(sink) });
            let e = err.error(&name, "init", status);
            return Err(e);
        }
        let flags = if ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, flags)
        {
            table.flags
        } else {
            0
        };
        Ok(Some(Transport {
            name,
            mem_kinds: plugin.report.capabilities.mem_bits,
            scopes: plugin.report.capabilities.scope_bits,
            devices: plugin.report.devices.clone(),
            local_unregistered: flags & sys::FERRY_TRANSPORT_LOCAL_UNREGISTERED != 0,
            table: table as *const sys::ferry_transport_plugin_v1_t,
            _library: library,
            instance,
            _init: storage,
            sink,
        }))
    }

    fn table(&self) -> &sys::ferry_transport_plugin_v1_t {
        // SAFETY: `library`'s own boxed, immutable copy of the table (the
        // loader's copy_table): its address is stable, and self holds
        // `library`.
        unsafe { &*self.table }
    }

    /// The plugin's library (kept loaded while this instance lives).
    #[cfg(feature = "testing")]
    pub fn library(&self) -> &Arc<LoadedLibrary> {
        &self._library
    }

    pub fn endpoint(&self) -> Result<Vec<u8>> {
        let f = self
            .table()
            .get_endpoint
            .ok_or_else(|| missing(&self.name, "get_endpoint"))?;
        sized_output(|buf, cap, len| {
            let mut err = ErrBuf::new();
            let mut raw = err.raw();
            // SAFETY: buf is writable for cap bytes; len and err are valid.
            let status = unsafe { f(self.instance, buf, cap, len, &mut raw) };
            if status == sys::FERRY_OK {
                Ok(())
            } else {
                Err(err.error(&self.name, "get_endpoint", status))
            }
        })
    }

    /// Registers a buffer; returns the plugin's handle and the key for peers.
    pub fn register(&self, r: &RegionSpec<'_>) -> Result<(u64, Vec<u8>)> {
        let f = self
            .table()
            .register_memory
            .ok_or_else(|| missing(&self.name, "register_memory"))?;
        let location = to_cstring_lossy(r.location);
        let region = sys::ferry_mem_region_t {
            struct_size: std::mem::size_of::<sys::ferry_mem_region_t>() as u32,
            numa_node: r
                .numa_node
                .and_then(|n| i32::try_from(n).ok())
                .unwrap_or(-1),
            addr: r.addr,
            len: r.len,
            mem_kind: r.mem_kind,
            location: location.as_ptr(),
            device_ordinal: r
                .device_ordinal
                .and_then(|n| i32::try_from(n).ok())
                .unwrap_or(-1),
            dmabuf_fd: r.dmabuf.map_or(-1, |(fd, _)| fd),
            flags: if r.local_only {
                sys::FERRY_REGION_LOCAL_ONLY
            } else {
                0
            },
            reserved: 0,
            dmabuf_offset: r.dmabuf.map_or(0, |(_, off)| off),
            share_fd: r.share.map_or(-1, |(fd, _)| fd),
            reserved2: 0,
            share_offset: r.share.map_or(0, |(_, off)| off),
        };
        // One call, with room for any key the descriptor can carry: calling
        // again for a longer key would register the buffer twice (plugin.h,
        // register_memory).
        let mut handle = 0u64;
        let mut key = vec![0u8; crate::descriptor::MAX_BLOB_LEN];
        let mut key_len = 0usize;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: region and its string live across the call; key is
        // writable for its length; the out pointers are valid.
        let status = unsafe {
            f(
                self.instance,
                &region,
                &mut handle,
                key.as_mut_ptr(),
                key.len(),
                &mut key_len,
                &mut raw,
            )
        };
        if status != sys::FERRY_OK {
            return Err(err.error(&self.name, "register_memory", status));
        }
        if key_len > key.len() {
            let _ = self.unregister(handle);
            return Err(Error::new(
                ErrorCode::Plugin,
                format!(
                    "{}: register_memory returned a key of {key_len} bytes, more than the {} \
                     a segment descriptor carries; the registration was undone",
                    self.name,
                    key.len()
                ),
            ));
        }
        key.truncate(key_len);
        Ok((handle, key))
    }

    pub fn unregister(&self, handle: u64) -> Result<()> {
        let f = self
            .table()
            .unregister_memory
            .ok_or_else(|| missing(&self.name, "unregister_memory"))?;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: handle came from register_memory on this instance.
        let status = unsafe { f(self.instance, handle, &mut raw) };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "unregister_memory", status))
        }
    }

    pub fn connect(
        self: &Arc<Self>,
        peer: &str,
        scope: u32,
        endpoint: &[u8],
    ) -> Result<PeerHandle> {
        let f = self
            .table()
            .connect
            .ok_or_else(|| missing(&self.name, "connect"))?;
        let name = to_cstring_lossy(peer);
        let info = sys::ferry_peer_info_t {
            struct_size: std::mem::size_of::<sys::ferry_peer_info_t>() as u32,
            scope,
            name: name.as_ptr(),
            endpoint: endpoint.as_ptr(),
            endpoint_len: endpoint.len(),
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: info and the bytes it points to live across the call.
        let status = unsafe { f(self.instance, &info, &mut handle, &mut raw) };
        if status != sys::FERRY_OK {
            return Err(err.error(&self.name, "connect", status));
        }
        Ok(PeerHandle {
            transport: self.clone(),
            handle,
        })
    }

    /// Hands requests to the plugin: all accepted (each will complete through
    /// the sink) or none (the error).
    pub fn submit(
        &self,
        peer: &PeerHandle,
        requests: &[sys::ferry_transfer_request_t],
    ) -> Result<()> {
        let f = self
            .table()
            .submit
            .ok_or_else(|| missing(&self.name, "submit"))?;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: requests is valid for its length; peer came from connect.
        let status = unsafe {
            f(
                self.instance,
                peer.handle,
                requests.as_ptr(),
                requests.len(),
                &mut raw,
            )
        };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "submit", status))
        }
    }

    /// Whether the plugin takes block lists (`submit_blocks`, ABI 1.4).
    pub fn takes_block_lists(&self) -> bool {
        let table = self.table();
        ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, submit_blocks)
            && table.submit_blocks.is_some()
    }

    /// Hands one block list to the plugin, completed once with
    /// `list.token`; `Unsupported` when it takes none (nothing accepted).
    pub fn submit_blocks(&self, peer: &PeerHandle, list: &sys::ferry_block_list_t) -> Result<()> {
        let table = self.table();
        let f = if self.takes_block_lists() {
            table.submit_blocks
        } else {
            None
        };
        let f = f.ok_or_else(|| {
            Error::new(
                ErrorCode::Unsupported,
                format!("transport {} takes no block lists", self.name),
            )
        })?;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: list, its key and its blocks are valid for the call; peer
        // came from connect.
        let status = unsafe { f(self.instance, peer.handle, list, &mut raw) };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "submit_blocks", status))
        }
    }

    /// Whether the plugin takes blocks by layout and index
    /// (`submit_layouts`, ABI 1.5).
    pub fn takes_layout_lists(&self) -> bool {
        let table = self.table();
        ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, submit_layouts)
            && table.submit_layouts.is_some()
    }

    /// Hands blocks by layout and index to the plugin, completed once with
    /// `list.token`; `Unsupported` when it takes none (nothing accepted).
    pub fn submit_layouts(&self, peer: &PeerHandle, list: &sys::ferry_layout_list_t) -> Result<()> {
        let table = self.table();
        let f = if self.takes_layout_lists() {
            table.submit_layouts
        } else {
            None
        };
        let f = f.ok_or_else(|| {
            Error::new(
                ErrorCode::Unsupported,
                format!("transport {} takes no layout lists", self.name),
            )
        })?;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: list, its key and its two index arrays (count entries
        // each) are valid for the call; peer came from connect.
        let status = unsafe { f(self.instance, peer.handle, list, &mut raw) };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "submit_layouts", status))
        }
    }

    /// The plugin's own words on how it reaches this peer.
    pub fn describe(&self, peer: &PeerHandle) -> Option<String> {
        let table = self.table();
        if !ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, describe_peer) {
            return None;
        }
        let f = table.describe_peer?;
        let bytes = sized_output(|buf, cap, len| {
            let mut err = ErrBuf::new();
            let mut raw = err.raw();
            // SAFETY: buf writable for cap bytes; peer from connect.
            let status = unsafe {
                f(
                    self.instance,
                    peer.handle,
                    buf.cast::<c_char>(),
                    cap,
                    len,
                    &mut raw,
                )
            };
            // The text is NUL-terminated: ask for one more byte.
            *len += 1;
            if status == sys::FERRY_OK {
                Ok(())
            } else {
                Err(err.error(&self.name, "describe_peer", status))
            }
        })
        .ok()?;
        // Shown in `ferry demo`, routes and logs: escaped, as every plugin string.
        let text = ferry_loader::escape::for_terminal(
            &CStr::from_bytes_until_nul(&bytes).ok()?.to_string_lossy(),
        )
        .into_owned();
        (!text.is_empty()).then_some(text)
    }

    /// Shareable memory from the plugin; `None` when it allocates none.
    pub fn allocate(&self, len: u64, numa_node: Option<u32>) -> Option<Result<u64>> {
        let table = self.table();
        if !ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, free_memory) {
            return None;
        }
        let f = table.allocate_memory?;
        table.free_memory?;
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        let numa = numa_node.and_then(|n| i32::try_from(n).ok()).unwrap_or(-1);
        // SAFETY: addr and err are valid out-pointers for the call.
        let status = unsafe { f(self.instance, len, numa, &mut addr, &mut raw) };
        match status {
            sys::FERRY_OK if !addr.is_null() => Some(Ok(addr as u64)),
            sys::FERRY_ERR_UNSUPPORTED => None,
            _ => Some(Err(err.error(&self.name, "allocate_memory", status))),
        }
    }

    pub fn free(&self, addr: u64) -> Result<()> {
        let f = self
            .table()
            .free_memory
            .ok_or_else(|| missing(&self.name, "free_memory"))?;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: addr came from this instance's allocate_memory.
        let status = unsafe { f(self.instance, addr as *mut c_void, &mut raw) };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "free_memory", status))
        }
    }

    /// Whether the plugin serves this peer's buffer with `key` (plugins
    /// without the check serve every buffer they were given a key for).
    pub fn accepts(&self, peer: &PeerHandle, key: &[u8]) -> Result<()> {
        let table = self.table();
        if !ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, accepts) {
            return Ok(());
        }
        let Some(f) = table.accepts else {
            return Ok(());
        };
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: peer from connect; key valid for its length.
        let status = unsafe {
            f(
                self.instance,
                peer.handle,
                key.as_ptr(),
                key.len(),
                &mut raw,
            )
        };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "accepts", status))
        }
    }

    /// Whether the plugin serves requests between the local buffer it gave
    /// `local_mem` for and this peer's buffer with `key`: its
    /// `accepts_pair` (ABI 1.2) where it has one, else [`Transport::accepts`].
    pub fn accepts_pair(&self, peer: &PeerHandle, local_mem: u64, key: &[u8]) -> Result<()> {
        let table = self.table();
        let f =
            if ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, accepts_pair)
            {
                table.accepts_pair
            } else {
                None
            };
        let Some(f) = f else {
            return self.accepts(peer, key);
        };
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: peer from connect; key valid for its length; local_mem is
        // the plugin's own handle, passed back as an integer.
        let status = unsafe {
            f(
                self.instance,
                peer.handle,
                local_mem,
                key.as_ptr(),
                key.len(),
                &mut raw,
            )
        };
        if status == sys::FERRY_OK {
            Ok(())
        } else {
            Err(err.error(&self.name, "accepts_pair", status))
        }
    }

    /// Hands a plugin message from the same-named transport of engine
    /// `from` to this instance and returns its reply.
    pub fn peer_request(&self, from: &str, body: &[u8]) -> Result<Vec<u8>> {
        let table = self.table();
        let f = if ferry_plugins_abi::has_field!(
            table,
            sys::ferry_transport_plugin_v1_t,
            on_peer_request
        ) {
            table.on_peer_request
        } else {
            None
        };
        let f = f.ok_or_else(|| {
            Error::new(
                ErrorCode::Unsupported,
                format!("transport {} answers no plugin messages", self.name),
            )
        })?;
        let from = to_cstring_lossy(from);
        let mut reply = vec![0u8; sys::FERRY_PEER_MSG_MAX];
        let mut len = 0usize;
        let mut err = ErrBuf::new();
        let mut raw = err.raw();
        // SAFETY: from is NUL-terminated, body readable for its length, reply
        // writable for its capacity; len and raw are live out-parameters.
        let status = unsafe {
            f(
                self.instance,
                from.as_ptr(),
                body.as_ptr(),
                body.len(),
                reply.as_mut_ptr(),
                reply.len(),
                &mut len,
                &mut raw,
            )
        };
        if status != sys::FERRY_OK {
            return Err(err.error(&self.name, "on_peer_request", status));
        }
        if len > reply.len() {
            return Err(Error::new(
                ErrorCode::Plugin,
                format!("{}: a plugin reply over the size limit", self.name),
            ));
        }
        reply.truncate(len);
        Ok(reply)
    }

    /// Lets the plugin complete what has arrived, on this thread.
    pub fn progress(&self) -> usize {
        let table = self.table();
        if !ferry_plugins_abi::has_field!(table, sys::ferry_transport_plugin_v1_t, progress) {
            return 0;
        }
        match table.progress {
            // SAFETY: the instance is live; progress takes only it.
            Some(f) => usize::try_from(unsafe { f(self.instance) }).unwrap_or(0),
            None => 0,
        }
    }

    #[cfg(feature = "testing")]
    pub fn supports(&self, mem_kind: u64, scope: u32) -> bool {
        self.mem_kinds & mem_kind != 0 && scope_served(self.scopes, scope)
    }
}

/// Whether a transport that reaches `offered` peers can serve a peer at
/// `scope`: a cross-host transport also works within a host (loopback), a
/// same-host one within a process.
pub fn scope_served(offered: u32, scope: u32) -> bool {
    match scope {
        sys::FERRY_SCOPE_SAME_PROCESS => offered != 0,
        sys::FERRY_SCOPE_SAME_HOST => {
            offered & (sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST) != 0
        }
        _ => offered & sys::FERRY_SCOPE_CROSS_HOST != 0,
    }
}

fn missing(plugin: &str, f: &str) -> Error {
    Error::new(
        ErrorCode::Unsupported,
        format!("transport {plugin} has no {f}"),
    )
}

impl Drop for Transport {
    fn drop(&mut self) {
        if let Some(fini) = self.table().fini {
            // SAFETY: the instance came from init and is finalised once; every
            // PeerHandle holds an Arc<Transport>, so none outlives this.
            unsafe { fini(self.instance) };
        }
        // SAFETY: fini has returned, so the plugin calls complete no more and
        // the boxed sink can go.
        drop(unsafe { Box::from_raw(self.sink.cast_mut()) });
    }
}
