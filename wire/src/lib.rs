//! The wire contract: the plain data that crosses the controller's API.
//!
//! # Layout
//! - [`view`]: what the store shows of the model (`status`, progress,
//!   strays, tasks) — made by the store, carried as is, rendered by the
//!   client.
//! - [`client`]: the client facade — one [`client::ClientCall`] per thing a
//!   user can ask of a controller, its answers, users and their access, and
//!   what the client keeps of the controllers it knows.

pub mod client;
pub mod view;
