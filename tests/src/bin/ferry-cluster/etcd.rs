//! The one etcd of the cluster, on a host (namespace) of its own.

use crate::netns::{self, Run};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    ns: String,
    pub addr: String,
    data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Etcd {
    pub fn start(run: &Run, octet: u8) -> Result<Etcd, String> {
        let ns = run.add_host("etcd", octet)?;
        let mut e = Etcd {
            ns,
            addr: format!("{}.{octet}:2379", netns::SUBNET),
            data: run.dir.join("etcd"),
            log: run.dir.join("logs/etcd.log"),
            child: None,
        };
        e.launch()?;
        Ok(e)
    }

    /// `etcd://...` for FERRY_METADATA.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.addr)
    }

    /// Starts etcd (on its existing data after a stop) and waits until it
    /// reports healthy.
    pub fn launch(&mut self) -> Result<(), String> {
        let client = format!("http://{}", self.addr);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, "etcd", "--name", "ferry-cluster"])
            .arg("--data-dir")
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-cluster", "ferry-cluster=http://127.0.0.1:2380"])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        netns::unblock_signals_in_child(&mut cmd);
        let child = cmd.spawn().map_err(|e| format!("cannot start etcd: {e}"))?;
        netns::record_pid(child.id());
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.healthy() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                // The run's folder goes away on exit: say why here.
                let text = std::fs::read_to_string(&self.log).unwrap_or_default();
                let why = text
                    .lines()
                    .find(|l| l.contains(" C | ") || l.starts_with("panic:"))
                    .or_else(|| text.lines().rfind(|l| !l.trim().is_empty()))
                    .unwrap_or("(its log is empty)");
                return Err(format!("etcd exited ({status}) before answering: {why}"));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "etcd did not report healthy within 30 s; see {}",
                    self.log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether etcd's /health says true, asked from inside its namespace.
    fn healthy(&self) -> bool {
        let addr = self.addr.clone();
        netns::in_namespace(&self.ns, move || {
            let Ok(mut s) =
                TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_millis(500))
            else {
                return None;
            };
            s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            s.write_all(b"GET /health HTTP/1.0\r\n\r\n").ok()?;
            let mut body = String::new();
            s.read_to_string(&mut body).ok()?;
            Some(body.contains("\"health\":\"true\""))
        })
        .ok()
        .flatten()
        .unwrap_or(false)
    }

    /// Stops etcd (SIGTERM, then SIGKILL); its data stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) of the etcd this run started.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
