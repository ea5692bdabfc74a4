//! The dummy cloud: the conformance suite, and each fault it injects.

use crate::conformance::{run_all, Subject};
use crate::dummy::{DummyProvider, LOG_FILE};
use crate::{ErrorClass, Provider, StartSpec};
use jujube_core::Constraints;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const UUID: &str = "11111111-2222-4333-8444-555555555555";
const OTHER: &str = "99999999-2222-4333-8444-555555555555";

fn cfg(kvs: &[(&str, &str)]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn spec(machine: &str, nonce: &str) -> StartSpec {
    StartSpec {
        machine_id: machine.into(),
        nonce: nonce.into(),
        series: "jammy".into(),
        constraints: Constraints::new(),
        zone: None,
        controller: false,
        user_data: String::new(),
        agent: None,
    }
}

fn subject(dir: &std::path::Path, config: BTreeMap<String, String>) -> Subject {
    Subject {
        provider: Arc::new(DummyProvider::open(dir, "test", UUID, &config).unwrap()),
        env_uuid: UUID.into(),
        other: Arc::new(DummyProvider::open(dir, "other", OTHER, &config).unwrap()),
        satisfiable: Constraints::parse("mem=4G cores=2").unwrap(),
        unsatisfiable: Constraints::parse("mem=1000G").unwrap(),
        series: "jammy".into(),
        settle: Duration::from_secs(2),
    }
}

#[tokio::test]
async fn dummy_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let failures = run_all(&subject(dir.path(), BTreeMap::new())).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(start_paused = true)]
async fn dummy_with_eventually_consistent_listings_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let failures = run_all(&subject(dir.path(), cfg(&[("dummy-listing-delay", "1s")]))).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test]
async fn the_cloud_persists_and_is_shared_between_processes() {
    let dir = tempfile::tempdir().unwrap();
    let a = DummyProvider::open(dir.path(), "test", UUID, &BTreeMap::new()).unwrap();
    let i = a.start_instance(&spec("1", "n1")).await.unwrap();
    // A second handle is as separate as another process: it replays the log.
    let b = DummyProvider::open(dir.path(), "test", UUID, &BTreeMap::new()).unwrap();
    assert_eq!(b.instances().await.unwrap(), vec![i.clone()]);
    // Idempotency holds across handles.
    assert_eq!(b.start_instance(&spec("1", "n1")).await.unwrap().id, i.id);
    b.stop_instances(std::slice::from_ref(&i.id)).await.unwrap();
    assert!(a.instances().await.unwrap().is_empty());
    // A partial line (a process killed mid-append) is ignored and does not
    // corrupt what comes after it.
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join(LOG_FILE))
        .unwrap()
        .write_all(b"{\"start\":{\"id\":\"i-tor")
        .unwrap();
    let c = DummyProvider::open(dir.path(), "test", UUID, &BTreeMap::new()).unwrap();
    let j = c.start_instance(&spec("2", "n2")).await.unwrap();
    let d = DummyProvider::open(dir.path(), "test", UUID, &BTreeMap::new()).unwrap();
    assert_eq!(d.instances().await.unwrap(), vec![j]);
}

#[tokio::test(start_paused = true)]
async fn start_latency_is_honoured() {
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-start-latency", "3s")])).unwrap();
    let t0 = tokio::time::Instant::now();
    p.start_instance(&spec("1", "n")).await.unwrap();
    assert_eq!(t0.elapsed(), Duration::from_secs(3));
}

#[tokio::test]
async fn chosen_machines_fail_with_the_chosen_class() {
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-fail-machines", "2,5")])).unwrap();
    p.start_instance(&spec("1", "a")).await.unwrap();
    let e = p.start_instance(&spec("2", "b")).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::InvalidSpec);
    assert!(
        e.to_string().contains("machine 2 is configured to fail"),
        "{e}"
    );
    p.update_config(&cfg(&[
        ("dummy-fail-machines", "2"),
        ("dummy-fail-class", "quota"),
    ]))
    .await
    .unwrap();
    assert_eq!(
        p.start_instance(&spec("2", "b")).await.unwrap_err().class(),
        ErrorClass::Quota
    );
    // Config changes apply to a live provider.
    p.update_config(&BTreeMap::new()).await.unwrap();
    p.start_instance(&spec("2", "b")).await.unwrap();
}

#[tokio::test]
async fn full_zones_answer_with_capacity_errors() {
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-full-zones", "zone-a")])).unwrap();
    let mut s = spec("1", "a");
    s.zone = Some("zone-a".into());
    let e = p.start_instance(&s).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Capacity);
    s.zone = Some("zone-b".into());
    assert_eq!(
        p.start_instance(&s).await.unwrap().zone.as_deref(),
        Some("zone-b")
    );
}

#[tokio::test]
async fn failure_rates_inject_each_class_at_about_its_rate() {
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-failure-rate", "transient:0.3")]))
        .unwrap();
    let mut failed = 0;
    for i in 0..1000 {
        if let Err(e) = p
            .start_instance(&spec(&i.to_string(), &format!("n{i}")))
            .await
        {
            assert_eq!(e.class(), ErrorClass::Transient);
            failed += 1;
        }
    }
    assert!(
        (220..380).contains(&failed),
        "{failed} of 1000 failed at rate 0.3"
    );
}

#[tokio::test]
async fn lost_responses_start_the_instance_and_a_retry_with_the_nonce_finds_it() {
    let p =
        DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-lost-response-rate", "1")])).unwrap();
    let e = p.start_instance(&spec("1", "n")).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Transient);
    let listed = p.instances().await.unwrap();
    assert_eq!(listed.len(), 1, "the instance started despite the error");
    p.update_config(&BTreeMap::new()).await.unwrap();
    assert_eq!(
        p.start_instance(&spec("1", "n")).await.unwrap().id,
        listed[0].id
    );
    assert_eq!(p.instances().await.unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn token_buckets_throttle_like_ec2() {
    let p = DummyProvider::in_memory(
        "t",
        UUID,
        &cfg(&[
            ("dummy-instance-bucket", "3/1"),
            ("dummy-request-bucket", "100/100"),
        ]),
    )
    .unwrap();
    let specs: Vec<StartSpec> = (0..5)
        .map(|i| spec(&i.to_string(), &format!("n{i}")))
        .collect();
    let results = p.start_instances(&specs).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 3);
    assert!(results[3..]
        .iter()
        .all(|r| r.as_ref().unwrap_err().class() == ErrorClass::Transient));
    tokio::time::advance(Duration::from_secs(2)).await;
    let results = p.start_instances(&specs[3..]).await;
    assert!(results.iter().all(|r| r.is_ok()));

    // The request bucket is RunInstances': one token per launch, whatever
    // its size; a launch batch takes its instances all or none.
    let p = DummyProvider::in_memory(
        "t",
        UUID,
        &cfg(&[
            ("dummy-request-bucket", "2/1"),
            ("dummy-instance-bucket", "8/1"),
        ]),
    )
    .unwrap();
    let batch: Vec<StartSpec> = (0..5)
        .map(|i| spec(&i.to_string(), &format!("b1/{i}")))
        .collect();
    assert!(p.start_instances(&batch).await.iter().all(|r| r.is_ok()));
    let second: Vec<StartSpec> = (0..5)
        .map(|i| spec(&(10 + i).to_string(), &format!("b2/{i}")))
        .collect();
    // 3 instance tokens left: the batch of 5 is refused whole.
    assert!(p
        .start_instances(&second)
        .await
        .iter()
        .all(|r| r.as_ref().unwrap_err().class() == ErrorClass::Transient));
    assert_eq!(p.api_stats().run_instances, 2);
    assert_eq!(p.api_stats().throttled, 1);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(p.start_instances(&second).await.iter().all(|r| r.is_ok()));
    assert_eq!(p.instances().await.unwrap().len(), 10);
    assert_eq!(p.api_stats().create_tags, 10, "one per batch member");

    // EC2 mode: every API has its documented bucket; DescribeInstances
    // holds 100 and refills 20 a second.
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-throttling", "ec2")])).unwrap();
    for _ in 0..100 {
        p.instances().await.unwrap();
    }
    assert_eq!(
        p.instances().await.unwrap_err().class(),
        ErrorClass::Transient
    );
    tokio::time::advance(Duration::from_millis(50)).await;
    p.instances().await.unwrap();
}

#[tokio::test]
async fn quota_caps_live_instances() {
    let p = DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-max-instances", "1")])).unwrap();
    let i = p.start_instance(&spec("1", "a")).await.unwrap();
    assert_eq!(
        p.start_instance(&spec("2", "b")).await.unwrap_err().class(),
        ErrorClass::Quota
    );
    p.stop_instances(&[i.id]).await.unwrap();
    p.start_instance(&spec("2", "b")).await.unwrap();
}

#[test]
fn the_catalogue_picks_the_smallest_type_that_fits() {
    use crate::dummy::choose_type;
    let c = |s: &str| choose_type(&Constraints::parse(s).unwrap());
    assert_eq!(c("").unwrap().instance_type(), Some("d1.nano"));
    assert_eq!(c("mem=3G").unwrap().instance_type(), Some("d1.medium"));
    assert_eq!(
        c("cores=64 mem=256G").unwrap().instance_type(),
        Some("d1.8xlarge")
    );
    assert_eq!(
        c("arch=arm64 cores=3").unwrap().instance_type(),
        Some("d1a.large")
    );
    assert_eq!(c("instance-type=d1.xlarge").unwrap().cores(), Some(8));
    assert_eq!(c("mem=257G").unwrap_err().class(), ErrorClass::InvalidSpec);
    assert_eq!(c("cores=65").unwrap_err().class(), ErrorClass::InvalidSpec);
    assert_eq!(
        c("arch=s390x").unwrap_err().class(),
        ErrorClass::InvalidSpec
    );
}

#[test]
fn unknown_and_malformed_keys_are_refused() {
    assert!(DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-latency", "1s")])).is_err());
    assert!(DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-start-latency", "soon")])).is_err());
    assert!(
        DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-failure-rate", "transient:2")]))
            .is_err()
    );
    assert!(DummyProvider::in_memory("t", UUID, &cfg(&[("dummy-instance-bucket", "x")])).is_err());
    // Keys of other components are not the dummy's business.
    assert!(DummyProvider::in_memory("t", UUID, &cfg(&[("harvest-mode", "all")])).is_ok());
}

#[test]
fn unsupported_constraint_keys_are_refused_per_provider_without_a_cloud() {
    let c = |s: &str| Constraints::parse(s).unwrap();
    let refused = |kind: &str, s: &str| {
        crate::check_supported(kind, &c(s))
            .err()
            .map(|e| (e.class(), e.to_string()))
    };
    let (class, msg) = refused("lxd", "instance-type=m5.large cpu-power=100").unwrap();
    assert_eq!(class, ErrorClass::InvalidSpec);
    assert!(msg.contains("`cpu-power`, `instance-type`"), "{msg}");
    assert!(refused("lxd", "cores=2 mem=4G root-disk=10G arch=amd64 zones=a").is_none());
    let (_, msg) = refused("ec2", "virt-type=kvm").unwrap();
    assert!(
        msg.contains("the ec2 provider does not support constraint(s) `virt-type`"),
        "{msg}"
    );
    assert!(refused("ec2", "instance-type=m5.large").is_none());
    // A root disk past EBS's largest volume (it was cut to 32 bits in the
    // request: 4294967297G asked for 1 GiB).
    assert!(refused("ec2", "root-disk=16T").is_none());
    let (class, msg) = refused("ec2", "root-disk=4294967297G").unwrap();
    assert_eq!(class, ErrorClass::InvalidSpec);
    assert_eq!(
        msg,
        "invalid instance spec: root-disk=4294967297G is more than the 16384G an EBS root volume may hold; ask for less"
    );
    // The dummy cloud takes every key.
    assert!(refused("dummy", "instance-type=m5.large virt-type=kvm tags=a").is_none());
}

/// Tags keep jujube's own keys as one character each: what goes in comes
/// out, in key order, and a key that looks like a code is not mistaken for
/// one.
#[test]
fn tags_round_trip_with_known_keys_stored_short() {
    let given = [
        (crate::TAG_NONCE, "b-1/7"),
        ("owner", "ops"),
        (crate::TAG_ENV_UUID, "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f"),
        ("\u{1}", "forged code"),
        (crate::TAG_NAME, "jujube-env-7"),
        (crate::TAG_MACHINE_ID, "7"),
    ];
    let tags: crate::Tags = given.iter().copied().collect();
    let mut want: Vec<(&str, &str)> = given
        .iter()
        .map(|&(k, v)| (if k == "\u{1}" { " " } else { k }, v))
        .collect();
    want.sort();
    assert_eq!(tags.iter().collect::<Vec<_>>(), want);
    assert_eq!(tags.get(crate::TAG_MACHINE_ID), Some("7"));
    assert_eq!(tags.get(" "), Some("forged code"));
    let json = serde_json::to_value(&tags).unwrap();
    assert_eq!(json[crate::TAG_NONCE], "b-1/7");
    assert_eq!(serde_json::from_value::<crate::Tags>(json).unwrap(), tags);
    let values: usize = given.iter().map(|(_, v)| v.len()).sum();
    let text = format!("{tags:?}");
    assert!(text.contains(crate::TAG_ENV_UUID), "{text}");
    // Each tag: its value, two separators and, for a known key, one
    // character; the two unknown keys ("owner", the cleaned code) in full.
    assert_eq!(tags.text_len(), values + 6 * 2 + 4 + "owner".len() + 1);
}
