//! The client facade: what a user's `jujube` asks of a controller.
//!
//! Paths (HTTP/2 over TLS, the same server as the agents'):
//! - `POST` [`CLIENT_PATH`] — a JSON [`ClientCall`]; answers `200 OK` with
//!   the answer's JSON as the body (written once by the controller: a
//!   100,000-unit status is tens of megabytes, which the client passes
//!   through or reads straight into its type), any other status with a
//!   JSON [`ClientError`]. Every request names its user ([`USER_HEADER`])
//!   and proves it (`authorization: Bearer PASSWORD`).
//! - `POST` [`REGISTER_PATH`] — a [`Registration`]: the one-time secret of
//!   `jujube add-user` traded for a password; no credential.
//! - `POST` [`CHARM_PATH`] — a charm's files (the agent crate's
//!   `charmdir` archive) for a `deploy` or `upgrade-charm` that follows
//!   (`write` access); answers [`UPLOAD_PREFIX`] and the upload's id, which
//!   the call then names as its charm.

use serde::{Deserialize, Serialize};
use std::fmt;

pub const CLIENT_PATH: &str = "/v1/client";
pub const REGISTER_PATH: &str = "/v1/register";
pub const CHARM_PATH: &str = "/v1/charms";
pub const USER_HEADER: &str = "x-jujube-user";
/// The user `bootstrap` makes.
pub const ADMIN: &str = "admin";
/// A charm named `upload:ID` is one uploaded to [`CHARM_PATH`].
pub const UPLOAD_PREFIX: &str = "upload:";

/// What a user may do in an environment, each level including the ones
/// below: `read` sees (`status`, `wait`, `debug-log`, `get*`), `write` also
/// changes the model, `admin` also runs commands on units (`exec`), manages
/// users and destroys the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// Logs in, sees nothing of the model (after `revoke NAME read`).
    None,
    Read,
    Write,
    Admin,
}

impl Access {
    pub const ALL: [Access; 4] = [Access::None, Access::Read, Access::Write, Access::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Access::None => "none",
            Access::Read => "read",
            Access::Write => "write",
            Access::Admin => "admin",
        }
    }

    pub fn level(self) -> i64 {
        self as i64
    }

    pub fn from_level(n: i64) -> Option<Access> {
        Access::ALL.get(usize::try_from(n).ok()?).copied()
    }

    /// The level just below (what `revoke` leaves).
    pub fn below(self) -> Access {
        Access::from_level(self.level() - 1).unwrap_or(Access::None)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Access {
    type Err = String;
    fn from_str(s: &str) -> Result<Access, String> {
        match s {
            "read" => Ok(Access::Read),
            "write" => Ok(Access::Write),
            "admin" => Ok(Access::Admin),
            _ => Err(format!(
                "unknown access `{s}`: use `read`, `write` or `admin`"
            )),
        }
    }
}

/// A user as `jujube users` shows it (never a secret or a hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct UserInfo {
    pub name: String,
    pub access: Access,
    /// Who added it (`admin` was made by `bootstrap`: none).
    pub created_by: Option<String>,
    /// Unix seconds.
    pub created_at: i64,
    /// Whether its registration string was used yet.
    pub registered: bool,
}

/// What `jujube register STRING` sends: the user, the one-time secret of
/// `add-user`, and the password it chose.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub user: String,
    pub secret: String,
    pub password: String,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// One request of the client facade. Each variant's answer (the body of a
/// `200 OK`) is the JSON of the type named in its comment. What a
/// call needs — `read`, `write` or `admin` — is checked by the store in
/// the call's own transaction.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", content = "args", rename_all = "kebab-case")]
pub enum ClientCall {
    /// → [`crate::view::Status`].
    Status,
    /// → [`EnvironmentInfo`].
    Environment,
    /// → `String`: the service's constraints, or the environment's.
    GetConstraints { service: Option<String> },
    /// → [`ServiceSettings`].
    Get { service: String },
    /// → `BTreeMap<String, String>`.
    GetEnvironment,
    /// → `Vec<`[`crate::view::Stray`]`>`.
    Strays,
    /// → [`crate::view::Task`].
    Task { id: i64 },
    /// → `Option<`[`crate::view::RunResult`]`>`: `None` until answered.
    RunResult { id: i64 },
    /// → [`WaitState`].
    WaitState,
    /// → [`Deployed`]. `charm` is a charm directory the controller reads.
    Deploy {
        charm: String,
        /// The series a `local:SERIES/NAME` URL named.
        url_series: Option<String>,
        series: Option<String>,
        service: Option<String>,
        units: Option<usize>,
        constraints: Option<String>,
        to: Option<i64>,
        settings: Vec<(String, String)>,
    },
    /// → `Vec<String>`: the units added.
    AddUnits {
        service: String,
        n: usize,
        to: Option<i64>,
    },
    /// → `Vec<i64>`: the machines added.
    AddMachines {
        n: usize,
        series: Option<String>,
        constraints: Option<String>,
    },
    /// → `Vec<i64>`: the controller machines added (`enable-ha -n`).
    EnableHa { n: usize },
    /// → `()`.
    SetConstraints {
        service: Option<String>,
        constraints: Vec<String>,
    },
    /// → `()`.
    Set {
        service: String,
        settings: Vec<(String, String)>,
    },
    /// → `()`.
    SetEnvironment { config: Vec<(String, String)> },
    /// → `String`: the relation's key.
    AddRelation { a: String, b: String },
    /// → `()`.
    DestroyRelation { a: String, b: String },
    /// → `()`.
    DestroyUnits { units: Vec<String> },
    /// → `()`.
    DestroyService { service: String },
    /// → `()`.
    DestroyMachines { ids: Vec<i64> },
    /// → [`Listed`]`<String>`: the units resolved.
    ResolveAll { retry: bool },
    /// → `()`.
    ResolveUnit { unit: String, retry: bool },
    /// → `()`.
    ResolveMachine {
        id: i64,
        constraints: Option<String>,
    },
    /// → `String`: the new charm URL. `path`: a charm directory the
    /// controller reads (else the service's own charm's, read again).
    UpgradeCharm {
        service: String,
        path: Option<String>,
        force: bool,
    },
    /// → [`Listed`]`<i64>`: the machines to be provisioned again (`None`:
    /// every machine in error; else at most 100 named).
    RetryProvisioning { ids: Option<Vec<i64>> },
    /// → `i64`: the run's id (`admin`).
    QueueRun {
        unit: String,
        argv: Vec<String>,
        timeout: u64,
    },
    /// → `()`.
    ForgetRun { id: i64 },
    /// → `i64`: the task's id.
    QueueAction {
        unit: String,
        action: String,
        params: Vec<String>,
        timeout: u64,
    },
    /// → [`LogLines`]: the units' log lines the controller's log sink
    /// holds — the last `lines` of them, or (`cursor`) those after it —,
    /// only `include`'s units when it names any.
    DebugLog {
        include: Vec<String>,
        lines: usize,
        cursor: Option<u64>,
    },
    /// → `String`: the one-time registration secret (`admin`).
    AddUser { name: String, access: Access },
    /// → `Vec<`[`UserInfo`]`>`: every user for an admin, else oneself.
    Users,
    /// → [`Access`]: what the user has now (`admin`).
    ChangeAccess {
        name: String,
        access: Access,
        grant: bool,
    },
    /// → `()`: oneself, or anyone for an admin.
    SetPassword { name: String, password: String },
}

/// What the environment is, for the client's own checks and messages.
/// What a command over every unit or machine in some state did: the first
/// of them (at most 20, by name or id) and how many they were, so that the
/// answer stays small when it touched 100,000.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listed<T> {
    pub listed: Vec<T>,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentInfo {
    pub name: String,
    pub uuid: String,
    pub provider: String,
    pub default_series: String,
    /// The Alive controller machines, in order (`enable-ha` adds them).
    #[serde(default)]
    pub controllers: Vec<i64>,
    /// Each one's controller as `status` shows it: whether it is up and
    /// where clients reach it.
    #[serde(default)]
    pub controller_status: Vec<crate::view::ControllerStatus>,
}

/// `deploy`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployed {
    pub service: String,
    pub charm_url: String,
    pub units: usize,
}

/// One setting as `jujube get` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SettingOut {
    #[serde(rename = "type")]
    pub kind: String,
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<jujube_core::charm::SettingValue>,
    pub default: bool,
}

/// `jujube get SERVICE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceSettings {
    pub service: String,
    pub charm: String,
    pub settings: std::collections::BTreeMap<String, SettingOut>,
}

/// `debug-log`'s answer: lines `UNIT: text`, where to read on, and how
/// many bytes were rotated away before they could be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLines {
    pub lines: Vec<String>,
    pub cursor: u64,
    pub missed: u64,
}

/// What `wait` shows and decides on, read at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitState {
    pub progress: crate::view::Progress,
    /// What still holds things up, each said in a line.
    pub stuck: Vec<String>,
    /// Machines and units in error with what frees them; empty when none.
    pub errors: String,
}

/// A refusal or failure of a call, as the client prints it (`error: ` and
/// the message). `usage`: the request itself was malformed (exit 2).
/// `unavailable`: this controller cannot reach its state database now;
/// nothing was decided, and another controller may answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientError {
    pub message: String,
    #[serde(default)]
    pub usage: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unavailable: bool,
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ClientError {}

impl ClientError {
    pub fn new(message: impl Into<String>) -> ClientError {
        ClientError {
            message: message.into(),
            usage: false,
            unavailable: false,
        }
    }

    pub fn usage(message: impl Into<String>) -> ClientError {
        ClientError {
            message: message.into(),
            usage: true,
            unavailable: false,
        }
    }
}

/// An answer's JSON.
pub fn raw<T: Serialize + ?Sized>(v: &T) -> Box<serde_json::value::RawValue> {
    serde_json::value::to_raw_value(v).expect("plain data")
}

/// The method only: one call carries a password.
impl fmt::Debug for ClientCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientCall")
            .field("method", &self.method())
            .finish_non_exhaustive()
    }
}

impl ClientCall {
    /// Whether the call may be sent again when its connection was lost
    /// before the answer (so that it may have been done): reads, and
    /// writes whose second doing changes nothing more (setting a value,
    /// destroying). Adding units or machines, deploying, relating,
    /// resolving, upgrading and queueing runs or actions are not: done
    /// twice they add, retry or run twice, or answer a refusal for what
    /// the first did.
    pub fn resendable(&self) -> bool {
        use ClientCall::*;
        match self {
            Status
            | Environment
            | GetConstraints { .. }
            | Get { .. }
            | GetEnvironment
            | Strays
            | Task { .. }
            | RunResult { .. }
            | WaitState
            | DebugLog { .. }
            | Users => true,
            SetConstraints { .. }
            | Set { .. }
            | SetEnvironment { .. }
            | DestroyRelation { .. }
            | DestroyUnits { .. }
            | DestroyService { .. }
            | DestroyMachines { .. }
            | RetryProvisioning { .. }
            | ForgetRun { .. }
            | ChangeAccess { .. }
            | SetPassword { .. } => true,
            Deploy { .. }
            | AddUnits { .. }
            | AddMachines { .. }
            | EnableHa { .. }
            | AddRelation { .. }
            | ResolveAll { .. }
            | ResolveUnit { .. }
            | ResolveMachine { .. }
            | UpgradeCharm { .. }
            | QueueRun { .. }
            | QueueAction { .. }
            | AddUser { .. } => false,
        }
    }

    /// Whether the answer grows with the whole model, not with what the
    /// call names: a `status` is a snapshot of every machine, service and
    /// unit (34 MB of JSON at 100,000 units). A server makes and sends only
    /// a few of these at once (see the API server's `Limits`).
    pub fn answers_the_whole_model(&self) -> bool {
        matches!(self, ClientCall::Status)
    }

    /// The method's name, for logs (never its arguments: one carries a
    /// password).
    pub fn method(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get("method").and_then(|m| m.as_str()).map(str::to_string))
            .unwrap_or_default()
    }
}
