//! A test engine driven line by line on stdin, for multi-process tests that
//! need engines found by name (metadata store). Configured by FERRY_*
//! variables; takes its seed and buffer size as arguments:
//!
//!     ferry-test-node SEED BYTES
//!
//! It registers two buffers: `src` filled with pattern(SEED) and an empty
//! `inbox`, prints `ready NAME SRC INBOX`, then answers one line per command:
//!
//! - `ring NAME`: writes src into NAME's inbox, reads it back, compares:
//!   `ring ok` or `ring error MESSAGE`
//! - `check SEED`: whether the inbox holds pattern(SEED): `check ok` / `check bad`
//! - `open NAME`: opens NAME afresh: `open ok` or `open error MESSAGE`
//! - `quit`

use ferry_core::{Engine, EngineConfig, Op, Request};
use ferry_tests::pattern;
use std::collections::HashMap;
use std::io::{BufRead, Write};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(seed), Some(len)) = (
        args.get(1).and_then(|s| s.parse::<u64>().ok()),
        args.get(2).and_then(|s| s.parse::<usize>().ok()),
    ) else {
        eprintln!("usage: ferry-test-node SEED BYTES");
        std::process::exit(2);
    };
    ferry_core::init_logging();
    let config = match EngineConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("fatal {e}");
            std::process::exit(1);
        }
    };
    let engine = match Engine::new(config) {
        Ok(e) => e,
        Err(e) => {
            println!("fatal {e}");
            std::process::exit(1);
        }
    };
    let src = pattern(len, seed);
    let mut inbox = vec![0u8; len];
    let mut scratch = vec![0u8; len];
    let (src_addr, inbox_addr, scratch_addr) = (
        src.as_ptr() as u64,
        inbox.as_mut_ptr() as u64,
        scratch.as_mut_ptr() as u64,
    );
    for a in [src_addr, inbox_addr, scratch_addr] {
        if let Err(e) = engine.register_memory(a, len as u64, None) {
            println!("fatal {e}");
            std::process::exit(1);
        }
    }
    println!("ready {} {src_addr} {inbox_addr}", engine.segment_name());
    let mut open: HashMap<String, u64> = HashMap::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let reply = match (words.next(), words.next(), words.next()) {
            (Some("ring"), Some(name), Some(remote_inbox)) => {
                let remote: u64 = remote_inbox.parse().unwrap_or(0);
                let seg = match open.get(name) {
                    Some(s) => Ok(*s),
                    None => engine.open_segment(name),
                };
                let done = seg.and_then(|seg| {
                    open.insert(name.to_string(), seg);
                    engine.transfer_sync(&[Request::new(
                        Op::Write,
                        src_addr,
                        seg,
                        remote,
                        len as u64,
                    )])?;
                    engine.transfer_sync(&[Request::new(
                        Op::Read,
                        scratch_addr,
                        seg,
                        remote,
                        len as u64,
                    )])
                });
                match done {
                    Ok(())
                        // SAFETY: scratch is this node's mapping of at least len
                        // bytes; nothing writes it while no transfer runs.
                        if unsafe {
                            std::slice::from_raw_parts(scratch_addr as *const u8, len)
                        } == &src[..] =>
                    {
                        "ring ok".to_string()
                    }
                    Ok(()) => "ring error read back differs".to_string(),
                    Err(e) => format!("ring error {e}"),
                }
            }
            (Some("check"), Some(seed), _) => {
                let want = pattern(len, seed.parse().unwrap_or(0));
                // SAFETY: no transfer into the inbox runs while we check.
                let got = unsafe { std::slice::from_raw_parts(inbox_addr as *const u8, len) };
                if got == &want[..] {
                    "check ok"
                } else {
                    "check bad"
                }
                .to_string()
            }
            (Some("open"), Some(name), _) => {
                if let Some(seg) = open.remove(name) {
                    let _ = engine.close_segment(seg);
                }
                match engine.open_segment(name) {
                    Ok(seg) => {
                        open.insert(name.to_string(), seg);
                        "open ok".to_string()
                    }
                    Err(e) => format!("open error {e}"),
                }
            }
            (Some("quit"), _, _) => break,
            _ => format!("error unknown command {line:?}"),
        };
        println!("{reply}");
        let _ = std::io::stdout().flush();
    }
    drop(inbox);
}
