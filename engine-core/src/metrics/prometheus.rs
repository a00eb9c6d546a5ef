//! The Prometheus text exposition format (version 0.0.4) of a snapshot:
//! `ferry_` names, one HELP and TYPE line per family, escaped labels.

use super::snapshot::MetricsSnapshot;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The Content-Type of the text this module writes.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value as the format wants it: backslash, quote and newline escaped.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn labels(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let body: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", body.join(","))
}

/// Collects one family's samples, then writes them under one header.
struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    lines: Vec<String>,
}

impl<'a> Family<'a> {
    fn new(
        out: &'a mut String,
        name: &'static str,
        kind: &'static str,
        help: &'static str,
    ) -> Self {
        Family {
            out,
            name,
            kind,
            help,
            lines: Vec::new(),
        }
    }

    fn sample(&mut self, suffix: &str, pairs: &[(&str, &str)], value: impl std::fmt::Display) {
        self.lines
            .push(format!("{}{suffix}{} {value}", self.name, labels(pairs)));
    }
}

impl Drop for Family<'_> {
    fn drop(&mut self) {
        let _ = writeln!(self.out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(self.out, "# TYPE {} {}", self.name, self.kind);
        for l in &self.lines {
            self.out.push_str(l);
            self.out.push('\n');
        }
    }
}

/// A float as the format spells it.
fn float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v}")
    }
}

/// Reads one counter of a flow.
type FlowValue = fn(&super::snapshot::FlowCounts) -> u64;

/// The whole snapshot as Prometheus text.
pub fn render(s: &MetricsSnapshot) -> String {
    let mut out = String::new();
    render_engine(&mut out, s);
    render_flows(&mut out, s);
    render_latency(&mut out, s);
    render_routing(&mut out, s);
    render_registry(&mut out, s);
    render_events(&mut out, s);
    out
}

/// The engine itself: up, uptime.
fn render_engine(out: &mut String, s: &MetricsSnapshot) {
    {
        let mut f = Family::new(
            out,
            "ferry_up",
            "gauge",
            "1 while the engine runs; metrics_enabled says whether requests are counted.",
        );
        f.sample(
            "",
            &[
                ("engine", &s.engine),
                ("metrics_enabled", if s.enabled { "true" } else { "false" }),
            ],
            1,
        );
    }
    {
        let mut f = Family::new(
            out,
            "ferry_uptime_seconds",
            "gauge",
            "Seconds since the engine started.",
        );
        f.sample("", &[], float(s.uptime_seconds));
    }
}

/// Per-flow counters, failures by code, staged bytes.
fn render_flows(out: &mut String, s: &MetricsSnapshot) {
    let flow_families: [(&str, &str, FlowValue); 4] = [
        ("ferry_transfer_requests_total", "Requests completed, by transport, local device, peer, op and memory.", |c| c.requests),
        ("ferry_transfer_bytes_total", "Bytes of completed requests.", |c| c.bytes),
        ("ferry_transport_submissions_total", "Submissions handed to the transport (adjacent requests coalesce into one; a block list is one), finished or failed.", |c| c.submissions),
        ("ferry_transfer_failed_bytes_total", "Bytes of failed requests.", |c| c.failed_bytes),
    ];
    for (name, help, get) in flow_families {
        let mut f = Family::new(out, name, "counter", help);
        for c in &s.flows {
            f.sample(
                "",
                &[
                    ("transport", &c.transport),
                    ("device", &c.device),
                    ("peer", &c.peer),
                    ("op", &c.op),
                    ("memory", &c.memory),
                ],
                get(c),
            );
        }
    }
    {
        let mut f = Family::new(
            out,
            "ferry_transfer_failures_total",
            "counter",
            "Requests failed after submit, by error code.",
        );
        for c in &s.flows {
            for (code, n) in &c.failures {
                f.sample(
                    "",
                    &[
                        ("transport", &c.transport),
                        ("device", &c.device),
                        ("peer", &c.peer),
                        ("op", &c.op),
                        ("memory", &c.memory),
                        ("code", code),
                    ],
                    n,
                );
            }
        }
    }
    {
        // Staged traffic, summed from the flows, for a quick look.
        let mut staged: BTreeMap<&str, u64> = BTreeMap::new();
        for c in s.flows.iter().filter(|c| c.memory == "staged") {
            *staged.entry(&c.op).or_default() += c.bytes;
        }
        let mut f = Family::new(
            out,
            "ferry_staged_bytes_total",
            "counter",
            "Bytes of device memory moved through host staging buffers.",
        );
        for (op, bytes) in staged {
            f.sample("", &[("op", op)], bytes);
        }
    }
}

/// Submission latency histograms.
fn render_latency(out: &mut String, s: &MetricsSnapshot) {
    {
        let mut f = Family::new(
            out,
            "ferry_transfer_latency_seconds",
            "histogram",
            "Submit to completion of one submission, by transport, op and size class.",
        );
        for l in &s.latency {
            let base = [
                ("transport", l.transport.as_str()),
                ("op", &l.op),
                ("size", &l.size),
            ];
            for (le, n) in &l.histogram.buckets {
                let le = float(*le);
                let mut p = base.to_vec();
                p.push(("le", &le));
                f.sample("_bucket", &p, n);
            }
            let mut p = base.to_vec();
            p.push(("le", "+Inf"));
            f.sample("_bucket", &p, l.histogram.count);
            f.sample("_sum", &base, float(l.histogram.sum_seconds));
            f.sample("_count", &base, l.histogram.count);
        }
    }
}

/// Refused submits and route changes.
fn render_routing(out: &mut String, s: &MetricsSnapshot) {
    {
        let mut f = Family::new(
            out,
            "ferry_submit_refused_requests_total",
            "counter",
            "Requests of submits refused whole (nothing moved), by error code.",
        );
        for (code, n) in &s.refused {
            f.sample("", &[("code", code)], n);
        }
    }
    {
        let mut f = Family::new(
            out,
            "ferry_route_changes_total",
            "counter",
            "Times selection moved a peer's traffic to another transport.",
        );
        for r in &s.route_changes {
            f.sample(
                "",
                &[
                    ("peer", &r.peer),
                    ("memory", &r.memory),
                    ("transport", &r.transport),
                ],
                r.changes,
            );
        }
    }
}

/// Registered memory and the GPU-direct decisions.
fn render_registry(out: &mut String, s: &MetricsSnapshot) {
    {
        let mut f = Family::new(
            out,
            "ferry_registered_bytes",
            "gauge",
            "Memory registered now, by device, transport and registration method.",
        );
        for r in &s.registered {
            f.sample(
                "",
                &[
                    ("device", &r.device),
                    ("transport", &r.transport),
                    ("memory", &r.memory),
                ],
                r.bytes,
            );
        }
    }
    {
        let mut f = Family::new(
            out,
            "ferry_registered_buffers",
            "gauge",
            "Buffers registered now.",
        );
        for r in &s.registered {
            f.sample(
                "",
                &[
                    ("device", &r.device),
                    ("transport", &r.transport),
                    ("memory", &r.memory),
                ],
                r.buffers,
            );
        }
    }
    {
        let mut f = Family::new(
            out,
            "ferry_gpu_direct_info",
            "gauge",
            "The GPU-direct decision of each GPU (1), in words.",
        );
        for g in &s.gpu_direct {
            f.sample("", &[("device", &g.device), ("decision", &g.decision)], 1);
        }
    }
}

/// Refused connections and what plugins counted.
fn render_events(out: &mut String, s: &MetricsSnapshot) {
    {
        let mut f = Family::new(
            out,
            "ferry_refusals_total",
            "counter",
            "Connections refused before or while being served, by listener (control, or the \
             transport) and cause (busy, per_source, auth, timeout, integrity, peer_user, full, \
             protocol).",
        );
        for r in &s.refusals {
            f.sample(
                "",
                &[("listener", &r.listener), ("cause", &r.cause)],
                r.count,
            );
        }
    }
    {
        let mut f = Family::new(
            out,
            "ferry_plugin_events_total",
            "counter",
            "What plugins counted: NIC pauses, retries, connections (refusals are in \
             ferry_refusals_total).",
        );
        for p in &s.plugins {
            f.sample(
                "",
                &[
                    ("plugin", &p.plugin),
                    ("name", &p.name),
                    ("device", &p.device),
                ],
                p.value,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(labels(&[("peer", "h:1")]), "{peer=\"h:1\"}");
    }

    #[test]
    fn every_family_has_one_header_even_when_empty() {
        let text = render(&MetricsSnapshot::default());
        assert_eq!(
            text.matches("# TYPE ferry_transfer_bytes_total counter")
                .count(),
            1
        );
        assert!(text.contains("ferry_up{engine=\"\",metrics_enabled=\"false\"} 1\n"));
    }
}
