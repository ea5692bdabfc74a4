//! A token bucket on tokio's clock (so tests can pause time): `burst` tokens,
//! refilled at `per_second`.

use tokio::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct TokenBucket {
    burst: f64,
    per_second: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(burst: u32, per_second: f64) -> TokenBucket {
        TokenBucket {
            burst: burst as f64,
            per_second,
            tokens: burst as f64,
            last: Instant::now(),
        }
    }

    /// Parses `BURST/PER_SECOND`, e.g. `1000/2`.
    pub fn parse(s: &str) -> Option<TokenBucket> {
        let (b, r) = s.split_once('/')?;
        let (b, r): (u32, f64) = (b.trim().parse().ok()?, r.trim().parse().ok()?);
        (b > 0 && r >= 0.0 && r.is_finite()).then(|| TokenBucket::new(b, r))
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.per_second).min(self.burst);
        self.last = now;
    }

    /// Tokens added per second.
    pub fn per_second(&self) -> f64 {
        self.per_second
    }

    /// Takes `n` tokens if there are that many.
    pub fn try_take(&mut self, n: u32) -> bool {
        self.refill();
        if self.tokens >= n as f64 {
            self.tokens -= n as f64;
            true
        } else {
            false
        }
    }

    /// Tokens available now (rounded down).
    pub fn available(&mut self) -> u32 {
        self.refill();
        self.tokens.floor() as u32
    }

    /// How long until `n` tokens are available (zero if they are now).
    pub fn wait_for(&mut self, n: u32) -> Duration {
        self.refill();
        let missing = n as f64 - self.tokens;
        if missing <= 0.0 {
            Duration::ZERO
        } else if self.per_second <= 0.0 {
            Duration::MAX
        } else {
            Duration::from_secs_f64(missing / self.per_second)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn refills_at_the_given_rate_up_to_the_burst() {
        let mut b = TokenBucket::parse("5/2").unwrap();
        assert!(b.try_take(5));
        assert!(!b.try_take(1));
        assert_eq!(b.wait_for(1), Duration::from_millis(500));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.available(), 2);
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(b.available(), 5);
        assert!(TokenBucket::parse("0/1").is_none());
        assert!(TokenBucket::parse("x").is_none());
    }
}
