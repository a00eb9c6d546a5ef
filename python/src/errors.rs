//! Ferry's one Python exception type, `FerryError`, carrying Ferry's error
//! code, its name and the message.

use pyo3::prelude::*;

pyo3::create_exception!(
    ferry,
    FerryError,
    pyo3::exceptions::PyException,
    "A Ferry operation failed. `code` is Ferry's (negative) error code, `name` its \
     name (e.g. \"NOT_FOUND\"), `message` what happened; str() gives both."
);

/// A Ferry error as a Python exception with `code`, `name` and `message`.
pub(crate) fn ferry_err(py: Python<'_>, e: ferry_core::Error) -> PyErr {
    let err = FerryError::new_err(e.to_string());
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail short of
    // running out of memory, which the raise itself would then report.
    let _ = value.setattr("code", e.code.as_raw());
    let _ = value.setattr("name", e.code.name());
    let _ = value.setattr("message", e.message);
    err
}

/// A FerryError for a wrong argument, raised before the engine is asked.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    ferry_err(
        py,
        ferry_core::Error::new(ferry_core::ErrorCode::InvalidArgument, message),
    )
}
