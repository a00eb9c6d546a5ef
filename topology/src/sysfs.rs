//! Reads under a sysfs root that may be a fake tree: every path is resolved
//! with realpath and must stay inside the root, reads are bounded and never
//! block, and anything missing or garbled reads as "absent" rather than as an
//! error. Paths handed around are relative to the (canonical) root.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::error::TopologyError;

/// Sysfs attributes are at most a page; anything longer is not an attribute.
const MAX_ATTRIBUTE_BYTES: u64 = 64 * 1024;

/// Where a path under the root leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// Inside the root: the canonical path, relative to the root.
    Inside(PathBuf),
    /// A symlink led outside the root: the canonical target.
    Outside(PathBuf),
    /// Nothing there (or a dangling or looping link).
    Missing,
}

#[derive(Debug)]
pub(crate) struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    /// Opens `root`, which must be a listable directory.
    pub(crate) fn open(root: &Path) -> Result<Self, TopologyError> {
        let unusable = |reason: String| TopologyError::UnusableSysfsRoot {
            root: root.to_path_buf(),
            reason,
        };
        let canonical = fs::canonicalize(root).map_err(|error| unusable(error.to_string()))?;
        if !canonical.is_dir() {
            return Err(unusable("not a directory".to_string()));
        }
        fs::read_dir(&canonical).map_err(|error| unusable(format!("cannot list it: {error}")))?;
        Ok(Sysfs { root: canonical })
    }

    /// The canonical root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Shows a root-relative path the way an operator would look for it.
    pub(crate) fn show(&self, relative: &Path) -> String {
        self.root.join(relative).display().to_string()
    }

    /// Resolves every symlink in `relative` and checks the result stays inside
    /// the root (real sysfs links are relative and never leave /sys).
    pub(crate) fn resolve(&self, relative: &Path) -> Resolved {
        match fs::canonicalize(self.root.join(relative)) {
            Ok(canonical) => match canonical.strip_prefix(&self.root) {
                Ok(inside) => Resolved::Inside(inside.to_path_buf()),
                Err(_) => Resolved::Outside(canonical),
            },
            Err(error) => {
                log::debug!("sysfs: {} unresolvable: {error}", self.show(relative));
                Resolved::Missing
            }
        }
    }

    /// The names in a directory, sorted; empty when it is missing, unreadable
    /// or resolves outside the root. Names that are not UTF-8 are skipped:
    /// no kernel object Ferry cares about has one.
    pub(crate) fn list(&self, relative: &Path) -> Vec<String> {
        let Resolved::Inside(directory) = self.resolve(relative) else {
            return Vec::new();
        };
        let entries = match fs::read_dir(self.root.join(&directory)) {
            Ok(entries) => entries,
            Err(error) => {
                log::debug!("sysfs: cannot list {}: {error}", self.show(relative));
                return Vec::new();
            }
        };
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .filter_map(|entry| entry.file_name().into_string().ok())
            .collect();
        names.sort();
        names
    }

    /// The trimmed text of an attribute file, with control characters
    /// replaced; `None` when it is missing, unreadable, outside the root, not
    /// a regular file, empty, or longer than an attribute can be.
    pub(crate) fn read_attribute(&self, relative: &Path) -> Option<String> {
        let Resolved::Inside(file) = self.resolve(relative) else {
            return None;
        };
        let path = self.root.join(file);
        let text = match read_bounded(&path) {
            Ok(Some(text)) => text,
            Ok(None) => return None,
            Err(error) => {
                // Some attributes refuse reads in some states (a link-down
                // NIC's `speed` answers EINVAL): that is "unknown", not a fault.
                log::debug!("sysfs: cannot read {}: {error}", path.display());
                return None;
            }
        };
        let cleaned: String = text
            .trim()
            .chars()
            .map(|c| if c.is_control() && c != '\n' { '?' } else { c })
            .collect();
        (!cleaned.is_empty()).then_some(cleaned)
    }
}

/// Reads a regular file of at most [`MAX_ATTRIBUTE_BYTES`]. Opening with
/// O_NONBLOCK keeps a FIFO planted in a fake tree from hanging discovery; it
/// changes nothing for regular files.
fn read_bounded(path: &Path) -> std::io::Result<Option<String>> {
    let file: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(MAX_ATTRIBUTE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_ATTRIBUTE_BYTES {
        return Ok(None);
    }
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// Parses a hex attribute such as `0x10de`.
pub(crate) fn parse_hex(text: &str) -> Option<u32> {
    let digits = text.trim().strip_prefix("0x").unwrap_or(text.trim());
    u32::from_str_radix(digits, 16).ok()
}

/// Parses a decimal attribute such as `numa_node` (`-1` included).
pub(crate) fn parse_decimal(text: &str) -> Option<i64> {
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hex_and_decimal_defensively() {
        assert_eq!(parse_hex("0x10de"), Some(0x10de));
        assert_eq!(parse_hex("0x030200"), Some(0x030200));
        assert_eq!(parse_hex("10de"), Some(0x10de));
        assert_eq!(parse_hex("0xZZ"), None);
        assert_eq!(parse_hex(""), None);
        assert_eq!(parse_decimal("-1"), Some(-1));
        assert_eq!(parse_decimal("1\n"), Some(1));
        assert_eq!(parse_decimal("one"), None);
    }

    #[test]
    fn refuses_paths_leaving_the_root_and_odd_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        fs::create_dir_all(root.join("a")).expect("mkdir");
        fs::create_dir_all(dir.path().join("outside")).expect("mkdir");
        fs::write(dir.path().join("outside/vendor"), "0x10de\n").expect("write");
        fs::write(root.join("a/vendor"), "  0x15b3\n").expect("write");
        std::os::unix::fs::symlink("../../outside", root.join("a/escape")).expect("symlink");
        // A FIFO would block a plain open(); coreutils' mkfifo keeps this test free of unsafe.
        let made_fifo = std::process::Command::new("mkfifo")
            .arg(root.join("a/fifo"))
            .status()
            .is_ok_and(|status| status.success());

        let sysfs = Sysfs::open(&root).expect("root");
        assert_eq!(
            sysfs.read_attribute(Path::new("a/vendor")).as_deref(),
            Some("0x15b3")
        );
        assert_eq!(sysfs.read_attribute(Path::new("a/escape/vendor")), None);
        assert!(matches!(
            sysfs.resolve(Path::new("a/escape")),
            Resolved::Outside(_)
        ));
        if made_fifo {
            assert_eq!(sysfs.read_attribute(Path::new("a/fifo")), None);
        }
        assert_eq!(sysfs.read_attribute(Path::new("a/missing")), None);
        assert_eq!(sysfs.list(Path::new("a/escape")), Vec::<String>::new());
        assert!(Sysfs::open(&root.join("a/vendor")).is_err());
        assert!(Sysfs::open(&dir.path().join("nope")).is_err());
    }
}
