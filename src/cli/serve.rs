//! The long-running subcommands: `worker`, `operator`, `local-store`.

use super::demo::feed::{Feed, FeedOptions};
use super::settings::{controller_settings, worker_settings};
use super::signal::shutdown_signal;
use super::store::{OpenStore, open_store};
use crate::config::{OperatorArgs, StoreArgs, WorkerArgs};
use crate::egress::HostPolicy;
use crate::embedded::EmbeddedStore;
use crate::lease::Caller;
use crate::metrics::Metrics;
use crate::probes::Health;
use crate::secrets::SecretSource;
use crate::worker::WorkerCtx;
use crate::worker::{PodLookup, Provenance};
use anyhow::{Context, bail};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// `tether local-store`: serve the embedded store until SIGINT/SIGTERM.
pub(super) async fn local_store(listen: SocketAddr, data: &Path) -> anyhow::Result<()> {
    let mut server = EmbeddedStore::start(Some(data), listen).await?;
    println!(
        "embedded DynamoDB-compatible store listening on {}",
        server.endpoint()
    );
    println!("  export AWS_ENDPOINT_URL_DYNAMODB={}", server.endpoint());
    tokio::select! {
        reason = server.stopped() => bail!("{reason}"),
        _ = shutdown_signal() => {}
    }
    server.shutdown().await;
    Ok(())
}

/// `tether demo feed`: the demo's replaying feed alone, until a signal.
pub(super) async fn demo_feed(listen: SocketAddr, rate: u32) -> anyhow::Result<()> {
    let feed = Feed::start(
        listen,
        FeedOptions {
            rate,
            ..FeedOptions::default()
        },
    )
    .await
    .with_context(|| format!("cannot listen on {listen}"))?;
    println!(
        "demo feed listening on ws://{}/<stream>?after=<last_seq>",
        feed.addr
    );
    shutdown_signal().await;
    Ok(())
}

/// `tether worker` (and the worker half of `tether operator`).
pub(super) async fn worker(
    open: OpenStore,
    metrics: Arc<Metrics>,
    args: WorkerArgs,
    secrets: SecretSource,
    pod: Option<PodLookup>,
    provenance: Provenance,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let mut settings = worker_settings(&args)?;
    let _emf = args.emf_namespace.clone().map(|namespace| {
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(crate::emf::run(
            namespace,
            open.store.table().to_string(),
            settings.worker_id.clone(),
            args.emf_interval.max(std::time::Duration::from_secs(1)),
            metrics.worker.clone(),
        )))
    });
    // The table is checked by the worker itself, which waits (not ready)
    // while DynamoDB does not answer and fails clearly when the table is
    // missing; the metrics server is up meanwhile for the probes.
    let listener = crate::probes::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {}", args.metrics_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    settings.poke_addr = poke_addr(args.advertise_ip, listener.local_addr()?)?;
    let health = Arc::new(Health::new(
        open.store.reachability(),
        open.store.clock(),
        settings.max_clock_skew,
    ));
    let ctx = Arc::new(
        WorkerCtx::new(
            settings,
            open.store.clone(),
            metrics.worker.clone(),
            HostPolicy::new(args.allow_hosts.clone()).deny(&args.deny_cidrs),
            HostPolicy::new(args.allow_sink_hosts.clone())
                .for_sinks()
                .deny(&args.deny_cidrs),
            secrets,
            pod,
        )?
        .serving_only(provenance),
    );
    let stop_server = tokio_util::sync::CancellationToken::new();
    let mut server = std::pin::pin!(tokio::spawn(crate::probes::serve(
        listener,
        metrics.clone(),
        health.clone(),
        ctx.shared.pokes.doorbell(),
        stop_server.clone().cancelled_owned(),
    )));
    let result = tokio::select! {
        r = crate::worker::run(ctx, health, shutdown) => r.map_err(anyhow::Error::from),
        r = &mut server => Err(anyhow::anyhow!("metrics server stopped: {r:?}")),
    };
    stop_server.cancel();
    let _ = server.await;
    drop(open);
    result
}

/// `tether operator`: the controller and a worker in one process, stopped
/// together by SIGTERM/SIGINT. Exits non-zero if the CRD is missing or the
/// controller stops on its own.
pub(super) async fn operator(
    store_args: &StoreArgs,
    metrics: Arc<Metrics>,
    args: OperatorArgs,
) -> anyhow::Result<()> {
    let OperatorArgs {
        worker: args,
        controller: controller_args,
    } = args;
    check_installation(&controller_args.installation)?;
    let client = kube::Client::try_default().await.context(
        "cannot configure a Kubernetes client (run in a pod with a service account, or set KUBECONFIG)",
    )?;
    let open = open_store(store_args, Caller::Operator, metrics.store.clone()).await?;
    let instance = format!(
        "{}-{:08x}",
        args.worker_id
            .clone()
            .unwrap_or_else(crate::worker::default_worker_id),
        rand::random::<u32>()
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            shutdown_signal().await;
            shutdown.cancel();
        }
    });
    let settings = controller_settings(&instance, &controller_args);
    crate::controller::check_crd(&client, &settings.namespaces).await?;
    // The worker serves only items of this installation's resources.
    let provenance = Provenance::resources(client.clone(), settings.item_installation());
    let ctx = Arc::new(crate::controller::Context::new(
        client.clone(),
        open.store.clone(),
        settings,
        metrics.controller.clone(),
    ));
    let mut controller = tokio::spawn(crate::controller::run(ctx, shutdown.clone()));
    let pod = PodLookup::from_env(client.clone());
    let worker = worker(
        open,
        metrics,
        args,
        SecretSource::Kubernetes(client),
        pod,
        provenance,
        shutdown.clone().cancelled_owned(),
    );
    tokio::pin!(worker);
    tokio::select! {
        result = &mut worker => {
            shutdown.cancel();
            let _ = controller.await;
            result
        }
        _ = &mut controller => {
            // Finishing after SIGTERM is the plan; finishing before it is not.
            let unexpected = !shutdown.is_cancelled();
            shutdown.cancel();
            let result = worker.await;
            if unexpected {
                bail!("the controller stopped unexpectedly");
            }
            result
        }
    }
}

/// An installation id is a label value: at most 63 characters, letters,
/// digits, `-`, `_`, `.`, starting and ending with a letter or digit.
fn check_installation(id: &str) -> anyhow::Result<()> {
    let ok_chars = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    let ok_ends = id.is_empty()
        || (id.starts_with(|c: char| c.is_ascii_alphanumeric())
            && id.ends_with(|c: char| c.is_ascii_alphanumeric()));
    if id.len() > 63 || !ok_chars || !ok_ends {
        bail!(
            "--installation '{id}' is not a label value (at most 63 letters, digits, '-', '_', '.', starting and ending with a letter or digit)"
        );
    }
    Ok(())
}

/// Where peers poke this worker: `--advertise-ip` and the port the metrics
/// listener got.
fn poke_addr(
    ip: Option<std::net::IpAddr>,
    listening: std::net::SocketAddr,
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    match ip {
        Some(ip) if ip.is_unspecified() => anyhow::bail!(
            "--advertise-ip {ip}: give the address peers reach this worker at (in Kubernetes, the pod IP), not a wildcard"
        ),
        Some(ip) => {
            if listening.ip().is_loopback() && !ip.is_loopback() {
                tracing::warn!(advertised = %ip, %listening, "--metrics-addr listens on loopback only: peers' pokes to the advertised address will fail, and this worker learns of their changes once a heartbeat");
            }
            Ok(Some(std::net::SocketAddr::new(ip, listening.port())))
        }
        None => Ok(None),
    }
}
