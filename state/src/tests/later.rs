//! Inserts a rule never reads back go with the transaction's next request
//! on PostgreSQL (`Connection::insert_later`, through `db::insert_rows`):
//! what the rule reads next sees them, their rows are counted, and one
//! that fails fails its whole transaction, whichever request carried it.
//! (On SQLite they run at once: the same checks hold.)

use super::env;
use crate::sql::params;

fn machines(e: &super::Env) -> i64 {
    e.st.read(|c| Ok(c.query_row("SELECT count(*) FROM machines", [], |r| r.get(0))?))
        .unwrap()
}

fn insert_machine(tx: &crate::sql::Connection, id: i64) -> crate::Result<()> {
    crate::db::insert_rows(
        tx,
        "INSERT INTO machines (id, series, jobs, manage_environ, constraints)",
        5,
        params![id, "jammy", "host-units", false, ""],
    )
}

#[test]
fn inserts_sent_later_are_read_and_counted_by_the_rest_of_their_transaction() {
    let e = env();
    let before = machines(&e);
    let (seen, written) =
        e.st.write(|tx| {
            let start = tx.rows_written();
            // More than are ever kept unsent at once.
            for id in 100..170 {
                insert_machine(tx, id)?;
            }
            let written = tx.rows_written() - start;
            let seen: i64 =
                tx.query_row("SELECT count(*) FROM machines WHERE id >= 100", [], |r| {
                    r.get(0)
                })?;
            Ok((seen, written))
        })
        .unwrap();
    assert_eq!((seen, written), (70, 70));
    assert_eq!(machines(&e), before + 70);
}

#[test]
fn an_insert_sent_later_that_fails_fails_its_transaction_and_keeps_nothing() {
    let e = env();
    let before = machines(&e);
    let head = e.st.head_revision().unwrap();
    let mut taken = None;
    let r = e.st.write(|tx| {
        insert_machine(tx, 200)?;
        // A unit of no service: refused by its foreign key, on PostgreSQL
        // only when the next request carries it (here the feed's, with
        // the COMMIT).
        let unit = crate::db::insert_rows(
            tx,
            "INSERT INTO units (name, service, number, series, machine_id, constraints)",
            6,
            params!["nope/0", "nope", 0i64, "jammy", 200i64, ""],
        );
        taken = Some(unit.is_ok());
        unit?;
        tx.changed(crate::feed::ChangeKind::Machine, "200")?;
        Ok(())
    });
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(taken, Some(postgres), "sent at once");
    let err = r.unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("foreign key"),
        "{err}"
    );
    assert_eq!(
        machines(&e),
        before,
        "the machine inserted with it was kept"
    );
    assert_eq!(
        e.st.head_revision().unwrap(),
        head,
        "its feed entry was written"
    );
    // The store goes on: the connection's transaction ended.
    e.st.write(|tx| insert_machine(tx, 201)).unwrap();
    assert_eq!(machines(&e), before + 1);
}

/// An op in a savepoint answers for the inserts it kept: one refused fails
/// that op alone, and the transaction goes on without it.
#[test]
fn an_insert_kept_in_a_savepoint_fails_its_op_alone() {
    let e = env();
    let before = machines(&e);
    let failed =
        e.st.write(|tx| {
            let op = tx.savepoint(|tx| {
                insert_machine(tx, 300)?;
                crate::db::insert_rows(
                    tx,
                    "INSERT INTO units (name, service, number, series, machine_id, constraints)",
                    6,
                    params!["nope/0", "nope", 0i64, "jammy", 300i64, ""],
                )
            });
            insert_machine(tx, 301)?;
            tx.changed(crate::feed::ChangeKind::Machine, "301")?;
            Ok(op.is_err())
        })
        .unwrap();
    assert!(failed, "the op with a refused insert succeeded");
    let ids: Vec<i64> =
        e.st.read(|c| {
            Ok(c.prepare("SELECT id FROM machines WHERE id >= 300")?
                .query_map([], |r| r.get(0))?
                .collect::<crate::sql::Result<_>>()?)
        })
        .unwrap();
    assert_eq!(ids, [301]);
    assert_eq!(machines(&e), before + 1);
}

/// A value the client cannot bind is refused as the insert is kept: never
/// sent, it would not abort the transaction on the server, and the
/// `COMMIT` sent with it would keep the rest.
#[test]
fn an_insert_whose_values_cannot_be_bound_fails_before_anything_is_sent() {
    let e = env();
    // A write like it first, so that its feed statement is prepared and
    // the insert goes with the `COMMIT`, not before a `PREPARE`.
    e.st.write(|tx| {
        insert_machine(tx, 399)?;
        tx.changed(crate::feed::ChangeKind::Machine, "399")
    })
    .unwrap();
    let head = e.st.head_revision().unwrap();
    let before = machines(&e);
    let r = e.st.write(|tx| {
        insert_machine(tx, 400)?;
        tx.changed(crate::feed::ChangeKind::Machine, "400")?;
        crate::db::insert_rows(
            tx,
            "INSERT INTO machines (id, series, jobs, manage_environ, constraints)",
            5,
            params!["four hundred and one", "jammy", "host-units", false, ""],
        )
    });
    assert!(r.is_err(), "a machine id of text was taken");
    assert_eq!(machines(&e), before);
    assert_eq!(
        e.st.head_revision().unwrap(),
        head,
        "its feed entry was kept"
    );
}

/// On PostgreSQL a commit's kept inserts go in its feed statement when
/// they write tables of their own (`sql::fold_kept`): `BEGIN`, one
/// statement and `COMMIT`, where each insert was a request answered apart.
/// Two inserts into one table stay apart. The rows are the same either way,
/// the unit's foreign key to the machine inserted beside it included.
#[test]
fn a_commits_kept_inserts_go_in_its_feed_statement() {
    let e = env();
    e.deploy("name: wordpress\n", "wordpress", 0);
    let unit = |tx: &crate::sql::Connection, number: i64, machine: i64| {
        crate::db::insert_rows(
            tx,
            "INSERT INTO units (name, service, number, series, machine_id, constraints)",
            6,
            params![
                format!("wordpress/{number}"),
                "wordpress",
                number,
                "jammy",
                machine,
                ""
            ],
        )
    };
    let write = |machines: &[i64], number: i64| {
        e.st.reset_stats();
        e.st.write(|tx| {
            for id in machines {
                insert_machine(tx, *id)?;
            }
            unit(tx, number, machines[0])?;
            tx.changed(crate::feed::ChangeKind::Unit, format!("wordpress/{number}"))?;
            tx.changed(crate::feed::ChangeKind::Machine, machines[0].to_string())
        })
        .unwrap();
        e.st.stats().pg_requests
    };
    // Each statement prepared first (twice the one shape: a statement's
    // first `PREPARE` sends what was kept before it, which then folds into
    // nothing).
    write(&[500], 50);
    write(&[506], 56);
    write(&[501, 502], 51);
    let postgres = matches!(e.st.location(), crate::Location::Postgres(_));
    assert_eq!(write(&[503], 53), if postgres { 3 } else { 0 });
    assert_eq!(
        write(&[504, 505], 54),
        if postgres { 6 } else { 0 },
        "BEGIN, the two machines, the unit, the feed's and COMMIT"
    );
    let units: Vec<(String, i64)> =
        e.st.read(|c| {
            Ok(
                c.prepare("SELECT name, machine_id FROM units WHERE number >= 50 ORDER BY number")?
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<crate::sql::Result<_>>()?,
            )
        })
        .unwrap();
    assert_eq!(
        units,
        [
            ("wordpress/50".to_string(), 500),
            ("wordpress/51".to_string(), 501),
            ("wordpress/53".to_string(), 503),
            ("wordpress/54".to_string(), 504),
            ("wordpress/56".to_string(), 506)
        ]
    );
    assert_eq!(
        e.st.read(|c| Ok(c.query_row(
            "SELECT count(*) FROM machines WHERE id >= 500",
            [],
            |r| r.get::<_, i64>(0)
        )?))
        .unwrap(),
        7
    );
}
