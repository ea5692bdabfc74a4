//! A consistent snapshot of the whole model, shaped for `jujube status`.
//! One read transaction, a handful of full-table queries: it must stay fast
//! at 100,000 units.

use crate::db::Store;
use crate::environment::get_environment;
use crate::model::{life, parse_scope};
use crate::Result;
use jujube_core::Life;
pub use jujube_wire::view::{
    EnvironmentStatus, MachineStatus, OrderedMap, Progress, RelationStatus, ServiceStatus, Status,
    SubordinateStatus, UnitStatus, WorkloadStatus,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};

impl Store {
    pub fn progress(&self) -> Result<Progress> {
        self.read(|c| {
            let (machines, machines_started, machines_in_error) = c
                .prepare_cached(
                    "SELECT count(*),
                            count(*) FILTER (WHERE instance_id IS NOT NULL AND status != 'error'),
                            count(*) FILTER (WHERE status = 'error')
                     FROM machines WHERE life = 0",
                )?
                .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            let (units, units_on_started_machines) = c
                .prepare_cached(
                    "SELECT count(*),
                            count(*) FILTER (WHERE m.instance_id IS NOT NULL AND m.status != 'error')
                     FROM units u LEFT JOIN machines m ON m.id = u.machine_id
                     WHERE u.principal IS NULL AND u.life != 2",
                )?
                .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(Progress {
                machines,
                machines_started,
                machines_in_error,
                units,
                units_on_started_machines,
            })
        })
    }

    /// Each Alive controller machine's controller, as `status` shows them:
    /// what grows with the controllers alone.
    pub fn controllers_status(&self) -> Result<Vec<jujube_wire::view::ControllerStatus>> {
        let now = crate::unix_now();
        self.read(|c| {
            let lapse = crate::credentials::presence_lapse(c)?;
            let lease = crate::leases::lease_in(c, crate::leases::SINGLETONS)?;
            controllers_status(c, lease.as_ref(), now, lapse)
        })
    }

    pub fn status(&self) -> Result<Status> {
        let now = crate::unix_now();
        self.read(|c| {
            let env = get_environment(c)?;
            let lapse = crate::credentials::presence_lapse(c)?;
            let mut machines = Vec::new();
            let mut stmt = c.prepare(
                "SELECT id, life, series, jobs, instance_id, status, status_info, constraints, zone, hardware,
                        CASE WHEN instance_id IS NULL THEN NULL ELSE coalesce(instance_status, 'running') END,
                        agent_status, agent_status_info,
                        (SELECT max(refused_at) FROM agent_credentials WHERE machine_id = machines.id),
                        (SELECT max(seen_at) FROM agent_credentials WHERE machine_id = machines.id)
                 FROM machines ORDER BY id",
            )?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let id: i64 = r.get(0)?;
                let (agent_status, agent_status_info) =
                    presence(r.get(11)?, r.get(12)?, r.get(14)?, now, lapse);
                machines.push((
                    id.to_string(),
                    MachineStatus {
                        life: life(r.get(1)?)?,
                        series: r.get(2)?,
                        jobs: r.get::<_, String>(3)?.split(' ').map(str::to_string).collect(),
                        instance_id: r.get(4)?,
                        instance_status: r.get(10)?,
                        status: r.get(5)?,
                        status_info: r.get(6)?,
                        constraints: r.get(7)?,
                        zone: r.get(8)?,
                        hardware: r.get(9)?,
                        agent_status,
                        agent_status_info,
                        credential_refused: refused_since(r.get(13)?),
                    },
                ));
            }

            // Relations first: services list what they are related to.
            let mut relations = Vec::new();
            let mut related: HashMap<String, BTreeMap<String, BTreeSet<String>>> = HashMap::new();
            let mut subordinate_to: HashMap<String, BTreeSet<String>> = HashMap::new();
            let mut stmt = c.prepare(
                "SELECT r.id, r.key, r.life, r.interface, r.scope, r.unit_count,
                        e.service, e.relation_name
                 FROM relations r JOIN relation_endpoints e ON e.relation_id = r.id
                 ORDER BY r.id",
            )?;
            let mut rows = stmt.query([])?;
            let mut eps: Vec<(i64, String, String, String)> = Vec::new();
            while let Some(r) = rows.next()? {
                let id: i64 = r.get(0)?;
                if relations.last().is_none_or(|l: &RelationStatus| l.id != id) {
                    relations.push(RelationStatus {
                        id,
                        key: r.get(1)?,
                        life: life(r.get(2)?)?,
                        interface: r.get(3)?,
                        scope: parse_scope(&r.get::<_, String>(4)?)?.as_str().to_string(),
                        units_in_scope: r.get(5)?,
                        message: String::new(),
                    });
                }
                eps.push((id, r.get(6)?, r.get(7)?, r.get(4)?));
            }
            for rel in relations.iter_mut().filter(|r| r.life != Life::Alive) {
                rel.message = crate::agents::relation_blockers(c, rel.id)?;
            }
            // Each endpoint is related to the other endpoint's service, or to
            // its own service in a peer relation.
            for rel in eps.chunk_by(|a, b| a.0 == b.0) {
                for (_, svc, relname, scope) in rel {
                    let entry = related.entry(svc.clone()).or_default().entry(relname.clone()).or_default();
                    for (_, other, _, _) in rel.iter().filter(|e| &e.1 != svc || rel.len() == 1) {
                        entry.insert(other.clone());
                        if scope == "container" && other != svc {
                            subordinate_to.entry(svc.clone()).or_default().insert(other.clone());
                        }
                    }
                }
            }

            // Subordinate units, grouped by principal.
            let mut subs: HashMap<String, Vec<(String, SubordinateStatus)>> = HashMap::new();
            let mut stmt = c.prepare(
                "SELECT name, principal, life, status, status_info,
                        (SELECT max(refused_at) FROM agent_credentials WHERE unit = units.name),
                        (SELECT max(seen_at) FROM agent_credentials WHERE unit = units.name),
                        workload_status, workload_message,
                        EXISTS (SELECT 1 FROM services s WHERE s.name = units.service AND s.leader = units.name),
                        status_current
                 FROM units WHERE principal IS NOT NULL ORDER BY service, number",
            )?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let (status, info) = current(r.get(3)?, r.get(4)?, r.get(10)?, life(r.get(2)?)?);
                let (agent_status, agent_status_info) =
                    presence(status, info, r.get(6)?, now, lapse);
                // A leader whose agent is down has lost it.
                let lead = r.get::<_, bool>(9)? && agent_status != "down";
                subs.entry(r.get(1)?).or_default().push((
                    r.get(0)?,
                    SubordinateStatus {
                        life: life(r.get(2)?)?,
                        agent_status,
                        agent_status_info,
                        workload_status: WorkloadStatus {
                            current: r.get(7)?,
                            message: r.get(8)?,
                        },
                        leader: lead,
                        credential_refused: refused_since(r.get(5)?),
                    },
                ));
            }

            let mut services: Vec<(String, ServiceStatus)> = Vec::new();
            let mut stmt = c.prepare(
                "SELECT name, charm_url, life, series, subordinate, constraints, workload_status, workload_message,
                        workload_version
                 FROM services ORDER BY name",
            )?;
            let mut rows = stmt.query([])?;
            let mut index = HashMap::new();
            while let Some(r) = rows.next()? {
                let name: String = r.get(0)?;
                let subordinate: bool = r.get(4)?;
                index.insert(name.clone(), services.len());
                services.push((
                    name.clone(),
                    ServiceStatus {
                        charm: r.get(1)?,
                        life: life(r.get(2)?)?,
                        series: r.get(3)?,
                        subordinate,
                        constraints: r.get(5)?,
                        subordinate_to: if subordinate {
                            subordinate_to.remove(&name).unwrap_or_default().into_iter().collect()
                        } else {
                            Vec::new()
                        },
                        relations: related
                            .remove(&name)
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, v.into_iter().collect()))
                            .collect(),
                        units: OrderedMap::default(),
                        workload_status: WorkloadStatus {
                            current: r.get(6)?,
                            message: r.get(7)?,
                        },
                        version: r.get(8)?,
                        message: String::new(),
                    },
                ));
            }

            for (name, svc) in services.iter_mut().filter(|(_, s)| s.life != Life::Alive) {
                svc.message = crate::agents::service_blockers(c, name)?;
            }

            let mut stmt = c.prepare(
                "SELECT name, service, life, machine_id, status, status_info, ports,
                        (SELECT max(refused_at) FROM agent_credentials WHERE unit = units.name),
                        (SELECT max(seen_at) FROM agent_credentials WHERE unit = units.name),
                        workload_status, workload_message,
                        EXISTS (SELECT 1 FROM services s WHERE s.name = units.service AND s.leader = units.name),
                        status_current
                 FROM units WHERE principal IS NULL ORDER BY service, number",
            )?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let name: String = r.get(0)?;
                let service: String = r.get(1)?;
                let Some(&i) = index.get(&service) else { continue };
                let subordinates = OrderedMap(subs.remove(&name).unwrap_or_default());
                let (status, info) = current(r.get(4)?, r.get(5)?, r.get(12)?, life(r.get(2)?)?);
                let (agent_status, agent_status_info) =
                    presence(status, info, r.get(8)?, now, lapse);
                let lead = r.get::<_, bool>(11)? && agent_status != "down";
                services[i].1.units.0.push((
                    name,
                    UnitStatus {
                        life: life(r.get(2)?)?,
                        machine: r.get::<_, Option<i64>>(3)?.map(|m| m.to_string()),
                        agent_status,
                        agent_status_info,
                        open_ports: r
                            .get::<_, String>(6)?
                            .split_whitespace()
                            .map(str::to_string)
                            .collect(),
                        credential_refused: refused_since(r.get(7)?),
                        workload_status: WorkloadStatus {
                            current: r.get(9)?,
                            message: r.get(10)?,
                        },
                        leader: lead,
                        subordinates,
                    },
                ));
            }

            let lease = crate::leases::lease_in(c, crate::leases::SINGLETONS)?;
            let controllers = controllers_status(c, lease.as_ref(), now, lapse)?;
            // A controller machine's agent is its controller.
            for cs in &controllers {
                if let Some((_, m)) = machines.iter_mut().find(|(id, _)| *id == cs.machine) {
                    if m.agent_status == "pending" || cs.state == "down" {
                        m.agent_status = match cs.state.as_str() {
                            "up" => "started".into(),
                            s => s.into(),
                        };
                    }
                }
            }
            Ok(Status {
                environment: EnvironmentStatus {
                    name: env.name,
                    uuid: env.uuid,
                    provider: env.provider,
                    default_series: env.default_series,
                    constraints: env.constraints.to_string(),
                    provider_status: crate::provisioning::provider_status_in(c)?,
                    singletons: lease.map(
                        |l| jujube_wire::view::LeaseStatus {
                            holder: l.holder,
                            token: l.token,
                            expires_ms: l.expires_ms,
                        },
                    ),
                },
                machines: OrderedMap(machines),
                services: OrderedMap(services),
                relations,
                strays: crate::provisioning::strays_in(c)?,
                strays_unlisted: crate::provisioning::unlisted_in(c)?,
                controllers,
            })
        })
    }
}

/// Each Alive controller machine's controller (see
/// [`jujube_wire::view::ControllerStatus`]); `now` in seconds, `lapse` the
/// agents' presence lapse in seconds.
fn controllers_status(
    c: &crate::sql::Connection,
    lease: Option<&crate::leases::Lease>,
    now: i64,
    lapse: i64,
) -> Result<Vec<jujube_wire::view::ControllerStatus>> {
    let rows = crate::controllers::controllers_in(c)?;
    let now_ms = now.saturating_mul(1000);
    Ok(crate::controllers::controller_machines(c)?
        .into_iter()
        .map(|id| {
            let row = rows.iter().find(|r| r.machine == id);
            let state = match row {
                None => "pending",
                Some(r) if now_ms - r.seen_ms <= lapse.saturating_mul(1000) => "up",
                Some(_) => "down",
            };
            jujube_wire::view::ControllerStatus {
                machine: id.to_string(),
                state: state.into(),
                addresses: row.map(|r| r.addresses.clone()).unwrap_or_default(),
                runs_singletons: row.zip(lease).is_some_and(|(r, l)| {
                    l.holder == r.holder && l.expires_ms > now_ms && state == "up"
                }),
            }
        })
        .collect())
}

fn refused_since(at: Option<i64>) -> Option<String> {
    at.map(|t| format!("{} UTC", jujube_core::time::format_utc(t.max(0) as u64)))
}

/// A unit agent's status as its agent reported it, said to be stale where
/// that agent ran in a host of in-process agents that has stopped since
/// (`status_current` false, see [`Store::agents_restarting`]) and the new
/// one has not reported yet (what `jujube wait` waits for, where the
/// unit's machine agent is not held by an error). The status itself
/// stands (a script reading `started` still reads it); an error or a
/// failed pass stands until someone acts, and is not marked, nor is a
/// unit being destroyed.
fn current(status: String, info: String, current: bool, life: Life) -> (String, String) {
    if current || life != Life::Alive || matches!(status.as_str(), "error" | "failed" | "pending") {
        return (status, info);
    }
    let stale = "not reported since its agents restarted: it came from agents that have stopped";
    let info = if info.is_empty() {
        stale.to_string()
    } else {
        format!("{info} ({stale})")
    };
    (status, info)
}

/// An agent's status as `status` shows it: `down` when it runs over the API
/// (it has a credential the server saw it use) and was last seen more than
/// `lapse` seconds ago ([`PRESENCE_LAPSE`](crate::credentials::PRESENCE_LAPSE)
/// unless `agent-presence-lapse` says otherwise) —
/// frozen, crashed, or unable to reach the controller — with since when
/// and what it was; otherwise what it reported.
fn presence(
    status: String,
    info: String,
    seen_at: Option<i64>,
    now: i64,
    lapse: i64,
) -> (String, String) {
    match seen_at {
        Some(t) if status != "pending" && t < now - lapse => {
            let was = if info.is_empty() {
                format!("was `{status}`")
            } else {
                format!("was `{status}`: {info}")
            };
            (
                "down".into(),
                format!(
                    "agent not seen since {} UTC ({was}); is its `jujube agent` process running and reaching the controller?",
                    jujube_core::time::format_utc(t.max(0) as u64)
                ),
            )
        }
        _ => (status, info),
    }
}
