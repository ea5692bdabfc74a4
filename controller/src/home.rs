//! Where environments live: `$JUJUBE_HOME` (default: the user's data
//! directory + `jujube`), one folder per environment holding its state
//! database (and, for the dummy provider, its cloud), and a `current-environment`
//! file naming the one commands use by default.
//!
//! What the client knows of controllers, beside: `controllers.json` (each
//! environment's API addresses and CA certificate) and `accounts.json` (the
//! user and password this home logs in with, per environment; 0600). A
//! home that bootstrapped an environment has both and its folder; one that
//! registered with `jujube register` has only the two files.

use crate::{bail, refusal, Context, Result};
use jujube_state::Store;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// How to reach an environment's controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerEntry {
    pub uuid: String,
    pub addresses: Vec<String>,
    pub ca_cert: String,
}

/// Who this home logs in as.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub user: String,
    pub password: String,
}

/// Where an environment's state lives when it is not this home's SQLite
/// file (`bootstrap --config state-url=...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatePlace {
    /// `postgres://USER@HOST:PORT/DB`, without a password.
    pub url: String,
    /// The file the password is read from at each open, if any; else
    /// `JUJUBE_STATE_PASSWORD`, else none (trust or peer authentication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
}

/// Where the state's password may come from, beside `state-password-file`.
pub const STATE_PASSWORD_ENV: &str = "JUJUBE_STATE_PASSWORD";

/// The longest password file read (a password, not a document).
const MAX_PASSWORD_FILE: u64 = 4096;

impl StatePlace {
    /// The database, with its password read now.
    pub fn target(&self) -> Result<jujube_state::PgTarget> {
        Ok(jujube_state::PgTarget::new(&self.url, self.password()?)?)
    }

    /// The store at this place, opened with full durability.
    pub fn open(&self) -> Result<jujube_state::Store> {
        Ok(jujube_state::Store::open_at(
            &jujube_state::Location::Postgres(self.target()?),
            jujube_state::Durability::Full,
        )?)
    }

    /// The password, read now: `JUJUBE_STATE_PASSWORD`, else the password
    /// file, else none.
    pub(crate) fn password(&self) -> Result<Option<String>> {
        Ok(
            match (std::env::var(STATE_PASSWORD_ENV), &self.password_file) {
                (Ok(p), _) if !p.is_empty() => Some(p),
                (_, Some(file)) => Some(read_password(file)?),
                _ => None,
            },
        )
    }
}

fn read_password(file: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(MAX_PASSWORD_FILE + 1).read_to_string(&mut text))
        .with_context(|| {
            format!(
                "cannot read the state's password from `{}` (`state-password-file`)",
                file.display()
            )
        })?;
    if text.len() as u64 > MAX_PASSWORD_FILE {
        bail!(
            "`{}` (`state-password-file`) is longer than {MAX_PASSWORD_FILE} bytes; it must hold the password alone",
            file.display()
        );
    }
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

pub(crate) const STATE_URL: &str = "state-url.json";

const CONTROLLERS: &str = "controllers.json";
const ACCOUNTS: &str = "accounts.json";

pub struct Home {
    pub root: PathBuf,
}

const CURRENT: &str = "current-environment";

impl Home {
    pub fn locate() -> Result<Home> {
        let root = match std::env::var_os("JUJUBE_HOME") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => dirs::data_dir()
                .ok_or_else(|| {
                    refusal!("cannot find a data directory for this user; set `JUJUBE_HOME`")
                })?
                .join("jujube"),
        };
        Ok(Home { root })
    }

    pub fn env_dir(&self, name: &str) -> PathBuf {
        self.root.join("environments").join(name)
    }

    pub fn state_path(&self, name: &str) -> PathBuf {
        self.env_dir(name).join("state.db")
    }

    /// Where an environment bootstrapped with `state-url` keeps its state:
    /// the file naming the database (its URL, and the file its password
    /// is read from; never the password).
    pub fn state_url_path(&self, name: &str) -> PathBuf {
        self.env_dir(name).join(STATE_URL)
    }

    /// Records that environment `name` keeps its state in PostgreSQL.
    pub fn set_state_url(&self, name: &str, place: &StatePlace) -> Result<()> {
        let path = self.state_url_path(name);
        std::fs::write(&path, serde_json::to_vec_pretty(place)?)
            .with_context(|| format!("cannot write `{}`", path.display()))
    }

    /// Where environment `name`'s state is: its PostgreSQL database, or its
    /// SQLite file.
    pub fn state_location(&self, name: &str) -> Result<jujube_state::Location> {
        Ok(match self.state_place(name)? {
            Some(place) => jujube_state::Location::Postgres(place.target()?),
            None => jujube_state::Location::File(self.state_path(name)),
        })
    }

    /// Where environment `name`'s state is when it is in PostgreSQL.
    pub fn state_place(&self, name: &str) -> Result<Option<StatePlace>> {
        let path = self.state_url_path(name);
        let Ok(text) = std::fs::read(&path) else {
            return Ok(None);
        };
        Ok(Some(serde_json::from_slice(&text).with_context(|| {
            format!("cannot read `{}`", path.display())
        })?))
    }

    pub fn exists(&self, name: &str) -> bool {
        self.has_store(name) || self.controller(name).ok().flatten().is_some()
    }

    /// Whether environment `name` was bootstrapped from this home: its
    /// store is here, or its controller runs in machine 0 (LXD) and this
    /// home knows where.
    pub fn holds(&self, name: &str) -> bool {
        self.has_store(name) || self.env_dir(name).join(crate::machine0::MARKER).exists()
    }

    /// Whether the environment's store is on this host (it was bootstrapped
    /// from this home).
    pub fn has_store(&self, name: &str) -> bool {
        self.state_path(name).exists() || self.state_url_path(name).exists()
    }

    fn read_map<T: serde::de::DeserializeOwned>(&self, file: &str) -> Result<BTreeMap<String, T>> {
        let path = self.root.join(file);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("cannot read `{}`; fix or remove it", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(e).with_context(|| format!("cannot read `{}`", path.display())),
        }
    }

    /// Writes `file` whole (0600, then renamed into place: a crash never
    /// leaves half of it).
    fn write_map<T: Serialize>(&self, file: &str, map: &BTreeMap<String, T>) -> Result<()> {
        std::fs::create_dir_all(&self.root)
            .with_context(|| format!("cannot create `{}`", self.root.display()))?;
        let path = self.root.join(file);
        jujube_agent::wire::write_private(&path, &serde_json::to_vec_pretty(map)?)
            .with_context(|| format!("cannot write `{}`", path.display()))
    }

    pub fn controller(&self, name: &str) -> Result<Option<ControllerEntry>> {
        Ok(self.read_map::<ControllerEntry>(CONTROLLERS)?.remove(name))
    }

    pub fn set_controller(&self, name: &str, entry: ControllerEntry) -> Result<()> {
        let mut all = self.read_map::<ControllerEntry>(CONTROLLERS)?;
        all.insert(name.to_string(), entry);
        self.write_map(CONTROLLERS, &all)
    }

    pub fn account(&self, name: &str) -> Result<Option<Account>> {
        Ok(self.read_map::<Account>(ACCOUNTS)?.remove(name))
    }

    /// Sets (`Some`) or forgets (`None`) the account for `name`.
    pub fn set_account(&self, name: &str, account: Option<Account>) -> Result<()> {
        let mut all = self.read_map::<Account>(ACCOUNTS)?;
        match account {
            Some(a) => all.insert(name.to_string(), a),
            None => all.remove(name),
        };
        self.write_map(ACCOUNTS, &all)
    }

    /// Forgets environment `name`'s controller and account.
    pub fn forget(&self, name: &str) -> Result<()> {
        let mut all = self.read_map::<ControllerEntry>(CONTROLLERS)?;
        if all.remove(name).is_some() {
            self.write_map(CONTROLLERS, &all)?;
        }
        if self.account(name)?.is_some() {
            self.set_account(name, None)?;
        }
        Ok(())
    }

    pub fn environments(&self) -> Result<Vec<String>> {
        let dir = self.root.join("environments");
        let mut names = Vec::new();
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for e in entries {
                    let e = e?;
                    if e.path().join("state.db").exists() {
                        names.push(e.file_name().to_string_lossy().into_owned());
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot read `{}`", dir.display())),
        }
        names.extend(self.read_map::<ControllerEntry>(CONTROLLERS)?.into_keys());
        names.sort();
        names.dedup();
        Ok(names)
    }

    pub fn current(&self) -> Option<String> {
        std::fs::read_to_string(self.root.join(CURRENT))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Creates `JUJUBE_HOME`, `environments/` and environment `name`'s
    /// directory, the owner's alone (0700: they hold the state, the CA's
    /// key, agents' credentials); existing ones are tightened.
    pub fn create_env_dir(&self, name: &str) -> Result<PathBuf> {
        let dir = self.env_dir(name);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
        self.tighten(name)?;
        Ok(dir)
    }

    /// Takes group and other permissions off `JUJUBE_HOME`, `environments/`
    /// and environment `name`'s directory.
    pub(crate) fn tighten(&self, name: &str) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let environments = self.root.join("environments");
        for d in [&self.root, &environments, &self.env_dir(name)] {
            let Ok(meta) = std::fs::metadata(d) else {
                continue;
            };
            let mode = meta.permissions().mode();
            if mode & 0o077 != 0 {
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode & 0o700))
                    .with_context(|| format!("cannot make `{}` private (0700)", d.display()))?;
            }
        }
        Ok(())
    }

    pub fn set_current(&self, name: &str) -> Result<()> {
        std::fs::create_dir_all(&self.root)?;
        // Write-then-rename, so a crash never leaves a half-written name.
        let tmp = self.root.join(format!("{CURRENT}.tmp"));
        std::fs::write(&tmp, format!("{name}\n"))?;
        std::fs::rename(&tmp, self.root.join(CURRENT))?;
        Ok(())
    }

    pub fn clear_current(&self) -> Result<()> {
        match std::fs::remove_file(self.root.join(CURRENT)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// The environment a command acts on: `--env`/`JUJUBE_ENV`, else the
    /// current one.
    pub fn select(&self, flag: Option<&str>) -> Result<String> {
        let name = match flag {
            Some(n) => n.to_string(),
            None => self.current().ok_or_else(|| {
                refusal!("no environment selected; create one with `jujube bootstrap NAME --provider dummy` or pick one with `jujube switch NAME`")
            })?,
        };
        jujube_core::names::validate_environment(&name)?;
        if !self.exists(&name) {
            let known = self.environments()?;
            if known.is_empty() {
                bail!("environment `{name}` not found; create it with `jujube bootstrap {name} --provider dummy`");
            }
            bail!(
                "environment `{name}` not found; known environments: {}",
                known
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(name)
    }

    pub fn open(&self, name: &str) -> Result<Store> {
        self.tighten(name)?;
        Ok(Store::open_at(
            &self.state_location(name)?,
            jujube_state::Durability::Full,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A password file holds a password: one longer than 4 KiB is refused
    /// at the read, and the password is read without its line ending.
    #[test]
    fn the_state_password_file_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        let place = StatePlace {
            url: "postgres://jujube@db.example/env".into(),
            password_file: Some(file.clone()),
        };
        std::fs::write(&file, "s3cret\n").unwrap();
        assert!(place.target().is_ok());
        assert_eq!(read_password(&file).unwrap(), "s3cret");
        std::fs::write(&file, "x".repeat(MAX_PASSWORD_FILE as usize + 1)).unwrap();
        let err = place.target().unwrap_err().to_string();
        assert!(err.contains("longer than 4096 bytes"), "{err}");
    }
}
