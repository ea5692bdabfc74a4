//! Users: who may use the environment through the API, and how much.
//!
//! A user proves itself with a password, kept as an argon2id hash (a hash
//! made to be slow for guessing: 7 MiB and five passes, see [`hasher`]). A new user gets a one-time registration secret instead; only
//! its SHA-256 is kept (it is random and long, so a fast hash is enough),
//! and it is gone once used.
//!
//! What a user may do is checked by the store itself: [`Store::as_user`]
//! gives a handle whose every transaction first reads the user's access
//! *inside that transaction* and refuses with [`Error::Forbidden`] unless it
//! is enough (`read` for reads, `write` for writes, `admin` where a method
//! says so). A grant or revoke therefore takes effect on the very next
//! transaction, whatever the API server cached.

use crate::db::Store;
use crate::sql::{Connection, OptionalExtension};
use crate::{unix_now, Error, Result};
use jujube_wire::client::{Access, UserInfo};

/// The user `bootstrap` makes.
pub use jujube_wire::client::ADMIN;

/// The longest password accepted (argon2 reads it whole).
pub const MAX_PASSWORD_BYTES: usize = 1024;

/// The memory (KiB) and passes of a new hash: OWASP's argon2id choice of
/// 7 MiB and five passes, which it rates as strong as the crate's default
/// 19 MiB and two. Every login the controller checks holds this memory
/// while it runs (two at once, `jujube_api::clients::CHECKS_AT_ONCE`):
/// 7 MiB, not 19, of the controller's peak for each. A hash keeps the
/// parameters it was made with; older ones verify as they are.
pub const HASH_MEMORY_KIB: u32 = 7 * 1024;
pub const HASH_PASSES: u32 = 5;

/// The argon2id hasher for new hashes (see [`HASH_MEMORY_KIB`]).
fn hasher() -> argon2::Argon2<'static> {
    argon2::Argon2::new(
        argon2::Algorithm::Argon2id,
        argon2::Version::V0x13,
        argon2::Params::new(HASH_MEMORY_KIB, HASH_PASSES, 1, None).expect("valid parameters"),
    )
}

/// An argon2id hash of `password`, as a PHC string (salt and parameters
/// included).
pub fn hash_password(password: &str) -> Result<String> {
    use argon2::password_hash::{rand_core::OsRng, PasswordHasher, SaltString};
    check_password(password)?;
    let salt = SaltString::generate(&mut OsRng);
    hasher()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| Error::Corrupt {
            what: "password hash",
            value: e.to_string(),
        })
}

/// Checks `password` against a hash no password matches, as long as a
/// real check takes: a login for a user who does not exist (or has not
/// registered) answers no sooner than one with a wrong password.
pub fn password_matches_nothing(password: &str) -> bool {
    static DECOY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let decoy =
        DECOY.get_or_init(|| hash_password(&uuid::Uuid::new_v4().to_string()).unwrap_or_default());
    let _ = password_matches(password, decoy);
    false
}

/// Whether `password` is the one `hash` (a PHC string) was made from.
pub fn password_matches(password: &str, hash: &str) -> bool {
    use argon2::password_hash::{PasswordHash, PasswordVerifier};
    if password.len() > MAX_PASSWORD_BYTES {
        return false;
    }
    // The hash's own parameters apply, whatever the hasher's.
    PasswordHash::new(hash).is_ok_and(|h| hasher().verify_password(password.as_bytes(), &h).is_ok())
}

fn check_password(password: &str) -> Result<()> {
    if password.is_empty() {
        return Err(Error::BadPassword("the password is empty".into()));
    }
    if password.len() > MAX_PASSWORD_BYTES {
        return Err(Error::BadPassword(format!(
            "the password is longer than {MAX_PASSWORD_BYTES} bytes"
        )));
    }
    if password.chars().any(char::is_control) {
        return Err(Error::BadPassword(
            "the password holds a control character".into(),
        ));
    }
    Ok(())
}

/// The SHA-256 of a registration secret, hex.
pub fn secret_hash(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the API server needs to check a login: the password's hash (none
/// before registration) and the access.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    pub password_hash: Option<String>,
    pub access: Access,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("access", &self.access)
            .finish_non_exhaustive()
    }
}

/// The access `user` has now, read inside the caller's transaction; `None`
/// when there is no such user.
pub(crate) fn access_in(c: &Connection, user: &str) -> Result<Option<Access>> {
    let level: Option<i64> = c
        .prepare_cached("SELECT access FROM users WHERE name = ?1")?
        .query_row([user], |r| r.get(0))
        .optional()?;
    level
        .map(|n| {
            Access::from_level(n).ok_or_else(|| Error::Corrupt {
                what: "user access",
                value: n.to_string(),
            })
        })
        .transpose()
}

/// Refuses unless `user` has at least `needs`.
pub(crate) fn require_access(c: &Connection, user: &str, needs: Access) -> Result<()> {
    match access_in(c, user)? {
        Some(has) if has >= needs => Ok(()),
        Some(has) => Err(Error::Forbidden {
            user: user.to_string(),
            has,
            needs,
        }),
        None => Err(Error::NoSuchUser(user.to_string())),
    }
}

fn admins_in(c: &Connection) -> Result<i64> {
    Ok(c.query_row(
        "SELECT count(*) FROM users WHERE access = ?1",
        [Access::Admin.level()],
        |r| r.get(0),
    )?)
}

/// The most users an environment keeps (the admin included): `users`
/// lists them all.
pub const MAX_USERS: usize = 1000;

impl Store {
    /// Makes the first user, `admin`, with `password` (bootstrap).
    pub fn create_admin(&self, password: &str) -> Result<()> {
        let hash = hash_password(password)?;
        self.write(|tx| {
            tx.prepare_cached(
                "INSERT INTO users (name, access, password_hash, created_at)
                 VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute((ADMIN, Access::Admin.level(), &hash, unix_now()))?;
            Ok(())
        })
    }

    /// What a login as `user` is checked against; `None` when there is no
    /// such user. Not scoped: the API server asks before it knows who
    /// calls.
    pub fn login(&self, user: &str) -> Result<Option<Login>> {
        self.read_unchecked(|c| {
            let row: Option<(Option<String>, i64)> = c
                .prepare_cached("SELECT password_hash, access FROM users WHERE name = ?1")?
                .query_row([user], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            row.map(|(password_hash, level)| {
                Ok(Login {
                    password_hash,
                    access: Access::from_level(level).ok_or_else(|| Error::Corrupt {
                        what: "user access",
                        value: level.to_string(),
                    })?,
                })
            })
            .transpose()
        })
    }

    /// Adds `name` with `access` and the hash of its one-time registration
    /// secret (admin only); refused past [`MAX_USERS`].
    pub fn add_user(&self, name: &str, access: Access, registration_hash: &str) -> Result<()> {
        jujube_core::names::validate_user(name)?;
        let by = self.user().map(str::to_string);
        self.write_at(Access::Admin, |tx| {
            if access_in(tx, name)?.is_some() {
                return Err(Error::UserExists(name.to_string()));
            }
            let users: i64 = tx
                .prepare_cached("SELECT count(*) FROM users")?
                .query_row([], |r| r.get(0))?;
            if users as usize >= MAX_USERS {
                return Err(Error::Relation(format!(
                    "cannot add user `{name}`: the environment has {users} users, the most it keeps; give an existing user the access instead (`jujube grant`)"
                )));
            }
            tx.prepare_cached(
                "INSERT INTO users (name, access, registration_hash, created_by, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute((
                name,
                access.level(),
                registration_hash,
                by.as_deref(),
                unix_now(),
            ))?;
            Ok(())
        })
    }

    /// `jujube register`: trades `name`'s registration secret for a
    /// password, once. Every refusal reads the same, telling nothing of
    /// which users exist.
    pub fn register_user(&self, name: &str, secret: &str, password: &str) -> Result<()> {
        let hash = hash_password(password)?;
        let presented = secret_hash(secret);
        self.write(|tx| {
            let stored: Option<Option<String>> = tx
                .prepare_cached("SELECT registration_hash FROM users WHERE name = ?1")?
                .query_row([name], |r| r.get(0))
                .optional()?;
            match stored.flatten() {
                Some(h) if h == presented => {}
                _ => return Err(Error::RegistrationRefused),
            }
            tx.prepare_cached(
                "UPDATE users SET password_hash = ?2, registration_hash = NULL WHERE name = ?1",
            )?
            .execute((name, &hash))?;
            Ok(())
        })
    }

    /// Sets `name`'s password: the user itself, or an admin.
    pub fn set_user_password(&self, name: &str, password: &str) -> Result<()> {
        let hash = hash_password(password)?;
        let needs = if self.user() == Some(name) {
            Access::None
        } else {
            Access::Admin
        };
        self.write_at(needs, |tx| {
            if access_in(tx, name)?.is_none() {
                return Err(Error::NoSuchUser(name.to_string()));
            }
            // A registration string not used yet stops working too.
            tx.prepare_cached(
                "UPDATE users SET password_hash = ?2, registration_hash = NULL WHERE name = ?1",
            )?
            .execute((name, &hash))?;
            Ok(())
        })
    }

    /// Sets `name`'s access (admin only): `grant` raises it to `access`
    /// (never lowers), `revoke` lowers it to below `access` (never raises).
    /// The last admin keeps `admin`.
    pub fn change_access(&self, name: &str, access: Access, grant: bool) -> Result<Access> {
        self.write_at(Access::Admin, |tx| {
            let has = access_in(tx, name)?.ok_or_else(|| Error::NoSuchUser(name.to_string()))?;
            let new = if grant {
                has.max(access)
            } else {
                has.min(access.below())
            };
            if has == Access::Admin && new < Access::Admin && admins_in(tx)? <= 1 {
                return Err(Error::LastAdmin(name.to_string()));
            }
            tx.prepare_cached("UPDATE users SET access = ?2 WHERE name = ?1")?
                .execute((name, new.level()))?;
            Ok(new)
        })
    }

    /// Refuses unless this handle's user has at least `needs` now (for what
    /// the API server does beside the store, e.g. keeping an uploaded
    /// charm); the controller's own handle always may.
    pub fn require(&self, needs: Access) -> Result<()> {
        self.read_at(needs, |_| Ok(()))
    }

    /// Every user (an admin), or only the caller itself (anyone else).
    pub fn users(&self) -> Result<Vec<UserInfo>> {
        let only = match self.user() {
            Some(u) => self.read_at(Access::None, |c| {
                Ok((access_in(c, u)? < Some(Access::Admin)).then(|| u.to_string()))
            })?,
            None => None,
        };
        self.read_at(Access::None, |c| {
            let mut stmt = c.prepare_cached(
                "SELECT name, access, created_by, created_at, registration_hash IS NULL
                 FROM users WHERE CAST(?1 AS TEXT) IS NULL OR name = ?1 ORDER BY name",
            )?;
            let rows = stmt.query_map([only.as_deref()], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                ))
            })?;
            rows.map(|row| {
                let (name, level, created_by, created_at, registered) = row?;
                Ok(UserInfo {
                    name,
                    access: Access::from_level(level).ok_or_else(|| Error::Corrupt {
                        what: "user access",
                        value: level.to_string(),
                    })?,
                    created_by,
                    created_at,
                    registered,
                })
            })
            .collect()
        })
    }
}
