//! Names for the capability bits of `plugin.h`, as `ferry info` prints them.

use crate::sys;

const MEM_NAMES: [(u64, &str); 5] = [
    (sys::FERRY_MEM_HOST, "host"),
    (sys::FERRY_MEM_CUDA_STAGED, "cuda-staged"),
    (sys::FERRY_MEM_CUDA_DMABUF, "cuda-dmabuf"),
    (sys::FERRY_MEM_CUDA_PEERMEM, "cuda-peermem"),
    (sys::FERRY_MEM_CUDA_IPC, "cuda-ipc"),
];

const SCOPE_NAMES: [(u32, &str); 3] = [
    (sys::FERRY_SCOPE_SAME_PROCESS, "same-process"),
    (sys::FERRY_SCOPE_SAME_HOST, "same-host"),
    (sys::FERRY_SCOPE_CROSS_HOST, "cross-host"),
];

/// The names of the `FERRY_MEM_*` bits set in `bits`; unknown bits (from a
/// newer plugin) are shown as `bit<N>`.
pub fn mem_kind_names(bits: u64) -> Vec<String> {
    let mut names: Vec<String> = MEM_NAMES
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, n)| (*n).to_string())
        .collect();
    let known = MEM_NAMES.iter().fold(0, |acc, (b, _)| acc | b);
    for i in 0..64 {
        if bits & !known & (1u64 << i) != 0 {
            names.push(format!("bit{i}"));
        }
    }
    names
}

/// The names of the `FERRY_SCOPE_*` bits set in `bits`.
pub fn scope_names(bits: u32) -> Vec<String> {
    let mut names: Vec<String> = SCOPE_NAMES
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, n)| (*n).to_string())
        .collect();
    let known = SCOPE_NAMES.iter().fold(0, |acc, (b, _)| acc | b);
    for i in 0..32 {
        if bits & !known & (1u32 << i) != 0 {
            names.push(format!("bit{i}"));
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_known_and_unknown_bits() {
        assert_eq!(
            mem_kind_names(sys::FERRY_MEM_HOST | (1 << 40)),
            vec!["host", "bit40"]
        );
        assert_eq!(
            scope_names(sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST),
            vec!["same-host", "cross-host"]
        );
    }
}
