//! Lists between pinned host memory and device memory, across PCIe by the
//! copy engines rather than by the copy kernel's own loads and stores.
//!
//! The kernel reaches mapped pinned memory, but its loads and stores cross
//! PCIe a few hundred bytes at a time: on an H200 it gathered staging's
//! 4 MiB runs of 16 KiB blocks into a pinned slot at 20 GB/s and scattered
//! them out of one at 13.5 GB/s, where one cuMemcpyAsync moves 54 GB/s. So
//! a list whose one side is all pinned host memory, close together, goes
//! through device scratch of its stream: a scatter copies the host span
//! into scratch in one DMA and the kernel moves it on inside the GPU; a
//! gather runs the kernel into scratch and one DMA per run of adjacent
//! destinations brings it out (bytes between destinations are never
//! written). `plan` is pure; `Scratch` is the stream's device memory.

use ferry_cuda_driver::driver::{CUdeviceptr, CUstream, Driver};
use ferry_cuda_driver::kernel::Desc;
use ferry_plugins_abi::sdk::PluginResult;

/// Lists smaller than this go to the kernel directly: a DMA more costs
/// microseconds that a small list does not win back.
pub(crate) const MIN_BYTES: u64 = 256 << 10;
/// The largest host span a list bounces through (the staging protocol's
/// largest slot).
pub(crate) const MAX_SPAN: u64 = 64 << 20;
/// A gather bounces out in at most this many runs of adjacent destinations.
const MAX_RUNS: usize = 16;

/// How a list crosses PCIe through scratch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Bounce {
    /// Every source is host memory in [start, start + len), every
    /// destination device memory: the span goes to scratch in one copy.
    In { start: u64, len: u64 },
    /// Every destination is host memory in [start, start + len), every
    /// source device memory: the kernel fills scratch at the destinations'
    /// offsets, one copy per run (address, length) brings it out.
    Out {
        start: u64,
        len: u64,
        runs: Vec<(u64, u64)>,
    },
}

impl Bounce {
    /// Bytes of scratch it needs.
    pub(crate) fn span(&self) -> u64 {
        match self {
            Bounce::In { len, .. } | Bounce::Out { len, .. } => *len,
        }
    }

    /// The list as the kernel moves it: the host ends rebased onto
    /// `scratch`.
    pub(crate) fn rebase(&self, descs: &[Desc], scratch: CUdeviceptr) -> Vec<Desc> {
        descs
            .iter()
            .map(|c| match self {
                Bounce::In { start, .. } => Desc {
                    src: scratch + (c.src - start),
                    ..*c
                },
                Bounce::Out { start, .. } => Desc {
                    dst: scratch + (c.dst - start),
                    ..*c
                },
            })
            .collect()
    }
}

/// How many sources and how many destinations of a list are pinned host
/// memory (the rest device memory), as the caller found while checking
/// that the kernel reaches every end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostEnds {
    pub(crate) src: usize,
    pub(crate) dst: usize,
}

/// Whether `descs` bounces, and how. `ends`: which of its ends are host
/// memory; `is_host(addr, len)`: the range lies inside one allocation of
/// pinned host memory the driver maps, asked of the span and the runs
/// only. None for a small list, a mixed one, a host span over MAX_SPAN or
/// more than twice the list's bytes, a span across allocations, or a
/// gather of more than MAX_RUNS runs.
pub(crate) fn plan(
    descs: &[Desc],
    ends: HostEnds,
    is_host: impl Fn(u64, u64) -> bool,
) -> Option<Bounce> {
    let bytes = descs.iter().map(|c| c.len).fold(0, u64::saturating_add);
    if bytes < MIN_BYTES {
        return None;
    }
    let inward = match (ends.src, ends.dst) {
        (n, 0) if n == descs.len() => true,
        (0, n) if n == descs.len() => false,
        _ => return None,
    };
    let end = if inward {
        |c: &Desc| c.src
    } else {
        |c: &Desc| c.dst
    };
    let start = descs.iter().map(end).min()?;
    let stop = descs.iter().map(|c| end(c) + c.len).max()?;
    let len = stop - start;
    if len > MAX_SPAN || len / 2 > bytes {
        return None;
    }
    if inward {
        // The one copy reads the whole span: it must be one allocation.
        return is_host(start, len).then_some(Bounce::In { start, len });
    }
    let runs = runs(descs.iter().map(|c| (c.dst, c.len)))?;
    runs.iter()
        .all(|&(a, n)| is_host(a, n))
        .then_some(Bounce::Out { start, len, runs })
}

/// Ranges merged where they touch or overlap, in address order; None past
/// MAX_RUNS.
fn runs(ranges: impl Iterator<Item = (u64, u64)>) -> Option<Vec<(u64, u64)>> {
    let mut sorted: Vec<(u64, u64)> = ranges.collect();
    sorted.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (addr, len) in sorted {
        match runs.last_mut() {
            Some((a, n)) if addr <= *a + *n => *n = (*n).max(addr + len - *a),
            _ => {
                if runs.len() == MAX_RUNS {
                    return None;
                }
                runs.push((addr, len));
            }
        }
    }
    Some(runs)
}

/// Device memory one stream keeps for bounced lists, grown on demand and
/// freed with the stream.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    ptr: CUdeviceptr,
    len: u64,
}

impl Scratch {
    /// At least `len` bytes (rounded up to a power of two, 4 MiB at
    /// least). Growing first waits for `stream`, whose queued lists may
    /// still use the old memory.
    ///
    /// # Safety
    /// The stream's context is current and `stream` belongs to it.
    pub(crate) unsafe fn reserve(
        &mut self,
        d: &Driver,
        stream: CUstream,
        len: u64,
    ) -> PluginResult<CUdeviceptr> {
        if self.len >= len {
            return Ok(self.ptr);
        }
        let alloc = d.function(d.api.cu_mem_alloc, "cuMemAlloc_v2")?;
        let sync = d.function(d.api.cu_stream_synchronize, "cuStreamSynchronize")?;
        // SAFETY: the caller made the stream's context current.
        d.check("cuStreamSynchronize", unsafe { sync(stream) })?;
        // SAFETY: the stream is idle (synchronised above): nothing queued
        // uses the old memory any more; context current (caller).
        unsafe { self.release(d) };
        let want = len.next_power_of_two().max(4 << 20);
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: ptr is a valid out-pointer; the context is current; the
        // memory is freed by `release`.
        d.check("cuMemAlloc", unsafe { alloc(&mut ptr, want as usize) })?;
        (self.ptr, self.len) = (ptr, want);
        Ok(ptr)
    }

    /// Frees the memory.
    ///
    /// # Safety
    /// Its context is current and no queued work uses it any more.
    pub(crate) unsafe fn release(&mut self, d: &Driver) {
        if self.len == 0 {
            return;
        }
        if let Some(free) = d.api.cu_mem_free {
            // SAFETY: ptr came from cuMemAlloc in this context and is freed
            // once (len is zeroed below); the caller vouches it is idle.
            let _ = unsafe { free(self.ptr) };
        }
        (self.ptr, self.len) = (0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: u64 = 0x7000_0000_0000;
    const DEV: u64 = 0x2000_0000;
    const K16: u64 = 16 << 10;

    fn d(src: u64, dst: u64, len: u64) -> Desc {
        Desc { src, dst, len }
    }

    /// One pinned allocation of 64 MiB at HOST; everything else device.
    fn host(addr: u64, len: u64) -> bool {
        addr >= HOST && addr + len <= HOST + (64 << 20)
    }

    /// plan, with the ends counted by `is_host` as the caller would.
    fn planned(descs: &[Desc], is_host: impl Fn(u64, u64) -> bool) -> Option<Bounce> {
        let ends = HostEnds {
            src: descs.iter().filter(|c| is_host(c.src, c.len)).count(),
            dst: descs.iter().filter(|c| is_host(c.dst, c.len)).count(),
        };
        plan(descs, ends, is_host)
    }

    fn gather(n: u64, gap: u64) -> Vec<Desc> {
        (0..n)
            .map(|i| d(DEV + (n - i) * 3 * K16, HOST + i * (K16 + gap), K16))
            .collect()
    }

    #[test]
    fn a_packed_gather_comes_out_in_one_copy() {
        let list = gather(256, 0);
        let b = planned(&list, host).expect("bounces");
        assert_eq!(
            b,
            Bounce::Out {
                start: HOST,
                len: 256 * K16,
                runs: vec![(HOST, 256 * K16)]
            }
        );
        let rebased = b.rebase(&list, 0x9000);
        assert_eq!(rebased[3].dst, 0x9000 + 3 * K16);
        assert_eq!(rebased[3].src, list[3].src, "device ends stay");
    }

    #[test]
    fn a_gather_never_writes_between_its_destinations() {
        // 16 KiB blocks 256 bytes apart: every gap would be overwritten by
        // one copy of the span, so each block is its own run, and past
        // MAX_RUNS runs the list goes to the kernel directly.
        assert_eq!(planned(&gather(256, 256), host), None);
        let Some(Bounce::Out { runs, .. }) = planned(&gather(16, 256), host) else {
            panic!("16 runs bounce");
        };
        assert_eq!(runs.len(), 16);
        assert!(runs.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0));
    }

    #[test]
    fn a_scatter_reads_its_span_in_one_copy_when_it_is_dense() {
        let list: Vec<Desc> = (0..256)
            .map(|i| d(HOST + i * (K16 + 256), DEV + i * 5 * K16, K16))
            .collect();
        let b = planned(&list, host).expect("bounces");
        assert_eq!(
            b,
            Bounce::In {
                start: HOST,
                len: 255 * (K16 + 256) + K16
            }
        );
        assert_eq!(b.rebase(&list, 0)[1].src, K16 + 256);
        // Sparse: the span is more than twice the bytes.
        let sparse: Vec<Desc> = (0..64)
            .map(|i| d(HOST + i * 3 * K16, DEV + i * K16, K16))
            .collect();
        assert_eq!(planned(&sparse, host), None);
    }

    #[test]
    fn small_mixed_or_device_only_lists_go_to_the_kernel() {
        assert_eq!(planned(&gather(8, 0), host), None, "128 KiB is small");
        let mut mixed = gather(256, 0);
        mixed[7].dst = DEV;
        assert_eq!(planned(&mixed, host), None);
        let on_device: Vec<Desc> = (0..256).map(|i| d(DEV + i * K16, DEV << 4, K16)).collect();
        assert_eq!(planned(&on_device, host), None);
        assert_eq!(planned(&[], host), None);
    }

    #[test]
    fn a_span_across_allocations_or_too_long_does_not_bounce() {
        // One block at the end of the allocation, one in the next: each is
        // host memory, their span is not one allocation.
        let next = |a: u64, n: u64| host(a, n) || a >= HOST + (64 << 20);
        let list = vec![
            d(HOST + (63 << 20), DEV, 1 << 20),
            d(HOST + (64 << 20), DEV, 1 << 20),
        ];
        assert_eq!(planned(&list, next), None);
        assert!(planned(&list[..1], next).is_some(), "alone it bounces");
        let long = vec![d(HOST, DEV, 40 << 20), d(HOST + (40 << 20), DEV, 30 << 20)];
        assert_eq!(planned(&long, |a, _| a >= HOST), None, "70 MiB");
    }

    #[test]
    fn runs_merge_touching_and_overlapping_ranges() {
        let r = runs([(10, 5), (0, 10), (12, 10), (30, 1)].into_iter()).unwrap();
        assert_eq!(r, vec![(0, 22), (30, 1)]);
        assert!(runs((0..17).map(|i| (i * 10, 5))).is_none());
    }
}
