//! The CLI's subcommands that talk to the table directly (`table`, `get`,
//! `local-store`), and the store wiring every subcommand shares.

use crate::config::{OutputFormat, StoreArgs, WorkerArgs};
use crate::embedded::EmbeddedStore;
use crate::http::Health;
use crate::lease::UpsertOutcome;
use crate::lease::{LeaseStore, RetryPolicy, StoreConfig, StreamKey, StreamRecord, now_ms};
use crate::metrics::Metrics;
use crate::metrics::StoreMetrics;
use crate::worker::secrets::SecretSource;
use crate::worker::{WorkerCtx, WorkerSettings, policy::HostPolicy};
use anyhow::{Context, bail};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

/// An open store, plus the embedded server behind it when one was asked for
/// (kept alive for as long as the store is used).
pub struct OpenStore {
    pub store: LeaseStore,
    pub embedded: Option<EmbeddedStore>,
}

/// Connects to the table the flags describe. With `--embedded-store` the embedded
/// store is started in-process and its table created; otherwise the standard AWS
/// configuration decides, and nothing is ever started silently.
pub async fn open_store(args: &StoreArgs, metrics: Arc<StoreMetrics>) -> anyhow::Result<OpenStore> {
    let embedded = match &args.embedded_store {
        Some(path) => Some(
            EmbeddedStore::start(
                Some(path.as_path()),
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            )
            .await?,
        ),
        None => None,
    };
    let mut cfg = match &embedded {
        Some(server) => StoreConfig::local(&args.table, server.endpoint()),
        None => StoreConfig::new(&args.table),
    };
    cfg.retry = RetryPolicy {
        deadline: args.store_call_deadline,
        ..RetryPolicy::default()
    };
    let store = LeaseStore::connect(cfg, metrics).await?;
    // The embedded store starts empty; give it its table so local use needs no step.
    if embedded.is_some() {
        store.create_table().await?;
    }
    Ok(OpenStore { store, embedded })
}

/// `tether table create`.
pub async fn table_create(store: &LeaseStore) -> anyhow::Result<()> {
    let created = store.create_table().await?;
    let verb = if created { "created" } else { "already exists" };
    println!(
        "table {} {verb} at {} (GSI by_state: desired_state / lease_expires_at_ms; ACTIVE)",
        store.table(),
        store.endpoint()
    );
    Ok(())
}

/// `tether get [NAME] [-o json]`.
pub async fn get(
    store: &LeaseStore,
    name: Option<&str>,
    output: OutputFormat,
) -> anyhow::Result<()> {
    store.check_table().await?;
    let records = match name {
        Some(name) => {
            let key = StreamKey::parse(name)
                .with_context(|| format!("'{name}' is not a valid stream name"))?;
            match store.get(&key).await? {
                Some(r) => vec![r],
                None => bail!("stream {key} not found in table {}", store.table()),
            }
        }
        None => store.list().await?,
    };
    let now = now_ms();
    match output {
        OutputFormat::Json => {
            let rows: Vec<_> = records.iter().map(|r| json_row(r, now)).collect();
            let value = if name.is_some() {
                rows.into_iter().next().unwrap_or_default()
            } else {
                serde_json::Value::Array(rows)
            };
            println!("{}", serde_json::to_string_pretty(&value)?);
        }
        OutputFormat::Table => print!("{}", table_text(&records, now)),
    }
    Ok(())
}

fn json_row(r: &StreamRecord, now: u64) -> serde_json::Value {
    serde_json::json!({
        "name": r.key.to_string(),
        "desiredState": r.desired_state,
        "url": r.ws_url,
        "phase": r.status.as_ref().map(|s| s.phase.clone()),
        "reason": r.status.as_ref().and_then(|s| s.reason.clone()).filter(|s| !s.is_empty()),
        "message": r.status.as_ref().and_then(|s| s.message.clone()).filter(|s| !s.is_empty()),
        "owner": r.live_owner(now),
        "leaseExpiresAtMs": r.lease_expires_at_ms,
        "leaseLeftMs": r.lease_expires_at_ms.saturating_sub(now),
        "leaseCounter": r.lease_counter,
        "lastSeq": r.last_seq,
        "generation": r.generation,
    })
}

/// The human table `tether get` prints.
pub fn table_text(records: &[StreamRecord], now: u64) -> String {
    let mut rows = vec![[
        "NAME".to_string(),
        "STATE".into(),
        "PHASE".into(),
        "OWNER".into(),
        "LEASE-LEFT".into(),
        "LAST-SEQ".into(),
    ]];
    for r in records {
        let owner = r.live_owner(now);
        let left = if owner.is_some() {
            format!(
                "{:.1}s",
                r.lease_expires_at_ms.saturating_sub(now) as f64 / 1000.0
            )
        } else {
            "-".into()
        };
        rows.push([
            r.key.to_string(),
            r.desired_state.as_str().to_string(),
            r.status
                .as_ref()
                .map(|s| s.phase.clone())
                .unwrap_or_else(|| "-".into()),
            owner.unwrap_or("-").to_string(),
            left,
            r.last_seq
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    let widths: Vec<usize> = (0..6)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `tether local-store`: serve the embedded store until SIGINT/SIGTERM.
pub async fn local_store(listen: SocketAddr, data: &Path) -> anyhow::Result<()> {
    let mut server = EmbeddedStore::start(Some(data), listen).await?;
    println!(
        "embedded DynamoDB-compatible store listening on {}",
        server.endpoint()
    );
    println!("  export AWS_ENDPOINT_URL_DYNAMODB={}", server.endpoint());
    tokio::select! {
        reason = server.stopped() => bail!("{reason}"),
        _ = crate::shutdown_signal() => {}
    }
    server.shutdown().await;
    Ok(())
}

/// `tether apply -f`: upsert every valid manifest; report every invalid one.
/// Fails (after applying the valid ones) when any document was invalid.
pub async fn apply(store: &LeaseStore, path: &Path) -> anyhow::Result<()> {
    store.check_table().await?;
    let (manifests, errors) = crate::manifest::load(path);
    for e in &errors {
        eprintln!("error: {e}");
    }
    for m in &manifests {
        let current = store.get(&m.key).await?;
        let spec_json = serde_json::to_value(&m.spec)?;
        // Standalone mode has no API server counting generations: bump on change.
        let (generation, verb) = match &current {
            Some(c)
                if c.spec.as_ref() == Some(&spec_json)
                    && c.desired_state == m.spec.desired_state.into() =>
            {
                println!("streamconnection {} unchanged", m.key);
                continue;
            }
            Some(c) => (c.generation + 1, "configured"),
            None => (1, "created"),
        };
        match store
            .upsert_desired(&m.spec.to_desired(m.key.clone(), generation))
            .await?
        {
            UpsertOutcome::Applied => println!("streamconnection {} {verb}", m.key),
            UpsertOutcome::StaleGeneration { stored } => {
                println!(
                    "streamconnection {} changed concurrently (generation {stored}); re-run apply",
                    m.key
                )
            }
        }
    }
    if !errors.is_empty() {
        bail!("{} invalid document(s) not applied", errors.len());
    }
    Ok(())
}

/// `tether delete NAME`.
pub async fn delete(store: &LeaseStore, name: &str) -> anyhow::Result<()> {
    store.check_table().await?;
    let key =
        StreamKey::parse(name).with_context(|| format!("'{name}' is not a valid stream name"))?;
    if store.delete(&key).await? {
        println!("streamconnection {key} deleted");
        Ok(())
    } else {
        bail!("stream {key} not found in table {}", store.table())
    }
}

/// `tether worker` (and the worker half of `tether operator`).
pub async fn worker(
    open: OpenStore,
    metrics: Arc<Metrics>,
    args: WorkerArgs,
    secrets: SecretSource,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let settings = WorkerSettings::from_args(&args).map_err(anyhow::Error::msg)?;
    open.store.check_table().await?;
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {}", args.metrics_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    let health = Arc::new(Health::new(open.store.reachability()));
    let ctx = Arc::new(
        WorkerCtx::new(
            settings,
            open.store.clone(),
            metrics.worker.clone(),
            HostPolicy::new(args.allow_hosts.clone()),
            secrets,
        )
        .map_err(anyhow::Error::msg)?,
    );
    let stop_server = tokio_util::sync::CancellationToken::new();
    let server = {
        let stop = stop_server.clone();
        tokio::spawn(crate::http::serve(
            listener,
            metrics.clone(),
            health.clone(),
            async move { stop.cancelled().await },
        ))
    };
    let mut server = std::pin::pin!(server);
    tokio::select! {
        _ = crate::worker::run(ctx, health, shutdown) => {}
        r = &mut server => bail!("metrics server stopped: {r:?}"),
    }
    stop_server.cancel();
    let _ = server.await;
    drop(open);
    Ok(())
}

/// `tether operator`: the controller and a worker in one process, stopped
/// together by SIGTERM/SIGINT. Exits non-zero if the CRD is missing or the
/// controller stops on its own.
pub async fn operator(
    store_args: &StoreArgs,
    metrics: Arc<Metrics>,
    args: WorkerArgs,
) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("cannot configure a Kubernetes client (run in a pod with a service account, or set KUBECONFIG)")?;
    crate::controller::check_crd(&client).await?;
    let open = open_store(store_args, metrics.store.clone()).await?;
    let instance = args
        .worker_id
        .clone()
        .unwrap_or_else(crate::worker::default_worker_id);
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            crate::shutdown_signal().await;
            shutdown.cancel();
        }
    });
    let ctx = Arc::new(crate::controller::Context::new(
        client.clone(),
        open.store.clone(),
        &instance,
        args.status_refresh,
    ));
    let mut controller = tokio::spawn(crate::controller::run(
        ctx,
        shutdown.clone().cancelled_owned(),
    ));
    let worker = worker(
        open,
        metrics,
        args,
        SecretSource::Kubernetes(client),
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
