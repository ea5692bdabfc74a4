//! The provisioner against the dummy cloud with injected faults, on tokio's
//! paused clock, with a real SQLite store.

use super::*;
use jujube_core::Constraints;
use jujube_providers::dummy::DummyProvider;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::{Durability, Store};

const UUID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d";

struct World {
    _dir: tempfile::TempDir,
    store: Store,
    cloud: Arc<DummyProvider>,
    p: Provisioner,
}

fn world(config: &[(&str, &str)]) -> World {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
    let config: BTreeMap<String, String> = config
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    store
        .initialize(&EnvironmentSpec {
            name: "test".into(),
            uuid: UUID.into(),
            provider: "dummy".into(),
            default_series: "jammy".into(),
            constraints: Constraints::default(),
            config: config.clone(),
        })
        .unwrap();
    let cloud = Arc::new(DummyProvider::open(dir.path(), "test", UUID, &config).unwrap());
    let p = Provisioner::new(store.clone(), cloud.clone()).unwrap();
    World {
        _dir: dir,
        store,
        cloud,
        p,
    }
}

impl World {
    /// Passes until the model stops moving (in virtual time).
    async fn settle(&self) {
        for _ in 0..50 {
            let before = (
                self.store.head_revision().unwrap(),
                self.cloud.all_instances().unwrap().len(),
            );
            self.p.reconcile().await.unwrap();
            self.p.idle().await;
            let after = (
                self.store.head_revision().unwrap(),
                self.cloud.all_instances().unwrap().len(),
            );
            if before == after {
                return;
            }
        }
        panic!("provisioning did not settle");
    }

    fn set(&self, kvs: &[(&str, &str)]) {
        let kvs: Vec<(String, String)> = kvs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.store.set_environment_config(&kvs).unwrap();
    }

    /// Ids of every instance the cloud holds.
    fn instance_ids(&self) -> Vec<String> {
        self.cloud
            .all_instances()
            .unwrap()
            .into_iter()
            .map(|i| i.id)
            .collect()
    }

    fn instances_of(&self, machine: i64) -> usize {
        self.cloud
            .all_instances()
            .unwrap()
            .iter()
            .filter(|i| i.machine_id() == Some(&machine.to_string()))
            .count()
    }

    fn tags(&self, uuid: Option<&str>, machine: &str) -> BTreeMap<String, String> {
        let mut t = BTreeMap::new();
        if let Some(u) = uuid {
            t.insert(jujube_providers::TAG_ENV_UUID.to_string(), u.to_string());
        }
        t.insert(
            jujube_providers::TAG_MACHINE_ID.to_string(),
            machine.to_string(),
        );
        t
    }
}

#[tokio::test(start_paused = true)]
async fn alive_machines_get_instances_with_their_constraints() {
    let w = world(&[]);
    let ids = w
        .store
        .add_machines(3, None, Some(&Constraints::parse("mem=3G").unwrap()))
        .unwrap();
    w.settle().await;
    for id in ids.iter().chain([&0]) {
        let m = w.store.machine(*id).unwrap();
        assert!(m.instance_id.is_some(), "machine {id} has no instance");
        assert_eq!(m.status, machine_status::STARTED);
        assert!(m.zone.is_some());
        assert_eq!(w.instances_of(*id), 1);
    }
    let m = w.store.machine(ids[0]).unwrap();
    assert!(
        m.hardware
            .as_deref()
            .unwrap()
            .contains("instance-type=d1.medium"),
        "{:?}",
        m.hardware
    );
    // Machines of one request spread over zones.
    let zones: HashSet<_> = ids
        .iter()
        .map(|i| w.store.machine(*i).unwrap().zone.unwrap())
        .collect();
    assert_eq!(zones.len(), 3);
    // Idempotent: another pass starts nothing.
    w.settle().await;
    assert_eq!(w.cloud.all_instances().unwrap().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_failed_start_leaves_no_instance_id_and_an_error_that_says_why() {
    let w = world(&[]);
    let id = w
        .store
        .add_machines(1, None, Some(&Constraints::parse("mem=512G").unwrap()))
        .unwrap()[0];
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert_eq!(m.instance_id, None);
    assert_eq!(m.status, machine_status::ERROR);
    assert_eq!(
        m.status_info,
        "cannot start machine 1: invalid instance spec: no dummy instance type satisfies `mem=512G` (the largest is 64 cores, 256G memory, 1T root disk)"
    );
    // Not retried while in error...
    w.settle().await;
    assert_eq!(w.instances_of(id), 0);
    // ...until resolved, here with constraints that fit.
    w.store
        .resolve_machine(id, Some(&Constraints::parse("mem=4G").unwrap()))
        .unwrap();
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert!(m.instance_id.is_some());
    assert!(m.hardware.unwrap().contains("mem=4G"));
}

#[tokio::test(start_paused = true)]
async fn injected_machine_failures_show_in_status_and_resolved_recovers_after_the_fix() {
    let w = world(&[("dummy-fail-machines", "2"), ("dummy-fail-class", "quota")]);
    w.store.add_machines(2, None, None).unwrap();
    w.settle().await;
    assert!(w.store.machine(1).unwrap().instance_id.is_some());
    let m2 = w.store.machine(2).unwrap();
    assert_eq!(m2.status, machine_status::ERROR);
    assert!(
        m2.status_info
            .contains("quota exceeded: machine 2 is configured to fail"),
        "{}",
        m2.status_info
    );
    // The fix is picked up from config without a restart.
    w.set(&[("dummy-fail-machines", "")]);
    w.store.retry_provisioning(&[2]).unwrap();
    w.settle().await;
    assert!(w.store.machine(2).unwrap().instance_id.is_some());
}

#[tokio::test(start_paused = true)]
async fn transient_errors_are_retried_with_backoff_until_they_pass() {
    let w = world(&[("dummy-failure-rate", "transient:0.7"), ("dummy-seed", "7")]);
    let ids = w.store.add_machines(20, None, None).unwrap();
    let t0 = Instant::now();
    w.settle().await;
    for id in &ids {
        assert_eq!(w.instances_of(*id), 1, "machine {id}");
        assert!(w.store.machine(*id).unwrap().instance_id.is_some());
    }
    assert!(
        t0.elapsed() > Duration::from_millis(500),
        "retries waited: {:?}",
        t0.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_start_being_retried_says_why_and_when_in_the_machines_status() {
    let w = world(&[
        ("dummy-failure-rate", "transient:1"),
        ("provisioner-retry-for", "1m"),
    ]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.p.reconcile().await.unwrap();
    // From the first failed attempt on (virtual time: no waiting).
    let mut m = w.store.machine(id).unwrap();
    for _ in 0..200 {
        if !m.status_info.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        m = w.store.machine(id).unwrap();
    }
    assert_eq!(m.status, machine_status::PROVISIONING);
    assert!(
        m.status_info.starts_with("start failed, retrying in ")
            && m.status_info
                .contains("(for up to 60s in all): transient provider error: injected failure"),
        "{}",
        m.status_info
    );
    // Still said between later attempts, until it gives up.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let m = w.store.machine(id).unwrap();
    assert_eq!(m.status, machine_status::PROVISIONING);
    assert!(
        m.status_info.starts_with("start failed, retrying in "),
        "{}",
        m.status_info
    );
    w.settle().await;
    assert_eq!(w.store.machine(id).unwrap().status, machine_status::ERROR);
}

#[tokio::test(start_paused = true)]
async fn persistent_transient_errors_give_up_after_the_retry_budget() {
    let w = world(&[
        ("dummy-failure-rate", "transient:1"),
        ("provisioner-retry-for", "1m"),
    ]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    let t0 = Instant::now();
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert_eq!(m.status, machine_status::ERROR);
    assert!(m.status_info.starts_with("cannot start machine 1: gave up after 60s of transient errors; last: transient provider error: injected failure"), "{}", m.status_info);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(30) && took <= Duration::from_secs(120),
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn capacity_errors_move_to_the_next_zone() {
    let w = world(&[("dummy-full-zones", "zone-a,zone-b")]);
    let ids = w.store.add_machines(3, None, None).unwrap();
    w.settle().await;
    for id in ids {
        let m = w.store.machine(id).unwrap();
        assert_eq!(
            m.zone.as_deref(),
            Some("zone-c"),
            "machine {id}: {}",
            m.status_info
        );
    }
    w.set(&[("dummy-full-zones", "zone-a,zone-b,zone-c")]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert!(
        m.status_info
            .starts_with("cannot start machine 4: no capacity in any zone (tried"),
        "{}",
        m.status_info
    );
}

#[tokio::test(start_paused = true)]
async fn lost_responses_never_make_a_second_instance() {
    let w = world(&[("dummy-lost-response-rate", "0.5"), ("dummy-seed", "3")]);
    let ids = w.store.add_machines(30, None, None).unwrap();
    w.settle().await;
    for id in ids {
        assert_eq!(w.instances_of(id), 1, "machine {id}");
        assert!(w.store.machine(id).unwrap().instance_id.is_some());
    }
}

#[tokio::test(start_paused = true)]
async fn a_restarted_provisioner_adopts_the_instance_of_a_start_it_lost() {
    let w = world(&[]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    // The nonce is committed, the instance started, then the process died
    // before recording it.
    let prepared = w.store.prepare_provisioning(&[id], UUID).unwrap();
    let m = w.store.machine(id).unwrap();
    let spec = w.p.spec_for(&m, &prepared[0].nonce);
    let inst = w.cloud.start_instance(&spec).await.unwrap();
    let fresh = Provisioner::new(w.store.clone(), w.cloud.clone()).unwrap();
    fresh.reconcile().await.unwrap();
    fresh.idle().await;
    assert_eq!(w.store.machine(id).unwrap().instance_id, Some(inst.id));
    assert_eq!(w.instances_of(id), 1);
}

/// `by` applies `op`, as an agent would.
fn agent(w: &World, by: Caller, op: AgentOp) {
    w.store.apply(&by, &op).unwrap();
}

#[tokio::test(start_paused = true)]
async fn dead_machines_are_stopped_then_removed_and_dying_ones_are_left_to_their_agents() {
    let w = world(&[]);
    let ids = w.store.add_machines(2, None, None).unwrap();
    w.settle().await;
    let inst = w.store.machine(ids[0]).unwrap().instance_id.unwrap();
    w.store.destroy_machine(ids[0]).unwrap();
    agent(
        &w,
        Caller::Machine(ids[1]),
        AgentOp::EnsureDeadMachine { machine: ids[1] },
    );
    w.settle().await;
    // The Dying machine is its agent's to set Dead, not the controller's.
    assert_eq!(w.store.machine(ids[0]).unwrap().life, Life::Dying);
    assert!(w.store.machine(ids[1]).is_err());
    agent(
        &w,
        Caller::Machine(ids[0]),
        AgentOp::EnsureDeadMachine { machine: ids[0] },
    );
    w.settle().await;
    assert!(w.store.machine(ids[0]).is_err());
    assert!(w
        .cloud
        .all_instances()
        .unwrap()
        .iter()
        .all(|i| i.id != inst));
    assert_eq!(
        w.cloud.all_instances().unwrap().len(),
        1,
        "only machine 0's instance remains"
    );
}

#[tokio::test(start_paused = true)]
async fn machines_destroyed_before_provisioning_are_removed_without_instances() {
    let w = world(&[("dummy-fail-machines", "1")]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    w.store.destroy_machine(id).unwrap();
    w.settle().await;
    assert!(w.store.machine(id).is_err());
    assert_eq!(w.instances_of(id), 0);
}

#[tokio::test(start_paused = true)]
async fn machines_with_dying_units_wait_for_them() {
    let w = world(&[]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    let charm = jujube_state::Charm {
        url: "local:jammy/mysql-1".into(),
        meta: jujube_core::charm::CharmMeta::parse("name: mysql\n").unwrap(),
        config: Default::default(),
        actions: Default::default(),
        path: String::new(),
    };
    w.store
        .deploy(&jujube_state::services::DeployArgs {
            service: "mysql".into(),
            charm,
            series: "jammy".into(),
            constraints: Constraints::default(),
            units: 1,
            to: Some(id),
            settings: vec![],
        })
        .unwrap();
    w.settle().await;
    let unit = || "mysql/0".to_string();
    let status = AgentOp::SetUnitStatus {
        unit: unit(),
        status: "started".into(),
        info: String::new(),
    };
    agent(&w, Caller::Unit(unit()), status);
    w.store.destroy_units(&[unit()]).unwrap();
    w.store.destroy_machine(id).unwrap();
    w.settle().await;
    assert_eq!(w.store.machine(id).unwrap().life, Life::Dying);
    assert_eq!(w.instances_of(id), 1);
    // The machine cannot be set Dead while its Dying unit remains.
    let dead = AgentOp::EnsureDeadMachine { machine: id };
    assert!(w.store.apply(&Caller::Machine(id), &dead).is_err());
    agent(
        &w,
        Caller::Unit(unit()),
        AgentOp::EnsureDeadUnit { unit: unit() },
    );
    agent(
        &w,
        Caller::Machine(id),
        AgentOp::RemoveUnit { unit: unit() },
    );
    agent(&w, Caller::Machine(id), dead);
    w.settle().await;
    assert!(w.store.machine(id).is_err());
    assert_eq!(w.instances_of(id), 0);
}

#[tokio::test(start_paused = true)]
async fn tagged_strays_are_reaped_after_the_grace_period_and_untagged_instances_never() {
    let w = world(&[("harvest-grace", "2m"), ("harvest-interval", "10s")]);
    w.settle().await;
    let stray = w.cloud.start_raw(w.tags(Some(UUID), "77")).unwrap();
    let foreign = w
        .cloud
        .start_raw(w.tags(Some("ffffffff-2222-4333-8444-555555555555"), "1"))
        .unwrap();
    let untagged = w.cloud.start_raw(w.tags(None, "1")).unwrap();
    tokio::time::advance(Duration::from_secs(11)).await;
    w.settle().await;
    let view = w.store.strays().unwrap();
    assert_eq!(view.len(), 1);
    assert_eq!(
        (view[0].instance_id.as_str(), view[0].class.as_str()),
        (stray.as_str(), "unknown")
    );
    assert_eq!(view[0].reap_at, Some(view[0].first_seen + 120));
    tokio::time::advance(Duration::from_secs(60)).await;
    w.settle().await;
    assert!(
        w.cloud
            .all_instances()
            .unwrap()
            .iter()
            .any(|i| i.id == stray),
        "reaped before the grace period"
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    w.settle().await;
    let left = w.instance_ids();
    assert!(!left.contains(&stray), "stray survived the grace period");
    assert!(
        left.contains(&foreign) && left.contains(&untagged),
        "touched an instance that is not ours"
    );
    assert!(w.store.strays().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn harvest_modes_decide_which_strays_go() {
    let w = world(&[
        ("harvest-grace", "0s"),
        ("harvest-interval", "1s"),
        ("harvest-mode", "none"),
    ]);
    let m = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    agent(
        &w,
        Caller::Machine(m),
        AgentOp::EnsureDeadMachine { machine: m },
    );
    // Removed behind the provisioner's back.
    agent(
        &w,
        Caller::Controller,
        AgentOp::RemoveMachine { machine: m },
    );
    let unknown = w.cloud.start_raw(w.tags(Some(UUID), "999")).unwrap();
    let destroyed = w
        .cloud
        .all_instances()
        .unwrap()
        .into_iter()
        .find(|i| i.machine_id() == Some("1"))
        .unwrap()
        .id;
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    let classes: BTreeMap<String, String> = w
        .store
        .strays()
        .unwrap()
        .into_iter()
        .map(|s| (s.instance_id, s.class))
        .collect();
    assert_eq!(classes[&unknown], "unknown");
    assert_eq!(classes[&destroyed], "destroyed");
    assert!(
        w.store
            .strays()
            .unwrap()
            .iter()
            .all(|s| s.reap_at.is_none()),
        "mode none reaps nothing"
    );
    assert_eq!(w.cloud.all_instances().unwrap().len(), 3);
    w.set(&[("harvest-mode", "destroyed")]);
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    let left = w.instance_ids();
    assert!(!left.contains(&destroyed) && left.contains(&unknown));
    w.set(&[("harvest-mode", "unknown")]);
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    assert!(!w
        .cloud
        .all_instances()
        .unwrap()
        .iter()
        .any(|i| i.id == unknown));
}

#[tokio::test(start_paused = true)]
async fn reaping_is_capped_per_pass() {
    let w = world(&[
        ("harvest-grace", "0s"),
        ("harvest-interval", "1s"),
        ("harvest-max-per-pass", "2"),
    ]);
    w.settle().await;
    for i in 0..5 {
        w.cloud
            .start_raw(w.tags(Some(UUID), &format!("90{i}")))
            .unwrap();
    }
    tokio::time::advance(Duration::from_secs(2)).await;
    w.p.reconcile().await.unwrap();
    assert_eq!(
        w.cloud.all_instances().unwrap().len(),
        1 + 3,
        "one pass reaps at most 2"
    );
    w.settle().await;
    assert_eq!(w.cloud.all_instances().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_client_side_limiter_paces_requests() {
    let w = world(&[("provisioner-rate", "1/1"), ("provisioner-batch", "1")]);
    w.store.add_machines(5, None, None).unwrap();
    let t0 = Instant::now();
    w.settle().await;
    // Six start requests at one per second (one token in the bucket at the start).
    assert!(t0.elapsed() >= Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(w.cloud.all_instances().unwrap().len(), 6);
}

#[tokio::test(start_paused = true)]
async fn run_reacts_to_changes_and_stops_cleanly() {
    let w = world(&[]);
    let (stop_tx, stop_rx) = watch::channel(false);
    let p = w.p.clone();
    let task = tokio::spawn(async move { p.run(stop_rx).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    w.store.add_machines(2, None, None).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(w.store.machine(2).unwrap().instance_id.is_some());
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
}

/// A stream of commits (a machine added every millisecond, and each
/// start's record) is taken by few passes, spaced from the last by
/// `PASS_SPACING`, and still provisions every machine soon after.
#[tokio::test(start_paused = true)]
async fn passes_a_stream_of_changes_asks_for_are_spaced() {
    let w = world(&[]);
    let (stop_tx, stop_rx) = watch::channel(false);
    let p = w.p.clone();
    let task = tokio::spawn(async move { p.run(stop_rx).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let before = w.p.passes();
    for _ in 0..200 {
        w.store.add_machines(1, None, None).unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(PASS_SPACING * 3).await;
    let passes = w.p.passes() - before;
    // 200 ms of changes, a pass at most every 50 ms (and one more for the
    // records of the last starts).
    assert!(passes <= 7, "{passes} passes");
    for id in 1..=200 {
        assert!(
            w.store.machine(id).unwrap().instance_id.is_some(),
            "machine {id} has no instance"
        );
    }
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
}

#[test]
fn bad_config_is_refused_with_the_key_named() {
    let c = |k: &str, v: &str| {
        Config::from_env(&[(k.to_string(), v.to_string())].into_iter().collect())
    };
    assert_eq!(
        c("harvest-mode", "some").unwrap_err().to_string(),
        "invalid provisioner config: `harvest-mode=some`: use none, destroyed, unknown or all"
    );
    assert!(c("harvest-grace", "soon").is_err());
    // Past what the harvest can add to a time (it wrapped to a negative
    // grace and reaped strays at once).
    assert_eq!(
        c("harvest-grace", "9223372036854775s").unwrap_err().to_string(),
        "invalid provisioner config: `harvest-grace=9223372036854775s`: use a duration such as `30s` or `5m`, at most 87600h (ten years)"
    );
    assert!(c("provisioner-concurrency", "0").is_err());
    assert!(c("provisioner-typo", "1").is_err());
    assert_eq!(
        c("harvest-grace", "90s").unwrap().grace,
        Duration::from_secs(90)
    );
}

/// The dummy cloud, seen through a provider that prefers one machine per
/// start call (as LXD does), counting the calls' sizes.
struct OnePerCall {
    cloud: Arc<DummyProvider>,
    sizes: Mutex<Vec<usize>>,
}

#[async_trait::async_trait]
impl Provider for OnePerCall {
    fn kind(&self) -> &'static str {
        "dummy"
    }
    fn preferred_batch(&self) -> usize {
        1
    }
    async fn start_instance(&self, spec: &StartSpec) -> jujube_providers::Result<Instance> {
        self.cloud.start_instance(spec).await
    }
    async fn start_instances(
        &self,
        specs: &[StartSpec],
    ) -> Vec<jujube_providers::Result<Instance>> {
        lock(&self.sizes).push(specs.len());
        self.cloud.start_instances(specs).await
    }
    async fn stop_instances(&self, ids: &[String]) -> jujube_providers::Result<()> {
        self.cloud.stop_instances(ids).await
    }
    async fn instances(&self) -> jujube_providers::Result<Vec<Instance>> {
        self.cloud.instances().await
    }
    async fn instances_by_id(&self, ids: &[String]) -> jujube_providers::Result<Vec<Instance>> {
        self.cloud.instances_by_id(ids).await
    }
    async fn zones(&self) -> jujube_providers::Result<Vec<String>> {
        self.cloud.zones().await
    }
    async fn validate_constraints(&self, cons: &Constraints) -> jujube_providers::Result<()> {
        self.cloud.validate_constraints(cons).await
    }
}

#[tokio::test(start_paused = true)]
async fn the_providers_preferred_batch_applies_unless_the_config_names_one() {
    let w = world(&[]);
    let one = Arc::new(OnePerCall {
        cloud: w.cloud.clone(),
        sizes: Mutex::new(Vec::new()),
    });
    let p = Provisioner::new(w.store.clone(), one.clone()).unwrap();
    w.store.add_machines(5, None, None).unwrap();
    p.reconcile().await.unwrap();
    p.idle().await;
    // Machine 0 and the five.
    assert_eq!(*lock(&one.sizes), vec![1; 6], "one machine per call");
    // The config wins over the provider's preference (machines in one
    // zone: a launch batch is one zone's).
    w.set(&[("provisioner-batch", "4")]);
    lock(&one.sizes).clear();
    let one_zone = Constraints::parse("zones=zone-a").unwrap();
    w.store.add_machines(8, None, Some(&one_zone)).unwrap();
    p.reconcile().await.unwrap();
    p.idle().await;
    assert_eq!(*lock(&one.sizes), vec![4, 4]);
    assert_eq!(w.cloud.all_instances().unwrap().len(), 14);
}

// ---- limits and shutdown (issue: machines silently stuck, shutdown that hangs)

/// The dummy cloud behind a provider that counts start requests in flight
/// (keeping the peak) and can be made to fail its zone listing.
struct Counting {
    cloud: Arc<DummyProvider>,
    in_flight: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
    zones_fail: std::sync::atomic::AtomicBool,
    zones_asked: std::sync::atomic::AtomicUsize,
}

impl Counting {
    fn new(cloud: Arc<DummyProvider>) -> Arc<Counting> {
        Arc::new(Counting {
            cloud,
            in_flight: Default::default(),
            peak: Default::default(),
            zones_fail: Default::default(),
            zones_asked: Default::default(),
        })
    }
    fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl Provider for Counting {
    fn kind(&self) -> &'static str {
        "dummy"
    }
    async fn start_instance(&self, spec: &StartSpec) -> jujube_providers::Result<Instance> {
        self.start_instances(std::slice::from_ref(spec))
            .await
            .pop()
            .unwrap()
    }
    async fn start_instances(
        &self,
        specs: &[StartSpec],
    ) -> Vec<jujube_providers::Result<Instance>> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.peak.fetch_max(now, SeqCst);
        let r = self.cloud.start_instances(specs).await;
        self.in_flight.fetch_sub(1, SeqCst);
        r
    }
    async fn stop_instances(&self, ids: &[String]) -> jujube_providers::Result<()> {
        self.cloud.stop_instances(ids).await
    }
    async fn instances(&self) -> jujube_providers::Result<Vec<Instance>> {
        self.cloud.instances().await
    }
    async fn instances_by_id(&self, ids: &[String]) -> jujube_providers::Result<Vec<Instance>> {
        self.cloud.instances_by_id(ids).await
    }
    async fn zones(&self) -> jujube_providers::Result<Vec<String>> {
        self.zones_asked
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.zones_fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(jujube_providers::Error::Transient(
                "connection refused".into(),
            ));
        }
        self.cloud.zones().await
    }
    async fn validate_constraints(&self, cons: &Constraints) -> jujube_providers::Result<()> {
        self.cloud.validate_constraints(cons).await
    }
    async fn update_config(
        &self,
        config: &BTreeMap<String, String>,
    ) -> jujube_providers::Result<()> {
        self.cloud.update_config(config).await
    }
}

#[test]
fn a_rate_that_never_refills_is_refused() {
    let c = |v: &str| {
        Config::from_env(
            &[("provisioner-rate".to_string(), v.to_string())]
                .into_iter()
                .collect(),
        )
    };
    assert_eq!(
        c("1/0").unwrap_err().to_string(),
        "invalid provisioner config: `provisioner-rate=1/0`: the refill rate must be above 0 (a bucket that never refills stops provisioning for good); use e.g. `5/2`, or remove the key for no limit"
    );
    assert!(c("5/0.0").is_err());
    assert_eq!(c("5/0.5").unwrap().rate.as_deref(), Some("5/0.5"));
}

#[tokio::test(start_paused = true)]
async fn starts_waiting_on_the_limiter_follow_a_rate_change_at_once() {
    // One token, then one every 1,000 s: two of the three starts wait.
    let w = world(&[("provisioner-rate", "1/0.001"), ("provisioner-batch", "1")]);
    w.store.add_machines(2, None, None).unwrap();
    let t0 = Instant::now();
    w.p.reconcile().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(w.cloud.all_instances().unwrap().len(), 1);
    // The waiting starts must not keep the old bucket.
    w.set(&[("provisioner-rate", "100/10")]);
    w.p.reconcile().await.unwrap();
    w.p.idle().await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the waiting starts kept the old rate: {:?}",
        t0.elapsed()
    );
    for id in 0..3 {
        assert_eq!(w.instances_of(id), 1, "machine {id}");
    }
}

#[tokio::test(start_paused = true)]
async fn machines_sharing_type_image_and_zone_launch_in_one_request_per_batch() {
    let w = world(&[("provisioner-batch", "8")]);
    let one_zone = Constraints::parse("zones=zone-b").unwrap();
    let ids = w.store.add_machines(20, None, Some(&one_zone)).unwrap();
    w.settle().await;
    // Machine 0 alone, then the 20 in batches of 8, 8 and 4.
    assert_eq!(w.cloud.api_stats().run_instances, 4);
    let mut batches = BTreeMap::new();
    for id in &ids {
        let m = w.store.machine(*id).unwrap();
        assert_eq!(m.zone.as_deref(), Some("zone-b"));
        assert_eq!(w.instances_of(*id), 1, "machine {id}");
        let (batch, index) = jujube_providers::launch_batch(m.nonce.as_deref().unwrap())
            .unwrap_or_else(|| panic!("machine {id} has a batch nonce: {:?}", m.nonce));
        batches
            .entry(batch.to_string())
            .or_insert_with(Vec::new)
            .push(index);
    }
    let mut sizes: Vec<Vec<u32>> = batches.into_values().collect();
    sizes.sort_by_key(|v| std::cmp::Reverse(v.len()));
    assert_eq!(
        sizes,
        vec![
            (0..8).collect::<Vec<u32>>(),
            (0..8).collect(),
            (0..4).collect()
        ]
    );
    // Machines spread over zones (`zones::Spread`: the emptiest first) are
    // batched per chosen zone: one request per zone used.
    let spread = w.store.add_machines(6, None, None).unwrap();
    w.settle().await;
    let mut used = std::collections::BTreeSet::new();
    for id in spread {
        assert_eq!(w.instances_of(id), 1);
        used.insert(w.store.machine(id).unwrap().zone.unwrap());
    }
    assert!(used.len() > 1, "{used:?}");
    assert_eq!(w.cloud.api_stats().run_instances, 4 + used.len() as u64);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_provisioner_re_forms_a_lost_batch_and_adopts_its_instances() {
    let w = world(&[]);
    let ids = w
        .store
        .add_machines(5, None, Some(&Constraints::parse("zones=zone-a").unwrap()))
        .unwrap();
    // The batch is committed and launched, then the process died before
    // recording anything.
    let prepared = w
        .store
        .prepare_batches(std::slice::from_ref(&ids), UUID)
        .unwrap();
    let specs: Vec<StartSpec> = prepared
        .iter()
        .map(|p| {
            let mut s = w.p.spec_for(&w.store.machine(p.machine).unwrap(), &p.nonce);
            s.zone = Some("zone-a".into());
            s
        })
        .collect();
    let launched: Vec<Instance> = w
        .cloud
        .start_instances(&specs)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(w.cloud.api_stats().run_instances, 1);
    let fresh = Provisioner::new(w.store.clone(), w.cloud.clone()).unwrap();
    fresh.reconcile().await.unwrap();
    fresh.idle().await;
    // Machine 0 is launched; the batch is adopted, not launched again.
    assert_eq!(w.cloud.api_stats().run_instances, 2);
    for (id, inst) in ids.iter().zip(&launched) {
        assert_eq!(
            w.store.machine(*id).unwrap().instance_id.as_ref(),
            Some(&inst.id)
        );
        assert_eq!(w.instances_of(*id), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_abandons_queued_starts_and_returns_within_one_call() {
    let w = world(&[
        ("provisioner-concurrency", "1"),
        ("provisioner-batch", "1"),
        ("dummy-start-latency", "2s"),
    ]);
    w.store.add_machines(8, None, None).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let p = w.p.clone();
    let task = tokio::spawn(async move { p.run(stop_rx).await });
    // Machine 0's start is done; machine 1's is in flight.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t0 = Instant::now();
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
    assert!(
        t0.elapsed() <= Duration::from_secs(2),
        "shutdown took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        w.cloud.all_instances().unwrap().len(),
        2,
        "the queued starts were abandoned"
    );
    // Nothing pretends to be under way; the nonces stay committed.
    for id in 2..=8 {
        let m = w.store.machine(id).unwrap();
        assert_eq!(m.status, machine_status::PENDING, "machine {id}");
        assert!(m.nonce.is_some(), "machine {id} keeps its nonce");
    }
    // The next controller resumes them: one instance each.
    let next = Provisioner::new(w.store.clone(), w.cloud.clone()).unwrap();
    for _ in 0..5 {
        next.reconcile().await.unwrap();
        next.idle().await;
    }
    for id in 0..=8 {
        assert_eq!(w.instances_of(id), 1, "machine {id}");
        assert!(w.store.machine(id).unwrap().instance_id.is_some());
    }
}

#[tokio::test(start_paused = true)]
async fn concurrency_is_one_limit_for_the_whole_controller() {
    let w = world(&[
        ("provisioner-concurrency", "1"),
        ("dummy-start-latency", "2s"),
    ]);
    let counting = Counting::new(w.cloud.clone());
    let p = Provisioner::new(w.store.clone(), counting.clone()).unwrap();
    // Four `add-machine` commands in a row, each seen by its own pass.
    for _ in 0..4 {
        w.store.add_machines(1, None, None).unwrap();
        p.reconcile().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.idle().await;
    assert_eq!(w.cloud.all_instances().unwrap().len(), 5);
    assert_eq!(counting.peak(), 1, "start requests in flight at once");
}

#[tokio::test(start_paused = true)]
async fn machines_are_provisioning_only_once_their_start_is_under_way() {
    let w = world(&[]);
    let counting = Counting::new(w.cloud.clone());
    counting
        .zones_fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let p = Provisioner::new(w.store.clone(), counting.clone()).unwrap();
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    assert!(
        p.reconcile().await.is_err(),
        "the pass fails when zones cannot be listed"
    );
    p.idle().await;
    for m in [0, id] {
        assert_eq!(
            w.store.machine(m).unwrap().status,
            machine_status::PENDING,
            "machine {m} is not being started"
        );
    }
    counting
        .zones_fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    p.reconcile().await.unwrap();
    p.idle().await;
    assert!(w.store.machine(id).unwrap().instance_id.is_some());
}

#[tokio::test(start_paused = true)]
async fn a_failed_pass_backs_off_whatever_changes_meanwhile_but_a_config_change() {
    use std::sync::atomic::Ordering::SeqCst;
    let w = world(&[]);
    let counting = Counting::new(w.cloud.clone());
    counting.zones_fail.store(true, SeqCst);
    let p = Provisioner::new(w.store.clone(), counting.clone()).unwrap();
    w.store.add_machines(1, None, None).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let run = tokio::spawn(async move { p.run(stop_rx).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let failed = counting.zones_asked.load(SeqCst);
    assert!(failed >= 1, "the first pass asked for the zones and failed");
    // A busy environment within the backoff (a second, then two): every
    // pass would fail again, and each re-reads every machine to start.
    for _ in 0..50 {
        w.store.add_machines(1, None, None).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        counting.zones_asked.load(SeqCst),
        failed,
        "passes during the backoff"
    );
    // The user changes the config (perhaps fixing the cause): a pass at once.
    counting.zones_fail.store(false, SeqCst);
    w.set(&[("harvest-grace", "1h")]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(counting.zones_asked.load(SeqCst) > failed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    for m in w.store.machines().unwrap() {
        assert!(m.instance_id.is_some(), "machine {} provisioned", m.id);
    }
    stop_tx.send_replace(true);
    run.await.unwrap().unwrap();
}

// ---- zones (issue: constraints the provisioner ignores)

#[tokio::test(start_paused = true)]
async fn capacity_errors_move_only_to_zones_the_constraints_allow() {
    let w = world(&[("dummy-full-zones", "zone-a")]);
    let only_a = w
        .store
        .add_machines(1, None, Some(&Constraints::parse("zones=zone-a").unwrap()))
        .unwrap()[0];
    let a_or_c = w
        .store
        .add_machines(
            1,
            None,
            Some(&Constraints::parse("zones=zone-a,zone-c").unwrap()),
        )
        .unwrap()[0];
    w.settle().await;
    let m = w.store.machine(only_a).unwrap();
    assert_eq!(
        w.instances_of(only_a),
        0,
        "started outside its zones: {m:?}"
    );
    assert_eq!(m.status, machine_status::ERROR);
    assert_eq!(
        m.status_info,
        format!("cannot start machine {only_a}: no capacity in the zones its constraints allow (`zones=zone-a`; tried zone-a): no capacity in zone `zone-a`: InsufficientInstanceCapacity")
    );
    let m = w.store.machine(a_or_c).unwrap();
    assert_eq!(m.zone.as_deref(), Some("zone-c"), "{}", m.status_info);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_zone_is_a_provisioning_error_naming_the_known_zones() {
    let w = world(&[]);
    let id = w
        .store
        .add_machines(1, None, Some(&Constraints::parse("zones=nowhere").unwrap()))
        .unwrap()[0];
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert_eq!(w.instances_of(id), 0, "started in {:?}", m.zone);
    assert_eq!(m.status, machine_status::ERROR);
    assert_eq!(
        m.status_info,
        format!("cannot start machine {id}: unknown zone `nowhere` in `zones=nowhere`; the provider's zones are `zone-a`, `zone-b`, `zone-c`; choose from them with `jujube resolved {id} --constraints zones=...`")
    );
}

fn deploy(w: &World, service: &str) {
    let charm = jujube_state::Charm {
        url: format!("local:jammy/{service}-1"),
        meta: jujube_core::charm::CharmMeta::parse(&format!("name: {service}\n")).unwrap(),
        config: Default::default(),
        actions: Default::default(),
        path: String::new(),
    };
    w.store
        .deploy(&jujube_state::services::DeployArgs {
            service: service.into(),
            charm,
            series: "jammy".into(),
            constraints: Constraints::default(),
            units: 1,
            to: None,
            settings: vec![],
        })
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_services_units_spread_over_zones_when_services_interleave() {
    let w = world(&[]);
    for s in ["a", "b", "c"] {
        deploy(&w, s);
    }
    // More units, one at a time: a, b, c, a, b, c.
    for _ in 0..2 {
        for s in ["a", "b", "c"] {
            w.store.add_units(s, 1, None).unwrap();
        }
    }
    w.settle().await;
    for s in ["a", "b", "c"] {
        let mut zones: Vec<String> = w
            .store
            .units_of(s)
            .unwrap()
            .iter()
            .map(|u| {
                w.store
                    .machine(u.machine_id.unwrap())
                    .unwrap()
                    .zone
                    .unwrap()
            })
            .collect();
        zones.sort();
        assert_eq!(zones, ["zone-a", "zone-b", "zone-c"], "service {s}");
    }
}

// ---- the cloud behind our back

#[tokio::test(start_paused = true)]
async fn an_instance_gone_behind_our_back_puts_its_machine_in_error_and_resolved_replaces_it() {
    let w = world(&[("harvest-interval", "10s")]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    let gone = m.instance_id.clone().unwrap();
    w.cloud
        .stop_instances(std::slice::from_ref(&gone))
        .await
        .unwrap();
    for _ in 0..2 {
        tokio::time::advance(Duration::from_secs(11)).await;
        w.settle().await;
    }
    let m = w.store.machine(id).unwrap();
    assert_eq!(m.status, machine_status::ERROR);
    assert_eq!(
        m.status_info,
        format!("instance `{gone}` is gone: the cloud no longer has it (stopped or terminated outside jujube); `jujube resolved {id}` starts a replacement")
    );
    assert_eq!(m.instance_id.as_deref(), Some(gone.as_str()), "still named");
    // Machine 0 was not touched.
    assert_eq!(w.store.machine(0).unwrap().status, machine_status::STARTED);
    // `resolved`: a replacement under a new nonce.
    w.store.resolve_machine(id, None).unwrap();
    w.settle().await;
    let r = w.store.machine(id).unwrap();
    let replacement = r.instance_id.clone().expect("a replacement");
    assert_ne!(replacement, gone);
    assert_ne!(r.nonce, m.nonce);
    assert_eq!(r.status, machine_status::STARTED);
    assert_eq!(w.instances_of(id), 1);
}

#[tokio::test(start_paused = true)]
async fn a_strays_grace_restarts_when_its_class_changes() {
    let w = world(&[
        ("harvest-mode", "all"),
        ("harvest-grace", "60s"),
        ("harvest-interval", "1s"),
        ("dummy-fail-machines", "1"),
    ]);
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    w.settle().await;
    let m = w.store.machine(id).unwrap();
    assert_eq!(m.status, machine_status::ERROR);
    // What a failed start left behind under the machine's nonce.
    let mut tags = w.tags(Some(UUID), &id.to_string());
    tags.insert(
        jujube_providers::TAG_NONCE.to_string(),
        m.nonce.clone().unwrap(),
    );
    let leftover = w.cloud.start_raw(tags).unwrap();
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    assert_eq!(w.store.strays().unwrap()[0].class, "errored");
    // Retried (and failing again) after 50 s: the leftover is now nobody's,
    // a new reason to reap it, with a grace of its own.
    tokio::time::advance(Duration::from_secs(50)).await;
    w.store.retry_provisioning(&[id]).unwrap();
    w.settle().await;
    assert_eq!(w.store.machine(id).unwrap().status, machine_status::ERROR);
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    assert_eq!(w.store.strays().unwrap()[0].class, "unknown");
    tokio::time::advance(Duration::from_secs(18)).await;
    w.settle().await;
    assert!(
        w.instance_ids().contains(&leftover),
        "reaped 20 s into its new class's 60 s grace"
    );
    tokio::time::advance(Duration::from_secs(45)).await;
    w.settle().await;
    assert!(!w.instance_ids().contains(&leftover));
}

#[tokio::test(start_paused = true)]
async fn an_instance_of_a_machine_being_started_is_never_reaped() {
    let w = world(&[
        ("harvest-grace", "0s"),
        ("harvest-interval", "1s"),
        ("dummy-start-latency", "30s"),
    ]);
    w.settle().await;
    let id = w.store.add_machines(1, None, None).unwrap()[0];
    // An earlier start's leftover of the machine (another nonce): on LXD it
    // would be the very container the start is making.
    let mut tags = w.tags(Some(UUID), &id.to_string());
    tags.insert(jujube_providers::TAG_NONCE.to_string(), "old".to_string());
    let leftover = w.cloud.start_raw(tags).unwrap();
    w.p.reconcile().await.unwrap(); // the start is now under way
    for _ in 0..10 {
        tokio::time::advance(Duration::from_secs(2)).await;
        w.p.reconcile().await.unwrap();
        assert!(
            w.instance_ids().contains(&leftover),
            "reaped while its machine was being started"
        );
    }
    w.p.idle().await;
    assert!(w.store.machine(id).unwrap().instance_id.is_some());
    tokio::time::advance(Duration::from_secs(2)).await;
    w.settle().await;
    assert!(!w.instance_ids().contains(&leftover), "reaped afterwards");
}

#[tokio::test(start_paused = true)]
async fn in_ec2_mode_the_dummy_charges_documented_buckets_and_launches_are_paced_not_throttled() {
    // 1,100 machines in batches of 100: past the 1,000-instance burst the
    // last launches wait for the refill (2 instances/s) instead of failing.
    let w = world(&[
        ("dummy-throttling", "ec2"),
        ("provisioner-batch", "100"),
        ("dummy-zones", "zone-a"),
        ("harvest-interval", "1h"),
    ]);
    let t0 = tokio::time::Instant::now();
    let ids = w.store.add_machines(1_100, None, None).unwrap();
    w.settle().await;
    let took = t0.elapsed();
    for id in [ids[0], ids[1_099]] {
        assert!(w.store.machine(id).unwrap().instance_id.is_some());
    }
    let s = w.cloud.api_stats();
    assert_eq!(s.throttled, 0, "{s:?}");
    // Machine 0 and 11 batches.
    assert_eq!(s.run_instances, 12);
    // 1,101 instances: 101 past the burst at 2/s.
    assert!(took >= Duration::from_secs(50), "{took:?}");
    assert!(took < Duration::from_secs(120), "{took:?}");
    // One CreateTags per batch member, paced at 5/s past a burst of 50.
    assert_eq!(s.create_tags, 1_100);
    let tags = s.tags_done_at.unwrap().duration_since(t0);
    assert!(tags >= Duration::from_secs(200), "{tags:?}");
}

mod restart;
