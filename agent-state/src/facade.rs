//! The in-process [`Facade`]: the store, scoped to one agent's entity.
//!
//! Every method first checks that what it is asked about lies in the
//! caller's scope (see `jujube_agent::api`), and refuses anything else — or
//! anything that does not exist — with `Unauthorized`. Writes then go to the
//! store as [`AgentOp`]s carrying the caller, where the store checks again,
//! inside the write's own transaction, that the caller is the responsible
//! agent: the facade's check is what the agent may *ask*, the store's is
//! what it may *do*, at the moment it does it.
//!
//! Writes from all agents go through one writer thread that group-commits
//! them ([`Store::apply_batch`]): each op stays its own atomic, checked unit,
//! but a hundred share one fsync. Reads run on the caller's task (they use
//! the store's reader connection, which never waits for the writer).
//!
//! Each write carries the store handle of the facade it came from, so that
//! agents a controller runs under its singletons lease write through the
//! lease's fenced handle ([`Store::fenced`]), and the API's agents beside
//! them do not: a controller that lost its lease cannot write its agents'
//! last reports over what the agents of the controller that took over
//! report, however late its writes reach the database. The writer commits
//! the ops of each handle together.

use crate::hub::{Hub, Key};
use async_trait::async_trait;
use jujube_agent::api::{
    AgentStatus, ApiError, ApiResult, Bag, CharmFile, CharmRef, Connector, EndpointView, ErrorCode,
    Facade, MachineView, NoticeStream, RelationView, RunRequest, RunResult, Tag, UnitRef, UnitView,
    WatchTarget,
};
use jujube_state::agents::deployer_of;
use jujube_state::{AgentOp, Caller, Relation, Stamp, Store, Unit};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// Ops committed together at most (each writes a handful of rows; the
/// largest transaction stays well under a thousand rows).
pub const WRITE_BATCH: usize = 64;

/// In-process agents in a pass at once: enough to keep the writer's
/// batches full (it queues four batches) with reads going on beside them; a
/// pass that runs a long hook holds its permit meanwhile.
pub const PASSES: usize = 512;

/// An op, the handle it is written through (fenced or not), the stamp its
/// agent sent it with (if it came through the API) and who waits.
type WriteRequest = (
    Store,
    Caller,
    Option<Stamp>,
    AgentOp,
    oneshot::Sender<ApiResult<()>>,
);

/// What every facade of one store shares.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) hub: Arc<Hub>,
    writes: mpsc::Sender<WriteRequest>,
    /// Agents in a pass at once (see `jujube_agent::Running`).
    passes: Arc<jujube_agent::Passes>,
    /// Where shipped logs go (none: shipped logs are refused); shared
    /// with the fenced views ([`Shared::through`]).
    pub(crate) sink: Arc<std::sync::OnceLock<Arc<crate::logsink::LogSink>>>,
}

impl Shared {
    /// Starts the writer thread (it ends when the last facade is dropped).
    pub(crate) fn new(store: Store, hub: Arc<Hub>, passes: usize) -> Arc<Shared> {
        let (writes, mut rx) = mpsc::channel::<WriteRequest>(4 * WRITE_BATCH);
        std::thread::Builder::new()
            .name("agent-writes".into())
            .spawn(move || {
                let mut batch = Vec::with_capacity(WRITE_BATCH);
                while let Some(first) = rx.blocking_recv() {
                    batch.push(first);
                    while batch.len() < WRITE_BATCH {
                        match rx.try_recv() {
                            Ok(r) => batch.push(r),
                            Err(_) => break,
                        }
                    }
                    // One transaction per handle (in practice one or two: the
                    // API's agents and the lease holder's); each agent's ops
                    // keep their order, as one agent writes through one
                    // handle.
                    while !batch.is_empty() {
                        let first = &batch[0].0;
                        let (fence, user) =
                            (first.fence().cloned(), first.user().map(str::to_string));
                        let (group, rest): (Vec<WriteRequest>, Vec<WriteRequest>) =
                            batch.drain(..).partition(|(s, ..)| {
                                s.fence() == fence.as_ref() && s.user() == user.as_deref()
                            });
                        commit(group);
                        batch = rest;
                    }
                }
            })
            .expect("spawn the agent writer thread");
        Arc::new(Shared {
            store,
            hub,
            writes,
            passes: jujube_agent::Passes::new(passes),
            sink: Default::default(),
        })
    }

    /// The same router, writer, pass gate and log sink, with the facades'
    /// writes (and direct writes such as a leadership claim) going through
    /// `store`, a handle on the same database: a controller's lease-fenced
    /// one.
    pub(crate) fn through(&self, store: Store) -> Arc<Shared> {
        Arc::new(Shared {
            store,
            hub: self.hub.clone(),
            writes: self.writes.clone(),
            passes: self.passes.clone(),
            sink: self.sink.clone(),
        })
    }
}

/// Commits `group`, written through one handle, and answers each op.
fn commit(mut group: Vec<WriteRequest>) {
    let ops: Vec<(Caller, Option<Stamp>, AgentOp)> = group
        .iter()
        .map(|(_, c, s, o, _)| (c.clone(), *s, o.clone()))
        .collect();
    match group[0].0.apply_stamped(&ops) {
        Ok(results) => {
            for ((_, caller, _, _, reply), r) in group.drain(..).zip(results) {
                let _ = reply.send(r.map_err(|e| api_error(&caller, e)));
            }
        }
        Err(e) => {
            warn!(error = %e, "agent write batch failed");
            // The batch's own failure: the database out of reach, or the
            // lease its agents ran under lost (see `code_of`).
            let err = ApiError::new(code_of(&e), e.to_string());
            for (.., reply) in group.drain(..) {
                let _ = reply.send(Err(err.clone()));
            }
        }
    }
}

/// Who the store takes an agent with `tag` for.
pub fn caller_of(tag: &Tag) -> Caller {
    match tag {
        Tag::Machine(id) => Caller::Machine(*id),
        Tag::Unit(u) => Caller::Unit(u.clone()),
    }
}

fn tag_of(caller: &Caller) -> Option<Tag> {
    match caller {
        Caller::Machine(id) => Some(Tag::Machine(*id)),
        Caller::Unit(u) => Some(Tag::Unit(u.clone())),
        Caller::Controller => None,
    }
}

/// What an error the store answered a whole write with is to an agent.
/// A lost lease is no refusal of what the agent asked (an agent takes a
/// refused hook commit for a failed hook): its controller gave up the
/// agents it ran, which stop, and another runs them.
fn code_of(e: &jujube_state::Error) -> ErrorCode {
    match e {
        jujube_state::Error::LeaseLost { .. } => ErrorCode::Unavailable,
        jujube_state::Error::Superseded { .. } => ErrorCode::Superseded,
        e if e.is_unavailable() => ErrorCode::Unavailable,
        e if e.is_refusal() => ErrorCode::Refused,
        _ => ErrorCode::Internal,
    }
}

/// A store error as the facade reports it. Not found is "not found or not
/// yours", like any out-of-scope call.
pub(crate) fn api_error(caller: &Caller, e: jujube_state::Error) -> ApiError {
    use jujube_state::Error as E;
    let code = match &e {
        E::NotFound { .. } | E::Unauthorized { .. } => ErrorCode::Unauthorized,
        e => code_of(e),
    };
    let message = match (&e, code) {
        (_, ErrorCode::Unauthorized) => match tag_of(caller) {
            Some(t) => format!("permission denied: `{t}`: {e}"),
            None => format!("permission denied: {e}"),
        },
        _ => e.to_string(),
    };
    ApiError::new(code, message)
}

pub use jujube_agent::charmdir::{charm_manifest, CharmEntry};

/// One charm restored at a time: each holds its archive in memory (at most
/// [`jujube_state::services::MAX_CHARM_ARCHIVE`]).
static RESTORING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Makes the directory of the charm kept at `path` from the archive the
/// state keeps of it, when this controller lacks it (another controller
/// kept the upload: `enable-ha`). A charm with no archive kept is left to
/// fail where it is read, naming its path.
fn restore_charm(store: &Store, path: &str) -> ApiResult<()> {
    let dir = std::path::Path::new(path);
    if path.is_empty() || dir.exists() {
        return Ok(());
    }
    let _one = RESTORING.lock().unwrap_or_else(|p| p.into_inner());
    if dir.exists() {
        return Ok(());
    }
    let internal = |e: jujube_state::Error| ApiError::new(ErrorCode::Internal, e.to_string());
    let Some(archive) = store.charm_archive(path).map_err(internal)? else {
        return Ok(());
    };
    jujube_agent::charmdir::restore(dir, &archive)?;
    tracing::info!(path, "restored a charm another controller kept");
    Ok(())
}

/// Every file under `root`, paths relative and `/`-separated (see
/// [`charm_manifest`] for symlinks and the bound).
fn charm_files(root: &std::path::Path) -> ApiResult<Vec<CharmFile>> {
    use base64::Engine;
    charm_manifest(root)?
        .into_iter()
        .map(|e| {
            let data = std::fs::read(&e.file)
                .map_err(|err| ApiError::new(ErrorCode::Internal, err.to_string()))?;
            Ok(CharmFile {
                path: e.path,
                mode: e.mode,
                data: base64::engine::general_purpose::STANDARD.encode(data),
            })
        })
        .collect()
}

/// The store, scoped to one agent. (Its `Caller` is made from the tag when
/// needed rather than kept: 200,000 agents each hold one of these.)
pub struct InProcess {
    tag: Tag,
    shared: Arc<Shared>,
    /// The stamp the agent sent this facade's call with (a facade made for
    /// one call of the API server); `None` for agents in this process.
    stamp: Option<Stamp>,
}

/// Makes in-process facades for the agents deployers start.
pub struct InProcessConnector(pub(crate) Arc<Shared>);

impl Connector for InProcessConnector {
    fn connect(&self, tag: &Tag) -> Arc<dyn Facade> {
        Arc::new(InProcess::new(self.0.clone(), tag.clone()))
    }

    fn passes(&self) -> Option<Arc<jujube_agent::Passes>> {
        Some(self.0.passes.clone())
    }
}

fn unit_ref(u: &Unit) -> UnitRef {
    UnitRef {
        name: u.name.clone(),
        life: u.life,
    }
}

impl InProcess {
    pub(crate) fn new(shared: Arc<Shared>, tag: Tag) -> InProcess {
        InProcess {
            tag,
            shared,
            stamp: None,
        }
    }

    /// The facade for one call an agent sent with `stamp`.
    pub(crate) fn stamped(shared: Arc<Shared>, tag: Tag, stamp: Stamp) -> InProcess {
        InProcess {
            tag,
            shared,
            stamp: Some(stamp),
        }
    }

    fn store(&self) -> &Store {
        &self.shared.store
    }

    fn denied(&self, what: impl std::fmt::Display) -> ApiError {
        ApiError::unauthorized(&self.tag, what)
    }

    fn err(&self, e: jujube_state::Error) -> ApiError {
        api_error(&caller_of(&self.tag), e)
    }

    fn is_machine(&self, id: i64) -> bool {
        self.tag == Tag::Machine(id)
    }

    fn is_unit(&self, name: &str) -> bool {
        matches!(&self.tag, Tag::Unit(u) if u == name)
    }

    /// The caller's own unit (unit agents only).
    fn own_unit(&self, what: impl std::fmt::Display) -> ApiResult<Unit> {
        let Tag::Unit(me) = &self.tag else {
            return Err(self.denied(what));
        };
        self.store().unit(me).map_err(|_| self.denied(what))
    }

    /// `unit`, if the caller deploys it (its machine's agent for a principal,
    /// its principal's agent for a subordinate).
    fn deployed_by_me(&self, unit: &str, what: impl std::fmt::Display) -> ApiResult<Unit> {
        match self.store().unit(unit) {
            Ok(u) if deployer_of(&u) == caller_of(&self.tag) => Ok(u),
            _ => Err(self.denied(what)),
        }
    }

    /// A relation the caller's unit's service is in.
    fn my_relation(
        &self,
        relation: i64,
        unit: &str,
        what: impl std::fmt::Display + Clone,
    ) -> ApiResult<Relation> {
        if !self.is_unit(unit) {
            return Err(self.denied(what));
        }
        let me = self.own_unit(what.clone())?;
        match self.store().relation(relation) {
            Ok(r) if r.endpoint_of(&me.service).is_some() => Ok(r),
            _ => Err(self.denied(what)),
        }
    }

    async fn write(&self, op: AgentOp) -> ApiResult<()> {
        let (tx, rx) = oneshot::channel();
        let unavailable = || ApiError::new(ErrorCode::Unavailable, "the agent writer has stopped");
        self.shared
            .writes
            .send((
                self.shared.store.clone(),
                caller_of(&self.tag),
                self.stamp,
                op,
                tx,
            ))
            .await
            .map_err(|_| unavailable())?;
        rx.await.map_err(|_| unavailable())?
    }
}

#[async_trait]
impl Facade for InProcess {
    fn tag(&self) -> &Tag {
        &self.tag
    }

    async fn watch(&self, target: WatchTarget) -> ApiResult<NoticeStream> {
        let keys = match &target {
            WatchTarget::Machine(id) if self.is_machine(*id) => vec![Key::Machine(*id)],
            WatchTarget::Unit(name) if self.is_unit(name) => {
                let u = self.own_unit(format!("watch unit `{name}`"))?;
                vec![Key::Unit(u.name.into()), Key::Service(u.service.into())]
            }
            WatchTarget::Scope { relation, unit } => {
                let what = format!("watch the scope of relation `{relation}` for unit `{unit}`");
                let rel = self.my_relation(*relation, unit, what.clone())?;
                let me = self.own_unit(what)?;
                let container = match rel.scope {
                    jujube_core::charm::Scope::Global => String::new(),
                    jujube_core::charm::Scope::Container => {
                        me.principal.clone().unwrap_or(me.name.clone())
                    }
                };
                vec![Key::Scope(Box::new((*relation, container.into())))]
            }
            other => return Err(self.denied(format!("watch {other:?}"))),
        };
        Ok(self.shared.hub.subscribe(keys))
    }

    async fn machine(&self, id: i64) -> ApiResult<MachineView> {
        if !self.is_machine(id) {
            return Err(self.denied(format!("read machine `{id}`")));
        }
        let (m, units) = self.store().machine_context(id).map_err(|e| self.err(e))?;
        Ok(MachineView {
            id,
            life: m.life,
            units: units.iter().map(unit_ref).collect(),
            api_addresses: self.shared.hub.api_addresses().to_vec(),
        })
    }

    async fn set_machine_status(&self, id: i64, status: AgentStatus, info: &str) -> ApiResult<()> {
        if !self.is_machine(id) {
            return Err(self.denied(format!("set the status of machine `{id}`")));
        }
        self.write(AgentOp::SetMachineAgentStatus {
            machine: id,
            status: status.as_str().into(),
            info: info.into(),
        })
        .await
    }

    async fn ensure_dead_machine(&self, id: i64) -> ApiResult<()> {
        if !self.is_machine(id) {
            return Err(self.denied(format!("set machine `{id}` dead")));
        }
        self.write(AgentOp::EnsureDeadMachine { machine: id }).await
    }

    async fn charm(&self, unit: &str) -> ApiResult<CharmRef> {
        // Its deployer, or the unit itself (to upgrade its charm): one
        // read, its deployer checked on it.
        let found = self.store().unit_charm(unit);
        if !self.is_unit(unit) {
            match &found {
                Ok((u, _, _)) if deployer_of(u) == caller_of(&self.tag) => {}
                _ => return Err(self.denied(format!("read the charm of unit `{unit}`"))),
            }
        }
        let (_, url, path) = found.map_err(|e| self.err(e))?;
        let store = self.store().clone();
        let at = path.clone();
        tokio::task::spawn_blocking(move || restore_charm(&store, &at))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))??;
        Ok(CharmRef { url, path })
    }

    async fn charm_files(&self, unit: &str) -> ApiResult<Vec<CharmFile>> {
        let charm = self.charm(unit).await?;
        let root = std::path::PathBuf::from(&charm.path);
        tokio::task::spawn_blocking(move || charm_files(&root))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    }

    async fn ensure_dead_unit(&self, unit: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            self.deployed_by_me(unit, format!("set unit `{unit}` dead"))?;
        }
        self.write(AgentOp::EnsureDeadUnit { unit: unit.into() })
            .await
    }

    async fn remove_unit(&self, unit: &str) -> ApiResult<()> {
        self.deployed_by_me(unit, format!("remove unit `{unit}`"))?;
        self.write(AgentOp::RemoveUnit { unit: unit.into() }).await
    }

    async fn set_unit_status(&self, unit: &str, status: AgentStatus, info: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            self.deployed_by_me(unit, format!("set the status of unit `{unit}`"))?;
        }
        self.write(AgentOp::SetUnitStatus {
            unit: unit.into(),
            status: status.as_str().into(),
            info: info.into(),
        })
        .await
    }

    async fn unit(&self, name: &str) -> ApiResult<UnitView> {
        if !self.is_unit(name) {
            return Err(self.denied(format!("read unit `{name}`")));
        }
        let c = self.store().unit_context(name).map_err(|e| self.err(e))?;
        Ok(UnitView {
            name: c.unit.name,
            life: c.unit.life,
            service: c.service.name,
            service_life: c.service.life,
            principal: c.unit.principal,
            principal_service: c.principal_service,
            relations: c
                .relations
                .into_iter()
                .map(|r| RelationView {
                    id: r.relation.id,
                    key: r.relation.key,
                    life: r.relation.life,
                    scope: r.relation.scope,
                    endpoints: r
                        .relation
                        .endpoints
                        .into_iter()
                        .map(|e| EndpointView {
                            service: e.service,
                            relation: e.relation,
                            role: e.role,
                        })
                        .collect(),
                    in_scope: r.in_scope,
                    belongs: r.belongs,
                })
                .collect(),
            subordinates: c.subordinates.iter().map(unit_ref).collect(),
            resolved: c.unit.resolved,
            force_upgrade: c.service.force_charm,
            leader: c.leader,
            leader_settings_version: c.service.leader_settings_version,
            machine: c.machine,
            zone: c.zone,
            ports: c.ports,
            update_status_ms: c.update_status_interval.map(|d| d.as_millis() as u64),
            charm_url: c.service.charm_url,
            runs: c
                .runs
                .into_iter()
                .map(|r| RunRequest {
                    id: r.id,
                    argv: r.argv,
                    timeout: r.timeout,
                    waited: r.waited,
                    action: r
                        .action
                        .map(|(name, params)| jujube_agent::api::ActionRequest { name, params }),
                })
                .collect(),
        })
    }

    async fn set_port(&self, unit: &str, port: &str, open: bool) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("open or close ports of unit `{unit}`")));
        }
        self.write(AgentOp::SetPort {
            unit: unit.into(),
            port: port.into(),
            open,
        })
        .await
    }

    async fn clear_resolved(&self, unit: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("clear the resolved mark of unit `{unit}`")));
        }
        self.write(AgentOp::ClearResolved { unit: unit.into() })
            .await
    }

    async fn ensure_dying_unit(&self, unit: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("destroy unit `{unit}`")));
        }
        self.write(AgentOp::EnsureDyingUnit { unit: unit.into() })
            .await
    }

    async fn enter_scope(
        &self,
        relation: i64,
        unit: &str,
        settings: Vec<(String, String)>,
    ) -> ApiResult<()> {
        self.my_relation(
            relation,
            unit,
            format!("enter the scope of relation `{relation}` for unit `{unit}`"),
        )?;
        self.write(AgentOp::EnterScope {
            relation,
            unit: unit.into(),
            settings,
        })
        .await
    }

    async fn finish_run(&self, unit: &str, id: i64, result: RunResult) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("answer run {id} of unit `{unit}`")));
        }
        self.write(AgentOp::FinishRun {
            unit: unit.into(),
            id,
            result: jujube_state::runs::RunResult {
                code: result.code,
                stdout: result.stdout,
                stderr: result.stderr,
                action: result.action.map(|a| jujube_state::runs::ActionOutcome {
                    results: a.results,
                    failed: a.failed,
                    log: a.log,
                }),
            },
        })
        .await
    }

    async fn leave_scope(&self, relation: i64, unit: &str) -> ApiResult<()> {
        self.my_relation(
            relation,
            unit,
            format!("leave the scope of relation `{relation}` for unit `{unit}`"),
        )?;
        self.write(AgentOp::LeaveScope {
            relation,
            unit: unit.into(),
        })
        .await
    }

    async fn scope_units(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<Vec<String>> {
        self.my_relation(
            relation,
            unit,
            format!("read the scope of relation `{relation}` for unit `{unit}`"),
        )?;
        self.store()
            .scope_units_seen_by(relation, unit, after)
            .map_err(|e| self.err(e))
    }

    async fn set_workload_status(
        &self,
        unit: &str,
        application: bool,
        status: &str,
        message: &str,
    ) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("set the workload status of unit `{unit}`")));
        }
        self.write(AgentOp::SetWorkloadStatus {
            unit: unit.into(),
            application,
            status: status.into(),
            message: message.into(),
        })
        .await
    }

    async fn workload_status(&self, unit: &str, application: bool) -> ApiResult<(String, String)> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("read the workload status of unit `{unit}`")));
        }
        self.store()
            .workload_status(unit, application)
            .map_err(|e| self.err(e))
    }

    async fn application_status(
        &self,
        unit: &str,
    ) -> ApiResult<jujube_agent::api::ApplicationStatus> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!(
                "read the application status of unit `{unit}`'s service"
            )));
        }
        let a = self
            .store()
            .application_status(unit)
            .map_err(|e| self.err(e))?;
        Ok(jujube_agent::api::ApplicationStatus {
            status: a.status,
            message: a.message,
            units: a
                .units
                .into_iter()
                .map(|(name, status, message)| (name, (status, message)))
                .collect(),
        })
    }

    async fn set_workload_version(&self, unit: &str, version: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!(
                "set the workload version of unit `{unit}`'s service"
            )));
        }
        self.write(AgentOp::SetWorkloadVersion {
            unit: unit.into(),
            version: version.into(),
        })
        .await
    }

    async fn is_leader(&self, unit: &str) -> ApiResult<bool> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("ask whether unit `{unit}` leads its service")));
        }
        self.store().claim_leadership(unit).map_err(|e| self.err(e))
    }

    async fn scope_settings(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<jujube_agent::api::ScopeSettings> {
        // Whoever may read the scope may read its members' settings: they
        // are units it sees now (`may_read_relation_settings`).
        self.my_relation(
            relation,
            unit,
            format!("read the scope of relation `{relation}` for unit `{unit}`"),
        )?;
        let s = self
            .store()
            .scope_settings_seen_by(relation, unit, after)
            .map_err(|e| self.err(e))?;
        Ok(jujube_agent::api::ScopeSettings {
            units: s.units,
            app: s.app,
        })
    }

    async fn service_config(
        &self,
        service: &str,
    ) -> ApiResult<BTreeMap<String, serde_json::Value>> {
        let what = format!("read the settings of service `{service}`");
        let me = self.own_unit(what.clone())?;
        if me.service != service {
            return Err(self.denied(what));
        }
        let settings = self
            .store()
            .service_settings(service)
            .map_err(|e| self.err(e))?;
        // An option with neither a value nor a default is there as null
        // (`config-get --all` lists it; without `--all` it is left out).
        Ok(settings
            .into_iter()
            .map(|s| {
                let v = s.value.or(s.option.default);
                (
                    s.key,
                    v.map_or(serde_json::Value::Null, |v| {
                        serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
                    }),
                )
            })
            .collect())
    }

    async fn relation_settings(
        &self,
        relation: i64,
        unit: &str,
    ) -> ApiResult<BTreeMap<String, String>> {
        let what = format!("read the settings of unit `{unit}` in relation `{relation}`");
        let Tag::Unit(me) = &self.tag else {
            return Err(self.denied(what));
        };
        let rel = self.my_relation(relation, me, what.clone())?;
        let readable = self
            .store()
            .may_read_relation_settings(&rel, me, unit)
            .map_err(|e| self.err(e))?;
        if !readable {
            return Err(self.denied(what));
        }
        self.store()
            .relation_settings(relation, unit)
            .map_err(|e| self.err(e))
    }

    async fn update_relation_settings(
        &self,
        relation: i64,
        unit: &str,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()> {
        self.my_relation(
            relation,
            unit,
            format!("change the settings of unit `{unit}` in relation `{relation}`"),
        )?;
        self.write(AgentOp::UpdateRelationSettings {
            relation,
            unit: unit.into(),
            changes,
        })
        .await
    }

    async fn ship_log(&self, unit: &str, text: &str) -> ApiResult<()> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("ship unit `{unit}`'s log")));
        }
        // Bounded as the sink writes it: each line gets the unit's name.
        let written = text.len() + text.lines().count() * (unit.len() + 3);
        if text.len() > jujube_agent::api::MAX_SHIPPED_LOG
            || written > 2 * jujube_agent::api::MAX_SHIPPED_LOG
        {
            return Err(ApiError::new(
                ErrorCode::Refused,
                format!(
                    "a shipped log is at most {} bytes a call",
                    jujube_agent::api::MAX_SHIPPED_LOG
                ),
            ));
        }
        let Some(sink) = self.shared.sink.get().cloned() else {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "this controller keeps no log sink",
            ));
        };
        let (unit, text) = (unit.to_string(), text.to_string());
        tokio::task::spawn_blocking(move || sink.append(&unit, &text))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
            .map_err(|e| {
                ApiError::new(
                    ErrorCode::Internal,
                    format!("cannot write the log sink: {e}"),
                )
            })
    }

    async fn goal_state(&self, unit: &str) -> ApiResult<jujube_agent::api::GoalState> {
        if !self.is_unit(unit) {
            return Err(self.denied(format!("read the goal state of unit `{unit}`")));
        }
        let g = self.store().goal_state(unit).map_err(|e| self.err(e))?;
        Ok(jujube_agent::api::GoalState {
            units: g.units,
            relations: g.relations,
        })
    }

    async fn bag(&self, unit: &str, bag: Bag) -> ApiResult<BTreeMap<String, String>> {
        let bag = state_bag(bag);
        if !self.is_unit(unit) {
            return Err(self.denied(format!("read {bag} as unit `{unit}`")));
        }
        self.store()
            .bag_seen_by(unit, &bag)
            .map_err(|e| self.err(e))
    }

    async fn update_bag(
        &self,
        unit: &str,
        bag: Bag,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()> {
        let bag = state_bag(bag);
        if !self.is_unit(unit) {
            return Err(self.denied(format!("change {bag} as unit `{unit}`")));
        }
        self.write(AgentOp::UpdateBag {
            unit: unit.into(),
            bag,
            changes,
        })
        .await
    }
}

fn state_bag(bag: Bag) -> jujube_state::bags::Bag {
    match bag {
        Bag::App { relation, service } => jujube_state::bags::Bag::App { relation, service },
        Bag::Leader => jujube_state::bags::Bag::Leader,
    }
}
