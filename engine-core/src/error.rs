//! The engine's error: Ferry's one error type, a code from the shared list
//! plus a message an operator can act on (the metadata store returns the
//! same type).

pub use ferry_plugins_abi::{Error, ErrorCode, Result};
