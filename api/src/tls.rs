//! The environment's certificate authority and the API server's
//! certificate.
//!
//! Made once (at bootstrap, or by the first controller of an environment
//! made before the API existed) and kept in `DIR/tls/` of the environment's
//! data dir: `ca.crt`, `ca.key`, `server.crt`, `server.key`, the keys
//! readable by their owner only. Agents are given `ca.crt` and trust nothing
//! else; the server certificate names [`SERVER_NAME`] (and `localhost`,
//! `127.0.0.1`, `::1`), so the address an agent dials does not matter, but
//! a certificate from another environment's CA is refused.

use crate::{Error, Result};
use jujube_agent::wire::SERVER_NAME;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const SERVER_CERT: &str = "server.crt";
const SERVER_KEY: &str = "server.key";

/// Where an environment's TLS files are.
pub fn dir(env_dir: &Path) -> PathBuf {
    env_dir.join("tls")
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Tls(format!("{what}: {e}"))
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Makes the CA and the server certificate for the environment `env_uuid`
/// unless they exist. Idempotent; the server certificate is written last, so
/// a crash part-way makes them again next time.
pub fn ensure(env_dir: &Path, env_uuid: &str) -> Result<()> {
    let dir = dir(env_dir);
    if dir.join(SERVER_KEY).exists() && dir.join(CA_CERT).exists() {
        return Ok(());
    }
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    let made = make(
        &format!("jujube CA for environment {env_uuid}"),
        time::Duration::days(3650),
    )?;
    write_file(&dir.join(CA_KEY), &made.ca_key, 0o600)?;
    write_file(&dir.join(CA_CERT), &made.ca_cert, 0o644)?;
    write_file(&dir.join(SERVER_CERT), &made.server_cert, 0o644)?;
    write_file(&dir.join(SERVER_KEY), &made.server_key, 0o600)?;
    Ok(())
}

/// A CA and a server certificate it signed for [`SERVER_NAME`], as PEM.
struct Made {
    ca_key: String,
    ca_cert: String,
    server_cert: String,
    server_key: String,
}

fn make(ca_name: &str, lifetime: time::Duration) -> Result<Made> {
    let now = time::OffsetDateTime::now_utc();
    let ca_key = KeyPair::generate().map_err(|e| tls_err("cannot make the CA key", e))?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, ca_name.to_string());
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = now - time::Duration::days(1);
    ca.not_after = now + lifetime;
    let ca_cert = ca
        .self_signed(&ca_key)
        .map_err(|e| tls_err("cannot make the CA certificate", e))?;

    let server_key = KeyPair::generate().map_err(|e| tls_err("cannot make the server key", e))?;
    let mut server = CertificateParams::new(vec![SERVER_NAME.to_string(), "localhost".to_string()])
        .map_err(|e| tls_err("cannot make the server certificate", e))?;
    server.subject_alt_names.extend([
        SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
        SanType::IpAddress(std::net::Ipv6Addr::LOCALHOST.into()),
    ]);
    server
        .distinguished_name
        .push(DnType::CommonName, SERVER_NAME);
    server.not_before = ca.not_before;
    server.not_after = ca.not_after;
    let issuer = Issuer::new(ca, &ca_key);
    let server_cert = server
        .signed_by(&server_key, &issuer)
        .map_err(|e| tls_err("cannot sign the server certificate", e))?;

    Ok(Made {
        ca_key: ca_key.serialize_pem(),
        ca_cert: ca_cert.pem(),
        server_cert: server_cert.pem(),
        server_key: server_key.serialize_pem(),
    })
}

/// A server identity for one exchange (machine 0's hand-over, see
/// [`crate::handover`]): the client trusts `ca_cert`, whose key is
/// discarded at once, so nothing but this `server_cert` and `server_key`
/// will ever be trusted by it. Valid for a day.
pub struct OneShot {
    pub ca_cert: String,
    pub server_cert: String,
    pub server_key: String,
}

impl OneShot {
    pub fn new() -> Result<OneShot> {
        let made = make("jujube one-shot CA", time::Duration::days(1))?;
        Ok(OneShot {
            ca_cert: made.ca_cert,
            server_cert: made.server_cert,
            server_key: made.server_key,
        })
    }
}

/// A self-signed client certificate and its key (PEM), named `name`: how
/// machine 0's controller proves itself to a daemon that trusts exactly
/// that certificate (LXD's trust store).
pub fn client_identity(name: &str) -> Result<(String, String)> {
    let key = KeyPair::generate().map_err(|e| tls_err("cannot make a client key", e))?;
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(|e| tls_err("cannot make a client certificate", e))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(3650);
    let cert = params
        .self_signed(&key)
        .map_err(|e| tls_err("cannot make a client certificate", e))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The CA certificate (PEM) agents are given.
pub fn ca_cert(env_dir: &Path) -> Result<String> {
    read_file(&dir(env_dir).join(CA_CERT))
}

/// The server's TLS configuration: its certificate, HTTP/2 only.
pub fn server_config(env_dir: &Path) -> Result<Arc<rustls::ServerConfig>> {
    let dir = dir(env_dir);
    server_config_of(
        &read_file(&dir.join(SERVER_CERT))?,
        &read_file(&dir.join(SERVER_KEY))?,
    )
}

/// A server configuration with certificate `cert` and key `key` (PEM).
pub fn server_config_of(cert: &str, key: &str) -> Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| tls_err("cannot read the server certificate", e))?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes())
        .map_err(|e| tls_err("cannot read the server key", e))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err("cannot configure TLS", e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| tls_err("cannot use the server certificate", e))?;
    // h2 for agents; http/1.1 for an instance's boot script fetching the binary.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
