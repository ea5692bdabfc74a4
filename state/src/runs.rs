//! `jujube run UNIT -- CMD...`: commands run by a unit's agent in a hook
//! context.
//!
//! charms-in-action.txt wishes for a `juju-run` that runs a command "in a
//! hook context" at any time. Here the request goes through the store, like
//! every other intent: the user queues it ([`Store::queue_run`]), the unit's
//! agent sees it in its view, runs it between two hooks (never during one:
//! the agent runs one thing at a time) and answers with
//! [`AgentOp::FinishRun`](crate::AgentOp::FinishRun), which only that unit's
//! agent may write. Because it travels as data, the same request reaches an
//! agent in the controller's process, in a `jujube agent` process, or inside
//! a container, and the answer survives a restart of either side.

use crate::db::{Store, Tx};
use crate::feed::ChangeKind;
use crate::model::get_unit;
use crate::{Entity, Error, Result};
use jujube_core::Life;
use rusqlite::OptionalExtension;

/// The most output kept of each stream (stdout, stderr) of a run.
pub const MAX_RUN_OUTPUT: usize = 1 << 20;

/// A queued command, as the unit's agent gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRequest {
    pub id: i64,
    pub argv: Vec<String>,
    /// Seconds the agent lets it run before killing it, counted from when
    /// it was queued.
    pub timeout: u64,
    /// Seconds since it was queued, as the store's clock reads now.
    pub waited: u64,
}

/// What a run printed and exited with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunResult {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Cuts `s` to at most [`MAX_RUN_OUTPUT`] bytes, on a character boundary,
/// saying so at the end.
pub fn bound_output(mut s: String) -> String {
    if s.len() > MAX_RUN_OUTPUT {
        let mut end = MAX_RUN_OUTPUT;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("\n[output truncated at 1 MiB]\n");
    }
    s
}

impl Store {
    /// Queues `argv` to run on `unit` (which must be Alive: a dying unit's
    /// agent is busy leaving), killed after `timeout` seconds. Returns the
    /// run's id for [`Store::run_result`].
    pub fn queue_run(&self, unit: &str, argv: &[String], timeout: u64) -> Result<i64> {
        jujube_core::names::parse_unit(unit)?;
        if argv.is_empty() || argv[0].is_empty() {
            return Err(Error::Relation(
                "no command given; name one after `--`, e.g. `jujube run wordpress/0 -- hostname`"
                    .into(),
            ));
        }
        if timeout == 0 {
            return Err(Error::Relation(
                "a run's timeout must be at least one second".into(),
            ));
        }
        self.write(|tx| {
            let u = get_unit(tx, unit)?;
            if u.life != Life::Alive {
                return Err(Error::NotAlive {
                    kind: Entity::Unit,
                    id: unit.to_string(),
                    life: u.life,
                    action: "run commands",
                });
            }
            tx.prepare_cached(
                "INSERT INTO runs (unit, argv, timeout, queued) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute((
                unit,
                serde_json::to_string(argv).expect("strings serialise"),
                timeout as i64,
                crate::unix_now(),
            ))?;
            let id = tx.last_insert_rowid();
            tx.changed(ChangeKind::Run, unit)?;
            Ok(id)
        })
    }

    /// The answer to run `id`: `None` while it is queued or running;
    /// [`Error::NotFound`] when it (or its unit) is gone.
    pub fn run_result(&self, id: i64) -> Result<Option<RunResult>> {
        self.read(|c| {
            let row: Option<(Option<i32>, Option<String>, Option<String>)> = c
                .prepare_cached("SELECT code, stdout, stderr FROM runs WHERE id = ?1")?
                .query_row([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .optional()?;
            match row {
                None => Err(Error::not_found(Entity::Unit, format!("run {id}"))),
                Some((None, _, _)) => Ok(None),
                Some((Some(code), out, err)) => Ok(Some(RunResult {
                    code,
                    stdout: out.unwrap_or_default(),
                    stderr: err.unwrap_or_default(),
                })),
            }
        })
    }

    /// Forgets an answered run (the command that asked has printed it).
    pub fn forget_run(&self, id: i64) -> Result<()> {
        self.write(|tx| {
            tx.prepare_cached("DELETE FROM runs WHERE id = ?1 AND code IS NOT NULL")?
                .execute([id])?;
            Ok(())
        })
    }

    /// The runs queued for `unit` and not answered yet, oldest first.
    pub fn pending_runs(&self, unit: &str) -> Result<Vec<RunRequest>> {
        self.read(|c| pending_runs_in(c, unit))
    }
}

pub(crate) fn pending_runs_in(c: &rusqlite::Connection, unit: &str) -> Result<Vec<RunRequest>> {
    let rows = c
        .prepare_cached(
            "SELECT id, argv, timeout, queued FROM runs WHERE unit = ?1 AND code IS NULL ORDER BY id",
        )?
        .query_map([unit], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let now = crate::unix_now().max(0) as u64;
    rows.into_iter()
        .map(|(id, argv, timeout, queued)| {
            let argv = serde_json::from_str(&argv).map_err(|_| Error::Corrupt {
                what: "run command",
                value: argv,
            })?;
            Ok(RunRequest {
                id,
                argv,
                timeout: timeout.max(1) as u64,
                waited: match u64::try_from(queued) {
                    Ok(q) if q > 0 => now.saturating_sub(q),
                    _ => 0,
                },
            })
        })
        .collect()
}

/// The unit's agent answers run `id` (once; a second answer is a no-op).
pub(crate) fn finish_run_in(
    tx: &mut Tx<'_>,
    unit: &str,
    id: i64,
    result: &RunResult,
) -> Result<()> {
    let owner: Option<String> = tx
        .prepare_cached("SELECT unit FROM runs WHERE id = ?1")?
        .query_row([id], |r| r.get(0))
        .optional()?;
    if owner.as_deref() != Some(unit) {
        return Err(Error::not_found(
            Entity::Unit,
            format!("run {id} of unit `{unit}`"),
        ));
    }
    let n = tx
        .prepare_cached(
            "UPDATE runs SET code = ?1, stdout = ?2, stderr = ?3 WHERE id = ?4 AND code IS NULL",
        )?
        .execute((
            result.code,
            bound_output(result.stdout.clone()),
            bound_output(result.stderr.clone()),
            id,
        ))?;
    if n > 0 {
        tx.changed(ChangeKind::Run, unit)?;
    }
    Ok(())
}
