//! Ferry's CUDA device plugin (`libferry_device_cuda.so`): tells the engine
//! which GPUs this process sees (ordinal, PCI bus id, GPUDirect RDMA and
//! DMA-BUF support), classifies pointers, exports device memory as DMA-BUF,
//! allocates pinned and device memory and runs copies for staging.
//!
//! The NVIDIA driver is loaded at run time (`libcuda.so.1`, never linked),
//! so one build runs on hosts with and without GPUs: without a driver,
//! probe says "unavailable" with the reason and nothing else happens.
//! The driver's symbol table, loading rules and contexts live in
//! `ferry-cuda-driver` (shared with the cuda-ipc transport); `instance`
//! holds the devices and the data path.
//!
//! Settings (engine configuration key, then environment variable):
//! - `cuda.library` / `FERRY_CUDA_LIBRARY`: the driver library to open
//!   instead of `libcuda.so.1` (default: unset, the dynamic loader's search).
//!   A path is checked (a complete ELF shared object for this machine)
//!   before it is opened. For tests and unusual installs.
//!
//! Probe calls cuInit (which starts the driver's own threads; a process that
//! has called it must not use CUDA in a fork()ed child) and only device
//! queries: it creates no context and allocates nothing.

mod bounce;
mod instance;
mod lists;
#[cfg(test)]
mod tests;

use ferry_cuda_driver::driver::{self, Driver};
use ferry_plugins_abi::sdk::{DeviceInfo, Host, PluginResult, ProbeDevice, ProbeReport};
use ferry_plugins_abi::sys;
use instance::{describe_all, CudaInstance, DeviceFacts};
use std::ffi::CStr;

pub struct CudaPlugin;

/// The setting naming another driver library (FERRY_CUDA_LIBRARY).
const LIBRARY_KEY: &str = "cuda.library";

/// Opens, initialises and checks the driver: every failure is a clean
/// "unavailable" with the reason.
fn open_driver(host: &Host<'_>) -> PluginResult<&'static Driver> {
    let configured = host
        .config(LIBRARY_KEY)
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let driver = driver::open(configured.as_deref())?;
    driver.init()?;
    driver.require_all()?;
    Ok(driver)
}

/// The FERRY_MEM_* kinds a device can serve.
fn mem_kinds(info: &DeviceInfo) -> u64 {
    let mut kinds = sys::FERRY_MEM_CUDA_STAGED;
    if info.dmabuf == Some(true) && info.dmabuf_export {
        kinds |= sys::FERRY_MEM_CUDA_DMABUF;
    }
    if info.gpu_direct_rdma == Some(true) {
        kinds |= sys::FERRY_MEM_CUDA_PEERMEM;
    }
    kinds
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown to this driver",
    }
}

/// "NVIDIA H200, 140.4 GiB, compute 9.0, GPUDirect RDMA (attribute 116):
/// yes, DMA-BUF (attribute 124): yes, driver CUDA 13.0, GPU-..."
fn detail(facts: &DeviceFacts, driver_version: Option<i32>) -> String {
    let info = &facts.info;
    let mut s = format!(
        "{}, {:.1} GiB",
        info.name,
        info.total_memory as f64 / (1u64 << 30) as f64
    );
    if let Some((major, minor)) = facts.compute {
        s.push_str(&format!(", compute {major}.{minor}"));
    }
    s.push_str(&format!(
        ", GPUDirect RDMA (attribute 116): {}, DMA-BUF (attribute 124): {}",
        yes_no(info.gpu_direct_rdma),
        yes_no(info.dmabuf)
    ));
    if let Some(v) = driver_version {
        s.push_str(&format!(", driver CUDA {}", driver::cuda_version_text(v)));
    }
    if !info.uuid.is_empty() {
        s.push_str(&format!(", {}", info.uuid));
    }
    s
}

/// The NUMA node sysfs gives the GPU's PCI function, if any.
fn numa_node(pci_bus_id: &str) -> Option<u32> {
    let text =
        std::fs::read_to_string(format!("/sys/bus/pci/devices/{pci_bus_id}/numa_node")).ok()?;
    u32::try_from(text.trim().parse::<i32>().ok()?).ok()
}

fn names(devices: &[&DeviceFacts]) -> String {
    devices
        .iter()
        .map(|d| format!("cuda:{}", d.info.ordinal))
        .collect::<Vec<_>>()
        .join(", ")
}

impl ferry_plugins_abi::sdk::DevicePlugin for CudaPlugin {
    const NAME: &'static CStr = c"cuda";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr =
        c"NVIDIA GPUs through the CUDA driver (libcuda.so.1, loaded at run time)";
    type Instance = CudaInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        let driver = open_driver(host)?;
        let devices = describe_all(driver)?;
        let version = driver.version();

        let mut all_kinds = 0;
        for facts in &devices {
            let kinds = mem_kinds(&facts.info);
            all_kinds |= kinds;
            report.add_device(&ProbeDevice {
                name: &format!("cuda:{}", facts.info.ordinal),
                pci_bus_id: Some(&facts.info.pci_bus_id),
                numa_node: numa_node(&facts.info.pci_bus_id),
                detail: Some(&detail(facts, version)),
                mem_kinds: kinds,
                gpu: Some(&facts.info),
                ..Default::default()
            });
        }
        // A device plugin owns memory; it reaches no peers itself.
        report.set_capabilities(all_kinds, 0);

        let version_text = version.map_or_else(
            || "unknown".to_string(),
            |v| {
                format!(
                    "CUDA {} (cuDriverGetVersion {v})",
                    driver::cuda_version_text(v)
                )
            },
        );
        report.add_note("driver", &version_text);
        report.add_note("library", &driver.describe_library());
        report.add_note("visible devices", &driver::visible_devices());
        match lists::CopySetting::parse(
            instance::COPY_KEY,
            host.config(instance::COPY_KEY).as_deref(),
        ) {
            Ok(copy) => report.add_note("staging lists", &lists::describe(driver, copy)),
            Err(e) => report.add_note("staging lists", &format!("{} (init refuses it)", e.message)),
        }

        let without_dmabuf: Vec<&DeviceFacts> = devices
            .iter()
            .filter(|d| d.info.dmabuf != Some(true))
            .collect();
        if !driver.can_export_dmabuf() {
            report.add_missing(
                "cuda-dmabuf",
                &format!(
                    "{} (driver {version_text}) has no cuMemGetHandleForAddressRange (CUDA 11.7, \
                     driver R515 or newer): GPU memory cannot be exported as DMA-BUF",
                    driver.library
                ),
            );
        } else if !without_dmabuf.is_empty() {
            report.add_missing(
                "cuda-dmabuf",
                &format!(
                    "{} report{} no CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124): the driver cannot \
                     export that memory as DMA-BUF here (it needs NVIDIA's open kernel modules \
                     and Linux 5.12 or newer)",
                    names(&without_dmabuf),
                    if without_dmabuf.len() == 1 { "s" } else { "" }
                ),
            );
        }
        let without_rdma: Vec<&DeviceFacts> = devices
            .iter()
            .filter(|d| d.info.gpu_direct_rdma != Some(true))
            .collect();
        if !without_rdma.is_empty() {
            report.add_missing(
                "cuda-peermem",
                &format!(
                    "{} report{} no CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116): NICs \
                     cannot reach that GPU memory directly; transfers stage through host memory",
                    names(&without_rdma),
                    if without_rdma.len() == 1 { "s" } else { "" }
                ),
            );
        }
        Ok(())
    }

    fn init(host: Host<'static>) -> PluginResult<CudaInstance> {
        let driver = open_driver(&host)?;
        let devices = describe_all(driver)?;
        host.debug(&format!(
            "{} CUDA device(s) through {}",
            devices.len(),
            driver.describe_library()
        ));
        CudaInstance::new(host, driver, devices)
    }
}

ferry_plugins_abi::export_device_plugin!(CudaPlugin);
