//! The agents at work: real machine and unit agents under a [`Host`], over
//! a real store and real directories, driven by the change feed. Waits are
//! on the feed (no sleeps), bounded by a generous timeout.

use super::*;
use crate::Host;
use jujube_core::Life;
use std::time::Duration;

/// Logs to the test's output when `RUST_LOG` asks for it.
pub(crate) fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Waits until `cond` holds, re-checking on every committed change.
pub(crate) async fn until(store: &Store, what: &str, cond: impl Fn(&Store) -> bool) {
    let mut watcher = store.watch(store.head_revision().unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !cond(store) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if tokio::time::timeout(left, watcher.next()).await.is_err() {
            panic!(
                "timed out waiting until {what}; status: {}",
                serde_json::to_string_pretty(&store.status().unwrap()).unwrap()
            );
        }
    }
}

fn life(store: &Store, unit: &str) -> Option<Life> {
    store.unit(unit).ok().map(|u| u.life)
}

fn status(store: &Store, unit: &str) -> String {
    store.unit(unit).map(|u| u.status).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_carry_the_whole_lifecycle_and_resume_after_a_restart() {
    logs();
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 2);
    w.deploy(MYSQL, "mysql", 1);
    w.deploy(LOGGING, "logging", 0);
    w.store.add_relation("wordpress", "mysql").unwrap();
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "every unit's agent started and joined", |s| {
        ["wordpress/0", "wordpress/1", "mysql/0"]
            .iter()
            .all(|u| status(s, u) == "started")
            && s.awaiting_agents(1).unwrap().is_empty()
    })
    .await;
    // Deployed: the machine's directory, the unit's with the charm copied in.
    let wp0 = agents_dir.join("machine-1/unit-wordpress-0");
    assert!(wp0.join("charm/metadata.yaml").is_file());
    assert!(wp0.join("agent.json").is_file());
    let m = w.store.machine(1).unwrap();
    assert_eq!(m.agent_status, "started");

    // A container relation: a subordinate under each principal, deployed
    // next to it by the principal's agent.
    w.store.add_relation("logging", "wordpress").unwrap();
    until(&w.store, "both subordinates started", |s| {
        ["logging/0", "logging/1"]
            .iter()
            .all(|u| status(s, u) == "started")
            && s.awaiting_agents(1).unwrap().is_empty()
    })
    .await;
    let mut principals: Vec<Option<String>> = ["logging/0", "logging/1"]
        .iter()
        .map(|u| w.store.unit(u).unwrap().principal)
        .collect();
    principals.sort();
    assert_eq!(
        principals,
        [Some("wordpress/0".into()), Some("wordpress/1".into())]
    );
    let sub0 = w.store.subordinates("wordpress/0").unwrap()[0].clone();
    let sub0_dir = agents_dir
        .join("machine-1")
        .join(jujube_agent::deployer::unit_dir_name(&sub0));
    let record = std::fs::read_to_string(sub0_dir.join("agent.json")).unwrap();
    assert!(
        record.contains("\"deployer\":{\"unit\":\"wordpress/0\"}"),
        "{record}"
    );

    // Restart the host mid-life: everything resumes from the directories.
    host.shutdown().await;
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();

    // Destroying the container relation: the subordinates set themselves
    // Dying, leave, are set Dead and removed by their principals' agents.
    w.store.destroy_relation("logging", "wordpress").unwrap();
    until(&w.store, "the subordinates are gone", |s| {
        life(s, "logging/0").is_none()
            && life(s, "logging/1").is_none()
            && s.relations()
                .unwrap()
                .iter()
                .all(|r| !r.key.contains("logging"))
    })
    .await;
    assert!(!sub0_dir.exists());
    assert_eq!(w.store.service("logging").unwrap().life, Life::Alive);

    // destroy-service: units Dying → Dead → removed, and the service with
    // the last reference, its relation with mysql too.
    w.store.destroy_service("wordpress").unwrap();
    until(&w.store, "wordpress is removed", |s| {
        s.service("wordpress").is_err()
    })
    .await;
    assert!(w
        .store
        .relations()
        .unwrap()
        .iter()
        .all(|r| !r.key.contains("wordpress")));
    assert!(!wp0.exists(), "recalled");

    // destroy-machine: the machine agent sets it Dead (the provisioner's
    // part, stopping and removing, is not running here).
    tracing::info!("destroying machines");
    w.store.destroy_machines(&[1, 2]).unwrap();
    until(&w.store, "machines 1 and 2 are dead", |s| {
        [1, 2]
            .iter()
            .all(|&m| s.machine(m).unwrap().life == Life::Dead)
    })
    .await;
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subordinate_whose_principal_is_destroyed_goes_first() {
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 1);
    w.deploy(LOGGING, "logging", 0);
    w.store.add_relation("logging", "wordpress").unwrap();
    w.provision();
    let host = Host::start(w.store.clone(), w.dir.path().join("agents")).unwrap();
    until(&w.store, "logging/0 started", |s| {
        status(s, "logging/0") == "started"
    })
    .await;
    w.store.destroy_units(&["wordpress/0".into()]).unwrap();
    until(&w.store, "both units are gone", |s| {
        life(s, "wordpress/0").is_none() && life(s, "logging/0").is_none()
    })
    .await;
    // The relation and both services stay: only units went.
    assert_eq!(w.store.service("logging").unwrap().life, Life::Alive);
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_agent_recalls_a_deployed_unit_no_longer_assigned_to_it() {
    let w = World::new();
    // No peer relation: the unit is in no scope, so it can be set Dead.
    w.deploy(MYSQL, "mysql", 1);
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "mysql/0 started", |s| {
        status(s, "mysql/0") == "started"
    })
    .await;
    host.shutdown().await;
    let db0 = agents_dir.join("machine-1/unit-mysql-0");
    assert!(db0.join("agent.json").is_file());

    // While no agent runs, the unit leaves the machine's view for good
    // (Dying, Dead and removed, as its deployer would): what is left under
    // the machine's directory is a deployment nobody assigned.
    w.store.destroy_units(&["mysql/0".into()]).unwrap();
    w.apply(
        Caller::Machine(1),
        AgentOp::EnsureDeadUnit {
            unit: "mysql/0".into(),
        },
    );
    w.apply(
        Caller::Machine(1),
        AgentOp::RemoveUnit {
            unit: "mysql/0".into(),
        },
    );
    assert!(db0.is_dir());

    // The restarted machine agent recalls it; only then, with nothing left
    // deployed, does it set its Dying machine Dead.
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    w.store.destroy_machines(&[1]).unwrap();
    until(&w.store, "machine 1 is dead", |s| {
        s.machine(1).unwrap().life == Life::Dead
    })
    .await;
    assert!(!db0.exists(), "the unassigned deployment was recalled");
    host.shutdown().await;
}

/// One pass at a time in the whole process: the bound only orders the
/// agents' passes, it never stops a duty — principals wait (across passes)
/// for their subordinates to be removed, deployers recall from inside
/// their passes, and everything destroyed still goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_go_through_their_whole_lifecycle_one_pass_at_a_time() {
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 2);
    w.deploy(LOGGING, "logging", 0);
    w.store.add_relation("logging", "wordpress").unwrap();
    w.provision();
    let host = Host::start_bounded(
        w.store.clone(),
        w.dir.path().join("agents"),
        crate::Mode::InProcess,
        1,
    )
    .unwrap();
    until(&w.store, "both subordinates started", |s| {
        ["logging/0", "logging/1"]
            .iter()
            .all(|u| status(s, u) == "started")
    })
    .await;
    w.store.destroy_service("wordpress").unwrap();
    until(&w.store, "wordpress and its subordinates are gone", |s| {
        s.service("wordpress").is_err() && s.units_of("logging").unwrap().is_empty()
    })
    .await;
    host.shutdown().await;
}

/// An idle agent has no task: its state is parked until something it
/// watches changes, which spawns one (a task each — its 128-byte cell, its
/// boxed future, its own stop flag — was three fifths of what 200,000 idle
/// agents kept). Parked agents still wake for every change and for a stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_agents_are_parked_without_a_task_and_wake_for_changes() {
    logs();
    let w = World::new();
    let units = w.deploy(WORDPRESS, "wordpress", 4);
    w.provision();
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let host = Host::start(w.store.clone(), w.dir.path().join("agents")).unwrap();
    until(&w.store, "every unit's agent started", |s| {
        units.iter().all(|u| status(s, u) == "started")
    })
    .await;
    // A task's end is no event anyone can wait on (an agent's task
    // signals its end just before it returns): this polls, bounded.
    let settles_to = |tasks: usize, what: &'static str| {
        let metrics = metrics.clone();
        async move {
            let settled = async {
                while metrics.num_alive_tasks() > tasks {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            if tokio::time::timeout(Duration::from_secs(30), settled)
                .await
                .is_err()
            {
                panic!(
                    "{} tasks alive {what} (before the host: {before})",
                    metrics.num_alive_tasks()
                );
            }
        }
    };
    // Eight agents; once they are idle only the host's two tasks (its
    // machine watcher and the change router) remain.
    settles_to(before + 2, "with every agent idle").await;
    // A change wakes them: the units go Dying, Dead, and are removed.
    w.store.destroy_service("wordpress").unwrap();
    until(&w.store, "the units are gone", |s| {
        units.iter().all(|u| life(s, u).is_none())
    })
    .await;
    for u in &units {
        assert!(
            !w.dir
                .path()
                .join("agents/machine-1")
                .join(jujube_agent::deployer::unit_dir_name(u))
                .exists(),
            "{u} recalled"
        );
    }
    // A stop reaches parked agents too: the shutdown waits for each.
    host.shutdown().await;
    settles_to(before, "after the host's shutdown").await;
}

/// Writes an executable hook `name` into the deployed charm `charm`.
fn hook(w: &World, charm: &str, name: &str, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    let path = w
        .dir
        .path()
        .join("charms")
        .join(charm)
        .join("hooks")
        .join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolved_without_retry_counts_a_failed_config_changed_done() {
    logs();
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    hook(
        &w,
        "mysql",
        "config-changed",
        "echo ran >> ../config-changed.runs; exit 1",
    );
    hook(&w, "mysql", "start", "touch ../started");
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "config-changed failed", |s| {
        status(s, "mysql/0") == "error"
    })
    .await;
    w.store.resolve_unit("mysql/0", false).unwrap();
    let unit = agents_dir.join("machine-1/unit-mysql-0");
    let runs = unit.join("config-changed.runs");
    until(
        &w.store,
        "the unit started, or config-changed ran again",
        |s| {
            status(s, "mysql/0") == "started"
                || std::fs::read_to_string(&runs)
                    .unwrap_or_default()
                    .lines()
                    .count()
                    > 1
        },
    )
    .await;
    assert_eq!(
        status(&w.store, "mysql/0"),
        "started",
        "held again: config-changed ran again"
    );
    assert_eq!(
        std::fs::read_to_string(unit.join("config-changed.runs")).unwrap(),
        "ran\n"
    );
    assert!(unit.join("started").is_file(), "start ran after it");
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_held_by_a_failed_hook_still_removes_its_dead_subordinate() {
    logs();
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 1);
    w.deploy(MYSQL, "mysql", 1);
    w.deploy(LOGGING, "logging", 0);
    hook(&w, "wordpress", "db-relation-joined", "exit 1");
    w.store.add_relation("logging", "wordpress").unwrap();
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "the subordinate started", |s| {
        status(s, "logging/0") == "started" && status(s, "wordpress/0") == "started"
    })
    .await;
    w.store.add_relation("wordpress", "mysql").unwrap();
    until(&w.store, "the principal held by its failed hook", |s| {
        status(s, "wordpress/0") == "error"
    })
    .await;
    // The subordinate goes Dying, then Dead by its own agent; recalling and
    // removing it is its principal's deployer's duty, which needs no hook.
    w.store.destroy_relation("logging", "wordpress").unwrap();
    until(&w.store, "the subordinate removed", |s| {
        life(s, "logging/0").is_none()
    })
    .await;
    assert_eq!(
        status(&w.store, "wordpress/0"),
        "error",
        "still held until resolved"
    );
    host.shutdown().await;
}

/// A second subordinate, related to wordpress and to logging (both
/// container-scoped).
const MONITOR: &str = "name: monitor\nsummary: monitors\nsubordinate: true\nrequires:\n  juju-info:\n    interface: juju-info\n    scope: container\n  logs:\n    interface: logs\n    scope: container\n";
const LOGGING_WITH_LOGS: &str = "name: logging\nsummary: logs\nsubordinate: true\nrequires:\n  juju-info:\n    interface: juju-info\n    scope: container\nprovides:\n  logs:\n    interface: logs\n    scope: container\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_subordinates_of_one_principal_join_their_container_relation() {
    logs();
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 2);
    w.deploy(LOGGING_WITH_LOGS, "logging", 0);
    w.deploy(MONITOR, "monitor", 0);
    w.store
        .add_relation("logging:juju-info", "wordpress")
        .unwrap();
    w.store
        .add_relation("monitor:juju-info", "wordpress")
        .unwrap();
    w.store
        .add_relation("monitor:logs", "logging:logs")
        .unwrap();
    let logs_rel = w.relation_id("monitor:logs logging:logs");
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(
        &w.store,
        "each subordinate in the scope with its neighbour",
        |s| {
            let subs =
                |p: &str| -> Vec<String> { s.subordinates(p).unwrap().into_iter().collect() };
            ["wordpress/0", "wordpress/1"].iter().all(|p| {
                let subs = subs(p);
                subs.len() == 2
                    && subs.iter().all(|u| {
                        s.scope_units_seen_by(logs_rel, u, None)
                            .map(|seen| seen.len() == 1)
                            .unwrap_or(false)
                    })
            })
        },
    )
    .await;
    // Each sees exactly the other subordinate of its own principal.
    for p in ["wordpress/0", "wordpress/1"] {
        let subs = w.store.subordinates(p).unwrap();
        for u in &subs {
            let seen = w.store.scope_units_seen_by(logs_rel, u, None).unwrap();
            let other: Vec<String> = subs.iter().filter(|x| *x != u).cloned().collect();
            assert_eq!(seen, other, "{u} under {p}");
        }
    }
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_timeout_counts_the_time_it_waited_behind_hooks() {
    logs();
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    let late = w
        .store
        .queue_run(
            "mysql/0",
            &["sh".into(), "-c".into(), "touch ../late".into()],
            60,
        )
        .unwrap();
    // It waited 100 s behind a hook (aged here rather than waited for).
    let db = rusqlite::Connection::open(w.dir.path().join("state.db")).unwrap();
    db.execute(
        "UPDATE runs SET queued = queued - 100 WHERE id = ?1",
        [late],
    )
    .unwrap();
    let fresh = w
        .store
        .queue_run(
            "mysql/0",
            &["sh".into(), "-c".into(), "touch ../fresh".into()],
            60,
        )
        .unwrap();
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "both runs answered", |s| {
        s.run_result(late).unwrap().is_some() && s.run_result(fresh).unwrap().is_some()
    })
    .await;
    let answer = w.store.run_result(late).unwrap().unwrap();
    assert_eq!(answer.code, -1, "{answer:?}");
    assert!(
        answer
            .stderr
            .contains("did not start within its 60s timeout"),
        "{answer:?}"
    );
    assert_eq!(w.store.run_result(fresh).unwrap().unwrap().code, 0);
    let unit = agents_dir.join("machine-1/unit-mysql-0");
    assert!(
        !unit.join("late").exists(),
        "a run past its timeout must not run"
    );
    assert!(unit.join("fresh").exists());
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_cannot_run_says_so_in_the_units_log() {
    logs();
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    let path = w.dir.path().join("charms/mysql/hooks/install");
    std::fs::write(&path, "#!/bin/sh\n").unwrap();
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "install failed", |s| {
        status(s, "mysql/0") == "error"
    })
    .await;
    let log = std::fs::read_to_string(agents_dir.join("machine-1/logs/unit-mysql-0.log")).unwrap();
    assert!(
        log.contains(
            "ERROR hook \"install\" is not executable; `chmod +x hooks/install` in the charm"
        ),
        "{log}"
    );
    host.shutdown().await;
}

/// The lines of a file a hook appends to (none yet: empty).
fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Waits, bounded, until `cond` holds of what hooks wrote (files, which
/// the feed does not tell of).
async fn until_files(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A unit joining six remote units has twelve relation hooks to run in
/// one pass. Stopped during the first, its agent runs no more of them:
/// the stop does not wait for the whole pass. Started again, it runs the
/// rest, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_leaves_the_rest_of_its_pass_to_its_next_start() {
    logs();
    let w = World::new();
    w.deploy(WORDPRESS, "wordpress", 1);
    hook(
        &w,
        "wordpress",
        "db-relation-joined",
        "echo $JUJU_REMOTE_UNIT >> ../joined; sleep 0.3",
    );
    hook(
        &w,
        "wordpress",
        "db-relation-changed",
        "echo $JUJU_REMOTE_UNIT >> ../changed",
    );
    w.provision();
    // mysql's units have no agent (their machines no instance): they are
    // in the relation's scope, with settings, before wordpress/0 starts.
    let remote = w.deploy(MYSQL, "mysql", 6);
    w.store.add_relation("wordpress", "mysql").unwrap();
    let db = w.relation_id("wordpress:db mysql:db");
    for u in &remote {
        w.apply(
            Caller::Unit(u.clone()),
            AgentOp::SetUnitStatus {
                unit: u.clone(),
                status: "started".into(),
                info: String::new(),
            },
        );
        w.apply(
            Caller::Unit(u.clone()),
            AgentOp::EnterScope {
                relation: db,
                unit: u.clone(),
                settings: vec![("host".into(), u.clone())],
            },
        );
    }
    let agents_dir = w.dir.path().join("agents");
    let unit = agents_dir.join("machine-1/unit-wordpress-0");
    let (joined, changed) = (unit.join("joined"), unit.join("changed"));
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until_files("the first -joined runs", || !lines(&joined).is_empty()).await;
    host.shutdown().await;
    let ran = lines(&joined).len() + lines(&changed).len();
    // The hook running when the stop came (and, were the stop slow to
    // arrive, the one after it); each takes 0.3 s.
    assert!(
        ran <= 2,
        "{ran} of 12 hooks ran before the agent stopped: {:?}",
        lines(&joined)
    );

    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until_files("every remote unit joined and changed", || {
        lines(&changed).len() >= remote.len()
    })
    .await;
    host.shutdown().await;
    let mut want = remote.clone();
    want.sort();
    for file in [&joined, &changed] {
        let mut got = lines(file);
        got.sort();
        assert_eq!(got, want, "{}", file.display());
    }
}

/// A pass that fails for something other than a hook (here the unit's
/// hook journal cannot be written) is not a failed hook: the unit is
/// `failed`, not `error` — nothing for `resolved`, and `wait` names it as
/// retrying, with why — and its agent goes on by itself once the cause is
/// gone, without running the hook again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pass_is_retried_and_never_taken_for_a_failed_hook() {
    logs();
    let w = World::new();
    // The journal holds the save made before the hook ran: replaced by a
    // directory, the save after it fails.
    let unit = mysql_whose_install_then(&w, "rm ../hooks.journal && mkdir ../hooks.journal");
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "the unit's pass failed", |s| {
        ["failed", "error"].contains(&status(s, "mysql/0").as_str())
    })
    .await;
    let u = w.store.unit("mysql/0").unwrap();
    assert_eq!(u.status, "failed", "{}", u.status_info);
    assert!(
        u.status_info.contains("hooks.journal`: Is a directory"),
        "{}",
        u.status_info
    );
    assert!(w.store.units_in_error(10).unwrap().is_empty());
    assert!(w.store.resolve_unit("mysql/0", true).is_err());
    let awaited = w.store.awaiting_agents(10).unwrap();
    assert!(
        awaited
            .iter()
            .any(|a| a.starts_with("the agent of unit `mysql/0` failed and tries again: ")),
        "{awaited:?}"
    );
    std::fs::remove_dir(unit.join("hooks.journal")).unwrap();
    until(&w.store, "the unit started", |s| {
        status(s, "mysql/0") == "started"
    })
    .await;
    assert_ran_once(&unit);
    host.shutdown().await;
}

/// Agents killed in a hook (their controller killed with -9) leave their
/// unit `started` in the store; the hook record says the hook is running.
/// Once a new host starts, `wait` waits for the unit until its new agent
/// has reported the hook failed: what the dead agent said is never taken
/// as settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_whose_agent_died_in_a_hook_is_waited_for_until_it_reports_the_failure() {
    logs();
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "the unit started", |s| {
        status(s, "mysql/0") == "started" && s.awaiting_agents(1).unwrap().is_empty()
    })
    .await;
    host.shutdown().await;
    // As a kill in the middle of config-changed leaves it.
    let unit = agents_dir.join("machine-1/unit-mysql-0");
    let mut record = jujube_agent::hooks::state::HookState::read(&unit).unwrap();
    record.running = Some(Box::new(jujube_agent::hooks::state::HookRecord {
        name: "config-changed".into(),
        relation: None,
        remote: None,
    }));
    record.save(&unit).unwrap();

    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "nothing is awaited", |s| {
        s.awaiting_agents(1).unwrap().is_empty()
    })
    .await;
    let u = w.store.unit("mysql/0").unwrap();
    assert_eq!(
        (u.status.as_str(), u.status_info.as_str()),
        ("error", "hook failed: \"config-changed\"")
    );
    host.shutdown().await;
}

/// mysql/0 (provisioned), whose install hook counts its runs in the
/// unit's directory, then runs `then`. The unit's directory.
fn mysql_whose_install_then(w: &World, then: &str) -> std::path::PathBuf {
    w.deploy(MYSQL, "mysql", 1);
    hook(
        w,
        "mysql",
        "install",
        &format!("echo installing; echo ran >> ../install.runs; {then}"),
    );
    w.provision();
    w.dir.path().join("agents/machine-1/unit-mysql-0")
}

#[track_caller]
fn assert_ran_once(unit: &std::path::Path) {
    assert_eq!(
        std::fs::read_to_string(unit.join("install.runs")).unwrap(),
        "ran\n"
    );
}

/// A hook that ran is never run again because its output could not be
/// marked shipped (`log.shipped` cannot be written): shipping is tried
/// again after the next hook, and the unit goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_cannot_be_marked_shipped_runs_no_hook_twice() {
    logs();
    let w = World::new();
    let unit = mysql_whose_install_then(&w, "mkdir ../log.shipped");
    let agents_dir = w.dir.path().join("agents");
    let facades = crate::Facades::new(w.store.clone()).unwrap();
    let logs_dir = w.dir.path().join("logs");
    std::fs::create_dir_all(&logs_dir).unwrap();
    facades.keep_logs(Arc::new(crate::logsink::LogSink::open(&logs_dir).unwrap()));
    let host = Host::on(
        &facades,
        w.store.clone(),
        agents_dir.clone(),
        crate::Mode::InProcess,
    )
    .unwrap();
    until(&w.store, "the unit started, or its pass failed", |s| {
        ["started", "failed"].contains(&status(s, "mysql/0").as_str())
    })
    .await;
    host.shutdown().await;
    assert_eq!(status(&w.store, "mysql/0"), "started");
    assert_ran_once(&unit);
}

fn set_update_status_interval(w: &World, interval: &str) {
    w.store
        .set_environment_config(&[("update-status-hook-interval".into(), interval.into())])
        .unwrap();
}

/// One mysql unit whose `update-status` hook appends to `hooks.log`, at
/// `interval`; not yet provisioned.
fn update_status_world(interval: &str) -> World {
    logs();
    let w = World::new();
    w.deploy(MYSQL, "mysql", 1);
    hook(
        &w,
        "mysql",
        "update-status",
        "echo update-status >> ../hooks.log",
    );
    set_update_status_interval(&w, interval);
    w
}

/// update-status runs on a started unit every `update-status-hook-interval`
/// (here a second, drawn from 0.8 to 1.2 s), never before its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_status_runs_every_interval_once_the_unit_started() {
    let w = update_status_world("1s");
    hook(&w, "mysql", "start", "echo start >> ../hooks.log");
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    let log = agents_dir.join("machine-1/unit-mysql-0/hooks.log");
    until_files("update-status ran three times", || {
        lines(&log).iter().filter(|l| *l == "update-status").count() >= 3
    })
    .await;
    let ran = lines(&log);
    assert_eq!(ran[0], "start", "{ran:?}");
    assert_eq!(ran.iter().filter(|l| *l == "start").count(), 1, "{ran:?}");
    host.shutdown().await;
}

/// A shorter `update-status-hook-interval` reaches a started unit at once,
/// as Juju's uniter resets its timer: a unit waiting out an hour runs
/// update-status within the new second, not at the hour's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_update_status_interval_reaches_a_waiting_unit() {
    let w = update_status_world("60m");
    w.provision();
    let agents_dir = w.dir.path().join("agents");
    let host = Host::start(w.store.clone(), agents_dir.clone()).unwrap();
    until(&w.store, "the unit started", |s| {
        status(s, "mysql/0") == "started"
    })
    .await;
    let log = agents_dir.join("machine-1/unit-mysql-0/hooks.log");
    assert!(lines(&log).is_empty(), "{:?}", lines(&log));
    set_update_status_interval(&w, "1s");
    until_files("update-status ran after the interval was shortened", || {
        lines(&log).iter().any(|l| l == "update-status")
    })
    .await;
    host.shutdown().await;
}
