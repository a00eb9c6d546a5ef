//! The NVIDIA driver as Ferry's CUDA plugins use it: `libcuda.so.1` opened at
//! run time (never linked), its functions resolved one symbol at a time
//! through cuGetProcAddress (`driver`), files checked before a configured
//! library is opened (`elf_check`), and primary contexts made current for
//! the length of a call (`context`).
//!
//! Shared by the cuda device plugin (devices/cuda) and the cuda-ipc
//! transport (transports/cuda-ipc), so both load the driver by the same
//! rules and a process opens it once.

pub mod context;
pub mod driver;
mod elf_check;

pub use context::{Current, PrimaryContext};
pub use driver::Driver;
