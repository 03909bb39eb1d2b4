//! The designs compared in one run: tether (incarnation leases, this
//! version), tether 0.1 (per-stream leases, the version it replaces) and the
//! seed design's parameters (per-stream leases, 60 s orphan scan, no
//! rebalancing — emulated by tether 0.1 with those settings).

use crate::Ctx;
use std::path::PathBuf;
use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions};
use tether_testkit::processes::FleetConfig;

/// Where a worker is poked (`--advertise-ip`).
pub const ADVERTISE_IP: &str = "TETHER_ADVERTISE_IP";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Design {
    Tether,
    Today,
    Seed,
    /// Another tether build (`Ctx::baseline`), with tether's timings.
    Baseline,
}

impl Design {
    pub const ALL: [Design; 3] = [Design::Tether, Design::Today, Design::Seed];

    /// Every design, and the baseline build when one is given.
    pub fn measured(ctx: &Ctx) -> Vec<Design> {
        Design::ALL
            .into_iter()
            .chain(ctx.baseline.is_some().then_some(Design::Baseline))
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Design::Tether => "tether",
            Design::Today => "tether-0.1",
            Design::Baseline => "tether-baseline",
            Design::Seed => "seed",
        }
    }

    /// Lease, heartbeat, orphan-scan interval.
    pub fn timings(self, ctx: &Ctx) -> (Duration, Duration, Duration) {
        let p = &ctx.profile;
        match self {
            Design::Tether | Design::Baseline => (p.lease, p.heartbeat, p.reconcile),
            Design::Today => (p.v1_lease, p.v1_heartbeat, p.reconcile),
            Design::Seed => (p.v1_lease, p.v1_heartbeat, p.seed_reconcile),
        }
    }

    fn exe(self, ctx: &Ctx) -> PathBuf {
        match self {
            Design::Tether => ctx.exe.clone(),
            Design::Baseline => ctx
                .baseline
                .clone()
                .expect("the baseline design runs only with TETHER_BENCH_BASELINE_BIN"),
            Design::Today | Design::Seed => ctx.legacy.clone(),
        }
    }

    /// A bed whose table suits the design.
    pub async fn bed(self, ctx: &Ctx, rate: u32, namespace: &str) -> anyhow::Result<Bed> {
        let options = BedOptions {
            rate,
            first_seq: 1,
            namespace: namespace.into(),
            legacy_table: matches!(self, Design::Today | Design::Seed).then(|| ctx.legacy.clone()),
            ..BedOptions::default()
        };
        Bed::start(self.exe(ctx), options).await
    }

    /// Fleet settings of the design on `bed`'s table, its store traffic to `endpoint`.
    pub fn fleet(self, ctx: &Ctx, bed: &Bed, endpoint: &str) -> FleetConfig {
        let (lease, heartbeat, reconcile) = self.timings(ctx);
        let mut fleet = FleetConfig::fast(self.exe(ctx), endpoint, bed.store.table(), &bed.log_dir);
        fleet.workers.lease_duration = lease;
        fleet.workers.heartbeat_interval = heartbeat;
        fleet.workers.reconcile_interval = reconcile;
        fleet.workers.fence_margin = Duration::from_secs(1);
        fleet.workers.drain_timeout = Duration::from_secs(10);
        match self {
            // As the chart runs them: peers poke each other (a build that
            // does not know the variable ignores it).
            Design::Tether | Design::Baseline => {
                fleet.env.push((ADVERTISE_IP.into(), "127.0.0.1".into()))
            }
            Design::Today => fleet.extra_args = vec!["--max-clock-skew".into(), "2s".into()],
            Design::Seed => {
                fleet.extra_args = vec![
                    "--max-clock-skew".into(),
                    "2s".into(),
                    "--no-rebalance".into(),
                ]
            }
        }
        fleet
    }
}
