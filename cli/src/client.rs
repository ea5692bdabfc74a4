//! How the CLI reaches an environment: every command is a series of
//! [`ClientCall`]s, answered by the client facade ([`crate::facade`]).
//!
//! - [`Client::Remote`]: over the controller's API (TLS, trusting only the
//!   environment's CA), logged in with this home's account — what a
//!   registered user always uses, and the bootstrapping home while its
//!   controller runs.
//! - [`Client::Local`]: the environment's store is on this host (this home
//!   bootstrapped it) and no controller runs: the facade runs in process,
//!   acting for `admin`. The calls, their checks and their refusals are the
//!   ones the API server answers with.

use crate::home::Home;
use anyhow::{anyhow, Result};
use jujube_agent::api::ErrorCode;
use jujube_agent::remote::UserClient;
use jujube_wire::client::{ClientCall, ClientError};
use serde::de::DeserializeOwned;
use std::time::{Duration, Instant};

pub enum Client<'a> {
    Local {
        home: &'a Home,
        name: String,
        store: jujube_state::Store,
    },
    Remote {
        name: String,
        addresses: Vec<String>,
        client: Box<UserClient>,
        runtime: tokio::runtime::Runtime,
        /// While a controller is known to run (its lock is held on this
        /// host), how long to keep trying to reach it: it may be starting.
        patience: Duration,
    },
}

/// How long a command keeps trying a controller that runs on this host but
/// does not answer yet (it is starting, or restarting under its
/// supervisor).
const STARTING_PATIENCE: Duration = Duration::from_secs(20);

impl<'a> Client<'a> {
    /// The client of environment `name` of `home`.
    pub fn open(home: &'a Home, name: &str) -> Result<Client<'a>> {
        let remote = match (home.controller(name)?, home.account(name)?) {
            (Some(c), Some(a)) => Some((c, a)),
            _ => None,
        };
        let runs = crate::controller::controller_runs(home, name);
        if home.has_store(name) && (remote.is_none() || !runs) {
            let store = home.open(name)?;
            // `admin`, made by `bootstrap`; an environment bootstrapped
            // before users existed has none, and its owner's handle is
            // unscoped.
            let admin = jujube_state::users::ADMIN;
            let store = match store.login(admin)? {
                Some(_) => store.as_user(admin),
                None => store,
            };
            return Ok(Client::Local {
                home,
                name: name.to_string(),
                store,
            });
        }
        let Some((controller, account)) = remote else {
            return Err(anyhow!(
                "not logged in to environment `{name}`; log in with `jujube login` (or register with the string an admin's `jujube add-user` printed)"
            ));
        };
        Client::remote(
            name,
            &controller,
            &account,
            if runs {
                STARTING_PATIENCE
            } else {
                Duration::ZERO
            },
        )
    }

    /// A client of `name`'s controller at `controller`, as `account`.
    pub fn remote(
        name: &str,
        controller: &crate::home::ControllerEntry,
        account: &crate::home::Account,
        patience: Duration,
    ) -> Result<Client<'a>> {
        let client = UserClient::new(
            &controller.addresses,
            &controller.ca_cert,
            &account.user,
            &account.password,
        )
        .map_err(|e| anyhow!("{}", e.message))?;
        Ok(Client::Remote {
            name: name.to_string(),
            addresses: controller.addresses.clone(),
            client: Box::new(client),
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            patience,
        })
    }

    /// Whether calls go over the API.
    pub fn is_remote(&self) -> bool {
        matches!(self, Client::Remote { .. })
    }

    /// The name a call gives the charm at `dir`: its path where the
    /// controller reads this host's disk, else the id of its upload.
    pub fn charm(&self, dir: &std::path::Path) -> Result<String> {
        match self {
            Client::Local { .. } => Ok(dir.to_string_lossy().into_owned()),
            Client::Remote {
                client, runtime, ..
            } => {
                match runtime
                    .block_on(client.upload_charm(dir))
                    .map_err(|e| anyhow!("{}", e.message))?
                {
                    Ok(v) => Ok(serde_json::from_value(v)?),
                    Err(e) => Err(e.into()),
                }
            }
        }
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
                let cx = crate::facade::Context {
                    zones: &zones,
                    charms: None,
                };
                crate::facade::call(&cx, store, call)
            }
            Client::Remote {
                name,
                addresses,
                client,
                runtime,
                patience,
            } => {
                let deadline = Instant::now() + *patience;
                loop {
                    match runtime.block_on(client.call(&call)) {
                        Ok(answer) => break answer,
                        Err(e) if e.code == ErrorCode::Unavailable && Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        Err(e) if e.code == ErrorCode::Unavailable => {
                            return Err(anyhow!(
                                "cannot reach the controller of environment `{name}` at {}: {}; check that it runs (on the dummy, `jujube bootstrap` started it; its log is `controller.log` in the environment's directory)",
                                addresses.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", "),
                                e.message
                            ))
                        }
                        Err(e) => return Err(anyhow!("{}", e.message)),
                    }
                }
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
