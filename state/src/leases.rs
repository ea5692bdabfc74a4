//! Controller leases: which controller runs a singleton job (the
//! provisioner, the cleaner, the stray harvest, the instance poller), and
//! the fencing token that keeps a controller that lost its lease from
//! acting on the state after another has taken it.
//!
//! # Layout
//!
//! - One row per lease in `controller_leases`: its holder (a name each
//!   controller process makes unique, e.g. `machine-N/HOST/ID`), its token
//!   and when it expires (unix milliseconds on the clock the claims name:
//!   [`LeaseNow::Database`] for controllers).
//! - [`Store::claim_lease`] takes a free or expired lease (the token goes
//!   up by one) or renews the caller's own (the token stays); a lease
//!   someone else holds is refused with who holds it and until when.
//! - [`Store::fenced`] gives a handle whose every write transaction first
//!   reads the lease's token inside itself and refuses with
//!   [`Error::LeaseLost`] unless it is still the handle's: a controller that
//!   stalled past its expiry (a long pause, a partition) and wakes up after
//!   another took the lease cannot write, whatever its clock says.
//!
//! # What the holder must do
//!
//! Tokens make a stale holder's writes fail; they do not stop its calls to
//! the cloud. So a holder stops its jobs before its lease expires, timed on
//! its own monotonic clock from the moment it sent the claim (not from the
//! answer). Every controller claims at [`LeaseNow::Database`]: expiries are
//! set and compared on one clock, the database's (PostgreSQL's
//! `clock_timestamp()`; a SQLite file's controllers share one host, and so
//! its clock), which reads the claim's time after it was sent. So another
//! controller takes the lease only once the holder's own deadline has
//! passed, however far apart the controllers' wall clocks are.

use crate::db::Store;
use crate::sql::OptionalExtension;
use crate::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// The lease the controller's singleton jobs run under.
pub const SINGLETONS: &str = "singletons";

/// The longest lease or holder name (bytes).
pub const MAX_NAME: usize = 128;
/// The shortest and longest lease a claim may ask for.
pub const MIN_TTL: Duration = Duration::from_millis(100);
pub const MAX_TTL: Duration = Duration::from_secs(600);

/// A lease held: what a fenced handle carries ([`Store::fenced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub lease: String,
    pub holder: String,
    /// Goes up by one each time the lease changes hands (or is taken again
    /// after it expired); never reused.
    pub token: i64,
    /// Unix milliseconds, on the clock of the claims ([`LeaseNow`]).
    pub expires_ms: i64,
}

/// Which clock a claim is made at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseNow {
    /// The database's clock, read inside the claim's transaction.
    Database,
    /// Unix milliseconds the caller gives (tests stand a clock of their own).
    At(i64),
}

impl From<i64> for LeaseNow {
    fn from(ms: i64) -> LeaseNow {
        LeaseNow::At(ms)
    }
}

/// The database's clock in unix milliseconds: PostgreSQL's (the same for
/// every controller, whatever their own clocks say), or this host's for a
/// SQLite file, which only processes of this host open.
fn database_now_ms(c: &crate::sql::Connection) -> Result<i64> {
    if c.as_sqlite().is_some() {
        return Ok(jujube_core::time::unix_now_ms());
    }
    Ok(c.prepare_cached(
        "SELECT CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS BIGINT)",
    )?
    .query_row([], |r| r.get::<_, i64>(0))?)
}

/// What a claim got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    Held(Fence),
    /// Another holder has it until `expires_ms`.
    Taken {
        holder: String,
        expires_ms: i64,
    },
}

/// A lease as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub lease: String,
    pub holder: String,
    pub token: i64,
    pub expires_ms: i64,
}

pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(Error::BadLease(format!(
            "{what} `{}` must be 1 to {MAX_NAME} bytes without control characters",
            name.escape_debug()
        )));
    }
    Ok(())
}

pub(crate) fn lease_in(c: &crate::sql::Connection, lease: &str) -> Result<Option<Lease>> {
    Ok(
        c.prepare_cached("SELECT holder, token, expires FROM controller_leases WHERE name = ?1")?
            .query_row([lease], |r| {
                Ok(Lease {
                    lease: lease.to_string(),
                    holder: r.get(0)?,
                    token: r.get(1)?,
                    expires_ms: r.get(2)?,
                })
            })
            .optional()?,
    )
}

/// First thing in a fenced handle's write transaction.
pub(crate) fn require_fence(c: &crate::sql::Connection, fence: &Fence) -> Result<()> {
    let now = c
        .prepare_cached("SELECT token FROM controller_leases WHERE name = ?1")?
        .query_row([&fence.lease], |r| r.get::<_, i64>(0))
        .optional()?;
    if now == Some(fence.token) {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            lease: fence.lease.clone(),
            token: fence.token,
        })
    }
}

impl Store {
    /// Claims `lease` for `holder` until `now + ttl`: takes it when
    /// nobody holds it or its holder's time is up (`expires <= now`; the
    /// token goes up by one), renews it when `holder` holds it (the token
    /// stays, and an expiry is never moved back). A renewal that returns
    /// another token than the holder had means its lease had expired and it
    /// took it anew: whatever it did under the old token must have stopped.
    pub fn claim_lease(
        &self,
        lease: &str,
        holder: &str,
        now: impl Into<LeaseNow>,
        ttl: Duration,
    ) -> Result<Claim> {
        self.claim(lease, holder, now.into(), ttl, false)
    }

    /// [`Store::claim_lease`] for a holder starting again whose previous
    /// process is known to be gone (the controller's file lock says so):
    /// a lease `holder` holds is taken at once under a new token, without
    /// waiting for its expiry, so that a restarted controller resumes its
    /// jobs at once while nothing its previous process began can write.
    pub fn claim_lease_anew(
        &self,
        lease: &str,
        holder: &str,
        now: impl Into<LeaseNow>,
        ttl: Duration,
    ) -> Result<Claim> {
        self.claim(lease, holder, now.into(), ttl, true)
    }

    fn claim(
        &self,
        lease: &str,
        holder: &str,
        now: LeaseNow,
        ttl: Duration,
        anew: bool,
    ) -> Result<Claim> {
        check_name("lease", lease)?;
        check_name("holder", holder)?;
        if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
            return Err(Error::BadLease(format!(
                "a lease lasts {} ms to {} s, not {} ms",
                MIN_TTL.as_millis(),
                MAX_TTL.as_secs(),
                ttl.as_millis()
            )));
        }
        self.write(|tx| {
            let now_ms = match now {
                LeaseNow::At(ms) => ms,
                LeaseNow::Database => database_now_ms(tx)?,
            };
            let until = now_ms.saturating_add(ttl.as_millis() as i64);
            let fence = |token, expires_ms| {
                Claim::Held(Fence {
                    lease: lease.to_string(),
                    holder: holder.to_string(),
                    token,
                    expires_ms,
                })
            };
            match lease_in(tx, lease)? {
                None => {
                    tx.prepare_cached(
                        "INSERT INTO controller_leases (name, holder, token, expires) VALUES (?1, ?2, 1, ?3)",
                    )?
                    .execute((lease, holder, until))?;
                    Ok(fence(1, until))
                }
                Some(l) if !anew && l.holder == holder && l.expires_ms > now_ms => {
                    let expires = l.expires_ms.max(until);
                    if expires != l.expires_ms {
                        tx.prepare_cached(
                            "UPDATE controller_leases SET expires = ?2 WHERE name = ?1",
                        )?
                        .execute((lease, expires))?;
                    }
                    Ok(fence(l.token, expires))
                }
                Some(l) if l.expires_ms <= now_ms || (anew && l.holder == holder) => {
                    let token = l.token + 1;
                    tx.prepare_cached(
                        "UPDATE controller_leases SET holder = ?2, token = ?3, expires = ?4 WHERE name = ?1",
                    )?
                    .execute((lease, holder, token, until))?;
                    Ok(fence(token, until))
                }
                Some(l) => Ok(Claim::Taken {
                    holder: l.holder,
                    expires_ms: l.expires_ms,
                }),
            }
        })
    }

    /// Gives a lease up at once (a controller stopping), so that another
    /// need not wait for its expiry; nothing if `fence` no longer holds it.
    pub fn release_lease(&self, fence: &Fence) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached(
                "UPDATE controller_leases SET expires = 0 WHERE name = ?1 AND token = ?2",
            )?
            .execute((&fence.lease, fence.token))?;
            Ok(())
        })
    }

    /// The lease's holder, token and expiry, if it was ever claimed.
    pub fn lease(&self, lease: &str) -> Result<Option<Lease>> {
        self.read(|c| lease_in(c, lease))
    }

    /// A handle on the same database whose every write transaction first
    /// checks, inside itself, that `fence` still holds its lease, and
    /// refuses with [`Error::LeaseLost`] otherwise (changing nothing).
    /// Reads are not fenced.
    pub fn fenced(&self, fence: Fence) -> Store {
        self.with_fence(Some(Arc::new(fence)))
    }
}
