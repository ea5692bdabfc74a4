//! Provisioning through the binary: bootstrap, the controller, `wait`,
//! failures and `resolved`, destroy, strays, crashes, destroy-environment.

use crate::Jujube;
use serde_json::Value;
use std::collections::BTreeMap;

fn instances(j: &Jujube) -> Vec<Value> {
    let r = j.run(&["dummy-cloud", "list"]).ok();
    serde_json::from_str::<Vec<Value>>(&r.stdout).unwrap()
}

fn uuid(j: &Jujube) -> String {
    j.status()["environment"]["uuid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn bootstrap_provisions_machine_0_as_the_controller_instance() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    let st = j.status();
    let id = st["machines"]["0"]["instance-id"]
        .as_str()
        .expect("machine 0 has an instance");
    assert_eq!(st["machines"]["0"]["status"], "started");
    let inst = instances(&j).into_iter().find(|i| i["id"] == id).unwrap();
    assert_eq!(inst["tags"]["jujube-controller"], "true");
    assert_eq!(inst["tags"]["jujube-env-uuid"], uuid(&j).as_str());
    assert_eq!(inst["tags"]["Name"], "jujube-t-0");
}

#[test]
fn a_failed_bootstrap_says_why_and_leaves_nothing_behind() {
    let j = Jujube::new();
    let r = j.run(&["bootstrap", "t", "--constraints", "mem=1000G"]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "error: bootstrap failed: cannot start machine 0: invalid instance spec: no dummy instance type satisfies `mem=1000G` (the largest is 64 cores, 256G memory, 1T root disk)\n"
    );
    assert_eq!(j.run(&["environments"]).ok().stdout, "");
    assert!(!j.home.path().join("environments/t").exists());
    j.refused(
        &["bootstrap", "u", "--config", "dummy-zones="],
        1,
        "invalid provider config: `dummy-zones` needs at least one zone",
    );
}

#[test]
fn the_provisioning_story_end_to_end() {
    let j = Jujube::new();
    j.run(&[
        "bootstrap",
        "t",
        "--config",
        "harvest-grace=2s",
        "--config",
        "harvest-interval=500ms",
    ])
    .ok();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "3"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    for m in ["0", "1", "2", "3"] {
        assert!(
            st["machines"][m]["instance-id"].is_string(),
            "machine {m}: {}",
            st["machines"][m]
        );
        assert_eq!(st["machines"][m]["status"], "started");
        assert!(st["machines"][m]["hardware"]
            .as_str()
            .unwrap()
            .contains("instance-type=d1.nano"));
    }

    // An injected failure: error in status, no instance id.
    j.run(&["set-environment", "dummy-fail-machines=4"]).ok();
    j.run(&["add-unit", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let m4 = &j.status()["machines"]["4"];
    assert_eq!(m4["status"], "error");
    assert!(m4["instance-id"].is_null());
    assert_eq!(m4["status-info"], "cannot start machine 4: invalid instance spec: machine 4 is configured to fail (`dummy-fail-machines`)");

    // Fixed, then resolved with new constraints: provisioned with them.
    j.run(&["set-environment", "dummy-fail-machines="]).ok();
    j.run(&["resolved", "4", "--constraints", "mem=4G"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let m4 = &j.status()["machines"]["4"];
    assert_eq!(m4["constraints"], "mem=4G");
    assert!(m4["instance-id"].is_string());
    assert!(m4["hardware"].as_str().unwrap().contains("mem=4G"), "{m4}");

    // destroy-unit + destroy-machine: instance stopped, machine removed.
    let inst1 = j.status()["machines"]["1"]["instance-id"]
        .as_str()
        .unwrap()
        .to_string();
    j.run(&["destroy-unit", "wordpress/0"]).ok();
    j.run(&["destroy-machine", "1"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert!(
        j.status()["machines"].get("1").is_none(),
        "machine 1 removed"
    );
    assert!(
        instances(&j).iter().all(|i| i["id"] != inst1.as_str()),
        "instance of machine 1 stopped"
    );

    // Strays: tagged ones go after the grace period; untagged ones never.
    let tag = format!("jujube-env-uuid={}", uuid(&j));
    let stray = j
        .run(&[
            "dummy-cloud",
            "start",
            "--tag",
            &tag,
            "--tag",
            "jujube-machine-id=42",
        ])
        .ok()
        .stdout
        .trim()
        .to_string();
    let foreign = j
        .run(&[
            "dummy-cloud",
            "start",
            "--tag",
            "jujube-machine-id=42",
            "--tag",
            "Name=jujube-t-42",
        ])
        .ok()
        .stdout
        .trim()
        .to_string();
    let other_env = j
        .run(&[
            "dummy-cloud",
            "start",
            "--tag",
            "jujube-env-uuid=00000000-0000-4000-8000-000000000000",
        ])
        .ok()
        .stdout
        .trim()
        .to_string();
    let seen = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        j.run(&["strays"]).ok().stdout.contains(&stray)
    });
    assert!(seen, "the stray is listed before it is reaped");
    j.run(&["wait", "--timeout", "60s"]).ok();
    let left: Vec<String> = instances(&j)
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!left.contains(&stray), "tagged stray reaped");
    assert!(
        left.contains(&foreign) && left.contains(&other_env),
        "never touch what is not ours"
    );
    assert_eq!(
        ctl.terminate().code(),
        Some(0),
        "the controller shuts down cleanly on SIGTERM"
    );
}

#[test]
fn wait_times_out_listing_what_is_stuck_and_one_controller_runs_at_a_time() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["add-machine"]).ok();
    let r = j.run(&["wait", "--timeout", "1s"]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "error: timed out after 1s; still waiting: machine 1 has no instance yet (status pending); is `jujube controller` running?\n"
    );
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let r = j.run(&["controller"]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "error: a controller is already running for environment `t`; stop it first\n"
    );
}

#[test]
fn bad_environment_config_is_refused_and_changes_nothing() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.refused(
        &["set-environment", "harvest-mode=sometimes"],
        1,
        "invalid provisioner config: `harvest-mode=sometimes`: use none, destroyed, unknown or all",
    );
    j.refused(&["set-environment", "dummy-latency=1s"], 1, "invalid provider config: unknown dummy provider key `dummy-latency`; README.md lists the keys");
    j.run(&["set-environment", "dummy-start-latency=10ms"]).ok();
    assert_eq!(
        j.run(&["get-environment"]).ok().stdout,
        "dummy-start-latency=10ms\n"
    );
}

#[test]
fn retry_provisioning_all_retries_every_machine_in_error() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t", "--config", "dummy-fail-machines=1,2"])
        .ok();
    j.run(&["add-machine", "-n", "2"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert_eq!(j.status()["machines"]["2"]["status"], "error");
    j.run(&["set-environment", "dummy-fail-machines="]).ok();
    let r = j.run(&["retry-provisioning", "--all"]).ok();
    assert_eq!(
        r.stdout,
        "machine `1` will be provisioned again\nmachine `2` will be provisioned again\n"
    );
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert!(j.status()["machines"]["2"]["instance-id"].is_string());
    j.refused(&["retry-provisioning", "2"], 1, "machine `2` has no provisioning error; `jujube resolved` only applies to machines in error");
    drop(ctl);
}

#[test]
fn destroy_environment_stops_every_instance_and_deletes_the_state() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["bootstrap", "keep"]).ok();
    j.run(&["switch", "t"]).ok();
    j.run(&["deploy", &j.charm("mysql"), "-n", "2"]).ok();
    {
        let _ctl = j.controller();
        j.run(&["wait", "--timeout", "60s"]).ok();
    }
    let tag = format!("jujube-env-uuid={}", uuid(&j));
    j.run(&["dummy-cloud", "start", "--tag", &tag]).ok();
    let untagged = j
        .run(&["dummy-cloud", "start"])
        .ok()
        .stdout
        .trim()
        .to_string();
    assert_eq!(instances(&j).len(), 5);
    let before = j.snapshot();
    let r = j.run(&["destroy-environment", "t"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "error: destroying environment `t` stops all its instances and deletes its state; add `--yes` to confirm\n");
    assert_eq!(before, j.snapshot());
    // Keep a copy of the dummy cloud (it lives in the environment's
    // directory) to see afterwards what was stopped.
    let dir = j.home.path().join("environments/t");
    let r = j.run(&["destroy-environment", "t", "-y"]).ok();
    assert_eq!(
        r.stdout,
        "stopped 4 instance(s)\ndestroyed environment `t`\n"
    );
    assert!(!dir.exists());
    assert_eq!(j.run(&["environments"]).ok().stdout, "  keep\n");
    assert!(!untagged.is_empty());
}

#[test]
fn killing_the_controller_at_random_moments_never_duplicates_or_leaks_instances() {
    let j = Jujube::new();
    j.run(&[
        "bootstrap",
        "t",
        "--config",
        "dummy-start-latency=100ms",
        "--config",
        "provisioner-batch=3",
        "--config",
        "provisioner-concurrency=2",
        "--config",
        "dummy-lost-response-rate=0.1",
        "--config",
        "harvest-interval=200ms",
    ])
    .ok();
    j.run(&["add-machine", "-n", "100"]).ok();
    let mut seed = std::process::id() as u64 | 1;
    let mut mid_way = 0;
    for trial in 0..6 {
        let ctl = j.controller();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let ms = 100 + seed % 400;
        std::thread::sleep(std::time::Duration::from_millis(ms));
        ctl.kill9();
        let done = j.provisioned();
        eprintln!("trial {trial}: killed after {ms} ms with {done} of 101 machines provisioned");
        if done > 1 && done < 101 {
            mid_way += 1;
        }
    }
    assert!(
        mid_way >= 2,
        "the kills must land while provisioning is under way ({mid_way} did)"
    );
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let st = j.status();
    let machines = st["machines"].as_object().unwrap();
    assert_eq!(machines.len(), 101);
    let listed = instances(&j);
    let mut per_machine: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in &listed {
        per_machine
            .entry(i["tags"]["jujube-machine-id"].as_str().unwrap().to_string())
            .or_default()
            .push(i["id"].as_str().unwrap().to_string());
    }
    for (id, m) in machines {
        let ids = per_machine.get(id).cloned().unwrap_or_default();
        assert_eq!(ids.len(), 1, "machine {id} has instances {ids:?}");
        assert_eq!(
            m["instance-id"].as_str(),
            Some(ids[0].as_str()),
            "machine {id} records its instance"
        );
    }
    assert_eq!(listed.len(), 101, "no strays left");
    assert!(st.get("strays").is_none(), "{:?}", st.get("strays"));
    drop(ctl);
}
