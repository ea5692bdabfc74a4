//! OS series. A series is set when a service, unit or machine is created and
//! never changes; charms for series X only ever run on series X.

use crate::{Error, Result};

/// The series an environment uses when neither the user nor a charm says.
pub const DEFAULT_SERIES: &str = "jammy";

/// Checks that `s` is a plausible series name (a lowercase word, digits
/// allowed after the first letter). Which series a provider can actually
/// start is the provider's business.
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

#[cfg(test)]
mod tests {
    #[test]
    fn series_names() {
        for ok in ["jammy", "noble", "centos7", "win2012"] {
            super::validate(ok).unwrap();
        }
        for bad in ["", "Jammy", "7jammy", "jam my", "jam-my"] {
            assert!(super::validate(bad).is_err(), "{bad}");
        }
    }
}
