//! The `jujube` command.
//!
//! # Layout
//! - `main.rs`: the command line (clap) and dispatch; exit codes.
//! - [`home`]: where environments live and which one is current.
//! - [`charm`]: finding and reading charm directories.
//! - [`render`]: `status` and `get` output as tables, YAML or JSON.
//! - [`progress`]: progress of `wait` and `bootstrap` on stderr.
//!
//! Exit codes: 0 success, 1 an operation was refused or failed (the message
//! says why, and nothing was changed; for `wait`: machines in error, or the
//! timeout), 2 the command line was wrong.

mod agent;
mod charm;
mod client;
mod commands;
mod debuglog;
mod hooktool;
mod progress;
mod render;
mod users;

use jujube_controller::{run as controller, supervise};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use client::Client;
use jujube_controller::Home;
use jujube_core::{names, series};
use jujube_wire::client::{Access, ClientCall, Deployed, UserInfo};
use jujube_wire::view::{Status, Stray, Task};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "jujube",
    version,
    about = "Deploy and relate services on a cloud, with strict lifecycles"
)]
struct Cli {
    /// The environment to act on (default: the current one).
    #[arg(long = "env", short = 'e', global = true, env = "JUJUBE_ENV")]
    env: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum ProviderKind {
    Dummy,
    Ec2,
    Lxd,
}

impl ProviderKind {
    fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Dummy => "dummy",
            ProviderKind::Ec2 => "ec2",
            ProviderKind::Lxd => "lxd",
        }
    }
}

#[derive(Clone, Copy, ValueEnum, Default)]
pub(crate) enum Format {
    #[default]
    Tabular,
    Yaml,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create an environment (with its controller machine 0) and make it current.
    Bootstrap {
        /// The environment's name.
        #[arg(default_value = "default")]
        name: String,
        #[arg(long, value_enum, default_value = "dummy")]
        provider: ProviderKind,
        /// Environment config, KEY=VALUE; repeatable.
        #[arg(long = "config", value_name = "KEY=VALUE")]
        config: Vec<String>,
        /// Environment constraints, e.g. "mem=4G cores=2".
        #[arg(long)]
        constraints: Option<String>,
        /// Series for services and machines that name none.
        #[arg(long, default_value = series::DEFAULT_SERIES)]
        default_series: String,
        /// Start no controller: run `jujube controller` yourself (development,
        /// a service manager). Without it, on the dummy, machine 0's controller
        /// is left running in the background, restarted if it dies.
        #[arg(long)]
        manual_controller: bool,
    },
    /// List environments; the current one is marked with `*`.
    Environments,
    /// Make an environment current.
    Switch { name: String },
    /// Deploy a charm as a new service.
    Deploy {
        /// A charm directory, or `local:SERIES/NAME` in the repository.
        charm: String,
        /// The service's name (default: the charm's).
        service: Option<String>,
        /// Number of units (default 1; subordinates get none; at most 100000).
        #[arg(short = 'n', long = "num-units")]
        num_units: Option<usize>,
        #[arg(long)]
        constraints: Option<String>,
        #[arg(long)]
        series: Option<String>,
        /// Place the unit on this existing machine.
        #[arg(long)]
        to: Option<String>,
        /// Where `local:` charms are found (default: $JUJUBE_REPOSITORY).
        #[arg(long)]
        repository: Option<PathBuf>,
        /// Service settings, KEY=VALUE; repeatable.
        #[arg(long = "config", value_name = "KEY=VALUE")]
        config: Vec<String>,
    },
    /// Upgrade a service's charm: its units lay the new charm over theirs and run
    /// `upgrade-charm`, then `config-changed`.
    UpgradeCharm {
        service: String,
        /// The new charm: a directory, or `local:SERIES/NAME` in the repository
        /// (default: where the service's charm was deployed from, read again).
        #[arg(long)]
        path: Option<String>,
        /// Where `local:` charms are found (default: $JUJUBE_REPOSITORY).
        #[arg(long)]
        repository: Option<PathBuf>,
        /// Upgrade units held by a failed hook too: the new charm is laid
        /// down and the failed hook retried from it (no upgrade-charm hook).
        #[arg(long)]
        force: bool,
    },
    /// Add units to a service, each on a new machine unless `--to` is given.
    AddUnit {
        service: String,
        /// Number of units (at most 100000).
        #[arg(short = 'n', long = "num-units", default_value_t = 1)]
        num_units: usize,
        #[arg(long)]
        to: Option<String>,
    },
    /// Add machines that host units.
    AddMachine {
        /// Number of machines (at most 100000).
        #[arg(short = 'n', default_value_t = 1)]
        n: usize,
        #[arg(long)]
        series: Option<String>,
        /// Constraints over the environment's (`key=` hides its value).
        #[arg(long)]
        constraints: Option<String>,
    },
    /// Set environment constraints, or a service's with `--service`.
    SetConstraints {
        #[arg(long, short = 's')]
        service: Option<String>,
        #[arg(value_name = "KEY=VALUE")]
        constraints: Vec<String>,
    },
    /// Show environment constraints, or a service's with `--service`.
    GetConstraints {
        #[arg(long, short = 's')]
        service: Option<String>,
    },
    /// Change service settings (`KEY=` resets to the default).
    Set {
        service: String,
        #[arg(value_name = "KEY=VALUE", required = true)]
        settings: Vec<String>,
    },
    /// Show a service's settings.
    Get {
        service: String,
        #[arg(long, value_enum, default_value = "yaml")]
        format: Format,
    },
    /// Change environment config (`KEY=` removes a key).
    SetEnvironment {
        #[arg(value_name = "KEY=VALUE", required = true)]
        config: Vec<String>,
    },
    /// Show environment config.
    GetEnvironment { key: Option<String> },
    /// Relate two services.
    AddRelation { a: String, b: String },
    /// Destroy the relation between two services.
    #[command(alias = "remove-relation")]
    DestroyRelation { a: String, b: String },
    /// Destroy units (all or none).
    #[command(alias = "remove-unit")]
    DestroyUnit {
        #[arg(required = true)]
        units: Vec<String>,
    },
    /// Destroy a service, its units and its relations.
    #[command(alias = "remove-service")]
    DestroyService { service: String },
    /// Destroy machines that host no units (all or none).
    #[command(alias = "remove-machine")]
    DestroyMachine {
        #[arg(required = true)]
        machines: Vec<String>,
    },
    /// Clear a machine's provisioning error so it is provisioned again, or a
    /// unit's failed hook so that its agent goes on.
    Resolved {
        /// A machine id, or a unit (`wordpress/0`).
        #[arg(value_name = "MACHINE|UNIT", required_unless_present = "all")]
        machine: Option<String>,
        /// Every unit in error (with `--retry`: run their failed hooks
        /// again), in bounded batches.
        #[arg(long, conflicts_with_all = ["machine", "constraints"])]
        all: bool,
        /// Replace the machine's constraints first.
        #[arg(long)]
        constraints: Option<String>,
        /// For a unit: run the failed hook again (without: count it as done).
        #[arg(long)]
        retry: bool,
    },
    /// Show the environment's machines, services, units and relations.
    Status {
        #[arg(long, value_enum, default_value = "tabular")]
        format: Format,
    },
    /// Make machines in error eligible for provisioning again.
    RetryProvisioning {
        machines: Vec<String>,
        /// Every machine in error.
        #[arg(long, conflicts_with = "machines")]
        all: bool,
    },
    /// Instances tagged as this environment's that no machine owns, and when
    /// each will be reaped (a dry run of the harvest).
    Strays {
        #[arg(long, value_enum, default_value = "tabular")]
        format: Format,
    },
    /// Add a user (with `read` access unless `--access` says otherwise) and print
    /// the one-time string it registers with.
    AddUser {
        name: String,
        #[arg(long, default_value = "read", value_parser = parse_access)]
        access: Access,
    },
    /// Register with the string `add-user` printed: choose a password, and make
    /// the environment current. The password is read from the terminal, or
    /// from standard input when it is not one.
    Register { string: String },
    /// Log in to the environment's controller as USER (default: this home's
    /// user, else `admin`).
    Login {
        #[arg(long = "user", short = 'u')]
        user: Option<String>,
    },
    /// Forget this home's password for the environment.
    Logout,
    /// Change a user's password (default: your own).
    ChangeUserPassword { user: Option<String> },
    /// List users (an admin sees every user; others themselves).
    Users {
        #[arg(long, value_enum, default_value = "tabular")]
        format: Format,
    },
    /// Give a user `read`, `write` or `admin` access (never lowers it).
    Grant {
        user: String,
        #[arg(value_parser = parse_access)]
        access: Access,
    },
    /// Take `read`, `write` or `admin` access away (leaves what is below it).
    Revoke {
        user: String,
        #[arg(value_parser = parse_access)]
        access: Access,
    },
    /// Run a controller in the foreground (logs: RUST_LOG).
    Controller {
        /// The controller machine whose controller this is (`enable-ha`
        /// adds them).
        #[arg(long, default_value_t = 0, env = jujube_controller::machine0::MACHINE_ENV)]
        machine: i64,
    },
    /// Run `jujube controller`, starting it again when it dies (what
    /// `bootstrap` and `enable-ha` leave running in the background).
    #[command(hide = true)]
    Supervise {
        #[arg(long, default_value_t = 0)]
        machine: i64,
    },
    /// Add controller machines until there are N, each serving the API,
    /// one at a time running the provisioner, the cleaner and the dummy's
    /// agents (the environment's state must be in PostgreSQL).
    EnableHa {
        /// How many controllers: odd, 1 to 7.
        #[arg(short = 'n', default_value_t = 3)]
        n: usize,
    },
    /// Show the units' logs (hook output and juju-log), then follow them.
    DebugLog {
        /// Only this unit's log (repeatable).
        #[arg(long = "include", value_name = "UNIT")]
        include: Vec<String>,
        /// Lines of each log to show first.
        #[arg(long = "lines", short = 'n', default_value_t = 10)]
        lines: usize,
        /// Show and exit instead of following.
        #[arg(long)]
        no_tail: bool,
    },
    /// Run an action of a unit's charm (`jujube run wordpress/0 backup target=/srv`),
    /// as Juju 3's `juju run`: its parameters are checked against the charm's
    /// actions.yaml, its agent runs it between hooks, and the results are printed;
    /// exits 1 when it failed. `jujube run UNIT -- CMD...` runs a command, as `exec`.
    /// Needs a running controller.
    Run {
        /// The unit, e.g. `wordpress/0`.
        unit: String,
        /// The action, then its parameters as `key=value` (`a.b=c` nests).
        #[arg(value_name = "ACTION [KEY=VALUE]...")]
        action: Vec<String>,
        /// How long it may run before its agent kills it.
        #[arg(long, default_value = "5m")]
        timeout: String,
        /// Queue the action, print its task id and return (see `show-task`).
        #[arg(long)]
        background: bool,
        /// A command and its arguments instead of an action, after `--`.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Run a command in a unit's hook context (Juju's `juju exec`), between its hooks;
    /// prints its output and exits with its status. The hook tools work in it; no shell
    /// unless you ask for one (`-- sh -c '...'`). Needs a running controller.
    Exec {
        /// The unit, e.g. `wordpress/0`.
        unit: String,
        /// How long the command may run before its agent kills it.
        #[arg(long, default_value = "5m")]
        timeout: String,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Show an action's task: its status, parameters, results and log.
    ShowTask {
        /// The task id `run --background` printed.
        id: i64,
    },
    /// Enroll this instance as its machine (its boot script runs this): trade the
    /// launch batch's token and the instance's signed identity document (from its
    /// metadata service) for DIR/agent.conf.
    #[command(hide = true)]
    Enroll {
        #[arg(long)]
        data_dir: PathBuf,
        /// The controller's API, `host:port`.
        #[arg(long)]
        api: String,
        /// The environment's CA certificate (PEM): the only one trusted.
        #[arg(long)]
        ca_cert: PathBuf,
        #[arg(long)]
        token: String,
        /// The instance identity document, as the metadata service gave it.
        #[arg(long)]
        identity_document: PathBuf,
        /// Its signature (base64), as the metadata service gave it.
        #[arg(long)]
        identity_signature: PathBuf,
    },
    /// On a controller machine's instance (its boot script runs this): take up
    /// the environment's controller from its control bucket, with the
    /// instance's credentials, then run it (after a restart, run it).
    #[command(hide = true)]
    TakeUp {
        /// Machine 0's `JUJUBE_HOME`.
        #[arg(long)]
        home: PathBuf,
        #[arg(long)]
        uuid: String,
        /// The control bucket holding the hand-over (with `--key`).
        #[arg(long, requires = "key", conflicts_with = "hand_over_token_sha256")]
        bucket: Option<String>,
        /// The hand-over's key in the bucket.
        #[arg(long, requires = "bucket")]
        key: Option<String>,
        /// Take the hand-over from bootstrap instead, bearing the token of this SHA-256.
        #[arg(long, required_unless_present = "bucket")]
        hand_over_token_sha256: Option<String>,
        #[arg(long)]
        region: String,
        #[arg(long)]
        endpoint: Option<String>,
        /// The controller machine this instance is (`enable-ha` adds others
        /// than machine 0).
        #[arg(long, default_value_t = 0)]
        machine: i64,
    },
    /// Run a machine agent from DIR/agent.conf, talking to the controller's API only.
    Agent {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Wait until nothing can make progress, showing progress on stderr. Fails (exit 1)
    /// listing every machine in error, or after the timeout listing what is stuck.
    Wait {
        #[arg(long, default_value = "10m")]
        timeout: String,
    },
    /// Stop every instance of an environment and delete its state (a running controller
    /// of it is stopped first).
    DestroyEnvironment {
        name: String,
        /// Do not ask for confirmation.
        #[arg(short = 'y', long)]
        yes: bool,
    },
    /// Work on the dummy cloud directly, behind jujube's back (for tests and demos).
    #[command(hide = true)]
    DummyCloud {
        #[command(subcommand)]
        action: DummyAction,
    },
}

#[derive(Subcommand)]
enum DummyAction {
    /// Start an instance with the given tags; prints its id.
    Start {
        #[arg(long = "tag", value_name = "KEY=VALUE")]
        tags: Vec<String>,
    },
    /// Stop instances, whoever owns them (an instance vanishing behind
    /// jujube's back).
    Stop {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// List live instances (all of them, whoever owns them) as JSON.
    List,
}

fn parse_access(s: &str) -> std::result::Result<Access, String> {
    s.parse()
}

/// A command line that parsed but makes no sense: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Usage(String);

pub(crate) fn usage(msg: impl Into<String>) -> anyhow::Error {
    Usage(msg.into()).into()
}

/// `jujube run` exits with its command's status, saying nothing more.
#[derive(Debug, thiserror::Error)]
#[error("the command exited with status {0}")]
struct ExitWith(u8);

fn key_values(args: &[String], what: &str) -> Result<Vec<(String, String)>> {
    args.iter()
        .map(|a| {
            a.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| usage(format!("malformed {what} `{a}`: write KEY=VALUE")))
        })
        .collect()
}

fn machine_id(s: &str) -> Result<i64> {
    Ok(names::parse_machine(s)?)
}

/// jemalloc, not the C library's malloc: the controller holds some ten
/// million small objects with 100,000 agents (their tasks, subscriptions,
/// routes), and glibc's malloc adds a header to each and keeps per-thread
/// arenas that do not share freed memory; jemalloc keeps small objects in
/// slabs of their size class.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read at its start (`_RJEM_MALLOC_CONF` in the
/// environment overrides them): one arena, as the controller's work is a
/// few threads that mostly wait on SQLite and the cloud, so that memory
/// freed by one thread serves the next allocation of any other; and pages
/// freed are given back to the system at once rather than held for a
/// decay period, since the largest frees (100,000 agents stopping) come
/// right before the next large allocation elsewhere.
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: Option<&'static std::ffi::c_char> = Some(
    // SAFETY: a static C string, read by jemalloc as one.
    unsafe { &*c"narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0".as_ptr() },
);

fn main() -> ExitCode {
    // Run under a hook tool's name: be that tool.
    // (Arguments are taken as the OS gives them: `std::env::args` panics on
    // one that is not UTF-8.)
    let mut argv = std::env::args_os();
    let argv0 = argv.next().unwrap_or_default();
    if let Some(tool) = argv0.to_str().and_then(hooktool::tool_name) {
        return hooktool::run(tool, argv.collect());
    }
    // A hook runs its tools, never jujube's user commands (it gets no
    // `JUJUBE_HOME`; this says so plainly instead of failing to find an
    // environment).
    if std::env::var_os("JUJU_CONTEXT_ID").is_some() {
        eprintln!(
            "error: `jujube` commands cannot run inside a hook context; a hook uses the hook tools ({})",
            jujube_agent::hooks::TOOLS.join(", ")
        );
        return ExitCode::from(2);
    }
    // What jujube creates is its user's alone (the state, logs, agents'
    // directories: relation settings hold charms' passwords); hooks get
    // Juju's usual 022 back (see the hook runner).
    // SAFETY: umask only sets this process's file-creation mask.
    unsafe {
        libc::umask(0o077);
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(ExitWith(code)) = e.downcast_ref::<ExitWith>() {
                return ExitCode::from(*code);
            }
            let usage = e.downcast_ref::<Usage>().is_some();
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                msg.push_str(&format!(": {cause}"));
            }
            eprintln!("error: {msg}");
            if usage {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// The controller and agents log to stderr (their supervisor's, init's or
/// systemd's log), at `info` unless `RUST_LOG` says otherwise.
fn init_log() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn run(cli: Cli) -> Result<()> {
    let home = Home::locate()?;
    let env_flag = cli.env.as_deref();
    let out = &mut std::io::stdout().lock();
    match cli.command {
        Command::Bootstrap {
            name,
            provider,
            config,
            constraints,
            default_series,
            manual_controller,
        } => {
            let config: BTreeMap<String, String> =
                key_values(&config, "config")?.into_iter().collect();
            let mut progress = progress::Reporter::new("bootstrap", false);
            let uuid = controller::bootstrap(
                &home,
                controller::BootstrapArgs {
                    name: &name,
                    provider: provider.as_str(),
                    config,
                    constraints: constraints.as_deref(),
                    default_series: &default_series,
                    in_machine_0: !manual_controller,
                },
                &mut progress,
            )?;
            writeln!(
                out,
                "bootstrapped environment `{name}` ({uuid}) on provider `{}`",
                provider.as_str()
            )?;
            if manual_controller {
                writeln!(out, "no controller started: run `jujube controller`")?;
            } else if provider.as_str() == "dummy" {
                supervise::start(&home, &name, 0)?;
                writeln!(
                    out,
                    "machine 0's controller runs in the background (log: `{}`)",
                    supervise::log_path(&home, &name, 0).display()
                )?;
            } else if provider.as_str() == "lxd" {
                writeln!(
                    out,
                    "machine 0's container runs the controller and holds the environment's state (restarted by its init if it dies)"
                )?;
            } else {
                writeln!(
                    out,
                    "machine 0's instance runs the controller (the systemd service `jujube-controller`) and holds the environment's state"
                )?;
            }
        }
        Command::Environments => {
            let current = home.current();
            for name in home.environments()? {
                let mark = if current.as_deref() == Some(&name) {
                    "*"
                } else {
                    " "
                };
                writeln!(out, "{mark} {name}")?;
            }
        }
        Command::DestroyEnvironment { name, yes } => {
            let name = home.select(Some(&name))?;
            if !home.holds(&name) {
                bail!("environment `{name}` was not bootstrapped from this home (`JUJUBE_HOME`): destroy it from the home that bootstrapped it");
            }
            if !yes {
                use std::io::IsTerminal;
                if !std::io::stdin().is_terminal() {
                    bail!("destroying environment `{name}` stops all its instances and deletes its state; add `--yes` to confirm");
                }
                write!(
                    out,
                    "Destroy environment `{name}`, all its instances and its state? [y/N] "
                )?;
                out.flush()?;
                let mut answer = String::new();
                std::io::stdin().read_line(&mut answer)?;
                if !matches!(answer.trim(), "y" | "Y" | "yes") {
                    bail!("not confirmed; environment `{name}` is unchanged");
                }
            }
            runtime()?.block_on(controller::destroy(&home, &name, out))?;
        }
        Command::Supervise { machine } => {
            let name = home.select(env_flag)?;
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .init();
            runtime()?.block_on(supervise::supervise(&home, &name, machine))?;
        }
        Command::TakeUp {
            home,
            uuid,
            bucket,
            key,
            hand_over_token_sha256,
            region,
            endpoint,
            machine,
        } => {
            init_log();
            let environment = env_flag
                .context("`take-up` needs the environment: `--env NAME`")?
                .to_string();
            let home = Home { root: home };
            use jujube_controller::machine0_ec2::{TakeUp, TakeUpFrom};
            let from = match (bucket, key, hand_over_token_sha256) {
                (Some(bucket), Some(key), None) => TakeUpFrom::Bucket { bucket, key },
                (None, None, Some(token_sha256)) => TakeUpFrom::HandOver { token_sha256 },
                _ => {
                    bail!("`take-up` takes `--bucket` with `--key`, or `--hand-over-token-sha256`")
                }
            };
            let take_up = TakeUp {
                env: environment.clone(),
                uuid,
                region,
                endpoint,
                from,
                machine,
            };
            runtime()?.block_on(async {
                jujube_controller::machine0_ec2::take_up(&home, &take_up).await?;
                jujube_controller::machine0_ec2::settle_on_instance(&home, &take_up).await?;
                controller::run(&home, &environment, machine).await
            })?;
        }
        Command::Controller { machine } => {
            let name = home.select(env_flag)?;
            init_log();
            runtime()?.block_on(controller::run(&home, &name, machine))?;
        }
        Command::DebugLog {
            include,
            lines,
            no_tail,
        } => {
            let name = home.select(env_flag)?;
            let client = Client::open(&home, &name)?;
            debuglog::run(&client, &include, lines, !no_tail, out)?;
        }
        Command::Run {
            unit,
            action,
            timeout,
            background,
            command,
        } => {
            let timeout = parse_timeout(&timeout)?;
            let name = home.select(env_flag)?;
            let code = match (action.split_first(), command.is_empty()) {
                (None, false) => {
                    let client = Client::open(&home, &name)?;
                    commands::run_command(&client, &unit, &command, timeout, out)?
                }
                (Some((action, params)), true) => {
                    let client = Client::open(&home, &name)?;
                    commands::run_action(
                        &client,
                        commands::ActionRun {
                            unit: &unit,
                            action,
                            params,
                            timeout,
                            background,
                        },
                        out,
                    )?
                }
                (None, true) => return Err(usage(format!(
                    "name an action to run on `{unit}` (`jujube run {unit} ACTION [KEY=VALUE]...`), or a command after `--`"
                ))),
                (Some(_), false) => return Err(usage(
                    "give an action or a command after `--`, not both; `jujube exec UNIT -- CMD` runs a command",
                )),
            };
            if code != 0 {
                return Err(ExitWith(code).into());
            }
        }
        Command::Exec {
            unit,
            timeout,
            command,
        } => {
            let timeout = parse_timeout(&timeout)?;
            let name = home.select(env_flag)?;
            let client = Client::open(&home, &name)?;
            let code = commands::run_command(&client, &unit, &command, timeout, out)?;
            if code != 0 {
                return Err(ExitWith(code).into());
            }
        }
        Command::ShowTask { id } => {
            let name = home.select(env_flag)?;
            let client = Client::open(&home, &name)?;
            let task: Task = client.call(ClientCall::Task { id })?;
            write!(out, "{}", commands::render_task(&task))?;
        }
        Command::Enroll {
            data_dir,
            api,
            ca_cert,
            token,
            identity_document,
            identity_signature,
        } => {
            let ca = std::fs::read_to_string(&ca_cert)
                .with_context(|| format!("cannot read `{}`", ca_cert.display()))?;
            let document = std::fs::read(&identity_document)
                .with_context(|| format!("cannot read `{}`", identity_document.display()))?;
            let signature = std::fs::read_to_string(&identity_signature)
                .with_context(|| format!("cannot read `{}`", identity_signature.display()))?;
            let conf = runtime()?
                .block_on(jujube_agent::remote::enroll(
                    std::slice::from_ref(&api),
                    &ca,
                    &token,
                    &document,
                    &signature,
                ))
                .map_err(|e| anyhow::anyhow!("cannot enroll at `{api}`: {e}"))?;
            let conf: jujube_agent::wire::AgentConf = serde_json::from_slice(&conf)
                .context("the controller answered with no agent configuration")?;
            std::fs::create_dir_all(&data_dir)
                .with_context(|| format!("cannot create `{}`", data_dir.display()))?;
            let path = data_dir.join(agent::CONF);
            conf.write(&path)
                .with_context(|| format!("cannot write `{}`", path.display()))?;
            writeln!(out, "enrolled as `{}`", conf.tag)?;
        }
        Command::Agent { data_dir } => {
            init_log();
            runtime()?.block_on(agent::run(&data_dir))?;
        }
        Command::DummyCloud { action } => {
            let name = home.select(env_flag)?;
            let cloud = controller::dummy(&home, &name)?;
            match action {
                DummyAction::Start { tags } => {
                    let tags = key_values(&tags, "tag")?.into_iter().collect();
                    writeln!(out, "{}", cloud.start_raw(tags)?)?;
                }
                DummyAction::Stop { ids } => {
                    cloud.stop_raw(&ids)?;
                    for id in ids {
                        writeln!(out, "stopped instance `{id}`")?;
                    }
                }
                DummyAction::List => {
                    serde_json::to_writer_pretty(&mut *out, &cloud.all_instances()?)?;
                    writeln!(out)?;
                }
            }
        }
        Command::Register { string } => users::register(&home, &string, out)?,
        Command::Login { user } => {
            let name = home.select(env_flag)?;
            users::login(&home, &name, user.as_deref(), out)?;
        }
        Command::Logout => {
            let name = home.select(env_flag)?;
            users::logout(&home, &name, out)?;
        }
        Command::Switch { name } => {
            let name = home.select(Some(&name))?;
            home.set_current(&name)?;
            writeln!(out, "current environment is now `{name}`")?;
        }
        command => {
            let name = home.select(env_flag)?;
            let client = Client::open(&home, &name)?;
            model_command(&client, &home, &name, command, out)?;
        }
    }
    Ok(())
}

fn model_command(
    client: &Client,
    home: &Home,
    name: &str,
    command: Command,
    out: &mut impl Write,
) -> Result<()> {
    match command {
        Command::Deploy {
            charm,
            service,
            num_units,
            constraints,
            series,
            to,
            repository,
            config,
        } => {
            let (dir, url_series) = charm::resolve(&charm, repository.as_deref())?;
            // Read here first: a charm the controller would refuse is
            // refused naming the user's own files, before any upload.
            jujube_controller::charm::read_dir(dir.clone(), url_series.clone())?;
            let deployed: Deployed = client.call(ClientCall::Deploy {
                charm: client.charm(&dir)?,
                url_series,
                series,
                service,
                units: num_units,
                constraints,
                to: to.as_deref().map(machine_id).transpose()?,
                settings: key_values(&config, "setting")?,
            })?;
            writeln!(
                out,
                "deployed service `{}` ({}) with {} unit(s)",
                deployed.service, deployed.charm_url, deployed.units
            )?;
        }
        Command::AddUnit {
            service,
            num_units,
            to,
        } => {
            let to = to.as_deref().map(machine_id).transpose()?;
            let units: Vec<String> = client.call(ClientCall::AddUnits {
                service,
                n: num_units,
                to,
            })?;
            for u in units {
                writeln!(out, "added unit `{u}`")?;
            }
        }
        Command::AddMachine {
            n,
            series,
            constraints,
        } => {
            if n == 0 {
                return Err(usage("`-n` must be at least 1"));
            }
            let ids: Vec<i64> = client.call(ClientCall::AddMachines {
                n,
                series,
                constraints,
            })?;
            for m in ids {
                writeln!(out, "added machine `{m}`")?;
            }
        }
        Command::EnableHa { n } => {
            let added: Vec<i64> = client.call(ClientCall::EnableHa { n })?;
            for m in &added {
                writeln!(out, "added controller machine `{m}`")?;
            }
            if added.is_empty() {
                writeln!(out, "the environment has {n} controllers already")?;
            }
            enable_ha_here(home, client, out)?;
        }
        Command::SetConstraints {
            service,
            constraints,
        } => client.call::<()>(ClientCall::SetConstraints {
            service,
            constraints,
        })?,
        Command::GetConstraints { service } => {
            let cons: String = client.call(ClientCall::GetConstraints { service })?;
            writeln!(out, "{cons}")?;
        }
        Command::Set { service, settings } => client.call::<()>(ClientCall::Set {
            service,
            settings: key_values(&settings, "setting")?,
        })?,
        Command::Get { service, format } => {
            render::settings(&client.call(ClientCall::Get { service })?, format, out)?
        }
        Command::SetEnvironment { config } => client.call::<()>(ClientCall::SetEnvironment {
            config: key_values(&config, "config")?,
        })?,
        Command::GetEnvironment { key } => {
            let config: BTreeMap<String, String> = client.call(ClientCall::GetEnvironment)?;
            match key {
                Some(k) => writeln!(
                    out,
                    "{}",
                    config.get(&k).ok_or_else(|| anyhow!("environment config has no key `{k}`; `jujube get-environment` lists the keys set"))?
                )?,
                None => {
                    for (k, v) in config {
                        writeln!(out, "{k}={v}")?;
                    }
                }
            }
        }
        Command::AddRelation { a, b } => {
            let key: String = client.call(ClientCall::AddRelation { a, b })?;
            writeln!(out, "added relation `{key}`")?;
        }
        Command::DestroyRelation { a, b } => {
            client.call::<()>(ClientCall::DestroyRelation { a, b })?
        }
        Command::DestroyUnit { units } => client.call::<()>(ClientCall::DestroyUnits { units })?,
        Command::DestroyService { service } => {
            client.call::<()>(ClientCall::DestroyService { service })?
        }
        Command::DestroyMachine { machines } => {
            let ids = machines
                .iter()
                .map(|m| machine_id(m))
                .collect::<Result<Vec<_>>>()?;
            client.call::<()>(ClientCall::DestroyMachines { ids })?;
        }
        Command::Resolved {
            all: true, retry, ..
        } => {
            let units: jujube_wire::client::Listed<String> =
                client.call(ClientCall::ResolveAll { retry })?;
            match (units.listed.as_slice(), units.count) {
                ([], _) => writeln!(out, "no unit is in error")?,
                ([one], 1) => writeln!(out, "resolved unit `{one}`")?,
                (some, count) => {
                    let names: Vec<String> = some.iter().map(|u| format!("`{u}`")).collect();
                    let more = count.saturating_sub(some.len() as u64);
                    writeln!(
                        out,
                        "resolved {count} units in error: {}{}",
                        names.join(", "),
                        if more > 0 {
                            format!(" and {more} more")
                        } else {
                            String::new()
                        }
                    )?
                }
            }
        }
        Command::Resolved {
            machine: Some(unit),
            constraints,
            retry,
            ..
        } if unit.contains('/') => {
            if constraints.is_some() {
                return Err(usage(
                    "`--constraints` is for machines; a unit's constraints are its service's",
                ));
            }
            client.call::<()>(ClientCall::ResolveUnit { unit, retry })?;
        }
        Command::Resolved {
            machine,
            constraints,
            retry,
            ..
        } => {
            let machine = machine.unwrap_or_default();
            if retry {
                return Err(usage("`--retry` is for units (a failed hook); a machine in error is simply provisioned again"));
            }
            client.call::<()>(ClientCall::ResolveMachine {
                id: machine_id(&machine)?,
                constraints,
            })?;
        }
        Command::Status { format } => {
            // Machine 0's agent status is the controller's to tell. Its
            // JSON is what `--format json` prints, passed through.
            if matches!(format, Format::Json) {
                client.call_into(ClientCall::Status, out)?;
                writeln!(out)?;
            } else {
                let st: Status = client.call(ClientCall::Status)?;
                render::status(&st, format, out)?
            }
            // What is shown stands whether or not the entry could be
            // updated; the next `status` tries again.
            let _ = follow_controllers(home, client);
        }
        Command::UpgradeCharm {
            service,
            path,
            repository,
            force,
        } => {
            // Without `--path`, a repository (`--repository` or
            // `$JUJUBE_REPOSITORY`) is looked in for the service's charm
            // by its URL (`local:SERIES/NAME`), as Juju does; with
            // neither, the controller reads its own copy again.
            let reference = match path {
                Some(p) => Some(p),
                None if repository.is_some() || std::env::var_os("JUJUBE_REPOSITORY").is_some() => {
                    let current: jujube_wire::client::ServiceSettings =
                        client.call(ClientCall::Get {
                            service: service.clone(),
                        })?;
                    let url = current.charm;
                    Some(
                        url.rsplit_once('-')
                            .filter(|(_, rev)| rev.chars().all(|c| c.is_ascii_digit()))
                            .map_or(url.clone(), |(base, _)| base.to_string()),
                    )
                }
                None => None,
            };
            let path = reference
                .map(|p| charm::resolve(&p, repository.as_deref()))
                .transpose()?
                .map(|(dir, _)| {
                    jujube_controller::charm::read_dir(dir.clone(), None)?;
                    client.charm(&dir)
                })
                .transpose()?;
            let url: String = client.call(ClientCall::UpgradeCharm {
                service: service.clone(),
                path,
                force,
            })?;
            writeln!(out, "service `{service}` upgraded to charm `{url}`")?;
        }
        Command::RetryProvisioning { machines, all } => {
            let ids = if all {
                None
            } else if machines.is_empty() {
                return Err(usage("name the machines to retry, or use `--all`"));
            } else {
                Some(
                    machines
                        .iter()
                        .map(|m| machine_id(m))
                        .collect::<Result<Vec<_>>>()?,
                )
            };
            let ids: jujube_wire::client::Listed<i64> =
                client.call(ClientCall::RetryProvisioning { ids })?;
            for id in &ids.listed {
                writeln!(out, "machine `{id}` will be provisioned again")?;
            }
            let more = ids.count.saturating_sub(ids.listed.len() as u64);
            if more > 0 {
                writeln!(out, "and {more} more machine(s) will be provisioned again")?;
            }
        }
        Command::AddUser { name: user, access } => {
            users::add_user(home, client, name, &user, access, out)?
        }
        Command::ChangeUserPassword { user } => {
            users::change_password(home, client, name, user.as_deref(), out)?
        }
        Command::Users { format } => render::users(
            &client.call::<Vec<UserInfo>>(ClientCall::Users)?,
            format,
            out,
        )?,
        Command::Grant { user, access } => users::change_access(client, &user, access, true, out)?,
        Command::Revoke { user, access } => {
            users::change_access(client, &user, access, false, out)?
        }
        Command::Strays { format } => {
            render::strays(&client.call::<Vec<Stray>>(ClientCall::Strays)?, format, out)?
        }
        Command::Wait { timeout } => {
            let timeout = jujube_core::duration::parse(&timeout).ok_or_else(|| {
                usage(format!(
                    "invalid `--timeout {timeout}`: use a duration such as `90s` or `10m`, at most 87600h"
                ))
            })?;
            commands::wait(client, timeout)?;
        }
        Command::Bootstrap { .. }
        | Command::Environments
        | Command::Switch { .. }
        | Command::DestroyEnvironment { .. }
        | Command::Controller { .. }
        | Command::Supervise { .. }
        | Command::Agent { .. }
        | Command::DebugLog { .. }
        | Command::Run { .. }
        | Command::Exec { .. }
        | Command::ShowTask { .. }
        | Command::Register { .. }
        | Command::Login { .. }
        | Command::Logout
        | Command::Enroll { .. }
        | Command::TakeUp { .. }
        | Command::DummyCloud { .. } => unreachable!("handled by run"),
    }
    Ok(())
}

/// After `enable-ha`: on the host that holds a dummy environment's
/// directory, every controller machine's controller left running in the
/// background (started where its supervisor is not running: `enable-ha`
/// again brings back one that was stopped), this home's controller entry
/// given each one's address, for the CLI to fail over between, and each
/// one waited for until it is up; for
/// controllers in containers (LXD), see [`controllers_in_containers`].
fn enable_ha_here(home: &Home, client: &Client, out: &mut impl Write) -> Result<()> {
    let name = client.name();
    // Not `status`: that grows with the model.
    let env: jujube_wire::client::EnvironmentInfo = client.call(ClientCall::Environment)?;
    let machines = env.controllers;
    if jujube_controller::machine0::hosted(home, name)?.is_some() {
        return controllers_in_containers(home, client, out);
    }
    if env.provider != "dummy" || !home.has_store(name) {
        return Ok(());
    }
    for &m in &machines {
        let running = jujube_controller::run::controller_runs(home, name, m)
            || supervise::running(home, name, m).is_some();
        if !running {
            supervise::start(home, name, m)?;
            writeln!(
                out,
                "machine {m}'s controller runs in the background (log: `{}`)",
                supervise::log_path(home, name, m).display()
            )?;
        }
    }
    if let Some(mut entry) = home.controller(name)? {
        let config: BTreeMap<String, String> = client.call(ClientCall::GetEnvironment)?;
        entry.addresses = controller::api_addresses(home, name, &config, &machines);
        home.set_controller(name, entry)?;
    }
    // Done when they serve, as on the other providers.
    controllers_up(client, out)?;
    Ok(())
}

/// After `status`: this home's controller entry follows the controllers
/// the environment records (added by `enable-ha` from another home, or
/// moved), as agents do (`followed_addresses`): the addresses it holds
/// that are still served first, then the others, up controllers' before
/// down ones'. Kept as it is when it shares none of them: it reaches the
/// controller through an address the controllers do not record (a tunnel,
/// machine 0's public address on EC2).
fn follow_controllers(home: &Home, client: &Client) -> Result<()> {
    let env: jujube_wire::client::EnvironmentInfo = client.call(ClientCall::Environment)?;
    let (up, down): (Vec<_>, Vec<_>) = env.controller_status.iter().partition(|c| c.state == "up");
    let mut learned: Vec<String> = Vec::new();
    for a in up.iter().chain(&down).flat_map(|c| c.addresses.iter()) {
        if !learned.contains(a) {
            learned.push(a.clone());
        }
    }
    let Some(mut entry) = home.controller(client.name())? else {
        return Ok(());
    };
    if let Some(next) = jujube_agent::remote::followed_addresses(&entry.addresses, &learned) {
        entry.addresses = next;
        home.set_controller(client.name(), entry)?;
    }
    Ok(())
}

/// How long `enable-ha` waits for the controllers the provisioner installs
/// on their instances to answer.
const CONTROLLERS_UP: std::time::Duration = std::time::Duration::from_secs(300);

/// After `enable-ha` of an environment whose controllers run on machines of
/// their own (LXD containers, EC2 instances): waits until every Alive
/// controller machine's controller is up (the provisioner starts its
/// instance and installs it there), then
/// gives this home's controller entry every one's address, machine 0's
/// first.
fn controllers_in_containers(home: &Home, client: &Client, out: &mut impl Write) -> Result<()> {
    let name = client.name();
    let up = controllers_up(client, out)?;
    let mut addresses: Vec<String> = Vec::new();
    for a in up.iter().flat_map(|c| c.addresses.iter()) {
        if !addresses.contains(a) {
            addresses.push(a.clone());
        }
    }
    if let Some(mut entry) = home.controller(name)? {
        entry.addresses = addresses;
        home.set_controller(name, entry)?;
    }
    for c in &up {
        writeln!(
            out,
            "machine {}'s controller is up at {}",
            c.machine,
            c.addresses.join(", ")
        )?;
    }
    Ok(())
}

/// Waits until every Alive controller machine's controller is up and says
/// where it serves, up to [`CONTROLLERS_UP`], saying which it waits for;
/// every controller's status then.
fn controllers_up(
    client: &Client,
    out: &mut impl Write,
) -> Result<Vec<jujube_wire::view::ControllerStatus>> {
    let deadline = std::time::Instant::now() + CONTROLLERS_UP;
    let mut said = BTreeMap::new();
    let up = loop {
        let env: jujube_wire::client::EnvironmentInfo = client.call(ClientCall::Environment)?;
        let st = env.controller_status;
        let waiting: Vec<&jujube_wire::view::ControllerStatus> = st
            .iter()
            .filter(|c| c.state != "up" || c.addresses.is_empty())
            .collect();
        if waiting.is_empty() {
            break st;
        }
        for c in &waiting {
            if said.insert(c.machine.clone(), c.state.clone()).as_ref() != Some(&c.state) {
                writeln!(
                    out,
                    "waiting for machine {}'s controller ({})",
                    c.machine, c.state
                )?;
            }
        }
        if std::time::Instant::now() >= deadline {
            let which: Vec<String> = waiting.iter().map(|c| format!("`{}`", c.machine)).collect();
            bail!("the controllers of machines {} are not up after {}s; see `jujube status` (a machine's status says why its instance did not start) and the controller's log (`controller-N.log` in the environment's directory on the dummy's host, `/var/lib/jujube/home/environments/NAME/controller.log` in an LXD container, `journalctl -u jujube-controller` on an EC2 instance), then run `jujube enable-ha` again to wait for them", which.join(", "), CONTROLLERS_UP.as_secs());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    };
    Ok(up)
}

fn parse_timeout(timeout: &str) -> Result<std::time::Duration> {
    jujube_core::duration::parse(timeout).ok_or_else(|| {
        usage(format!(
            "invalid `--timeout {timeout}`: use a duration such as `90s` or `5m`, at most 87600h"
        ))
    })
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

#[cfg(test)]
mod tests {
    /// Every command's arguments are well formed (clap checks them only
    /// when a command is used: `take-up`'s `--env` clashed with the global
    /// one, and only machine 0 ran it).
    #[test]
    fn every_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
