//! Machine 0's container as the environment's controller: what `bootstrap`
//! asks of LXD to run the controller there, and what
//! `destroy-environment` asks to take it away.
//!
//! # How the pieces reach each other (containers have no network)
//! - The controller reaches the daemon over HTTPS with a client
//!   certificate made at bootstrap and added to the daemon's trust store
//!   (as Juju does), named `jujube-controller-<full UUID>` so that only this
//!   environment's certificate is ever removed. A proxy device,
//!   `jujube-lxd`, listens on [`CONTROLLER_LXD_LISTEN`] inside the container
//!   and connects on the daemon's host to the daemon's own
//!   `core.https_address`: the same for a local and a remote daemon.
//! - The host's CLI and the other containers' agents reach the API through
//!   `jujube-api-host`, a proxy device bound on the daemon's host (a
//!   loopback port for a local daemon) and connecting inside the container
//!   to [`CONTROLLER_API_PORT`] on its loopback. Agents' containers proxy
//!   their API socket to that same host address.
//! - The image's init runs `jujube controller` whenever
//!   [`CONTROLLER_ENV_FILE`] and the binary are there, and starts it again
//!   when it exits (`scripts/lxd-setup` builds such an image,
//!   `jujube-agent`); the store lives on the container's own disk, so a
//!   restart of the container loses nothing.

use super::{client::ApiError, LxdProvider};
use crate::{Error, Result};
use bytes::Bytes;
use hyper::Method;
use serde_json::{json, Value};

/// `JUJUBE_HOME` of the controller inside machine 0's container.
pub const CONTROLLER_HOME: &str = "/var/lib/jujube/home";
/// What the image's init reads to run the controller, as shell
/// assignments: `JUJUBE_HOME` and `JUJUBE_ENV`, where the daemon's host
/// exposes its API, and another controller machine's id (`enable-ha`).
pub const CONTROLLER_ENV_FILE: &str = "/var/lib/jujube/controller.env";
/// The controller's certificates for the daemon, inside the container.
pub const CONTROLLER_LXD_DIR: &str = "/var/lib/jujube/lxd";
/// Where the API listens inside machine 0's container.
pub const CONTROLLER_API_PORT: u16 = 17070;
/// Where the controller inside machine 0's container finds the daemon.
pub const CONTROLLER_LXD_LISTEN: &str = "127.0.0.1:8443";

/// What the controller inside machine 0's container reads the daemon with:
/// environment config and the files it names.
pub struct ControllerAccess {
    pub config: Vec<(String, String)>,
    /// `(path in the container, contents, mode)`.
    pub files: Vec<(String, Bytes, u32)>,
}

/// Where the daemon's host connects to for `address` (LXD's
/// `core.https_address`): a wildcard or an empty host is its loopback.
fn https_connect(address: &str) -> Option<String> {
    let address = address.trim();
    if address.is_empty() {
        return None;
    }
    let (host, port) = match address.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) => (h, p),
        _ => (address, "8443"),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = match host {
        "" | "0.0.0.0" | "::" => "127.0.0.1",
        h => h,
    };
    Some(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// The base64 of a PEM certificate's DER: what LXD's trust store takes.
fn pem_body(pem: &str) -> String {
    pem.lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect()
}

/// The proxy device through which a controller inside a container reaches
/// the daemon, whose HTTPS its host connects to at `connect`.
fn lxd_device(connect: &str) -> Value {
    proxy(
        "container",
        &format!("tcp:{CONTROLLER_LXD_LISTEN}"),
        &format!("tcp:{connect}"),
    )
}

/// The proxy device exposing a controller's API on the daemon's host at
/// `host_address`.
fn api_host_device(host_address: &str) -> Value {
    proxy(
        "host",
        &format!("tcp:{host_address}"),
        &format!("tcp:127.0.0.1:{CONTROLLER_API_PORT}"),
    )
}

/// The proxy device reaching `address` on the daemon's host from inside a
/// container at the same address.
fn reach_device(address: &str) -> Value {
    proxy(
        "container",
        &format!("tcp:{address}"),
        &format!("tcp:{address}"),
    )
}

fn proxy(bind: &str, listen: &str, connect: &str) -> Value {
    json!({"type": "proxy", "bind": bind, "listen": listen, "connect": connect})
}

impl LxdProvider {
    /// The daemon's `/1.0` and where its host connects to its HTTPS;
    /// refused when it does not listen for HTTPS.
    async fn daemon_https(&self) -> Result<(Value, String)> {
        let c = self.client();
        let info = c
            .get("/1.0")
            .await?
            .map_err(|e| e.into_error(&format!("LXD at `{}`", c.display())))?;
        let https = info["config"]["core.https_address"].as_str().unwrap_or("");
        let Some(connect) = https_connect(https) else {
            return Err(Error::Config(format!(
                "LXD at `{}` does not listen for HTTPS, which machine 0's controller reaches it through: run `lxc config set core.https_address 127.0.0.1:8443` and bootstrap again (or bootstrap with `--manual-controller` to run the controller on this host)",
                c.display()
            )));
        };
        Ok((info, connect))
    }

    /// The proxy devices a controller machine's container is made with
    /// (`enable-ha`): those machine 0's container is given at bootstrap
    /// ([`Self::admit_controller`], [`Self::expose_controller_api`],
    /// [`Self::reach_from_controller`]), its API on the daemon's host at
    /// the install's own address.
    pub(super) async fn controller_devices(
        &self,
        install: &crate::ControllerInstall,
    ) -> Result<Vec<(String, Value)>> {
        let (_, connect) = self.daemon_https().await?;
        let mut devices = vec![
            ("jujube-lxd".to_string(), lxd_device(&connect)),
            (
                "jujube-api-host".to_string(),
                api_host_device(&install.api_listen),
            ),
        ];
        if let Some(db) = &install.state_db {
            devices.push(("jujube-state-db".to_string(), reach_device(db)));
        }
        Ok(devices)
    }

    /// The name machine 0's client certificate has in the daemon's trust
    /// store.
    fn trust_name(&self) -> String {
        format!("jujube-controller-{}", self.env_uuid)
    }

    /// A container of ours by name, or a refusal.
    async fn owned_container(&self, name: &str) -> Result<()> {
        match self.lookup(name).await? {
            Some(v) if self.owned(&v) => Ok(()),
            _ => Err(Error::InvalidSpec(format!(
                "container `{name}` is not this environment's"
            ))),
        }
    }

    /// Adds devices to one of our containers (LXD merges them with its
    /// others).
    pub(super) async fn add_devices(&self, name: &str, devices: Value) -> Result<()> {
        self.owned_container(name).await?;
        self.patch_devices(name, devices).await
    }

    /// [`Self::add_devices`] on a container already known to be ours.
    async fn patch_devices(&self, name: &str, devices: Value) -> Result<()> {
        self.client()
            .run(
                Method::PATCH,
                &format!("/1.0/instances/{name}"),
                Some(&json!({ "devices": devices })),
            )
            .await?
            .map_err(|e| e.into_error(&format!("adding devices to `{name}`")))?;
        Ok(())
    }

    /// Lets the controller in container `name` reach the daemon: trusts
    /// `cert_pem` (a certificate whose key only the environment's
    /// controllers' containers get) and
    /// proxies the daemon's HTTPS into the container. Refused, changing
    /// nothing, when the daemon does not listen for HTTPS.
    pub async fn admit_controller(
        &self,
        name: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<ControllerAccess> {
        self.owned_container(name).await?;
        let c = self.client();
        let (info, connect) = self.daemon_https().await?;
        let server_cert = info["environment"]["certificate"]
            .as_str()
            .filter(|s| s.contains("BEGIN CERTIFICATE"))
            .ok_or_else(|| {
                Error::Config(format!(
                    "LXD at `{}` did not show its certificate",
                    c.display()
                ))
            })?
            .to_string();
        // A certificate left by an earlier, failed bootstrap of this UUID
        // goes first: names need not be unique in the trust store.
        self.forget_controller().await?;
        c.run(
            Method::POST,
            "/1.0/certificates",
            Some(&json!({
                "type": "client",
                "name": self.trust_name(),
                "certificate": pem_body(cert_pem),
            })),
        )
        .await?
        .map_err(|e| e.into_error("trusting machine 0's certificate"))?;
        self.add_devices(name, json!({ "jujube-lxd": lxd_device(&connect) }))
            .await?;
        let path = |f: &str| format!("{CONTROLLER_LXD_DIR}/{f}");
        Ok(ControllerAccess {
            config: vec![
                ("lxd-url".into(), format!("https://{CONTROLLER_LXD_LISTEN}")),
                ("lxd-client-cert".into(), path("client.crt")),
                ("lxd-client-key".into(), path("client.key")),
                ("lxd-server-cert".into(), path("server.crt")),
            ],
            files: vec![
                (path("client.crt"), Bytes::from(cert_pem.to_string()), 0o600),
                (path("client.key"), Bytes::from(key_pem.to_string()), 0o600),
                (path("server.crt"), Bytes::from(server_cert), 0o600),
            ],
        })
    }

    /// Exposes the API of the controller in container `name` on the
    /// daemon's host at `host_address` (`HOST:PORT`).
    pub async fn expose_controller_api(&self, name: &str, host_address: &str) -> Result<()> {
        self.add_devices(
            name,
            json!({ "jujube-api-host": api_host_device(host_address) }),
        )
        .await
    }

    /// Lets the controller in container `name` reach `address` (`IP:PORT`
    /// on the daemon's host; containers have no network) at the same
    /// address inside the container, through a proxy device named
    /// `jujube-<device>`: the state database on a local daemon's host's
    /// loopback, whose certificate then still names the address the
    /// controller dials.
    pub async fn reach_from_controller(
        &self,
        name: &str,
        device: &str,
        address: &str,
    ) -> Result<()> {
        self.add_devices(
            name,
            json!({ format!("jujube-{device}"): reach_device(address) }),
        )
        .await
    }

    /// Gives every agent's container of the environment (those with a
    /// socket to machine 0's API) a socket to each of the other controllers
    /// in `controllers` (`(machine, connect)`, machine 0's left as it is),
    /// or points the one it has at the controller's new place; leaves
    /// alone what is as wanted. Answers how many containers it changed.
    pub async fn proxy_controllers(&self, controllers: &[(i64, String)]) -> Result<usize> {
        let mut changed = 0;
        let mut failed = None;
        for v in self.listed_ours().await? {
            let Some(name) = v["name"].as_str() else {
                continue;
            };
            if v["devices"]["jujube-api"].is_null() {
                continue;
            }
            let mut patch = serde_json::Map::new();
            for (m, connect) in controllers.iter().filter(|(m, _)| *m != 0) {
                let (device, want) = super::agent_api_device(*m, connect);
                if v["devices"][&device] != want {
                    patch.insert(device, want);
                }
            }
            if patch.is_empty() {
                continue;
            }
            // One container that cannot be changed keeps none of the
            // others from theirs.
            match self.patch_devices(name, Value::Object(patch)).await {
                Ok(()) => changed += 1,
                Err(e) => match self.lookup(name).await {
                    // Gone meanwhile: nothing to reach.
                    Ok(None) => {
                        tracing::debug!(name, error = %e, "container gone before its proxies")
                    }
                    _ => {
                        tracing::warn!(name, error = %e, "cannot give a container every controller's API");
                        failed.get_or_insert(e);
                    }
                },
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(changed),
        }
    }

    /// Writes files into one of our containers (root's, with their modes),
    /// making their directories (0755) on the way.
    pub async fn push_files(&self, name: &str, files: &[(String, Bytes, u32)]) -> Result<()> {
        self.owned_container(name).await?;
        let c = self.client();
        let what = |p: &str| format!("writing `{p}` in `{name}`");
        let mut made = std::collections::BTreeSet::new();
        for (path, data, mode) in files {
            let mut dir = String::new();
            let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
            for part in &parts[..parts.len().saturating_sub(1)] {
                dir.push('/');
                dir.push_str(part);
                if made.insert(dir.clone()) {
                    c.push_file(name, &dir, Bytes::new(), 0o755, true)
                        .await?
                        .map_err(|e| e.into_error(&what(&dir)))?;
                }
            }
            c.push_file(name, path, data.clone(), *mode, false)
                .await?
                .map_err(|e| e.into_error(&what(path)))?;
        }
        Ok(())
    }

    /// Freezes one of our containers: its processes stop where they are
    /// (the controller acts no more) until it is thawed or stopped.
    pub async fn freeze(&self, name: &str) -> Result<()> {
        self.owned_container(name).await?;
        match self
            .client()
            .run(
                Method::PUT,
                &format!("/1.0/instances/{name}/state"),
                Some(&json!({"action": "freeze", "timeout": 30})),
            )
            .await?
        {
            Ok(_) => Ok(()),
            Err(ApiError { message, .. }) if message.contains("already frozen") => Ok(()),
            Err(e) => Err(e.into_error(&format!("freezing `{name}`"))),
        }
    }

    /// Removes machine 0's certificate from the daemon's trust store (only
    /// the one named for this environment's full UUID); gone is fine.
    pub async fn forget_controller(&self) -> Result<()> {
        let c = self.client();
        let list = c
            .get("/1.0/certificates?recursion=1")
            .await?
            .map_err(|e| e.into_error("listing the daemon's trusted certificates"))?;
        let name = self.trust_name();
        let ours: Vec<String> = list
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|v| v["name"].as_str() == Some(name.as_str()))
                    .filter_map(|v| v["fingerprint"].as_str())
                    .filter(|f| f.chars().all(|c| c.is_ascii_hexdigit()))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        for f in ours {
            match c
                .run(Method::DELETE, &format!("/1.0/certificates/{f}"), None)
                .await?
            {
                Ok(_) => {}
                Err(e) if e.code == 404 => {}
                Err(e) => return Err(e.into_error("removing machine 0's certificate")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{https_connect, pem_body};

    #[test]
    fn the_daemons_https_address_is_reached_on_its_own_host() {
        assert_eq!(https_connect(""), None);
        assert_eq!(
            https_connect("127.0.0.1:8443").as_deref(),
            Some("127.0.0.1:8443")
        );
        assert_eq!(https_connect(":8443").as_deref(), Some("127.0.0.1:8443"));
        assert_eq!(
            https_connect("[::]:9443").as_deref(),
            Some("127.0.0.1:9443")
        );
        assert_eq!(https_connect("0.0.0.0").as_deref(), Some("127.0.0.1:8443"));
        assert_eq!(
            https_connect("10.1.2.3:8443").as_deref(),
            Some("10.1.2.3:8443")
        );
        assert_eq!(
            https_connect("[fd00::1]:8443").as_deref(),
            Some("[fd00::1]:8443")
        );
    }

    #[test]
    fn a_pem_certificate_is_sent_as_its_base64_body() {
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\nAbCd\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_body(pem), "MIIBAbCd");
    }
}
