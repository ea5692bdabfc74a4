//! jujube's controller: what runs machine 0's jobs for one environment —
//! the state store, the provisioner, the cleaner, the host of the agents
//! that run in its process, the API server and the client facade that
//! answers users' commands — and what sets an environment up and takes it
//! down on the host that holds it.
//!
//! # Layout
//! - [`run`]: `run` (the controller until SIGINT/SIGTERM: API server
//!   first, then provisioner, cleaner and agents' host), building the
//!   environment's provider, config validation, the controller's lock,
//!   `Placement` (where machine agents run), the `Installer` and the
//!   `Enrolls` the provisioner and the API server are given, `bootstrap`'s
//!   machine 0, `destroy`, and what `wait` reports.
//! - [`facade`]: the client facade — every `ClientCall` answered on a
//!   store handle acting for the proven user.
//! - [`home`]: `$JUJUBE_HOME` — the environments this host holds (machine
//!   0's disk on the dummy) and what its client knows of controllers.
//! - [`supervise`]: machine 0's controller on the dummy, kept running by a
//!   supervisor process.
//! - [`machine0`]: machine 0's container as the controller on LXD — the
//!   store moved in at bootstrap, and taken away by `destroy-environment`.
//! - [`machine0_ec2`]: machine 0's instance as the controller on EC2 — the
//!   control bucket, the controller's IAM role and instance profile, the
//!   hand-over through the bucket that `jujube take-up` reads on machine 0,
//!   and the teardown.
//! - [`singletons`]: the provisioner and the cleaner run only while this
//!   controller holds the `singletons` lease, with a store fenced by its
//!   token.
//! - [`charm`]: reading a charm directory.
//!
//! The `jujube` binary (`cli`) runs these; it never opens the store itself.

pub mod charm;
pub mod facade;
pub mod home;
pub mod machine0;
pub mod machine0_ec2;
pub mod run;
pub mod singletons;
pub mod supervise;

pub use home::Home;

/// Everything the controller refuses or fails with. Most refusals are
/// words for the user (what was wrong, what to do); the rest carry their
/// component's error, and [`Error::Context`] says what was being done.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Refused(String),
    /// The request itself was malformed (a command line's exit code 2).
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Context { what: String, source: Box<Error> },
    #[error(transparent)]
    State(#[from] jujube_state::Error),
    #[error(transparent)]
    Core(#[from] jujube_core::Error),
    #[error(transparent)]
    Provider(#[from] jujube_providers::Error),
    #[error(transparent)]
    Provisioner(#[from] jujube_provisioner::Error),
    #[error(transparent)]
    Api(#[from] jujube_api::Error),
    #[error("{}", .0.message)]
    Agent(#[from] jujube_agent::api::ApiError),
    #[error(transparent)]
    AgentRun(#[from] jujube_agent::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("a task of the controller failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// This controller could not reach its state database: nothing was
    /// decided, and another controller may answer.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::State(e) => e.is_unavailable(),
            Error::Context { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }
}

/// What was being done when an error happened, as its message's start.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            what: what.into(),
            source: Box::new(e.into()),
        })
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::Context {
            what: what(),
            source: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::Refused(what.into()))
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| Error::Refused(what()))
    }
}

/// Returns a refusal worded as `format!` words it.
#[macro_export]
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::Error::Refused(format!($($t)*)))
    };
}

/// A refusal worded as `format!` words it.
#[macro_export]
macro_rules! refusal {
    ($($t:tt)*) => {
        $crate::Error::Refused(format!($($t)*))
    };
}
