//! The store benchmark's 100,000-unit figures measured through the API,
//! beside the same operations on the store directly, in one run: `deploy
//! -n`, `status --format json`, and `destroy-service` until every unit and
//! the service are removed. Through the API each is the real `jujube`
//! command (a process, TLS, the client facade, the answer decoded and
//! rendered) against a running controller; directly, the store's own calls
//! (the snapshot turned into JSON for `status`, as the CLI prints it; the
//! cleanups run in a loop for the removal). `status` through the API is
//! the median of three runs once the controller has gone idle after the
//! deploy (the one right after the deploy is printed too).
//!
//! The controller's cloud is the dummy, unreachable (`dummy-unreachable`,
//! set once bootstrap has made machine 0), so that it provisions nothing: both sides do the store's work alone
//! (machines without instances, units without agents, removed by the
//! cleaner). Goal: through the API within 1.5× of the direct figure.
//!
//! `cargo bench -p jujube-cli --bench api`; `JUJUBE_BENCH_UNITS` overrides
//! 100,000 for a quick run.

mod common;

use common::{count, jujube};
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::services::DeployArgs;
use jujube_state::{Charm, Store};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const META: &str =
    "name: bench\nsummary: a benchmark charm\nseries: [jammy]\nrequires:\n  db: mysql\n";

/// Polls until `cond` (every 50 ms), returning the time it took.
fn until(what: &str, limit: Duration, cond: impl FnMut() -> bool) -> Duration {
    common::until_every(what, limit, Duration::from_millis(50), cond)
}

/// The three figures, in seconds, and the status's size in bytes.
struct Figures {
    deploy: f64,
    status: f64,
    removal: f64,
    bytes: usize,
    /// `status` right after the deploy (through the API only).
    busy: f64,
}

/// CPU time (user and system) process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime, fields 14 and 15 of the line (11 and 12 after the
    // command's closing parenthesis); 100 ticks a second.
    (ticks(11) + ticks(12)) / 100.0
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
    let json = serde_json::to_vec(&st.status().unwrap()).unwrap();
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
        bytes: json.len(),
        busy: 0.0,
    }
}

fn through_the_api(n: usize) -> Figures {
    let home = tempfile::tempdir().unwrap();
    let charm = home.path().join("charm");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(charm.join("metadata.yaml"), META).unwrap();
    jujube(home.path(), &["bootstrap", "bench", "--manual-controller"]);
    // The cloud goes away once machine 0 is up, before the controller
    // starts (bootstrap needs it; `set-environment` would race the deploy).
    rusqlite::Connection::open(home.path().join("environments/bench/state.db"))
        .unwrap()
        .execute(
            "INSERT INTO environment_config (key, value) VALUES ('dummy-unreachable', 'true')",
            [],
        )
        .unwrap();
    let mut ctl = Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("controller")
        .env("JUJUBE_HOME", home.path())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until("the controller to answer", Duration::from_secs(60), || {
        common::answers(home.path())
    });
    let limit = Duration::from_secs(1800);
    let start = Instant::now();
    common::deploy_big(home.path(), &charm, n);
    let deploy = start.elapsed().as_secs_f64();
    // Right after the deploy the controller still routes its 100,000
    // changes: that figure is printed too; the one compared is the median
    // of three once the controller is idle again.
    let start = Instant::now();
    jujube(home.path(), &["status", "--format", "json"]);
    let busy = start.elapsed().as_secs_f64();
    until("the controller to settle", limit, || {
        let before = cpu_seconds(ctl.id());
        std::thread::sleep(Duration::from_millis(500));
        cpu_seconds(ctl.id()) - before < 0.05
    });
    let mut times = Vec::new();
    let mut json = Vec::new();
    for _ in 0..3 {
        // The command's time, its output read from a pipe as it is written
        // (checked after the clock stops).
        let start = Instant::now();
        json = common::jujube_output(home.path(), &["status", "--format", "json"]).stdout;
        times.push(start.elapsed().as_secs_f64());
    }
    assert!(serde_json::from_slice::<serde_json::Value>(&json).is_ok());
    times.sort_by(f64::total_cmp);
    let status = times[1];
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
        bytes: json.len(),
        busy,
    }
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let d = direct(n);
    let a = through_the_api(n);
    println!(
        "{n} units, direct on the store | through the API (goal <= 1.5x); status {:.0} MB | {:.0} MB of JSON:",
        d.bytes as f64 / 1e6,
        a.bytes as f64 / 1e6
    );
    println!(
        "  (status through the API right after the deploy, the controller still busy: {:.2} s)",
        a.busy
    );
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
