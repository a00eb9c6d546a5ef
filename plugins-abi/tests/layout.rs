//! Proves that the Rust mirror in `sys.rs` matches `include/ferry/plugin.h`:
//! a C program compiled from the header prints the size of every struct and
//! the offset and size of every field, and each must equal Rust's.
//! Also checks every constant the header defines.

use ferry_plugins_abi::sys::*;
use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

/// (C type, Rust size, [(field, Rust offset, Rust size)]).
type Layout = (&'static str, usize, Vec<(&'static str, usize, usize)>);

macro_rules! layout {
    ($cname:literal, $ty:ty, [$($field:ident),* $(,)?]) => {{
        let fields: Vec<(&'static str, usize, usize)> = vec![$((
            stringify!($field),
            offset_of!($ty, $field),
            {
                fn size_of_field<T>(_: fn(&$ty) -> &T) -> usize { size_of::<T>() }
                size_of_field(|t: &$ty| &t.$field)
            },
        )),*];
        ($cname, size_of::<$ty>(), fields)
    }};
}

fn rust_layouts() -> Vec<Layout> {
    vec![
        layout!(
            "ferry_abi_header_t",
            ferry_abi_header_t,
            [struct_size, abi_major, abi_minor]
        ),
        layout!("ferry_errbuf_t", ferry_errbuf_t, [msg, cap]),
        layout!(
            "ferry_nic_desc_t",
            ferry_nic_desc_t,
            [
                kind, path_class, name, netdev, pci_bus_id, numa_node, port_state, link_layer,
                reserved, speed_mbps
            ]
        ),
        layout!(
            "ferry_host_services_t",
            ferry_host_services_t,
            [
                hdr,
                ctx,
                log,
                log_enabled,
                config_get,
                topo_nics,
                peer_request,
                count
            ]
        ),
        layout!(
            "ferry_probe_device_t",
            ferry_probe_device_t,
            [
                struct_size,
                numa_node,
                name,
                pci_bus_id,
                detail,
                mem_kinds,
                bandwidth_mbps,
                latency_ns,
                reserved,
                gpu
            ]
        ),
        layout!(
            "ferry_probe_sink_t",
            ferry_probe_sink_t,
            [
                hdr,
                ctx,
                set_capabilities,
                add_device,
                add_missing,
                add_note,
                add_memory_method
            ]
        ),
        layout!(
            "ferry_transport_init_params_t",
            ferry_transport_init_params_t,
            [hdr, engine_name, listen_host, completion_ctx, complete]
        ),
        layout!(
            "ferry_mem_region_t",
            ferry_mem_region_t,
            [
                struct_size,
                numa_node,
                addr,
                len,
                mem_kind,
                location,
                device_ordinal,
                dmabuf_fd,
                flags,
                reserved,
                dmabuf_offset,
                share_fd,
                reserved2,
                share_offset
            ]
        ),
        layout!(
            "ferry_peer_info_t",
            ferry_peer_info_t,
            [struct_size, scope, name, endpoint, endpoint_len]
        ),
        layout!(
            "ferry_transfer_request_t",
            ferry_transfer_request_t,
            [
                op,
                reserved,
                local_addr,
                local_mem,
                remote_addr,
                length,
                remote_key,
                remote_key_len,
                token
            ]
        ),
        layout!(
            "ferry_block_t",
            ferry_block_t,
            [local_offset, remote_offset, length]
        ),
        layout!(
            "ferry_block_list_t",
            ferry_block_list_t,
            [
                op,
                reserved,
                local_addr,
                local_mem,
                remote_addr,
                remote_key,
                remote_key_len,
                blocks,
                count,
                token
            ]
        ),
        layout!(
            "ferry_layout_list_t",
            ferry_layout_list_t,
            [
                op,
                reserved,
                local_base,
                local_stride,
                local_blocks,
                local_mem,
                remote_base,
                remote_stride,
                remote_blocks,
                remote_key,
                remote_key_len,
                block_size,
                local_ids,
                remote_ids,
                count,
                token
            ]
        ),
        layout!(
            "ferry_transport_plugin_v1_t",
            ferry_transport_plugin_v1_t,
            [
                hdr,
                name,
                version,
                description,
                probe,
                init,
                fini,
                get_endpoint,
                register_memory,
                unregister_memory,
                connect,
                disconnect,
                submit,
                describe_peer,
                progress,
                allocate_memory,
                free_memory,
                accepts,
                on_peer_request,
                accepts_pair,
                flags,
                submit_blocks,
                submit_layouts
            ]
        ),
        layout!(
            "ferry_device_info_t",
            ferry_device_info_t,
            [
                struct_size,
                ordinal,
                name,
                pci_bus_id,
                uuid,
                total_memory,
                gpu_direct_rdma,
                dmabuf,
                dmabuf_export,
                reserved
            ]
        ),
        layout!(
            "ferry_pointer_info_t",
            ferry_pointer_info_t,
            [struct_size, kind, ordinal, reserved, base, size]
        ),
        layout!(
            "ferry_device_plugin_v1_t",
            ferry_device_plugin_v1_t,
            [
                hdr,
                name,
                version,
                description,
                probe,
                init,
                fini,
                device_count,
                device_info,
                query_pointer,
                export_dmabuf,
                alloc_pinned,
                free_pinned,
                alloc_device,
                free_device,
                stream_create,
                stream_destroy,
                copy_async,
                stream_sync,
                pin_host,
                unpin_host,
                copy_list_async,
                stream_query
            ]
        ),
        layout!("ferry_device_copy_t", ferry_device_copy_t, [src, dst, len]),
    ]
}

/// Every integer constant of the header, with Rust's value.
fn rust_constants() -> Vec<(&'static str, i128)> {
    macro_rules! consts {
        ($($name:ident),* $(,)?) => { vec![$((stringify!($name), $name as i128)),*] };
    }
    consts![
        FERRY_PLUGIN_ABI_MAJOR,
        FERRY_PLUGIN_ABI_MINOR,
        FERRY_OK,
        FERRY_ERR_INVALID_ARGUMENT,
        FERRY_ERR_UNSUPPORTED,
        FERRY_ERR_UNAVAILABLE,
        FERRY_ERR_NOT_FOUND,
        FERRY_ERR_OUT_OF_BOUNDS,
        FERRY_ERR_TIMEOUT,
        FERRY_ERR_CONNECTION,
        FERRY_ERR_PROTOCOL,
        FERRY_ERR_NO_MEMORY,
        FERRY_ERR_BUSY,
        FERRY_ERR_ABI_MISMATCH,
        FERRY_ERR_PLUGIN,
        FERRY_ERR_PANIC,
        FERRY_ERR_PERMISSION,
        FERRY_ERR_CANCELLED,
        FERRY_ERR_IO,
        FERRY_ERR_INTERNAL,
        FERRY_LOG_ERROR,
        FERRY_LOG_WARN,
        FERRY_LOG_INFO,
        FERRY_LOG_DEBUG,
        FERRY_LOG_TRACE,
        FERRY_MEM_HOST,
        FERRY_MEM_CUDA_STAGED,
        FERRY_MEM_CUDA_DMABUF,
        FERRY_MEM_CUDA_PEERMEM,
        FERRY_MEM_CUDA_IPC,
        FERRY_SCOPE_SAME_PROCESS,
        FERRY_SCOPE_SAME_HOST,
        FERRY_SCOPE_CROSS_HOST,
        FERRY_NIC_KIND_RDMA,
        FERRY_NIC_KIND_NET,
        FERRY_PATH_UNKNOWN,
        FERRY_PATH_PIX,
        FERRY_PATH_PXB,
        FERRY_PATH_PHB,
        FERRY_PATH_NODE,
        FERRY_PATH_SYS,
        FERRY_PORT_UNKNOWN,
        FERRY_PORT_DOWN,
        FERRY_PORT_ACTIVE,
        FERRY_LINK_UNKNOWN,
        FERRY_LINK_INFINIBAND,
        FERRY_LINK_ETHERNET,
        FERRY_OP_READ,
        FERRY_OP_WRITE,
        FERRY_PTR_HOST,
        FERRY_PTR_DEVICE,
        FERRY_PTR_HOST_PINNED,
        FERRY_PTR_MANAGED,
        FERRY_REGION_LOCAL_ONLY,
        FERRY_TRANSPORT_LOCAL_UNREGISTERED,
        FERRY_PEER_MSG_MAX,
    ]
}

fn c_program(layouts: &[Layout], constants: &[(&str, i128)]) -> String {
    let mut c = String::from(
        "#include <ferry/plugin.h>\n#include <stdio.h>\n#include <stddef.h>\nint main(void) {\n",
    );
    for (ty, _, fields) in layouts {
        c.push_str(&format!(
            "  printf(\"{ty} SIZE %zu %zu\\n\", sizeof({ty}), (size_t)0);\n"
        ));
        for (f, _, _) in fields {
            c.push_str(&format!(
                "  printf(\"{ty} {f} %zu %zu\\n\", offsetof({ty}, {f}), sizeof((({ty} *)0)->{f}));\n"
            ));
        }
    }
    for (name, _) in constants {
        c.push_str(&format!(
            "  printf(\"CONST {name} %lld 0\\n\", (long long)({name}));\n"
        ));
    }
    c.push_str(&format!(
        "  printf(\"CONST SYMBOLS %d 0\\n\", !__builtin_strcmp(FERRY_TRANSPORT_PLUGIN_V1_SYMBOL, \"{}\") && !__builtin_strcmp(FERRY_DEVICE_PLUGIN_V1_SYMBOL, \"{}\"));\n",
        FERRY_TRANSPORT_PLUGIN_V1_SYMBOL, FERRY_DEVICE_PLUGIN_V1_SYMBOL
    ));
    c.push_str("  return 0;\n}\n");
    c
}

#[test]
fn rust_definitions_match_the_c_header() {
    let layouts = rust_layouts();
    let constants = rust_constants();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("layout.c");
    let exe = dir.path().join("layout");
    std::fs::write(&src, c_program(&layouts, &constants)).unwrap();
    let include = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run the C compiler");
    assert!(
        out.status.success(),
        "compiling against plugin.h failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run the layout program");
    assert!(run.status.success());
    let text = String::from_utf8(run.stdout).unwrap();
    let mut c_values: BTreeMap<(String, String), (i128, i128)> = BTreeMap::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.len(), 4, "bad line {line:?}");
        c_values.insert(
            (parts[0].to_string(), parts[1].to_string()),
            (parts[2].parse().unwrap(), parts[3].parse().unwrap()),
        );
    }

    let mut mismatches = Vec::new();
    for (ty, size, fields) in &layouts {
        let c = c_values[&(ty.to_string(), "SIZE".to_string())].0;
        if c != *size as i128 {
            mismatches.push(format!("sizeof({ty}): C {c}, Rust {size}"));
        }
        for (f, off, fsize) in fields {
            let (c_off, c_size) = c_values[&(ty.to_string(), f.to_string())];
            if (c_off, c_size) != (*off as i128, *fsize as i128) {
                mismatches.push(format!(
                    "{ty}.{f}: C offset {c_off} size {c_size}, Rust offset {off} size {fsize}"
                ));
            }
        }
    }
    for (name, value) in &constants {
        let c = c_values[&("CONST".to_string(), name.to_string())].0;
        if c != *value {
            mismatches.push(format!("{name}: C {c}, Rust {value}"));
        }
    }
    assert_eq!(
        c_values[&("CONST".into(), "SYMBOLS".into())].0,
        1,
        "entry symbol names differ"
    );
    assert!(
        mismatches.is_empty(),
        "plugin.h and sys.rs disagree:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn every_field_of_every_struct_is_checked() {
    // A field added to the header but not to the list above would slip by;
    // count the fields declared in each struct of the header to catch that.
    let header = std::fs::read_to_string(ferry_plugins_abi::HEADER_PATH).unwrap();
    for (ty, _, fields) in rust_layouts() {
        let tag = ty.trim_end_matches("_t");
        let start = header
            .find(&format!("typedef struct {tag} {{"))
            .unwrap_or_else(|| panic!("{ty} not found in plugin.h"));
        let body = &header[start..];
        let end = body.find(&format!("}} {ty};")).unwrap();
        let body = &body[..end];
        let declared = body
            .lines()
            .skip(1)
            .map(|l| l.split("/*").next().unwrap_or("").trim())
            // A declaration spread over lines ends with ';' once.
            .filter(|l| l.ends_with(';'))
            .count();
        assert_eq!(
            declared,
            fields.len(),
            "{ty}: plugin.h declares {declared} fields, the layout test checks {}",
            fields.len()
        );
    }
}
