//! The hook tools against a real store, through the in-process facade: a
//! table of Juju 1.25's own `jujuc` cases (args → stdout, stderr, exit
//! status), reworded for this world, and what the tools change.

use super::{World, MYSQL, UUID};
use crate::Facades;
use jujube_agent::api::Tag;
use jujube_agent::hooks::context::{HookContext, HookView, Output};
use jujube_agent::hooks::tools::{self, Invocation};
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_core::Constraints;
use jujube_state::services::DeployArgs;
use jujube_state::{AgentOp, Caller, Charm};
use std::collections::BTreeMap;
use std::sync::Arc;

const CONFIG: &str = "options:
  monsters: {type: boolean, default: false, description: m}
  spline-reticulation: {type: int, default: 45, description: s}
  title: {type: string, default: My Title, description: t}
  username: {type: string, default: admin001, description: u}
  ratio: {type: float, default: 1.5, description: r}
  empty: {type: string, description: e}
";

struct Fixture {
    w: World,
    db: i64,
    facades: Facades,
}

/// wordpress/0 with a charm config, related to mysql/0, mysql/1 and
/// mysql/2; each in the scope with settings of its own.
fn fixture() -> Fixture {
    let _ = UUID;
    let w = World::new();
    let meta = CharmMeta::parse(
        "name: wordpress\nsummary: blog\nrequires:\n  db:\n    interface: mysql\n",
    )
    .unwrap();
    let path = w.dir.path().join("charms/wordpress");
    std::fs::create_dir_all(path.join("hooks")).unwrap();
    w.store
        .deploy(&DeployArgs {
            service: "wordpress".into(),
            charm: Charm {
                url: "local:jammy/wordpress-1".into(),
                meta,
                config: CharmConfig::parse("wordpress", CONFIG).unwrap(),
                actions: Default::default(),
                path: path.to_string_lossy().into_owned(),
            },
            series: "jammy".into(),
            constraints: Constraints::default(),
            units: 1,
            to: None,
            settings: vec![],
        })
        .unwrap();
    w.deploy(MYSQL, "mysql", 3);
    w.store.add_relation("wordpress", "mysql").unwrap();
    let db = w.relation_id("wordpress:db mysql:db");
    for (u, settings) in [
        ("wordpress/0", vec![("private-address", "foo: bar\n")]),
        ("mysql/0", vec![("pew", "pew\npew\n"), ("user", "admin")]),
        ("mysql/1", vec![("value", "12345")]),
        ("mysql/2", vec![]),
    ] {
        w.apply(
            Caller::Unit(u.into()),
            AgentOp::SetUnitStatus {
                unit: u.into(),
                status: "started".into(),
                info: String::new(),
            },
        );
        w.apply(
            Caller::Unit(u.into()),
            AgentOp::EnterScope {
                relation: db,
                unit: u.into(),
                settings: settings
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
        );
    }
    let facades = Facades::new(w.store.clone()).unwrap();
    Fixture { w, db, facades }
}

impl Fixture {
    /// wordpress/0's context: `hook` names the relation hook's remote unit
    /// (`Some("")` for one without, such as `-broken`); `None` is a unit hook.
    fn ctx(&self, remote: Option<&str>) -> Arc<HookContext> {
        let relation = remote.map(|_| (self.db, "db".to_string()));
        let remote = remote.filter(|r| !r.is_empty()).map(str::to_string);
        let view = HookView {
            relation,
            remote,
            relations: BTreeMap::from([(self.db, "db".to_string())]),
            // As the hooks have seen it (unsorted here; the tool sorts).
            members: BTreeMap::from([(
                self.db,
                vec![
                    "mysql/2".to_string(),
                    "mysql/0".to_string(),
                    "mysql/10".to_string(),
                ],
            )]),
            apps: BTreeMap::from([(self.db, "mysql".to_string())]),
            action: None,
        };
        Arc::new(HookContext::new(
            "ctx-1".into(),
            "wordpress/0",
            view,
            self.facades.for_agent(Tag::unit("wordpress/0")),
            self.w.dir.path().join("unit.log"),
        ))
    }
}

async fn run(ctx: &HookContext, line: &[&str]) -> Output {
    let args: Vec<String> = line[1..].iter().map(|s| s.to_string()).collect();
    let cwd = std::env::temp_dir();
    let inv = Invocation {
        cwd: cwd.to_str(),
        stdin: None,
    };
    tools::run(ctx, line[0], &args, &inv).await
}

/// One row: the command line (words; `{r}` is the relation's `name:id`,
/// `{db}` its id), then stdout, stderr and the exit status.
type Case<'a> = (&'a str, &'a str, &'a str, i32);

async fn check(ctx: &HookContext, cases: &[Case<'_>]) {
    let db = ctx.relations.keys().next().copied().unwrap_or_default();
    for (line, stdout, stderr, code) in cases {
        let line = line
            .replace("{r}", &format!("db:{db}"))
            .replace("{db}", &db.to_string());
        let words: Vec<&str> = line.split_whitespace().collect();
        let out = run(ctx, &words).await;
        let stdout = stdout.replace("{r}", &format!("db:{db}"));
        assert_eq!(
            (out.stdout.as_str(), out.stderr.as_str(), out.code),
            (stdout.as_str(), *stderr, *code),
            "{line:?}"
        );
    }
}

#[tokio::test]
async fn tools_answer_as_jujus_own_cases_say_outside_relation_hooks() {
    let f = fixture();
    let ctx = f.ctx(None);
    let db = f.db;
    let cases: Vec<Case> = vec![
        ("config-get monsters", "False\n", "", 0),
        ("config-get --format yaml monsters", "false\n", "", 0),
        ("config-get --format=json monsters", "false\n", "", 0),
        ("config-get spline-reticulation", "45\n", "", 0),
        ("config-get ratio", "1.5\n", "", 0),
        ("config-get title", "My Title\n", "", 0),
        ("config-get missing", "", "", 0),
        ("config-get empty", "", "", 0),
        ("config-get --format json missing", "null\n", "", 0),
        (
            "config-get --format json",
            "{\"monsters\":false,\"ratio\":1.5,\"spline-reticulation\":45,\"title\":\"My Title\",\"username\":\"admin001\"}\n",
            "",
            0,
        ),
        (
            "config-get -a --format json",
            "{\"empty\":null,\"monsters\":false,\"ratio\":1.5,\"spline-reticulation\":45,\"title\":\"My Title\",\"username\":\"admin001\"}\n",
            "",
            0,
        ),
        (
            "config-get --all --format json monsters",
            "",
            "error: cannot use argument --all together with key \"monsters\"\n",
            2,
        ),
        (
            "config-get monsters --all",
            "",
            "error: cannot use argument --all together with key \"monsters\"\n",
            2,
        ),
        ("config-get multiple keys", "", "error: unrecognized args: [\"keys\"]\n", 2),
        ("config-get --bogus", "", "error: flag provided but not defined: --bogus\n", 2),
        ("config-get -format json", "", "error: flag provided but not defined: -f\n", 2),
        (
            "config-get --format xml",
            "",
            "error: invalid value \"xml\" for flag --format: unknown format \"xml\"\n",
            2,
        ),
        ("relation-get", "", "error: no relation id specified\n", 2),
        (
            "relation-get -r burble:123",
            "",
            "error: invalid value \"burble:123\" for flag -r: relation not found\n",
            2,
        ),
        (
            "relation-get -r one",
            "",
            "error: invalid value \"one\" for flag -r: invalid relation id\n",
            2,
        ),
        ("relation-get -r {r}", "", "error: no unit id specified\n", 2),
        ("relation-get -r {r} - mysql/1", "value: '12345'\n", "", 0),
        ("relation-get -r {r} value mysql/1", "12345\n", "", 0),
        ("relation-get -r {r} --format json value mysql/1", "\"12345\"\n", "", 0),
        ("relation-get -r {r} missing mysql/1", "", "", 0),
        ("relation-get -r {r} --format json missing mysql/1", "null\n", "", 0),
        ("relation-get -r {r} private-address wordpress/0", "foo: bar\n\n", "", 0),
        ("relation-get -r {r} a b c", "", "error: unrecognized args: [\"c\"]\n", 2),
        ("relation-list", "", "error: no relation id specified\n", 2),
        ("relation-list -r bad", "", "error: invalid value \"bad\" for flag -r: invalid relation id\n", 2),
        // Sorted as strings, as Juju sorts them.
        ("relation-list -r ignored:{db}", "mysql/0\nmysql/10\nmysql/2\n", "", 0),
        (
            "relation-list -r {r} --format json",
            "[\"mysql/0\",\"mysql/10\",\"mysql/2\"]\n",
            "",
            0,
        ),
        ("relation-list -r {r} extra", "", "error: unrecognized args: [\"extra\"]\n", 2),
        ("relation-ids", "", "error: no relation name specified\n", 2),
        ("relation-ids db", "{r}\n", "", 0),
        ("relation-ids --format json db", "[\"{r}\"]\n", "", 0),
        ("relation-ids z", "", "", 0),
        ("relation-ids --format json z", "[]\n", "", 0),
        ("relation-ids --format yaml z", "[]\n", "", 0),
        ("relation-set -r {r} haha", "", "error: expected \"key=value\", got \"haha\"\n", 2),
        ("relation-set -r {r} =haha", "", "error: expected \"key=value\", got \"=haha\"\n", 2),
        ("relation-set -r {r} a=1 a=2", "", "error: key \"a\" specified more than once\n", 2),
        ("relation-set -r one", "", "error: invalid value \"one\" for flag -r: invalid relation id\n", 2),
        (
            "relation-set -r db:999",
            "",
            "error: invalid value \"db:999\" for flag -r: relation not found\n",
            2,
        ),
        ("relation-set k=v", "", "error: no relation id specified\n", 2),
        // 1.25: -r with no settings is valid.
        ("relation-set -r {r}", "", "", 0),
        ("relation-set -r {r} --format foo rel=", "", "--format flag deprecated for command \"relation-set\"", 0),
        ("unit-get protected-address", "", "error: unknown setting \"protected-address\"\n", 2),
        ("unit-get private-address blah", "", "error: unrecognized args: [\"blah\"]\n", 2),
        ("unit-get", "", "error: no setting specified\n", 2),
        ("open-port", "", "error: no port or range specified\n", 2),
        ("close-port", "", "error: no port or range specified\n", 2),
        ("open-port 0", "", "error: port must be in the range [1, 65535]; got \"0\"\n", 2),
        ("open-port 99999/UDP", "", "error: port must be in the range [1, 65535]; got \"99999\"\n", 2),
        (
            "open-port two",
            "",
            "error: expected <port>[/<protocol>] or <from>-<to>[/<protocol>]; got \"two\"\n",
            2,
        ),
        ("open-port 80/http", "", "error: protocol must be \"tcp\" or \"udp\"; got \"http\"\n", 2),
        ("close-port 1-0", "", "error: invalid port range 1-0/tcp; expected fromPort <= toPort\n", 2),
        ("open-port -42", "", "error: flag provided but not defined: -4\n", 2),
        ("open-port 123 haha", "", "error: unrecognized args: [\"haha\"]\n", 2),
        ("juju-log", "", "error: no message specified\n", 2),
        ("juju-log -l FATAL", "", "error: no message specified\n", 2),
        ("juju-log -l", "", "error: flag needs an argument: -l\n", 2),
        ("juju-log -1", "", "error: flag provided but not defined: -1\n", 2),
        ("juju-log --format foo msg", "", "--format flag deprecated for command \"juju-log\"", 0),
    ];
    check(&ctx, &cases).await;
    // Nothing the refused calls asked for was written.
    assert!(ctx
        .pending
        .lock()
        .await
        .get(&db)
        .is_none_or(|p| p == &BTreeMap::from([("rel".to_string(), None)])));
}

#[tokio::test]
async fn tools_in_a_relation_hook_default_to_its_relation_and_remote_unit() {
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    let cases: Vec<Case> = vec![
        ("relation-get ker-plunk", "", "", 0),
        ("relation-get pew", "pew\npew\n\n", "", 0),
        ("relation-get pew --format smart", "pew\npew\n\n", "", 0),
        (
            "relation-get --format=json -",
            "{\"pew\":\"pew\\npew\\n\",\"user\":\"admin\"}\n",
            "",
            0,
        ),
        ("relation-get value mysql/1", "12345\n", "", 0),
        ("relation-ids", "{r}\n", "", 0),
        ("relation-list", "mysql/0\nmysql/10\nmysql/2\n", "", 0),
        ("relation-set a=1 b= c=x=y", "", "", 0),
        (
            "relation-get --format=json - wordpress/0",
            "{\"a\":\"1\",\"c\":\"x=y\",\"private-address\":\"foo: bar\\n\"}\n",
            "",
            0,
        ),
    ];
    check(&ctx, &cases).await;
    // A unit of the related service that departed is still readable
    // (charms-in-action: settings outlive membership for the relation's
    // lifetime); a unit never in the relation is not.
    f.w.apply(
        Caller::Unit("mysql/1".into()),
        AgentOp::LeaveScope {
            relation: f.db,
            unit: "mysql/1".into(),
        },
    );
    let later = f.ctx(Some("mysql/0"));
    check(
        &later,
        &[("relation-get - mysql/1", "value: '12345'\n", "", 0)],
    )
    .await;
    let out = run(&later, &["relation-get", "-", "mysql/7"]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("permission denied"), "{}", out.stderr);
}

#[tokio::test]
async fn help_prints_the_usage_on_stdout_and_exits_0() {
    let f = fixture();
    let ctx = f.ctx(None);
    for tool in jujube_agent::hooks::TOOLS {
        for flag in ["--help", "-h"] {
            let out = run(&ctx, &[tool, flag]).await;
            assert_eq!((out.code, out.stderr.as_str()), (0, ""), "{tool} {flag}");
            assert!(
                out.stdout.starts_with(&format!("usage: {tool}")),
                "{}",
                out.stdout
            );
        }
    }
    let out = run(&ctx, &["config-get", "--help"]).await;
    assert_eq!(
        out.stdout,
        "usage: config-get [options] [<key>]\npurpose: print service configuration\n\noptions:\n\
         -a, --all  (= false)\n    print all keys\n--format  (= smart)\n    specify output format (json|smart|yaml)\n\
         -o, --output (= \"\")\n    specify an output file\n\n\
         When no <key> is supplied, all keys with values or defaults are printed. If\n\
         --all is set, all known keys are printed; those without defaults or values are\n\
         reported as null. <key> and --all are mutually exclusive.\n"
    );
    // charmhelpers looks for `--file` in relation-set's help.
    assert!(run(&ctx, &["relation-set", "--help"])
        .await
        .stdout
        .contains("--file"));
    // An earlier bad flag wins over --help.
    assert_eq!(
        run(&ctx, &["config-get", "--bogus", "--help"]).await.code,
        2
    );
}

#[tokio::test]
async fn output_names_a_file_the_client_writes() {
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    let out = run(&ctx, &["relation-get", "--output", "some-file", "pew"]).await;
    assert_eq!(
        (out.code, out.file.as_deref(), out.stdout.as_str()),
        (0, Some("some-file"), "pew\npew\n\n")
    );
    let out = run(&ctx, &["config-get", "-o", "f", "monsters"]).await;
    assert_eq!(
        (out.file.as_deref(), out.stdout.as_str()),
        (Some("f"), "False\n")
    );
}

#[tokio::test]
async fn relation_set_reads_a_yaml_or_json_file_and_arguments_win() {
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("s.yaml"),
        "foo: baz\nham: eggs\nn: 5\ngone: null\n",
    )
    .unwrap();
    let inv = Invocation {
        cwd: dir.path().to_str(),
        stdin: None,
    };
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let out = tools::run(
        &ctx,
        "relation-set",
        &args(&["--file", "s.yaml", "foo=bar"]),
        &inv,
    )
    .await;
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
    let stdin = Invocation {
        cwd: None,
        stdin: Some("{\"json\": \"yes\"}"),
    };
    let out = tools::run(&ctx, "relation-set", &args(&["--file", "-"]), &stdin).await;
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
    let pending = ctx.pending.lock().await.get(&f.db).cloned().unwrap();
    let want: BTreeMap<String, Option<String>> = [
        ("foo", Some("bar")),
        ("ham", Some("eggs")),
        ("n", Some("5")),
        ("gone", None),
        ("json", Some("yes")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
    .collect();
    assert_eq!(pending, want);
    // A file that is not a mapping is a run-time error (exit 1).
    std::fs::write(dir.path().join("bad.yaml"), "- a\n- b\n").unwrap();
    let out = tools::run(&ctx, "relation-set", &args(&["--file", "bad.yaml"]), &inv).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.starts_with("error: expected YAML map, got"),
        "{}",
        out.stderr
    );
    let out = tools::run(
        &ctx,
        "relation-set",
        &args(&["--file", "missing.yaml"]),
        &inv,
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
}

#[tokio::test]
async fn ports_open_and_close_as_ranges_and_status_shows_them() {
    let f = fixture();
    let ctx = f.ctx(None);
    let ok = |out: Output| assert_eq!((out.code, out.stderr), (0, String::new()));
    for p in ["80", "99/tcp", "100-200", "443/udp"] {
        ok(run(&ctx, &["open-port", p]).await);
    }
    let ports = || {
        let status = serde_json::to_value(f.w.store.status().unwrap()).unwrap();
        status["services"]["wordpress"]["units"]["wordpress/0"]["open-ports"].clone()
    };
    assert_eq!(
        ports(),
        serde_json::json!(["80/tcp", "99/tcp", "100-200/tcp", "443/udp"])
    );
    // Overlapping another open range is refused, and nothing changes.
    let out = run(&ctx, &["open-port", "150-250/tcp"]).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("conflicts with 100-200/tcp"),
        "{}",
        out.stderr
    );
    for p in ["80/TCP", "100-200/tcP", "443", "443/udp"] {
        ok(run(&ctx, &["close-port", p]).await);
    }
    ok(run(&ctx, &["open-port", "123/udp"]).await);
    ok(run(&ctx, &["close-port", "9999/UDP"]).await);
    assert_eq!(ports(), serde_json::json!(["99/tcp", "123/udp"]));
    // ICMP, as `ops` opens it (`unit.open_port('icmp')`): again is a no-op;
    // it sorts first, as Juju's (ports -1) does.
    ok(run(&ctx, &["open-port", "icmp"]).await);
    ok(run(&ctx, &["open-port", "icmp"]).await);
    assert_eq!(ports(), serde_json::json!(["icmp", "99/tcp", "123/udp"]));
    let out = run(&ctx, &["opened-ports"]).await;
    assert_eq!(out.stdout, "icmp\n99/tcp\n123/udp\n");
    ok(run(&ctx, &["close-port", "icmp"]).await);
    assert_eq!(ports(), serde_json::json!(["99/tcp", "123/udp"]));
}

#[tokio::test]
async fn juju_log_writes_juju_levels_and_names_the_relation() {
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    for flags in [
        &[][..],
        &["--debug"],
        &["--log-level", "TRACE"],
        &["-l", "WaRnInG"],
        &["-l", "bogus"],
    ] {
        let mut line = vec!["juju-log"];
        line.extend_from_slice(flags);
        line.extend_from_slice(&["the chickens", "are 110% AWESOME"]);
        let out = run(&ctx, &line).await;
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.as_str()),
            (0, "", "")
        );
    }
    assert_eq!(run(&ctx, &["juju-log", "--", "-x", "y"]).await.code, 0);
    let log = std::fs::read_to_string(f.w.dir.path().join("unit.log")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let rel = format!("db:{}", f.db);
    let tail: Vec<String> = lines
        .iter()
        .map(|l| l.splitn(3, ' ').nth(2).unwrap().to_string())
        .collect();
    assert_eq!(
        tail,
        [
            format!("INFO unit.wordpress/0.juju-log: {rel}: the chickens are 110% AWESOME"),
            format!("DEBUG unit.wordpress/0.juju-log: {rel}: the chickens are 110% AWESOME"),
            format!("TRACE unit.wordpress/0.juju-log: {rel}: the chickens are 110% AWESOME"),
            format!("WARNING unit.wordpress/0.juju-log: {rel}: the chickens are 110% AWESOME"),
            "WARNING unit.wordpress/0.juju-log: Specified log level of \"bogus\" is not valid"
                .to_string(),
            format!("INFO unit.wordpress/0.juju-log: {rel}: the chickens are 110% AWESOME"),
            format!("INFO unit.wordpress/0.juju-log: {rel}: -x y"),
        ]
    );
    // `YYYY-MM-DD HH:MM:SS`.
    let time = &lines[0][..19];
    assert!(
        time.as_bytes()[4] == b'-' && time.as_bytes()[10] == b' ' && time.as_bytes()[13] == b':',
        "{time}"
    );
}

#[tokio::test]
async fn relation_set_refuses_settings_beyond_the_bound_at_once() {
    // The tool's bound is the store's.
    assert_eq!(
        jujube_agent::api::MAX_RELATION_SETTINGS_BYTES,
        jujube_state::relations::MAX_RELATION_SETTINGS_BYTES
    );
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    let dir = tempfile::tempdir().unwrap();
    let half = "x".repeat(jujube_agent::api::MAX_RELATION_SETTINGS_BYTES / 2);
    std::fs::write(dir.path().join("a.yaml"), format!("a: {half}\n")).unwrap();
    std::fs::write(dir.path().join("b.yaml"), format!("b: {half}\n")).unwrap();
    let inv = Invocation {
        cwd: dir.path().to_str(),
        stdin: None,
    };
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let out = tools::run(&ctx, "relation-set", &args(&["--file", "a.yaml"]), &inv).await;
    assert_eq!((out.code, out.stderr.as_str()), (0, ""));
    // The second half more, across two calls of one hook: refused at once.
    let out = tools::run(&ctx, "relation-set", &args(&["--file", "b.yaml"]), &inv).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("a unit may hold in one relation; nothing was set"),
        "{}",
        out.stderr
    );
    let pending = ctx.pending.lock().await.get(&f.db).cloned().unwrap();
    assert_eq!(pending.keys().collect::<Vec<_>>(), ["a"]);
}

/// `status-set`, `status-get` and `is-leader`, as `ops` calls them: the
/// unit's workload status; the first unit to ask leads its service, the
/// others do not while it holds; only the leader sets the application's
/// status; leadership moves when the leader is lost.
#[tokio::test]
async fn workload_status_and_leadership_as_ops_calls_them() {
    let f = fixture();
    let ctx = f.ctx(None);
    check(
        &ctx,
        &[
            ("status-get", "unknown\n", "", 0),
            ("status-set maintenance installing", "", "", 0),
            (
                "status-get --include-data --format=json",
                "{\"message\":\"installing\",\"status\":\"maintenance\",\"status-data\":{}}\n",
                "",
                0,
            ),
            ("status-set --application=False active", "", "", 0),
            ("status-get", "active\n", "", 0),
            ("status-get --format=json", "{\"status\":\"active\"}\n", "", 0),
            (
                "status-set running",
                "",
                "error: invalid status \"running\", expected one of [maintenance blocked waiting active]\n",
                2,
            ),
            ("status-set", "", "error: invalid args, require <status> [message] [data]\n", 2),
            ("is-leader --format=json", "true\n", "", 0),
            ("is-leader", "True\n", "", 0),
            ("status-set --application=True blocked need a db", "", "error: unrecognized args: [\"a\"]\n", 2),
            ("status-set --application=True blocked \"need-db\"", "", "", 0),
            ("status-get --application", "blocked\n", "", 0),
            (
                "status-get --application --format=json",
                "{\"application-status\":{\"status\":\"blocked\",\"units\":{\"wordpress/0\":{\"status\":\"active\"}}}}\n",
                "",
                0,
            ),
            (
                "status-get --application --include-data --format=json",
                "{\"application-status\":{\"message\":\"\\\"need-db\\\"\",\"status\":\"blocked\",\"status-data\":{},\"units\":{\"wordpress/0\":{\"message\":\"\",\"status\":\"active\",\"status-data\":{}}}}}\n",
                "",
                0,
            ),
        ],
    )
    .await;
    let st = f.w.store.status().unwrap();
    let wp = st.services.get("wordpress").unwrap();
    assert_eq!(wp.workload_status.current, "blocked");
    let u = wp.units.get("wordpress/0").unwrap();
    assert_eq!(u.workload_status.current, "active");
    assert!(u.leader);

    // mysql: the first unit to ask leads; the others do not, and may not
    // set the application's status.
    let mysql = |u: &str| {
        Arc::new(HookContext::new(
            format!("ctx-{u}"),
            u,
            HookView::default(),
            f.facades.for_agent(Tag::unit(u)),
            f.w.dir.path().join("unit.log"),
        ))
    };
    let (m0, m1) = (mysql("mysql/0"), mysql("mysql/1"));
    check(&m1, &[("is-leader", "True\n", "", 0)]).await;
    check(
        &m0,
        &[
            ("is-leader", "False\n", "", 0),
            (
                "status-set --application active",
                "",
                "error: unit `mysql/0` is not the leader of service `mysql`: only the leader sets the application's status (`is-leader` tells)\n",
                1,
            ),
        ],
    )
    .await;
    // Only the leader reads the application's status, with every unit's.
    check(
        &m0,
        &[(
            "status-get --application",
            "",
            "error: finding application status: this unit is not the leader\n",
            1,
        )],
    )
    .await;
    check(&m1, &[("status-set maintenance", "", "", 0)]).await;
    check(
        &m1,
        &[
            ("is-leader", "True\n", "", 0),
            (
                "status-get --application --format=json",
                "{\"application-status\":{\"status\":\"unknown\",\"units\":{\"mysql/0\":{\"status\":\"unknown\"},\"mysql/1\":{\"status\":\"maintenance\"},\"mysql/2\":{\"status\":\"unknown\"}}}}\n",
                "",
                0,
            ),
        ],
    )
    .await;
    // The leader lost (its unit destroyed): the next to ask leads.
    f.w.store.destroy_units(&["mysql/1".to_string()]).unwrap();
    check(&m0, &[("is-leader", "True\n", "", 0)]).await;
    check(&m1, &[("is-leader", "False\n", "", 0)]).await;
}

/// The rest of what `ops` calls in common paths: `application-version-set`
/// (the service's version in `status`), `network-get` (the machine's
/// address), and Juju features jujube lacks answering "not supported".
#[tokio::test]
async fn version_network_and_unsupported_tools() {
    let f = fixture();
    let ctx = f.ctx(None);
    let address = jujube_agent::hooks::runner::private_address();
    check(
        &ctx,
        &[
            ("application-version-set 5.7.2", "", "", 0),
            ("application-version-set", "", "error: no version specified\n", 2),
            ("network-get db --ingress-address", &format!("{address}\n"), "", 0),
            ("network-get db --primary-address", &format!("{address}\n"), "", 0),
            ("network-get db --bind-address -r {r}", &format!("{address}\n"), "", 0),
            (
                "network-get db --egress-subnets --format=json",
                &format!("[\"{address}/32\"]\n"),
                "",
                0,
            ),
            (
                "network-get db --bind-address --ingress-address --format=json",
                &format!("{{\"bind-address\":\"{address}\",\"ingress-address\":\"{address}\"}}\n"),
                "",
                0,
            ),
            (
                "network-get db --primary-address --bind-address",
                "",
                "error: --primary-address must be the only flag specified\n",
                1,
            ),
            (
                "network-get db -r db:999",
                "",
                "error: invalid value \"db:999\" for flag -r: relation not found\n",
                2,
            ),
            (
                "credential-get",
                "",
                "error: credential-get is not supported: jujube gives charms no cloud credentials\n",
                1,
            ),
            // No secret exists: "not found" (ops' SecretNotFoundError),
            // with the flags ops passes; only adding one is refused.
            (
                "secret-get secret:cq2rfm7mp25c77dvm5n0 --refresh",
                "",
                "error: secret \"secret:cq2rfm7mp25c77dvm5n0\" not found\n",
                1,
            ),
            (
                "secret-get --label db-password",
                "",
                "error: secret with label \"db-password\" not found\n",
                1,
            ),
            (
                "secret-info-get --label db-password --format=json",
                "",
                "error: secret with label \"db-password\" not found\n",
                1,
            ),
            (
                "secret-remove secret:cq2rfm7mp25c77dvm5n0 --revision 2",
                "",
                "error: secret \"secret:cq2rfm7mp25c77dvm5n0\" not found\n",
                1,
            ),
            ("secret-get", "", "error: require either a secret URI or label\n", 2),
            ("secret-set --label x", "", "error: missing secret URI\n", 2),
            ("secret-set a=b", "", "error: secret URI \"a=b\" not valid\n", 2),
            // As Juju's secret-get: one of --peek and --refresh, at most
            // one key, and a model named by its UUID.
            (
                "secret-get cq2rfm7mp25c77dvm5n0 --peek --refresh",
                "",
                "error: specify one of --peek or --refresh but not both\n",
                2,
            ),
            (
                "secret-get cq2rfm7mp25c77dvm5n0 password extra",
                "",
                "error: unrecognized args: [\"extra\"]\n",
                2,
            ),
            (
                "secret-get secret://not-a-model/cq2rfm7mp25c77dvm5n0",
                "",
                "error: secret URI \"secret://not-a-model/cq2rfm7mp25c77dvm5n0\" not valid\n",
                2,
            ),
            (
                "secret-get secret://3a5e2b3c-1f2d-4e5f-8a9b-0c1d2e3f4a5b/cq2rfm7mp25c77dvm5n0",
                "",
                "error: secret \"secret://3a5e2b3c-1f2d-4e5f-8a9b-0c1d2e3f4a5b/cq2rfm7mp25c77dvm5n0\" not found\n",
                1,
            ),
            ("secret-grant cq2rfm7mp25c77dvm5n0", "", "error: no relation id specified\n", 2),
            (
                "secret-grant secret:cq2rfm7mp25c77dvm5n0 --relation 3",
                "",
                "error: secret \"secret:cq2rfm7mp25c77dvm5n0\" not found\n",
                1,
            ),
            ("secret-ids --format=json", "[]\n", "", 0),
            ("secret-ids", "", "", 0),
            (
                "secret-add --label db-password --owner unit password=x",
                "",
                "error: secret-add is not supported: jujube has no secrets for charms\n",
                1,
            ),
            (
                "secret-add password=x",
                "",
                "error: secret-add is not supported: jujube has no secrets for charms\n",
                1,
            ),
            (
                "resource-get software",
                "",
                "error: resource-get is not supported: jujube has no resources for charms; ship the file in the charm\n",
                1,
            ),
            (
                "state-get --format=json",
                "",
                "error: state-get is not supported: jujube keeps no charm state on the controller; keep it in the charm's directory\n",
                1,
            ),
        ],
    )
    .await;
    let out = run(&ctx, &["network-get", "db", "--format=json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["ingress-addresses"][0], address.as_str(), "{v}");
    // Juju's JSON names an address `value`; its YAML says `address` too.
    assert_eq!(
        v["bind-addresses"][0]["addresses"][0]["value"],
        address.as_str()
    );
    // goal-state: the service's units, and per endpoint the related
    // application and its units (here mysql/1 is being destroyed).
    f.w.store.destroy_units(&["mysql/1".to_string()]).unwrap();
    let out = run(&ctx, &["goal-state", "--format=json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["units"]["wordpress/0"]["status"], "active", "{v}");
    let db = &v["relations"]["db"];
    assert_eq!(db["mysql"]["status"], "joined", "{v}");
    assert_eq!(db["mysql/0"]["status"], "active", "{v}");
    assert_eq!(db["mysql/1"]["status"], "dying", "{v}");
    assert!(
        db["mysql/0"]["since"].as_str().unwrap().ends_with('Z'),
        "{v}"
    );
    let st = f.w.store.status().unwrap();
    assert_eq!(st.services.get("wordpress").unwrap().version, "5.7.2");
}

/// Application data (`--app`), leader settings, `opened-ports` and the
/// action tools, as `ops` calls them: the leader writes its application's
/// bag (seen by its own later reads in the hook), a non-leader is refused;
/// the action tools work only in an action's context.
#[tokio::test]
async fn application_data_leader_settings_and_actions_as_ops_calls_them() {
    let f = fixture();
    let ctx = f.ctx(Some("mysql/0"));
    assert!(f.w.store.claim_leadership("mysql/2").unwrap());
    check(
        &ctx,
        &[
            ("relation-list --format=json --app -r {r}", "\"mysql\"\n", "", 0),
            ("relation-get --format=json -r {r} --app - mysql", "{}\n", "", 0),
            // In a hook about mysql/0, --app without a name is mysql's bag.
            ("relation-get --app --format=json", "{}\n", "", 0),
            ("relation-set -r {r} --app url=http://w", "", "", 0),
            ("relation-get --format=json -r {r} --app - wordpress", "{\"url\":\"http://w\"}\n", "", 0),
            ("is-leader --format=json", "true\n", "", 0),
            ("leader-set password=s3cret gone=", "", "", 0),
            ("leader-get --format=json", "{\"password\":\"s3cret\"}\n", "", 0),
            ("leader-get password", "s3cret\n", "", 0),
            ("leader-set", "", "error: no key=value pairs specified\n", 2),
            ("open-port 80/tcp", "", "", 0),
            ("opened-ports --format=json", "[\"80/tcp\"]\n", "", 0),
            (
                "action-get",
                "",
                "error: action-get may only be used in an action context; this is a relation hook\n",
                1,
            ),
        ],
    )
    .await;
    // The hook's --app write is pending until it succeeds, then it is the
    // application's for mysql's units to read.
    let pending = ctx.pending_app.lock().await.get(&f.db).cloned().unwrap();
    assert_eq!(pending["url"].as_deref(), Some("http://w"));
    let m0 = Arc::new(HookContext::new(
        "ctx-m0".into(),
        "mysql/0",
        HookView {
            relation: Some((f.db, "db".into())),
            relations: BTreeMap::from([(f.db, "db".to_string())]),
            apps: BTreeMap::from([(f.db, "wordpress".to_string())]),
            ..HookView::default()
        },
        f.facades.for_agent(Tag::unit("mysql/0")),
        f.w.dir.path().join("unit.log"),
    ));
    check(
        &m0,
        &[
            (
                "relation-set --app -r {db} x=1",
                "",
                "error: cannot write relation settings: unit `mysql/0` is not the leader; only the leader sets its application's settings (`is-leader` tells)\n",
                1,
            ),
            ("leader-get --format=json", "{}\n", "", 0),
            // No remote unit (an application's data changed, or -broken):
            // as Juju, the remote application's data; and with --app, a
            // unit's name stands for its application.
            ("relation-get --format=json", "{}\n", "", 0),
            ("relation-get --format=json url", "null\n", "", 0),
            ("relation-get --app --format=json - wordpress/0", "{}\n", "", 0),
        ],
    )
    .await;
    let out = run(&m0, &["leader-set", "a=b"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("not the leader"), "{}", out.stderr);

    // An action's context.
    let action = Arc::new(HookContext::new(
        "ctx-action".into(),
        "wordpress/0",
        HookView {
            action: Some(serde_json::json!({"target": "x", "nested": {"level": 3}})),
            ..HookView::default()
        },
        f.facades.for_agent(Tag::unit("wordpress/0")),
        f.w.dir.path().join("unit.log"),
    ));
    check(
        &action,
        &[
            ("action-get --format=json", "{\"nested\":{\"level\":3},\"target\":\"x\"}\n", "", 0),
            ("action-get nested.level", "3\n", "", 0),
            ("action-get missing", "", "", 0),
            ("action-set path=/b/x detail.level=3 compressed=True", "", "", 0),
            (
                "action-set Bad=1",
                "",
                "error: key \"Bad\" must start and end with lowercase alphanumeric, and contain only lowercase alphanumeric, hyphens and periods\n",
                2,
            ),
            ("action-set stdout=1", "", "error: cannot set reserved action key \"stdout\"\n", 2),
            ("action-log -- backing up", "", "", 0),
            ("action-fail -- disk-full", "", "", 0),
            ("action-fail a b", "", "error: unrecognized args: [\"b\"]\n", 2),
        ],
    )
    .await;
    // Results above their bound are refused, those set before kept; the
    // log keeps what fits its bound (the rest is in the unit's log only).
    let big = format!(
        "blob={}",
        "x".repeat(jujube_agent::api::MAX_ACTION_RESULTS_BYTES)
    );
    let out = run(&action, &["action-set", &big]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("more than the"), "{}", out.stderr);
    let line = "y".repeat(tools::MAX_ACTION_LOG_MESSAGE);
    for _ in 0..(tools::MAX_ACTION_LOG_BYTES / tools::MAX_ACTION_LOG_MESSAGE + 2) {
        assert_eq!(run(&action, &["action-log", &line]).await.code, 0);
    }
    let mut outcome = action.action.as_ref().unwrap().outcome.lock().await.clone();
    assert!(serde_json::to_string(&outcome.log).unwrap().len() <= tools::MAX_ACTION_LOG_BYTES);
    outcome.log.truncate(1);
    assert_eq!(
        outcome.results.keys().collect::<Vec<_>>(),
        ["compressed", "detail.level", "path"]
    );
    assert_eq!(outcome.failed.as_deref(), Some("disk-full"));
    assert_eq!(outcome.log.len(), 1);
    assert_eq!(outcome.log[0].1, "backing up");
}
