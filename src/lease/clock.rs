//! Measuring this machine's clock against DynamoDB's.
//!
//! Ownership under this protocol never compares wall clocks across machines
//! (death is observed on each worker's monotonic clock). Two things still use
//! wall-clock time: taking over a version-1 lease during a rolling upgrade, and
//! the lease times people read. So every DynamoDB response's `Date` header is
//! compared with the local clock: the header has one-second resolution and the
//! request took a round trip, so each sample bounds the offset to an interval,
//! and the intervals of recent samples are intersected. A worker whose clock is
//! provably off by more than `--max-clock-skew` refuses to acquire and says so
//! (`/readyz`, `tether_clock_skew_exceeded`, a log line).

use crate::support::lock;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Samples whose intervals are intersected.
const SAMPLES: usize = 16;
/// Resolution of the HTTP `Date` header.
const DATE_RESOLUTION_MS: i64 = 1000;

/// Wall-clock milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `local - server` in milliseconds is within `[low, high]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetBounds {
    pub low: i64,
    pub high: i64,
}

impl OffsetBounds {
    /// From one exchange: sent and received on the local clock, `date` from the server.
    pub fn from_exchange(sent_ms: i64, received_ms: i64, date_ms: i64) -> Self {
        Self {
            low: sent_ms - (date_ms + DATE_RESOLUTION_MS),
            high: received_ms - date_ms,
        }
    }

    pub fn midpoint(&self) -> i64 {
        (self.low + self.high) / 2
    }

    /// Whether the offset is provably larger than `budget` either way.
    pub fn exceeds(&self, budget: Duration) -> bool {
        let b = budget.as_millis() as i64;
        self.low > b || self.high < -b
    }
}

/// The running estimate, shared by every clone of a store.
#[derive(Debug, Default)]
pub struct ClockGauge {
    samples: Mutex<Vec<OffsetBounds>>,
}

impl ClockGauge {
    pub fn record(&self, sample: OffsetBounds) {
        let mut samples = lock(&self.samples);
        samples.push(sample);
        if samples.len() > SAMPLES {
            samples.remove(0);
        }
    }

    /// The intersection of recent samples; the newest alone when they disagree
    /// (the clock was stepped). `None` before the first response.
    pub fn bounds(&self) -> Option<OffsetBounds> {
        let samples = lock(&self.samples);
        let last = *samples.last()?;
        let low = samples.iter().map(|s| s.low).max()?;
        let high = samples.iter().map(|s| s.high).min()?;
        Some(if low <= high {
            OffsetBounds { low, high }
        } else {
            last
        })
    }

    /// The store's clock as best known (ms): local time corrected by the
    /// middle of the offset bounds (within about a second of the store's).
    /// Change stamps use it, so stamps from machines whose clocks disagree
    /// still line up.
    pub fn store_now(&self) -> u64 {
        let offset = self.bounds().map_or(0, |b| b.midpoint());
        (now_ms() as i64 - offset).max(0) as u64
    }

    /// A time the store's clock has certainly reached (ms): local time minus
    /// however far ahead this clock may be. Used to judge version-1 expiries.
    pub fn store_now_at_least(&self) -> u64 {
        let ahead = self.bounds().map_or(0, |b| b.high.max(0)) as u64;
        now_ms().saturating_sub(ahead)
    }
}

#[derive(Debug, Clone, Copy)]
struct SentAt(i64);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

/// Records every DynamoDB exchange in a [`ClockGauge`].
#[derive(Debug)]
pub struct ClockInterceptor(pub Arc<ClockGauge>);

impl Intercept for ClockInterceptor {
    fn name(&self) -> &'static str {
        "tether-clock-offset"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state().store_put(SentAt(now_ms() as i64));
        Ok(())
    }

    fn read_after_transmit(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let received = now_ms() as i64;
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|d| chrono::DateTime::parse_from_rfc2822(d).ok());
        if let (Some(SentAt(sent)), Some(date)) = (cfg.load::<SentAt>().copied(), date) {
            self.0.record(OffsetBounds::from_exchange(
                sent,
                received,
                date.timestamp_millis(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_exchange_bounds_the_offset_by_the_round_trip_and_the_header_resolution() {
        // Sent at 10.000 s, answered at 10.050 s local; the server said 07 s.
        let b = OffsetBounds::from_exchange(10_000, 10_050, 7_000);
        assert_eq!((b.low, b.high), (2_000, 3_050));
        assert!(b.exceeds(Duration::from_millis(1_500)));
        assert!(!b.exceeds(Duration::from_secs(2)), "2 s is not proven");
        assert!(
            !OffsetBounds::from_exchange(10_000, 10_050, 10_000).exceeds(Duration::from_secs(1))
        );
        assert!(
            OffsetBounds::from_exchange(10_000, 10_050, 14_000).exceeds(Duration::from_secs(2))
        );
    }

    #[test]
    fn samples_narrow_the_interval_and_a_stepped_clock_resets_it() {
        let g = ClockGauge::default();
        assert_eq!(g.bounds(), None);
        g.record(OffsetBounds {
            low: -900,
            high: 100,
        });
        g.record(OffsetBounds {
            low: -200,
            high: 600,
        });
        assert_eq!(
            g.bounds(),
            Some(OffsetBounds {
                low: -200,
                high: 100
            })
        );
        g.record(OffsetBounds {
            low: 4_000,
            high: 5_000,
        });
        assert_eq!(
            g.bounds(),
            Some(OffsetBounds {
                low: 4_000,
                high: 5_000
            })
        );
    }
}
