//! `jujube debug-log`: the units' logs (their hooks' output and
//! `juju-log`), each line prefixed with its unit, the last lines of each and
//! then, unless `--no-tail`, whatever they append, until interrupted.

use crate::home::Home;
use anyhow::Result;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

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

fn last_lines(text: &str, n: usize) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

pub fn run(
    home: &Home,
    env_name: &str,
    include: &[String],
    lines: usize,
    tail: bool,
    out: &mut impl Write,
) -> Result<()> {
    for u in include {
        jujube_core::names::parse_unit(u)?;
    }
    let dir = home.env_dir(env_name);
    let wanted = |unit: &str| include.is_empty() || include.iter().any(|i| i == unit);
    // How far each file has been shown.
    let mut shown: BTreeMap<String, u64> = BTreeMap::new();
    for (unit, path) in logs(&dir).into_iter().filter(|(u, _)| wanted(u)) {
        let text = std::fs::read(&path).unwrap_or_default();
        for l in last_lines(&String::from_utf8_lossy(&text), lines) {
            writeln!(out, "{unit}: {l}")?;
        }
        shown.insert(unit, text.len() as u64);
    }
    out.flush()?;
    if !tail {
        return Ok(());
    }
    loop {
        std::thread::sleep(Duration::from_millis(200));
        for (unit, path) in logs(&dir).into_iter().filter(|(u, _)| wanted(u)) {
            let from = shown.get(&unit).copied().unwrap_or(0);
            let Ok(mut f) = std::fs::File::open(&path) else {
                continue;
            };
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len <= from {
                continue;
            }
            let mut buf = Vec::new();
            f.seek(SeekFrom::Start(from))?;
            f.read_to_end(&mut buf)?;
            // Whole lines only; the rest next time.
            let end = buf.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
            for l in String::from_utf8_lossy(&buf[..end]).lines() {
                writeln!(out, "{unit}: {l}")?;
            }
            shown.insert(unit, from + end as u64);
        }
        out.flush()?;
    }
}
