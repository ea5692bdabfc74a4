//! Controller machines: how many there are (`enable-ha`), and where each
//! one's running controller serves the API and when it last said so.
//!
//! # Layout
//!
//! - A controller machine is a machine with the `manage-environ` job:
//!   machine 0 from `bootstrap`, and those [`Store::enable_ha`] adds, in
//!   one transaction, until the asked number are Alive. They host no units.
//! - A running controller calls [`Store::controller_seen`] when it starts
//!   and every few seconds after: one row per controller machine in
//!   `controllers` (its lease holder name, its API addresses, the time); a
//!   change-feed entry (`controllers`) only when its addresses differ from
//!   those recorded, so that agents learn of a controller added later
//!   without waking every few seconds. `status` tells a controller
//!   whose row is older than the agents' presence lapse `down`, and
//!   [`Store::controller_addresses`] is what agents and clients are given
//!   to fail over between.
//! - Which controller runs the singleton jobs is the `singletons` lease
//!   (`crate::leases`), matched to a row by its holder name.

use crate::db::Store;
use crate::feed::ChangeKind;
use crate::model::{get_machine, JOB_MANAGE_ENVIRON};
use crate::sql::{Connection, OptionalExtension};
use crate::{Error, Result};
use jujube_core::Life;

/// The most controller machines an environment may have (an odd number:
/// a majority of them outlives the loss of the others).
pub const MAX_CONTROLLERS: usize = 7;
/// The most API addresses a controller may record, and the longest one
/// (bytes).
pub const MAX_ADDRESSES: usize = 8;
pub const MAX_ADDRESS: usize = 256;

/// A running controller, as it last recorded itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controller {
    pub machine: i64,
    /// The name it claims the controller leases under.
    pub holder: String,
    pub addresses: Vec<String>,
    /// Unix milliseconds, on its clock.
    pub seen_ms: i64,
}

/// The Alive controller machines, in id order.
pub(crate) fn controller_machines(c: &Connection) -> Result<Vec<i64>> {
    let mut stmt =
        c.prepare_cached("SELECT id FROM machines WHERE manage_environ AND life = 0 ORDER BY id")?;
    let ids = stmt
        .query_map([], |r| r.get(0))?
        .collect::<crate::sql::Result<Vec<i64>>>()?;
    Ok(ids)
}

pub(crate) fn controllers_in(c: &Connection) -> Result<Vec<Controller>> {
    let mut stmt = c.prepare_cached(
        "SELECT machine_id, holder, addresses, seen FROM controllers ORDER BY machine_id",
    )?;
    let rows = stmt
        .query_map([], |r| {
            Ok(Controller {
                machine: r.get(0)?,
                holder: r.get(1)?,
                addresses: r
                    .get::<_, String>(2)?
                    .split('\n')
                    .filter(|a| !a.is_empty())
                    .map(str::to_string)
                    .collect(),
                seen_ms: r.get(3)?,
            })
        })?
        .collect::<crate::sql::Result<Vec<_>>>()?;
    Ok(rows)
}

fn check_addresses(addresses: &[String]) -> Result<()> {
    if addresses.len() > MAX_ADDRESSES {
        return Err(Error::BadController(format!(
            "{} API addresses are more than {MAX_ADDRESSES}",
            addresses.len()
        )));
    }
    for a in addresses {
        if a.is_empty() || a.len() > MAX_ADDRESS || a.chars().any(|c| c.is_control()) {
            return Err(Error::BadController(format!(
                "API address `{}` must be 1 to {MAX_ADDRESS} bytes without control characters",
                a.escape_debug()
            )));
        }
    }
    Ok(())
}

impl Store {
    /// `enable-ha`: adds controller machines (the `manage-environ` job, on
    /// the environment's series and constraints) until `count` are Alive,
    /// in one transaction, and answers the ids added (none when there are
    /// that many already). `count` is odd, 1 to [`MAX_CONTROLLERS`]; fewer
    /// than there are is refused (a controller machine is never destroyed
    /// by this).
    pub fn enable_ha(&self, count: usize) -> Result<Vec<i64>> {
        if count.is_multiple_of(2) || count > MAX_CONTROLLERS {
            return Err(Error::BadController(format!(
                "cannot have {count} controllers: the number must be odd, 1 to {MAX_CONTROLLERS} (a majority must outlive the loss of the others), e.g. `-n 3`"
            )));
        }
        self.write_at(jujube_wire::client::Access::Admin, |tx| {
            let env = crate::environment::get_environment(tx)?;
            let have = controller_machines(tx)?.len();
            if count < have {
                return Err(Error::BadController(format!(
                    "the environment has {have} controllers and `enable-ha` only adds them; ask for {have} or more"
                )));
            }
            let mut added = Vec::with_capacity(count - have);
            for _ in have..count {
                added.push(crate::machines::insert_machine(
                    tx,
                    &env.default_series,
                    &[JOB_MANAGE_ENVIRON],
                    &env.constraints,
                )?);
            }
            Ok(added)
        })
    }

    /// Records that the controller of `machine` runs, claims leases as
    /// `holder` and serves the API at `addresses`, at `now_ms`. Refused for
    /// a machine that is not an Alive controller machine, and beyond
    /// [`MAX_ADDRESSES`] or [`MAX_ADDRESS`]. Writes a change-feed entry
    /// only when `addresses` differ from those recorded.
    pub fn controller_seen(
        &self,
        machine: i64,
        holder: &str,
        addresses: &[String],
        now_ms: i64,
    ) -> Result<()> {
        crate::leases::check_name("holder", holder)?;
        check_addresses(addresses)?;
        let joined = addresses.join("\n");
        self.write(|tx| {
            let m = get_machine(tx, machine)?;
            if !m.manages_environ() || m.life != Life::Alive {
                return Err(Error::BadController(format!(
                    "machine `{machine}` is not an alive controller machine; `jujube status` lists the controllers"
                )));
            }
            let recorded: Option<String> = tx
                .prepare_cached("SELECT addresses FROM controllers WHERE machine_id = ?1")?
                .query_row([machine], |r| r.get(0))
                .optional()?;
            if recorded.as_deref() != Some(joined.as_str()) {
                tx.changed(ChangeKind::Controllers, "")?;
            }
            tx.prepare_cached(
                "INSERT INTO controllers (machine_id, holder, addresses, seen) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (machine_id) DO UPDATE
                 SET holder = excluded.holder, addresses = excluded.addresses, seen = excluded.seen",
            )?
            .execute((machine, holder, &joined, now_ms))?;
            Ok(())
        })
    }

    /// The Alive controller machines, in order.
    pub fn controller_machines(&self) -> Result<Vec<i64>> {
        self.read(controller_machines)
    }

    /// Every controller that ever recorded itself, in machine order.
    pub fn controllers(&self) -> Result<Vec<Controller>> {
        self.read(controllers_in)
    }

    /// Every Alive controller machine's API addresses: those of `first`
    /// (the caller's own controller) first, then the others in machine
    /// order; what agents and clients fail over between.
    pub fn controller_addresses(&self, first: i64) -> Result<Vec<String>> {
        self.read(|c| {
            let alive = controller_machines(c)?;
            let mut rows: Vec<Controller> = controllers_in(c)?
                .into_iter()
                .filter(|r| alive.contains(&r.machine))
                .collect();
            rows.sort_by_key(|r| (r.machine != first, r.machine));
            let mut out: Vec<String> = Vec::new();
            for a in rows.into_iter().flat_map(|r| r.addresses) {
                if !out.contains(&a) {
                    out.push(a);
                }
            }
            Ok(out)
        })
    }
}
