//! etcds://: the TLS side of the etcd client. The CA bundle, client
//! certificate and key are read and checked once, when the store connects
//! (a bad file is an error there, naming the file), and handed to ureq's
//! rustls connector; a failed handshake is told in an operator's words:
//! which side refused which certificate, and why.

use super::config::EtcdAccess;
use crate::error::{Error, ErrorCode, Result};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig, TlsProvider};

/// Where Debian, Ubuntu, Alpine (first) and Red Hat, Fedora (second) keep
/// the system's CA bundle: trusted when FERRY_METADATA_CACERT is unset, as
/// etcdctl trusts the system's pool without --cacert.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
];

/// What Ferry knows of its own client certificate, to say why etcd
/// refused it.
struct ClientIdentity {
    path: PathBuf,
    /// notAfter, seconds since the epoch, and as text.
    not_after: Option<(i64, String)>,
}

pub struct Tls {
    pub config: TlsConfig,
    /// The same settings as rustls's own configuration, for `diagnose`.
    rustls: Arc<rustls::ClientConfig>,
    /// "FERRY_METADATA_CACERT /etc/ferry/etcd-ca.crt" or the system bundle.
    ca: String,
    client: Option<ClientIdentity>,
}

fn invalid(msg: String) -> Error {
    Error::new(ErrorCode::InvalidArgument, msg)
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| invalid(format!("cannot read {what} {}: {e}", path.display())))
}

fn pem_certs(path: &Path, what: &str) -> Result<Vec<Certificate<'static>>> {
    let pem = read(path, what)?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        match item {
            Ok(PemItem::Certificate(c)) => certs.push(c),
            Ok(_) => {}
            Err(e) => return Err(invalid(format!("{what} {}: {e}", path.display()))),
        }
    }
    if certs.is_empty() {
        return Err(invalid(format!(
            "{what} {}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
            path.display()
        )));
    }
    Ok(certs)
}

impl Tls {
    /// The TLS settings of `access`: None for plain etcd://, where any TLS
    /// file given is an error (a file silently unused would be worse).
    pub fn load(access: &EtcdAccess) -> Result<Option<Tls>> {
        if !access.tls {
            let given: Vec<&str> = [
                (access.cacert.is_some(), "FERRY_METADATA_CACERT"),
                (access.cert.is_some(), "FERRY_METADATA_CERT"),
                (access.key.is_some(), "FERRY_METADATA_KEY"),
            ]
            .iter()
            .filter(|(set, _)| *set)
            .map(|(_, n)| *n)
            .collect();
            if !given.is_empty() {
                return Err(invalid(format!(
                    "{} set, but FERRY_METADATA is etcd:// (plain HTTP): use etcds://host:port \
                     for TLS",
                    given.join(", ")
                )));
            }
            return Ok(None);
        }
        let (ca_path, ca) = trust_anchor(access)?;
        let roots = pem_certs(&ca_path, "CA bundle")?;
        let mut store = rustls::RootCertStore::empty();
        for c in &roots {
            store
                .add(CertificateDer::from(c.der().to_vec()))
                .map_err(|e| {
                    invalid(format!(
                        "CA bundle {}: a certificate rustls cannot use as a root: {e}",
                        ca_path.display()
                    ))
                })?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(rustls::ALL_VERSIONS)
            .map_err(|e| Error::new(ErrorCode::Internal, format!("rustls: {e}")))?
            .with_root_certificates(store);
        let (client_cert, client, rustls) = match (&access.cert, &access.key) {
            (None, None) => (None, None, builder.with_no_client_auth()),
            (Some(cert), Some(key)) => {
                let (c, id, rustls) = with_client_cert(builder, cert, key)?;
                (Some(c), Some(id), rustls)
            }
            (Some(_), None) => {
                return Err(invalid(
                    "FERRY_METADATA_CERT is set without FERRY_METADATA_KEY (its private key)"
                        .into(),
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "FERRY_METADATA_KEY is set without FERRY_METADATA_CERT (its certificate)"
                        .into(),
                ))
            }
        };
        let config = TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .root_certs(RootCerts::new_with_certs(&roots))
            .client_cert(client_cert)
            .build();
        Ok(Some(Tls {
            config,
            rustls: Arc::new(rustls),
            ca,
            client,
        }))
    }

    /// What to log at start: "TLS (CA ..., client certificate ...)".
    pub fn describe(&self) -> String {
        match &self.client {
            Some(c) => format!(
                "TLS (server checked against {}, client certificate {})",
                self.ca,
                c.path.display()
            ),
            None => format!(
                "TLS (server checked against {}, no client certificate)",
                self.ca
            ),
        }
    }

    /// Why a handshake (or the alert that ended one) failed, as "it ...".
    pub fn cause(&self, e: &rustls::Error) -> String {
        use rustls::AlertDescription as A;
        use rustls::CertificateError as C;
        match e {
            rustls::Error::InvalidCertificate(c) => {
                let why = match c {
                    C::UnknownIssuer => format!("is not signed by a CA in {}", self.ca),
                    C::BadSignature => format!("has a signature {} does not verify", self.ca),
                    C::Expired | C::ExpiredContext { .. } => "has expired".to_string(),
                    C::NotValidYet | C::NotValidYetContext { .. } => "is not valid yet".into(),
                    C::NotValidForName | C::NotValidForNameContext { .. } => format!(
                        "is not issued for the name Ferry connected to ({e}): use a host \
                         name or address its subjectAltName lists"
                    ),
                    C::InvalidPurpose | C::InvalidPurposeContext { .. } => {
                        "is not for server authentication (extendedKeyUsage)".to_string()
                    }
                    _ => format!("was refused ({e})"),
                };
                format!("presented a server certificate that {why}")
            }
            rustls::Error::AlertReceived(alert) => {
                let refused = matches!(
                    alert,
                    A::BadCertificate
                        | A::CertificateRequired
                        | A::UnknownCA
                        | A::CertificateExpired
                        | A::CertificateUnknown
                        | A::UnsupportedCertificate
                        | A::CertificateRevoked
                        | A::AccessDenied
                );
                match (&self.client, refused) {
                    (None, true) => format!(
                        "requires a client certificate (TLS alert {alert:?}; etcd runs with \
                         --client-cert-auth): set FERRY_METADATA_CERT and FERRY_METADATA_KEY"
                    ),
                    (Some(c), true) => match &c.not_after {
                        Some((t, shown)) if *t < now() => format!(
                            "refused Ferry's client certificate {}: it expired at {shown} \
                             (TLS alert {alert:?})",
                            c.path.display()
                        ),
                        _ => format!(
                            "refused Ferry's client certificate {} (TLS alert {alert:?}): not \
                             issued by a CA in etcd's --trusted-ca-file, or not for client \
                             authentication",
                            c.path.display()
                        ),
                    },
                    (_, false) => format!("ended the TLS handshake (alert {alert:?})"),
                }
            }
            rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
                format!(
                    "does not speak TLS ({e}): is it plain HTTP (etcd:// rather than etcds://)?"
                )
            }
            other => format!("TLS failed ({other})"),
        }
    }
}

impl Tls {
    /// Why `endpoint` ("host:port") closed a TLS connection, when it said
    /// so: a handshake of its own, then a read within `limit`. A server
    /// that refuses a client certificate in TLS 1.3 does it after the
    /// client has finished its handshake, and its alert often lies unread
    /// behind a request that could not be written ("connection closed").
    /// None when it completes without a refusal.
    pub fn diagnose(&self, endpoint: &str, limit: Duration) -> Option<String> {
        use std::net::{TcpStream, ToSocketAddrs};
        let started = Instant::now();
        let (host, _) = endpoint.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr = endpoint.to_socket_addrs().ok()?.next()?;
        let mut sock = TcpStream::connect_timeout(&addr, limit).ok()?;
        let name = rustls::pki_types::ServerName::try_from(host.to_string()).ok()?;
        let mut conn = rustls::ClientConnection::new(self.rustls.clone(), name).ok()?;
        let inner = |e: &std::io::Error| {
            e.get_ref()
                .and_then(|i| i.downcast_ref::<rustls::Error>())
                .map(|r| self.cause(r))
        };
        let timeouts = |sock: &TcpStream| -> Option<()> {
            let left = limit.checked_sub(started.elapsed())?;
            let left = Some(left.max(Duration::from_millis(1)));
            sock.set_read_timeout(left).ok()?;
            sock.set_write_timeout(left).ok()
        };
        while conn.is_handshaking() {
            timeouts(&sock)?;
            if let Err(e) = conn.complete_io(&mut sock) {
                return inner(&e);
            }
        }
        // Handshake done (our Finished may still be queued): send what is
        // left and wait for what the server says next.
        loop {
            timeouts(&sock)?;
            while conn.wants_write() {
                conn.write_tls(&mut sock).ok()?;
            }
            match conn.read_tls(&mut sock) {
                Ok(0) | Err(_) => return None,
                Ok(_) => {
                    if let Err(e) = conn.process_new_packets() {
                        return Some(self.cause(&e));
                    }
                }
            }
        }
    }
}

/// The rustls error inside a ureq error, if there is one (the handshake's
/// own, or one met while reading: in TLS 1.3 a refused client certificate
/// shows as an alert after the handshake).
pub fn rustls_error(e: &ureq::Error) -> Option<&rustls::Error> {
    match e {
        ureq::Error::Rustls(r) => Some(r),
        ureq::Error::Io(io) => io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()),
        _ => None,
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// One DER element: (tag, contents, what follows it).
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = b.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A certificate's notAfter (seconds since the epoch, and as text), read
/// from its DER: Certificate { tbsCertificate { [0] version, serial,
/// signature, issuer, validity { notBefore, notAfter } ... } ... }.
fn validity_end(cert: &[u8]) -> Option<(i64, String)> {
    let (_, cert, _) = der(cert)?;
    let (_, tbs, _) = der(cert)?;
    let mut rest = tbs;
    let (tag, _, r) = der(rest)?;
    if tag == 0xa0 {
        rest = r;
    }
    // serial, signature algorithm, issuer
    for _ in 0..3 {
        rest = der(rest)?.2;
    }
    let (_, validity, _) = der(rest)?;
    let (_, _, after) = der(validity)?;
    let (tag, time, _) = der(after)?;
    let text = std::str::from_utf8(time).ok()?.strip_suffix('Z')?;
    // UTCTime YYMMDDHHMMSS (years 1950-2049), GeneralizedTime YYYYMMDDHHMMSS.
    let (year, rest) = match tag {
        0x17 => {
            let yy: i64 = text.get(..2)?.parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, text.get(2..)?)
        }
        0x18 => (text.get(..4)?.parse().ok()?, text.get(4..)?),
        _ => return None,
    };
    let field = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (mo, d, h, mi, s) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if mo <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (mo + if mo > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((
        days * 86_400 + h * 3600 + mi * 60 + s,
        format!("{year:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02} UTC"),
    ))
}

/// The CA bundle to trust (FERRY_METADATA_CACERT, else the system's), and
/// how to name it in messages.
fn trust_anchor(access: &EtcdAccess) -> Result<(PathBuf, String)> {
    Ok(match &access.cacert {
        Some(p) => (p.clone(), format!("FERRY_METADATA_CACERT {}", p.display())),
        None => {
            let p = SYSTEM_BUNDLES
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    invalid(format!(
                        "etcds:// without FERRY_METADATA_CACERT trusts the system's CA \
                         bundle, and there is none ({}): set FERRY_METADATA_CACERT to the \
                         CA that signed etcd's certificates",
                        SYSTEM_BUNDLES.join(", ")
                    ))
                })?;
            let shown = format!("the system's CA bundle {}", p.display());
            (p, shown)
        }
    })
}

/// The client configuration with `cert` and `key` presented to etcd, and
/// what ureq needs of them; every way the pair can be unusable is a clear
/// error here rather than a panic in ureq.
fn with_client_cert(
    builder: rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert>,
    cert: &Path,
    key: &Path,
) -> Result<(ClientCert, ClientIdentity, rustls::ClientConfig)> {
    let chain = pem_certs(cert, "client certificate")?;
    let key_pem = read(key, "client key")?;
    let private = PrivateKey::from_pem(&key_pem).map_err(|e| {
        invalid(format!(
            "client key {}: no PEM private key in it ({e})",
            key.display()
        ))
    })?;
    let key_der = PrivateKeyDer::try_from(private.der().to_vec())
        .map_err(|e| invalid(format!("client key {}: {e}", key.display())))?;
    // The checks ureq would otherwise make with a panic: the
    // key must be usable and belong to the certificate.
    let rustls = builder
        .with_client_auth_cert(
            chain
                .iter()
                .map(|c| CertificateDer::from(c.der().to_vec()))
                .collect(),
            key_der,
        )
        .map_err(|e| {
            let why = match e {
                rustls::Error::InconsistentKeys(_) => {
                    "the key is not the certificate's (they do not match)".to_string()
                }
                e => e.to_string(),
            };
            invalid(format!(
                "client certificate {} and key {}: {why}",
                cert.display(),
                key.display()
            ))
        })?;
    let not_after = validity_end(chain[0].der());
    if let Some((t, shown)) = &not_after {
        if *t < now() {
            log::warn!(
                "metadata: client certificate {} expired at {shown}: etcd will \
                     refuse it",
                cert.display()
            );
        }
    }
    Ok((
        ClientCert::new_with_certs(&chain, private),
        ClientIdentity {
            path: cert.to_path_buf(),
            not_after,
        },
        rustls,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate's outer layers with only what validity_end reads.
    fn cert_with(not_after: &[u8], tag: u8) -> Vec<u8> {
        fn wrap(tag: u8, body: &[u8]) -> Vec<u8> {
            let mut v = vec![tag, body.len() as u8];
            v.extend_from_slice(body);
            v
        }
        let validity = [wrap(0x17, b"240101000000Z"), wrap(tag, not_after)].concat();
        let tbs = [
            wrap(0xa0, &wrap(0x02, &[2])),
            wrap(0x02, &[1]),
            wrap(0x30, &[]),
            wrap(0x30, &[]),
            wrap(0x30, &validity),
        ]
        .concat();
        wrap(0x30, &wrap(0x30, &tbs))
    }

    #[test]
    fn reads_a_certificates_end_of_validity() {
        assert_eq!(
            validity_end(&cert_with(b"250301120000Z", 0x17)),
            Some((1_740_830_400, "2025-03-01 12:00:00 UTC".into()))
        );
        assert_eq!(
            validity_end(&cert_with(b"19700101000001Z", 0x18)),
            Some((1, "1970-01-01 00:00:01 UTC".into()))
        );
        assert_eq!(validity_end(&cert_with(b"2503", 0x17)), None);
        assert_eq!(validity_end(&[0x30, 0x05, 1]), None);
        assert_eq!(validity_end(&[]), None);
    }

    #[test]
    fn tls_files_with_plain_http_are_an_error() {
        let access = EtcdAccess {
            cacert: Some("/etc/ca.crt".into()),
            ..EtcdAccess::default()
        };
        let e = Tls::load(&access).err().unwrap();
        assert!(
            e.message.contains("FERRY_METADATA_CACERT set"),
            "{}",
            e.message
        );
        let access = EtcdAccess {
            tls: true,
            cacert: Some("/nonexistent/ca.crt".into()),
            ..EtcdAccess::default()
        };
        let e = Tls::load(&access).err().unwrap();
        assert!(e.message.contains("cannot read CA bundle"), "{}", e.message);
    }
}
