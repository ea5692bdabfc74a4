//! The store benchmark's 100,000-unit figures measured through the API,
//! beside the same operations on the store directly, in one run: `deploy
//! -n`, `status --format json`, and `destroy-service` until every unit and
//! the service are removed. Through the API each is the real `jujube`
//! command (a process, TLS, the client facade, the answer decoded and
//! rendered) against a running controller; directly, the store's own calls
//! (the snapshot turned into JSON for `status`; the cleanups run in a loop
//! for the removal).
//!
//! The controller's cloud is the dummy, unreachable (`dummy-unreachable`),
//! so that it provisions nothing: both sides do the store's work alone
//! (machines without instances, units without agents, removed by the
//! cleaner). Goal: through the API within 1.5× of the direct figure.
//!
//! `cargo bench -p jujube-cli --bench api`; `JUJUBE_BENCH_UNITS` overrides
//! 100,000 for a quick run.

use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::services::DeployArgs;
use jujube_state::{Charm, Store};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const META: &str = "name: bench\nsummary: a benchmark charm\nseries: [jammy]\nrequires:\n  db: mysql\n";

fn jujube(home: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_jujube"))
        .args(args)
        .env("JUJUBE_HOME", home)
        .env_remove("JUJUBE_ENV")
        .output()
        .expect("run jujube");
    assert!(
        out.status.success(),
        "jujube {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn count(db: &rusqlite::Connection, sql: &str) -> i64 {
    db.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// Polls until `cond` (every 50 ms), returning the time it took.
fn until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// The three figures, in seconds.
struct Figures {
    deploy: f64,
    status: f64,
    removal: f64,
}

fn direct(n: usize) -> Figures {
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open(dir.path().join("state.db")).unwrap();
    st.initialize(&EnvironmentSpec {
        name: "bench".into(),
        uuid: "00000000-0000-4000-8000-000000000000".into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::default(),
        config: Default::default(),
    })
    .unwrap();
    let meta = CharmMeta::parse(META).unwrap();
    let charm = Charm {
        url: "local:jammy/bench-1".into(),
        meta,
        config: CharmConfig::parse("bench", "").unwrap(),
        actions: Default::default(),
        path: String::new(),
    };
    let start = Instant::now();
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
    let deploy = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let json = serde_json::to_vec_pretty(&st.status().unwrap()).unwrap();
    let status = start.elapsed().as_secs_f64();
    assert!(json.len() > n * 100);
    let start = Instant::now();
    st.destroy_service("big").unwrap();
    while st.units_of("big").map(|u| !u.is_empty()).unwrap_or(false) {
        st.run_cleanups(usize::MAX).unwrap();
    }
    Figures {
        deploy,
        status,
        removal: start.elapsed().as_secs_f64(),
    }
}

fn through_the_api(n: usize) -> Figures {
    let home = tempfile::tempdir().unwrap();
    let charm = home.path().join("charm");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(charm.join("metadata.yaml"), META).unwrap();
    jujube(
        home.path(),
        &[
            "bootstrap",
            "bench",
            "--manual-controller",
            "--config",
            "dummy-unreachable=true",
        ],
    );
    let mut ctl = Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("controller")
        .env("JUJUBE_HOME", home.path())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until("the controller to answer", Duration::from_secs(60), || {
        Command::new(env!("CARGO_BIN_EXE_jujube"))
            .arg("status")
            .env("JUJUBE_HOME", home.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    let limit = Duration::from_secs(1800);
    let start = Instant::now();
    jujube(
        home.path(),
        &["deploy", charm.to_str().unwrap(), "big", "-n", &n.to_string()],
    );
    let deploy = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let json = jujube(home.path(), &["status", "--format", "json"]);
    let status = start.elapsed().as_secs_f64();
    assert!(json.len() > n * 100, "{} bytes of status", json.len());
    let db = rusqlite::Connection::open_with_flags(
        home.path().join("environments/bench/state.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let start = Instant::now();
    jujube(home.path(), &["destroy-service", "big"]);
    until("the service's removal", limit, || {
        count(&db, "SELECT count(*) FROM units") == 0
            && count(&db, "SELECT count(*) FROM services") == 0
    });
    let removal = start.elapsed().as_secs_f64();
    let _ = ctl.kill();
    let _ = ctl.wait();
    Figures {
        deploy,
        status,
        removal,
    }
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let d = direct(n);
    let a = through_the_api(n);
    println!("{n} units, direct on the store | through the API (goal <= 1.5x):");
    for (what, d, a) in [
        ("deploy -n", d.deploy, a.deploy),
        ("status --format json", d.status, a.status),
        ("destroy-service to removal", d.removal, a.removal),
    ] {
        println!(
            "  {what:<28} {d:>7.2} s | {a:>7.2} s  ({:.2}x{})",
            a / d,
            if a / d <= 1.5 { "" } else { ", above the goal" }
        );
    }
}
