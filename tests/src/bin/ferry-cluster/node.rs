//! A host's node process (`ferry-cluster-node`) as the driver sees it:
//! started inside the host's network namespace with its own IPC and UTS
//! namespaces and its fixture bind-mounted where every host looks for it,
//! so every node runs with exactly the same environment; commands go in on
//! stdin, JSON answers come back on stdout.

use crate::netns;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How a node is started: the same for every host but for `env_extra`
/// (the bad-input hosts only).
pub struct Launch<'a> {
    pub bin: &'a Path,
    pub ns: &'a str,
    pub hostname: &'a str,
    /// The host's fixture directory, mounted on `mount_point`.
    pub fixture: &'a Path,
    pub mount_point: &'a Path,
    pub env: &'a [(String, String)],
    pub env_extra: &'a [(String, String)],
    pub cell: u64,
    pub extra_engines: usize,
    pub log: PathBuf,
}

pub struct Node {
    pub name: String,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pub ready: Value,
}

impl Node {
    /// Starts the node and waits for its first line (`ready` or `fatal`).
    pub fn start(l: &Launch<'_>) -> Result<Node, String> {
        let log = std::fs::File::create(&l.log).map_err(|e| format!("{}: {e}", l.log.display()))?;
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns", "exec", l.ns, "unshare", "--ipc", "--uts", "--", "sh", "-c",
        ])
        .arg(r#"hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@""#)
        .arg("sh")
        .arg(l.hostname)
        .arg(l.fixture)
        .arg(l.mount_point)
        .arg(l.bin)
        .arg(l.hostname)
        .arg(l.cell.to_string())
        .arg(l.extra_engines.to_string())
        .env_clear()
        .envs(l.env.iter().cloned())
        .envs(l.env_extra.iter().cloned())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log);
        netns::unblock_signals_in_child(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the node for {}: {e}", l.hostname))?;
        netns::record_pid(child.id());
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut node = Node {
            name: l.hostname.to_string(),
            child,
            stdin,
            lines: rx,
            ready: Value::Null,
        };
        let first = node
            .next(Duration::from_secs(120))
            .map_err(|e| format!("{}: {e}; its log: {}", l.hostname, l.log.display()))?;
        if first["event"] != "ready" {
            return Err(format!(
                "{} did not start: {} {}; its log: {}",
                l.hostname,
                first["code"].as_str().unwrap_or(""),
                first["error"].as_str().unwrap_or(&first.to_string()),
                l.log.display()
            ));
        }
        node.ready = first;
        Ok(node)
    }

    fn next(&mut self, timeout: Duration) -> Result<Value, String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                serde_json::from_str(&line).map_err(|e| format!("bad answer {line:?}: {e}"))
            }
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("no answer within {} s (hung?)", timeout.as_secs()))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.try_wait().ok().flatten();
                Err(format!("the node exited ({status:?})"))
            }
        }
    }

    /// Sends one command and waits for its answer; `timeout` is a hang
    /// guard, never a performance limit.
    pub fn ask(&mut self, command: &str, timeout: Duration) -> Result<Value, String> {
        writeln!(self.stdin, "{command}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| format!("{}: cannot send {command:?}: {e}", self.name))?;
        self.next(timeout)
            .map_err(|e| format!("{}: {command}: {e}", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Asks the node to quit, and waits (killed after 10 s).
    pub fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}
