//! The copies of one submission: requests cut into parts of about equal
//! size for the copy threads, each part copied through a mapping of the
//! peer's memory (loads and stores, optionally non-temporal stores) or by
//! cross-memory attach (process_vm_readv/writev over iovec batches), and
//! the requests that failed, with why.
//!
//! Small submissions are one part, copied on the caller's thread: no hand-off
//! adds latency to them.

use crate::cma;
use crate::pool::Pool;
use ferry_plugins_abi::sdk::{Block, Op};
use std::io;
use std::sync::Mutex;

/// A submission smaller than twice this stays on the caller's thread, and
/// no part is smaller than this (a hand-off costs a few microseconds, the
/// time to copy tens of KiB).
pub const MIN_PART: u64 = 64 << 10;

/// Most iovecs one process_vm_readv/writev takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// A stretch's iovecs: a small one's on the stack.
type Iovecs = smallvec::SmallVec<[libc::iovec; 16]>;

/// One request's copy (or a slice of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the request in the submission.
    pub req: usize,
    pub op: Op,
    pub local: u64,
    /// Mapped: an address in our mapping of the peer's memory. Cross-memory
    /// attach: an address in the peer.
    pub remote: u64,
    pub len: u64,
}

/// When non-temporal stores are used on the mapped path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonTemporal {
    Off,
    /// For submissions whose share per copy thread is at least this many
    /// bytes.
    From(u64),
}

impl NonTemporal {
    /// Smaller shares use regular stores: they fit in cache, and
    /// the peer may read them from there.
    const DEFAULT_MIN: u64 = 256 << 10;

    /// From the `shm.nontemporal` setting: `on` (the default), `off`, or
    /// the part size in bytes from which they are used; Err explains a bad
    /// value.
    pub fn parse(v: Option<&str>) -> Result<NonTemporal, String> {
        match v.map(str::trim) {
            Some("off" | "0" | "false" | "no") => Ok(NonTemporal::Off),
            None | Some("" | "on" | "1" | "true" | "yes") => {
                Ok(NonTemporal::From(Self::DEFAULT_MIN))
            }
            Some(s) => s
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(NonTemporal::From)
                .ok_or_else(|| {
                    format!(
                        "FERRY_SHM_NONTEMPORAL={s:?} is not 'on', 'off' or a size in bytes \
                         from which non-temporal stores are used"
                    )
                }),
        }
    }

    fn applies(self, len: u64) -> bool {
        matches!(self, NonTemporal::From(min) if len >= min)
    }

    /// Whether a submission of `total` bytes in `parts` parts uses them:
    /// decided on one thread's share of the whole, not on a part.
    fn applies_to(self, total: u64, parts: usize, pool: Option<&Pool>) -> bool {
        let threads = pool.map_or(1, |p| p.helpers() + 1).min(parts).max(1);
        self.applies(total / threads as u64)
    }
}

/// Parts per copy thread: threads claim parts as they come free, so one
/// that starts late (woken after the caller began) or runs slower takes
/// fewer, and the caller waits at most about a part for the last one.
const PARTS_PER_COPIER: usize = 4;

/// How many parts `total` bytes make for `copiers` threads.
pub fn parts_for(total: u64, copiers: usize) -> usize {
    if copiers <= 1 {
        return 1;
    }
    ((total / MIN_PART) as usize).clamp(1, copiers * PARTS_PER_COPIER)
}

/// Cuts `pieces` into `parts` runs of about equal bytes (cutting pieces
/// where a run ends, at 4 KiB boundaries). Returns the pieces and where
/// each run starts in them (one more entry than runs: the end).
pub fn split(pieces: &[Piece], parts: usize) -> (Vec<Piece>, Vec<usize>) {
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    let parts = parts.max(1) as u64;
    let share = total.div_ceil(parts).next_multiple_of(4096).max(1);
    let mut out = Vec::with_capacity(pieces.len() + parts as usize);
    let mut starts = vec![0];
    let mut room = share;
    for p in pieces {
        let mut p = *p;
        while p.len > room {
            out.push(Piece { len: room, ..p });
            p.local += room;
            p.remote += room;
            p.len -= room;
            starts.push(out.len());
            room = share;
        }
        if p.len > 0 {
            out.push(p);
            room -= p.len;
        }
        if room == 0 {
            starts.push(out.len());
            room = share;
        }
    }
    if *starts.last().unwrap_or(&0) != out.len() {
        starts.push(out.len());
    }
    (out, starts)
}

/// Runs `one(run of pieces)` for every part, on the pool when there is
/// more than one part and a pool; `total`: the pieces' bytes. False when a
/// part did not finish.
fn run_parts(
    pool: Option<&Pool>,
    (pieces, total): (&[Piece], u64),
    parts: usize,
    one: &(dyn Fn(&[Piece]) + Sync),
) -> bool {
    match pool {
        Some(pool) if parts > 1 && pool.helpers() > 0 => {
            let share = total.div_ceil(parts as u64);
            if let Some(starts) = run_starts(pieces.iter().map(|p| p.len), share) {
                // Runs of whole pieces: slices of `pieces`, nothing copied.
                return pool.run(
                    starts.len() - 1,
                    &|i| one(&pieces[starts[i]..starts[i + 1]]),
                );
            }
            let (cut, starts) = split(pieces, parts);
            pool.run(starts.len() - 1, &|i| one(&cut[starts[i]..starts[i + 1]]))
        }
        _ => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one(pieces))).is_ok(),
    }
}

/// Copies mapped pieces. False when a part did not finish (a bug, reported
/// as a failure of every request of the submission).
///
/// # Safety
/// Every piece's local range must be valid memory of this process, and its
/// remote range must lie inside a mapping that stays mapped until this
/// returns.
pub unsafe fn mapped(pool: Option<&Pool>, pieces: &[Piece], parts: usize, nt: NonTemporal) -> bool {
    let total = total_of(pieces);
    let nt = nt.applies_to(total, parts, pool);
    // SAFETY: the `# Safety` section of `mapped` is mapped_with's.
    unsafe { mapped_with(pool, (pieces, total), parts, nt) }
}

/// The bytes of `pieces`.
fn total_of(pieces: &[Piece]) -> u64 {
    pieces.iter().fold(0, |t, p| t.saturating_add(p.len))
}

/// [`mapped`] with the pieces' total bytes known and the choice of
/// non-temporal stores made.
///
/// # Safety
/// As [`mapped`].
unsafe fn mapped_with(
    pool: Option<&Pool>,
    (pieces, total): (&[Piece], u64),
    parts: usize,
    nt: bool,
) -> bool {
    run_parts(pool, (pieces, total), parts, &|run| {
        // SAFETY: `run` is a sub-run of `pieces` (split only cuts pieces),
        // so the `# Safety` section of mapped_with is copy_run's for each
        // of its pieces.
        unsafe { copy_run(run.len(), |k| run[k], nt) }
    })
}

/// Copies a block list on the mapped path: block k between `local +
/// blocks[k].local_offset` and `remote + blocks[k].remote_offset`. The
/// copy threads take runs of whole blocks and work out each block's
/// addresses as they go, so nothing is built per block first: a list of
/// 65,536 pieces was a 2.6 MiB vector in pages faulted in afresh every
/// batch (1.1 ms of one thread on the development VM to fill), then copied
/// again by `split`, before any copy thread could start; what is left
/// before them (the list's checks, its total, the runs) takes 0.4 ms. A
/// list with a block longer than a part's share (a few large blocks) goes
/// through [`mapped`], which cuts them. `total`: the blocks' bytes. False
/// when a part did not finish.
///
/// # Safety
/// Every block's local range (from `local`) must be valid memory of this
/// process, and its remote range (from `remote`) must lie inside a mapping
/// that stays mapped until this returns.
pub unsafe fn mapped_blocks(
    pool: Option<&Pool>,
    op: Op,
    (local, remote): (u64, u64),
    (blocks, total): (&[Block], u64),
    parts: usize,
    nt: NonTemporal,
) -> bool {
    let piece = |k: usize| block_piece(op, (local, remote), k, &blocks[k]);
    let parts = parts.max(1);
    let nt = nt.applies_to(total, parts, pool);
    let Some(pool) = pool.filter(|p| parts > 1 && p.helpers() > 0) else {
        // SAFETY: every block of the list, as this function's `# Safety`.
        let one = || unsafe { copy_run(blocks.len(), piece, nt) };
        return std::panic::catch_unwind(std::panic::AssertUnwindSafe(one)).is_ok();
    };
    let share = total.div_ceil(parts as u64);
    let Some(starts) = run_starts(blocks.iter().map(|b| b.length), share) else {
        let pieces: Vec<Piece> = (0..blocks.len()).map(piece).collect();
        // SAFETY: the same ranges, as pieces: this function's `# Safety`.
        return unsafe { mapped_with(Some(pool), (&pieces, total), parts, nt) };
    };
    pool.run(starts.len() - 1, &|i| {
        let first = starts[i];
        // SAFETY: blocks first..starts[i + 1] of the list, each covered by
        // this function's `# Safety`.
        unsafe { copy_run(starts[i + 1] - first, |k| piece(first + k), nt) }
    })
}

/// Block `k` of a list whose blocks are offsets from `local` and `remote`,
/// as the piece to copy (its request: `k`).
pub fn block_piece(op: Op, (local, remote): (u64, u64), k: usize, b: &Block) -> Piece {
    Piece {
        req: k,
        op,
        local: local + b.local_offset,
        remote: remote + b.remote_offset,
        len: b.length,
    }
}

/// Where runs of whole pieces (of these lengths) of about `share` bytes
/// each start: one more entry than runs, the last the end; None when a
/// piece is longer than `share` (it is to be cut). A piece goes to the run
/// its middle byte falls in, so every run is within a piece of `share`
/// (closing a run only once it held `share` made runs of two 60 KiB pieces
/// where 64 KiB was meant, leaving half the copy threads without one).
fn run_starts(lengths: impl ExactSizeIterator<Item = u64>, share: u64) -> Option<Vec<usize>> {
    let n = lengths.len();
    let share = share.max(1);
    let mut starts = vec![0];
    let (mut before, mut run) = (0u64, 0u64);
    for (k, len) in lengths.enumerate() {
        if len > share {
            return None;
        }
        let of = before.saturating_add(len / 2) / share;
        if of > run && k > 0 {
            starts.push(k);
            run = of;
        }
        before = before.saturating_add(len);
    }
    starts.push(n);
    Some(starts)
}

/// Copies pieces `piece(0..n)` on this thread, touching each small one's
/// first line a few pieces ahead, then fences once.
///
/// # Safety
/// Every piece's local range must be valid memory of this process, and its
/// remote range must lie inside a mapping that stays mapped until this
/// returns.
#[inline(always)]
unsafe fn copy_run(n: usize, piece: impl Fn(usize) -> Piece, nt: bool) {
    for k in 0..n {
        let p = piece(k);
        let (dst, src) = match p.op {
            Op::Write => (p.remote, p.local),
            Op::Read => (p.local, p.remote),
        };
        if k + AHEAD < n {
            touch_ahead(&piece(k + AHEAD));
        }
        // SAFETY: copy_unfenced needs `src` readable and `dst` writable for
        // p.len bytes: by the `# Safety` section the local range is valid
        // memory of this process and the remote one lies inside a mapping
        // kept mapped until we return; memory.rs maps peers' memory
        // PROT_READ | PROT_WRITE, so either may be the destination.
        unsafe { copy_unfenced(dst as *mut u8, src as *const u8, p.len as usize, nt) };
    }
    // One fence per run, not per piece: a fence waits for every streaming
    // store in flight, which cost a 4 KiB block as much as its bytes.
    store_fence(nt);
}

/// How many pieces ahead of the one being copied [`touch_ahead`] looks.
const AHEAD: usize = 4;

/// Pieces at most this long are touched ahead; a longer one's own copy
/// hides the start of the next.
const TOUCH_BELOW: u64 = 64 << 10;

/// Loads the first line of a small piece's source and destination a few
/// pieces ahead. Scattered small blocks (a KV cache's) each start on a
/// page neither the TLB nor the hardware prefetcher has seen, and a copy
/// that waits for the page walks and the first line each time moved 4 KiB
/// blocks about 20% slower here (prefetching the whole next block was
/// slower still: it competes with the copy for the memory bus).
fn touch_ahead(p: &Piece) {
    #[cfg(target_arch = "x86_64")]
    if p.len < TOUCH_BELOW {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of x86-64; a prefetch never faults, whatever
        // the address (these lie in the piece's ranges anyway).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p.local as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(p.remote as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Why a cross-memory-attach piece failed.
#[derive(Debug)]
pub enum Failure {
    /// The system call failed with this error.
    Refused(io::Error),
    /// The peer's range is not mapped (the kernel stopped there).
    Short,
    /// A copy thread did not finish its part.
    Incomplete,
}

/// Copies pieces by cross-memory attach with process `pid`. Returns the
/// failed pieces' requests, each with why (a request may appear more than
/// once when several of its slices failed).
///
/// # Safety
/// Every piece's local range must be valid memory of this process (writable
/// for reads) until this returns.
pub unsafe fn cma(
    pool: Option<&Pool>,
    pid: i32,
    pieces: &[Piece],
    parts: usize,
) -> Vec<(usize, Failure)> {
    let failed: Mutex<Vec<(usize, Failure)>> = Mutex::default();
    let done = run_parts(pool, (pieces, total_of(pieces)), parts, &|run| {
        let mut mine = Vec::new();
        // SAFETY: cma_run hands each piece's local range (or a sub-range) to
        // process_vm_readv/writev as a local iovec; `run` is a sub-run of
        // `pieces`, whose local ranges the `# Safety` section makes valid
        // memory (writable for reads) until cma returns, after run_parts.
        unsafe { cma_run(pid, run, &mut mine) };
        if !mine.is_empty() {
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(mine);
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    if !done {
        failed.extend(pieces.iter().map(|p| (p.req, Failure::Incomplete)));
    }
    failed
}

/// Most bytes one system call is asked to move: the kernel shortens a
/// longer iovec list to about 2 GiB (MAX_RW_COUNT) without saying so.
const CALL_MAX: u64 = 1 << 30;

/// One thread's pieces, in as few system calls as they allow: pieces that
/// continue each other on both sides (a batch of consecutive blocks) are
/// one iovec, so the kernel pins the peer's pages many at a time rather
/// than one lookup per block; a call takes up to IOV_MAX iovecs of one
/// operation. After a short count the call resumes where the kernel
/// stopped; a call that moves nothing fails the piece it started in, so
/// one unmapped range fails only its own request.
unsafe fn cma_run(pid: i32, run: &[Piece], failed: &mut Vec<(usize, Failure)>) {
    let iov = |addr: u64, len: u64| libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len as usize,
    };
    // Where the next call starts: a piece, and how far into it.
    let (mut at, mut into) = (0usize, 0u64);
    loop {
        while at < run.len() && run[at].len == into {
            (at, into) = (at + 1, 0);
        }
        if at == run.len() {
            return;
        }
        let op = run[at].op;
        let (mut local, mut remote) = (Iovecs::new(), Iovecs::new());
        let mut asked = 0u64;
        let mut end = at;
        while end < run.len() && run[end].op == op && asked < CALL_MAX {
            let p = &run[end];
            let skip = if end == at { into } else { 0 };
            let len = (p.len - skip).min(CALL_MAX - asked);
            let (l, r) = (p.local + skip, p.remote + skip);
            let full = local.len() == IOV_MAX;
            match (local.last_mut(), remote.last_mut()) {
                (Some(lv), Some(rv))
                    if lv.iov_base as u64 + lv.iov_len as u64 == l
                        && rv.iov_base as u64 + rv.iov_len as u64 == r =>
                {
                    lv.iov_len += len as usize;
                    rv.iov_len += len as usize;
                }
                _ if full => break,
                _ => {
                    local.push(iov(l, len));
                    remote.push(iov(r, len));
                }
            }
            asked += len;
            end += 1;
        }
        // SAFETY: vectored needs every local iovec valid for the call
        // (writable for reads): each is a piece's [local + skip, +len) with
        // len <= p.len - skip, or such ranges merged only where contiguous,
        // so it lies in local ranges of `run`. cma_run has no `# Safety` of
        // its own: its one caller, cma, passes a sub-run of pieces whose local
        // ranges cma's `# Safety` keeps valid (writable for reads) until cma
        // returns. The kernel checks the remote iovecs against the peer's
        // address space (EFAULT).
        let moved = unsafe { cma::vectored(pid, op == Op::Write, &local, &remote) };
        match moved {
            Ok(n) if n > 0 => {
                // Advance past what moved: whole pieces, then into one.
                let mut n = n as u64;
                while n > 0 && at < run.len() {
                    let left = run[at].len - into;
                    if n >= left {
                        n -= left;
                        (at, into) = (at + 1, 0);
                    } else {
                        into += n;
                        n = 0;
                    }
                }
            }
            Ok(_) => {
                failed.push((run[at].req, Failure::Short));
                (at, into) = (at + 1, 0);
            }
            Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                // Nothing moved: the peer's range where the call started
                // is not mapped (our own ranges are registered memory).
                failed.push((run[at].req, Failure::Short));
                (at, into) = (at + 1, 0);
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                failed.push((run[at].req, Failure::Refused(e)));
                (at, into) = (at + 1, 0);
            }
            Err(e) => {
                // The peer is gone or we may not attach: every piece fails.
                for p in &run[at..] {
                    failed.push((
                        p.req,
                        Failure::Refused(io::Error::from_raw_os_error(
                            e.raw_os_error().unwrap_or(libc::EIO),
                        )),
                    ));
                }
                return;
            }
        }
    }
}

/// Copies `len` bytes; with non-temporal stores when `nt` and the ranges
/// do not overlap (x86-64; elsewhere always memmove).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes.
#[cfg(test)]
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, nt: bool) {
    // SAFETY: copy_unfenced's requirement (`src` readable, `dst` writable for
    // `len` bytes) is the `# Safety` section of copy_bytes itself, which the
    // tests calling it meet with ranges inside their own vectors.
    unsafe { copy_unfenced(dst, src, len, nt) };
    store_fence(nt);
}

/// Orders the streaming stores issued so far before what follows (the
/// completion that tells the peer its bytes are there).
pub fn store_fence(nt: bool) {
    #[cfg(target_arch = "x86_64")]
    if nt {
        // SAFETY: sfence has no preconditions; SSE is part of x86-64.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = nt;
}

/// As [`copy_bytes`], without the fence after streaming stores: the caller
/// calls [`store_fence`] once after a run of copies.
///
/// # Safety
/// As [`copy_bytes`].
pub unsafe fn copy_unfenced(dst: *mut u8, src: *const u8, len: usize, nt: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let apart = (dst as usize).abs_diff(src as usize) >= len;
        if nt && len >= 64 && apart {
            // SAFETY: copy_streaming needs `src` readable and `dst` writable
            // for `len` bytes, which the `# Safety` section (as copy_bytes's)
            // gives, and the two ranges apart: `apart` checked just above
            // that their starts are at least `len` bytes from each other.
            unsafe { copy_streaming(dst, src, len) };
            return;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = nt;
    // SAFETY: the `# Safety` section (as copy_bytes's) makes `src` readable
    // and `dst` writable for `len` bytes; u8 needs no alignment, and
    // ptr::copy (memmove) tolerates overlap (a loopback to this process's own
    // mapping of the same file).
    unsafe { std::ptr::copy(src, dst, len) }
}

/// Loads, and stores that bypass the cache (the destination is the other
/// process's, not read here soon), 64 bytes at a time. The stores start at
/// a cache line: streaming stores that straddle two lines are flushed as
/// partial writes (a destination 16 bytes off a line copied 25-40% slower
/// here, as plain malloc'ed buffers are).
///
/// # Safety
/// As [`copy_bytes`], and the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    // SAFETY: within the caller's ranges (head <= len), not overlapping.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let (mut d, mut s, mut n) = (dst.wrapping_add(head), src.wrapping_add(head), len - head);
    while n >= 64 {
        // SAFETY: 64 bytes remain at s (readable) and d (writable, 64-byte
        // aligned, more than _mm_stream_si128's 16); SSE2 is part of x86-64.
        unsafe {
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            d = d.add(64);
            s = s.add(64);
        }
        n -= 64;
    }
    // SAFETY: the n < 64 bytes left of both ranges. The caller fences.
    unsafe { std::ptr::copy_nonoverlapping(s, d, n) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn piece(req: usize, local: u64, remote: u64, len: u64) -> Piece {
        Piece {
            req,
            op: Op::Write,
            local,
            remote,
            len,
        }
    }

    #[test]
    fn splitting_keeps_every_byte_once_in_balanced_parts() {
        let pieces = [
            piece(0, 0, 1 << 40, 3 << 20),
            piece(1, 3 << 20, (1 << 40) + (8 << 20), 4096),
            piece(2, 8 << 20, (1 << 40) + (16 << 20), 5 << 20),
        ];
        for parts in 1..=9 {
            let (cut, starts) = split(&pieces, parts);
            assert!(starts.len() - 1 <= parts, "{parts}: {starts:?}");
            assert_eq!(*starts.last().unwrap(), cut.len());
            for (req, whole) in pieces.iter().enumerate() {
                let mine: Vec<&Piece> = cut.iter().filter(|p| p.req == req).collect();
                assert_eq!(mine.iter().map(|p| p.len).sum::<u64>(), whole.len);
                // Consecutive, gapless slices of the request.
                let mut at = whole.local;
                for p in mine {
                    assert_eq!(p.local, at);
                    assert_eq!(p.remote - whole.remote, at - whole.local);
                    at += p.len;
                }
            }
            let sizes: Vec<u64> = starts
                .windows(2)
                .map(|w| cut[w[0]..w[1]].iter().map(|p| p.len).sum())
                .collect();
            let max = *sizes.iter().max().unwrap();
            assert!(
                max <= (8 << 20) / parts as u64 + 4096 * 2 || parts == 1,
                "{sizes:?}"
            );
        }
        assert_eq!(parts_for(4096, 16), 1);
        assert_eq!(parts_for(1 << 20, 16), 16);
        assert_eq!(parts_for(1 << 20, 2), 8);
        assert_eq!(parts_for(16 << 20, 16), 64);
        assert_eq!(parts_for(16 << 20, 1), 1);
    }

    #[test]
    fn block_lists_move_every_block_to_its_place_in_runs_of_whole_blocks() {
        let block = |l: u64, r: u64, n: u64| Block {
            local_offset: l,
            remote_offset: r,
            length: n,
        };
        let pool = Pool::new(3, BTreeSet::new()).unwrap();
        let src: Vec<u8> = (0..8 << 20).map(|i| (i * 13 + i / 4093) as u8).collect();
        // 2,048 blocks of 4 KiB to reversed places, then one list whose
        // last block is longer than a part's share (cut by `mapped`).
        let small: Vec<Block> = (0..2048u64)
            .map(|k| block(k * 4096, (2047 - k) * 4096, 4096))
            .collect();
        let mut large = small[..1024].to_vec();
        large.push(block(4 << 20, 0, 4 << 20));
        for (blocks, parts) in [(&small, 8), (&small, 1), (&large, 8)] {
            for nt in [NonTemporal::Off, NonTemporal::From(1)] {
                let mut dst = vec![0u8; src.len()];
                let ends = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
                let total = blocks.iter().map(|b| b.length).sum();
                let list = (&blocks[..], total);
                // SAFETY: every block lies inside the first 8 MiB of src
                // and dst, both alive meanwhile.
                let done = unsafe { mapped_blocks(Some(&pool), Op::Write, ends, list, parts, nt) };
                assert!(done);
                for b in blocks.iter() {
                    let (l, r, n) = (
                        b.local_offset as usize,
                        b.remote_offset as usize,
                        b.length as usize,
                    );
                    assert!(dst[r..r + n] == src[l..l + n], "{nt:?}, {parts} parts");
                }
            }
        }
        // The same small blocks as pieces: runs of whole pieces, sliced.
        let mut dst = vec![0u8; src.len()];
        let pieces: Vec<Piece> = (small.iter().enumerate())
            .map(|(k, b)| {
                let local = src.as_ptr() as u64 + b.local_offset;
                piece(
                    k,
                    local,
                    dst.as_mut_ptr() as u64 + b.remote_offset,
                    b.length,
                )
            })
            .collect();
        // SAFETY: as above.
        assert!(unsafe { mapped(Some(&pool), &pieces, 8, NonTemporal::From(1)) });
        assert!(
            dst == src[..]
                .chunks(4096)
                .rev()
                .flatten()
                .copied()
                .collect::<Vec<u8>>()
        );
        let lengths = |b: &[Block]| b.iter().map(|b| b.length).collect::<Vec<_>>().into_iter();
        let starts = run_starts(lengths(&small), 1 << 20).unwrap();
        assert_eq!(starts, vec![0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]);
        assert_eq!(run_starts(lengths(&small[..1]), 1 << 20), Some(vec![0, 1]));
        let starts = run_starts([60 << 10; 17].into_iter(), 64 << 10).unwrap();
        assert_eq!(starts.len() - 1, 16, "{starts:?}");
        assert_eq!(run_starts([].into_iter(), 1), Some(vec![0, 0]));
        assert_eq!(run_starts(lengths(&large), 1 << 20), None);
    }

    #[test]
    fn mapped_copies_on_several_threads_move_every_byte() {
        let pool = Pool::new(3, BTreeSet::new()).unwrap();
        let src: Vec<u8> = (0..(9 << 20) + 123)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        for nt in [NonTemporal::Off, NonTemporal::From(1)] {
            let mut dst = vec![0u8; src.len()];
            let pieces = [
                piece(0, src.as_ptr() as u64, dst.as_mut_ptr() as u64, 5 << 20),
                piece(
                    1,
                    src.as_ptr() as u64 + (5 << 20),
                    dst.as_mut_ptr() as u64 + (5 << 20),
                    src.len() as u64 - (5 << 20),
                ),
            ];
            // SAFETY: both pieces lie inside src and dst, alive meanwhile.
            assert!(unsafe { mapped(Some(&pool), &pieces, 4, nt) });
            assert!(dst == src, "{nt:?}");
        }
    }

    #[test]
    fn unaligned_streaming_copies_are_exact() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        for (off, len) in [
            (0, 0),
            (1, 63),
            (3, 64),
            (5, 4000),
            (17, 4983),
            (33, 30),
            (47, 130),
            (60, 4),
        ] {
            let mut dst = vec![0u8; 5000];
            // SAFETY: [off, off + len) lies inside both vectors.
            unsafe { copy_bytes(dst.as_mut_ptr().add(off), src.as_ptr().add(off), len, true) };
            assert_eq!(dst[off..off + len], src[off..off + len]);
            assert!(dst[off + len..].iter().all(|b| *b == 0));
        }
    }

    #[test]
    fn cross_memory_attach_merges_consecutive_blocks_and_fails_only_the_hole() {
        if cma::syscalls_allowed().is_err() {
            return;
        }
        const PAGE: usize = 4096;
        // Five pages of the "peer" (ourselves), the middle one unmapped.
        // SAFETY: a fresh anonymous mapping, then one page of it unmapped.
        let peer = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                5 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            std::ptr::write_bytes(p.cast::<u8>(), 9, 5 * PAGE);
            assert_eq!(libc::munmap(p.cast::<u8>().add(2 * PAGE).cast(), PAGE), 0);
            p as u64
        };
        let mut dst = vec![0u8; 5 * PAGE];
        let local = dst.as_mut_ptr() as u64;
        let pid = std::process::id() as i32;
        // One request per page, consecutive on both sides: one iovec; the
        // request on the hole fails, those after it still move.
        let pieces: Vec<Piece> = (0..5u64)
            .map(|i| Piece {
                op: Op::Read,
                ..piece(i as usize, local + i * 4096, peer + i * 4096, 4096)
            })
            .collect();
        // SAFETY: every local range lies inside dst.
        let failed = unsafe { cma(None, pid, &pieces, 1) };
        let reqs: Vec<usize> = failed.iter().map(|f| f.0).collect();
        assert_eq!(reqs, [2], "{failed:?}");
        assert!(matches!(failed[0].1, Failure::Short));
        assert!(dst[..2 * PAGE].iter().all(|b| *b == 9));
        assert!(dst[2 * PAGE..3 * PAGE].iter().all(|b| *b == 0));
        assert!(dst[3 * PAGE..].iter().all(|b| *b == 9));
        // More separate ranges than one call takes (gaps between them):
        // every one moves.
        let src: Vec<u8> = (0..3000 * 64).map(|i| (i / 64) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let pieces: Vec<Piece> = (0..1500u64)
            .map(|i| Piece {
                op: Op::Read,
                ..piece(
                    i as usize,
                    dst.as_mut_ptr() as u64 + i * 128,
                    src.as_ptr() as u64 + i * 128,
                    64,
                )
            })
            .collect();
        // SAFETY: every local range lies inside dst.
        let failed = unsafe { cma(None, pid, &pieces, 1) };
        assert!(failed.is_empty(), "{failed:?}");
        for i in 0..3000 {
            let want = if i % 2 == 0 { i as u8 } else { 0 };
            assert!(dst[i * 64..(i + 1) * 64].iter().all(|b| *b == want));
        }
        // SAFETY: unmaps what is left of the mapping made above.
        unsafe {
            libc::munmap(peer as *mut libc::c_void, 2 * PAGE);
            libc::munmap((peer + 3 * 4096) as *mut libc::c_void, 2 * PAGE);
        }
    }

    #[test]
    fn cross_memory_attach_fails_only_the_unmapped_request() {
        if cma::syscalls_allowed().is_err() {
            return;
        }
        let pool = Pool::new(1, BTreeSet::new()).unwrap();
        let src = vec![7u8; 1 << 20];
        let mut dst = vec![0u8; 1 << 20];
        let pid = std::process::id() as i32;
        let read = |req, local: u64, remote: u64, len| Piece {
            op: Op::Read,
            ..piece(req, local, remote, len)
        };
        let pieces = [
            read(0, dst.as_mut_ptr() as u64, src.as_ptr() as u64, 256 << 10),
            read(1, dst.as_mut_ptr() as u64 + (256 << 10), 8, 4096),
            read(
                2,
                dst.as_mut_ptr() as u64 + (512 << 10),
                src.as_ptr() as u64 + (512 << 10),
                512 << 10,
            ),
        ];
        // SAFETY: every local range lies inside dst.
        let failed = unsafe { cma(Some(&pool), pid, &pieces, 2) };
        let reqs: BTreeSet<usize> = failed.iter().map(|f| f.0).collect();
        assert_eq!(reqs, BTreeSet::from([1]), "{failed:?}");
        assert!(dst[..256 << 10].iter().all(|b| *b == 7));
        assert!(dst[512 << 10..].iter().all(|b| *b == 7));
        assert!(NonTemporal::parse(Some("on")).unwrap().applies(1 << 20));
        assert_eq!(NonTemporal::parse(Some("off")), Ok(NonTemporal::Off));
        assert_eq!(NonTemporal::parse(None), NonTemporal::parse(Some("on")));
        assert!(NonTemporal::parse(Some("fast")).is_err());
    }
}
