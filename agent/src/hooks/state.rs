//! The unit agent's hook record (`hooks.json` in the unit's directory).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the unit agent knows of one relation it is in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelationState {
    /// `name` of the relation from this unit's side (`db`).
    pub name: String,
    /// Remote units it ran `-joined` for, with the settings (a digest) it
    /// last ran `-changed` with.
    pub joined: BTreeMap<String, String>,
    /// The remote application (the unit's own in a peer relation).
    #[serde(default)]
    pub app: String,
    /// The remote application's settings (a digest) it last ran
    /// `-changed` with; `None` before they were first set.
    #[serde(default)]
    pub app_settings: Option<String>,
    /// `relation-created` ran (Juju 2.8+: the first hook of a relation,
    /// before any `-joined`). A record from before this hook existed knew
    /// the relation already: it counts as run there.
    #[serde(default = "known_before")]
    pub created: bool,
}

fn known_before() -> bool {
    true
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookState {
    pub installed: bool,
    pub started: bool,
    pub stopped: bool,
    /// `remove` ran (Juju 2.8+: the last hook of a unit, after `stop`).
    #[serde(default)]
    pub removed: bool,
    /// Digest of the service settings the last `config-changed` saw.
    /// (`Box<str>`s here: every idle unit agent keeps this record.)
    pub config: Option<Box<str>>,
    pub relations: BTreeMap<i64, RelationState>,
    /// The hook under way; still set when the agent comes back, it failed.
    /// (Both boxed: each idle unit agent keeps this record, and these are
    /// rarely set.)
    pub running: Option<Box<HookRecord>>,
    /// A failed hook the unit waits on (`jujube resolved`).
    pub failed: Option<Box<HookRecord>>,
    /// The charm URL the charm directory holds, once upgraded (before the
    /// first upgrade: the one it was deployed with, in `agent.json`).
    #[serde(default)]
    pub charm: Option<Box<str>>,
    /// `leader-elected` ran since the unit last became its service's
    /// leader.
    #[serde(default)]
    pub leader: bool,
    /// 1 + the version of the leader settings the last
    /// `leader-settings-changed` saw (see `UnitView`), 0 before it first
    /// ran (a `u32`: every idle agent keeps this record).
    #[serde(default)]
    pub leader_settings: u32,
    /// How the record is kept on disk (see [`HookState::save`]); not part
    /// of the record.
    #[serde(skip)]
    journal: Journal,
}

/// `hooks.json` is the whole record as of one generation; `hooks.journal`
/// the saves since, one JSON line each: the record without its `joined`
/// maps (small), and what changed in those. A 1,000-unit peer relation's
/// `joined` map is tens of kilobytes, and the record is saved around every
/// hook: written whole each time, each unit wrote that map a few thousand
/// times over (quadratic in the relation's size). A save costs a line now,
/// and the whole record is written again every [`JOURNAL_MAX`] bytes of lines.
#[derive(Debug, Clone, Default)]
struct Journal {
    /// The generation `hooks.json` holds (0: no `hooks.json` yet, the lines
    /// being over the empty record; or one written whole by an earlier
    /// version); journal lines of another are stale (left by a
    /// crash between writing a new `hooks.json` and emptying the journal)
    /// and ignored. (`u32`s: every idle unit agent keeps this.)
    generation: u32,
    /// Bytes of the journal, as written; `u32::MAX` once it must not be
    /// appended to (see [`HookState::read`]).
    lines: u32,
    /// Changes to the `joined` maps since the last save, in order.
    /// (Boxed: empty between saves, and a pointer's width then.)
    #[allow(clippy::box_collection)] // for its width while empty
    pending: Option<Box<Vec<JoinedChange>>>,
}

impl PartialEq for Journal {
    /// Bookkeeping, not part of the record.
    fn eq(&self, _: &Journal) -> bool {
        true
    }
}

impl Eq for Journal {}

/// The journal's size at which the whole record is written again: saves
/// of a record of any size cost a line each, and a whole record every
/// this many bytes of lines.
const JOURNAL_MAX: u32 = 64 << 10;

/// `hooks.json`: the record and its generation. (A record written whole
/// by an earlier version, without one, is read as generation 0.)
#[derive(Serialize, Deserialize)]
struct Base<S> {
    state: S,
    generation: u32,
}

/// One line of `hooks.journal`.
#[derive(Serialize, Deserialize)]
struct Line<S> {
    #[serde(rename = "g")]
    generation: u32,
    /// The record without its `joined` maps.
    head: S,
    #[serde(default)]
    joined: Vec<JoinedChange>,
}

/// Relation, remote unit, its settings' digest (`None`: departed).
type JoinedChange = (i64, String, Option<String>);

/// Which hook, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookRecord {
    pub name: String,
    #[serde(default)]
    pub relation: Option<(i64, String)>,
    #[serde(default)]
    pub remote: Option<String>,
}

impl From<&super::runner::Hook> for HookRecord {
    fn from(h: &super::runner::Hook) -> HookRecord {
        HookRecord {
            name: h.name.clone(),
            relation: h.relation.clone(),
            remote: h.remote.clone(),
        }
    }
}

impl HookState {
    pub fn path(unit_dir: &Path) -> PathBuf {
        unit_dir.join("hooks.json")
    }

    fn journal_path(unit_dir: &Path) -> PathBuf {
        unit_dir.join("hooks.journal")
    }

    /// The record, or a fresh one. A hook that was running when the agent
    /// stopped (killed, crashed) is a failed hook now, and whatever of it
    /// still runs is killed first: the next hook must not run beside it.
    /// A record that exists but cannot be read (out of file descriptors, an
    /// I/O error) is an error naming its file, never a fresh record, which
    /// would run `install` again.
    pub fn load(unit_dir: &Path) -> Result<HookState, (PathBuf, std::io::Error)> {
        let mut s = Self::read(unit_dir)?;
        if let Some(h) = s.running.take() {
            let killed = super::runner::kill_leftovers(unit_dir);
            if killed > 0 {
                tracing::info!(hook = %h.name, dir = %unit_dir.display(), killed, "killed what was left of a hook whose agent died");
            }
            s.failed.get_or_insert(h);
        }
        Ok(s)
    }

    /// Whether the last save failed (or what was read must be written
    /// again whole): what is held here is ahead of the files.
    pub fn unsaved(&self) -> bool {
        self.journal.lines == u32::MAX
    }

    /// The record as saved, `hooks.json` with the journal's lines of its
    /// generation replayed (a line cut short, a crash while it was
    /// written, ends the replay); unlike [`HookState::load`], a hook
    /// recorded running stays so and nothing is killed.
    pub fn read(unit_dir: &Path) -> Result<HookState, (PathBuf, std::io::Error)> {
        // A file that is not there is an empty one.
        let read = |path: PathBuf| match std::fs::read(&path) {
            Ok(bytes) => Ok(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err((path, e)),
        };
        let bytes = read(Self::path(unit_dir))?;
        // No `hooks.json` yet: a new unit's saves are lines of generation
        // 0 over the empty record (see [`HookState::save`]).
        let base = match serde_json::from_slice::<Base<HookState>>(&bytes) {
            _ if bytes.is_empty() => Base {
                state: HookState::default(),
                generation: 0,
            },
            Ok(base) => base,
            Err(_) => match serde_json::from_slice::<HookState>(&bytes) {
                Ok(state) => Base {
                    state,
                    generation: 0,
                },
                Err(_) => {
                    // Lines appended to a record that does not parse
                    // would never be read: the next save writes it whole.
                    let mut s = HookState::default();
                    s.journal.lines = u32::MAX;
                    return Ok(s);
                }
            },
        };
        let mut s = base.state;
        let mut journal = Journal {
            generation: base.generation,
            ..Journal::default()
        };
        let lines = read(Self::journal_path(unit_dir))?;
        let mut whole = true;
        for line in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let line = match serde_json::from_slice::<Line<HookState>>(line) {
                Ok(line) if line.generation == journal.generation => line,
                _ => {
                    whole = false;
                    break;
                }
            };
            let mut next = line.head;
            for (id, rel) in next.relations.iter_mut() {
                if let Some(old) = s.relations.get_mut(id) {
                    rel.joined = std::mem::take(&mut old.joined);
                }
            }
            for (id, unit, digest) in line.joined {
                if let Some(rel) = next.relations.get_mut(&id) {
                    match digest {
                        Some(d) => rel.joined.insert(unit, d),
                        None => rel.joined.remove(&unit),
                    };
                }
            }
            s = next;
        }
        journal.lines = u32::try_from(lines.len()).unwrap_or(u32::MAX);
        if !whole {
            // Lines appended after a stale or torn one would never be
            // read: the next save starts a new generation.
            journal.lines = u32::MAX;
        }
        s.journal = journal;
        Ok(s)
    }

    /// Records that `unit`'s `-joined` ran in relation `rel` (with
    /// `digest`, the settings its last `-changed` saw; empty before).
    pub fn join(&mut self, rel: i64, unit: &str, digest: String) {
        self.note(rel, unit, Some(digest.clone()));
        self.relations
            .entry(rel)
            .or_default()
            .joined
            .insert(unit.to_string(), digest);
    }

    /// Records that `unit` departed relation `rel`.
    pub fn depart(&mut self, rel: i64, unit: &str) {
        if let Some(r) = self.relations.get_mut(&rel) {
            if r.joined.remove(unit).is_some() {
                self.note(rel, unit, None);
            }
        }
    }

    fn note(&mut self, rel: i64, unit: &str, digest: Option<String>) {
        self.journal
            .pending
            .get_or_insert_with(Default::default)
            .push((rel, unit.to_string(), digest));
    }

    /// Saves the record: a line on the journal, or, once the journal holds
    /// [`JOURNAL_MAX`] bytes (or a line may be lost), the whole record as a
    /// new generation (a temporary file renamed into place; the journal
    /// emptied after). A new unit's first saves are lines over the empty
    /// record (generation 0, no `hooks.json`): its first pass creates one
    /// file, not two — a deploy of 100,000 units is bound by creating inodes.
    /// A failure names the file it was about.
    pub fn save(&mut self, unit_dir: &Path) -> Result<(), (PathBuf, std::io::Error)> {
        use std::io::Write;
        let at = |p: &Path| {
            let p = p.to_path_buf();
            move |e| (p, e)
        };
        let mut journal = std::mem::take(&mut self.journal);
        let r = (|| {
            if journal.lines < JOURNAL_MAX {
                // The head without the `joined` maps, put back after.
                let taken: Vec<(i64, BTreeMap<String, String>)> = self
                    .relations
                    .iter_mut()
                    .map(|(id, r)| (*id, std::mem::take(&mut r.joined)))
                    .collect();
                let line = serde_json::to_vec(&Line {
                    generation: journal.generation,
                    head: &*self,
                    joined: journal.pending.take().map(|p| *p).unwrap_or_default(),
                });
                for (id, joined) in taken {
                    if let Some(r) = self.relations.get_mut(&id) {
                        r.joined = joined;
                    }
                }
                let mut line = line.expect("plain data");
                line.push(b'\n');
                let journal_path = Self::journal_path(unit_dir);
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&journal_path)
                    .and_then(|mut f| f.write_all(&line))
                    .map_err(at(&journal_path))?;
                journal.lines = journal.lines.saturating_add(line.len() as u32);
                return Ok(());
            }
            let path = Self::path(unit_dir);
            let tmp = path.with_extension("tmp");
            let generation = journal.generation.wrapping_add(1);
            let generation = generation.max(1);
            let bytes = serde_json::to_vec(&Base {
                state: &*self,
                generation,
            })
            .expect("plain data");
            std::fs::write(&tmp, &bytes).map_err(at(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(at(&path))?;
            // Lines of the old generation are ignored from here on.
            let journal_path = Self::journal_path(unit_dir);
            match std::fs::remove_file(&journal_path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(at(&journal_path)(e))
                }
                _ => {}
            }
            journal = Journal {
                // Never 0, which means "no generation yet".
                generation: generation.max(1),
                lines: 0,
                pending: None,
            };
            Ok(())
        })();
        if r.is_err() {
            // What this save held may be lost, or half a line written:
            // the next save writes the whole record as a new generation.
            journal.lines = u32::MAX;
        }
        self.journal = journal;
        r
    }
}

/// A stable digest of settings, to tell whether they changed.
pub fn digest<T: Serialize>(v: &T) -> String {
    use sha2::Digest;
    let bytes = serde_json::to_vec(v).expect("plain data");
    sha2::Sha256::digest(&bytes)
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(i: usize) -> String {
        format!("peer/{i}")
    }

    /// An agent reads its record at each pass: one that is there but
    /// cannot be read is an error naming it, not an empty record (with
    /// which the unit would run `install` again); one not there is empty.
    #[test]
    fn a_record_that_cannot_be_read_is_an_error_not_a_fresh_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(HookState::load(dir.path()).unwrap(), HookState::default());
        let mut s = HookState {
            installed: true,
            ..Default::default()
        };
        s.save(dir.path()).unwrap();
        assert!(HookState::load(dir.path()).unwrap().installed);
        for file in [
            HookState::journal_path(dir.path()),
            HookState::path(dir.path()),
        ] {
            let _ = std::fs::remove_file(&file);
            std::fs::create_dir(&file).unwrap();
            let (path, _) = HookState::load(dir.path()).unwrap_err();
            assert_eq!(path, file);
            std::fs::remove_dir(&file).unwrap();
        }
    }

    /// A new unit's saves (`install`, `config-changed`, `start` and the
    /// rest of its first pass) are lines of a journal over the empty
    /// record: one file created, not two, of the handful of inodes a unit's
    /// deploy costs. `hooks.json` comes with the journal's first rewrite.
    #[test]
    fn a_new_record_is_a_journal_until_its_first_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = HookState::default();
        for hook in ["install", "config-changed", "start"] {
            s.running = Some(Box::new(HookRecord {
                name: hook.into(),
                relation: None,
                remote: None,
            }));
            s.save(dir.path()).unwrap();
            s.running = None;
            s.installed = true;
            s.started = hook == "start";
            s.save(dir.path()).unwrap();
            assert_eq!(HookState::read(dir.path()).unwrap(), s, "after {hook}");
        }
        assert!(!HookState::path(dir.path()).exists());
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(files, 1, "the journal alone");
        let mut i = 0;
        while !HookState::path(dir.path()).exists() {
            s.join(1, &unit(i), format!("{i:064x}"));
            s.save(dir.path()).unwrap();
            i += 1;
        }
        assert_eq!(HookState::read(dir.path()).unwrap(), s);
        assert!(i > 10, "rewritten after {i} saves");
    }

    /// A record written whole by an earlier version (no generation) takes
    /// lines too, and a `hooks.json` that does not parse is never
    /// appended to: it is written again whole at the next save.
    #[test]
    fn old_and_unparseable_records_are_read_then_kept() {
        let dir = tempfile::tempdir().unwrap();
        let old = HookState {
            installed: true,
            ..HookState::default()
        };
        std::fs::write(
            HookState::path(dir.path()),
            serde_json::to_vec(&old).unwrap(),
        )
        .unwrap();
        let mut s = HookState::read(dir.path()).unwrap();
        assert_eq!(s, old);
        s.started = true;
        s.save(dir.path()).unwrap();
        assert_eq!(HookState::read(dir.path()).unwrap(), s);

        std::fs::write(HookState::path(dir.path()), b"{not json").unwrap();
        let mut s = HookState::read(dir.path()).unwrap();
        assert_eq!(s, HookState::default());
        s.installed = true;
        s.save(dir.path()).unwrap();
        assert_eq!(HookState::read(dir.path()).unwrap(), s);
    }

    /// A 2,000-unit peer relation joined one unit at a time, a save after
    /// each `-joined` and `-changed` as the agent makes them: read back
    /// the same at every step, across generations; and what the saves
    /// write grows with what changed, not with the record (written whole
    /// each time, about 2,000 times the whole record).
    #[test]
    fn saves_write_what_changed_and_read_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = HookState {
            installed: true,
            ..HookState::default()
        };
        s.relations.insert(
            7,
            RelationState {
                name: "peer".into(),
                ..RelationState::default()
            },
        );
        let (mut written, mut generations) = (0u64, 0u64);
        let mut save = |s: &mut HookState| {
            let before = (s.journal.generation, s.journal.lines);
            s.save(dir.path()).unwrap();
            let j = &s.journal;
            written += u64::from(match before {
                (g, lines) if g == j.generation => j.lines - lines,
                _ => {
                    generations += 1;
                    std::fs::metadata(HookState::path(dir.path()))
                        .unwrap()
                        .len() as u32
                }
            });
        };
        for i in 0..2000 {
            s.join(7, &unit(i), String::new());
            save(&mut s);
            s.join(7, &unit(i), format!("{i:024x}"));
            if i % 3 == 0 {
                s.depart(7, &unit(i / 2));
            }
            save(&mut s);
            if i % 97 == 0 {
                assert_eq!(HookState::load(dir.path()).unwrap(), s, "after unit {i}");
            }
        }
        assert_eq!(HookState::load(dir.path()).unwrap(), s);
        assert!(s.relations[&7].joined.len() > 1000);
        let whole = std::fs::metadata(HookState::path(dir.path()))
            .unwrap()
            .len();
        assert!(
            written < 100 * whole,
            "4,000 saves wrote {written} bytes, {generations} whole records of up to {whole}"
        );
    }

    #[test]
    fn head_fields_and_relations_come_back_from_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = HookState::default();
        s.join(1, "a/0", "d0".into());
        s.join(2, "b/0", "d1".into());
        s.save(dir.path()).unwrap();
        s.started = true;
        s.config = Some("c".into());
        s.relations.get_mut(&1).unwrap().app_settings = Some("x".into());
        s.relations.remove(&2);
        s.join(3, "c/0", String::new());
        s.failed = Some(Box::new(HookRecord {
            name: "start".into(),
            relation: None,
            remote: None,
        }));
        s.save(dir.path()).unwrap();
        assert!(std::fs::metadata(HookState::journal_path(dir.path())).is_ok());
        assert_eq!(HookState::load(dir.path()).unwrap(), s);
    }

    /// A crash between writing a new `hooks.json` and emptying the journal
    /// leaves lines of the old generation: they are not replayed over the
    /// newer record. A line cut short ends the replay.
    #[test]
    fn stale_and_torn_journal_lines_are_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = HookState::default();
        s.join(1, "a/0", String::new());
        s.save(dir.path()).unwrap();
        s.join(1, "a/1", String::new());
        s.save(dir.path()).unwrap();
        let stale = std::fs::read(HookState::journal_path(dir.path())).unwrap();
        // A new generation, the old journal put back as a crash leaves it.
        s.depart(1, "a/1");
        s.depart(1, "a/0");
        s.journal.lines = u32::MAX;
        s.save(dir.path()).unwrap();
        std::fs::write(HookState::journal_path(dir.path()), &stale).unwrap();
        assert_eq!(HookState::load(dir.path()).unwrap(), s);
        assert!(HookState::load(dir.path()).unwrap().relations[&1]
            .joined
            .is_empty());

        // A line, then half of the next.
        let mut s = HookState::load(dir.path()).unwrap();
        s.join(1, "a/2", String::new());
        s.save(dir.path()).unwrap();
        let whole = s.clone();
        s.join(1, "a/3", String::new());
        s.save(dir.path()).unwrap();
        let path = HookState::journal_path(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 20]).unwrap();
        assert_eq!(HookState::load(dir.path()).unwrap(), whole);
    }
}
