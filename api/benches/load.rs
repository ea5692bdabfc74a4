//! 1,000 agents on the API server at once, over real TCP sockets and TLS,
//! each on its own HTTP/2 connection with its own credential: each watches
//! its machine, re-reads it on every notice, and about once a second
//! re-reads it and writes its status — while a user, once a second, deploys
//! a service with 50 units onto those machines and destroys it again. Prints calls/s, p50/p99/max
//! latency of the agents' calls and the process's peak RSS (server, store
//! and the 1,000 clients share the process: the figure is an upper bound
//! for the controller). Goal: p99 ≤ 50 ms at 1,000 agents.
//!
//! `cargo bench -p jujube-api --bench load`; `JUJUBE_BENCH_AGENTS` (default
//! 1,000) and `JUJUBE_BENCH_SECONDS` (default 20) override the size;
//! `JUJUBE_BENCH_USER=flat-out` makes the user as fast as the store allows.

use jujube_agent::api::{AgentStatus, Facade, Tag, WatchTarget};
use jujube_agent::remote::Remote;
use jujube_agent::wire::{new_secret, secret_hash, AgentConf};
use jujube_agent_state::Facades;
use jujube_api::{tls, ApiServer, Limits};
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::provisioning::Started;
use jujube_state::services::DeployArgs;
use jujube_state::{Charm, Store};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const UUID: &str = "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f";

fn env_num(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn raise_fd_limit() {
    // Two sockets per agent in one process: lift the soft limit to the hard.
    unsafe {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

fn charm(dir: &std::path::Path) -> Charm {
    let meta = CharmMeta::parse("name: app\nsummary: load\n").unwrap();
    let path = dir.join("charms/app");
    std::fs::create_dir_all(&path).unwrap();
    Charm {
        url: "local:jammy/app-1".into(),
        meta,
        config: CharmConfig::default(),
        path: path.to_string_lossy().into_owned(),
    }
}

fn main() {
    raise_fd_limit();
    let agents = env_num("JUJUBE_BENCH_AGENTS", 1000) as usize;
    let seconds = env_num("JUJUBE_BENCH_SECONDS", 20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(agents, seconds));
}

async fn run(agents: usize, seconds: u64) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("state.db")).unwrap();
    store
        .initialize(&EnvironmentSpec {
            name: "load".into(),
            uuid: UUID.into(),
            provider: "dummy".into(),
            default_series: "jammy".into(),
            constraints: Constraints::default(),
            config: Default::default(),
        })
        .unwrap();
    let ids = store.add_machines(agents, None, None).unwrap();
    let prepared = store.prepare_provisioning(&ids, UUID).unwrap();
    let started: Vec<Started> = prepared
        .into_iter()
        .map(|p| Started {
            instance_id: format!("i-{}", p.machine),
            machine: p.machine,
            nonce: p.nonce,
            zone: None,
            hardware: String::new(),
        })
        .collect();
    store.record_instances(&started).unwrap();
    tls::ensure(dir.path(), UUID).unwrap();
    let ca = tls::ca_cert(dir.path()).unwrap();
    let facades = Arc::new(Facades::new(store.clone()).unwrap());
    facades.ready().await;
    let server = ApiServer::start(
        dir.path(),
        store.clone(),
        facades,
        Some("127.0.0.1:0"),
        None,
        Limits::default(),
    )
    .await
    .unwrap();
    let addr = server.tcp_addr().unwrap().to_string();
    let rss_before = status_kb("VmRSS:");

    let latencies = Arc::new(Mutex::new(Vec::<u32>::with_capacity(1 << 20)));
    let errors = Arc::new(AtomicU64::new(0));
    let notices = Arc::new(AtomicU64::new(0));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let t_connect = Instant::now();
    let mut remotes = Vec::with_capacity(agents);
    for &id in &ids {
        let secret = new_secret();
        let tag = Tag::Machine(id);
        store
            .set_machine_credential(id, &tag.to_string(), &secret_hash(&secret))
            .unwrap();
        let remote = Remote::new(&AgentConf {
            api_addresses: vec![addr.clone()],
            ca_cert: ca.clone(),
            tag,
            secret,
            env_name: "load".into(),
        })
        .unwrap();
        remotes.push((id, remote));
    }
    // Each agent subscribes (its first call: connection, TLS, watch).
    let mut watching = Vec::with_capacity(agents);
    for (id, remote) in remotes {
        watching.push(tokio::spawn(async move {
            let stream = remote.watch(WatchTarget::Machine(id)).await.unwrap();
            (id, remote, stream)
        }));
    }
    let mut ready = Vec::with_capacity(agents);
    for w in watching {
        ready.push(w.await.unwrap());
    }
    println!(
        "{agents} agents connected and watching in {:.1} s",
        t_connect.elapsed().as_secs_f64()
    );

    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(agents);
    for (i, (id, remote, mut stream)) in ready.into_iter().enumerate() {
        let (latencies, errors, notices) = (latencies.clone(), errors.clone(), notices.clone());
        tasks.push(tokio::spawn(async move {
            use futures_util::StreamExt;
            // Spread the ticks: about one pass per second per agent.
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + Duration::from_millis((i as u64 * 7919) % 1000),
                Duration::from_secs(1),
            );
            let mut n = 0u64;
            let mut mine = Vec::new();
            loop {
                // A notice: re-read the view. A tick: re-read and report
                // status, as an agent's periodic work does.
                let write = tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = tick.tick() => true,
                    Some(_) = stream.next() => {
                        notices.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                };
                let t = Instant::now();
                let mut ok = remote.machine(id).await.is_ok();
                mine.push(t.elapsed().as_micros() as u32);
                if write {
                    n += 1;
                    let t = Instant::now();
                    ok &= remote
                        .set_machine_status(id, AgentStatus::Started, &format!("pass {n}"))
                        .await
                        .is_ok();
                    mine.push(t.elapsed().as_micros() as u32);
                }
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            latencies.lock().unwrap().extend(mine);
            drop(remote);
        }));
    }

    // The user: deploys units onto the agents' machines and destroys them.
    let user = {
        let store = store.clone();
        let ids = ids.clone();
        let charm = charm(dir.path());
        let flat_out = std::env::var("JUJUBE_BENCH_USER").as_deref() == Ok("flat-out");
        tokio::task::spawn_blocking(move || {
            let mut round = 0usize;
            let mut ops = 0u64;
            while Instant::now() < t0 + Duration::from_secs(seconds) {
                let svc = format!("app{round}");
                store
                    .deploy(&DeployArgs {
                        service: svc.clone(),
                        charm: charm.clone(),
                        series: "jammy".into(),
                        constraints: Constraints::default(),
                        units: 0,
                        to: None,
                        settings: vec![],
                    })
                    .unwrap();
                for k in 0..50 {
                    let m = ids[(round * 50 + k) % ids.len()];
                    store.add_units(&svc, 1, Some(m)).unwrap();
                    ops += 1;
                }
                store.destroy_service(&svc).unwrap();
                while store.cleanup_step().unwrap_or(false) {}
                ops += 1;
                round += 1;
                // A user types commands; one round a second keeps every
                // agent's machine changing every 20 s or so.
                // `JUJUBE_BENCH_USER=flat-out` drops the pacing: a stress
                // figure, the store's writer saturated by the user.
                let next = t0 + Duration::from_secs(round as u64);
                if flat_out {
                    continue;
                }
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            ops
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    let user_ops = user.await.unwrap();
    let elapsed = t0.elapsed().as_secs_f64();
    let mut l = latencies.lock().unwrap().clone();
    l.sort_unstable();
    let pct = |p: f64| {
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    println!(
        "{} calls in {elapsed:.1} s: {:.0} calls/s; latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; {} errors; {} notices; user: {user_ops} units added/services destroyed",
        l.len(),
        l.len() as f64 / elapsed,
        pct(0.50),
        pct(0.99),
        pct(1.0),
        errors.load(Ordering::Relaxed),
        notices.load(Ordering::Relaxed),
    );
    println!(
        "process RSS: {} MB before the agents connected, {} MB now, peak {} MB (server, store and all {agents} clients)",
        rss_before / 1024,
        status_kb("VmRSS:") / 1024,
        status_kb("VmHWM:") / 1024
    );
    println!(
        "goal p99 <= 50 ms: {}",
        if pct(0.99) <= 50.0 { "met" } else { "NOT met" }
    );
    drop(server);
}
