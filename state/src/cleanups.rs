//! Work that transactions queue because it is too big for one: the settings
//! of removed relations (the spec's "document for the attention of some
//! other part of the system (BUG: which doesn't exist)" — this is that part),
//! and the units of destroyed services, which are destroyed here in batches
//! so that `destroy-service` stays one small transaction even at 100,000
//! units and finishes even when no unit agent runs.
//!
//! Each [`Store::cleanup_step`] is one transaction of bounded size.
//!
//! A cleanup names what it acts on by an id that is never reused: a
//! relation id, or a service's *incarnation* (not its name, which a new
//! service may take once the old one is removed). It ends when that thing is
//! gone, and never touches anything else.
//!
//! Rows of a kind this version does not know (queued by a newer jujube) are
//! left in place for a version that knows them, passed over so that they
//! never block the rows behind them, and reported by
//! [`Store::skipped_cleanups`].

use crate::db::Store;
use crate::feed::ChangeKind;
use crate::sql::{Connection, OptionalExtension};
use crate::units::destroy_units_after;
use crate::{Error, Result};

/// Deletes the settings of a removed relation; the target is its id.
pub const RELATION_SETTINGS: &str = "relation-settings";
/// Destroys the units of a destroyed service; the target is the service's
/// incarnation id.
pub const SERVICE_UNITS: &str = "service-units";
/// Every kind this version does.
pub const KINDS: [&str; 2] = [RELATION_SETTINGS, SERVICE_UNITS];

/// Settings rows deleted per step.
pub const SETTINGS_BATCH: usize = 500;
/// Units destroyed per step at most. Destroying a unit writes about 5 rows,
/// and as many again for each subordinate it takes with it: a step stops
/// early once it has written [`UNITS_STEP_ROWS`].
pub const UNITS_BATCH: usize = 192;
/// The rows a step of unit destruction writes before it stops (the one
/// unit that crosses it finishes): transactions stay under a thousand rows.
pub const UNITS_STEP_ROWS: u64 = 800;

/// A queued cleanup, as [`Store::skipped_cleanups`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cleanup {
    pub id: i64,
    pub kind: String,
    pub target: String,
}

/// `kind IN ('relation-settings', ...)`: the rows this version can do.
fn known() -> String {
    let kinds: Vec<String> = KINDS.iter().map(|k| format!("'{k}'")).collect();
    format!("kind IN ({})", kinds.join(", "))
}

/// The name of the service whose incarnation is `target`, if it still
/// exists.
fn service_of_incarnation(c: &Connection, target: &str) -> Result<Option<String>> {
    let Ok(incarnation) = target.parse::<i64>() else {
        return Ok(None);
    };
    Ok(
        c.prepare_cached("SELECT name FROM services WHERE incarnation = ?1")?
            .query_row([incarnation], |r| r.get(0))
            .optional()?,
    )
}

impl Store {
    /// Cleanups this version has yet to do.
    pub fn pending_cleanups(&self) -> Result<usize> {
        self.read(|c| {
            Ok(c.query_row(
                &format!("SELECT count(*) FROM cleanups WHERE {}", known()),
                [],
                |r| r.get::<_, i64>(0),
            )? as usize)
        })
    }

    /// Cleanups of kinds this version does not know, oldest first: a newer
    /// jujube queued them, and they wait for it. The controller reports them.
    pub fn skipped_cleanups(&self) -> Result<Vec<Cleanup>> {
        self.read(|c| {
            let mut stmt = c.prepare(&format!(
                "SELECT id, kind, target FROM cleanups WHERE NOT {} ORDER BY id",
                known()
            ))?;
            let rows = stmt.query_map([], |r| {
                Ok(Cleanup {
                    id: r.get(0)?,
                    kind: r.get(1)?,
                    target: r.get(2)?,
                })
            })?;
            Ok(rows.collect::<crate::sql::Result<_>>()?)
        })
    }

    /// Does one bounded step of the oldest cleanup this version knows how to
    /// do. Returns false when there was nothing to do.
    pub fn cleanup_step(&self) -> Result<bool> {
        self.write(|tx| {
            let row: Option<(i64, String, String, i64)> = tx
                .prepare_cached(&format!(
                    "SELECT id, kind, target, cursor FROM cleanups WHERE {} ORDER BY id LIMIT 1",
                    known()
                ))?
                .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .optional()?;
            let Some((id, kind, target, cursor)) = row else {
                return Ok(false);
            };
            let finished = match kind.as_str() {
                RELATION_SETTINGS => {
                    let n = tx.execute(
                        "DELETE FROM relation_settings WHERE relation_id = ?1 AND unit IN
                         (SELECT unit FROM relation_settings WHERE relation_id = ?1 LIMIT ?2)",
                        (target.parse::<i64>().unwrap_or(-1), SETTINGS_BATCH as i64),
                    )?;
                    n < SETTINGS_BATCH
                }
                SERVICE_UNITS => match service_of_incarnation(tx, &target)? {
                    // That incarnation is gone (a service of the same name
                    // may exist, but it is another one): done.
                    None => true,
                    Some(service) => {
                        let step = destroy_units_after(
                            tx,
                            &service,
                            cursor,
                            UNITS_BATCH,
                            UNITS_STEP_ROWS,
                        )?;
                        if let Some(last) = step.last {
                            tx.execute(
                                "UPDATE cleanups SET cursor = ?1 WHERE id = ?2",
                                (last, id),
                            )?;
                        }
                        step.finished
                    }
                },
                // `known()` selects only the kinds above.
                other => {
                    return Err(Error::Corrupt {
                        what: "cleanup kind",
                        value: other.to_string(),
                    })
                }
            };
            if finished {
                tx.execute("DELETE FROM cleanups WHERE id = ?1", [id])?;
                tx.changed(ChangeKind::Cleanup, &target)?;
            }
            Ok(true)
        })
    }

    /// Runs cleanup steps until none is left or `max_steps` were done.
    /// Returns the number of steps done.
    pub fn run_cleanups(&self, max_steps: usize) -> Result<usize> {
        let mut steps = 0;
        while steps < max_steps && self.cleanup_step()? {
            steps += 1;
        }
        Ok(steps)
    }
}
