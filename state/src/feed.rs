//! The change feed.
//!
//! Every change a transaction makes to the model is recorded as a row in the
//! `changes` table, whose revision is assigned by SQLite's single writer and
//! therefore committed in order: a reader that has seen revision N has seen
//! everything before it. Readers in any process ask for
//! [`Store::changes_since`]; readers in this process use a [`Watcher`], which
//! is woken by the committing transaction itself and only polls (cheaply, on
//! the primary key) to notice commits made by other processes.
//!
//! The feed is pruned by the cleaner ([`Store::prune_changes`]); a reader
//! that falls behind the pruned floor is told so (`Changes::truncated`) and
//! must re-read the state it cares about.

use crate::db::Store;
use crate::sql::OptionalExtension;
use crate::Result;
use std::time::Duration;
use tokio::sync::watch;

/// What kind of entity a change touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    Environment,
    Machine,
    Service,
    Unit,
    Relation,
    /// A unit entered or left a relation scope; the id is `RELATION#UNIT`.
    Scope,
    /// Relation unit settings; the id is `RELATION#UNIT`.
    Settings,
    Cleanup,
    /// A `jujube run` request queued or answered; the id is the unit's name.
    Run,
    /// The unit became, or stopped being, its service's leader; the id is
    /// the unit's name.
    Leader,
    /// The controllers' API addresses changed (a controller came up, or
    /// came up elsewhere); the id is empty.
    Controllers,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Environment => "environment",
            ChangeKind::Machine => "machine",
            ChangeKind::Service => "service",
            ChangeKind::Unit => "unit",
            ChangeKind::Relation => "relation",
            ChangeKind::Scope => "scope",
            ChangeKind::Settings => "settings",
            ChangeKind::Cleanup => "cleanup",
            ChangeKind::Run => "run",
            ChangeKind::Leader => "leader",
            ChangeKind::Controllers => "controllers",
        }
    }

    pub fn parse(s: &str) -> Option<ChangeKind> {
        use ChangeKind::*;
        [
            Environment,
            Machine,
            Service,
            Unit,
            Relation,
            Scope,
            Settings,
            Cleanup,
            Run,
            Leader,
            Controllers,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub revision: u64,
    pub kind: ChangeKind,
    pub id: String,
}

/// A batch read from the feed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub changes: Vec<Change>,
    /// The revision to ask from next time.
    pub revision: u64,
    /// True when changes after the requested revision were pruned before
    /// they could be read: re-read the state instead of trusting the batch.
    pub truncated: bool,
}

const FLOOR: &str = "changes-floor";

/// The revision below which changes were pruned (0: none ever were).
fn floor(c: &crate::sql::Connection) -> Result<i64> {
    Ok(
        c.query_row("SELECT next FROM sequences WHERE name = ?1", [FLOOR], |r| {
            r.get(0)
        })
        .optional()?
        .unwrap_or(0),
    )
}

impl Store {
    /// The revision of the newest committed change.
    pub fn head_revision(&self) -> Result<u64> {
        self.read(|c| {
            Ok(
                c.query_row("SELECT coalesce(max(revision), 0) FROM changes", [], |r| {
                    r.get::<_, i64>(0)
                })? as u64,
            )
        })
    }

    /// Where a watch resumed from `since` (0: a new one) starts, read in
    /// one snapshot: the head revision, and whether changes after `since`
    /// were made (`Some(false)`) or pruned before they could be read
    /// (`Some(true)`: the watcher must re-read everything).
    pub fn resume_point(&self, since: u64) -> Result<(u64, Option<bool>)> {
        self.read(|c| {
            let head = c.query_row("SELECT coalesce(max(revision), 0) FROM changes", [], |r| {
                r.get::<_, i64>(0)
            })? as u64;
            if since == 0 {
                return Ok((head, None));
            }
            let floor = floor(c)?;
            if (since as i64) < floor {
                return Ok((head, Some(true)));
            }
            Ok((head, (head > since).then_some(false)))
        })
    }

    /// Up to `limit` changes with revisions greater than `since`.
    pub fn changes_since(&self, since: u64, limit: usize) -> Result<Changes> {
        self.read(|c| {
            let floor = floor(c)?;
            let mut stmt = c.prepare_cached(
                "SELECT revision, kind, id FROM changes WHERE revision > ?1 ORDER BY revision LIMIT ?2",
            )?;
            let changes = stmt
                .query_map((since as i64, i64::try_from(limit).unwrap_or(i64::MAX)), |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get(2)?))
                })?
                .map(|row| {
                    let (revision, kind, id) = row?;
                    let kind = ChangeKind::parse(&kind).ok_or(crate::Error::Corrupt {
                        what: "change kind",
                        value: kind,
                    })?;
                    Ok(Change {
                        revision: revision as u64,
                        kind,
                        id,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let revision = changes
                .last()
                .map_or(since.max(floor as u64), |c| c.revision);
            Ok(Changes {
                changes,
                revision,
                truncated: (since as i64) < floor,
            })
        })
    }

    /// Deletes up to `batch - 1` of the oldest changes, keeping the newest
    /// `keep`, and raises the floor: at most `batch` rows in all, in one
    /// transaction. Returns how many were deleted.
    pub fn prune_changes(&self, keep: u64, batch: usize) -> Result<usize> {
        self.write(|tx| {
            let head: i64 =
                tx.query_row("SELECT coalesce(max(revision), 0) FROM changes", [], |r| {
                    r.get(0)
                })?;
            // The newest change always stays: a revision is the largest one
            // plus one, so an emptied feed would count from 1 again.
            let cut = head - keep.max(1) as i64;
            if cut <= 0 {
                return Ok(0);
            }
            let upto: Option<i64> = tx
                .query_row(
                    "SELECT max(revision) FROM (SELECT revision FROM changes WHERE revision <= ?1
                     ORDER BY revision LIMIT ?2) AS t",
                    // One row of the batch is the floor's.
                    (cut, batch.saturating_sub(1).max(1) as i64),
                    |r| r.get(0),
                )
                .optional()?
                .flatten();
            let Some(upto) = upto else { return Ok(0) };
            let n = tx.execute("DELETE FROM changes WHERE revision <= ?1", [upto])?;
            tx.execute(
                "INSERT INTO sequences (name, next) VALUES (?1, ?2)
                 ON CONFLICT (name) DO UPDATE SET next = excluded.next WHERE excluded.next > sequences.next",
                (FLOOR, upto),
            )?;
            Ok(n)
        })
    }

    /// Whether a change of `kind` was committed after revision `since` up
    /// to `upto`, counting changes pruned before they could be read as one
    /// (the caller cannot know what they were). Read in SQL, not as rows:
    /// 100,000 changes cost the scan of their range.
    pub fn changed_between(&self, kind: ChangeKind, since: u64, upto: u64) -> Result<bool> {
        self.read(|c| {
            let floor = floor(c)?;
            if (since as i64) < floor {
                return Ok(true);
            }
            Ok(c.prepare_cached(
                "SELECT 1 FROM changes WHERE revision > ?1 AND revision <= ?2 AND kind = ?3 LIMIT 1",
            )?
            .query_row((since as i64, upto as i64, kind.as_str()), |_| Ok(()))
            .optional()?
            .is_some())
        })
    }

    /// A watcher that reports changes after `since`.
    pub fn watch(&self, since: u64) -> Watcher {
        Watcher {
            store: self.clone(),
            local: self.head_receiver(),
            since,
            poll: Duration::from_millis(250),
            limit: 10_000,
        }
    }
}

/// Waits for changes. In-process commits wake it at once; commits by other
/// processes are noticed within the poll interval.
pub struct Watcher {
    store: Store,
    local: watch::Receiver<u64>,
    since: u64,
    poll: Duration,
    limit: usize,
}

impl Watcher {
    /// How often to look for commits made by other processes.
    pub fn with_poll_interval(mut self, poll: Duration) -> Watcher {
        self.poll = poll;
        self
    }

    pub fn revision(&self) -> u64 {
        self.since
    }

    /// Waits for a commit after the last revision seen, and takes the
    /// head: the range of revisions since, `(since, head]`, without
    /// reading them (for watchers that only need to wake, or ask the
    /// store about the range: see [`Store::changed_between`]).
    pub async fn next_head(&mut self) -> Result<(u64, u64)> {
        loop {
            self.local.mark_unchanged();
            let head = self.store.head_revision()?;
            if head > self.since {
                let since = std::mem::replace(&mut self.since, head);
                return Ok((since, head));
            }
            tokio::select! {
                _ = self.local.changed() => {}
                _ = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    /// The next non-empty batch of changes (or a truncation notice).
    pub async fn next(&mut self) -> Result<Changes> {
        loop {
            self.local.mark_unchanged();
            let batch = self.store.changes_since(self.since, self.limit)?;
            if !batch.changes.is_empty() || batch.truncated {
                self.since = batch.revision;
                return Ok(batch);
            }
            tokio::select! {
                _ = self.local.changed() => {}
                _ = tokio::time::sleep(self.poll) => {}
            }
        }
    }
}
