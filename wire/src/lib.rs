//! The wire contract: the plain data that crosses the controller's API.
//!
//! # Layout
//! - [`view`]: what the store shows of the model (`status`, progress,
//!   strays, tasks) — made by the store, carried as is, rendered by the
//!   client.
//! - [`facade`]: the agents' facade — [`facade::Facade`], scoped to one
//!   agent's entity ([`facade::Tag`]), its plain data, errors and watches.
//! - [`calls`]: that facade on the wire — one [`calls::Call`] per method,
//!   [`calls::dispatch`], paths and headers, `agent.conf`, agent secrets.
//! - [`client`]: the client facade — one [`client::ClientCall`] per thing a
//!   user can ask of a controller, its answers, users and their access, and
//!   what the client keeps of the controllers it knows.

pub mod calls;
pub mod client;
pub mod facade;
pub mod view;
