//! End-to-end tests: they drive the real `jujube` binary, each in its own
//! `JUJUBE_HOME`, and check what a user sees — stdout, exact stderr, exit
//! codes — and that a refused command left the environment unchanged.

mod agents;
mod charmhelpers;
mod ec2;
mod ec2_storage;
mod ha;
mod hooks;
mod input;
mod lxd;
mod lxd_direct;
mod model;
mod ops;
mod postgres;
mod provisioning;
mod supervised;
mod users;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Jujube {
    /// Declared first, dropped first: the controller the harness keeps is
    /// stopped before its home is deleted, or it writes there as the
    /// deletion runs and leaves part of the home behind.
    background: std::cell::RefCell<Option<Controller>>,
    pub home: tempfile::TempDir,
    /// Extra environment for every command (e.g. AWS credentials).
    pub envs: Vec<(String, String)>,
    /// Whether `bootstrap` leaves machine 0's controller running, as it
    /// does for users; most tests start their own (`Jujube::controller`),
    /// after setting what they need, so they bootstrap with
    /// `--manual-controller`.
    pub auto_controller: bool,
    /// Whether a command that needs the controller starts one first when
    /// none runs (as a user would run `jujube controller`); the harness
    /// keeps it until the test takes it with [`Jujube::controller`].
    pub start_controllers: bool,
}

/// Commands that do not talk to a controller.
const LOCAL_COMMANDS: &[&str] = &[
    "bootstrap",
    "environments",
    "switch",
    "destroy-environment",
    "controller",
    "supervise",
    "dummy-cloud",
    "register",
    "login",
    "logout",
    "agent",
    "enroll",
];

#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    #[track_caller]
    pub fn ok(self) -> Run {
        assert_eq!(self.code, 0, "command failed: {}", self.stderr);
        self
    }
}

pub fn charms() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/charms")
}

impl Default for Jujube {
    fn default() -> Jujube {
        Jujube::new()
    }
}

impl Jujube {
    pub fn new() -> Jujube {
        Jujube {
            home: tempfile::tempdir().unwrap(),
            envs: Vec::new(),
            auto_controller: false,
            start_controllers: true,
            background: std::cell::RefCell::new(None),
        }
    }

    pub fn run(&self, args: &[&str]) -> Run {
        self.run_with_input(args, "")
    }

    /// Runs a command with `input` on its standard input (a pipe, not a
    /// terminal).
    pub fn run_with_input(&self, args: &[&str], input: &str) -> Run {
        use std::io::Write;
        if self.start_controllers && args.first().is_some_and(|a| !LOCAL_COMMANDS.contains(a)) {
            if let Some(env) = self.env_of(args) {
                self.ensure_controller(&env);
            }
        }
        let manual = args.first() == Some(&"bootstrap") && !self.auto_controller;
        let mut child = Command::new(env!("CARGO_BIN_EXE_jujube"))
            .args(args)
            .args(manual.then_some("--manual-controller"))
            .env("JUJUBE_HOME", self.home.path())
            .env_remove("JUJUBE_ENV")
            .env_remove("JUJUBE_REPOSITORY")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run jujube");
        let mut stdin = child.stdin.take().expect("a pipe");
        let _ = stdin.write_all(input.as_bytes());
        drop(stdin);
        let out: Output = child.wait_with_output().expect("run jujube");
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    }

    /// Runs a command that must be refused with exactly `stderr`, and checks
    /// that it changed nothing the user can see.
    #[track_caller]
    pub fn refused(&self, args: &[&str], code: i32, stderr: &str) {
        let before = self.settled();
        let r = self.run(args);
        assert_eq!(r.stderr, format!("error: {stderr}\n"), "stderr of {args:?}");
        assert_eq!(r.code, code, "exit code of {args:?}");
        assert_eq!(r.stdout, "", "stdout of {args:?}");
        assert_eq!(before, self.snapshot(), "{args:?} changed state");
    }

    /// A snapshot once the controller's work has settled (two in a row
    /// alike, 200 ms apart), so that a comparison sees only what a command
    /// changed.
    pub fn settled(&self) -> String {
        let t0 = std::time::Instant::now();
        let mut last = self.snapshot();
        loop {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let now = self.snapshot();
            if now == last || t0.elapsed() > std::time::Duration::from_secs(60) {
                return now;
            }
            last = now;
        }
    }

    /// What a user can see of the model, less who leads each service (the
    /// controller elects leaders on its own beat, every 15 s by default)
    /// and the provider's status (what the provisioner's and the harvest's
    /// last calls to the cloud met: a stray being created while the harvest
    /// deletes it is "busy" for a pass): no command under test causes
    /// either.
    pub fn snapshot(&self) -> String {
        let status = self.run(&["status", "--format", "json"]);
        let env = self.run(&["get-constraints"]);
        let cfg = self.run(&["get-environment"]);
        let status = match serde_json::from_str::<serde_json::Value>(&status.stdout) {
            Ok(mut v) => {
                without_leaders(&mut v);
                if let Some(env) = v
                    .pointer_mut("/environment")
                    .and_then(serde_json::Value::as_object_mut)
                {
                    env.remove("provider-status");
                }
                // The singletons lease's expiry moves with every renewal
                // (every 3 s): not a change of the model. Its holder and
                // token stay in.
                if let Some(lease) = v
                    .pointer_mut("/environment/singletons")
                    .and_then(serde_json::Value::as_object_mut)
                {
                    lease.remove("expires-ms");
                }
                serde_json::to_string_pretty(&v).unwrap()
            }
            Err(_) => format!("{}{}", status.stdout, status.stderr),
        };
        format!("{status}\n{}\n{}", env.stdout, cfg.stdout)
    }

    pub fn status(&self) -> serde_json::Value {
        let r = self.run(&["status", "--format", "json"]).ok();
        serde_json::from_str(&r.stdout).unwrap()
    }

    /// Checks that every machine of `st` (a `status`) has exactly one
    /// instance in the dummy cloud, the one it records, and that the cloud
    /// has no other (no stray left).
    pub fn assert_one_instance_per_machine(&self, st: &serde_json::Value) {
        let machines = st["machines"].as_object().unwrap();
        let listed: Vec<serde_json::Value> =
            serde_json::from_str(&self.run(&["dummy-cloud", "list"]).ok().stdout).unwrap();
        let mut per_machine: std::collections::BTreeMap<String, Vec<String>> = Default::default();
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
        assert_eq!(listed.len(), machines.len(), "no strays left");
        assert!(st.get("strays").is_none(), "{:?}", st.get("strays"));
    }

    /// How many machines have a recorded instance.
    pub fn provisioned(&self) -> usize {
        self.status()["machines"].as_object().map_or(0, |ms| {
            ms.values().filter(|m| m["instance-id"].is_string()).count()
        })
    }

    /// The environment a command acts on: its `-e`/`--env`, else the
    /// current one.
    fn env_of(&self, args: &[&str]) -> Option<String> {
        args.windows(2)
            .find(|w| w[0] == "-e" || w[0] == "--env")
            .map(|w| w[1].to_string())
            .or_else(|| {
                std::fs::read_to_string(self.home.path().join("current-environment"))
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .filter(|e| self.home.path().join("environments").join(e).exists())
    }

    /// The pid of the controller holding `env`'s lock, if one runs.
    pub fn controller_pid(&self, env: &str) -> Option<i32> {
        let lock = self
            .home
            .path()
            .join("environments")
            .join(env)
            .join("controller.lock");
        let pid: i32 = std::fs::read_to_string(lock).ok()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let zombie = stat.rsplit(')').next()?.split_whitespace().next()? == "Z";
        (!zombie && cmdline.split(|&b| b == 0).any(|a| a == b"controller")).then_some(pid)
    }

    /// Starts a controller for `env` unless one runs, and waits until it
    /// holds its lock.
    fn ensure_controller(&self, env: &str) {
        if self.controller_pid(env).is_some() {
            return;
        }
        let c = self.spawn_controller(Some(env));
        *self.background.borrow_mut() = Some(c);
    }

    /// Waits (up to 30 s) until a controller holds `env`'s lock, or `c`
    /// has exited.
    fn await_lock(&self, env: Option<&str>, c: &mut Controller) {
        let Some(env) = env.map(str::to_string).or_else(|| self.env_of(&[])) else {
            return;
        };
        let t0 = std::time::Instant::now();
        while self.controller_pid(&env).is_none()
            && c.child.try_wait().ok().flatten().is_none()
            && t0.elapsed() < std::time::Duration::from_secs(30)
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The controller the harness started, while it runs; else starts
    /// `jujube controller` in the background. Killed on drop.
    pub fn controller(&self) -> Controller {
        if let Some(mut c) = self.background.borrow_mut().take() {
            if c.child.try_wait().ok().flatten().is_none() {
                return c;
            }
        }
        self.spawn_controller(None)
    }

    fn spawn_controller(&self, env: Option<&str>) -> Controller {
        let child = Command::new(env!("CARGO_BIN_EXE_jujube"))
            .args(env.map(|e| ["--env", e]).into_iter().flatten())
            .arg("controller")
            .env("JUJUBE_HOME", self.home.path())
            .env_remove("JUJUBE_ENV")
            .env("RUST_LOG", "warn")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("start the controller");
        let mut c = Controller { child };
        self.await_lock(env, &mut c);
        c
    }

    pub fn charm(&self, name: &str) -> String {
        charms().join(name).to_string_lossy().into_owned()
    }
}

/// Takes every `leader` mark (`"leader": true`, not a service named so) out
/// of a status.
fn without_leaders(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("leader").is_some_and(serde_json::Value::is_boolean) {
                m.remove("leader");
            }
            m.values_mut().for_each(without_leaders);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(without_leaders),
        _ => {}
    }
}

pub struct Controller {
    pub child: std::process::Child,
}

impl Controller {
    /// SIGKILL: a crash, as far as the controller can tell.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, and the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id() as i32;
        // SAFETY: sending a signal to our own child process.
        unsafe { libc_kill(pid, 15) };
        self.child.wait().unwrap()
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
