//! `jujube debug-log`: the units' logs (their hooks' output and
//! `juju-log`), each line prefixed with its unit, the last lines of each and
//! then, unless `--no-tail`, whatever they append, until interrupted.

use anyhow::Result;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the agents' logs are.
pub enum Source {
    /// Under the environment's `agents/` (agents run by the controller).
    Local(PathBuf),
    /// Inside the environment's LXD containers, read through LXD's file
    /// API (agents running in their containers).
    Lxd(Box<jujube_providers::lxd::LxdProvider>),
}

impl Source {
    /// Every log: its prefix (a unit's name, or `machine-N` for a machine
    /// agent's own log) → its bytes after the offset `shown` has for it (a
    /// local file is read from there; a container's is fetched whole).
    async fn read(&self, shown: &BTreeMap<String, usize>) -> Result<BTreeMap<String, Vec<u8>>> {
        let from = |prefix: &str| shown.get(prefix).copied().unwrap_or(0);
        let mut out = BTreeMap::new();
        match self {
            Source::Local(env_dir) => {
                for (unit, path) in logs(env_dir) {
                    let mut bytes = Vec::new();
                    if let Ok(mut f) = std::fs::File::open(&path) {
                        let _ = f
                            .seek(SeekFrom::Start(from(&unit) as u64))
                            .and_then(|_| f.read_to_end(&mut bytes));
                    }
                    out.insert(unit, bytes);
                }
            }
            Source::Lxd(p) => {
                for (tag, bytes) in p.agent_logs().await? {
                    let prefix = match tag.parse::<jujube_agent::api::Tag>() {
                        Ok(jujube_agent::api::Tag::Unit(u)) => u,
                        _ => tag,
                    };
                    let new = bytes.get(from(&prefix)..).unwrap_or_default().to_vec();
                    out.insert(prefix, new);
                }
            }
        }
        Ok(out)
    }
}

/// Every unit log of the environment: unit name → file.
fn logs(env_dir: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(machines) = env_dir.join("agents").read_dir() else {
        return out;
    };
    for m in machines.flatten() {
        let Ok(files) = m.path().join("logs").read_dir() else {
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            let Some(tag) = name.strip_suffix(".log") else {
                continue;
            };
            if let Ok(jujube_agent::api::Tag::Unit(unit)) = tag.parse() {
                out.insert(unit, f.path());
            }
        }
    }
    out
}

/// A log line as `debug-log` shows it: a line the agent stamped with
/// `YYYY-MM-DD HH:MM:SS` (UTC) shows only the time of day, as Juju's
/// `debug-log` does; anything else (a hook's own output) as it is.
fn as_shown(line: &str) -> &str {
    let b = line.as_bytes();
    let stamped = b.len() > 20
        && b[..10].iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        })
        && b[10] == b' '
        && b[13] == b':'
        && b[16] == b':'
        && b[19] == b' ';
    if stamped {
        &line[11..]
    } else {
        line
    }
}

fn last_lines(text: &str, n: usize) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

pub async fn run(
    source: Source,
    include: &[String],
    lines: usize,
    tail: bool,
    out: &mut impl Write,
) -> Result<()> {
    for u in include {
        jujube_core::names::parse_unit(u)?;
    }
    let wanted = |unit: &str| include.is_empty() || include.iter().any(|i| i == unit);
    // How far each log has been shown.
    let mut shown: BTreeMap<String, usize> = BTreeMap::new();
    for (unit, text) in source
        .read(&shown)
        .await?
        .into_iter()
        .filter(|(u, _)| wanted(u))
    {
        for l in last_lines(&String::from_utf8_lossy(&text), lines) {
            writeln!(out, "{unit}: {}", as_shown(l))?;
        }
        shown.insert(unit, text.len());
    }
    out.flush()?;
    if !tail {
        return Ok(());
    }
    loop {
        tokio::time::sleep(match source {
            Source::Local(_) => Duration::from_millis(200),
            Source::Lxd(_) => Duration::from_secs(1),
        })
        .await;
        for (unit, buf) in source
            .read(&shown)
            .await?
            .into_iter()
            .filter(|(u, _)| wanted(u))
        {
            let from = shown.get(&unit).copied().unwrap_or(0);
            // Whole lines only; the rest next time.
            let end = buf.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
            for l in String::from_utf8_lossy(&buf[..end]).lines() {
                writeln!(out, "{unit}: {}", as_shown(l))?;
            }
            shown.insert(unit, from + end);
        }
        out.flush()?;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn stamped_lines_show_the_time_of_day_and_others_are_untouched() {
        assert_eq!(
            super::as_shown("2026-11-25 07:14:42 INFO unit.a/0.juju-log: hi"),
            "07:14:42 INFO unit.a/0.juju-log: hi"
        );
        for plain in [
            "hook output",
            "2026-11-25 not a time",
            "1795590882.123 INFO a/0: x",
            "",
        ] {
            assert_eq!(super::as_shown(plain), plain);
        }
    }
}
