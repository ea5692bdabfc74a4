//! [`ApiServer`]: accepts agents' connections, authenticates every request,
//! and runs it on the facade scoped to the caller.
//!
//! Bounded by construction ([`Limits`]): request bodies are read up to a
//! size, a connection holds a bounded number of watches, a connection with
//! no request and no watch for the idle time is closed, a TLS handshake must
//! finish in time, and the number of connections is capped. A slow reader
//! cannot make the server buffer: a watch's notices coalesce (only the
//! latest revision is kept) and HTTP/2 flow control stops the server from
//! producing more than the client reads.

use crate::tls;
use crate::{Error, Result};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use jujube_agent::api::{ApiError, ErrorCode, Facade, Notice, Tag};
use jujube_agent::wire::{self, Call, Reply, WatchRequest, CALL_PATH, TAG_HEADER, WATCH_PATH};
use jujube_agent_state::Facades;
use jujube_state::Store;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use tracing::{debug, info};

/// The server's bounds.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The largest request body read; larger is refused (413).
    pub max_request_bytes: usize,
    /// Watches open at once on one connection; more are refused (429).
    pub max_watches_per_connection: usize,
    /// A connection with no request in flight and no watch open for this
    /// long is closed.
    pub idle_timeout: Duration,
    /// The TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// Connections open at once (over both transports, counted from
    /// accept, before the TLS handshake); beyond it, one connection per
    /// listener waits for a slot and further ones wait to be accepted.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_request_bytes: 1 << 20,
            max_watches_per_connection: 256,
            idle_timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            max_connections: 20_000,
        }
    }
}

struct Shared {
    store: Store,
    facades: Arc<Facades>,
    limits: Limits,
    acceptor: tokio_rustls::TlsAcceptor,
    connections: Arc<Semaphore>,
    /// The agent binary served at [`TOOLS_PATH`], with its SHA-256.
    tools: std::sync::OnceLock<(PathBuf, String)>,
    enroller: std::sync::OnceLock<Arc<dyn Enroller>>,
}

/// `GET` [`TOOLS_PATH`] — the `jujube` binary, for instances installing
/// their agent (their boot script checks it against the SHA-256 in their
/// user data, so the download needs no credential). `POST` [`ENROLL_PATH`]
/// — an instance trades its batch's enrollment token and its instance id
/// for its machine's `agent.conf` ([`EnrollRequest`]).
pub use jujube_agent::wire::{ENROLL_PATH, TOOLS_PATH};

/// What an instance sends to enroll.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct EnrollRequest {
    pub token: String,
    pub instance_id: String,
}

/// Checks an enrollment and makes the machine's credential: the
/// controller's business (it knows the provider), not the server's.
#[async_trait::async_trait]
pub trait Enroller: Send + Sync + 'static {
    /// The machine's `agent.conf` (JSON), or why not (the same words for
    /// every refusal that could tell an outsider something).
    async fn enroll(
        &self,
        token: &str,
        instance_id: &str,
    ) -> std::result::Result<Vec<u8>, ApiError>;
}

/// A running API server. Dropping it (or [`ApiServer::stop`]) stops
/// accepting and closes every connection.
pub struct ApiServer {
    tcp: Option<SocketAddr>,
    unix: Option<PathBuf>,
    /// 0 running; 1 stopping (requests in flight get a second); 2 gone.
    stop: watch::Sender<u8>,
    shared: Arc<Shared>,
}

impl ApiServer {
    /// Listens on `tcp` (port 0 picks a free one) and/or the unix socket
    /// `unix` (a stale socket file is replaced), serving the facades of
    /// `store`. The TLS files must exist ([`tls::ensure`]).
    pub async fn start(
        env_dir: &Path,
        store: Store,
        facades: Arc<Facades>,
        tcp: Option<&str>,
        unix: Option<&Path>,
        limits: Limits,
    ) -> Result<ApiServer> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls::server_config(env_dir)?);
        let shared = Arc::new(Shared {
            store,
            facades,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            acceptor,
            tools: std::sync::OnceLock::new(),
            enroller: std::sync::OnceLock::new(),
        });
        let (stop, stopped) = watch::channel(0u8);
        let mut tcp_addr = None;
        if let Some(addr) = tcp {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen {
                    address: addr.to_string(),
                    source,
                })?;
            tcp_addr = Some(listener.local_addr().map_err(|source| Error::Listen {
                address: addr.to_string(),
                source,
            })?);
            let (shared, stopped) = (shared.clone(), stopped.clone());
            tokio::spawn(async move {
                accept_loop(shared, stopped, || async {
                    let (s, _) = listener.accept().await?;
                    let _ = s.set_nodelay(true);
                    Ok(s)
                })
                .await
            });
        }
        if let Some(path) = unix {
            let _ = std::fs::remove_file(path);
            let listener =
                tokio::net::UnixListener::bind(path).map_err(|source| Error::Listen {
                    address: path.display().to_string(),
                    source,
                })?;
            let (shared, stopped) = (shared.clone(), stopped.clone());
            tokio::spawn(async move {
                accept_loop(shared, stopped, || async {
                    let (s, _) = listener.accept().await?;
                    Ok(s)
                })
                .await
            });
        }
        info!(tcp = ?tcp_addr, unix = ?unix, "API server listening");
        Ok(ApiServer {
            tcp: tcp_addr,
            unix: unix.map(Path::to_path_buf),
            stop,
            shared,
        })
    }

    /// Serves `binary` at [`TOOLS_PATH`] from now on; returns its SHA-256
    /// (hex), which instances check the download against.
    pub fn serve_tools(&self, binary: &Path) -> std::io::Result<String> {
        let sum = jujube_agent::wire::sha256_hex(&std::fs::read(binary)?);
        let _ = self.shared.tools.set((binary.to_path_buf(), sum.clone()));
        Ok(sum)
    }

    /// Answers [`ENROLL_PATH`] with `enroller` from now on.
    pub fn enroll_with(&self, enroller: Arc<dyn Enroller>) {
        let _ = self.shared.enroller.set(enroller);
    }

    /// The TCP address it listens on (the port chosen when 0 was asked).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp
    }

    pub fn unix_path(&self) -> Option<&Path> {
        self.unix.as_deref()
    }

    /// The addresses to give agents, in the form `agent.conf` takes.
    pub fn addresses(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(p) = &self.unix {
            out.push(format!("unix:{}", p.display()));
        }
        if let Some(a) = self.tcp {
            out.push(a.to_string());
        }
        out
    }

    /// Stops accepting; requests in flight get a second, then every
    /// connection (watches included) is dropped.
    pub fn stop(&self) {
        self.stop.send_replace(1);
    }
}

impl Drop for ApiServer {
    /// Drops every connection at once.
    fn drop(&mut self) {
        self.stop.send_replace(2);
        if let Some(p) = &self.unix {
            let _ = std::fs::remove_file(p);
        }
    }
}

async fn accept_loop<IO, F, Fut>(shared: Arc<Shared>, mut stopped: watch::Receiver<u8>, accept: F)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::io::Result<IO>>,
{
    loop {
        let io = tokio::select! {
            io = accept() => io,
            _ = stopped.changed() => return,
        };
        match io {
            Ok(io) => {
                // A slot is taken for a connection accepted, never held by
                // a listener waiting for one: the listeners share the cap,
                // and an idle one holding a slot would leave the other a
                // slot short (with a cap of one, starved). Beyond the cap,
                // this connection waits here, its handshake not begun, and
                // further ones wait in the kernel to be accepted.
                let permit = tokio::select! {
                    p = shared.connections.clone().acquire_owned() => p.expect("never closed"),
                    _ = stopped.changed() => return,
                };
                let (shared, stopped) = (shared.clone(), stopped.clone());
                tokio::spawn(async move {
                    serve_connection(shared, io, stopped).await;
                    drop(permit);
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin.
                debug!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// What the idle timer watches on one connection.
struct Activity {
    in_flight: AtomicUsize,
    watches: AtomicUsize,
    last: Mutex<Instant>,
    /// The tag and the hash of the secret this connection last proved (never
    /// the secret itself), so that the store
    /// is asked once per connection and credential (as a Juju agent logs in
    /// once per connection). A removed entity still loses everything at
    /// once: its facade refuses every call about it.
    proven: Mutex<Option<(String, String)>>,
}

impl Activity {
    fn touch(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Resolves once the connection has been idle for `idle`.
    async fn idle(&self, idle: Duration) {
        loop {
            let busy = self.in_flight.load(Ordering::Acquire) > 0
                || self.watches.load(Ordering::Acquire) > 0;
            let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
            if !busy && last.elapsed() >= idle {
                return;
            }
            let wait = if busy {
                idle
            } else {
                idle.saturating_sub(last.elapsed())
            };
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

/// Counts down on drop: a request in flight, or a watch held open by its
/// response body.
struct Held(Arc<Activity>, fn(&Activity) -> &AtomicUsize);

impl Drop for Held {
    fn drop(&mut self) {
        (self.1)(&self.0).fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

async fn serve_connection<IO>(shared: Arc<Shared>, io: IO, mut stopped: watch::Receiver<u8>)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let tls =
        match tokio::time::timeout(shared.limits.handshake_timeout, shared.acceptor.accept(io))
            .await
        {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                debug!("TLS handshake refused: {e}");
                return;
            }
            Err(_) => {
                debug!("TLS handshake timed out");
                return;
            }
        };
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        watches: AtomicUsize::new(0),
        last: Mutex::new(Instant::now()),
        proven: Mutex::new(None),
    });
    let svc = {
        let (shared, activity) = (shared.clone(), activity.clone());
        hyper::service::service_fn(move |req| {
            let (shared, activity) = (shared.clone(), activity.clone());
            async move { Ok::<_, Infallible>(handle(shared, activity, req).await) }
        })
    };
    // Agents speak HTTP/2; HTTP/1.1 is there for an instance's boot script
    // (busybox or curl fetching the binary and enrolling).
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(shared.limits.max_watches_per_connection as u32 + 64)
        .max_header_list_size(16 << 10);
    builder
        .http1()
        .timer(TokioTimer::new())
        .max_buf_size(64 << 10);
    let conn = builder.serve_connection(TokioIo::new(tls), svc);
    tokio::pin!(conn);
    let mut closing = false;
    // When the server stops, requests in flight get a moment to finish;
    // then the connection is dropped, watches included (they never finish
    // by themselves, and their clients resume them on the next server).
    let mut cut_at: Option<Instant> = None;
    loop {
        let cut = async {
            match cut_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = activity.idle(shared.limits.idle_timeout), if !closing => {
                debug!("closing an idle connection");
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = stopped.changed() => {
                if *stopped.borrow() >= 2 {
                    return;
                }
                if !closing {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
                cut_at = Some(Instant::now() + Duration::from_secs(1));
            }
            _ = cut => return,
        }
    }
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

fn reply(status: StatusCode, r: &Reply) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(r).expect("plain data"))).boxed_unsync())
        .expect("a valid response")
}

fn refuse(e: ApiError) -> Response<Body> {
    let status = match e.code {
        ErrorCode::Unauthorized => StatusCode::FORBIDDEN,
        ErrorCode::Refused => StatusCode::CONFLICT,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    };
    reply(status, &Reply::Error(e))
}

/// Who is calling, proven: the tag and the secret checked against the
/// stored hash. Every failure answers the same, so that it tells nothing
/// about which agents exist.
async fn authenticate(
    shared: &Shared,
    activity: &Activity,
    req: &Request<Incoming>,
) -> std::result::Result<Tag, Response<Body>> {
    let denied = |tag: &str| {
        let e = ApiError::new(
            ErrorCode::Unauthorized,
            format!(
                "invalid credentials for agent `{tag}`; check the `secret` in its `agent.conf`"
            ),
        );
        reply(StatusCode::UNAUTHORIZED, &Reply::Error(e))
    };
    let tag_text = req
        .headers()
        .get(TAG_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let shown: String = tag_text.chars().take(64).collect();
    let Ok(tag) = tag_text.parse::<Tag>() else {
        return Err(denied(&shown));
    };
    let secret = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .to_string();
    let proven = activity
        .proven
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|(t, h)| *t == tag_text && wire::secret_matches(&secret, h));
    if proven {
        return Ok(tag);
    }
    let store = shared.store.clone();
    let key = tag.to_string();
    let hash = tokio::task::spawn_blocking(move || store.agent_credential(&key))
        .await
        .ok()
        .and_then(|r| r.ok())
        .flatten();
    match hash {
        Some(h) if !secret.is_empty() && wire::secret_matches(&secret, &h) => {
            *activity.proven.lock().unwrap_or_else(|e| e.into_inner()) = Some((tag_text, h));
            Ok(tag)
        }
        _ => Err(denied(&shown)),
    }
}

async fn read_body(shared: &Shared, body: Incoming) -> std::result::Result<Bytes, Response<Body>> {
    match http_body_util::Limited::new(body, shared.limits.max_request_bytes)
        .collect()
        .await
    {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            &Reply::Error(ApiError::new(
                ErrorCode::Refused,
                format!(
                    "request larger than {} bytes, or cut short",
                    shared.limits.max_request_bytes
                ),
            )),
        )),
    }
}

async fn handle(
    shared: Arc<Shared>,
    activity: Arc<Activity>,
    req: Request<Incoming>,
) -> Response<Body> {
    activity.in_flight.fetch_add(1, Ordering::AcqRel);
    let _held = Held(activity.clone(), |a| &a.in_flight);
    activity.touch();
    if req.method() == hyper::Method::GET && req.uri().path() == TOOLS_PATH {
        return tools(&shared).await;
    }
    if req.method() == hyper::Method::POST && req.uri().path() == ENROLL_PATH {
        return enroll(&shared, req).await;
    }
    if req.method() != hyper::Method::POST || ![CALL_PATH, WATCH_PATH].contains(&req.uri().path()) {
        return reply(
            StatusCode::NOT_FOUND,
            &Reply::Error(ApiError::new(
                ErrorCode::Refused,
                format!("no such endpoint `{} {}`", req.method(), req.uri().path()),
            )),
        );
    }
    let tag = match authenticate(&shared, &activity, &req).await {
        Ok(t) => t,
        Err(resp) => return resp,
    };
    let watch = req.uri().path() == WATCH_PATH;
    let body = match read_body(&shared, req.into_body()).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let facade = shared.facades.for_agent(tag.clone());
    if watch {
        let Ok(w) = serde_json::from_slice::<WatchRequest>(&body) else {
            return refuse(ApiError::new(ErrorCode::Refused, "malformed watch request"));
        };
        return open_watch(&shared, &activity, &*facade, w).await;
    }
    let Ok(call) = serde_json::from_slice::<Call>(&body) else {
        return refuse(ApiError::new(ErrorCode::Refused, "malformed call"));
    };
    debug!(agent = %tag, method = call.method(), "call");
    let result = match call {
        Call::SetUnitCredential { unit, secret } => {
            set_unit_credential(&shared, &tag, unit, secret).await
        }
        call => wire::dispatch(&*facade, call).await,
    };
    match result {
        Ok(v) => reply(StatusCode::OK, &Reply::Ok(v)),
        Err(e) => refuse(e),
    }
}

/// The agent binary, whole (the server reads it for each download: they
/// are one per instance, at its first boot).
async fn tools(shared: &Shared) -> Response<Body> {
    let Some((path, sum)) = shared.tools.get() else {
        return refuse(ApiError::new(
            ErrorCode::Refused,
            "this controller serves no agent binary",
        ));
    };
    match tokio::fs::read(path).await {
        Ok(bytes) => Response::builder()
            .status(StatusCode::OK)
            .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
            .header("x-jujube-sha256", sum.as_str())
            .body(Full::new(Bytes::from(bytes)).boxed_unsync())
            .expect("a valid response"),
        Err(e) => refuse(ApiError::new(
            ErrorCode::Internal,
            format!("cannot read the agent binary: {e}"),
        )),
    }
}

/// An instance enrolls: its batch's token and its instance id for its
/// machine's `agent.conf`.
async fn enroll(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let body = match read_body(shared, req.into_body()).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let Ok(r) = serde_json::from_slice::<EnrollRequest>(&body) else {
        return refuse(ApiError::new(
            ErrorCode::Refused,
            "malformed enrollment: expected {\"token\": ..., \"instance-id\": ...}",
        ));
    };
    let Some(enroller) = shared.enroller.get() else {
        return refuse(ApiError::new(
            ErrorCode::Refused,
            "this controller enrolls no instances",
        ));
    };
    match enroller.enroll(&r.token, &r.instance_id).await {
        Ok(conf) => Response::builder()
            .status(StatusCode::OK)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(conf)).boxed_unsync())
            .expect("a valid response"),
        Err(e) => refuse(e),
    }
}

/// A deployer sets the credential of a unit it deploys: a machine agent for
/// the units on its machine (its principals and their subordinates, which
/// run there too), a unit agent for its own subordinates. Nothing else: the
/// answer for any other unit, or one that does not exist, is the same
/// refusal.
async fn set_unit_credential(
    shared: &Shared,
    caller: &Tag,
    unit: String,
    secret: String,
) -> Result<serde_json::Value, ApiError> {
    if secret.len() < 32 {
        return Err(ApiError::new(
            ErrorCode::Refused,
            "an agent secret must be at least 32 characters (use 32 random bytes)",
        ));
    }
    let (store, caller_, unit_) = (shared.store.clone(), caller.clone(), unit.clone());
    let hash = wire::secret_hash(&secret);
    let done = tokio::task::spawn_blocking(move || -> jujube_state::Result<bool> {
        let Ok(u) = store.unit(&unit_) else {
            return Ok(false);
        };
        let deploys = match (&caller_, &u.principal) {
            (Tag::Unit(me), Some(p)) => p == me,
            (Tag::Unit(_), None) => false,
            (Tag::Machine(m), None) => u.machine_id == Some(*m),
            (Tag::Machine(m), Some(p)) => store
                .unit(p)
                .map(|p| p.machine_id == Some(*m))
                .unwrap_or(false),
        };
        if deploys {
            store.set_unit_credential(&unit_, &Tag::Unit(unit_.clone()).to_string(), &hash)?;
        }
        Ok(deploys)
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
    if !done {
        return Err(ApiError::unauthorized(
            caller,
            format_args!("set the credential of unit `{unit}`"),
        ));
    }
    Ok(serde_json::Value::Null)
}

async fn open_watch(
    shared: &Shared,
    activity: &Arc<Activity>,
    facade: &dyn Facade,
    w: WatchRequest,
) -> Response<Body> {
    let max = shared.limits.max_watches_per_connection;
    if activity.watches.fetch_add(1, Ordering::AcqRel) >= max {
        activity.watches.fetch_sub(1, Ordering::AcqRel);
        return reply(
            StatusCode::TOO_MANY_REQUESTS,
            &Reply::Error(ApiError::new(
                ErrorCode::Unavailable,
                format!("too many watches on one connection (at most {max})"),
            )),
        );
    }
    let held = Held(activity.clone(), |a| &a.watches);
    // Subscribe first, then look at what happened since the client's last
    // revision: nothing falls between the two.
    let stream = match facade.watch(w.target).await {
        Ok(s) => s,
        Err(e) => return refuse(e),
    };
    // The head revision at subscription goes back as a header: a client
    // resuming later names it (or a later notice's), and is told of anything
    // it missed in between.
    let store = shared.store.clone();
    let since = w.since;
    let looked = tokio::task::spawn_blocking(move || {
        let head = store.head_revision()?;
        let missed = if since > 0 {
            Some(store.changes_since(since, 1)?)
        } else {
            None
        };
        Ok::<_, jujube_state::Error>((head, missed))
    })
    .await;
    let (head, first) = match looked {
        Ok(Ok((head, Some(changes)))) if changes.truncated => (
            head,
            Some(Notice {
                revision: head,
                resync: true,
            }),
        ),
        // Notices say "re-read": one covers every change missed.
        Ok(Ok((head, Some(changes)))) if !changes.changes.is_empty() => (
            head,
            Some(Notice {
                revision: head,
                resync: false,
            }),
        ),
        Ok(Ok((head, _))) => (head, None),
        _ => {
            return refuse(ApiError::new(
                ErrorCode::Unavailable,
                "cannot read the change feed; try again",
            ))
        }
    };
    let notices = futures_util::stream::iter(first).chain(stream);
    let frames = notices.map(move |n| {
        let _ = &held; // the watch counts until its body is dropped
        let mut line = serde_json::to_vec(&n).expect("plain data");
        line.push(b'\n');
        Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/x-ndjson")
        .header(wire::REVISION_HEADER, head.to_string())
        .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
        .expect("a valid response")
}
