//! The controller's cloud identity on EC2: an IAM role machine 0 assumes
//! through an instance profile, so that the controller gets short-lived
//! credentials from the instance metadata service and no long-lived secret
//! is ever written to the instance (nor to its user data, which anyone who
//! may describe the instance can read).
//!
//! The role and the profile are both named `jujube-<uuid>` and tagged with
//! the environment's full UUID; one of that name without the tag is never
//! changed nor deleted. The role may do what the controller does and no
//! more: EC2's instance and security-group calls, and reading and writing
//! the environment's control bucket alone.

use super::{ec2_code, Error, Result};
use crate::TAG_ENV_UUID;
use aws_sdk_iam::error::ProvideErrorMetadata;
use aws_sdk_iam::types::Tag;

/// The policy's name on the role.
const POLICY: &str = "jujube-controller";

/// Who may assume the role: EC2 instances (through their profile).
const TRUST: &str = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"sts:AssumeRole"}]}"#;

/// The EC2 calls the controller makes (the provider's, the provisioner's
/// and the enrollment checks').
const EC2_ACTIONS: [&str; 11] = [
    "ec2:RunInstances",
    "ec2:TerminateInstances",
    "ec2:CreateTags",
    "ec2:DescribeInstances",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeImages",
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeSecurityGroups",
    "ec2:CreateSecurityGroup",
    "ec2:AuthorizeSecurityGroupIngress",
    "ec2:DeleteSecurityGroup",
];

/// The role's permissions: the EC2 calls above, the control bucket
/// `bucket` alone in S3, and passing this role (`role`, by name) to EC2:
/// what launching another controller's instance with the same profile
/// takes (`enable-ha`).
pub fn policy(bucket: &str, role: &str) -> String {
    serde_json::json!({
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": EC2_ACTIONS, "Resource": "*"},
            {
                "Effect": "Allow",
                "Action": ["iam:PassRole"],
                "Resource": format!("arn:aws:iam::*:role/{role}"),
                "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            },
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": format!("arn:aws:s3:::{bucket}"),
            },
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                "Resource": format!("arn:aws:s3:::{bucket}/*"),
            },
        ],
    })
    .to_string()
}

/// What [`ControllerProfile::destroy`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    pub profile: bool,
    pub role: bool,
}

/// The name of environment `env_uuid`'s instance profile and role.
pub fn profile_name(env_uuid: &str) -> String {
    format!("jujube-{env_uuid}")
}

/// One environment's role and instance profile.
pub struct ControllerProfile {
    client: aws_sdk_iam::Client,
    name: String,
    env_uuid: String,
}

impl ControllerProfile {
    pub(crate) fn new(client: aws_sdk_iam::Client, env_uuid: &str) -> ControllerProfile {
        ControllerProfile {
            client,
            name: profile_name(env_uuid),
            env_uuid: env_uuid.to_string(),
        }
    }

    /// The instance profile's (and the role's) name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn tag(&self) -> Result<Tag> {
        Tag::builder()
            .key(TAG_ENV_UUID)
            .value(&self.env_uuid)
            .build()
            .map_err(|e| Error::InvalidSpec(e.to_string()))
    }

    fn not_ours(&self, what: &str) -> Error {
        Error::Config(format!(
            "IAM {what} `{}` exists and is not this environment's (it lacks the `{TAG_ENV_UUID}` tag of `{}`); remove it or use another environment",
            self.name, self.env_uuid
        ))
    }

    /// Makes the role (allowed `bucket` and the controller's EC2 calls) and
    /// the instance profile holding it, or completes what an interrupted
    /// call made. Refuses a role or profile of that name that is not this
    /// environment's.
    pub async fn ensure(&self, bucket: &str) -> Result<()> {
        match self
            .client
            .create_role()
            .role_name(&self.name)
            .assume_role_policy_document(TRUST)
            .description("jujube controller (machine 0)")
            .tags(self.tag()?)
            .send()
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == Some("EntityAlreadyExists") => {
                if self.role_owned().await? != Some(true) {
                    return Err(self.not_ours("role"));
                }
            }
            Err(e) => return Err(classify(e, "role", &self.name)),
        }
        self.client
            .put_role_policy()
            .role_name(&self.name)
            .policy_name(POLICY)
            .policy_document(policy(bucket, &self.name))
            .send()
            .await
            .map_err(|e| classify(e, "role", &self.name))?;
        match self
            .client
            .create_instance_profile()
            .instance_profile_name(&self.name)
            .tags(self.tag()?)
            .send()
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == Some("EntityAlreadyExists") => {
                if self.profile_owned().await? != Some(true) {
                    return Err(self.not_ours("instance profile"));
                }
            }
            Err(e) => return Err(classify(e, "instance profile", &self.name)),
        }
        let held = self
            .client
            .get_instance_profile()
            .instance_profile_name(&self.name)
            .send()
            .await
            .map_err(|e| classify(e, "instance profile", &self.name))?
            .instance_profile()
            .is_some_and(|p| p.roles().iter().any(|r| r.role_name() == self.name));
        if !held {
            match self
                .client
                .add_role_to_instance_profile()
                .instance_profile_name(&self.name)
                .role_name(&self.name)
                .send()
                .await
            {
                Ok(_) => {}
                // One role a profile: a concurrent call added it.
                Err(e) if e.code() == Some("LimitExceeded") => {}
                Err(e) => return Err(classify(e, "instance profile", &self.name)),
            }
        }
        Ok(())
    }

    /// Whether the role carries this environment's UUID (`None`: no role).
    async fn role_owned(&self) -> Result<Option<bool>> {
        match self
            .client
            .list_role_tags()
            .role_name(&self.name)
            .send()
            .await
        {
            Ok(t) => Ok(Some(self.carries(t.tags()))),
            Err(e) if e.code() == Some("NoSuchEntity") => Ok(None),
            Err(e) => Err(classify(e, "role", &self.name)),
        }
    }

    /// Whether the profile carries this environment's UUID (`None`: none).
    async fn profile_owned(&self) -> Result<Option<bool>> {
        match self
            .client
            .list_instance_profile_tags()
            .instance_profile_name(&self.name)
            .send()
            .await
        {
            Ok(t) => Ok(Some(self.carries(t.tags()))),
            Err(e) if e.code() == Some("NoSuchEntity") => Ok(None),
            Err(e) => Err(classify(e, "instance profile", &self.name)),
        }
    }

    fn carries(&self, tags: &[Tag]) -> bool {
        tags.iter()
            .any(|t| t.key() == TAG_ENV_UUID && t.value() == self.env_uuid)
    }

    /// Removes the profile and the role if they are this environment's;
    /// what is gone already is nothing to do. Refuses, untouched, a profile
    /// or role of that name that is somebody else's.
    pub async fn destroy(&self) -> Result<Removed> {
        let mut removed = Removed::default();
        match self.profile_owned().await? {
            None => {}
            Some(false) => return Err(self.not_ours("instance profile")),
            Some(true) => {
                match self
                    .client
                    .remove_role_from_instance_profile()
                    .instance_profile_name(&self.name)
                    .role_name(&self.name)
                    .send()
                    .await
                {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("NoSuchEntity") => {}
                    Err(e) => return Err(classify(e, "instance profile", &self.name)),
                }
                match self
                    .client
                    .delete_instance_profile()
                    .instance_profile_name(&self.name)
                    .send()
                    .await
                {
                    Ok(_) => removed.profile = true,
                    Err(e) if e.code() == Some("NoSuchEntity") => {}
                    Err(e) => return Err(classify(e, "instance profile", &self.name)),
                }
            }
        }
        match self.role_owned().await? {
            None => {}
            Some(false) => return Err(self.not_ours("role")),
            Some(true) => {
                let policies = self
                    .client
                    .list_role_policies()
                    .role_name(&self.name)
                    .send()
                    .await
                    .map_err(|e| classify(e, "role", &self.name))?;
                for p in policies.policy_names() {
                    match self
                        .client
                        .delete_role_policy()
                        .role_name(&self.name)
                        .policy_name(p)
                        .send()
                        .await
                    {
                        Ok(_) => {}
                        Err(e) if e.code() == Some("NoSuchEntity") => {}
                        Err(e) => return Err(classify(e, "role", &self.name)),
                    }
                }
                match self.client.delete_role().role_name(&self.name).send().await {
                    Ok(_) => removed.role = true,
                    Err(e) if e.code() == Some("NoSuchEntity") => {}
                    Err(e) => return Err(classify(e, "role", &self.name)),
                }
            }
        }
        Ok(removed)
    }
}

fn classify<E, R>(e: aws_sdk_iam::error::SdkError<E, R>, what: &str, name: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    match e.code() {
        Some("AccessDenied") | Some("AccessDeniedException") => Error::Credentials(format!(
            "IAM {what} `{name}`: {}; bootstrap needs iam:CreateRole, iam:PutRolePolicy, iam:CreateInstanceProfile, iam:AddRoleToInstanceProfile and iam:PassRole",
            e.message().unwrap_or("access denied")
        )),
        // Something jujube did not make hangs on it (a policy attached by
        // hand): what is in the way is the user's to remove.
        Some("DeleteConflict") => Error::InUse(format!(
            "IAM {what} `{name}` is still in use ({}); detach what was added to it outside jujube (`aws iam list-attached-role-policies --role-name {name}`), then run `destroy-environment` again",
            e.message().unwrap_or("DeleteConflict")
        )),
        _ => ec2_code(e, &format!("IAM {what} `{name}`")),
    }
}
