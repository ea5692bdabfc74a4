//! jujube's model vocabulary, with no I/O.
//!
//! # Layout
//! - [`life`]: the Alive → Dying → Dead lifecycle shared by machines, units,
//!   services and relations.
//! - [`names`]: validation and parsing of service, unit, machine and endpoint
//!   names as users type them.
//! - [`series`]: OS series names.
//! - [`constraints`]: hardware constraints — parse, merge (service over
//!   environment), canonical display.
//! - [`charm`]: charm metadata and config (parsed from YAML text; reading the
//!   files is the caller's business), endpoints and relation matching.
//! - [`actions`]: a charm's `actions.yaml` and the check an action's
//!   parameters pass before it is queued.
//! - [`time`]: calendar times as logs and `status` show them (UTC).
//!
//! Everything here is pure: the state store, the providers and the CLI all
//! build on these types, so none of them may depend on anything but data.

pub mod actions;
pub mod charm;
pub mod constraints;
pub mod duration;
pub mod life;
pub mod names;
pub mod series;
pub mod time;
pub mod yaml;

pub use constraints::Constraints;
pub use life::Life;

/// Everything that can be wrong with a value given to the model.
///
/// Messages are lowercase, quote names with backticks and say how to fix the
/// input; callers prefix them with `error: `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("invalid {kind} name `{name}`: {why}")]
    InvalidName {
        kind: &'static str,
        name: String,
        why: &'static str,
    },
    #[error("invalid series `{0}`: a series is a lowercase word such as `jammy` or `noble`")]
    InvalidSeries(String),
    #[error(
        "unknown series `{0}`: jujube knows Ubuntu's series from `{first}` ({first_v}) to \
         `{last}` ({last_v}), e.g. `jammy` or `noble`; to use another, add it to the \
         environment's `{key}` config (`jujube set-environment {key}={0}`, or \
         `--config {key}={0}` when bootstrapping)",
        first = series::KNOWN[0].0,
        first_v = series::KNOWN[0].1,
        last = series::KNOWN[series::KNOWN.len() - 1].0,
        last_v = series::KNOWN[series::KNOWN.len() - 1].1,
        key = series::EXTRA_SERIES_KEY
    )]
    UnknownSeries(String),
    #[error("malformed constraint `{0}`: write constraints as key=value, e.g. `mem=4G`; a space inside a value is written `\\ `, e.g. `zones=Availability\\ zone\\ 1`")]
    MalformedConstraint(String),
    #[error(
        "unknown constraint `{key}`: valid constraints are {}",
        constraints::KEYS_LIST
    )]
    UnknownConstraint { key: String },
    #[error("constraints of {len} bytes are more than {max}; shorten them")]
    ConstraintsTooLong { len: usize, max: usize },
    #[error("constraint `{key}` is given twice: give each constraint once")]
    DuplicateConstraint { key: String },
    #[error("invalid constraint `{key}={value}`: {why}")]
    InvalidConstraint {
        key: String,
        value: String,
        why: String,
    },
    #[error("invalid charm `{charm}`: {why}")]
    InvalidCharm { charm: String, why: String },
    #[error(
        "cannot parse `{file}`{}: {why}; fix it and deploy again",
        .line.map(|l| format!(" at line {l}")).unwrap_or_default()
    )]
    CharmFile {
        file: String,
        line: Option<usize>,
        why: String,
    },
    #[error("invalid value `{value}` for option `{key}`: {why}")]
    InvalidSetting {
        key: String,
        value: String,
        why: String,
    },
    #[error("unknown option `{key}` for charm `{charm}`: the charm's options are {options}")]
    UnknownSetting {
        key: String,
        charm: String,
        options: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
