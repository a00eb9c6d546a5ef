//! Errors that stop topology discovery. Only two things do: a sysfs root that
//! cannot be used at all, and a bad topology file. Everything else that sysfs
//! may lack or garble degrades discovery and is recorded as a warning.

use std::fmt;
use std::io;
use std::path::PathBuf;

use super::config::{ENV_SYSFS_ROOT, ENV_TOPOLOGY_FILE};

/// Why topology discovery failed; the message names the path and the fix.
#[derive(Debug)]
#[non_exhaustive]
pub enum TopologyError {
    /// The sysfs root does not exist, is not a directory or cannot be listed.
    UnusableSysfsRoot { root: PathBuf, reason: String },
    /// The topology file could not be read.
    TopologyFileUnreadable { path: PathBuf, source: io::Error },
    /// The topology file is not valid JSON, or a value has the wrong type.
    TopologyFileSyntax {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    /// The topology file is well-formed but says something impossible
    /// (a pin naming an unknown NIC, a malformed PCI address, ...).
    TopologyFileInvalid { path: PathBuf, message: String },
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopologyError::UnusableSysfsRoot { root, reason } => write!(
                f,
                "sysfs root {} is unusable: {reason} (set {ENV_SYSFS_ROOT} to a sysfs tree, or unset it for /sys)",
                root.display()
            ),
            TopologyError::TopologyFileUnreadable { path, source } => write!(
                f,
                "cannot read topology file {} (from {ENV_TOPOLOGY_FILE}): {source}",
                path.display()
            ),
            TopologyError::TopologyFileSyntax {
                path,
                line,
                column,
                message,
            } => write!(
                f,
                "topology file {} (from {ENV_TOPOLOGY_FILE}), line {line} column {column}: {message}",
                path.display()
            ),
            TopologyError::TopologyFileInvalid { path, message } => write!(
                f,
                "topology file {} (from {ENV_TOPOLOGY_FILE}): {message}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for TopologyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TopologyError::TopologyFileUnreadable { source, .. } => Some(source),
            _ => None,
        }
    }
}
