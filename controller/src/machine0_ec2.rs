//! Machine 0's instance as the controller, on EC2 (Juju 1.x's bootstrap,
//! with nothing secret in user data):
//!
//! 1. `bootstrap` makes the environment's control bucket (tagged with its
//!    UUID) and puts the `jujube` binary there under its SHA-256; makes the
//!    controller's IAM role and instance profile (unless
//!    `instance-profile` names the user's own, or `none`); opens the API
//!    port in the environment's security group to `api-allowed-cidr`.
//! 2. Machine 0 is launched with that profile and user data that fetches
//!    the binary by a presigned URL (expiring, one object, no credential),
//!    checks its SHA-256 and runs `jujube take-up` as a systemd service.
//! 3. The environment's store, CA and certificates go to the control
//!    bucket as one private object, encrypted at rest, named in the user
//!    data; reading it takes the account's credentials or the role's.
//!    `take-up` on machine 0 reads it with the role's credentials from the
//!    instance metadata service, lays it into its home, deletes it from the
//!    bucket, and runs the controller (after a restart, the controller
//!    alone).
//!
//!    With `controller-credentials=hand-over` no role is made: machine 0
//!    makes a one-shot TLS identity, publishes its CA certificate by a
//!    presigned `PUT` URL (the user data's, one object), and waits; bootstrap
//!    reads that certificate with its own credentials, trusts nothing else,
//!    and hands over the same bundle with its credentials added, bearing a
//!    one-time token machine 0 knows only the hash of
//!    (`jujube_api::handover`). Machine 0 keeps them in
//!    [`CLOUD_CREDENTIALS`], and its controller acts with them.
//! 4. `bootstrap` waits for each step (the instance started, the state
//!    taken up, the controller answering this home's account at machine
//!    0's address, proven by the environment's CA) until `bootstrap-timeout`;
//!    a step that does not come says which, and everything made is removed.
//!    On success this home keeps only [`crate::machine0::MARKER`] and what a
//!    client keeps, as on LXD.
//!
//! `destroy-environment` (from the home that bootstrapped it) stops every
//! instance with the environment's UUID, machine 0 last, and removes the
//! security group, the bucket, the profile and the role.

use crate::home::Home;
use crate::machine0::{files_under, hand_over_home, wait_for_answer, Machine0};
use crate::{bail, Context, Result};
use jujube_providers::ec2::{storage, ControllerLaunch, Ec2Provider, HandedCredentials};
use jujube_providers::Provider;
use jujube_state::Store;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// The controller's API port on machine 0.
pub const API_PORT: u16 = 17070;

/// Where machine 0 keeps its home (`JUJUBE_HOME`).
pub const CONTROLLER_HOME: &str = "/var/lib/jujube/home";

/// How long bootstrap waits for machine 0 by default (`bootstrap-timeout`).
pub const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(600);

/// The most a hand-over object may hold: a new environment's store and
/// certificates are a few hundred kilobytes.
const BUNDLE_MAX: u64 = 64 << 20;

/// What bootstrap hands machine 0 through the control bucket: the
/// environment directory's files.
#[derive(Serialize, Deserialize)]
struct Bundle {
    files: Vec<BundleFile>,
    /// The user's cloud credentials, when they are handed over
    /// (`controller-credentials=hand-over`): kept in [`CLOUD_CREDENTIALS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    credentials: Option<HandedCredentials>,
}

/// Where machine 0's controller keeps the credentials it was handed, in the
/// environment's directory, the owner's alone; the controller's EC2
/// provider uses them instead of the default chain.
pub const CLOUD_CREDENTIALS: &str = "cloud-credentials";

/// The credentials kept in environment directory `dir`, if any were handed
/// over.
pub fn handed_credentials(dir: &Path) -> Result<Option<HandedCredentials>> {
    let path = dir.join(CLOUD_CREDENTIALS);
    match std::fs::read(&path) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b).with_context(|| {
            format!("`{}` does not hold credentials", path.display())
        })?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read `{}`", path.display())),
    }
}

#[derive(Serialize, Deserialize)]
struct BundleFile {
    /// Relative to the environment's directory.
    path: String,
    mode: u32,
    /// Base64.
    data: String,
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// The environment directory's files (the store closed first), SQLite's
/// shared-memory index aside (rebuilt from the WAL), and `credentials`.
/// A state in PostgreSQL (`state`, its place as this home reaches it, and
/// the environment's directory on machine 0) goes as machine 0's own
/// `state-url.json`, its authority and its password beside it
/// (`machine0::state_files`), instead of this home's.
fn bundle(
    dir: &Path,
    credentials: Option<HandedCredentials>,
    state: Option<(&crate::home::StatePlace, &str)>,
) -> Result<Vec<u8>> {
    use base64::Engine;
    let mut rels = Vec::new();
    files_under(dir, Path::new(""), &mut rels)?;
    let mut files = Vec::new();
    if let Some((place, theirs)) = state {
        for (path, bytes) in crate::machine0::state_files(place, theirs)? {
            files.push(BundleFile {
                path: path.to_string(),
                mode: 0o600,
                data: b64().encode(bytes),
            });
        }
    }
    for rel in rels {
        let name = rel.to_string_lossy().to_string();
        if name.ends_with("-shm")
            || name == "lock"
            || name.ends_with(".log")
            || name == CLOUD_CREDENTIALS
            || name == crate::home::STATE_URL
        {
            continue;
        }
        let bytes = std::fs::read(dir.join(&rel))
            .with_context(|| format!("cannot read `{}`", dir.join(&rel).display()))?;
        files.push(BundleFile {
            path: name,
            mode: 0o600,
            data: b64().encode(bytes),
        });
    }
    Ok(serde_json::to_vec(&Bundle { files, credentials })?)
}

/// Lays a bundle's files into `dir` (made, the owner's alone). Refused,
/// writing nothing: a path that is absolute, climbs out (`..`), or holds
/// anything but `[A-Za-z0-9._/-]`.
fn unbundle(bytes: &[u8], dir: &Path) -> Result<()> {
    use base64::Engine;
    let bundle: Bundle = serde_json::from_slice(bytes).context("the hand-over is not a bundle")?;
    let mut decoded = Vec::new();
    for f in &bundle.files {
        let plain = f
            .path
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._/-".contains(&c));
        if !plain || f.path.starts_with('/') || f.path.split('/').any(|p| p.is_empty() || p == "..")
        {
            bail!(
                "the hand-over names a path jujube does not write: `{}`",
                f.path
            );
        }
        let data: Vec<u8> = match b64().decode(&f.data) {
            Ok(d) => d,
            Err(_) => bail!("the hand-over's `{}` is not base64", f.path),
        };
        decoded.push((dir.join(&f.path), data));
    }
    if let Some(c) = &bundle.credentials {
        decoded.push((dir.join(CLOUD_CREDENTIALS), serde_json::to_vec(c)?));
    }
    for (path, data) in decoded {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create `{}`", parent.display()))?;
        }
        jujube_agent::wire::write_private(&path, &data)
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}

/// Refuses a `state-url` machine 0's instance could not reach: one on this
/// host's loopback, unless the cloud itself is (an emulator on this host,
/// whose instances are this host's too).
pub(crate) fn check_state_reachable(url: &str, config: &BTreeMap<String, String>) -> Result<()> {
    let (address, loopback) = crate::machine0::one_server(url)?;
    let cloud_here = config
        .get("endpoint")
        .and_then(|e| e.split_once("://").map(|(_, r)| r))
        .and_then(|r| crate::machine0::db_address(&format!("x://{r}")))
        .is_some_and(|(_, loopback)| loopback);
    if loopback && !cloud_here {
        bail!("`state-url` names this host's loopback (`{address}`), which machine 0's instance cannot reach: give the address of a database server the instance reaches in the cloud's network (a managed PostgreSQL, say), or bootstrap with `--manual-controller` (an `endpoint` on this host's loopback, an emulator's, lets its instances reach this host's)");
    }
    Ok(())
}

/// What a controller machine's `jujube take-up` is told (in its user data:
/// no secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeUp {
    pub env: String,
    pub uuid: String,
    pub region: String,
    pub endpoint: Option<String>,
    pub from: TakeUpFrom,
    /// The controller machine it becomes: 0 at bootstrap, another with
    /// `enable-ha`.
    pub machine: i64,
}

/// Where machine 0 takes the environment's state from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeUpFrom {
    /// Object `key` of the control bucket `bucket`, read with the
    /// instance profile's credentials.
    Bucket { bucket: String, key: String },
    /// `bootstrap`, over TLS, with the user's credentials
    /// (`controller-credentials=hand-over`): machine 0 makes a one-shot
    /// identity, publishes its CA certificate by the presigned `PUT` URL
    /// its boot script left in [`jujube_providers::HAND_OVER_URL_FILE`],
    /// and takes the hand-over bearing the token whose SHA-256 is
    /// `token_sha256` (see `jujube_api::handover`).
    HandOver { token_sha256: String },
}

impl TakeUp {
    /// `jujube take-up`'s arguments.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "take-up".to_string(),
            format!("--home={CONTROLLER_HOME}"),
            format!("--env={}", self.env),
            format!("--uuid={}", self.uuid),
            format!("--region={}", self.region),
        ];
        match &self.from {
            TakeUpFrom::Bucket { bucket, key } => {
                a.push(format!("--bucket={bucket}"));
                a.push(format!("--key={key}"));
            }
            TakeUpFrom::HandOver { token_sha256 } => {
                a.push(format!("--hand-over-token-sha256={token_sha256}"));
            }
        }
        if let Some(e) = &self.endpoint {
            a.push(format!("--endpoint={e}"));
        }
        if self.machine != 0 {
            a.push(format!("--machine={}", self.machine));
        }
        a
    }
}

/// What `take-up` learned of the instance its controller runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnInstance {
    /// The region it runs in (`take-up --region`).
    pub region: String,
    /// Where agents reach its API: its private address (the cloud's
    /// network), else its public one; `None`: the environment's
    /// `api-address`.
    pub agents: Option<String>,
}

static ON_INSTANCE: std::sync::OnceLock<OnInstance> = std::sync::OnceLock::new();

/// What `take-up` learned of the instance this process's controller runs
/// on; `None` where it did not run (`--manual-controller`, other providers).
pub fn on_instance() -> Option<&'static OnInstance> {
    ON_INSTANCE.get()
}

/// On a controller machine's instance, after [`take_up`]: learns where the
/// controller is reached, at [`API_PORT`] — for clients machine 0's
/// `controller-address` when bootstrap was told one (it reached machine 0
/// there), then the instance's public and private addresses, from its
/// metadata service; for agents its private one — and says so
/// ([`crate::machine0::advertise`], [`on_instance`]): the controller records
/// them for `status`, the CLI and agents instead of where it listens
/// (`0.0.0.0`). Refused when it learns none (the service restarts it).
pub async fn settle_on_instance(home: &Home, t: &TakeUp) -> Result<()> {
    let mut clients = Vec::new();
    if t.machine == 0 {
        let store = home.open(&t.env)?;
        if let Some(a) = store.environment_config()?.get("controller-address") {
            clients.push(a.clone());
        }
    }
    let own = jujube_providers::ec2::own_addresses(Duration::from_secs(10)).await;
    let at = |ip: &String| format!("{ip}:{API_PORT}");
    for a in [&own.public, &own.private].into_iter().flatten().map(at) {
        if !clients.contains(&a) {
            clients.push(a);
        }
    }
    if clients.is_empty() {
        bail!("cannot learn this instance's addresses from its metadata service (`/latest/meta-data/local-ipv4`), which clients and agents reach its controller at; check that the instance metadata service is enabled on it");
    }
    let _ = ON_INSTANCE.set(OnInstance {
        region: t.region.clone(),
        agents: own.private.as_ref().or(own.public.as_ref()).map(at),
    });
    crate::machine0::advertise(clients);
    Ok(())
}

/// The instance profile the controllers' instances are launched with: the
/// one machine 0 was (`None`: none, as `instance-profile=none` launched
/// machine 0, whose credentials came another way, as theirs will); or why
/// `enable-ha` cannot launch another controller as machine 0 was.
pub(crate) fn controllers_profile(
    config: &BTreeMap<String, String>,
    env_uuid: &str,
) -> std::result::Result<Option<String>, String> {
    if config.get("controller-credentials").map(String::as_str) == Some("hand-over") {
        return Err("`enable-ha` on EC2 launches each controller machine as machine 0 was, and machine 0 was handed this home's credentials (`controller-credentials=hand-over`), which jujube does not copy to more instances; bootstrap an environment with an instance profile (the default) to run several controllers".into());
    }
    match config.get("instance-profile").map(String::as_str) {
        None | Some("") => Ok(Some(jujube_providers::ec2::profile::profile_name(env_uuid))),
        Some("none") => Ok(None),
        Some(other) => Ok(Some(other.to_string())),
    }
}

/// What a controller on an EC2 instance gives the instances of the
/// controller machines it provisions (`enable-ha`): its environment's
/// certificates and place of the state (in PostgreSQL), put in the control
/// bucket for the new instance's `take-up` to read with the credentials
/// machine 0 has (its instance profile's), and user data that fetches the binary and runs
/// `take-up` as that machine.
pub(crate) struct Ec2Seed {
    name: String,
    uuid: String,
    region: String,
    endpoint: Option<String>,
    bucket: String,
    dir: std::path::PathBuf,
    instance_profile: Option<String>,
}

impl Ec2Seed {
    /// The seed of the controller running here, when it took up an
    /// instance of its own ([`on_instance`]) and the state is in
    /// PostgreSQL; `None` otherwise (`enable-ha` refuses those).
    pub(crate) fn here(
        home: &Home,
        name: &str,
        config: &BTreeMap<String, String>,
        uuid: &str,
    ) -> Result<Option<Ec2Seed>> {
        let Some(here) = on_instance() else {
            return Ok(None);
        };
        if home.state_place(name)?.is_none() {
            return Ok(None);
        }
        let Ok(instance_profile) = controllers_profile(config, uuid) else {
            return Ok(None);
        };
        Ok(Some(Ec2Seed {
            name: name.to_string(),
            uuid: uuid.to_string(),
            region: here.region.clone(),
            endpoint: config.get("endpoint").cloned(),
            bucket: storage::bucket_name(uuid, config),
            dir: home.env_dir(name),
            instance_profile,
        }))
    }
}

impl crate::machine0::Seed for Ec2Seed {
    fn install(&self, machine: i64, _nonce: &str) -> Result<jujube_providers::ControllerInstall> {
        let key = format!(
            "{}take-up-{machine}-{}",
            storage::CONTROLLER_FILES,
            uuid::Uuid::new_v4()
        );
        let t = TakeUp {
            env: self.name.clone(),
            uuid: self.uuid.clone(),
            region: self.region.clone(),
            endpoint: self.endpoint.clone(),
            from: TakeUpFrom::Bucket {
                bucket: self.bucket.clone(),
                key: key.clone(),
            },
            machine,
        };
        Ok(jujube_providers::ControllerInstall {
            files: Vec::new(),
            api_listen: String::new(),
            state_db: None,
            take_up: Some(jujube_providers::TakeUpInstall {
                bundle: controller_bundle(&self.dir)?,
                key,
                args: t.args(),
                instance_profile: self.instance_profile.clone(),
            }),
        })
    }
}

/// Another controller's bundle, from this controller's environment
/// directory: [`crate::machine0::controller_files`], nothing else of it
/// (the agents', the logs).
fn controller_bundle(dir: &Path) -> Result<Vec<u8>> {
    use base64::Engine;
    let mut files = Vec::new();
    for rel in crate::machine0::controller_files(dir)? {
        let bytes = std::fs::read(dir.join(&rel))
            .with_context(|| format!("cannot read `{}`", dir.join(&rel).display()))?;
        files.push(BundleFile {
            path: rel.to_string_lossy().to_string(),
            mode: 0o600,
            data: b64().encode(bytes),
        });
    }
    Ok(serde_json::to_vec(&Bundle {
        files,
        credentials: None,
    })?)
}

/// On machine 0: takes up environment `t.env`'s controller into `home`
/// unless it holds it already (a restart): from the control bucket with
/// the instance's credentials (retrying while they or the object are not
/// there yet; deleted there once taken), or from `bootstrap`'s hand-over.
pub async fn take_up(home: &Home, t: &TakeUp) -> Result<()> {
    if home.has_store(&t.env) {
        return Ok(());
    }
    match &t.from {
        TakeUpFrom::Bucket { bucket, key } => take_up_from_bucket(home, t, bucket, key).await,
        TakeUpFrom::HandOver { token_sha256 } => take_up_handed_over(home, t, token_sha256).await,
    }
}

async fn take_up_from_bucket(home: &Home, t: &TakeUp, bucket: &str, key: &str) -> Result<()> {
    let mut config = BTreeMap::from([
        ("region".to_string(), t.region.clone()),
        ("control-bucket".to_string(), bucket.to_string()),
    ]);
    if let Some(e) = &t.endpoint {
        config.insert("endpoint".into(), e.clone());
    }
    let provider = Ec2Provider::new(&t.env, &t.uuid, &config, None).await?;
    let bucket = provider.control_bucket();
    let mut wait = Duration::from_secs(1);
    let bytes = loop {
        match bucket.get(key, BUNDLE_MAX).await {
            Ok(Some(b)) => break b,
            Ok(None) => {
                tracing::info!(key = %key, "the controller's state is not in the control bucket yet")
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the controller's state yet"),
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(15));
    };
    lay_out(home, &t.env, &bytes)?;
    if let Err(e) = bucket.delete(key).await {
        // Bootstrap deletes it too once the controller answers.
        tracing::warn!(error = %e, "cannot delete the controller's state from the control bucket");
    }
    tracing::info!(env = %t.env, "took up the controller");
    Ok(())
}

async fn take_up_handed_over(home: &Home, t: &TakeUp, token_sha256: &str) -> Result<()> {
    let url_file = Path::new(jujube_providers::HAND_OVER_URL_FILE);
    let url = std::fs::read_to_string(url_file).with_context(|| {
        format!(
            "cannot read where to publish the hand-over's identity (`{}`, left by the boot script)",
            url_file.display()
        )
    })?;
    let id = jujube_api::tls::OneShot::new()?;
    publish(url.trim(), &id.ca_cert).await?;
    let (home, env) = (
        Home {
            root: home.root.clone(),
        },
        t.env.clone(),
    );
    jujube_api::handover::receive(
        &format!("0.0.0.0:{API_PORT}"),
        &id.server_cert,
        &id.server_key,
        token_sha256,
        BUNDLE_MAX as usize,
        Box::new(move |bytes| lay_out(&home, &env, &bytes).map_err(|e| e.to_string())),
        jujube_api::handover::CONNECTION_TIMEOUT,
    )
    .await?;
    let _ = std::fs::remove_file(url_file);
    tracing::info!(env = %t.env, "took up the controller");
    Ok(())
}

/// `PUT`s `text` to the presigned `url` with curl (which fetched this
/// binary), retrying for a minute.
async fn publish(url: &str, text: &str) -> Result<()> {
    let mut last = String::new();
    for _ in 0..12 {
        let mut child = tokio::process::Command::new("curl")
            .args(["-fsS", "-X", "PUT", "--data-binary", "@-", url])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("cannot run `curl`")?;
        if let Some(mut stdin) = child.stdin.take() {
            use tokio::io::AsyncWriteExt;
            stdin.write_all(text.as_bytes()).await?;
        }
        let out = child.wait_with_output().await?;
        if out.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
        tracing::warn!(error = %last, "cannot publish the hand-over's identity yet");
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    bail!("cannot publish the hand-over's identity to the control bucket: {last}")
}

/// Lays the hand-over `bytes` out as environment `env`'s directory: beside
/// it first, then renamed into place whole, so that a crash part-way
/// leaves no half environment a restart would take as whole.
fn lay_out(home: &Home, env: &str, bytes: &[u8]) -> Result<()> {
    let dir = home.env_dir(env);
    let laying = dir.with_extension("taking-up");
    let _ = std::fs::remove_dir_all(&laying);
    unbundle(bytes, &laying)?;
    home.create_env_dir(env)?;
    std::fs::remove_dir(&dir).with_context(|| format!("cannot replace `{}`", dir.display()))?;
    std::fs::rename(&laying, &dir)
        .with_context(|| format!("cannot move the controller's state to `{}`", dir.display()))?;
    home.tighten(env)?;
    home.set_current(env)
}

fn bootstrap_timeout(config: &BTreeMap<String, String>) -> Result<Duration> {
    match config.get("bootstrap-timeout") {
        None => Ok(BOOTSTRAP_TIMEOUT),
        Some(v) => jujube_core::duration::parse(v).ok_or_else(|| {
            crate::Error::Refused(format!(
                "`bootstrap-timeout={v}` is not a duration; give one like `10m` or `90s`"
            ))
        }),
    }
}

/// The steps bootstrap waits for, named when one does not come.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Step {
    Storage,
    Identity,
    Instance,
    TakeUp,
    Answer,
}

impl Step {
    fn doing(self) -> &'static str {
        match self {
            Step::Storage => "making the environment's storage and uploading the tools",
            Step::Identity => "making the controller's IAM role and instance profile",
            Step::Instance => "starting machine 0's instance",
            Step::TakeUp => "waiting for machine 0 to fetch its tools and take up the controller",
            Step::Answer => "waiting for machine 0's controller to answer",
        }
    }
}

/// `bootstrap --provider ec2`: machine 0's instance made the controller
/// (see the module's steps). On failure, whatever step it was, machine 0 is
/// terminated and the bucket, profile, role and security group removed; the
/// caller removes the directory.
pub async fn bootstrap(
    home: &Home,
    name: &str,
    store: Store,
    password: &str,
    progress: &mut dyn crate::run::Progress,
) -> Result<()> {
    let env = store.environment()?;
    let config = store.environment_config()?;
    let deadline = Instant::now() + bootstrap_timeout(&config)?;
    let ec2 = Arc::new(Ec2Provider::new(&env.name, &env.uuid, &config, None).await?);
    let mut step = Step::Storage;
    let result = steps(
        home, name, store, password, progress, &ec2, &config, deadline, &mut step,
    )
    .await;
    if let Err(e) = result {
        progress.finish(&format!("bootstrap failed while {}", step.doing()));
        let mut removed = Vec::new();
        let ours: Vec<String> = ec2
            .instances()
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|i| i.id)
            .collect();
        if !ours.is_empty() && ec2.stop_instances(&ours).await.is_ok() {
            removed.push(format!("instance(s) {}", ours.join(", ")));
            // A state in PostgreSQL is erased after this: not while a
            // controller that took it up may still write it.
            if home.state_place(name).ok().flatten().is_some() {
                let _ = wait_terminated(&ec2, &ours, TERMINATION_WAIT).await;
            }
        }
        match ec2.remove_environment_resources().await {
            Ok(gone) => removed.extend(gone),
            Err(c) => removed.push(format!("not all else ({c})")),
        }
        let removed = if removed.is_empty() {
            "nothing had been made".to_string()
        } else {
            format!("removed {}", removed.join(", "))
        };
        bail!("bootstrap failed while {}: {e}; {removed}", step.doing());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn steps(
    home: &Home,
    name: &str,
    store: Store,
    password: &str,
    progress: &mut dyn crate::run::Progress,
    ec2: &Arc<Ec2Provider>,
    config: &BTreeMap<String, String>,
    deadline: Instant,
    step: &mut Step,
) -> Result<()> {
    let env = store.environment()?;
    let bucket = ec2.control_bucket();
    progress.line(&format!(
        "making the environment's storage (S3 bucket `{}`)",
        bucket.name()
    ));
    bucket.ensure().await?;
    let exe = std::env::current_exe().context("cannot find the `jujube` binary")?;
    let binary = std::fs::read(&exe).with_context(|| format!("cannot read `{}`", exe.display()))?;
    let tools = bucket.put_tools(binary).await?;
    let url = bucket
        .presign(&tools.key, SystemTime::now(), storage::TOOLS_URL_LIFETIME)
        .await?;
    *step = Step::Identity;
    let handing_over =
        config.get("controller-credentials").map(String::as_str) == Some("hand-over");
    let profile = match config.get("instance-profile").map(String::as_str) {
        _ if handing_over => None,
        None | Some("") => {
            let p = ec2.controller_profile();
            progress.line(&format!(
                "making the controller's IAM role and instance profile `{}`",
                p.name()
            ));
            p.ensure(bucket.name()).await?;
            Some(p.name().to_string())
        }
        Some("none") => None,
        Some(other) => Some(other.to_string()),
    };
    let cidr = config
        .get("api-allowed-cidr")
        .map(String::as_str)
        .unwrap_or("0.0.0.0/0");
    ec2.open_port(API_PORT, cidr).await?;

    *step = Step::Instance;
    let key = format!(
        "{}take-up-{}",
        storage::CONTROLLER_FILES,
        uuid::Uuid::new_v4()
    );
    // A hand-over: the one-time token stays here, machine 0 is told its
    // hash; it publishes its one-shot identity's CA by a URL that can
    // write that one object until the bootstrap times out.
    let token = jujube_agent::wire::new_secret();
    let (from, hand_over_url) = if handing_over {
        let lifetime = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(60));
        let url = bucket
            .presign_put(&key, SystemTime::now(), lifetime)
            .await?;
        (
            TakeUpFrom::HandOver {
                token_sha256: jujube_agent::wire::secret_hash(&token),
            },
            Some(url),
        )
    } else {
        (
            TakeUpFrom::Bucket {
                bucket: bucket.name().to_string(),
                key: key.clone(),
            },
            None,
        )
    };
    let take_up = TakeUp {
        env: name.to_string(),
        uuid: env.uuid.clone(),
        region: ec2.region().to_string(),
        endpoint: config.get("endpoint").cloned(),
        from,
        machine: 0,
    };
    let user_data = jujube_providers::controller_boot_script(&jujube_providers::ControllerBoot {
        tools_url: url,
        sha256: tools.sha256.clone(),
        args: take_up.args(),
        hand_over_url,
    })?;
    ec2.launch_controller_with(ControllerLaunch {
        user_data,
        instance_profile: profile,
    });
    crate::run::provision_machine_0(&store, ec2.clone() as Arc<dyn Provider>, progress).await?;
    let instance = store
        .machine(0)?
        .instance_id
        .context("machine 0 has no instance")?;
    let addrs = ec2.addresses(&instance).await?;
    let private = addrs.private.clone().or(addrs.public.clone());
    let dial = match config.get("controller-address") {
        Some(a) => a.clone(),
        None => {
            let ip = if config.get("use-private-address").map(String::as_str) == Some("true") {
                private.clone()
            } else {
                addrs.public.clone()
            };
            let ip = ip.with_context(|| {
                format!("machine 0's instance `{instance}` has no address to reach it at; set `use-private-address=true` from inside its network, or `controller-address`")
            })?;
            format!("{ip}:{API_PORT}")
        }
    };
    progress.line(&format!(
        "machine 0: instance `{instance}` started; its controller will answer at {dial}"
    ));
    // What the controller reads on machine 0: where agents reach it, where
    // it listens.
    let mut set = vec![(
        "api-listen-address".to_string(),
        format!("0.0.0.0:{API_PORT}"),
    )];
    if let Some(ip) = &private {
        set.push(("api-address".into(), format!("{ip}:{API_PORT}")));
    }
    store.set_environment_config(&set)?;
    drop(store);
    let dir = home.env_dir(name);
    let state = home.state_place(name)?;
    let theirs_dir = format!("{CONTROLLER_HOME}/environments/{name}");
    let theirs = state.as_ref().map(|p| (p, theirs_dir.as_str()));

    *step = Step::TakeUp;
    let what = Step::TakeUp.doing();
    let t0 = Instant::now();
    let late = || {
        crate::Error::Refused(format!("machine 0 did not take up the controller within the `bootstrap-timeout`; see /var/log/cloud-init-output.log on `{instance}`"))
    };
    if handing_over {
        let credentials = ec2.current_credentials().await?;
        if let Some(at) = credentials.expires {
            progress.line(&format!(
                "note: the credentials handed to machine 0 are temporary (they expire {}s from now); its controller cannot act on the cloud after that: bootstrap with an instance profile instead",
                at.saturating_sub(
                    SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs())
                )
            ));
        }
        let bundle = bundle(&dir, Some(credentials), theirs)?;
        let env_ca = jujube_api::tls::ca_cert(&dir)?;
        loop {
            if Instant::now() > deadline {
                return Err(late());
            }
            progress.update(&format!("{what} ({}s)", t0.elapsed().as_secs()), what);
            // Its identity first (published by machine 0 in the bucket,
            // read with this home's credentials), then the hand-over.
            let attempt = match bucket.get(&key, 64 << 10).await? {
                None => None,
                Some(ca) => {
                    let ca = String::from_utf8_lossy(&ca).to_string();
                    Some(jujube_agent::remote::hand_over(&dial, &ca, &token, bundle.clone()).await)
                }
            };
            match attempt {
                Some(Ok(())) => break,
                // Not listening yet, or not reachable yet; or it took one
                // whose answer was lost, and its controller has the port
                // now: its answering is what says so.
                Some(Err(e))
                    if e.code == jujube_agent::api::ErrorCode::Unavailable
                        || e.message == jujube_api::handover::TAKEN_ALREADY =>
                {
                    let answers = controller_answers(&dial, &env_ca, password).await;
                    if answers {
                        break;
                    }
                }
                Some(Err(e)) => bail!("machine 0 refused the hand-over: {e}"),
                None => {}
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let _ = bucket.delete(&key).await;
        progress.line("machine 0: tools fetched, state and credentials handed over");
    } else {
        bucket
            .put_private(&key, bundle(&dir, None, theirs)?)
            .await?;
        while bucket.exists(&key).await? {
            if Instant::now() > deadline {
                return Err(late());
            }
            progress.update(&format!("{what} ({}s)", t0.elapsed().as_secs()), what);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        progress.line("machine 0: tools fetched, controller taken up");
    }

    *step = Step::Answer;
    let ca = jujube_api::tls::ca_cert(&dir)?;
    wait_for_answer(&dial, &ca, password, deadline, progress).await?;
    hand_over_home(
        home,
        name,
        &Machine0 {
            uuid: env.uuid.clone(),
            provider: "ec2".into(),
            container: instance,
            lxd: config.clone(),
            api_address: dial,
            state,
        },
    )
}

/// How long `destroy-environment` waits for machine 0's instance to
/// terminate before it erases a state in PostgreSQL.
const TERMINATION_WAIT: Duration = Duration::from_secs(300);

/// Waits until instances `ids` have terminated (shut down, not only
/// stopping), up to `within`.
async fn wait_terminated(ec2: &Ec2Provider, ids: &[String], within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let left = ec2.not_terminated(ids).await?;
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "instance(s) {} had not terminated after {}s",
                left.join(", "),
                within.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Whether the environment's controller answers this home's admin at `dial`,
/// proven by the environment's CA `ca`: once, no waiting.
async fn controller_answers(dial: &str, ca: &str, password: &str) -> bool {
    let Ok(client) = jujube_agent::remote::UserClient::new(
        std::slice::from_ref(&dial.to_string()),
        ca,
        jujube_wire::client::ADMIN,
        password,
    ) else {
        return false;
    };
    matches!(
        client.call(&jujube_wire::client::ClientCall::Status).await,
        Ok(Ok(_))
    )
}

/// `destroy-environment` of an environment whose controller runs on
/// machine 0's instance: every other instance with its UUID is stopped,
/// then machine 0, then its security group, bucket, profile and role go;
/// says what it removed. A second run after a partial failure finishes it.
pub async fn destroy(home: &Home, name: &str, m0: Machine0, out: &mut impl Write) -> Result<()> {
    let ec2 = Ec2Provider::new(name, &m0.uuid, &m0.lxd, None).await?;
    // Every controller (`enable-ha`'s too) may write the state until its
    // instance has terminated: those listed before the stop, and any
    // launched meanwhile.
    let mut controllers = ec2.controller_instances().await?;
    crate::run::stop_every_instance(&ec2, Vec::new(), Some(&m0.container), out).await?;
    controllers.extend(ec2.controller_instances().await?);
    let machine0 = std::slice::from_ref(&m0.container);
    if !ec2.instances_by_id(machine0).await?.is_empty() {
        ec2.stop_instances(machine0).await?;
        writeln!(
            out,
            "stopped machine 0 (`{}`), the controller",
            m0.container
        )?;
    }
    let removed = ec2.remove_environment_resources().await?;
    if removed.is_empty() {
        writeln!(out, "nothing else of the environment was left in the cloud")?;
    } else {
        writeln!(out, "removed {}", removed.join(", "))?;
    }
    if let Some(place) = &m0.state {
        // Erased only when no controller's instance runs.
        controllers.push(m0.container.clone());
        controllers.sort();
        controllers.dedup();
        wait_terminated(&ec2, &controllers, TERMINATION_WAIT)
            .await
            .map_err(|e| {
                crate::Error::Refused(format!(
                    "{e}, so the environment's state in `{}` is kept: run `jujube destroy-environment {name}` again",
                    place.url
                ))
            })?;
        crate::machine0::erase_state(name, place, out)?;
    }
    crate::run::forget_environment(home, name, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state in PostgreSQL goes to machine 0 as its own place: this
    /// home's `state-url.json` stays here, the authority and the password
    /// travel as files of machine 0's environment directory, which its URL
    /// and password file name.
    #[test]
    fn a_bundle_carries_machine_0s_own_state_place() {
        let from = tempfile::tempdir().unwrap();
        let ca = from.path().join("ca.crt");
        std::fs::write(&ca, b"authority").unwrap();
        let password = from.path().join("password");
        std::fs::write(&password, b"s3cret\n").unwrap();
        let env = from.path().join("env");
        std::fs::create_dir_all(&env).unwrap();
        let place = crate::home::StatePlace {
            url: format!(
                "postgres://jujube@db.internal:5432/jujube?sslmode=verify-full&sslrootcert={}",
                ca.display()
            ),
            password_file: Some(password),
        };
        std::fs::write(
            env.join(crate::home::STATE_URL),
            serde_json::to_vec(&place).unwrap(),
        )
        .unwrap();
        let theirs = "/var/lib/jujube/home/environments/aws";
        let bytes = bundle(&env, None, Some((&place, theirs))).unwrap();
        let to = tempfile::tempdir().unwrap();
        let dir = to.path().join("env");
        unbundle(&bytes, &dir).unwrap();
        let laid: crate::home::StatePlace =
            serde_json::from_slice(&std::fs::read(dir.join(crate::home::STATE_URL)).unwrap())
                .unwrap();
        assert_eq!(
            laid.url,
            format!("postgres://jujube@db.internal:5432/jujube?sslmode=verify-full&sslrootcert={theirs}/state-ca.pem")
        );
        assert_eq!(
            laid.password_file,
            Some(format!("{theirs}/state-password").into())
        );
        assert_eq!(
            std::fs::read(dir.join("state-ca.pem")).unwrap(),
            b"authority"
        );
        assert_eq!(
            std::fs::read(dir.join("state-password")).unwrap(),
            b"s3cret"
        );
    }

    #[test]
    fn a_state_url_on_this_hosts_loopback_is_refused_unless_the_cloud_is_here_too() {
        let config = |endpoint: Option<&str>| -> BTreeMap<String, String> {
            endpoint
                .map(|e| ("endpoint".to_string(), e.to_string()))
                .into_iter()
                .collect()
        };
        let here = "postgres://jujube@127.0.0.1:5432/jujube";
        let err = check_state_reachable(here, &config(None))
            .unwrap_err()
            .to_string();
        assert!(err.contains("machine 0's instance cannot reach"), "{err}");
        assert!(
            check_state_reachable(here, &config(Some("https://ec2.eu-west-1.amazonaws.com")))
                .is_err()
        );
        assert!(
            check_state_reachable("postgres://jujube@localhost/jujube", &config(None)).is_err()
        );
        // An emulated cloud on this host: its instances are this host's.
        check_state_reachable(here, &config(Some("http://127.0.0.1:4566"))).unwrap();
        check_state_reachable("postgres://jujube@db.internal:5432/jujube", &config(None)).unwrap();
        check_state_reachable("postgres://jujube@10.0.1.5/jujube", &config(None)).unwrap();
        assert!(check_state_reachable("mysql:nothing", &config(None)).is_err());
        // A host that is not the URL's authority's one: refused as on LXD.
        for sneaky in [
            "postgres://jujube@/jujube?host=/run/postgresql",
            "postgres://jujube@db.internal/jujube?host=127.0.0.1",
            "postgres://jujube@db.internal/jujube?hostaddr=127.0.0.1",
            "postgres://jujube@db.internal:5432,127.0.0.1:5433/jujube",
        ] {
            assert!(
                check_state_reachable(sneaky, &config(None)).is_err(),
                "{sneaky}"
            );
        }
        for here in ["http://localhost:4566", "http://[::1]:4566"] {
            check_state_reachable("postgres://jujube@127.0.0.1/jujube", &config(Some(here)))
                .unwrap();
        }
    }

    #[test]
    fn a_bundle_lays_out_what_it_took_and_nothing_outside() {
        let from = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(from.path().join("tls")).unwrap();
        std::fs::write(from.path().join("state.db"), b"store").unwrap();
        std::fs::write(from.path().join("state.db-shm"), b"index").unwrap();
        std::fs::write(from.path().join("tls/ca.key"), b"key").unwrap();
        // Credentials kept from an earlier hand-over never travel on.
        std::fs::write(from.path().join(CLOUD_CREDENTIALS), b"old").unwrap();
        let handed = HandedCredentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG".into(),
            session_token: None,
            expires: None,
        };
        let bytes = bundle(from.path(), Some(handed.clone()), None).unwrap();
        let to = tempfile::tempdir().unwrap();
        let dir = to.path().join("env");
        unbundle(&bytes, &dir).unwrap();
        assert_eq!(handed_credentials(&dir).unwrap(), Some(handed));
        assert_eq!(
            handed_credentials(from.path().join("none").as_path()).unwrap(),
            None
        );
        assert_eq!(std::fs::read(dir.join("state.db")).unwrap(), b"store");
        assert_eq!(std::fs::read(dir.join("tls/ca.key")).unwrap(), b"key");
        assert!(!dir.join("state.db-shm").exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("tls/ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "the owner's alone");
        let mode = std::fs::metadata(dir.join(CLOUD_CREDENTIALS))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "the owner's alone");

        for evil in ["../escape", "/etc/passwd", "tls/../../x", "a b", ""] {
            let bad = serde_json::to_vec(&Bundle {
                files: vec![BundleFile {
                    path: evil.into(),
                    mode: 0o600,
                    data: String::new(),
                }],
                credentials: None,
            })
            .unwrap();
            let out = to.path().join("evil");
            let err = unbundle(&bad, &out).unwrap_err().to_string();
            assert!(
                err.contains("names a path jujube does not write"),
                "{evil}: {err}"
            );
            assert!(!out.exists(), "nothing written for {evil}");
        }
    }

    /// Another controller's instance gets the environment's certificates
    /// and the place of the state, nothing else of machine 0's directory,
    /// by a key of its own that its `take-up` names, as its machine.
    #[test]
    fn an_ec2_seed_gives_a_controller_machine_its_certificates_and_state_place_alone() {
        let from = tempfile::tempdir().unwrap();
        let dir = from.path().join("ha");
        for (f, data) in [
            ("tls/ca.crt", "ca"),
            ("tls/server.key", "key"),
            (crate::home::STATE_URL, "{}"),
            ("state-ca.pem", "authority"),
            ("state-password", "s3cret"),
            ("agents/machine-1/agent.conf", "agent"),
            ("logsink/0.log", "log"),
            (CLOUD_CREDENTIALS, "credentials"),
        ] {
            std::fs::create_dir_all(dir.join(f).parent().unwrap()).unwrap();
            std::fs::write(dir.join(f), data).unwrap();
        }
        let seed = Ec2Seed {
            name: "ha".into(),
            uuid: "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
            region: "us-east-1".into(),
            endpoint: None,
            bucket: "jujube-6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
            dir,
            instance_profile: Some("jujube-6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into()),
        };
        use crate::machine0::Seed;
        let install = seed.install(2, "b/0").unwrap();
        let t = install.take_up.expect("taken up from the bucket");
        assert!(t.key.starts_with("controller/take-up-2-"), "{}", t.key);
        assert!(t.args.contains(&"--machine=2".to_string()), "{:?}", t.args);
        assert!(t.args.contains(&format!("--key={}", t.key)), "{:?}", t.args);
        assert_eq!(t.instance_profile, seed.instance_profile);
        // Each start attempt its own key.
        assert_ne!(seed.install(2, "b/0").unwrap().take_up.unwrap().key, t.key);
        let to = tempfile::tempdir().unwrap();
        unbundle(&t.bundle, to.path()).unwrap();
        let mut laid = Vec::new();
        files_under(to.path(), Path::new(""), &mut laid).unwrap();
        let mut laid: Vec<String> = laid
            .into_iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        laid.sort();
        assert_eq!(
            laid,
            [
                "state-ca.pem",
                "state-password",
                crate::home::STATE_URL,
                "tls/ca.crt",
                "tls/server.key"
            ]
        );
    }

    #[test]
    fn controllers_are_launched_as_machine_0_was_and_never_with_handed_credentials() {
        let uuid = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";
        let config = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            controllers_profile(&config(&[]), uuid),
            Ok(Some(format!("jujube-{uuid}")))
        );
        assert_eq!(
            controllers_profile(&config(&[("instance-profile", "mine")]), uuid),
            Ok(Some("mine".into()))
        );
        assert_eq!(
            controllers_profile(&config(&[("instance-profile", "none")]), uuid),
            Ok(None)
        );
        let err = controllers_profile(&config(&[("controller-credentials", "hand-over")]), uuid)
            .unwrap_err();
        assert!(err.contains("`controller-credentials=hand-over`"), "{err}");
    }

    #[test]
    fn take_up_is_told_no_secret() {
        let token = jujube_agent::wire::new_secret();
        for from in [
            TakeUpFrom::Bucket {
                bucket: "jujube-6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
                key: "controller/take-up-0b8e".into(),
            },
            TakeUpFrom::HandOver {
                token_sha256: jujube_agent::wire::secret_hash(&token),
            },
        ] {
            let t = TakeUp {
                env: "prod".into(),
                uuid: "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
                region: "us-east-1".into(),
                endpoint: None,
                from: from.clone(),
                machine: 0,
            };
            let script =
                jujube_providers::controller_boot_script(&jujube_providers::ControllerBoot {
                    tools_url: "https://example/tools".into(),
                    sha256: "0".repeat(64),
                    args: t.args(),
                    hand_over_url: matches!(from, TakeUpFrom::HandOver { .. })
                        .then(|| "https://example/controller/ca".into()),
                })
                .unwrap();
            assert!(script.contains(
                "take-up --home=/var/lib/jujube/home --env=prod --uuid=6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f"
            ));
            // The hand-over's token is in bootstrap alone: machine 0 knows
            // its hash.
            for secret in ["password", "BEGIN", "AWS_SECRET", "token=", &token] {
                assert!(!script.contains(secret), "{secret}");
            }
        }
    }
}
