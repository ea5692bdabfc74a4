//! 1,000 machine agents on the API server at once, over real TCP sockets
//! and TLS, each on its own HTTP/2 connection with its own credential: each
//! watches its machine, re-reads it on every notice, and about once a
//! second re-reads it and writes its status (the cheap calls whose latency
//! is the figure). Three phases, one run:
//! - idle: the machine agents alone;
//! - deploying: a user, once a second, deploys a service with 50 units onto
//!   those machines and destroys it again;
//! - relation hooks: a unit agent per machine (its own connection and
//!   credential; services in pairs of 10 + 10 units, related), each in its
//!   relation's scope, watching it, re-reading its counterparts and their
//!   settings on every notice (one call, as the unit agent does), then
//!   running its `-changed` hook (100 ms on its own machine, during which
//!   further notices wait, as in the unit agent), and changing its own
//!   settings every `JUJUBE_BENCH_SET_EVERY` seconds (default 10; 1,000
//!   units make 100 `relation-set`s a second, every counterpart re-reading)
//!   — while the user, once a second,
//!   deploys a pair of services, relates them, adds units and destroys them.
//!
//! Prints, per phase, calls/s and p50/p99/max latency of the machine
//! agents' calls (and of the unit agents' calls), and the process's peak
//! RSS (server, store and every client share the process: an upper bound
//! for the controller). Goal: the machine agents' p99 ≤ 50 ms at 1,000
//! agents in every phase.
//!
//! `cargo bench -p jujube-api --bench load`; `JUJUBE_BENCH_AGENTS` (default
//! 1,000), `JUJUBE_BENCH_SECONDS` (per phase, default 15) and
//! `JUJUBE_BENCH_SET_EVERY` override the size; `JUJUBE_BENCH_USER=flat-out` makes the user as fast as the store
//! allows.

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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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

fn charm(dir: &std::path::Path, name: &str, meta: &str) -> Charm {
    let meta = CharmMeta::parse(&format!("name: {name}\nsummary: load\n{meta}")).unwrap();
    let path = dir.join("charms").join(name);
    std::fs::create_dir_all(&path).unwrap();
    Charm {
        url: format!("local:jammy/{name}-1"),
        meta,
        config: CharmConfig::default(),
        actions: Default::default(),
        path: path.to_string_lossy().into_owned(),
    }
}

fn deploy(store: &Store, service: &str, charm: &Charm) {
    store
        .deploy(&DeployArgs {
            service: service.into(),
            charm: charm.clone(),
            series: "jammy".into(),
            constraints: Constraints::default(),
            units: 0,
            to: None,
            settings: vec![],
        })
        .unwrap();
}

/// Latencies (µs) of one kind of call, per phase.
type Latencies = Arc<[Mutex<Vec<u32>>; 3]>;

const PHASES: [&str; 3] = ["idle", "deploying", "relation hooks"];
const SETTING_UP: usize = 3;
const OVER: usize = 4;

fn percentile(sorted: &[u32], p: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0) as f64
        / 1000.0
}

/// How long a unit agent's `-changed` hook runs (on its own machine: the
/// controller spends nothing meanwhile).
const HOOK: Duration = Duration::from_millis(100);

/// Prints one kind of call's rate and latencies over `secs`; returns its
/// p99 (ms).
fn report(phase: &str, what: &str, calls: &Mutex<Vec<u32>>, secs: f64, tail: &str) -> f64 {
    let mut l = calls.lock().unwrap().clone();
    l.sort_unstable();
    println!(
        "{phase:>15}{} {what} {:.0}/s, latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms{tail}",
        if phase.is_empty() { " " } else { ":" },
        l.len() as f64 / secs,
        percentile(&l, 0.50),
        percentile(&l, 0.99),
        percentile(&l, 1.0),
    );
    percentile(&l, 0.99)
}

/// Units per service in the relation phase: each unit sees 10
/// counterparts.
const PAIR_SIDE: usize = 10;

fn main() {
    raise_fd_limit();
    let agents = env_num("JUJUBE_BENCH_AGENTS", 1000) as usize;
    let seconds = env_num("JUJUBE_BENCH_SECONDS", 15);
    let set_every = env_num("JUJUBE_BENCH_SET_EVERY", 10).max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(agents, seconds, set_every));
}

async fn run(agents: usize, seconds: u64, set_every: u64) {
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
        // Every agent here connects from 127.0.0.1, where real agents
        // each have an address of their own: the per-peer bound on
        // connections not yet proven would refuse most of them.
        Limits {
            max_unauthenticated_per_peer: 2 * agents + 16,
            ..Limits::default()
        },
        None,
    )
    .await
    .unwrap();
    let addr = server.tcp_addr().unwrap().to_string();
    let rss_before = status_kb("VmRSS:");
    let remote_for = |tag: Tag| {
        let secret = new_secret();
        match &tag {
            Tag::Machine(id) => store
                .set_machine_credential(*id, &tag.to_string(), &secret_hash(&secret))
                .unwrap(),
            Tag::Unit(name) => store
                .set_unit_credential(name, &tag.to_string(), &secret_hash(&secret))
                .unwrap(),
        }
        Remote::new(&AgentConf {
            api_addresses: vec![addr.clone()],
            ca_cert: ca.clone(),
            tag,
            secret,
            env_name: "load".into(),
            env_uuid: String::new(),
        })
        .unwrap()
    };

    let machine_calls: Latencies = Arc::new(Default::default());
    let status_writes: Latencies = Arc::new(Default::default());
    let unit_calls: Latencies = Arc::new(Default::default());
    let errors = Arc::new(AtomicU64::new(0));
    let notices = Arc::new(AtomicU64::new(0));
    // The phase now: 0 idle, 1 deploying, 2 relation hooks; SETTING_UP
    // while the relation phase's services, units and agents are made (not
    // counted: a thousand agents connecting is not the load measured);
    // OVER when the run is over.
    let phase = Arc::new(AtomicUsize::new(0));
    let t_connect = Instant::now();
    // Each agent subscribes (its first call: connection, TLS, watch).
    let mut watching = Vec::with_capacity(agents);
    for &id in &ids {
        let remote = remote_for(Tag::Machine(id));
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
        "{agents} machine agents connected and watching in {:.1} s",
        t_connect.elapsed().as_secs_f64()
    );

    let mut tasks = Vec::with_capacity(agents);
    for (i, (id, remote, mut stream)) in ready.into_iter().enumerate() {
        let writes = status_writes.clone();
        let (calls, errors, notices, phase) = (
            machine_calls.clone(),
            errors.clone(),
            notices.clone(),
            phase.clone(),
        );
        tasks.push(tokio::spawn(async move {
            use futures_util::StreamExt;
            // Spread the ticks: about one pass per second per agent.
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + Duration::from_millis((i as u64 * 7919) % 1000),
                Duration::from_secs(1),
            );
            let mut n = 0u64;
            let mut mine: [Vec<u32>; 3] = Default::default();
            let mut written: [Vec<u32>; 3] = Default::default();
            let mut check = tokio::time::interval(Duration::from_millis(100));
            loop {
                // A notice: re-read the view. A tick: re-read and report
                // status, as an agent's periodic work does.
                let write = tokio::select! {
                    _ = check.tick() => {
                        if phase.load(Ordering::Relaxed) == OVER { break }
                        continue;
                    }
                    _ = tick.tick() => true,
                    Some(_) = stream.next() => {
                        notices.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                };
                let p = phase.load(Ordering::Relaxed);
                let t = Instant::now();
                let mut ok = remote.machine(id).await.is_ok();
                if let Some(v) = mine.get_mut(p) {
                    v.push(t.elapsed().as_micros() as u32);
                }
                if write {
                    n += 1;
                    let t = Instant::now();
                    ok &= remote
                        .set_machine_status(id, AgentStatus::Started, &format!("pass {n}"))
                        .await
                        .is_ok();
                    if let Some(v) = written.get_mut(p) {
                        v.push(t.elapsed().as_micros() as u32);
                    }
                }
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            for (p, v) in mine.into_iter().enumerate() {
                calls[p].lock().unwrap().extend(v);
            }
            for (p, v) in written.into_iter().enumerate() {
                writes[p].lock().unwrap().extend(v);
            }
            drop(remote);
        }));
    }

    let flat_out = std::env::var("JUJUBE_BENCH_USER").as_deref() == Ok("flat-out");
    let app = charm(
        dir.path(),
        "app",
        "requires:\n  db:\n    interface: pgsql\n",
    );
    let db = charm(dir.path(), "db", "provides:\n  db:\n    interface: pgsql\n");
    // The user, for one phase: once a second (or flat out) a round of
    // `round_fn`; returns the rounds made.
    let user = |round_fn: fn(&Store, &[i64], &Charm, &Charm, usize)| {
        let (store, ids, app, db) = (store.clone(), ids.clone(), app.clone(), db.clone());
        tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let mut round = 0usize;
            while Instant::now() < t0 + Duration::from_secs(seconds) {
                round_fn(&store, &ids, &app, &db, round);
                round += 1;
                // A user types commands; one round a second keeps every
                // agent's machine changing every 20 s or so.
                let next = t0 + Duration::from_secs(round as u64);
                if flat_out {
                    continue;
                }
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            round
        })
    };
    let started = Instant::now();

    // Idle.
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let mut ends = vec![started.elapsed()];

    // Deploying.
    phase.store(1, Ordering::Relaxed);
    let rounds_deploying = user(|store, ids, app, _db, round| {
        let svc = format!("app{round}");
        deploy(store, &svc, app);
        for k in 0..50 {
            let m = ids[(round * 50 + k) % ids.len()];
            store.add_units(&svc, 1, Some(m)).unwrap();
        }
        store.destroy_service(&svc).unwrap();
        while store.cleanup_step().unwrap_or(false) {}
    })
    .await
    .unwrap();
    ends.push(started.elapsed());
    phase.store(SETTING_UP, Ordering::Relaxed);

    // Relation hooks: services in pairs, a unit per machine, related.
    let t_units = Instant::now();
    let mut units: Vec<(String, i64)> = Vec::with_capacity(agents);
    for (g, group) in ids.chunks(2 * PAIR_SIDE).enumerate() {
        let (a, d) = (format!("web{g}"), format!("pg{g}"));
        deploy(&store, &a, &app);
        deploy(&store, &d, &db);
        let rel = store.add_relation(&a, &d).unwrap();
        for (k, &m) in group.iter().enumerate() {
            let svc = if k < PAIR_SIDE { &a } else { &d };
            let name = store.add_units(svc, 1, Some(m)).unwrap().remove(0);
            units.push((name, rel.id));
        }
    }
    let mut joining = Vec::with_capacity(units.len());
    for (i, (name, rel)) in units.into_iter().enumerate() {
        let remote = remote_for(Tag::unit(&name));
        joining.push(tokio::spawn(async move {
            remote
                .enter_scope(
                    rel,
                    &name,
                    vec![(
                        "private-address".into(),
                        format!("10.0.{}.{}", i / 250, i % 250),
                    )],
                )
                .await
                .unwrap();
            let stream = remote
                .watch(WatchTarget::Scope {
                    relation: rel,
                    unit: name.clone(),
                })
                .await
                .unwrap();
            (name, rel, remote, stream)
        }));
    }
    let mut joined = Vec::with_capacity(joining.len());
    for j in joining {
        joined.push(j.await.unwrap());
    }
    println!(
        "{} unit agents entered their relations' scopes and are watching them in {:.1} s; each sets its settings every {set_every} s, a hook runs {} ms",
        joined.len(),
        t_units.elapsed().as_secs_f64(),
        HOOK.as_millis()
    );
    let unit_notices = Arc::new(AtomicU64::new(0));
    for (i, (name, rel, remote, mut stream)) in joined.into_iter().enumerate() {
        let (calls, errors, notices, phase) = (
            unit_calls.clone(),
            errors.clone(),
            unit_notices.clone(),
            phase.clone(),
        );
        tasks.push(tokio::spawn(async move {
            use futures_util::StreamExt;
            let every = set_every * 1000;
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + Duration::from_millis((i as u64 * 7919) % every),
                Duration::from_millis(every),
            );
            let mut check = tokio::time::interval(Duration::from_millis(100));
            let mut mine = Vec::new();
            let mut n = 0u64;
            let timed = |mine: &mut Vec<u32>, t: Instant, ok: bool| {
                mine.push(t.elapsed().as_micros() as u32);
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            };
            loop {
                let changed = tokio::select! {
                    _ = check.tick() => {
                        if phase.load(Ordering::Relaxed) == OVER { break }
                        continue;
                    }
                    _ = tick.tick() => false,
                    Some(_) = stream.next() => true,
                };
                if changed {
                    // What the unit agent re-reads on a scope notice: who
                    // is there and what they say, in one call.
                    notices.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let ok = remote.scope_settings(rel, &name, None).await.is_ok();
                    timed(&mut mine, t, ok);
                    tokio::time::sleep(HOOK).await;
                } else {
                    // `relation-set`.
                    n += 1;
                    let t = Instant::now();
                    let ok = remote
                        .update_relation_settings(
                            rel,
                            &name,
                            vec![("seq".into(), Some(n.to_string()))],
                        )
                        .await
                        .is_ok();
                    timed(&mut mine, t, ok);
                }
            }
            calls[2].lock().unwrap().extend(mine);
            drop(remote);
        }));
    }
    phase.store(2, Ordering::Relaxed);
    let phase2_start = started.elapsed();
    let rounds_relating = user(|store, ids, app, db, round| {
        let (a, d) = (format!("w{round}"), format!("p{round}"));
        deploy(store, &a, app);
        deploy(store, &d, db);
        store.add_relation(&a, &d).unwrap();
        for k in 0..25 {
            let m = ids[(round * 50 + k) % ids.len()];
            store.add_units(&a, 1, Some(m)).unwrap();
            store
                .add_units(&d, 1, Some(ids[(round * 50 + 25 + k) % ids.len()]))
                .unwrap();
        }
        store.destroy_service(&a).unwrap();
        store.destroy_service(&d).unwrap();
        while store.cleanup_step().unwrap_or(false) {}
    })
    .await
    .unwrap();
    ends.push(started.elapsed());
    phase.store(OVER, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let starts = [Duration::ZERO, ends[0], phase2_start];
    let mut met = true;
    for (p, name) in PHASES.iter().enumerate() {
        let secs = (ends[p] - starts[p]).as_secs_f64();
        let user = match p {
            1 => format!("; user: {rounds_deploying} services of 50 units deployed and destroyed"),
            2 => format!(
                "; user: {rounds_relating} related pairs of 25 + 25 units deployed and destroyed"
            ),
            _ => String::new(),
        };
        let p99 = report(
            name,
            "machine agents' reads (the cheap call)",
            &machine_calls[p],
            secs,
            &user,
        );
        met &= p99 <= 50.0;
        report(
            "",
            "machine agents' status writes",
            &status_writes[p],
            secs,
            "",
        );
        if p == 2 {
            let notices = format!("; {} scope notices", unit_notices.load(Ordering::Relaxed));
            report(
                "",
                "unit agents' relation calls",
                &unit_calls[2],
                secs,
                &notices,
            );
        }
    }
    println!(
        "{} errors; {} machine notices",
        errors.load(Ordering::Relaxed),
        notices.load(Ordering::Relaxed),
    );
    println!(
        "process RSS: {} MB before the agents connected, {} MB now, peak {} MB (server, store and every client)",
        rss_before / 1024,
        status_kb("VmRSS:") / 1024,
        status_kb("VmHWM:") / 1024
    );
    println!(
        "goal: the cheap call's p99 <= 50 ms in every phase: {}",
        if met { "met" } else { "NOT met" }
    );
    drop(server);
}
