//! `tether get`: streams with their state, phase, owner, how long ago the
//! owner last renewed its heartbeat, and the freshest checkpoint.
//!
//! Liveness is per worker, not per stream: a stream has no lease of its own to
//! count down. What says its owner is alive is the owner's heartbeat (peers
//! declare it dead once that stood still for a whole lease), and the freshest
//! checkpoint is the item's or the one the owner packs into each heartbeat.

use crate::config::OutputFormat;
use crate::lease::{LeaseStore, StreamView, now_ms};
use anyhow::bail;

/// What `tether get` lists.
pub(super) struct Selection<'a> {
    pub name: Option<&'a str>,
    pub namespace: Option<&'a str>,
}

/// How often `--watch` reads the table again.
const WATCH_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) async fn get(
    store: &LeaseStore,
    selection: Selection<'_>,
    output: OutputFormat,
    watch: bool,
) -> anyhow::Result<()> {
    store.check_table().await?;
    let single = selection.name.is_some();
    // Watching: what was last printed per stream, without its lease
    // countdown (which moves on every read and is no news).
    let mut shown: std::collections::HashMap<String, serde_json::Value> = Default::default();
    let mut first = true;
    loop {
        let views = select(store, &selection).await?;
        let now = now_ms();
        if !watch {
            print!("{}", render(&views, now, output, single)?);
            return Ok(());
        }
        let changed: Vec<StreamView> = views
            .into_iter()
            .filter(|v| {
                let mut row = json_row(v, now);
                row["heartbeatAgeMs"] = serde_json::Value::Null;
                shown.insert(v.record.key.to_string(), row.clone()) != Some(row)
            })
            .collect();
        match output {
            // A document per changed stream.
            OutputFormat::Json | OutputFormat::Yaml => {
                for v in &changed {
                    if output == OutputFormat::Yaml {
                        println!("---");
                    }
                    print!("{}", render(std::slice::from_ref(v), now, output, true)?);
                }
            }
            // The header once, then a row per changed stream.
            _ => {
                let text = render(&changed, now, output, false)?;
                let header = matches!(output, OutputFormat::Table | OutputFormat::Wide);
                for (i, line) in text.lines().enumerate() {
                    if !(header && i == 0 && !first) {
                        println!("{line}");
                    }
                }
            }
        }
        first = false;
        tokio::select! {
            _ = crate::cli::shutdown_signal() => return Ok(()),
            _ = tokio::time::sleep(WATCH_PERIOD) => {}
        }
    }
}

async fn select(store: &LeaseStore, selection: &Selection<'_>) -> anyhow::Result<Vec<StreamView>> {
    if let Some(name) = selection.name {
        let key = super::apply::qualified(name, selection.namespace)?;
        return match store.view(&key).await? {
            Some(v) => Ok(vec![v]),
            None => bail!("stream {key} not found in table {}", store.table()),
        };
    }
    let (views, malformed) = store.view_all().await?;
    for m in malformed {
        eprintln!(
            "warning: item {} is malformed ({}); skipped",
            m.pk, m.detail
        );
    }
    Ok(views
        .into_iter()
        .filter(|v| {
            selection
                .namespace
                .is_none_or(|ns| v.record.key.namespace == ns)
        })
        .collect())
}

fn render(
    views: &[StreamView],
    now: u64,
    output: OutputFormat,
    single: bool,
) -> anyhow::Result<String> {
    let rows = || -> serde_json::Value {
        let rows: Vec<_> = views.iter().map(|v| json_row(v, now)).collect();
        if single {
            rows.into_iter().next().unwrap_or_default()
        } else {
            serde_json::Value::Array(rows)
        }
    };
    Ok(match output {
        OutputFormat::Json => format!("{}\n", serde_json::to_string_pretty(&rows())?),
        OutputFormat::Yaml => serde_yaml::to_string(&rows())?,
        OutputFormat::Name => views
            .iter()
            .map(|v| format!("streamconnection/{}\n", v.record.key))
            .collect(),
        OutputFormat::Table => table_text(views, now),
        OutputFormat::Wide => wide_text(views, now),
    })
}

fn json_row(v: &StreamView, now: u64) -> serde_json::Value {
    let r = &v.record;
    let owner = v.live_owner();
    serde_json::json!({
        "name": r.key.to_string(),
        "desiredState": r.desired_state,
        "url": r.ws_url,
        "phase": r.status.as_ref().map(|s| s.phase),
        "reason": r.status.as_ref().and_then(|s| s.reason.clone()),
        "message": r.status.as_ref().and_then(|s| s.message.clone()),
        "owner": owner.map(|o| o.owner.clone()),
        "ownerWorker": owner.map(|o| o.worker_id.clone()),
        "heartbeatAgeMs": owner.and_then(|o| o.heartbeat_at_ms).map(|at| now.saturating_sub(at)),
        "leaseCounter": r.lease_counter,
        "lastSeq": v.checkpoint,
        "generation": r.generation,
    })
}

/// The human table `tether get` prints.
pub(super) fn table_text(views: &[StreamView], now: u64) -> String {
    columns(views, now, false)
}

/// `-o wide`: the table plus token, reason and URL.
fn wide_text(views: &[StreamView], now: u64) -> String {
    columns(views, now, true)
}

fn columns(views: &[StreamView], now: u64, wide: bool) -> String {
    let mut rows = vec![vec![
        "NAME".to_string(),
        "STATE".into(),
        "PHASE".into(),
        "OWNER".into(),
        "HEARTBEAT".into(),
        "CHECKPOINT".into(),
    ]];
    if wide {
        rows[0].extend(["TOKEN".to_string(), "REASON".into(), "URL".into()]);
    }
    for v in views {
        let r = &v.record;
        let owner = v.live_owner();
        let heartbeat = owner
            .and_then(|o| o.heartbeat_at_ms)
            .map(|at| format!("{:.1}s ago", now.saturating_sub(at) as f64 / 1000.0))
            .unwrap_or_else(|| "-".into());
        let phase = match (owner, r.status.as_ref()) {
            (Some(_), Some(s)) => s.phase.to_string(),
            (None, _) if r.desired_state == crate::lease::DesiredState::Stopped => "Stopped".into(),
            _ => "Pending".into(),
        };
        let mut row = vec![
            r.key.to_string(),
            r.desired_state.as_str().to_string(),
            phase,
            owner.map_or("-", |o| o.worker_id.as_str()).to_string(),
            heartbeat,
            v.checkpoint
                .map_or_else(|| "none".into(), |s| s.to_string()),
        ];
        if wide {
            row.extend([
                r.lease_counter.to_string(),
                r.status
                    .as_ref()
                    .and_then(|s| s.reason.clone())
                    .unwrap_or_else(|| "-".into()),
                r.ws_url.clone(),
            ]);
        }
        rows.push(row);
    }
    let widths: Vec<usize> = (0..rows[0].len())
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
