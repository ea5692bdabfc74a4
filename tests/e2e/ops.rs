//! Charms written with the `ops` framework (canonical/operator, from PyPI),
//! packed as charmcraft packs them (`dispatch`, `hooks/*` linked to it,
//! `src/charm.py`, ops under `venv/`), run unchanged: statuses, unit and
//! application relation data between two services and within a peer
//! relation, leadership and its failover, and actions through `jujube run`.
//! The charms are in `tests/e2e/ops-charms`; `scripts/test` installs ops
//! (`scripts/ops-setup`) and names the directory in `JUJUBE_OPS_LIB`; the
//! test fails without it (`JUJUBE_SKIP_OPS=1` skips it knowingly).

use crate::Jujube;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Copies `name` from the fixtures with ops laid in as its `venv/` (without
/// compiled bytecode, which the charm's python makes itself).
fn pack(into: &Path, name: &str, ops: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/e2e/ops-charms")
        .join(name);
    let dst = into.join(name);
    let cp = |from: &Path, to: &Path| {
        let ok = Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .unwrap()
            .success();
        assert!(ok, "cp -a {} {}", from.display(), to.display());
    };
    cp(&src, &dst);
    cp(ops, &dst.join("venv"));
    let ok = Command::new("find")
        .arg(dst.join("venv"))
        .args([
            "-name",
            "__pycache__",
            "-prune",
            "-exec",
            "rm",
            "-rf",
            "{}",
            ";",
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    dst
}

fn until<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn unit_dir(j: &Jujube, st: &Value, service: &str, unit: &str) -> PathBuf {
    let machine = st["services"][service]["units"][unit]["machine"]
        .as_str()
        .unwrap();
    j.home.path().join(format!(
        "environments/t/agents/machine-{machine}/unit-{}",
        unit.replace('/', "-")
    ))
}

fn report(dir: &Path, event: &str) -> Option<Value> {
    let text = std::fs::read_to_string(dir.join(format!("charm/report-{event}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

fn leaders(st: &Value, service: &str) -> Vec<String> {
    st["services"][service]["units"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(_, u)| u["leader"] == true)
                .map(|(n, _)| n.clone())
                .collect()
        })
        .unwrap_or_default()
}

fn workload(st: &Value, service: &str, unit: &str) -> (String, String) {
    let w = &st["services"][service]["units"][unit]["workload-status"];
    (
        w["current"].as_str().unwrap_or_default().to_string(),
        w["message"].as_str().unwrap_or_default().to_string(),
    )
}

#[test]
fn ops_charms_run_unchanged() {
    if std::env::var_os("JUJUBE_SKIP_OPS").is_some() {
        eprintln!("skipped: JUJUBE_SKIP_OPS is set");
        return;
    }
    let ops = PathBuf::from(std::env::var("JUJUBE_OPS_LIB").expect(
        "JUJUBE_OPS_LIB names a directory with ops installed (scripts/test runs scripts/ops-setup); \
         set JUJUBE_SKIP_OPS=1 to skip knowingly",
    ));
    let charms = tempfile::tempdir().unwrap();
    let db = pack(charms.path(), "ops-db", &ops);
    let app = pack(charms.path(), "ops-app", &ops);
    let j = Jujube::new();
    // Agents as processes of their own, reaching the controller over the
    // API only; presence lapses after 4 s, so failover is quick.
    crate::agents::bootstrap_with_agent_processes(&j);
    j.run(&["deploy", db.to_str().unwrap(), "-n", "2"]).ok();
    j.run(&["deploy", app.to_str().unwrap()]).ok();
    j.run(&["add-relation", "ops-app", "ops-db"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "180s"]).ok();

    // Statuses as the charms set them, one leader with the application's
    // status, the workload version.
    let st = until("the charms' statuses", Duration::from_secs(90), || {
        let st = j.status();
        let ready = workload(&st, "ops-app", "ops-app/0")
            == ("active".into(), "db ready: appdb".into())
            && ["ops-db/0", "ops-db/1"]
                .iter()
                .all(|u| workload(&st, "ops-db", u) == ("active".into(), "ready appdb".into()))
            && leaders(&st, "ops-db").len() == 1
            && st["services"]["ops-db"]["workload-status"]["message"] == "leading";
        ready.then_some(st)
    });
    assert_eq!(st["services"]["ops-db"]["version"], "1.2.3", "{st:#}");
    assert_eq!(
        st["services"]["ops-db"]["workload-status"]["current"],
        "active"
    );
    let leader = leaders(&st, "ops-db").remove(0);
    let other = if leader == "ops-db/0" {
        "ops-db/1"
    } else {
        "ops-db/0"
    };

    // Unit and application data across the relation, both ways.
    let app_dir = unit_dir(&j, &st, "ops-app", "ops-app/0");
    let seen = until(
        "ops-app to see ops-db's data",
        Duration::from_secs(60),
        || {
            report(&app_dir, "db-relation-changed").filter(|r| {
                r["remote_app_data"]["database"] == "appdb"
                    && r["remote_units"].as_object().is_some_and(|m| m.len() == 2)
            })
        },
    );
    assert_eq!(
        seen["remote_app_data"],
        serde_json::json!({"database": "appdb", "password-hash": "x"}),
        "{seen:#}"
    );
    assert_eq!(seen["remote_app"], "ops-db");
    for u in ["ops-db/0", "ops-db/1"] {
        assert_eq!(seen["remote_units"][u]["unit"], u, "{seen:#}");
        assert!(seen["remote_units"][u]["host"].is_string(), "{seen:#}");
    }
    assert_eq!(
        seen["local_app_data"],
        serde_json::json!({"client": "ops-app"})
    );
    // The leader's application status, set and read back through
    // `status-get --application`.
    assert_eq!(seen["app_status"], serde_json::json!(["active", "serving"]));
    // jujube keeps no secrets: ops' `get_secret` raises SecretNotFoundError.
    let install = report(&app_dir, "install").expect("ops-app's install report");
    assert_eq!(install["secret"], "not found", "{install:#}");
    let leader_dir = unit_dir(&j, &st, "ops-db", &leader);
    let seen = until(
        "ops-db to see ops-app's data",
        Duration::from_secs(60),
        || {
            report(&leader_dir, "db-relation-changed")
                .filter(|r| r["remote_app_data"]["client"] == "ops-app")
        },
    );
    assert_eq!(
        seen["remote_units"]["ops-app/0"]["wants"], "appdb",
        "{seen:#}"
    );
    // The peer relation: the non-leader reads what the leader wrote in the
    // application's bag.
    let other_dir = unit_dir(&j, &st, "ops-db", other);
    let peer = until("the peer data", Duration::from_secs(60), || {
        std::fs::read_dir(other_dir.join("charm"))
            .ok()?
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("report-cluster-relation-")
            })
            .filter_map(|e| {
                serde_json::from_str::<Value>(&std::fs::read_to_string(e.path()).ok()?).ok()
            })
            .find(|r| r["cluster"]["app_data"]["leader"] == leader.as_str())
    });
    assert_eq!(peer["leader"], false, "{peer:#}");

    // Actions: parameters checked before anything is queued, results
    // printed, failure said and exit 1.
    let refused = j.run(&["run", "ops-db/0", "backup"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("needs parameter `target`"),
        "{}",
        refused.stderr
    );
    let refused = j.run(&["run", "ops-db/0", "backup", "target=x", "level=high"]);
    assert!(
        refused.stderr.contains("must be of type integer"),
        "{}",
        refused.stderr
    );
    let r = j
        .run(&["run", "ops-db/0", "backup", "target=nightly", "level=5"])
        .ok();
    let results: Value = yaml_serde::from_str(&r.stdout).unwrap();
    assert_eq!(results["path"], "/backups/nightly", "{}", r.stdout);
    assert_eq!(results["detail"]["level"], "5", "{}", r.stdout);
    assert_eq!(results["compressed"], "True", "{}", r.stdout);
    assert!(r.stderr.contains("backing up"), "{}", r.stderr);
    let db0 = unit_dir(&j, &st, "ops-db", "ops-db/0");
    let params = report(&db0, "backup-action").unwrap()["params"].clone();
    assert_eq!(
        params,
        serde_json::json!({"target": "nightly", "compress": true, "level": 5})
    );
    let failed = j.run(&["run", "ops-db/1", "fail-me"]);
    assert_eq!(failed.code, 1, "{failed:?}");
    assert!(failed.stderr.contains("asked to fail"), "{}", failed.stderr);
    let bg = j
        .run(&["run", "ops-db/0", "backup", "target=later", "--background"])
        .ok();
    let id = bg
        .stdout
        .split_whitespace()
        .nth(2)
        .expect("a task id")
        .to_string();
    let task = until("the background task", Duration::from_secs(60), || {
        let t: Value = yaml_serde::from_str(&j.run(&["show-task", &id]).ok().stdout).ok()?;
        (t["status"] == "completed").then_some(t)
    });
    assert_eq!(task["results"]["path"], "/backups/later", "{task:#}");
    assert_eq!(task["action"], "backup");

    // Leadership fails over: the leader's agent frozen, the other unit
    // leads and runs leader-elected (and the application status follows).
    let machine = st["services"]["ops-db"]["units"][&leader]["machine"]
        .as_str()
        .unwrap()
        .to_string();
    let pid = crate::agents::agent_pid(&j, &machine).expect("the leader's agent process");
    // SAFETY: kill(2) on an agent process this test's controller started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    until("the other unit to lead", Duration::from_secs(60), || {
        let st = j.status();
        let log = std::fs::read_to_string(other_dir.join("charm/events.log")).unwrap_or_default();
        (leaders(&st, "ops-db") == [other.to_string()]
            && log.contains(&format!("leader-elected {other} leader=true")))
        .then_some(())
    });
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
    assert_eq!(ctl.terminate().code(), Some(0));
}
