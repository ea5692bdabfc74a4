//! The LXD REST API transport: HTTP/1.1 over the daemon's unix socket, or
//! over TLS with a client certificate for a remote daemon. One connection
//! per request: a unix socket connects in microseconds, and it keeps the
//! client free of pool state that a restarted daemon would invalidate.
//!
//! LXD answers in an envelope (`type` = `sync`, `async` or `error`). Async
//! answers name an operation, which [`Client::wait`] follows to its real
//! end: LXD 5.0 answers HTTP 200 to `/wait` even when the operation failed,
//! so the outcome is read from `metadata.status` and `metadata.err`.

use crate::{Error, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
pub use hyper::Method;
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The socket of a Debian-packaged LXD.
pub const DEFAULT_SOCKET: &str = "/var/lib/lxd/unix.socket";
/// The socket of the snap-packaged LXD.
pub const SNAP_SOCKET: &str = "/var/snap/lxd/common/lxd/unix.socket";

/// The local daemon's socket when the config names none, found the way
/// `lxc` finds it: `$LXD_DIR/unix.socket`, else the snap's socket if it
/// exists, else the Debian package's.
pub fn default_socket() -> PathBuf {
    default_socket_from(std::env::var_os("LXD_DIR").map(PathBuf::from), |p| {
        std::path::Path::new(p).exists()
    })
}

fn default_socket_from(lxd_dir: Option<PathBuf>, exists: impl Fn(&str) -> bool) -> PathBuf {
    match lxd_dir {
        Some(d) if !d.as_os_str().is_empty() => d.join("unix.socket"),
        _ if !exists(DEFAULT_SOCKET) && exists(SNAP_SOCKET) => PathBuf::from(SNAP_SOCKET),
        _ => PathBuf::from(DEFAULT_SOCKET),
    }
}

/// How long one request may take before it counts as lost.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one `/wait` long-poll asks the daemon to hold on.
const WAIT_POLL_SECS: u64 = 30;

/// An error the daemon reported, before it is classified for the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP-like status code (`error_code` or the operation's `status_code`).
    pub code: u16,
    pub message: String,
}

impl ApiError {
    /// Another operation holds the instance (one a killed client left
    /// running, say): worth retrying once it ends.
    pub fn is_busy(&self) -> bool {
        self.message.contains("is busy running")
    }

    /// The default classification; callers refine it where the context
    /// knows more (a 404 on create means a missing image, say).
    pub fn into_error(self, what: &str) -> Error {
        let m = format!("{what}: {}", self.message);
        if self.is_busy() {
            return Error::Transient(m);
        }
        match self.code {
            403 | 401 => Error::Credentials(m),
            404 => Error::NotFound(m),
            409 | 429 | 500..=599 => Error::Transient(m),
            _ => Error::InvalidSpec(m),
        }
    }
}

/// What a request came back with.
#[derive(Debug)]
pub enum Reply {
    Sync(Value),
    /// The operation's path, `/1.0/operations/<id>`.
    Async(String),
}

#[derive(Clone)]
enum Endpoint {
    Unix(PathBuf),
    Https {
        host: String,
        port: u16,
        tls: tokio_rustls::TlsConnector,
        server_name: ServerName<'static>,
    },
}

#[derive(Clone)]
pub struct Client {
    endpoint: Endpoint,
    /// Shown in errors: the socket path or the URL.
    display: String,
}

impl Client {
    pub fn unix(path: impl Into<PathBuf>) -> Client {
        let path = path.into();
        Client {
            display: path.display().to_string(),
            endpoint: Endpoint::Unix(path),
        }
    }

    /// A remote daemon at `url` (`https://host[:port]`, port 8443 by
    /// default), authenticated with a client certificate the daemon trusts,
    /// and trusting exactly the daemon's own (self-signed) certificate.
    pub fn https(
        url: &str,
        client_cert: &str,
        client_key: &str,
        server_cert: &str,
    ) -> Result<Client> {
        let rest = url.strip_prefix("https://").ok_or_else(|| {
            Error::Config(format!(
                "`lxd-url` `{url}` must start with `https://` (for the local daemon, leave it unset and set `lxd-socket`)"
            ))
        })?;
        let (host, port) = host_port(url, rest)?;
        if host.is_empty() {
            return Err(Error::Config(format!("`lxd-url` `{url}` names no host")));
        }
        let pem = |key: &str, path: &str| -> Result<Vec<u8>> {
            std::fs::read(path)
                .map_err(|e| Error::Config(format!("cannot read `{key}` file `{path}`: {e}")))
        };
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&pem("lxd-client-cert", client_cert)?)
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::Config(format!("`lxd-client-cert` `{client_cert}`: {e}")))?;
        if certs.is_empty() {
            return Err(Error::Config(format!(
                "`lxd-client-cert` `{client_cert}` holds no PEM certificate"
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(&pem("lxd-client-key", client_key)?)
            .map_err(|e| Error::Config(format!("`lxd-client-key` `{client_key}`: {e}")))?;
        let pinned = CertificateDer::from_pem_slice(&pem("lxd-server-cert", server_cert)?)
            .map_err(|e| Error::Config(format!("`lxd-server-cert` `{server_cert}`: {e}")))?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier = Arc::new(PinnedServer {
            cert: pinned,
            provider: provider.clone(),
        });
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS setup: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(certs, key)
            .map_err(|e| {
                Error::Config(format!(
                    "`lxd-client-key` does not fit `lxd-client-cert`: {e}"
                ))
            })?;
        let server_name = ServerName::try_from(host.clone())
            .map_err(|e| Error::Config(format!("`lxd-url` host `{host}`: {e}")))?;
        Ok(Client {
            display: url.to_string(),
            endpoint: Endpoint::Https {
                host,
                port,
                tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
                server_name,
            },
        })
    }

    pub fn display(&self) -> &str {
        &self.display
    }

    /// Sends one request and reads the envelope. `Err(Ok(api))` is an error
    /// the daemon reported; `Err(Err(e))` is one on the way there.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<std::result::Result<Reply, ApiError>> {
        self.call_with_timeout(method, path, body, REQUEST_TIMEOUT)
            .await
    }

    async fn call_with_timeout(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<std::result::Result<Reply, ApiError>> {
        let bytes = match body {
            Some(v) => Bytes::from(serde_json::to_vec(v).expect("JSON values serialise")),
            None => Bytes::new(),
        };
        let (status, body) = self
            .send(
                method.clone(),
                path,
                bytes,
                &[("content-type", "application/json".to_string())],
                timeout,
            )
            .await?;
        envelope(&method, path, status, &body)
    }

    /// One request with a raw body and extra headers; the raw answer.
    async fn send(
        &self,
        method: Method,
        path: &str,
        bytes: Bytes,
        headers: &[(&str, String)],
        timeout: Duration,
    ) -> Result<(u16, Bytes)> {
        let host = match &self.endpoint {
            Endpoint::Unix(_) => "lxd".to_string(),
            Endpoint::Https { host, port, .. } => format!("{host}:{port}"),
        };
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::USER_AGENT, "jujube");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req.body(Full::new(bytes)).expect("a valid request");
        let round = async {
            match &self.endpoint {
                Endpoint::Unix(p) => {
                    let s = tokio::net::UnixStream::connect(p).await.map_err(|e| {
                        Error::Transient(format!(
                            "cannot reach the LXD daemon at `{}`: {e}; is it running? (`scripts/lxd-setup` starts one; set `lxd-socket` for another path)",
                            p.display()
                        ))
                    })?;
                    exchange(TokioIo::new(s), req).await
                }
                Endpoint::Https {
                    host,
                    port,
                    tls,
                    server_name,
                } => {
                    let tcp = tokio::net::TcpStream::connect((host.as_str(), *port))
                        .await
                        .map_err(|e| {
                            Error::Transient(format!("cannot reach LXD at `{}`: {e}", self.display))
                        })?;
                    let s = tls.connect(server_name.clone(), tcp).await.map_err(|e| {
                        let m = format!("TLS with LXD at `{}` failed: {e}", self.display);
                        if e.kind() == std::io::ErrorKind::InvalidData {
                            Error::Credentials(format!("{m}; check `lxd-server-cert`, `lxd-client-cert` and that the daemon trusts the client certificate"))
                        } else {
                            Error::Transient(m)
                        }
                    })?;
                    exchange(TokioIo::new(s), req).await
                }
            }
        };
        tokio::time::timeout(timeout, round).await.map_err(|_| {
            Error::Transient(format!(
                "LXD at `{}` did not answer {method} {path} within {timeout:?}",
                self.display
            ))
        })?
    }

    /// Writes a file (or makes a directory: `data` empty, `directory`) in
    /// a container through LXD's file API, owned by root with `mode`. An
    /// existing file is deleted first: LXD keeps an existing file's mode and
    /// owner, and truncating a running binary in place fails.
    pub async fn push_file(
        &self,
        container: &str,
        path: &str,
        data: Bytes,
        mode: u32,
        directory: bool,
    ) -> Result<std::result::Result<(), ApiError>> {
        let at = files_path(container, path);
        if !directory {
            match self.call(Method::DELETE, &at, None).await? {
                Ok(_) => {}
                Err(e) if e.code == 404 => {}
                Err(e) => return Ok(Err(e)),
            }
        }
        let headers = [
            ("content-type", "application/octet-stream".to_string()),
            (
                "x-lxd-type",
                if directory { "directory" } else { "file" }.to_string(),
            ),
            ("x-lxd-mode", format!("0{mode:o}")),
            ("x-lxd-uid", "0".to_string()),
            ("x-lxd-gid", "0".to_string()),
            ("x-lxd-write", "overwrite".to_string()),
        ];
        let (status, body) = self
            .send(Method::POST, &at, data, &headers, PUSH_TIMEOUT)
            .await?;
        Ok(match envelope(&Method::POST, &at, status, &body)? {
            Ok(_) => Ok(()),
            Err(e) if directory && e.message.to_lowercase().contains("exists") => Ok(()),
            Err(e) => Err(e),
        })
    }

    /// A file's bytes from a container; `None` when it does not exist.
    pub async fn read_file(&self, container: &str, path: &str) -> Result<Option<Bytes>> {
        let at = files_path(container, path);
        let (status, body) = self
            .send(Method::GET, &at, Bytes::new(), &[], PUSH_TIMEOUT)
            .await?;
        if status == 200 {
            return Ok(Some(body));
        }
        match envelope(&Method::GET, &at, status, &body)? {
            Err(e) if e.code == 404 => Ok(None),
            Err(e) => Err(e.into_error(&format!("reading `{path}` in `{container}`"))),
            Ok(_) => Ok(None),
        }
    }

    /// The names in a directory of a container; empty when it does not
    /// exist.
    pub async fn list_dir(&self, container: &str, path: &str) -> Result<Vec<String>> {
        let at = files_path(container, path);
        match self.get(&at).await? {
            Ok(v) => Ok(v
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|n| n.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()),
            Err(e) if e.code == 404 => Ok(Vec::new()),
            Err(e) => Err(e.into_error(&format!("listing `{path}` in `{container}`"))),
        }
    }
}

/// LXD's file API for `path` in `container`.
fn files_path(container: &str, path: &str) -> String {
    format!(
        "/1.0/instances/{container}/files?path={}",
        query_escape(path)
    )
}

/// How long a file push or read may take (a debug build of the binary is
/// a few hundred megabytes).
const PUSH_TIMEOUT: Duration = Duration::from_secs(300);

/// Reads LXD's envelope.
fn envelope(
    method: &Method,
    path: &str,
    status: u16,
    body: &[u8],
) -> Result<std::result::Result<Reply, ApiError>> {
    {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            Error::Transient(format!(
                "LXD answered {method} {path} with HTTP {status} and no JSON envelope: {e}"
            ))
        })?;
        Ok(match v["type"].as_str() {
            Some("sync") => Ok(Reply::Sync(v["metadata"].clone())),
            Some("async") => match v["operation"].as_str() {
                Some(op) if !op.is_empty() => Ok(Reply::Async(op.to_string())),
                _ => Err(ApiError {
                    code: 500,
                    message: "an async answer without an operation".into(),
                }),
            },
            _ => {
                let code = v["error_code"]
                    .as_u64()
                    .filter(|c| *c != 0)
                    .unwrap_or(status as u64);
                if status == 403 || code == 403 {
                    return Ok(Err(ApiError {
                        code: 403,
                        message: format!(
                            "{} (is the client certificate trusted by the daemon?)",
                            v["error"].as_str().unwrap_or("forbidden")
                        ),
                    }));
                }
                Err(ApiError {
                    code: code as u16,
                    message: v["error"].as_str().unwrap_or("unknown error").to_string(),
                })
            }
        })
    }
}

impl Client {
    /// GET of a sync resource; a daemon-reported error is classified.
    pub async fn get(&self, path: &str) -> Result<std::result::Result<Value, ApiError>> {
        Ok(match self.call(Method::GET, path, None).await? {
            Ok(Reply::Sync(v)) => Ok(v),
            Ok(Reply::Async(op)) => Err(ApiError {
                code: 500,
                message: format!("GET {path} answered with operation `{op}`"),
            }),
            Err(e) => Err(e),
        })
    }

    /// Sends a request and, if it starts an operation, waits for the
    /// operation's real outcome.
    pub async fn run(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<std::result::Result<Value, ApiError>> {
        match self.call(method, path, body).await? {
            Ok(Reply::Sync(v)) => Ok(Ok(v)),
            Ok(Reply::Async(op)) => self.wait(&op).await,
            Err(e) => Ok(Err(e)),
        }
    }

    /// Follows an operation until it ends; its failure is an [`ApiError`]
    /// with the operation's `status_code` and `err`.
    pub async fn wait(&self, op: &str) -> Result<std::result::Result<Value, ApiError>> {
        loop {
            let path = format!("{op}/wait?timeout={WAIT_POLL_SECS}");
            let timeout = Duration::from_secs(WAIT_POLL_SECS) + REQUEST_TIMEOUT;
            let meta = match self
                .call_with_timeout(Method::GET, &path, None, timeout)
                .await?
            {
                Ok(Reply::Sync(m)) => m,
                Ok(Reply::Async(_)) => continue,
                Err(e) => return Ok(Err(e)),
            };
            match meta["status"].as_str() {
                Some("Success") => return Ok(Ok(meta)),
                Some("Running") | Some("Pending") | Some("Ready") => continue,
                _ => {
                    let code = meta["status_code"].as_u64().unwrap_or(400) as u16;
                    let err = meta["err"].as_str().unwrap_or("").to_string();
                    return Ok(Err(ApiError {
                        code: if code < 400 { 400 } else { code },
                        message: if err.is_empty() {
                            format!(
                                "operation `{}` ended {}",
                                meta["description"].as_str().unwrap_or(op),
                                meta["status"].as_str().unwrap_or("without a status")
                            )
                        } else {
                            err
                        },
                    }));
                }
            }
        }
    }
}

async fn exchange<IO>(io: IO, req: Request<Full<Bytes>>) -> Result<(u16, Bytes)>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let lost = |e: hyper::Error| Error::Transient(format!("LXD connection: {e}"));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(lost)?;
    // The connection task ends when `sender` is dropped.
    let conn = tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(lost)?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(lost)?.to_bytes();
    drop(sender);
    let _ = conn.await;
    Ok((status, body))
}

/// Trusts exactly one server certificate, the way LXD clients pin a
/// daemon's self-signed certificate; signatures are still checked.
#[derive(Debug)]
struct PinnedServer {
    cert: CertificateDer<'static>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.cert.as_ref() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the daemon's certificate is not the one in `lxd-server-cert`".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Host and port of `lxd-url` (given without its `https://`); the port is
/// 8443, LXD's, unless named. IPv6 hosts are bracketed.
fn host_port(url: &str, rest: &str) -> Result<(String, u16)> {
    let authority = rest.split('/').next().unwrap_or_default();
    let bad_port = |p: &str| Error::Config(format!("`lxd-url` `{url}` has a bad port `{p}`"));
    let port = |p: Option<&str>| match p {
        None => Ok(8443),
        Some(p) => p.parse::<u16>().map_err(|_| bad_port(p)),
    };
    if let Some(bracketed) = authority.strip_prefix('[') {
        let (h, after) = bracketed
            .split_once(']')
            .ok_or_else(|| Error::Config(format!("`lxd-url` `{url}` has an unclosed `[`")))?;
        let p = match after {
            "" => None,
            a => Some(a.strip_prefix(':').ok_or_else(|| bad_port(a))?),
        };
        return Ok((h.to_string(), port(p)?));
    }
    match authority.split_once(':') {
        Some((h, p)) => Ok((h.to_string(), port(Some(p))?)),
        None => Ok((authority.to_string(), port(None)?)),
    }
}

/// `%`-encodes a query value (LXD filters contain spaces).
pub fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_escaped_for_the_query_string() {
        assert_eq!(
            query_escape("config.user.jujube-env-uuid eq a-b"),
            "config.user.jujube-env-uuid%20eq%20a-b"
        );
        assert_eq!(query_escape("x&y=z"), "x%26y%3Dz");
    }

    #[test]
    fn the_default_socket_follows_lxd_dir_then_the_snap_then_debian() {
        let none = |_: &str| false;
        let snap_only = |p: &str| p == SNAP_SOCKET;
        let both = |_: &str| true;
        assert_eq!(
            default_socket_from(Some("/srv/lxd".into()), both),
            PathBuf::from("/srv/lxd/unix.socket")
        );
        assert_eq!(
            default_socket_from(None, snap_only),
            PathBuf::from(SNAP_SOCKET)
        );
        assert_eq!(
            default_socket_from(None, both),
            PathBuf::from(DEFAULT_SOCKET)
        );
        assert_eq!(
            default_socket_from(None, none),
            PathBuf::from(DEFAULT_SOCKET)
        );
        assert_eq!(
            default_socket_from(Some("".into()), snap_only),
            PathBuf::from(SNAP_SOCKET)
        );
    }

    #[test]
    fn lxd_urls_give_host_and_port() {
        let hp = |rest: &str| host_port("u", rest).map_err(|e| e.to_string());
        assert_eq!(
            hp("lxd.example:9443").unwrap(),
            ("lxd.example".into(), 9443)
        );
        assert_eq!(hp("lxd.example").unwrap(), ("lxd.example".into(), 8443));
        assert_eq!(hp("10.0.0.1:8443/").unwrap(), ("10.0.0.1".into(), 8443));
        assert_eq!(hp("[::1]:9443").unwrap(), ("::1".into(), 9443));
        assert_eq!(hp("[fd00::2]/").unwrap(), ("fd00::2".into(), 8443));
        assert!(hp("h:x").unwrap_err().contains("bad port `x`"));
        assert!(hp("[::1").unwrap_err().contains("unclosed"));
        assert!(hp("[::1]x").unwrap_err().contains("bad port"));
    }

    #[test]
    fn api_errors_are_classified() {
        use crate::ErrorClass::*;
        for (code, class) in [
            (403, Credentials),
            (404, NotFound),
            (500, Transient),
            (503, Transient),
            (400, InvalidSpec),
        ] {
            let e = ApiError {
                code,
                message: "m".into(),
            };
            assert_eq!(e.into_error("x").class(), class, "{code}");
        }
        let busy = ApiError {
            code: 400,
            message:
                "Failed creating instance record: Instance is busy running a \"start\" operation"
                    .into(),
        };
        assert_eq!(busy.into_error("x").class(), Transient);
    }

    #[test]
    fn https_config_errors_name_the_key_and_the_file() {
        let e = Client::https("http://h", "a", "b", "c").err().unwrap();
        assert!(e.to_string().contains("`lxd-url`"), "{e}");
        let e = Client::https("https://h:x", "a", "b", "c").err().unwrap();
        assert!(e.to_string().contains("bad port"), "{e}");
        let e = Client::https("https://h", "/nonexistent/c.crt", "b", "c")
            .err()
            .unwrap();
        assert!(
            e.to_string().contains("`lxd-client-cert`")
                && e.to_string().contains("/nonexistent/c.crt"),
            "{e}"
        );
    }
}
