//! A 100,000-unit service's whole life, phase by phase, printing the largest
//! transaction (rows) of each: the invariant "no transaction grows with the
//! model" measured end to end. `cargo bench -p jujube-provisioner --bench
//! lifecycle`; `JUJUBE_BENCH_UNITS` overrides 100,000 for a quick run.
//!
//! 1. `deploy -n 100000` (the service and a machine per unit);
//! 2. every machine provisioned by the provisioner on a zero-latency dummy
//!    cloud (nonces, starts, recorded instances);
//! 3. `destroy-service`, and the cleaner until every unit is removed;
//! 4. `destroy-machine` of every machine (100 ids per command, as a user
//!    would type them), each machine's agent setting it Dead (group-committed
//!    as the agents' writer does), and the provisioner until every instance
//!    is stopped and every machine removed.
//!
//! The store is a real SQLite file at full durability (every commit is
//! fsynced), as in an environment; the goal is no transaction above 1,000
//! rows in any phase. (The state crate's own benchmark, `--bench store`,
//! cannot run the provisioner: the state crate must not depend on it.)

use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_providers::dummy::DummyProvider;
use jujube_provisioner::Provisioner;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::services::DeployArgs;
use jujube_state::{AgentOp, Caller, Charm, Store};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

const UUID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d";
const GOAL: u64 = 1000;

struct Phase {
    name: String,
    seconds: f64,
    transactions: u64,
    largest: u64,
}

fn measure(st: &Store, name: impl Into<String>, f: impl FnOnce()) -> Phase {
    st.reset_stats();
    let t0 = Instant::now();
    f();
    let seconds = t0.elapsed().as_secs_f64();
    let stats = st.stats();
    let phase = Phase {
        name: name.into(),
        seconds,
        transactions: stats.transactions,
        largest: stats.max_transaction_rows,
    };
    println!(
        "{}: {:.1} s, {} transactions, largest {} rows{}",
        phase.name,
        phase.seconds,
        phase.transactions,
        phase.largest,
        if phase.largest <= GOAL {
            ""
        } else {
            " (ABOVE THE GOAL)"
        }
    );
    phase
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Strays are listed once an hour: this measures the model, not listings.
    let config: BTreeMap<String, String> = [("harvest-interval", "1h")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let st = Store::open(dir.path().join("state.db")).unwrap();
    st.initialize(&EnvironmentSpec {
        name: "bench".into(),
        uuid: UUID.into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::default(),
        config: config.clone(),
    })
    .unwrap();
    let cloud = Arc::new(DummyProvider::in_memory("bench", UUID, &config).unwrap());
    let p = Provisioner::new(st.clone(), cloud.clone()).unwrap();
    let meta = CharmMeta::parse("name: wordpress\nrequires:\n  db: mysql\n").unwrap();
    let charm = Charm {
        url: "local:jammy/wordpress-1".into(),
        meta,
        config: CharmConfig::default(),
        actions: Default::default(),
        path: String::new(),
    };
    println!("lifecycle of a {n}-unit service (goal: no transaction above {GOAL} rows)");
    let mut phases = Vec::new();

    phases.push(measure(&st, format!("1. deploy -n {n}"), || {
        st.deploy(&DeployArgs {
            service: "big".into(),
            charm,
            series: "jammy".into(),
            constraints: Constraints::default(),
            units: n,
            to: None,
            settings: vec![],
        })
        .unwrap();
    }));

    phases.push(measure(
        &st,
        format!("2. provision {} machines (zero-latency dummy)", n + 1),
        || {
            rt.block_on(async {
                loop {
                    p.reconcile().await.unwrap();
                    p.idle().await;
                    let machines = st.machines().unwrap();
                    let failed = machines.iter().filter(|m| m.status == "error").count();
                    assert_eq!(failed, 0, "no start may fail on this dummy");
                    if machines.iter().all(|m| m.instance_id.is_some()) {
                        return;
                    }
                }
            })
        },
    ));

    phases.push(measure(&st, "3. destroy-service + cleanups", || {
        st.destroy_service("big").unwrap();
        st.run_cleanups(usize::MAX).unwrap();
        assert!(st.services().unwrap().is_empty(), "the service is removed");
    }));

    phases.push(measure(
        &st,
        "4. destroy-machine (100 per command) + provisioner",
        || {
            let ids: Vec<i64> = st
                .machines()
                .unwrap()
                .iter()
                .filter(|m| !m.manages_environ())
                .map(|m| m.id)
                .collect();
            for chunk in ids.chunks(100) {
                st.destroy_machines(chunk).unwrap();
            }
            // Each machine's agent sets its Dying machine Dead; agents'
            // writes are group-committed 64 to a transaction, as the
            // in-process facade's writer does.
            let dead: Vec<(Caller, AgentOp)> = ids
                .iter()
                .map(|&id| {
                    (
                        Caller::Machine(id),
                        AgentOp::EnsureDeadMachine { machine: id },
                    )
                })
                .collect();
            for chunk in dead.chunks(64) {
                for r in st.apply_batch(chunk).unwrap() {
                    r.unwrap();
                }
            }
            rt.block_on(async {
                loop {
                    p.reconcile().await.unwrap();
                    p.idle().await;
                    if st.machines().unwrap().len() == 1 {
                        return;
                    }
                }
            })
        },
    ));
    let live = rt.block_on(jujube_providers::Provider::instances(cloud.as_ref()));
    println!(
        "left: {} machine(s) (the controller), {} live instance(s) (its own)",
        st.machines().unwrap().len(),
        live.map(|l| l.len()).unwrap_or(0)
    );
    let worst = phases.iter().map(|p| p.largest).max().unwrap_or(0);
    println!(
        "largest transaction of any phase: {worst} rows ({})",
        if worst <= GOAL {
            "goal met"
        } else {
            "goal NOT met"
        }
    );
}
