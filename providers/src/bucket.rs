//! A token bucket on tokio's clock (so tests can pause time): `burst` tokens,
//! refilled at `per_second`; and [`ec2_limits`], the buckets EC2 documents.

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

    /// Takes `n` tokens if there are that many (zero wait), else says how
    /// long until there will be.
    pub fn take_or_wait(&mut self, n: u32) -> Duration {
        let wait = self.wait_for(n);
        if wait.is_zero() {
            self.tokens -= n as f64;
        }
        wait
    }

    /// Takes `n` tokens now, going into debt if there are fewer, and says
    /// how long until the debt is paid: a client that waits its turn at this
    /// bucket's rate (a FIFO pacer) is done after that long.
    pub fn reserve(&mut self, n: u32) -> Duration {
        self.refill();
        self.tokens -= n as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else if self.per_second <= 0.0 {
            Duration::MAX
        } else {
            Duration::from_secs_f64(-self.tokens / self.per_second)
        }
    }

    pub fn burst(&self) -> u32 {
        self.burst as u32
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

/// Client-side pacing of launches at RunInstances' documented request and
/// resource rates: past the burst, a launch waits its turn (first come, first
/// served) for one request token and one token per instance, instead of
/// being throttled. The EC2 provider paces its launches with it, and the
/// dummy cloud in `dummy-throttling=ec2` mode paces the same way, so that
/// what the dummy measures is what the EC2 provider does.
#[derive(Debug)]
pub struct LaunchPacer(tokio::sync::Mutex<(TokenBucket, TokenBucket)>);

impl LaunchPacer {
    pub fn ec2() -> LaunchPacer {
        let (b, r) = ec2_limits::RUN_INSTANCES;
        let (rb, rr) = ec2_limits::RUN_INSTANCES_RESOURCE;
        LaunchPacer(tokio::sync::Mutex::new((
            TokenBucket::new(b, r),
            TokenBucket::new(rb, rr),
        )))
    }

    /// Waits until a launch of `count` instances is paid for.
    pub async fn pace(&self, count: u32) {
        let wait = {
            let mut p = self.0.lock().await;
            p.0.reserve(1).max(p.1.reserve(count))
        };
        if !wait.is_zero() {
            // A millisecond more: the cloud's bucket, refilled at the same
            // rate, must hold the tokens when the request arrives.
            tokio::time::sleep(wait + Duration::from_millis(1)).await;
        }
    }
}

/// EC2's API throttling as AWS documents it, per account and region, as
/// `(bucket maximum capacity, refill per second)`: "Request throttling for
/// the Amazon EC2 API",
/// <https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html>.
/// Every request takes one token from its API's request bucket; RunInstances
/// and TerminateInstances also take one token per instance from a resource
/// bucket ("you can immediately launch 1000 instances, using any number of
/// API requests, such as one request for 1000 instances or four requests
/// for 250 instances"). A request either bucket cannot cover fails whole
/// with `RequestLimitExceeded`. The dummy cloud charges exactly these
/// (`dummy-ec2-throttling`), and the EC2 provider paces its CreateTags calls
/// with [`CREATE_TAGS`].
pub mod ec2_limits {
    /// RunInstances requests (a resource-intensive action).
    pub const RUN_INSTANCES: (u32, f64) = (50, 5.0);
    /// Instances launched by RunInstances.
    pub const RUN_INSTANCES_RESOURCE: (u32, f64) = (1000, 2.0);
    /// TerminateInstances requests (a mutating action).
    pub const TERMINATE_INSTANCES: (u32, f64) = (50, 5.0);
    /// Instances terminated by TerminateInstances.
    pub const TERMINATE_INSTANCES_RESOURCE: (u32, f64) = (1000, 20.0);
    /// DescribeInstances with filters (a non-mutating action).
    pub const DESCRIBE_INSTANCES: (u32, f64) = (100, 20.0);
    /// CreateTags requests (a mutating action).
    pub const CREATE_TAGS: (u32, f64) = (50, 5.0);
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
