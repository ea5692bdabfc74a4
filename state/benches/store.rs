//! Store benchmark; prints figures. `cargo bench -p jujube-state`.
//!
//! - add-unit, add-machine and `set` (a service setting), one at a time as
//!   users and autoscalers make them (one transaction each,
//!   synchronous=FULL), next to a bare rusqlite loop of one-row
//!   transactions with the same durability: rounds alternating between
//!   them, the median of each, with WAL pages, writes and commits per
//!   operation (one commit is one fsync of the WAL); beside the same bare
//!   loop on pages of the store's size, and a bare transaction writing as
//!   many WAL pages (one row in each of as many tables): the fsync of a
//!   commit costs more for each page it carries;
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
        config: CharmConfig::parse(
            "wordpress",
            "options:\n  blog-title:\n    type: string\n    default: a blog\n",
        )
        .unwrap(),
        actions: Default::default(),
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

/// A charm with a setting for `set`.
const WORDPRESS: &str = "name: wordpress\nrequires:\n  db: mysql\n";

fn deploy(st: &Store, name: &str, units: usize) {
    st.deploy(&DeployArgs {
        service: name.into(),
        charm: charm(WORDPRESS),
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

/// The most tables a bare transaction writes (one row each): more pages
/// than any operation measured here writes.
const WIDEST: usize = 12;

/// A bare loop's connection: WAL, synchronous=FULL, tables `t0`..`t11`,
/// pages of `page_size` bytes (SQLite's default is 4096).
fn bare_connection(path: &std::path::Path, page_size: i64) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).unwrap();
    c.pragma_update(None, "page_size", page_size).unwrap();
    c.pragma_update(None, "journal_mode", "WAL").unwrap();
    c.pragma_update(None, "synchronous", "FULL").unwrap();
    for t in 0..WIDEST {
        c.execute_batch(&format!(
            "CREATE TABLE t{t} (id INTEGER PRIMARY KEY, name TEXT NOT NULL)"
        ))
        .unwrap();
    }
    c
}

/// `n` transactions of one row in each of `width` tables (one page of each
/// table's last leaf: `width` WAL pages a commit); the time and WAL pages
/// they took.
fn bare_loop(c: &mut rusqlite::Connection, n: usize, width: usize) -> (Duration, u64) {
    jujube_state::pages_written(c, true);
    let start = Instant::now();
    for i in 0..n {
        let tx = c
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        for t in 0..width {
            tx.prepare_cached(&format!("INSERT INTO t{t} (name) VALUES (?1)"))
                .unwrap()
                .execute([format!("svc/{i}")])
                .unwrap();
        }
        tx.commit().unwrap();
    }
    (start.elapsed(), jujube_state::pages_written(c, false))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The bare loops an operation is set against.
struct Bare {
    /// SQLite's defaults: the goal's loop.
    default: rusqlite::Connection,
    /// Pages of the store's size.
    small: rusqlite::Connection,
    /// The store's page size.
    page_size: i64,
}

/// One operation at a time against the bare loops, in alternating rounds
/// (the disk's mood moves all alike); prints the medians. The goal is set
/// against one-row transactions of SQLite's defaults. Beside it, the same
/// on pages of the store's size, and a bare transaction writing as many
/// WAL pages of that size as the operation does: a commit's fsync costs
/// more for each page it carries, so that one shows what is the disk's
/// charge for the pages and what is the store's own cost. SQLite writes a
/// WAL frame in two calls (its header, its page); the store's writer, one
/// commit in one (see `walvfs`).
fn side_by_side(name: &str, what: &str, st: &Store, bare: &mut Bare, mut op: impl FnMut(usize)) {
    const ROUNDS: usize = 5;
    const N: usize = 400;
    // The operation's pages, from a first round that is not counted.
    st.reset_stats();
    for i in 0..N {
        op(i);
    }
    let width = ((st.stats().wal_pages as f64 / N as f64).round() as usize).clamp(1, WIDEST);
    let (mut ours, mut one, mut small, mut wide) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut pages, mut writes, mut commits) = (0, 0, 0);
    let (mut one_pages, mut wide_pages) = (0, 0);
    for round in 1..=ROUNDS {
        st.reset_stats();
        let start = Instant::now();
        for i in 0..N {
            op(round * N + i);
        }
        ours.push(rate(N, start.elapsed()));
        let stats = st.stats();
        pages += stats.wal_pages;
        writes += stats.wal_writes;
        commits += stats.transactions;
        let (took, p) = bare_loop(&mut bare.default, N, 1);
        one.push(rate(N, took));
        one_pages += p;
        let (took, _) = bare_loop(&mut bare.small, N, 1);
        small.push(rate(N, took));
        let (took, p) = bare_loop(&mut bare.small, N, width);
        wide.push(rate(N, took));
        wide_pages += p;
    }
    let (ours, one, small, wide) = (median(ours), median(one), median(small), median(wide));
    let ops = (ROUNDS * N) as f64;
    let kib = bare.page_size / 1024;
    println!(
        "{name}: {ours:.0}/s ({what}); bare rusqlite one-row transactions: {one:.0} tx/s; ratio {:.0}% (goal >= 90%); per operation {:.2} commits, {:.1} WAL pages of {kib} KiB in {:.2} writes (bare: 1 commit, {:.1} pages of 4 KiB in {:.0} writes, SQLite's two a page)",
        100.0 * ours / one,
        commits as f64 / ops,
        pages as f64 / ops,
        writes as f64 / ops,
        one_pages as f64 / ops,
        2.0 * one_pages as f64 / ops,
    );
    println!(
        "  beside bare one-row transactions on {kib} KiB pages: {small:.0} tx/s; ratio {:.0}%",
        100.0 * ours / small,
    );
    println!(
        "  beside a bare transaction of one row in each of {width} tables ({kib} KiB pages; {:.1} WAL pages in {:.0} writes, SQLite's two a page, 1 commit): {wide:.0} tx/s; ratio {:.0}%",
        wide_pages as f64 / ops,
        2.0 * wide_pages as f64 / ops,
        100.0 * ours / wide,
    );
}

fn main() {
    let big: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();

    // 1. One at a time, against the bare loop.
    let st = store(dir.path());
    deploy(&st, "wordpress", 0);
    let page_size = rusqlite::Connection::open(st.path().expect("a store on SQLite"))
        .unwrap()
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .unwrap();
    let mut bare = Bare {
        default: bare_connection(&dir.path().join("bare.db"), 4096),
        small: bare_connection(&dir.path().join("small.db"), page_size),
        page_size,
    };
    // Warm the WALs to their working size first.
    for c in [&mut bare.default, &mut bare.small] {
        bare_loop(c, 1_000, 1);
        bare_loop(c, 100, WIDEST);
    }
    for _ in 0..200 {
        st.add_units("wordpress", 1, None).unwrap();
    }
    side_by_side(
        "add-unit",
        "units, each unit + machine + feed in one transaction",
        &st,
        &mut bare,
        |_| {
            st.add_units("wordpress", 1, None).unwrap();
        },
    );
    side_by_side("add-machine", "machines", &st, &mut bare, |_| {
        st.add_machines(1, None, None).unwrap();
    });
    side_by_side("set", "a service setting changed", &st, &mut bare, |i| {
        st.set_service_settings("wordpress", &[("blog-title".into(), format!("t{i}"))])
            .unwrap();
    });
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
    rusqlite::Connection::open(st.path().expect("a store on SQLite"))
        .unwrap()
        .execute(
            "UPDATE machines SET status = 'error', status_info = 'bench' WHERE id > 0",
            [],
        )
        .unwrap();
    phase(&format!("retry-provisioning --all of {big}"), &mut || {
        assert_eq!(st.retry_all_provisioning().unwrap().1 as usize, big);
    });
}
