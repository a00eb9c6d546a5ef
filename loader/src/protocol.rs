//! What the ferry-probe child and the application say to each other over
//! their socket: one JSON object per line, versioned by the child's first
//! line. The child runs plugin code, so the application reads every line as
//! hostile input: bounded in length and count, parsed by serde into fixed
//! types, and checked (`Outcome::check`) before anything is believed.

use crate::report::Outcome;
use ferry_plugins_abi::sdk::Nic;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Raised whenever a message changes meaning; parent and child must agree.
pub const PROTOCOL: u32 = 1;
/// The longest line either side accepts (a report with thousands of devices).
pub const MAX_LINE: usize = 8 << 20;
/// The most bytes a child may send in all.
pub const MAX_TOTAL: usize = 32 << 20;
/// The most lines a child may send (questions and log lines included).
pub const MAX_MESSAGES: usize = 100_000;
/// The longest log line or setting value passed through.
pub const MAX_TEXT: usize = 64 << 10;
/// Files a report may list as mapped by the plugin.
pub const MAX_LIBS: usize = 1024;

/// Child to application.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChildMsg {
    /// First line: which protocol and which Ferry the helper is.
    Hello { protocol: u32, ferry: String },
    /// Loading begins (dlopen: the library's constructors run).
    Loading,
    /// Loading succeeded and probe begins: the table's strings.
    Loaded {
        version: String,
        description: String,
        abi: String,
        load_us: u64,
    },
    /// config_get from the plugin; answered with [`Reply::Config`].
    Config { key: String },
    /// topo_nics from the plugin; answered with [`Reply::Nics`].
    Nics { location: Option<String> },
    /// A log line from the plugin (level as FERRY_LOG_*).
    Log { level: i32, msg: String },
    /// The last line: the outcome and the files the plugin mapped.
    Report {
        outcome: Outcome,
        libs: Vec<PathBuf>,
    },
}

/// Application to child: answers, in order.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Config { value: Option<String> },
    Nics { result: Result<Vec<WireNic>, i32> },
}

/// [`Nic`] on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireNic {
    pub kind: u32,
    pub path_class: u32,
    pub name: String,
    pub netdev: String,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub port_state: u32,
    pub link_layer: u32,
    pub speed_mbps: u64,
}

impl From<&Nic> for WireNic {
    fn from(n: &Nic) -> WireNic {
        WireNic {
            kind: n.kind,
            path_class: n.path_class,
            name: n.name.clone(),
            netdev: n.netdev.clone(),
            pci_bus_id: n.pci_bus_id.clone(),
            numa_node: n.numa_node,
            port_state: n.port_state,
            link_layer: n.link_layer,
            speed_mbps: n.speed_mbps,
        }
    }
}

impl From<WireNic> for Nic {
    fn from(n: WireNic) -> Nic {
        Nic {
            kind: n.kind,
            path_class: n.path_class,
            name: n.name,
            netdev: n.netdev,
            pci_bus_id: n.pci_bus_id,
            numa_node: n.numa_node,
            port_state: n.port_state,
            link_layer: n.link_layer,
            speed_mbps: n.speed_mbps,
        }
    }
}

/// Writes one message as a line.
pub fn write_line<T: Serialize>(out: &mut impl Write, msg: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    out.write_all(&line)?;
    out.flush()
}

/// Why no line came.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadStop {
    /// Nothing yet; the deadline has not passed.
    Idle,
    /// The deadline passed.
    Deadline,
    /// The other side closed.
    Eof,
    /// A line or the whole stream went past its bounds.
    TooMuch(String),
    Io(String),
}

/// Reads bounded lines from a stream whose reads time out (the caller set a
/// read timeout: each `Idle` is one such tick).
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// How much of `buf` is known to hold no newline.
    scanned: usize,
    total: usize,
    lines: usize,
}

impl<R: Read> LineReader<R> {
    pub fn new(inner: R) -> LineReader<R> {
        LineReader {
            inner,
            buf: Vec::new(),
            scanned: 0,
            total: 0,
            lines: 0,
        }
    }

    /// The next complete line (without its newline).
    pub fn next_line(&mut self, deadline: Instant) -> Result<Vec<u8>, ReadStop> {
        loop {
            if let Some(at) = self.buf[self.scanned..].iter().position(|b| *b == b'\n') {
                let pos = self.scanned + at;
                self.scanned = 0;
                let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
                line.pop();
                self.lines += 1;
                if self.lines > MAX_MESSAGES {
                    return Err(ReadStop::TooMuch(format!(
                        "more than {MAX_MESSAGES} messages"
                    )));
                }
                return Ok(line);
            }
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_LINE {
                return Err(ReadStop::TooMuch(format!(
                    "a line longer than {MAX_LINE} bytes"
                )));
            }
            if Instant::now() >= deadline {
                return Err(ReadStop::Deadline);
            }
            let mut chunk = [0u8; 16 << 10];
            match self.inner.read(&mut chunk) {
                Ok(0) => return Err(ReadStop::Eof),
                Ok(n) => {
                    self.total += n;
                    if self.total > MAX_TOTAL {
                        return Err(ReadStop::TooMuch(format!(
                            "more than {MAX_TOTAL} bytes in all"
                        )));
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadStop::Idle)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadStop::Io(e.to_string())),
            }
        }
    }
}

/// How long one read may block: short enough to notice a child that died
/// while something else holds its end of the socket.
pub fn tick(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), Duration::from_millis(100))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_bounded_and_split() {
        let data = b"{\"a\":1}\n{\"b\":2}\npartial".to_vec();
        let mut r = LineReader::new(std::io::Cursor::new(data));
        let far = Instant::now() + Duration::from_secs(5);
        assert_eq!(r.next_line(far).unwrap(), b"{\"a\":1}");
        assert_eq!(r.next_line(far).unwrap(), b"{\"b\":2}");
        assert_eq!(r.next_line(far), Err(ReadStop::Eof));

        let huge = vec![b'x'; MAX_LINE + 20_000];
        let mut r = LineReader::new(std::io::Cursor::new(huge));
        assert!(matches!(r.next_line(far), Err(ReadStop::TooMuch(_))));
    }

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let m = ChildMsg::Config {
            key: "tcp.connections".into(),
        };
        let mut out = Vec::new();
        write_line(&mut out, &m).unwrap();
        let back: ChildMsg = serde_json::from_slice(&out[..out.len() - 1]).unwrap();
        assert!(matches!(back, ChildMsg::Config { key } if key == "tcp.connections"));
        assert!(serde_json::from_slice::<ChildMsg>(b"{\"report\":{}}").is_err());
        assert!(serde_json::from_slice::<ChildMsg>(b"\x1b[2J").is_err());
    }
}
