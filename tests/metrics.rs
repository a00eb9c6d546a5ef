//! Metrics, read the way an operator's scraper reads them: a known
//! workload over tcp and shm (with requests refused at submit and requests
//! failing after it), then the initiator's Prometheus endpoint fetched by a
//! real HTTP client and parsed as Prometheus text; every counter must equal
//! what moved and what failed.

use ferry_core::{Engine, EngineConfig, Op, Request, SegmentId};
use ferry_tests::TargetProcess;
use std::collections::BTreeMap;
use std::time::Duration;

struct Workload<'a> {
    engine: &'a Engine,
    seg: SegmentId,
    local: u64,
    remote: u64,
}

impl Workload<'_> {
    /// `count` requests of `len` bytes over `transport`, `stride` apart (a
    /// stride equal to `len` makes them adjacent, so they coalesce).
    fn requests(
        &self,
        op: Op,
        transport: &str,
        count: u64,
        len: u64,
        stride: u64,
        at: u64,
    ) -> Vec<Request> {
        (0..count)
            .map(|i| Request {
                transport: Some(transport.into()),
                ..Request::new(
                    op,
                    self.local + at + i * stride,
                    self.seg,
                    self.remote + at + i * stride,
                    len,
                )
            })
            .collect()
    }

    fn run(&self, reqs: &[Request]) -> ferry_core::BatchStatus {
        let b = self.engine.allocate_batch(reqs.len()).unwrap();
        self.engine.submit(b, reqs).unwrap();
        let s = self.engine.wait(b, Duration::from_secs(30)).unwrap();
        assert!(s.is_done(), "{s:?}");
        self.engine.free_batch(b).unwrap();
        s
    }
}

/// Samples of one family: labels (sorted, without `le`) -> value.
type Samples = BTreeMap<String, f64>;

fn scrape(url: &str) -> BTreeMap<String, Samples> {
    let mut response = ureq::get(url).call().expect("GET the metrics endpoint");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = response.body_mut().read_to_string().unwrap();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let mut out: BTreeMap<String, Samples> = BTreeMap::new();
    for s in scrape.samples {
        let mut labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => {
                // The +Inf bucket: the histogram's count.
                h.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.entry(s.metric)
            .or_default()
            .insert(labels.join(","), value);
    }
    out
}

/// The one sample of `family` whose labels include all of `want`.
fn value(m: &BTreeMap<String, Samples>, family: &str, want: &[&str]) -> f64 {
    let found: Vec<(&String, &f64)> = m
        .get(family)
        .into_iter()
        .flatten()
        .filter(|(labels, _)| want.iter().all(|w| labels.split(',').any(|l| l == *w)))
        .collect();
    match found.as_slice() {
        [] => 0.0,
        [(_, v)] => **v,
        more => panic!("{family} {want:?} matches several series: {more:?}"),
    }
}

#[test]
fn the_endpoint_counts_exactly_what_moved_and_what_failed() {
    let target = TargetProcess::start(
        &["--buffer-size", "16M"],
        &[("FERRY_TRANSPORTS", "shm,tcp")],
        &[],
    );
    let mut c = EngineConfig::default();
    c.set("transports", "shm,tcp").unwrap();
    c.set("timeout_ms", "5000").unwrap();
    c.set("metrics_listen", "127.0.0.1:0").unwrap();
    let engine = Engine::new(c).unwrap();
    let url = format!(
        "http://{}/metrics",
        engine.metrics_addr().expect("endpoint")
    );
    let local = vec![5u8; 16 << 20];
    engine
        .register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = engine.open_segment(&target.segment).unwrap();
    let remote = engine.descriptor_of(seg).unwrap().buffers[0].addr;
    let w = Workload {
        engine: &engine,
        seg,
        local: local.as_ptr() as u64,
        remote,
    };
    let peer = format!("peer={}", target.segment);

    // Successes: separate and adjacent (coalescing) requests, both ops.
    assert!(w
        .run(&w.requests(Op::Write, "tcp", 10, 4096, 8192, 0))
        .succeeded());
    assert!(w
        .run(&w.requests(Op::Read, "tcp", 3, 65536, 65536, 1 << 20))
        .succeeded());
    assert!(w
        .run(&w.requests(Op::Write, "shm", 7, 100_000, 200_000, 2 << 20))
        .succeeded());
    assert!(w
        .run(&w.requests(Op::Read, "shm", 2, 1 << 20, 2 << 20, 4 << 20))
        .succeeded());
    // Refused at submit: past the end of the peer's buffer.
    let past_end = w.requests(Op::Write, "tcp", 4, 4096, 8192, (16 << 20) - 8192);
    let b = engine.allocate_batch(4).unwrap();
    let refused = engine.submit(b, &past_end).unwrap_err();
    engine.free_batch(b).unwrap();

    let m = scrape(&url);
    let flow = |t: &str, op: &str| {
        [
            format!("transport={t}"),
            format!("op={op}"),
            "device=cpu:0".into(),
            peer.clone(),
            "memory=host".into(),
        ]
    };
    let check = |family: &str, t: &str, op: &str, expect: u64| {
        let labels = flow(t, op);
        let want: Vec<&str> = labels.iter().map(String::as_str).collect();
        assert_eq!(value(&m, family, &want), expect as f64, "{family} {t} {op}");
    };
    check("ferry_transfer_requests_total", "tcp", "write", 10);
    check("ferry_transfer_bytes_total", "tcp", "write", 10 * 4096);
    // The 10 writes lie between one pair of buffers: one block list.
    check("ferry_transport_submissions_total", "tcp", "write", 1);
    check("ferry_transfer_requests_total", "tcp", "read", 3);
    check("ferry_transfer_bytes_total", "tcp", "read", 3 * 65536);
    check("ferry_transport_submissions_total", "tcp", "read", 1);
    check("ferry_transfer_requests_total", "shm", "write", 7);
    check("ferry_transfer_bytes_total", "shm", "write", 700_000);
    check("ferry_transfer_requests_total", "shm", "read", 2);
    check("ferry_transfer_bytes_total", "shm", "read", 2 << 20);
    let code = format!("code={}", refused.code.name());
    assert_eq!(
        value(&m, "ferry_submit_refused_requests_total", &[&code]),
        4.0,
        "{refused}"
    );
    // Latency: one sample per hand-over (the requests of one size class
    // that one submit gave a transport, or one block list, classed by its
    // bytes), timed to the last of them.
    for (t, op, size, n) in [
        ("tcp", "write", "4-64KiB", 1.0),
        ("tcp", "read", "64KiB-1MiB", 1.0),
        ("shm", "write", "64KiB-1MiB", 1.0),
        ("shm", "read", "1-16MiB", 1.0),
    ] {
        let (t, op, size) = (
            format!("transport={t}"),
            format!("op={op}"),
            format!("size={size}"),
        );
        assert_eq!(
            value(&m, "ferry_transfer_latency_seconds", &[&t, &op, &size]),
            n,
            "{t} {op} {size}"
        );
        assert_eq!(
            value(
                &m,
                "ferry_transfer_latency_seconds_count",
                &[&t, &op, &size]
            ),
            n,
            "{t} {op} {size}"
        );
    }
    assert_eq!(
        value(&m, "ferry_route_changes_total", &[&peer, "memory=host"]),
        1.0,
        "tcp, tcp, then shm"
    );
    assert_eq!(
        value(
            &m,
            "ferry_registered_bytes",
            &["transport=tcp", "memory=host"]
        ),
        (16 << 20) as f64
    );
    assert_eq!(
        value(&m, "ferry_transfer_failures_total", &[]),
        0.0,
        "nothing failed yet"
    );

    // Failures after submit: the peer is gone; each request fails with the
    // code its batch reports, and counts under that code.
    drop(target);
    std::thread::sleep(Duration::from_millis(200));
    let mut failed: BTreeMap<(String, String), u64> = BTreeMap::new();
    for t in ["tcp", "shm"] {
        let reqs = w.requests(Op::Write, t, 5, 4096, 8192, 8 << 20);
        let b = engine.allocate_batch(5).unwrap();
        let submitted = engine.submit(b, &reqs);
        let s = engine.wait(b, Duration::from_secs(30)).unwrap();
        if s.total == 0 {
            // Refused whole at planning (nothing reserved in the batch).
            let e = submitted.expect_err("nothing submitted");
            *failed
                .entry(("refused".into(), e.code.name().to_string()))
                .or_default() += 5;
        } else {
            // Handed to the transport (a submit that fails there also
            // fails its requests in the batch).
            assert_eq!(s.failed, 5, "{t}: {s:?}");
            for i in 0..5 {
                let ferry_core::RequestStatus::Failed(e) = engine.request_status(b, i).unwrap()
                else {
                    panic!()
                };
                *failed
                    .entry((t.to_string(), e.code.name().to_string()))
                    .or_default() += 1;
            }
        }
        engine.free_batch(b).unwrap();
    }
    let m = scrape(&url);
    for ((t, code), n) in &failed {
        let c = format!("code={code}");
        if t == "refused" {
            let before = if *code == refused.code.name() {
                4.0
            } else {
                0.0
            };
            assert_eq!(
                value(&m, "ferry_submit_refused_requests_total", &[&c]),
                before + *n as f64
            );
        } else {
            let tr = format!("transport={t}");
            assert_eq!(
                value(&m, "ferry_transfer_failures_total", &[&tr, &c, "op=write"]),
                *n as f64,
                "{t} {code}"
            );
            assert_eq!(
                value(&m, "ferry_transfer_failed_bytes_total", &[&tr, "op=write"]),
                (*n * 4096) as f64
            );
        }
    }
    eprintln!("failures after the peer went away: {failed:?}");
    // Successes did not move.
    check("ferry_transfer_requests_total", "tcp", "write", 10);
    check("ferry_transfer_requests_total", "shm", "write", 7);
}

#[test]
fn metrics_off_counts_nothing_and_serves_no_endpoint_by_default() {
    let mut c = EngineConfig::default();
    c.set("transports", "tcp").unwrap();
    c.set("metrics", "off").unwrap();
    let e = Engine::new(c).unwrap();
    assert!(e.metrics_addr().is_none());
    let s = e.metrics();
    assert!(!s.enabled);
    assert!(e.metrics_prometheus().contains("metrics_enabled=\"false\""));
    let mut c = EngineConfig::default();
    assert!(c.set("metrics", "maybe").is_err());
    c.set("metrics_listen", "256.0.0.1:1").unwrap();
    let err = Engine::new(c)
        .err()
        .expect("a bad metrics address fails the engine");
    assert!(err.message.contains("FERRY_METRICS_LISTEN"), "{err}");
}
