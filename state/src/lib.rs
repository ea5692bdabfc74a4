//! The jujube state store: the model on SQLite.
//!
//! # Layout
//! - [`db`]: opening a database (WAL, foreign keys, busy timeout), embedded
//!   migrations ([`schema`]), and [`Store::write`], the one way to change
//!   anything: a closure run inside a `BEGIN IMMEDIATE` transaction, retried
//!   whole when the database is busy, that records what it changed in the
//!   change feed.
//! - [`feed`]: the change feed — a monotonic revision per recorded change,
//!   `changes_since(N)` for any reader in any process, and [`feed::Watcher`]
//!   which in-process readers wake on without polling.
//! - [`environment`], [`machines`], [`services`], [`units`], [`relations`]:
//!   every lifecycle rule of the spec as a single transaction. Each one reads
//!   what it needs *inside* its transaction, checks its preconditions there,
//!   and either applies fully or returns an error having changed nothing.
//! - [`agents`]: agent-side writes ([`AgentOp`]) checked against who makes
//!   them ([`Caller`]) inside their transaction, group-committed in batches,
//!   and the snapshots agents decide on.
//! - [`cleanups`]: work queued by those transactions that is too large for one
//!   (settings of removed relations, units of destroyed services), done later
//!   in bounded batches.
//! - [`status`]: a consistent snapshot of the whole model for `jujube status`.
//!
//! The store knows nothing of clouds: the provisioner reads machines from it
//! and records instances in it; providers never see it.

pub mod agents;
pub mod bags;
pub mod cleanups;
pub mod controllers;
pub mod credentials;
pub mod db;
pub mod environment;
pub mod feed;
pub mod leases;
pub mod machines;
pub mod model;
pub mod pg;
pub mod provisioning;
pub mod relations;
pub mod runs;
mod schema;
pub mod services;
pub mod sql;
pub mod status;
pub mod units;
pub mod users;
mod walvfs;

#[cfg(test)]
mod tests;

pub use agents::{AgentOp, Caller, Stamp};
pub use db::{pages_written, Durability, Location, Store, StoreStats};
pub use feed::{Change, ChangeKind, Changes, Watcher};
pub use model::*;
pub use pg::PgTarget;

use jujube_core::Life;
use std::fmt;

/// The kinds of entity an error can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entity {
    Environment,
    Machine,
    Service,
    Unit,
    Relation,
    Charm,
    /// A queued action (`show-task`).
    Task,
}

impl fmt::Display for Entity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Entity::Environment => "environment",
            Entity::Machine => "machine",
            Entity::Service => "service",
            Entity::Unit => "unit",
            Entity::Relation => "relation",
            Entity::Charm => "charm",
            Entity::Task => "task",
        })
    }
}

/// Everything the store can refuse or fail with.
///
/// Every variant but [`Error::Database`], [`Error::Busy`] and
/// [`Error::SchemaTooNew`] is a *refusal*: a rule of the model said no, and
/// the store is exactly as it was before the call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{kind} `{id}` not found; `jujube status` lists what exists")]
    NotFound { kind: Entity, id: String },
    #[error("{kind} `{id}` already exists{}", if *kind == Entity::Relation { "" } else { "; choose another name" })]
    AlreadyExists { kind: Entity, id: String },
    #[error("{kind} `{id}` is being destroyed; wait until it is removed (see `jujube status`) before reusing it")]
    BeingDestroyed { kind: Entity, id: String },
    #[error("{kind} `{id}` is {life}; only an alive {kind} can {action}")]
    NotAlive {
        kind: Entity,
        id: String,
        life: Life,
        action: &'static str,
    },
    #[error("{kind} `{id}` is not dead; destroy it and let its agent finish before removing it")]
    NotDead { kind: Entity, id: String },
    #[error("machine `{machine}` has assigned units {units}; destroy them first with `jujube destroy-unit`")]
    MachineHasUnits { machine: i64, units: String },
    #[error("machine `{0}` manages the environment and cannot be destroyed; use `jujube destroy-environment` instead")]
    ManagesEnvironment(i64),
    #[error("machine `{machine}` cannot host units (its jobs are {jobs}); choose another machine or omit `--to`")]
    CannotHostUnits { machine: i64, jobs: String },
    #[error("cannot place a unit of service `{service}` (series `{series}`) on machine `{machine}` (series `{machine_series}`); units run only on machines of their service's series")]
    SeriesMismatch {
        service: String,
        series: String,
        machine: i64,
        machine_series: String,
    },
    #[error("service `{service}` is a subordinate: {hint}")]
    Subordinate { service: String, hint: &'static str },
    #[error("unit `{unit}` {why}")]
    UnitBusy { unit: String, why: String },
    #[error("charm `{charm}` does not support series `{series}` (it supports {supported}); use `--series` with one of those")]
    UnsupportedSeries {
        charm: String,
        series: String,
        supported: String,
    },
    #[error("{0}")]
    Relation(String),
    /// A page of a relation's scope asked after something that is not a
    /// unit's name.
    #[error("invalid unit name `{0}`: a page of a scope starts after a unit named `SERVICE/N`")]
    BadScopeCursor(String),
    #[error("{caller} cannot {action}: only the agent responsible for it can")]
    Unauthorized { caller: String, action: String },
    #[error("invalid agent status `{0}`: an agent reports `started`, `dying` or `error`")]
    InvalidStatus(String),
    /// Entering a container scope needs the principal's subordinate of the
    /// other service to be Alive or absent; an old one that is Dying or Dead
    /// must be removed first. Juju's `ErrCannotEnterScopeYet`: the agent
    /// retries once the subordinate is gone.
    #[error("unit `{unit}` cannot enter scope yet: its subordinate `{subordinate}` of service `{service}` is {life} and has not been removed; try again once it is removed")]
    CannotEnterScopeYet {
        unit: String,
        subordinate: String,
        service: String,
        life: Life,
    },
    #[error("machine `{0}` has no provisioning error; `jujube resolved` only applies to machines in error")]
    NoProvisioningError(i64),
    #[error("unit `{0}` is not in an error state; `jujube resolved` only applies to units whose hook failed (see `jujube status`)")]
    UnitNotInError(String),
    #[error(transparent)]
    Model(#[from] jujube_core::Error),
    #[error("the database is busy after {attempts} attempts; another jujube process holds it: try again")]
    Busy { attempts: u32 },
    #[error("the state database was written by a newer jujube (schema {found}, this one knows {known}); upgrade jujube")]
    SchemaTooNew { found: i64, known: i64 },
    #[error("user `{user}` has `{has}` access to this environment and this needs `{needs}`; an admin can grant it with `jujube grant {user} {needs}`")]
    Forbidden {
        user: String,
        has: jujube_wire::client::Access,
        needs: jujube_wire::client::Access,
    },
    #[error("user `{0}` not found; `jujube users` lists the users")]
    NoSuchUser(String),
    #[error("user `{0}` already exists; choose another name")]
    UserExists(String),
    #[error("registration refused: the registration string is wrong or was used already; ask an admin for a new user (`jujube add-user`)")]
    RegistrationRefused,
    #[error("user `{0}` is the last admin and keeps `admin`; grant `admin` to another user first")]
    LastAdmin(String),
    #[error("invalid password: {0}; choose another")]
    BadPassword(String),
    #[error("invalid lease: {0}")]
    BadLease(String),
    #[error("{0}")]
    BadController(String),
    #[error("{0}")]
    BadCharm(String),
    #[error("{0}")]
    BadConfig(String),
    #[error("this controller no longer holds lease `{lease}` (its token {token} was replaced): another controller runs its jobs now; nothing was written")]
    LeaseLost { lease: String, token: i64 },
    /// An agent's write sent before one of its later writes (or its
    /// restart) was applied: it is refused, changing nothing, however late
    /// it reaches the store (see [`agents::Stamp`]).
    #[error("a later write of {agent} was applied before this one, sent earlier (or the agent started again since): it is refused, changing nothing; nothing to do, the agent goes on from what it sent later")]
    Superseded { agent: String },
    #[error("state database error: {0}")]
    Database(#[from] crate::sql::Error),
    /// The session to PostgreSQL was lost while its COMMIT was in flight:
    /// the server may or may not have kept the transaction. Neither the
    /// store nor (it is not [`Error::is_unavailable`]) a client runs it
    /// again: an add-unit kept and sent again would add twice.
    #[error("the connection to the state database was lost while the change was being committed, so whether it was kept is unknown; check with `jujube status` before asking again ({0})")]
    CommitUnknown(crate::sql::Error),
    #[error("invalid state URL: {0}")]
    BadStateUrl(String),
    #[error("`{0}` is chosen at bootstrap and cannot change; bootstrap a new environment to use another")]
    FixedAtBootstrap(String),
    #[error("cannot reach the state database at `{url}`: {cause}; check that PostgreSQL runs there, takes this user's password, and (with `sslrootcert`) shows a certificate signed by it")]
    Unreachable { url: String, cause: String },
    #[error("cannot secure the state database `{path}`: {source}; check its directory's owner and permissions")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("state database error: stored {what} `{value}` is invalid")]
    Corrupt { what: &'static str, value: String },
    #[error("cannot add {asked} {what} at once: at most {max} per command; add them in several commands")]
    TooMany {
        what: &'static str,
        asked: usize,
        max: usize,
    },
    #[error("cannot place more units on machine `{machine}`: it hosts {hosted}, and a machine hosts at most {max}; place them on another machine, or add units without `--to` to give each a machine of its own")]
    MachineFull {
        machine: i64,
        hosted: usize,
        max: usize,
    },
    #[error("cannot {verb} {asked} {what} at once: at most {max} per command; {verb} them in several commands{}", if *verb == "destroy" && *what == "units" { " (or the whole service with `jujube destroy-service`)" } else if *verb == "retry" { " (or every machine in error with `--all`)" } else { "" })]
    TooManyNamed {
        verb: &'static str,
        what: &'static str,
        asked: usize,
        max: usize,
    },
    /// A request done in several transactions failed part-way: `added` were
    /// added (whole batches), the rest were not.
    #[error(
        "{cause}; {} of the {asked} {what} were added ({}): add the other {} (`-n {}`)",
        .added.len(),
        span(.added),
        asked - .added.len(),
        asked - .added.len()
    )]
    Incomplete {
        what: &'static str,
        asked: usize,
        added: Vec<String>,
        cause: Box<Error>,
    },
}

/// Refuses a count above [`MAX_PER_COMMAND`], before anything proportional
/// to it is allocated or written.
pub(crate) fn check_count(what: &'static str, asked: usize) -> Result<()> {
    if asked > MAX_PER_COMMAND {
        return Err(Error::TooMany {
            what,
            asked,
            max: MAX_PER_COMMAND,
        });
    }
    Ok(())
}

/// Adds `asked` things (`done` already added) by calling `step(n)` for
/// batches of at most `batch`, each of which is one whole transaction. A
/// failure after some batches committed is [`Error::Incomplete`], naming
/// what was added: nothing is half-done, and asking again for the rest
/// finishes the request.
pub(crate) fn in_batches<T: ToString>(
    what: &'static str,
    asked: usize,
    batch: usize,
    mut done: Vec<T>,
    mut step: impl FnMut(usize) -> Result<Vec<T>>,
) -> Result<Vec<T>> {
    while done.len() < asked {
        let n = (asked - done.len()).min(batch);
        match step(n) {
            Ok(more) if more.is_empty() => break,
            Ok(more) => done.extend(more),
            Err(e) if done.is_empty() => return Err(e),
            Err(e) => {
                return Err(Error::Incomplete {
                    what,
                    asked,
                    added: done.iter().map(ToString::to_string).collect(),
                    cause: Box::new(e),
                })
            }
        }
    }
    Ok(done)
}

/// "`first` to `last`" of a non-empty list.
fn span(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [one] => format!("`{one}`"),
        [first, .., last] => format!("`{first}` to `{last}`"),
    }
}

impl Error {
    /// True when a model rule refused the operation (as opposed to the
    /// database failing); the store is unchanged either way, except after
    /// [`Error::Incomplete`], which is never a refusal.
    pub fn is_refusal(&self) -> bool {
        match self {
            // Refused part-way (another writer destroyed the service between
            // two batches): a refusal, which says what was added.
            Error::Incomplete { cause, .. } => cause.is_refusal(),
            Error::Busy { .. }
            | Error::SchemaTooNew { .. }
            | Error::Database(_)
            | Error::CommitUnknown(_)
            | Error::BadStateUrl(_)
            | Error::Unreachable { .. }
            | Error::Corrupt { .. } => false,
            _ => true,
        }
    }

    /// True when the database could not be reached or kept busy (nothing
    /// was decided): another controller, or this one later, may answer.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::Busy { .. } | Error::Unreachable { .. } => true,
            Error::Database(e) => crate::sql::is_connection_lost(e),
            Error::Incomplete { cause, .. } => cause.is_unavailable(),
            _ => false,
        }
    }

    pub(crate) fn not_found(kind: Entity, id: impl ToString) -> Error {
        Error::NotFound {
            kind,
            id: id.to_string(),
        }
    }
}

/// SQLite's own calls (opening, pragmas, migrations) fail as a statement
/// does.
impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Error {
        Error::Database(e.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The most units or machines one command may add (`deploy -n`, `add-unit
/// -n`, `add-machine -n`). Larger counts are refused before anything is
/// allocated or written; they would only be a typo or a runaway script.
pub const MAX_PER_COMMAND: usize = 100_000;

/// The most units or machines one `destroy-unit`, `destroy-machine` or
/// `retry-provisioning` may name: the command is all or none, one
/// transaction, and a unit's destroy writes about six rows (a unit no agent
/// started goes at once, with its machine's life and the feed's entries;
/// its subordinates add theirs), so this many stays within a transaction's
/// 1,000 rows. More are refused before anything is read.
pub const MAX_NAMED_PER_COMMAND: usize = 100;

/// The most names the answer of a command over every unit or machine in
/// some state carries (`resolved --all`, `retry-provisioning --all`): the
/// first ones, by name or id; it counts the rest. Such a command may touch
/// 100,000 units; its answer stays this size.
pub const MAX_LISTED: usize = 20;

/// Refuses a command that would `verb` more than [`MAX_NAMED_PER_COMMAND`]
/// `what`.
pub(crate) fn check_named_count(
    verb: &'static str,
    what: &'static str,
    asked: usize,
) -> Result<()> {
    if asked > MAX_NAMED_PER_COMMAND {
        return Err(Error::TooManyNamed {
            verb,
            what,
            asked,
            max: MAX_NAMED_PER_COMMAND,
        });
    }
    Ok(())
}

/// Refuses with [`Error::NotAlive`] unless `life` is Alive.
pub(crate) fn require_alive(
    kind: Entity,
    id: impl ToString,
    life: Life,
    action: &'static str,
) -> Result<()> {
    if life == Life::Alive {
        Ok(())
    } else {
        Err(Error::NotAlive {
            kind,
            id: id.to_string(),
            life,
            action,
        })
    }
}

pub(crate) use jujube_core::time::unix_now;
