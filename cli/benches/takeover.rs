//! How long three controllers on one PostgreSQL go without a lease holder
//! after the holder's machine dies: `kill -9` of its supervisor and its
//! controller, then the time until another controller holds the
//! singletons lease (read from the database every 50 ms), and the time
//! until `status` answers again through the CLI. Several kills, each
//! controller brought back by `enable-ha` between them.
//!
//! `cargo bench -p jujube-cli --bench takeover` (starts a throwaway
//! cluster with `scripts/pg-setup`); `JUJUBE_BENCH_KILLS` overrides 5.
//! The lease lasts 15 s and is renewed every 3 s: a takeover comes between
//! about 12 s (killed just before a renewal) and 18 s (another controller
//! looks every 3 s) after the kill.

mod common;

use common::{jujube, jujube_output};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

fn lease(db: &mut postgres::Client) -> (String, i64) {
    db.query_opt(
        "SELECT holder, token FROM controller_leases WHERE name = 'singletons'",
        &[],
    )
    .unwrap()
    .map_or((String::new(), 0), |r| (r.get(0), r.get(1)))
}

fn pid_in(dir: &Path, file: &str) -> i32 {
    std::fs::read_to_string(dir.join(file))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn main() {
    let kills: usize = std::env::var("JUJUBE_BENCH_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("pg-state");
    let out = std::process::Command::new(script("pg-setup"))
        .arg(&state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let url = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let boot = jujube_output(
        &home,
        &["bootstrap", "t", "--config", &format!("state-url={url}")],
    );
    assert!(
        boot.status.success(),
        "{}",
        String::from_utf8_lossy(&boot.stderr)
    );
    jujube(&home, &["enable-ha"]);
    let dir = home.join("environments/t");
    let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut takeovers = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..kills {
        // Every controller up, one holding the lease for a while.
        jujube(&home, &["enable-ha"]);
        std::thread::sleep(Duration::from_secs(4));
        let (holder, token) = lease(&mut db);
        let seat: i64 = holder
            .strip_prefix("machine-")
            .and_then(|h| h.split('/').next())
            .and_then(|m| m.parse().ok())
            .unwrap();
        let (sup, ctl) = if seat == 0 {
            ("supervisor.pid".to_string(), "controller.lock".to_string())
        } else {
            (
                format!("supervisor-{seat}.pid"),
                format!("controller-{seat}.lock"),
            )
        };
        let killed = Instant::now();
        // SAFETY: kill(2) on processes this benchmark's bootstrap started.
        unsafe {
            libc::kill(pid_in(&dir, &sup), libc::SIGKILL);
            libc::kill(pid_in(&dir, &ctl), libc::SIGKILL);
        }
        let status = std::thread::spawn({
            let home = home.clone();
            move || {
                while !jujube_output(&home, &["status"]).status.success() {}
                killed.elapsed()
            }
        });
        loop {
            let (h, t) = lease(&mut db);
            if t > token && h != holder {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(120), "no takeover");
            std::thread::sleep(Duration::from_millis(50));
        }
        takeovers.push(killed.elapsed());
        answers.push(status.join().unwrap());
    }
    let secs = |v: &mut Vec<Duration>| {
        v.sort();
        format!(
            "min {:.1} s, median {:.1} s, max {:.1} s",
            v[0].as_secs_f64(),
            v[v.len() / 2].as_secs_f64(),
            v[v.len() - 1].as_secs_f64()
        )
    };
    println!(
        "{kills} kills of the lease holder among 3 controllers on PostgreSQL (lease 15 s, renewed every 3 s): another controller held the lease after {}; `status` answered through another controller after {}",
        secs(&mut takeovers),
        secs(&mut answers)
    );
    jujube(&home, &["destroy-environment", "t", "-y"]);
    let _ = std::process::Command::new(script("pg-stop"))
        .arg(&state)
        .status();
}
