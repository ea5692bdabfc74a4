//! Provisioning benchmark; prints figures. `cargo bench -p jujube-provisioner`.
//!
//! 1. Throughput: machines provisioned per second against a zero-latency
//!    dummy cloud, with a real SQLite store at full durability (wall time).
//! 2. Throttling: 1,000 machines against the dummy's EC2-like token buckets
//!    (instances: burst 1,000, refill 2/s; RunInstances requests: burst 5,
//!    refill 2/s), for jujube next to a Juju-style strategy (16 workers, one
//!    instance per call, a fixed 10 s wait between up to 10 tries). The
//!    buckets run on tokio's clock, so this part runs in virtual time and
//!    reports virtual seconds.

use jujube_core::Constraints;
use jujube_providers::dummy::DummyProvider;
use jujube_providers::{Provider, StartSpec};
use jujube_provisioner::Provisioner;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::Store;
use std::collections::BTreeMap;
use std::sync::Arc;
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

const EC2_BUCKETS: [(&str, &str); 2] = [
    ("dummy-instance-bucket", "1000/2"),
    ("dummy-request-bucket", "5/2"),
];

fn jujube_vs_buckets(n: usize) -> (f64, usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut kv = EC2_BUCKETS.to_vec();
        kv.extend([
            ("provisioner-rate", "5/2"),
            ("provisioner-batch", "100"),
            ("harvest-interval", "1h"),
        ]);
        let config = cfg(&kv);
        let st = store(dir.path(), &config);
        st.add_machines(n - 1, None, None).unwrap();
        let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &config).unwrap());
        let p = Provisioner::new(st.clone(), cloud).unwrap();
        let t0 = tokio::time::Instant::now();
        provision_all(&p, &st, n - 1).await;
        let failed = st
            .machines()
            .unwrap()
            .iter()
            .filter(|m| m.instance_id.is_none())
            .count();
        (t0.elapsed().as_secs_f64(), failed)
    })
}

/// Juju's provisioner as it was: a fixed pool of workers, one
/// RunInstances per machine, and on any error a fixed 10 s wait, 10 tries.
fn baseline_vs_buckets(n: usize) -> (f64, usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &cfg(&EC2_BUCKETS)).unwrap());
        let queue = Arc::new(std::sync::Mutex::new((0..n).collect::<Vec<_>>()));
        let t0 = tokio::time::Instant::now();
        let mut workers = Vec::new();
        for _ in 0..16 {
            let (cloud, queue) = (cloud.clone(), queue.clone());
            workers.push(tokio::spawn(async move {
                let mut failed = 0;
                loop {
                    let Some(m) = queue.lock().unwrap().pop() else {
                        return failed;
                    };
                    let spec = StartSpec {
                        machine_id: m.to_string(),
                        nonce: format!("baseline-{m}"),
                        series: "jammy".into(),
                        constraints: Constraints::default(),
                        zone: None,
                        controller: false,
                        user_data: String::new(),
                    };
                    let mut ok = false;
                    for _ in 0..10 {
                        if cloud.start_instance(&spec).await.is_ok() {
                            ok = true;
                            break;
                        }
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                    if !ok {
                        failed += 1;
                    }
                }
            }));
        }
        let mut failed = 0;
        for w in workers {
            failed += w.await.unwrap();
        }
        (t0.elapsed().as_secs_f64(), failed)
    })
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_MACHINES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    throughput(n);
    let (ours, our_failed) = jujube_vs_buckets(1000);
    let (theirs, their_failed) = baseline_vs_buckets(1000);
    println!(
        "1000 machines against EC2-like buckets (instances 1000/2, requests 5/2), virtual time: jujube {ours:.1} s ({our_failed} failed); Juju-style baseline {theirs:.1} s ({their_failed} failed after 10 tries); speed-up {:.1}x (goal >= 2x)",
        theirs / ours
    );
}
