//! Property test: random user operations interleaved with the real agents
//! (a [`Host`] running machine and unit agents concurrently) and the
//! controller's duties. After every step the model's invariants hold; once
//! the user stops and destroys what is left, the agents drive everything
//! destroyed to removal: no service, unit or relation remains, and no
//! machine but the controller's.
//!
//! `PROPTEST_CASES` sets the number of sequences.

use super::*;
use crate::Host;
use jujube_core::Life;
use proptest::prelude::*;
use std::collections::HashMap;
use std::time::Duration;

const CHARMS: [&str; 3] = [WORDPRESS, MYSQL, LOGGING];
const NAMES: [&str; 4] = ["svc-a", "svc-b", "svc-c", "svc-d"];

#[derive(Debug, Clone)]
enum Op {
    Deploy {
        charm: usize,
        name: usize,
        units: usize,
    },
    AddUnit {
        svc: usize,
    },
    AddRelation {
        a: usize,
        b: usize,
    },
    DestroyRelation {
        a: usize,
        b: usize,
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
    Provision,
    Controller,
    /// Let the agents run a little before the next operation.
    Pause {
        yields: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = || 0usize..32;
    prop_oneof![
        3 => (0usize..3, 0usize..NAMES.len(), 0usize..3).prop_map(|(charm, name, units)| Op::Deploy { charm, name, units }),
        3 => i().prop_map(|svc| Op::AddUnit { svc }),
        4 => (i(), i()).prop_map(|(a, b)| Op::AddRelation { a, b }),
        2 => (i(), i()).prop_map(|(a, b)| Op::DestroyRelation { a, b }),
        3 => i().prop_map(|unit| Op::DestroyUnit { unit }),
        2 => i().prop_map(|svc| Op::DestroyService { svc }),
        2 => i().prop_map(|m| Op::DestroyMachine { m }),
        3 => Just(Op::Provision),
        2 => Just(Op::Controller),
        4 => (0u32..200).prop_map(|yields| Op::Pause { yields }),
    ]
}

fn pick<T: Clone>(v: &[T], i: usize) -> Option<T> {
    (!v.is_empty()).then(|| v[i % v.len()].clone())
}

/// The controller's part: cleanups, and removing Dead machines (their
/// instances are pretend ones) and unprovisioned non-Alive ones.
fn controller(w: &World) {
    w.store.run_cleanups(usize::MAX).unwrap();
    for m in w.store.machines().unwrap() {
        let ctl = Caller::Controller;
        if m.life == Life::Dead {
            w.store
                .apply(&ctl, &AgentOp::RemoveMachine { machine: m.id })
                .unwrap();
        } else if m.life == Life::Dying && m.instance_id.is_none() {
            let _ = w
                .store
                .apply(&ctl, &AgentOp::EnsureDeadMachine { machine: m.id });
            let _ = w
                .store
                .apply(&ctl, &AgentOp::RemoveMachine { machine: m.id });
        }
    }
}

fn apply(w: &World, op: &Op) -> Option<jujube_state::Result<()>> {
    let st = &w.store;
    let services: Vec<String> = st.services().unwrap().into_iter().map(|s| s.name).collect();
    let units: Vec<String> = services
        .iter()
        .flat_map(|s| st.units_of(s).unwrap())
        .filter(|u| u.principal.is_none())
        .map(|u| u.name)
        .collect();
    let machines: Vec<i64> = st.machines().unwrap().into_iter().map(|m| m.id).collect();
    Some(match op {
        Op::Deploy { charm, name, units } => {
            if st.service(NAMES[*name]).is_ok() {
                return None;
            }
            w.deploy(CHARMS[*charm], NAMES[*name], *units);
            Ok(())
        }
        Op::AddUnit { svc } => st.add_units(&pick(&services, *svc)?, 1, None).map(|_| ()),
        Op::AddRelation { a, b } => st
            .add_relation(&pick(&services, *a)?, &pick(&services, *b)?)
            .map(|_| ()),
        Op::DestroyRelation { a, b } => {
            st.destroy_relation(&pick(&services, *a)?, &pick(&services, *b)?)
        }
        Op::DestroyUnit { unit } => st.destroy_units(&[pick(&units, *unit)?]),
        Op::DestroyService { svc } => st.destroy_service(&pick(&services, *svc)?),
        Op::DestroyMachine { m } => st.destroy_machine(pick(&machines, *m)?),
        Op::Provision => {
            w.provision();
            Ok(())
        }
        Op::Controller => {
            controller(w);
            Ok(())
        }
        Op::Pause { .. } => return None,
    })
}

fn count(c: &rusqlite::Connection, sql: &str) -> i64 {
    c.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// Lives seen so far: none may go back, nothing removed may come back.
#[derive(Default)]
struct History {
    lives: HashMap<String, i64>,
    gone: std::collections::HashSet<String>,
}

fn check(c: &rusqlite::Connection, h: &mut History) -> Result<(), TestCaseError> {
    let mut now = HashMap::new();
    for (table, key, prefix) in [
        ("machines", "id", "m:"),
        ("units", "name", "u:"),
        ("relations", "id", "r:"),
    ] {
        let mut stmt = c
            .prepare(&format!("SELECT {key} || '=' || life FROM {table}"))
            .unwrap();
        for row in stmt.query_map([], |r| r.get::<_, String>(0)).unwrap() {
            let row = row.unwrap();
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
        if !now.contains_key(id) {
            h.gone.insert(id.clone());
        }
    }
    h.lives = now;
    let checks: &[(&str, &str)] = &[
        ("unit counts are exact", "SELECT count(*) FROM services s WHERE unit_count != (SELECT count(*) FROM units u WHERE u.service = s.name)"),
        ("relation counts are exact", "SELECT count(*) FROM services s WHERE relation_count != (SELECT count(DISTINCT relation_id) FROM relation_endpoints e WHERE e.service = s.name)"),
        ("scope counts are exact", "SELECT count(*) FROM relations r WHERE unit_count != (SELECT count(*) FROM relation_scopes x WHERE x.relation_id = r.id)"),
        ("a dying relation has units in scope", "SELECT count(*) FROM relations WHERE life != 0 AND unit_count = 0"),
        ("an unreferenced destroyed service is removed", "SELECT count(*) FROM services WHERE life != 0 AND unit_count = 0 AND relation_count = 0"),
        ("dead units are in no scope", "SELECT count(*) FROM units u JOIN relation_scopes x ON x.unit = u.name WHERE u.life = 2"),
        ("dead units have no subordinates", "SELECT count(*) FROM units p JOIN units s ON s.principal = p.name WHERE p.life = 2"),
        ("dead machines host nothing", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE m.life = 2"),
        ("subordinates in scope are in their principal's container",
         "SELECT count(*) FROM relation_scopes x JOIN units u ON u.name = x.unit JOIN relations r ON r.id = x.relation_id WHERE r.scope = 'container' AND u.principal IS NOT NULL AND x.container != u.principal"),
    ];
    for (what, sql) in checks {
        prop_assert_eq!(count(c, sql), 0, "invariant broken: {}", what);
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let w = World::new();
        let host = Host::start(w.store.clone(), w.dir.path().join("agents")).unwrap();
        let db = rusqlite::Connection::open_with_flags(
            w.dir.path().join("state.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        let mut h = History::default();
        for op in &ops {
            match apply(&w, op) {
                None | Some(Ok(())) => {}
                Some(Err(e)) => prop_assert!(e.is_refusal(), "{:?} failed: {}", op, e),
            }
            let yields = if let Op::Pause { yields } = op {
                *yields
            } else {
                1
            };
            for _ in 0..yields {
                tokio::task::yield_now().await;
            }
            check(&db, &mut h)?;
        }
        // The user stops and destroys everything left; agents and the
        // controller must take it all away.
        for s in w.store.services().unwrap() {
            // Destroying one service may remove another (a destroyed one
            // whose last relation went with it).
            match w.store.destroy_service(&s.name) {
                Ok(()) | Err(jujube_state::Error::NotFound { .. }) => {}
                Err(e) => panic!("destroy-service `{}`: {e}", s.name),
            }
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            controller(&w);
            w.provision();
            for m in w.store.machines().unwrap() {
                if !m.manages_environ() && w.store.units_on_machine(m.id).unwrap().is_empty() {
                    w.store.destroy_machine(m.id).unwrap();
                }
            }
            check(&db, &mut h)?;
            let left = |s: &Store| {
                s.services().unwrap().len()
                    + s.relations().unwrap().len()
                    + s.machines().unwrap().len()
                    - 1
            };
            if left(&w.store) == 0 {
                break;
            }
            prop_assert!(
                tokio::time::Instant::now() < deadline,
                "agents did not drive everything to removal: {}",
                serde_json::to_string_pretty(&w.store.status().unwrap()).unwrap()
            );
            // Until the next change (an agent acted), or a short while.
            let mut watcher = w.store.watch(w.store.head_revision().unwrap());
            let _ = tokio::time::timeout(Duration::from_millis(500), watcher.next()).await;
        }
        host.shutdown().await;
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(16),
        // Bounded: a failing case can take the full 60 s to show itself.
        max_shrink_iters: 16,
        ..ProptestConfig::default()
    })]

    #[test]
    fn agents_drive_everything_destroyed_to_removal_whatever_the_interleaving(ops in proptest::collection::vec(op(), 20..80)) {
        run(ops)?;
    }
}
