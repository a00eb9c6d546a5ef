//! The all-to-all matrix: for every ordered pair of hosts, a write and a
//! read-back from host memory and from GPU memory to host memory and to GPU
//! memory (where the hosts have GPUs), each checked at the target and
//! against the rules, printed one line per cell.

use crate::rules::{self, Side};
use crate::Host;
use serde_json::Value;
use std::time::Duration;

/// A guard against a hung node, far above any transfer's time.
const CELL_GUARD: Duration = Duration::from_secs(120);

#[derive(Clone, Debug)]
pub struct Cell {
    pub from: usize,
    pub to: usize,
    pub local: String,
    pub remote: String,
}

pub struct Row {
    pub cell: Cell,
    pub got: Value,
    pub wrong: Vec<String>,
}

/// The cells between `among` (host indices): host and GPU memory at both
/// ends; which NUMA node and GPU rotates with the pair, so the matrix
/// touches every GPU and node of a host.
pub fn cells(hosts: &[Host], among: &[usize]) -> Vec<Cell> {
    let mut out = Vec::new();
    for &a in among {
        for &b in among {
            if a == b {
                continue;
            }
            let (ca, ga) = hosts[a].machine.locations();
            let (cb, gb) = hosts[b].machine.locations();
            let k = a * 3 + b;
            let pick = |v: &[String], salt: usize| v.get((k + salt) % v.len().max(1)).cloned();
            let mut push = |local: Option<String>, remote: Option<String>| {
                if let (Some(local), Some(remote)) = (local, remote) {
                    out.push(Cell {
                        from: a,
                        to: b,
                        local,
                        remote,
                    });
                }
            };
            push(pick(&ca, 0), pick(&cb, 1));
            push(pick(&ca, 1), pick(&gb, 0));
            push(pick(&ga, 0), pick(&cb, 0));
            push(pick(&ga, 1), pick(&gb, 3));
        }
    }
    out
}

/// Runs one cell: the write and read-back at `from`, the check at `to`.
pub fn run(hosts: &mut [Host], cell: &Cell, seed: u64) -> Row {
    run_adjusted(hosts, cell, seed, &|_| {})
}

/// As [`run`], with the rules' expectation changed by `adjust` (a fault
/// the rules do not know about).
pub fn run_adjusted(
    hosts: &mut [Host],
    cell: &Cell,
    seed: u64,
    adjust: &dyn Fn(&mut rules::Expect),
) -> Row {
    let to_name = hosts[cell.to].name.clone();
    let mut want = rules::expect(
        &Side {
            machine: &hosts[cell.from].machine,
            rdma: hosts[cell.from].rdma,
        },
        &Side {
            machine: &hosts[cell.to].machine,
            rdma: hosts[cell.to].rdma,
        },
        &cell.local,
        &cell.remote,
    );
    adjust(&mut want);
    let got = ask(
        &mut hosts[cell.from],
        &format!("xfer {to_name} {} {} {seed}", cell.local, cell.remote),
    );
    let check = if got["ok"] == true {
        ask(
            &mut hosts[cell.to],
            &format!("check {} {seed}", cell.remote),
        )
    } else {
        Value::Null
    };
    let wrong = rules::judge(&want, &got, &check);
    Row {
        cell: cell.clone(),
        got,
        wrong,
    }
}

/// A command to a host's node; an unreachable node is an answer too.
pub fn ask(host: &mut Host, command: &str) -> Value {
    if crate::netns::interrupted() {
        // The signal's thread is cleaning up and ends the process.
        loop {
            std::thread::park();
        }
    }
    match host.node.as_mut() {
        Some(n) => n
            .ask(command, CELL_GUARD)
            .unwrap_or_else(|e| serde_json::json!({"ok": false, "code": "DRIVER", "error": e})),
        None => {
            serde_json::json!({"ok": false, "code": "DRIVER", "error": "the host's node is not running"})
        }
    }
}

/// NIC names in natural order (mlx5_9 before mlx5_10).
fn nics(v: &Value) -> String {
    let mut k: Vec<String> = v
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    k.sort_by_key(|n| {
        let (stem, num) = n.rsplit_once('_').unwrap_or((n, ""));
        (stem.to_string(), num.parse::<u32>().unwrap_or(0))
    });
    if k.is_empty() {
        "-".into()
    } else {
        k.join(",")
    }
}

/// The worst path class from `location` to the NICs in `used`.
fn class(host: &Host, location: &str, used: &Value) -> String {
    used.as_object()
        .and_then(|m| {
            m.keys()
                .filter_map(|n| host.machine.class(location, n))
                .max()
        })
        .map_or("-".into(), |c| c.as_str().to_string())
}

pub fn header() -> String {
    format!(
        "{:<6} {:<6} {:<18} {:<12} {:<30} {:<30} {:<9} {:>7} {:>7}  {}",
        "from",
        "to",
        "memory",
        "transport",
        "NICs here",
        "NICs at the peer",
        "class",
        "wr GB/s",
        "rd GB/s",
        "verdict"
    )
}

pub fn line(hosts: &[Host], row: &Row) -> String {
    let c = &row.cell;
    let g = &row.got;
    let memory = format!("{} -> {}", c.local, c.remote);
    let ok = g["ok"] == true;
    let transport = if !ok {
        "-".to_string()
    } else if g["staged"] == true {
        format!("{}+staged", g["transport"].as_str().unwrap_or("?"))
    } else {
        g["transport"].as_str().unwrap_or("?").to_string()
    };
    let (here, there, cls) = if !ok {
        ("-".into(), "-".into(), "-".into())
    } else if g["transport"] == "rdma" {
        let cls = if g["staged"] == true {
            "staged".to_string()
        } else {
            format!(
                "{}/{}",
                class(&hosts[c.from], &c.local, &g["local_nics"]),
                class(&hosts[c.to], &c.remote, &g["remote_nics"])
            )
        };
        (nics(&g["local_nics"]), nics(&g["remote_nics"]), cls)
    } else {
        (
            g["interface"].as_str().unwrap_or("-").to_string(),
            "-".to_string(),
            g["class"].as_str().unwrap_or("-").to_string(),
        )
    };
    let rate = |s: &Value| {
        let bytes = g["bytes"].as_f64().unwrap_or(0.0);
        s.as_f64()
            .filter(|s| *s > 0.0)
            .map_or("-".into(), |s| format!("{:.2}", bytes / s / 1e9))
    };
    let verdict = if row.wrong.is_empty() {
        "ok".to_string()
    } else {
        format!("WRONG: {}", row.wrong.join("; "))
    };
    format!(
        "{:<6} {:<6} {:<18} {:<12} {:<30} {:<30} {:<9} {:>7} {:>7}  {}",
        hosts[c.from].name,
        hosts[c.to].name,
        memory,
        transport,
        here,
        there,
        cls,
        rate(&g["write_s"]),
        rate(&g["read_s"]),
        verdict
    )
}
