//! Machine 0's controller on the dummy, left running by `bootstrap`: a
//! supervisor process, detached from the terminal, runs `jujube controller`
//! and starts it again when it dies (a crash, `kill -9`), with a growing
//! pause between restarts; asked to stop (SIGTERM, as `destroy-environment`
//! does) it stops the controller gracefully and ends. An environment thus
//! lives after the terminal that bootstrapped it closes.
//!
//! In the environment's directory: `controller.log` (both processes'
//! output, appended) and `supervisor.pid`; for another controller machine
//! N (`enable-ha`), `controller-N.log` and `supervisor-N.pid`, its
//! supervisor and controller run with `--machine N`. `jujube controller`
//! stays the foreground form (development, service managers: `bootstrap
//! --manual-controller` starts nothing).

use crate::home::Home;
use crate::{bail, Context, Result};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{info, warn};

/// The controller's and its supervisor's log, in the environment's
/// directory.
pub const LOG: &str = "controller.log";
const PID: &str = "supervisor.pid";

/// The first pause before a restart; doubled after each quick death, up to
/// [`MAX_BACKOFF`], and back to this after a controller ran a minute.
const BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long `start` waits for the first controller to hold its lock.
const START_TIMEOUT: Duration = Duration::from_secs(30);

pub fn log_path(home: &Home, env: &str, machine: i64) -> PathBuf {
    crate::run::seat_file(home, env, machine, LOG)
}

fn pid_path(home: &Home, env: &str, machine: i64) -> PathBuf {
    crate::run::seat_file(home, env, machine, PID)
}

/// The arguments after `--env ENV` that run controller machine
/// `machine`'s `command` (`supervise`, `controller`).
fn seat_args(command: &str, machine: i64) -> Vec<String> {
    let mut args = vec![command.to_string()];
    if machine != 0 {
        args.extend(["--machine".to_string(), machine.to_string()]);
    }
    args
}

/// Whether `pid` runs `jujube --env ENV supervise` for `env`'s controller
/// machine `machine` (a pid in a stale file may have been reused by
/// anything since).
fn is_supervisor(pid: i32, env: &str, machine: i64) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let Some(at) = args
        .windows(3)
        .position(|w| w == [&b"--env"[..], env.as_bytes(), &b"supervise"[..]])
    else {
        return false;
    };
    let rest: Vec<&[u8]> = args[at + 3..]
        .iter()
        .copied()
        .filter(|a| !a.is_empty())
        .collect();
    let want = seat_args("supervise", machine);
    rest.len() == want.len() - 1 && rest.iter().zip(&want[1..]).all(|(a, w)| *a == w.as_bytes())
}

/// The controller machines this home runs controllers for: machine 0, and
/// every N whose `controller-N.lock` is in the environment's directory.
pub fn seats_here(home: &Home, env: &str) -> Vec<i64> {
    let mut seats = vec![0];
    if let Ok(dir) = std::fs::read_dir(home.env_dir(env)) {
        for e in dir.flatten() {
            let name = e.file_name();
            let n = name
                .to_str()
                .and_then(|n| n.strip_prefix("controller-"))
                .and_then(|n| n.strip_suffix(".lock"))
                .and_then(|n| n.parse::<i64>().ok());
            if let Some(n) = n.filter(|n| *n > 0) {
                seats.push(n);
            }
        }
    }
    seats.sort_unstable();
    seats
}

/// The running supervisor's pid, if one runs for `env`'s controller
/// machine `machine`.
pub fn running(home: &Home, env: &str, machine: i64) -> Option<i32> {
    std::fs::read_to_string(pid_path(home, env, machine))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&p| p > 0 && is_supervisor(p, env, machine))
}

/// Starts the supervisor of `env`'s controller machine `machine`'s
/// controller, detached (a session of its own, no terminal, output to
/// [`LOG`]), and waits until its controller holds its lock.
pub fn start(home: &Home, env: &str, machine: i64) -> Result<u32> {
    use std::os::unix::process::CommandExt;
    let log_file = log_path(home, env, machine);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_file)
        .with_context(|| format!("cannot open `{}`", log_file.display()))?;
    let exe = std::env::current_exe().context("cannot find the jujube binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["--env", env])
        .args(seat_args("supervise", machine))
        .env("JUJUBE_HOME", &home.root)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .context("cannot start the controller's supervisor")?;
    let pid = child.id();
    let deadline = std::time::Instant::now() + START_TIMEOUT;
    while !crate::run::controller_runs(home, env, machine) {
        if let Some(status) = child.try_wait()? {
            bail!(
                "the controller of environment `{env}` did not start ({status}); see `{}`",
                log_file.display()
            );
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "the controller of environment `{env}` did not start within {}s; see `{}`",
                START_TIMEOUT.as_secs(),
                log_file.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(pid)
}

/// `jujube supervise [--machine N]`: runs `jujube controller` for `env`'s
/// controller machine `machine` until asked to stop, starting it again
/// whenever it dies other than by a clean exit.
pub async fn supervise(home: &Home, env: &str, machine: i64) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let dir = home.env_dir(env);
    let pid_file = pid_path(home, env, machine);
    std::fs::write(&pid_file, format!("{}\n", std::process::id()))
        .with_context(|| format!("cannot write `{}`", pid_file.display()))?;
    let exe = std::env::current_exe().context("cannot find the jujube binary")?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut backoff = BACKOFF;
    info!(environment = env, machine, "supervising the controller");
    loop {
        if !dir.exists() {
            info!("the environment's directory is gone; stopping");
            return Ok(());
        }
        let started = tokio::time::Instant::now();
        let mut child = tokio::process::Command::new(&exe)
            .args(["--env", env])
            .args(seat_args("controller", machine))
            .env("JUJUBE_HOME", &home.root)
            .env(crate::facade::KEPT_BY, "supervisor")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(false)
            .spawn()
            .context("cannot start the controller")?;
        let pid = child.id();
        info!(pid, "controller started");
        let status = tokio::select! {
            s = child.wait() => s?,
            _ = term.recv() => return stop(child, pid).await,
            _ = int.recv() => return stop(child, pid).await,
        };
        if status.success() {
            info!("the controller stopped; so does its supervisor");
            let _ = std::fs::remove_file(&pid_file);
            return Ok(());
        }
        if started.elapsed() >= Duration::from_secs(60) {
            backoff = BACKOFF;
        }
        warn!(
            %status,
            "the controller died; starting it again in {}s",
            backoff.as_secs()
        );
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Stops the supervised controller gracefully (SIGTERM) and waits for it.
async fn stop(mut child: tokio::process::Child, pid: Option<u32>) -> Result<()> {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let status = child.wait().await?;
    info!(%status, "asked to stop; the controller stopped");
    Ok(())
}

/// Stops the supervisor of `env`'s controller machine `machine`, if one
/// runs, and so its controller; waits up to `timeout` for it to end.
pub async fn stop_supervisor(
    home: &Home,
    env: &str,
    machine: i64,
    timeout: Duration,
    out: &mut impl Write,
) -> Result<()> {
    let Some(pid) = running(home, env, machine) else {
        return Ok(());
    };
    // SAFETY: kill(2) on the pid the supervisor wrote, checked to run
    // `jujube supervise` just now.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ESRCH) {
            bail!("cannot stop the controller's supervisor of environment `{env}` (pid {pid}): {err}; stop it (`kill {pid}`) and try again");
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    while is_supervisor(pid, env, machine) && !gone(pid) {
        if tokio::time::Instant::now() >= deadline {
            bail!("the controller's supervisor of environment `{env}` (pid {pid}) did not stop within {}s; stop it (`kill {pid}`) and try again", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_file(pid_path(home, env, machine));
    let whose = if machine == 0 {
        String::new()
    } else {
        format!(" of machine `{machine}`")
    };
    writeln!(
        out,
        "stopped the controller's supervisor{whose} (pid {pid})"
    )?;
    Ok(())
}

/// Whether `pid` has ended (a zombie counts: its parent, if any, has yet to
/// reap it).
fn gone(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.is_empty()
        || stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            == Some("Z")
}
