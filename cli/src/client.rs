//! How the CLI reaches an environment: every command is a series of
//! [`ClientCall`]s, answered by the client facade ([`crate::facade`]).
//!
//! [`Client::Local`]: the environment's store is on this host (this
//! `JUJUBE_HOME` bootstrapped it), and the facade runs in process acting
//! for `admin`. The calls, their checks and their refusals are the ones the
//! API server answers remote users with.

use crate::home::Home;
use anyhow::Result;
use jujube_wire::client::{ClientCall, ClientError};
use serde::de::DeserializeOwned;

pub enum Client<'a> {
    Local {
        home: &'a Home,
        name: String,
        store: jujube_state::Store,
    },
}

impl<'a> Client<'a> {
    /// The client of environment `name` of `home`.
    pub fn open(home: &'a Home, name: &str) -> Result<Client<'a>> {
        let store = home.open(name)?;
        // `admin`, made by `bootstrap`; an environment bootstrapped before
        // users existed has none, and its owner's handle is unscoped.
        let admin = jujube_state::users::ADMIN;
        let store = match store.login(admin)? {
            Some(_) => store.as_user(admin),
            None => store,
        };
        Ok(Client::Local {
            home,
            name: name.to_string(),
            store,
        })
    }

    /// Makes `call`; its answer read as `T`. A refusal is an error whose
    /// message is the controller's words (a usage error exits 2).
    pub fn call<T: DeserializeOwned>(&self, call: ClientCall) -> Result<T> {
        let answer = match self {
            Client::Local { home, name, store } => {
                let zones = |store: &jujube_state::Store| {
                    let rt = crate::runtime().ok()?;
                    crate::facade::zones_on(rt.handle(), home, name, store)
                };
                let cx = crate::facade::Context { zones: &zones };
                crate::facade::call(&cx, store, call)
            }
        };
        match answer {
            Ok(v) => Ok(serde_json::from_value(v)?),
            Err(ClientError {
                message,
                usage: true,
            }) => Err(crate::usage(message)),
            Err(e) => Err(e.into()),
        }
    }
}
