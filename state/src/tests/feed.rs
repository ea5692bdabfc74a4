//! The change feed: revisions, changes_since, watchers in and across
//! processes, pruning.

use super::*;
use crate::ChangeKind;
use std::time::Duration;

#[test]
fn every_committed_change_bumps_the_revision_and_names_what_changed() {
    let e = env();
    let head = e.st.head_revision().unwrap();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let batch = e.st.changes_since(head, 100).unwrap();
    assert!(!batch.truncated);
    let revs: Vec<u64> = batch.changes.iter().map(|c| c.revision).collect();
    assert!(
        revs.windows(2).all(|w| w[0] < w[1]),
        "revisions increase: {revs:?}"
    );
    assert!(batch
        .changes
        .iter()
        .any(|c| c.kind == ChangeKind::Unit && c.id == u));
    assert!(batch
        .changes
        .iter()
        .any(|c| c.kind == ChangeKind::Service && c.id == "wordpress"));
    assert!(batch
        .changes
        .iter()
        .any(|c| c.kind == ChangeKind::Machine && c.id == "1"));
    assert_eq!(batch.revision, e.st.head_revision().unwrap());
    // A refused operation records nothing.
    let _ = e.st.add_units("nope", 1, None);
    assert!(e
        .st
        .changes_since(batch.revision, 10)
        .unwrap()
        .changes
        .is_empty());
}

#[tokio::test(start_paused = true)]
async fn in_process_watchers_wake_on_commit_without_polling() {
    let e = env();
    let head = e.st.head_revision().unwrap();
    // A poll interval far longer than the test: only the commit can wake it.
    let mut w =
        e.st.watch(head)
            .with_poll_interval(Duration::from_secs(3600));
    let st = e.st.clone();
    let task = tokio::spawn(async move { w.next().await.unwrap() });
    tokio::task::yield_now().await;
    st.add_machines(1, None, None).unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(batch.changes[0].kind, ChangeKind::Machine);
}

#[tokio::test(start_paused = true)]
async fn watchers_see_commits_made_by_other_processes() {
    let e = env();
    let other = crate::Store::open_at(e.st.location(), crate::Durability::Relaxed).unwrap();
    let head = e.st.head_revision().unwrap();
    let mut w =
        e.st.watch(head)
            .with_poll_interval(Duration::from_millis(100));
    // The other handle's commit does not notify this handle's channel.
    other.add_machines(1, None, None).unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(1), w.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(batch.changes.len(), 1);
    assert_eq!(batch.changes[0].id, "1");
}

/// On PostgreSQL (else `None`): a store, another handle on its database
/// as another controller's, and the first one's wake-ups.
fn two_controllers() -> Option<(super::Env, crate::Store, tokio::sync::watch::Receiver<u64>)> {
    super::postgres_url()?;
    let e = env();
    let other = crate::Store::open_at(e.st.location(), crate::Durability::Relaxed).unwrap();
    let woken = e.st.head_receiver();
    Some((e, other, woken))
}

/// On PostgreSQL another controller's commit is heard (`LISTEN/NOTIFY`):
/// it wakes this store's watchers without their polling. On SQLite other
/// processes' commits are polled (the test above): nothing to hear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgresql_another_controllers_commit_wakes_the_watchers_at_once() {
    let Some((e, other, mut woken)) = two_controllers() else {
        return;
    };
    woken.mark_unchanged();
    other.add_machines(1, None, None).unwrap();
    // Bounds the wait only: the store polls nothing here.
    tokio::time::timeout(Duration::from_secs(30), woken.changed())
        .await
        .expect("the other handle's commit was not heard")
        .unwrap();
    let mut w = e.st.watch(0).with_poll_interval(Duration::from_secs(3600));
    let batch = w.next().await.unwrap();
    assert!(batch
        .changes
        .iter()
        .any(|c| c.kind == ChangeKind::Machine && c.id == "1"));
}

/// Commits only mark a notification owed, and the listening session
/// sends one for whatever was owed meanwhile: commit after commit, each
/// is heard by another controller without a poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgresql_every_commit_in_turn_is_heard() {
    let Some((_e, other, mut woken)) = two_controllers() else {
        return;
    };
    for i in 0..20 {
        woken.mark_unchanged();
        other.add_machines(1, None, None).unwrap();
        // Bounds the wait only: the store polls nothing here.
        tokio::time::timeout(Duration::from_secs(30), woken.changed())
            .await
            .unwrap_or_else(|_| panic!("commit {i} was not heard"))
            .unwrap();
    }
}

/// A burst of commits is notified a few times, not once a commit: the
/// listening session spaces its notifications (`listen::SPACING`). Each
/// wake another controller hears is one notification at most, so the wakes
/// counted while the burst runs are bounded by its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgresql_a_burst_of_commits_is_notified_a_few_times() {
    use crate::pg::listen::SPACING;
    let Some((e, other, mut woken)) = two_controllers() else {
        return;
    };
    woken.mark_unchanged();
    let wakes = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counting = tokio::spawn({
        let wakes = wakes.clone();
        async move {
            while woken.changed().await.is_ok() {
                wakes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    let start = std::time::Instant::now();
    const COMMITS: u32 = 200;
    let burst = tokio::task::spawn_blocking(move || {
        for _ in 0..COMMITS {
            other.add_machines(1, None, None).unwrap();
        }
        other
    });
    let other = burst.await.unwrap();
    let took = start.elapsed();
    // The burst's last commit is heard (bounds the wait only).
    let head = other.head_revision().unwrap();
    let mut w = e.st.watch(0).with_poll_interval(Duration::from_secs(3600));
    tokio::time::timeout(Duration::from_secs(30), async {
        while w.revision() < head {
            w.next().await.unwrap();
        }
    })
    .await
    .expect("the burst's last commit was not heard");
    let heard_by = start.elapsed();
    let wakes = wakes.load(std::sync::atomic::Ordering::Relaxed);
    counting.abort();
    let bound = (heard_by.as_secs_f64() / SPACING.as_secs_f64()).ceil() as u32 + 2;
    assert!(
        wakes <= bound,
        "{wakes} wakes for {COMMITS} commits in {took:?} (at most {bound} notifications)"
    );
}

/// The session sends a notification at once, and the next no sooner than
/// `SPACING` after it.
#[tokio::test(start_paused = true)]
async fn notifications_are_spaced_apart() {
    use crate::pg::listen::{Pace, SPACING};
    use tokio::time::{advance, Instant};
    let mut pace = Pace::default();
    let t0 = Instant::now();
    pace.wait().await;
    assert_eq!(Instant::now(), t0, "the first waits for nothing");
    pace.sent();
    advance(SPACING / 4).await;
    pace.wait().await;
    // The timer's own granularity: a millisecond.
    let waited = Instant::now() - t0;
    assert!(
        waited >= SPACING && waited <= SPACING + Duration::from_millis(1),
        "{waited:?}"
    );
    pace.sent();
    advance(SPACING * 3).await;
    let t1 = Instant::now();
    pace.wait().await;
    assert_eq!(
        Instant::now(),
        t1,
        "one owed long after the last is sent at once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_head_watcher_wakes_on_commit_with_the_range_it_did_not_read() {
    let e = env();
    let head = e.st.head_revision().unwrap();
    let mut w =
        e.st.watch(head)
            .with_poll_interval(Duration::from_secs(3600));
    let st = e.st.clone();
    let task = tokio::spawn(async move {
        let range = w.next_head().await.unwrap();
        (range, w)
    });
    tokio::task::yield_now().await;
    st.add_machines(3, None, None).unwrap();
    let ((since, upto), mut w) = tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((since, upto), (head, e.st.head_revision().unwrap()));
    assert_eq!(w.revision(), upto);
    // Nothing new: it waits (the poll finds nothing either).
    assert!(tokio::time::timeout(Duration::from_secs(1), w.next_head())
        .await
        .is_err());
    // Whether a kind of change is in the range is the store's to answer.
    assert!(e
        .st
        .changed_between(ChangeKind::Machine, since, upto)
        .unwrap());
    assert!(!e
        .st
        .changed_between(ChangeKind::Environment, since, upto)
        .unwrap());
    e.st.set_environment_config(&[("harvest-mode".into(), "none".into())])
        .unwrap();
    let head = e.st.head_revision().unwrap();
    assert!(e
        .st
        .changed_between(ChangeKind::Environment, upto, head)
        .unwrap());
    assert!(!e
        .st
        .changed_between(ChangeKind::Machine, upto, head)
        .unwrap());
    // A range partly pruned may have held anything.
    e.st.prune_changes(1, 1000).unwrap();
    assert!(e
        .st
        .changed_between(ChangeKind::Environment, since, since + 1)
        .unwrap());
}

#[test]
fn the_routers_machine_links_are_life_and_instance_in_one_read() {
    use crate::provisioning::Started;
    use jujube_core::Life;
    let e = env();
    let ids = e.st.add_machines(2, None, None).unwrap();
    let nonce = e.st.prepare_provisioning(&ids[1..], "6f1e0f4c").unwrap()[0]
        .nonce
        .clone();
    e.st.record_instances(&[Started {
        machine: ids[1],
        nonce,
        instance_id: "i-1".into(),
        zone: None,
        hardware: String::new(),
    }])
    .unwrap();
    e.st.destroy_machines(&[ids[1]]).unwrap();
    let links = e.st.machine_links(&[ids[0], ids[1], 999]).unwrap();
    assert_eq!(
        links,
        vec![Some((Life::Alive, false)), Some((Life::Dying, true)), None]
    );
}

#[test]
fn readers_behind_the_pruned_floor_are_told_to_resync() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 5);
    let head = e.st.head_revision().unwrap();
    let deleted = e.st.prune_changes(3, 1000).unwrap();
    assert_eq!(deleted as u64, head - 3);
    let batch = e.st.changes_since(0, 100).unwrap();
    assert!(batch.truncated);
    assert_eq!(batch.changes.len(), 3);
    let fresh = e.st.changes_since(head - 3, 100).unwrap();
    assert!(!fresh.truncated);
    // Reopening keeps the head: revisions never go back.
    let reopened = crate::Store::open_at(e.st.location(), crate::Durability::Full).unwrap();
    assert_eq!(reopened.head_revision().unwrap(), head);
}

#[test]
fn pruning_writes_at_most_its_batch_of_rows_floor_included() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 300);
    let head = e.st.head_revision().unwrap();
    assert!(head > 200, "enough changes to prune: {head}");
    e.st.reset_stats();
    let deleted = e.st.prune_changes(0, 100).unwrap();
    assert!(deleted > 0);
    // The controller prunes in batches of 1,000 and the store promises no
    // transaction above 1,000 rows: the floor's row counts too.
    assert!(
        e.st.stats().max_transaction_rows <= 100,
        "{:?}",
        e.st.stats().max_transaction_rows
    );
    let batch = e.st.changes_since(0, 10).unwrap();
    assert!(batch.truncated);
}

/// Reads run side by side: one held open (a slow read on another thread)
/// does not keep the next from being answered, while the writer commits.
#[test]
fn reads_run_beside_each_other_and_the_writer() {
    let e = env();
    let (held, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            e.st.read(|c| {
                let n: i64 = c.query_row("SELECT count(*) FROM machines", [], |r| r.get(0))?;
                held.wait();
                release.wait();
                Ok(n)
            })
            .unwrap()
        });
        held.wait();
        // Another read, and a write, while the first is still open.
        let ids = e.st.add_machines(1, None, None).unwrap();
        let seen =
            e.st.read(|c| {
                Ok(c.query_row(
                    "SELECT count(*) FROM machines WHERE id = ?1",
                    [ids[0]],
                    |r| r.get::<_, i64>(0),
                )?)
            })
            .unwrap();
        assert_eq!(seen, 1, "a read after the write sees it");
        release.wait();
    });
}

/// An agent that runs over the API and has not been seen for a minute is
/// `down` in status, with since when and what it was, and `wait` names it;
/// one seen lately, or never started, is what it reported.
#[test]
fn an_agent_not_seen_for_a_minute_is_down() {
    let e = env();
    let id = e.st.add_machines(1, None, None).unwrap()[0];
    let tag = format!("machine-{id}");
    e.st.set_machine_credential(id, &tag, "hash").unwrap();
    let now = crate::unix_now();
    let agent = |e: &Env| {
        let m =
            e.st.status()
                .unwrap()
                .machines
                .get(&id.to_string())
                .unwrap()
                .clone();
        (m.agent_status, m.agent_status_info)
    };
    let waits = |e: &Env| e.st.awaiting_agents(10).unwrap().join("\n");
    // Never started: pending, whatever its presence.
    e.st.note_agents_seen(std::slice::from_ref(&tag), now - 600)
        .unwrap();
    assert_eq!(agent(&e).0, "pending");
    e.st.apply_batch(&[(
        crate::agents::Caller::Machine(id),
        crate::agents::AgentOp::SetMachineAgentStatus {
            machine: id,
            status: "started".into(),
            info: String::new(),
        },
    )])
    .unwrap()
    .remove(0)
    .unwrap();
    e.st.note_agents_seen(std::slice::from_ref(&tag), now - 10)
        .unwrap();
    assert_eq!(agent(&e).0, "started");
    assert!(!waits(&e).contains("down"), "{}", waits(&e));
    e.st.note_agents_seen(std::slice::from_ref(&tag), now - 120)
        .unwrap();
    let (status, info) = agent(&e);
    assert_eq!(status, "down");
    assert!(
        info.contains("agent not seen since") && info.contains("was `started`"),
        "{info}"
    );
    assert!(
        waits(&e).contains(&format!("the agent of machine `{id}` is down")),
        "{}",
        waits(&e)
    );
    assert_eq!(e.st.agent_seen_at(&tag).unwrap(), Some(now - 120));
}

/// A service whose leader is lost (its agent down) gets another: its
/// lowest-numbered unit whose agent started and is present; a service
/// whose leader holds keeps it.
#[test]
fn a_lost_leader_is_replaced_by_a_present_unit() {
    use crate::agents::{AgentOp, Caller};
    let e = env();
    let units = e.deploy(MYSQL, "mysql", 3);
    let now = crate::unix_now();
    for u in &units {
        e.st.set_unit_credential(u, &format!("unit-{}", u.replace('/', "-")), "hash")
            .unwrap();
        e.st.apply_batch(&[(
            Caller::Unit(u.clone()),
            AgentOp::SetUnitStatus {
                unit: u.clone(),
                status: "started".into(),
                info: String::new(),
            },
        )])
        .unwrap();
    }
    let seen = |u: &str, at: i64| {
        e.st.note_agents_seen(&[format!("unit-{}", u.replace('/', "-"))], at)
            .unwrap();
    };
    for u in &units {
        seen(u, now);
    }
    assert!(e.st.claim_leadership("mysql/1").unwrap());
    assert_eq!(e.st.elect_leaders(10).unwrap(), 0, "the leader holds");
    assert!(e.st.unit_context("mysql/1").unwrap().leader);
    // mysql/1's agent goes down; mysql/0's too: mysql/2 is elected.
    seen("mysql/1", now - 600);
    seen("mysql/0", now - 600);
    let leaders = |e: &Env| {
        let st = e.st.status().unwrap();
        let units = &st.services.get("mysql").unwrap().units.0;
        units
            .iter()
            .filter(|(_, u)| u.leader)
            .map(|(n, _)| n.clone())
            .collect::<Vec<_>>()
    };
    assert!(
        leaders(&e).is_empty(),
        "a leader whose agent is down is shown leading"
    );
    assert_eq!(e.st.elect_leaders(10).unwrap(), 1);
    assert_eq!(leaders(&e), ["mysql/2"]);
    assert!(e.st.unit_context("mysql/2").unwrap().leader);
    assert!(!e.st.unit_context("mysql/1").unwrap().leader);
    assert!(!e.st.claim_leadership("mysql/0").unwrap());
}

/// A revision is the largest one plus one: pruning, even asked to keep
/// nothing, keeps the newest change, so the feed never counts from 1 again
/// (a watcher would miss everything up to its old revision); nor does
/// reopening the store.
#[test]
fn revisions_never_go_back_whatever_is_pruned() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 3);
    let head = e.st.head_revision().unwrap();
    while e.st.prune_changes(0, 1000).unwrap() > 0 {}
    assert_eq!(e.st.head_revision().unwrap(), head);
    e.deploy(MYSQL, "mysql", 1);
    let next = e.st.changes_since(head, 100).unwrap();
    assert!(!next.changes.is_empty());
    assert!(next.changes.iter().all(|c| c.revision > head), "{next:?}");
    drop(e.st.clone());
    let reopened = crate::Store::open_at(e.st.location(), crate::Durability::Full).unwrap();
    assert_eq!(
        reopened.head_revision().unwrap(),
        e.st.head_revision().unwrap()
    );
}

#[test]
fn a_resumed_watch_learns_in_one_snapshot_whether_it_missed_changes_or_their_record() {
    let e = env_with("");
    let h = e.st.head_revision().unwrap();
    assert_eq!(e.st.resume_point(0).unwrap(), (h, None));
    assert_eq!(e.st.resume_point(h).unwrap(), (h, None));
    e.st.add_machines(1, None, None).unwrap();
    let now = e.st.head_revision().unwrap();
    assert!(now > h);
    assert_eq!(e.st.resume_point(h).unwrap(), (now, Some(false)));
    assert_eq!(e.st.resume_point(now).unwrap(), (now, None));
    // Pruned past it: the watcher must re-read everything.
    e.st.add_machines(1, None, None).unwrap();
    while e.st.prune_changes(0, 1000).unwrap() > 0 {}
    let (head, missed) = e.st.resume_point(h).unwrap();
    assert_eq!(missed, Some(true));
    assert_eq!(head, e.st.head_revision().unwrap());
}
