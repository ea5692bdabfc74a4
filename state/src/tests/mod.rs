//! Store tests: one test per rule of the spec (`rules`), the change feed
//! (`feed`), and a property test over long random sequences of operations
//! (`prop`).
//!
//! One suite, two backends: every store a test opens with [`empty_store`]
//! (and [`env`]) is on real SQLite files, or, when
//! `JUJUBE_TEST_STATE_URL` names a PostgreSQL server (`scripts/test` starts
//! a throwaway cluster and runs the suite again so), in a schema of its own
//! on that server. A server named there that cannot be reached fails the
//! tests; it never skips them. Tests of what only SQLite has (its files,
//! pragmas, old SQLite schemas) open SQLite themselves.

mod charms;
mod checks;
mod cleanups;
mod controllers;
mod feed;
mod later;
mod leases;
mod limits;
mod prop;
mod reconnect;
mod rules;
mod stamps;
mod tls;
mod users;
mod walvfs;

use crate::environment::EnvironmentSpec;
use crate::model::Charm;
use crate::services::DeployArgs;
use crate::{Durability, Location, Store};
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;

pub(crate) const WORDPRESS: &str = "name: wordpress\nsummary: blog\nrequires:\n  db:\n    interface: mysql\nprovides:\n  website:\n    interface: http\npeers:\n  loadbalancer:\n    interface: reversenginx\n";
pub(crate) const MYSQL: &str = "name: mysql\nsummary: db\nprovides:\n  db:\n    interface: mysql\n";
pub(crate) const LOGGING: &str = "name: logging\nsummary: logs\nsubordinate: true\nrequires:\n  logging-directory:\n    interface: logging\n    scope: container\n  juju-info:\n    interface: juju-info\n    scope: container\n";
pub(crate) const WP_CONFIG: &str = "options:\n  title:\n    type: string\n    default: My Blog\n  port:\n    type: int\n    default: 80\n";

pub(crate) fn charm(meta: &str) -> Charm {
    let meta = CharmMeta::parse(meta).unwrap();
    let config = if meta.name == "wordpress" {
        CharmConfig::parse("wordpress", WP_CONFIG).unwrap()
    } else {
        CharmConfig::default()
    };
    Charm {
        url: format!("local:jammy/{}-1", meta.name),
        meta,
        config,
        actions: Default::default(),
        path: String::new(),
    }
}

pub(crate) struct Env {
    pub st: Store,
    // Keeps the database (its directory, or its schema) for the test's
    // duration.
    pub _place: Place,
}

/// Where a test's store lives, removed at its end.
pub(crate) enum Place {
    Dir(#[allow(dead_code)] tempfile::TempDir),
    Schema { admin: String, name: String },
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Place::Schema { admin, name } = self {
            let target = crate::PgTarget::new(admin, None).unwrap();
            let role = crate::pg::Role::Writer(Durability::Relaxed);
            if let Ok(c) = crate::pg::connect(&target, role) {
                let _ = c.execute_batch(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"));
            }
        }
    }
}

/// The PostgreSQL server the suite runs against, if one is named.
pub(crate) fn postgres_url() -> Option<String> {
    std::env::var("JUJUBE_TEST_STATE_URL")
        .ok()
        .filter(|u| !u.is_empty())
}

/// A new, empty place for a store on the suite's backend.
pub(crate) fn fresh_location() -> (Location, Place) {
    match postgres_url() {
        None => {
            let dir = tempfile::tempdir().unwrap();
            (Location::File(dir.path().join("state.db")), Place::Dir(dir))
        }
        Some(admin) => {
            let name = format!("t_{}", uuid::Uuid::new_v4().simple());
            let target = crate::PgTarget::new(&admin, None).unwrap();
            let c = crate::pg::connect(&target, crate::pg::Role::Writer(Durability::Relaxed))
                .unwrap_or_else(|e| {
                    panic!("JUJUBE_TEST_STATE_URL names `{admin}`, which cannot be reached: {e}")
                });
            c.execute_batch(&format!("CREATE SCHEMA {name}")).unwrap();
            let sep = if admin.contains('?') { '&' } else { '?' };
            let url = format!("{admin}{sep}options=-csearch_path%3D{name}");
            (
                Location::Postgres(crate::PgTarget::new(&url, None).unwrap()),
                Place::Schema { admin, name },
            )
        }
    }
}

/// An empty store on the suite's backend (not initialized).
pub(crate) fn empty_store() -> (Store, Place) {
    let (location, place) = fresh_location();
    (
        Store::open_at(&location, Durability::Relaxed).unwrap(),
        place,
    )
}

/// A test environment on SQLite whatever the suite's backend, for a test
/// of what only SQLite has.
pub(crate) fn sqlite_env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
    st.initialize(&spec("")).unwrap();
    Env {
        st,
        _place: Place::Dir(dir),
    }
}

pub(crate) fn env_with(cons: &str) -> Env {
    let (st, place) = empty_store();
    st.initialize(&spec(cons)).unwrap();
    Env { st, _place: place }
}

/// The test environment, with `cons` as its constraints.
pub(crate) fn spec(cons: &str) -> EnvironmentSpec {
    EnvironmentSpec {
        name: "test".into(),
        uuid: "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::parse(cons).unwrap(),
        config: Default::default(),
    }
}

/// Each prepared machine started as instance `i-<machine>`.
pub(crate) fn started_as_prepared(
    prepared: &[crate::provisioning::Prepared],
) -> Vec<crate::provisioning::Started> {
    prepared
        .iter()
        .map(|p| crate::provisioning::Started {
            machine: p.machine,
            nonce: p.nonce.clone(),
            instance_id: format!("i-{}", p.machine),
            zone: None,
            hardware: String::new(),
        })
        .collect()
}

pub(crate) fn env() -> Env {
    env_with("")
}

pub(crate) fn deploy_args(meta: &str, service: &str, units: usize) -> DeployArgs {
    DeployArgs {
        service: service.into(),
        charm: charm(meta),
        series: "jammy".into(),
        constraints: Constraints::default(),
        units,
        to: None,
        settings: vec![],
    }
}

impl Env {
    pub fn deploy(&self, meta: &str, service: &str, units: usize) -> Vec<String> {
        self.st.deploy(&deploy_args(meta, service, units)).unwrap()
    }

    /// Everything in the database, rows sorted, as text: two equal digests
    /// mean nothing changed at all, change feed included.
    pub fn digest(&self) -> String {
        digest(&self.st)
    }

    /// Asserts that `op` is refused and leaves the database exactly as it was.
    #[track_caller]
    pub fn refused<T: std::fmt::Debug>(
        &self,
        op: impl FnOnce(&Store) -> crate::Result<T>,
    ) -> crate::Error {
        let before = self.digest();
        let err = op(&self.st).expect_err("operation should be refused");
        assert!(err.is_refusal(), "not a refusal: {err}");
        assert_eq!(
            before,
            self.digest(),
            "refused operation changed state: {err}"
        );
        err
    }
}

/// Everything in `st`'s database, rows sorted, as text: two equal digests
/// mean nothing changed at all, change feed included.
pub(crate) fn digest(st: &Store) -> String {
    st.read(|c| {
        let tables: Vec<String> = c
            .prepare(match c.engine() {
                crate::sql::Engine::Sqlite => {
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
                }
                crate::sql::Engine::Postgres => {
                    "SELECT table_name::text FROM information_schema.tables
                             WHERE table_schema = current_schema() ORDER BY 1"
                }
            })?
            .query_map([], |r| r.get(0))?
            .collect::<crate::sql::Result<_>>()?;
        let mut out = String::new();
        for t in tables {
            let mut stmt = c.prepare(&format!("SELECT * FROM \"{t}\""))?;
            let n = stmt.column_count();
            let mut rows: Vec<String> = stmt
                .query_map([], |r| {
                    let mut s = String::new();
                    for i in 0..n {
                        let v: crate::sql::Value = r.get(i)?;
                        s.push_str(&format!("{v:?}|"));
                    }
                    Ok(s)
                })?
                .collect::<crate::sql::Result<_>>()?;
            rows.sort();
            out.push_str(&format!("[{t}]\n{}\n", rows.join("\n")));
        }
        Ok(out)
    })
    .unwrap()
}

/// The agent-side writes as the responsible agent makes them, under the names
/// the rule and property tests use: each checks, like every agent write, that
/// the caller is the one the spec makes responsible (`agents::Caller`).
impl Store {
    fn responsible(&self, unit: &str) -> crate::Caller {
        self.unit(unit)
            .map(|u| crate::agents::deployer_of(&u))
            .unwrap_or(crate::Caller::Controller)
    }

    pub fn enter_scope(&self, relation: i64, unit: &str) -> crate::Result<()> {
        let op = crate::AgentOp::EnterScope {
            relation,
            unit: unit.into(),
            settings: Vec::new(),
        };
        self.apply(&crate::Caller::Unit(unit.into()), &op)
    }

    pub fn leave_scope(&self, relation: i64, unit: &str) -> crate::Result<()> {
        let op = crate::AgentOp::LeaveScope {
            relation,
            unit: unit.into(),
        };
        self.apply(&crate::Caller::Unit(unit.into()), &op)
    }

    pub fn update_relation_settings(
        &self,
        relation: i64,
        unit: &str,
        changes: &[(String, Option<String>)],
    ) -> crate::Result<()> {
        let op = crate::AgentOp::UpdateRelationSettings {
            relation,
            unit: unit.into(),
            changes: changes.to_vec(),
        };
        self.apply(&crate::Caller::Unit(unit.into()), &op)
    }

    /// As the unit's own agent (which marks the unit's agent started).
    pub fn set_unit_status(&self, unit: &str, status: &str, info: &str) -> crate::Result<()> {
        let op = crate::AgentOp::SetUnitStatus {
            unit: unit.into(),
            status: status.into(),
            info: info.into(),
        };
        self.apply(&crate::Caller::Unit(unit.into()), &op)
    }

    pub fn ensure_dead_unit(&self, unit: &str) -> crate::Result<()> {
        let op = crate::AgentOp::EnsureDeadUnit { unit: unit.into() };
        self.apply(&crate::Caller::Unit(unit.into()), &op)
    }

    /// As the unit's deployer.
    pub fn remove_unit(&self, unit: &str) -> crate::Result<()> {
        let op = crate::AgentOp::RemoveUnit { unit: unit.into() };
        self.apply(&self.responsible(unit), &op)
    }

    pub fn ensure_dead_machine(&self, machine: i64) -> crate::Result<()> {
        let op = crate::AgentOp::EnsureDeadMachine { machine };
        self.apply(&crate::Caller::Machine(machine), &op)
    }

    pub fn remove_machine(&self, machine: i64) -> crate::Result<()> {
        let op = crate::AgentOp::RemoveMachine { machine };
        self.apply(&crate::Caller::Controller, &op)
    }
}
