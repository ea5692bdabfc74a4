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

/// A session lost while COMMIT is in flight leaves unknown whether the
/// server kept the transaction: the store does not run it again, and says
/// so with an error no client takes for "try another controller" (which
/// would apply an add-unit twice when the first was kept).
#[test]
fn a_write_whose_session_was_lost_during_its_commit_is_not_run_again_nor_called_unavailable() {
    let e = env();
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    if postgres {
        // A deferred constraint trigger runs at COMMIT, after every
        // statement of the rule answered: it ends its own session there.
        e.st.write(|tx| {
            tx.execute_batch(
                "CREATE TABLE commit_cut (x integer);
                 CREATE FUNCTION commit_cut() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NULL; END $$;
                 CREATE CONSTRAINT TRIGGER commit_cut AFTER INSERT ON commit_cut
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION commit_cut();",
            )?;
            Ok(())
        })
        .unwrap();
    }
    let mut attempts = 0;
    let r = e.st.write(|tx| {
        attempts += 1;
        let id = crate::machines::insert_machine(
            tx,
            "jammy",
            &[JOB_HOST_UNITS],
            &Constraints::default(),
        )?;
        if postgres {
            tx.execute_batch("INSERT INTO commit_cut VALUES (1)")?;
        }
        Ok(id)
    });
    assert_eq!(attempts, 1, "a commit of unknown outcome was run again");
    if !postgres {
        assert_eq!(r.unwrap(), 1);
        return;
    }
    let err = r.unwrap_err();
    assert!(
        matches!(err, crate::Error::CommitUnknown(_)),
        "lost at commit: {err:?}"
    );
    assert!(!err.is_unavailable(), "a client would send it again: {err}");
    assert!(!err.is_refusal());
    assert!(err.to_string().contains("`jujube status`"), "{err}");
    // The store still works on a new session.
    e.st.write(|tx| Ok(tx.execute_batch("DROP TABLE commit_cut")?))
        .unwrap();
    assert!(e.st.machines().is_ok());
}

/// A session lost after the rule's last statement but before its
/// `COMMIT` went out: the commit's own statement (the feed's insert with
/// the kept inserts folded in, of a shape new on this session) is
/// prepared first, and that prepare finds the session gone. Nothing was
/// committed, so the transaction runs again on a new session, never
/// reported as a commit of unknown outcome.
#[test]
fn a_write_whose_session_was_lost_before_its_commit_was_sent_runs_again() {
    let e = env();
    let mut attempts = 0;
    let ids =
        e.st.write(|tx| {
            attempts += 1;
            let pid: Option<i32> = match tx.engine() {
                Engine::Postgres => {
                    Some(tx.query_row("SELECT pg_backend_pid()", [], |r| r.get(0))?)
                }
                Engine::Sqlite => None,
            };
            // Prepared now, its rows kept for the commit: three machines
            // after machine 0.
            let ids = crate::machines::insert_machines_from(
                tx,
                1,
                std::num::NonZeroUsize::new(3).unwrap(),
                "jammy",
                &[JOB_HOST_UNITS],
                "",
            )?;
            if let (1, Some(pid)) = (attempts, pid) {
                e.st.read(|c| {
                    c.query_row("SELECT pg_terminate_backend(?1)", [pid], |r| {
                        r.get::<_, bool>(0)
                    })?;
                    Ok(())
                })?;
                until_gone(&e.st, pid)?;
            }
            Ok(ids)
        })
        .unwrap();
    assert_eq!(ids, vec![1, 2, 3]);
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(attempts, if postgres { 2 } else { 1 });
    assert_eq!(e.st.machines().unwrap().len(), 4);
}

/// A session the server ended between transactions (an administrator's
/// `pg_terminate_backend`, a restart while idle) is found before the next
/// transaction begins on it: nothing reads the socket between calls, so
/// the store reads what the server sent first, and the transaction runs
/// once, on a new session.
/// Waits until the server no longer lists session `pid`, asking through
/// one of `st`'s readers: each time in a read of its own, since a
/// transaction sees the server's list of sessions as it first read it.
fn until_gone(st: &crate::Store, pid: i32) -> crate::Result<()> {
    while st.read(|c| {
        Ok(c.query_row(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ?1",
            [pid],
            |r| r.get::<_, i64>(0),
        )?)
    })? > 0
    {
        std::thread::yield_now();
    }
    Ok(())
}

#[test]
fn a_session_ended_while_idle_is_found_before_a_transaction_begins_on_it() {
    let e = env();
    let pid: Option<i32> =
        e.st.write(|tx| match tx.engine() {
            Engine::Postgres => Ok(Some(
                tx.query_row("SELECT pg_backend_pid()", [], |r| r.get(0))?,
            )),
            Engine::Sqlite => Ok(None),
        })
        .unwrap();
    if let Some(pid) = pid {
        e.st.read(|c| {
            c.query_row("SELECT pg_terminate_backend(?1)", [pid], |r| {
                r.get::<_, bool>(0)
            })?;
            Ok(())
        })
        .unwrap();
        until_gone(&e.st, pid).unwrap();
    }
    let mut attempts = 0;
    e.st.write(|tx| {
        attempts += 1;
        crate::machines::insert_machine(tx, "jammy", &[JOB_HOST_UNITS], &Constraints::default())
    })
    .unwrap();
    assert_eq!(
        attempts, 1,
        "the ended session was not taken for a transaction"
    );
    assert_eq!(e.st.machines().unwrap().len(), 2);
}

/// A session the server ends inside a transaction, between its statements,
/// with a FATAL error of a class other than "connection" or "shutdown"
/// (here the idle-in-transaction timeout, 25P03), while nothing reads the
/// socket: the rule's next statement finds the session ended, and the
/// transaction runs again on a new one.
#[test]
fn a_transaction_whose_session_ended_with_a_fatal_error_runs_again() {
    let e = env();
    let mut attempts = 0;
    let id =
        e.st.write(|tx| {
            attempts += 1;
            if attempts == 1 && tx.engine() == Engine::Postgres {
                tx.execute_batch("SET LOCAL idle_in_transaction_session_timeout = 1")?;
                let pid: i32 = tx.query_row("SELECT pg_backend_pid()", [], |r| r.get(0))?;
                // Idle in its transaction until the server ends it.
                until_gone(&e.st, pid)?;
            }
            crate::machines::insert_machine(tx, "jammy", &[JOB_HOST_UNITS], &Constraints::default())
        })
        .unwrap();
    assert_eq!(id, 1);
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(attempts, if postgres { 2 } else { 1 });
}

/// On PostgreSQL every session of the store has the server end it when it
/// sits idle inside a transaction for `IDLE_IN_TRANSACTION` (a frozen
/// controller holding a lease's row lock would otherwise block every other
/// controller's claim until TCP gave up): its writers' and its readers'.
#[test]
fn sessions_left_idle_in_a_transaction_are_ended_by_the_server() {
    let e = env();
    if !matches!(e.st.location(), crate::Location::Postgres(_)) {
        return;
    }
    let show = |c: &crate::sql::Connection| -> crate::Result<String> {
        Ok(c.query_row("SHOW idle_in_transaction_session_timeout", [], |r| r.get(0))?)
    };
    assert_eq!(e.st.write(|tx| show(tx)).unwrap(), "30s");
    assert_eq!(e.st.read(|c| show(c)).unwrap(), "30s");
}
