//! Charms in action: the hooks a unit agent runs and the hook tools they
//! call (charms-in-action.txt).
//!
//! # Layout
//! - [`state`]: what the unit agent has run, persisted in the unit's
//!   directory (`hooks.json`) after every hook, so that a restarted agent
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
pub const TOOLS: [&str; 9] = [
    "juju-log",
    "open-port",
    "close-port",
    "unit-get",
    "config-get",
    "relation-get",
    "relation-set",
    "relation-ids",
    "relation-list",
];
