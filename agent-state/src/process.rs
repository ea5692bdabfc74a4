//! Machine agents as processes of their own (`dummy-agents=process`): the
//! host gives each machine a fresh credential (its hash stored, the secret
//! written only to the machine's `agent.conf`, mode 0600) and runs `jujube
//! agent --data-dir DIR` there, restarting it with backoff if it dies. The
//! process talks to the controller only through the API server.
//!
//! An agent process outlives a controller killed with -9 (as a real
//! machine's agent outlives its controller): the next controller finds it by
//! the lock it holds on its directory (`agent.lock`; its pid file may never
//! have been written, if the controller died just after starting it) and
//! its command line, leaves it running and watches it, and the agent
//! reconnects to the new API server by itself. A controller stopping
//! normally stops its agent processes; `destroy-environment` stops any left
//! over, found the same way, and says how many.
//!
//! This is what a cloud instance's boot script does for a real machine: a
//! credential made when the machine is provisioned, written where only the
//! agent reads it.

use jujube_agent::api::Tag;
use jujube_agent::wire::{new_secret, secret_hash, AgentConf};
use jujube_state::Store;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{info, warn};

/// What an agent process is started with.
#[derive(Clone)]
pub struct ProcessAgents {
    /// The `jujube` binary.
    pub exe: PathBuf,
    pub api_addresses: Vec<String>,
    pub ca_cert: String,
    pub env_name: String,
    pub env_uuid: String,
}

impl ProcessAgents {
    /// The `agent.conf` of the agent `tag` with `secret`.
    pub fn conf(&self, tag: Tag, secret: String) -> AgentConf {
        AgentConf {
            api_addresses: self.api_addresses.clone(),
            ca_cert: self.ca_cert.clone(),
            tag,
            secret,
            env_name: self.env_name.clone(),
            env_uuid: self.env_uuid.clone(),
        }
    }
}

/// Runs machine `id`'s agent process in `dir` until `stop`, or until it
/// exits by itself (its machine is Dead).
pub(crate) async fn supervise(
    store: Store,
    p: ProcessAgents,
    id: i64,
    dir: PathBuf,
    stop: jujube_agent::Stop,
) {
    let tag = Tag::Machine(id);
    let mut backoff = Duration::from_millis(200);
    loop {
        if stop.is_stopped() {
            return;
        }
        if holds_lock(&dir) {
            let pid = running_agent(&dir);
            info!(agent = %tag, pid, "agent process still running; adopting it");
            // Recorded now if its start never was: a later death of it is
            // then told from its machine's end (which removes the record).
            if let Some(pid) = pid {
                let _ = std::fs::write(dir.join(PID), pid.to_string());
            }
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.stopped() => {
                        if let Some(pid) = pid.or_else(|| running_agent(&dir)) {
                            terminate(pid).await;
                        }
                        return;
                    }
                }
                if !holds_lock(&dir) {
                    break;
                }
            }
            if !dir.join(PID).exists() {
                return; // it finished: its machine is Dead
            }
            continue;
        }
        match start(&store, &p, &tag, id, &dir).await {
            Ok(mut child) => {
                let pid = child.id();
                info!(agent = %tag, pid, "agent process started");
                tokio::select! {
                    status = child.wait() => match status {
                        Ok(s) if s.success() => {
                            info!(agent = %tag, "agent process finished");
                            let _ = std::fs::remove_file(dir.join(PID));
                            return;
                        }
                        Ok(s) => warn!(agent = %tag, status = %s, "agent process died; restarting"),
                        Err(e) => warn!(agent = %tag, error = %e, "cannot wait for the agent process"),
                    },
                    _ = stop.stopped() => {
                        // SIGTERM: it stops its unit agents and exits; what
                        // it deployed stays for the next start.
                        if let Some(pid) = pid {
                            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                        }
                        if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
                            let _ = child.kill().await;
                        }
                        let _ = std::fs::remove_file(dir.join(PID));
                        return;
                    }
                }
            }
            Err(e) => warn!(agent = %tag, error = %e, "cannot start the agent process"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.stopped() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

async fn start(
    store: &Store,
    p: &ProcessAgents,
    tag: &Tag,
    id: i64,
    dir: &std::path::Path,
) -> Result<tokio::process::Child, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    // The provisioner gave the machine its credential when it started the
    // instance (the dummy writes it here, as a cloud's boot script would).
    // A machine provisioned by an older controller has none: it gets one now.
    if !dir.join("agent.conf").is_file() {
        let secret = new_secret();
        let (st, key, hash) = (store.clone(), tag.to_string(), secret_hash(&secret));
        tokio::task::spawn_blocking(move || st.set_machine_credential(id, &key, &hash))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        p.conf(tag.clone(), secret)
            .write(&dir.join("agent.conf"))
            .map_err(|e| e.to_string())?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("agent.log"))
        .map_err(|e| format!("cannot open the agent's log: {e}"))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    let child = tokio::process::Command::new(&p.exe)
        .arg("agent")
        .arg("--data-dir")
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot run `{}`: {e}", p.exe.display()))?;
    if let Some(pid) = child.id() {
        std::fs::write(dir.join(PID), pid.to_string())
            .map_err(|e| format!("cannot write the agent's pid file: {e}"))?;
    }
    Ok(child)
}

const PID: &str = "agent.pid";

fn alive(pid: u32) -> bool {
    // Signal 0 checks existence; a zombie of ours would still count, but
    // adopted agents are never our children.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Whether an agent process holds `dir`'s lock: it runs, whether or not its
/// pid was recorded. (Taking the lock for a moment to find out could make an
/// agent starting at that very moment exit; its supervisor starts it again.)
fn holds_lock(dir: &std::path::Path) -> bool {
    let Ok(f) = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("agent.lock"))
    else {
        return false;
    };
    match f.try_lock() {
        Ok(()) => {
            let _ = f.unlock();
            false
        }
        Err(std::fs::TryLockError::WouldBlock) => true,
        Err(std::fs::TryLockError::Error(_)) => false,
    }
}

/// Whether `pid` runs `jujube agent` for `dir` (a pid reused by something
/// else is not it).
fn runs_agent_for(pid: u32, dir: &std::path::Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    args.contains(&b"agent".as_slice()) && args.contains(&dir.as_os_str().as_encoded_bytes())
}

/// The agent process running for `dir`: the one its pid file names, else
/// found among the processes by its command line.
fn running_agent(dir: &std::path::Path) -> Option<u32> {
    let recorded = std::fs::read_to_string(dir.join(PID))
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        .filter(|&pid| runs_agent_for(pid, dir));
    recorded.or_else(|| {
        std::fs::read_dir("/proc")
            .ok()?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .find(|&pid| runs_agent_for(pid, dir))
    })
}

async fn terminate(pid: u32) {
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    for _ in 0..100 {
        if !alive(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// Stops every agent process left under `agents_dir` (a controller killed
/// with -9 leaves them running, recorded or not); for `destroy-environment`.
/// Returns how many it stopped.
pub async fn stop_all(agents_dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(agents_dir) else {
        return 0;
    };
    let mut stopped = 0;
    for e in entries.flatten() {
        if let Some(pid) = running_agent(&e.path()) {
            terminate(pid).await;
            stopped += 1;
        }
    }
    stopped
}
