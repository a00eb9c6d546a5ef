//! Starts an engine the way a serving process does (FERRY_* settings) and
//! prints one JSON object:
//!
//!     ferry-host-model                      what it decided at start: the
//!                                           transports that run and each
//!                                           GPU's GPU-direct decision
//!     ferry-host-model route SEGMENT ADDR LEN
//!                                           the route of a LEN-byte request
//!                                           from host memory it allocates to
//!                                           ADDR of SEGMENT (Route::to_json)
//!
//! tests/host_model.rs holds the first against `ferry info --json`;
//! python/tests/test_same_route.py holds the second against C and Python.

use ferry_core::{Engine, EngineConfig};

fn main() {
    ferry_core::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let engine = EngineConfig::from_env().and_then(Engine::new);
    let result = engine.and_then(|engine| match args.as_slice() {
        [] => Ok(started(&engine)),
        [cmd, segment, addr, len] if cmd == "route" => {
            let (Ok(addr), Ok(len)) = (addr.parse::<u64>(), len.parse::<u64>()) else {
                return Err(ferry_core::Error::new(
                    ferry_core::ErrorCode::InvalidArgument,
                    "usage: ferry-host-model route SEGMENT ADDR LEN",
                ));
            };
            let local = engine.allocate_memory(len, None)?;
            let seg = engine.open_segment(segment)?;
            Ok(engine.route(seg, local, addr, len)?.to_json())
        }
        _ => Err(ferry_core::Error::new(
            ferry_core::ErrorCode::InvalidArgument,
            "usage: ferry-host-model [route SEGMENT ADDR LEN]",
        )),
    });
    match result {
        Ok(text) => println!("{text}"),
        Err(e) => {
            eprintln!("ferry-host-model: {e}");
            std::process::exit(1);
        }
    }
}

fn started(engine: &Engine) -> String {
    let gpus: serde_json::Map<String, serde_json::Value> = engine
        .gpus()
        .iter()
        .map(|g| {
            let decision = engine.gpu_direct(g.location).unwrap_or_default();
            (g.location.to_string(), decision.into())
        })
        .collect();
    let failed: Vec<String> = engine
        .transport_failures()
        .iter()
        .map(|(name, _)| name.clone())
        .collect();
    serde_json::json!({
        "transports": engine.transports(),
        "transport_failures": failed,
        "gpus": gpus,
    })
    .to_string()
}
