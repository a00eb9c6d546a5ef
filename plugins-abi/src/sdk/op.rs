//! The direction of a transfer, as requests and block lists carry it.

use super::boundary::PluginError;
use crate::status::ErrorCode;
use crate::sys;

/// `Read`: the peer's memory into local memory; `Write`: the other way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    /// The operation behind `FERRY_OP_*`, or an error naming the value.
    pub fn from_raw(op: u32) -> Result<Op, PluginError> {
        match op {
            sys::FERRY_OP_READ => Ok(Op::Read),
            sys::FERRY_OP_WRITE => Ok(Op::Write),
            other => Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!("unknown operation {other}"),
            )),
        }
    }
}
