//! Opening the database and running transactions.

use crate::feed::ChangeKind;
use crate::pg::{PgTarget, Role};
use crate::schema::MIGRATIONS;
use crate::sql::{Begin, Connection, Engine, Open};
use crate::{Error, Result};
use jujube_wire::client::Access;
use rusqlite::{OpenFlags, OptionalExtension};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// How hard a commit tries to survive a power cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `synchronous = FULL`: a committed transaction survives power loss.
    /// What every environment uses.
    #[default]
    Full,
    /// `synchronous = OFF`: survives a process crash but not an OS crash.
    /// For throw-away databases in tests, where fsync time is noise.
    Relaxed,
}

/// Where an environment's state lives.
#[derive(Debug, Clone)]
pub enum Location {
    /// A SQLite file: the embedded default.
    File(PathBuf),
    /// A PostgreSQL database.
    Postgres(PgTarget),
}

/// How long SQLite itself waits for a lock before reporting busy, and how
/// many times [`Store::write`] then retries the whole transaction.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const BUSY_RETRIES: u32 = 8;

/// Counters a benchmark or an operator can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Committed write transactions.
    pub transactions: u64,
    /// Rows inserted, updated or deleted by the largest one.
    pub max_transaction_rows: u64,
    /// Pages the writer connection wrote to the WAL (SQLite's
    /// `SQLITE_DBSTATUS_CACHE_WRITE`): what a commit costs the disk. 0 on
    /// PostgreSQL.
    pub wal_pages: u64,
    /// `write` calls the writer connection made to the WAL: one a commit
    /// (see `walvfs`), where SQLite alone makes two a page. 0 on
    /// PostgreSQL, and where durability is relaxed.
    pub wal_writes: u64,
    /// Requests the writer connection sent to PostgreSQL (statements,
    /// `BEGIN`s, `COMMIT`s, `PREPARE`s), each answered apart; 0 on SQLite.
    pub pg_requests: u64,
}

struct Inner {
    conn: Mutex<Connection>,
    /// Connections for [`Store::read`]: in WAL mode readers wait neither
    /// for the writer (a long group commit, see
    /// [`Store::apply_batch`](crate::agents), never stalls the many agents
    /// reading their views meanwhile) nor for each other, so that reads
    /// on several threads (the API server answers reads on blocking
    /// threads) run side by side. [`READERS`] of them, opened as needed.
    readers: Vec<Mutex<Option<Connection>>>,
    /// Where the next read starts looking for a free reader.
    next_reader: AtomicU64,
    location: Location,
    durability: Durability,
    head: watch::Sender<u64>,
    /// On PostgreSQL, the session that hears other controllers' commits
    /// and wakes `head`'s watchers, and tells them of this store's (see
    /// `pg::listen`).
    listener: std::sync::OnceLock<crate::pg::listen::Listener>,
    transactions: AtomicU64,
    max_rows: AtomicU64,
    /// Bumped whenever an agent credential is set or replaced through this
    /// store: the API server re-checks a connection's cached credential
    /// when it moved.
    credential_epoch: AtomicU64,
}

/// A handle on one environment's state database. Cheap to clone; clones
/// share one connection, and several processes may each open the same file.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
    /// Set by [`Store::as_user`]: every transaction checks this user's
    /// access inside itself. `None`: the controller's own handle.
    user: Option<Arc<str>>,
    /// Set by [`Store::fenced`]: every write transaction checks that this
    /// lease is still held under this token (see [`crate::leases`]).
    fence: Option<Arc<crate::leases::Fence>>,
}

/// A write transaction in progress. Everything that changes the model goes
/// through one, and says what it changed with [`Tx::changed`].
pub struct Tx<'c> {
    tx: Open<'c>,
    last_revision: Option<u64>,
    /// Feed entries recorded and not yet written.
    pending: Vec<(&'static str, String)>,
}

impl std::ops::Deref for Tx<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.tx.conn()
    }
}

/// Feed entries written by one statement at most.
const FEED_CHUNK: usize = 32;

/// Rows at most that a multi-row statement takes exactly as many as
/// there are: the few rows most transactions write (an add-unit's three
/// feed entries) go in one statement — on PostgreSQL, one round trip.
const EXACT_ROWS: usize = 8;

/// How many of `rows` rows the next multi-row statement writes, at most
/// `max`: all of them up to [`EXACT_ROWS`], else the largest power of two
/// that fits, so that few statement texts exist (1 to 8, 16, 32, ...).
fn chunk_rows(rows: usize, max: usize) -> usize {
    if rows <= EXACT_ROWS.min(max) {
        return rows;
    }
    1 << (usize::BITS - 1 - rows.min(max).leading_zeros())
}

/// The statement that writes `n` feed entries (`n` a size
/// [`chunk_rows`] gives, up to [`FEED_CHUNK`]), made once per process: a
/// commit only looks it up.
fn feed_insert(engine: Engine, n: usize) -> &'static str {
    static TEXTS: std::sync::OnceLock<[Vec<String>; 2]> = std::sync::OnceLock::new();
    let texts = TEXTS.get_or_init(|| {
        // Indexed by the row count; sizes `chunk_rows` never gives stay
        // empty.
        let sizes =
            || (0..=FEED_CHUNK).map(|n| (n > 0 && chunk_rows(n, FEED_CHUNK) == n).then_some(n));
        let rows = |n: usize, row: &dyn Fn(usize) -> String| {
            (0..n).map(row).collect::<Vec<_>>().join(", ")
        };
        [
            sizes()
                .map(|n| {
                    let Some(n) = n else { return String::new() };
                    let rows = rows(n, &|i| format!("(?{}, ?{})", 2 * i + 1, 2 * i + 2));
                    format!("INSERT INTO changes (kind, id) VALUES {rows}")
                })
                .collect(),
            sizes()
                .map(|n| {
                    let Some(n) = n else { return String::new() };
                    let rows = rows(n, &|i| {
                        format!("({}, ?{}, ?{})", i + 1, 2 * i + 1, 2 * i + 2)
                    });
                    format!(
                        "INSERT INTO changes (revision, kind, id)
                         SELECT h.top + v.o, v.k, v.i
                         FROM (SELECT coalesce(max(revision), 0) AS top FROM changes) AS h,
                              (VALUES {rows}) AS v (o, k, i)
                         ORDER BY v.o
                         RETURNING revision"
                    )
                })
                .collect(),
        ]
    });
    let texts = match engine {
        Engine::Sqlite => &texts[0],
        Engine::Postgres => &texts[1],
    };
    &texts[n]
}

/// Rows one multi-row `INSERT` of [`insert_rows`] writes at most.
const ROWS_CHUNK: usize = 64;

/// Inserts `values.len() / width` rows with `head` (`INSERT INTO t (a, b)`),
/// `width` values a row, in multi-row statements of up to [`ROWS_CHUNK`]
/// rows (sized by [`chunk_rows`]): on PostgreSQL every statement is a
/// round trip to the server, and a batch of units was one per row. The
/// statements go with the transaction's next request
/// ([`Connection::insert_later`]): no rule reads an insert's result, and
/// its failure (a key taken by a concurrent writer) fails the transaction.
pub(crate) fn insert_rows(
    c: &Connection,
    head: &'static str,
    width: usize,
    values: &[&dyn crate::sql::ToSql],
) -> Result<()> {
    assert_eq!(values.len() % width, 0, "whole rows");
    let mut rest = values;
    while !rest.is_empty() {
        let n = chunk_rows(rest.len() / width, ROWS_CHUNK);
        let (chunk, tail) = rest.split_at(n * width);
        rest = tail;
        c.insert_later(rows_insert(head, width, n), chunk, n as u64)?;
    }
    Ok(())
}

/// The text of `head` with `n` rows of `width` placeholders, made once per
/// process (the heads are the code's own literals, the sizes a handful).
fn rows_insert(head: &'static str, width: usize, n: usize) -> &'static str {
    type Texts = std::collections::HashMap<(&'static str, usize), &'static str>;
    static TEXTS: std::sync::OnceLock<Mutex<Texts>> = std::sync::OnceLock::new();
    let mut texts = TEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    texts.entry((head, n)).or_insert_with(|| {
        let rows: Vec<String> = (0..n)
            .map(|r| {
                let row: Vec<String> = (1..=width).map(|i| format!("?{}", r * width + i)).collect();
                format!("({})", row.join(", "))
            })
            .collect();
        Box::leak(format!("{head} VALUES {}", rows.join(", ")).into_boxed_str())
    })
}

/// Feed entries as a feed insert's parameters, two a row.
fn feed_values<'a>(entries: &'a [(&'static str, String)]) -> Vec<&'a dyn crate::sql::ToSql> {
    entries
        .iter()
        .flat_map(|(k, id)| [k as &dyn crate::sql::ToSql, id as &dyn crate::sql::ToSql])
        .collect()
}

impl Tx<'_> {
    /// Records a change in the feed; the revision becomes visible to
    /// watchers when the transaction commits. The entries are written
    /// together just before the commit ([`Tx::write_changes`]): one
    /// statement where a rule made several (a unit, its machine and its
    /// service's count), which on PostgreSQL is one round trip instead of
    /// three.
    pub(crate) fn changed(&mut self, kind: ChangeKind, id: impl AsRef<str>) -> Result<()> {
        self.pending.push((kind.as_str(), id.as_ref().to_string()));
        Ok(())
    }

    /// Rows this connection has written, counting the feed entries
    /// recorded and not yet written: what bounds a step's size.
    pub(crate) fn rows_written(&self) -> u64 {
        self.total_changes() + self.pending.len() as u64
    }

    /// Writes the recorded feed entries, in the order they were recorded,
    /// and notes the last revision; on PostgreSQL all but the last
    /// statement's, which [`Tx::commit`] sends with the `COMMIT`.
    fn write_changes(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        let mut rest = &pending[..];
        while !rest.is_empty() {
            let n = chunk_rows(rest.len(), FEED_CHUNK);
            let (chunk, tail) = rest.split_at(n);
            if tail.is_empty() && self.engine() == Engine::Postgres {
                self.pending = chunk.to_vec();
                break;
            }
            rest = tail;
            let values = feed_values(chunk);
            let revision: i64 = match self.engine() {
                // The rowid is the largest revision plus one: SQLite's
                // single writer commits revisions in order.
                Engine::Sqlite => {
                    self.prepare_cached(feed_insert(Engine::Sqlite, n))?
                        .execute(&values[..])?;
                    self.last_insert_rowid().unwrap_or(0)
                }
                // The same rule spelt out, never a sequence: under
                // SERIALIZABLE two writers taking the same revision cannot
                // both commit (the second is a serialization failure,
                // retried), so revisions commit in order and a reader that
                // has seen N has seen everything before it. (A sequence
                // hands out numbers that commit in any order.) Measured too
                // slow for SQLite, where the rowid does it for free.
                Engine::Postgres => self
                    .prepare_cached(feed_insert(Engine::Postgres, n))?
                    .query_map(&values[..], |r| r.get::<_, i64>(0))?
                    .try_fold(0, |top, r| r.map(|r| top.max(r)))?,
            };
            self.last_revision = Some(revision as u64);
        }
        Ok(())
    }

    /// Commits, with the feed entries [`Tx::write_changes`] left (one
    /// statement's, on PostgreSQL) sent together with the `COMMIT`: the
    /// last revision, if the transaction wrote any.
    fn commit(self) -> Result<Option<u64>> {
        if self.pending.is_empty() {
            self.tx.commit()?;
            return Ok(self.last_revision);
        }
        let n = self.pending.len();
        let values = feed_values(&self.pending);
        let revisions =
            self.tx
                .query_and_commit(feed_insert(Engine::Postgres, n), &values[..], |r| {
                    r.get::<_, i64>(0)
                })?;
        Ok(revisions.into_iter().max().map(|r| r as u64))
    }

    /// Runs `f` inside a savepoint of this transaction: if `f` fails, what it
    /// did (feed entries included) is undone and the transaction goes on
    /// without it. Several independent operations can so share one commit.
    ///
    /// A failure for another transaction's writes (SQLite busy, a
    /// PostgreSQL serialization failure) is not the operation's: the whole
    /// transaction then fails at its end and runs again.
    pub(crate) fn savepoint<T>(&mut self, f: impl FnOnce(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        let pending = self.pending.len();
        let doomed = self.failed().is_some();
        self.execute_batch("SAVEPOINT op")?;
        // What the op kept to send later fails the op, not the release.
        match f(self).and_then(|v| Ok(self.send_kept().map(|()| v)?)) {
            Ok(v) => {
                self.execute_batch("RELEASE op")?;
                Ok(v)
            }
            Err(e) => {
                self.execute_batch("ROLLBACK TO op; RELEASE op")?;
                if !doomed {
                    self.rolled_back_to_savepoint();
                }
                self.pending.truncate(pending);
                Err(e)
            }
        }
    }

    /// Takes the next value of a named sequence.
    pub(crate) fn next_in_sequence(&self, name: &str) -> Result<i64> {
        let n: i64 = self
            .prepare_cached(
                "INSERT INTO sequences (name, next) VALUES (?1, 1)
                 ON CONFLICT (name) DO UPDATE SET next = sequences.next + 1
                 RETURNING next - 1",
            )?
            .query_row([name], |r| r.get(0))?;
        Ok(n)
    }
}

/// Process-wide SQLite settings, made once before the first connection
/// (SQLite takes them only then).
///
/// Statement journals are kept in memory in small chunks. A statement
/// that may fail half-way (an upsert, a foreign key check: most of the
/// store's writes) inside a transaction keeps the pages it changes in
/// a statement journal; by default that journal starts as one 64 KiB
/// allocation, which glibc's malloc takes from the top of the heap and
/// gives back at its free, two `brk` calls per statement. A statement
/// journal holds only the pages its statement changed, and no
/// transaction here changes more than a thousand rows.
///
/// No memory statistics are kept: the store never reads them, and
/// keeping them takes a process-wide mutex around each of SQLite's
/// allocations (about twenty in an add-unit).
fn configure_sqlite() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: called before any connection of this process is opened
        // (SQLite refuses it with SQLITE_MISUSE, harmlessly, otherwise),
        // with the one int argument this option takes.
        let rc = unsafe {
            rusqlite::ffi::sqlite3_config(
                rusqlite::ffi::SQLITE_CONFIG_STMTJRNL_SPILL,
                -1 as std::os::raw::c_int,
            )
        };
        // SAFETY: as above; this option also takes one int.
        let rc2 = unsafe {
            rusqlite::ffi::sqlite3_config(
                rusqlite::ffi::SQLITE_CONFIG_MEMSTATUS,
                0 as std::os::raw::c_int,
            )
        };
        if rc != rusqlite::ffi::SQLITE_OK || rc2 != rusqlite::ffi::SQLITE_OK {
            tracing::debug!(
                rc,
                rc2,
                "sqlite was initialised before the store: it keeps its default configuration"
            );
        }
    });
}

/// A transaction that failed only because of another's (SQLite's busy
/// database, PostgreSQL's serialization failure): run it again.
fn is_busy(e: &Error) -> bool {
    matches!(e, Error::Database(e) if crate::sql::is_retryable(e))
}

/// How long a transaction waits for PostgreSQL to take sessions again
/// after its connection was lost (a restart, a failover), trying again
/// every [`RECONNECT_EVERY`].
pub const RECONNECT_FOR: Duration = Duration::from_secs(60);
const RECONNECT_EVERY: Duration = Duration::from_millis(250);

/// Whether `e` says the connection was lost or the server takes no
/// sessions now (see [`crate::sql::is_connection_lost`]).
fn connection_lost(e: &Error) -> bool {
    match e {
        Error::Database(e) => crate::sql::is_connection_lost(e),
        Error::Unreachable { .. } => true,
        _ => false,
    }
}

/// Whether to try a lost connection again: the first loss starts the
/// clock; within [`RECONNECT_FOR`] of it, waits [`RECONNECT_EVERY`] and
/// says yes.
fn still_waiting(lost: &mut Option<std::time::Instant>) -> bool {
    let since = *lost.get_or_insert_with(std::time::Instant::now);
    if since.elapsed() >= RECONNECT_FOR {
        return false;
    }
    tracing::warn!("the connection to the state database was lost; trying again");
    std::thread::sleep(RECONNECT_EVERY);
    true
}

impl Store {
    /// Opens (creating if needed) the database at `path` and brings its
    /// schema up to date.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        Store::open_with(path, Durability::Full)
    }

    /// The database, its WAL and shared-memory files are the owner's
    /// alone (0600: relation settings hold charms' passwords): a new
    /// database is created so (SQLite gives its WAL the database's mode),
    /// and an existing one is tightened at open.
    pub fn open_with(path: impl AsRef<Path>, durability: Durability) -> Result<Store> {
        Store::open_at(&Location::File(path.as_ref().to_path_buf()), durability)
    }

    /// Opens the store at `location`, bringing its schema up to date.
    pub fn open_at(location: &Location, durability: Durability) -> Result<Store> {
        let (conn, reader) = match location {
            Location::File(path) => (open_sqlite(path, durability)?, open_reader(location)?),
            Location::Postgres(target) => {
                let conn = crate::pg::connect(target, Role::Writer(durability))?;
                crate::pg::check_collation(&conn, target)?;
                crate::pg::migrate(&conn)?;
                (conn, open_reader(location)?)
            }
        };
        let head: i64 =
            conn.query_row("SELECT coalesce(max(revision), 0) FROM changes", [], |r| {
                r.get(0)
            })?;
        let (tx, _) = watch::channel(head as u64);
        let store = Store {
            inner: Arc::new(Inner {
                conn: Mutex::new(conn),
                readers: std::iter::once(Some(reader))
                    .chain(std::iter::repeat_with(|| None))
                    .take(READERS)
                    .map(Mutex::new)
                    .collect(),
                next_reader: AtomicU64::new(0),
                location: location.clone(),
                durability,
                head: tx,
                listener: std::sync::OnceLock::new(),
                transactions: AtomicU64::new(0),
                max_rows: AtomicU64::new(0),
                credential_epoch: AtomicU64::new(0),
            }),
            user: None,
            fence: None,
        };
        if let Location::Postgres(target) = location {
            // A weak handle: the session ends with the store.
            let inner = Arc::downgrade(&store.inner);
            let listener = crate::pg::listen::listen(target, move || {
                if let Some(inner) = inner.upgrade() {
                    inner.head.send_modify(|_| {});
                }
            });
            let _ = store.inner.listener.set(listener);
        }
        Ok(store)
    }

    /// A handle on the same database acting for `user`: each of its
    /// transactions reads the user's access inside itself first and
    /// refuses with [`Error::Forbidden`] unless it is enough (see
    /// [`crate::users`]).
    pub fn as_user(&self, user: &str) -> Store {
        Store {
            inner: self.inner.clone(),
            user: Some(user.into()),
            fence: self.fence.clone(),
        }
    }

    pub(crate) fn with_fence(&self, fence: Option<Arc<crate::leases::Fence>>) -> Store {
        Store {
            inner: self.inner.clone(),
            user: self.user.clone(),
            fence,
        }
    }

    /// The fence of a handle made by [`Store::fenced`].
    pub fn fence(&self) -> Option<&crate::leases::Fence> {
        self.fence.as_deref()
    }

    /// The user this handle acts for ([`Store::as_user`]).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// Deletes the environment's state where the store's own files do not
    /// hold it: on PostgreSQL, every table and function the store made
    /// (nothing else of the database). A SQLite file is deleted with its
    /// environment's directory.
    pub fn erase(self) -> Result<()> {
        match &self.inner.location {
            Location::File(_) => Ok(()),
            Location::Postgres(_) => crate::pg::erase(&*self.writer()?),
        }
    }

    /// The SQLite file, for a store on one.
    pub fn path(&self) -> Option<&Path> {
        match &self.inner.location {
            Location::File(p) => Some(p),
            Location::Postgres(_) => None,
        }
    }

    pub fn location(&self) -> &Location {
        &self.inner.location
    }

    pub fn stats(&self) -> StoreStats {
        let conn = self.lock();
        let sqlite = conn.as_sqlite();
        StoreStats {
            transactions: self.inner.transactions.load(Ordering::Relaxed),
            max_transaction_rows: self.inner.max_rows.load(Ordering::Relaxed),
            wal_pages: sqlite.map_or(0, |c| pages_written(c, false)),
            wal_writes: sqlite
                .and_then(|c| crate::walvfs::writes(c, false))
                .unwrap_or(0),
            pg_requests: conn.requests(false).unwrap_or(0),
        }
    }

    /// Moves on whenever an agent credential is set or replaced through
    /// this store (see [`Store::agent_credential`]).
    pub fn credential_epoch(&self) -> u64 {
        self.inner.credential_epoch.load(Ordering::Acquire)
    }

    pub(crate) fn credentials_changed(&self) {
        self.inner.credential_epoch.fetch_add(1, Ordering::AcqRel);
    }

    pub fn reset_stats(&self) {
        self.inner.transactions.store(0, Ordering::Relaxed);
        self.inner.max_rows.store(0, Ordering::Relaxed);
        if let Some(c) = self.lock().as_sqlite() {
            pages_written(c, true);
            crate::walvfs::writes(c, true);
        }
        self.lock().requests(true);
    }

    pub(crate) fn head_receiver(&self) -> watch::Receiver<u64> {
        self.inner.head.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave a transaction open
        // (dropping it rolls back), so a poisoned lock is still usable.
        self.inner.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The writer, connected again if the server closed it (PostgreSQL
    /// restarted): a transaction cut off so failed and is not retried
    /// (it may have committed), the next one runs on a new connection.
    fn writer(&self) -> Result<MutexGuard<'_, Connection>> {
        let mut conn = self.lock();
        if conn.is_closed() {
            if let Location::Postgres(target) = &self.inner.location {
                *conn = crate::pg::connect(target, Role::Writer(self.inner.durability))?;
            }
        }
        Ok(conn)
    }

    /// A reader connection: the first free one from a rotating start, or
    /// else the start's (waiting for it). Opened on first use.
    fn lock_reader(&self) -> Result<MutexGuard<'_, Option<Connection>>> {
        let readers = &self.inner.readers;
        let start = self.inner.next_reader.fetch_add(1, Ordering::Relaxed) as usize;
        let mut guard = None;
        for k in 0..readers.len() {
            match readers[(start + k) % readers.len()].try_lock() {
                Ok(g) => {
                    guard = Some(g);
                    break;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    guard = Some(p.into_inner());
                    break;
                }
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        let mut guard = match guard {
            Some(g) => g,
            None => readers[start % readers.len()]
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        };
        if guard.as_ref().is_none_or(Connection::is_closed) {
            *guard = Some(open_reader(&self.inner.location)?);
        }
        Ok(guard)
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction and commits it if `f`
    /// succeeds; if `f` fails, nothing it did is kept.
    ///
    /// `f` must read everything it decides on through the transaction it is
    /// given: it may run more than once, because a transaction that finds the
    /// database busy is retried from the start.
    pub(crate) fn write<T>(&self, f: impl FnMut(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        self.write_at(Access::Write, f)
    }

    /// [`Store::write`] for a method that needs `needs` of a user handle
    /// ([`Store::as_user`]); checked first thing in the transaction.
    pub(crate) fn write_at<T>(
        &self,
        needs: Access,
        f: impl FnMut(&mut Tx<'_>) -> Result<T>,
    ) -> Result<T> {
        self.off_runtime(|| self.write_in(needs, f))
    }

    /// A transaction's whole wait — on the server, on the writer or a
    /// reader, between retries — off the runtime worker that called the
    /// store, where the state is in PostgreSQL: the in-process agents, the
    /// API server and the lease's renewals share a controller's workers,
    /// and a worker blocked on the network for each store call starved
    /// them all (the lease then missed its deadline under a deploy, and
    /// moved). On SQLite a call is a few microseconds of the worker's own
    /// CPU, and stays where it is.
    fn off_runtime<T>(&self, f: impl FnOnce() -> T) -> T {
        let multi_thread = || {
            tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        };
        if matches!(self.inner.location, Location::Postgres(_)) && multi_thread() {
            tokio::task::block_in_place(f)
        } else {
            f()
        }
    }

    fn write_in<T>(&self, needs: Access, mut f: impl FnMut(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        let mut conn = self.lock();
        let mut attempt = 0;
        // A connection lost once its COMMIT was sent leaves unknown
        // whether the transaction was kept, so it is not run again
        // (`Connection::commit_sent`).
        let mut lost: Option<std::time::Instant> = None;
        loop {
            if conn.is_closed() {
                if let Location::Postgres(target) = &self.inner.location {
                    match crate::pg::connect(target, Role::Writer(self.inner.durability)) {
                        Ok(c) => *conn = c,
                        Err(e) if connection_lost(&e) && still_waiting(&mut lost) => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
            let before = conn.total_changes();
            let run = (|| {
                let mut tx = Tx {
                    tx: Open::begin(&conn, Begin::Write)?,
                    last_revision: None,
                    pending: Vec::new(),
                };
                if let Some(user) = &self.user {
                    crate::users::require_access(&tx, user, needs)?;
                }
                if let Some(fence) = &self.fence {
                    crate::leases::require_fence(&tx, fence)?;
                }
                // On PostgreSQL, a statement that failed for another
                // transaction's writes (a read swallowed as "not found")
                // makes every later one fail as "transaction aborted":
                // the first failure is the transaction's, and is retried.
                let value = match f(&mut tx).and_then(|v| tx.write_changes().map(|()| v)) {
                    Ok(v) => v,
                    Err(e) => match tx.failed() {
                        Some(first) if crate::sql::is_retryable(&first) => return Err(first.into()),
                        _ => return Err(e),
                    },
                };
                // A statement that failed on PostgreSQL aborted the
                // transaction even if the rule went on (a savepoint rolled
                // back, an error taken for "not found"): never commit it.
                if let Some(e) = tx.failed() {
                    return Err(e.into());
                }
                // (On PostgreSQL the last feed entries go with the COMMIT,
                // in one round trip: a connection lost then is as lost
                // during the COMMIT. Lost while their statement is first
                // prepared, before that, nothing was sent to commit.)
                let revision = tx.commit()?;
                Ok((value, revision))
            })();
            match run {
                Ok((value, revision)) => {
                    let rows = conn.total_changes() - before;
                    self.inner.transactions.fetch_add(1, Ordering::Relaxed);
                    self.inner.max_rows.fetch_max(rows, Ordering::Relaxed);
                    if let Some(rev) = revision {
                        self.inner.head.send_replace(rev);
                        if let Some(listener) = self.inner.listener.get() {
                            listener.owe();
                        }
                    }
                    return Ok(value);
                }
                Err(e) if is_busy(&e) && attempt < BUSY_RETRIES => {
                    attempt += 1;
                    // Back off with a little jitter so that competing
                    // processes do not retry in lockstep.
                    // (Two stores of one process, or one's threads, too.)
                    let jitter = {
                        use std::hash::{BuildHasher, Hasher};
                        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                        h.write_u32(attempt);
                        h.finish() % 13
                    };
                    std::thread::sleep(Duration::from_millis(10 * attempt as u64 + jitter));
                }
                // Lost before its commit: nothing of it was kept; run it
                // again on a new connection once the server answers.
                Err(e)
                    if !conn.commit_sent() && connection_lost(&e) && still_waiting(&mut lost) =>
                {
                    conn.mark_closed();
                }
                // Lost with its COMMIT in flight: the server may have kept
                // it. Said so, never as "unavailable", which a client
                // would answer by sending it again.
                Err(Error::Database(e))
                    if conn.commit_sent() && crate::sql::is_connection_lost(&e) =>
                {
                    conn.mark_closed();
                    return Err(Error::CommitUnknown(e));
                }
                Err(Error::Database(e)) if crate::sql::is_unique_violation(&e) => {
                    return Err(Error::Database(e))
                }
                Err(e) if is_busy(&e) => {
                    return Err(Error::Busy {
                        attempts: attempt + 1,
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs `f` on a read snapshot: everything it reads is from one
    /// committed state, whatever other writers do meanwhile.
    pub(crate) fn read<T>(&self, f: impl FnMut(&Connection) -> Result<T>) -> Result<T> {
        self.read_at(Access::Read, f)
    }

    /// [`Store::read`] needing `needs` of a user handle.
    pub(crate) fn read_at<T>(
        &self,
        needs: Access,
        mut f: impl FnMut(&Connection) -> Result<T>,
    ) -> Result<T> {
        let user = self.user.clone();
        self.read_unchecked(|c| {
            if let Some(user) = &user {
                crate::users::require_access(c, user, needs)?;
            }
            f(c)
        })
    }

    /// A read no user check applies to (the login itself).
    ///
    /// A read whose connection to PostgreSQL was lost (the server
    /// restarting) runs again on a new one, for up to [`RECONNECT_FOR`].
    pub(crate) fn read_unchecked<T>(&self, f: impl FnMut(&Connection) -> Result<T>) -> Result<T> {
        self.off_runtime(|| self.read_in(f))
    }

    fn read_in<T>(&self, mut f: impl FnMut(&Connection) -> Result<T>) -> Result<T> {
        let mut lost: Option<std::time::Instant> = None;
        loop {
            let run = (|| {
                let guard = self.lock_reader()?;
                let conn = guard.as_ref().expect("opened by lock_reader");
                let r = (|| {
                    let tx = Open::begin(conn, Begin::Read)?;
                    let value = f(tx.conn())?;
                    tx.commit()?;
                    Ok(value)
                })();
                if r.as_ref().is_err_and(connection_lost) {
                    conn.mark_closed();
                }
                r
            })();
            match run {
                Err(e) if connection_lost(&e) && still_waiting(&mut lost) => {}
                r => return r,
            }
        }
    }
}

/// The SQLite writer connection, the file made private and migrated.
fn open_sqlite(path: &Path, durability: Durability) -> Result<Connection> {
    configure_sqlite();
    private_files(path)?;
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    // A commit's WAL frames in one write (see `walvfs`), where every
    // commit is synced: the VFS relies on that sync.
    let conn = if durability == Durability::Full && crate::walvfs::register() {
        rusqlite::Connection::open_with_flags_and_vfs(path, flags, crate::walvfs::NAME)?
    } else {
        rusqlite::Connection::open_with_flags(path, flags)?
    };
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // Before anything is written; a no-op for an existing database.
    conn.pragma_update(None, "page_size", PAGE_SIZE)?;
    // WAL lets readers in other processes run while one writes.
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(
        None,
        "synchronous",
        match durability {
            Durability::Full => "FULL",
            Durability::Relaxed => "OFF",
        },
    )?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    stable_plans(&conn)?;
    conn.set_prepared_statement_cache_capacity(128);
    migrate(&conn)?;
    Ok(Connection::sqlite(conn))
}

/// The page size of new SQLite stores, a quarter of SQLite's default. A
/// commit's fsync costs about what the bytes it carries cost (the 4 KiB
/// blocks of the WAL it dirties), and a rule's commit touches a handful of
/// B-trees, one leaf each, changing a row or two of it: an add-unit wrote
/// eight 4 KiB pages (33 KB) for a few hundred bytes of rows, and writes
/// ten 1 KiB pages (10 KB) so. Deeper trees cost scans a little (the
/// store benchmark's `status` and deploy at 100,000 units); a store made
/// before keeps its page size (SQLite cannot change it in WAL mode).
const PAGE_SIZE: i64 = 1024;

/// Pages `conn` wrote (to the WAL, in WAL mode) since it opened or this
/// was last asked with `reset`.
pub fn pages_written(conn: &rusqlite::Connection, reset: bool) -> u64 {
    let (mut current, mut high) = (0, 0);
    // SAFETY: the handle is `conn`'s own, open for the call; the status
    // call only reads counters.
    let rc = unsafe {
        rusqlite::ffi::sqlite3_db_status(
            conn.handle(),
            rusqlite::ffi::SQLITE_DBSTATUS_CACHE_WRITE,
            &mut current,
            &mut high,
            i32::from(reset),
        )
    };
    if rc == rusqlite::ffi::SQLITE_OK {
        current.max(0) as u64
    } else {
        0
    }
}

/// How many reader connections a store keeps: one per core of a small
/// controller and then some (each holds its statement cache and page
/// cache; more would only wait for CPU).
const READERS: usize = 4;

/// A connection for reads only.
fn open_reader(location: &Location) -> Result<Connection> {
    let path = match location {
        Location::File(path) => path,
        Location::Postgres(target) => return crate::pg::connect(target, Role::Reader),
    };
    let reader = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    reader.busy_timeout(BUSY_TIMEOUT)?;
    reader.pragma_update(None, "query_only", "ON")?;
    stable_plans(&reader)?;
    reader.set_prepared_statement_cache_capacity(128);
    Ok(Connection::sqlite(reader))
}

/// Turns on SQLite's query planner stability guarantee. Without it, a
/// statement whose plan the planner found could depend on a bound value
/// (an integer compared with `=`, an `ORDER BY` next to `col = ?1`) is
/// marked to be re-prepared whenever that value changes, so a cached
/// statement was parsed and planned again on every use: the agents' reads,
/// `unit_context` above all, spent most of their time in SQLite's parser.
/// Our queries gain nothing from per-value plans (no `ANALYZE` statistics).
fn stable_plans(conn: &rusqlite::Connection) -> Result<()> {
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    Ok(())
}

fn migrate(conn: &rusqlite::Connection) -> Result<()> {
    let known = MIGRATIONS.len() as i64;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version > known {
        return Err(Error::SchemaTooNew {
            found: version,
            known,
        });
    }
    if version == known {
        return Ok(());
    }
    // Some migrations rebuild a table that others reference: SQLite's way
    // is with foreign keys off (they cannot be turned off inside a
    // transaction), checked before the commit.
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    let migrated = migrate_in(conn);
    conn.pragma_update(None, "foreign_keys", "ON")?;
    migrated
}

fn migrate_in(conn: &rusqlite::Connection) -> Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let result = (|| {
        // Re-read under the write lock: another process may have migrated.
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            conn.execute_batch(sql)?;
            conn.pragma_update(None, "user_version", i as i64 + 1)?;
        }
        let broken: Option<String> = conn
            .query_row("PRAGMA foreign_key_check", [], |r| r.get(0))
            .optional()?;
        if let Some(table) = broken {
            return Err(Error::Corrupt {
                what: "foreign key after a migration",
                value: table,
            });
        }
        Ok::<_, Error>(())
    })();
    match result {
        Ok(()) => conn.execute_batch("COMMIT")?,
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            return Err(e);
        }
    }
    Ok(())
}

/// Creates the database file 0600 if it is not there, and takes group and
/// other permissions off it and its WAL and shared-memory files if they
/// are.
fn private_files(path: &Path) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(e)),
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let p = std::path::PathBuf::from(p);
        if let Ok(meta) = std::fs::metadata(&p) {
            let mode = meta.permissions().mode();
            if mode & 0o077 != 0 {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o700))
                    .map_err(io)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod chunks {
    use super::{chunk_rows, EXACT_ROWS, FEED_CHUNK};

    #[test]
    fn a_few_rows_go_in_one_statement_and_many_in_few_sizes() {
        // An add-unit's three feed entries: one statement.
        assert_eq!(chunk_rows(3, FEED_CHUNK), 3);
        let mut sizes = std::collections::BTreeSet::new();
        for total in 1..=300 {
            let (mut rest, mut statements) = (total, 0);
            while rest > 0 {
                let n = chunk_rows(rest, FEED_CHUNK);
                assert!((1..=rest.min(FEED_CHUNK)).contains(&n), "{total}: {n}");
                sizes.insert(n);
                rest -= n;
                statements += 1;
            }
            if total <= EXACT_ROWS {
                assert_eq!(statements, 1, "{total}");
            }
            assert!(
                statements <= total / FEED_CHUNK + 6,
                "{total}: {statements}"
            );
        }
        assert_eq!(
            sizes.into_iter().collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
        );
    }
}
