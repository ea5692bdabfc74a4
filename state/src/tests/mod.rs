//! Store tests against real SQLite files: one test per rule of the spec
//! (`rules`), the change feed (`feed`), and a property test over long random
//! sequences of operations (`prop`).

mod charms;
mod cleanups;
mod feed;
mod leases;
mod limits;
mod prop;
mod rules;
mod users;

use crate::environment::EnvironmentSpec;
use crate::model::Charm;
use crate::services::DeployArgs;
use crate::{Durability, Store};
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
    // Keeps the database's directory alive for the test's duration.
    pub _dir: tempfile::TempDir,
    pub st: Store,
}

pub(crate) fn env_with(cons: &str) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
    st.initialize(&spec(cons)).unwrap();
    Env { _dir: dir, st }
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
        self.st
            .read(|c| {
                let tables: Vec<String> = c
                    .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")?
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
                                let v: rusqlite::types::Value = r.get(i)?;
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
