//! The agents through the binary, with the controller running: deployment,
//! subordinates, the whole destroy story, and a kill -9 mid-destroy.

use crate::Jujube;
use serde_json::Value;

fn unit<'a>(st: &'a Value, svc: &str, u: &str) -> &'a Value {
    &st["services"][svc]["units"][u]
}

fn instances(j: &Jujube) -> Vec<Value> {
    let r = j.run(&["dummy-cloud", "list"]).ok();
    serde_json::from_str::<Vec<Value>>(&r.stdout).unwrap()
}

#[test]
fn the_agents_story_end_to_end() {
    story(false);
}

/// The same story with every machine agent a `jujube agent` process that
/// reaches the controller only through its API; the agents outlive the
/// controller killed with -9 and reconnect to the next one.
#[test]
fn the_agents_story_end_to_end_with_agent_processes() {
    story(true);
}

/// `wait`, after a controller was killed with -9: a hook that was running
/// then is a failed hook now (charms-in-action.txt), and its unit holds in
/// `error` until `resolved`; re-run those hooks, as a user would.
fn wait_resolving_interrupted_hooks(j: &Jujube) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let st = j.status();
        for svc in st["services"].as_object().unwrap().values() {
            for (name, u) in svc["units"].as_object().unwrap() {
                let subs = u["subordinates"].as_object().cloned().unwrap_or_default();
                for (n, v) in std::iter::once((name.clone(), u.clone())).chain(subs) {
                    if v["agent-status"] == "error" {
                        let _ = j.run(&["resolved", "--retry", &n]);
                    }
                }
            }
        }
        if j.run(&["wait", "--timeout", "5s"]).code == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never converged: {:#}",
            j.status()
        );
    }
}

/// Bootstraps `t` whose agents run as processes of their own, reaching the
/// controller only through its API, with presence lapsing after 4 s (a
/// frozen agent shows quickly).
/// Placement and the presence lapse are read when a controller starts:
/// they are given at bootstrap.
pub(crate) fn bootstrap_with_agent_processes(j: &Jujube) {
    j.run(&[
        "bootstrap",
        "t",
        "--config",
        "dummy-agents=process",
        "--config",
        "agent-presence-lapse=4",
    ])
    .ok();
}

pub(crate) fn agent_pid(j: &Jujube, machine: &str) -> Option<u32> {
    let dir = j
        .home
        .path()
        .join(format!("environments/t/agents/machine-{machine}"));
    let pid: u32 = std::fs::read_to_string(dir.join("agent.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).ok()?;
    cmdline.contains("agent").then_some(pid)
}

fn story(process: bool) {
    let j = Jujube::new();
    if process {
        j.run(&["bootstrap", "t", "--config", "dummy-agents=process"])
            .ok();
    } else {
        j.run(&["bootstrap", "t"]).ok();
    }
    j.run(&["deploy", &j.charm("wordpress"), "-n", "2"]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    for (svc, u) in [
        ("wordpress", "wordpress/0"),
        ("wordpress", "wordpress/1"),
        ("mysql", "mysql/0"),
    ] {
        assert_eq!(unit(&st, svc, u)["agent-status"], "started", "{u}: {st:#}");
    }
    for m in ["1", "2", "3"] {
        assert_eq!(st["machines"][m]["agent-status"], "started", "machine {m}");
        assert_eq!(st["machines"][m]["status"], "started", "machine {m}");
    }
    // Deployed: a directory per machine, the unit's with the charm in it.
    let agents = j.home.path().join("environments/t/agents");
    let wp0 = agents.join("machine-1/unit-wordpress-0");
    assert!(
        wp0.join("charm/metadata.yaml").is_file(),
        "{}",
        wp0.display()
    );
    assert!(agents
        .join("machine-3/unit-mysql-0/charm/metadata.yaml")
        .is_file());
    let pids: Vec<Option<u32>> = ["1", "2", "3"].iter().map(|m| agent_pid(&j, m)).collect();
    if process {
        use std::os::unix::fs::PermissionsExt;
        assert!(
            pids.iter().all(Option::is_some),
            "an agent process per machine: {pids:?}"
        );
        let conf = agents.join("machine-1/agent.conf");
        let mode = std::fs::metadata(&conf).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "agent.conf is the agent's alone: {mode:o}");
        // The unit agents' credentials, made through the API by the
        // machine agent.
        assert!(agents
            .join("machine-1/credentials/unit-wordpress-0.conf")
            .is_file());
    } else {
        assert!(pids.iter().all(Option::is_none), "{pids:?}");
    }
    let db = st["relations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "wordpress:db mysql:db")
        .unwrap();
    assert_eq!(db["units-in-scope"], 3);

    // A container relation: one logging unit under each wordpress unit.
    j.run(&["add-relation", "logging", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    let logging = &st["services"]["logging"];
    assert_eq!(logging["subordinate-to"], serde_json::json!(["wordpress"]));
    assert_eq!(
        logging["units"],
        serde_json::json!({}),
        "a subordinate service lists no units of its own"
    );
    let mut subs = Vec::new();
    for u in ["wordpress/0", "wordpress/1"] {
        let s = unit(&st, "wordpress", u)["subordinates"]
            .as_object()
            .unwrap();
        assert_eq!(s.len(), 1, "{u}: {st:#}");
        let (name, sub) = s.iter().next().unwrap();
        assert_eq!(sub["agent-status"], "started", "{name}");
        assert_eq!(sub["life"], "alive");
        subs.push(name.clone());
    }
    subs.sort();
    assert_eq!(subs, ["logging/0", "logging/1"]);
    assert!(agents.join("machine-1").read_dir().unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("unit-logging-")
    }));

    // Destroying the logging relation: the subordinates go.
    j.run(&["destroy-relation", "logging", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    for u in ["wordpress/0", "wordpress/1"] {
        assert_eq!(
            unit(&st, "wordpress", u)["subordinates"],
            serde_json::json!({}),
            "{u}"
        );
    }
    assert_eq!(st["services"]["logging"]["life"], "alive");
    assert!(st["relations"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["scope"] != "container"));

    // destroy-service, with the controller killed (-9) in the middle: the
    // next one completes it.
    j.run(&["destroy-service", "wordpress"]).ok();
    ctl.kill9();
    if process {
        // The agents outlived the controller; the next one adopts them
        // rather than starting second ones.
        assert_eq!(agent_pid(&j, "3"), pids[2], "machine 3's agent still runs");
    }
    let ctl = j.controller();
    wait_resolving_interrupted_hooks(&j);
    let st = j.status();
    assert!(st["services"].get("wordpress").is_none(), "{st:#}");
    assert!(
        st["relations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| !r["key"].as_str().unwrap().contains("wordpress")),
        "its relations went with it: {st:#}"
    );
    assert_eq!(st["services"]["mysql"]["life"], "alive");
    assert!(!wp0.exists(), "recalled");

    // The now empty machines: Dying → Dead → instance stopped → removed.
    let inst1 = st["machines"]["1"]["instance-id"]
        .as_str()
        .unwrap()
        .to_string();
    j.run(&["destroy-machine", "1", "2"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    assert!(
        st["machines"].get("1").is_none() && st["machines"].get("2").is_none(),
        "{st:#}"
    );
    assert!(
        instances(&j).iter().all(|i| i["id"] != inst1.as_str()),
        "instance stopped"
    );
    if process {
        assert_eq!(agent_pid(&j, "3"), pids[2], "adopted, not replaced");
    }
    assert_eq!(ctl.terminate().code(), Some(0));
    if process {
        assert_eq!(
            agent_pid(&j, "3"),
            None,
            "a controller stopping stops its agents"
        );
    }
}

#[test]
fn a_controller_killed_mid_destroy_of_a_subordinate_relation_resumes_it() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "3"]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "logging", "wordpress"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    j.run(&["destroy-relation", "logging", "wordpress"]).ok();
    ctl.kill9();
    let _ctl = j.controller();
    wait_resolving_interrupted_hooks(&j);
    let st = j.status();
    for u in ["wordpress/0", "wordpress/1", "wordpress/2"] {
        assert_eq!(
            unit(&st, "wordpress", u)["subordinates"],
            serde_json::json!({}),
            "{u}: {st:#}"
        );
        assert_eq!(unit(&st, "wordpress", u)["agent-status"], "started");
    }
}

/// An agent process killed with -9 is restarted by its controller and
/// resumes where it stopped: what it deployed stays deployed (not deployed
/// again), and it carries on with the lifecycle.
#[test]
fn an_agent_process_killed_and_restarted_resumes_without_redoing_its_work() {
    use std::os::unix::fs::MetadataExt;
    let j = Jujube::new();
    j.run(&["bootstrap", "t", "--config", "dummy-agents=process"])
        .ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let unit_dir = j
        .home
        .path()
        .join("environments/t/agents/machine-1/unit-wordpress-0");
    let inode = std::fs::metadata(&unit_dir).unwrap().ino();
    let charm_mtime = std::fs::metadata(unit_dir.join("charm/metadata.yaml"))
        .unwrap()
        .mtime_nsec();
    // Killed between hooks (a hook killed with its agent is a failed hook:
    // `hooks.rs` tests that): wordpress has its database settings and
    // nothing runs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let settled = |h: jujube_agent::hooks::state::HookState| h.installed && h.running.is_none();
    while !(unit_dir.join("charm/db.conf").is_file()
        && settled(jujube_agent::hooks::state::HookState::read(&unit_dir).unwrap_or_default()))
    {
        assert!(std::time::Instant::now() < deadline, "hooks never settled");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = agent_pid(&j, "1").expect("machine 1's agent process");
    // SAFETY: kill(2) on the agent process this test's controller started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let mut restarted = None;
    for _ in 0..200 {
        match agent_pid(&j, "1") {
            Some(p) if p != pid => {
                restarted = Some(p);
                break;
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
    assert!(restarted.is_some(), "the controller restarts a dead agent");
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert_eq!(
        std::fs::metadata(&unit_dir).unwrap().ino(),
        inode,
        "not deployed again"
    );
    assert_eq!(
        std::fs::metadata(unit_dir.join("charm/metadata.yaml"))
            .unwrap()
            .mtime_nsec(),
        charm_mtime
    );
    assert_eq!(
        unit(&j.status(), "wordpress", "wordpress/0")["agent-status"],
        "started"
    );
    // And it goes on with the lifecycle.
    j.run(&["destroy-service", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert!(j.status()["services"].get("wordpress").is_none());
    assert!(!unit_dir.exists());
    assert_eq!(ctl.terminate().code(), Some(0));
}

/// A controller killed after starting an agent process but before recording
/// its pid: the next controller finds the agent by its lock and adopts it
/// (no replacement dying on the lock), and `destroy-environment` after
/// another kill stops it and says so.
#[test]
fn an_agent_process_whose_pid_was_never_recorded_is_adopted_and_destroyed() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t", "--config", "dummy-agents=process"])
        .ok();
    j.run(&["add-machine"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let pid = agent_pid(&j, "1").expect("machine 1's agent process");
    ctl.kill9();
    let dir = j.home.path().join("environments/t/agents/machine-1");
    std::fs::remove_file(dir.join("agent.pid")).unwrap();
    let ctl = j.controller();
    crate::hooks::eventually("the agent adopted (its pid recorded again)", || {
        agent_pid(&j, "1").is_some()
    });
    assert_eq!(agent_pid(&j, "1"), Some(pid), "adopted, not replaced");
    j.run(&["wait", "--timeout", "60s"]).ok();
    let log = std::fs::read_to_string(dir.join("agent.log")).unwrap();
    assert!(!log.contains("another agent runs"), "{log}");
    ctl.kill9();
    std::fs::remove_file(dir.join("agent.pid")).unwrap();
    let out = j.run(&["destroy-environment", "t", "--yes"]).ok().stdout;
    assert!(out.contains("stopped 1 agent process(es)"), "{out}");
    // SAFETY: signal 0 only checks that the process exists.
    assert_ne!(
        unsafe { libc::kill(pid as i32, 0) },
        0,
        "the agent still runs"
    );
}

/// Agent presence: a frozen agent process (SIGSTOP) shows `down` in
/// `status`, machine and units alike, with since when; `wait` names it and
/// does not report success; thawed, it is `started` again.
#[test]
fn a_frozen_agent_process_shows_down_and_wait_names_it() {
    let j = Jujube::new();
    bootstrap_with_agent_processes(&j);
    j.run(&["deploy", &j.charm("mysql")]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let pid = agent_pid(&j, "1").expect("machine 1's agent process");
    let agent = |j: &Jujube| {
        let st = j.status();
        (
            st["machines"]["1"]["agent-status"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            unit(&st, "mysql", "mysql/0")["agent-status"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            unit(&st, "mysql", "mysql/0")["agent-status-info"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        )
    };
    assert_eq!(agent(&j).0, "started");
    // SAFETY: kill(2) on the agent process this test's controller started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while agent(&j).1 != "down" {
        assert!(
            std::time::Instant::now() < deadline,
            "never down: {:?}",
            agent(&j)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let (machine, _, info) = agent(&j);
    assert_eq!(machine, "down");
    assert!(
        info.contains("agent not seen since") && info.contains("was `started`"),
        "{info}"
    );
    // A unit destroyed meanwhile cannot go: wait says who it waits for.
    j.run(&["destroy-unit", "mysql/0"]).ok();
    let w = j.run(&["wait", "--timeout", "3s"]);
    assert_ne!(w.code, 0, "wait succeeded with a frozen agent");
    assert!(
        w.stderr.contains("the agent of unit `mysql/0` is down"),
        "{}",
        w.stderr
    );
    // Thawed: seen again, and the destroy goes through.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert_eq!(agent(&j).0, "started");
    assert!(j.status()["services"]["mysql"]["units"]
        .get("mysql/0")
        .is_none());
    assert_eq!(ctl.terminate().code(), Some(0));
}

/// Leadership fails over: the leader's agent process frozen, another unit
/// becomes leader within the presence lapse and runs `leader-elected`.
#[test]
fn leadership_moves_when_the_leaders_agent_is_lost() {
    use std::os::unix::fs::PermissionsExt;
    let j = Jujube::new();
    let charms = tempfile::tempdir().unwrap();
    let charm = charms.path().join("leaders");
    std::fs::create_dir_all(&charm).unwrap();
    std::fs::write(
        charm.join("metadata.yaml"),
        "name: leaders\nsummary: leads\n",
    )
    .unwrap();
    let dispatch = charm.join("dispatch");
    std::fs::write(
        &dispatch,
        "#!/bin/sh\n[ \"$JUJU_HOOK_NAME\" = install ] && is-leader >/dev/null\n\
         [ \"$JUJU_HOOK_NAME\" = leader-elected ] && leader-set chosen=\"$JUJU_UNIT_NAME\"\n\
         [ \"$JUJU_HOOK_NAME\" = leader-settings-changed ] && echo \"leader says: $(leader-get chosen)\"\n\
         echo \"dispatch: $JUJU_DISPATCH_PATH\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&dispatch, std::fs::Permissions::from_mode(0o755)).unwrap();
    bootstrap_with_agent_processes(&j);
    j.run(&["deploy", charm.to_str().unwrap(), "-n", "2"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let leader_of = |j: &Jujube| -> Vec<String> {
        let st = j.status();
        st["services"]["leaders"]["units"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, u)| u["leader"] == true)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while leader_of(&j).len() != 1 {
        assert!(std::time::Instant::now() < deadline, "no single leader");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let first = leader_of(&j).remove(0);
    let st = j.status();
    let machine_of = |u: &str| {
        st["services"]["leaders"]["units"][u]["machine"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let other = if first == "leaders/0" {
        "leaders/1"
    } else {
        "leaders/0"
    };
    let log_of = |u: &str| {
        std::fs::read_to_string(j.home.path().join(format!(
            "environments/t/agents/machine-{}/logs/unit-{}.log",
            machine_of(u),
            u.replace('/', "-")
        )))
        .unwrap_or_default()
    };
    let elected = |u: &str| log_of(u).contains("dispatch: hooks/leader-elected");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !elected(&first) {
        assert!(
            std::time::Instant::now() < deadline,
            "leader-elected never ran on {first}: {}",
            log_of(&first)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        !elected(other),
        "{other} ran leader-elected while {first} led"
    );
    // What the leader set reaches the other unit: leader-settings-changed.
    let told = format!("leader says: {first}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !log_of(other).contains(&told) {
        assert!(
            std::time::Instant::now() < deadline,
            "{other} never ran leader-settings-changed with {first}'s setting: {}",
            log_of(other)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The leader's agent frozen: the other unit leads and runs
    // leader-elected.
    let pid = agent_pid(&j, &machine_of(&first)).expect("the leader's agent process");
    // SAFETY: kill(2) on an agent process this test's controller started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !(leader_of(&j) == [other.to_string()] && elected(other)) {
        assert!(
            std::time::Instant::now() < deadline,
            "no failover: leaders {:?}",
            leader_of(&j)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
    assert_eq!(ctl.terminate().code(), Some(0));
}
