//! The unit agent's hook record (`hooks.json` in the unit's directory).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the unit agent knows of one relation it is in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelationState {
    /// `name` of the relation from this unit's side (`db`).
    pub name: String,
    /// Remote units it ran `-joined` for, with the settings (a digest) it
    /// last ran `-changed` with.
    pub joined: BTreeMap<String, String>,
    /// The remote application (the unit's own in a peer relation).
    #[serde(default)]
    pub app: String,
    /// The remote application's settings (a digest) it last ran
    /// `-changed` with; `None` before they were first set.
    #[serde(default)]
    pub app_settings: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookState {
    pub installed: bool,
    pub started: bool,
    pub stopped: bool,
    /// Digest of the service settings the last `config-changed` saw.
    pub config: Option<String>,
    pub relations: BTreeMap<i64, RelationState>,
    /// The hook under way; still set when the agent comes back, it failed.
    /// (Both boxed: each idle unit agent keeps this record, and these are
    /// rarely set.)
    pub running: Option<Box<HookRecord>>,
    /// A failed hook the unit waits on (`jujube resolved`).
    pub failed: Option<Box<HookRecord>>,
    /// The charm URL the charm directory holds, once upgraded (before the
    /// first upgrade: the one it was deployed with, in `agent.json`).
    #[serde(default)]
    pub charm: Option<String>,
    /// `leader-elected` ran since the unit last became its service's
    /// leader.
    #[serde(default)]
    pub leader: bool,
    /// 1 + the version of the leader settings the last
    /// `leader-settings-changed` saw (see `UnitView`), 0 before it first
    /// ran (a `u32`: every idle agent keeps this record).
    #[serde(default)]
    pub leader_settings: u32,
}

/// Which hook, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookRecord {
    pub name: String,
    #[serde(default)]
    pub relation: Option<(i64, String)>,
    #[serde(default)]
    pub remote: Option<String>,
}

impl From<&super::runner::Hook> for HookRecord {
    fn from(h: &super::runner::Hook) -> HookRecord {
        HookRecord {
            name: h.name.clone(),
            relation: h.relation.clone(),
            remote: h.remote.clone(),
        }
    }
}

impl HookState {
    pub fn path(unit_dir: &Path) -> PathBuf {
        unit_dir.join("hooks.json")
    }

    /// The record, or a fresh one. A hook that was running when the agent
    /// stopped (killed, crashed) is a failed hook now, and whatever of it
    /// still runs is killed first: the next hook must not run beside it.
    pub fn load(unit_dir: &Path) -> HookState {
        let mut s: HookState = std::fs::read(Self::path(unit_dir))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        if let Some(h) = s.running.take() {
            let killed = super::runner::kill_leftovers(unit_dir);
            if killed > 0 {
                tracing::info!(hook = %h.name, dir = %unit_dir.display(), killed, "killed what was left of a hook whose agent died");
            }
            s.failed.get_or_insert(h);
        }
        s
    }

    /// Written whole: a temporary file renamed into place.
    pub fn save(&self, unit_dir: &Path) -> std::io::Result<()> {
        let path = Self::path(unit_dir);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).expect("plain data"))?;
        std::fs::rename(&tmp, &path)
    }
}

/// A stable digest of settings, to tell whether they changed.
pub fn digest<T: Serialize>(v: &T) -> String {
    use sha2::Digest;
    let bytes = serde_json::to_vec(v).expect("plain data");
    sha2::Sha256::digest(&bytes)
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect()
}
