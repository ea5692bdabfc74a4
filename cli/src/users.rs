//! Users: `add-user`, `register`, `login`, `logout`, `change-user-password`,
//! `users`, `grant`, `revoke`. Every one is a call to the controller; only
//! `register` and `login` also write this home's files (the controller's
//! address and CA, the account).
//!
//! A registration string carries what a new user's `jujube` needs to find
//! and trust the controller (addresses, CA certificate) and the one-time
//! secret that lets it choose a password; it holds no other secret.

use crate::client::Client;
use anyhow::{anyhow, bail, Context, Result};
use base64::Engine;
use jujube_controller::home::{Account, ControllerEntry, Home};
use jujube_wire::client::{Access, ClientCall, Registration, UserInfo};
use serde::{Deserialize, Serialize};
use std::io::Write;

/// What `add-user` prints, base64url of this JSON.
#[derive(Serialize, Deserialize)]
struct Ticket {
    user: String,
    secret: String,
    environment: String,
    uuid: String,
    addresses: Vec<String>,
    ca_cert: String,
}

/// The longest registration string read.
const MAX_TICKET: usize = 64 << 10;

pub fn add_user(
    home: &Home,
    client: &Client,
    env: &str,
    name: &str,
    access: Access,
    out: &mut impl Write,
) -> Result<()> {
    let controller = home.controller(env)?.ok_or_else(|| {
        anyhow!(
            "this home knows no controller for environment `{env}`; bootstrap or register first"
        )
    })?;
    let secret: String = client.call(ClientCall::AddUser {
        name: name.to_string(),
        access,
    })?;
    let ticket = Ticket {
        user: name.to_string(),
        secret,
        environment: env.to_string(),
        uuid: controller.uuid,
        addresses: controller.addresses,
        ca_cert: controller.ca_cert,
    };
    let encoded =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(&ticket)?);
    writeln!(
        out,
        "User `{name}` added with `{access}` access to environment `{env}`."
    )?;
    writeln!(
        out,
        "Please send this command to {name} (it works once):\n    jujube register {encoded}"
    )?;
    Ok(())
}

pub fn register(home: &Home, string: &str, out: &mut impl Write) -> Result<()> {
    let ticket: Ticket = (string.len() <= MAX_TICKET)
        .then(|| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(string.trim())
                .ok()
        })
        .flatten()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .ok_or_else(|| {
            anyhow!(
                "malformed registration string; copy the whole string `jujube add-user` printed"
            )
        })?;
    jujube_core::names::validate_environment(&ticket.environment)?;
    if home.has_store(&ticket.environment) {
        bail!(
            "environment `{}` was bootstrapped from this home; register from another `JUJUBE_HOME`",
            ticket.environment
        );
    }
    let password = read_password(&format!("Enter a password for `{}`: ", ticket.user), true)?;
    let controller = ControllerEntry {
        uuid: ticket.uuid.clone(),
        addresses: ticket.addresses.clone(),
        ca_cert: ticket.ca_cert.clone(),
    };
    let client =
        jujube_agent::remote::UserClient::new(&ticket.addresses, &ticket.ca_cert, &ticket.user, "")
            .map_err(|e| anyhow!("{}", e.message))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime
        .block_on(client.register(&Registration {
            user: ticket.user.clone(),
            secret: ticket.secret.clone(),
            password: password.clone(),
        }))
        .map_err(|e| {
            anyhow!(
                "cannot reach the controller of environment `{}` at {}: {}",
                ticket.environment,
                ticket.addresses.join(", "),
                e.message
            )
        })?;
    answer.map_err(|e| anyhow!("{}", e.message))?;
    home.set_controller(&ticket.environment, controller)?;
    home.set_account(
        &ticket.environment,
        Some(Account {
            user: ticket.user.clone(),
            password,
        }),
    )?;
    home.set_current(&ticket.environment)?;
    writeln!(
        out,
        "registered as `{}` with environment `{}`, now the current environment",
        ticket.user, ticket.environment
    )?;
    Ok(())
}

pub fn login(home: &Home, env: &str, user: Option<&str>, out: &mut impl Write) -> Result<()> {
    let controller = home.controller(env)?.ok_or_else(|| {
        anyhow!("this home knows no controller for environment `{env}`; register with the string an admin's `jujube add-user` printed")
    })?;
    let user = match user {
        Some(u) => u.to_string(),
        None => home
            .account(env)?
            .map(|a| a.user)
            .unwrap_or_else(|| jujube_wire::client::ADMIN.to_string()),
    };
    let password = read_password(&format!("Password for `{user}`: "), false)?;
    let account = Account {
        user: user.clone(),
        password,
    };
    let client = Client::remote(
        env,
        &controller,
        &account,
        std::time::Duration::ZERO,
        "check that it runs".into(),
    )?;
    // Any call proves the password; this one every user may make.
    client.call::<Vec<UserInfo>>(ClientCall::Users)?;
    home.set_account(env, Some(account))?;
    writeln!(out, "logged in to environment `{env}` as `{user}`")?;
    Ok(())
}

pub fn logout(home: &Home, env: &str, out: &mut impl Write) -> Result<()> {
    match home.account(env)? {
        Some(a) => {
            home.set_account(env, None)?;
            writeln!(out, "logged out of environment `{env}` (was `{}`)", a.user)?;
        }
        None => writeln!(out, "not logged in to environment `{env}`")?,
    }
    Ok(())
}

pub fn change_password(
    home: &Home,
    client: &Client,
    env: &str,
    user: Option<&str>,
    out: &mut impl Write,
) -> Result<()> {
    let own = home.account(env)?;
    let name = match (user, &own) {
        (Some(u), _) => u.to_string(),
        (None, Some(a)) => a.user.clone(),
        (None, None) => jujube_wire::client::ADMIN.to_string(),
    };
    let password = read_password(&format!("New password for `{name}`: "), true)?;
    client.call::<()>(ClientCall::SetPassword {
        name: name.clone(),
        password: password.clone(),
    })?;
    if let Some(mut a) = own.filter(|a| a.user == name) {
        a.password = password;
        home.set_account(env, Some(a))?;
    }
    writeln!(out, "password of `{name}` changed")?;
    Ok(())
}

pub fn change_access(
    client: &Client,
    name: &str,
    access: Access,
    grant: bool,
    out: &mut impl Write,
) -> Result<()> {
    let now: Access = client.call(ClientCall::ChangeAccess {
        name: name.to_string(),
        access,
        grant,
    })?;
    writeln!(out, "user `{name}` now has `{now}` access")?;
    Ok(())
}

/// Reads a password: from the terminal without echo (twice when
/// `confirm`), or the first line of standard input when it is not a
/// terminal.
fn read_password(prompt: &str, confirm: bool) -> Result<String> {
    use std::io::IsTerminal;
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stdin.lock(), &mut line)
            .context("cannot read the password from standard input")?;
        let password = line.trim_end_matches(['\n', '\r']).to_string();
        if password.is_empty() {
            bail!("no password on standard input; give it as its first line");
        }
        return Ok(password);
    }
    let first = read_hidden(prompt)?;
    if confirm && read_hidden("Type it again: ")? != first {
        bail!("the passwords differ; nothing was changed");
    }
    if first.is_empty() {
        bail!("the password is empty; nothing was changed");
    }
    Ok(first)
}

/// One line from the terminal, echo off while it is typed.
fn read_hidden(prompt: &str) -> Result<String> {
    eprint!("{prompt}");
    let _ = std::io::stderr().flush();
    let fd = 0;
    // SAFETY: tcgetattr/tcsetattr on standard input with a zeroed struct
    // the call fills in; the original settings are restored below.
    let mut original: libc::termios = unsafe { std::mem::zeroed() };
    let saved = unsafe { libc::tcgetattr(fd, &mut original) } == 0;
    if saved {
        let mut quiet = original;
        quiet.c_lflag &= !libc::ECHO;
        quiet.c_lflag |= libc::ECHONL;
        // SAFETY: as above.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &quiet) };
    }
    let mut line = String::new();
    let read = std::io::stdin().read_line(&mut line);
    if saved {
        // SAFETY: restores what tcgetattr read.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &original) };
    }
    read.context("cannot read the password")?;
    Ok(line.trim_end_matches(['\n', '\r']).to_string())
}
