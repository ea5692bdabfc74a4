//! The client facade: every [`ClientCall`] a user's `jujube` makes, answered
//! on a store handle acting for that user ([`Store::as_user`]: the store
//! checks the user's access inside each call's transaction).
//!
//! The API server runs it for callers over the network; the CLI runs the
//! same code in process while the environment's store is on its own disk.
//! Either way a command is the same calls, refused with the same words.

use crate::charm;
use crate::home::Home;
use crate::{bail, refusal, Context as _, Error, Result};
use jujube_api::clients::Answer;
use jujube_core::{series, Constraints};
use jujube_state::services::DeployArgs;
use jujube_state::Store;
use jujube_wire::client::Access;
use jujube_wire::client::{
    ClientCall, ClientError, Deployed, EnvironmentInfo, ServiceSettings, SettingOut, WaitState,
};
use std::path::PathBuf;

/// Where the environment is, for what a call reads beside the store: the
/// provider (zones, constraint keys) and charm directories.
pub struct Context<'a> {
    /// Lists the provider's zones, where it can (see [`ZONE_CHECK_TIMEOUT`]);
    /// `None` when it cannot be asked.
    pub zones: &'a (dyn Fn(&Store) -> Option<Vec<String>> + Sync),
    /// Where uploaded charms are kept.
    pub charms: &'a std::path::Path,
    /// What agents shipped of their logs.
    pub logs: &'a jujube_agent_state::logsink::LogSink,
    /// The controller's own handle on the store, for what it decides
    /// whoever asked (whether an uploaded charm is in use).
    pub owner: &'a Store,
}

/// The directory a call's charm names — `upload:ID`, an upload — moved
/// out of the pending ones to be kept (the store records its path). A
/// client names nothing else: the controller reads no path a caller gives.
fn charm_dir(cx: &Context<'_>, charm: &str) -> Result<PathBuf> {
    let Some(id) = charm.strip_prefix(jujube_wire::client::UPLOAD_PREFIX) else {
        bail!("charm `{charm}` is not an upload; the controller reads no path a client names: upload the charm first (`jujube deploy` and `jujube upgrade-charm` do)");
    };
    let charms = cx.charms;
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!("charm `{charm}` is not an upload's id");
    }
    let pending = charms.join(jujube_api::clients::PENDING).join(id);
    let kept = charms.join(id);
    std::fs::rename(&pending, &kept).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => refusal!(
            "upload `{id}` not found: it was used already, or is older than an hour; deploy again"
        ),
        _ => refusal!("cannot keep upload `{id}`: {e}; check the controller's disk"),
    })?;
    if let Err(e) = keep_archive(cx.owner, &kept) {
        let _ = std::fs::remove_dir_all(&kept);
        return Err(e);
    }
    Ok(kept)
}

/// One archive made at a time: each is held in memory (at most
/// [`jujube_state::services::MAX_CHARM_ARCHIVE`]).
static ARCHIVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Keeps the archive of the charm kept in `dir` in the state, under the
/// path the store records for it, for the other controllers (`enable-ha`)
/// to restore it from.
fn keep_archive(owner: &Store, dir: &std::path::Path) -> Result<()> {
    let _one = ARCHIVING.lock().unwrap_or_else(|p| p.into_inner());
    let path = std::fs::canonicalize(dir)
        .with_context(|| format!("cannot read the kept charm `{}`", dir.display()))?;
    let mut archive = Vec::new();
    jujube_agent::charmdir::write_archive(&path, &mut archive)
        .map_err(|e| refusal!("{}", e.message))?;
    owner.keep_charm_archive(&path.to_string_lossy(), &archive)?;
    Ok(())
}

/// How long a command waits for the provider's zones before accepting the
/// constraints unchecked (a start in an unknown zone is then a provisioning
/// error naming the zones there are).
pub const ZONE_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Answers `call` on `store` (a handle acting for the caller), as JSON:
/// written once, or (`status`: 34 MB at 100,000 units) as it is sent.
pub fn call(cx: &Context<'_>, store: &Store, call: ClientCall) -> Result<Answer, ClientError> {
    answer(cx, store, call).map_err(|e| ClientError {
        message: e.to_string(),
        usage: matches!(e, Error::Usage(_)),
        unavailable: e.is_unavailable(),
    })
}

fn json<T: serde::Serialize>(v: T) -> Result<Answer> {
    Ok(Answer::Json(jujube_wire::client::raw(&v)))
}

/// What keeps this controller running when it dies, as `bootstrap` set it
/// in the controller's environment.
pub const KEPT_BY: &str = "JUJUBE_CONTROLLER_KEPT_BY";

/// A controller machine's jobs run in its controller, not in an agent of
/// its own: the store tells it `started` while that controller records
/// itself; this says what restarts it.
fn controllers_run(st: &mut jujube_wire::view::Status) {
    let info = match std::env::var(KEPT_BY).as_deref() {
        Ok("supervisor") => {
            "its jobs run in a controller left running in the background (restarted if it dies)"
        }
        Ok("init") => {
            "its jobs run in the controller in its container (restarted by its init if it dies)"
        }
        _ => "its jobs run in the controller",
    };
    for (_, m) in st.machines.0.iter_mut() {
        let manages = m
            .jobs
            .iter()
            .any(|j| j == jujube_wire::view::JOB_MANAGE_ENVIRON);
        if manages && m.agent_status == "started" && m.agent_status_info.is_empty() {
            m.agent_status_info = info.into();
        }
    }
}

/// What a call needs of its user, checked before it does anything (the
/// store checks again in each transaction): nothing outside the store —
/// an upload kept, the provider asked for its zones — happens for a caller
/// who may not make the call.
fn needs(call: &ClientCall) -> Access {
    match call {
        ClientCall::Status
        | ClientCall::Environment
        | ClientCall::GetConstraints { .. }
        | ClientCall::Get { .. }
        | ClientCall::GetEnvironment
        | ClientCall::Strays
        | ClientCall::Task { .. }
        | ClientCall::WaitState
        | ClientCall::DebugLog { .. } => Access::Read,
        ClientCall::Users | ClientCall::SetPassword { .. } => Access::None,
        ClientCall::QueueRun { .. }
        | ClientCall::RunResult { .. }
        | ClientCall::ForgetRun { .. }
        | ClientCall::AddUser { .. }
        | ClientCall::EnableHa { .. }
        | ClientCall::ChangeAccess { .. } => Access::Admin,
        _ => Access::Write,
    }
}

fn answer(cx: &Context<'_>, store: &Store, call: ClientCall) -> Result<Answer> {
    store.require(needs(&call))?;
    match call {
        ClientCall::Status => {
            let mut st = store.status()?;
            controllers_run(&mut st);
            Ok(Answer::streamed(st))
        }
        ClientCall::Environment => {
            let env = store.environment()?;
            json(EnvironmentInfo {
                name: env.name,
                uuid: env.uuid,
                provider: env.provider,
                default_series: env.default_series,
                controllers: store.controller_machines()?,
                controller_status: store.controllers_status()?,
            })
        }
        ClientCall::GetConstraints { service } => json(
            match service {
                Some(s) => store.service(&s)?.constraints,
                None => store.environment()?.constraints,
            }
            .to_string(),
        ),
        ClientCall::Get { service } => json(settings(store, &service)?),
        ClientCall::GetEnvironment => json(store.environment_config()?),
        ClientCall::Strays => json(store.strays()?),
        ClientCall::Task { id } => match store.task(id) {
            Err(jujube_state::Error::NotFound { .. }) => bail!(
                "task `{id}` not found: a unit keeps its last 100 tasks, and a removed unit's go with it (`jujube run --background` prints a task's id)"
            ),
            r => json(r?),
        },
        ClientCall::RunResult { id } => json(store.run_result(id)?),
        ClientCall::WaitState => json(WaitState {
            stuck: crate::run::stuck(store)?,
            progress: store.progress()?,
            errors: crate::run::errors_listed(store)?,
        }),
        ClientCall::Deploy {
            charm,
            url_series,
            series: series_flag,
            service,
            units,
            constraints,
            to,
            settings,
        } => {
            let dir = charm_dir(cx, &charm)?;
            let uploaded = charm.starts_with(jujube_wire::client::UPLOAD_PREFIX);
            let deployed = (|| {
            let loaded = charm::read_dir(dir.clone(), url_series)?;
            let env = store.environment()?;
            let series_ = match (&series_flag, &loaded.url_series) {
                (Some(f), Some(u)) if f != u => {
                    return Err(usage(format!("`--series {f}` contradicts the charm's series `{u}` in `{charm}`; drop one of them")))
                }
                (Some(s), _) | (None, Some(s)) => s.clone(),
                (None, None) => loaded.charm.meta.series.first().cloned().unwrap_or(env.default_series.clone()),
            };
            series::validate(&series_)?;
            let mut c = loaded.charm;
            c.url = format!("local:{series_}/{}", c.url);
            let subordinate = c.meta.subordinate;
            let units = units.unwrap_or(if subordinate { 0 } else { 1 });
            if to.is_some() && units != 1 {
                return Err(usage("`--to` places one unit; use `-n 1` with it"));
            }
            let constraints = constraints_for(cx, store, &env.provider, constraints.as_deref())?;
            let args = DeployArgs {
                service: service.unwrap_or_else(|| c.meta.name.clone()),
                charm: c,
                series: series_,
                constraints: constraints.unwrap_or_default(),
                units,
                to,
                settings,
            };
            let added = store.deploy(&args)?;
            Ok(Deployed {
                charm_url: store.service(&args.service)?.charm_url,
                service: args.service,
                units: added.len(),
            })
            })();
            if uploaded {
                keep_if_used(cx.owner, &dir);
            }
            json(deployed?)
        }
        ClientCall::AddUnits { service, n, to } => {
            if to.is_some() && n > 1 {
                return Err(usage("`--to` places one unit; use `-n 1` with it"));
            }
            if n == 0 {
                return Err(usage("`-n` must be at least 1"));
            }
            json(store.add_units(&service, n, to)?)
        }
        ClientCall::AddMachines {
            n,
            series,
            constraints,
        } => {
            if n == 0 {
                return Err(usage("`-n` must be at least 1"));
            }
            let provider = store.environment()?.provider;
            let cons = constraints_for(cx, store, &provider, constraints.as_deref())?;
            json(store.add_machines(n, series.as_deref(), cons.as_ref())?)
        }
        ClientCall::EnableHa { n } => {
            if cx.owner.path().is_some() {
                bail!("`enable-ha` needs the environment's state in PostgreSQL: its SQLite file lives on machine 0 alone and would go with it; bootstrap an environment with `--config state-url=postgres://USER@HOST:PORT/DB`");
            }
            let provider = store.environment()?.provider;
            let in_container = crate::machine0::advertised().is_some();
            match provider.as_str() {
                "dummy" => {}
                // The provisioner installs each one from this controller's
                // container (`machine0::ControllerSeed`).
                "lxd" if in_container => {}
                // Likewise from this controller's instance
                // (`machine0_ec2::Ec2Seed`).
                "ec2" if crate::machine0_ec2::on_instance().is_some() => {
                    let config = store.environment_config()?;
                    let uuid = store.environment()?.uuid;
                    if let Err(why) = crate::machine0_ec2::controllers_profile(&config, &uuid) {
                        bail!("{why}");
                    }
                }
                "ec2" => bail!("`enable-ha` on EC2 needs the controller on machine 0's instance, which installs the others on instances of their own; this controller runs where bootstrap ran: bootstrap a new environment without `--manual-controller`"),
                "lxd" => bail!("`enable-ha` on LXD needs the controller in machine 0's container, told by its `controller.env` where the daemon's host exposes its API (`{}`, which this version's `bootstrap` writes); this controller was not: bootstrap a new environment without `--manual-controller`", crate::machine0::API_ADVERTISE),
                _ => bail!("`enable-ha` runs controller machines on the dummy, LXD and EC2 providers, not on `{provider}`; bootstrap an environment on one of those to run several controllers"),
            }
            json(store.enable_ha(n)?)
        }
        ClientCall::SetConstraints {
            service,
            constraints,
        } => {
            let cons = Constraints::parse_words(constraints.iter().map(String::as_str))?;
            let provider = store.environment()?.provider;
            jujube_providers::check_supported(&provider, &cons)?;
            check_zones(cx, store, &provider, Some(&cons))?;
            match service {
                Some(s) => store.set_service_constraints(&s, &cons)?,
                None => store.set_environment_constraints(&cons)?,
            }
            json(())
        }
        ClientCall::Set { service, settings } => {
            store.set_service_settings(&service, &settings)?;
            json(())
        }
        ClientCall::SetEnvironment { config } => {
            let mut merged = store.environment_config()?;
            for (k, v) in &config {
                if v.is_empty() {
                    merged.remove(k);
                } else {
                    merged.insert(k.clone(), v.clone());
                }
            }
            crate::run::validate_config(&store.environment()?.provider, &merged)?;
            store.set_environment_config(&config)?;
            json(())
        }
        ClientCall::AddRelation { a, b } => json(store.add_relation(&a, &b)?.key),
        ClientCall::DestroyRelation { a, b } => json(store.destroy_relation(&a, &b)?),
        ClientCall::DestroyUnits { units } => json(store.destroy_units(&units)?),
        ClientCall::DestroyService { service } => json(store.destroy_service(&service)?),
        ClientCall::DestroyMachines { ids } => json(store.destroy_machines(&ids)?),
        ClientCall::ResolveAll { retry } => {
            let (listed, count) = store.resolve_all_units(retry)?;
            json(jujube_wire::client::Listed { listed, count })
        }
        ClientCall::ResolveUnit { unit, retry } => json(store.resolve_unit(&unit, retry)?),
        ClientCall::ResolveMachine { id, constraints } => {
            let provider = store.environment()?.provider;
            let cons = constraints_for(cx, store, &provider, constraints.as_deref())?;
            json(store.resolve_machine(id, cons.as_ref())?)
        }
        ClientCall::UpgradeCharm {
            service,
            path,
            force,
        } => {
            let svc = store.service(&service)?;
            let uploaded = path
                .as_deref()
                .is_some_and(|p| p.starts_with(jujube_wire::client::UPLOAD_PREFIX));
            let from = match path {
                Some(p) => charm_dir(cx, &p)?,
                None => PathBuf::from(store.charm(&svc.charm_url)?.path),
            };
            let upgraded = (|| {
                let loaded = charm::read_dir(from.clone(), None)?;
                let mut c = loaded.charm;
                c.url = format!("local:{}/{}", svc.series, c.url);
                Ok::<_, crate::Error>(store.upgrade_charm(&service, &c, force)?)
            })();
            if uploaded {
                keep_if_used(cx.owner, &from);
            }
            json(upgraded?)
        }
        ClientCall::RetryProvisioning { ids } => match ids {
            // Found and resolved in the same transactions, batch by batch:
            // a machine resolved meanwhile is no error.
            None => {
                let (listed, count) = store.retry_all_provisioning()?;
                json(jujube_wire::client::Listed { listed, count })
            }
            Some(ids) if ids.is_empty() => {
                Err(usage("name the machines to retry, or use `--all`"))
            }
            Some(ids) => {
                store.retry_provisioning(&ids)?;
                json(jujube_wire::client::Listed {
                    count: ids.len() as u64,
                    listed: ids,
                })
            }
        },
        ClientCall::QueueRun {
            unit,
            argv,
            timeout,
        } => json(store.queue_run(&unit, &argv, timeout)?),
        ClientCall::ForgetRun { id } => json(store.forget_run(id)?),
        ClientCall::QueueAction {
            unit,
            action,
            params,
            timeout,
        } => json(store.queue_action(&unit, &action, &params, timeout)?),
        ClientCall::DebugLog {
            include,
            lines,
            cursor,
        } => {
            let prefixes: Vec<String> = include.iter().map(|u| format!("{u}: ")).collect();
            let keep = |line: &str| prefixes.is_empty() || prefixes.iter().any(|p| line.starts_with(p));
            let read = cx.logs.read(cursor, lines, &keep)?;
            json(jujube_wire::client::LogLines {
                lines: read.lines,
                cursor: read.cursor,
                missed: read.missed,
            })
        }
        ClientCall::AddUser { name, access } => {
            let secret = new_secret();
            store.add_user(&name, access, &jujube_state::users::secret_hash(&secret))?;
            json(secret)
        }
        ClientCall::Users => json(store.users()?),
        ClientCall::ChangeAccess {
            name,
            access,
            grant,
        } => json(store.change_access(&name, access, grant)?),
        ClientCall::SetPassword { name, password } => {
            json(store.set_user_password(&name, &password)?)
        }
    }
}

/// Removes an uploaded charm's directory unless a charm of the store is
/// kept there, whatever the call answered: a call refused, or a charm the
/// store had already (its earlier copy is the one used), leaves nothing
/// behind; one that added a service and then failed part-way keeps it.
fn keep_if_used(owner: &Store, dir: &std::path::Path) {
    let path = std::fs::canonicalize(dir).ok();
    let used = path
        .as_ref()
        .is_some_and(|d| owner.charm_kept_at(&d.to_string_lossy()).unwrap_or(true));
    if !used {
        if let Some(p) = &path {
            if let Err(e) = owner.forget_charm_archive(&p.to_string_lossy()) {
                tracing::warn!(error = %e, path = %p.display(), "cannot forget an unused charm's archive");
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn usage(message: impl Into<String>) -> Error {
    Error::Usage(message.into())
}

/// A random secret (two v4 UUIDs: 244 random bits), for registrations and
/// `admin`'s first password.
pub fn new_secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

fn settings(store: &Store, service: &str) -> Result<ServiceSettings> {
    let svc = store.service(service)?;
    let settings = store
        .service_settings(service)?
        .into_iter()
        .map(|s| {
            let default = s.value.is_none();
            let value = s.value.or(s.option.default.clone());
            (
                s.key,
                SettingOut {
                    kind: s.option.kind,
                    description: s.option.description,
                    value,
                    default,
                },
            )
        })
        .collect();
    Ok(ServiceSettings {
        service: svc.name,
        charm: svc.charm_url,
        settings,
    })
}

/// Constraints for an environment on `provider`: parsed, and refused before
/// anything changes if the provider cannot honour a key or has no such
/// zone.
fn constraints_for(
    cx: &Context<'_>,
    store: &Store,
    provider: &str,
    c: Option<&str>,
) -> Result<Option<Constraints>> {
    let cons = c.map(Constraints::parse).transpose()?;
    if let Some(cons) = &cons {
        jujube_providers::check_supported(provider, cons)?;
    }
    check_zones(cx, store, provider, cons.as_ref())?;
    Ok(cons)
}

/// Refuses constraints naming zones the provider does not have, where it
/// can list them.
fn check_zones(
    cx: &Context<'_>,
    store: &Store,
    provider: &str,
    cons: Option<&Constraints>,
) -> Result<()> {
    let Some(wanted) = cons.map(|c| c.zones()).filter(|z| !z.is_empty()) else {
        return Ok(());
    };
    let Some(known) = (cx.zones)(store) else {
        return Ok(());
    };
    let unknown: Vec<String> = wanted
        .iter()
        .filter(|z| !known.contains(z))
        .map(|z| format!("`{z}`"))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let quoted: Vec<String> = known.iter().map(|z| format!("`{z}`")).collect();
    bail!(
        "unknown zone {} in `zones={}`; provider `{provider}` has zones {}",
        unknown.join(", "),
        wanted.join(","),
        if quoted.is_empty() {
            "none".to_string()
        } else {
            quoted.join(", ")
        }
    )
}

/// The provider's zones, asked on `runtime` within [`ZONE_CHECK_TIMEOUT`].
pub fn zones_on(
    runtime: &tokio::runtime::Handle,
    home: &Home,
    name: &str,
    store: &Store,
) -> Option<Vec<String>> {
    runtime.block_on(async {
        tokio::time::timeout(ZONE_CHECK_TIMEOUT, async {
            let provider = crate::run::provider(home, name, store).await.ok()?;
            provider.zones().await.ok()
        })
        .await
        .ok()
        .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use jujube_wire::client::ADMIN;

    struct World {
        dir: tempfile::TempDir,
        store: Store,
        logs: jujube_agent_state::logsink::LogSink,
    }

    fn world() -> World {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("state.db")).unwrap();
        store
            .initialize(&jujube_state::environment::EnvironmentSpec {
                name: "t".into(),
                uuid: "6f1e0f4c-3d7e-4b53-9d3b-1a2b3c4d5e6f".into(),
                provider: "dummy".into(),
                default_series: "jammy".into(),
                constraints: Default::default(),
                config: Default::default(),
            })
            .unwrap();
        store.create_admin("pw").unwrap();
        let logs = jujube_agent_state::logsink::LogSink::open(&dir.path().join("logs")).unwrap();
        World { dir, store, logs }
    }

    fn ask(w: &World, user: &str, c: ClientCall) -> Result<serde_json::Value, ClientError> {
        ask_json(w, user, c).map(|a| serde_json::from_slice(&a.into_bytes()).unwrap())
    }

    fn ask_json(w: &World, user: &str, c: ClientCall) -> Result<Answer, ClientError> {
        let zones = |_: &Store| None;
        let charms = w.dir.path().join("charms");
        let cx = Context {
            zones: &zones,
            charms: &charms,
            logs: &w.logs,
            owner: &w.store,
        };
        call(&cx, &w.store.as_user(user), c)
    }

    fn deploy(charm: &str) -> ClientCall {
        ClientCall::Deploy {
            charm: charm.into(),
            url_series: None,
            series: None,
            service: None,
            units: None,
            constraints: None,
            to: None,
            settings: vec![],
        }
    }

    /// `wait`'s look at a large deploy names a bounded number of machines
    /// and counts the rest, whatever the deploy's size.
    #[test]
    fn waits_answer_names_a_bounded_number_of_machines() {
        let w = world();
        w.store.add_machines(50, None, None).unwrap();
        let a = ask(&w, ADMIN, ClientCall::WaitState).unwrap();
        let stuck: Vec<String> = serde_json::from_value(a["stuck"].clone()).unwrap();
        let machines: Vec<&String> = stuck
            .iter()
            .filter(|s| s.starts_with("machine ") && s.contains("has no instance yet"))
            .collect();
        // Machine 0 (no instance in this world) and the 50.
        let all = w.store.machines().unwrap().len();
        assert_eq!(all, 51);
        assert_eq!(machines.len(), 20, "{stuck:?}");
        assert!(machines[0].starts_with("machine 0 "), "{stuck:?}");
        let more = format!(
            "and {} more machine(s) waiting likewise (`jujube status` lists them)",
            all - 20
        );
        assert!(stuck.contains(&more), "{stuck:?}");
        assert_eq!(a["progress"]["machines"], all);
    }

    /// `wait` names at most 20 machines in error and counts the rest (it
    /// named every one, each with its message, and read every machine to
    /// find them); `retry-provisioning --all` answers as few and a count.
    #[test]
    fn machines_in_error_are_named_a_bounded_number_at_a_time() {
        let w = world();
        let ids = w.store.add_machines(50, None, None).unwrap();
        for &id in &ids {
            w.store
                .set_provisioning_error(id, &format!("cannot start machine {id}: no capacity"))
                .unwrap();
        }
        let a = ask(&w, ADMIN, ClientCall::WaitState).unwrap();
        let errors = a["errors"].as_str().unwrap();
        let named: Vec<&str> = errors
            .lines()
            .filter(|l| l.trim_start().starts_with("machine "))
            .collect();
        assert_eq!(named.len(), 20, "{errors}");
        assert_eq!(
            named[0].trim(),
            format!("machine {0}: cannot start machine {0}: no capacity", ids[0])
        );
        assert!(errors.starts_with("50 machine(s) in error:"), "{errors}");
        assert!(errors.contains("\n  and 30 more\n"), "{errors}");
        let retried = ask(&w, ADMIN, ClientCall::RetryProvisioning { ids: None }).unwrap();
        assert_eq!(retried["count"], 50);
        let listed: Vec<i64> = serde_json::from_value(retried["listed"].clone()).unwrap();
        assert_eq!(listed, ids[..20]);
        assert_eq!(ask(&w, ADMIN, ClientCall::WaitState).unwrap()["errors"], "");
    }

    #[test]
    fn the_controller_reads_no_path_a_client_names() {
        let w = world();
        let charm = w.dir.path().join("mysql");
        std::fs::create_dir_all(&charm).unwrap();
        std::fs::write(charm.join("metadata.yaml"), "name: mysql\nsummary: s\n").unwrap();
        let e = ask(&w, ADMIN, deploy(charm.to_str().unwrap())).unwrap_err();
        assert!(
            e.message
                .contains("is not an upload; the controller reads no path a client names"),
            "{}",
            e.message
        );
        let e = ask(&w, ADMIN, deploy("upload:../../etc")).unwrap_err();
        assert!(e.message.contains("is not an upload's id"), "{}", e.message);
        assert!(w.store.status().unwrap().services.0.is_empty());
    }

    #[test]
    fn a_user_who_may_not_change_the_model_touches_no_upload() {
        let w = world();
        w.store
            .as_user(ADMIN)
            .add_user("bob", jujube_wire::client::Access::Read, "h")
            .unwrap();
        let pending = w
            .dir
            .path()
            .join("charms")
            .join(jujube_api::clients::PENDING)
            .join("abc123");
        std::fs::create_dir_all(&pending).unwrap();
        std::fs::write(pending.join("metadata.yaml"), "name: mysql\nsummary: s\n").unwrap();
        let e = ask(&w, "bob", deploy("upload:abc123")).unwrap_err();
        assert!(e.message.contains("this needs `write`"), "{}", e.message);
        assert!(
            pending.join("metadata.yaml").is_file(),
            "the upload was left alone"
        );
        // The admin's deploy keeps it, used by the store.
        ask(&w, ADMIN, deploy("upload:abc123")).unwrap();
        assert!(!pending.exists());
        let kept = w.dir.path().join("charms/abc123");
        assert!(kept.join("metadata.yaml").is_file());
        // Its archive is in the state, for the other controllers: it
        // restores the same charm.
        let kept_at = std::fs::canonicalize(&kept).unwrap();
        let archive = w
            .store
            .charm_archive(&kept_at.to_string_lossy())
            .unwrap()
            .expect("the kept upload's archive");
        let restored = w.dir.path().join("restored");
        jujube_agent::charmdir::restore(&restored, &archive).unwrap();
        assert_eq!(
            std::fs::read_to_string(restored.join("metadata.yaml")).unwrap(),
            "name: mysql\nsummary: s\n"
        );
        // An identical charm uploaded again is not kept: the store has it,
        // and keeps no archive of it.
        let again = pending.with_file_name("def456");
        std::fs::create_dir_all(&again).unwrap();
        std::fs::write(again.join("metadata.yaml"), "name: mysql\nsummary: s\n").unwrap();
        let e = ask(&w, ADMIN, deploy("upload:def456")).unwrap_err();
        assert!(e.message.contains("already exists"), "{}", e.message);
        assert!(!w.dir.path().join("charms/def456").exists());
        let gone = kept_at.with_file_name("def456");
        assert_eq!(
            w.store.charm_archive(&gone.to_string_lossy()).unwrap(),
            None
        );
        assert!(w
            .store
            .charm_archive(&kept_at.to_string_lossy())
            .unwrap()
            .is_some());
    }
}
