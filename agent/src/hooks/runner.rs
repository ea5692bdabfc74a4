//! Runs one hook in Juju's execution environment.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What every hook of this process is told about its environment.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    /// `JUJU_ENV_NAME`.
    pub name: String,
    /// `JUJU_API_ADDRESSES`: the controller's API addresses, space-separated.
    pub api_addresses: Vec<String>,
    /// The `jujube` binary the tool links point at.
    pub exe: Option<PathBuf>,
}

static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();

/// Set once by the process that runs agents (the controller or `jujube
/// agent`); hooks of a process that never sets it get empty values and no
/// tools.
pub fn set_environment(env: Environment) {
    let _ = ENVIRONMENT.set(env);
}

fn environment() -> Environment {
    ENVIRONMENT.get().cloned().unwrap_or_default()
}

/// Which hook, and about what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    pub name: String,
    /// The relation (`id`, this side's name) of a relation hook.
    pub relation: Option<(i64, String)>,
    /// The remote unit of `-joined`, `-changed`, `-departed`.
    pub remote: Option<String>,
}

impl Hook {
    pub fn unit(name: &str) -> Hook {
        Hook {
            name: name.to_string(),
            relation: None,
            remote: None,
        }
    }

    pub fn relation(rel: i64, rel_name: &str, kind: &str, remote: Option<&str>) -> Hook {
        Hook {
            name: format!("{rel_name}-relation-{kind}"),
            relation: Some((rel, rel_name.to_string())),
            remote: remote.map(str::to_string),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The charm has no such hook: nothing ran.
    Missing,
    Succeeded,
    /// Ran and failed, or could not run; the message says which.
    Failed(String),
}

/// The unit's tools directory: a link per hook tool to the `jujube` binary.
pub fn ensure_tools(unit_dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let Some(exe) = environment().exe else {
        return Ok(None);
    };
    let dir = unit_dir.join("tools");
    std::fs::create_dir_all(&dir)?;
    for tool in super::TOOLS {
        let link = dir.join(tool);
        if std::fs::read_link(&link).ok().as_deref() != Some(exe.as_path()) {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&exe, &link)?;
        }
    }
    Ok(Some(dir))
}

/// Runs `hook` for `unit` from `unit_dir/charm`, its output appended to
/// `log`.
pub async fn run(
    unit_dir: &Path,
    log: &Path,
    unit: &str,
    context_id: &str,
    socket: &Path,
    hook: &Hook,
) -> Outcome {
    use std::os::unix::fs::PermissionsExt;
    let charm = unit_dir.join("charm");
    let path = charm.join("hooks").join(&hook.name);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(_) => return Outcome::Missing,
    };
    if meta.permissions().mode() & 0o111 == 0 {
        return Outcome::Failed(format!(
            "hook \"{}\" is not executable; `chmod +x hooks/{}` in the charm",
            hook.name, hook.name
        ));
    }
    let env = environment();
    let tools = match ensure_tools(unit_dir) {
        Ok(t) => t,
        Err(e) => return Outcome::Failed(format!("cannot set up the hook tools: {e}")),
    };
    if let Some(parent) = log.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let log = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        Ok(f) => f,
        Err(e) => return Outcome::Failed(format!("cannot open the unit's log: {e}")),
    };
    let err = match log.try_clone() {
        Ok(f) => f,
        Err(e) => return Outcome::Failed(format!("cannot open the unit's log: {e}")),
    };
    let mut path_var = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into());
    if let Some(t) = &tools {
        path_var = format!("{}:{path_var}", t.display());
    }
    let mut cmd = tokio::process::Command::new(&path);
    cmd.current_dir(&charm)
        .env("PATH", path_var)
        .env("CHARM_DIR", &charm)
        .env("JUJU_UNIT_NAME", unit)
        .env("JUJU_CONTEXT_ID", context_id)
        .env("JUJU_AGENT_SOCKET", socket)
        .env("JUJU_API_ADDRESSES", env.api_addresses.join(" "))
        .env("JUJU_ENV_NAME", &env.name)
        .env_remove("JUJU_RELATION")
        .env_remove("JUJU_RELATION_ID")
        .env_remove("JUJU_REMOTE_UNIT")
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(err)
        .kill_on_drop(true);
    if let Some((id, name)) = &hook.relation {
        cmd.env("JUJU_RELATION", name)
            .env("JUJU_RELATION_ID", format!("{name}:{id}"));
    }
    if let Some(remote) = &hook.remote {
        cmd.env("JUJU_REMOTE_UNIT", remote);
    }
    match cmd.status().await {
        Ok(s) if s.success() => Outcome::Succeeded,
        Ok(s) => Outcome::Failed(format!("hook failed: \"{}\" ({s})", hook.name)),
        Err(e) => Outcome::Failed(format!("cannot run hook \"{}\": {e}", hook.name)),
    }
}
