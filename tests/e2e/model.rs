//! The model commands of issue "state store": bootstrap, deploy, units,
//! machines, relations, constraints, settings, destroy, status.

use crate::Jujube;
use serde_json::Value;

fn bootstrapped() -> Jujube {
    let j = Jujube::new();
    j.run(&["bootstrap", "test", "--provider", "dummy"]).ok();
    j
}

/// An environment whose cloud cannot be reached once bootstrapped: its
/// machines get no instances, its units no agents.
fn bootstrapped_without_instances() -> Jujube {
    let j = bootstrapped();
    j.run(&["set-environment", "dummy-unreachable=true"]).ok();
    j
}

#[test]
fn bootstrap_creates_the_environment_with_controller_machine_0_and_makes_it_current() {
    let j = Jujube::new();
    let r = j
        .run(&[
            "bootstrap",
            "alpha",
            "--provider",
            "dummy",
            "--constraints",
            "mem=4G",
            "--config",
            "harvest-mode=none",
        ])
        .ok();
    assert!(
        r.stdout.starts_with("bootstrapped environment `alpha` ("),
        "{}",
        r.stdout
    );
    let st = j.status();
    assert_eq!(st["environment"]["name"], "alpha");
    assert_eq!(st["environment"]["provider"], "dummy");
    let uuid = st["environment"]["uuid"].as_str().unwrap();
    assert_eq!(uuid.len(), 36, "a full UUID: {uuid}");
    let m0 = &st["machines"]["0"];
    assert_eq!(m0["jobs"], serde_json::json!(["manage-environ"]));
    assert_eq!(m0["life"], "alive");
    assert_eq!(m0["constraints"], "mem=4G");
    assert_eq!(
        j.run(&["get-environment", "harvest-mode"]).ok().stdout,
        "none\n"
    );
    j.refused(&["bootstrap", "../escape"], 1, "invalid environment name `../escape`: use lowercase letters, digits and hyphens, starting with a letter");
    assert!(!j.home.path().join("escape").exists());
    j.refused(
        &["bootstrap", "alpha"],
        1,
        "environment `alpha` already exists; choose another name, or remove it with `jujube destroy-environment alpha`",
    );
}

#[test]
fn environments_switch_and_env_flag_select_the_environment() {
    let j = Jujube::new();
    j.refused(&["status"], 1, "no environment selected; create one with `jujube bootstrap NAME --provider dummy` or pick one with `jujube switch NAME`");
    j.run(&["bootstrap", "one"]).ok();
    j.run(&["bootstrap", "two"]).ok();
    assert_eq!(j.run(&["environments"]).ok().stdout, "  one\n* two\n");
    j.run(&["switch", "one"]).ok();
    assert_eq!(j.run(&["environments"]).ok().stdout, "* one\n  two\n");
    j.run(&["--env", "two", "add-machine"]).ok();
    assert!(j.status()["machines"].get("1").is_none());
    let st: Value = serde_json::from_str(
        &j.run(&["status", "--format", "json", "-e", "two"])
            .ok()
            .stdout,
    )
    .unwrap();
    assert!(st["machines"].get("1").is_some());
    let r = j.run(&["switch", "three"]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "error: environment `three` not found; known environments: `one`, `two`\n"
    );
}

#[test]
fn seed_constraint_story_one_machine_with_2g_and_two_with_3g() {
    let j = bootstrapped();
    j.run(&["deploy", "--constraints", "mem=2G", &j.charm("wordpress")])
        .ok();
    j.run(&["set-constraints", "--service", "wordpress", "mem=3G"])
        .ok();
    j.run(&["add-unit", "wordpress", "-n", "2"]).ok();
    let st = j.status();
    let units = st["services"]["wordpress"]["units"].as_object().unwrap();
    assert_eq!(units.len(), 3);
    let mut mems: Vec<String> = units
        .values()
        .map(|u| {
            st["machines"][u["machine"].as_str().unwrap()]["constraints"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    mems.sort();
    assert_eq!(mems, ["mem=2G", "mem=3G", "mem=3G"]);
    assert_eq!(
        j.run(&["get-constraints", "--service", "wordpress"])
            .ok()
            .stdout,
        "mem=3G\n"
    );
}

#[test]
fn status_json_has_the_documented_shape() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("wordpress"), "blog", "-n", "2"])
        .ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "blog", "mysql"]).ok();
    j.run(&["add-relation", "logging", "blog"]).ok();
    let st = j.status();
    for k in ["name", "uuid", "provider"] {
        assert!(st["environment"][k].is_string(), "environment.{k}");
    }
    // The controller running on machine 0 holds the singleton jobs' lease.
    let lease = &st["environment"]["singletons"];
    assert!(
        lease["holder"]
            .as_str()
            .is_some_and(|h| h.starts_with("machine-0/")),
        "{lease}"
    );
    assert!(lease["token"].as_i64().is_some_and(|t| t >= 1), "{lease}");
    assert!(lease["expires-ms"].as_i64().is_some(), "{lease}");
    let m = &st["machines"]["1"];
    for k in [
        "life",
        "series",
        "jobs",
        "instance-id",
        "status",
        "status-info",
        "agent-status",
        "agent-status-info",
        "constraints",
    ] {
        assert!(m.get(k).is_some(), "machines.1.{k}");
    }
    let blog = &st["services"]["blog"];
    assert_eq!(blog["charm"], "local:jammy/wordpress-3");
    assert_eq!(blog["life"], "alive");
    assert_eq!(blog["series"], "jammy");
    let u = &blog["units"]["blog/1"];
    assert_eq!(u["machine"], "2");
    for k in ["life", "agent-status", "agent-status-info", "subordinates"] {
        assert!(u.get(k).is_some(), "units.blog/1.{k}");
    }
    assert_eq!(
        st["services"]["logging"]["subordinate-to"],
        serde_json::json!(["blog"])
    );
    let rels = st["relations"].as_array().unwrap();
    let db = rels
        .iter()
        .find(|r| r["key"] == "blog:db mysql:db")
        .unwrap();
    assert_eq!(
        (
            db["life"].as_str(),
            db["interface"].as_str(),
            db["scope"].as_str()
        ),
        (Some("alive"), Some("mysql"), Some("global"))
    );
    let sub = rels.iter().find(|r| r["scope"] == "container").unwrap();
    assert_eq!(sub["key"], "logging:juju-info blog:juju-info");
    // YAML and the table render the same model.
    let yaml = j.run(&["status", "--format", "yaml"]).ok().stdout;
    assert!(yaml.contains("blog/1:"), "{yaml}");
    let table = j.run(&["status"]).ok().stdout;
    let row = table
        .lines()
        .find(|l| l.starts_with("blog:db mysql:db "))
        .expect("relation row");
    assert_eq!(
        row.split_whitespace().collect::<Vec<_>>(),
        ["blog:db", "mysql:db", "mysql", "global", "alive"]
    );
}

#[test]
fn refused_commands_say_why_exactly_and_change_nothing() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["add-machine", "--series", "noble"]).ok();
    j.refused(&["destroy-machine", "1"], 1, "machine `1` has assigned units `wordpress/0`; destroy them first with `jujube destroy-unit`");
    j.refused(&["destroy-machine", "0"], 1, "machine `0` manages the environment and cannot be destroyed; use `jujube destroy-environment` instead");
    j.refused(&["destroy-machine", "3", "1"], 1, "machine `1` has assigned units `wordpress/0`; destroy them first with `jujube destroy-unit`");
    j.refused(
        &["destroy-machine", "9"],
        1,
        "machine `9` not found; `jujube status` lists what exists",
    );
    j.refused(
        &["deploy", &j.charm("wordpress")],
        1,
        "service `wordpress` already exists; choose another name",
    );
    j.refused(
        &["add-relation", "mysql", "wordpress"],
        1,
        "relation `wordpress:db mysql:db` already exists",
    );
    j.refused(
        &["add-unit", "logging"],
        1,
        "service `logging` is a subordinate: it gets a unit for each principal unit it is related to; add units to a principal service instead",
    );
    j.refused(
        &["add-unit", "mysql", "--to", "3"],
        1,
        "cannot place a unit of service `mysql` (series `jammy`) on machine `3` (series `noble`); units run only on machines of their service's series",
    );
    j.refused(&["add-unit", "mysql", "--to", "0"], 1, "machine `0` cannot host units (its jobs are manage-environ); choose another machine or omit `--to`");
    j.refused(
        &["set-constraints", "--service", "mysql", "mem=2G", "gpu=1"],
        1,
        "unknown constraint `gpu`: valid constraints are `allocate-public-ip`, `arch`, `container`, `cores`, `cpu-power`, `instance-type`, `mem`, `root-disk`, `tags`, `virt-type` and `zones`",
    );
    j.refused(
        &["set-constraints", "mem=lots"],
        1,
        "invalid constraint `mem=lots`: use a size such as `512M`, `2G`, `1.5T` or `1P`",
    );
    j.refused(
        &["destroy-unit", "wordpress/0", "mysql/7"],
        1,
        "unit `mysql/7` not found; `jujube status` lists what exists",
    );
    j.refused(
        &["destroy-unit", "wordpress"],
        1,
        "invalid unit name `wordpress`: a unit is named `service/N`, e.g. `wordpress/0`",
    );
    j.refused(&["resolved", "1"], 1, "machine `1` has no provisioning error; `jujube resolved` only applies to machines in error");
    j.refused(
        &["set", "wordpress", "port=eighty"],
        1,
        "invalid value `eighty` for option `port`: expected an integer",
    );
    j.refused(&["set", "wordpress", "colour=red"], 1, "unknown option `colour` for charm `wordpress`: the charm's options are `debug`, `port`, `title`");
    j.refused(&["deploy", "/nonexistent"], 1, "charm `/nonexistent` not found: give a charm directory (with a metadata.yaml) or `local:SERIES/NAME` with `--repository DIR`");
    j.refused(&["deploy", &j.charm("mysql"), "db", "--series", "focal"], 1, "charm `mysql` does not support series `focal` (it supports `jammy`, `noble`); use `--series` with one of those");
    j.refused(&["add-relation", "wordpress:website", "mysql"], 1, "no relation between `wordpress:website` and `mysql`: no provider and requirer with a common interface; `jujube status` and the charms' metadata.yaml show their endpoints");
}

#[test]
fn usage_errors_exit_with_2_and_change_nothing() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.refused(
        &["set", "wordpress", "port"],
        2,
        "malformed setting `port`: write KEY=VALUE",
    );
    j.refused(
        &["add-unit", "wordpress", "-n", "2", "--to", "1"],
        2,
        "`--to` places one unit; use `-n 1` with it",
    );
    // A deploy of no units has none to place (`--to` was dropped unsaid).
    j.refused(
        &["deploy", &j.charm("mysql"), "-n", "0", "--to", "1"],
        2,
        "`--to` places one unit; use `-n 1` with it",
    );
    let before = j.settled();
    let r = j.run(&["add-unit"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .starts_with("error: the following required arguments were not provided"),
        "{}",
        r.stderr
    );
    assert_eq!(before, j.snapshot());
}

#[test]
fn destroyed_service_name_is_reusable_only_after_removal() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("mysql"), "db", "-n", "0"]).ok();
    j.run(&["destroy-service", "db"]).ok();
    // No units, no relations but its peer: removed at once.
    assert!(j.status()["services"].get("db").is_none());
    // A unit held by a failed hook holds its service Dying.
    let charms = tempfile::tempdir().unwrap();
    let flaky = crate::hooks::flaky_charm(charms.path());
    j.run(&["deploy", &flaky, "--config", "fail-hook=stop"])
        .ok();
    j.run(&["deploy", &j.charm("mysql"), "db", "-n", "0"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    j.run(&["remove-service", "flaky"]).ok();
    crate::hooks::eventually("the stop hook to fail", || {
        j.status()["services"]["flaky"]["units"]["flaky/0"]["agent-status"] == "error"
    });
    assert_eq!(j.status()["services"]["flaky"]["life"], "dying");
    j.refused(
        &["deploy", &flaky],
        1,
        "service `flaky` is being destroyed; wait until it is removed (see `jujube status`) before reusing it",
    );
    // Freed, it goes; then the name is free.
    j.run(&["resolved", "flaky/0"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert!(j.status()["services"].get("flaky").is_none());
    j.run(&["deploy", &flaky]).ok();
}

#[test]
fn destroy_unit_with_no_agent_removes_it_and_frees_the_machine() {
    let j = bootstrapped_without_instances();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "2"]).ok();
    j.run(&["destroy-unit", "wordpress/0", "wordpress/1"]).ok();
    let st = j.status();
    assert!(st["services"]["wordpress"]["units"]
        .as_object()
        .unwrap()
        .is_empty());
    j.run(&["destroy-machine", "1", "2"]).ok();
    // Never provisioned: nothing to stop, and the provisioner removes them.
    crate::hooks::eventually("machines 1 and 2 removed", || {
        let st = j.status();
        st["machines"].get("1").is_none() && st["machines"].get("2").is_none()
    });
}

#[test]
fn local_charms_are_found_in_the_repository_by_series() {
    let j = bootstrapped();
    let repo = tempfile::tempdir().unwrap();
    let noble = repo.path().join("noble");
    std::fs::create_dir_all(&noble).unwrap();
    copy_dir(&crate::charms().join("mysql"), &noble.join("mysql"));
    let r = j
        .run(&[
            "deploy",
            "local:noble/mysql",
            "--repository",
            repo.path().to_str().unwrap(),
        ])
        .ok();
    assert_eq!(
        r.stdout,
        "deployed service `mysql` (local:noble/mysql-1) with 1 unit(s)\n"
    );
    let st = j.status();
    assert_eq!(st["services"]["mysql"]["series"], "noble");
    assert_eq!(st["machines"]["1"]["series"], "noble");
    j.refused(
        &["deploy", "local:jammy/mysql", "db", "--repository", repo.path().to_str().unwrap()],
        1,
        &format!(
            "charm `local:jammy/mysql` not found in repository `{0}` (looked for `{0}/jammy/mysql/metadata.yaml`); check the series and name",
            repo.path().display()
        ),
    );
    j.refused(&["deploy", "local:noble/mysql", "db2"], 1, "charm `local:noble/mysql` is a local charm: give its repository with `--repository DIR` or `JUJUBE_REPOSITORY`");
    // A new version in the repository: upgrade-charm finds it by the
    // service's charm URL and uploads it.
    let meta = noble.join("mysql/metadata.yaml");
    let text = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(&meta, format!("{text}tags: [next]\n")).unwrap();
    let r = j
        .run(&[
            "upgrade-charm",
            "mysql",
            "--repository",
            repo.path().to_str().unwrap(),
        ])
        .ok();
    assert_eq!(
        r.stdout,
        "service `mysql` upgraded to charm `local:noble/mysql-2`\n"
    );
}

#[test]
fn settings_are_typed_and_reset_with_an_empty_value() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("wordpress"), "--config", "title=Hello"])
        .ok();
    j.run(&["set", "wordpress", "port=8080", "debug=true"]).ok();
    let got: Value =
        serde_json::from_str(&j.run(&["get", "wordpress", "--format", "json"]).ok().stdout)
            .unwrap();
    assert_eq!(got["settings"]["port"]["value"], 8080);
    assert_eq!(got["settings"]["debug"]["value"], true);
    assert_eq!(got["settings"]["title"]["value"], "Hello");
    j.run(&["set", "wordpress", "port="]).ok();
    let got: Value =
        serde_json::from_str(&j.run(&["get", "wordpress", "--format", "json"]).ok().stdout)
            .unwrap();
    assert_eq!(got["settings"]["port"]["value"], 80);
    assert_eq!(got["settings"]["port"]["default"], true);
}

#[test]
fn a_charm_with_a_container_scoped_peer_relation_is_refused_at_deploy() {
    let j = bootstrapped();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metadata.yaml"),
        "name: ring\nsummary: a ring\npeers:\n  cluster:\n    interface: ring\n    scope: container\n",
    )
    .unwrap();
    j.refused(
        &["deploy", dir.path().to_str().unwrap()],
        1,
        "invalid charm `ring`: peer relation `cluster` is container-scoped; a peer relation joins the units of one service, which never share a container: remove `scope: container` from it",
    );
    assert!(j.status()["services"].get("ring").is_none());
}

#[test]
fn a_removed_services_name_is_taken_by_a_new_service_that_comes_up_whole() {
    let j = bootstrapped_without_instances();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "1"]).ok();
    j.run(&["destroy-service", "wordpress"]).ok();
    // Pending (no agent): the cleanup destroys the unit, which goes at
    // once, and the service with it.
    crate::hooks::eventually("wordpress removed", || {
        j.status()["services"].get("wordpress").is_none()
    });
    j.run(&["deploy", &j.charm("wordpress"), "-n", "2"]).ok();
    j.run(&["set-environment", "dummy-unreachable="]).ok();
    let _ctl = j.controller();
    // `wait` returns once no cleanup is pending and every machine started
    // (and the units' install, config-changed and start hooks ran: on a
    // loaded 2-core machine running the whole suite that took over 60 s).
    j.run(&["wait", "--timeout", "180s"]).ok();
    let st = j.status();
    let units = st["services"]["wordpress"]["units"].as_object().unwrap();
    let names: Vec<&String> = units.keys().collect();
    assert_eq!(names, ["wordpress/1", "wordpress/2"], "{st}");
    for u in units.values() {
        assert_eq!(u["life"], "alive", "{st}");
    }
}

pub(crate) fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
