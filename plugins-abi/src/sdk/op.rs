//! The direction of a transfer, as requests and block lists carry it.

/// `Read`: the peer's memory into local memory; `Write`: the other way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}
