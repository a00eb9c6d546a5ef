//! Device memory moved by host-only transports (TCP, shm) through staging,
//! with a fake GPU plugin whose device memory the CPU cannot touch: any code
//! path that dereferences a device pointer crashes this test.

use ferry_core::{Engine, EngineConfig, Location, Op, Request};
use ferry_tests::built;

/// A plugin directory holding the fake GPU as the "cuda" device plugin.
fn fake_gpu_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        built("libferry_test_device_fakegpu.so"),
        dir.path().join("libferry_device_cuda.so"),
    )
    .unwrap();
    dir
}

fn engine(plugins: &std::path::Path, transports: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("plugin_path", plugins.to_str().unwrap()).unwrap();
    c.set("transports", transports).unwrap();
    Engine::new(c).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(7)
                .wrapping_add(seed ^ (i >> 16) as u8)
        })
        .collect()
}

#[test]
fn gpu_to_gpu_writes_and_reads_over_tcp_and_shm_are_staged_and_verified() {
    let plugins = fake_gpu_dir();
    for transports in ["tcp", "shm"] {
        let target = engine(plugins.path(), transports);
        let initiator = engine(plugins.path(), transports);
        assert_eq!(initiator.gpus().len(), 1, "the fake GPU is found");
        const LEN: u64 = 24 << 20; // not a multiple of the 4 MiB chunk
        let remote = target.allocate_device(Location::Cuda(0), LEN).unwrap();
        target.register_memory(remote, LEN, None).unwrap();
        let d = target.descriptor();
        assert_eq!(
            d.buffers[0].location, "cuda:0",
            "device memory is recognised"
        );

        let src = initiator.allocate_device(Location::Cuda(0), LEN).unwrap();
        let dst = initiator.allocate_device(Location::Cuda(0), LEN).unwrap();
        initiator.register_memory(src, LEN, None).unwrap();
        initiator
            .register_memory(dst, LEN, Some(Location::Cuda(0)))
            .unwrap();
        let host = pattern(LEN as usize, transports.len() as u8);
        // SAFETY: host is a live Vec of LEN bytes; src is device memory.
        unsafe { initiator.copy_memory(src, host.as_ptr() as u64, LEN) }.unwrap();

        let seg = initiator.open_segment(target.segment_name()).unwrap();
        initiator
            .transfer_sync(&[Request::new(Op::Write, src, seg, remote, LEN)])
            .unwrap();
        initiator
            .transfer_sync(&[Request::new(Op::Read, dst, seg, remote, LEN)])
            .unwrap();
        let mut back = vec![0u8; LEN as usize];
        // SAFETY: back is a live Vec of LEN bytes; dst is device memory.
        unsafe { initiator.copy_memory(back.as_mut_ptr() as u64, dst, LEN) }.unwrap();
        assert!(back == host, "GPU -> GPU -> GPU over {transports}");

        // Host <-> device too, and a request inside the device buffer.
        let mut h2 = vec![0u8; 1 << 20];
        initiator
            .register_memory(h2.as_mut_ptr() as u64, 1 << 20, None)
            .unwrap();
        initiator
            .transfer_sync(&[Request::new(
                Op::Read,
                h2.as_mut_ptr() as u64,
                seg,
                remote + 12345,
                1 << 20,
            )])
            .unwrap();
        assert!(h2[..] == host[12345..12345 + (1 << 20)]);
    }
}
