//! Flags to settings: the one place where clap's argument types meet the
//! domain's settings, so the worker and the controller know nothing of the
//! command line (they are driven the same way by the test kit and the bench).

use crate::config::{ControllerArgs, WorkerArgs};
use crate::controller::ControllerSettings;
use crate::lease::valid_worker_id;
use crate::worker::{WorkerError, WorkerSettings, default_worker_id, fence_window};

/// `tether worker`'s and `tether operator`'s worker flags, checked.
pub(super) fn worker_settings(args: &WorkerArgs) -> Result<WorkerSettings, WorkerError> {
    let WorkerArgs {
        worker_id,
        lease_duration,
        heartbeat_interval,
        reconcile_interval,
        max_clock_skew,
        fence_margin,
        max_connections,
        metrics_addr: _,
        advertise_ip: _,
        drain_timeout,
        allow_hosts: _,
        allow_sink_hosts: _,
        kinesis_streams,
        deny_cidrs: _,
        no_rebalance,
        ca_file,
        connect_rate,
        connect_burst,
        emf_namespace: _,
        emf_interval: _,
    } = args;
    if !(connect_rate.is_finite() && *connect_rate >= 0.0) {
        return Err(WorkerError::Settings(format!(
            "--connect-rate {connect_rate}: use a number of connects per second, 0 for no limit"
        )));
    }
    if heartbeat_interval.is_zero() || reconcile_interval.is_zero() {
        return Err(WorkerError::Settings(
            "--heartbeat-interval and --reconcile-interval must be positive".into(),
        ));
    }
    let fence_window = fence_window(*lease_duration, *fence_margin, *heartbeat_interval)
        .map_err(WorkerError::Settings)?;
    let worker_id = worker_id.clone().unwrap_or_else(default_worker_id);
    if !valid_worker_id(&worker_id) {
        return Err(WorkerError::Settings(format!(
            "--worker-id '{worker_id}': use at most 128 letters, digits, '.', '_' or '-'"
        )));
    }
    Ok(WorkerSettings {
        worker_id,
        lease_duration: *lease_duration,
        heartbeat_interval: *heartbeat_interval,
        reconcile_interval: *reconcile_interval,
        fence_window,
        max_clock_skew: *max_clock_skew,
        max_connections: *max_connections,
        drain_timeout: *drain_timeout,
        rebalance: !no_rebalance,
        ca_file: ca_file.clone(),
        connect_rate: *connect_rate,
        connect_burst: *connect_burst,
        kinesis_streams: crate::egress::KinesisStreams::new(kinesis_streams.clone()),
        read_orphans_whole: false,
        // Set once the metrics listener is bound (its port).
        poke_addr: None,
    })
}

/// `tether operator`'s controller flags.
pub(super) fn controller_settings(instance: &str, args: &ControllerArgs) -> ControllerSettings {
    ControllerSettings {
        instance: instance.to_string(),
        installation: args.installation.clone(),
        namespaces: args
            .watch_namespaces
            .iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect(),
        status_refresh: args.status_refresh,
        progress_interval: args.status_progress_interval,
        leader_namespace: args.leader_namespace.clone(),
        leader_lease: args.leader_lease,
        gc_grace: args.gc_grace,
    }
}
