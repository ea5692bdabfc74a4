//! What the benchmarks that drive the real binary share: running a
//! command, counting rows of the store, polling until a condition holds.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `jujube ARGS` in `home`; panics with its stderr if it fails.
pub fn jujube_output(home: &Path, args: &[&str]) -> std::process::Output {
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
    out
}

/// Runs `jujube ARGS` in `home`; its standard output.
pub fn jujube(home: &Path, args: &[&str]) -> String {
    String::from_utf8_lossy(&jujube_output(home, args).stdout).into_owned()
}

/// The one number `sql` answers.
pub fn count(db: &rusqlite::Connection, sql: &str) -> i64 {
    db.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// Polls until `cond` (every `every`), returning the time it took.
pub fn until_every(
    what: &str,
    limit: Duration,
    every: Duration,
    mut cond: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(every);
    }
    start.elapsed()
}

/// Whether the environment's controller answers (`jujube status`).
pub fn answers(home: &Path) -> bool {
    Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("status")
        .env("JUJUBE_HOME", home)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `jujube deploy CHARM big -n N` in `home`: the benchmarks' service.
pub fn deploy_big(home: &Path, charm: &Path, n: usize) {
    jujube(
        home,
        &[
            "deploy",
            charm.to_str().unwrap(),
            "big",
            "-n",
            &n.to_string(),
        ],
    );
}
