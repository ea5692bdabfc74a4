//! The facade on the wire: one [`Call`] per [`Facade`] method, and the
//! envelope both ends agree on.
//!
//! The API server (`jujube-api`) decodes a [`Call`], hands it to the facade
//! scoped to the authenticated caller with [`dispatch`], and answers with a
//! [`Reply`]; the remote client (the agent crate's `remote`) encodes each facade
//! method as the same [`Call`]. Because both ends go through this one enum,
//! a facade method that is not on the wire does not compile.
//!
//! Paths and headers:
//! - `POST /v1/call` — a JSON [`Call`]; answers a JSON [`Reply`];
//! - `POST /v1/watch` — a JSON [`WatchRequest`]; answers a stream of
//!   [`Notice`](crate::facade::Notice)s, one JSON object per line, for as long as the client reads,
//!   with [`REVISION_HEADER`] saying where the subscription starts;
//! - every request carries [`TAG_HEADER`] (who) and `authorization: Bearer
//!   SECRET` (proof); an agent's writes carry [`STAMP_HEADER`] too.

use crate::facade::{
    AgentStatus, ApiError, ApiResult, Bag, ErrorCode, Facade, RunResult, Tag, WatchTarget,
};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const CALL_PATH: &str = "/v1/call";
pub const WATCH_PATH: &str = "/v1/watch";
/// `POST` — an instance's enrollment (no credential: a token); see the API
/// server.
pub const ENROLL_PATH: &str = "/v1/enroll";
/// `POST` — machine 0's hand-over on EC2 when the user hands the
/// controller their credentials: bootstrap's one-time token as bearer,
/// the environment's state as body (see `jujube_api::handover`).
pub const HAND_OVER_PATH: &str = "/v1/hand-over";

/// The most bytes an enrollment's body may hold: an identity document of
/// at most 4,096 bytes (base64: 5,464 characters), a signature of at most
/// 1,024 characters, the token and the JSON around them. Larger is refused
/// before it is read.
pub const MAX_ENROLL_BYTES: usize = 8 << 10;

/// What an instance sends to enroll: its batch's token and its proof of
/// identity (see [`Identity`]). Its `Debug` leaves the token out.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct EnrollRequest {
    pub token: String,
    /// The instance identity document, base64 (its exact bytes: the
    /// signature is over them).
    pub identity_document: String,
    /// The document's signature, as the metadata service gives it.
    pub identity_signature: String,
}

impl std::fmt::Debug for EnrollRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrollRequest")
            .field("token", &"(hidden)")
            .field("identity_document", &self.identity_document)
            .field("identity_signature", &self.identity_signature)
            .finish()
    }
}
/// `GET` — the agent binary, for instances installing their agent.
pub const TOOLS_PATH: &str = "/v1/tools/jujube";
pub const TAG_HEADER: &str = "x-jujube-tag";
/// On an agent's write: `INCARNATION.SEQ`, the incarnation the agent took
/// with [`Call::StartAgent`] as it started and the write's number within
/// it (from 1, the same when the write is sent again). The store applies a
/// write only if no later one of the agent's was (a write held up in a
/// controller cut off from the database, while the agent went on through
/// another, is refused with [`ErrorCode::Superseded`] when it arrives),
/// and a write sent again once. Without it (agents in a controller's own
/// process) writes are applied as they come.
pub const STAMP_HEADER: &str = "x-jujube-stamp";

/// [`STAMP_HEADER`]'s value: two positive integers, `INCARNATION.SEQ`
/// (at most 41 bytes). Numbers may skip (a write refused by a rule
/// records nothing); 0 is what a fresh incarnation has applied.
pub fn parse_stamp(value: &[u8]) -> Option<(i64, i64)> {
    let text = std::str::from_utf8(value).ok()?;
    let (incarnation, seq) = text.split_once('.')?;
    let number = |s: &str| {
        (!s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<i64>().ok())
            .flatten()
            .filter(|&n| n >= 1)
    };
    Some((number(incarnation)?, number(seq)?))
}
/// On a watch's answer: the head revision when the subscription was made.
/// A client resumes from it (or from a later notice's revision).
pub const REVISION_HEADER: &str = "x-jujube-revision";
/// The name the API server's certificate is issued for, whatever address it
/// listens on (Juju does the same with `juju-apiserver`): agents check that
/// name against the environment's CA, never a DNS name.
pub const SERVER_NAME: &str = "jujube-apiserver";

/// A facade method and its arguments. Its `Debug` shows the method only:
/// one call carries a secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", content = "args", rename_all = "kebab-case")]
pub enum Call {
    Machine {
        id: i64,
    },
    SetMachineStatus {
        id: i64,
        status: AgentStatus,
        info: String,
    },
    EnsureDeadMachine {
        id: i64,
    },
    Charm {
        unit: String,
    },
    CharmFiles {
        unit: String,
    },
    EnsureDeadUnit {
        unit: String,
    },
    RemoveUnit {
        unit: String,
    },
    SetUnitStatus {
        unit: String,
        status: AgentStatus,
        info: String,
    },
    Unit {
        name: String,
    },
    EnsureDyingUnit {
        unit: String,
    },
    ClearResolved {
        unit: String,
    },
    SetPort {
        unit: String,
        port: String,
        open: bool,
    },
    EnterScope {
        relation: i64,
        unit: String,
        #[serde(default)]
        settings: Vec<(String, String)>,
    },
    FinishRun {
        unit: String,
        id: i64,
        result: RunResult,
    },
    LeaveScope {
        relation: i64,
        unit: String,
    },
    ScopeUnits {
        relation: i64,
        unit: String,
        /// The page after this unit (see [`Facade::scope_units`]).
        #[serde(default)]
        after: Option<String>,
    },
    ScopeSettings {
        relation: i64,
        unit: String,
        #[serde(default)]
        after: Option<String>,
    },
    SetWorkloadStatus {
        unit: String,
        application: bool,
        status: String,
        message: String,
    },
    WorkloadStatus {
        unit: String,
        application: bool,
    },
    ApplicationStatus {
        unit: String,
    },
    SetWorkloadVersion {
        unit: String,
        version: String,
    },
    /// A write: it may elect the caller.
    IsLeader {
        unit: String,
    },
    ServiceConfig {
        service: String,
    },
    RelationSettings {
        relation: i64,
        unit: String,
    },
    UpdateRelationSettings {
        relation: i64,
        unit: String,
        changes: Vec<(String, Option<String>)>,
    },
    Bag {
        unit: String,
        bag: Bag,
    },
    ShipLog {
        unit: String,
        text: String,
    },
    GoalState {
        unit: String,
    },
    UpdateBag {
        unit: String,
        bag: Bag,
        changes: Vec<(String, Option<String>)>,
    },
    /// Not a facade method: the agent, as it starts, takes a new
    /// incarnation for its writes' stamps (see [`STAMP_HEADER`]); answers
    /// it (`i64`).
    StartAgent,
    /// Not a facade method: a deployer (the machine agent for its
    /// principals, a unit agent for its subordinates) sets the credential
    /// the unit's agent will log in with. The server stores only its hash.
    SetUnitCredential {
        unit: String,
        secret: String,
    },
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Call({})", self.method())
    }
}

impl Call {
    /// Whether the call is a write the store applies as the agent's op,
    /// in the order the agent sent it: sent with a [`STAMP_HEADER`], one at
    /// a time. A deployer's `set-unit-credential` is one: a credential
    /// landing after a newer one would lock the unit's agent out. Not the
    /// reads, `start-agent` (what takes the incarnation), a leadership
    /// claim (`is-leader`: whoever asks while the leader is lost takes it,
    /// and a late claim meets the holder's lease) or a shipped log (lines
    /// carry their own times).
    pub fn is_stamped(&self) -> bool {
        !self.is_read()
            && !matches!(
                self,
                Call::CharmFiles { .. }
                    | Call::IsLeader { .. }
                    | Call::ShipLog { .. }
                    | Call::StartAgent
            )
    }

    /// Whether the call only reads: the server may answer it on any
    /// thread, beside others.
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            Call::Machine { .. }
                | Call::Charm { .. }
                | Call::Unit { .. }
                | Call::ScopeUnits { .. }
                | Call::ScopeSettings { .. }
                | Call::WorkloadStatus { .. }
                | Call::ApplicationStatus { .. }
                | Call::ServiceConfig { .. }
                | Call::RelationSettings { .. }
                | Call::Bag { .. }
                | Call::GoalState { .. }
        )
    }

    /// The method's name, for logs (never the arguments: a credential call
    /// carries a secret).
    pub fn method(&self) -> &'static str {
        match self {
            Call::Machine { .. } => "machine",
            Call::SetMachineStatus { .. } => "set-machine-status",
            Call::EnsureDeadMachine { .. } => "ensure-dead-machine",
            Call::Charm { .. } => "charm",
            Call::CharmFiles { .. } => "charm-files",
            Call::EnsureDeadUnit { .. } => "ensure-dead-unit",
            Call::RemoveUnit { .. } => "remove-unit",
            Call::SetUnitStatus { .. } => "set-unit-status",
            Call::Unit { .. } => "unit",
            Call::EnsureDyingUnit { .. } => "ensure-dying-unit",
            Call::ClearResolved { .. } => "clear-resolved",
            Call::SetPort { .. } => "set-port",
            Call::EnterScope { .. } => "enter-scope",
            Call::FinishRun { .. } => "finish-run",
            Call::LeaveScope { .. } => "leave-scope",
            Call::ScopeUnits { .. } => "scope-units",
            Call::ScopeSettings { .. } => "scope-settings",
            Call::SetWorkloadStatus { .. } => "set-workload-status",
            Call::WorkloadStatus { .. } => "workload-status",
            Call::ApplicationStatus { .. } => "application-status",
            Call::IsLeader { .. } => "is-leader",
            Call::SetWorkloadVersion { .. } => "set-workload-version",
            Call::ServiceConfig { .. } => "service-config",
            Call::RelationSettings { .. } => "relation-settings",
            Call::UpdateRelationSettings { .. } => "update-relation-settings",
            Call::Bag { .. } => "bag",
            Call::GoalState { .. } => "goal-state",
            Call::ShipLog { .. } => "ship-log",
            Call::UpdateBag { .. } => "update-bag",
            Call::SetUnitCredential { .. } => "set-unit-credential",
            Call::StartAgent => "start-agent",
        }
    }
}

/// The answer to a [`Call`]: exactly one of the two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reply {
    Ok(serde_json::Value),
    Error(ApiError),
}

/// Subscribe to a watch, resuming after `since` (the last revision the
/// client saw; 0 for a first subscription). Changes after `since` that the
/// client could not have seen are announced by one notice at once, or a
/// `resync` notice when the feed no longer holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    pub target: WatchTarget,
    #[serde(default)]
    pub since: u64,
}

fn encode<T: Serialize>(v: T) -> ApiResult<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
}

/// Runs `call` on `facade`, answering plain JSON. Authorisation is the
/// facade's: it is scoped to the caller, so an out-of-scope call is refused
/// there, the same way in process and over the wire.
/// [`Call::SetUnitCredential`] and [`Call::StartAgent`] are the server's
/// own business and are refused here.
pub async fn dispatch(facade: &dyn Facade, call: Call) -> ApiResult<serde_json::Value> {
    match call {
        Call::Machine { id } => encode(facade.machine(id).await?),
        Call::SetMachineStatus { id, status, info } => {
            encode(facade.set_machine_status(id, status, &info).await?)
        }
        Call::EnsureDeadMachine { id } => encode(facade.ensure_dead_machine(id).await?),
        Call::Charm { unit } => encode(facade.charm(&unit).await?),
        Call::CharmFiles { unit } => encode(facade.charm_files(&unit).await?),
        Call::EnsureDeadUnit { unit } => encode(facade.ensure_dead_unit(&unit).await?),
        Call::RemoveUnit { unit } => encode(facade.remove_unit(&unit).await?),
        Call::SetUnitStatus { unit, status, info } => {
            encode(facade.set_unit_status(&unit, status, &info).await?)
        }
        Call::Unit { name } => encode(facade.unit(&name).await?),
        Call::EnsureDyingUnit { unit } => encode(facade.ensure_dying_unit(&unit).await?),
        Call::ClearResolved { unit } => encode(facade.clear_resolved(&unit).await?),
        Call::SetPort { unit, port, open } => encode(facade.set_port(&unit, &port, open).await?),
        Call::EnterScope {
            relation,
            unit,
            settings,
        } => encode(facade.enter_scope(relation, &unit, settings).await?),
        Call::FinishRun { unit, id, result } => encode(facade.finish_run(&unit, id, result).await?),
        Call::LeaveScope { relation, unit } => encode(facade.leave_scope(relation, &unit).await?),
        Call::ScopeUnits {
            relation,
            unit,
            after,
        } => encode(
            facade
                .scope_units(relation, &unit, after.as_deref())
                .await?,
        ),
        Call::ScopeSettings {
            relation,
            unit,
            after,
        } => encode(
            facade
                .scope_settings(relation, &unit, after.as_deref())
                .await?,
        ),
        Call::SetWorkloadStatus {
            unit,
            application,
            status,
            message,
        } => encode(
            facade
                .set_workload_status(&unit, application, &status, &message)
                .await?,
        ),
        Call::WorkloadStatus { unit, application } => {
            encode(facade.workload_status(&unit, application).await?)
        }
        Call::ApplicationStatus { unit } => encode(facade.application_status(&unit).await?),
        Call::IsLeader { unit } => encode(facade.is_leader(&unit).await?),
        Call::SetWorkloadVersion { unit, version } => {
            encode(facade.set_workload_version(&unit, &version).await?)
        }
        Call::ServiceConfig { service } => encode(facade.service_config(&service).await?),
        Call::RelationSettings { relation, unit } => {
            encode(facade.relation_settings(relation, &unit).await?)
        }
        Call::UpdateRelationSettings {
            relation,
            unit,
            changes,
        } => encode(
            facade
                .update_relation_settings(relation, &unit, changes)
                .await?,
        ),
        Call::Bag { unit, bag } => encode(facade.bag(&unit, bag).await?),
        Call::GoalState { unit } => encode(facade.goal_state(&unit).await?),
        Call::ShipLog { unit, text } => encode(facade.ship_log(&unit, &text).await?),
        Call::UpdateBag { unit, bag, changes } => {
            encode(facade.update_bag(&unit, bag, changes).await?)
        }
        Call::SetUnitCredential { .. } | Call::StartAgent => Err(ApiError::new(
            ErrorCode::Internal,
            format!(
                "`{}` is answered by the API server, not a facade",
                call.method()
            ),
        )),
    }
}

impl std::str::FromStr for Tag {
    type Err = ApiError;

    /// Juju's tag syntax: `machine-1`, `unit-wordpress-0` (a service name
    /// may hold dashes; the unit number is after the last one).
    fn from_str(s: &str) -> ApiResult<Tag> {
        let bad = || {
            ApiError::new(
                ErrorCode::Unauthorized,
                format!("malformed agent tag `{s}`: expected `machine-N` or `unit-SERVICE-N`"),
            )
        };
        if let Some(id) = s.strip_prefix("machine-") {
            let id: i64 = id.parse().map_err(|_| bad())?;
            if id < 0 || id.to_string() != s["machine-".len()..] {
                return Err(bad());
            }
            return Ok(Tag::Machine(id));
        }
        let rest = s.strip_prefix("unit-").ok_or_else(bad)?;
        let (service, n) = rest.rsplit_once('-').ok_or_else(bad)?;
        let n: u64 = n.parse().map_err(|_| bad())?;
        if service.is_empty() || n.to_string() != rest[service.len() + 1..] {
            return Err(bad());
        }
        Ok(Tag::Unit(format!("{service}/{n}")))
    }
}

/// What an agent process needs to reach the controller: `agent.conf` in its
/// data dir (JSON, mode 0600: it holds the agent's secret).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AgentConf {
    /// `host:port` addresses, or `unix:PATH`, tried in order.
    pub api_addresses: Vec<String>,
    /// The environment's CA certificate (PEM): the only one trusted.
    pub ca_cert: String,
    pub tag: Tag,
    pub secret: String,
    /// The environment's name (`JUJU_ENV_NAME` for hooks).
    #[serde(default)]
    pub env_name: String,
    /// The environment's UUID (`JUJU_MODEL_UUID` for hooks).
    #[serde(default)]
    pub env_uuid: String,
}

impl std::fmt::Debug for AgentConf {
    /// Never the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConf")
            .field("api_addresses", &self.api_addresses)
            .field("tag", &self.tag)
            .field("secret", &"<hidden>")
            .finish()
    }
}

impl AgentConf {
    pub fn read(path: &Path) -> std::io::Result<AgentConf> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
    }

    /// Written whole (a temporary file renamed into place), readable by its
    /// owner only.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).expect("plain data");
        write_private(path, text.as_bytes())
    }
}

/// Writes `bytes` to `path` whole — a temporary file beside it, synced,
/// renamed into place: a crash never leaves half of it — readable by its
/// owner only (0600: it holds a secret).
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    // A name of its own (two writers never share one), made new (never a
    // file left behind with wider permissions).
    let mut name = path.as_os_str().to_owned();
    name.push(format!(
        ".{}.{}.tmp",
        std::process::id(),
        new_secret().get(..8).unwrap_or("")
    ));
    let tmp = std::path::PathBuf::from(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    let written = f.write_all(bytes).and_then(|_| f.sync_all());
    if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}

/// A fresh agent secret: 32 bytes from the operating system's CSPRNG, hex.
pub fn new_secret() -> String {
    let mut buf = [0u8; 32];
    getrandom::getrandom(&mut buf).expect("the operating system's random source");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the store keeps of a secret: SHA-256, hex. Secrets are 256 random
/// bits, so a fast hash is enough (no dictionary to slow down), as Juju's
/// agent password hash is.
pub fn secret_hash(secret: &str) -> String {
    sha256_hex(secret.as_bytes())
}

/// SHA-256 of `bytes`, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Compares a presented secret with a stored hash in time independent of
/// where they differ.
pub fn secret_matches(secret: &str, hash: &str) -> bool {
    let presented = secret_hash(secret);
    presented.len() == hash.len()
        && presented
            .bytes()
            .zip(hash.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_enrollment_shown_for_debugging_leaves_its_token_out() {
        let r = EnrollRequest {
            token: "s3cr3t-token-value".into(),
            identity_document: "e30=".into(),
            identity_signature: "sig".into(),
        };
        let shown = format!("{r:?}");
        assert!(!shown.contains("s3cr3t-token-value"), "{shown}");
        assert!(shown.contains("e30="), "{shown}");
    }

    #[test]
    fn tags_parse_back_from_their_display() {
        for tag in [
            Tag::Machine(0),
            Tag::Machine(42),
            Tag::unit("wordpress/0"),
            Tag::unit("my-db-2/17"),
        ] {
            assert_eq!(tag.to_string().parse::<Tag>().unwrap(), tag);
        }
        for bad in [
            "",
            "machine-",
            "machine--1",
            "machine-01",
            "machine-x",
            "unit-",
            "unit-wordpress",
            "unit--0",
            "unit-wordpress-01",
            "service-wordpress",
        ] {
            let err = bad.parse::<Tag>().unwrap_err();
            assert!(err.is_unauthorized(), "{bad}: {err:?}");
        }
    }

    #[test]
    fn secrets_are_random_and_checked_against_their_hash_only() {
        let a = new_secret();
        let b = new_secret();
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        let h = secret_hash(&a);
        assert!(!h.contains(&a));
        assert!(secret_matches(&a, &h));
        assert!(!secret_matches(&b, &h));
        assert!(!secret_matches("", &h));
        assert!(!secret_matches(&a, ""));
    }

    #[test]
    fn calls_round_trip_as_json_and_name_their_method_only() {
        let call = Call::UpdateRelationSettings {
            relation: 3,
            unit: "wordpress/0".into(),
            changes: vec![("host".into(), Some("10.0.0.1".into())), ("x".into(), None)],
        };
        let json = serde_json::to_string(&call).unwrap();
        assert_eq!(serde_json::from_str::<Call>(&json).unwrap(), call);
        let cred = Call::SetUnitCredential {
            unit: "wordpress/0".into(),
            secret: "s3cret".into(),
        };
        assert!(!cred.method().contains("s3cret"));
        assert!(!format!("{cred:?}").contains("s3cret"));
        let conf = AgentConf {
            api_addresses: vec![],
            ca_cert: String::new(),
            tag: Tag::Machine(1),
            secret: "s3cret".into(),
            env_name: String::new(),
            env_uuid: String::new(),
        };
        assert!(!format!("{conf:?}").contains("s3cret"));
    }

    #[test]
    fn a_stamp_is_two_positive_integers_and_nothing_else() {
        assert_eq!(parse_stamp(b"1.7"), Some((1, 7)));
        // What a fresh incarnation has applied, and no incarnation at all.
        assert_eq!(parse_stamp(b"1.0"), None);
        assert_eq!(parse_stamp(b"0.1"), None);
        assert_eq!(parse_stamp(b"9223372036854775807.1"), Some((i64::MAX, 1)));
        for bad in [
            &b""[..],
            b"1",
            b"1.",
            b".1",
            b"1.2.3",
            b"-1.2",
            b"1.+2",
            b" 1.2",
            b"1.x",
            b"9223372036854775808.1",
            b"000000000000000000001.1",
            b"\xff.1",
        ] {
            assert_eq!(parse_stamp(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
