#![no_main]
// The target's body and its checks: ferry_tests::fuzz::cuda_ipc_wire.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_tests::fuzz::cuda_ipc_wire(data);
});
