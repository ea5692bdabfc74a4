//! Store benchmark; prints figures. `cargo bench -p jujube-state`.
//!
//! - add-unit rate (one transaction per unit, synchronous=FULL) next to a
//!   bare rusqlite loop of one-row transactions with the same durability;
//! - deploying 100,000 units;
//! - `status` (snapshot + JSON) at 100,000 units;
//! - destroying the 100,000-unit service through its cleanup, with the
//!   largest transaction's row count;
//! - `add-machine -n 100000`, the provisioner's preparation of all those
//!   machines at once (as its first pass does), and `retry-provisioning
//!   --all` of all of them, each with its largest transaction.
//!
//! The whole life of such a service through the provisioner (which this
//! crate cannot depend on) is `cargo bench -p jujube-provisioner --bench
//! lifecycle`.
//!
//! `JUJUBE_BENCH_UNITS` overrides 100,000 for a quick run.

use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::services::DeployArgs;
use jujube_state::{Charm, Store};
use std::time::{Duration, Instant};

fn charm(meta: &str) -> Charm {
    let meta = CharmMeta::parse(meta).unwrap();
    Charm {
        url: format!("local:jammy/{}-1", meta.name),
        meta,
        config: CharmConfig::default(),
        path: String::new(),
    }
}

fn store(dir: &std::path::Path) -> Store {
    let st = Store::open(dir.join("state.db")).unwrap();
    st.initialize(&EnvironmentSpec {
        name: "bench".into(),
        uuid: "00000000-0000-4000-8000-000000000000".into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::parse("mem=2G").unwrap(),
        config: Default::default(),
    })
    .unwrap();
    st
}

fn deploy(st: &Store, name: &str, units: usize) {
    st.deploy(&DeployArgs {
        service: name.into(),
        charm: charm("name: wordpress\nrequires:\n  db: mysql\n"),
        series: "jammy".into(),
        constraints: Constraints::default(),
        units,
        to: None,
        settings: vec![],
    })
    .unwrap();
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn bare_loop(dir: &std::path::Path, n: usize) -> Duration {
    let c = rusqlite::Connection::open(dir.join("bare.db")).unwrap();
    c.pragma_update(None, "journal_mode", "WAL").unwrap();
    c.pragma_update(None, "synchronous", "FULL").unwrap();
    c.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
        .unwrap();
    let mut c = c;
    let start = Instant::now();
    for i in 0..n {
        let tx = c
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        tx.execute("INSERT INTO t (name) VALUES (?1)", [format!("svc/{i}")])
            .unwrap();
        tx.commit().unwrap();
    }
    start.elapsed()
}

fn main() {
    let big: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();

    // 1. add-unit, one transaction each, against the bare loop.
    let n = 2_000;
    let st = store(dir.path());
    deploy(&st, "wordpress", 0);
    let start = Instant::now();
    for _ in 0..n {
        st.add_units("wordpress", 1, None).unwrap();
    }
    let ours = start.elapsed();
    let bare = bare_loop(dir.path(), n);
    println!(
        "add-unit: {:.0} units/s (each: unit + machine + feed, one transaction); bare rusqlite one-row transactions: {:.0} tx/s; ratio {:.0}% (goal >= 50%)",
        rate(n, ours),
        rate(n, bare),
        100.0 * bare.as_secs_f64() / ours.as_secs_f64()
    );
    drop(st);

    // 2. deploy 100,000 units.
    let dir2 = tempfile::tempdir().unwrap();
    let st = store(dir2.path());
    st.reset_stats();
    let start = Instant::now();
    deploy(&st, "big", big);
    let took = start.elapsed();
    println!(
        "deploy -n {big}: {:.2} s ({:.0} units/s, {} transactions, largest {} rows)",
        took.as_secs_f64(),
        rate(big, took),
        st.stats().transactions,
        st.stats().max_transaction_rows
    );

    // 3. status at 100,000 units.
    let start = Instant::now();
    let status = st.status().unwrap();
    let json = serde_json::to_vec(&status).unwrap();
    let took = start.elapsed();
    println!(
        "status --format json at {big} units: {:.3} s ({} MB of JSON) (goal <= 2 s)",
        took.as_secs_f64(),
        json.len() / 1_000_000
    );

    // 4. destroy the 100,000-unit service.
    st.reset_stats();
    let start = Instant::now();
    st.destroy_service("big").unwrap();
    let destroy_tx = start.elapsed();
    let steps = st.run_cleanups(usize::MAX).unwrap();
    let took = start.elapsed();
    let stats = st.stats();
    println!(
        "destroy-service of {big} units: destroy transaction {:.1} ms, cleanup {} steps, {:.2} s in all; largest transaction {} rows (goal <= 1000); units left {}",
        destroy_tx.as_secs_f64() * 1000.0,
        steps,
        took.as_secs_f64(),
        stats.max_transaction_rows,
        st.units_of("big").map(|u| u.len()).unwrap_or(0)
    );

    // 5. add-machine -n 100000, then what the provisioner and
    // retry-provisioning --all do with all of them.
    let dir3 = tempfile::tempdir().unwrap();
    let st = store(dir3.path());
    let phase = |name: &str, f: &mut dyn FnMut()| {
        st.reset_stats();
        let start = Instant::now();
        f();
        let stats = st.stats();
        println!(
            "{name}: {:.2} s, {} transactions, largest {} rows (goal <= 1000)",
            start.elapsed().as_secs_f64(),
            stats.transactions,
            stats.max_transaction_rows
        );
    };
    let mut ids = Vec::new();
    phase(&format!("add-machine -n {big}"), &mut || {
        ids = st.add_machines(big, None, None).unwrap();
    });
    phase(
        &format!("prepare_provisioning of {big} machines in one call"),
        &mut || {
            st.prepare_provisioning(&ids, "00000000").unwrap();
        },
    );
    // Every start failed (one statement from another connection, as another
    // process would write it).
    rusqlite::Connection::open(st.path())
        .unwrap()
        .execute(
            "UPDATE machines SET status = 'error', status_info = 'bench' WHERE id > 0",
            [],
        )
        .unwrap();
    phase(&format!("retry-provisioning --all of {big}"), &mut || {
        assert_eq!(st.retry_all_provisioning().unwrap().len(), big);
    });
}
