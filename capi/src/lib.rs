//! libferry: Ferry's C API (`include/ferry.h`, generated from this crate by
//! cbindgen and checked in; a test fails when they drift).
//!
//! Conventions, after rustls-ffi:
//! - every fallible function returns a `ferry_status_t` (FERRY_OK or a
//!   negative FERRY_ERR_* code, the same codes as ferry/plugin.h) and, on
//!   failure, leaves a message for `ferry_last_error()` on the calling thread;
//! - every exported body runs inside [`ffi_boundary!`], so a panic becomes
//!   FERRY_ERR_PANIC instead of unwinding into C;
//! - null pointers are checked and reported, never dereferenced;
//! - opaque handles come in `_new` / `_free` pairs; `_free(NULL)` is a no-op.
//!
//! One file per part of the API: `types` (what C sees), `boundary` (the
//! last error, status codes, argument checks), `config`, `engine` (memory
//! and segments), `batch`, `blocks` (layouts, transfers by block index),
//! `notify`, `info`.

#![allow(non_camel_case_types)]

// In the order include/ferry.h lists them (cbindgen reads the modules in
// the order they are declared).
mod types;

#[macro_use]
mod boundary;

mod config;

mod engine;

mod batch;

mod blocks;

mod notify;

mod info;
