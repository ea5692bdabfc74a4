//! The API server through real sockets and real TLS, against a real store:
//! authentication, confinement (every facade method tried out of scope),
//! trust in exactly the environment's CA, credentials that die with their
//! entity, watches that survive a server restart, and the limits.

use crate::{tls, ApiServer, Limits};
use jujube_agent::api::{AgentStatus, Bag, ErrorCode, Facade, RunResult, Tag, WatchTarget};
use jujube_agent::remote::Remote;
use jujube_agent::wire::{new_secret, secret_hash, AgentConf};
use jujube_agent_state::Facades;
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::provisioning::Started;
use jujube_state::services::DeployArgs;
use jujube_state::{Charm, Durability, Store};
use std::sync::Arc;
use std::time::Duration;

const UUID: &str = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";
const OTHER_UUID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d";
const WORDPRESS: &str = "name: wordpress\nsummary: blog\nrequires:\n  db:\n    interface: mysql\n";
const MYSQL: &str = "name: mysql\nsummary: db\nprovides:\n  db:\n    interface: mysql\n";
const LOGGING: &str = "name: logging\nsummary: logs\nsubordinate: true\nrequires:\n  juju-info:\n    interface: juju-info\n    scope: container\n";

struct World {
    dir: tempfile::TempDir,
    store: Store,
    facades: Arc<Facades>,
    server: Option<ApiServer>,
}

impl World {
    /// wordpress/0 on machine 1, wordpress/1 on machine 2, mysql/0 on
    /// machine 3, logging related to wordpress, wordpress to mysql; every
    /// machine provisioned.
    async fn new() -> World {
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
        for (meta, units) in [(WORDPRESS, 2), (MYSQL, 1), (LOGGING, 0)] {
            let meta = CharmMeta::parse(meta).unwrap();
            let path = dir.path().join("charms").join(&meta.name);
            std::fs::create_dir_all(&path).unwrap();
            store
                .deploy(&DeployArgs {
                    service: meta.name.clone(),
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
                .unwrap();
        }
        store.add_relation("wordpress", "mysql").unwrap();
        store.add_relation("logging", "wordpress").unwrap();
        let ids: Vec<i64> = store
            .machines()
            .unwrap()
            .iter()
            .map(|m| m.id)
            .filter(|&id| id != 0)
            .collect();
        let prepared = store.prepare_provisioning(&ids, UUID).unwrap();
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
        store.record_instances(&started).unwrap();
        tls::ensure(dir.path(), UUID).unwrap();
        let facades = Arc::new(Facades::new(store.clone()).unwrap());
        facades.ready().await;
        let mut w = World {
            dir,
            store,
            facades,
            server: None,
        };
        w.start(Limits::default()).await;
        w
    }

    /// A server as a restarted controller makes it: its own facades, whose
    /// change router starts at the store's head.
    async fn start(&mut self, limits: Limits) {
        self.start_serving(limits, None).await;
    }

    /// [`World::start`], serving users with `clients`.
    async fn start_serving(
        &mut self,
        limits: Limits,
        clients: Option<Arc<dyn crate::clients::ClientHandler>>,
    ) {
        self.server = None;
        self.facades = Arc::new(Facades::new(self.store.clone()).unwrap());
        self.facades.ready().await;
        let sock = self.dir.path().join("api.socket");
        self.server = Some(
            ApiServer::start(
                self.dir.path(),
                self.store.clone(),
                self.facades.clone(),
                Some("127.0.0.1:0"),
                Some(&sock),
                limits,
                clients,
            )
            .await
            .unwrap(),
        );
    }

    fn machine_of(&self, unit: &str) -> i64 {
        self.store.unit(unit).unwrap().machine_id.unwrap()
    }

    /// A credential for machine `id`, as the provisioner makes it.
    fn machine_conf(&self, id: i64) -> AgentConf {
        let secret = new_secret();
        let tag = Tag::Machine(id);
        self.store
            .set_machine_credential(id, &tag.to_string(), &secret_hash(&secret))
            .unwrap();
        self.conf(tag, secret)
    }

    fn conf(&self, tag: Tag, secret: String) -> AgentConf {
        AgentConf {
            api_addresses: self.server.as_ref().unwrap().addresses(),
            ca_cert: tls::ca_cert(self.dir.path()).unwrap(),
            tag,
            secret,
            env_name: "test".into(),
            env_uuid: String::new(),
        }
    }

    fn remote(&self, conf: &AgentConf) -> Remote {
        Remote::new(conf).unwrap()
    }
}

fn assert_unauthorized<T: std::fmt::Debug>(what: &str, r: Result<T, jujube_agent::api::ApiError>) {
    match r {
        Err(e) if e.code == ErrorCode::Unauthorized => {}
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

/// Every facade method, about entities outside `api`'s scope.
async fn try_everything_out_of_scope(api: &dyn Facade, machine: i64, unit: &str, relation: i64) {
    assert_unauthorized(
        "watch machine",
        api.watch(WatchTarget::Machine(machine)).await.map(|_| ()),
    );
    assert_unauthorized(
        "watch unit",
        api.watch(WatchTarget::Unit(unit.into())).await.map(|_| ()),
    );
    assert_unauthorized(
        "watch scope",
        api.watch(WatchTarget::Scope {
            relation,
            unit: unit.into(),
        })
        .await
        .map(|_| ()),
    );
    assert_unauthorized("machine", api.machine(machine).await);
    assert_unauthorized(
        "set_machine_status",
        api.set_machine_status(machine, AgentStatus::Started, "")
            .await,
    );
    assert_unauthorized(
        "ensure_dead_machine",
        api.ensure_dead_machine(machine).await,
    );
    assert_unauthorized("charm", api.charm(unit).await);
    assert_unauthorized("charm_files", api.charm_files(unit).await);
    assert_unauthorized("ensure_dead_unit", api.ensure_dead_unit(unit).await);
    assert_unauthorized("remove_unit", api.remove_unit(unit).await);
    assert_unauthorized(
        "set_unit_status",
        api.set_unit_status(unit, AgentStatus::Started, "").await,
    );
    assert_unauthorized("unit", api.unit(unit).await);
    assert_unauthorized("ensure_dying_unit", api.ensure_dying_unit(unit).await);
    assert_unauthorized("clear_resolved", api.clear_resolved(unit).await);
    assert_unauthorized("set_port", api.set_port(unit, "80/tcp", true).await);
    let answer = RunResult {
        code: 0,
        stdout: String::new(),
        stderr: String::new(),
        action: None,
    };
    assert_unauthorized("finish_run", api.finish_run(unit, 1, answer).await);
    assert_unauthorized("enter_scope", api.enter_scope(relation, unit, vec![]).await);
    assert_unauthorized("leave_scope", api.leave_scope(relation, unit).await);
    assert_unauthorized("scope_units", api.scope_units(relation, unit, None).await);
    assert_unauthorized(
        "scope_settings",
        api.scope_settings(relation, unit, None).await,
    );
    assert_unauthorized(
        "set_workload_status",
        api.set_workload_status(unit, false, "active", "").await,
    );
    assert_unauthorized("workload_status", api.workload_status(unit, false).await);
    assert_unauthorized("application_status", api.application_status(unit).await);
    assert_unauthorized("is_leader", api.is_leader(unit).await);
    assert_unauthorized(
        "relation_settings",
        api.relation_settings(relation, unit).await,
    );
    assert_unauthorized(
        "update_relation_settings",
        api.update_relation_settings(relation, unit, vec![("k".into(), Some("v".into()))])
            .await,
    );
    assert_unauthorized("goal_state", api.goal_state(unit).await);
    assert_unauthorized("bag", api.bag(unit, Bag::Leader).await);
    assert_unauthorized(
        "update_bag",
        api.update_bag(unit, Bag::Leader, vec![("k".into(), Some("v".into()))])
            .await,
    );
}

fn relation(w: &World, key: &str) -> i64 {
    w.store
        .relations()
        .unwrap()
        .into_iter()
        .find(|r| r.key.contains(key))
        .unwrap_or_else(|| panic!("no relation like `{key}`"))
        .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_agent_reaches_its_machine_and_units_and_nothing_else() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let m2 = w.machine_of("wordpress/1");
    let conf = w.machine_conf(m1);
    let api = w.remote(&conf);
    let view = api.machine(m1).await.unwrap();
    assert_eq!(
        view.units
            .iter()
            .map(|u| u.name.as_str())
            .collect::<Vec<_>>(),
        ["wordpress/0"]
    );
    api.set_machine_status(m1, AgentStatus::Started, "")
        .await
        .unwrap();
    assert_eq!(
        api.charm("wordpress/0").await.unwrap().url,
        "local:jammy/wordpress-1"
    );

    let before = w.store.head_revision().unwrap();
    let db = relation(&w, "mysql");
    try_everything_out_of_scope(&api, m2, "wordpress/1", db).await;
    try_everything_out_of_scope(&api, m2, "mysql/0", db).await;
    // A machine agent is not its units' agent either.
    assert_unauthorized("unit of its own machine", api.unit("wordpress/0").await);
    assert_eq!(
        w.store.head_revision().unwrap(),
        before,
        "a refusal changed something"
    );

    // It sets the credential of the unit it deploys, and only that one.
    let secret = api.new_unit_credential("wordpress/0").await.unwrap();
    assert_unauthorized(
        "credential of another machine's unit",
        api.new_unit_credential("wordpress/1").await,
    );
    assert_unauthorized(
        "credential of a unit of nobody's",
        api.new_unit_credential("mysql/7").await,
    );
    let stored = w
        .store
        .agent_credential("unit-wordpress-0")
        .unwrap()
        .unwrap();
    assert_ne!(stored, secret, "the store keeps the hash, never the secret");
    assert_eq!(stored, secret_hash(&secret));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_agent_sees_its_unit_its_relations_and_its_container_only() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let machine = w.remote(&w.machine_conf(m1));
    let secret = machine.new_unit_credential("wordpress/0").await.unwrap();
    let conf = w.conf(Tag::unit("wordpress/0"), secret);
    let api = w.remote(&conf);

    let view = api.unit("wordpress/0").await.unwrap();
    assert_eq!(view.service, "wordpress");
    let db = relation(&w, "mysql");
    let logging = relation(&w, "logging");
    api.enter_scope(db, "wordpress/0", vec![]).await.unwrap();
    api.update_relation_settings(
        db,
        "wordpress/0",
        vec![("host".into(), Some("10.0.0.1".into()))],
    )
    .await
    .unwrap();
    assert_eq!(
        api.relation_settings(db, "wordpress/0")
            .await
            .unwrap()
            .get("host")
            .map(String::as_str),
        Some("10.0.0.1")
    );
    // Entering the container scope creates its subordinate, which it may
    // give a credential to, and whose agent then sees only its container.
    api.enter_scope(logging, "wordpress/0", vec![])
        .await
        .unwrap();
    let subs = api.unit("wordpress/0").await.unwrap().subordinates;
    assert_eq!(subs.len(), 1);
    let sub = subs[0].name.clone();
    // Its machine agent may set it too (it runs on that machine); the
    // principal of another machine may not.
    machine.new_unit_credential(&sub).await.unwrap();
    let sub_secret = api.new_unit_credential(&sub).await.unwrap();
    let sub_api = w.remote(&w.conf(Tag::unit(&sub), sub_secret));
    assert_eq!(
        sub_api.unit(&sub).await.unwrap().principal.as_deref(),
        Some("wordpress/0")
    );

    // wordpress/1 enters the logging scope too: its subordinate is not
    // visible to wordpress/0's subordinate.
    let m2 = w.machine_of("wordpress/1");
    let machine2 = w.remote(&w.machine_conf(m2));
    let wp1 = w.remote(&w.conf(
        Tag::unit("wordpress/1"),
        machine2.new_unit_credential("wordpress/1").await.unwrap(),
    ));
    wp1.enter_scope(logging, "wordpress/1", vec![])
        .await
        .unwrap();
    let other_sub = wp1.unit("wordpress/1").await.unwrap().subordinates[0]
        .name
        .clone();
    assert_eq!(
        sub_api.scope_units(logging, &sub, None).await.unwrap(),
        ["wordpress/0"]
    );
    // Members and settings in one call: the same units, each with what
    // `relation_settings` answers for it, only those of its container.
    let together = sub_api.scope_settings(logging, &sub, None).await.unwrap();
    assert_eq!(
        together.units,
        vec![(
            "wordpress/0".to_string(),
            Some(
                sub_api
                    .relation_settings(logging, "wordpress/0")
                    .await
                    .unwrap()
            )
        )]
    );
    assert_unauthorized(
        "settings of another container",
        sub_api.relation_settings(logging, &other_sub).await,
    );
    assert_unauthorized(
        "settings of another container",
        sub_api.relation_settings(logging, "wordpress/1").await,
    );

    let before = w.store.head_revision().unwrap();
    let m3 = w.machine_of("mysql/0");
    try_everything_out_of_scope(&api, m3, "wordpress/1", db).await;
    try_everything_out_of_scope(&api, m3, "mysql/0", logging).await;
    try_everything_out_of_scope(&sub_api, m2, &other_sub, logging).await;
    assert_unauthorized(
        "another service's settings",
        api.service_config("mysql").await,
    );
    assert_unauthorized("its machine", api.machine(m1).await);
    assert_unauthorized(
        "a credential for a unit it does not deploy",
        api.new_unit_credential("wordpress/1").await,
    );
    assert_eq!(
        w.store.head_revision().unwrap(),
        before,
        "a refusal changed something"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_or_wrong_credentials_are_refused_alike() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let good = w.machine_conf(m1);
    let cases = [
        ("wrong secret", w.conf(Tag::Machine(m1), new_secret())),
        ("no secret", w.conf(Tag::Machine(m1), String::new())),
        (
            "the hash as the secret",
            w.conf(Tag::Machine(m1), secret_hash(&good.secret)),
        ),
        (
            "another machine's tag",
            w.conf(Tag::Machine(w.machine_of("mysql/0")), good.secret.clone()),
        ),
        (
            "a machine that does not exist",
            w.conf(Tag::Machine(99), good.secret.clone()),
        ),
        (
            "a unit without a credential",
            w.conf(Tag::unit("wordpress/0"), good.secret.clone()),
        ),
    ];
    for (what, conf) in cases {
        let remote = w.remote(&conf);
        let e = remote.machine(m1).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::Unauthenticated, "{what}: {e:?}");
        assert!(remote.credential_refused(), "{what}");
        assert!(
            !e.message.contains(&good.secret),
            "{what}: the secret leaked: {e}"
        );
        assert!(e.message.contains("invalid credentials"), "{what}: {e}");
    }
    let good = w.remote(&good);
    good.machine(m1).await.unwrap();
    assert!(!good.credential_refused());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_trust_exactly_their_environments_ca() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let good = w.machine_conf(m1);
    // Another environment's CA: its server certificate is not ours.
    let other = tempfile::tempdir().unwrap();
    tls::ensure(other.path(), OTHER_UUID).unwrap();
    let mut wrong_ca = good.clone();
    wrong_ca.ca_cert = tls::ca_cert(other.path()).unwrap();
    let e = w.remote(&wrong_ca).machine(m1).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
    assert!(e.message.contains("TLS handshake"), "{e}");
    // A server presenting another environment's certificate is refused
    // by an agent of ours.
    let other_store = Store::open_with(other.path().join("state.db"), Durability::Relaxed).unwrap();
    other_store
        .initialize(&EnvironmentSpec {
            name: "other".into(),
            uuid: OTHER_UUID.into(),
            provider: "dummy".into(),
            default_series: "jammy".into(),
            constraints: Constraints::default(),
            config: Default::default(),
        })
        .unwrap();
    let other_server = ApiServer::start(
        other.path(),
        other_store.clone(),
        Arc::new(Facades::new(other_store).unwrap()),
        Some("127.0.0.1:0"),
        None,
        Limits::default(),
        None,
    )
    .await
    .unwrap();
    let mut wrong_server = good.clone();
    wrong_server.api_addresses = other_server.addresses();
    let e = w.remote(&wrong_server).machine(m1).await.unwrap_err();
    assert!(e.message.contains("TLS handshake"), "{e}");
    // Over both transports, the right CA works.
    for addr in w.server.as_ref().unwrap().addresses() {
        let mut conf = good.clone();
        conf.api_addresses = vec![addr.clone()];
        w.remote(&conf)
            .machine(m1)
            .await
            .unwrap_or_else(|e| panic!("{addr}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_units_credential_stops_working() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let machine = w.remote(&w.machine_conf(m1));
    let secret = machine.new_unit_credential("wordpress/0").await.unwrap();
    let conf = w.conf(Tag::unit("wordpress/0"), secret);
    let unit = w.remote(&conf);
    unit.unit("wordpress/0").await.unwrap();
    // No agent has started for it, so destroying it removes it at once.
    w.store.destroy_units(&["wordpress/0".to_string()]).unwrap();
    assert!(w.store.unit("wordpress/0").is_err());
    assert_eq!(w.store.agent_credential("unit-wordpress-0").unwrap(), None);
    // On the connection it logged in on, everything is refused: the facade
    // finds no such unit.
    let e = unit.unit("wordpress/0").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
    // A new connection cannot log in at all.
    let e = w.remote(&conf).unit("wordpress/0").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e:?}");
    assert!(e.message.contains("invalid credentials"), "{e}");
}

async fn next(n: &mut jujube_agent::api::NoticeStream) -> jujube_agent::api::Notice {
    use futures_util::StreamExt;
    tokio::time::timeout(Duration::from_secs(20), n.next())
        .await
        .expect("a notice in time")
        .expect("the stream goes on")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_notices_changes_and_resumes_across_a_server_restart() {
    let mut w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let api = w.remote(&conf);
    let mut notices = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    // A unit assigned to the machine is something its agent sees.
    w.store.add_units("wordpress", 1, Some(m1)).unwrap();
    let first = next(&mut notices).await;
    assert!(first.revision > 0);

    // The server goes away; a change happens while it is down; a new
    // server comes up on the same socket: the watch resumes by itself and
    // announces what was missed.
    w.server = None;
    let head = w.store.head_revision().unwrap();
    w.store.add_units("wordpress", 1, Some(m1)).unwrap();
    assert!(w.store.head_revision().unwrap() > head);
    w.start(Limits::default()).await;
    let missed = next(&mut notices).await;
    assert!(
        missed.revision > first.revision,
        "{missed:?} after {first:?}"
    );
    assert_eq!(api.machine(m1).await.unwrap().units.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_per_connection_and_request_sizes_are_bounded() {
    let mut w = World::new().await;
    w.start(Limits {
        max_watches_per_connection: 2,
        max_request_bytes: 4096,
        ..Limits::default()
    })
    .await;
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&w.machine_conf(m1));
    let a = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    let _b = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    let e = api
        .watch(WatchTarget::Machine(m1))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.message
            .contains("too many watches on one connection (at most 2)"),
        "{e}"
    );
    // A watch given up frees its place.
    drop(a);
    let mut again = None;
    for _ in 0..100 {
        match api.watch(WatchTarget::Machine(m1)).await {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(again.is_some(), "a dropped watch never freed its place");

    let big = "x".repeat(8192);
    let e = api
        .update_relation_settings(relation(&w, "mysql"), "wordpress/0", vec![(big, None)])
        .await
        .unwrap_err();
    assert!(e.message.contains("request larger than 4096 bytes"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_and_the_client_reconnects() {
    let mut w = World::new().await;
    w.start(Limits {
        idle_timeout: Duration::from_millis(200),
        ..Limits::default()
    })
    .await;
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&w.machine_conf(m1));
    api.machine(m1).await.unwrap();
    // Count the server's connections through the OS: ours closes once idle.
    let port = w.server.as_ref().unwrap().tcp_addr().unwrap().port();
    let established = || {
        std::fs::read_to_string("/proc/net/tcp")
            .unwrap()
            .lines()
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].ends_with(&format!(":{port:04X}")) && f[3] == "01"
            })
            .count()
    };
    // The client dials the unix socket first; use TCP only for this test.
    let mut conf = w.machine_conf(m1);
    conf.api_addresses.retain(|a| !a.starts_with("unix:"));
    let api = w.remote(&conf);
    api.machine(m1).await.unwrap();
    assert_eq!(established(), 1);
    let mut closed = false;
    for _ in 0..200 {
        if established() == 0 {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(closed, "the idle connection stayed open");
    api.machine(m1).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_deployer_gives_its_units_credentials_that_survive_a_restart() {
    use jujube_agent::api::Connector;
    use jujube_agent::remote::RemoteConnector;
    use std::os::unix::fs::PermissionsExt;
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let machine = Arc::new(w.remote(&w.machine_conf(m1)));
    let dir = w.dir.path().join("machine-dir");
    std::fs::create_dir_all(&dir).unwrap();
    let connector = RemoteConnector::new(machine.clone(), dir.clone());
    let unit = connector.connect(&Tag::unit("wordpress/0"));
    assert_eq!(unit.unit("wordpress/0").await.unwrap().name, "wordpress/0");
    let path = dir.join("unit-wordpress-0.conf");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "agent.conf readable by others: {mode:o}");
    let hash = w
        .store
        .agent_credential("unit-wordpress-0")
        .unwrap()
        .unwrap();
    // A restarted deployer's agent logs in with the kept credential.
    let again =
        RemoteConnector::new(machine.clone(), dir.clone()).connect(&Tag::unit("wordpress/0"));
    again.unit("wordpress/0").await.unwrap();
    assert_eq!(
        w.store
            .agent_credential("unit-wordpress-0")
            .unwrap()
            .unwrap(),
        hash
    );
    // A unit not on the deployer's machine gets no credential, and its
    // agent nothing.
    let stranger = connector.connect(&Tag::unit("mysql/0"));
    let e = stranger.unit("mysql/0").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
    assert!(!dir.join("unit-mysql-0.conf").exists());
}

/// Shutting a server down returns once every connection it held is closed,
/// ones still in their TLS handshake and ones carrying watches alike: nothing
/// the old server says can reach a client after it (a handshake is not left
/// to run out its timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_shut_down_has_closed_every_connection() {
    use tokio::io::AsyncReadExt;
    let mut w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    // Connected, and silent: the server waits for its ClientHello.
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let api = w.remote(&w.machine_conf(m1));
    let _notices = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), w.server.take().unwrap().shutdown())
        .await
        .expect("shut down without waiting out a handshake");
    let mut b = [0u8; 1];
    match tokio::time::timeout(Duration::from_millis(500), raw.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => {}
        other => panic!("the silent connection is still open: {other:?}"),
    }
}

/// A change made after a watch was opened but before any notice reached the
/// client, with the server gone meanwhile: the resumed watch still tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_before_its_first_notice_misses_nothing() {
    let mut w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&w.machine_conf(m1));
    let mut notices = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    w.server.take().unwrap().shutdown().await;
    w.store.add_units("wordpress", 1, Some(m1)).unwrap();
    w.start(Limits::default()).await;
    let n = next(&mut notices).await;
    assert!(!n.resync);
    assert_eq!(api.machine(m1).await.unwrap().units.len(), 2);
}

/// A watch resumed after the feed was pruned past its revision is told to
/// resync (re-read everything), not given a partial picture.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_past_the_pruned_feed_is_told_to_resync() {
    let mut w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&w.machine_conf(m1));
    let mut notices = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    w.server.take().unwrap().shutdown().await;
    // Changes while the server is down, then the feed pruned to the last
    // one: the revision the client holds is gone.
    w.store.add_units("wordpress", 1, Some(m1)).unwrap();
    w.store.add_units("mysql", 1, None).unwrap();
    w.store.prune_changes(1, 10_000).unwrap();
    w.start(Limits::default()).await;
    let n = next(&mut notices).await;
    assert!(n.resync, "{n:?}");
    assert_eq!(api.machine(m1).await.unwrap().units.len(), 2);
}

/// A slow reader: a watch nobody reads while thousands of changes happen
/// holds one pending notice, and the next read gets the latest revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_nobody_reads_holds_one_notice_not_a_backlog() {
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&w.machine_conf(m1));
    let mut notices = api.watch(WatchTarget::Machine(m1)).await.unwrap();
    for _ in 0..250 {
        // Each a change its agent sees: a unit assigned to its machine
        // (250 of the 256 a machine hosts).
        w.store.add_units("wordpress", 1, Some(m1)).unwrap();
    }
    let head = w.store.head_revision().unwrap();
    // Coalesced: a handful of notices at most (those already on the wire
    // when the writes went on, and the one pending), the last at the head;
    // never 250.
    let mut seen = vec![next(&mut notices).await];
    while let Ok(Some(n)) = tokio::time::timeout(
        Duration::from_millis(300),
        futures_util::StreamExt::next(&mut notices),
    )
    .await
    {
        seen.push(n);
    }
    assert!(seen.len() <= 8, "{} notices for 250 changes", seen.len());
    assert_eq!(seen.last().unwrap().revision, head);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_machines_credential_stops_working() {
    use jujube_state::{AgentOp, Caller};
    let w = World::new().await;
    // A machine never provisioned: the controller may take it to Dead and
    // remove it.
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    let conf = w.machine_conf(id);
    w.remote(&conf).machine(id).await.unwrap();
    w.store.destroy_machines(&[id]).unwrap();
    w.store
        .apply(
            &Caller::Controller,
            &AgentOp::EnsureDeadMachine { machine: id },
        )
        .unwrap();
    w.store
        .apply(&Caller::Controller, &AgentOp::RemoveMachine { machine: id })
        .unwrap();
    assert_eq!(
        w.store.agent_credential(&format!("machine-{id}")).unwrap(),
        None
    );
    let e = w.remote(&conf).machine(id).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e:?}");
    assert!(e.message.contains("invalid credentials"), "{e}");
}

fn tcp_only(mut conf: AgentConf) -> AgentConf {
    conf.api_addresses.retain(|a| !a.starts_with("unix:"));
    assert_eq!(conf.api_addresses.len(), 1);
    conf
}

fn unix_only(mut conf: AgentConf) -> AgentConf {
    conf.api_addresses.retain(|a| a.starts_with("unix:"));
    assert_eq!(conf.api_addresses.len(), 1);
    conf
}

/// The server's side of its TCP port, as the kernel sees it: connections
/// established (accepted or not), and connections waiting in the listening
/// socket's accept queue (its `rx_queue` in `/proc/net/tcp`).
fn tcp_port_state(port: u16) -> (usize, usize) {
    let (mut established, mut queued) = (0, 0);
    for l in std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
    {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 5 || !f[1].ends_with(&format!(":{port:04X}")) {
            continue;
        }
        match f[3] {
            "01" => established += 1,
            "0A" => {
                let rx = f[4].split(':').nth(1).unwrap();
                queued += usize::from_str_radix(rx, 16).unwrap();
            }
            _ => {}
        }
    }
    (established, queued)
}

/// Polls `cond` every 10 ms for up to `secs`; whether it came true.
async fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

/// Whether the server closed `s` (EOF or reset) rather than leaving it open
/// with nothing to read; never blocks.
fn closed_by_server(s: &std::net::TcpStream) -> bool {
    use std::io::Read;
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let closed = match (&*s).read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!("the server sent {n} bytes to a client that never said hello"),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    };
    s.set_nonblocking(false).unwrap();
    closed
}

/// How long until the server closes `s`, waiting at most 5 s (then `None`).
async fn time_until_closed(s: std::net::TcpStream, since: std::time::Instant) -> Option<Duration> {
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 64];
        match (&s).read(&mut buf) {
            Ok(0) => Some(since.elapsed()),
            Ok(n) => panic!("the server sent {n} bytes to a client that never said hello"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(_) => Some(since.elapsed()),
        }
    })
    .await
    .unwrap()
}

/// A TLS record header announcing a 512-byte handshake message, and the
/// first bytes of a ClientHello: a handshake begun and never finished.
const PARTIAL_CLIENT_HELLO: &[u8] = &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03];

/// A client that connects and never finishes its TLS handshake (silent, or
/// stalled in its ClientHello) is cut off at the handshake timeout — not
/// before, not at the idle timeout — while an agent connecting meanwhile is
/// served at once, and afterwards too.
///
/// Real time, not tokio's paused clock: with real sockets the paused clock
/// auto-advances to the next timer whenever the runtime waits for the
/// kernel (tokio counts an I/O wake-up as idle), so the agent's own TLS
/// round trips would jump the clock past its handshake deadline. Bounded
/// instead: 500 ms of timeout, 5 s at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_tls_handshake_is_cut_off_in_time() {
    use std::io::Write;
    let timeout = Duration::from_millis(500);
    let mut w = World::new().await;
    w.start(Limits {
        handshake_timeout: timeout,
        ..Limits::default()
    })
    .await;
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let m1 = w.machine_of("wordpress/0");
    let conf = tcp_only(w.machine_conf(m1));

    let start = std::time::Instant::now();
    let silent = std::net::TcpStream::connect(addr).unwrap();
    let mut stalled = std::net::TcpStream::connect(addr).unwrap();
    stalled.write_all(PARTIAL_CLIENT_HELLO).unwrap();
    // Meanwhile an agent connects over the same listener and is served:
    // the stalled handshakes hold up nobody.
    w.remote(&conf).machine(m1).await.unwrap();
    assert!(
        !closed_by_server(&silent) && !closed_by_server(&stalled),
        "the agent was served only after the stalled handshakes were given up ({:?})",
        start.elapsed()
    );

    for (what, s) in [("silent", silent), ("stalled", stalled)] {
        let took = time_until_closed(s, start)
            .await
            .unwrap_or_else(|| panic!("a {what} client still connected after 5 s"));
        assert!(
            took >= timeout,
            "a {what} client cut off after {took:?}, before the timeout"
        );
    }
    // And afterwards: a new connection, a new handshake, served.
    w.remote(&conf).machine(m1).await.unwrap();
}

/// The connection cap, as the server enforces it: a connection counts from
/// the moment it is taken, before its TLS handshake, across both
/// transports; beyond the cap the server leaves connections in the kernel's
/// accept queue (it does not take them all and hold them itself), and a
/// client waiting there is served as soon as a connection closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let mut w = World::new().await;
    w.start(Limits {
        max_connections: 2,
        // Held connections keep their slot for the whole test.
        handshake_timeout: Duration::from_secs(60),
        ..Limits::default()
    })
    .await;
    let port = w.server.as_ref().unwrap().tcp_addr().unwrap().port();
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);

    // Two connections that never handshake: both taken, up to the cap.
    let held1 = std::net::TcpStream::connect(addr).unwrap();
    let held2 = std::net::TcpStream::connect(addr).unwrap();
    assert!(
        eventually(5, || tcp_port_state(port) == (2, 0)).await,
        "the server did not take two connections with a cap of 2: {:?} (established, queued)",
        tcp_port_state(port)
    );

    // A third client over TCP and a fourth over the unix socket: neither is
    // served. Each keeps its Remote (and so its connection) once answered.
    let call = |conf: AgentConf| {
        let api = w.remote(&conf);
        tokio::spawn(async move {
            let r = api.machine(m1).await;
            (api, r)
        })
    };
    let mut tcp = Some(call(tcp_only(conf.clone())));
    assert!(eventually(5, || tcp_port_state(port).0 == 3).await);
    // A fifth, raw: at least one of the two TCP clients beyond the cap stays
    // in the accept queue.
    let _held3 = std::net::TcpStream::connect(addr).unwrap();
    let mut unix = Some(call(unix_only(conf.clone())));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !tcp.as_ref().unwrap().is_finished() && !unix.as_ref().unwrap().is_finished(),
        "a client was served beyond the cap"
    );
    let (established, queued) = tcp_port_state(port);
    assert_eq!(established, 4);
    assert!(
        queued >= 1,
        "the server took every connection beyond the cap"
    );

    // One held connection closes: one waiting client is served, and the
    // other still waits (its slot went to the one served, which stays).
    drop(held1);
    assert!(
        eventually(5, || tcp.as_ref().unwrap().is_finished()
            || unix.as_ref().unwrap().is_finished())
        .await,
        "no waiting client served after a connection closed"
    );
    let (first, mut second) = if tcp.as_ref().unwrap().is_finished() {
        (tcp.take().unwrap(), unix.take().unwrap())
    } else {
        (unix.take().unwrap(), tcp.take().unwrap())
    };
    let (_api1, r) = first.await.unwrap();
    r.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "two clients served for one slot freed"
    );
    drop(held2);
    let (_api2, r) = tokio::time::timeout(Duration::from_secs(5), &mut second)
        .await
        .expect("the last waiting client served once a second slot freed")
        .unwrap();
    r.unwrap();
}

/// A connection that never finishes its handshake holds its slot only
/// until the handshake timeout: with a cap of one, an agent waiting behind
/// it is served then, without the stalled client going away by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_gives_its_slot_back_at_the_timeout() {
    let timeout = Duration::from_millis(300);
    let mut w = World::new().await;
    w.start(Limits {
        max_connections: 1,
        handshake_timeout: timeout,
        ..Limits::default()
    })
    .await;
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let m1 = w.machine_of("wordpress/0");
    let api = w.remote(&tcp_only(w.machine_conf(m1)));
    let start = std::time::Instant::now();
    let stalled = std::net::TcpStream::connect(addr).unwrap();
    tokio::time::timeout(Duration::from_secs(5), api.machine(m1))
        .await
        .expect("an agent behind a stalled handshake never served")
        .unwrap();
    assert!(
        start.elapsed() >= timeout,
        "served after {:?}, beyond the cap of one",
        start.elapsed()
    );
    assert!(closed_by_server(&stalled));
}

/// A slow reader at the transport: a watch opened over raw HTTP/2 (not
/// through `Remote`, which keeps only the latest notice by itself, so that
/// tests through it cannot tell what the server sent) with a 256-byte
/// flow-control window, its body left unread while 100 changes happen, each
/// its own notice (spaced so that the change router does not batch them).
/// The server sends what the window allows and then holds one coalesced
/// notice, not a backlog: reading afterwards yields about a window's worth
/// (18 seen; at most 25 allowed), ending at the head. With a 1 MiB window
/// the same run yields 100: the bound is the window's, not the router's
/// batching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_body_left_unread_costs_the_server_a_window_not_a_backlog() {
    use http_body_util::{BodyExt, Full};
    use jujube_agent::wire::{WatchRequest, SERVER_NAME, TAG_HEADER, WATCH_PATH};
    const WINDOW: u32 = 256;
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);

    let mut sender = h2(&w, &conf, WINDOW).await;
    let req = WatchRequest {
        target: WatchTarget::Machine(m1),
        since: 0,
    };
    let resp = sender
        .send_request(
            hyper::Request::post(format!("https://{SERVER_NAME}{WATCH_PATH}"))
                .header(TAG_HEADER, conf.tag.to_string())
                .header(
                    hyper::header::AUTHORIZATION,
                    format!("Bearer {}", conf.secret),
                )
                .body(Full::new(bytes::Bytes::from(
                    serde_json::to_vec(&req).unwrap(),
                )))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    let mut body = resp.into_body();

    for _ in 0..100 {
        w.store.add_units("wordpress", 1, Some(m1)).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let head = w.store.head_revision().unwrap();
    // Let the server send all it will while nobody reads.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut text = Vec::new();
    let mut wait = Duration::from_secs(5);
    while let Ok(Some(frame)) = tokio::time::timeout(wait, body.frame()).await {
        if let Ok(data) = frame.unwrap().into_data() {
            text.extend_from_slice(&data);
        }
        // Once something came, stop when nothing more does.
        wait = Duration::from_millis(300);
    }
    let notices: Vec<jujube_agent::api::Notice> = text
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    // A window's worth (the shortest line, `{"revision":1}\n`, is 15
    // bytes), a line split at the window's edge, the coalesced latest, and
    // slack for window updates in flight: far from 100.
    let bound = WINDOW as usize / 15 + 8;
    assert!(
        !notices.is_empty() && notices.len() <= bound,
        "{} notices for 100 changes with a {WINDOW}-byte window (at most {bound})",
        notices.len()
    );
    assert_eq!(notices.last().unwrap().revision, head);
}

/// A bare HTTP/2 connection to the server over TCP and TLS, trusting the
/// environment's CA, with `window` bytes of flow-control window per stream.
async fn h2(
    w: &World,
    conf: &AgentConf,
    window: u32,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>> {
    try_h2(w, conf, window).await.unwrap()
}

/// [`h2`], or why the connection could not be made.
async fn try_h2(
    w: &World,
    conf: &AgentConf,
    window: u32,
) -> std::io::Result<hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>> {
    let (sender, conn) = h2_parts(w, conf, window).await?;
    tokio::spawn(conn);
    Ok(sender)
}

type H2Conn = hyper::client::conn::http2::Connection<
    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    http_body_util::Full<bytes::Bytes>,
    hyper_util::rt::TokioExecutor,
>;

/// A client HTTP/2 connection's sender, and the connection that must be
/// polled for anything to move.
type H2Parts = (
    hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    H2Conn,
);

/// A client HTTP/2 connection over TCP and TLS: the sender, and the
/// connection that must be polled for anything to move.
async fn h2_parts(w: &World, conf: &AgentConf, window: u32) -> std::io::Result<H2Parts> {
    h2_parts_at(w.server.as_ref().unwrap().tcp_addr().unwrap(), conf, window).await
}

/// [`h2_parts`] to `addr`.
async fn h2_parts_at(
    addr: std::net::SocketAddr,
    conf: &AgentConf,
    window: u32,
) -> std::io::Result<H2Parts> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let tls = try_tls_to(addr, conf, b"h2").await?;
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(window)
        // Room on the connection for every stream's window: a stream left
        // unread must not starve the others.
        .initial_connection_window_size(16 << 20)
        .handshake(TokioIo::new(tls))
        .await
        .map_err(std::io::Error::other)?;
    Ok((sender, conn))
}

/// A call as an agent sends it, with `conf`'s credential.
fn call_request(
    conf: &AgentConf,
    call: &jujube_agent::wire::Call,
) -> hyper::Request<http_body_util::Full<bytes::Bytes>> {
    use jujube_agent::wire::{CALL_PATH, SERVER_NAME, TAG_HEADER};
    hyper::Request::post(format!("https://{SERVER_NAME}{CALL_PATH}"))
        .header(TAG_HEADER, conf.tag.to_string())
        .header(
            hyper::header::AUTHORIZATION,
            format!("Bearer {}", conf.secret),
        )
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(call).unwrap(),
        )))
        .unwrap()
}

/// This process's resident memory, bytes.
/// Held by the tests that measure the process's memory, and by those that
/// allocate much of it (argon2 takes 7 MiB a password check), so that
/// neither runs beside the other.
static MEMORY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tools_download_is_streamed_from_disk_not_read_whole() {
    let _alone = MEMORY.lock().await;
    use http_body_util::{BodyExt, Full};
    use jujube_agent::wire::{SERVER_NAME, TOOLS_PATH};
    let w = World::new().await;
    let binary = w.dir.path().join("jujube-binary");
    // 64 MiB (sparse: the disk holds none of it).
    std::fs::File::create(&binary)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    w.server.as_ref().unwrap().serve_tools(&binary).unwrap();
    let conf = w.machine_conf(w.machine_of("wordpress/0"));
    let mut sender = h2(&w, &conf, 1 << 16).await;
    let before = rss();
    // Sixteen downloads nobody reads.
    let mut bodies = Vec::new();
    for _ in 0..16 {
        let resp = sender
            .send_request(
                hyper::Request::get(format!("https://{SERVER_NAME}{TOOLS_PATH}"))
                    .body(Full::new(bytes::Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), hyper::StatusCode::OK);
        assert_eq!(
            resp.headers()[hyper::header::CONTENT_LENGTH],
            (64u64 << 20).to_string().as_str()
        );
        bodies.push(resp.into_body());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 256 << 20,
        "16 unread 64 MiB downloads grew the process by {} MiB",
        grown >> 20
    );
    // A download read to its end is the whole binary.
    let mut n = 0usize;
    let mut body = bodies.pop().unwrap();
    while let Some(frame) = body.frame().await {
        n += frame.unwrap().into_data().map(|d| d.len()).unwrap_or(0);
    }
    assert_eq!(n, 64 << 20);
}

/// An answer larger than a request counts whole against its connection's
/// unread answers: while one is unread, a call whose answer would not fit
/// beside it waits (it was counted as a request's size, so many such
/// answers could be held unread, each counted at a fraction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_a_request_counts_whole_against_the_unread_budget() {
    use http_body_util::BodyExt;
    use jujube_agent::wire::Call;
    let mut w = World::new().await;
    w.start(Limits {
        max_request_bytes: 16 << 10,
        max_unread_bytes_per_connection: 96 << 10,
        ..Limits::default()
    })
    .await;
    let unit = "wordpress/0";
    // The unit's view carries a queued command of 60 KiB.
    w.store
        .queue_run(unit, &["echo".into(), "a".repeat(60 << 10)], 60)
        .unwrap();
    let machine = w.remote(&w.machine_conf(w.machine_of(unit)));
    let secret = machine.new_unit_credential(unit).await.unwrap();
    let conf = tcp_only(w.conf(Tag::unit(unit), secret));
    // A window of 1 KiB: what the client does not read stays with the server.
    let mut sender = h2(&w, &conf, 1 << 10).await;
    let call = Call::Unit { name: unit.into() };
    let first = sender
        .send_request(call_request(&conf, &call))
        .await
        .unwrap();
    assert_eq!(first.status(), hyper::StatusCode::OK);
    let second = tokio::spawn(sender.send_request(call_request(&conf, &call)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !second.is_finished(),
        "a second 60 KiB answer was made beside an unread one within 96 KiB"
    );
    let n = first.into_body().collect().await.unwrap().to_bytes().len();
    assert!(n > 60 << 10, "{n}");
    let second = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("answered once the first was read")
        .unwrap()
        .unwrap();
    assert_eq!(second.status(), hyper::StatusCode::OK);
    let n = second.into_body().collect().await.unwrap().to_bytes().len();
    assert!(n > 60 << 10, "{n}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_charm_files_answers_are_bounded_per_connection() {
    let _alone = MEMORY.lock().await;
    use http_body_util::BodyExt;
    use jujube_agent::wire::Call;
    let w = World::new().await;
    // A charm with a 7.5 MiB file (random: nothing compresses it).
    let charm = w.dir.path().join("charms/wordpress");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let big: Vec<u8> = (0..7_500_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(charm.join("blob"), &big).unwrap();
    drop(big);
    let unit = "wordpress/0";
    let conf = w.machine_conf(w.machine_of(unit));
    let mut sender = h2(&w, &conf, 1 << 16).await;
    let call = Call::CharmFiles { unit: unit.into() };
    let before = rss();
    // Thirty calls, none of whose answers is read: the server may hold a
    // bounded number of answers per connection, never thirty.
    let mut pending = Vec::new();
    for _ in 0..30 {
        pending.push(tokio::spawn(
            sender.send_request(call_request(&conf, &call)),
        ));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = rss().saturating_sub(before);
    // Streamed from disk: a chunk or two per answer, not the answer.
    assert!(
        grown < 96 << 20,
        "30 unread 10 MiB answers on one connection grew the process by {} MiB",
        grown >> 20
    );
    // Read them all (each as it comes, as an agent does): every one is
    // answered in full as room frees up.
    let readers: Vec<_> = pending
        .into_iter()
        .map(|p| {
            tokio::spawn(async move {
                let resp = p.await.unwrap().unwrap();
                assert_eq!(resp.status(), hyper::StatusCode::OK);
                resp.into_body().collect().await.unwrap().to_bytes().len()
            })
        })
        .collect();
    for r in readers {
        let n = r.await.unwrap();
        assert!(n > 10_000_000, "{n}");
    }
}

/// One peer address holds a bounded number of connections that proved no
/// credential (a flood of idle TLS connections from one host): beyond it a
/// connection is closed at once, while an agent's connection, once it
/// proves its credential, no longer counts; one that never does is closed
/// at the (short) unauthenticated timeout, not the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_connections_are_capped_per_peer_and_closed_soon() {
    let mut w = World::new().await;
    w.start(Limits {
        max_unauthenticated_per_peer: 3,
        unauthenticated_timeout: Duration::from_millis(700),
        ..Limits::default()
    })
    .await;
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let m1 = w.machine_of("wordpress/0");
    let conf = tcp_only(w.machine_conf(m1));
    // An agent proves its credential: it does not count against the peer.
    let agent = w.remote(&conf);
    agent.machine(m1).await.unwrap();
    let start = std::time::Instant::now();
    let idle: Vec<_> = (0..3)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    // Let the server take them.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let fourth = std::net::TcpStream::connect(addr).unwrap();
    let took = time_until_closed(fourth, start)
        .await
        .expect("the fourth is closed at once");
    assert!(took < Duration::from_millis(600), "closed after {took:?}");
    // The agent is still served (its connection is proven).
    agent.machine(m1).await.unwrap();
    drop(idle);
    // A TLS connection that never proves a credential goes at the
    // unauthenticated timeout (the idle timeout is 300 s). (The server
    // notices the three closed a moment later: until then a new one is
    // still one too many.)
    let mut silent = None;
    for _ in 0..100 {
        if let Ok(s) = try_h2(&w, &conf, 65_535).await {
            silent = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut silent = silent.expect("a connection once the idle ones closed");
    let opened = std::time::Instant::now();
    assert!(
        eventually(5, || silent.is_closed()).await,
        "still open after 5 s"
    );
    let took = opened.elapsed();
    assert!(took >= Duration::from_millis(600), "closed after {took:?}");
    let _ = silent.ready().await;
}

/// A connection that proves no credential is closed at its deadline,
/// counted from when it opened, whatever it sends meanwhile: requests that
/// need no credential (a 404 every 200 ms here) do not keep it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unproven_connection_is_closed_at_its_deadline_whatever_it_sends() {
    use http_body_util::Full;
    let (w, conf) = unproven_after_700ms().await;
    let mut sender = h2(&w, &conf, 65_535).await;
    let opened = std::time::Instant::now();
    let mut answered = 0;
    while opened.elapsed() < Duration::from_secs(5) {
        let req = hyper::Request::get(format!(
            "https://{}/v1/nope",
            jujube_agent::wire::SERVER_NAME
        ))
        .body(Full::new(bytes::Bytes::new()))
        .unwrap();
        match sender.send_request(req).await {
            Ok(r) => {
                assert_eq!(r.status(), hyper::StatusCode::NOT_FOUND);
                answered += 1;
            }
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = opened.elapsed();
    assert!(answered >= 2, "answered {answered}");
    assert!(
        took < Duration::from_secs(3),
        "an unproven connection sending requests was still open after {took:?}"
    );
}

/// A request that proves no credential and trickles its body (a byte every
/// 200 ms) does not hold its connection past the unproven deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_unproven_request_does_not_hold_its_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (w, conf) = unproven_after_700ms().await;
    let addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let mut tls = tls_to(addr, &conf, b"http/1.1").await;
    let opened = std::time::Instant::now();
    tls.write_all(
        format!(
            "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-length: 100000\r\n\r\n",
            jujube_agent::wire::ENROLL_PATH,
            jujube_agent::wire::SERVER_NAME
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // The trickle is written from a second handle: a TLS stream is split.
    let (mut rd, mut wr) = tokio::io::split(tls);
    let reading = async move {
        let mut buf = [0u8; 4096];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let writing = async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if wr.write_all(b"x").await.is_err() || wr.flush().await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = reading => {}
        () = writing => {}
        () = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
    let took = opened.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "a trickled unproven request held its connection for {took:?}"
    );
}

/// An enrollment's body is bounded ([`crate::server::MAX_ENROLL_BYTES`]):
/// larger is refused, the enroller never asked; a controller that enrolls
/// nothing refuses before reading any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrollment_is_bounded_and_read_only_where_one_is_taken() {
    use http_body_util::{BodyExt, Full};
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counting(AtomicUsize);
    #[async_trait::async_trait]
    impl crate::server::Enroller for Counting {
        async fn enroll(
            &self,
            _: &str,
            _: &crate::server::Identity,
        ) -> Result<Vec<u8>, jujube_agent::api::ApiError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Err(jujube_agent::api::ApiError::new(
                ErrorCode::Unauthorized,
                "refused",
            ))
        }
    }
    let mut w = World::new().await;
    w.start(Limits::default()).await;
    let conf = tcp_only(w.machine_conf(w.machine_of("wordpress/0")));
    let post = |body: Vec<u8>| {
        hyper::Request::post(format!(
            "https://{}{}",
            jujube_agent::wire::SERVER_NAME,
            jujube_agent::wire::ENROLL_PATH
        ))
        .body(Full::new(bytes::Bytes::from(body)))
        .unwrap()
    };
    let text = |r: hyper::Response<hyper::body::Incoming>| async move {
        let status = r.status();
        let b = r.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&b).into_owned())
    };
    let request = |token: &str, document: usize| {
        serde_json::to_vec(&serde_json::json!({
            "token": token,
            "identity-document": "A".repeat(document),
            "identity-signature": "sig",
        }))
        .unwrap()
    };
    let mut sender = h2(&w, &conf, 65_535).await;
    let (status, body) = text(sender.send_request(post(request("t", 64))).await.unwrap()).await;
    assert_eq!(status, hyper::StatusCode::CONFLICT, "{body}");
    assert!(
        body.contains("this controller enrolls no instances"),
        "{body}"
    );

    let counting = Arc::new(Counting(AtomicUsize::new(0)));
    w.server.as_ref().unwrap().enroll_with(counting.clone());
    // The largest a real instance sends is taken to the enroller.
    let (status, body) = text(sender.send_request(post(request("t", 5464))).await.unwrap()).await;
    assert_eq!(status, hyper::StatusCode::FORBIDDEN, "{body}");
    assert_eq!(counting.0.load(Ordering::SeqCst), 1);
    // Past the bound: refused, the enroller not asked.
    let big = request("t", crate::server::MAX_ENROLL_BYTES);
    let (status, body) = text(sender.send_request(post(big)).await.unwrap()).await;
    assert_eq!(status, hyper::StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert!(
        body.contains("an enrollment is at most 8192 bytes"),
        "{body}"
    );
    assert_eq!(counting.0.load(Ordering::SeqCst), 1);
}

/// The World of the unproven-deadline tests: a server closing connections
/// that prove nothing within 700 ms, and an agent's conf for its TCP port.
async fn unproven_after_700ms() -> (World, AgentConf) {
    let mut w = World::new().await;
    w.start(Limits {
        unauthenticated_timeout: Duration::from_millis(700),
        ..Limits::default()
    })
    .await;
    let conf = tcp_only(w.machine_conf(w.machine_of("wordpress/0")));
    (w, conf)
}

/// A TLS connection to the API server at `addr`, offering `alpn`.
async fn tls_to(
    addr: std::net::SocketAddr,
    conf: &AgentConf,
    alpn: &[u8],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    try_tls_to(addr, conf, alpn).await.unwrap()
}

/// [`tls_to`], or why the connection could not be made.
async fn try_tls_to(
    addr: std::net::SocketAddr,
    conf: &AgentConf,
    alpn: &[u8],
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use jujube_agent::wire::SERVER_NAME;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(conf.ca_cert.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(SERVER_NAME).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(name, tcp)
        .await
}

/// One credential holds a bounded number of connections: a call on one
/// more is refused with 429, and served once one of the others closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_holds_a_bounded_number_of_connections() {
    use http_body_util::{BodyExt, Full};
    use jujube_agent::wire::Call;
    let mut w = World::new().await;
    w.start(Limits {
        max_connections_per_credential: 2,
        ..Limits::default()
    })
    .await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let call = Call::Machine { id: m1 };
    let send = |sender: &mut hyper::client::conn::http2::SendRequest<Full<bytes::Bytes>>| {
        sender.send_request(call_request(&conf, &call))
    };
    let mut a = h2(&w, &conf, 65_535).await;
    let mut b = h2(&w, &conf, 65_535).await;
    let mut c = h2(&w, &conf, 65_535).await;
    assert_eq!(send(&mut a).await.unwrap().status(), hyper::StatusCode::OK);
    assert_eq!(send(&mut b).await.unwrap().status(), hyper::StatusCode::OK);
    let refused = send(&mut c).await.unwrap();
    assert_eq!(refused.status(), hyper::StatusCode::TOO_MANY_REQUESTS);
    let text = refused.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains("holds 2 connections already, the most one credential may"),
        "{text}"
    );
    // The first connection still works; once it closes, the third is served.
    assert_eq!(send(&mut a).await.unwrap().status(), hyper::StatusCode::OK);
    drop(a);
    let mut served = false;
    for _ in 0..100 {
        if send(&mut c).await.unwrap().status() == hyper::StatusCode::OK {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        served,
        "the third connection was not served after the first closed"
    );
}

/// A credential replaced (a new start attempt, an enrollment) stops working
/// on a connection that logged in with it: the next call is refused and
/// the connection closed, watches included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_credential_stops_working_on_its_open_connection() {
    use http_body_util::Full;
    use jujube_agent::wire::Call;
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let status = Call::SetMachineStatus {
        id: m1,
        status: AgentStatus::Started,
        info: String::new(),
    };
    let send = |sender: &mut hyper::client::conn::http2::SendRequest<Full<bytes::Bytes>>| {
        sender.send_request(call_request(&conf, &status))
    };
    let mut old = h2(&w, &conf, 65_535).await;
    assert_eq!(
        send(&mut old).await.unwrap().status(),
        hyper::StatusCode::OK
    );
    // A new start attempt replaces the machine's credential.
    let _new = w.machine_conf(m1);
    let before = w.store.head_revision().unwrap();
    let refused = send(&mut old).await.unwrap();
    assert_eq!(refused.status(), hyper::StatusCode::UNAUTHORIZED);
    assert_eq!(
        w.store.head_revision().unwrap(),
        before,
        "the old credential wrote"
    );
    assert!(
        eventually(5, || old.is_closed()).await,
        "the connection stayed open"
    );
    // Status says that the machine's agent is refused, and since when...
    let refused_since = |w: &World| {
        w.store
            .status()
            .unwrap()
            .machines
            .get(&m1.to_string())
            .unwrap()
            .credential_refused
            .clone()
    };
    assert!(
        eventually(5, || refused_since(&w).is_some()).await,
        "status shows the refused credential"
    );
    let since = refused_since(&w).unwrap();
    assert!(since.ends_with(" UTC"), "{since}");
    // ...until the agent logs in with its current credential.
    w.remote(&_new).machine(m1).await.unwrap();
    assert_eq!(refused_since(&w), None);
}

/// `charm-files` over the API, streamed from disk, is exactly what the
/// facade answers in process: every file, its mode, its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charm_files_over_the_api_are_the_charms_files() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new().await;
    let charm = w.dir.path().join("charms/wordpress");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(
        charm.join("hooks/install"),
        "#!/bin/sh\necho \"quoted\" \\ and more\n",
    )
    .unwrap();
    std::fs::set_permissions(
        charm.join("hooks/install"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(charm.join("empty"), "").unwrap();
    // Not a multiple of a chunk, nor of 3.
    let big: Vec<u8> = (0..200_001u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(charm.join("blob"), &big).unwrap();
    let unit = "wordpress/0";
    let remote = w.remote(&w.machine_conf(w.machine_of(unit)));
    let over_api = remote.charm_files(unit).await.unwrap();
    let in_process = w
        .facades
        .for_agent(Tag::Machine(w.machine_of(unit)))
        .charm_files(unit)
        .await
        .unwrap();
    assert_eq!(over_api, in_process);
    assert_eq!(
        over_api.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
        ["blob", "empty", "hooks/install"]
    );
    // Out of scope: refused alike.
    let other = w.remote(&w.machine_conf(w.machine_of("mysql/0")));
    let e = other.charm_files(unit).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
}

/// Presence: an agent holding a connection is noted as seen; one that
/// freezes (its socket open, its pings unanswered) loses its connection
/// and is seen no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_agent_loses_its_connection_and_its_presence() {
    use jujube_agent::wire::Call;
    let mut w = World::new().await;
    w.start(Limits {
        keepalive: Duration::from_millis(200),
        presence_every: Duration::from_millis(50),
        ..Limits::default()
    })
    .await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let tag = format!("machine-{m1}");
    assert_eq!(w.store.agent_seen_at(&tag).unwrap(), None);
    // The agent's connection goes through a relay that can freeze it, as
    // SIGSTOP freezes an agent: its socket stays open, nothing moves.
    let server_addr = w.server.as_ref().unwrap().tcp_addr().unwrap();
    let (relay_addr, freeze, upstream) = freezable_relay(server_addr).await;
    let (mut sender, conn) = h2_parts_at(relay_addr, &conf, 65_535).await.unwrap();
    tokio::spawn(conn);
    let call = Call::Machine { id: m1 };
    let resp = sender
        .send_request(call_request(&conf, &call))
        .await
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    assert!(
        eventually(5, || w.store.agent_seen_at(&tag).unwrap().is_some()).await,
        "a connected agent was not noted as seen"
    );
    // Idle but alive: pings answered, the connection stays.
    let port = w.server.as_ref().unwrap().tcp_addr().unwrap().port();
    let upstream = *upstream.get().expect("the relay connected");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        tcp_established_from(port, upstream),
        "a live agent's connection closed"
    );
    freeze.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        eventually(5, || !tcp_established_from(port, upstream)).await,
        "the frozen agent's connection stayed open"
    );
    // No longer seen: its last sighting stays where it was.
    let last = w.store.agent_seen_at(&tag).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(w.store.agent_seen_at(&tag).unwrap(), last);
}

/// What [`freezable_relay`] gives: where to connect, the flag that freezes
/// it, and (once it relays) the address its connection to the server comes
/// from.
type Relay = (
    std::net::SocketAddr,
    Arc<std::sync::atomic::AtomicBool>,
    Arc<std::sync::OnceLock<std::net::SocketAddr>>,
);

/// A TCP relay to `to` for one connection; once the flag is set it stops
/// moving bytes either way and holds both sockets open.
async fn freezable_relay(to: std::net::SocketAddr) -> Relay {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let frozen = Arc::new(AtomicBool::new(false));
    let f = frozen.clone();
    let upstream = Arc::new(std::sync::OnceLock::new());
    let from = upstream.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(to).await.unwrap();
        let _ = from.set(server.local_addr().unwrap());
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                    mut w: tokio::net::tcp::OwnedWriteHalf,
                    f: Arc<AtomicBool>| async move {
            let mut buf = vec![0u8; 16 << 10];
            loop {
                let n = match r.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if f.load(Ordering::SeqCst) {
                    // Frozen: hold both ends, move nothing.
                    let _held = (r, w);
                    std::future::pending::<()>().await;
                    return;
                }
                if w.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let up = tokio::spawn(pump(cr, sw, f.clone()));
        let down = tokio::spawn(pump(sr, cw, f));
        let _ = tokio::join!(up, down);
    });
    (addr, frozen, upstream)
}

/// Whether the server listening on `port` holds a connection from `peer`
/// (IPv4), as the kernel sees it: only that one, whatever else the machine
/// does with the port's number.
fn tcp_established_from(port: u16, peer: std::net::SocketAddr) -> bool {
    let std::net::IpAddr::V4(ip) = peer.ip() else {
        panic!("an IPv4 peer")
    };
    let remote = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(ip.octets()),
        peer.port()
    );
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .any(|f| {
            f.len() > 3 && f[1].ends_with(&format!(":{port:04X}")) && f[2] == remote && f[3] == "01"
        })
}

/// The users' side of the server, answered by a handler that lists users
/// as the controller's does (on the store, acting for the proven user).
struct ListUsers(Store);

impl crate::clients::ClientHandler for ListUsers {
    fn call(
        &self,
        user: &str,
        call: jujube_wire::client::ClientCall,
    ) -> Result<crate::clients::Answer, jujube_wire::client::ClientError> {
        match call {
            jujube_wire::client::ClientCall::Users => self
                .0
                .as_user(user)
                .users()
                .map(|u| crate::clients::Answer::Json(jujube_wire::client::raw(&u)))
                .map_err(|e| jujube_wire::client::ClientError::new(e.to_string())),
            other => Err(jujube_wire::client::ClientError::new(format!(
                "not answered here: {}",
                other.method()
            ))),
        }
    }
}

/// A credential check is the server's own work, which may take long (a
/// login refused is answered after a pause; a controller cut off from its
/// database waits on it): the unproven deadline does not cut it, and the
/// answer arrives. (Cut, the client saw a lost connection where another
/// controller would have answered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_being_checked_is_answered_past_the_unproven_deadline() {
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    let mut w = World::new().await;
    w.store.create_admin("pw").unwrap();
    w.start_serving(
        Limits {
            unauthenticated_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
        Some(Arc::new(ListUsers(w.store.clone()))),
    )
    .await;
    let server = w.server.as_ref().unwrap();
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let started = std::time::Instant::now();
    let e = UserClient::new(&server.addresses(), &ca, "admin", "wrong")
        .unwrap()
        .call(&ClientCall::Users)
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        started.elapsed() > Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        e.message,
        "invalid credentials for user `admin`; log in again with `jujube login`"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_log_in_with_their_password_and_register_once_within_the_bounds() {
    let _alone = MEMORY.lock().await;
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::{Access, ClientCall, Registration};
    let mut w = World::new().await;
    w.store.create_admin("the admin's pässword").unwrap();
    w.store
        .as_user("admin")
        .add_user(
            "bob",
            Access::Read,
            &jujube_state::users::secret_hash("the secret"),
        )
        .unwrap();
    w.start_serving(
        Limits::default(),
        Some(Arc::new(ListUsers(w.store.clone()))),
    )
    .await;
    let server = w.server.as_ref().unwrap();
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = |user: &str, password: &str| {
        UserClient::new(&server.addresses(), &ca, user, password).unwrap()
    };
    // Its password (any characters) logs a user in; a wrong one, or a user
    // that does not exist or has not registered, is refused alike.
    let users = client("admin", "the admin's pässword")
        .call(&ClientCall::Users)
        .await
        .unwrap()
        .unwrap();
    let users: serde_json::Value = serde_json::from_slice(&users).unwrap();
    assert_eq!(users.as_array().unwrap().len(), 2);
    for (user, password) in [("admin", "wrong"), ("nobody", "x"), ("bob", "")] {
        let e = client(user, password)
            .call(&ClientCall::Users)
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(
            e.message,
            format!("invalid credentials for user `{user}`; log in again with `jujube login`")
        );
    }
    // A name that is not a user's name never leaves the client.
    assert!(UserClient::new(&server.addresses(), &ca, "bob\nx", "pw").is_err());
    // A registration is small, and works once.
    let register = |secret: &str, password: String| {
        let c = client("bob", "");
        let r = Registration {
            user: "bob".into(),
            secret: secret.into(),
            password,
        };
        async move { c.register(&r).await.unwrap() }
    };
    let e = register("the secret", "p".repeat(9 << 10))
        .await
        .unwrap_err();
    assert_eq!(e.message, "a registration is at most 8192 bytes");
    let e = register("not it", "bob's".into()).await.unwrap_err();
    assert!(
        e.message.starts_with("registration refused"),
        "{}",
        e.message
    );
    register("the secret", "bøb's".into()).await.unwrap();
    let mine = client("bob", "bøb's")
        .call(&ClientCall::Users)
        .await
        .unwrap()
        .unwrap();
    let mine: serde_json::Value = serde_json::from_slice(&mine).unwrap();
    assert_eq!(mine[0]["name"], "bob");
    let e = register("the secret", "again".into()).await.unwrap_err();
    assert!(
        e.message.starts_with("registration refused"),
        "{}",
        e.message
    );
}

/// Answers `status` with an answer as large as a 100,000-unit model's
/// status (about 40 MB of JSON).
struct LargeStatus;

impl crate::clients::ClientHandler for LargeStatus {
    fn call(
        &self,
        _user: &str,
        _call: jujube_wire::client::ClientCall,
    ) -> Result<crate::clients::Answer, jujube_wire::client::ClientError> {
        let units: serde_json::Map<String, serde_json::Value> = (0..100_000)
            .map(|i| {
                (
                    format!("big/{i}"),
                    serde_json::json!({"machine": i.to_string(), "agent-status": "started", "workload-status": "active", "public-address": format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255), "message": "x".repeat(300)}),
                )
            })
            .collect();
        Ok(crate::clients::Answer::streamed(
            serde_json::json!({ "units": units }),
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_answer_as_large_as_a_100000_unit_status_reaches_the_client() {
    let _alone = MEMORY.lock().await;
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    let mut w = World::new().await;
    w.store.create_admin("pw").unwrap();
    w.start_serving(Limits::default(), Some(Arc::new(LargeStatus)))
        .await;
    let server = w.server.as_ref().unwrap();
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = UserClient::new(&server.addresses(), &ca, "admin", "pw").unwrap();
    let status = client.call(&ClientCall::Status).await.unwrap().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    assert_eq!(status["units"].as_object().unwrap().len(), 100_000);
    assert!(serde_json::to_vec(&status).unwrap().len() > 32 << 20);
}

/// Streams its answers: `status` whole (3 MB, written in pieces), `users`
/// cut short by its writer after 1 MB.
struct Streams;

impl Streams {
    fn piece(i: usize) -> String {
        format!("{{\"piece\":{i},\"text\":\"{}\"}}", "x".repeat(1000))
    }
}

impl crate::clients::ClientHandler for Streams {
    fn call(
        &self,
        _user: &str,
        call: jujube_wire::client::ClientCall,
    ) -> Result<crate::clients::Answer, jujube_wire::client::ClientError> {
        let fails = matches!(call, jujube_wire::client::ClientCall::Users);
        Ok(crate::clients::Answer::Streamed(Box::new(move |w| {
            w.write_all(b"[")?;
            for i in 0..3000 {
                if fails && i == 1000 {
                    return Err(std::io::Error::other("the store went away"));
                }
                if i > 0 {
                    w.write_all(b",")?;
                }
                w.write_all(Self::piece(i).as_bytes())?;
            }
            w.write_all(b"]")
        })))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_arrives_whole_or_as_an_error_never_cut_short_as_if_whole() {
    let _alone = MEMORY.lock().await;
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    let mut w = World::new().await;
    w.store.create_admin("pw").unwrap();
    w.start_serving(Limits::default(), Some(Arc::new(Streams)))
        .await;
    let server = w.server.as_ref().unwrap();
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = UserClient::new(&server.addresses(), &ca, "admin", "pw").unwrap();
    let whole = client.call(&ClientCall::Status).await.unwrap().unwrap();
    let pieces: Vec<serde_json::Value> = serde_json::from_slice(&whole).unwrap();
    assert_eq!(pieces.len(), 3000);
    assert_eq!(pieces[2999]["piece"], 2999);
    // Handed on as it arrives: the same bytes, in more than one piece.
    let (mut got, mut calls) = (Vec::new(), 0);
    client
        .call_into(&ClientCall::Status, &mut |b| {
            calls += 1;
            got.extend_from_slice(b);
            Ok(())
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, whole);
    assert!(calls > 1, "{calls}");
    // A writer that fails mid-way: an error, after what was sent.
    let e = client.call(&ClientCall::Users).await.unwrap_err();
    assert!(e.message.contains("reading the answer"), "{}", e.message);
    let mut got = Vec::new();
    let e = client
        .call_into(&ClientCall::Users, &mut |b| {
            got.extend_from_slice(b);
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(e.message.contains("reading the answer"), "{}", e.message);
    assert!(got.len() < whole.len() / 2, "{}", got.len());
}

/// Answers `status` with 8 MB of JSON, streamed, and counts the answers
/// alive at once: made and not yet written out or given up (each would
/// hold a snapshot of the model).
#[derive(Default)]
struct HeldStatus {
    live: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

/// One answer of [`HeldStatus`]'s alive, until dropped.
struct Alive(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl crate::clients::ClientHandler for HeldStatus {
    fn call(
        &self,
        _user: &str,
        _call: jujube_wire::client::ClientCall,
    ) -> Result<crate::clients::Answer, jujube_wire::client::ClientError> {
        use std::sync::atomic::Ordering;
        let n = self.live.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        let alive = Alive(self.live.clone());
        Ok(crate::clients::Answer::Streamed(Box::new(move |w| {
            let _alive = alive;
            for _ in 0..8000 {
                w.write_all(&[b' '; 1024])?;
            }
            w.write_all(b"{}")
        })))
    }
}

/// A user's call as `UserClient` sends it.
fn user_request(
    user: &str,
    password: &str,
    call: &jujube_wire::client::ClientCall,
) -> hyper::Request<http_body_util::Full<bytes::Bytes>> {
    use base64::Engine;
    use jujube_agent::wire::SERVER_NAME;
    use jujube_wire::client::{CLIENT_PATH, USER_HEADER};
    hyper::Request::post(format!("https://{SERVER_NAME}{CLIENT_PATH}"))
        .header(USER_HEADER, user)
        .header(
            hyper::header::AUTHORIZATION,
            format!(
                "Bearer {}",
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(password)
            ),
        )
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(call).unwrap(),
        )))
        .unwrap()
}

/// `n` users besides the admin, `user0`.., each with password `pw`.
fn add_users(store: &Store, n: usize) -> Vec<String> {
    use jujube_wire::client::Access;
    (0..n)
        .map(|i| {
            let name = format!("user{i}");
            store
                .as_user("admin")
                .add_user(&name, Access::Read, &jujube_state::users::secret_hash("s"))
                .unwrap();
            store.register_user(&name, "s", "pw").unwrap();
            name
        })
        .collect()
}

/// A server answering `status` as [`HeldStatus`] within `limits`, for the
/// admin (`pw`) and two users: the world, the handler's counts, a TLS
/// configuration to connect with, and the users' names.
async fn serving_held_status(limits: Limits) -> (World, Arc<HeldStatus>, AgentConf, Vec<String>) {
    let mut w = World::new().await;
    w.store.create_admin("pw").unwrap();
    let users = add_users(&w.store, 2);
    let handler = Arc::new(HeldStatus::default());
    w.start_serving(limits, Some(handler.clone())).await;
    let tls = w.machine_conf(1);
    (w, handler, tls, users)
}

/// A `status` is a snapshot of the whole model, held until its client has
/// read it: however many users ask and read nothing, the server makes and
/// holds at most `max_whole_model_answers` of them, and a user's share
/// of those; the next waits its turn and is answered once one is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_answers_made_and_held_at_once_are_bounded_whoever_asks() {
    use http_body_util::BodyExt;
    use jujube_wire::client::ClientCall;
    use std::sync::atomic::Ordering;
    let _alone = MEMORY.lock().await;
    let (w, handler, tls, users) = serving_held_status(Limits {
        max_whole_model_answers: 2,
        max_whole_model_answers_per_user: 1,
        ..Limits::default()
    })
    .await;
    let (live, most) = (handler.live.clone(), handler.most.clone());
    // A window of 1 KiB: what a client does not read stays with the server.
    let mut admin = h2(&w, &tls, 1 << 10).await;
    let mut first = h2(&w, &tls, 1 << 10).await;
    let held_admin = admin
        .send_request(user_request("admin", "pw", &ClientCall::Status))
        .await
        .unwrap();
    let held_first = first
        .send_request(user_request(&users[0], "pw", &ClientCall::Status))
        .await
        .unwrap();
    assert_eq!(held_admin.status(), hyper::StatusCode::OK);
    assert_eq!(held_first.status(), hyper::StatusCode::OK);
    // The admin again, on another connection, while its first is unread:
    // refused at once, saying why.
    let mut again = h2(&w, &tls, 1 << 10).await;
    let refused = again
        .send_request(user_request("admin", "pw", &ClientCall::Status))
        .await
        .unwrap();
    assert_eq!(refused.status(), hyper::StatusCode::TOO_MANY_REQUESTS);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let e: jujube_wire::client::ClientError = serde_json::from_slice(&body).unwrap();
    assert!(
        e.message.contains("still being made or sent"),
        "{}",
        e.message
    );
    // A third user waits: nothing is made for it while two are held.
    let mut third = h2(&w, &tls, 1 << 10).await;
    let waiting =
        tokio::spawn(third.send_request(user_request(&users[1], "pw", &ClientCall::Status)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !waiting.is_finished(),
        "a third status was answered beside two unread"
    );
    assert_eq!(live.load(Ordering::SeqCst), 2);
    // The admin reads its answer: the third's turn comes.
    let n = held_admin
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .len();
    assert_eq!(n, 8000 * 1024 + 2);
    let answered = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("answered once a turn was given back")
        .unwrap()
        .unwrap();
    assert_eq!(answered.status(), hyper::StatusCode::OK);
    let n = answered
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .len();
    assert_eq!(n, 8000 * 1024 + 2);
    // A client that lets go of its answer gives its turn back too.
    drop(held_first);
    assert!(eventually(10, || live.load(Ordering::SeqCst) == 0).await);
    // The admin's turn is its own again.
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        again.send_request(user_request("admin", "pw", &ClientCall::Status)),
    )
    .await
    .expect("a turn is free")
    .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    let n = resp.into_body().collect().await.unwrap().to_bytes().len();
    assert_eq!(n, 8000 * 1024 + 2);
    assert_eq!(most.load(Ordering::SeqCst), 2);
}

/// A call that waits for its turn and whose client gives up (resets the
/// stream, or goes) leaves the line: however many did, the next call waits
/// its turn and is answered, never told the line is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_given_up_while_waiting_for_a_turn_leave_the_line() {
    use http_body_util::BodyExt;
    use jujube_wire::client::ClientCall;
    let _alone = MEMORY.lock().await;
    let (w, _, tls, users) = serving_held_status(Limits {
        max_whole_model_answers: 1,
        // The line alone is under test.
        max_whole_model_answers_per_user: 1000,
        ..Limits::default()
    })
    .await;
    let mut holder = h2(&w, &tls, 1 << 10).await;
    let held = holder
        .send_request(user_request("admin", "pw", &ClientCall::Status))
        .await
        .unwrap();
    assert_eq!(held.status(), hyper::StatusCode::OK);
    // More than the line holds wait, one after another, and give up.
    let mut waiter = h2(&w, &tls, 1 << 10).await;
    for i in 0..crate::clients::MAX_WAITING_WHOLE_MODEL + 6 {
        let call = waiter.send_request(user_request(&users[0], "pw", &ClientCall::Status));
        match tokio::time::timeout(Duration::from_millis(30), call).await {
            Err(_) => {}
            Ok(r) => panic!(
                "call {i} answered while the only turn is held: {:?}",
                r.map(|r| r.status())
            ),
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut last = h2(&w, &tls, 1 << 20).await;
    let next = tokio::spawn(last.send_request(user_request(&users[1], "pw", &ClientCall::Status)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = held.into_body().collect().await.unwrap().to_bytes().len();
    assert_eq!(n, 8000 * 1024 + 2);
    let resp = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("answered once the turn is free")
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
}

/// A status nobody reads is given up at the server's deadline for a whole
/// answer (well before a client that takes a chunk now and then would
/// let go): its snapshot and its turn go, and its client sees an error,
/// never a cut answer taken as whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_not_read_whole_by_the_deadline_is_cut_off_and_gives_its_turn_back() {
    use http_body_util::BodyExt;
    use jujube_wire::client::ClientCall;
    use std::sync::atomic::Ordering;
    let _alone = MEMORY.lock().await;
    let (w, handler, tls, _) = serving_held_status(Limits {
        max_whole_model_answers: 1,
        stream_deadline: Duration::from_secs(2),
        ..Limits::default()
    })
    .await;
    let live = handler.live.clone();
    let mut slow = h2(&w, &tls, 1 << 10).await;
    let started = std::time::Instant::now();
    let held = slow
        .send_request(user_request("admin", "pw", &ClientCall::Status))
        .await
        .unwrap();
    assert_eq!(held.status(), hyper::StatusCode::OK);
    assert!(eventually(10, || live.load(Ordering::SeqCst) == 0).await);
    let given_up = started.elapsed();
    assert!(
        given_up >= Duration::from_secs(2) && given_up < crate::clients::STREAM_STALL,
        "{given_up:?}"
    );
    // Its client reads what was sent, then an error.
    assert!(held.into_body().collect().await.is_err());
    // The turn is free: the next status is made and read whole.
    let mut next = h2(&w, &tls, 1 << 20).await;
    let resp = next
        .send_request(user_request("admin", "pw", &ClientCall::Status))
        .await
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    let n = resp.into_body().collect().await.unwrap().to_bytes().len();
    assert_eq!(n, 8000 * 1024 + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_connects_the_moment_the_server_listens_is_answered() {
    let _alone = MEMORY.lock().await;
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    let mut w = World::new().await;
    w.store.create_admin("pw").unwrap();
    // A controller's CLI connects as soon as the socket accepts (it waits
    // while the controller's lock is held): the first call must reach the
    // users' handler, not a server that has not been told of it yet.
    w.start_serving(
        Limits::default(),
        Some(Arc::new(ListUsers(w.store.clone()))),
    )
    .await;
    let server = w.server.as_ref().unwrap();
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = UserClient::new(&server.addresses(), &ca, "admin", "pw").unwrap();
    let users = client.call(&ClientCall::Users).await.unwrap();
    assert!(users.is_ok(), "{users:?}");
    // A server started without users' handler (an agents-only one) says so.
    w.start(Limits::default()).await;
    let server = w.server.as_ref().unwrap();
    let client = UserClient::new(&server.addresses(), &ca, "admin", "pw").unwrap();
    let e = client.call(&ClientCall::Users).await.unwrap().unwrap_err();
    assert!(e.message.contains("does not serve users"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_is_taken_once_with_the_token_within_its_bound_from_the_one_shot_identity() {
    use bytes::Bytes;
    use jujube_agent::remote::hand_over;
    let taken = Arc::new(std::sync::Mutex::new(Vec::<Bytes>::new()));
    let accept = {
        let taken = taken.clone();
        Box::new(move |body: Bytes| {
            if body.as_ref() == b"not yet" {
                return Err("the state is not laid out".into());
            }
            taken.lock().unwrap().push(body);
            Ok(())
        })
    };
    let (id, token, addr, receiving) =
        listening_hand_over(accept, crate::handover::CONNECTION_TIMEOUT).await;
    // Another identity (the environment's own CA, say) is not trusted.
    let other = crate::tls::OneShot::new().unwrap();
    let e = hand_over(&addr, &other.ca_cert, &token, b"state".to_vec())
        .await
        .unwrap_err();
    assert!(e.message.contains("TLS handshake"), "{e}");
    // A wrong token, an empty one, or too large a body: refused, nothing
    // taken.
    let e = hand_over(&addr, &id.ca_cert, &new_secret(), b"state".to_vec())
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
    let e = hand_over(&addr, &id.ca_cert, "", b"state".to_vec())
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
    let e = hand_over(&addr, &id.ca_cert, &token, vec![b'x'; 1001])
        .await
        .unwrap_err();
    assert!(e.message.contains("more than 1000 bytes"), "{e}");
    // What its taker refuses is said, and may be tried again.
    let e = hand_over(&addr, &id.ca_cert, &token, b"not yet".to_vec())
        .await
        .unwrap_err();
    assert_eq!(e.message, "the state is not laid out");
    assert!(taken.lock().unwrap().is_empty());
    hand_over(&addr, &id.ca_cert, &token, b"state".to_vec())
        .await
        .unwrap();
    receiving.await.unwrap().unwrap();
    assert_eq!(*taken.lock().unwrap(), vec![Bytes::from_static(b"state")]);
    // Then nothing listens: the controller takes the port.
    assert!(hand_over(&addr, &id.ca_cert, &token, b"again".to_vec())
        .await
        .is_err());
    assert!(tokio::net::TcpListener::bind(&addr).await.is_ok());
}

/// A hand-over listening on a free loopback port with a one-shot identity,
/// taken by `accept`, each connection held at most `held`: its identity,
/// token and address, and the task receiving it (once it listens).
async fn listening_hand_over(
    accept: Box<crate::handover::Accept>,
    held: Duration,
) -> (
    crate::tls::OneShot,
    String,
    String,
    tokio::task::JoinHandle<crate::Result<()>>,
) {
    let id = crate::tls::OneShot::new().unwrap();
    let token = new_secret();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let receiving = {
        let (cert, key) = (id.server_cert.clone(), id.server_key.clone());
        let (addr, hash) = (addr.clone(), secret_hash(&token));
        tokio::spawn(async move {
            crate::handover::receive(&addr, &cert, &key, &hash, 1000, accept, held).await
        })
    };
    let mut tries = 0;
    while std::net::TcpStream::connect(&addr).is_err() {
        tries += 1;
        assert!(tries < 500, "the hand-over listens");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (id, token, addr, receiving)
}

/// Connections that hold every slot of the hand-over and send nothing are
/// dropped at their time, and the hand-over is then taken (it was refused
/// at accept for as long as they stayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_keep_the_hand_over_out() {
    use jujube_agent::remote::hand_over;
    let (id, token, addr, receiving) =
        listening_hand_over(Box::new(|_| Ok(())), Duration::from_millis(800)).await;
    // The probe's connection, dropped, frees its slot soon.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle: Vec<_> = (0..crate::handover::MAX_CONNECTIONS)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Every slot is held: one more is closed as it is accepted.
    let start = std::time::Instant::now();
    let more = std::net::TcpStream::connect(&addr).unwrap();
    let took = time_until_closed(more, start)
        .await
        .expect("one more is closed at once");
    assert!(took < Duration::from_millis(500), "closed after {took:?}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    hand_over(&addr, &id.ca_cert, &token, b"state".to_vec())
        .await
        .unwrap();
    receiving.await.unwrap().unwrap();
    drop(idle);
}

/// What a [`scripted_server`] does with each request it takes.
#[derive(Clone, Copy)]
enum Script {
    /// Drops the connection without answering (a controller killed while
    /// the call ran).
    Drop,
    /// Answers 503, "unavailable" (a controller cut off its database).
    Unavailable,
}

/// A server with the environment's certificate that does `script` with
/// each request; counts the requests it took.
async fn scripted_server(
    w: &World,
    script: Script,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    type Answer = Result<hyper::Response<http_body_util::Full<bytes::Bytes>>, std::io::Error>;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls::server_config(w.dir.path()).unwrap());
    let taken = Arc::new(AtomicUsize::new(0));
    let counter = taken.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, counter) = (acceptor.clone(), counter.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let gone = Arc::new(tokio::sync::Notify::new());
                let signal = gone.clone();
                let service = hyper::service::service_fn(move |_req| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let signal = signal.clone();
                    async move {
                        match script {
                            Script::Drop => {
                                signal.notify_one();
                                std::future::pending::<Answer>().await
                            }
                            Script::Unavailable => {
                                let body = serde_json::to_vec(&jujube_wire::client::ClientError {
                                    message: "cannot reach the state database".into(),
                                    usage: false,
                                    unavailable: true,
                                })
                                .unwrap();
                                Ok(hyper::Response::builder()
                                    .status(hyper::StatusCode::SERVICE_UNAVAILABLE)
                                    .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                                    .unwrap())
                            }
                        }
                    }
                });
                let conn =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service);
                tokio::select! {
                    _ = conn => {}
                    _ = gone.notified() => {}
                }
            });
        }
    });
    (addr, taken)
}

/// Calls that shared a connection to a controller that answered 503 move
/// on to the next controller together: the next connection goes to the
/// one after it, not one further per call that saw the 503.
#[tokio::test]
async fn calls_refused_together_by_one_controller_move_to_the_next_one() {
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    use std::sync::atomic::Ordering;
    let w = World::new().await;
    let (cut_off, refused) = scripted_server(&w, Script::Unavailable).await;
    let (next, to_next) = scripted_server(&w, Script::Drop).await;
    let (after, to_after) = scripted_server(&w, Script::Drop).await;
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = UserClient::new(&[cut_off, next, after], &ca, "admin", "pw").unwrap();
    let (a, b) = tokio::join!(
        client.call(&ClientCall::Status),
        client.call(&ClientCall::Users)
    );
    for r in [a, b] {
        assert_eq!(r.unwrap_err().code, ErrorCode::Unavailable);
    }
    assert_eq!(refused.load(Ordering::SeqCst), 2, "both calls went to it");
    // The next call's connection: to `next`, which drops it.
    let err = client
        .call(&ClientCall::AddUnits {
            service: "wordpress".into(),
            n: 1,
            to: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Unanswered, "{err}");
    assert_eq!(
        (
            to_next.load(Ordering::SeqCst),
            to_after.load(Ordering::SeqCst)
        ),
        (1, 0),
        "the controller after the one that refused was skipped"
    );
}

/// A user's call whose connection is lost after the controller took it
/// (it may have been done) is sent again only when doing it twice changes
/// nothing more: an add-unit is answered "unanswered" after one request
/// (sent again, a kept one would add twice); a status is asked again.
#[tokio::test]
async fn a_write_whose_answer_was_lost_is_not_sent_again_and_a_read_is() {
    use jujube_agent::remote::UserClient;
    use jujube_wire::client::ClientCall;
    use std::sync::atomic::Ordering;
    let w = World::new().await;
    let (addr, taken) = scripted_server(&w, Script::Drop).await;
    let ca = tls::ca_cert(w.dir.path()).unwrap();
    let client = UserClient::new(&[addr], &ca, "admin", "pw").unwrap();

    let add = ClientCall::AddUnits {
        service: "wordpress".into(),
        n: 1,
        to: None,
    };
    let err = client.call(&add).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unanswered, "{err}");
    assert_eq!(
        taken.load(Ordering::SeqCst),
        1,
        "the add-unit was sent again"
    );

    let err = client.call(&ClientCall::Status).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unavailable, "{err}");
    assert_eq!(
        taken.load(Ordering::SeqCst),
        3,
        "a status is asked again on a new connection"
    );
}

/// An agent's writes carry a stamp (its incarnation, the write's number):
/// a write that reaches the store after a later one of the same agent
/// (held up in a controller cut off from its database while the agent
/// went on through another) is refused and changes nothing; a write sent
/// again after a lost answer is applied once; an agent started again
/// refuses the previous process's writes under its old incarnation, and
/// that process sends a write so refused once more under a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_write_arriving_after_its_later_one_is_refused_and_changes_nothing() {
    use jujube_agent::wire::{Call, STAMP_HEADER};
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let status = |w: &World| w.store.machine(m1).unwrap().agent_status;
    let agent = w.remote(&conf);
    // Its first write takes incarnation 1 and is number 1 in it; the
    // next is number 2.
    agent
        .set_machine_status(m1, AgentStatus::Started, "")
        .await
        .unwrap();
    agent
        .set_machine_status(m1, AgentStatus::Started, "up")
        .await
        .unwrap();
    assert_eq!(status(&w), "started");
    let mut sender = h2(&w, &conf, 65_535).await;
    let mut send = |stamp: &str, to: AgentStatus| {
        let mut req = call_request(
            &conf,
            &Call::SetMachineStatus {
                id: m1,
                status: to,
                info: String::new(),
            },
        );
        req.headers_mut()
            .insert(STAMP_HEADER, stamp.parse().unwrap());
        sender.send_request(req)
    };
    // Write 2 again (its answer lost): done, and not applied twice.
    let before = w.store.head_revision().unwrap();
    let again = send("1.2", AgentStatus::Error).await.unwrap();
    assert_eq!(again.status(), hyper::StatusCode::OK);
    assert_eq!(status(&w), "started");
    assert_eq!(w.store.head_revision().unwrap(), before, "a resend wrote");
    // A write numbered before it arrives late: refused, nothing written.
    let late = send("1.1", AgentStatus::Error).await.unwrap();
    assert_superseded(late).await;
    assert_eq!(status(&w), "started");
    assert_eq!(
        w.store.head_revision().unwrap(),
        before,
        "a late write wrote"
    );
    // A malformed stamp is refused before anything is done; so is number
    // 0, what a fresh incarnation has applied.
    for bad in ["1.x", "1.0"] {
        let bad = send(bad, AgentStatus::Error).await.unwrap();
        assert_eq!(bad.status(), hyper::StatusCode::CONFLICT);
        assert_eq!(status(&w), "started");
    }
    // The agent started again (a new process): the old one's next write
    // is refused, and its write after that goes through on a new
    // incarnation.
    let restarted = w.remote(&conf);
    restarted
        .set_machine_status(m1, AgentStatus::Error, "restarted")
        .await
        .unwrap();
    assert_eq!(status(&w), "error");
    // The old process's next write is refused under its incarnation, and
    // goes once more under a new one, which the restarted process's next
    // write then finds taken: it too goes again under a newer one.
    agent
        .set_machine_status(m1, AgentStatus::Started, "old")
        .await
        .unwrap();
    assert_eq!(status(&w), "started");
    restarted
        .set_machine_status(m1, AgentStatus::Error, "restarted, again")
        .await
        .unwrap();
    assert_eq!(status(&w), "error");
}

/// An answer refusing a write as superseded (409, `superseded`).
async fn assert_superseded(resp: hyper::Response<hyper::body::Incoming>) {
    assert_eq!(resp.status(), hyper::StatusCode::CONFLICT);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let reply: jujube_agent::wire::Reply = serde_json::from_slice(&body).unwrap();
    assert!(
        matches!(&reply, jujube_agent::wire::Reply::Error(e) if e.code == ErrorCode::Superseded),
        "{reply:?}"
    );
}

/// A deployer's credential for its unit is one of its writes, in order: a
/// credential held up in a controller that lost its database, while the
/// deployer went on through another and set a newer one, would lock the
/// unit's agent out when it landed.
#[tokio::test]
async fn a_unit_credential_arriving_after_a_later_one_is_refused_and_changes_nothing() {
    use jujube_agent::wire::{Call, STAMP_HEADER};
    let w = World::new().await;
    let m1 = w.machine_of("wordpress/0");
    let conf = w.machine_conf(m1);
    let stored = |w: &World| w.store.agent_credential("unit-wordpress-0").unwrap();
    let deployer = w.remote(&conf);
    // Write 1 of incarnation 1, then the credential: write 2.
    deployer
        .set_machine_status(m1, AgentStatus::Started, "")
        .await
        .unwrap();
    let newer = deployer.new_unit_credential("wordpress/0").await.unwrap();
    assert_eq!(stored(&w), Some(secret_hash(&newer)));
    let mut sender = h2(&w, &conf, 65_535).await;
    let mut send = |stamp: &str, secret: &str| {
        let mut req = call_request(
            &conf,
            &Call::SetUnitCredential {
                unit: "wordpress/0".into(),
                secret: secret.into(),
            },
        );
        req.headers_mut()
            .insert(STAMP_HEADER, stamp.parse().unwrap());
        sender.send_request(req)
    };
    // The credential sent as write 1 arrives late: refused, the newer kept.
    let older = new_secret();
    let late = send("1.1", &older).await.unwrap();
    assert_superseded(late).await;
    assert_eq!(
        stored(&w),
        Some(secret_hash(&newer)),
        "a late credential was kept"
    );
    // Write 2 again (its answer lost): done, the credential unchanged.
    let again = send("1.2", &newer).await.unwrap();
    assert_eq!(again.status(), hyper::StatusCode::OK);
    assert_eq!(stored(&w), Some(secret_hash(&newer)));
    // The deployer's next credential goes on as write 3.
    let next = deployer.new_unit_credential("wordpress/0").await.unwrap();
    assert_eq!(stored(&w), Some(secret_hash(&next)));
}
