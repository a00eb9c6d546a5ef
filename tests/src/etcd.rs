//! A real etcd cluster on loopback for the metadata tests, and an observer
//! that is not Ferry: `etcdctl` (Debian's etcd-server and etcd-client;
//! scripts/test installs both) tells which member leads, when the cluster
//! answers, and, through a watch, whether a key ever disappeared.

use crate::{ferry_bin, free_port};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `cmd`'s path on PATH, or a panic saying which package brings it.
fn tool(cmd: &str, package: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(cmd))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "{cmd} is not installed: run scripts/test (it installs Debian's {package}) or \
                 `apt-get install {package}`"
            )
        })
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// An etcd cluster of one or more members, each a process with its own
/// data directory under one temporary directory.
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    /// Client port with TLS and --client-cert-auth (`start_secure`).
    tls: Option<Pki>,
    /// etcdctl's own flags: certificates, and --user once auth is on.
    ctl: Vec<String>,
}

impl EtcdCluster {
    /// Starts `n` members and returns once the cluster answers a
    /// linearizable read.
    pub fn start(n: usize) -> EtcdCluster {
        let mut c = EtcdCluster::planned(n);
        c.start_all();
        c
    }

    /// A cluster of `n` members with their ports chosen, none started.
    pub fn planned(n: usize) -> EtcdCluster {
        EtcdCluster {
            dir: tempfile::tempdir().unwrap(),
            members: (0..n)
                .map(|i| Member {
                    name: format!("m{i}"),
                    client: free_port(),
                    peer: free_port(),
                    child: None,
                })
                .collect(),
            tls: None,
            ctl: Vec::new(),
        }
    }

    /// Starts `n` members serving clients over TLS only, with
    /// --client-cert-auth, trusting `pki`'s CA; peers talk plain HTTP.
    pub fn start_secure(n: usize, pki: &Pki) -> EtcdCluster {
        let mut c = EtcdCluster::planned(n);
        c.ctl = pki.etcdctl_flags();
        c.tls = Some(pki.clone());
        c.start_all();
        c
    }

    /// Turns etcd's users on: root (for etcdctl from now on), `user` with
    /// readwrite on every key under `prefix` (a role of its own), and each
    /// of `strangers` with no role. Every password is "<name>-password".
    pub fn enable_auth(&mut self, user: &str, prefix: &str, strangers: &[&str]) {
        let role = format!("{user}-rw");
        let mut steps: Vec<Vec<String>> = vec![
            vec![
                "user",
                "add",
                "root",
                "--new-user-password",
                "root-password",
            ],
            vec!["user", "grant-role", "root", "root"],
            vec!["user", "add", user, "--new-user-password"],
            vec!["role", "add", &role],
            vec![
                "role",
                "grant-permission",
                &role,
                "readwrite",
                prefix,
                "--prefix=true",
            ],
            vec!["user", "grant-role", user, &role],
        ]
        .into_iter()
        .map(|v| v.into_iter().map(str::to_string).collect())
        .collect();
        steps[2].push(format!("{user}-password"));
        for s in strangers {
            steps.push(vec![
                "user".into(),
                "add".into(),
                s.to_string(),
                "--new-user-password".into(),
                format!("{s}-password"),
            ]);
        }
        steps.push(vec!["auth".into(), "enable".into()]);
        for step in &steps {
            let args: Vec<&str> = step.iter().map(String::as_str).collect();
            self.etcdctl(&args)
                .unwrap_or_else(|e| panic!("etcdctl {}: {e}", step.join(" ")));
        }
        self.ctl
            .extend(["--user".into(), "root:root-password".into()]);
    }

    /// Starts every member; returns once the cluster answers.
    pub fn start_all(&mut self) {
        for i in 0..self.members.len() {
            self.launch(i);
        }
        self.wait_answering(Duration::from_secs(30));
    }

    fn launch(&mut self, i: usize) {
        let bin = tool("etcd", "etcd-server");
        let initial = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        // A token of its own: clusters of tests running side by side never
        // mistake each other's members for theirs.
        let token = format!("ferry-{}-{}", std::process::id(), self.members[0].peer);
        let m = &mut self.members[i];
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let mut cmd = Command::new(bin);
        if let Some(pki) = &self.tls {
            cmd.arg("--cert-file")
                .arg(pki.file("server.crt"))
                .arg("--key-file")
                .arg(pki.file("server.key"))
                .arg("--trusted-ca-file")
                .arg(pki.file("ca.crt"))
                .arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", &m.name, "--data-dir"])
            .arg(self.dir.path().join(&m.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-token", &token])
            .args(["--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        m.child = Some(child);
    }

    /// FERRY_METADATA for this cluster.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://{}", self.endpoints())
    }

    /// "127.0.0.1:A,127.0.0.1:B,..." (etcdctl --endpoints).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Member `i`'s client endpoint, "127.0.0.1:PORT".
    pub fn endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.members[i].client)
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data directory.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.launch(i);
    }

    /// Stops every member, removes everything they stored and starts a
    /// new cluster on the same ports (an etcd that lost its data).
    pub fn restart_wiped(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
            std::fs::remove_dir_all(self.dir.path().join(&self.members[i].name)).unwrap();
        }
        for i in 0..self.members.len() {
            self.launch(i);
        }
        self.wait_answering(Duration::from_secs(30));
    }

    /// etcdctl against every member, with a 1 s command timeout.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String, String> {
        etcdctl(&self.endpoints(), &self.ctl, args)
    }

    /// Whether a linearizable read succeeds now (the cluster has quorum).
    pub fn answers(&self) -> bool {
        self.etcdctl(&["get", "/ferry-test-probe"]).is_ok()
    }

    /// Polls `answers` every 50 ms; the time it took. Panics after `limit`
    /// (a hang guard).
    pub fn wait_answering(&self, limit: Duration) -> Duration {
        let start = Instant::now();
        while !self.answers() {
            assert!(
                start.elapsed() < limit,
                "etcd did not answer within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        start.elapsed()
    }

    /// The index of the member that leads now, as the members say.
    pub fn leader(&self) -> Option<usize> {
        // Only the members running: etcdctl fails as a whole when one of
        // its endpoints is down.
        let live: Vec<String> = (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .map(|i| self.endpoint(i))
            .collect();
        let text = etcdctl(
            &live.join(","),
            &self.ctl,
            &["endpoint", "status", "-w", "json"],
        )
        .ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let leader = v
            .as_array()?
            .iter()
            .find_map(|s| s["Status"]["leader"].as_u64())?;
        let ep = v.as_array()?.iter().find_map(|s| {
            (s["Status"]["header"]["member_id"].as_u64() == Some(leader))
                .then(|| s["Endpoint"].as_str().map(str::to_string))
                .flatten()
        })?;
        (0..self.members.len()).find(|&i| self.endpoint(i) == ep)
    }

    /// Waits (hang guard `limit`) until a leader is known.
    pub fn wait_leader(&self, limit: Duration) -> usize {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(start.elapsed() < limit, "no etcd leader within {limit:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// etcdctl against `endpoints`, with a 1 s command timeout.
fn etcdctl(endpoints: &str, flags: &[String], args: &[&str]) -> Result<String, String> {
    let out = Command::new(tool("etcdctl", "etcd-client"))
        .env("ETCDCTL_API", "3")
        .args(flags)
        .args(["--endpoints", endpoints, "--command-timeout", "1s"])
        .args(["--dial-timeout", "500ms"])
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `ferry segments --json` against `url`, with a deadline of `timeout_ms`
/// for each etcd call: the registered names, or the error it printed.
pub fn segments(url: &str, timeout_ms: u64) -> Result<Vec<String>, String> {
    segments_with(&[("FERRY_METADATA", url)], timeout_ms)
}

/// `segments` with the settings of `envs` (FERRY_METADATA and, for a
/// secure cluster, its certificates and user).
pub fn segments_with(envs: &[(&str, &str)], timeout_ms: u64) -> Result<Vec<String>, String> {
    let out = Command::new(ferry_bin())
        .args(["segments", "--json"])
        .envs(envs.iter().copied())
        .env("FERRY_CONNECT_TIMEOUT_MS", timeout_ms.to_string())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(v.as_array()
        .ok_or("segments --json: not a list")?
        .iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect())
}

#[derive(Default)]
struct Watched {
    /// Segment name -> whether its key exists, as the watch last said.
    present: HashMap<String, bool>,
    /// Names that must stay present, with what the sampler saw.
    live: HashMap<String, Gaps>,
    /// Every deletion the watch reported: (when, name).
    deletions: Vec<(Instant, String)>,
    samples: u64,
}

/// What the sampler saw of one name that had to stay present.
#[derive(Clone, Debug, Default)]
pub struct Gaps {
    /// 100 ms samples at which the key was missing.
    pub missing_samples: u64,
    /// The longest run of missing samples, as a duration.
    pub longest: Duration,
    since: Option<Instant>,
}

/// A watch on `<prefix>/segments/` through etcdctl (its own client, with
/// its own fail-over), and a sampler that checks every 100 ms that each
/// live name's key is present.
pub struct Watcher {
    child: Child,
    state: Arc<Mutex<Watched>>,
    stop: Arc<AtomicBool>,
    sampler: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    pub fn start(cluster: &EtcdCluster, prefix: &str) -> Watcher {
        use base64::Engine as _;
        let key_prefix = format!("{prefix}/segments/");
        let mut child = Command::new(tool("etcdctl", "etcd-client"))
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &cluster.endpoints()])
            .args(["watch", "--prefix", &key_prefix, "-w", "json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcdctl watch");
        let state = Arc::new(Mutex::new(Watched::default()));
        let stdout = child.stdout.take().unwrap();
        let (st, keys) = (state.clone(), key_prefix.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                let now = Instant::now();
                for ev in v["Events"].as_array().into_iter().flatten() {
                    let Some(key) = ev["kv"]["key"]
                        .as_str()
                        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok())
                    else {
                        continue;
                    };
                    let key = String::from_utf8_lossy(&key).into_owned();
                    let Some(name) = key.strip_prefix(&keys) else {
                        continue;
                    };
                    let deleted = ev["type"].as_u64() == Some(1);
                    let mut s = st.lock().unwrap();
                    s.present.insert(name.to_string(), !deleted);
                    if deleted {
                        s.deletions.push((now, name.to_string()));
                    }
                }
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (st, halt) = (state.clone(), stop.clone());
        let sampler = std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let now = Instant::now();
                let mut s = st.lock().unwrap();
                s.samples += 1;
                let Watched { present, live, .. } = &mut *s;
                for (name, gaps) in live.iter_mut() {
                    if present.get(name).copied().unwrap_or(false) {
                        if let Some(t) = gaps.since.take() {
                            gaps.longest = gaps.longest.max(now - t);
                        }
                    } else {
                        gaps.missing_samples += 1;
                        gaps.since.get_or_insert(now);
                        let t = gaps.since.unwrap();
                        gaps.longest = gaps.longest.max(now - t);
                    }
                }
            }
        });
        let w = Watcher {
            child,
            state,
            stop,
            sampler: Some(sampler),
        };
        // Ready once it reports a key written after it started.
        let probe = format!("{key_prefix}.watch-ready");
        let start = Instant::now();
        while !w.state.lock().unwrap().present.contains_key(".watch-ready") {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "etcdctl watch reported nothing within 30 s"
            );
            let _ = cluster.etcdctl(&["put", &probe, "x"]);
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = cluster.etcdctl(&["del", &probe]);
        w
    }

    /// Whether the watch has seen `name`'s key (and not its deletion).
    pub fn present(&self, name: &str) -> bool {
        self.state
            .lock()
            .unwrap()
            .present
            .get(name)
            .copied()
            .unwrap_or(false)
    }

    /// From now on, `name`'s key must stay present.
    pub fn expect_live(&self, name: &str) {
        self.state
            .lock()
            .unwrap()
            .live
            .insert(name.to_string(), Gaps::default());
    }

    /// `name` may go now (its engine is killed, or the test deletes it).
    pub fn release(&self, name: &str) -> Option<Gaps> {
        self.state.lock().unwrap().live.remove(name)
    }

    /// What the sampler saw of each live name so far, and how many
    /// samples it took.
    pub fn gaps(&self) -> (u64, Vec<(String, Gaps)>) {
        let s = self.state.lock().unwrap();
        let mut v: Vec<(String, Gaps)> =
            s.live.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        (s.samples, v)
    }

    /// Deletions of `name`'s key the watch reported.
    pub fn deletions(&self, name: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .deletions
            .iter()
            .filter(|(_, n)| n == name)
            .count()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.sampler.take() {
            let _ = s.join();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Certificates made for a test with the openssl command (Debian's openssl,
/// on every machine this project runs on; scripts/test installs it where
/// missing): a CA, etcd's server certificate (127.0.0.1 and localhost; for
/// client use too, as etcd's gateway presents it to etcd itself), Ferry's
/// client certificate, one of the same name from another CA, and one that
/// has expired. Client certificates have no Common Name: etcd's JSON
/// gateway refuses those that have one (etcd 3.4.22 and newer).
#[derive(Clone)]
pub struct Pki {
    dir: Arc<tempfile::TempDir>,
}

impl Pki {
    pub fn make() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let openssl = |args: &[&str]| {
            let out = Command::new(tool("openssl", "openssl"))
                .current_dir(d)
                .args(args)
                .output()
                .expect("run openssl");
            assert!(
                out.status.success(),
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (ca, cn) in [("ca", "ferry-test-ca"), ("other-ca", "another-ca")] {
            let (key, crt, subj) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN={cn}"),
            );
            let mut a = vec!["req", "-x509"];
            a.extend(ec);
            a.extend(["-keyout", &key, "-out", &crt, "-days", "2", "-subj", &subj]);
            openssl(&a);
        }
        let leaves = [
            ("server", "/CN=etcd-server", "ca", "2",
             "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"),
            ("client", "/O=ferry", "ca", "2", "extendedKeyUsage=clientAuth\n"),
            ("foreign", "/O=ferry", "other-ca", "2", "extendedKeyUsage=clientAuth\n"),
            // Valid until the day before it was issued.
            ("expired", "/O=ferry", "ca", "-1", "extendedKeyUsage=clientAuth\n"),
        ];
        for (name, subj, ca, days, ext) in leaves {
            let (key, csr, crt, extf) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
                format!("{name}.ext"),
            );
            std::fs::write(d.join(&extf), format!("basicConstraints=CA:FALSE\n{ext}")).unwrap();
            let mut a = vec!["req"];
            a.extend(ec);
            a.extend(["-keyout", &key, "-out", &csr, "-subj", subj]);
            openssl(&a);
            let (cacrt, cakey) = (format!("{ca}.crt"), format!("{ca}.key"));
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &cacrt,
                "-CAkey",
                &cakey,
                "-CAcreateserial",
                "-days",
                days,
                "-out",
                &crt,
                "-extfile",
                &extf,
            ]);
        }
        Pki { dir: Arc::new(dir) }
    }

    /// A file of this PKI ("ca.crt", "client.key", ...), or one written
    /// beside them (a password file).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `text` to `name` (mode 600) and returns its path.
    pub fn write(&self, name: &str, text: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let p = self.file(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p.display().to_string()
    }

    fn etcdctl_flags(&self) -> Vec<String> {
        [
            "--cacert",
            "ca.crt",
            "--cert",
            "client.crt",
            "--key",
            "client.key",
        ]
        .chunks(2)
        .flat_map(|f| [f[0].to_string(), self.file(f[1]).display().to_string()])
        .collect()
    }
}
