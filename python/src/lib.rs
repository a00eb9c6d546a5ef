//! `ferry.lib._ferry`: the native half of Ferry's Python package.
//!
//! Thin on purpose: an engine handle whose every blocking call releases the
//! GIL, a buffer-protocol view that keeps an exported buffer pinned while it
//! is registered, `info()`, and one exception type carrying Ferry's error
//! code and message. The Pythonic API and the Mooncake-compatible
//! `TransferEngine` are Python code in python/ferry/ on top of this.
//!
//! Plugins are found with no environment variable: this module is
//! `<pkg>/lib/_ferry.abi3.so` and the wheel ships the plugins in
//! `<pkg>/lib/ferry/plugins`, which is the loader's "beside the library"
//! directory (`<dir of the library>/../lib/ferry/plugins`), the same rule
//! that serves the tarball's `<prefix>/lib/libferry.so`.

use pyo3::prelude::*;

mod buffer;
mod engine;
mod errors;

use errors::{ferry_err, FerryError};

/// What `ferry info` prints, as (text, JSON): the plugin search path, every
/// plugin with its state and reason, GPUs and their registration decision.
#[pyfunction]
fn info_report(py: Python<'_>) -> PyResult<(String, String)> {
    py.detach(|| {
        let topology = ferry_core::topology::Topology::discover(
            &ferry_core::topology::TopologyConfig::from_env(),
        )
        .ok()
        .map(std::sync::Arc::new);
        let set = ferry_core::load_plugins(
            &ferry_core::loader::LoaderConfig::from_env(),
            ferry_core::host::CoreHost::new(Default::default(), topology.clone()),
        );
        let report =
            ferry_core::info::InfoReport::from_plugins(&set).with_gpus(&set, topology.as_deref());
        let json = report.to_json_text(false)?;
        Ok((report.render_text(), json))
    })
    .map_err(|e| ferry_err(py, e))
}

/// Ferry's error codes: (code, name) pairs.
#[pyfunction]
fn error_codes() -> Vec<(i32, &'static str)> {
    ferry_core::ErrorCode::ALL
        .iter()
        .map(|c| (c.as_raw(), c.name()))
        .collect()
}

/// The search path the loader would use from this module: (path, origin,
/// exists) per entry.
#[pyfunction]
fn plugin_search_path() -> Vec<(String, String, bool)> {
    ferry_core::loader::LoaderConfig::from_env()
        .search_path()
        .into_iter()
        .map(|e| {
            (
                e.path.display().to_string(),
                e.origin.as_str().to_string(),
                e.exists,
            )
        })
        .collect()
}

#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    ferry_core::init_logging();
    m.add("__version__", ferry_core::info::FERRY_VERSION)?;
    m.add("FerryError", m.py().get_type::<FerryError>())?;
    m.add_class::<engine::NativeEngine>()?;
    m.add_class::<buffer::BufferView>()?;
    m.add_function(wrap_pyfunction!(info_report, m)?)?;
    m.add_function(wrap_pyfunction!(error_codes, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_search_path, m)?)?;
    Ok(())
}
