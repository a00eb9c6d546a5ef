//! Ferry's plugin ABI, version 1, and the SDK for plugins written in Rust.
//!
//! The contract is the C header `include/ferry/plugin.h`; [`sys`] mirrors it
//! field by field (a test compares the layouts with the C compiler's), and
//! [`status::ErrorCode`] is the one list of error codes the whole project
//! shares. [`sdk`] lets a Rust plugin implement a safe trait and export it
//! with one macro: no `unsafe` entry code, no panic across the boundary.
//!
//! This crate is the bottom layer: it depends on nothing else in Ferry.

pub mod caps;
mod error;
pub mod sdk;
pub mod status;
pub mod sys;
pub mod versioned;

pub use error::{Error, Result};
pub use status::ErrorCode;

/// Path of the checked-in C header, for tests and packaging.
pub const HEADER_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/include/ferry/plugin.h");

/// The ABI version this build of Ferry speaks, as "major.minor".
pub fn abi_version() -> String {
    format!(
        "{}.{}",
        sys::FERRY_PLUGIN_ABI_MAJOR,
        sys::FERRY_PLUGIN_ABI_MINOR
    )
}
