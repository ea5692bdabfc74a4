//! What the store shows of the model — `status`, `wait`'s progress, the
//! strays, a task — as plain data: the store makes these, the API carries
//! them unchanged, the client renders them.

use jujube_core::Life;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, Serializer};
use std::collections::BTreeMap;

/// The job of a machine that runs the controller (machine 0).
pub const JOB_MANAGE_ENVIRON: &str = "manage-environ";

/// A map that keeps insertion order when serialised (machine ids and unit
/// numbers sort numerically, not as strings).
#[derive(Debug, Clone, PartialEq)]
pub struct OrderedMap<V>(pub Vec<(String, V)>);

impl<V> Default for OrderedMap<V> {
    fn default() -> Self {
        OrderedMap(Vec::new())
    }
}

impl<V: Serialize> Serialize for OrderedMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for OrderedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Ordered<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Ordered<V> {
            type Value = OrderedMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut v = Vec::new();
                while let Some(entry) = m.next_entry()? {
                    v.push(entry);
                }
                Ok(OrderedMap(v))
            }
        }
        d.deserialize_map(Ordered(std::marker::PhantomData))
    }
}

impl<V> OrderedMap<V> {
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Status {
    pub environment: EnvironmentStatus,
    pub machines: OrderedMap<MachineStatus>,
    pub services: OrderedMap<ServiceStatus>,
    pub relations: Vec<RelationStatus>,
    /// Instances tagged as this environment's that no machine owns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub strays: Vec<Stray>,
    /// How many more there are than `strays` lists (it lists the first 256
    /// seen).
    #[serde(default, rename = "strays-unlisted", skip_serializing_if = "is_zero")]
    pub strays_unlisted: u64,
    /// Every Alive controller machine's controller, in machine order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controllers: Vec<ControllerStatus>,
}

/// A controller machine's controller: `up` while it records itself within
/// the agents' presence lapse, `down` after, `pending` before it first
/// ran; where it serves the API; whether it holds the singletons lease now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ControllerStatus {
    pub machine: String,
    pub state: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub runs_singletons: bool,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct EnvironmentStatus {
    pub name: String,
    pub uuid: String,
    pub provider: String,
    pub default_series: String,
    pub constraints: String,
    /// Present while the provider cannot be reached (listing zones or
    /// instances fails): why, and since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<ProviderStatus>,
    /// Which controller runs the singleton jobs (the provisioner, the
    /// cleaner): the holder of their lease. Absent before any controller
    /// ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singletons: Option<LeaseStatus>,
}

/// A controller lease: who holds it, under which fencing token, and until
/// when (unix milliseconds) unless renewed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct LeaseStatus {
    pub holder: String,
    pub token: i64,
    pub expires_ms: i64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MachineStatus {
    pub life: Life,
    pub series: String,
    pub jobs: Vec<String>,
    pub instance_id: Option<String>,
    /// `running`, or `gone` when the cloud no longer has the recorded
    /// instance; absent without an instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_status: Option<String>,
    /// The provisioning status.
    pub status: String,
    pub status_info: String,
    /// What the machine's agent reports (`pending` until it starts).
    pub agent_status: String,
    pub agent_status_info: String,
    /// When the API server first refused this agent's credential (a
    /// secret other than its current one: an agent left behind by a newer
    /// start attempt or enrollment), `YYYY-MM-DD HH:MM:SS UTC`; absent
    /// while it logs in with its current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_refused: Option<String>,
    pub constraints: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<String>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ServiceStatus {
    pub charm: String,
    pub life: Life,
    pub series: String,
    pub subordinate: bool,
    pub constraints: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subordinate_to: Vec<String>,
    /// Relation name → related services.
    pub relations: BTreeMap<String, Vec<String>>,
    /// Principal units only: a subordinate service lists none of its own
    /// (they appear under their principals), as Juju's status does.
    pub units: OrderedMap<UnitStatus>,
    /// What its leader's charm says of the application (`status-set
    /// --application`).
    pub workload_status: WorkloadStatus,
    /// Its workload's version (`application-version-set`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// For a Dying service: what it waits for (its units, named, and
    /// relations; one unit a failed hook holds, with the command that
    /// frees it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct UnitStatus {
    pub life: Life,
    pub machine: Option<String>,
    /// `pending` (no agent yet), `started`, `dying` or `error`.
    pub agent_status: String,
    pub agent_status_info: String,
    /// When the API server first refused this agent's credential (a
    /// secret other than its current one: an agent left behind by a newer
    /// start attempt or enrollment), `YYYY-MM-DD HH:MM:SS UTC`; absent
    /// while it logs in with its current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_refused: Option<String>,
    /// What its charm says of its workload (`status-set`).
    pub workload_status: WorkloadStatus,
    /// The leader of its service.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leader: bool,
    /// What its hooks opened (`open-port`), e.g. `80/tcp`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_ports: Vec<String>,
    pub subordinates: OrderedMap<SubordinateStatus>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SubordinateStatus {
    pub life: Life,
    pub agent_status: String,
    pub agent_status_info: String,
    pub workload_status: WorkloadStatus,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leader: bool,
    /// When the API server first refused this agent's credential (a
    /// secret other than its current one: an agent left behind by a newer
    /// start attempt or enrollment), `YYYY-MM-DD HH:MM:SS UTC`; absent
    /// while it logs in with its current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_refused: Option<String>,
}

/// A workload status as Juju shows it: `current` (`unknown` until the
/// charm sets one) and its message.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkloadStatus {
    pub current: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct RelationStatus {
    pub id: i64,
    pub key: String,
    pub life: Life,
    pub interface: String,
    pub scope: String,
    pub units_in_scope: i64,
    /// For a Dying relation: what it waits for, naming the units still in
    /// its scope and one a failed hook holds, with the command that frees
    /// it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// How far provisioning has come, counted in one read for `wait` and
/// `bootstrap` to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Alive machines.
    pub machines: i64,
    /// Alive machines with an instance, not in error.
    pub machines_started: i64,
    /// Alive machines in error.
    pub machines_in_error: i64,
    /// Principal units that are not Dead.
    pub units: i64,
    /// Those of them on a machine that has an instance and is not in error.
    pub units_on_started_machines: i64,
}

/// The provider cannot be reached: why, and since when (unix seconds).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProviderStatus {
    pub message: String,
    pub since: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Stray {
    pub instance_id: String,
    pub machine_tag: String,
    /// `destroyed` (its machine was removed), `unknown` (no machine ever had
    /// it) or `errored` (a machine in error that does not own it).
    pub class: String,
    /// Unix seconds.
    pub first_seen: i64,
    /// Unix seconds; `None` when the harvest mode leaves it alone.
    pub reap_at: Option<i64>,
}

/// What a run printed and exited with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunResult {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// For an action: what it said with the action tools.
    pub action: Option<ActionOutcome>,
}

/// What an action said with `action-set`, `action-fail` and `action-log`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ActionOutcome {
    /// `action-set`'s results, keys dotted as set (`detail.level`).
    pub results: BTreeMap<String, String>,
    /// `action-fail`'s message: the action failed.
    pub failed: Option<String>,
    /// `action-log`'s messages, with their unix time.
    pub log: Vec<(i64, String)>,
}

/// A queued action as `show-task` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Task {
    pub id: i64,
    pub unit: String,
    pub action: String,
    pub params: serde_json::Value,
    /// Unix seconds.
    pub queued: i64,
    /// `None` while pending or running.
    pub result: Option<RunResult>,
}

impl Task {
    /// Juju's task status: `pending`, `completed` or `failed` (failed when
    /// the action said so or exited non-zero).
    pub fn status(&self) -> &'static str {
        match &self.result {
            None => "pending",
            Some(r) if r.code != 0 || r.action.as_ref().is_some_and(|a| a.failed.is_some()) => {
                "failed"
            }
            Some(_) => "completed",
        }
    }
}
