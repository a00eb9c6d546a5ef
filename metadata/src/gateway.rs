//! etcd's v3 operations Ferry uses, as JSON over the gateway (the gRPC
//! messages in their JSON form: byte fields in base64, int64 fields as
//! strings). Every reply is checked before use: etcd is a peer on the
//! network like any other.

use super::failure::CallError;
use super::pool::{int, Pool};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::Instant;

/// One key-value pair of a range reply.
pub struct Kv {
    pub key: Vec<u8>,
    /// Empty when asked for keys only.
    pub value: Vec<u8>,
    /// The lease it is attached to; 0 for none.
    pub lease: i64,
}

fn bad_reply(pool: &Pool, what: &str) -> CallError {
    CallError::Etcd {
        endpoint: pool.shown(),
        code: 0,
        message: format!("malformed {what} reply"),
    }
}

/// The end of the range holding every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff: "\0" means "to the end of the key space".
    vec![0]
}

/// The key `key`, or every key under it when `prefix`.
pub fn range(
    pool: &Pool,
    key: &[u8],
    prefix: bool,
    keys_only: bool,
    deadline: Instant,
) -> Result<Vec<Kv>, CallError> {
    let mut req = json!({ "key": B64.encode(key) });
    if prefix {
        req["range_end"] = json!(B64.encode(prefix_end(key)));
    }
    if keys_only {
        req["keys_only"] = json!(true);
    }
    let reply = pool.call("/v3/kv/range", &req, deadline)?;
    let Some(kvs) = reply.get("kvs") else {
        // An empty result has no "kvs" at all.
        return Ok(Vec::new());
    };
    let kvs = kvs.as_array().ok_or_else(|| bad_reply(pool, "range"))?;
    let field = |kv: &Value, name: &str| -> Result<Vec<u8>, CallError> {
        match kv.get(name) {
            None => Ok(Vec::new()),
            Some(v) => v
                .as_str()
                .and_then(|s| B64.decode(s).ok())
                .ok_or_else(|| bad_reply(pool, "range")),
        }
    };
    kvs.iter()
        .map(|kv| {
            Ok(Kv {
                key: field(kv, "key")?,
                value: field(kv, "value")?,
                lease: kv.get("lease").and_then(int).unwrap_or(0),
            })
        })
        .collect()
}

/// Stores `value` under `key`, attached to `lease`.
pub fn put(
    pool: &Pool,
    key: &[u8],
    value: &[u8],
    lease: i64,
    deadline: Instant,
) -> Result<(), CallError> {
    let req = json!({
        "key": B64.encode(key),
        "value": B64.encode(value),
        "lease": lease.to_string(),
    });
    pool.call("/v3/kv/put", &req, deadline).map(drop)
}

/// A new lease of `ttl_s` seconds: its id.
pub fn grant(pool: &Pool, ttl_s: u64, deadline: Instant) -> Result<i64, CallError> {
    let reply = pool.call(
        "/v3/lease/grant",
        &json!({ "TTL": ttl_s.to_string() }),
        deadline,
    )?;
    match reply.get("ID").and_then(int) {
        Some(id) if id != 0 => Ok(id),
        _ => Err(CallError::Etcd {
            endpoint: pool.shown(),
            code: 0,
            message: reply
                .get("error")
                .and_then(Value::as_str)
                .map_or_else(|| "malformed lease grant reply".to_string(), str::to_string),
        }),
    }
}

/// Renews `lease` once: the seconds it has left, 0 when etcd no longer
/// knows it (it expired, or etcd lost its data).
pub fn keep_alive(pool: &Pool, lease: i64, deadline: Instant) -> Result<i64, CallError> {
    let reply = pool.call(
        "/v3/lease/keepalive",
        &json!({ "ID": lease.to_string() }),
        deadline,
    )?;
    // A stream of one message: {"result": {"ID": ..., "TTL": ...}}; TTL is
    // left out when it is 0.
    let result = reply
        .get("result")
        .ok_or_else(|| bad_reply(pool, "lease keep-alive"))?;
    Ok(result.get("TTL").and_then(int).unwrap_or(0))
}

/// Ends `lease` and removes every key attached to it. An unknown lease is
/// already gone.
pub fn revoke(pool: &Pool, lease: i64, deadline: Instant) -> Result<(), CallError> {
    match pool.call(
        "/v3/lease/revoke",
        &json!({ "ID": lease.to_string() }),
        deadline,
    ) {
        Err(e) if e.is_not_found() => Ok(()),
        r => r.map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_end_past_the_prefix() {
        assert_eq!(prefix_end(b"/ferry/segments/"), b"/ferry/segments0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }
}
