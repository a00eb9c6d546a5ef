//! Where the ferry-probe helper is: found the way plugins are, beside the
//! library or binary that runs Ferry (`<prefix>/lib/ferry/ferry-probe`, next
//! to `<prefix>/lib/ferry/plugins`; in the Python wheel
//! `ferry/lib/ferry/ferry-probe`), else in the development build directory.
//! FERRY_PLUGIN_PROBE_HELPER names another file, or `off`.

use crate::config::{dev_build_dir, HelperChoice};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The helper's file name.
pub const HELPER_NAME: &str = "ferry-probe";

/// The helper to use, or why probes run in this process.
pub(crate) fn locate(choice: &HelperChoice) -> Result<PathBuf, String> {
    match choice {
        HelperChoice::Off => Err("FERRY_PLUGIN_PROBE_HELPER=off".into()),
        HelperChoice::Path(p) => {
            if executable(p) {
                Ok(p.clone())
            } else {
                Err(format!(
                    "FERRY_PLUGIN_PROBE_HELPER={} is not an executable file",
                    p.display()
                ))
            }
        }
        HelperChoice::Auto => {
            let places = default_places();
            if let Some(found) = places.iter().find(|p| executable(p)) {
                return Ok(found.clone());
            }
            Err(if places.is_empty() {
                "cannot tell where Ferry is installed, so no ferry-probe helper was found".into()
            } else {
                format!(
                    "no {HELPER_NAME} helper at {}",
                    places
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(" or ")
                )
            })
        }
    }
}

/// `<prefix>/lib/ferry/ferry-probe`, then `<dev build dir>/ferry-probe`.
fn default_places() -> Vec<PathBuf> {
    let Some(object) = crate::self_location::containing_object() else {
        return Vec::new();
    };
    let Some(dir) = object.parent() else {
        return Vec::new();
    };
    let prefix = dir.parent().unwrap_or(dir);
    let mut places = vec![prefix.join("lib/ferry").join(HELPER_NAME)];
    if let Some(dev) = dev_build_dir(dir) {
        places.push(dev.join(HELPER_NAME));
    }
    places
}

fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
