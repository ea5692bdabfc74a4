//! Opening a store on PostgreSQL: connecting, checking the database, and
//! bringing its schema up to date.
//!
//! The rules and the change feed are the same as on SQLite (see
//! [`crate::sql`] for what the seam translates); what only PostgreSQL
//! needs is here: a password kept out of the URL, TLS as libpq's `sslmode`
//! and `sslrootcert` ask for it, sessions set up per role (a reader is
//! read-only, a relaxed writer does not wait for its commit's flush),
//! byte-order text, and migrations serialized between controllers by an
//! advisory lock.

pub(crate) mod drive;
pub(crate) mod listen;
mod tls;

use crate::schema::PG_MIGRATIONS;
use crate::sql::Connection;
use crate::{Durability, Error, Result};

/// Where a PostgreSQL store lives: a `postgres://USER@HOST:PORT/DB` URL
/// (the client's URL and its query options: `sslmode`, `sslrootcert`,
/// `options`, `connect_timeout`, ...), and its password kept beside it,
/// never in the URL (so that a URL can be shown and logged).
#[derive(Clone)]
pub struct PgTarget {
    url: String,
    /// The URL as the client reads it: `sslrootcert` taken out and
    /// `sslmode` put in the client's terms (it knows three modes).
    client_url: String,
    password: Option<String>,
    /// How the server's certificate is checked; `None`: no TLS.
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTarget")
            .field("url", &self.url)
            .field("tls", &self.tls.is_some())
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

/// The longest state URL accepted.
pub const MAX_URL: usize = 1024;

impl PgTarget {
    /// `url` must carry no password: give it as `password` (read from a
    /// file or the environment by the caller).
    pub fn new(url: &str, password: Option<String>) -> Result<PgTarget> {
        let bad = |why: &str| Error::BadStateUrl(why.to_string());
        if url.len() > MAX_URL {
            return Err(bad(&format!("it is longer than {MAX_URL} bytes")));
        }
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(bad("it does not start with `postgres://`"));
        }
        let (client_url, tls) = tls::split(url).map_err(|why| bad(&why))?;
        let config: tokio_postgres::Config = client_url
            .parse()
            .map_err(|e| bad(&format!("it does not parse ({e})")))?;
        if config.get_password().is_some() {
            return Err(bad(
                "it carries a password, which would be stored and shown with it; give the password in a file or the environment instead",
            ));
        }
        if config.get_user().is_none() {
            return Err(bad("it names no user (`postgres://USER@HOST:PORT/DB`)"));
        }
        let (hosts, addrs) = (config.get_hosts().len(), config.get_hostaddrs().len());
        if hosts > 0 && addrs > 0 && hosts != addrs {
            return Err(bad(&format!(
                "it names {hosts} hosts and {addrs} `hostaddr`s; give each host an address, or none"
            )));
        }
        let ports = config.get_ports().len();
        if ports > 1 && ports != hosts.max(addrs) {
            return Err(bad(&format!(
                "it names {} hosts and {ports} ports; give one port, or one for each host",
                hosts.max(addrs)
            )));
        }
        let tls = tls.config().map_err(|why| bad(&why))?;
        Ok(PgTarget {
            url: url.to_string(),
            client_url,
            password,
            tls,
        })
    }

    /// The URL, which carries no secret.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn config(&self) -> Result<tokio_postgres::Config> {
        let mut config: tokio_postgres::Config = self
            .client_url
            .parse()
            .map_err(|e| Error::BadStateUrl(format!("it does not parse ({e})")))?;
        if let Some(p) = &self.password {
            config.password(p);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(std::time::Duration::from_secs(10));
        }
        // A database behind a broken link would otherwise hold a call for
        // the kernel's retransmission timeout (about 15 minutes): data
        // unacknowledged for `TCP_USER_TIMEOUT`, or an idle session whose
        // keepalive probes go unanswered, closes the session, the call
        // fails as unavailable, and callers go to another controller. The
        // URL's own `tcp_user_timeout`/`keepalives_*` win.
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
        if !self.client_url.contains("keepalives_idle=") {
            config.keepalives_idle(KEEPALIVE_IDLE);
        }
        if !self.client_url.contains("keepalives_interval=") {
            config.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if !self.client_url.contains("keepalives_retries=") {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        config.application_name("jujube");
        Ok(config)
    }
}

/// How long data sent to the database may go unacknowledged before the
/// session is given up; and the keepalive probes of an idle session (dead
/// after `IDLE + INTERVAL * RETRIES`, 20 s).
const TCP_USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(10);
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 2;

/// How long the server lets one of the store's sessions sit idle inside a
/// transaction before it ends it (see [`connect`]).
pub const IDLE_IN_TRANSACTION: std::time::Duration = std::time::Duration::from_secs(30);

/// The role a connection plays in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Writer(Durability),
    Reader,
}

/// A connection to `target`, set up for `role`.
pub(crate) fn connect(target: &PgTarget, role: Role) -> Result<Connection> {
    let conn = Connection::postgres(target.config()?, target.tls.clone()).map_err(|e| {
        Error::Unreachable {
            url: target.url.clone(),
            cause: e.to_string(),
        }
    })?;
    conn.execute_batch(match role {
        // A relaxed store survives the server's crash but not its
        // machine's, as SQLite's `synchronous = OFF`.
        Role::Writer(Durability::Relaxed) => "SET synchronous_commit = off",
        Role::Writer(Durability::Full) => "SET synchronous_commit = on",
        Role::Reader => "SET default_transaction_read_only = on",
    })?;
    // A session left idle inside a transaction (its controller frozen, or
    // cut off with the socket still open) is ended by the server after
    // IDLE_IN_TRANSACTION, its locks with it: a lease claim, or any rule,
    // waiting on its rows waits that long, not until TCP gives up (hours).
    // No rule is idle between its statements for more than moments.
    conn.execute_batch(&format!(
        "SET idle_in_transaction_session_timeout = '{}s'",
        IDLE_IN_TRANSACTION.as_secs()
    ))?;
    Ok(conn)
}

/// Checks that the database orders text as SQLite does (by bytes): rules
/// page through names in order, and elect the first by name.
pub(crate) fn check_collation(conn: &Connection, target: &PgTarget) -> Result<()> {
    let bytewise: bool = conn.query_row("SELECT 'B'::text < 'a'::text", [], |r| r.get(0))?;
    if !bytewise {
        return Err(Error::BadStateUrl(format!(
            "database of `{}` does not sort text by bytes; create it with `CREATE DATABASE ... TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'`",
            target.url
        )));
    }
    Ok(())
}

/// Any number for the advisory lock that serializes migrations between
/// controllers opening one database at once.
const MIGRATION_LOCK: i64 = 0x6a75_6a75_6265;

/// Brings the schema up to date in one transaction, as SQLite's
/// migrations do; the version is kept in `schema_version` (counted as
/// SQLite's `user_version`).
pub(crate) fn migrate(conn: &Connection) -> Result<()> {
    let known = (crate::schema::PG_BASELINE + PG_MIGRATIONS.len() - 1) as i64;
    // READ COMMITTED, not the rules' SERIALIZABLE: each statement sees
    // what committed before it, so that a controller that waited for the
    // lock reads the version another just migrated to (a serializable
    // snapshot would be taken at the lock's statement, before it).
    conn.execute_batch("BEGIN")?;
    let result = (|| {
        conn.execute_batch(&format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))?;
        conn.execute_batch("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")?;
        let version: Option<i64> =
            conn.query_row("SELECT max(version) FROM schema_version", [], |r| r.get(0))?;
        let version = version.unwrap_or(0);
        if version > known {
            return Err(Error::SchemaTooNew {
                found: version,
                known,
            });
        }
        let first = match version {
            0 => 0,
            v => (v as usize + 1) - crate::schema::PG_BASELINE,
        };
        for sql in PG_MIGRATIONS.iter().skip(first) {
            conn.execute_batch(sql)?;
        }
        if version != known {
            conn.execute("DELETE FROM schema_version", [])?;
            conn.execute("INSERT INTO schema_version (version) VALUES (?1)", [known])?;
        }
        Ok(())
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

/// Drops everything the store created in its schema, in one transaction.
pub(crate) fn erase(conn: &Connection) -> Result<()> {
    use crate::schema::{PG_FUNCTIONS, PG_TABLES};
    conn.execute_batch(&format!(
        "BEGIN; DROP TABLE IF EXISTS {} CASCADE; DROP FUNCTION IF EXISTS {} CASCADE; COMMIT",
        PG_TABLES.join(", "),
        PG_FUNCTIONS.join(", ")
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_url_carries_a_user_and_no_password() {
        let ok = PgTarget::new(
            "postgres://jujube@db.example:5432/env",
            Some("s3cret".into()),
        )
        .unwrap();
        assert_eq!(ok.url(), "postgres://jujube@db.example:5432/env");
        assert!(!format!("{ok:?}").contains("s3cret"), "{ok:?}");
        for (url, why) in [
            ("postgres://jujube:s3cret@db/env", "carries a password"),
            ("postgres://db/env", "names no user"),
            ("mysql://jujube@db/env", "does not start with `postgres://`"),
            (
                "postgres://jujube@db/env?sslmode=sometimes",
                "`sslmode=sometimes` is not one of",
            ),
            (
                "postgres://jujube@db/env?sslmode=verify-full",
                "`sslmode=verify-full` checks the server's certificate against `sslrootcert`",
            ),
            (
                "postgres://jujube@db/env?sslmode=disable&sslrootcert=/x",
                "`sslrootcert` with `sslmode=disable`",
            ),
            (
                "postgres://jujube@db/env?sslmode=require&sslrootcert=/nowhere/ca.crt",
                "cannot read `sslrootcert` `/nowhere/ca.crt`",
            ),
            (
                "postgres://jujube@db/env?connect_timeout=soon",
                "does not parse",
            ),
            (
                "postgres://jujube@a,b/env?port=5432,5433,5434",
                "ports; give one port, or one for each host",
            ),
            (
                "postgres://jujube@a,b/env?hostaddr=127.0.0.1",
                "names 2 hosts and 1 `hostaddr`",
            ),
        ] {
            let err = PgTarget::new(url, None).unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
        let long = format!("postgres://jujube@db/{}", "x".repeat(MAX_URL));
        assert!(PgTarget::new(&long, None).is_err());
    }

    #[test]
    fn a_session_behind_a_broken_link_is_given_up_unless_the_url_says_otherwise() {
        use std::time::Duration;
        let c = PgTarget::new("postgres://jujube@db/env", None)
            .unwrap()
            .config()
            .unwrap();
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(20)));
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(10));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(5)));
        assert_eq!(c.get_keepalives_retries(), Some(2));
        let c = PgTarget::new(
            "postgres://jujube@db/env?tcp_user_timeout=60&keepalives_idle=30&keepalives_interval=7&keepalives_retries=9",
            None,
        )
        .unwrap()
        .config()
        .unwrap();
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(60)));
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(30));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(7)));
        assert_eq!(c.get_keepalives_retries(), Some(9));
    }
}
