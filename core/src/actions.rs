//! A charm's actions (`actions.yaml`) and the check an action's parameters
//! pass before it is queued.
//!
//! Juju describes each action's parameters with JSON Schema; charms use a
//! small part of it, and that part is what is checked here: each parameter's
//! `type` (`string`, `integer`, `number`, `boolean`, `array`, `object`), its
//! `enum` and `default`, the action's `required` list and
//! `additionalProperties` (true unless the charm says false, as Juju 3 has
//! it). Values typed on the command line (`key=value`) are read as the
//! parameter's type asks: `target=123` is the string `"123"` for a string
//! parameter (Juju reads it as YAML first and then refuses the number; this
//! is the kinder reading of the same rule), `level=3` an integer, and
//! `a.b=c` sets `c` under `b` of object `a`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The longest action name, and the most parameters' text an action may be
/// queued with.
pub const MAX_ACTION_NAME: usize = 64;
pub const MAX_PARAMS_BYTES: usize = 64 << 10;

/// The deepest an action's parameters may nest (a dotted key's parts and a
/// value's own arrays and maps, together): deeper could not be read back
/// (JSON readers stop at 128) and costs recursion wherever it is walked.
pub const MAX_PARAMS_DEPTH: usize = 32;

/// One action of `actions.yaml`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActionSpec {
    #[serde(default)]
    pub description: String,
    /// Parameter name → its JSON Schema.
    #[serde(default)]
    pub params: BTreeMap<String, Value>,
    #[serde(default)]
    pub required: Vec<String>,
    #[serde(
        default = "yes",
        rename = "additionalProperties",
        alias = "additional-properties"
    )]
    pub additional_properties: bool,
}

fn yes() -> bool {
    true
}

/// A charm's `actions.yaml`: action name → spec.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CharmActions(pub BTreeMap<String, ActionSpec>);

/// Why parameters were refused. The message names the action and the
/// parameter and says what is expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParamError(pub String);

impl CharmActions {
    /// Parses `actions.yaml` (empty text: no actions).
    pub fn parse(charm: &str, yaml: &str) -> crate::Result<CharmActions> {
        let invalid = |why: String| crate::Error::InvalidCharm {
            charm: charm.to_string(),
            why,
        };
        if yaml.trim().is_empty() {
            return Ok(CharmActions::default());
        }
        if crate::yaml::too_deep(yaml) {
            return Err(invalid(format!(
                "actions.yaml nests its brackets and braces more than {} deep",
                crate::yaml::MAX_FLOW_DEPTH
            )));
        }
        let v: Value = yaml_serde::from_str(yaml)
            .map_err(|e| invalid(format!("actions.yaml is not valid YAML: {e}")))?;
        let actions: CharmActions = match v {
            Value::Null => CharmActions::default(),
            v => serde_json::from_value(v).map_err(|e| {
                invalid(format!("actions.yaml: {e}; each action is a mapping with `description`, `params`, `required`"))
            })?,
        };
        for (name, spec) in &actions.0 {
            check_name(name).map_err(|why| invalid(format!("action `{name}`: {why}")))?;
            for (p, schema) in &spec.params {
                let kind = schema.get("type").and_then(Value::as_str);
                if let Some(k) = kind {
                    if !KINDS.contains(&k) {
                        return Err(invalid(format!(
                            "action `{name}` parameter `{p}` has unknown type `{k}`; use one of {}",
                            KINDS.join(", ")
                        )));
                    }
                }
                if let Some(d) = schema.get("default") {
                    check_value(name, p, schema, d).map_err(|e| invalid(e.0))?;
                }
            }
            for r in &spec.required {
                if !spec.params.contains_key(r) {
                    return Err(invalid(format!(
                        "action `{name}` requires `{r}`, which is not one of its params"
                    )));
                }
            }
        }
        Ok(actions)
    }

    /// The parameters `raw` (`key=value` as typed) for action `name`,
    /// checked and completed with defaults, as a JSON object.
    pub fn params(&self, name: &str, raw: &[String]) -> Result<Value, ParamError> {
        let spec = self.0.get(name).ok_or_else(|| {
            let known: Vec<String> = self.0.keys().map(|k| format!("`{k}`")).collect();
            ParamError(if known.is_empty() {
                format!("the charm has no action `{name}` (it has no actions.yaml)")
            } else {
                format!(
                    "the charm has no action `{name}`; its actions are {}",
                    known.join(", ")
                )
            })
        })?;
        let mut out = Map::new();
        for kv in raw {
            let (key, text) = kv.split_once('=').ok_or_else(|| {
                ParamError(format!(
                    "expected `key=value` for action `{name}`, got `{kv}`"
                ))
            })?;
            // Counted before anything is built from it: a key of 65,000
            // parts would nest as deep.
            if key.split('.').nth(MAX_PARAMS_DEPTH).is_some() || crate::yaml::too_deep(text) {
                return Err(too_deep(name));
            }
            let path: Vec<&str> = key.split('.').collect();
            if path.iter().any(|p| p.is_empty()) {
                return Err(ParamError(format!(
                    "invalid parameter name `{key}` for action `{name}`"
                )));
            }
            let schema = spec.params.get(path[0]);
            let value = match (schema, path.len()) {
                (Some(s), 1) => typed(s, text),
                _ => yaml_scalar(text),
            };
            insert(&mut out, &path, value).map_err(|()| {
                ParamError(format!(
                    "parameter `{key}` of action `{name}` is given twice or under a value"
                ))
            })?;
        }
        for (p, schema) in &spec.params {
            if !out.contains_key(p) {
                if let Some(d) = schema.get("default") {
                    out.insert(p.clone(), d.clone());
                }
            }
        }
        for r in &spec.required {
            if !out.contains_key(r) {
                return Err(ParamError(format!(
                    "action `{name}` needs parameter `{r}`: give it as `{r}=VALUE`"
                )));
            }
        }
        for (k, v) in &out {
            match spec.params.get(k) {
                Some(schema) => check_value(name, k, schema, v)?,
                None if !spec.additional_properties => {
                    let known: Vec<String> = spec.params.keys().map(|k| format!("`{k}`")).collect();
                    return Err(ParamError(format!(
                        "action `{name}` has no parameter `{k}`; its parameters are {}",
                        if known.is_empty() {
                            "none".to_string()
                        } else {
                            known.join(", ")
                        }
                    )));
                }
                None => {}
            }
        }
        let v = Value::Object(out);
        if depth(&v) > MAX_PARAMS_DEPTH {
            return Err(too_deep(name));
        }
        let len = v.to_string().len();
        if len > MAX_PARAMS_BYTES {
            return Err(ParamError(format!(
                "the parameters of action `{name}` are {len} bytes, more than the {MAX_PARAMS_BYTES} an action may take; pass large data another way (a file the action reads)"
            )));
        }
        Ok(v)
    }
}

fn too_deep(action: &str) -> ParamError {
    ParamError(format!(
        "the parameters of action `{action}` nest more than {MAX_PARAMS_DEPTH} levels deep; flatten them"
    ))
}

/// How deep `v` nests (a scalar is 0, `{"a": 1}` is 1), walked without
/// recursion.
fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|v| (v, d + 1))),
            Value::Object(m) => stack.extend(m.values().map(|v| (v, d + 1))),
            _ => {}
        }
    }
    deepest
}

const KINDS: &[&str] = &["string", "integer", "number", "boolean", "array", "object"];

/// Juju's rule for action names: lowercase letters and dashes, starting and
/// ending with a letter.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_ACTION_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "an action name is 1 to {MAX_ACTION_NAME} lowercase letters, digits and dashes, starting with a letter"
        ))
    }
}

/// `text` read as the schema's type asks; as YAML when that fails (the check
/// then says what was expected).
fn typed(schema: &Value, text: &str) -> Value {
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => Value::String(text.to_string()),
        Some("integer") => text
            .parse::<i64>()
            .map(Value::from)
            .unwrap_or_else(|_| yaml_scalar(text)),
        Some("number") => text
            .parse::<f64>()
            .ok()
            .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
            .unwrap_or_else(|| yaml_scalar(text)),
        _ => yaml_scalar(text),
    }
}

fn yaml_scalar(text: &str) -> Value {
    yaml_serde::from_str::<Value>(text)
        .ok()
        .filter(|v| !v.is_null() || text.trim() == "null" || text.trim() == "~")
        .unwrap_or_else(|| Value::String(text.to_string()))
}

fn insert(into: &mut Map<String, Value>, path: &[&str], v: Value) -> Result<(), ()> {
    match path {
        [last] => {
            if into.contains_key(*last) {
                return Err(());
            }
            into.insert(last.to_string(), v);
            Ok(())
        }
        [first, rest @ ..] => {
            let next = into
                .entry(first.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            match next {
                Value::Object(m) => insert(m, rest, v),
                _ => Err(()),
            }
        }
        [] => Err(()),
    }
}

fn check_value(action: &str, param: &str, schema: &Value, v: &Value) -> Result<(), ParamError> {
    let kind = schema.get("type").and_then(Value::as_str);
    let fits = match kind {
        None => true,
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some("array") => v.is_array(),
        Some("object") => v.is_object(),
        Some(_) => true,
    };
    if !fits {
        return Err(ParamError(format!(
            "parameter `{param}` of action `{action}` must be of type {}, not `{v}`",
            kind.unwrap_or("any")
        )));
    }
    if let Some(choices) = schema.get("enum").and_then(Value::as_array) {
        if !choices.contains(v) {
            let list: Vec<String> = choices.iter().map(|c| format!("`{c}`")).collect();
            return Err(ParamError(format!(
                "parameter `{param}` of action `{action}` must be one of {}, not `{v}`",
                list.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const YAML: &str = r#"
backup:
  description: Back up the database.
  params:
    target: {type: string, description: where}
    compress: {type: boolean, default: true}
    level: {type: integer, default: 3}
    mode: {type: string, enum: [full, incremental], default: full}
  required: [target]
  additionalProperties: false
free-form:
  description: Anything goes.
"#;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parameters_are_typed_by_the_schema_and_completed_with_defaults() {
        let a = CharmActions::parse("db", YAML).unwrap();
        let p = a
            .params(
                "backup",
                &args(&["target=123", "level=7", "compress=false"]),
            )
            .unwrap();
        assert_eq!(
            p,
            json!({"target": "123", "level": 7, "compress": false, "mode": "full"})
        );
        let p = a.params("free-form", &args(&["x.y=1", "x.z=a b"])).unwrap();
        assert_eq!(p, json!({"x": {"y": 1, "z": "a b"}}));
    }

    #[test]
    fn what_juju_refuses_before_queueing_is_refused() {
        let a = CharmActions::parse("db", YAML).unwrap();
        let refused = |raw: &[&str], needle: &str| {
            let e = a.params("backup", &args(raw)).unwrap_err().0;
            assert!(e.contains(needle), "{e}");
        };
        refused(&[], "needs parameter `target`");
        refused(&["target=a", "level=high"], "must be of type integer");
        refused(&["target=a", "compress=maybe"], "must be of type boolean");
        refused(&["target=a", "mode=partial"], "must be one of");
        refused(&["target=a", "colour=red"], "has no parameter `colour`");
        refused(&["target=a", "target=b"], "given twice");
        refused(&["target"], "expected `key=value`");
        let e = a.params("restore", &[]).unwrap_err().0;
        assert!(e.contains("`backup`, `free-form`"), "{e}");
        let big = format!("x={}", "a".repeat(MAX_PARAMS_BYTES));
        assert!(a
            .params("free-form", &[big])
            .unwrap_err()
            .0
            .contains("bytes"));
    }

    /// Nesting is bounded, whether by a dotted key (65,000 parts overflowed
    /// the stack building it) or by a value's own brackets, and together.
    #[test]
    fn parameters_nest_at_most_their_depth() {
        let a = CharmActions::parse("db", YAML).unwrap();
        let deep = |n: usize| format!("{}b=1", "a.".repeat(n));
        let e = a.params("free-form", &[deep(65_000)]).unwrap_err().0;
        assert!(e.contains("nest more than 32 levels"), "{e}");
        assert!(a.params("free-form", &[deep(MAX_PARAMS_DEPTH - 1)]).is_ok());
        assert!(a.params("free-form", &[deep(MAX_PARAMS_DEPTH)]).is_err());
        // A key 20 deep holding a value 20 deep.
        let both = format!("{}b={}{}", "a.".repeat(19), "[".repeat(20), "]".repeat(20));
        let e = a.params("free-form", &[both]).unwrap_err().0;
        assert!(e.contains("nest more than 32 levels"), "{e}");
        let e = a
            .params("free-form", &[format!("x={}", "[".repeat(100_000))])
            .unwrap_err()
            .0;
        assert!(e.contains("nest more than 32 levels"), "{e}");
        let v = a.params("free-form", &["x=[[1]]".to_string()]).unwrap();
        assert_eq!(depth(&v), 3);
    }

    #[test]
    fn a_bad_actions_yaml_is_refused_with_the_reason() {
        for (yaml, needle) in [
            ("Backup: {}", "action `Backup`"),
            ("b: {params: {x: {type: colour}}}", "unknown type `colour`"),
            (
                "b: {params: {x: {type: integer, default: nope}}}",
                "must be of type integer",
            ),
            ("b: {required: [y]}", "requires `y`"),
            ("b: [1, 2]", "each action is a mapping"),
        ] {
            let e = CharmActions::parse("db", yaml).unwrap_err().to_string();
            assert!(e.contains(needle), "{yaml}: {e}");
        }
        assert_eq!(
            CharmActions::parse("db", "").unwrap(),
            CharmActions::default()
        );
    }
}
