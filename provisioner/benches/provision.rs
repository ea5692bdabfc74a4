//! Provisioning benchmark; prints figures. `cargo bench -p jujube-provisioner
//! --bench provision`.
//!
//! 1. Throughput: machines provisioned per second against a zero-latency
//!    dummy cloud, with a real SQLite store at full durability (wall time).
//! 2. EC2's throttling: 1,000 and 5,000 machines against the dummy cloud in
//!    `dummy-throttling=ec2` mode, which charges every call as EC2 does with
//!    the buckets AWS documents (`jujube_providers::bucket::ec2_limits`:
//!    RunInstances 50 requests / 5 per s and 1,000 instances / 2 per s,
//!    DescribeInstances 100 / 20 per s, CreateTags 50 / 5 per s), and takes
//!    1 s per launch request. jujube (default settings: launch batches of 64
//!    machines sharing type, image and zone, 8 in flight, launches paced at
//!    the documented rates exactly as the EC2 provider paces them) runs next
//!    to a model of Juju's provisioner with its real advantages: 16 workers,
//!    one RunInstances per machine, the AWS SDK's standard retry mode under
//!    each call and Juju's 10 tries 10 s apart over that. Neither side has a
//!    client-side limiter configured (`provisioner-rate` unset). The buckets
//!    run on tokio's clock, so this part runs in virtual time (tokio's paused
//!    clock) and reports virtual seconds.

use jujube_core::Constraints;
use jujube_providers::dummy::DummyProvider;
use jujube_providers::StartSpec;
use jujube_provisioner::Provisioner;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::Store;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const UUID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d";

fn cfg(kvs: &[(&str, &str)]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn store(dir: &std::path::Path, config: &BTreeMap<String, String>) -> Store {
    let st = Store::open(dir.join("state.db")).unwrap();
    st.initialize(&EnvironmentSpec {
        name: "bench".into(),
        uuid: UUID.into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::default(),
        config: config.clone(),
    })
    .unwrap();
    st
}

async fn provision_all(p: &Provisioner, st: &Store, n: usize) {
    loop {
        p.reconcile().await.unwrap();
        p.idle().await;
        let done = st
            .machines()
            .unwrap()
            .iter()
            .filter(|m| m.instance_id.is_some() || m.status == "error")
            .count();
        if done > n {
            return;
        }
    }
}

fn throughput(n: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = cfg(&[("provisioner-batch", "256"), ("harvest-interval", "1h")]);
    let st = store(dir.path(), &config);
    let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &config).unwrap());
    let p = Provisioner::new(st.clone(), cloud.clone()).unwrap();
    st.add_machines(n, None, None).unwrap();
    let t0 = std::time::Instant::now();
    rt.block_on(provision_all(&p, &st, n));
    let took = t0.elapsed();
    let started = st
        .machines()
        .unwrap()
        .iter()
        .filter(|m| m.instance_id.is_some())
        .count();
    println!(
        "throughput: {n} machines in {:.2} s = {:.0} machines/s (zero-latency dummy, SQLite synchronous=FULL; goal >= 5000/s); {started} started",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64()
    );
}

/// EC2 as the dummy charges it, with 1 s per launch request.
const EC2: [(&str, &str); 2] = [("dummy-throttling", "ec2"), ("dummy-start-latency", "1s")];

struct Outcome {
    secs: f64,
    machines: usize,
    /// Machines left without an instance, in error.
    failed: usize,
    /// Throttling errors that reached the provisioner (past the SDK's
    /// retries, for the baseline): what a user would see in status.
    shown: usize,
    run_instances: u64,
    calls: u64,
    throttled: u64,
    /// When the last per-machine tag was applied (jujube only).
    tags_done: Option<f64>,
}

fn jujube_vs_ec2(n: usize) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut kv = EC2.to_vec();
        kv.push(("harvest-interval", "1h"));
        let config = cfg(&kv);
        let st = store(dir.path(), &config);
        // Machine 0 is there already: n in all.
        st.add_machines(n - 1, None, None).unwrap();
        let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &config).unwrap());
        let p = Provisioner::new(st.clone(), cloud.clone()).unwrap();
        let t0 = tokio::time::Instant::now();
        provision_all(&p, &st, n - 1).await;
        let secs = t0.elapsed().as_secs_f64();
        let machines = st.machines().unwrap();
        let failed = machines.iter().filter(|m| m.instance_id.is_none()).count();
        let shown = machines
            .iter()
            .filter(|m| m.status_info.contains("RequestLimitExceeded"))
            .count();
        let s = cloud.api_stats();
        Outcome {
            secs,
            machines: n,
            failed,
            shown,
            run_instances: s.run_instances,
            calls: s.run_instances + s.describe_instances + s.create_tags + s.terminate_instances,
            throttled: s.throttled,
            tags_done: s
                .tags_done_at
                .map(|t| t.saturating_duration_since(t0).as_secs_f64()),
        }
    })
}

/// The AWS SDK's standard retry mode, as aws-smithy-runtime implements it
/// (`client/retries/strategy/standard.rs` and `token_bucket.rs` in
/// smithy-lang/smithy-rs): at most 3 attempts; before retry `i` (1, 2) a
/// wait of `rand[0,1) × 1 s × 2^(i-1)`, at most 20 s; a retry quota shared by
/// the client, 500 tokens, of which a retry of a throttling error takes 5;
/// a retry that succeeds gives its 5 back, a first attempt that succeeds adds
/// 1 (up to 500), and a retry that fails keeps them. Without quota, the error
/// is returned at once.
struct SdkRetry {
    quota: Mutex<u32>,
    rng: Mutex<u64>,
}

impl SdkRetry {
    fn new() -> SdkRetry {
        SdkRetry {
            quota: Mutex::new(500),
            rng: Mutex::new(0x9E37_79B9_7F4A_7C15),
        }
    }

    fn random(&self) -> f64 {
        let mut x = self.rng.lock().unwrap();
        *x ^= *x >> 12;
        *x ^= *x << 25;
        *x ^= *x >> 27;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    async fn call(
        &self,
        cloud: &DummyProvider,
        spec: &StartSpec,
    ) -> Result<(), jujube_providers::Error> {
        let mut held = 0u32;
        for attempt in 1..=3u32 {
            match cloud.run_instance(spec).await {
                Ok(_) => {
                    let mut q = self.quota.lock().unwrap();
                    *q = (*q + if held > 0 { held } else { 1 }).min(500);
                    return Ok(());
                }
                Err(e) => {
                    let retryable = e.class() == jujube_providers::ErrorClass::Transient;
                    if !retryable || attempt == 3 {
                        return Err(e);
                    }
                    {
                        let mut q = self.quota.lock().unwrap();
                        if *q < 5 {
                            return Err(e);
                        }
                        *q -= 5;
                        // A new permit replaces the one held: that one is
                        // forgotten, as in the SDK.
                        held = 5;
                    }
                    let backoff = (self.random() * 2f64.powi(attempt as i32 - 1)).min(20.0);
                    tokio::time::sleep(Duration::from_secs_f64(backoff)).await;
                }
            }
        }
        unreachable!("the last attempt returns")
    }
}

/// Juju's provisioner as a model: 16 workers, one RunInstances per machine
/// through the SDK's standard retries, and on an error that gets through,
/// up to 10 tries 10 s apart (each failure shown in the machine's status).
fn baseline_vs_ec2(n: usize) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &cfg(&EC2)).unwrap());
        let sdk = Arc::new(SdkRetry::new());
        let queue = Arc::new(Mutex::new((0..n).rev().collect::<Vec<_>>()));
        let t0 = tokio::time::Instant::now();
        let mut workers = Vec::new();
        for _ in 0..16 {
            let (cloud, queue, sdk) = (cloud.clone(), queue.clone(), sdk.clone());
            workers.push(tokio::spawn(async move {
                let (mut failed, mut shown) = (0, 0);
                loop {
                    let Some(m) = queue.lock().unwrap().pop() else {
                        return (failed, shown);
                    };
                    let spec = StartSpec {
                        machine_id: m.to_string(),
                        nonce: format!("baseline-{m}"),
                        series: "jammy".into(),
                        constraints: Constraints::default(),
                        zone: None,
                        controller: false,
                        user_data: String::new(),
                        agent: None,
                    };
                    let mut ok = false;
                    for _ in 0..10 {
                        if sdk.call(&cloud, &spec).await.is_ok() {
                            ok = true;
                            break;
                        }
                        shown += 1;
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                    if !ok {
                        failed += 1;
                    }
                }
            }));
        }
        let (mut failed, mut shown) = (0, 0);
        for w in workers {
            let (f, s) = w.await.unwrap();
            failed += f;
            shown += s;
        }
        let secs = t0.elapsed().as_secs_f64();
        let s = cloud.api_stats();
        Outcome {
            secs,
            machines: n,
            failed,
            shown,
            run_instances: s.run_instances,
            calls: s.run_instances + s.describe_instances + s.create_tags + s.terminate_instances,
            throttled: s.throttled,
            tags_done: None,
        }
    })
}

fn report(who: &str, o: &Outcome) {
    println!(
        "  {who}: {:.1} s, {} of {} machines provisioned; {} RunInstances, {} API calls in all; {} throttling errors from EC2, {} shown to the user{}",
        o.secs,
        o.machines - o.failed,
        o.machines,
        o.run_instances,
        o.calls,
        o.throttled,
        o.shown,
        o.tags_done
            .map(|t| format!("; per-machine tags all applied at {t:.1} s"))
            .unwrap_or_default()
    );
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_MACHINES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    throughput(n);
    println!(
        "against EC2's documented throttling (dummy-throttling=ec2: RunInstances 50 requests + 5/s and 1000 instances + 2/s, DescribeInstances 100 + 20/s, CreateTags 50 + 5/s; 1 s per launch request; no client-side limiter on either side), virtual time (tokio's paused clock):"
    );
    for machines in [1000, 5000] {
        let ours = jujube_vs_ec2(machines);
        let theirs = baseline_vs_ec2(machines);
        println!("{machines} machines:");
        report("jujube", &ours);
        report(
            "Juju-style baseline (16 workers, 1 instance per call, SDK standard retries, 10 x 10 s)",
            &theirs,
        );
        let floor = if machines > 1000 {
            format!(
                "; past the 1000-instance burst both are bounded by the refill of 2 instances/s: at least {:.0} s for {machines}",
                (machines - 1000) as f64 / 2.0
            )
        } else {
            String::new()
        };
        println!(
            "  speed-up {:.1}x in time to the last machine{}{floor}",
            theirs.secs / ours.secs,
            if machines == 1000 {
                " (goal >= 2x with no throttling error shown to a user)"
            } else {
                ""
            }
        );
    }
}
