//! Property test: long random sequences of user and agent operations. After
//! every step: no life went back, refcounts equal the real counts, nothing
//! dangles, and a refused operation changed nothing at all. At the end, the
//! agents' duties are carried out until nothing moves, and everything except
//! the controller machine must have been removed.
//!
//! `PROPTEST_CASES` sets the number of sequences (CI runs enough for well
//! over 100,000 operations).

use super::*;
use crate::model::{machine_status, JOB_HOST_UNITS};
use crate::Store;
use proptest::prelude::*;
use std::collections::HashMap;

const CHARMS: [&str; 3] = [WORDPRESS, MYSQL, LOGGING];
const NAMES: [&str; 5] = ["svc-a", "svc-b", "svc-c", "svc-d", "svc-e"];

#[derive(Debug, Clone)]
enum Op {
    Deploy {
        charm: usize,
        name: usize,
        units: usize,
    },
    AddUnit {
        svc: usize,
        to: Option<usize>,
    },
    AddMachine,
    AddRelation {
        a: usize,
        b: usize,
    },
    DestroyRelation {
        rel: usize,
    },
    DestroyUnit {
        unit: usize,
    },
    DestroyService {
        svc: usize,
    },
    DestroyMachine {
        m: usize,
    },
    EnterScope {
        rel: usize,
        unit: usize,
    },
    LeaveScope {
        scope: usize,
    },
    Started {
        unit: usize,
    },
    EnsureDeadUnit {
        unit: usize,
    },
    RemoveUnit {
        unit: usize,
    },
    EnsureDeadMachine {
        m: usize,
    },
    RemoveMachine {
        m: usize,
    },
    ProvisioningError {
        m: usize,
    },
    Resolved {
        m: usize,
    },
    Cleanup,
}

fn op() -> impl Strategy<Value = Op> {
    let i = || 0usize..64;
    prop_oneof![
        3 => (0usize..3, 0usize..NAMES.len(), 0usize..3).prop_map(|(charm, name, units)| Op::Deploy { charm, name, units }),
        4 => (i(), proptest::option::weighted(0.3, i())).prop_map(|(svc, to)| Op::AddUnit { svc, to }),
        1 => Just(Op::AddMachine),
        4 => (i(), i()).prop_map(|(a, b)| Op::AddRelation { a, b }),
        2 => i().prop_map(|rel| Op::DestroyRelation { rel }),
        3 => i().prop_map(|unit| Op::DestroyUnit { unit }),
        2 => i().prop_map(|svc| Op::DestroyService { svc }),
        2 => i().prop_map(|m| Op::DestroyMachine { m }),
        8 => (i(), i()).prop_map(|(rel, unit)| Op::EnterScope { rel, unit }),
        5 => i().prop_map(|scope| Op::LeaveScope { scope }),
        3 => i().prop_map(|unit| Op::Started { unit }),
        4 => i().prop_map(|unit| Op::EnsureDeadUnit { unit }),
        4 => i().prop_map(|unit| Op::RemoveUnit { unit }),
        2 => i().prop_map(|m| Op::EnsureDeadMachine { m }),
        2 => i().prop_map(|m| Op::RemoveMachine { m }),
        1 => i().prop_map(|m| Op::ProvisioningError { m }),
        1 => i().prop_map(|m| Op::Resolved { m }),
        2 => Just(Op::Cleanup),
    ]
}

fn pick<T: Clone>(v: &[T], i: usize) -> Option<T> {
    if v.is_empty() {
        None
    } else {
        Some(v[i % v.len()].clone())
    }
}

fn strings(st: &Store, sql: &str) -> Vec<String> {
    st.read(|c| {
        Ok(c.prepare(sql)?
            .query_map([], |r| r.get::<_, rusqlite::types::Value>(0))?
            .map(|v| {
                Ok(match v? {
                    rusqlite::types::Value::Integer(i) => i.to_string(),
                    rusqlite::types::Value::Text(t) => t,
                    other => format!("{other:?}"),
                })
            })
            .collect::<rusqlite::Result<Vec<_>>>()?)
    })
    .unwrap()
}

fn count(st: &Store, sql: &str) -> i64 {
    st.read(|c| Ok(c.query_row(sql, [], |r| r.get(0))?))
        .unwrap()
}

/// Applies one op; `None` when it had nothing to act on.
fn apply(e: &Env, op: &Op) -> Option<crate::Result<()>> {
    let st = &e.st;
    let units = strings(st, "SELECT name FROM units ORDER BY name");
    let services = strings(st, "SELECT name FROM services ORDER BY name");
    let machines: Vec<i64> = strings(st, "SELECT id FROM machines ORDER BY id")
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let rels: Vec<i64> = strings(st, "SELECT id FROM relations ORDER BY id")
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    Some(match op {
        Op::Deploy { charm, name, units } => {
            let mut args = deploy_args(CHARMS[*charm], NAMES[*name], *units);
            if *charm == 2 {
                args.units = 0;
            }
            st.deploy(&args).map(|_| ())
        }
        Op::AddUnit { svc, to } => {
            let s = pick(&services, *svc)?;
            let to = to.and_then(|m| pick(&machines, m));
            st.add_units(&s, 1, to).map(|_| ())
        }
        Op::AddMachine => st.add_machines(1, None, None).map(|_| ()),
        Op::AddRelation { a, b } => st
            .add_relation(&pick(&services, *a)?, &pick(&services, *b)?)
            .map(|_| ()),
        Op::DestroyRelation { rel } => st.destroy_relation_id(pick(&rels, *rel)?),
        Op::DestroyUnit { unit } => st.destroy_units(&[pick(&units, *unit)?]),
        Op::DestroyService { svc } => st.destroy_service(&pick(&services, *svc)?),
        Op::DestroyMachine { m } => st.destroy_machine(pick(&machines, *m)?),
        Op::EnterScope { rel, unit } => {
            let rel = pick(&rels, *rel)?;
            let candidates = strings(
                st,
                &format!(
                    "SELECT u.name FROM units u JOIN relation_endpoints e ON e.service = u.service
                     WHERE e.relation_id = {rel} ORDER BY u.name"
                ),
            );
            st.enter_scope(rel, &pick(&candidates, *unit)?)
        }
        Op::LeaveScope { scope } => {
            let scopes = strings(
                st,
                "SELECT relation_id || '#' || unit FROM relation_scopes ORDER BY 1",
            );
            let s = pick(&scopes, *scope)?;
            let (rel, unit) = s.split_once('#').unwrap();
            st.leave_scope(rel.parse().unwrap(), unit)
        }
        Op::Started { unit } => st.set_unit_status(&pick(&units, *unit)?, "started", ""),
        Op::EnsureDeadUnit { unit } => st.ensure_dead_unit(&pick(&units, *unit)?),
        Op::RemoveUnit { unit } => st.remove_unit(&pick(&units, *unit)?),
        Op::EnsureDeadMachine { m } => st.ensure_dead_machine(pick(&machines, *m)?),
        Op::RemoveMachine { m } => st.remove_machine(pick(&machines, *m)?),
        Op::ProvisioningError { m } => {
            st.set_machine_status(pick(&machines, *m)?, machine_status::ERROR, "boom")
        }
        Op::Resolved { m } => st.resolve_machine(pick(&machines, *m)?, None),
        Op::Cleanup => st.cleanup_step().map(|_| ()),
    })
}

/// Lives seen so far, to prove none went back; removed unit names and
/// machine ids must never come back either.
#[derive(Default)]
struct History {
    lives: HashMap<String, i64>,
    gone: std::collections::HashSet<String>,
}

fn check_invariants(st: &Store, h: &mut History) -> Result<(), TestCaseError> {
    let mut now = HashMap::new();
    for (table, key, prefix) in [
        ("machines", "id", "m:"),
        ("units", "name", "u:"),
        ("services", "name", "s:"),
        ("relations", "id", "r:"),
    ] {
        for row in strings(st, &format!("SELECT {key} || '=' || life FROM {table}")) {
            let (id, life) = row.rsplit_once('=').unwrap();
            now.insert(format!("{prefix}{id}"), life.parse::<i64>().unwrap());
        }
    }
    for (id, life) in &now {
        if let Some(prev) = h.lives.get(id) {
            prop_assert!(life >= prev, "{} went back from {} to {}", id, prev, life);
        }
        prop_assert!(!h.gone.contains(id), "{} came back after removal", id);
    }
    for id in h.lives.keys() {
        if !now.contains_key(id) && !id.starts_with("s:") {
            // Service names may be reused once removed; nothing else may.
            h.gone.insert(id.clone());
        }
    }
    h.lives = now;

    let checks: &[(&str, &str)] = &[
        ("unit counts are exact",
         "SELECT count(*) FROM services s WHERE unit_count != (SELECT count(*) FROM units u WHERE u.service = s.name)"),
        ("relation counts are exact",
         "SELECT count(*) FROM services s WHERE relation_count != (SELECT count(DISTINCT relation_id) FROM relation_endpoints e WHERE e.service = s.name)"),
        ("scope counts are exact",
         "SELECT count(*) FROM relations r WHERE unit_count != (SELECT count(*) FROM relation_scopes x WHERE x.relation_id = r.id)"),
        ("units reference services", "SELECT count(*) FROM units WHERE service NOT IN (SELECT name FROM services)"),
        ("principals reference machines",
         "SELECT count(*) FROM units WHERE principal IS NULL AND (machine_id IS NULL OR machine_id NOT IN (SELECT id FROM machines))"),
        ("subordinates reference principals",
         "SELECT count(*) FROM units WHERE principal IS NOT NULL AND (machine_id IS NOT NULL OR principal NOT IN (SELECT name FROM units WHERE principal IS NULL))"),
        ("scopes reference relations and units",
         "SELECT count(*) FROM relation_scopes WHERE relation_id NOT IN (SELECT id FROM relations) OR unit NOT IN (SELECT name FROM units)"),
        ("relations reference services",
         "SELECT count(*) FROM relation_endpoints WHERE service NOT IN (SELECT name FROM services) OR relation_id NOT IN (SELECT id FROM relations)"),
        ("every relation has endpoints",
         "SELECT count(*) FROM relations WHERE id NOT IN (SELECT relation_id FROM relation_endpoints)"),
        ("a dying relation has units in scope", "SELECT count(*) FROM relations WHERE life != 0 AND unit_count = 0"),
        ("an alive relation has only alive services",
         "SELECT count(*) FROM relations r JOIN relation_endpoints e ON e.relation_id = r.id JOIN services s ON s.name = e.service WHERE r.life = 0 AND s.life != 0"),
        ("an unreferenced destroyed service is removed",
         "SELECT count(*) FROM services WHERE life != 0 AND unit_count = 0 AND relation_count = 0"),
        ("dead units are in no scope", "SELECT count(*) FROM units u JOIN relation_scopes x ON x.unit = u.name WHERE u.life = 2"),
        ("dead units have no subordinates", "SELECT count(*) FROM units p JOIN units s ON s.principal = p.name WHERE p.life = 2"),
        ("dead machines host nothing", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE m.life = 2"),
        ("machines with alive units are alive", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE u.life = 0 AND m.life != 0"),
        ("units have their service's series", "SELECT count(*) FROM units u JOIN services s ON s.name = u.service WHERE u.series != s.series"),
        ("units run on machines of their series", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE u.series != m.series"),
        ("subordinates have no constraints", "SELECT count(*) FROM units WHERE principal IS NOT NULL AND constraints != ''"),
        ("the controller machine lives", "SELECT count(*) FROM machines WHERE manage_environ = 1 AND life != 0"),
    ];
    for (what, sql) in checks {
        prop_assert_eq!(count(st, sql), 0, "invariant broken: {}", what);
    }
    let fk: Vec<String> = strings(st, "SELECT \"table\" FROM pragma_foreign_key_check");
    prop_assert!(fk.is_empty(), "foreign key violations in {:?}", fk);
    Ok(())
}

/// Does what agents and the provisioner would, until nothing changes.
fn drain(e: &Env) {
    let st = &e.st;
    for s in strings(st, "SELECT name FROM services") {
        st.destroy_service(&s).unwrap();
    }
    for _ in 0..100 {
        let before = e.digest();
        st.run_cleanups(usize::MAX).unwrap();
        // Unit agents: leave scopes of Dying relations and of Dying units;
        // subordinates die when no relation to their principal is Alive.
        for row in strings(
            st,
            "SELECT x.relation_id || '#' || x.unit FROM relation_scopes x JOIN relations r ON r.id = x.relation_id
             JOIN units u ON u.name = x.unit WHERE r.life != 0 OR u.life != 0",
        ) {
            let (rel, unit) = row.split_once('#').unwrap();
            st.leave_scope(rel.parse().unwrap(), unit).unwrap();
        }
        for u in strings(st, "SELECT name FROM units WHERE life != 0") {
            let _ = st.ensure_dead_unit(&u);
        }
        for u in strings(st, "SELECT name FROM units WHERE life = 2") {
            st.remove_unit(&u).unwrap();
        }
        // Machine agents and the provisioner.
        for m in strings(
            st,
            &format!("SELECT id FROM machines WHERE jobs = '{JOB_HOST_UNITS}'"),
        ) {
            let m = m.parse().unwrap();
            if st.units_on_machine(m).unwrap().is_empty() {
                st.destroy_machine(m).unwrap();
                st.ensure_dead_machine(m).unwrap();
                st.remove_machine(m).unwrap();
            }
        }
        if before == e.digest() {
            break;
        }
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let e = env();
    let mut h = History::default();
    for op in &ops {
        let before = e.digest();
        match apply(&e, op) {
            None | Some(Ok(())) => {}
            Some(Err(err)) => {
                prop_assert!(err.is_refusal(), "{:?} failed: {}", op, err);
                prop_assert_eq!(
                    &before,
                    &e.digest(),
                    "refused {:?} changed state: {}",
                    op,
                    err
                );
            }
        }
        check_invariants(&e.st, &mut h)?;
    }
    drain(&e);
    check_invariants(&e.st, &mut h)?;
    for (what, sql) in [
        ("services", "SELECT count(*) FROM services"),
        ("units", "SELECT count(*) FROM units"),
        ("relations", "SELECT count(*) FROM relations"),
        ("cleanups", "SELECT count(*) FROM cleanups"),
        (
            "relation settings",
            "SELECT count(*) FROM relation_settings",
        ),
        (
            "machines other than the controller",
            "SELECT count(*) FROM machines WHERE manage_environ = 0",
        ),
    ] {
        prop_assert_eq!(
            count(&e.st, sql),
            0,
            "{} left after every agent did its duty",
            what
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operation_sequences_keep_every_invariant(ops in proptest::collection::vec(op(), 150..350)) {
        run(ops)?;
    }
}
