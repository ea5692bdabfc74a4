//! The API server: the agent facade served over the network, so that agents
//! run on the machines they manage and never touch the store.
//!
//! # Layout
//! - [`tls`]: the environment's CA and the server certificate, kept in the
//!   environment's data dir; agents trust exactly that CA.
//! - [`server`]: [`ApiServer`], HTTP/2 over TLS on a TCP address and a unix
//!   socket. Every request names its agent (`x-jujube-tag`) and proves it
//!   (`authorization: Bearer SECRET`, checked against the hash the store
//!   keeps); the call then runs on the facade scoped to that agent
//!   (`jujube_agent_state`), whose scope check is the authorisation — the
//!   same code that confines in-process agents.
//! - [`clients`]: users' requests on the same server — the client facade
//!   (a user and its password, checked against the store's argon2id hash,
//!   guesses slowed) and registration; what a user may do is checked by
//!   the store in each call's transaction.
//!
//! - [`handover`]: machine 0's one-shot listener on EC2 that takes the
//!   environment's state and the user's credentials from `bootstrap`.
//!
//! The wire format is `jujube_agent::wire` (one `Call` per facade method);
//! the client is `jujube_agent::remote::Remote`.

pub mod clients;
pub mod handover;
pub mod server;
pub mod tls;

pub use server::{ApiServer, Limits};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot use `{}`: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Tls(String),
    #[error("cannot listen on `{address}`: {source}; set `api-address` to a free address, e.g. `127.0.0.1:0`")]
    Listen {
        address: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    State(#[from] jujube_state::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests;
