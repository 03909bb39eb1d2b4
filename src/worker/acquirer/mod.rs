//! Taking streams: the acquisition pass (`pass`), the audit of its own
//! partitions (`audit`, when in `audit_schedule`), fair share (`fair_share`,
//! with the total a giver counts in `peak_total`),
//! reading peers and the fleet view (`peers`), declaring the overdue dead on
//! this worker's monotonic clock (`overdue`, with when a watched peer is next
//! read in `renewal_forecast`), what departed incarnations left
//! (`departed`), the pace of acquires (`pacing`), which orphan partitions a
//! pass reads (`rotation`) and how much of each (`sampling`), and when a pass may skip
//! the fleet's reads (`quiet`, with what it remembers in `quiet_state`).

mod audit;
mod audit_schedule;
mod departed;
mod fair_share;
mod overdue;
mod pacing;
mod pass;
mod peak_total;
mod peers;
mod quiet;
mod quiet_state;
mod renewal_forecast;
mod rotation;
mod sampling;

pub(super) use pass::{Acquired, Acquirer};
