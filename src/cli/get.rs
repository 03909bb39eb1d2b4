//! `tether get`: streams with their state, phase, owner, how long the owner
//! has proven itself for, and the freshest checkpoint.

use crate::config::OutputFormat;
use crate::lease::{LeaseStore, StreamKey, StreamView, now_ms};
use anyhow::{Context, bail};

pub async fn get(
    store: &LeaseStore,
    name: Option<&str>,
    output: OutputFormat,
) -> anyhow::Result<()> {
    store.check_table().await?;
    let views = match name {
        Some(name) => {
            let key = StreamKey::parse(name)
                .with_context(|| format!("'{name}' is not a valid stream name"))?;
            match store.view(&key).await? {
                Some(v) => vec![v],
                None => bail!("stream {key} not found in table {}", store.table()),
            }
        }
        None => {
            let (views, malformed) = store.view_all().await?;
            for m in malformed {
                eprintln!(
                    "warning: item {} is malformed ({}); skipped",
                    m.pk, m.detail
                );
            }
            views
        }
    };
    let now = now_ms();
    match output {
        OutputFormat::Json => {
            let rows: Vec<_> = views.iter().map(|v| json_row(v, now)).collect();
            let value = if name.is_some() {
                rows.into_iter().next().unwrap_or_default()
            } else {
                serde_json::Value::Array(rows)
            };
            println!("{}", serde_json::to_string_pretty(&value)?);
        }
        OutputFormat::Table => print!("{}", table_text(&views, now)),
    }
    Ok(())
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
        "leaseLeftMs": owner.and_then(|o| o.until_ms).map(|u| u.saturating_sub(now)),
        "leaseCounter": r.lease_counter,
        "lastSeq": v.checkpoint,
        "generation": r.generation,
    })
}

/// The human table `tether get` prints.
pub fn table_text(views: &[StreamView], now: u64) -> String {
    let mut rows = vec![[
        "NAME".to_string(),
        "STATE".into(),
        "PHASE".into(),
        "OWNER".into(),
        "LEASE-LEFT".into(),
        "LAST-SEQ".into(),
    ]];
    for v in views {
        let r = &v.record;
        let owner = v.live_owner();
        let left = owner
            .and_then(|o| o.until_ms)
            .map(|u| format!("{:.1}s", u.saturating_sub(now) as f64 / 1000.0))
            .unwrap_or_else(|| "-".into());
        let phase = match (owner, r.status.as_ref()) {
            (Some(_), Some(s)) => s.phase.to_string(),
            (None, _) if r.desired_state == crate::lease::DesiredState::Stopped => "Stopped".into(),
            _ => "Pending".into(),
        };
        rows.push([
            r.key.to_string(),
            r.desired_state.as_str().to_string(),
            phase,
            owner.map_or("-", |o| o.worker_id.as_str()).to_string(),
            left,
            v.checkpoint.map_or_else(|| "-".into(), |s| s.to_string()),
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
