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
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(": hook: ").map(|(_, h)| h.to_string()))
        .collect()
}

fn pos(hooks: &[String], h: &str) -> usize {
    hooks
        .iter()
        .position(|x| x == h)
        .unwrap_or_else(|| panic!("hook `{h}` never ran: {hooks:?}"))
}

fn count(hooks: &[String], h: &str) -> usize {
    hooks.iter().filter(|x| *x == h).count()
}

/// Waits (bounded) until `f` holds: hooks run asynchronously to `wait`'s
/// view of the model when nothing in it changes.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn hooks_run_in_order_and_wordpress_gets_mysqls_credentials() {
    let j = Jujube::new();
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
    assert!(conf.contains("host=127.0.0.1\n"), "{conf}");
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

    // Unit hooks first, once, in order; then the relation's.
    let wp = log(&j, "1", "wordpress/0");
    let h = hooks(&wp);
    for once in ["install", "start"] {
        assert_eq!(count(&h, once), 1, "{once}: {h:?}");
    }
    assert!(pos(&h, "install") < pos(&h, "config-changed"), "{h:?}");
    assert!(pos(&h, "config-changed") < pos(&h, "start"), "{h:?}");
    assert!(
        pos(&h, "start") < pos(&h, "db-relation-joined mysql/0"),
        "{h:?}"
    );
    assert!(
        pos(&h, "db-relation-joined mysql/0") < pos(&h, "db-relation-changed mysql/0"),
        "{h:?}"
    );
    assert_eq!(count(&h, "db-relation-joined mysql/0"), 1, "{h:?}");
    let my = hooks(&log(&j, "2", "mysql/0"));
    assert!(
        pos(&my, "start") < pos(&my, "db-relation-joined wordpress/0"),
        "{my:?}"
    );
    assert!(
        pos(&my, "db-relation-joined wordpress/0") < pos(&my, "db-relation-changed wordpress/0"),
        "{my:?}"
    );
    // The subordinate records its principal.
    let logging = agents.join("machine-1/unit-logging-0/charm/principal");
    eventually("logging's principal", || logging.is_file());
    assert_eq!(std::fs::read_to_string(&logging).unwrap(), "wordpress/0\n");

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

    // A settings change fires config-changed once.
    j.run(&["set", "wordpress", "title=Hello"]).ok();
    eventually("config-changed after `set`", || {
        count(&hooks(&wp), "config-changed") == 2
    });
    assert_eq!(
        std::fs::read_to_string(charm.join("site.conf")).unwrap(),
        "title=Hello\n"
    );

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

    // Destroying the service: stop is the last hook, after every relation
    // (the logging one, the peer one) is broken.
    j.run(&["destroy-service", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let h = hooks(&wp);
    assert_eq!(h.last().map(String::as_str), Some("stop"), "{h:?}");
    assert_eq!(count(&h, "stop"), 1);
    let lg = hooks(&log(&j, "1", "logging/0"));
    assert!(
        pos(&lg, "juju-info-relation-broken") < pos(&lg, "stop"),
        "{lg:?}"
    );
    assert_eq!(ctl.terminate().code(), Some(0));
}
