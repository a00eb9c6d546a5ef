//! The application's side of a probe in a child process: start the
//! ferry-probe helper on one plugin file, answer the plugin's host-service
//! calls, and turn whatever happens (a report, a crash, silence, garbage)
//! into an [`Outcome`]. The plugin never runs in this process here.

use crate::asked::{Asked, Recorder};
use crate::discover::Candidate;
use crate::escape::for_terminal;
use crate::host::HostServices;
use crate::probe::timed_out;
use crate::protocol::{
    tick, write_line, ChildMsg, LineReader, ReadStop, Reply, WireNic, MAX_LIBS, MAX_TEXT, PROTOCOL,
};
use crate::report::{bounded, Outcome, Stage, MAX_PLUGIN_STRING};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Log lines a child may pass on; more are dropped.
const MAX_LOG_LINES: usize = 1000;

pub(crate) enum ChildResult {
    Done {
        outcome: Box<Outcome>,
        /// What the probe asked the host; `None`: too much to keep.
        asked: Option<Vec<Asked>>,
        /// Files the plugin mapped (its dependencies).
        libs: Vec<PathBuf>,
    },
    /// The helper itself could not be used; the plugin was not judged.
    HelperFailed(String),
}

/// Where the child had got to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Loading,
    Probing,
}

/// Probes `cand` in a child process running `helper`, within `timeout`
/// for loading and probing together.
pub(crate) fn probe_in_child(
    helper: &Path,
    cand: &Candidate,
    host: &Arc<dyn HostServices>,
    timeout: Duration,
) -> ChildResult {
    let (ours, theirs) = match UnixStream::pair() {
        Ok(p) => p,
        Err(e) => return ChildResult::HelperFailed(format!("cannot make a socket pair: {e}")),
    };
    // The plugin's own output to stdout goes to our stderr: stdout may be
    // carrying `ferry info --json`.
    let stdout = match std::io::stderr().as_fd().try_clone_to_owned() {
        Ok(fd) => Stdio::from(fd),
        Err(_) => Stdio::null(),
    };
    let log_level = [
        log::Level::Trace,
        log::Level::Debug,
        log::Level::Info,
        log::Level::Warn,
        log::Level::Error,
    ]
    .into_iter()
    .find(|l| host.log_enabled(&cand.name, *l))
    .map_or(0, |l| l as i32);
    let spawned = Command::new(helper)
        .arg("--protocol")
        .arg(PROTOCOL.to_string())
        .arg("--kind")
        .arg(cand.kind.as_str())
        .arg("--name")
        .arg(&cand.name)
        .arg("--path")
        .arg(&cand.path)
        .arg("--log-level")
        .arg(log_level.to_string())
        .arg("--parent")
        .arg(std::process::id().to_string())
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(stdout)
        .stderr(Stdio::inherit())
        .spawn();
    // The Command (and our copy of the child's end) is gone here: when the
    // child ends, its end closes and we read end-of-file.
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            return ChildResult::HelperFailed(format!("cannot start {}: {e}", helper.display()))
        }
    };
    log::debug!(
        "probing {} in a child process (pid {})",
        cand.path.display(),
        child.id()
    );
    let recorder = Recorder::default();
    let result = converse(&mut child, ours, cand, host, &recorder, timeout);
    reap(&mut child);
    match result {
        Talk::Outcome(outcome, libs) => ChildResult::Done {
            outcome,
            asked: recorder.finish(&**host),
            libs,
        },
        Talk::HelperFailed(why) => ChildResult::HelperFailed(why),
    }
}

/// How a conversation with a child ended.
enum Talk {
    /// The plugin's outcome (its report, or what we saw: a crash, a
    /// timeout, garbage) and the files it mapped.
    Outcome(Box<Outcome>, Vec<PathBuf>),
    HelperFailed(String),
}

fn converse(
    child: &mut Child,
    stream: UnixStream,
    cand: &Candidate,
    host: &Arc<dyn HostServices>,
    recorder: &Recorder,
    timeout: Duration,
) -> Talk {
    let deadline = Instant::now() + timeout;
    let Ok(mut writer) = stream.try_clone() else {
        return Talk::HelperFailed("cannot clone the socket".into());
    };
    let _ = writer.set_write_timeout(Some(Duration::from_secs(2)));
    let mut reader = LineReader::new(&stream);
    let mut phase = Phase::Starting;
    let mut strings: Option<(String, String, String)> = None;
    let mut load_us = None;
    let mut logs = 0usize;
    let stage = |phase: Phase| {
        if phase == Phase::Probing {
            Stage::Loaded
        } else {
            Stage::Discovered
        }
    };
    loop {
        let _ = stream.set_read_timeout(Some(tick(deadline)));
        let line = match reader.next_line(deadline) {
            Ok(line) => line,
            Err(ReadStop::Idle) => {
                // Something else may hold the child's end of the socket (a
                // process the application forked meanwhile): look for the
                // child's end directly.
                match child.try_wait() {
                    Ok(Some(status)) => return ended(phase, status, cand, strings, load_us),
                    Ok(None) => {}
                    // Not waitable (SIGCHLD ignored): wait for the deadline.
                    Err(_) => {}
                }
                continue;
            }
            Err(ReadStop::Eof) => {
                return match wait_briefly(child) {
                    Waited::Exited(status) => ended(phase, status, cand, strings, load_us),
                    Waited::Running => {
                        let _ = child.kill();
                        done(hostile(phase, "closed its socket but kept running"))
                    }
                    Waited::Unknown => done(hostile(
                        phase,
                        "ended without a report (how, this application cannot tell: it \
                         ignores SIGCHLD)",
                    )),
                };
            }
            Err(ReadStop::Deadline) => {
                let _ = child.kill();
                let after = "its probe process was killed and the plugin is not loaded into \
                             this process";
                let mut o = timed_out(timeout, stage(phase), load_us, strings, after);
                if phase == Phase::Starting {
                    o.stage = Stage::Discovered;
                }
                return done(o);
            }
            Err(ReadStop::TooMuch(what)) => {
                let _ = child.kill();
                return done(hostile(phase, &format!("sent {what}")));
            }
            Err(ReadStop::Io(e)) => {
                let _ = child.kill();
                return done(hostile(phase, &format!("could not be read ({e})")));
            }
        };
        let msg: ChildMsg = match serde_json::from_slice(&line) {
            Ok(m) => m,
            Err(e) => {
                let _ = child.kill();
                if phase == Phase::Starting {
                    return Talk::HelperFailed(format!(
                        "{} did not greet as ferry-probe does ({e})",
                        cand.path.display()
                    ));
                }
                return done(hostile(phase, &format!("sent a malformed message ({e})")));
            }
        };
        match (phase, msg) {
            (Phase::Starting, ChildMsg::Hello { protocol, ferry }) => {
                if protocol != PROTOCOL {
                    let _ = child.kill();
                    return Talk::HelperFailed(format!(
                        "the helper is from Ferry {} (probe protocol {protocol}); this Ferry is \
                         {} (protocol {PROTOCOL})",
                        for_terminal(&bounded(&ferry, 64)),
                        env!("CARGO_PKG_VERSION")
                    ));
                }
                phase = Phase::Loading;
            }
            (Phase::Starting, _) => {
                let _ = child.kill();
                return Talk::HelperFailed("the helper did not greet first".into());
            }
            (Phase::Loading, ChildMsg::Loading) => {}
            (
                Phase::Loading,
                ChildMsg::Loaded {
                    version,
                    description,
                    abi,
                    load_us: us,
                },
            ) => {
                if [&version, &description, &abi]
                    .iter()
                    .any(|s| s.chars().count() > MAX_PLUGIN_STRING)
                {
                    let _ = child.kill();
                    return done(hostile(phase, "sent strings past their bounds"));
                }
                strings = Some((version, description, abi));
                load_us = Some(us);
                phase = Phase::Probing;
            }
            (_, ChildMsg::Config { key }) => {
                let value = if key.len() > MAX_TEXT {
                    None
                } else {
                    recorder.config(&**host, &key)
                };
                if write_line(&mut writer, &Reply::Config { value }).is_err() {
                    let _ = child.kill();
                    return done(hostile(phase, "stopped reading its answers"));
                }
            }
            (_, ChildMsg::Nics { location }) => {
                let result = if location.as_ref().is_some_and(|l| l.len() > MAX_TEXT) {
                    Err(ferry_plugins_abi::ErrorCode::InvalidArgument.as_raw())
                } else {
                    recorder
                        .nics(&**host, location.as_deref())
                        .map(|n| n.iter().map(WireNic::from).collect())
                        .map_err(|c| c.as_raw())
                };
                if write_line(&mut writer, &Reply::Nics { result }).is_err() {
                    let _ = child.kill();
                    return done(hostile(phase, "stopped reading its answers"));
                }
            }
            (_, ChildMsg::Log { level, msg }) => {
                logs += 1;
                if logs <= MAX_LOG_LINES {
                    let level = match level {
                        i32::MIN..=1 => log::Level::Error,
                        2 => log::Level::Warn,
                        3 => log::Level::Info,
                        4 => log::Level::Debug,
                        _ => log::Level::Trace,
                    };
                    host.log(&cand.name, level, &for_terminal(&bounded(&msg, MAX_TEXT)));
                }
            }
            (_, ChildMsg::Report { outcome, libs }) => {
                if let Err(e) = outcome.check() {
                    let _ = child.kill();
                    return done(hostile(
                        phase,
                        &format!("sent a report out of bounds ({e})"),
                    ));
                }
                if libs.len() > MAX_LIBS {
                    let _ = child.kill();
                    return done(hostile(phase, "listed too many libraries"));
                }
                return Talk::Outcome(Box::new(outcome), libs);
            }
            (_, other) => {
                let _ = child.kill();
                return done(hostile(
                    phase,
                    &format!("sent {} out of order", message_name(&other)),
                ));
            }
        }
    }
}

fn message_name(m: &ChildMsg) -> &'static str {
    match m {
        ChildMsg::Hello { .. } => "a second greeting",
        ChildMsg::Loading => "'loading'",
        ChildMsg::Loaded { .. } => "'loaded'",
        ChildMsg::Config { .. } => "a question",
        ChildMsg::Nics { .. } => "a question",
        ChildMsg::Log { .. } => "a log line",
        ChildMsg::Report { .. } => "a report",
    }
}

fn done(outcome: Outcome) -> Talk {
    Talk::Outcome(Box::new(outcome), Vec::new())
}

fn hostile(phase: Phase, what: &str) -> Outcome {
    let stage = if phase == Phase::Probing {
        Stage::Loaded
    } else {
        Stage::Discovered
    };
    Outcome::disabled(
        stage,
        format!("its probe process {what}; the plugin is not loaded into this process"),
    )
}

/// The child ended without a report.
fn ended(
    phase: Phase,
    status: ExitStatus,
    cand: &Candidate,
    strings: Option<(String, String, String)>,
    load_us: Option<u64>,
) -> Talk {
    let how = match status.signal() {
        Some(sig) => signal_name(sig),
        None => format!("exit status {}", status.code().unwrap_or(-1)),
    };
    let mut o = match (phase, status.signal()) {
        (Phase::Starting, _) => {
            return Talk::HelperFailed(format!(
                "the helper ended before it spoke ({how}) while asked to probe {}",
                cand.path.display()
            ))
        }
        (Phase::Loading, Some(_)) => Outcome::disabled(
            Stage::Discovered,
            format!(
                "loading it crashed: {how} (in a constructor of the library or of a library \
                 it needs; seen in a child process, never loaded into this one)"
            ),
        ),
        (Phase::Loading, None) => Outcome::disabled(
            Stage::Discovered,
            format!(
                "loading it ended its process with {how} (a constructor called exit?); seen \
                 in a child process, never loaded into this one"
            ),
        ),
        (Phase::Probing, Some(_)) => Outcome::disabled(
            Stage::Loaded,
            format!(
                "probe crashed: {how} (seen in a child process; the plugin is not loaded into \
                 this one)"
            ),
        ),
        (Phase::Probing, None) => Outcome::disabled(
            Stage::Loaded,
            format!(
                "probe ended its process with {how} (it called exit?); seen in a child \
                 process, the plugin is not loaded into this one"
            ),
        ),
    };
    o.load_us = load_us;
    if let Some((version, description, abi)) = strings {
        o.version = Some(version);
        o.description = Some(description);
        o.abi = Some(abi);
    }
    done(o)
}

/// SIGSEGV, SIGABRT, ... or "signal N".
pub(crate) fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGSYS => "SIGSYS",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGKILL => return "SIGKILL (killed from outside: out of memory?)".into(),
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

enum Waited {
    Exited(ExitStatus),
    Running,
    /// Not ours to wait for: the application ignores SIGCHLD, so the
    /// kernel reaped the child itself.
    Unknown,
}

/// The child's status once it ends, waiting a moment for it.
fn wait_briefly(child: &mut Child) -> Waited {
    let until = Instant::now() + Duration::from_secs(2);
    let mut pause = Duration::from_micros(50);
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Waited::Exited(s),
            Ok(None) if Instant::now() < until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
            Ok(None) => return Waited::Running,
            Err(_) => return Waited::Unknown,
        }
    }
}

/// Makes sure the child is gone and reaped.
fn reap(child: &mut Child) {
    if let Waited::Running = wait_briefly(child) {
        let _ = child.kill();
        let _ = child.wait();
    }
}
