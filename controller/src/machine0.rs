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
    CONTROLLER_API_PORT, CONTROLLER_ENV_FILE, CONTROLLER_HOME,
};
use jujube_providers::lxd::{LxdProvider, AGENT_BINARY};
use jujube_providers::Provider;
use jujube_state::Store;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// The file in an environment's directory on the host that bootstrapped it
/// when its controller runs in machine 0's container.
pub const MARKER: &str = "machine-0.json";

/// How long `bootstrap` waits for machine 0's controller to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

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

        let dir = home.env_dir(name);
        let mut rels = Vec::new();
        files_under(&dir, Path::new(""), &mut rels)?;
        let mut files = access.files;
        for rel in rels {
            // SQLite's shared-memory index is rebuilt from the WAL.
            if rel.to_string_lossy().ends_with("-shm") {
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
            format!(
                "JUJUBE_HOME={CONTROLLER_HOME}\nJUJUBE_ENV={name}\n{}=init\n",
                crate::facade::KEPT_BY
            )
            .into(),
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

/// `destroy-environment` of an environment whose controller runs in
/// machine 0's container: machine 0 is frozen (its controller acts no
/// more), every other instance of the environment is stopped, then machine
/// 0; the daemon forgets its certificate, and the host the environment.
pub async fn destroy(home: &Home, name: &str, m0: Machine0, out: &mut impl Write) -> Result<()> {
    if m0.provider == "ec2" {
        return crate::machine0_ec2::destroy(home, name, m0, out).await;
    }
    let provider = LxdProvider::new(&m0.uuid, &m0.lxd)?;
    let machine0 = std::slice::from_ref(&m0.container);
    if !provider.instances_by_id(machine0).await?.is_empty() {
        if let Err(e) = provider.freeze(&m0.container).await {
            // A daemon that cannot freeze: machine 0 stops first instead.
            tracing::warn!(error = %e, "cannot freeze machine 0; stopping it first");
            provider.stop_instances(machine0).await?;
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
    crate::run::forget_environment(home, name, out)
}

#[cfg(test)]
mod tests {
    use super::api_addresses;

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
