//! `jujube debug-log`: the units' logs (their hooks' output, `juju-log`,
//! commands), as their agents shipped them to the controller's log sink,
//! each line prefixed with its unit: the last lines and then, unless
//! `--no-tail`, whatever arrives, until interrupted. It reads the same
//! wherever the agents run.

use crate::client::Client;
use anyhow::Result;
use jujube_wire::client::{ClientCall, LogLines};
use std::io::Write;
use std::time::Duration;

/// How often a follower asks for more when nothing new came.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

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

pub fn run(
    client: &Client,
    include: &[String],
    lines: usize,
    tail: bool,
    out: &mut impl Write,
) -> Result<()> {
    for u in include {
        jujube_core::names::parse_unit(u)?;
    }
    let mut cursor = None;
    loop {
        let got: LogLines = client.call(ClientCall::DebugLog {
            include: include.to_vec(),
            lines,
            cursor,
        })?;
        if got.missed > 0 {
            eprintln!(
                "warning: {} bytes of log were rotated away before they were shown",
                got.missed
            );
        }
        for l in &got.lines {
            match l.split_once(": ") {
                Some((unit, text)) => writeln!(out, "{unit}: {}", as_shown(text))?,
                None => writeln!(out, "{l}")?,
            }
        }
        out.flush()?;
        if !tail {
            return Ok(());
        }
        if got.lines.is_empty() || cursor == Some(got.cursor) {
            std::thread::sleep(FOLLOW_EVERY);
        }
        cursor = Some(got.cursor);
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
