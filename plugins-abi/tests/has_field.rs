//! `FERRY_HAS_FIELD` (C and C++) and `has_field!` (Rust) on every struct
//! that can grow, whether its size sits in a `ferry_abi_header_t` or in its
//! own first field: a struct whose `struct_size` stops just short of a field
//! does not have it; one that reaches the field's end does.

use ferry_plugins_abi::has_field;
use ferry_plugins_abi::sys::*;
use std::mem::{offset_of, size_of};
use std::process::Command;

/// (type, the last field of ABI 1.0 or the struct's last field).
const CASES: &[(&str, &str)] = &[
    ("ferry_host_services_t", "peer_request"),
    ("ferry_probe_sink_t", "add_note"),
    ("ferry_transport_init_params_t", "complete"),
    ("ferry_transport_plugin_v1_t", "on_peer_request"),
    ("ferry_device_plugin_v1_t", "stream_query"),
    ("ferry_probe_device_t", "mem_kinds"),
    ("ferry_mem_region_t", "dmabuf_offset"),
    ("ferry_peer_info_t", "endpoint_len"),
    ("ferry_device_info_t", "reserved"),
    ("ferry_pointer_info_t", "size"),
];

fn program() -> String {
    let mut c = String::from(
        "#include <ferry/plugin.h>\n#include <stdio.h>\n#include <stdlib.h>\n\
         #include <string.h>\n\
         static unsigned char store[4096];\n\
         int main(void) {\n  int bad = 0;\n",
    );
    for (ty, field) in CASES {
        c.push_str(&format!(
            "  {{\n    size_t end = offsetof({ty}, {field}) + sizeof((({ty} *)0)->{field});\n\
             \x20   uint32_t size = (uint32_t)(end - 1);\n\
             \x20   memcpy(store, &size, sizeof size);\n\
             \x20   const {ty} *p = (const {ty} *)(const void *)store;\n\
             \x20   if (FERRY_HAS_FIELD(p, {ty}, {field})) {{ printf(\"{ty}.{field} present at %u\\n\", size); bad = 1; }}\n\
             \x20   size = (uint32_t)end;\n\
             \x20   memcpy(store, &size, sizeof size);\n\
             \x20   if (!FERRY_HAS_FIELD(p, {ty}, {field})) {{ printf(\"{ty}.{field} absent at %u\\n\", size); bad = 1; }}\n\
             \x20 }}\n"
        ));
    }
    c.push_str("  if (!bad) printf(\"ok\\n\");\n  return bad;\n}\n");
    c
}

fn compile_and_run(compiler: &str, std: &str, file_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join(file_name);
    let exe = dir.path().join("has_field");
    std::fs::write(&src, program()).unwrap();
    let include = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let out = Command::new(compiler)
        .args([std, "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(&include)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run the compiler");
    assert!(
        out.status.success(),
        "{compiler}: FERRY_HAS_FIELD does not compile on every struct:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the program");
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success() && text.trim() == "ok", "{text}");
}

#[test]
fn ferry_has_field_works_on_every_struct_that_can_grow_in_c() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    compile_and_run(&cc, "-std=c11", "has_field.c");
}

#[test]
fn ferry_has_field_works_in_cpp_too() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("no C++ compiler ({cxx}); skipped");
        return;
    }
    compile_and_run(&cxx, "-std=c++11", "has_field.cpp");
}

/// A zeroed struct of type T with its size set to `size`.
fn with_size<T: ferry_plugins_abi::versioned::Versioned>(size: usize) -> Box<T> {
    let mut bytes = vec![0u8; size_of::<T>()];
    bytes[..4].copy_from_slice(&(size as u32).to_ne_bytes());
    // SAFETY: every type used here is a repr(C) struct of integers, raw
    // pointers and nullable function pointers, for which all-zero bytes are
    // a valid value; the buffer has exactly size_of::<T>() bytes, and
    // read_unaligned copes with the Vec's alignment.
    Box::new(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

#[test]
fn has_field_macro_reads_the_size_of_every_kind_of_struct() {
    let end = offset_of!(ferry_mem_region_t, dmabuf_offset) + 8;
    assert!(!has_field!(
        &*with_size::<ferry_mem_region_t>(end - 1),
        ferry_mem_region_t,
        dmabuf_offset
    ));
    assert!(has_field!(
        &*with_size::<ferry_mem_region_t>(end),
        ferry_mem_region_t,
        dmabuf_offset
    ));
    let end = offset_of!(ferry_transport_plugin_v1_t, on_peer_request) + size_of::<usize>();
    assert!(!has_field!(
        &*with_size::<ferry_transport_plugin_v1_t>(end - 1),
        ferry_transport_plugin_v1_t,
        on_peer_request
    ));
    assert!(has_field!(
        &*with_size::<ferry_transport_plugin_v1_t>(end),
        ferry_transport_plugin_v1_t,
        on_peer_request
    ));
    let end = offset_of!(ferry_probe_device_t, mem_kinds) + 8;
    assert!(has_field!(
        &*with_size::<ferry_probe_device_t>(end),
        ferry_probe_device_t,
        mem_kinds
    ));
    assert!(!has_field!(
        &*with_size::<ferry_probe_device_t>(end - 1),
        ferry_probe_device_t,
        mem_kinds
    ));
}
