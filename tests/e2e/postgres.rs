//! An environment whose state is in PostgreSQL (`bootstrap --config
//! state-url=...`), on the dummy, against the throwaway cluster
//! `scripts/test` starts (`JUJUBE_TEST_STATE_URL`; missing, the test
//! fails): everything else unchanged for the user, and nothing of it left
//! in the database after `destroy-environment`.

use crate::Jujube;

/// A schema of its own on the test cluster, and the state URL that uses it.
pub(crate) fn fresh_schema() -> (postgres::Client, String, String) {
    let admin = std::env::var("JUJUBE_TEST_STATE_URL")
        .expect("JUJUBE_TEST_STATE_URL must name a PostgreSQL server (scripts/test starts one)");
    let mut c = postgres::Client::connect(&admin, postgres::NoTls)
        .unwrap_or_else(|e| panic!("cannot reach `{admin}`: {e}"));
    let schema = format!("e2e_{}", uuid::Uuid::new_v4().simple());
    c.batch_execute(&format!("CREATE SCHEMA {schema}")).unwrap();
    // Over TLS, the server's certificate checked (`scripts/test` names
    // its authority).
    let ca = std::env::var("JUJUBE_TEST_STATE_CA")
        .expect("JUJUBE_TEST_STATE_CA must name the server's authority (scripts/test sets it)");
    let url =
        format!("{admin}?sslmode=verify-full&sslrootcert={ca}&options=-csearch_path%3D{schema}");
    (c, schema, url)
}

/// [`fresh_schema`] for async tests: the blocking client runs a runtime of
/// its own, so it is made, used and dropped (a failed assertion included)
/// on threads of its own.
pub(crate) struct AsyncSchema {
    client: Option<postgres::Client>,
    pub schema: String,
    pub url: String,
}

impl AsyncSchema {
    pub fn new() -> AsyncSchema {
        let (c, schema, url) = std::thread::spawn(fresh_schema).join().unwrap();
        AsyncSchema {
            client: Some(c),
            schema,
            url,
        }
    }

    /// How many tables the schema holds.
    pub fn tables(&mut self) -> i64 {
        let (c, schema) = (self.client.as_mut().unwrap(), &self.schema);
        std::thread::scope(|s| s.spawn(|| tables(c, schema)).join().unwrap())
    }
}

impl Drop for AsyncSchema {
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            let _ = std::thread::spawn(move || drop(c)).join();
        }
    }
}

pub(crate) fn tables(c: &mut postgres::Client, schema: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_tables WHERE schemaname = $1",
        &[&schema],
    )
    .unwrap()
    .get(0)
}

#[test]
fn an_environment_keeps_its_state_in_postgresql_and_leaves_nothing_there_when_destroyed() {
    let (mut c, schema, url) = fresh_schema();
    let mut j = Jujube::new();
    j.auto_controller = true;

    // A password in the URL would be stored and shown with it: refused
    // before anything is made, and not echoed.
    let with_password = url.replacen("jujube@", "jujube:hunter2@", 1);
    let r = j.run(&[
        "bootstrap",
        "t",
        "--config",
        &format!("state-url={with_password}"),
    ]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("carries a password"), "{}", r.stderr);
    assert!(!r.stderr.contains("hunter2"), "{}", r.stderr);
    assert!(!j.home.path().join("environments/t").exists());
    assert_eq!(tables(&mut c, &schema), 0);

    let r = j
        .run(&["bootstrap", "t", "--config", &format!("state-url={url}")])
        .ok();
    assert!(
        r.stdout
            .contains("machine 0's controller runs in the background"),
        "{}",
        r.stdout
    );
    let dir = j.home.path().join("environments/t");
    assert!(
        !dir.join("state.db").exists(),
        "the state is not in a file here"
    );
    assert!(tables(&mut c, &schema) > 0);

    // The user's commands, unchanged.
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let status = j.status();
    assert_eq!(
        status["services"]["wordpress"]["units"]["wordpress/0"]["agent-status"], "started",
        "{status}"
    );
    let units: i64 = c
        .query_one(&format!("SELECT count(*) FROM {schema}.units"), &[])
        .unwrap()
        .get(0);
    assert_eq!(units, 2);
    // Where the state lives is chosen once.
    let r = j.run(&["set-environment", "state-url=postgres://other@db/x"]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("chosen at bootstrap"), "{}", r.stderr);

    j.run(&["destroy-environment", "t", "--yes"]).ok();
    assert_eq!(
        tables(&mut c, &schema),
        0,
        "destroy-environment left tables"
    );
    c.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .unwrap();
}
