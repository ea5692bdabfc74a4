//! Launch 20 machines through jujube (the real binary: `add-machine -n 20`
//! then `wait`, with a controller running) next to 20 parallel direct LXD
//! API launches (create, wait, start, wait — what any client must do), in
//! one run against the same daemon, and print both.
//!
//! Needs a daemon prepared by `scripts/lxd-setup`. Run with
//! `cargo bench -p jujube-cli --bench lxd_launch`; `LXD_BENCH_N` changes the
//! number of machines and `LXD_BENCH_ROUNDS` the rounds (default 2; the
//! two ways alternate so that neither always runs on a warmer daemon).

#[path = "../../tests/e2e/lxd_direct.rs"]
mod lxd_direct;

use jujube_providers::lxd::client::Client;
use lxd_direct::{delete_directly, launch_directly, ALIAS};
mod common;
use common::jujube_output as jujube;
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SOCKET: &str = "/var/lib/lxd/unix.socket";

async fn direct(n: usize, round: usize) -> Duration {
    let c = Client::unix(SOCKET);
    let names: Vec<String> = (0..n)
        .map(|i| format!("bench-direct-{round}-{i}"))
        .collect();
    let t0 = Instant::now();
    let tasks: Vec<_> = names
        .iter()
        .map(|name| {
            let c = c.clone();
            let name = name.clone();
            tokio::spawn(async move {
                launch_directly(&c, &name, json!({"user.jujube-bench": "direct"})).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let took = t0.elapsed();
    let deletes: Vec<_> = names
        .into_iter()
        .map(|name| {
            let c = c.clone();
            tokio::spawn(async move { delete_directly(&c, &name).await })
        })
        .collect();
    for t in deletes {
        t.await.unwrap();
    }
    took
}

fn through_jujube(n: usize) -> Duration {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    jujube(
        h,
        &[
            "bootstrap",
            "bench",
            "--provider",
            "lxd",
            "--config",
            &format!("image-alias={ALIAS}"),
        ],
    );
    let mut ctl = Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("controller")
        .env("JUJUBE_HOME", h)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start the controller");
    // The controller is up and idle (machine 0 is started) before timing.
    let up = Instant::now();
    while !Command::new(env!("CARGO_BIN_EXE_jujube"))
        .arg("status")
        .env("JUJUBE_HOME", h)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        assert!(
            up.elapsed() < Duration::from_secs(60),
            "the controller never answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    jujube(h, &["wait", "--timeout", "60s"]);
    let t0 = Instant::now();
    jujube(h, &["add-machine", "-n", &n.to_string()]);
    jujube(h, &["wait", "--timeout", "300s"]);
    let took = t0.elapsed();
    let status: serde_json::Value =
        serde_json::from_slice(&jujube(h, &["status", "--format", "json"]).stdout).unwrap();
    let started = status["machines"]
        .as_object()
        .unwrap()
        .values()
        .filter(|m| m["instance-id"].is_string())
        .count();
    assert_eq!(started, n + 1, "every machine started: {status:#}");
    let _ = ctl.kill();
    let _ = ctl.wait();
    jujube(h, &["destroy-environment", "bench", "-y"]);
    took
}

fn main() {
    let n: usize = std::env::var("LXD_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let rounds: usize = std::env::var("LXD_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    if std::os::unix::net::UnixStream::connect(SOCKET).is_err() {
        eprintln!("error: no LXD daemon at {SOCKET}; run `scripts/lxd-setup` first");
        std::process::exit(1);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut d = Vec::new();
    let mut j = Vec::new();
    for round in 0..rounds {
        if round % 2 == 0 {
            d.push(rt.block_on(direct(n, round)));
            j.push(through_jujube(n));
        } else {
            j.push(through_jujube(n));
            d.push(rt.block_on(direct(n, round)));
        }
        println!(
            "round {round}: {n} direct parallel API launches {:>7.2}s | {n} machines through jujube {:>7.2}s",
            d[round].as_secs_f64(),
            j[round].as_secs_f64()
        );
    }
    let best = |v: &[Duration]| v.iter().min().copied().unwrap();
    let (bd, bj) = (best(&d), best(&j));
    println!(
        "best of {rounds}: direct {:.2}s ({:.0} ms/machine), jujube {:.2}s ({:.0} ms/machine); jujube/direct = {:.2}",
        bd.as_secs_f64(),
        bd.as_millis() as f64 / n as f64,
        bj.as_secs_f64(),
        bj.as_millis() as f64 / n as f64,
        bj.as_secs_f64() / bd.as_secs_f64()
    );
    println!("(jujube's figure includes the CLI commands, the state store, the provisioner's pass and `wait`'s 200 ms polling)");
}
