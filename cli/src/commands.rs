//! What a user's commands do beside single calls: `exec` and `run` wait
//! for the unit agent's answer, `show-task` renders a task, `wait` follows
//! the controller's progress — all through the [`Client`].

use crate::client::Client;
use crate::progress::Reporter;
use anyhow::{bail, Result};
use jujube_wire::client::{ClientCall, WaitState};
use jujube_wire::view::{RunResult, Task};
use std::io::Write;
use std::time::Duration;

/// The progress line of `wait`.
fn progress_line(p: &jujube_wire::view::Progress, stuck: &[String]) -> (String, String) {
    let mut msg = format!(
        "units {}/{} on started machines",
        p.units_on_started_machines, p.units
    );
    if p.machines_in_error > 0 {
        msg.push_str(&format!(", {} machine(s) in error", p.machines_in_error));
    }
    if let Some(first) = stuck.first() {
        msg.push_str(&format!("; waiting for: {first}"));
        if stuck.len() > 1 {
            msg.push_str(&format!(" (and {} more)", stuck.len() - 1));
        }
    }
    let line = format!(
        "{}/{} machines started, {msg}",
        p.machines_started, p.machines
    );
    (msg, line)
}

/// `jujube run UNIT -- CMD...`: queues the command for the unit's agent,
/// waits for its answer, prints its output (stdout to `out`, stderr to
/// stderr) and returns its exit status (1 when it could not run or was
/// killed). The unit's agent runs it in a hook context between hooks.
pub fn run_command(
    client: &Client,
    unit: &str,
    argv: &[String],
    timeout: Duration,
    out: &mut impl Write,
) -> Result<u8> {
    let id: i64 = client.call(ClientCall::QueueRun {
        unit: unit.to_string(),
        argv: argv.to_vec(),
        timeout: timeout.as_secs().max(1),
    })?;
    // The agent kills the command at `timeout`; a little longer for the
    // agent to pick it up and answer.
    let what = "the command".to_string();
    let result: RunResult = answer(unit, &what, timeout, "", || {
        client.call(ClientCall::RunResult { id })
    })?;
    let _ = client.call::<()>(ClientCall::ForgetRun { id });
    out.write_all(result.stdout.as_bytes())?;
    out.flush()?;
    eprint!("{}", result.stderr);
    Ok(match result.code {
        0..=255 => result.code as u8,
        _ => 1,
    })
}

/// How often a command waiting for an agent's answer asks again.
const ANSWER_POLL: Duration = Duration::from_millis(100);

/// Waits for `unit`'s agent to answer (`poll` gives the answer once there
/// is one): `timeout` for its run, 30 s more for the agent to pick it up
/// and answer. `what` names the request in errors, `hint` ends the timeout's.
fn answer<T>(
    unit: &str,
    what: &str,
    timeout: Duration,
    hint: &str,
    poll: impl Fn() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = std::time::Instant::now() + timeout + Duration::from_secs(30);
    loop {
        match poll() {
            Ok(Some(r)) => return Ok(r),
            Ok(None) => {}
            // The run's rows go with its unit.
            Err(e)
                if e.to_string().starts_with("unit `") && e.to_string().contains("not found") =>
            {
                bail!("unit `{unit}` was removed before it ran {what}")
            }
            Err(e) => return Err(e),
        }
        if std::time::Instant::now() >= deadline {
            bail!("unit `{unit}` did not run {what} within {}s; is its agent running? (`jujube status` shows its agent-status{hint})", timeout.as_secs() + 30);
        }
        std::thread::sleep(ANSWER_POLL);
    }
}

/// What `jujube run UNIT ACTION` asks for.
pub struct ActionRun<'a> {
    pub unit: &'a str,
    pub action: &'a str,
    pub params: &'a [String],
    pub timeout: Duration,
    pub background: bool,
}

/// `jujube run UNIT ACTION [KEY=VALUE]...`: queues the action (its
/// parameters checked against the charm's actions.yaml first: refused,
/// nothing queued), waits for its task and prints its results as YAML;
/// exits 1 when it failed. `--background` prints the task's id instead.
pub fn run_action(client: &Client, run: ActionRun<'_>, out: &mut impl Write) -> Result<u8> {
    let ActionRun {
        unit,
        action,
        params,
        timeout,
        background,
    } = run;
    let id: i64 = client.call(ClientCall::QueueAction {
        unit: unit.to_string(),
        action: action.to_string(),
        params: params.to_vec(),
        timeout: timeout.as_secs().max(1),
    })?;
    if background {
        writeln!(out, "Scheduled operation {id} with task {id}")?;
        writeln!(out, "Check operation status with 'jujube show-task {id}'")?;
        return Ok(0);
    }
    eprintln!(
        "Running operation {id} with 1 task\n  - task {id} on unit-{}\n\nWaiting for task {id}...",
        unit.replace('/', "-")
    );
    let what = format!("action `{action}` (task {id})");
    let later = format!("; `jujube show-task {id}` shows the task later");
    let task = answer(unit, &what, timeout, &later, || {
        let t: Task = client.call(ClientCall::Task { id })?;
        Ok(t.result.is_some().then_some(t))
    })?;
    let result = task.result.as_ref().expect("answered");
    let outcome = result.action.clone().unwrap_or_default();
    for (at, message) in &outcome.log {
        let time = jujube_core::time::format_utc(u64::try_from(*at).unwrap_or(0));
        eprintln!("{} {message}", time.get(11..).unwrap_or(&time));
    }
    let results = nest(&outcome.results);
    if results.as_object().is_some_and(|m| !m.is_empty()) {
        out.write_all(yaml_serde::to_string(&results)?.as_bytes())?;
    }
    out.write_all(result.stdout.as_bytes())?;
    out.flush()?;
    eprint!("{}", result.stderr);
    if task.status() == "failed" {
        bail!(
            "action `{action}` on unit `{unit}` failed: {} (task {id}; `jujube show-task {id}` shows it)",
            failure_message(result)
        );
    }
    Ok(0)
}

/// Why a task failed: what the action said with `action-fail`, else its
/// exit status.
fn failure_message(result: &RunResult) -> String {
    match result.action.as_ref().and_then(|a| a.failed.clone()) {
        Some(m) => m,
        None if result.code == -1 => result
            .stderr
            .trim()
            .trim_start_matches("error: ")
            .to_string(),
        None => format!("exit status {}", result.code),
    }
}

/// `action-set`'s dotted keys as nested maps (`detail.level=3` is
/// `detail: {level: "3"}`), as Juju shows them.
fn nest(results: &std::collections::BTreeMap<String, String>) -> serde_json::Value {
    let mut root = serde_json::Map::new();
    for (key, value) in results {
        let parts: Vec<&str> = key.split('.').collect();
        let mut node = &mut root;
        for part in &parts[..parts.len() - 1] {
            let next = node
                .entry(part.to_string())
                .or_insert_with(|| serde_json::Value::Object(Default::default()));
            if !next.is_object() {
                *next = serde_json::Value::Object(Default::default());
            }
            node = next.as_object_mut().expect("just made an object");
        }
        node.insert(
            parts[parts.len() - 1].to_string(),
            serde_json::Value::String(value.clone()),
        );
    }
    serde_json::Value::Object(root)
}

/// `jujube show-task ID`, as YAML (Juju's keys).
pub fn render_task(task: &Task) -> String {
    let time = |t: i64| {
        format!(
            "{} UTC",
            jujube_core::time::format_utc(u64::try_from(t).unwrap_or(0))
        )
    };
    let mut doc = serde_json::json!({
        "id": task.id.to_string(),
        "action": task.action,
        "unit": task.unit,
        "status": task.status(),
        "parameters": task.params,
        "enqueued": time(task.queued),
    });
    if let Some(r) = &task.result {
        let outcome = r.action.clone().unwrap_or_default();
        if task.status() == "failed" {
            doc["message"] = failure_message(r).into();
        }
        doc["results"] = nest(&outcome.results);
        doc["return-code"] = r.code.into();
        if !r.stdout.is_empty() {
            doc["stdout"] = r.stdout.clone().into();
        }
        if !r.stderr.is_empty() {
            doc["stderr"] = r.stderr.clone().into();
        }
        if !outcome.log.is_empty() {
            doc["log"] = outcome
                .log
                .iter()
                .map(|(at, m)| format!("{} {m}", time(*at)))
                .collect::<Vec<_>>()
                .into();
        }
    }
    yaml_serde::to_string(&doc).unwrap_or_default()
}

/// `jujube wait`: until nothing can make progress, or the timeout. Succeeds
/// only when everything converged without error; otherwise the error lists
/// every machine in error (and, on timeout, what is still stuck).
/// The controller answers each look, so it is at work: a timeout says
/// what holds things up.
pub fn wait(client: &Client, timeout: Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    let mut progress = Reporter::new("wait", true);
    loop {
        let state: WaitState = client.call(ClientCall::WaitState)?;
        let (s, p) = (state.stuck, state.progress);
        let (msg, line) = progress_line(&p, &s);
        progress.update(
            Some((p.machines_started as u64, p.machines as u64)),
            &msg,
            &line,
        );
        let timed_out = std::time::Instant::now() >= deadline;
        if s.is_empty() || timed_out {
            progress.finish(&line);
            let listed = state.errors;
            if timed_out && !s.is_empty() {
                bail!(
                    "timed out after {timeout:?}; still waiting: {}{}",
                    s.join("; "),
                    if listed.is_empty() {
                        String::new()
                    } else {
                        format!("\n{listed}")
                    }
                );
            }
            if !listed.is_empty() {
                bail!("{listed}");
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
