//! The rules batches keep: tokens, a group completing each request with
//! its own status, hooks, and the table that routes completions.

use super::lost_wakeup::{spin_until, WINDOW};
use super::*;
use std::sync::atomic::AtomicBool;

#[test]
fn tokens_round_trip() {
    assert_eq!(split_token(token(12345, 678)), (12345, 678));
}

fn local() -> Arc<LocalBuffer> {
    Arc::new(LocalBuffer {
        addr: 0x1000,
        len: 4096,
        location: crate::location::Location::Cpu(0),
        mem_kind: 1,
        device: None,
        visibility: crate::memory::Visibility::LocalOnly,
        registrations: Vec::new(),
        inflight: AtomicUsize::new(0),
    })
}

#[test]
fn requests_failed_within_a_group_fail_alone_when_it_completes() {
    let table = BatchTable::default();
    let b = table.allocate(8).unwrap();
    let start = b.reserve(6).unwrap();
    let buffer = local();
    let g = group_of(b.add_group(start, 6, buffer.clone(), None));
    let e = |m: &str| Error::new(ErrorCode::OutOfBounds, m);
    b.fail_within(g, start + 1, 2, 32, e("block one"));
    b.fail_within(g, start + 5, 1, 16, e("block three"));
    // Outside the group, or empty: ignored.
    b.fail_within(g, start + 5, 2, 16, e("past the end"));
    b.fail_within(g, start, 0, 0, e("empty"));
    assert_eq!(b.status().pending, 6, "nothing finishes before the group");
    assert_eq!(buffer.inflight.load(Ordering::SeqCst), 6);
    assert!(b.complete_group(g, Ok(())));
    let st = b.status();
    assert_eq!((st.completed, st.failed, st.pending), (3, 3, 0));
    assert_eq!(st.first_error.as_ref().map(|(i, _)| *i), Some(start + 1));
    let got: Vec<String> = (0..6)
        .map(|i| match b.request_status(start + i).unwrap() {
            RequestStatus::Failed(e) => e.message,
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        [
            "Completed",
            "block one",
            "block one",
            "Completed",
            "Completed",
            "block three"
        ]
    );
    assert_eq!(buffer.inflight.load(Ordering::SeqCst), 0);

    // A group that fails whole fails every request with its own error.
    let start = b.reserve(2).unwrap();
    let g = group_of(b.add_group(start, 2, buffer.clone(), None));
    b.fail_within(g, start, 1, 8, e("one block"));
    b.complete_group(g, Err(e("the whole run")));
    for i in 0..2 {
        match b.request_status(start + i).unwrap() {
            RequestStatus::Failed(e) => assert_eq!(e.message, "the whole run"),
            other => panic!("{other:?}"),
        }
    }
}

/// A group split into parts (a refused list served in part) finishes
/// with its last part, its failed ranges failing alone; a split that
/// does not fit the group changes nothing.
#[test]
fn a_split_group_finishes_with_its_last_part() {
    let table = BatchTable::default();
    let b = table.allocate(8).unwrap();
    let start = b.reserve(5).unwrap();
    let g = b.add_group(start, 5, local(), None);
    let e = |m: &str| Error::new(ErrorCode::OutOfBounds, m);
    assert!(!table.split_group(g, 2, vec![(4, 2, 8, e("past the end"))]));
    assert!(!table.split_group(g, 0, Vec::new()), "no part: not split");
    assert!(!table.split_group(token(b.id + 1, 0), 2, Vec::new()));
    assert!(table.split_group(g, 2, vec![(1, 2, 8, e("outside"))]));
    table.complete(g, Ok(()));
    assert_eq!(b.status().pending, 5, "one part of two finished");
    table.complete(g, Ok(()));
    let st = b.status();
    assert_eq!((st.completed, st.failed, st.pending), (3, 2, 0));
    assert_eq!(st.first_error.map(|(i, _)| i), Some(start + 1));
    assert!(!table.split_group(g, 2, Vec::new()), "done: not split");
}

/// The hook runs after the last request, not before; the batch stays
/// pending until the notification is finished.
#[test]
fn the_notification_waits_for_every_request() {
    let table = BatchTable::default();
    let b = table.allocate(4).unwrap();
    let start = b.reserve(3).unwrap();
    let g0 = group_of(b.add_group(start, 2, local(), None));
    b.complete_empty(start + 2, 1);
    let ran = Arc::new(Mutex::new(None));
    let r = ran.clone();
    b.attach_notify(Box::new(move |e| *r.lock() = Some(e)))
        .unwrap();
    assert!(ran.lock().is_none());
    assert_eq!(b.reserve(1).unwrap_err().code, ErrorCode::InvalidArgument);
    assert!(b.attach_notify(Box::new(|_| ())).is_err());
    b.complete_group(g0, Ok(()));
    assert_eq!(*ran.lock(), Some(None));
    let st = b.status();
    assert_eq!(
        (st.pending, st.notify.clone()),
        (0, Some(NotifyStatus::Pending))
    );
    assert!(!st.is_done());
    assert_eq!(table.free(b.id).unwrap_err().code, ErrorCode::Busy);
    b.finish_notify(Ok(()));
    let st = b.wait(Duration::from_secs(1), Duration::ZERO, || ());
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(st.notify, Some(NotifyStatus::Delivered));
    table.free(b.id).unwrap();
}

/// Says the completer is past its locked part, then holds it there
/// until the waiter is in the window.
struct Gate {
    arrived: Arc<AtomicBool>,
    in_window: Arc<AtomicBool>,
}

impl GroupObserver for Gate {
    fn finished(&self, _ok: bool) {
        self.arrived.store(true, Ordering::SeqCst);
        spin_until(|| self.in_window.load(Ordering::SeqCst));
    }
}

/// The last completion is counted down exactly between the waiter
/// reading a non-zero count and going to sleep: the waiter must still
/// be woken, not sleep to its deadline (this lost wake-up hung staged
/// jobs on a 16-core host until their timeout).
#[test]
fn the_last_completion_wakes_a_waiter_about_to_sleep() {
    let table = BatchTable::default();
    let b = table.allocate(1).unwrap();
    let start = b.reserve(1).unwrap();
    let g = group_of(b.add_group(start, 1, local(), None));
    let arrived = Arc::new(AtomicBool::new(false));
    let in_window = Arc::new(AtomicBool::new(false));
    let gate: Arc<dyn GroupObserver> = Arc::new(Gate {
        arrived: arrived.clone(),
        in_window: in_window.clone(),
    });
    b.observe([(g, 0)], &gate, None);
    WINDOW.set(Some(in_window));
    let b2 = b.clone();
    let completer = std::thread::spawn(move || b2.complete_group(g, Ok(())));
    spin_until(|| arrived.load(Ordering::SeqCst));
    let (st, slept) = b.wait_reporting(Duration::from_secs(10), Duration::ZERO, || ());
    WINDOW.set(None);
    completer.join().unwrap();
    assert!(st.succeeded(), "{st:?}");
    assert!(!slept, "the waiter slept through the last completion");
}

#[test]
fn a_failed_request_reaches_the_hook_and_a_batch_with_nothing_pending_runs_it_at_once() {
    let table = BatchTable::default();
    let b = table.allocate(1).unwrap();
    let start = b.reserve(1).unwrap();
    let g = group_of(b.add_group(start, 1, local(), None));
    b.complete_group(g, Err(Error::new(ErrorCode::Connection, "gone")));
    let ran = Arc::new(Mutex::new(None));
    let r = ran.clone();
    b.attach_notify(Box::new(move |e| {
        *r.lock() = Some(e.map(|(i, e)| (i, e.code)))
    }))
    .unwrap();
    assert_eq!(*ran.lock(), Some(Some((0, ErrorCode::Connection))));
    b.finish_notify(Err(Error::new(ErrorCode::Connection, "not sent")));
    let st = b.status();
    assert!(st.is_done() && !st.succeeded());
    assert!(matches!(st.notify, Some(NotifyStatus::Failed(_))));
}

/// Records what it was asked to retry.
#[derive(Default)]
struct Retrier(Mutex<Vec<(u64, usize, ErrorCode)>>);

impl Retry for Retrier {
    fn retry(self: Arc<Self>, token: u64, index: usize, error: Error) {
        self.0.lock().push((token, index, error.code));
    }
}

/// A refusal of the peer's key goes to the group's retry, once: the
/// group stays pending and its local buffer in flight; its next result
/// is final. Other failures, and groups with no retry, finish at once.
#[test]
fn a_refused_group_is_retried_once_and_stays_pending_meanwhile() {
    let table = BatchTable::default();
    let b = table.allocate(3).unwrap();
    let start = b.reserve(3).unwrap();
    let buf = local();
    let g0 = group_of(b.add_group(start, 2, buf.clone(), None));
    let g1 = group_of(b.add_group(start + 2, 1, buf.clone(), None));
    let retrier = Arc::new(Retrier::default());
    let retry: Arc<dyn Retry> = retrier.clone();
    let flight = Arc::new(Counted::default());
    let observer: Arc<dyn GroupObserver> = flight.clone();
    b.observe([(g0, 0), (g1, 1)], &observer, Some(&retry));
    let refused = || Err(Error::new(ErrorCode::OutOfBounds, "revoked"));
    assert!(!b.complete_group(g0, refused()));
    assert_eq!(
        *retrier.0.lock(),
        [(token(b.id, g0), 0, ErrorCode::OutOfBounds)]
    );
    // The first attempt told its observer it failed (no measurement).
    assert_eq!(*flight.0.lock(), [false]);
    let st = b.status();
    assert_eq!((st.pending, st.failed), (3, 0));
    assert_eq!(buf.inflight.load(Ordering::SeqCst), 3);
    assert_eq!(table.free(b.id).unwrap_err().code, ErrorCode::Busy);
    // The retry's refusal is final.
    assert!(b.complete_group(g0, refused()));
    assert_eq!(retrier.0.lock().len(), 1);
    // Another failure is not retried.
    let gone = Error::new(ErrorCode::Connection, "gone");
    assert!(b.complete_group(g1, Err(gone)));
    assert_eq!(retrier.0.lock().len(), 1);
    let st = b.status();
    assert_eq!((st.pending, st.failed), (0, 3));
    assert_eq!(st.first_error.unwrap().1.code, ErrorCode::OutOfBounds);
    assert_eq!(buf.inflight.load(Ordering::SeqCst), 0);
    // A retried group that then succeeds counts as completed.
    let b = table.allocate(1).unwrap();
    let start = b.reserve(1).unwrap();
    let g = group_of(b.add_group(start, 1, buf.clone(), None));
    b.observe([(g, 0)], &observer, Some(&retry));
    assert!(!b.complete_group(g, refused()));
    assert!(b.complete_group(g, Ok(())));
    assert!(b.status().succeeded());
}

#[derive(Default)]
struct Counted(Mutex<Vec<bool>>);

impl GroupObserver for Counted {
    fn finished(&self, ok: bool) {
        self.0.lock().push(ok);
    }
}
