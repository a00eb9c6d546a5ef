//! etcd as production clusters run it (issue 36): a 3-member cluster that
//! serves clients over TLS only, with --client-cert-auth, and etcd's users
//! on, Ferry's user limited to Ferry's prefix (certificates made here with
//! the openssl command):
//!
//! - segments register, are found by name, carry a transfer and vanish
//!   with their engine; a change of etcd's users (which voids every token)
//!   costs no call; the leader SIGKILLed, look-ups keep working;
//! - the same etcd refuses, and Ferry's error says why: no client
//!   certificate, one from another CA, an expired one, a wrong password, a
//!   user without rights on the prefix, a CA that did not sign etcd's;
//! - registration and look-up latency over TLS with a user against plain
//!   HTTP, in the same run (printed, not asserted).
//!
//! Needs etcd, etcdctl and openssl (scripts/test installs them). Every
//! bounded wait is a hang guard, not a timing assertion.

use ferry_core::metadata::EtcdStore;
use ferry_core::EngineConfig;
use ferry_tests::etcd::{segments_with, EtcdCluster, Pki};
use ferry_tests::node::Node;
use std::collections::HashMap;
use std::ffi::OsString;
use std::time::{Duration, Instant};

const TTL_S: &str = "2";
const DEADLINE_MS: u64 = 2000;
const LEN: usize = 64 << 10;
/// etcd elects a new leader in about one election timeout (1 s).
const SETTLE: Duration = Duration::from_secs(3);
/// Calls timed per operation and cluster.
const SAMPLES: usize = 40;

type Envs = Vec<(String, String)>;

fn refs(envs: &Envs) -> Vec<(&str, &str)> {
    envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// `envs` with `key` replaced (or removed, for None).
fn with(envs: &Envs, key: &str, value: Option<&str>) -> Envs {
    let mut e: Envs = envs.iter().filter(|(k, _)| k != key).cloned().collect();
    if let Some(v) = value {
        e.push((key.to_string(), v.to_string()));
    }
    e
}

fn start_node(envs: &Envs, name: &str, seed: u64) -> Node {
    let deadline = DEADLINE_MS.to_string();
    let mut all = refs(envs);
    all.extend([
        ("FERRY_METADATA_TTL_S", TTL_S),
        ("FERRY_NAME", name),
        ("FERRY_TIMEOUT_MS", "5000"),
        ("FERRY_CONNECT_TIMEOUT_MS", deadline.as_str()),
    ]);
    Node::start(seed, LEN, &all).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn listed(envs: &Envs) -> Result<Vec<String>, String> {
    segments_with(&refs(envs), DEADLINE_MS).map(|mut l| {
        l.sort();
        l
    })
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// `ferry segments` with `envs` must fail saying `cause`, with code
/// PERMISSION, and never print `secret`.
fn refused(what: &str, envs: &Envs, cause: &str, secret: &str) {
    let e = listed(envs).expect_err(what);
    eprintln!("{what}: {e}");
    assert!(e.contains(cause), "{what}: {e}");
    assert!(e.contains("[PERMISSION]"), "{what}: {e}");
    assert!(
        !e.contains(secret),
        "{what}: the password is in the error: {e}"
    );
}

/// (median, 90th percentile) of `samples`.
fn summary(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

/// Times a store's calls on `envs`' etcd: the first registration (a
/// connection, TLS handshake, token and lease included), then registrations
/// (a put each) and look-ups by name.
fn time_store(envs: &Envs, label: &str) -> [(Duration, Duration); 3] {
    let map: HashMap<String, String> = envs.iter().cloned().collect();
    let config = EngineConfig::from_lookup(|n| map.get(n).map(OsString::from)).unwrap();
    let store = EtcdStore::connect(&config.metadata, Duration::from_millis(DEADLINE_MS)).unwrap();
    let name = format!("latency-{label}");
    let descriptor = vec![b'x'; 2048];
    let t = Instant::now();
    store.publish(&name, descriptor.clone()).unwrap();
    let first = t.elapsed();
    let mut puts = Vec::new();
    let mut gets = Vec::new();
    for _ in 0..SAMPLES {
        let t = Instant::now();
        store.publish(&name, descriptor.clone()).unwrap();
        puts.push(t.elapsed());
        let t = Instant::now();
        assert_eq!(
            store.fetch(&name).unwrap().as_deref(),
            Some(&descriptor[..])
        );
        gets.push(t.elapsed());
    }
    store.withdraw();
    [(first, first), summary(puts), summary(gets)]
}

#[test]
fn etcd_with_tls_client_certificates_and_users() {
    let pki = Pki::make();
    let mut cluster = EtcdCluster::start_secure(3, &pki);
    cluster.enable_auth("ferry", "/ferry/", &["stranger"]);
    let path = |f: &str| pki.file(f).display().to_string();
    let password_file = pki.write("ferry.password", "ferry-password\n");
    let secure: Envs = [
        ("FERRY_METADATA", cluster.url()),
        ("FERRY_METADATA_CACERT", path("ca.crt")),
        ("FERRY_METADATA_CERT", path("client.crt")),
        ("FERRY_METADATA_KEY", path("client.key")),
        ("FERRY_METADATA_USER", "ferry".into()),
        ("FERRY_METADATA_PASSWORD_FILE", password_file),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();

    // Latency first, while nothing else runs: the same calls on a plain
    // HTTP cluster of the same size, in the same run.
    {
        let plain = EtcdCluster::start(3);
        let plain_envs: Envs = vec![("FERRY_METADATA".into(), plain.url())];
        let http = time_store(&plain_envs, "http");
        let tls = time_store(&secure, "tls");
        eprintln!(
            "latency, 3 members on loopback, {SAMPLES} calls each (median / 90th percentile):"
        );
        let rows = ["first registration", "registration", "look-up by name"];
        for (i, what) in rows.iter().enumerate() {
            let ratio = tls[i].0.as_secs_f64() / http[i].0.as_secs_f64().max(1e-9);
            eprintln!(
                "  {what:<20} plain HTTP {:>9.2?} / {:>9.2?}   TLS + client cert + user \
                 {:>9.2?} / {:>9.2?}   median x{ratio:.2}",
                http[i].0, http[i].1, tls[i].0, tls[i].1
            );
        }
    }

    // Engines register, find each other by name and transfer.
    let t0 = start_node(&secure, "t-0", 1);
    let mut t1 = start_node(&secure, "t-1", 2);
    let mut looker = start_node(&secure, "l-0", 3);
    wait_for("three engines listed", Duration::from_secs(20), || {
        listed(&secure).is_ok_and(|l| l == ["l-0", "t-0", "t-1"])
    });
    assert_eq!(looker.ask("open t-0"), "open ok");
    assert_eq!(t1.ring_to(&t0), "ring ok", "t-1 -> t-0 by name");
    let e = looker.ask("open nobody");
    assert!(e.contains("no such segment"), "{e}");

    // A change of etcd's users voids every token: the next call gets a new
    // one and succeeds.
    cluster
        .etcdctl(&["user", "add", "bump", "--new-user-password", "bump"])
        .unwrap();
    assert_eq!(
        looker.ask("open t-1"),
        "open ok",
        "after tokens were voided"
    );
    assert!(listed(&secure).is_ok());

    // Refusals, each with its cause.
    let secret = "ferry-password";
    refused(
        "no client certificate",
        &with(
            &with(&secure, "FERRY_METADATA_CERT", None),
            "FERRY_METADATA_KEY",
            None,
        ),
        "requires a client certificate",
        secret,
    );
    refused(
        "a client certificate from another CA",
        &with(
            &with(&secure, "FERRY_METADATA_CERT", Some(&path("foreign.crt"))),
            "FERRY_METADATA_KEY",
            Some(&path("foreign.key")),
        ),
        "not issued by a CA in etcd's --trusted-ca-file",
        secret,
    );
    refused(
        "an expired client certificate",
        &with(
            &with(&secure, "FERRY_METADATA_CERT", Some(&path("expired.crt"))),
            "FERRY_METADATA_KEY",
            Some(&path("expired.key")),
        ),
        "expired at",
        secret,
    );
    refused(
        "a CA that did not sign etcd's certificate",
        &with(
            &secure,
            "FERRY_METADATA_CACERT",
            Some(&path("other-ca.crt")),
        ),
        "presented a server certificate that is not signed by a CA in FERRY_METADATA_CACERT",
        secret,
    );
    let wrong = pki.write("wrong.password", "not-the-password\n");
    refused(
        "a wrong password",
        &with(&secure, "FERRY_METADATA_PASSWORD_FILE", Some(&wrong)),
        "wrong password for etcd user \"ferry\"",
        "not-the-password",
    );
    let stranger = pki.write("stranger.password", "stranger-password\n");
    refused(
        "a user without rights on the prefix",
        &with(
            &with(&secure, "FERRY_METADATA_USER", Some("stranger")),
            "FERRY_METADATA_PASSWORD_FILE",
            Some(&stranger),
        ),
        "permission denied: etcd user \"stranger\" may not read and write keys under \
         /ferry/segments/",
        "stranger-password",
    );
    refused(
        "no user",
        &with(
            &with(&secure, "FERRY_METADATA_USER", None),
            "FERRY_METADATA_PASSWORD_FILE",
            None,
        ),
        "set FERRY_METADATA_USER",
        secret,
    );

    // A SIGKILLed engine's segment goes with its lease.
    t1.child.kill().unwrap();
    let _ = t1.child.wait();
    let gone = wait_for("t-1 gone from etcd", Duration::from_secs(30), || {
        listed(&secure).is_ok_and(|l| l == ["l-0", "t-0"])
    });
    eprintln!("t-1's segment disappeared {gone:.2?} after SIGKILL (lease TTL {TTL_S} s)");

    // The leader SIGKILLed: once a new one is elected, look-ups by name and
    // listings keep working, as over plain HTTP.
    let leader = cluster.wait_leader(Duration::from_secs(20));
    cluster.kill(leader);
    eprintln!("SIGKILLed the leader, member {leader}");
    std::thread::sleep(SETTLE);
    let mut failed = Vec::new();
    for i in 0..20 {
        let a = looker.ask("open t-0");
        if a != "open ok" {
            failed.push(a);
        }
        if i % 5 == 0 {
            if let Err(e) = listed(&secure) {
                failed.push(e);
            }
        }
    }
    eprintln!(
        "with the leader dead: {} of 24 look-ups and listings failed",
        failed.len()
    );
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(listed(&secure).unwrap(), ["l-0", "t-0"]);
    drop(t0);
}
