//! TLS to the PostgreSQL server, chosen in the state URL with libpq's own
//! words, so that a URL that works with `psql` works here:
//!
//! | `sslmode`     | TLS                          | the server's certificate                  |
//! |---------------|------------------------------|-------------------------------------------|
//! | `disable`     | never                        | -                                         |
//! | `allow`, `prefer` (the default) | if the server offers it | checked only if `sslrootcert` is given |
//! | `require`     | always                       | checked only if `sslrootcert` is given    |
//! | `verify-ca`   | always                       | signed by `sslrootcert`                   |
//! | `verify-full` | always                       | signed by `sslrootcert`, for the URL's host |
//!
//! `sslrootcert` is a PEM file of the authorities to trust, or `system`
//! for the machine's own. Two departures from libpq, both stricter: `allow`
//! tries TLS first (libpq tries without it first), and `prefer` checks the
//! certificate when `sslrootcert` is given (libpq checks it only from
//! `require` up). A `verify-*` mode without `sslrootcert` is refused rather
//! than looking for `~/.postgresql/root.crt`: a controller runs as a
//! service, and its trust should be in the URL its environment was
//! bootstrapped with.
//!
//! The client (tokio-postgres) knows `disable`, `prefer` and `require`, and
//! no `sslrootcert`: [`split`] takes both out of the URL it is given, and
//! the check is done here, in rustls's verifier.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

/// The longest `sslrootcert` file read: a bundle of every public authority
/// is about 200 KiB.
pub const MAX_ROOT_FILE: u64 = 1024 * 1024;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// Where trusted authorities come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Roots {
    File(String),
    System,
}

/// What the URL asks of TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tls {
    pub mode: Mode,
    pub roots: Option<Roots>,
}

/// Splits `url` into the URL the client reads (without `sslrootcert`, and
/// with `sslmode` as one of its three) and what it asks of TLS. The error
/// says what is wrong, to follow "invalid state URL: ".
pub(crate) fn split(url: &str) -> Result<(String, Tls), String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let mut kept = Vec::new();
    let mut mode = None;
    let mut roots = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => {
                let value = decode(value)?;
                mode = Some(match value.as_str() {
                    "disable" => Mode::Disable,
                    "allow" => Mode::Allow,
                    "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-ca" => Mode::VerifyCa,
                    "verify-full" => Mode::VerifyFull,
                    other => {
                        return Err(format!(
                            "`sslmode={other}` is not one of `disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full`"
                        ))
                    }
                });
            }
            "sslrootcert" => {
                let value = decode(value)?;
                roots = Some(match value.as_str() {
                    "" => return Err("`sslrootcert` is empty; name a PEM file of the authorities to trust, or `system`".into()),
                    "system" => Roots::System,
                    path => Roots::File(path.to_string()),
                });
            }
            _ => kept.push(pair),
        }
    }
    let tls = Tls {
        mode: mode.unwrap_or(Mode::Prefer),
        roots,
    };
    match (tls.mode, &tls.roots) {
        (Mode::Disable, Some(_)) => {
            return Err("`sslrootcert` with `sslmode=disable` would trust nothing; leave it out, or choose `sslmode=verify-full`".into())
        }
        (Mode::VerifyCa | Mode::VerifyFull, None) => {
            let name = if tls.mode == Mode::VerifyCa { "verify-ca" } else { "verify-full" };
            return Err(format!(
                "`sslmode={name}` checks the server's certificate against `sslrootcert`, which is missing; add `sslrootcert=PATH` (a PEM file) or `sslrootcert=system`"
            ));
        }
        _ => {}
    }
    kept.push(match tls.mode {
        Mode::Disable => "sslmode=disable",
        Mode::Allow | Mode::Prefer => "sslmode=prefer",
        Mode::Require | Mode::VerifyCa | Mode::VerifyFull => "sslmode=require",
    });
    Ok((format!("{base}?{}", kept.join("&")), tls))
}

/// Percent-decodes a query value, as the client does.
fn decode(value: &str) -> Result<String, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = value
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("`{value}` has a `%` not followed by two hex digits"))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("`{value}` does not decode to UTF-8"))
}

impl Tls {
    /// The client's TLS settings, its authorities read now (so that a
    /// missing file is found when the URL is given, not at the first
    /// connection); `None` for `sslmode=disable`.
    pub(crate) fn config(&self) -> Result<Option<Arc<ClientConfig>>, String> {
        if self.mode == Mode::Disable {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let roots = match &self.roots {
            None => None,
            Some(roots) => {
                let store = Arc::new(read_roots(roots)?);
                let webpki = WebPkiServerVerifier::builder_with_provider(store, provider.clone())
                    .build()
                    .map_err(|e| format!("`sslrootcert` cannot be used: {e}"))?;
                Some(webpki)
            }
        };
        let verifier: Arc<dyn ServerCertVerifier> = match (self.mode, roots) {
            (Mode::VerifyFull, Some(webpki)) => webpki,
            (_, roots) => Arc::new(Lenient {
                roots,
                provider: provider.clone(),
            }),
        };
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS cannot be set up: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Some(Arc::new(config)))
    }
}

fn read_roots(roots: &Roots) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::System => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = store.add(cert);
            }
            if store.is_empty() {
                return Err("`sslrootcert=system`: this machine has no trusted authorities; name a PEM file instead".into());
            }
        }
        Roots::File(path) => {
            use rustls::pki_types::pem::PemObject;
            use std::io::Read;
            let cannot = |why: String| format!("cannot read `sslrootcert` `{path}`: {why}");
            let mut pem = Vec::new();
            std::fs::File::open(path)
                .and_then(|f| f.take(MAX_ROOT_FILE + 1).read_to_end(&mut pem))
                .map_err(|e| cannot(e.to_string()))?;
            if pem.len() as u64 > MAX_ROOT_FILE {
                return Err(cannot(format!("it is longer than {MAX_ROOT_FILE} bytes")));
            }
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| cannot(format!("it is not PEM ({e})")))?;
                store
                    .add(cert)
                    .map_err(|e| cannot(format!("a certificate in it is invalid ({e})")))?;
            }
            if store.is_empty() {
                return Err(cannot("it holds no certificate".into()));
            }
        }
    }
    Ok(store)
}

/// Every mode but `verify-full`: the chain checked against `roots` when
/// there are roots (`verify-ca`, and `require`/`prefer` with `sslrootcert`),
/// the name in the certificate never; without roots (`prefer`, `require`)
/// the session is encrypted and the server not authenticated (libpq's
/// meaning of those modes). The handshake's signatures are always checked,
/// so the server holds the key of the certificate it shows.
#[derive(Debug)]
struct Lenient {
    roots: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        match roots.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_reads_the_url_without_sslrootcert_and_with_one_of_its_three_modes() {
        let (url, tls) =
            split("postgres://u@h/db?options=-csearch_path%3Dx&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20b.crt")
                .unwrap();
        assert_eq!(
            url,
            "postgres://u@h/db?options=-csearch_path%3Dx&sslmode=require"
        );
        assert_eq!(
            tls,
            Tls {
                mode: Mode::VerifyFull,
                roots: Some(Roots::File("/tmp/ca b.crt".into()))
            }
        );
        let (url, tls) = split("postgres://u@h/db").unwrap();
        assert_eq!(url, "postgres://u@h/db?sslmode=prefer");
        assert_eq!((tls.mode, tls.roots), (Mode::Prefer, None));
        let (url, tls) = split("postgres://u@h/db?sslmode=verify-ca&sslrootcert=system").unwrap();
        assert_eq!(url, "postgres://u@h/db?sslmode=require");
        assert_eq!(tls.roots, Some(Roots::System));
        assert_eq!(
            split("postgres://u@h/db?sslmode=disable").unwrap().0,
            "postgres://u@h/db?sslmode=disable"
        );
        for bad in [
            "postgres://u@h/db?sslrootcert=",
            "postgres://u@h/db?sslmode=verify-ca",
            "postgres://u@h/db?sslrootcert=%zz",
            "postgres://u@h/db?sslmode=VERIFY-FULL",
        ] {
            assert!(split(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_root_file_must_hold_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_ROOT_FILE as usize + 1]).unwrap();
        for (path, why) in [
            (&empty, "holds no certificate"),
            (&junk, "not PEM"),
            (&big, "longer than"),
        ] {
            let tls = Tls {
                mode: Mode::VerifyFull,
                roots: Some(Roots::File(path.display().to_string())),
            };
            let err = tls.config().unwrap_err();
            assert!(err.contains(why), "{path:?}: {err}");
        }
        // Without roots, `require` encrypts without checking.
        let tls = Tls {
            mode: Mode::Require,
            roots: None,
        };
        assert!(tls.config().unwrap().is_some());
        assert!(Tls {
            mode: Mode::Disable,
            roots: None
        }
        .config()
        .unwrap()
        .is_none());
    }
}
