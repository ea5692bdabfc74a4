//! The cleanup queue: a cleanup acts only on what it was queued for, ends
//! when that is gone, and a kind this version does not know never blocks the
//! rows behind it.

use super::*;
use crate::schema::MIGRATIONS;
use crate::Error;
use jujube_core::Life;

fn started(e: &Env, unit: &str) {
    e.st.set_unit_status(unit, "started", "").unwrap();
}

#[test]
fn a_stale_cleanup_never_touches_a_new_service_that_reuses_the_name() {
    let e = env();
    let old = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.st.destroy_service("wordpress").unwrap();
    assert_eq!(e.st.pending_cleanups().unwrap(), 1);
    // No agent ever acted on the unit: destroying it removes it at once, and
    // with it the Dying service it was the last thing holding.
    e.st.destroy_units(&[old]).unwrap();
    assert!(matches!(
        e.st.service("wordpress"),
        Err(Error::NotFound { .. })
    ));
    let new = e.deploy(WORDPRESS, "wordpress", 2);
    assert_eq!(new, vec!["wordpress/1", "wordpress/2"]);
    for u in &new {
        started(&e, u);
    }
    e.st.run_cleanups(100).unwrap();
    for u in &new {
        assert_eq!(
            e.st.unit(u).unwrap().life,
            Life::Alive,
            "{u} of the new service was destroyed by the old service's cleanup"
        );
    }
    assert_eq!(e.st.service("wordpress").unwrap().life, Life::Alive);
    // The old incarnation is gone, so its cleanup ended.
    assert_eq!(e.st.pending_cleanups().unwrap(), 0);
}

#[test]
fn a_cleanup_still_destroys_the_units_of_its_own_incarnation() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 3);
    for u in &units {
        started(&e, u);
    }
    e.st.destroy_service("wordpress").unwrap();
    e.st.run_cleanups(100).unwrap();
    for u in &units {
        assert_eq!(e.st.unit(u).unwrap().life, Life::Dying);
    }
    assert_eq!(e.st.pending_cleanups().unwrap(), 0);
}

#[test]
fn unknown_cleanup_kinds_are_skipped_and_reported_without_blocking_the_queue() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    // A row a newer jujube queued, ahead of work this version knows.
    e.st.write(|tx| {
        tx.execute(
            "INSERT INTO cleanups (kind, target) VALUES ('from-the-future', 'x')",
            [],
        )?;
        Ok(())
    })
    .unwrap();
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    e.st.leave_scope(rel.id, &ws[0]).unwrap();
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    assert!(e.st.relation_settings(rel.id, &ws[0]).is_ok());

    e.st.run_cleanups(100).unwrap();
    assert!(
        e.st.relation_settings(rel.id, &ws[0]).is_err(),
        "the known cleanup behind the unknown one must run"
    );
    // Kept for the version that knows it, reported, and not counted as work
    // this version could still do (`jujube wait` would never finish).
    let skipped = e.st.skipped_cleanups().unwrap();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(
        (skipped[0].kind.as_str(), skipped[0].target.as_str()),
        ("from-the-future", "x")
    );
    assert_eq!(e.st.pending_cleanups().unwrap(), 0);
    // A step with only unknown rows left does nothing and says so.
    let before = e.digest();
    assert!(!e.st.cleanup_step().unwrap());
    assert_eq!(before, e.digest());
}

/// A database as jujube left it before cleanups were keyed by incarnation
/// (schema 2), with three queued `service-units` cleanups by name: one for a
/// Dying service, one stale (the name now belongs to a new, Alive service)
/// and one for a service that is gone.
#[test]
fn queued_cleanups_of_an_older_database_are_migrated_to_incarnations() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        for sql in &MIGRATIONS[..2] {
            c.execute_batch(sql).unwrap();
        }
        c.execute_batch(
            "INSERT INTO environment (id, name, uuid, provider, default_series)
                 VALUES (1, 'test', '6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f', 'dummy', 'jammy');
             INSERT INTO machines (id, series, jobs, manage_environ)
                 VALUES (0, 'jammy', 'manage-environ', 1), (1, 'jammy', 'host-units', 0),
                        (2, 'jammy', 'host-units', 0);
             INSERT INTO charms (url, meta, config) VALUES ('local:jammy/wordpress-1', '{}', '{}');
             INSERT INTO services (name, charm_url, series, subordinate, life, unit_count)
                 VALUES ('wordpress', 'local:jammy/wordpress-1', 'jammy', 0, 1, 1),
                        ('blog', 'local:jammy/wordpress-1', 'jammy', 0, 0, 1);
             INSERT INTO units (name, service, number, series, machine_id, status)
                 VALUES ('wordpress/0', 'wordpress', 0, 'jammy', 1, 'started'),
                        ('blog/3', 'blog', 3, 'jammy', 2, 'started');
             INSERT INTO sequences (name, next) VALUES ('machine', 3), ('unit:wordpress', 1),
                 ('unit:blog', 4);
             INSERT INTO cleanups (kind, target) VALUES ('service-units', 'wordpress'),
                 ('service-units', 'blog'), ('service-units', 'gone');
             PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    let st = crate::Store::open_with(&path, Durability::Relaxed).unwrap();
    assert_eq!(
        st.pending_cleanups().unwrap(),
        1,
        "only the live one is left"
    );
    st.run_cleanups(100).unwrap();
    assert_eq!(st.unit("wordpress/0").unwrap().life, Life::Dying);
    assert_eq!(st.unit("blog/3").unwrap().life, Life::Alive);
    assert_eq!(st.pending_cleanups().unwrap(), 0);
    // Services made before the migration got incarnations too: destroying
    // one queues a cleanup that works.
    st.destroy_service("blog").unwrap();
    st.run_cleanups(100).unwrap();
    assert_eq!(st.unit("blog/3").unwrap().life, Life::Dying);
}

/// A destroyed service's units, a few of each kind among plain ones over
/// more than one step: those of a started agent, in a relation's scope,
/// with a subordinate, and those nothing holds.
fn units_of_each_kind(e: &Env) -> Vec<String> {
    let units = e.deploy(WORDPRESS, "wordpress", crate::cleanups::UNITS_BATCH + 60);
    let m = e.deploy(MYSQL, "mysql", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let db = e.st.add_relation("wordpress", "mysql").unwrap();
    let logs = e.st.add_relation("logging", "wordpress").unwrap();
    e.st.enter_scope(db.id, &m).unwrap();
    for u in units.iter().step_by(7) {
        started(e, u);
    }
    for u in units.iter().skip(3).step_by(11) {
        e.st.enter_scope(db.id, u).unwrap();
    }
    for u in units.iter().skip(5).step_by(13) {
        e.st.enter_scope(logs.id, u).unwrap();
        // A subordinate outside the scope: destroyed with its principal,
        // both removed unless something else holds them.
        let sub = e.st.subordinates(u).unwrap().remove(0);
        if u.ends_with('5') {
            e.st.enter_scope(logs.id, &sub).unwrap();
        } else {
            e.st.leave_scope(logs.id, u).unwrap();
        }
    }
    units
}

/// The feed's entries after `since`, as `KIND ID`.
fn feed_after(e: &Env, since: u64) -> Vec<String> {
    e.st.changes_since(since, usize::MAX)
        .unwrap()
        .changes
        .into_iter()
        .map(|c| format!("{:?} {}", c.kind, c.id))
        .collect()
}

/// Every unit's and subordinate's life, the service's life and unit
/// count, and the feed's entries, as [`outcome`] reads them.
type Outcome = (
    Vec<Option<Life>>,
    Option<(Life, i64)>,
    std::collections::BTreeSet<String>,
);

/// Every unit's and subordinate's life (None: removed or never there),
/// the service's life and unit count, and the feed's entries after
/// `since` as a set.
fn outcome(e: &Env, units: &[String], since: u64) -> Outcome {
    // The subordinates' too (logging's units, all there were, in order).
    let subs = (0..units.len()).map(|i| format!("logging/{i}"));
    let lives = units
        .iter()
        .cloned()
        .chain(subs)
        .map(|u| e.st.unit(&u).ok().map(|u| u.life))
        .collect();
    let svc =
        e.st.service("wordpress")
            .ok()
            .map(|s| (s.life, s.unit_count));
    (lives, svc, feed_after(e, since).into_iter().collect())
}

#[test]
fn a_destroyed_services_cleanup_destroys_each_unit_as_destroy_unit_does() {
    // The cleanup's steps against destroy-unit of every unit, one at a
    // time, on the same service.
    let (a, b) = (env(), env());
    let (units, same) = (units_of_each_kind(&a), units_of_each_kind(&b));
    assert_eq!(units, same);
    let (ra, rb) = (a.st.head_revision().unwrap(), b.st.head_revision().unwrap());
    a.st.destroy_service("wordpress").unwrap();
    let steps = a.st.run_cleanups(usize::MAX).unwrap();
    b.st.destroy_service("wordpress").unwrap();
    for u in &same {
        if b.st.unit(u).is_ok() {
            b.st.destroy_units(std::slice::from_ref(u)).unwrap();
        }
    }
    b.st.run_cleanups(usize::MAX).unwrap();
    let (got, want) = (outcome(&a, &units, ra), outcome(&b, &same, rb));
    assert_eq!(got.0, want.0);
    assert_eq!(got.1, want.1);
    assert_eq!(got.2, want.2);
    // Some of each outcome, in two steps.
    assert!(got.0.iter().any(|l| l.is_none()));
    assert!(got.0.contains(&Some(Life::Dying)));
    assert_eq!(got.1.unwrap().0, Life::Dying);
    assert_eq!(steps, 2);
    let stats = a.st.stats();
    assert!(stats.max_transaction_rows <= 1000, "{stats:?}");
}

#[test]
fn a_destroyed_services_last_units_removed_by_its_cleanup_remove_it() {
    let e = env();
    let units = e.deploy(MYSQL, "mysql", crate::cleanups::UNITS_BATCH + 1);
    let machines: Vec<i64> = units
        .iter()
        .map(|u| e.st.unit(u).unwrap().machine_id.unwrap())
        .collect();
    let since = e.st.head_revision().unwrap();
    e.st.destroy_service("mysql").unwrap();
    assert_eq!(e.st.run_cleanups(usize::MAX).unwrap(), 2);
    assert!(matches!(e.st.service("mysql"), Err(Error::NotFound { .. })));
    let feed = feed_after(&e, since);
    for (u, m) in units.iter().zip(&machines) {
        assert!(e.st.unit(u).is_err());
        assert!(feed.contains(&format!("Unit {u}")), "{u}");
        assert!(feed.contains(&format!("Machine {m}")), "{m}");
    }
    // A new unit of a new service of that name takes none of their numbers.
    let again = e.deploy(MYSQL, "mysql", 1).remove(0);
    assert_eq!(again, format!("mysql/{}", units.len()));
}
