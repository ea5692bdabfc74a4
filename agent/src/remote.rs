//! The facade over the network: [`Remote`] speaks to the controller's API
//! server, so an agent runs unchanged on another machine.
//!
//! One HTTP/2 connection over TLS per [`Remote`], multiplexing every call and
//! watch of the agent. The server must present a certificate for
//! [`SERVER_NAME`] issued by the environment's CA — the only root trusted —
//! so a server of another environment, or anything else listening on the
//! address, is refused during the handshake.
//!
//! Failures: a call on a broken connection reconnects once (the controller
//! may have restarted) and otherwise answers [`ErrorCode::Unavailable`],
//! which the agents' loops retry. A watch survives reconnections by itself:
//! it resubscribes with the last revision it saw, and the server announces
//! what it missed (or says `resync`).

use crate::api::*;
use crate::wire::{
    AgentConf, Call, Reply, WatchRequest, CALL_PATH, SERVER_NAME, TAG_HEADER, WATCH_PATH,
};
use async_trait::async_trait;
pub use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Mutex;

/// The largest answer an agent reads (a unit view of a large model is a few
/// hundred kilobytes).
const MAX_REPLY: usize = 16 << 20;

/// The largest answer a user's client reads: `status` grows with the model
/// (about 40 MB of JSON at 100,000 units), and the user asked for it.
const MAX_CLIENT_REPLY: usize = 256 << 20;
/// The largest HTTP/2 frame the controller may send.
const MAX_FRAME: u32 = 1 << 20;

/// A TLS client configuration trusting only `ca_cert` (PEM), speaking
/// HTTP/2.
fn tls_trusting(ca_cert: &str) -> ApiResult<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_cert.as_bytes()) {
        let cert = cert
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("bad CA certificate: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("bad CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(ApiError::new(
            ErrorCode::Internal,
            "no CA certificate in the agent's configuration",
        ));
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// How long connecting and the TLS and HTTP/2 handshakes may take at one
/// address (a frozen server accepts, then never answers).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A facade whose every method is a call to the API server.
pub struct Remote {
    tag: Tag,
    inner: Arc<Inner>,
}

struct Inner {
    /// Tried in order on each new connection; shared by a deployer and the
    /// unit agents it runs (see [`Remote::follow_controllers`]).
    addresses: Arc<std::sync::RwLock<Vec<String>>>,
    tls: tokio_rustls::TlsConnector,
    /// Who calls: the header naming it and its value (an agent's tag, or a
    /// user's name).
    who: (&'static str, String),
    /// `Bearer SECRET`; `None` until a deferred credential is obtained.
    bearer: Mutex<Option<String>>,
    deferred: Option<Deferred>,
    /// The connection, and the index in `addresses` it was made to.
    conn: Mutex<Option<(SendRequest<Full<Bytes>>, usize)>>,
    /// The server refused this client's own credential on its last call
    /// (cleared by the next call it accepts).
    refused: std::sync::atomic::AtomicBool,
    /// Where the next connection starts in `addresses`: past a controller
    /// that answered it cannot reach its state database, else where the
    /// last one was made.
    start: std::sync::atomic::AtomicUsize,
    /// The incarnation this agent took and its last write's number (see
    /// [`STAMP_HEADER`](crate::wire::STAMP_HEADER)); held through
    /// each write, so that an agent's writes go one at a time, in order.
    stamp: Mutex<Option<(i64, i64)>>,
}

/// A unit agent's credential, obtained on its first call: read from its
/// `agent.conf` if its deployer made one before (a restarted agent), else
/// made by the deployer through the API and written there.
struct Deferred {
    deployer: Arc<Remote>,
    conf: AgentConf,
    path: PathBuf,
}

/// What an agent holding `held` tries after learning that the controllers
/// serve at `learned`; `None` to keep `held`. Kept when nothing was learned,
/// when the sets are the same, and when `held` shares no address with
/// `learned`: that agent reaches its controller through an address the
/// controllers do not record (the socket LXD proxies into a container, the
/// `api-address` an EC2 instance is given), which it keeps. Otherwise the
/// addresses it holds that are still served come first, in its order (the
/// one it is connected through stays first), then the new ones.
pub fn followed_addresses(held: &[String], learned: &[String]) -> Option<Vec<String>> {
    if learned.is_empty() || !held.iter().any(|a| learned.contains(a)) {
        return None;
    }
    if held.len() == learned.len() && held.iter().all(|a| learned.contains(a)) {
        return None;
    }
    let mut next: Vec<String> = held
        .iter()
        .filter(|a| learned.contains(a))
        .cloned()
        .collect();
    for a in learned {
        if !next.contains(a) {
            next.push(a.clone());
        }
    }
    Some(next)
}

fn unavailable(what: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Unavailable, format!("{UNREACHED}{what}"))
}

const UNREACHED: &str = "API server unavailable: ";

fn unanswered(what: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::Unanswered,
        format!("the connection to the controller was lost before it answered ({what})"),
    )
}

/// Whether `e` says a controller answered that it cannot act now (its state
/// database out of reach), rather than that none could be reached: the
/// next call goes to the next controller at once.
pub fn answered_unavailable(e: &ApiError) -> bool {
    e.code == ErrorCode::Unavailable && !e.message.starts_with(UNREACHED)
}

impl Remote {
    /// A client for `conf`'s entity. Nothing is sent until the first call.
    pub fn new(conf: &AgentConf) -> ApiResult<Remote> {
        Ok(Remote {
            tag: conf.tag.clone(),
            inner: Arc::new(Inner {
                addresses: Arc::new(std::sync::RwLock::new(conf.api_addresses.clone())),
                tls: tls_trusting(&conf.ca_cert)?,
                who: (TAG_HEADER, conf.tag.to_string()),
                bearer: Mutex::new(Some(format!("Bearer {}", conf.secret))),
                deferred: None,
                conn: Mutex::new(None),
                refused: std::sync::atomic::AtomicBool::new(false),
                start: Default::default(),
                stamp: Mutex::new(None),
            }),
        })
    }

    /// Whether the server refused this client's credential on its last
    /// call: an agent process then exits non-zero (it is not done; its
    /// supervisor restarts it, with whatever `agent.conf` holds then).
    pub fn credential_refused(&self) -> bool {
        self.inner
            .refused
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// The API addresses tried, in order, on the next connection.
    pub fn addresses(&self) -> Vec<String> {
        self.inner
            .addresses
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Follows the controllers: `learned` (a machine view's
    /// [`MachineView::api_addresses`](crate::api::MachineView)) replaces
    /// the addresses tried, for this client and the unit agents it deploys,
    /// when [`followed_addresses`] says so; answers the new list then.
    pub fn follow_controllers(&self, learned: &[String]) -> Option<Vec<String>> {
        let mut held = self
            .inner
            .addresses
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let next = followed_addresses(&held, learned)?;
        *held = next.clone();
        Some(next)
    }

    /// A client for `tag` whose credential its deployer `deployer` makes on
    /// first use and keeps in `conf_path` (mode 0600).
    pub fn deferred(deployer: Arc<Remote>, tag: Tag, conf_path: PathBuf) -> Remote {
        let conf = AgentConf {
            api_addresses: deployer.addresses(),
            ca_cert: String::new(),
            tag: tag.clone(),
            secret: String::new(),
            env_name: String::new(),
            env_uuid: String::new(),
        };
        Remote {
            tag: tag.clone(),
            inner: Arc::new(Inner {
                addresses: deployer.inner.addresses.clone(),
                tls: deployer.inner.tls.clone(),
                who: (TAG_HEADER, tag.to_string()),
                bearer: Mutex::new(None),
                deferred: Some(Deferred {
                    deployer,
                    conf,
                    path: conf_path,
                }),
                refused: std::sync::atomic::AtomicBool::new(false),
                start: Default::default(),
                stamp: Mutex::new(None),
                conn: Mutex::new(None),
            }),
        }
    }

    /// Sets the credential `unit`'s agent will log in with (the caller must
    /// be its deployer) and returns it; the server keeps only its hash.
    pub async fn new_unit_credential(&self, unit: &str) -> ApiResult<String> {
        let secret = crate::wire::new_secret();
        self.call::<()>(Call::SetUnitCredential {
            unit: unit.to_string(),
            secret: secret.clone(),
        })
        .await?;
        Ok(secret)
    }

    /// Makes `call`. A write is stamped with this agent's incarnation
    /// (taken on its first write) and its next number, kept when it goes
    /// again after a lost answer: a write held up in a controller that
    /// lost its database, while this agent went on through another, is
    /// refused when it arrives instead of undoing what came after it.
    async fn call<T: DeserializeOwned>(&self, call: Call) -> ApiResult<T> {
        if !call.is_stamped() {
            return self.exchange(&call, None).await;
        }
        let mut stamp = self.inner.stamp.lock().await;
        let mut tries = 0;
        loop {
            let (incarnation, seq) = match *stamp {
                Some((incarnation, seq)) => (incarnation, seq + 1),
                None => match self.exchange::<i64>(&Call::StartAgent, None).await {
                    Ok(incarnation) => (incarnation, 1),
                    // A controller older than stamps knows no
                    // `start-agent`: its writes go unstamped, as before.
                    Err(e) if e.code == ErrorCode::Refused => {
                        return self.exchange(&call, None).await
                    }
                    Err(e) => return Err(e),
                },
            };
            *stamp = Some((incarnation, seq));
            let r = self.exchange(&call, Some((incarnation, seq))).await;
            match r {
                // A later incarnation was taken since (another start of
                // this agent, or a `start-agent` of this one held up and
                // committed late): this write changed nothing, and goes
                // once more under a new one.
                Err(e) if e.code == ErrorCode::Superseded && tries == 0 => {
                    *stamp = None;
                    tries += 1;
                }
                Err(e) if e.code == ErrorCode::Superseded => {
                    *stamp = None;
                    return Err(e);
                }
                r => return r,
            }
        }
    }

    async fn exchange<T: DeserializeOwned>(
        &self,
        call: &Call,
        stamp: Option<(i64, i64)>,
    ) -> ApiResult<T> {
        let body = serde_json::to_vec(call).expect("plain data");
        let resp = self
            .inner
            .send_stamped(CALL_PATH, body, true, stamp)
            .await?;
        let bytes = read_limited(resp.into_body()).await?;
        match serde_json::from_slice::<Reply>(&bytes) {
            Ok(Reply::Ok(v)) => serde_json::from_value(v).map_err(|e| {
                ApiError::new(
                    ErrorCode::Internal,
                    format!("malformed answer to `{}`: {e}", call.method()),
                )
            }),
            Ok(Reply::Error(e)) => Err(e),
            Err(e) => Err(ApiError::new(
                ErrorCode::Internal,
                format!("malformed answer to `{}`: {e}", call.method()),
            )),
        }
    }
}

async fn read_limited(body: Incoming) -> ApiResult<Bytes> {
    read_at_most(body, MAX_REPLY).await
}

async fn read_at_most(body: Incoming, limit: usize) -> ApiResult<Bytes> {
    let limited = http_body_util::Limited::new(body, limit);
    Ok(limited
        .collect()
        .await
        .map_err(|e| unavailable(format!("reading the answer: {e}")))?
        .to_bytes())
}

/// An instance's enrollment (see `jujube enroll`): trades its batch's
/// `token` and its identity (the provider's signed `document` and its
/// `signature`, as the metadata service gave them) for its machine's
/// `agent.conf`, at the API server of `addresses`, trusting only
/// `ca_cert`. Returns the configuration's bytes (JSON) as the controller
/// made them.
pub async fn enroll(
    addresses: &[String],
    ca_cert: &str,
    token: &str,
    document: &[u8],
    signature: &str,
) -> ApiResult<Vec<u8>> {
    use base64::Engine;
    let probe = AgentConf {
        api_addresses: addresses.to_vec(),
        ca_cert: ca_cert.to_string(),
        tag: Tag::Machine(0),
        secret: String::new(),
        env_name: String::new(),
        env_uuid: String::new(),
    };
    let body = serde_json::to_vec(&crate::wire::EnrollRequest {
        token: token.to_string(),
        identity_document: base64::engine::general_purpose::STANDARD.encode(document),
        identity_signature: signature.trim().to_string(),
    })
    .expect("plain data");
    post_once(&probe, crate::wire::ENROLL_PATH, None, body, "enrolling").await
}

/// `bootstrap`'s hand-over to machine 0 on EC2 (see
/// `jujube_api::handover`): `body` to the one-shot listener at `address`,
/// trusting only `ca_cert`, with the one-time `token`.
pub async fn hand_over(address: &str, ca_cert: &str, token: &str, body: Vec<u8>) -> ApiResult<()> {
    let probe = AgentConf {
        api_addresses: vec![address.to_string()],
        ca_cert: ca_cert.to_string(),
        tag: Tag::Machine(0),
        secret: String::new(),
        env_name: String::new(),
        env_uuid: String::new(),
    };
    post_once(
        &probe,
        crate::wire::HAND_OVER_PATH,
        Some(token),
        body,
        "handing over",
    )
    .await
    .map(drop)
}

/// One `POST` of `body` to `path` at `probe`'s addresses (no agent
/// credential; `bearer` if given), its answer's bytes when it succeeded.
async fn post_once(
    probe: &AgentConf,
    path: &str,
    bearer: Option<&str>,
    body: Vec<u8>,
    doing: &str,
) -> ApiResult<Vec<u8>> {
    let client = Remote::new(probe)?;
    let (mut sender, _) = client.inner.connect().await?;
    let mut req = hyper::Request::post(format!("https://{SERVER_NAME}{path}"))
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(b) = bearer {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {b}"));
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request");
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| unavailable(format!("{doing}: {e}")))?;
    let ok = resp.status().is_success();
    let bytes = http_body_util::Limited::new(resp.into_body(), MAX_REPLY)
        .collect()
        .await
        .map_err(|e| unavailable(format!("reading the answer: {e}")))?
        .to_bytes();
    if ok {
        return Ok(bytes.to_vec());
    }
    Err(match serde_json::from_slice::<Reply>(&bytes) {
        Ok(Reply::Error(e)) => e,
        _ => ApiError::new(ErrorCode::Internal, format!("{doing}: refused")),
    })
}

impl Inner {
    async fn handshake<IO>(&self, io: IO) -> ApiResult<SendRequest<Full<Bytes>>>
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).expect("a valid name");
        let tls = self
            .tls
            .connect(name, io)
            .await
            .map_err(|e| unavailable(format!("TLS handshake: {e}")))?;
        // Frames up to 1 MiB (HTTP/2's default is 16 KiB): a large answer
        // (a 100,000-unit status is 34 MB) arrives in a few dozen frames,
        // each one write where it is printed, not two thousand.
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .max_frame_size(MAX_FRAME)
            .handshake(TokioIo::new(tls))
            .await
            .map_err(|e| unavailable(format!("HTTP/2 handshake: {e}")))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Drops the connection made to `addresses[at]`, unless another call
    /// made a new one elsewhere meanwhile.
    async fn forget(&self, at: usize) {
        let mut conn = self.conn.lock().await;
        if conn.as_ref().is_some_and(|(_, i)| *i == at) {
            *conn = None;
        }
    }

    /// A connection to the first address that takes one, from `start` on;
    /// and that address's index.
    async fn connect(&self) -> ApiResult<(SendRequest<Full<Bytes>>, usize)> {
        let mut last = unavailable("no API address configured");
        let addresses = self
            .addresses
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let start = self.start.load(std::sync::atomic::Ordering::Acquire);
        for i in (0..addresses.len()).map(|k| (start + k) % addresses.len()) {
            let addr = &addresses[i];
            let attempt = tokio::time::timeout(CONNECT_TIMEOUT, async {
                if let Some(path) = addr.strip_prefix("unix:") {
                    match tokio::net::UnixStream::connect(path).await {
                        Ok(s) => self.handshake(s).await,
                        Err(e) => Err(unavailable(format!("connecting to `{addr}`: {e}"))),
                    }
                } else {
                    match tokio::net::TcpStream::connect(addr.as_str()).await {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            self.handshake(s).await
                        }
                        Err(e) => Err(unavailable(format!("connecting to `{addr}`: {e}"))),
                    }
                }
            })
            .await
            .unwrap_or_else(|_| {
                Err(unavailable(format!(
                    "connecting to `{addr}`: no TLS session within {}s",
                    CONNECT_TIMEOUT.as_secs()
                )))
            });
            match attempt {
                Ok(s) => {
                    self.start.store(i, std::sync::atomic::Ordering::Release);
                    return Ok((s, i));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn bearer(&self) -> ApiResult<String> {
        let mut bearer = self.bearer.lock().await;
        if let Some(b) = bearer.as_ref() {
            return Ok(b.clone());
        }
        let d = self
            .deferred
            .as_ref()
            .expect("a credential or a way to get one");
        let secret = match AgentConf::read(&d.path) {
            Ok(conf) if conf.tag == d.conf.tag && !conf.secret.is_empty() => conf.secret,
            _ => {
                let Tag::Unit(unit) = &d.conf.tag else {
                    return Err(ApiError::new(
                        ErrorCode::Internal,
                        "only unit credentials are made by a deployer",
                    ));
                };
                // The deployer's own writes' order is not this unit's: a
                // `superseded` there (after its own retry) must not make
                // this agent give up its incarnation.
                let secret = Box::pin(d.deployer.new_unit_credential(unit))
                    .await
                    .map_err(|e| match e.code {
                        ErrorCode::Superseded => ApiError::new(
                            ErrorCode::Unavailable,
                            format!(
                                "the deployer could not make this unit's credential: {}",
                                e.message
                            ),
                        ),
                        _ => e,
                    })?;
                let mut conf = d.conf.clone();
                conf.secret = secret.clone();
                conf.write(&d.path)
                    .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
                secret
            }
        };
        let b = format!("Bearer {secret}");
        *bearer = Some(b.clone());
        Ok(b)
    }

    fn request(
        &self,
        path: &str,
        body: Vec<u8>,
        bearer: &str,
        stamp: Option<(i64, i64)>,
    ) -> hyper::Request<Full<Bytes>> {
        let mut req = hyper::Request::post(format!("https://{SERVER_NAME}{path}"))
            .header(self.who.0, &self.who.1)
            .header(hyper::header::AUTHORIZATION, bearer)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some((incarnation, seq)) = stamp {
            req = req.header(crate::wire::STAMP_HEADER, format!("{incarnation}.{seq}"));
        }
        req.body(Full::new(Bytes::from(body)))
            .expect("a valid request")
    }

    /// Sends on the shared connection, reconnecting once if it broke.
    ///
    /// A request the connection may have carried before it broke (the
    /// server may have done it) goes again only if `resend`; otherwise the
    /// answer is [`ErrorCode::Unanswered`]. One it surely did not carry
    /// (the connection was found closed first) always goes again.
    async fn send(
        &self,
        path: &str,
        body: Vec<u8>,
        resend: bool,
    ) -> ApiResult<hyper::Response<Incoming>> {
        self.send_stamped(path, body, resend, None).await
    }

    /// [`Inner::send`], with an agent's write stamp (sent again with it).
    async fn send_stamped(
        &self,
        path: &str,
        body: Vec<u8>,
        resend: bool,
        stamp: Option<(i64, i64)>,
    ) -> ApiResult<hyper::Response<Incoming>> {
        let bearer = self.bearer().await?;
        for attempt in 0..2 {
            let (mut sender, at) = {
                let mut conn = self.conn.lock().await;
                match conn.as_ref() {
                    Some((s, at)) if !s.is_closed() => (s.clone(), *at),
                    _ => {
                        let made = self.connect().await?;
                        *conn = Some(made.clone());
                        made
                    }
                }
            };
            // `Err((e, carried))`: `carried` unless hyper says the request
            // never left (its connection closed before it was written).
            let sent = match sender.ready().await {
                Err(e) => Err((e, false)),
                Ok(()) => sender
                    .send_request(self.request(path, body.clone(), &bearer, stamp))
                    .await
                    .map_err(|e| {
                        let carried = !e.is_canceled();
                        (e, carried)
                    }),
            };
            match sent {
                Ok(resp) if resp.status() == hyper::StatusCode::SERVICE_UNAVAILABLE => {
                    // This controller cannot reach its state database (or
                    // is stopping): the next connection goes to the next
                    // controller. Nothing was decided; the caller's retry
                    // decides whether to ask again.
                    // Calls that shared the connection move on once: the
                    // first to see its 503 moves the start past it.
                    self.forget(at).await;
                    let _ = self.start.compare_exchange(
                        at,
                        at + 1,
                        std::sync::atomic::Ordering::AcqRel,
                        std::sync::atomic::Ordering::Acquire,
                    );
                    return Ok(resp);
                }
                Ok(resp) => {
                    // A deferred credential refused (its file is stale):
                    // made afresh by the deployer on the next call.
                    let refused = resp.status() == hyper::StatusCode::UNAUTHORIZED;
                    if refused {
                        if let Some(d) = &self.deferred {
                            *self.bearer.lock().await = None;
                            let _ = std::fs::remove_file(&d.path);
                        }
                    }
                    self.refused
                        .store(refused, std::sync::atomic::Ordering::Release);
                    return Ok(resp);
                }
                Err((e, carried)) => {
                    self.forget(at).await;
                    if carried && !resend {
                        return Err(unanswered(e));
                    }
                    if attempt == 1 {
                        return Err(unavailable(e));
                    }
                }
            }
        }
        unreachable!()
    }

    /// Opens a watch stream; a refusal is answered as a JSON [`Reply`] with a
    /// non-200 status.
    /// Answers the stream and the revision the subscription starts at.
    async fn open_watch(&self, target: &WatchTarget, since: u64) -> ApiResult<(Incoming, u64)> {
        let req = WatchRequest {
            target: target.clone(),
            since,
        };
        let resp = self
            .send(
                WATCH_PATH,
                serde_json::to_vec(&req).expect("plain data"),
                true,
            )
            .await?;
        if resp.status() == hyper::StatusCode::OK {
            let at = resp
                .headers()
                .get(crate::wire::REVISION_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            return Ok((resp.into_body(), at));
        }
        let bytes = read_limited(resp.into_body()).await?;
        match serde_json::from_slice::<Reply>(&bytes) {
            Ok(Reply::Error(e)) => Err(e),
            _ => Err(unavailable("malformed refusal of a watch")),
        }
    }
}

/// Reads newline-separated notices from a watch body into `tx`; returns
/// when the body ends or fails, or nobody listens any more.
async fn pump(
    mut body: Incoming,
    tx: &tokio::sync::watch::Sender<Option<Notice>>,
    since: &mut u64,
) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            _ = tx.closed() => return,
        };
        let Some(Ok(frame)) = frame else { return };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            if let Ok(n) = serde_json::from_slice::<Notice>(&line[..pos]) {
                *since = (*since).max(n.revision);
                if tx.send(Some(n)).is_err() {
                    return;
                }
            }
        }
        if buf.len() > 64 << 10 {
            return; // not notices: drop the stream and resubscribe
        }
    }
}

#[async_trait]
impl Facade for Remote {
    fn tag(&self) -> &Tag {
        &self.tag
    }

    async fn watch(&self, target: WatchTarget) -> ApiResult<NoticeStream> {
        // The first subscription is made before returning, so that a view
        // read afterwards misses nothing; later ones resume from the last
        // revision seen.
        let (first, at) = self.inner.open_watch(&target, 0).await?;
        let (tx, rx) = tokio::sync::watch::channel(None::<Notice>);
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let mut since = at;
            let mut body = Some(first);
            let mut backoff = Duration::from_millis(100);
            loop {
                if let Some(b) = body.take() {
                    pump(b, &tx, &mut since).await;
                    tracing::debug!(agent = %inner.who.1, ?target, since, "watch stream ended");
                    backoff = Duration::from_millis(100);
                }
                if tx.is_closed() {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = tx.closed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                match inner.open_watch(&target, since).await {
                    Ok((b, _)) => {
                        tracing::debug!(agent = %inner.who.1, ?target, since, "watch resumed");
                        body = Some(b)
                    }
                    // The entity is gone or no longer ours: the watch ends.
                    Err(e) if e.is_unauthorized() => {
                        tracing::debug!(agent = %inner.who.1, ?target, error = %e, "watch refused; it ends");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(agent = %inner.who.1, ?target, error = %e, "cannot resume a watch yet")
                    }
                }
            }
        });
        Ok(Box::pin(futures_util::stream::unfold(
            rx,
            |mut rx| async move {
                loop {
                    rx.changed().await.ok()?;
                    let latest = *rx.borrow_and_update();
                    if let Some(n) = latest {
                        return Some((n, rx));
                    }
                }
            },
        )))
    }

    async fn machine(&self, id: i64) -> ApiResult<MachineView> {
        self.call(Call::Machine { id }).await
    }
    async fn set_machine_status(&self, id: i64, status: AgentStatus, info: &str) -> ApiResult<()> {
        self.call(Call::SetMachineStatus {
            id,
            status,
            info: info.to_string(),
        })
        .await
    }
    async fn ensure_dead_machine(&self, id: i64) -> ApiResult<()> {
        self.call(Call::EnsureDeadMachine { id }).await
    }
    async fn charm(&self, unit: &str) -> ApiResult<CharmRef> {
        self.call(Call::Charm { unit: unit.into() }).await
    }
    async fn charm_files(&self, unit: &str) -> ApiResult<Vec<CharmFile>> {
        self.call(Call::CharmFiles { unit: unit.into() }).await
    }
    async fn ensure_dead_unit(&self, unit: &str) -> ApiResult<()> {
        self.call(Call::EnsureDeadUnit { unit: unit.into() }).await
    }
    async fn remove_unit(&self, unit: &str) -> ApiResult<()> {
        self.call(Call::RemoveUnit { unit: unit.into() }).await
    }
    async fn set_unit_status(&self, unit: &str, status: AgentStatus, info: &str) -> ApiResult<()> {
        self.call(Call::SetUnitStatus {
            unit: unit.into(),
            status,
            info: info.into(),
        })
        .await
    }
    async fn unit(&self, name: &str) -> ApiResult<UnitView> {
        self.call(Call::Unit { name: name.into() }).await
    }
    async fn ensure_dying_unit(&self, unit: &str) -> ApiResult<()> {
        self.call(Call::EnsureDyingUnit { unit: unit.into() }).await
    }
    async fn clear_resolved(&self, unit: &str) -> ApiResult<()> {
        self.call(Call::ClearResolved { unit: unit.into() }).await
    }
    async fn set_port(&self, unit: &str, port: &str, open: bool) -> ApiResult<()> {
        self.call(Call::SetPort {
            unit: unit.into(),
            port: port.into(),
            open,
        })
        .await
    }
    async fn enter_scope(
        &self,
        relation: i64,
        unit: &str,
        settings: Vec<(String, String)>,
    ) -> ApiResult<()> {
        self.call(Call::EnterScope {
            relation,
            unit: unit.into(),
            settings,
        })
        .await
    }
    async fn finish_run(&self, unit: &str, id: i64, result: RunResult) -> ApiResult<()> {
        self.call(Call::FinishRun {
            unit: unit.into(),
            id,
            result,
        })
        .await
    }
    async fn leave_scope(&self, relation: i64, unit: &str) -> ApiResult<()> {
        self.call(Call::LeaveScope {
            relation,
            unit: unit.into(),
        })
        .await
    }
    async fn scope_units(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<Vec<String>> {
        self.call(Call::ScopeUnits {
            relation,
            unit: unit.into(),
            after: after.map(str::to_string),
        })
        .await
    }
    async fn set_workload_status(
        &self,
        unit: &str,
        application: bool,
        status: &str,
        message: &str,
    ) -> ApiResult<()> {
        self.call(Call::SetWorkloadStatus {
            unit: unit.into(),
            application,
            status: status.into(),
            message: message.into(),
        })
        .await
    }
    async fn workload_status(&self, unit: &str, application: bool) -> ApiResult<(String, String)> {
        self.call(Call::WorkloadStatus {
            unit: unit.into(),
            application,
        })
        .await
    }
    async fn application_status(&self, unit: &str) -> ApiResult<crate::api::ApplicationStatus> {
        self.call(Call::ApplicationStatus { unit: unit.into() })
            .await
    }
    async fn set_workload_version(&self, unit: &str, version: &str) -> ApiResult<()> {
        self.call(Call::SetWorkloadVersion {
            unit: unit.into(),
            version: version.into(),
        })
        .await
    }
    async fn is_leader(&self, unit: &str) -> ApiResult<bool> {
        self.call(Call::IsLeader { unit: unit.into() }).await
    }
    async fn goal_state(&self, unit: &str) -> ApiResult<crate::api::GoalState> {
        self.call(Call::GoalState { unit: unit.into() }).await
    }

    async fn ship_log(&self, unit: &str, text: &str) -> ApiResult<()> {
        self.call(Call::ShipLog {
            unit: unit.into(),
            text: text.into(),
        })
        .await
    }

    async fn bag(&self, unit: &str, bag: crate::api::Bag) -> ApiResult<BTreeMap<String, String>> {
        self.call(Call::Bag {
            unit: unit.into(),
            bag,
        })
        .await
    }

    async fn update_bag(
        &self,
        unit: &str,
        bag: crate::api::Bag,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()> {
        self.call(Call::UpdateBag {
            unit: unit.into(),
            bag,
            changes,
        })
        .await
    }

    async fn scope_settings(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<crate::api::ScopeSettings> {
        self.call(Call::ScopeSettings {
            relation,
            unit: unit.into(),
            after: after.map(str::to_string),
        })
        .await
    }
    async fn service_config(
        &self,
        service: &str,
    ) -> ApiResult<BTreeMap<String, serde_json::Value>> {
        self.call(Call::ServiceConfig {
            service: service.into(),
        })
        .await
    }
    async fn relation_settings(
        &self,
        relation: i64,
        unit: &str,
    ) -> ApiResult<BTreeMap<String, String>> {
        self.call(Call::RelationSettings {
            relation,
            unit: unit.into(),
        })
        .await
    }
    async fn update_relation_settings(
        &self,
        relation: i64,
        unit: &str,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()> {
        self.call(Call::UpdateRelationSettings {
            relation,
            unit: unit.into(),
            changes,
        })
        .await
    }
}

/// Facades for the agents a remote deployer starts: each a [`Remote`] whose
/// credential the deployer makes on first use, kept as `TAG.conf` in `dir`.
pub struct RemoteConnector {
    deployer: Arc<Remote>,
    dir: PathBuf,
    observer: Option<Observer>,
}

/// What [`RemoteConnector::observing`] is given.
pub type Observer = Box<dyn Fn(&MachineView) + Send + Sync>;

impl RemoteConnector {
    pub fn new(deployer: Arc<Remote>, dir: PathBuf) -> RemoteConnector {
        RemoteConnector {
            deployer,
            dir,
            observer: None,
        }
    }

    /// Shows `observer` each view of its machine the machine agent reads
    /// (see [`Connector::machine_view`]).
    pub fn observing(mut self, observer: Observer) -> RemoteConnector {
        self.observer = Some(observer);
        self
    }
}

impl Connector for RemoteConnector {
    fn connect(&self, tag: &Tag) -> Arc<dyn Facade> {
        Arc::new(Remote::deferred(
            self.deployer.clone(),
            tag.clone(),
            self.dir.join(format!("{tag}.conf")),
        ))
    }

    fn machine_view(&self, view: &MachineView) {
        if let Some(observer) = &self.observer {
            observer(view);
        }
    }
}

/// A user's client of the controller: the client facade
/// ([`jujube_wire::client`]) over the same kind of connection an agent
/// has — HTTP/2, TLS trusting only the environment's CA.
pub struct UserClient {
    inner: Inner,
}

impl UserClient {
    /// A client for `user` with `password` at `addresses`; nothing is sent
    /// until the first call.
    pub fn new(
        addresses: &[String],
        ca_cert: &str,
        user: &str,
        password: &str,
    ) -> ApiResult<UserClient> {
        use base64::Engine;
        // A user's name goes in a header as it is (names are plain), its
        // password as base64, whatever characters it holds.
        jujube_core::names::validate_user(user)
            .map_err(|e| ApiError::new(ErrorCode::Refused, e.to_string()))?;
        let password = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(password);
        Ok(UserClient {
            inner: Inner {
                addresses: Arc::new(std::sync::RwLock::new(addresses.to_vec())),
                tls: tls_trusting(ca_cert)?,
                who: (jujube_wire::client::USER_HEADER, user.to_string()),
                bearer: Mutex::new(Some(format!("Bearer {password}"))),
                deferred: None,
                conn: Mutex::new(None),
                refused: std::sync::atomic::AtomicBool::new(false),
                start: Default::default(),
                stamp: Mutex::new(None),
            },
        })
    }

    /// Makes `call`; the answer's JSON, or the controller's refusal. A
    /// controller that cannot be reached is `Err` of [`ApiError`].
    pub async fn call(
        &self,
        call: &jujube_wire::client::ClientCall,
    ) -> ApiResult<Result<Bytes, jujube_wire::client::ClientError>> {
        let body = serde_json::to_vec(call).expect("plain data");
        let resend = call.resendable();
        let resp = self
            .inner
            .send(jujube_wire::client::CLIENT_PATH, body, resend)
            .await?;
        // Done (the controller said so) and its answer lost on the way.
        let done = resp.status() == hyper::StatusCode::OK;
        client_answer(resp).await.map_err(|e| {
            if done && !resend && e.code == ErrorCode::Unavailable {
                unanswered(e.message)
            } else {
                e
            }
        })
    }

    /// Makes `call`, handing its answer's JSON to `sink` as it arrives
    /// (a large status is printed while the rest is still on its way);
    /// or the controller's refusal, before any of it. An answer cut short
    /// is `Err` of [`ApiError`] after what arrived of it.
    pub async fn call_into(
        &self,
        call: &jujube_wire::client::ClientCall,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> ApiResult<Result<(), jujube_wire::client::ClientError>> {
        use http_body_util::BodyExt;
        let body = serde_json::to_vec(call).expect("plain data");
        let resp = self
            .inner
            .send(jujube_wire::client::CLIENT_PATH, body, call.resendable())
            .await?;
        if resp.status() != hyper::StatusCode::OK {
            return client_answer(resp).await.map(|r| r.map(|_| ()));
        }
        let mut body = resp.into_body();
        let mut read = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| unavailable(format!("reading the answer: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            read += data.len();
            if read > MAX_CLIENT_REPLY {
                return Err(unavailable(format!(
                    "reading the answer: longer than {MAX_CLIENT_REPLY} bytes"
                )));
            }
            sink(&data).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        }
        Ok(Ok(()))
    }

    /// Uploads the charm at `root` (its [`crate::charmdir`] archive);
    /// answers the `upload:ID` a following call names it by.
    pub async fn upload_charm(
        &self,
        root: &std::path::Path,
    ) -> ApiResult<Result<Bytes, jujube_wire::client::ClientError>> {
        let mut body = Vec::new();
        crate::charmdir::write_archive(root, &mut body)?;
        let resp = self
            .inner
            .send(jujube_wire::client::CHARM_PATH, body, true)
            .await?;
        client_answer(resp).await
    }

    /// `jujube register`: trades a registration secret for a password (no
    /// credential is presented).
    pub async fn register(
        &self,
        registration: &jujube_wire::client::Registration,
    ) -> ApiResult<Result<Bytes, jujube_wire::client::ClientError>> {
        let body = serde_json::to_vec(registration).expect("plain data");
        let resp = self
            .inner
            .send(jujube_wire::client::REGISTER_PATH, body, false)
            .await?;
        client_answer(resp).await
    }
}

async fn client_answer(
    resp: hyper::Response<Incoming>,
) -> ApiResult<Result<Bytes, jujube_wire::client::ClientError>> {
    let ok = resp.status() == hyper::StatusCode::OK;
    let bytes = read_at_most(resp.into_body(), MAX_CLIENT_REPLY).await?;
    if ok {
        // The answer's JSON, read by the caller into its type (or passed
        // through).
        return Ok(Ok(bytes));
    }
    match serde_json::from_slice::<jujube_wire::client::ClientError>(&bytes) {
        // Nothing was decided: asked again (of the next controller) as
        // when none could be reached.
        Ok(e) if e.unavailable => Err(ApiError::new(ErrorCode::Unavailable, e.message)),
        Ok(e) => Ok(Err(e)),
        Err(e) => Err(ApiError::new(
            ErrorCode::Internal,
            format!("malformed answer from the controller: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::followed_addresses;

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn an_agent_follows_the_controllers_it_was_given_and_keeps_what_they_do_not_record() {
        let m0 = ["unix:/e/api.socket", "127.0.0.1:17070"];
        // Two controllers added: appended after the ones held.
        let all = v(&[
            "127.0.0.1:17071",
            "unix:/e/api.socket",
            "127.0.0.1:17070",
            "127.0.0.1:17072",
        ]);
        assert_eq!(
            followed_addresses(&v(&m0), &all),
            Some(v(&[
                "unix:/e/api.socket",
                "127.0.0.1:17070",
                "127.0.0.1:17071",
                "127.0.0.1:17072"
            ]))
        );
        // The same set in another order: kept as held.
        let held = v(&["127.0.0.1:17072", "127.0.0.1:17070"]);
        assert_eq!(
            followed_addresses(&held, &v(&["127.0.0.1:17070", "127.0.0.1:17072"])),
            None
        );
        // One gone, one moved to a new port: the one left first.
        assert_eq!(
            followed_addresses(&held, &v(&["127.0.0.1:17070", "127.0.0.1:18072"])),
            Some(v(&["127.0.0.1:17070", "127.0.0.1:18072"]))
        );
        // Nothing learned (an older controller), or nothing in common (an
        // LXD container's proxied socket, an instance's `api-address`).
        assert_eq!(followed_addresses(&v(&m0), &[]), None);
        assert_eq!(
            followed_addresses(&v(&["unix:/var/lib/jujube/api.socket"]), &all),
            None
        );
        assert_eq!(followed_addresses(&v(&["10.0.0.5:17070"]), &all), None);
    }
}
