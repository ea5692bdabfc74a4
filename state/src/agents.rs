//! What agents (and the controller, in their place where the spec says so)
//! write, each write carrying who makes it.
//!
//! Every agent-side write is an [`AgentOp`] applied by a [`Caller`]; the
//! store checks, inside the op's own transaction, that the caller is the one
//! the spec makes responsible:
//!
//! | op | who may |
//! |---|---|
//! | unit status | the unit's agent (which marks the unit's agent started), or its deployer |
//! | machine agent status | the machine's agent |
//! | enter/leave scope, relation settings | the unit's agent |
//! | answer a `jujube run` | the unit's agent |
//! | set own unit Dying (service Dying, subordinate orphaned) | the unit's agent |
//! | set a unit Dead | the unit's agent, or its deployer (for a unit it never deployed) |
//! | remove a unit | its deployer: the machine agent for a principal, the principal's unit agent for a subordinate |
//! | set a machine Dead | the machine's agent; the controller only for a machine that never had an instance (no agent can exist) |
//! | remove a machine | the controller |
//!
//! [`Store::apply_batch`] applies many ops in one transaction, each in its
//! own savepoint: every op is still checked and applied atomically on its
//! own (a refused op changes nothing), but they share one commit — one fsync
//! for a hundred agents' writes, which is what keeps 100,000 agents cheap.
//!
//! The reads here are the consistent snapshots an agent decides on: a unit's
//! context (its unit, service, relations and whether it is in each scope, its
//! subordinates) and a machine's principals, one read transaction each.

use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::model::{
    agent_status, find_machine, find_unit, finish_unit, get_machine, get_service, get_unit,
    unit_row, Machine, Relation, Service, Unit, UNIT_COLS,
};
use crate::relations::relations_of;
use crate::sql::{Connection, OptionalExtension};
use crate::units::destroy_unit_in;
use crate::{Error, Result};
use jujube_core::charm::Scope;
use jujube_core::Life;
pub use jujube_wire::facade::MAX_STATUS_INFO_BYTES;
use std::collections::BTreeMap;
use std::fmt;

/// What an agent's write carries so that it is applied at most once and
/// never after a later one of the same agent.
///
/// Agents that reach the store through a controller's API may have a write
/// held up there (the controller cut off from the database, its writer
/// retrying) while they give up on that controller and report again
/// through another. Without a stamp the held write could commit last and
/// undo what the agent reported since. Each agent takes an incarnation as
/// it starts ([`Store::start_agent`]) and numbers its writes from 1 within
/// it, sending a write again (after a lost answer) under the same number.
/// Its row (`units` or `machines`) keeps the incarnation and the number of
/// its last write applied, changed in the write's own transaction, so
/// that:
/// - the next number is applied, and recorded;
/// - the last number applied is a resend: answered as done, applied once;
/// - anything else (an earlier number, an earlier incarnation) is
///   [`Error::Superseded`], changing nothing.
///
/// The agents a controller runs in its own process under the singletons
/// lease send no stamp: the lease fences them (see `crate::leases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub incarnation: i64,
    pub seq: i64,
}

/// The row that keeps `agent`'s stamp: its table, key column and key.
fn stamp_row(agent: &Caller) -> Option<(&'static str, &'static str, &dyn crate::sql::ToSql)> {
    match agent {
        Caller::Unit(u) => Some(("units", "name", u)),
        Caller::Machine(m) => Some(("machines", "id", m)),
        Caller::Controller => None,
    }
}

/// Checks and records `stamp` for `agent`'s op in the op's transaction
/// (see [`Stamp`]): whether to apply the op (false: applied already).
/// An agent whose row is gone has its op checked by the op's own rule.
pub(crate) fn stamp_in(tx: &mut Tx<'_>, agent: &Caller, stamp: &Stamp) -> Result<bool> {
    let Some((table, key, id)) = stamp_row(agent) else {
        return Ok(true);
    };
    // 0 is what a fresh incarnation has applied: no write is numbered so.
    if stamp.seq < 1 {
        return Err(Error::Superseded {
            agent: agent.to_string(),
        });
    }
    let next = tx
        .prepare_cached(&format!(
            "UPDATE {table} SET agent_seq = ?3
             WHERE {key} = ?1 AND agent_incarnation = ?2 AND agent_seq < ?3"
        ))?
        .execute(crate::sql::params![*id, stamp.incarnation, stamp.seq])?;
    if next == 1 {
        return Ok(true);
    }
    let kept: Option<(i64, i64)> = tx
        .prepare_cached(&format!(
            "SELECT agent_incarnation, agent_seq FROM {table} WHERE {key} = ?1"
        ))?
        .query_row(crate::sql::params![*id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    match kept {
        None => Ok(true),
        Some(kept) if kept == (stamp.incarnation, stamp.seq) => Ok(false),
        Some(_) => Err(Error::Superseded {
            agent: agent.to_string(),
        }),
    }
}

/// Who makes an agent-side write.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The environment manager (provisioner, cleaner): JobManageEnviron.
    Controller,
    /// The agent of this machine.
    Machine(i64),
    /// The agent of this unit.
    Unit(String),
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Controller => f.write_str("the controller"),
            Caller::Machine(id) => write!(f, "the agent of machine `{id}`"),
            Caller::Unit(u) => write!(f, "the agent of unit `{u}`"),
        }
    }
}

/// An agent-side write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentOp {
    /// A unit's agent status (`started`, `dying`, `error`) and its message.
    SetUnitStatus {
        unit: String,
        status: String,
        info: String,
    },
    /// The unit's agent has acted on `jujube resolved`.
    ClearResolved {
        unit: String,
    },
    /// A hook's `open-port` / `close-port`: `port` is `N/tcp` or `N/udp`.
    SetPort {
        unit: String,
        port: String,
        open: bool,
    },
    SetMachineAgentStatus {
        machine: i64,
        status: String,
        info: String,
    },
    /// `application-version-set`: the version of the service's workload.
    SetWorkloadVersion {
        unit: String,
        version: String,
    },
    /// `status-set`: the unit's workload status, or (`application`) its
    /// service's, which only the service's leader sets.
    SetWorkloadStatus {
        unit: String,
        application: bool,
        status: String,
        message: String,
    },
    /// Enters the scope with `settings` as the unit's first relation
    /// settings (its `private-address`), in the same transaction: no
    /// counterpart ever sees it in scope without them.
    EnterScope {
        relation: i64,
        unit: String,
        settings: Vec<(String, String)>,
    },
    LeaveScope {
        relation: i64,
        unit: String,
    },
    UpdateRelationSettings {
        relation: i64,
        unit: String,
        changes: Vec<(String, Option<String>)>,
    },
    /// The leader's agent changes its application's settings in a relation
    /// or its leader settings (see [`crate::bags`]).
    UpdateBag {
        unit: String,
        bag: crate::bags::Bag,
        changes: Vec<(String, Option<String>)>,
    },
    /// The unit's agent sets its Alive unit Dying because its service is
    /// not Alive, or (a subordinate) because no Alive container-scoped
    /// relation between its service and its principal's service remains.
    /// Refused while neither holds; not Alive already: a no-op.
    EnsureDyingUnit {
        unit: String,
    },
    EnsureDeadUnit {
        unit: String,
    },
    RemoveUnit {
        unit: String,
    },
    EnsureDeadMachine {
        machine: i64,
    },
    RemoveMachine {
        machine: i64,
    },
    /// The unit's agent answers a `jujube run` request.
    FinishRun {
        unit: String,
        id: i64,
        result: crate::runs::RunResult,
    },
}

/// Who deploys a unit, and so recalls and removes it.
pub fn deployer_of(unit: &Unit) -> Caller {
    match (&unit.principal, unit.machine_id) {
        (Some(p), _) => Caller::Unit(p.clone()),
        (None, Some(m)) => Caller::Machine(m),
        (None, None) => Caller::Controller,
    }
}

fn unauthorized(by: &Caller, action: String) -> Error {
    Error::Unauthorized {
        caller: by.to_string(),
        action,
    }
}

fn is_unit(by: &Caller, name: &str) -> bool {
    matches!(by, Caller::Unit(u) if u == name)
}

fn check_status(status: &str) -> Result<()> {
    if status != agent_status::PENDING && agent_status::ALL.contains(&status) {
        Ok(())
    } else {
        Err(Error::InvalidStatus(status.to_string()))
    }
}

/// True when an Alive container-scoped relation joins `a` and `b`.
fn alive_container_relation(c: &Connection, a: &str, b: &str) -> Result<bool> {
    Ok(c.prepare_cached(
        "SELECT EXISTS (SELECT 1 FROM relations r
           JOIN relation_endpoints x ON x.relation_id = r.id AND x.service = ?1
           JOIN relation_endpoints y ON y.relation_id = r.id AND y.service = ?2
          WHERE r.scope = 'container' AND r.life = 0)",
    )?
    .query_row((a, b), |r| r.get(0))?)
}

/// An agent's status message within [`MAX_STATUS_INFO_BYTES`].
fn check_status_info(info: &str) -> Result<()> {
    if info.len() > MAX_STATUS_INFO_BYTES {
        return Err(Error::Relation(format!(
            "an agent status message of {} bytes is more than {MAX_STATUS_INFO_BYTES}; shorten it",
            info.len()
        )));
    }
    Ok(())
}

/// Records that the unit's agent has started (see [`Unit::agent_started`]).
fn mark_agent_started(tx: &Tx<'_>, unit: &str) -> Result<()> {
    tx.prepare_cached("UPDATE units SET agent_started = TRUE WHERE name = ?1")?
        .execute([unit])?;
    Ok(())
}

fn apply_in(tx: &mut Tx<'_>, by: &Caller, op: &AgentOp) -> Result<()> {
    match op {
        AgentOp::SetUnitStatus { unit, status, info } => {
            check_status(status)?;
            check_status_info(info)?;
            let u = get_unit(tx, unit)?;
            if is_unit(by, unit) {
                // An agent reporting is an agent that has started.
                mark_agent_started(tx, unit)?;
            } else if *by != deployer_of(&u) {
                return Err(unauthorized(by, format!("set the status of unit `{unit}`")));
            }
            Store::set_unit_status_in(tx, unit, status, info)
        }
        AgentOp::SetPort { unit, port, open } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("open or close ports of unit `{unit}`"),
                ));
            }
            let range = PortRange::parse(port)?;
            get_unit(tx, unit)?;
            let now: String = tx
                .prepare_cached("SELECT ports FROM units WHERE name = ?1")?
                .query_row([unit], |r| r.get(0))?;
            let mut ranges: Vec<PortRange> = now
                .split_whitespace()
                .filter_map(|p| PortRange::parse(p).ok())
                .collect();
            if *open {
                // Juju: opening the same range again is a no-op; a range
                // overlapping another one of the unit is refused.
                if let Some(other) = ranges.iter().find(|r| **r != range && r.overlaps(&range)) {
                    return Err(Error::Relation(format!(
                        "cannot open {range} (unit `{unit}`): conflicts with {other} already open; close it first"
                    )));
                }
                if !ranges.contains(&range) {
                    if ranges.len() >= MAX_OPEN_PORT_RANGES {
                        return Err(Error::Relation(format!(
                            "unit `{unit}` has {MAX_OPEN_PORT_RANGES} port ranges open, the most a unit may have; close some (`close-port`) or open one range for many ports (`open-port 1000-2000/tcp`)"
                        )));
                    }
                    ranges.push(range);
                }
            } else {
                ranges.retain(|r| *r != range);
            }
            ranges.sort();
            let next = ranges
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ");
            if next != now {
                tx.prepare_cached("UPDATE units SET ports = ?1 WHERE name = ?2")?
                    .execute((&next, unit))?;
                tx.changed(ChangeKind::Unit, unit.clone())?;
            }
            Ok(())
        }
        AgentOp::SetWorkloadStatus {
            unit,
            application,
            status,
            message,
        } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("set the workload status of unit `{unit}`"),
                ));
            }
            if !WORKLOAD_STATUSES.contains(&status.as_str()) {
                return Err(Error::Relation(format!(
                    "invalid workload status `{status}`: use `maintenance`, `blocked`, `waiting` or `active`"
                )));
            }
            if message.len() > MAX_WORKLOAD_MESSAGE_BYTES {
                return Err(Error::Relation(format!(
                    "a status message of {} bytes is more than {MAX_WORKLOAD_MESSAGE_BYTES}; shorten it",
                    message.len()
                )));
            }
            let u = get_unit(tx, unit)?;
            if *application {
                if !leader_in(tx, &u.service, unit)? {
                    return Err(Error::Relation(format!(
                        "unit `{unit}` is not the leader of service `{}`: only the leader sets the application's status (`is-leader` tells)",
                        u.service
                    )));
                }
                tx.prepare_cached(
                    "UPDATE services SET workload_status = ?1, workload_message = ?2 WHERE name = ?3",
                )?
                .execute((status, message, &u.service))?;
            } else {
                tx.prepare_cached(
                    "UPDATE units SET workload_status = ?1, workload_message = ?2 WHERE name = ?3",
                )?
                .execute((status, message, unit))?;
            }
            Ok(())
        }
        AgentOp::SetWorkloadVersion { unit, version } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("set the workload version of unit `{unit}`'s service"),
                ));
            }
            if version.len() > MAX_WORKLOAD_VERSION_BYTES {
                return Err(Error::Relation(format!(
                    "a workload version of {} bytes is more than {MAX_WORKLOAD_VERSION_BYTES}; shorten it",
                    version.len()
                )));
            }
            let u = get_unit(tx, unit)?;
            tx.prepare_cached("UPDATE services SET workload_version = ?1 WHERE name = ?2")?
                .execute((version, &u.service))?;
            Ok(())
        }
        AgentOp::ClearResolved { unit } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("clear the resolved mark of unit `{unit}`"),
                ));
            }
            get_unit(tx, unit)?;
            let n = tx
                .prepare_cached(
                    "UPDATE units SET resolved = NULL WHERE name = ?1 AND resolved IS NOT NULL",
                )?
                .execute([unit])?;
            if n > 0 {
                tx.changed(ChangeKind::Unit, unit.clone())?;
            }
            Ok(())
        }
        AgentOp::SetMachineAgentStatus {
            machine,
            status,
            info,
        } => {
            check_status(status)?;
            check_status_info(info)?;
            if *by != Caller::Machine(*machine) {
                return Err(unauthorized(
                    by,
                    format!("set the agent status of machine `{machine}`"),
                ));
            }
            let m = get_machine(tx, *machine)?;
            if m.agent_status != *status || m.agent_status_info != *info {
                tx.prepare_cached(
                    "UPDATE machines SET agent_status = ?1, agent_status_info = ?2 WHERE id = ?3",
                )?
                .execute((status, info, machine))?;
                tx.changed(ChangeKind::Machine, machine.to_string())?;
            }
            Ok(())
        }
        AgentOp::EnterScope {
            relation,
            unit,
            settings,
        } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("enter the scope of relation `{relation}` for unit `{unit}`"),
                ));
            }
            Store::enter_scope_in(tx, *relation, unit)?;
            if settings.is_empty() {
                return Ok(());
            }
            let changes: Vec<(String, Option<String>)> = settings
                .iter()
                .map(|(k, v)| (k.clone(), Some(v.clone())))
                .collect();
            Store::update_relation_settings_in(tx, *relation, unit, &changes)
        }
        AgentOp::FinishRun { unit, id, result } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("answer run {id} of unit `{unit}`"),
                ));
            }
            crate::runs::finish_run_in(tx, unit, *id, result)
        }
        AgentOp::LeaveScope { relation, unit } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("leave the scope of relation `{relation}` for unit `{unit}`"),
                ));
            }
            Store::leave_scope_in(tx, *relation, unit)
        }
        AgentOp::UpdateRelationSettings {
            relation,
            unit,
            changes,
        } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(
                    by,
                    format!("change the settings of unit `{unit}` in relation `{relation}`"),
                ));
            }
            Store::update_relation_settings_in(tx, *relation, unit, changes)
        }
        AgentOp::UpdateBag { unit, bag, changes } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(by, format!("change {bag} as unit `{unit}`")));
            }
            crate::bags::update_bag_in(tx, unit, bag, changes)
        }
        AgentOp::EnsureDyingUnit { unit } => {
            if !is_unit(by, unit) {
                return Err(unauthorized(by, format!("destroy unit `{unit}`")));
            }
            let u = get_unit(tx, unit)?;
            if u.life != Life::Alive {
                return Ok(());
            }
            let svc = get_service(tx, &u.service)?;
            let abandoned = svc.life != Life::Alive
                || match &u.principal {
                    Some(p) => {
                        let principal_service = get_unit(tx, p)?.service;
                        !alive_container_relation(tx, &u.service, &principal_service)?
                    }
                    None => false,
                };
            if !abandoned {
                return Err(Error::UnitBusy {
                    unit: unit.clone(),
                    why: format!(
                        "is still wanted: its service `{}` is alive{}; destroy it with `jujube destroy-unit` or `jujube destroy-service`",
                        u.service,
                        if u.principal.is_some() { " and related to its principal's service" } else { "" }
                    ),
                });
            }
            // Its own agent asks, so an agent runs: the unit goes through
            // Dying and Dead like any started unit (removal at once is for
            // units no agent has taken up).
            if !u.agent_started {
                mark_agent_started(tx, unit)?;
            }
            destroy_unit_in(
                tx,
                &Unit {
                    agent_started: true,
                    ..u
                },
            )
        }
        AgentOp::EnsureDeadUnit { unit } => {
            let u = get_unit(tx, unit)?;
            if !is_unit(by, unit) && *by != deployer_of(&u) {
                return Err(unauthorized(by, format!("set unit `{unit}` dead")));
            }
            Store::ensure_dead_unit_in(tx, unit)
        }
        AgentOp::RemoveUnit { unit } => {
            let u = get_unit(tx, unit)?;
            if *by != deployer_of(&u) {
                return Err(unauthorized(by, format!("remove unit `{unit}`")));
            }
            Store::remove_dead_unit_in(tx, unit)
        }
        AgentOp::EnsureDeadMachine { machine } => {
            let m = get_machine(tx, *machine)?;
            let allowed = *by == Caller::Machine(*machine)
                || (*by == Caller::Controller && m.instance_id.is_none());
            if !allowed {
                return Err(unauthorized(by, format!("set machine `{machine}` dead")));
            }
            Store::ensure_dead_machine_in(tx, *machine)
        }
        AgentOp::RemoveMachine { machine } => {
            if *by != Caller::Controller {
                return Err(unauthorized(by, format!("remove machine `{machine}`")));
            }
            Store::remove_machine_in(tx, *machine)
        }
    }
}

/// A relation of a unit's service, and whether the unit is in its scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationContext {
    pub relation: Relation,
    pub in_scope: bool,
    /// Whether the unit belongs in the relation's scope: a subordinate
    /// joins a container-scoped relation only with its principal's service
    /// or with another subordinate service (whose units under the same
    /// principal share its container).
    pub belongs: bool,
}

/// Where a unit sits: what routing its changes needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitRoute {
    pub name: String,
    pub life: Life,
    pub machine: Option<i64>,
    pub principal: Option<String>,
}

/// Everything a unit agent decides on, read in one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitContext {
    pub unit: Unit,
    pub service: Service,
    /// The service of the unit's principal, for a subordinate.
    pub principal_service: Option<String>,
    /// The relations the unit's service is in, by id.
    pub relations: Vec<RelationContext>,
    /// The unit's subordinates, by service and number.
    pub subordinates: Vec<Unit>,
    /// `jujube run` requests waiting for the unit's agent, oldest first.
    pub runs: Vec<crate::runs::RunRequest>,
    /// The unit is its service's recorded leader.
    pub leader: bool,
    /// The machine it runs on (its principal's, for a subordinate), and
    /// that machine's availability zone.
    pub machine: Option<i64>,
    pub zone: Option<String>,
    /// The ports and ranges the unit opened (`80/tcp`, `100-200/udp`).
    pub ports: Vec<String>,
    /// The environment's `update-status-hook-interval`, when set.
    pub update_status_interval: Option<std::time::Duration>,
}

fn units_where(c: &Connection, clause: &str, arg: &dyn crate::sql::ToSql) -> Result<Vec<Unit>> {
    let mut stmt = c.prepare_cached(&format!(
        "SELECT {UNIT_COLS} FROM units WHERE {clause} ORDER BY service, number"
    ))?;
    let rows = stmt.query_map([arg], unit_row)?;
    rows.map(|r| finish_unit(r?)).collect()
}

/// Units marked per transaction by [`Store::resolve_all_units`]: a unit
/// and its change row each, 1,000 rows, the bound every bulk operation
/// keeps.
pub const RESOLVE_BATCH: usize = 500;

/// A unit's open port or range of ports: `80/tcp`, `100-200/udp`; or
/// `icmp` (Juju's ICMP "range", no ports: from and to are 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct PortRange {
    from: u16,
    to: u16,
    protocol: Protocol,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Protocol {
    Tcp,
    Udp,
    Icmp,
}

impl PortRange {
    /// `PORT/PROTO`, `FROM-TO/PROTO` or `icmp` (the hook tools send it so).
    fn parse(port: &str) -> Result<PortRange> {
        let bad = || {
            Error::Relation(format!(
                "invalid port `{port}`: expected PORT/PROTOCOL or FROM-TO/PROTOCOL with ports in 1-65535 and tcp or udp, e.g. `80/tcp` or `100-200/udp`, or `icmp`"
            ))
        };
        if port == "icmp" {
            return Ok(PortRange {
                from: 0,
                to: 0,
                protocol: Protocol::Icmp,
            });
        }
        let (ports, proto) = port.split_once('/').ok_or_else(bad)?;
        let protocol = match proto {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            _ => return Err(bad()),
        };
        let number = |n: &str| -> Result<u16> {
            if n.starts_with('0') {
                return Err(bad());
            }
            n.parse::<u16>().ok().filter(|n| *n > 0).ok_or_else(bad)
        };
        let (from, to) = match ports.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => (number(ports)?, number(ports)?),
        };
        if from > to {
            return Err(bad());
        }
        Ok(PortRange { from, to, protocol })
    }

    fn overlaps(&self, other: &PortRange) -> bool {
        self.protocol == other.protocol && self.from <= other.to && other.from <= self.to
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Icmp => return f.write_str("icmp"),
        };
        if self.from == self.to {
            write!(f, "{}/{proto}", self.from)
        } else {
            write!(f, "{}-{}/{proto}", self.from, self.to)
        }
    }
}

impl Store {
    /// `jujube resolved --all [--retry]`: marks every unit in error not
    /// marked yet, in transactions of at most [`RESOLVE_BATCH`] units (a unit
    /// resolved meanwhile is no error); returns the first
    /// [`crate::MAX_LISTED`] of their names and how many they were.
    pub fn resolve_all_units(&self, retry: bool) -> Result<(Vec<String>, u64)> {
        let mode = if retry { "retry-hooks" } else { "no-hooks" };
        let (mut out, mut count) = (Vec::new(), 0u64);
        let mut after = String::new();
        loop {
            let batch = self.write(|tx| {
                let names = tx
                    .prepare_cached(
                        "SELECT name FROM units WHERE status = ?1 AND resolved IS NULL AND name > ?2
                         ORDER BY name LIMIT ?3",
                    )?
                    .query_map(
                        (crate::model::agent_status::ERROR, &after, RESOLVE_BATCH as i64),
                        |r| r.get::<_, String>(0),
                    )?
                    .collect::<crate::sql::Result<Vec<String>>>()?;
                for name in &names {
                    tx.prepare_cached("UPDATE units SET resolved = ?1 WHERE name = ?2")?
                        .execute((mode, name))?;
                    tx.changed(ChangeKind::Unit, name.clone())?;
                }
                Ok(names)
            })?;
            let Some(last) = batch.last() else {
                return Ok((out, count));
            };
            after = last.clone();
            count += batch.len() as u64;
            let room = crate::MAX_LISTED.saturating_sub(out.len());
            out.extend(batch.into_iter().take(room));
        }
    }

    /// Units whose hook failed and that nobody resolved yet, with what
    /// failed (`hook failed: "install"`), at most `limit`.
    pub fn units_in_error(&self, limit: usize) -> Result<Vec<(String, String)>> {
        self.read(|c| {
            Ok(c.prepare_cached(
                "SELECT name, status_info FROM units WHERE status = ?1 AND resolved IS NULL
                     ORDER BY service, number LIMIT ?2",
            )?
            .query_map(
                (
                    crate::model::agent_status::ERROR,
                    i64::try_from(limit).unwrap_or(i64::MAX),
                ),
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?
            .collect::<crate::sql::Result<Vec<_>>>()?)
        })
    }

    /// `jujube resolved UNIT [--retry]`: marks a unit whose hook failed
    /// (agent status `error`) so that its agent goes on — re-running the
    /// hook with `retry`, counting it done without. Refused for a unit not
    /// in error.
    pub fn resolve_unit(&self, name: &str, retry: bool) -> Result<()> {
        jujube_core::names::parse_unit(name)?;
        self.write(|tx| {
            let u = get_unit(tx, name)?;
            if u.status != crate::model::agent_status::ERROR {
                return Err(Error::UnitNotInError(name.to_string()));
            }
            let mode = if retry { "retry-hooks" } else { "no-hooks" };
            tx.prepare_cached("UPDATE units SET resolved = ?1 WHERE name = ?2")?
                .execute((mode, name))?;
            tx.changed(ChangeKind::Unit, name)?;
            Ok(())
        })
    }

    /// Applies one agent-side write as `by`, in its own transaction.
    pub fn apply(&self, by: &Caller, op: &AgentOp) -> Result<()> {
        self.write(|tx| apply_in(tx, by, op))
    }

    /// Applies several agent-side writes in one transaction, each in its own
    /// savepoint: each is checked and applied (or refused, changing nothing)
    /// exactly as [`Store::apply`] would, in order, and all share one commit.
    /// The outer error is for the commit itself.
    pub fn apply_batch(&self, ops: &[(Caller, AgentOp)]) -> Result<Vec<Result<()>>> {
        self.write(|tx| {
            Ok(ops
                .iter()
                .map(|(by, op)| tx.savepoint(|tx| apply_in(tx, by, op)))
                .collect())
        })
    }

    /// [`Store::apply_batch`], each op with the stamp its agent sent it
    /// with, if any: a stamped op is applied only if it is its agent's
    /// next ([`Stamp`]), answered `Ok` without being applied again if it
    /// is the one applied last (a resend), and refused
    /// ([`Error::Superseded`]) otherwise.
    pub fn apply_stamped(
        &self,
        ops: &[(Caller, Option<Stamp>, AgentOp)],
    ) -> Result<Vec<Result<()>>> {
        self.write(|tx| {
            Ok(ops
                .iter()
                .map(|(by, stamp, op)| {
                    tx.savepoint(|tx| match stamp {
                        Some(stamp) if !stamp_in(tx, by, stamp)? => Ok(()),
                        _ => apply_in(tx, by, op),
                    })
                })
                .collect())
        })
    }

    /// A new incarnation for `agent`'s writes, which it takes as it starts
    /// (its sequence starts again at 0): every write stamped with an earlier
    /// one is refused from now on.
    pub fn start_agent(&self, agent: &Caller) -> Result<i64> {
        let Some((table, key, id)) = stamp_row(agent) else {
            return Err(Error::Unauthorized {
                caller: agent.to_string(),
                action: "take a write incarnation".into(),
            });
        };
        self.write(|tx| {
            tx.prepare_cached(&format!(
                "UPDATE {table} SET agent_incarnation = agent_incarnation + 1, agent_seq = 0
                 WHERE {key} = ?1 RETURNING agent_incarnation"
            ))?
            .query_row(crate::sql::params![*id], |r| r.get(0))
            .optional()?
            .ok_or_else(|| match agent {
                Caller::Machine(m) => Error::not_found(crate::Entity::Machine, m),
                Caller::Unit(u) => Error::not_found(crate::Entity::Unit, u),
                Caller::Controller => unreachable!("no stamp row"),
            })
        })
    }

    /// A unit's context for its agent, in one snapshot.
    pub fn unit_context(&self, name: &str) -> Result<UnitContext> {
        self.read(|c| {
            let unit = get_unit(c, name)?;
            let service = get_service(c, &unit.service)?;
            let (principal_service, machine) = match &unit.principal {
                Some(p) => {
                    let p = get_unit(c, p)?;
                    (Some(p.service), p.machine_id)
                }
                None => (None, unit.machine_id),
            };
            // The unit's open ports, its machine's zone and the
            // environment's update-status interval, in one read.
            let (ports, zone, update_status): (String, Option<String>, Option<String>) = c
                .prepare_cached(
                    "SELECT u.ports, m.zone,
                            (SELECT value FROM environment_config WHERE key = ?3)
                     FROM units u LEFT JOIN machines m ON m.id = ?2
                     WHERE u.name = ?1",
                )?
                .query_row(
                    (name, machine, crate::environment::UPDATE_STATUS_KEY),
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )?;
            let scopes = scope_ids(c, name)?;
            let relations = relations_of(c, &unit.service)?
                .into_iter()
                .map(|relation| {
                    let belongs = match (relation.scope, &principal_service) {
                        (Scope::Container, Some(ps)) => {
                            let counterpart = relation
                                .counterpart_of(&unit.service)
                                .map(|e| e.service.clone())
                                .unwrap_or_default();
                            counterpart == *ps || get_service(c, &counterpart)?.subordinate
                        }
                        _ => true,
                    };
                    Ok(RelationContext {
                        in_scope: scopes.contains(&relation.id),
                        belongs,
                        relation,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let subordinates = units_where(c, "principal = ?1", &name)?;
            let runs = crate::runs::pending_runs_in(c, name)?;
            Ok(UnitContext {
                update_status_interval: update_status
                    .and_then(|v| crate::environment::update_status_interval(&v)),
                leader: service.leader.as_deref() == Some(name),
                unit,
                service,
                principal_service,
                relations,
                subordinates,
                runs,
                machine,
                zone,
                ports: ports.split_whitespace().map(str::to_string).collect(),
            })
        })
    }

    /// A machine and the principal units assigned to it, in one snapshot.
    pub fn machine_context(&self, id: i64) -> Result<(Machine, Vec<Unit>)> {
        self.read(|c| {
            let m = get_machine(c, id)?;
            let units = units_where(c, "machine_id = ?1", &id)?;
            Ok((m, units))
        })
    }

    /// The ids of the relations whose scope a unit is in.
    pub fn unit_scopes(&self, unit: &str) -> Result<Vec<i64>> {
        self.read(|c| scope_ids(c, unit))
    }

    /// The units in a relation's scope that `unit` sees: in a
    /// container-scoped relation only those in its own container, and of
    /// those only its counterparts — the other service's units, or its peers
    /// in a peer relation — never itself. In unit order, at most
    /// [`MAX_SCOPE_MEMBERS`] from after the unit `after` (a name in the
    /// form `service/N`; it need not exist any more): an answer that full
    /// may have more after its last.
    pub fn scope_units_seen_by(
        &self,
        relation_id: i64,
        unit: &str,
        after: Option<&str>,
    ) -> Result<Vec<String>> {
        // The same page as its settings' (read, here, to be dropped: one
        // query for both, and only the API's `scope-units` asks this).
        let page = self.scope_settings_seen_by(relation_id, unit, after)?;
        Ok(page.units.into_iter().map(|(u, _)| u).collect())
    }

    /// The units `unit` sees in the relation's scope (as
    /// [`Store::scope_units_seen_by`], a page of at most
    /// [`MAX_SCOPE_MEMBERS`] after `after`) with their settings, in one
    /// snapshot: what an agent re-reads on a scope notice, in one read
    /// instead of one per member. Settings come in members' order until
    /// they would pass [`MAX_SCOPE_SETTINGS_BYTES`] in all; later members
    /// come without (`None`: read them one by one), so that an answer never
    /// holds more than that, however many members a scope has.
    pub fn scope_settings_seen_by(
        &self,
        relation_id: i64,
        unit: &str,
        after: Option<&str>,
    ) -> Result<ScopeSettings> {
        let (after_service, after_number) = scope_cursor(after)?;
        self.read(|c| {
            let (container, rel, service) = scope_of(c, relation_id, unit)?;
            let peer = rel.endpoints.len() == 1;
            // The page first (a bounded top-N sort on both engines), then
            // its settings and their running size.
            let rows = c
                .prepare_cached(
                    "SELECT unit, CASE WHEN running <= ?6 THEN coalesce(settings, '{}') END FROM (
                       SELECT p.unit, s.settings, p.service, p.number,
                              sum(coalesce(length(s.settings), 2))
                                OVER (ORDER BY p.service, p.number) AS running
                       FROM (SELECT x.unit, u.service, u.number
                             FROM relation_scopes x JOIN units u ON u.name = x.unit
                             WHERE x.relation_id = ?1 AND x.container = ?2 AND x.unit != ?3
                               AND ((?4 AND u.service = ?5) OR (NOT ?4 AND u.service != ?5))
                               AND (u.service, u.number) > (?7, ?8)
                             ORDER BY u.service, u.number LIMIT ?9) AS p
                       LEFT JOIN relation_settings s ON s.relation_id = ?1 AND s.unit = p.unit) AS t
                     ORDER BY service, number",
                )?
                .query_map(
                    (
                        relation_id,
                        &container,
                        unit,
                        peer,
                        &service,
                        MAX_SCOPE_SETTINGS_BYTES as i64,
                        &after_service,
                        after_number,
                        MAX_SCOPE_MEMBERS as i64,
                    ),
                    |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?)),
                )?
                .collect::<crate::sql::Result<Vec<_>>>()?;
            let units = rows
                .into_iter()
                .map(|(name, raw)| {
                    let settings = raw
                        .map(|raw| {
                            serde_json::from_str(&raw).map_err(|_| Error::Corrupt {
                                what: "relation settings",
                                value: raw,
                            })
                        })
                        .transpose()?;
                    Ok((name, settings))
                })
                .collect::<Result<_>>()?;
            Ok(ScopeSettings {
                units,
                app: crate::bags::counterpart_bag_in(c, &rel, &service)?,
            })
        })
    }

    /// Whether `reader` may read `unit`'s settings in the relation: its
    /// own; in a global relation those of any unit of the other service (of
    /// its own, in a peer relation) that ever entered the scope, also one
    /// that departed or was removed since: settings stay readable for the
    /// relation's lifetime (charms-in-action.txt); in a container-scoped
    /// relation only the units it sees now, in its own container.
    /// `rel` is the relation as the caller already read it.
    pub fn may_read_relation_settings(
        &self,
        rel: &crate::model::Relation,
        reader: &str,
        unit: &str,
    ) -> Result<bool> {
        if reader == unit {
            return Ok(true);
        }
        let relation_id = rel.id;
        if rel.scope == Scope::Container {
            // One of the units `reader` sees now (as `scope_units_seen_by`).
            return self.read(|c| {
                let (container, rel, service) = scope_of(c, relation_id, reader)?;
                let peer = rel.endpoints.len() == 1;
                Ok(c.prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM relation_scopes x JOIN units u ON u.name = x.unit
                     WHERE x.relation_id = ?1 AND x.container = ?2 AND x.unit != ?3
                       AND ((?4 AND u.service = ?5) OR (NOT ?4 AND u.service != ?5))
                       AND x.unit = ?6)",
                )?
                .query_row(
                    (relation_id, &container, reader, peer, &service, unit),
                    |r| r.get(0),
                )?)
            });
        }
        let service_of = |u: &str| u.split_once('/').map(|(s, _)| s.to_string());
        let (Some(mine), Some(theirs)) = (service_of(reader), service_of(unit)) else {
            return Ok(false);
        };
        let counterpart = if rel.endpoints.len() == 1 {
            theirs == mine
        } else {
            theirs != mine && rel.endpoints.iter().any(|e| e.service == theirs)
        };
        if !counterpart {
            return Ok(false);
        }
        self.read(|c| {
            Ok(c.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM relation_settings WHERE relation_id = ?1 AND unit = ?2)",
            )?
            .query_row((relation_id, unit), |r| r.get(0))?)
        })
    }

    /// Every unit's name, life, machine and principal, for routing change
    /// notifications without a read per change.
    pub fn unit_routes(&self) -> Result<Vec<UnitRoute>> {
        self.read(|c| {
            let mut stmt =
                c.prepare_cached("SELECT name, life, machine_id, principal FROM units")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get(2)?,
                    r.get(3)?,
                ))
            })?;
            rows.map(|r| {
                let (name, l, machine, principal) = r?;
                Ok(UnitRoute {
                    name,
                    life: crate::model::life(l)?,
                    machine,
                    principal,
                })
            })
            .collect()
        })
    }

    /// Several units by name, in one read snapshot: `None` for a name no
    /// unit has. One transaction for a whole batch of changes is what keeps
    /// the routing of 100,000 agents' changes cheap (one per unit cost a
    /// lock round and a snapshot each, contending with the agents' reads).
    pub fn units_named(&self, names: &[&str]) -> Result<Vec<Option<Unit>>> {
        self.read(|c| names.iter().map(|n| find_unit(c, n)).collect())
    }

    /// What the change router needs of each named unit — its life, machine,
    /// principal and pending resolution — in one read snapshot, reading no
    /// other column (it runs for every unit change: status writes too).
    pub fn unit_links(&self, names: &[&str]) -> Result<Vec<Option<UnitLinks>>> {
        use crate::sql::OptionalExtension;
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT life, machine_id, principal, resolved FROM units WHERE name = ?1",
            )?;
            names
                .iter()
                .map(|n| {
                    stmt.query_row([n], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })
                    .optional()?
                    .map(|(l, machine_id, principal, resolved)| {
                        Ok(UnitLinks {
                            life: crate::model::life(l)?,
                            machine_id,
                            principal,
                            resolved,
                        })
                    })
                    .transpose()
                })
                .collect()
        })
    }

    /// What the change router needs of each machine (see
    /// [`Store::unit_links`]): its life and whether it has an instance, in
    /// one read snapshot, two columns of each row (a whole machine costs
    /// its constraints parsed, for 100,000 removed units' machines).
    pub fn machine_links(&self, ids: &[i64]) -> Result<Vec<Option<(Life, bool)>>> {
        use crate::sql::OptionalExtension;
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT life, instance_id IS NOT NULL FROM machines WHERE id = ?1",
            )?;
            ids.iter()
                .map(|id| {
                    stmt.query_row([id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, bool>(1)?)))
                        .optional()?
                        .map(|(l, has)| Ok((crate::model::life(l)?, has)))
                        .transpose()
                })
                .collect()
        })
    }

    /// Several machines by id, in one read snapshot (see
    /// [`Store::units_named`]).
    pub fn machines_with_ids(&self, ids: &[i64]) -> Result<Vec<Option<Machine>>> {
        self.read(|c| ids.iter().map(|&id| find_machine(c, id)).collect())
    }

    /// A service's settings as stored (JSON values by key; defaults are not
    /// stored), cheap enough to compare on every change.
    pub fn service_settings_raw(&self, name: &str) -> Result<Vec<(String, String)>> {
        self.read(|c| {
            let rows = c
                .prepare_cached(
                    "SELECT key, value FROM service_settings WHERE service = ?1 ORDER BY key",
                )?
                .query_map([name], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<crate::sql::Result<Vec<(String, String)>>>()?;
            Ok(rows)
        })
    }
}

/// A unit as the change router sees it: see [`Store::unit_links`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLinks {
    pub life: Life,
    pub machine_id: Option<i64>,
    pub principal: Option<String>,
    pub resolved: Option<String>,
}

fn scope_ids(c: &Connection, unit: &str) -> Result<Vec<i64>> {
    let ids = c
        .prepare_cached("SELECT relation_id FROM relation_scopes WHERE unit = ?1 ORDER BY 1")?
        .query_map([unit], |r| r.get(0))?
        .collect::<crate::sql::Result<Vec<i64>>>()?;
    Ok(ids)
}

impl Store {
    /// Called by a host of in-process agents (the controller's, which runs
    /// every agent of its environment) as it starts, before any of its
    /// agents runs: every unit's status is from then on taken as reported
    /// by an agent that no longer runs (`units.status_current` false) until
    /// the unit's agent reports again. A unit whose agent died with the
    /// previous host (a controller killed) keeps what that agent said last
    /// — `started`, though a hook was cut off that its next agent finds
    /// failed — and [`Store::awaiting_agents`] waits for its agent's report
    /// rather than trusting that. One statement, fenced like the host's other writes,
    /// with no feed entry: only that wait reads the flag. Returns how many
    /// units it marked.
    pub fn agents_restarting(&self) -> Result<u64> {
        self.write(|tx| {
            let n = tx
                .prepare_cached("UPDATE units SET status_current = FALSE WHERE status_current")?
                .execute([])?;
            Ok(n as u64)
        })
    }

    /// What agents still have to do, in words, at most `limit` items per
    /// kind (for `jujube wait`): units whose agent has not started though
    /// their machine (or principal's agent) is up; units, relations and
    /// services being destroyed; Alive relations a started unit has not
    /// joined yet; first of all, agents that are `down` (not seen by the
    /// API server for [`PRESENCE_LAPSE`](crate::credentials::PRESENCE_LAPSE)
    /// seconds), which nothing else can move. Agents in error are not
    /// waited for: nothing moves them until someone acts.
    pub fn awaiting_agents(&self, limit: usize) -> Result<Vec<String>> {
        let now = crate::unix_now();
        self.read(|c| {
            let lapsed = now - crate::credentials::presence_lapse(c)?;
            let mut out = Vec::new();
            let lim = limit as i64;
            let mut down = c.prepare_cached(
                "SELECT coalesce('unit `' || u.name || '`', 'machine `' || m.id || '`'), a.seen_at
                 FROM agent_credentials a
                 LEFT JOIN units u ON u.name = a.unit AND u.life != 2 AND u.status != 'pending'
                 LEFT JOIN machines m ON m.id = a.machine_id AND m.life != 2 AND m.agent_status != 'pending'
                 WHERE a.seen_at < ?1 AND (u.name IS NOT NULL OR m.id IS NOT NULL)
                 ORDER BY a.tag LIMIT ?2",
            )?;
            let rows = down.query_map((lapsed, lim), |r| {
                Ok(format!(
                    "the agent of {} is down (not seen since {} UTC): is its `jujube agent` process running and reaching the controller?",
                    r.get::<_, String>(0)?,
                    jujube_core::time::format_utc(r.get::<_, i64>(1)?.max(0) as u64)
                ))
            })?;
            for r in rows {
                out.push(r?);
            }
            let mut each = |sql: &str, f: &dyn Fn(&crate::sql::Row<'_>) -> crate::sql::Result<String>| -> Result<()> {
                let mut stmt = c.prepare_cached(sql)?;
                let rows = stmt.query_map([lim], |r| f(r))?;
                for r in rows {
                    out.push(r?);
                }
                Ok(())
            };
            each(
                "SELECT u.name FROM units u JOIN machines m ON m.id = u.machine_id
                 WHERE u.life = 0 AND NOT u.agent_started AND u.status NOT IN ('error', 'failed')
                   AND m.instance_id IS NOT NULL AND m.agent_status NOT IN ('error', 'failed')
                 ORDER BY u.service, u.number LIMIT ?1",
                &|r| Ok(format!("unit `{}` waits for its agent to start", r.get::<_, String>(0)?)),
            )?;
            each(
                "SELECT s.name FROM units s JOIN units p ON p.name = s.principal
                 WHERE s.life = 0 AND NOT s.agent_started AND s.status NOT IN ('error', 'failed')
                   AND p.agent_started AND p.status NOT IN ('error', 'failed')
                 ORDER BY s.service, s.number LIMIT ?1",
                &|r| Ok(format!("unit `{}` waits for its agent to start", r.get::<_, String>(0)?)),
            )?;
            // Started under a host of in-process agents that has stopped (see
            // `agents_restarting`): what it last said may be stale. Not
            // where the machine's agent is held by an error, which runs
            // none of its units' agents until someone acts.
            each(
                "SELECT u.name FROM units u
                 JOIN machines m ON m.id = coalesce(u.machine_id,
                     (SELECT p.machine_id FROM units p WHERE p.name = u.principal))
                 WHERE NOT u.status_current AND u.life = 0 AND u.agent_started
                   AND u.status NOT IN ('error', 'failed') AND m.agent_status != 'error'
                 ORDER BY u.service, u.number LIMIT ?1",
                &|r| Ok(format!(
                    "unit `{}` waits for its agent to start again and report (what it reported last came from agents that have stopped)",
                    r.get::<_, String>(0)?
                )),
            )?;
            each(
                "SELECT u.name, u.life FROM units u
                 JOIN machines m ON m.id = coalesce(u.machine_id,
                     (SELECT p.machine_id FROM units p WHERE p.name = u.principal))
                 WHERE u.life != 0 AND u.status != 'error' AND (u.status != 'failed' OR u.life = 2)
                   AND m.instance_id IS NOT NULL
                 ORDER BY u.service, u.number LIMIT ?1",
                &|r| {
                    let life = crate::model::life(r.get(1)?).unwrap_or(Life::Dying);
                    Ok(format!("unit `{}` is {life} and waits for its agents", r.get::<_, String>(0)?))
                },
            )?;
            // Failed passes, which their agents retry by themselves: what
            // failed, so that a wait says why it goes on.
            each(
                "SELECT 'unit `' || name || '`', status_info FROM units
                 WHERE status = 'failed' AND life != 2
                 UNION ALL
                 SELECT 'machine ' || id, agent_status_info FROM machines
                 WHERE agent_status = 'failed' AND life != 2
                 ORDER BY 1 LIMIT ?1",
                &|r| Ok(format!(
                    "the agent of {} failed and tries again: {}",
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?
                )),
            )?;
            each(
                "SELECT u.name, r.key FROM units u
                 JOIN relation_endpoints e ON e.service = u.service
                 JOIN relations r ON r.id = e.relation_id AND r.life = 0
                 WHERE u.life = 0 AND u.agent_started AND u.status NOT IN ('error', 'failed')
                   AND NOT EXISTS (SELECT 1 FROM relation_scopes x WHERE x.relation_id = r.id AND x.unit = u.name)
                   AND (r.scope = 'global' OR u.principal IS NULL OR EXISTS (
                        SELECT 1 FROM relation_endpoints o JOIN units p ON p.name = u.principal
                        WHERE o.relation_id = r.id AND o.service = p.service))
                 ORDER BY u.service, u.number LIMIT ?1",
                &|r| Ok(format!(
                    "unit `{}` has not joined relation `{}` yet",
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?
                )),
            )?;
            let dying: Vec<(i64, String)> = c
                .prepare_cached("SELECT id, key FROM relations WHERE life != 0 ORDER BY id LIMIT ?1")?
                .query_map([lim], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<crate::sql::Result<_>>()?;
            for (id, key) in dying {
                out.push(format!("relation `{key}` is dying and {}", relation_blockers(c, id)?));
            }
            let dying: Vec<String> = c
                .prepare_cached("SELECT name FROM services WHERE life != 0 ORDER BY name LIMIT ?1")?
                .query_map([lim], |r| r.get(0))?
                .collect::<crate::sql::Result<_>>()?;
            for name in dying {
                out.push(format!("service `{name}` is dying and {}", service_blockers(c, &name)?));
            }
            Ok(out)
        })
    }
}

/// What decides which units `unit` sees in a relation's scope: the
/// container it is in (empty for a global relation), whether the relation
/// is a peer relation, and the unit's service.
/// Where a page of a scope starts: after `after`'s service and number; for
/// none, before every unit (every service's name is longer than `""`).
fn scope_cursor(after: Option<&str>) -> Result<(String, i64)> {
    let Some(after) = after else {
        return Ok((String::new(), -1));
    };
    after
        .rsplit_once('/')
        .and_then(|(service, n)| Some((service.to_string(), n.parse::<i64>().ok()?)))
        .filter(|(service, n)| !service.is_empty() && *n >= 0)
        .ok_or_else(|| Error::BadScopeCursor(after.to_string()))
}

fn scope_of(
    c: &crate::sql::Connection,
    relation_id: i64,
    unit: &str,
) -> Result<(String, Relation, String)> {
    let rel = crate::model::get_relation(c, relation_id)?;
    let u = get_unit(c, unit)?;
    let container = match rel.scope {
        Scope::Global => String::new(),
        Scope::Container => u.principal.clone().unwrap_or_else(|| u.name.clone()),
    };
    Ok((container, rel, u.service))
}

/// How many units a blocker's description names.
const NAMED: i64 = 3;

/// Up to [`NAMED`] of `sql`'s names (one `?1` parameter), quoted, with how
/// many more there are out of `total`.
fn some_names(
    c: &crate::sql::Connection,
    sql: &str,
    key: &dyn crate::sql::ToSql,
    total: i64,
) -> Result<String> {
    let names: Vec<String> = c
        .prepare_cached(sql)?
        .query_map(crate::sql::params![key, NAMED], |r| r.get::<_, String>(0))?
        .collect::<crate::sql::Result<_>>()?;
    let mut s = names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let more = total - names.len() as i64;
    if more > 0 {
        s.push_str(&format!(" and {more} more"));
    }
    Ok(s)
}

/// What a failed hook holds among `sql`'s units (one `?1` parameter), in
/// words with the command that frees it, or nothing.
fn held(c: &crate::sql::Connection, sql: &str, key: &dyn crate::sql::ToSql) -> Result<String> {
    use crate::sql::OptionalExtension;
    let unit: Option<String> = c
        .prepare_cached(sql)?
        .query_row([key], |r| r.get(0))
        .optional()?;
    Ok(unit.map_or_else(String::new, |u| {
        format!("; unit `{u}` is held by a failed hook (`jujube resolved {u}`)")
    }))
}

/// What a Dying relation waits for, naming the units still in its scope
/// and one a failed hook holds.
pub(crate) fn relation_blockers(c: &crate::sql::Connection, id: i64) -> Result<String> {
    let total: i64 = c
        .prepare_cached("SELECT count(*) FROM relation_scopes WHERE relation_id = ?1")?
        .query_row([id], |r| r.get(0))?;
    if total == 0 {
        return Ok("waits for its cleanup".into());
    }
    let names = some_names(
        c,
        "SELECT unit FROM relation_scopes WHERE relation_id = ?1 ORDER BY unit LIMIT ?2",
        &id,
        total,
    )?;
    let held = held(
        c,
        "SELECT x.unit FROM relation_scopes x JOIN units u ON u.name = x.unit
         WHERE x.relation_id = ?1 AND u.status = 'error' ORDER BY x.unit LIMIT 1",
        &id,
    )?;
    Ok(format!("waits for {names} to leave it{held}"))
}

/// What a Dying service waits for: its units (named) and relations.
pub(crate) fn service_blockers(c: &crate::sql::Connection, name: &str) -> Result<String> {
    let (units, relations): (i64, i64) = c
        .prepare_cached(
            "SELECT unit_count, (SELECT count(*) FROM relation_endpoints WHERE service = ?1)
             FROM services WHERE name = ?1",
        )?
        .query_row([name], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let mut waits = Vec::new();
    if units > 0 {
        waits.push(format!(
            "unit(s) {}",
            some_names(
                c,
                "SELECT name FROM units WHERE service = ?1 ORDER BY number LIMIT ?2",
                &name,
                units,
            )?
        ));
    }
    if relations > 0 {
        waits.push(format!("{relations} relation(s)"));
    }
    if waits.is_empty() {
        return Ok("waits for its cleanup".into());
    }
    let held = held(
        c,
        "SELECT name FROM units WHERE service = ?1 AND status = 'error' ORDER BY number LIMIT 1",
        &name,
    )?;
    Ok(format!("waits for {} to go{held}", waits.join(" and ")))
}

/// The workload statuses a charm may set (`status-set`).
pub const WORKLOAD_STATUSES: [&str; 4] = ["maintenance", "blocked", "waiting", "active"];
/// The longest workload status message.
pub const MAX_WORKLOAD_MESSAGE_BYTES: usize = 2048;
/// A scope's members with their settings (`None`: beyond the answer's
/// bound, read it on its own), and the remote application's settings in
/// the relation (its own application's in a peer relation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScopeSettings {
    pub units: Vec<(String, Option<BTreeMap<String, String>>)>,
    /// The remote application's name and settings.
    pub app: Option<(String, BTreeMap<String, String>)>,
}

/// The most settings text one [`Store::scope_settings_seen_by`] answer
/// carries (a scope's members beyond it are named without settings): the
/// wire contract's bound.
pub const MAX_SCOPE_SETTINGS_BYTES: usize = jujube_wire::facade::MAX_SCOPE_SETTINGS_BYTES;
/// The most port ranges a unit may have open (`open-port`): they travel in
/// every view of the unit and in `status`, so one more is refused at the
/// write; a range (`1000-2000/tcp`) opens many ports as one.
pub const MAX_OPEN_PORT_RANGES: usize = 256;
/// The most members one answer of [`Store::scope_units_seen_by`] or
/// [`Store::scope_settings_seen_by`] lists (the wire contract's bound): a
/// scope of more is read in pages.
pub const MAX_SCOPE_MEMBERS: usize = jujube_wire::facade::MAX_SCOPE_MEMBERS;
/// What `status-get --application` answers (see
/// [`Store::application_status`]): the service's workload status and
/// message, and each unit's name, status and message, in unit order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplicationStatus {
    pub status: String,
    pub message: String,
    pub units: Vec<(String, String, String)>,
}

/// The most units one [`Store::application_status`] answer lists.
pub const MAX_APPLICATION_STATUS_UNITS: usize = MAX_GOAL_UNITS;
/// The most bytes of unit names, statuses and messages it carries.
pub const MAX_APPLICATION_STATUS_BYTES: usize = 1 << 20;

/// What `goal-state` answers (see [`Store::goal_state`]): unit → status,
/// and per relation endpoint, application or unit → status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GoalState {
    pub units: BTreeMap<String, String>,
    pub relations: BTreeMap<String, BTreeMap<String, String>>,
}

/// The most units `goal-state` lists, all services together.
pub const MAX_GOAL_UNITS: usize = 10_000;
/// The longest workload version.
pub const MAX_WORKLOAD_VERSION_BYTES: usize = 256;

/// Whether `unit` is the recorded leader of `service` now: recorded, and
/// Alive with its agent present (see [`Store::claim_leadership`]).
pub(crate) fn leader_in(c: &crate::sql::Connection, service: &str, unit: &str) -> Result<bool> {
    Ok(current_leader(c, service, presence_since(c)?)?.as_deref() == Some(unit))
}

/// Since when an agent must have been seen to be present (unix seconds).
fn presence_since(c: &crate::sql::Connection) -> Result<i64> {
    Ok(crate::unix_now() - crate::credentials::presence_lapse(c)?)
}

/// An agent counts as present: over the API, seen since `?2`; in the
/// controller (no credential), while the controller runs.
const PRESENT: &str = "(a.seen_at IS NULL OR a.seen_at >= ?2)";

/// The service's leader, if it still holds: Alive, and its agent present
/// (seen since `since`).
fn current_leader(c: &crate::sql::Connection, service: &str, since: i64) -> Result<Option<String>> {
    use crate::sql::OptionalExtension;
    Ok(c.prepare_cached(&format!(
        "SELECT u.name FROM services s JOIN units u ON u.name = s.leader
         LEFT JOIN agent_credentials a ON a.unit = u.name
         WHERE s.name = ?1 AND u.life = 0 AND {PRESENT}"
    ))?
    .query_row((service, since), |r| r.get(0))
    .optional()?)
}

/// The unit to elect in `service`: its lowest-numbered Alive unit whose
/// agent started and is present.
fn candidate(c: &crate::sql::Connection, service: &str, since: i64) -> Result<Option<String>> {
    use crate::sql::OptionalExtension;
    Ok(c.prepare_cached(&format!(
        "SELECT u.name FROM units u LEFT JOIN agent_credentials a ON a.unit = u.name
         WHERE u.service = ?1 AND u.life = 0 AND u.agent_started AND {PRESENT}
         ORDER BY u.number LIMIT 1"
    ))?
    .query_row((service, since), |r| r.get(0))
    .optional()?)
}

impl Store {
    /// `is-leader`: whether `unit` leads its service. A service whose
    /// leader no longer holds (gone, dying, or its agent down) gets the
    /// asking unit as its leader if it is Alive, in one transaction:
    /// exactly one leader per service at a time, and leadership moves only
    /// when the leader is lost. One row per service: the cost grows with
    /// services, not units. While the leader holds (nearly every call) it
    /// is a read.
    pub fn claim_leadership(&self, unit: &str) -> Result<bool> {
        let held = self.read(|c| {
            let u = get_unit(c, unit)?;
            current_leader(c, &u.service, presence_since(c)?)
        })?;
        if let Some(leader) = held {
            return Ok(leader == unit);
        }
        self.write(|tx| {
            let u = get_unit(tx, unit)?;
            if let Some(leader) = current_leader(tx, &u.service, presence_since(tx)?)? {
                return Ok(leader == unit);
            }
            if u.life != Life::Alive {
                return Ok(false);
            }
            take_leadership(tx, &u.service, unit)?;
            Ok(true)
        })
    }

    /// Elects a leader for every Alive service whose leader was lost (gone,
    /// dying, its agent down) and that has a unit whose agent started and
    /// is present: its lowest-numbered one, whose agent is woken to run
    /// `leader-elected`. At most `limit` services a call, in one
    /// transaction, taken only when a read found some to elect (most calls
    /// find none). Returns how many were elected.
    pub fn elect_leaders(&self, limit: usize) -> Result<usize> {
        let lost: Vec<String> = self.read(|c| {
            let since = presence_since(c)?;
            Ok(c.prepare_cached(&format!(
                "SELECT s.name FROM services s
                 WHERE s.life = 0 AND s.unit_count > 0
                   AND NOT EXISTS (SELECT 1 FROM units u LEFT JOIN agent_credentials a ON a.unit = u.name
                                   WHERE u.name = s.leader AND u.life = 0 AND {PRESENT})
                   AND EXISTS (SELECT 1 FROM units u LEFT JOIN agent_credentials a ON a.unit = u.name
                               WHERE u.service = s.name AND u.life = 0 AND u.agent_started AND {PRESENT})
                 ORDER BY s.name LIMIT ?1"
            ))?
            .query_map((limit as i64, since), |r| r.get(0))?
            .collect::<crate::sql::Result<_>>()?)
        })?;
        if lost.is_empty() {
            return Ok(0);
        }
        self.write(|tx| {
            let since = presence_since(tx)?;
            let mut elected = 0;
            for svc in &lost {
                // Checked again in the write: another may have elected.
                if current_leader(tx, svc, since)?.is_some() {
                    continue;
                }
                if let Some(unit) = candidate(tx, svc, since)? {
                    take_leadership(tx, svc, &unit)?;
                    elected += 1;
                }
            }
            Ok(elected)
        })
    }

    /// `goal-state`: what `unit`'s service and its relations are meant to
    /// hold: its service's units, and per relation endpoint the related
    /// applications and their units, each `active` (Alive) or `dying`
    /// (Juju's `joined` for a related application). Refused when the
    /// services it names have more than [`MAX_GOAL_UNITS`] units in all: the
    /// answer is one message.
    pub fn goal_state(&self, unit: &str) -> Result<GoalState> {
        self.read(|c| {
            let u = get_unit(c, unit)?;
            let status = |life: Life| {
                if life == Life::Alive {
                    "active"
                } else {
                    "dying"
                }
            };
            let units_of = |service: &str| -> Result<BTreeMap<String, String>> {
                let rows: Vec<(String, i64)> = c
                    .prepare_cached(
                        "SELECT name, life FROM units WHERE service = ?1 ORDER BY number LIMIT ?2",
                    )?
                    .query_map((service, MAX_GOAL_UNITS as i64 + 1), |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })?
                    .collect::<crate::sql::Result<_>>()?;
                if rows.len() > MAX_GOAL_UNITS {
                    return Err(Error::Relation(format!(
                        "goal-state answers for services of at most {MAX_GOAL_UNITS} units; `{service}` has more"
                    )));
                }
                rows.into_iter()
                    .map(|(n, l)| Ok((n, status(crate::model::life(l)?).to_string())))
                    .collect()
            };
            // Each service's units read once, however many relations name
            // it; the whole answer bounded as one service's is.
            let mut seen: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
            let mut total = 0;
            let mut units_once = |service: &str| -> Result<BTreeMap<String, String>> {
                if let Some(units) = seen.get(service) {
                    return Ok(units.clone());
                }
                let units = units_of(service)?;
                total += units.len();
                if total > MAX_GOAL_UNITS {
                    return Err(Error::Relation(format!(
                        "goal-state answers for at most {MAX_GOAL_UNITS} units in all; `{}`'s service and its relations have more",
                        u.name
                    )));
                }
                seen.insert(service.to_string(), units.clone());
                Ok(units)
            };
            let mut goal = GoalState {
                units: units_once(&u.service)?,
                relations: BTreeMap::new(),
            };
            for rel in relations_of(c, &u.service)? {
                let Some(mine) = rel.endpoint_of(&u.service) else {
                    continue;
                };
                let Some(other) = rel.counterpart_of(&u.service) else {
                    continue;
                };
                let entry = goal.relations.entry(mine.relation.clone()).or_default();
                let joined = if rel.life == Life::Alive { "joined" } else { "dying" };
                entry.insert(other.service.clone(), joined.to_string());
                for (name, st) in units_once(&other.service)? {
                    if name != unit {
                        entry.insert(name, st);
                    }
                }
            }
            Ok(goal)
        })
    }

    /// `status-get`: the workload status and message of `unit`, or of its
    /// service (`application`).
    pub fn workload_status(&self, unit: &str, application: bool) -> Result<(String, String)> {
        self.read(|c| {
            let u = get_unit(c, unit)?;
            Ok(if application {
                service_workload(c, &u.service)?
            } else {
                c.prepare_cached(
                    "SELECT workload_status, workload_message FROM units WHERE name = ?1",
                )?
                .query_row([unit], |r| Ok((r.get(0)?, r.get(1)?)))?
            })
        })
    }
    /// `status-get --application`: the service's workload status and
    /// message and each of its units' (in unit order), as Juju answers the
    /// service's leader and only it. Refused when the service has more than
    /// [`MAX_APPLICATION_STATUS_UNITS`] units or their names and messages
    /// are more than [`MAX_APPLICATION_STATUS_BYTES`]: the answer is one
    /// message (rows are read one at a time and the read stops there).
    pub fn application_status(&self, unit: &str) -> Result<ApplicationStatus> {
        self.read(|c| {
            let u = get_unit(c, unit)?;
            if !leader_in(c, &u.service, unit)? {
                return Err(Error::Relation(format!(
                    "finding application status: this unit is not the leader: only the leader of service `{}` reads its status and its units' (`is-leader` tells)",
                    u.service
                )));
            }
            let (status, message) = service_workload(c, &u.service)?;
            let mut stmt = c.prepare_cached(
                "SELECT name, workload_status, workload_message FROM units
                 WHERE service = ?1 ORDER BY number LIMIT ?2",
            )?;
            let mut rows = stmt.query((&u.service, MAX_APPLICATION_STATUS_UNITS as i64 + 1))?;
            let (mut units, mut bytes) = (Vec::new(), 0);
            while let Some(r) = rows.next()? {
                let (name, status, message): (String, String, String) =
                    (r.get(0)?, r.get(1)?, r.get(2)?);
                bytes += name.len() + status.len() + message.len();
                if units.len() == MAX_APPLICATION_STATUS_UNITS || bytes > MAX_APPLICATION_STATUS_BYTES {
                    return Err(Error::Relation(format!(
                        "finding application status: service `{}` has more units than one answer lists (at most {MAX_APPLICATION_STATUS_UNITS} units and {MAX_APPLICATION_STATUS_BYTES} bytes of names and messages); `jujube status {}` shows them all",
                        u.service, u.service
                    )));
                }
                units.push((name, status, message));
            }
            Ok(ApplicationStatus {
                status,
                message,
                units,
            })
        })
    }
}

/// The workload status and message of `service` (its application status).
fn service_workload(c: &crate::sql::Connection, service: &str) -> Result<(String, String)> {
    Ok(
        c.prepare_cached("SELECT workload_status, workload_message FROM services WHERE name = ?1")?
            .query_row([service], |r| Ok((r.get(0)?, r.get(1)?)))?,
    )
}

/// Makes `unit` the leader of `service`, telling it and the unit that lost
/// it (their agents run or forget `leader-elected`).
fn take_leadership(tx: &mut Tx<'_>, service: &str, unit: &str) -> Result<()> {
    use crate::sql::OptionalExtension;
    let old: Option<String> = tx
        .prepare_cached("SELECT leader FROM services WHERE name = ?1")?
        .query_row([service], |r| r.get(0))
        .optional()?
        .flatten();
    tx.prepare_cached("UPDATE services SET leader = ?1 WHERE name = ?2")?
        .execute((unit, service))?;
    tx.changed(ChangeKind::Leader, unit)?;
    if let Some(old) = old.filter(|o| o != unit) {
        tx.changed(ChangeKind::Leader, old)?;
    }
    Ok(())
}
