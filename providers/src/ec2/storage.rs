//! The environment's storage on EC2: its control bucket (Juju 1.x's
//! `control-bucket`), where bootstrap puts the `jujube` binary machine 0
//! installs.
//!
//! - **Ownership**: the bucket is tagged with the environment's full UUID
//!   when it is made; a bucket of the same name without that tag is never
//!   written to nor deleted ([`ControlBucket::ensure`] and
//!   [`ControlBucket::destroy`] refuse it), as instances are never stopped
//!   without it.
//! - **Tools** are kept under their SHA-256 (`tools/jujube-<sha256>`), so an
//!   object is never replaced by other bytes under the same name, and a
//!   machine that fetched it checks what it got against the name's hash.
//! - **Fetching** needs no credential on the machine: a presigned GET
//!   ([`ControlBucket::presign`]) lets whoever holds the URL read that one
//!   object until it expires, and nothing else. It is the only thing a boot
//!   script says about the bucket.

use super::{ec2_code, Error, Result};
use crate::TAG_ENV_UUID;
use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{
    BucketLocationConstraint, CreateBucketConfiguration, Delete, ObjectIdentifier, Tag, Tagging,
};
use std::time::{Duration, SystemTime};

/// Where objects that wait for a controller's instance go in the bucket,
/// and the lifecycle rule that expires them after a day.
pub const CONTROLLER_FILES: &str = "controller/";
const CONTROLLER_FILES_RULE: &str = "jujube-controller-files";

/// How long a presigned tools URL lives by default: machine 0 fetches its
/// binary within minutes of booting, and `bootstrap-timeout` defaults to
/// ten.
pub const TOOLS_URL_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// The longest a presigned URL may live (SigV4's own limit: seven days).
pub const MAX_URL_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// The name of an environment's control bucket: `control-bucket` from its
/// config, or `jujube-<uuid>` (43 characters, within S3's 3-63, lowercase).
pub fn bucket_name(env_uuid: &str, config: &std::collections::BTreeMap<String, String>) -> String {
    config
        .get("control-bucket")
        .cloned()
        .unwrap_or_else(|| format!("jujube-{env_uuid}"))
}

/// Checks a `control-bucket` name against S3's rules for new buckets, so
/// that bootstrap refuses it before making anything.
pub fn validate_bucket_name(name: &str) -> Result<()> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ends_ok = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let looks_like_ip = name.split('.').count() == 4
        && name
            .split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    if (3..=63).contains(&name.len())
        && ok_chars
        && ends_ok(name.as_bytes().first())
        && ends_ok(name.as_bytes().last())
        && !name.contains("..")
        && !looks_like_ip
    {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "`control-bucket` `{name}` is not a valid S3 bucket name: 3-63 characters of lowercase letters, digits, `-` and `.`, starting and ending with a letter or digit; choose another or leave it unset for `jujube-<uuid>`"
        )))
    }
}

/// An object of tools in the bucket: its key and the SHA-256 (hex) of its
/// bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    pub key: String,
    pub sha256: String,
}

/// What [`ControlBucket::destroy`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    pub objects: usize,
    pub bucket: bool,
}

/// One environment's control bucket.
pub struct ControlBucket {
    client: aws_sdk_s3::Client,
    name: String,
    region: String,
    env_uuid: String,
}

impl ControlBucket {
    pub(crate) fn new(
        client: aws_sdk_s3::Client,
        name: String,
        region: &str,
        env_uuid: &str,
    ) -> ControlBucket {
        ControlBucket {
            client,
            name,
            region: region.to_string(),
            env_uuid: env_uuid.to_string(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes the bucket, tagged with the environment's UUID, or finds it
    /// made already by this environment. Refuses a bucket of that name that
    /// is somebody else's (another account's, or one of this account's not
    /// tagged as this environment's), changing nothing.
    pub async fn ensure(&self) -> Result<()> {
        // Looked at first: S3 answers a second CreateBucket of one's own
        // bucket in us-east-1 with success, so the create cannot tell.
        match self.owned().await? {
            Some(true) => return Ok(()),
            Some(false) => return Err(self.not_ours()),
            None => {}
        }
        let mut create = self.client.create_bucket().bucket(&self.name);
        // us-east-1 is the one region that takes no location constraint.
        if self.region != "us-east-1" {
            create = create.create_bucket_configuration(
                CreateBucketConfiguration::builder()
                    .location_constraint(BucketLocationConstraint::from(self.region.as_str()))
                    .build(),
            );
        }
        match create.send().await {
            Ok(_) => {}
            // Made meanwhile, by someone: only the tag tells whose.
            Err(e) if e.code() == Some("BucketAlreadyOwnedByYou") => {
                return match self.owned().await? {
                    Some(true) => Ok(()),
                    _ => Err(self.not_ours()),
                };
            }
            Err(e) if e.code() == Some("BucketAlreadyExists") => return Err(self.not_ours()),
            Err(e) => return Err(classify(e, &self.name)),
        }
        // What waits for a controller under `controller/` (its files, a
        // hand-over's identity) is taken within minutes; what no instance
        // took (one that never booted) goes after a day.
        use aws_sdk_s3::types::{
            BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule,
            LifecycleRuleFilter,
        };
        let invalid =
            |e: aws_smithy_types::error::operation::BuildError| Error::InvalidSpec(e.to_string());
        self.client
            .put_bucket_lifecycle_configuration()
            .bucket(&self.name)
            .lifecycle_configuration(
                BucketLifecycleConfiguration::builder()
                    .rules(
                        LifecycleRule::builder()
                            .id(CONTROLLER_FILES_RULE)
                            .filter(
                                LifecycleRuleFilter::builder()
                                    .prefix(CONTROLLER_FILES)
                                    .build(),
                            )
                            .status(ExpirationStatus::Enabled)
                            .expiration(LifecycleExpiration::builder().days(1).build())
                            .build()
                            .map_err(invalid)?,
                    )
                    .build()
                    .map_err(invalid)?,
            )
            .send()
            .await
            .map_err(|e| classify(e, &self.name))?;
        self.client
            .put_bucket_tagging()
            .bucket(&self.name)
            .tagging(
                Tagging::builder()
                    .tag_set(
                        Tag::builder()
                            .key(TAG_ENV_UUID)
                            .value(&self.env_uuid)
                            .build()
                            .map_err(|e| Error::InvalidSpec(e.to_string()))?,
                    )
                    .build()
                    .map_err(|e| Error::InvalidSpec(e.to_string()))?,
            )
            .send()
            .await
            .map_err(|e| classify(e, &self.name))?;
        Ok(())
    }

    fn not_ours(&self) -> Error {
        Error::Config(format!(
            "S3 bucket `{}` exists and is not this environment's (it lacks the `{TAG_ENV_UUID}` tag of `{}`); choose another name with `--config control-bucket=NAME`",
            self.name, self.env_uuid
        ))
    }

    /// Whether the bucket carries this environment's UUID: `None` when
    /// there is no such bucket.
    async fn owned(&self) -> Result<Option<bool>> {
        match self
            .client
            .get_bucket_tagging()
            .bucket(&self.name)
            .send()
            .await
        {
            Ok(t) => {
                Ok(Some(t.tag_set().iter().any(|t| {
                    t.key() == TAG_ENV_UUID && t.value() == self.env_uuid
                })))
            }
            Err(e) if e.code() == Some("NoSuchBucket") => Ok(None),
            // Untagged, or another account's.
            Err(e) if matches!(e.code(), Some("NoSuchTagSet") | Some("AccessDenied")) => {
                Ok(Some(false))
            }
            Err(e) => Err(classify(e, &self.name)),
        }
    }

    /// Puts `bytes` (a `jujube` binary) in the bucket under their SHA-256.
    /// Idempotent: the same bytes land on the same key, and are not sent
    /// again when they are there (each controller `enable-ha` starts
    /// fetches the same binary).
    pub async fn put_tools(&self, bytes: Vec<u8>) -> Result<Tools> {
        let sha256 = sha256_hex(&bytes);
        let key = format!("tools/jujube-{sha256}");
        if self.exists(&key).await? {
            return Ok(Tools { key, sha256 });
        }
        self.client
            .put_object()
            .bucket(&self.name)
            .key(&key)
            .content_type("application/octet-stream")
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(|e| classify(e, &self.name))?;
        Ok(Tools { key, sha256 })
    }

    /// Puts `bytes` under `key`, encrypted at rest (SSE-S3), readable only
    /// by the account's principals (the bucket is private) and the
    /// controller's role.
    pub async fn put_private(&self, key: &str, bytes: Vec<u8>) -> Result<()> {
        self.client
            .put_object()
            .bucket(&self.name)
            .key(key)
            .server_side_encryption(aws_sdk_s3::types::ServerSideEncryption::Aes256)
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(|e| classify(e, &self.name))?;
        Ok(())
    }

    /// The object under `key`, if there is one; refused above `max` bytes
    /// (read no further).
    pub async fn get(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>> {
        let got = match self
            .client
            .get_object()
            .bucket(&self.name)
            .key(key)
            .send()
            .await
        {
            Ok(o) => o,
            Err(e) if e.code() == Some("NoSuchKey") => return Ok(None),
            Err(e) => return Err(classify(e, &self.name)),
        };
        if got.content_length().unwrap_or(0) as u64 > max {
            return Err(Error::InvalidSpec(format!(
                "S3 object `{key}` in `{}` is {} bytes, more than the {max} expected",
                self.name,
                got.content_length().unwrap_or(0)
            )));
        }
        let bytes = got.body.collect().await.map_err(|e| {
            Error::Transient(format!("S3 bucket `{}`: reading `{key}`: {e}", self.name))
        })?;
        let bytes = bytes.into_bytes();
        if bytes.len() as u64 > max {
            return Err(Error::InvalidSpec(format!(
                "S3 object `{key}` in `{}` is more than the {max} bytes expected",
                self.name
            )));
        }
        Ok(Some(bytes.to_vec()))
    }

    /// Whether there is an object under `key`.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        match self
            .client
            .head_object()
            .bucket(&self.name)
            .key(key)
            .send()
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.raw_response().is_some_and(|r| r.status().as_u16() == 404) => Ok(false),
            Err(e) => Err(classify(e, &self.name)),
        }
    }

    /// Deletes the object under `key` (none there is no error).
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.client
            .delete_object()
            .bucket(&self.name)
            .key(key)
            .send()
            .await
            .map_err(|e| classify(e, &self.name))?;
        Ok(())
    }

    /// A URL that reads `key` with a GET until `lifetime` after `start`,
    /// and nothing else: no credential travels with it.
    pub async fn presign(
        &self,
        key: &str,
        start: SystemTime,
        lifetime: Duration,
    ) -> Result<String> {
        self.presign_as(key, start, lifetime, false).await
    }

    /// A URL that writes object `key` (a `PUT` of its bytes, no credential)
    /// from `start` for `lifetime`, at most 7 days: how machine 0, which has
    /// no credential of its own in a hand-over, tells bootstrap the
    /// identity it listens with. A capability for one object, until it
    /// expires.
    pub async fn presign_put(
        &self,
        key: &str,
        start: SystemTime,
        lifetime: Duration,
    ) -> Result<String> {
        self.presign_as(key, start, lifetime, true).await
    }

    async fn presign_as(
        &self,
        key: &str,
        start: SystemTime,
        lifetime: Duration,
        put: bool,
    ) -> Result<String> {
        if lifetime.is_zero() || lifetime > MAX_URL_LIFETIME {
            return Err(Error::Config(format!(
                "a presigned URL lives between 1 s and 7 days, not {} s",
                lifetime.as_secs()
            )));
        }
        let cfg = PresigningConfig::builder()
            .start_time(start)
            .expires_in(lifetime)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        let req = if put {
            self.client
                .put_object()
                .bucket(&self.name)
                .key(key)
                .presigned(cfg)
                .await
                .map_err(|e| classify(e, &self.name))?
        } else {
            self.client
                .get_object()
                .bucket(&self.name)
                .key(key)
                .presigned(cfg)
                .await
                .map_err(|e| classify(e, &self.name))?
        };
        Ok(req.uri().to_string())
    }

    /// Deletes every object and then the bucket, if it is this
    /// environment's; a bucket that is gone already is nothing to do, and one
    /// that is not ours is refused untouched.
    pub async fn destroy(&self) -> Result<Removed> {
        let mut removed = Removed::default();
        match self.owned().await? {
            None => return Ok(removed),
            Some(false) => return Err(self.not_ours()),
            Some(true) => {}
        }
        // At most 1,000 keys a listing and a DeleteObjects call.
        loop {
            let page = self
                .client
                .list_objects_v2()
                .bucket(&self.name)
                .send()
                .await
                .map_err(|e| classify(e, &self.name))?;
            let keys: Vec<ObjectIdentifier> = page
                .contents()
                .iter()
                .filter_map(|o| o.key())
                .filter_map(|k| ObjectIdentifier::builder().key(k).build().ok())
                .collect();
            if keys.is_empty() {
                break;
            }
            removed.objects += keys.len();
            self.client
                .delete_objects()
                .bucket(&self.name)
                .delete(
                    Delete::builder()
                        .set_objects(Some(keys))
                        .quiet(true)
                        .build()
                        .map_err(|e| Error::InvalidSpec(e.to_string()))?,
                )
                .send()
                .await
                .map_err(|e| classify(e, &self.name))?;
        }
        match self.client.delete_bucket().bucket(&self.name).send().await {
            Ok(_) => removed.bucket = true,
            Err(e) if e.code() == Some("NoSuchBucket") => {}
            Err(e) => return Err(classify(e, &self.name)),
        }
        Ok(removed)
    }
}

/// The SHA-256 of `bytes`, in lowercase hex (as `sha256sum` prints it).
pub fn sha256_hex(bytes: &[u8]) -> String {
    aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn classify<E, R>(e: aws_sdk_s3::error::SdkError<E, R>, bucket: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    match e.code() {
        Some("AccessDenied") | Some("InvalidAccessKeyId") | Some("SignatureDoesNotMatch") => {
            Error::Credentials(format!(
                "S3 bucket `{bucket}`: {}",
                e.message().unwrap_or("access denied")
            ))
        }
        _ => ec2_code(e, &format!("S3 bucket `{bucket}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ec2::Ec2Provider;

    const HAND_OVER_URL: &str = "https://s3.example/b/controller/ca?X-Amz-Signature=abc&x='y'$HOME";

    /// Machine 0's boot script run by `sh` under a scratch root, fetching with
    /// curl from a `file://` URL: (exit code, stderr, the root).
    fn run_controller_boot(served: &[u8], sha256: &str) -> (i32, String, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        let tools = root.path().join("served-jujube");
        std::fs::write(&tools, served).unwrap();
        let script = crate::controller_boot_script(&crate::ControllerBoot {
            tools_url: format!("file://{}", tools.display()),
            sha256: sha256.to_string(),
            args: vec!["controller".into(), "--took-up=machine-0".into()],
            hand_over_url: Some(HAND_OVER_URL.into()),
        })
        .unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .env("JUJUBE_ROOT", root.path())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            root,
        )
    }

    #[test]
    fn machine_0s_boot_script_installs_the_binary_its_hash_names_and_starts_the_controller() {
        // A stand-in binary that says it ran, and with what.
        let binary = b"#!/bin/sh\necho \"$@\" > \"$JUJUBE_ROOT/var/lib/jujube/ran\"\n";
        let (code, err, root) = run_controller_boot(binary, &sha256_hex(binary));
        assert_eq!(code, 0, "{err}");
        let installed = root.path().join("usr/local/bin/jujube");
        assert_eq!(std::fs::read(&installed).unwrap(), binary);
        let ran = root.path().join("var/lib/jujube/ran");
        for _ in 0..100 {
            if ran.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            std::fs::read_to_string(&ran).unwrap(),
            "controller --took-up=machine-0\n"
        );
        // The hand-over's URL, as given, the owner's alone.
        use std::os::unix::fs::PermissionsExt;
        let file = root
            .path()
            .join(crate::HAND_OVER_URL_FILE.trim_start_matches('/'));
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            format!("{HAND_OVER_URL}\n")
        );
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }

    #[test]
    fn machine_0s_boot_script_refuses_a_tampered_binary_and_installs_nothing() {
        let good = b"the controller's binary";
        let tampered = b"the controller's binary, altered on its way";
        let (code, err, root) = run_controller_boot(tampered, &sha256_hex(good));
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("jujube: refused the controller's binary: its SHA-256 is")
                && err.contains(&sha256_hex(good)),
            "{err}"
        );
        let bin = root.path().join("usr/local/bin");
        assert_eq!(
            std::fs::read_dir(&bin).unwrap().count(),
            0,
            "nothing is installed, not even the download"
        );
    }

    #[test]
    fn machine_0s_boot_script_holds_no_secret_and_refuses_what_it_cannot_quote() {
        let b = crate::ControllerBoot {
            tools_url: "https://s3.example/b/tools/jujube-x?X-Amz-Signature=abc&x='y'".into(),
            sha256: "a".repeat(64),
            args: vec!["controller".into()],
            hand_over_url: None,
        };
        let script = crate::controller_boot_script(&b).unwrap();
        // The quote in the URL cannot end the string it is in.
        assert!(script.contains(
            r"url='https://s3.example/b/tools/jujube-x?X-Amz-Signature=abc&x='\''y'\'''"
        ));
        for secret in [
            "AWS_SECRET",
            "aws_secret_access_key",
            "PRIVATE KEY",
            "password",
            "token",
        ] {
            assert!(
                !script.to_lowercase().contains(&secret.to_lowercase()),
                "{secret} in {script}"
            );
        }
        let bad_arg = crate::ControllerBoot {
            args: vec!["controller; rm -rf /".into()],
            ..b.clone()
        };
        assert!(crate::controller_boot_script(&bad_arg).is_err());
        let bad_hash = crate::ControllerBoot {
            sha256: "not-a-hash".into(),
            ..b
        };
        assert!(crate::controller_boot_script(&bad_hash).is_err());
    }

    /// A provider whose calls would fail (nothing listens there): presigning
    /// is local.
    async fn offline() -> Ec2Provider {
        let config = [("region", "eu-west-1"), ("endpoint", "http://127.0.0.1:9")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let creds = aws_sdk_ec2::config::Credentials::new(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
            None,
            None,
            "test",
        );
        Ec2Provider::new_with(
            "test",
            "11111111-2222-4333-8444-555555555555",
            &config,
            Some(creds),
            None,
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_presigned_url_names_its_start_and_lifetime_and_carries_no_secret() {
        let p = offline().await;
        let bucket = p.control_bucket();
        let start = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let url = bucket
            .presign("tools/jujube-abc", start, Duration::from_secs(600))
            .await
            .unwrap();
        assert!(
            url.starts_with(
                "http://127.0.0.1:9/jujube-11111111-2222-4333-8444-555555555555/tools/jujube-abc?"
            ),
            "{url}"
        );
        // 2027-01-15T08:00:00Z, valid for ten minutes: S3 refuses it after.
        assert!(url.contains("X-Amz-Date=20270115T080000Z"), "{url}");
        assert!(url.contains("X-Amz-Expires=600"), "{url}");
        assert!(url.contains("X-Amz-Signature="), "{url}");
        assert!(
            !url.contains("wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
            "{url}"
        );
        // The script machine 0 boots with, made from it, holds no secret.
        let script = crate::controller_boot_script(&crate::ControllerBoot {
            tools_url: url,
            sha256: "a".repeat(64),
            args: vec!["controller".into()],
            hand_over_url: None,
        })
        .unwrap();
        assert!(!script.contains("wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"));
        for lifetime in [Duration::ZERO, MAX_URL_LIFETIME + Duration::from_secs(1)] {
            assert!(bucket.presign("k", start, lifetime).await.is_err());
        }
    }

    #[test]
    fn bucket_names_follow_s3s_rules() {
        for ok in [
            "jujube-11111111-2222-4333-8444-555555555555",
            "abc",
            "a.b-c1",
        ] {
            validate_bucket_name(ok).unwrap();
        }
        for bad in [
            "ab",
            "Upper",
            "under_score",
            "-lead",
            "trail-",
            "a..b",
            "192.168.0.1",
            &"a".repeat(64),
        ] {
            assert!(validate_bucket_name(bad).is_err(), "{bad}");
        }
    }
}
