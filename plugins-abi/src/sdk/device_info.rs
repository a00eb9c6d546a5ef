//! One device as a device plugin describes it: the same facts from
//! `device_info` and, since ABI 1.6, from probe (`ferry_probe_device_t.gpu`),
//! and their C form both ways.

use crate::sys;
use std::ffi::c_char;

/// One device, as [`DeviceInstance::device_info`](super::DeviceInstance::device_info)
/// and probe describe it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    /// "0000:18:00.0".
    pub pci_bus_id: String,
    pub uuid: String,
    pub total_memory: u64,
    /// GPU_DIRECT_RDMA_SUPPORTED; `None` when the driver cannot say.
    pub gpu_direct_rdma: Option<bool>,
    /// DMA_BUF_SUPPORTED; `None` when the driver cannot say.
    pub dmabuf: Option<bool>,
    /// Whether the driver can export a DMA-BUF fd at all.
    pub dmabuf_export: bool,
}

impl DeviceInfo {
    /// The C form, for the host.
    pub fn to_raw(&self) -> sys::ferry_device_info_t {
        let mut out = sys::ferry_device_info_t {
            struct_size: std::mem::size_of::<sys::ferry_device_info_t>() as u32,
            ordinal: i32::try_from(self.ordinal).unwrap_or(-1),
            name: [0; 96],
            pci_bus_id: [0; 32],
            uuid: [0; 48],
            total_memory: self.total_memory,
            gpu_direct_rdma: tri(self.gpu_direct_rdma),
            dmabuf: tri(self.dmabuf),
            dmabuf_export: i32::from(self.dmabuf_export),
            reserved: 0,
        };
        fill_fixed(&mut out.name, &self.name);
        fill_fixed(&mut out.pci_bus_id, &self.pci_bus_id);
        fill_fixed(&mut out.uuid, &self.uuid);
        out
    }

    /// Writes the facts into the host's struct (its `struct_size` kept).
    pub fn write_raw(&self, out: &mut sys::ferry_device_info_t) {
        let size = out.struct_size;
        *out = self.to_raw();
        out.struct_size = size;
    }

    /// The facts a plugin wrote, as the host reads them: strings up to
    /// their NUL (lossy UTF-8), the PCI id in lower case, anything but 0
    /// or 1 as "cannot say". None for a negative ordinal.
    pub fn from_raw(raw: &sys::ferry_device_info_t) -> Option<DeviceInfo> {
        Some(DeviceInfo {
            ordinal: u32::try_from(raw.ordinal).ok()?,
            name: fixed(&raw.name),
            pci_bus_id: fixed(&raw.pci_bus_id).to_ascii_lowercase(),
            uuid: fixed(&raw.uuid),
            total_memory: raw.total_memory,
            gpu_direct_rdma: from_tri(raw.gpu_direct_rdma),
            dmabuf: from_tri(raw.dmabuf),
            dmabuf_export: raw.dmabuf_export == 1,
        })
    }
}

fn fill_fixed(dst: &mut [c_char], src: &str) {
    let n = src.len().min(dst.len().saturating_sub(1));
    for (d, s) in dst.iter_mut().zip(&src.as_bytes()[..n]) {
        *d = *s as c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}

fn fixed(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn tri(v: Option<bool>) -> i32 {
    match v {
        Some(true) => 1,
        Some(false) => 0,
        None => -1,
    }
}

fn from_tri(v: i32) -> Option<bool> {
    match v {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_survive_their_c_form_and_long_strings_are_cut() {
        let info = DeviceInfo {
            ordinal: 3,
            name: "NVIDIA H200".into(),
            pci_bus_id: "0000:18:00.0".into(),
            uuid: "GPU-1234".into(),
            total_memory: 141 << 30,
            gpu_direct_rdma: Some(true),
            dmabuf: None,
            dmabuf_export: true,
        };
        assert_eq!(DeviceInfo::from_raw(&info.to_raw()), Some(info));
        let long = DeviceInfo {
            name: "x".repeat(500),
            ..Default::default()
        };
        assert_eq!(DeviceInfo::from_raw(&long.to_raw()).unwrap().name.len(), 95);
    }

    #[test]
    fn a_negative_ordinal_or_odd_flags_are_read_safely() {
        let mut raw = DeviceInfo::default().to_raw();
        raw.gpu_direct_rdma = 7;
        raw.dmabuf_export = 2;
        let read = DeviceInfo::from_raw(&raw).unwrap();
        assert_eq!(read.gpu_direct_rdma, None);
        assert!(!read.dmabuf_export);
        raw.ordinal = -1;
        assert_eq!(DeviceInfo::from_raw(&raw), None);
    }
}
