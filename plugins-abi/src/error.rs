//! A failure anywhere in Ferry above the plugin boundary: one code from the
//! shared list ([`ErrorCode`]) and a message an operator can act on. The
//! engine, the metadata store and the front ends return this one type, so
//! an error keeps its code and words on its way up.

use crate::status::ErrorCode;
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
