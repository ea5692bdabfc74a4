//! The facade's scope (every method, out-of-scope callers refused, nothing
//! changed), the store's caller checks (every agent-side write), and the
//! agents at work over a real store and real directories.

mod agents;
mod prop;
mod tools;

use crate::Facades;
use jujube_agent::api::{AgentStatus, ErrorCode, Facade, Tag, WatchTarget};
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::provisioning::Started;
use jujube_state::services::DeployArgs;
use jujube_state::{AgentOp, Caller, Charm, Durability, Store};
use std::sync::Arc;

pub(crate) const UUID: &str = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";
pub(crate) const WORDPRESS: &str = "name: wordpress\nsummary: blog\nrequires:\n  db:\n    interface: mysql\npeers:\n  loadbalancer:\n    interface: reversenginx\n";
pub(crate) const MYSQL: &str = "name: mysql\nsummary: db\nprovides:\n  db:\n    interface: mysql\n";
pub(crate) const LOGGING: &str = "name: logging\nsummary: logs\nsubordinate: true\nrequires:\n  juju-info:\n    interface: juju-info\n    scope: container\n";

pub(crate) struct World {
    pub dir: tempfile::TempDir,
    pub store: Store,
}

impl World {
    pub fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
        store
            .initialize(&EnvironmentSpec {
                name: "test".into(),
                uuid: UUID.into(),
                provider: "dummy".into(),
                default_series: "jammy".into(),
                constraints: Constraints::default(),
                config: Default::default(),
            })
            .unwrap();
        World { dir, store }
    }

    /// A charm directory on disk for `meta`, stored with the service.
    pub fn deploy(&self, meta: &str, service: &str, units: usize) -> Vec<String> {
        let meta = CharmMeta::parse(meta).unwrap();
        let path = self.dir.path().join("charms").join(&meta.name);
        std::fs::create_dir_all(path.join("hooks")).unwrap();
        std::fs::write(path.join("metadata.yaml"), format!("name: {}\n", meta.name)).unwrap();
        let units = if meta.subordinate { 0 } else { units };
        self.store
            .deploy(&DeployArgs {
                service: service.into(),
                charm: Charm {
                    url: format!("local:jammy/{}-1", meta.name),
                    meta,
                    config: CharmConfig::default(),
                    actions: Default::default(),
                    path: path.to_string_lossy().into_owned(),
                },
                series: "jammy".into(),
                constraints: Constraints::default(),
                units,
                to: None,
                settings: vec![],
            })
            .unwrap()
    }

    /// Gives every Alive machine without an instance a pretend one (what
    /// the provisioner would do).
    pub fn provision(&self) {
        let ids: Vec<i64> = self
            .store
            .machines()
            .unwrap()
            .into_iter()
            .filter(|m| m.instance_id.is_none() && m.life == jujube_core::Life::Alive)
            .map(|m| m.id)
            .collect();
        let prepared = self.store.prepare_provisioning(&ids, UUID).unwrap();
        let started: Vec<Started> = prepared
            .into_iter()
            .map(|p| Started {
                instance_id: format!("i-{}", p.machine),
                machine: p.machine,
                nonce: p.nonce,
                zone: None,
                hardware: String::new(),
            })
            .collect();
        self.store.record_instances(&started).unwrap();
    }

    pub fn relation_id(&self, key: &str) -> i64 {
        self.store
            .relations()
            .unwrap()
            .into_iter()
            .find(|r| r.key == key)
            .unwrap_or_else(|| panic!("no relation `{key}`"))
            .id
    }

    pub fn apply(&self, by: Caller, op: AgentOp) {
        self.store.apply(&by, &op).unwrap();
    }

    /// `u` enters the scope of `relation`, as its agent does.
    pub fn enter_scope(&self, relation: i64, u: &str) {
        self.apply(
            Caller::Unit(unit(u)),
            AgentOp::EnterScope {
                relation,
                unit: unit(u),
                settings: Vec::new(),
            },
        );
    }

    /// Everything a user or an agent could observe: two equal digests mean
    /// no write was committed (every write records a change).
    pub fn digest(&self) -> String {
        format!(
            "{}\n{}",
            self.store.head_revision().unwrap(),
            serde_json::to_string(&self.store.status().unwrap()).unwrap()
        )
    }
}

fn unit(name: &str) -> String {
    name.to_string()
}

/// wordpress/0 (machine 1) and wordpress/1 (machine 3) with subordinates
/// logging/0 and logging/1, mysql/0 (machine 2); wordpress–mysql (global)
/// and logging–wordpress (container); every unit's agent started and in
/// its scopes.
fn scoped_world() -> (World, i64, i64) {
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 1);
    w.deploy(MYSQL, "mysql", 1);
    w.store.add_units("wordpress", 1, None).unwrap();
    w.deploy(LOGGING, "logging", 0);
    w.store.add_relation("wordpress", "mysql").unwrap();
    w.store.add_relation("logging", "wordpress").unwrap();
    let db = w.relation_id("wordpress:db mysql:db");
    let info = w.relation_id("logging:juju-info wordpress:juju-info");
    for u in ["wordpress/0", "wordpress/1", "mysql/0"] {
        let started = AgentOp::SetUnitStatus {
            unit: unit(u),
            status: "started".into(),
            info: String::new(),
        };
        w.apply(Caller::Unit(unit(u)), started);
    }
    for (rel, u) in [
        (db, "wordpress/0"),
        (db, "mysql/0"),
        (info, "wordpress/0"),
        (info, "wordpress/1"),
        (info, "logging/0"),
        (info, "logging/1"),
    ] {
        w.enter_scope(rel, u);
    }
    (w, db, info)
}

#[track_caller]
fn denied<T: std::fmt::Debug>(w: &World, r: jujube_agent::api::ApiResult<T>, before: &str) {
    let e = r.expect_err("an out-of-scope call must be refused");
    assert_eq!(e.code, ErrorCode::Unauthorized, "{e}");
    assert!(e.message.starts_with("permission denied: "), "{e}");
    assert_eq!(before, w.digest(), "a refused call changed the store: {e}");
}

#[tokio::test]
async fn a_unit_ships_its_own_log_to_the_sink_within_the_bound() {
    let (w, _, _) = scoped_world();
    let f = Facades::new(w.store.clone()).unwrap();
    let wp = f.for_agent(Tag::unit("wordpress/0"));
    // No sink kept: refused as unavailable, to be shipped later.
    let e = wp.ship_log("wordpress/0", "early\n").await.unwrap_err();
    assert_eq!(e.code, jujube_agent::api::ErrorCode::Unavailable);
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(crate::logsink::LogSink::open(dir.path()).unwrap());
    f.keep_logs(sink.clone());
    wp.ship_log("wordpress/0", "hook: install\n").await.unwrap();
    let big = "x".repeat(jujube_agent::api::MAX_SHIPPED_LOG + 1);
    let e = wp.ship_log("wordpress/0", &big).await.unwrap_err();
    assert_eq!(e.code, jujube_agent::api::ErrorCode::Refused);
    let read = sink.read(None, 10, &|_: &str| true).unwrap();
    assert_eq!(read.lines, ["wordpress/0: hook: install"]);
}

#[tokio::test]
async fn the_facade_refuses_every_method_outside_the_callers_scope() {
    let (w, db, info) = scoped_world();
    let f = Facades::new(w.store.clone()).unwrap();
    let m1 = f.for_agent(Tag::Machine(1));
    let wp = f.for_agent(Tag::unit("wordpress/0"));
    let log = f.for_agent(Tag::unit("logging/0"));
    let before = w.digest();
    let b = before.as_str();
    let st = AgentStatus::Started;

    // In scope, for contrast: each of these is allowed.
    assert_eq!(m1.machine(1).await.unwrap().units[0].name, "wordpress/0");
    assert_eq!(
        wp.unit("wordpress/0").await.unwrap().subordinates[0].name,
        "logging/0"
    );
    assert_eq!(
        wp.scope_units(db, "wordpress/0", None).await.unwrap(),
        ["mysql/0"]
    );
    assert_eq!(
        wp.scope_units(info, "wordpress/0", None).await.unwrap(),
        ["logging/0"]
    );
    assert_eq!(
        log.scope_units(info, "logging/0", None).await.unwrap(),
        ["wordpress/0"]
    );
    assert!(m1.charm("wordpress/0").await.is_ok());
    assert!(wp.charm("logging/0").await.is_ok());
    assert!(wp.relation_settings(info, "logging/0").await.is_ok());
    assert!(wp.service_config("wordpress").await.is_ok());
    assert!(wp
        .watch(WatchTarget::Scope {
            relation: info,
            unit: unit("wordpress/0")
        })
        .await
        .is_ok());
    assert_eq!(before, w.digest());

    // watch
    denied(&w, m1.watch(WatchTarget::Machine(2)).await.map(|_| ()), b);
    denied(
        &w,
        m1.watch(WatchTarget::Unit(unit("wordpress/0")))
            .await
            .map(|_| ()),
        b,
    );
    denied(
        &w,
        wp.watch(WatchTarget::Unit(unit("mysql/0")))
            .await
            .map(|_| ()),
        b,
    );
    denied(&w, wp.watch(WatchTarget::Machine(1)).await.map(|_| ()), b);
    denied(
        &w,
        wp.watch(WatchTarget::Scope {
            relation: db,
            unit: unit("mysql/0"),
        })
        .await
        .map(|_| ()),
        b,
    );
    denied(
        &w,
        log.watch(WatchTarget::Scope {
            relation: db,
            unit: unit("logging/0"),
        })
        .await
        .map(|_| ()),
        b,
    );
    // machine, set_machine_status, ensure_dead_machine
    for id in [2, 0, 99] {
        denied(&w, m1.machine(id).await, b);
        denied(&w, m1.set_machine_status(id, st, "").await, b);
        denied(&w, m1.ensure_dead_machine(id).await, b);
    }
    denied(&w, wp.machine(1).await, b);
    denied(&w, wp.set_machine_status(1, st, "").await, b);
    denied(&w, wp.ensure_dead_machine(1).await, b);
    // charm: only what the caller deploys, or its own unit's
    for (f, u) in [
        (&m1, "mysql/0"),
        (&m1, "logging/0"),
        (&wp, "mysql/0"),
        (&wp, "logging/1"),
        (&log, "wordpress/0"),
        (&m1, "nope/7"),
    ] {
        denied(&w, f.charm(u).await, b);
        denied(&w, f.charm_files(u).await, b);
    }
    // ensure_dead_unit: the unit itself or its deployer
    for (f, u) in [
        (&m1, "mysql/0"),
        (&m1, "logging/0"),
        (&wp, "mysql/0"),
        (&wp, "logging/1"),
        (&log, "wordpress/0"),
    ] {
        denied(&w, f.ensure_dead_unit(u).await, b);
    }
    // remove_unit: its deployer only
    for (f, u) in [
        (&m1, "mysql/0"),
        (&m1, "logging/0"),
        (&wp, "wordpress/0"),
        (&log, "logging/0"),
        (&wp, "logging/1"),
    ] {
        denied(&w, f.remove_unit(u).await, b);
    }
    // set_unit_status: the unit itself or its deployer
    for (f, u) in [
        (&m1, "mysql/0"),
        (&m1, "logging/0"),
        (&wp, "mysql/0"),
        (&log, "wordpress/0"),
    ] {
        denied(&w, f.set_unit_status(u, st, "").await, b);
    }
    // unit, ensure_dying_unit, clear_resolved: the unit itself only
    for (f, u) in [
        (&m1, "wordpress/0"),
        (&wp, "mysql/0"),
        (&wp, "logging/0"),
        (&log, "wordpress/0"),
    ] {
        denied(&w, f.unit(u).await, b);
        denied(&w, f.ensure_dying_unit(u).await, b);
        denied(&w, f.clear_resolved(u).await, b);
        denied(&w, f.set_port(u, "80/tcp", true).await, b);
        let answer = jujube_agent::api::RunResult {
            code: 0,
            stdout: String::new(),
            stderr: String::new(),
            action: None,
        };
        denied(&w, f.finish_run(u, 1, answer).await, b);
        denied(&w, f.goal_state(u).await, b);
        denied(&w, f.ship_log(u, "not mine\n").await, b);
        denied(&w, f.bag(u, jujube_agent::api::Bag::Leader).await, b);
        let changes = vec![("k".to_string(), Some("v".to_string()))];
        denied(
            &w,
            f.update_bag(u, jujube_agent::api::Bag::Leader, changes)
                .await,
            b,
        );
    }
    // enter/leave scope, scope units, relation settings: only its own unit,
    // in relations of its own service
    for (f, rel, u) in [
        (&wp, db, "mysql/0"),
        (&log, db, "logging/0"),
        (&m1, db, "wordpress/0"),
        (&wp, 999, "wordpress/0"),
    ] {
        denied(&w, f.enter_scope(rel, u, vec![]).await, b);
        denied(&w, f.leave_scope(rel, u).await, b);
        denied(&w, f.scope_units(rel, u, None).await, b);
        denied(
            &w,
            f.update_relation_settings(rel, u, vec![("k".into(), Some("v".into()))])
                .await,
            b,
        );
    }
    // relation settings of units it cannot see: another container, another
    // relation, or for a machine agent anything
    denied(&w, wp.relation_settings(info, "logging/1").await, b);
    denied(&w, log.relation_settings(info, "wordpress/1").await, b);
    denied(&w, log.relation_settings(db, "mysql/0").await, b);
    denied(&w, m1.relation_settings(db, "wordpress/0").await, b);
    // service config: its own service only
    denied(&w, wp.service_config("mysql").await, b);
    denied(&w, log.service_config("wordpress").await, b);
    denied(&w, m1.service_config("wordpress").await, b);
}

#[test]
fn the_store_checks_the_caller_of_every_agent_side_write() {
    let (w, db, _) = scoped_world();
    w.store.destroy_units(&["wordpress/1".into()]).unwrap();
    let before = w.digest();
    let m = |id| Caller::Machine(id);
    let u = |n: &str| Caller::Unit(n.to_string());
    let cases: Vec<(Caller, AgentOp)> = vec![
        (
            u("mysql/0"),
            AgentOp::SetUnitStatus {
                unit: unit("wordpress/0"),
                status: "started".into(),
                info: String::new(),
            },
        ),
        (
            m(2),
            AgentOp::SetMachineAgentStatus {
                machine: 1,
                status: "started".into(),
                info: String::new(),
            },
        ),
        (
            Caller::Controller,
            AgentOp::SetMachineAgentStatus {
                machine: 1,
                status: "started".into(),
                info: String::new(),
            },
        ),
        (
            u("mysql/0"),
            AgentOp::EnterScope {
                relation: db,
                unit: unit("wordpress/1"),
                settings: Vec::new(),
            },
        ),
        (
            m(1),
            AgentOp::LeaveScope {
                relation: db,
                unit: unit("wordpress/0"),
            },
        ),
        (
            u("wordpress/0"),
            AgentOp::UpdateRelationSettings {
                relation: db,
                unit: unit("mysql/0"),
                changes: vec![],
            },
        ),
        (
            u("wordpress/0"),
            AgentOp::EnsureDyingUnit {
                unit: unit("logging/0"),
            },
        ),
        (
            m(2),
            AgentOp::EnsureDeadUnit {
                unit: unit("wordpress/1"),
            },
        ),
        (
            u("wordpress/0"),
            AgentOp::EnsureDeadUnit {
                unit: unit("logging/1"),
            },
        ),
        (
            u("wordpress/1"),
            AgentOp::RemoveUnit {
                unit: unit("wordpress/1"),
            },
        ),
        (
            m(1),
            AgentOp::RemoveUnit {
                unit: unit("logging/0"),
            },
        ),
        (m(2), AgentOp::EnsureDeadMachine { machine: 1 }),
        // The controller only for a machine that never had an instance.
        (
            Caller::Controller,
            AgentOp::EnsureDeadMachine { machine: 1 },
        ),
        (m(1), AgentOp::RemoveMachine { machine: 1 }),
        // A run is answered by its unit's own agent only.
        (
            m(1),
            AgentOp::FinishRun {
                unit: unit("wordpress/0"),
                id: 1,
                result: answer(),
            },
        ),
        (
            u("mysql/0"),
            AgentOp::FinishRun {
                unit: unit("wordpress/0"),
                id: 1,
                result: answer(),
            },
        ),
    ];
    w.provision();
    w.store
        .queue_run("wordpress/0", &["true".to_string()], 60)
        .unwrap();
    let before_provisioned = w.digest();
    assert_ne!(before, before_provisioned);
    for (by, op) in cases {
        let e = w
            .store
            .apply(&by, &op)
            .expect_err(&format!("{by} must not {op:?}"));
        assert!(
            matches!(e, jujube_state::Error::Unauthorized { .. }),
            "{op:?}: {e}"
        );
        assert!(e.is_refusal());
        assert_eq!(
            before_provisioned,
            w.digest(),
            "refused {op:?} changed the store"
        );
    }
    // And batched, a refused op among allowed ones changes nothing itself.
    let ok = AgentOp::SetUnitStatus {
        unit: unit("mysql/0"),
        status: "error".into(),
        info: "x".into(),
    };
    let bad = AgentOp::RemoveUnit {
        unit: unit("mysql/0"),
    };
    let results = w
        .store
        .apply_batch(&[(u("mysql/0"), ok), (u("mysql/0"), bad)])
        .unwrap();
    assert!(results[0].is_ok());
    assert!(matches!(
        results[1],
        Err(jujube_state::Error::Unauthorized { .. })
    ));
    assert_eq!(w.store.unit("mysql/0").unwrap().status, "error");
    assert!(w.store.unit("mysql/0").is_ok());
}

#[test]
fn a_subordinate_sets_itself_dying_only_when_no_alive_container_relation_remains() {
    let (w, _, info) = scoped_world();
    let me = || Caller::Unit(unit("logging/0"));
    let dying = || AgentOp::EnsureDyingUnit {
        unit: unit("logging/0"),
    };
    let before = w.digest();
    let e = w.store.apply(&me(), &dying()).unwrap_err();
    assert!(e.to_string().contains("is still wanted"), "{e}");
    assert_eq!(before, w.digest());
    // Today's `destroy-relation` leaves a Dying relation (units are in its
    // scope); the subordinate may now go.
    w.store.destroy_relation("logging", "wordpress").unwrap();
    assert_eq!(
        w.store.relation(info).unwrap().life,
        jujube_core::Life::Dying
    );
    w.apply(me(), dying());
    assert_eq!(
        w.store.unit("logging/0").unwrap().life,
        jujube_core::Life::Dying
    );
    // A principal whose service is Alive may not.
    let e = w
        .store
        .apply(
            &Caller::Unit(unit("wordpress/0")),
            &AgentOp::EnsureDyingUnit {
                unit: unit("wordpress/0"),
            },
        )
        .unwrap_err();
    assert!(e.is_refusal());
}

#[test]
fn the_pending_shortcut_keys_on_the_agent_started_marker_not_the_status() {
    let w = World::new();
    w.deploy(MYSQL, "mysql", 2);
    // A deployer reporting a failed deploy does not start the unit's agent.
    let err = AgentOp::SetUnitStatus {
        unit: unit("mysql/0"),
        status: "failed".into(),
        info: "cannot deploy: disk full".into(),
    };
    w.apply(Caller::Machine(1), err);
    assert!(!w.store.unit("mysql/0").unwrap().agent_started);
    w.store.destroy_units(&["mysql/0".into()]).unwrap();
    assert!(
        w.store.unit("mysql/0").is_err(),
        "no agent: removed at once"
    );
    // The unit's own agent reporting marks it started.
    let started = AgentOp::SetUnitStatus {
        unit: unit("mysql/1"),
        status: "started".into(),
        info: String::new(),
    };
    w.apply(Caller::Unit(unit("mysql/1")), started);
    assert!(w.store.unit("mysql/1").unwrap().agent_started);
    w.store.destroy_units(&["mysql/1".into()]).unwrap();
    assert_eq!(
        w.store.unit("mysql/1").unwrap().life,
        jujube_core::Life::Dying
    );
}

#[test]
fn a_unit_whose_own_agent_sets_it_dying_is_not_removed_at_once() {
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    // The service goes before its unit's agent reported anything (the
    // cleaner that would set the unit Dying has not run).
    w.store.destroy_service("mysql").unwrap();
    assert!(!w.store.unit("mysql/0").unwrap().agent_started);
    w.apply(
        Caller::Unit(unit("mysql/0")),
        AgentOp::EnsureDyingUnit {
            unit: unit("mysql/0"),
        },
    );
    let u = w.store.unit("mysql/0").expect("still there, Dying");
    assert_eq!(u.life, jujube_core::Life::Dying);
    assert!(u.agent_started);
}

#[test]
fn scope_units_are_filtered_to_the_callers_container_and_counterparts() {
    let (w, db, info) = scoped_world();
    let seen = |rel, u: &str| w.store.scope_units_seen_by(rel, u, None).unwrap();
    assert_eq!(seen(info, "wordpress/0"), ["logging/0"]);
    assert_eq!(seen(info, "wordpress/1"), ["logging/1"]);
    assert_eq!(seen(info, "logging/1"), ["wordpress/1"]);
    assert_eq!(seen(db, "mysql/0"), ["wordpress/0"]);
    assert_eq!(w.store.unit_scopes("wordpress/0").unwrap(), vec![db, info]);
    assert_eq!(w.store.unit_scopes("logging/1").unwrap(), vec![info]);
    // With their settings, in one read: the same members, each with its
    // settings as `relation_settings` reads them.
    w.apply(
        Caller::Unit(unit("wordpress/0")),
        AgentOp::UpdateRelationSettings {
            relation: db,
            unit: unit("wordpress/0"),
            changes: vec![("host".into(), Some("10.0.0.1".into()))],
        },
    );
    assert_eq!(
        w.store
            .scope_settings_seen_by(db, "mysql/0", None)
            .unwrap()
            .units[0]
            .1
            .as_ref()
            .unwrap()["host"],
        "10.0.0.1"
    );
    for (rel, u) in [
        (info, "wordpress/0"),
        (info, "logging/1"),
        (db, "mysql/0"),
        (db, "wordpress/0"),
    ] {
        let together = w.store.scope_settings_seen_by(rel, u, None).unwrap();
        let apart: Vec<_> = seen(rel, u)
            .into_iter()
            .map(|m| {
                let settings = w.store.relation_settings(rel, &m).unwrap();
                (m, Some(settings))
            })
            .collect();
        assert_eq!(together.units, apart, "{u} in {rel}");
    }
}

/// An agent reads a scope larger than one answer page by page, through
/// its facade, and gets every member once, in order.
#[tokio::test]
async fn an_agent_reads_a_scope_of_more_than_one_page_whole() {
    use jujube_agent::api::{scope_settings_all, MAX_SCOPE_MEMBERS};
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 1);
    let ms = w.deploy(MYSQL, "mysql", MAX_SCOPE_MEMBERS + 2);
    let rel = w.store.add_relation("wordpress", "mysql").unwrap().id;
    for u in std::iter::once("wordpress/0").chain(ms.iter().map(String::as_str)) {
        w.enter_scope(rel, u);
    }
    // The first page's settings fit one answer; the second page's two
    // would too, but not on top of the first's.
    let set = |u: &str, len: usize| {
        w.apply(
            Caller::Unit(unit(u)),
            AgentOp::UpdateRelationSettings {
                relation: rel,
                unit: unit(u),
                changes: vec![("blob".into(), Some("b".repeat(len)))],
            },
        )
    };
    for m in &ms[..MAX_SCOPE_MEMBERS] {
        set(m, 780);
    }
    for m in &ms[MAX_SCOPE_MEMBERS..] {
        set(m, 200 << 10);
    }
    let f = Facades::new(w.store.clone()).unwrap();
    let wp = f.for_agent(Tag::unit("wordpress/0"));
    let page = wp.scope_settings(rel, "wordpress/0", None).await.unwrap();
    assert_eq!(page.units.len(), MAX_SCOPE_MEMBERS);
    assert!(page.units.iter().all(|(_, s)| s.is_some()));
    let all = scope_settings_all(&*wp, rel, "wordpress/0").await.unwrap();
    let names: Vec<&str> = all.units.iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(names, ms.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(all.app, page.app);
    // Settings kept over all pages stay within one answer's bound; the
    // member past it comes without (read on its own).
    let kept: usize = all
        .units
        .iter()
        .filter_map(|(_, s)| s.as_ref())
        .map(|s| s["blob"].len())
        .sum();
    assert!(
        kept <= jujube_agent::api::MAX_SCOPE_SETTINGS_BYTES,
        "{kept}"
    );
    assert!(all.units[MAX_SCOPE_MEMBERS].1.is_some());
    assert!(all.units[MAX_SCOPE_MEMBERS + 1].1.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_tell_exactly_the_agents_that_can_see_a_change() {
    use futures_util::{FutureExt, StreamExt};
    let (w, _, info) = scoped_world();
    let f = Facades::new(w.store.clone()).unwrap();
    f.ready().await;
    let watch = |tag: Tag, target: WatchTarget| {
        let api = f.for_agent(tag);
        async move { api.watch(target).await.unwrap() }
    };
    let mut wp0 = watch(
        Tag::unit("wordpress/0"),
        WatchTarget::Unit(unit("wordpress/0")),
    )
    .await;
    let mut scope0 = watch(
        Tag::unit("wordpress/0"),
        WatchTarget::Scope {
            relation: info,
            unit: unit("wordpress/0"),
        },
    )
    .await;
    let mut mysql = watch(Tag::unit("mysql/0"), WatchTarget::Unit(unit("mysql/0"))).await;
    let mut m1 = watch(Tag::Machine(1), WatchTarget::Machine(1)).await;
    let mut m2 = watch(Tag::Machine(2), WatchTarget::Machine(2)).await;
    // Notices are in feed order: once a later change is told, an earlier one
    // would have been told already.
    let quiet = |s: &mut jujube_agent::api::NoticeStream, who: &str| {
        assert!(
            s.next().now_or_never().is_none(),
            "{who} was told of a change it cannot see"
        );
    };

    // A status message matters to nobody; a subordinate leaving the scope
    // of another container only to that container.
    let status = AgentOp::SetUnitStatus {
        unit: unit("mysql/0"),
        status: "started".into(),
        info: "busy".into(),
    };
    w.apply(Caller::Unit(unit("mysql/0")), status);
    w.apply(
        Caller::Unit(unit("logging/1")),
        AgentOp::LeaveScope {
            relation: info,
            unit: unit("logging/1"),
        },
    );
    w.apply(
        Caller::Unit(unit("logging/0")),
        AgentOp::LeaveScope {
            relation: info,
            unit: unit("logging/0"),
        },
    );
    assert!(scope0.next().await.is_some());
    for (s, who) in [
        (&mut wp0, "wordpress/0"),
        (&mut mysql, "mysql/0"),
        (&mut m1, "machine 1"),
        (&mut m2, "machine 2"),
    ] {
        quiet(s, who);
    }

    // A unit's life: the unit and its machine, no one else.
    w.store.destroy_units(&["mysql/0".into()]).unwrap();
    assert!(mysql.next().await.is_some());
    assert!(m2.next().await.is_some());
    quiet(&mut wp0, "wordpress/0");
    quiet(&mut m1, "machine 1");

    // A service's life: its units.
    w.store.destroy_service("wordpress").unwrap();
    assert!(wp0.next().await.is_some());
}

/// Where the controllers serve reaches every machine agent (its view carries
/// it) when it changes, and nobody on a controller's beat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_moving_tells_every_machine_agent_and_no_unit() {
    use futures_util::{FutureExt, StreamExt};
    let (w, _, _) = scoped_world();
    let at = vec!["127.0.0.1:17070".to_string()];
    w.store.controller_seen(0, "machine-0/h", &at, 1).unwrap();
    let f = Facades::new(w.store.clone()).unwrap();
    f.ready().await;
    let m1 = f.for_agent(Tag::Machine(1));
    assert_eq!(m1.machine(1).await.unwrap().api_addresses, at);
    let mut n1 = m1.watch(WatchTarget::Machine(1)).await.unwrap();
    let mut n2 = f
        .for_agent(Tag::Machine(2))
        .watch(WatchTarget::Machine(2))
        .await
        .unwrap();
    let mut wp0 = f
        .for_agent(Tag::unit("wordpress/0"))
        .watch(WatchTarget::Unit(unit("wordpress/0")))
        .await
        .unwrap();
    // The beat: nothing to tell. Then the controller moves.
    w.store.controller_seen(0, "machine-0/h", &at, 2).unwrap();
    let moved = vec!["127.0.0.1:17170".to_string()];
    w.store
        .controller_seen(0, "machine-0/h", &moved, 3)
        .unwrap();
    let head = w.store.head_revision().unwrap();
    for n in [&mut n1, &mut n2] {
        let told = tokio::time::timeout(std::time::Duration::from_secs(10), n.next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(told.revision, head);
    }
    assert_eq!(m1.machine(1).await.unwrap().api_addresses, moved);
    assert!(wp0.next().now_or_never().is_none(), "a unit agent was told");
}

/// Agents told to reach each controller machine where the controller
/// says (LXD: a socket per controller proxied into their container) are
/// given that, for every controller machine, and told again when a new
/// controller first records itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reach_each_controller_where_they_are_told_and_learn_new_ones() {
    use futures_util::StreamExt;
    let (w, _, _) = scoped_world();
    w.store
        .controller_seen(0, "machine-0/h", &["127.0.0.1:17070".to_string()], 1)
        .unwrap();
    let f = Facades::new(w.store.clone()).unwrap();
    f.ready().await;
    f.agents_reach_controllers_at(Arc::new(|m| format!("unix:/s/api-{m}.socket")))
        .unwrap();
    let m1 = f.for_agent(Tag::Machine(1));
    assert_eq!(
        m1.machine(1).await.unwrap().api_addresses,
        vec!["unix:/s/api-0.socket".to_string()]
    );
    let mut n1 = m1.watch(WatchTarget::Machine(1)).await.unwrap();
    let added = w.store.enable_ha(3).unwrap();
    for &m in &added {
        w.store
            .controller_seen(
                m,
                &format!("machine-{m}/h"),
                &[format!("127.0.0.1:{}", 17100 + m)],
                2,
            )
            .unwrap();
    }
    let want: Vec<String> = std::iter::once(0)
        .chain(added.iter().copied())
        .map(|m| format!("unix:/s/api-{m}.socket"))
        .collect();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while m1.machine(1).await.unwrap().api_addresses != want {
        tokio::time::timeout_at(deadline, n1.next())
            .await
            .expect("machine 1's agent was not told of the new controllers")
            .unwrap();
    }
}

/// A controller without the directory of a charm another controller kept
/// (`enable-ha`) restores it from the archive the state keeps, whole,
/// before it answers where the charm is; without an archive it answers as
/// before, and the read names the missing path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charm_another_controller_kept_is_restored_from_the_state() {
    let (w, _, _) = scoped_world();
    let f = Facades::new(w.store.clone()).unwrap();
    let wp = f.for_agent(Tag::unit("wordpress/0"));
    let path = std::path::PathBuf::from(wp.charm("wordpress/0").await.unwrap().path);
    std::fs::write(path.join("hooks/install"), "#!/bin/sh\necho kept\n").unwrap();
    let mut archive = Vec::new();
    jujube_agent::charmdir::write_archive(&path, &mut archive).unwrap();
    w.store
        .keep_charm_archive(&path.to_string_lossy(), &archive)
        .unwrap();
    std::fs::remove_dir_all(&path).unwrap();

    let got = wp.charm("wordpress/0").await.unwrap();
    assert_eq!(std::path::Path::new(&got.path), path);
    assert_eq!(
        std::fs::read_to_string(path.join("hooks/install")).unwrap(),
        "#!/bin/sh\necho kept\n"
    );
    assert_eq!(
        std::fs::read_to_string(path.join("metadata.yaml")).unwrap(),
        "name: wordpress\n"
    );
    let beside: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".restoring"))
        .collect();
    assert!(beside.is_empty(), "{beside:?}");

    // No archive kept (a charm from before archives): the path as before.
    let mysql = f.for_agent(Tag::unit("mysql/0"));
    let mpath = mysql.charm("mysql/0").await.unwrap().path;
    std::fs::remove_dir_all(&mpath).unwrap();
    assert_eq!(mysql.charm("mysql/0").await.unwrap().path, mpath);
    let e = mysql.charm_files("mysql/0").await.unwrap_err();
    assert!(e.message.contains(&mpath), "{e:?}");
}

/// The facade's facades are cheap handles: one writer, one router.
#[allow(dead_code)]
fn facade_is_object_safe(f: Arc<dyn Facade>) -> Arc<dyn Facade> {
    f
}

fn answer() -> jujube_state::runs::RunResult {
    jujube_state::runs::RunResult {
        code: 0,
        stdout: "forged".into(),
        stderr: String::new(),
        action: None,
    }
}

/// A machine that gets its instance after the revision the hub starts from
/// but before its first load looks unchanged to it; the host, whose own
/// first look may have come before the instance, must still hear of it.
#[tokio::test(start_paused = true)]
async fn a_machine_provisioned_before_the_hubs_first_load_is_announced() {
    let w = World::new();
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    let from = w.store.head_revision().unwrap();
    w.provision();
    let hub = Arc::new(crate::hub::Hub::default());
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(hub.clone().run(w.store.clone(), from, stop_rx));
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        hub.machines_changed.notified(),
    )
    .await
    .expect("the host is told to look at the machines");
    assert!(hub.take_machine_events().contains(&id));
    task.abort();
}

/// What each of 200,000 idle agents keeps stays small: the agents, and the
/// unit's hook record while a pass holds it.
/// (An idle agent has no task: see
/// `idle_agents_are_parked_without_a_task_and_wake_for_changes`.)
#[tokio::test]
async fn an_idle_agent_keeps_little() {
    let w = World::new();
    let f = Facades::new(w.store.clone()).unwrap();
    let dir = w.dir.path();
    let m = jujube_agent::machine::MachineAgent::new(
        f.for_agent(Tag::Machine(1)),
        f.connector(),
        1,
        dir,
    );
    assert!(
        std::mem::size_of_val(&m) <= 88,
        "{}",
        std::mem::size_of_val(&m)
    );
    let u = jujube_agent::unit::UnitAgent::new(
        f.for_agent(Tag::unit("a/0")),
        f.connector(),
        Arc::from(dir),
    );
    assert!(
        std::mem::size_of_val(&u) <= 128,
        "{}",
        std::mem::size_of_val(&u)
    );
    // The hook record is let go when the agent goes idle (only the agents
    // in a pass, at most the permits' 512, and one whose save failed hold
    // one), so its size is bounded loosely: 104 bytes since `removed`.
    let hooks = std::mem::size_of::<jujube_agent::hooks::state::HookState>();
    assert!(hooks <= 104, "{hooks}");
}

/// Heap bytes allocated minus freed by the current thread: what a
/// `current_thread` test's tasks keep (the store's writer thread and the
/// blocking pool count elsewhere).
mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Counting;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    fn grew(by: isize) {
        let live = LIVE.with(|l| {
            l.set(l.get() + by);
            l.get()
        });
        PEAK.with(|p| p.set(p.get().max(live)));
    }

    // SAFETY: every call goes to `System`; the counter only observes sizes.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            grew(layout.size() as isize);
            System.alloc(layout)
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            LIVE.with(|l| l.set(l.get() - layout.size() as isize));
            System.dealloc(ptr, layout)
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
            grew(new as isize - layout.size() as isize);
            System.realloc(ptr, layout, new)
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    pub(crate) fn live_here() -> isize {
        LIVE.with(|l| l.get())
    }

    /// The most this thread held since the last call (or its start).
    pub(crate) fn peak_here() -> isize {
        let live = live_here();
        PEAK.with(|p| p.replace(live))
    }
}

/// `n` provisioned machines, the facades over them and the permits their
/// in-process agents share.
struct Machines {
    w: World,
    ids: Vec<i64>,
    f: Facades,
    connector: Arc<dyn jujube_agent::api::Connector>,
    passes: Arc<jujube_agent::Passes>,
}

impl Machines {
    async fn new(n: usize) -> Machines {
        let w = World::new();
        let ids = w.store.add_machines(n, None, None).unwrap();
        w.provision();
        let f = Facades::new(w.store.clone()).unwrap();
        f.ready().await;
        let connector = f.connector();
        let passes = connector.passes().expect("in-process agents share passes");
        Machines {
            w,
            ids,
            f,
            connector,
            passes,
        }
    }

    /// Starts machine `id`'s agent.
    fn spawn(&self, id: i64) -> jujube_agent::Running {
        jujube_agent::machine::MachineAgent::new(
            self.f.for_agent(Tag::Machine(id)),
            self.connector.clone(),
            id,
            &self.w.dir.path().join(format!("machine-{id}")),
        )
        .spawn()
    }
}

/// One change wakes every agent of a service (100,000 in the benchmark, as
/// at a controller's start), and each then waits for a pass's permit: what
/// it holds meanwhile is most of the controller's peak. It waits parked,
/// without a task: waiting inside the whole pass-sized future, a waiting
/// machine agent kept 1,160 bytes.
#[tokio::test(flavor = "current_thread")]
async fn an_agent_waiting_for_a_pass_keeps_little() {
    const N: usize = 500;
    let m = Machines::new(N).await;
    let (ids, passes) = (&m.ids, &m.passes);
    let all: Vec<_> = (0..crate::facade::PASSES)
        .map(|_| passes.try_acquire().expect("a free permit"))
        .collect();
    assert!(passes.try_acquire().is_none());
    let mut running = Vec::with_capacity(N);
    let tasks = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let before = heap::live_here();
    for &id in ids {
        running.push(m.spawn(id));
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let per_agent = (heap::live_here() - before) / N as isize;
    // Each has subscribed and waits: its cell, its boxed loop state, its
    // facade handle and subscription, and its place in the queue.
    assert!(per_agent <= 600, "{per_agent} bytes per waiting agent");
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    assert_eq!(alive, tasks, "waiting agents hold no task");
    drop(all);
    for r in &running {
        r.stop();
    }
    for r in running {
        r.finished().await;
    }
    // Every permit came back: those handed to agents that were stopped
    // before their pass too.
    let all: Vec<_> = (0..crate::facade::PASSES)
        .map(|_| passes.try_acquire().expect("every permit back"))
        .collect();
    assert_eq!(all.len(), crate::facade::PASSES);
}

/// A change that wakes agents while every permit is taken (a destroyed
/// service's cleanup wakes 100,000 within a second) queues them as they are
/// woken, without a task each: a task spawned only to queue the agent and
/// park it again held 230 bytes until the runtime got to it, 25 MB of the
/// benchmark's peak.
#[tokio::test(flavor = "current_thread")]
async fn agents_woken_while_every_permit_is_taken_queue_without_a_task_each() {
    const N: usize = 300;
    let m = Machines::new(N).await;
    let (w, ids, passes) = (&m.w, &m.ids, &m.passes);
    let running: Vec<_> = ids.iter().map(|&id| m.spawn(id)).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let started = || {
        w.store
            .machines()
            .unwrap()
            .iter()
            .filter(|m| m.agent_status == "started")
            .count()
    };
    while started() < N {
        assert!(std::time::Instant::now() < deadline, "agents never started");
        tokio::task::yield_now().await;
    }
    // Every permit taken, once the first passes have given theirs back.
    let mut held = Vec::new();
    while held.len() < crate::facade::PASSES {
        assert!(
            std::time::Instant::now() < deadline,
            "permits never returned"
        );
        match passes.try_acquire() {
            Some(p) => held.push(p),
            None => tokio::task::yield_now().await,
        }
    }
    // Routing runs on this thread's runtime, and the wakes with it.
    let before = heap::live_here();
    heap::peak_here();
    // In the fewest commands allowed, one right after the other.
    for chunk in ids.chunks(jujube_state::MAX_NAMED_PER_COMMAND) {
        w.store.destroy_machines(chunk).unwrap();
    }
    while passes.queued() < N {
        assert!(std::time::Instant::now() < deadline, "agents never queued");
        tokio::task::yield_now().await;
    }
    // What routing the change takes (its feed entries, the keys woken)
    // and each agent's place in the queue; a task each came to 315.
    let per_agent = (heap::peak_here() - before) / N as isize;
    assert!(
        per_agent <= 200,
        "{per_agent} bytes per woken agent at the peak"
    );
    // Granted permits, each sets its Dying machine Dead and ends.
    drop(held);
    for r in running {
        r.finished().await;
    }
    assert_eq!(passes.queued(), 0);
    for m in w.store.machines().unwrap() {
        assert!(
            m.life == jujube_core::Life::Dead || !ids.contains(&m.id),
            "{m:?}"
        );
    }
    let all: Vec<_> = (0..crate::facade::PASSES)
        .map(|_| passes.try_acquire().expect("every permit back"))
        .collect();
    assert_eq!(all.len(), crate::facade::PASSES);
}

/// A charm packed by charmcraft links `hooks/install` to `../dispatch`:
/// such a link ships as a copy of its file; a link out of the charm, or to a
/// directory, is refused rather than followed.
#[test]
fn a_charms_links_to_its_own_files_ship_as_copies() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let charm = dir.path().join("c");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(charm.join("dispatch"), "#!/bin/sh\n").unwrap();
    symlink("../dispatch", charm.join("hooks/install")).unwrap();
    let files = crate::facade::charm_manifest(&charm).unwrap();
    let paths: Vec<&str> = files.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["dispatch", "hooks/install"]);
    assert_eq!(files[1].len, 10);
    assert_eq!(std::fs::read(&files[1].file).unwrap(), b"#!/bin/sh\n");
    for (name, target) in [("out", "../../secret"), ("dir", "../hooks")] {
        std::fs::write(dir.path().join("secret"), "key").unwrap();
        let link = charm.join("hooks").join(name);
        symlink(target, &link).unwrap();
        let err = crate::facade::charm_manifest(&charm).unwrap_err();
        assert!(
            err.message
                .contains("does not name a file inside the charm"),
            "{err}"
        );
        std::fs::remove_file(link).unwrap();
    }
}

/// What the leader writes wakes the units that act on it: an application's
/// bag in a container-scoped relation wakes the other service's units (the
/// bag has no container), leader settings wake the service's other units
/// (`leader-settings-changed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaders_bags_wake_the_units_that_read_them() {
    use futures_util::{FutureExt, StreamExt};
    use jujube_state::bags::Bag;
    let (w, _, info) = scoped_world();
    let f = Facades::new(w.store.clone()).unwrap();
    f.ready().await;
    let watch = |u: &str| {
        let api = f.for_agent(Tag::unit(u));
        let target = WatchTarget::Unit(unit(u));
        async move { api.watch(target).await.unwrap() }
    };
    let mut wp1 = watch("wordpress/1").await;
    let mut mysql = watch("mysql/0").await;
    assert!(w.store.claim_leadership("logging/0").unwrap());
    assert!(w.store.claim_leadership("wordpress/0").unwrap());
    let bag = |u: &str, bag: Bag| AgentOp::UpdateBag {
        unit: unit(u),
        bag,
        changes: vec![("k".into(), Some("v".into()))],
    };
    w.apply(
        Caller::Unit(unit("logging/0")),
        bag(
            "logging/0",
            Bag::App {
                relation: info,
                service: "logging".into(),
            },
        ),
    );
    tokio::time::timeout(std::time::Duration::from_secs(5), wp1.next())
        .await
        .expect("wordpress/1 told of logging's application settings");
    w.apply(
        Caller::Unit(unit("wordpress/0")),
        bag("wordpress/0", Bag::Leader),
    );
    tokio::time::timeout(std::time::Duration::from_secs(5), wp1.next())
        .await
        .expect("wordpress/1 told of the leader settings");
    assert!(
        mysql.next().now_or_never().is_none(),
        "mysql/0 was told of a change it cannot see"
    );
}

/// A store that cannot reach its database decided nothing: the agent is
/// told to try again (another controller), never that it was refused.
#[test]
fn a_database_out_of_reach_is_unavailable_not_a_refusal() {
    let caller = Caller::Machine(1);
    let unreachable = jujube_state::Error::Unreachable {
        url: "postgres://jujube@db/env".into(),
        cause: "connection refused".into(),
    };
    assert!(unreachable.is_unavailable());
    let e = crate::facade::api_error(&caller, unreachable);
    assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
    let refused = jujube_state::Error::BadLease("no".into());
    assert!(!refused.is_unavailable());
    assert_ne!(
        crate::facade::api_error(&caller, refused).code,
        ErrorCode::Unavailable
    );
}

/// The agents a controller runs under its singletons lease write through
/// the lease's fenced handle: once another controller holds the lease,
/// whatever they still send is refused and changes nothing (a controller
/// cut off from the database wrote its agents' "cannot reach the state
/// database" over what the new holder's agents reported), while the API's
/// agents, writing beside them in the same batches, are not fenced.
#[tokio::test]
async fn agents_run_under_a_lease_cannot_write_once_it_is_lost() {
    use jujube_state::leases::{Claim, SINGLETONS};
    let (w, _, _) = scoped_world();
    let ttl = std::time::Duration::from_secs(1);
    let Claim::Held(fence) = w.store.claim_lease(SINGLETONS, "a", 0, ttl).unwrap() else {
        panic!("a free lease was not taken");
    };
    let f = Facades::new(w.store.clone()).unwrap();
    let held = f.shared.through(w.store.fenced(fence));
    let fenced = |tag: Tag| crate::facade::InProcess::new(held.clone(), tag);
    let (m1, wp0) = (fenced(Tag::Machine(1)), fenced(Tag::unit("wordpress/0")));
    let mysql = f.for_agent(Tag::unit("mysql/0"));
    // Held: fenced writes go through, direct ones (a leadership claim) too.
    m1.set_machine_status(1, AgentStatus::Started, "")
        .await
        .unwrap();
    assert!(wp0.is_leader("wordpress/0").await.unwrap());
    assert_eq!(w.store.machine(1).unwrap().agent_status, "started");

    // Another controller takes the lease after it expired.
    let Claim::Held(b) = w.store.claim_lease(SINGLETONS, "b", 5_000, ttl).unwrap() else {
        panic!("an expired lease was not taken");
    };
    assert_eq!(b.token, 2);
    let before = w.digest();
    let (lost, api) = tokio::join!(
        m1.set_machine_status(1, AgentStatus::Failed, "cannot reach the state database"),
        wp0.set_unit_status(
            "wordpress/0",
            AgentStatus::Failed,
            "cannot reach the state database"
        ),
    );
    // Unavailable, not refused: an agent takes a refused hook commit for
    // a failed hook, and these agents are stopped, to run elsewhere.
    for e in [lost.unwrap_err(), api.unwrap_err()] {
        assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
        assert!(e.message.contains("singletons"), "{e}");
    }
    // A leadership claim that would write (logging has no leader yet).
    let logging0 = fenced(Tag::unit("logging/0"));
    let e = logging0.is_leader("logging/0").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
    assert_eq!(before, w.digest(), "a lost lease's agent wrote");

    // The API's agents write as before, in the writer's batches beside
    // refused ones.
    let (refused, written) = tokio::join!(
        m1.set_machine_status(1, AgentStatus::Failed, "late"),
        mysql.set_unit_status("mysql/0", AgentStatus::Error, "hook failed: \"install\""),
    );
    assert_eq!(refused.unwrap_err().code, ErrorCode::Unavailable);
    written.unwrap();
    assert_eq!(w.store.unit("mysql/0").unwrap().status, "error");
    assert_eq!(w.store.machine(1).unwrap().agent_status, "started");
    assert_eq!(w.store.unit("wordpress/0").unwrap().status, "started");
}
