//! The simulated network: one network namespace per host, all joined by
//! veth pairs to a bridge in a namespace of its own, so nothing of a run
//! touches this machine's own network. Every name carries the run's prefix
//! (`fcl<pid>-`): two runs never collide, and a run that died without
//! cleaning up is recognised by its dead pid and swept by the next.
//!
//! Cleanup runs on every way out: normally (`Run::cleanup`), on a panic
//! (`Drop`), and on SIGINT/SIGTERM/SIGHUP (a thread waits for them with
//! sigwait and cleans up before exiting).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// The private subnet of a run's hosts (an isolated bridge: runs may share it).
pub const SUBNET: &str = "10.77.0";

/// What a run created, for cleanup.
#[derive(Default)]
struct Created {
    namespaces: Vec<String>,
    pids: Vec<u32>,
    dirs: Vec<PathBuf>,
}

static CREATED: Mutex<Option<Created>> = Mutex::new(None);

/// One simulation run.
pub struct Run {
    pub prefix: String,
    /// Fixtures, logs, etcd's data: removed at the end.
    pub dir: PathBuf,
    /// The verbs emulator's fabric directory (in /dev/shm).
    pub fabric: PathBuf,
    switch: String,
    next_port: Mutex<u32>,
}

/// Runs `ip ARGS`; the error names the command and what `ip` said.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why namespaces cannot be made here, or None when they can: root (or
/// CAP_SYS_ADMIN and CAP_NET_ADMIN), `ip`, `unshare`, `etcd`.
pub fn unavailable() -> Option<String> {
    for tool in ["ip", "unshare", "etcd", "mount", "hostname"] {
        if which(tool).is_none() {
            return Some(format!(
                "`{tool}` is not installed (scripts/lib/common.sh installs iproute2, util-linux, \
                 etcd-server)"
            ));
        }
    }
    let probe = format!("fcl{}-probe", std::process::id());
    if let Err(e) = ip(&["netns", "add", &probe]) {
        return Some(format!(
            "cannot create a network namespace (needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN): {e}"
        ));
    }
    let made = Command::new("ip")
        .args(["netns", "exec", &probe, "unshare", "--ipc", "--uts", "true"])
        .stderr(Stdio::piped())
        .output();
    let _ = ip(&["netns", "del", &probe]);
    match made {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "cannot create IPC and UTS namespaces: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run ip netns exec: {e}")),
    }
}

pub fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    })
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Kills every process in namespace `ns` and deletes it.
fn remove_namespace(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: plain kill(2) of a process inside the run's namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    let _ = ip(&["netns", "del", ns]);
}

/// Removes what earlier runs whose driver is gone left behind.
fn sweep_stale() -> Vec<String> {
    let mut swept = Vec::new();
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return swept;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let ns = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = ns.strip_prefix("fcl") else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !alive(pid) {
            remove_namespace(ns);
            swept.push(ns.to_string());
            for dir in [
                std::env::temp_dir().join(format!("ferry-cluster-fcl{pid}")),
                PathBuf::from(format!("/dev/shm/ferry-cluster-fcl{pid}")),
            ] {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
    swept
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a signal ended the run (its cleanup is under way: stop working).
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Everything the run created, removed; safe to call more than once, from
/// any thread: a second caller waits until the first is done.
pub fn cleanup() {
    let mut guard = CREATED.lock().unwrap_or_else(|p| p.into_inner());
    let Some(created) = guard.take() else {
        return;
    };
    for pid in &created.pids {
        // SAFETY: kill(2) of a child this run started (SIGKILL: the run is over).
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    for ns in created.namespaces.iter().rev() {
        remove_namespace(ns);
    }
    for d in &created.dirs {
        let _ = std::fs::remove_dir_all(d);
    }
    drop(guard);
}

fn record(f: impl FnOnce(&mut Created)) {
    if let Some(c) = CREATED.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        f(c);
    }
}

/// A child the run started, killed at cleanup.
pub fn record_pid(pid: u32) {
    record(|c| c.pids.push(pid));
}

/// Blocks the termination signals in this thread (and every thread it
/// starts) and cleans up when one arrives. Call first in main.
fn catch_signals() {
    // SAFETY: sigset operations on a local set; pthread_sigmask on this thread.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    std::thread::spawn(move || {
        let mut sig: libc::c_int = 0;
        // SAFETY: waits for one of the blocked signals in `set`.
        unsafe { libc::sigwait(&set, &mut sig) };
        INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
        eprintln!("\nferry-cluster: signal {sig}: removing the namespaces, processes and files of this run");
        cleanup();
        std::process::exit(128 + sig);
    });
}

/// Children start with the signals unblocked (the mask is inherited).
pub fn unblock_signals_in_child(cmd: &mut Command) {
    // SAFETY: pre_exec runs in the child between fork and exec; only the
    // async-signal-safe sigemptyset/sigprocmask are called.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
}

impl Run {
    /// Sweeps stale runs, catches signals, makes the bridge.
    pub fn start() -> Result<Run, String> {
        for ns in sweep_stale() {
            eprintln!("removed {ns}, left by an earlier run that did not finish");
        }
        *CREATED.lock().unwrap_or_else(|p| p.into_inner()) = Some(Created::default());
        catch_signals();
        let prefix = format!("fcl{}", std::process::id());
        let dir = std::env::temp_dir().join(format!("ferry-cluster-{prefix}"));
        let shm = Path::new("/dev/shm");
        let fabric = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
        .join(format!("ferry-cluster-{prefix}"));
        for d in [&dir, &fabric] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            let d = d.clone();
            record(|c| c.dirs.push(d));
        }
        let run = Run {
            switch: format!("{prefix}-sw"),
            prefix,
            dir,
            fabric,
            next_port: Mutex::new(0),
        };
        run.add_namespace(&run.switch)?;
        ip(&["-n", &run.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &run.switch, "link", "set", "br0", "up"])?;
        Ok(run)
    }

    fn add_namespace(&self, ns: &str) -> Result<(), String> {
        ip(&["netns", "add", ns])?;
        let ns = ns.to_string();
        record(|c| c.namespaces.push(ns));
        Ok(())
    }

    /// A host: its namespace, a veth pair to the bridge, address
    /// SUBNET.<octet>/24 and a default route (so an engine listening on
    /// 0.0.0.0 advertises that address). Returns the namespace's name.
    pub fn add_host(&self, name: &str, octet: u8) -> Result<String, String> {
        let ns = format!("{}-{name}", self.prefix);
        self.add_namespace(&ns)?;
        let port = {
            let mut n = self.next_port.lock().unwrap_or_else(|p| p.into_inner());
            *n += 1;
            format!("p{n}")
        };
        ip(&[
            "-n",
            &ns,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            &port,
            "netns",
            &self.switch,
        ])?;
        ip(&["-n", &self.switch, "link", "set", &port, "master", "br0"])?;
        ip(&["-n", &self.switch, "link", "set", &port, "up"])?;
        let addr = format!("{SUBNET}.{octet}/24");
        ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "route", "add", "default", "dev", "eth0"])?;
        Ok(ns)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        cleanup();
    }
}

/// Runs `f` on a thread that joined namespace `ns`'s network (for the
/// driver's own probes, e.g. whether etcd answers).
pub fn in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        use std::os::fd::AsRawFd;
        // SAFETY: setns on this thread only, with a namespace fd we hold open.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns {path}: {}", std::io::Error::last_os_error()));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| "namespace thread panicked".to_string())?
}
