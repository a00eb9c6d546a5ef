//! Why a metadata call failed: Ferry's one error type (a code from the
//! shared list and a message an operator can act on), which the engine
//! passes on unchanged.

pub use ferry_plugins_abi::{Error, ErrorCode, Result};
