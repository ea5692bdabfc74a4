//! Machine 0's hand-over on EC2 when the user hands the controller their own
//! cloud credentials (`controller-credentials=hand-over`) instead of an
//! instance profile: machine 0 has no credential to read the control bucket
//! with, so `bootstrap` brings it the environment's state and the
//! credentials itself, over TLS, once machine 0 answers.
//!
//! - Machine 0 listens with a one-shot server identity ([`OneShot`]) whose
//!   CA key `bootstrap` threw away: the client trusts nothing else, and that
//!   identity is worthless once the exchange is over.
//! - The request proves itself with `bootstrap`'s one-time token (`Bearer`);
//!   machine 0 was given only its SHA-256 (user data holds nothing a reader
//!   could hand over with).
//! - The first request accepted ends it: [`receive`] stops listening and
//!   returns, so the controller can take the port. Nothing else is served.
//!
//! Bounds: [`MAX_CONNECTIONS`] at once (more are closed at accept),
//! [`HANDSHAKE_TIMEOUT`] to say who one is, a body of at most `max` bytes
//! (refused with 413 once it is exceeded, without reading the rest), and
//! one request handled at a time.
//!
//! [`OneShot`]: crate::tls::OneShot

use crate::{Error, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use jujube_agent::api::{ApiError, ErrorCode};
use jujube_agent::wire::{secret_hash, Reply, HAND_OVER_PATH};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex, Semaphore};
use tracing::{info, warn};

/// Connections held at once; a further one is closed as it is accepted.
pub const MAX_CONNECTIONS: usize = 8;

/// How long a connection has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection is held from when it was accepted, whatever it
/// does: connections that send nothing (or trickle) cannot keep the
/// [`MAX_CONNECTIONS`] slots from the hand-over for longer than this.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// What a hand-over is answered once one was taken (the first one's
/// answer may have been lost on its way: its sender then finds the
/// controller answering).
pub const TAKEN_ALREADY: &str = "this machine has taken its hand-over already";

/// What one accepted hand-over did with the body: `Err` says why it was not
/// taken (the caller may try again).
pub type Accept = dyn Fn(Bytes) -> std::result::Result<(), String> + Send + Sync;

struct Shared {
    token_sha256: String,
    max: usize,
    accept: Box<Accept>,
    /// One request handled at a time; `true` once one was taken.
    taken: Mutex<bool>,
    done: watch::Sender<bool>,
}

fn reply(status: StatusCode, code: ErrorCode, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec(&Reply::Error(ApiError::new(code, message))).expect("plain data");
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}

async fn handle(shared: Arc<Shared>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::POST || req.uri().path() != HAND_OVER_PATH {
        return reply(
            StatusCode::NOT_FOUND,
            ErrorCode::Unauthorized,
            "machine 0 is waiting for its hand-over, and serves nothing else yet",
        );
    }
    let token = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Hashes compared, never the token: how far two hashes agree tells
    // nothing about the token.
    if secret_hash(token) != shared.token_sha256 {
        warn!("a hand-over with a wrong token was refused");
        return reply(
            StatusCode::FORBIDDEN,
            ErrorCode::Unauthenticated,
            "the hand-over's token is not the one this machine was given",
        );
    }
    let body = match http_body_util::Limited::new(req.into_body(), shared.max)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return reply(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::Refused,
                &format!("the hand-over holds more than {} bytes", shared.max),
            )
        }
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                ErrorCode::Unavailable,
                &format!("reading the hand-over: {e}"),
            )
        }
    };
    let mut taken = shared.taken.lock().await;
    if *taken {
        return reply(StatusCode::GONE, ErrorCode::Refused, TAKEN_ALREADY);
    }
    match (shared.accept)(body) {
        Ok(()) => {
            *taken = true;
            let _ = shared.done.send(true);
            let ok = serde_json::to_vec(&Reply::Ok(serde_json::Value::Null)).expect("plain data");
            Response::new(Full::new(Bytes::from(ok)))
        }
        Err(message) => reply(StatusCode::BAD_REQUEST, ErrorCode::Refused, &message),
    }
}

/// Listens on `listen` as the one-shot identity `cert`/`key` (PEM) until a
/// `POST` [`HAND_OVER_PATH`] bearing the token whose SHA-256 is
/// `token_sha256`, with a body of at most `max` bytes, is taken by
/// `accept`; then stops listening and returns (the answer sent). Each
/// connection is held at most `held` ([`CONNECTION_TIMEOUT`] for a real
/// hand-over).
pub async fn receive(
    listen: &str,
    cert: &str,
    key: &str,
    token_sha256: &str,
    max: usize,
    accept: Box<Accept>,
    held: Duration,
) -> Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(crate::tls::server_config_of(cert, key)?);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| Error::Listen {
            address: listen.to_string(),
            source,
        })?;
    info!(address = listen, "waiting for the hand-over");
    let (done, mut finished) = watch::channel(false);
    let shared = Arc::new(Shared {
        token_sha256: token_sha256.to_ascii_lowercase(),
        max,
        accept,
        taken: Mutex::new(false),
        done,
    });
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = async { let _ = finished.wait_for(|d| *d).await; } => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let serve = async move {
                let Ok(Ok(tls)) =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    let shared = shared.clone();
                    async move { Ok::<_, Infallible>(handle(shared, req).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            };
            // Dropped at its time, slot and all.
            let _ = tokio::time::timeout(held, serve).await;
        });
    }
    // The answer is on its way: its connection is given a few seconds to
    // deliver it (the client closes it then) before the caller moves on.
    drop(listener);
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        slots.acquire_many(MAX_CONNECTIONS as u32),
    )
    .await;
    info!("hand-over taken");
    Ok(())
}
