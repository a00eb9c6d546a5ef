//! A peer of the initiator: up to `tcp.connections` connections to one
//! target, made on demand and authenticated (with backoff while the target
//! answers BUSY); a submit's requests split across them (large ones
//! striped, small ones packed into frames) and queued on each connection
//! (initiator.rs).

use crate::entries::{Done, Entry, Split};
use crate::errors::{connection_error, integrity, protocol};
use crate::initiator::{Conn, Settings, RETIRED_RETRIES};
use crate::reactor::Reactor;
use crate::sockio;
use crate::wire::{self, Desc, Kind, TAG_LEN};
use ferry_plugins_abi::sdk::auth::AuthError;
use ferry_plugins_abi::sdk::deadline::DeadlineStream;
use ferry_plugins_abi::sdk::{
    block_extent, BlockList, Completer, Op, PluginError, TransferRequest,
};
use ferry_plugins_abi::ErrorCode;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A work item: its operation, its entry, and whether it is a part of a
/// request split over connections (it fills a frame alone).
type Item = (Op, Entry, bool);

/// Every live connection of an instance, for `progress`.
#[derive(Default)]
pub struct ConnRegistry {
    conns: std::sync::RwLock<Vec<std::sync::Weak<Conn>>>,
}

impl ConnRegistry {
    fn add(&self, conn: &Arc<Conn>) {
        let mut list = self.conns.write().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(conn));
    }

    /// Completes, on this thread, every response that has fully arrived.
    pub fn progress(&self) -> usize {
        let list = self.conns.read().unwrap_or_else(|p| p.into_inner());
        list.iter()
            .filter_map(|w| w.upgrade())
            .map(|c| c.try_progress())
            .sum()
    }
}

/// A peer: its address and up to `connections` connections, made on demand.
pub struct TcpPeer {
    name: String,
    addr: SocketAddr,
    /// The target instance the segment was opened on (from its endpoint).
    instance: Option<u64>,
    settings: Arc<Settings>,
    completer: Completer,
    slots: Vec<Mutex<Option<Arc<Conn>>>>,
    next: AtomicUsize,
    local_ip: Mutex<Option<std::net::IpAddr>>,
    registry: Arc<ConnRegistry>,
    reactor: Arc<Reactor>,
}

impl TcpPeer {
    pub fn new(
        name: String,
        addr: SocketAddr,
        instance: Option<u64>,
        settings: Arc<Settings>,
        completer: Completer,
        registry: Arc<ConnRegistry>,
        reactor: Arc<Reactor>,
    ) -> TcpPeer {
        let slots = (0..settings.connections.max(1))
            .map(|_| Mutex::new(None))
            .collect();
        TcpPeer {
            name,
            addr,
            instance,
            settings,
            completer,
            slots,
            next: AtomicUsize::new(0),
            local_ip: Mutex::new(None),
            registry,
            reactor,
        }
    }

    /// The connection in slot `i`, connecting (again) when needed.
    fn conn(&self, i: usize) -> Result<Arc<Conn>, PluginError> {
        let mut slot = self.slots[i].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref() {
            if !c.is_broken() && !c.retire_if_stale() {
                return Ok(c.clone());
            }
        }
        if let Some(old) = slot.take() {
            old.close();
        }
        let (stream, session) = self.open()?;
        let (tx, mut rx) = (session.send, session.recv);
        let mut hello = [0u8; wire::HELLO_LEN + TAG_LEN];
        DeadlineStream::new(&stream, self.settings.connect_timeout)
            .read_exact(&mut hello)
            .map_err(|e| connection_error(&self.name, "reading the hello of", &e.to_string()))?;
        let (hello, tag) = hello.split_at(wire::HELLO_LEN);
        rx.open(&[hello], tag)
            .map_err(|e| integrity(&self.name, &e))?;
        let hello: [u8; wire::HELLO_LEN] = hello.try_into().unwrap_or([0; wire::HELLO_LEN]);
        let instance = wire::decode_hello(&hello).map_err(|e| protocol(&self.name, &e.0))?;
        if self.instance.is_some_and(|want| want != instance) {
            return Err(PluginError::new(
                ErrorCode::Connection,
                format!(
                    // Opening an open name returns the same segment: the
                    // advice names what re-reads the descriptor (the engine
                    // also does on its next submit after this failure).
                    "tcp: {} at {} is not the engine whose segment was opened (it restarted); \
                     the next submit to it re-reads its descriptor (refresh the segment to do \
                     it now) and uses the new engine's memory",
                    self.name, self.addr
                ),
            ));
        }
        sockio::configure(&stream).map_err(|e| {
            PluginError::new(ErrorCode::Io, format!("tcp: configuring a socket: {e}"))
        })?;
        if let Ok(local) = stream.local_addr() {
            *self.local_ip.lock().unwrap_or_else(|p| p.into_inner()) = Some(local.ip());
        }
        let conn = Conn::start(
            stream,
            self.name.clone(),
            (tx, rx),
            self.completer,
            self.settings.clone(),
            self.reactor.place(),
        )?;
        self.registry.add(&conn);
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Connects and authenticates, trying again with backoff (until the
    /// connect deadline) while the target answers BUSY.
    fn open(&self) -> Result<(TcpStream, ferry_plugins_abi::sdk::auth::Session), PluginError> {
        let started = Instant::now();
        let limit = self.settings.connect_timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let left = limit
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(100));
            let stream = TcpStream::connect_timeout(&self.addr, left).map_err(|e| {
                let code = if e.kind() == std::io::ErrorKind::TimedOut {
                    ErrorCode::Timeout
                } else {
                    ErrorCode::Connection
                };
                PluginError::new(
                    code,
                    format!("tcp: cannot connect to {} at {}: {e}", self.name, self.addr),
                )
            })?;
            let left = limit
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(100));
            match ferry_plugins_abi::sdk::auth::connect(
                &mut DeadlineStream::new(&stream, left),
                self.settings.token.as_ref(),
                "tcp",
                &format!("{} at {}", self.name, self.addr),
            ) {
                Ok(session) => return Ok((stream, session)),
                Err(AuthError::Busy(_)) if started.elapsed() + pause < limit => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                Err(e) => {
                    let code = match e {
                        AuthError::Refused(_) => ErrorCode::Permission,
                        AuthError::Busy(_) => ErrorCode::Busy,
                        AuthError::Protocol(_) => ErrorCode::Connection,
                    };
                    return Err(PluginError::new(code, format!("tcp: {e}")));
                }
            }
        }
    }

    /// The first slot whose connection has nothing in flight (or is not yet
    /// made), else the next in round-robin order.
    fn idle_slot(&self) -> usize {
        for (i, slot) in self.slots.iter().enumerate() {
            let slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            match slot.as_ref() {
                None => return i,
                Some(c) if c.idle() => return i,
                Some(_) => {}
            }
        }
        self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()
    }

    /// Splits, packs and queues `requests`; all accepted or none.
    pub fn submit(&self, requests: &[TransferRequest<'_>]) -> Result<(), PluginError> {
        let n = self.slots.len();
        // Work items: (op, local, remote, len, done).
        let mut items: Vec<Item> = Vec::with_capacity(requests.len());
        for r in requests {
            let mut parts = 1u64;
            if n > 1 && r.length >= self.settings.stripe_bytes.saturating_mul(2) {
                parts = (r.length / self.settings.stripe_bytes).min(n as u64);
            }
            parts = parts.max(r.length.div_ceil(wire::MAX_FRAME_PAYLOAD));
            if parts <= 1 {
                items.push((
                    r.op,
                    Entry {
                        local: r.local_addr,
                        remote: r.remote_addr,
                        len: r.length,
                        done: Done::Token(r.token),
                    },
                    false,
                ));
                continue;
            }
            let split = Arc::new(Split {
                token: r.token,
                remaining: AtomicUsize::new(parts as usize),
                error: Mutex::new(None),
            });
            let part_len = r.length.div_ceil(parts);
            let mut off = 0;
            while off < r.length {
                let len = part_len.min(r.length - off);
                items.push((
                    r.op,
                    Entry {
                        local: r.local_addr + off,
                        remote: r.remote_addr + off,
                        len,
                        done: Done::Part(split.clone()),
                    },
                    true,
                ));
                off += len;
            }
        }
        self.send_items(items)
    }

    /// Packs and queues a block list, completed once: its blocks travel as
    /// the descriptors of frames of many blocks each (one writev of the
    /// frame's blocks), spread over the connections; a block of at least
    /// two stripes is split over connections as a request is.
    pub fn submit_blocks(&self, list: &BlockList<'_>) -> Result<(), PluginError> {
        let (local_end, remote_end) = block_extent(list.blocks)?;
        if list.local_addr.checked_add(local_end).is_none()
            || list.remote_addr.checked_add(remote_end).is_none()
        {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "tcp: blocks up to {local_end:#x} / {remote_end:#x} past {:#x} / {:#x} wrap \
                     around",
                    list.local_addr, list.remote_addr
                ),
            ));
        }
        let n = self.slots.len();
        let stripe = self.settings.stripe_bytes.saturating_mul(2);
        let pieces = |len: u64| {
            let mut parts = 1u64;
            if n > 1 && len >= stripe {
                parts = (len / self.settings.stripe_bytes).min(n as u64);
            }
            parts.max(len.div_ceil(wire::MAX_FRAME_PAYLOAD))
        };
        let entries: usize = list.blocks.iter().map(|b| pieces(b.length) as usize).sum();
        let split = Arc::new(Split {
            token: list.token,
            remaining: AtomicUsize::new(entries),
            error: Mutex::new(None),
        });
        let mut items: Vec<Item> = Vec::with_capacity(entries);
        for b in list.blocks {
            let parts = pieces(b.length);
            let (local, remote) = (
                list.local_addr + b.local_offset,
                list.remote_addr + b.remote_offset,
            );
            let part_len = b.length.div_ceil(parts);
            let mut off = 0;
            while off < b.length {
                let len = part_len.min(b.length - off);
                items.push((
                    list.op,
                    Entry {
                        local: local + off,
                        remote: remote + off,
                        len,
                        done: Done::Part(split.clone()),
                    },
                    parts > 1,
                ));
                off += len;
            }
        }
        self.send_items(items)
    }

    /// Packs work items into frames and queues them; all accepted or none.
    fn send_items(&self, items: Vec<Item>) -> Result<(), PluginError> {
        let n = self.slots.len();
        // Pack into frames: one op per frame, bounded by descriptors and
        // bytes; every part of a split request starts a frame of its own so
        // the parts land on different connections.
        let mut frames: Vec<(Op, Vec<Entry>)> = Vec::new();
        let mut bytes = 0u64;
        for (op, entry, is_part) in items {
            let start_new = match frames.last() {
                None => true,
                Some((fop, entries)) => {
                    *fop != op
                        || is_part
                        || entries.len() >= wire::MAX_DESCS
                        || bytes >= self.settings.frame_bytes
                        || bytes + entry.len > wire::MAX_FRAME_PAYLOAD
                }
            };
            if start_new {
                frames.push((op, Vec::new()));
                bytes = 0;
            }
            bytes += entry.len;
            if let Some((_, entries)) = frames.last_mut() {
                entries.push(entry);
            }
            if is_part {
                // A part fills its frame alone.
                bytes = u64::MAX / 2;
            }
        }

        // Connect every connection we are about to use before accepting
        // anything, so a dead peer fails the whole submit cleanly.
        // A lone frame goes to the first idle connection, so a caller issuing
        // one request after another keeps hitting the same target thread
        // (which polls for its next frame); batches spread round-robin.
        let first = if frames.len() == 1 {
            self.idle_slot()
        } else {
            self.next.fetch_add(frames.len(), Ordering::Relaxed)
        };
        let mut conns: Vec<(usize, Arc<Conn>)> = Vec::with_capacity(frames.len().min(n));
        for k in 0..frames.len().min(n) {
            let i = (first + k) % n;
            conns.push((i, self.conn(i)?));
        }
        for (k, (op, entries)) in frames.into_iter().enumerate() {
            let used = conns.len();
            let (slot, conn) = &mut conns[k % used];
            let descs: Vec<Desc> = entries
                .iter()
                .map(|e| Desc {
                    addr: e.remote,
                    len: e.len,
                })
                .collect();
            let (kind, payload): (Kind, Vec<(u64, u64)>) = match op {
                Op::Write => (
                    Kind::Write,
                    entries.iter().map(|e| (e.local, e.len)).collect(),
                ),
                Op::Read => (Kind::Read, Vec::new()),
            };
            let mut entries = entries;
            let mut attempt = 0;
            loop {
                match conn.enqueue(kind, &descs, &payload, entries) {
                    Ok(()) => break,
                    // Retired by another submit meanwhile: take its successor.
                    Err((_, back, true)) if attempt < RETIRED_RETRIES => {
                        attempt += 1;
                        match self.conn(*slot) {
                            Ok(c) => {
                                *conn = c;
                                entries = back;
                            }
                            Err(e) => {
                                for entry in back {
                                    entry.finish(&self.completer, Err(e.clone()));
                                }
                                break;
                            }
                        }
                    }
                    Err((err, back, _)) => {
                        // Accepted already: report through completions.
                        for entry in back {
                            entry.finish(&self.completer, Err(err.clone()));
                        }
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        let local = *self.local_ip.lock().unwrap_or_else(|p| p.into_inner());
        let via = local
            .and_then(|ip| Some((ferry_plugins_abi::sdk::net::interface_with(ip)?, ip)))
            .map(|(i, ip)| format!(" via {} ({ip})", i.name))
            .unwrap_or_default();
        format!(
            "tcp to {}{via}, up to {} connections, frames of {} KiB",
            self.addr,
            self.slots.len(),
            self.settings.frame_bytes / 1024
        )
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        for slot in &self.slots {
            if let Some(c) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                c.close();
            }
        }
    }
}
