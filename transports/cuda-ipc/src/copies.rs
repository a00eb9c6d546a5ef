//! Copies in flight: each queued copy has an event after it; `progress`
//! (called by the engine's waiting threads) completes those whose event has
//! fired, without blocking. One poller thread per instance does the same
//! while copies are in flight and no one else calls `progress` (the engine
//! spins on `progress` only briefly, then sleeps until completions arrive),
//! so there is no thread per request and nothing waits longer than a poll.

use crate::gpu::{Event, Gpus, Poll};
use crate::import::Import;
use ferry_plugins_abi::sdk::{Completer, PluginError};
use ferry_plugins_abi::ErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// Copies queued on a GPU (one request's, a block list's, or a whole
/// submission's for that GPU), until the event behind them says they are
/// done; then every token completes.
pub struct InFlight {
    pub event: Event,
    pub tokens: Vec<u64>,
    /// Keep the peer's mappings open until the copies are done.
    pub imports: Vec<Arc<Import>>,
}

pub struct Copies {
    gpus: Arc<Gpus>,
    completer: Completer,
    inflight: Mutex<Vec<InFlight>>,
    wake: Condvar,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Copies {
    /// The state and its poller thread (stopped by [`Copies::shut_down`]).
    pub fn start(
        gpus: Arc<Gpus>,
        completer: Completer,
    ) -> std::io::Result<(Arc<Copies>, std::thread::JoinHandle<()>)> {
        let c = Arc::new(Copies {
            gpus,
            completer,
            inflight: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let poller = c.clone();
        let t = std::thread::Builder::new()
            .name("ferry-cuda-ipc-poll".into())
            .spawn(move || poller.poll_loop())?;
        Ok((c, t))
    }

    pub fn add(&self, queued: Vec<InFlight>) {
        if queued.is_empty() {
            return;
        }
        lock(&self.inflight).extend(queued);
        self.wake.notify_one();
    }

    /// Completes what has finished; returns how many.
    pub fn progress(&self) -> usize {
        let Ok(mut inflight) = self.inflight.try_lock() else {
            return 0;
        };
        let mut done = Vec::new();
        let mut i = 0;
        while i < inflight.len() {
            match self.gpus.poll(inflight[i].event) {
                Poll::Pending => i += 1,
                Poll::Done => done.push((inflight.swap_remove(i), None)),
                Poll::Failed(e) => done.push((inflight.swap_remove(i), Some(e))),
            }
        }
        drop(inflight);
        let n = done.len();
        for (f, err) in done {
            self.gpus.recycle(f.event);
            drop(f.imports);
            for token in f.tokens {
                self.completer
                    .complete(token, err.as_ref().map_or(Ok(()), Err));
            }
        }
        n
    }

    fn poll_loop(&self) {
        let mut idle = 0u32;
        while !self.stop.load(Ordering::SeqCst) {
            {
                let mut inflight = lock(&self.inflight);
                while inflight.is_empty() && !self.stop.load(Ordering::SeqCst) {
                    inflight = self
                        .wake
                        .wait_timeout(inflight, Duration::from_millis(100))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
            if self.progress() > 0 {
                idle = 0;
            } else if idle < 64 {
                // Copies of a few microseconds: look again at once.
                idle += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Stops the poller, waits for what is queued and completes it; what
    /// cannot be completed is failed.
    pub fn shut_down(&self, poller: std::thread::JoinHandle<()>) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify_all();
        let _ = poller.join();
        self.gpus.sync_all();
        self.progress();
        let left: Vec<InFlight> = lock(&self.inflight).drain(..).collect();
        let cancelled = PluginError::new(
            ErrorCode::Cancelled,
            "cuda-ipc: shut down with the copy unfinished",
        );
        for token in left.into_iter().flat_map(|f| f.tokens) {
            self.completer.complete(token, Err(&cancelled));
        }
    }
}
