//! jujube's agents: the machine agent and the unit agent, and the facade
//! they see the model through.
//!
//! # Layout
//! - [`api`]: the [`Facade`](api::Facade) trait — the wire contract, scoped
//!   to the agent's own entity — and its plain-data types.
//! - [`charmdir`]: what of a charm directory is shipped (to agents, and a
//!   client's upload to the controller) and the upload's archive.
//! - [`deployer`]: deploying units (a directory per unit with the charm
//!   copied in, and a running unit agent), recalling them, and the
//!   deployer's duties shared by machine agents (principals) and unit agents
//!   (subordinates). The directories are the record of what was deployed.
//! - [`machine`], [`unit`]: the agents' duties as one idempotent pass each,
//!   run whenever a notice says something they can see changed.
//! - `run`: the loop of passes; an agent waiting for anything (a notice,
//!   its retry timer, a pass's permit) is parked without a task
//!   ([`Running`] is its handle).
//!
//! - [`wire`]: the facade on the wire (one `Call` per method), agent
//!   credentials and `agent.conf`; [`remote`]: the facade as a client of
//!   the controller's API server (HTTP/2 over TLS, trusting only the
//!   environment's CA).
//!
//! Agents never import the state store: everything goes through the facade,
//! so the same agent code runs over the in-process implementation
//! (`jujube-agent-state`) or a remote one.

pub mod api;
pub mod charmdir;
pub mod deployer;
pub mod hooks;
pub mod machine;
pub mod remote;
mod run;
pub mod startup;
pub mod unit;
pub mod wire;

pub use run::{PassPermit, Passes, Running};

use api::{ApiError, Facade, WatchTarget};
use futures_util::task::AtomicWaker;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("cannot {action} `{}`: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a pass found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do until something changes.
    Idle,
    /// It changed something: look again at once.
    Again,
    /// The entity is Dead or gone: the agent stops for good.
    Done,
}

/// An agent: one idempotent pass over its view, and what to watch.
#[allow(async_fn_in_trait)]
pub trait Agent: Send {
    fn api(&self) -> &Arc<dyn Facade>;
    fn target(&self) -> WatchTarget;
    /// Everything the agent watches; it is resubscribed whenever this
    /// changes after a pass (a unit agent watches the scopes it is in).
    fn targets(&self) -> Vec<WatchTarget> {
        vec![self.target()]
    }
    /// The bound on passes shared with the other agents of this process
    /// (its connector's [`Connector::passes`](api::Connector::passes)).
    fn passes(&self) -> Option<Arc<crate::Passes>> {
        None
    }
    async fn step(&mut self) -> Result<Step>;
    /// Whether its start counts in [`startup`] (unit agents).
    fn counts_start(&self) -> bool {
        false
    }
    /// When the agent wants a pass though nothing it watches changed (a
    /// unit agent's `update-status`); `None`: only on a notice.
    fn wake_at(&self) -> Option<tokio::time::Instant> {
        None
    }
    /// Reports a failed pass (best effort).
    async fn failed(&mut self, message: &str);
    /// Stops whatever the agent runs (its deployed units' agents).
    async fn finish(&mut self);
}

/// Tells a task to stop (an agent process's supervisor; an agent itself is
/// stopped through its [`Running`]). A flag and the one task that waits on
/// it; clones share the flag; only one task may wait on it (one waker is
/// kept).
#[derive(Clone, Default)]
pub struct Stop(Arc<StopCell>);

#[derive(Default)]
struct StopCell {
    stopped: AtomicBool,
    waker: AtomicWaker,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// Asks the agent to stop; it finishes the pass it is in first.
    pub fn stop(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        self.0.waker.wake();
    }

    pub fn is_stopped(&self) -> bool {
        self.0.stopped.load(Ordering::SeqCst)
    }

    /// Ready once [`Stop::stop`] was called; registers the waiting task.
    pub fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_stopped() {
            return Poll::Ready(());
        }
        self.0.waker.register(cx.waker());
        // A stop between the check and the registration woke nobody.
        if self.is_stopped() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Waits for [`Stop::stop`].
    pub async fn stopped(&self) {
        std::future::poll_fn(|cx| self.poll_stopped(cx)).await
    }
}
