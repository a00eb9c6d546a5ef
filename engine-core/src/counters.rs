//! Counters that plugins keep through the host's `count` service (ABI 1.2):
//! NIC pauses, retries, refused connections. Read by the engine's metrics.

use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// One counter as it reads now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginCount {
    pub plugin: String,
    pub name: String,
    /// The plugin's device it counts for; `None` when not per device.
    pub device: Option<String>,
    pub value: u64,
}

/// plugin -> counter name -> device ("" for none) -> value. Nested so that
/// an existing counter is found with borrowed strings: no allocation on the
/// hot path, only a read lock and an atomic add.
type Table = HashMap<String, HashMap<String, HashMap<String, AtomicU64>>>;

/// Every plugin counter of one engine.
#[derive(Debug, Default)]
pub struct PluginCounters {
    table: RwLock<Table>,
}

/// No plugin creates counters without bound: past this many, new ones are
/// dropped (existing ones keep counting).
const MAX_COUNTERS: usize = 4096;

impl PluginCounters {
    /// Adds `delta` to the counter, creating it at its first use.
    pub fn add(&self, plugin: &str, name: &str, device: Option<&str>, delta: u64) {
        let device = device.unwrap_or("");
        {
            let table = self.table.read();
            if let Some(c) = table
                .get(plugin)
                .and_then(|p| p.get(name))
                .and_then(|n| n.get(device))
            {
                c.fetch_add(delta, Ordering::Relaxed);
                return;
            }
        }
        let mut table = self.table.write();
        let total: usize = table
            .values()
            .flat_map(|p| p.values())
            .map(HashMap::len)
            .sum();
        let slot = table
            .entry(plugin.to_string())
            .or_default()
            .entry(name.to_string())
            .or_default();
        if let Some(c) = slot.get(device) {
            c.fetch_add(delta, Ordering::Relaxed);
        } else if total < MAX_COUNTERS {
            slot.insert(device.to_string(), AtomicU64::new(delta));
        }
    }

    /// Every counter, sorted by plugin, name and device.
    pub fn snapshot(&self) -> Vec<PluginCount> {
        let table = self.table.read();
        let mut out: Vec<PluginCount> = table
            .iter()
            .flat_map(|(plugin, names)| {
                names.iter().flat_map(move |(name, devices)| {
                    devices.iter().map(move |(device, v)| PluginCount {
                        plugin: plugin.clone(),
                        name: name.clone(),
                        device: (!device.is_empty()).then(|| device.clone()),
                        value: v.load(Ordering::Relaxed),
                    })
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.plugin, &a.name, &a.device).cmp(&(&b.plugin, &b.name, &b.device)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_plugin_name_and_device() {
        let c = PluginCounters::default();
        c.add("rdma", "nic_pauses", Some("mlx5_0"), 1);
        c.add("rdma", "nic_pauses", Some("mlx5_0"), 2);
        c.add("rdma", "nic_pauses", Some("mlx5_1"), 5);
        c.add("tcp", "refused", None, 7);
        let s = c.snapshot();
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].device.as_deref(), s[0].value), (Some("mlx5_0"), 3));
        assert_eq!((s[1].device.as_deref(), s[1].value), (Some("mlx5_1"), 5));
        assert_eq!(
            (s[2].plugin.as_str(), s[2].device.as_deref(), s[2].value),
            ("tcp", None, 7)
        );
    }

    #[test]
    fn the_number_of_counters_is_bounded() {
        let c = PluginCounters::default();
        for i in 0..MAX_COUNTERS + 10 {
            c.add("x", "n", Some(&i.to_string()), 1);
        }
        assert_eq!(c.snapshot().len(), MAX_COUNTERS);
        c.add("x", "n", Some("0"), 1);
        assert_eq!(
            c.snapshot()
                .iter()
                .find(|k| k.device.as_deref() == Some("0"))
                .unwrap()
                .value,
            2
        );
    }
}
