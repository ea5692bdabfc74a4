//! OS series. A series is set when a service, unit or machine is created and
//! never changes; charms for series X only ever run on series X.
//!
//! jujube knows one list of series, [`KNOWN`] (Ubuntu's releases by
//! codename); a series outside it is refused wherever one is chosen (deploy,
//! add-machine, bootstrap), unless the environment adds it in its
//! [`EXTRA_SERIES_KEY`] config key, for a release newer than this jujube or
//! an image of one's own.

use crate::{Error, Result};

/// The series an environment uses when neither the user nor a charm says.
pub const DEFAULT_SERIES: &str = "jammy";

/// Every series jujube knows, oldest first, with its Ubuntu version.
pub const KNOWN: [(&str, &str); 29] = [
    ("precise", "12.04"),
    ("quantal", "12.10"),
    ("raring", "13.04"),
    ("saucy", "13.10"),
    ("trusty", "14.04"),
    ("utopic", "14.10"),
    ("vivid", "15.04"),
    ("wily", "15.10"),
    ("xenial", "16.04"),
    ("yakkety", "16.10"),
    ("zesty", "17.04"),
    ("artful", "17.10"),
    ("bionic", "18.04"),
    ("cosmic", "18.10"),
    ("disco", "19.04"),
    ("eoan", "19.10"),
    ("focal", "20.04"),
    ("groovy", "20.10"),
    ("hirsute", "21.04"),
    ("impish", "21.10"),
    ("jammy", "22.04"),
    ("kinetic", "22.10"),
    ("lunar", "23.04"),
    ("mantic", "23.10"),
    ("noble", "24.04"),
    ("oracular", "24.10"),
    ("plucky", "25.04"),
    ("questing", "25.10"),
    ("resolute", "26.04"),
];

/// The environment config key that adds series to [`KNOWN`]:
/// comma-separated series names, e.g. `extra-series=centos9,mybuntu`.
pub const EXTRA_SERIES_KEY: &str = "extra-series";

/// Checks that `s` is a plausible series name (a lowercase word, digits
/// allowed after the first letter). Whether jujube knows it is
/// [`check_known`]'s business.
pub fn validate(s: &str) -> Result<()> {
    let mut chars = s.chars();
    let ok = matches!(chars.next(), Some(c) if c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && s.len() <= 32;
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidSeries(s.to_string()))
    }
}

/// Parses the value of [`EXTRA_SERIES_KEY`]: series names separated by
/// commas (spaces around them allowed), each a plausible series name.
pub fn parse_extra(value: &str) -> Result<Vec<String>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| validate(s).map(|()| s.to_string()))
        .collect()
}

/// Checks that `s` is a series jujube knows, or one of `extra` (the
/// environment's [`EXTRA_SERIES_KEY`]).
pub fn check_known(s: &str, extra: &[String]) -> Result<()> {
    validate(s)?;
    if KNOWN.iter().any(|(k, _)| *k == s) || extra.iter().any(|e| e == s) {
        Ok(())
    } else {
        Err(Error::UnknownSeries(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_names() {
        for ok in ["jammy", "noble", "centos7", "win2012"] {
            validate(ok).unwrap();
        }
        for bad in ["", "Jammy", "7jammy", "jam my", "jam-my"] {
            assert!(validate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_known_series_and_the_environments_extra_ones_are_accepted() {
        check_known("jammy", &[]).unwrap();
        check_known("noble", &[]).unwrap();
        let err = check_known("nosuch", &[]).unwrap_err();
        assert_eq!(err, Error::UnknownSeries("nosuch".into()));
        assert_eq!(
            err.to_string(),
            "unknown series `nosuch`: jujube knows Ubuntu's series from `precise` (12.04) to \
             `resolute` (26.04), e.g. `jammy` or `noble`; to use another, add it to the \
             environment's `extra-series` config (`jujube set-environment extra-series=nosuch`, \
             or `--config extra-series=nosuch` when bootstrapping)"
        );
        let extra = parse_extra("nosuch, centos9").unwrap();
        assert_eq!(extra, ["nosuch", "centos9"]);
        check_known("nosuch", &extra).unwrap();
        // The format is still checked for extra series.
        assert!(matches!(
            check_known("No Such", &["No Such".into()]),
            Err(Error::InvalidSeries(_))
        ));
        assert!(matches!(
            parse_extra("ok,Not-OK"),
            Err(Error::InvalidSeries(s)) if s == "Not-OK"
        ));
        assert_eq!(parse_extra("").unwrap(), Vec::<String>::new());
    }
}
