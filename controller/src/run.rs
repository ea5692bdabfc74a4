//! The controller and what it shares with other commands: building an
//! environment's provider, validating config, `wait`, `destroy-environment`.
//!
//! One controller runs per controller machine: machine 0's holds
//! `controller.lock` (machine N's `controller-N.lock`; see [`seat_file`]),
//! an exclusive `flock`, for its lifetime and writes its pid into it, so
//! that `destroy-environment` can ask it to stop (SIGTERM) and wait for the
//! lock.

use crate::home::Home;
use crate::{bail, refusal, Context, Result};
use jujube_core::Life;
use jujube_providers::dummy::DummyProvider;
use jujube_providers::Provider;
use jujube_provisioner::Provisioner;
use jujube_state::model::machine_status;
use jujube_state::Store;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tracing::{info, warn};

const LOCK: &str = "controller.lock";

/// A file of controller machine `machine`'s controller in the
/// environment's directory: `name` itself for machine 0 (as before there
/// were several), else `name` with `-N` before its extension
/// (`controller-2.lock`, `api-2.socket`, `api-addresses-2`).
pub fn seat_file(home: &Home, env_name: &str, machine: i64, name: &str) -> std::path::PathBuf {
    let dir = home.env_dir(env_name);
    if machine == 0 {
        return dir.join(name);
    }
    match name.split_once('.') {
        Some((stem, ext)) => dir.join(format!("{stem}-{machine}.{ext}")),
        None => dir.join(format!("{name}-{machine}")),
    }
}

/// Checks environment config against every component that reads it.
pub fn validate_config(provider: &str, config: &BTreeMap<String, String>) -> Result<()> {
    jujube_provisioner::Config::from_env(config)?;
    if let Some(v) = config.get("lxd-agents") {
        if !matches!(v.as_str(), "container" | "in-process") {
            bail!("unknown `lxd-agents` value `{v}`; use `container` (agents inside each machine's container) or `in-process`");
        }
    }
    if let Some(v) = config.get("agent-presence-lapse") {
        if !v.parse::<u64>().is_ok_and(|s| s >= 4) {
            bail!("`agent-presence-lapse={v}` is not a number of seconds of at least 4; e.g. `jujube set-environment agent-presence-lapse=60` (the default)");
        }
    }
    if let Some(v) = config.get("dummy-agents") {
        if !matches!(v.as_str(), "process" | "in-process") {
            bail!("unknown `dummy-agents` value `{v}`; use `in-process` or `process`");
        }
    }
    match provider {
        "dummy" => jujube_providers::dummy::validate_config(config)?,
        "lxd" => jujube_providers::lxd::validate_config(config)?,
        "ec2" => validate_ec2_config(config)?,
        _ => {}
    }
    Ok(())
}

/// The EC2 bootstrap's keys (see [`crate::machine0_ec2`]).
fn validate_ec2_config(config: &BTreeMap<String, String>) -> Result<()> {
    if let Some(b) = config.get("control-bucket") {
        jujube_providers::ec2::storage::validate_bucket_name(b)?;
    }
    if let Some(v) = config.get("bootstrap-timeout") {
        if jujube_core::duration::parse(v).is_none_or(|d| d.is_zero()) {
            bail!("`bootstrap-timeout={v}` is not a duration; give one like `10m` (the default) or `900s`");
        }
    }
    if let Some(v) = config.get("use-private-address") {
        if !matches!(v.as_str(), "true" | "false") {
            bail!("`use-private-address={v}` is not `true` or `false`");
        }
    }
    if let Some(v) = config.get("api-allowed-cidr") {
        let ok = v.split_once('/').is_some_and(|(ip, bits)| {
            ip.parse::<std::net::Ipv4Addr>().is_ok() && bits.parse::<u8>().is_ok_and(|b| b <= 32)
        });
        if !ok {
            bail!("`api-allowed-cidr={v}` is not an IPv4 range like `203.0.113.0/24`; the API port opens to it (default `0.0.0.0/0`)");
        }
    }
    match config.get("controller-credentials").map(String::as_str) {
        None | Some("instance-profile") => {}
        Some("hand-over") => {
            if let Some(p) = config.get("instance-profile").filter(|p| *p != "none") {
                bail!("`controller-credentials=hand-over` gives machine 0 your credentials instead of an instance profile; drop `instance-profile={p}`, or drop `controller-credentials`");
            }
        }
        Some(v) => bail!("`controller-credentials={v}` is not `instance-profile` (the default: machine 0 acts with an IAM role bootstrap makes) or `hand-over` (bootstrap hands machine 0 the credentials it acts with)"),
    }
    for key in ["controller-address", "api-listen-address"] {
        if let Some(v) = config.get(key) {
            if v.rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
            {
                bail!("`{key}={v}` is not a host:port");
            }
        }
    }
    Ok(())
}

/// The provider of an environment.
pub async fn provider(home: &Home, env_name: &str, store: &Store) -> Result<Arc<dyn Provider>> {
    let env = store.environment()?;
    let config = store.environment_config()?;
    match env.provider.as_str() {
        "dummy" => Ok(Arc::new(DummyProvider::open(home.env_dir(env_name), &env.name, &env.uuid, &config)?)),
        // Machine 0's controller acts with the credentials it was handed,
        // if it was; else the default chain's (its instance profile).
        "ec2" => {
            let handed = crate::machine0_ec2::handed_credentials(&home.env_dir(env_name))?;
            Ok(Arc::new(
                jujube_providers::ec2::Ec2Provider::new_with(
                    &env.name,
                    &env.uuid,
                    &config,
                    handed.map(|c| c.to_sdk()),
                    None,
                )
                .await?,
            ))
        }
        "lxd" => Ok(Arc::new(jujube_providers::lxd::LxdProvider::new(
            &env.uuid, &config,
        )?)),
        other => bail!("provider `{other}` is not available in this build of jujube; use `--provider dummy`, `ec2` or `lxd`"),
    }
}

/// The dummy cloud of an environment, for the `dummy-cloud` command.
pub fn dummy(home: &Home, env_name: &str) -> Result<DummyProvider> {
    let store = home.open(env_name)?;
    let env = store.environment()?;
    if env.provider != "dummy" {
        bail!(
            "environment `{env_name}` runs on provider `{}`, not the dummy cloud",
            env.provider
        );
    }
    Ok(DummyProvider::open(
        home.env_dir(env_name),
        &env.name,
        &env.uuid,
        &store.environment_config()?,
    )?)
}

/// Holds the environment's controller lock for as long as it lives.
pub struct ControllerLock(File);

impl ControllerLock {
    /// Writes our pid into the lock file, for `destroy-environment`.
    fn write_pid(&mut self) -> Result<()> {
        self.0.set_len(0)?;
        writeln!(self.0, "{}", std::process::id())?;
        self.0.flush()?;
        Ok(())
    }
}

fn lock_path(home: &Home, env_name: &str, machine: i64) -> std::path::PathBuf {
    seat_file(home, env_name, machine, LOCK)
}

/// Whether a controller runs for the environment, told without touching
/// its lock (taking it, even for a moment, would make a controller starting
/// at that moment refuse to run): the pid it wrote in its lock file still
/// runs `jujube controller`.
pub fn controller_runs(home: &Home, env_name: &str, machine: i64) -> bool {
    let Some(pid) = std::fs::read_to_string(lock_path(home, env_name, machine))
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    else {
        return false;
    };
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"controller"))
}

pub fn try_lock(home: &Home, env_name: &str, machine: i64) -> Result<Option<ControllerLock>> {
    let path = lock_path(home, env_name, machine);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open `{}`", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(Some(ControllerLock(f))),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("cannot lock `{}`", path.display()))
        }
    }
}

/// How long `destroy-environment` waits for a running controller to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// Asks the controller that holds the lock to stop (SIGTERM to the pid it
/// wrote) and waits until it has released the lock, which is then ours.
async fn stop_controller(
    home: &Home,
    name: &str,
    machine: i64,
    out: &mut impl Write,
) -> Result<ControllerLock> {
    let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
    let mut signalled: Option<i32> = None;
    loop {
        if let Some(lock) = try_lock(home, name, machine)? {
            if let Some(pid) = signalled {
                writeln!(out, "stopped the controller of `{name}` (pid {pid})")?;
            }
            return Ok(lock);
        }
        if signalled.is_none() {
            // Empty while the holder has not written it yet: look again.
            let pid = std::fs::read_to_string(lock_path(home, name, machine))
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
                .filter(|p| *p > 0);
            if let Some(pid) = pid {
                // SAFETY: kill(2) has no memory effects; the pid is the one
                // the live holder of the controller lock wrote.
                if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
                    let err = std::io::Error::last_os_error();
                    // ESRCH: it has just exited; the lock tells.
                    if err.raw_os_error() != Some(libc::ESRCH) {
                        bail!("cannot stop the controller of environment `{name}` (pid {pid}): {err}; stop it yourself and try again");
                    }
                }
                info!(pid, "asked the controller to stop");
                signalled = Some(pid);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            match signalled {
                Some(pid) => bail!("the controller of environment `{name}` (pid {pid}) did not stop within {}s; stop it (`kill {pid}`) and try again", STOP_TIMEOUT.as_secs()),
                None => bail!("a controller is running for environment `{name}` and did not say its pid; stop it first"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The API server agents reach the controller through: TLS with the
/// environment's CA (made now if the environment predates it), on
/// `api-address` (default `127.0.0.1:0`, a free port) and on the unix socket
/// `api.socket` in the environment's directory. The addresses it really
/// listens on are written to `api-addresses` there. It answers users with
/// `clients` from its first connection.
pub async fn start_api(
    home: &Home,
    env_name: &str,
    machine: i64,
    store: &Store,
    facades: std::sync::Arc<jujube_agent_state::Facades>,
    clients: Arc<dyn jujube_api::clients::ClientHandler>,
) -> Result<jujube_api::ApiServer> {
    let env = store.environment()?;
    let dir = home.env_dir(env_name);
    jujube_api::tls::ensure(&dir, &env.uuid)?;
    let config = store.environment_config()?;
    // Where it listens: `api-listen-address` where that differs from the
    // address agents dial (machine 0 on EC2 listens on every interface).
    // Machine 0's, and any controller's in a container of its own (its
    // init named where the daemon's host exposes it); other controllers
    // on one host take free ports.
    let own_host = machine == 0 || crate::machine0::advertised_addresses().is_some();
    let address = if own_host {
        config
            .get("api-listen-address")
            .or(config.get("api-address"))
            .cloned()
            .unwrap_or_else(|| "127.0.0.1:0".to_string())
    } else {
        "127.0.0.1:0".to_string()
    };
    // Pings and presence notes a quarter of the lapse apart (15 s at the
    // default minute): a frozen agent loses its connection, and then its
    // presence, within the lapse and a half.
    let lapse = config
        .get("agent-presence-lapse")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(jujube_state::credentials::PRESENCE_LAPSE as u64);
    let beat = std::time::Duration::from_secs((lapse / 4).clamp(1, 15));
    let socket = seat_file(home, env_name, machine, "api.socket");
    // A unix socket path is limited to 107 bytes: without one, agents use
    // the TCP address.
    let socket = (socket.as_os_str().len() < 100).then_some(socket);
    let api = jujube_api::ApiServer::start(
        &dir,
        store.clone(),
        facades,
        Some(&address),
        socket.as_deref(),
        jujube_api::Limits {
            keepalive: beat,
            presence_every: beat,
            ..jujube_api::Limits::default()
        },
        Some(clients),
    )
    .await?;
    let list = seat_file(home, env_name, machine, "api-addresses");
    std::fs::write(&list, api.addresses().join("\n") + "\n")
        .with_context(|| format!("cannot write `{}`", list.display()))?;
    info!(addresses = ?api.addresses(), "API server started");
    Ok(api)
}

/// Where users reach environment `env_name`'s controllers on this host:
/// each one's unix socket (where the path fits one), machine 0's first,
/// and, when `api-address` names a fixed port, machine 0's at that address.
pub fn api_addresses(
    home: &Home,
    env_name: &str,
    config: &BTreeMap<String, String>,
    machines: &[i64],
) -> Vec<String> {
    let mut out = Vec::new();
    for &m in machines {
        let socket = seat_file(home, env_name, m, "api.socket");
        if socket.as_os_str().len() < 100 {
            out.push(format!("unix:{}", socket.display()));
        }
        if m == 0 {
            if let Some(a) = config.get("api-address") {
                if !a.ends_with(":0") {
                    out.push(a.clone());
                }
            }
        }
    }
    out
}

/// Users' calls over the API: the client facade on a store handle acting
/// for the proven user.
struct Clients {
    home: Home,
    name: String,
    store: Store,
    runtime: tokio::runtime::Handle,
    logs: Arc<jujube_agent_state::logsink::LogSink>,
}

impl jujube_api::clients::ClientHandler for Clients {
    fn call(
        &self,
        user: &str,
        call: jujube_wire::client::ClientCall,
    ) -> std::result::Result<jujube_api::clients::Answer, jujube_wire::client::ClientError> {
        let zones =
            |store: &Store| crate::facade::zones_on(&self.runtime, &self.home, &self.name, store);
        let charms = self.home.env_dir(&self.name).join("charms");
        let cx = crate::facade::Context {
            zones: &zones,
            charms: &charms,
            logs: &self.logs,
            owner: &self.store,
        };
        crate::facade::call(&cx, &self.store.as_user(user), call)
    }
}

/// Where machine agents run, from environment config:
/// - `dummy-agents`: `in-process` (the default: tasks of the controller) or
///   `process` (one `jujube agent` process per machine, through the API
///   only; dummy provider only);
/// - `lxd-agents`: `container` (the default: inside each machine's
///   container, reaching the API through a socket LXD proxies in; the
///   image must run them, e.g. `jujube-agent` from `scripts/lxd-setup`) or
///   `in-process`.
///
/// Agents that run anywhere but in the controller get their machine's
/// credential from the provisioner at each start: the host (`Some`) runs
/// those on the controller's machine, the installer puts it on the
/// instance.
struct Placement {
    host: Option<jujube_agent_state::Mode>,
    installer: Option<Arc<Installer>>,
    /// Agents in LXD containers and controllers in containers of their
    /// own: each agent's container gets a socket to every controller
    /// (`machine0::proxy_controllers`, a singleton job).
    lxd_controllers: Option<Arc<jujube_providers::lxd::LxdProvider>>,
}

fn placement(
    home: &Home,
    env_name: &str,
    machine: i64,
    store: &Store,
    api: &jujube_api::ApiServer,
    provider: Arc<dyn Provider>,
) -> Result<Placement> {
    let config = store.environment_config()?;
    let env = store.environment()?;
    let dir = home.env_dir(env_name);
    let agents =
        |api_addresses: Vec<String>| -> Result<jujube_agent_state::process::ProcessAgents> {
            Ok(jujube_agent_state::process::ProcessAgents {
                exe: std::env::current_exe().context("cannot find the `jujube` binary")?,
                api_addresses,
                ca_cert: jujube_api::tls::ca_cert(&dir)?,
                env_name: env_name.to_string(),
                env_uuid: env.uuid.clone(),
            })
        };
    let installer = |agents: Option<jujube_agent_state::process::ProcessAgents>,
                     enroll: Option<(String, String)>,
                     api_connect: String,
                     controllers: Option<Arc<dyn crate::machine0::Seed>>| {
        Some(Arc::new(Installer {
            agents,
            api_connect,
            enroll,
            tokens: Mutex::new(HashMap::new()),
            proxies_controllers: env.provider == "lxd" && controllers.is_some(),
            controllers,
        }))
    };
    let in_process = Placement {
        host: Some(jujube_agent_state::Mode::InProcess),
        installer: None,
        lxd_controllers: None,
    };
    match (
        env.provider.as_str(),
        config.get("dummy-agents").map(String::as_str),
    ) {
        ("dummy", Some("process")) => {
            // Every controller's addresses, this one's first: agents fail
            // over between them.
            let a = agents(store.controller_addresses(machine)?)?;
            Ok(Placement {
                installer: installer(Some(a.clone()), None, String::new(), None),
                host: Some(jujube_agent_state::Mode::Process(a)),
                lxd_controllers: None,
            })
        }
        ("lxd", _) => {
            // A controller in a container installs the others (`enable-ha`).
            let controllers = crate::machine0::ControllerSeed::here(home, env_name, &config)?
                .map(|s| Arc::new(s) as Arc<dyn crate::machine0::Seed>);
            if !lxd_agents_in_containers(&config) {
                return Ok(Placement {
                    installer: controllers
                        .and_then(|seed| installer(None, None, String::new(), Some(seed))),
                    ..in_process
                });
            }
            // Where the daemon's host finds the API for the agents'
            // containers: the address it proxies to machine 0's container
            // when the controller runs there, else this host's socket.
            let api_connect = match config.get("lxd-controller-address") {
                Some(address) => format!("tcp:{address}"),
                None => match api.unix_path() {
                    Some(socket) => format!("unix:{}", socket.display()),
                    None => bail!("the environment's directory `{}` is too deep for the API's unix socket, which LXD containers reach their controller through; use a shorter `JUJUBE_HOME`, or `jujube set-environment lxd-agents=in-process`", dir.display()),
                },
            };
            let lxd_controllers = match &controllers {
                Some(_) => Some(Arc::new(jujube_providers::lxd::LxdProvider::new(
                    &env.uuid, &config,
                )?)),
                None => None,
            };
            Ok(Placement {
                host: None,
                installer: installer(
                    Some(agents(vec![format!(
                        "unix:{}",
                        jujube_providers::lxd::AGENT_API_SOCKET
                    )])?),
                    None,
                    api_connect,
                    controllers,
                ),
                lxd_controllers,
            })
        }
        // Instances reach the API at `api-address`; without one, agents
        // stay in the controller (until it runs on machine 0 itself).
        ("ec2", _) if config.contains_key("api-address") => {
            // A controller on an instance of its own gives agents its own
            // address: machine 0's (`api-address`) is gone when another
            // took over from it.
            let address = crate::machine0_ec2::on_instance()
                .and_then(|i| i.agents.clone())
                .unwrap_or_else(|| config["api-address"].clone());
            let reachable = address
                .parse::<std::net::SocketAddr>()
                .map(|a| a.port() != 0 && !a.ip().is_unspecified())
                .unwrap_or(true);
            if !reachable {
                bail!("`api-address={address}` is where the controller listens, but instances need an address they can reach it at: set it to this machine's address and a fixed port, e.g. `jujube set-environment api-address=10.0.0.5:17070`");
            }
            let a = agents(vec![address.clone()])?;
            let sha = api
                .serve_tools(&a.exe)
                .with_context(|| format!("cannot read `{}`", a.exe.display()))?;
            api.enroll_with(Arc::new(Enrolls {
                store: store.clone(),
                provider,
                env_uuid: env.uuid.clone(),
                agents: a.clone(),
                keys: identity_keys(&config)?,
                region: config
                    .get("region")
                    .cloned()
                    .or_else(|| std::env::var("AWS_REGION").ok()),
            }));
            // A controller on an instance of its own installs the others
            // (`enable-ha`).
            let controllers =
                crate::machine0_ec2::Ec2Seed::here(home, env_name, &config, &env.uuid)?
                    .map(|s| Arc::new(s) as Arc<dyn crate::machine0::Seed>);
            Ok(Placement {
                host: None,
                installer: installer(Some(a), Some((address, sha)), String::new(), controllers),
                lxd_controllers: None,
            })
        }
        _ => Ok(in_process),
    }
}

/// The keys instance identity documents are checked against: AWS's for
/// the standard regions, and the certificates in the PEM file
/// `identity-certificates` names (an opt-in region's; AWS publishes one per
/// region).
fn identity_keys(
    config: &BTreeMap<String, String>,
) -> Result<jujube_providers::ec2::identity::IdentityKeys> {
    use jujube_providers::ec2::identity::IdentityKeys;
    let keys = IdentityKeys::aws_standard_regions();
    let Some(path) = config.get("identity-certificates") else {
        return Ok(keys);
    };
    let pem = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read `identity-certificates={path}`: give a PEM file of AWS's instance identity certificates, or `jujube set-environment identity-certificates=` to use the built-in ones")
    })?;
    Ok(keys.and(IdentityKeys::from_pem(&pem)?))
}

/// How long an enrollment token works: instances enroll at first boot.
const ENROLLMENT_TTL: Duration = Duration::from_secs(2 * 3600);

use jujube_core::time::unix_now;

/// Answers instances' enrollments: the instance proves which one it is
/// with its identity document signed by AWS (checked against AWS's key for
/// the region, or `identity-certificates`); the token must be live and
/// unused by that instance, and the provider must show the instance as
/// this environment's, launched in the token's batch; the machine is the
/// one whose start made it (by its nonce). The token alone is never
/// enough: every instance of a batch holds it, and an instance can read
/// only its own identity document. Every refusal reads the same.
struct Enrolls {
    store: Store,
    provider: Arc<dyn Provider>,
    env_uuid: String,
    agents: jujube_agent_state::process::ProcessAgents,
    keys: jujube_providers::ec2::identity::IdentityKeys,
    /// The environment's region: a document from another is refused.
    region: Option<String>,
}

/// Whether an enrollment from `peer` may come from an instance whose
/// private address is `private_ip`. Where they meet directly (the peer a
/// private address: the same VPC, or a peered one) the peer must be the
/// instance itself; from loopback (a tunnel or proxy on the controller's
/// host) or a public address (a NAT gateway) nothing can be told.
fn peer_may_be(peer: &str, private_ip: Option<&str>) -> bool {
    let Ok(ip) = peer.parse::<std::net::IpAddr>() else {
        return true;
    };
    let direct = match ip {
        std::net::IpAddr::V4(v4) => v4.is_private() || v4.is_link_local(),
        std::net::IpAddr::V6(v6) => v6.is_unique_local() || v6.is_unicast_link_local(),
    };
    !direct || private_ip.and_then(|p| p.parse::<std::net::IpAddr>().ok()) == Some(ip)
}

#[async_trait::async_trait]
impl jujube_api::server::Enroller for Enrolls {
    async fn enroll(
        &self,
        token: &str,
        identity: &jujube_api::server::Identity,
    ) -> std::result::Result<Vec<u8>, jujube_agent::api::ApiError> {
        use jujube_agent::api::{ApiError, ErrorCode};
        let refused = || {
            ApiError::new(
                ErrorCode::Unauthorized,
                jujube_state::credentials::ENROLLMENT_REFUSED,
            )
        };
        let internal = |e: String| ApiError::new(ErrorCode::Unavailable, e);
        let doc = match self.keys.verify(&identity.document, &identity.signature) {
            Ok(doc) => doc,
            Err(e) => {
                warn!(peer = %identity.peer, "enrollment refused: {e}");
                return Err(refused());
            }
        };
        if self.region.as_ref().is_some_and(|r| *r != doc.region) {
            warn!(peer = %identity.peer, region = %doc.region, "enrollment refused: an identity document of another region");
            return Err(refused());
        }
        if !peer_may_be(&identity.peer, doc.private_ip.as_deref()) {
            warn!(peer = %identity.peer, instance = %doc.instance_id, "enrollment refused: the identity document is another instance's");
            return Err(refused());
        }
        let instance_id = doc.instance_id.as_str();
        let hash = jujube_agent::wire::secret_hash(token);
        let now = unix_now();
        let batch = self
            .store
            .enrollment_batch(&hash, now)
            .map_err(|e| internal(e.to_string()))?
            .ok_or_else(refused)?;
        let found = self
            .provider
            .instances_by_id(&[instance_id.to_string()])
            .await
            .map_err(|e| internal(e.to_string()))?;
        let inst = found
            .into_iter()
            .find(|i| i.id == instance_id && i.owned_by(&self.env_uuid))
            .ok_or_else(refused)?;
        let nonce = inst.nonce().ok_or_else(refused)?.to_string();
        let in_batch = nonce == batch
            || jujube_providers::launch_batch(&nonce).is_some_and(|(b, _)| b == batch);
        if !in_batch {
            return Err(refused());
        }
        let machine = self
            .store
            .machine_by_nonce(&nonce)
            .map_err(|e| internal(e.to_string()))?
            .ok_or_else(refused)?;
        let tag = jujube_agent::api::Tag::Machine(machine);
        let secret = jujube_agent::wire::new_secret();
        self.store
            .enroll_machine(
                &hash,
                instance_id,
                machine,
                &tag.to_string(),
                &jujube_agent::wire::secret_hash(&secret),
                now,
            )
            .map_err(|e| match e {
                e if e.is_refusal() => refused(),
                e => internal(e.to_string()),
            })?;
        info!(machine, instance = instance_id, "instance enrolled");
        serde_json::to_vec_pretty(&self.agents.conf(tag, secret))
            .map_err(|e| internal(e.to_string()))
    }
}

/// `lxd-agents`: `container` (the default) or `in-process`.
fn lxd_agents_in_containers(config: &BTreeMap<String, String>) -> bool {
    matches!(
        config.get("lxd-agents").map(String::as_str),
        None | Some("container")
    )
}

/// Gives a machine's agent a fresh credential at each start attempt (only
/// its hash is stored, replacing any earlier one) and the `agent.conf`
/// holding it, for the provider to put on the instance.
/// This controller's name as a lease holder: `machine-N/HOST/ID`, where
/// `ID` is the start of the host's `/etc/machine-id`. A holder's name must
/// be one process's alone (two processes under one name would both hold
/// the lease under one token, which no fence tells apart); the host's file
/// lock keeps one per machine id and host, and the machine id tells two
/// hosts of one hostname apart, while a controller restarted on its host
/// keeps its name (and so takes its own lease back at once). Without a
/// machine id, a name drawn for this process: a restart then waits for
/// the old lease to run out.
fn holder_name(machine: i64) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let id = std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|id| id.trim().chars().take(8).collect::<String>())
        .filter(|id| id.len() == 8)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()[..8].to_string());
    format!("machine-{machine}/{}/{id}", host.trim())
}

struct Installer {
    /// `None`: machine agents are not installed on instances (they run in
    /// the controller).
    agents: Option<jujube_agent_state::process::ProcessAgents>,
    /// Where the API is on the provider's host (LXD's proxy `connect`).
    api_connect: String,
    /// For instances enrolling from shared user data: the API address they
    /// use and the binary's SHA-256.
    enroll: Option<(String, String)>,
    /// One enrollment token per launch batch, with when it was minted: a
    /// batch is launched once, and its instances keep the token they booted
    /// with, whose hash the store keeps until it expires. Kept here until
    /// then too, never longer: a token past its time is no use to an
    /// instance, and a controller's life of batches was kept in full.
    tokens: Mutex<HashMap<String, (String, tokio::time::Instant)>>,
    /// Where controller machines get their controller from (`enable-ha` on
    /// LXD and EC2); `None`: they get none on their instance.
    controllers: Option<Arc<dyn crate::machine0::Seed>>,
    /// Whether agents' containers get a socket to every controller
    /// (controllers in LXD containers).
    proxies_controllers: bool,
}

impl jujube_provisioner::AgentInstaller for Installer {
    fn prepare(
        &self,
        store: &Store,
        machine: i64,
        nonce: &str,
    ) -> std::result::Result<Option<jujube_providers::AgentInstall>, String> {
        let m = store.machine(machine).map_err(|e| e.to_string())?;
        if m.manages_environ() && !m.hosts_units() {
            let Some(seed) = &self.controllers else {
                return Ok(None);
            };
            let exe = std::env::current_exe()
                .map_err(|e| format!("cannot find the `jujube` binary: {e}"))?;
            return Ok(Some(jujube_providers::AgentInstall {
                conf: Vec::new(),
                binary: exe,
                api_connect: String::new(),
                other_controllers: Vec::new(),
                enrollment: None,
                controller: Some(seed.install(machine, nonce).map_err(|e| e.to_string())?),
            }));
        }
        let Some(agents) = self.agents.as_ref().filter(|_| m.hosts_units()) else {
            return Ok(None);
        };
        if let Some((api_address, sha)) = &self.enroll {
            let batch = jujube_providers::launch_batch(nonce).map_or(nonce, |(b, _)| b);
            let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
            // Minted this long ago at most, so that an instance still has
            // the time a token is meant to give it.
            let fresh = ENROLLMENT_TTL / 2;
            let token = match tokens
                .get(batch)
                .filter(|(_, minted)| minted.elapsed() < fresh)
            {
                Some((t, _)) => t.clone(),
                None => {
                    // Once a batch: the others' tokens past their time go.
                    tokens.retain(|_, (_, minted)| minted.elapsed() < fresh);
                    let t = jujube_agent::wire::new_secret();
                    let now = unix_now();
                    store
                        .add_enrollment(
                            &jujube_agent::wire::secret_hash(&t),
                            batch,
                            now + ENROLLMENT_TTL.as_secs() as i64,
                            now,
                        )
                        .map_err(|e| e.to_string())?;
                    tokens.insert(batch.to_string(), (t.clone(), tokio::time::Instant::now()));
                    t
                }
            };
            return Ok(Some(jujube_providers::AgentInstall {
                conf: Vec::new(),
                binary: agents.exe.clone(),
                api_connect: String::new(),
                other_controllers: Vec::new(),
                enrollment: Some(jujube_providers::Enrollment {
                    token,
                    api_address: api_address.clone(),
                    ca_cert: agents.ca_cert.clone(),
                    binary_sha256: sha.clone(),
                }),
                controller: None,
            }));
        }
        let tag = jujube_agent::api::Tag::Machine(machine);
        let secret = jujube_agent::wire::new_secret();
        store
            .set_machine_credential(
                machine,
                &tag.to_string(),
                &jujube_agent::wire::secret_hash(&secret),
            )
            .map_err(|e| e.to_string())?;
        // With other controllers in containers of their own, a socket to
        // each one too, and the agent told of them all from its start.
        let other_controllers = if self.proxies_controllers {
            crate::machine0::other_controllers(store).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        let mut conf = agents.conf(tag, secret);
        conf.api_addresses.extend(
            other_controllers
                .iter()
                .map(|(m, _)| format!("unix:{}", jujube_providers::lxd::agent_api_socket(*m))),
        );
        let conf = serde_json::to_vec_pretty(&conf).map_err(|e| e.to_string())?;
        Ok(Some(jujube_providers::AgentInstall {
            conf,
            binary: agents.exe.clone(),
            api_connect: self.api_connect.clone(),
            other_controllers,
            enrollment: None,
            controller: None,
        }))
    }
}

/// Wall-clock unix milliseconds.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// How often a running controller records itself ([`Store::controller_seen`]):
/// `status` tells it `down` after the agents' presence lapse.
const SEEN_EVERY: Duration = Duration::from_secs(3);

/// `jujube controller [--machine N]`: controller machine `machine`'s
/// controller — the API server, and under the singletons lease the
/// provisioner, the cleaner and the machine agents run from this host —
/// until SIGINT/SIGTERM.
pub async fn run(home: &Home, env_name: &str, machine: i64) -> Result<()> {
    jujube_agent::startup::begin();
    if let Some(m0) = crate::machine0::hosted(home, env_name)? {
        let kind = if m0.provider == "ec2" {
            "instance"
        } else {
            "container"
        };
        bail!("environment `{env_name}`'s controller runs in machine 0's {kind} `{}`, which holds its state; there is none to run on this host", m0.container);
    }
    let store = home.open(env_name)?;
    if machine != 0 {
        match store.machine(machine) {
            Ok(m) if m.manages_environ() && m.life == Life::Alive => {}
            _ => bail!("machine `{machine}` is not an alive controller machine of environment `{env_name}`; `jujube status` lists the controllers"),
        }
    }
    let mut lock = try_lock(home, env_name, machine)?.ok_or_else(|| {
        if machine == 0 {
            refusal!("a controller is already running for environment `{env_name}`; stop it first")
        } else {
            refusal!("machine `{machine}`'s controller is already running for environment `{env_name}`; stop it first")
        }
    })?;
    lock.write_pid()?;
    let provider = provider(home, env_name, &store).await?;
    // Settings the provisioner cannot run with stop the controller here, as
    // they always did; the provisioner itself starts under the lease below.
    jujube_provisioner::Config::from_env(&store.environment_config()?)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    info!(environment = env_name, machine, "controller started");
    // The API first: agents the provisioner installs on instances are given
    // its CA and addresses.
    // One change router and one writer for every agent, remote or in
    // process: the API server and the host share them.
    let facades = std::sync::Arc::new(jujube_agent_state::Facades::new(store.clone())?);
    let logs = Arc::new(
        jujube_agent_state::logsink::LogSink::open(&home.env_dir(env_name).join("logsink"))
            .context("cannot open the log sink")?,
    );
    facades.keep_logs(logs.clone());
    let clients = Arc::new(Clients {
        home: Home {
            root: home.root.clone(),
        },
        name: env_name.to_string(),
        store: store.clone(),
        runtime: tokio::runtime::Handle::current(),
        logs,
    });
    let api = start_api(home, env_name, machine, &store, facades.clone(), clients).await?;
    let holder = holder_name(machine);
    // Recorded before anything else happens, so that `status`, agents and
    // the other controllers know where it serves; then every few seconds.
    // In a container, where the daemon's host exposes it: its own
    // addresses are the container's; on an instance, the instance's: it
    // listens on every address.
    let addresses = crate::machine0::advertised_addresses().unwrap_or_else(|| api.addresses());
    store.controller_seen(machine, &holder, &addresses, wall_ms())?;
    // Leases and these records on connections of their own: neither waits
    // behind the agents' writes (see `singletons::Claimer`).
    let own = Store::open_at(store.location(), jujube_state::Durability::Full)?;
    let claimer = crate::singletons::Claimer::start(own.clone())
        .context("cannot start the lease-claiming thread")?;
    let seen = {
        let (store, holder, mut stop) = (own, holder.clone(), stop_rx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(SEEN_EVERY) => {}
                    _ = stop.changed() => return,
                }
                let (store, holder, addresses) = (store.clone(), holder.clone(), addresses.clone());
                let r = tokio::task::spawn_blocking(move || {
                    store.controller_seen(machine, &holder, &addresses, wall_ms())
                })
                .await;
                if let Ok(Err(e)) = r {
                    warn!(error = %e, "cannot record this controller as running; will retry");
                }
            }
        })
    };
    jujube_agent::hooks::runner::set_environment(jujube_agent::hooks::runner::Environment {
        name: env_name.to_string(),
        uuid: store.environment()?.uuid,
        api_addresses: api.addresses(),
        exe: std::env::current_exe().ok(),
        private_address: None,
    });
    let placement = placement(home, env_name, machine, &store, &api, provider.clone())?;
    if placement.lxd_controllers.is_some() {
        facades.agents_reach_controllers_at(Arc::new(|m| {
            format!("unix:{}", jujube_providers::lxd::agent_api_socket(m))
        }))?;
    }

    // The provisioner, the cleaner and the machine agents run from this
    // host while this controller holds the singletons lease, all on a store
    // fenced by its token: they stop with the lease, so that two
    // controllers never run one machine's agent, and what they still had
    // in flight when it moved (a cut-off controller's agents reporting
    // that the database is unreachable) is refused, not written over what
    // the new holder's agents report.
    let singletons = {
        let installer = placement.installer;
        let host_mode = placement.host;
        let lxd_controllers = placement.lxd_controllers;
        let agents_dir = home.env_dir(env_name).join("agents");
        let facades = facades.clone();
        let start: crate::singletons::StartJobs = Box::new(move |store, stop| {
            let mut jobs = Vec::new();
            match Provisioner::new(store.clone(), provider.clone()) {
                Ok(p) => {
                    if let Some(i) = &installer {
                        p.install_agents(i.clone());
                    }
                    let stop = stop.clone();
                    jobs.push(tokio::spawn(async move {
                        if let Err(e) = p.run(stop).await {
                            warn!(error = %e, "the provisioner stopped");
                        }
                    }));
                }
                Err(e) => {
                    // A job ended at once: the holding stops the others and
                    // starts them all again after a while, so this is tried
                    // again.
                    warn!(error = %e, "cannot start the provisioner; trying again");
                    jobs.push(tokio::spawn(async {}));
                }
            }
            // The machine agents (and their unit agents) of every machine
            // with an instance, deploying under the environment's data
            // dir, unless they run on the instances themselves.
            if let Some(mode) = &host_mode {
                match jujube_agent_state::Host::on(
                    &facades,
                    store.clone(),
                    agents_dir.clone(),
                    mode.clone(),
                ) {
                    Ok(host) => {
                        let mut stop = stop.clone();
                        jobs.push(tokio::spawn(async move {
                            let _ = stop.wait_for(|s| *s).await;
                            host.shutdown().await;
                        }));
                    }
                    Err(e) => {
                        // Ended at once, as the provisioner's above.
                        warn!(error = %e, "cannot start the machine agents; trying again");
                        jobs.push(tokio::spawn(async {}));
                    }
                }
            }
            if let Some(lxd) = &lxd_controllers {
                jobs.push(crate::machine0::proxy_controllers(
                    store.clone(),
                    lxd.clone(),
                    stop.clone(),
                ));
            }
            jobs.push(cleaner(store, stop));
            jobs
        });
        crate::singletons::hold(
            store.clone(),
            claimer,
            holder,
            crate::singletons::LeaseTimes::default(),
            crate::singletons::database_clock(),
            start,
            stop_rx,
        )
        .context("cannot start the lease's holding thread")?
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("interrupted; shutting down"),
        _ = term.recv() => info!("terminated; shutting down"),
    }
    stop_tx.send_replace(true);
    let _ = singletons.await;
    let _ = seen.await;
    drop(api);
    // Parsed by the agents benchmark: `STEP=COUNT@SECONDS ...`.
    info!(
        "unit agents' start, since the controller's: {}",
        jujube_agent::startup::summary()
    );
    let stats = store.stats();
    info!(
        transactions = stats.transactions,
        largest_transaction_rows = stats.max_transaction_rows,
        "controller stopped"
    );
    Ok(())
}

/// The cleaner: runs cleanups, reports kinds this version does not know,
/// and prunes the change feed, on every commit and every 30 s, until
/// `stop`.
fn cleaner(store: Store, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut watcher = store.watch(0).with_poll_interval(Duration::from_secs(1));
        // Cleanups of kinds this version does not know, reported once.
        let mut reported = std::collections::HashSet::new();
        // It wakes on every commit (agents make thousands a second):
        // write transactions only when there is work, so that it does
        // not take the write lock from the agents for nothing.
        let mut pruned_at = 0u64;
        loop {
            let pending = store.pending_cleanups().unwrap_or(1);
            match if pending > 0 {
                store.run_cleanups(usize::MAX)
            } else {
                Ok(0)
            } {
                Ok(n) if n > 0 => info!(steps = n, "cleanups done"),
                Ok(_) => {}
                Err(e) => warn!(error = %e, "cleanup failed; will retry"),
            }
            match store.skipped_cleanups() {
                Ok(skipped) => {
                    for c in skipped.into_iter().filter(|c| reported.insert(c.id)) {
                        warn!(
                            id = c.id,
                            kind = %c.kind,
                            target = %c.target,
                            "skipping a cleanup of a kind this jujube does not know (queued by a newer version); it stays queued for a version that knows it"
                        );
                    }
                }
                Err(e) => warn!(error = %e, "listing skipped cleanups failed"),
            }
            let head = store.head_revision().unwrap_or(u64::MAX);
            if head >= pruned_at.saturating_add(1000) {
                match store.prune_changes(100_000, 1000) {
                    // Nothing (more) to prune: not before 1,000 more
                    // changes.
                    Ok(n) if n < 999 => pruned_at = head,
                    Ok(_) => {}
                    Err(e) => warn!(error = %e, "pruning the change feed failed"),
                }
            }
            tokio::select! {
                _ = watcher.next_head() => {}
                _ = tokio::time::sleep(Duration::from_secs(30)) => {}
                _ = stop.changed() => return,
            }
        }
    })
}

/// The most machines `wait` names in what it waits for (it counts the
/// rest): it asks several times a second, and a deploy of 100,000 units
/// would otherwise have each answer read and name every machine.
const MACHINES_LISTED: usize = 20;

/// What keeps an environment from being settled, in words.
pub fn stuck(store: &Store) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let now = unix_now();
    if let Some(p) = store.provider_status()? {
        out.push(format!(
            "the provider cannot be reached (for {}s): {}",
            (now - p.since).max(0),
            p.message
        ));
    }
    let (machines, unsettled) = store.unsettled_machines(MACHINES_LISTED)?;
    for m in machines {
        match m.life {
            Life::Alive if m.instance_id.is_none() && m.status != machine_status::ERROR => out
                .push(if m.status_info.is_empty() {
                    format!("machine {} has no instance yet (status {})", m.id, m.status)
                } else {
                    format!(
                        "machine {} has no instance yet ({}: {})",
                        m.id, m.status, m.status_info
                    )
                }),
            Life::Dead => out.push(format!(
                "machine {} is dead and waits for its instance to be stopped",
                m.id
            )),
            // Its agent sets it Dead once its units are gone (or, without
            // an instance, the provisioner removes it).
            Life::Dying if m.agent_status != jujube_state::model::agent_status::ERROR => {
                // Name what holds it: its units, and which of them a failed
                // hook holds (and the command that frees them).
                let (_, units) = store.machine_context(m.id)?;
                let held: Vec<&str> = units
                    .iter()
                    .filter(|u| u.status == jujube_state::model::agent_status::ERROR)
                    .map(|u| u.name.as_str())
                    .collect();
                out.push(if let Some(u) = held.first() {
                    format!(
                        "machine {} is dying and waits for unit `{u}`, held by a failed hook (`jujube resolved {u}`)",
                        m.id
                    )
                } else if !units.is_empty() {
                    let names: Vec<String> = units.iter().map(|u| format!("`{}`", u.name)).collect();
                    format!(
                        "machine {} is dying and waits for its units to go ({})",
                        m.id,
                        names.join(", ")
                    )
                } else {
                    format!("machine {} is dying and waits for its agent to stop it", m.id)
                })
            }
            _ => {}
        }
    }
    if unsettled > MACHINES_LISTED as u64 {
        out.push(format!(
            "and {} more machine(s) waiting likewise (`jujube status` lists them)",
            unsettled - MACHINES_LISTED as u64
        ));
    }
    out.extend(store.awaiting_agents(3)?);
    let cleanups = store.pending_cleanups()?;
    if cleanups > 0 {
        out.push(format!("{cleanups} cleanup(s) pending"));
    }
    // The first few due, and a count of the rest.
    let strays = store.strays()?;
    let mut due: Vec<_> = strays
        .iter()
        .filter_map(|s| s.reap_at.map(|at| (at, s)))
        .collect();
    due.sort_by_key(|(at, _)| *at);
    for (at, s) in due.iter().take(MACHINES_LISTED) {
        out.push(format!(
            "stray instance {} is to be reaped in {}s",
            s.instance_id,
            (at - now).max(0)
        ));
    }
    let more = due.len().saturating_sub(MACHINES_LISTED) as u64 + store.strays_unlisted()?;
    if more > 0 {
        out.push(format!(
            "and {more} more stray instance(s) (`jujube strays` lists the first ones)"
        ));
    }
    Ok(out)
}

/// The most units in error `wait` names (it counts them all); as many
/// machines in error.
const UNITS_LISTED: usize = 20;

/// What `wait` fails with when something is in error: machines whose
/// provisioning failed and units (subordinates too) held by a failed hook —
/// which also hold their relations and machines — each with what frees it.
/// Empty when nothing is.
pub fn errors_listed(store: &Store) -> Result<String> {
    let mut out = String::new();
    let (machines, in_error) = store.machines_in_error(UNITS_LISTED)?;
    if !machines.is_empty() {
        let shown: Vec<String> = machines
            .iter()
            .map(|(id, info)| format!("machine {id}: {info}"))
            .collect();
        let more = in_error.saturating_sub(shown.len() as u64);
        let more = if more > 0 {
            format!("\n  and {more} more")
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{in_error} machine(s) in error:\n  {}{more}\nfix the causes, then `jujube resolved MACHINE` or `jujube retry-provisioning --all`\n",
            shown.join("\n  ")
        ));
    }
    let units = store.units_in_error(UNITS_LISTED + 1)?;
    if !units.is_empty() {
        let shown: Vec<String> = units
            .iter()
            .take(UNITS_LISTED)
            .map(|(u, info)| format!("unit `{u}`: {info}"))
            .collect();
        let more = if units.len() > UNITS_LISTED {
            "\n  (and more)"
        } else {
            ""
        };
        out.push_str(&format!(
            "unit(s) held by a failed hook:\n  {}{more}\nfix the charm, then `jujube resolved UNIT --retry` (or without `--retry` to skip the hook; `--all` for every unit)\n",
            shown.join("\n  ")
        ));
    }
    Ok(out.trim_end().to_string())
}

/// `jujube destroy-environment`: stops every instance of the environment,
/// then deletes its state.
pub async fn destroy(home: &Home, name: &str, out: &mut impl Write) -> Result<()> {
    if let Some(m0) = crate::machine0::hosted(home, name)? {
        return crate::machine0::destroy(home, name, m0, out).await;
    }
    if !home.has_store(name) {
        bail!("environment `{name}` was not bootstrapped from this home (`JUJUBE_HOME`): destroy it from the home that bootstrapped it");
    }
    let store = home.open(name)?;
    // Each controller machine's supervisor first, which stops its
    // controller (else it would start it again); then any other controller
    // is asked to stop; their locks are then ours, so that no controller
    // starts while the environment is destroyed.
    let controllers: Vec<i64> = store
        .machines()?
        .into_iter()
        .filter(|m| m.manages_environ())
        .map(|m| m.id)
        .collect();
    let mut _locks = Vec::new();
    for &m in &controllers {
        crate::supervise::stop_supervisor(home, name, m, STOP_TIMEOUT, out).await?;
    }
    for &m in &controllers {
        _locks.push(match try_lock(home, name, m)? {
            Some(lock) => lock,
            None => stop_controller(home, name, m, out).await?,
        });
    }
    // Agent processes a controller killed with -9 left running.
    let stopped = jujube_agent_state::process::stop_all(&home.env_dir(name).join("agents")).await;
    if stopped > 0 {
        writeln!(out, "stopped {stopped} agent process(es)")?;
    }
    let provider = provider(home, name, &store).await?;
    // Everything the state knows of, and everything tagged as ours.
    let ids: Vec<String> = store
        .machines()?
        .into_iter()
        .filter_map(|m| m.instance_id)
        .collect();
    stop_every_instance(&*provider, ids, None, out).await?;
    provider.destroy_environment().await?;
    store.erase()?;
    forget_environment(home, name, out)
}

/// Stops `ids` and every instance the provider lists as the environment's
/// but `except`, listing again until none is left (a start answered late
/// shows up in a later listing); at most 30 rounds.
pub(crate) async fn stop_every_instance(
    provider: &dyn Provider,
    mut ids: Vec<String>,
    except: Option<&str>,
    out: &mut impl Write,
) -> Result<()> {
    for attempt in 0..30 {
        ids.extend(
            provider
                .instances()
                .await?
                .into_iter()
                .map(|i| i.id)
                .filter(|id| Some(id.as_str()) != except),
        );
        ids.sort();
        ids.dedup();
        if ids.is_empty() {
            break;
        }
        provider.stop_instances(&ids).await?;
        writeln!(out, "stopped {} instance(s)", ids.len())?;
        ids.clear();
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// The end of `destroy-environment` on this host: the environment's
/// directory removed, and this home's entries for it.
pub(crate) fn forget_environment(home: &Home, name: &str, out: &mut impl Write) -> Result<()> {
    let dir = home.env_dir(name);
    std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove `{}`", dir.display()))?;
    home.forget(name)?;
    if home.current().as_deref() == Some(name) {
        home.clear_current()?;
    }
    writeln!(out, "destroyed environment `{name}`")?;
    Ok(())
}

/// What `bootstrap` shows of its progress (the CLI draws it).
pub trait Progress {
    /// A line of its own.
    fn line(&mut self, line: &str);
    /// What it waits for now: `msg` for a terminal's bar, `line` for a
    /// log.
    fn update(&mut self, msg: &str, line: &str);
    /// The last line.
    fn finish(&mut self, line: &str);
}

/// What `bootstrap` asks for.
pub struct BootstrapArgs<'a> {
    pub name: &'a str,
    pub provider: &'a str,
    pub config: BTreeMap<String, String>,
    pub constraints: Option<&'a str>,
    pub default_series: &'a str,
    /// Whether machine 0 runs the controller (LXD: in its container, where
    /// the store then lives), rather than a controller on this host.
    pub in_machine_0: bool,
}

/// `jujube bootstrap`: the environment's directory, its store, its CA and
/// the API server's certificate, `admin` (with a password only this home's
/// account file holds: the store keeps its hash), this home's controller
/// entry and account, and machine 0 provisioned; the environment is made
/// current. On failure nothing is left behind. Answers its UUID.
pub fn bootstrap(
    home: &Home,
    args: BootstrapArgs<'_>,
    progress: &mut dyn Progress,
) -> Result<String> {
    let name = args.name;
    jujube_core::names::validate_environment(name)?;
    validate_config(args.provider, &args.config)?;
    let constraints = args
        .constraints
        .map(jujube_core::Constraints::parse)
        .transpose()?
        .unwrap_or_default();
    jujube_providers::check_supported(args.provider, &constraints)?;
    jujube_core::series::validate(args.default_series)?;
    if home.env_dir(name).exists() {
        bail!("environment `{name}` already exists; choose another name, or remove it with `jujube destroy-environment {name}`");
    }
    let spec = jujube_state::environment::EnvironmentSpec {
        name: name.to_string(),
        uuid: uuid::Uuid::new_v4().to_string(),
        provider: args.provider.to_string(),
        default_series: args.default_series.to_string(),
        constraints,
        config: args.config,
    };
    let in_container = args.in_machine_0 && spec.provider == "lxd";
    let state_place = state_place(&spec.config, args.in_machine_0 && spec.provider == "ec2")?;
    if let (Some(place), true) = (&state_place, in_container) {
        crate::machine0::check_state_reachable(&place.url, &spec.config)?;
    }
    let dir = home.create_env_dir(name)?;
    let result = (|| {
        if let Some(place) = &state_place {
            home.set_state_url(name, place)?;
        }
        let store = home.open(name)?;
        store.initialize(&spec)?;
        jujube_api::tls::ensure(&dir, &spec.uuid)?;
        let password = crate::facade::new_secret();
        store.create_admin(&password)?;
        home.set_controller(
            name,
            crate::home::ControllerEntry {
                uuid: spec.uuid.clone(),
                addresses: api_addresses(home, name, &spec.config, &[0]),
                ca_cert: jujube_api::tls::ca_cert(&dir)?,
            },
        )?;
        home.set_account(
            name,
            Some(crate::home::Account {
                user: jujube_wire::client::ADMIN.to_string(),
                password: password.clone(),
            }),
        )?;
        if args.in_machine_0 && spec.provider == "ec2" {
            runtime()?.block_on(crate::machine0_ec2::bootstrap(
                home, name, store, &password, progress,
            ))?;
        } else {
            bootstrap_machine_0(home, name, &store, progress)?;
            if args.in_machine_0 && spec.provider == "lxd" {
                runtime()?.block_on(crate::machine0::move_in(
                    home, name, store, &password, progress,
                ))?;
            }
        }
        home.set_current(name)
    })();
    if let Err(e) = result {
        // A database elsewhere is left as it was found (reached through
        // the place itself: machine 0's hand-over may have removed this
        // home's `state-url.json` already).
        if let Some(place) = &state_place {
            if let Ok(store) = place.open() {
                let _ = store.erase();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let _ = home.forget(name);
        return Err(e);
    }
    Ok(spec.uuid)
}

/// `state-url` (and `state-password-file`) of a bootstrap's config: the
/// state in PostgreSQL rather than this home's SQLite file. Checked before
/// anything is made: a URL with a password in it, or a database that
/// cannot be reached, leaves nothing behind.
fn state_place(
    config: &BTreeMap<String, String>,
    on_ec2_machine_0: bool,
) -> Result<Option<crate::home::StatePlace>> {
    let Some(url) = config.get("state-url") else {
        if config.contains_key("state-password-file") {
            bail!("`state-password-file` is only for `state-url`; give both, or neither");
        }
        return Ok(None);
    };
    // A relative `sslrootcert` is this directory's: kept absolute, as the
    // password file is, so that later commands find it from anywhere.
    let url = match crate::machine0::with_root_at(url, "").1 {
        Some(root) if root.is_relative() => {
            let root = std::path::absolute(&root)?;
            crate::machine0::with_root_at(url, &root.to_string_lossy()).0
        }
        _ => url.clone(),
    };
    let place = crate::home::StatePlace {
        url: url.clone(),
        password_file: config
            .get("state-password-file")
            .map(std::path::absolute)
            .transpose()?,
    };
    let target = place.target()?;
    if on_ec2_machine_0 {
        crate::machine0_ec2::check_state_reachable(&url, config)?;
    }
    // Refused here, before the environment exists: a database that is not
    // empty of jujube's state (another environment's).
    let store = Store::open_at(
        &jujube_state::Location::Postgres(target),
        jujube_state::Durability::Full,
    )?;
    if store.environment().is_ok() {
        bail!("the database at `{url}` already holds an environment's state; give each environment a database (or schema) of its own");
    }
    Ok(Some(place))
}

/// Gives an environment bootstrapped before users existed its `admin`
/// (with a new password) and this home its controller entry and account.
pub fn adopt(home: &Home, name: &str) -> Result<()> {
    let store = home.open(name)?;
    let admin = jujube_wire::client::ADMIN;
    let password = crate::facade::new_secret();
    match store.login(admin)? {
        None => store.create_admin(&password)?,
        Some(_) => store.set_user_password(admin, &password)?,
    }
    let env = store.environment()?;
    let config = store.environment_config()?;
    home.set_controller(
        name,
        crate::home::ControllerEntry {
            uuid: env.uuid,
            addresses: api_addresses(home, name, &config, &[0]),
            ca_cert: jujube_api::tls::ca_cert(&home.env_dir(name))?,
        },
    )?;
    home.set_account(
        name,
        Some(crate::home::Account {
            user: admin.to_string(),
            password,
        }),
    )
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Provisions machine 0 and waits for it, showing how it goes; on failure
/// stops whatever was started for it, so that the caller can delete the
/// environment and leave nothing behind.
fn bootstrap_machine_0(
    home: &Home,
    name: &str,
    store: &Store,
    progress: &mut dyn Progress,
) -> Result<()> {
    runtime()?.block_on(async {
        let provider = provider(home, name, store).await?;
        let started = provision_machine_0(store, provider.clone(), progress).await;
        if started.is_err() {
            // Whatever was started for it, and what the provider made for
            // the environment, goes.
            let ours: Vec<String> = provider
                .instances()
                .await?
                .into_iter()
                .map(|i| i.id)
                .collect();
            provider.stop_instances(&ours).await?;
            provider.destroy_environment().await?;
        }
        started
    })
}

/// Provisions machine 0 through `provider` and waits for it, showing how it
/// goes. On failure the caller removes what was made.
pub(crate) async fn provision_machine_0(
    store: &Store,
    provider: Arc<dyn Provider>,
    progress: &mut dyn Progress,
) -> Result<()> {
    {
        let kind = provider.kind();
        progress.line(&format!(
            "starting machine 0 (the controller) on provider `{kind}`"
        ));
        let p = Provisioner::new(store.clone(), provider.clone())?;
        let start = p.provision_now(&[0]);
        tokio::pin!(start);
        let t0 = std::time::Instant::now();
        let failed = loop {
            tokio::select! {
                r = &mut start => break r?,
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {
                    let m = store.machine(0)?;
                    let what = match m.status.as_str() {
                        "provisioning" => format!("waiting for `{kind}` to start machine 0's instance"),
                        _ => format!("preparing machine 0 (status {})", m.status),
                    };
                    let msg = format!("{what} ({}s)", t0.elapsed().as_secs());
                    progress.update(&msg, &what);
                }
            }
        };
        if let Some((_, why)) = failed.first() {
            progress.finish("machine 0 failed to start");
            bail!("bootstrap failed: {why}");
        }
        let m = store.machine(0)?;
        progress.finish(&format!(
            "machine 0 started: instance `{}`{}",
            m.instance_id.unwrap_or_default(),
            m.zone
                .map(|z| format!(" in zone `{z}`"))
                .unwrap_or_default()
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::peer_may_be;

    /// A store in a directory of its own, and an installer of machine
    /// agents on it (enrolling from shared user data with `enroll`).
    fn installer(
        enroll: Option<(String, String)>,
    ) -> (tempfile::TempDir, jujube_state::Store, super::Installer) {
        let dir = tempfile::tempdir().unwrap();
        let st = jujube_state::Store::open(dir.path().join("state.db")).unwrap();
        st.initialize(&jujube_state::environment::EnvironmentSpec {
            name: "t".into(),
            uuid: "00000000-0000-4000-8000-000000000000".into(),
            provider: "dummy".into(),
            default_series: "jammy".into(),
            constraints: Default::default(),
            config: Default::default(),
        })
        .unwrap();
        let installer = super::Installer {
            agents: Some(jujube_agent_state::process::ProcessAgents {
                exe: "/bin/true".into(),
                api_addresses: vec!["127.0.0.1:17070".into()],
                ca_cert: String::new(),
                env_name: "t".into(),
                env_uuid: "00000000-0000-4000-8000-000000000000".into(),
            }),
            api_connect: String::new(),
            enroll,
            tokens: Default::default(),
            controllers: None,
            proxies_controllers: false,
        };
        (dir, st, installer)
    }

    /// What the installer writes for a start (the machine's credential) goes
    /// through the provisioner's store, with its lease's fence: a
    /// provisioner whose lease another controller took cannot replace the
    /// credential of the instance its successor starts.
    #[test]
    fn the_installer_writes_under_the_provisioners_fence() {
        use jujube_provisioner::AgentInstaller;
        use std::time::Duration;
        let (_dir, st, installer) = installer(None);
        let m = st.add_machines(1, None, None).unwrap()[0];
        let ttl = Duration::from_secs(15);
        let held = |c| match c {
            jujube_state::leases::Claim::Held(f) => f,
            other => panic!("not held: {other:?}"),
        };
        let a = held(st.claim_lease("provisioner", "a", 1_000, ttl).unwrap());
        installer
            .prepare(&st.fenced(a.clone()), m, "n1")
            .unwrap()
            .unwrap();
        // `a`'s lease ran out and `b` took it.
        let b = held(st.claim_lease("provisioner", "b", 100_000, ttl).unwrap());
        let err = installer.prepare(&st.fenced(a), m, "n2").unwrap_err();
        assert!(err.contains("lease"), "{err}");
        installer.prepare(&st.fenced(b), m, "n3").unwrap().unwrap();
    }

    /// A launch batch's machines share one enrollment token, minted once;
    /// tokens are let go once past half their time (a batch prepared
    /// later gets a new one, and the map keeps only recent batches).
    #[tokio::test(start_paused = true)]
    async fn enrollment_tokens_are_one_per_batch_and_let_go_when_old() {
        use jujube_provisioner::AgentInstaller;
        let (_dir, st, installer) = installer(Some(("127.0.0.1:17070".into(), "00".repeat(32))));
        let ms = st.add_machines(3, None, None).unwrap();
        let token = |m: i64, nonce: &str| {
            installer
                .prepare(&st, m, nonce)
                .unwrap()
                .unwrap()
                .enrollment
                .unwrap()
                .token
        };
        let (n0, n1) = (
            jujube_providers::batch_nonce("b1", 0),
            jujube_providers::batch_nonce("b1", 1),
        );
        let first = token(ms[0], &n0);
        assert_eq!(token(ms[1], &n1), first, "one token a batch");
        tokio::time::advance(super::ENROLLMENT_TTL / 2).await;
        let other = token(ms[2], &jujube_providers::batch_nonce("b2", 0));
        let tokens = installer.tokens.lock().unwrap();
        assert_eq!(tokens.len(), 1, "b1's token let go when b2's was minted");
        assert_eq!(tokens["b2"].0, other);
        drop(tokens);
        assert_ne!(
            token(ms[0], &n0),
            first,
            "b1 again, past its time: a new token"
        );
    }

    #[test]
    fn ec2_bootstrap_keys_are_checked_before_anything_is_made() {
        let check = |k: &str, v: &str| {
            super::validate_config("ec2", &[(k.to_string(), v.to_string())].into())
                .map_err(|e| e.to_string())
        };
        for (k, v, says) in [
            (
                "control-bucket",
                "Not_A_Bucket",
                "is not a valid S3 bucket name",
            ),
            (
                "bootstrap-timeout",
                "soon",
                "`bootstrap-timeout=soon` is not a duration",
            ),
            ("bootstrap-timeout", "0s", "is not a duration"),
            ("use-private-address", "yes", "is not `true` or `false`"),
            ("api-allowed-cidr", "10.0.0.0/33", "is not an IPv4 range"),
            ("api-allowed-cidr", "everyone", "is not an IPv4 range"),
            ("controller-address", "127.0.0.1", "is not a host:port"),
            ("api-listen-address", ":17070", "is not a host:port"),
            (
                "controller-credentials",
                "mine",
                "is not `instance-profile` (the default",
            ),
        ] {
            let err = check(k, v).unwrap_err();
            assert!(err.contains(says), "{k}={v}: {err}");
        }
        // A hand-over gives machine 0 no profile: naming one contradicts it.
        let both = super::validate_config(
            "ec2",
            &[
                ("controller-credentials".into(), "hand-over".into()),
                ("instance-profile".into(), "ops-profile".into()),
            ]
            .into(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            both.contains("drop `instance-profile=ops-profile`"),
            "{both}"
        );
        for (k, v) in [
            ("control-bucket", "my-jujube-tools"),
            ("bootstrap-timeout", "15m"),
            ("use-private-address", "true"),
            ("api-allowed-cidr", "203.0.113.0/24"),
            ("controller-address", "localhost:17070"),
            ("controller-credentials", "hand-over"),
            ("controller-credentials", "instance-profile"),
        ] {
            check(k, v).unwrap();
        }
    }

    #[test]
    fn a_presence_lapse_below_four_seconds_or_not_a_number_is_refused() {
        let with = |v: &str| {
            super::validate_config(
                "dummy",
                &[("agent-presence-lapse".to_string(), v.to_string())].into(),
            )
        };
        assert!(with("4").is_ok());
        for bad in ["3", "0", "-5", "1m", ""] {
            let e = with(bad).unwrap_err().to_string();
            assert!(
                e.contains("is not a number of seconds of at least 4"),
                "{e}"
            );
        }
    }

    #[test]
    fn an_enrollment_met_directly_must_come_from_the_documents_instance() {
        // The same VPC: the peer is the instance, or it is another's claim.
        assert!(peer_may_be("10.0.1.7", Some("10.0.1.7")));
        assert!(!peer_may_be("10.0.1.8", Some("10.0.1.7")));
        assert!(!peer_may_be("172.31.2.3", None));
        assert!(!peer_may_be("fd00::5", Some("10.0.1.7")));
        // Through a tunnel or proxy on the controller's host, the unix
        // socket, or a NAT gateway's public address: nothing to tell.
        assert!(peer_may_be("127.0.0.1", Some("10.0.1.7")));
        assert!(peer_may_be("unix", Some("10.0.1.7")));
        assert!(peer_may_be("203.0.113.9", Some("10.0.1.7")));
    }
}
