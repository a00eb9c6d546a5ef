//! FERRY_METADATA: which store finds segments by name, and its settings.

use crate::error::{Error, ErrorCode, Result};
use std::path::PathBuf;

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
    /// An etcd cluster: its endpoints ("http://host:port", or
    /// "https://host:port" for etcds://).
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
        ttl_s: u64,
        access: EtcdAccess,
    },
}

/// How Ferry proves itself to etcd and checks that it talks to etcd: TLS
/// files (etcds:// only) and an etcd user. Paths only: the password is read
/// from its file when the store connects, never kept in the configuration
/// (which `ferry info` shows and logs print).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct EtcdAccess {
    /// etcds://: HTTPS to every member.
    pub tls: bool,
    /// FERRY_METADATA_CACERT (etcdctl --cacert): the CA bundle that signed
    /// the members' certificates; the system's bundle when unset.
    pub cacert: Option<PathBuf>,
    /// FERRY_METADATA_CERT and FERRY_METADATA_KEY (etcdctl --cert, --key):
    /// Ferry's client certificate and its key, for --client-cert-auth.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// FERRY_METADATA_USER (etcdctl --user's name): the etcd user Ferry
    /// authenticates as.
    pub user: Option<String>,
    /// FERRY_METADATA_PASSWORD_FILE: a file whose first line is the user's
    /// password.
    pub password_file: Option<PathBuf>,
}

impl MetadataConfig {
    /// Parses FERRY_METADATA: `p2p` (also empty or `P2PHANDSHAKE`, the
    /// reference engine's word), `etcd://host:port[,host:port...]` or
    /// `etcds://host:port[,...]` (TLS).
    pub fn parse(text: &str) -> Result<MetadataConfig> {
        let t = text.trim();
        if t.is_empty() || t.eq_ignore_ascii_case("p2p") || t.eq_ignore_ascii_case("P2PHANDSHAKE") {
            return Ok(MetadataConfig::P2p);
        }
        let (rest, tls) = match (t.strip_prefix("etcd://"), t.strip_prefix("etcds://")) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "metadata store {t:?}: expected p2p, etcd://host:port[,host:port...] or \
                         etcds://host:port[,...] (TLS)"
                    ),
                ))
            }
        };
        let scheme = if tls { "https" } else { "http" };
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
            endpoints.push(format!("{scheme}://{e}"));
        }
        if endpoints.is_empty() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "etcd:// or etcds:// names no endpoint",
            ));
        }
        Ok(MetadataConfig::Etcd {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            ttl_s: DEFAULT_TTL_S,
            access: EtcdAccess {
                tls,
                ..EtcdAccess::default()
            },
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
        match MetadataConfig::parse("etcds://etcd-0.example:2379,10.0.0.2:2379").unwrap() {
            MetadataConfig::Etcd {
                endpoints, access, ..
            } => {
                assert_eq!(
                    endpoints,
                    ["https://etcd-0.example:2379", "https://10.0.0.2:2379"]
                );
                assert!(access.tls);
            }
            other => panic!("{other:?}"),
        }
        for bad in [
            "etcds://",
            "etcds://host",
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
