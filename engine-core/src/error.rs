//! The engine's error: one code from the shared list plus a message an
//! operator can act on.

pub use ferry_plugins_abi::ErrorCode;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: ErrorCode,
    pub message: String,
}

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.message, self.code.name())
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<ferry_metadata::Error> for Error {
    fn from(e: ferry_metadata::Error) -> Error {
        Error::new(e.code, e.message)
    }
}
