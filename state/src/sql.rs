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
//! - The statement, row and parameter vocabulary the rules use:
//!   [`Statement`], [`Row`], [`Rows`], [`Params`], [`ToSql`] and
//!   [`FromSql`] (the values every engine binds and reads; their bounds
//!   are the engines' own traits), [`OptionalExtension`],
//!   [`params!`](crate::sql::params).
//! - [`Connection::sqlite`]: what only SQLite has (pragmas, the WAL's
//!   counters, migrations' `user_version`), for the store's own SQLite
//!   code and its tests.

/// What a statement fails with: the engine's error, as it said it, or a
/// row asked for that is not there.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("no row found")]
    NoRows,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `.optional()`: a statement's missing row as `None`.
pub trait OptionalExtension<T> {
    fn optional(self) -> Result<Option<T>>;
}

impl<T> OptionalExtension<T> for Result<T> {
    fn optional(self) -> Result<Option<T>> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(Error::NoRows) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A value a statement can be given: what every engine can bind. (Each
/// engine's own trait is a bound of this one, so that a value is bound as
/// it is by whichever engine runs the statement.)
pub trait ToSql: rusqlite::ToSql {}
impl<T: rusqlite::ToSql + ?Sized> ToSql for T {}

/// A value a row's column can be read as, by every engine.
pub trait FromSql: rusqlite::types::FromSql {}
impl<T: rusqlite::types::FromSql> FromSql for T {}

/// A statement's parameters: `()`, `[]`, a tuple or an array of values,
/// `&[&dyn ToSql]`, or [`params!`](crate::sql::params).
pub trait Params {
    fn values(&self) -> Vec<&dyn ToSql>;
}

impl Params for () {
    fn values(&self) -> Vec<&dyn ToSql> {
        Vec::new()
    }
}

impl Params for [&dyn ToSql; 0] {
    fn values(&self) -> Vec<&dyn ToSql> {
        Vec::new()
    }
}

impl Params for &[&dyn ToSql] {
    fn values(&self) -> Vec<&dyn ToSql> {
        self.to_vec()
    }
}

macro_rules! array_params {
    ($($n:literal)+) => {
        $(impl<T: ToSql> Params for [T; $n] {
            fn values(&self) -> Vec<&dyn ToSql> {
                self.iter().map(|v| v as &dyn ToSql).collect()
            }
        })+
    };
}
array_params!(1 2 3 4 5 6 7 8);

macro_rules! tuple_params {
    ($($t:ident $i:tt),+) => {
        impl<$($t: ToSql),+> Params for ($($t,)+) {
            fn values(&self) -> Vec<&dyn ToSql> {
                vec![$(&self.$i as &dyn ToSql),+]
            }
        }
    };
}
tuple_params!(A 0);
tuple_params!(A 0, B 1);
tuple_params!(A 0, B 1, C 2);
tuple_params!(A 0, B 1, C 2, D 3);
tuple_params!(A 0, B 1, C 2, D 3, E 4);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);
tuple_params!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11);

/// Parameters of mixed types, as a slice.
#[macro_export]
macro_rules! sql_params {
    ($($p:expr),* $(,)?) => {
        &[$(&$p as &dyn $crate::sql::ToSql),*] as &[&dyn $crate::sql::ToSql]
    };
}
pub use crate::sql_params as params;

/// The engine's view of our parameters.
fn sqlite_params(p: &impl Params) -> Vec<&dyn rusqlite::ToSql> {
    p.values()
        .into_iter()
        .map(|v| v as &dyn rusqlite::ToSql)
        .collect()
}

/// A column's place in a row (from 0).
pub trait Column {
    fn column(self) -> usize;
}

impl Column for usize {
    fn column(self) -> usize {
        self
    }
}

/// One row of a result.
pub struct Row<'r> {
    inner: &'r rusqlite::Row<'r>,
}

impl Row<'_> {
    /// Column `idx` (from 0) as a `T`.
    pub fn get<I: Column, T: FromSql>(&self, idx: I) -> Result<T> {
        Ok(self.inner.get(idx.column())?)
    }
}

enum Prepared<'c> {
    Cached(rusqlite::CachedStatement<'c>),
    Once(rusqlite::Statement<'c>),
}

/// A prepared statement.
pub struct Statement<'c> {
    inner: Prepared<'c>,
}

impl<'c> Statement<'c> {
    fn raw(&mut self) -> &mut rusqlite::Statement<'c> {
        match &mut self.inner {
            Prepared::Cached(s) => s,
            Prepared::Once(s) => s,
        }
    }

    /// Runs it: rows changed.
    pub fn execute<P: Params>(&mut self, params: P) -> Result<usize> {
        Ok(self.raw().execute(&*sqlite_params(&params))?)
    }

    /// Its first row, as `f` reads it; [`OptionalExtension::optional`] for
    /// none.
    pub fn query_row<T, P: Params, F: FnOnce(&Row<'_>) -> Result<T>>(
        &mut self,
        params: P,
        f: F,
    ) -> Result<T> {
        let mut rows = self.raw().query(&*sqlite_params(&params))?;
        match rows.next()? {
            Some(r) => f(&Row { inner: r }),
            None => Err(Error::NoRows),
        }
    }

    /// Its rows, each as `f` reads it.
    pub fn query_map<T, P: Params, F: FnMut(&Row<'_>) -> Result<T>>(
        &mut self,
        params: P,
        f: F,
    ) -> Result<MappedRows<'_, F>> {
        let rows = self.raw().query(&*sqlite_params(&params))?;
        Ok(MappedRows { rows, f })
    }

    /// Its rows, one at a time ([`Rows::next`]).
    pub fn query<P: Params>(&mut self, params: P) -> Result<Rows<'_>> {
        Ok(Rows {
            rows: self.raw().query(&*sqlite_params(&params))?,
        })
    }

    pub fn column_count(&mut self) -> usize {
        self.raw().column_count()
    }

    /// The SQLite statement underneath (the store's own SQLite tests).
    #[cfg(test)]
    pub(crate) fn as_sqlite(&mut self) -> &mut rusqlite::Statement<'c> {
        self.raw()
    }
}

/// Rows read one at a time.
pub struct Rows<'s> {
    rows: rusqlite::Rows<'s>,
}

impl Rows<'_> {
    /// The next row. (Not an `Iterator`: each row borrows the rows.)
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Row<'_>>> {
        Ok(self.rows.next()?.map(|r| Row { inner: r }))
    }
}

/// Rows as a function reads each.
pub struct MappedRows<'s, F> {
    rows: rusqlite::Rows<'s>,
    f: F,
}

impl<T, F: FnMut(&Row<'_>) -> Result<T>> Iterator for MappedRows<'_, F> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        match self.rows.next() {
            Ok(Some(r)) => Some((self.f)(&Row { inner: r })),
            Ok(None) => None,
            Err(e) => Some(Err(e.into())),
        }
    }
}

/// Whether a statement failed only because another connection held the
/// database (SQLite's busy or locked): the transaction is to be run again
/// whole.
pub(crate) fn is_busy(e: &Error) -> bool {
    use rusqlite::ErrorCode;
    matches!(e, Error::Sqlite(rusqlite::Error::SqliteFailure(f, _))
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
            Engine::Sqlite(c) => Ok(Statement {
                inner: Prepared::Cached(c.prepare_cached(sql)?),
            }),
        }
    }

    /// A statement prepared for one use, not cached (its text varies).
    pub fn prepare(&self, sql: &str) -> Result<Statement<'_>> {
        match &self.engine {
            Engine::Sqlite(c) => Ok(Statement {
                inner: Prepared::Once(c.prepare(sql)?),
            }),
        }
    }

    /// A statement run once: rows changed.
    pub fn execute<P: Params>(&self, sql: &str, params: P) -> Result<usize> {
        match &self.engine {
            Engine::Sqlite(c) => Ok(c.execute(sql, &*sqlite_params(&params))?),
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
            Engine::Sqlite(_) => self.prepare(sql)?.query_row(params, f),
        }
    }

    /// Statements without parameters, one after the other.
    pub fn execute_batch(&self, sql: &str) -> Result<()> {
        match &self.engine {
            Engine::Sqlite(c) => Ok(c.execute_batch(sql)?),
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
            Engine::Sqlite(c) => Ok(c.execute_batch(match how {
                Begin::Write => "BEGIN IMMEDIATE",
                Begin::Read => "BEGIN DEFERRED",
            })?),
        }
    }

    pub(crate) fn commit(&self) -> Result<()> {
        match &self.engine {
            Engine::Sqlite(c) => Ok(c.execute_batch("COMMIT")?),
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
