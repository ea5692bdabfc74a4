//! The LXD provider against a real LXD daemon (prepared by
//! `scripts/lxd-setup`; `scripts/test` runs it). These tests fail when the
//! daemon is not there; `JUJUBE_SKIP_LXD=1` skips them knowingly. Each test
//! works in environments with UUIDs of its own, so tests running at once
//! never see each other's containers.

use crate::hooks::{in_order, MYSQL_ORDER, WORDPRESS_ORDER};
use crate::lxd_direct::{create_directly, delete_directly, launch_directly, ALIAS};
use crate::Jujube;
use jujube_core::Constraints;
use jujube_providers::conformance::{run_all, Subject};
use jujube_providers::lxd::client::Client;
use jujube_providers::lxd::client::Method;
use jujube_providers::lxd::LxdProvider;
use jujube_providers::{ErrorClass, Provider};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const SOCKET: &str = "/var/lib/lxd/unix.socket";

/// None when the LXD tests are skipped on purpose; panics when the daemon is
/// simply not there.
fn lxd() -> Option<Client> {
    if std::env::var("JUJUBE_SKIP_LXD").as_deref() == Ok("1") {
        eprintln!("JUJUBE_SKIP_LXD=1: skipping an LXD test");
        return None;
    }
    if std::os::unix::net::UnixStream::connect(SOCKET).is_err() {
        panic!("no LXD daemon answers at {SOCKET}: run `scripts/lxd-setup` (scripts/test does), or set JUJUBE_SKIP_LXD=1 to skip the LXD tests knowingly");
    }
    Some(Client::unix(SOCKET))
}

/// Where `scripts/lxd-setup` left the TLS files.
fn tls_dir() -> PathBuf {
    std::env::var_os("JUJUBE_LXD_TLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/lxd-setup/tls")
        })
}

fn config(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut c: BTreeMap<String, String> = [("image-alias", ALIAS)]
        .into_iter()
        .chain(extra.iter().copied())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    c.retain(|_, v| !v.is_empty());
    c
}

fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn short(uuid: &str) -> String {
    uuid.replace('-', "")[..8].to_string()
}

fn subject(provider: Arc<dyn Provider>, env_uuid: String, other: Arc<dyn Provider>) -> Subject {
    Subject {
        provider,
        env_uuid,
        other,
        satisfiable: Constraints::parse("cores=1 mem=128M root-disk=1G").unwrap(),
        unsatisfiable: Constraints::parse("mem=100000G").unwrap(),
        series: "jammy".into(),
        settle: Duration::from_secs(5),
    }
}

/// Runs the conformance suite for an environment on the daemon reached
/// with `ours`; the other environment talks over the socket. The sweep is
/// returned so that callers check what is left before it cleans up.
async fn conformance(ours: BTreeMap<String, String>) -> (Subject, Sweep) {
    let (a, b) = (uuid(), uuid());
    let sweep = Sweep {
        uuids: vec![a.clone(), b.clone()],
        names: vec![],
    };
    let s = subject(
        Arc::new(LxdProvider::new(&a, &ours).unwrap()),
        a.clone(),
        Arc::new(LxdProvider::new(&b, &config(&[])).unwrap()),
    );
    let failures = run_all(&s).await;
    assert!(failures.is_empty(), "{failures:#?}");
    (s, sweep)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lxd_passes_the_conformance_suite_over_the_unix_socket() {
    let Some(_) = lxd() else { return };
    let (s, _sweep) = conformance(config(&[])).await;
    assert!(s.provider.instances().await.unwrap().is_empty());
}

fn https_config(cert: &str) -> BTreeMap<String, String> {
    let d = tls_dir();
    let p = |f: &str| d.join(f).to_string_lossy().into_owned();
    config(&[
        ("lxd-url", "https://127.0.0.1:8443"),
        ("lxd-client-cert", &p(&format!("{cert}.crt"))),
        ("lxd-client-key", &p(&format!("{cert}.key"))),
        ("lxd-server-cert", &p("server.crt")),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lxd_passes_the_conformance_suite_over_https_with_a_client_certificate() {
    let Some(_) = lxd() else { return };
    // One daemon, two ways: ours over HTTPS, the other over the socket.
    conformance(https_config("client")).await;
}

#[tokio::test]
async fn https_refuses_an_untrusted_client_and_a_server_that_is_not_the_pinned_one() {
    let Some(_) = lxd() else { return };
    // A client certificate the daemon does not trust.
    let p = LxdProvider::new(&uuid(), &https_config("stranger")).unwrap();
    let e = p.instances().await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Credentials, "{e}");
    assert!(e.to_string().contains("trust"), "{e}");
    // A pinned server certificate that is not the daemon's.
    let mut cfg = https_config("client");
    cfg.insert(
        "lxd-server-cert".into(),
        tls_dir()
            .join("stranger.crt")
            .to_string_lossy()
            .into_owned(),
    );
    let p = LxdProvider::new(&uuid(), &cfg).unwrap();
    let e = p.instances().await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Credentials, "{e}");
    assert!(e.to_string().contains("lxd-server-cert"), "{e}");
}

/// The container's record, or None if it does not exist.
async fn container(c: &Client, name: &str) -> Option<Value> {
    match c.get(&format!("/1.0/instances/{name}")).await.unwrap() {
        Ok(v) => Some(v),
        Err(e) if e.code == 404 => None,
        Err(e) => panic!("{name}: {e:?}"),
    }
}

/// Deletes, when dropped (a failed assertion included), every container
/// carrying one of the test's UUIDs and the named ones, so a failing test
/// leaves nothing running.
struct Sweep {
    uuids: Vec<String>,
    names: Vec<String>,
}

impl Sweep {
    /// What sweeps environment `uuid`'s containers.
    fn of(uuid: &str) -> Sweep {
        Sweep {
            uuids: vec![uuid.to_string()],
            names: vec![],
        }
    }
}

/// A provider for a new environment UUID, and what sweeps its containers.
fn fresh_provider() -> (String, Sweep, LxdProvider) {
    let env_uuid = uuid();
    let p = LxdProvider::new(&env_uuid, &config(&[])).unwrap();
    (env_uuid.clone(), Sweep::of(&env_uuid), p)
}

impl Drop for Sweep {
    fn drop(&mut self) {
        let (uuids, names) = (self.uuids.clone(), self.names.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let c = Client::unix(SOCKET);
                let mut all = names;
                for u in &uuids {
                    all.extend(tagged(&c, u).await);
                }
                for n in all {
                    delete_directly(&c, &n).await;
                }
            })
        })
        .join()
        .unwrap();
    }
}

/// Polls the daemon (real time: it is a real daemon) until `name` is gone.
async fn until_gone(c: &Client, name: &str) -> bool {
    for _ in 0..100 {
        if container(c, name).await.is_none() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Names of every container carrying `uuid`, whatever its name.
async fn tagged(c: &Client, uuid: &str) -> Vec<String> {
    let list = c.get("/1.0/instances?recursion=1").await.unwrap().unwrap();
    let mut names: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["config"]["user.jujube-env-uuid"].as_str() == Some(uuid))
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

fn lxd_jujube(env: &str, extra: &[&str]) -> (Jujube, String) {
    let j = Jujube::new();
    let mut args = vec![
        "bootstrap",
        env,
        "--provider",
        "lxd",
        "--config",
        "image-alias=jujube-test",
        // The busybox test image runs no agents: these are provider tests.
        "--config",
        "lxd-agents=in-process",
    ];
    args.extend_from_slice(extra);
    j.run(&args).ok();
    let uuid = j.status()["environment"]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    (j, uuid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lxd_end_to_end_through_the_binary() {
    let Some(c) = lxd() else { return };
    // The controller runs from the first command, before the strays below
    // exist: the harvest lists the cloud every 2 s to find them.
    let (j, env_uuid) = lxd_jujube(
        "lx",
        &[
            "--config",
            "harvest-grace=0s",
            "--config",
            "harvest-interval=2s",
        ],
    );
    let prefix = format!("jujube-{}-", short(&env_uuid));

    // Bootstrap provisioned machine 0 as a running, tagged container.
    let st = j.status();
    assert_eq!(
        st["machines"]["0"]["instance-id"],
        json!(format!("{prefix}0"))
    );
    let m0 = container(&c, &format!("{prefix}0"))
        .await
        .expect("machine 0's container");
    assert_eq!(m0["status"], "Running");
    assert_eq!(m0["config"]["user.jujube-env-uuid"], json!(env_uuid));
    assert_eq!(m0["config"]["user.jujube-machine-id"], "0");
    assert_eq!(m0["config"]["user.jujube-controller"], "true");

    // Look-alikes, made directly: our name prefix without the UUID, and the
    // UUID under a name without the prefix. Neither is ever touched. A
    // stray that IS ours (both) shows that reaping does run.
    let lookalike = format!("{prefix}99");
    let foreign_name = format!("other-{}", short(&env_uuid));
    let stray = format!("{prefix}77");
    let _sweep = Sweep {
        uuids: vec![env_uuid.clone()],
        names: vec![lookalike.clone(), foreign_name.clone()],
    };
    launch_directly(&c, &lookalike, json!({"user.jujube-machine-id": "99"})).await;
    launch_directly(
        &c,
        &foreign_name,
        json!({"user.jujube-env-uuid": env_uuid, "user.jujube-machine-id": "98"}),
    )
    .await;
    // Created, not started: the harvest may reap it as soon as it exists
    // (a start would race its deletion).
    create_directly(
        &c,
        &stray,
        json!({"user.jujube-env-uuid": env_uuid, "user.jujube-machine-id": "77"}),
    )
    .await;

    // Keys LXD cannot honour are refused before anything changes.
    let unsupported = "invalid instance spec: the lxd provider does not support constraint(s) `instance-type`, `tags`; it honours `arch`, `cores`, `mem`, `root-disk` and `zones`";
    j.refused(
        &[
            "deploy",
            &j.charm("mysql"),
            "--constraints",
            "instance-type=m5.large tags=x",
        ],
        1,
        unsupported,
    );
    j.refused(
        &["set-constraints", "instance-type=m5.large", "tags=x"],
        1,
        unsupported,
    );
    j.refused(
        &["add-machine", "--constraints", "virt-type=kvm"],
        1,
        "invalid instance spec: the lxd provider does not support constraint(s) `virt-type`; it honours `arch`, `cores`, `mem`, `root-disk` and `zones`",
    );

    j.run(&[
        "deploy",
        &j.charm("mysql"),
        "-n",
        "3",
        "--constraints",
        "cores=1 mem=256M root-disk=2G",
    ])
    .ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let st = j.status();
    for m in ["1", "2", "3"] {
        let name = format!("{prefix}{m}");
        assert_eq!(st["machines"][m]["instance-id"], json!(name));
        let v = container(&c, &name)
            .await
            .unwrap_or_else(|| panic!("{name} exists"));
        assert_eq!(v["status"], "Running", "{name}");
        assert_eq!(v["config"]["limits.cpu"], "1", "{name}");
        assert_eq!(v["config"]["limits.memory"], "256MiB", "{name}");
        assert_eq!(v["devices"]["root"]["size"], "2048MiB", "{name}");
        assert_eq!(v["config"]["user.jujube-machine-id"], json!(m));
        assert_eq!(
            st["machines"][m]["hardware"],
            "arch=amd64 cores=1 mem=256M root-disk=2G"
        );
    }
    // The harvest (grace 0) reaps our stray and nothing else.
    assert!(until_gone(&c, &stray).await, "our stray reaped");
    assert!(
        container(&c, &lookalike).await.is_some(),
        "look-alike name survives"
    );
    assert!(
        container(&c, &foreign_name).await.is_some(),
        "foreign name survives"
    );

    // Destroy: the container is deleted and the machine removed.
    j.run(&["destroy-unit", "mysql/0"]).ok();
    j.run(&["destroy-machine", "1"]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    assert!(j.status()["machines"].get("1").is_none());
    assert!(
        container(&c, &format!("{prefix}1")).await.is_none(),
        "machine 1's container deleted"
    );
    drop(ctl);

    j.run(&["destroy-environment", "lx", "-y"]).ok();
    let left: Vec<String> = tagged(&c, &env_uuid)
        .await
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "environment's containers left: {left:?}");
    assert!(
        container(&c, &lookalike).await.is_some(),
        "look-alike survives destroy-environment"
    );
    assert!(
        container(&c, &foreign_name).await.is_some(),
        "foreign name survives destroy-environment"
    );
    delete_directly(&c, &lookalike).await;
    delete_directly(&c, &foreign_name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_image_alias_is_a_provisioning_error_and_resolved_recovers() {
    let Some(c) = lxd() else { return };
    let (j, env_uuid) = lxd_jujube(
        "lx",
        &["--config", "image-aliases=noble:jujube-no-such-image"],
    );
    let prefix = format!("jujube-{}-", short(&env_uuid));
    let _sweep = Sweep::of(&env_uuid);
    let ctl = j.controller();
    j.run(&["add-machine", "--series", "noble"]).ok();
    j.run(&["add-machine", "--series", "jammy"]).ok();
    let r = j.run(&["wait", "--timeout", "120s"]);
    assert_eq!(
        r.code, 1,
        "wait fails while machine 1 is in error: {}",
        r.stderr
    );
    let st = j.status();
    assert_eq!(st["machines"]["1"]["status"], "error", "{st:#}");
    let info = st["machines"]["1"]["status-info"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        info.contains("`jujube-no-such-image`") && info.contains("image-aliases="),
        "{info}"
    );
    assert!(st["machines"]["1"]
        .get("instance-id")
        .is_none_or(Value::is_null));
    assert!(container(&c, &format!("{prefix}1")).await.is_none());
    // The jammy machine is unaffected.
    assert_eq!(
        st["machines"]["2"]["instance-id"],
        json!(format!("{prefix}2"))
    );

    // Fix the config, mark the machine resolved: the controller retries.
    j.run(&["set-environment", "image-aliases=noble:jujube-test"])
        .ok();
    j.run(&["resolved", "1"]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let st = j.status();
    assert_eq!(
        st["machines"]["1"]["instance-id"],
        json!(format!("{prefix}1")),
        "{st:#}"
    );
    let v = container(&c, &format!("{prefix}1")).await.unwrap();
    assert_eq!(v["status"], "Running");
    drop(ctl);
    j.run(&["destroy-environment", "lx", "-y"]).ok();
    assert!(tagged(&c, &env_uuid).await.is_empty());
}

fn start_spec(machine: &str, nonce: &str) -> jujube_providers::StartSpec {
    jujube_providers::StartSpec {
        machine_id: machine.into(),
        nonce: nonce.into(),
        series: "jammy".into(),
        constraints: Constraints::new(),
        zone: None,
        controller: false,
        user_data: String::new(),
        agent: None,
    }
}

/// A controller machine's container (`enable-ha`) is made with machine 0's
/// proxy devices (the daemon, the state database, its API on the daemon's
/// host at the install's address) and gets the controller's files, root's
/// alone, and no agent. A host port already taken fails the start as
/// transient (the next attempt draws another) and leaves no container; a
/// retry of an attempt whose container exists makes its devices as the
/// retry says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_machines_container_gets_machine_0s_devices_and_a_taken_port_is_transient() {
    let Some(c) = lxd() else { return };
    let (_, _sweep, p) = fresh_provider();
    let dir = tempfile::tempdir().unwrap();
    let binary = dir.path().join("jujube");
    std::fs::write(&binary, "#!/bin/sh\nexit 0\n").unwrap();
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let kept = "/var/lib/jujube/home/environments/e/tls/ca.crt";
    let spec = |nonce: &str, port: u16| jujube_providers::StartSpec {
        controller: true,
        agent: Some(jujube_providers::AgentInstall {
            conf: Vec::new(),
            binary: binary.clone(),
            api_connect: String::new(),
            other_controllers: Vec::new(),
            enrollment: None,
            controller: Some(jujube_providers::ControllerInstall {
                files: vec![(kept.to_string(), b"not a secret\n".to_vec(), 0o600)],
                api_listen: format!("127.0.0.1:{port}"),
                state_db: Some("127.0.0.1:5999".into()),
                take_up: None,
            }),
        }),
        ..start_spec("1", nonce)
    };

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = p.start_instance(&spec("n-a", port)).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Transient, "{e}");
    let name = p.container_name("1");
    assert!(
        until_gone(&c, &name).await,
        "the failed start left `{name}`"
    );
    drop(taken);

    let port = free_port();
    let i = p.start_instance(&spec("n-b", port)).await.unwrap();
    assert_eq!(i.id, name);
    let v = container(&c, &name).await.unwrap();
    let devices = &v["devices"];
    assert_eq!(devices["jujube-api-host"]["bind"], "host", "{devices}");
    assert_eq!(
        devices["jujube-api-host"]["listen"],
        format!("tcp:127.0.0.1:{port}")
    );
    assert_eq!(devices["jujube-api-host"]["connect"], "tcp:127.0.0.1:17070");
    assert_eq!(devices["jujube-state-db"]["listen"], "tcp:127.0.0.1:5999");
    assert_eq!(devices["jujube-lxd"]["listen"], "tcp:127.0.0.1:8443");
    assert!(
        devices["jujube-api"].is_null(),
        "an agent's socket: {devices}"
    );
    assert_eq!(file_in(&c, &name, kept).await, "not a secret\n");
    assert!(
        roots_alone(&c, &name, kept).await,
        "the controller's files are not root's alone"
    );
    assert!(!has_agent(&c, &name).await);

    // The same attempt again, told another port: its devices follow.
    let moved = free_port();
    p.start_instance(&spec("n-b", moved)).await.unwrap();
    let v = container(&c, &name).await.unwrap();
    assert_eq!(
        v["devices"]["jujube-api-host"]["listen"],
        format!("tcp:127.0.0.1:{moved}")
    );
    p.stop_instances(std::slice::from_ref(&name)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_adopts_its_own_container_replaces_a_leftover_and_refuses_a_squatter() {
    let Some(c) = lxd() else { return };
    let env_uuid = uuid();
    let prefix = format!("jujube-{}-", short(&env_uuid));
    let squatter = format!("{prefix}3");
    let _sweep = Sweep {
        uuids: vec![env_uuid.clone()],
        names: vec![squatter.clone()],
    };
    let p = LxdProvider::new(&env_uuid, &config(&[])).unwrap();

    // A start whose container exists but was stopped (say the daemon
    // restarted between create and start) adopts and starts it.
    let first = p.start_instance(&start_spec("1", "nonce-a")).await.unwrap();
    c.run(
        Method::PUT,
        &format!("/1.0/instances/{}/state", first.id),
        Some(&json!({"action": "stop", "force": true})),
    )
    .await
    .unwrap()
    .unwrap();
    let again = p.start_instance(&start_spec("1", "nonce-a")).await.unwrap();
    assert_eq!(again.id, first.id);
    let v = container(&c, &first.id).await.unwrap();
    assert_eq!(v["status"], "Running");
    assert_eq!(v["config"]["user.jujube-nonce"], "nonce-a");
    let first_uuid = v["config"]["volatile.uuid"].clone();
    assert!(first_uuid.is_string());

    // The same machine started with a new nonce (after `resolved`): the
    // leftover of the earlier start is replaced, not kept beside it.
    let replaced = p.start_instance(&start_spec("1", "nonce-b")).await.unwrap();
    assert_eq!(replaced.id, first.id);
    assert_eq!(replaced.nonce(), Some("nonce-b"));
    let v = container(&c, &first.id).await.unwrap();
    assert_eq!(v["config"]["user.jujube-nonce"], "nonce-b");
    assert_ne!(
        v["config"]["volatile.uuid"], first_uuid,
        "a new container, not the old one relabelled"
    );
    assert_eq!(v["status"], "Running");

    // A container with our name but without our UUID is someone else's:
    // the start is refused and the container left alone.
    launch_directly(&c, &squatter, json!({"user.jujube-machine-id": "3"})).await;
    let e = p
        .start_instance(&start_spec("3", "nonce-c"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::InvalidSpec, "{e}");
    assert!(e.to_string().contains("does not own"), "{e}");
    let v = container(&c, &squatter)
        .await
        .expect("the squatter survives");
    assert_eq!(v["status"], "Running");
    assert!(v["config"].get("user.jujube-nonce").is_none());
    // Nor does a stop of its name touch it.
    p.stop_instances(std::slice::from_ref(&squatter))
        .await
        .unwrap();
    assert!(container(&c, &squatter).await.is_some());

    p.stop_instances(std::slice::from_ref(&first.id))
        .await
        .unwrap();
    assert!(container(&c, &first.id).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_mid_provisioning_leaves_one_container_per_machine() {
    let Some(c) = lxd() else { return };
    // With agents: each container gets one as it starts.
    let (j, env_uuid) = lxd_jujube("lx", &AGENTS);
    let _sweep = Sweep::of(&env_uuid);
    j.run(&["add-machine", "-n", "12"]).ok();
    let mut seed = u64::from(std::process::id()) | 1;
    let mut mid_way = 0;
    for trial in 0..3 {
        let before = tagged(&c, &env_uuid).await.len();
        let ctl = j.controller();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // Kill as soon as the controller has made a new container (when
        // it most likely has not recorded it yet), plus a random delay.
        let ms = seed % 300;
        for _ in 0..500 {
            if before >= 13 || tagged(&c, &env_uuid).await.len() > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::thread::sleep(Duration::from_millis(ms));
        ctl.kill9();
        let done = j.provisioned();
        let made = tagged(&c, &env_uuid).await.len();
        eprintln!(
            "trial {trial}: killed {ms} ms after a new container with {made} containers made, {done} of 13 machines recorded"
        );
        if made > done {
            mid_way += 1;
        }
    }
    assert!(
        mid_way >= 1,
        "a kill must land between a container's creation and its recording"
    );
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "120s"]).ok();
    drop(ctl);
    let st = j.status();
    let machines = st["machines"].as_object().unwrap();
    assert_eq!(machines.len(), 13);
    let names = tagged(&c, &env_uuid).await;
    for (id, m) in machines {
        let name = format!("jujube-{}-{id}", short(&env_uuid));
        assert_eq!(
            m["instance-id"],
            json!(name),
            "machine {id} records its container: {m:#}"
        );
        let v = container(&c, &name)
            .await
            .unwrap_or_else(|| panic!("{name} exists"));
        assert_eq!(v["status"], "Running", "{name}");
        assert_eq!(v["config"]["user.jujube-machine-id"], json!(id));
    }
    assert_eq!(
        names.len(),
        13,
        "one container per machine, no strays: {names:?}"
    );
    j.run(&["destroy-environment", "lx", "-y"]).ok();
    assert!(tagged(&c, &env_uuid).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaping_a_listed_stray_never_deletes_the_retry_that_took_its_name() {
    let Some(c) = lxd() else { return };
    let (_, _sweep, p) = fresh_provider();
    // A failed start's leftover, listed by the harvester as a stray...
    let listed = p.start_instance(&start_spec("1", "nonce-a")).await.unwrap();
    // ...then the machine is retried with a new nonce: the same name.
    let retry = p.start_instance(&start_spec("1", "nonce-b")).await.unwrap();
    assert_eq!(retry.id, listed.id);
    p.reap_instances(std::slice::from_ref(&listed))
        .await
        .unwrap();
    let v = container(&c, &retry.id)
        .await
        .expect("the retry's container survives the reap of the old stray");
    assert_eq!(v["config"]["user.jujube-nonce"], "nonce-b");
    assert_eq!(v["status"], "Running");
    // What is listed now is reaped.
    p.reap_instances(std::slice::from_ref(&retry))
        .await
        .unwrap();
    assert!(container(&c, &retry.id).await.is_none());
}

/// Bootstrap config for machines whose agents run inside their containers,
/// on the image `scripts/lxd-setup` builds for that.
const AGENTS: [&str; 6] = [
    "--config",
    "image-alias=jujube-agent",
    "--config",
    "lxd-agents=container",
    // Read when the controller starts.
    "--config",
    "agent-presence-lapse=8",
];

/// A file inside a container, through LXD's file API ("" if missing).
async fn file_in(c: &Client, container: &str, path: &str) -> String {
    c.read_file(container, path)
        .await
        .unwrap()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Runs a command in a container through LXD's exec API; its exit code.
async fn exec_in(c: &Client, container: &str, command: &[&str]) -> i64 {
    let body = json!({
        "command": command,
        "wait-for-websocket": false,
        "interactive": false,
        "record-output": false,
    });
    let op = c
        .run(
            Method::POST,
            &format!("/1.0/instances/{container}/exec"),
            Some(&body),
        )
        .await
        .unwrap()
        .unwrap();
    op["metadata"]["return"].as_i64().unwrap_or(-1)
}

/// The hooks a unit ran, from the `hook: NAME [REMOTE]` lines its example
/// charm logs inside its container.
async fn hooks_in(c: &Client, container: &str, unit: &str) -> Vec<String> {
    let log = format!(
        "{}/logs/unit-{}.log",
        jujube_providers::lxd::AGENT_DIR,
        unit.replace('/', "-")
    );
    crate::hooks::hook_lines(&file_in(c, container, &log).await)
}

/// Polls (real time: a real daemon and real agents) until `f` holds.
async fn eventually_in<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..300 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_run_inside_their_containers_and_hooks_run_there() {
    let Some(c) = lxd() else { return };
    let (j, env_uuid) = lxd_jujube("lxa", &AGENTS);
    let _sweep = Sweep::of(&env_uuid);
    let name = |machine: &str| format!("jujube-{}-{machine}", short(&env_uuid));
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["deploy", &j.charm("logging")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["add-relation", "logging", "wordpress"]).ok();
    let ctl = j.controller();
    j.run(&["wait", "--timeout", "180s"]).ok();
    let st = j.status();
    let machine_of = |unit: &str| {
        let svc = unit.split('/').next().unwrap();
        st["services"][svc]["units"][unit]["machine"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (my, wp) = (
        name(&machine_of("mysql/0")),
        name(&machine_of("wordpress/0")),
    );
    assert_ne!(my, wp);

    // Nothing was deployed on the controller's side: the agents are in
    // the containers.
    assert!(!j.home.path().join("environments/lxa/agents").exists());
    // Each unit's hooks ran inside its own container, in order.
    let agent_dir = jujube_providers::lxd::AGENT_DIR;
    let conf = format!("{agent_dir}/unit-wordpress-0/charm/db.conf");
    eventually_in("wordpress's database configuration", || {
        let (c, wp, conf) = (&c, &wp, &conf);
        async move { file_in(c, wp, conf).await.contains("password=") }
    })
    .await;
    let h = hooks_in(&c, &wp, "wordpress/0").await;
    in_order(&h, WORDPRESS_ORDER);
    let m = hooks_in(&c, &my, "mysql/0").await;
    in_order(&m, &MYSQL_ORDER[..2]);
    assert!(hooks_in(&c, &wp, "logging/0")
        .await
        .contains(&"start".to_string()));
    // wordpress's configuration, inside its container, holds the password
    // mysql's hook (in the other container) made: it travelled through the
    // controller's API.
    let db = file_in(&c, &wp, &conf).await;
    let password = db
        .lines()
        .find_map(|l| l.strip_prefix("password="))
        .unwrap();
    assert_eq!(password.len(), 24, "{db}");
    assert!(db.contains("database=wordpress\n"), "{db}");

    // `jujube run` runs in the unit's container.
    let out = j.run(&["run", "wordpress/0", "--", "hostname"]).ok().stdout;
    assert_eq!(out.trim(), wp);
    let out = j.run(&["run", "mysql/0", "--", "hostname"]).ok().stdout;
    assert_eq!(out.trim(), my);

    // debug-log: the agents in the containers shipped their logs to the
    // controller.
    let log = j
        .run(&["debug-log", "--no-tail", "--lines", "100"])
        .ok()
        .stdout;
    assert!(
        log.contains("wordpress/0: ") && log.contains("hook: install"),
        "{log}"
    );
    assert!(log.contains("mysql/0: "), "{log}");
    let only = j
        .run(&["debug-log", "--no-tail", "--include", "mysql/0"])
        .ok()
        .stdout;
    assert!(
        !only.is_empty() && only.lines().all(|l| l.starts_with("mysql/0: ")),
        "{only}"
    );

    // A container's agent killed: init starts it again, and it resumes
    // without running completed hooks again.
    let started = |log: String| log.matches("agent started").count();
    let before = started(file_in(&c, &wp, &format!("{agent_dir}/agent.log")).await);
    assert!(before >= 1);
    let killed = exec_in(
        &c,
        &wp,
        &[
            "sh",
            "-c",
            "kill -9 $(ps | grep '[j]ujube agent' | awk '{print $1}')",
        ],
    )
    .await;
    assert_eq!(killed, 0);
    eventually_in("the agent's restart", || {
        let (c, wp) = (&c, &wp);
        async move { started(file_in(c, wp, &format!("{agent_dir}/agent.log")).await) > before }
    })
    .await;
    let out = j.run(&["run", "wordpress/0", "--", "hostname"]).ok().stdout;
    assert_eq!(out.trim(), wp, "the restarted agent answers");
    // And after a reboot of its container.
    c.run(
        Method::PUT,
        &format!("/1.0/instances/{wp}/state"),
        Some(&json!({"action": "restart", "timeout": 30, "force": true})),
    )
    .await
    .unwrap()
    .unwrap();
    let out = j.run(&["run", "wordpress/0", "--", "hostname"]).ok().stdout;
    assert_eq!(out.trim(), wp, "the agent runs again after a reboot");
    let h = hooks_in(&c, &wp, "wordpress/0").await;
    assert_eq!(h.iter().filter(|x| *x == "install").count(), 1, "{h:?}");
    assert_eq!(h.iter().filter(|x| *x == "start").count(), 1, "{h:?}");

    // A frozen agent inside its container (SIGSTOP) shows `down`; thawed,
    // `started` again.
    let mysql_agent = |j: &Jujube| {
        j.status()["services"]["mysql"]["units"]["mysql/0"]["agent-status"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    let signal = |sig: &'static str| {
        let (c, my) = (&c, &my);
        async move {
            let cmd = format!("kill -{sig} $(ps | grep '[j]ujube agent' | awk '{{print $1}}')");
            exec_in(c, my, &["sh", "-c", &cmd]).await
        }
    };
    assert_eq!(signal("STOP").await, 0);
    eventually_in("mysql/0's agent down", || {
        let j = &j;
        async move { mysql_agent(j) == "down" }
    })
    .await;
    assert_eq!(signal("CONT").await, 0);
    eventually_in("mysql/0's agent seen again", || {
        let j = &j;
        async move { mysql_agent(j) == "started" }
    })
    .await;

    // destroy-service: the units leave, their stop hooks run inside (and
    // wordpress's remove after it); then destroy-machine takes the
    // container away.
    j.run(&["destroy-service", "wordpress"]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    let h = hooks_in(&c, &wp, "wordpress/0").await;
    assert_eq!(
        h[h.len().saturating_sub(2)..],
        ["stop".to_string(), "remove".to_string()],
        "{h:?}"
    );
    let lg = hooks_in(&c, &wp, "logging/0").await;
    assert_eq!(lg.last().map(String::as_str), Some("stop"), "{lg:?}");
    j.run(&["destroy-machine", &machine_of("wordpress/0")]).ok();
    j.run(&["wait", "--timeout", "120s"]).ok();
    assert!(until_gone(&c, &wp).await, "{wp} deleted");
    assert!(container(&c, &my).await.is_some());
    drop(ctl);
    j.run(&["destroy-environment", "lxa", "-y"]).ok();
    assert!(
        tagged(&c, &env_uuid).await.is_empty(),
        "nothing of the environment is left"
    );
}

/// An instance metadata service as EC2's answers the identity paths
/// (IMDSv2 only: a GET without the session token is refused), serving a
/// document and its signature.
struct Imds {
    port: u16,
}

impl Imds {
    fn start(document: String, signature: String) -> Imds {
        Imds::serve(document, signature, None, None)
    }

    /// Also an instance profile's role `jujube-role`, whose credentials are
    /// `access_key` (a LocalStack account) and secret `test`.
    fn with_role(document: String, signature: String, access_key: &str) -> Imds {
        Imds::serve(document, signature, Some(access_key.to_string()), None)
    }

    /// As [`Imds::with_role`], the instance's addresses too: `(public,
    /// private)`.
    fn with_addresses(
        document: String,
        signature: String,
        access_key: &str,
        addresses: (&str, &str),
    ) -> Imds {
        Imds::serve(
            document,
            signature,
            Some(access_key.to_string()),
            Some((addresses.0.to_string(), addresses.1.to_string())),
        )
    }

    fn serve(
        document: String,
        signature: String,
        access_key: Option<String>,
        addresses: Option<(String, String)>,
    ) -> Imds {
        use std::io::{BufRead, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let mut r = std::io::BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                let _ = r.read_line(&mut line);
                let mut has_token = false;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    has_token |= h
                        .to_ascii_lowercase()
                        .starts_with("x-aws-ec2-metadata-token: session-token");
                }
                let (doc, sig) = (document.clone(), signature.clone());
                let creds = access_key.as_ref().map(|k| {
                    format!(
                        r#"{{"Code":"Success","LastUpdated":"2026-11-28T00:00:00Z","Type":"AWS-HMAC","AccessKeyId":"{k}","SecretAccessKey":"test","Token":"session","Expiration":"2036-11-28T00:00:00Z"}}"#
                    )
                });
                let (status, body) = match line.split_whitespace().take(2).collect::<Vec<_>>()[..] {
                    ["PUT", "/latest/api/token"] => ("200 OK", "session-token".to_string()),
                    [_, _] if !has_token => ("401 Unauthorized", String::new()),
                    ["GET", "/latest/meta-data/public-ipv4"] if addresses.is_some() => {
                        ("200 OK", addresses.as_ref().unwrap().0.clone())
                    }
                    ["GET", "/latest/meta-data/local-ipv4"] if addresses.is_some() => {
                        ("200 OK", addresses.as_ref().unwrap().1.clone())
                    }
                    ["GET", "/latest/dynamic/instance-identity/document"] => ("200 OK", doc),
                    ["GET", "/latest/dynamic/instance-identity/signature"] => ("200 OK", sig),
                    ["GET", "/latest/meta-data/iam/security-credentials/"
                    | "/latest/meta-data/iam/security-credentials-extended/"]
                        if creds.is_some() =>
                    {
                        ("200 OK", "jujube-role".to_string())
                    }
                    ["GET", "/latest/meta-data/iam/security-credentials/jujube-role"
                    | "/latest/meta-data/iam/security-credentials-extended/jujube-role"] => {
                        match &creds {
                            Some(c) => ("200 OK", c.clone()),
                            None => ("404 Not Found", String::new()),
                        }
                    }
                    _ => ("404 Not Found", String::new()),
                };
                let mut w = conn;
                // A session token says how long it lives, as the real one does.
                let ttl = if body == "session-token" {
                    "X-aws-ec2-metadata-token-ttl-seconds: 21600\r\n"
                } else {
                    ""
                };
                let _ = write!(
                    w,
                    "HTTP/1.1 {status}\r\n{ttl}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Imds { port }
    }
}

/// An identity document as EC2 writes one, for `instance` in us-east-1.
fn identity_document(instance: &str) -> String {
    format!(
        "{{\n  \"accountId\" : \"000000000000\",\n  \"availabilityZone\" : \"us-east-1a\",\n  \"instanceId\" : \"{instance}\",\n  \"pendingTime\" : \"2026-11-25T10:00:00Z\",\n  \"privateIp\" : \"10.0.0.12\",\n  \"region\" : \"us-east-1\",\n  \"version\" : \"2017-09-30\"\n}}"
    )
}

fn sign(key: &rcgen::KeyPair, document: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .encode(rcgen::SigningKey::sign(key, document.as_bytes()).unwrap())
}

/// EC2 with agents: an instance's user data is a boot script that fetches
/// the binary from the API (checked by hash), enrolls with its batch's
/// one-time token and its identity document signed by AWS (here by a test
/// key the controller is configured to trust, through the real
/// verification), and runs the agent. LocalStack's instances run nothing,
/// so the script runs here as cloud-init would, as root in a container
/// (the `jujube-agent` image), which reaches the API at `api-address` and a
/// metadata service through LXD proxies: its agent takes up its machine.
/// The token alone is not enough to take another instance's machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ec2_instances_user_data_installs_an_agent_that_takes_up_its_machine() {
    use crate::ec2::{account, ec2_bootstrap, ec2_jujube, localstack, raw_client};
    use base64::Engine;
    let Some(()) = localstack() else { return };
    let Some(c) = lxd() else { return };
    let acct = account();
    let j = ec2_jujube(&acct);
    let api = format!("127.0.0.1:{}", unclaimed_port());
    let trusted = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    let cert = rcgen::CertificateParams::new(vec![])
        .unwrap()
        .self_signed(&trusted)
        .unwrap()
        .pem();
    let certs = j.home.path().join("identity.pem");
    std::fs::write(&certs, cert).unwrap();
    ec2_bootstrap(
        &j,
        &[
            &format!("api-address={api}"),
            &format!("identity-certificates={}", certs.display()),
        ],
    );
    // One zone: one launch batch.
    j.run(&[
        "add-machine",
        "-n",
        "3",
        "--constraints",
        "zones=us-east-1a",
    ])
    .ok();
    let ctl = j.controller();
    let mut iids: Vec<String> = Vec::new();
    for _ in 0..300 {
        let st = j.status();
        iids = ["1", "2", "3"]
            .iter()
            .filter_map(|m| {
                st["machines"][*m]["instance-id"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        if iids.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(iids.len(), 3, "machines 1-3 provisioned");
    let iid = iids[0].clone();

    // Each instance's user data: the boot script of their launch batch,
    // with the API's address, the binary's hash and the batch's token;
    // never a secret.
    let raw = raw_client(&acct);
    let mut scripts = Vec::new();
    for i in &iids {
        let attr = raw
            .describe_instance_attribute()
            .instance_id(i)
            .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
            .send()
            .await
            .unwrap();
        let encoded = attr
            .user_data()
            .and_then(|u| u.value())
            .unwrap()
            .to_string();
        scripts.push(
            String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .unwrap(),
            )
            .unwrap(),
        );
    }
    assert!(
        scripts.iter().all(|s| *s == scripts[0]),
        "one launch batch, one user data"
    );
    let script = scripts[0].clone();
    assert!(script.starts_with("#!/bin/sh\n"), "{script}");
    assert!(script.contains(&format!("api='{api}'")), "{script}");
    let binary = std::fs::read(env!("CARGO_BIN_EXE_jujube")).unwrap();
    let sha: String = {
        use sha2::Digest;
        sha2::Sha256::digest(&binary)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    assert!(script.contains(&format!("sha256='{sha}'")), "{script}");
    let token = script
        .lines()
        .find_map(|l| l.strip_prefix("token='"))
        .and_then(|t| t.strip_suffix('\''))
        .unwrap()
        .to_string();
    assert!(token.len() >= 32);
    assert!(!script.contains("\"secret\""), "no credential in user data");

    // The instance, as a container: its id where cloud-init keeps it, the
    // API at the same address through a proxy, then the script.
    let doc = identity_document(&iid);
    let imds = Imds::start(doc.clone(), sign(&trusted, &doc));
    let name = format!("jujube-enroll-{}", &uuid()[..8]);
    let _sweep = Sweep {
        uuids: vec![],
        names: vec![name.clone()],
    };
    let body = json!({
        "name": name,
        "type": "container",
        "source": {"type": "image", "alias": "jujube-agent"},
        "devices": {
            "api": {
                "type": "proxy",
                "bind": "container",
                "listen": format!("tcp:{api}"),
                "connect": format!("tcp:{api}"),
            },
            "imds": {
                "type": "proxy",
                "bind": "container",
                "listen": format!("tcp:127.0.0.1:{}", imds.port),
                "connect": format!("tcp:127.0.0.1:{}", imds.port),
            },
        },
    });
    crate::lxd_direct::launch_body(&c, &name, &body).await;
    c.push_file(
        &name,
        "/root/user-data",
        script.clone().into(),
        0o700,
        false,
    )
    .await
    .unwrap()
    .unwrap();
    let run_script = format!(
        "JUJUBE_IMDS=http://127.0.0.1:{} exec /bin/sh /root/user-data",
        imds.port
    );
    assert_eq!(exec_in(&c, &name, &["/bin/sh", "-c", &run_script]).await, 0);
    let conf = file_in(&c, &name, "/var/lib/jujube/agent/agent.conf").await;
    assert!(
        conf.contains("\"machine\": 1") || conf.contains("machine-1"),
        "{conf}"
    );

    // Its agent (started by the image's init) takes up machine 1.
    eventually_in("machine 1's agent", || {
        let j = &j;
        async move { j.status()["machines"]["1"]["agent-status"] == "started" }
    })
    .await;

    // What the token and identities can get: `document` signed by `key`.
    let untrusted = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    let enroll_with = |document: String, signature: String, dir: &'static str| {
        let (c, name, api, token) = (&c, name.clone(), api.clone(), token.clone());
        async move {
            c.push_file(&name, "/root/doc.json", document.into(), 0o600, false)
                .await
                .unwrap()
                .unwrap();
            c.push_file(&name, "/root/doc.sig", signature.into(), 0o600, false)
                .await
                .unwrap()
                .unwrap();
            let data_dir = format!("/root/{dir}");
            let argv = [
                "/usr/local/bin/jujube",
                "enroll",
                "--data-dir",
                &data_dir,
                "--api",
                &api,
                "--ca-cert",
                "/var/lib/jujube/ca.pem",
                "--token",
                &token,
                "--identity-document",
                "/root/doc.json",
                "--identity-signature",
                "/root/doc.sig",
            ];
            let code = exec_in(c, &name, &argv).await;
            (
                code,
                file_in(c, &name, &format!("{data_dir}/agent.conf")).await,
            )
        }
    };
    // The token works once per instance: enrolling again is refused.
    let (code, conf) = enroll_with(doc.clone(), sign(&trusted, &doc), "again").await;
    assert!(
        code != 0 && conf.is_empty(),
        "a token works once per instance"
    );
    // Instance 1 holds the token but cannot prove itself instance 2: its
    // own document edited (the signature no longer holds), or one signed
    // by a key the controller does not trust.
    let forged = doc.replace(&iid, &iids[1]);
    let (code, conf) = enroll_with(forged.clone(), sign(&trusted, &doc), "forged").await;
    assert!(code != 0 && conf.is_empty(), "an edited document enrolled");
    let (code, conf) = enroll_with(forged.clone(), sign(&untrusted, &forged), "untrusted").await;
    assert!(
        code != 0 && conf.is_empty(),
        "an untrusted signature enrolled"
    );
    // An instance not of the batch, however well signed: refused.
    let stranger = identity_document("i-0123456789abcdef0");
    let (code, conf) = enroll_with(stranger.clone(), sign(&trusted, &stranger), "stranger").await;
    assert!(code != 0 && conf.is_empty(), "only instances of the batch");
    // Instance 2 itself (its own signed document) still enrolls: nobody
    // took its machine.
    let (code, conf) = enroll_with(forged.clone(), sign(&trusted, &forged), "second").await;
    assert_eq!(code, 0, "instance 2 could not enroll");
    assert!(
        conf.contains("\"machine\": 2") || conf.contains("machine-2"),
        "{conf}"
    );
    drop(ctl);
    j.run(&["destroy-environment", "aws", "-y"]).ok();
}

/// Processes on this machine started for `home` (their environment names
/// it as `JUJUBE_HOME`): a controller or agent this host runs for it.
fn processes_for(home: &std::path::Path) -> Vec<String> {
    let needle = format!("JUJUBE_HOME={}", home.display());
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Ok(environ) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            found.push(format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmd).replace('\0', " ")
            ));
        }
    }
    found
}

/// Machines with their instances, units with their machines, relations:
/// what a restart of the controller must not lose.
/// A bootstrapped environment's status and UUID, what sweeps its
/// containers, and machine 0's container, whose agent has started.
fn machine_0(j: &Jujube) -> (Value, String, Sweep, String) {
    let st = j.status();
    let uuid = st["environment"]["uuid"].as_str().unwrap().to_string();
    let sweep = Sweep {
        uuids: vec![uuid.clone()],
        names: vec![],
    };
    let m0 = format!("jujube-{}-0", short(&uuid));
    assert_eq!(st["machines"]["0"]["agent-status"], "started");
    (st, uuid, sweep, m0)
}

/// `wait`, and then `unit`'s agent has started.
#[track_caller]
fn waited_until_started(j: &Jujube, unit: &str) {
    j.run(&["wait", "--timeout", "180s"]).ok();
    let service = unit.split('/').next().unwrap();
    let st = j.status();
    assert_eq!(
        st["services"][service]["units"][unit]["agent-status"], "started",
        "{st}"
    );
}

fn model_of(st: &Value) -> Value {
    let machines: BTreeMap<String, Value> = st["machines"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, m)| (id.clone(), m["instance-id"].clone()))
        .collect();
    let mut units = BTreeMap::new();
    for (_, s) in st["services"].as_object().unwrap() {
        for (u, v) in s["units"].as_object().into_iter().flatten() {
            units.insert(u.clone(), v["machine"].clone());
        }
    }
    json!({"machines": machines, "units": units, "relations": st["relations"].clone()})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_0s_container_runs_the_controller_and_holds_the_state() {
    let Some(c) = lxd() else { return };
    let mut j = Jujube::new();
    // As users bootstrap: nothing started by hand, no controller on this
    // host.
    j.auto_controller = true;
    j.start_controllers = false;
    let r = j
        .run(&[
            "bootstrap",
            "lxm",
            "--provider",
            "lxd",
            "--config",
            "image-alias=jujube-agent",
        ])
        .ok();
    assert!(
        r.stdout
            .contains("machine 0's container runs the controller"),
        "{}",
        r.stdout
    );
    let (st, uuid, _sweep, m0) = machine_0(&j);
    assert_eq!(st["machines"]["0"]["instance-id"], json!(m0));

    // The host holds no state and runs nothing of the environment: the
    // store is in machine 0's container, and so is the controller.
    let env_dir = j.home.path().join("environments/lxm");
    let left: Vec<String> = std::fs::read_dir(&env_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["machine-0.json".to_string()]);
    assert_eq!(processes_for(j.home.path()), Vec::<String>::new());
    let home = jujube_providers::lxd::controller::CONTROLLER_HOME;
    let db = c
        .read_file(&m0, &format!("{home}/environments/lxm/state.db"))
        .await
        .unwrap()
        .expect("the store in machine 0's container");
    assert!(db.starts_with(b"SQLite format 3\0"));
    let controller_log = format!("{home}/environments/lxm/controller.log");
    // A command run on the host for it says where it runs.
    let r = j.run(&["controller"]);
    assert_eq!(
        r.stderr,
        format!("error: environment `lxm`'s controller runs in machine 0's container `{m0}`, which holds its state; there is none to run on this host\n")
    );
    assert!(!env_dir.join("state.db").exists());

    // The host's CLI deploys through it; the agents run in their own
    // containers, reaching machine 0 through the daemon's host.
    j.run(&["deploy", &j.charm("mysql")]).ok();
    j.run(&["deploy", &j.charm("wordpress")]).ok();
    j.run(&["add-relation", "wordpress", "mysql"]).ok();
    j.run(&["wait", "--timeout", "180s"]).ok();
    let st = j.status();
    let wp_machine = st["services"]["wordpress"]["units"]["wordpress/0"]["machine"]
        .as_str()
        .unwrap()
        .to_string();
    let wp = format!("jujube-{}-{wp_machine}", short(&uuid));
    let conf = format!(
        "{}/unit-wordpress-0/charm/db.conf",
        jujube_providers::lxd::AGENT_DIR
    );
    eventually_in("wordpress's database configuration", || {
        let (c, wp, conf) = (&c, &wp, &conf);
        async move { file_in(c, wp, conf).await.contains("password=") }
    })
    .await;
    in_order(&hooks_in(&c, &wp, "wordpress/0").await, WORDPRESS_ORDER);
    let out = j.run(&["run", "wordpress/0", "--", "hostname"]).ok().stdout;
    assert_eq!(out.trim(), wp);

    // The controller killed inside machine 0: its init starts it again.
    let starts = |log: String| log.matches("controller started").count();
    let before = starts(file_in(&c, &m0, &controller_log).await);
    assert_eq!(before, 1, "{}", file_in(&c, &m0, &controller_log).await);
    let killed = exec_in(
        &c,
        &m0,
        &[
            "sh",
            "-c",
            "kill -9 $(ps | grep '[j]ujube controller' | awk '{print $1}')",
        ],
    )
    .await;
    assert_eq!(killed, 0);
    eventually_in("the controller's restart", || {
        let (c, m0, log) = (&c, &m0, &controller_log);
        async move { starts(file_in(c, m0, log).await) > before }
    })
    .await;
    let model = model_of(&j.status());
    assert!(model["units"].get("mysql/0").is_some(), "{model}");

    // `lxc restart` of machine 0 loses nothing: the store is on its disk,
    // its init starts the controller, and it goes on.
    c.run(
        Method::PUT,
        &format!("/1.0/instances/{m0}/state"),
        Some(&json!({"action": "restart", "timeout": 30, "force": true})),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(model_of(&j.status()), model, "the model after a restart");
    j.run(&["add-unit", "wordpress"]).ok();
    waited_until_started(&j, "wordpress/1");

    // destroy-environment: every instance, then machine 0; the daemon no
    // longer trusts machine 0's certificate; the host forgets it all.
    let r = j.run(&["destroy-environment", "lxm", "-y"]).ok();
    assert!(
        r.stdout
            .contains(&format!("stopped machine 0 (`{m0}`), the controller")),
        "{}",
        r.stdout
    );
    assert!(tagged(&c, &uuid).await.is_empty(), "containers left");
    let trusted = c
        .get("/1.0/certificates?recursion=1")
        .await
        .unwrap()
        .unwrap();
    let name = format!("jujube-controller-{uuid}");
    assert!(
        !trusted
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"].as_str() == Some(name.as_str())),
        "machine 0's certificate is still trusted"
    );
    assert!(!env_dir.exists());
    assert_eq!(j.run(&["environments"]).ok().stdout, "");
}

/// Environment `name` bootstrapped on LXD with its state in a fresh schema
/// of the test cluster (the password in a file the server does not need:
/// it trusts loopback).
fn bootstrapped_on_postgresql(name: &str) -> (Jujube, crate::postgres::AsyncSchema) {
    let db = crate::postgres::AsyncSchema::new();
    let mut j = Jujube::new();
    j.auto_controller = true;
    j.start_controllers = false;
    let password = j.home.path().join("state-password");
    std::fs::write(&password, "not-needed-by-trust\n").unwrap();
    j.run(&[
        "bootstrap",
        name,
        "--provider",
        "lxd",
        "--config",
        "image-alias=jujube-agent",
        "--config",
        &format!("state-url={}", db.url),
        "--config",
        &format!("state-password-file={}", password.display()),
    ])
    .ok();
    (j, db)
}

/// `bootstrap --provider lxd --config state-url=...`: machine 0's
/// controller keeps the state in PostgreSQL on this host, reached through a
/// proxy at the address the URL names (the server's certificate checked
/// against its own copy of the authority), with the password in a file
/// only root reads in machine 0; nothing of the state is in the container
/// or on the host, and `destroy-environment` leaves nothing in the
/// database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_0s_controller_keeps_the_state_in_postgresql() {
    let Some(c) = lxd() else { return };
    let (j, mut db) = bootstrapped_on_postgresql("lxp");
    let url = db.url.clone();
    let (_, uuid, _sweep, m0) = machine_0(&j);
    assert!(db.tables() > 0);

    // What machine 0 holds of the state: where it is, never the state.
    let home = jujube_providers::lxd::controller::CONTROLLER_HOME;
    let env = format!("{home}/environments/lxp");
    assert!(c
        .read_file(&m0, &format!("{env}/state.db"))
        .await
        .unwrap()
        .is_none());
    assert_machine_0s_own_state_place(&c, &m0, &env, &url).await;
    let left: Vec<String> = std::fs::read_dir(j.home.path().join("environments/lxp"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["machine-0.json".to_string()]);

    j.run(&["deploy", &j.charm("mysql")]).ok();
    waited_until_started(&j, "mysql/0");

    destroyed_leaving_nothing(&j, &c, "lxp", &uuid, &mut db).await;
    assert!(!j.home.path().join("environments/lxp").exists());
}

/// `enable-ha -n 3` with the controller in machine 0's container and the
/// state in PostgreSQL: the provisioner makes the two new controller
/// machines' containers controllers (the same certificates, identity for
/// the daemon and place of the state; each API on a port of its own on
/// this host) and runs no agent there; the CLI waits for them and keeps
/// every one's address, and the agent's container made before them gets a
/// socket to each. With machine 0's container stopped, another controller
/// takes the singletons lease and the CLI and the agents fail over to it:
/// the unit runs a command, and a unit added then starts on a new machine.
/// `destroy-environment` stops every controller and erases the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_ha_makes_controllers_of_containers_that_take_over_from_machine_0() {
    let Some(c) = lxd() else { return };
    let (j, mut db) = bootstrapped_on_postgresql("lxha");
    let url = db.url.clone();
    let (_, uuid, _sweep, m0) = machine_0(&j);
    j.run(&["deploy", &j.charm("mysql")]).ok();
    waited_until_started(&j, "mysql/0");
    let my = format!("jujube-{}-1", short(&uuid));

    let r = j.run(&["enable-ha", "-n", "3"]).ok();
    for m in ["2", "3"] {
        assert!(
            r.stdout
                .contains(&format!("added controller machine `{m}`")),
            "{}",
            r.stdout
        );
        assert!(
            r.stdout
                .contains(&format!("machine {m}'s controller is up at 127.0.0.1:")),
            "{}",
            r.stdout
        );
    }
    let controllers: Value =
        serde_json::from_slice(&std::fs::read(j.home.path().join("controllers.json")).unwrap())
            .unwrap();
    let addresses = controllers["lxha"]["addresses"].as_array().unwrap().clone();
    assert_eq!(addresses.len(), 3, "{controllers}");
    // A home that knew machine 0's address alone (one that did not run
    // `enable-ha`) learns the others' from `status`.
    let mut alone = controllers.clone();
    alone["lxha"]["addresses"] = json!([addresses[0].clone()]);
    std::fs::write(
        j.home.path().join("controllers.json"),
        serde_json::to_vec(&alone).unwrap(),
    )
    .unwrap();
    j.run(&["status"]).ok();
    let learned: Value =
        serde_json::from_slice(&std::fs::read(j.home.path().join("controllers.json")).unwrap())
            .unwrap();
    assert_eq!(learned["lxha"]["addresses"], json!(addresses), "{learned}");
    let st = j.status();
    let shown: Vec<(String, String, Value)> = st["controllers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["machine"].as_str().unwrap().to_string(),
                c["state"].as_str().unwrap().to_string(),
                c["addresses"][0].clone(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        ["0", "2", "3"]
            .iter()
            .zip(&addresses)
            .map(|(m, a)| (m.to_string(), "up".to_string(), a.clone()))
            .collect::<Vec<_>>(),
        "{st}"
    );
    // Each new controller runs in its own container, as its machine, from
    // its own copy of the place of the state; no agent there.
    let home = jujube_providers::lxd::controller::CONTROLLER_HOME;
    let env = format!("{home}/environments/lxha");
    for m in [2, 3] {
        let name = format!("jujube-{}-{m}", short(&uuid));
        let conf = file_in(
            &c,
            &name,
            jujube_providers::lxd::controller::CONTROLLER_ENV_FILE,
        )
        .await;
        assert!(conf.contains(&format!("JUJUBE_MACHINE={m}")), "{conf}");
        assert!(conf.contains("JUJUBE_API_ADVERTISE=127.0.0.1:"), "{conf}");
        assert_machine_0s_own_state_place(&c, &name, &env, &url).await;
        assert!(!has_agent(&c, &name).await, "machine {m} has an agent");
    }
    // The agent's container made before them reaches them too.
    eventually_in(
        "a socket to each new controller in mysql/0's container",
        || {
            let (c, my) = (&c, &my);
            async move {
                let v = container(c, my).await.unwrap();
                ["jujube-api-2", "jujube-api-3"]
                    .iter()
                    .all(|d| v["devices"][*d]["type"] == "proxy")
            }
        },
    )
    .await;

    // Machine 0 goes away: another controller takes the lease, and the
    // CLI and the agents reach it.
    let holder = machine_0_gone(&j, &c, &m0).await;
    assert!(holder == "2" || holder == "3", "{holder}");
    let out = j.run(&["run", "mysql/0", "--", "hostname"]).ok().stdout;
    assert_eq!(
        out.trim(),
        my,
        "mysql/0's agent answers through another controller"
    );
    j.run(&["add-unit", "mysql"]).ok();
    waited_until_started(&j, "mysql/1");
    let st = j.status();
    assert_eq!(
        st["services"]["mysql"]["units"]["mysql/1"]["machine"], "4",
        "{st}"
    );

    destroyed_leaving_nothing(&j, &c, "lxha", &uuid, &mut db).await;
}

/// Stops machine 0's container `m0` (machine 0 gone) and waits, two
/// minutes at most, until another controller holds the singletons lease:
/// that one's machine.
async fn machine_0_gone(j: &Jujube, c: &Client, m0: &str) -> String {
    c.run(
        Method::PUT,
        &format!("/1.0/instances/{m0}/state"),
        Some(&json!({"action": "stop", "force": true})),
    )
    .await
    .unwrap()
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let st = j.status();
        let holder = st["controllers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["runs-singletons"] == json!(true))
            .map(|c| c["machine"].as_str().unwrap().to_string());
        match holder {
            Some(h) if h != "0" => return h,
            _ => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no other controller took over: {st}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `destroy-environment NAME` of an environment with UUID `uuid` whose
/// state is in `db`: it says it erased the state, and leaves no container
/// and no table.
async fn destroyed_leaving_nothing(
    j: &Jujube,
    c: &Client,
    name: &str,
    uuid: &str,
    db: &mut crate::postgres::AsyncSchema,
) {
    let r = j.run(&["destroy-environment", name, "-y"]).ok();
    assert!(
        r.stdout.contains("erased the environment's state"),
        "{}",
        r.stdout
    );
    assert!(tagged(c, uuid).await.is_empty(), "containers left");
    assert_eq!(db.tables(), 0);
}

/// Machine 0's (`m0`) own place of a state in PostgreSQL at `url`, in its
/// environment's directory `env`: its URL names its own copy of the
/// authority, its password is in a file only root reads.
async fn assert_machine_0s_own_state_place(c: &Client, m0: &str, env: &str, url: &str) {
    let theirs: Value =
        serde_json::from_str(&file_in(c, m0, &format!("{env}/state-url.json")).await).unwrap();
    let theirs_url = theirs["url"].as_str().unwrap();
    assert!(
        theirs_url.contains(&format!("sslrootcert={env}/state-ca.pem")),
        "{theirs}"
    );
    assert_eq!(
        theirs_url.replace(&format!("{env}/state-ca.pem"), ""),
        url.replace(&std::env::var("JUJUBE_TEST_STATE_CA").unwrap(), ""),
    );
    assert_eq!(
        theirs["password_file"],
        json!(format!("{env}/state-password"))
    );
    assert_eq!(
        file_in(c, m0, &format!("{env}/state-password")).await,
        "not-needed-by-trust"
    );
    assert!(
        roots_alone(c, m0, &format!("{env}/state-password")).await,
        "the password file is not root's alone"
    );
}

/// Whether `path` in `container` is a file only its owner (root) reads.
async fn roots_alone(c: &Client, container: &str, path: &str) -> bool {
    let test = format!("test \"$(stat -c %a {path})\" = 600");
    exec_in(c, container, &["sh", "-c", &test]).await == 0
}

/// Whether `container` was given a machine agent.
async fn has_agent(c: &Client, container: &str) -> bool {
    let conf = format!("{}/agent.conf", jujube_providers::lxd::AGENT_DIR);
    exec_in(c, container, &["test", "-e", &conf]).await == 0
}

/// `bootstrap --provider ec2` as a user runs it: the tools go to the
/// environment's control bucket, machine 0's instance is launched with user
/// data that fetches them by a presigned URL and takes up the controller's
/// state from the bucket with the instance's own credentials (from its
/// metadata service; the profile LocalStack's EC2 cannot attach is left
/// out with `instance-profile=none`); LocalStack's instances run nothing,
/// so the user data runs here as cloud-init would, in a container that
/// reaches LocalStack and its metadata service only through LXD proxies,
/// and whose API this host reaches through another. The host's CLI then
/// works through machine 0's controller, which launches instances in
/// LocalStack, and `destroy-environment` leaves nothing with the
/// environment's UUID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_on_ec2_puts_the_controller_on_machine_0() {
    bootstrap_on_ec2(false).await;
}

/// As above, machine 0 given no role: `controller-credentials=hand-over`
/// hands it this home's credentials over TLS once it answers, authenticated
/// by a one-time token only bootstrap knows (machine 0 is told its hash),
/// to a one-shot identity machine 0 published in the bucket; its metadata
/// service serves no credentials. This environment keeps its state in
/// PostgreSQL (`state-url`, the test cluster reached from machine 0 as the
/// cloud's network would carry it, through a proxy): the hand-over carries
/// machine 0's own place of it (the URL naming its own copy of the
/// authority, the password in a file only root reads), no state is on
/// machine 0 or left on this host, and `destroy-environment` erases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_on_ec2_can_hand_machine_0_the_users_credentials() {
    bootstrap_on_ec2(true).await;
}

async fn bootstrap_on_ec2(hand_over: bool) {
    use crate::ec2::{account, ec2_jujube, localstack, raw_client, ENDPOINT, REGION};
    let Some(()) = localstack() else { return };
    let Some(c) = lxd() else { return };
    let acct = account();
    let mut j = ec2_jujube(&acct);
    j.auto_controller = true;
    j.start_controllers = false;
    let api = format!("127.0.0.1:{}", unclaimed_port());
    // The hand-over's environment keeps its state in PostgreSQL.
    let mut db = hand_over.then(crate::postgres::AsyncSchema::new);
    let state_url = db.as_ref().map(|d| d.url.clone());
    let state_password = j.home.path().join("state-password");
    std::fs::write(&state_password, "not-needed-by-trust\n").unwrap();
    let state_config: Vec<String> = match &state_url {
        Some(url) => vec![
            "--config".into(),
            format!("state-url={url}"),
            "--config".into(),
            format!("state-password-file={}", state_password.display()),
        ],
        None => vec![],
    };

    // Bootstrap waits for machine 0: run it beside.
    let args: Vec<String> = [
        "bootstrap",
        "aws",
        "--provider",
        "ec2",
        "--config",
        &format!("region={REGION}"),
        "--config",
        &format!("endpoint={ENDPOINT}"),
        "--config",
        if hand_over {
            "controller-credentials=hand-over"
        } else {
            "instance-profile=none"
        },
        "--config",
        &format!("controller-address={api}"),
        "--config",
        "bootstrap-timeout=4m",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(state_config)
    .collect();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_jujube"));
    cmd.args(&args)
        .env("JUJUBE_HOME", j.home.path())
        .env_remove("JUJUBE_ENV")
        .envs(j.envs.iter().map(|(k, v)| (k, v)));
    let bootstrap = std::thread::spawn(move || cmd.output().unwrap());

    // Machine 0's instance and its user data.
    let raw = raw_client(&acct);
    let mut machine0 = None;
    for _ in 0..600 {
        let r = raw
            .describe_instances()
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name("tag:jujube-controller")
                    .values("true")
                    .build(),
            )
            .send()
            .await
            .unwrap();
        machine0 = r
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter_map(|i| i.instance_id().map(str::to_string))
            .next();
        if machine0.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let iid = machine0.expect("machine 0's instance is launched");
    let script = crate::ec2::user_data_of(&acct, &iid).await;
    // No secret: no password, no key, no credential.
    assert!(
        script.contains("X-Amz-Expires="),
        "a presigned URL: {script}"
    );
    assert!(
        script.contains(" take-up --home=/var/lib/jujube/home --env=aws "),
        "{script}"
    );
    for secret in ["PRIVATE KEY", "password", "AWS_SECRET", "test@"] {
        assert!(!script.contains(secret), "{secret} in {script}");
    }
    assert_eq!(
        script.contains(" --hand-over-token-sha256="),
        hand_over,
        "{script}"
    );
    let home_files = format!("{}", j.home.path().display());
    assert!(!script.contains(&home_files));

    // Machine 0, as a container: LocalStack and its metadata service at
    // the addresses it would have, its API at `api` on this host.
    let trusted = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    let doc = identity_document(&iid);
    let imds = if hand_over {
        Imds::start(doc.clone(), sign(&trusted, &doc))
    } else {
        Imds::with_role(doc.clone(), sign(&trusted, &doc), &acct)
    };
    let (name, _sweep) =
        instance_container(&c, "m0", &imds, &api, state_url.as_deref(), &script).await;

    let out = tokio::task::spawn_blocking(move || bootstrap.join().unwrap())
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "bootstrap: {stdout}\n{stderr}\nmachine 0's log:\n{}",
        file_in(&c, &name, "/var/log/jujube-controller.log").await
    );
    assert!(
        stdout.contains("machine 0's instance runs the controller"),
        "{stdout}"
    );
    let taken = if hand_over {
        "machine 0: tools fetched, state and credentials handed over"
    } else {
        "machine 0: tools fetched, controller taken up"
    };
    assert!(stderr.contains(taken), "{stderr}");
    // Machine 0 keeps the credentials it was handed, its root's alone.
    let kept = roots_alone(
        &c,
        &name,
        "/var/lib/jujube/home/environments/aws/cloud-credentials",
    )
    .await;
    assert_eq!(kept, hand_over, "cloud-credentials kept: {kept}");
    // Machine 0's place of a state in PostgreSQL: its own authority and
    // password file; never the state itself.
    let m0_env = "/var/lib/jujube/home/environments/aws";
    let theirs = c
        .read_file(&name, &format!("{m0_env}/state-url.json"))
        .await
        .unwrap();
    assert_eq!(theirs.is_some(), hand_over);
    if let Some(url) = &state_url {
        assert_machine_0s_own_state_place(&c, &name, m0_env, url).await;
        assert!(c
            .read_file(&name, &format!("{m0_env}/state.db"))
            .await
            .unwrap()
            .is_none());
    }
    if let Some(db) = &mut db {
        assert!(db.tables() > 0, "no state in PostgreSQL");
    }
    // This home holds no state of the environment now, and the hand-over
    // is gone from the bucket.
    let env_dir = j.home.path().join("environments/aws");
    let left: Vec<String> = std::fs::read_dir(&env_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["machine-0.json"]);
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env_dir.join("machine-0.json")).unwrap()).unwrap();
    assert_eq!(marker["provider"], "ec2");
    assert_eq!(marker["container"], iid.as_str());
    let env_uuid = marker["uuid"].as_str().unwrap().to_string();

    // The CLI works through machine 0's controller, which launches
    // instances in LocalStack.
    j.run(&["deploy", &j.charm("mysql"), "-n", "2"]).ok();
    eventually_in("machines 1 and 2 provisioned", || {
        let j = &j;
        async move {
            let st = j.status();
            ["1", "2"]
                .iter()
                .all(|m| st["machines"][*m]["instance-id"].as_str().is_some())
        }
    })
    .await;

    // Destroyed from this home: nothing tagged with the UUID is left.
    let r = j.run(&["destroy-environment", "aws", "-y"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("stopped machine 0"), "{}", r.stdout);
    assert_eq!(
        r.stdout.contains("erased the environment's state"),
        hand_over,
        "{}",
        r.stdout
    );
    if let Some(db) = &mut db {
        assert_eq!(db.tables(), 0, "state left in PostgreSQL");
    }
    assert!(r.stdout.contains("the S3 bucket `jujube-"), "{}", r.stdout);
    let live: Vec<String> = crate::ec2::live_instances(&acct)
        .await
        .iter()
        .filter(|i| {
            i.tags()
                .iter()
                .any(|t| t.key() == Some("jujube-env-uuid") && t.value() == Some(&env_uuid))
        })
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect();
    assert!(live.is_empty(), "left running: {live:?}");
    let groups = raw.describe_security_groups().send().await.unwrap();
    assert!(!groups
        .security_groups()
        .iter()
        .any(|g| g.group_name() == Some(&format!("jujube-{env_uuid}"))));
    let s3 = crate::ec2_storage::raw_s3(&acct).await;
    assert!(s3
        .head_bucket()
        .bucket(format!("jujube-{env_uuid}"))
        .send()
        .await
        .is_err());
    assert!(!env_dir.exists());
}

/// `enable-ha` on EC2, each instance played by a container as in
/// `bootstrap_on_ec2`: machine 0's controller launches an instance per new
/// controller machine as machine 0 was (here without a profile, their
/// role's credentials from the metadata service) with user data that holds
/// no secret (a presigned URL for the binary, `take-up` as that
/// machine); the instance takes the environment's certificates and its own
/// place of the state in PostgreSQL from the control bucket with its role's
/// credentials, and records where it is reached: its instance's public and
/// private addresses. The CLI waits for them and keeps every address. With
/// machine 0's instance gone, another controller takes the singletons lease,
/// the CLI fails over to it and its provisioner launches a new machine's
/// instance; `destroy-environment` stops every controller and erases the
/// state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_ha_on_ec2_makes_controllers_of_instances_that_take_over_from_machine_0() {
    use crate::ec2::{account, ec2_jujube, localstack, raw_client, user_data_of, ENDPOINT, REGION};
    let Some(()) = localstack() else { return };
    let Some(c) = lxd() else { return };
    let acct = account();
    let mut j = ec2_jujube(&acct);
    j.auto_controller = true;
    j.start_controllers = false;
    let api = format!("127.0.0.1:{}", unclaimed_port());
    let mut db = crate::postgres::AsyncSchema::new();
    let state_password = j.home.path().join("state-password");
    std::fs::write(&state_password, "not-needed-by-trust\n").unwrap();
    let bootstrap = beside(
        &j,
        &[
            "bootstrap",
            "ha",
            "--provider",
            "ec2",
            "--config",
            &format!("region={REGION}"),
            "--config",
            &format!("endpoint={ENDPOINT}"),
            "--config",
            &format!("controller-address={api}"),
            "--config",
            "bootstrap-timeout=4m",
            // LocalStack's EC2 cannot attach a profile IAM made (the
            // provider's own test sees the launch name one): the role's
            // credentials come from the metadata service alone.
            "--config",
            "instance-profile=none",
            "--config",
            &format!("state-url={}", db.url),
            "--config",
            &format!("state-password-file={}", state_password.display()),
        ],
    );
    let raw = raw_client(&acct);
    let trusted = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    let m0 = controller_instance(&raw, "0").await;
    let doc = identity_document(&m0);
    let imds0 = Imds::with_role(doc.clone(), sign(&trusted, &doc), &acct);
    let script = user_data_of(&acct, &m0).await;
    let (m0c, _sweep0) = instance_container(&c, "m0", &imds0, &api, Some(&db.url), &script).await;
    let out = finished(bootstrap).await;
    assert!(out.0, "bootstrap: {}\n{}", out.1, out.2);

    let enable = beside(&j, &["enable-ha", "-n", "3"]);
    let mut kept = Vec::new();
    for m in [1, 2] {
        let iid = controller_instance(&raw, &m.to_string()).await;
        let script = user_data_of(&acct, &iid).await;
        assert!(script.contains(&format!(" --machine={m}")), "{script}");
        assert!(
            script.contains(" take-up --home=/var/lib/jujube/home --env=ha "),
            "{script}"
        );
        assert!(
            script.contains("X-Amz-Expires="),
            "a presigned URL: {script}"
        );
        for secret in ["PRIVATE KEY", "password", "AWS_SECRET", "test@", "BEGIN"] {
            assert!(!script.contains(secret), "{secret} in {script}");
        }
        let public = format!("127.0.0.{}", 10 + m);
        let private = format!("10.0.0.{m}");
        let doc = identity_document(&iid);
        let imds = Imds::with_addresses(
            doc.clone(),
            sign(&trusted, &doc),
            &acct,
            (&public, &private),
        );
        let (name, sweep) = instance_container(
            &c,
            &format!("m{m}"),
            &imds,
            &format!("{public}:17070"),
            Some(&db.url),
            &script,
        )
        .await;
        kept.push((name, sweep, imds));
    }
    let (ok, stdout, stderr) = finished(enable).await;
    assert!(ok, "enable-ha: {stdout}\n{stderr}");
    for m in [1, 2] {
        let up = format!(
            "machine {m}'s controller is up at 127.0.0.{}:17070, 10.0.0.{m}:17070",
            10 + m
        );
        assert!(stdout.contains(&up), "{stdout}");
    }
    // Each took its own place of the state, and no state; nothing of
    // theirs waits in the bucket.
    let env = "/var/lib/jujube/home/environments/ha";
    for (name, _, _) in &kept {
        assert_machine_0s_own_state_place(&c, name, env, &db.url).await;
        assert!(!has_agent(&c, name).await, "{name} has an agent");
    }
    let s3 = crate::ec2_storage::raw_s3(&acct).await;
    let marker: Value = serde_json::from_slice(
        &std::fs::read(j.home.path().join("environments/ha/machine-0.json")).unwrap(),
    )
    .unwrap();
    let uuid = marker["uuid"].as_str().unwrap();
    let listed = s3
        .list_objects_v2()
        .bucket(format!("jujube-{uuid}"))
        .prefix("controller/")
        .send()
        .await
        .unwrap();
    assert!(listed.contents().is_empty(), "{:?}", listed.contents());

    // Machine 0's instance goes away: another controller takes the lease,
    // the CLI reaches it, and its provisioner launches instances.
    let holder = machine_0_gone(&j, &c, &m0c).await;
    assert!(holder == "1" || holder == "2", "{holder}");
    j.run(&["add-machine"]).ok();
    eventually_in("machine 3 provisioned by another controller", || {
        let j = &j;
        async move {
            j.status()["machines"]["3"]["instance-id"]
                .as_str()
                .is_some()
        }
    })
    .await;
    // Its agent is told to enroll at that controller's private address,
    // not at machine 0's, which is gone.
    let m3 = j.status()["machines"]["3"]["instance-id"]
        .as_str()
        .unwrap()
        .to_string();
    let boot = user_data_of(&acct, &m3).await;
    assert!(
        boot.contains(&format!("api='10.0.0.{holder}:17070'")),
        "{boot}"
    );

    let r = j.run(&["destroy-environment", "ha", "-y"]).ok();
    assert!(
        r.stdout.contains("erased the environment's state"),
        "{}",
        r.stdout
    );
    assert_eq!(db.tables(), 0, "state left in PostgreSQL");
    let live: Vec<String> = crate::ec2::live_instances(&acct)
        .await
        .iter()
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect();
    assert!(live.is_empty(), "left running: {live:?}");
}

/// `jujube ARGS` of `j`'s home, run beside the test (it waits for what the
/// test does meanwhile).
fn beside(j: &Jujube, args: &[&str]) -> std::thread::JoinHandle<std::process::Output> {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_jujube"));
    cmd.args(args)
        .env("JUJUBE_HOME", j.home.path())
        .env_remove("JUJUBE_ENV")
        .envs(j.envs.iter().map(|(k, v)| (k, v)));
    std::thread::spawn(move || cmd.output().unwrap())
}

/// Whether a command run [`beside`] succeeded, and its stdout and stderr.
async fn finished(h: std::thread::JoinHandle<std::process::Output>) -> (bool, String, String) {
    let out = tokio::task::spawn_blocking(move || h.join().unwrap())
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The instance LocalStack launched for controller machine `machine`
/// (waiting up to two minutes for it).
async fn controller_instance(raw: &aws_sdk_ec2::Client, machine: &str) -> String {
    let tag = |k: &str, v: &str| {
        aws_sdk_ec2::types::Filter::builder()
            .name(format!("tag:{k}"))
            .values(v)
            .build()
    };
    for _ in 0..600 {
        let r = raw
            .describe_instances()
            .filters(tag(jujube_providers::TAG_CONTROLLER, "true"))
            .filters(tag(jujube_providers::TAG_MACHINE_ID, machine))
            .send()
            .await
            .unwrap();
        let found = r
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter(|i| {
                i.state()
                    .and_then(|s| s.name())
                    .is_some_and(|n| n.as_str() == "running" || n.as_str() == "pending")
            })
            .filter_map(|i| i.instance_id().map(str::to_string))
            .next();
        if let Some(id) = found {
            return id;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no instance was launched for controller machine {machine}")
}

/// A LocalStack instance as an LXD container (named `jujube-LABEL-…`): its
/// user data `script` run there as cloud-init would, with LocalStack and
/// its metadata service `imds` at the addresses it would have, the database
/// `state_url` names reached where the URL names it (as the cloud's network
/// would carry it), and its API (port 17070) exposed on this host at `api`.
/// The container goes with the returned sweep.
async fn instance_container(
    c: &Client,
    label: &str,
    imds: &Imds,
    api: &str,
    state_url: Option<&str>,
    script: &str,
) -> (String, Sweep) {
    let name = format!("jujube-{label}-{}", &uuid()[..8]);
    let sweep = Sweep {
        uuids: vec![],
        names: vec![name.clone()],
    };
    let body = json!({
        "name": name,
        "type": "container",
        "source": {"type": "image", "alias": "jujube-agent"},
        "devices": {
            "localstack": {
                "type": "proxy",
                "bind": "container",
                "listen": "tcp:127.0.0.1:4566",
                "connect": "tcp:127.0.0.1:4566",
            },
            "imds": {
                "type": "proxy",
                "bind": "container",
                "listen": format!("tcp:127.0.0.1:{}", imds.port),
                "connect": format!("tcp:127.0.0.1:{}", imds.port),
            },
            "api": {
                "type": "proxy",
                "bind": "host",
                "listen": format!("tcp:{api}"),
                "connect": "tcp:127.0.0.1:17070",
            },
        },
    });
    let mut body = body;
    if let Some(url) = state_url {
        // The database, where the URL names it.
        let db = url
            .split_once("://")
            .and_then(|(_, r)| r.split(['/', '?']).next())
            .and_then(|a| a.rsplit_once('@').map(|(_, h)| h))
            .unwrap()
            .to_string();
        body["devices"]["state-db"] = json!({
            "type": "proxy",
            "bind": "container",
            "listen": format!("tcp:{db}"),
            "connect": format!("tcp:{db}"),
        });
    }
    crate::lxd_direct::launch_body(c, &name, &body).await;
    // What every cloud image has and the test image lacks: root
    // certificates (the AWS SDK will not start without them).
    for (path, dir) in [("/etc/ssl", true), ("/etc/ssl/certs", true)] {
        let _ = c
            .push_file(&name, path, Vec::new().into(), 0o755, dir)
            .await;
    }
    c.push_file(
        &name,
        "/etc/ssl/certs/ca-certificates.crt",
        std::fs::read("/etc/ssl/certs/ca-certificates.crt")
            .unwrap()
            .into(),
        0o644,
        false,
    )
    .await
    .unwrap()
    .unwrap();
    c.push_file(
        &name,
        "/root/user-data",
        script.to_string().into(),
        0o700,
        false,
    )
    .await
    .unwrap()
    .unwrap();
    let run_script = format!(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:{} exec /bin/sh /root/user-data",
        imds.port
    );
    assert_eq!(exec_in(c, &name, &["/bin/sh", "-c", &run_script]).await, 0);
    (name, sweep)
}

/// A loopback port that is free now and that no one is handed by the
/// kernel meanwhile: it lies below the ephemeral range, so neither a bind to
/// port 0 nor an outgoing connection can take it between this choice and the
/// LXD proxy's bind (a port from `bind(0)` was taken in between once).
fn unclaimed_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let seed = std::process::id() as u16;
    (0..2000u16)
        .map(|i| {
            20000 + (seed.wrapping_add(i.wrapping_mul(7))) % (low.saturating_sub(20000)).max(1)
        })
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free loopback port below the ephemeral range")
}
