//! Runs one hook in Juju's execution environment.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The `PATH` a hook gets when the agent has none.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What every hook of this process is told about its environment.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    /// `JUJU_ENV_NAME` and `JUJU_MODEL_NAME`.
    pub name: String,
    /// `JUJU_MODEL_UUID`: the environment's UUID.
    pub uuid: String,
    /// `JUJU_API_ADDRESSES`: the controller's API addresses, space-separated.
    pub api_addresses: Vec<String>,
    /// The `jujube` binary the tool links point at.
    pub exe: Option<PathBuf>,
    /// The address of the machine the agents run on: `unit-get
    /// private-address`, and what a unit writes into a relation as it joins
    /// (see [`local_address`]).
    pub private_address: Option<String>,
}

/// The address other machines reach this one at: the source address of
/// the route to the outside (no packet is sent: connecting a UDP socket
/// only picks the route), or loopback on a machine without one.
pub fn local_address() -> String {
    let probe = || -> std::io::Result<std::net::IpAddr> {
        let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
        // TEST-NET-1 (RFC 5737): never routed, never answered.
        s.connect("192.0.2.1:9")?;
        Ok(s.local_addr()?.ip())
    };
    match probe() {
        Ok(ip) if !ip.is_unspecified() => ip.to_string(),
        _ => "127.0.0.1".to_string(),
    }
}

/// This process's machine address (set by the process, else probed once).
pub fn private_address() -> String {
    static PROBED: OnceLock<String> = OnceLock::new();
    match environment().private_address {
        Some(a) => a,
        None => PROBED.get_or_init(local_address).clone(),
    }
}

static ENVIRONMENT: std::sync::RwLock<Option<Environment>> = std::sync::RwLock::new(None);

/// Set once by the process that runs agents (the controller or `jujube
/// agent`; a later call changes nothing); hooks of a process that never
/// sets it get empty values and no tools.
pub fn set_environment(env: Environment) {
    let mut held = ENVIRONMENT.write().unwrap_or_else(|e| e.into_inner());
    if held.is_none() {
        *held = Some(env);
    }
}

/// The controllers' addresses changed (the agent follows them, see
/// `Remote::follow_controllers`): the hooks started from now on are told
/// these in `JUJU_API_ADDRESSES`.
pub fn follow_api_addresses(addresses: &[String]) {
    if let Some(env) = ENVIRONMENT
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
    {
        env.api_addresses = addresses.to_vec();
    }
}

fn environment() -> Environment {
    ENVIRONMENT
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default()
}

/// The Juju version whose hook semantics jujube follows, as `JUJU_VERSION`
/// tells charms (the `ops` framework decides what it may use by it).
pub const JUJU_VERSION: &str = "3.6.4";

/// What runs for `hook` in `charm`: the charm's `dispatch` when it has an
/// executable one (every hook and action, told which by
/// `JUJU_DISPATCH_PATH`, as charmcraft packs charms), else `hooks/NAME`
/// (`actions/NAME` for an action).
pub fn program(charm: &Path, hook: &Hook) -> (PathBuf, Option<String>) {
    let dir = if hook.action.is_some() {
        "actions"
    } else {
        "hooks"
    };
    if runs_dispatch(charm) {
        (charm.join("dispatch"), Some(format!("{dir}/{}", hook.name)))
    } else {
        (charm.join(dir).join(&hook.name), None)
    }
}

/// Whether `charm` has an executable `dispatch`, which then runs every
/// hook and action.
fn runs_dispatch(charm: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(charm.join("dispatch"))
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Which hooks a unit's charm has, as [`program`] would find them: a stat
/// of `dispatch` and a listing of `hooks/`, read once, where a pass looked
/// for each hook with two stats before running it and two more after (a
/// unit of a charm without hooks made sixteen in its first pass). Its
/// holder forgets it whenever anything ran in the unit's context (an
/// `install` hook may link the others into place) or the charm is laid.
/// It holds at most [`MAX_LISTED_HOOKS`] names: a `hooks/` holding more
/// (a hook may write anything there) is looked in hook by hook.
pub struct CharmHooks {
    /// An executable `dispatch`: it runs every hook.
    dispatch: bool,
    /// The names in `hooks/` that exist (a link counts if what it names
    /// does); `None` when there were more than [`MAX_LISTED_HOOKS`].
    present: Option<std::collections::HashSet<Box<str>>>,
    hooks: PathBuf,
}

/// The most names [`CharmHooks`] keeps of a charm's `hooks/`: a charm has
/// a few dozen hooks (its relations' four each), and a listing held in a
/// pass must not grow with what a hook wrote there.
pub const MAX_LISTED_HOOKS: usize = 1024;

impl CharmHooks {
    pub fn read(charm: &Path) -> CharmHooks {
        let dispatch = runs_dispatch(charm);
        let hooks = charm.join("hooks");
        let mut present = Some(std::collections::HashSet::new());
        if !dispatch {
            for (i, entry) in std::fs::read_dir(&hooks)
                .into_iter()
                .flatten()
                .flatten()
                .enumerate()
            {
                if i == MAX_LISTED_HOOKS {
                    present = None;
                    break;
                }
                let there = match entry.file_type() {
                    Ok(t) if !t.is_symlink() => true,
                    _ => entry.path().exists(),
                };
                if let (true, Some(p)) = (there, present.as_mut()) {
                    p.insert(entry.file_name().to_string_lossy().into());
                }
            }
        }
        CharmHooks {
            dispatch,
            present,
            hooks,
        }
    }

    /// Whether the charm has unit or relation hook `name`.
    pub fn has(&self, name: &str) -> bool {
        self.dispatch
            || match &self.present {
                Some(p) => p.contains(name),
                None => self.hooks.join(name).exists(),
            }
    }
}

/// Which hook, and about what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    pub name: String,
    /// The relation (`id`, this side's name) of a relation hook.
    pub relation: Option<(i64, String)>,
    /// The remote unit of `-joined`, `-changed`, `-departed`.
    pub remote: Option<String>,
    /// `JUJU_REMOTE_APP`: the remote unit's service, or the remote
    /// application of a `-broken` hook or of a `-changed` about its
    /// application settings (no remote unit then).
    pub remote_app: Option<String>,
    /// The principal of the unit it runs for, when that is a subordinate.
    pub principal: Option<String>,
    /// `JUJU_MACHINE_ID` and `JUJU_AVAILABILITY_ZONE`.
    pub machine: Option<i64>,
    pub zone: Option<String>,
    /// An action (`name` is the action's): its task id, `JUJU_ACTION_UUID`.
    pub action: Option<i64>,
}

impl Hook {
    pub fn unit(name: &str) -> Hook {
        Hook {
            name: name.to_string(),
            relation: None,
            remote: None,
            remote_app: None,
            principal: None,
            machine: None,
            zone: None,
            action: None,
        }
    }

    /// Action `name`, task `id`.
    pub fn action(name: &str, id: i64) -> Hook {
        Hook {
            action: Some(id),
            ..Hook::unit(name)
        }
    }

    /// The same hook, told where its unit runs: its principal, for a
    /// subordinate (`JUJU_PRINCIPAL_UNIT`), its machine and zone.
    pub fn placed(mut self, view: &crate::api::UnitView) -> Hook {
        self.principal = view.principal.clone();
        self.machine = view.machine;
        self.zone = view.zone.clone();
        self
    }

    pub fn relation(rel: i64, rel_name: &str, kind: &str, remote: Option<&str>) -> Hook {
        Hook {
            relation: Some((rel, rel_name.to_string())),
            remote: remote.map(str::to_string),
            remote_app: remote
                .and_then(|r| r.split_once('/'))
                .map(|(app, _)| app.to_string()),
            ..Hook::unit(&format!("{rel_name}-relation-{kind}"))
        }
    }

    /// A relation hook about the remote application `app` (`-broken`, or
    /// `-changed` for its application settings): no remote unit.
    pub fn about_app(rel: i64, rel_name: &str, kind: &str, app: Option<&str>) -> Hook {
        Hook {
            remote_app: app.map(str::to_string),
            ..Hook::relation(rel, rel_name, kind, None)
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

/// How many hooks this process runs at once: a few per core. The agents of
/// every machine a process hosts (a controller's in-process agents on the
/// dummy, a machine agent's units) share its host, as Juju's units share
/// their machine's hook lock; a thousand units' hooks spawned at once made
/// the host's load some hundreds, and starved everything else on it (the
/// controller's API, its lease's renewals) for minutes.
///
/// Held from before a hook is recorded as running until its record is
/// cleared (see `UnitAgent::run_hook`): a hook waiting for its slot when
/// its agent dies has not begun, and is not taken for a failed one.
pub async fn hook_slot() -> tokio::sync::SemaphorePermit<'static> {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS
        .get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            tokio::sync::Semaphore::new(cores * 4)
        })
        .acquire()
        .await
        .expect("the hook slots are never closed")
}

/// Runs `hook` for `unit` from `unit_dir/charm`, its output appended to
/// `log` (the caller holds a [`hook_slot`]).
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
    let (path, _) = program(&charm, hook);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(_) => return Outcome::Missing,
    };
    if meta.permissions().mode() & 0o111 == 0 {
        let message = format!(
            "hook \"{}\" is not executable; `chmod +x hooks/{}` in the charm",
            hook.name, hook.name
        );
        // Said in the unit's log (and so in `debug-log`), not only in status.
        if let Ok(mut f) = open_log(log) {
            use std::io::Write;
            let _ = writeln!(f, "{} ERROR {message}", super::log_time());
        }
        return Outcome::Failed(message);
    }
    let log = match open_log(log) {
        Ok(f) => f,
        Err(e) => return Outcome::Failed(format!("cannot open the unit's log: {e}")),
    };
    let err = match log.try_clone() {
        Ok(f) => f,
        Err(e) => return Outcome::Failed(format!("cannot open the unit's log: {e}")),
    };
    let mut cmd = match command(&path, unit_dir, unit, context_id, socket, hook) {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(format!("cannot set up the hook tools: {e}")),
    };
    cmd.stdout(log).stderr(err);
    match cmd.status().await {
        Ok(s) if s.success() => Outcome::Succeeded,
        Ok(s) => Outcome::Failed(format!("hook failed: \"{}\" ({s})", hook.name)),
        Err(e) => Outcome::Failed(format!("cannot run hook \"{}\": {e}", hook.name)),
    }
}

fn open_log(log: &Path) -> std::io::Result<std::fs::File> {
    if let Some(parent) = log.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
}

/// `program` set up to run in the unit's hook context: in the charm
/// directory, with Juju's environment and the hook tools first on `PATH`.
fn command(
    program: &Path,
    unit_dir: &Path,
    unit: &str,
    context_id: &str,
    socket: &Path,
    hook: &Hook,
) -> std::io::Result<tokio::process::Command> {
    let env = environment();
    let charm = unit_dir.join("charm");
    let tools = ensure_tools(unit_dir)?;
    // Juju's hook PATH: the tools first, then the agent's own.
    let mut path_var = std::env::var("PATH")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| SYSTEM_PATH.into());
    if let Some(t) = &tools {
        path_var = format!("{}:{path_var}", t.display());
    }
    let mut cmd = tokio::process::Command::new(program);
    // A hook inherits nothing of the agent's environment (the controller's
    // `JUJUBE_HOME`, cloud credentials, `RUST_LOG`...): it gets exactly the
    // spec's variables, and what Juju sets besides them.
    cmd.env_clear();
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    cmd.current_dir(&charm)
        .env("PATH", path_var)
        .env("LANG", "C.UTF-8")
        .env("TERM", "tty")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("APT_LISTCHANGES_FRONTEND", "none")
        .env("CHARM_DIR", &charm)
        .env("JUJU_CHARM_DIR", &charm)
        .env("JUJU_UNIT_NAME", unit)
        .env("JUJU_CONTEXT_ID", context_id)
        .env("JUJU_AGENT_SOCKET", socket)
        .env("JUJU_API_ADDRESSES", env.api_addresses.join(" "))
        .env("JUJU_ENV_NAME", &env.name)
        .env("JUJU_MODEL_NAME", &env.name)
        .env("JUJU_MODEL_UUID", &env.uuid)
        .env("JUJU_VERSION", JUJU_VERSION)
        .stdin(std::process::Stdio::null())
        // Its own process group, so that the whole of it can be killed
        // (a timed-out `jujube run`, a hook left by a dead agent).
        .process_group(0)
        .kill_on_drop(true);
    // jujube itself creates files 0600 (umask 077); a charm's hooks write
    // files other system users read (a web server's configuration), so
    // they get the usual 022.
    // SAFETY: umask(2) is async-signal-safe, all pre_exec may call.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o022);
            Ok(())
        });
    }
    if let Some((id, name)) = &hook.relation {
        cmd.env("JUJU_RELATION", name)
            .env("JUJU_RELATION_ID", format!("{name}:{id}"));
    }
    if let Some(remote) = &hook.remote {
        cmd.env("JUJU_REMOTE_UNIT", remote);
        if hook.name.ends_with("-relation-departed") {
            cmd.env("JUJU_DEPARTING_UNIT", remote);
        }
    }
    if let Some(app) = &hook.remote_app {
        cmd.env("JUJU_REMOTE_APP", app);
    }
    if let Some(p) = &hook.principal {
        cmd.env("JUJU_PRINCIPAL_UNIT", p);
    }
    if let Some(m) = hook.machine {
        cmd.env("JUJU_MACHINE_ID", m.to_string());
    }
    if let Some(z) = &hook.zone {
        cmd.env("JUJU_AVAILABILITY_ZONE", z);
    }
    let (_, dispatch) = self::program(&charm, hook);
    match hook.action {
        Some(id) => {
            cmd.env("JUJU_ACTION_NAME", &hook.name)
                .env("JUJU_ACTION_UUID", id.to_string());
        }
        // `jujube run`'s commands are no hook.
        None if hook.name == "run" => {}
        None => {
            cmd.env("JUJU_HOOK_NAME", &hook.name);
        }
    }
    if hook.name != "run" || hook.action.is_some() {
        if let Some(d) = dispatch {
            cmd.env("JUJU_DISPATCH_PATH", d);
        }
    }
    Ok(cmd)
}

/// Where a command runs: the unit's directory and log, the unit, and the
/// hook context its tools reach (id and socket).
#[derive(Debug, Clone, Copy)]
pub struct Site<'a> {
    pub unit_dir: &'a Path,
    pub log: &'a Path,
    pub unit: &'a str,
    pub context_id: &'a str,
    pub socket: &'a Path,
}

/// What `jujube run` gets back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// The exit code; `-1` when it was killed or could not start.
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `argv` (no shell: `sh -c '...'` for one) in the unit's hook context,
/// as `jujube run` asks, capturing its output; killed after `timeout`. Its
/// output is also appended to the unit's log, after a line naming it.
pub async fn run_command(
    site: &Site<'_>,
    hook: &Hook,
    argv: &[String],
    timeout: std::time::Duration,
) -> Captured {
    let Site {
        unit_dir,
        log,
        unit,
        context_id,
        socket,
    } = *site;
    let fail = |stderr: String| Captured {
        code: -1,
        stdout: String::new(),
        stderr,
    };
    let Some(program) = argv.first() else {
        return fail("error: no command given\n".into());
    };
    let mut cmd = match command(Path::new(program), unit_dir, unit, context_id, socket, hook) {
        Ok(c) => c,
        Err(e) => return fail(format!("error: cannot set up the hook tools: {e}\n")),
    };
    cmd.args(&argv[1..])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return fail(format!("error: cannot run `{program}`: {e}\n")),
    };
    let group = child.id();
    let captured = match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(out)) => Captured {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        },
        Ok(Err(e)) => fail(format!("error: cannot run `{program}`: {e}\n")),
        // Dropping the child kills it (kill_on_drop); what it started in its
        // process group goes with it.
        Err(_) => {
            if let Some(g) = group.and_then(|g| i32::try_from(g).ok()) {
                // SAFETY: kill(2) on the command's own process group.
                unsafe { libc::kill(-g, libc::SIGKILL) };
            }
            fail(format!(
                "error: `{program}` did not finish within {}s and was killed\n",
                timeout.as_secs()
            ))
        }
    };
    if let Ok(mut f) = open_log(log) {
        use std::io::Write;
        let _ = match hook.action {
            Some(id) => writeln!(
                f,
                "action {} (task {id}, exit {})",
                hook.name, captured.code
            ),
            None => writeln!(f, "jujube run {} (exit {})", loggable(argv), captured.code),
        };
        let _ = f.write_all(captured.stdout.as_bytes());
        let _ = f.write_all(captured.stderr.as_bytes());
    }
    captured
}

/// The most of a command line the unit's log shows.
const MAX_LOGGED_ARGV: usize = 1024;

/// `argv` for the log: quoted, and cut (marked) past [`MAX_LOGGED_ARGV`]
/// bytes, so that a huge argument is not written to the log in full.
fn loggable(argv: &[String]) -> String {
    let mut s = format!("{argv:?}");
    if s.len() > MAX_LOGGED_ARGV {
        let total = s.len();
        s.truncate(crate::api::char_floor(&s, MAX_LOGGED_ARGV));
        s.push_str(&format!("... ({total} bytes)"));
    }
    s
}

/// Kills what is left of a hook whose agent died while it ran: every
/// process group led by a process of a hook context (`JUJU_CONTEXT_ID` in
/// its environment) working in `unit_dir/charm`. Called before the
/// restarted agent runs anything, so a unit never runs two hooks at once.
/// Returns how many groups were killed. Linux only (`/proc`); elsewhere
/// nothing is found.
pub fn kill_leftovers(unit_dir: &Path) -> usize {
    let charm = unit_dir.join("charm");
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut groups = std::collections::BTreeSet::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if std::fs::read_link(p.path().join("cwd")).ok().as_deref() != Some(charm.as_path()) {
            continue;
        }
        let in_context = std::fs::read(p.path().join("environ"))
            .map(|env| {
                env.split(|b| *b == 0)
                    .any(|v| v.starts_with(b"JUJU_CONTEXT_ID="))
            })
            .unwrap_or(false);
        if !in_context {
            continue;
        }
        // /proc/PID/stat: `pid (comm) state ppid pgrp ...`; comm may hold
        // spaces and parentheses, so count from the last `)`.
        let pgrp = std::fs::read_to_string(p.path().join("stat"))
            .ok()
            .and_then(|s| {
                let rest = &s[s.rfind(')')? + 1..];
                rest.split_whitespace().nth(2)?.parse::<i32>().ok()
            });
        groups.insert(pgrp.filter(|g| *g > 1).unwrap_or(pid));
    }
    let mut killed = 0;
    for g in groups {
        // SAFETY: kill(2) with a negative pid signals that process group
        // (the process alone when it leads none).
        if unsafe { libc::kill(-g, libc::SIGKILL) == 0 || libc::kill(g, libc::SIGKILL) == 0 } {
            killed += 1;
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::{program, CharmHooks, Hook};

    /// What the listing says a charm has is what a look for each hook's
    /// program finds: files and links to files in `hooks/`, not a link to
    /// nothing; every hook once `dispatch` is executable.
    #[test]
    fn the_charms_hooks_read_once_agree_with_a_look_for_each() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let charm = dir.path();
        let names = [
            "install",
            "start",
            "stop",
            "config-changed",
            "db-relation-joined",
        ];
        let agree = |charm: &std::path::Path| {
            let hooks = CharmHooks::read(charm);
            for name in names {
                let looked = program(charm, &Hook::unit(name)).0.exists();
                let listed = hooks.has(name);
                assert_eq!(listed, looked, "{name}");
            }
        };
        // No `hooks/` at all.
        agree(charm);
        std::fs::create_dir(charm.join("hooks")).unwrap();
        std::fs::write(charm.join("hooks/install"), "#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("install", charm.join("hooks/start")).unwrap();
        std::os::unix::fs::symlink("nothing", charm.join("hooks/stop")).unwrap();
        agree(charm);
        assert!(CharmHooks::read(charm).has("start"));
        assert!(!CharmHooks::read(charm).has("stop"));
        // A `dispatch` that is not executable runs nothing; one that is
        // runs every hook.
        std::fs::write(charm.join("dispatch"), "#!/bin/sh\n").unwrap();
        agree(charm);
        std::fs::set_permissions(
            charm.join("dispatch"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        agree(charm);
        assert!(CharmHooks::read(charm).dispatch);
    }

    /// A `hooks/` holding more names than the bound is not kept whole:
    /// the hooks are looked for one by one, with the same answers.
    #[test]
    fn a_hooks_directory_past_the_bound_is_looked_in_hook_by_hook() {
        let dir = tempfile::tempdir().unwrap();
        let charm = dir.path();
        std::fs::create_dir(charm.join("hooks")).unwrap();
        for i in 0..=super::MAX_LISTED_HOOKS {
            std::fs::write(charm.join(format!("hooks/written-{i}")), "").unwrap();
        }
        std::fs::write(charm.join("hooks/install"), "#!/bin/sh\n").unwrap();
        let hooks = CharmHooks::read(charm);
        assert!(hooks.present.is_none(), "more names than the bound kept");
        for name in ["install", "start", "written-7"] {
            let looked = program(charm, &Hook::unit(name)).0.exists();
            assert_eq!(hooks.has(name), looked, "{name}");
        }
    }

    #[test]
    fn a_huge_command_line_is_cut_in_the_log() {
        let small = vec!["echo".to_string(), "hi".to_string()];
        assert_eq!(super::loggable(&small), r#"["echo", "hi"]"#);
        let huge = vec!["echo".to_string(), "é".repeat(100_000)];
        let logged = super::loggable(&huge);
        assert!(logged.len() < 1100, "{}", logged.len());
        assert!(logged.ends_with("... (200012 bytes)"), "{logged}");
    }
}
