//! The NVIDIA driver as Ferry's CUDA plugins use it: `libcuda.so.1` opened at
//! run time (never linked), its functions resolved one symbol at a time
//! through cuGetProcAddress (`driver`), files checked before a configured
//! library is opened (`elf_check`), and primary contexts made current for
//! the length of a call (`context`); lists of copies on one stream, by one
//! launch of Ferry's scattered-copy kernel (`kernel`, PTX from
//! kernels/copy.cu) or by the driver's batched or single copies (`batch`).
//!
//! Shared by the cuda device plugin (devices/cuda) and the cuda-ipc
//! transport (transports/cuda-ipc), so both load the driver by the same
//! rules and a process opens it once.

pub mod batch;
pub mod context;
pub mod driver;
mod elf_check;
pub mod kernel;
pub mod method;

pub use context::{Current, PrimaryContext};
pub use driver::Driver;
