//! What each cell of the matrix must show, decided from the two hosts'
//! fixtures by rules, never from a stored answer:
//!
//! - rdma when both hosts have RDMA NICs that share a link layer
//!   (InfiniBand with InfiniBand, RoCE with RoCE), tcp otherwise;
//! - over rdma, the NICs used at each end are exactly those the fixture
//!   ranks nearest to that end's buffer (smallest path class, then fastest,
//!   every one that ties: the rails) among NICs that can reach the other
//!   end; GPU memory goes directly (DMA-BUF) when the GPU's nearest NIC
//!   is at PXB or closer (the engine's per-GPU decision), otherwise
//!   through pinned host memory;
//! - over tcp, device memory is staged through pinned host memory and the
//!   bytes leave through the host's interface (eth0);
//! - every byte verified, by reading back and at the target.

use crate::hosts::Machine;
use ferry_core::topology::PathClass;
use serde_json::Value;
use std::collections::BTreeSet;

/// One host as the rules see it.
pub struct Side<'a> {
    pub machine: &'a Machine,
    /// False where rdma cannot run although the fixture has NICs (the
    /// broken-plugin host).
    pub rdma: bool,
}

impl Side<'_> {
    fn links(&self) -> Vec<String> {
        if self.rdma {
            self.machine.link_layers()
        } else {
            Vec::new()
        }
    }
}

#[derive(Debug)]
pub struct Expect {
    pub transport: &'static str,
    /// Whether a GPU buffer of this cell is staged through host memory.
    pub staged: bool,
    /// For direct rdma: the NICs each end must use.
    pub local_nics: Option<BTreeSet<String>>,
    pub remote_nics: Option<BTreeSet<String>>,
}

/// Whether memory at `location` goes directly: host memory always, GPU
/// memory when the GPU's nearest RDMA NIC is at PXB or closer.
fn direct(m: &Machine, location: &str) -> bool {
    !location.starts_with("cuda")
        || m.rdma.iter().any(|n| {
            m.class(location, &n.name)
                .is_some_and(|c| c <= PathClass::Pxb)
        })
}

pub fn expect(from: &Side<'_>, to: &Side<'_>, local: &str, remote: &str) -> Expect {
    let common: Vec<String> = from
        .links()
        .into_iter()
        .filter(|l| to.links().contains(l))
        .collect();
    if common.is_empty() {
        return Expect {
            transport: "tcp",
            staged: local.starts_with("cuda") || remote.starts_with("cuda"),
            local_nics: None,
            remote_nics: None,
        };
    }
    let here = from.machine.nearest(local, &to.links());
    let there = to.machine.nearest(remote, &from.links());
    let staged = !direct(from.machine, local) || !direct(to.machine, remote);
    Expect {
        transport: "rdma",
        staged,
        local_nics: (!staged).then(|| here.into_iter().collect()),
        remote_nics: (!staged).then(|| there.into_iter().collect()),
    }
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every way the answer `got` (a node's `xfer` reply) and the target's
/// `check` differ from `want`; empty when the cell is right.
pub fn judge(want: &Expect, got: &Value, check: &Value) -> Vec<String> {
    let mut wrong = Vec::new();
    if got["ok"] != true {
        wrong.push(format!(
            "failed: {} {}",
            got["code"].as_str().unwrap_or(""),
            got["error"].as_str().unwrap_or("")
        ));
        return wrong;
    }
    if check["ok"] != true {
        wrong.push(format!(
            "the target's memory: {}",
            check["error"].as_str().unwrap_or(&check.to_string())
        ));
    }
    let transport = got["transport"].as_str().unwrap_or("?");
    if transport != want.transport {
        wrong.push(format!(
            "transport {transport}, expected {}",
            want.transport
        ));
        return wrong;
    }
    let staged = got["staged"] == true;
    if staged != want.staged {
        wrong.push(format!(
            "{}, expected {}",
            if staged { "staged" } else { "direct" },
            if want.staged { "staged" } else { "direct" }
        ));
    }
    if let Some(nics) = &want.local_nics {
        let used = keys(&got["local_nics"]);
        if &used != nics {
            wrong.push(format!("NICs here {used:?}, expected {nics:?}"));
        }
    }
    if let Some(nics) = &want.remote_nics {
        let used = keys(&got["remote_nics"]);
        if &used != nics {
            wrong.push(format!("NICs at the peer {used:?}, expected {nics:?}"));
        }
    }
    if want.transport == "tcp" && got["interface"].as_str() != Some("eth0") {
        wrong.push(format!(
            "tcp left through {}, expected eth0",
            got["interface"]
        ));
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hosts::Kind;
    use serde_json::json;

    fn set(names: &[&str]) -> Option<BTreeSet<String>> {
        Some(names.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn the_rules_on_the_three_kinds_of_host() {
        let dir = tempfile::tempdir().unwrap();
        let dgx = Machine::write(Kind::Gpu, 0, &dir.path().join("a")).unwrap();
        let dgx2 = Machine::write(Kind::Gpu, 1, &dir.path().join("b")).unwrap();
        let cpu = Machine::write(Kind::CpuRdma, 2, &dir.path().join("c")).unwrap();
        let vm = Machine::write(Kind::Tcp, 3, &dir.path().join("d")).unwrap();
        let side = |m| Side {
            machine: m,
            rdma: true,
        };

        // NUMA node 0's four compute NICs, toward cuda:1's PCIe switch NIC.
        let e = expect(&side(&dgx), &side(&dgx2), "cpu:0", "cuda:1");
        assert_eq!(e.transport, "rdma");
        assert!(!e.staged);
        assert_eq!(e.local_nics, set(&["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5"]));
        assert_eq!(e.remote_nics, set(&["mlx5_3"]));

        // InfiniBand compute NICs cannot reach a RoCE host: the storage
        // ports of the GPU's NUMA node, toward the host's node-0 NIC.
        let e = expect(&side(&dgx), &side(&cpu), "cuda:2", "cpu:0");
        assert_eq!(e.transport, "rdma");
        assert_eq!(e.local_nics, set(&["mlx5_1", "mlx5_2"]));
        assert_eq!(e.remote_nics, set(&["mlx5_0"]));
        let e = expect(&side(&cpu), &side(&dgx), "cpu:1", "cuda:6");
        assert_eq!(e.local_nics, set(&["mlx5_1"]));
        assert_eq!(e.remote_nics, set(&["mlx5_7", "mlx5_8"]));

        // No NIC at one end: tcp, device memory staged.
        let e = expect(&side(&dgx), &side(&vm), "cuda:0", "cpu:0");
        assert_eq!((e.transport, e.staged), ("tcp", true));
        let e = expect(&side(&vm), &side(&cpu), "cpu:0", "cpu:0");
        assert_eq!((e.transport, e.staged), ("tcp", false));
        // rdma broken at a host whose fixture has NICs: tcp too.
        let broken = Side {
            machine: &cpu,
            rdma: false,
        };
        assert_eq!(
            expect(&side(&dgx), &broken, "cpu:0", "cpu:0").transport,
            "tcp"
        );
    }

    #[test]
    fn a_cell_is_wrong_in_every_way_it_differs() {
        let want = Expect {
            transport: "rdma",
            staged: false,
            local_nics: set(&["mlx5_3"]),
            remote_nics: set(&["mlx5_3"]),
        };
        let ok = json!({"ok": true});
        let got = json!({"ok": true, "transport": "rdma", "staged": false,
            "local_nics": {"mlx5_3": 16}, "remote_nics": {"mlx5_3": 16}});
        assert!(judge(&want, &got, &ok).is_empty());
        let other = json!({"ok": true, "transport": "rdma", "staged": false,
            "local_nics": {"mlx5_0": 16}, "remote_nics": {"mlx5_3": 16}});
        assert_eq!(judge(&want, &other, &ok).len(), 1);
        assert_eq!(judge(&want, &got, &json!({"ok": false})).len(), 1);
        let tcp = json!({"ok": true, "transport": "tcp", "staged": false});
        assert!(judge(&want, &tcp, &ok)[0].starts_with("transport tcp"));
        let failed = json!({"ok": false, "code": "CONNECTION", "error": "x"});
        assert!(judge(&want, &failed, &Value::Null)[0].starts_with("failed"));
    }
}
