//! The unit agent: its unit's lifecycle duties (lifecycles.txt, "Agents"),
//! as one idempotent pass ([`UnitAgent::step`]) run whenever something it can
//! see changes.
//!
//! Alive:
//! - if its service is not Alive, or (a subordinate) no Alive
//!   container-scoped relation with its principal's service remains, it sets
//!   its unit Dying;
//! - it enters the scopes of the Alive relations of its service it belongs
//!   in (a principal entering a container-scoped relation creates its
//!   subordinate there; a subordinate enters only relations with its
//!   principal's service); it leaves the scopes of relations that are not
//!   Alive (which may remove the relation, and the counterpart service);
//! - as deployer of its subordinates: deploys the Alive ones, removes the
//!   undeployed non-Alive ones, recalls and removes the Dead ones.
//!
//! Dying: it leaves every scope, waits for its subordinates to be removed
//! (their agents set them Dead; it recalls and removes them), then sets its
//! unit Dead and stops for good. Its deployer then recalls and removes it.

use crate::api::{
    AgentStatus, ApiError, Connector, ErrorCode, Facade, RelationView, RunResult, Tag, UnitView,
    WatchTarget, MAX_SHIPPED_LOG,
};
use crate::deployer::{unit_dir_name, Deployer};
use crate::hooks::context::{HookContext, HookView, ToolServer};
use crate::hooks::runner::{self, CharmHooks, Hook, Outcome};
use crate::hooks::state::{digest, HookRecord, HookState, RelationState};
use crate::{Agent, Result, Running, Step};
use jujube_core::charm::Scope;
use jujube_core::Life;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::{debug, warn};

/// The most calls one shipping of a unit's log makes (the rest goes after
/// the next hook).
const SHIP_CALLS: usize = 16;

/// What of `chunk` (read from where shipping stands) one call ships: whole
/// lines (a line longer than a call is cut), as text within
/// [`MAX_SHIPPED_LOG`] even where invalid UTF-8 grows in decoding, and how
/// many bytes of the chunk that is; `None` when there is no whole line yet.
fn shippable(chunk: &[u8]) -> Option<(String, usize)> {
    let mut end = match chunk.iter().rposition(|&b| b == b'\n') {
        Some(i) => i + 1,
        None if chunk.len() >= MAX_SHIPPED_LOG => chunk.len(),
        None => return None,
    };
    loop {
        let text = String::from_utf8_lossy(&chunk[..end]);
        if text.len() <= MAX_SHIPPED_LOG {
            return Some((text.into_owned(), end));
        }
        // Fewer bytes: up to an earlier line's end, else half.
        end = chunk[..end - 1]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(end / 2, |i| i + 1)
            .max(1);
    }
}

pub struct UnitAgent {
    api: Arc<dyn Facade>,
    connector: Arc<dyn Connector>,
    machine_dir: Arc<Path>,
    /// Opened on the first pass that needs it (the directory scan is the
    /// agent's own work). Boxed, as `tools`: most units have no
    /// subordinates, and 100,000 idle agents each keep this struct.
    deployer: Option<Box<Deployer>>,
    /// Whether the directory was read for deployed subordinates since the
    /// agent started (see `reconcile_subordinates`).
    scanned: bool,
    reported: Option<(AgentStatus, Box<str>)>,
    /// What hooks have run: read at a pass's start, saved after each hook,
    /// let go when the agent goes idle (see `step`).
    hooks: Option<Box<HookState>>,
    tools: Option<Box<ToolServer>>,
    /// Which hooks the charm has, read when a pass first asks (see
    /// [`CharmHooks`]); let go with the pass, when something ran in the
    /// unit's context (`close_context`) and when the charm is laid.
    charm_hooks: Option<Box<CharmHooks>>,
    /// Relations whose scope it is in: watched for members and settings.
    /// (A boxed slice: a vector's capacity is a word more in each agent.)
    scopes: Box<[i64]>,
    /// config-changed runs once whenever the agent (re)starts: how
    /// charms-in-action.txt's "recovering from transient unit agent errors"
    /// happens (Juju's uniter does the same).
    ran_config_changed: bool,
    /// Whether it reported `started` since it began (see
    /// [`crate::startup`]).
    started: bool,
    /// When `update-status` runs next (see [`Due`]); `None` while the
    /// charm has no such hook or the unit has not started (no timer is
    /// kept then).
    update_status_at: Option<Due>,
}

/// A time to the second, in four bytes (every idle unit agent keeps one):
/// seconds after the process first asked for one, plus one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Due(std::num::NonZeroU32);

impl Due {
    fn base() -> tokio::time::Instant {
        static BASE: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(tokio::time::Instant::now)
    }

    /// `wait` from now, rounded up to the second.
    fn after(wait: std::time::Duration) -> Due {
        let base = Due::base();
        let at = tokio::time::Instant::now() + wait;
        let secs = at.saturating_duration_since(base).as_secs_f64().ceil() as u64 + 1;
        Due(std::num::NonZeroU32::new(u32::try_from(secs).unwrap_or(u32::MAX)).expect("at least 1"))
    }

    fn instant(self) -> tokio::time::Instant {
        Due::base() + std::time::Duration::from_secs(u64::from(self.0.get() - 1))
    }
}

/// How often `update-status` runs on a started unit unless the
/// environment sets `update-status-hook-interval`: Juju's default.
pub const UPDATE_STATUS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(300);

/// The next wait before `update-status`: the interval the view gives (see
/// [`UPDATE_STATUS_INTERVAL`]), drawn from 80% to 120% of it so that the
/// units of a machine (and of a controller) do not all run it at once.
fn update_status_wait(view: &UnitView) -> std::time::Duration {
    use std::hash::BuildHasher;
    let draw = std::collections::hash_map::RandomState::new().hash_one(0u8) % 1_000;
    update_status_interval(view).mul_f64(0.8 + 0.4 * draw as f64 / 1_000.0)
}

fn update_status_interval(view: &UnitView) -> std::time::Duration {
    view.update_status_ms
        .map_or(UPDATE_STATUS_INTERVAL, std::time::Duration::from_millis)
}

/// True when the unit must become Dying by its own agent's hand.
pub fn abandoned(view: &UnitView) -> bool {
    if view.service_life != Life::Alive {
        return true;
    }
    match &view.principal_service {
        Some(ps) => !view.relations.iter().any(|r| {
            r.life == Life::Alive
                && r.scope == Scope::Container
                && r.counterpart_of(&view.service) == Some(ps)
        }),
        None => false,
    }
}

/// `Ok(true)` when the call went through; `Ok(false)` when refused, or when
/// what it was about went meanwhile (the next notice brings whatever
/// explains it).
fn went_through(r: std::result::Result<(), ApiError>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.code, ErrorCode::Refused | ErrorCode::Unauthorized) => {
            debug!(error = %e, "refused for now");
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

impl UnitAgent {
    pub fn new(
        api: Arc<dyn Facade>,
        connector: Arc<dyn Connector>,
        machine_dir: Arc<Path>,
    ) -> UnitAgent {
        UnitAgent {
            api,
            connector,
            machine_dir,
            deployer: None,
            scanned: false,
            reported: None,
            hooks: None,
            tools: None,
            charm_hooks: None,
            scopes: Box::default(),
            ran_config_changed: false,
            started: false,
            update_status_at: None,
        }
    }

    /// The unit's name: its facade's tag (one copy, not two, for 100,000
    /// agents).
    pub fn name(&self) -> &str {
        match self.api.tag() {
            Tag::Unit(name) => name,
            Tag::Machine(_) => "",
        }
    }

    /// The unit's service: its name's part before the `/`.
    fn service(&self) -> &str {
        self.name().split('/').next().unwrap_or_default()
    }

    /// The unit's directory (its charm is in `charm/`).
    pub fn dir(&self) -> PathBuf {
        self.machine_dir.join(unit_dir_name(self.name()))
    }

    /// Starts the agent on the current tokio runtime; it runs until the
    /// unit is Dead or gone, or it is stopped.
    pub fn spawn(self) -> Running {
        crate::run::spawn_with(self)
    }

    async fn report(&mut self, status: AgentStatus, info: &str) -> Result<()> {
        if self
            .reported
            .as_ref()
            .is_some_and(|(s, i)| *s == status && **i == *info)
        {
            return Ok(());
        }
        let fitted = crate::api::fit_status_info(info);
        self.api
            .set_unit_status(self.name(), status, &fitted)
            .await?;
        self.reported = Some((status, info.into()));
        Ok(())
    }

    /// The unit's log (its hooks' output and `juju-log`), beside its
    /// directory so that it outlives the unit's recall:
    /// `<machine dir>/logs/unit-svc-N.log`.
    pub fn log_path(&self) -> PathBuf {
        self.machine_dir
            .join("logs")
            .join(format!("{}.log", unit_dir_name(self.name())))
    }

    /// Ships what its log gained since last time to the controller's log
    /// sink, whole lines in calls of at most [`MAX_SHIPPED_LOG`] bytes (at
    /// most [`SHIP_CALLS`] calls a time). A controller that keeps no sink or
    /// cannot be reached is tried again after the next hook: the offset —
    /// kept in `log.shipped` in the unit's directory, not in the agent,
    /// which 100,000 idle agents would each hold — moves only with what
    /// was shipped.
    async fn ship_log(&mut self) -> Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let path = self.log_path();
        let Ok(len) = std::fs::metadata(&path).map(|m| m.len()) else {
            return Ok(());
        };
        let mark = self.dir().join("log.shipped");
        let mut from: u64 = std::fs::read_to_string(&mark)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if from > len {
            // A new log (its file was replaced): from its start.
            from = 0;
        }
        for _ in 0..SHIP_CALLS {
            if from >= len {
                break;
            }
            let mut chunk = Vec::new();
            let read = std::fs::File::open(&path).and_then(|mut f| {
                f.seek(SeekFrom::Start(from))?;
                f.take(MAX_SHIPPED_LOG as u64).read_to_end(&mut chunk)
            });
            if read.is_err() {
                break;
            }
            let Some(text) = shippable(&chunk) else { break };
            let end = text.1;
            match self.api.ship_log(self.name(), &text.0).await {
                Ok(()) => {
                    from += end as u64;
                    std::fs::write(&mark, from.to_string()).map_err(|source| crate::Error::Io {
                        action: "write",
                        path: mark.clone(),
                        source,
                    })?;
                }
                Err(e) => {
                    tracing::debug!(unit = %self.name(), error = %e, "log not shipped yet");
                    break;
                }
            }
        }
        Ok(())
    }

    /// Whether this unit has a charm to run hooks from (a deployed unit).
    fn has_charm(&self) -> bool {
        self.dir().join("charm").is_dir()
    }

    /// Whether the charm has `hook` (what [`runner::program`] names
    /// exists), from [`CharmHooks`].
    fn has_hook(&mut self, hook: &Hook) -> bool {
        if hook.action.is_some() {
            return runner::program(&self.dir().join("charm"), hook).0.exists();
        }
        if self.charm_hooks.is_none() {
            self.charm_hooks = Some(Box::new(CharmHooks::read(&self.dir().join("charm"))));
        }
        self.charm_hooks
            .as_ref()
            .expect("just read")
            .has(&hook.name)
    }

    /// The record, read at the pass's start (see `step`).
    fn hook_state(&mut self) -> &mut HookState {
        self.hooks.get_or_insert_with(Default::default)
    }

    fn save_hooks(&mut self) -> Result<()> {
        let dir = self.dir();
        if let Some(h) = &mut self.hooks {
            h.save(&dir).map_err(|(path, source)| crate::Error::Io {
                action: "write",
                path,
                source,
            })?;
        }
        Ok(())
    }

    /// Runs one hook (one at a time: the agent's pass awaits it). `Ok(true)`
    /// when it succeeded or the charm has no such hook; `Ok(false)` when it
    /// failed — the unit is then in error and holds until resolved — or was
    /// not run because the agent is stopping: either way the pass goes no
    /// further.
    async fn run_hook(&mut self, relations: &BTreeMap<i64, String>, hook: Hook) -> Result<bool> {
        let dir = self.dir();
        // A hook the charm does not have is skipped without a trace: no
        // socket, no write (100,000 units of a charm without hooks stay
        // cheap). A charm with a `dispatch` has every hook. (No charm laid
        // yet: no hook either, without a stat of its own.)
        if !self.has_hook(&hook) {
            return Ok(true);
        }
        // Told where the unit runs (a subordinate's principal, the machine).
        let hook = hook.placed(&self.api.unit(self.name()).await?);
        // Held while the hook is recorded as running, to the record's
        // clearing: at most a slot's worth of hooks can be found
        // interrupted when the process dies.
        let _slot = runner::hook_slot().await;
        // Asked to stop (meanwhile, or during the hook before): this one
        // waits for the agent's next start, as every later one of the pass.
        if crate::run::stop_requested() {
            return Ok(false);
        }
        self.hook_state().running = Some(Box::new(HookRecord::from(&hook)));
        if let Err(e) = self.save_hooks() {
            // Not run: nothing may say it runs (the next save would write it).
            self.hook_state().running = None;
            return Err(e);
        }
        let (id, ctx, socket) = self.open_context(&hook, relations, None).await?;
        let log = self.log_path();
        let outcome = runner::run(&dir, &log, self.name(), &id, &socket, &hook).await;
        self.close_context().await;
        // Shipped again after the next hook if this fails: failing the pass
        // here would run the hook again.
        if let Err(e) = self.ship_log().await {
            debug!(unit = %self.name(), error = %e, "cannot ship the unit's log yet");
        }
        // What the hook set is written now; the store refusing it (a bound
        // the tool did not see coming) fails the hook, it is no agent error.
        let outcome = match outcome {
            Outcome::Missing | Outcome::Succeeded => match self.commit_context(&ctx).await {
                Err(crate::Error::Api(e)) if e.code == ErrorCode::Refused => {
                    Outcome::Failed(format!(
                        "hook \"{}\" succeeded but its relation settings were refused: {e}",
                        hook.name
                    ))
                }
                Err(e) => return Err(e),
                Ok(()) => outcome,
            },
            failed => failed,
        };
        match outcome {
            Outcome::Missing | Outcome::Succeeded => {
                if outcome == Outcome::Succeeded {
                    debug!(unit = %self.name(), hook = %hook.name, "hook ran");
                }
                self.hook_state().running = None;
                // A failed save fails the pass only once the caller has
                // recorded the hook as run (and saves again): the pass's
                // retry then saves first and never runs the hook again.
                if let Err(e) = self.save_hooks() {
                    debug!(unit = %self.name(), hook = %hook.name, error = %e, "hook ran; its record is not saved yet");
                }
                Ok(true)
            }
            Outcome::Failed(message) => {
                let h = self.hook_state();
                h.running = None;
                h.failed = Some(Box::new(HookRecord::from(&hook)));
                self.save_hooks()?;
                self.report(AgentStatus::Error, &message).await?;
                Ok(false)
            }
        }
    }

    /// Opens a hook context for `hook` on the unit's tool socket (listening
    /// only while something runs in a context: a socket per running hook,
    /// not per unit). Returns its id, the context and the socket's path.
    async fn open_context(
        &mut self,
        hook: &Hook,
        relations: &BTreeMap<i64, String>,
        action: Option<&serde_json::Value>,
    ) -> Result<(String, Arc<HookContext>, PathBuf)> {
        if self.tools.is_none() {
            let mut socket = self.dir().join("agent.socket");
            if socket.as_os_str().len() > 100 {
                // A unix socket path is limited to 107 bytes.
                socket = std::env::temp_dir().join(format!("jujube-{}.socket", digest(&socket)));
            }
            self.tools = Some(Box::new(ToolServer::start(&socket).map_err(|source| {
                crate::Error::Io {
                    action: "listen on",
                    path: socket.clone(),
                    source,
                }
            })?));
        }
        // Numbered for the whole process, not per agent: unique all the
        // same, and four bytes fewer in each of 100,000 idle agents.
        static CONTEXTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = CONTEXTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let id = format!("{}-{}-{}", self.name(), hook.name, n);
        let members = self.members(hook);
        let apps = self
            .hook_state()
            .relations
            .iter()
            .map(|(id, r)| (*id, r.app.clone()))
            .collect();
        let view = HookView {
            relation: hook.relation.clone(),
            remote: hook.remote.clone(),
            relations: relations.clone(),
            members,
            apps,
            action: action.cloned(),
        };
        let ctx = Arc::new(HookContext::new(
            id.clone(),
            self.name(),
            view,
            self.api.clone(),
            self.log_path(),
        ));
        let tools = self.tools.as_ref().expect("just started");
        tools.set(Some(ctx.clone())).await;
        Ok((id, ctx, tools.path.clone()))
    }

    /// What `relation-list` shows in `hook`'s context: per relation, the
    /// units whose `-joined` ran and that have not departed (the record of
    /// what the hooks saw, not the live scope). The hook's remote unit
    /// counts as joined from its own `-joined` on, and is gone in its
    /// `-departed`; a `-broken` relation has none (Juju's relationer).
    fn members(&mut self, hook: &Hook) -> BTreeMap<i64, Vec<String>> {
        let mut members: BTreeMap<i64, Vec<String>> = self
            .hook_state()
            .relations
            .iter()
            .map(|(id, r)| (*id, r.joined.keys().cloned().collect()))
            .collect();
        if let Some((rel, _)) = &hook.relation {
            let units = members.entry(*rel).or_default();
            let kind = hook.name.rsplit('-').next().unwrap_or("");
            match (kind, &hook.remote) {
                ("departed", Some(remote)) => units.retain(|u| u != remote),
                ("broken", _) => units.clear(),
                (_, Some(remote)) if !units.contains(remote) => units.push(remote.clone()),
                _ => {}
            }
        }
        members
    }

    async fn close_context(&mut self) {
        // What ran may have changed the charm's hooks.
        self.charm_hooks = None;
        if let Some(tools) = self.tools.take() {
            tools.set(None).await;
        }
    }

    /// Writes a context's `relation-set`s, now that what ran in it
    /// succeeded.
    async fn commit_context(&self, ctx: &HookContext) -> Result<()> {
        let pending = std::mem::take(&mut *ctx.pending.lock().await);
        for (rel, changes) in pending {
            self.api
                .update_relation_settings(rel, self.name(), changes.into_iter().collect())
                .await?;
        }
        let pending = std::mem::take(&mut *ctx.pending_app.lock().await);
        for (relation, changes) in pending {
            let bag = crate::api::Bag::App {
                relation,
                service: self.service().to_string(),
            };
            self.api
                .update_bag(self.name(), bag, changes.into_iter().collect())
                .await?;
        }
        Ok(())
    }

    /// Whether the service's charm is not the one laid in the unit's charm
    /// directory.
    fn charm_differs(&mut self, view: &UnitView) -> bool {
        if self.hook_state().charm.is_none() {
            let deployed = crate::deployer::deployed_charm(&self.dir());
            self.hook_state().charm = deployed.map(Into::into);
        }
        !view.charm_url.is_empty()
            && self.hook_state().charm.as_deref() != Some(view.charm_url.as_str())
    }

    /// Lays the service's current charm over the unit's charm directory:
    /// its files replace theirs, anything else there stays.
    async fn lay_charm(&mut self) -> Result<()> {
        self.charm_hooks = None;
        let charm = self.api.charm(self.name()).await?;
        crate::deployer::install_charm(&*self.api, self.name(), &charm, &self.dir()).await
    }

    /// `jujube run`: each queued command in turn, in a hook context of its
    /// own, between hooks (never during one), answered through the facade.
    /// Its `relation-set`s are written if it exits 0, as a hook's are.
    async fn run_commands(
        &mut self,
        view: &UnitView,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        if view.runs.is_empty() {
            return Ok(false);
        }
        for run in &view.runs {
            // `--timeout` counts from the request: what it waited behind a
            // hook is spent.
            let left = run.timeout.saturating_sub(run.waited);
            let result = if left == 0 {
                RunResult {
                    code: -1,
                    stdout: String::new(),
                    stderr: format!(
                        "error: the command did not start within its {}s timeout: the unit's agent was busy (a hook ran meanwhile); it was not run; try again, or give `--timeout` more time\n",
                        run.timeout
                    ),
                    action: None,
                }
            } else if self.has_charm() {
                let hook = match &run.action {
                    Some(a) => Hook::action(&a.name, run.id).placed(view),
                    None => Hook::unit("run").placed(view),
                };
                let argv = match &run.action {
                    Some(_) => {
                        let program = runner::program(&self.dir().join("charm"), &hook).0;
                        vec![program.to_string_lossy().into_owned()]
                    }
                    None => run.argv.clone(),
                };
                let params = run.action.as_ref().map(|a| &a.params);
                let (id, ctx, socket) = self.open_context(&hook, relations, params).await?;
                let (dir, log) = (self.dir(), self.log_path());
                let site = runner::Site {
                    unit_dir: &dir,
                    log: &log,
                    unit: self.name(),
                    context_id: &id,
                    socket: &socket,
                };
                let out =
                    runner::run_command(&site, &hook, &argv, std::time::Duration::from_secs(left))
                        .await;
                self.close_context().await;
                self.ship_log().await?;
                let action = match &ctx.action {
                    Some(a) => Some(std::mem::take(&mut *a.outcome.lock().await)),
                    None => None,
                };
                let mut out = out;
                if out.code == 0 && action.as_ref().is_none_or(|a| a.failed.is_none()) {
                    // What it set refused by the store (a bound, leadership
                    // lost): the run failed, as a hook would have.
                    match self.commit_context(&ctx).await {
                        Err(crate::Error::Api(e)) if e.code == ErrorCode::Refused => {
                            out.code = 1;
                            out.stderr
                                .push_str(&format!("error: what it set was refused: {e}\n"));
                        }
                        r => r?,
                    }
                }
                RunResult {
                    code: out.code,
                    stdout: out.stdout,
                    stderr: out.stderr,
                    action,
                }
            } else {
                RunResult {
                    code: -1,
                    stdout: String::new(),
                    stderr: format!(
                        "error: unit `{}` has no charm deployed yet; try again once `jujube wait` succeeds\n",
                        self.name()
                    ),
                    action: None,
                }
            };
            // An answer the store refuses (above its bound) is answered
            // without what the action said: else the run stays pending and
            // runs again on every pass until its timeout.
            match self.api.finish_run(self.name(), run.id, result).await {
                Err(e) if e.code == ErrorCode::Refused => {
                    let refused = RunResult {
                        code: 1,
                        stdout: String::new(),
                        stderr: format!("error: its answer was refused: {e}\n"),
                        action: run.action.as_ref().map(|_| crate::api::ActionOutcome {
                            failed: Some(format!("its answer was refused: {e}")),
                            ..Default::default()
                        }),
                    };
                    self.api.finish_run(self.name(), run.id, refused).await?;
                }
                r => r?,
            }
        }
        Ok(true)
    }

    /// install, config-changed, start — once, in that order — and
    /// config-changed again whenever the service's settings change.
    /// `Ok(false)`: a hook failed.
    async fn unit_hooks(
        &mut self,
        view: &UnitView,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        if !self.has_charm() {
            return Ok(true);
        }
        let config = digest(&self.api.service_config(&view.service).await?);
        // Saved after each hook that ran (a crash must not run it again);
        // hooks the charm lacks are recorded with one write at the end.
        let mut dirty = false;
        if !self.hook_state().installed {
            if !self.run_hook(relations, Hook::unit("install")).await? {
                return Ok(false);
            }
            self.hook_state().installed = true;
            dirty = self.save_if_ran("install")?;
        }
        // relation-created for the relations the unit was deployed into,
        // right after install (as Juju: before leader-elected,
        // config-changed and start); a relation added later gets its own
        // before the unit enters its scope (see `advance`).
        for rel in view
            .relations
            .iter()
            .filter(|r| r.life == Life::Alive && r.belongs)
        {
            // Most passes: nothing to do, and nothing to allocate.
            if self
                .hook_state()
                .relations
                .get(&rel.id)
                .is_some_and(|s| s.created)
            {
                continue;
            }
            if !self
                .relation_created(rel, &side_of(view, rel), relations)
                .await?
            {
                return Ok(false);
            }
        }
        // leader-elected once the unit became its service's leader (after
        // install, as Juju); a unit that lost leadership forgets it, so
        // that it runs again when it leads again.
        if view.leader != self.hook_state().leader {
            if view.leader
                && !self
                    .run_hook(relations, Hook::unit("leader-elected"))
                    .await?
            {
                return Ok(false);
            }
            self.hook_state().leader = view.leader;
            self.save_hooks()?;
        }
        // leader-settings-changed on the other units: once after install
        // (Juju runs it in the leader-elected's place) and whenever the
        // leader changes its settings.
        let version = (view.leader_settings_version as u32).wrapping_add(1);
        if !view.leader && self.hook_state().leader_settings != version {
            if !self
                .run_hook(relations, Hook::unit("leader-settings-changed"))
                .await?
            {
                return Ok(false);
            }
            self.hook_state().leader_settings = version;
            dirty = self.save_if_ran("leader-settings-changed")? || dirty;
        }
        // upgrade-charm when the service's charm changed: its files laid
        // over the charm directory (what the charm wrote there stays), the
        // hook, then config-changed.
        if self.hook_state().charm.is_none() {
            // Before its first upgrade: the charm it was deployed with
            // (read once, then kept in the record).
            let deployed = crate::deployer::deployed_charm(&self.dir());
            self.hook_state().charm = deployed.map(Into::into);
        }
        let have = self.hook_state().charm.clone();
        if !view.charm_url.is_empty() && have.as_deref() != Some(view.charm_url.as_str()) {
            self.lay_charm().await?;
            if !self
                .run_hook(relations, Hook::unit("upgrade-charm"))
                .await?
            {
                return Ok(false);
            }
            self.hook_state().charm = Some(view.charm_url.as_str().into());
            self.ran_config_changed = false;
            self.save_hooks()?;
        }
        if self.hook_state().config.as_deref() != Some(config.as_str()) || !self.ran_config_changed
        {
            if !self
                .run_hook(relations, Hook::unit("config-changed"))
                .await?
            {
                return Ok(false);
            }
            self.ran_config_changed = true;
            self.hook_state().config = Some(config.into());
            dirty = self.save_if_ran("config-changed")?;
        }
        if !self.hook_state().started {
            if !self.run_hook(relations, Hook::unit("start")).await? {
                return Ok(false);
            }
            self.hook_state().started = true;
            dirty = self.save_if_ran("start")?;
        }
        if dirty {
            self.save_hooks()?;
        }
        Ok(true)
    }

    /// `update-status` when it is due, on a started unit whose charm has
    /// it, with nothing else to do (Juju's uniter); the first is due an
    /// interval after the unit started (or its agent did). `Ok(false)`: the
    /// hook failed.
    async fn update_status(
        &mut self,
        view: &UnitView,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        if !self.hook_state().started || !self.has_hook(&Hook::unit("update-status")) {
            self.update_status_at = None;
            return Ok(true);
        }
        match self.update_status_at {
            Some(at) if at.instant() <= tokio::time::Instant::now() => {
                // The next one counted from this one's start, a failure
                // included: `resolved` does not run it again at once.
                self.update_status_at = Some(Due::after(update_status_wait(view)));
                self.run_hook(relations, Hook::unit("update-status")).await
            }
            // Due later than the interval allows (it was made shorter; the
            // hub passes every unit its view then): drawn again from the
            // new one, as Juju's uniter resets its timer. A longer one
            // takes effect from the next run.
            Some(at)
                if at.instant()
                    > tokio::time::Instant::now()
                        + update_status_interval(view).mul_f64(1.2)
                        + std::time::Duration::from_secs(1) =>
            {
                self.update_status_at = Some(Due::after(update_status_wait(view)));
                Ok(true)
            }
            Some(_) => Ok(true),
            None => {
                self.update_status_at = Some(Due::after(update_status_wait(view)));
                Ok(true)
            }
        }
    }

    /// `relation-created` for `rel`, once: the relation recorded first,
    /// with its remote application, and listed in the hook's context (ops
    /// looks the hook's relation up among `relation-ids`). `Ok(false)`: the
    /// hook failed.
    async fn relation_created(
        &mut self,
        rel: &RelationView,
        name: &str,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        let state = self.relation_entry(rel, name);
        if state.created {
            return Ok(true);
        }
        let app = state.app.clone();
        let mut known = relations.clone();
        known.insert(rel.id, name.to_string());
        let hook = Hook::about_app(
            rel.id,
            name,
            "created",
            Some(app.as_str()).filter(|a| !a.is_empty()),
        );
        if !self.run_hook(&known, hook).await? {
            return Ok(false);
        }
        self.relation_state(rel.id).created = true;
        self.save_hooks()?;
        Ok(true)
    }

    /// Brings the relation hooks of `rel` up to date with its scope:
    /// `-departed` for units gone, `-joined` then `-changed` for units new,
    /// `-changed` for units whose settings changed.
    async fn relation_hooks(
        &mut self,
        rel: &RelationView,
        name: &str,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        // Members and their settings in one read (one call over the API).
        let scope = crate::api::scope_settings_all(&*self.api, rel.id, self.name()).await?;
        let mut seen_now = scope.units;
        seen_now.sort_by(|a, b| a.0.cmp(&b.0));
        let remote: Vec<String> = seen_now.iter().map(|(u, _)| u.clone()).collect();
        let state = self.relation_entry(rel, name);
        let app = state.app.clone();
        let known = state.joined.clone();
        for gone in known.keys().filter(|u| !remote.contains(u)) {
            if !self.depart(rel.id, name, gone, relations).await? {
                return Ok(false);
            }
        }
        for (u, settings) in &seen_now {
            let settings = match settings {
                Some(s) => digest(s),
                // Beyond the one answer's bound: read on its own.
                None => digest(&self.api.relation_settings(rel.id, u).await?),
            };
            let seen = known.get(u);
            if seen.is_none()
                && !self
                    .run_hook(relations, Hook::relation(rel.id, name, "joined", Some(u)))
                    .await?
            {
                return Ok(false);
            }
            if seen.is_none() {
                // Joined, not yet changed: a retry starts at -changed.
                self.hook_state().join(rel.id, u, String::new());
                self.save_hooks()?;
            }
            if seen != Some(&settings) {
                if !self
                    .run_hook(relations, Hook::relation(rel.id, name, "changed", Some(u)))
                    .await?
                {
                    return Ok(false);
                }
                self.hook_state().join(rel.id, u, settings);
                self.save_hooks()?;
            }
        }
        // The remote application's settings: `-changed` with no remote
        // unit (Juju 2.7+), once they were set and whenever they change.
        if let Some((_, bag)) = scope.app {
            let seen = self.relation_state(rel.id).app_settings.clone();
            let now = digest(&bag);
            if seen.as_deref() != Some(now.as_str()) && !(seen.is_none() && bag.is_empty()) {
                let hook = Hook::about_app(rel.id, name, "changed", Some(&app));
                if !self.run_hook(relations, hook).await? {
                    return Ok(false);
                }
                self.relation_state(rel.id).app_settings = Some(now);
                self.save_hooks()?;
            }
        }
        Ok(true)
    }

    /// `jujube resolved` without `--retry`: the failed hook counts as run.
    async fn count_as_done(&mut self, hook: &HookRecord, view: &UnitView) -> Result<()> {
        let kind = hook.name.rsplit('-').next().unwrap_or("");
        match (hook.name.as_str(), &hook.relation, &hook.remote) {
            ("install", None, _) => self.hook_state().installed = true,
            ("start", None, _) => self.hook_state().started = true,
            ("stop", None, _) => self.hook_state().stopped = true,
            ("remove", None, _) => self.hook_state().removed = true,
            ("leader-elected", None, _) => self.hook_state().leader = true,
            ("leader-settings-changed", None, _) => {
                self.hook_state().leader_settings =
                    (view.leader_settings_version as u32).wrapping_add(1);
            }
            ("upgrade-charm", None, _) => {
                self.hook_state().charm = Some(view.charm_url.as_str().into());
                self.ran_config_changed = false;
            }
            ("config-changed", None, _) => {
                let config = digest(&self.api.service_config(&view.service).await?);
                self.hook_state().config = Some(config.into());
                // Done for this run of the agent too: without this the
                // once-per-start config-changed ran it again at once.
                self.ran_config_changed = true;
            }
            (_, Some((rel, _)), Some(remote)) if kind == "joined" => {
                self.hook_state().join(*rel, remote, String::new());
            }
            (_, Some((rel, _)), Some(remote)) if kind == "changed" => {
                let settings = digest(&self.api.relation_settings(*rel, remote).await?);
                self.hook_state().join(*rel, remote, settings);
            }
            // A -changed about the remote application's settings.
            (_, Some((rel, _)), None) if kind == "changed" => {
                // The first page carries it.
                let app = self.api.scope_settings(*rel, self.name(), None).await?.app;
                if let Some((_, bag)) = app {
                    self.relation_state(*rel).app_settings = Some(digest(&bag));
                }
            }
            (_, Some((rel, _)), Some(remote)) if kind == "departed" => {
                self.hook_state().depart(*rel, remote);
            }
            (_, Some((rel, _)), None) if kind == "created" => {
                self.relation_state(*rel).created = true;
            }
            (_, Some((rel, _)), None) if kind == "broken" => {
                self.hook_state().relations.remove(rel);
            }
            _ => {}
        }
        Ok(())
    }

    /// Saves the whole record now if `hook` exists (it ran), and then
    /// nothing is owed; otherwise a save is owed.
    fn save_if_ran(&mut self, hook: &str) -> Result<bool> {
        if self.has_hook(&Hook::unit(hook)) {
            self.save_hooks()?;
            Ok(false)
        } else {
            Ok(true)
        }
    }

    /// Whether one of [`LAST_HOOKS`] is still to run (a deployed,
    /// installed unit whose charm has it, and it has not run).
    fn last_hook_due(&mut self, hook: &str, ran: RanFlag) -> bool {
        self.hook_state().installed && !*ran(self.hook_state()) && self.has_hook(&Hook::unit(hook))
    }

    /// The record of `rel` (named `name` on this side), made if new, with
    /// its remote application as the relation now says.
    fn relation_entry(&mut self, rel: &RelationView, name: &str) -> &mut RelationState {
        let app = rel
            .counterpart_of(self.service())
            .unwrap_or_default()
            .to_string();
        let state = self
            .hook_state()
            .relations
            .entry(rel.id)
            .or_insert_with(|| RelationState {
                name: name.to_string(),
                created: false,
                ..RelationState::default()
            });
        state.app = app;
        state
    }

    fn relation_state(&mut self, id: i64) -> &mut RelationState {
        self.hook_state().relations.entry(id).or_default()
    }

    /// `-departed` for `gone`, then forgets it. `Ok(false)`: the hook failed.
    async fn depart(
        &mut self,
        rel: i64,
        name: &str,
        gone: &str,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        if !self
            .run_hook(relations, Hook::relation(rel, name, "departed", Some(gone)))
            .await?
        {
            return Ok(false);
        }
        self.hook_state().depart(rel, gone);
        self.save_hooks()?;
        Ok(true)
    }

    /// Before leaving a scope: `-departed` for every remote unit, then
    /// `-broken`, once.
    async fn break_relation(
        &mut self,
        rel: &RelationView,
        name: &str,
        relations: &BTreeMap<i64, String>,
    ) -> Result<bool> {
        if !self.has_charm() {
            return Ok(true);
        }
        let Some(state) = self.hook_state().relations.get(&rel.id).cloned() else {
            return Ok(true);
        };
        for gone in state.joined.keys() {
            if !self.depart(rel.id, name, gone, relations).await? {
                return Ok(false);
            }
        }
        let app = Some(state.app.as_str()).filter(|a| !a.is_empty());
        if !self
            .run_hook(relations, Hook::about_app(rel.id, name, "broken", app))
            .await?
        {
            return Ok(false);
        }
        self.hook_state().relations.remove(&rel.id);
        self.save_hooks()?;
        Ok(true)
    }

    /// The deployer's duties for the unit's subordinates. A deployer with
    /// nothing deployed is not kept: most units never have a subordinate,
    /// and 100,000 idle agents each kept one. Once the directory was read
    /// (after a start, for what an earlier run deployed), it is opened again
    /// only when there are subordinates.
    async fn reconcile_subordinates(
        &mut self,
        subordinates: &[crate::api::UnitRef],
    ) -> Result<bool> {
        if self.deployer.is_none() && self.scanned && subordinates.is_empty() {
            return Ok(false);
        }
        let acted = self.deployer()?.reconcile(subordinates).await?;
        self.scanned = true;
        if self.deployer.as_ref().is_some_and(|d| d.is_empty()) {
            self.deployer = None;
        }
        Ok(acted)
    }

    fn deployer(&mut self) -> Result<&mut Deployer> {
        if self.deployer.is_none() {
            let mut d = Deployer::open(
                self.api.clone(),
                self.connector.clone(),
                self.machine_dir.clone(),
            )?;
            d.start_agents();
            self.deployer = Some(Box::new(d));
        }
        Ok(self.deployer.as_mut().expect("just opened"))
    }
}

/// Where a unit's hook record says a hook ran.
type RanFlag = fn(&mut HookState) -> &mut bool;

/// The hooks a Dying unit runs last, in order, once every relation is
/// broken, each with where its record says it ran.
const LAST_HOOKS: [(&str, RanFlag); 2] =
    [("stop", |h| &mut h.stopped), ("remove", |h| &mut h.removed)];

/// The relation's name on the unit's side (`db`).
fn side_of(view: &UnitView, rel: &RelationView) -> String {
    rel.endpoints
        .iter()
        .find(|e| e.service == view.service)
        .map(|e| e.relation.clone())
        .unwrap_or_default()
}

impl crate::run::Driven for UnitAgent {
    fn drive(
        cell: std::sync::Arc<crate::run::Cell<Self>>,
        state: Box<crate::run::Looping<Self>>,
    ) -> futures_util::future::BoxFuture<'static, ()> {
        Box::pin(crate::run::drive(cell, state))
    }
}

impl Agent for UnitAgent {
    fn api(&self) -> &Arc<dyn Facade> {
        &self.api
    }

    fn target(&self) -> WatchTarget {
        WatchTarget::Unit(self.name().to_string())
    }

    fn passes(&self) -> Option<Arc<crate::Passes>> {
        self.connector.passes()
    }

    fn counts_start(&self) -> bool {
        true
    }

    fn wake_at(&self) -> Option<tokio::time::Instant> {
        self.update_status_at.map(Due::instant)
    }

    fn targets(&self) -> Vec<WatchTarget> {
        let mut t = vec![self.target()];
        t.extend(self.scopes.iter().map(|&relation| WatchTarget::Scope {
            relation,
            unit: self.name().to_string(),
        }));
        t
    }

    /// One pass over the record of what hooks have run, read first. An
    /// agent that goes idle lets it go: 100,000 idle units' records were
    /// 8 MB of the controller, and its next pass reads a file of a few
    /// hundred bytes again. One ahead of its files (a failed save) is kept
    /// until it is saved. A record that cannot be read fails the pass.
    async fn step(&mut self) -> Result<Step> {
        if self.hooks.is_none() {
            let record =
                HookState::load(&self.dir()).map_err(|(path, source)| crate::Error::Io {
                    action: "read",
                    path,
                    source,
                })?;
            self.hooks = Some(Box::new(record));
        }
        let step = self.advance().await;
        self.charm_hooks = None;
        if matches!(step, Ok(Step::Idle)) && self.hooks.as_ref().is_some_and(|h| !h.unsaved()) {
            self.hooks = None;
        }
        step
    }

    async fn failed(&mut self, message: &str) {
        let _ = self.report(AgentStatus::Failed, message).await;
    }

    async fn finish(&mut self) {
        // A record a failed save left behind: once more before the agent
        // ends (a hook recorded running would count as failed at its next
        // start, though it completed).
        if self.hooks.as_ref().is_some_and(|h| h.unsaved()) {
            if let Err(e) = self.save_hooks() {
                warn!(unit = %self.name(), error = %e, "the hook record is not saved");
            }
        }
        if let Some(d) = self.deployer.as_mut() {
            d.stop().await;
        }
        self.tools = None;
    }
}

impl UnitAgent {
    /// A pass (see [`Agent::step`]), its hook record read.
    async fn advance(&mut self) -> Result<Step> {
        // A record a failed pass could not save (a hook ran since): saved
        // before anything else is done, or this pass fails too.
        if self.hooks.as_ref().is_some_and(|h| h.unsaved()) {
            self.save_hooks()?;
        }
        let view = match self.api.unit(self.name()).await {
            Ok(v) => v,
            // Removed (or never ours): nothing left to do.
            Err(e) if e.is_unauthorized() => return Ok(Step::Done),
            Err(e) => return Err(e.into()),
        };
        let side = |rel: &RelationView| side_of(&view, rel);
        let in_scope: BTreeMap<i64, String> = view
            .relations
            .iter()
            .filter(|r| r.in_scope)
            .map(|r| (r.id, side(r)))
            .collect();
        // Commands run even on a unit whose hook failed: that is when a
        // user most wants to look around in its context.
        if self.run_commands(&view, &in_scope).await? {
            return Ok(Step::Again);
        }
        // A failed hook holds the unit, whatever its life, until resolved.
        if let Some(failed) = self.hook_state().failed.clone() {
            match view.resolved.as_deref() {
                Some("retry-hooks") => {
                    // Nothing recorded it as done: the pass runs it again.
                    self.hook_state().failed = None;
                }
                Some(_) => {
                    self.count_as_done(&failed, &view).await?;
                    self.hook_state().failed = None;
                }
                None if view.force_upgrade && self.charm_differs(&view) => {
                    // A forced upgrade from an error: the new charm laid
                    // down, the failed hook retried from it; no
                    // upgrade-charm hook (nor the config-changed after it),
                    // as the spec says of forced upgrades from an error.
                    self.lay_charm().await?;
                    self.hook_state().charm = Some(view.charm_url.as_str().into());
                    self.hook_state().failed = None;
                    self.save_hooks()?;
                    return Ok(Step::Again);
                }
                None => {
                    // No update-status while held (Juju's uniter): it is
                    // due again an interval after the unit is resolved.
                    self.update_status_at = None;
                    self.report(
                        AgentStatus::Error,
                        &format!("hook failed: \"{}\"", failed.name),
                    )
                    .await?;
                    // Held, but the deployer's duties run no hook: a Dead
                    // subordinate is still recalled and removed (and a new
                    // one deployed), as Juju's deployer works apart from
                    // the uniter.
                    let acted = self.reconcile_subordinates(&view.subordinates).await?;
                    return Ok(if acted { Step::Again } else { Step::Idle });
                }
            }
            self.save_hooks()?;
            self.api.clear_resolved(self.name()).await?;
            return Ok(Step::Again);
        }
        self.scopes = in_scope.keys().copied().collect();
        let mut acted = false;
        match view.life {
            Life::Dead => return Ok(Step::Done),
            Life::Alive => {
                // Before any hook: a unit whose service is going has no
                // business installing or reconfiguring itself.
                if abandoned(&view) && went_through(self.api.ensure_dying_unit(self.name()).await)?
                {
                    return Ok(Step::Again);
                }
                if !self.unit_hooks(&view, &in_scope).await? {
                    return Ok(Step::Idle);
                }
                if !self.started {
                    crate::startup::took(crate::startup::StartStep::HooksRun);
                }
                self.report(AgentStatus::Started, "").await?;
                if !self.started {
                    self.started = true;
                    crate::startup::took(crate::startup::StartStep::Reported);
                }
                for rel in &view.relations {
                    if rel.life == Life::Alive && !rel.in_scope && rel.belongs {
                        // Its addresses with it, in one transaction, so
                        // that the other side's -joined/-changed can
                        // always read them: what Juju's EnterScope puts
                        // in a unit's settings (`private-address`, and
                        // since 2.3 `ingress-address` and `egress-subnets`,
                        // which `ops` charms read).
                        let ip = runner::private_address();
                        let address = vec![
                            ("egress-subnets".into(), format!("{ip}/32")),
                            ("ingress-address".into(), ip.clone()),
                            ("private-address".into(), ip),
                        ];
                        acted |=
                            went_through(self.api.enter_scope(rel.id, self.name(), address).await)?;
                    } else if rel.life == Life::Alive && rel.in_scope {
                        if !self.relation_hooks(rel, &side(rel), &in_scope).await? {
                            return Ok(Step::Idle);
                        }
                    } else if rel.life != Life::Alive && rel.in_scope {
                        if !self.break_relation(rel, &side(rel), &in_scope).await? {
                            return Ok(Step::Idle);
                        }
                        acted |= went_through(self.api.leave_scope(rel.id, self.name()).await)?;
                    }
                }
                acted |= self.reconcile_subordinates(&view.subordinates).await?;
                if !acted && !self.update_status(&view, &in_scope).await? {
                    return Ok(Step::Idle);
                }
            }
            Life::Dying => {
                self.update_status_at = None;
                // `dying` is worth a write only if the unit stays Dying a
                // while: it is in a scope, has subordinates or a stop hook
                // to run. Otherwise it is Dead within this pass.
                // (Also when its last report was a failed pass: this one
                // went through, and `failed` would outlive it.)
                let lingers = view.relations.iter().any(|r| r.in_scope)
                    || !view.subordinates.is_empty()
                    || LAST_HOOKS
                        .iter()
                        .any(|&(hook, ran)| self.last_hook_due(hook, ran))
                    || matches!(self.reported, Some((AgentStatus::Failed, _)));
                if lingers {
                    self.report(AgentStatus::Dying, "").await?;
                }
                for rel in view.relations.iter().filter(|r| r.in_scope) {
                    if !self.break_relation(rel, &side(rel), &in_scope).await? {
                        return Ok(Step::Idle);
                    }
                    acted |= went_through(self.api.leave_scope(rel.id, self.name()).await)?;
                }
                acted |= self.reconcile_subordinates(&view.subordinates).await?;
                let in_scope = view.relations.iter().any(|r| r.in_scope);
                if !acted && !in_scope && view.subordinates.is_empty() {
                    // stop last: after every relation is broken.
                    // Without a stop hook nothing runs and nothing is
                    // recorded: a restart before Dead has nothing to run
                    // again (the write was half the controller's work while
                    // 100,000 hookless units went).
                    // Then remove, the unit's last hook (Juju 2.8+).
                    for (hook, ran) in LAST_HOOKS {
                        if !self.last_hook_due(hook, ran) {
                            continue;
                        }
                        // Reported before the hook runs (`lingers` may have
                        // been false on an earlier pass).
                        self.report(AgentStatus::Dying, "").await?;
                        if !self.run_hook(&BTreeMap::new(), Hook::unit(hook)).await? {
                            return Ok(Step::Idle);
                        }
                        *ran(self.hook_state()) = true;
                        self.save_hooks()?;
                    }
                    if went_through(self.api.ensure_dead_unit(self.name()).await)? {
                        return Ok(Step::Done);
                    }
                }
            }
        }
        Ok(if acted { Step::Again } else { Step::Idle })
    }
}

#[cfg(test)]
mod tests {
    use super::{shippable, MAX_SHIPPED_LOG};

    #[test]
    fn a_shipment_is_whole_lines_within_the_bound_even_when_decoding_grows_it() {
        assert_eq!(shippable(b"one\ntwo\nthr"), Some(("one\ntwo\n".into(), 8)));
        assert_eq!(shippable(b"no newline yet"), None);
        // A line longer than a call is cut at the bound.
        let long = vec![b'x'; MAX_SHIPPED_LOG];
        let (text, end) = shippable(&long).unwrap();
        assert_eq!((text.len(), end), (MAX_SHIPPED_LOG, MAX_SHIPPED_LOG));
        // Invalid bytes decode to three each: fewer bytes are shipped, and
        // what is shipped is counted as shipped, nothing more.
        let mut bad = vec![0xffu8; MAX_SHIPPED_LOG / 2];
        bad.push(b'\n');
        bad.extend(vec![0xffu8; MAX_SHIPPED_LOG / 2 - 2]);
        bad.push(b'\n');
        let (text, end) = shippable(&bad).unwrap();
        assert!(text.len() <= MAX_SHIPPED_LOG, "{}", text.len());
        assert!(end < bad.len());
        assert_eq!(String::from_utf8_lossy(&bad[..end]), text);
    }
}
