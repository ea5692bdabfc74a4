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
use crate::sql::OptionalExtension;
use crate::{Entity, Error, Result};
use jujube_core::Life;

/// The most output kept of each stream (stdout, stderr) of a run.
pub const MAX_RUN_OUTPUT: usize = 1 << 20;

/// How many answered actions a unit keeps for `show-task` (the oldest go
/// first): what a unit's actions hold in the store is bounded.
pub const KEPT_ACTIONS: i64 = 100;

/// How many answered commands (`jujube run`, `exec`) a unit keeps whose
/// result nobody has read and forgotten yet (the oldest go first): a
/// client that waits reads and forgets its own at once, and one that was
/// killed or cut off leaves it behind, so what they hold is bounded too.
pub const KEPT_RUNS: i64 = 100;

/// How many commands and actions may wait for one unit's agent: every view
/// of the unit carries them.
pub const MAX_PENDING_RUNS: i64 = 100;

/// The most bytes a queued command's words may add up to (as an action's
/// parameters may): every view of the unit carries its pending runs.
pub const MAX_RUN_ARGV_BYTES: usize = 64 << 10;

/// The most bytes of commands' words and actions' parameters one view of a
/// unit carries (at least one run, whatever its size): the rest wait in the
/// store and come in later views, as earlier runs are answered. So a view
/// stays small however the unit's queue was filled.
pub const MAX_VIEW_RUNS_BYTES: usize = 256 << 10;

/// The longest a queued command or action may be given to run: a day.
pub const MAX_RUN_TIMEOUT: u64 = 24 * 3600;

/// A queued command, or action, as the unit's agent gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRequest {
    pub id: i64,
    /// The command (empty for an action).
    pub argv: Vec<String>,
    /// The action to run and its checked parameters (a JSON object).
    pub action: Option<(String, serde_json::Value)>,
    /// Seconds the agent lets it run before killing it, counted from when
    /// it was queued.
    pub timeout: u64,
    /// Seconds since it was queued, as the store's clock reads now.
    pub waited: u64,
}

pub use jujube_wire::view::{ActionOutcome, RunResult, Task};

/// Cuts `s` to at most [`MAX_RUN_OUTPUT`] bytes, on a character boundary,
/// saying so at the end.
pub fn bound_output(mut s: String) -> String {
    if s.len() > MAX_RUN_OUTPUT {
        s.truncate(jujube_wire::facade::char_floor(&s, MAX_RUN_OUTPUT));
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
        check_timeout("a run", timeout)?;
        let bytes: usize = argv.iter().map(|w| w.len()).sum();
        if bytes > MAX_RUN_ARGV_BYTES {
            return Err(Error::Relation(format!(
                "the command is {bytes} bytes, more than the {MAX_RUN_ARGV_BYTES} a run may take; put it in a script the unit runs"
            )));
        }
        self.write_at(jujube_wire::client::Access::Admin, |tx| {
            alive_unit(tx, unit, "run commands")?;
            check_pending(tx, unit)?;
            let id: i64 = tx
                .prepare_cached(
                    "INSERT INTO runs (unit, argv, timeout, queued) VALUES (?1, ?2, ?3, ?4)
                     RETURNING id",
                )?
                .query_row(
                    (
                        unit,
                        serde_json::to_string(argv).expect("strings serialise"),
                        timeout as i64,
                        crate::unix_now(),
                    ),
                    |r| r.get(0),
                )?;
            tx.changed(ChangeKind::Run, unit)?;
            Ok(id)
        })
    }

    /// Queues action `name` of `unit`'s charm with parameters `raw`
    /// (`key=value` as typed), checked against the charm's `actions.yaml`
    /// and completed with its defaults first: refused, queueing nothing,
    /// when they do not fit. Returns the task's id.
    pub fn queue_action(
        &self,
        unit: &str,
        name: &str,
        raw: &[String],
        timeout: u64,
    ) -> Result<i64> {
        jujube_core::names::parse_unit(unit)?;
        check_timeout("an action", timeout)?;
        self.write(|tx| {
            let u = alive_unit(tx, unit, "run actions")?;
            check_pending(tx, unit)?;
            let svc = crate::model::get_service(tx, &u.service)?;
            let charm = crate::model::get_charm(tx, &svc.charm_url)?;
            let params = charm
                .actions
                .params(name, raw)
                .map_err(|e| Error::Relation(format!("{e} (charm `{}`)", svc.charm_url)))?;
            let id: i64 = tx
                .prepare_cached(
                    "INSERT INTO runs (unit, argv, timeout, queued, action, params)
                     VALUES (?1, '[]', ?2, ?3, ?4, ?5) RETURNING id",
                )?
                .query_row(
                    (
                        unit,
                        timeout as i64,
                        crate::unix_now(),
                        name,
                        params.to_string(),
                    ),
                    |r| r.get(0),
                )?;
            tx.changed(ChangeKind::Run, unit)?;
            Ok(id)
        })
    }

    /// Task `id` (a queued action), answered or not.
    pub fn task(&self, id: i64) -> Result<Task> {
        self.read(|c| {
            type Row = (String, Option<String>, Option<String>, i64, Option<i32>, Option<String>, Option<String>, Option<String>);
            let row: Option<Row> = c
                .prepare_cached(
                    "SELECT unit, action, params, queued, code, stdout, stderr, results FROM runs WHERE id = ?1",
                )?
                .query_row([id], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?))
                })
                .optional()?;
            let missing = || Error::not_found(Entity::Task, id.to_string());
            let Some((unit, Some(action), params, queued, code, out, err, results)) = row else {
                return Err(missing());
            };
            let params = json_of("action parameters", params.as_deref().unwrap_or("{}"))?;
            let result = match code {
                None => None,
                Some(code) => Some(RunResult {
                    code,
                    stdout: out.unwrap_or_default(),
                    stderr: err.unwrap_or_default(),
                    action: results
                        .map(|r| {
                            serde_json::from_str(&r).map_err(|_| Error::Corrupt {
                                what: "action results",
                                value: r,
                            })
                        })
                        .transpose()?,
                }),
            };
            Ok(Task { id, unit, action, params, queued, result })
        })
    }

    /// The answer to run `id`: `None` while it is queued or running;
    /// [`Error::NotFound`] when it (or its unit) is gone.
    pub fn run_result(&self, id: i64) -> Result<Option<RunResult>> {
        // A command's output is for who may run commands: an admin.
        self.read_at(jujube_wire::client::Access::Admin, |c| {
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
                    action: None,
                })),
            }
        })
    }

    /// Forgets an answered run (the command that asked has printed it).
    /// An action stays for `show-task` (at most [`KEPT_ACTIONS`] a unit).
    pub fn forget_run(&self, id: i64) -> Result<()> {
        self.write_at(jujube_wire::client::Access::Admin, |tx| {
            tx.prepare_cached(
                "DELETE FROM runs WHERE id = ?1 AND code IS NOT NULL AND action IS NULL",
            )?
            .execute([id])?;
            Ok(())
        })
    }

    /// The runs queued for `unit` and not answered yet, oldest first.
    pub fn pending_runs(&self, unit: &str) -> Result<Vec<RunRequest>> {
        self.read(|c| pending_runs_in(c, unit))
    }
}

/// A run's or an action's (`what`'s) timeout: 1 s to [`MAX_RUN_TIMEOUT`].
fn check_timeout(what: &str, timeout: u64) -> Result<()> {
    if timeout == 0 {
        return Err(Error::Relation(format!(
            "{what}'s timeout must be at least one second"
        )));
    }
    if timeout > MAX_RUN_TIMEOUT {
        return Err(Error::Relation(format!(
            "{what}'s timeout of {timeout} s is more than {MAX_RUN_TIMEOUT} s (a day); give a shorter `--timeout`"
        )));
    }
    Ok(())
}

/// `unit`, refused unless Alive (a dying unit's agent is busy leaving).
fn alive_unit(c: &crate::sql::Connection, unit: &str, action: &'static str) -> Result<crate::Unit> {
    let u = get_unit(c, unit)?;
    if u.life != Life::Alive {
        return Err(Error::NotAlive {
            kind: Entity::Unit,
            id: unit.to_string(),
            life: u.life,
            action,
        });
    }
    Ok(u)
}

/// Refuses a run when [`MAX_PENDING_RUNS`] already wait for `unit`.
fn check_pending(c: &crate::sql::Connection, unit: &str) -> Result<()> {
    let pending: i64 = c
        .prepare_cached("SELECT count(*) FROM runs WHERE unit = ?1 AND code IS NULL")?
        .query_row([unit], |r| r.get(0))?;
    if pending >= MAX_PENDING_RUNS {
        return Err(Error::Relation(format!(
            "{pending} commands and actions already wait for unit `{unit}`'s agent, the most it queues; wait for some to finish (`jujube show-task`, `jujube status`)"
        )));
    }
    Ok(())
}

fn json_of(what: &'static str, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|_| Error::Corrupt {
        what,
        value: text.to_string(),
    })
}

pub(crate) fn pending_runs_in(c: &crate::sql::Connection, unit: &str) -> Result<Vec<RunRequest>> {
    let rows = c
        .prepare_cached(
            "SELECT id, argv, timeout, queued, action, params FROM runs
             WHERE unit = ?1 AND code IS NULL ORDER BY id",
        )?
        .query_map([unit], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, Option<String>>(5)?,
            ))
        })?
        .collect::<crate::sql::Result<Vec<_>>>()?;
    let now = crate::unix_now().max(0) as u64;
    let mut carried = 0usize;
    rows.into_iter()
        .take_while(|(_, argv, _, _, _, params)| {
            let first = carried == 0;
            carried += argv.len() + params.as_ref().map_or(0, String::len);
            first || carried <= MAX_VIEW_RUNS_BYTES
        })
        .map(|(id, argv, timeout, queued, action, params)| {
            let argv = serde_json::from_str(&argv).map_err(|_| Error::Corrupt {
                what: "run command",
                value: argv,
            })?;
            let action = match action {
                Some(name) => Some((
                    name,
                    json_of("action parameters", params.as_deref().unwrap_or("{}"))?,
                )),
                None => None,
            };
            Ok(RunRequest {
                id,
                argv,
                action,
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
    let results = match &result.action {
        Some(outcome) => {
            let text = serde_json::to_string(outcome).expect("plain data");
            if text.len() > MAX_RUN_OUTPUT {
                return Err(Error::Relation(format!(
                    "the action's results and log are {} bytes, more than the {MAX_RUN_OUTPUT} an action may answer; nothing was recorded: set less with `action-set`",
                    text.len()
                )));
            }
            Some(text)
        }
        None => None,
    };
    let n = tx
        .prepare_cached(
            "UPDATE runs SET code = ?1, stdout = ?2, stderr = ?3, results = ?4
             WHERE id = ?5 AND code IS NULL",
        )?
        .execute((
            result.code,
            bound_output(result.stdout.clone()),
            bound_output(result.stderr.clone()),
            results,
            id,
        ))?;
    if n > 0 {
        if result.action.is_some() {
            // The unit's answered actions beyond the newest KEPT_ACTIONS go.
            tx.prepare_cached(
                "DELETE FROM runs WHERE unit = ?1 AND action IS NOT NULL AND code IS NOT NULL
                   AND id NOT IN (SELECT id FROM runs WHERE unit = ?1 AND action IS NOT NULL
                                  AND code IS NOT NULL ORDER BY id DESC LIMIT ?2)",
            )?
            .execute((unit, KEPT_ACTIONS))?;
        } else {
            // Its answered commands beyond the newest KEPT_RUNS.
            tx.prepare_cached(
                "DELETE FROM runs WHERE unit = ?1 AND action IS NULL AND code IS NOT NULL
                   AND id NOT IN (SELECT id FROM runs WHERE unit = ?1 AND action IS NULL
                                  AND code IS NOT NULL ORDER BY id DESC LIMIT ?2)",
            )?
            .execute((unit, KEPT_RUNS))?;
        }
        tx.changed(ChangeKind::Run, unit)?;
    }
    Ok(())
}
