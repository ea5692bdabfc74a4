//! Machine 0's container as the controller, on LXD: `bootstrap` moves the
//! environment's store, CA and the API's certificates into machine 0's
//! container and the image's init runs `jujube controller` there; the host
//! keeps only what any client keeps (`controllers.json`, `accounts.json`)
//! and [`MARKER`], which says where machine 0 is, for
//! `destroy-environment`. How the container reaches the daemon, and the
//! host and the other containers reach it: `jujube_providers::lxd::controller`.

use crate::home::Home;
use crate::{bail, Context, Result};
use jujube_providers::lxd::controller::{
    CONTROLLER_API_PORT, CONTROLLER_ENV_FILE, CONTROLLER_HOME, CONTROLLER_LXD_LISTEN,
};
use jujube_providers::lxd::{LxdProvider, AGENT_BINARY};
use jujube_providers::Provider;
use jujube_state::Store;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The file in an environment's directory on the host that bootstrapped it
/// when its controller runs in machine 0's container.
pub const MARKER: &str = "machine-0.json";

/// How long `bootstrap` waits for machine 0's controller to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// Set in a controller container's [`CONTROLLER_ENV_FILE`]: where the
/// daemon's host exposes its API (`HOST:PORT`, what the CLI dials). The
/// controller records that address for clients, not the container's own.
pub const API_ADVERTISE: &str = "JUJUBE_API_ADVERTISE";
/// Where this controller's API is exposed for clients when it runs in a
/// container ([`API_ADVERTISE`], set and not empty).
pub fn advertised() -> Option<String> {
    std::env::var(API_ADVERTISE).ok().filter(|a| !a.is_empty())
}

/// Where this process's controller is reached, set by `take-up` on an EC2
/// instance (its instance's addresses) before it runs.
static ADVERTISED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Says where this process's controller is reached when that is not where
/// it listens (`take-up`: its instance's addresses, not `0.0.0.0`); before
/// [`crate::run::run`]. Said once.
pub fn advertise(addresses: Vec<String>) {
    let _ = ADVERTISED.set(addresses);
}

/// Where this controller is reached when it runs on a machine of its own
/// (an EC2 instance it took up: [`advertise`]; an LXD container:
/// [`advertised`]), which it records for clients and agents instead of
/// where it listens.
pub fn advertised_addresses() -> Option<Vec<String>> {
    ADVERTISED
        .get()
        .filter(|a| !a.is_empty())
        .cloned()
        .or_else(|| advertised().map(|a| vec![a]))
}

/// What makes a controller machine's instance one of the environment's
/// controllers (`enable-ha`), made by the controller that provisions it
/// from its own home: for each start attempt, a
/// [`jujube_providers::ControllerInstall`] for the provider to apply.
pub(crate) trait Seed: Send + Sync {
    fn install(&self, machine: i64, nonce: &str) -> Result<jujube_providers::ControllerInstall>;
}

/// Set in another controller machine's [`CONTROLLER_ENV_FILE`]
/// (`enable-ha`): its machine id (`jujube controller --machine`).
pub const MACHINE_ENV: &str = "JUJUBE_MACHINE";

/// The daemon's host ports other controllers' APIs are exposed at, one
/// drawn for each start attempt from its nonce (a retry of one attempt
/// gets the same; a port taken makes the start fail as transient, and the
/// next attempt draws again). Below Linux's ephemeral range.
const CONTROLLER_PORTS: std::ops::RangeInclusive<u16> = 17071..=17999;

/// The files a state in PostgreSQL adds to a controller's environment
/// directory ([`state_files`]): the URL's authority, the password.
const STATE_CA: &str = "state-ca.pem";
const STATE_PASSWORD: &str = "state-password";
/// Every file of a controller's environment directory that says where its
/// state in PostgreSQL is and how it gets in.
const STATE_FILES: [&str; 3] = [crate::home::STATE_URL, STATE_CA, STATE_PASSWORD];

/// Where an environment's controller runs, as the host that bootstrapped it
/// knows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine0 {
    pub uuid: String,
    /// `lxd` or `ec2` (absent: `lxd`, the first).
    #[serde(default = "lxd")]
    pub provider: String,
    /// Machine 0's instance: its container on LXD, its instance id on EC2.
    pub container: String,
    /// How this host reaches the cloud: the environment's config at
    /// bootstrap.
    pub lxd: BTreeMap<String, String>,
    /// Where the API is proxied to on the daemon's host.
    pub api_address: String,
    /// Where the state is when it is in PostgreSQL (`state-url`), as this
    /// host reaches it: `destroy-environment` erases it from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<crate::home::StatePlace>,
}

fn lxd() -> String {
    "lxd".into()
}

/// Machine 0 of environment `name`, when its controller runs there.
pub fn hosted(home: &Home, name: &str) -> Result<Option<Machine0>> {
    let path = home.env_dir(name).join(MARKER);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
            format!("cannot read `{}`; fix or remove it", path.display())
        })?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read `{}`", path.display())),
    }
}

/// The daemon's host address the API is proxied to: a free loopback port
/// for the local daemon; for a remote one, every address of its host on
/// the API's usual port (the CLI uses the daemon's host name).
fn api_addresses(config: &BTreeMap<String, String>) -> Result<(String, String)> {
    match config.get("lxd-url") {
        None => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .context("cannot find a free port for machine 0's API")?
                .port();
            let a = format!("127.0.0.1:{port}");
            Ok((a.clone(), a))
        }
        Some(url) => {
            let host = url
                .trim_start_matches("https://")
                .split('/')
                .next()
                .unwrap_or_default();
            let host = match host.rsplit_once(':') {
                Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
                _ => host,
            };
            Ok((
                format!("0.0.0.0:{CONTROLLER_API_PORT}"),
                format!("{host}:{CONTROLLER_API_PORT}"),
            ))
        }
    }
}

/// The address of a `postgres://` URL's server, `HOST:PORT` (5432 when
/// it names no port), with whether it is a loopback one.
pub(crate) fn db_address(url: &str) -> Option<(String, bool)> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match hostport.strip_prefix('[') {
        Some(r) => {
            let (h, after) = r.split_once(']')?;
            (h, after.strip_prefix(':'))
        }
        None => match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        },
    };
    let port: u16 = match port {
        Some(p) if !p.is_empty() => p.parse().ok()?,
        _ => 5432,
    };
    let ip: std::net::IpAddr = match host {
        h if h.eq_ignore_ascii_case("localhost") => std::net::Ipv4Addr::LOCALHOST.into(),
        h => match h.parse() {
            Ok(ip) => ip,
            Err(_) => return Some((format!("{h}:{port}"), false)),
        },
    };
    Some((
        std::net::SocketAddr::new(ip, port).to_string(),
        ip.is_loopback(),
    ))
}

/// Refuses a `state-url` machine 0's container could not reach: containers
/// have no network, so the controller reaches the database through a
/// proxy from the daemon's host, at the address it dials (which the
/// server's certificate names): a loopback address of this host, served
/// by a local daemon.
pub(crate) fn check_state_reachable(url: &str, config: &BTreeMap<String, String>) -> Result<()> {
    let (address, loopback) = one_server(url)?;
    if !loopback {
        bail!("machine 0's container reaches the state database through a proxy on this host, so `state-url` must name this host's loopback (`127.0.0.1`), not `{address}`: serve the database there (or forward a loopback port to it), or bootstrap with `--manual-controller`");
    }
    if config.contains_key("lxd-url") {
        bail!("`state-url` names this host's loopback, which a remote LXD daemon's host cannot reach for machine 0: bootstrap with the local daemon, or with `--manual-controller`");
    }
    // Machine 0's own loopback ports: the daemon's proxy and the API.
    let lxd_port = CONTROLLER_LXD_LISTEN.rsplit_once(':').map(|(_, p)| p);
    let api_port = CONTROLLER_API_PORT.to_string();
    let port = address.rsplit_once(':').map(|(_, p)| p);
    if port == lxd_port || port == Some(api_port.as_str()) {
        bail!("machine 0 uses port {} of its loopback itself, so the state database cannot be reached there: serve it on another port", port.unwrap_or_default());
    }
    Ok(())
}

/// The one server a machine 0 reaches the state at, `HOST:PORT`, and
/// whether it is on this host's loopback: refused unless `state-url` names
/// exactly one TCP server in its authority (not a local socket, several
/// hosts, or a host the query names).
pub(crate) fn one_server(url: &str) -> Result<(String, bool)> {
    // The server is the URL's one host, not one the query names.
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let named = query
        .split('&')
        .filter_map(|p| p.split_once('=').map(|(k, _)| k))
        .find(|k| matches!(*k, "host" | "hostaddr" | "port"));
    if let Some(key) = named {
        bail!("machine 0 reaches the state database at the host and port of `state-url` itself, not one a `{key}=` option names; give them as `postgres://USER@HOST:PORT/DB`");
    }
    let authority = url
        .split_once("://")
        .map_or("", |(_, r)| r.split(['/', '?']).next().unwrap_or(""));
    if authority.contains(',') {
        bail!("machine 0 reaches one state database server, and `state-url` names several; give one `HOST:PORT`");
    }
    match db_address(url) {
        Some((address, _)) if address.starts_with(':') => {
            bail!("`state-url` names no server host (a local socket), which machine 0 cannot reach: give it as `postgres://USER@HOST:PORT/DB`")
        }
        Some(server) => Ok(server),
        None => {
            bail!("cannot read the server's address in `state-url`; give it as `postgres://USER@HOST:PORT/DB`")
        }
    }
}

/// `url` with its `sslrootcert` file (unless `system`) named `path`
/// instead, and the file it named.
pub(crate) fn with_root_at(url: &str, path: &str) -> (String, Option<std::path::PathBuf>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let mut old = None;
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some(("sslrootcert", v)) if percent_decoded(v) != "system" => {
                old = Some(std::path::PathBuf::from(percent_decoded(v)));
                format!("sslrootcert={}", percent_encoded(path))
            }
            _ => pair.to_string(),
        })
        .collect();
    (format!("{base}?{}", pairs.join("&")), old)
}

/// A path as a query value: what is not unreserved (or `/`) escaped.
fn percent_encoded(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

fn percent_decoded(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).and_then(|&c| hex(c)),
            b.get(i + 2).and_then(|&c| hex(c)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What machine 0's controller needs of a state in PostgreSQL: the proxy
/// to the database (see [`check_state_reachable`]), and its own copy of
/// the state's place ([`state_files`]). Returns those files, by their
/// paths in the container.
async fn state_into(
    provider: &LxdProvider,
    container: &str,
    name: &str,
    place: &crate::home::StatePlace,
) -> Result<Vec<(String, Vec<u8>, u32)>> {
    let (address, _) = db_address(&place.url).context("cannot read `state-url`")?;
    provider
        .reach_from_controller(container, "state-db", &address)
        .await
        .context("cannot let machine 0 reach the state database")?;
    let dir = format!("{CONTROLLER_HOME}/environments/{name}");
    Ok(state_files(place, &dir)?
        .into_iter()
        .map(|(file, bytes)| (format!("{dir}/{file}"), bytes, 0o600))
        .collect())
}

/// Machine 0's own `state-url.json` for a state at `place`, when its
/// environment's directory is `dir` there: the URL's authority
/// (`sslrootcert`) and the password as files beside it (the password in a
/// file only root reads, as a `state-password-file` is on a host). The
/// files by their names in `dir`, with their contents.
pub(crate) fn state_files(
    place: &crate::home::StatePlace,
    dir: &str,
) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let (url, root) = with_root_at(&place.url, &format!("{dir}/{STATE_CA}"));
    let mut files = Vec::new();
    if let Some(root) = root {
        let pem = std::fs::read(&root)
            .with_context(|| format!("cannot read `{}` (`sslrootcert`)", root.display()))?;
        files.push((STATE_CA, pem));
    }
    let password_file = match place.password()? {
        Some(p) => {
            files.push((STATE_PASSWORD, p.into_bytes()));
            Some(format!("{dir}/{STATE_PASSWORD}").into())
        }
        None => None,
    };
    let theirs = crate::home::StatePlace { url, password_file };
    files.push((crate::home::STATE_URL, serde_json::to_vec_pretty(&theirs)?));
    Ok(files)
}

/// Erases environment `name`'s state at `place` once machine 0 is stopped
/// (nothing writes it any more), saying so on `out`.
pub(crate) fn erase_state(
    name: &str,
    place: &crate::home::StatePlace,
    out: &mut impl Write,
) -> Result<()> {
    let erased = place.open().and_then(|st| Ok(st.erase()?));
    if let Err(e) = erased {
        bail!("every instance of environment `{name}` is stopped, but its state in `{}` could not be erased: {e}; run `jujube destroy-environment {name}` again once the database answers (with its password in `state-password-file`'s file or `JUJUBE_STATE_PASSWORD`)", place.url);
    }
    writeln!(out, "erased the environment's state in `{}`", place.url)?;
    Ok(())
}

/// Waits until the controller at `address`, proven by the environment's CA
/// `ca`, answers `admin` with `password`, showing how long it has waited;
/// refused (by its account) or unanswered by `deadline`, it fails saying so.
pub(crate) async fn wait_for_answer(
    address: &str,
    ca: &str,
    password: &str,
    deadline: Instant,
    progress: &mut dyn crate::run::Progress,
) -> Result<()> {
    let client = jujube_agent::remote::UserClient::new(
        std::slice::from_ref(&address.to_string()),
        ca,
        jujube_wire::client::ADMIN,
        password,
    )?;
    let t0 = Instant::now();
    loop {
        match client.call(&jujube_wire::client::ClientCall::Status).await {
            Ok(Ok(_)) => break,
            Ok(Err(e)) => bail!(
                "machine 0's controller refused this home's account: {}",
                e.message
            ),
            Err(e) if Instant::now() > deadline => bail!(
                "machine 0's controller did not answer at {address} within {}s ({})",
                t0.elapsed().as_secs(),
                e.message
            ),
            Err(_) => {
                let what = "waiting for machine 0's controller to answer";
                progress.update(&format!("{what} ({}s)", t0.elapsed().as_secs()), what);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    progress.finish(&format!("machine 0's controller answers at {address}"));
    Ok(())
}

/// Once machine 0's controller answers: the host keeps no state of the
/// environment, only where machine 0 is (`marker`) and what a client keeps,
/// pointed at machine 0's API.
pub(crate) fn hand_over_home(home: &Home, name: &str, marker: &Machine0) -> Result<()> {
    let dir = home.env_dir(name);
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        }
        .with_context(|| format!("cannot remove `{}`", p.display()))?;
    }
    jujube_agent::wire::write_private(&dir.join(MARKER), &serde_json::to_vec_pretty(marker)?)
        .with_context(|| format!("cannot write `{}`", dir.join(MARKER).display()))?;
    let mut entry = home
        .controller(name)?
        .context("this home lost the environment's controller entry")?;
    entry.addresses = vec![marker.api_address.clone()];
    home.set_controller(name, entry)
}

/// What another controller takes of a controller's environment directory
/// `dir` (`enable-ha`), relative to it: the environment's certificates
/// (`tls/`) and its place of the state in PostgreSQL ([`STATE_FILES`]),
/// which name the same paths on every controller's machine.
pub(crate) fn controller_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let tls = jujube_api::tls::dir(dir);
    let tls_rel = tls
        .strip_prefix(dir)
        .unwrap_or(Path::new("tls"))
        .to_path_buf();
    let mut rels = Vec::new();
    files_under(&tls, Path::new(""), &mut rels)?;
    let mut out: Vec<std::path::PathBuf> = rels.into_iter().map(|r| tls_rel.join(r)).collect();
    out.extend(
        STATE_FILES
            .iter()
            .filter(|f| dir.join(f).exists())
            .map(std::path::PathBuf::from),
    );
    Ok(out)
}

/// Every file under `dir`, as paths relative to it.
pub(crate) fn files_under(dir: &Path, rel: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<()> {
    let here = dir.join(rel);
    for e in
        std::fs::read_dir(&here).with_context(|| format!("cannot read `{}`", here.display()))?
    {
        let e = e?;
        let rel = rel.join(e.file_name());
        let kind = e.file_type()?;
        if kind.is_dir() {
            files_under(dir, &rel, out)?;
        } else if kind.is_file() {
            out.push(rel);
        }
    }
    Ok(())
}

/// Moves environment `name`'s controller into machine 0's container, which
/// `bootstrap` has just started: the daemon trusts a certificate made for
/// it, its API is proxied to the daemon's host, the store (closed here
/// first) and the environment's certificates are pushed in with the
/// binary, and the image's init starts the controller; then waits until it
/// answers this home's account. On success the host keeps no state of the
/// environment; on failure machine 0's container and its certificate are
/// gone (the caller removes the directory).
pub async fn move_in(
    home: &Home,
    name: &str,
    store: Store,
    password: &str,
    progress: &mut dyn crate::run::Progress,
) -> Result<()> {
    let env = store.environment()?;
    let config = store.environment_config()?;
    let provider = LxdProvider::new(&env.uuid, &config)?;
    let container = provider.container_name("0");
    let state = home.state_place(name)?;
    let result = async {
        let (listen, address) = api_addresses(&config)?;
        let (cert, key) = jujube_api::tls::client_identity(&format!(
            "jujube controller of environment {}",
            env.uuid
        ))?;
        let access = provider
            .admit_controller(&container, &cert, &key)
            .await
            .context("cannot let machine 0's controller reach LXD")?;
        provider
            .expose_controller_api(&container, &listen)
            .await
            .context("cannot expose machine 0's API")?;
        // What the controller in the container reads: the daemon through
        // its proxy, the API on the container's loopback, and where the
        // agents' containers find it.
        let mut set = access.config.clone();
        set.push(("lxd-socket".into(), String::new()));
        set.push((
            "api-address".into(),
            format!("127.0.0.1:{CONTROLLER_API_PORT}"),
        ));
        set.push((
            "lxd-controller-address".into(),
            listen.replace("0.0.0.0", "127.0.0.1"),
        ));
        store.set_environment_config(&set)?;
        drop(store);

        let mut files = access.files;
        if let Some(place) = &state {
            let theirs = state_into(&provider, &container, name, place).await?;
            files.extend(theirs.into_iter().map(|(p, b, m)| (p, b.into(), m)));
        }
        let dir = home.env_dir(name);
        let mut rels = Vec::new();
        files_under(&dir, Path::new(""), &mut rels)?;
        for rel in rels {
            // SQLite's shared-memory index is rebuilt from the WAL; the
            // host's `state-url.json` is replaced by the container's.
            if rel.to_string_lossy().ends_with("-shm") || rel == Path::new(crate::home::STATE_URL) {
                continue;
            }
            let bytes = std::fs::read(dir.join(&rel))
                .with_context(|| format!("cannot read `{}`", dir.join(&rel).display()))?;
            files.push((
                format!("{CONTROLLER_HOME}/environments/{name}/{}", rel.display()),
                bytes.into(),
                0o600,
            ));
        }
        let exe = std::env::current_exe().context("cannot find the `jujube` binary")?;
        let binary =
            std::fs::read(&exe).with_context(|| format!("cannot read `{}`", exe.display()))?;
        files.push((AGENT_BINARY.to_string(), binary.into(), 0o755));
        files.push((
            format!("{CONTROLLER_HOME}/current-environment"),
            format!("{name}\n").into(),
            0o600,
        ));
        // Last: what makes the image's init start the controller.
        files.push((
            CONTROLLER_ENV_FILE.to_string(),
            controller_env(name, 0, &address).into(),
            0o600,
        ));
        progress.update(
            "installing the controller in machine 0",
            "installing the controller in machine 0",
        );
        provider
            .push_files(&container, &files)
            .await
            .context("cannot install the controller in machine 0")?;
        progress.line(&format!(
            "machine 0: controller installed in `{container}`, its API at {address}"
        ));

        let ca = jujube_api::tls::ca_cert(&dir)?;
        wait_for_answer(
            &address,
            &ca,
            password,
            Instant::now() + ANSWER_TIMEOUT,
            progress,
        )
        .await
        .map_err(|e| {
            crate::Error::Refused(format!(
                "{e}; see `{CONTROLLER_HOME}/environments/{name}/controller.log` in `{container}`"
            ))
        })?;
        let marker = Machine0 {
            uuid: env.uuid.clone(),
            provider: "lxd".into(),
            container: container.clone(),
            lxd: config.clone(),
            api_address: address.clone(),
            state: state.clone(),
        };
        hand_over_home(home, name, &marker)?;
        Ok(())
    }
    .await;
    if result.is_err() {
        let _ = provider
            .stop_instances(std::slice::from_ref(&container))
            .await;
        let _ = provider.forget_controller().await;
    }
    result
}

/// What the image's init reads to run controller machine `machine`'s
/// controller in its container, whose API the daemon's host exposes at
/// `advertise`.
fn controller_env(name: &str, machine: i64, advertise: &str) -> String {
    let mut env = format!(
        "JUJUBE_HOME={CONTROLLER_HOME}\nJUJUBE_ENV={name}\n{}=init\n{API_ADVERTISE}={advertise}\n",
        crate::facade::KEPT_BY
    );
    if machine != 0 {
        env.push_str(&format!("{MACHINE_ENV}={machine}\n"));
    }
    env
}

/// The host port of controller machine `machine`'s start attempt
/// `nonce`: the same for a retry of the attempt, spread over
/// [`CONTROLLER_PORTS`] (FNV-1a; any stable hash would do).
fn attempt_port(machine: i64, nonce: &str) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in machine.to_be_bytes().iter().chain(nonce.as_bytes()) {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let span = u64::from(CONTROLLER_PORTS.end() - CONTROLLER_PORTS.start()) + 1;
    CONTROLLER_PORTS.start() + (h % span) as u16
}

/// What a controller in an LXD container gives the containers of the
/// controller machines it provisions (`enable-ha`): a copy of its own
/// environment's certificates, client identity for the daemon and place of
/// the state, and its binary; each one's API exposed on the daemon's host
/// beside its own.
pub(crate) struct ControllerSeed {
    name: String,
    dir: std::path::PathBuf,
    /// This controller's [`API_ADVERTISE`]: the others are on its host.
    advertise_host: String,
    /// Where the daemon's host binds them: its loopback when this one's
    /// is there, else every address.
    listen_ip: &'static str,
    state_db: Option<String>,
    lxd_files: Vec<String>,
}

impl ControllerSeed {
    /// The seed of the controller running here, when it runs in an LXD
    /// container (its init gave it [`API_ADVERTISE`]).
    pub(crate) fn here(
        home: &Home,
        name: &str,
        config: &BTreeMap<String, String>,
    ) -> Result<Option<ControllerSeed>> {
        let Some(advertise) = advertised() else {
            return Ok(None);
        };
        let Some((host, _)) = advertise.rsplit_once(':') else {
            bail!("`{API_ADVERTISE}={advertise}` is not `HOST:PORT`; fix `{CONTROLLER_ENV_FILE}`");
        };
        let loopback = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
        let state_db = match home.state_place(name)? {
            Some(place) => Some(db_address(&place.url).context("cannot read `state-url`")?.0),
            None => None,
        };
        let lxd_files = ["lxd-client-cert", "lxd-client-key", "lxd-server-cert"]
            .iter()
            .filter_map(|k| config.get(*k).cloned())
            .collect();
        Ok(Some(ControllerSeed {
            name: name.to_string(),
            dir: home.env_dir(name),
            advertise_host: host.to_string(),
            listen_ip: if loopback { "127.0.0.1" } else { "0.0.0.0" },
            state_db,
            lxd_files,
        }))
    }
}

impl Seed for ControllerSeed {
    /// Controller machine `machine`'s controller, exposed at a port drawn
    /// for the start attempt `nonce`.
    fn install(&self, machine: i64, nonce: &str) -> Result<jujube_providers::ControllerInstall> {
        let port = attempt_port(machine, nonce);
        let advertise = format!("{}:{port}", self.advertise_host);
        let read = |path: &Path| {
            std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))
        };
        let mut files = Vec::new();
        for rel in controller_files(&self.dir)? {
            let path = self.dir.join(rel);
            files.push((path.display().to_string(), read(&path)?, 0o600));
        }
        for f in &self.lxd_files {
            files.push((f.clone(), read(Path::new(f))?, 0o600));
        }
        files.push((
            format!("{CONTROLLER_HOME}/current-environment"),
            format!("{}\n", self.name).into(),
            0o600,
        ));
        // Last: what makes the image's init start the controller.
        files.push((
            CONTROLLER_ENV_FILE.to_string(),
            controller_env(&self.name, machine, &advertise).into(),
            0o600,
        ));
        Ok(jujube_providers::ControllerInstall {
            files,
            api_listen: format!("{}:{port}", self.listen_ip),
            state_db: self.state_db.clone(),
            take_up: None,
        })
    }
}

/// Where the daemon's host reaches each controller machine's API but
/// machine 0's (`enable-ha`; machine 0's is `lxd-controller-address`), as
/// an LXD proxy's `connect`: the port each one records that it is exposed
/// at, on the daemon's host's loopback. Controllers not yet recorded are
/// left out.
pub(crate) fn other_controllers(store: &Store) -> Result<Vec<(i64, String)>> {
    let alive = store.controller_machines()?;
    Ok(store
        .controllers()?
        .into_iter()
        .filter(|c| c.machine != 0 && alive.contains(&c.machine))
        .filter_map(|c| {
            let port = c
                .addresses
                .first()?
                .rsplit_once(':')?
                .1
                .parse::<u16>()
                .ok()?;
            Some((c.machine, format!("tcp:127.0.0.1:{port}")))
        })
        .collect())
}

/// Keeps every agent's container able to reach every controller
/// (`LxdProvider::proxy_controllers`), looking every few seconds, until
/// `stop`: a singleton job of the controllers in containers.
pub(crate) fn proxy_controllers(
    store: Store,
    provider: Arc<LxdProvider>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    /// How often it looks at the controllers, and how often it looks at
    /// every container again even when they did not change (a container
    /// started meanwhile with an older list).
    const LOOK_EVERY: Duration = Duration::from_secs(5);
    const AGAIN_EVERY: Duration = Duration::from_secs(60);
    tokio::spawn(async move {
        let mut applied: Option<(Vec<(i64, String)>, Instant)> = None;
        loop {
            let read = {
                let store = store.clone();
                tokio::task::spawn_blocking(move || other_controllers(&store)).await
            };
            match read {
                // One controller (no `enable-ha`): nothing to give anyone,
                // and no listing of every container each minute.
                Ok(Ok(wanted)) if wanted.is_empty() => {}
                Ok(Ok(wanted)) => {
                    let due = applied
                        .as_ref()
                        .is_none_or(|(had, at)| *had != wanted || at.elapsed() >= AGAIN_EVERY);
                    if due {
                        match provider.proxy_controllers(&wanted).await {
                            Ok(n) => {
                                if n > 0 {
                                    tracing::info!(
                                        containers = n,
                                        "agents' containers given every controller's API"
                                    );
                                }
                                applied = Some((wanted, Instant::now()));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot give agents' containers every controller's API; will retry")
                            }
                        }
                    }
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot read the controllers; will retry"),
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(LOOK_EVERY) => {}
                _ = stop.changed() => return,
            }
        }
    })
}

/// `destroy-environment` of an environment whose controller runs in
/// machine 0's container: every controller's container is frozen (their
/// controllers act no more), every other instance of the environment is
/// stopped, then machine 0; the daemon forgets its certificate, and the
/// host the environment.
pub async fn destroy(home: &Home, name: &str, m0: Machine0, out: &mut impl Write) -> Result<()> {
    if m0.provider == "ec2" {
        return crate::machine0_ec2::destroy(home, name, m0, out).await;
    }
    let provider = LxdProvider::new(&m0.uuid, &m0.lxd)?;
    let machine0 = std::slice::from_ref(&m0.container);
    // Every controller first (`enable-ha` adds them), machine 0 among
    // them where it still is: none provisions again what is being stopped.
    let controllers: Vec<String> = provider
        .instances()
        .await?
        .into_iter()
        .filter(|i| {
            i.id == m0.container || i.tags.get(jujube_providers::TAG_CONTROLLER) == Some("true")
        })
        .map(|i| i.id)
        .collect();
    for c in &controllers {
        if let Err(e) = provider.freeze(c).await {
            // A daemon that cannot freeze: the controller stops first instead.
            tracing::warn!(error = %e, container = %c, "cannot freeze a controller; stopping it first");
            provider.stop_instances(std::slice::from_ref(c)).await?;
        }
    }
    crate::run::stop_every_instance(&provider, Vec::new(), Some(&m0.container), out).await?;
    provider.stop_instances(machine0).await?;
    writeln!(
        out,
        "stopped machine 0 (`{}`), the controller",
        m0.container
    )?;
    provider.destroy_environment().await?;
    provider.forget_controller().await?;
    if let Some(place) = &m0.state {
        erase_state(name, place, out)?;
    }
    crate::run::forget_environment(home, name, out)
}

#[cfg(test)]
mod tests {
    use super::{api_addresses, check_state_reachable, db_address, with_root_at};

    #[test]
    fn a_state_url_is_reached_from_machine_0_only_on_this_hosts_loopback() {
        for (url, address, loopback) in [
            ("postgres://j@127.0.0.1:5433/env", "127.0.0.1:5433", true),
            (
                "postgresql://j@localhost/env?sslmode=require",
                "127.0.0.1:5432",
                true,
            ),
            ("postgres://[::1]:6000/env", "[::1]:6000", true),
            ("postgres://j@10.1.2.3:5432/env", "10.1.2.3:5432", false),
            ("postgres://j@db.example:5432/env", "db.example:5432", false),
        ] {
            assert_eq!(
                db_address(url),
                Some((address.to_string(), loopback)),
                "{url}"
            );
        }
        assert_eq!(db_address("postgres://j@127.0.0.1:x/env"), None);
        assert_eq!(
            db_address("postgres://j@LocalHost:/env"),
            Some(("127.0.0.1:5432".to_string(), true))
        );
        let local = Default::default();
        check_state_reachable("postgres://j@127.0.0.1:5433/env", &local).unwrap();
        let e = check_state_reachable("postgres://j@10.1.2.3/env", &local).unwrap_err();
        assert!(e.to_string().contains("`10.1.2.3:5432`"), "{e}");
        for (url, why) in [
            (
                "postgres://j@127.0.0.1/env?hostaddr=10.0.0.5",
                "`hostaddr=`",
            ),
            ("postgres://j@/env?host=127.0.0.1", "`host=`"),
            (
                "postgres://j@127.0.0.1:5432,127.0.0.2:5432/env",
                "names several",
            ),
            ("postgres://j@127.0.0.1:17070/env", "port 17070"),
            ("postgres://j@127.0.0.1:8443/env", "port 8443"),
        ] {
            let e = check_state_reachable(url, &local).unwrap_err();
            assert!(e.to_string().contains(why), "{url}: {e}");
        }
        let remote = [(
            "lxd-url".to_string(),
            "https://lxd.example:8443".to_string(),
        )]
        .into();
        let e = check_state_reachable("postgres://j@127.0.0.1:5433/env", &remote).unwrap_err();
        assert!(e.to_string().contains("remote LXD daemon"), "{e}");
    }

    #[test]
    fn machine_0s_state_url_names_its_own_copy_of_the_authority() {
        let (url, old) = with_root_at(
            "postgres://j@127.0.0.1:5433/env?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20x.crt&application_name=a",
            "/var/lib/jujube/ca.pem",
        );
        assert_eq!(
            url,
            "postgres://j@127.0.0.1:5433/env?sslmode=verify-full&sslrootcert=/var/lib/jujube/ca.pem&application_name=a"
        );
        assert_eq!(old, Some("/tmp/ca x.crt".into()));
        let (url, _) = with_root_at("postgres://h/d?sslrootcert=ca.pem", "/a b&c/ca.pem");
        assert_eq!(url, "postgres://h/d?sslrootcert=/a%20b%26c/ca.pem");
        for kept in [
            "postgres://j@127.0.0.1/env",
            "postgres://j@127.0.0.1/env?sslmode=verify-full&sslrootcert=system",
            "postgres://j@127.0.0.1/env?sslmode=verify-full&sslrootcert=syst%65m",
        ] {
            assert_eq!(with_root_at(kept, "/x"), (kept.to_string(), None));
        }
    }

    #[test]
    fn a_remote_daemons_host_carries_the_api_on_its_usual_port() {
        let config = |url: &str| [("lxd-url".to_string(), url.to_string())].into();
        for url in [
            "https://lxd.example:8443",
            "https://lxd.example",
            "https://lxd.example:8443/",
        ] {
            assert_eq!(
                api_addresses(&config(url)).unwrap(),
                ("0.0.0.0:17070".to_string(), "lxd.example:17070".to_string()),
                "{url}"
            );
        }
    }
}
