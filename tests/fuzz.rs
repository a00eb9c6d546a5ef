//! Bounded fuzzing in the test suite: every decoder of network bytes
//! (src/fuzz.rs) gets its seeds and a few thousand deterministic mutants,
//! on the stable toolchain, in seconds. The coverage-guided runs are
//! cargo-fuzz's (fuzz/, nightly): same target functions, hours if you like.
//!
//! FERRY_FUZZ_ITERATIONS changes the number of mutants per target;
//! FERRY_FUZZ_CORPUS=DIR writes the seeds as a starting corpus for
//! cargo-fuzz (DIR/<target>/seed-N).

use ferry_tests::fuzz::{run_bounded, seeds, TARGETS};
use std::time::Instant;

fn iterations() -> usize {
    std::env::var("FERRY_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

fn fuzz(name: &str) {
    let (_, target) = TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a known target");
    if let Some(dir) = std::env::var_os("FERRY_FUZZ_CORPUS") {
        // Relative to the workspace root, not to this crate (cargo's cwd).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = root.join(dir).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), s).unwrap();
        }
    }
    // One fixed driver seed per target: a failure reproduces exactly.
    let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let started = Instant::now();
    let stats = run_bounded(name, *target, iterations(), seed);
    eprintln!(
        "fuzz {name}: {} executions ({} accepted by a decoder) in {:.2} s, no failure",
        stats.executions,
        stats.accepted,
        started.elapsed().as_secs_f64()
    );
}

macro_rules! targets {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                fuzz(stringify!($name));
            }
        )*

        #[test]
        fn every_target_has_a_test() {
            let tested = [$(stringify!($name)),*];
            for (name, _) in TARGETS {
                assert!(tested.contains(name), "{name} has no test here");
            }
        }
    };
}

targets!(
    control_frame,
    descriptor,
    staging,
    plugin_message,
    tcp_wire,
    shm_wire,
    cuda_ipc_wire,
    rdma_wire,
    auth,
);
