//! Runs the machine agents of an environment inside the controller: one per
//! machine that hosts units and has an instance, each deploying under
//! `<agents dir>/machine-N/`. Machines are followed through the hub (no scan
//! per change): a machine that gets its instance gets its agent; an agent
//! whose machine is Dead ends by itself; a removed machine's directory is
//! deleted. A restarted host resumes every agent where it stopped, from the
//! deployment directories; as it starts, it takes no unit's status as
//! current until that unit's in-process agent has reported under it (what
//! the agents of a killed controller said last may be stale).

use crate::facade::{InProcess, InProcessConnector, Shared};
use crate::hub::Hub;
use jujube_agent::api::Tag;
use jujube_agent::machine::MachineAgent;
use jujube_core::Life;
use jujube_state::{Machine, Store};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// How the host runs machine agents.
#[derive(Clone)]
pub enum Mode {
    /// As tasks of this process, on the in-process facade (the default:
    /// 100,000 units stay cheap).
    InProcess,
    /// As `jujube agent` processes, one per machine, reaching the controller
    /// only through its API (see [`crate::process`]).
    Process(crate::process::ProcessAgents),
}

/// A machine's agent: parked between passes in this process, or a
/// supervised agent process.
enum Running {
    InProcess(jujube_agent::Running),
    Process {
        stop: jujube_agent::Stop,
        handle: JoinHandle<()>,
    },
}

impl Running {
    fn is_finished(&self) -> bool {
        match self {
            Running::InProcess(r) => r.is_finished(),
            Running::Process { handle, .. } => handle.is_finished(),
        }
    }

    fn stop(&self) {
        match self {
            Running::InProcess(r) => r.stop(),
            Running::Process { stop, .. } => stop.stop(),
        }
    }

    async fn finished(self) {
        match self {
            Running::InProcess(r) => r.finished().await,
            Running::Process { handle, .. } => {
                let _ = handle.await;
            }
        }
    }
}

/// The agents of one environment, running in this process.
pub struct Host {
    stop: watch::Sender<bool>,
    runner: JoinHandle<()>,
    /// The change router, when the host started its own.
    hub: Option<JoinHandle<()>>,
}

fn wants_agent(m: &Machine) -> bool {
    m.hosts_units() && m.instance_id.is_some() && m.life != Life::Dead
}

fn machine_dir(dir: &Path, id: i64) -> PathBuf {
    dir.join(Tag::Machine(id).to_string())
}

impl Host {
    /// Starts the change router, the writer and the machine agents. Must be
    /// called inside a tokio runtime.
    pub fn start(store: Store, agents_dir: PathBuf) -> jujube_state::Result<Host> {
        Host::start_bounded(store, agents_dir, Mode::InProcess, crate::facade::PASSES)
    }

    /// As [`Host::start`], running the machine agents as `mode` says, with at
    /// most `passes` in-process agents in a pass at once (see
    /// `jujube_agent::Running`).
    pub fn start_bounded(
        store: Store,
        agents_dir: PathBuf,
        mode: Mode,
        passes: usize,
    ) -> jujube_state::Result<Host> {
        mark_restarting(&store, &mode)?;
        // Before any agent subscribes: see `Hub::run`.
        let from = store.head_revision()?;
        let hub = Arc::new(Hub::default());
        let shared = Shared::new(store.clone(), hub.clone(), passes);
        let (stop, stop_rx) = watch::channel(false);
        let hub_task = tokio::spawn(hub.run(store, from, stop_rx.clone()));
        Ok(Host::spawn(
            shared,
            agents_dir,
            mode,
            (stop, stop_rx),
            Some(hub_task),
        ))
    }

    /// As [`Host::start_bounded`], on the change router and writer of
    /// `facades` (the API server's): a controller then keeps one copy of
    /// what routing needs, not two, and routes each change once. The
    /// agents write through `store`, a handle on `facades`' database: the
    /// controller gives its lease-fenced one, so that once another
    /// controller holds the lease nothing these agents still had in flight
    /// is written.
    pub fn on(
        facades: &crate::Facades,
        store: Store,
        agents_dir: PathBuf,
        mode: Mode,
    ) -> jujube_state::Result<Host> {
        mark_restarting(&store, &mode)?;
        let shared = facades.shared.through(store);
        Ok(Host::spawn(
            shared,
            agents_dir,
            mode,
            watch::channel(false),
            None,
        ))
    }

    fn spawn(
        shared: Arc<Shared>,
        agents_dir: PathBuf,
        mode: Mode,
        (stop, stop_rx): (watch::Sender<bool>, watch::Receiver<bool>),
        hub: Option<JoinHandle<()>>,
    ) -> Host {
        let router = shared.hub.clone();
        let runner = tokio::spawn(run(shared, router, agents_dir, Arc::new(mode), stop_rx));
        Host { stop, runner, hub }
    }

    /// Stops every agent (keeping what they deployed) and waits for them.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        let _ = self.runner.await;
        if let Some(hub) = self.hub {
            let _ = hub.await;
        }
    }
}

/// Before any in-process agent of a host runs (and before its start
/// returns, so that whoever starts a host never sees its units as they
/// were): what the units' previous agents reported, which died with the
/// previous host, is no longer taken as current; see
/// `Store::agents_restarting`. Agent processes outlive their host (see
/// `crate::process`) and are adopted, not restarted: what they reported
/// stands, and the API server tells when they are down.
fn mark_restarting(store: &Store, mode: &Mode) -> jujube_state::Result<()> {
    if matches!(mode, Mode::InProcess) {
        let n = store.agents_restarting()?;
        info!(units = n, "units wait for their agents to report again");
    }
    Ok(())
}

async fn run(
    shared: Arc<Shared>,
    hub: Arc<Hub>,
    dir: PathBuf,
    mode: Arc<Mode>,
    mut stop: watch::Receiver<bool>,
) {
    let connector: Arc<dyn jujube_agent::api::Connector> =
        Arc::new(InProcessConnector(shared.clone()));
    let store = shared.store.clone();
    let mut running: HashMap<i64, Running> = HashMap::new();
    let start = |id: i64, running: &mut HashMap<i64, Running>| {
        if running.get(&id).is_some_and(|r| !r.is_finished()) {
            return;
        }
        let r = match &*mode {
            Mode::InProcess => {
                let api = Arc::new(InProcess::new(shared.clone(), Tag::Machine(id)));
                let agent = MachineAgent::new(api, connector.clone(), id, &machine_dir(&dir, id));
                Running::InProcess(agent.spawn())
            }
            Mode::Process(p) => {
                let stop = jujube_agent::Stop::new();
                let handle = tokio::spawn(crate::process::supervise(
                    shared.store.clone(),
                    p.clone(),
                    id,
                    machine_dir(&dir, id),
                    stop.clone(),
                ));
                Running::Process { stop, handle }
            }
        };
        running.insert(id, r);
    };
    // Everything once; then only what the hub says changed.
    loop {
        match store.machines() {
            Ok(ms) => {
                let ids: std::collections::HashSet<i64> = ms.iter().map(|m| m.id).collect();
                for m in ms.iter().filter(|m| wants_agent(m)) {
                    start(m.id, &mut running);
                }
                remove_stale_dirs(&dir, &ids);
                info!(agents = running.len(), "machine agents started");
                break;
            }
            Err(e) => {
                warn!(error = %e, "cannot list machines; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    _ = stop.changed() => break,
                }
            }
        }
    }
    let mut sweeps = 0u64;
    while !*stop.borrow() {
        tokio::select! {
            _ = hub.machines_changed.notified() => {}
            r = stop.changed() => if r.is_err() { break } else { continue },
        }
        // One read snapshot for every machine the hub named (a wake after
        // a provisioning batch names a thousand).
        let ids: Vec<i64> = hub.take_machine_events().into_iter().collect();
        let found = match store.machines_with_ids(&ids) {
            Ok(found) => found,
            Err(e) => {
                // Kept, and looked at again in a second.
                warn!(error = %e, "cannot read machines; retrying");
                hub.keep_machine_events(ids);
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    _ = stop.changed() => {}
                }
                hub.machines_changed.notify_one();
                continue;
            }
        };
        for (id, m) in ids.into_iter().zip(found) {
            match m {
                Some(m) if wants_agent(&m) => start(id, &mut running),
                Some(_) => {}
                None => {
                    if let Some(r) = running.remove(&id) {
                        r.stop();
                        r.finished().await;
                    }
                    let d = machine_dir(&dir, id);
                    if let Err(e) = std::fs::remove_dir_all(&d) {
                        if e.kind() != std::io::ErrorKind::NotFound {
                            warn!(dir = %d.display(), error = %e, "cannot remove a removed machine's directory");
                        }
                    }
                }
            }
        }
        // Finished agents are started again by `start` when their machine
        // changes; the map is swept of them now and then, not on every
        // wake (it holds an entry per machine).
        sweeps += 1;
        if sweeps.is_multiple_of(64) {
            running.retain(|_, r| !r.is_finished());
        }
    }
    for r in running.values() {
        r.stop();
    }
    for (_, r) in running {
        r.finished().await;
    }
}

/// Directories of machines that no longer exist (removed while no
/// controller ran).
fn remove_stale_dirs(dir: &Path, ids: &std::collections::HashSet<i64>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(id) = name
            .strip_prefix("machine-")
            .and_then(|s| s.parse::<i64>().ok())
        {
            if !ids.contains(&id) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}
