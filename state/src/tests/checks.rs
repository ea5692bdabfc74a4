//! The SQLite schema's checks of a column against a list: the same rules
//! as comparisons, with no ephemeral table built for each row written.

use super::{deploy_args, spec, WORDPRESS};
use crate::schema::MIGRATIONS;
use crate::{Durability, Store};

/// The opcodes SQLite would run for `sql` (its parameters bound as NULL).
fn opcodes(c: &rusqlite::Connection, sql: &str) -> Vec<String> {
    let mut stmt = c.prepare(&format!("EXPLAIN {sql}")).unwrap();
    let ops = stmt.raw_query().mapped(|r| r.get::<_, String>(1));
    ops.map(Result::unwrap).collect()
}

/// What a rule's inserts and its lifecycle updates cost, and that the
/// checks still refuse what they refused.
fn assert_checks_are_comparisons(c: &rusqlite::Connection) {
    let tables: Vec<String> = c
        .prepare("SELECT sql FROM sqlite_schema WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(tables.iter().all(|t| !t.contains(" IN (")), "{tables:#?}");
    for sql in [
        "INSERT INTO units (name, service, number, series, machine_id, constraints) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        "INSERT INTO machines (id, series, jobs, manage_environ, constraints) VALUES (?1, ?2, ?3, ?4, ?5)",
        "UPDATE units SET life = ?1 WHERE name = ?2",
        "UPDATE machines SET life = ?1 WHERE id = ?2",
        "UPDATE services SET life = ?1 WHERE name = ?2",
    ] {
        let ops = opcodes(c, sql);
        assert!(!ops.iter().any(|o| o == "OpenEphemeral"), "{sql}: {ops:?}");
    }
    for (sql, what) in [
        ("UPDATE units SET life = 3", "units.life"),
        ("UPDATE machines SET life = -1", "machines.life"),
        ("UPDATE services SET life = 1.5", "services.life"),
        (
            "UPDATE relation_endpoints SET role = 'peers'",
            "relation_endpoints.role",
        ),
    ] {
        let e = c.execute(sql, []).unwrap_err().to_string();
        assert!(e.contains("CHECK constraint failed"), "{what}: {e}");
    }
}

#[test]
fn a_new_store_checks_its_lists_by_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let st = Store::open_with(dir.path().join("state.db"), Durability::Relaxed).unwrap();
    st.initialize(&spec("")).unwrap();
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 2)).unwrap();
    st.deploy(&deploy_args(super::MYSQL, "mysql", 1)).unwrap();
    st.add_relation("wordpress", "mysql").unwrap();
    let c = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    assert_checks_are_comparisons(&c);
}

#[test]
fn a_store_made_with_list_checks_migrates_to_comparisons_and_keeps_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    // Rows of every kind the checks cover.
    let st = Store::open_with(&path, Durability::Relaxed).unwrap();
    st.initialize(&spec("")).unwrap();
    st.deploy(&deploy_args(WORDPRESS, "wordpress", 2)).unwrap();
    st.deploy(&deploy_args(super::MYSQL, "mysql", 1)).unwrap();
    st.add_relation("wordpress", "mysql").unwrap();
    st.destroy_units(&["wordpress/1".to_string()]).unwrap();
    st.destroy_service("mysql").unwrap();
    drop(st);
    // The tables as the migration before this one left them: the lists,
    // and nothing later migrations add (each later one is undone below).
    let before = MIGRATIONS
        .iter()
        .position(|m| m.contains("PRAGMA writable_schema = ON"))
        .unwrap();
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "PRAGMA writable_schema = ON;
             UPDATE sqlite_schema SET sql = replace(replace(replace(sql,
                 'CHECK (life = 0 OR life = 1 OR life = 2)', 'CHECK (life IN (0, 1, 2))'),
                 'CHECK (role = ''provider'' OR role = ''requirer'' OR role = ''peer'')',
                 'CHECK (role IN (''provider'', ''requirer'', ''peer''))'),
                 'CHECK (access = 0 OR access = 1 OR access = 2 OR access = 3)',
                 'CHECK (access IN (0, 1, 2, 3))')
                 WHERE type = 'table';
             PRAGMA writable_schema = RESET;
             DROP INDEX machines_in_error;
             DROP TABLE strays_unlisted;",
        )
        .unwrap();
        c.pragma_update(None, "user_version", before as i64)
            .unwrap();
        let c = rusqlite::Connection::open(&path).unwrap();
        let ops = opcodes(
            &c,
            "INSERT INTO machines (id, series, jobs, manage_environ, constraints) VALUES (?1, ?2, ?3, ?4, ?5)",
        );
        assert!(ops.iter().any(|o| o == "OpenEphemeral"), "{ops:?}");
    }
    // The migration runs at the store's next open.
    let st = Store::open_with(&path, Durability::Relaxed).unwrap();
    assert_eq!(st.units_of("wordpress").unwrap().len(), 1);
    assert_eq!(st.service("mysql").unwrap().life, jujube_core::Life::Dying);
    assert_eq!(st.units_of("mysql").unwrap().len(), 1);
    assert_eq!(st.add_units("wordpress", 1, None).unwrap(), ["wordpress/2"]);
    let c = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, MIGRATIONS.len() as i64);
    let ok: String = c
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    assert_checks_are_comparisons(&c);
}
