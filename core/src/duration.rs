//! Durations as users write them: `250ms`, `2s`, `5m`, `1h`, or a bare
//! number of seconds.

use std::time::Duration;

pub fn parse(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().ok()?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return None,
    };
    // `try_`: a number past what a `Duration` holds is refused, not a panic.
    Duration::try_from_secs_f64(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse("1.5m"), Some(Duration::from_secs(90)));
        assert_eq!(parse("1h"), Some(Duration::from_secs(3600)));
        for bad in ["", "s", "2d", "-1s", "x1", "99999999999999999999h", "1e400"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
