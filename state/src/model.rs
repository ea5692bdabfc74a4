//! The entities as read from the store, and the small helpers that load and
//! decode them inside a transaction.

use crate::sql::{Connection, OptionalExtension, Row};
use crate::{Entity, Error, Result};
use jujube_core::charm::{CharmConfig, CharmMeta, Endpoint, Role, Scope};
use jujube_core::{Constraints, Life};
use serde::Serialize;

pub const JOB_HOST_UNITS: &str = "host-units";
pub use jujube_wire::view::JOB_MANAGE_ENVIRON;

/// Agent status before any agent has reported (units and machines).
pub const UNIT_PENDING: &str = "pending";

/// What an agent reports about itself: `agent-status` in `jujube status`.
pub mod agent_status {
    /// No agent has started yet.
    pub const PENDING: &str = "pending";
    pub const STARTED: &str = "started";
    /// The agent is carrying out its entity's Dying duties.
    pub const DYING: &str = "dying";
    /// A hook failed and holds the unit until resolved;
    /// `agent-status-info` says which.
    pub const ERROR: &str = "error";
    /// The agent's last pass failed otherwise; it retries by itself, and
    /// `agent-status-info` says why.
    pub const FAILED: &str = "failed";
    pub const ALL: [&str; 5] = [PENDING, STARTED, DYING, ERROR, FAILED];
}

/// Machine statuses. `error` carries the reason in `status_info`.
pub mod machine_status {
    pub const PENDING: &str = "pending";
    pub const PROVISIONING: &str = "provisioning";
    pub const STARTED: &str = "started";
    pub const ERROR: &str = "error";
    pub const STOPPING: &str = "stopping";
}

/// What the provisioner knows of a machine's recorded instance
/// (`instance-status` in `jujube status`).
pub mod instance_status {
    /// Recorded at its start, and seen by the instance poller since.
    pub const RUNNING: &str = "running";
    /// The cloud no longer has it: stopped or terminated behind jujube's
    /// back. The machine is in `error` until `resolved`.
    pub const GONE: &str = "gone";
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Environment {
    pub name: String,
    pub uuid: String,
    pub provider: String,
    pub default_series: String,
    pub constraints: Constraints,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Machine {
    pub id: i64,
    pub life: Life,
    pub series: String,
    pub jobs: Vec<String>,
    pub constraints: Constraints,
    pub instance_id: Option<String>,
    pub nonce: Option<String>,
    pub status: String,
    pub status_info: String,
    pub zone: Option<String>,
    pub hardware: Option<String>,
    /// What the machine's agent reports (see [`agent_status`]).
    pub agent_status: String,
    pub agent_status_info: String,
}

impl Machine {
    pub fn manages_environ(&self) -> bool {
        self.jobs.iter().any(|j| j == JOB_MANAGE_ENVIRON)
    }
    pub fn hosts_units(&self) -> bool {
        self.jobs.iter().any(|j| j == JOB_HOST_UNITS)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Service {
    pub name: String,
    pub charm_url: String,
    pub series: String,
    pub subordinate: bool,
    pub constraints: Constraints,
    pub life: Life,
    pub unit_count: i64,
    pub relation_count: i64,
    /// The current charm was set by `upgrade-charm --force`.
    pub force_charm: bool,
    /// The unit recorded as its leader (it may have been lost since; see
    /// `Store::claim_leadership`).
    pub leader: Option<String>,
    /// Moves whenever the leader changes its leader settings
    /// (`leader-settings-changed` runs on the other units).
    pub leader_settings_version: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unit {
    pub name: String,
    pub service: String,
    pub number: i64,
    pub series: String,
    pub principal: Option<String>,
    pub machine_id: Option<i64>,
    pub constraints: Constraints,
    pub life: Life,
    /// The unit's agent status (see [`agent_status`]).
    pub status: String,
    pub status_info: String,
    /// True once an agent has started for the unit: from then on only that
    /// agent may set it Dead, so destroying it can no longer remove it at once.
    pub agent_started: bool,
    /// `retry-hooks` or `no-hooks` after `jujube resolved`, until its agent
    /// acts on it.
    pub resolved: Option<String>,
}

impl Unit {
    pub fn is_subordinate(&self) -> bool {
        self.principal.is_some()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Relation {
    pub id: i64,
    pub key: String,
    pub interface: String,
    pub scope: Scope,
    pub life: Life,
    pub unit_count: i64,
    pub endpoints: Vec<Endpoint>,
}

impl Relation {
    pub fn endpoint_of(&self, service: &str) -> Option<&Endpoint> {
        self.endpoints.iter().find(|e| e.service == service)
    }
    /// The other service, or the same one for a peer relation.
    pub fn counterpart_of(&self, service: &str) -> Option<&Endpoint> {
        self.endpoints
            .iter()
            .find(|e| e.service != service)
            .or_else(|| self.endpoint_of(service))
    }
}

/// A charm as stored: its URL, metadata and config.
#[derive(Debug, Clone, PartialEq)]
pub struct Charm {
    pub url: String,
    pub meta: CharmMeta,
    pub config: CharmConfig,
    /// Its `actions.yaml`.
    pub actions: jujube_core::actions::CharmActions,
    /// Where the charm was read from, for agents that deploy it.
    pub path: String,
}

pub(crate) fn life(code: i64) -> Result<Life> {
    Life::from_code(code).ok_or(Error::Corrupt {
        what: "life",
        value: code.to_string(),
    })
}

pub(crate) fn constraints(s: String) -> Result<Constraints> {
    Constraints::parse_stored(&s).map_err(|_| Error::Corrupt {
        what: "constraints",
        value: s,
    })
}

pub(crate) const MACHINE_COLS: &str =
    "id, life, series, jobs, constraints, instance_id, nonce, status, status_info, zone, hardware, agent_status, agent_status_info";

pub(crate) fn machine_row(r: &Row<'_>) -> crate::sql::Result<(Machine, i64, String)> {
    Ok((
        Machine {
            id: r.get(0)?,
            life: Life::Alive,
            series: r.get(2)?,
            jobs: r
                .get::<_, String>(3)?
                .split(' ')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            constraints: Constraints::default(),
            instance_id: r.get(5)?,
            nonce: r.get(6)?,
            status: r.get(7)?,
            status_info: r.get(8)?,
            zone: r.get(9)?,
            hardware: r.get(10)?,
            agent_status: r.get(11)?,
            agent_status_info: r.get(12)?,
        },
        r.get(1)?,
        r.get(4)?,
    ))
}

pub(crate) fn finish_machine((mut m, l, c): (Machine, i64, String)) -> Result<Machine> {
    m.life = life(l)?;
    m.constraints = constraints(c)?;
    Ok(m)
}

pub(crate) fn find_machine(c: &Connection, id: i64) -> Result<Option<Machine>> {
    c.prepare_cached(&format!(
        "SELECT {MACHINE_COLS} FROM machines WHERE id = ?1"
    ))?
    .query_row([id], machine_row)
    .optional()?
    .map(finish_machine)
    .transpose()
}

pub(crate) fn get_machine(c: &Connection, id: i64) -> Result<Machine> {
    find_machine(c, id)?.ok_or_else(|| Error::not_found(Entity::Machine, id))
}

pub(crate) const SERVICE_COLS: &str =
    "name, charm_url, series, subordinate, constraints, life, unit_count, relation_count, force_charm, leader, leader_settings_version";

/// How many columns [`SERVICE_COLS`] names (what a statement reads after
/// them starts there).
pub(crate) const SERVICE_COLUMNS: usize = 11;
const _: () = assert!(columns(SERVICE_COLS) == SERVICE_COLUMNS);

/// How many columns a list of column names holds.
const fn columns(list: &str) -> usize {
    let (bytes, mut i, mut n) = (list.as_bytes(), 0, 1);
    while i < bytes.len() {
        if bytes[i] == b',' {
            n += 1;
        }
        i += 1;
    }
    n
}

pub(crate) fn service_row(r: &Row<'_>) -> crate::sql::Result<(Service, i64, String)> {
    Ok((
        Service {
            name: r.get(0)?,
            charm_url: r.get(1)?,
            series: r.get(2)?,
            subordinate: r.get(3)?,
            constraints: Constraints::default(),
            life: Life::Alive,
            unit_count: r.get(6)?,
            relation_count: r.get(7)?,
            force_charm: r.get(8)?,
            leader: r.get(9)?,
            leader_settings_version: r.get(10)?,
        },
        r.get(5)?,
        r.get(4)?,
    ))
}

pub(crate) fn finish_service((mut s, l, c): (Service, i64, String)) -> Result<Service> {
    s.life = life(l)?;
    s.constraints = constraints(c)?;
    Ok(s)
}

pub(crate) fn find_service(c: &Connection, name: &str) -> Result<Option<Service>> {
    c.prepare_cached(&format!(
        "SELECT {SERVICE_COLS} FROM services WHERE name = ?1"
    ))?
    .query_row([name], service_row)
    .optional()?
    .map(finish_service)
    .transpose()
}

pub(crate) fn get_service(c: &Connection, name: &str) -> Result<Service> {
    find_service(c, name)?.ok_or_else(|| Error::not_found(Entity::Service, name))
}

pub(crate) const UNIT_COLS: &str =
    "name, service, number, series, principal, machine_id, constraints, life, status, status_info, agent_started, resolved";

pub(crate) fn unit_row(r: &Row<'_>) -> crate::sql::Result<(Unit, i64, String)> {
    Ok((
        Unit {
            name: r.get(0)?,
            service: r.get(1)?,
            number: r.get(2)?,
            series: r.get(3)?,
            principal: r.get(4)?,
            machine_id: r.get(5)?,
            constraints: Constraints::default(),
            life: Life::Alive,
            status: r.get(8)?,
            status_info: r.get(9)?,
            agent_started: r.get(10)?,
            resolved: r.get(11)?,
        },
        r.get(7)?,
        r.get(6)?,
    ))
}

pub(crate) fn finish_unit((mut u, l, c): (Unit, i64, String)) -> Result<Unit> {
    u.life = life(l)?;
    u.constraints = constraints(c)?;
    Ok(u)
}

pub(crate) fn find_unit(c: &Connection, name: &str) -> Result<Option<Unit>> {
    c.prepare_cached(&format!("SELECT {UNIT_COLS} FROM units WHERE name = ?1"))?
        .query_row([name], unit_row)
        .optional()?
        .map(finish_unit)
        .transpose()
}

pub(crate) fn get_unit(c: &Connection, name: &str) -> Result<Unit> {
    find_unit(c, name)?.ok_or_else(|| Error::not_found(Entity::Unit, name))
}

pub(crate) fn find_relation(c: &Connection, id: i64) -> Result<Option<Relation>> {
    let row = c
        .prepare_cached(
            "SELECT id, key, interface, scope, life, unit_count FROM relations WHERE id = ?1",
        )?
        .query_row([id], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })
        .optional()?;
    let Some((id, key, interface, scope, l, unit_count)) = row else {
        return Ok(None);
    };
    Ok(Some(Relation {
        id,
        key,
        interface,
        scope: parse_scope(&scope)?,
        life: life(l)?,
        unit_count,
        endpoints: relation_endpoints(c, id)?,
    }))
}

pub(crate) fn get_relation(c: &Connection, id: i64) -> Result<Relation> {
    find_relation(c, id)?.ok_or_else(|| Error::not_found(Entity::Relation, id))
}

pub(crate) fn parse_scope(s: &str) -> Result<Scope> {
    Scope::parse(s).ok_or(Error::Corrupt {
        what: "relation scope",
        value: s.to_string(),
    })
}

pub(crate) fn relation_endpoints(c: &Connection, id: i64) -> Result<Vec<Endpoint>> {
    let mut stmt = c.prepare_cached(
        "SELECT service, relation_name, role, interface, scope FROM relation_endpoints
         WHERE relation_id = ?1",
    )?;
    let rows = stmt.query_map([id], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?,
            r.get::<_, String>(4)?,
        ))
    })?;
    let mut eps = Vec::new();
    for row in rows {
        let (service, relation, role, interface, scope) = row?;
        eps.push(Endpoint {
            service,
            relation,
            role: Role::parse(&role).ok_or(Error::Corrupt {
                what: "role",
                value: role.clone(),
            })?,
            interface,
            scope: parse_scope(&scope)?,
        });
    }
    let _ = jujube_core::charm::canonical_key(&mut eps);
    Ok(eps)
}

pub(crate) fn get_charm(c: &Connection, url: &str) -> Result<Charm> {
    let (meta, config, path, actions): (String, String, String, String) = c
        .prepare_cached("SELECT meta, config, path, actions FROM charms WHERE url = ?1")?
        .query_row([url], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .optional()?
        .ok_or_else(|| Error::not_found(Entity::Charm, url))?;
    Ok(Charm {
        url: url.to_string(),
        meta: charm_column(&meta, "charm metadata", url)?,
        config: charm_column(&config, "charm config", url)?,
        actions: charm_column(&actions, "charm actions", url)?,
        path,
    })
}

/// What checking settings needs of a charm: its name (for messages) and
/// its options, read without the rest of its metadata and its actions,
/// which a `set` has no use for (decoding them was a third of its work).
pub(crate) fn get_charm_options(c: &Connection, url: &str) -> Result<(String, CharmConfig)> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    let (meta, config): (String, String) = c
        .prepare_cached("SELECT meta, config FROM charms WHERE url = ?1")?
        .query_row([url], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .ok_or_else(|| Error::not_found(Entity::Charm, url))?;
    let named: Named = charm_column(&meta, "charm metadata", url)?;
    Ok((named.name, charm_column(&config, "charm config", url)?))
}

/// A charm's JSON column `what` decoded; a value that does not decode is
/// the charm `url`'s corrupt row.
fn charm_column<T: serde::de::DeserializeOwned>(
    json: &str,
    what: &'static str,
    url: &str,
) -> Result<T> {
    serde_json::from_str(json).map_err(|_| Error::Corrupt {
        what,
        value: url.to_string(),
    })
}

/// `a`, `b` as "`a`, `b`" for messages.
pub(crate) fn quote_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
