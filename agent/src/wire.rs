//! The facade on the wire — one `Call` per facade method, the envelope,
//! paths and headers, `agent.conf`, agent secrets — is the wire contract in
//! `jujube-wire`; re-exported here for the agents.

pub use jujube_wire::calls::*;
