//! The hook tools, with Juju's flags and output formats.
//!
//! `--format smart` (the default) prints a string as it is, a list one item
//! per line and a map as YAML; `json` and `yaml` print the value so. `-r`
//! takes a relation id as `name:id` (what `relation-ids` prints) or `id`.

use super::context::{HookContext, Output};
use std::collections::BTreeMap;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Smart,
    Json,
    Yaml,
}

struct Parsed {
    format: Format,
    relation: Option<String>,
    level: Option<String>,
    positional: Vec<String>,
}

fn parse(args: &[String], value_flags: &[&str]) -> Result<Parsed, String> {
    let mut p = Parsed {
        format: Format::Smart,
        relation: None,
        level: None,
        positional: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with('-') && f != "-" => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("flag needs an argument: {name}")),
            }
        };
        match flag {
            "--format" if value_flags.contains(&"--format") => {
                p.format = match value("--format")?.as_str() {
                    "smart" => Format::Smart,
                    "json" => Format::Json,
                    "yaml" => Format::Yaml,
                    other => {
                        return Err(format!(
                            "invalid value \"{other}\" for flag --format: unknown format; use json, smart or yaml"
                        ))
                    }
                }
            }
            "-r" | "--relation" if value_flags.contains(&"-r") => p.relation = Some(value(flag)?),
            "-l" | "--log-level" if value_flags.contains(&"-l") => p.level = Some(value(flag)?),
            "--debug" if value_flags.contains(&"-l") => p.level = Some("DEBUG".into()),
            "-" => p.positional.push(a.clone()),
            f if f.starts_with('-') && f.len() > 1 && inline.is_none() && f.parse::<f64>().is_err() => {
                return Err(format!("flag provided but not defined: {f}"))
            }
            _ => p.positional.push(a.clone()),
        }
    }
    Ok(p)
}

fn render(format: Format, v: &serde_json::Value) -> String {
    use serde_json::Value;
    match format {
        Format::Json => format!("{v}\n"),
        Format::Yaml => yaml(v),
        Format::Smart => match v {
            Value::Null => String::new(),
            Value::String(s) => format!("{s}\n"),
            Value::Bool(_) | Value::Number(_) => format!("{v}\n"),
            Value::Array(items) => items
                .iter()
                .map(|i| match i {
                    Value::String(s) => format!("{s}\n"),
                    other => format!("{other}\n"),
                })
                .collect(),
            Value::Object(_) => yaml(v),
        },
    }
}

fn yaml(v: &serde_json::Value) -> String {
    if v.is_null() {
        return String::new();
    }
    yaml_serde::to_string(v).unwrap_or_default()
}

/// Resolves `-r`: `name:id` or `id`, among the unit's relations.
fn relation_id(ctx: &HookContext, flag: Option<&str>) -> Result<i64, String> {
    let Some(text) = flag else {
        return ctx
            .relation
            .as_ref()
            .map(|(id, _)| *id)
            .ok_or_else(|| "no relation id specified".to_string());
    };
    let id = text.rsplit(':').next().unwrap_or(text);
    let id: i64 = id
        .parse()
        .map_err(|_| format!("invalid value \"{text}\" for flag -r: invalid relation id"))?;
    if ctx.relations.contains_key(&id) || ctx.relation.as_ref().is_some_and(|(r, _)| *r == id) {
        Ok(id)
    } else {
        Err(format!(
            "invalid value \"{text}\" for flag -r: relation not found"
        ))
    }
}

async fn settings_of(
    ctx: &HookContext,
    rel: i64,
    unit: &str,
) -> Result<BTreeMap<String, String>, String> {
    let key = (rel, unit.to_string());
    let mut cache = ctx.settings.lock().await;
    let mut settings = match cache.get(&key) {
        Some(s) => s.clone(),
        None => {
            let s = ctx.api.relation_settings(rel, unit).await.map_err(|e| {
                format!("cannot read settings of unit `{unit}` in relation {rel}: {e}")
            })?;
            cache.insert(key, s.clone());
            s
        }
    };
    drop(cache);
    // A unit reads its own settings with this hook's changes in.
    if unit == ctx.unit {
        if let Some(changes) = ctx.pending.lock().await.get(&rel) {
            for (k, v) in changes {
                match v {
                    Some(v) => settings.insert(k.clone(), v.clone()),
                    None => settings.remove(k),
                };
            }
        }
    }
    Ok(settings)
}

async fn members(ctx: &HookContext, rel: i64) -> Result<Vec<String>, String> {
    let mut cache = ctx.members.lock().await;
    if let Some(m) = cache.get(&rel) {
        return Ok(m.clone());
    }
    let m = ctx
        .api
        .scope_units(rel, &ctx.unit)
        .await
        .map_err(|e| format!("cannot list the units of relation {rel}: {e}"))?;
    cache.insert(rel, m.clone());
    Ok(m)
}

/// Runs `tool` with `args` in `ctx`.
pub async fn run(ctx: &HookContext, tool: &str, args: &[String]) -> Output {
    match run_inner(ctx, tool, args).await {
        Ok(out) => out,
        Err(e) => Output::fail(1, e),
    }
}

async fn run_inner(ctx: &HookContext, tool: &str, args: &[String]) -> Result<Output, String> {
    use serde_json::{json, Value};
    match tool {
        "juju-log" => {
            let p = parse(args, &["-l"])?;
            if p.positional.is_empty() {
                return Err("no message specified".into());
            }
            let line = format!(
                "{} {} {}: {}\n",
                chrono_free_now(),
                p.level.as_deref().unwrap_or("INFO"),
                ctx.unit,
                p.positional.join(" ")
            );
            use std::io::Write;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&ctx.log)
                .and_then(|mut f| f.write_all(line.as_bytes()))
                .map_err(|e| format!("cannot write the unit's log: {e}"))?;
            Ok(Output::ok(""))
        }
        "unit-get" => {
            let p = parse(args, &["--format"])?;
            let [key] = p.positional.as_slice() else {
                return Err("no setting specified; use private-address or public-address".into());
            };
            match key.as_str() {
                // Units of the dummy provider run on this host.
                "private-address" | "public-address" => {
                    // This machine's address (the spec's unit-get; with no
                    // public network of their own, both are the same).
                    let address = super::runner::private_address();
                    Ok(Output::ok(render(p.format, &json!(address))))
                }
                other => Err(format!("unknown setting \"{other}\"")),
            }
        }
        "config-get" => {
            let p = parse(args, &["--format"])?;
            let mut cache = ctx.config.lock().await;
            if cache.is_none() {
                let unit = ctx.api.unit(&ctx.unit).await.map_err(|e| e.to_string())?;
                *cache = Some(
                    ctx.api
                        .service_config(&unit.service)
                        .await
                        .map_err(|e| format!("cannot read the service's settings: {e}"))?,
                );
            }
            let config = cache.as_ref().expect("just read");
            let v = match p.positional.as_slice() {
                [] => json!(config),
                [key] => config.get(key).cloned().unwrap_or(Value::Null),
                _ => return Err(format!("unrecognized args: {:?}", &p.positional[1..])),
            };
            Ok(Output::ok(render(p.format, &v)))
        }
        "relation-ids" => {
            let p = parse(args, &["--format"])?;
            let name = match p.positional.as_slice() {
                [] => ctx
                    .relation
                    .as_ref()
                    .map(|(_, n)| n.clone())
                    .ok_or("no relation name specified")?,
                [n] => n.clone(),
                _ => return Err(format!("unrecognized args: {:?}", &p.positional[1..])),
            };
            let ids: Vec<String> = ctx
                .relations
                .iter()
                .filter(|(_, n)| **n == name)
                .map(|(id, n)| format!("{n}:{id}"))
                .collect();
            Ok(Output::ok(render(p.format, &json!(ids))))
        }
        "relation-list" => {
            let p = parse(args, &["--format", "-r"])?;
            let rel = relation_id(ctx, p.relation.as_deref())?;
            if !p.positional.is_empty() {
                return Err(format!("unrecognized args: {:?}", p.positional));
            }
            Ok(Output::ok(render(
                p.format,
                &json!(members(ctx, rel).await?),
            )))
        }
        "relation-get" => {
            let p = parse(args, &["--format", "-r"])?;
            let rel = relation_id(ctx, p.relation.as_deref())?;
            let (key, unit) = match p.positional.as_slice() {
                [] => (None, None),
                [k] => (Some(k.clone()), None),
                [k, u] => (Some(k.clone()), Some(u.clone())),
                _ => return Err(format!("unrecognized args: {:?}", &p.positional[2..])),
            };
            let unit = unit
                .or_else(|| ctx.remote.clone())
                .ok_or("no unit id specified")?;
            let settings = settings_of(ctx, rel, &unit).await?;
            let v = match key.as_deref() {
                None | Some("-") => json!(settings),
                Some(k) => settings.get(k).map_or(Value::Null, |v| json!(v)),
            };
            Ok(Output::ok(render(p.format, &v)))
        }
        "relation-set" => {
            let p = parse(args, &["-r", "--format"])?;
            let rel = relation_id(ctx, p.relation.as_deref())?;
            if p.positional.is_empty() {
                return Err("no settings specified".into());
            }
            let mut changes = Vec::new();
            for kv in &p.positional {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| format!("expected \"key=value\", got \"{kv}\""))?;
                if k.is_empty() {
                    return Err(format!("expected \"key=value\", got \"{kv}\""));
                }
                changes.push((k.to_string(), (!v.is_empty()).then(|| v.to_string())));
            }
            let mut pending = ctx.pending.lock().await;
            let entry = pending.entry(rel).or_default();
            for (k, v) in changes {
                entry.insert(k, v);
            }
            Ok(Output::ok(""))
        }
        "open-port" | "close-port" => {
            let p = parse(args, &[])?;
            let [port] = p.positional.as_slice() else {
                return Err("no port specified; e.g. `open-port 80` or `open-port 53/udp`".into());
            };
            let port = if port.contains('/') {
                port.to_lowercase()
            } else {
                format!("{port}/tcp")
            };
            // Acts at once, not when the hook ends (charms-in-action.txt).
            ctx.api
                .set_port(&ctx.unit, &port, tool == "open-port")
                .await
                .map_err(|e| e.to_string())?;
            Ok(Output::ok(""))
        }
        other => Err(format!("unknown hook tool `{other}`")),
    }
}

/// Seconds since the epoch, for log lines (no date crate for one field).
fn chrono_free_now() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:03}", t.as_secs(), t.subsec_millis())
}
