//! GPU ordinals without a GPU library: NVIDIA GPUs in PCI bus order (CUDA's
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID`), then `CUDA_VISIBLE_DEVICES` applied as the
//! CUDA driver applies it. The CUDA device plugin later replaces this mapping
//! with the driver's own.
//!
//! - `0,2`: `cuda:0` is the 1st GPU in PCI order, `cuda:1` the 3rd.
//! - `""` or `-1`: no GPU is visible.
//! - The list stops at the first invalid entry (not a number, out of range,
//!   or repeated), as CUDA's does; later entries are ignored with a warning.
//! - `GPU-<uuid>` and `MIG-<...>` entries name GPUs by UUID, which sysfs does
//!   not carry. Guessing would silently bind memory to the wrong NIC, so the
//!   variable is ignored as a whole: every GPU stays visible in PCI order and
//!   a warning names the entry, until the CUDA device plugin maps UUIDs.

/// Which of `gpu_count` PCI-ordered GPUs are visible, in ordinal order.
pub(crate) fn visible_gpu_indices(
    cuda_visible_devices: Option<&str>,
    gpu_count: usize,
    warnings: &mut Vec<String>,
) -> Vec<usize> {
    let Some(value) = cuda_visible_devices else {
        return (0..gpu_count).collect();
    };
    let entries: Vec<&str> = value.split(',').map(str::trim).collect();
    if let Some(uuid) = entries
        .iter()
        .find(|entry| entry.starts_with("GPU-") || entry.starts_with("MIG-"))
    {
        warnings.push(format!(
            "CUDA_VISIBLE_DEVICES names {uuid}: GPU UUIDs cannot be resolved from sysfs, so \
             CUDA_VISIBLE_DEVICES is ignored and cuda:N follows PCI bus order over all {gpu_count} \
             GPU(s); cuda:N may not be the GPU CUDA calls N until the CUDA device plugin maps it"
        ));
        return (0..gpu_count).collect();
    }
    let mut visible = Vec::new();
    for (position, entry) in entries.iter().enumerate() {
        let valid = entry
            .parse::<usize>()
            .ok()
            .filter(|index| *index < gpu_count && !visible.contains(index));
        match valid {
            Some(index) => visible.push(index),
            None => {
                // "" and "-1" are the usual ways of hiding every GPU: no news.
                let hides_all = position == 0 && (entry.is_empty() || *entry == "-1");
                if !hides_all {
                    warnings.push(format!(
                        "CUDA_VISIBLE_DEVICES=\"{value}\": entry \"{entry}\" is not a valid index \
                         for the {gpu_count} GPU(s) in sysfs (or repeats one); like CUDA, \
                         Ferry ignores it and every entry after it"
                    ));
                }
                break;
            }
        }
    }
    visible
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(value: Option<&str>, count: usize) -> (Vec<usize>, Vec<String>) {
        let mut warnings = Vec::new();
        let indices = visible_gpu_indices(value, count, &mut warnings);
        (indices, warnings)
    }

    #[test]
    fn follows_cuda_semantics() {
        assert_eq!(visible(None, 3).0, [0, 1, 2]);
        assert_eq!(visible(Some("0,2"), 3), (vec![0, 2], vec![]));
        assert_eq!(visible(Some("2, 0"), 3).0, [2, 0]);
        assert_eq!(visible(Some(""), 3), (vec![], vec![]));
        assert_eq!(visible(Some("-1"), 3), (vec![], vec![]));
        let (indices, warnings) = visible(Some("1,7,0"), 3);
        assert_eq!(indices, [1]);
        assert!(warnings[0].contains("\"7\""), "{warnings:?}");
        assert_eq!(visible(Some("1,x,0"), 3).0, [1]);
        assert_eq!(visible(Some("1,1,0"), 3).0, [1]);
        assert_eq!(visible(Some("0,-1,1"), 3).0, [0]);
    }

    #[test]
    fn uuids_keep_pci_order_and_warn() {
        let (indices, warnings) = visible(Some("GPU-8a3e4c1d-0000-1111-2222-333344445555,0"), 2);
        assert_eq!(indices, [0, 1]);
        assert!(warnings[0].contains("GPU-8a3e4c1d"), "{warnings:?}");
        let (indices, warnings) = visible(Some("1,MIG-abc"), 2);
        assert_eq!(indices, [0, 1]);
        assert!(warnings[0].contains("MIG-abc"));
    }
}
