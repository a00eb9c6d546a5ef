//! What happens to the cluster after the first matrix: the scale figures,
//! a failed NIC, a host SIGKILLed and restarted, etcd stopped for 10 s, and
//! two hosts that are configured wrong.

use crate::hosts::Kind;
use crate::matrix::{self, ask};
use crate::{percentile, section, Cluster};
use serde_json::Value;
use std::time::{Duration, Instant};

fn names_listed(v: &Value) -> Vec<String> {
    v["names"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Every engine of every host is listed in etcd; lookup latency from every
/// node to every name.
pub fn scale(c: &mut Cluster) {
    section(&format!(
        "scale: {} engines in one etcd ({} per host)",
        c.hosts.len() * (1 + c.extra_per_host),
        1 + c.extra_per_host
    ));
    let listed = names_listed(&ask(&mut c.hosts[0], "segments"));
    let want = c.hosts.len() * (1 + c.extra_per_host);
    println!("etcd lists {} segments", listed.len());
    if listed.len() != want {
        c.fail(format!(
            "etcd lists {} segments, expected {want}",
            listed.len()
        ));
    }
    let rounds = if c.opts.short { 2 } else { 5 };
    let command = format!("lookup {rounds} {}", listed.join(" "));
    let mut us: Vec<f64> = Vec::new();
    let t = Instant::now();
    // Every node looks up every name at the same time.
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = c
            .hosts
            .iter_mut()
            .map(|h| {
                let command = command.clone();
                s.spawn(move || ask(h, &command))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Value::Null))
            .collect()
    });
    let wall = t.elapsed();
    for (i, a) in answers.iter().enumerate() {
        if a["ok"] != true {
            let name = c.hosts[i].name.clone();
            c.fail(format!("{name}: lookups: {} {}", a["code"], a["error"]));
            continue;
        }
        us.extend(
            a["us"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64),
        );
    }
    us.sort_by(f64::total_cmp);
    println!(
        "segment lookup (open by name through etcd, then close): {} lookups from {} nodes at once \
         in {:.2} s: p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        us.len(),
        c.hosts.len(),
        wall.as_secs_f64(),
        percentile(&us, 0.5),
        percentile(&us, 0.99),
        us.last().copied().unwrap_or(0.0)
    );
}

fn host_index(c: &Cluster, name: &str) -> Option<usize> {
    c.hosts.iter().position(|h| h.name == name)
}

/// One emulated NIC of a GPU host fails mid-run (its port goes down for
/// every process of that host); cells through it must still verify, with
/// its slices on other NICs.
pub fn nic_failure(c: &mut Cluster) {
    let Some(victim) = host_index(c, "gpu1") else {
        return;
    };
    let Some(peer) = host_index(c, "gpu0") else {
        return;
    };
    let ib = vec!["InfiniBand".to_string()];
    let nic = c.hosts[victim]
        .machine
        .nearest("cuda:1", &ib)
        .into_iter()
        .next()
        .unwrap_or_default();
    let Some(guid) = c.hosts[victim]
        .machine
        .rdma
        .iter()
        .find(|n| n.name == nic)
        .map(|n| n.guid)
    else {
        return;
    };
    section(&format!(
        "fault: {}'s {nic} (the NIC on cuda:1's PCIe switch) fails",
        c.hosts[victim].name
    ));
    // The emulator's port record: while its owner (this driver) lives, the
    // port is down for every process of that host (tests/verbs-emulator).
    let record = c.run.fabric.join(format!("port/{guid:016x}.1"));
    let me = std::process::id();
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(19).map(String::from))
        })
        .unwrap_or_default();
    let _ = std::fs::create_dir_all(c.run.fabric.join("port"));
    let tmp = record.with_extension("tmp");
    if std::fs::write(&tmp, format!("pid={me}\nstart={start}\n"))
        .and_then(|_| std::fs::rename(&tmp, &record))
        .is_err()
    {
        c.fail(format!("cannot write {}", record.display()));
        return;
    }
    // Every cell that touches the failed host: the NIC on cuda:1's switch
    // first, from both ends, then the rest.
    let all: Vec<usize> = (0..c.hosts.len()).collect();
    let mut cells = vec![
        matrix::Cell {
            from: victim,
            to: peer,
            local: "cuda:1".into(),
            remote: "cuda:1".into(),
        },
        matrix::Cell {
            from: peer,
            to: victim,
            local: "cpu:0".into(),
            remote: "cuda:1".into(),
        },
        matrix::Cell {
            from: victim,
            to: peer,
            local: "cpu:0".into(),
            remote: "cpu:0".into(),
        },
    ];
    cells.extend(
        matrix::cells(&c.hosts, &all)
            .into_iter()
            .filter(|cell| cell.from == victim || cell.to == victim),
    );
    println!("{}", matrix::header());
    let (mut avoided, mut retried) = (0, 0);
    for cell in &cells {
        let seed = c.seed();
        // At the failed host, the rules' NICs without the failed one (the
        // next closest where it was the only one). At the other end, the
        // rules' NICs or some of them: until a peer's NIC has failed three
        // times in a row (then it is paused), slices sent toward it fail
        // and move to other pairs, so its partner may carry nothing.
        let (location, other) = if cell.from == victim {
            (&cell.local, cell.to)
        } else {
            (&cell.remote, cell.from)
        };
        let rules_nics = c.hosts[victim]
            .machine
            .nearest(location, &c.hosts[other].machine.link_layers());
        let instead: std::collections::BTreeSet<String> = c.hosts[victim]
            .machine
            .nearest_without(
                location,
                &c.hosts[other].machine.link_layers(),
                std::slice::from_ref(&nic),
            )
            .into_iter()
            .collect();
        let at_victim = cell.from == victim;
        let other_nics = std::cell::RefCell::new(None);
        let row = matrix::run_adjusted(&mut c.hosts, cell, seed, &|want| {
            let (side, other) = if at_victim {
                (&mut want.local_nics, &mut want.remote_nics)
            } else {
                (&mut want.remote_nics, &mut want.local_nics)
            };
            if side.is_some() {
                *side = Some(instead.clone());
            }
            *other_nics.borrow_mut() = other.take();
        });
        println!("{}", matrix::line(&c.hosts, &row));
        let what = format!(
            "{} -> {} ({} -> {}) with {nic} down",
            c.hosts[cell.from].name, c.hosts[cell.to].name, cell.local, cell.remote
        );
        if !row.wrong.is_empty() {
            c.fail(format!("{what}: {}", row.wrong.join("; ")));
            continue;
        }
        let g = &row.got;
        if g["transport"] != "rdma" || g["staged"] == true {
            continue;
        }
        let other_side = if at_victim {
            "remote_nics"
        } else {
            "local_nics"
        };
        let used: std::collections::BTreeSet<String> = g[other_side]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        if let Some(allowed) = other_nics.borrow().as_ref() {
            if used.is_empty() || !used.is_subset(allowed) {
                c.fail(format!(
                    "{what}: NICs at the other end {used:?}, expected some of {allowed:?}"
                ));
                continue;
            }
        }
        // Where the failed NIC was a rail: it carried nothing, the others
        // every byte of the write and the read.
        let side = if at_victim {
            "local_nics"
        } else {
            "remote_nics"
        };
        let carried = g[side][&nic].as_u64().unwrap_or(0);
        let total: u64 = g[side]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        if carried != 0 || total != 2 * c.opts.cell {
            c.fail(format!(
                "{what}: {nic} carried {carried} B, all NICs {total} B (expected 0 and {})",
                2 * c.opts.cell
            ));
        } else if rules_nics.contains(&nic) {
            avoided += 1;
            retried += g["retried"].as_u64().unwrap_or(0);
        }
    }
    println!(
        "\n{avoided} verified cells had {nic} among their rails: it carried nothing, the next \
         closest NICs everything ({retried} slices retried on another NIC pair along the way)"
    );
    let _ = std::fs::remove_file(&record);
    println!("{nic} is back (its record removed); the host is killed next, which resets it");
}

/// A host is SIGKILLed: its segment leaves etcd within the lease, requests
/// to it fail cleanly, the others carry on; then (`restart`) it comes back
/// and is found again by name.
pub fn kill_host(c: &mut Cluster, restart: bool) {
    let victim = host_index(c, "gpu1").unwrap_or(1);
    let name = c.hosts[victim].name.clone();
    let survivors: Vec<usize> = (0..c.hosts.len()).filter(|&i| i != victim).collect();
    section(&format!("fault: {name} is SIGKILLed"));
    let t = Instant::now();
    if let Some(mut n) = c.hosts[victim].node.take() {
        println!("kill -9 {} ({name}'s node)", n.pid());
        n.kill();
    }
    // Requests to it fail cleanly, at once, from every survivor.
    let ok_codes = ["CONNECTION", "TIMEOUT", "NOT_FOUND", "UNAVAILABLE"];
    for &s in &survivors {
        let seed = c.seed();
        let t1 = Instant::now();
        let a = ask(&mut c.hosts[s], &format!("xfer {name} cpu:0 cpu:0 {seed}"));
        let code = a["code"].as_str().unwrap_or("");
        println!(
            "{:<6} -> {name}: {} after {:.0} ms: {} {}",
            c.hosts[s].name,
            if a["ok"] == true {
                "SUCCEEDED"
            } else {
                "failed"
            },
            t1.elapsed().as_secs_f64() * 1e3,
            code,
            a["error"].as_str().unwrap_or("")
        );
        if a["ok"] == true || !ok_codes.contains(&code) {
            let who = c.hosts[s].name.clone();
            c.fail(format!(
                "{who} -> killed {name}: expected a clean failure, got {a}"
            ));
        }
    }
    // Its segment leaves etcd within the lease.
    let first = survivors[0];
    let gone = ask(
        &mut c.hosts[first],
        &format!("gone {name} {}", c.opts.ttl_s * 10_000),
    );
    let after = t.elapsed().as_secs_f64();
    if gone["ok"] == true {
        println!(
            "{name}'s segment left etcd {after:.2} s after the kill (lease {} s)",
            c.opts.ttl_s
        );
        if after > c.opts.ttl_s as f64 + 2.0 {
            c.fail(format!(
                "{name}'s segment left etcd after {after:.2} s, beyond its {} s lease",
                c.opts.ttl_s
            ));
        }
    } else {
        c.fail(format!("{name}'s segment did not leave etcd: {gone}"));
    }
    let first_name = c.hosts[first].name.clone();
    let a = ask(&mut c.hosts[first], &format!("open {name}"));
    println!(
        "{first_name} opens {name} by name now: {} {}",
        a["code"].as_str().unwrap_or(""),
        a["error"].as_str().unwrap_or("")
    );
    if a["code"] != "NOT_FOUND" {
        c.fail(format!(
            "opening the dead {name}: expected NOT_FOUND, got {a}"
        ));
    }

    section(&format!("the {} others carry on", survivors.len()));
    let cells = matrix::cells(&c.hosts, &survivors);
    c.matrix(&cells);

    if !restart {
        return;
    }
    section(&format!("{name} restarts and is found again by name"));
    let t = Instant::now();
    if let Err(e) = c.start_node(victim, c.extra_per_host) {
        c.fail(format!("restarting {name}: {e}"));
        return;
    }
    println!(
        "{name} ready again after {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let all: Vec<usize> = (0..c.hosts.len()).collect();
    let cells: Vec<matrix::Cell> = matrix::cells(&c.hosts, &all)
        .into_iter()
        .filter(|cell| cell.from == victim || cell.to == victim)
        .collect();
    c.matrix(&cells);
}

/// etcd stops for 10 s: transfers between open segments go on, a fresh
/// lookup fails with a clear error, and every engine is listed again
/// once etcd is back.
pub fn etcd_outage(c: &mut Cluster) {
    section("fault: etcd stopped for 10 s");
    let t = Instant::now();
    c.etcd.stop();
    println!("etcd stopped");
    let from = 0;
    let others: Vec<usize> = (1..c.hosts.len()).collect();
    let cells: Vec<matrix::Cell> = matrix::cells(
        &c.hosts,
        &[from].iter().chain(&others).copied().collect::<Vec<_>>(),
    )
    .into_iter()
    .filter(|cell| cell.from == from)
    .collect();
    println!("transfers between segments already open, during the outage:");
    c.matrix(&cells);
    let peer = c.hosts[1].name.clone();
    let t1 = Instant::now();
    let a = ask(&mut c.hosts[0], &format!("open {peer}"));
    println!(
        "{} opens {peer} afresh during the outage: {} after {:.0} ms: {}",
        c.hosts[0].name,
        a["code"].as_str().unwrap_or("ok"),
        t1.elapsed().as_secs_f64() * 1e3,
        a["error"].as_str().unwrap_or("")
    );
    if a["ok"] == true || a["code"] != "CONNECTION" {
        c.fail(format!(
            "a lookup during the etcd outage: expected a CONNECTION error, got {a}"
        ));
    }
    let left = Duration::from_secs(10).saturating_sub(t.elapsed());
    std::thread::sleep(left);
    let relaunch = t.elapsed();
    if let Err(e) = c.etcd.launch() {
        c.fail(format!("restarting etcd: {e}"));
        return;
    }
    let back = Instant::now();
    println!(
        "etcd started again {:.1} s after it stopped, and answered {:.1} s later",
        relaunch.as_secs_f64(),
        (t.elapsed() - relaunch).as_secs_f64()
    );
    let want = c.hosts.len() * (1 + c.extra_per_host);
    let mut listed = 0;
    while back.elapsed() < Duration::from_secs(60) {
        listed = names_listed(&ask(&mut c.hosts[0], "segments")).len();
        if listed == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if listed == want {
        println!(
            "all {want} engines listed again {:.2} s after etcd answered",
            back.elapsed().as_secs_f64()
        );
    } else {
        c.fail(format!(
            "after the outage etcd lists {listed} engines, expected {want}"
        ));
    }
    // Still there after twice the lease: their keepers renew them again
    // (etcd extends the leases it restores by one TTL, no more).
    std::thread::sleep(Duration::from_secs(2 * c.opts.ttl_s));
    let listed = names_listed(&ask(&mut c.hosts[0], "segments")).len();
    println!(
        "{listed} engines listed {} s later (twice the lease): the keepers renew them",
        2 * c.opts.ttl_s
    );
    if listed != want {
        c.fail(format!(
            "{listed} engines listed twice the lease after the outage, expected {want}"
        ));
    }
    let a = ask(&mut c.hosts[0], &format!("open {peer}"));
    if a["ok"] != true {
        c.fail(format!("opening {peer} after the outage: {a}"));
    }
    let all: Vec<usize> = (0..c.hosts.len()).collect();
    let cells: Vec<matrix::Cell> = matrix::cells(&c.hosts, &all)
        .into_iter()
        .filter(|cell| cell.from == 0 && cell.to == 1)
        .collect();
    c.matrix(&cells);
}

/// A host whose token differs: it starts and registers, but nobody talks
/// to it and it talks to nobody; the others are unaffected.
pub fn bad_token(c: &mut Cluster) {
    section("bad input: a host whose token differs");
    let index = c.hosts.len();
    let extra = vec![(
        "FERRY_AUTH_TOKEN".to_string(),
        "not-the-cluster-token".to_string(),
    )];
    let Ok(i) = c.add_host("badtok", Kind::CpuRdma, index, extra) else {
        c.fail("cannot add the badtok host".into());
        return;
    };
    if let Err(e) = c.start_node(i, 0) {
        c.fail(format!("badtok did not start: {e}"));
        return;
    }
    let seed = c.seed();
    let a = ask(&mut c.hosts[0], &format!("xfer badtok cpu:0 cpu:0 {seed}"));
    println!(
        "{} -> badtok: {} {}",
        c.hosts[0].name,
        a["code"].as_str().unwrap_or("ok"),
        a["error"].as_str().unwrap_or("")
    );
    if a["ok"] == true || a["code"] != "PERMISSION" {
        c.fail(format!(
            "a transfer to a host with another token: expected PERMISSION, got {a}"
        ));
    }
    let first = c.hosts[0].name.clone();
    let seed = c.seed();
    let a = ask(&mut c.hosts[i], &format!("xfer {first} cpu:0 cpu:0 {seed}"));
    println!(
        "badtok -> {first}: {} {}",
        a["code"].as_str().unwrap_or("ok"),
        a["error"].as_str().unwrap_or("")
    );
    if a["ok"] == true || a["code"] != "PERMISSION" {
        c.fail(format!(
            "a transfer from a host with another token: expected PERMISSION, got {a}"
        ));
    }
    if let Some(n) = c.hosts[i].node.take() {
        n.quit();
    }
    unaffected(c, i);
}

/// A host whose rdma plugin is a broken file: it says why, runs on tcp,
/// and everyone else reaches it over tcp; the others are unaffected.
pub fn broken_plugin(c: &mut Cluster) {
    section("bad input: a host with a broken plugin");
    let broken = c.run.dir.join("broken");
    let plugins = c
        .env
        .iter()
        .find(|(k, _)| k == "FERRY_PLUGIN_PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let made = std::fs::create_dir_all(&broken).and_then(|_| {
        // The first 4 KiB of the real plugin: an ELF header, no body.
        let real = std::fs::read(crate::build_dir().join("libferry_transport_rdma.so"))?;
        std::fs::write(
            broken.join("libferry_transport_rdma.so"),
            &real[..real.len().min(4096)],
        )
    });
    if let Err(e) = made {
        c.fail(format!("cannot make the broken plugin: {e}"));
        return;
    }
    let index = c.hosts.len();
    let extra = vec![(
        "FERRY_PLUGIN_PATH".to_string(),
        format!("{}:{plugins}", broken.display()),
    )];
    let Ok(i) = c.add_host("badplg", Kind::CpuRdma, index, extra) else {
        c.fail("cannot add the badplg host".into());
        return;
    };
    c.hosts[i].rdma = false;
    if let Err(e) = c.start_node(i, 0) {
        c.fail(format!("badplg did not start: {e}"));
        return;
    }
    let ready = c.hosts[i]
        .node
        .as_ref()
        .map(|n| n.ready.clone())
        .unwrap_or_default();
    let rdma = ready["not_enabled"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "rdma")
        .cloned();
    match rdma {
        Some(p) => println!(
            "badplg started with transports {}; rdma {}: {}",
            ready["transports"],
            p["state"].as_str().unwrap_or(""),
            p["reason"].as_str().unwrap_or("")
        ),
        None => c.fail(format!(
            "badplg: its broken rdma plugin is not reported: {ready}"
        )),
    }
    let all: Vec<usize> = (0..c.hosts.len())
        .filter(|&h| c.hosts[h].node.is_some())
        .collect();
    let cells: Vec<matrix::Cell> = matrix::cells(&c.hosts, &all)
        .into_iter()
        .filter(|cell| cell.from == i || cell.to == i)
        .collect();
    c.matrix(&cells);
    if let Some(n) = c.hosts[i].node.take() {
        n.quit();
    }
    unaffected(c, i);
}

/// One row of the matrix between the good hosts, after a bad one.
fn unaffected(c: &mut Cluster, bad: usize) {
    let good: Vec<usize> = (0..c.hosts.len())
        .filter(|&h| h != bad && c.hosts[h].node.is_some())
        .collect();
    let cells: Vec<matrix::Cell> = matrix::cells(&c.hosts, &good)
        .into_iter()
        .filter(|cell| cell.from == good[0])
        .collect();
    println!("the others, unaffected:");
    c.matrix(&cells);
}
