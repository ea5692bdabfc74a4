//! Units: creation (with machine placement and constraint capture), and the
//! destroy → Dead → remove lifecycle, including the removal of a Dying
//! service by the removal of its last unit.

use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::machines::{insert_machine, insert_machines_from};
use crate::model::{
    constraints, finish_unit, get_machine, get_service, get_unit, quote_list, unit_row, Service,
    Unit, JOB_HOST_UNITS, UNIT_COLS,
};
use crate::sql::Connection;
use crate::{require_alive, Entity, Error, Result};
use jujube_core::{names, Constraints, Life};

/// The most principal units one machine hosts (`--to` places them there):
/// its agent's view lists them, and `destroy-machine` names them.
pub const MAX_UNITS_PER_MACHINE: usize = 256;

/// Checks that `adding` principals of `svc` may be placed on machine `id`.
pub(crate) fn check_placement(c: &Connection, svc: &Service, id: i64, adding: usize) -> Result<()> {
    let m = get_machine(c, id)?;
    require_alive(Entity::Machine, id.to_string(), m.life, "host new units")?;
    let hosted: i64 = c
        .prepare_cached("SELECT count(*) FROM units WHERE machine_id = ?1")?
        .query_row([id], |r| r.get(0))?;
    if hosted as usize + adding > MAX_UNITS_PER_MACHINE {
        return Err(Error::MachineFull {
            machine: id,
            hosted: hosted as usize,
            max: MAX_UNITS_PER_MACHINE,
        });
    }
    if !m.hosts_units() {
        return Err(Error::CannotHostUnits {
            machine: id,
            jobs: m.jobs.join(", "),
        });
    }
    if m.series != svc.series {
        return Err(Error::SeriesMismatch {
            service: svc.name.clone(),
            series: svc.series.clone(),
            machine: id,
            machine_series: m.series,
        });
    }
    Ok(())
}

/// [`next_unit_number`]'s expression (the service's name is `?1`), for a
/// statement that reads it with more. The service's last unit is read as
/// the first of its units in descending order, not as their `max`:
/// PostgreSQL planned `max(number) ... WHERE service = $1` as a scan of
/// every unit of the service whenever its statistics were older than the
/// table (the plan is kept with the prepared statement), and each add-unit
/// took longer than the last.
macro_rules! next_unit_number_sql {
    () => {
        "(SELECT coalesce(max(n), 0) FROM (
           SELECT n FROM (SELECT number + 1 AS n FROM units WHERE service = ?1
                          ORDER BY number DESC LIMIT 1) AS last
           UNION ALL SELECT next FROM sequences WHERE name = 'unit:' || ?1) AS t)"
    };
}
#[cfg(test)] // the tests read its plan
pub(crate) use next_unit_number_sql;

/// The next unit number of the service named `service`: one above the
/// largest in use or ever removed under that name (kept by the
/// `units_high_water` trigger), 0 for the first.
fn next_unit_number(c: &Connection, service: &str) -> Result<i64> {
    Ok(
        c.prepare_cached(concat!("SELECT ", next_unit_number_sql!()))?
            .query_row([service], |r| r.get(0))?,
    )
}

/// Inserts a principal unit of `svc`, capturing the environment and service
/// constraints collapsed as they are now, on machine `to` or on a new machine
/// that copies the unit's constraints. The caller bumps the service's unit
/// count (once per batch) and checks placement beforehand.
pub(crate) fn insert_principal(
    tx: &mut Tx<'_>,
    svc: &Service,
    env_cons: &Constraints,
    to: Option<i64>,
) -> Result<String> {
    let number = next_unit_number(tx, &svc.name)?;
    let name = format!("{}/{}", svc.name, number);
    let cons = svc.constraints.with_fallbacks(env_cons);
    let machine = match to {
        Some(id) => id,
        None => insert_machine(tx, &svc.series, &[JOB_HOST_UNITS], &cons)?,
    };
    tx.prepare_cached(
        "INSERT INTO units (name, service, number, series, machine_id, constraints)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute((
        &name,
        &svc.name,
        number,
        &svc.series,
        machine,
        cons.to_string(),
    ))?;
    tx.changed(ChangeKind::Unit, &name)?;
    if to.is_some() {
        tx.changed(ChangeKind::Machine, machine.to_string())?;
    }
    Ok(name)
}

/// What new principal units and their machines start from, read with
/// the service's row as its unit count is raised (see [`NEXT_SQL`]).
pub(crate) struct Next {
    /// The environment's constraints (`None`: not initialised).
    pub env_constraints: Option<String>,
    /// The first unit number and machine id free.
    pub unit: i64,
    pub machine: i64,
}

/// [`Next`]'s columns (the service's name is `?1`), for the statement
/// that reads the service: one round trip on PostgreSQL, where an
/// add-unit is two in all, its `COMMIT`'s included.
pub(crate) const NEXT_SQL: &str = concat!(
    "(SELECT constraints FROM environment WHERE id = 1), ",
    next_unit_number_sql!(),
    ", ",
    crate::machines::next_machine_id_sql!()
);

impl Next {
    /// From the row's columns `at`, `at + 1` and `at + 2`.
    pub(crate) fn from_row(r: &crate::sql::Row<'_>, at: usize) -> crate::sql::Result<Next> {
        Ok(Next {
            env_constraints: r.get(at)?,
            unit: r.get(at + 1)?,
            machine: r.get(at + 2)?,
        })
    }
}

/// Inserts `n` principal units of `svc` from `next`, each on a new machine
/// that copies its constraints (the environment and service constraints
/// collapsed as they are now), as [`insert_principal`] does one at a time,
/// in multi-row statements: a statement per row was a round trip per row
/// on PostgreSQL. The caller bumps the service's unit count.
pub(crate) fn insert_principals(
    tx: &mut Tx<'_>,
    svc: &Service,
    n: std::num::NonZeroUsize,
    next: Next,
) -> Result<Vec<String>> {
    let (first, first_machine) = (next.unit, next.machine);
    let env_cons = next
        .env_constraints
        .ok_or_else(|| Error::not_found(Entity::Environment, "(uninitialised)"))?;
    // In its canonical text once, for the machines and the units alike.
    let cons = svc
        .constraints
        .with_fallbacks(&constraints(env_cons)?)
        .to_string();
    let machines =
        insert_machines_from(tx, first_machine, n, &svc.series, &[JOB_HOST_UNITS], &cons)?;
    let numbers: Vec<i64> = (first..first + n.get() as i64).collect();
    let names: Vec<String> = numbers
        .iter()
        .map(|number| format!("{}/{}", svc.name, number))
        .collect();
    let values: Vec<&dyn crate::sql::ToSql> = names
        .iter()
        .zip(&numbers)
        .zip(&machines)
        .flat_map(|((name, number), machine)| -> [&dyn crate::sql::ToSql; 6] {
            [name, &svc.name, number, &svc.series, machine, &cons]
        })
        .collect();
    crate::db::insert_rows(
        tx,
        "INSERT INTO units (name, service, number, series, machine_id, constraints)",
        6,
        &values,
    )?;
    for name in &names {
        tx.changed(ChangeKind::Unit, name)?;
    }
    Ok(names)
}

/// Inserts the subordinate unit of `sub` for `principal` (no machine, no
/// constraints: it lives wherever its principal does).
pub(crate) fn insert_subordinate(
    tx: &mut Tx<'_>,
    sub: &Service,
    principal: &str,
) -> Result<String> {
    let number = next_unit_number(tx, &sub.name)?;
    let name = format!("{}/{}", sub.name, number);
    tx.prepare_cached(
        "INSERT INTO units (name, service, number, series, principal) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute((&name, &sub.name, number, &sub.series, principal))?;
    tx.execute(
        "UPDATE services SET unit_count = unit_count + 1 WHERE name = ?1",
        [&sub.name],
    )?;
    tx.changed(ChangeKind::Unit, &name)?;
    tx.changed(ChangeKind::Service, &sub.name)?;
    Ok(name)
}

pub(crate) fn subordinates_of(c: &Connection, unit: &str) -> Result<Vec<String>> {
    let mut stmt =
        c.prepare_cached("SELECT name FROM units WHERE principal = ?1 ORDER BY service, number")?;
    let names = stmt
        .query_map([unit], |r| r.get(0))?
        .collect::<crate::sql::Result<Vec<String>>>()?;
    Ok(names)
}

/// Keys of the relations whose scope `unit` is in.
pub(crate) fn scopes_of(c: &Connection, unit: &str) -> Result<Vec<String>> {
    let mut stmt = c.prepare_cached(
        "SELECT r.key FROM relation_scopes s JOIN relations r ON r.id = s.relation_id
         WHERE s.unit = ?1 ORDER BY r.id",
    )?;
    let keys = stmt
        .query_map([unit], |r| r.get(0))?
        .collect::<crate::sql::Result<Vec<String>>>()?;
    Ok(keys)
}

fn set_unit_life(tx: &mut Tx<'_>, name: &str, life: Life) -> Result<()> {
    tx.prepare_cached("UPDATE units SET life = ?1 WHERE name = ?2")?
        .execute((life.code(), name))?;
    tx.changed(ChangeKind::Unit, name)
}

/// Destroys an Alive unit: sets it Dying, after destroying its subordinates.
///
/// A unit for which no agent has started (the explicit `agent_started`
/// marker, not its status string) that is in no relation scope and has no
/// subordinates is removed at once instead: no agent would ever set it Dead,
/// and nothing refers to it. Such a unit becomes Dead and is removed in this
/// one transaction. A deployer about to deploy it finds it gone and recalls
/// whatever it had started.
pub(crate) fn destroy_unit_in(tx: &mut Tx<'_>, unit: &Unit) -> Result<()> {
    if unit.life != Life::Alive {
        return Ok(());
    }
    let subs = subordinates_of(tx, &unit.name)?;
    for sub in &subs {
        let sub = get_unit(tx, sub)?;
        destroy_unit_in(tx, &sub)?;
    }
    // Subordinates left are read again only if there were any (one
    // statement, a round trip on PostgreSQL, less per unit destroyed).
    if !unit.agent_started
        && scopes_of(tx, &unit.name)?.is_empty()
        && (subs.is_empty() || subordinates_of(tx, &unit.name)?.is_empty())
    {
        return remove_unit_in(tx, unit);
    }
    set_unit_life(tx, &unit.name, Life::Dying)
}

/// What [`destroy_units_after`] did: the number of the last unit it
/// handled (`None`: there was none) and whether no unit is left above it.
pub(crate) struct UnitsStep {
    pub last: Option<i64>,
    pub finished: bool,
}

/// Destroys the units of `service` numbered above `after` — at most
/// `batch` of them, stopping early once about `max_rows` rows are written —
/// exactly as [`destroy_unit_in`] does one at a time: a unit nothing holds
/// (agent never started, in no relation scope, no subordinates) is
/// removed, any other Alive unit becomes Dying. Units with subordinates go
/// one at a time through [`destroy_unit_in`] (their subordinates first);
/// the rest in one `DELETE` and one `UPDATE` over their range, each
/// stating the rule in its `WHERE`: a handful of statements a step where
/// a statement per rule and unit made the cleanup of a 100,000-unit
/// service some 600,000 round trips on PostgreSQL.
pub(crate) fn destroy_units_after(
    tx: &mut Tx<'_>,
    service: &str,
    after: i64,
    batch: usize,
    max_rows: u64,
) -> Result<UnitsStep> {
    // (number, name, whether it goes on its own: Alive with subordinates)
    let units: Vec<(i64, String, bool)> = tx
        .prepare_cached(
            "SELECT u.number, u.name,
                    u.life = 0 AND EXISTS (SELECT 1 FROM units s WHERE s.principal = u.name)
             FROM units u WHERE u.service = ?1 AND u.number > ?2 ORDER BY u.number LIMIT ?3",
        )?
        .query_map((service, after, batch as i64), |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?
        .collect::<crate::sql::Result<_>>()?;
    // What the set-wide statements below may write: a unit removed is its
    // row, its number's high-water row (SQLite counts the trigger's) and
    // two feed entries, a unit made Dying fewer; then the service's row
    // and entry, and the cursor.
    let plain = units.iter().filter(|u| !u.2).count() as u64;
    let budget = max_rows.saturating_sub(4 * plain + 3);
    let before = tx.rows_written();
    let mut done = units.len();
    for (i, (_, name, alone)) in units.iter().enumerate() {
        if !alone {
            continue;
        }
        // Re-read: destroying an earlier unit may have changed this one.
        if let Ok(u) = get_unit(tx, name) {
            destroy_unit_in(tx, &u)?;
        }
        if tx.rows_written() - before >= budget {
            done = i + 1;
            break;
        }
    }
    let Some(&(last, _, _)) = units[..done].last() else {
        return Ok(UnitsStep {
            last: None,
            finished: true,
        });
    };
    let removed: Vec<(String, Option<i64>)> = tx
        .prepare_cached(
            "DELETE FROM units WHERE service = ?1 AND number > ?2 AND number <= ?3
               AND life = 0 AND NOT agent_started
               AND NOT EXISTS (SELECT 1 FROM relation_scopes s WHERE s.unit = units.name)
               AND NOT EXISTS (SELECT 1 FROM units s WHERE s.principal = units.name)
             RETURNING name, machine_id",
        )?
        .query_map((service, after, last), |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<crate::sql::Result<_>>()?;
    let dying: Vec<String> = tx
        .prepare_cached(
            "UPDATE units SET life = 1 WHERE service = ?1 AND number > ?2 AND number <= ?3
               AND life = 0
             RETURNING name",
        )?
        .query_map((service, after, last), |r| r.get(0))?
        .collect::<crate::sql::Result<_>>()?;
    for (name, machine) in &removed {
        tx.changed(ChangeKind::Unit, name)?;
        if let Some(m) = machine {
            tx.changed(ChangeKind::Machine, m.to_string())?;
        }
    }
    for name in &dying {
        tx.changed(ChangeKind::Unit, name)?;
    }
    if !removed.is_empty() {
        units_removed(tx, service, removed.len() as i64)?;
    }
    Ok(UnitsStep {
        last: Some(last),
        finished: done == units.len() && units.len() < batch,
    })
}

/// Counts `n` units of `service` removed and, if they were the last thing
/// holding it Dying, removes the service.
fn units_removed(tx: &mut Tx<'_>, service: &str, n: i64) -> Result<()> {
    let svc = get_service(tx, service)?;
    if svc.life == Life::Alive || svc.unit_count > n || svc.relation_count > 0 {
        tx.prepare_cached("UPDATE services SET unit_count = unit_count - ?1 WHERE name = ?2")?
            .execute((n, &svc.name))?;
        tx.changed(ChangeKind::Service, &svc.name)
    } else {
        remove_service_in(tx, &svc.name)
    }
}

/// Deletes a unit (the caller has checked it may go) and, if it was the last
/// thing holding a Dying service, the service too.
pub(crate) fn remove_unit_in(tx: &mut Tx<'_>, unit: &Unit) -> Result<()> {
    tx.prepare_cached("DELETE FROM units WHERE name = ?1")?
        .execute([&unit.name])?;
    tx.changed(ChangeKind::Unit, &unit.name)?;
    if let Some(m) = unit.machine_id {
        tx.changed(ChangeKind::Machine, m.to_string())?;
    }
    units_removed(tx, &unit.service, 1)
}

/// Deletes a service and its settings. The caller has established that
/// nothing refers to it any more.
pub(crate) fn remove_service_in(tx: &mut Tx<'_>, name: &str) -> Result<()> {
    tx.execute("DELETE FROM service_settings WHERE service = ?1", [name])?;
    tx.execute("DELETE FROM services WHERE name = ?1", [name])?;
    tx.changed(ChangeKind::Service, name)
}

impl Store {
    pub fn unit(&self, name: &str) -> Result<Unit> {
        self.read(|c| get_unit(c, name))
    }

    /// A unit with its service's charm URL and the charm's files, in one
    /// read snapshot (what its deployer lays down; the charm's metadata
    /// is not parsed).
    pub fn unit_charm(&self, name: &str) -> Result<(Unit, String, String)> {
        use crate::sql::OptionalExtension;
        self.read(|c| {
            let u = get_unit(c, name)?;
            let (url, path) = c
                .prepare_cached(
                    "SELECT ch.url, ch.path FROM services s JOIN charms ch ON ch.url = s.charm_url
                     WHERE s.name = ?1",
                )?
                .query_row([&u.service], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?
                .ok_or_else(|| Error::not_found(Entity::Service, &u.service))?;
            Ok((u, url, path))
        })
    }

    /// All units of a service, in number order.
    pub fn units_of(&self, service: &str) -> Result<Vec<Unit>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(&format!(
                "SELECT {UNIT_COLS} FROM units WHERE service = ?1 ORDER BY number"
            ))?;
            let rows = stmt.query_map([service], unit_row)?;
            rows.map(|r| finish_unit(r?)).collect()
        })
    }

    /// Units assigned to a machine (principals only).
    pub fn units_on_machine(&self, id: i64) -> Result<Vec<String>> {
        self.read(|c| crate::machines::assigned_units(c, id, false))
    }

    /// Subordinate units of a principal.
    pub fn subordinates(&self, unit: &str) -> Result<Vec<String>> {
        self.read(|c| subordinates_of(c, unit))
    }

    /// `destroy-unit`: destroys principal units, all or none. Subordinates
    /// are refused (they go with their principal or their relation); units
    /// already destroying are skipped.
    pub fn destroy_units(&self, names_: &[String]) -> Result<()> {
        crate::check_named_count("destroy", "units", names_.len())?;
        for n in names_ {
            names::parse_unit(n)?;
        }
        self.write(|tx| {
            for n in names_ {
                let unit = get_unit(tx, n)?;
                if unit.is_subordinate() {
                    return Err(Error::Subordinate {
                        service: unit.service,
                        hint: "its units cannot be destroyed directly; destroy the relation to its principal, or the principal unit",
                    });
                }
                // Re-read: destroying an earlier unit in the list may have
                // changed this one (it cannot today, but the rule is cheap).
                let unit = get_unit(tx, n)?;
                destroy_unit_in(tx, &unit)?;
            }
            Ok(())
        })
    }

    /// Sets a unit Dead (its agent's last act). Refused while the unit is in
    /// any relation scope or has subordinates. Already Dead: a no-op.
    pub(crate) fn ensure_dead_unit_in(tx: &mut Tx<'_>, name: &str) -> Result<()> {
        {
            let unit = get_unit(tx, name)?;
            if unit.life == Life::Dead {
                return Ok(());
            }
            let scopes = scopes_of(tx, name)?;
            if !scopes.is_empty() {
                return Err(Error::UnitBusy {
                    unit: name.to_string(),
                    why: format!(
                        "is still in the scope of relation {}; it must leave them before it can be dead",
                        quote_list(&scopes)
                    ),
                });
            }
            let subs = subordinates_of(tx, name)?;
            if !subs.is_empty() {
                return Err(Error::UnitBusy {
                    unit: name.to_string(),
                    why: format!(
                        "still has subordinates {}; they must be removed before it can be dead",
                        quote_list(&subs)
                    ),
                });
            }
            set_unit_life(tx, name, Life::Dead)
        }
    }

    /// Deletes a Dead unit, unassigning it from its machine or principal;
    /// removes its service too if that was Dying and held only by this unit.
    pub(crate) fn remove_dead_unit_in(tx: &mut Tx<'_>, name: &str) -> Result<()> {
        {
            let unit = get_unit(tx, name)?;
            if unit.life != Life::Dead {
                return Err(Error::NotDead {
                    kind: Entity::Unit,
                    id: name.to_string(),
                });
            }
            remove_unit_in(tx, &unit)
        }
    }

    /// Sets a unit's status (agents report through this), reported by an
    /// agent that runs now (see [`Store::agents_restarting`]).
    pub(crate) fn set_unit_status_in(
        tx: &mut Tx<'_>,
        name: &str,
        status: &str,
        info: &str,
    ) -> Result<()> {
        {
            get_unit(tx, name)?;
            tx.execute(
                "UPDATE units SET status = ?1, status_info = ?2, status_current = TRUE WHERE name = ?3",
                (status, info, name),
            )?;
            tx.changed(ChangeKind::Unit, name)
        }
    }
}
