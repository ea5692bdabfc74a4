//! Clouds, behind one small trait.
//!
//! # Layout
//! - this file: the [`Provider`] trait, the types it speaks ([`StartSpec`],
//!   [`Instance`]), the ownership tags, and the classified [`Error`].
//! - [`dummy`]: the embedded default cloud and fault injector — persistent,
//!   configurable latency, failures per machine or per error class, EC2-like
//!   token buckets, lost responses, eventually consistent listings.
//! - `ec2` (feature `ec2`, on by default): Amazon EC2 and compatible APIs.
//! - `lxd` (feature `lxd`, on by default): system containers on an LXD
//!   daemon, over its REST API (unix socket, or HTTPS with a client
//!   certificate).
//! - [`conformance`]: scenarios every provider must pass; each provider's
//!   tests run them against the real thing.
//! - [`bucket`]: the token bucket the dummy throttles with and the
//!   provisioner paces itself with.
//!
//! Providers know nothing of the state store: they are told what to start
//! and asked what exists. Ownership is proven by tags carrying the
//! environment's full UUID, never guessed: a provider lists, and the
//! provisioner stops, only instances so tagged.

pub mod bucket;
pub mod conformance;
pub mod dummy;
#[cfg(feature = "ec2")]
pub mod ec2;
#[cfg(feature = "lxd")]
pub mod lxd;

use async_trait::async_trait;
use jujube_core::Constraints;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Tag holding the environment's full UUID: the proof of ownership.
pub const TAG_ENV_UUID: &str = "jujube-env-uuid";
/// Tag holding the machine id the instance was started for.
pub const TAG_MACHINE_ID: &str = "jujube-machine-id";
/// Tag holding the nonce (idempotency token) of the start.
pub const TAG_NONCE: &str = "jujube-nonce";
/// Tag marking the environment's controller instance (machine 0).
pub const TAG_CONTROLLER: &str = "jujube-controller";
/// Human-readable instance name, `jujube-<env>-<machine>`.
pub const TAG_NAME: &str = "Name";
/// Tag holding the launch batch of instances started by one request (EC2's
/// RunInstances with a count), applied atomically with the launch.
pub const TAG_BATCH: &str = "jujube-batch";

/// The launch batch and index a nonce names. Machines started by one request
/// get nonces `<batch>/<index>`, committed before the request: the index is
/// the instance's place in the request (EC2's `AmiLaunchIndex`), so a
/// restarted controller re-forms the same batch and matches what a lost
/// request launched to machines deterministically. Any other nonce is a
/// launch of its own.
pub fn launch_batch(nonce: &str) -> Option<(&str, u32)> {
    let (batch, index) = nonce.rsplit_once('/')?;
    let index = index.parse().ok()?;
    (!batch.is_empty()).then_some((batch, index))
}

/// The nonce of the instance at `index` in launch batch `batch`.
pub fn batch_nonce(batch: &str, index: u32) -> String {
    format!("{batch}/{index}")
}

/// What to start: everything comes from the machine entity.
#[derive(Debug, Clone, PartialEq)]
pub struct StartSpec {
    pub machine_id: String,
    /// Idempotency token: starting twice with one nonce yields one instance.
    pub nonce: String,
    pub series: String,
    pub constraints: Constraints,
    /// Zone to start in; `None` lets the provider choose.
    pub zone: Option<String>,
    pub controller: bool,
    pub user_data: String,
    /// The machine's agent, for providers that install it on the instance
    /// (LXD: pushed into the container; the dummy: written to the machine's
    /// directory). `None`: its agent runs elsewhere (in the controller).
    pub agent: Option<AgentInstall>,
}

/// What a machine's agent needs on its instance. Made by the provisioner
/// for each start attempt with a fresh secret (only its hash is stored), so
/// a retried or adopted start carries a credential that works.
#[derive(Clone, PartialEq)]
pub struct AgentInstall {
    /// The agent's `agent.conf`: API addresses, CA, tag and secret.
    pub conf: Vec<u8>,
    /// The `jujube` binary to install (the controller's own).
    pub binary: PathBuf,
    /// Where the controller's API is on the provider's host, as an LXD
    /// proxy device's `connect` (`unix:PATH`, `tcp:HOST:PORT`): LXD exposes
    /// it inside the container, so the agent needs no network. Machine 0's
    /// controller's, or the one controller's.
    pub api_connect: String,
    /// The other controller machines (`enable-ha`), each as `(machine,
    /// connect)`: LXD proxies each one's API into the container beside
    /// machine 0's.
    pub other_controllers: Vec<(i64, String)>,
    /// For instances that boot from user data shared by their launch batch
    /// (EC2): no secret, but what their boot script needs to fetch the
    /// binary and enroll (`conf` is then empty).
    pub enrollment: Option<Enrollment>,
    /// For a controller machine (`enable-ha`) on a provider that installs
    /// controllers (LXD): what makes the instance a controller (`conf` is
    /// then empty, and no agent runs there).
    pub controller: Option<ControllerInstall>,
}

/// What makes an instance one of the environment's controllers, made by
/// the controller that provisions it from its own home: the same CA,
/// certificates, client identity for the cloud and place of the state,
/// and where the instance's API is exposed (LXD: containers have no
/// network, so a proxy device on the daemon's host).
#[derive(Clone, PartialEq)]
pub struct ControllerInstall {
    /// `(path on the instance, contents, mode)`: secrets among them.
    pub files: Vec<(String, Vec<u8>, u32)>,
    /// Where the controller's API is exposed on the provider's host
    /// (`IP:PORT`): what the CLI and agents' proxies connect to.
    pub api_listen: String,
    /// The state database's server on the provider's host (`IP:PORT`),
    /// reached from inside the instance at the same address (its
    /// certificate names the address the controller dials).
    pub state_db: Option<String>,
    /// For a provider whose instances boot from user data (EC2): how the
    /// instance takes the controller up ([`TakeUpInstall`]); `files`,
    /// `api_listen` and `state_db` are then empty.
    pub take_up: Option<TakeUpInstall>,
}

/// How an instance that boots from user data becomes a controller (EC2):
/// the provider puts `bundle` in the environment's storage, private, as
/// `key`, and boots the instance with [`controller_boot_script`] running
/// `jujube ARGS` (which reads `key` with the instance profile's
/// credentials, lays it out and deletes it) under `instance_profile`.
/// Nothing secret reaches the user data.
#[derive(Clone, PartialEq)]
pub struct TakeUpInstall {
    /// The controller's files (secrets among them), as `take-up` reads
    /// them.
    pub bundle: Vec<u8>,
    /// Where in the environment's storage: one per start attempt.
    pub key: String,
    /// `jujube`'s arguments on the instance: they name `key`.
    pub args: Vec<String>,
    /// The instance profile whose role reads `key` and acts on the cloud.
    pub instance_profile: Option<String>,
}

impl std::fmt::Debug for ControllerInstall {
    /// Never the files' contents: secrets are among them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerInstall")
            .field(
                "files",
                &self.files.iter().map(|(p, _, _)| p).collect::<Vec<_>>(),
            )
            .field("api_listen", &self.api_listen)
            .field("state_db", &self.state_db)
            .field(
                "take_up",
                &self
                    .take_up
                    .as_ref()
                    .map(|t| (&t.key, &t.args, &t.instance_profile)),
            )
            .finish()
    }
}

/// What an instance's boot script needs to install its agent: see
/// [`boot_script`].
#[derive(Clone, PartialEq)]
pub struct Enrollment {
    /// The batch's one-time token (per instance), traded for the machine's
    /// credential.
    pub token: String,
    /// The API's address as instances reach it (`host:port`).
    pub api_address: String,
    /// The environment's CA certificate (PEM): the agent trusts only it.
    pub ca_cert: String,
    /// SHA-256 (hex) of the binary the API serves.
    pub binary_sha256: String,
}

/// The user data that installs and starts a machine's agent: a shell
/// script cloud-init runs once, as root, at first boot (the same script
/// runs anywhere with `sh`, `sha256sum` and `curl` or a `wget` whose TLS
/// sends signature algorithms, which busybox's does not). It
/// fetches the binary from the controller's API and checks it against the
/// hash it carries (so the download needs neither a credential nor a
/// trusted certificate), enrolls with the batch's token and the instance's
/// identity document signed by AWS (from the metadata service, IMDSv2
/// first; `JUJUBE_IMDS` overrides the service's address) — the token alone
/// proves nothing about which instance calls, since every instance of the
/// batch holds it — (the binary does, trusting only the environment's CA),
/// and runs the
/// agent as a systemd service where there is systemd (an image without it
/// runs `/usr/local/bin/jujube agent --data-dir /var/lib/jujube/agent` from
/// its init, as `scripts/lxd-setup`'s `jujube-agent` does).
pub fn boot_script(e: &Enrollment) -> String {
    format!(
        r#"#!/bin/sh
# jujube: install and start this machine's agent.
set -eu
api='{api}'
sha256='{sha}'
token='{token}'
dir=/var/lib/jujube/agent
mkdir -p /usr/local/bin /var/lib/jujube "$dir"
chmod 700 "$dir"
imds=${{JUJUBE_IMDS:-http://169.254.169.254}}
# The instance identity document and its signature: IMDSv2 (a session
# token), else IMDSv1.
imds_get() {{
  if command -v curl >/dev/null 2>&1; then
    t=$(curl -fsS -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' "$imds/latest/api/token" 2>/dev/null || true)
    if [ -n "$t" ]; then
      curl -fsS -H "X-aws-ec2-metadata-token: $t" -o "$2" "$imds$1"
    else
      curl -fsS -o "$2" "$imds$1"
    fi
  else
    wget -qO "$2" "$imds$1"
  fi
}}
until imds_get /latest/dynamic/instance-identity/document /var/lib/jujube/identity.json &&
    imds_get /latest/dynamic/instance-identity/signature /var/lib/jujube/identity.sig; do
  echo "jujube: cannot read this instance's identity from $imds yet; retrying" >&2
  sleep 5
done
cat > /var/lib/jujube/ca.pem <<'CA'
{ca}CA
tmp=/usr/local/bin/.jujube.download
fetch() {{
  if command -v curl >/dev/null 2>&1; then
    curl -fsSk -o "$tmp" "https://$api{tools}"
  else
    wget -q --no-check-certificate -O "$tmp" "https://$api{tools}"
  fi
}}
until fetch &&
    [ "$(sha256sum "$tmp" | cut -d' ' -f1)" = "$sha256" ]; do
  echo "jujube: cannot fetch the agent from $api yet; retrying" >&2
  sleep 5
done
chmod 755 "$tmp"
mv "$tmp" /usr/local/bin/jujube
until /usr/local/bin/jujube enroll --data-dir "$dir" --api "$api" --ca-cert /var/lib/jujube/ca.pem --token "$token" \
    --identity-document /var/lib/jujube/identity.json --identity-signature /var/lib/jujube/identity.sig; do
  sleep 5
done
if command -v systemctl >/dev/null 2>&1; then
{unit}fi
"#,
        unit = systemd_service(
            "jujube-agent",
            "jujube machine agent",
            "agent --data-dir /var/lib/jujube/agent"
        ),
        api = e.api_address,
        sha = e.binary_sha256,
        token = e.token,
        ca = if e.ca_cert.ends_with('\n') {
            e.ca_cert.clone()
        } else {
            format!("{}\n", e.ca_cert)
        },
        tools = TOOLS_PATH,
    )
}

/// What machine 0's boot script needs to install the controller: a URL
/// that reads the `jujube` binary (on EC2 a presigned GET of the control
/// bucket's tools: it expires, and carries no credential), its SHA-256, and
/// the arguments `jujube` runs with as the controller's service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerBoot {
    pub tools_url: String,
    pub sha256: String,
    pub args: Vec<String>,
    /// A URL `jujube` finds in [`HAND_OVER_URL_FILE`] (the owner's alone):
    /// where machine 0 publishes the identity it takes its hand-over with.
    pub hand_over_url: Option<String>,
}

/// Where machine 0's boot script leaves [`ControllerBoot::hand_over_url`].
pub const HAND_OVER_URL_FILE: &str = "/var/lib/jujube/hand-over-url";

/// A controller machine's user data (machine 0's, and `enable-ha`'s
/// others' on EC2): fetches the binary from `tools_url`, refuses it
/// unless its SHA-256 is `sha256` (then exits 1, installing nothing),
/// installs it as `/usr/local/bin/jujube` and runs `jujube ARGS...` as the
/// systemd service `jujube-controller` (in the background where there is no
/// systemd). A fetch that fails is retried for five minutes; a binary that
/// does not match is not (the bytes under a name never change). It holds no
/// secret: the URL is a capability for one object, until it expires.
/// `JUJUBE_ROOT` prefixes every path it writes.
///
/// Refused: an argument outside `[A-Za-z0-9._/:=@+,-]` (nothing here quotes
/// for both sh and systemd), or a hash that is not 64 hex digits.
pub fn controller_boot_script(b: &ControllerBoot) -> Result<String> {
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._/:=@+,-".contains(&c))
    };
    if let Some(a) = b.args.iter().find(|a| !plain(a)) {
        return Err(Error::InvalidSpec(format!(
            "controller argument `{a}` has characters a boot script does not quote"
        )));
    }
    if b.sha256.len() != 64 || !b.sha256.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(Error::InvalidSpec(format!(
            "`{}` is not a SHA-256 in hex",
            b.sha256
        )));
    }
    // The URL goes in single quotes: any quote in it is closed, escaped
    // and reopened.
    let url = b.tools_url.replace('\'', r"'\''");
    let args = b.args.join(" ");
    let hand_over = match &b.hand_over_url {
        Some(u) => format!(
            "(umask 077; printf '%s\\n' '{}' > \"$root{HAND_OVER_URL_FILE}\")\n",
            u.replace('\'', r"'\''")
        ),
        None => String::new(),
    };
    Ok(format!(
        r#"#!/bin/sh
# jujube: install one of this environment's controllers.
set -eu
root=${{JUJUBE_ROOT:-}}
url='{url}'
sha256='{sha}'
bin="$root/usr/local/bin"
mkdir -p "$bin" "$root/var/lib/jujube" "$root/var/log"
{hand_over}tmp="$bin/.jujube.download"
n=0
until curl -fsS -o "$tmp" "$url"; do
  n=$((n + 1))
  if [ "$n" -ge 60 ]; then
    echo "jujube: cannot fetch the controller's binary from the environment's storage (its URL may have expired); giving up" >&2
    exit 1
  fi
  echo "jujube: cannot fetch the controller's binary yet; retrying" >&2
  sleep 5
done
got=$(sha256sum "$tmp" | cut -d' ' -f1)
if [ "$got" != "$sha256" ]; then
  rm -f "$tmp"
  echo "jujube: refused the controller's binary: its SHA-256 is $got, not $sha256" >&2
  exit 1
fi
chmod 755 "$tmp"
mv "$tmp" "$bin/jujube"
if [ -z "$root" ] && command -v systemctl >/dev/null 2>&1; then
{unit}else
  # A non-interactive shell's background job outlives it (no SIGHUP).
  "$bin/jujube" {args} </dev/null >>"$root/var/log/jujube-controller.log" 2>&1 &
fi
"#,
        sha = b.sha256.to_ascii_lowercase(),
        unit = systemd_service("jujube-controller", "jujube controller", &args),
    ))
}

/// Boot script lines that install and start `/usr/local/bin/jujube ARGS`
/// as the systemd service `name`, restarted whenever it stops.
fn systemd_service(name: &str, description: &str, args: &str) -> String {
    format!(
        r#"  cat > /etc/systemd/system/{name}.service <<'UNIT'
[Unit]
Description={description}
After=network-online.target

[Service]
ExecStart=/usr/local/bin/jujube {args}
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
UNIT
  systemctl daemon-reload
  systemctl enable --now {name}.service
"#
    )
}

/// The API path the binary is served at (the API server's).
pub const TOOLS_PATH: &str = "/v1/tools/jujube";

impl std::fmt::Debug for AgentInstall {
    /// Never the configuration: it holds the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentInstall")
            .field("binary", &self.binary)
            .field("api_connect", &self.api_connect)
            .field("enrollment", &self.enrollment.as_ref().map(|_| "<hidden>"))
            .field("controller", &self.controller)
            .finish_non_exhaustive()
    }
}

impl StartSpec {
    /// The tags an instance for this spec carries in environment
    /// `env_name` / `env_uuid`.
    pub fn tags(&self, env_name: &str, env_uuid: &str) -> BTreeMap<String, String> {
        let mut t = BTreeMap::new();
        t.insert(TAG_ENV_UUID.to_string(), env_uuid.to_string());
        if let Some((batch, _)) = launch_batch(&self.nonce) {
            t.insert(TAG_BATCH.to_string(), batch.to_string());
        }
        t.insert(TAG_MACHINE_ID.to_string(), self.machine_id.clone());
        t.insert(TAG_NONCE.to_string(), self.nonce.clone());
        t.insert(
            TAG_NAME.to_string(),
            format!("jujube-{env_name}-{}", self.machine_id),
        );
        if self.controller {
            t.insert(TAG_CONTROLLER.to_string(), "true".to_string());
        }
        t
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub id: String,
    /// Shared: a listing of 100,000 instances names a handful of zones and
    /// instance types, and a copy each was a fifth of the listing.
    pub zone: Option<Arc<str>>,
    /// What the instance has, as constraints (`arch cores mem root-disk
    /// instance-type ...`).
    pub hardware: Arc<str>,
    pub tags: Tags,
}

/// An instance's tags, sorted by key, kept as one shared string (`key \x1f
/// value \x1e` each, jujube's own keys as one character each: see
/// `KNOWN_KEYS`). A listing of 100,000 instances with a `BTreeMap` each
/// held a 550-byte tree node and ten strings per instance; these are one
/// allocation the size of the text, and a clone (the dummy's listings) is a
/// reference count. Serialised as a map.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tags(std::sync::Arc<str>);

impl Tags {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The bytes its text takes.
    #[cfg(test)]
    fn text_len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0
            .split('\x1e')
            .filter_map(|kv| kv.split_once('\x1f'))
            .map(|(k, v)| (decode_key(k), v))
    }
}

/// The tag keys every instance jujube starts carries, stored as one
/// character each (`\x01` for the first): a third of each instance's tag
/// text, 100,000 times over in the dummy cloud.
const KNOWN_KEYS: [&str; 6] = [
    TAG_ENV_UUID,
    TAG_MACHINE_ID,
    TAG_NONCE,
    TAG_CONTROLLER,
    TAG_NAME,
    TAG_BATCH,
];

fn encode_key(k: &str) -> Option<char> {
    let i = KNOWN_KEYS.iter().position(|known| *known == k)?;
    Some(char::from(i as u8 + 1))
}

fn decode_key(k: &str) -> &str {
    match k.as_bytes() {
        [b @ 1..=6] => KNOWN_KEYS[usize::from(*b - 1)],
        _ => k,
    }
}

impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for Tags {
    /// Sorted by key, the last value of a repeated key kept. The separators
    /// and the known keys' codes are control characters no cloud allows in
    /// a tag; they become spaces.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Tags {
        let sorted: BTreeMap<String, String> = iter
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string()))
            .collect();
        let clean = |s: &str| {
            s.replace(
                [
                    '\x1e', '\x1f', '\x01', '\x02', '\x03', '\x04', '\x05', '\x06',
                ],
                " ",
            )
        };
        let mut text = String::new();
        for (k, v) in &sorted {
            match encode_key(k) {
                Some(code) => text.push(code),
                None => text.push_str(&clean(k)),
            }
            text.push('\x1f');
            text.push_str(&clean(v));
            text.push('\x1e');
        }
        Tags(text.into())
    }
}

impl From<BTreeMap<String, String>> for Tags {
    fn from(m: BTreeMap<String, String>) -> Tags {
        m.into_iter().collect()
    }
}

impl std::fmt::Debug for Tags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Tags {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Tags {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Tags, D::Error> {
        BTreeMap::<String, String>::deserialize(d).map(Tags::from)
    }
}

impl Instance {
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key)
    }
    pub fn machine_id(&self) -> Option<&str> {
        self.tag(TAG_MACHINE_ID)
    }
    /// The start's nonce. Providers report it for a batch-launched instance
    /// (as `<batch>/<launch index>`) even before its per-machine tags are
    /// applied.
    pub fn nonce(&self) -> Option<&str> {
        self.tag(TAG_NONCE)
    }
    /// True when the tags prove the instance belongs to `env_uuid`.
    pub fn owned_by(&self, env_uuid: &str) -> bool {
        self.tag(TAG_ENV_UUID) == Some(env_uuid)
    }
}

/// The class of a provider error decides what the provisioner does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Throttling, 5xx, a lost response: retry with backoff.
    Transient,
    /// No capacity in a zone: try the next zone.
    Capacity,
    /// An account limit: retrying soon will not help.
    Quota,
    /// No instance type or image matches: the user must change something.
    InvalidSpec,
    /// Credentials missing or rejected.
    Credentials,
    NotFound,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Capacity => "capacity",
            ErrorClass::Quota => "quota",
            ErrorClass::InvalidSpec => "invalid-spec",
            ErrorClass::Credentials => "credentials",
            ErrorClass::NotFound => "not-found",
        }
    }
    pub fn parse(s: &str) -> Option<ErrorClass> {
        use ErrorClass::*;
        [
            Transient,
            Capacity,
            Quota,
            InvalidSpec,
            Credentials,
            NotFound,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("transient provider error: {0}")]
    Transient(String),
    #[error("no capacity in zone `{zone}`: {message}")]
    Capacity { zone: String, message: String },
    #[error("quota exceeded: {0}; stop instances or raise the quota")]
    Quota(String),
    #[error("invalid instance spec: {0}")]
    InvalidSpec(String),
    #[error("credentials rejected: {0}; check the provider credentials")]
    Credentials(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid provider config: {0}")]
    Config(String),
    #[error("provider storage `{path}`: {message}")]
    Storage { path: String, message: String },
    /// An instance's proof of identity did not hold.
    #[error("instance identity refused: {0}")]
    Identity(String),
    /// Something made outside jujube holds on to what it would remove.
    #[error("{0}")]
    InUse(String),
}

impl Error {
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Transient(_) | Error::Storage { .. } => ErrorClass::Transient,
            Error::Capacity { .. } => ErrorClass::Capacity,
            Error::Quota(_) => ErrorClass::Quota,
            Error::InvalidSpec(_) | Error::Config(_) | Error::InUse(_) => ErrorClass::InvalidSpec,
            Error::Credentials(_) | Error::Identity(_) => ErrorClass::Credentials,
            Error::NotFound(_) => ErrorClass::NotFound,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Refuses constraint keys provider `kind` cannot honour at all, without
/// asking the cloud (whether an instance fits is
/// [`Provider::validate_constraints`]'s question). Commands that record
/// constraints call it first, so a refusal changes nothing.
pub fn check_supported(kind: &str, cons: &Constraints) -> Result<()> {
    match kind {
        #[cfg(feature = "lxd")]
        "lxd" => lxd::check_supported(cons),
        #[cfg(feature = "ec2")]
        "ec2" => ec2::check_supported(cons),
        _ => Ok(()),
    }
}

/// A cloud. Every method is safe to call concurrently and to retry.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// `dummy`, `ec2` or `lxd`.
    fn kind(&self) -> &'static str;

    /// Starts an instance for a machine, tagged with the environment's full
    /// UUID, the machine id and the nonce, and returns it.
    ///
    /// Guarantee: idempotent per nonce. Starting again with a nonce that
    /// already started an instance (even if the first call reported a
    /// failure after the instance was made) returns that instance and starts
    /// nothing. Errors are classified ([`Error::class`]).
    async fn start_instance(&self, spec: &StartSpec) -> Result<Instance>;

    /// Starts several instances, one result per spec in order. The same
    /// guarantees as [`Provider::start_instance`] per spec. Specs whose
    /// nonces name one launch batch ([`launch_batch`]) share series,
    /// constraints and zone: providers whose API launches several instances
    /// per request override this to launch each batch in one request (and to
    /// adopt, by launch index, what an earlier request for the batch
    /// launched); the default makes one call per spec.
    async fn start_instances(&self, specs: &[StartSpec]) -> Vec<Result<Instance>> {
        let mut out = Vec::with_capacity(specs.len());
        for s in specs {
            out.push(self.start_instance(s).await);
        }
        out
    }

    /// How many machines one [`Provider::start_instances`] call should
    /// carry when the environment config does not say
    /// (`provisioner-batch`). Clouds whose API launches many instances per
    /// request want large batches; a cloud that makes one call per instance
    /// wants 1, so that each start is recorded as soon as it is done.
    fn preferred_batch(&self) -> usize {
        64
    }

    /// Stops (terminates) instances. Idempotent: ids that are unknown or
    /// already stopped are fine. Never stops an instance whose tags do not
    /// carry this environment's UUID.
    async fn stop_instances(&self, ids: &[String]) -> Result<()>;

    /// Stops stray instances as they were listed: like
    /// [`Provider::stop_instances`], but each only while it is still the
    /// instance that was listed (same nonce). Where an id is never reused
    /// (EC2, the dummy) the id says so and this is `stop_instances`; a
    /// provider whose ids are names that a new start reuses (LXD names a
    /// container after its machine) checks the nonce right before deleting,
    /// so that a retry's new instance is never taken for the old stray.
    async fn reap_instances(&self, listed: &[Instance]) -> Result<()> {
        let ids: Vec<String> = listed.iter().map(|i| i.id.clone()).collect();
        self.stop_instances(&ids).await
    }

    /// This environment's live instances: only those whose tags prove
    /// ownership. May lag behind starts and stops on eventually consistent
    /// clouds.
    async fn instances(&self) -> Result<Vec<Instance>>;

    /// Looks instances up by id; ids that do not exist (or are not this
    /// environment's) are simply absent from the result.
    async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<Instance>>;

    /// Zones instances can be started in, in preference order.
    async fn zones(&self) -> Result<Vec<String>>;

    /// Checks that some instance could satisfy the constraints; an
    /// [`Error::InvalidSpec`] says why not.
    async fn validate_constraints(&self, cons: &Constraints) -> Result<()>;

    /// Applies changed environment config (a running controller calls this
    /// when `set-environment` changes it).
    async fn update_config(&self, _config: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    /// Deletes what the provider made for the environment as a whole (e.g.
    /// a security group), once its instances are stopped. Idempotent.
    async fn destroy_environment(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
