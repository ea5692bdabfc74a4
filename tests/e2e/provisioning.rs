//! Provisioning through the binary: bootstrap, the controller, `wait`,
//! failures and `resolved`, destroy, strays, crashes, destroy-environment.

use crate::Jujube;
use serde_json::Value;

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
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some("bootstrap: starting machine 0 (the controller) on provider `dummy`"),
        "{}",
        r.stderr
    );
    assert_eq!(
        lines[lines.len() - 2..],
        [
            "bootstrap: machine 0 failed to start",
            "error: bootstrap failed: cannot start machine 0: invalid instance spec: no dummy instance type satisfies `mem=1000G` (the largest is 64 cores, 256G memory, 1T root disk)"
        ]
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
    let r = j.run(&["wait", "--timeout", "60s"]);
    assert_eq!(r.code, 1, "wait fails while a machine is in error");
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
    // Starts take 3 s: a wait of 1 s times out naming the machine.
    j.run(&["bootstrap", "t", "--config", "dummy-start-latency=3s"])
        .ok();
    j.run(&["add-machine"]).ok();
    let r = j.run(&["wait", "--timeout", "1s"]);
    assert_eq!(r.code, 1);
    let last = r.stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with(
            "error: timed out after 1s; still waiting: machine 1 has no instance yet (status "
        ),
        "{}",
        r.stderr
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
    assert_eq!(j.run(&["wait", "--timeout", "60s"]).code, 1);
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
    let mut j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["bootstrap", "keep"]).ok();
    j.run(&["switch", "t"]).ok();
    j.run(&["deploy", &j.charm("mysql"), "-n", "2"]).ok();
    let tag = {
        let _ctl = j.controller();
        j.run(&["wait", "--timeout", "60s"]).ok();
        format!("jujube-env-uuid={}", uuid(&j))
    };
    // No controller from here on: instances appear behind jujube's back.
    j.start_controllers = false;
    j.run(&["dummy-cloud", "start", "--tag", &tag]).ok();
    let untagged = j
        .run(&["dummy-cloud", "start"])
        .ok()
        .stdout
        .trim()
        .to_string();
    assert_eq!(instances(&j).len(), 5);
    let before = instances(&j);
    let r = j.run(&["destroy-environment", "t"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "error: destroying environment `t` stops all its instances and deletes its state; add `--yes` to confirm\n");
    assert_eq!(before, instances(&j));
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
    j.assert_one_instance_per_machine(&st);
    drop(ctl);
}

/// Polls (real time: it is another process) until `check` holds.
fn until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..300 {
        if check() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("timed out waiting until {what}");
}

#[test]
fn wait_exits_1_listing_every_machine_in_error() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t", "--config", "dummy-fail-machines=1,3"])
        .ok();
    j.run(&["add-machine", "-n", "3"]).ok();
    let _ctl = j.controller();
    let r = j.run(&["wait", "--timeout", "60s"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let error = &r.stderr[r.stderr.find("error: ").expect(&r.stderr)..];
    assert_eq!(
        error,
        "error: 2 machine(s) in error:\n  machine 1: cannot start machine 1: invalid instance spec: machine 1 is configured to fail (`dummy-fail-machines`)\n  machine 3: cannot start machine 3: invalid instance spec: machine 3 is configured to fail (`dummy-fail-machines`)\nfix the causes, then `jujube resolved MACHINE` or `jujube retry-provisioning --all`\n"
    );
    // Fixed and retried: converged, exit 0.
    j.run(&["set-environment", "dummy-fail-machines="]).ok();
    j.run(&["retry-provisioning", "--all"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
}

#[test]
fn wait_and_bootstrap_show_progress_line_by_line_when_not_on_a_terminal() {
    let j = Jujube::new();
    let r = j.run(&["bootstrap", "t"]).ok();
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some("bootstrap: starting machine 0 (the controller) on provider `dummy`")
    );
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("bootstrap: machine 0 started: instance `i-")
            && last.ends_with(" in zone `zone-a`"),
        "{}",
        r.stderr
    );
    j.run(&["set-environment", "dummy-start-latency=1500ms"])
        .ok();
    j.run(&["deploy", &j.charm("wordpress"), "-n", "2"]).ok();
    let _ctl = j.controller();
    let r = j.run(&["wait", "--timeout", "60s"]).ok();
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with("wait: 1/3 machines started, units 0/2 on started machines; waiting for: machine 1 has no instance yet")),
        "{}",
        r.stderr
    );
    assert_eq!(
        lines.last().copied(),
        Some("wait: 3/3 machines started, units 2/2 on started machines"),
        "{}",
        r.stderr
    );
}

#[test]
fn wait_shows_a_progress_bar_on_a_terminal() {
    // `script` gives the command a pseudo-terminal, as a user's shell would.
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["add-machine", "-n", "2"]).ok();
    let _ctl = j.controller();
    let cmd = format!("{} wait --timeout 60s", env!("CARGO_BIN_EXE_jujube"));
    let out = std::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("JUJUBE_HOME", j.home.path())
        .env_remove("JUJUBE_ENV")
        .output()
        .expect("run `script` (util-linux)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("machines started") && (text.contains('\r') || text.contains("\u{1b}[")),
        "no terminal drawing: {text:?}"
    );
    assert!(
        text.contains("wait: 3/3 machines started, units 0/0 on started machines"),
        "{text:?}"
    );
}

#[test]
fn a_rate_that_never_refills_is_refused() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.refused(
        &["set-environment", "provisioner-rate=1/0"],
        1,
        "invalid provisioner config: `provisioner-rate=1/0`: the refill rate must be above 0 (a bucket that never refills stops provisioning for good); use e.g. `5/2`, or remove the key for no limit",
    );
}

#[test]
fn sigterm_abandons_queued_starts_and_the_next_controller_resumes_them() {
    let j = Jujube::new();
    j.run(&[
        "bootstrap",
        "t",
        "--config",
        "provisioner-concurrency=1",
        "--config",
        "provisioner-batch=1",
    ])
    .ok();
    j.run(&["set-environment", "dummy-start-latency=2s"]).ok();
    j.run(&["add-machine", "-n", "8"]).ok();
    let ctl = j.controller();
    until("a machine is being started", || {
        let st = j.status();
        (1..=8).any(|m| st["machines"][m.to_string()]["status"] == "provisioning")
    });
    let t0 = std::time::Instant::now();
    assert_eq!(ctl.terminate().code(), Some(0));
    let took = t0.elapsed();
    // Machine 0 and the start in flight; the queued ones were abandoned
    // (not started one after the other, 2 s each).
    let started = instances(&j).len();
    assert!(started <= 3, "{started} instances after SIGTERM");
    assert!(took < std::time::Duration::from_secs(8), "{took:?}");
    let st = j.status();
    let pending = (1..=8)
        .filter(|m| st["machines"][m.to_string()]["status"] == "pending")
        .count();
    assert!(pending >= 6, "abandoned starts are pending again: {st:#}");
    let _next = j.controller();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let listed = instances(&j);
    assert_eq!(listed.len(), 9, "one instance per machine");
}

#[test]
fn an_unknown_zone_is_refused_by_the_command_that_sets_it() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    let refusal = "unknown zone `nowhere` in `zones=nowhere`; provider `dummy` has zones `zone-a`, `zone-b`, `zone-c`";
    j.refused(
        &["add-machine", "--constraints", "zones=nowhere"],
        1,
        refusal,
    );
    j.refused(&["set-constraints", "zones=nowhere"], 1, refusal);
    j.refused(
        &["deploy", &j.charm("mysql"), "--constraints", "zones=zone-a,nowhere"],
        1,
        "unknown zone `nowhere` in `zones=zone-a,nowhere`; provider `dummy` has zones `zone-a`, `zone-b`, `zone-c`",
    );
    j.run(&["add-machine", "--constraints", "zones=zone-c"])
        .ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    assert_eq!(j.status()["machines"]["1"]["zone"], "zone-c");
}

#[test]
fn an_unreachable_provider_is_shown_in_status_and_by_wait() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["set-environment", "dummy-unreachable=true"]).ok();
    j.run(&["add-machine"]).ok();
    let _ctl = j.controller();
    until("status shows the provider's problem", || {
        j.status()["environment"].get("provider-status").is_some()
    });
    let st = j.status();
    assert_eq!(
        st["environment"]["provider-status"]["message"],
        "listing zones: transient provider error: the dummy cloud cannot be reached (`dummy-unreachable`)"
    );
    assert_eq!(st["machines"]["1"]["status"], "pending", "not provisioning");
    let table = j.run(&["status"]).ok().stdout;
    assert!(
        table.lines().any(|l| l.starts_with("Provider `dummy` cannot be reached (for ")
            && l.ends_with("s): listing zones: transient provider error: the dummy cloud cannot be reached (`dummy-unreachable`)")),
        "{table}"
    );
    let r = j.run(&["wait", "--timeout", "1s"]);
    assert_eq!(r.code, 1);
    let last = r.stderr.lines().last().unwrap();
    assert!(
        last.starts_with("error: timed out after 1s; still waiting: the provider cannot be reached (for ")
            && last.contains("s): listing zones: transient provider error: the dummy cloud cannot be reached (`dummy-unreachable`); machine 1 has no instance yet (status pending)"),
        "{}",
        r.stderr
    );
    j.run(&["set-environment", "dummy-unreachable=false"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    assert!(st["environment"].get("provider-status").is_none());
    assert!(st["machines"]["1"]["instance-id"].is_string());
}

#[test]
fn an_instance_stopped_behind_our_back_shows_and_resolved_replaces_it() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t", "--config", "harvest-interval=300ms"])
        .ok();
    j.run(&["add-machine"]).ok();
    let _ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    assert_eq!(st["machines"]["1"]["instance-status"], "running");
    let gone = st["machines"]["1"]["instance-id"]
        .as_str()
        .unwrap()
        .to_string();
    j.refused(
        &["dummy-cloud", "stop", "i-nosuch", &gone],
        1,
        "not found: no live instance `i-nosuch` in the dummy cloud; `jujube dummy-cloud list` shows them",
    );
    assert_eq!(instances(&j).len(), 2, "all or nothing");
    let r = j.run(&["dummy-cloud", "stop", &gone]).ok();
    assert_eq!(r.stdout, format!("stopped instance `{gone}`\n"));
    until("machine 1 is in error", || {
        j.status()["machines"]["1"]["status"] == "error"
    });
    let m1 = &j.status()["machines"]["1"];
    assert_eq!(m1["instance-status"], "gone");
    assert_eq!(m1["instance-id"], gone.as_str());
    let why = format!("instance `{gone}` is gone: the cloud no longer has it (stopped or terminated outside jujube); `jujube resolved 1` starts a replacement");
    assert_eq!(m1["status-info"], why.as_str());
    let table = j.run(&["status"]).ok().stdout;
    assert!(table.contains(&format!("{gone} (gone)")), "{table}");
    let r = j.run(&["wait", "--timeout", "60s"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(&format!("  machine 1: {why}\n")),
        "{}",
        r.stderr
    );
    j.run(&["resolved", "1"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let m1 = &j.status()["machines"]["1"];
    assert_eq!(m1["status"], "started");
    assert_eq!(m1["instance-status"], "running");
    assert_ne!(m1["instance-id"], gone.as_str());
}

#[test]
fn destroy_environment_stops_a_running_controller_first() {
    let j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    j.run(&["add-machine", "-n", "2"]).ok();
    let mut ctl = j.controller();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let pid = ctl.child.id();
    let r = j.run(&["destroy-environment", "t", "-y"]).ok();
    assert_eq!(
        r.stdout,
        format!("stopped the controller of `t` (pid {pid})\nstopped 3 instance(s)\ndestroyed environment `t`\n")
    );
    let status = ctl.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "the controller shut down cleanly");
    assert_eq!(j.run(&["environments"]).ok().stdout, "");
}

#[test]
fn a_start_being_retried_says_why_in_status_and_wait() {
    let j = Jujube::new();
    j.run(&[
        "bootstrap",
        "t",
        "--config",
        "dummy-fail-machines=1",
        "--config",
        "dummy-fail-class=transient",
    ])
    .ok();
    j.run(&["add-machine"]).ok();
    let _ctl = j.controller();
    let info = || {
        j.status()["machines"]["1"]["status-info"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    crate::hooks::eventually("the retry said in status", || {
        info().starts_with("start failed, retrying in ")
    });
    assert_eq!(j.status()["machines"]["1"]["status"], "provisioning");
    assert!(
        info().contains("configured to fail (`dummy-fail-machines`)"),
        "{}",
        info()
    );
    // `wait` names it, and does not ask whether a controller runs.
    let r = j.run(&["wait", "--timeout", "1s"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains("machine 1 has no instance yet (provisioning: start failed, retrying in "),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("no controller runs"), "{}", r.stderr);
}

#[test]
fn machine_0s_agent_status_is_started_while_its_controller_answers() {
    let mut j = Jujube::new();
    j.run(&["bootstrap", "t"]).ok();
    let st = j.status();
    assert_eq!(st["machines"]["0"]["agent-status"], "started");
    assert_eq!(
        st["machines"]["0"]["agent-status-info"],
        "its jobs run in the controller"
    );
    // Without one, nothing answers for it: `status` says so.
    assert_eq!(j.controller().terminate().code(), Some(0));
    j.start_controllers = false;
    let r = j.run(&["status"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.ends_with(
            "no controller runs for it on this host: start one with `jujube controller`\n"
        ),
        "{}",
        r.stderr
    );
}
