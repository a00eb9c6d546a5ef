//! Notifications: a short message a batch carries to its peer, delivered
//! once every byte of the batch is in the peer's memory (the engine sends
//! it over the control connection after the batch's completions; see
//! `engine/notify.rs` for why that order holds on every transport).
//!
//! This file holds what travels and what waits: the message and its
//! limits, its wire form (checked field by field: it arrives from the
//! network), the bounded inbox a receiving engine keeps until the
//! application takes its notifications, and the thread that sends an
//! engine's own.
//!
//! Drop policy: the inbox holds at most [`NOTIFY_QUEUE_DEPTH`] messages.
//! When it is full a new message is refused, never an old one evicted: the
//! sender's batch then reports its notification failed with BUSY (so the
//! sender knows, and may send it again), and the receiver counts the
//! refusal in [`Inbox::dropped`]. Messages already queued are delivered in
//! the order they arrived.

use crate::batch::Batch;
use crate::control::{ControlClient, Link, MsgType};
use crate::error::{Error, ErrorCode, Result};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Weak};

/// Longest notification name, in bytes.
pub const MAX_NOTIFY_NAME: usize = 256;
/// Longest notification message, in bytes.
pub const MAX_NOTIFY_MSG: usize = 4096;
/// Longest sender name (a segment name) a notification may carry.
pub const MAX_NOTIFY_SENDER: usize = 512;
/// Notifications an engine keeps for the application before it refuses new
/// ones (about 4.3 MiB at most).
pub const NOTIFY_QUEUE_DEPTH: usize = 1024;

/// What a sender attaches to a batch: a name (Mooncake's `name`, often the
/// sender's id or a request id) and a short message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notify {
    name: String,
    msg: Vec<u8>,
}

impl Notify {
    /// A notification, or INVALID_ARGUMENT when the name is over
    /// [`MAX_NOTIFY_NAME`] or the message over [`MAX_NOTIFY_MSG`] bytes.
    pub fn new(name: impl Into<String>, msg: impl Into<Vec<u8>>) -> Result<Notify> {
        let (name, msg) = (name.into(), msg.into());
        if name.len() > MAX_NOTIFY_NAME {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "a notification's name is at most {MAX_NOTIFY_NAME} bytes, not {}",
                    name.len()
                ),
            ));
        }
        if msg.len() > MAX_NOTIFY_MSG {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "a notification's message is at most {MAX_NOTIFY_MSG} bytes, not {} (send \
                     bulk data as a transfer, and its handle in the message)",
                    msg.len()
                ),
            ));
        }
        Ok(Notify { name, msg })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn msg(&self) -> &[u8] {
        &self.msg
    }
}

/// A notification as its receiver gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The segment name the sending engine gave (its connection proved the
    /// cluster token; the name itself is the sender's word).
    pub peer: String,
    pub name: String,
    pub msg: Vec<u8>,
}

/// Wire form: `u16 sender length | sender | u16 name length | name |
/// u32 message length | message` (little endian), nothing after.
pub fn encode_notify(from: &str, notify: &Notify) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + from.len() + notify.name.len() + notify.msg.len());
    out.extend_from_slice(&(from.len() as u16).to_le_bytes());
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(&(notify.name.len() as u16).to_le_bytes());
    out.extend_from_slice(notify.name.as_bytes());
    out.extend_from_slice(&(notify.msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&notify.msg);
    out
}

/// Decodes a notification from a peer; every length is checked against the
/// body and the limits, names must be UTF-8.
pub fn decode_notify(body: &[u8]) -> Result<Notification> {
    let bad = |what: &str| {
        Error::new(
            ErrorCode::Protocol,
            format!("malformed notification: {what}"),
        )
    };
    let mut rest = body;
    let mut take = |len_bytes: usize, limit: usize, what: &str| -> Result<&[u8]> {
        if rest.len() < len_bytes {
            return Err(bad(what));
        }
        let mut n = [0u8; 4];
        n[..len_bytes].copy_from_slice(&rest[..len_bytes]);
        let n = u32::from_le_bytes(n) as usize;
        if n > limit || rest.len() - len_bytes < n {
            return Err(bad(what));
        }
        let field = &rest[len_bytes..len_bytes + n];
        rest = &rest[len_bytes + n..];
        Ok(field)
    };
    let text = |b: &[u8], what: &str| {
        std::str::from_utf8(b)
            .map(str::to_string)
            .map_err(|_| bad(what))
    };
    let peer = text(take(2, MAX_NOTIFY_SENDER, "sender")?, "sender")?;
    let name = text(take(2, MAX_NOTIFY_NAME, "name")?, "name")?;
    let msg = take(4, MAX_NOTIFY_MSG, "message")?.to_vec();
    if !rest.is_empty() {
        return Err(bad("bytes after the message"));
    }
    Ok(Notification { peer, name, msg })
}

/// Notifications received and not yet taken, bounded (see the drop policy
/// above).
pub struct Inbox {
    queue: Mutex<VecDeque<Notification>>,
    depth: usize,
    dropped: AtomicU64,
}

impl Default for Inbox {
    fn default() -> Inbox {
        Inbox::with_depth(NOTIFY_QUEUE_DEPTH)
    }
}

impl Inbox {
    pub fn with_depth(depth: usize) -> Inbox {
        Inbox {
            queue: Mutex::new(VecDeque::new()),
            depth,
            dropped: AtomicU64::new(0),
        }
    }

    /// Queues a notification, or refuses it with BUSY when the inbox is
    /// full (counted in `dropped`).
    pub fn push(&self, n: Notification) -> Result<()> {
        let mut q = self.queue.lock();
        if q.len() >= self.depth {
            drop(q);
            let total = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if total == 1 || total.is_power_of_two() {
                log::warn!(
                    "notification queue full ({} waiting): the application is not taking \
                     notifications; refused one from {} ({total} refused so far)",
                    self.depth,
                    n.peer
                );
            }
            return Err(Error::new(
                ErrorCode::Busy,
                format!(
                    "the peer's notification queue is full ({} waiting: its application is not \
                     taking them); this notification was refused",
                    self.depth
                ),
            ));
        }
        q.push_back(n);
        Ok(())
    }

    /// The oldest waiting notification, taken.
    pub fn take_one(&self) -> Option<Notification> {
        self.queue.lock().pop_front()
    }

    /// Every waiting notification, oldest first; the inbox is then empty.
    pub fn take_all(&self) -> Vec<Notification> {
        self.queue.lock().drain(..).collect()
    }

    /// Notifications refused because the inbox was full, since the start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// One message to send, for one batch.
pub(crate) struct Outgoing {
    pub(crate) batch: Weak<Batch>,
    /// The peer's segment name (for messages).
    pub(crate) peer: String,
    /// Its control address.
    pub(crate) control: String,
    /// The encoded notification.
    pub(crate) body: Vec<u8>,
}

/// The engine's notifications: what peers sent it, and the thread that
/// sends its own.
#[derive(Default)]
pub(crate) struct Notifier {
    pub(crate) inbox: Inbox,
    outbox: Mutex<Option<mpsc::Sender<Outgoing>>>,
}

impl Notifier {
    /// The sending thread's queue, starting the thread on first use.
    pub(crate) fn outbox(&self, link: &Link) -> Result<mpsc::Sender<Outgoing>> {
        let mut out = self.outbox.lock();
        if let Some(tx) = out.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel();
        let link = link.clone();
        std::thread::Builder::new()
            .name("ferry-notify".into())
            .spawn(move || send_loop(rx, link))
            .map_err(|e| {
                Error::new(
                    ErrorCode::NoMemory,
                    format!("cannot start the notification thread: {e}"),
                )
            })?;
        *out = Some(tx.clone());
        Ok(tx)
    }
}

/// Sends each job's message and records the outcome in its batch, until
/// the engine (every sender) is gone.
fn send_loop(rx: mpsc::Receiver<Outgoing>, link: Link) {
    let mut clients: HashMap<String, ControlClient> = HashMap::new();
    while let Ok(job) = rx.recv() {
        let result = deliver(&mut clients, &link, &job).map_err(|e| {
            Error::new(
                e.code,
                format!("notification to {} not delivered: {}", job.peer, e.message),
            )
        });
        if let Err(e) = &result {
            log::debug!("{e}");
        }
        if let Some(batch) = job.batch.upgrade() {
            batch.finish_notify(result);
        }
    }
}

/// One message over the peer's control connection (kept for the next).
/// A message is sent once: a connection that fails midway is not retried,
/// so a peer never queues one twice.
fn deliver(
    clients: &mut HashMap<String, ControlClient>,
    link: &Link,
    job: &Outgoing,
) -> Result<()> {
    if clients.get(&job.control).is_some_and(|c| !c.reusable()) {
        clients.remove(&job.control);
    }
    let client = match clients.entry(job.control.clone()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(ControlClient::connect(&job.control, link)?)
        }
    };
    let answer = client
        .send(MsgType::Notify, &job.body)
        .and_then(|()| client.recv_reply());
    match answer {
        Ok(Ok((MsgType::NotifyAck, _))) => Ok(()),
        // The peer refused (its queue is full): the connection is fine.
        Ok(Err(e)) => Err(e),
        Ok(Ok(_)) => {
            clients.remove(&job.control);
            Err(Error::new(
                ErrorCode::Protocol,
                "the peer answered with an unexpected message",
            ))
        }
        Err(e) => {
            clients.remove(&job.control);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_enforced_and_said() {
        assert!(Notify::new("n".repeat(MAX_NOTIFY_NAME), vec![0; MAX_NOTIFY_MSG]).is_ok());
        let e = Notify::new("n".repeat(MAX_NOTIFY_NAME + 1), b"m".to_vec()).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(e.message.contains("at most 256 bytes"), "{}", e.message);
        let e = Notify::new("n", vec![0; MAX_NOTIFY_MSG + 1]).unwrap_err();
        assert!(e.message.contains("at most 4096 bytes"), "{}", e.message);
    }

    #[test]
    fn round_trip_and_garbage() {
        let n = Notify::new("req-7", b"blocks 1..9".to_vec()).unwrap();
        let body = encode_notify("10.0.0.1:7000", &n);
        let got = decode_notify(&body).unwrap();
        assert_eq!(
            (got.peer.as_str(), got.name.as_str(), &got.msg[..]),
            ("10.0.0.1:7000", "req-7", &b"blocks 1..9"[..])
        );
        // Every truncation, a trailing byte, lengths over the limits.
        for cut in 0..body.len() {
            assert!(decode_notify(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.clone();
        long.push(0);
        assert!(decode_notify(&long).is_err());
        let mut huge = body.clone();
        let at = 2 + 13 + 2 + 5;
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_notify(&huge).unwrap_err().code, ErrorCode::Protocol);
        let mut not_utf8 = body;
        not_utf8[2] = 0xff;
        assert!(decode_notify(&not_utf8).is_err());
    }

    #[test]
    fn a_full_inbox_refuses_the_newest_and_counts_it() {
        let inbox = Inbox::with_depth(2);
        let n = |i: u8| Notification {
            peer: "p".into(),
            name: format!("{i}"),
            msg: vec![i],
        };
        inbox.push(n(1)).unwrap();
        inbox.push(n(2)).unwrap();
        let e = inbox.push(n(3)).unwrap_err();
        assert_eq!(e.code, ErrorCode::Busy);
        assert!(e.message.contains("queue is full"), "{}", e.message);
        assert_eq!(inbox.dropped(), 1);
        let names: Vec<String> = inbox.take_all().into_iter().map(|n| n.name).collect();
        assert_eq!(names, ["1", "2"]);
        assert!(inbox.take_all().is_empty());
        inbox.push(n(4)).unwrap();
    }
}
