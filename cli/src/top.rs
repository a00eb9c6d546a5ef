//! `ferry top`: a live view of a running engine, read from its metrics
//! endpoint (Prometheus text) every second: throughput per transport,
//! device and peer, failures by code, refusals, route changes, plugins'
//! events. Drawn with ratatui over crossterm.

use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table};
use ratatui::Frame;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub struct TopArgs {
    /// The metrics URL (http://host:port[/metrics]).
    pub url: String,
    pub interval: Duration,
    /// Stop after this many refreshes (for scripts); run until `q` otherwise.
    pub frames: Option<u64>,
}

/// One scrape, summed the ways the view shows it.
#[derive(Default, Clone)]
struct Sample {
    at: Option<Instant>,
    engine: String,
    uptime: f64,
    /// (transport, op) -> (bytes, requests, failures)
    by_transport: BTreeMap<(String, String), (f64, f64, f64)>,
    /// (peer, transport) -> (bytes, requests, failures)
    by_peer: BTreeMap<(String, String), (f64, f64, f64)>,
    /// (device, memory) -> (bytes, requests)
    by_device: BTreeMap<(String, String), (f64, f64)>,
    /// "kind label" -> count: failures by code, refusals, route changes,
    /// plugins' events.
    events: BTreeMap<String, f64>,
}

fn fetch(url: &str) -> Result<Sample, String> {
    let mut response = ureq::get(url).call().map_err(|e| format!("{url}: {e}"))?;
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("{url}: {e}"))?;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .map_err(|e| format!("{url}: not Prometheus text: {e}"))?;
    let mut s = Sample {
        at: Some(Instant::now()),
        ..Sample::default()
    };
    for m in &scrape.samples {
        let v = match m.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        let l = |k: &str| m.labels.get(k).unwrap_or("").to_string();
        match m.metric.as_str() {
            "ferry_up" => s.engine = l("engine"),
            "ferry_uptime_seconds" => s.uptime = v,
            "ferry_transfer_bytes_total" | "ferry_transfer_requests_total" => {
                let bytes = m.metric == "ferry_transfer_bytes_total";
                let t = s.by_transport.entry((l("transport"), l("op"))).or_default();
                let p = s.by_peer.entry((l("peer"), l("transport"))).or_default();
                let d = s.by_device.entry((l("device"), l("memory"))).or_default();
                if bytes {
                    t.0 += v;
                    p.0 += v;
                    d.0 += v;
                } else {
                    t.1 += v;
                    p.1 += v;
                    d.1 += v;
                }
            }
            "ferry_transfer_failures_total" => {
                s.by_transport
                    .entry((l("transport"), l("op")))
                    .or_default()
                    .2 += v;
                s.by_peer.entry((l("peer"), l("transport"))).or_default().2 += v;
                *s.events
                    .entry(format!("failed {} over {}", l("code"), l("transport")))
                    .or_default() += v;
            }
            "ferry_submit_refused_requests_total" => {
                *s.events
                    .entry(format!("refused {}", l("code")))
                    .or_default() += v;
            }
            "ferry_route_changes_total" if v > 0.0 => {
                *s.events
                    .entry(format!(
                        "route changes to {} ({} memory), now {}",
                        l("peer"),
                        l("memory"),
                        l("transport")
                    ))
                    .or_default() += v;
            }
            "ferry_staged_bytes_total" => {
                *s.events
                    .entry(format!("staged bytes, {}", l("op")))
                    .or_default() += v;
            }
            "ferry_refusals_total" if v > 0.0 => {
                *s.events
                    .entry(format!(
                        "{} refused connections: {}",
                        l("listener"),
                        l("cause")
                    ))
                    .or_default() += v;
            }
            "ferry_plugin_events_total" => {
                let dev = l("device");
                let at = if dev.is_empty() {
                    String::new()
                } else {
                    format!(" on {dev}")
                };
                *s.events
                    .entry(format!("{}: {}{at}", l("plugin"), l("name")))
                    .or_default() += v;
            }
            _ => {}
        }
    }
    Ok(s)
}

fn rate(now: f64, before: Option<f64>, dt: f64) -> f64 {
    match before {
        Some(b) if dt > 0.0 && now >= b => (now - b) / dt,
        _ => 0.0,
    }
}

fn gbps(bytes_per_s: f64) -> String {
    format!("{:.3}", bytes_per_s / 1e9)
}

/// Bytes in binary units with one decimal ("17.6 GiB").
fn total(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes.max(0.0);
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

fn draw(f: &mut Frame, url: &str, now: &Sample, before: &Sample, error: Option<&str>) {
    let dt = match (now.at, before.at) {
        (Some(a), Some(b)) => a.duration_since(b).as_secs_f64(),
        _ => 0.0,
    };
    let head = Style::default()
        .add_modifier(Modifier::BOLD)
        .fg(Color::Cyan);
    let areas = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(now.by_transport.len() as u16 + 3),
        Constraint::Length(now.by_peer.len() as u16 + 3),
        Constraint::Length(now.by_device.len() as u16 + 3),
        Constraint::Min(3),
    ])
    .split(f.area());
    let mut title = vec![Line::from(format!(
        "ferry top  engine {}  up {:.0} s  {}  (q quits)",
        now.engine, now.uptime, url
    ))];
    if let Some(e) = error {
        title.push(Line::styled(
            format!("last refresh failed: {e}"),
            Style::default().fg(Color::Red),
        ));
    }
    f.render_widget(Paragraph::new(title), areas[0]);

    let rows = now.by_transport.iter().map(|((t, op), (b, r, fails))| {
        let old = before.by_transport.get(&(t.clone(), op.clone()));
        Row::new(vec![
            t.clone(),
            op.clone(),
            gbps(rate(*b, old.map(|o| o.0), dt)),
            format!("{:.0}", rate(*r, old.map(|o| o.1), dt)),
            total(*b),
            format!("{r:.0}"),
            format!("{fails:.0}"),
        ])
    });
    let widths = [
        Constraint::Length(12),
        Constraint::Length(6),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(12),
        Constraint::Length(12),
        Constraint::Length(9),
    ];
    f.render_widget(
        Table::new(rows, widths)
            .header(
                Row::new([
                    "transport",
                    "op",
                    "GB/s",
                    "req/s",
                    "total",
                    "requests",
                    "failed",
                ])
                .style(head),
            )
            .block(Block::bordered().title(" transports ")),
        areas[1],
    );

    let rows = now.by_peer.iter().map(|((p, t), (b, r, fails))| {
        let old = before.by_peer.get(&(p.clone(), t.clone()));
        Row::new(vec![
            p.clone(),
            t.clone(),
            gbps(rate(*b, old.map(|o| o.0), dt)),
            format!("{:.0}", rate(*r, old.map(|o| o.1), dt)),
            total(*b),
            format!("{fails:.0}"),
        ])
    });
    let widths = [
        Constraint::Length(24),
        Constraint::Length(12),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(12),
        Constraint::Length(9),
    ];
    f.render_widget(
        Table::new(rows, widths)
            .header(Row::new(["peer", "transport", "GB/s", "req/s", "total", "failed"]).style(head))
            .block(Block::bordered().title(" peers ")),
        areas[2],
    );

    let rows = now.by_device.iter().map(|((d, m), (b, r))| {
        let old = before.by_device.get(&(d.clone(), m.clone()));
        Row::new(vec![
            d.clone(),
            m.clone(),
            gbps(rate(*b, old.map(|o| o.0), dt)),
            format!("{:.0}", rate(*r, old.map(|o| o.1), dt)),
            total(*b),
        ])
    });
    let widths = [
        Constraint::Length(12),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(12),
    ];
    f.render_widget(
        Table::new(rows, widths)
            .header(Row::new(["device", "memory", "GB/s", "req/s", "total"]).style(head))
            .block(Block::bordered().title(" local devices ")),
        areas[3],
    );

    let rows = now.events.iter().map(|(k, v)| {
        let new = v - before.events.get(k).copied().unwrap_or(*v);
        Row::new(vec![
            k.clone(),
            format!("{v:.0}"),
            if new > 0.0 {
                format!("+{new:.0}")
            } else {
                String::new()
            },
        ])
    });
    let widths = [
        Constraint::Min(30),
        Constraint::Length(14),
        Constraint::Length(10),
    ];
    f.render_widget(
        Table::new(rows, widths)
            .header(
                Row::new([
                    "failures, refusals, route changes, plugin events",
                    "total",
                    "new",
                ])
                .style(head),
            )
            .block(Block::bordered().title(" errors and events ")),
        areas[4],
    );
}

/// `http://host:port` or `host:port` -> the /metrics URL.
pub fn metrics_url(given: &str) -> String {
    let with_scheme = if given.contains("://") {
        given.to_string()
    } else {
        format!("http://{given}")
    };
    let after_scheme = with_scheme.split_once("://").map_or("", |(_, r)| r);
    if after_scheme.contains('/') {
        with_scheme
    } else {
        format!("{with_scheme}/metrics")
    }
}

pub fn run(args: TopArgs) -> Result<(), String> {
    // Fail before taking over the terminal when the endpoint is not there.
    let mut now = fetch(&args.url)?;
    let mut before = Sample::default();
    let mut terminal = ratatui::try_init()
        .map_err(|e| format!("ferry top draws on a terminal, and this is none ({e})"))?;
    let mut frames = 0u64;
    let mut error: Option<String> = None;
    let result = loop {
        if let Err(e) = terminal.draw(|f| draw(f, &args.url, &now, &before, error.as_deref())) {
            break Err(format!("terminal: {e}"));
        }
        frames += 1;
        if args.frames.is_some_and(|n| frames >= n) {
            break Ok(());
        }
        let next = Instant::now() + args.interval;
        let mut quit = false;
        while let Some(left) = next.checked_duration_since(Instant::now()) {
            if !event::poll(left).unwrap_or(false) {
                break;
            }
            if let Ok(Event::Key(k)) = event::read() {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                    quit = true;
                    break;
                }
            }
        }
        if quit {
            break Ok(());
        }
        match fetch(&args.url) {
            Ok(s) => {
                before = std::mem::replace(&mut now, s);
                error = None;
            }
            Err(e) => error = Some(e),
        }
    };
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_a_scheme_and_a_path() {
        assert_eq!(
            metrics_url("127.0.0.1:9464"),
            "http://127.0.0.1:9464/metrics"
        );
        assert_eq!(metrics_url("http://h:1"), "http://h:1/metrics");
        assert_eq!(metrics_url("http://h:1/x"), "http://h:1/x");
    }

    #[test]
    fn a_live_endpoint_is_read_and_summed_by_transport_peer_and_device() {
        use ferry_core::{Engine, EngineConfig, Op, Request};
        let config = |listen: bool| {
            let mut c = EngineConfig::default();
            c.set("transports", "tcp").unwrap();
            if listen {
                c.set("metrics_listen", "127.0.0.1:0").unwrap();
            }
            c
        };
        let (target, initiator) = (
            Engine::new(config(false)).unwrap(),
            Engine::new(config(true)).unwrap(),
        );
        let remote = vec![0u8; 1 << 16];
        let local = vec![1u8; 1 << 16];
        target
            .register_memory(remote.as_ptr() as u64, 1 << 16, None)
            .unwrap();
        initiator
            .register_memory(local.as_ptr() as u64, 1 << 16, None)
            .unwrap();
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        let reqs: Vec<Request> = (0..4u64)
            .map(|i| {
                Request::new(
                    Op::Write,
                    local.as_ptr() as u64 + i * 8192,
                    seg,
                    remote.as_ptr() as u64 + i * 8192,
                    4096,
                )
            })
            .collect();
        initiator.transfer_sync(&reqs).unwrap();
        // Past the end of the peer's buffer: refused whole.
        let bad = Request::new(
            Op::Write,
            local.as_ptr() as u64,
            seg,
            remote.as_ptr() as u64 + (1 << 16) - 8,
            64,
        );
        assert!(initiator.transfer_sync(&[bad]).is_err());
        let url = metrics_url(&initiator.metrics_addr().unwrap().to_string());
        let s = fetch(&url).unwrap();
        assert_eq!(s.engine, initiator.segment_name());
        let key = ("tcp".to_string(), "write".to_string());
        assert_eq!(s.by_transport.get(&key), Some(&(16384.0, 4.0, 0.0)));
        let peer = (target.segment_name().to_string(), "tcp".to_string());
        assert_eq!(s.by_peer.get(&peer), Some(&(16384.0, 4.0, 0.0)));
        assert_eq!(s.by_device.values().map(|d| d.0).sum::<f64>(), 16384.0);
        assert_eq!(
            s.events.get("refused OUT_OF_BOUNDS"),
            Some(&1.0),
            "{:?}",
            s.events
        );
        assert!(fetch("http://127.0.0.1:1/metrics").is_err());
    }

    #[test]
    fn totals_read_in_binary_units() {
        assert_eq!(total(0.0), "0 B");
        assert_eq!(total(1536.0), "1.5 KiB");
        assert_eq!(total(18_475_012.0 * 1024.0), "17.6 GiB");
    }

    #[test]
    fn rates_need_an_earlier_sample_and_never_go_negative() {
        assert_eq!(rate(10.0, None, 1.0), 0.0);
        assert_eq!(rate(10.0, Some(4.0), 2.0), 3.0);
        assert_eq!(rate(1.0, Some(4.0), 2.0), 0.0);
    }
}
