//! Requests that scale with a user's number or with the model: every
//! transaction stays bounded, counts above the maximum are refused before
//! anything is allocated, a failure part-way leaves whole batches that a
//! retry completes; and what users type that jujube does not know (series)
//! is refused.

use super::*;
use crate::model::machine_status;
use crate::sql::Engine;
use crate::Error;
use jujube_core::Constraints;

/// The bound the invariant "no transaction grows with the model" promises.
const BOUND: u64 = 1000;

const UUID: &str = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";

#[test]
fn counts_above_the_maximum_are_refused_before_anything_is_allocated() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    // Before the limit, this asked for 2.4 TB and aborted the process.
    let err = e.refused(|s| s.add_units("wordpress", 99_999_999_999, None));
    assert_eq!(
        err.to_string(),
        "cannot add 99999999999 units at once: at most 100000 per command; add them in several commands"
    );
    let err = e.refused(|s| s.add_machines(99_999_999_999, None, None));
    assert_eq!(
        err.to_string(),
        "cannot add 99999999999 machines at once: at most 100000 per command; add them in several commands"
    );
    let err = e.refused(|s| s.deploy(&deploy_args(MYSQL, "mysql", 100_001)));
    assert!(
        matches!(
            err,
            Error::TooMany {
                asked: 100_001,
                max: 100_000,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(crate::MAX_PER_COMMAND, 100_000);
}

/// `destroy-unit`, `destroy-machine` and `retry-provisioning` are all or
/// none, in one transaction: a list longer than `MAX_NAMED_PER_COMMAND` is refused
/// before anything is read, changing nothing, and the longest list allowed
/// stays within the 1,000 rows a transaction may write.
#[test]
fn destroying_many_units_or_machines_in_one_command_is_bounded() {
    use crate::MAX_NAMED_PER_COMMAND;
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", MAX_NAMED_PER_COMMAND + 1);
    let err = e.refused(|s| s.destroy_units(&units));
    assert_eq!(
        err.to_string(),
        format!("cannot destroy {} units at once: at most {MAX_NAMED_PER_COMMAND} per command; destroy them in several commands (or the whole service with `jujube destroy-service`)", units.len())
    );
    let ids: Vec<i64> = (1..=MAX_NAMED_PER_COMMAND as i64 + 1).collect();
    let err = e.refused(|s| s.destroy_machines(&ids));
    assert_eq!(
        err.to_string(),
        format!("cannot destroy {} machines at once: at most {MAX_NAMED_PER_COMMAND} per command; destroy them in several commands", ids.len())
    );
    let err = e.refused(|s| s.retry_provisioning(&ids));
    assert_eq!(
        err.to_string(),
        format!("cannot retry {} machines at once: at most {MAX_NAMED_PER_COMMAND} per command; retry them in several commands (or every machine in error with `--all`)", ids.len())
    );
    e.st.reset_stats();
    e.st.destroy_units(&units[..MAX_NAMED_PER_COMMAND]).unwrap();
    let free: Vec<i64> =
        e.st.add_machines(MAX_NAMED_PER_COMMAND, None, None)
            .unwrap();
    for &id in &free {
        e.st.set_machine_status(id, crate::model::machine_status::ERROR, "no capacity")
            .unwrap();
    }
    e.st.retry_provisioning(&free).unwrap();
    e.st.destroy_machines(&free).unwrap();
    let rows = e.st.stats().max_transaction_rows;
    assert!(rows <= 1000, "largest transaction {rows} rows");
}

/// What `wait` reads of unsettled machines is `limit` rows and a count,
/// however many there are; a machine set Dying still counts.
#[test]
fn unsettled_machines_are_read_a_page_and_a_count() {
    let e = env();
    let (_, before) = e.st.unsettled_machines(0).unwrap();
    let ids = e.st.add_machines(25, None, None).unwrap();
    e.st.destroy_machines(&ids[..2]).unwrap();
    let (listed, all) = e.st.unsettled_machines(20).unwrap();
    assert_eq!(all, before + 25);
    assert_eq!(listed.len(), 20);
    assert!(listed.windows(2).all(|w| w[0].id < w[1].id));
}

/// Environment config is bounded at the write: a key's length, a value's,
/// and the number of keys; each refusal changes nothing.
#[test]
fn environment_config_is_bounded_at_the_write() {
    use crate::environment::{MAX_CONFIG_KEYS, MAX_CONFIG_KEY_BYTES, MAX_CONFIG_VALUE_BYTES};
    let e = env();
    let set = |k: &str, v: &str| e.st.set_environment_config(&[(k.into(), v.into())]);
    set("big", &"v".repeat(MAX_CONFIG_VALUE_BYTES)).unwrap();
    let err = e.refused(|s| {
        s.set_environment_config(&[("big".into(), "v".repeat(MAX_CONFIG_VALUE_BYTES + 1))])
    });
    assert_eq!(
        err.to_string(),
        format!(
            "the value of `big` is {} bytes, more than {MAX_CONFIG_VALUE_BYTES}; shorten it",
            MAX_CONFIG_VALUE_BYTES + 1
        )
    );
    let long = "k".repeat(MAX_CONFIG_KEY_BYTES + 1);
    let err = e.refused(|s| s.set_environment_config(&[(long.clone(), "v".into())]));
    assert_eq!(
        err.to_string(),
        format!(
            "a config key of {} bytes is more than {MAX_CONFIG_KEY_BYTES}; shorten it",
            MAX_CONFIG_KEY_BYTES + 1
        )
    );
    let have = e.st.environment_config().unwrap().len();
    let fill: Vec<(String, String)> = (have..MAX_CONFIG_KEYS)
        .map(|i| (format!("k{i}"), "v".into()))
        .collect();
    e.st.set_environment_config(&fill).unwrap();
    assert_eq!(e.st.environment_config().unwrap().len(), MAX_CONFIG_KEYS);
    let err = e.refused(|s| s.set_environment_config(&[("one-more".into(), "v".into())]));
    assert!(
        err.to_string().contains(&format!(
            "would hold {} keys, more than {MAX_CONFIG_KEYS}",
            MAX_CONFIG_KEYS + 1
        )),
        "{err}"
    );
    // Changing a key, or unsetting one, still works at the bound.
    set("big", "small").unwrap();
    set("big", "").unwrap();
    set("one-more", "v").unwrap();
}

#[test]
fn adding_many_machines_keeps_every_transaction_bounded() {
    let e = env();
    e.st.reset_stats();
    let ids = e.st.add_machines(1000, None, None).unwrap();
    assert_eq!(ids.len(), 1000);
    assert_eq!(ids, (1..=1000).collect::<Vec<i64>>());
    let stats = e.st.stats();
    assert!(stats.max_transaction_rows <= BOUND, "{stats:?}");
    assert!(stats.transactions > 1, "{stats:?}");
}

/// Makes the `n`th insert of a machine (counting machine 0) fail inside its
/// transaction, as a full disk or a lost lock would.
fn fail_machine_insert(e: &Env, id: i64) {
    e.st.write(|tx| {
        tx.execute_batch(&match tx.engine() {
            Engine::Sqlite => format!(
                "CREATE TRIGGER fail_machine BEFORE INSERT ON machines WHEN NEW.id = {id}
                 BEGIN SELECT RAISE(ABORT, 'injected failure'); END;"
            ),
            Engine::Postgres => format!(
                "CREATE FUNCTION fail_machine() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     IF NEW.id = {id} THEN RAISE EXCEPTION 'injected failure'; END IF;
                     RETURN NEW;
                 END $$;
                 CREATE TRIGGER fail_machine BEFORE INSERT ON machines
                     FOR EACH ROW EXECUTE FUNCTION fail_machine();"
            ),
        })?;
        Ok(())
    })
    .unwrap();
}

fn clear_failure(e: &Env) {
    e.st.write(|tx| {
        Ok(tx.execute_batch(match tx.engine() {
            Engine::Sqlite => "DROP TRIGGER fail_machine",
            Engine::Postgres => "DROP TRIGGER fail_machine ON machines; DROP FUNCTION fail_machine",
        })?)
    })
    .unwrap();
}

#[test]
fn machines_added_before_a_failed_batch_are_whole_and_the_error_says_what_is_left() {
    let e = env();
    fail_machine_insert(&e, 300);
    let err = e.st.add_machines(1000, None, None).unwrap_err();
    let Error::Incomplete {
        added,
        asked,
        cause,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    // Whole batches only: every machine before the failed batch, none of it.
    assert_eq!(*asked, 1000);
    assert_eq!(added.len() % crate::machines::MACHINE_BATCH, 0);
    assert!(added.len() < 300 && added.len() + crate::machines::MACHINE_BATCH >= 300);
    assert!(!err.is_refusal(), "something was added: {err}");
    let left = 1000 - added.len();
    assert!(cause
        .to_string()
        .starts_with("state database error: injected failure"));
    assert_eq!(
        err.to_string(),
        format!(
            "{cause}; {} of the 1000 machines were added (`1` to `{}`): add the other {left} (`-n {left}`)",
            added.len(),
            added.len()
        )
    );
    let machines = e.st.machines().unwrap();
    assert_eq!(machines.len(), 1 + added.len());
    // Retrying what the error says finishes the request.
    clear_failure(&e);
    e.st.add_machines(left, None, None).unwrap();
    assert_eq!(e.st.machines().unwrap().len(), 1001);
}

#[test]
fn units_added_before_a_failed_batch_are_whole_and_the_error_says_what_is_left() {
    let e = env();
    fail_machine_insert(&e, 200);
    let err =
        e.st.deploy(&deploy_args(WORDPRESS, "wordpress", 500))
            .unwrap_err();
    let Error::Incomplete { added, cause, .. } = &err else {
        panic!("{err}");
    };
    let n = added.len();
    assert!(n > 0 && n < 200, "{err}");
    assert!(cause
        .to_string()
        .starts_with("state database error: injected failure"));
    assert_eq!(
        err.to_string(),
        format!(
            "{cause}; {n} of the 500 units were added (`wordpress/0` to `wordpress/{}`): add the other {} (`-n {}`)",
            n - 1,
            500 - n,
            500 - n
        )
    );
    let svc = e.st.service("wordpress").unwrap();
    assert_eq!(svc.unit_count as usize, n);
    assert_eq!(e.st.units_of("wordpress").unwrap().len(), n);
    clear_failure(&e);
    e.st.add_units("wordpress", 500 - n, None).unwrap();
    assert_eq!(e.st.service("wordpress").unwrap().unit_count, 500);
}

#[test]
fn preparing_many_machines_for_provisioning_keeps_every_transaction_bounded() {
    let e = env();
    let ids = e.st.add_machines(2000, None, None).unwrap();
    e.st.reset_stats();
    let prepared = e.st.prepare_provisioning(&ids, UUID).unwrap();
    assert_eq!(prepared.len(), 2000);
    let stats = e.st.stats();
    assert!(stats.max_transaction_rows <= BOUND, "{stats:?}");
    // Every machine has its nonce committed; preparing again reuses them.
    let again = e.st.prepare_provisioning(&ids, UUID).unwrap();
    assert_eq!(again, prepared);
    e.st.reset_stats();
    let started = started_as_prepared(&prepared);
    let recorded = e.st.record_instances(&started).unwrap();
    assert_eq!(recorded.len(), 2000);
    let stats = e.st.stats();
    assert!(stats.max_transaction_rows <= BOUND, "{stats:?}");
    assert!(e
        .st
        .machines()
        .unwrap()
        .iter()
        .all(|m| m.id == 0 || m.status == machine_status::STARTED));
}

#[test]
fn retry_provisioning_all_survives_a_machine_resolved_meanwhile() {
    let e = env();
    let ids = e.st.add_machines(3, None, None).unwrap();
    for &id in &ids {
        e.st.set_machine_status(id, machine_status::ERROR, "no capacity")
            .unwrap();
    }
    // Another client resolves machine ids[1] while `retry-provisioning
    // --all` runs: it holds the write lock from before `--all` looks until
    // after, and commits while `--all` waits for the lock.
    let other = Store::open_at(e.st.location(), Durability::Relaxed).unwrap();
    let racer = ids[1];
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let other = std::thread::spawn(move || {
        other
            .write(|tx| {
                crate::machines::resolve_in(tx, racer, None)?;
                let _ = locked_tx.send(());
                // Long enough for `--all` to read its list if it reads
                // outside its write transaction; the busy timeout (5 s)
                // outlasts it. (Ordering, not timing, is under test.)
                std::thread::sleep(std::time::Duration::from_millis(300));
                Ok(())
            })
            .unwrap();
    });
    locked_rx.recv().unwrap();
    let retried = e.st.retry_all_provisioning().unwrap();
    other.join().unwrap();
    assert_eq!(retried, (vec![ids[0], ids[2]], 2));
    for id in ids {
        assert_eq!(e.st.machine(id).unwrap().status, machine_status::PENDING);
    }
}

#[test]
fn retry_provisioning_all_works_in_bounded_batches() {
    let e = env();
    let ids = e.st.add_machines(1500, None, None).unwrap();
    for &id in &ids {
        e.st.set_machine_status(id, machine_status::ERROR, "no capacity")
            .unwrap();
    }
    e.st.reset_stats();
    // The answer names the first few and counts them all, whatever their
    // number.
    assert_eq!(
        e.st.retry_all_provisioning().unwrap(),
        (ids[..crate::MAX_LISTED].to_vec(), 1500)
    );
    let stats = e.st.stats();
    assert!(stats.max_transaction_rows <= BOUND, "{stats:?}");
    assert_eq!(e.st.machines_in_error(1).unwrap(), (Vec::new(), 0));
    // Nothing in error: nothing to do, and no error.
    assert_eq!(e.st.retry_all_provisioning().unwrap(), (Vec::new(), 0));
}

#[test]
fn series_jujube_does_not_know_are_refused_unless_the_environment_adds_them() {
    let e = env();
    let err = e.refused(|s| s.add_machines(1, Some("nosuch"), None));
    assert!(
        matches!(&err, Error::Model(jujube_core::Error::UnknownSeries(s)) if s == "nosuch"),
        "{err}"
    );
    let mut args = deploy_args(MYSQL, "mysql", 1);
    args.series = "nosuch".into();
    e.refused(|s| s.deploy(&args));
    e.st.add_machines(1, Some("noble"), None).unwrap();
    // An environment may know more.
    e.st.set_environment_config(&[("extra-series".into(), "nosuch, other".into())])
        .unwrap();
    e.st.add_machines(1, Some("nosuch"), None).unwrap();
    e.st.deploy(&args).unwrap();
    assert_eq!(e.st.service("mysql").unwrap().series, "nosuch");
    // Its value is a list of series names.
    let err =
        e.refused(|s| s.set_environment_config(&[("extra-series".into(), "ok,Not OK".into())]));
    assert!(
        matches!(err, Error::Model(jujube_core::Error::InvalidSeries(_))),
        "{err}"
    );
}

#[test]
fn bootstrap_refuses_an_unknown_default_series_unless_its_config_adds_it() {
    let (st, _place) = super::empty_store();
    let mut spec = EnvironmentSpec {
        name: "test".into(),
        uuid: UUID.into(),
        provider: "dummy".into(),
        default_series: "nosuch".into(),
        constraints: Constraints::default(),
        config: Default::default(),
    };
    assert!(matches!(
        st.initialize(&spec),
        Err(Error::Model(jujube_core::Error::UnknownSeries(_)))
    ));
    spec.config.insert("extra-series".into(), "nosuch".into());
    st.initialize(&spec).unwrap();
    assert_eq!(st.machine(0).unwrap().series, "nosuch");
}

#[test]
fn machine_constraints_fill_unset_keys_from_the_environment_at_creation() {
    let e = env_with("mem=4G cores=2 arch=amd64");
    let cons = Constraints::parse("cores=8 arch=").unwrap();
    let m = e.st.add_machines(1, None, Some(&cons)).unwrap()[0];
    // `cores` from the command, `mem` from the environment, and `arch=`
    // hides the environment's arch.
    assert_eq!(
        e.st.machine(m).unwrap().constraints.to_string(),
        "cores=8 mem=4G"
    );
    // Captured at creation: later environment changes do not reach it.
    e.st.set_environment_constraints(&Constraints::parse("mem=16G").unwrap())
        .unwrap();
    assert_eq!(
        e.st.machine(m).unwrap().constraints.to_string(),
        "cores=8 mem=4G"
    );
    let plain = e.st.add_machines(1, None, None).unwrap()[0];
    assert_eq!(
        e.st.machine(plain).unwrap().constraints.to_string(),
        "mem=16G"
    );
}

#[test]
fn an_enrollment_token_works_once_per_instance_of_its_batch_until_it_expires() {
    let e = env();
    let ids = e.st.add_machines(3, None, None).unwrap();
    // Machines 1 and 2 in one launch batch, 3 in another.
    let prepared =
        e.st.prepare_batches(&[vec![ids[0], ids[1]], vec![ids[2]]], UUID)
            .unwrap();
    let nonce = |id: i64| {
        prepared
            .iter()
            .find(|p| p.machine == id)
            .unwrap()
            .nonce
            .clone()
    };
    let batch = nonce(ids[0]).rsplit_once('/').unwrap().0.to_string();
    assert_eq!(nonce(ids[1]).rsplit_once('/').unwrap().0, batch);
    e.st.add_enrollment("hash", &batch, 1_000, 0).unwrap();
    assert_eq!(e.st.machine_by_nonce(&nonce(ids[1])).unwrap(), Some(ids[1]));

    let enroll = |machine: i64, instance: &str, now: i64| {
        e.st.enroll_machine(
            "hash",
            instance,
            machine,
            &format!("machine-{machine}"),
            "h",
            now,
        )
    };
    // A machine of another batch; then an expired token: refused, nothing
    // written (a later good enrollment of that instance still works).
    e.refused(|_| enroll(ids[2], "i-3", 10));
    e.refused(|_| enroll(ids[0], "i-1", 1_000));
    enroll(ids[0], "i-1", 10).unwrap();
    assert_eq!(
        e.st.agent_credential(&format!("machine-{}", ids[0]))
            .unwrap(),
        Some("h".to_string())
    );
    // Once per instance; another instance of the batch may still.
    let err = e.refused(|_| enroll(ids[0], "i-1", 11));
    assert_eq!(err.to_string(), crate::credentials::ENROLLMENT_REFUSED);
    enroll(ids[1], "i-2", 12).unwrap();
    // An unknown token.
    e.refused(|s| s.enroll_machine("other", "i-9", ids[1], "machine-2", "h", 12));
}

/// A cached statement is parsed and planned once, whatever values are bound
/// to it later. SQLite marks a statement for re-preparation on every new
/// binding when its plan could depend on the value; unchecked, every agent
/// read re-parsed its queries (four-fifths of a unit's context read).
#[test]
fn cached_statements_are_not_prepared_again_for_new_values() {
    let e = super::sqlite_env();
    let units = e.deploy(WORDPRESS, "wordpress", 3);
    e.st.add_machines(2, None, None).unwrap();
    let subordinates = format!(
        "SELECT {} FROM units WHERE principal = ?1 ORDER BY service, number",
        crate::model::UNIT_COLS
    );
    let by_machine = format!(
        "SELECT {} FROM units WHERE machine_id = ?1 ORDER BY service, number",
        crate::model::UNIT_COLS
    );
    for u in &units {
        e.st.unit_context(u).unwrap();
    }
    for id in 1..=3 {
        let _ = e.st.machine_context(id);
    }
    let reprepared = |sql: &str| {
        e.st.read(|c| {
            Ok(c.prepare_cached(sql)?
                .as_sqlite()
                .expect("a store on SQLite")
                .get_status(rusqlite::StatementStatus::RePrepare))
        })
        .unwrap()
    };
    assert_eq!(reprepared(&subordinates), 0, "{subordinates}");
    assert_eq!(reprepared(&by_machine), 0, "{by_machine}");
}

#[test]
fn the_database_and_its_wal_are_the_owners_alone_and_loose_ones_are_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    {
        let st = crate::Store::open(&path).unwrap();
        // A write, so that the WAL exists.
        st.initialize(&spec("")).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.path().join("state.db-wal")), 0o600);
        assert_eq!(mode(&dir.path().join("state.db-shm")), 0o600);
    }
    // One made 0644 by an earlier version is tightened at open.
    for f in ["state.db", "state.db-wal"] {
        let p = dir.path().join(f);
        if p.exists() {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
    let _st = crate::Store::open(&path).unwrap();
    assert_eq!(mode(&path), 0o600);
}

#[test]
fn relation_settings_and_service_settings_are_bounded_at_the_write() {
    use crate::relations::{MAX_RELATION_SETTINGS_BYTES, MAX_RELATION_SETTING_KEY_BYTES};
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    let w = &ws[0];
    e.st.enter_scope(rel.id, w).unwrap();
    let big = "x".repeat(900 << 10);
    let half = "y".repeat(MAX_RELATION_SETTINGS_BYTES / 2);
    e.st.update_relation_settings(rel.id, w, &[("a".into(), Some(half.clone()))])
        .unwrap();
    let before = e.st.head_revision().unwrap();
    // One value too big, or many that add up: refused, nothing changed.
    for changes in [
        vec![("big".to_string(), Some(big.clone()))],
        vec![("b".to_string(), Some(half.clone()))],
        vec![(
            "k".repeat(MAX_RELATION_SETTING_KEY_BYTES + 1),
            Some("v".to_string()),
        )],
    ] {
        let err =
            e.st.update_relation_settings(rel.id, w, &changes)
                .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("a unit may hold in one relation")
                || text.contains("a key is 1 to 256 bytes"),
            "{text}"
        );
    }
    assert_eq!(
        e.st.head_revision().unwrap(),
        before,
        "a refused write changed nothing"
    );
    assert_eq!(e.st.relation_settings(rel.id, w).unwrap()["a"], half);
    // Deleting to make room, then setting, fits.
    e.st.update_relation_settings(rel.id, w, &[("a".into(), None), ("b".into(), Some(half))])
        .unwrap();

    // A service setting's value.
    let huge = "z".repeat(crate::services::MAX_SERVICE_SETTING_BYTES + 1);
    let err =
        e.st.set_service_settings("wordpress", &[("title".into(), huge)])
            .unwrap_err();
    assert!(
        err.to_string()
            .contains("more than the 262144 a setting may hold"),
        "{err}"
    );
}

#[test]
fn resolved_all_marks_every_unit_in_error_in_bounded_transactions() {
    let e = env();
    let units = e.deploy(MYSQL, "mysql", 2500);
    for u in &units[..2100] {
        e.st.apply(
            &crate::Caller::Unit(u.clone()),
            &crate::AgentOp::SetUnitStatus {
                unit: u.clone(),
                status: "error".into(),
                info: "hook failed: \"install\"".into(),
            },
        )
        .unwrap();
    }
    assert_eq!(e.st.units_in_error(3).unwrap().len(), 3);
    e.st.resolve_unit(&units[0], false).unwrap();
    e.st.reset_stats();
    let (listed, count) = e.st.resolve_all_units(true).unwrap();
    assert_eq!(count, 2099, "every unit in error not marked yet");
    // Named: the first few by name, not all 2,099.
    let mut names = units[1..2100].to_vec();
    names.sort();
    assert_eq!(listed, names[..crate::MAX_LISTED]);
    assert!(
        e.st.stats().max_transaction_rows <= BOUND,
        "{:?}",
        e.st.stats()
    );
    assert_eq!(
        e.st.unit(&units[1]).unwrap().resolved.as_deref(),
        Some("retry-hooks")
    );
    assert_eq!(
        e.st.unit(&units[0]).unwrap().resolved.as_deref(),
        Some("no-hooks")
    );
    assert_eq!(
        e.st.unit(&units[2200]).unwrap().resolved,
        None,
        "not in error"
    );
    assert!(e.st.units_in_error(10).unwrap().is_empty());
    // Nothing left: a no-op.
    assert_eq!(e.st.resolve_all_units(false).unwrap(), (Vec::new(), 0));
}

/// A charm's workload status message and version are bounded at the write:
/// a larger one is refused saying so, and nothing changes.
#[test]
fn workload_status_messages_and_versions_are_bounded_at_the_write() {
    use crate::agents::{AgentOp, Caller, MAX_WORKLOAD_MESSAGE_BYTES, MAX_WORKLOAD_VERSION_BYTES};
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let apply = |op: AgentOp| {
        e.st.apply_batch(&[(Caller::Unit(w.clone()), op)])
            .unwrap()
            .remove(0)
    };
    let status = |message: String| AgentOp::SetWorkloadStatus {
        unit: w.clone(),
        application: false,
        status: "active".into(),
        message,
    };
    apply(status("x".repeat(MAX_WORKLOAD_MESSAGE_BYTES))).unwrap();
    let before = e.digest();
    let err = apply(status("x".repeat(MAX_WORKLOAD_MESSAGE_BYTES + 1))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a status message of 2049 bytes is more than 2048; shorten it"
    );
    let err = apply(AgentOp::SetWorkloadVersion {
        unit: w.clone(),
        version: "v".repeat(MAX_WORKLOAD_VERSION_BYTES + 1),
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "a workload version of 257 bytes is more than 256; shorten it"
    );
    assert_eq!(e.digest(), before, "a refused write changed nothing");
    let (_, message) = e.st.workload_status(&w, false).unwrap();
    assert_eq!(message.len(), MAX_WORKLOAD_MESSAGE_BYTES);
}

/// A unit opens at most `MAX_OPEN_PORT_RANGES` port ranges: one more is
/// refused saying so, changing nothing; opening one already open, and
/// closing, still work at the bound.
#[test]
fn a_units_open_ports_are_bounded_at_the_write() {
    use crate::agents::{AgentOp, Caller, MAX_OPEN_PORT_RANGES};
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let port = |port: String, open: bool| {
        e.st.apply_batch(&[(
            Caller::Unit(w.clone()),
            AgentOp::SetPort {
                unit: w.clone(),
                port,
                open,
            },
        )])
        .unwrap()
        .remove(0)
    };
    for p in 0..MAX_OPEN_PORT_RANGES {
        port(format!("{}/tcp", 1000 + p), true).unwrap();
    }
    port("1000/tcp".into(), true).unwrap();
    let before = e.digest();
    let err = port("80/tcp".into(), true).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("unit `{w}` has {MAX_OPEN_PORT_RANGES} port ranges open, the most a unit may have; close some (`close-port`) or open one range for many ports (`open-port 1000-2000/tcp`)")
    );
    assert_eq!(e.digest(), before, "a refused write changed nothing");
    port("1000/tcp".into(), false).unwrap();
    port("80/tcp".into(), true).unwrap();
    assert_eq!(
        e.st.unit_context(&w).unwrap().ports.len(),
        MAX_OPEN_PORT_RANGES
    );
}

/// An agent's status message is bounded at the write, the unit's and the
/// machine's: a larger one is refused saying so, and nothing changes.
#[test]
fn agent_status_messages_are_bounded_at_the_write() {
    use crate::agents::{AgentOp, Caller, MAX_STATUS_INFO_BYTES};
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let m = e.st.unit(&w).unwrap().machine_id.unwrap();
    let apply = |by: Caller, op: AgentOp| e.st.apply_batch(&[(by, op)]).unwrap().remove(0);
    let unit = |info: String| AgentOp::SetUnitStatus {
        unit: w.clone(),
        status: "error".into(),
        info,
    };
    let machine = |info: String| AgentOp::SetMachineAgentStatus {
        machine: m,
        status: "error".into(),
        info,
    };
    apply(
        Caller::Unit(w.clone()),
        unit("x".repeat(MAX_STATUS_INFO_BYTES)),
    )
    .unwrap();
    apply(
        Caller::Machine(m),
        machine("y".repeat(MAX_STATUS_INFO_BYTES)),
    )
    .unwrap();
    let before = e.digest();
    let err = apply(
        Caller::Unit(w.clone()),
        unit("x".repeat(MAX_STATUS_INFO_BYTES + 1)),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "an agent status message of 2049 bytes is more than 2048; shorten it"
    );
    let err = apply(Caller::Machine(m), machine("y".repeat(1 << 20))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "an agent status message of 1048576 bytes is more than 2048; shorten it"
    );
    assert_eq!(e.digest(), before, "a refused write changed nothing");
    assert_eq!(
        e.st.unit(&w).unwrap().status_info.len(),
        MAX_STATUS_INFO_BYTES
    );
}

/// One answer of a scope's members with their settings holds at most
/// `MAX_SCOPE_SETTINGS_BYTES` of settings: later members come named,
/// without settings, and read one by one they are whole.
#[test]
fn a_scopes_settings_in_one_answer_are_bounded() {
    use crate::agents::MAX_SCOPE_SETTINGS_BYTES;
    use crate::relations::MAX_RELATION_SETTINGS_BYTES;
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 1);
    let ms = e.deploy(MYSQL, "mysql", 6);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    let value = "v".repeat(MAX_RELATION_SETTINGS_BYTES - 1024);
    for m in &ms {
        e.st.enter_scope(rel.id, m).unwrap();
        e.st.update_relation_settings(rel.id, m, &[("blob".into(), Some(value.clone()))])
            .unwrap();
    }
    let answer = e.st.scope_settings_seen_by(rel.id, &ws[0], None).unwrap();
    assert_eq!(
        answer
            .units
            .iter()
            .map(|(u, _)| u.as_str())
            .collect::<Vec<_>>(),
        ms.iter().map(String::as_str).collect::<Vec<_>>()
    );
    let carried: usize = answer
        .units
        .iter()
        .filter_map(|(_, s)| s.as_ref())
        .map(|s| s["blob"].len())
        .sum();
    assert!(
        carried <= MAX_SCOPE_SETTINGS_BYTES,
        "{carried} bytes in one answer"
    );
    let (with, without): (Vec<_>, Vec<_>) = answer.units.iter().partition(|(_, s)| s.is_some());
    assert_eq!(
        with.len(),
        MAX_SCOPE_SETTINGS_BYTES / value.len(),
        "the first ones carry theirs"
    );
    assert!(!without.is_empty());
    for (u, _) in without {
        assert_eq!(e.st.relation_settings(rel.id, u).unwrap()["blob"], value);
    }
}

/// A scope's members come in pages of at most `MAX_SCOPE_MEMBERS`, in
/// unit order (by number, not by name's text), each after a cursor that
/// need not name a unit that still exists; a cursor that is not a unit's
/// name is refused, changing nothing.
#[test]
fn a_scopes_members_come_in_bounded_pages() {
    use crate::agents::MAX_SCOPE_MEMBERS;
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 1);
    let ms = e.deploy(MYSQL, "mysql", MAX_SCOPE_MEMBERS + 3);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    for m in &ms {
        e.st.enter_scope(rel.id, m).unwrap();
    }
    let names = |after: Option<&str>| e.st.scope_units_seen_by(rel.id, &ws[0], after).unwrap();
    let settled = |after: Option<&str>| {
        e.st.scope_settings_seen_by(rel.id, &ws[0], after)
            .unwrap()
            .units
            .into_iter()
            .map(|(u, _)| u)
            .collect::<Vec<_>>()
    };
    let first = names(None);
    assert_eq!(first, ms[..MAX_SCOPE_MEMBERS]);
    assert_eq!(settled(None), first);
    let last = first.last().unwrap().as_str();
    assert_eq!(last, format!("mysql/{}", MAX_SCOPE_MEMBERS - 1));
    assert_eq!(names(Some(last)), ms[MAX_SCOPE_MEMBERS..]);
    assert_eq!(settled(Some(last)), ms[MAX_SCOPE_MEMBERS..]);
    assert!(names(Some(ms.last().unwrap())).is_empty());
    // After a unit that is gone, or never was: where it would be.
    assert_eq!(names(Some("mysql/500")), ms[501..]);
    assert_eq!(names(Some("aaa/7")), first);
    for bad in ["mysql", "mysql/x", "/3", "mysql/-1"] {
        let err = e.refused(|s| s.scope_units_seen_by(rel.id, &ws[0], Some(bad)));
        assert_eq!(
            err.to_string(),
            format!(
                "invalid unit name `{bad}`: a page of a scope starts after a unit named `SERVICE/N`"
            )
        );
        e.refused(|s| s.scope_settings_seen_by(rel.id, &ws[0], Some(bad)));
    }
}

/// An instance belongs to at most one machine (the partial unique index of
/// migration 20 keeps UNIQUE's rule for the ids that are set).
#[test]
fn two_machines_cannot_record_the_same_instance() {
    let e = env();
    let units = e.deploy(MYSQL, "mysql", 2);
    assert_eq!(units.len(), 2);
    let set = |id: i64| {
        e.st.write(|tx| {
            Ok(tx.execute(
                "UPDATE machines SET instance_id = 'i-same' WHERE id = ?1",
                [id],
            )?)
        })
    };
    assert_eq!(set(1).unwrap(), 1);
    let err = set(2).unwrap_err();
    assert!(err.to_string().to_lowercase().contains("unique"), "{err}");
}

/// `status-get --application` answers its service's leader, and only it,
/// with every unit's status up to its bound of names and messages; beyond
/// it, the read is refused saying so (the answer is one message).
#[test]
fn an_application_status_answers_the_leader_within_its_bound() {
    use crate::agents::{
        AgentOp, Caller, MAX_APPLICATION_STATUS_BYTES, MAX_WORKLOAD_MESSAGE_BYTES,
    };
    let e = env();
    // Units whose messages fill the bound to within one unit's share.
    let fit = MAX_APPLICATION_STATUS_BYTES / (MAX_WORKLOAD_MESSAGE_BYTES + 20);
    let units = e.deploy(WORDPRESS, "wordpress", fit + 1);
    let (leader, other) = (&units[0], &units[1]);
    assert!(e.st.claim_leadership(leader).unwrap());
    let err = e.st.application_status(other).unwrap_err();
    assert!(
        err.to_string().contains("this unit is not the leader"),
        "{err}"
    );
    let long = |u: &String| {
        (
            Caller::Unit(u.clone()),
            AgentOp::SetWorkloadStatus {
                unit: u.clone(),
                application: false,
                status: "active".into(),
                message: "m".repeat(MAX_WORKLOAD_MESSAGE_BYTES),
            },
        )
    };
    let ops: Vec<_> = units[..fit].iter().map(long).collect();
    assert!(e.st.apply_batch(&ops).unwrap().iter().all(|r| r.is_ok()));
    let app = e.st.application_status(leader).unwrap();
    assert_eq!(app.units.len(), fit + 1);
    assert_eq!(app.units[1].0, units[1]);
    assert_eq!(app.units[1].1, "active");
    assert_eq!(app.units[fit].1, "unknown");
    e.st.apply_batch(&[long(&units[fit])])
        .unwrap()
        .remove(0)
        .unwrap();
    let err = e.st.application_status(leader).unwrap_err().to_string();
    assert!(
        err.contains("more units than one answer lists")
            && err.contains("`jujube status wordpress`"),
        "{err}"
    );
}

/// A service's settings are bounded in all, keys and values, at the write
/// (`set` and `deploy --config` alike): one more value over the total is
/// refused, changing nothing; resetting one in the same command makes room.
#[test]
fn a_services_settings_are_bounded_in_all_at_the_write() {
    use crate::services::{MAX_SERVICE_SETTINGS_BYTES, MAX_SERVICE_SETTING_BYTES};
    let e = env();
    let mut args = deploy_args(MYSQL, "mysql", 0);
    let options: String = ["a", "b", "c", "d"]
        .iter()
        .map(|k| format!("  {k}:\n    type: string\n    default: x\n"))
        .collect();
    args.charm.config =
        jujube_core::charm::CharmConfig::parse("mysql", &format!("options:\n{options}")).unwrap();
    let value = "v".repeat(MAX_SERVICE_SETTING_BYTES);
    args.settings = ["a", "b", "c"]
        .iter()
        .map(|k| (k.to_string(), value.clone()))
        .collect();
    e.st.deploy(&args).unwrap();
    let err = e.refused(|s| s.set_service_settings("mysql", &[("d".into(), value.clone())]));
    assert_eq!(
        err.to_string(),
        format!(
            "the settings of service `mysql` would hold {} bytes, more than the {MAX_SERVICE_SETTINGS_BYTES} a service's settings may hold in all; nothing was changed: reset some (`jujube set mysql KEY=`) or pass large data another way (a file, a URL)",
            // Four keys of one byte, four values stored as JSON strings.
            4 * (1 + MAX_SERVICE_SETTING_BYTES + 2)
        )
    );
    e.st.set_service_settings("mysql", &[("a".into(), String::new()), ("d".into(), value)])
        .unwrap();
    let set: Vec<String> =
        e.st.service_settings("mysql")
            .unwrap()
            .into_iter()
            .filter(|s| s.value.is_some())
            .map(|s| s.key)
            .collect();
    assert_eq!(set, ["b", "c", "d"]);
    // A deploy whose settings add up to more is refused whole.
    let mut args = deploy_args(MYSQL, "other", 0);
    args.charm.config =
        jujube_core::charm::CharmConfig::parse("mysql", &format!("options:\n{options}")).unwrap();
    args.settings = ["a", "b", "c", "d"]
        .iter()
        .map(|k| (k.to_string(), "w".repeat(MAX_SERVICE_SETTING_BYTES)))
        .collect();
    let err = e.refused(|s| s.deploy(&args));
    assert!(
        err.to_string()
            .contains("the settings of service `other` would hold"),
        "{err}"
    );
}

/// A machine hosts a bounded number of principal units (`--to`): a
/// placement past it is refused, whole, saying where else to put them.
#[test]
fn a_machine_hosts_a_bounded_number_of_units() {
    use crate::units::MAX_UNITS_PER_MACHINE;
    let e = env();
    e.deploy(MYSQL, "mysql", 0);
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    e.st.add_units("mysql", MAX_UNITS_PER_MACHINE - 1, Some(m))
        .unwrap();
    let message = |hosted: usize| {
        format!(
            "cannot place more units on machine `{m}`: it hosts {hosted}, and a machine hosts at most {MAX_UNITS_PER_MACHINE}; place them on another machine, or add units without `--to` to give each a machine of its own"
        )
    };
    let err = e.refused(|s| s.add_units("mysql", 2, Some(m)));
    assert_eq!(err.to_string(), message(MAX_UNITS_PER_MACHINE - 1));
    e.st.add_units("mysql", 1, Some(m)).unwrap();
    let err = e.refused(|s| s.add_units("mysql", 1, Some(m)));
    assert_eq!(err.to_string(), message(MAX_UNITS_PER_MACHINE));
    // Elsewhere, as many as asked.
    assert_eq!(e.st.add_units("mysql", 2, None).unwrap().len(), 2);
}

/// A service joins a bounded number of relations: each of its units'
/// agents reads them all. One more is refused, changing nothing.
#[test]
fn a_service_joins_a_bounded_number_of_relations() {
    use crate::relations::MAX_RELATIONS_PER_SERVICE;
    const APP: &str = "name: app\nsummary: a\nrequires:\n  db:\n    interface: mysql\n";
    let e = env();
    e.deploy(MYSQL, "mysql", 0);
    for i in 0..=MAX_RELATIONS_PER_SERVICE {
        e.deploy(APP, &format!("app-n{i}"), 0);
        if i < MAX_RELATIONS_PER_SERVICE {
            e.st.add_relation(&format!("app-n{i}"), "mysql").unwrap();
        }
    }
    let err = e.refused(|s| s.add_relation(&format!("app-n{MAX_RELATIONS_PER_SERVICE}"), "mysql"));
    assert_eq!(
        err.to_string(),
        format!(
            "cannot relate `app-n{MAX_RELATIONS_PER_SERVICE}` and `mysql`: service `mysql` is in {MAX_RELATIONS_PER_SERVICE} relations, the most a service may join; remove one first (`jujube destroy-relation`)"
        )
    );
    assert_eq!(
        e.st.service("mysql").unwrap().relation_count,
        MAX_RELATIONS_PER_SERVICE as i64
    );
}

/// The strays view records a bounded number, the first seen, and counts
/// the rest: however many tagged instances the cloud holds, its
/// replacement is one bounded transaction and `status` lists as many.
#[test]
fn the_strays_view_is_bounded_and_counts_the_rest() {
    use crate::provisioning::{Stray, MAX_STRAYS_RECORDED};
    let e = env();
    let n = MAX_STRAYS_RECORDED + 44;
    // Seen in reverse: the view keeps the first seen, whatever the order.
    let strays: Vec<Stray> = (0..n)
        .rev()
        .map(|i| Stray {
            instance_id: format!("i-{i:05}"),
            machine_tag: String::new(),
            class: "unknown".into(),
            first_seen: 1_000 + i as i64,
            reap_at: Some(2_000 + i as i64),
        })
        .collect();
    e.st.reset_stats();
    e.st.set_strays(&strays).unwrap();
    let rows = e.st.stats().max_transaction_rows;
    assert!(rows <= 1000, "largest transaction {rows} rows");
    let kept = e.st.strays().unwrap();
    assert_eq!(kept.len(), MAX_STRAYS_RECORDED);
    assert_eq!(kept[0].instance_id, "i-00000");
    assert_eq!(
        kept.last().unwrap().instance_id,
        format!("i-{:05}", MAX_STRAYS_RECORDED - 1)
    );
    assert_eq!(e.st.strays_unlisted().unwrap(), 44);
    let status = e.st.status().unwrap();
    assert_eq!(
        (status.strays.len(), status.strays_unlisted),
        (MAX_STRAYS_RECORDED, 44)
    );
    // The same view again writes nothing; a smaller one clears the count.
    let before = e.st.head_revision().unwrap();
    e.st.set_strays(&strays).unwrap();
    assert_eq!(e.st.head_revision().unwrap(), before);
    e.st.set_strays(&strays[n - 3..]).unwrap();
    assert_eq!(
        (
            e.st.strays().unwrap().len(),
            e.st.strays_unlisted().unwrap()
        ),
        (3, 0)
    );
}
