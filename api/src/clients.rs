//! Users' requests: the client facade ([`CLIENT_PATH`]) and registration
//! ([`REGISTER_PATH`]).
//!
//! A user proves itself on each request with its name and password; the
//! password is checked against the argon2id hash the store keeps, and a
//! connection that proved it is trusted for [`RECHECK`] before the store
//! is asked again. Checking costs memory and time by design (argon2), so
//! at most [`CHECKS_AT_ONCE`] run at once, at most
//! [`MAX_WAITING_CHECKS`] wait for one (more are told to try again), and a
//! failed login or registration is answered only after [`FAILURE_PAUSE`].
//! The answer is the same whether the user exists or not, and as slow: a
//! user without a password hash is checked against a decoy. What a proven user may do is then the store's
//! to check, in each call's transaction.
//!
//! An answer of the whole model (`status`) is a snapshot of it, held until
//! its client has read its JSON: such calls take a turn before the answer
//! is made, at most [`crate::Limits::max_whole_model_answers`] at once over
//! all users and [`crate::Limits::max_whole_model_answers_per_user`] per
//! user, so that the memory they hold is a few snapshots whoever asks; a
//! streamed answer not read whole within
//! [`crate::Limits::stream_deadline`] is given up, and its turn with it.

use crate::server::{Activity, Body, Shared};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use jujube_wire::client::{
    ClientCall, ClientError, Registration, CHARM_PATH, CLIENT_PATH, REGISTER_PATH, USER_HEADER,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// How long a proven user is trusted on one connection without asking the
/// store again.
pub const RECHECK: Duration = Duration::from_secs(5);
/// Password checks (and registrations) running at once.
pub const CHECKS_AT_ONCE: usize = 2;
/// How long a failed login or registration waits before it is answered
/// (its check slot given back first).
pub const FAILURE_PAUSE: Duration = Duration::from_secs(1);
/// Logins and registrations waiting for a check slot at once; more are
/// answered "try again" at once.
pub const MAX_WAITING_CHECKS: usize = 64;
/// The largest registration read.
pub const MAX_REGISTRATION_BYTES: usize = 8 << 10;
/// Calls waiting for a turn to answer with the whole model (see
/// [`crate::Limits::max_whole_model_answers`]); more are answered "try
/// again" at once.
pub const MAX_WAITING_WHOLE_MODEL: usize = 64;

/// A turn to make and send an answer of the whole model, held until the
/// answer is written out (or given up), and counted against its user's.
pub(crate) struct WholeModelTurn {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _counted: UserTurns,
}

/// A user's count of turns held or waited for, given back when dropped.
struct UserTurns {
    user: String,
    per_user: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
}

impl Drop for UserTurns {
    fn drop(&mut self) {
        let mut held = self.per_user.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.user);
            }
        }
    }
}

/// A turn for `user`'s call that answers with the whole model: refused
/// at once when the user already holds its share or too many wait, waited
/// for otherwise.
async fn take_whole_model_turn(
    shared: &Arc<Shared>,
    user: &str,
) -> Result<WholeModelTurn, Response<Body>> {
    let per_user = shared.whole_model_per_user.clone();
    {
        let mut held = per_user.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(user.to_string()).or_default();
        if *n >= shared.limits.max_whole_model_answers_per_user {
            let most = shared.limits.max_whole_model_answers_per_user;
            if *n == 0 {
                held.remove(user);
            }
            return Err(refused(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "a `status` for user `{user}` is still being made or sent, and a user gets {most} at once; wait for it to finish"
                ),
            ));
        }
        *n += 1;
    }
    // From here the count is given back however this ends.
    let counted = UserTurns {
        user: user.to_string(),
        per_user,
    };
    let Some(waiting) = InLine::join(&shared.whole_model_waiting, MAX_WAITING_WHOLE_MODEL) else {
        return Err(refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many `status` calls at once; try again in a moment",
        ));
    };
    let permit = shared.whole_model.clone().acquire_owned().await;
    drop(waiting);
    let permit =
        permit.map_err(|_| refused(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping"))?;
    Ok(WholeModelTurn {
        _permit: permit,
        _counted: counted,
    })
}

/// A place in a line of at most `most` waiting, given back when dropped:
/// also when the call that waits is dropped itself, as its client reset
/// the stream or went (counted down after the wait instead, a line lost a
/// place for each such call, until it was full for good).
struct InLine<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InLine<'a> {
    fn join(line: &'a std::sync::atomic::AtomicUsize, most: usize) -> Option<InLine<'a>> {
        use std::sync::atomic::Ordering;
        if line.fetch_add(1, Ordering::AcqRel) >= most {
            line.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(InLine(line))
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A check slot, waited for only while fewer than [`MAX_WAITING_CHECKS`]
/// others wait.
async fn take_slot(
    shared: &Arc<Shared>,
) -> Result<tokio::sync::SemaphorePermit<'_>, Response<Body>> {
    let Some(_waiting) = InLine::join(&shared.checks_waiting, MAX_WAITING_CHECKS) else {
        return Err(refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many logins at once; try again in a moment",
        ));
    };
    let slot = shared.checks.acquire().await;
    slot.map_err(|_| refused(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping"))
}

/// Answers a client call on behalf of a proven user: the controller's
/// business (it knows the provider and the charms), not the server's.
pub trait ClientHandler: Send + Sync + 'static {
    /// Runs on a blocking thread.
    fn call(&self, user: &str, call: ClientCall) -> Result<Answer, ClientError>;
}

/// Writes an answer's JSON, on a blocking thread.
pub type WriteJson = Box<dyn FnOnce(&mut dyn std::io::Write) -> std::io::Result<()> + Send>;

/// A call's answer (`200 OK`): its JSON written once, or written as it is
/// sent.
pub enum Answer {
    /// Small answers, written before the response starts.
    Json(Box<serde_json::value::RawValue>),
    /// Large ones (a 100,000-unit status is 34 MB): written into the
    /// response as HTTP/2's flow control takes it, [`STREAM_CHUNK`] bytes
    /// at a time, at most [`STREAM_CHUNKS_AHEAD`] chunks ahead of the
    /// client, so the controller never holds the JSON whole, and the
    /// client reads (and prints) the start while the rest is written. A
    /// client that takes no chunk for [`STREAM_STALL`] is cut off.
    Streamed(WriteJson),
}

impl Answer {
    /// `v`, written as it is sent.
    pub fn streamed<T: serde::Serialize + Send + 'static>(v: T) -> Answer {
        Answer::Streamed(Box::new(move |w| {
            serde_json::to_writer(w, &v).map_err(std::io::Error::other)
        }))
    }

    /// The whole JSON (for callers in the same process).
    pub fn into_bytes(self) -> Vec<u8> {
        match self {
            Answer::Json(v) => String::from(Box::<str>::from(v)).into_bytes(),
            Answer::Streamed(write) => {
                let mut out = Vec::new();
                write(&mut out).expect("writing to memory");
                out
            }
        }
    }
}

/// The size of a streamed answer's chunks.
pub const STREAM_CHUNK: usize = 256 << 10;
/// How many chunks a streamed answer is written ahead of its client.
pub const STREAM_CHUNKS_AHEAD: usize = 4;
/// How long a streamed answer waits for its client to take a chunk.
pub const STREAM_STALL: Duration = Duration::from_secs(30);

/// A user proven on a connection: who, a digest of the password it
/// presented (never the password), and when.
pub(crate) struct ProvenUser {
    user: String,
    digest: [u8; 32],
    at: Instant,
}

fn digest(password: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(password.as_bytes()).into()
}

pub(crate) fn checks() -> Semaphore {
    Semaphore::new(CHECKS_AT_ONCE)
}

/// `200 OK` with the answer's JSON as it is.
fn answer(json: Box<serde_json::value::RawValue>) -> Response<Body> {
    let json: Box<str> = json.into();
    json_response(StatusCode::OK, Bytes::from(String::from(json)))
}

fn json_response(status: StatusCode, body: Bytes) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body).map_err(crate::server::never).boxed_unsync())
        .expect("a valid response")
}

/// What the writer of a streamed answer hands the response.
type Piece = std::io::Result<Bytes>;

/// Collects an answer's JSON into chunks sent to its response.
struct ChunkWriter {
    buf: Vec<u8>,
    tx: tokio::sync::mpsc::Sender<Piece>,
    runtime: tokio::runtime::Handle,
    /// When the answer must have been taken whole (see
    /// [`crate::Limits::stream_deadline`]).
    deadline: Instant,
    deadline_secs: u64,
}

impl ChunkWriter {
    fn send(&mut self, piece: Piece) -> std::io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let sent = self.runtime.block_on(tokio::time::timeout(
            STREAM_STALL.min(left),
            self.tx.send(piece),
        ));
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the client went away",
            )),
            Err(_) if left <= STREAM_STALL => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the client did not read the answer whole within {}s",
                    self.deadline_secs
                ),
            )),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing for {}s", STREAM_STALL.as_secs()),
            )),
        }
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= STREAM_CHUNK {
            let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(STREAM_CHUNK + 8192));
            self.send(Ok(Bytes::from(chunk)))?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `200 OK` with the JSON `write` writes, sent as it is written (see
/// [`Answer::Streamed`]). The body ends only once the JSON is whole: a
/// writer that fails (or panics) resets the stream instead.
///
/// `turn`, when the answer is of the whole model, is held until the JSON
/// is written out or given up: then the answer's data is gone too.
fn streamed(write: WriteJson, deadline: Duration, turn: Option<WholeModelTurn>) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Piece>(STREAM_CHUNKS_AHEAD);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let mut w = ChunkWriter {
            buf: Vec::with_capacity(STREAM_CHUNK + 8192),
            tx,
            runtime,
            deadline: Instant::now() + deadline,
            deadline_secs: deadline.as_secs(),
        };
        let written = write(&mut w).and_then(|()| {
            let rest = std::mem::take(&mut w.buf);
            if rest.is_empty() {
                Ok(())
            } else {
                w.send(Ok(Bytes::from(rest)))
            }
        });
        // An empty chunk says the JSON is whole; anything else ends it
        // with an error.
        let last = match written {
            Ok(()) => Ok(Bytes::new()),
            Err(e) => {
                warn!("a streamed answer was cut short: {e}");
                Err(e)
            }
        };
        let _ = w.send(last);
    });
    let frames = futures_util::stream::unfold((rx, false), |(mut rx, ended)| async move {
        if ended {
            return None;
        }
        match rx.recv().await {
            // The last piece is the one after which the writer has
            // nothing left: an empty chunk or an error.
            Some(Ok(b)) if b.is_empty() => None,
            Some(Ok(b)) => Some((Ok(hyper::body::Frame::data(b)), (rx, false))),
            Some(Err(e)) => Some((Err(e), (rx, true))),
            None => Some((
                Err(std::io::Error::other("the answer's writer stopped")),
                (rx, true),
            )),
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::StreamBody::new(frames).boxed_unsync())
        .expect("a valid response")
}

/// A refusal: `status` (never `200 OK`) with the [`ClientError`].
fn client_error(status: StatusCode, e: &ClientError) -> Response<Body> {
    json_response(
        status,
        Bytes::from(serde_json::to_vec(e).expect("plain data")),
    )
}

fn refused(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    client_error(status, &ClientError::new(message))
}

/// Whether `path` is a users' endpoint.
pub(crate) fn serves(path: &str) -> bool {
    path == CLIENT_PATH || path == REGISTER_PATH || path == CHARM_PATH
}

/// How long an uploaded charm waits for the call that uses it; older ones
/// are removed by the next upload.
pub const UPLOAD_KEPT: Duration = Duration::from_secs(3600);

/// Where uploads wait for their call, under the charms directory.
pub const PENDING: &str = "pending";

/// `POST` [`CHARM_PATH`]: the archive laid out as it arrives under
/// `charms/pending/ID`; answers `upload:ID`.
async fn upload(shared: &Arc<Shared>, user: &str, req: Request<Incoming>) -> Response<Body> {
    let store = shared.store.as_user(user);
    let allowed =
        tokio::task::spawn_blocking(move || store.require(jujube_wire::client::Access::Write))
            .await;
    match allowed {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return refused(StatusCode::FORBIDDEN, e.to_string()),
        Err(e) => return refused(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
    let pending = shared.charms_dir.join(PENDING);
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dir = pending.join(&id);
    let unpacked = {
        let (pending, dir) = (pending.clone(), dir.clone());
        let mut body = req.into_body();
        async move {
            tokio::task::spawn_blocking(move || forget_old(&pending))
                .await
                .ok();
            let mut unpacker = {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || jujube_agent::charmdir::Unpacker::new(&dir))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.message)?
            };
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| format!("the upload was cut short: {e}"))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                unpacker =
                    tokio::task::spawn_blocking(move || unpacker.feed(&data).map(|()| unpacker))
                        .await
                        .map_err(|e| e.to_string())?
                        .map_err(|e| e.message)?;
            }
            unpacker.finish().map_err(|e| e.message)
        }
        .await
    };
    match unpacked {
        Ok(_) => {
            info!(user = %user, upload = %id, "charm uploaded");
            answer(jujube_wire::client::raw(&format!(
                "{}{id}",
                jujube_wire::client::UPLOAD_PREFIX
            )))
        }
        Err(message) => {
            let _ = std::fs::remove_dir_all(&dir);
            refused(
                StatusCode::CONFLICT,
                format!("cannot upload the charm: {message}"),
            )
        }
    }
}

/// Removes uploads older than [`UPLOAD_KEPT`].
fn forget_old(pending: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(pending) else {
        return;
    };
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > UPLOAD_KEPT);
        if old {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

pub(crate) async fn handle(
    shared: &Arc<Shared>,
    activity: &Arc<Activity>,
    req: Request<Incoming>,
) -> Response<Body> {
    let Some(handler) = shared.clients.clone() else {
        return refused(
            StatusCode::NOT_FOUND,
            "this API server does not serve users",
        );
    };
    if req.method() != hyper::Method::POST {
        return refused(StatusCode::NOT_FOUND, "use POST");
    }
    if req.uri().path() == REGISTER_PATH {
        return register(shared, req).await;
    }
    let user = match authenticate(shared, activity, &req).await {
        Ok(u) => u,
        Err(resp) => return resp,
    };
    if req.uri().path() == CHARM_PATH {
        return upload(shared, &user, req).await;
    }
    let body = match read(shared, req.into_body()).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let Ok(call) = serde_json::from_slice::<ClientCall>(&body) else {
        return refused(
            StatusCode::BAD_REQUEST,
            "malformed call; is this jujube as new as the controller?",
        );
    };
    debug!(user = %user, method = %call.method(), "client call");
    // Taken before the answer is made: its snapshot is what costs.
    let turn = if call.answers_the_whole_model() {
        match take_whole_model_turn(shared, &user).await {
            Ok(t) => Some(t),
            Err(resp) => return resp,
        }
    } else {
        None
    };
    let answered = tokio::task::spawn_blocking(move || handler.call(&user, call)).await;
    match answered {
        Ok(Ok(Answer::Json(v))) => answer(v),
        Ok(Ok(Answer::Streamed(write))) => streamed(write, shared.limits.stream_deadline, turn),
        Ok(Err(e)) if e.unavailable => client_error(StatusCode::SERVICE_UNAVAILABLE, &e),
        Ok(Err(e)) => client_error(StatusCode::CONFLICT, &e),
        Err(e) => refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the call failed: {e}"),
        ),
    }
}

async fn read(shared: &Shared, body: Incoming) -> Result<Bytes, Response<Body>> {
    crate::server::collect_body(shared, body)
        .await
        .map_err(|message| refused(StatusCode::PAYLOAD_TOO_LARGE, message))
}

async fn authenticate(
    shared: &Arc<Shared>,
    activity: &Arc<Activity>,
    req: &Request<Incoming>,
) -> Result<String, Response<Body>> {
    let user: String = req
        .headers()
        .get(USER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .chars()
        .take(64)
        .collect();
    // Sent as base64 (see `UserClient`): any characters travel.
    let password = {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(crate::server::bearer(req))
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default()
    };
    let presented = digest(&password);
    {
        let proven = activity.user.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = proven.as_ref() {
            if p.user == user && p.digest == presented && p.at.elapsed() < RECHECK {
                return Ok(user);
            }
        }
    }
    let _checking = activity.checking();
    let slot = take_slot(shared).await?;
    let store = shared.store.clone();
    let name = user.clone();
    let checked = tokio::task::spawn_blocking(move || {
        // A store that cannot answer decides nothing: the password is
        // neither right nor wrong (see `unavailable`).
        let login = store.login(&name)?;
        Ok::<_, jujube_state::Error>(match login.and_then(|l| l.password_hash) {
            Some(h) => jujube_state::users::password_matches(&password, &h),
            None => jujube_state::users::password_matches_nothing(&password),
        })
    })
    .await;
    drop(slot);
    let ok = match checked {
        Ok(Ok(ok)) => ok,
        Ok(Err(e)) => {
            warn!(user = %user, error = %e, "cannot check a login");
            return Err(client_error(
                StatusCode::SERVICE_UNAVAILABLE,
                &ClientError {
                    unavailable: true,
                    ..ClientError::new(format!("this controller cannot check the login now: {e}"))
                },
            ));
        }
        Err(_) => false,
    };
    if !ok {
        warn!(user = %user, "refused a login");
        tokio::time::sleep(FAILURE_PAUSE).await;
        *activity.user.lock().unwrap_or_else(|e| e.into_inner()) = None;
        return Err(refused(
            StatusCode::UNAUTHORIZED,
            format!("invalid credentials for user `{user}`; log in again with `jujube login`"),
        ));
    }
    activity.proven_user();
    *activity.user.lock().unwrap_or_else(|e| e.into_inner()) = Some(ProvenUser {
        user: user.clone(),
        digest: presented,
        at: Instant::now(),
    });
    Ok(user)
}

async fn register(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    // A registration is a name, a secret and a password: small, and read
    // before its caller has proved anything.
    let Some(body) = crate::server::collect_within(req.into_body(), MAX_REGISTRATION_BYTES).await
    else {
        return refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a registration is at most {MAX_REGISTRATION_BYTES} bytes"),
        );
    };
    let Ok(r) = serde_json::from_slice::<Registration>(&body) else {
        return refused(StatusCode::BAD_REQUEST, "malformed registration");
    };
    let slot = match take_slot(shared).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let store = shared.store.clone();
    let user = r.user.clone();
    let done =
        tokio::task::spawn_blocking(move || store.register_user(&r.user, &r.secret, &r.password))
            .await;
    drop(slot);
    match done {
        Ok(Ok(())) => {
            info!(user = %user, "user registered");
            answer(jujube_wire::client::raw(&()))
        }
        Ok(Err(e)) => {
            if !matches!(e, jujube_state::Error::BadPassword(_)) {
                tokio::time::sleep(FAILURE_PAUSE).await;
            }
            refused(StatusCode::FORBIDDEN, e.to_string())
        }
        Err(e) => refused(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
