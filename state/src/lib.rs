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
//! - [`cleanups`]: work queued by those transactions that is too large for one
//!   (settings of removed relations, units of destroyed services), done later
//!   in bounded batches.
//! - [`status`]: a consistent snapshot of the whole model for `jujube status`.
//!
//! The store knows nothing of clouds: the provisioner reads machines from it
//! and records instances in it; providers never see it.

pub mod cleanups;
pub mod db;
pub mod environment;
pub mod feed;
pub mod machines;
pub mod model;
pub mod provisioning;
pub mod relations;
mod schema;
pub mod services;
pub mod status;
pub mod units;

#[cfg(test)]
mod tests;

pub use db::{Durability, Store, StoreStats};
pub use feed::{Change, ChangeKind, Changes, Watcher};
pub use model::*;

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
    #[error(transparent)]
    Model(#[from] jujube_core::Error),
    #[error("the database is busy after {attempts} attempts; another jujube process holds it: try again")]
    Busy { attempts: u32 },
    #[error("the state database was written by a newer jujube (schema {found}, this one knows {known}); upgrade jujube")]
    SchemaTooNew { found: i64, known: i64 },
    #[error("state database error: {0}")]
    Database(#[from] rusqlite::Error),
    #[error("state database error: stored {what} `{value}` is invalid")]
    Corrupt { what: &'static str, value: String },
}

impl Error {
    /// True when a model rule refused the operation (as opposed to the
    /// database failing); the store is unchanged either way.
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            Error::Busy { .. }
                | Error::SchemaTooNew { .. }
                | Error::Database(_)
                | Error::Corrupt { .. }
        )
    }

    pub(crate) fn not_found(kind: Entity, id: impl ToString) -> Error {
        Error::NotFound {
            kind,
            id: id.to_string(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

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
