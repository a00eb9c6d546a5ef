//! Gives libferry.so a SONAME. A program linked against the library by its
//! path (CMake does so) then records "libferry.so", found at run time through
//! its rpath, instead of the absolute path it was linked from: the tarball
//! and the programs built against it can move.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libferry.so");
}
