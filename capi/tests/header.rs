//! include/ferry.h is generated from this crate by cbindgen; this test
//! regenerates it and fails when the checked-in copy differs, so the header
//! C programs compile against is always the one the library implements.
//! `FERRY_BLESS=1 cargo test -p ferry-capi --test header` updates it.

use std::path::Path;

#[test]
fn checked_in_header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = crate_dir.join("include/ferry.h");
    if std::env::var_os("FERRY_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/ferry.h");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "capi/include/ferry.h is out of date with capi/src; run \
         `FERRY_BLESS=1 cargo test -p ferry-capi --test header` and commit the result"
    );
}
