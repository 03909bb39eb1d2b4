//! The CLI's subcommands that talk to the table directly (`table`, `get`,
//! `local-store`), and the store wiring every subcommand shares.

use crate::config::{OutputFormat, StoreArgs};
use crate::embedded::{EMBEDDED_CREDENTIALS, EmbeddedStore};
use crate::lease::{LeaseStore, RetryPolicy, StoreConfig, StreamKey, StreamRecord, now_ms};
use crate::metrics::StoreMetrics;
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
    let mut cfg = StoreConfig::new(&args.table);
    cfg.retry = RetryPolicy {
        deadline: args.store_call_deadline,
        ..RetryPolicy::default()
    };
    let embedded = match &args.embedded_store {
        Some(path) => {
            let server = EmbeddedStore::start(
                Some(path.as_path()),
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            )
            .await?;
            cfg.endpoint = Some(server.endpoint());
            cfg.static_credentials =
                Some((EMBEDDED_CREDENTIALS.0.into(), EMBEDDED_CREDENTIALS.1.into()));
            Some(server)
        }
        None => None,
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
