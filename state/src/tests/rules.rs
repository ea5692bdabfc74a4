//! One test per rule of lifecycles.txt, death-and-destruction.txt and the
//! Series and Constraints sections of provisioning.txt, named after it.

use super::*;
use crate::model::{machine_status, UNIT_PENDING};
use crate::{Entity, Error};
use jujube_core::{Constraints, Life};

fn started(e: &Env, unit: &str) {
    // Marks a unit as acted on by its agent, so destroying it goes through
    // Dying rather than the no-agent shortcut.
    e.st.set_unit_status(unit, "started", "").unwrap();
}

// ---- lifecycles.txt: fundamental truths -------------------------------

#[test]
fn all_entities_start_alive() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    let unit = e.st.unit(&units[0]).unwrap();
    assert_eq!(unit.life, Life::Alive);
    assert_eq!(
        e.st.machine(unit.machine_id.unwrap()).unwrap().life,
        Life::Alive
    );
    assert_eq!(e.st.service("wordpress").unwrap().life, Life::Alive);
    assert_eq!(rel.life, Life::Alive);
}

#[test]
fn no_entity_ever_changes_to_an_earlier_state() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 1);
    let u = &units[0];
    started(&e, u);
    e.st.destroy_units(std::slice::from_ref(u)).unwrap();
    e.st.ensure_dead_unit(u).unwrap();
    // Destroying a Dead unit is a no-op, never a step back to Dying.
    e.st.destroy_units(std::slice::from_ref(u)).unwrap();
    assert_eq!(e.st.unit(u).unwrap().life, Life::Dead);
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    e.st.ensure_dead_machine(m).unwrap();
    e.st.destroy_machine(m).unwrap();
    assert_eq!(e.st.machine(m).unwrap().life, Life::Dead);
}

// ---- machines --------------------------------------------------------

#[test]
fn machine_with_manage_environ_cannot_become_dying_or_dead() {
    let e = env();
    let m0 = e.st.machine(0).unwrap();
    assert!(m0.manages_environ());
    assert!(matches!(
        e.refused(|s| s.destroy_machine(0)),
        Error::ManagesEnvironment(0)
    ));
    assert!(matches!(
        e.refused(|s| s.ensure_dead_machine(0)),
        Error::ManagesEnvironment(0)
    ));
}

#[test]
fn principal_units_are_assigned_only_to_alive_machines_with_host_units() {
    let e = env();
    let m = e.st.add_machines(2, None, None).unwrap();
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.to = Some(m[0]);
    let units = e.st.deploy(&args).unwrap();
    assert_eq!(e.st.unit(&units[0]).unwrap().machine_id, Some(m[0]));
    let err = e.refused(|s| s.add_units("wordpress", 1, Some(0)));
    assert!(
        matches!(err, Error::CannotHostUnits { machine: 0, .. }),
        "{err}"
    );
    e.st.destroy_machine(m[1]).unwrap();
    let err = e.refused(|s| s.add_units("wordpress", 1, Some(m[1])));
    assert!(
        matches!(
            err,
            Error::NotAlive {
                kind: Entity::Machine,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        e.refused(|s| s.add_units("wordpress", 1, Some(99))),
        Error::NotFound { .. }
    ));
}

#[test]
fn destroy_machine_fails_while_alive_principal_units_are_assigned() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 1);
    let m = e.st.unit(&units[0]).unwrap().machine_id.unwrap();
    let err = e.refused(|s| s.destroy_machine(m));
    assert_eq!(
        err.to_string(),
        format!("machine `{m}` has assigned units `wordpress/0`; destroy them first with `jujube destroy-unit`")
    );
}

#[test]
fn destroy_machine_without_units_sets_it_dying_and_is_a_noop_after() {
    let e = env();
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    e.st.destroy_machine(m).unwrap();
    assert_eq!(e.st.machine(m).unwrap().life, Life::Dying);
    let before = e.digest();
    e.st.destroy_machine(m).unwrap();
    assert_eq!(
        before,
        e.digest(),
        "destroying a Dying machine must change nothing"
    );
}

#[test]
fn machine_with_dying_units_may_become_dying_but_not_dead_until_they_are_removed() {
    // The spec's future plan, built: Dying units no longer block
    // destroy-machine; the machine waits for their removal to become Dead.
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 1);
    let u = &units[0];
    started(&e, u);
    let m = e.st.unit(u).unwrap().machine_id.unwrap();
    e.st.destroy_units(std::slice::from_ref(u)).unwrap();
    e.st.destroy_machine(m).unwrap();
    assert_eq!(e.st.machine(m).unwrap().life, Life::Dying);
    let err = e.refused(|s| s.ensure_dead_machine(m));
    assert!(matches!(err, Error::MachineHasUnits { .. }), "{err}");
    e.st.ensure_dead_unit(u).unwrap();
    e.st.remove_unit(u).unwrap();
    e.st.ensure_dead_machine(m).unwrap();
    e.st.remove_machine(m).unwrap();
    assert!(matches!(e.st.machine(m), Err(Error::NotFound { .. })));
}

#[test]
fn removing_a_machine_requires_it_to_be_dead() {
    let e = env();
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    assert!(matches!(
        e.refused(|s| s.remove_machine(m)),
        Error::NotDead { .. }
    ));
    e.st.destroy_machine(m).unwrap();
    assert!(matches!(
        e.refused(|s| s.remove_machine(m)),
        Error::NotDead { .. }
    ));
    e.st.ensure_dead_machine(m).unwrap();
    e.st.remove_machine(m).unwrap();
}

#[test]
fn machine_ids_are_sequential_and_never_reused() {
    let e = env();
    let a = e.st.add_machines(2, None, None).unwrap();
    assert_eq!(a, vec![1, 2]);
    e.st.ensure_dead_machine(2).unwrap();
    e.st.remove_machine(2).unwrap();
    assert_eq!(e.st.add_machines(1, None, None).unwrap(), vec![3]);
    // Every machine but the controller gone: still never an old id.
    for id in [1, 3] {
        e.st.ensure_dead_machine(id).unwrap();
        e.st.remove_machine(id).unwrap();
    }
    assert_eq!(e.st.add_machines(1, None, None).unwrap(), vec![4]);
}

#[test]
fn unit_numbers_go_on_above_the_largest_removed_even_when_later_ones_remain() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 3);
    // The largest goes; a smaller one stays.
    e.st.destroy_units(&units[1..]).unwrap();
    assert_eq!(
        e.st.add_units("wordpress", 1, None).unwrap(),
        vec!["wordpress/3"]
    );
}

/// Units added together are written with multi-row statements of 1, 2, 4,
/// ... 64 rows: every count across those sizes gets consecutive names above
/// the largest ever used, a new machine each with the next ids and the
/// service's constraints, and a feed entry for each unit and machine.
#[test]
fn units_added_together_get_consecutive_names_a_machine_each_and_their_feed_entries() {
    let e = env_with("mem=4G");
    let first = e.deploy(WORDPRESS, "wordpress", 3);
    e.st.destroy_units(&first[2..]).unwrap();
    let mut next_unit = 3;
    let mut next_machine = e.st.machines().unwrap().iter().map(|m| m.id).max().unwrap() + 1;
    for n in [1, 2, 3, 64, 65, 127, 128] {
        let (since, _) = e.st.resume_point(0).unwrap();
        let names = e.st.add_units("wordpress", n, None).unwrap();
        let expected: Vec<String> = (next_unit..next_unit + n as i64)
            .map(|i| format!("wordpress/{i}"))
            .collect();
        assert_eq!(names, expected, "{n} units");
        let changes = e.st.changes_since(since, usize::MAX).unwrap().changes;
        for (i, name) in names.iter().enumerate() {
            let u = e.st.unit(name).unwrap();
            let m = next_machine + i as i64;
            assert_eq!(u.machine_id, Some(m), "{name}");
            assert_eq!(u.life, Life::Alive);
            let machine = e.st.machine(m).unwrap();
            assert_eq!(machine.constraints.to_string(), "mem=4G", "{m}");
            assert_eq!(u.constraints, machine.constraints, "{name}");
            assert!(machine.instance_id.is_none());
            for (kind, id) in [
                (crate::feed::ChangeKind::Unit, name.clone()),
                (crate::feed::ChangeKind::Machine, m.to_string()),
            ] {
                assert!(
                    changes.iter().any(|c| c.kind == kind && c.id == id),
                    "no feed entry for {id}"
                );
            }
        }
        next_unit += n as i64;
        next_machine += n as i64;
    }
    assert_eq!(
        e.st.service("wordpress").unwrap().unit_count,
        2 + (1 + 2 + 3 + 64 + 65 + 127 + 128)
    );
    // Machines added together likewise.
    let ids = e.st.add_machines(67, None, None).unwrap();
    assert_eq!(ids, (next_machine..next_machine + 67).collect::<Vec<_>>());
}

// ---- units -----------------------------------------------------------

#[test]
fn destroy_unit_sets_it_dying_and_is_a_noop_when_not_alive() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    e.st.destroy_units(std::slice::from_ref(&u)).unwrap();
    assert_eq!(e.st.unit(&u).unwrap().life, Life::Dying);
    let before = e.digest();
    e.st.destroy_units(std::slice::from_ref(&u)).unwrap();
    assert_eq!(before, e.digest());
}

#[test]
fn destroy_unit_does_not_work_on_subordinates() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("logging", "wordpress").unwrap();
    e.st.enter_scope(rel.id, &u).unwrap();
    let sub = e.st.subordinates(&u).unwrap().remove(0);
    let err = e.refused(|s| s.destroy_units(std::slice::from_ref(&sub)));
    assert!(matches!(err, Error::Subordinate { .. }), "{err}");
}

#[test]
fn destroy_unit_is_all_or_nothing() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 2);
    started(&e, &units[0]);
    let err = e.refused(|s| s.destroy_units(&[units[0].clone(), "wordpress/9".into()]));
    assert!(matches!(
        err,
        Error::NotFound {
            kind: Entity::Unit,
            ..
        }
    ));
    assert_eq!(e.st.unit(&units[0]).unwrap().life, Life::Alive);
}

#[test]
fn subordinate_becomes_dying_when_its_principal_is_destroyed() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("logging", "wordpress").unwrap();
    e.st.enter_scope(rel.id, &u).unwrap();
    let sub = e.st.subordinates(&u).unwrap().remove(0);
    e.st.enter_scope(rel.id, &sub).unwrap();
    e.st.destroy_units(std::slice::from_ref(&u)).unwrap();
    assert_eq!(e.st.unit(&u).unwrap().life, Life::Dying);
    assert_eq!(e.st.unit(&sub).unwrap().life, Life::Dying);
}

#[test]
fn unit_may_not_become_dead_while_subordinates_exist() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("logging", "wordpress").unwrap();
    e.st.enter_scope(rel.id, &u).unwrap();
    let sub = e.st.subordinates(&u).unwrap().remove(0);
    e.st.leave_scope(rel.id, &u).unwrap();
    let err = e.refused(|s| s.ensure_dead_unit(&u));
    assert_eq!(
        err.to_string(),
        format!(
            "unit `{u}` still has subordinates `{sub}`; they must be removed before it can be dead"
        )
    );
    e.st.ensure_dead_unit(&sub).unwrap();
    e.st.remove_unit(&sub).unwrap();
    e.st.ensure_dead_unit(&u).unwrap();
}

#[test]
fn unit_may_not_become_dead_while_in_relation_scope() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &u).unwrap();
    let err = e.refused(|s| s.ensure_dead_unit(&u));
    assert!(matches!(err, Error::UnitBusy { .. }), "{err}");
    e.st.leave_scope(rel.id, &u).unwrap();
    e.st.ensure_dead_unit(&u).unwrap();
}

#[test]
fn removing_a_unit_requires_it_to_be_dead_and_unassigns_it() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    let m = e.st.unit(&u).unwrap().machine_id.unwrap();
    assert!(matches!(
        e.refused(|s| s.remove_unit(&u)),
        Error::NotDead { .. }
    ));
    e.st.destroy_units(std::slice::from_ref(&u)).unwrap();
    assert!(matches!(
        e.refused(|s| s.remove_unit(&u)),
        Error::NotDead { .. }
    ));
    e.st.ensure_dead_unit(&u).unwrap();
    e.st.remove_unit(&u).unwrap();
    assert!(e.st.units_on_machine(m).unwrap().is_empty());
    assert_eq!(e.st.service("wordpress").unwrap().unit_count, 0);
    // The machine is free again: it can be destroyed.
    e.st.destroy_machine(m).unwrap();
}

#[test]
fn destroying_a_unit_no_agent_has_acted_on_removes_it_at_once() {
    // provisioning.txt: a unit on a machine that was never provisioned can
    // be removed directly by destroy-unit.
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    assert_eq!(e.st.unit(&u).unwrap().status, UNIT_PENDING);
    e.st.destroy_units(std::slice::from_ref(&u)).unwrap();
    assert!(matches!(e.st.unit(&u), Err(Error::NotFound { .. })));
    assert_eq!(e.st.service("wordpress").unwrap().unit_count, 0);
}

#[test]
fn unit_names_are_never_reused() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.st.destroy_units(&[u]).unwrap();
    assert_eq!(
        e.st.add_units("wordpress", 1, None).unwrap(),
        vec!["wordpress/1"]
    );
}

// ---- services --------------------------------------------------------

#[test]
fn services_with_duplicate_names_are_not_allowed() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    let err = e.refused(|s| s.deploy(&deploy_args(MYSQL, "wordpress", 1)));
    assert_eq!(
        err.to_string(),
        "service `wordpress` already exists; choose another name"
    );
}

#[test]
fn service_name_cannot_be_reused_until_the_old_service_is_removed() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    e.st.destroy_service("wordpress").unwrap();
    let err = e.refused(|s| s.deploy(&deploy_args(WORDPRESS, "wordpress", 1)));
    assert_eq!(
        err.to_string(),
        "service `wordpress` is being destroyed; wait until it is removed (see `jujube status`) before reusing it"
    );
    e.st.run_cleanups(10).unwrap();
    e.st.ensure_dead_unit(&u).unwrap();
    e.st.remove_unit(&u).unwrap();
    // The name's unit numbers go on where the removed service's stopped.
    assert_eq!(e.deploy(WORDPRESS, "wordpress", 1), vec!["wordpress/1"]);
}

#[test]
fn units_and_relations_are_added_only_to_alive_services() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    e.deploy(MYSQL, "mysql", 0);
    e.st.destroy_service("wordpress").unwrap();
    let err = e.refused(|s| s.add_units("wordpress", 1, None));
    assert!(
        matches!(
            err,
            Error::NotAlive {
                kind: Entity::Service,
                ..
            }
        ),
        "{err}"
    );
    let err = e.refused(|s| s.add_relation("wordpress", "mysql"));
    assert!(
        matches!(
            err,
            Error::NotAlive {
                kind: Entity::Service,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn destroyed_service_without_units_or_relations_is_removed_at_once() {
    let e = env();
    e.deploy(MYSQL, "mysql", 0);
    e.st.destroy_service("mysql").unwrap();
    assert!(matches!(e.st.service("mysql"), Err(Error::NotFound { .. })));
}

#[test]
fn destroyed_service_whose_relations_can_all_be_removed_is_removed_at_once() {
    let e = env();
    e.deploy(MYSQL, "mysql", 0);
    e.deploy(WORDPRESS, "wordpress", 0);
    e.st.add_relation("wordpress", "mysql").unwrap();
    assert_eq!(e.st.service("wordpress").unwrap().relation_count, 2); // peer + db
    e.st.destroy_service("wordpress").unwrap();
    assert!(matches!(
        e.st.service("wordpress"),
        Err(Error::NotFound { .. })
    ));
    // The counterpart's count dropped; the relation and peer relation went.
    assert_eq!(e.st.service("mysql").unwrap().relation_count, 0);
    assert!(e.st.relations().unwrap().is_empty());
}

#[test]
fn destroyed_service_with_units_becomes_dying_and_its_units_follow() {
    let e = env();
    let units = e.deploy(WORDPRESS, "wordpress", 3);
    for u in &units {
        started(&e, u);
    }
    e.st.destroy_service("wordpress").unwrap();
    let svc = e.st.service("wordpress").unwrap();
    assert_eq!(svc.life, Life::Dying);
    // The peer relation had no units in scope: removed, and counted.
    assert_eq!(svc.relation_count, 0);
    // Units become Dying through the cleanup, not the destroy transaction.
    assert!(units
        .iter()
        .all(|u| e.st.unit(u).unwrap().life == Life::Alive));
    assert_eq!(e.st.pending_cleanups().unwrap(), 1);
    e.st.run_cleanups(100).unwrap();
    assert!(units
        .iter()
        .all(|u| e.st.unit(u).unwrap().life == Life::Dying));
    assert_eq!(e.st.pending_cleanups().unwrap(), 0);
}

#[test]
fn destroyed_service_sets_relations_with_units_in_scope_dying() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    let m = e.deploy(MYSQL, "mysql", 1).remove(0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &m).unwrap();
    e.st.destroy_service("wordpress").unwrap();
    assert_eq!(e.st.relation(rel.id).unwrap().life, Life::Dying);
    // Peer relation removed (counted), db relation survives (still counted).
    assert_eq!(e.st.service("wordpress").unwrap().relation_count, 1);
    assert_eq!(e.st.service("mysql").unwrap().relation_count, 1);
}

#[test]
fn last_unit_removal_removes_dying_service_without_relations() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    e.st.destroy_service("wordpress").unwrap();
    e.st.run_cleanups(10).unwrap();
    e.st.ensure_dead_unit(&u).unwrap();
    e.st.remove_unit(&u).unwrap();
    assert!(matches!(
        e.st.service("wordpress"),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn last_unit_removal_keeps_dying_service_that_is_still_in_a_relation() {
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &w);
    let m = e.deploy(MYSQL, "mysql", 1).remove(0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &m).unwrap();
    e.st.destroy_service("wordpress").unwrap();
    e.st.run_cleanups(10).unwrap();
    e.st.ensure_dead_unit(&w).unwrap();
    e.st.remove_unit(&w).unwrap();
    let svc = e.st.service("wordpress").unwrap();
    assert_eq!(
        (svc.life, svc.unit_count, svc.relation_count),
        (Life::Dying, 0, 1)
    );
    // The last unit of the *other* service to leave removes it.
    e.st.leave_scope(rel.id, &m).unwrap();
    assert!(matches!(
        e.st.service("wordpress"),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(e.st.relation(rel.id), Err(Error::NotFound { .. })));
    assert_eq!(e.st.service("mysql").unwrap().relation_count, 0);
}

#[test]
fn destroy_service_is_a_noop_when_not_alive() {
    let e = env();
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &u);
    e.st.destroy_service("wordpress").unwrap();
    let before = e.digest();
    e.st.destroy_service("wordpress").unwrap();
    assert_eq!(before, e.digest());
}

#[test]
fn peer_relations_are_created_with_the_service() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    let rels = e.st.relations().unwrap();
    assert_eq!(rels.len(), 1);
    assert_eq!(rels[0].key, "wordpress:loadbalancer");
    assert_eq!(e.st.service("wordpress").unwrap().relation_count, 1);
}

// ---- relations -------------------------------------------------------

#[test]
fn relation_key_is_canonical_whatever_the_argument_order() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("mysql", "wordpress").unwrap();
    assert_eq!(rel.key, "wordpress:db mysql:db");
    let err = e.refused(|s| s.add_relation("wordpress:db", "mysql:db"));
    assert_eq!(
        err.to_string(),
        "relation `wordpress:db mysql:db` already exists"
    );
}

#[test]
fn identical_relation_cannot_be_added_until_the_old_one_is_removed() {
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    let err = e.refused(|s| s.add_relation("wordpress", "mysql"));
    assert!(
        matches!(
            err,
            Error::BeingDestroyed {
                kind: Entity::Relation,
                ..
            }
        ),
        "{err}"
    );
    e.st.leave_scope(rel.id, &w).unwrap();
    e.st.add_relation("wordpress", "mysql").unwrap();
}

#[test]
fn relations_need_matching_endpoints_and_refuse_ambiguity() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    e.deploy(WORDPRESS, "blog", 0);
    let err = e.refused(|s| s.add_relation("wordpress", "blog"));
    assert!(matches!(err, Error::Relation(_)), "{err}");
    e.deploy(MYSQL, "mysql", 0);
    let err = e.refused(|s| s.add_relation("wordpress:website", "mysql"));
    assert!(
        err.to_string()
            .starts_with("no relation between `wordpress:website` and `mysql`"),
        "{err}"
    );
    let err = e.refused(|s| s.add_relation("wordpress", "wordpress"));
    assert!(err.to_string().contains("to itself"), "{err}");
}

#[test]
fn destroyed_relation_without_units_in_scope_is_removed_decrementing_both_services() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.destroy_relation("mysql", "wordpress").unwrap();
    assert!(matches!(e.st.relation(rel.id), Err(Error::NotFound { .. })));
    assert_eq!(e.st.service("wordpress").unwrap().relation_count, 1);
    assert_eq!(e.st.service("mysql").unwrap().relation_count, 0);
}

#[test]
fn destroyed_relation_with_units_in_scope_becomes_dying_and_destroy_is_then_a_noop() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 2);
    let w = ws[0].clone();
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    assert_eq!(e.st.relation(rel.id).unwrap().life, Life::Dying);
    let before = e.digest();
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    assert_eq!(before, e.digest());
    // Units cannot join a Dying relation.
    let err = e.refused(|s| s.enter_scope(rel.id, &ws[1]));
    assert!(err.to_string().contains("is dying"), "{err}");
}

#[test]
fn last_unit_leaving_a_dying_relation_removes_it() {
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    let m = e.deploy(MYSQL, "mysql", 1).remove(0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    e.st.enter_scope(rel.id, &m).unwrap();
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    e.st.leave_scope(rel.id, &w).unwrap();
    assert_eq!(e.st.relation(rel.id).unwrap().unit_count, 1);
    e.st.leave_scope(rel.id, &m).unwrap();
    assert!(matches!(e.st.relation(rel.id), Err(Error::NotFound { .. })));
    assert_eq!(e.st.service("wordpress").unwrap().relation_count, 1);
    assert_eq!(e.st.service("mysql").unwrap().relation_count, 0);
    // Leaving again is a no-op.
    e.st.leave_scope(rel.id, &m).unwrap();
}

#[test]
fn removed_relation_settings_are_cleaned_up_later_in_batches() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 3);
    e.deploy(MYSQL, "mysql", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    for w in &ws {
        e.st.enter_scope(rel.id, w).unwrap();
        e.st.update_relation_settings(rel.id, w, &[("host".into(), Some(w.clone()))])
            .unwrap();
        e.st.leave_scope(rel.id, w).unwrap();
    }
    // Settings outlive the scope...
    assert_eq!(
        e.st.relation_settings(rel.id, &ws[0]).unwrap()["host"],
        ws[0]
    );
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    // ...and the relation, until the cleaner runs.
    assert!(e.st.relation_settings(rel.id, &ws[0]).is_ok());
    assert_eq!(e.st.pending_cleanups().unwrap(), 1);
    e.st.run_cleanups(10).unwrap();
    assert!(e.st.relation_settings(rel.id, &ws[0]).is_err());
    assert_eq!(e.st.pending_cleanups().unwrap(), 0);
}

#[test]
fn only_alive_units_enter_alive_relations_and_only_of_their_services() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 2);
    e.deploy(MYSQL, "mysql", 0);
    e.deploy(WORDPRESS, "blog", 0);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    started(&e, &ws[1]);
    e.st.destroy_units(&[ws[1].clone()]).unwrap();
    let err = e.refused(|s| s.enter_scope(rel.id, &ws[1]));
    assert!(
        matches!(
            err,
            Error::NotAlive {
                kind: Entity::Unit,
                ..
            }
        ),
        "{err}"
    );
    let b = e.st.add_units("blog", 1, None).unwrap().remove(0);
    let err = e.refused(|s| s.enter_scope(rel.id, &b));
    assert!(matches!(err, Error::Relation(_)), "{err}");
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    let before = e.digest();
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    assert_eq!(before, e.digest(), "entering twice changes nothing");
}

// ---- subordinates ----------------------------------------------------

#[test]
fn principal_entering_container_scope_creates_its_subordinate() {
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("wordpress", "logging").unwrap();
    assert_eq!(rel.key, "logging:juju-info wordpress:juju-info");
    e.st.enter_scope(rel.id, &w).unwrap();
    let subs = e.st.subordinates(&w).unwrap();
    assert_eq!(subs, vec!["logging/0"]);
    let sub = e.st.unit("logging/0").unwrap();
    assert_eq!(sub.principal.as_deref(), Some(w.as_str()));
    assert_eq!(sub.machine_id, None);
    assert_eq!(sub.series, "jammy");
    assert_eq!(e.st.service("logging").unwrap().unit_count, 1);
    // Entering again (or via a second container relation) never duplicates.
    e.st.leave_scope(rel.id, &w).unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    assert_eq!(e.st.subordinates(&w).unwrap().len(), 1);
}

#[test]
fn subordinate_services_get_no_units_from_deploy_or_add_unit() {
    let e = env();
    e.deploy(LOGGING, "logging", 0);
    assert!(matches!(
        e.refused(|s| s.add_units("logging", 1, None)),
        Error::Subordinate { .. }
    ));
    let err = e.refused(|s| s.deploy(&deploy_args(LOGGING, "logging2", 1)));
    assert!(matches!(err, Error::Subordinate { .. }), "{err}");
}

#[test]
fn subordinate_relations_are_only_between_services_of_equal_series() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    let mut args = deploy_args(LOGGING, "logging", 0);
    args.series = "noble".into();
    e.st.deploy(&args).unwrap();
    let err = e.refused(|s| s.add_relation("wordpress", "logging"));
    assert_eq!(
        err.to_string(),
        "relation `logging:juju-info wordpress:juju-info` is container-scoped, so both services must have the same series, but `wordpress` is `jammy` and `logging` is `noble`; deploy the subordinate with `--series jammy`"
    );
}

#[test]
fn a_charm_with_a_container_scoped_peer_relation_is_refused_at_deploy() {
    let e = env();
    // Parsing refuses such metadata already; a charm built in code must not
    // get past deploy either.
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.charm.meta.peers.get_mut("loadbalancer").unwrap().scope =
        jujube_core::charm::Scope::Container;
    let err = e.refused(|s| s.deploy(&args));
    assert_eq!(
        err.to_string(),
        "invalid charm `wordpress`: peer relation `loadbalancer` is container-scoped; a peer relation joins the units of one service, which never share a container: remove `scope: container` from it"
    );
}

#[test]
fn peer_relations_cannot_be_destroyed_alone() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 1);
    let peer = e.st.relations().unwrap().remove(0);
    assert_eq!(peer.key, "wordpress:loadbalancer");
    let msg = "relation `wordpress:loadbalancer` is a peer relation of service `wordpress` and lives as long as it; destroy the service to remove it";
    let err = e.refused(|s| s.destroy_relation_id(peer.id));
    assert_eq!(err.to_string(), msg);
    let err = e.refused(|s| s.destroy_relation("wordpress:loadbalancer", "wordpress"));
    assert_eq!(err.to_string(), msg);
}

#[test]
fn a_principal_cannot_enter_container_scope_until_its_old_subordinate_is_removed() {
    let e = env();
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    started(&e, &w);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("logging", "wordpress").unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    let sub = e.st.subordinates(&w).unwrap().remove(0);
    e.st.enter_scope(rel.id, &sub).unwrap();
    // The relation goes; its units leave; the subordinate's agent sets it
    // Dead but has not removed it yet when the relation is added again.
    e.st.destroy_relation("logging", "wordpress").unwrap();
    e.st.leave_scope(rel.id, &sub).unwrap();
    e.st.leave_scope(rel.id, &w).unwrap();
    e.st.ensure_dead_unit(&sub).unwrap();
    let again = e.st.add_relation("logging", "wordpress").unwrap();
    let err = e.refused(|s| s.enter_scope(again.id, &w));
    assert!(matches!(err, Error::CannotEnterScopeYet { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!("unit `{w}` cannot enter scope yet: its subordinate `{sub}` of service `logging` is dead and has not been removed; try again once it is removed")
    );
    e.st.remove_unit(&sub).unwrap();
    e.st.enter_scope(again.id, &w).unwrap();
    assert_eq!(e.st.subordinates(&w).unwrap(), vec!["logging/1"]);
}

#[test]
fn a_unit_sees_only_its_counterparts_in_scope_and_in_a_container_only_its_own_container() {
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 2);
    let ms = e.deploy(MYSQL, "mysql", 1);
    e.deploy(LOGGING, "logging", 0);
    let db = e.st.add_relation("wordpress", "mysql").unwrap();
    let logs = e.st.add_relation("logging", "wordpress").unwrap();
    let peer =
        e.st.relations_of("wordpress")
            .unwrap()
            .into_iter()
            .find(|r| r.key == "wordpress:loadbalancer")
            .unwrap();
    for w in &ws {
        e.st.enter_scope(db.id, w).unwrap();
        e.st.enter_scope(logs.id, w).unwrap();
        e.st.enter_scope(peer.id, w).unwrap();
    }
    e.st.enter_scope(db.id, &ms[0]).unwrap();
    let subs: Vec<String> = ws
        .iter()
        .map(|w| e.st.subordinates(w).unwrap().remove(0))
        .collect();
    for s in &subs {
        e.st.enter_scope(logs.id, s).unwrap();
    }
    for (w, s) in ws.iter().zip(&subs) {
        assert_eq!(e.st.scope_units(logs.id, w).unwrap(), vec![s.clone()]);
        assert_eq!(e.st.scope_units(logs.id, s).unwrap(), vec![w.clone()]);
    }
    // Global: the other side's units; peers: the others of its service.
    assert_eq!(e.st.scope_units(db.id, &ws[0]).unwrap(), ms);
    assert_eq!(e.st.scope_units(db.id, &ms[0]).unwrap(), ws);
    assert_eq!(
        e.st.scope_units(peer.id, &ws[0]).unwrap(),
        vec![ws[1].clone()]
    );
    let err = e.refused(|s| s.scope_units(db.id, &subs[0]));
    assert!(matches!(err, Error::Relation(_)), "{err}");
}

// ---- series ----------------------------------------------------------

#[test]
fn units_take_their_service_series_and_run_only_on_machines_of_that_series() {
    let e = env();
    let noble = e.st.add_machines(1, Some("noble"), None).unwrap()[0];
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.series = "noble".into();
    let u = e.st.deploy(&args).unwrap().remove(0);
    let unit = e.st.unit(&u).unwrap();
    assert_eq!(unit.series, "noble");
    assert_eq!(
        e.st.machine(unit.machine_id.unwrap()).unwrap().series,
        "noble"
    );
    e.st.add_units("wordpress", 1, Some(noble)).unwrap();
    e.deploy(MYSQL, "mysql", 0);
    let err = e.refused(|s| s.add_units("mysql", 1, Some(noble)));
    assert!(matches!(err, Error::SeriesMismatch { .. }), "{err}");
}

#[test]
fn charms_run_only_on_series_they_support() {
    let e = env();
    let mut args = deploy_args(&format!("{MYSQL}series: [focal]\n"), "mysql", 1);
    args.series = "jammy".into();
    let err = e.refused(|s| s.deploy(&args));
    assert!(matches!(err, Error::UnsupportedSeries { .. }), "{err}");
}

// ---- constraints -----------------------------------------------------

#[test]
fn unit_constraints_collapse_service_over_environment_at_creation() {
    let e = env_with("mem=4G cores=2 arch=amd64");
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.constraints = Constraints::parse("mem=8G arch=").unwrap();
    let u = e.st.deploy(&args).unwrap().remove(0);
    let unit = e.st.unit(&u).unwrap();
    assert_eq!(unit.constraints.to_string(), "cores=2 mem=8G");
    // The machine created for the unit copies the unit's constraints.
    let m = e.st.machine(unit.machine_id.unwrap()).unwrap();
    assert_eq!(m.constraints, unit.constraints);
}

#[test]
fn machine_added_without_a_unit_copies_environment_constraints() {
    let e = env_with("mem=4G");
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    assert_eq!(e.st.machine(m).unwrap().constraints.to_string(), "mem=4G");
    assert_eq!(e.st.machine(0).unwrap().constraints.to_string(), "mem=4G");
}

#[test]
fn subordinate_units_have_no_constraints() {
    let e = env_with("mem=4G");
    let w = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.deploy(LOGGING, "logging", 0);
    let mut args = deploy_args(LOGGING, "logging2", 0);
    args.constraints = Constraints::parse("mem=1G").unwrap();
    assert!(matches!(
        e.refused(|s| s.deploy(&args)),
        Error::Subordinate { .. }
    ));
    assert!(matches!(
        e.refused(|s| s.set_service_constraints("logging", &Constraints::parse("mem=1G").unwrap())),
        Error::Subordinate { .. }
    ));
    let rel = e.st.add_relation("wordpress", "logging").unwrap();
    e.st.enter_scope(rel.id, &w).unwrap();
    assert!(e.st.unit("logging/0").unwrap().constraints.is_empty());
}

#[test]
fn set_constraints_never_changes_existing_units_or_machines() {
    let e = env_with("cores=1");
    let u = e.deploy(WORDPRESS, "wordpress", 1).remove(0);
    e.st.set_environment_constraints(&Constraints::parse("cores=8").unwrap())
        .unwrap();
    e.st.set_service_constraints("wordpress", &Constraints::parse("mem=1G").unwrap())
        .unwrap();
    let unit = e.st.unit(&u).unwrap();
    assert_eq!(unit.constraints.to_string(), "cores=1");
    assert_eq!(
        e.st.machine(unit.machine_id.unwrap())
            .unwrap()
            .constraints
            .to_string(),
        "cores=1"
    );
}

#[test]
fn seed_constraint_story_gives_one_machine_with_old_and_two_with_new_constraints() {
    // provisioning.txt: deploy --constraints mem=2G wordpress;
    // set-constraints --service wordpress mem=3G; add-unit wordpress -n 2.
    let e = env();
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.constraints = Constraints::parse("mem=2G").unwrap();
    e.st.deploy(&args).unwrap();
    e.st.set_service_constraints("wordpress", &Constraints::parse("mem=3G").unwrap())
        .unwrap();
    e.st.add_units("wordpress", 2, None).unwrap();
    let mut mems: Vec<String> =
        e.st.machines()
            .unwrap()
            .into_iter()
            .filter(|m| m.id != 0)
            .map(|m| m.constraints.to_string())
            .collect();
    mems.sort();
    assert_eq!(mems, vec!["mem=2G", "mem=3G", "mem=3G"]);
}

// ---- provisioning errors ---------------------------------------------

#[test]
fn resolved_clears_a_provisioning_error_and_can_replace_constraints() {
    let e = env();
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    let err = e.refused(|s| s.resolve_machine(m, None));
    assert_eq!(
        err.to_string(),
        format!("machine `{m}` has no provisioning error; `jujube resolved` only applies to machines in error")
    );
    e.st.set_machine_status(m, machine_status::ERROR, "no capacity")
        .unwrap();
    let cons = Constraints::parse("mem=4G").unwrap();
    e.st.resolve_machine(m, Some(&cons)).unwrap();
    let mm = e.st.machine(m).unwrap();
    assert_eq!(
        (mm.status.as_str(), mm.status_info.as_str()),
        (machine_status::PENDING, "")
    );
    assert_eq!(mm.constraints, cons);
}

#[test]
fn a_machine_is_provisioning_only_once_marked_and_abandoned_starts_go_back_to_pending() {
    use crate::provisioning::Prepared;
    let e = env();
    let ms = e.st.add_machines(2, None, None).unwrap();
    let prepared = e.st.prepare_provisioning(&ms, "6f1e0f4c").unwrap();
    assert_eq!(prepared.len(), 2);
    for m in &ms {
        let mm = e.st.machine(*m).unwrap();
        assert_eq!(mm.status, machine_status::PENDING, "a nonce is not a start");
        assert!(mm.nonce.is_some());
    }
    // A machine destroyed meanwhile, and a nonce that is no longer the
    // machine's, are not started.
    e.st.destroy_machine(ms[1]).unwrap();
    let stale = Prepared {
        machine: ms[0],
        nonce: "other".into(),
    };
    assert_eq!(e.st.mark_provisioning(&[stale]).unwrap(), Vec::<i64>::new());
    assert_eq!(e.st.mark_provisioning(&prepared).unwrap(), vec![ms[0]]);
    assert_eq!(
        e.st.machine(ms[0]).unwrap().status,
        machine_status::PROVISIONING
    );
    e.st.abandon_provisioning(&[ms[0]]).unwrap();
    let mm = e.st.machine(ms[0]).unwrap();
    assert_eq!(mm.status, machine_status::PENDING);
    assert_eq!(mm.nonce, Some(prepared[0].nonce.clone()), "the nonce stays");
}

#[test]
fn a_gone_instance_puts_the_machine_in_error_and_resolved_forgets_it() {
    use crate::provisioning::{Prepared, Started};
    let e = env();
    let m = e.st.add_machines(1, None, None).unwrap()[0];
    let Prepared { nonce, .. } = e.st.prepare_provisioning(&[m], "6f1e0f4c").unwrap()[0].clone();
    e.st.record_instances(&[Started {
        machine: m,
        nonce: nonce.clone(),
        instance_id: "i-1".into(),
        zone: Some("z".into()),
        hardware: "mem=1G".into(),
    }])
    .unwrap();
    let view = |e: &Env| {
        e.st.status()
            .unwrap()
            .machines
            .get(&m.to_string())
            .unwrap()
            .clone()
    };
    assert_eq!(view(&e).instance_status.as_deref(), Some("running"));
    assert!(
        !e.st.set_instance_gone(m, "i-other", "gone").unwrap(),
        "another instance"
    );
    assert!(e
        .st
        .set_instance_gone(m, "i-1", "instance `i-1` is gone")
        .unwrap());
    assert!(!e.st.set_instance_gone(m, "i-1", "again").unwrap(), "once");
    let v = view(&e);
    assert_eq!(
        (
            v.status.as_str(),
            v.status_info.as_str(),
            v.instance_status.as_deref()
        ),
        ("error", "instance `i-1` is gone", Some("gone"))
    );
    assert_eq!(v.instance_id.as_deref(), Some("i-1"));
    e.st.resolve_machine(m, None).unwrap();
    let mm = e.st.machine(m).unwrap();
    assert_eq!(
        (mm.instance_id, mm.zone, mm.hardware, mm.nonce),
        (None, None, None, None)
    );
    assert_eq!(mm.status, machine_status::PENDING);
}

#[test]
fn the_provider_status_keeps_its_first_failure_time_and_clears() {
    let e = env();
    assert_eq!(e.st.provider_status().unwrap(), None);
    e.st.set_provider_status(Some("listing zones: refused"), 100)
        .unwrap();
    e.st.set_provider_status(Some("listing instances: refused"), 160)
        .unwrap();
    let p = e.st.provider_status().unwrap().unwrap();
    assert_eq!(
        (p.message.as_str(), p.since),
        ("listing instances: refused", 100)
    );
    let rev = e.st.head_revision().unwrap();
    e.st.set_provider_status(Some("listing instances: refused"), 200)
        .unwrap();
    assert_eq!(e.st.head_revision().unwrap(), rev, "no change, no write");
    e.st.set_provider_status(None, 300).unwrap();
    assert_eq!(e.st.provider_status().unwrap(), None);
    assert_eq!(e.st.status().unwrap().environment.provider_status, None);
}

// ---- transactions ----------------------------------------------------

#[test]
fn deploying_many_units_keeps_every_transaction_bounded() {
    let e = env();
    e.st.reset_stats();
    e.deploy(WORDPRESS, "wordpress", 1000);
    assert_eq!(e.st.service("wordpress").unwrap().unit_count, 1000);
    assert!(
        e.st.stats().max_transaction_rows <= 1000,
        "{:?}",
        e.st.stats()
    );
    for u in e.st.units_of("wordpress").unwrap() {
        started(&e, &u.name);
    }
    e.st.reset_stats();
    e.st.destroy_service("wordpress").unwrap();
    e.st.run_cleanups(usize::MAX).unwrap();
    let stats = e.st.stats();
    assert!(stats.max_transaction_rows <= 1000, "{stats:?}");
    assert!(
        stats.transactions > (1000 / crate::cleanups::UNITS_BATCH) as u64,
        "the cleanup must work in batches: {stats:?}"
    );
    assert!(e
        .st
        .units_of("wordpress")
        .unwrap()
        .iter()
        .all(|u| u.life == Life::Dying));
}

#[test]
fn two_processes_writing_one_database_lose_nothing() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 0);
    let location = e.st.location().clone();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let location = location.clone();
            std::thread::spawn(move || {
                // A separate connection per thread is as separate as another
                // process: SQLite's file locks arbitrate between them, and
                // PostgreSQL's serializable transactions.
                let st = crate::Store::open_at(&location, crate::Durability::Relaxed).unwrap();
                for _ in 0..25 {
                    st.add_units("wordpress", 1, None).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(e.st.service("wordpress").unwrap().unit_count, 100);
    assert_eq!(e.st.units_of("wordpress").unwrap().len(), 100);
    assert_eq!(e.st.machines().unwrap().len(), 101);
}

#[test]
fn a_database_from_a_newer_jujube_is_refused() {
    let e = env();
    match e.st.path() {
        Some(path) => rusqlite::Connection::open(path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap(),
        None => {
            e.st.write(|tx| Ok(tx.execute("UPDATE schema_version SET version = 99", [])?))
                .unwrap();
        }
    }
    let err = crate::Store::open_at(e.st.location(), crate::Durability::Full)
        .err()
        .expect("newer schema must be refused");
    assert!(
        matches!(err, Error::SchemaTooNew { found: 99, .. }),
        "{err}"
    );
}

#[test]
fn launch_batches_commit_batch_nonces_before_the_start_and_keep_them() {
    let e = env();
    let ids = e.st.add_machines(4, None, None).unwrap();
    let uuid = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";
    let p =
        e.st.prepare_batches(&[ids[..3].to_vec(), vec![ids[3]]], uuid)
            .unwrap();
    let nonces: Vec<String> = p.iter().map(|p| p.nonce.clone()).collect();
    // Three machines in one batch: `<batch>/<index>`; one alone: plain.
    let (batch, _) = nonces[0].rsplit_once('/').unwrap();
    assert!(batch.starts_with("6f1e0f4c-"), "{batch}");
    for (k, n) in nonces[..3].iter().enumerate() {
        assert_eq!(n, &format!("{batch}/{k}"));
    }
    assert!(!nonces[3].contains('/'), "{}", nonces[3]);
    for (id, n) in ids.iter().zip(&nonces) {
        let m = e.st.machine(*id).unwrap();
        assert_eq!(m.nonce.as_ref(), Some(n));
        // Provisioning only once the start is sent (`mark_provisioning`).
        assert_eq!(m.status, "pending");
    }
    assert_eq!(e.st.mark_provisioning(&p[..3]).unwrap(), ids[..3].to_vec());
    assert_eq!(e.st.machine(ids[0]).unwrap().status, "provisioning");
    // A restarted controller re-forms nothing new: the nonces stay, even
    // when it groups the machines differently.
    let again =
        e.st.prepare_batches(std::slice::from_ref(&ids), uuid)
            .unwrap();
    assert_eq!(
        again.iter().map(|p| p.nonce.clone()).collect::<Vec<_>>(),
        nonces
    );
}

#[test]
fn upgrade_charm_keeps_endpoints_in_use_and_settings_and_bumps_the_revision() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 1);
    e.st.add_relation("wordpress", "mysql").unwrap();
    e.st.set_service_settings("wordpress", &[("title".into(), "Mine".into())])
        .unwrap();
    let before = e.st.service("wordpress").unwrap().charm_url;

    // Another charm's name; an endpoint the relation uses dropped; a set
    // setting the new charm does not know; a principal turned subordinate
    // (refused by the charm's own rules or by the upgrade's).
    let err = e.refused(|s| s.upgrade_charm("wordpress", &charm(MYSQL), false));
    assert!(
        err.to_string().contains("a service keeps its charm's name"),
        "{err}"
    );
    let no_db = WORDPRESS.replace("requires:\n  db:\n    interface: mysql\n", "");
    let err = e.refused(|s| s.upgrade_charm("wordpress", &charm(&no_db), false));
    assert_eq!(
        err.to_string(),
        "cannot upgrade service `wordpress` to charm `wordpress`: relation `wordpress:db mysql:db` uses its endpoint `db` (requirer of `mysql`), which the new charm lacks; remove the relation first"
    );
    let mut no_title = charm(WORDPRESS);
    no_title.config.options.remove("title");
    let err = e.refused(|s| s.upgrade_charm("wordpress", &no_title, false));
    assert!(err.to_string().contains("setting `title`"), "{err}");
    let mut sub = charm(WORDPRESS);
    sub.meta.subordinate = true;
    let err = e.refused(|s| s.upgrade_charm("wordpress", &sub, false));
    assert!(err.to_string().contains("subordinate"), "{err}");

    // The same charm again is still an upgrade: a new revision, above the
    // current one even when the directory's revision is older.
    let url =
        e.st.upgrade_charm("wordpress", &charm(WORDPRESS), false)
            .unwrap();
    assert_eq!(before, "local:jammy/wordpress-1");
    assert_eq!(url, "local:jammy/wordpress-2");
    assert_eq!(e.st.service("wordpress").unwrap().charm_url, url);
    let url =
        e.st.upgrade_charm("wordpress", &charm(WORDPRESS), false)
            .unwrap();
    assert_eq!(url, "local:jammy/wordpress-3");

    // Not on a dying service.
    e.st.destroy_service("wordpress").unwrap();
    e.refused(|s| s.upgrade_charm("wordpress", &charm(WORDPRESS), false));
}

/// A charm at the last revision that can be counted is not upgraded (the
/// next one wrapped to 0 before, and overflowed in a debug build).
#[test]
fn upgrade_charm_refuses_past_the_last_revision() {
    let e = env();
    let mut args = deploy_args(WORDPRESS, "wordpress", 1);
    args.charm.url = format!("local:jammy/wordpress-{}", u64::MAX);
    e.st.deploy(&args).unwrap();
    let err = e.refused(|s| s.upgrade_charm("wordpress", &charm(WORDPRESS), false));
    assert!(
        err.to_string()
            .contains("past which no revision can be counted"),
        "{err}"
    );
}

/// The poller's lean view is exactly what it watches: Alive machines not in
/// error that have an instance.
#[test]
fn watched_instances_are_the_alive_machines_with_an_instance_not_in_error() {
    let e = env();
    let ms = e.st.add_machines(4, None, None).unwrap();
    let prepared = e.st.prepare_provisioning(&ms[..3], "6f1e0f4c").unwrap();
    let started = started_as_prepared(&prepared);
    e.st.record_instances(&started).unwrap();
    // One in error (its instance gone), one Dying; the fourth has none.
    assert!(e
        .st
        .set_instance_gone(ms[1], &format!("i-{}", ms[1]), "gone")
        .unwrap());
    e.st.destroy_machines(&[ms[2]]).unwrap();
    assert_eq!(
        e.st.watched_instances().unwrap(),
        vec![(ms[0], format!("i-{}", ms[0]))]
    );
}

/// A Dying relation or service names what holds it — the units still in
/// the scope, the unit a failed hook holds and the command that frees it —
/// in `status` and in what `wait` waits for.
#[test]
fn dying_relations_and_services_name_what_holds_them() {
    use crate::agents::{AgentOp, Caller};
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 1);
    e.deploy(MYSQL, "mysql", 2);
    let rel = e.st.add_relation("wordpress", "mysql").unwrap();
    let apply = |who: &str, op: AgentOp| {
        e.st.apply_batch(&[(Caller::Unit(who.into()), op)])
            .unwrap()
            .remove(0)
            .unwrap();
    };
    for u in ["wordpress/0", "mysql/0", "mysql/1"] {
        apply(
            u,
            AgentOp::EnterScope {
                relation: rel.id,
                unit: u.into(),
                settings: vec![],
            },
        );
    }
    apply(
        "mysql/1",
        AgentOp::SetUnitStatus {
            unit: "mysql/1".into(),
            status: "error".into(),
            info: "hook failed: \"db-relation-departed\"".into(),
        },
    );
    e.st.destroy_relation("wordpress", "mysql").unwrap();
    let st = e.st.status().unwrap();
    let of = |id| st.relations.iter().find(|r| r.id == id).unwrap();
    assert!(
        of(1).message.is_empty(),
        "the Alive peer relation says nothing"
    );
    let msg = &of(rel.id).message;
    assert!(
        msg.contains("waits for `mysql/0`, `mysql/1`, `wordpress/0` to leave it"),
        "{msg}"
    );
    assert!(
        msg.contains("unit `mysql/1` is held by a failed hook (`jujube resolved mysql/1`)"),
        "{msg}"
    );
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(
        waits.contains(&format!("relation `{}` is dying and {msg}", rel.key)),
        "{waits}"
    );
    e.st.destroy_service("mysql").unwrap();
    let st = e.st.status().unwrap();
    let svc = st.services.get("mysql").unwrap();
    assert!(
        svc.message
            .contains("waits for unit(s) `mysql/0`, `mysql/1` and 1 relation(s) to go"),
        "{}",
        svc.message
    );
    assert!(
        svc.message.contains("`jujube resolved mysql/1`"),
        "{}",
        svc.message
    );
    assert!(st.services.get("wordpress").unwrap().message.is_empty());
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(
        waits.contains("service `mysql` is dying and waits for unit(s)"),
        "{waits}"
    );
}

/// An agent whose pass failed other than in a hook (`failed`) tries again
/// by itself: what `wait` waits for names it and why, nothing lists it as
/// held by a failed hook, and `resolved` refuses it.
#[test]
fn agents_whose_pass_failed_are_waited_for_with_why_not_held() {
    use crate::agents::{AgentOp, Caller};
    let e = env();
    let units = e.deploy(MYSQL, "mysql", 2);
    let m = e.st.unit(&units[1]).unwrap().machine_id.unwrap();
    let ms: Vec<i64> = e.st.machines().unwrap().iter().map(|m| m.id).collect();
    let prepared = e.st.prepare_provisioning(&ms, "6f1e0f4c").unwrap();
    e.st.record_instances(&started_as_prepared(&prepared))
        .unwrap();
    let failed = [
        (
            Caller::Unit(units[0].clone()),
            AgentOp::SetUnitStatus {
                unit: units[0].clone(),
                status: "failed".into(),
                info: "cannot write `hooks.json`: disk full".into(),
            },
        ),
        (
            Caller::Machine(m),
            AgentOp::SetMachineAgentStatus {
                machine: m,
                status: "failed".into(),
                info: "the controller cannot be reached".into(),
            },
        ),
    ];
    for r in e.st.apply_batch(&failed).unwrap() {
        r.unwrap();
    }
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(
        waits.contains(&format!(
            "the agent of unit `{}` failed and tries again: cannot write `hooks.json`: disk full",
            units[0]
        )),
        "{waits}"
    );
    assert!(
        waits.contains(&format!(
            "the agent of machine {m} failed and tries again: the controller cannot be reached"
        )),
        "{waits}"
    );
    assert!(e.st.units_in_error(10).unwrap().is_empty());
    assert!(matches!(
        e.st.resolve_unit(&units[0], true),
        Err(Error::UnitNotInError(_))
    ));
    // Dead, it waits for its deployer, whatever its agent said last.
    e.st.destroy_units(&units[..1]).unwrap();
    e.st.ensure_dead_unit(&units[0]).unwrap();
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(
        waits.contains(&format!(
            "unit `{}` is dead and waits for its agents",
            units[0]
        )),
        "{waits}"
    );
    assert!(!waits.contains("disk full"), "{waits}");
}

/// A controller killed with its agents leaves each unit's last status as
/// those agents reported it: `started`, though a hook was cut off that the
/// unit's next agent finds failed. Once another agent host starts, `wait`
/// waits for each unit's agent to report again rather than trusting what
/// the dead one said (a unit in error is shown as such, not waited for).
#[test]
fn units_are_waited_for_until_their_agents_report_again_after_a_host_restart() {
    use crate::agents::{AgentOp, Caller};
    let e = env();
    let units = e.deploy(MYSQL, "mysql", 3);
    let ms: Vec<i64> = e.st.machines().unwrap().iter().map(|m| m.id).collect();
    let prepared = e.st.prepare_provisioning(&ms, "6f1e0f4c").unwrap();
    e.st.record_instances(&started_as_prepared(&prepared))
        .unwrap();
    let report = |unit: &str, status: &str, info: &str| {
        let op = (
            Caller::Unit(unit.to_string()),
            AgentOp::SetUnitStatus {
                unit: unit.to_string(),
                status: status.into(),
                info: info.into(),
            },
        );
        for r in e.st.apply_batch(&[op]).unwrap() {
            r.unwrap();
        }
    };
    report(&units[0], "started", "");
    report(&units[1], "started", "");
    report(&units[2], "error", "hook failed: \"install\"");
    let again = |u: &str| format!("unit `{u}` waits for its agent to start again");
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(!waits.contains("start again"), "{waits}");

    assert_eq!(e.st.agents_restarting().unwrap(), 3);
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(waits.contains(&again(&units[0])), "{waits}");
    assert!(waits.contains(&again(&units[1])), "{waits}");
    assert!(!waits.contains(&units[2]), "{waits}");
    // What the store holds meanwhile is unchanged; `status` shows it with
    // why it may be stale, as `wait` says.
    assert_eq!(e.st.unit(&units[0]).unwrap().status, "started");
    let shown = |u: &str| {
        let status = e.st.status().unwrap();
        let (_, unit) = status
            .services
            .0
            .iter()
            .flat_map(|(_, s)| s.units.0.iter())
            .find(|(name, _)| name == u)
            .cloned()
            .unwrap();
        (unit.agent_status, unit.agent_status_info)
    };
    let (status, info) = shown(&units[0]);
    assert_eq!(status, "started");
    assert!(
        info.contains("not reported since its agents restarted"),
        "{info}"
    );
    // An error stands until someone acts: not waited for, not marked.
    assert_eq!(
        shown(&units[2]),
        ("error".into(), "hook failed: \"install\"".into())
    );

    // The new agent finds the hook it was running cut off.
    report(&units[0], "error", "hook failed: \"config-changed\"");
    report(&units[1], "started", "");
    let waits = e.st.awaiting_agents(10).unwrap().join("\n");
    assert!(!waits.contains("start again"), "{waits}");
    assert_eq!(e.st.units_in_error(10).unwrap().len(), 2);
    assert_eq!(shown(&units[1]), ("started".into(), String::new()));
}

#[test]
fn a_units_credential_is_set_by_its_deployer_or_its_principals_machine_only() {
    use crate::Caller;
    let e = env();
    let ws = e.deploy(WORDPRESS, "wordpress", 2);
    e.deploy(LOGGING, "logging", 0);
    let rel = e.st.add_relation("wordpress", "logging").unwrap();
    e.st.enter_scope(rel.id, &ws[0]).unwrap();
    let m0 = e.st.unit(&ws[0]).unwrap().machine_id.unwrap();
    let m1 = e.st.unit(&ws[1]).unwrap().machine_id.unwrap();
    let set = |by: &Caller, unit: &str| {
        e.st.set_unit_credential_as(
            by,
            None,
            unit,
            &format!("unit-{}", unit.replace('/', "-")),
            "h",
        )
    };
    // Its deployers may.
    set(&Caller::Machine(m0), &ws[0]).unwrap();
    set(&Caller::Unit(ws[0].clone()), "logging/0").unwrap();
    set(&Caller::Machine(m0), "logging/0").unwrap();
    // Nobody else, and a unit that does not exist is refused alike.
    let before = e.digest();
    for (by, unit) in [
        (Caller::Machine(m1), ws[0].as_str()),
        (Caller::Machine(m1), "logging/0"),
        (Caller::Unit(ws[1].clone()), "logging/0"),
        (Caller::Unit(ws[0].clone()), ws[1].as_str()),
        (Caller::Machine(m0), "wordpress/9"),
    ] {
        let err = set(&by, unit).unwrap_err();
        assert!(
            matches!(err, Error::Unauthorized { .. }),
            "{by} {unit}: {err}"
        );
    }
    assert_eq!(before, e.digest());
    let tag = format!("unit-{}", ws[1].replace('/', "-"));
    assert_eq!(e.st.agent_credential(&tag).unwrap(), None);
}

/// What `destroy-environment` removes on PostgreSQL is exactly what the
/// migrations made: the list `erase` drops is the schema's, and after it
/// the schema is empty (on SQLite the file goes with its directory).
#[test]
fn erasing_the_state_leaves_nothing_of_it() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 2);
    if let Some(path) = e.st.path() {
        let path = path.to_path_buf();
        e.st.clone().erase().unwrap();
        assert!(path.exists(), "the file is its directory's to delete");
        return;
    }
    let objects = |st: &crate::Store| -> Vec<String> {
        st.read(|c| {
            Ok(c.prepare(
                "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema()
                 UNION ALL SELECT proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                   WHERE n.nspname = current_schema() ORDER BY 1",
            )?
            .query_map([], |r| r.get(0))?
            .collect::<crate::sql::Result<_>>()?)
        })
        .unwrap()
    };
    let mut made: Vec<String> = crate::schema::PG_TABLES
        .iter()
        .chain(crate::schema::PG_FUNCTIONS)
        .map(|s| s.to_string())
        .collect();
    made.sort();
    assert_eq!(objects(&e.st), made);
    let observer = crate::Store::open_at(e.st.location(), crate::Durability::Relaxed).unwrap();
    e.st.clone().erase().unwrap();
    // Opening again would migrate: read through a store opened before.
    assert_eq!(objects(&observer), Vec::<String>::new());
}

#[test]
fn where_the_state_lives_is_chosen_at_bootstrap_only() {
    let e = env();
    for key in crate::environment::BOOTSTRAP_ONLY {
        let err = e.refused(|st| {
            st.set_environment_config(&[(key.to_string(), "postgres://u@h/db".into())])
        });
        assert!(
            matches!(err, Error::FixedAtBootstrap(ref k) if k == key),
            "{err}"
        );
    }
}

/// The two schemas say the same: every table of the SQLite schema, with
/// its columns in order and their kinds, is in PostgreSQL's (on SQLite
/// alone there is nothing to compare).
#[test]
fn the_postgresql_schema_has_the_sqlite_schemas_tables_and_columns() {
    let e = env();
    if !matches!(e.st.location(), crate::Location::Postgres(_)) {
        return;
    }
    let lite = super::sqlite_env();
    // (table, column, kind): integers (and flags), text, bytes, or other.
    let kind = |t: &str| -> String {
        let t = t.to_ascii_lowercase();
        if t.contains("int") || t == "boolean" {
            "integer".into()
        } else if t == "text" {
            "text".into()
        } else if t == "blob" || t == "bytea" {
            "bytes".into()
        } else {
            t
        }
    };
    // (table, column, kind) of every column `sql` lists, in its order.
    let columns = |st: &crate::Store, sql: &str| -> Vec<(String, String, String)> {
        st.read(|c| {
            Ok(c.prepare(sql)?
                .query_map([], |r| {
                    Ok((r.get(0)?, r.get(1)?, kind(&r.get::<_, String>(2)?)))
                })?
                .collect::<crate::sql::Result<Vec<(String, String, String)>>>()?)
        })
        .unwrap()
    };
    let sqlite = columns(
        &lite.st,
        "SELECT m.name, p.name, p.type FROM sqlite_master m, pragma_table_info(m.name) p
         WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY m.name, p.cid",
    );
    let pg = columns(
        &e.st,
        "SELECT table_name::text, column_name::text, data_type::text FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name <> 'schema_version'
         ORDER BY table_name, ordinal_position",
    );
    assert!(
        sqlite.iter().any(|(t, _, _)| t == "controllers"),
        "{sqlite:?}"
    );
    assert_eq!(pg, sqlite);
}

/// The next unit number reads the service's last unit alone, however many
/// it has and however stale the server's statistics: PostgreSQL planned
/// `max(number)` as a scan of all of them once its statistics were older
/// than the table, and each add-unit took longer than the last.
#[test]
fn the_next_unit_number_reads_one_unit_however_many_the_service_has() {
    let e = env();
    e.deploy(MYSQL, "mysql", 1);
    let postgres =
        e.st.read(|c| Ok(c.engine() == crate::sql::Engine::Postgres))
            .unwrap();
    if postgres {
        // What the server knows of the table: one unit.
        e.st.write(|tx| Ok(tx.execute_batch("ANALYZE units")?))
            .unwrap();
    }
    e.st.add_units("mysql", 2000, None).unwrap();
    assert_eq!(e.st.add_units("mysql", 1, None).unwrap(), ["mysql/2001"]);
    if !postgres {
        return; // SQLite reads `max` off the index, as it reads this.
    }
    let sql = concat!("SELECT ", crate::units::next_unit_number_sql!()).replace("?1", "$1");
    let plan: Vec<String> =
        e.st.read(|c| {
            c.execute_batch(&format!(
                "SET plan_cache_mode = force_generic_plan; PREPARE next_number(text) AS {sql}"
            ))?;
            let mut stmt =
                c.prepare("EXPLAIN (ANALYZE, COSTS OFF) EXECUTE next_number('mysql')")?;
            let rows = stmt
                .query_map([], |r| r.get::<_, String>(0))?
                .collect::<crate::sql::Result<Vec<_>>>()?;
            c.execute_batch("DEALLOCATE next_number; RESET plan_cache_mode")?;
            Ok(rows)
        })
        .unwrap();
    let scan = plan
        .iter()
        .find(|l| l.contains(" on units "))
        .unwrap_or_else(|| panic!("{plan:#?}"));
    assert!(scan.contains("rows=1 loops=1"), "{plan:#?}");
}

#[test]
fn update_status_hook_interval_is_a_duration_from_a_second_to_an_hour() {
    let e = env();
    for bad in ["0s", "500ms", "61m", "2h", "soon", ""] {
        let err = e.refused(|st| {
            st.set_environment_config(&[("update-status-hook-interval".into(), bad.into())])
        });
        assert!(
            err.to_string().contains("is not a duration from 1s to 60m"),
            "{err}"
        );
    }
    e.st.set_environment_config(&[("update-status-hook-interval".into(), "90s".into())])
        .unwrap();
    let units = e.deploy(WORDPRESS, "wordpress", 1);
    let c = e.st.unit_context(&units[0]).unwrap();
    assert_eq!(
        c.update_status_interval,
        Some(std::time::Duration::from_secs(90))
    );
}
