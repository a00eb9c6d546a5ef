use super::*;

fn err(code: ErrorCode, what: &str) -> Error {
    Error::new(code, what)
}

#[test]
fn a_write_leaves_the_local_device_first_and_a_read_last() {
    use Leg::*;
    assert_eq!(
        legs(Op::Write, true, true).as_slice(),
        [LocalCopy, Host, PeerCopy]
    );
    assert_eq!(
        legs(Op::Read, true, true).as_slice(),
        [PeerCopy, Host, LocalCopy]
    );
}

#[test]
fn host_memory_at_either_end_has_no_copy_leg() {
    use Leg::*;
    assert_eq!(legs(Op::Write, true, false).as_slice(), [LocalCopy, Host]);
    assert_eq!(legs(Op::Write, false, true).as_slice(), [Host, PeerCopy]);
    assert_eq!(legs(Op::Read, false, true).as_slice(), [PeerCopy, Host]);
    assert_eq!(legs(Op::Read, true, false).as_slice(), [Host, LocalCopy]);
    assert_eq!(legs(Op::Read, false, false).as_slice(), [Host]);
}

#[test]
fn chunks_cover_a_request_with_a_short_last_one() {
    assert_eq!(chunk_offsets(10, 4).collect::<Vec<_>>(), [0, 4, 8]);
    assert_eq!(chunk_offsets(8, 4).collect::<Vec<_>>(), [0, 4]);
    assert_eq!(chunk_offsets(1, 4).collect::<Vec<_>>(), [0]);
    assert_eq!(chunk_offsets(0, 4).count(), 0);
}

/// Items by index: (key, length); None is not packable.
fn packable(items: &[Option<(u32, u64)>]) -> impl Fn(usize, u64) -> Option<(u32, u64)> + '_ {
    move |i, _| items[i]
}

fn whole(n: usize) -> Vec<(usize, u64)> {
    (0..n).map(|i| (i, 0)).collect()
}

#[test]
fn small_requests_to_one_peer_share_a_run_at_aligned_places() {
    let items = [Some((1, 100)), Some((1, 300)), Some((1, 256))];
    let parts = pack(whole(3), 4096, 64, packable(&items));
    assert_eq!(
        parts,
        [
            Part {
                item: 0,
                len: 100,
                at: 0
            },
            Part {
                item: 1,
                len: 300,
                at: 256
            },
            Part {
                item: 2,
                len: 256,
                at: 768
            },
        ]
    );
}

#[test]
fn a_run_stops_at_another_key_an_unpackable_request_or_a_full_chunk() {
    let other_key = [
        Some((1, 100)),
        Some((1, 100)),
        Some((2, 100)),
        Some((1, 100)),
    ];
    assert_eq!(pack(whole(4), 4096, 64, packable(&other_key)).len(), 2);
    let unpackable = [Some((1, 100)), Some((1, 100)), None, Some((1, 100))];
    assert_eq!(pack(whole(4), 4096, 64, packable(&unpackable)).len(), 2);
    // 3 x 1,000 bytes at 1,024-byte places: the third ends at 3,048 > 3,000.
    let full = [Some((1, 1000)); 3];
    assert_eq!(pack(whole(3), 3000, 64, packable(&full)).len(), 2);
    assert_eq!(pack(whole(3), 3048, 64, packable(&full)).len(), 3);
}

#[test]
fn a_run_has_at_most_max_requests() {
    let items = [Some((1, 8)); 10];
    assert_eq!(pack(whole(10), 4096, 4, packable(&items)).len(), 4);
}

#[test]
fn one_request_alone_is_no_run() {
    let items = [Some((1, 100)), Some((2, 100))];
    assert!(pack(whole(2), 4096, 64, packable(&items)).is_empty());
    let big = [Some((1, 4096)), Some((1, 100))];
    assert!(pack(whole(2), 4096, 64, packable(&big)).is_empty());
    // A request's later chunk (offset > 0) is never packed.
    let items = [Some((1, 100)), Some((1, 100))];
    assert!(pack([(0, 4096), (1, 0)], 8192, 64, packable(&items)).is_empty());
    assert!(pack(Vec::new(), 4096, 64, packable(&items)).is_empty());
}

#[test]
fn a_request_completes_with_its_last_chunk_and_its_first_error() {
    let mut t = Tally::new([2, 1, 3]);
    assert_eq!(t.finish(1, Ok(())), Some(Ok(())));
    assert_eq!(t.finish(0, Ok(())), None);
    assert_eq!(t.remaining(0), 1);
    assert_eq!(t.finish(0, Ok(())), Some(Ok(())));

    let first = err(ErrorCode::Timeout, "first");
    assert_eq!(t.finish(2, Err(first.clone())), None);
    assert!(t.failed(2));
    assert_eq!(t.finish(2, Err(err(ErrorCode::Internal, "second"))), None);
    assert_eq!(t.finish(2, Ok(())), Some(Err(first)));
}

#[test]
fn a_chunk_counted_after_its_request_completed_changes_nothing() {
    let mut t = Tally::new([1]);
    assert_eq!(t.finish(0, Ok(())), Some(Ok(())));
    assert_eq!(t.finish(0, Err(err(ErrorCode::Internal, "late"))), None);
    assert_eq!(t.remaining(0), 0);
}

#[test]
fn replies_go_to_chunks_in_the_order_their_requests_went() {
    let mut r = Replies::new();
    r.sent(7, 'a');
    r.sent(9, 'x');
    r.sent(7, 'b');
    assert_eq!(r.take('b'), None);
    r.read(7, Ok(()), false).unwrap();
    r.read(7, Err(err(ErrorCode::OutOfBounds, "b")), false)
        .unwrap();
    assert_eq!(r.take('a'), Some(Ok(())));
    assert_eq!(
        r.take('b').unwrap().unwrap_err().code,
        ErrorCode::OutOfBounds
    );
    assert_eq!(r.take('x'), None);
    r.read(9, Ok(()), false).unwrap();
    assert_eq!(r.take('x'), Some(Ok(())));
}

#[test]
fn a_broken_connection_fails_every_chunk_still_awaiting_its_peer() {
    let mut r = Replies::new();
    for k in ['a', 'b', 'c'] {
        r.sent(7, k);
    }
    r.sent(9, 'x');
    r.read(7, Err(err(ErrorCode::Connection, "reset")), true)
        .unwrap();
    for k in ['a', 'b', 'c'] {
        assert_eq!(r.take(k).unwrap().unwrap_err().code, ErrorCode::Connection);
    }
    assert_eq!(r.take('x'), None, "another peer's chunks are not touched");
}

#[test]
fn two_sessions_with_one_peer_answer_each_in_its_own_order() {
    // A job's chunks alternate between its sessions with a peer: a reply
    // on session 1 is the oldest of session 1's, whatever session 0 awaits.
    let mut r = Replies::new();
    r.sent((7, 0), 'a');
    r.sent((7, 1), 'b');
    r.sent((7, 0), 'c');
    r.read((7, 1), Ok(()), false).unwrap();
    assert_eq!(r.take('b'), Some(Ok(())));
    assert_eq!(r.take('a'), None);
    assert!(r.awaiting((7, 0)) && !r.awaiting((7, 1)));
    r.read((7, 0), Err(err(ErrorCode::Connection, "reset")), true)
        .unwrap();
    assert_eq!(
        r.take('c').unwrap().unwrap_err().code,
        ErrorCode::Connection
    );
}

#[test]
fn a_reply_to_nothing_asked_is_an_error_not_a_panic() {
    let mut r: Replies<u64, char> = Replies::new();
    assert_eq!(
        r.read(7, Ok(()), false).unwrap_err().code,
        ErrorCode::Internal
    );
}

#[test]
fn the_time_account_names_every_wait_and_leaves_the_rest_to_polling() {
    let ms = Duration::from_millis;
    let mut spent = Spent {
        admit: ms(1),
        pack: ms(1) / 2,
        device: ms(2),
        host: ms(3),
        peer: ms(4),
        retire: ms(5),
        chunks: 7,
        ..Spent::default()
    };
    spent.peer_reported(&CopyDone {
        check_us: 250,
        queue_us: 500,
        wait_us: 1500,
    });
    spent.peer_reported(&CopyDone::decode(b"not json"));
    // A hostile peer's numbers saturate; they never overflow the account.
    let mut hostile = Spent::default();
    for _ in 0..3 {
        hostile.peer_reported(&CopyDone {
            check_us: u64::MAX,
            queue_us: u64::MAX,
            wait_us: u64::MAX,
        });
    }
    hostile.peer_wait = Duration::MAX;
    hostile.peer_reported(&CopyDone::decode(br#"{"wait_us":18446744073709551615}"#));
    assert_eq!(hostile.peer_wait, Duration::MAX);
    let line = spent.describe(16384, 1 << 28, ms(20));
    for part in [
        "16384 requests, 268435456 bytes in 7 chunks, 20.00 ms",
        "admitting 1.00 ms (packing 0.50 ms)",
        "local device copies 2.00 ms",
        "host legs 3.00 ms",
        "device copies 4.00 ms",
        "completions 5.00 ms",
        "polling 5.00 ms",
        "the peer: checking 0.25 ms, queuing 0.50 ms, waiting for its device 1.50 ms",
    ] {
        assert!(line.contains(part), "{part:?} in {line}");
    }
    // A clock that ran backwards across a wait leaves no negative rest.
    assert!(spent.describe(1, 1, ms(10)).contains("polling 0.00 ms;"));
}

#[test]
fn requests_of_one_group_complete_it_once_with_their_first_error() {
    // Requests 0-2 share group 9 (a staged run), 3 has group 4 alone, and
    // 4 shares group 9 again though not adjacent to the others.
    let mut g = Groups::new([9, 9, 9, 4, 9].into_iter());
    assert_eq!(g.finish(0, Ok(())), None);
    assert_eq!(g.finish(3, Ok(())), Some((4, Ok(()))));
    let first = err(ErrorCode::Connection, "first");
    assert_eq!(g.finish(2, Err(first.clone())), None);
    assert_eq!(g.finish(4, Err(err(ErrorCode::Timeout, "second"))), None);
    assert_eq!(g.finish(1, Ok(())), Some((9, Err(first))));
    // A request counted again, or one that does not exist, changes nothing.
    assert_eq!(g.finish(1, Ok(())), None);
    assert_eq!(g.finish(7, Ok(())), None);
}

#[test]
fn a_peer_reply_is_read_whole_from_an_older_engine_or_as_nothing() {
    let d = CopyDone::decode(
        &CopyDone {
            check_us: 1,
            queue_us: 2,
            wait_us: 3,
        }
        .encode(),
    );
    assert_eq!((d.check_us, d.queue_us, d.wait_us), (1, 2, 3));
    let old = CopyDone::decode(b"{}");
    assert_eq!((old.check_us, old.queue_us, old.wait_us), (0, 0, 0));
}
