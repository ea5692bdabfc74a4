//! Provisioner settings, read from environment config so that a running
//! controller picks up `set-environment` changes.
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `provisioner-concurrency` | start requests in flight at once, for the whole controller | `8` |
//! | `provisioner-batch` | machines per start request | the provider's preference: `64`, `1` on LXD |
//! | `provisioner-rate` | client-side request limit, `BURST/PER_SECOND`, the rate above 0 | none |
//! | `provisioner-retry-for` | how long transient errors are retried before a machine is marked in error | `5m` |
//! | `harvest-mode` | which stray instances are reaped: `none`, `destroyed`, `unknown`, `all` | `unknown` |
//! | `harvest-grace` | how long a stray is left alone after it is first seen (an adoption window; kept across restarts, restarted on a change of class) | `5m` |
//! | `harvest-max-per-pass` | strays reaped per pass at most | `10` |
//! | `harvest-interval` | how often instances are listed to find strays and instances that are gone | `30s` |

use crate::Error;
use jujube_core::duration;
use std::collections::BTreeMap;
use std::time::Duration;

/// Which stray instances (tagged with this environment's UUID, owned by no
/// machine) are reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HarvestMode {
    /// None: strays are only reported.
    None,
    /// Only strays whose machine jujube removed.
    Destroyed,
    /// Every stray no machine owns: removed machines' and never-known ones.
    Unknown,
    /// As `unknown`, plus instances left by failed starts of machines that
    /// are in error.
    All,
}

impl HarvestMode {
    pub fn parse(s: &str) -> Option<HarvestMode> {
        match s {
            "none" => Some(HarvestMode::None),
            "destroyed" => Some(HarvestMode::Destroyed),
            "unknown" => Some(HarvestMode::Unknown),
            "all" => Some(HarvestMode::All),
            _ => None,
        }
    }

    /// Whether a stray of `class` (`destroyed`, `unknown`, `errored`) is reaped.
    pub fn reaps(self, class: &str) -> bool {
        match self {
            HarvestMode::None => false,
            HarvestMode::Destroyed => class == "destroyed",
            HarvestMode::Unknown => class == "destroyed" || class == "unknown",
            HarvestMode::All => true,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub concurrency: usize,
    pub batch: usize,
    pub rate: Option<String>,
    pub retry_for: Duration,
    pub harvest: HarvestMode,
    pub grace: Duration,
    pub harvest_cap: usize,
    pub list_interval: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            concurrency: 8,
            batch: 64,
            rate: None,
            retry_for: Duration::from_secs(300),
            harvest: HarvestMode::Unknown,
            grace: Duration::from_secs(300),
            harvest_cap: 10,
            list_interval: Duration::from_secs(30),
        }
    }
}

impl Config {
    pub fn from_env(cfg: &BTreeMap<String, String>) -> Result<Config, Error> {
        let mut c = Config::default();
        let bad = |k: &str, v: &str, want: &str| Error::Config(format!("`{k}={v}`: {want}"));
        let dur = |k: &str, v: &str| {
            duration::parse(v).ok_or_else(|| {
                bad(
                    k,
                    v,
                    "use a duration such as `30s` or `5m`, at most 87600h (ten years)",
                )
            })
        };
        let count = |k: &str, v: &str| {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad(k, v, "use a whole number above 0"))
        };
        for (k, v) in cfg {
            match k.as_str() {
                "provisioner-concurrency" => c.concurrency = count(k, v)?,
                "provisioner-batch" => c.batch = count(k, v)?,
                "provisioner-rate" => {
                    let bucket = jujube_providers::bucket::TokenBucket::parse(v)
                        .ok_or_else(|| bad(k, v, "use BURST/PER_SECOND, e.g. `5/2`"))?;
                    // A bucket that never refills would stop provisioning for
                    // good once its burst is spent.
                    if bucket.per_second() <= 0.0 {
                        return Err(bad(
                            k,
                            v,
                            "the refill rate must be above 0 (a bucket that never refills stops provisioning for good); use e.g. `5/2`, or remove the key for no limit",
                        ));
                    }
                    c.rate = Some(v.clone());
                }
                "provisioner-retry-for" => c.retry_for = dur(k, v)?,
                "harvest-mode" => {
                    c.harvest = HarvestMode::parse(v)
                        .ok_or_else(|| bad(k, v, "use none, destroyed, unknown or all"))?
                }
                "harvest-grace" => c.grace = dur(k, v)?,
                "harvest-max-per-pass" => c.harvest_cap = count(k, v)?,
                "harvest-interval" => c.list_interval = dur(k, v)?,
                k if k.starts_with("provisioner-") || k.starts_with("harvest-") => {
                    return Err(Error::Config(format!(
                        "unknown key `{k}`; README.md lists the keys"
                    )))
                }
                _ => {}
            }
        }
        Ok(c)
    }
}
