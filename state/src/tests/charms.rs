//! What today's charms write beyond their unit's own settings: application
//! and leader bags (who may read and write them, their bounds), and actions
//! (checked before they are queued, answered once, kept within a bound).

use super::*;
use crate::bags::Bag;
use crate::{AgentOp, Caller};
use std::collections::BTreeMap;

fn update(e: &Env, unit: &str, bag: Bag, changes: &[(&str, Option<&str>)]) -> crate::Result<()> {
    let changes = changes
        .iter()
        .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
        .collect();
    e.st.apply(
        &Caller::Unit(unit.into()),
        &AgentOp::UpdateBag {
            unit: unit.into(),
            bag,
            changes,
        },
    )
}

fn app(relation: i64, service: &str) -> Bag {
    Bag::App {
        relation,
        service: service.into(),
    }
}

#[test]
fn only_the_leader_writes_its_applications_bags_and_the_right_units_read_them() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 2);
    let ms = e.deploy(MYSQL, "mysql", 1);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap().id;
    assert!(e.st.claim_leadership(&ws[0]).unwrap());
    assert!(!e.st.claim_leadership(&ws[1]).unwrap());

    // A non-leader is refused, changing nothing; so is writing another
    // application's bag.
    let err = e.refused(|_| update(&e, &ws[1], app(rel, "wordpress"), &[("k", Some("v"))]));
    assert!(err.to_string().contains("is not the leader"), "{err}");
    e.refused(|_| update(&e, &ws[0], app(rel, "mysql"), &[("k", Some("v"))]));
    e.refused(|_| update(&e, &ws[1], Bag::Leader, &[("k", Some("v"))]));
    // Another unit's agent cannot write in the leader's name.
    e.refused(|st| {
        st.apply(
            &Caller::Unit(ws[1].clone()),
            &AgentOp::UpdateBag {
                unit: ws[0].clone(),
                bag: Bag::Leader,
                changes: vec![("k".into(), Some("v".into()))],
            },
        )
    });

    update(
        &e,
        &ws[0],
        app(rel, "wordpress"),
        &[("url", Some("http://x")), ("gone", Some("1"))],
    )
    .unwrap();
    update(&e, &ws[0], app(rel, "wordpress"), &[("gone", None)]).unwrap();
    let expected = BTreeMap::from([("url".to_string(), "http://x".to_string())]);
    // The other side reads it (and sees it in its scope answer); the leader
    // reads its own; a non-leader of a non-peer relation may not.
    assert_eq!(
        e.st.bag_seen_by(&ms[0], &app(rel, "wordpress")).unwrap(),
        expected
    );
    assert_eq!(
        e.st.bag_seen_by(&ws[0], &app(rel, "wordpress")).unwrap(),
        expected
    );
    assert!(e.st.bag_seen_by(&ws[1], &app(rel, "wordpress")).is_err());
    assert_eq!(
        e.st.bag_seen_by(&ws[1], &app(rel, "mysql")).unwrap(),
        BTreeMap::new()
    );
    e.st.enter_scope(rel, &ms[0]).unwrap();
    assert_eq!(
        e.st.scope_settings_seen_by(rel, &ms[0], None).unwrap().app,
        Some(("wordpress".to_string(), expected.clone()))
    );

    // In a peer relation every unit reads its application's bag.
    let peer =
        e.st.relations_of("wordpress")
            .unwrap()
            .into_iter()
            .find(|r| r.endpoints.len() == 1)
            .expect("the peer relation")
            .id;
    update(
        &e,
        &ws[0],
        app(peer, "wordpress"),
        &[("leader", Some(&ws[0]))],
    )
    .unwrap();
    assert_eq!(
        e.st.bag_seen_by(&ws[1], &app(peer, "wordpress")).unwrap()["leader"],
        ws[0]
    );
    // A unit of a service outside the relation reads nothing of it.
    assert!(e.st.bag_seen_by(&ms[0], &app(peer, "wordpress")).is_err());

    // Leader settings: the leader writes, every unit reads, and the version
    // that wakes the others moves.
    let before =
        e.st.unit_context(&ws[1])
            .unwrap()
            .service
            .leader_settings_version;
    update(&e, &ws[0], Bag::Leader, &[("password", Some("s"))]).unwrap();
    assert_eq!(
        e.st.bag_seen_by(&ws[1], &Bag::Leader).unwrap()["password"],
        "s"
    );
    let after =
        e.st.unit_context(&ws[1])
            .unwrap()
            .service
            .leader_settings_version;
    assert_eq!(after, before + 1);
}

#[test]
fn application_bags_are_bounded_at_the_write() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 1);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap().id;
    assert!(e.st.claim_leadership(&ws[0]).unwrap());
    let big = "x".repeat(crate::relations::MAX_RELATION_SETTINGS_BYTES);
    for bag in [app(rel, "wordpress"), Bag::Leader] {
        let err = e.refused(|_| update(&e, &ws[0], bag.clone(), &[("k", Some(&big))]));
        assert!(err.to_string().contains("would be"), "{err}");
        let key = "k".repeat(crate::relations::MAX_RELATION_SETTING_KEY_BYTES + 1);
        e.refused(|_| update(&e, &ws[0], bag.clone(), &[(&key, Some("v"))]));
    }
}

const ACTIONS: &str = "backup:\n  params:\n    target: {type: string}\n    level: {type: integer, default: 3}\n  required: [target]\n";

#[test]
fn actions_are_checked_before_they_are_queued_and_answered_once() {
    let e = env();
    let mut args = deploy_args(MYSQL, "mysql", 1);
    args.charm.actions = jujube_core::actions::CharmActions::parse("mysql", ACTIONS).unwrap();
    let u = e.st.deploy(&args).unwrap().remove(0);
    let err = e.refused(|st| st.queue_action(&u, "backup", &[], 60));
    assert!(
        err.to_string().contains("needs parameter `target`"),
        "{err}"
    );
    e.refused(|st| st.queue_action(&u, "restore", &["target=x".into()], 60));
    e.refused(|st| st.queue_action(&u, "backup", &["target=x".into(), "level=high".into()], 60));

    let id =
        e.st.queue_action(&u, "backup", &["target=x".into()], 60)
            .unwrap();
    let pending = e.st.pending_runs(&u).unwrap();
    assert_eq!(pending.len(), 1);
    let (name, params) = pending[0].action.clone().unwrap();
    assert_eq!(name, "backup");
    assert_eq!(params, serde_json::json!({"target": "x", "level": 3}));
    assert_eq!(e.st.task(id).unwrap().status(), "pending");

    let answer = |code: i32, failed: Option<&str>| crate::runs::RunResult {
        code,
        stdout: String::new(),
        stderr: String::new(),
        action: Some(crate::runs::ActionOutcome {
            results: BTreeMap::from([("path".to_string(), "/b/x".to_string())]),
            failed: failed.map(str::to_string),
            log: vec![(1, "backing up".into())],
        }),
    };
    let finish = |id: i64, r: crate::runs::RunResult| {
        e.st.apply(
            &Caller::Unit(u.clone()),
            &AgentOp::FinishRun {
                unit: u.clone(),
                id,
                result: r,
            },
        )
    };
    // Only the unit's own agent answers.
    e.refused(|st| {
        st.apply(
            &Caller::Unit("mysql/9".into()),
            &AgentOp::FinishRun {
                unit: u.clone(),
                id,
                result: answer(0, None),
            },
        )
    });
    finish(id, answer(0, None)).unwrap();
    finish(id, answer(1, Some("late"))).unwrap();
    let task = e.st.task(id).unwrap();
    assert_eq!(task.status(), "completed", "the first answer stands");
    assert_eq!(task.result.unwrap().action.unwrap().results["path"], "/b/x");
    // An answered action stays for show-task (a command's run does not).
    e.st.forget_run(id).unwrap();
    assert_eq!(e.st.task(id).unwrap().status(), "completed");
    let failed =
        e.st.queue_action(&u, "backup", &["target=y".into()], 60)
            .unwrap();
    finish(failed, answer(0, Some("disk full"))).unwrap();
    assert_eq!(e.st.task(failed).unwrap().status(), "failed");

    // How many of the unit's runs are kept: actions, or commands.
    let count = |actions: bool| -> i64 {
        let sql = if actions {
            "SELECT count(*) FROM runs WHERE action IS NOT NULL"
        } else {
            "SELECT count(*) FROM runs WHERE action IS NULL"
        };
        e.st.read(|c| Ok(c.query_row(sql, [], |r| r.get(0))?))
            .unwrap()
    };
    // A unit keeps at most KEPT_ACTIONS answered actions.
    for _ in 0..crate::runs::KEPT_ACTIONS {
        let id =
            e.st.queue_action(&u, "backup", &["target=z".into()], 60)
                .unwrap();
        finish(id, answer(0, None)).unwrap();
    }
    assert!(matches!(e.st.task(id), Err(crate::Error::NotFound { .. })));
    assert_eq!(count(true), crate::runs::KEPT_ACTIONS);

    // Answered commands nobody forgot (their client went away): at most
    // KEPT_RUNS, the newest, whatever the actions do.
    let ran = |_| {
        let id = e.st.queue_run(&u, &["true".into()], 60).unwrap();
        finish(
            id,
            crate::runs::RunResult {
                code: 0,
                stdout: "x".repeat(1000),
                stderr: String::new(),
                action: None,
            },
        )
        .unwrap();
        id
    };
    let ids: Vec<i64> = (0..crate::runs::KEPT_RUNS + 5).map(ran).collect();
    assert!(e.st.run_result(ids[4]).is_err(), "the oldest went");
    assert_eq!(e.st.run_result(ids[5]).unwrap().unwrap().code, 0);
    assert_eq!(count(false), crate::runs::KEPT_RUNS);
    assert_eq!(
        count(true),
        crate::runs::KEPT_ACTIONS,
        "actions are kept apart"
    );
}

/// What an action answers is bounded at the write: results and log above
/// `MAX_RUN_OUTPUT` are refused, the task left unanswered.
#[test]
fn an_actions_answer_above_its_bound_is_refused_with_nothing_changed() {
    let e = env();
    let mut args = deploy_args(MYSQL, "mysql", 1);
    args.charm.actions = jujube_core::actions::CharmActions::parse("mysql", ACTIONS).unwrap();
    let u = e.st.deploy(&args).unwrap().remove(0);
    let id =
        e.st.queue_action(&u, "backup", &["target=x".into()], 60)
            .unwrap();
    let big = "x".repeat(crate::runs::MAX_RUN_OUTPUT);
    let result = crate::runs::RunResult {
        code: 0,
        stdout: String::new(),
        stderr: String::new(),
        action: Some(crate::runs::ActionOutcome {
            results: BTreeMap::from([("data".to_string(), big)]),
            failed: None,
            log: vec![],
        }),
    };
    let err = e.refused(|st| {
        st.apply(
            &Caller::Unit(u.clone()),
            &AgentOp::FinishRun {
                unit: u.clone(),
                id,
                result: result.clone(),
            },
        )
    });
    assert!(err.to_string().contains("an action may answer"), "{err}");
    assert_eq!(e.st.task(id).unwrap().status(), "pending");
}

/// `goal-state` answers for a service of at most `MAX_GOAL_UNITS` units and
/// refuses, saying so, beyond: its answer is one message.
#[test]
fn goal_state_is_refused_beyond_its_bound() {
    let e = env();
    let units = e.deploy(MYSQL, "mysql", crate::agents::MAX_GOAL_UNITS);
    let goal = e.st.goal_state(&units[0]).unwrap();
    assert_eq!(goal.units.len(), crate::agents::MAX_GOAL_UNITS);
    e.st.add_units("mysql", 1, None).unwrap();
    let err = e.st.goal_state(&units[0]).unwrap_err();
    assert!(err.to_string().contains("at most 10000 units"), "{err}");
}

/// A unit's view carries its pending runs up to `MAX_VIEW_RUNS_BYTES` of
/// words and parameters (at least one): a queue of large commands comes a
/// few at a time, in order, as earlier ones are answered.
#[test]
fn a_units_view_carries_a_bounded_share_of_its_runs() {
    use crate::runs::{RunResult, MAX_VIEW_RUNS_BYTES};
    let e = env();
    let u = e.deploy(MYSQL, "mysql", 1).remove(0);
    let word = "a".repeat(60 << 10);
    let ids: Vec<i64> = (0..10)
        .map(|_| {
            e.st.queue_run(&u, &["echo".into(), word.clone()], 60)
                .unwrap()
        })
        .collect();
    let fit = MAX_VIEW_RUNS_BYTES / (60 << 10);
    let pending = || -> Vec<i64> {
        e.st.pending_runs(&u)
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect()
    };
    let carried = pending();
    assert_eq!(carried, ids[..fit]);
    for id in &carried {
        e.st.apply(
            &Caller::Unit(u.clone()),
            &AgentOp::FinishRun {
                unit: u.clone(),
                id: *id,
                result: RunResult {
                    code: 0,
                    stdout: String::new(),
                    stderr: String::new(),
                    action: None,
                },
            },
        )
        .unwrap();
    }
    assert_eq!(pending(), ids[fit..2 * fit]);
}

/// A queued command's words and a run's timeout are bounded: past them a
/// run is refused, saying which bound, and nothing is queued.
#[test]
fn a_runs_command_and_timeout_are_bounded() {
    use crate::runs::{MAX_RUN_ARGV_BYTES, MAX_RUN_TIMEOUT};
    let e = env();
    let mut args = deploy_args(MYSQL, "mysql", 1);
    args.charm.actions = jujube_core::actions::CharmActions::parse("mysql", ACTIONS).unwrap();
    let u = e.st.deploy(&args).unwrap().remove(0);
    let big = vec!["echo".to_string(), "a".repeat(MAX_RUN_ARGV_BYTES)];
    let err = e.refused(|st| st.queue_run(&u, &big, 60));
    assert!(
        err.to_string()
            .contains("more than the 65536 a run may take"),
        "{err}"
    );
    for timeout in [MAX_RUN_TIMEOUT + 1, u64::MAX] {
        let err = e.refused(|st| st.queue_run(&u, &["true".into()], timeout));
        assert!(err.to_string().contains("is more than 86400 s"), "{err}");
        let err = e.refused(|st| st.queue_action(&u, "backup", &["target=x".into()], timeout));
        assert!(err.to_string().contains("is more than 86400 s"), "{err}");
    }
    let id =
        e.st.queue_run(&u, &["true".into()], MAX_RUN_TIMEOUT)
            .unwrap();
    let pending = e.st.pending_runs(&u).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].id, pending[0].timeout), (id, MAX_RUN_TIMEOUT));
}

/// At most `MAX_PENDING_RUNS` commands and actions wait for one unit's
/// agent (each of its views carries them); one more is refused, changing
/// nothing.
#[test]
fn a_units_queue_of_runs_is_bounded() {
    let e = env();
    let mut args = deploy_args(MYSQL, "mysql", 1);
    args.charm.actions = jujube_core::actions::CharmActions::parse("mysql", ACTIONS).unwrap();
    let u = e.st.deploy(&args).unwrap().remove(0);
    for i in 0..crate::runs::MAX_PENDING_RUNS {
        if i % 2 == 0 {
            e.st.queue_action(&u, "backup", &["target=x".into()], 60)
                .unwrap();
        } else {
            e.st.queue_run(&u, &["true".into()], 60).unwrap();
        }
    }
    let err = e.refused(|st| st.queue_action(&u, "backup", &["target=x".into()], 60));
    assert!(err.to_string().contains("the most it queues"), "{err}");
    e.refused(|st| st.queue_run(&u, &["true".into()], 60));
    assert_eq!(
        e.st.pending_runs(&u).unwrap().len() as i64,
        crate::runs::MAX_PENDING_RUNS
    );
}
