//! The writer's WAL through `walvfs`: a commit is one write of the log,
//! and everything committed is in the files when the commit returns.

use super::{deploy_args, spec, WORDPRESS};
use crate::{Durability, Store};
use std::path::Path;

/// A store as environments have it: on files, every commit synced.
fn durable(dir: &Path) -> Store {
    let st = Store::open_with(dir.join("state.db"), Durability::Full).unwrap();
    st.initialize(&spec("")).unwrap();
    st
}

/// What a crash would leave: the database and its log copied as they are
/// on disk now, while the store still runs (no close, no checkpoint), then
/// opened with SQLite's own VFS, which recovers the log from its frames
/// and checksums alone.
fn as_left_by_a_crash(dir: &Path, into: &Path) -> rusqlite::Connection {
    for file in ["state.db", "state.db-wal"] {
        std::fs::copy(dir.join(file), into.join(file)).unwrap();
    }
    rusqlite::Connection::open(into.join("state.db")).unwrap()
}

fn units(c: &rusqlite::Connection) -> Vec<String> {
    let mut stmt = c
        .prepare("SELECT name FROM units ORDER BY service, number")
        .unwrap();
    let names = stmt.query_map([], |r| r.get(0)).unwrap();
    names.map(Result::unwrap).collect()
}

#[test]
fn an_add_unit_is_one_write_of_the_log_and_on_disk_when_it_returns() {
    let (dir, crashed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let st = durable(dir.path());
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 1)).unwrap();
    st.reset_stats();
    let added = st.add_units("wordpress", 1, None).unwrap();
    let stats = st.stats();
    assert_eq!(stats.transactions, 1);
    // Its pages (the unit, its machine, their indexes, the service, the
    // feed), each a header and a page for SQLite alone: one write here.
    assert!(stats.wal_pages >= 5, "{stats:?}");
    assert_eq!(stats.wal_writes, 1, "{stats:?}");
    assert_eq!(added, ["wordpress/1"]);
    let left = as_left_by_a_crash(dir.path(), crashed.path());
    assert_eq!(units(&left), ["wordpress/0", "wordpress/1"]);
    // And another connection (SQLite's own VFS) reads it at once.
    let other = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    assert_eq!(units(&other), ["wordpress/0", "wordpress/1"]);
}

#[test]
fn a_commit_larger_than_what_is_gathered_is_written_in_runs_and_kept_whole() {
    let (dir, crashed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let st = durable(dir.path());
    st.reset_stats();
    // One transaction of a 300 KB charm archive: its overflow pages.
    let archive: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    st.keep_charm_archive("local/big-1", &archive).unwrap();
    let stats = st.stats();
    assert_eq!(stats.transactions, 1, "{stats:?}");
    let bytes = stats.wal_pages * (1024 + 24);
    let runs = bytes.div_ceil(crate::walvfs::GATHER_MAX as u64);
    assert!(runs >= 4, "{stats:?}");
    // Runs of at most what is gathered, where SQLite alone writes twice a
    // page.
    assert_eq!(stats.wal_writes, runs, "{stats:?}");
    let left = as_left_by_a_crash(dir.path(), crashed.path());
    let kept: Vec<u8> = left
        .query_row(
            "SELECT archive FROM charm_archives WHERE path = 'local/big-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(kept == archive, "the archive came back changed");
    drop(st);
    let reopened = Store::open(dir.path().join("state.db")).unwrap();
    assert!(reopened.charm_archive("local/big-1").unwrap() == Some(archive));
}

#[test]
fn new_stores_have_small_pages_and_an_existing_one_keeps_its_own() {
    let page_size = |path: &Path| -> i64 {
        let c = rusqlite::Connection::open(path).unwrap();
        c.query_row("PRAGMA page_size", [], |r| r.get(0)).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let st = durable(dir.path());
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 1)).unwrap();
    assert_eq!(page_size(&dir.path().join("state.db")), 1024);

    // A database made with SQLite's default pages, as stores were.
    let old = tempfile::tempdir().unwrap();
    let path = old.path().join("state.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (a); DROP TABLE t;")
        .unwrap();
    assert_eq!(page_size(&path), 4096);
    let st = durable(old.path());
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 3)).unwrap();
    st.reset_stats();
    st.add_units("wordpress", 1, None).unwrap();
    assert_eq!(st.stats().wal_writes, 1);
    assert_eq!(page_size(&path), 4096);
    assert_eq!(st.service("wordpress").unwrap().unit_count, 4);
}

#[test]
fn a_store_that_does_not_sync_writes_its_log_as_sqlite_does() {
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
    st.initialize(&spec("")).unwrap();
    st.reset_stats();
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 1)).unwrap();
    let stats = st.stats();
    assert!(stats.wal_pages > 0, "{stats:?}");
    assert_eq!(stats.wal_writes, 0, "{stats:?}");
}
