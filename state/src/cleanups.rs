//! Work that transactions queue because it is too big for one: the settings
//! of removed relations (the spec's "document for the attention of some
//! other part of the system (BUG: which doesn't exist)" — this is that part),
//! and the units of destroyed services, which are destroyed here in batches
//! so that `destroy-service` stays one small transaction even at 100,000
//! units and finishes even when no unit agent runs.
//!
//! Each [`Store::cleanup_step`] is one transaction of bounded size.

use crate::db::Store;
use crate::feed::ChangeKind;
use crate::model::{find_service, finish_unit, unit_row, UNIT_COLS};
use crate::units::destroy_unit_in;
use crate::Result;
use rusqlite::OptionalExtension;

pub const RELATION_SETTINGS: &str = "relation-settings";
pub const SERVICE_UNITS: &str = "service-units";

/// Settings rows deleted per step.
pub const SETTINGS_BATCH: usize = 500;
/// Units destroyed per step. Destroying a unit writes at most ~5 rows, and as
/// many again for each subordinate it takes with it.
pub const UNITS_BATCH: usize = 64;

/// A queued cleanup, as [`Store::skipped_cleanups`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cleanup {
    pub id: i64,
    pub kind: String,
    pub target: String,
}

impl Store {
    /// Cleanups of kinds this version does not know (not yet).
    pub fn skipped_cleanups(&self) -> Result<Vec<Cleanup>> {
        Ok(Vec::new())
    }

    /// Cleanups not yet finished.
    pub fn pending_cleanups(&self) -> Result<usize> {
        self.read(|c| {
            Ok(c.query_row("SELECT count(*) FROM cleanups", [], |r| r.get::<_, i64>(0))? as usize)
        })
    }

    /// Does one bounded step of the oldest cleanup. Returns false when there
    /// was nothing to do.
    pub fn cleanup_step(&self) -> Result<bool> {
        self.write(|tx| {
            let row: Option<(i64, String, String, i64)> = tx
                .query_row(
                    "SELECT id, kind, target, cursor FROM cleanups ORDER BY id LIMIT 1",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
                )
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
                SERVICE_UNITS => {
                    if find_service(tx, &target)?.is_none() {
                        true
                    } else {
                        let units = tx
                            .prepare_cached(&format!(
                                "SELECT {UNIT_COLS} FROM units WHERE service = ?1 AND number > ?2
                                 ORDER BY number LIMIT ?3"
                            ))?
                            .query_map((&target, cursor, UNITS_BATCH as i64), unit_row)?
                            .map(|r| finish_unit(r?))
                            .collect::<Result<Vec<_>>>()?;
                        for u in &units {
                            // Re-read: destroying an earlier unit may have
                            // removed this one's service or changed it.
                            if let Ok(u) = crate::model::get_unit(tx, &u.name) {
                                destroy_unit_in(tx, &u)?;
                            }
                        }
                        if let Some(last) = units.last() {
                            tx.execute(
                                "UPDATE cleanups SET cursor = ?1 WHERE id = ?2",
                                (last.number, id),
                            )?;
                        }
                        units.len() < UNITS_BATCH
                    }
                }
                // A kind this version does not know came from a newer one;
                // leave it for that version rather than guess.
                _ => return Ok(false),
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
