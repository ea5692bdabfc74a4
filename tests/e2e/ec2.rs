//! The EC2 provider against a real LocalStack (started by `localstack/start`;
//! `scripts/test` does it). These tests fail when LocalStack is not there;
//! `JUJUBE_SKIP_EC2=1` skips them knowingly. Each test works in an account
//! of its own (LocalStack takes a 12-digit access key id as the account), so
//! tests never see each other's instances.

use crate::Jujube;
use aws_sdk_ec2::config::Credentials;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextMut,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_runtime_api::http::{Response, StatusCode};
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::config_bag::ConfigBag;
use jujube_core::Constraints;
use jujube_providers::conformance::{run_all, Subject};
use jujube_providers::ec2::Ec2Provider;
use jujube_providers::Provider;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(crate) const ENDPOINT: &str = "http://127.0.0.1:4566";
pub(crate) const REGION: &str = "us-east-1";

/// None when the EC2 tests are skipped on purpose; panics when LocalStack is
/// simply not there.
pub(crate) fn localstack() -> Option<()> {
    if std::env::var("JUJUBE_SKIP_EC2").as_deref() == Ok("1") {
        eprintln!("JUJUBE_SKIP_EC2=1: skipping an EC2 test");
        return None;
    }
    if std::net::TcpStream::connect_timeout(
        &"127.0.0.1:4566".parse().unwrap(),
        Duration::from_secs(2),
    )
    .is_err()
    {
        panic!("LocalStack is not running at {ENDPOINT}: start it with `localstack/start` (scripts/test does), or set JUJUBE_SKIP_EC2=1 to skip the EC2 tests knowingly");
    }
    Some(())
}

pub(crate) fn account() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let n = N.fetch_add(1, Ordering::Relaxed) as u64;
    format!(
        "{:012}",
        (t * 7 + n * 7919 + std::process::id() as u64) % 900_000_000_000 + 100_000_000_000
    )
}

fn config() -> BTreeMap<String, String> {
    [("region", REGION), ("endpoint", ENDPOINT)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn provider(account: &str, uuid: &str, extra: Option<Arc<dyn Intercept>>) -> Ec2Provider {
    provider_with(account, uuid, extra, config()).await
}

async fn provider_with(
    account: &str,
    uuid: &str,
    extra: Option<Arc<dyn Intercept>>,
    cfg: BTreeMap<String, String>,
) -> Ec2Provider {
    let creds = Credentials::new(account, "test", None, None, "jujube-tests");
    Ec2Provider::new_with(
        "test",
        uuid,
        &cfg,
        Some(creds),
        Some(Box::new(move |mut b: aws_sdk_ec2::config::Builder| {
            if let Some(i) = extra {
                b = b.interceptor(SharedIntercept(i));
            }
            b
        })),
    )
    .await
    .unwrap()
}

#[derive(Debug)]
struct SharedIntercept(Arc<dyn Intercept>);

impl Intercept for SharedIntercept {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn modify_before_transmit(
        &self,
        c: &mut BeforeTransmitInterceptorContextMut<'_>,
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.modify_before_transmit(c, rc, cfg)
    }
    fn modify_before_deserialization(
        &self,
        c: &mut BeforeDeserializationInterceptorContextMut<'_>,
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.modify_before_deserialization(c, rc, cfg)
    }
}

fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The account's pending and running instances, whoever launched them.
pub(crate) async fn live_instances(account: &str) -> Vec<aws_sdk_ec2::types::Instance> {
    raw_client(account)
        .describe_instances()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("instance-state-name")
                .values("pending")
                .values("running")
                .build(),
        )
        .send()
        .await
        .unwrap()
        .reservations()
        .iter()
        .flat_map(|r| r.instances().to_vec())
        .collect()
}

/// An instance's user data, decoded.
pub(crate) async fn user_data_of(account: &str, id: &str) -> String {
    use base64::Engine;
    let attr = raw_client(account)
        .describe_instance_attribute()
        .instance_id(id)
        .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
        .send()
        .await
        .unwrap();
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(attr.user_data().and_then(|u| u.value()).unwrap())
            .unwrap(),
    )
    .unwrap()
}

pub(crate) fn raw_client(account: &str) -> aws_sdk_ec2::Client {
    let conf = aws_sdk_ec2::Config::builder()
        .behavior_version(aws_sdk_ec2::config::BehaviorVersion::latest())
        .region(aws_sdk_ec2::config::Region::new(REGION))
        .endpoint_url(ENDPOINT)
        .credentials_provider(Credentials::new(
            account,
            "test",
            None,
            None,
            "jujube-tests",
        ))
        .build();
    aws_sdk_ec2::Client::from_conf(conf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ec2_passes_the_conformance_suite_against_localstack() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let (ours, theirs) = (uuid(), uuid());
    let s = Subject {
        provider: Arc::new(provider(&acct, &ours, None).await),
        env_uuid: ours,
        other: Arc::new(provider(&acct, &theirs, None).await),
        satisfiable: Constraints::parse("mem=2G").unwrap(),
        unsatisfiable: Constraints::parse("mem=100000G").unwrap(),
        series: "jammy".into(),
        settle: Duration::from_secs(10),
    };
    let failures = run_all(&s).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_canonicals_newest_for_the_series_and_arch() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let p = provider(&acct, &uuid(), None).await;
    let start = |series: &str, cons: &str, m: &str| jujube_providers::StartSpec {
        machine_id: m.into(),
        nonce: format!("n-{m}-{}", uuid()),
        series: series.into(),
        constraints: Constraints::parse(cons).unwrap(),
        zone: None,
        controller: false,
        user_data: String::new(),
        agent: None,
    };
    let raw = raw_client(&acct);
    let image_of = |id: String| {
        let raw = raw.clone();
        async move {
            let r = raw
                .describe_instances()
                .instance_ids(id)
                .send()
                .await
                .unwrap();
            r.reservations()[0].instances()[0]
                .image_id()
                .unwrap()
                .to_string()
        }
    };
    let i = p.start_instance(&start("jammy", "", "1")).await.unwrap();
    assert_eq!(
        image_of(i.id).await,
        "ami-0f3a9d1c2b4e50002",
        "the newer of two jammy amd64 images"
    );
    let i = p
        .start_instance(&start("noble", "arch=arm64", "2"))
        .await
        .unwrap();
    assert_eq!(image_of(i.id.clone()).await, "ami-0f3a9d1c2b4e50005");
    assert!(i.hardware.contains("arch=arm64"), "{}", i.hardware);
    let e = p
        .start_instance(&start("bionic", "", "3"))
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "invalid instance spec: no Ubuntu image for series `bionic` and arch `amd64` in region `us-east-1`; set `image-id` to use your own");
}

/// What a fault interceptor does to RunInstances.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Answer `RequestLimitExceeded` without sending.
    Throttle,
    /// Answer `InsufficientInstanceCapacity` for one zone.
    NoCapacityIn(&'static str),
    /// Answer `Unsupported` (the type is not offered there) for one zone.
    UnsupportedIn(&'static str),
    /// Count calls, change nothing.
    Count,
    /// Let the launch happen, then lose the response.
    LoseResponse,
}

#[derive(Debug)]
struct Faulty {
    fault: Fault,
    remaining: AtomicUsize,
    calls: AtomicUsize,
    zones: Mutex<Vec<String>>,
    /// Set when the request in flight is to fail; calls here are sequential.
    armed: std::sync::atomic::AtomicBool,
}

impl Faulty {
    fn new(fault: Fault, times: usize) -> Arc<Faulty> {
        Arc::new(Faulty {
            fault,
            remaining: AtomicUsize::new(times),
            calls: AtomicUsize::new(0),
            zones: Mutex::new(vec![]),
            armed: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

fn error_response(status: u16, code: &str) -> Response {
    let xml = format!("<Response><Errors><Error><Code>{code}</Code><Message>injected by the test</Message></Error></Errors><RequestID>t-1</RequestID></Response>");
    Response::new(StatusCode::try_from(status).unwrap(), SdkBody::from(xml))
}

impl Intercept for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn modify_before_transmit(
        &self,
        c: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if cfg.load::<Metadata>().map(|m| m.name()) != Some("RunInstances") {
            return Ok(());
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        let body =
            String::from_utf8_lossy(c.request().body().bytes().unwrap_or_default()).to_string();
        let zone = body
            .split('&')
            .find_map(|kv| kv.strip_prefix("Placement.AvailabilityZone="))
            .unwrap_or("")
            .to_string();
        self.zones.lock().unwrap().push(zone.clone());
        let hit = match self.fault {
            Fault::NoCapacityIn(z) | Fault::UnsupportedIn(z) => zone == z,
            Fault::Count => false,
            _ => self.remaining.load(Ordering::SeqCst) > 0,
        };
        if hit {
            let _ = self
                .remaining
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            self.armed.store(true, Ordering::SeqCst);
            if self.fault != Fault::LoseResponse {
                // A throttled or refused launch never reaches the server:
                // send something harmless instead, and answer with the fault.
                let harmless = "Action=DescribeAvailabilityZones&Version=2016-11-15";
                *c.request_mut().body_mut() = SdkBody::from(harmless);
                c.request_mut()
                    .headers_mut()
                    .insert("content-length", harmless.len().to_string());
            }
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        c: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if cfg.load::<Metadata>().map(|m| m.name()) != Some("RunInstances")
            || !self.armed.swap(false, Ordering::SeqCst)
        {
            return Ok(());
        }
        *c.response_mut() = match self.fault {
            Fault::Throttle => error_response(503, "RequestLimitExceeded"),
            Fault::NoCapacityIn(_) => error_response(500, "InsufficientInstanceCapacity"),
            Fault::UnsupportedIn(_) => error_response(400, "Unsupported"),
            Fault::LoseResponse => error_response(500, "InternalError"),
            Fault::Count => unreachable!("never armed"),
        };
        Ok(())
    }
}

/// A provisioner over a real SQLite store and a faulty EC2 provider.
async fn provision_one(
    fault: Arc<Faulty>,
) -> (jujube_state::Machine, Ec2Provider, tempfile::TempDir) {
    let (mut ms, clean, dir, _) = provision_many(fault, 0, None).await;
    (ms.remove(0), clean, dir)
}

/// Machine 0 and `n` more (with constraints `cons`), provisioned by one
/// provisioner over a real SQLite store and a faulty EC2 provider.
async fn provision_many(
    fault: Arc<Faulty>,
    n: usize,
    cons: Option<&str>,
) -> (
    Vec<jujube_state::Machine>,
    Ec2Provider,
    tempfile::TempDir,
    String,
) {
    let acct = account();
    let env_uuid = uuid();
    let dir = tempfile::tempdir().unwrap();
    let store = jujube_state::Store::open(dir.path().join("state.db")).unwrap();
    let mut cfg = config();
    cfg.insert("provisioner-retry-for".into(), "2m".into());
    // One launch at a time: the fault interceptor arms one call at a time.
    cfg.insert("provisioner-concurrency".into(), "1".into());
    store
        .initialize(&jujube_state::environment::EnvironmentSpec {
            name: "test".into(),
            uuid: env_uuid.clone(),
            provider: "ec2".into(),
            default_series: "jammy".into(),
            constraints: Constraints::default(),
            config: cfg,
        })
        .unwrap();
    let faulty = Arc::new(provider(&acct, &env_uuid, Some(fault as Arc<dyn Intercept>)).await);
    let p = jujube_provisioner::Provisioner::new(store.clone(), faulty.clone()).unwrap();
    let cons = cons.map(|c| Constraints::parse(c).unwrap());
    let mut ids = vec![0];
    ids.extend(store.add_machines(n, None, cons.as_ref()).unwrap());
    let failed = p.provision_now(&ids).await.unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    (
        ids.iter().map(|id| store.machine(*id).unwrap()).collect(),
        provider(&acct, &env_uuid, None).await,
        dir,
        acct,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_launches_are_retried_with_backoff() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::Throttle, 2);
    let t0 = std::time::Instant::now();
    let (m, clean, _dir) = provision_one(fault.clone()).await;
    assert!(m.instance_id.is_some());
    assert_eq!(
        fault.calls.load(Ordering::SeqCst),
        3,
        "two throttled calls, then success"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "backed off between tries"
    );
    assert_eq!(clean.instances().await.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_errors_in_one_zone_fall_back_to_the_next() {
    let Some(()) = localstack() else { return };
    // Machine 0 is first sent to the first zone.
    let fault = Faulty::new(Fault::NoCapacityIn("us-east-1a"), usize::MAX);
    let (m, clean, _dir) = provision_one(fault.clone()).await;
    let zones = fault.zones.lock().unwrap().clone();
    assert_eq!(zones[0], "us-east-1a");
    assert_eq!(m.zone.as_deref(), Some(zones.last().unwrap().as_str()));
    assert_ne!(m.zone.as_deref(), Some("us-east-1a"));
    assert_eq!(clean.instances().await.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_not_offered_in_one_zone_moves_to_the_next() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::UnsupportedIn("us-east-1a"), usize::MAX);
    let (m, clean, _dir) = provision_one(fault.clone()).await;
    let zones = fault.zones.lock().unwrap().clone();
    assert_eq!(zones[0], "us-east-1a");
    assert!(m.instance_id.is_some(), "{}", m.status_info);
    assert_ne!(m.zone.as_deref(), Some("us-east-1a"));
    assert_eq!(clean.instances().await.unwrap().len(), 1);
}

/// Each machine's instance: distinct, listed, and the one its nonce names.
async fn one_instance_each(machines: &[jujube_state::Machine], clean: &Ec2Provider) {
    let listed = clean.instances().await.unwrap();
    assert_eq!(listed.len(), machines.len(), "{listed:#?}");
    for m in machines {
        let id = m.instance_id.as_deref().expect("provisioned");
        let i = listed.iter().find(|i| i.id == id).expect("listed");
        assert_eq!(i.nonce(), m.nonce.as_deref(), "machine {}", m.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_machines_cost_at_most_two_run_instances() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::Count, 0);
    // Two zones allowed: the machines spread over both, a batch each.
    let (machines, clean, _dir, _) =
        provision_many(fault.clone(), 20, Some("zones=us-east-1a,us-east-1b")).await;
    // Machine 0 (the controller) is a launch of its own.
    assert_eq!(fault.calls.load(Ordering::SeqCst), 1 + 2);
    one_instance_each(&machines, &clean).await;
    let zones: std::collections::BTreeSet<_> = machines[1..]
        .iter()
        .map(|m| m.zone.clone().unwrap())
        .collect();
    assert_eq!(zones.len(), 2, "{zones:?}");
    // Per-machine tags follow in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let listed = clean.instances().await.unwrap();
        let tagged = listed
            .iter()
            .filter(|i| {
                machines.iter().any(|m| {
                    m.instance_id.as_deref() == Some(i.id.as_str())
                        && i.machine_id() == Some(m.id.to_string().as_str())
                        && i.tag("Name") == Some(format!("jujube-test-{}", m.id).as_str())
                })
            })
            .count();
        if tagged == machines.len() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{tagged} of 21 tagged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_spread_over_every_zone_cost_one_run_instances_per_zone() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::Count, 0);
    let (machines, clean, _dir, _) = provision_many(fault.clone(), 20, None).await;
    let zones: std::collections::BTreeSet<_> = machines[1..]
        .iter()
        .map(|m| m.zone.clone().unwrap())
        .collect();
    assert_eq!(zones.len(), 6, "LocalStack has six zones: {zones:?}");
    assert_eq!(fault.calls.load(Ordering::SeqCst), 1 + 6);
    one_instance_each(&machines, &clean).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_launch_response_is_adopted_by_launch_index() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::LoseResponse, 2);
    // Machine 0's launch loses its response first, then the batch's.
    let (machines, clean, _dir, acct) =
        provision_many(fault.clone(), 5, Some("zones=us-east-1c")).await;
    assert_eq!(
        fault.remaining.load(Ordering::SeqCst),
        0,
        "both faults injected"
    );
    assert_eq!(
        fault.calls.load(Ordering::SeqCst),
        2,
        "the retries found the launched instances by nonce and by batch"
    );
    one_instance_each(&machines, &clean).await;
    // Instance k of the request is the machine whose nonce is `<batch>/k`.
    let raw = raw_client(&acct);
    for m in &machines[1..] {
        let (_, k) = jujube_providers::launch_batch(m.nonce.as_deref().unwrap()).unwrap();
        let r = raw
            .describe_instances()
            .instance_ids(m.instance_id.clone().unwrap())
            .send()
            .await
            .unwrap();
        let idx = r.reservations()[0].instances()[0]
            .ami_launch_index()
            .unwrap();
        assert_eq!(idx as u32, k, "machine {}", m.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_adopts_a_batch_a_crash_left_unrecorded() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let env_uuid = uuid();
    let dir = tempfile::tempdir().unwrap();
    let store = jujube_state::Store::open(dir.path().join("state.db")).unwrap();
    store
        .initialize(&jujube_state::environment::EnvironmentSpec {
            name: "test".into(),
            uuid: env_uuid.clone(),
            provider: "ec2".into(),
            default_series: "jammy".into(),
            constraints: Constraints::default(),
            config: config(),
        })
        .unwrap();
    let ids = store
        .add_machines(
            4,
            None,
            Some(&Constraints::parse("zones=us-east-1d").unwrap()),
        )
        .unwrap();
    // The first controller commits the batch and launches it, then dies
    // before recording (or tagging) anything.
    let prepared = store
        .prepare_batches(std::slice::from_ref(&ids), &env_uuid)
        .unwrap();
    let first = provider(&acct, &env_uuid, None).await;
    let specs: Vec<jujube_providers::StartSpec> = prepared
        .iter()
        .map(|p| jujube_providers::StartSpec {
            machine_id: p.machine.to_string(),
            nonce: p.nonce.clone(),
            series: "jammy".into(),
            constraints: Constraints::parse("zones=us-east-1d").unwrap(),
            zone: Some("us-east-1d".into()),
            controller: false,
            user_data: String::new(),
            agent: None,
        })
        .collect();
    let launched: Vec<String> = first
        .start_instances(&specs)
        .await
        .into_iter()
        .map(|r| r.unwrap().id)
        .collect();
    drop(first);
    let counter = Faulty::new(Fault::Count, 0);
    let second = Arc::new(
        provider(
            &acct,
            &env_uuid,
            Some(counter.clone() as Arc<dyn Intercept>),
        )
        .await,
    );
    let p = jujube_provisioner::Provisioner::new(store.clone(), second).unwrap();
    let failed = p.provision_now(&ids).await.unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(
        counter.calls.load(Ordering::SeqCst),
        0,
        "nothing launched again"
    );
    for (id, inst) in ids.iter().zip(&launched) {
        assert_eq!(store.machine(*id).unwrap().instance_id.as_ref(), Some(inst));
    }
    let clean = provider(&acct, &env_uuid, None).await;
    assert_eq!(clean.instances().await.unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_launch_response_never_makes_a_second_instance() {
    let Some(()) = localstack() else { return };
    let fault = Faulty::new(Fault::LoseResponse, 1);
    let (m, clean, _dir) = provision_one(fault.clone()).await;
    let listed = clean.instances().await.unwrap();
    assert_eq!(
        fault.remaining.load(Ordering::SeqCst),
        0,
        "the fault was injected"
    );
    assert_eq!(
        fault.calls.load(Ordering::SeqCst),
        1,
        "the retry found the launched instance by its nonce"
    );
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(m.instance_id.as_deref(), Some(listed[0].id.as_str()));
}

pub(crate) fn ec2_jujube(acct: &str) -> Jujube {
    let mut j = Jujube::new();
    j.envs = vec![
        ("AWS_ACCESS_KEY_ID".into(), acct.to_string()),
        ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ("AWS_CONFIG_FILE".into(), "/nonexistent".into()),
        ("AWS_SHARED_CREDENTIALS_FILE".into(), "/nonexistent".into()),
    ];
    j
}

/// Bootstraps environment `aws` on LocalStack, with `extra` config
/// (`KEY=VALUE` each).
pub(crate) fn ec2_bootstrap(j: &Jujube, extra: &[&str]) {
    let region = format!("region={REGION}");
    let endpoint = format!("endpoint={ENDPOINT}");
    let mut args = vec![
        "bootstrap",
        "aws",
        "--provider",
        "ec2",
        "--config",
        &region,
        "--config",
        &endpoint,
    ];
    for kv in extra {
        args.extend(["--config", kv]);
    }
    j.run(&args).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ec2_end_to_end_through_the_binary() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let j = ec2_jujube(&acct);
    let raw = raw_client(&acct);
    // Someone else's instance, launched directly, with no jujube tags.
    let foreign = raw
        .run_instances()
        .image_id("ami-0f3a9d1c2b4e50002")
        .instance_type(aws_sdk_ec2::types::InstanceType::T3Micro)
        .min_count(1)
        .max_count(1)
        .send()
        .await
        .unwrap()
        .instances()[0]
        .instance_id()
        .unwrap()
        .to_string();

    ec2_bootstrap(&j, &[]);
    let st = j.status();
    let env_uuid = st["environment"]["uuid"].as_str().unwrap().to_string();
    let ours = provider(&acct, &env_uuid, None).await;
    let m0 = st["machines"]["0"]["instance-id"]
        .as_str()
        .expect("machine 0 provisioned")
        .to_string();
    let listed = ours.instances().await.unwrap();
    let i0 = listed.iter().find(|i| i.id == m0).unwrap();
    assert_eq!(i0.tag("jujube-controller"), Some("true"));
    assert_eq!(i0.tag("Name"), Some("jujube-aws-0"));

    j.run(&[
        "deploy",
        &j.charm("wordpress"),
        "-n",
        "2",
        "--constraints",
        "mem=3G",
    ])
    .ok();
    j.run(&[
        "deploy",
        &j.charm("mysql"),
        "--constraints",
        "cores=8 mem=64G",
    ])
    .ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let st = j.status();
    let hw = |m: &str| {
        st["machines"][m]["hardware"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(hw("1").contains("instance-type=t3.medium"), "{}", hw("1"));
    assert!(hw("2").contains("instance-type=t3.medium"), "{}", hw("2"));
    assert!(hw("3").contains("instance-type=r5.2xlarge"), "{}", hw("3"));
    assert_ne!(
        st["machines"]["1"]["zone"], st["machines"]["2"]["zone"],
        "a service's machines spread over zones"
    );

    // Destroy: the instance is terminated and the machine removed.
    let i1 = st["machines"]["1"]["instance-id"]
        .as_str()
        .unwrap()
        .to_string();
    j.run(&["destroy-unit", "wordpress/0"]).ok();
    j.run(&["destroy-machine", "1"]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    assert!(j.status()["machines"].get("1").is_none());
    assert!(
        ours.instances_by_id(&[i1]).await.unwrap().is_empty(),
        "machine 1's instance terminated"
    );
    drop(ctl);

    j.run(&["destroy-environment", "aws", "-y"]).ok();
    assert!(
        ours.instances().await.unwrap().is_empty(),
        "nothing of the environment left running"
    );
    let groups = raw
        .describe_security_groups()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("group-name")
                .values(format!("jujube-{env_uuid}"))
                .build(),
        )
        .send()
        .await
        .unwrap();
    assert!(
        groups.security_groups().is_empty(),
        "security group deleted"
    );
    let r = raw
        .describe_instances()
        .instance_ids(&foreign)
        .send()
        .await
        .unwrap();
    let state = r.reservations()[0].instances()[0]
        .state()
        .unwrap()
        .name()
        .unwrap()
        .as_str()
        .to_string();
    assert_eq!(
        state, "running",
        "an instance without the environment's tags survives everything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_controller_mid_batch_never_duplicates_or_leaks_instances() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let j = ec2_jujube(&acct);
    ec2_bootstrap(
        &j,
        &[
            "provisioner-batch=4",
            "provisioner-concurrency=1",
            "harvest-interval=1s",
            "harvest-grace=2s",
        ],
    );
    let env_uuid = j.status()["environment"]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    j.run(&[
        "add-machine",
        "-n",
        "40",
        "--constraints",
        "zones=us-east-1a",
    ])
    .ok();
    let ours = provider(&acct, &env_uuid, None).await;
    let mut seed = std::process::id() as u64 | 1;
    let mut mid_way = 0;
    for trial in 0..5 {
        let before = ours.instances().await.unwrap().len();
        let ctl = j.controller();
        // A controller spends a while starting (instance types, images, the
        // security group): kill it at a random moment after its first
        // launch of this run.
        let t0 = std::time::Instant::now();
        while ours.instances().await.unwrap().len() == before
            && t0.elapsed() < Duration::from_secs(60)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // All 40 machines were recorded within 1.4 s of the first launch in
        // a run here, and once within 366 ms: kill within its first 150 ms,
        // while it is under way.
        let ms = seed % 150;
        std::thread::sleep(Duration::from_millis(ms));
        ctl.kill9();
        let done = j.provisioned();
        let launched = ours.instances().await.unwrap().len();
        eprintln!(
            "trial {trial}: killed {ms} ms after a launch with {done} of 41 machines provisioned, {launched} instances launched"
        );
        // Mid-way: some launched, not all recorded.
        if launched > 1 && done < 41 {
            mid_way += 1;
        }
        if done == 41 {
            break;
        }
    }
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "180s"]).ok();
    let st = j.status();
    let machines = st["machines"].as_object().unwrap();
    assert_eq!(machines.len(), 41);
    let ours = provider(&acct, &env_uuid, None).await;
    // Listings settle: nothing of ours beyond the machines' instances.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let listed = loop {
        let listed = ours.instances().await.unwrap();
        if listed.len() <= 41 || std::time::Instant::now() > deadline {
            break listed;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let mut per_nonce: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for i in &listed {
        per_nonce
            .entry(i.nonce().unwrap_or("").to_string())
            .or_default()
            .push(i.id.clone());
    }
    for (id, m) in machines {
        let inst = m["instance-id"]
            .as_str()
            .unwrap_or_else(|| panic!("machine {id}: {m}"));
        let with_id: Vec<_> = listed.iter().filter(|i| i.id == inst).collect();
        assert_eq!(with_id.len(), 1, "machine {id}'s instance {inst} is listed");
        let same_nonce = &per_nonce[with_id[0].nonce().unwrap()];
        assert_eq!(
            same_nonce.len(),
            1,
            "machine {id} has instances {same_nonce:?}"
        );
    }
    assert_eq!(listed.len(), 41, "no strays left: {listed:#?}");
    assert!(st.get("strays").is_none(), "{:?}", st.get("strays"));
    assert!(
        mid_way >= 1,
        "the kills must land while provisioning is under way ({mid_way} did)"
    );
    drop(ctl);
    j.run(&["destroy-environment", "aws", "-y"]).ok();
}

/// Records the instance profile each RunInstances names, and takes it out
/// before sending: LocalStack's EC2 cannot attach IAM's profiles (see
/// localstack/NOTES.md).
#[derive(Debug, Default)]
struct ProfileSpy {
    profiles: Mutex<Vec<Option<String>>>,
}

impl Intercept for ProfileSpy {
    fn name(&self) -> &'static str {
        "profile-spy"
    }

    fn modify_before_transmit(
        &self,
        c: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if cfg.load::<Metadata>().map(|m| m.name()) != Some("RunInstances") {
            return Ok(());
        }
        let body =
            String::from_utf8_lossy(c.request().body().bytes().unwrap_or_default()).to_string();
        let (profile, rest): (Vec<&str>, Vec<&str>) = body
            .split('&')
            .partition(|kv| kv.starts_with("IamInstanceProfile."));
        self.profiles.lock().unwrap().push(
            profile
                .iter()
                .find_map(|kv| kv.strip_prefix("IamInstanceProfile.Name="))
                .map(str::to_string),
        );
        let sent = rest.join("&");
        c.request_mut()
            .headers_mut()
            .insert("content-length", sent.len().to_string());
        *c.request_mut().body_mut() = SdkBody::from(sent);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_0_is_launched_with_the_controllers_profile_and_boot_script_and_no_other_is() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let spy = Arc::new(ProfileSpy::default());
    let p = provider(&acct, &uuid(), Some(spy.clone() as Arc<dyn Intercept>)).await;
    let boot = "#!/bin/sh\necho machine 0 installs the controller\n";
    p.launch_controller_with(jujube_providers::ec2::ControllerLaunch {
        user_data: boot.into(),
        instance_profile: Some("jujube-controller-profile".into()),
    });
    let spec = |machine: &str, controller: bool| jujube_providers::StartSpec {
        machine_id: machine.into(),
        nonce: uuid(),
        series: "jammy".into(),
        constraints: Constraints::default(),
        zone: None,
        controller,
        user_data: format!("#cloud-config\n# machine {machine}\n"),
        agent: None,
    };
    let m0 = p.start_instance(&spec("0", true)).await.unwrap();
    let m1 = p.start_instance(&spec("1", false)).await.unwrap();
    assert_eq!(
        *spy.profiles.lock().unwrap(),
        [Some("jujube-controller-profile".to_string()), None]
    );
    assert_eq!(user_data_of(&acct, &m0.id).await, boot);
    assert_eq!(
        user_data_of(&acct, &m1.id).await,
        "#cloud-config\n# machine 1\n"
    );
    p.stop_instances(&[m0.id, m1.id]).await.unwrap();
    p.destroy_environment().await.unwrap();
}

/// `enable-ha`'s controller machines taken up from the control bucket: a
/// launch batch of them is launched one by one (each boots from user data
/// of its own), each with the instance profile it names and the controller's
/// boot script running its `take-up`; its files wait in the bucket, private,
/// under its key, and the binary once under its SHA-256. A retried start
/// adopts what it launched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controllers_taken_up_from_the_bucket_launch_one_by_one_with_their_profile_and_files() {
    let Some(()) = localstack() else { return };
    let acct = account();
    let spy = Arc::new(ProfileSpy::default());
    let p = provider(&acct, &uuid(), Some(spy.clone() as Arc<dyn Intercept>)).await;
    let bucket = p.control_bucket();
    bucket.ensure().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let binary = dir.path().join("jujube");
    std::fs::write(&binary, b"#!/bin/sh\necho a controller\n").unwrap();
    let batch = uuid();
    let spec = |m: u32| jujube_providers::StartSpec {
        machine_id: m.to_string(),
        nonce: jujube_providers::batch_nonce(&batch, m - 1),
        series: "jammy".into(),
        constraints: Constraints::default(),
        zone: None,
        controller: true,
        user_data: String::new(),
        agent: Some(jujube_providers::AgentInstall {
            conf: Vec::new(),
            binary: binary.clone(),
            api_connect: String::new(),
            other_controllers: Vec::new(),
            enrollment: None,
            controller: Some(jujube_providers::ControllerInstall {
                files: Vec::new(),
                api_listen: String::new(),
                state_db: None,
                take_up: Some(jujube_providers::TakeUpInstall {
                    bundle: format!("machine {m}'s files").into_bytes(),
                    key: format!("controller/take-up-{m}-x"),
                    args: vec!["take-up".into(), format!("--machine={m}")],
                    instance_profile: Some("jujube-controllers".into()),
                }),
            }),
        }),
    };
    let specs = [spec(1), spec(2)];
    let started: Vec<String> = p
        .start_instances(&specs)
        .await
        .into_iter()
        .map(|r| r.unwrap().id)
        .collect();
    assert_ne!(started[0], started[1]);
    assert_eq!(
        *spy.profiles.lock().unwrap(),
        [
            Some("jujube-controllers".to_string()),
            Some("jujube-controllers".to_string())
        ]
    );
    let sha: String = {
        use sha2::Digest;
        sha2::Sha256::digest(std::fs::read(&binary).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    for (m, id) in [1, 2].iter().zip(&started) {
        let script = user_data_of(&acct, id).await;
        assert!(
            script.contains(&format!("/jujube take-up --machine={m}")),
            "{script}"
        );
        assert!(script.contains(&sha), "{script}");
        assert!(script.contains("X-Amz-Expires="), "{script}");
        assert!(!script.contains("'s files"), "{script}");
        assert_eq!(
            bucket
                .get(&format!("controller/take-up-{m}-x"), 1 << 10)
                .await
                .unwrap(),
            Some(format!("machine {m}'s files").into_bytes())
        );
    }
    assert!(bucket.exists(&format!("tools/jujube-{sha}")).await.unwrap());
    // Retried: the same instances, nothing launched again.
    let again: Vec<String> = p
        .start_instances(&specs)
        .await
        .into_iter()
        .map(|r| r.unwrap().id)
        .collect();
    assert_eq!(again, started);
    assert_eq!(spy.profiles.lock().unwrap().len(), 2);
    // One ended before it was recorded: an error that says so, no launch
    // (a fresh key and URL would make EC2 refuse the nonce's token forever).
    p.stop_instances(&started[..1]).await.unwrap();
    let err = p.start_instance(&specs[0]).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("was terminated before it was recorded"),
        "{err}"
    );
    assert_eq!(spy.profiles.lock().unwrap().len(), 2);
    p.stop_instances(&started).await.unwrap();
    p.destroy_environment().await.unwrap();
}

/// A bootstrap that fails part-way says which step did not come, exits 1,
/// and leaves nothing: no instance, bucket, security group, role or
/// profile with the UUID, no environment in this home. Here once at the
/// launch (LocalStack's EC2 cannot attach the profile bootstrap made), once
/// waiting for machine 0 to take up the controller (nothing runs its user
/// data) past `bootstrap-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_that_fails_part_way_says_where_and_removes_what_it_made() {
    let Some(()) = localstack() else { return };
    for (extra, step, why) in [
        (
            "bootstrap-timeout=10m",
            "starting machine 0's instance",
            "NoSuchEntity: Instance profile jujube-",
        ),
        (
            "instance-profile=none",
            "waiting for machine 0 to fetch its tools and take up the controller",
            "machine 0 did not take up the controller within the `bootstrap-timeout`",
        ),
    ] {
        let acct = account();
        let mut j = ec2_jujube(&acct);
        j.auto_controller = true;
        j.start_controllers = false;
        let r = j.run(&[
            "bootstrap",
            "aws",
            "--provider",
            "ec2",
            "--config",
            &format!("region={REGION}"),
            "--config",
            &format!("endpoint={ENDPOINT}"),
            "--config",
            "bootstrap-timeout=3s",
            "--config",
            extra,
        ]);
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(
            r.stderr
                .contains(&format!("error: bootstrap failed while {step}: "))
                && r.stderr.contains(why),
            "{}",
            r.stderr
        );
        // It says what it removed: the group and the bucket always, the
        // profile and role where it made them.
        assert!(
            r.stderr.contains("removed ")
                && r.stderr.contains("the security group `jujube-")
                && r.stderr.contains("the S3 bucket `jujube-"),
            "{}",
            r.stderr
        );
        assert_eq!(
            r.stderr.contains("the IAM role `jujube-"),
            extra != "instance-profile=none",
            "{}",
            r.stderr
        );
        assert!(!j.home.path().join("environments/aws").exists());
        let live: Vec<_> = live_instances(&acct)
            .await
            .iter()
            .filter_map(|i| i.instance_id().map(str::to_string))
            .collect();
        let raw = raw_client(&acct);
        assert!(live.is_empty(), "{live:?}");
        let groups = raw.describe_security_groups().send().await.unwrap();
        assert!(
            !groups
                .security_groups()
                .iter()
                .any(|g| g.group_name().is_some_and(|n| n.starts_with("jujube-"))),
            "the group is gone"
        );
        let iam = crate::ec2_storage::raw_iam(&acct).await;
        let roles = iam.list_roles().send().await.unwrap();
        assert!(
            !roles
                .roles()
                .iter()
                .any(|r| r.role_name().starts_with("jujube-")),
            "the role is gone"
        );
        let profiles = iam.list_instance_profiles().send().await.unwrap();
        assert!(
            profiles.instance_profiles().is_empty(),
            "the profile is gone"
        );
        let s3 = crate::ec2_storage::raw_s3(&acct).await;
        let buckets = s3.list_buckets().send().await.unwrap();
        assert!(
            !buckets
                .buckets()
                .iter()
                .any(|b| b.name().is_some_and(|n| r.stderr.contains(n))),
            "the bucket is gone"
        );
    }
}
