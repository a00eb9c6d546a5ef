//! `FERRY_NICS`: `mlx5_0,mlx5_1` keeps only those NICs, `^mlx5_2` removes
//! them. Names match exactly (NCCL matches prefixes, where `mlx5_1` would
//! also catch `mlx5_10`). A name that is not on the host is a warning, not an
//! error, so one setting can serve a fleet of slightly different hosts.

use std::collections::BTreeSet;

use super::config::ENV_NICS;

/// A parsed `FERRY_NICS` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NicFilter {
    deny: bool,
    names: BTreeSet<String>,
}

impl NicFilter {
    /// `None` for an empty or blank value (no filtering).
    pub(crate) fn parse(value: &str) -> Option<Self> {
        let trimmed = value.trim();
        let (deny, list) = match trimmed.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, trimmed),
        };
        let names: BTreeSet<String> = list
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_string)
            .collect();
        (deny || !names.is_empty()).then_some(NicFilter { deny, names })
    }

    /// Whether `name` stays.
    pub(crate) fn keeps(&self, name: &str) -> bool {
        self.names.contains(name) != self.deny
    }

    /// Whether `name` was asked for by name in an allow list; such a NIC is
    /// kept even where Ferry would otherwise drop it (an SR-IOV VF).
    pub(crate) fn names_explicitly(&self, name: &str) -> bool {
        !self.deny && self.names.contains(name)
    }

    /// Warnings for listed names that no NIC has.
    pub(crate) fn unknown_names<'a>(&self, known: impl Iterator<Item = &'a str>) -> Vec<String> {
        let known: BTreeSet<&str> = known.collect();
        let list = if self.deny { "deny" } else { "allow" };
        self.names
            .iter()
            .filter(|name| !known.contains(name.as_str()))
            .map(|name| {
                let known_list: Vec<&str> = known.iter().copied().collect();
                format!(
                    "{ENV_NICS} {list} list names {name}, which is not a NIC on this host (NICs: {})",
                    if known_list.is_empty() { "none".to_string() } else { known_list.join(", ") }
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_and_deny_lists() {
        let allow = NicFilter::parse("mlx5_0, mlx5_1").expect("filter");
        assert!(allow.keeps("mlx5_0") && allow.keeps("mlx5_1"));
        assert!(!allow.keeps("mlx5_10"));
        assert!(allow.names_explicitly("mlx5_1"));
        let deny = NicFilter::parse("^mlx5_2").expect("filter");
        assert!(!deny.keeps("mlx5_2") && deny.keeps("mlx5_0"));
        assert!(!deny.names_explicitly("mlx5_2"));
        assert_eq!(NicFilter::parse(" "), None);
        assert_eq!(NicFilter::parse(",,"), None);
        let warnings = allow.unknown_names(["mlx5_0", "eth0"].into_iter());
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("mlx5_1"), "{warnings:?}");
    }
}
