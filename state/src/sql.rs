//! The seam between the store's SQL and the engine that runs it.
//!
//! Every rule of the store is written once, against [`Connection`]: the
//! statements, their parameters and their rows go through here, never
//! through an engine's own types. Today the engine is SQLite (rusqlite);
//! the PostgreSQL backend plugs in behind the same methods (an `Engine`
//! arm each, with the placeholders, types and upserts that differ
//! translated here), so that the rules do not change.
//!
//! # Layout
//!
//! - [`Connection`]: one engine connection, owned by the store (its writer,
//!   or a reader). Transactions are begun and ended by the store
//!   ([`Connection::begin`], [`Connection::commit`],
//!   [`Connection::rollback`]), never by a rule.
//! - The statement, row and parameter vocabulary the rules use
//!   ([`Row`], [`Params`], [`ToSql`], [`FromSql`], [`OptionalExtension`],
//!   [`params!`](crate::sql::params)), with rusqlite's meaning for now.
//! - [`Connection::sqlite`]: what only SQLite has (pragmas, the WAL's
//!   counters, migrations' `user_version`), for the store's own SQLite
//!   code and its tests.

pub use rusqlite::types::{FromSql, ToSql};
pub use rusqlite::{params, OptionalExtension, Params, Row};

/// What a statement fails with.
pub type Error = rusqlite::Error;
pub type Result<T, E = Error> = std::result::Result<T, E>;
/// A prepared statement, kept in the connection's cache.
pub type Statement<'c> = rusqlite::CachedStatement<'c>;
/// A statement prepared for one use (its text built at run time).
pub type OnceStatement<'c> = rusqlite::Statement<'c>;

/// Whether a statement failed only because another connection held the
/// database (SQLite's busy or locked): the transaction is to be run again
/// whole.
pub(crate) fn is_busy(e: &Error) -> bool {
    use rusqlite::ErrorCode;
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == ErrorCode::DatabaseBusy || f.code == ErrorCode::DatabaseLocked)
}

/// How a transaction takes the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// Writes: the write lock from the start, so that the transaction is
    /// never refused half-way for another writer (SQLite's `IMMEDIATE`).
    Write,
    /// Reads: one snapshot for the whole transaction.
    Read,
}

enum Engine {
    Sqlite(rusqlite::Connection),
}

/// One connection to the state database.
pub struct Connection {
    engine: Engine,
}

impl Connection {
    pub(crate) fn sqlite(conn: rusqlite::Connection) -> Connection {
        Connection {
            engine: Engine::Sqlite(conn),
        }
    }

    /// The SQLite connection underneath, for what only SQLite has.
    pub(crate) fn as_sqlite(&self) -> &rusqlite::Connection {
        match &self.engine {
            Engine::Sqlite(c) => c,
        }
    }

    /// A statement, prepared once per connection and kept.
    pub fn prepare_cached(&self, sql: &str) -> Result<Statement<'_>> {
        match &self.engine {
            Engine::Sqlite(c) => c.prepare_cached(sql),
        }
    }

    /// A statement prepared for one use, not cached (its text varies).
    pub fn prepare(&self, sql: &str) -> Result<OnceStatement<'_>> {
        match &self.engine {
            Engine::Sqlite(c) => c.prepare(sql),
        }
    }

    /// A statement run once: rows changed.
    pub fn execute<P: Params>(&self, sql: &str, params: P) -> Result<usize> {
        match &self.engine {
            Engine::Sqlite(c) => c.execute(sql, params),
        }
    }

    /// The first row of a statement run once.
    pub fn query_row<T, P: Params, F: FnOnce(&Row<'_>) -> Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> Result<T> {
        match &self.engine {
            Engine::Sqlite(c) => c.query_row(sql, params, f),
        }
    }

    /// Statements without parameters, one after the other.
    pub fn execute_batch(&self, sql: &str) -> Result<()> {
        match &self.engine {
            Engine::Sqlite(c) => c.execute_batch(sql),
        }
    }

    /// The id the last insert gave its row.
    pub fn last_insert_rowid(&self) -> i64 {
        match &self.engine {
            Engine::Sqlite(c) => c.last_insert_rowid(),
        }
    }

    /// Rows inserted, updated or deleted since the connection opened.
    pub(crate) fn total_changes(&self) -> u64 {
        match &self.engine {
            Engine::Sqlite(c) => c.total_changes(),
        }
    }

    pub(crate) fn begin(&self, how: Begin) -> Result<()> {
        match &self.engine {
            Engine::Sqlite(c) => c.execute_batch(match how {
                Begin::Write => "BEGIN IMMEDIATE",
                Begin::Read => "BEGIN DEFERRED",
            }),
        }
    }

    pub(crate) fn commit(&self) -> Result<()> {
        match &self.engine {
            Engine::Sqlite(c) => c.execute_batch("COMMIT"),
        }
    }

    /// Undoes an open transaction; nothing if none is open.
    pub(crate) fn rollback(&self) {
        match &self.engine {
            Engine::Sqlite(c) => {
                if !c.is_autocommit() {
                    let _ = c.execute_batch("ROLLBACK");
                }
            }
        }
    }
}

/// An open transaction that is rolled back unless committed (a rule that
/// fails, or panics, keeps nothing).
pub(crate) struct Open<'c> {
    conn: &'c Connection,
    done: bool,
}

impl<'c> Open<'c> {
    pub(crate) fn begin(conn: &'c Connection, how: Begin) -> Result<Open<'c>> {
        conn.begin(how)?;
        Ok(Open { conn, done: false })
    }

    pub(crate) fn conn(&self) -> &'c Connection {
        self.conn
    }

    pub(crate) fn commit(mut self) -> Result<()> {
        self.done = true;
        let r = self.conn.commit();
        if r.is_err() {
            self.conn.rollback();
        }
        r
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.conn.rollback();
        }
    }
}
