//! The log sink: what unit agents ship of their logs (hooks' output,
//! `juju-log`, commands), kept by the controller so that `debug-log` reads
//! it from anywhere, wherever the agents run.
//!
//! Bounded on disk: one file, `agents.log`, each line prefixed with its
//! unit; past [`MAX_FILE_BYTES`] it is renamed to `agents.log.1` (replacing
//! the one before) and a new one begun, so the sink never holds more than
//! twice that. A reader's place is a cursor counting bytes since the sink
//! began (`agents.log.base` keeps how many the rotated-away files held), so
//! a follower survives a rotation and learns when what it had not read yet
//! was rotated away.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The most one file of the sink holds before it is rotated.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// The most one read answers.
pub const MAX_READ_BYTES: usize = 256 << 10;

const FILE: &str = "agents.log";
const OLD: &str = "agents.log.1";
const BASE: &str = "agents.log.base";

pub struct LogSink {
    dir: PathBuf,
    max_file: u64,
    state: Mutex<()>,
}

/// What a read found: lines (each `UNIT: text`) and where to read next.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogRead {
    pub lines: Vec<String>,
    pub cursor: u64,
    /// Bytes rotated away before they were read.
    pub missed: u64,
}

impl LogSink {
    /// The sink in `dir` (made if missing).
    pub fn open(dir: &Path) -> std::io::Result<LogSink> {
        LogSink::with_max(dir, MAX_FILE_BYTES)
    }

    pub fn with_max(dir: &Path, max_file: u64) -> std::io::Result<LogSink> {
        std::fs::create_dir_all(dir)?;
        Ok(LogSink {
            dir: dir.to_path_buf(),
            max_file,
            state: Mutex::new(()),
        })
    }

    fn base(&self) -> u64 {
        std::fs::read_to_string(self.dir.join(BASE))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn len(&self, name: &str) -> u64 {
        std::fs::metadata(self.dir.join(name))
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Appends `text` as `unit`'s, a line each (a last line without its
    /// newline gets one).
    pub fn append(&self, unit: &str, text: &str) -> std::io::Result<()> {
        let mut out = String::with_capacity(text.len() + 64);
        for line in text.lines() {
            out.push_str(unit);
            out.push_str(": ");
            out.push_str(line);
            out.push('\n');
        }
        if out.is_empty() {
            return Ok(());
        }
        let _held = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.len(FILE);
        if current > 0 && current + out.len() as u64 > self.max_file {
            // Rotation: the current file becomes the old one, then the base
            // moves on by what the replaced old file held. A crash between
            // the two steps at worst makes readers skip, never repeat.
            let old = self.len(OLD);
            let base = self.base() + old;
            std::fs::rename(self.dir.join(FILE), self.dir.join(OLD))?;
            let tmp = self.dir.join(format!("{BASE}.tmp"));
            std::fs::write(&tmp, base.to_string())?;
            std::fs::rename(&tmp, self.dir.join(BASE))?;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(FILE))?
            .write_all(out.as_bytes())
    }

    /// Lines after `cursor` (`None`: the last `last` lines), at most
    /// [`MAX_READ_BYTES`] of them, kept only where `keep` says so.
    pub fn read(
        &self,
        cursor: Option<u64>,
        last: usize,
        keep: &dyn Fn(&str) -> bool,
    ) -> std::io::Result<LogRead> {
        let _held = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (base, old, current) = (self.base(), self.len(OLD), self.len(FILE));
        // The sink as one stream: [base, base + old) in the old file, then
        // [base + old, end) in the current one.
        let start = base;
        let end = base + old + current;
        let (from, missed) = match cursor {
            Some(c) if c >= start => (c.min(end), 0),
            Some(c) => (start, start - c),
            // The tail: enough bytes for `last` lines, within the bound.
            None => (end.saturating_sub(MAX_READ_BYTES as u64).max(start), 0),
        };
        let upto = (from + MAX_READ_BYTES as u64).min(end);
        let mut bytes = Vec::new();
        for (name, lo, hi) in [(OLD, start, start + old), (FILE, start + old, end)] {
            let (a, b) = (from.max(lo), upto.min(hi));
            if a < b {
                let mut f = std::fs::File::open(self.dir.join(name))?;
                f.seek(SeekFrom::Start(a - lo))?;
                let mut part = Vec::new();
                f.take(b - a).read_to_end(&mut part)?;
                bytes.extend(part);
            }
        }
        // Whole lines only: a cut line is read next time; a tail that began
        // inside a line drops that line's end.
        let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let first = if cursor.is_none() && from > start {
            bytes[..whole]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(whole, |i| i + 1)
        } else {
            0
        };
        let text = String::from_utf8_lossy(&bytes[first..whole]);
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| keep(l))
            .map(str::to_string)
            .collect();
        if cursor.is_none() && lines.len() > last {
            lines.drain(..lines.len() - last);
        }
        let cursor = if cursor.is_none() {
            end
        } else {
            from + whole as u64
        };
        Ok(LogRead {
            lines,
            cursor,
            missed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_prefixed_read_after_a_cursor_and_survive_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let sink = LogSink::with_max(dir.path(), 100).unwrap();
        sink.append("a/0", "one\ntwo").unwrap();
        let all = |_: &str| true;
        let r = sink.read(None, 10, &all).unwrap();
        assert_eq!(r.lines, ["a/0: one", "a/0: two"]);
        let c = r.cursor;
        for n in 0..20 {
            sink.append("b/1", &format!("line {n}\n")).unwrap();
        }
        // Bounded on disk: two files of at most 100 bytes.
        assert!(sink.len(FILE) <= 100 && sink.len(OLD) <= 100);
        // The follower was too slow: what was rotated away is counted.
        let r = sink.read(Some(c), 10, &all).unwrap();
        assert!(r.missed > 0);
        assert_eq!(r.lines.last().unwrap(), "b/1: line 19");
        let again = sink.read(Some(r.cursor), 10, &all).unwrap();
        assert!(again.lines.is_empty());
        assert_eq!(again.missed, 0);
        sink.append("a/0", "three\n").unwrap();
        let r = sink
            .read(Some(again.cursor), 10, &|l: &str| l.starts_with("a/0: "))
            .unwrap();
        assert_eq!(r.lines, ["a/0: three"]);
        // The tail: the last N lines.
        let r = sink.read(None, 2, &all).unwrap();
        assert_eq!(r.lines, ["b/1: line 19", "a/0: three"]);
    }
}
