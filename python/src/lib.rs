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

mod addrs;
mod buffer;
mod engine;
mod errors;

use errors::{ferry_err, FerryError};

/// What `ferry info` prints, as (text, JSON): the one report of
/// `ferry_core::info::report`, as the CLI and the C API give it. A FERRY_*
/// value that is rejected raises FerryError with the reason.
#[pyfunction]
fn info_report(py: Python<'_>) -> PyResult<(String, String)> {
    py.detach(|| {
        let report = ferry_core::info::report_from_env(false)?;
        let json = report.to_json_text(false)?;
        Ok((report.render_text(), json))
    })
    .map_err(|e| ferry_err(py, e))
}

/// The settings an engine would start with: the FERRY_* variables, then
/// `options` (keys of EngineConfig, plugin settings) on top, as
/// (key, value) pairs; a value a key does not accept raises FerryError
/// (INVALID_ARGUMENT) with the reason, as `NativeEngine` would.
#[pyfunction]
fn effective_config(
    py: Python<'_>,
    options: Vec<(String, String)>,
) -> PyResult<Vec<(String, String)>> {
    let config = (|| -> Result<_, ferry_core::Error> {
        let mut config = ferry_core::EngineConfig::from_env()?;
        for (k, v) in &options {
            config.set(k, v)?;
        }
        Ok(config)
    })()
    .map_err(|e| ferry_err(py, e))?;
    Ok(config.effective().into_iter().collect())
}

/// `values` as a list of ints: a list or tuple of integers (ints or
/// objects with `__index__`) or a 1-D array of 8-byte integers, by the one
/// rule every address and length list follows (`addrs::AddrList`); a
/// TypeError or OverflowError says which item is wrong.
/// The token an engine started with these options (over the FERRY_*
/// variables) authenticates with, as its text; None with FERRY_AUTH=off.
/// With none configured it is this user's token file, read and checked
/// (owner, mode, no symbolic link) exactly as an engine reads it: the
/// refusal, if any, is the error.
#[pyfunction]
fn cluster_token(py: Python<'_>, options: Vec<(String, String)>) -> PyResult<Option<String>> {
    py.detach(|| -> ferry_core::Result<Option<String>> {
        let mut config = ferry_core::EngineConfig::from_env()?;
        for (k, v) in &options {
            config.set(k, v)?;
        }
        Ok(match (&config.auth_token, config.auth_off) {
            (Some(t), _) => Some(t.expose()),
            (None, true) => None,
            (None, false) => Some(ferry_core::user_token::load_or_create()?.0.expose()),
        })
    })
    .map_err(|e| ferry_err(py, e))
}

#[pyfunction]
fn int_list(values: addrs::AddrList) -> Vec<u64> {
    values.0
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
/// exists) per entry, for the settings of the environment.
#[pyfunction]
fn plugin_search_path(py: Python<'_>) -> PyResult<Vec<(String, String, bool)>> {
    let config = ferry_core::EngineConfig::from_env().map_err(|e| ferry_err(py, e))?;
    Ok(config
        .loader
        .search_path()
        .into_iter()
        .map(|e| {
            (
                e.path.display().to_string(),
                e.origin.as_str().to_string(),
                e.exists,
            )
        })
        .collect())
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
    m.add_function(wrap_pyfunction!(int_list, m)?)?;
    m.add_function(wrap_pyfunction!(cluster_token, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_search_path, m)?)?;
    m.add_function(wrap_pyfunction!(effective_config, m)?)?;
    Ok(())
}
