//! Names as users type them: services, units, machines and relation
//! endpoints. Unit and machine identifiers are assigned by jujube; users only
//! ever name existing ones.

use crate::{Error, Result};

/// Validates a service name: lowercase letters and digits in hyphen-separated
/// words, starting with a letter, where no word is all digits (so that
/// `wordpress-2/0` can never be confused with a unit number).
pub fn validate_service(name: &str) -> Result<()> {
    let err = |why| {
        Err(Error::InvalidName {
            kind: "service",
            name: name.to_string(),
            why,
        })
    };
    if name.is_empty() || name.len() > 63 {
        return err("a service name has 1 to 63 characters");
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return err("a service name starts with a lowercase letter");
    }
    for word in name.split('-') {
        if word.is_empty() {
            return err("hyphens separate words and may not repeat or end the name");
        }
        if !word
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        {
            return err("use lowercase letters, digits and hyphens only");
        }
        if word.chars().all(|c| c.is_ascii_digit()) {
            return err("no hyphen-separated word may be only digits");
        }
    }
    Ok(())
}

/// Validates an environment name: lowercase letters, digits and single
/// hyphens, starting with a letter (it names a directory and tags instances).
pub fn validate_environment(name: &str) -> Result<()> {
    let ok = name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-')
        && !name.contains("--");
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            kind: "environment",
            name: name.to_string(),
            why: "use lowercase letters, digits and hyphens, starting with a letter",
        })
    }
}

/// Validates a user name (Juju's rule): letters, digits, `.`, `+` and
/// `-`, starting and ending with a letter or digit, at most 64 characters.
pub fn validate_user(name: &str) -> Result<()> {
    let ends_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = name.len() <= 64
        && ends_ok(name.chars().next())
        && ends_ok(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            kind: "user",
            name: name.to_string(),
            why: "use letters, digits, `.`, `+` and `-`, starting and ending with a letter or digit, at most 64 characters",
        })
    }
}

/// Validates a relation name as it appears in charm metadata.
pub fn validate_relation(name: &str) -> Result<()> {
    let ok = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        && !name.ends_with(['-', '_']);
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            kind: "relation",
            name: name.to_string(),
            why:
                "a relation name is lowercase letters, digits, `-` and `_`, starting with a letter",
        })
    }
}

/// A unit name `service/N`, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitName<'a> {
    pub service: &'a str,
    pub number: u64,
}

pub fn parse_unit(name: &str) -> Result<UnitName<'_>> {
    let err = || Error::InvalidName {
        kind: "unit",
        name: name.to_string(),
        why: "a unit is named `service/N`, e.g. `wordpress/0`",
    };
    let (service, number) = name.split_once('/').ok_or_else(err)?;
    validate_service(service).map_err(|_| err())?;
    if number.is_empty() || (number.len() > 1 && number.starts_with('0')) {
        return Err(err());
    }
    let number = number.parse().map_err(|_| err())?;
    Ok(UnitName { service, number })
}

/// Parses a machine id: a non-negative decimal number without leading zeros.
pub fn parse_machine(id: &str) -> Result<i64> {
    let err = || Error::InvalidName {
        kind: "machine",
        name: id.to_string(),
        why: "a machine id is a number such as `0` or `12`",
    };
    if id.is_empty() || (id.len() > 1 && id.starts_with('0')) {
        return Err(err());
    }
    let n: i64 = id.parse().map_err(|_| err())?;
    if n < 0 {
        return Err(err());
    }
    Ok(n)
}

/// An endpoint as typed on the command line: `service` or `service:relation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    pub service: String,
    pub relation: Option<String>,
}

pub fn parse_endpoint(spec: &str) -> Result<EndpointSpec> {
    let (service, relation) = match spec.split_once(':') {
        Some((s, r)) => (s, Some(r)),
        None => (spec, None),
    };
    validate_service(service).map_err(|_| Error::InvalidName {
        kind: "endpoint",
        name: spec.to_string(),
        why: "an endpoint is `service` or `service:relation`, e.g. `wordpress:db`",
    })?;
    if let Some(r) = relation {
        validate_relation(r)?;
    }
    Ok(EndpointSpec {
        service: service.to_string(),
        relation: relation.map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_names() {
        for ok in ["wordpress", "my-sql", "a1", "web-2a", "x"] {
            validate_service(ok).unwrap();
        }
        for bad in ["", "Wordpress", "1abc", "wp-2", "a--b", "a-", "wp_x", "a/b"] {
            assert!(validate_service(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn environment_names() {
        for ok in ["demo", "demo-1795283624", "a1"] {
            validate_environment(ok).unwrap();
        }
        for bad in ["", "Demo", "1demo", "de--mo", "demo-", "de mo", "../x"] {
            assert!(validate_environment(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unit_names() {
        assert_eq!(
            parse_unit("wordpress/12").unwrap(),
            UnitName {
                service: "wordpress",
                number: 12
            }
        );
        for bad in [
            "wordpress",
            "wordpress/",
            "wordpress/01",
            "/0",
            "wordpress/-1",
            "Wp/0",
        ] {
            assert!(parse_unit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn machine_ids() {
        assert_eq!(parse_machine("0").unwrap(), 0);
        assert_eq!(parse_machine("17").unwrap(), 17);
        for bad in ["", "-1", "01", "a", "1.0"] {
            assert!(parse_machine(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn endpoints() {
        let e = parse_endpoint("wordpress:db").unwrap();
        assert_eq!(e.service, "wordpress");
        assert_eq!(e.relation.as_deref(), Some("db"));
        assert_eq!(parse_endpoint("mysql").unwrap().relation, None);
        assert!(parse_endpoint("wordpress:").is_err());
        assert!(parse_endpoint("Word:db").is_err());
    }
}
