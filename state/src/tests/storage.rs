//! How the store lays its database out on disk.

use super::*;
use crate::db::PAGE_SIZE;

fn page_size(path: &std::path::Path) -> i64 {
    rusqlite::Connection::open(path)
        .unwrap()
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn a_new_database_has_small_pages_and_an_existing_one_keeps_its_own() {
    let e = env();
    e.deploy(WORDPRESS, "wordpress", 3);
    assert_eq!(page_size(e.st.path()), PAGE_SIZE);

    // A store made before the page size was chosen: SQLite's default.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.pragma_update(None, "page_size", 4096).unwrap();
        c.execute_batch("CREATE TABLE before (x)").unwrap();
    }
    let st = Store::open_with(&path, Durability::Relaxed).unwrap();
    st.initialize(&spec("")).unwrap();
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 3)).unwrap();
    st.add_units("wordpress", 2, None).unwrap();
    assert_eq!(st.units_of("wordpress").unwrap().len(), 5);
    drop(st);
    assert_eq!(page_size(&path), 4096);
}
