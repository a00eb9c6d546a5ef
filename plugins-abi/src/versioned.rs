//! Which structs of the ABI can grow, and their `struct_size`: what
//! [`has_field!`](crate::has_field), the Rust twin of `FERRY_HAS_FIELD`,
//! reads. Tables carry it in their `ferry_abi_header_t`, the other growable
//! structs as their own first field (plugin.h, "Versioning rules").

use crate::sys;

/// A struct that begins with its size as its producer compiled it.
pub trait Versioned {
    /// The producer's `sizeof`: fields past it are absent.
    fn struct_size(&self) -> u32;
}

macro_rules! through_header {
    ($($t:ty),* $(,)?) => {$(
        impl Versioned for $t {
            fn struct_size(&self) -> u32 {
                self.hdr.struct_size
            }
        }
    )*};
}

macro_rules! own_field {
    ($($t:ty),* $(,)?) => {$(
        impl Versioned for $t {
            fn struct_size(&self) -> u32 {
                self.struct_size
            }
        }
    )*};
}

through_header!(
    sys::ferry_host_services_t,
    sys::ferry_probe_sink_t,
    sys::ferry_transport_init_params_t,
    sys::ferry_transport_plugin_v1_t,
    sys::ferry_device_plugin_v1_t,
);

own_field!(
    sys::ferry_abi_header_t,
    sys::ferry_probe_device_t,
    sys::ferry_mem_region_t,
    sys::ferry_peer_info_t,
    sys::ferry_device_info_t,
    sys::ferry_pointer_info_t,
);
