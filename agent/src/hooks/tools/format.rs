//! The tools' output formats, as Juju's `--format` prints them.
//!
//! - `smart` (the default): nothing for no value, a string as it is, a
//!   boolean as `True`/`False`, a number in plain decimal (`5`, `0.5`; Juju
//!   1.25's juju/cmd, after it stopped printing `1e+07`), a list of strings
//!   one per line, anything else as YAML.
//! - `json`: one line; numbers as Go's `encoding/json` writes them (`5`, not
//!   `5.0`), so that a charm comparing output sees what Juju gave it.
//! - `yaml`: a YAML document.
//!
//! A non-empty output is written with one newline added, as Juju does: a
//! string that ends in a newline prints with two (YAML's own trailing
//! newlines are trimmed first).

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Smart,
    Json,
    Yaml,
}

impl Format {
    /// The `--format` value; the error is the flag's message.
    pub fn parse(v: &str) -> Result<Format, String> {
        match v {
            "smart" => Ok(Format::Smart),
            "json" => Ok(Format::Json),
            "yaml" => Ok(Format::Yaml),
            other => Err(format!(
                "invalid value {other:?} for flag --format: unknown format {other:?}"
            )),
        }
    }

    pub fn render(self, v: &Value) -> String {
        let mut s = match self {
            Format::Json => json(v),
            Format::Yaml => yaml(v),
            Format::Smart => smart(v),
        };
        if !s.is_empty() {
            s.push('\n');
        }
        s
    }
}

fn smart(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => match n.as_f64() {
            // Rust's shortest plain decimal: `5`, `0.5`, `10000000`.
            Some(f) if n.is_f64() => format!("{f}"),
            _ => n.to_string(),
        },
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        other => yaml(other),
    }
}

fn yaml(v: &Value) -> String {
    if v.is_null() {
        return String::new();
    }
    let mut s = yaml_serde::to_string(v).unwrap_or_default();
    s.truncate(s.trim_end_matches('\n').len());
    s
}

/// JSON as Go's `encoding/json` writes it: compact, keys sorted, numbers
/// without a gratuitous `.0`.
pub fn json(v: &Value) -> String {
    let mut out = String::new();
    write_json(&mut out, v);
    out
}

fn write_json(out: &mut String, v: &Value) {
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or_default();
            out.push_str(&go_json_float(f));
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_json(out, &map[k]);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Go's `encoding/json` float64: exponent form below 1e-6 and from 1e21,
/// with the exponent's leading zero dropped (`1e-07` becomes `1e-7`).
fn go_json_float(f: f64) -> String {
    go_style(f, -6, 21, 1)
}

fn go_style(f: f64, min_exp: i32, max_exp: i32, exp_digits: usize) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    if f == 0.0 {
        return "0".into();
    }
    // Rust's `{:e}` is the shortest round-trip mantissa: `1.5e-7`.
    let e = format!("{f:e}");
    let (mantissa, exp) = e.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if exp < min_exp || exp >= max_exp {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:0exp_digits$}", exp.abs())
    } else {
        format!("{f}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn smart_prints_as_juju() {
        let smart = |v: Value| Format::Smart.render(&v);
        assert_eq!(smart(Value::Null), "");
        assert_eq!(smart(json!("")), "");
        assert_eq!(smart(json!("a b")), "a b\n");
        assert_eq!(smart(json!("pew\npew\n")), "pew\npew\n\n");
        assert_eq!(smart(json!(true)), "True\n");
        assert_eq!(smart(json!(false)), "False\n");
        assert_eq!(smart(json!(42)), "42\n");
        assert_eq!(smart(json!(-3)), "-3\n");
        assert_eq!(smart(json!(5.0)), "5\n");
        assert_eq!(smart(json!(0.5)), "0.5\n");
        assert_eq!(smart(json!(1e7)), "10000000\n");
        assert_eq!(smart(json!(1.1)), "1.1\n");
        assert_eq!(smart(json!(["b", "a"])), "b\na\n");
        assert_eq!(smart(json!([])), "");
        assert_eq!(smart(json!({"b": 1, "a": "x"})), "a: x\nb: 1\n");
    }

    #[test]
    fn json_prints_as_go() {
        assert_eq!(Format::Json.render(&Value::Null), "null\n");
        assert_eq!(
            Format::Json.render(&json!({"b": 5.0, "a": [1, "x"]})),
            "{\"a\":[1,\"x\"],\"b\":5}\n"
        );
        assert_eq!(Format::Json.render(&json!(1.5e-7)), "1.5e-7\n");
        assert_eq!(Format::Json.render(&json!(0.000001)), "0.000001\n");
        assert_eq!(Format::Json.render(&json!([])), "[]\n");
        assert_eq!(Format::Json.render(&json!(1234567.0)), "1234567\n");
        assert_eq!(Format::Json.render(&json!(1e21)), "1e+21\n");
    }

    #[test]
    fn unknown_formats_are_refused_with_the_flags_message() {
        assert_eq!(
            Format::parse("xml").unwrap_err(),
            r#"invalid value "xml" for flag --format: unknown format "xml""#
        );
    }
}
