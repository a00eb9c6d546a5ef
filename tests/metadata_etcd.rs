//! Segments found by name through a real etcd: three engines in three
//! processes register, find each other and transfer in a ring; a SIGKILLed
//! engine's segment disappears with its lease; etcd restarted with its data
//! wiped gets every live engine back, with no engine restarted.
//!
//! Needs the `etcd` binary (Debian: etcd-server; scripts/test installs it).
//! Each bounded wait below is a hang guard, not a timing assertion: the
//! lease TTL is 2 s and the guards allow many times that.

use ferry_tests::{built, ferry_bin, free_port};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TTL_S: &str = "2";
const LEN: usize = 1 << 20;

/// An etcd server on loopback with its own data directory.
struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client: u16,
    peer: u16,
}

impl Etcd {
    fn start() -> Etcd {
        let mut e = Etcd {
            child: None,
            dir: tempfile::tempdir().unwrap(),
            client: free_port(),
            peer: free_port(),
        };
        e.launch();
        e
    }

    fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client)
    }

    fn launch(&mut self) {
        let bin = which("etcd").unwrap_or_else(|| {
            panic!(
                "etcd is not installed: run scripts/test (it installs Debian's etcd-server) \
                 or `apt-get install etcd-server`"
            )
        });
        let client = format!("http://127.0.0.1:{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new(bin)
            .args(["--name", "ferry-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("ferry-test={peer}")])
            .args(["--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        // Ready when `ferry segments` can list (an empty list is fine).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if segments(&self.url()).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "etcd did not start within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops etcd, removes everything it stored, starts it again.
    fn restart_wiped(&mut self) {
        self.stop();
        std::fs::remove_dir_all(self.dir.path().join("data")).unwrap();
        self.launch();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn which(cmd: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(cmd))
            .find(|p| p.is_file())
    })
}

/// `ferry segments --json` against this store: the registered names.
fn segments(url: &str) -> Result<Vec<String>, String> {
    let out = Command::new(ferry_bin())
        .args(["segments", "--json"])
        .env("FERRY_METADATA", url)
        .env("FERRY_CONNECT_TIMEOUT_MS", "1000")
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(v.as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect())
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// One engine process (tests/src/bin/ferry-test-node.rs).
struct Node {
    name: String,
    inbox: u64,
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Node {
    fn start(url: &str, name: &str, seed: u64) -> Node {
        let mut child = Command::new(built("ferry-test-node"))
            .args([seed.to_string(), LEN.to_string()])
            .env("FERRY_METADATA", url)
            .env("FERRY_METADATA_TTL_S", TTL_S)
            .env("FERRY_NAME", name)
            .env("FERRY_TRANSPORTS", "tcp")
            .env("FERRY_TIMEOUT_MS", "5000")
            .env("FERRY_CONNECT_TIMEOUT_MS", "2000")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut n = Node {
            name: name.to_string(),
            inbox: 0,
            child,
            stdin,
            lines,
        };
        let ready = n.line();
        let words: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"ready"), "{name}: {ready}");
        assert_eq!(words[1], name);
        n.inbox = words[3].parse().unwrap();
        n
    }

    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{}: no answer within 60 s", self.name))
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.line()
    }

    fn ring_to(&mut self, next: &Node) -> String {
        self.ask(&format!("ring {} {}", next.name, next.inbox))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn engines_find_each_other_by_name_through_etcd_and_survive_its_loss() {
    let mut etcd = Etcd::start();
    let url = etcd.url();
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| Node::start(&url, &format!("node-{i}"), i + 1))
        .collect();
    let mut listed = segments(&url).unwrap();
    listed.sort();
    assert_eq!(listed, ["node-0", "node-1", "node-2"]);

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
        segments(&url).is_ok_and(|l| !l.contains(&"node-2".to_string()))
    });
    eprintln!("node-2's segment disappeared {gone:?} after SIGKILL (lease TTL {TTL_S} s)");
    let e = nodes[0].ask("open node-2");
    assert!(
        e.starts_with("open error") && e.contains("no such segment"),
        "{e}"
    );

    // etcd goes away: segments already open keep working.
    etcd.stop();
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
            segments(&url).is_ok_and(|mut l| {
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

#[test]
fn unreachable_etcd_at_start_is_a_clear_error() {
    let port = free_port();
    let out = Command::new(built("ferry-test-node"))
        .args(["1", "4096"])
        .env("FERRY_METADATA", format!("etcd://127.0.0.1:{port}"))
        .env("FERRY_CONNECT_TIMEOUT_MS", "500")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("fatal") && text.contains(&format!("127.0.0.1:{port}")),
        "{text}"
    );
    // And `ferry segments` without a store says what to configure.
    let out = Command::new(ferry_bin())
        .arg("segments")
        .env_remove("FERRY_METADATA")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("FERRY_METADATA"));
}
