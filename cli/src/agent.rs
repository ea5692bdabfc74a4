//! `jujube agent --data-dir DIR`: a machine agent (and, under it, its unit
//! agents) in a process of its own, reaching the controller only through its
//! API with the credential in `DIR/agent.conf`.
//!
//! Everything it deploys lives under `DIR`; its unit agents' credentials,
//! made through the API on first use, under `DIR/credentials/`. When the
//! controller restarts, calls fail as unavailable and are retried with
//! backoff, and watches resume from the last revision they saw; a restarted
//! agent resumes from its directories.

use anyhow::{anyhow, Context, Result};
use jujube_agent::api::Tag;
use jujube_agent::machine::MachineAgent;
use jujube_agent::remote::{Remote, RemoteConnector};
use jujube_agent::wire::AgentConf;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::{info, warn};

pub const CONF: &str = "agent.conf";

pub async fn run(data_dir: &Path) -> Result<()> {
    let path = data_dir.join(CONF);
    let conf = AgentConf::read(&path).map_err(|e| {
        anyhow!(
            "cannot read `{}`: {e}; `jujube agent` needs the `{CONF}` its controller wrote in `--data-dir`",
            path.display()
        )
    })?;
    let Tag::Machine(id) = conf.tag else {
        return Err(anyhow!(
            "`{}` is for `{}`; `jujube agent` runs machine agents (unit agents run under them)",
            path.display(),
            conf.tag
        ));
    };
    // One agent per directory: a second one would deploy the same units.
    let lock_path = data_dir.join("agent.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot open `{}`", lock_path.display()))?;
    if lock.try_lock().is_err() {
        return Err(anyhow!(
            "another agent runs in `{}`; stop it first",
            data_dir.display()
        ));
    }
    jujube_agent::hooks::runner::set_environment(jujube_agent::hooks::runner::Environment {
        name: conf.env_name.clone(),
        uuid: conf.env_uuid.clone(),
        api_addresses: conf.api_addresses.clone(),
        exe: std::env::current_exe().ok(),
        private_address: None,
    });
    let api = Arc::new(Remote::new(&conf).map_err(|e| anyhow!("{e}"))?);
    let creds = data_dir.join("credentials");
    std::fs::create_dir_all(&creds)
        .with_context(|| format!("cannot create `{}`", creds.display()))?;
    let api_check = api.clone();
    let follower = follow_controllers(api.clone(), path.clone(), conf.clone());
    let connector = Arc::new(RemoteConnector::new(api.clone(), creds).observing(follower));
    let agent = MachineAgent::new(api, connector, id, data_dir);
    let running = agent.spawn();
    info!(agent = %conf.tag, addresses = ?conf.api_addresses, "agent started");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // A refused credential is not a dead machine: the agent says so and
    // exits non-zero, and its supervisor (systemd, the container's init,
    // the controller) starts it again, with whatever `agent.conf` holds by
    // then (a new start attempt or enrollment writes a new one). Refused on
    // two checks in a row, 5 s apart, to outlast one stale call.
    let mut check = tokio::time::interval(std::time::Duration::from_secs(5));
    let mut refused = 0;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = running.finished() => {
                info!(agent = %conf.tag, "machine is dead; agent stopped");
                return Ok(());
            }
            _ = check.tick() => {
                refused = if api_check.credential_refused() { refused + 1 } else { 0 };
                if refused >= 2 {
                    running.stop();
                    running.finished().await;
                    return Err(anyhow!(
                        "the controller refuses this agent's credential (`{}`): it was replaced by a newer start attempt or enrollment, or its machine was removed; exiting so that the agent is started again with the `agent.conf` it has then",
                        conf.tag
                    ));
                }
            }
        }
    }
    running.stop();
    running.finished().await;
    info!(agent = %conf.tag, "agent stopped");
    drop(lock);
    Ok(())
}

/// Keeps the agent's API addresses (and `agent.conf`'s, for its next start,
/// and its hooks' `JUJU_API_ADDRESSES`) those of every controller as
/// controllers are added: a machine agent installed when machine 0's
/// controller was the only one fails over to the others later (see
/// `followed_addresses` for which agents follow). Each view of its machine
/// the agent reads carries them (a change of them is a change of every
/// machine; see `Connector::machine_view`); the unit agents it runs share
/// its addresses.
fn follow_controllers(
    api: Arc<Remote>,
    path: PathBuf,
    conf: AgentConf,
) -> jujube_agent::remote::Observer {
    let conf = std::sync::Mutex::new(conf);
    Box::new(move |view: &jujube_agent::api::MachineView| {
        let Some(next) = api.follow_controllers(&view.api_addresses) else {
            return;
        };
        info!(addresses = ?next, "the controllers serve elsewhere now; following them");
        jujube_agent::hooks::runner::follow_api_addresses(&next);
        let mut conf = conf.lock().unwrap_or_else(|e| e.into_inner());
        conf.api_addresses = next;
        if let Err(e) = conf.write(&path) {
            warn!(error = %e, "cannot record the controllers' addresses in `{}`", path.display());
        }
    })
}
