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

/// A versioned struct that is plain data: a `repr(C)` struct whose first
/// four bytes are its size (directly or as its header's first field) and
/// whose fields are integers, raw pointers and nullable function pointers
/// only, so all-zero bytes, and any bytes a producer wrote, are a value.
///
/// # Safety
/// Implement it only for such structs: [`read_plain`] fills the fields the
/// producer's size does not cover with zeros and copies the rest as bytes.
pub unsafe trait Plain: Versioned + Sized {}

// SAFETY: each is repr(C) with its size (or its header, size first) first,
// and holds only integers, raw pointers and Option<extern "C" fn> (sys.rs).
unsafe impl Plain for sys::ferry_host_services_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_probe_sink_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_transport_init_params_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_transport_plugin_v1_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_device_plugin_v1_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_mem_region_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_peer_info_t {}
// SAFETY: as above.
unsafe impl Plain for sys::ferry_probe_device_t {}
// SAFETY: as above; its char arrays are integers too.
unsafe impl Plain for sys::ferry_device_info_t {}

/// This build's copy of the struct at `p`: the bytes its producer's size
/// covers (at most this build's size), zero beyond, so that a struct from
/// an older minor version, shorter than this build's, is never read past
/// its end (a `&T` over it would reach there) and its absent fields read as
/// 0, NULL or None. The copy keeps the producer's size, so
/// [`has_field!`](crate::has_field) on it still says what the producer has.
/// None when `p` is null.
///
/// # Safety
/// `p` is null or points to a struct whose first four bytes (its size)
/// are readable, and which is readable for that many bytes, during the
/// call (plugin.h's rule for every versioned struct).
pub unsafe fn read_plain<T: Plain>(p: *const T) -> Option<T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null, and its first four bytes are readable (contract).
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    let len = size.min(std::mem::size_of::<T>());
    let mut copy = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: `p` is readable for `size >= len` bytes (contract); the copy
    // is this function's own, size_of::<T>() >= len bytes, and does not
    // overlap it.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), len) };
    // SAFETY: every byte is zero or one the producer wrote for a field of
    // integers, raw pointers or nullable function pointers (Plain): each a
    // valid value.
    Some(unsafe { copy.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shorter_struct_is_read_to_its_end_and_the_rest_is_zero() {
        // An ABI 1.0 region: struct_size ends before dmabuf_offset (1.1).
        let short = std::mem::offset_of!(sys::ferry_mem_region_t, dmabuf_offset);
        let mut bytes = vec![0xAAu8; short];
        bytes[..4].copy_from_slice(&(short as u32).to_ne_bytes());
        // The bytes after `short` are not there: the allocation ends.
        let p = bytes.as_ptr().cast::<sys::ferry_mem_region_t>();
        // SAFETY: readable for its size (short bytes), its size first.
        let r = unsafe { read_plain(p) }.unwrap();
        assert_eq!(r.struct_size as usize, short);
        assert_eq!(r.addr, u64::from_ne_bytes([0xAA; 8]));
        assert_eq!((r.dmabuf_offset, r.share_fd, r.share_offset), (0, 0, 0));
        assert!(!crate::has_field!(
            &r,
            sys::ferry_mem_region_t,
            dmabuf_offset
        ));
        assert!(crate::has_field!(&r, sys::ferry_mem_region_t, flags));
        // SAFETY: null is allowed.
        assert!(unsafe { read_plain::<sys::ferry_mem_region_t>(std::ptr::null()) }.is_none());
    }

    #[test]
    fn a_longer_struct_is_read_to_this_builds_end() {
        // A producer from a later minor version: more bytes than we know.
        let long = std::mem::size_of::<sys::ferry_peer_info_t>() + 64;
        let mut bytes = vec![0u8; long];
        bytes[..4].copy_from_slice(&(long as u32).to_ne_bytes());
        // SAFETY: readable for its size, its size first.
        let p = unsafe { read_plain(bytes.as_ptr().cast::<sys::ferry_peer_info_t>()) }.unwrap();
        assert_eq!(p.struct_size as usize, long);
    }
}
