//! Drives one `ferry-test-node` process (src/bin/ferry-test-node.rs): an
//! engine configured by FERRY_* variables, answering one line per command.

use crate::built;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct Node {
    /// Its segment name, as it reported it.
    pub name: String,
    /// The address of its `inbox` buffer.
    pub inbox: u64,
    pub child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Node {
    /// Starts a node with a `src` buffer filled with pattern(`seed`) and
    /// an `inbox`, both `len` bytes, and the given variables (FERRY_NAME,
    /// FERRY_METADATA, ...); returns once it printed `ready`, or the line it
    /// printed instead (`fatal ...`).
    pub fn start(seed: u64, len: usize, envs: &[(&str, &str)]) -> Result<Node, String> {
        let mut child = Command::new(built("ferry-test-node"))
            .args([seed.to_string(), len.to_string()])
            .env("FERRY_TRANSPORTS", "tcp")
            .envs(envs.iter().copied())
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
            name: String::new(),
            inbox: 0,
            child,
            stdin,
            lines,
        };
        let ready = n.line();
        let words: Vec<&str> = ready.split_whitespace().collect();
        if words.first() != Some(&"ready") || words.len() < 4 {
            return Err(ready);
        }
        n.name = words[1].to_string();
        n.inbox = words[3].parse().unwrap();
        Ok(n)
    }

    pub fn line(&mut self) -> String {
        match self.lines.recv_timeout(Duration::from_secs(60)) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("node {}: no answer within 60 s", self.name)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!("node {}: exited without answering", self.name)
            }
        }
    }

    /// Asks the node to stop (its engine withdraws its segment) and waits.
    pub fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }

    pub fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.line()
    }

    /// Writes this node's data into `next`'s inbox by name, and reads it
    /// back: "ring ok" or "ring error ...".
    pub fn ring_to(&mut self, next: &Node) -> String {
        self.ask(&format!("ring {} {}", next.name, next.inbox))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
