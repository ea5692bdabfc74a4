//! Several controllers on one PostgreSQL (`enable-ha`), on the dummy, on a
//! cluster of the test's own (started with `scripts/pg-setup`, so that it
//! can be restarted under the environment without disturbing other tests):
//! the lease holder killed with -9 in the middle of a 1,000-unit deploy,
//! then PostgreSQL restarted while the deploy goes on; afterwards every
//! machine has exactly one instance, every unit runs, nothing is stuck.

use crate::Jujube;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A throwaway cluster, stopped and deleted when dropped.
struct Cluster {
    state: PathBuf,
    url: String,
    _dir: tempfile::TempDir,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("pg-state");
        let out = std::process::Command::new(script("pg-setup"))
            .arg(&state)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/pg-setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Over TLS, the server's certificate checked against the
        // cluster's authority and its address (as a managed server is
        // reached): the restart below reconnects through a new handshake.
        let dir_of_cluster = std::fs::read_to_string(&state).unwrap();
        let ca = Path::new(dir_of_cluster.lines().nth(1).unwrap()).join("ca.crt");
        let url = format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            String::from_utf8(out.stdout).unwrap().trim(),
            ca.display()
        );
        Cluster {
            state,
            url,
            _dir: dir,
        }
    }

    fn restart(&self) {
        let out = std::process::Command::new(script("pg-restart"))
            .arg(&self.state)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/pg-restart failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(script("pg-stop"))
            .arg(&self.state)
            .status();
    }
}

/// Kills every process of the test's home when dropped (a failing test
/// must not leave supervised controllers behind).
struct Reaper(PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        let mark = format!("JUJUBE_HOME={}", self.0.display());
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
            if env.split(|&b| b == 0).any(|v| v == mark.as_bytes()) {
                // SAFETY: kill(2) on a process this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// A charm whose every hook logs through a hook tool (so that a hook needs
/// its controller), and no peer relation: a thousand units would each
/// track the 999 others.
fn charm(j: &Jujube) -> String {
    use std::os::unix::fs::PermissionsExt;
    let dir = j.home.path().join("charm-ha");
    std::fs::create_dir_all(dir.join("hooks")).unwrap();
    std::fs::write(
        dir.join("metadata.yaml"),
        "name: ha\nsummary: a charm for the fault run\nseries: [jammy]\n",
    )
    .unwrap();
    for hook in ["install", "config-changed", "start", "stop"] {
        let path = dir.join("hooks").join(hook);
        std::fs::write(
            &path,
            "#!/bin/sh\nset -e\njuju-log \"hook: $(basename \"$0\")\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir.display().to_string()
}

fn pid_in(j: &Jujube, file: &str) -> i32 {
    std::fs::read_to_string(j.home.path().join("environments/t").join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// Polls `check` every 200 ms for up to `limit`.
fn within(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn controllers(st: &Value) -> Vec<(String, String, bool)> {
    st["controllers"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    (
                        c["machine"].as_str().unwrap().to_string(),
                        c["state"].as_str().unwrap().to_string(),
                        c["runs-singletons"].as_bool().unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A home whose controllers only their supervisors start (the harness
/// would start machine 0's again after a kill), and whose processes all die
/// with the test.
fn controllers_home() -> (Jujube, Reaper) {
    let mut j = Jujube::new();
    j.auto_controller = true;
    j.start_controllers = false;
    let reaper = Reaper(j.home.path().to_path_buf());
    (j, reaper)
}

/// Waits (40 s: the lease's 15 s and then some) for another controller
/// than `holder` to take the singletons lease, under a token above `token`.
fn lease_taken_from(j: &Jujube, holder: &str, token: i64) {
    within(
        Duration::from_secs(40),
        "another controller to take the lease",
        || {
            let (h, t) = lease(&j.status());
            t > token && h != holder
        },
    );
}

/// Bootstraps environment `t` with its state at `url`, agents told down
/// after 10 s without a word, and `config` (`key=value`) besides.
fn bootstrap_at(j: &Jujube, url: &str, config: &[&str]) {
    let state_url = format!("state-url={url}");
    let mut args = vec!["bootstrap", "t", "--config", &state_url];
    for c in config.iter().chain(&["agent-presence-lapse=10"]) {
        args.extend(["--config", c]);
    }
    j.run(&args).ok();
}

/// Waits for `status` to tell controller machine `seat`'s controller
/// `state`.
fn seat_told(j: &Jujube, seat: i64, state: &str, limit: Duration) {
    within(
        limit,
        &format!("machine {seat}'s controller {state}"),
        || {
            controllers(&j.status())
                .iter()
                .any(|c| c.0 == seat.to_string() && c.1 == state)
        },
    );
}

/// Waits for three controllers to be up.
fn three_up(j: &Jujube) {
    within(Duration::from_secs(60), "three controllers up", || {
        controllers(&j.status())
            .iter()
            .filter(|c| c.1 == "up")
            .count()
            == 3
    });
}

/// The controller machine a lease holder (`machine-N/HOST`) runs on.
fn seat_of(holder: &str) -> i64 {
    holder
        .strip_prefix("machine-")
        .and_then(|h| h.split('/').next())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("holder `{holder}`"))
}

/// Controller machine `seat`'s file in the environment's directory:
/// `controller.lock` for machine 0's, `controller-N.lock` for another's.
fn seat_file(seat: i64, stem: &str, ext: &str) -> String {
    if seat == 0 {
        format!("{stem}.{ext}")
    } else {
        format!("{stem}-{seat}.{ext}")
    }
}

fn lease(st: &Value) -> (String, i64) {
    let l = &st["environment"]["singletons"];
    (
        l["holder"].as_str().unwrap_or_default().to_string(),
        l["token"].as_i64().unwrap_or_default(),
    )
}

#[test]
fn three_controllers_on_postgresql_outlive_the_lease_holder_and_a_database_restart_mid_deploy() {
    let pg = Cluster::start();
    let (j, _reaper) = controllers_home();

    // With the state in a SQLite file, more controllers would all lose it
    // with machine 0: refused, nothing added.
    j.run(&["bootstrap", "lite"]).ok();
    let r = j.run(&["enable-ha", "-e", "lite"]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("needs the environment's state in PostgreSQL"),
        "{}",
        r.stderr
    );
    j.run(&["destroy-environment", "lite", "-y"]).ok();

    bootstrap_at(&j, &pg.url, &[]);
    let r = j.run(&["enable-ha", "-n", "2"]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("must be odd"), "{}", r.stderr);
    let r = j.run(&["enable-ha"]).ok();
    assert!(
        r.stdout.contains("added controller machine `1`"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("added controller machine `2`"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("machine 2's controller runs in the background"),
        "{}",
        r.stdout
    );
    let st = j.status();
    let cs = controllers(&st);
    assert_eq!(
        cs.iter()
            .map(|c| (c.0.as_str(), c.1.as_str()))
            .collect::<Vec<_>>(),
        [("0", "up"), ("1", "up"), ("2", "up")],
        "{st:#}"
    );
    assert_eq!(
        cs.iter().filter(|c| c.2).count(),
        1,
        "one runs the singletons: {cs:?}"
    );
    // Asked again: nothing added, every controller already runs.
    let r = j.run(&["enable-ha", "-n", "3"]).ok();
    assert!(
        r.stdout.contains("has 3 controllers already"),
        "{}",
        r.stdout
    );

    j.run(&["deploy", &charm(&j), "-n", "1000"]).ok();
    within(
        Duration::from_secs(300),
        "the deploy to get under way",
        || j.provisioned() >= 100,
    );

    // The lease holder's machine dies: its supervisor and its controller
    // killed with -9, in the middle of the deploy.
    let (holder, token) = lease(&j.status());
    let seat = seat_of(&holder);
    let (sup, ctl) = (
        seat_file(seat, "supervisor", "pid"),
        seat_file(seat, "controller", "lock"),
    );
    let before = j.provisioned();
    let started = |st: &Value| {
        st["services"]["ha"]["units"].as_object().map_or(0, |us| {
            us.values()
                .filter(|u| u["agent-status"] == "started")
                .count()
        })
    };
    let started_before = started(&j.status());
    // SAFETY: kill(2) on the supervisor and controller this test started.
    unsafe {
        assert_eq!(libc::kill(pid_in(&j, &sup), libc::SIGKILL), 0);
        assert_eq!(libc::kill(pid_in(&j, &ctl), libc::SIGKILL), 0);
    }
    // Another takes over once the lease has expired (15 s), under a new
    // token; the client reaches a live controller meanwhile.
    lease_taken_from(&j, &holder, token);
    let st = j.status();
    assert!(
        before < 1003 || started_before < 1000,
        "the kill must land in the middle of the deploy ({before} machines provisioned and {started_before} units started when it did)"
    );

    // PostgreSQL restarted while the deploy goes on: controllers and
    // agents reconnect and finish.
    within(
        Duration::from_secs(300),
        "the deploy to go on under the new holder",
        || {
            let st = j.status();
            started(&st) > started_before || j.provisioned() > before
        },
    );
    pg.restart();
    // Units whose hook ran in the killed controller are in error: as the
    // spec says of a unit agent killed in a hook, the hook failed and
    // waits for the user. At most as many as a process runs hooks at once
    // (four per core); nothing else fails (the restart is waited out, not
    // reported).
    // An agent finds its interrupted hook when it next runs, which may be
    // after a `resolved`: wait, resolve what `wait` names, until nothing is
    // left.
    let mut failed = std::collections::BTreeSet::new();
    for _ in 0..5 {
        let r = j.run(&["wait", "--timeout", "900s"]);
        if r.code == 0 {
            break;
        }
        let now: Vec<String> = r
            .stderr
            .lines()
            .filter_map(|l| l.trim().strip_prefix("unit `")?.split_once('`'))
            .map(|(unit, why)| {
                assert!(why.contains("hook failed"), "{unit}{why}");
                unit.to_string()
            })
            .collect();
        assert!(
            !now.is_empty(),
            "wait failed with no unit in error: {}",
            r.stderr
        );
        let st = j.status();
        for u in &now {
            eprintln!(
                "{u} as status shows it: {}",
                st["services"]["ha"]["units"][u]
            );
        }
        failed.extend(now);
        j.run(&["resolved", "--all", "--retry"]).ok();
    }
    eprintln!("{} units' hooks were interrupted by the kill", failed.len());
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    assert!(
        failed.len() <= 4 * cores,
        "{} units in error: {failed:?}",
        failed.len()
    );
    j.run(&["wait", "--timeout", "600s"]).ok();

    let st2 = j.status();
    let machines = st2["machines"].as_object().unwrap();
    assert_eq!(
        machines.len(),
        1003,
        "1,000 unit machines and 3 controllers"
    );
    j.assert_one_instance_per_machine(&st2);
    let units = st2["services"]["ha"]["units"].as_object().unwrap();
    assert_eq!(units.len(), 1000);
    for (name, u) in units {
        assert_eq!(u["agent-status"], "started", "{name}: {u}");
    }
    // The lease moved once, at the kill: not between live controllers under
    // the deploy's load, nor across the restart.
    assert_eq!(lease(&st2).1, token + 1, "{:?}", lease(&st2));
    // The killed controller is told down; the new holder runs the jobs.
    let cs = controllers(&st2);
    let dead = cs.iter().find(|c| c.0 == seat.to_string()).unwrap();
    assert_eq!(dead.1, "down", "{cs:?} {st}");
    assert!(cs.iter().any(|c| c.2 && c.0 != seat.to_string()), "{cs:?}");

    j.run(&["destroy-environment", "t", "-y"]).ok();
}

/// Agents installed when machine 0's controller was the only one follow the
/// controllers `enable-ha` adds (their `agent.conf` too, for their next
/// start), and go on through them when machine 0's controller dies.
#[test]
fn agents_follow_controllers_added_after_them_and_fail_over_to_them() {
    let pg = Cluster::start();
    let (j, _reaper) = controllers_home();
    bootstrap_at(&j, &pg.url, &["dummy-agents=process"]);
    j.run(&["deploy", &charm(&j), "-n", "2"]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let agents = j.home.path().join("environments/t/agents");
    let held = |m: &str| -> Vec<String> {
        let conf: Value = serde_json::from_slice(
            &std::fs::read(agents.join(format!("machine-{m}/agent.conf"))).unwrap(),
        )
        .unwrap();
        serde_json::from_value(conf["api-addresses"].clone()).unwrap()
    };
    let st = j.status();
    let machines: Vec<String> = st["services"]["ha"]["units"]
        .as_object()
        .unwrap()
        .values()
        .map(|u| u["machine"].as_str().unwrap().to_string())
        .collect();
    let served = |st: &Value| -> Vec<String> {
        st["controllers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c["addresses"].as_array().cloned().unwrap_or_default())
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let first = served(&st);
    for m in &machines {
        let mut h = held(m);
        h.sort();
        let mut f = first.clone();
        f.sort();
        assert_eq!(
            h, f,
            "machine {m}'s agent starts with machine 0's controller"
        );
    }

    j.run(&["enable-ha"]).ok();
    three_up(&j);
    let all = served(&j.status());
    assert!(all.len() > first.len(), "{all:?}");
    within(
        Duration::from_secs(60),
        "every agent to follow the controllers",
        || {
            machines
                .iter()
                .all(|m| all.iter().all(|a| held(m).contains(a)))
        },
    );
    // Machine 0's own addresses stay first: the agents are connected there.
    for m in &machines {
        assert_eq!(held(m)[..first.len()], first[..], "machine {m}");
    }

    // Machine 0's controller dies with its supervisor; the agents' next
    // connections go to the others, and a command run on a unit (which its
    // agent must fetch and answer through the API) comes back, told every
    // controller's address as hooks are.
    // SAFETY: kill(2) on the supervisor and controller this test started.
    unsafe {
        assert_eq!(libc::kill(pid_in(&j, "supervisor.pid"), libc::SIGKILL), 0);
        assert_eq!(libc::kill(pid_in(&j, "controller.lock"), libc::SIGKILL), 0);
    }
    let st = j.status();
    for u in st["services"]["ha"]["units"].as_object().unwrap().keys() {
        let r = j.run(&[
            "run",
            u,
            "--timeout",
            "120s",
            "--",
            "sh",
            "-c",
            "echo still-here $JUJU_API_ADDRESSES",
        ]);
        assert_eq!(r.code, 0, "{u}: {}", r.stderr);
        assert!(r.stdout.contains("still-here"), "{u}: {}", r.stdout);
        for a in &all {
            assert!(
                r.stdout.contains(a.as_str()),
                "{u} is not told `{a}`: {}",
                r.stdout
            );
        }
    }
    j.run(&["destroy-environment", "t", "-y"]).ok();
}

/// A TCP proxy in front of the cluster that can cut one process off the
/// database: its connections closed, and each new one it makes closed as
/// soon as it is accepted (the database unreachable for it alone, as a
/// machine behind a broken link sees it). Connections are told apart by the
/// client socket's inode, which names its owner in `/proc/PID/fd`.
struct Proxy {
    port: u16,
    cut: std::sync::Arc<std::sync::Mutex<Option<i32>>>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<(u64, std::net::TcpStream)>>>,
}

/// The inode of the loopback socket bound to `port` whose peer is `peer`.
fn socket_inode(port: u16, peer: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let (local, remote) = (
        format!("0100007F:{port:04X}"),
        format!("0100007F:{peer:04X}"),
    );
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&local.as_str()) && f.get(2) == Some(&remote.as_str()))
            .then(|| f.get(9)?.parse().ok())
            .flatten()
    })
}

/// The socket inodes process `pid` holds.
fn sockets_of(pid: i32) -> std::collections::HashSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let l = std::fs::read_link(e.path()).ok()?;
            l.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

impl Proxy {
    fn start(to: u16) -> Proxy {
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxy = Proxy {
            port,
            cut: Default::default(),
            conns: Default::default(),
        };
        let (cut, conns) = (proxy.cut.clone(), proxy.conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let peer = client.peer_addr().unwrap().port();
                let inode = socket_inode(peer, port).unwrap_or(0);
                if let Some(pid) = *cut.lock().unwrap() {
                    if sockets_of(pid).contains(&inode) {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
                conns
                    .lock()
                    .unwrap()
                    .push((inode, client.try_clone().unwrap()));
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        proxy
    }

    /// `url` with the proxy's port for the cluster's.
    fn url(&self, url: &str) -> String {
        let (head, rest) = url.rsplit_once("@127.0.0.1:").unwrap();
        let tail = &rest[rest.find('/').unwrap()..];
        format!("{head}@127.0.0.1:{}{tail}", self.port)
    }

    /// Cuts process `pid` off: what it holds closed, what it opens refused.
    fn cut(&self, pid: i32) {
        *self.cut.lock().unwrap() = Some(pid);
        let held = sockets_of(pid);
        let mut conns = self.conns.lock().unwrap();
        conns.retain(|(inode, s)| {
            if held.contains(inode) {
                let _ = s.shutdown(std::net::Shutdown::Both);
                false
            } else {
                true
            }
        });
    }

    fn heal(&self) {
        *self.cut.lock().unwrap() = None;
    }
}

/// The controller holding the singletons lease cut off from the database
/// (the others still reach it): it stops its singleton jobs and does not
/// die, another takes the lease, the deploy goes on; healed, it serves
/// again without taking the lease back.
#[test]
fn a_controller_cut_off_from_the_database_stops_its_singleton_jobs() {
    let pg = Cluster::start();
    let port: u16 = pg.url.rsplit_once("@127.0.0.1:").unwrap().1[..5]
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap();
    let proxy = Proxy::start(port);
    let (j, _reaper) = controllers_home();
    bootstrap_at(&j, &proxy.url(&pg.url), &[]);
    j.run(&["enable-ha"]).ok();
    three_up(&j);
    j.run(&["deploy", &charm(&j), "-n", "30"]).ok();

    let (holder, token) = lease(&j.status());
    let seat = seat_of(&holder);
    let (lock, log) = (
        seat_file(seat, "controller", "lock"),
        seat_file(seat, "controller", "log"),
    );
    let pid = pid_in(&j, &lock);
    let log = j.home.path().join("environments/t").join(log);
    let logged_before = std::fs::read_to_string(&log).unwrap().len();
    proxy.cut(pid);

    lease_taken_from(&j, &holder, token);
    within(
        Duration::from_secs(30),
        "the cut controller to stop its jobs",
        || {
            let text = std::fs::read_to_string(&log).unwrap();
            text[logged_before..].contains("stopping the singleton jobs")
                || text[logged_before..].contains("singleton jobs stopped")
        },
    );
    seat_told(&j, seat, "down", Duration::from_secs(30));
    // SAFETY: signal 0 only checks that the process exists.
    assert_eq!(unsafe { libc::kill(pid, 0) }, 0, "the cut controller died");

    proxy.heal();
    seat_told(&j, seat, "up", Duration::from_secs(60));
    j.run(&["wait", "--timeout", "300s"]).ok();
    let st = j.status();
    j.assert_one_instance_per_machine(&st);
    let units = st["services"]["ha"]["units"].as_object().unwrap();
    assert_eq!(units.len(), 30);
    for (name, u) in units {
        assert_eq!(u["agent-status"], "started", "{name}: {u}");
        // What the cut controller's machine agents still had to report
        // once it was healed is refused (their lease was lost), not
        // written over what the new holder's agents reported.
        let m = u["machine"].as_str().unwrap();
        let machine = &st["machines"][m];
        assert_eq!(machine["agent-status"], "started", "machine {m}: {machine}");
    }
    // The lease moved once, at the cut: the healed controller waits.
    let (h, t) = lease(&st);
    assert_eq!(t, token + 1, "{h}");
    assert_eq!(
        unsafe { libc::kill(pid, 0) },
        0,
        "the healed controller died"
    );
    j.run(&["destroy-environment", "t", "-y"]).ok();
}
