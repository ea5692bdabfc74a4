//! LXD: machines are system containers on one LXD daemon, reached over its
//! unix socket (or HTTPS with a client certificate, for a remote daemon).
//!
//! # What a container of ours looks like
//! - named `jujube-<env-short>-<machine>`, `<env-short>` being the first 8
//!   hex digits of the environment UUID (LXD names are hostnames: 63
//!   characters at most, so the full UUID does not fit in the name);
//! - config `user.jujube-env-uuid` (the FULL UUID), `user.jujube-machine-id`,
//!   `user.jujube-nonce`, and `user.jujube-controller` on machine 0.
//!
//! Ownership needs BOTH the name prefix and the full UUID: a container
//! with only one of them (a look-alike name, or a copied config) is never
//! listed, looked up, stopped or deleted. Names without the prefix are not
//! even asked about.
//!
//! # Why the calls are shaped this way (LXD 5.0)
//! - Create and start are separate calls: the create-time `start` flag is
//!   ignored by 5.0.
//! - Every async operation is waited on and its real outcome read; a
//!   duplicate name is accepted and fails only in the operation.
//! - A running container cannot be deleted: stop (forced), then delete.
//! - Starting again with a nonce whose container exists adopts it (and
//!   starts it if it is stopped): idempotency survives a lost response. A
//!   container of the same machine with another nonce is the leftover of an
//!   earlier failed start of that machine (the provisioner only starts
//!   machines with no recorded instance) and is replaced.

pub mod client;
pub mod controller;

use crate::{
    Error, Instance, Provider, Result, StartSpec, TAG_CONTROLLER, TAG_ENV_UUID, TAG_MACHINE_ID,
    TAG_NAME, TAG_NONCE,
};
use async_trait::async_trait;
use client::{query_escape, ApiError, Client};
use futures_util::stream::{self, StreamExt};
use hyper::Method;
use jujube_core::Constraints;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::RwLock;
use tracing::{debug, info, warn};

/// Config keys this provider reads; every other `lxd-*` key is refused.
pub const CONFIG_KEYS: [&str; 11] = [
    "image-alias",
    // Read by the controller: machine agents inside the containers
    // (`container`, the default) or in the controller (`in-process`).
    "lxd-agents",
    // Read by the controller in machine 0's container: where its API is
    // proxied to on the daemon's host, which agents' containers connect to.
    "lxd-controller-address",
    "image-aliases",
    "lxd-socket",
    "lxd-url",
    "lxd-client-cert",
    "lxd-client-key",
    "lxd-server-cert",
    "lxd-profiles",
    "lxd-storage-pool",
];

/// How many containers one call creates or deletes at a time. The daemon
/// does the work; more in flight only queues inside it.
const PARALLEL: usize = 8;

const CFG_UUID: &str = "user.jujube-env-uuid";
const CFG_MACHINE: &str = "user.jujube-machine-id";
const CFG_NONCE: &str = "user.jujube-nonce";
const CFG_CONTROLLER: &str = "user.jujube-controller";

/// What the provider reads from the environment config.
#[derive(Debug, Clone, PartialEq)]
struct Config {
    /// One alias for every series.
    image_alias: Option<String>,
    /// Per-series aliases; these win over `image_alias`.
    image_aliases: BTreeMap<String, String>,
    profiles: Vec<String>,
    pool: String,
    transport: Transport,
}

#[derive(Debug, Clone, PartialEq)]
enum Transport {
    Unix(String),
    Https {
        url: String,
        cert: String,
        key: String,
        server_cert: String,
    },
}

impl Config {
    fn parse(config: &BTreeMap<String, String>) -> Result<Config> {
        for k in config.keys().filter(|k| k.starts_with("lxd-")) {
            if !CONFIG_KEYS.contains(&k.as_str()) {
                return Err(Error::Config(format!(
                    "unknown LXD config key `{k}`; known keys: {}",
                    CONFIG_KEYS.map(|k| format!("`{k}`")).join(", ")
                )));
            }
        }
        let mut image_aliases = BTreeMap::new();
        if let Some(list) = config.get("image-aliases") {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (series, alias) = item
                    .split_once(':')
                    .map(|(s, a)| (s.trim(), a.trim()))
                    .filter(|(s, a)| !s.is_empty() && !a.is_empty())
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "`image-aliases` item `{item}` is not `SERIES:ALIAS`; write e.g. `image-aliases=jammy:ubuntu/22.04,noble:ubuntu/24.04`"
                        ))
                    })?;
                jujube_core::series::validate(series)
                    .map_err(|e| Error::Config(format!("`image-aliases` item `{item}`: {e}")))?;
                image_aliases.insert(series.to_string(), alias.to_string());
            }
        }
        let image_alias = config
            .get("image-alias")
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        let profiles: Vec<String> = match config.get("lxd-profiles") {
            Some(p) => p
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            None => vec!["default".to_string()],
        };
        let https_keys = ["lxd-client-cert", "lxd-client-key", "lxd-server-cert"];
        let transport = match config.get("lxd-url") {
            Some(url) => {
                let get = |k: &str| {
                    config.get(k).cloned().ok_or_else(|| {
                        Error::Config(format!(
                            "`lxd-url` needs `{k}` too: set `lxd-client-cert`, `lxd-client-key` (PEM files of a certificate the daemon trusts) and `lxd-server-cert` (the daemon's certificate)"
                        ))
                    })
                };
                if config.contains_key("lxd-socket") {
                    return Err(Error::Config(
                        "set either `lxd-url` (a remote daemon) or `lxd-socket` (a local one), not both".into(),
                    ));
                }
                Transport::Https {
                    url: url.clone(),
                    cert: get("lxd-client-cert")?,
                    key: get("lxd-client-key")?,
                    server_cert: get("lxd-server-cert")?,
                }
            }
            None => {
                if let Some(k) = https_keys.iter().find(|k| config.contains_key(**k)) {
                    return Err(Error::Config(format!(
                        "`{k}` is only used with `lxd-url`; set `lxd-url=https://HOST:8443` too, or remove `{k}`"
                    )));
                }
                Transport::Unix(
                    config
                        .get("lxd-socket")
                        .cloned()
                        .unwrap_or_else(|| client::default_socket().to_string_lossy().into_owned()),
                )
            }
        };
        Ok(Config {
            image_alias,
            image_aliases,
            profiles,
            pool: config
                .get("lxd-storage-pool")
                .cloned()
                .unwrap_or_else(|| "default".to_string()),
            transport,
        })
    }

    /// The image alias for a series: `image-aliases`, then `image-alias`,
    /// then `ubuntu/<series>`.
    fn alias_for(&self, series: &str) -> String {
        self.image_aliases
            .get(series)
            .or(self.image_alias.as_ref())
            .cloned()
            .unwrap_or_else(|| format!("ubuntu/{series}"))
    }

    fn client(&self) -> Result<Client> {
        match &self.transport {
            Transport::Unix(path) => Ok(Client::unix(path)),
            Transport::Https {
                url,
                cert,
                key,
                server_cert,
            } => Client::https(url, cert, key, server_cert),
        }
    }
}

/// Checks LXD config keys without building a provider (files named by the
/// HTTPS keys are read when the provider is built).
pub fn validate_config(config: &BTreeMap<String, String>) -> Result<()> {
    Config::parse(config).map(|_| ())
}

/// Refuses constraint keys LXD cannot honour. Needs no daemon: the CLI
/// calls it before it changes anything.
pub fn check_supported(cons: &Constraints) -> Result<()> {
    let mut unsupported = Vec::new();
    if cons.instance_type().is_some() {
        unsupported.push("instance-type");
    }
    if cons.cpu_power().is_some() {
        unsupported.push("cpu-power");
    }
    if !cons.tags().is_empty() {
        unsupported.push("tags");
    }
    if cons.allocate_public_ip().is_some() {
        unsupported.push("allocate-public-ip");
    }
    if cons.container().is_some_and(|c| c != "none") {
        unsupported.push("container");
    }
    if cons.virt_type().is_some_and(|v| v != "container") {
        unsupported.push("virt-type");
    }
    if unsupported.is_empty() {
        return Ok(());
    }
    unsupported.sort();
    Err(Error::InvalidSpec(format!(
        "the lxd provider does not support constraint(s) {}; it honours `arch`, `cores`, `mem`, `root-disk` and `zones`",
        unsupported
            .iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// What the daemon's host offers, read once.
#[derive(Debug, Clone)]
struct Host {
    server_name: String,
    /// In jujube's names (`amd64`, `arm64` ...).
    arches: Vec<String>,
    cpus: u64,
    mem_mib: u64,
}

pub struct LxdProvider {
    env_uuid: String,
    /// `jujube-<first 8 of the UUID>-`.
    prefix: String,
    state: RwLock<State>,
    /// The agent binary last read, shared by every push.
    binary: tokio::sync::Mutex<Option<(std::path::PathBuf, bytes::Bytes)>>,
}

/// Where a container's machine agent lives: its `agent.conf`, its
/// deployments and logs (outside `/run` and `/tmp`, which the image's init
/// mounts over).
pub const AGENT_DIR: &str = "/var/lib/jujube/agent";
/// The controller's API inside a container: a socket LXD proxies to the
/// controller's `api.socket`, so the agent needs no network.
pub const AGENT_API_SOCKET: &str = "/var/lib/jujube/api.socket";
/// Where the `jujube` binary is installed in a container.
pub const AGENT_BINARY: &str = "/usr/local/bin/jujube";

/// Where controller machine `machine`'s API is inside an agent's container
/// (`enable-ha`): machine 0's at [`AGENT_API_SOCKET`], another's at
/// `api-N.socket` beside it, each proxied to that controller.
pub fn agent_api_socket(machine: i64) -> String {
    match machine {
        0 => AGENT_API_SOCKET.to_string(),
        m => format!("/var/lib/jujube/api-{m}.socket"),
    }
}

/// The proxy device named for controller machine `machine` in an agent's
/// container: its API socket there, connected to `connect` on the daemon's
/// host. Root's alone, as the agent is.
fn agent_api_device(machine: i64, connect: &str) -> (String, Value) {
    let name = match machine {
        0 => "jujube-api".to_string(),
        m => format!("jujube-api-{m}"),
    };
    (
        name,
        json!({
            "type": "proxy",
            "bind": "container",
            "listen": format!("unix:{}", agent_api_socket(machine)),
            "connect": connect,
            "uid": "0",
            "gid": "0",
            "mode": "0600",
        }),
    )
}

struct State {
    cfg: Config,
    client: Client,
    /// Read from the daemon on first use; forgotten when the connection
    /// config changes.
    host: Option<Host>,
}

/// Maps a kernel architecture name (LXD's) to jujube's.
fn arch_name(kernel: &str) -> &str {
    match kernel {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "armv7l" | "armv8l" => "armhf",
        "i686" => "i386",
        "ppc64le" => "ppc64el",
        other => other,
    }
}

/// `limits.memory` (`512MiB`, `1GB`, `2147483648`) in MiB.
fn parse_size_mib(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let bytes = match unit.trim() {
        "" | "B" => n,
        "kB" => n * 1000,
        "MB" => n * 1000 * 1000,
        "GB" => n * 1000 * 1000 * 1000,
        "TB" => n * 1000u64.pow(4),
        "KiB" => n << 10,
        "MiB" => n << 20,
        "GiB" => n << 30,
        "TiB" => n << 40,
        _ => return None,
    };
    Some(bytes >> 20)
}

impl LxdProvider {
    /// A provider for environment `env_uuid` on the daemon the config names
    /// (the local unix socket by default). Nothing is sent until it is used.
    pub fn new(env_uuid: &str, config: &BTreeMap<String, String>) -> Result<LxdProvider> {
        let short: String = env_uuid.chars().filter(|c| *c != '-').take(8).collect();
        if short.len() < 8 {
            return Err(Error::Config(format!(
                "environment UUID `{env_uuid}` is too short to name containers"
            )));
        }
        let cfg = Config::parse(config)?;
        let client = cfg.client()?;
        Ok(LxdProvider {
            env_uuid: env_uuid.to_string(),
            prefix: format!("jujube-{short}-"),
            state: RwLock::new(State {
                cfg,
                client,
                host: None,
            }),
            binary: tokio::sync::Mutex::new(None),
        })
    }

    /// The container name for a machine.
    pub fn container_name(&self, machine_id: &str) -> String {
        format!("{}{}", self.prefix, machine_id.replace('/', "-"))
    }

    fn state(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn cfg(&self) -> Config {
        self.state().cfg.clone()
    }

    fn client(&self) -> Client {
        self.state().client.clone()
    }

    /// True for names this environment could have made: the prefix and a
    /// plain name (nothing that would change the request path).
    fn ours_by_name(&self, name: &str) -> bool {
        name.strip_prefix(&self.prefix).is_some_and(|rest| {
            !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
    }

    /// Ownership: the prefix AND the full UUID.
    fn owned(&self, v: &Value) -> bool {
        v["name"].as_str().is_some_and(|n| self.ours_by_name(n))
            && v["config"][CFG_UUID].as_str() == Some(self.env_uuid.as_str())
    }

    /// Every container of this environment, as the daemon lists them
    /// (config and devices included).
    pub(super) async fn listed_ours(&self) -> Result<Vec<Value>> {
        let filter = query_escape(&format!("config.{CFG_UUID} eq {}", self.env_uuid));
        let list = self
            .client()
            .get(&format!("/1.0/instances?recursion=1&filter={filter}"))
            .await?
            .map_err(|e| e.into_error("listing instances"))?;
        Ok(match list {
            Value::Array(all) => all.into_iter().filter(|v| self.owned(v)).collect(),
            _ => Vec::new(),
        })
    }

    async fn host(&self) -> Result<Host> {
        if let Some(h) = &self.state().host {
            return Ok(h.clone());
        }
        let host = async {
                let c = self.client();
                let info = c
                    .get("/1.0")
                    .await?
                    .map_err(|e| e.into_error(&format!("LXD at `{}`", c.display())))?;
                let env = &info["environment"];
                if info["auth"].as_str() == Some("untrusted") {
                    return Err(Error::Credentials(format!(
                        "LXD at `{}` does not trust this client; add its certificate with `lxc config trust add`",
                        c.display()
                    )));
                }
                let res = c
                    .get("/1.0/resources")
                    .await?
                    .map_err(|e| e.into_error("LXD host resources"))?;
                let mut arches: Vec<String> = env["architectures"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(|s| arch_name(s).to_string())
                            .collect()
                    })
                    .unwrap_or_default();
                arches.dedup();
                Ok::<_, Error>(Host {
                    server_name: env["server_name"].as_str().unwrap_or("lxd").to_string(),
                    arches,
                    cpus: res["cpu"]["total"].as_u64().unwrap_or(1),
                    mem_mib: res["memory"]["total"].as_u64().unwrap_or(0) >> 20,
                })
            }
            .await?;
        self.state.write().unwrap_or_else(|p| p.into_inner()).host = Some(host.clone());
        Ok(host)
    }

    fn instance(&self, v: &Value, host: &Host) -> Instance {
        let name = v["name"].as_str().unwrap_or_default().to_string();
        let cfg = &v["config"];
        let mut tags = BTreeMap::new();
        for (key, tag) in [
            (CFG_UUID, TAG_ENV_UUID),
            (CFG_MACHINE, TAG_MACHINE_ID),
            (CFG_NONCE, TAG_NONCE),
            (CFG_CONTROLLER, TAG_CONTROLLER),
        ] {
            if let Some(s) = cfg[key].as_str() {
                tags.insert(tag.to_string(), s.to_string());
            }
        }
        tags.insert(TAG_NAME.to_string(), name.clone());
        let mut hw = vec![format!(
            "arch={}",
            arch_name(v["architecture"].as_str().unwrap_or("x86_64"))
        )];
        let cores = cfg["limits.cpu"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(host.cpus);
        hw.push(format!("cores={cores}"));
        let mem = cfg["limits.memory"]
            .as_str()
            .and_then(parse_size_mib)
            .unwrap_or(host.mem_mib);
        hw.push(format!("mem={mem}M"));
        if let Some(size) = v["devices"]["root"]["size"]
            .as_str()
            .and_then(parse_size_mib)
        {
            hw.push(format!("root-disk={size}M"));
        }
        let hardware = Constraints::parse_words(hw.iter().map(String::as_str))
            .map(|c| c.to_string())
            .unwrap_or_else(|_| hw.join(" "));
        let location = v["location"]
            .as_str()
            .filter(|l| !l.is_empty() && *l != "none");
        Instance {
            id: name,
            zone: Some(location.unwrap_or(&host.server_name).into()),
            hardware: hardware.into(),
            tags: tags.into(),
        }
    }

    /// The instance's record, if it exists (whoever owns it).
    async fn lookup(&self, name: &str) -> Result<Option<Value>> {
        match self.client().get(&format!("/1.0/instances/{name}")).await? {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.code == 404 => Ok(None),
            Err(e) => Err(e.into_error(&format!("looking up `{name}`"))),
        }
    }

    fn check_constraints(&self, cons: &Constraints, host: &Host) -> Result<()> {
        check_supported(cons)?;
        if let Some(a) = cons.arch() {
            if !host.arches.iter().any(|h| h == a) {
                return Err(Error::InvalidSpec(format!(
                    "`arch={a}`: LXD host `{}` runs {}",
                    host.server_name,
                    host.arches.join(", ")
                )));
            }
        }
        if let Some(c) = cons.cores() {
            if c > host.cpus {
                return Err(Error::InvalidSpec(format!(
                    "`cores={c}`: LXD host `{}` has {} CPUs",
                    host.server_name, host.cpus
                )));
            }
        }
        if let Some(m) = cons.mem() {
            if m > host.mem_mib {
                return Err(Error::InvalidSpec(format!(
                    "`mem={m}M`: LXD host `{}` has {}M of memory",
                    host.server_name, host.mem_mib
                )));
            }
        }
        if !cons.zones().is_empty() && !cons.zones().contains(&host.server_name) {
            return Err(Error::InvalidSpec(format!(
                "`zones={}`: the only zone is `{}`",
                cons.zones().join(","),
                host.server_name
            )));
        }
        Ok(())
    }

    /// Starts a container whose record `v` says it is not running.
    async fn ensure_running(&self, name: &str, v: &Value) -> Result<()> {
        if v["status"].as_str() == Some("Running") {
            return Ok(());
        }
        self.start(name).await
    }

    /// Starts a container; already running is fine.
    async fn start(&self, name: &str) -> Result<()> {
        let body = json!({"action": "start", "timeout": 30});
        match self
            .client()
            .run(
                Method::PUT,
                &format!("/1.0/instances/{name}/state"),
                Some(&body),
            )
            .await?
        {
            Ok(_) => Ok(()),
            Err(e) if e.message.contains("already running") => Ok(()),
            Err(e) => Err(start_error(name, e)),
        }
    }

    /// Stops (forced) and deletes one container; gone already is fine.
    async fn remove(&self, name: &str) -> Result<()> {
        if !self.force_stop(name).await? {
            return Ok(());
        }
        self.delete(name).await
    }

    /// Stops a container (forced). False when it does not exist.
    async fn force_stop(&self, name: &str) -> Result<bool> {
        let stop = json!({"action": "stop", "force": true, "timeout": 30});
        match self
            .client()
            .run(
                Method::PUT,
                &format!("/1.0/instances/{name}/state"),
                Some(&stop),
            )
            .await?
        {
            Ok(_) => {}
            Err(e) if e.code == 404 => return Ok(false),
            // Stopped already, or stopping: the delete decides.
            Err(e)
                if e.message.contains("already stopped") || e.message.contains("not running") => {}
            Err(e) => debug!(name, error = %e.message, "forced stop failed; trying the delete"),
        }
        Ok(true)
    }

    /// Deletes a stopped container; gone already is fine.
    async fn delete(&self, name: &str) -> Result<()> {
        match self
            .client()
            .run(Method::DELETE, &format!("/1.0/instances/{name}"), None)
            .await?
        {
            Ok(_) => Ok(()),
            Err(e) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into_error(&format!("deleting `{name}`"))),
        }
    }

    /// True while container `name` is ours and carries `nonce`.
    async fn still(&self, name: &str, nonce: Option<&str>) -> Result<bool> {
        Ok(self
            .lookup(name)
            .await?
            .is_some_and(|v| self.owned(&v) && v["config"][CFG_NONCE].as_str() == nonce))
    }

    /// Reaps a stray container as it was listed: the name is the machine's,
    /// so a retried start of that machine makes a new container under the
    /// same name. The nonce is checked before the stop and again right
    /// before the delete; a container that changed is left alone.
    async fn reap_one(&self, name: &str, nonce: Option<&str>) -> Result<()> {
        if !self.still(name, nonce).await? {
            info!(
                name,
                "not reaping: the container changed since it was listed"
            );
            return Ok(());
        }
        if !self.force_stop(name).await? {
            return Ok(());
        }
        if !self.still(name, nonce).await? {
            warn!(
                name,
                "not deleting: the container changed while it was being stopped"
            );
            return Ok(());
        }
        self.delete(name).await
    }

    /// Stops and deletes one container, if it is ours.
    async fn stop_one(&self, name: &str) -> Result<()> {
        let Some(v) = self.lookup(name).await? else {
            return Ok(());
        };
        if !self.owned(&v) {
            warn!(
                name,
                "not stopping a container that does not carry this environment's UUID"
            );
            return Ok(());
        }
        self.remove(name).await
    }

    async fn create(
        &self,
        spec: &StartSpec,
        name: &str,
        cfg: &Config,
    ) -> Result<std::result::Result<(), ApiError>> {
        let alias = cfg.alias_for(&spec.series);
        let mut config = serde_json::Map::new();
        config.insert(CFG_UUID.into(), json!(self.env_uuid));
        config.insert(CFG_MACHINE.into(), json!(spec.machine_id));
        config.insert(CFG_NONCE.into(), json!(spec.nonce));
        if spec.controller {
            config.insert(CFG_CONTROLLER.into(), json!("true"));
        }
        if !spec.user_data.is_empty() {
            config.insert("user.user-data".into(), json!(spec.user_data));
        }
        if let Some(c) = spec.constraints.cores() {
            config.insert("limits.cpu".into(), json!(c.to_string()));
        }
        if let Some(m) = spec.constraints.mem() {
            config.insert("limits.memory".into(), json!(format!("{m}MiB")));
        }
        let mut devices = serde_json::Map::new();
        if let Some(d) = spec.constraints.root_disk() {
            devices.insert(
                "root".into(),
                json!({"type": "disk", "path": "/", "pool": cfg.pool, "size": format!("{d}MiB")}),
            );
        }
        if let Some(install) = spec.agent.as_ref().and_then(|a| a.controller.as_ref()) {
            // Another controller (`enable-ha`): what machine 0's container
            // is given at bootstrap, from the start.
            for (name, device) in self.controller_devices(install).await? {
                devices.insert(name, device);
            }
        } else if let Some(agent) = &spec.agent {
            // A socket on the controller's host is on the daemon's host only
            // when the daemon is local; an address the daemon's host proxies
            // to machine 0's controller works from anywhere.
            if matches!(cfg.transport, Transport::Https { .. })
                && agent.api_connect.starts_with("unix:")
            {
                return Err(Error::InvalidSpec(
                    "machine agents inside containers reach the controller through a socket LXD proxies from this host, which a remote LXD daemon cannot do; use a local daemon, run the controller in machine 0 (bootstrap without `--manual-controller`), or `jujube set-environment lxd-agents=in-process`".into(),
                ));
            }
            let (name, device) = agent_api_device(0, &agent.api_connect);
            devices.insert(name, device);
            for (m, connect) in &agent.other_controllers {
                let (name, device) = agent_api_device(*m, connect);
                devices.insert(name, device);
            }
        }
        let body = json!({
            "name": name,
            "type": "container",
            "source": {"type": "image", "alias": alias},
            "config": config,
            "devices": devices,
            "profiles": cfg.profiles,
        });
        let c = self.client();
        Ok(match c.run(Method::POST, "/1.0/instances", Some(&body)).await? {
            Ok(_) => Ok(()),
            Err(e) if e.code == 404 && e.message.to_lowercase().contains("image") => {
                return Err(Error::InvalidSpec(format!(
                    "no image with alias `{alias}` for series `{}` on LXD at `{}`; import one (`lxc image import ... --alias {alias}`), or point the series at another image with the environment config `image-aliases={}:ALIAS` or `image-alias=ALIAS` (`--config` at bootstrap, `jujube set-environment` later)",
                    spec.series,
                    c.display(),
                    spec.series
                )))
            }
            Err(e) => Err(e),
        })
    }

    /// Puts the machine's agent into container `name`: the binary and its
    /// `agent.conf` (0600), through LXD's file API; or, for a controller
    /// machine, the binary and the controller's files
    /// ([`crate::ControllerInstall`]). Its image's init runs
    /// `jujube agent --data-dir /var/lib/jujube/agent` whenever both are
    /// there (`scripts/lxd-setup` builds such an image, `jujube-agent`).
    async fn install_agent(&self, name: &str, spec: &StartSpec) -> Result<()> {
        let Some(agent) = &spec.agent else {
            return Ok(());
        };
        let binary = {
            let mut cached = self.binary.lock().await;
            match &*cached {
                Some((path, bytes)) if *path == agent.binary => bytes.clone(),
                _ => {
                    let bytes =
                        bytes::Bytes::from(tokio::fs::read(&agent.binary).await.map_err(|e| {
                            Error::InvalidSpec(format!(
                                "cannot read the agent binary `{}`: {e}",
                                agent.binary.display()
                            ))
                        })?);
                    *cached = Some((agent.binary.clone(), bytes.clone()));
                    bytes
                }
            }
        };
        let c = self.client();
        let what = |p: &str| format!("installing the agent in `{name}` ({p})");
        for dir in [
            "/usr",
            "/usr/local",
            "/usr/local/bin",
            "/var",
            "/var/lib",
            "/var/lib/jujube",
        ] {
            c.push_file(name, dir, bytes::Bytes::new(), 0o755, true)
                .await?
                .map_err(|e| e.into_error(&what(dir)))?;
        }
        c.push_file(name, AGENT_BINARY, binary, 0o755, false)
            .await?
            .map_err(|e| e.into_error(&what(AGENT_BINARY)))?;
        if let Some(install) = &agent.controller {
            // The controller's files, the one that makes init start it last.
            let files: Vec<_> = install
                .files
                .iter()
                .map(|(p, b, m)| (p.clone(), bytes::Bytes::from(b.clone()), *m))
                .collect();
            self.push_files(name, &files).await?;
            info!(name, machine = %spec.machine_id, "controller installed");
            return Ok(());
        }
        c.push_file(name, AGENT_DIR, bytes::Bytes::new(), 0o700, true)
            .await?
            .map_err(|e| e.into_error(&what(AGENT_DIR)))?;
        let conf = format!("{AGENT_DIR}/agent.conf");
        c.push_file(
            name,
            &conf,
            bytes::Bytes::from(agent.conf.clone()),
            0o600,
            false,
        )
        .await?
        .map_err(|e| e.into_error(&what(&conf)))?;
        info!(name, machine = %spec.machine_id, "agent installed");
        Ok(())
    }

    async fn start_one(&self, spec: &StartSpec) -> Result<Instance> {
        let host = self.host().await?;
        self.check_constraints(&spec.constraints, &host)?;
        let cfg = self.cfg();
        let name = self.container_name(&spec.machine_id);
        if !self.ours_by_name(&name) {
            return Err(Error::InvalidSpec(format!(
                "machine id `{}` cannot name a container",
                spec.machine_id
            )));
        }
        let mut replaced = false;
        loop {
            match self.create(spec, &name, &cfg).await? {
                Ok(()) => {
                    // Just created, so stopped: its agent first, then start
                    // it (its init starts the agent).
                    let started = match self.install_agent(&name, spec).await {
                        Ok(()) => self.start(&name).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = started {
                        // Leave nothing half-made behind: a container that
                        // never ran is deleted (the harvester would reap it
                        // otherwise, but only after its grace).
                        warn!(name, error = %e, "start failed; deleting the new container");
                        if let Err(e2) = self.remove(&name).await {
                            warn!(name, error = %e2, "could not delete it; the stray harvest will");
                        }
                        return Err(e);
                    }
                    let v = self.lookup(&name).await?.ok_or_else(|| {
                        Error::Transient(format!("`{name}` vanished after its start"))
                    })?;
                    info!(name, machine = %spec.machine_id, "container started");
                    return Ok(self.instance(&v, &host));
                }
                // Exists already (or is being made or started by an
                // operation a killed process left behind): see whose it is.
                Err(e) if e.message.contains("already exists") || e.is_busy() => {
                    let Some(v) = self.lookup(&name).await? else {
                        // Deleted in between: create again.
                        continue;
                    };
                    if !self.owned(&v) {
                        return Err(Error::InvalidSpec(format!(
                            "container name `{name}` is taken by an instance this environment does not own (no `{CFG_UUID}` with its UUID); rename or delete that container"
                        )));
                    }
                    if v["config"][CFG_NONCE].as_str() == Some(spec.nonce.as_str()) {
                        // Ours from an earlier attempt with this nonce:
                        // this attempt's credential replaced that one's, so
                        // its agent gets the new one (and restarts on it);
                        // a controller's devices are made as this attempt
                        // says, as its files are.
                        if let Some(install) =
                            spec.agent.as_ref().and_then(|a| a.controller.as_ref())
                        {
                            let devices = self.controller_devices(install).await?;
                            self.add_devices(&name, Value::Object(devices.into_iter().collect()))
                                .await?;
                        }
                        self.install_agent(&name, spec).await?;
                        self.ensure_running(&name, &v).await?;
                        let v = self.lookup(&name).await?.unwrap_or(v);
                        return Ok(self.instance(&v, &host));
                    }
                    if replaced
                        || v["config"][CFG_MACHINE].as_str() != Some(spec.machine_id.as_str())
                    {
                        return Err(Error::Transient(format!(
                            "container `{name}` exists with another nonce; it will be replaced"
                        )));
                    }
                    info!(
                        name,
                        "replacing the leftover of an earlier start of this machine"
                    );
                    self.remove(&name).await?;
                    replaced = true;
                }
                Err(e) => return Err(e.into_error(&format!("creating `{name}`"))),
            }
        }
    }
}

#[async_trait]
impl Provider for LxdProvider {
    fn kind(&self) -> &'static str {
        "lxd"
    }

    async fn start_instance(&self, spec: &StartSpec) -> Result<Instance> {
        self.start_one(spec).await
    }

    /// One container per call: LXD has no multi-instance create, and a
    /// container recorded the moment it runs is one less to adopt after a
    /// crash. Parallelism comes from `provisioner-concurrency`.
    fn preferred_batch(&self) -> usize {
        1
    }

    async fn start_instances(&self, specs: &[StartSpec]) -> Vec<Result<Instance>> {
        // The futures are made before the stream so that no closure is held
        // across an await (which `async_trait`'s `Send` bound cannot prove).
        let starts: Vec<_> = specs.iter().map(|s| self.start_one(s)).collect();
        stream::iter(starts).buffered(PARALLEL).collect().await
    }

    async fn stop_instances(&self, ids: &[String]) -> Result<()> {
        let stops: Vec<_> = ids
            .iter()
            .filter(|id| self.ours_by_name(id))
            .map(|name| self.stop_one(name))
            .collect();
        let results: Vec<Result<()>> = stream::iter(stops)
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// Each container only while it still carries the nonce it was listed
    /// with, checked right before the stop and right before the delete.
    async fn reap_instances(&self, listed: &[Instance]) -> Result<()> {
        let reaps: Vec<_> = listed
            .iter()
            .filter(|i| self.ours_by_name(&i.id))
            .map(|i| self.reap_one(&i.id, i.nonce()))
            .collect();
        let results: Vec<Result<()>> = stream::iter(reaps)
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        results.into_iter().collect()
    }

    async fn instances(&self) -> Result<Vec<Instance>> {
        let host = self.host().await?;
        let mut out: Vec<Instance> = self
            .listed_ours()
            .await?
            .iter()
            .map(|v| self.instance(v, &host))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<Instance>> {
        let host = self.host().await?;
        let lookups: Vec<_> = ids
            .iter()
            .filter(|id| self.ours_by_name(id))
            .map(|name| self.lookup(name))
            .collect();
        let found: Vec<Result<Option<Value>>> =
            stream::iter(lookups).buffered(PARALLEL).collect().await;
        let found: Vec<Result<Option<Instance>>> = found
            .into_iter()
            .map(|r| {
                r.map(|v| {
                    v.filter(|v| self.owned(v))
                        .map(|v| self.instance(&v, &host))
                })
            })
            .collect();
        found.into_iter().filter_map(Result::transpose).collect()
    }

    async fn zones(&self) -> Result<Vec<String>> {
        Ok(vec![self.host().await?.server_name.clone()])
    }

    async fn validate_constraints(&self, cons: &Constraints) -> Result<()> {
        let host = self.host().await?;
        self.check_constraints(cons, &host)
    }

    /// Image aliases, profiles and the pool apply to the next start; a
    /// changed connection (socket, URL, certificates) to the next request.
    async fn update_config(&self, config: &BTreeMap<String, String>) -> Result<()> {
        let cfg = Config::parse(config)?;
        let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
        if cfg.transport != st.cfg.transport {
            st.client = cfg.client()?;
            st.host = None;
        }
        st.cfg = cfg;
        Ok(())
    }
}

/// What a failed start of container `name` is. A proxy device's host port
/// taken meanwhile (another controller's API is exposed on a port drawn for
/// each attempt) is transient: the next attempt draws another. LXD says so
/// as "address already in use", or — when its listener process dies of it
/// before handing its socket over — as a failure to receive that socket;
/// either way the device failed as it started, which its configuration,
/// checked when the container was made, cannot cause.
fn start_error(name: &str, e: client::ApiError) -> Error {
    if e.message.contains("address already in use") || e.message.contains("starting proxy device") {
        return Error::Transient(format!("starting `{name}`: {}; trying again", e.message));
    }
    e.into_error(&format!("starting `{name}`"))
}

#[cfg(test)]
mod tests;
