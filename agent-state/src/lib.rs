//! The agent facade over the state store, and the host that runs agents in
//! the controller's process.
//!
//! # Layout
//! - [`facade`]: [`InProcess`](facade::InProcess), the store scoped to one
//!   agent's entity (every out-of-scope call refused), with one writer
//!   thread group-committing every agent's writes.
//! - `hub`: one change-feed reader routing "something you can see changed"
//!   notices to exactly the agents concerned.
//! - [`host`]: [`Host`], one machine agent per machine that hosts units and
//!   has an instance, in this process; their unit agents run under them.
//! - [`logsink`]: [`LogSink`](logsink::LogSink), what unit agents ship of
//!   their logs, bounded and rotated on the controller's disk, for
//!   `debug-log`.
//! - [`process`]: the same agents as `jujube agent` processes talking to
//!   the API server (`dummy-agents=process`).
//!
//! The layering rule: agents (`jujube-agent`) never import the store, and
//! the store knows nothing of agents' code; this crate is the only one that
//! knows both.

pub mod facade;
pub mod host;
mod hub;
pub mod logsink;
pub mod process;

pub use host::{Host, Mode};
pub use hub::ControllerAddress;

use std::sync::Arc;

/// Facades over one store, for tests and tools that drive agents directly.
pub struct Facades {
    shared: Arc<facade::Shared>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Facades {
    /// Starts the change router and the writer for `store`. Must be called
    /// inside a tokio runtime.
    pub fn new(store: jujube_state::Store) -> jujube_state::Result<Facades> {
        let from = store.head_revision()?;
        let hub = Arc::new(hub::Hub::default());
        let shared = facade::Shared::new(store.clone(), hub.clone(), facade::PASSES);
        let (stop, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(hub.run(store, from, rx));
        Ok(Facades { shared, stop })
    }

    /// Machine agents are told (in their machine's view) to reach
    /// controller machine N's API at `reach(N)`, for every Alive controller
    /// machine, instead of where the controllers record that they serve:
    /// agents in LXD containers reach each one through a socket a proxy
    /// device puts in their container.
    pub fn agents_reach_controllers_at(
        &self,
        reach: ControllerAddress,
    ) -> jujube_state::Result<()> {
        self.shared
            .hub
            .reach_controllers_at(&self.shared.store, reach)
    }

    /// Keeps what agents ship of their logs in `sink` from now on.
    pub fn keep_logs(&self, sink: Arc<logsink::LogSink>) {
        let _ = self.shared.sink.set(sink);
    }

    /// Waits until changes are routed to watchers.
    pub async fn ready(&self) {
        self.shared.hub.ready().await
    }

    /// The facade scoped to `tag`.
    pub fn for_agent(&self, tag: jujube_agent::api::Tag) -> Arc<dyn jujube_agent::api::Facade> {
        Arc::new(facade::InProcess::new(self.shared.clone(), tag))
    }

    /// The facade scoped to `tag` for one call it sent with `stamp` (see
    /// `jujube_wire::calls::STAMP_HEADER`).
    pub fn for_agent_stamped(
        &self,
        tag: jujube_agent::api::Tag,
        stamp: jujube_state::Stamp,
    ) -> Arc<dyn jujube_agent::api::Facade> {
        Arc::new(facade::InProcess::stamped(self.shared.clone(), tag, stamp))
    }

    pub fn connector(&self) -> Arc<dyn jujube_agent::api::Connector> {
        Arc::new(facade::InProcessConnector(self.shared.clone()))
    }
}

impl Drop for Facades {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

#[cfg(test)]
mod tests;
