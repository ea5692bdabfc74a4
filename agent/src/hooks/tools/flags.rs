//! The hook tools' command line, parsed as Juju's command framework parses
//! it (Go's `gnuflag` under `juju/cmd`): long flags `--name`, `--name=V`,
//! `--name V`; short flags `-x`, `-xV`, `-x V`, grouped booleans `-ab`;
//! flags and arguments interspersed; `--` ends the flags; a lone `-` is an
//! argument. `-h` and `--help` ask for the usage.
//!
//! What goes wrong here is a *usage* error: the tool exits 2 with `error:
//! MSG`, as Juju's do. charmhelpers relies on that (an exit 2 of
//! `relation-get` means "no value"), so the messages and the status are
//! behaviour, not cosmetics.

use std::collections::BTreeMap;

/// One flag a tool accepts.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    pub short: Option<char>,
    pub long: &'static str,
    /// `None`: a boolean flag. `Some(default)`: takes a value.
    pub value: Option<&'static str>,
    /// A plain string flag: its help shows the default quoted (`(= "")`),
    /// as Juju's does; typed ones (format, relation, file) show it bare.
    pub quoted: bool,
    pub help: &'static str,
}

impl Flag {
    const fn new(
        short: Option<char>,
        long: &'static str,
        value: Option<&'static str>,
        quoted: bool,
        help: &'static str,
    ) -> Flag {
        Flag {
            short,
            long,
            value,
            quoted,
            help,
        }
    }

    /// A typed flag (format, relation, file): its default shown bare.
    pub const fn value(
        short: Option<char>,
        long: &'static str,
        default: &'static str,
        help: &'static str,
    ) -> Flag {
        Flag::new(short, long, Some(default), false, help)
    }

    /// A plain string flag: its default shown quoted.
    pub const fn string(
        short: Option<char>,
        long: &'static str,
        default: &'static str,
        help: &'static str,
    ) -> Flag {
        Flag::new(short, long, Some(default), true, help)
    }

    pub const fn bool(short: Option<char>, long: &'static str, help: &'static str) -> Flag {
        Flag::new(short, long, None, false, help)
    }
}

/// A tool's command line: its name, argument synopsis, purpose, flags and
/// longer description (what `--help` prints).
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub name: &'static str,
    pub args: &'static str,
    pub purpose: &'static str,
    pub flags: &'static [Flag],
    pub doc: &'static str,
}

/// What a command line said.
#[derive(Debug, Default)]
pub struct Parsed {
    /// Flags given, by long name (booleans as `"true"`/`"false"`). A flag
    /// given twice keeps its last value, as `gnuflag` does.
    pub flags: BTreeMap<&'static str, String>,
    pub args: Vec<String>,
}

impl Parsed {
    pub fn get(&self, long: &str) -> Option<&str> {
        self.flags.get(long).map(String::as_str)
    }

    pub fn is_set(&self, long: &str) -> bool {
        self.get(long).is_some_and(|v| v == "true")
    }
}

/// The outcome of parsing: flags and arguments, or a request for help.
#[derive(Debug)]
pub enum Line {
    Run(Parsed),
    Help,
}

fn display(f: &Flag, short: bool) -> String {
    match (short, f.short) {
        (true, Some(c)) => format!("-{c}"),
        _ => format!("--{}", f.long),
    }
}

impl Spec {
    /// Parses `args` (the arguments after the tool's name).
    pub fn parse(&self, args: &[String]) -> Result<Line, String> {
        let mut p = Parsed::default();
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            i += 1;
            if a == "--" {
                p.args.extend(args[i..].iter().cloned());
                break;
            }
            if let Some(long) = a.strip_prefix("--") {
                let (name, inline) = match long.split_once('=') {
                    Some((n, v)) => (n, Some(v.to_string())),
                    None => (long, None),
                };
                let Some(f) = self.flags.iter().find(|f| f.long == name) else {
                    if name == "help" {
                        return Ok(Line::Help);
                    }
                    return Err(format!("flag provided but not defined: --{name}"));
                };
                let v = match (f.value, inline) {
                    (None, None) => "true".to_string(),
                    (None, Some(v)) => bool_value(&v)
                        .ok_or_else(|| {
                            format!("invalid boolean flag {name}: strconv.ParseBool: parsing {v:?}: invalid syntax")
                        })?
                        .to_string(),
                    (Some(_), Some(v)) => v,
                    (Some(_), None) => match args.get(i) {
                        Some(v) => {
                            i += 1;
                            v.clone()
                        }
                        None => return Err(format!("flag needs an argument: --{name}")),
                    },
                };
                p.flags.insert(f.long, v);
                continue;
            }
            if let Some(group) = a.strip_prefix('-').filter(|g| !g.is_empty()) {
                for (at, c) in group.char_indices() {
                    let Some(f) = self.flags.iter().find(|f| f.short == Some(c)) else {
                        if c == 'h' {
                            return Ok(Line::Help);
                        }
                        return Err(format!("flag provided but not defined: -{c}"));
                    };
                    if f.value.is_none() {
                        p.flags.insert(f.long, "true".into());
                        continue;
                    }
                    // A value flag takes the rest of the group, or the
                    // next argument.
                    let rest = &group[at + c.len_utf8()..];
                    let v = if let Some(v) = rest
                        .strip_prefix('=')
                        .or(Some(rest))
                        .filter(|r| !r.is_empty())
                    {
                        v.to_string()
                    } else {
                        match args.get(i) {
                            Some(v) => {
                                i += 1;
                                v.clone()
                            }
                            None => return Err(format!("flag needs an argument: -{c}")),
                        }
                    };
                    p.flags.insert(f.long, v);
                    break;
                }
                continue;
            }
            p.args.push(a.clone());
        }
        Ok(Line::Run(p))
    }

    /// What `--help` prints, laid out as Juju 1.25's: usage, purpose, the
    /// options sorted by their shortest name, then the details.
    pub fn usage(&self) -> String {
        let mut s = format!("usage: {}", self.name);
        if !self.flags.is_empty() {
            s.push_str(" [options]");
        }
        if !self.args.is_empty() {
            s.push(' ');
            s.push_str(self.args);
        }
        s.push_str(&format!("\npurpose: {}\n", self.purpose));
        if !self.flags.is_empty() {
            s.push_str("\noptions:\n");
            let mut flags: Vec<&Flag> = self.flags.iter().collect();
            let key = |f: &Flag| f.short.map_or(f.long.to_string(), |c| c.to_string());
            flags.sort_by_key(|f| key(f));
            for f in flags {
                let names = match f.short {
                    Some(_) => format!("{}, {}", display(f, true), display(f, false)),
                    None => display(f, false),
                };
                let default = match f.value {
                    None => "  (= false)".to_string(),
                    Some(d) if f.quoted => format!(" (= {d:?})"),
                    Some(d) => format!("  (= {d})"),
                };
                s.push_str(&format!("{names}{default}\n    {}\n", f.help));
            }
        }
        if !self.doc.is_empty() {
            s.push('\n');
            s.push_str(self.doc.trim_end());
            s.push('\n');
        }
        s
    }
}

fn bool_value(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Juju's message for arguments left over: `unrecognized args: ["a" "b"]`.
pub fn check_empty(args: &[String]) -> Result<(), String> {
    if args.is_empty() {
        return Ok(());
    }
    let quoted: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    Err(format!("unrecognized args: [{}]", quoted.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Spec = Spec {
        name: "t",
        args: "<key>",
        purpose: "test",
        flags: &[
            Flag::bool(Some('a'), "all", "all"),
            Flag::value(Some('r'), "relation", "", "relation"),
            Flag::value(None, "format", "smart", "format"),
        ],
        doc: "",
    };

    fn run(args: &[&str]) -> Result<Parsed, String> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        match SPEC.parse(&args)? {
            Line::Run(p) => Ok(p),
            Line::Help => Err("help".into()),
        }
    }

    #[test]
    fn flags_in_every_spelling() {
        for args in [
            &["-r", "db:1", "k"][..],
            &["-rdb:1", "k"],
            &["-r=db:1", "k"],
            &["--relation", "db:1", "k"],
            &["--relation=db:1", "k"],
            &["k", "-r", "db:1"],
        ] {
            let p = run(args).unwrap();
            assert_eq!(p.get("relation"), Some("db:1"), "{args:?}");
            assert_eq!(p.args, ["k"], "{args:?}");
        }
        let p = run(&["-ar", "1"]).unwrap();
        assert!(p.is_set("all"));
        assert_eq!(p.get("relation"), Some("1"));
        assert!(!run(&["--all=false"]).unwrap().is_set("all"));
    }

    #[test]
    fn double_dash_ends_flags_and_a_lone_dash_is_an_argument() {
        let p = run(&["-", "--", "-a", "--format=json"]).unwrap();
        assert_eq!(p.args, ["-", "-a", "--format=json"]);
        assert!(!p.is_set("all"));
    }

    #[test]
    fn usage_errors_say_what_gnuflag_says() {
        assert_eq!(
            run(&["--bad"]).unwrap_err(),
            "flag provided but not defined: --bad"
        );
        assert_eq!(
            run(&["-x"]).unwrap_err(),
            "flag provided but not defined: -x"
        );
        assert_eq!(run(&["-r"]).unwrap_err(), "flag needs an argument: -r");
        assert_eq!(
            run(&["--format"]).unwrap_err(),
            "flag needs an argument: --format"
        );
        assert_eq!(run(&["-h"]).unwrap_err(), "help");
        assert_eq!(run(&["k", "--help"]).unwrap_err(), "help");
        assert_eq!(
            check_empty(&["a".into(), "b c".into()]).unwrap_err(),
            r#"unrecognized args: ["a" "b c"]"#
        );
    }
}
