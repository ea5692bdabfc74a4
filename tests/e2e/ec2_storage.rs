//! The environment's storage and identity on EC2 against LocalStack (S3 and
//! IAM): the control bucket and its tools, presigned URLs as a machine
//! fetches them (with curl, signatures checked: `localstack/start` sets
//! `S3_SKIP_SIGNATURE_VALIDATION=0`), the controller's role and instance
//! profile, the API port, and their removal with the environment.

use crate::ec2::{account, localstack, ENDPOINT, REGION};
use aws_sdk_ec2::config::Credentials;
use jujube_providers::ec2::storage::{self, Tools};
use jujube_providers::ec2::Ec2Provider;
use jujube_providers::Provider;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

fn config(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    [("region", REGION), ("endpoint", ENDPOINT)]
        .iter()
        .chain(extra)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn provider(account: &str, uuid: &str, cfg: BTreeMap<String, String>) -> Ec2Provider {
    let creds = Credentials::new(account, "test", None, None, "jujube-tests");
    Ec2Provider::new_with("test", uuid, &cfg, Some(creds), None)
        .await
        .unwrap()
}

/// S3 and IAM as the test's account sees them, outside jujube.
async fn sdk(account: &str) -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(REGION))
        .endpoint_url(ENDPOINT)
        .credentials_provider(Credentials::new(account, "test", None, None, "raw"))
        .load()
        .await
}

pub(crate) async fn raw_s3(account: &str) -> aws_sdk_s3::Client {
    aws_sdk_s3::Client::from_conf(
        aws_sdk_s3::config::Builder::from(&sdk(account).await)
            .force_path_style(true)
            .build(),
    )
}

pub(crate) async fn raw_iam(account: &str) -> aws_sdk_iam::Client {
    aws_sdk_iam::Client::from_conf(aws_sdk_iam::config::Builder::from(&sdk(account).await).build())
}

/// GETs `url` with curl, as a boot script does: the HTTP status and body.
fn curl(url: &str) -> (u16, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("body");
    let out = std::process::Command::new("curl")
        .args(["-sS", "-o"])
        .arg(&body)
        .args(["-w", "%{http_code}", url])
        .output()
        .unwrap();
    let code = String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0);
    (code, std::fs::read(&body).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_bucket_is_tagged_keeps_tools_by_hash_and_hands_out_expiring_urls() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let uuid = uuid::Uuid::new_v4().to_string();
    let p = provider(&acct, &uuid, config(&[])).await;
    let bucket = p.control_bucket();
    assert_eq!(bucket.name(), format!("jujube-{uuid}"));
    bucket.ensure().await.unwrap();
    bucket
        .ensure()
        .await
        .expect("making it again finds it made");
    let s3 = raw_s3(&acct).await;
    let tags = s3
        .get_bucket_tagging()
        .bucket(bucket.name())
        .send()
        .await
        .unwrap();
    assert!(tags
        .tag_set()
        .iter()
        .any(|t| t.key() == "jujube-env-uuid" && t.value() == uuid));
    // What waits for a controller's instance goes after a day if none
    // takes it.
    let lifecycle = s3
        .get_bucket_lifecycle_configuration()
        .bucket(bucket.name())
        .send()
        .await
        .unwrap();
    let rule = &lifecycle.rules()[0];
    assert_eq!(
        rule.filter().and_then(|f| f.prefix()),
        Some(storage::CONTROLLER_FILES)
    );
    assert_eq!(rule.expiration().and_then(|e| e.days()), Some(1));

    let binary = b"#!/bin/sh\necho a jujube binary\n".repeat(1000);
    let tools = bucket.put_tools(binary.clone()).await.unwrap();
    let sha = storage::sha256_hex(&binary);
    assert_eq!(
        tools,
        Tools {
            key: format!("tools/jujube-{sha}"),
            sha256: sha.clone()
        }
    );
    // Fetched by its URL, with no credential: the very bytes.
    let url = bucket
        .presign(&tools.key, SystemTime::now(), Duration::from_secs(600))
        .await
        .unwrap();
    assert!(!url.contains("test"), "no secret in the URL: {url}");
    let (code, body) = curl(&url);
    assert_eq!(code, 200);
    assert_eq!(body, binary);
    // A URL altered anywhere is refused: here the object it names.
    let (code, _) = curl(&url.replace(&sha, &"0".repeat(64)));
    assert_eq!(code, 403, "a URL for another key is refused");
    // Expired: signed two hours ago for ten minutes.
    let old = bucket
        .presign(
            &tools.key,
            SystemTime::now() - Duration::from_secs(7200),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    let (code, body) = curl(&old);
    assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("expired"));
    // Longer than SigV4 allows: refused before any call.
    assert!(bucket
        .presign(
            &tools.key,
            SystemTime::now(),
            Duration::from_secs(8 * 24 * 3600)
        )
        .await
        .is_err());

    // A private object is read back only up to the bound its reader sets
    // (machine 0's hand-over: 64 MiB); a larger one is refused and left.
    bucket
        .put_private("controller/hand-over", vec![7; 2048])
        .await
        .unwrap();
    let err = bucket
        .get("controller/hand-over", 1024)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is 2048 bytes, more than the 1024 expected"),
        "{err}"
    );
    assert_eq!(
        bucket.get("controller/hand-over", 4096).await.unwrap(),
        Some(vec![7; 2048])
    );
    assert!(bucket.exists("controller/hand-over").await.unwrap());
    bucket.delete("controller/hand-over").await.unwrap();
    assert!(!bucket.exists("controller/hand-over").await.unwrap());
    assert_eq!(
        bucket.get("controller/hand-over", 4096).await.unwrap(),
        None
    );

    // The environment's removal takes the bucket and what it holds.
    p.destroy_environment().await.unwrap();
    let gone = raw_s3(&acct)
        .await
        .head_bucket()
        .bucket(bucket.name())
        .send()
        .await;
    assert!(gone.is_err(), "the bucket is deleted");
    assert_eq!(
        bucket.destroy().await.unwrap(),
        storage::Removed::default(),
        "a second removal finds nothing to do"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_that_is_not_the_environments_is_never_written_nor_deleted() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let name = format!(
        "jujube-test-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    // Someone's bucket, untagged, with something in it.
    let s3 = raw_s3(&acct).await;
    s3.create_bucket().bucket(&name).send().await.unwrap();
    s3.put_object()
        .bucket(&name)
        .key("theirs")
        .body(b"keep me".to_vec().into())
        .send()
        .await
        .unwrap();
    let uuid = uuid::Uuid::new_v4().to_string();
    let p = provider(&acct, &uuid, config(&[("control-bucket", &name)])).await;
    let err = p.control_bucket().ensure().await.unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "S3 bucket `{name}` exists and is not this environment's"
        )) && err.contains("--config control-bucket="),
        "{err}"
    );
    let err = p.destroy_environment().await.unwrap_err().to_string();
    assert!(err.contains("is not this environment's"), "{err}");
    let kept = s3.get_object().bucket(&name).key("theirs").send().await;
    assert!(kept.is_ok(), "their object is untouched");

    // A name S3 would refuse is refused before anything is made.
    let err = Ec2Provider::new(
        "test",
        &uuid,
        &config(&[("control-bucket", "Not_A_Bucket")]),
        None,
    )
    .await
    .err()
    .expect("refused")
    .to_string();
    assert!(
        err.contains("`control-bucket` `Not_A_Bucket` is not a valid S3 bucket name"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_role_and_instance_profile_are_made_once_and_removed_with_the_environment()
{
    let Some(()) = localstack() else { return };
    let acct = account();
    let uuid = uuid::Uuid::new_v4().to_string();
    let p = provider(&acct, &uuid, config(&[])).await;
    let profile = p.controller_profile();
    let name = format!("jujube-{uuid}");
    assert_eq!(profile.name(), name);
    profile.ensure(&format!("jujube-{uuid}")).await.unwrap();
    profile
        .ensure(&format!("jujube-{uuid}"))
        .await
        .expect("making them again completes nothing twice");

    let iam = raw_iam(&acct).await;
    let got = iam
        .get_instance_profile()
        .instance_profile_name(&name)
        .send()
        .await
        .unwrap();
    let roles: Vec<&str> = got
        .instance_profile()
        .unwrap()
        .roles()
        .iter()
        .map(|r| r.role_name())
        .collect();
    assert_eq!(roles, [name.as_str()], "the profile holds the role once");
    for tags in [
        iam.list_role_tags()
            .role_name(&name)
            .send()
            .await
            .unwrap()
            .tags()
            .to_vec(),
        iam.list_instance_profile_tags()
            .instance_profile_name(&name)
            .send()
            .await
            .unwrap()
            .tags()
            .to_vec(),
    ] {
        assert!(tags
            .iter()
            .any(|t| t.key() == "jujube-env-uuid" && t.value() == uuid));
    }
    let policy = iam
        .get_role_policy()
        .role_name(&name)
        .policy_name("jujube-controller")
        .send()
        .await
        .unwrap();
    let doc = urlencoding_decode(policy.policy_document());
    assert!(
        doc.contains(&format!("arn:aws:s3:::jujube-{uuid}/*")) && doc.contains("ec2:RunInstances"),
        "{doc}"
    );
    // Of IAM, only passing its own role to EC2 (launching `enable-ha`'s
    // controllers as machine 0 was).
    let parsed: serde_json::Value = serde_json::from_str(&doc).unwrap();
    let iam_grants: Vec<&serde_json::Value> = parsed["Statement"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|st| st["Action"].to_string().contains("iam:"))
        .collect();
    assert_eq!(iam_grants.len(), 1, "{doc}");
    assert_eq!(iam_grants[0]["Action"], serde_json::json!(["iam:PassRole"]));
    assert_eq!(
        iam_grants[0]["Resource"],
        serde_json::json!(format!("arn:aws:iam::*:role/{name}"))
    );
    assert_eq!(
        iam_grants[0]["Condition"]["StringEquals"]["iam:PassedToService"],
        "ec2.amazonaws.com"
    );

    p.destroy_environment().await.unwrap();
    assert!(iam.get_role().role_name(&name).send().await.is_err());
    assert!(iam
        .get_instance_profile()
        .instance_profile_name(&name)
        .send()
        .await
        .is_err());
    assert_eq!(
        profile.destroy().await.unwrap(),
        jujube_providers::ec2::profile::Removed::default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_of_the_same_name_that_is_not_the_environments_is_left_alone() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let uuid = uuid::Uuid::new_v4().to_string();
    let name = format!("jujube-{uuid}");
    let iam = raw_iam(&acct).await;
    iam.create_role()
        .role_name(&name)
        .assume_role_policy_document("{}")
        .send()
        .await
        .unwrap();
    let p = provider(&acct, &uuid, config(&[])).await;
    let err = p
        .controller_profile()
        .ensure(&name)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "IAM role `{name}` exists and is not this environment's"
        )),
        "{err}"
    );
    let err = p.destroy_environment().await.unwrap_err().to_string();
    assert!(err.contains("is not this environment's"), "{err}");
    assert!(iam.get_role().role_name(&name).send().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_port_opens_to_a_range_and_an_instance_says_its_addresses() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let uuid = uuid::Uuid::new_v4().to_string();
    let p = provider(&acct, &uuid, config(&[])).await;
    p.open_port(17070, "203.0.113.0/24").await.unwrap();
    p.open_port(17070, "203.0.113.0/24")
        .await
        .expect("opening it twice is no error");
    let groups = crate::ec2::raw_client(&acct)
        .describe_security_groups()
        .group_names(format!("jujube-{uuid}"))
        .send()
        .await
        .unwrap();
    let rules: Vec<(i32, String)> = groups.security_groups()[0]
        .ip_permissions()
        .iter()
        .flat_map(|r| {
            r.ip_ranges().iter().map(|ip| {
                (
                    r.from_port().unwrap_or(0),
                    ip.cidr_ip().unwrap_or("").to_string(),
                )
            })
        })
        .collect();
    assert!(
        rules.contains(&(17070, "203.0.113.0/24".to_string())),
        "{rules:?}"
    );
    assert!(rules.contains(&(22, "0.0.0.0/0".to_string())), "{rules:?}");
    // And to the environment's own instances, whatever the range.
    let group = &groups.security_groups()[0];
    let own = group.ip_permissions().iter().any(|r| {
        r.from_port() == Some(17070)
            && r.user_id_group_pairs()
                .iter()
                .any(|g| g.group_id() == group.group_id())
    });
    assert!(own, "{:?}", group.ip_permissions());

    let inst = p
        .start_instance(&jujube_providers::StartSpec {
            machine_id: "0".into(),
            nonce: uuid::Uuid::new_v4().to_string(),
            series: "jammy".into(),
            constraints: jujube_core::Constraints::default(),
            zone: None,
            controller: true,
            user_data: String::new(),
            agent: None,
        })
        .await
        .unwrap();
    let addrs = p.addresses(&inst.id).await.unwrap();
    assert!(addrs.private.is_some(), "{addrs:?}");
    let err = p.addresses("i-0123456789abcdef0").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("no instance `i-0123456789abcdef0`"),
        "{err}"
    );
    p.stop_instances(std::slice::from_ref(&inst.id))
        .await
        .unwrap();
    p.destroy_environment().await.unwrap();
}

/// IAM returns policy documents URL-encoded.
fn urlencoding_decode(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `destroy-environment` stopped part-way (here: the role has a policy
/// someone attached by hand, so IAM refuses to delete it) says what is in
/// the way; run again once it is out of the way, it removes what is left,
/// taking what is gone already as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_stopped_part_way_is_finished_by_the_next_one() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let uuid = uuid::Uuid::new_v4().to_string();
    let p = provider(&acct, &uuid, config(&[])).await;
    let name = format!("jujube-{uuid}");
    let bucket = p.control_bucket();
    bucket.ensure().await.unwrap();
    bucket
        .put_private("controller/take-up-x", b"state".to_vec())
        .await
        .unwrap();
    p.controller_profile().ensure(&name).await.unwrap();
    p.open_port(17070, "0.0.0.0/0").await.unwrap();
    let iam = raw_iam(&acct).await;
    let policy = iam
        .create_policy()
        .policy_name(format!("attached-by-hand-{uuid}"))
        .policy_document(
            r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:ListAllMyBuckets","Resource":"*"}]}"#,
        )
        .send()
        .await
        .unwrap();
    let arn = policy.policy().unwrap().arn().unwrap().to_string();
    iam.attach_role_policy()
        .role_name(&name)
        .policy_arn(&arn)
        .send()
        .await
        .unwrap();

    let e = p.destroy_environment().await.unwrap_err().to_string();
    assert!(
        e.contains(&format!("IAM role `{name}`"))
            && e.contains("is still in use")
            && e.contains("then run `destroy-environment` again"),
        "{e}"
    );
    assert!(
        iam.get_role().role_name(&name).send().await.is_ok(),
        "the role stays while its policy is attached"
    );

    iam.detach_role_policy()
        .role_name(&name)
        .policy_arn(&arn)
        .send()
        .await
        .unwrap();
    // It says what it removed: what the first run left (the profile went
    // before the role refused), no more.
    let removed = p
        .remove_environment_resources()
        .await
        .expect("the second run finishes the job");
    assert_eq!(removed, [format!("the IAM role `{name}`")]);
    assert!(iam.get_role().role_name(&name).send().await.is_err());
    assert!(iam
        .get_instance_profile()
        .instance_profile_name(&name)
        .send()
        .await
        .is_err());
    let s3 = raw_s3(&acct).await;
    assert!(s3.head_bucket().bucket(&name).send().await.is_err());
    let groups = crate::ec2::raw_client(&acct)
        .describe_security_groups()
        .send()
        .await
        .unwrap();
    assert!(!groups
        .security_groups()
        .iter()
        .any(|g| g.group_name() == Some(name.as_str())));
    assert!(p
        .remove_environment_resources()
        .await
        .expect("and a third has nothing to do")
        .is_empty());
}
