//! The EC2 provider (feature `ec2`): aws-sdk-ec2 with the default credential
//! chain (environment, profiles, SSO), the region from environment config
//! (`region`) or AWS conventions, and an `endpoint` for LocalStack or another
//! EC2 API.
//!
//! - **Launch** a batch in one RunInstances: the machines whose nonces name
//!   one launch batch (`<batch>/<index>`, committed before the call; see
//!   [`crate::launch_batch`]) share series, constraints and zone, so one
//!   request with MinCount = MaxCount = the batch's size launches them all or
//!   none. `TagSpecifications` applies the ownership tags (the environment's
//!   full UUID and the batch id) atomically with the launch, and `ClientToken`
//!   is the batch id. Instance `k` of the request (`AmiLaunchIndex`) is the
//!   machine whose nonce is `<batch>/k`; the per-machine tags (machine id,
//!   nonce, name) follow with CreateTags, one call per instance, in the
//!   background and paced at CreateTags' documented rate: the machine does not
//!   wait for them, because its instance is already proven its by the batch
//!   tag and the launch index (listings report the nonce of an untagged
//!   batch instance as `<batch>/<launch index>`). A plain nonce is a launch of
//!   one, with every tag in `TagSpecifications` and the nonce as ClientToken.
//! - **Never two launches for one batch or nonce.** Before launching, the
//!   batch (or nonce) is looked up by tag in every state: that keeps the
//!   guarantee on EC2 emulators that ignore ClientToken (LocalStack does),
//!   while on EC2 ClientToken also covers the window in which a fresh launch
//!   is not yet listed (a retry with the same token, even in another zone,
//!   returns the first launch). A batch that launched is never launched
//!   again: its listed instances are adopted by launch index; a member whose
//!   instance is missing from the listing is retried (eventual consistency),
//!   one whose instance was terminated is an error (`jujube resolved` starts a
//!   new one). RunInstances is never retried inside the SDK: the provisioner
//!   retries it, with the same batch.
//! - **Instance type** from constraints via DescribeInstanceTypes (cached):
//!   the cheapest type that satisfies them by an embedded price table, or the
//!   smallest match when none is priced; `instance-type` is honoured and
//!   validated.
//! - **Image** by series and arch via DescribeImages (Canonical's owner id,
//!   name pattern per series), newest first; config `image-id` overrides.
//! - **Security group** `jujube-<uuid>` per environment, with SSH ingress,
//!   created idempotently and deleted by [`Ec2Provider::destroy_environment`].
//! - **Listing** by tag filter with pagination, excluding terminated and
//!   shutting-down instances; termination in batches, only of instances whose
//!   tags carry the environment's UUID.

pub mod identity;
pub mod profile;
pub mod storage;

use crate::bucket::{ec2_limits, LaunchPacer, TokenBucket};
use crate::{
    batch_nonce, boot_script, launch_batch, Error, ErrorClass, Instance, Provider, Result,
    StartSpec, TAG_BATCH, TAG_CONTROLLER, TAG_ENV_UUID, TAG_NONCE,
};
use async_trait::async_trait;
use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::types::{
    BlockDeviceMapping, EbsBlockDevice, Filter, IamInstanceProfileSpecification, InstanceStateName,
    InstanceType, IpPermission, IpRange, Placement, ResourceType, Tag, TagSpecification,
    UserIdGroupPair,
};
use aws_sdk_ec2::Client;
use base64::Engine;
use jujube_core::Constraints;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;
use tracing::warn;

/// Canonical's account: the only owner whose Ubuntu images are used.
pub const CANONICAL: &str = "099720109477";
const LIVE_STATES: [&str; 4] = ["pending", "running", "stopping", "stopped"];

/// A customisation of the SDK client (tests add fault-injecting interceptors).
pub type Customize =
    Box<dyn FnOnce(aws_sdk_ec2::config::Builder) -> aws_sdk_ec2::config::Builder + Send>;

#[derive(Debug, Clone)]
struct TypeInfo {
    name: String,
    vcpus: u64,
    mem: u64,
    arches: Vec<String>,
}

/// On-demand prices (USD/hour, us-east-1) of common types: enough to prefer
/// the cheap families; anything unlisted ranks after every listed match.
const PRICES: &[(&str, f64)] = &[
    ("t3.nano", 0.0052),
    ("t3.micro", 0.0104),
    ("t3.small", 0.0208),
    ("t3.medium", 0.0416),
    ("t3.large", 0.0832),
    ("t3.xlarge", 0.1664),
    ("t3.2xlarge", 0.3328),
    ("t4g.nano", 0.0042),
    ("t4g.micro", 0.0084),
    ("t4g.small", 0.0168),
    ("t4g.medium", 0.0336),
    ("t4g.large", 0.0672),
    ("t4g.xlarge", 0.1344),
    ("t4g.2xlarge", 0.2688),
    ("m5.large", 0.096),
    ("m5.xlarge", 0.192),
    ("m5.2xlarge", 0.384),
    ("m5.4xlarge", 0.768),
    ("m5.8xlarge", 1.536),
    ("m5.12xlarge", 2.304),
    ("m5.16xlarge", 3.072),
    ("m5.24xlarge", 4.608),
    ("m6g.large", 0.077),
    ("m6g.xlarge", 0.154),
    ("m6g.2xlarge", 0.308),
    ("m6g.4xlarge", 0.616),
    ("m6g.8xlarge", 1.232),
    ("m6g.12xlarge", 1.848),
    ("m6g.16xlarge", 2.464),
    ("c5.large", 0.085),
    ("c5.xlarge", 0.17),
    ("c5.2xlarge", 0.34),
    ("c5.4xlarge", 0.68),
    ("c5.9xlarge", 1.53),
    ("c5.12xlarge", 2.04),
    ("c5.18xlarge", 3.06),
    ("c5.24xlarge", 4.08),
    ("r5.large", 0.126),
    ("r5.xlarge", 0.252),
    ("r5.2xlarge", 0.504),
    ("r5.4xlarge", 1.008),
    ("r5.8xlarge", 2.016),
    ("r5.12xlarge", 3.024),
    ("r5.16xlarge", 4.032),
    ("r5.24xlarge", 6.048),
];

fn price(name: &str) -> Option<f64> {
    PRICES.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
}

fn ec2_arch(arch: &str) -> &str {
    match arch {
        "amd64" => "x86_64",
        "i386" => "i386",
        other => other, // arm64 is arm64 on both sides
    }
}

/// The cheapest (priced) or smallest type satisfying the constraints.
fn choose(types: &[TypeInfo], cons: &Constraints, region: &str) -> Result<TypeInfo> {
    let arch = cons.arch().unwrap_or("amd64");
    if let Some(want) = cons.instance_type() {
        let t = types.iter().find(|t| t.name == want).ok_or_else(|| {
            Error::InvalidSpec(format!(
                "instance type `{want}` does not exist in region `{region}`"
            ))
        })?;
        if !t.arches.iter().any(|a| a == ec2_arch(arch)) {
            return Err(Error::InvalidSpec(format!(
                "instance type `{want}` does not run `{arch}`"
            )));
        }
        return Ok(t.clone());
    }
    let fits = |t: &&TypeInfo| {
        t.arches.iter().any(|a| a == ec2_arch(arch))
            && cons.cores().is_none_or(|c| t.vcpus >= c)
            && cons.cpu_power().is_none_or(|p| t.vcpus * 100 >= p)
            && cons.mem().is_none_or(|m| t.mem >= m)
    };
    let mut matches: Vec<&TypeInfo> = types.iter().filter(fits).collect();
    matches.sort_by(|a, b| {
        let key = |t: &TypeInfo| {
            (
                price(&t.name).is_none(),
                price(&t.name).unwrap_or(0.0),
                t.vcpus,
                t.mem,
            )
        };
        key(a)
            .partial_cmp(&key(b))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.name.cmp(&b.name))
    });
    matches.first().map(|t| (*t).clone()).ok_or_else(|| {
        Error::InvalidSpec(format!(
            "no instance type in region `{region}` satisfies `{cons}`"
        ))
    })
}

fn classify<E, R>(e: SdkError<E, R>, zone: Option<&str>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    classify_in(e, "EC2", None, zone)
}

/// An AWS error (EC2's, S3's, IAM's: they share the common codes) to its
/// class, its text led by `what` was asked of.
fn ec2_code<E, R>(e: SdkError<E, R>, what: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    classify_in(e, what, Some(what), None)
}

/// `what` names the service in transport errors; `lead`, when given, leads
/// the text of a service's own error too.
fn classify_in<E, R>(e: SdkError<E, R>, what: &str, lead: Option<&str>, zone: Option<&str>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    match &e {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("").to_string();
            let msg = se.err().message().unwrap_or("").to_string();
            let err = classify_code(&code, &msg, zone);
            let Some(lead) = lead else { return err };
            match err {
                Error::Transient(t) => Error::Transient(format!("{lead}: {t}")),
                Error::Quota(t) => Error::Quota(format!("{lead}: {t}")),
                Error::InvalidSpec(t) => Error::InvalidSpec(format!("{lead}: {t}")),
                Error::Credentials(t) => Error::Credentials(format!("{lead}: {t}")),
                Error::NotFound(t) => Error::NotFound(format!("{lead}: {t}")),
                err => err,
            }
        }
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            Error::Transient(format!(
                "{what} request failed: {}",
                aws_smithy_types::error::display::DisplayErrorContext(&e)
            ))
        }
        _ => Error::InvalidSpec(format!(
            "{what} request could not be made: {}",
            aws_smithy_types::error::display::DisplayErrorContext(&e)
        )),
    }
}

/// EC2 error codes to classes.
pub fn classify_code(code: &str, msg: &str, zone: Option<&str>) -> Error {
    let text = if msg.is_empty() {
        code.to_string()
    } else {
        format!("{code}: {msg}")
    };
    match code {
        "RequestLimitExceeded"
        | "Throttling"
        | "ThrottlingException"
        | "InternalError"
        | "InternalFailure"
        | "ServiceUnavailable"
        | "Unavailable"
        | "RequestTimeout"
        // A launch with this ClientToken (the batch id) already succeeded
        // with other parameters (a member left the batch since): it is found
        // by its tag on the next look.
        | "IdempotentParameterMismatch" => Error::Transient(text),
        // `Unsupported`: the instance type is not offered in this zone. Like
        // a capacity shortage, another zone may have it (Juju moves on too).
        "InsufficientInstanceCapacity"
        | "InsufficientCapacity"
        | "InsufficientHostCapacity"
        | "Unsupported" => Error::Capacity {
            zone: zone.unwrap_or("").to_string(),
            message: text,
        },
        "InstanceLimitExceeded"
        | "VcpuLimitExceeded"
        | "MaxSpotInstanceCountExceeded"
        | "ResourceLimitExceeded" => Error::Quota(text),
        "AuthFailure"
        | "UnauthorizedOperation"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "OptInRequired"
        | "Blocked"
        | "ExpiredToken" => Error::Credentials(text),
        c if c.starts_with("InvalidInstanceID.NotFound") => Error::NotFound(text),
        // A new instance profile takes seconds to reach EC2 (IAM is
        // eventually consistent): the launch is retried, not refused.
        "InvalidParameterValue" if msg.contains("iamInstanceProfile") => Error::Transient(text),
        _ => Error::InvalidSpec(text),
    }
}

fn filter(name: &str, values: impl IntoIterator<Item = impl Into<String>>) -> Filter {
    Filter::builder()
        .name(name)
        .set_values(Some(values.into_iter().map(Into::into).collect()))
        .build()
}

fn tags_of(i: &aws_sdk_ec2::types::Instance) -> BTreeMap<String, String> {
    i.tags()
        .iter()
        .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or("").to_string())))
        .collect()
}

pub struct Ec2Provider {
    client: Client,
    region: String,
    env_name: String,
    env_uuid: String,
    image_override: Mutex<Option<String>>,
    types: OnceCell<Vec<TypeInfo>>,
    images: Mutex<HashMap<(String, String), (String, String)>>,
    group: OnceCell<String>,
    /// Paces the per-machine CreateTags calls of batch launches.
    tagger: Arc<tokio::sync::Mutex<TokenBucket>>,
    /// Paces launches at RunInstances' documented request and resource
    /// rates, so that past the burst a launch waits for its tokens instead
    /// of being throttled (and retried, and counted against the
    /// provisioner's patience). Another client of the account can still
    /// make EC2 throttle us; the provisioner retries that.
    launch_pacer: LaunchPacer,
    /// The environment's control bucket and the controller's IAM role and
    /// profile: made by bootstrap, removed by `destroy-environment`.
    s3: aws_sdk_s3::Client,
    iam: aws_sdk_iam::Client,
    bucket: String,
    /// How a controller's instance (machine 0) boots: set by bootstrap.
    controller_launch: Mutex<Option<ControllerLaunch>>,
    /// Where its credentials come from (see
    /// [`Ec2Provider::current_credentials`]).
    credentials: Option<aws_sdk_ec2::config::SharedCredentialsProvider>,
}

/// Cloud credentials as they are handed to machine 0's controller when the
/// user says so (`controller-credentials=hand-over`) and kept there, the
/// owner's alone. Never shown: its `Debug` names the key id only.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct HandedCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token: Option<String>,
    /// When temporary credentials expire (seconds since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<u64>,
}

impl std::fmt::Debug for HandedCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandedCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("expires", &self.expires)
            .finish_non_exhaustive()
    }
}

impl HandedCredentials {
    /// As the SDK takes them.
    pub fn to_sdk(&self) -> aws_sdk_ec2::config::Credentials {
        aws_sdk_ec2::config::Credentials::new(
            self.access_key_id.clone(),
            self.secret_access_key.clone(),
            self.session_token.clone(),
            self.expires
                .map(|s| std::time::UNIX_EPOCH + std::time::Duration::from_secs(s)),
            "jujube-handed-over",
        )
    }
}

/// How machine 0's instance boots: the user data that installs the
/// controller ([`crate::controller_boot_script`]) and the instance profile
/// whose role gives it its cloud credentials (`None`: no profile; the
/// controller's credentials come another way).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerLaunch {
    pub user_data: String,
    pub instance_profile: Option<String>,
}

/// An instance's IP addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addresses {
    pub public: Option<String>,
    pub private: Option<String>,
}

/// The addresses of the instance this runs on, from its metadata service
/// (`AWS_EC2_METADATA_SERVICE_ENDPOINT` says where it is, as for the SDK's
/// credentials): what a controller on it is reached at. One it does not
/// give (an instance without a public address), or does not give within
/// `within`, is `None`.
pub async fn own_addresses(within: std::time::Duration) -> Addresses {
    let imds = aws_config::imds::Client::builder().build();
    let get = |path: &'static str| {
        let imds = imds.clone();
        async move {
            match tokio::time::timeout(within, imds.get(path)).await {
                Ok(Ok(a)) => {
                    let a: String = a.into();
                    let a = a.trim().to_string();
                    a.parse::<std::net::IpAddr>().is_ok().then_some(a)
                }
                _ => None,
            }
        }
    };
    Addresses {
        public: get("/latest/meta-data/public-ipv4").await,
        private: get("/latest/meta-data/local-ipv4").await,
    }
}

/// User data shared by a batch's instances: which launch index is which
/// machine (an agent reads its `ami-launch-index` from instance metadata).
/// With agents to install, it is the batch's boot script ([`boot_script`]:
/// one enrollment token for the batch, no secret).
fn batch_user_data(batch: &str, specs: &[&StartSpec], count: u32) -> String {
    if let Some(e) = specs[0].agent.as_ref().and_then(|a| a.enrollment.as_ref()) {
        return boot_script(e);
    }
    let mut s = format!("#cloud-config\n# jujube launch batch {batch}, {count} instance(s)\n");
    for sp in specs {
        let k = launch_batch(&sp.nonce).map_or(0, |(_, k)| k);
        s.push_str(&format!(
            "# instance {k}: machine {} nonce {}\n",
            sp.machine_id, sp.nonce
        ));
    }
    s
}

impl Ec2Provider {
    /// Builds the client from environment config: `region`, `endpoint`,
    /// `image-id`. Credentials come from the default chain.
    pub async fn new(
        env_name: &str,
        env_uuid: &str,
        config: &BTreeMap<String, String>,
        customize: Option<Customize>,
    ) -> Result<Ec2Provider> {
        Ec2Provider::new_with(env_name, env_uuid, config, None, customize).await
    }

    /// As [`Ec2Provider::new`], with `credentials` for EC2, S3 and IAM alike
    /// instead of the default chain's.
    pub async fn new_with(
        env_name: &str,
        env_uuid: &str,
        config: &BTreeMap<String, String>,
        credentials: Option<aws_sdk_ec2::config::Credentials>,
        customize: Option<Customize>,
    ) -> Result<Ec2Provider> {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(c) = credentials {
            loader = loader.credentials_provider(c);
        }
        if let Some(r) = config.get("region") {
            loader = loader.region(aws_config::Region::new(r.clone()));
        }
        let shared = loader.load().await;
        let credentials = shared.credentials_provider();
        let region = shared
            .region()
            .map(|r| r.to_string())
            .ok_or_else(|| Error::Config("no AWS region: set `region` in the environment config (e.g. `--config region=us-east-1`) or AWS_REGION".into()))?;
        let mut b = aws_sdk_ec2::config::Builder::from(&shared);
        let mut s3 = aws_sdk_s3::config::Builder::from(&shared);
        let mut iam = aws_sdk_iam::config::Builder::from(&shared);
        if let Some(ep) = config.get("endpoint") {
            b = b.endpoint_url(ep);
            // An emulator answers on one host: buckets in the path.
            s3 = s3.endpoint_url(ep).force_path_style(true);
            iam = iam.endpoint_url(ep);
        }
        if let Some(f) = customize {
            b = f(b);
        }
        let ec2 = b.build();
        let bucket = storage::bucket_name(env_uuid, config);
        storage::validate_bucket_name(&bucket)?;
        Ok(Ec2Provider {
            s3: aws_sdk_s3::Client::from_conf(s3.build()),
            iam: aws_sdk_iam::Client::from_conf(iam.build()),
            bucket,
            controller_launch: Mutex::new(None),
            credentials,
            client: Client::from_conf(ec2),
            region,
            env_name: env_name.to_string(),
            env_uuid: env_uuid.to_string(),
            image_override: Mutex::new(config.get("image-id").cloned()),
            types: OnceCell::new(),
            images: Mutex::new(HashMap::new()),
            group: OnceCell::new(),
            tagger: Arc::new(tokio::sync::Mutex::new(TokenBucket::new(
                ec2_limits::CREATE_TAGS.0,
                ec2_limits::CREATE_TAGS.1,
            ))),
            launch_pacer: LaunchPacer::ec2(),
        })
    }

    /// Of `ids`, this environment's instances that have not terminated
    /// yet: live ones and those still shutting down (whose processes may
    /// still run), which [`Provider::instances_by_id`] leaves out.
    pub async fn not_terminated(&self, ids: &[String]) -> Result<Vec<String>> {
        if ids.is_empty() {
            return Ok(vec![]);
        }
        let states = LIVE_STATES.iter().copied().chain(["shutting-down"]);
        let filters = vec![
            filter("instance-id", ids.to_vec()),
            filter("instance-state-name", states),
        ];
        Ok(self
            .describe_raw(filters, false)
            .await?
            .into_iter()
            .map(|(_, _, i)| i.id)
            .collect())
    }

    pub fn region(&self) -> &str {
        &self.region
    }

    /// The credentials this provider acts with now, as its chain resolves
    /// them (what `bootstrap` hands machine 0 when told to).
    pub async fn current_credentials(&self) -> Result<HandedCredentials> {
        use aws_sdk_ec2::config::ProvideCredentials;
        let none = || {
            Error::Config(
                "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile"
                    .into(),
            )
        };
        let c = self
            .credentials
            .as_ref()
            .ok_or_else(none)?
            .provide_credentials()
            .await
            .map_err(|e| Error::Config(format!("cannot resolve the AWS credentials: {e}")))?;
        Ok(HandedCredentials {
            access_key_id: c.access_key_id().to_string(),
            secret_access_key: c.secret_access_key().to_string(),
            session_token: c.session_token().map(str::to_string),
            expires: c
                .expiry()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_secs()),
        })
    }

    /// The environment's control bucket (`control-bucket`, or
    /// `jujube-<uuid>`).
    pub fn control_bucket(&self) -> storage::ControlBucket {
        storage::ControlBucket::new(
            self.s3.clone(),
            self.bucket.clone(),
            &self.region,
            &self.env_uuid,
        )
    }

    /// Machine 0's instance boots so from now on (see
    /// [`ControllerLaunch`]); other machines' do not change.
    pub fn launch_controller_with(&self, launch: ControllerLaunch) {
        *self
            .controller_launch
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(launch);
    }

    fn controller_launch(&self, spec: &StartSpec) -> Option<ControllerLaunch> {
        spec.controller
            .then(|| {
                self.controller_launch
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
            })
            .flatten()
    }

    /// The user data of a controller machine taken up from the control
    /// bucket (`enable-ha`): the binary (`binary`, put there under its
    /// SHA-256, once) by a presigned URL, then `jujube ARGS`.
    async fn controller_boot(
        &self,
        t: &crate::TakeUpInstall,
        binary: &std::path::Path,
    ) -> Result<String> {
        let bucket = self.control_bucket();
        let bytes = std::fs::read(binary)
            .map_err(|e| Error::Config(format!("cannot read `{}`: {e}", binary.display())))?;
        let tools = bucket.put_tools(bytes).await?;
        let url = bucket
            .presign(
                &tools.key,
                std::time::SystemTime::now(),
                storage::TOOLS_URL_LIFETIME,
            )
            .await?;
        crate::controller_boot_script(&crate::ControllerBoot {
            tools_url: url,
            sha256: tools.sha256,
            args: t.args.clone(),
            hand_over_url: None,
        })
    }

    /// The instances that are this environment's controllers (tagged so),
    /// live or still shutting down.
    pub async fn controller_instances(&self) -> Result<Vec<String>> {
        let states = LIVE_STATES.iter().copied().chain(["shutting-down"]);
        Ok(self
            .describe_raw(
                vec![
                    filter(&format!("tag:{TAG_CONTROLLER}"), ["true".to_string()]),
                    filter("instance-state-name", states),
                ],
                false,
            )
            .await?
            .into_iter()
            .map(|(_, _, i)| i.id)
            .collect())
    }

    /// The controller's IAM role and instance profile.
    pub fn controller_profile(&self) -> profile::ControllerProfile {
        profile::ControllerProfile::new(self.iam.clone(), &self.env_uuid)
    }

    /// Opens TCP `port` in the environment's security group to `cidr` (the
    /// controller's API, to the addresses its users come from) and to the
    /// group's own instances, whatever `cidr` is (agents and other
    /// controllers reach it over the cloud's network). Opening it twice is
    /// no error.
    pub async fn open_port(&self, port: u16, cidr: &str) -> Result<()> {
        let group = self.security_group().await?;
        let rule = || {
            IpPermission::builder()
                .ip_protocol("tcp")
                .from_port(i32::from(port))
                .to_port(i32::from(port))
        };
        for permission in [
            rule()
                .ip_ranges(IpRange::builder().cidr_ip(cidr).build())
                .build(),
            rule()
                .user_id_group_pairs(UserIdGroupPair::builder().group_id(group).build())
                .build(),
        ] {
            self.authorize(group, permission).await?;
        }
        Ok(())
    }

    /// Adds ingress `permission` to security group `group`; one it has
    /// already is no error.
    async fn authorize(&self, group: &str, permission: IpPermission) -> Result<()> {
        let auth = self
            .client
            .authorize_security_group_ingress()
            .group_id(group)
            .ip_permissions(permission)
            .send()
            .await;
        match auth {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("InvalidPermission.Duplicate") => Ok(()),
            Err(e) => Err(classify(e, None)),
        }
    }

    /// Deletes the environment's security group once no instance uses it
    /// (EC2 refuses while terminating instances still do: a minute at most).
    /// Deletes the environment's security group; whether there was one.
    async fn delete_group(&self) -> Result<bool> {
        let Some(id) = self.find_group().await? else {
            return Ok(false);
        };
        for attempt in 0..20 {
            match self
                .client
                .delete_security_group()
                .group_id(&id)
                .send()
                .await
            {
                Ok(_) => return Ok(true),
                Err(e) if e.code() == Some("InvalidGroup.NotFound") => return Ok(false),
                Err(e) if e.code() == Some("DependencyViolation") && attempt < 19 => {
                    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
                }
                Err(e) => return Err(classify(e, None)),
            }
        }
        Ok(false)
    }

    /// Removes what the environment holds besides instances: its security
    /// group, its control bucket (every object in it), and the
    /// controller's instance profile and role, each if it is there (so a
    /// run after a partial failure finishes the job). Says what it removed.
    pub async fn remove_environment_resources(&self) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        if self.delete_group().await? {
            removed.push(format!("the security group `jujube-{}`", self.env_uuid));
        }
        let bucket = self.control_bucket().destroy().await?;
        if bucket.bucket {
            removed.push(format!(
                "the S3 bucket `{}` ({} object(s))",
                self.bucket, bucket.objects
            ));
        }
        let profile = self.controller_profile();
        let gone = profile.destroy().await?;
        if gone.profile {
            removed.push(format!("the IAM instance profile `{}`", profile.name()));
        }
        if gone.role {
            removed.push(format!("the IAM role `{}`", profile.name()));
        }
        Ok(removed)
    }

    /// An instance's addresses, public first (either may be missing), if it
    /// is this environment's and live.
    pub async fn addresses(&self, instance_id: &str) -> Result<Addresses> {
        let r = self
            .client
            .describe_instances()
            .instance_ids(instance_id)
            .send()
            .await;
        let missing =
            || Error::NotFound(format!("no instance `{instance_id}` of this environment"));
        let r = match r {
            Ok(r) => r,
            Err(e) if e.code().is_some_and(|c| c.starts_with("InvalidInstanceID")) => {
                return Err(missing())
            }
            Err(e) => return Err(classify(e, None)),
        };
        let inst = r
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .find(|i| {
                i.instance_id() == Some(instance_id)
                    && tags_of(i).get(TAG_ENV_UUID) == Some(&self.env_uuid)
            })
            .ok_or_else(missing)?;
        Ok(Addresses {
            public: inst.public_ip_address().map(str::to_string),
            private: inst.private_ip_address().map(str::to_string),
        })
    }

    async fn instance_types(&self) -> Result<&Vec<TypeInfo>> {
        self.types
            .get_or_try_init(|| async {
                let mut out = Vec::new();
                let mut token: Option<String> = None;
                loop {
                    let r = self
                        .client
                        .describe_instance_types()
                        .set_next_token(token.clone())
                        .send()
                        .await
                        .map_err(|e| classify(e, None))?;
                    for t in r.instance_types() {
                        let Some(name) = t.instance_type().map(|n| n.as_str().to_string()) else {
                            continue;
                        };
                        out.push(TypeInfo {
                            name,
                            vcpus: t.v_cpu_info().and_then(|v| v.default_v_cpus()).unwrap_or(0)
                                as u64,
                            mem: t.memory_info().and_then(|m| m.size_in_mib()).unwrap_or(0) as u64,
                            arches: t
                                .processor_info()
                                .map(|p| {
                                    p.supported_architectures()
                                        .iter()
                                        .map(|a| a.as_str().to_string())
                                        .collect()
                                })
                                .unwrap_or_default(),
                        });
                    }
                    token = r.next_token().map(str::to_string);
                    if token.is_none() {
                        break;
                    }
                }
                Ok(out)
            })
            .await
    }

    /// The newest Canonical image for a series and arch: (id, root device).
    async fn image(&self, series: &str, arch: &str) -> Result<(String, String)> {
        if let Some(id) = self
            .image_override
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Ok((id, "/dev/sda1".to_string()));
        }
        let key = (series.to_string(), arch.to_string());
        if let Some(hit) = self
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(hit.clone());
        }
        let r = self
            .client
            .describe_images()
            .owners(CANONICAL)
            .filters(filter(
                "name",
                [format!("ubuntu/images/*ubuntu-{series}-*-{arch}-server-*")],
            ))
            .filters(filter("architecture", [ec2_arch(arch)]))
            .filters(filter("state", ["available"]))
            .send()
            .await
            .map_err(|e| classify(e, None))?;
        let mut images: Vec<_> = r
            .images()
            .iter()
            .filter(|i| i.owner_id() == Some(CANONICAL))
            .filter_map(|i| {
                Some((
                    i.creation_date().unwrap_or("").to_string(),
                    i.name().unwrap_or("").to_string(),
                    i.image_id()?.to_string(),
                    i.root_device_name().unwrap_or("/dev/sda1").to_string(),
                ))
            })
            .collect();
        images.sort();
        let (_, _, id, root) = images.pop().ok_or_else(|| {
            Error::InvalidSpec(format!(
                "no Ubuntu image for series `{series}` and arch `{arch}` in region `{}`; set `image-id` to use your own",
                self.region
            ))
        })?;
        self.images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, (id.clone(), root.clone()));
        Ok((id, root))
    }

    fn group_name(&self) -> String {
        format!("jujube-{}", self.env_uuid)
    }

    /// The environment's security group, created (with SSH ingress) if
    /// missing. Safe against concurrent creation.
    async fn security_group(&self) -> Result<&String> {
        self.group
            .get_or_try_init(|| async {
                if let Some(id) = self.find_group().await? {
                    return Ok(id);
                }
                let created = self
                    .client
                    .create_security_group()
                    .group_name(self.group_name())
                    .description(format!("jujube environment {}", self.env_name))
                    .tag_specifications(
                        TagSpecification::builder()
                            .resource_type(ResourceType::SecurityGroup)
                            .tags(
                                Tag::builder()
                                    .key(TAG_ENV_UUID)
                                    .value(&self.env_uuid)
                                    .build(),
                            )
                            .build(),
                    )
                    .send()
                    .await;
                let id = match created {
                    Ok(r) => r.group_id().unwrap_or_default().to_string(),
                    Err(e) if e.code() == Some("InvalidGroup.Duplicate") => self
                        .find_group()
                        .await?
                        .ok_or_else(|| Error::Transient("security group vanished".into()))?,
                    Err(e) => return Err(classify(e, None)),
                };
                self.authorize(
                    &id,
                    IpPermission::builder()
                        .ip_protocol("tcp")
                        .from_port(22)
                        .to_port(22)
                        .ip_ranges(IpRange::builder().cidr_ip("0.0.0.0/0").build())
                        .build(),
                )
                .await?;
                Ok(id)
            })
            .await
    }

    async fn find_group(&self) -> Result<Option<String>> {
        let r = self
            .client
            .describe_security_groups()
            .filters(filter("group-name", [self.group_name()]))
            .send()
            .await
            .map_err(|e| classify(e, None))?;
        Ok(r.security_groups()
            .first()
            .and_then(|g| g.group_id())
            .map(str::to_string))
    }

    /// Instances matching filters (plus ownership and liveness), all pages.
    async fn describe(&self, filters: Vec<Filter>) -> Result<Vec<Instance>> {
        Ok(self
            .describe_raw(filters, true)
            .await?
            .into_iter()
            .map(|(_, _, i)| i)
            .collect())
    }

    /// Instances matching filters and proven ours, all pages, with their
    /// launch index and whether they are live; only live ones unless
    /// `live_only` is false.
    async fn describe_raw(
        &self,
        mut filters: Vec<Filter>,
        live_only: bool,
    ) -> Result<Vec<(u32, bool, Instance)>> {
        filters.push(filter(
            &format!("tag:{TAG_ENV_UUID}"),
            [self.env_uuid.clone()],
        ));
        if live_only {
            filters.push(filter("instance-state-name", LIVE_STATES));
        }
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let r = self
                .client
                .describe_instances()
                .set_filters(Some(filters.clone()))
                .set_next_token(token.clone())
                .send()
                .await
                .map_err(|e| classify(e, None))?;
            for res in r.reservations() {
                for i in res.instances() {
                    let live = i.state().and_then(|s| s.name()).is_some_and(|s| {
                        !matches!(
                            s,
                            InstanceStateName::Terminated | InstanceStateName::ShuttingDown
                        )
                    });
                    let tags = tags_of(i);
                    // Never trust a filter alone with ownership.
                    if (live_only && !live) || tags.get(TAG_ENV_UUID) != Some(&self.env_uuid) {
                        continue;
                    }
                    let index = i.ami_launch_index().unwrap_or(0).max(0) as u32;
                    out.push((index, live, self.convert(i, tags, None)));
                }
            }
            token = r.next_token().map(str::to_string);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// The launch request shared by single and batch launches: image, type,
    /// group, zone, root disk, user data and the tags applied atomically.
    async fn run_request(
        &self,
        spec: &StartSpec,
        count: i32,
        token: &str,
        tags: Vec<Tag>,
        user_data: &str,
        instance_profile: Option<String>,
    ) -> Result<aws_sdk_ec2::operation::run_instances::builders::RunInstancesFluentBuilder> {
        let types = self.instance_types().await?;
        let itype = choose(types, &spec.constraints, &self.region)?;
        let arch = spec.constraints.arch().unwrap_or("amd64");
        let (image, root_device) = self.image(&spec.series, arch).await?;
        let group = self.security_group().await?.clone();
        let mut req = self
            .client
            .run_instances()
            .image_id(image)
            .instance_type(InstanceType::from(itype.name.as_str()))
            .min_count(count)
            .max_count(count)
            .client_token(token)
            .security_group_ids(group)
            .user_data(base64::engine::general_purpose::STANDARD.encode(user_data))
            .tag_specifications(
                TagSpecification::builder()
                    .resource_type(ResourceType::Instance)
                    .set_tags(Some(tags.clone()))
                    .build(),
            )
            .tag_specifications(
                TagSpecification::builder()
                    .resource_type(ResourceType::Volume)
                    .set_tags(Some(tags))
                    .build(),
            );
        if let Some(z) = &spec.zone {
            req = req.placement(Placement::builder().availability_zone(z).build());
        }
        if let Some(profile) = instance_profile {
            req = req.iam_instance_profile(
                IamInstanceProfileSpecification::builder()
                    .name(profile)
                    .build(),
            );
        }
        if let Some(mib) = spec.constraints.root_disk() {
            req = req.block_device_mappings(
                BlockDeviceMapping::builder()
                    .device_name(root_device)
                    .ebs(
                        EbsBlockDevice::builder()
                            // Within i32: `check_supported` bounds it.
                            .volume_size(
                                i32::try_from(mib.div_ceil(1024).min(MAX_ROOT_DISK_GIB))
                                    .unwrap_or(i32::MAX),
                            )
                            .delete_on_termination(true)
                            .build(),
                    )
                    .build(),
            );
        }
        Ok(req)
    }

    async fn send_run(
        &self,
        req: aws_sdk_ec2::operation::run_instances::builders::RunInstancesFluentBuilder,
        zone: Option<&str>,
    ) -> Result<aws_sdk_ec2::operation::run_instances::RunInstancesOutput> {
        req.customize()
            .config_override(
                aws_sdk_ec2::config::Builder::default()
                    .retry_config(aws_config::retry::RetryConfig::disabled()),
            )
            .send()
            .await
            .map_err(|e| classify(e, zone))
    }

    /// A launch of one: every tag atomically, the nonce as ClientToken.
    async fn launch_one(&self, spec: &StartSpec) -> Result<Instance> {
        let take_up = spec
            .agent
            .as_ref()
            .and_then(|a| Some((a.controller.as_ref()?.take_up.as_ref()?, &a.binary)));
        // The nonce first: a launch that already happened is returned.
        let existing = self
            .describe_raw(
                vec![filter(&format!("tag:{TAG_NONCE}"), [spec.nonce.clone()])],
                false,
            )
            .await?;
        if let Some((_, _, i)) = existing.iter().find(|(_, live, _)| *live) {
            return Ok(i.clone());
        }
        // A controller's user data differs at each try (a fresh key and
        // URL), so EC2 would refuse the nonce's ClientToken again as a
        // mismatch forever: its instance ended, as a batch's does.
        if let (Some((_, _, gone)), Some(_)) = (existing.first(), take_up) {
            return Err(Error::NotFound(format!(
                "instance `{}` launched for machine {} was terminated before it was recorded; `jujube resolved {}` starts a new one",
                gone.id, spec.machine_id, spec.machine_id
            )));
        }
        let tags: Vec<Tag> = spec
            .tags(&self.env_name, &self.env_uuid)
            .into_iter()
            .map(|(k, v)| Tag::builder().key(k).value(v).build())
            .collect();
        let (user_data, profile) = match (
            self.controller_launch(spec),
            spec.agent.as_ref().and_then(|a| a.enrollment.as_ref()),
            take_up,
        ) {
            (Some(c), _, _) => (c.user_data, c.instance_profile),
            (None, _, Some((t, binary))) => (
                self.controller_boot(t, binary).await?,
                t.instance_profile.clone(),
            ),
            (None, Some(e), None) => (boot_script(e), None),
            (None, None, None) => (spec.user_data.clone(), None),
        };
        let req = self
            .run_request(spec, 1, &spec.nonce, tags, &user_data, profile)
            .await?;
        // A controller's files go in the bucket last, when nothing but the
        // launch itself can fail.
        if let Some((t, _)) = take_up {
            self.control_bucket()
                .put_private(&t.key, t.bundle.clone())
                .await?;
        }
        self.launch_pacer.pace(1).await;
        let r = match self.send_run(req, spec.zone.as_deref()).await {
            Ok(r) => r,
            Err(e) => {
                // Refused: the controller's files would wait in the bucket
                // for no one. (An error that may hide a launch keeps them:
                // the retry adopts that instance, which takes them.)
                if let Some((t, _)) = take_up.filter(|_| e.class() != ErrorClass::Transient) {
                    let _ = self.control_bucket().delete(&t.key).await;
                }
                return Err(e);
            }
        };
        let i = r
            .instances()
            .first()
            .ok_or_else(|| Error::Transient("RunInstances returned no instance".into()))?;
        Ok(self.convert(i, tags_of(i), spec.constraints.root_disk()))
    }

    /// A launch batch in one RunInstances, adopting what an earlier request
    /// for the batch launched. `specs` are the batch's members still to be
    /// started (a member removed since the batch was formed leaves a gap,
    /// whose instance becomes a stray and is reaped).
    async fn launch_many(&self, batch: &str, specs: &[&StartSpec]) -> Vec<Result<Instance>> {
        match self.launch_many_inner(batch, specs).await {
            Ok(v) => v,
            Err(e) => specs.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    async fn launch_many_inner(
        &self,
        batch: &str,
        specs: &[&StartSpec],
    ) -> Result<Vec<Result<Instance>>> {
        let index_of = |s: &StartSpec| launch_batch(&s.nonce).map_or(0, |(_, k)| k);
        let root_disk = specs[0].constraints.root_disk();
        // Every state: a terminated instance of the batch still proves the
        // batch launched, and must not be launched again.
        let listed = self
            .describe_raw(
                vec![filter(&format!("tag:{TAG_BATCH}"), [batch.to_string()])],
                false,
            )
            .await?;
        let launched: Vec<(u32, bool, Instance)> = if listed.is_empty() {
            let count = specs.iter().map(|s| index_of(s)).max().unwrap_or(0) + 1;
            let tags = vec![
                Tag::builder()
                    .key(TAG_ENV_UUID)
                    .value(&self.env_uuid)
                    .build(),
                Tag::builder().key(TAG_BATCH).value(batch).build(),
            ];
            let req = self
                .run_request(
                    specs[0],
                    count as i32,
                    batch,
                    tags,
                    &batch_user_data(batch, specs, count),
                    self.controller_launch(specs[0])
                        .and_then(|l| l.instance_profile),
                )
                .await?;
            self.launch_pacer.pace(count).await;
            let r = self.send_run(req, specs[0].zone.as_deref()).await?;
            let mut out = Vec::new();
            for i in r.instances() {
                let tags = tags_of(i);
                out.push((
                    i.ami_launch_index().unwrap_or(-1) as u32,
                    true,
                    self.convert(i, tags, root_disk),
                ));
            }
            out
        } else {
            listed
        };
        let mut results = Vec::with_capacity(specs.len());
        let mut to_tag = Vec::new();
        for spec in specs {
            let k = index_of(spec);
            match launched.iter().find(|(i, _, _)| *i == k) {
                Some((_, true, inst)) => {
                    let mut inst = inst.clone();
                    let want = spec.tags(&self.env_name, &self.env_uuid);
                    if want.iter().any(|(k, v)| inst.tags.get(k) != Some(v)) {
                        to_tag.push((inst.id.clone(), want.clone()));
                    }
                    inst.tags = want.into();
                    results.push(Ok(inst));
                }
                Some((_, false, inst)) => results.push(Err(Error::NotFound(format!(
                    "instance `{}` launched for machine {} (batch `{batch}`, index {k}) was terminated before it was recorded; `jujube resolved {}` starts a new one",
                    inst.id, spec.machine_id, spec.machine_id
                )))),
                None => results.push(Err(Error::Transient(format!(
                    "launch batch `{batch}` is listed without its instance {k} yet"
                )))),
            }
        }
        if !to_tag.is_empty() {
            self.tag_later(to_tag);
        }
        Ok(results)
    }

    /// Applies per-machine tags in the background, one CreateTags per
    /// instance (their values differ), paced at CreateTags' documented
    /// request rate so that a large batch is not throttled. Nothing depends
    /// on these tags for correctness (see the module docs); a failure is
    /// logged.
    fn tag_later(&self, work: Vec<(String, BTreeMap<String, String>)>) {
        let client = self.client.clone();
        let pacer = self.tagger.clone();
        tokio::spawn(async move {
            for (id, tags) in work {
                let tags: Vec<Tag> = tags
                    .into_iter()
                    .map(|(k, v)| Tag::builder().key(k).value(v).build())
                    .collect();
                let mut attempt = 0;
                loop {
                    loop {
                        let wait = pacer.lock().await.take_or_wait(1);
                        if wait.is_zero() {
                            break;
                        }
                        tokio::time::sleep(wait).await;
                    }
                    let r = client
                        .create_tags()
                        .resources(&id)
                        .set_tags(Some(tags.clone()))
                        .send()
                        .await;
                    match r {
                        Ok(_) => break,
                        Err(e) if attempt < 5 => {
                            attempt += 1;
                            warn!(instance = %id, error = %aws_smithy_types::error::display::DisplayErrorContext(&e), "tagging failed; retrying");
                            tokio::time::sleep(std::time::Duration::from_secs(1 << attempt)).await;
                        }
                        Err(e) => {
                            warn!(instance = %id, error = %aws_smithy_types::error::display::DisplayErrorContext(&e), "giving up tagging the instance with its machine");
                            break;
                        }
                    }
                }
            }
        });
    }

    fn convert(
        &self,
        i: &aws_sdk_ec2::types::Instance,
        tags: BTreeMap<String, String>,
        root_disk: Option<u64>,
    ) -> Instance {
        let arch = match i.architecture().map(|a| a.as_str()) {
            Some("x86_64") => "amd64",
            Some(a) => a,
            None => "amd64",
        };
        let itype = i
            .instance_type()
            .map(|t| t.as_str().to_string())
            .unwrap_or_default();
        let info = self
            .types
            .get()
            .and_then(|ts| ts.iter().find(|t| t.name == itype).cloned());
        let mut hw = format!("arch={arch}");
        if let Some(t) = &info {
            hw.push_str(&format!(" cores={} mem={}M", t.vcpus, t.mem));
        }
        hw.push_str(&format!(" instance-type={itype}"));
        if let Some(d) = root_disk {
            hw.push_str(&format!(" root-disk={d}M"));
        }
        let hardware = Constraints::parse(&hw).map(|c| c.to_string()).unwrap_or(hw);
        let mut tags = tags;
        // A batch instance not yet tagged with its machine: its nonce is
        // its batch and launch index, which is what the machine committed.
        if !tags.contains_key(TAG_NONCE) {
            if let (Some(b), Some(k)) = (tags.get(TAG_BATCH), i.ami_launch_index()) {
                let nonce = batch_nonce(b, k.max(0) as u32);
                tags.insert(TAG_NONCE.to_string(), nonce);
            }
        }
        Instance {
            id: i.instance_id().unwrap_or_default().to_string(),
            zone: i
                .placement()
                .and_then(|p| p.availability_zone())
                .map(Into::into),
            hardware: hardware.into(),
            tags: tags.into(),
        }
    }
}

#[async_trait]
impl Provider for Ec2Provider {
    fn kind(&self) -> &'static str {
        "ec2"
    }

    async fn start_instance(&self, spec: &StartSpec) -> Result<Instance> {
        self.start_instances(std::slice::from_ref(spec))
            .await
            .pop()
            .expect("one result per spec")
    }

    /// One RunInstances per launch batch (see the module docs); specs with
    /// plain nonces are launched one by one.
    async fn start_instances(&self, specs: &[StartSpec]) -> Vec<Result<Instance>> {
        let mut out: Vec<Option<Result<Instance>>> = specs.iter().map(|_| None).collect();
        let mut batches: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            // A controller taken up boots from user data of its own.
            let own_user_data = s
                .agent
                .as_ref()
                .and_then(|a| a.controller.as_ref())
                .is_some_and(|c| c.take_up.is_some());
            match launch_batch(&s.nonce).filter(|_| !own_user_data) {
                Some((b, _)) => match batches.iter_mut().find(|(id, _)| *id == b) {
                    Some((_, members)) => members.push(i),
                    None => batches.push((b, vec![i])),
                },
                None => out[i] = Some(self.launch_one(s).await),
            }
        }
        for (batch, members) in batches {
            let group: Vec<&StartSpec> = members.iter().map(|&i| &specs[i]).collect();
            for (i, r) in members
                .into_iter()
                .zip(self.launch_many(batch, &group).await)
            {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.expect("every spec has a result"))
            .collect()
    }

    async fn stop_instances(&self, ids: &[String]) -> Result<()> {
        for chunk in ids.chunks(200) {
            // Only instances proven ours by their tags are terminated.
            let owned: Vec<String> = self
                .describe(vec![filter("instance-id", chunk.to_vec())])
                .await?
                .into_iter()
                .map(|i| i.id)
                .collect();
            if owned.is_empty() {
                continue;
            }
            match self
                .client
                .terminate_instances()
                .set_instance_ids(Some(owned))
                .send()
                .await
            {
                Ok(_) => {}
                Err(e)
                    if e.code()
                        .is_some_and(|c| c.starts_with("InvalidInstanceID.NotFound")) => {}
                Err(e) => return Err(classify(e, None)),
            }
        }
        Ok(())
    }

    async fn instances(&self) -> Result<Vec<Instance>> {
        self.describe(vec![]).await
    }

    async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<Instance>> {
        if ids.is_empty() {
            return Ok(vec![]);
        }
        self.describe(vec![filter("instance-id", ids.to_vec())])
            .await
    }

    async fn zones(&self) -> Result<Vec<String>> {
        let r = self
            .client
            .describe_availability_zones()
            .filters(filter("state", ["available"]))
            .send()
            .await
            .map_err(|e| classify(e, None))?;
        let mut z: Vec<String> = r
            .availability_zones()
            .iter()
            .filter_map(|z| z.zone_name())
            .map(str::to_string)
            .collect();
        z.sort();
        Ok(z)
    }

    async fn validate_constraints(&self, cons: &Constraints) -> Result<()> {
        check_supported(cons)?;
        choose(self.instance_types().await?, cons, &self.region).map(|_| ())
    }

    /// Deletes the environment's security group (after its instances are
    /// gone; retried while EC2 still sees them using it).
    /// The security group, then the control bucket, the instance profile
    /// and the role: each only if this environment's, each skipped if gone.
    async fn destroy_environment(&self) -> Result<()> {
        let removed = self.remove_environment_resources().await?;
        if !removed.is_empty() {
            tracing::info!(removed = %removed.join(", "), "removed the environment's resources");
        }
        Ok(())
    }

    async fn update_config(&self, config: &BTreeMap<String, String>) -> Result<()> {
        *self
            .image_override
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = config.get("image-id").cloned();
        Ok(())
    }
}

/// Refuses constraint keys EC2 cannot honour. Needs no network: the CLI
/// calls it before it changes anything.
/// The largest EBS volume (gp2, gp3), in GiB: 16 TiB.
pub const MAX_ROOT_DISK_GIB: u64 = 16 * 1024;

pub fn check_supported(cons: &Constraints) -> Result<()> {
    if let Some(mib) = cons.root_disk() {
        if mib.div_ceil(1024) > MAX_ROOT_DISK_GIB {
            return Err(Error::InvalidSpec(format!(
                "root-disk={}G is more than the {MAX_ROOT_DISK_GIB}G an EBS root volume may hold; ask for less",
                mib.div_ceil(1024)
            )));
        }
    }
    let unsupported: Vec<&str> = [
        (cons.container().is_some_and(|c| c != "none"), "container"),
        (cons.virt_type().is_some(), "virt-type"),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .map(|(_, k)| k)
    .collect();
    if unsupported.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidSpec(format!(
        "the ec2 provider does not support constraint(s) {}",
        unsupported
            .iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, vcpus: u64, mem: u64, arch: &str) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            vcpus,
            mem,
            arches: vec![arch.into()],
        }
    }

    #[test]
    fn the_cheapest_priced_type_that_fits_wins() {
        let types = vec![
            t("t3.micro", 2, 1024, "x86_64"),
            t("t3.medium", 2, 4096, "x86_64"),
            t("t3.xlarge", 4, 16384, "x86_64"),
            t("m5.xlarge", 4, 16384, "x86_64"),
            t("r5.2xlarge", 8, 65536, "x86_64"),
            t("m5.4xlarge", 16, 65536, "x86_64"),
            t("t4g.small", 2, 2048, "arm64"),
            t("x9.huge", 4, 8192, "x86_64"),
        ];
        let c = |s: &str| choose(&types, &Constraints::parse(s).unwrap(), "r").map(|t| t.name);
        assert_eq!(c("").unwrap(), "t3.micro");
        assert_eq!(c("mem=3G").unwrap(), "t3.medium");
        assert_eq!(c("cores=4 mem=16G").unwrap(), "t3.xlarge");
        assert_eq!(c("cores=8 mem=64G").unwrap(), "r5.2xlarge");
        assert_eq!(c("arch=arm64").unwrap(), "t4g.small");
        assert_eq!(c("instance-type=m5.xlarge").unwrap(), "m5.xlarge");
        assert!(matches!(
            c("instance-type=q1.big"),
            Err(Error::InvalidSpec(_))
        ));
        assert!(matches!(
            c("instance-type=t4g.small"),
            Err(Error::InvalidSpec(_))
        ));
        assert!(matches!(c("mem=1000G"), Err(Error::InvalidSpec(_))));
        // Unpriced types are a fallback only.
        let only_unpriced = vec![
            t("x9.huge", 4, 8192, "x86_64"),
            t("x9.small", 2, 8192, "x86_64"),
        ];
        assert_eq!(
            choose(&only_unpriced, &Constraints::new(), "r")
                .unwrap()
                .name,
            "x9.small"
        );
    }

    #[test]
    fn ec2_error_codes_are_classified() {
        use crate::ErrorClass::*;
        for (code, class) in [
            ("RequestLimitExceeded", Transient),
            ("InternalError", Transient),
            ("InsufficientInstanceCapacity", Capacity),
            ("Unsupported", Capacity),
            ("IdempotentParameterMismatch", Transient),
            ("InstanceLimitExceeded", Quota),
            ("VcpuLimitExceeded", Quota),
            ("AuthFailure", Credentials),
            ("UnauthorizedOperation", Credentials),
            ("InvalidAMIID.NotFound", InvalidSpec),
            ("InvalidInstanceID.NotFound", NotFound),
        ] {
            assert_eq!(classify_code(code, "m", Some("z")).class(), class, "{code}");
        }
        match classify_code(
            "InsufficientInstanceCapacity",
            "none left",
            Some("us-east-1a"),
        ) {
            Error::Capacity { zone, .. } => assert_eq!(zone, "us-east-1a"),
            e => panic!("{e}"),
        }
        // A profile IAM has made but EC2 does not know yet, as EC2 words it,
        // is worth retrying; another bad parameter is not.
        let profile = "Value (jujube-x) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name";
        assert_eq!(
            classify_code("InvalidParameterValue", profile, None).class(),
            Transient
        );
        assert_eq!(
            classify_code("InvalidParameterValue", "bad volume size", None).class(),
            InvalidSpec
        );
    }
}
