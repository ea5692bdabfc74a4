//! Commits by other controllers, heard at once: each store on PostgreSQL
//! keeps one session that `LISTEN`s on [`CHANNEL`], and that notifies it
//! after the store's own commits that wrote feed entries (its payload is
//! the schema, so environments sharing a database do not wake each other;
//! see [`NOTIFY`]). A notification only wakes other processes' watchers
//! sooner: they still read the feed from the last revision they saw, and
//! still poll, so a notification lost (the session cut, the server
//! restarted) costs at most one poll interval, never a change.
//!
//! The notification is sent here, not by the committing session: a
//! `NOTIFY` is a transaction of its own on the server (an id assigned,
//! the notification queue's lock taken, a commit), which a writer paid
//! for after every rule, one at a time. Here commits only mark a
//! notification owed ([`Listener::owe`]); the session sends one for
//! whatever was owed while the last one was under way, so a burst of
//! commits costs a few notifications, and the last commit of a burst is
//! always notified after it committed.
//!
//! Notifications are also spaced at least [`SPACING`] apart: a store that
//! commits one rule after another (an `add-unit` loop) otherwise had its
//! session notify after nearly every commit, a server transaction and a
//! wake of this thread each time, taking CPU from the writer's own
//! session on a small machine. Another controller hears a burst's last
//! commit at most [`SPACING`] later.

use std::future::poll_fn;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::AsyncMessage;

use super::PgTarget;

macro_rules! channel {
    () => {
        "jujube_changes"
    };
}

/// The channel commits that wrote feed entries notify.
pub(crate) const CHANNEL: &str = channel!();

/// What a store sends right after a commit that wrote feed entries: the
/// channel, and the environment's schema, so that environments sharing a
/// database do not wake each other.
pub(crate) const NOTIFY: &str = concat!(
    "SELECT pg_notify('",
    channel!(),
    "', current_schema()::text)"
);

/// The least time between two notifications a session sends.
pub(crate) const SPACING: Duration = Duration::from_millis(10);

/// How long a lost listening session waits before it tries again.
const RETRY: Duration = Duration::from_secs(1);

/// The listening session, ended when dropped.
pub(crate) struct Listener {
    _stop: oneshot::Sender<()>,
    /// A notification owed for commits made since the last one was sent
    /// (at most one permit: one owed is as good as many).
    owed: Arc<tokio::sync::Notify>,
}

impl Listener {
    /// Marks a notification owed for a commit that wrote feed entries:
    /// the session sends it (after the one under way, if any).
    pub(crate) fn owe(&self) {
        self.owed.notify_one();
    }
}

/// Starts listening for `target`'s commits on a thread of its own, calling
/// `wake` for each (and once after each new session, for what was
/// committed while none listened). Returns once the first session listens,
/// or has failed to (the thread keeps trying; the store polls meanwhile).
pub(crate) fn listen(target: &PgTarget, wake: impl Fn() + Send + 'static) -> Listener {
    let (stop_tx, mut stop) = oneshot::channel();
    let (ready_tx, ready) = std::sync::mpsc::sync_channel(1);
    let target = target.clone();
    let owed = Arc::new(tokio::sync::Notify::new());
    let listener = Listener {
        _stop: stop_tx,
        owed: owed.clone(),
    };
    let spawned = std::thread::Builder::new()
        .name("jujube-pg-listen".into())
        .spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                let _ = ready_tx.send(());
                return;
            };
            runtime.block_on(async move {
                let mut ready = Some(ready_tx);
                loop {
                    tokio::select! {
                        _ = session(&target, &wake, &owed, &mut ready) => {}
                        _ = &mut stop => return,
                    }
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => {}
                        _ = &mut stop => return,
                    }
                }
            });
        });
    if spawned.is_ok() {
        let _ = ready.recv();
    }
    listener
}

/// One listening session, until it is lost: wakes on other sessions'
/// notifications, and sends the ones owed.
async fn session(
    target: &PgTarget,
    wake: &impl Fn(),
    owed: &tokio::sync::Notify,
    ready: &mut Option<std::sync::mpsc::SyncSender<()>>,
) {
    let Ok(config) = target.config() else { return };
    // At most one wake waits here: one pending is as good as many, so
    // nothing grows with the rate of commits.
    let (heard_tx, mut heard) = mpsc::channel::<()>(1);
    let schema: Arc<OnceLock<(String, i32)>> = Arc::new(OnceLock::new());
    let driven = match &target.tls {
        None => config
            .connect(tokio_postgres::NoTls)
            .await
            .map(|(c, conn)| (c, tokio::spawn(drive(conn, schema.clone(), heard_tx)))),
        Some(tls) => config
            .connect(tokio_postgres_rustls::MakeRustlsConnect::new(
                (**tls).clone(),
            ))
            .await
            .map(|(c, conn)| (c, tokio::spawn(drive(conn, schema.clone(), heard_tx)))),
    };
    let Ok((client, driver)) = driven else {
        tracing::debug!(url = %target.url, "cannot open the session that listens for commits; polling meanwhile");
        return;
    };
    let listening = async {
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        let row = client
            .query_one("SELECT current_schema()::text, pg_backend_pid()", &[])
            .await?;
        Ok::<_, tokio_postgres::Error>((
            row.get::<_, Option<String>>(0).unwrap_or_default(),
            row.get::<_, i32>(1),
        ))
    };
    match listening.await {
        Ok(name_and_pid) => {
            let _ = schema.set(name_and_pid);
        }
        Err(_) => {
            driver.abort();
            return;
        }
    }
    // Whatever was committed before this session listened; before the
    // store is handed out, so that its first watchers owe no wake to it.
    wake();
    if let Some(r) = ready.take() {
        let _ = r.send(());
    }
    let mut pace = Pace::default();
    loop {
        tokio::select! {
            h = heard.recv() => match h {
                Some(()) => wake(),
                None => break,
            },
            // Hearing other sessions goes on while the next is paced.
            () = async { pace.wait().await; owed.notified().await } => {
                if client.batch_execute(NOTIFY).await.is_err() {
                    // Still owed: the next session sends it.
                    owed.notify_one();
                    break;
                }
                pace.sent();
            }
        }
    }
    driver.abort();
}

/// Keeps a session's notifications [`SPACING`] apart.
#[derive(Default)]
pub(crate) struct Pace {
    last: Option<tokio::time::Instant>,
}

impl Pace {
    /// Until [`SPACING`] has passed since the last notification sent.
    pub(crate) async fn wait(&self) {
        if let Some(last) = self.last {
            tokio::time::sleep_until(last + SPACING).await;
        }
    }

    /// A notification was sent now.
    pub(crate) fn sent(&mut self) {
        self.last = Some(tokio::time::Instant::now());
    }
}

/// Drives the session's socket, passing on what other sessions notified
/// for this store's schema (nothing before it is known: the session wakes
/// once when it is). Its own notifications are for this store's commits,
/// whose watchers were woken as they committed.
async fn drive<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    schema: Arc<OnceLock<(String, i32)>>,
    heard: mpsc::Sender<()>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        match poll_fn(|cx| conn.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notification(n))) => {
                if schema
                    .get()
                    .is_some_and(|(s, own)| s == n.payload() && *own != n.process_id())
                {
                    // Full: a wake is pending already.
                    let _ = heard.try_send(());
                }
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return,
        }
    }
}
