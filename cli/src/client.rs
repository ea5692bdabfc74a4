//! How the CLI reaches an environment: every command is a series of
//! [`ClientCall`]s to its controller's API (TLS, trusting only the
//! environment's CA), logged in with this home's account, answered by the
//! client facade ([`crate::facade`]) — whether this home bootstrapped the
//! environment or registered with it.

use anyhow::{anyhow, Result};
use jujube_agent::api::{ApiResult, ErrorCode};
use jujube_agent::remote::UserClient;
use jujube_controller::home::{Account, ControllerEntry, Home};
use jujube_wire::client::{ClientCall, ClientError};
use serde::de::DeserializeOwned;
use std::future::Future;
use std::time::{Duration, Instant};

pub struct Client {
    name: String,
    addresses: Vec<String>,
    client: UserClient,
    runtime: tokio::runtime::Runtime,
    /// While a controller is known to run (its lock or its supervisor is
    /// on this host), how long to keep trying to reach it: it may be
    /// starting, or restarting.
    patience: Duration,
    /// What to check when it cannot be reached.
    hint: String,
}

/// How long a command keeps trying a controller that runs on this host but
/// does not answer yet (it is starting, or restarting under its
/// supervisor).
const STARTING_PATIENCE: Duration = Duration::from_secs(20);

impl Client {
    /// The client of environment `name` of `home`.
    pub fn open(home: &Home, name: &str) -> Result<Client> {
        let here = home.has_store(name);
        if here && home.controller(name)?.is_none() {
            jujube_controller::run::adopt(home, name)?;
        }
        let (Some(controller), Some(account)) = (home.controller(name)?, home.account(name)?)
        else {
            return Err(anyhow!(
                "not logged in to environment `{name}`; log in with `jujube login` (or register with the string an admin's `jujube add-user` printed)"
            ));
        };
        // Where this home runs the controller: a controller holding its
        // lock, or its supervisor, may be starting — worth a little
        // patience; none at all is said at once.
        let (patience, hint) = if let Some(m0) = jujube_controller::machine0::hosted(home, name)? {
            // Machine 0's container may be restarting, and its init
            // starting the controller again.
            let hint = if m0.provider == "ec2" {
                format!(
                    "it runs on machine 0's instance `{}`: check that it runs, and the log of its service (`journalctl -u jujube-controller` there)",
                    m0.container
                )
            } else {
                format!(
                    "it runs in machine 0's container `{}`: check that it runs, and its log `{}/environments/{name}/controller.log` there",
                    m0.container,
                    jujube_providers::lxd::controller::CONTROLLER_HOME
                )
            };
            (STARTING_PATIENCE, hint)
        } else if !here {
            (Duration::ZERO, "check that it runs".to_string())
        } else if jujube_controller::supervise::seats_here(home, name)
            .into_iter()
            .any(|m| {
                jujube_controller::run::controller_runs(home, name, m)
                    || jujube_controller::supervise::running(home, name, m).is_some()
            })
        {
            (
                STARTING_PATIENCE,
                format!(
                    "it runs on this host but does not answer; see `{}`",
                    jujube_controller::supervise::log_path(home, name, 0).display()
                ),
            )
        } else {
            (
                Duration::ZERO,
                "no controller runs for it on this host: start one with `jujube controller`"
                    .to_string(),
            )
        };
        Client::remote(name, &controller, &account, patience, hint)
    }

    /// A client of `name`'s controller at `controller`, as `account`.
    pub fn remote(
        name: &str,
        controller: &ControllerEntry,
        account: &Account,
        patience: Duration,
        hint: String,
    ) -> Result<Client> {
        let client = UserClient::new(
            &controller.addresses,
            &controller.ca_cert,
            &account.user,
            &account.password,
        )
        .map_err(|e| anyhow!("{}", e.message))?;
        Ok(Client {
            name: name.to_string(),
            addresses: controller.addresses.clone(),
            client,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            patience,
            hint,
        })
    }

    /// The environment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name a call gives the charm at `dir`: the id of its upload.
    pub fn charm(&self, dir: &std::path::Path) -> Result<String> {
        self.request(|| self.client.upload_charm(dir))
    }

    /// Makes `call`, writing its answer's JSON to `out` as it arrives (a
    /// large status is printed while the rest is on its way). Sent again
    /// while the controller is starting, never once any of it is written.
    pub fn call_into(&self, call: ClientCall, out: &mut dyn std::io::Write) -> Result<()> {
        let out = std::cell::RefCell::new(out);
        let started = std::cell::Cell::new(false);
        self.answer(|| async {
            let mut sink = |b: &[u8]| {
                started.set(true);
                out.borrow_mut().write_all(b)
            };
            match self.client.call_into(&call, &mut sink).await {
                Err(e) if started.get() => Err(jujube_agent::api::ApiError::new(
                    ErrorCode::Internal,
                    format!("the answer was cut short: {}", e.message),
                )),
                r => r,
            }
        })
    }

    /// Makes `call`; its answer read as `T`. A refusal is an error whose
    /// message is the controller's words (a usage error exits 2).
    pub fn call<T: DeserializeOwned>(&self, call: ClientCall) -> Result<T> {
        self.request(|| self.client.call(&call))
    }

    /// Sends a request (again while the controller is starting, within
    /// the patience); its answer read as `T`.
    fn request<'c, T, F, Fut>(&'c self, send: F) -> Result<T>
    where
        T: DeserializeOwned,
        F: Fn() -> Fut,
        Fut: Future<Output = ApiResult<Result<jujube_agent::remote::Bytes, ClientError>>> + 'c,
    {
        Ok(serde_json::from_slice(&self.answer(send)?)?)
    }

    /// Sends a request as [`Client::request`] does; what `send` answers.
    fn answer<'c, T, F, Fut>(&'c self, send: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = ApiResult<Result<T, ClientError>>> + 'c,
    {
        let deadline = Instant::now() + self.patience;
        // Every controller is asked once, whatever the patience: one that
        // cannot reach its state database sends the next call to the next.
        let mut tries = 0;
        let answer = loop {
            tries += 1;
            match self.runtime.block_on(send()) {
                Ok(answer) => break answer,
                Err(e)
                    if jujube_agent::remote::answered_unavailable(&e)
                        && tries < self.addresses.len() => {}
                Err(e) if e.code == ErrorCode::Unavailable && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) if e.code == ErrorCode::Unavailable => {
                    return Err(anyhow!(
                        "cannot reach the controller of environment `{}` at {}: {}; {}",
                        self.name,
                        self.addresses
                            .iter()
                            .map(|a| format!("`{a}`"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        e.message,
                        self.hint
                    ))
                }
                // Never asked again: it may have been done.
                Err(e) if e.code == ErrorCode::Unanswered => {
                    return Err(anyhow!(
                        "{}: whether it was done is unknown; check with `jujube status` before asking again",
                        e.message
                    ))
                }
                Err(e) => return Err(anyhow!("{}", e.message)),
            }
        };
        match answer {
            Ok(v) => Ok(v),
            Err(ClientError {
                message,
                usage: true,
                ..
            }) => Err(crate::usage(message)),
            Err(e) => Err(e.into()),
        }
    }
}
