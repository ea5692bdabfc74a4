//! Charm metadata (`metadata.yaml`), config (`config.yaml`), endpoints, and
//! the rules that decide which endpoints may be related.
//!
//! Parsing takes YAML text (with `yaml_serde`, the YAML organization's
//! maintained continuation of `serde_yaml`); reading a charm directory is the
//! caller's job, which names the file for errors.

use crate::names;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Every principal charm implicitly provides `juju-info` (interface
/// `juju-info`), so that subordinates can attach to any principal.
pub const JUJU_INFO: &str = "juju-info";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    // Declared in canonical-key order: requirers first, then providers.
    Requirer,
    Provider,
    Peer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Requirer => "requirer",
            Role::Provider => "provider",
            Role::Peer => "peer",
        }
    }
    pub fn parse(s: &str) -> Option<Role> {
        [Role::Requirer, Role::Provider, Role::Peer]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
    /// The role an endpoint of this role relates to.
    pub fn counterpart(self) -> Role {
        match self {
            Role::Requirer => Role::Provider,
            Role::Provider => Role::Requirer,
            Role::Peer => Role::Peer,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Global,
    Container,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Container => "container",
        }
    }
    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "global" => Some(Scope::Global),
            "container" => Some(Scope::Container),
            _ => None,
        }
    }
}

/// One relation a charm declares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelationMeta {
    pub interface: String,
    #[serde(default)]
    pub scope: Scope,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
}

/// `db: mysql` is shorthand for `db: {interface: mysql}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RelationMetaYaml {
    Short(String),
    Full(RelationMeta),
}

fn relations<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, RelationMeta>, D::Error> {
    let raw: Option<BTreeMap<String, RelationMetaYaml>> = Option::deserialize(d)?;
    Ok(raw
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let meta = match v {
                RelationMetaYaml::Short(interface) => RelationMeta {
                    interface,
                    scope: Scope::Global,
                    limit: None,
                    optional: false,
                },
                RelationMetaYaml::Full(m) => m,
            };
            (k, meta)
        })
        .collect())
}

/// A charm's `metadata.yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CharmMeta {
    pub name: String,
    #[serde(default)]
    pub summary: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub subordinate: bool,
    /// Series the charm supports, first preferred; empty means "any".
    #[serde(default)]
    pub series: Vec<String>,
    #[serde(default, deserialize_with = "relations")]
    pub provides: BTreeMap<String, RelationMeta>,
    #[serde(default, deserialize_with = "relations")]
    pub requires: BTreeMap<String, RelationMeta>,
    #[serde(default, deserialize_with = "relations")]
    pub peers: BTreeMap<String, RelationMeta>,
}

impl CharmMeta {
    /// Parses and validates `metadata.yaml` text.
    pub fn parse(yaml: &str) -> Result<CharmMeta> {
        CharmMeta::parse_file("metadata.yaml", yaml)
    }

    /// [`CharmMeta::parse`], naming `file` (and the line) when the YAML is
    /// malformed.
    pub fn parse_file(file: &str, yaml: &str) -> Result<CharmMeta> {
        too_deep(file, yaml)?;
        let meta: CharmMeta = yaml_serde::from_str(yaml).map_err(|e| yaml_error(file, &e))?;
        meta.validate()?;
        Ok(meta)
    }

    /// Checks the rules every charm must keep. [`CharmMeta::parse`] calls
    /// it; callers that build metadata in code call it themselves.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(Error::InvalidCharm {
                charm: self.name.clone(),
                why,
            })
        };
        let declared = self.provides.len() + self.requires.len() + self.peers.len();
        if declared > MAX_RELATIONS_DECLARED {
            return bad(format!(
                "it declares {declared} relations (provides, requires and peers), more than the {MAX_RELATIONS_DECLARED} a charm may"
            ));
        }
        names::validate_service(&self.name).or_else(|_| {
            bad("its name must be a valid service name (lowercase words joined by hyphens)".into())
        })?;
        for s in &self.series {
            crate::series::validate(s)?;
        }
        let mut seen = BTreeMap::new();
        for (role, rels) in [
            (Role::Provider, &self.provides),
            (Role::Requirer, &self.requires),
            (Role::Peer, &self.peers),
        ] {
            for (name, rel) in rels {
                names::validate_relation(name)?;
                if (name.starts_with("juju-") || name == JUJU_INFO)
                    && !(role == Role::Requirer && rel.interface == JUJU_INFO)
                {
                    return bad(format!(
                        "relation `{name}` uses the reserved `juju-` prefix; rename it"
                    ));
                }
                if rel.interface.is_empty() {
                    return bad(format!("relation `{name}` has no interface"));
                }
                if rel.interface == JUJU_INFO && role == Role::Provider {
                    return bad(format!(
                        "relation `{name}` provides the reserved interface `juju-info`; every charm provides it already"
                    ));
                }
                if role == Role::Peer && rel.scope == Scope::Container {
                    // A principal entering such a scope would get a
                    // "subordinate" of its own service.
                    return bad(format!(
                        "peer relation `{name}` is container-scoped; a peer relation joins the units of one service, which never share a container: remove `scope: container` from it"
                    ));
                }
                if let Some(prev) = seen.insert(name.clone(), role) {
                    return bad(format!(
                        "relation `{name}` is declared twice (as {} and {})",
                        prev.as_str(),
                        role.as_str()
                    ));
                }
            }
        }
        if self.subordinate && !self.requires.values().any(|r| r.scope == Scope::Container) {
            return bad(
                "a subordinate charm must require at least one relation with `scope: container`"
                    .into(),
            );
        }
        Ok(())
    }

    /// Every endpoint of a service running this charm, including the implicit
    /// `juju-info` provider of principal charms.
    pub fn endpoints(&self, service: &str) -> Vec<Endpoint> {
        let mut out = Vec::new();
        if !self.subordinate {
            out.push(Endpoint {
                service: service.to_string(),
                relation: JUJU_INFO.to_string(),
                role: Role::Provider,
                interface: JUJU_INFO.to_string(),
                scope: Scope::Global,
            });
        }
        for (role, rels) in [
            (Role::Provider, &self.provides),
            (Role::Requirer, &self.requires),
            (Role::Peer, &self.peers),
        ] {
            for (name, rel) in rels {
                out.push(Endpoint {
                    service: service.to_string(),
                    relation: name.clone(),
                    role,
                    interface: rel.interface.clone(),
                    scope: rel.scope,
                });
            }
        }
        out
    }
}

/// A YAML error in `file`: the line it is on, and the parser's message
/// without its own location (which the error shows once, as the line).
/// Refuses `yaml` before it is parsed when it nests too deep to read (see
/// [`crate::yaml`]).
fn too_deep(file: &str, yaml: &str) -> Result<()> {
    if crate::yaml::too_deep(yaml) {
        return Err(Error::CharmFile {
            file: file.to_string(),
            line: None,
            why: format!(
                "its brackets and braces nest more than {} deep",
                crate::yaml::MAX_FLOW_DEPTH
            ),
        });
    }
    Ok(())
}

fn yaml_error(file: &str, e: &yaml_serde::Error) -> Error {
    let mut why = e.to_string();
    let line = e.location().map(|l| {
        let at = format!(" at line {} column {}", l.line(), l.column());
        if let Some(i) = why.find(&at) {
            why.replace_range(i..i + at.len(), "");
        }
        l.line()
    });
    Error::CharmFile {
        file: file.to_string(),
        line,
        why,
    }
}

/// One side of a relation: a service's relation, with role, interface and
/// scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    pub service: String,
    pub relation: String,
    pub role: Role,
    pub interface: String,
    pub scope: Scope,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.service, self.relation)
    }
}

/// True when two endpoints of *different* services can form a relation.
pub fn can_relate(a: &Endpoint, b: &Endpoint) -> bool {
    a.service != b.service
        && a.role != Role::Peer
        && a.role.counterpart() == b.role
        && a.interface == b.interface
}

/// The scope of a relation between these endpoints: container if either
/// side asks for it.
pub fn relation_scope(eps: &[Endpoint]) -> Scope {
    if eps.iter().any(|e| e.scope == Scope::Container) {
        Scope::Container
    } else {
        Scope::Global
    }
}

/// Sorts endpoints into canonical order (requirer before provider, then by
/// service name) and returns the relation's key, e.g. `wordpress:db mysql:db`.
/// Two relations are identical exactly when their keys are equal.
pub fn canonical_key(eps: &mut [Endpoint]) -> String {
    eps.sort_by(|a, b| (a.role, &a.service).cmp(&(b.role, &b.service)));
    eps.iter()
        .map(Endpoint::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

/// One option of `config.yaml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigOption {
    #[serde(rename = "type", default = "default_type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<SettingValue>,
    #[serde(default)]
    pub description: String,
}

fn default_type() -> String {
    "string".to_string()
}

/// A typed setting value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SettingValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    String(String),
}

impl fmt::Display for SettingValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingValue::Bool(b) => write!(f, "{b}"),
            SettingValue::Int(n) => write!(f, "{n}"),
            SettingValue::Float(x) => write!(f, "{x}"),
            SettingValue::String(s) => f.write_str(s),
        }
    }
}

/// A charm's `config.yaml`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CharmConfig {
    #[serde(default)]
    pub options: BTreeMap<String, ConfigOption>,
}

/// The most relation endpoints one charm declares (provides, requires and
/// peers together).
pub const MAX_RELATIONS_DECLARED: usize = 256;

/// The most options one charm's `config.yaml` declares.
pub const MAX_CONFIG_OPTIONS: usize = 1024;

impl CharmConfig {
    /// Parses and validates the `config.yaml` text of charm `charm`.
    pub fn parse(charm: &str, yaml: &str) -> Result<CharmConfig> {
        CharmConfig::parse_file("config.yaml", charm, yaml)
    }

    /// [`CharmConfig::parse`], naming `file` (and the line) when the YAML is
    /// malformed.
    pub fn parse_file(file: &str, charm: &str, yaml: &str) -> Result<CharmConfig> {
        too_deep(file, yaml)?;
        let cfg: CharmConfig = yaml_serde::from_str(yaml).map_err(|e| yaml_error(file, &e))?;
        if cfg.options.len() > MAX_CONFIG_OPTIONS {
            return Err(Error::InvalidCharm {
                charm: charm.to_string(),
                why: format!(
                    "its {file} declares {} options, more than the {MAX_CONFIG_OPTIONS} a charm may",
                    cfg.options.len()
                ),
            });
        }
        for (name, opt) in &cfg.options {
            if !["string", "int", "float", "boolean"].contains(&opt.kind.as_str()) {
                return Err(Error::InvalidCharm {
                    charm: charm.to_string(),
                    why: format!(
                        "option `{name}` has unknown type `{}`; use string, int, float or boolean",
                        opt.kind
                    ),
                });
            }
            if let Some(d) = &opt.default {
                opt.coerce(name, &d.to_string())
                    .map_err(|_| Error::InvalidCharm {
                        charm: charm.to_string(),
                        why: format!("option `{name}` has a default that is not a {}", opt.kind),
                    })?;
            }
        }
        Ok(cfg)
    }

    /// Checks `key=raw` against the options and returns the typed value.
    pub fn validate(&self, charm: &str, key: &str, raw: &str) -> Result<SettingValue> {
        let opt = self.options.get(key).ok_or_else(|| Error::UnknownSetting {
            key: key.to_string(),
            charm: charm.to_string(),
            options: if self.options.is_empty() {
                "none".to_string()
            } else {
                self.options
                    .keys()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        })?;
        opt.coerce(key, raw)
    }
}

impl ConfigOption {
    fn coerce(&self, key: &str, raw: &str) -> Result<SettingValue> {
        let invalid = |why: &str| Error::InvalidSetting {
            key: key.to_string(),
            value: raw.to_string(),
            why: why.to_string(),
        };
        Ok(match self.kind.as_str() {
            "int" => SettingValue::Int(raw.parse().map_err(|_| invalid("expected an integer"))?),
            // Finite only: NaN and infinities have no JSON, and a stored
            // `null` could not be read back as the option's value.
            "float" => SettingValue::Float(
                raw.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite())
                    .ok_or_else(|| invalid("expected a finite number"))?,
            ),
            "boolean" => SettingValue::Bool(match raw {
                "true" => true,
                "false" => false,
                _ => return Err(invalid("expected `true` or `false`")),
            }),
            _ => SettingValue::String(raw.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A charm's declared relations and options are bounded: one more is
    /// refused, naming the charm.
    #[test]
    fn a_charms_relations_and_options_are_bounded() {
        let provides: String = (0..MAX_RELATIONS_DECLARED)
            .map(|i| format!("  p{i}:\n    interface: i{i}\n"))
            .collect();
        let meta = format!("name: big\nsummary: s\nprovides:\n{provides}");
        assert_eq!(
            CharmMeta::parse(&meta).unwrap().provides.len(),
            MAX_RELATIONS_DECLARED
        );
        let err =
            CharmMeta::parse(&format!("{meta}peers:\n  one:\n    interface: x\n")).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("invalid charm `big`: it declares {} relations (provides, requires and peers), more than the {MAX_RELATIONS_DECLARED} a charm may", MAX_RELATIONS_DECLARED + 1)
        );
        let options = |n: usize| -> String {
            let o: String = (0..n)
                .map(|i| format!("  o{i}:\n    type: string\n"))
                .collect();
            format!("options:\n{o}")
        };
        assert_eq!(
            CharmConfig::parse("big", &options(MAX_CONFIG_OPTIONS))
                .unwrap()
                .options
                .len(),
            MAX_CONFIG_OPTIONS
        );
        let err = CharmConfig::parse("big", &options(MAX_CONFIG_OPTIONS + 1)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("invalid charm `big`: its config.yaml declares {} options, more than the {MAX_CONFIG_OPTIONS} a charm may", MAX_CONFIG_OPTIONS + 1)
        );
    }

    const WORDPRESS: &str =
        "name: wordpress\nsummary: blog\nrequires:\n  db:\n    interface: mysql\n\
                             provides:\n  website: http\npeers:\n  loadbalancer: reversenginx\n";
    const LOGGING: &str = "name: logging\nsubordinate: true\nrequires:\n  logging-directory:\n    \
                           interface: logging\n    scope: container\n  juju-info:\n    interface: juju-info\n    scope: container\n";

    #[test]
    fn metadata_parses_short_and_long_forms() {
        let m = CharmMeta::parse(WORDPRESS).unwrap();
        assert_eq!(m.requires["db"].interface, "mysql");
        assert_eq!(m.provides["website"].interface, "http");
        assert_eq!(m.peers["loadbalancer"].scope, Scope::Global);
        let eps = m.endpoints("wp");
        assert!(eps
            .iter()
            .any(|e| e.relation == JUJU_INFO && e.role == Role::Provider));
        assert_eq!(eps.len(), 4);
    }

    #[test]
    fn subordinates_need_a_container_requirement_and_get_no_juju_info() {
        let m = CharmMeta::parse(LOGGING).unwrap();
        assert!(m.subordinate);
        assert!(!m
            .endpoints("logging")
            .iter()
            .any(|e| e.role == Role::Provider));
        let err = CharmMeta::parse("name: x\nsubordinate: true\nrequires:\n  a: b\n").unwrap_err();
        assert!(err.to_string().contains("scope: container"), "{err}");
    }

    #[test]
    fn container_scoped_peer_relations_are_refused() {
        let err = CharmMeta::parse(
            "name: ring\npeers:\n  cluster:\n    interface: ring\n    scope: container\n",
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid charm `ring`: peer relation `cluster` is container-scoped; a peer relation joins the units of one service, which never share a container: remove `scope: container` from it"
        );
    }

    #[test]
    fn reserved_and_duplicate_relations_are_refused() {
        assert!(CharmMeta::parse("name: x\nprovides:\n  juju-foo: bar\n").is_err());
        assert!(CharmMeta::parse("name: x\nprovides:\n  a: b\nrequires:\n  a: c\n").is_err());
        assert!(CharmMeta::parse("name: X\n").is_err());
    }

    const EXAMPLES: [(&str, &str); 3] = [
        (
            "wordpress",
            include_str!("../../examples/charms/wordpress/metadata.yaml"),
        ),
        (
            "mysql",
            include_str!("../../examples/charms/mysql/metadata.yaml"),
        ),
        (
            "logging",
            include_str!("../../examples/charms/logging/metadata.yaml"),
        ),
    ];

    #[test]
    fn the_example_charms_parse() {
        for (name, text) in EXAMPLES {
            let m = CharmMeta::parse_file(&format!("{name}/metadata.yaml"), text).unwrap();
            assert_eq!(m.name, name);
            assert_eq!(m.series, ["jammy", "noble"]);
        }
        let wp = CharmMeta::parse(EXAMPLES[0].1).unwrap();
        assert_eq!(wp.requires["db"].interface, "mysql");
        assert_eq!(wp.provides["website"].interface, "http");
        assert_eq!(wp.peers["loadbalancer"].interface, "reversenginx");
        assert!(wp
            .description
            .starts_with("WordPress, as a jujube example charm."));
        let logging = CharmMeta::parse(EXAMPLES[2].1).unwrap();
        assert!(logging.subordinate);
        assert_eq!(logging.requires["juju-info"].scope, Scope::Container);
        let cfg = CharmConfig::parse_file(
            "wordpress/config.yaml",
            "wordpress",
            include_str!("../../examples/charms/wordpress/config.yaml"),
        )
        .unwrap();
        assert_eq!(
            cfg.options.keys().collect::<Vec<_>>(),
            ["debug", "port", "title"]
        );
        assert_eq!(cfg.options["port"].default, Some(SettingValue::Int(80)));
    }

    /// YAML output is byte for byte what `serde_yaml` 0.9.34 wrote before
    /// the move to `yaml_serde` (captured from it).
    #[test]
    fn yaml_output_is_unchanged_from_serde_yaml() {
        let wp = CharmMeta::parse(EXAMPLES[0].1).unwrap();
        assert_eq!(
            yaml_serde::to_string(&wp).unwrap(),
            r#"name: wordpress
summary: A blog, requiring a MySQL database
description: |
  WordPress, as a jujube example charm. Relate it to `mysql` for its
  database; it offers `website` (http) to load balancers and proxies.
subordinate: false
series:
- jammy
- noble
provides:
  website:
    interface: http
    scope: global
requires:
  db:
    interface: mysql
    scope: global
peers:
  loadbalancer:
    interface: reversenginx
    scope: global
"#
        );
        let cfg = CharmConfig::parse(
            "wordpress",
            include_str!("../../examples/charms/wordpress/config.yaml"),
        )
        .unwrap();
        assert_eq!(
            yaml_serde::to_string(&cfg).unwrap(),
            r#"options:
  debug:
    type: boolean
    default: false
    description: Turn on WordPress debug logging.
  port:
    type: int
    default: 80
    description: Port the site listens on.
  title:
    type: string
    default: My Blog
    description: The blog's title.
"#
        );
        // And reads back to the same value.
        assert_eq!(
            yaml_serde::from_str::<CharmMeta>(&yaml_serde::to_string(&wp).unwrap()).unwrap(),
            wp
        );
    }

    #[test]
    fn malformed_yaml_names_the_file_and_the_line() {
        let err = CharmMeta::parse_file(
            "charms/x/metadata.yaml",
            "name: x\nsummary: y\nprovides:\n\tdb: mysql\n",
        )
        .unwrap_err();
        let Error::CharmFile { file, line, why } = &err else {
            panic!("{err}");
        };
        assert_eq!((file.as_str(), *line), ("charms/x/metadata.yaml", Some(4)));
        assert!(why.contains("cannot start any token"), "{why}");
        assert!(
            err.to_string()
                .starts_with("cannot parse `charms/x/metadata.yaml` at line 4: "),
            "{err}"
        );
        assert!(
            err.to_string().ends_with("; fix it and deploy again"),
            "{err}"
        );
        // A value of the wrong type: the line of the value.
        let err = CharmMeta::parse_file("m.yaml", "name: x\nsubordinate: maybe\n").unwrap_err();
        assert!(
            matches!(&err, Error::CharmFile { line: Some(2), why, .. } if why.starts_with("subordinate: invalid type")),
            "{err}"
        );
        // The location is said once, as the line.
        assert!(!err.to_string().contains("column"), "{err}");
        let err = CharmConfig::parse_file(
            "c.yaml",
            "x",
            "options:\n  port:\n    type: int\n    default: [80\n",
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::CharmFile { file, line: Some(_), .. } if file == "c.yaml"),
            "{err}"
        );
        // Nothing a charm holds makes the parser panic.
        for text in ["", "[", "name: &a [*a]\n", "\u{0}"] {
            assert!(CharmMeta::parse(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn canonical_key_puts_requirers_first() {
        let wp = CharmMeta::parse(WORDPRESS).unwrap().endpoints("wordpress");
        let db = wp.iter().find(|e| e.relation == "db").unwrap().clone();
        let provider = Endpoint {
            service: "mysql".into(),
            relation: "db".into(),
            role: Role::Provider,
            interface: "mysql".into(),
            scope: Scope::Global,
        };
        assert!(can_relate(&db, &provider));
        let mut a = [provider.clone(), db.clone()];
        let mut b = [db, provider];
        assert_eq!(canonical_key(&mut a), "wordpress:db mysql:db");
        assert_eq!(canonical_key(&mut b), "wordpress:db mysql:db");
    }

    /// A charm's YAML nesting deeper than its bound is refused before it is
    /// parsed (200,000 brackets took the parser minutes).
    #[test]
    fn charm_files_nesting_too_deep_are_refused_unparsed() {
        let deep = format!("name: x\nsummary: {}", "[".repeat(200_000));
        let started = std::time::Instant::now();
        let err = CharmMeta::parse(&deep).unwrap_err().to_string();
        assert_eq!(
            err,
            "cannot parse `metadata.yaml`: its brackets and braces nest more than 64 deep; fix it and deploy again"
        );
        let err = CharmConfig::parse("x", &format!("options: {}", "{a: ".repeat(100_000)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("nest more than 64 deep"), "{err}");
        let err = crate::actions::CharmActions::parse("x", &"[".repeat(100_000))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nests its brackets and braces more than 64"),
            "{err}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn config_values_are_typed() {
        let cfg = CharmConfig::parse(
            "wp",
            "options:\n  port:\n    type: int\n    default: 80\n  debug:\n    type: boolean\n  title:\n    type: string\n",
        )
        .unwrap();
        assert_eq!(
            cfg.validate("wp", "port", "8080").unwrap(),
            SettingValue::Int(8080)
        );
        assert!(cfg.validate("wp", "port", "x").is_err());
        assert_eq!(
            cfg.validate("wp", "debug", "true").unwrap(),
            SettingValue::Bool(true)
        );
        let err = cfg.validate("wp", "nope", "1").unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown option `nope` for charm `wp`: the charm's options are `debug`, `port`, `title`"
        );
        assert!(CharmConfig::parse("wp", "options:\n  a:\n    type: list\n").is_err());
        let cfg = CharmConfig::parse("wp", "options:\n  ratio:\n    type: float\n").unwrap();
        assert_eq!(
            cfg.validate("wp", "ratio", "0.5").unwrap(),
            SettingValue::Float(0.5)
        );
        for bad in ["NaN", "nan", "inf", "-infinity", "1e999"] {
            let err = cfg.validate("wp", "ratio", bad).unwrap_err().to_string();
            assert!(err.contains("expected a finite number"), "{bad}: {err}");
        }
    }
}
