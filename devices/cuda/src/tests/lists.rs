//! Lists of copies through the C table (copy_list_async): one kernel
//! launch per list, the driver's copies where the kernel cannot reach, and
//! lists between pinned and device memory bounced through device scratch.

use super::*;

impl EmuView {
    /// Copy calls so far: 0 cuMemcpyAsync, 1 kernel launches, 2 batched.
    fn calls(&self, kind: i32) -> i64 {
        // SAFETY: ferry_cuda_emu_calls is `long fn(int)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32) -> i64>(b"ferry_cuda_emu_calls")
                .unwrap();
            f(kind)
        }
    }
}

impl Instance {
    fn copy_list(
        &self,
        s: *mut c_void,
        copies: &[sys::ferry_device_copy_t],
    ) -> Result<(), (i32, String)> {
        // SAFETY: the instance and stream from this plugin, copies a live
        // slice for the call and a live error buffer, as plugin.h requires.
        call("copy_list_async", |e| unsafe {
            self.table.copy_list_async.unwrap()(self.raw, s, copies.as_ptr(), copies.len(), e)
        })
    }
}

/// Staging's gather and scatter: shuffled 16 KiB blocks of device memory
/// into one pinned run and back out, each list one kernel launch; a list
/// with an end the kernel cannot reach (pageable host memory) moves by
/// the driver's copies instead, and a bad list is refused whole.
#[test]
fn lists_gather_and_scatter_in_one_launch_and_fall_back_where_the_kernel_cannot_reach() {
    let dir = tempfile::tempdir().unwrap();
    let path = emulator(dir.path(), "lists", &["FERRY_CUDA_EMU_PROC_ADDRESS"]);
    let h = host(Some(&path));
    let inst = Instance::init(h);
    let emu = EmuView::open(&path);
    const BLOCK: u64 = 16 << 10;
    const N: u64 = 64;
    let dev = inst.alloc_device(0, N * BLOCK).unwrap();
    let back = inst.alloc_device(0, N * BLOCK).unwrap();
    let pinned = inst.alloc_pinned(N * BLOCK);
    let stream = inst.stream(0);
    let data: Vec<u8> = (0..N * BLOCK).map(|i| (i * 13 % 251) as u8).collect();
    inst.copy(stream, dev, data.as_ptr() as u64, N * BLOCK);
    // Block i of the run is device block perm[i].
    let perm: Vec<u64> = (0..N).map(|i| (i * 37 + 5) % N).collect();
    let gather: Vec<sys::ferry_device_copy_t> = perm
        .iter()
        .enumerate()
        .map(|(i, &b)| sys::ferry_device_copy_t {
            src: dev + b * BLOCK,
            dst: pinned + i as u64 * BLOCK,
            len: BLOCK,
        })
        .collect();
    let launches = emu.calls(1);
    inst.copy_list(stream, &gather).unwrap();
    inst.sync(stream);
    assert_eq!(emu.calls(1), launches + 1, "one launch gathers them all");
    // SAFETY: pinned holds N * BLOCK bytes, filled by the list above.
    let run = unsafe { std::slice::from_raw_parts(pinned as *const u8, (N * BLOCK) as usize) };
    for (i, &b) in perm.iter().enumerate() {
        let (i, b) = (i * BLOCK as usize, b as usize * BLOCK as usize);
        assert!(run[i..i + BLOCK as usize] == data[b..b + BLOCK as usize]);
    }
    // Scatter them back to where they came from, in another buffer.
    let scatter = scattered_back(&gather, dev, back);
    inst.copy_list(stream, &scatter).unwrap();
    inst.sync(stream);
    assert_eq!(emu.calls(1), launches + 2);
    let mut out = vec![0u8; (N * BLOCK) as usize];
    inst.copy(stream, out.as_mut_ptr() as u64, back, N * BLOCK);
    inst.sync(stream);
    assert!(out == data, "gathered and scattered back intact");

    // Pageable host memory is not the kernel's: the driver copies it.
    let mut pageable = vec![0u8; (2 * BLOCK) as usize];
    let to_pageable = [0, 1].map(|i| sys::ferry_device_copy_t {
        src: dev + i * BLOCK,
        dst: pageable.as_mut_ptr() as u64 + i * BLOCK,
        len: BLOCK,
    });
    let (launches, batched) = (emu.calls(1), emu.calls(2));
    inst.copy_list(stream, &to_pageable).unwrap();
    inst.sync(stream);
    assert_eq!((emu.calls(1), emu.calls(2)), (launches, batched + 1));
    assert!(pageable[..] == data[..(2 * BLOCK) as usize]);
    assert!(logs(h)
        .iter()
        .any(|l| l.contains("memory the copy kernel cannot")));

    // An empty or wrapping copy refuses the list; nothing is queued.
    let copies = (emu.calls(0), emu.calls(1), emu.calls(2));
    let bad = [
        gather[0],
        sys::ferry_device_copy_t {
            src: u64::MAX - 4,
            dst: pinned,
            len: 16,
        },
    ];
    let (status, message) = inst.copy_list(stream, &bad).unwrap_err();
    assert_eq!(status, sys::FERRY_ERR_INVALID_ARGUMENT);
    assert!(message.contains("copy 1"), "{message}");
    assert_eq!((emu.calls(0), emu.calls(1), emu.calls(2)), copies);

    inst.destroy(stream);
    inst.free_pinned(pinned);
    inst.free_device(dev);
    inst.free_device(back);
    inst.fini();
    assert_eq!(emu.count("ferry_cuda_emu_live_allocations"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_context_violations"), 0);
}

/// Lists between pinned host memory and device memory cross by the copy
/// engines through the stream's device scratch: a packed gather is one
/// launch and one copy out, a scatter one copy in and one launch. A gather
/// whose destinations leave gaps (more runs than a bounce takes) goes to
/// the kernel alone and never writes the gaps; cuda.copy=kernel never
/// bounces.
#[test]
fn pinned_lists_bounce_through_device_scratch_and_never_write_between_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = emulator(dir.path(), "bounce", &["FERRY_CUDA_EMU_PROC_ADDRESS"]);
    let emu = EmuView::open(&path);
    const BLOCK: u64 = 16 << 10;
    const N: u64 = 64;
    const GAP: u64 = 256;
    for copy in [None, Some("kernel")] {
        let inst = Instance::init(host_copying(Some(&path), copy));
        let dev = inst.alloc_device(0, N * BLOCK).unwrap();
        let back = inst.alloc_device(0, N * BLOCK).unwrap();
        let pinned = inst.alloc_pinned(N * (BLOCK + GAP));
        let stream = inst.stream(0);
        let data: Vec<u8> = (0..N * BLOCK).map(|i| (i * 7 % 253) as u8).collect();
        inst.copy(stream, dev, data.as_ptr() as u64, N * BLOCK);
        inst.sync(stream);
        let perm: Vec<u64> = (0..N).map(|i| (i * 29 + 3) % N).collect();
        let list = |gap: u64| -> Vec<sys::ferry_device_copy_t> {
            perm.iter()
                .enumerate()
                .map(|(i, &b)| sys::ferry_device_copy_t {
                    src: dev + b * BLOCK,
                    dst: pinned + i as u64 * (BLOCK + gap),
                    len: BLOCK,
                })
                .collect()
        };
        let bounces = copy.is_none();
        // Packed: one launch, and one copy out when it bounces.
        let calls = (emu.calls(0), emu.calls(1));
        inst.copy_list(stream, &list(0)).unwrap();
        inst.sync(stream);
        assert_eq!(
            (emu.calls(0) - calls.0, emu.calls(1) - calls.1),
            (i64::from(bounces), 1),
            "{copy:?}: gather"
        );
        // Back, scattered: one copy in when it bounces, one launch.
        let scatter = scattered_back(&list(0), dev, back);
        let calls = (emu.calls(0), emu.calls(1));
        inst.copy_list(stream, &scatter).unwrap();
        inst.sync(stream);
        assert_eq!(
            (emu.calls(0) - calls.0, emu.calls(1) - calls.1),
            (i64::from(bounces), 1),
            "{copy:?}: scatter"
        );
        let mut out = vec![0u8; (N * BLOCK) as usize];
        inst.copy(stream, out.as_mut_ptr() as u64, back, N * BLOCK);
        inst.sync(stream);
        assert!(out == data, "{copy:?}: gathered and scattered back intact");

        // With gaps: every gap keeps its bytes, every block lands.
        // SAFETY: pinned holds N * (BLOCK + GAP) bytes of this instance.
        let run = unsafe {
            std::slice::from_raw_parts_mut(pinned as *mut u8, (N * (BLOCK + GAP)) as usize)
        };
        run.fill(0xEE);
        let calls = emu.calls(0);
        inst.copy_list(stream, &list(GAP)).unwrap();
        inst.sync(stream);
        assert_eq!(
            emu.calls(0),
            calls,
            "{copy:?}: 64 runs go to the kernel alone"
        );
        for (i, &b) in perm.iter().enumerate() {
            let at = i * (BLOCK + GAP) as usize;
            let from = b as usize * BLOCK as usize;
            assert!(run[at..at + BLOCK as usize] == data[from..from + BLOCK as usize]);
            let gap = &run[at + BLOCK as usize..at + (BLOCK + GAP) as usize];
            assert!(
                gap.iter().all(|&x| x == 0xEE),
                "{copy:?}: gap {i} untouched"
            );
        }
        inst.destroy(stream);
        inst.free_pinned(pinned);
        inst.free_device(dev);
        inst.free_device(back);
        inst.fini();
        assert_eq!(
            emu.count("ferry_cuda_emu_live_allocations"),
            0,
            "scratch freed"
        );
        assert_eq!(emu.count("ferry_cuda_emu_context_violations"), 0);
    }
}

/// The scatter that undoes a gather out of device memory at `dev`: each
/// gathered block goes to its old place, in the buffer at `back`.
fn scattered_back(
    gather: &[sys::ferry_device_copy_t],
    dev: u64,
    back: u64,
) -> Vec<sys::ferry_device_copy_t> {
    gather
        .iter()
        .map(|c| sys::ferry_device_copy_t {
            src: c.dst,
            dst: back + (c.src - dev),
            len: c.len,
        })
        .collect()
}
