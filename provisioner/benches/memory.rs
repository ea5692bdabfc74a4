//! The controller's memory with many machines; prints figures.
//! `cargo bench -p jujube-provisioner --bench memory` (`JUJUBE_BENCH_MACHINES`,
//! default 100,000).
//!
//! The parent process creates a dummy environment with that many machines
//! (as `jujube add-machine` would), then runs the controller's part in a
//! child process of its own, so that the child's peak RSS (`VmHWM` in
//! `/proc/self/status`) is the controller's alone: a store on the SQLite
//! file, the dummy cloud persisted in the environment's directory, and the
//! provisioner's run loop on a two-thread runtime (as `jujube controller`),
//! until every machine is provisioned and a few harvest passes have listed
//! every instance. It allocates as `jujube` does (jemalloc, one arena);
//! `_RJEM_MALLOC_CONF=narenas:8` measures with jemalloc's default arenas.

use jujube_core::Constraints;
use jujube_providers::dummy::DummyProvider;
use jujube_provisioner::Provisioner;
use jujube_state::environment::EnvironmentSpec;
use jujube_state::Store;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const UUID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d";
const CHILD: &str = "JUJUBE_MEMORY_BENCH_DIR";

fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn config() -> BTreeMap<String, String> {
    [("harvest-interval", "2s")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `jujube`'s allocator and its settings (see `malloc_conf` in its
/// `main.rs`): jemalloc, one arena, freed pages given back at once.
/// `_RJEM_MALLOC_CONF` in the environment overrides them.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: Option<&'static std::ffi::c_char> = Some(
    // SAFETY: a static C string, read by jemalloc as one.
    unsafe { &*c"narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0".as_ptr() },
);

fn child(dir: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = std::path::PathBuf::from(dir);
    let store = Store::open(dir.join("state.db")).unwrap();
    let n = store.next_machine_id().unwrap() as usize;
    let t0 = std::time::Instant::now();
    rt.block_on(async {
        let cloud = Arc::new(DummyProvider::open(&dir, "bench", UUID, &config()).unwrap());
        let p = Provisioner::new(store.clone(), cloud).unwrap();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let run = tokio::spawn({
            let p = p.clone();
            async move { p.run(stop_rx).await }
        });
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            // A count, not the machine list: the bench must not add to the
            // memory it measures.
            if store.provisioned_count().unwrap() == n {
                break;
            }
        }
        let provisioned = t0.elapsed();
        // A few harvest passes over every instance.
        tokio::time::sleep(Duration::from_secs(7)).await;
        stop_tx.send_replace(true);
        run.await.unwrap().unwrap();
        println!(
            "controller: {n} machines provisioned on the dummy in {:.1} s; peak RSS (VmHWM) {} MB, RSS at the end {} MB (goal <= 300 MB)",
            provisioned.as_secs_f64(),
            status_kb("VmHWM:") / 1024,
            status_kb("VmRSS:") / 1024,
        );
    });
}

fn main() {
    if let Ok(dir) = std::env::var(CHILD) {
        return child(&dir);
    }
    let n: usize = std::env::var("JUJUBE_BENCH_MACHINES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open(dir.path().join("state.db")).unwrap();
    st.initialize(&EnvironmentSpec {
        name: "bench".into(),
        uuid: UUID.into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: Constraints::default(),
        config: config(),
    })
    .unwrap();
    for _ in 0..(n - 1) / 10_000 {
        st.add_machines(10_000, None, None).unwrap();
    }
    st.add_machines((n - 1) % 10_000, None, None).unwrap();
    drop(st);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(CHILD, dir.path())
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the controller process failed");
}
