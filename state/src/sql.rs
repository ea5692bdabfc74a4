//! The seam between the store's SQL and the engine that runs it.
//!
//! Every rule of the store is written once, against [`Connection`]: the
//! statements, their parameters and their rows go through here, never
//! through an engine's own types. Two engines sit behind it: SQLite
//! (rusqlite; the embedded default) and PostgreSQL (rust-postgres, for
//! state that outlives one machine). What differs between them is
//! translated here and nowhere else — the dialect layer:
//!
//! - placeholders: statements are written with SQLite's numbered `?N`;
//!   PostgreSQL gets `$N` ([`pg_text`], once per statement and connection);
//! - values: both engines bind and read through one value model
//!   ([`ValueRef`]), so that a rule binding an `i64` to a PostgreSQL
//!   `INT4` column, or reading a `BOOLEAN` as a `bool`, works as it does
//!   on SQLite's dynamic types;
//! - transactions: SQLite's `BEGIN IMMEDIATE` (one writer) against
//!   PostgreSQL's `SERIALIZABLE`, whose serialization failures are retried
//!   whole as SQLite's busy database is ([`is_retryable`]);
//! - a transaction PostgreSQL aborted (a statement failed and the rule
//!   went on) is never committed: PostgreSQL would answer `COMMIT` with a
//!   silent rollback, so the seam remembers the first failure and refuses
//!   the commit with it;
//! - round trips: on PostgreSQL every statement is one, where SQLite runs
//!   it in-process. A transaction's `BEGIN` goes with its first statement,
//!   its last with its `COMMIT`, and the inserts a rule never reads back
//!   ([`Connection::insert_later`]) with whatever goes next: requests are
//!   pipelined, sent together and answered in order.
//!
//! # Layout
//!
//! - [`Connection`]: one engine connection, owned by the store (its writer,
//!   or a reader). Transactions are begun and ended by the store
//!   ([`Connection::begin`], [`Connection::commit`],
//!   [`Connection::rollback`]), never by a rule.
//! - The statement, row and parameter vocabulary the rules use:
//!   [`Statement`], [`Row`], [`Rows`], [`Params`], [`ToSql`] and
//!   [`FromSql`] (over [`ValueRef`]), [`OptionalExtension`],
//!   [`params!`](crate::sql::params).
//! - [`Connection::as_sqlite`]: what only SQLite has (pragmas, the WAL's
//!   counters, migrations' `user_version`), for the store's own SQLite
//!   code and its tests.

use bytes::BufMut;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use tokio_postgres::types::Type;

/// What a statement fails with: the engine's error, as it said it, or a
/// row asked for that is not there, or a value of the wrong type.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{}", pg_message(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// A PostgreSQL transaction in which a statement had failed (SQLSTATE
    /// `code`), refused at its commit.
    #[error("the transaction was aborted by an earlier error ({message}, sqlstate {code}); nothing was written")]
    Aborted { code: String, message: String },
    #[error("no row found")]
    NoRows,
    /// A PostgreSQL session could not be opened (before the protocol's
    /// own errors: resolving, connecting, setting up the socket).
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Conversion(String),
}

/// PostgreSQL's own message and SQLSTATE where the server sent one (the
/// client's `Display` says only "db error"); otherwise the client's words
/// and their causes (for a failed TLS handshake it says only "error
/// performing TLS handshake", and the cause is which check failed).
fn pg_message(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} (sqlstate {})", db.message(), db.code().code());
    }
    let mut message = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let said = c.to_string();
        if !message.contains(&said) {
            message = format!("{message}: {said}");
        }
        cause = c.source();
    }
    message
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

/// One value as the store binds and reads it, whichever engine holds it:
/// SQLite's storage classes. PostgreSQL's `BOOLEAN` reads as an integer 0
/// or 1, its `INT2`/`INT4`/`INT8` as integers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueRef<'a> {
    Null,
    Integer(i64),
    Real(f64),
    Text(&'a str),
    Blob(&'a [u8]),
}

/// A value a statement can be given.
pub trait ToSql: Sync {
    fn to_value(&self) -> Result<ValueRef<'_>>;
}

/// A value a row's column can be read as.
pub trait FromSql: Sized {
    fn column_result(v: ValueRef<'_>) -> Result<Self>;
}

fn wrong_type<T>(v: ValueRef<'_>, want: &str) -> Result<T> {
    Err(Error::Conversion(format!("a stored {v:?} is not {want}")))
}

macro_rules! integers {
    ($($t:ty)+) => {
        $(impl ToSql for $t {
            fn to_value(&self) -> Result<ValueRef<'_>> {
                i64::try_from(*self)
                    .map(ValueRef::Integer)
                    .map_err(|_| Error::Conversion(format!("{} does not fit a 64-bit integer", self)))
            }
        }
        impl FromSql for $t {
            fn column_result(v: ValueRef<'_>) -> Result<Self> {
                match v {
                    ValueRef::Integer(i) => <$t>::try_from(i).map_err(|_| {
                        Error::Conversion(format!("a stored {i} does not fit {}", stringify!($t)))
                    }),
                    v => wrong_type(v, "an integer"),
                }
            }
        })+
    };
}
integers!(i64 i32 i16 u8 u16 u32 u64 usize isize);

impl ToSql for bool {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Integer(i64::from(*self)))
    }
}
impl FromSql for bool {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        match v {
            ValueRef::Integer(i) => Ok(i != 0),
            v => wrong_type(v, "a boolean"),
        }
    }
}

impl ToSql for f64 {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Real(*self))
    }
}
impl FromSql for f64 {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        match v {
            ValueRef::Real(f) => Ok(f),
            ValueRef::Integer(i) => Ok(i as f64),
            v => wrong_type(v, "a number"),
        }
    }
}

impl ToSql for str {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Text(self))
    }
}
impl ToSql for String {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Text(self))
    }
}
impl FromSql for String {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        match v {
            ValueRef::Text(s) => Ok(s.to_owned()),
            v => wrong_type(v, "text"),
        }
    }
}

impl ToSql for [u8] {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Blob(self))
    }
}
impl ToSql for Vec<u8> {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(ValueRef::Blob(self))
    }
}
impl FromSql for Vec<u8> {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        match v {
            ValueRef::Blob(b) => Ok(b.to_vec()),
            ValueRef::Text(s) => Ok(s.as_bytes().to_vec()),
            v => wrong_type(v, "bytes"),
        }
    }
}

impl<T: ToSql> ToSql for Option<T> {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        match self {
            Some(v) => v.to_value(),
            None => Ok(ValueRef::Null),
        }
    }
}
impl<T: FromSql> FromSql for Option<T> {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        match v {
            ValueRef::Null => Ok(None),
            v => T::column_result(v).map(Some),
        }
    }
}

impl<T: ToSql + ?Sized> ToSql for &T {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        (**self).to_value()
    }
}

impl<T: ToSql + ?Sized> ToSql for Box<T> {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        (**self).to_value()
    }
}

impl<T: ToSql + ?Sized + Send> ToSql for std::sync::Arc<T> {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        (**self).to_value()
    }
}

/// Any stored value, owned: what a test reads when it does not know a
/// column's type, and the parameters of an insert kept to be sent later
/// ([`Connection::insert_later`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Integer(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

impl FromSql for Value {
    fn column_result(v: ValueRef<'_>) -> Result<Self> {
        Ok(match v {
            ValueRef::Null => Value::Null,
            ValueRef::Integer(i) => Value::Integer(i),
            ValueRef::Real(f) => Value::Real(f),
            ValueRef::Text(s) => Value::Text(s.to_owned()),
            ValueRef::Blob(b) => Value::Blob(b.to_vec()),
        })
    }
}

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

impl ToSql for Value {
    fn to_value(&self) -> Result<ValueRef<'_>> {
        Ok(match self {
            Value::Null => ValueRef::Null,
            Value::Integer(i) => ValueRef::Integer(*i),
            Value::Real(f) => ValueRef::Real(*f),
            Value::Text(s) => ValueRef::Text(s),
            Value::Blob(b) => ValueRef::Blob(b),
        })
    }
}

/// A parameter as an engine binds it.
struct Bind<'a>(&'a dyn ToSql);

impl std::fmt::Debug for Bind<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0.to_value())
    }
}

impl rusqlite::ToSql for Bind<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::ValueRef as V;
        let v = self
            .0
            .to_value()
            .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
        Ok(rusqlite::types::ToSqlOutput::Borrowed(match v {
            ValueRef::Null => V::Null,
            ValueRef::Integer(i) => V::Integer(i),
            ValueRef::Real(f) => V::Real(f),
            ValueRef::Text(s) => V::Text(s.as_bytes()),
            ValueRef::Blob(b) => V::Blob(b),
        }))
    }
}

type BoxError = Box<dyn std::error::Error + Sync + Send>;

/// PostgreSQL's text-like types, which take and give text.
fn is_text(ty: &Type) -> bool {
    [
        Type::TEXT,
        Type::VARCHAR,
        Type::BPCHAR,
        Type::NAME,
        Type::UNKNOWN,
    ]
    .contains(ty)
}

/// Binds our value as the type PostgreSQL inferred for the parameter.
impl tokio_postgres::types::ToSql for Bind<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> std::result::Result<tokio_postgres::types::IsNull, BoxError> {
        let v = self.0.to_value()?;
        match v {
            ValueRef::Null => return Ok(tokio_postgres::types::IsNull::Yes),
            ValueRef::Integer(i) if *ty == Type::INT8 => out.put_i64(i),
            ValueRef::Integer(i) if *ty == Type::INT4 => out.put_i32(i32::try_from(i)?),
            ValueRef::Integer(i) if *ty == Type::INT2 => out.put_i16(i16::try_from(i)?),
            ValueRef::Integer(i) if *ty == Type::BOOL => out.put_u8(u8::from(i != 0)),
            ValueRef::Integer(i) if *ty == Type::FLOAT8 => out.put_f64(i as f64),
            ValueRef::Integer(i) if is_text(ty) => out.put_slice(i.to_string().as_bytes()),
            ValueRef::Real(f) if *ty == Type::FLOAT8 => out.put_f64(f),
            ValueRef::Real(f) if *ty == Type::FLOAT4 => out.put_f32(f as f32),
            ValueRef::Text(s) if is_text(ty) => out.put_slice(s.as_bytes()),
            ValueRef::Blob(b) if *ty == Type::BYTEA => out.put_slice(b),
            v => return Err(format!("cannot bind {v:?} as {ty}").into()),
        }
        Ok(tokio_postgres::types::IsNull::No)
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

/// A column of a PostgreSQL row as our value.
struct Raw<'a>(ValueRef<'a>);

impl<'a> tokio_postgres::types::FromSql<'a> for Raw<'a> {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> std::result::Result<Raw<'a>, BoxError> {
        fn int<const N: usize>(raw: &[u8]) -> std::result::Result<[u8; N], BoxError> {
            Ok(raw.try_into()?)
        }
        Ok(Raw(if *ty == Type::BOOL {
            ValueRef::Integer(i64::from(raw.first().copied().unwrap_or(0) != 0))
        } else if *ty == Type::INT8 {
            ValueRef::Integer(i64::from_be_bytes(int(raw)?))
        } else if *ty == Type::INT4 {
            ValueRef::Integer(i32::from_be_bytes(int(raw)?).into())
        } else if *ty == Type::INT2 {
            ValueRef::Integer(i16::from_be_bytes(int(raw)?).into())
        } else if *ty == Type::OID {
            ValueRef::Integer(u32::from_be_bytes(int(raw)?).into())
        } else if *ty == Type::FLOAT8 {
            ValueRef::Real(f64::from_be_bytes(int(raw)?))
        } else if *ty == Type::FLOAT4 {
            ValueRef::Real(f32::from_be_bytes(int(raw)?).into())
        } else if is_text(ty) {
            ValueRef::Text(std::str::from_utf8(raw)?)
        } else if *ty == Type::BYTEA {
            ValueRef::Blob(raw)
        } else {
            return Err(format!("the store reads no {ty} column").into());
        }))
    }

    fn from_sql_null(_: &Type) -> std::result::Result<Raw<'a>, BoxError> {
        Ok(Raw(ValueRef::Null))
    }

    fn accepts(_: &Type) -> bool {
        true
    }
}

fn sqlite_value(v: rusqlite::types::ValueRef<'_>) -> Result<ValueRef<'_>> {
    use rusqlite::types::ValueRef as V;
    Ok(match v {
        V::Null => ValueRef::Null,
        V::Integer(i) => ValueRef::Integer(i),
        V::Real(f) => ValueRef::Real(f),
        V::Text(t) => ValueRef::Text(
            std::str::from_utf8(t).map_err(|e| Error::Conversion(format!("stored text: {e}")))?,
        ),
        V::Blob(b) => ValueRef::Blob(b),
    })
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
    inner: RowOf<'r>,
}

enum RowOf<'r> {
    Sqlite(&'r rusqlite::Row<'r>),
    Pg(&'r tokio_postgres::Row),
}

impl Row<'_> {
    /// Column `idx` (from 0) as a `T`.
    pub fn get<I: Column, T: FromSql>(&self, idx: I) -> Result<T> {
        let i = idx.column();
        match self.inner {
            RowOf::Sqlite(r) => T::column_result(sqlite_value(r.get_ref(i)?)?),
            RowOf::Pg(r) => T::column_result(r.try_get::<_, Raw<'_>>(i)?.0),
        }
    }
}

enum Prepared<'c> {
    Cached(rusqlite::CachedStatement<'c>),
    Once(rusqlite::Statement<'c>),
    Pg(&'c Pg, tokio_postgres::Statement),
}

/// A prepared statement.
pub struct Statement<'c> {
    inner: Prepared<'c>,
}

/// What a statement's rows are read from.
enum Source<'s> {
    Sqlite(rusqlite::Rows<'s>),
    /// PostgreSQL's rows are read whole (the client cannot leave a result
    /// half-read while the rule runs other statements); every statement
    /// the store runs is bounded (by a `LIMIT`, or by what the rule's
    /// caller may hold).
    Pg(
        std::vec::IntoIter<tokio_postgres::Row>,
        Option<tokio_postgres::Row>,
    ),
}

impl<'c> Statement<'c> {
    fn sqlite(&mut self) -> Option<&mut rusqlite::Statement<'c>> {
        match &mut self.inner {
            Prepared::Cached(s) => Some(s),
            Prepared::Once(s) => Some(s),
            Prepared::Pg(..) => None,
        }
    }

    fn source<P: Params>(&mut self, params: &P) -> Result<Source<'_>> {
        let values = params.values();
        let binds: Vec<Bind<'_>> = values.iter().map(|v| Bind(*v)).collect();
        match &mut self.inner {
            Prepared::Cached(s) => Ok(Source::Sqlite(s.query(sqlite_binds(&binds).as_slice())?)),
            Prepared::Once(s) => Ok(Source::Sqlite(s.query(sqlite_binds(&binds).as_slice())?)),
            Prepared::Pg(pg, stmt) => {
                let binds = pg_binds(&binds);
                let rows = pg.run(pg.client.query(&*stmt, &binds))?;
                Ok(Source::Pg(rows.into_iter(), None))
            }
        }
    }

    /// Runs it: rows changed.
    pub fn execute<P: Params>(&mut self, params: P) -> Result<usize> {
        let values = params.values();
        let binds: Vec<Bind<'_>> = values.iter().map(|v| Bind(*v)).collect();
        match &mut self.inner {
            Prepared::Cached(s) => Ok(s.execute(sqlite_binds(&binds).as_slice())?),
            Prepared::Once(s) => Ok(s.execute(sqlite_binds(&binds).as_slice())?),
            Prepared::Pg(pg, stmt) => {
                let binds = pg_binds(&binds);
                let n = pg.run(pg.client.execute(&*stmt, &binds))?;
                pg.changes.set(pg.changes.get() + n);
                Ok(n as usize)
            }
        }
    }

    /// Its first row, as `f` reads it; [`OptionalExtension::optional`] for
    /// none.
    pub fn query_row<T, P: Params, F: FnOnce(&Row<'_>) -> Result<T>>(
        &mut self,
        params: P,
        f: F,
    ) -> Result<T> {
        let mut rows = Rows {
            source: self.source(&params)?,
        };
        match rows.next()? {
            Some(r) => f(&r),
            None => Err(Error::NoRows),
        }
    }

    /// Its rows, each as `f` reads it.
    pub fn query_map<T, P: Params, F: FnMut(&Row<'_>) -> Result<T>>(
        &mut self,
        params: P,
        f: F,
    ) -> Result<MappedRows<'_, F>> {
        Ok(MappedRows {
            rows: Rows {
                source: self.source(&params)?,
            },
            f,
        })
    }

    /// Its rows, one at a time ([`Rows::next`]).
    pub fn query<P: Params>(&mut self, params: P) -> Result<Rows<'_>> {
        Ok(Rows {
            source: self.source(&params)?,
        })
    }

    pub fn column_count(&mut self) -> usize {
        match &mut self.inner {
            Prepared::Pg(_, stmt) => stmt.columns().len(),
            _ => self.sqlite().map_or(0, |s| s.column_count()),
        }
    }

    /// The SQLite statement underneath (the store's own SQLite tests).
    #[cfg(test)]
    pub(crate) fn as_sqlite(&mut self) -> Option<&mut rusqlite::Statement<'c>> {
        self.sqlite()
    }
}

fn sqlite_binds<'a>(binds: &'a [Bind<'a>]) -> Vec<&'a dyn rusqlite::ToSql> {
    binds.iter().map(|b| b as &dyn rusqlite::ToSql).collect()
}

fn pg_binds<'a>(binds: &'a [Bind<'a>]) -> Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)> {
    binds
        .iter()
        .map(|b| b as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// Rows read one at a time.
pub struct Rows<'s> {
    source: Source<'s>,
}

impl Rows<'_> {
    /// The next row. (Not an `Iterator`: each row borrows the rows.)
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Row<'_>>> {
        match &mut self.source {
            Source::Sqlite(rows) => Ok(rows.next()?.map(|r| Row {
                inner: RowOf::Sqlite(r),
            })),
            Source::Pg(rows, current) => {
                *current = rows.next();
                Ok(current.as_ref().map(|r| Row {
                    inner: RowOf::Pg(r),
                }))
            }
        }
    }
}

/// Rows as a function reads each.
pub struct MappedRows<'s, F> {
    rows: Rows<'s>,
    f: F,
}

impl<T, F: FnMut(&Row<'_>) -> Result<T>> Iterator for MappedRows<'_, F> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        match self.rows.next() {
            Ok(Some(r)) => Some((self.f)(&r)),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// PostgreSQL's SQLSTATEs that mean "run the transaction again": a
/// serialization failure of `SERIALIZABLE`, a deadlock broken by the
/// server, and a unique violation. PostgreSQL reports a key taken by a
/// concurrent transaction as a serialization failure only when this one
/// read that key's index page first; a rule that read the largest unit
/// number through another index and inserts the next name meets a unique
/// violation instead (its documentation advises retrying both). A real
/// violation fails again on every attempt, and the store then returns it
/// as it is.
const PG_RETRY: [&str; 3] = ["40001", "40P01", UNIQUE_VIOLATION];

const UNIQUE_VIOLATION: &str = "23505";

/// Whether `e` is PostgreSQL's unique violation (see [`PG_RETRY`]).
pub(crate) fn is_unique_violation(e: &Error) -> bool {
    match e {
        Error::Postgres(e) => e.code().is_some_and(|c| c.code() == UNIQUE_VIOLATION),
        Error::Aborted { code, .. } => code == UNIQUE_VIOLATION,
        _ => false,
    }
}

/// Whether a statement failed only because of what other transactions did
/// (SQLite's busy or locked database; PostgreSQL's serialization failure
/// or deadlock): the transaction is to be run again whole.
pub(crate) fn is_retryable(e: &Error) -> bool {
    use rusqlite::ErrorCode;
    match e {
        Error::Sqlite(rusqlite::Error::SqliteFailure(f, _)) => {
            f.code == ErrorCode::DatabaseBusy || f.code == ErrorCode::DatabaseLocked
        }
        Error::Postgres(e) => e.code().is_some_and(|c| PG_RETRY.contains(&c.code())),
        Error::Aborted { code, .. } => PG_RETRY.contains(&code.as_str()),
        _ => false,
    }
}

/// Whether `e` says the connection to PostgreSQL is gone, or that the
/// server takes no sessions now (shutting down, starting up, crashed:
/// SQLSTATE classes 08 and 57P): a transaction not yet committing kept
/// nothing, and may run again on a new connection.
pub(crate) fn is_connection_lost(e: &Error) -> bool {
    let lost_code = |c: &str| c.starts_with("08") || c.starts_with("57P");
    match e {
        Error::Postgres(e) => {
            e.is_closed()
                || e.code().is_some_and(|c| lost_code(c.code()))
                || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
        }
        Error::Aborted { code, .. } => lost_code(code),
        _ => false,
    }
}

/// How a transaction takes the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// Writes: serializable (SQLite's `IMMEDIATE`: the write lock from the
    /// start, so that the transaction is never refused half-way for
    /// another writer; PostgreSQL's `SERIALIZABLE`, retried whole when it
    /// fails for another's writes).
    Write,
    /// Reads: one snapshot for the whole transaction.
    Read,
}

/// Which engine a connection talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

enum Conn {
    Sqlite(rusqlite::Connection),
    Pg(Box<Pg>),
}

/// The most statements a PostgreSQL connection keeps prepared (as
/// SQLite's statement cache); past it the cache starts again empty.
const PG_STATEMENTS: usize = 256;

/// A PostgreSQL connection and what the seam keeps beside it.
struct Pg {
    /// Dropped before the session's last turn (see `Drop for Pg`).
    client: std::mem::ManuallyDrop<tokio_postgres::Client>,
    /// Drives the session's socket on the calling thread (see
    /// [`crate::pg::drive`]).
    driver: RefCell<crate::pg::drive::Driver>,
    /// Prepared statements by their text as written (with `?N`).
    statements: RefCell<HashMap<String, tokio_postgres::Statement>>,
    /// Rows changed by statements run on this connection.
    changes: Cell<u64>,
    /// Requests sent (statements, `BEGIN`s, `COMMIT`s, `PREPARE`s), each
    /// with a `Sync` of its own and so answered apart.
    requests: Cell<u64>,
    in_tx: Cell<bool>,
    /// The open transaction's `COMMIT` was handed to the client: from
    /// then on a lost session leaves unknown whether the server kept it
    /// (see [`Connection::commit_sent`]).
    commit_sent: Cell<bool>,
    /// The first failure inside the open transaction (SQLSTATE, message):
    /// PostgreSQL runs nothing more in it, and its commit must fail.
    failed: RefCell<Option<(String, String)>>,
    /// Its session found lost ([`Connection::mark_closed`]).
    lost: Cell<bool>,
    /// The `BEGIN` of the open transaction while it is not sent yet: it
    /// goes with the transaction's first statement, pipelined (both sent,
    /// then both answers read), so that it costs no round trip of its own
    /// (see [`Pg::run`]).
    begin: Cell<Option<&'static str>>,
    /// Inserts of the open transaction not sent yet
    /// ([`Connection::insert_later`]): they go, in order, before the next
    /// request, in the same write.
    later: RefCell<Vec<Later>>,
}

impl Drop for Pg {
    /// Ends the session as a client should: with the client gone, the
    /// session's last turn sends the server `Terminate` (without waiting),
    /// so that it does not log a lost connection.
    fn drop(&mut self) {
        // SAFETY: dropped once, here; nothing uses the client after it.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.client) };
        self.driver.get_mut().poll_idle();
    }
}

/// An insert kept to be sent with the next request.
struct Later {
    /// Its text as written (`?N`): the commit folds it into its last
    /// statement ([`fold_kept`]).
    sql: String,
    statement: tokio_postgres::Statement,
    values: Vec<Value>,
}

/// The most parameters one PostgreSQL statement takes (the protocol counts
/// them in 16 bits).
const PG_MAX_PARAMS: usize = 65_535;

/// `main` with the inserts `kept` before it as data-modifying `WITH`
/// clauses, parameters numbered on (the kept inserts' values first): one
/// statement where there were `kept.len() + 1`. On PostgreSQL each
/// statement is a `Sync` of its own, so each was answered in a packet of
/// its own, a wake-up of this thread and of the server's send path, and
/// each was planned and started in the executor apart; a rule's commit
/// sent its machines, units and feed entries as three statements.
///
/// `None` (send them apart, as before) unless `main` is an insert, every
/// kept insert writes values of its own (no `SELECT`), every kept insert
/// and `main` write different tables, and the whole takes at
/// most [`PG_MAX_PARAMS`]: PostgreSQL runs every clause of one statement
/// on one snapshot, so a clause reading or writing a table another
/// writes would not see that one's rows (`main` must read no table but
/// its own: the feed's insert reads the feed's last revision), and
/// CockroachDB refuses a statement that modifies one table twice. The
/// foreign keys between the tables are checked at the statement's end,
/// on all of its rows.
fn fold_kept(kept: &[(&str, usize)], main: &str, main_params: usize) -> Option<String> {
    fn target(sql: &str) -> Option<&str> {
        let rest = sql.trim_start().strip_prefix("INSERT INTO ")?;
        rest.split(|c: char| c.is_whitespace() || c == '(').next()
    }
    let starts_with = |sql: &str, word: &str| {
        sql.trim_start()
            .get(..word.len())
            .is_some_and(|w| w.eq_ignore_ascii_case(word))
    };
    if kept.is_empty() || starts_with(main, "WITH") {
        return None;
    }
    let params: usize = kept.iter().map(|(_, n)| n).sum();
    if params + main_params > PG_MAX_PARAMS {
        return None;
    }
    let mut tables = Vec::with_capacity(kept.len() + 1);
    for (sql, _) in kept {
        // Rows of its own values only: a clause that read a table would
        // not see what a sibling wrote to it.
        if sql
            .as_bytes()
            .windows(6)
            .any(|w| w.eq_ignore_ascii_case(b"SELECT"))
        {
            return None;
        }
        let t = target(sql)?;
        if tables.contains(&t) {
            return None;
        }
        tables.push(t);
    }
    if tables.contains(&target(main)?) {
        return None;
    }
    let mut text = String::from("WITH ");
    let mut offset = 0;
    for (i, (sql, n)) in kept.iter().enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        text.push_str(&format!("kept{i} AS ("));
        text.push_str(&shift_placeholders(sql, offset));
        text.push(')');
        offset += n;
    }
    text.push(' ');
    text.push_str(&shift_placeholders(main, offset));
    Some(text)
}

/// `sql` with each `?N` placeholder (outside quoted text and identifiers)
/// numbered `N + by`.
fn shift_placeholders(sql: &str, by: usize) -> String {
    placeholders(sql, '?', by)
}

/// `sql` with each `?N` placeholder outside quoted text and identifiers
/// written `{mark}{N + by}`.
fn placeholders(sql: &str, mark: char, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut quote: Option<char> = None;
    let mut chars = sql.chars().peekable();
    while let Some(ch) = chars.next() {
        match quote {
            Some(q) => {
                if ch == q {
                    quote = None;
                }
                out.push(ch);
            }
            None if ch == '\'' || ch == '"' => {
                quote = Some(ch);
                out.push(ch);
            }
            None if ch == '?' && chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut n = 0usize;
                while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                    n = n * 10 + d as usize;
                    chars.next();
                }
                out.push(mark);
                out.push_str(&(n + by).to_string());
            }
            None => out.push(ch),
        }
    }
    out
}

/// The most inserts kept unsent: past it they are sent together, answered
/// before the rule goes on (a deploy of many units holds a bounded number
/// of requests, not one per statement).
const LATER_MAX: usize = 32;

type PgFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = std::result::Result<(), tokio_postgres::Error>> + 'a>,
>;

impl Pg {
    /// Runs one call on the client (waiting for it), noting a failure
    /// inside a transaction. The first call of a transaction sends its
    /// `BEGIN` first, in the same write: the client sends requests in the
    /// order they are first polled, and the server answers in order, so
    /// the call runs inside the transaction. (A `BEGIN` fails only with
    /// its session, and then so does the call.)
    fn run<T>(
        &self,
        call: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    ) -> Result<T> {
        self.run_between(call, false)
    }

    /// [`Pg::run`], and with `commit` the transaction's `COMMIT` sent right
    /// after the call, before either is answered: one round trip for both.
    /// The inserts kept for later go between the `BEGIN` and the call.
    /// Every request's failure is the first one's: a request that fails
    /// aborts the transaction, whose later statements then fail for it,
    /// and the server answers `COMMIT` by rolling back.
    fn run_between<T>(
        &self,
        call: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
        commit: bool,
    ) -> Result<T> {
        use std::future::Future;
        use std::task::Poll;
        let begin = self.begin.take();
        let later = std::mem::take(&mut *self.later.borrow_mut());
        self.requests.set(
            self.requests.get()
                + u64::from(begin.is_some())
                + later.len() as u64
                + 1
                + u64::from(commit),
        );
        let r = if begin.is_none() && later.is_empty() && !commit {
            self.wait_for(call)
        } else {
            let binds: Vec<Vec<Bind<'_>>> = later
                .iter()
                .map(|l| l.values.iter().map(|v| Bind(v)).collect())
                .collect();
            let binds: Vec<_> = binds.iter().map(|b| pg_binds(b)).collect();
            // Polled in order, each until it answers: the client sends
            // requests in the order they are first polled.
            let mut before: Vec<(PgFuture<'_>, Option<_>)> = begin
                .map(|b| -> PgFuture<'_> { Box::pin(self.client.batch_execute(b)) })
                .into_iter()
                .chain(later.iter().zip(&binds).map(|(l, b)| -> PgFuture<'_> {
                    Box::pin(async move { self.client.execute(&l.statement, b).await.map(drop) })
                }))
                .map(|f| (f, None))
                .collect();
            // (The feed's notification is not sent here: see `pg::listen`.)
            let mut after = commit.then(|| Box::pin(self.client.batch_execute("COMMIT")));
            if commit {
                self.commit_sent.set(true);
            }
            let mut call = std::pin::pin!(call);
            let (mut r, mut a) = (None, after.is_none().then_some(Ok(())));
            self.wait_for(std::future::poll_fn(|cx| {
                for (f, done) in before.iter_mut().filter(|(_, done)| done.is_none()) {
                    if let Poll::Ready(v) = f.as_mut().poll(cx) {
                        *done = Some(v);
                    }
                }
                if r.is_none() {
                    if let Poll::Ready(v) = call.as_mut().poll(cx) {
                        r = Some(v);
                    }
                }
                if let (None, Some(f)) = (&a, after.as_mut()) {
                    if let Poll::Ready(v) = f.as_mut().poll(cx) {
                        a = Some(v);
                    }
                }
                if before.iter().all(|(_, done)| done.is_some()) && r.is_some() && a.is_some() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }));
            let first = before
                .into_iter()
                .map(|(_, done)| done.expect("every request answered"))
                .collect::<std::result::Result<Vec<()>, _>>();
            match (r, a) {
                (Some(r), Some(a)) => first.and(r).and_then(|v| a.map(|()| v)),
                _ => unreachable!("every request answered"),
            }
        };
        r.map_err(|e| {
            if self.in_tx.get() && self.failed.borrow().is_none() {
                let code = e.code().map_or("", |c| c.code()).to_string();
                *self.failed.borrow_mut() = Some((code, pg_message(&e)));
            }
            Error::Postgres(e)
        })
    }

    /// Waits for `call`, driving the session meanwhile.
    fn wait_for<F: std::future::Future>(&self, call: F) -> F::Output {
        self.driver.borrow_mut().block_on(call)
    }

    fn prepare(&self, sql: &str, cache: bool) -> Result<tokio_postgres::Statement> {
        if let Some(s) = self.statements.borrow().get(sql) {
            return Ok(s.clone());
        }
        let text = pg_text(sql);
        let stmt = self.run(self.client.prepare(&text))?;
        if cache {
            let mut statements = self.statements.borrow_mut();
            if statements.len() >= PG_STATEMENTS {
                statements.clear();
            }
            statements.insert(sql.to_string(), stmt.clone());
        }
        Ok(stmt)
    }
}

/// A statement's text for PostgreSQL: SQLite's numbered `?N` placeholders
/// as `$N` (outside quoted text and identifiers), and SQLite's index
/// hint (`INDEXED BY name`, which PostgreSQL has no use for: its planner
/// takes a partial index by itself) left out.
pub(crate) fn pg_text(sql: &str) -> String {
    let out = placeholders(sql, '$', 0);
    match out.find("INDEXED BY ") {
        Some(at) => {
            let rest = &out[at + "INDEXED BY ".len()..];
            let name = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let end = at + "INDEXED BY ".len() + name;
            format!("{}{}", out[..at].trim_end(), &out[end..])
        }
        None => out,
    }
}

/// One connection to the state database.
pub struct Connection {
    conn: Conn,
}

impl Connection {
    pub(crate) fn sqlite(conn: rusqlite::Connection) -> Connection {
        Connection {
            conn: Conn::Sqlite(conn),
        }
    }

    /// A PostgreSQL connection, its socket driven by whichever thread
    /// calls (see [`crate::pg::drive`]).
    /// With `tls`, TLS as the config's `sslmode` asks (see `pg::tls`).
    pub(crate) fn postgres(
        config: tokio_postgres::Config,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) -> Result<Connection> {
        use crate::pg::drive::connect;
        let (client, driver) = match tls {
            None => connect(&config, tokio_postgres::NoTls)?,
            Some(tls) => connect(
                &config,
                tokio_postgres_rustls::MakeRustlsConnect::new((*tls).clone()),
            )?,
        };
        Ok(Connection {
            conn: Conn::Pg(Box::new(Pg {
                client: std::mem::ManuallyDrop::new(client),
                driver: RefCell::new(driver),
                statements: RefCell::new(HashMap::new()),
                changes: Cell::new(0),
                requests: Cell::new(0),
                in_tx: Cell::new(false),
                commit_sent: Cell::new(false),
                failed: RefCell::new(None),
                lost: Cell::new(false),
                begin: Cell::new(None),
                later: RefCell::new(Vec::new()),
            })),
        })
    }

    /// Takes a PostgreSQL connection whose session was found lost for
    /// closed, so that the next transaction opens a new one (the client
    /// may not have noticed yet). Nothing on SQLite.
    pub(crate) fn mark_closed(&self) {
        if let Conn::Pg(pg) = &self.conn {
            pg.lost.set(true);
        }
    }

    pub fn engine(&self) -> Engine {
        match &self.conn {
            Conn::Sqlite(_) => Engine::Sqlite,
            Conn::Pg(_) => Engine::Postgres,
        }
    }

    /// The SQLite connection underneath, for what only SQLite has.
    pub(crate) fn as_sqlite(&self) -> Option<&rusqlite::Connection> {
        match &self.conn {
            Conn::Sqlite(c) => Some(c),
            Conn::Pg(_) => None,
        }
    }

    /// Whether the server closed this connection (PostgreSQL restarted,
    /// or the network between): the store opens another.
    pub(crate) fn is_closed(&self) -> bool {
        match &self.conn {
            Conn::Sqlite(_) => false,
            Conn::Pg(pg) => {
                // Nothing drives the session between calls: what the
                // server sent meanwhile (its end) is read now.
                pg.driver.borrow_mut().poll_idle();
                pg.lost.get() || pg.client.is_closed()
            }
        }
    }

    /// A statement, prepared once per connection and kept.
    pub fn prepare_cached(&self, sql: &str) -> Result<Statement<'_>> {
        Ok(Statement {
            inner: match &self.conn {
                Conn::Sqlite(c) => Prepared::Cached(c.prepare_cached(sql)?),
                Conn::Pg(pg) => Prepared::Pg(pg, pg.prepare(sql, true)?),
            },
        })
    }

    /// A statement prepared for one use, not cached (its text varies).
    pub fn prepare(&self, sql: &str) -> Result<Statement<'_>> {
        Ok(Statement {
            inner: match &self.conn {
                Conn::Sqlite(c) => Prepared::Once(c.prepare(sql)?),
                Conn::Pg(pg) => Prepared::Pg(pg, pg.prepare(sql, false)?),
            },
        })
    }

    /// Runs an `INSERT` of exactly `rows` rows (no `ON CONFLICT`, no
    /// `RETURNING`) whose result the rule does not read: on PostgreSQL it
    /// is sent with the transaction's next request, a round trip saved
    /// (at most [`LATER_MAX`] wait). Its failure fails the transaction as
    /// any statement's does, but is returned by that next request: only
    /// for inserts whose failure no rule handles (nothing catches a
    /// violation of them; a savepoint sends what its op kept before it
    /// ends, [`Connection::send_kept`]). On SQLite it runs now.
    pub(crate) fn insert_later(&self, sql: &str, params: &[&dyn ToSql], rows: u64) -> Result<()> {
        match &self.conn {
            Conn::Sqlite(_) => {
                let n = self.prepare_cached(sql)?.execute(params)?;
                debug_assert_eq!(n as u64, rows, "{sql}");
                Ok(())
            }
            Conn::Pg(pg) => {
                let statement = pg.prepare(sql, true)?;
                let values = params
                    .iter()
                    .map(|p| p.to_value().and_then(Value::column_result))
                    .collect::<Result<Vec<_>>>()?;
                // Bound now, to fail now: a value the client cannot bind
                // is never sent, so the server would not abort the
                // transaction for it, and a `COMMIT` sent with it would
                // commit without its rows.
                let types = statement.params();
                if types.len() != values.len() {
                    return Err(Error::Conversion(format!(
                        "{} values for the {} parameters of `{sql}`",
                        values.len(),
                        types.len()
                    )));
                }
                let mut scratch = bytes::BytesMut::new();
                for (v, ty) in values.iter().zip(types) {
                    scratch.clear();
                    tokio_postgres::types::ToSql::to_sql(&Bind(v), ty, &mut scratch).map_err(
                        |e| Error::Conversion(format!("cannot bind {v:?} as {ty}: {e}")),
                    )?;
                }
                pg.later.borrow_mut().push(Later {
                    sql: sql.to_string(),
                    statement,
                    values,
                });
                // An INSERT without ON CONFLICT writes every row or fails
                // the transaction: its count is known now.
                pg.changes.set(pg.changes.get() + rows);
                if pg.later.borrow().len() >= LATER_MAX {
                    self.send_kept()?;
                }
                Ok(())
            }
        }
    }

    /// Sends the inserts kept for later ([`Connection::insert_later`]) and
    /// waits for their answers: a savepoint's op answers for its own.
    pub(crate) fn send_kept(&self) -> Result<()> {
        match &self.conn {
            Conn::Pg(pg) if !pg.later.borrow().is_empty() => pg.run(std::future::ready(Ok(()))),
            _ => Ok(()),
        }
    }

    /// A statement run once: rows changed.
    pub fn execute<P: Params>(&self, sql: &str, params: P) -> Result<usize> {
        match &self.conn {
            Conn::Sqlite(c) => {
                let values = params.values();
                let binds: Vec<Bind<'_>> = values.iter().map(|v| Bind(*v)).collect();
                Ok(c.execute(sql, sqlite_binds(&binds).as_slice())?)
            }
            Conn::Pg(_) => self.prepare_cached(sql)?.execute(params),
        }
    }

    /// The first row of a statement run once.
    pub fn query_row<T, P: Params, F: FnOnce(&Row<'_>) -> Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> Result<T> {
        match &self.conn {
            Conn::Sqlite(_) => self.prepare(sql)?.query_row(params, f),
            Conn::Pg(_) => self.prepare_cached(sql)?.query_row(params, f),
        }
    }

    /// Statements without parameters, one after the other.
    pub fn execute_batch(&self, sql: &str) -> Result<()> {
        match &self.conn {
            Conn::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Conn::Pg(pg) => pg.run(pg.client.batch_execute(sql)),
        }
    }

    /// The id SQLite's last insert gave its row (SQLite's own code: the
    /// rules read new ids with `RETURNING`).
    pub(crate) fn last_insert_rowid(&self) -> Option<i64> {
        self.as_sqlite().map(|c| c.last_insert_rowid())
    }

    /// Whether the open (or last) transaction's `COMMIT` was handed to
    /// the server's session. A session lost before that kept nothing of
    /// the transaction, whatever was already sent (its statements, the
    /// preparing of the commit's own statement), and the transaction may
    /// run again; lost after, the outcome is unknown. Never on SQLite,
    /// which has no session to lose.
    pub(crate) fn commit_sent(&self) -> bool {
        match &self.conn {
            Conn::Sqlite(_) => false,
            Conn::Pg(pg) => pg.commit_sent.get(),
        }
    }

    /// Rows inserted, updated or deleted since the connection opened.
    pub(crate) fn total_changes(&self) -> u64 {
        match &self.conn {
            Conn::Sqlite(c) => c.total_changes(),
            Conn::Pg(pg) => pg.changes.get(),
        }
    }

    /// Requests sent to PostgreSQL since the connection opened or this
    /// was last asked with `reset`, each answered apart (see
    /// [`fold_kept`]); `None` on SQLite.
    pub(crate) fn requests(&self, reset: bool) -> Option<u64> {
        match &self.conn {
            Conn::Sqlite(_) => None,
            Conn::Pg(pg) => Some(if reset {
                pg.requests.replace(0)
            } else {
                pg.requests.get()
            }),
        }
    }

    pub(crate) fn begin(&self, how: Begin) -> Result<()> {
        match &self.conn {
            // Prepared once per connection, not parsed for every
            // transaction (as `execute_batch` would).
            Conn::Sqlite(c) => {
                c.prepare_cached(match how {
                    Begin::Write => "BEGIN IMMEDIATE",
                    Begin::Read => "BEGIN DEFERRED",
                })?
                .execute([])?;
                Ok(())
            }
            Conn::Pg(pg) => {
                *pg.failed.borrow_mut() = None;
                // Reads take one snapshot (REPEATABLE READ); they decide
                // nothing, every rule reads what it decides on inside its
                // own SERIALIZABLE write transaction. Sent with the first
                // statement (see `Pg::run`).
                pg.begin.set(Some(match how {
                    Begin::Write => "BEGIN ISOLATION LEVEL SERIALIZABLE",
                    Begin::Read => "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
                }));
                pg.in_tx.set(true);
                pg.commit_sent.set(false);
                Ok(())
            }
        }
    }

    pub(crate) fn commit(&self) -> Result<()> {
        match &self.conn {
            Conn::Sqlite(c) => {
                c.prepare_cached("COMMIT")?.execute([])?;
                Ok(())
            }
            Conn::Pg(pg) => {
                if let Some((code, message)) = pg.failed.borrow_mut().take() {
                    return Err(Error::Aborted { code, message });
                }
                // A transaction that ran nothing was never begun.
                if pg.later.borrow().is_empty() && pg.begin.take().is_some() {
                    pg.in_tx.set(false);
                    return Ok(());
                }
                pg.commit_sent.set(true);
                let r = pg.run(pg.client.batch_execute("COMMIT"));
                if r.is_ok() {
                    pg.in_tx.set(false);
                }
                r
            }
        }
    }

    /// Runs `sql`, reading its rows with `f`, then commits the open
    /// transaction: on PostgreSQL the statement and the `COMMIT` are sent
    /// together, one round trip for both (a transaction's last statement,
    /// whose rows are not needed before it commits). Fails, having kept
    /// nothing, if the statement fails on the server; its values must be
    /// ones the client binds (a value that fails to bind is never sent, and
    /// the `COMMIT` is: the feed's texts, as `insert_later` checks its own).
    /// The inserts kept for later go in the same statement when they fold
    /// into it ([`fold_kept`]), so `sql` must read no table but its own.
    pub(crate) fn query_and_commit<T, P: Params, F: FnMut(&Row<'_>) -> Result<T>>(
        &self,
        sql: &str,
        params: P,
        mut f: F,
    ) -> Result<Vec<T>> {
        match &self.conn {
            Conn::Sqlite(_) => {
                let rows = self
                    .prepare_cached(sql)?
                    .query_map(params, &mut f)?
                    .collect::<Result<Vec<T>>>()?;
                self.commit()?;
                Ok(rows)
            }
            Conn::Pg(pg) => {
                if let Some((code, message)) = pg.failed.borrow_mut().take() {
                    return Err(Error::Aborted { code, message });
                }
                let values = params.values();
                // The inserts kept for later, in this statement if they
                // fold into it (its rows are still this statement's).
                let kept = std::mem::take(&mut *pg.later.borrow_mut());
                let texts: Vec<(&str, usize)> = kept
                    .iter()
                    .map(|k| (k.sql.as_str(), k.values.len()))
                    .collect();
                let (stmt, kept) = match fold_kept(&texts, sql, values.len()) {
                    Some(text) => (pg.prepare(&text, true)?, kept),
                    None => {
                        // Sent apart, before it.
                        *pg.later.borrow_mut() = kept;
                        (pg.prepare(sql, true)?, Vec::new())
                    }
                };
                let binds: Vec<Bind<'_>> = kept
                    .iter()
                    .flat_map(|k| k.values.iter().map(|v| Bind(v)))
                    .chain(values.iter().map(|v| Bind(*v)))
                    .collect();
                let binds = pg_binds(&binds);
                let rows = pg.run_between(pg.client.query(&stmt, &binds), true)?;
                pg.in_tx.set(false);
                pg.changes.set(pg.changes.get() + rows.len() as u64);
                rows.iter()
                    .map(|r| {
                        f(&Row {
                            inner: RowOf::Pg(r),
                        })
                    })
                    .collect()
            }
        }
    }

    /// Undoes an open transaction; nothing if none is open.
    pub(crate) fn rollback(&self) {
        match &self.conn {
            Conn::Sqlite(c) => {
                if !c.is_autocommit() {
                    let _ = c.execute_batch("ROLLBACK");
                }
            }
            Conn::Pg(pg) => {
                // Nothing to roll back of a `BEGIN` not sent.
                pg.later.borrow_mut().clear();
                if pg.in_tx.replace(false) && pg.begin.take().is_none() {
                    let _ = pg.wait_for(pg.client.batch_execute("ROLLBACK"));
                }
                *pg.failed.borrow_mut() = None;
            }
        }
    }

    /// After `ROLLBACK TO` a savepoint: a statement that failed inside it
    /// no longer aborts the transaction (PostgreSQL runs on after the
    /// rollback), unless it failed for another transaction's writes —
    /// then the whole transaction must run again, and stays failed.
    pub(crate) fn rolled_back_to_savepoint(&self) {
        if let Conn::Pg(pg) = &self.conn {
            let mut failed = pg.failed.borrow_mut();
            if failed
                .as_ref()
                .is_some_and(|(code, _)| !PG_RETRY.contains(&code.as_str()))
            {
                *failed = None;
            }
        }
    }

    /// The first failure PostgreSQL had in the open transaction, if a rule
    /// went on after it: the transaction can only be rolled back.
    pub(crate) fn failed(&self) -> Option<Error> {
        match &self.conn {
            Conn::Sqlite(_) => None,
            Conn::Pg(pg) => pg
                .failed
                .borrow()
                .clone()
                .map(|(code, message)| Error::Aborted { code, message }),
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

    /// [`Connection::query_and_commit`]: the last statement and the commit.
    pub(crate) fn query_and_commit<T, P: Params, F: FnMut(&Row<'_>) -> Result<T>>(
        mut self,
        sql: &str,
        params: P,
        f: F,
    ) -> Result<Vec<T>> {
        self.done = true;
        let r = self.conn.query_and_commit(sql, params, f);
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

#[cfg(test)]
mod tests {
    use super::{fold_kept, pg_text, shift_placeholders};

    #[test]
    fn placeholders_shift_outside_quotes() {
        assert_eq!(
            shift_placeholders("VALUES (?1, ?2, '?3', \"?4\"), (?10, ?11)", 5),
            "VALUES (?6, ?7, '?3', \"?4\"), (?15, ?16)"
        );
        assert_eq!(shift_placeholders("SELECT ?1", 0), "SELECT ?1");
    }

    #[test]
    fn kept_inserts_fold_into_the_last_statement_numbered_on() {
        let machine = "INSERT INTO machines (id, series) VALUES (?1, ?2)";
        let unit = "INSERT INTO units (name, machine_id) VALUES (?1, ?2), (?3, ?4)";
        let feed = "INSERT INTO changes (kind, id) VALUES (?1, ?2) RETURNING revision";
        assert_eq!(
            fold_kept(&[(machine, 2), (unit, 4)], feed, 2).as_deref(),
            Some(
                "WITH kept0 AS (INSERT INTO machines (id, series) VALUES (?1, ?2)), \
                 kept1 AS (INSERT INTO units (name, machine_id) VALUES (?3, ?4), (?5, ?6)) \
                 INSERT INTO changes (kind, id) VALUES (?7, ?8) RETURNING revision"
            )
        );
    }

    #[test]
    fn kept_inserts_stay_apart_where_one_statement_cannot_hold_them() {
        let machine = "INSERT INTO machines (id) VALUES (?1)";
        let feed = "INSERT INTO changes (kind, id) VALUES (?1, ?2)";
        assert_eq!(fold_kept(&[], feed, 2), None, "nothing to fold");
        // One table written twice: its clauses would not see each other.
        assert_eq!(fold_kept(&[(machine, 1), (machine, 1)], feed, 2), None);
        assert_eq!(fold_kept(&[(machine, 1)], machine, 1), None);
        // A last statement with its own WITH, or that is no insert (a
        // read would not see the kept rows).
        assert_eq!(
            fold_kept(&[(machine, 1)], "WITH x AS (SELECT 1) SELECT 2", 0),
            None
        );
        assert_eq!(
            fold_kept(&[(machine, 1)], "SELECT count(*) FROM machines", 0),
            None
        );
        assert_eq!(fold_kept(&[("DELETE FROM machines", 0)], feed, 2), None);
        // A kept insert that reads: it would not see its siblings' rows.
        let copy = "INSERT INTO units (name) SELECT name FROM machines WHERE id = ?1";
        assert_eq!(fold_kept(&[(machine, 1), (copy, 1)], feed, 2), None);
        // Past the protocol's parameters.
        assert_eq!(fold_kept(&[(machine, 65_534)], feed, 2), None);
        assert!(fold_kept(&[(machine, 65_533)], feed, 2).is_some());
    }

    #[test]
    fn placeholders_become_postgres_ones_outside_quotes_and_the_index_hint_goes() {
        assert_eq!(
            pg_text("SELECT a FROM t WHERE b = ?1 AND c = '?2' AND \"?3\" = ?10"),
            "SELECT a FROM t WHERE b = $1 AND c = '?2' AND \"?3\" = $10"
        );
        assert_eq!(
            pg_text("SELECT id FROM machines INDEXED BY machines_actionable WHERE life != 0"),
            "SELECT id FROM machines WHERE life != 0"
        );
        assert_eq!(pg_text("SELECT 'it''s ?1', ?1"), "SELECT 'it''s ?1', $1");
    }
}
