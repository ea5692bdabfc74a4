//! The hook tools, as Juju 1.25's `jujuc` commands behave: the same flags,
//! output formats, messages and exit statuses (where later Juju versions
//! differ, 1.25 is followed and the place says so).
//!
//! # Layout
//! - [`flags`]: the command line as Juju's command framework parses it, and
//!   each tool's usage for `--help`.
//! - [`format`]: `--format smart|json|yaml` as Juju prints values.
//! - this module: one [`Spec`] per tool and what it does with the hook
//!   context. A usage error (bad flag, missing or extra argument, bad value)
//!   exits 2 with `error: MSG`, a failure while running exits 1: charms
//!   (charmhelpers' `relation_get`) tell the two apart.
//!
//! The `jujube` binary run under a tool's name is only a client: it sends
//! the arguments, its working directory and, when `relation-set --file -`
//! asks for it, its standard input, and writes what comes back to its
//! stdout, stderr or the `--output` file.

pub mod flags;
pub mod format;

use super::context::{HookContext, Output};
use flags::{check_empty, Flag, Line, Parsed, Spec};
use format::Format;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The most a `relation-set --file` may hold: the tool channel's request
/// limit, so a file is bounded as arguments are.
pub const MAX_FILE_BYTES: u64 = super::context::MAX_REQUEST_BYTES as u64;

const FORMAT: Flag = Flag::value(
    None,
    "format",
    "smart",
    "specify output format (json|smart|yaml)",
);
const OUTPUT: Flag = Flag::string(Some('o'), "output", "", "specify an output file");
const RELATION: Flag = Flag::value(Some('r'), "relation", "", "specify a relation by id");
/// `relation-get/set/list --app` (Juju 2.7+): the application's settings.
const APP: Flag = Flag::bool(None, "app", "the application's settings, not a unit's");
/// Accepted and ignored with a warning, as Juju 1.25 does.
const DEPRECATED_FORMAT: Flag = Flag::string(None, "format", "", "deprecated format flag");

/// The purpose of every [`unsupported`] tool, which marks it.
const NOT_SUPPORTED: &str = "not supported by jujube";

/// A tool of a Juju feature jujube does not have (cloud credentials,
/// storage, secrets): it is there, so that a charm probing for
/// it gets Juju's "not supported" answer (exit 1), not "command not found".
/// Why jujube has no `name` (one of the [`unsupported`] tools).
fn unsupported_why(name: &str) -> &'static str {
    match name {
        "credential-get" => "jujube gives charms no cloud credentials",
        "resource-get" => "jujube has no resources for charms; ship the file in the charm",
        "relation-model-get" => "jujube has no cross-model relations",
        "juju-reboot" => "jujube does not reboot machines for charms",
        "add-metric" => "jujube collects no metrics",
        n if n.starts_with("storage-") => "jujube has no storage for charms",
        n if n.starts_with("secret-") => "jujube has no secrets for charms",
        n if n.starts_with("state-") => {
            "jujube keeps no charm state on the controller; keep it in the charm's directory"
        }
        _ => "jujube has no such feature",
    }
}

const fn unsupported(name: &'static str) -> Spec {
    Spec {
        name,
        args: "[...]",
        purpose: NOT_SUPPORTED,
        flags: &[FORMAT, OUTPUT],
        doc: "",
    }
}

/// The purpose of every [`secret`] tool, which marks it.
const NO_SECRETS: &str = "jujube keeps no secrets: every secret is not found";
/// `--label`: a secret named by its label rather than its ID.
const LABEL: Flag = Flag::string(None, "label", "", "a label used to identify the secret");

/// Whether `s` is a secret's URI as Juju writes one: `secret:ID`,
/// `secret://MODEL/ID` (the model by its UUID, lowercase) or the bare `ID`,
/// twenty characters of `[0-9a-z]`.
fn valid_secret_uri(s: &str) -> bool {
    let rest = s.strip_prefix("secret:").unwrap_or(s);
    let id = match rest.strip_prefix("//") {
        Some(path) => match path.split_once('/') {
            Some((model, id)) if is_lowercase_uuid(model) => id,
            _ => return false,
        },
        None => rest,
    };
    id.len() == 20
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
}

/// `8-4-4-4-12` lowercase hexadecimal digits.
fn is_lowercase_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(g, n)| {
            g.len() == n
                && g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// What `secret-add` and `secret-set` take besides the content.
const SECRET_FIELDS: &[Flag] = &[
    LABEL,
    Flag::string(None, "description", "", "the secret description"),
    Flag::string(
        None,
        "expire",
        "",
        "either a duration or time when the secret should expire",
    ),
    Flag::string(None, "rotate", "", "the secret rotation policy"),
    Flag::string(
        None,
        "owner",
        "application",
        "the owner of the secret, either the application or unit",
    ),
    Flag::string(None, "file", "", "a YAML file containing secret key values"),
];

/// A secret tool other than `secret-add` (which is [`unsupported`]): with
/// Juju's flags, so that `ops` calls parse, answering as Juju does for a
/// secret that does not exist — jujube keeps none. `ops` raises
/// `SecretNotFoundError` for an error saying "not found", which charms
/// catch; `secret-ids` lists none.
const fn secret(name: &'static str, args: &'static str, flags: &'static [Flag]) -> Spec {
    Spec {
        name,
        args,
        purpose: NO_SECRETS,
        flags,
        doc: "",
    }
}

/// Every tool: its command line. [`super::TOOLS`] names the same ones.
pub const SPECS: &[Spec] = &[
    Spec {
        name: "juju-log",
        args: "<message>",
        purpose: "write a message to the juju log",
        flags: &[
            Flag::bool(None, "debug", "log at debug level"),
            DEPRECATED_FORMAT,
            Flag::string(
                Some('l'),
                "log-level",
                "INFO",
                "Send log message at the given level",
            ),
        ],
        doc: "",
    },
    Spec {
        name: "status-set",
        args: "<maintenance | blocked | waiting | active> [message]",
        purpose: "set status information",
        flags: &[
            Flag::bool(None, "application", "set this status for the application to which the unit belongs if the unit is the leader"),
            Flag::bool(None, "service", "the same as --application (Juju 1.25's name)"),
        ],
        doc: "Sets the workload status of the charm. Message is optional.\n\
              The \"last updated\" attribute of the status is set, even if the\n\
              status and message are the same as what's already set.",
    },
    Spec {
        name: "status-get",
        args: "[--include-data] [--application]",
        purpose: "print status information",
        flags: &[
            Flag::bool(None, "application", "print status for all units of this application if this unit is the leader"),
            Flag::bool(None, "service", "the same as --application (Juju 1.25's name)"),
            Flag::bool(None, "include-data", "print all status data"),
            FORMAT,
            OUTPUT,
        ],
        doc: "By default, only the status value is printed.\n\
              If the --include-data flag is passed, the associated data are printed also.",
    },
    Spec {
        name: "is-leader",
        args: "",
        purpose: "print application leadership status",
        flags: &[FORMAT, OUTPUT],
        doc: "is-leader prints a boolean indicating whether the local unit is guaranteed to\n\
              be application leader for at least 30 seconds. If it fails, you should\n\
              assume that there is no such guarantee.",
    },
    Spec {
        name: "application-version-set",
        args: "<new-version>",
        purpose: "specify which version of the application is deployed",
        flags: &[],
        doc: "application-version-set tells Juju which version of the application\n\
              software is running. It is shown as the service's `version` in status.",
    },
    Spec {
        name: "network-get",
        args: "<binding-name>",
        purpose: "get network config",
        flags: &[
            Flag::bool(
                None,
                "primary-address",
                "(deprecated) print the binding's primary address",
            ),
            Flag::bool(None, "bind-address", "print the address to bind to"),
            Flag::bool(None, "ingress-address", "print the ingress-address"),
            Flag::bool(None, "egress-subnets", "print egress subnets"),
            Flag::value(Some('r'), "relation", "", "specify a relation by id"),
            FORMAT,
            OUTPUT,
        ],
        doc: "network-get returns the network config for a given binding name. Every\n\
              binding answers with the machine's address. With one of --bind-address,\n\
              --ingress-address or --egress-subnets, just that value is printed; with\n\
              several, a map of them.",
    },
    unsupported("credential-get"),
    unsupported("storage-get"),
    unsupported("storage-list"),
    unsupported("storage-add"),
    secret("secret-get", "<ID> [key[#base64]]", &[LABEL, Flag::bool(None, "peek", "get the latest revision just this time"), Flag::bool(None, "refresh", "get the latest revision and also get this same revision for subsequent calls"), FORMAT, OUTPUT]),
    secret("secret-info-get", "<ID>", &[LABEL, FORMAT, OUTPUT]),
    secret("secret-ids", "", &[FORMAT, OUTPUT]),
    secret("secret-set", "<ID> [key[#base64|#file]=value...]", SECRET_FIELDS),
    secret("secret-remove", "<ID>", &[Flag::string(None, "revision", "", "remove the specified revision")]),
    secret("secret-grant", "<ID>", &[Flag::string(Some('r'), "relation", "", "the relation with which to associate the grant"), Flag::string(None, "unit", "", "the unit to grant access")]),
    secret("secret-revoke", "<ID>", &[Flag::string(Some('r'), "relation", "", "the relation for which to revoke the grant"), Flag::string(None, "unit", "", "the unit to revoke access"), Flag::string(None, "app", "", "the application to revoke access")]),
    // With Juju's flags, so that `ops`' call gets "not supported", not a
    // flag error.
    Spec {
        name: "secret-add",
        args: "[key[#base64|#file]=value...]",
        purpose: NOT_SUPPORTED,
        flags: SECRET_FIELDS,
        doc: "",
    },
    unsupported("resource-get"),
    unsupported("relation-model-get"),
    unsupported("juju-reboot"),
    unsupported("add-metric"),
    unsupported("state-get"),
    unsupported("state-set"),
    unsupported("state-delete"),
    Spec {
        name: "goal-state",
        args: "",
        purpose: "print the status of the charm's peers and related units",
        flags: &[FORMAT, OUTPUT],
        doc: "goal-state prints what the unit's application and its relations are meant to\n\
              hold: the application's units and, per endpoint, the related applications and\n\
              their units, each with a status (active, dying; joined for an application).\n\
              `since` is when the question was answered: jujube keeps no time for these.",
    },
    Spec {
        name: "unit-get",
        args: "<setting>",
        purpose: "print public-address or private-address",
        flags: &[FORMAT, OUTPUT],
        doc: "",
    },
    Spec {
        name: "config-get",
        args: "[<key>]",
        purpose: "print service configuration",
        flags: &[
            Flag::bool(Some('a'), "all", "print all keys"),
            FORMAT,
            OUTPUT,
        ],
        doc: "When no <key> is supplied, all keys with values or defaults are printed. If\n\
              --all is set, all known keys are printed; those without defaults or values are\n\
              reported as null. <key> and --all are mutually exclusive.",
    },
    Spec {
        name: "relation-ids",
        args: "<name>",
        purpose: "list all relation ids with the given relation name",
        flags: &[FORMAT, OUTPUT],
        doc: "In a relation hook, <name> defaults to the hook's own relation name.",
    },
    Spec {
        name: "relation-list",
        args: "",
        purpose: "list relation units",
        flags: &[APP, FORMAT, OUTPUT, RELATION],
        doc: "-r must be specified when not in a relation hook. The units listed are those\n\
              whose -joined hook has run and that have not departed. With --app, the\n\
              remote application's name is printed instead.",
    },
    Spec {
        name: "relation-get",
        args: "<key> <unit id>",
        purpose: "get relation settings",
        flags: &[APP, FORMAT, OUTPUT, RELATION],
        doc: "relation-get prints the value of a unit's relation setting, specified by key.\n\
              If no key is given, or if the key is \"-\", all keys and values will be printed.\n\
              -r must be specified when not in a relation hook; <unit id> may be omitted\n\
              in a hook about a remote unit.",
    },
    Spec {
        name: "relation-set",
        args: "key=value [key=value ...]",
        purpose: "set relation settings",
        flags: &[
            APP,
            Flag::value(None, "file", "", "file containing key-value pairs"),
            DEPRECATED_FORMAT,
            RELATION,
        ],
        doc: "\"relation-set\" writes the local unit's settings for some relation. If no\n\
              relation is specified then the current relation is used. The setting values\n\
              are not inspected and are stored as strings. Setting an empty string causes\n\
              the setting to be removed. Duplicate settings are not allowed.\n\
              \n\
              The --file option should be used when one or more key-value pairs are too\n\
              long to fit within the command length limit of the shell or operating\n\
              system. The file will contain a YAML map containing the settings. Settings\n\
              in the file will be overridden by any duplicate key-value arguments. A value\n\
              of \"-\" for the filename means <stdin>. The changes are written when the\n\
              hook exits 0. With --app, the leader sets its application's settings.",
    },
    Spec {
        name: "opened-ports",
        args: "",
        purpose: "list all ports or ranges opened by the unit",
        flags: &[FORMAT, OUTPUT],
        doc: "Each port or range is printed as <port>/<protocol> or <from>-<to>/<protocol>.",
    },
    Spec {
        name: "leader-get",
        args: "[<key>]",
        purpose: "print application leadership settings",
        flags: &[FORMAT, OUTPUT],
        doc: "leader-get prints the value of a leadership setting specified by key. If no key\n\
              is given, or if the key is \"-\", all keys and values will be printed.",
    },
    Spec {
        name: "leader-set",
        args: "<key>=<value> [...]",
        purpose: "write application leadership settings",
        flags: &[],
        doc: "leader-set immediately writes the supplied key/value pairs to the controller,\n\
              which will then inform non-leader units of the change. It will fail if called\n\
              without arguments, or if called by a unit that is not currently application\n\
              leader. Setting a value to the empty string removes it.",
    },
    Spec {
        name: "action-get",
        args: "[<key>[.<key>.<key>...]]",
        purpose: "get action parameters",
        flags: &[FORMAT, OUTPUT],
        doc: "action-get will print the value of the parameter at the given key, serialized\n\
              as YAML. If multiple keys are passed, action-get will recurse into the param\n\
              map as needed.",
    },
    Spec {
        name: "action-set",
        args: "<key>=<value> [<key>=<value> ...]",
        purpose: "set action results",
        flags: &[],
        doc: "action-set adds the given values to the results map of the Action. This map\n\
              is returned to the user after the completion of the Action. Keys must start\n\
              and end with lowercase alphanumeric, and contain only lowercase alphanumeric,\n\
              hyphens and periods; a period nests the value under a map.",
    },
    Spec {
        name: "action-fail",
        args: "[\"<failure message>\"]",
        purpose: "set action fail status with message",
        flags: &[],
        doc: "action-fail sets the fail state of the action with a given error message.",
    },
    Spec {
        name: "action-log",
        args: "<message>",
        purpose: "record a progress message for the current action",
        flags: &[],
        doc: "",
    },
    Spec {
        name: "open-port",
        args: "<port>[/<protocol>] or <from>-<to>[/<protocol>]",
        purpose: "register a port or range to open",
        flags: &[DEPRECATED_FORMAT],
        doc: "The port range will only be open while the service is exposed.",
    },
    Spec {
        name: "close-port",
        args: "<port>[/<protocol>] or <from>-<to>[/<protocol>]",
        purpose: "ensure a port or range is always closed",
        flags: &[DEPRECATED_FORMAT],
        doc: "",
    },
];

/// Why a tool did not do its job: a usage error exits 2, a failure while
/// running exits 1.
#[derive(Debug)]
enum Failure {
    Usage(String),
    Run(String),
}

impl From<String> for Failure {
    fn from(s: String) -> Failure {
        Failure::Run(s)
    }
}

impl From<&str> for Failure {
    fn from(s: &str) -> Failure {
        Failure::Run(s.to_string())
    }
}

fn usage(msg: impl Into<String>) -> Failure {
    Failure::Usage(msg.into())
}

fn spec(tool: &str) -> Option<&'static Spec> {
    SPECS.iter().find(|s| s.name == tool)
}

/// Whether the client must send its standard input: `relation-set --file -`.
/// Uses the tool's own parser, so the client and the tool never disagree.
pub fn reads_stdin(tool: &str, args: &[String]) -> bool {
    match spec(tool).map(|s| s.parse(args)) {
        Some(Ok(Line::Run(p))) => tool == "relation-set" && p.get("file") == Some("-"),
        _ => false,
    }
}

/// What a tool's client sent besides its arguments.
#[derive(Debug, Default, Clone)]
pub struct Invocation<'a> {
    /// The tool's working directory: relative `--file` paths start there.
    pub cwd: Option<&'a str>,
    /// Standard input, when [`reads_stdin`] said it was needed.
    pub stdin: Option<&'a str>,
}

/// Runs `tool` with `args` in `ctx`.
pub async fn run(ctx: &HookContext, tool: &str, args: &[String], inv: &Invocation<'_>) -> Output {
    let Some(spec) = spec(tool) else {
        return Output::fail(1, format!("unknown hook tool `{tool}`"));
    };
    let parsed = match spec.parse(args) {
        Ok(Line::Help) => return Output::ok(spec.usage()),
        Ok(Line::Run(p)) => p,
        Err(e) => return Output::fail(2, e),
    };
    match run_tool(ctx, spec, parsed, inv).await {
        Ok(out) => out,
        Err(Failure::Usage(e)) => Output::fail(2, e),
        Err(Failure::Run(e)) => Output::fail(1, e),
    }
}

/// The output flags of a printing tool.
fn output(p: &Parsed) -> Result<(Format, Option<String>), Failure> {
    let format = Format::parse(p.get("format").unwrap_or("smart")).map_err(usage)?;
    // Written by the client, where the tool runs.
    Ok((
        format,
        p.get("output")
            .filter(|f| !f.is_empty())
            .map(str::to_string),
    ))
}

fn print(p: &Parsed, v: &Value) -> Result<Output, Failure> {
    let (format, file) = output(p)?;
    let mut out = Output::ok(format.render(v));
    out.file = file;
    Ok(out)
}

/// Juju 1.25's warning for the deprecated `--format` of tools that print
/// nothing (written before the tool runs, as Juju's is).
fn deprecated_format(spec: &Spec, p: &Parsed) -> String {
    match p.get("format") {
        Some(f) if !f.is_empty() => format!("--format flag deprecated for command {:?}", spec.name),
        _ => String::new(),
    }
}

/// Resolves `-r` (`name:id` or `id`) among the unit's relations, or the
/// hook's relation. Both errors are usage errors, as in Juju.
fn relation_id(ctx: &HookContext, p: &Parsed) -> Result<i64, Failure> {
    let Some(text) = p.get("relation").filter(|t| !t.is_empty()) else {
        return ctx
            .relation
            .as_ref()
            .map(|(id, _)| *id)
            .ok_or_else(|| usage("no relation id specified"));
    };
    let trimmed = text.rsplit(':').next().unwrap_or(text);
    let id: i64 = trimmed.parse().map_err(|_| {
        usage(format!(
            "invalid value {text:?} for flag -r: invalid relation id"
        ))
    })?;
    if ctx.relations.contains_key(&id) || ctx.relation.as_ref().is_some_and(|(r, _)| *r == id) {
        Ok(id)
    } else {
        // Juju 2+'s words, which `ops` reads as the relation being gone
        // (`RelationNotFoundError`); 1.25 said "unknown relation id".
        Err(usage(format!(
            "invalid value {text:?} for flag -r: relation not found"
        )))
    }
}

async fn settings_of(
    ctx: &HookContext,
    rel: i64,
    unit: &str,
) -> Result<BTreeMap<String, String>, Failure> {
    let key = (rel, unit.to_string());
    let mut cache = ctx.settings.lock().await;
    let mut settings = match cache.get(&key) {
        Some(s) => s.clone(),
        None => {
            let s = ctx.api.relation_settings(rel, unit).await.map_err(|e| {
                format!("cannot read settings for unit {unit:?} in relation {rel}: {e}")
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

async fn run_tool(
    ctx: &HookContext,
    spec: &Spec,
    p: Parsed,
    inv: &Invocation<'_>,
) -> Result<Output, Failure> {
    match spec.name {
        "juju-log" => juju_log(ctx, spec, p),
        "status-set" => {
            let application = p.is_set("application") || p.is_set("service");
            let (status, message) = match p.args.as_slice() {
                [] => return Err(usage("invalid args, require <status> [message] [data]")),
                [status] => (status.clone(), String::new()),
                [status, message] => (status.clone(), message.clone()),
                [_, _, extra, ..] => return Err(usage(format!("unrecognized args: [{extra:?}]"))),
            };
            if !["maintenance", "blocked", "waiting", "active"].contains(&status.as_str()) {
                return Err(usage(format!(
                    "invalid status {status:?}, expected one of [maintenance blocked waiting active]"
                )));
            }
            ctx.api
                .set_workload_status(&ctx.unit, application, &status, &message)
                .await
                .map_err(|e| e.message)?;
            Ok(Output::ok(""))
        }
        "status-get" => {
            let (format, _) = output(&p)?;
            check_empty(&p.args).map_err(usage)?;
            let include = p.is_set("include-data");
            // As Juju: the bare status only in the smart format without
            // --include-data; else a map, with the message and data when
            // asked.
            let details = |status: &str, message: &str| {
                let mut one = json!({ "status": status });
                if include {
                    one["message"] = json!(message);
                    one["status-data"] = json!({});
                }
                one
            };
            let bare = !include && matches!(format, Format::Smart);
            let v = if p.is_set("application") || p.is_set("service") {
                // Only the leader reads it (Juju's `this unit is not the
                // leader`); asking first lets a unit take a lost leadership,
                // as Juju's own check does.
                let leads = ctx.api.is_leader(&ctx.unit).await.map_err(|e| e.message)?;
                if !leads {
                    return Err(Failure::from(
                        "finding application status: this unit is not the leader".to_string(),
                    ));
                }
                let app = ctx
                    .api
                    .application_status(&ctx.unit)
                    .await
                    .map_err(|e| e.message)?;
                if bare {
                    json!(app.status)
                } else {
                    let mut one = details(&app.status, &app.message);
                    one["units"] = app
                        .units
                        .iter()
                        .map(|(name, (status, message))| (name.clone(), details(status, message)))
                        .collect::<serde_json::Map<_, _>>()
                        .into();
                    json!({ "application-status": one })
                }
            } else {
                let (status, message) = ctx
                    .api
                    .workload_status(&ctx.unit, false)
                    .await
                    .map_err(|e| e.message)?;
                if bare {
                    json!(status)
                } else {
                    details(&status, &message)
                }
            };
            print(&p, &v)
        }
        "application-version-set" => {
            let [version] = p.args.as_slice() else {
                return Err(usage("no version specified"));
            };
            ctx.api
                .set_workload_version(&ctx.unit, version)
                .await
                .map_err(|e| e.message)?;
            Ok(Output::ok(""))
        }
        "network-get" => {
            output(&p)?;
            let [binding, rest @ ..] = p.args.as_slice() else {
                return Err(usage("no arguments specified"));
            };
            if binding.is_empty() {
                return Err(usage("no binding name specified"));
            }
            check_empty(rest).map_err(usage)?;
            if p.get("relation").is_some_and(|t| !t.is_empty()) {
                relation_id(ctx, &p)?;
            }
            // Every binding is the machine's one address.
            let address = super::runner::private_address();
            let egress = json!([format!("{address}/32")]);
            // As Juju: the keys asked for, in this order; one is printed as
            // its value, several as a map.
            let keys: Vec<(&str, serde_json::Value)> = [
                ("bind-address", json!(address)),
                ("ingress-address", json!(address)),
                ("egress-subnets", egress.clone()),
            ]
            .into_iter()
            .filter(|(k, _)| p.is_set(k))
            .collect();
            let v = if p.is_set("primary-address") {
                if !keys.is_empty() {
                    return Err(Failure::Run(
                        "--primary-address must be the only flag specified".into(),
                    ));
                }
                json!(address)
            } else if let [(_, one)] = keys.as_slice() {
                one.clone()
            } else if !keys.is_empty() {
                serde_json::Value::Object(
                    keys.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                )
            } else {
                // Juju names an address `value` (JSON) and `address` as well
                // (its YAML, for older readers): both, for every reader.
                json!({
                    "bind-addresses": [{
                        "mac-address": "",
                        "interface-name": "",
                        "addresses": [{"hostname": "", "value": address, "address": address, "cidr": ""}],
                    }],
                    "egress-subnets": egress,
                    "ingress-addresses": [address],
                })
            };
            print(&p, &v)
        }
        "secret-ids" => {
            output(&p)?;
            check_empty(&p.args).map_err(usage)?;
            print(&p, &json!([]))
        }
        _ if spec.purpose == NO_SECRETS => {
            if spec.flags.iter().any(|f| f.long == "format") {
                output(&p)?;
            }
            let id = p.args.first().filter(|id| !id.is_empty());
            // As Juju: these name a secret by its ID only.
            let by_id = [
                "secret-set",
                "secret-remove",
                "secret-grant",
                "secret-revoke",
            ];
            if id.is_none() && by_id.contains(&spec.name) {
                return Err(usage("missing secret URI"));
            }
            if let Some(id) = id.filter(|id| !valid_secret_uri(id)) {
                return Err(usage(format!("secret URI {id:?} not valid")));
            }
            if spec.name == "secret-grant" && p.get("relation").is_none_or(str::is_empty) {
                return Err(usage("no relation id specified"));
            }
            let not_found = match (id, p.get("label").filter(|l| !l.is_empty())) {
                (Some(id), _) => format!("secret {id:?} not found"),
                (_, Some(label)) => format!("secret with label {label:?} not found"),
                (None, None) => return Err(usage("require either a secret URI or label")),
            };
            if spec.name == "secret-get" {
                if p.is_set("peek") && p.is_set("refresh") {
                    return Err(usage("specify one of --peek or --refresh but not both"));
                }
                // The ID, then at most one key.
                check_empty(p.args.get(2..).unwrap_or_default()).map_err(usage)?;
            }
            Err(Failure::Run(not_found))
        }
        // A failure (exit 1), which `ops` raises as `ModelError` and charms
        // catch; a missing tool would be `FileNotFoundError`.
        name if spec.purpose == NOT_SUPPORTED => Err(Failure::Run(format!(
            "{name} is not supported: {}",
            unsupported_why(name)
        ))),
        "is-leader" => {
            output(&p)?;
            check_empty(&p.args).map_err(usage)?;
            let leader = ctx.api.is_leader(&ctx.unit).await.map_err(|e| e.message)?;
            print(&p, &json!(leader))
        }
        "unit-get" => {
            let (_, _) = output(&p)?;
            let [key, rest @ ..] = p.args.as_slice() else {
                return Err(usage("no setting specified"));
            };
            if key != "private-address" && key != "public-address" {
                return Err(usage(format!("unknown setting {key:?}")));
            }
            check_empty(rest).map_err(usage)?;
            // This machine's address (the spec's unit-get; with no public
            // network of their own, both are the same).
            print(&p, &json!(super::runner::private_address()))
        }
        "config-get" => {
            output(&p)?;
            let all = p.is_set("all");
            let key = match p.args.as_slice() {
                [] => None,
                [key, rest @ ..] => {
                    if all {
                        return Err(usage(format!(
                            "cannot use argument --all together with key {key:?}"
                        )));
                    }
                    check_empty(rest).map_err(usage)?;
                    Some(key.clone())
                }
            };
            let config = config(ctx).await?;
            let v = match key {
                Some(k) => config.get(&k).cloned().unwrap_or(Value::Null),
                // Unset options (no value, no default) only with --all.
                None => Value::Object(
                    config
                        .into_iter()
                        .filter(|(_, v)| all || !v.is_null())
                        .collect(),
                ),
            };
            print(&p, &v)
        }
        "relation-ids" => {
            output(&p)?;
            let name = match p.args.as_slice() {
                [] => match &ctx.relation {
                    Some((_, n)) => n.clone(),
                    None => return Err(usage("no relation name specified")),
                },
                [n, rest @ ..] => {
                    check_empty(rest).map_err(usage)?;
                    n.clone()
                }
            };
            let mut ids: Vec<String> = ctx
                .relations
                .iter()
                .filter(|(_, n)| **n == name)
                .map(|(id, n)| format!("{n}:{id}"))
                .collect();
            ids.sort();
            print(&p, &json!(ids))
        }
        "relation-list" => {
            output(&p)?;
            let rel = relation_id(ctx, &p)?;
            check_empty(&p.args).map_err(usage)?;
            if p.is_set("app") {
                return print(&p, &json!(remote_app(ctx, rel)?));
            }
            print(&p, &json!(ctx.members_of(rel)))
        }
        "relation-get" => {
            output(&p)?;
            let rel = relation_id(ctx, &p)?;
            let mut args = p.args.iter();
            let key = args.next().filter(|k| *k != "-").cloned();
            // Juju's choice of whose settings: a name given wins (with
            // --app, a unit's name stands for its application); else
            // --app's is the remote application, else the remote unit;
            // and in a hook of the relation with no remote unit (its
            // application's data changed, or -broken), the remote
            // application's.
            let app_flag = p.is_set("app");
            let hook_relation = ctx.relation.as_ref().is_some_and(|(id, _)| *id == rel);
            let (app, unit) = match args.next() {
                Some(u) if app_flag => (
                    true,
                    u.split_once('/').map_or(u.as_str(), |(a, _)| a).to_string(),
                ),
                Some(u) => (false, u.clone()),
                None if app_flag => (true, remote_app(ctx, rel)?),
                None => match (&ctx.remote, hook_relation) {
                    (Some(r), _) => (false, r.clone()),
                    (None, true) => (
                        true,
                        remote_app(ctx, rel).map_err(|_| usage("no unit id specified"))?,
                    ),
                    (None, false) => return Err(usage("no unit id specified")),
                },
            };
            check_empty(args.as_slice()).map_err(usage)?;
            let settings = if app {
                app_settings_of(ctx, rel, &unit).await?
            } else {
                settings_of(ctx, rel, &unit).await?
            };
            let v = match key {
                None => json!(settings),
                Some(k) => settings.get(&k).map_or(Value::Null, |v| json!(v)),
            };
            print(&p, &v)
        }
        "relation-set" => {
            let rel = relation_id(ctx, &p)?;
            let mut changes: BTreeMap<String, Option<String>> = BTreeMap::new();
            let parsed_args = key_values(&p.args)?;
            let warning = deprecated_format(spec, &p);
            if let Some(file) = p.get("file").filter(|f| !f.is_empty()) {
                let text = read_settings_file(file, inv)?;
                for (k, v) in parse_settings(&text)? {
                    changes.insert(k, v);
                }
            }
            // key=value arguments win over the file.
            changes.extend(parsed_args);
            let app = p.is_set("app");
            if app && !ctx.api.is_leader(&ctx.unit).await.map_err(|e| e.message)? {
                return Err(Failure::Run(format!(
                    "cannot write relation settings: unit `{}` is not the leader; only the leader sets its application's settings (`is-leader` tells)",
                    ctx.unit
                )));
            }
            // Refused here, at the write, when the settings would outgrow
            // the bound: never discovered by the reader.
            let mut after = if app {
                app_settings_of(ctx, rel, own_app(ctx)).await?
            } else {
                settings_of(ctx, rel, &ctx.unit).await?
            };
            for (k, v) in &changes {
                match v {
                    Some(v) => after.insert(k.clone(), v.clone()),
                    None => after.remove(k),
                };
            }
            let size = serde_json::to_string(&after).map(|t| t.len()).unwrap_or(0);
            if size > crate::api::MAX_RELATION_SETTINGS_BYTES {
                return Err(Failure::Run(format!(
                    "the unit's settings in relation {rel} would be {size} bytes, more than the {} a unit may hold in one relation; nothing was set: pass large data another way",
                    crate::api::MAX_RELATION_SETTINGS_BYTES
                )));
            }
            // `-r ID` with no settings is valid (Juju 1.25; later versions
            // refuse it): nothing changes.
            let mut pending = if app {
                ctx.pending_app.lock().await
            } else {
                ctx.pending.lock().await
            };
            let entry = pending.entry(rel).or_default();
            for (k, v) in changes {
                entry.insert(k, v);
            }
            Ok(warn(warning))
        }
        "open-port" | "close-port" => {
            let warning = deprecated_format(spec, &p);
            let [port, rest @ ..] = p.args.as_slice() else {
                return Err(usage("no port or range specified"));
            };
            let range = parse_port_range(port).map_err(usage)?;
            check_empty(rest).map_err(usage)?;
            // Acts at once, not when the hook ends (charms-in-action.txt).
            ctx.api
                .set_port(&ctx.unit, &range, spec.name == "open-port")
                .await
                .map_err(|e| e.to_string())?;
            Ok(warn(warning))
        }
        "opened-ports" => {
            output(&p)?;
            check_empty(&p.args).map_err(usage)?;
            let view = ctx.api.unit(&ctx.unit).await.map_err(|e| e.message)?;
            print(&p, &json!(view.ports))
        }
        "goal-state" => {
            output(&p)?;
            check_empty(&p.args).map_err(usage)?;
            let goal = ctx.api.goal_state(&ctx.unit).await.map_err(|e| e.message)?;
            let since = format!("{}Z", super::log_time());
            let entry = |status: &String| json!({"status": status, "since": since});
            let v = json!({
                "units": goal.units.iter().map(|(u, st)| (u.clone(), entry(st))).collect::<serde_json::Map<_, _>>(),
                "relations": goal.relations.iter().map(|(ep, members)| {
                    (ep.clone(), Value::Object(members.iter().map(|(m, st)| (m.clone(), entry(st))).collect()))
                }).collect::<serde_json::Map<_, _>>(),
            });
            print(&p, &v)
        }
        "leader-get" => {
            output(&p)?;
            let key = match p.args.as_slice() {
                [] => None,
                [k] if k == "-" => None,
                [k] => Some(k.clone()),
                [_, extra, ..] => return Err(usage(format!("unrecognized args: [{extra:?}]"))),
            };
            let settings = ctx
                .api
                .bag(&ctx.unit, crate::api::Bag::Leader)
                .await
                .map_err(|e| format!("cannot read leadership settings: {}", e.message))?;
            let v = match key {
                None => json!(settings),
                Some(k) => settings.get(&k).map_or(Value::Null, |v| json!(v)),
            };
            print(&p, &v)
        }
        "leader-set" => {
            let changes = key_values(&p.args)?;
            if changes.is_empty() {
                return Err(usage("no key=value pairs specified"));
            }
            // Written at once, as Juju does: the other units learn it now.
            ctx.api
                .update_bag(&ctx.unit, crate::api::Bag::Leader, changes)
                .await
                .map_err(|e| e.message)?;
            Ok(Output::ok(""))
        }
        "action-get" | "action-set" | "action-fail" | "action-log" => {
            action_tool(ctx, spec, p).await
        }
        other => Err(format!("unknown hook tool `{other}`").into()),
    }
}

/// `key=value` arguments, an empty value deleting the key; a key given
/// twice or without `=` is a usage error.
fn key_values(args: &[String]) -> Result<Vec<(String, Option<String>)>, Failure> {
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for kv in args {
        match kv.split_once('=') {
            Some((k, _)) if out.iter().any(|(seen, _)| seen == k) => {
                return Err(usage(format!("key {k:?} specified more than once")))
            }
            Some((k, v)) if !k.is_empty() => {
                out.push((k.to_string(), (!v.is_empty()).then(|| v.to_string())))
            }
            _ => return Err(usage(format!("expected \"key=value\", got {kv:?}"))),
        }
    }
    Ok(out)
}

/// The unit's own application.
fn own_app(ctx: &HookContext) -> &str {
    ctx.unit.split('/').next().unwrap_or_default()
}

/// The remote application of relation `rel` (the unit's own in a peer
/// relation).
fn remote_app(ctx: &HookContext, rel: i64) -> Result<String, Failure> {
    ctx.apps
        .get(&rel)
        .filter(|a| !a.is_empty())
        .cloned()
        .ok_or_else(|| {
            Failure::Run(format!(
                "relation not found: no remote application known for relation {rel}"
            ))
        })
}

/// An application's settings in relation `rel`, with this hook's own
/// `relation-set --app`s in when it is the unit's own application.
async fn app_settings_of(
    ctx: &HookContext,
    rel: i64,
    app: &str,
) -> Result<BTreeMap<String, String>, Failure> {
    let bag = crate::api::Bag::App {
        relation: rel,
        service: app.to_string(),
    };
    let mut settings = ctx.api.bag(&ctx.unit, bag).await.map_err(|e| {
        format!(
            "cannot read the settings of application {app:?} in relation {rel}: {}",
            e.message
        )
    })?;
    if app == own_app(ctx) {
        if let Some(changes) = ctx.pending_app.lock().await.get(&rel) {
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

/// The longest `action-log` or `action-fail` message, and the most an
/// action's log keeps (as JSON; later messages go to the unit's log only).
pub const MAX_ACTION_LOG_MESSAGE: usize = 4096;
pub const MAX_ACTION_LOG_BYTES: usize = 256 << 10;

/// Juju's rule for `action-set` keys (each dotted part): lowercase letters,
/// digits and dashes, starting and ending with a letter or digit.
fn valid_result_key(part: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !part.is_empty()
        && part.starts_with(ok_char)
        && part.ends_with(ok_char)
        && part.chars().all(|c| ok_char(c) || c == '-')
}

/// `message` cut, marked, at [`MAX_ACTION_LOG_MESSAGE`] bytes (an
/// `action-log` or `action-fail` message), on a character boundary.
fn cut(mut message: String) -> String {
    if message.len() > MAX_ACTION_LOG_MESSAGE {
        message.truncate(crate::api::char_floor(&message, MAX_ACTION_LOG_MESSAGE));
        message.push_str(" [cut]");
    }
    message
}

async fn action_tool(ctx: &HookContext, spec: &Spec, p: Parsed) -> Result<Output, Failure> {
    let Some(action) = &ctx.action else {
        return Err(Failure::Run(format!(
            "{} may only be used in an action context; this is {}",
            spec.name,
            if ctx.relation.is_some() {
                "a relation hook"
            } else {
                "a hook or a command"
            }
        )));
    };
    match spec.name {
        "action-get" => {
            output(&p)?;
            let mut v = &action.params;
            if let [path] = p.args.as_slice() {
                for part in path.split('.') {
                    v = v.get(part).unwrap_or(&Value::Null);
                }
            } else if p.args.len() > 1 {
                return Err(usage(format!("unrecognized args: [{:?}]", p.args[1])));
            }
            print(&p, v)
        }
        "action-set" => {
            if p.args.is_empty() {
                return Err(usage("no key=value pairs specified"));
            }
            let mut parsed = Vec::new();
            for kv in &p.args {
                let Some((k, v)) = kv.split_once('=') else {
                    return Err(usage(format!(
                        "argument {kv:?} must be of the form key=value"
                    )));
                };
                if !k.split('.').all(valid_result_key) {
                    return Err(usage(format!(
                        "key {k:?} must start and end with lowercase alphanumeric, and contain only lowercase alphanumeric, hyphens and periods"
                    )));
                }
                if ["stdout", "stderr", "stdout-encoding", "stderr-encoding"].contains(&k) {
                    return Err(usage(format!("cannot set reserved action key {k:?}")));
                }
                parsed.push((k.to_string(), v.to_string()));
            }
            let mut outcome = action.outcome.lock().await;
            let mut after = outcome.results.clone();
            after.extend(parsed.iter().cloned());
            let size = serde_json::to_string(&after).map_or(0, |t| t.len());
            if size > crate::api::MAX_ACTION_RESULTS_BYTES {
                return Err(Failure::Run(format!(
                    "the action's results would be {size} bytes, more than the {} an action may set; set less, or write large output to a file",
                    crate::api::MAX_ACTION_RESULTS_BYTES
                )));
            }
            outcome.results = after;
            Ok(Output::ok(""))
        }
        "action-fail" => {
            let message = match p.args.as_slice() {
                [] => "action failed without reason given, check action for errors".to_string(),
                [m] => cut(m.clone()),
                [_, extra, ..] => return Err(usage(format!("unrecognized args: [{extra:?}]"))),
            };
            action.outcome.lock().await.failed = Some(message);
            Ok(Output::ok(""))
        }
        _ => {
            // action-log: also in the unit's log (and so `debug-log`).
            if p.args.is_empty() {
                return Err(usage("no message specified"));
            }
            let message = cut(p.args.join(" "));
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&ctx.log)
            {
                use std::io::Write;
                let _ = writeln!(f, "{} INFO action: {message}", super::log_time());
            }
            let mut outcome = action.outcome.lock().await;
            outcome.log.push((jujube_core::time::unix_now(), message));
            if serde_json::to_string(&outcome.log).map_or(0, |t| t.len()) > MAX_ACTION_LOG_BYTES {
                outcome.log.pop();
            }
            Ok(Output::ok(""))
        }
    }
}

/// Success with Juju's deprecation warning, if any, on stderr (without a
/// newline, as Juju writes it).
fn warn(warning: String) -> Output {
    let mut out = Output::ok("");
    out.stderr = warning;
    out
}

async fn config(ctx: &HookContext) -> Result<BTreeMap<String, Value>, Failure> {
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
    Ok(cache.clone().expect("just read"))
}

/// The longest message `juju-log` writes whole: charmhelpers cuts at
/// 131,071 characters; a longer one is cut here, marked, so a hook cannot
/// fill the disk through the log faster than through its own output.
pub const MAX_LOG_MESSAGE: usize = 128 << 10;

fn juju_log(ctx: &HookContext, spec: &Spec, p: Parsed) -> Result<Output, Failure> {
    if p.args.is_empty() {
        return Err(usage("no message specified"));
    }
    let warning = deprecated_format(spec, &p);
    let given = p.get("log-level").unwrap_or("INFO");
    let mut lines = Vec::new();
    let level = if p.is_set("debug") {
        "DEBUG"
    } else {
        match given.to_uppercase().as_str() {
            "TRACE" => "TRACE",
            "DEBUG" => "DEBUG",
            "INFO" => "INFO",
            "WARN" | "WARNING" => "WARNING",
            "ERROR" => "ERROR",
            "CRITICAL" => "CRITICAL",
            // Juju logs a warning and the message at INFO.
            _ => {
                lines.push((
                    "WARNING",
                    format!("Specified log level of {given:?} is not valid"),
                ));
                "INFO"
            }
        }
    };
    let mut message = p.args.join(" ");
    if message.len() > MAX_LOG_MESSAGE {
        message.truncate(crate::api::char_floor(&message, MAX_LOG_MESSAGE));
        message.push_str(" [truncated]");
    }
    // In a relation hook the message names the relation, as Juju's does.
    if let Some((id, name)) = &ctx.relation {
        message = format!("{name}:{id}: {message}");
    }
    lines.push((level, message));
    let time = super::log_time();
    let text: String = lines
        .iter()
        .map(|(level, m)| format!("{time} {level} unit.{}.juju-log: {m}\n", ctx.unit))
        .collect();
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&ctx.log)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("cannot write the unit's log: {e}"))?;
    Ok(warn(warning))
}

/// The contents `--file` names: a path (relative to the tool's working
/// directory) or `-`, standard input.
fn read_settings_file(file: &str, inv: &Invocation<'_>) -> Result<String, Failure> {
    if file == "-" {
        return Ok(inv.stdin.unwrap_or_default().to_string());
    }
    let path = match inv.cwd {
        Some(cwd) => Path::new(cwd).join(file),
        None => Path::new(file).to_path_buf(),
    };
    use std::io::Read;
    let f = std::fs::File::open(&path).map_err(|e| format!("cannot read {file:?}: {e}"))?;
    let mut text = String::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {file:?}: {e}"))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "{file:?} is larger than {} bytes, the most relation-set reads from a file",
            MAX_FILE_BYTES
        )
        .into());
    }
    Ok(text)
}

/// A `--file`'s settings: a YAML (or JSON, which is YAML) mapping of keys
/// to scalars; `null` or an empty value unsets the key.
fn parse_settings(text: &str) -> Result<Vec<(String, Option<String>)>, Failure> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    if jujube_core::yaml::too_deep(text) {
        return Err(Failure::Run(format!(
            "cannot parse settings file: it nests more than {} deep",
            jujube_core::yaml::MAX_FLOW_DEPTH
        )));
    }
    let v: Value =
        yaml_serde::from_str(text).map_err(|e| format!("cannot parse settings file: {e}"))?;
    let map = match v {
        Value::Object(map) => map,
        Value::Null => return Ok(Vec::new()),
        other => {
            return Err(format!("expected YAML map, got {}", format::json(&other)).into());
        }
    };
    map.into_iter()
        .map(|(k, v)| {
            if k.is_empty() {
                return Err(Failure::from("cannot parse settings file: empty key"));
            }
            let v = match v {
                Value::Null => None,
                Value::String(s) => (!s.is_empty()).then_some(s),
                Value::Bool(b) => Some(if b { "true" } else { "false" }.to_string()),
                Value::Number(n) => Some(n.to_string()),
                _ => {
                    return Err(Failure::Run(format!(
                        "expected YAML map of strings, got a list or map as the value of {k:?}"
                    )))
                }
            };
            Ok((k, v))
        })
        .collect()
}

/// `PORT[/PROTOCOL]` or `FROM-TO[/PROTOCOL]` as the store keeps it
/// (`80/tcp`, `100-200/udp`); the protocol's case does not matter and
/// defaults to tcp. Checked in Juju's order, with Juju's messages.
pub fn parse_port_range(text: &str) -> Result<String, String> {
    let lower = text.to_lowercase();
    // Juju's ICMP: no ports, no protocol (`open-port icmp`).
    if lower == "icmp" {
        return Ok(lower);
    }
    let shape =
        || format!("expected <port>[/<protocol>] or <from>-<to>[/<protocol>]; got {text:?}");
    let (ports, protocol) = match lower.split_once('/') {
        Some((ports, proto)) => (ports, proto),
        None => (lower.as_str(), "tcp"),
    };
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if protocol.is_empty() || !protocol.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(shape());
    }
    let (from, to) = match ports.split_once('-') {
        Some((a, b)) if digits(a) && digits(b) => (a, b),
        None if digits(ports) => (ports, ports),
        _ => return Err(shape()),
    };
    let number = |d: &str| -> Result<u64, String> {
        d.parse::<u64>()
            .map_err(|e| format!("expected port number; got {d:?}: {e}"))
    };
    let (lo, hi) = (number(from)?, number(to)?);
    let valid = |n: u64| (1..=65535).contains(&n);
    if lo == hi {
        if !valid(lo) {
            return Err(format!(
                "port must be in the range [1, 65535]; got \"{lo}\""
            ));
        }
    } else {
        if lo > hi {
            return Err(format!(
                "invalid port range {lo}-{hi}/{protocol}; expected fromPort <= toPort"
            ));
        }
        if !valid(lo) {
            return Err(format!(
                "fromPort must be in the range [1, 65535]; got \"{lo}\""
            ));
        }
        if !valid(hi) {
            return Err(format!(
                "toPort must be in the range [1, 65535]; got \"{hi}\""
            ));
        }
    }
    if protocol != "tcp" && protocol != "udp" {
        return Err(format!(
            "protocol must be \"tcp\" or \"udp\"; got {protocol:?}"
        ));
    }
    Ok(if lo == hi {
        format!("{lo}/{protocol}")
    } else {
        format!("{lo}-{hi}/{protocol}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_as_juju_takes_them() {
        assert_eq!(parse_port_range("80").unwrap(), "80/tcp");
        assert_eq!(parse_port_range("80/TCP").unwrap(), "80/tcp");
        assert_eq!(parse_port_range("53/Udp").unwrap(), "53/udp");
        assert_eq!(parse_port_range("100-200/udp").unwrap(), "100-200/udp");
        assert_eq!(parse_port_range("8000-8000").unwrap(), "8000/tcp");
        assert_eq!(parse_port_range("ICMP").unwrap(), "icmp");
        assert!(parse_port_range("icmp/tcp").is_err());
        assert_eq!(
            parse_port_range("80/http").unwrap_err(),
            r#"protocol must be "tcp" or "udp"; got "http""#
        );
        assert_eq!(
            parse_port_range("0").unwrap_err(),
            r#"port must be in the range [1, 65535]; got "0""#
        );
        assert_eq!(
            parse_port_range("65536/tcp").unwrap_err(),
            r#"port must be in the range [1, 65535]; got "65536""#
        );
        assert_eq!(
            parse_port_range("http").unwrap_err(),
            r#"expected <port>[/<protocol>] or <from>-<to>[/<protocol>]; got "http""#
        );
        assert_eq!(
            parse_port_range("20-10/tcp").unwrap_err(),
            "invalid port range 20-10/tcp; expected fromPort <= toPort"
        );
        assert_eq!(
            parse_port_range("99999/UDP").unwrap_err(),
            r#"port must be in the range [1, 65535]; got "99999""#
        );
        assert_eq!(
            parse_port_range("0-80").unwrap_err(),
            r#"fromPort must be in the range [1, 65535]; got "0""#
        );
        for bad in ["80/tcp/x", "blah/blah/blah", " 80", "80-", "two"] {
            assert_eq!(
                parse_port_range(bad).unwrap_err(),
                format!("expected <port>[/<protocol>] or <from>-<to>[/<protocol>]; got {bad:?}")
            );
        }
    }

    #[test]
    fn settings_files_are_yaml_or_json_mappings() {
        let s = parse_settings("a: b\nn: 5\nt: true\ngone: null\nempty: ''\n").unwrap();
        assert_eq!(
            s,
            vec![
                ("a".into(), Some("b".into())),
                ("empty".into(), None),
                ("gone".into(), None),
                ("n".into(), Some("5".into())),
                ("t".into(), Some("true".into())),
            ]
        );
        assert_eq!(
            parse_settings("{\"x\": \"1\"}").unwrap(),
            vec![("x".into(), Some("1".into()))]
        );
        assert!(parse_settings("- a\n- b\n").is_err());
        assert!(parse_settings("a: [1]\n").is_err());
        assert_eq!(parse_settings("").unwrap(), vec![]);
    }

    #[test]
    fn every_tool_has_a_spec_and_help_that_names_its_flags() {
        for tool in super::super::TOOLS {
            let spec = spec(tool).unwrap_or_else(|| panic!("no spec for {tool}"));
            let usage = spec.usage();
            assert!(usage.starts_with(&format!("usage: {tool} ")), "{usage}");
            for f in spec.flags {
                assert!(usage.contains(&format!("--{}", f.long)), "{tool}: {usage}");
            }
        }
        assert!(spec("relation-set").unwrap().usage().contains("--file"));
    }

    #[test]
    fn only_relation_set_with_file_dash_reads_stdin() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(reads_stdin("relation-set", &a(&["--file", "-"])));
        assert!(reads_stdin(
            "relation-set",
            &a(&["-r", "1", "--file=-", "k=v"])
        ));
        assert!(!reads_stdin("relation-set", &a(&["--file", "f.yaml"])));
        assert!(!reads_stdin("relation-set", &a(&["--", "--file", "-"])));
        assert!(!reads_stdin("relation-get", &a(&["-"])));
    }
}
