//! The 100,000-unit benchmark with agents running, through the real binary:
//! deploy, provision (dummy), every unit's agent started, `destroy-service`,
//! and the time until everything destroyed is removed. Prints the figures
//! with the controller's peak RSS (VmHWM) and its largest transaction.
//!
//! `cargo bench -p jujube-cli --bench agents`; `JUJUBE_BENCH_UNITS` overrides
//! 100,000 for a quick run. Goals: every unit agent started ≤ 30 s after
//! the last machine, removal ≤ 30 s, peak RSS ≤ 250 MB, largest
//! transaction ≤ 1,000 rows. Also printed: how long the deletion of
//! recalled units' directories (a background thread's disk work) went on
//! after the units were removed.

mod common;

use common::{count, jujube};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn peak_rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The CPU seconds `pid` has used, in user space and in the kernel (its
/// file creation is kernel time): the work, where the wall-clock times
/// above also measure what else the machine and its disk were doing.
fn cpu_seconds(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's name (in parentheses, which may hold spaces):
    // state is field 3, utime and stime fields 14 and 15, in clock ticks.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    let hz = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    match (ticks(11), ticks(12)) {
        (Some(user), Some(system)) => (user / hz, system / hz),
        _ => (f64::NAN, f64::NAN),
    }
}

/// Polls until `cond` (every 250 ms), returning the time it took.
fn until(what: &str, limit: Duration, cond: impl FnMut() -> bool) -> Duration {
    common::until_every(what, limit, Duration::from_millis(250), cond)
}

fn main() {
    let n: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let home = tempfile::tempdir().unwrap();
    let charm = home.path().join("charm");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(
        charm.join("metadata.yaml"),
        "name: bench\nsummary: a benchmark charm\nseries: [jammy]\n",
    )
    .unwrap();
    // The bench starts the controller itself, and deploys through its API
    // once it answers: the controller provisions while the deploy adds
    // units, so provisioning is timed from the deploy's start.
    jujube(home.path(), &["bootstrap", "bench", "--manual-controller"]);
    let log = home.path().join("controller.log");
    let mut ctl = Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("controller")
        .env("JUJUBE_HOME", home.path())
        .env("RUST_LOG", "warn,jujube=info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let pid = ctl.id();
    let ran = Instant::now();
    let limit = Duration::from_secs(1800);
    until("the controller to answer", Duration::from_secs(60), || {
        common::answers(home.path())
    });
    let start = Instant::now();
    common::deploy_big(home.path(), &charm, n);
    let deploy = start.elapsed();
    let db = rusqlite::Connection::open_with_flags(
        home.path().join("environments/bench/state.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let provisioned = until("provisioning", limit, || {
        count(
            &db,
            "SELECT count(*) FROM machines WHERE instance_id IS NULL",
        ) == 0
    });
    let started = until("every unit's agent", limit, || {
        count(&db, "SELECT count(*) FROM units WHERE NOT agent_started") == 0
    });
    let (user, system) = cpu_seconds(pid);
    println!(
        "{n} units: deploy through the API {:.1} s; provisioned {n} dummy machines {:.1} s after the deploy began; every unit agent started {:.1} s later (goal <= 30 s); controller peak RSS so far {:.0} MB",
        deploy.as_secs_f64(),
        (deploy + provisioned).as_secs_f64(),
        started.as_secs_f64(),
        peak_rss_mb(pid)
    );
    println!(
        "controller CPU from its start until every agent started: {:.1} s ({user:.1} s user, {system:.1} s kernel), {:.0} us a unit",
        user + system,
        (user + system) * 1e6 / n as f64
    );
    jujube(home.path(), &["destroy-service", "big"]);
    let removed = until("the service's removal", limit, || {
        count(&db, "SELECT count(*) FROM units") == 0
            && count(&db, "SELECT count(*) FROM services") == 0
    });
    let rss = peak_rss_mb(pid);
    // A recall renames a unit's directory away and a background thread
    // deletes it: say how long the disk work went on after the removal.
    let agents = home.path().join("environments/bench/agents");
    let recalled_left = || {
        std::fs::read_dir(&agents)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|m| std::fs::read_dir(m.path()).into_iter().flatten().flatten())
            .filter(|e| e.file_name().to_string_lossy().starts_with("unit-"))
            .count()
    };
    let deleting = Instant::now();
    let left = recalled_left();
    while recalled_left() > 0 {
        assert!(
            deleting.elapsed() < limit,
            "recalled directories are never deleted"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    let deleted = deleting.elapsed();
    // SIGTERM; the controller logs its transaction figures as it stops.
    // SAFETY: sending a signal to our own child process.
    unsafe { kill(pid as i32, 15) };
    ctl.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    // Where the start went: each step's count and when its last agent took
    // it, from the controller's log, against when the last machine was
    // provisioned (both since the controller started).
    let last_machine = (start - ran) + deploy + provisioned;
    let steps = text
        .lines()
        .rev()
        .find_map(|l| l.split_once("unit agents' start, since the controller's: "))
        .map(|(_, s)| s.to_string())
        .unwrap_or_default();
    println!(
        "the start, step by step (the last agent to take each, seconds after the last machine was provisioned):"
    );
    for (step, what) in [
        (
            "deployed",
            "deployed (directory and charm laid, agent started)",
        ),
        ("watching", "first watch subscribed"),
        ("first_pass", "first pass began (its permit granted)"),
        ("hooks_run", "start hooks run, their records written"),
        ("reported", "reported `started`"),
    ] {
        let Some((count, at)) = steps
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{step}=")))
            .and_then(|v| v.split_once('@'))
        else {
            println!("  {what}: not logged");
            continue;
        };
        let at: f64 = at.trim_end_matches('s').parse().unwrap_or(f64::NAN);
        println!(
            "  {what:<48} {count:>7} agents, last {:>6.1} s",
            at - last_machine.as_secs_f64()
        );
    }
    let stats = text
        .lines()
        .rev()
        .find(|l| l.contains("controller stopped"))
        .unwrap_or("(no final log line)");
    let rows = stats
        .split_whitespace()
        .find_map(|w| w.strip_prefix("largest_transaction_rows="))
        .unwrap_or("?");
    println!(
        "destroy-service of {n} units with agents: every unit Dying → Dead → removed and the service removed in {:.1} s (goal <= 30 s); controller peak RSS {rss:.0} MB (goal <= 250 MB); largest controller transaction {rows} rows (goal <= 1000)",
        removed.as_secs_f64()
    );
    println!(
        "recalled units' directories: {left} still being deleted at that moment, all gone {:.1} s later",
        deleted.as_secs_f64()
    );
    // Leadership is on throughout (the API server elects a leader for every
    // service whose leader was lost, each presence beat): its writes are
    // the elections the controller logged; holding a lease writes nothing.
    let elections: u64 = text
        .lines()
        .filter(|l| l.contains("leaders elected"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("services="))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum();
    let ran = ran.elapsed().as_secs_f64();
    println!(
        "leadership: {elections} election(s) written in {ran:.0} s of the controller's run ({:.3} lease writes/s); renewals write nothing",
        elections as f64 / ran
    );
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
