//! Raw `#[repr(C)]` mirror of `include/ferry/plugin.h`.
//!
//! The header is the contract; this file follows it field by field, and
//! `tests/layout.rs` compiles the header with the system C compiler and
//! compares every size and offset against these definitions.

#![allow(non_camel_case_types)]

use std::ffi::c_char;
use std::ffi::c_void;

pub const FERRY_PLUGIN_ABI_MAJOR: u16 = 1;
pub const FERRY_PLUGIN_ABI_MINOR: u16 = 7;

pub type ferry_status_t = i32;

pub const FERRY_OK: ferry_status_t = 0;
pub const FERRY_ERR_INVALID_ARGUMENT: ferry_status_t = -1;
pub const FERRY_ERR_UNSUPPORTED: ferry_status_t = -2;
pub const FERRY_ERR_UNAVAILABLE: ferry_status_t = -3;
pub const FERRY_ERR_NOT_FOUND: ferry_status_t = -4;
pub const FERRY_ERR_OUT_OF_BOUNDS: ferry_status_t = -5;
pub const FERRY_ERR_TIMEOUT: ferry_status_t = -6;
pub const FERRY_ERR_CONNECTION: ferry_status_t = -7;
pub const FERRY_ERR_PROTOCOL: ferry_status_t = -8;
pub const FERRY_ERR_NO_MEMORY: ferry_status_t = -9;
pub const FERRY_ERR_BUSY: ferry_status_t = -10;
pub const FERRY_ERR_ABI_MISMATCH: ferry_status_t = -11;
pub const FERRY_ERR_PLUGIN: ferry_status_t = -12;
pub const FERRY_ERR_PANIC: ferry_status_t = -13;
pub const FERRY_ERR_PERMISSION: ferry_status_t = -14;
pub const FERRY_ERR_CANCELLED: ferry_status_t = -15;
pub const FERRY_ERR_IO: ferry_status_t = -16;
pub const FERRY_ERR_INTERNAL: ferry_status_t = -17;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ferry_abi_header_t {
    pub struct_size: u32,
    pub abi_major: u16,
    pub abi_minor: u16,
}

impl ferry_abi_header_t {
    /// The header a table of type `T` carries when built against this crate.
    pub const fn for_table<T>() -> Self {
        ferry_abi_header_t {
            struct_size: std::mem::size_of::<T>() as u32,
            abi_major: FERRY_PLUGIN_ABI_MAJOR,
            abi_minor: FERRY_PLUGIN_ABI_MINOR,
        }
    }
}

#[repr(C)]
#[derive(Debug)]
pub struct ferry_errbuf_t {
    pub msg: *mut c_char,
    pub cap: usize,
}

pub const FERRY_LOG_ERROR: i32 = 1;
pub const FERRY_LOG_WARN: i32 = 2;
pub const FERRY_LOG_INFO: i32 = 3;
pub const FERRY_LOG_DEBUG: i32 = 4;
pub const FERRY_LOG_TRACE: i32 = 5;

pub const FERRY_MEM_HOST: u64 = 1 << 0;
pub const FERRY_MEM_CUDA_STAGED: u64 = 1 << 1;
pub const FERRY_MEM_CUDA_DMABUF: u64 = 1 << 2;
pub const FERRY_MEM_CUDA_PEERMEM: u64 = 1 << 3;
pub const FERRY_MEM_CUDA_IPC: u64 = 1 << 4;

pub const FERRY_SCOPE_SAME_PROCESS: u32 = 1 << 0;
pub const FERRY_SCOPE_SAME_HOST: u32 = 1 << 1;
pub const FERRY_SCOPE_CROSS_HOST: u32 = 1 << 2;

pub const FERRY_NIC_KIND_RDMA: u32 = 1;
pub const FERRY_NIC_KIND_NET: u32 = 2;

pub const FERRY_PATH_UNKNOWN: u32 = 0;
pub const FERRY_PATH_PIX: u32 = 1;
pub const FERRY_PATH_PXB: u32 = 2;
pub const FERRY_PATH_PHB: u32 = 3;
pub const FERRY_PATH_NODE: u32 = 4;
pub const FERRY_PATH_SYS: u32 = 5;

pub const FERRY_PORT_UNKNOWN: u32 = 0;
pub const FERRY_PORT_DOWN: u32 = 1;
pub const FERRY_PORT_ACTIVE: u32 = 2;

pub const FERRY_LINK_UNKNOWN: u32 = 0;
pub const FERRY_LINK_INFINIBAND: u32 = 1;
pub const FERRY_LINK_ETHERNET: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_nic_desc_t {
    pub kind: u32,
    pub path_class: u32,
    pub name: [c_char; 64],
    pub netdev: [c_char; 32],
    pub pci_bus_id: [c_char; 32],
    pub numa_node: i32,
    pub port_state: u32,
    pub link_layer: u32,
    pub reserved: u32,
    pub speed_mbps: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_host_services_t {
    pub hdr: ferry_abi_header_t,
    pub ctx: *mut c_void,
    pub log: Option<unsafe extern "C" fn(ctx: *mut c_void, level: i32, msg: *const c_char)>,
    pub log_enabled: Option<unsafe extern "C" fn(ctx: *mut c_void, level: i32) -> i32>,
    pub config_get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            buf: *mut c_char,
            cap: usize,
        ) -> i64,
    >,
    pub topo_nics: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            location: *const c_char,
            out: *mut ferry_nic_desc_t,
            elem_size: usize,
            cap: u32,
            count: *mut u32,
        ) -> ferry_status_t,
    >,
    // ABI 1.1
    pub peer_request: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            peer: *const c_char,
            body: *const u8,
            body_len: usize,
            reply: *mut u8,
            reply_cap: usize,
            reply_len: *mut usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    // ABI 1.2
    pub count: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            name: *const c_char,
            device: *const c_char,
            delta: u64,
        ),
    >,
}

/// The largest plugin message, request or reply.
pub const FERRY_PEER_MSG_MAX: usize = 65536;

#[repr(C)]
pub struct ferry_probe_device_t {
    pub struct_size: u32,
    pub numa_node: i32,
    pub name: *const c_char,
    pub pci_bus_id: *const c_char,
    pub detail: *const c_char,
    pub mem_kinds: u64,
    // ABI 1.2
    pub bandwidth_mbps: u64,
    pub latency_ns: u32,
    pub reserved: u32,
    // ABI 1.6
    pub gpu: *const ferry_device_info_t,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_probe_sink_t {
    pub hdr: ferry_abi_header_t,
    pub ctx: *mut c_void,
    pub set_capabilities:
        Option<unsafe extern "C" fn(ctx: *mut c_void, mem_kinds: u64, scopes: u32)>,
    pub add_device:
        Option<unsafe extern "C" fn(ctx: *mut c_void, device: *const ferry_probe_device_t)>,
    pub add_missing: Option<
        unsafe extern "C" fn(ctx: *mut c_void, capability: *const c_char, reason: *const c_char),
    >,
    pub add_note:
        Option<unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_char)>,
    // ABI 1.5
    pub add_memory_method: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            mem_kind: u64,
            available: i32,
            detail: *const c_char,
        ),
    >,
}

pub type ferry_probe_fn = unsafe extern "C" fn(
    host: *const ferry_host_services_t,
    sink: *const ferry_probe_sink_t,
    err: *mut ferry_errbuf_t,
) -> ferry_status_t;

pub const FERRY_OP_READ: u32 = 0;
pub const FERRY_OP_WRITE: u32 = 1;

pub type ferry_complete_fn = unsafe extern "C" fn(
    completion_ctx: *mut c_void,
    token: u64,
    status: ferry_status_t,
    msg: *const c_char,
);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_transport_init_params_t {
    pub hdr: ferry_abi_header_t,
    pub engine_name: *const c_char,
    pub listen_host: *const c_char,
    pub completion_ctx: *mut c_void,
    pub complete: Option<ferry_complete_fn>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_mem_region_t {
    pub struct_size: u32,
    pub numa_node: i32,
    pub addr: u64,
    pub len: u64,
    pub mem_kind: u64,
    pub location: *const c_char,
    pub device_ordinal: i32,
    pub dmabuf_fd: i32,
    pub flags: u32,
    pub reserved: u32,
    // ABI 1.1
    pub dmabuf_offset: u64,
    // ABI 1.2
    pub share_fd: i32,
    pub reserved2: u32,
    pub share_offset: u64,
}

pub const FERRY_REGION_LOCAL_ONLY: u32 = 1 << 0;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_peer_info_t {
    pub struct_size: u32,
    pub scope: u32,
    pub name: *const c_char,
    pub endpoint: *const u8,
    pub endpoint_len: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ferry_transfer_request_t {
    pub op: u32,
    pub reserved: u32,
    pub local_addr: u64,
    pub local_mem: u64,
    pub remote_addr: u64,
    pub length: u64,
    pub remote_key: *const u8,
    pub remote_key_len: usize,
    pub token: u64,
}

/// One copy of a device copy list (ABI 1.5; see plugin.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ferry_device_copy_t {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// One block of a block list (ABI 1.4; see plugin.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ferry_block_t {
    pub local_offset: u64,
    pub remote_offset: u64,
    pub length: u64,
}

/// Many blocks between one local and one peer buffer, completed once (ABI
/// 1.4; see plugin.h).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ferry_block_list_t {
    pub op: u32,
    pub reserved: u32,
    pub local_addr: u64,
    pub local_mem: u64,
    pub remote_addr: u64,
    pub remote_key: *const u8,
    pub remote_key_len: usize,
    pub blocks: *const ferry_block_t,
    pub count: usize,
    pub token: u64,
}

/// Blocks of two layouts by index, completed once (ABI 1.5; see
/// plugin.h).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ferry_layout_list_t {
    pub op: u32,
    pub reserved: u32,
    pub local_base: u64,
    pub local_stride: u64,
    pub local_blocks: u64,
    pub local_mem: u64,
    pub remote_base: u64,
    pub remote_stride: u64,
    pub remote_blocks: u64,
    pub remote_key: *const u8,
    pub remote_key_len: usize,
    pub block_size: u64,
    pub local_ids: *const u64,
    pub remote_ids: *const u64,
    pub count: usize,
    pub token: u64,
}

#[repr(C)]
pub struct ferry_transport_plugin_v1_t {
    pub hdr: ferry_abi_header_t,
    pub name: *const c_char,
    pub version: *const c_char,
    pub description: *const c_char,
    pub probe: Option<ferry_probe_fn>,
    pub init: Option<
        unsafe extern "C" fn(
            host: *const ferry_host_services_t,
            params: *const ferry_transport_init_params_t,
            instance: *mut *mut c_void,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub fini: Option<unsafe extern "C" fn(instance: *mut c_void)>,
    pub get_endpoint: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            buf: *mut u8,
            cap: usize,
            len: *mut usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub register_memory: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            region: *const ferry_mem_region_t,
            mem_handle: *mut u64,
            key: *mut u8,
            key_cap: usize,
            key_len: *mut usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub unregister_memory: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            mem_handle: u64,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub connect: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer: *const ferry_peer_info_t,
            peer_handle: *mut *mut c_void,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub disconnect: Option<unsafe extern "C" fn(instance: *mut c_void, peer_handle: *mut c_void)>,
    pub submit: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            requests: *const ferry_transfer_request_t,
            count: usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub describe_peer: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            buf: *mut c_char,
            cap: usize,
            len: *mut usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub progress: Option<unsafe extern "C" fn(instance: *mut c_void) -> i32>,
    pub allocate_memory: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            len: u64,
            numa_node: i32,
            addr: *mut *mut c_void,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub free_memory: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            addr: *mut c_void,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    pub accepts: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            remote_key: *const u8,
            key_len: usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    // ABI 1.1
    pub on_peer_request: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            from: *const c_char,
            body: *const u8,
            body_len: usize,
            reply: *mut u8,
            reply_cap: usize,
            reply_len: *mut usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    // ABI 1.2
    pub accepts_pair: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            local_mem: u64,
            remote_key: *const u8,
            key_len: usize,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    // ABI 1.3
    /// `FERRY_TRANSPORT_*` bits.
    pub flags: u64,
    // ABI 1.4
    pub submit_blocks: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            list: *const ferry_block_list_t,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
    // ABI 1.5
    pub submit_layouts: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            peer_handle: *mut c_void,
            list: *const ferry_layout_list_t,
            err: *mut ferry_errbuf_t,
        ) -> ferry_status_t,
    >,
}

/// submit moves local memory never registered with the transport (see
/// plugin.h).
pub const FERRY_TRANSPORT_LOCAL_UNREGISTERED: u64 = 1 << 0;

pub const FERRY_TRANSPORT_PLUGIN_V1_SYMBOL: &str = "ferry_transport_plugin_v1";
pub type ferry_transport_plugin_v1_entry_fn =
    unsafe extern "C" fn() -> *const ferry_transport_plugin_v1_t;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_device_info_t {
    pub struct_size: u32,
    pub ordinal: i32,
    pub name: [c_char; 96],
    pub pci_bus_id: [c_char; 32],
    pub uuid: [c_char; 48],
    pub total_memory: u64,
    pub gpu_direct_rdma: i32,
    pub dmabuf: i32,
    pub dmabuf_export: i32,
    pub reserved: i32,
}

pub const FERRY_PTR_HOST: u32 = 0;
pub const FERRY_PTR_DEVICE: u32 = 1;
pub const FERRY_PTR_HOST_PINNED: u32 = 2;
pub const FERRY_PTR_MANAGED: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ferry_pointer_info_t {
    pub struct_size: u32,
    pub kind: u32,
    pub ordinal: i32,
    pub reserved: u32,
    pub base: u64,
    pub size: u64,
}

type Err = *mut ferry_errbuf_t;

#[repr(C)]
pub struct ferry_device_plugin_v1_t {
    pub hdr: ferry_abi_header_t,
    pub name: *const c_char,
    pub version: *const c_char,
    pub description: *const c_char,
    pub probe: Option<ferry_probe_fn>,
    pub init: Option<
        unsafe extern "C" fn(
            host: *const ferry_host_services_t,
            instance: *mut *mut c_void,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub fini: Option<unsafe extern "C" fn(instance: *mut c_void)>,
    pub device_count: Option<
        unsafe extern "C" fn(instance: *mut c_void, count: *mut u32, err: Err) -> ferry_status_t,
    >,
    pub device_info: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            ordinal: i32,
            out: *mut ferry_device_info_t,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub query_pointer: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            addr: u64,
            out: *mut ferry_pointer_info_t,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub export_dmabuf: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            addr: u64,
            len: u64,
            fd: *mut i32,
            offset: *mut u64,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub alloc_pinned: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            len: u64,
            out: *mut *mut c_void,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub free_pinned: Option<unsafe extern "C" fn(instance: *mut c_void, ptr: *mut c_void)>,
    pub alloc_device: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            ordinal: i32,
            len: u64,
            out: *mut u64,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub free_device: Option<unsafe extern "C" fn(instance: *mut c_void, ptr: u64)>,
    pub stream_create: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            ordinal: i32,
            stream: *mut *mut c_void,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub stream_destroy: Option<unsafe extern "C" fn(instance: *mut c_void, stream: *mut c_void)>,
    pub copy_async: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            stream: *mut c_void,
            dst: u64,
            src: u64,
            len: u64,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub stream_sync: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            stream: *mut c_void,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub pin_host: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            addr: u64,
            len: u64,
            err: Err,
        ) -> ferry_status_t,
    >,
    pub unpin_host: Option<unsafe extern "C" fn(instance: *mut c_void, addr: u64)>,
    // ABI 1.5
    pub copy_list_async: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            stream: *mut c_void,
            copies: *const ferry_device_copy_t,
            count: usize,
            err: Err,
        ) -> ferry_status_t,
    >,
    // ABI 1.7
    pub stream_query: Option<
        unsafe extern "C" fn(
            instance: *mut c_void,
            stream: *mut c_void,
            done: *mut u32,
            err: Err,
        ) -> ferry_status_t,
    >,
}

pub const FERRY_DEVICE_PLUGIN_V1_SYMBOL: &str = "ferry_device_plugin_v1";
pub type ferry_device_plugin_v1_entry_fn =
    unsafe extern "C" fn() -> *const ferry_device_plugin_v1_t;

// SAFETY: a plugin table is immutable after construction and only holds
// pointers to 'static data (string literals, functions), so sharing a
// reference between threads cannot race.
unsafe impl Sync for ferry_transport_plugin_v1_t {}
// SAFETY: a device plugin table, like a transport's, is immutable after
// construction and holds only pointers to 'static data, so shared
// references cannot race.
unsafe impl Sync for ferry_device_plugin_v1_t {}
