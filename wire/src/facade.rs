//! The facade: everything an agent may know and do, as a wire contract.
//!
//! An agent acts for one entity (its [`Tag`]) and sees the model only
//! through a [`Facade`] scoped to that entity:
//!
//! - a **machine agent** reads and changes its machine and the principal
//!   units assigned to it (it deploys them, and recalls and removes them);
//! - a **unit agent** reads and changes its unit, reads its service and the
//!   service's settings, the relations its service is in and the units it
//!   sees in their scopes (in a container-scoped relation only those of its
//!   own container), and deploys, recalls and removes its own subordinates.
//!
//! A call about any other entity is refused with [`ErrorCode::Unauthorized`]
//! — as is a call about an entity that does not exist, so that a refusal
//! tells nothing about what exists elsewhere ("not found or not yours").
//!
//! Everything crossing the facade is plain serde data, and every method is
//! one request and one answer, so that the remote implementation (an API
//! client) can be put in place of the in-process one without changing agent
//! code. Watches are streams of [`Notice`]s: "something you can see changed
//! at revision N" — never the change itself; the agent re-reads its view.

use async_trait::async_trait;
use futures_util::Stream;
use jujube_core::charm::{Role, Scope};
use jujube_core::Life;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;

/// Who an agent is: Juju's tags, `machine-1`, `unit-wordpress-0`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tag {
    Machine(i64),
    Unit(String),
}

impl Tag {
    pub fn unit(name: &str) -> Tag {
        Tag::Unit(name.to_string())
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tag::Machine(id) => write!(f, "machine-{id}"),
            Tag::Unit(name) => write!(f, "unit-{}", name.replace('/', "-")),
        }
    }
}

/// A scope's members with their settings, in one answer (`None`: beyond
/// the answer's bound; read it with `relation_settings`), and the remote
/// application's settings in the relation (its own application's in a peer
/// relation).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeSettings {
    pub units: Vec<(String, Option<BTreeMap<String, String>>)>,
    /// The remote application's name and settings.
    #[serde(default)]
    pub app: Option<(String, BTreeMap<String, String>)>,
}

/// What `status-get --application` answers the service's leader: the
/// service's workload status and message, and each unit's, by unit name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplicationStatus {
    pub status: String,
    pub message: String,
    pub units: BTreeMap<String, (String, String)>,
}

/// What `goal-state` answers: the unit's service's units and, per relation
/// endpoint, the related applications and their units, each with a status
/// (`active`, `dying`; `joined` for a related application).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoalState {
    pub units: BTreeMap<String, String>,
    pub relations: BTreeMap<String, BTreeMap<String, String>>,
}

/// A databag the service's leader writes (see `jujube_state::bags`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bag {
    /// `service`'s application settings in `relation` (`relation-get
    /// --app`, `relation-set --app`).
    App { relation: i64, service: String },
    /// The service's leader settings (`leader-get`, `leader-set`).
    Leader,
}

/// What an agent reports about itself (`agent-status` in `jujube status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentStatus {
    Started,
    /// Carrying out its entity's Dying duties.
    Dying,
    /// Held by a failed hook until `jujube resolved`; the info says which.
    Error,
    /// Its last pass failed for something other than a hook (the API out
    /// of reach, a deploy or a write on its machine failing); it retries
    /// by itself, and the info says why. Juju's agent status `failed`: not
    /// `error`, which `wait` reports as needing a user and `resolved`
    /// acts on.
    Failed,
}

impl AgentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentStatus::Started => "started",
            AgentStatus::Dying => "dying",
            AgentStatus::Error => "error",
            AgentStatus::Failed => "failed",
        }
    }
}

/// A unit as its deployer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRef {
    pub name: String,
    pub life: Life,
}

/// A machine and the principal units assigned to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineView {
    pub id: i64,
    pub life: Life,
    pub units: Vec<UnitRef>,
    /// Where the controllers serve the API, as they record it (every
    /// controller's addresses, in machine order): an agent given these
    /// follows them as controllers are added (its machine's watch tells it
    /// when they change).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_addresses: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointView {
    pub service: String,
    pub relation: String,
    pub role: Role,
}

/// A relation of the unit's service, and whether the unit is in its scope
/// (as the store records it: scope membership is never guessed from local
/// files, which the spec calls "a pretty serious BUG").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelationView {
    pub id: i64,
    pub key: String,
    pub life: Life,
    pub scope: Scope,
    pub endpoints: Vec<EndpointView>,
    pub in_scope: bool,
    /// Whether the unit belongs in the scope (the store's rule: a
    /// subordinate joins a container-scoped relation with its principal's
    /// service or with another subordinate service).
    #[serde(default = "yes")]
    pub belongs: bool,
}

fn yes() -> bool {
    true
}

impl RelationView {
    /// The other service (the same one in a peer relation).
    pub fn counterpart_of(&self, service: &str) -> Option<&str> {
        self.endpoints
            .iter()
            .find(|e| e.service != service)
            .or_else(|| self.endpoints.iter().find(|e| e.service == service))
            .map(|e| e.service.as_str())
    }
}

/// Everything a unit agent decides on, as one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitView {
    pub name: String,
    pub life: Life,
    pub service: String,
    pub service_life: Life,
    /// The principal unit and its service, for a subordinate.
    pub principal: Option<String>,
    pub principal_service: Option<String>,
    pub relations: Vec<RelationView>,
    pub subordinates: Vec<UnitRef>,
    /// After `jujube resolved` on a failed hook: `retry-hooks` or
    /// `no-hooks`, until the agent clears it.
    #[serde(default)]
    pub resolved: Option<String>,
    /// `jujube run` requests for the unit, oldest first.
    #[serde(default)]
    pub runs: Vec<RunRequest>,
    /// The charm its service runs now: a unit whose charm directory holds
    /// another one upgrades it (`upgrade-charm`).
    #[serde(default)]
    pub charm_url: String,
    /// `charm_url` was set by `upgrade-charm --force`: a unit held by a
    /// failed hook lays it down and retries the hook from it.
    #[serde(default)]
    pub force_upgrade: bool,
    /// The unit leads its service (`leader-elected` runs when it becomes
    /// leader).
    #[serde(default)]
    pub leader: bool,
    /// Moves when the leader changes the leader settings
    /// (`leader-settings-changed` runs on the other units).
    #[serde(default)]
    pub leader_settings_version: i64,
    /// The machine it runs on (`JUJU_MACHINE_ID`) and its availability
    /// zone (`JUJU_AVAILABILITY_ZONE`).
    #[serde(default)]
    pub machine: Option<i64>,
    #[serde(default)]
    pub zone: Option<String>,
    /// The ports and ranges the unit opened (`opened-ports`).
    #[serde(default)]
    pub ports: Vec<String>,
    /// Milliseconds between `update-status` hooks, when the environment
    /// sets `update-status-hook-interval` (else the agent's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_status_ms: Option<u64>,
}

/// A command `jujube run` asked the unit's agent to run in a hook context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub id: i64,
    pub argv: Vec<String>,
    /// Seconds before the agent kills it, counted from when it was queued.
    pub timeout: u64,
    /// Seconds it has waited (behind a running hook, say), by the
    /// controller's clock when the view was read.
    #[serde(default)]
    pub waited: u64,
    /// An action (`jujube run UNIT ACTION`) instead of a command: its name
    /// and its checked parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ActionRequest>,
}

/// An action to run, as the store checked it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRequest {
    pub name: String,
    /// A JSON object, defaults filled in.
    pub params: serde_json::Value,
}

/// What a run printed and exited with (`-1`: killed or could not start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunResult {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// For an action: what it said with the action tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ActionOutcome>,
}

/// What an action said with `action-set`, `action-fail` and `action-log`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionOutcome {
    /// `action-set`'s results, keys dotted as set (`detail.level`).
    pub results: BTreeMap<String, String>,
    /// `action-fail`'s message: the action failed.
    pub failed: Option<String>,
    /// `action-log`'s messages with their unix time.
    pub log: Vec<(i64, String)>,
}

impl UnitView {
    pub fn is_subordinate(&self) -> bool {
        self.principal.is_some()
    }
}

/// Where a unit's charm is, for its deployer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CharmRef {
    pub url: String,
    pub path: String,
}

/// One file of a charm, for a deployer that cannot read the charm where
/// the controller keeps it (an agent on another machine).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CharmFile {
    /// Relative to the charm's root, `/`-separated, never `..`.
    pub path: String,
    /// Unix permission bits (hooks are executable).
    pub mode: u32,
    /// The contents, base64.
    pub data: String,
}

/// The most an action's `action-set` results may hold (as JSON); with its
/// log (at most 256 KiB) it stays within what the store keeps of a run.
pub const MAX_ACTION_RESULTS_BYTES: usize = 512 << 10;

/// The most a charm's files may add up to over the API.
pub const MAX_CHARM_BYTES: usize = 8 << 20;

/// The most of its log a unit agent ships in one call.
pub const MAX_SHIPPED_LOG: usize = 64 << 10;

/// The most a unit's settings in one relation may hold, as JSON (the
/// store refuses more at the write; `relation-set` refuses it at once).
pub const MAX_RELATION_SETTINGS_BYTES: usize = 256 << 10;

/// The most members one answer of [`Facade::scope_units`] or
/// [`Facade::scope_settings`] lists: a larger scope is read in pages, so
/// that no answer (nor what the controller holds to make it) grows with a
/// relation's size.
pub const MAX_SCOPE_MEMBERS: usize = 1000;

/// The most settings text one [`Facade::scope_settings`] answer carries,
/// and [`scope_settings_all`] keeps over all its pages: members beyond it
/// come named, without settings (read them with `relation_settings`).
pub const MAX_SCOPE_SETTINGS_BYTES: usize = 1 << 20;

/// Every page of [`Facade::scope_settings`], gathered: the whole scope
/// (read page by page, each its own snapshot; a scope notice after a
/// change brings a new read) and the remote application's settings from
/// the first page. Settings are kept until they pass
/// [`MAX_SCOPE_SETTINGS_BYTES`] over all pages, as in one answer: later
/// members are kept without theirs, so a scope of any size costs its
/// reader the members' names and at most that much settings.
pub async fn scope_settings_all<F: Facade + ?Sized>(
    facade: &F,
    relation: i64,
    unit: &str,
) -> ApiResult<ScopeSettings> {
    let mut all = facade.scope_settings(relation, unit, None).await?;
    let mut carried: usize = all.units.iter().map(|(_, s)| settings_size(s)).sum();
    let mut full = all.units.len() >= MAX_SCOPE_MEMBERS;
    while full {
        let Some(after) = all.units.last().map(|(u, _)| u.clone()) else {
            break;
        };
        let page = facade.scope_settings(relation, unit, Some(&after)).await?;
        full = page.units.len() >= MAX_SCOPE_MEMBERS;
        // A page holding its own cursor did not move past it (a server
        // that ignores it answers the first page again): the read ends
        // rather than repeating it.
        if page.units.is_empty() || page.units.iter().any(|(u, _)| *u == after) {
            break;
        }
        for (u, settings) in page.units {
            let size = settings_size(&settings);
            let settings = if carried + size <= MAX_SCOPE_SETTINGS_BYTES {
                carried += size;
                settings
            } else {
                None
            };
            all.units.push((u, settings));
        }
    }
    Ok(all)
}

/// About what a member's settings take as text (keys, values and the
/// JSON around each pair).
fn settings_size(settings: &Option<BTreeMap<String, String>>) -> usize {
    settings.as_ref().map_or(0, |s| {
        2 + s.iter().map(|(k, v)| k.len() + v.len() + 6).sum::<usize>()
    })
}

/// The most an agent's status message (`set_unit_status`,
/// `set_machine_status`) may hold; the store refuses more at the write, and
/// agents cut their own messages to it ([`fit_status_info`]).
pub const MAX_STATUS_INFO_BYTES: usize = 2048;

/// `info` cut to [`MAX_STATUS_INFO_BYTES`] at a character boundary, ending
/// in `…` when cut: for messages an agent makes of errors it did not write.
pub fn fit_status_info(info: &str) -> std::borrow::Cow<'_, str> {
    if info.len() <= MAX_STATUS_INFO_BYTES {
        return std::borrow::Cow::Borrowed(info);
    }
    let end = char_floor(info, MAX_STATUS_INFO_BYTES - '…'.len_utf8());
    std::borrow::Cow::Owned(format!("{}…", &info[..end]))
}

/// The largest character boundary of `s` at or below `at`: where to cut
/// `s` to at most `at` bytes.
pub fn char_floor(s: &str, at: usize) -> usize {
    let mut end = at.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// What a watch names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WatchTarget {
    /// The machine's life and the principals assigned to it.
    Machine(i64),
    /// The unit's life, its service (life, settings, relations), those
    /// relations' lives, and its subordinates.
    Unit(String),
    /// Membership and settings of the units `unit` sees in a relation scope.
    Scope { relation: i64, unit: String },
}

/// "Something you can see changed": re-read your view. `resync` says that
/// changes were lost (the feed was pruned past them); re-read everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    pub revision: u64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resync: bool,
}

pub type NoticeStream = Pin<Box<dyn Stream<Item = Notice> + Send>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// Out of the caller's scope, or does not exist.
    Unauthorized,
    /// The caller's credential was refused (wrong, replaced, or its entity
    /// removed): it says nothing about any entity, and an agent refused so
    /// is not done — it waits for a new credential.
    Unauthenticated,
    /// A rule of the model said no; nothing changed.
    Refused,
    /// Try again later (the store is busy, the connection dropped).
    Unavailable,
    /// The call was sent and its connection lost before the answer: it may
    /// have been done. Never sent again by itself (see
    /// `ClientCall::resendable`): an add-unit done and sent again would add
    /// twice.
    Unanswered,
    /// A write sent before a later one of the same agent was applied (or
    /// the agent took a new incarnation since): refused, changing nothing
    /// (see [`STAMP_HEADER`](crate::calls::STAMP_HEADER)).
    Superseded,
    Internal,
}

/// An error as it crosses the facade.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
        }
    }

    pub fn unauthorized(caller: &Tag, what: impl fmt::Display) -> ApiError {
        ApiError::new(
            ErrorCode::Unauthorized,
            format!("permission denied: `{caller}` cannot {what}"),
        )
    }

    pub fn is_unauthorized(&self) -> bool {
        self.code == ErrorCode::Unauthorized
    }
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;

/// The agent facade. Every argument and result is serde data; every method
/// is one request/answer. Implementations refuse anything outside the scope
/// of [`Facade::tag`] with [`ErrorCode::Unauthorized`].
#[async_trait]
pub trait Facade: Send + Sync + 'static {
    /// The entity this facade acts for.
    fn tag(&self) -> &Tag;

    /// Notices whenever something the target covers changes. Subscribing
    /// happens before this returns, so a view read afterwards misses nothing.
    async fn watch(&self, target: WatchTarget) -> ApiResult<NoticeStream>;

    // -- machine agents --
    async fn machine(&self, id: i64) -> ApiResult<MachineView>;
    /// `info` at most [`MAX_STATUS_INFO_BYTES`].
    async fn set_machine_status(&self, id: i64, status: AgentStatus, info: &str) -> ApiResult<()>;
    async fn ensure_dead_machine(&self, id: i64) -> ApiResult<()>;

    // -- deployers: a machine agent for its principals, a unit agent for
    //    its subordinates --
    /// The unit's charm: for its deployer, or the unit itself (which
    /// upgrades its charm directory when its service's charm changes).
    async fn charm(&self, unit: &str) -> ApiResult<CharmRef>;
    /// The charm's files, for a deployer that cannot read [`CharmRef::path`]
    /// (at most [`MAX_CHARM_BYTES`]; a symlink to a file in the charm comes
    /// as a copy of it, others are refused).
    async fn charm_files(&self, unit: &str) -> ApiResult<Vec<CharmFile>>;
    /// For the unit itself, or its deployer when it never deployed it.
    async fn ensure_dead_unit(&self, unit: &str) -> ApiResult<()>;
    async fn remove_unit(&self, unit: &str) -> ApiResult<()>;
    /// For the unit itself (which marks its agent started), or its deployer
    /// reporting a failed deployment. `info` at most
    /// [`MAX_STATUS_INFO_BYTES`].
    async fn set_unit_status(&self, unit: &str, status: AgentStatus, info: &str) -> ApiResult<()>;

    // -- unit agents --
    async fn unit(&self, name: &str) -> ApiResult<UnitView>;
    /// Sets the caller's Alive unit Dying when its service is not Alive or,
    /// for a subordinate, no Alive container-scoped relation with its
    /// principal's service remains (refused otherwise).
    async fn ensure_dying_unit(&self, unit: &str) -> ApiResult<()>;
    /// The unit's agent acted on `jujube resolved`.
    async fn clear_resolved(&self, unit: &str) -> ApiResult<()>;
    /// A hook's `open-port` (`open`) or `close-port`; `port` is `N/tcp` or
    /// `N/udp`.
    async fn set_port(&self, unit: &str, port: &str, open: bool) -> ApiResult<()>;
    /// Enters the scope with `settings` as the unit's first settings in it
    /// (its `private-address`), in one transaction.
    async fn enter_scope(
        &self,
        relation: i64,
        unit: &str,
        settings: Vec<(String, String)>,
    ) -> ApiResult<()>;
    async fn leave_scope(&self, relation: i64, unit: &str) -> ApiResult<()>;
    /// The units `unit` sees in the relation's scope (its counterparts, in
    /// its own container for a container-scoped relation), in unit order:
    /// a page of at most [`MAX_SCOPE_MEMBERS`] after the unit named
    /// `after` (from the first for none). A full page may have more after
    /// its last: ask again after it.
    async fn scope_units(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<Vec<String>>;
    /// The service's settings with defaults applied, as JSON values; an
    /// option with neither a value nor a default is null.
    async fn service_config(&self, service: &str)
        -> ApiResult<BTreeMap<String, serde_json::Value>>;
    /// `status-set`: the unit's workload status, or (`application`) its
    /// service's, which only the service's leader may set.
    async fn set_workload_status(
        &self,
        unit: &str,
        application: bool,
        status: &str,
        message: &str,
    ) -> ApiResult<()>;
    /// `status-get`: the unit's (or its service's) workload status and
    /// message.
    async fn workload_status(&self, unit: &str, application: bool) -> ApiResult<(String, String)>;
    /// `status-get --application`: the service's workload status and its
    /// units', for the service's leader only (at most
    /// `jujube_state::agents::MAX_APPLICATION_STATUS_UNITS` units).
    async fn application_status(&self, unit: &str) -> ApiResult<ApplicationStatus>;
    /// `application-version-set`: the version of the unit's service's
    /// workload.
    async fn set_workload_version(&self, unit: &str, version: &str) -> ApiResult<()>;
    /// `is-leader`: whether `unit` leads its service; a service whose
    /// leader was lost (gone, dying, its agent down) gets `unit` as its
    /// leader.
    async fn is_leader(&self, unit: &str) -> ApiResult<bool>;
    /// The units `unit` sees in the relation's scope with their settings,
    /// in one snapshot: what a scope notice makes an agent re-read, in one
    /// call instead of one per member. A member without settings (`None`)
    /// came beyond the answer's bound: read it with `relation_settings`.
    /// Paged as [`Facade::scope_units`] is: [`scope_settings_all`] reads
    /// every page.
    async fn scope_settings(
        &self,
        relation: i64,
        unit: &str,
        after: Option<&str>,
    ) -> ApiResult<ScopeSettings>;
    /// A unit's settings in a relation: the caller's own, or those of a unit
    /// it sees in the scope.
    async fn relation_settings(
        &self,
        relation: i64,
        unit: &str,
    ) -> ApiResult<BTreeMap<String, String>>;
    /// Answers a `jujube run` request of the caller's own unit (once).
    async fn finish_run(&self, unit: &str, id: i64, result: RunResult) -> ApiResult<()>;
    /// Changes the caller's own settings in a relation whose scope it is in
    /// (`None` deletes a key).
    async fn update_relation_settings(
        &self,
        relation: i64,
        unit: &str,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()>;
    /// `goal-state` for the caller's own unit.
    async fn goal_state(&self, unit: &str) -> ApiResult<GoalState>;
    /// A leader-written bag as `unit` may read it (empty when never
    /// written).
    async fn bag(&self, unit: &str, bag: Bag) -> ApiResult<BTreeMap<String, String>>;
    /// Ships lines of the caller's own unit's log to the controller's log
    /// sink (what `debug-log` reads), at most [`MAX_SHIPPED_LOG`] bytes a
    /// call.
    async fn ship_log(&self, unit: &str, text: &str) -> ApiResult<()>;
    /// The leader changes a bag (`None` deletes a key); refused for another
    /// unit.
    async fn update_bag(
        &self,
        unit: &str,
        bag: Bag,
        changes: Vec<(String, Option<String>)>,
    ) -> ApiResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_message_is_cut_to_its_bound_at_a_character() {
        assert_eq!(fit_status_info("hook failed"), "hook failed");
        let exact = "x".repeat(MAX_STATUS_INFO_BYTES);
        assert_eq!(fit_status_info(&exact), exact.as_str());
        // Multi-byte characters across the cut: never split.
        let long = "é".repeat(MAX_STATUS_INFO_BYTES);
        let cut = fit_status_info(&long);
        assert!(cut.len() <= MAX_STATUS_INFO_BYTES, "{}", cut.len());
        assert!(cut.len() > MAX_STATUS_INFO_BYTES - 8, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'));
    }
}
