//! Test-only transport plugin whose probe panics, to prove the SDK stops the
//! panic at the ABI boundary and the host carries on.

use ferry_plugins_abi::sdk::{Host, NoDataPath, PluginResult, ProbeReport, TransportPlugin};
use std::ffi::CStr;

pub struct Panics;

impl TransportPlugin for Panics {
    const NAME: &'static CStr = c"panics";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr = c"test plugin whose probe panics";
    type Instance = NoDataPath;

    fn probe(_host: &Host<'_>, _report: &mut ProbeReport<'_>) -> PluginResult<()> {
        let devices: Vec<u32> = Vec::new();
        if devices.is_empty() {
            panic!("probe exploded on purpose");
        }
        Ok(())
    }
}

ferry_plugins_abi::export_transport_plugin!(Panics, probe_only);
