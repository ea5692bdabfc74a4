//! The `jujube` binary run under a hook tool's name (`relation-get`,
//! `config-get`, ...; links in the unit's `tools/` directory, first on a
//! hook's `PATH`): a client of the unit agent's socket. The tools' logic is
//! the agent's (`jujube_agent::hooks::tools`); this only carries the
//! arguments there and the answer back.

use jujube_agent::hooks::context::{Output, Request, MAX_REQUEST_BYTES};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::ExitCode;

/// The tool `argv0` names, if it names one.
pub fn tool_name(argv0: &str) -> Option<&'static str> {
    let base = std::path::Path::new(argv0).file_name()?.to_str()?;
    jujube_agent::hooks::TOOLS
        .iter()
        .copied()
        .find(|t| *t == base)
}

pub fn run(tool: &str, args: Vec<OsString>) -> ExitCode {
    // Settings, keys and messages are text: an argument that is not UTF-8
    // is a usage error (exit 2, as Juju's flag parsing refuses bad input),
    // never a panic.
    let mut text = Vec::with_capacity(args.len());
    for (i, a) in args.into_iter().enumerate() {
        match a.into_string() {
            Ok(s) => text.push(s),
            Err(_) => {
                eprintln!(
                    "error: argument {} is not valid UTF-8; hook tools take text",
                    i + 1
                );
                return ExitCode::from(2);
            }
        }
    }
    match call(tool, text) {
        Ok(out) => {
            let mut code = out.code.clamp(0, 255) as u8;
            match out.file.as_deref() {
                // `--output FILE`: relative to where the tool runs.
                Some(file) if code == 0 => {
                    if let Err(e) = std::fs::write(file, out.stdout.as_bytes()) {
                        eprintln!("error: cannot write {file:?}: {e}");
                        code = 1;
                    }
                }
                _ => print!("{}", out.stdout),
            }
            eprint!("{}", out.stderr);
            let _ = std::io::stdout().flush();
            ExitCode::from(code)
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
    }
}

fn call(tool: &str, args: Vec<String>) -> Result<Output, String> {
    let (Ok(context_id), Ok(socket)) = (
        std::env::var("JUJU_CONTEXT_ID"),
        std::env::var("JUJU_AGENT_SOCKET"),
    ) else {
        return Err(format!(
            "`{tool}` works only inside a hook context (JUJU_CONTEXT_ID and JUJU_AGENT_SOCKET are not set); it is run by a charm's hooks"
        ));
    };
    let stdin = if jujube_agent::hooks::tools::reads_stdin(tool, &args) {
        let mut text = String::new();
        std::io::stdin()
            .take(MAX_REQUEST_BYTES as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read standard input: {e}"))?;
        Some(text)
    } else {
        None
    };
    let size =
        args.iter().map(|a| a.len() + 1).sum::<usize>() + stdin.as_ref().map_or(0, String::len);
    if size > MAX_REQUEST_BYTES {
        return Err(format!(
            "`{tool}`'s arguments{} are {size} bytes, more than the tool channel's limit of {MAX_REQUEST_BYTES} bytes; pass less (relation settings and messages are meant to be small)",
            if stdin.is_some() { " and input" } else { "" }
        ));
    }
    let cwd = std::env::current_dir()
        .ok()
        .and_then(|d| d.into_os_string().into_string().ok());
    let mut stream = std::os::unix::net::UnixStream::connect(&socket)
        .map_err(|e| format!("cannot reach the unit agent at `{socket}`: {e}"))?;
    let mut line = serde_json::to_vec(&Request {
        context_id,
        tool: tool.to_string(),
        args,
        cwd,
        stdin,
    })
    .map_err(|e| e.to_string())?;
    line.push(b'\n');
    stream
        .write_all(&line)
        .map_err(|e| format!("cannot reach the unit agent at `{socket}`: {e}"))?;
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .map_err(|e| format!("no answer from the unit agent at `{socket}`: {e}"))?;
    serde_json::from_str(&answer).map_err(|e| format!("malformed answer from the unit agent: {e}"))
}
