//! A charm written against charmhelpers (PyPI), the library most charms of
//! Juju's 1.x/2.x era call the hook tools through: two related services
//! whose hooks use `config()`, `relation_get`, `relation_set` (with and
//! without `--file`), `relation_ids`, `related_units`, `unit_get`, `log`
//! and `open_port`, end to end. `scripts/test` installs charmhelpers into a
//! venv and names its python in `JUJUBE_CHARMHELPERS_PYTHON`; the test
//! fails without it (`JUJUBE_SKIP_CHARMHELPERS=1` skips it knowingly).

use crate::hooks::eventually;
use crate::Jujube;
use std::path::Path;

/// The provider's hook: everything it learns goes into its report, which
/// the test reads; a failed expectation fails the hook.
const DB_HOOK: &str = r#"
import json, os, sys
from charmhelpers.core import hookenv

hook = os.path.basename(sys.argv[0])
hookenv.log("charmhelpers hook: " + hook)
cfg = hookenv.config()
report = os.path.join(os.environ["CHARM_DIR"], "report-" + hook + ".json")
out = {"config": dict(cfg)}
if hook == "install":
    hookenv.open_port(5432)            # charmhelpers sends 5432/TCP
    hookenv.open_ports(6000, 6010, "udp")
    # Outside a relation hook relation-get exits 2: charmhelpers reads None.
    out["relation_get_outside"] = hookenv.relation_get("user")
    out["relation_ids_outside"] = hookenv.relation_ids()
elif hook == "db-relation-joined":
    # With --file (charmhelpers found it in `relation-set --help`).
    hookenv.relation_set(relation_settings={
        "user": cfg["user"],
        "password": "s3cret: with a colon",
        "host": hookenv.unit_get("private-address"),
        "port": 5432,
    })
    # Without --file: key=value arguments.
    hookenv._relation_set_accepts_file = lambda: False
    hookenv.relation_set(plain="yes", unwanted=None)
    out["remote"] = hookenv.remote_unit()
    out["relation_id"] = hookenv.relation_id()
json.dump(out, open(report, "w"))
"#;

const APP_HOOK: &str = r#"
import json, os, sys
from charmhelpers.core import hookenv

hook = os.path.basename(sys.argv[0])
hookenv.log("charmhelpers hook: " + hook, level=hookenv.DEBUG)
report = os.path.join(os.environ["CHARM_DIR"], "report-" + hook + ".json")
out = {}
if hook == "db-relation-changed":
    rid = hookenv.relation_id()
    out["relation_id"] = rid
    out["relation_ids"] = hookenv.relation_ids("db")
    out["related_units"] = hookenv.related_units()
    out["settings"] = hookenv.relation_get()
    out["user"] = hookenv.relation_get("user")
    out["missing"] = hookenv.relation_get("no-such-key")
    out["by_rid"] = hookenv.relation_get("host", unit=hookenv.remote_unit(), rid=rid)
    out["for_unit"] = hookenv.relation_for_unit()
    out["in_relation_hook"] = hookenv.in_relation_hook()
    out["address"] = hookenv.unit_get("private-address")
    if out["settings"].get("password"):
        json.dump(out, open(report, "w"))
"#;

fn charm(
    dir: &Path,
    name: &str,
    meta: &str,
    config: &str,
    hook: &str,
    hooks: &[&str],
    python: &str,
) {
    let root = dir.join(name);
    std::fs::create_dir_all(root.join("hooks")).unwrap();
    std::fs::write(root.join("metadata.yaml"), meta).unwrap();
    std::fs::write(root.join("config.yaml"), config).unwrap();
    std::fs::write(root.join("revision"), "1\n").unwrap();
    crate::hooks::write_hooks(&root, hooks, &format!("#!{python}\n{hook}"));
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_charmhelpers_charm_runs_unchanged_between_two_related_services() {
    if std::env::var_os("JUJUBE_SKIP_CHARMHELPERS").is_some() {
        eprintln!("skipped: JUJUBE_SKIP_CHARMHELPERS is set");
        return;
    }
    let python = std::env::var("JUJUBE_CHARMHELPERS_PYTHON").expect(
        "JUJUBE_CHARMHELPERS_PYTHON names a python with charmhelpers installed (scripts/test sets it up); \
         set JUJUBE_SKIP_CHARMHELPERS=1 to skip knowingly",
    );
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    charm(
        charms.path(),
        "chdb",
        "name: chdb\nsummary: db\ndescription: d\nprovides:\n  db:\n    interface: chdb\n",
        "options:\n  user: {type: string, default: admin, description: u}\n  \
         tuning: {type: float, default: 0.5, description: t}\n  \
         unset: {type: string, description: no default}\n",
        DB_HOOK,
        &[
            "install",
            "config-changed",
            "start",
            "db-relation-joined",
            "db-relation-changed",
        ],
        &python,
    );
    charm(
        charms.path(),
        "chapp",
        "name: chapp\nsummary: app\ndescription: d\nrequires:\n  db:\n    interface: chdb\n",
        "options: {}\n",
        APP_HOOK,
        &["install", "db-relation-joined", "db-relation-changed"],
        &python,
    );
    j.run(&["bootstrap", "t"]).ok();
    for c in ["chdb", "chapp"] {
        j.run(&["deploy", charms.path().join(c).to_str().unwrap()])
            .ok();
    }
    j.run(&["add-relation", "chapp", "chdb"]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "90s"]).ok();
    let agents = j.home.path().join("environments/t/agents");
    let db_charm = agents.join("machine-1/unit-chdb-0/charm");
    let app_charm = agents.join("machine-2/unit-chapp-0/charm");
    let changed = app_charm.join("report-db-relation-changed.json");
    eventually("chapp's db-relation-changed with chdb's settings", || {
        changed.is_file()
    });

    let install = report(&db_charm.join("report-install.json"));
    // config(): `config-get --all --format=json`, unset options as null.
    assert_eq!(
        install["config"],
        serde_json::json!({"user": "admin", "tuning": 0.5, "unset": null}),
        "{install}"
    );
    assert_eq!(
        install["relation_get_outside"],
        serde_json::Value::Null,
        "{install}"
    );
    assert_eq!(
        install["relation_ids_outside"],
        serde_json::json!([]),
        "{install}"
    );
    let joined = report(&db_charm.join("report-db-relation-joined.json"));
    assert_eq!(joined["remote"], "chapp/0", "{joined}");
    let rid = joined["relation_id"].as_str().unwrap().to_string();
    assert!(rid.starts_with("db:"), "{joined}");

    let app = report(&changed);
    let address = j
        .run(&["run", "chdb/0", "--", "unit-get", "private-address"])
        .ok()
        .stdout
        .trim()
        .to_string();
    assert_eq!(app["relation_id"], rid.as_str(), "{app}");
    assert_eq!(app["relation_ids"], serde_json::json!([rid]), "{app}");
    assert_eq!(app["related_units"], serde_json::json!(["chdb/0"]), "{app}");
    assert_eq!(app["user"], "admin", "{app}");
    assert_eq!(app["missing"], serde_json::Value::Null, "{app}");
    assert_eq!(app["by_rid"], address.as_str(), "{app}");
    assert_eq!(app["in_relation_hook"], true, "{app}");
    let settings = &app["settings"];
    assert_eq!(settings["password"], "s3cret: with a colon", "{app}");
    assert_eq!(settings["port"], "5432", "{app}");
    assert_eq!(settings["plain"], "yes", "{app}");
    assert_eq!(settings["host"], address.as_str(), "{app}");
    assert!(settings.get("unwanted").is_none(), "{app}");
    assert_eq!(app["for_unit"]["__unit__"], "chdb/0", "{app}");
    assert_eq!(app["for_unit"]["user"], "admin", "{app}");

    // open_port(5432) sent `5432/TCP`; open_ports a udp range.
    let status = j.status();
    let ports = &status["services"]["chdb"]["units"]["chdb/0"]["open-ports"];
    assert_eq!(
        ports,
        &serde_json::json!(["5432/tcp", "6000-6010/udp"]),
        "{status}"
    );
    // log(): juju-log lines in the unit's log, the relation named.
    let log = std::fs::read_to_string(agents.join("machine-2/logs/unit-chapp-0.log")).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains(" DEBUG unit.chapp/0.juju-log: db:")
                && l.ends_with("charmhelpers hook: db-relation-changed")),
        "{log}"
    );
    // No hook failed anywhere.
    for (svc, unit) in [("chdb", "chdb/0"), ("chapp", "chapp/0")] {
        let u = &status["services"][svc]["units"][unit];
        assert_eq!(u["agent-status"], "started", "{status}");
    }
}
