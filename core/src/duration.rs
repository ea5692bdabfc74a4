//! Durations as users write them: `250ms`, `2s`, `5m`, `1h`, or a bare
//! number of seconds; at most [`MAX`].

use std::time::Duration;

/// The longest duration taken: ten years (87,600 h). Longer means "never"
/// to a user, and would overflow what it is added to (a clock's instant,
/// milliseconds since the epoch).
pub const MAX: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// `s` as a duration, or `None` when it is none or longer than [`MAX`].
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
    Duration::try_from_secs_f64(secs).ok().filter(|d| *d <= MAX)
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
        assert_eq!(parse("87600h"), Some(MAX));
        for bad in [
            "",
            "s",
            "2d",
            "-1s",
            "x1",
            "99999999999999999999h",
            "1e400",
            "87601h",
            "10000000000000000000",
            "9223372036854775s",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
