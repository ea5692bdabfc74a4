//! Users, end to end on the dummy: `bootstrap` makes `admin`; a second
//! `JUJUBE_HOME` registers with the string `add-user` printed and reaches
//! the controller only over its API, seeing what its access lets it see;
//! grants and revokes hold from the next command; a controller that cannot
//! be reached is said so in one line, and once its supervisor brings it
//! back nothing is lost.

use crate::hooks::eventually;
use crate::Jujube;

fn pid_in(j: &Jujube, file: &str) -> i32 {
    std::fs::read_to_string(j.home.path().join("environments/t").join(file))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pid in `{file}`"))
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this test's bootstrap started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

#[test]
fn a_registered_read_user_sees_the_model_over_the_api_and_changes_nothing() {
    let mut admin = Jujube::new();
    admin.auto_controller = true;
    admin.run(&["bootstrap", "t"]).ok();
    // Only this home holds admin's password, in a file of its own.
    let accounts = admin.home.path().join("accounts.json");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&accounts).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    admin.run(&["deploy", &admin.charm("mysql")]).ok();
    admin.run(&["wait", "--timeout", "60s"]).ok();

    let added = admin.run(&["add-user", "bob"]).ok();
    assert!(
        added
            .stdout
            .starts_with("User `bob` added with `read` access to environment `t`."),
        "{}",
        added.stdout
    );
    let string = added
        .stdout
        .split_whitespace()
        .last()
        .expect("a registration string")
        .to_string();
    // The string carries no password and no hash.
    let secrets = std::fs::read_to_string(&accounts).unwrap();
    let admin_password = secrets
        .split('"')
        .skip_while(|s| *s != "password")
        .nth(2)
        .unwrap()
        .to_string();
    assert!(!string.contains(&admin_password));

    let bob = Jujube::new();
    let r = bob
        .run_with_input(&["register", &string], "bøbs pässwörd\n")
        .ok();
    assert_eq!(
        r.stdout,
        "registered as `bob` with environment `t`, now the current environment\n"
    );
    // Bob's home has no store: everything goes through the API.
    assert!(!bob.home.path().join("environments/t").exists());
    let st = bob.status();
    assert_eq!(
        st["services"]["mysql"]["units"]["mysql/0"]["agent-status"],
        "started"
    );
    assert_eq!(st["machines"]["0"]["agent-status"], "started");

    // read: refused every change, which changes nothing.
    let before = admin.snapshot();
    for args in [
        vec!["deploy", &admin.charm("wordpress")],
        vec!["add-unit", "mysql"],
        vec!["set", "mysql", "x=1"],
        vec!["destroy-service", "mysql"],
    ] {
        let r = bob.run(&args);
        assert_eq!(r.code, 1, "{args:?}: {r:?}");
        assert_eq!(
            r.stderr,
            "error: user `bob` has `read` access to this environment and this needs `write`; an admin can grant it with `jujube grant bob write`\n"
        );
    }
    let r = bob.run(&["add-user", "eve"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("this needs `admin`"), "{}", r.stderr);
    assert_eq!(before, admin.snapshot());
    // Users: bob sees himself; admin sees both.
    let mine = bob.run(&["users", "--format", "json"]).ok();
    let mine: serde_json::Value = serde_json::from_str(&mine.stdout).unwrap();
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!(mine[0]["access"], "read");
    let all = admin.run(&["users"]).ok();
    assert!(
        all.stdout.contains("admin") && all.stdout.contains("bob"),
        "{}",
        all.stdout
    );

    // The string worked once.
    let again = Jujube::new();
    let r = again.run_with_input(&["register", &string], "other\n");
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "error: registration refused: the registration string is wrong or was used already; ask an admin for a new user (`jujube add-user`)\n");

    // write, from the next command on.
    admin.run(&["grant", "bob", "write"]).ok();
    assert_eq!(
        bob.run(&["add-unit", "mysql"]).ok().stdout,
        "added unit `mysql/1`\n"
    );
    // A charm on bob's side is uploaded with the deploy: the controller
    // keeps its own copy, which is all its agents use.
    let mine = bob.home.path().join("my-wordpress");
    crate::model::copy_dir(&crate::charms().join("wordpress"), &mine);
    let r = bob.run(&["deploy", mine.to_str().unwrap(), "blog"]).ok();
    assert_eq!(
        r.stdout,
        "deployed service `blog` (local:jammy/wordpress-3) with 1 unit(s)\n"
    );
    std::fs::remove_dir_all(&mine).unwrap();
    bob.run(&["add-relation", "blog", "mysql"]).ok();
    bob.run(&["wait", "--timeout", "60s"]).ok();
    let ids = admin
        .run(&["exec", "blog/0", "--", "relation-ids", "db"])
        .ok();
    assert!(ids.stdout.starts_with("db:"), "{}", ids.stdout);
    // The units' logs reach bob through the controller's log sink.
    let log = bob
        .run(&[
            "debug-log",
            "--no-tail",
            "--include",
            "blog/0",
            "--lines",
            "100",
        ])
        .ok()
        .stdout;
    assert!(
        log.lines()
            .any(|l| l.starts_with("blog/0: ") && l.ends_with("hook: install")),
        "{log}"
    );
    assert!(log.lines().all(|l| l.starts_with("blog/0: ")), "{log}");
    // exec is an admin's.
    let r = bob.run(&["exec", "blog/0", "--", "true"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("this needs `admin`"), "{}", r.stderr);

    // A wrong password is refused and keeps the account that works.
    let r = bob.run_with_input(&["login"], "not bobs\n");
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "error: invalid credentials for user `bob`; log in again with `jujube login`\n"
    );
    bob.status();
    // Bob changes his password; it is what logs in from then on.
    bob.run_with_input(&["change-user-password"], "nëw pässword\n")
        .ok();
    bob.status();
    bob.run_with_input(&["login"], "nëw pässword\n").ok();

    // revoke read: bob sees nothing.
    admin.run(&["revoke", "bob", "read"]).ok();
    let r = bob.run(&["status"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "error: user `bob` has `none` access to this environment and this needs `read`; an admin can grant it with `jujube grant bob read`\n");
    admin.run(&["grant", "bob", "read"]).ok();

    // The controller killed, and nothing to restart it yet: bob's commands
    // say where they could not reach it.
    let supervisor = pid_in(&admin, "supervisor.pid");
    let controller = pid_in(&admin, "controller.lock");
    signal(supervisor, libc::SIGSTOP);
    signal(controller, libc::SIGKILL);
    eventually("the controller to be gone", || {
        !std::path::Path::new(&format!("/proc/{controller}")).exists()
            || std::fs::read_to_string(format!("/proc/{controller}/stat"))
                .is_ok_and(|s| s.contains(") Z"))
    });
    let r = bob.run(&["status"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with("error: cannot reach the controller of environment `t` at `unix:"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    // Its supervisor brings it back; nothing was lost.
    signal(supervisor, libc::SIGCONT);
    eventually("the controller to answer bob again", || {
        bob.run(&["status"]).code == 0
    });
    let st = bob.status();
    for u in ["mysql/0", "mysql/1"] {
        assert!(st["services"]["mysql"]["units"][u].is_object(), "{st:#}");
    }
    admin.run(&["destroy-environment", "t", "-y"]).ok();
    assert_eq!(
        std::fs::read_to_string(admin.home.path().join("controllers.json")).unwrap(),
        "{}"
    );
}
