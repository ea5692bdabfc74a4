//! TLS to PostgreSQL, against the suite's cluster (`scripts/pg-setup`
//! serves TLS with a certificate for `127.0.0.1` alone, signed by an
//! authority of its own, `JUJUBE_TEST_STATE_CA`). On SQLite there is
//! nothing to connect to: these tests pass without looking.

use super::{postgres_url, spec, Place};
use crate::pg::{connect, Role};
use crate::{Durability, Error, Location, PgTarget, Store};

/// The suite's server and the authority that signed its certificate.
fn server() -> Option<(String, String)> {
    let admin = postgres_url()?;
    let ca = std::env::var("JUJUBE_TEST_STATE_CA").expect(
        "JUJUBE_TEST_STATE_CA must name the authority of the server's certificate (scripts/test sets it beside JUJUBE_TEST_STATE_URL)",
    );
    Some((admin, ca))
}

fn with(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// Whether a session opened with `url` is encrypted, as the server sees it.
fn encrypted(url: &str) -> Result<bool, Error> {
    let target = PgTarget::new(url, Some("not-needed".into()))?;
    let c = connect(&target, Role::Reader)?;
    Ok(c.query_row(
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        [],
        |r| r.get(0),
    )?)
}

#[test]
fn each_sslmode_gets_the_session_it_names() {
    let Some((admin, ca)) = server() else { return };
    let full = with(&admin, &format!("sslmode=verify-full&sslrootcert={ca}"));
    assert!(encrypted(&full).unwrap(), "verify-full");
    assert!(
        encrypted(&with(&admin, "sslmode=require")).unwrap(),
        "require"
    );
    // libpq's default, `prefer`: the server offers TLS, so it is taken.
    assert!(encrypted(&admin).unwrap(), "prefer");
    assert!(
        !encrypted(&with(&admin, "sslmode=disable")).unwrap(),
        "disable"
    );
}

#[test]
fn verify_full_refuses_a_certificate_for_another_name_or_from_another_authority() {
    let Some((admin, ca)) = server() else { return };
    // The certificate names 127.0.0.1 only.
    let by_name = admin.replacen("@127.0.0.1:", "@localhost:", 1);
    assert_ne!(by_name, admin, "the suite's URL names 127.0.0.1");
    let err = encrypted(&with(
        &by_name,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cannot reach the state database") && err.contains("not valid for name"),
        "{err}"
    );
    assert!(
        !err.contains("not-needed"),
        "the password is never shown: {err}"
    );
    // `verify-ca` checks the authority and not the name.
    assert!(encrypted(&with(
        &by_name,
        &format!("sslmode=verify-ca&sslrootcert={ca}")
    ))
    .unwrap());
    // No public authority signed it.
    let err = encrypted(&with(&admin, "sslmode=verify-ca&sslrootcert=system"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid peer certificate"), "{err}");
    // `require` with `sslrootcert` checks the authority, as libpq does.
    assert!(encrypted(&with(&admin, "sslmode=require&sslrootcert=system")).is_err());
}

#[test]
fn a_store_on_a_verified_tls_session_runs_its_rules() {
    let Some((admin, ca)) = server() else { return };
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let c = connect(
        &PgTarget::new(&admin, None).unwrap(),
        Role::Writer(Durability::Relaxed),
    )
    .unwrap();
    c.execute_batch(&format!("CREATE SCHEMA {name}")).unwrap();
    let _place = Place::Schema {
        admin: admin.clone(),
        name: name.clone(),
    };
    let url = with(
        &admin,
        &format!("sslmode=verify-full&sslrootcert={ca}&options=-csearch_path%3D{name}"),
    );
    let st = Store::open_at(
        &Location::Postgres(PgTarget::new(&url, None).unwrap()),
        Durability::Full,
    )
    .unwrap();
    st.initialize(&spec("")).unwrap();
    let m = st.add_machines(1, None, None).unwrap()[0];
    assert_eq!(st.machine(m).unwrap().id, m);
}
