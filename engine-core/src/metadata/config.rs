//! FERRY_METADATA: which store finds segments by name, and its settings.

use crate::error::{Error, ErrorCode, Result};

/// Default for FERRY_METADATA_PREFIX.
pub const DEFAULT_PREFIX: &str = "/ferry";
/// Default for FERRY_METADATA_TTL_S.
pub const DEFAULT_TTL_S: u64 = 10;

/// Which metadata store an engine uses.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum MetadataConfig {
    /// Segment names are control addresses; nothing else runs.
    #[default]
    P2p,
    /// An etcd cluster: its endpoints ("http://host:port").
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
        ttl_s: u64,
    },
}

impl MetadataConfig {
    /// Parses FERRY_METADATA: `p2p` (also empty or `P2PHANDSHAKE`, the
    /// reference engine's word) or `etcd://host:port[,host:port...]`.
    pub fn parse(text: &str) -> Result<MetadataConfig> {
        let t = text.trim();
        if t.is_empty() || t.eq_ignore_ascii_case("p2p") || t.eq_ignore_ascii_case("P2PHANDSHAKE") {
            return Ok(MetadataConfig::P2p);
        }
        let Some(rest) = t.strip_prefix("etcd://") else {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("metadata store {t:?}: expected p2p or etcd://host:port[,host:port...]"),
            ));
        };
        let mut endpoints = Vec::new();
        for e in rest.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let e = e.trim_end_matches('/');
            let (host, port) = e.rsplit_once(':').ok_or_else(|| {
                Error::new(
                    ErrorCode::InvalidArgument,
                    format!("etcd endpoint {e:?}: expected host:port"),
                )
            })?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("etcd endpoint {e:?}: expected host:port"),
                ));
            }
            endpoints.push(format!("http://{e}"));
        }
        if endpoints.is_empty() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "etcd:// names no endpoint",
            ));
        }
        Ok(MetadataConfig::Etcd {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            ttl_s: DEFAULT_TTL_S,
        })
    }

    pub fn is_p2p(&self) -> bool {
        *self == MetadataConfig::P2p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_urls() {
        assert!(MetadataConfig::parse("").unwrap().is_p2p());
        assert!(MetadataConfig::parse("P2PHANDSHAKE").unwrap().is_p2p());
        match MetadataConfig::parse("etcd://10.0.0.1:2379, 10.0.0.2:2379/").unwrap() {
            MetadataConfig::Etcd { endpoints, .. } => {
                assert_eq!(endpoints, ["http://10.0.0.1:2379", "http://10.0.0.2:2379"])
            }
            other => panic!("{other:?}"),
        }
        for bad in [
            "etcd://",
            "etcd://host",
            "etcd://host:port",
            "zk://a:1",
            "etcd://:1",
        ] {
            assert!(MetadataConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
