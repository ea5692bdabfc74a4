//! Scenarios every provider must pass, whatever cloud is behind it. A
//! provider's tests build a [`Subject`] against the real thing (the dummy
//! cloud, LocalStack, an LXD daemon) and call [`run_all`].
//!
//! Each scenario checks a guarantee documented on [`Provider`]; a failure
//! names the scenario and what went wrong.

use crate::{ErrorClass, Instance, Provider, StartSpec, TAG_ENV_UUID, TAG_MACHINE_ID, TAG_NONCE};
use jujube_core::Constraints;
use std::sync::Arc;
use std::time::Duration;

pub struct Subject {
    pub provider: Arc<dyn Provider>,
    pub env_uuid: String,
    /// The same cloud seen by another environment: its instances must be
    /// invisible and untouchable for `provider`.
    pub other: Arc<dyn Provider>,
    /// Constraints some instance satisfies, and some none does.
    pub satisfiable: Constraints,
    pub unsatisfiable: Constraints,
    pub series: String,
    /// How long listings may lag behind starts and stops.
    pub settle: Duration,
}

type Outcome = Result<(), String>;

fn spec(s: &Subject, machine: &str) -> StartSpec {
    StartSpec {
        machine_id: machine.to_string(),
        nonce: format!(
            "{}:{machine}:{}",
            &s.env_uuid[..8],
            uuid::Uuid::new_v4().simple()
        ),
        series: s.series.clone(),
        constraints: s.satisfiable.clone(),
        zone: None,
        controller: false,
        user_data: String::new(),
        agent: None,
    }
}

async fn listed(s: &Subject, id: &str) -> Result<bool, String> {
    Ok(s.provider
        .instances()
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .any(|i| i.id == id))
}

/// Polls until `want` holds for the listing or `settle` passes.
async fn eventually(s: &Subject, id: &str, want: bool) -> Outcome {
    let deadline = tokio::time::Instant::now() + s.settle;
    loop {
        if listed(s, id).await? == want {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "instance `{id}` listed={} after {:?}, wanted {want}",
                !want, s.settle
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn check_tags(s: &Subject, i: &Instance, sp: &StartSpec) -> Outcome {
    for (k, v) in [
        (TAG_ENV_UUID, s.env_uuid.as_str()),
        (TAG_MACHINE_ID, sp.machine_id.as_str()),
        (TAG_NONCE, sp.nonce.as_str()),
    ] {
        if i.tag(k) != Some(v) {
            return Err(format!(
                "instance `{}` tag `{k}` is {:?}, want `{v}`",
                i.id,
                i.tag(k)
            ));
        }
    }
    Ok(())
}

pub async fn start_tags_lists_and_looks_up(s: &Subject) -> Outcome {
    let sp = spec(s, "101");
    let i = s
        .provider
        .start_instance(&sp)
        .await
        .map_err(|e| format!("start: {e}"))?;
    check_tags(s, &i, &sp)?;
    eventually(s, &i.id, true).await?;
    let found = s
        .provider
        .instances_by_id(std::slice::from_ref(&i.id))
        .await
        .map_err(|e| e.to_string())?;
    if found.len() != 1 || found[0].id != i.id {
        return Err(format!("lookup of `{}` found {found:?}", i.id));
    }
    s.provider
        .stop_instances(std::slice::from_ref(&i.id))
        .await
        .map_err(|e| e.to_string())?;
    eventually(s, &i.id, false).await
}

pub async fn start_is_idempotent_per_nonce(s: &Subject) -> Outcome {
    let sp = spec(s, "102");
    let a = s
        .provider
        .start_instance(&sp)
        .await
        .map_err(|e| format!("first start: {e}"))?;
    let b = s
        .provider
        .start_instance(&sp)
        .await
        .map_err(|e| format!("second start: {e}"))?;
    if a.id != b.id {
        return Err(format!(
            "one nonce started two instances: `{}` and `{}`",
            a.id, b.id
        ));
    }
    eventually(s, &a.id, true).await?;
    let with_nonce = s
        .provider
        .instances()
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|i| i.nonce() == Some(&sp.nonce))
        .count();
    s.provider
        .stop_instances(std::slice::from_ref(&a.id))
        .await
        .map_err(|e| e.to_string())?;
    if with_nonce != 1 {
        return Err(format!("{with_nonce} instances carry nonce `{}`", sp.nonce));
    }
    Ok(())
}

pub async fn batch_start_gives_one_result_per_spec(s: &Subject) -> Outcome {
    let specs: Vec<StartSpec> = (0..3).map(|i| spec(s, &format!("11{i}"))).collect();
    let results = s.provider.start_instances(&specs).await;
    if results.len() != 3 {
        return Err(format!("{} results for 3 specs", results.len()));
    }
    let mut ids = Vec::new();
    for (r, sp) in results.into_iter().zip(&specs) {
        let i = r.map_err(|e| format!("start of machine {}: {e}", sp.machine_id))?;
        check_tags(s, &i, sp)?;
        ids.push(i.id);
    }
    ids.sort();
    ids.dedup();
    s.provider
        .stop_instances(&ids)
        .await
        .map_err(|e| e.to_string())?;
    if ids.len() != 3 {
        return Err("batch start reused an instance".into());
    }
    Ok(())
}

pub async fn stop_is_idempotent_and_ignores_unknown_ids(s: &Subject) -> Outcome {
    let i = s
        .provider
        .start_instance(&spec(s, "103"))
        .await
        .map_err(|e| format!("start: {e}"))?;
    let ids = vec![i.id.clone(), "i-does-not-exist".to_string()];
    s.provider
        .stop_instances(&ids)
        .await
        .map_err(|e| format!("first stop: {e}"))?;
    s.provider
        .stop_instances(&ids)
        .await
        .map_err(|e| format!("second stop: {e}"))?;
    eventually(s, &i.id, false).await
}

pub async fn only_instances_tagged_with_this_environment_are_seen_or_stopped(
    s: &Subject,
) -> Outcome {
    let theirs = s
        .other
        .start_instance(&spec(s, "104"))
        .await
        .map_err(|e| format!("other env start: {e}"))?;
    tokio::time::sleep(s.settle).await;
    if listed(s, &theirs.id).await? {
        return Err(format!(
            "another environment's instance `{}` is listed as ours",
            theirs.id
        ));
    }
    if !s
        .provider
        .instances_by_id(std::slice::from_ref(&theirs.id))
        .await
        .map_err(|e| e.to_string())?
        .is_empty()
    {
        return Err("lookup by id returned another environment's instance".into());
    }
    s.provider
        .stop_instances(std::slice::from_ref(&theirs.id))
        .await
        .map_err(|e| e.to_string())?;
    let still = s
        .other
        .instances_by_id(std::slice::from_ref(&theirs.id))
        .await
        .map_err(|e| e.to_string())?;
    s.other
        .stop_instances(std::slice::from_ref(&theirs.id))
        .await
        .map_err(|e| e.to_string())?;
    if still.is_empty() {
        return Err(format!(
            "stopping another environment's instance `{}` worked; it must not",
            theirs.id
        ));
    }
    Ok(())
}

/// The hardware an instance reports meets what was asked for: `mem`,
/// `cores` and `root-disk` at least, `arch` exactly.
pub async fn started_instances_report_hardware_that_meets_their_constraints(
    s: &Subject,
) -> Outcome {
    let sp = spec(s, "106");
    let i = s
        .provider
        .start_instance(&sp)
        .await
        .map_err(|e| format!("start: {e}"))?;
    s.provider
        .stop_instances(std::slice::from_ref(&i.id))
        .await
        .map_err(|e| e.to_string())?;
    let hw = Constraints::parse(&i.hardware)
        .map_err(|e| format!("hardware `{}` does not parse: {e}", i.hardware))?;
    let want = &sp.constraints;
    for (key, asked, got) in [
        ("mem", want.mem(), hw.mem()),
        ("cores", want.cores(), hw.cores()),
        ("root-disk", want.root_disk(), hw.root_disk()),
    ] {
        if let Some(asked) = asked {
            match got {
                Some(got) if got >= asked => {}
                _ => {
                    return Err(format!(
                        "asked for `{key}` {asked}, instance `{}` reports hardware `{}`",
                        i.id, i.hardware
                    ))
                }
            }
        }
    }
    if want.arch().is_some() && want.arch() != hw.arch() {
        return Err(format!(
            "asked for `arch={}`, instance `{}` reports hardware `{}`",
            want.arch().unwrap_or_default(),
            i.id,
            i.hardware
        ));
    }
    Ok(())
}

pub async fn missing_ids_are_absent_from_lookups(s: &Subject) -> Outcome {
    let found = s
        .provider
        .instances_by_id(&["i-00000000000000000".to_string()])
        .await
        .map_err(|e| e.to_string())?;
    if found.is_empty() {
        Ok(())
    } else {
        Err(format!("lookup of a missing id returned {found:?}"))
    }
}

pub async fn zones_are_listed(s: &Subject) -> Outcome {
    let z = s.provider.zones().await.map_err(|e| e.to_string())?;
    if z.is_empty() {
        Err("no zones".into())
    } else {
        Ok(())
    }
}

pub async fn unsatisfiable_constraints_are_an_invalid_spec(s: &Subject) -> Outcome {
    s.provider
        .validate_constraints(&s.satisfiable)
        .await
        .map_err(|e| format!("satisfiable constraints refused: {e}"))?;
    let err = s
        .provider
        .validate_constraints(&s.unsatisfiable)
        .await
        .err()
        .ok_or("unsatisfiable constraints accepted")?;
    if err.class() != ErrorClass::InvalidSpec {
        return Err(format!("validate: want invalid-spec, got {err}"));
    }
    let mut sp = spec(s, "105");
    sp.constraints = s.unsatisfiable.clone();
    match s.provider.start_instance(&sp).await {
        Err(e) if e.class() == ErrorClass::InvalidSpec => Ok(()),
        Err(e) => Err(format!("start: want invalid-spec, got {e}")),
        Ok(i) => {
            let _ = s.provider.stop_instances(std::slice::from_ref(&i.id)).await;
            Err(format!("started `{}` for unsatisfiable constraints", i.id))
        }
    }
}

/// Runs every scenario; returns the failures (empty when all pass).
pub async fn run_all(s: &Subject) -> Vec<String> {
    let mut failures = Vec::new();
    macro_rules! scenario {
        ($f:ident) => {
            if let Err(e) = $f(s).await {
                failures.push(format!("{}: {e}", stringify!($f)));
            }
        };
    }
    scenario!(start_tags_lists_and_looks_up);
    scenario!(start_is_idempotent_per_nonce);
    scenario!(batch_start_gives_one_result_per_spec);
    scenario!(stop_is_idempotent_and_ignores_unknown_ids);
    scenario!(only_instances_tagged_with_this_environment_are_seen_or_stopped);
    scenario!(started_instances_report_hardware_that_meets_their_constraints);
    scenario!(missing_ids_are_absent_from_lookups);
    scenario!(zones_are_listed);
    scenario!(unsatisfiable_constraints_are_an_invalid_spec);
    failures
}
