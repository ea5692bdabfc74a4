//! The `jujube` binary run under a hook tool's name (`relation-get`,
//! `config-get`, ...; links in the unit's `tools/` directory, first on a
//! hook's `PATH`): a client of the unit agent's socket. The tools' logic is
//! the agent's (`jujube_agent::hooks::tools`); this only carries the
//! arguments there and the answer back.

use jujube_agent::hooks::context::{Output, Request};
use std::io::{BufRead, BufReader, Write};
use std::process::ExitCode;

/// The tool `argv0` names, if it names one.
pub fn tool_name(argv0: &str) -> Option<&'static str> {
    let base = std::path::Path::new(argv0).file_name()?.to_str()?;
    jujube_agent::hooks::TOOLS
        .iter()
        .copied()
        .find(|t| *t == base)
}

pub fn run(tool: &str, args: Vec<String>) -> ExitCode {
    match call(tool, args) {
        Ok(out) => {
            print!("{}", out.stdout);
            eprint!("{}", out.stderr);
            let _ = std::io::stdout().flush();
            ExitCode::from(out.code.clamp(0, 255) as u8)
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
    let mut stream = std::os::unix::net::UnixStream::connect(&socket)
        .map_err(|e| format!("cannot reach the unit agent at `{socket}`: {e}"))?;
    let mut line = serde_json::to_vec(&Request {
        context_id,
        tool: tool.to_string(),
        args,
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
