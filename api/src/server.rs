//! [`ApiServer`]: accepts agents' connections, authenticates every request,
//! and runs it on the facade scoped to the caller.
//!
//! Bounded by construction ([`Limits`]): request bodies are read up to a
//! size, a connection holds a bounded number of watches, a connection with
//! no request and no watch for the idle time is closed (one that never
//! proved a credential much sooner), a TLS handshake must finish in time,
//! and the number of connections is capped — in all, per peer address while
//! unauthenticated, and per credential. A slow reader cannot make the
//! server buffer: a watch's notices coalesce (only the latest revision is
//! kept), HTTP/2 flow control stops the server from producing more than the
//! client reads, the answers a connection has not read yet share a byte
//! budget (a call waits for room before it runs), and the tools binary is
//! read from disk as it is sent.

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
use tracing::{debug, info, warn};

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
    /// [`ApiServer::start`] lowers it to three quarters of the process's
    /// open-files limit, so that the cap acts before descriptors run out.
    pub max_connections: usize,
    /// Connections from one peer address (a unix socket's peers count as
    /// one) that have not proved a credential yet, handshakes included;
    /// beyond it a new one is closed at once.
    pub max_unauthenticated_per_peer: usize,
    /// A connection that has not proved a credential within this long
    /// after it opened is closed, whatever it sent meanwhile (requests that
    /// need no credential do not extend it; one in flight is cut), except
    /// while the server checks a credential it presented (the check may
    /// wait on the store), and while it downloads the agent binary and the
    /// download moves: then it is closed once the download ends, or stalls
    /// for this long.
    pub unauthenticated_timeout: Duration,
    /// Connections one credential may hold open at once (an agent needs
    /// one); a call on one more is refused (429).
    pub max_connections_per_credential: usize,
    /// Bytes of answers a connection may hold unread: a call waits for
    /// room before it runs, so an agent that sends calls and reads nothing
    /// costs the server this much, not a copy of every answer.
    pub max_unread_bytes_per_connection: usize,
    /// An HTTP/2 connection is pinged after this long without traffic and
    /// closed when a ping goes unanswered for as long: an agent that is
    /// frozen or gone (its socket still open) loses its connection, and so
    /// its presence.
    pub keepalive: Duration,
    /// How often the agents holding proven connections are noted as seen
    /// in the store (`status` shows one unseen for a minute as `down`).
    pub presence_every: Duration,
    /// Answers of the whole model (`status`: a snapshot of every machine,
    /// service and unit, then its JSON streamed) being made or sent at
    /// once, over all users. Each holds its snapshot until its client has
    /// read the JSON, so this, not the number of callers, bounds the memory
    /// they take. More wait for a turn, at most
    /// [`crate::clients::MAX_WAITING_WHOLE_MODEL`] of them; beyond that
    /// they are told to try again (503).
    pub max_whole_model_answers: usize,
    /// Of those, one user's at once: one more while they are made or sent
    /// is refused (429), so that a user cannot take every turn.
    pub max_whole_model_answers_per_user: usize,
    /// The longest a streamed answer may take to be read whole (a client
    /// reading one chunk just before each [`crate::clients::STREAM_STALL`]
    /// would hold its turn for an hour); past it the answer is cut off and
    /// its client told so.
    pub stream_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_request_bytes: 1 << 20,
            max_watches_per_connection: 256,
            idle_timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            max_connections: 20_000,
            max_unauthenticated_per_peer: 256,
            unauthenticated_timeout: Duration::from_secs(15),
            max_connections_per_credential: 8,
            max_unread_bytes_per_connection: 24 << 20,
            keepalive: Duration::from_secs(15),
            presence_every: Duration::from_secs(jujube_state::credentials::PRESENCE_EVERY as u64),
            max_whole_model_answers: 2,
            max_whole_model_answers_per_user: 1,
            stream_deadline: Duration::from_secs(600),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) store: Store,
    facades: Arc<Facades>,
    pub(crate) limits: Limits,
    /// Users' calls, once the controller hands a handler over.
    pub(crate) clients: Option<Arc<dyn crate::clients::ClientHandler>>,
    /// Where charms users upload are kept (the environment's `charms`).
    pub(crate) charms_dir: PathBuf,
    /// Password checks running at once (see [`crate::clients`]).
    pub(crate) checks: Semaphore,
    /// Logins and registrations waiting for one of those.
    pub(crate) checks_waiting: AtomicUsize,
    /// Turns for answers of the whole model (see
    /// [`Limits::max_whole_model_answers`]), the calls waiting for one, and
    /// per user those holding one.
    pub(crate) whole_model: Arc<Semaphore>,
    pub(crate) whole_model_waiting: AtomicUsize,
    pub(crate) whole_model_per_user: Arc<Mutex<std::collections::HashMap<String, usize>>>,
    acceptor: tokio_rustls::TlsAcceptor,
    connections: Arc<Semaphore>,
    /// The agent binary served at [`TOOLS_PATH`], with its SHA-256.
    tools: std::sync::OnceLock<(PathBuf, String)>,
    enroller: std::sync::OnceLock<Arc<dyn Enroller>>,
    /// Per peer address: connections not yet proven.
    unproven: Mutex<std::collections::HashMap<String, usize>>,
    /// Per credential (tag): connections that proved it.
    per_credential: Mutex<std::collections::HashMap<String, usize>>,
    /// Tags whose refused secrets were last noted in the store, and when.
    refusals: Mutex<std::collections::HashMap<String, Instant>>,
}

/// `GET` [`TOOLS_PATH`] — the `jujube` binary, for instances installing
/// their agent (their boot script checks it against the SHA-256 in their
/// user data, so the download needs no credential). `POST` [`ENROLL_PATH`]
/// — an instance trades its batch's enrollment token and its signed identity
/// for its machine's `agent.conf` ([`EnrollRequest`]).
pub use jujube_agent::wire::{EnrollRequest, ENROLL_PATH, MAX_ENROLL_BYTES, TOOLS_PATH};

/// An instance's proof of identity, as the provider's metadata service
/// gave it (EC2: the instance identity document and its signature), and
/// the address its enrollment came from.
#[derive(Debug, Clone)]
pub struct Identity {
    pub document: Vec<u8>,
    pub signature: String,
    /// The peer's IP address (`unix` for the unix socket).
    pub peer: String,
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
        identity: &Identity,
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
    /// `store`, and users with `clients` where given. The TLS files must
    /// exist ([`tls::ensure`]).
    ///
    /// Users' handler is given here, not set later: a user's command that
    /// reaches a starting controller the moment it listens (the CLI waits
    /// for it while its lock is held) is answered, never told that this
    /// server does not serve users.
    pub async fn start(
        env_dir: &Path,
        store: Store,
        facades: Arc<Facades>,
        tcp: Option<&str>,
        unix: Option<&Path>,
        limits: Limits,
        clients: Option<Arc<dyn crate::clients::ClientHandler>>,
    ) -> Result<ApiServer> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls::server_config(env_dir)?);
        let mut limits = limits;
        let files = open_files_limit();
        let fitting = files.saturating_mul(3) / 4;
        if limits.max_connections > fitting {
            info!(
                asked = limits.max_connections,
                open_files = files,
                cap = fitting,
                "API connections capped below the open-files limit"
            );
            limits.max_connections = fitting.max(1);
        }
        let whole_model = Arc::new(Semaphore::new(limits.max_whole_model_answers));
        let shared = Arc::new(Shared {
            store,
            facades,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            acceptor,
            tools: std::sync::OnceLock::new(),
            enroller: std::sync::OnceLock::new(),
            clients,
            checks: crate::clients::checks(),
            checks_waiting: AtomicUsize::new(0),
            whole_model,
            whole_model_waiting: AtomicUsize::new(0),
            whole_model_per_user: Arc::default(),
            charms_dir: env_dir.join("charms"),
            unproven: Mutex::default(),
            per_credential: Mutex::default(),
            refusals: Mutex::default(),
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
                    let (s, peer) = listener.accept().await?;
                    let _ = s.set_nodelay(true);
                    Ok((s, peer.ip().to_string()))
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
                    Ok((s, "unix".to_string()))
                })
                .await
            });
        }
        {
            // Presence: who holds a proven connection now is noted in the
            // store every `presence_every`, in bounded transactions.
            let (shared, mut stopped) = (shared.clone(), stopped.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(shared.limits.presence_every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stopped.changed() => return,
                    }
                    let tags: Vec<String> = shared
                        .per_credential
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .keys()
                        .cloned()
                        .collect();
                    // Then services whose leader was lost get another.
                    let store = shared.store.clone();
                    let noted = tokio::task::spawn_blocking(move || {
                        if !tags.is_empty() {
                            store.note_agents_seen(&tags, unix_now())?;
                        }
                        store.elect_leaders(LEADERS_PER_BEAT)
                    })
                    .await;
                    match noted {
                        Ok(Err(e)) => warn!("cannot note the agents seen or elect leaders: {e}"),
                        Ok(Ok(n)) if n > 0 => info!(services = n, "leaders elected"),
                        _ => {}
                    }
                }
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
        let sum = sha256_file(binary)?;
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

impl ApiServer {
    /// Stops at once, as dropping does, and returns when every connection
    /// is closed (handshakes included): nothing this server sends can reach
    /// a client afterwards.
    pub async fn shutdown(self) {
        self.stop.send_replace(2);
        // Every task of the server holds a receiver: the listeners, the
        // presence beat and each connection.
        self.stop.closed().await;
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
    Fut: std::future::Future<Output = std::io::Result<(IO, String)>>,
{
    loop {
        let io = tokio::select! {
            io = accept() => io,
            _ = stopped.changed() => return,
        };
        match io {
            Ok((io, peer)) => {
                // One peer may not hold more than its share of unproven
                // connections (an idle TLS flood from one address).
                let Some(unproven) = Unproven::take(&shared, &peer) else {
                    refused_peer(&peer, shared.limits.max_unauthenticated_per_peer);
                    continue;
                };
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
                    serve_connection(shared, io, stopped, unproven).await;
                    drop(permit);
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin, and
                // say so (the connection cap should have acted first).
                warn!("accepting an API connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The process's soft limit on open files, raised to the hard limit first
/// (a controller serves thousands of agents; the default soft limit of
/// 1,024 would make the connection cap meaningless).
fn open_files_limit() -> usize {
    // SAFETY: getrlimit/setrlimit on this process, with a valid struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    }
}

/// A refused peer is logged above DEBUG, at most once a second (a flood
/// must not flood the log too).
fn refused_peer(peer: &str, max: usize) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
        *last = Some(Instant::now());
        warn!(
            peer,
            max, "refused an API connection: its peer holds too many unauthenticated connections"
        );
    }
}

/// A connection counted against its peer's unproven connections until it
/// proves a credential (or closes).
struct Unproven {
    shared: Arc<Shared>,
    peer: Option<String>,
}

impl Unproven {
    fn take(shared: &Arc<Shared>, peer: &str) -> Option<Unproven> {
        let mut m = shared.unproven.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(peer.to_string()).or_default();
        if *n >= shared.limits.max_unauthenticated_per_peer {
            return None;
        }
        *n += 1;
        Some(Unproven {
            shared: shared.clone(),
            peer: Some(peer.to_string()),
        })
    }

    /// The connection proved a credential: it no longer counts.
    fn proven(&mut self) {
        if let Some(peer) = self.peer.take() {
            release(&self.shared.unproven, &peer);
        }
    }
}

impl Drop for Unproven {
    fn drop(&mut self) {
        self.proven();
    }
}

/// What the idle timer watches on one connection.
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    watches: AtomicUsize,
    /// Downloads of the agent binary under way (each touches `last` as it
    /// sends).
    downloads: AtomicUsize,
    /// Credentials being checked against the store: the server's own work,
    /// which may wait on the store (a controller cut off from its database
    /// answers "unavailable" when the check gives up, and the client moves
    /// to another controller); the unproven deadline waits for it.
    checking: AtomicUsize,
    /// When the connection was taken (after its TLS handshake): the
    /// unproven deadline counts from here.
    opened: Instant,
    last: Mutex<Instant>,
    /// The credential this connection last proved (never the secret
    /// itself), so that the store is not asked on every call; it is asked
    /// again when the store's credential epoch moved (a credential set or
    /// replaced) and at least every [`RECHECK`], so a replaced or removed
    /// credential stops working on a connection that logged in with it.
    proven: Mutex<Option<Proven>>,
    /// The user this connection last proved (see [`crate::clients`]).
    pub(crate) user: Mutex<Option<crate::clients::ProvenUser>>,
    /// Set when the connection's credential was found replaced or removed:
    /// the connection is closed.
    revoked: tokio::sync::Notify,
    /// Until a credential is proven here: its place among its peer's
    /// unproven connections.
    unproven: Mutex<Option<Unproven>>,
    /// The credential this connection counts against (see
    /// [`Limits::max_connections_per_credential`]).
    counted: Mutex<Option<String>>,
    /// Room for answers not yet read (KiB).
    unread: Arc<Semaphore>,
    /// The peer's IP address (`unix` on the unix socket).
    peer: Arc<str>,
    shared: Arc<Shared>,
}

impl Drop for Activity {
    fn drop(&mut self) {
        let counted = self.counted.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(tag) = counted.take() {
            release(&self.shared.per_credential, &tag);
        }
    }
}

/// Counts one connection less under `key`.
fn release(counts: &Mutex<std::collections::HashMap<String, usize>>, key: &str) {
    let mut m = counts.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = m.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            m.remove(key);
        }
    }
}

impl Activity {
    /// A credential (an agent's or a user's) was proved here: the
    /// connection no longer counts among its peer's unproven ones.
    pub(crate) fn proven_user(&self) {
        if let Some(mut u) = self
            .unproven
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            u.proven();
        }
    }

    fn touch(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Counts one more under `counter` (requests in flight, downloads,
    /// credential checks) until the guard is dropped.
    fn hold(self: &Arc<Self>, counter: fn(&Activity) -> &AtomicUsize) -> Held {
        counter(self).fetch_add(1, Ordering::AcqRel);
        Held(self.clone(), counter)
    }

    /// A credential check under way, until the guard is dropped (see
    /// [`Activity::checking`]).
    pub(crate) fn checking(self: &Arc<Self>) -> Held {
        self.hold(|a| &a.checking)
    }

    /// Counts this connection against `tag`'s connections (once); false
    /// when `tag` holds too many already.
    fn count_for(&self, tag: &str) -> bool {
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        if counted.as_deref() == Some(tag) {
            return true;
        }
        let mut m = self
            .shared
            .per_credential
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let n = m.entry(tag.to_string()).or_default();
        if *n >= self.shared.limits.max_connections_per_credential {
            return false;
        }
        *n += 1;
        drop(m);
        if let Some(old) = counted.replace(tag.to_string()) {
            release(&self.shared.per_credential, &old);
        }
        self.proven_user();
        true
    }

    /// Resolves once the connection has been idle for `idle`; or, while it
    /// has proven no credential, once `unproven` has passed since it
    /// opened (see [`Limits::unauthenticated_timeout`]), with true: what
    /// it has in flight is to be cut, not waited for.
    async fn idle(&self, idle: Duration, unproven: Duration) -> bool {
        loop {
            let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
            if self
                .unproven
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
            {
                let open = self.opened.elapsed();
                let downloading = self.downloads.load(Ordering::Acquire) > 0;
                let checking = self.checking.load(Ordering::Acquire) > 0;
                if open >= unproven && !checking && (!downloading || last.elapsed() >= unproven) {
                    return true;
                }
                let wait = if open < unproven {
                    unproven - open
                } else {
                    unproven.saturating_sub(last.elapsed())
                };
                // At most `idle`: a credential proven meanwhile puts the
                // connection under the idle rule soon.
                tokio::time::sleep(wait.min(idle).max(Duration::from_millis(10))).await;
                continue;
            }
            let busy = self.in_flight.load(Ordering::Acquire) > 0
                || self.watches.load(Ordering::Acquire) > 0;
            if !busy && last.elapsed() >= idle {
                return false;
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

/// How long a connection's proven credential is trusted without asking the
/// store (changes made through this controller's store are seen at once).
const RECHECK: Duration = Duration::from_secs(5);

struct Proven {
    tag: String,
    hash: String,
    epoch: u64,
    at: Instant,
}

/// Counts down on drop: a request in flight, a download, a credential
/// check, or a watch held open by its response body.
pub(crate) struct Held(Arc<Activity>, fn(&Activity) -> &AtomicUsize);

impl Drop for Held {
    fn drop(&mut self) {
        (self.1)(&self.0).fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

async fn serve_connection<IO>(
    shared: Arc<Shared>,
    io: IO,
    mut stopped: watch::Receiver<u8>,
    unproven: Unproven,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // A server stopping does not wait for a handshake to run out its time.
    let handshake =
        tokio::time::timeout(shared.limits.handshake_timeout, shared.acceptor.accept(io));
    let tls = tokio::select! {
        r = handshake => match r {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                debug!("TLS handshake refused: {e}");
                return;
            }
            Err(_) => {
                debug!("TLS handshake timed out");
                return;
            }
        },
        _ = stopped.changed() => return,
    };
    let peer: Arc<str> = unproven.peer.as_deref().unwrap_or("").into();
    let activity = Arc::new(Activity {
        peer,
        in_flight: AtomicUsize::new(0),
        watches: AtomicUsize::new(0),
        downloads: AtomicUsize::new(0),
        checking: AtomicUsize::new(0),
        opened: Instant::now(),
        last: Mutex::new(Instant::now()),
        proven: Mutex::new(None),
        user: Mutex::new(None),
        revoked: tokio::sync::Notify::new(),
        unproven: Mutex::new(Some(unproven)),
        counted: Mutex::new(None),
        unread: Arc::new(Semaphore::new(
            (shared.limits.max_unread_bytes_per_connection >> 10).max(1),
        )),
        shared: shared.clone(),
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
        .keep_alive_interval(Some(shared.limits.keepalive))
        .keep_alive_timeout(shared.limits.keepalive)
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
            _ = activity.revoked.notified() => {
                // The refusal goes out first; then the connection, watches
                // included, is gone.
                info!("closing a connection whose credential was replaced or removed");
                if !closing {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
                cut_at = Some(Instant::now() + Duration::from_secs(1));
            }
            cut = activity.idle(shared.limits.idle_timeout, shared.limits.unauthenticated_timeout), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
                if cut {
                    debug!("closing a connection that proved no credential in time");
                    cut_at = Some(Instant::now() + Duration::from_millis(100));
                } else {
                    debug!("closing an idle connection");
                }
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

/// A response's body. Its error cuts an answer short in the middle (the
/// client sees the stream reset, never a truncated answer that looks whole).
pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// For bodies that cannot fail.
pub(crate) fn never(e: Infallible) -> std::io::Error {
    match e {}
}

fn reply(status: StatusCode, r: &Reply) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(
            Full::new(Bytes::from(serde_json::to_vec(r).expect("plain data")))
                .map_err(never)
                .boxed_unsync(),
        )
        .expect("a valid response")
}

fn status_of(e: &ApiError) -> StatusCode {
    match e.code {
        ErrorCode::Unauthorized => StatusCode::FORBIDDEN,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::Refused | ErrorCode::Superseded => StatusCode::CONFLICT,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        // Unanswered is the client's own finding; never the server's.
        ErrorCode::Internal | ErrorCode::Unanswered => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn refuse(e: ApiError) -> Response<Body> {
    reply(status_of(&e), &Reply::Error(e))
}

/// Who is calling, proven: the tag and the secret checked against the
/// stored hash. Every failure answers the same, so that it tells nothing
/// about which agents exist.
async fn authenticate(
    shared: &Shared,
    activity: &Arc<Activity>,
    req: &Request<Incoming>,
) -> std::result::Result<Tag, Response<Body>> {
    let denied = |tag: &str| {
        let e = ApiError::new(
            ErrorCode::Unauthenticated,
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
    let secret = bearer(req);
    let epoch = shared.store.credential_epoch();
    let cached = {
        let p = activity.proven.lock().unwrap_or_else(|e| e.into_inner());
        match p.as_ref() {
            Some(p) if p.tag == tag_text && wire::secret_matches(&secret, &p.hash) => {
                Some(p.epoch == epoch && p.at.elapsed() < RECHECK)
            }
            _ => None,
        }
    };
    if cached == Some(true) {
        return Ok(tag);
    }
    let _checking = activity.checking();
    let store = shared.store.clone();
    let key = tag.to_string();
    let record =
        match tokio::task::spawn_blocking(move || store.agent_credential_record(&key)).await {
            Ok(Ok(r)) => r,
            // A store that cannot answer decides nothing: the secret is
            // neither right nor wrong, and the agent tries again (elsewhere).
            Ok(Err(e)) => {
                warn!(agent = %tag, error = %e, "cannot check an agent's credential");
                return Err(reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &Reply::Error(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("this controller cannot check the credential now: {e}"),
                    )),
                ));
            }
            Err(_) => None,
        };
    let still = record
        .as_ref()
        .is_some_and(|c| !secret.is_empty() && wire::secret_matches(&secret, &c.hash));
    if record.is_some() && !still {
        // A secret that is not the agent's current one: most often an
        // agent left behind by a newer start attempt or enrollment.
        // `status` shows it (see `note_refusal`).
        note_refusal(shared, &tag_text);
    }
    if cached.is_some() && !still {
        // What this connection proved no longer holds: refused, and the
        // connection closed once this answer is out.
        warn!(agent = %tag, "refused a call: the credential this connection proved was replaced or removed");
        activity.revoked.notify_one();
        *activity.proven.lock().unwrap_or_else(|e| e.into_inner()) = None;
        return Err(denied(&shown));
    }
    if still && record.as_ref().is_some_and(|c| c.refused_at.is_some()) {
        let (store, key) = (shared.store.clone(), tag_text.clone());
        let _ = tokio::task::spawn_blocking(move || store.clear_credential_refused(&key)).await;
        shared
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tag_text);
    }
    match record.map(|c| c.hash) {
        Some(h) if still => {
            if !activity.count_for(&tag_text) {
                let max = shared.limits.max_connections_per_credential;
                warn!(agent = %tag, max, "refused a call: its credential holds too many connections");
                return Err(reply(
                    StatusCode::TOO_MANY_REQUESTS,
                    &Reply::Error(ApiError::new(
                        ErrorCode::Unavailable,
                        format!("agent `{tag}` holds {max} connections already, the most one credential may; close one"),
                    )),
                ));
            }
            *activity.proven.lock().unwrap_or_else(|e| e.into_inner()) = Some(Proven {
                tag: tag_text,
                hash: h,
                epoch,
                at: Instant::now(),
            });
            Ok(tag)
        }
        _ => Err(denied(&shown)),
    }
}

/// Notes in the store that `tag`'s credential was refused, at most once a
/// minute per tag and for at most [`MAX_NOTED_REFUSALS`] tags a minute, so
/// that wrong secrets cost the store a bounded number of writes and this
/// server a bounded map. The write runs on a blocking thread, unawaited:
/// the refusal is answered at once.
fn note_refusal(shared: &Shared, tag: &str) {
    let now = Instant::now();
    {
        let mut noted = shared.refusals.lock().unwrap_or_else(|e| e.into_inner());
        if noted.len() >= MAX_NOTED_REFUSALS {
            noted.retain(|_, at| now.duration_since(*at) < REFUSAL_NOTE_EVERY);
        }
        match noted.get(tag) {
            Some(at) if now.duration_since(*at) < REFUSAL_NOTE_EVERY => return,
            _ if noted.len() >= MAX_NOTED_REFUSALS => return,
            _ => {
                noted.insert(tag.to_string(), now);
            }
        }
    }
    warn!(agent = %tag, "refused a secret that is not the agent's current one");
    let (store, tag) = (shared.store.clone(), tag.to_string());
    tokio::task::spawn_blocking(move || {
        let _ = store.note_credential_refused(&tag, unix_now());
    });
}

/// Services given a new leader per presence beat at most.
const LEADERS_PER_BEAT: usize = 1000;

/// How often one tag's refusals reach the store.
const REFUSAL_NOTE_EVERY: Duration = Duration::from_secs(60);
/// How many tags' refusals a minute reach the store.
const MAX_NOTED_REFUSALS: usize = 10_000;

use jujube_core::time::unix_now;

async fn read_body(shared: &Shared, body: Incoming) -> std::result::Result<Bytes, Response<Body>> {
    collect_body(shared, body).await.map_err(|message| {
        reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            &Reply::Error(ApiError::new(ErrorCode::Refused, message)),
        )
    })
}

/// The secret a request presents (`authorization: Bearer SECRET`; empty
/// when none).
pub(crate) fn bearer<B>(req: &Request<B>) -> String {
    req.headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
        .to_string()
}

/// A request's body, up to [`Limits::max_request_bytes`]; else why not.
pub(crate) async fn collect_body(
    shared: &Shared,
    body: Incoming,
) -> std::result::Result<Bytes, String> {
    collect_within(body, shared.limits.max_request_bytes)
        .await
        .ok_or_else(|| {
            format!(
                "request larger than {} bytes, or cut short",
                shared.limits.max_request_bytes
            )
        })
}

/// A body of at most `max` bytes; `None` when it is larger or cut short.
pub(crate) async fn collect_within(body: Incoming, max: usize) -> Option<Bytes> {
    http_body_util::Limited::new(body, max)
        .collect()
        .await
        .ok()
        .map(|b| b.to_bytes())
}

async fn handle(
    shared: Arc<Shared>,
    activity: Arc<Activity>,
    req: Request<Incoming>,
) -> Response<Body> {
    let _held = activity.hold(|a| &a.in_flight);
    activity.touch();
    if req.method() == hyper::Method::GET && req.uri().path() == TOOLS_PATH {
        return tools(&shared, &activity).await;
    }
    if req.method() == hyper::Method::POST && req.uri().path() == ENROLL_PATH {
        return enroll(&shared, &activity.peer, req).await;
    }
    if crate::clients::serves(req.uri().path()) {
        return crate::clients::handle(&shared, &activity, req).await;
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
    let stamp = match req.headers().get(wire::STAMP_HEADER) {
        None => None,
        Some(v) => match wire::parse_stamp(v.as_bytes()) {
            Some((incarnation, seq)) => Some(jujube_state::Stamp { incarnation, seq }),
            None => {
                return refuse(ApiError::new(
                    ErrorCode::Refused,
                    format!(
                        "malformed `{}` header: send `INCARNATION.SEQ`, two non-negative integers",
                        wire::STAMP_HEADER
                    ),
                ))
            }
        },
    };
    let body = match read_body(&shared, req.into_body()).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let facade = match stamp {
        Some(stamp) => shared.facades.for_agent_stamped(tag.clone(), stamp),
        None => shared.facades.for_agent(tag.clone()),
    };
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
    if let Call::CharmFiles { unit } = &call {
        return charm_files(&activity, &*facade, unit).await;
    }
    // Room for the answer among this connection's unread answers, taken
    // before the call runs (as much as a request may hold: most answers
    // other than `charm-files`, streamed above, are that small), given back
    // down to what the answer is once it is made, the rest when it has been
    // sent. A larger answer is counted whole (up to the whole budget): its
    // call gives back what it holds and waits for room for all of it,
    // holding none meanwhile, so that no two calls wait on each other.
    let room = |bytes: usize| u32::try_from((bytes >> 10) + 1).unwrap_or(u32::MAX);
    let budget = u32::try_from(activity_budget(&shared)).unwrap_or(u32::MAX);
    let want = room(shared.limits.max_request_bytes).min(budget);
    let Ok(mut permit) = activity.unread.clone().acquire_many_owned(want).await else {
        return refuse(ApiError::new(
            ErrorCode::Unavailable,
            "the server is stopping",
        ));
    };
    let result = match call {
        Call::SetUnitCredential { unit, secret } => {
            set_unit_credential(&shared, &tag, stamp, unit, secret).await
        }
        Call::StartAgent => start_agent(&shared, &tag).await,
        // Reads answer from the store's reader connections on a blocking
        // thread: a read (and its wait for a reader) never holds up the
        // runtime's workers, which serve every other connection; writes
        // join the facades' group commit, which waits without blocking.
        call if call.is_read() => {
            let runtime = tokio::runtime::Handle::current();
            let facade = facade.clone();
            match tokio::task::spawn_blocking(move || {
                runtime.block_on(wire::dispatch(&*facade, call))
            })
            .await
            {
                Ok(r) => r,
                Err(e) => Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("the call failed: {e}"),
                )),
            }
        }
        call => wire::dispatch(&*facade, call).await,
    };
    let (status, r) = match result {
        Ok(v) => (StatusCode::OK, Reply::Ok(v)),
        Err(e) => (status_of(&e), Reply::Error(e)),
    };
    let bytes = Bytes::from(serde_json::to_vec(&r).expect("plain data"));
    let needed = room(bytes.len()).min(budget);
    if needed <= want {
        if let Some(extra) = permit.split(permit.num_permits() - needed as usize) {
            drop(extra);
        }
    } else {
        drop(permit);
        permit = match activity.unread.clone().acquire_many_owned(needed).await {
            Ok(p) => p,
            Err(_) => {
                return refuse(ApiError::new(
                    ErrorCode::Unavailable,
                    "the server is stopping",
                ))
            }
        };
    }
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(
            Chunked {
                data: bytes,
                _room: permit,
            }
            .map_err(never)
            .boxed_unsync(),
        )
        .expect("a valid response")
}

/// How much of a charm file one frame of a `charm-files` answer carries
/// (a multiple of 3, so that base64 pieces join into one).
const CHARM_CHUNK: usize = 48 << 10;

/// `charm-files`, answered as `wire::dispatch` would (the same JSON), but
/// read from disk as it is sent: the facade checks who may fetch the charm
/// and where it is, [`charm_manifest`] what it holds, and each file is read
/// and base64-encoded a chunk at a time as HTTP/2 takes frames — an answer
/// costs a chunk, not the charm, however slowly it is read.
async fn charm_files(activity: &Arc<Activity>, facade: &dyn Facade, unit: &str) -> Response<Body> {
    use jujube_agent_state::facade::charm_manifest;
    let charm = match facade.charm(unit).await {
        Ok(c) => c,
        Err(e) => return refuse(e),
    };
    let root = PathBuf::from(&charm.path);
    let entries = match tokio::task::spawn_blocking(move || charm_manifest(&root)).await {
        Ok(Ok(entries)) => entries,
        Ok(Err(e)) => return refuse(e),
        Err(e) => return refuse(ApiError::new(ErrorCode::Internal, e.to_string())),
    };
    // A streamed answer holds about two chunks; it still takes its room
    // among the connection's unread answers.
    let Ok(room) = activity.unread.clone().acquire_many_owned(256).await else {
        return refuse(ApiError::new(
            ErrorCode::Unavailable,
            "the server is stopping",
        ));
    };
    struct Sending {
        entries: std::collections::VecDeque<jujube_agent_state::facade::CharmEntry>,
        file: Option<(tokio::fs::File, u64)>,
        first: bool,
        done: bool,
        _room: tokio::sync::OwnedSemaphorePermit,
    }
    let start = Sending {
        entries: entries.into(),
        file: None,
        first: true,
        done: false,
        _room: room,
    };
    let frames = futures_util::stream::unfold(start, |mut s| async move {
        use base64::Engine;
        use tokio::io::AsyncReadExt;
        if s.done {
            return None;
        }
        let mut out = Vec::new();
        if s.first {
            out.extend_from_slice(b"{\"ok\":[");
        }
        if let Some((file, left)) = &mut s.file {
            let mut buf = vec![0u8; CHARM_CHUNK.min(*left as usize)];
            let mut got = 0;
            while got < buf.len() {
                match file.read(&mut buf[got..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            buf.truncate(got);
            *left = if got == 0 { 0 } else { *left - got as u64 };
            out.extend_from_slice(
                base64::engine::general_purpose::STANDARD
                    .encode(&buf)
                    .as_bytes(),
            );
            if *left == 0 {
                out.extend_from_slice(b"\"}");
                s.file = None;
            }
        } else if let Some(e) = s.entries.pop_front() {
            if !s.first {
                out.push(b',');
            }
            let head = format!(
                "{{\"path\":{},\"mode\":{},\"data\":\"",
                serde_json::Value::String(e.path.clone()),
                e.mode
            );
            out.extend_from_slice(head.as_bytes());
            match tokio::fs::File::open(&e.file).await {
                Ok(f) if e.len > 0 => s.file = Some((f, e.len)),
                // Empty, or gone since the manifest: an empty file.
                _ => out.extend_from_slice(b"\"}"),
            }
        } else {
            out.extend_from_slice(b"]}");
            s.done = true;
        }
        s.first = false;
        Some((Ok::<_, Infallible>(Frame::data(Bytes::from(out))), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(StreamBody::new(frames).map_err(never).boxed_unsync())
        .expect("a valid response")
}

/// The SHA-256 (hex) of a file, read a buffer at a time.
fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The whole unread-answer budget of a connection, in permits (KiB).
fn activity_budget(shared: &Shared) -> usize {
    (shared.limits.max_unread_bytes_per_connection >> 10).max(1)
}

/// An answer handed to HTTP/2 a frame at a time, holding its room in the
/// connection's unread budget until its last frame is taken: a client that
/// does not read keeps the answer here, counted, not in a send buffer.
struct Chunked {
    data: Bytes,
    _room: tokio::sync::OwnedSemaphorePermit,
}

impl hyper::body::Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<std::result::Result<Frame<Bytes>, Infallible>>> {
        const FRAME: usize = 16 << 10;
        if self.data.is_empty() {
            return std::task::Poll::Ready(None);
        }
        let n = self.data.len().min(FRAME);
        let chunk = self.data.split_to(n);
        std::task::Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.data.len() as u64)
    }
}

/// The agent binary, whole (the server reads it for each download: they
/// are one per instance, at its first boot).
async fn tools(shared: &Shared, activity: &Arc<Activity>) -> Response<Body> {
    let Some((path, sum)) = shared.tools.get() else {
        return refuse(ApiError::new(
            ErrorCode::Refused,
            "this controller serves no agent binary",
        ));
    };
    let opened = async {
        let f = tokio::fs::File::open(path).await?;
        let len = f.metadata().await?.len();
        Ok::<_, std::io::Error>((f, len))
    };
    match opened.await {
        // Read as it is sent: flow control stops the reading when the
        // client stops reading, so a download costs one buffer, not the
        // binary.
        Ok((file, len)) => {
            // Counted while the body lives, and each frame sent is activity:
            // a moving download keeps an unproven connection open.
            let held = activity.hold(|a| &a.downloads);
            let frames = futures_util::stream::unfold(Some((file, held)), |state| async move {
                use tokio::io::AsyncReadExt;
                let (mut file, held) = state?;
                let mut buf = vec![0u8; 64 << 10];
                match file.read(&mut buf).await {
                    Ok(0) => None,
                    Ok(n) => {
                        buf.truncate(n);
                        held.0.touch();
                        Some((Ok(Frame::data(Bytes::from(buf))), Some((file, held))))
                    }
                    // Cut short: the length and the client's SHA-256 check
                    // tell it so.
                    Err(e) => {
                        warn!("reading the agent binary failed mid-download: {e}");
                        None
                    }
                }
            });
            Response::builder()
                .status(StatusCode::OK)
                .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
                .header(hyper::header::CONTENT_LENGTH, len)
                .header("x-jujube-sha256", sum.as_str())
                .body(StreamBody::new(frames).map_err(never).boxed_unsync())
                .expect("a valid response")
        }
        Err(e) => refuse(ApiError::new(
            ErrorCode::Internal,
            format!("cannot read the agent binary: {e}"),
        )),
    }
}

/// An instance enrolls: its batch's token and its instance id for its
/// machine's `agent.conf`.
async fn enroll(shared: &Shared, peer: &str, req: Request<Incoming>) -> Response<Body> {
    // Nothing of an outsider's is read where nothing would be done with it.
    let Some(enroller) = shared.enroller.get() else {
        return refuse(ApiError::new(
            ErrorCode::Refused,
            "this controller enrolls no instances",
        ));
    };
    let Some(body) = collect_within(req.into_body(), MAX_ENROLL_BYTES).await else {
        return reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            &Reply::Error(ApiError::new(
                ErrorCode::Refused,
                format!("an enrollment is at most {MAX_ENROLL_BYTES} bytes"),
            )),
        );
    };
    use base64::Engine;
    let malformed = || {
        refuse(ApiError::new(
            ErrorCode::Refused,
            "malformed enrollment: expected {\"token\": ..., \"identity-document\": BASE64, \"identity-signature\": ...}",
        ))
    };
    let Ok(r) = serde_json::from_slice::<EnrollRequest>(&body) else {
        return malformed();
    };
    let Ok(document) = base64::engine::general_purpose::STANDARD.decode(&r.identity_document)
    else {
        return malformed();
    };
    let identity = Identity {
        document,
        signature: r.identity_signature,
        peer: peer.to_string(),
    };
    match enroller.enroll(&r.token, &identity).await {
        Ok(conf) => Response::builder()
            .status(StatusCode::OK)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(conf)).map_err(never).boxed_unsync())
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
    stamp: Option<jujube_state::Stamp>,
    unit: String,
    secret: String,
) -> Result<serde_json::Value, ApiError> {
    if secret.len() < 32 {
        return Err(ApiError::new(
            ErrorCode::Refused,
            "an agent secret must be at least 32 characters (use 32 random bytes)",
        ));
    }
    let by = jujube_agent_state::facade::caller_of(caller);
    let store = shared.store.clone();
    let hash = wire::secret_hash(&secret);
    let tag = Tag::Unit(unit.clone()).to_string();
    let unit_ = unit.clone();
    let done = tokio::task::spawn_blocking(move || {
        store.set_unit_credential_as(&by, stamp.as_ref(), &unit_, &tag, &hash)
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    match done {
        Ok(()) => {}
        Err(jujube_state::Error::Unauthorized { .. }) => {
            return Err(ApiError::unauthorized(
                caller,
                format_args!("set the credential of unit `{unit}`"),
            ))
        }
        Err(e @ jujube_state::Error::Superseded { .. }) => {
            return Err(ApiError::new(ErrorCode::Superseded, e.to_string()))
        }
        Err(e) => return Err(ApiError::new(ErrorCode::Unavailable, e.to_string())),
    }
    Ok(serde_json::Value::Null)
}

/// An agent, as it starts, takes a new incarnation for its writes'
/// stamps (see `wire::STAMP_HEADER`): its own, no other's.
async fn start_agent(shared: &Shared, caller: &Tag) -> Result<serde_json::Value, ApiError> {
    let by = jujube_agent_state::facade::caller_of(caller);
    let store = shared.store.clone();
    let taken = tokio::task::spawn_blocking(move || store.start_agent(&by))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    match taken {
        Ok(incarnation) => Ok(serde_json::Value::from(incarnation)),
        Err(jujube_state::Error::NotFound { .. }) => {
            Err(ApiError::unauthorized(caller, "take a write incarnation"))
        }
        Err(e) if e.is_unavailable() => Err(ApiError::new(ErrorCode::Unavailable, e.to_string())),
        Err(e) => Err(ApiError::new(ErrorCode::Internal, e.to_string())),
    }
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
    let looked = tokio::task::spawn_blocking(move || store.resume_point(since)).await;
    // Notices say "re-read": one covers every change missed.
    let (head, first) = match looked {
        Ok(Ok((head, missed))) => (
            head,
            missed.map(|resync| Notice {
                revision: head,
                resync,
            }),
        ),
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
        .body(StreamBody::new(frames).map_err(never).boxed_unsync())
        .expect("a valid response")
}
