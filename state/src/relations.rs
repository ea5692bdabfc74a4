//! Relations: add (with endpoint inference), destroy, and the scope
//! operations unit agents perform — entering (which creates subordinate
//! units) and leaving (which may remove the relation and even the
//! counterpart service).

use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::model::{find_relation, get_charm, get_relation, get_service, get_unit, Relation};
use crate::sql::{Connection, OptionalExtension};
use crate::units::{insert_subordinate, remove_service_in};
use crate::{require_alive, Entity, Error, Result};
use jujube_core::charm::{
    can_relate, canonical_key, relation_scope, Endpoint, Role, Scope, JUJU_INFO,
};
use jujube_core::names::{parse_endpoint, EndpointSpec};
use jujube_core::Life;
use std::collections::BTreeMap;

/// The most a unit's settings in one relation may hold, as stored (JSON):
/// what every counterpart reads in full, whenever it changes.
pub const MAX_RELATION_SETTINGS_BYTES: usize = 256 << 10;

/// The longest key of a relation setting.
pub const MAX_RELATION_SETTING_KEY_BYTES: usize = 256;

/// Who destroys a relation decides whose relation counts it may touch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum DestroyedBy<'a> {
    /// `destroy-relation`: both services' counts drop.
    User,
    /// Destruction of this service: it settles its own count itself.
    Service(&'a str),
}

pub(crate) fn insert_relation(tx: &mut Tx<'_>, key: &str, eps: &[Endpoint]) -> Result<i64> {
    let id: i64 = tx.query_row(
        "INSERT INTO relations (key, interface, scope) VALUES (?1, ?2, ?3) RETURNING id",
        (key, &eps[0].interface, relation_scope(eps).as_str()),
        |r| r.get(0),
    )?;
    let mut counted = Vec::new();
    for ep in eps {
        tx.execute(
            "INSERT INTO relation_endpoints (relation_id, service, relation_name, role, interface, scope)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            (id, &ep.service, &ep.relation, ep.role.as_str(), &ep.interface, ep.scope.as_str()),
        )?;
        if !counted.contains(&ep.service) {
            tx.execute(
                "UPDATE services SET relation_count = relation_count + 1 WHERE name = ?1",
                [&ep.service],
            )?;
            tx.changed(ChangeKind::Service, &ep.service)?;
            counted.push(ep.service.clone());
        }
    }
    tx.changed(ChangeKind::Relation, id.to_string())?;
    Ok(id)
}

/// Relations a service takes part in, by id.
pub(crate) fn relations_of(c: &Connection, service: &str) -> Result<Vec<Relation>> {
    let ids: Vec<i64> = c
        .prepare_cached(
            "SELECT DISTINCT relation_id FROM relation_endpoints WHERE service = ?1 ORDER BY relation_id",
        )?
        .query_map([service], |r| r.get(0))?
        .collect::<crate::sql::Result<_>>()?;
    ids.into_iter().map(|id| get_relation(c, id)).collect()
}

/// Deletes a relation document and its endpoints, and queues its settings
/// for the cleaner (they may be many; the relation's removal already made
/// them unreachable).
fn delete_relation(tx: &mut Tx<'_>, rel: &Relation) -> Result<()> {
    tx.execute(
        "DELETE FROM relation_endpoints WHERE relation_id = ?1",
        [rel.id],
    )?;
    tx.execute("DELETE FROM relations WHERE id = ?1", [rel.id])?;
    tx.changed(ChangeKind::Relation, rel.id.to_string())?;
    let has_settings: bool = tx
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM relation_settings WHERE relation_id = ?1)")?
        .query_row([rel.id], |r| r.get(0))?;
    if has_settings {
        tx.execute(
            "INSERT INTO cleanups (kind, target) VALUES (?1, ?2)",
            (crate::cleanups::RELATION_SETTINGS, rel.id.to_string()),
        )?;
        tx.changed(ChangeKind::Cleanup, rel.id.to_string())?;
    }
    Ok(())
}

fn decrement_relation_count(tx: &mut Tx<'_>, service: &str) -> Result<()> {
    tx.execute(
        "UPDATE services SET relation_count = relation_count - 1 WHERE name = ?1",
        [service],
    )?;
    tx.changed(ChangeKind::Service, service)
}

fn distinct_services(rel: &Relation) -> Vec<String> {
    let mut out: Vec<String> = rel.endpoints.iter().map(|e| e.service.clone()).collect();
    out.dedup();
    out.sort();
    out.dedup();
    out
}

/// Destroys an Alive relation: Dying if any unit is in its scope, otherwise
/// removed at once. Returns true when it was removed.
pub(crate) fn destroy_relation_in(
    tx: &mut Tx<'_>,
    rel: &Relation,
    by: DestroyedBy<'_>,
) -> Result<bool> {
    if rel.unit_count > 0 {
        tx.execute(
            "UPDATE relations SET life = ?1 WHERE id = ?2",
            (Life::Dying.code(), rel.id),
        )?;
        tx.changed(ChangeKind::Relation, rel.id.to_string())?;
        return Ok(false);
    }
    for svc in distinct_services(rel) {
        match by {
            DestroyedBy::Service(s) if s == svc => {}
            _ => decrement_relation_count(tx, &svc)?,
        }
    }
    delete_relation(tx, rel)?;
    Ok(true)
}

fn is_implicit(ep: &Endpoint) -> bool {
    ep.relation == JUJU_INFO && ep.role == Role::Provider
}

/// Every endpoint pair two specs could name, given the services' charms
/// (services of any life, so that existing relations can be named too).
fn endpoint_pairs(
    c: &Connection,
    a: &EndpointSpec,
    b: &EndpointSpec,
) -> Result<Vec<[Endpoint; 2]>> {
    let eps = |spec: &EndpointSpec| -> Result<Vec<Endpoint>> {
        let svc = get_service(c, &spec.service)?;
        let charm = get_charm(c, &svc.charm_url)?;
        Ok(charm
            .meta
            .endpoints(&svc.name)
            .into_iter()
            .filter(|e| spec.relation.as_ref().is_none_or(|r| *r == e.relation))
            .collect())
    };
    let (ea, eb) = (eps(a)?, eps(b)?);
    let mut pairs = Vec::new();
    for x in &ea {
        for y in &eb {
            if can_relate(x, y) {
                pairs.push([x.clone(), y.clone()]);
            }
        }
    }
    Ok(pairs)
}

/// The pairs a new relation could use. When several match, pairs that use
/// the implicit `juju-info` provider give way to explicit ones.
fn infer(c: &Connection, a: &EndpointSpec, b: &EndpointSpec) -> Result<Vec<[Endpoint; 2]>> {
    let mut pairs = endpoint_pairs(c, a, b)?;
    if pairs.len() > 1 && pairs.iter().any(|p| !p.iter().any(is_implicit)) {
        pairs.retain(|p| !p.iter().any(is_implicit));
    }
    Ok(pairs)
}

fn spec_str(s: &EndpointSpec) -> String {
    match &s.relation {
        Some(r) => format!("{}:{}", s.service, r),
        None => s.service.clone(),
    }
}

fn ambiguous(a: &EndpointSpec, b: &EndpointSpec, pairs: &mut [[Endpoint; 2]]) -> Error {
    let keys: Vec<String> = pairs
        .iter_mut()
        .map(|p| format!("`{}`", canonical_key(p)))
        .collect();
    Error::Relation(format!(
        "ambiguous relation `{} {}` could be {}; name the relations, e.g. `{}`",
        spec_str(a),
        spec_str(b),
        keys.join(" or "),
        keys[0].trim_matches('`')
    ))
}

fn is_peer(rel: &Relation) -> bool {
    matches!(rel.endpoints.as_slice(), [ep] if ep.role == Role::Peer)
}

/// Peer relations exist exactly as long as their service (lifecycles.txt:
/// they are created with it, and only its destruction removes them); one
/// destroyed alone could never be added back.
fn peer_refusal(rel: &Relation) -> Error {
    Error::Relation(format!(
        "relation `{}` is a peer relation of service `{}` and lives as long as it; destroy the service to remove it",
        rel.key, rel.endpoints[0].service
    ))
}

/// The unit of `sub` that is subordinate to `principal`, if any.
fn subordinate_for(c: &Connection, sub: &str, principal: &str) -> Result<Option<String>> {
    Ok(
        c.prepare_cached("SELECT name FROM units WHERE principal = ?1 AND service = ?2")?
            .query_row((principal, sub), |r| r.get(0))
            .optional()?,
    )
}

/// The most relations one service may be in (its peer relations
/// included): each of its units' agents reads them all, in its view and in
/// `goal-state`. A charm declares at most
/// [`jujube_core::charm::MAX_RELATIONS_DECLARED`] endpoints, so a deploy's
/// peer relations always fit.
pub const MAX_RELATIONS_PER_SERVICE: usize = 1000;

impl Store {
    pub fn relation(&self, id: i64) -> Result<Relation> {
        self.read(|c| get_relation(c, id))
    }

    pub fn relations(&self) -> Result<Vec<Relation>> {
        self.read(|c| {
            let ids: Vec<i64> = c
                .prepare_cached("SELECT id FROM relations ORDER BY id")?
                .query_map([], |r| r.get(0))?
                .collect::<crate::sql::Result<_>>()?;
            ids.into_iter().map(|id| get_relation(c, id)).collect()
        })
    }

    /// Relations a service takes part in.
    pub fn relations_of(&self, service: &str) -> Result<Vec<Relation>> {
        self.read(|c| relations_of(c, service))
    }

    /// `add-relation EP EP`. Both services must be Alive; exactly one pair of
    /// endpoints must match; container-scoped relations need a subordinate
    /// on one side and equal series on both; no identical relation may
    /// exist, even a Dying one; neither service may be in
    /// [`MAX_RELATIONS_PER_SERVICE`] relations already.
    pub fn add_relation(&self, a: &str, b: &str) -> Result<Relation> {
        let (sa, sb) = (parse_endpoint(a)?, parse_endpoint(b)?);
        if sa.service == sb.service {
            return Err(Error::Relation(format!(
                "cannot relate service `{}` to itself; peer relations are added when it is deployed",
                sa.service
            )));
        }
        self.write(|tx| {
            let svc_a = get_service(tx, &sa.service)?;
            let svc_b = get_service(tx, &sb.service)?;
            for s in [&svc_a, &svc_b] {
                require_alive(Entity::Service, &s.name, s.life, "join new relations")?;
            }
            for s in [&svc_a, &svc_b] {
                if s.relation_count as usize >= MAX_RELATIONS_PER_SERVICE {
                    return Err(Error::Relation(format!(
                        "cannot relate `{}` and `{}`: service `{}` is in {} relations, the most a service may join; remove one first (`jujube destroy-relation`)",
                        sa.service, sb.service, s.name, s.relation_count
                    )));
                }
            }
            let mut pairs = infer(tx, &sa, &sb)?;
            let mut eps = match pairs.len() {
                0 => {
                    return Err(Error::Relation(format!(
                        "no relation between `{}` and `{}`: no provider and requirer with a common interface; `jujube status` and the charms' metadata.yaml show their endpoints",
                        spec_str(&sa),
                        spec_str(&sb)
                    )))
                }
                1 => pairs.pop().expect("one pair").to_vec(),
                _ => return Err(ambiguous(&sa, &sb, &mut pairs)),
            };
            let key = canonical_key(&mut eps);
            if relation_scope(&eps) == Scope::Container {
                if !svc_a.subordinate && !svc_b.subordinate {
                    return Err(Error::Relation(format!(
                        "relation `{key}` is container-scoped but neither service is a subordinate; relate a subordinate service instead"
                    )));
                }
                if svc_a.series != svc_b.series {
                    return Err(Error::Relation(format!(
                        "relation `{key}` is container-scoped, so both services must have the same series, but `{}` is `{}` and `{}` is `{}`; deploy the subordinate with `--series {}`",
                        svc_a.name, svc_a.series, svc_b.name, svc_b.series,
                        if svc_a.subordinate { &svc_b.series } else { &svc_a.series }
                    )));
                }
            }
            let existing: Option<i64> = tx
                .query_row("SELECT life FROM relations WHERE key = ?1", [&key], |r| r.get(0))
                .optional()?;
            match existing.map(crate::model::life).transpose()? {
                Some(Life::Alive) => {
                    return Err(Error::AlreadyExists {
                        kind: Entity::Relation,
                        id: key,
                    })
                }
                Some(_) => {
                    return Err(Error::BeingDestroyed {
                        kind: Entity::Relation,
                        id: key,
                    })
                }
                None => {}
            }
            let id = insert_relation(tx, &key, &eps)?;
            get_relation(tx, id)
        })
    }

    /// `destroy-relation EP EP`: finds the one existing relation the
    /// endpoints name and destroys it (a no-op if it is already Dying).
    pub fn destroy_relation(&self, a: &str, b: &str) -> Result<()> {
        let (sa, sb) = (parse_endpoint(a)?, parse_endpoint(b)?);
        self.write(|tx| {
            if sa.service == sb.service {
                // Both ends on one service can only name its peer relation.
                let named = |r: &Relation| {
                    [&sa, &sb].iter().all(|s| {
                        s.relation
                            .as_ref()
                            .is_none_or(|n| *n == r.endpoints[0].relation)
                    })
                };
                if let Some(peer) = relations_of(tx, &sa.service)?
                    .iter()
                    .find(|r| is_peer(r) && named(r))
                {
                    return Err(peer_refusal(peer));
                }
            }
            let mut found = Vec::new();
            for mut pair in endpoint_pairs(tx, &sa, &sb)? {
                let key = canonical_key(&mut pair);
                let id: Option<i64> = tx
                    .query_row("SELECT id FROM relations WHERE key = ?1", [&key], |r| {
                        r.get(0)
                    })
                    .optional()?;
                if let Some(id) = id {
                    found.push((id, pair));
                }
            }
            match found.len() {
                0 => Err(Error::NotFound {
                    kind: Entity::Relation,
                    id: format!("{} {}", spec_str(&sa), spec_str(&sb)),
                }),
                1 => {
                    let rel = get_relation(tx, found[0].0)?;
                    if rel.life != Life::Alive {
                        return Ok(());
                    }
                    destroy_relation_in(tx, &rel, DestroyedBy::User).map(|_| ())
                }
                _ => {
                    let mut pairs: Vec<_> = found.into_iter().map(|(_, p)| p).collect();
                    Err(ambiguous(&sa, &sb, &mut pairs))
                }
            }
        })
    }

    /// Destroys a relation by id (as `destroy-relation` does). Peer
    /// relations are refused: they go with their service.
    pub fn destroy_relation_id(&self, id: i64) -> Result<()> {
        self.write(|tx| {
            let rel = get_relation(tx, id)?;
            if is_peer(&rel) {
                return Err(peer_refusal(&rel));
            }
            if rel.life != Life::Alive {
                return Ok(());
            }
            destroy_relation_in(tx, &rel, DestroyedBy::User).map(|_| ())
        })
    }

    /// A unit agent joins a relation. Both the relation and the unit must be
    /// Alive. A principal entering a container-scoped relation gets its
    /// subordinate unit of the other service created here, if it has none;
    /// if it has one that is not Alive, entering is refused with
    /// [`Error::CannotEnterScopeYet`] (as in Juju): the agent retries once
    /// the old subordinate is removed, and a new one is then created.
    /// Already in scope: a no-op.
    pub(crate) fn enter_scope_in(tx: &mut Tx<'_>, relation_id: i64, unit: &str) -> Result<()> {
        {
            let rel = get_relation(tx, relation_id)?;
            let u = get_unit(tx, unit)?;
            let in_scope: bool = tx
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM relation_scopes WHERE relation_id = ?1 AND unit = ?2)",
                )?
                .query_row((relation_id, unit), |r| r.get(0))?;
            if in_scope {
                return Ok(());
            }
            require_alive(Entity::Relation, &rel.key, rel.life, "be joined")?;
            require_alive(Entity::Unit, &u.name, u.life, "join relations")?;
            if rel.endpoint_of(&u.service).is_none() {
                return Err(Error::Relation(format!(
                    "unit `{unit}` cannot join relation `{}`: its service `{}` is not in it",
                    rel.key, u.service
                )));
            }
            let counterpart = rel
                .counterpart_of(&u.service)
                .expect("relation has endpoints")
                .service
                .clone();
            let container = match (rel.scope, &u.principal) {
                (Scope::Global, _) => String::new(),
                (Scope::Container, Some(principal)) => {
                    let p = get_unit(tx, principal)?;
                    // With its principal's service, or with another
                    // subordinate service: that one's unit under the same
                    // principal shares the container.
                    if p.service != counterpart && !get_service(tx, &counterpart)?.subordinate {
                        return Err(Error::Relation(format!(
                            "unit `{unit}` cannot join container relation `{}`: its principal `{principal}` is not a unit of `{counterpart}`, and `{counterpart}` is not a subordinate",
                            rel.key
                        )));
                    }
                    principal.clone()
                }
                (Scope::Container, None) => {
                    let sub = get_service(tx, &counterpart)?;
                    if !sub.subordinate {
                        // Deploy refuses charms that could make this (a
                        // container-scoped peer relation); never create a
                        // "subordinate" of a principal service.
                        return Err(Error::Relation(format!(
                            "unit `{unit}` cannot join container relation `{}`: the other side, service `{}`, is not a subordinate",
                            rel.key, sub.name
                        )));
                    }
                    match subordinate_for(tx, &sub.name, unit)? {
                        None => {
                            require_alive(Entity::Service, &sub.name, sub.life, "get new units")?;
                            insert_subordinate(tx, &sub, unit)?;
                        }
                        Some(existing) => {
                            let existing = get_unit(tx, &existing)?;
                            if existing.life != Life::Alive {
                                return Err(Error::CannotEnterScopeYet {
                                    unit: unit.to_string(),
                                    subordinate: existing.name,
                                    service: sub.name,
                                    life: existing.life,
                                });
                            }
                        }
                    }
                    u.name.clone()
                }
            };
            tx.prepare_cached(
                "INSERT INTO relation_scopes (relation_id, unit, container) VALUES (?1, ?2, ?3)",
            )?
            .execute((relation_id, unit, &container))?;
            tx.prepare_cached(
                "INSERT INTO relation_settings (relation_id, unit) VALUES (?1, ?2)
                 ON CONFLICT DO NOTHING",
            )?
            .execute((relation_id, unit))?;
            tx.prepare_cached("UPDATE relations SET unit_count = unit_count + 1 WHERE id = ?1")?
                .execute([relation_id])?;
            tx.changed(ChangeKind::Scope, format!("{relation_id}#{unit}"))?;
            tx.changed(ChangeKind::Relation, relation_id.to_string())
        }
    }

    /// A unit agent departs a relation. When the last unit leaves a Dying
    /// relation, the relation is removed in this same transaction, and with
    /// it the counterpart service if that was Dying and held by nothing
    /// else. Not in scope (or no such relation): a no-op.
    pub(crate) fn leave_scope_in(tx: &mut Tx<'_>, relation_id: i64, unit: &str) -> Result<()> {
        {
            let Some(rel) = find_relation(tx, relation_id)? else {
                return Ok(());
            };
            let n = tx
                .prepare_cached("DELETE FROM relation_scopes WHERE relation_id = ?1 AND unit = ?2")?
                .execute((relation_id, unit))?;
            if n == 0 {
                return Ok(());
            }
            tx.prepare_cached("UPDATE relations SET unit_count = unit_count - 1 WHERE id = ?1")?
                .execute([relation_id])?;
            tx.changed(ChangeKind::Scope, format!("{relation_id}#{unit}"))?;
            tx.changed(ChangeKind::Relation, relation_id.to_string())?;
            if rel.life == Life::Alive || rel.unit_count > 1 {
                return Ok(());
            }
            // The last unit left a Dying relation: remove it.
            let u = get_unit(tx, unit)?;
            decrement_relation_count(tx, &u.service)?;
            delete_relation(tx, &rel)?;
            let counterpart = rel
                .counterpart_of(&u.service)
                .expect("relation has endpoints");
            if counterpart.service != u.service {
                let other = get_service(tx, &counterpart.service)?;
                if other.life == Life::Alive || other.unit_count > 0 || other.relation_count >= 2 {
                    decrement_relation_count(tx, &other.name)?;
                } else {
                    remove_service_in(tx, &other.name)?;
                }
            }
            Ok(())
        }
    }

    /// The units in a relation's scope that `unit` relates to, as its agent
    /// sees them (Juju's relation scope watcher): units of the counterpart
    /// service — of its own service, other than itself, for a peer
    /// relation — and, in a container-scoped relation, only those in its own
    /// container (its principal, or its subordinate). In unit-number order.
    /// `unit` need not be in scope itself; its service must be in the
    /// relation.
    pub fn scope_units(&self, relation_id: i64, unit: &str) -> Result<Vec<String>> {
        self.read(|c| {
            let rel = get_relation(c, relation_id)?;
            let u = get_unit(c, unit)?;
            if rel.endpoint_of(&u.service).is_none() {
                return Err(Error::Relation(format!(
                    "unit `{unit}` is not in relation `{}`: its service `{}` is not in it",
                    rel.key, u.service
                )));
            }
            let counterpart = &rel
                .counterpart_of(&u.service)
                .expect("relation has endpoints")
                .service;
            // The container of a unit is its principal's name, or its own
            // for a principal; the scope rows record the same.
            let container = match rel.scope {
                Scope::Global => String::new(),
                Scope::Container => u.principal.clone().unwrap_or_else(|| u.name.clone()),
            };
            let names = c
                .prepare_cached(
                    "SELECT s.unit FROM relation_scopes s JOIN units u ON u.name = s.unit
                     WHERE s.relation_id = ?1 AND s.container = ?2 AND u.service = ?3
                       AND s.unit != ?4
                     ORDER BY u.number",
                )?
                .query_map((relation_id, &container, counterpart, unit), |r| r.get(0))?
                .collect::<crate::sql::Result<Vec<String>>>()?;
            Ok(names)
        })
    }

    /// A unit's settings in a relation (kept after it leaves, until the
    /// relation is removed).
    pub fn relation_settings(
        &self,
        relation_id: i64,
        unit: &str,
    ) -> Result<BTreeMap<String, String>> {
        self.read(|c| {
            let raw: Option<String> = c
                .prepare_cached(
                    "SELECT settings FROM relation_settings WHERE relation_id = ?1 AND unit = ?2",
                )?
                .query_row((relation_id, unit), |r| r.get(0))
                .optional()?;
            let raw = raw.ok_or_else(|| Error::NotFound {
                kind: Entity::Relation,
                id: format!("{relation_id} settings of {unit}"),
            })?;
            serde_json::from_str(&raw).map_err(|_| Error::Corrupt {
                what: "relation settings",
                value: raw,
            })
        })
    }

    /// Applies changes (`None` deletes a key) to a unit's settings in a
    /// relation whose scope it is in; refused, changing nothing, when the
    /// result would exceed [`MAX_RELATION_SETTINGS_BYTES`] or a key
    /// [`MAX_RELATION_SETTING_KEY_BYTES`].
    pub(crate) fn update_relation_settings_in(
        tx: &mut Tx<'_>,
        relation_id: i64,
        unit: &str,
        changes: &[(String, Option<String>)],
    ) -> Result<()> {
        {
            let raw: Option<String> = tx
                .query_row(
                    "SELECT st.settings FROM relation_settings st JOIN relation_scopes sc
                     ON sc.relation_id = st.relation_id AND sc.unit = st.unit
                     WHERE st.relation_id = ?1 AND st.unit = ?2",
                    (relation_id, unit),
                    |r| r.get(0),
                )
                .optional()?;
            let raw = raw.ok_or_else(|| Error::Relation(format!(
                "unit `{unit}` is not in the scope of relation `{relation_id}`; it can only change its settings while joined"
            )))?;
            let settings: BTreeMap<String, String> =
                serde_json::from_str(&raw).map_err(|_| Error::Corrupt {
                    what: "relation settings",
                    value: raw,
                })?;
            let text = apply_settings(
                settings,
                changes,
                &format!("unit `{unit}`'s settings in relation `{relation_id}`"),
                "a unit may hold in one relation",
            )?;
            tx.execute(
                "UPDATE relation_settings SET settings = ?1, version = version + 1
                 WHERE relation_id = ?2 AND unit = ?3",
                (text, relation_id, unit),
            )?;
            tx.changed(ChangeKind::Settings, format!("{relation_id}#{unit}"))
        }
    }
}

/// `settings` with `changes` applied (`None` deletes a key), as the JSON to
/// store: refused when a key is empty or longer than
/// [`MAX_RELATION_SETTING_KEY_BYTES`], or the whole longer than
/// [`MAX_RELATION_SETTINGS_BYTES`]. `whose` names them in the refusal,
/// `holder` says who is bounded.
pub(crate) fn apply_settings(
    mut settings: BTreeMap<String, String>,
    changes: &[(String, Option<String>)],
    whose: &str,
    holder: &str,
) -> Result<String> {
    for (k, v) in changes {
        if k.is_empty() || k.len() > MAX_RELATION_SETTING_KEY_BYTES {
            return Err(Error::Relation(format!(
                "{whose} cannot take a key {} bytes long: a key is 1 to {MAX_RELATION_SETTING_KEY_BYTES} bytes",
                k.len()
            )));
        }
        match v {
            Some(v) => settings.insert(k.clone(), v.clone()),
            None => settings.remove(k),
        };
    }
    let text = serde_json::to_string(&settings).expect("settings serialise");
    if text.len() > MAX_RELATION_SETTINGS_BYTES {
        return Err(Error::Relation(format!(
            "{whose} would be {} bytes, more than the {MAX_RELATION_SETTINGS_BYTES} {holder}; nothing was changed: pass large data another way (a file the charm serves, a reference)",
            text.len()
        )));
    }
    Ok(text)
}
