//! What a user gets from `bootstrap` on the dummy: machine 0's controller
//! left running in the background, with no `jujube controller` in any
//! terminal; started again by its supervisor after `kill -9`, losing
//! nothing; stopped, with its supervisor, by `destroy-environment`.

use crate::hooks::eventually;
use crate::Jujube;

fn pid_in(j: &Jujube, file: &str) -> Option<i32> {
    std::fs::read_to_string(j.home.path().join("environments/t").join(file))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                .map(|state| state != "Z")
        })
        .unwrap_or(false)
}

#[test]
fn bootstrap_leaves_the_controller_running_and_its_supervisor_restarts_it() {
    let mut j = Jujube::new();
    j.auto_controller = true;
    let r = j.run(&["bootstrap", "t"]).ok();
    assert!(
        r.stdout
            .contains("machine 0's controller runs in the background"),
        "{}",
        r.stdout
    );
    let first = pid_in(&j, "controller.lock").expect("the controller's pid");
    let supervisor = pid_in(&j, "supervisor.pid").expect("the supervisor's pid");
    assert!(alive(first) && alive(supervisor));
    assert_eq!(j.status()["machines"]["0"]["agent-status"], "started");

    // The model converges with nobody running a controller by hand.
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let ids = j
        .run(&["exec", "wordpress/0", "--", "relation-ids", "db"])
        .ok();
    assert!(ids.stdout.starts_with("db:"), "{}", ids.stdout);

    // kill -9: the supervisor starts it again; nothing is lost, and the
    // new controller goes on with what is asked of it.
    // SAFETY: kill(2) on the controller this test's bootstrap started.
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    eventually("the supervisor to start the controller again", || {
        pid_in(&j, "controller.lock").is_some_and(|p| p != first && alive(p))
    });
    assert!(alive(supervisor));
    j.run(&["add-unit", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "60s"]).ok();
    let st = j.status();
    for u in ["wordpress/0", "wordpress/1", "mysql/0"] {
        let unit = &st["services"][u.split('/').next().unwrap()]["units"][u];
        assert_eq!(unit["agent-status"], "started", "{u}: {st:#}");
    }
    let ids = j
        .run(&["exec", "wordpress/1", "--", "relation-ids", "db"])
        .ok();
    assert!(ids.stdout.starts_with("db:"), "{}", ids.stdout);

    // destroy-environment stops the supervisor and its controller.
    let second = pid_in(&j, "controller.lock").unwrap();
    let r = j.run(&["destroy-environment", "t", "-y"]).ok();
    assert!(
        r.stdout.contains("stopped the controller's supervisor"),
        "{}",
        r.stdout
    );
    eventually("the supervisor and the controller to end", || {
        !alive(supervisor) && !alive(second)
    });
    assert!(!j.home.path().join("environments/t").exists());
}
