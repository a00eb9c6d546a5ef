//! Segments found by name through a real etcd: three engines in three
//! processes register, find each other and transfer in a ring; a SIGKILLed
//! engine's segment disappears with its lease; etcd restarted with its data
//! wiped gets every live engine back, with no engine restarted.
//!
//! Needs `etcd` and `etcdctl` (Debian: etcd-server, etcd-client; scripts/test
//! installs them).
//! Each bounded wait below is a hang guard, not a timing assertion: the
//! lease TTL is 2 s and the guards allow many times that.

use ferry_tests::etcd::{segments, EtcdCluster};
use ferry_tests::ferry_bin;
use ferry_tests::node::Node;
use std::process::Command;
use std::time::{Duration, Instant};

const TTL_S: &str = "2";
const LEN: usize = 1 << 20;

fn start_node(url: &str, name: &str, seed: u64) -> Node {
    Node::start(
        seed,
        LEN,
        &[
            ("FERRY_METADATA", url),
            ("FERRY_METADATA_TTL_S", TTL_S),
            ("FERRY_NAME", name),
            ("FERRY_TIMEOUT_MS", "5000"),
            ("FERRY_CONNECT_TIMEOUT_MS", "2000"),
        ],
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn listed(url: &str) -> Result<Vec<String>, String> {
    segments(url, 1000)
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

#[test]
fn engines_find_each_other_by_name_through_etcd_and_survive_its_loss() {
    let mut etcd = EtcdCluster::start(1);
    let url = etcd.url();
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| start_node(&url, &format!("node-{i}"), i + 1))
        .collect();
    let mut names = listed(&url).unwrap();
    names.sort();
    assert_eq!(names, ["node-0", "node-1", "node-2"]);

    // A ring: node i writes its data into node i+1's inbox, by name.
    for i in 0..3 {
        let next = (i + 1) % 3;
        let (a, b) = if i < next {
            let (l, r) = nodes.split_at_mut(next);
            (&mut l[i], &r[0])
        } else {
            let (l, r) = nodes.split_at_mut(i);
            (&mut r[0], &l[next])
        };
        assert_eq!(a.ring_to(b), "ring ok", "node-{i} -> node-{next}");
    }
    for i in 0..3u64 {
        let prev = (i + 2) % 3;
        let n = &mut nodes[i as usize];
        assert_eq!(
            n.ask(&format!("check {}", prev + 1)),
            "check ok",
            "node-{i}"
        );
    }

    // An unknown name is a clear error.
    let e = nodes[0].ask("open node-9");
    assert!(e.contains("no such segment"), "{e}");

    // SIGKILL node-2: its segment goes with its lease.
    let mut dead = nodes.pop().unwrap();
    dead.child.kill().unwrap();
    let _ = dead.child.wait();
    let gone = wait_for("node-2 gone from etcd", Duration::from_secs(30), || {
        listed(&url).is_ok_and(|l| !l.contains(&"node-2".to_string()))
    });
    eprintln!("node-2's segment disappeared {gone:?} after SIGKILL (lease TTL {TTL_S} s)");
    let e = nodes[0].ask("open node-2");
    assert!(
        e.starts_with("open error") && e.contains("no such segment"),
        "{e}"
    );

    // etcd goes away: segments already open keep working.
    etcd.kill(0);
    {
        let (l, r) = nodes.split_at_mut(1);
        assert_eq!(
            l[0].ring_to(&r[0]),
            "ring ok",
            "node-0 -> node-1 with etcd down"
        );
    }
    // etcd comes back empty: the live engines register again by themselves.
    etcd.restart_wiped();
    let back = wait_for(
        "node-0 and node-1 back in etcd",
        Duration::from_secs(60),
        || {
            listed(&url).is_ok_and(|mut l| {
                l.sort();
                l == ["node-0", "node-1"]
            })
        },
    );
    eprintln!("live engines re-registered {back:?} after etcd restarted wiped");
    assert_eq!(nodes[1].ask("open node-0"), "open ok");
    {
        let (l, r) = nodes.split_at_mut(1);
        assert_eq!(
            r[0].ring_to(&l[0]),
            "ring ok",
            "node-1 -> node-0 after restart"
        );
        assert_eq!(
            l[0].ring_to(&r[0]),
            "ring ok",
            "node-0 -> node-1 after restart"
        );
    }
    assert_eq!(nodes[0].ask("check 2"), "check ok");
    assert_eq!(nodes[1].ask("check 1"), "check ok");
}

/// An engine whose etcd is down still starts; its look-ups say why they
/// fail, and it registers by itself once etcd answers.
#[test]
fn an_engine_starts_without_etcd_and_registers_when_it_answers() {
    let mut etcd = EtcdCluster::planned(1);
    let url = etcd.url();
    let endpoint = etcd.endpoint(0);
    let mut node = Node::start(
        1,
        4096,
        &[
            ("FERRY_METADATA", url.as_str()),
            ("FERRY_METADATA_TTL_S", TTL_S),
            ("FERRY_CONNECT_TIMEOUT_MS", "500"),
        ],
    )
    .expect("an engine starts while etcd is down");
    let e = node.ask("open node-0");
    assert!(
        e.starts_with("open error")
            && e.contains(&format!(
                "cannot reach etcd (0 of 1 members reachable: {endpoint} unreachable \
                 (connection refused))"
            )),
        "{e}"
    );
    let e = segments(&url, 500).unwrap_err();
    assert!(e.contains("cannot reach etcd"), "{e}");

    etcd.start_all();
    let name = node.name.clone();
    let took = wait_for("the engine registered", Duration::from_secs(30), || {
        listed(&url).is_ok_and(|l| l.contains(&name))
    });
    eprintln!("registered {took:?} after etcd answered (lease TTL {TTL_S} s)");

    // And `ferry segments` without a store says what to configure.
    let out = Command::new(ferry_bin())
        .arg("segments")
        .env_remove("FERRY_METADATA")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("FERRY_METADATA"));
}
