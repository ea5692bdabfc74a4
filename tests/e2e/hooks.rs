//! Charms in action through the binary, with the controller running: the
//! example charms' hooks run in Juju's order, talk to jujube through the
//! hook tools, and wordpress ends up configured with the credentials that
//! mysql's hook set.

use crate::Jujube;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn log(j: &Jujube, machine: &str, unit: &str) -> PathBuf {
    j.home.path().join(format!(
        "environments/t/agents/machine-{machine}/logs/unit-{}.log",
        unit.replace('/', "-")
    ))
}

/// The hooks a unit ran, in order, from the `hook: NAME [REMOTE]` lines its
/// example charm logs.
fn hooks(path: &Path) -> Vec<String> {
    hook_lines(&std::fs::read_to_string(path).unwrap_or_default())
}

/// The `hook: NAME [REMOTE]` lines of a unit's log, in order.
pub(crate) fn hook_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.split_once(": hook: ").map(|(_, h)| h.to_string()))
        .collect()
}

/// Where hook `h` ran first in `hooks` (it must have).
pub(crate) fn pos(hooks: &[String], h: &str) -> usize {
    hooks
        .iter()
        .position(|x| x == h)
        .unwrap_or_else(|| panic!("hook `{h}` never ran: {hooks:?}"))
}

/// Asserts that each of `order` ran, each before the next.
pub(crate) fn in_order(hooks: &[String], order: &[&str]) {
    for w in order.windows(2) {
        assert!(
            pos(hooks, w[0]) < pos(hooks, w[1]),
            "{} before {}: {hooks:?}",
            w[0],
            w[1]
        );
    }
}

/// wordpress/0's hooks, in Juju's order, up to its relation with mysql/0.
pub(crate) const WORDPRESS_ORDER: &[&str] = &[
    "install",
    "config-changed",
    "start",
    "db-relation-joined mysql/0",
    "db-relation-changed mysql/0",
];

/// mysql/0's relation hooks with wordpress/0, after its start.
pub(crate) const MYSQL_ORDER: &[&str] = &[
    "start",
    "db-relation-joined wordpress/0",
    "db-relation-changed wordpress/0",
];

fn count(hooks: &[String], h: &str) -> usize {
    hooks.iter().filter(|x| *x == h).count()
}

/// Waits (bounded) until `f` holds: hooks run asynchronously to `wait`'s
/// view of the model when nothing in it changes.
pub(crate) fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn hooks_run_in_order_and_wordpress_gets_mysqls_credentials() {
    let mut j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["add-relation", "logging", "wordpress"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let agents = j.home.path().join("environments/t/agents");
    let charm = agents.join("machine-1/unit-wordpress-0/charm");
    eventually("wordpress's database configuration", || {
        charm.join("db.conf").is_file()
    });
    let conf = std::fs::read_to_string(charm.join("db.conf")).unwrap();
    assert!(conf.contains("database=wordpress\n"), "{conf}");
    assert!(conf.contains("user=wordpress\n"), "{conf}");
    // `jujube run`: a command in a unit's hook context, serialised with
    // its hooks; the hook tools work in it. mysql's hook gave its own
    // address as `host`.
    let address = j
        .run(&["run", "mysql/0", "--", "unit-get", "private-address"])
        .ok()
        .stdout;
    assert!(!address.trim().is_empty());
    assert!(conf.contains(&format!("host={address}")), "{conf}");

    let password = conf
        .lines()
        .find_map(|l| l.strip_prefix("password="))
        .unwrap();
    assert_eq!(
        password.len(),
        24,
        "set by mysql's db-relation-joined: {conf}"
    );
    assert_eq!(
        std::fs::read_to_string(charm.join("site.conf")).unwrap(),
        "title=My Blog\n",
        "config-get"
    );
    // The charms' workload status, set by their hooks (`status-set`).
    eventually("wordpress serving", || {
        j.status()["services"]["wordpress"]["units"]["wordpress/0"]["workload-status"]
            == serde_json::json!({"current": "active", "message": "serving"})
    });
    assert_eq!(
        j.status()["services"]["mysql"]["units"]["mysql/0"]["workload-status"],
        serde_json::json!({"current": "active", "message": "ready"})
    );

    // Unit hooks first, once, in order; then the relation's.
    let wp = log(&j, "1", "wordpress/0");
    let h = hooks(&wp);
    for once in ["install", "start"] {
        assert_eq!(count(&h, once), 1, "{once}: {h:?}");
    }
    in_order(&h, WORDPRESS_ORDER);
    assert_eq!(count(&h, "db-relation-joined mysql/0"), 1, "{h:?}");
    // relation-created first of the relation's hooks, once, after install
    // (its hook checks that the relation is listed, with nobody in it).
    assert_eq!(count(&h, "db-relation-created"), 1, "{h:?}");
    in_order(
        &h,
        &[
            "install",
            "db-relation-created",
            "db-relation-joined mysql/0",
        ],
    );
    let my = hooks(&log(&j, "2", "mysql/0"));
    in_order(&my, MYSQL_ORDER);
    // The subordinate records its principal.
    let logging = agents.join("machine-1/unit-logging-0/charm/principal");
    eventually("logging's principal", || logging.is_file());
    assert_eq!(std::fs::read_to_string(&logging).unwrap(), "wordpress/0\n");

    // Output and exit status pass through; no shell unless asked for.
    let r = j.run(&[
        "run",
        "wordpress/0",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    ]);
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (3, "out\n", "err\n")
    );
    let pwd = j.run(&["run", "wordpress/0", "--", "pwd"]).ok().stdout;
    assert!(pwd.ends_with("unit-wordpress-0/charm\n"), "{pwd}");
    // A unit writes its address into a relation as it joins it.
    let ids = j
        .run(&["run", "wordpress/0", "--", "relation-ids", "db"])
        .ok()
        .stdout;
    assert!(ids.starts_with("db:"), "{ids}");
    let seen = j
        .run(&[
            "run",
            "mysql/0",
            "--",
            "relation-get",
            "-r",
            ids.trim(),
            "private-address",
            "wordpress/0",
        ])
        .ok()
        .stdout;
    assert_eq!(seen, address, "both units run on this host");
    // Juju's other addresses of a unit entering scope, as `ops` reads them.
    let all = j
        .run(&[
            "run",
            "mysql/0",
            "--",
            "relation-get",
            "--format=json",
            "-r",
            ids.trim(),
            "-",
            "wordpress/0",
        ])
        .ok()
        .stdout;
    let all: serde_json::Value = serde_json::from_str(&all).unwrap();
    assert_eq!(all["ingress-address"], address.trim(), "{all}");
    assert_eq!(
        all["egress-subnets"],
        format!("{}/32", address.trim()),
        "{all}"
    );
    j.refused(
        &["run", "nosuch/0", "--", "true"],
        1,
        "unit `nosuch/0` not found; `jujube status` lists what exists",
    );
    let r = j.run(&["run", "mysql/0", "--", "/nonexistent/command"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("cannot run `/nonexistent/command`"),
        "{}",
        r.stderr
    );

    // A tool outside a hook context says so.
    let tool = agents.join("machine-1/unit-wordpress-0/tools/relation-get");
    let out = std::process::Command::new(&tool)
        .env_remove("JUJU_CONTEXT_ID")
        .env_remove("JUJU_AGENT_SOCKET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("works only inside a hook context"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // open-port acts at once; status shows it.
    let ports = |j: &Jujube| {
        j.status()["services"]["wordpress"]["units"]["wordpress/0"]["open-ports"].clone()
    };
    assert_eq!(ports(&j), serde_json::json!(["80/tcp"]));
    assert!(j.status()["services"]["mysql"]["units"]["mysql/0"]
        .get("open-ports")
        .is_none());

    // A settings change fires config-changed once (the port moves).
    j.run(&["set", "wordpress", "title=Hello", "port=8080"])
        .ok();
    eventually("config-changed after `set`", || {
        std::fs::read_to_string(charm.join("site.conf")).unwrap_or_default() == "title=Hello\n"
    });
    assert_eq!(count(&hooks(&wp), "config-changed"), 2);
    eventually("the port moved", || {
        ports(&j) == serde_json::json!(["8080/tcp"])
    });

    // Destroying the relation: -departed once, then -broken once, last.
    j.run(&["destroy-relation", "wordpress", "mysql"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    eventually("db-relation-broken", || {
        count(&hooks(&wp), "db-relation-broken") == 1
    });
    let h = hooks(&wp);
    assert_eq!(count(&h, "db-relation-departed mysql/0"), 1, "{h:?}");
    assert!(pos(&h, "db-relation-departed mysql/0") < pos(&h, "db-relation-broken"));
    assert!(
        !charm.join("db.conf").exists(),
        "removed by db-relation-broken"
    );
    assert_eq!(
        count(&h, "config-changed"),
        2,
        "no spurious config-changed: {h:?}"
    );

    // Destroying the service: stop, after every relation (the logging
    // one, the peer one) is broken, then remove, the last hook.
    j.run(&["destroy-service", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let h = hooks(&wp);
    assert_eq!(
        h[h.len().saturating_sub(2)..],
        ["stop".to_string(), "remove".to_string()],
        "{h:?}"
    );
    assert_eq!((count(&h, "stop"), count(&h, "remove")), (1, 1));
    let lg = hooks(&log(&j, "1", "logging/0"));
    assert!(
        pos(&lg, "juju-info-relation-broken") < pos(&lg, "stop"),
        "{lg:?}"
    );
    assert_eq!(ctl.terminate().code(), Some(0));
    j.start_controllers = false;
    let r = j.run(&["run", "mysql/0", "--", "true"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with("error: cannot reach the controller of environment `t` at `unix:")
            && r.stderr.ends_with(
                "; no controller runs for it on this host: start one with `jujube controller`\n"
            ),
        "{}",
        r.stderr
    );
}

/// A test charm whose hooks log their name and fail, or block, on demand:
/// `fail-hook=NAME` makes hook NAME exit 1 (after a `relation-set`, for
/// relation hooks); `block-hook=NAME` makes it write `blocked` and wait for
/// the file `go` in the unit's directory, reading `config-get title` before
/// and after.
pub(crate) fn flaky_charm(dir: &Path) -> String {
    let charm = dir.join("flaky");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(
        charm.join("metadata.yaml"),
        "name: flaky\nsummary: fails on demand\nseries: [jammy, noble]\npeers:\n  peer:\n    interface: flaky\n",
    )
    .unwrap();
    std::fs::write(
        charm.join("config.yaml"),
        "options:\n  fail-hook:\n    type: string\n    default: \"\"\n  block-hook:\n    type: string\n    default: \"\"\n  title:\n    type: string\n    default: one\n",
    )
    .unwrap();
    let hook = r#"#!/bin/sh
name=$(basename "$0")
juju-log "hook: $name${JUJU_REMOTE_UNIT:+ $JUJU_REMOTE_UNIT}"
case "$name" in
  peer-relation-joined) relation-set secret=from-$JUJU_UNIT_NAME ;;
  peer-relation-changed) juju-log "saw secret=[$(relation-get secret)]" ;;
esac
if [ "$(config-get block-hook)" = "$name" ]; then
  juju-log "read title=$(config-get title)"
  echo $$ > "$CHARM_DIR/../hook.pid"
  touch "$CHARM_DIR/../blocked"
  i=0
  while [ ! -f "$CHARM_DIR/../go" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done
  juju-log "read title=$(config-get title)"
fi
[ "$(config-get fail-hook)" != "$name" ]
"#;
    write_hooks(
        &charm,
        &[
            "install",
            "config-changed",
            "start",
            "stop",
            "peer-relation-joined",
            "peer-relation-changed",
            "peer-relation-departed",
            "peer-relation-broken",
        ],
        hook,
    );
    charm.to_string_lossy().into_owned()
}

/// A bootstrapped environment with `n` units of the flaky charm (the
/// charm's directory lives as long as the second value).
fn flaky_env(n: usize, settings: &[&str]) -> (Jujube, tempfile::TempDir) {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    let charm = flaky_charm(charms.path());
    let n = n.to_string();
    let mut args = vec!["deploy", &charm, "-n", &n];
    for s in settings {
        args.extend(["--config", s]);
    }
    j.run(&args).ok();
    (j, charms)
}

/// Writes `body` as each of the charm's hooks `names`, executable.
pub(crate) fn write_hooks(charm: &Path, names: &[&str], body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    for h in names {
        let p = charm.join("hooks").join(h);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// The unit's agent has recorded a failed hook and runs none: what
/// `resolved` acts on (the status alone may still show an earlier error).
fn holds_on_failure(j: &Jujube, unit: &str) -> bool {
    let (svc, n) = unit.split_once('/').unwrap();
    let Ok(machines) = j.home.path().join("environments/t/agents").read_dir() else {
        return false;
    };
    let dir = machines
        .flatten()
        .map(|e| e.path().join(format!("unit-{svc}-{n}")))
        .find(|d| d.exists());
    let Some(dir) = dir else { return false };
    let h = jujube_agent::hooks::state::HookState::read(&dir).unwrap_or_default();
    h.running.is_none() && h.failed.is_some() && agent_status(j, unit).0 == "error"
}

fn agent_status(j: &Jujube, unit: &str) -> (String, String) {
    let st = j.status();
    let svc = unit.split('/').next().unwrap();
    let u = &st["services"][svc]["units"][unit];
    (
        u["agent-status"].as_str().unwrap_or("").to_string(),
        u["agent-status-info"].as_str().unwrap_or("").to_string(),
    )
}

#[test]
fn a_failed_hook_holds_the_unit_until_resolved_with_or_without_retry() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    // A unit whose hooks all succeed is not in error.
    let charm = flaky_charm(charms.path());
    j.run(&["deploy", &charm, "steady"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let r = j.run(&["resolved", "steady/0"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains("unit `steady/0` is not in an error state"),
        "{}",
        r.stderr
    );
    // Asked to fail from its first hook on.
    j.run(&["deploy", &charm, "--config", "fail-hook=install"])
        .ok();
    let _ctl = j.controller();
    let log = log(&j, "2", "flaky/0");
    eventually("install to fail", || holds_on_failure(&j, "flaky/0"));
    let (_, info) = agent_status(&j, "flaky/0");
    assert!(info.contains("hook failed: \"install\""), "{info}");
    // Held: a settings change runs nothing while in error.
    j.run(&["set", "flaky", "title=two"]).ok();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(hooks(&log), ["install"]);

    // --retry runs it again (it fails again: still asked to).
    j.run(&["resolved", "--retry", "flaky/0"]).ok();
    eventually("install to run again", || {
        count(&hooks(&log), "install") == 2
    });
    eventually("the unit back in error", || holds_on_failure(&j, "flaky/0"));
    j.run(&["set", "flaky", "fail-hook="]).ok();
    j.run(&["resolved", "--retry", "flaky/0"]).ok();
    eventually("the unit started", || {
        agent_status(&j, "flaky/0").0 == "started"
    });
    assert_eq!(
        hooks(&log),
        ["install", "install", "install", "config-changed", "start"]
    );

    // Without --retry the failed hook counts as done: it is not run again.
    j.run(&["set", "flaky", "fail-hook=config-changed", "title=three"])
        .ok();
    eventually("config-changed to fail", || holds_on_failure(&j, "flaky/0"));
    j.run(&["resolved", "flaky/0"]).ok();
    eventually("the unit started", || {
        agent_status(&j, "flaky/0").0 == "started"
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count(&hooks(&log), "config-changed"),
        2,
        "{:?}",
        hooks(&log)
    );
}

#[test]
fn a_hook_killed_with_its_agent_is_a_failed_hook_when_the_agent_comes_back() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&[
        "deploy",
        &flaky_charm(charms.path()),
        "--config",
        "block-hook=install",
    ])
    .ok();
    let ctl = j.controller();
    let unit_dir = j
        .home
        .path()
        .join("environments/t/agents/machine-1/unit-flaky-0");
    eventually("install to be running", || {
        unit_dir.join("blocked").exists()
    });
    ctl.kill9();
    // The hook outlived its agent (it waits for `go`, up to 30 s).
    let pid = std::fs::read_to_string(unit_dir.join("hook.pid")).unwrap();
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
    };
    assert!(
        alive(),
        "the blocked install still runs after its agent died"
    );
    j.run(&["set", "flaky", "block-hook="]).ok();
    let _ctl = j.controller();
    eventually("the killed install to count as failed", || {
        agent_status(&j, "flaky/0") == ("error".into(), "hook failed: \"install\"".into())
    });
    // The restarted agent killed it before running anything: a unit
    // never runs two hooks at once.
    assert!(
        !alive(),
        "the dead agent's hook still runs beside the new agent"
    );
    j.run(&["resolved", "--retry", "flaky/0"]).ok();
    eventually("the unit started", || {
        agent_status(&j, "flaky/0").0 == "started"
    });
    let h = hooks(&log(&j, "1", "flaky/0"));
    assert_eq!(count(&h, "install"), 2, "{h:?}");
}

#[test]
fn hooks_get_exactly_jujus_environment_and_cannot_run_jujubes_commands() {
    let mut j = Jujube::new();
    // What the controller has that a hook must not see.
    j.envs
        .push(("AWS_SECRET_ACCESS_KEY".into(), "do-not-leak".into()));
    j.envs
        .push(("JUJUBE_TEST_MARKER".into(), "do-not-leak".into()));
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &flaky_charm(charms.path())]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let env = j.run(&["run", "flaky/0", "--", "env"]).ok().stdout;
    let mut names: Vec<&str> = env
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k)
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(
        names,
        [
            "APT_LISTCHANGES_FRONTEND",
            "CHARM_DIR",
            "DEBIAN_FRONTEND",
            "HOME",
            "JUJU_AGENT_SOCKET",
            "JUJU_API_ADDRESSES",
            "JUJU_AVAILABILITY_ZONE",
            "JUJU_CHARM_DIR",
            "JUJU_CONTEXT_ID",
            "JUJU_ENV_NAME",
            "JUJU_MACHINE_ID",
            "JUJU_MODEL_NAME",
            "JUJU_MODEL_UUID",
            "JUJU_UNIT_NAME",
            "JUJU_VERSION",
            "LANG",
            "PATH",
            "TERM",
        ],
        "{env}"
    );
    assert!(!env.contains("do-not-leak"), "{env}");
    let st = j.status();
    let uuid = st["environment"]["uuid"].as_str().unwrap().to_string();
    let machine = st["services"]["flaky"]["units"]["flaky/0"]["machine"]
        .as_str()
        .unwrap()
        .to_string();
    let zone = st["machines"][&machine]["zone"]
        .as_str()
        .unwrap()
        .to_string();
    for var in [
        "JUJU_MODEL_NAME=t".to_string(),
        format!("JUJU_MODEL_UUID={uuid}"),
        "JUJU_VERSION=3.6.4".to_string(),
        format!("JUJU_MACHINE_ID={machine}"),
        format!("JUJU_AVAILABILITY_ZONE={zone}"),
    ] {
        assert!(env.lines().any(|l| l == var), "{var} in {env}");
    }
    // The tools are the jujube binary; run under its own name in a hook
    // context it refuses its user commands.
    let r = j.run(&[
        "run",
        "flaky/0",
        "--",
        "sh",
        "-c",
        "\"$(readlink -f \"$(command -v relation-get)\")\" status",
    ]);
    assert_eq!(r.code, 2, "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("error: `jujube` commands cannot run inside a hook context"),
        "{}",
        r.stderr
    );
    // A tool never panics: an argument that is not UTF-8 is a usage error;
    // a request above the tool channel's limit is refused naming it.
    let r = j.run(&[
        "run",
        "flaky/0",
        "--",
        "sh",
        "-c",
        "config-get \"$(printf '\\377')\"",
    ]);
    assert_eq!(
        (r.code, r.stderr.as_str()),
        (
            2,
            "error: argument 1 is not valid UTF-8; hook tools take text\n"
        )
    );
    let r = j.run(&[
        "run",
        "flaky/0",
        "--",
        "sh",
        "-c",
        "head -c 2000000 /dev/zero | tr '\\0' a | relation-set --file -",
    ]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("more than the tool channel's limit of 1048576 bytes"),
        "{}",
        r.stderr
    );
}

#[test]
fn relation_list_answers_what_the_hooks_have_seen_not_the_live_scope() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("lister");
    std::fs::create_dir_all(charm.join("hooks")).unwrap();
    std::fs::write(
        charm.join("metadata.yaml"),
        "name: lister\nsummary: lists\npeers:\n  peer:\n    interface: lister\n",
    )
    .unwrap();
    // lister/0 installs only once `go` exists; its relation hooks log what
    // relation-list answers.
    let hook = r#"#!/bin/sh
name=$(basename "$0")
if [ "$name" = install ] && [ "$JUJU_UNIT_NAME" = lister/0 ]; then
  i=0
  while [ ! -f "$CHARM_DIR/../go" ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
fi
case "$name" in
  peer-relation-*) juju-log "hook: $name $JUJU_REMOTE_UNIT sees [$(relation-list | tr '\n' ' ')]" ;;
esac
"#;
    write_hooks(
        &charm,
        &["install", "peer-relation-joined", "peer-relation-departed"],
        hook,
    );
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", charm.to_str().unwrap(), "-n", "3"]).ok();
    let _ctl = j.controller();
    let agents = j.home.path().join("environments/t/agents");
    let unit_log = |u: &str| -> PathBuf {
        let machine = j.status()["services"]["lister"]["units"][u]["machine"]
            .as_str()
            .unwrap_or("")
            .to_string();
        log(&j, &machine, u)
    };
    // lister/1 and lister/2 joined each other: both are in the scope
    // before lister/0 runs any relation hook.
    eventually("lister/1 and lister/2 in the peer scope", || {
        hooks(&unit_log("lister/1"))
            .iter()
            .any(|h| h.starts_with("peer-relation-joined lister/2"))
            && hooks(&unit_log("lister/2"))
                .iter()
                .any(|h| h.starts_with("peer-relation-joined lister/1"))
    });
    let zero = agents
        .read_dir()
        .unwrap()
        .flatten()
        .map(|m| m.path().join("unit-lister-0"))
        .find(|d| d.exists())
        .unwrap();
    std::fs::write(zero.join("go"), "").unwrap();
    eventually("lister/0 joined both", || {
        hooks(&unit_log("lister/0"))
            .iter()
            .filter(|h| h.starts_with("peer-relation-joined"))
            .count()
            == 2
    });
    let h: Vec<String> = hooks(&unit_log("lister/0"))
        .into_iter()
        .filter(|h| h.starts_with("peer-relation-joined"))
        .collect();
    assert_eq!(
        h,
        [
            "peer-relation-joined lister/1 sees [lister/1 ]",
            "peer-relation-joined lister/2 sees [lister/1 lister/2 ]",
        ]
    );
    // -departed: the departing unit is gone from the list.
    j.run(&["remove-unit", "lister/2"]).ok();
    eventually("lister/0's -departed", || {
        hooks(&unit_log("lister/0"))
            .iter()
            .any(|h| h.starts_with("peer-relation-departed"))
    });
    let departed = hooks(&unit_log("lister/0"))
        .into_iter()
        .find(|h| h.starts_with("peer-relation-departed"))
        .unwrap();
    assert_eq!(departed, "peer-relation-departed lister/2 sees [lister/1 ]");
}

#[test]
fn reads_in_a_hook_are_a_snapshot_and_a_failed_hooks_relation_set_is_discarded() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&[
        "deploy",
        &flaky_charm(charms.path()),
        "-n",
        "2",
        "--config",
        "block-hook=start",
    ])
    .ok();
    let _ctl = j.controller();
    // Both units block in start; the title changes under them.
    let agents = j.home.path().join("environments/t/agents");
    let (u0, u1) = (
        agents.join("machine-1/unit-flaky-0"),
        agents.join("machine-2/unit-flaky-1"),
    );
    eventually("start to be running", || {
        u0.join("blocked").exists() && u1.join("blocked").exists()
    });
    j.run(&[
        "set",
        "flaky",
        "title=changed",
        "block-hook=",
        "fail-hook=peer-relation-joined",
    ])
    .ok();
    std::fs::write(u0.join("go"), "").unwrap();
    std::fs::write(u1.join("go"), "").unwrap();
    let log0 = log(&j, "1", "flaky/0");
    eventually("start to finish", || {
        std::fs::read_to_string(&log0)
            .unwrap_or_default()
            .matches("read title=")
            .count()
            == 2
    });
    let text = std::fs::read_to_string(&log0).unwrap();
    let reads: Vec<&str> = text.lines().filter(|l| l.contains("read title=")).collect();
    assert!(
        reads.iter().all(|l| l.ends_with("read title=one")),
        "{reads:?}"
    );
    // peer-relation-joined sets `secret` and fails: the other unit never
    // sees it, before or after `resolved` (without --retry).
    eventually("peer-relation-joined to fail", || {
        holds_on_failure(&j, "flaky/0")
    });
    eventually("peer-relation-joined to fail", || {
        holds_on_failure(&j, "flaky/1")
    });
    j.run(&["set", "flaky", "fail-hook="]).ok();
    j.run(&["resolved", "flaky/0"]).ok();
    j.run(&["resolved", "flaky/1"]).ok();
    eventually("both started", || {
        agent_status(&j, "flaky/0").0 == "started" && agent_status(&j, "flaky/1").0 == "started"
    });
    eventually("peer-relation-changed on flaky/0 to read", || {
        std::fs::read_to_string(&log0)
            .unwrap_or_default()
            .contains("saw secret=")
    });
    let text = std::fs::read_to_string(&log0).unwrap();
    assert!(text.contains("saw secret=[]"), "{text}");
    assert!(!text.contains("saw secret=[from-"), "{text}");
}

#[test]
fn debug_log_shows_the_units_logs_prefixed_and_filtered() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    eventually("both units started", || {
        let st = j.status();
        st["services"]["mysql"]["units"]["mysql/0"]["agent-status"] == "started"
            && st["services"]["wordpress"]["units"]["wordpress/0"]["agent-status"] == "started"
    });
    let all = j.run(&["debug-log", "--no-tail"]).ok().stdout;
    assert!(
        all.contains("mysql/0: ") && all.contains("wordpress/0: "),
        "{all}"
    );
    assert!(
        all.lines()
            .any(|l| l.starts_with("wordpress/0: ") && l.ends_with("hook: start")),
        "{all}"
    );
    let one = j
        .run(&[
            "debug-log",
            "--no-tail",
            "--include",
            "mysql/0",
            "--lines",
            "1",
        ])
        .ok()
        .stdout;
    assert_eq!(one.lines().count(), 1, "{one}");
    assert!(one.starts_with("mysql/0: "), "{one}");
    let r = j.run(&["debug-log", "--no-tail", "--include", "no such"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
}

#[test]
fn upgrade_charm_runs_its_hook_then_config_changed_and_keeps_what_the_charm_wrote() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    // The next version of wordpress: an upgrade-charm hook of its own.
    let next = j.home.path().join("wordpress-next");
    let copied = std::process::Command::new("cp")
        .args(["-r", &j.charm("wordpress")])
        .arg(&next)
        .status()
        .unwrap();
    assert!(copied.success());
    let hook = next.join("hooks/upgrade-charm");
    std::fs::write(
        &hook,
        "#!/bin/sh\nset -e\njuju-log \"hook: $(basename \"$0\")\"\necho next > \"$CHARM_DIR/version\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    // It drops a hook the old revision had.
    std::fs::remove_file(next.join("hooks/db-relation-broken")).unwrap();

    j.run(&["deploy", &j.charm("wordpress")]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let wp = log(&j, "1", "wordpress/0");
    let charm = j
        .home
        .path()
        .join("environments/t/agents/machine-1/unit-wordpress-0/charm");
    eventually("start", || hooks(&wp).contains(&"start".to_string()));
    let before = j.status()["services"]["wordpress"]["charm"].clone();

    // Refused, changing nothing: no such service; another charm's name.
    j.refused(
        &["upgrade-charm", "nosuch"],
        1,
        "service `nosuch` not found; `jujube status` lists what exists",
    );
    j.refused(
        &["upgrade-charm", "wordpress", "--path", &j.charm("mysql")],
        1,
        "cannot upgrade service `wordpress` to charm `mysql`: it runs charm `wordpress`, and a service keeps its charm's name; deploy the other charm as a service of its own",
    );

    let out = j
        .run(&[
            "upgrade-charm",
            "wordpress",
            "--path",
            next.to_str().unwrap(),
        ])
        .ok()
        .stdout;
    assert!(
        out.contains("upgraded to charm `local:jammy/wordpress-"),
        "{out}"
    );
    let after = j.status()["services"]["wordpress"]["charm"].clone();
    assert_ne!(before, after);
    eventually("upgrade-charm, then config-changed", || {
        let h = hooks(&wp);
        h.contains(&"upgrade-charm".to_string()) && count(&h, "config-changed") == 2
    });
    let h = hooks(&wp);
    assert_eq!(count(&h, "upgrade-charm"), 1, "{h:?}");
    assert!(
        pos(&h, "upgrade-charm") < h.iter().rposition(|x| x == "config-changed").unwrap(),
        "config-changed after upgrade-charm: {h:?}"
    );
    assert_eq!(count(&h, "install"), 1, "{h:?}");
    // The new files are in, the dropped hook is gone (it must not run
    // again); what the charm wrote there before stays.
    assert!(charm.join("hooks/upgrade-charm").is_file());
    assert!(!charm.join("hooks/db-relation-broken").exists());
    assert_eq!(
        std::fs::read_to_string(charm.join("version")).unwrap(),
        "next\n"
    );
    assert!(
        charm.join("site.conf").is_file(),
        "written by config-changed"
    );
    assert_eq!(ctl.terminate().code(), Some(0));
}

#[test]
fn a_forced_upgrade_lays_the_new_charm_over_a_unit_in_error_and_retries_the_failed_hook() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    j.run(&["bootstrap", "t"]).ok();
    let broken = flaky_charm(charms.path());
    // This revision's install always fails.
    let install = Path::new(&broken).join("hooks/install");
    std::fs::write(&install, "#!/bin/sh\njuju-log \"hook: install\"\nexit 1\n").unwrap();
    j.run(&["deploy", &broken]).ok();
    let _ctl = j.controller();
    eventually("install failed", || holds_on_failure(&j, "flaky/0"));
    // The fixed revision: an install that works, and an upgrade-charm hook
    // that must not run after a forced upgrade from an error (the spec).
    let fixed = j.home.path().join("flaky-fixed");
    let copied = std::process::Command::new("cp")
        .args(["-r", &broken])
        .arg(&fixed)
        .status()
        .unwrap();
    assert!(copied.success());
    std::fs::write(
        fixed.join("hooks/install"),
        "#!/bin/sh\njuju-log \"hook: install fixed\"\n",
    )
    .unwrap();
    let upgrade = fixed.join("hooks/upgrade-charm");
    std::fs::write(&upgrade, "#!/bin/sh\njuju-log \"hook: upgrade-charm\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&upgrade, std::fs::Permissions::from_mode(0o755)).unwrap();

    j.run(&[
        "upgrade-charm",
        "flaky",
        "--force",
        "--path",
        fixed.to_str().unwrap(),
    ])
    .ok();
    eventually("the unit started from the fixed charm", || {
        agent_status(&j, "flaky/0").0 == "started"
    });
    let h = hooks(&log(&j, "1", "flaky/0"));
    assert_eq!(count(&h, "install fixed"), 1, "{h:?}");
    assert_eq!(
        count(&h, "upgrade-charm"),
        0,
        "no upgrade-charm after a forced upgrade from an error: {h:?}"
    );
    in_order(&h, &["install", "install fixed", "start"]);
}

#[test]
fn an_environments_files_are_its_users_alone() {
    use std::os::unix::fs::PermissionsExt;
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    // A home made 0755 by someone else's umask is tightened.
    std::fs::set_permissions(j.home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &flaky_charm(charms.path())]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let env = j.home.path().join("environments/t");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(j.home.path()), 0o700);
    assert_eq!(mode(&env), 0o700);
    for f in ["state.db", "state.db-wal"] {
        assert_eq!(mode(&env.join(f)), 0o600, "{f}");
    }
    let log = log(&j, "1", "flaky/0");
    eventually("the unit's log", || log.is_file());
    assert_eq!(mode(&log), 0o600);
    // A hook's own files get the usual 022.
    let r = j
        .run(&[
            "run",
            "flaky/0",
            "--",
            "sh",
            "-c",
            "touch ../made-by-hook && stat -c %a ../made-by-hook",
        ])
        .ok();
    assert_eq!(r.stdout.trim(), "644");
}

#[test]
fn wait_fails_naming_units_held_by_a_failed_hook_and_resolved_all_frees_them() {
    let (j, _charms) = flaky_env(2, &["fail-hook=install"]);
    let _ctl = j.controller();
    eventually("both installs failed", || {
        holds_on_failure(&j, "flaky/0") && holds_on_failure(&j, "flaky/1")
    });
    let r = j.run(&["wait", "--timeout", "30s"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    for u in ["flaky/0", "flaky/1"] {
        assert!(
            r.stderr
                .contains(&format!("unit `{u}`: hook failed: \"install\"")),
            "{}",
            r.stderr
        );
    }
    assert!(
        r.stderr.contains("`jujube resolved UNIT --retry`"),
        "{}",
        r.stderr
    );
    // `--all`, with `--retry`, after fixing the cause.
    j.run(&["set", "flaky", "fail-hook="]).ok();
    let out = j.run(&["resolved", "--all", "--retry"]).ok().stdout;
    assert_eq!(out, "resolved 2 units in error: `flaky/0`, `flaky/1`\n");
    eventually("both started", || {
        agent_status(&j, "flaky/0").0 == "started" && agent_status(&j, "flaky/1").0 == "started"
    });
    j.run(&["wait", "--timeout", "30s"]).ok();
    assert_eq!(
        j.run(&["resolved", "--all"]).ok().stdout,
        "no unit is in error\n"
    );
    let r = j.run(&["resolved", "--all", "flaky/0"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .starts_with("error: the argument '--all' cannot be used with '[MACHINE|UNIT]'"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_dying_machine_names_the_unit_a_failed_hook_holds() {
    let (j, _charms) = flaky_env(1, &[]);
    j.run(&["set", "flaky", "fail-hook=stop"]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    j.run(&["destroy-unit", "flaky/0"]).ok();
    j.run(&["destroy-machine", "1"]).ok();
    eventually("the stop hook failed", || holds_on_failure(&j, "flaky/0"));
    let r = j.run(&["wait", "--timeout", "1s"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(
            "machine 1 is dying and waits for unit `flaky/0`, held by a failed hook (`jujube resolved flaky/0`)"
        ),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("unit `flaky/0`: hook failed: \"stop\""),
        "{}",
        r.stderr
    );
}

/// A charm with an executable `dispatch` (as charmcraft packs `ops`
/// charms) has it run for every hook, told which by `JUJU_DISPATCH_PATH`,
/// with the relation hooks' `JUJU_REMOTE_APP` and the departing unit; a
/// subordinate's hooks are told its principal.
#[test]
fn a_charm_with_dispatch_runs_it_for_every_hook() {
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("dispatcher");
    std::fs::create_dir_all(&charm).unwrap();
    std::fs::write(
        charm.join("metadata.yaml"),
        "name: dispatcher\nsummary: dispatches\nsubordinate: true\nrequires:\n  db:\n    interface: mysql\n  juju-info:\n    interface: juju-info\n    scope: container\n",
    )
    .unwrap();
    let dispatch = charm.join("dispatch");
    std::fs::write(
        &dispatch,
        "#!/bin/sh\n[ \"hooks/$JUJU_HOOK_NAME\" = \"$JUJU_DISPATCH_PATH\" ] || exit 1\necho \"dispatch: $JUJU_DISPATCH_PATH app=${JUJU_REMOTE_APP:-} departing=${JUJU_DEPARTING_UNIT:-} principal=${JUJU_PRINCIPAL_UNIT:-}\"\nstatus-set active \"ran $JUJU_HOOK_NAME\"\necho \"leader: $(is-leader --format=json)\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dispatch, std::fs::Permissions::from_mode(0o755)).unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", charm.to_str().unwrap()]).ok();
    j.run(&["add-relation", "dispatcher", "wordpress"]).ok();
    j.run(&["add-relation", "dispatcher", "mysql"]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    let machine = st["services"]["wordpress"]["units"]["wordpress/0"]["machine"]
        .as_str()
        .unwrap()
        .to_string();
    let lines = || {
        std::fs::read_to_string(log(&j, &machine, "dispatcher/0"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_once("dispatch: ").map(|(_, d)| d.to_string()))
            .collect::<Vec<_>>()
    };
    // The charm's status and leadership, through the hook tools.
    let sub = &st["services"]["wordpress"]["units"]["wordpress/0"]["subordinates"]["dispatcher/0"];
    assert_eq!(sub["workload-status"]["current"], "active", "{sub}");
    assert_eq!(sub["leader"], true, "{sub}");
    let unit_log = std::fs::read_to_string(log(&j, &machine, "dispatcher/0")).unwrap();
    assert!(unit_log.contains("leader: true"), "{unit_log}");
    let seen = lines();
    for want in [
        "hooks/install app= departing= principal=wordpress/0",
        "hooks/start app= departing= principal=wordpress/0",
        "hooks/leader-elected app= departing= principal=wordpress/0",
        "hooks/db-relation-joined app=mysql departing= principal=wordpress/0",
        "hooks/db-relation-changed app=mysql departing= principal=wordpress/0",
    ] {
        assert!(seen.iter().any(|l| l == want), "{want} in {seen:?}");
    }
    j.run(&["destroy-relation", "dispatcher", "mysql"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let seen = lines();
    assert!(
        seen.iter()
            .any(|l| l
                == "hooks/db-relation-departed app=mysql departing=mysql/0 principal=wordpress/0"),
        "{seen:?}"
    );
}

/// `resolved` without `--retry` counts a failed `leader-settings-changed`
/// as done: it is not run again until the leader settings change.
#[test]
fn resolved_counts_a_failed_leader_settings_changed_as_done() {
    use std::os::unix::fs::PermissionsExt;
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("lsc");
    std::fs::create_dir_all(&charm).unwrap();
    std::fs::write(charm.join("metadata.yaml"), "name: lsc\nsummary: s\n").unwrap();
    let dispatch = charm.join("dispatch");
    std::fs::write(
        &dispatch,
        "#!/bin/sh\ncase \"$JUJU_HOOK_NAME\" in\n  \
         install) is-leader >/dev/null ;;\n  \
         leader-settings-changed) echo ran >> \"$CHARM_DIR/../lsc.count\"; exit 1 ;;\nesac\n",
    )
    .unwrap();
    std::fs::set_permissions(&dispatch, std::fs::Permissions::from_mode(0o755)).unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", charm.to_str().unwrap(), "-n", "2"]).ok();
    let _ctl = j.controller();
    let units = ["lsc/0", "lsc/1"];
    eventually("a unit held by leader-settings-changed", || {
        units.iter().any(|u| holds_on_failure(&j, u))
    });
    let (_, info) = units
        .iter()
        .map(|u| agent_status(&j, u))
        .find(|(s, _)| s == "error")
        .unwrap();
    assert!(info.contains("leader-settings-changed"), "{info}");
    j.run(&["resolved", "--all"]).ok();
    eventually("both units started", || {
        units.iter().all(|u| agent_status(&j, u).0 == "started")
    });
    std::thread::sleep(Duration::from_millis(500));
    let st = j.status();
    for u in units {
        assert_eq!(agent_status(&j, u).0, "started", "{u}");
        let machine = st["services"]["lsc"]["units"][u]["machine"]
            .as_str()
            .unwrap();
        let count = j.home.path().join(format!(
            "environments/t/agents/machine-{machine}/unit-{}/lsc.count",
            u.replace('/', "-")
        ));
        let runs = std::fs::read_to_string(count).unwrap_or_default();
        assert!(runs.lines().count() <= 1, "{u} ran it again: {runs:?}");
    }
}

/// An action whose answer would pass the store's bound still gets one: it
/// is not run again and again (each pass found it unanswered) until its
/// timeout, and `jujube run` says it failed.
#[test]
fn an_action_answering_more_than_the_store_keeps_runs_once_and_fails() {
    use std::os::unix::fs::PermissionsExt;
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("big");
    std::fs::create_dir_all(charm.join("actions")).unwrap();
    std::fs::write(charm.join("metadata.yaml"), "name: big\nsummary: s\n").unwrap();
    std::fs::write(
        charm.join("actions.yaml"),
        "shout:\n  description: says a lot\n",
    )
    .unwrap();
    // Results near their bound, and a failure message of control
    // characters, which JSON writes six bytes each.
    let action = charm.join("actions/shout");
    std::fs::write(
        &action,
        "#!/bin/sh\necho ran >> \"$CHARM_DIR/../shout.count\"\n\
         x=$(head -c 120000 /dev/zero | tr '\\0' x)\n\
         action-set a=\"$x\" b=\"$x\" c=\"$x\" d=\"$x\"\n\
         action-fail \"$(head -c 120000 /dev/zero | tr '\\0' '\\001')\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&action, std::fs::Permissions::from_mode(0o755)).unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", charm.to_str().unwrap()]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let r = j.run(&["run", "big/0", "shout", "--timeout", "20s"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("action `shout` on unit `big/0` failed"),
        "{}",
        r.stderr
    );
    let machine = j.status()["services"]["big"]["units"]["big/0"]["machine"]
        .as_str()
        .unwrap()
        .to_string();
    let count = j.home.path().join(format!(
        "environments/t/agents/machine-{machine}/unit-big-0/shout.count"
    ));
    let runs = std::fs::read_to_string(count).unwrap();
    assert_eq!(runs.lines().count(), 1, "{runs:?}");
}

/// Without a running controller `jujube run UNIT ACTION` queues nothing
/// and says so; `--background` queues it for when one runs.
#[test]
fn without_a_controller_an_action_is_refused_and_nothing_is_queued() {
    use std::os::unix::fs::PermissionsExt;
    let mut j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("act");
    std::fs::create_dir_all(charm.join("actions")).unwrap();
    std::fs::write(charm.join("metadata.yaml"), "name: act\nsummary: s\n").unwrap();
    std::fs::write(charm.join("actions.yaml"), "hello: {}\n").unwrap();
    let action = charm.join("actions/hello");
    std::fs::write(&action, "#!/bin/sh\naction-set said=hello\n").unwrap();
    std::fs::set_permissions(&action, std::fs::Permissions::from_mode(0o755)).unwrap();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", charm.to_str().unwrap()]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert_eq!(j.controller().terminate().code(), Some(0));
    j.start_controllers = false;
    for args in [
        &["run", "act/0", "hello"][..],
        &["run", "act/0", "hello", "--background"][..],
    ] {
        let r = j.run(args);
        assert_eq!(r.code, 1, "{args:?}");
        assert!(
            r.stderr
                .starts_with("error: cannot reach the controller of environment `t`"),
            "{}",
            r.stderr
        );
    }
    j.start_controllers = true;
    let _ctl = j.controller();
    let r = j.run(&["show-task", "1"]);
    assert_eq!(r.code, 1, "nothing was queued: {}", r.stdout);
    let bg = j.run(&["run", "act/0", "hello", "--background"]).ok();
    let id = bg.stdout.split_whitespace().nth(2).unwrap().to_string();
    eventually("the queued action to run", || {
        j.run(&["show-task", &id])
            .ok()
            .stdout
            .contains("said: hello")
    });
}
