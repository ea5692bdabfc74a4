//! Deploying units: a directory per unit under its machine's directory, with
//! the charm copied in, and a running unit agent.
//!
//! ```text
//! <agents dir>/machine-1/                    one per machine (its agent's)
//!     unit-wordpress-0/                      deployed by machine-1
//!         agent.json                         {"unit", "deployer", "charm-url", "charm-files"}
//!         charm/                             the charm, copied
//!     unit-logging-3/                        deployed by unit-wordpress-0
//! ```
//!
//! The directory *is* the record of what was deployed: it is built under a
//! temporary name (`*.deploying`) and renamed into place, and a recall renames
//! it away (`*.recalling`) before deleting it, so a kill -9 at any point
//! leaves either a deployment or an attributable leftover that the next
//! [`Deployer::open`] clears. A restarted deployer therefore resumes exactly
//! where it stopped: it restarts the agents of what it had deployed.
//!
//! A deployer serves one owner — a machine agent for its principals, or a
//! unit agent for its subordinates — and applies the same rules to both
//! ([`Deployer::reconcile`]), as lifecycles.txt lists them.

use crate::api::{CharmRef, Connector, ErrorCode, Facade, Tag, UnitRef};
use crate::{Error, Result, Running};
use jujube_core::Life;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::{debug, warn};

const RECORD: &str = "agent.json";
const DEPLOYING: &str = ".deploying";
const RECALLING: &str = ".recalling";

/// `agent.json` in a unit's directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Record {
    pub unit: String,
    pub deployer: Tag,
    pub charm_url: String,
    /// What the charm laid in `charm/`, relative paths (see
    /// [`install_charm`]). Kept here rather than in a file of its own:
    /// deploying 100,000 units is bound by creating inodes. (Units
    /// deployed before kept it in `charm.manifest`, read once more at
    /// their next upgrade.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub charm_files: Vec<String>,
}

/// The deployed units, sorted by name, and their agents (`None`: not
/// started yet). A sorted `Vec`, not a map: most deployers hold one unit (a
/// machine's principal), and a one-entry `BTreeMap` took 450 bytes.
#[derive(Default)]
struct Deployed(Vec<(String, Option<Running>)>);

impl Deployed {
    fn find(&self, unit: &str) -> std::result::Result<usize, usize> {
        self.0.binary_search_by(|(u, _)| u.as_str().cmp(unit))
    }

    fn contains(&self, unit: &str) -> bool {
        self.find(unit).is_ok()
    }

    fn get_mut(&mut self, unit: &str) -> Option<&mut Option<Running>> {
        let i = self.find(unit).ok()?;
        Some(&mut self.0[i].1)
    }

    fn insert(&mut self, unit: String, running: Option<Running>) {
        match self.find(&unit) {
            Ok(i) => self.0[i].1 = running,
            Err(i) => {
                // Exactly: a vector's usual growth would give the one-unit
                // deployer room for four.
                self.0.reserve_exact(1);
                self.0.insert(i, (unit, running))
            }
        }
    }

    fn remove(&mut self, unit: &str) {
        if let Ok(i) = self.find(unit) {
            self.0.remove(i);
        }
    }
}

/// What one owner deployed, and the agents it runs for them.
pub struct Deployer {
    api: Arc<dyn Facade>,
    connector: Arc<dyn Connector>,
    /// Shared by every agent on the machine (one allocation per machine).
    machine_dir: Arc<Path>,
    deployed: Deployed,
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// The directory name of a unit (its tag).
pub fn unit_dir_name(unit: &str) -> String {
    Tag::unit(unit).to_string()
}

/// The charm URL a unit was deployed with (its `agent.json`).
pub(crate) fn deployed_charm(unit_dir: &Path) -> Option<String> {
    read_record(unit_dir).map(|r| r.charm_url)
}

fn read_record(dir: &Path) -> Option<Record> {
    load_record(dir).ok()
}

/// The record in unit directory `dir`; one that cannot be read or parsed
/// is an error naming it.
fn load_record(dir: &Path) -> Result<Record> {
    let path = dir.join(RECORD);
    let text = std::fs::read_to_string(&path).map_err(io("read", &path))?;
    serde_json::from_str(&text).map_err(|e| Error::Io {
        action: "read",
        path,
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// Writes `record` at `path` (in place: see the callers for when that is
/// enough).
fn write_record(path: &Path, record: &Record) -> Result<()> {
    let bytes = serde_json::to_vec(record).expect("record serialises");
    std::fs::write(path, bytes).map_err(io("write", path))
}

/// A charm's files, gathered before anything of it is laid: a deploy then
/// writes the unit's record once, complete, before it lays them (a second
/// write of the record truncated it, and ext4 writes a file truncated
/// and written again out to the disk as it is closed: a block allocation
/// and a write a unit, in the deploy's path).
pub(crate) enum CharmFiles {
    /// Copied from where the controller keeps the charm (this machine):
    /// its directories and files relative to its root, each directory
    /// before what it holds.
    Local {
        root: PathBuf,
        entries: Vec<(String, bool)>,
    },
    /// Fetched through the API (an agent on another machine).
    Fetched(Vec<crate::api::CharmFile>),
}

impl CharmFiles {
    /// `unit`'s charm: listed where the controller keeps it when that is
    /// here, else fetched through the API.
    pub(crate) async fn gather(
        api: &dyn Facade,
        unit: &str,
        charm: &CharmRef,
    ) -> Result<CharmFiles> {
        let root = Path::new(&charm.path);
        if root.is_dir() {
            CharmFiles::listed(root)
        } else {
            Ok(CharmFiles::Fetched(api.charm_files(unit).await?))
        }
    }

    /// The charm at `root`, on this machine.
    fn listed(root: &Path) -> Result<CharmFiles> {
        let mut entries = Vec::new();
        list_tree(root, "", &mut entries)?;
        Ok(CharmFiles::Local {
            root: root.to_path_buf(),
            entries,
        })
    }

    /// The files it lays, relative to the charm's root (what the unit's
    /// record lists).
    fn paths(&self) -> Vec<String> {
        match self {
            CharmFiles::Local { entries, .. } => entries
                .iter()
                .filter(|(_, dir)| !dir)
                .map(|(rel, _)| rel.clone())
                .collect(),
            CharmFiles::Fetched(files) => files.iter().map(|f| f.path.clone()).collect(),
        }
    }

    /// Lays the files under `to` (over what is there: they replace theirs).
    fn lay(&self, to: &Path) -> Result<()> {
        match self {
            CharmFiles::Local { root, entries } => {
                make_dir(to)?;
                for (rel, dir) in entries {
                    let dst = to.join(rel);
                    if *dir {
                        make_dir(&dst)?;
                    } else {
                        let src = root.join(rel);
                        std::fs::copy(&src, &dst).map_err(io("copy", &src))?;
                    }
                }
                Ok(())
            }
            CharmFiles::Fetched(files) => {
                std::fs::create_dir_all(to).map_err(io("create", to))?;
                write_files(files, to)
            }
        }
    }
}

/// Creates directory `dir`, whose parent exists; one already there is
/// fine (laid over).
fn make_dir(dir: &Path) -> Result<()> {
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        r => r.map_err(io("create", dir)),
    }
}

/// Puts `unit`'s charm over the one in `unit_dir`'s `charm/` (an upgrade:
/// its files replace theirs).
///
/// The files a charm put there are listed in the unit's record
/// (`charm-files`), as Juju's charm deployer keeps a manifest: laying a new
/// revision removes the files the old one had and the new one has not (a
/// hook the new revision dropped must not run), while whatever the charm's
/// hooks wrote themselves stays.
pub(crate) async fn install_charm(
    api: &dyn Facade,
    unit: &str,
    charm: &CharmRef,
    unit_dir: &Path,
) -> Result<()> {
    let files = CharmFiles::gather(api, unit, charm).await?;
    files.lay(&unit_dir.join("charm"))?;
    record_laid(unit_dir, files.paths())
}

/// Lists `laid` in the unit's record, first removing the files the earlier
/// lay listed that `laid` lacks.
fn record_laid(unit_dir: &Path, laid: Vec<String>) -> Result<()> {
    let path = unit_dir.join(RECORD);
    let mut record = load_record(unit_dir)?;
    let legacy = unit_dir.join(LEGACY_MANIFEST);
    let old = match std::mem::take(&mut record.charm_files) {
        files if files.is_empty() => std::fs::read_to_string(&legacy)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        files => files,
    };
    let to = unit_dir.join("charm");
    let new: std::collections::BTreeSet<&str> = laid.iter().map(String::as_str).collect();
    for gone in old.iter().filter(|l| !new.contains(l.as_str())) {
        let rel = Path::new(gone);
        // A manifest line is a path this code wrote; still, never leave
        // the charm directory.
        if rel
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            let path = to.join(rel);
            let _ = std::fs::remove_file(&path);
            // Directories the old revision brought, if now empty.
            let mut dir = path.parent();
            while let Some(d) = dir.filter(|d| *d != to.as_path()) {
                if std::fs::remove_dir(d).is_err() {
                    break;
                }
                dir = d.parent();
            }
        }
    }
    record.charm_files = laid;
    let tmp = path.with_extension("tmp");
    write_record(&tmp, &record)?;
    std::fs::rename(&tmp, &path).map_err(io("rename", &path))?;
    match std::fs::remove_file(&legacy) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", &legacy)(e)),
        _ => Ok(()),
    }
}

/// Where units deployed by earlier versions listed their charm's files.
const LEGACY_MANIFEST: &str = "charm.manifest";

/// Adds what directory `dir` of a charm holds to `entries`, relative to
/// the charm's root (`rel` is `dir`'s), each directory before its
/// contents. (Copied with their permissions by [`CharmFiles::lay`].)
fn list_tree(dir: &Path, rel: &str, entries: &mut Vec<(String, bool)>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(io("read", dir))? {
        let entry = entry.map_err(io("read", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let rel = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        if entry
            .file_type()
            .map_err(io("read", &entry.path()))?
            .is_dir()
        {
            entries.push((rel.clone(), true));
            list_tree(&entry.path(), &rel, entries)?;
        } else {
            entries.push((rel, false));
        }
    }
    Ok(())
}

/// Writes a charm fetched through the API under `to`, with its modes.
fn write_files(files: &[crate::api::CharmFile], to: &Path) -> Result<()> {
    use base64::Engine;
    use std::os::unix::fs::PermissionsExt;
    for f in files {
        let rel = Path::new(&f.path);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(crate::Error::Io {
                action: "write",
                path: rel.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a charm file path must stay inside the charm",
                ),
            });
        }
        let path = to.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io("create", parent))?;
        }
        let data = base64::engine::general_purpose::STANDARD
            .decode(&f.data)
            .map_err(|e| crate::Error::Io {
                action: "decode",
                path: path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
            })?;
        std::fs::write(&path, data).map_err(io("write", &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode & 0o777))
            .map_err(io("chmod", &path))?;
    }
    Ok(())
}

impl Deployer {
    /// Reads what `api`'s owner deployed under `machine_dir`, clearing the
    /// owner's leftovers of interrupted deploys and recalls. (The machine's
    /// own agent also clears leftovers that name no owner.) Agents are not
    /// started until [`Deployer::start_agents`].
    pub fn open(
        api: Arc<dyn Facade>,
        connector: Arc<dyn Connector>,
        machine_dir: Arc<Path>,
    ) -> Result<Deployer> {
        let mut d = Deployer::new(api, connector, machine_dir);
        d.scan()?;
        Ok(d)
    }

    /// A deployer that has not read its directory yet (see
    /// [`Deployer::scan`]): a machine agent keeps one from its start, and
    /// no second copy of its facade and directory.
    pub fn new(
        api: Arc<dyn Facade>,
        connector: Arc<dyn Connector>,
        machine_dir: Arc<Path>,
    ) -> Deployer {
        Deployer {
            api,
            connector,
            machine_dir,
            deployed: Deployed::default(),
        }
    }

    pub fn api(&self) -> &Arc<dyn Facade> {
        &self.api
    }

    pub fn connector(&self) -> &Arc<dyn Connector> {
        &self.connector
    }

    /// What [`Deployer::open`] reads: replaces what this deployer knew of
    /// its units (their agents are not started).
    pub fn scan(&mut self) -> Result<()> {
        let machine_dir = self.machine_dir.clone();
        let owner = self.api.tag().clone();
        let mut deployed = Deployed::default();
        let entries = match std::fs::read_dir(&machine_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A new machine: nothing deployed yet.
                std::fs::create_dir_all(&machine_dir).map_err(io("create", &machine_dir))?;
                self.deployed = deployed;
                return Ok(());
            }
            Err(e) => return Err(io("read", &machine_dir)(e)),
        };
        // A unit's own directory is never its deployment (nor a leftover
        // of one): not read.
        let own = match &owner {
            Tag::Unit(_) => Some(owner.to_string()),
            _ => None,
        };
        for entry in entries {
            let entry = entry.map_err(io("read", &machine_dir))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if own.as_deref() == Some(name.as_str()) {
                continue;
            }
            let record = read_record(&path);
            let mine = record.as_ref().map(|r| r.deployer == owner);
            let leftover = name.ends_with(DEPLOYING) || name.ends_with(RECALLING);
            if leftover {
                // Ours, or (for the machine's own agent, which opens before
                // any unit agent runs) one that names no owner.
                if mine == Some(true) || (mine.is_none() && matches!(owner, Tag::Machine(_))) {
                    debug!(%owner, dir = %path.display(), "clearing an interrupted deploy or recall");
                    if name.ends_with(RECALLING) {
                        // Garbage only (never counted as deployed), and
                        // perhaps being deleted by this process's reaper
                        // right now: a failure is not the deployer's.
                        remove_tree(&path);
                    } else {
                        std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
                    }
                }
            } else if let (Some(true), Some(record)) = (mine, record) {
                deployed.insert(record.unit, None);
            }
        }
        self.deployed = deployed;
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.deployed.0.is_empty()
    }

    pub fn deployed(&self) -> impl Iterator<Item = &str> {
        self.deployed.0.iter().map(|(u, _)| u.as_str())
    }

    fn unit_dir(&self, unit: &str) -> PathBuf {
        self.machine_dir.join(unit_dir_name(unit))
    }

    /// Starts the agent of every deployed unit whose agent is not running
    /// (after [`Deployer::open`], or when one ended while its unit lives).
    pub fn start_agents(&mut self) {
        let dir = self.machine_dir.clone();
        for (unit, running) in self.deployed.0.iter_mut() {
            if running.as_ref().is_none_or(|r| r.is_finished()) {
                *running = Some(start_unit_agent(&self.connector, &dir, unit));
            }
        }
    }

    /// Deploys a unit: its directory with the charm, then its agent.
    pub async fn deploy(&mut self, unit: &str, charm: &CharmRef) -> Result<()> {
        // Before anything is made: the record lists the charm's files.
        let files = CharmFiles::gather(&*self.api, unit, charm).await?;
        let dir = self.unit_dir(unit);
        let tmp = self
            .machine_dir
            .join(format!("{}{DEPLOYING}", unit_dir_name(unit)));
        match std::fs::create_dir(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // What an interrupted deploy of this unit left.
                std::fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
                std::fs::create_dir(&tmp).map_err(io("create", &tmp))?;
            }
            Err(_) => std::fs::create_dir_all(&tmp).map_err(io("create", &tmp))?,
        }
        // The record first, so that a leftover is attributable; written
        // once, in place (the directory is renamed into place whole), with
        // the charm's files listed in it: an inode fewer a deploy than a
        // manifest of its own.
        let record = Record {
            unit: unit.to_string(),
            deployer: self.api.tag().clone(),
            charm_url: charm.url.clone(),
            charm_files: files.paths(),
        };
        write_record(&tmp.join(RECORD), &record)?;
        files.lay(&tmp.join("charm"))?;
        std::fs::rename(&tmp, &dir).map_err(io("rename", &tmp))?;
        debug!(owner = %self.api.tag(), unit, "deployed");
        let running = start_unit_agent(&self.connector, &self.machine_dir, unit);
        self.deployed.insert(unit.to_string(), Some(running));
        crate::startup::took(crate::startup::StartStep::Deployed);
        Ok(())
    }

    /// Recalls a unit: stops its agent, renames its directory away (the
    /// recall) and has it deleted in the background.
    pub async fn recall(&mut self, unit: &str) -> Result<()> {
        if let Some(Some(running)) = self.deployed.get_mut(unit) {
            running.stop();
            running.finished().await;
        }
        let dir = self.unit_dir(unit);
        if dir.exists() {
            // A name of its own: an earlier recall's leftover may still be
            // being deleted.
            let mut away = format!("{}{RECALLING}", unit_dir_name(unit));
            let mut n = 0;
            while self.machine_dir.join(&away).exists() {
                n += 1;
                away = format!("{}.{n}{RECALLING}", unit_dir_name(unit));
            }
            std::fs::rename(&dir, self.machine_dir.join(&away)).map_err(io("rename", &dir))?;
            delete_in_background(self.machine_dir.clone(), away.into());
        }
        self.deployed.remove(unit);
        debug!(owner = %self.api.tag(), unit, "recalled");
        Ok(())
    }

    /// Stops every agent this deployer runs, keeping the deployments (a
    /// restart resumes them).
    pub async fn stop(&mut self) {
        for running in self.deployed.0.iter().filter_map(|(_, r)| r.as_ref()) {
            running.stop();
        }
        for (_, running) in self.deployed.0.iter_mut() {
            if let Some(r) = running.take() {
                r.finished().await;
            }
        }
    }

    /// One pass of the deployer's duties over the units it is responsible
    /// for (a machine's principals, or a unit's subordinates):
    ///
    /// - Alive and not deployed: deploy it;
    /// - not Alive and not deployed: set it Dead and remove it (there is no
    ///   point deploying a unit only for its agent to set itself Dead);
    /// - Dead and deployed: recall it, then remove it;
    /// - deployed but no longer ours (unassigned, removed): recall it.
    ///
    /// Returns whether it changed anything. A unit that fails to deploy is
    /// reported in its status and the others still go ahead; the first
    /// failure is returned at the end, so the owner retries later.
    pub async fn reconcile(&mut self, units: &[UnitRef]) -> Result<bool> {
        let mut acted = false;
        let mut failed: Option<Error> = None;
        let ours: HashSet<&str> = units.iter().map(|u| u.name.as_str()).collect();
        let gone: Vec<String> = self
            .deployed()
            .filter(|u| !ours.contains(u))
            .map(str::to_string)
            .collect();
        for unit in gone {
            self.recall(&unit).await?;
            acted = true;
        }
        for u in units {
            let deployed = self.deployed.contains(&u.name);
            match (u.life, deployed) {
                (Life::Alive, false) => {
                    let charm = match self.api.charm(&u.name).await {
                        Ok(c) => c,
                        Err(e) if e.code == ErrorCode::Unauthorized => continue,
                        Err(e) => return Err(e.into()),
                    };
                    if let Err(e) = self.deploy(&u.name, &charm).await {
                        warn!(unit = %u.name, error = %e, "deploy failed; will retry");
                        let _ = self
                            .api
                            .set_unit_status(
                                &u.name,
                                crate::api::AgentStatus::Failed,
                                &crate::api::fit_status_info(&format!("cannot deploy: {e}")),
                            )
                            .await;
                        failed.get_or_insert(e);
                    } else {
                        acted = true;
                    }
                }
                (Life::Dying | Life::Dead, false) => {
                    if went_through(self.api.ensure_dead_unit(&u.name).await)?
                        && went_through(self.api.remove_unit(&u.name).await)?
                    {
                        debug!(owner = %self.api.tag(), unit = %u.name, "removed undeployed unit");
                        acted = true;
                    }
                }
                (Life::Dead, true) => {
                    self.recall(&u.name).await?;
                    if went_through(self.api.remove_unit(&u.name).await)? {
                        debug!(owner = %self.api.tag(), unit = %u.name, "removed dead unit");
                    }
                    acted = true;
                }
                (Life::Alive | Life::Dying, true) => {}
            }
        }
        self.start_agents();
        match failed {
            Some(e) => Err(e),
            None => Ok(acted),
        }
    }
}

/// Deletes a recalled unit's directory on a thread of its own. The rename
/// to `*.recalling` is the recall (a leftover is cleared by the next
/// [`Deployer::open`] if the process dies first); the deletion is only disk
/// work, and slow work where the filesystem discards freed blocks: done in
/// the pass, it held one of the runtime's two worker threads in I/O waits
/// per unit, and recalls were most of the time 100,000 units took to go.
fn delete_in_background(machine_dir: Arc<Path>, name: Box<str>) {
    static REAPER: std::sync::OnceLock<Arc<Reaper>> = std::sync::OnceLock::new();
    REAPER
        .get_or_init(|| {
            let reaper = Arc::new(Reaper::new(Reaper::QUEUED));
            reaper.start(Reaper::THREADS);
            reaper
        })
        .delete(machine_dir, name);
}

/// Deletes recalled units' directories on threads of its own, holding at
/// most [`Reaper::QUEUED`] of their names however many units are recalled
/// at once. A name queued is the machine's directory (shared with its
/// deployer) and the name in it. Past the bound, only the machine's
/// directory is kept, once, and searched for `*.recalling` directories
/// after a reaper's next queued deletion: what the reaper holds then grows
/// with the machines this process serves, never with the units recalled.
struct Reaper {
    queue: std::sync::mpsc::SyncSender<Queued>,
    next: std::sync::Mutex<std::sync::mpsc::Receiver<Queued>>,
    /// Machines' directories holding recalled units whose names did not
    /// fit in the queue. Taken under this lock only where the queue's
    /// order with it matters (see [`Reaper::delete`]).
    overflow: std::sync::Mutex<HashSet<Arc<Path>>>,
    /// Threads started: with none, a deletion is done by its caller.
    threads: std::sync::atomic::AtomicUsize,
}

type Queued = (Arc<Path>, Box<str>);

impl Reaper {
    /// 4,096 names: 250 KB.
    const QUEUED: usize = 4096;
    /// A few threads: the deletions mostly wait on the disk.
    const THREADS: usize = 4;

    fn new(queued: usize) -> Reaper {
        let (queue, next) = std::sync::mpsc::sync_channel(queued);
        Reaper {
            queue,
            next: std::sync::Mutex::new(next),
            overflow: Default::default(),
            threads: Default::default(),
        }
    }

    fn start(self: &Arc<Self>, threads: usize) {
        for i in 0..threads {
            let reaper = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("recalled-dirs-{i}"))
                .spawn(move || while reaper.reap_one() {});
            match spawned {
                Ok(_) => {
                    self.threads
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => {
                    warn!(error = %e, "cannot start a thread that deletes recalled units' directories")
                }
            }
        }
    }

    /// Has `machine_dir/name` deleted: queued, or its machine's directory
    /// searched later when the queue is full. The overflow's lock is held
    /// across the attempt to queue, so that a directory added because
    /// the queue was full is seen by the check that follows the deletion
    /// of one of the names then queued (each taken after this returns).
    fn delete(&self, machine_dir: Arc<Path>, name: Box<str>) {
        use std::sync::mpsc::TrySendError;
        if self.threads.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return remove_tree(&machine_dir.join(&*name));
        }
        let mut overflow = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        match self.queue.try_send((machine_dir, name)) {
            Ok(()) => {}
            Err(TrySendError::Full((dir, _))) => {
                overflow.insert(dir);
            }
            Err(TrySendError::Disconnected((dir, name))) => {
                drop(overflow);
                remove_tree(&dir.join(&*name));
            }
        }
    }

    /// Waits for a queued name and deletes it, then every machine's
    /// overflow (one at a time: other reapers share them), so that no
    /// directory added to it waits for a name that is never queued.
    /// `false` once nothing more can be queued.
    fn reap_one(&self) -> bool {
        let next = self.next.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((dir, name)) = next else { return false };
        remove_tree(&dir.join(&*name));
        loop {
            let overflowed = {
                let mut overflow = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
                let dir = overflow.iter().next().cloned();
                dir.inspect(|d| {
                    overflow.remove(d);
                })
            };
            match overflowed {
                Some(dir) => remove_recalled(&dir),
                None => return true,
            }
        }
    }
}

/// Deletes every recalled unit's directory left in `machine_dir`.
fn remove_recalled(machine_dir: &Path) {
    let entries = match std::fs::read_dir(machine_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            warn!(dir = %machine_dir.display(), error = %e, "cannot look for recalled units' directories");
            return;
        }
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().ends_with(RECALLING) {
            remove_tree(&entry.path());
        }
    }
}

/// Deletes a directory tree; one already gone (deleted meanwhile) is fine.
fn remove_tree(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(dir = %path.display(), error = %e, "cannot delete a recalled unit's directory");
        }
    }
}

/// `Ok(true)` when the call went through, `Ok(false)` when a rule refused it
/// or the unit is gone (the next notice brings the state that explains it).
fn went_through(r: crate::api::ApiResult<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.code, ErrorCode::Refused | ErrorCode::Unauthorized) => {
            debug!(error = %e, "not now");
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

fn start_unit_agent(
    connector: &Arc<dyn Connector>,
    machine_dir: &Arc<Path>,
    unit: &str,
) -> Running {
    let api = connector.connect(&Tag::unit(unit));
    crate::unit::UnitAgent::new(api, connector.clone(), machine_dir.clone()).spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However many units are recalled at once, the reaper holds at most
    /// its bound of names (the rest as their machines' directories, once
    /// each), and one queued deletion is followed by every overflowed one.
    #[test]
    fn the_reaper_holds_a_bounded_queue_and_deletes_what_overflowed() {
        let tmp = tempfile::tempdir().unwrap();
        let reaper = Reaper::new(2);
        // Threads counted, none running yet: the deletions wait.
        reaper
            .threads
            .store(1, std::sync::atomic::Ordering::Relaxed);
        let mut machines = Vec::new();
        for m in 0..4 {
            let machine_dir: Arc<Path> = tmp.path().join(format!("machine-{m}")).into();
            std::fs::create_dir_all(machine_dir.join("keep")).unwrap();
            for u in 0..3 {
                let name = format!("unit-wordpress-{}{RECALLING}", m * 3 + u);
                std::fs::create_dir_all(machine_dir.join(&name).join("charm")).unwrap();
                reaper.delete(machine_dir.clone(), name.into());
            }
            machines.push(machine_dir);
        }
        assert!(
            reaper
                .queue
                .try_send((machines[0].clone(), "x".into()))
                .is_err(),
            "the queue holds its bound"
        );
        assert_eq!(
            reaper.overflow.lock().unwrap().len(),
            4,
            "each machine whose recalls did not all fit, once"
        );
        assert!(reaper.reap_one());
        assert!(reaper.overflow.lock().unwrap().is_empty());
        for machine_dir in &machines {
            let left: Vec<String> = std::fs::read_dir(machine_dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert_eq!(
                left,
                vec!["keep".to_string()],
                "every recalled unit's directory deleted"
            );
        }
        assert!(
            reaper.reap_one(),
            "the second name queued, already gone, is fine"
        );
    }

    fn record(unit_dir: &Path) -> Record {
        serde_json::from_slice(&std::fs::read(unit_dir.join(RECORD)).unwrap()).unwrap()
    }

    fn lay(unit_dir: &Path, files: &[&str]) -> Vec<String> {
        for f in files {
            let path = unit_dir.join("charm").join(f);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, f).unwrap();
        }
        files.iter().map(|f| f.to_string()).collect()
    }

    /// A unit's record as a deploy first writes it.
    fn fresh(unit_dir: &Path) -> Record {
        let r = Record {
            unit: "wordpress/0".into(),
            deployer: Tag::Machine(1),
            charm_url: "local:jammy/wordpress-1".into(),
            charm_files: Vec::new(),
        };
        std::fs::write(unit_dir.join(RECORD), serde_json::to_vec(&r).unwrap()).unwrap();
        r
    }

    /// A charm on this machine is listed before anything is laid (what
    /// the record lists, written once before the files), then laid whole:
    /// its directories, empty ones too, and its files with their modes.
    #[test]
    fn a_local_charm_is_listed_then_laid_with_its_directories_and_modes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        for d in ["hooks", "templates/empty"] {
            std::fs::create_dir_all(src.join(d)).unwrap();
        }
        std::fs::write(src.join("metadata.yaml"), "name: x\n").unwrap();
        std::fs::write(src.join("hooks/install"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            src.join("hooks/install"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        let files = CharmFiles::listed(&src).unwrap();
        let mut paths = files.paths();
        paths.sort();
        assert_eq!(paths, ["hooks/install", "metadata.yaml"]);
        let to = dir.path().join("unit/charm");
        std::fs::create_dir(dir.path().join("unit")).unwrap();
        files.lay(&to).unwrap();
        assert_eq!(
            std::fs::read_to_string(to.join("metadata.yaml")).unwrap(),
            "name: x\n"
        );
        let mode = std::fs::metadata(to.join("hooks/install"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert!(to.join("templates/empty").is_dir());
        // Laid again over itself (an upgrade to the same files): fine.
        files.lay(&to).unwrap();
    }

    /// An upgrade removes what the old revision had and the new one lacks
    /// (with the directories it leaves empty), and keeps what the charm
    /// wrote itself.
    #[test]
    fn the_record_lists_what_was_laid_and_an_upgrade_removes_what_was_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let unit_dir = dir.path();
        let mut r = fresh(unit_dir);
        let laid = lay(
            unit_dir,
            &["metadata.yaml", "hooks/install", "hooks/old/stop"],
        );
        r.charm_files = laid.clone();
        std::fs::write(unit_dir.join(RECORD), serde_json::to_vec(&r).unwrap()).unwrap();

        std::fs::write(unit_dir.join("charm/written"), "by a hook").unwrap();
        let laid = lay(
            unit_dir,
            &["metadata.yaml", "hooks/install", "hooks/upgrade-charm"],
        );
        record_laid(unit_dir, laid.clone()).unwrap();
        let after = record(unit_dir);
        assert_eq!(after.charm_files, laid);
        assert_eq!((after.unit, after.charm_url), (r.unit, r.charm_url));
        assert!(!unit_dir.join("charm/hooks/old").exists());
        assert!(unit_dir.join("charm/hooks/install").is_file());
        assert!(unit_dir.join("charm/written").is_file());
    }

    /// A unit deployed by an earlier version listed its charm's files in
    /// `charm.manifest`: its next upgrade reads them there, and moves the
    /// list into the record.
    #[test]
    fn an_upgrade_reads_an_earlier_versions_manifest_and_moves_it_into_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let unit_dir = dir.path();
        fresh(unit_dir);
        lay(unit_dir, &["metadata.yaml", "hooks/dropped"]);
        std::fs::write(
            unit_dir.join(LEGACY_MANIFEST),
            "metadata.yaml\nhooks/dropped\n",
        )
        .unwrap();
        let laid = lay(unit_dir, &["metadata.yaml"]);
        record_laid(unit_dir, laid.clone()).unwrap();
        assert!(!unit_dir.join("charm/hooks").exists());
        assert!(!unit_dir.join(LEGACY_MANIFEST).exists());
        assert_eq!(record(unit_dir).charm_files, laid);
    }
}
