//! The ferry-probe helper's side: in a short-lived child process, load one
//! plugin file and probe it, answering the plugin's host-service calls by
//! asking the application over the socket it gave us as stdin, then report
//! and exit without running the plugin's destructors. Whatever the plugin
//! does here (abort, a wild pointer, a hang) ends only this process.

use crate::discover::Candidate;
use crate::host::HostServices;
use crate::protocol::{write_line, ChildMsg, Reply, MAX_LIBS, MAX_TEXT, PROTOCOL};
use crate::report::{bounded, Outcome, PluginKind, Stage};
use crate::{elf, fingerprint, library, probe};
use ferry_plugins_abi::sdk::Nic;
use ferry_plugins_abi::{sys, ErrorCode};
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the application tells the helper on its command line.
struct Args {
    kind: PluginKind,
    name: String,
    path: PathBuf,
    /// The most verbose FERRY_LOG_* level the application prints for plugins.
    log_level: i32,
    parent: i32,
}

fn parse_args(args: Vec<OsString>) -> Result<Args, String> {
    let mut it = args.into_iter();
    let (mut protocol, mut kind, mut name, mut path, mut log_level, mut parent) =
        (None, None, None, None, 0, 0);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag:?} needs a value"))?;
        let text = || value.to_str().map(str::to_string).ok_or("not UTF-8");
        match flag.to_str() {
            Some("--protocol") => protocol = text()?.parse::<u32>().ok(),
            Some("--kind") => {
                kind = match text()?.as_str() {
                    "transport" => Some(PluginKind::Transport),
                    "device" => Some(PluginKind::Device),
                    other => return Err(format!("unknown kind {other:?}")),
                }
            }
            Some("--name") => name = Some(text()?),
            Some("--path") => path = Some(PathBuf::from(value)),
            Some("--log-level") => log_level = text()?.parse().unwrap_or(0),
            Some("--parent") => parent = text()?.parse().unwrap_or(0),
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if protocol != Some(PROTOCOL) {
        return Err(format!(
            "this ferry-probe speaks protocol {PROTOCOL}, the application asked for {protocol:?}"
        ));
    }
    Ok(Args {
        kind: kind.ok_or("no --kind")?,
        name: name.ok_or("no --name")?,
        path: path.ok_or("no --path")?,
        log_level,
        parent,
    })
}

/// The application's end of the conversation: requests and their replies
/// under one lock, so plugin threads calling services at once stay in order.
struct Channel {
    io: Mutex<(UnixStream, BufReader<UnixStream>)>,
}

impl Channel {
    fn send(&self, msg: &ChildMsg) {
        let mut g = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let _ = write_line(&mut g.0, msg);
    }

    fn ask(&self, msg: &ChildMsg) -> Option<Reply> {
        let mut g = self.io.lock().unwrap_or_else(|e| e.into_inner());
        write_line(&mut g.0, msg).ok()?;
        let mut line = String::new();
        g.1.read_line(&mut line).ok()?;
        serde_json::from_str(&line).ok()
    }
}

/// Host services answered by the application.
struct RemoteHost {
    channel: Arc<Channel>,
    log_level: i32,
}

fn raw_level(level: log::Level) -> i32 {
    match level {
        log::Level::Error => sys::FERRY_LOG_ERROR,
        log::Level::Warn => sys::FERRY_LOG_WARN,
        log::Level::Info => sys::FERRY_LOG_INFO,
        log::Level::Debug => sys::FERRY_LOG_DEBUG,
        log::Level::Trace => sys::FERRY_LOG_TRACE,
    }
}

impl HostServices for RemoteHost {
    fn log(&self, _plugin: &str, level: log::Level, msg: &str) {
        self.channel.send(&ChildMsg::Log {
            level: raw_level(level),
            msg: bounded(msg, MAX_TEXT / 4),
        });
    }

    fn log_enabled(&self, _plugin: &str, level: log::Level) -> bool {
        raw_level(level) <= self.log_level
    }

    fn config(&self, key: &str) -> Option<String> {
        match self.channel.ask(&ChildMsg::Config {
            key: key.to_string(),
        })? {
            Reply::Config { value } => value,
            Reply::Nics { .. } => None,
        }
    }

    fn nics(&self, location: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
        let reply = self.channel.ask(&ChildMsg::Nics {
            location: location.map(str::to_string),
        });
        match reply {
            Some(Reply::Nics { result: Ok(nics) }) => Ok(nics.into_iter().map(Nic::from).collect()),
            Some(Reply::Nics { result: Err(code) }) => {
                Err(ErrorCode::from_raw(code).unwrap_or(ErrorCode::Internal))
            }
            _ => Err(ErrorCode::Internal),
        }
    }

    fn peer_request(
        &self,
        _plugin: &str,
        _peer: &str,
        _body: &[u8],
    ) -> Result<Vec<u8>, (ErrorCode, String)> {
        Err((
            ErrorCode::Unsupported,
            "plugin messaging is not available to probe".into(),
        ))
    }
}

/// Takes the socket the application passed as stdin and puts /dev/null in
/// its place, so plugin code reading or closing fd 0 cannot touch it.
fn take_channel() -> Result<UnixStream, String> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on fd 0 only creates a new descriptor.
    let fd = unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, 10) };
    if fd < 0 {
        return Err(format!(
            "no socket on stdin: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: fd was just created above and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto fd 0, which we own as this process's stdin.
        unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0) };
    }
    Ok(UnixStream::from(owned))
}

/// Dies with the application, and leaves no core file: a crash here is an
/// expected outcome, reported, not a bug of Ferry's to debug.
fn harden(parent: i32) {
    // SAFETY: prctl and setrlimit with constant arguments change only this
    // process's own attributes.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        if parent > 0 && libc::getppid() != parent {
            // The application is already gone.
            libc::_exit(3);
        }
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
    }
}

/// The helper's main: returns the exit status (nonzero when it could not
/// even start talking to the application).
pub fn helper_main() -> i32 {
    let args = match parse_args(std::env::args_os().skip(1).collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "ferry-probe: {e}\n(ferry-probe is started by Ferry's plugin loader, not by hand)"
            );
            return 2;
        }
    };
    harden(args.parent);
    let stream = match take_channel() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferry-probe: {e}");
            return 2;
        }
    };
    let Ok(reader) = stream.try_clone() else {
        return 2;
    };
    let channel = Arc::new(Channel {
        io: Mutex::new((stream, BufReader::new(reader))),
    });
    channel.send(&ChildMsg::Hello {
        protocol: PROTOCOL,
        ferry: env!("CARGO_PKG_VERSION").to_string(),
    });
    let host: Arc<dyn HostServices> = Arc::new(RemoteHost {
        channel: channel.clone(),
        log_level: args.log_level,
    });
    let before = fingerprint::mapped_files();
    let outcome = load_and_probe(&args, &host, &channel);
    let libs: Vec<PathBuf> = fingerprint::mapped_files()
        .difference(&before)
        .take(MAX_LIBS)
        .cloned()
        .collect();
    channel.send(&ChildMsg::Report { outcome, libs });
    // SAFETY: _exit ends the process at once: the plugin's destructors and
    // atexit handlers, which may crash or hang, never run here.
    unsafe { libc::_exit(0) }
}

fn load_and_probe(args: &Args, host: &Arc<dyn HostServices>, channel: &Channel) -> Outcome {
    let cand = Candidate {
        path: args.path.clone(),
        origin: crate::config::DirOrigin::Env,
        kind: args.kind,
        name: args.name.clone(),
    };
    let facts = match elf::inspect(&cand.path) {
        Ok(f) => f,
        Err(reason) => return Outcome::disabled(Stage::Discovered, reason),
    };
    channel.send(&ChildMsg::Loading);
    let started = Instant::now();
    let lib = match library::open(&cand, &facts, host) {
        Ok(l) => l,
        Err(reason) => return Outcome::disabled(Stage::Discovered, reason),
    };
    let load_us = probe::elapsed_us(started);
    let (version, description, abi) = lib.strings();
    channel.send(&ChildMsg::Loaded {
        version,
        description,
        abi,
        load_us,
    });
    probe::probe_outcome(&lib, load_us)
}
