//! PostgreSQL clients, measured; prints figures.
//! `cargo bench -p jujube-state --bench postgres`.
//!
//! One-row transactions, one at a time, as the store commits a rule, on a
//! throwaway cluster on this machine (`scripts/pg-setup`: loopback, fsync
//! and synchronous_commit on; `JUJUBE_PG_URL` names another instead), in
//! alternating rounds (medians), next to SQLite on the same disk with the
//! store's durability (WAL, synchronous=FULL):
//!
//! - rust-postgres (`postgres`, synchronous, as the store runs inside
//!   `spawn_blocking`) and tokio-postgres (its asynchronous core, on a
//!   current-thread runtime), each with its statement prepared once:
//!   - `BEGIN; INSERT; COMMIT` at READ COMMITTED and at SERIALIZABLE (how
//!     the store's rules will run: three round trips),
//!   - the INSERT alone in autocommit (one round trip: the least any
//!     client can pay for a durable row — the bare loop);
//! - rusqlite, `BEGIN IMMEDIATE; INSERT; COMMIT`;
//! - a bare tokio-postgres client writing what an `add-unit` writes, with
//!   the store's statements in the store's round trips (what is left
//!   between it and the store is the store's own cost);
//! - and jujube's own store on that cluster (a schema of its own, full
//!   durability): `add-unit` one at a time, each a whole rule (unit,
//!   machine, feed, the service's count) in one serializable transaction,
//!   as a share of the bare loops above;
//! - the store at scale, PostgreSQL beside a SQLite file (both with full
//!   durability): `deploy -n 100000` (`JUJUBE_BENCH_UNITS` overrides),
//!   `status` at that size (snapshot and JSON), and destroying the service
//!   through its cleanups until no unit is left.

use std::process::Command;
use std::time::{Duration, Instant};

const ROUNDS: usize = 5;
const N: usize = 500;

/// A cluster of our own, stopped when dropped; or the one `JUJUBE_PG_URL`
/// names.
struct Cluster {
    url: String,
    state: Option<tempfile::NamedTempFile>,
}

impl Cluster {
    fn start() -> Cluster {
        if let Ok(url) = std::env::var("JUJUBE_PG_URL") {
            return Cluster { url, state: None };
        }
        let scripts = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts");
        let state = tempfile::NamedTempFile::new().unwrap();
        let out = Command::new(format!("{scripts}/pg-setup"))
            .arg(state.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/pg-setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster {
            url: String::from_utf8(out.stdout).unwrap().trim().to_string(),
            state: Some(state),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            let scripts = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts");
            let _ = Command::new(format!("{scripts}/pg-stop"))
                .arg(state.path())
                .status();
        }
    }
}

#[derive(Clone, Copy)]
enum Shape {
    ReadCommitted,
    Serializable,
    Autocommit,
}

fn sync_round(c: &mut postgres::Client, shape: Shape, n: usize) -> Duration {
    let insert = c.prepare("INSERT INTO t (name) VALUES ($1)").unwrap();
    let start = Instant::now();
    for i in 0..n {
        let name = format!("svc/{i}");
        match shape {
            Shape::Autocommit => {
                c.execute(&insert, &[&name]).unwrap();
            }
            Shape::ReadCommitted | Shape::Serializable => {
                let level = if matches!(shape, Shape::Serializable) {
                    postgres::IsolationLevel::Serializable
                } else {
                    postgres::IsolationLevel::ReadCommitted
                };
                let mut tx = c
                    .build_transaction()
                    .isolation_level(level)
                    .start()
                    .unwrap();
                tx.execute(&insert, &[&name]).unwrap();
                tx.commit().unwrap();
            }
        }
    }
    start.elapsed()
}

async fn async_round(c: &mut tokio_postgres::Client, shape: Shape, n: usize) -> Duration {
    let insert = c.prepare("INSERT INTO t (name) VALUES ($1)").await.unwrap();
    let start = Instant::now();
    for i in 0..n {
        let name = format!("svc/{i}");
        match shape {
            Shape::Autocommit => {
                c.execute(&insert, &[&name]).await.unwrap();
            }
            Shape::ReadCommitted | Shape::Serializable => {
                let level = if matches!(shape, Shape::Serializable) {
                    tokio_postgres::IsolationLevel::Serializable
                } else {
                    tokio_postgres::IsolationLevel::ReadCommitted
                };
                let tx = c
                    .build_transaction()
                    .isolation_level(level)
                    .start()
                    .await
                    .unwrap();
                tx.execute(&insert, &[&name]).await.unwrap();
                tx.commit().await.unwrap();
            }
        }
    }
    start.elapsed()
}

/// What the store's add-unit writes, written by a bare client in the
/// store's own schema and in its round trips: `BEGIN` and the service's
/// row (its count raised, the next unit number and machine id read, with
/// the store's subqueries) in one; the machine, the unit and the feed's
/// three entries in one statement (the first two as `WITH` clauses, as the
/// store folds its kept inserts into its feed's), and `COMMIT`, in the
/// other. Requests are pipelined as the store's are (sent in order before
/// their answers are read), each with its own `Sync`, as the client sends
/// them: four in all. What a rule costs beyond this is the store's own.
async fn same_rows_round(c: &tokio_postgres::Client, n: usize) -> Duration {
    let update = c
        .prepare(
            "UPDATE services SET unit_count = unit_count + $2 WHERE name = $1
             RETURNING (SELECT constraints FROM environment WHERE id = 1),
               (SELECT coalesce(max(n), 0) FROM (
                  SELECT n FROM (SELECT number + 1 AS n FROM units WHERE service = $1
                                 ORDER BY number DESC LIMIT 1) AS last
                  UNION ALL SELECT next FROM sequences WHERE name = 'unit:' || $1) AS t),
               (SELECT coalesce(max(n), 0) FROM (
                  SELECT max(id) + 1 AS n FROM machines
                  UNION ALL SELECT next FROM sequences WHERE name = 'machine') AS t)",
        )
        .await
        .unwrap();
    let rows = c
        .prepare(
            "WITH kept0 AS (INSERT INTO machines (id, series, jobs, manage_environ, constraints)
                            VALUES ($1, $2, $3, $4, $5)),
                  kept1 AS (INSERT INTO units (name, service, number, series, machine_id, constraints)
                            VALUES ($6, $7, $8, $9, $10, $11))
             INSERT INTO changes (revision, kind, id)
             SELECT h.top + v.o, v.k, v.i
             FROM (SELECT coalesce(max(revision), 0) AS top FROM changes) AS h,
                  (VALUES (1, $12, $13), (2, $14, $15), (3, $16, $17)) AS v (o, k, i)
             ORDER BY v.o
             RETURNING revision",
        )
        .await
        .unwrap();
    let start = Instant::now();
    for _ in 0..n {
        let ((), row) = tokio::try_join!(
            biased;
            c.batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE"),
            c.query_one(&update, &[&"wordpress", &1i64])
        )
        .unwrap();
        let cons: String = row.get(0);
        let (number, id): (i64, i64) = (row.get(1), row.get(2));
        let name = format!("wordpress/{number}");
        let id_text = id.to_string();
        let series = "jammy";
        let values: [&(dyn tokio_postgres::types::ToSql + Sync); 17] = [
            &id,
            &series,
            &"host-units",
            &false,
            &cons,
            &name,
            &"wordpress",
            &number,
            &series,
            &id,
            &cons,
            &"machine",
            &id_text,
            &"unit",
            &name,
            &"service",
            &"wordpress",
        ];
        tokio::try_join!(
            biased;
            c.query(&rows, &values),
            c.batch_execute("COMMIT"),
        )
        .unwrap();
    }
    start.elapsed()
}

fn sqlite_round(c: &mut rusqlite::Connection, n: usize) -> Duration {
    let start = Instant::now();
    for i in 0..n {
        let tx = c
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        tx.prepare_cached("INSERT INTO t (name) VALUES (?1)")
            .unwrap()
            .execute([format!("svc/{i}")])
            .unwrap();
        tx.commit().unwrap();
    }
    start.elapsed()
}

/// A store of jujube's on the cluster, with a service to add units to.
/// A fresh schema `schema` on the cluster at `url`.
fn schema_on(url: &str, schema: &str) -> jujube_state::Location {
    let mut admin = postgres::Client::connect(url, postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        ))
        .unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    // Plain TCP, as the bare loops' clients connect (`NoTls`): the
    // cluster offers TLS, which the store would otherwise take.
    jujube_state::Location::Postgres(
        jujube_state::PgTarget::new(
            &format!("{url}{sep}sslmode=disable&options=-csearch_path%3D{schema}"),
            None,
        )
        .unwrap(),
    )
}

fn store_on(url: &str) -> jujube_state::Store {
    store_on_schema(url, &format!("bench_{}", std::process::id()))
}

fn store_on_schema(url: &str, schema: &str) -> jujube_state::Store {
    let st = store_at(&schema_on(url, schema));
    deploy(&st, "wordpress", 0);
    st
}

/// An initialized environment's store at `location`, full durability.
fn store_at(location: &jujube_state::Location) -> jujube_state::Store {
    let st = jujube_state::Store::open_at(location, jujube_state::Durability::Full).unwrap();
    st.initialize(&jujube_state::environment::EnvironmentSpec {
        name: "bench".into(),
        uuid: "00000000-0000-4000-8000-000000000000".into(),
        provider: "dummy".into(),
        default_series: "jammy".into(),
        constraints: jujube_core::Constraints::parse("mem=2G").unwrap(),
        config: Default::default(),
    })
    .unwrap();
    st
}

fn deploy(st: &jujube_state::Store, service: &str, units: usize) {
    use jujube_core::charm::{CharmConfig, CharmMeta};
    let meta = CharmMeta::parse("name: wordpress\nrequires:\n  db: mysql\n").unwrap();
    st.deploy(&jujube_state::services::DeployArgs {
        service: service.into(),
        charm: jujube_state::Charm {
            url: "local:jammy/wordpress-1".into(),
            meta,
            config: CharmConfig::default(),
            actions: Default::default(),
            path: String::new(),
        },
        series: "jammy".into(),
        constraints: Default::default(),
        units,
        to: None,
        settings: vec![],
    })
    .unwrap();
}

/// Deploy, `status` and destroy of a `units`-unit service on `st`: the
/// seconds each took.
fn at_scale(st: &jujube_state::Store, units: usize) -> [f64; 3] {
    let start = Instant::now();
    deploy(st, "big", units);
    let deployed = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let json = serde_json::to_vec(&st.status().unwrap()).unwrap();
    let status = start.elapsed().as_secs_f64();
    assert!(json.len() > units * 100, "a status of every unit");
    let start = Instant::now();
    st.destroy_service("big").unwrap();
    while st.run_cleanups(1_000).unwrap() > 0 {}
    assert_eq!(st.units_of("big").map(|u| u.len()).unwrap_or(0), 0);
    [deployed, status, start.elapsed().as_secs_f64()]
}

/// `n` add-units; the time, and the requests they sent.
fn store_round(st: &jujube_state::Store, n: usize) -> (Duration, u64) {
    st.reset_stats();
    let start = Instant::now();
    for _ in 0..n {
        st.add_units("wordpress", 1, None).unwrap();
    }
    (start.elapsed(), st.stats().pg_requests)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let cluster = Cluster::start();
    let mut sync = postgres::Client::connect(&cluster.url, postgres::NoTls).unwrap();
    sync.batch_execute(
        "DROP TABLE IF EXISTS t;
         CREATE TABLE t (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name TEXT NOT NULL)",
    )
    .unwrap();
    let settings: Vec<String> = ["fsync", "synchronous_commit", "wal_sync_method"]
        .iter()
        .map(|s| {
            let v: String = sync.query_one(&format!("SHOW {s}"), &[]).unwrap().get(0);
            format!("{s}={v}")
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut tokio_client = rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(&cluster.url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
    });
    let dir = tempfile::tempdir().unwrap();
    let mut lite = rusqlite::Connection::open(dir.path().join("bare.db")).unwrap();
    lite.pragma_update(None, "journal_mode", "WAL").unwrap();
    lite.pragma_update(None, "synchronous", "FULL").unwrap();
    lite.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
        .unwrap();

    let shapes = [
        (
            "BEGIN; INSERT; COMMIT (read committed)",
            Shape::ReadCommitted,
        ),
        ("BEGIN; INSERT; COMMIT (serializable)", Shape::Serializable),
        ("INSERT in autocommit", Shape::Autocommit),
    ];
    let mut figures: Vec<(String, Vec<f64>)> = Vec::new();
    let mut push = |name: String, took: Duration| match figures.iter_mut().find(|f| f.0 == name) {
        Some(f) => f.1.push(N as f64 / took.as_secs_f64()),
        None => figures.push((name, vec![N as f64 / took.as_secs_f64()])),
    };
    let st = store_on(&cluster.url);
    // The bare client of the add-unit's rows writes in a store's schema of
    // its own (made, then left to it).
    let rows_schema = format!("bench_rows_{}", std::process::id());
    drop(store_on_schema(&cluster.url, &rows_schema));
    let rows_client = rt.block_on(async {
        let sep = if cluster.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}options=-csearch_path%3D{rows_schema}", cluster.url);
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
    });
    let mut requests = 0;
    // Warm every path once.
    sync_round(&mut sync, Shape::Autocommit, 100);
    sqlite_round(&mut lite, 100);
    store_round(&st, 100);
    rt.block_on(same_rows_round(&rows_client, 100));
    for _ in 0..ROUNDS {
        for (what, shape) in shapes {
            push(
                format!("rust-postgres   {what}"),
                sync_round(&mut sync, shape, N),
            );
            push(
                format!("tokio-postgres  {what}"),
                rt.block_on(async_round(&mut tokio_client, shape, N)),
            );
        }
        push(
            "rusqlite        BEGIN IMMEDIATE; INSERT; COMMIT (WAL, synchronous=FULL)".into(),
            sqlite_round(&mut lite, N),
        );
        let (took, sent) = store_round(&st, N);
        push(STORE.into(), took);
        requests += sent;
        push(
            SAME_ROWS.into(),
            rt.block_on(same_rows_round(&rows_client, N)),
        );
    }
    println!(
        "one-row transactions, one at a time ({ROUNDS} alternating rounds of {N}, medians; PostgreSQL on loopback without TLS, every client alike, {}):",
        settings.join(", ")
    );
    let rate = |name: &str| {
        figures
            .iter()
            .find(|f| f.0 == name)
            .map(|f| median(f.1.clone()))
            .unwrap()
    };
    let ours = rate(STORE);
    let serializable = rate("tokio-postgres  BEGIN; INSERT; COMMIT (serializable)");
    let autocommit = rate("tokio-postgres  INSERT in autocommit");
    let same_rows = rate(SAME_ROWS);
    for (name, rates) in &figures {
        println!("  {name}: {:.0} tx/s", median(rates.clone()));
    }
    println!(
        "jujube add-unit on PostgreSQL: {:.0}% of a bare serializable one-row transaction, {:.0}% of a bare autocommit INSERT (goal: >= 80%)",
        100.0 * ours / serializable,
        100.0 * ours / autocommit
    );
    println!(
        "  beside a bare client writing the add-unit's rows (the same statements, round trips and durability): {:.0}%; that client is {:.0}% of the bare serializable one-row transaction",
        100.0 * ours / same_rows,
        100.0 * same_rows / serializable
    );
    println!(
        "  per add-unit: {:.2} requests answered apart, in 2 round trips (the bare one-row transaction: 3 requests in 3)",
        requests as f64 / (ROUNDS * N) as f64
    );
    // The schema is the cluster's: a cluster of our own goes with it.
    drop(st);

    let big: usize = std::env::var("JUJUBE_BENCH_UNITS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let lite = at_scale(
        &store_at(&jujube_state::Location::File(dir.path().join("state.db"))),
        big,
    );
    let pg = at_scale(
        &store_at(&schema_on(
            &cluster.url,
            &format!("bench_big_{}", std::process::id()),
        )),
        big,
    );
    println!("the store at {big} units (one run each; full durability), PostgreSQL beside SQLite:");
    for (i, what) in [
        format!("deploy -n {big}"),
        "status (snapshot and JSON)".to_string(),
        "destroy-service through its cleanups".to_string(),
    ]
    .iter()
    .enumerate()
    {
        println!(
            "  {what}: PostgreSQL {:.2} s, SQLite {:.2} s ({:.1}x)",
            pg[i],
            lite[i],
            pg[i] / lite[i]
        );
    }
}

const SAME_ROWS: &str =
    "tokio-postgres  the add-unit's rows (BEGIN, UPDATE; 3 INSERTs in 1 statement, COMMIT; pipelined)";
const STORE: &str = "jujube store    add-unit (one rule: unit, machine, feed, count; serializable)";
