//! A PostgreSQL session lost under a transaction (the server restarted,
//! or the session ended by an administrator) before its commit: the
//! transaction runs again on a new connection, and the caller never sees
//! it. (On SQLite there are no sessions to lose: these tests have nothing
//! to cut there and check only that the rules still run.)

use super::env;
use crate::model::JOB_HOST_UNITS;
use crate::sql::Engine;
use jujube_core::Constraints;

/// Ends the session `c` runs on, from inside it, as a restart would.
fn cut(c: &crate::sql::Connection) {
    if c.engine() == Engine::Postgres {
        let _ = c.execute_batch("SELECT pg_terminate_backend(pg_backend_pid())");
    }
}

#[test]
fn a_write_whose_session_was_lost_before_its_commit_runs_again_on_a_new_connection() {
    let e = env();
    let mut attempts = 0;
    let id =
        e.st.write(|tx| {
            attempts += 1;
            if attempts == 1 {
                cut(tx);
            }
            crate::machines::insert_machine(tx, "jammy", &[JOB_HOST_UNITS], &Constraints::default())
        })
        .unwrap();
    assert_eq!(id, 1);
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(attempts, if postgres { 2 } else { 1 });
    assert_eq!(e.st.machines().unwrap().len(), 2);
}

#[test]
fn a_read_whose_session_was_lost_runs_again_on_a_new_connection() {
    let e = env();
    let mut attempts = 0;
    let n: i64 =
        e.st.read(|c| {
            attempts += 1;
            if attempts == 1 {
                cut(c);
            }
            Ok(c.query_row("SELECT count(*) FROM machines", [], |r| r.get(0))?)
        })
        .unwrap();
    assert_eq!(n, 1);
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(attempts, if postgres { 2 } else { 1 });
}
