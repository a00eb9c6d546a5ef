//! Calling a loaded plugin's probe and collecting what it reports through
//! the sink: in the ferry-probe child, or in this process when there is no
//! helper (then on a thread, within the timeout).

use crate::library::{plugin_str, LoadedLibrary};
use crate::report::{
    bounded, MemoryMethod, MissingCapability, Note, Outcome, ProbedDevice, Stage, MAX_PROBE_ITEMS,
    MAX_REASON,
};
use ferry_plugins_abi::caps;
use ferry_plugins_abi::sys;
use ferry_plugins_abi::versioned::read_plain;
use ferry_plugins_abi::ErrorCode;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// What probe reported through the sink.
#[derive(Default)]
struct Findings {
    mem_kinds: u64,
    scopes: u32,
    devices: Vec<ProbedDevice>,
    missing: Vec<MissingCapability>,
    memory_methods: Vec<MemoryMethod>,
    notes: Vec<Note>,
}

/// The outcome of a plugin that loaded: its strings, and what its probe
/// returned and reported. `load_us` is how long loading took.
pub(crate) fn probe_outcome(lib: &LoadedLibrary, load_us: u64) -> Outcome {
    let (version, description, abi) = lib.strings();
    let started = Instant::now();
    let (status, message, findings) = run_probe(lib);
    let probe_us = elapsed_us(started);
    let mut outcome = Outcome::disabled(Stage::Probed, String::new());
    outcome.version = Some(version);
    outcome.description = Some(description);
    outcome.abi = Some(abi);
    outcome.load_us = Some(load_us);
    outcome.probe_us = Some(probe_us);
    outcome.mem_kinds = findings.mem_kinds;
    outcome.scopes = findings.scopes;
    outcome.devices = findings.devices;
    outcome.missing = findings.missing;
    outcome.memory_methods = findings.memory_methods;
    outcome.notes = findings.notes;
    if status == sys::FERRY_OK {
        outcome.enabled = true;
        outcome.reason = enabled_reason(&outcome);
    } else {
        let message = if message.is_empty() {
            "(the plugin gave no reason)".to_string()
        } else {
            message
        };
        let reason = match ErrorCode::from_raw(status) {
            Some(ErrorCode::Unavailable) => message,
            Some(ErrorCode::Panic) => {
                format!("probe panicked: {}", strip_panic_prefix(&message))
            }
            Some(code) => format!("probe failed with {code}: {message}"),
            None => format!("probe failed with unknown status {status}: {message}"),
        };
        outcome.reason = bounded(&reason, MAX_REASON);
    }
    outcome
}

/// The outcome of a plugin whose probe (or loading) did not finish in time.
pub(crate) fn timed_out(
    timeout: Duration,
    stage: Stage,
    load_us: Option<u64>,
    strings: Option<(String, String, String)>,
    after: &str,
) -> Outcome {
    let what = if stage == Stage::Discovered {
        "loading it"
    } else {
        "its probe"
    };
    let mut o = Outcome::disabled(
        stage,
        format!(
            "{what} did not finish within {} ms (FERRY_PLUGIN_PROBE_TIMEOUT_MS); {after}",
            timeout.as_millis()
        ),
    );
    o.load_us = load_us;
    if let Some((version, description, abi)) = strings {
        o.version = Some(version);
        o.description = Some(description);
        o.abi = Some(abi);
    }
    o.timed_out_after_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    o
}

fn strip_panic_prefix(msg: &str) -> &str {
    msg.strip_prefix("plugin panicked: ").unwrap_or(msg)
}

fn enabled_reason(o: &Outcome) -> String {
    let mut parts = vec!["probe passed".to_string()];
    let memory = caps::mem_kind_names(o.mem_kinds);
    if !memory.is_empty() {
        parts.push(format!("moves {} memory", memory.join("/")));
    }
    let scopes = caps::scope_names(o.scopes);
    if !scopes.is_empty() {
        parts.push(format!("reaches {} peers", scopes.join("/")));
    }
    match o.devices.len() {
        0 => {}
        1 => parts.push("1 device".into()),
        n => parts.push(format!("{n} devices")),
    }
    parts.join("; ")
}

pub(crate) fn elapsed_us(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Probes `lib` in this process on a thread of its own, giving up after
/// `timeout`; `None` when it did not return in time (the thread, and with it
/// the library, are abandoned: the plugin's code may still be running).
pub(crate) fn probe_outcome_within(
    lib: &Arc<LoadedLibrary>,
    load_us: u64,
    timeout: Duration,
) -> Option<Outcome> {
    let (tx, rx) = mpsc::channel();
    let lib2 = lib.clone();
    let spawned = std::thread::Builder::new()
        .name("ferry-probe".into())
        .spawn(move || {
            let outcome = probe_outcome(&lib2, load_us);
            let _ = tx.send(outcome);
        });
    if let Err(e) = spawned {
        // No thread to spare: probe on this one, without the timeout.
        log::debug!("cannot start a probe thread ({e}); probing inline");
        return Some(probe_outcome(lib, load_us));
    }
    rx.recv_timeout(timeout).ok()
}

fn run_probe(lib: &LoadedLibrary) -> (sys::ferry_status_t, String, Findings) {
    let Some(probe) = lib.probe_fn() else {
        return (
            sys::FERRY_ERR_ABI_MISMATCH,
            "no probe function".into(),
            Findings::default(),
        );
    };
    let findings = Mutex::new(Findings::default());
    let sink = sys::ferry_probe_sink_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_probe_sink_t>(),
        ctx: (&findings as *const Mutex<Findings>)
            .cast_mut()
            .cast::<c_void>(),
        set_capabilities: Some(sink_set_capabilities),
        add_device: Some(sink_add_device),
        add_missing: Some(sink_add_missing),
        add_note: Some(sink_add_note),
        add_memory_method: Some(sink_add_memory_method),
    };
    let mut buf = vec![0u8; 2048];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr().cast::<c_char>(),
        cap: buf.len(),
    };
    // SAFETY: every pointer handed to probe (services, sink, err) is valid for
    // the whole call: services lives in `lib`, sink/findings/buf on this stack.
    let status = unsafe { probe(lib.services(), &sink, &mut err) };
    // Whatever the plugin wrote, keep it inside the buffer.
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    let message = CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    let findings = findings.into_inner().unwrap_or_else(|e| e.into_inner());
    (status, message.trim().to_string(), findings)
}

/// # Safety
/// `ctx` must be the sink ctx set up by `run_probe`.
unsafe fn findings<'a>(ctx: *mut c_void) -> Option<&'a Mutex<Findings>> {
    // SAFETY: ctx points at the Mutex on run_probe's stack, alive for the
    // whole probe call, which is the only time the sink may be used.
    unsafe { ctx.cast::<Mutex<Findings>>().cast_const().as_ref() }
}

unsafe extern "C" fn sink_set_capabilities(ctx: *mut c_void, mem_kinds: u64, scopes: u32) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink.
        if let Some(f) = unsafe { findings(ctx) } {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            f.mem_kinds = mem_kinds;
            f.scopes = scopes;
        }
    }));
}

unsafe extern "C" fn sink_add_device(ctx: *mut c_void, device: *const sys::ferry_probe_device_t) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; device is null or, for the call,
        // readable for its struct_size (plugin.h), which read_plain copies
        // (a plugin built for an older ABI passes a shorter record).
        let (Some(f), Some(d)) = (unsafe { findings(ctx) }, unsafe { read_plain(device) }) else {
            return;
        };
        let d = &d;
        if !ferry_plugins_abi::has_field!(d, sys::ferry_probe_device_t, mem_kinds) {
            return;
        }
        // The 1.2 declarations are read only when the plugin's struct has them.
        let declared = ferry_plugins_abi::has_field!(d, sys::ferry_probe_device_t, latency_ns);
        // SAFETY: the device's strings are null or C strings per the ABI.
        let Some(name) = (unsafe { plugin_str(d.name) }) else {
            return;
        };
        let report = ProbedDevice {
            name,
            // SAFETY: the same device record: its PCI id is null or a C
            // string that lives for this callback, per the ABI.
            pci: unsafe { plugin_str(d.pci_bus_id) },
            numa: (d.numa_node >= 0).then_some(d.numa_node),
            // SAFETY: the same device record: its detail is null or a C
            // string that lives for this callback, per the ABI.
            detail: unsafe { plugin_str(d.detail) },
            mem_kinds: d.mem_kinds,
            bandwidth_mbps: (declared && d.bandwidth_mbps > 0).then_some(d.bandwidth_mbps),
            latency_ns: (declared && d.latency_ns > 0).then_some(d.latency_ns),
            gpu: if ferry_plugins_abi::has_field!(d, sys::ferry_probe_device_t, gpu) {
                // SAFETY: the same device record (ABI 1.6, covered by its
                // struct_size): `gpu` is null or points to a device info
                // readable for its struct_size during this callback.
                unsafe { read_plain(d.gpu) }
                    .filter(|g| {
                        g.struct_size as usize >= std::mem::size_of::<sys::ferry_device_info_t>()
                    })
                    .and_then(|g| ferry_plugins_abi::sdk::DeviceInfo::from_raw(&g))
            } else {
                None
            },
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.devices.len() < MAX_PROBE_ITEMS {
            f.devices.push(report);
        }
    }));
}

unsafe extern "C" fn sink_add_missing(
    ctx: *mut c_void,
    capability: *const c_char,
    reason: *const c_char,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; strings are C strings per the ABI.
        let (Some(f), Some(capability), Some(reason)) = (
            unsafe { findings(ctx) },
            unsafe { plugin_str(capability) },
            unsafe { plugin_str(reason) },
        ) else {
            return;
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.missing.len() < MAX_PROBE_ITEMS {
            f.missing.push(MissingCapability { capability, reason });
        }
    }));
}

unsafe extern "C" fn sink_add_memory_method(
    ctx: *mut c_void,
    mem_kind: u64,
    available: i32,
    detail: *const c_char,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; detail is a C string per the ABI.
        let (Some(f), Some(detail)) = (unsafe { findings(ctx) }, unsafe { plugin_str(detail) })
        else {
            return;
        };
        // One kind per entry; anything else is the plugin's mistake, dropped.
        if mem_kind.count_ones() != 1 {
            return;
        }
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.memory_methods.len() < MAX_PROBE_ITEMS {
            f.memory_methods.push(MemoryMethod {
                kind: mem_kind,
                memory: caps::mem_kind_names(mem_kind).join(","),
                available: available != 0,
                detail,
            });
        }
    }));
}

unsafe extern "C" fn sink_add_note(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx from our sink; strings are C strings per the ABI.
        let (Some(f), Some(key), Some(value)) = (
            unsafe { findings(ctx) },
            unsafe { plugin_str(key) },
            unsafe { plugin_str(value) },
        ) else {
            return;
        };
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        if f.notes.len() < MAX_PROBE_ITEMS {
            f.notes.push(Note { key, value });
        }
    }));
}
