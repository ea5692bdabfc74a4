//! The hook context a running hook's tools talk to, and the unit agent's
//! socket they reach it through.
//!
//! One hook runs at a time per unit, so the socket serves at most one
//! context; a tool naming another context id (a stale one, or a process
//! left over from an earlier hook) is refused. Reads are cached for the
//! hook's life: the first answer is the answer, whatever changes meanwhile
//! (the spec's sandbox). `relation-set` goes to a buffer that the unit agent
//! writes through the facade only when the hook exits 0.

use crate::api::Facade;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;

/// One tool invocation, as the tool client sends it (one JSON line).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Request {
    pub context_id: String,
    pub tool: String,
    pub args: Vec<String>,
    /// The tool's working directory (relative `--file` paths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The tool's standard input, sent only when the tool reads it
    /// (`relation-set --file -`; see [`super::tools::reads_stdin`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

/// The most a tool request (arguments, and standard input where it is
/// read) may hold on the tool channel. A tool refuses a larger one itself,
/// naming this limit; the socket never reads more.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// What the tool prints and exits with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// `--output FILE`: the client writes `stdout` there instead, relative
    /// to its own working directory, with its own permissions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
}

impl Output {
    pub fn ok(stdout: impl Into<String>) -> Output {
        Output {
            code: 0,
            stdout: stdout.into(),
            stderr: String::new(),
            file: None,
        }
    }

    pub fn fail(code: i32, message: impl Into<String>) -> Output {
        Output {
            code,
            stdout: String::new(),
            stderr: format!("error: {}\n", message.into()),
            file: None,
        }
    }
}

/// Everything a hook's tools may see and do, for one hook run.
pub struct HookContext {
    pub id: String,
    pub unit: String,
    /// The relation the hook is about (`id`, this side's relation name).
    pub relation: Option<(i64, String)>,
    pub remote: Option<String>,
    /// Relations whose scope the unit is in: id → this side's name.
    pub relations: BTreeMap<i64, String>,
    pub api: Arc<dyn Facade>,
    pub log: PathBuf,
    pub(crate) settings: Mutex<HashMap<(i64, String), BTreeMap<String, String>>>,
    /// What `relation-list` answers: per relation, the remote units whose
    /// `-joined` has run and that have not departed, as the hooks have seen
    /// them (not the live scope), with the hook's own remote unit in a
    /// `-joined`/`-changed` and without it in a `-departed`.
    pub(crate) members: BTreeMap<i64, Vec<String>>,
    pub(crate) config: Mutex<Option<BTreeMap<String, serde_json::Value>>>,
    /// `relation-set`s of this hook, per relation, written on success.
    pub pending: Mutex<BTreeMap<i64, BTreeMap<String, Option<String>>>>,
    /// `relation-set --app`s of this hook, per relation, written on
    /// success.
    pub pending_app: Mutex<BTreeMap<i64, BTreeMap<String, Option<String>>>>,
    /// Per relation, the remote application (`relation-list --app`).
    pub(crate) apps: BTreeMap<i64, String>,
    /// The action running in this context, if it is one.
    pub action: Option<ActionContext>,
}

/// What an action's tools use: its parameters (`action-get`) and what it
/// says (`action-set`, `action-fail`, `action-log`).
pub struct ActionContext {
    pub params: serde_json::Value,
    pub outcome: Mutex<crate::api::ActionOutcome>,
}

/// What a hook is about and what its relations look like to it.
#[derive(Debug, Clone, Default)]
pub struct HookView {
    /// The relation the hook is about (`id`, this side's relation name).
    pub relation: Option<(i64, String)>,
    pub remote: Option<String>,
    /// Relations whose scope the unit is in: id → this side's name.
    pub relations: BTreeMap<i64, String>,
    /// See [`HookContext::members_of`].
    pub members: BTreeMap<i64, Vec<String>>,
    /// Per relation, the remote application (the unit's own in a peer
    /// relation).
    pub apps: BTreeMap<i64, String>,
    /// The parameters of the action that runs, if one does.
    pub action: Option<serde_json::Value>,
}

impl HookContext {
    pub fn new(
        id: String,
        unit: &str,
        view: HookView,
        api: Arc<dyn Facade>,
        log: PathBuf,
    ) -> HookContext {
        let HookView {
            relation,
            remote,
            relations,
            members,
            apps,
            action,
        } = view;
        HookContext {
            id,
            unit: unit.to_string(),
            relation,
            remote,
            relations,
            api,
            log,
            settings: Mutex::default(),
            members,
            config: Mutex::default(),
            pending: Mutex::default(),
            pending_app: Mutex::default(),
            apps,
            action: action.map(|params| ActionContext {
                params,
                outcome: Mutex::default(),
            }),
        }
    }

    /// `relation-list`'s answer for `rel`, sorted as strings (Juju's order).
    pub fn members_of(&self, rel: i64) -> Vec<String> {
        let mut m = self.members.get(&rel).cloned().unwrap_or_default();
        m.sort();
        m
    }
}

/// The unit agent's tool socket.
pub struct ToolServer {
    pub path: PathBuf,
    current: Arc<Mutex<Option<Arc<HookContext>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ToolServer {
    /// Listens on `path` (a stale socket file is replaced).
    pub fn start(path: &Path) -> std::io::Result<ToolServer> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        let current: Arc<Mutex<Option<Arc<HookContext>>>> = Arc::default();
        let cur = current.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let cur = cur.clone();
                tokio::spawn(async move {
                    let (r, mut w) = stream.into_split();
                    let mut line = Vec::new();
                    // One request per connection, at most the limit (and
                    // its newline); JSON escapes make the line longer than
                    // what it carries, so allow for them.
                    let cap = (2 * MAX_REQUEST_BYTES + 4096) as u64;
                    let mut r = BufReader::new(tokio::io::AsyncReadExt::take(r, cap + 1));
                    if r.read_until(b'\n', &mut line).await.is_err() {
                        return;
                    }
                    let out = match serde_json::from_slice::<Request>(&line) {
                        Err(_) if line.len() as u64 > cap || !line.ends_with(b"\n") => Output::fail(
                            1,
                            format!(
                                "the tool's request is larger than the tool channel's limit of {} bytes",
                                MAX_REQUEST_BYTES
                            ),
                        ),
                        Err(e) => Output::fail(2, format!("malformed tool request: {e}")),
                        Ok(req) => {
                            let ctx = cur.lock().await.clone();
                            match ctx {
                                Some(ctx) if ctx.id == req.context_id => {
                                    let inv = super::tools::Invocation {
                                        cwd: req.cwd.as_deref(),
                                        stdin: req.stdin.as_deref(),
                                    };
                                    super::tools::run(&ctx, &req.tool, &req.args, &inv).await
                                }
                                _ => Output::fail(
                                    1,
                                    format!(
                                        "context `{}` is not running; hook tools work only while their hook runs",
                                        req.context_id
                                    ),
                                ),
                            }
                        }
                    };
                    let mut bytes = serde_json::to_vec(&out).expect("plain data");
                    bytes.push(b'\n');
                    let _ = w.write_all(&bytes).await;
                });
            }
        });
        Ok(ToolServer {
            path: path.to_path_buf(),
            current,
            task,
        })
    }

    /// Makes `ctx` the context tools reach (`None` between hooks).
    pub async fn set(&self, ctx: Option<Arc<HookContext>>) {
        *self.current.lock().await = ctx;
    }
}

impl Drop for ToolServer {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}
