//! Property test: long random sequences of user and agent operations.
//!
//! After every step: no life went back, refcounts equal the real counts,
//! nothing dangles, no transaction wrote [`MAX_TX_ROWS`] rows or more, a
//! refused operation committed nothing at all, and every refusal is
//! *justified*: the reason it gives is re-checked against the state as it
//! was before the operation (see [`justify`]). A cleanup step may only touch
//! units of services that are not Alive (or the subordinates of their units).
//!
//! The sequences reuse a few service names, so names come back after their
//! services are removed while old cleanups may still be queued; they deploy
//! more than one batch of units now and then, destroy relations by id and by
//! endpoints, and try a charm whose peer relation is container-scoped (which
//! deploy must refuse).
//!
//! At the end the agents' duties are carried out until nothing moves, and
//! everything but the controller machine must have been removed. Half of the
//! sequences drain as a user would — relations and units first, with the
//! cleaner running while their services are still alive — and the others
//! start by destroying every service.
//!
//! A second property runs two threads writing through separate [`Store`]
//! handles on one file and checks the same invariants at the end.
//!
//! `PROPTEST_CASES` sets the number of sequences (CI runs 400: about
//! 100,000 operations).

use super::*;
use crate::model::{finish_unit, machine_status, unit_row, Machine, Relation, Service, Unit};
use crate::model::{JOB_HOST_UNITS, UNIT_COLS};
use crate::services::UNIT_BATCH;
use crate::{Entity, Error, Store};
use jujube_core::charm::{can_relate, relation_scope, Endpoint, Role, Scope, JUJU_INFO};
use jujube_core::Life;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// A charm whose peer relation is container-scoped: deploy must refuse it.
/// (Parsing refuses it too, so the test builds it in code.)
const RING: &str = "name: ring\nsummary: ring\npeers:\n  cluster:\n    interface: ring\n";
const CHARMS: [&str; 4] = [WORDPRESS, MYSQL, LOGGING, RING];
const LOGGING_CHARM: usize = 2;
const RING_CHARM: usize = 3;
const NAMES: [&str; 5] = ["svc-a", "svc-b", "svc-c", "svc-d", "svc-e"];
/// No transaction may write this many rows (the bound).
const MAX_TX_ROWS: u64 = 1000;

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
    /// By endpoints, as the CLI does: `form` 0 names the services only, 1
    /// the relations too (of an existing relation); 2 names two services
    /// picked at random.
    DestroyRelationByEndpoints {
        rel: usize,
        other: usize,
        form: u8,
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
    // Mostly a few units; now and then more than one batch.
    let units = prop_oneof![24 => 0usize..3, 1 => Just(UNIT_BATCH + 1)];
    prop_oneof![
        3 => (0usize..4, 0usize..NAMES.len(), units).prop_map(|(charm, name, units)| Op::Deploy { charm, name, units }),
        4 => (i(), proptest::option::weighted(0.3, i())).prop_map(|(svc, to)| Op::AddUnit { svc, to }),
        1 => Just(Op::AddMachine),
        4 => (i(), i()).prop_map(|(a, b)| Op::AddRelation { a, b }),
        1 => i().prop_map(|rel| Op::DestroyRelation { rel }),
        1 => (i(), i(), 0u8..3).prop_map(|(rel, other, form)| Op::DestroyRelationByEndpoints { rel, other, form }),
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

/// An operation made concrete against the state it runs on.
#[derive(Debug, Clone)]
enum Call {
    Deploy {
        charm: usize,
        name: String,
        units: usize,
    },
    AddUnit {
        svc: String,
        to: Option<i64>,
    },
    AddMachine,
    AddRelation {
        a: String,
        b: String,
    },
    DestroyRelationId {
        id: i64,
    },
    DestroyRelation {
        a: String,
        b: String,
    },
    DestroyUnit {
        unit: String,
    },
    DestroyService {
        svc: String,
    },
    DestroyMachine {
        m: i64,
    },
    EnterScope {
        rel: i64,
        unit: String,
    },
    LeaveScope {
        rel: i64,
        unit: String,
    },
    Started {
        unit: String,
    },
    EnsureDeadUnit {
        unit: String,
    },
    RemoveUnit {
        unit: String,
    },
    EnsureDeadMachine {
        m: i64,
    },
    RemoveMachine {
        m: i64,
    },
    ProvisioningError {
        m: i64,
    },
    Resolved {
        m: i64,
    },
    Cleanup,
}

/// The model as it is between two operations.
#[derive(Debug, Clone, PartialEq, Default)]
struct Snap {
    services: BTreeMap<String, Service>,
    units: BTreeMap<String, Unit>,
    machines: BTreeMap<i64, Machine>,
    relations: BTreeMap<i64, Relation>,
    /// (relation, unit, container)
    scopes: BTreeSet<(i64, String, String)>,
}

impl Snap {
    fn take(st: &Store) -> Snap {
        let units: Vec<Unit> = st
            .read(|c| {
                let mut stmt = c.prepare_cached(&format!("SELECT {UNIT_COLS} FROM units"))?;
                let rows = stmt.query_map([], unit_row)?;
                rows.map(|r| finish_unit(r?)).collect()
            })
            .unwrap();
        let scopes: Vec<(i64, String, String)> = st
            .read(|c| {
                Ok(
                    c.prepare_cached("SELECT relation_id, unit, container FROM relation_scopes")?
                        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                        .collect::<crate::sql::Result<_>>()?,
                )
            })
            .unwrap();
        Snap {
            services: st
                .services()
                .unwrap()
                .into_iter()
                .map(|s| (s.name.clone(), s))
                .collect(),
            units: units.into_iter().map(|u| (u.name.clone(), u)).collect(),
            machines: st
                .machines()
                .unwrap()
                .into_iter()
                .map(|m| (m.id, m))
                .collect(),
            relations: st
                .relations()
                .unwrap()
                .into_iter()
                .map(|r| (r.id, r))
                .collect(),
            scopes: scopes.into_iter().collect(),
        }
    }

    fn in_scope(&self, unit: &str) -> bool {
        self.scopes.iter().any(|(_, u, _)| u == unit)
    }

    fn subordinates(&self, unit: &str) -> Vec<&Unit> {
        self.units
            .values()
            .filter(|u| u.principal.as_deref() == Some(unit))
            .collect()
    }

    fn is_peer(&self, rel: &Relation) -> bool {
        rel.endpoints.len() == 1 && rel.endpoints[0].role == Role::Peer
    }

    /// Existing relations whose endpoints two specs (`svc` or `svc:rel`)
    /// name, by an independent reading of what `destroy-relation` means.
    fn named_by(&self, a: &str, b: &str) -> Vec<i64> {
        let matches = |spec: &str, ep: &Endpoint| match spec.split_once(':') {
            Some((s, r)) => ep.service == s && ep.relation == r,
            None => ep.service == spec,
        };
        self.relations
            .values()
            .filter(|r| match r.endpoints.as_slice() {
                [x, y] => (matches(a, x) && matches(b, y)) || (matches(a, y) && matches(b, x)),
                _ => false,
            })
            .map(|r| r.id)
            .collect()
    }
}

fn pick<T: Clone>(v: &[T], i: usize) -> Option<T> {
    if v.is_empty() {
        None
    } else {
        Some(v[i % v.len()].clone())
    }
}

fn keys<K: Clone, V>(m: &BTreeMap<K, V>) -> Vec<K> {
    m.keys().cloned().collect()
}

/// Makes an op concrete; `None` when there is nothing for it to act on.
fn resolve(s: &Snap, op: &Op) -> Option<Call> {
    let units = keys(&s.units);
    let services = keys(&s.services);
    let machines = keys(&s.machines);
    let rels = keys(&s.relations);
    Some(match op {
        Op::Deploy { charm, name, units } => Call::Deploy {
            charm: *charm,
            name: NAMES[*name].to_string(),
            // Subordinates get no units at deploy; asking is a refusal
            // already covered by the rules tests.
            units: if *charm == LOGGING_CHARM { 0 } else { *units },
        },
        Op::AddUnit { svc, to } => Call::AddUnit {
            svc: pick(&services, *svc)?,
            to: to.and_then(|m| pick(&machines, m)),
        },
        Op::AddMachine => Call::AddMachine,
        Op::AddRelation { a, b } => Call::AddRelation {
            a: pick(&services, *a)?,
            b: pick(&services, *b)?,
        },
        Op::DestroyRelation { rel } => Call::DestroyRelationId {
            id: pick(&rels, *rel)?,
        },
        Op::DestroyRelationByEndpoints { rel, other, form } => {
            if *form == 2 {
                Call::DestroyRelation {
                    a: pick(&services, *rel)?,
                    b: pick(&services, *other)?,
                }
            } else {
                let r = &s.relations[&pick(&rels, *rel)?];
                let spec = |ep: &Endpoint| {
                    if *form == 0 {
                        ep.service.clone()
                    } else {
                        ep.to_string()
                    }
                };
                let a = spec(&r.endpoints[0]);
                let b = spec(r.endpoints.last().unwrap());
                Call::DestroyRelation { a, b }
            }
        }
        Op::DestroyUnit { unit } => Call::DestroyUnit {
            unit: pick(&units, *unit)?,
        },
        Op::DestroyService { svc } => Call::DestroyService {
            svc: pick(&services, *svc)?,
        },
        Op::DestroyMachine { m } => Call::DestroyMachine {
            m: pick(&machines, *m)?,
        },
        Op::EnterScope { rel, unit } => {
            let rel = &s.relations[&pick(&rels, *rel)?];
            let candidates: Vec<String> = s
                .units
                .values()
                .filter(|u| rel.endpoint_of(&u.service).is_some())
                .map(|u| u.name.clone())
                .collect();
            Call::EnterScope {
                rel: rel.id,
                unit: pick(&candidates, *unit)?,
            }
        }
        Op::LeaveScope { scope } => {
            let scopes: Vec<_> = s.scopes.iter().collect();
            let (rel, unit, _) = pick(&scopes, *scope)?;
            Call::LeaveScope {
                rel: *rel,
                unit: unit.clone(),
            }
        }
        Op::Started { unit } => Call::Started {
            unit: pick(&units, *unit)?,
        },
        Op::EnsureDeadUnit { unit } => Call::EnsureDeadUnit {
            unit: pick(&units, *unit)?,
        },
        Op::RemoveUnit { unit } => Call::RemoveUnit {
            unit: pick(&units, *unit)?,
        },
        Op::EnsureDeadMachine { m } => Call::EnsureDeadMachine {
            m: pick(&machines, *m)?,
        },
        Op::RemoveMachine { m } => Call::RemoveMachine {
            m: pick(&machines, *m)?,
        },
        Op::ProvisioningError { m } => Call::ProvisioningError {
            m: pick(&machines, *m)?,
        },
        Op::Resolved { m } => Call::Resolved {
            m: pick(&machines, *m)?,
        },
        Op::Cleanup => Call::Cleanup,
    })
}

fn call(st: &Store, c: &Call) -> crate::Result<()> {
    match c {
        Call::Deploy { charm, name, units } => {
            let mut args = deploy_args(CHARMS[*charm], name, *units);
            if *charm == RING_CHARM {
                args.charm.meta.peers.get_mut("cluster").unwrap().scope = Scope::Container;
            }
            st.deploy(&args).map(|_| ())
        }
        Call::AddUnit { svc, to } => st.add_units(svc, 1, *to).map(|_| ()),
        Call::AddMachine => st.add_machines(1, None, None).map(|_| ()),
        Call::AddRelation { a, b } => st.add_relation(a, b).map(|_| ()),
        Call::DestroyRelationId { id } => st.destroy_relation_id(*id),
        Call::DestroyRelation { a, b } => st.destroy_relation(a, b),
        Call::DestroyUnit { unit } => st.destroy_units(std::slice::from_ref(unit)),
        Call::DestroyService { svc } => st.destroy_service(svc),
        Call::DestroyMachine { m } => st.destroy_machine(*m),
        Call::EnterScope { rel, unit } => st.enter_scope(*rel, unit),
        Call::LeaveScope { rel, unit } => st.leave_scope(*rel, unit),
        Call::Started { unit } => st.set_unit_status(unit, "started", ""),
        Call::EnsureDeadUnit { unit } => st.ensure_dead_unit(unit),
        Call::RemoveUnit { unit } => st.remove_unit(unit),
        Call::EnsureDeadMachine { m } => st.ensure_dead_machine(*m),
        Call::RemoveMachine { m } => st.remove_machine(*m),
        Call::ProvisioningError { m } => st.set_machine_status(*m, machine_status::ERROR, "boom"),
        Call::Resolved { m } => st.resolve_machine(*m, None),
        Call::Cleanup => st.cleanup_step().map(|_| ()),
    }
}

/// The endpoint pairs `add-relation a b` could mean, worked out afresh from
/// the charms (implicit `juju-info` pairs give way to explicit ones).
fn relatable_pairs(st: &Store, pre: &Snap, a: &str, b: &str) -> Vec<[Endpoint; 2]> {
    let eps = |s: &str| {
        let svc = &pre.services[s];
        st.charm(&svc.charm_url).unwrap().meta.endpoints(s)
    };
    let mut pairs = Vec::new();
    for x in eps(a) {
        for y in eps(b) {
            if can_relate(&x, &y) {
                pairs.push([x.clone(), y]);
            }
        }
    }
    let implicit = |p: &[Endpoint; 2]| {
        p.iter()
            .any(|e| e.relation == JUJU_INFO && e.role == Role::Provider)
    };
    if pairs.len() > 1 && pairs.iter().any(|p| !implicit(p)) {
        pairs.retain(|p| !implicit(p));
    }
    pairs
}

/// Re-checks the reason a refusal gives against the state before the
/// operation. `Err` says why the refusal was not justified.
fn justify(st: &Store, pre: &Snap, c: &Call, err: &Error) -> Result<(), String> {
    let svc = |n: &str| pre.services.get(n);
    let unit = |n: &str| pre.units.get(n);
    let machine = |m: i64| pre.machines.get(&m);
    let relation_by_key = |k: &str| pre.relations.values().find(|r| r.key == k);
    let not_alive = |l: Option<Life>, life: &Life| l == Some(*life) && *life != Life::Alive;
    let holds = match (c, err) {
        // Claims about one entity, true whatever the operation.
        (_, Error::NotFound { kind, id }) => match kind {
            Entity::Service => svc(id).is_none(),
            Entity::Unit => unit(id).is_none(),
            Entity::Machine => id.parse().ok().and_then(machine).is_none(),
            Entity::Relation => match c {
                Call::DestroyRelation { a, b } => pre.named_by(a, b).is_empty(),
                _ => id
                    .parse()
                    .ok()
                    .and_then(|i: i64| pre.relations.get(&i))
                    .is_none(),
            },
            _ => false,
        },
        (_, Error::NotAlive { kind, id, life, .. }) => match kind {
            Entity::Service => not_alive(svc(id).map(|s| s.life), life),
            Entity::Unit => not_alive(unit(id).map(|u| u.life), life),
            Entity::Machine => not_alive(id.parse().ok().and_then(machine).map(|m| m.life), life),
            Entity::Relation => not_alive(relation_by_key(id).map(|r| r.life), life),
            _ => false,
        },
        (_, Error::NotDead { kind, id }) => match kind {
            Entity::Unit => unit(id).is_some_and(|u| u.life != Life::Dead),
            Entity::Machine => id
                .parse()
                .ok()
                .and_then(machine)
                .is_some_and(|m| m.life != Life::Dead),
            _ => false,
        },
        (_, Error::ManagesEnvironment(m)) => machine(*m).is_some_and(|m| m.manages_environ()),
        (_, Error::CannotHostUnits { machine: m, .. }) => {
            machine(*m).is_some_and(|m| !m.hosts_units())
        }
        (Call::DestroyMachine { m }, Error::MachineHasUnits { machine: x, .. }) => {
            x == m
                && pre
                    .units
                    .values()
                    .any(|u| u.machine_id == Some(*m) && u.life == Life::Alive)
        }
        (Call::EnsureDeadMachine { m }, Error::MachineHasUnits { machine: x, .. }) => {
            x == m && pre.units.values().any(|u| u.machine_id == Some(*m))
        }
        (Call::Resolved { m }, Error::NoProvisioningError(x)) => {
            x == m && machine(*m).is_some_and(|m| m.status != machine_status::ERROR)
        }
        // Services.
        (
            Call::Deploy { charm, .. },
            Error::Model(jujube_core::Error::InvalidCharm { why, .. }),
        ) => *charm == RING_CHARM && why.contains("container-scoped"),
        (
            Call::Deploy { name, .. },
            Error::AlreadyExists {
                kind: Entity::Service,
                id,
            },
        ) => id == name && svc(name).is_some_and(|s| s.life == Life::Alive),
        (
            Call::Deploy { name, .. },
            Error::BeingDestroyed {
                kind: Entity::Service,
                id,
            },
        ) => id == name && svc(name).is_some_and(|s| s.life != Life::Alive),
        (Call::AddUnit { svc: s, .. }, Error::Subordinate { service, .. }) => {
            service == s && svc(s).is_some_and(|s| s.subordinate)
        }
        // Units.
        (Call::DestroyUnit { unit: u }, Error::Subordinate { service, .. }) => {
            unit(u).is_some_and(|u| u.is_subordinate() && &u.service == service)
        }
        (Call::EnsureDeadUnit { unit: u }, Error::UnitBusy { unit: x, why }) => {
            x == u
                && if why.starts_with("is still in the scope") {
                    pre.in_scope(u)
                } else {
                    why.starts_with("still has subordinates") && !pre.subordinates(u).is_empty()
                }
        }
        // Relations.
        (Call::AddRelation { a, b }, Error::Relation(msg)) => {
            if msg.contains("to itself") {
                a == b
            } else {
                let pairs = relatable_pairs(st, pre, a, b);
                if msg.starts_with("no relation between") {
                    pairs.is_empty()
                } else if msg.starts_with("ambiguous relation") {
                    pairs.len() > 1
                } else if msg.contains("neither service is a subordinate") {
                    pairs.len() == 1
                        && relation_scope(&pairs[0]) == Scope::Container
                        && !svc(a).unwrap().subordinate
                        && !svc(b).unwrap().subordinate
                } else if msg.contains("must have the same series") {
                    svc(a).unwrap().series != svc(b).unwrap().series
                } else {
                    false
                }
            }
        }
        (
            Call::AddRelation { .. },
            Error::AlreadyExists {
                kind: Entity::Relation,
                id,
            },
        ) => relation_by_key(id).is_some_and(|r| r.life == Life::Alive),
        (
            Call::AddRelation { .. },
            Error::BeingDestroyed {
                kind: Entity::Relation,
                id,
            },
        ) => relation_by_key(id).is_some_and(|r| r.life != Life::Alive),
        (Call::DestroyRelationId { id }, Error::Relation(msg)) => {
            msg.contains("is a peer relation")
                && pre.relations.get(id).is_some_and(|r| pre.is_peer(r))
        }
        (Call::DestroyRelation { a, b }, Error::Relation(msg)) => {
            let service = |s: &str| s.split(':').next().unwrap().to_string();
            if msg.contains("is a peer relation") {
                service(a) == service(b)
                    && pre.relations.values().any(|r| {
                        pre.is_peer(r)
                            && r.endpoints[0].service == service(a)
                            && [a, b]
                                .iter()
                                .all(|s| !s.contains(':') || **s == r.endpoints[0].to_string())
                    })
            } else {
                msg.starts_with("ambiguous relation") && pre.named_by(a, b).len() > 1
            }
        }
        (Call::EnterScope { rel, unit: u }, Error::Relation(msg)) => {
            let (Some(r), Some(u)) = (pre.relations.get(rel), unit(u)) else {
                return Err(format!("{c:?} names nothing, yet: {err}"));
            };
            let counterpart = r.counterpart_of(&u.service).map(|e| e.service.clone());
            if msg.contains("is not in it") {
                r.endpoint_of(&u.service).is_none()
            } else if msg.contains("is not a unit of") {
                r.scope == Scope::Container
                    && u.principal
                        .as_deref()
                        .and_then(unit)
                        .is_some_and(|p| Some(&p.service) != counterpart.as_ref())
            } else {
                false
            }
        }
        (
            Call::EnterScope { rel, unit: u },
            Error::CannotEnterScopeYet {
                unit: x,
                subordinate,
                service,
                life,
            },
        ) => {
            x == u
                && pre.relations.get(rel).is_some_and(|r| {
                    r.scope == Scope::Container && r.endpoint_of(service).is_some()
                })
                && unit(subordinate).is_some_and(|s| {
                    s.principal.as_deref() == Some(u.as_str())
                        && &s.service == service
                        && s.life == *life
                        && *life != Life::Alive
                })
        }
        _ => false,
    };
    if holds {
        Ok(())
    } else {
        Err(format!(
            "refusal of {c:?} not justified by the state before it: {err}"
        ))
    }
}

fn strings(st: &Store, sql: &str) -> Vec<String> {
    st.read(|c| {
        Ok(c.prepare(sql)?
            .query_map([], |r| r.get::<_, crate::sql::Value>(0))?
            .map(|v| {
                Ok(match v? {
                    crate::sql::Value::Integer(i) => i.to_string(),
                    crate::sql::Value::Text(t) => t,
                    other => format!("{other:?}"),
                })
            })
            .collect::<crate::sql::Result<Vec<_>>>()?)
    })
    .unwrap()
}

fn count(st: &Store, sql: &str) -> i64 {
    st.read(|c| Ok(c.query_row(sql, [], |r| r.get(0))?))
        .unwrap()
}

/// Lives seen so far, to prove none went back; removed unit names, machine
/// ids and relation ids must never come back either.
#[derive(Default)]
struct History {
    lives: HashMap<String, Life>,
    gone: HashSet<String>,
}

fn check_history(now: &Snap, h: &mut History) -> Result<(), TestCaseError> {
    let mut lives = HashMap::new();
    for m in now.machines.values() {
        lives.insert(format!("m:{}", m.id), m.life);
    }
    for u in now.units.values() {
        lives.insert(format!("u:{}", u.name), u.life);
    }
    for s in now.services.values() {
        lives.insert(format!("s:{}", s.name), s.life);
    }
    for r in now.relations.values() {
        lives.insert(format!("r:{}", r.id), r.life);
    }
    for (id, life) in &lives {
        if let Some(prev) = h.lives.get(id) {
            prop_assert!(life >= prev, "{} went back from {} to {}", id, prev, life);
        }
        prop_assert!(!h.gone.contains(id), "{} came back after removal", id);
    }
    for id in h.lives.keys() {
        if !lives.contains_key(id) && !id.starts_with("s:") {
            // Service names may be reused once removed; nothing else may.
            h.gone.insert(id.clone());
        }
    }
    h.lives = lives;
    Ok(())
}

/// What must hold in every committed state, whoever wrote it.
fn check_invariants(st: &Store) -> Result<(), TestCaseError> {
    // The JSON functions differ between the engines.
    let postgres = st.path().is_none();
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
        ("a subordinate unit's service is a subordinate service, a principal's a principal",
         "SELECT count(*) FROM units u JOIN services s ON s.name = u.service WHERE (u.principal IS NOT NULL) != s.subordinate"),
        ("a principal has at most one subordinate of each service",
         "SELECT count(*) FROM (SELECT 1 FROM units WHERE principal IS NOT NULL GROUP BY principal, service HAVING count(*) > 1) AS t"),
        ("scopes reference relations and units",
         "SELECT count(*) FROM relation_scopes WHERE relation_id NOT IN (SELECT id FROM relations) OR unit NOT IN (SELECT name FROM units)"),
        ("a scope's container is its unit's principal's name (container scope) or empty (global)",
         "SELECT count(*) FROM relation_scopes x JOIN relations r ON r.id = x.relation_id JOIN units u ON u.name = x.unit
          WHERE x.container != CASE r.scope WHEN 'container' THEN coalesce(u.principal, u.name) ELSE '' END"),
        ("relations reference services",
         "SELECT count(*) FROM relation_endpoints WHERE service NOT IN (SELECT name FROM services) OR relation_id NOT IN (SELECT id FROM relations)"),
        ("every relation has endpoints",
         "SELECT count(*) FROM relations WHERE id NOT IN (SELECT relation_id FROM relation_endpoints)"),
        ("a container-scoped relation has a subordinate side",
         "SELECT count(*) FROM relations r WHERE r.scope = 'container' AND NOT EXISTS
          (SELECT 1 FROM relation_endpoints e JOIN services s ON s.name = e.service WHERE e.relation_id = r.id AND s.subordinate)"),
        ("a dying relation has units in scope", "SELECT count(*) FROM relations WHERE life != 0 AND unit_count = 0"),
        ("an alive relation has only alive services",
         "SELECT count(*) FROM relations r JOIN relation_endpoints e ON e.relation_id = r.id JOIN services s ON s.name = e.service WHERE r.life = 0 AND s.life != 0"),
        ("an alive service keeps its peer relations",
         match postgres {
             false => "SELECT count(*) FROM services s JOIN charms c ON c.url = s.charm_url, json_each(c.meta, '$.peers') p
              WHERE s.life = 0 AND NOT EXISTS (SELECT 1 FROM relations r WHERE r.key = s.name || ':' || p.key AND r.life = 0)",
             true => "SELECT count(*) FROM services s JOIN charms c ON c.url = s.charm_url,
              json_each(CASE WHEN json_typeof(c.meta::json -> 'peers') = 'object' THEN c.meta::json -> 'peers' ELSE '{}' END) p
              WHERE s.life = 0 AND NOT EXISTS (SELECT 1 FROM relations r WHERE r.key = s.name || ':' || p.key AND r.life = 0)",
         }),
        ("an unreferenced destroyed service is removed",
         "SELECT count(*) FROM services WHERE life != 0 AND unit_count = 0 AND relation_count = 0"),
        ("dead units are in no scope", "SELECT count(*) FROM units u JOIN relation_scopes x ON x.unit = u.name WHERE u.life = 2"),
        ("dead units have no subordinates", "SELECT count(*) FROM units p JOIN units s ON s.principal = p.name WHERE p.life = 2"),
        ("dead machines host nothing", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE m.life = 2"),
        ("machines with alive units are alive", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE u.life = 0 AND m.life != 0"),
        ("units have their service's series", "SELECT count(*) FROM units u JOIN services s ON s.name = u.service WHERE u.series != s.series"),
        ("units run on machines of their series", "SELECT count(*) FROM units u JOIN machines m ON m.id = u.machine_id WHERE u.series != m.series"),
        ("subordinates have no constraints", "SELECT count(*) FROM units WHERE principal IS NOT NULL AND constraints != ''"),
        ("the controller machine lives", "SELECT count(*) FROM machines WHERE manage_environ AND life != 0"),
    ];
    for (what, sql) in checks {
        prop_assert_eq!(count(st, sql), 0, "invariant broken: {}", what);
    }
    // PostgreSQL checks every foreign key at every statement; SQLite only
    // with `foreign_keys` on, which is what this proves.
    if !postgres {
        let fk: Vec<String> = strings(st, "SELECT \"table\" FROM pragma_foreign_key_check");
        prop_assert!(fk.is_empty(), "foreign key violations in {:?}", fk);
    }
    let rows = st.stats().max_transaction_rows;
    prop_assert!(
        rows < MAX_TX_ROWS,
        "a transaction wrote {} rows (bound {})",
        rows,
        MAX_TX_ROWS
    );
    Ok(())
}

/// A cleanup acts only on what it was queued for: the units of a service
/// that is no longer Alive, and the subordinates of those units.
fn check_cleanup_step(pre: &Snap, post: &Snap) -> Result<(), TestCaseError> {
    let alive = |s: &str| pre.services.get(s).is_some_and(|s| s.life == Life::Alive);
    for (name, u) in &pre.units {
        if post.units.get(name).map(|p| p.life) == Some(u.life) {
            continue;
        }
        let principal_service_alive = u
            .principal
            .as_deref()
            .and_then(|p| pre.units.get(p))
            .is_none_or(|p| alive(&p.service));
        prop_assert!(
            !alive(&u.service) || !principal_service_alive,
            "a cleanup step touched {} of the alive service {}",
            name,
            u.service
        );
    }
    for (name, s) in &pre.services {
        if s.life == Life::Alive {
            prop_assert_eq!(
                post.services.get(name).map(|p| p.life),
                Some(Life::Alive),
                "a cleanup step touched the alive service {}",
                name
            );
        }
    }
    Ok(())
}

/// Runs cleanup steps until none is left, checking each.
fn run_cleanups_checked(st: &Store) -> Result<(), TestCaseError> {
    loop {
        let pre = Snap::take(st);
        if !st.cleanup_step().unwrap() {
            return Ok(());
        }
        check_cleanup_step(&pre, &Snap::take(st))?;
    }
}

/// One round of what agents and the provisioner would do. Returns whether
/// anything changed.
fn agents_round(st: &Store, checked: bool) -> Result<bool, TestCaseError> {
    let before = Snap::take(st);
    if checked {
        run_cleanups_checked(st)?;
    } else {
        st.run_cleanups(usize::MAX).unwrap();
    }
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
    Ok(before != Snap::take(st) || st.pending_cleanups().unwrap() > 0)
}

fn settle(st: &Store, checked: bool) -> Result<(), TestCaseError> {
    for _ in 0..100 {
        if !agents_round(st, checked)? {
            return Ok(());
        }
    }
    Err(TestCaseError::fail("the agents never settled"))
}

/// Takes everything down. `user_first`: as a user would, relations and
/// units first (the cleaner meanwhile meets whatever cleanups are left while
/// their services' names belong to live services), then the services.
fn drain(st: &Store, user_first: bool, checked: bool) -> Result<(), TestCaseError> {
    if user_first {
        let s = Snap::take(st);
        for r in s.relations.values() {
            if s.is_peer(r) {
                continue;
            }
            let spec: Vec<String> = r.endpoints.iter().map(|e| e.to_string()).collect();
            st.destroy_relation(&spec[0], &spec[1]).unwrap();
        }
        for u in s.units.values().filter(|u| !u.is_subordinate()) {
            st.destroy_units(std::slice::from_ref(&u.name)).unwrap();
        }
        settle(st, checked)?;
        let s = Snap::take(st);
        for svc in s.services.values() {
            prop_assert_eq!(svc.unit_count, 0, "{} has units after the drain", &svc.name);
        }
    }
    for s in strings(st, "SELECT name FROM services") {
        st.destroy_service(&s).unwrap();
    }
    settle(st, checked)?;
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
            "SELECT count(*) FROM machines WHERE NOT manage_environ",
        ),
    ] {
        prop_assert_eq!(
            count(st, sql),
            0,
            "{} left after every agent did its duty",
            what
        );
    }
    Ok(())
}

/// Whether another connection committed anything: the proof that a
/// refused operation committed nothing (feed, sequences and settings
/// included). On SQLite, `PRAGMA data_version` of a second connection
/// changes exactly when another connection commits, without reading every
/// table. PostgreSQL has no such counter for one schema (its transaction
/// ids are the whole server's, and the other tests write meanwhile): there
/// every row of the schema is read, by a connection of its own.
enum Observer {
    Sqlite(rusqlite::Connection),
    Postgres(Store),
}

impl Observer {
    fn new(st: &Store) -> Observer {
        match st.location() {
            crate::Location::File(path) => {
                Observer::Sqlite(rusqlite::Connection::open(path).unwrap())
            }
            crate::Location::Postgres(_) => {
                Observer::Postgres(Store::open_at(st.location(), Durability::Relaxed).unwrap())
            }
        }
    }

    /// What the database holds now, as far as the observer tells.
    fn mark(&self) -> String {
        match self {
            Observer::Sqlite(c) => c
                .query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0))
                .unwrap()
                .to_string(),
            Observer::Postgres(st) => super::digest(st),
        }
    }

    /// Whether anything committed since `mark`.
    fn committed_since(&self, mark: &str) -> bool {
        self.mark() != mark
    }
}

fn run(ops: Vec<Op>, user_first: bool) -> Result<(), TestCaseError> {
    let e = env();
    let st = &e.st;
    let obs = Observer::new(st);
    let mut h = History::default();
    let mut pre = Snap::take(st);
    for op in &ops {
        let Some(c) = resolve(&pre, op) else {
            continue;
        };
        let mark = obs.mark();
        let result = call(st, &c);
        let post = Snap::take(st);
        match result {
            Ok(()) => {
                if matches!(c, Call::AddMachine) {
                    // Proves the observer sees commits, so that the check
                    // below can fail.
                    prop_assert!(obs.committed_since(&mark), "a commit went unseen");
                }
            }
            Err(err) => {
                prop_assert!(err.is_refusal(), "{:?} failed: {}", c, err);
                prop_assert!(
                    !obs.committed_since(&mark),
                    "refused {:?} committed: {}",
                    c,
                    err
                );
                prop_assert!(pre == post, "refused {:?} changed the model: {}", c, err);
                if let Err(why) = justify(st, &pre, &c, &err) {
                    return Err(TestCaseError::fail(why));
                }
            }
        }
        if matches!(c, Call::Cleanup) {
            check_cleanup_step(&pre, &post)?;
        }
        check_history(&post, &mut h)?;
        check_invariants(st)?;
        pre = post;
    }
    drain(st, user_first, true)?;
    check_history(&Snap::take(st), &mut h)?;
    check_invariants(st)
}

/// Two threads, each with its own `Store` on one database, run their own
/// sequences at once. Refusals are expected (each acts on a view the other
/// may have changed); anything else is a failure. The invariants must hold
/// at the end and after the drain.
fn run_concurrently(a: Vec<Op>, b: Vec<Op>, user_first: bool) -> Result<(), TestCaseError> {
    let e = env();
    let location = e.st.location().clone();
    let threads: Vec<_> = [a, b]
        .into_iter()
        .map(|ops| {
            let location = location.clone();
            std::thread::spawn(move || -> Result<u64, String> {
                let st = Store::open_at(&location, Durability::Relaxed).unwrap();
                for op in &ops {
                    let Some(c) = resolve(&Snap::take(&st), op) else {
                        continue;
                    };
                    if let Err(err) = call(&st, &c) {
                        if !err.is_refusal() {
                            return Err(format!("{c:?} failed: {err}"));
                        }
                    }
                }
                Ok(st.stats().max_transaction_rows)
            })
        })
        .collect();
    for t in threads {
        let rows = t.join().unwrap().map_err(TestCaseError::fail)?;
        prop_assert!(rows < MAX_TX_ROWS, "a transaction wrote {} rows", rows);
    }
    check_invariants(&e.st)?;
    drain(&e.st, user_first, false)?;
    check_invariants(&e.st)
}

fn cases(divisor: u32) -> u32 {
    let n: u32 = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48);
    (n / divisor).max(1)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(1),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operation_sequences_keep_every_invariant(
        ops in proptest::collection::vec(op(), 150..350),
        user_first in any::<bool>(),
    ) {
        run(ops, user_first)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(8),
        max_shrink_iters: 500,
        ..ProptestConfig::default()
    })]

    #[test]
    fn two_writers_on_one_file_keep_every_invariant(
        a in proptest::collection::vec(op(), 100..200),
        b in proptest::collection::vec(op(), 100..200),
        user_first in any::<bool>(),
    ) {
        run_concurrently(a, b, user_first)?;
    }
}
