//! Charms in action: the hooks a unit agent runs and the hook tools they
//! call (charms-in-action.txt).
//!
//! # Layout
//! - [`state`]: what the unit agent has run, persisted in the unit's
//!   directory after every hook (`hooks.json`, and the saves since it in
//!   `hooks.journal`: a line each; a new unit's, the journal alone), so
//!   that a restarted agent
//!   neither repeats nor skips one; a hook that was running when the agent
//!   died counts as failed.
//! - [`runner`]: runs one hook — `charm/hooks/NAME` in the charm directory,
//!   with Juju's environment (`CHARM_DIR`, `JUJU_UNIT_NAME`,
//!   `JUJU_CONTEXT_ID`, `JUJU_AGENT_SOCKET`, `JUJU_RELATION`, ...) and the
//!   hook tools first on `PATH`; output appended to the unit's log
//!   (`<machine dir>/logs/unit-svc-N.log`, kept after the unit goes).
//! - [`context`]: the unit agent's socket, where hook tools reach the hook
//!   context that is running: reads are a snapshot (the same answer all
//!   hook long), `relation-set` is buffered and written only if the hook
//!   succeeds.
//! - [`tools`]: the tools themselves (`relation-get`, `relation-set`,
//!   `relation-ids`, `relation-list`, `config-get`, `unit-get`, `juju-log`,
//!   `open-port`, `close-port`)
//!   with Juju's flags and formats; the `jujube` binary run under a tool's
//!   name is only their client.

pub mod context;
pub mod runner;
pub mod state;
pub mod tools;

/// Names the `jujube` binary answers to as a hook tool.
pub const TOOLS: [&str; 41] = [
    "juju-log",
    "status-set",
    "status-get",
    "is-leader",
    "application-version-set",
    "network-get",
    "credential-get",
    "storage-get",
    "storage-list",
    "storage-add",
    "secret-get",
    "secret-set",
    "secret-add",
    "secret-ids",
    "secret-info-get",
    "secret-grant",
    "secret-revoke",
    "secret-remove",
    "resource-get",
    "relation-model-get",
    "juju-reboot",
    "add-metric",
    "state-get",
    "state-set",
    "state-delete",
    "goal-state",
    "open-port",
    "close-port",
    "unit-get",
    "config-get",
    "relation-get",
    "relation-set",
    "relation-ids",
    "relation-list",
    "opened-ports",
    "leader-get",
    "leader-set",
    "action-get",
    "action-set",
    "action-fail",
    "action-log",
];

/// Now, as the units' logs write it: `YYYY-MM-DD HH:MM:SS` in UTC (Juju's
/// log time; `debug-log` shows the time of day).
pub fn log_time() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    format_utc(secs)
}

pub use jujube_core::time::format_utc;

#[cfg(test)]
mod tests {
    #[test]
    fn log_times_are_utc_calendar_times() {
        assert_eq!(super::format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(super::format_utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(super::format_utc(1_795_590_882), "2026-11-25 07:14:42");
        assert_eq!(super::format_utc(4_107_542_399), "2100-02-28 23:59:59");
    }
}
