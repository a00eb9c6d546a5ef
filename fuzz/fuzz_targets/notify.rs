#![no_main]
// The target's body and its checks: ferry_tests::fuzz::notify.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_tests::fuzz::notify(data);
});
