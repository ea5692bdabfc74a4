//! Machines: creation, the destroy → Dead → remove lifecycle, and the
//! provisioning status the provisioner and `resolved` work with.

use crate::db::{Store, Tx};
use crate::environment::{check_series, get_environment};
use crate::feed::ChangeKind;
use crate::model::{
    finish_machine, get_machine, machine_row, machine_status, quote_list, Machine, JOB_HOST_UNITS,
    MACHINE_COLS,
};
use crate::sql::Connection;
use crate::{require_alive, Entity, Error, Result};
use jujube_core::{series, Constraints, Life};

/// Machines are added in transactions of at most this many (each writes
/// two rows: the machine and its feed entry).
pub const MACHINE_BATCH: usize = 256;

/// [`next_machine_id`]'s expression, for a statement that reads it with
/// more (one round trip on PostgreSQL, not two).
macro_rules! next_machine_id_sql {
    () => {
        "(SELECT coalesce(max(n), 0) FROM (
           SELECT max(id) + 1 AS n FROM machines
           UNION ALL SELECT next FROM sequences WHERE name = 'machine') AS t)"
    };
}
pub(crate) use next_machine_id_sql;

/// The next machine id: one above the largest in use or ever removed
/// (kept by the `machines_high_water` trigger), 0 for the first. Every
/// smaller id was once used.
pub(crate) fn next_machine_id(c: &Connection) -> Result<i64> {
    Ok(
        c.prepare_cached(concat!("SELECT ", next_machine_id_sql!()))?
            .query_row([], |r| r.get(0))?,
    )
}

/// Inserts an Alive machine with the next id. Ids are never reused.
pub(crate) fn insert_machine(
    tx: &mut Tx<'_>,
    series: &str,
    jobs: &[&str],
    cons: &Constraints,
) -> Result<i64> {
    Ok(insert_machines(tx, n1(), series, jobs, cons)?[0])
}

fn n1() -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::MIN
}

/// Inserts `n` Alive machines alike, with the next ids, in multi-row
/// statements (see [`crate::db::insert_rows`]).
pub(crate) fn insert_machines(
    tx: &mut Tx<'_>,
    n: std::num::NonZeroUsize,
    series: &str,
    jobs: &[&str],
    cons: &Constraints,
) -> Result<Vec<i64>> {
    let first = next_machine_id(tx)?;
    insert_machines_from(tx, first, n, series, jobs, &cons.to_string())
}

/// [`insert_machines`] from `first`, the [`next_machine_id`] the caller
/// read in this transaction.
pub(crate) fn insert_machines_from(
    tx: &mut Tx<'_>,
    first: i64,
    n: std::num::NonZeroUsize,
    series: &str,
    jobs: &[&str],
    cons: &str,
) -> Result<Vec<i64>> {
    let ids: Vec<i64> = (first..first + n.get() as i64).collect();
    let manage = jobs.contains(&crate::model::JOB_MANAGE_ENVIRON);
    let jobs = jobs.join(" ");
    let values: Vec<&dyn crate::sql::ToSql> = ids
        .iter()
        .flat_map(|id| -> [&dyn crate::sql::ToSql; 5] { [id, &series, &jobs, &manage, &cons] })
        .collect();
    crate::db::insert_rows(
        tx,
        "INSERT INTO machines (id, series, jobs, manage_environ, constraints)",
        5,
        &values,
    )?;
    for id in &ids {
        tx.changed(ChangeKind::Machine, id.to_string())?;
    }
    Ok(ids)
}

/// Names of the units assigned to a machine, in order.
pub(crate) fn assigned_units(c: &Connection, id: i64, alive_only: bool) -> Result<Vec<String>> {
    let mut stmt = c.prepare_cached(
        "SELECT name FROM units WHERE machine_id = ?1 AND (NOT ?2 OR life = 0)
         ORDER BY service, number",
    )?;
    let names = stmt
        .query_map((id, alive_only), |r| r.get(0))?
        .collect::<crate::sql::Result<Vec<String>>>()?;
    Ok(names)
}

fn set_machine_life(tx: &mut Tx<'_>, id: i64, life: Life) -> Result<()> {
    tx.prepare_cached("UPDATE machines SET life = ?1 WHERE id = ?2")?
        .execute((life.code(), id))?;
    tx.changed(ChangeKind::Machine, id.to_string())
}

fn destroy_machine_in(tx: &mut Tx<'_>, id: i64) -> Result<()> {
    let m = get_machine(tx, id)?;
    if m.life != Life::Alive {
        return Ok(());
    }
    if m.manages_environ() {
        return Err(Error::ManagesEnvironment(id));
    }
    let units = assigned_units(tx, id, true)?;
    if !units.is_empty() {
        return Err(Error::MachineHasUnits {
            machine: id,
            units: quote_list(&units),
        });
    }
    set_machine_life(tx, id, Life::Dying)
}

/// Clears a machine's provisioning error (and its nonce: an instance a
/// failed start may have left behind is then nobody's, and is reaped as a
/// stray), optionally replacing its constraints. A machine in error because
/// its instance is gone (the instance poller's finding) also forgets that
/// instance, so that a replacement is started under a new nonce.
pub(crate) fn resolve_in(tx: &mut Tx<'_>, id: i64, cons: Option<&Constraints>) -> Result<()> {
    let m = get_machine(tx, id)?;
    require_alive(
        Entity::Machine,
        id.to_string(),
        m.life,
        "be provisioned again",
    )?;
    if m.status != machine_status::ERROR {
        return Err(Error::NoProvisioningError(id));
    }
    if let Some(c) = cons {
        tx.execute(
            "UPDATE machines SET constraints = ?1 WHERE id = ?2",
            (c.to_string(), id),
        )?;
    }
    tx.execute(
        "UPDATE machines SET status = ?1, status_info = '', nonce = NULL WHERE id = ?2",
        (machine_status::PENDING, id),
    )?;
    tx.execute(
        "UPDATE machines SET instance_id = NULL, zone = NULL, hardware = NULL, instance_status = NULL
         WHERE id = ?1 AND instance_status = ?2",
        (id, crate::model::instance_status::GONE),
    )?;
    tx.changed(ChangeKind::Machine, id.to_string())
}

impl Store {
    /// `add-machine -n N`: adds `n` machines with job `host-units`, in
    /// transactions of [`MACHINE_BATCH`]. `series` defaults to the
    /// environment's and must be one jujube knows (or the environment's
    /// `extra-series` adds). `cons` is merged over the environment's
    /// constraints as Juju does (keys it does not set come from the
    /// environment; `key=` hides the environment's value), and each machine
    /// keeps what that gave at its creation.
    ///
    /// More than [`crate::MAX_PER_COMMAND`] is refused before anything is
    /// written. A failure after some batches is [`Error::Incomplete`].
    pub fn add_machines(
        &self,
        n: usize,
        series_: Option<&str>,
        cons: Option<&Constraints>,
    ) -> Result<Vec<i64>> {
        crate::check_count("machines", n)?;
        if let Some(s) = series_ {
            series::validate(s)?;
        }
        let cons = cons.cloned().unwrap_or_default();
        crate::in_batches("machines", n, MACHINE_BATCH, Vec::new(), |k| {
            self.write(|tx| {
                let env = get_environment(tx)?;
                let series_ = series_.unwrap_or(&env.default_series);
                check_series(tx, series_)?;
                let cons = cons.with_fallbacks(&env.constraints);
                match std::num::NonZeroUsize::new(k) {
                    Some(k) => insert_machines(tx, k, series_, &[JOB_HOST_UNITS], &cons),
                    None => Ok(Vec::new()),
                }
            })
        })
    }

    pub fn machine(&self, id: i64) -> Result<Machine> {
        self.read(|c| get_machine(c, id))
    }

    pub fn machines(&self) -> Result<Vec<Machine>> {
        self.read(|c| {
            let mut stmt =
                c.prepare_cached(&format!("SELECT {MACHINE_COLS} FROM machines ORDER BY id"))?;
            let rows = stmt.query_map([], machine_row)?;
            rows.map(|r| finish_machine(r?)).collect()
        })
    }

    /// The machines a provisioning pass may have to act on: those not Alive,
    /// and those without an instance (an index holds exactly these, so with
    /// every machine provisioned and Alive this reads nothing).
    pub fn actionable_machines(&self) -> Result<Vec<Machine>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(&format!(
                "SELECT {MACHINE_COLS} FROM machines INDEXED BY machines_actionable
                 WHERE life != 0 OR instance_id IS NULL ORDER BY id"
            ))?;
            let rows = stmt.query_map([], machine_row)?;
            rows.map(|r| finish_machine(r?)).collect()
        })
    }

    /// The machines that keep the environment from settling, for `wait`:
    /// Alive without an instance (not in error), Dying (their agent not in
    /// error) and Dead; the first `limit` by id, and how many there are in
    /// all. Read from the index of actionable machines, so an answer costs
    /// `limit` rows whatever the deploy's size.
    pub fn unsettled_machines(&self, limit: usize) -> Result<(Vec<Machine>, u64)> {
        const UNSETTLED: &str = "FROM machines INDEXED BY machines_actionable
             WHERE (life != 0 OR instance_id IS NULL)
               AND ((life = 0 AND status != 'error') OR life = 2
                    OR (life = 1 AND agent_status != 'error'))";
        self.read(|c| {
            let listed = c
                .prepare_cached(&format!(
                    "SELECT {MACHINE_COLS} {UNSETTLED} ORDER BY id LIMIT ?1"
                ))?
                .query_map([limit as i64], machine_row)?
                .map(|r| finish_machine(r?))
                .collect::<Result<Vec<_>>>()?;
            let all: i64 = c
                .prepare_cached(&format!("SELECT count(*) {UNSETTLED}"))?
                .query_row([], |r| r.get(0))?;
            Ok((listed, all as u64))
        })
    }

    /// `destroy-machine`: sets an Alive machine Dying.
    ///
    /// Refused for a machine that manages the environment, and while any
    /// Alive principal unit is assigned. This is the spec's "future plan"
    /// rather than its current rule: units that are already Dying do not
    /// block it, because the machine agent waits for them to be removed
    /// before setting the machine Dead ([`Store::ensure_dead_machine`]).
    /// Not Alive already: a no-op.
    pub fn destroy_machine(&self, id: i64) -> Result<()> {
        self.destroy_machines(&[id])
    }

    /// `destroy-machine ID...`: [`Store::destroy_machine`] for each, all or
    /// none in one transaction.
    pub fn destroy_machines(&self, ids: &[i64]) -> Result<()> {
        crate::check_named_count("destroy", "machines", ids.len())?;
        self.write(|tx| ids.iter().try_for_each(|&id| destroy_machine_in(tx, id)))
    }

    /// Sets a machine Dead (the machine agent's job once it is Dying).
    /// Refused while any unit is still assigned, whatever its life, and for a
    /// machine that manages the environment. Already Dead: a no-op.
    pub(crate) fn ensure_dead_machine_in(tx: &mut Tx<'_>, id: i64) -> Result<()> {
        {
            let m = get_machine(tx, id)?;
            if m.life == Life::Dead {
                return Ok(());
            }
            if m.manages_environ() {
                return Err(Error::ManagesEnvironment(id));
            }
            let units = assigned_units(tx, id, false)?;
            if !units.is_empty() {
                return Err(Error::MachineHasUnits {
                    machine: id,
                    units: quote_list(&units),
                });
            }
            set_machine_life(tx, id, Life::Dead)
        }
    }

    /// Deletes a Dead machine. Refused for any other.
    pub(crate) fn remove_machine_in(tx: &mut Tx<'_>, id: i64) -> Result<()> {
        {
            let m = get_machine(tx, id)?;
            if m.life != Life::Dead {
                return Err(Error::NotDead {
                    kind: Entity::Machine,
                    id: id.to_string(),
                });
            }
            tx.execute("DELETE FROM machines WHERE id = ?1", [id])?;
            tx.changed(ChangeKind::Machine, id.to_string())
        }
    }

    /// `resolved MACHINE [--constraints C]`: clears a provisioning error so
    /// that the provisioner tries again, first replacing the machine's
    /// constraints when `cons` is given.
    pub fn resolve_machine(&self, id: i64, cons: Option<&Constraints>) -> Result<()> {
        self.write(|tx| resolve_in(tx, id, cons))
    }

    /// Sets a machine's status and its explanation.
    pub fn set_machine_status(&self, id: i64, status: &str, info: &str) -> Result<()> {
        self.write(|tx| {
            get_machine(tx, id)?;
            tx.execute(
                "UPDATE machines SET status = ?1, status_info = ?2 WHERE id = ?3",
                (status, info, id),
            )?;
            tx.changed(ChangeKind::Machine, id.to_string())
        })
    }
}
