//! `tether apply` and `tether delete`: the standalone control plane.

use crate::lease::{
    DeleteOutcome, DesiredState, LeaseStore, StreamKey, UpsertOutcome, UpsertRefusal,
};
use anyhow::{Context, bail};
use std::path::Path;
use std::time::Duration;

/// How long `tether delete` waits for the owner to release the stream.
const DELETE_WAIT: Duration = Duration::from_secs(30);

/// `tether apply -f`: upsert every valid manifest; report every invalid one.
/// Fails (after applying the valid ones) when any document was invalid or a
/// write was refused.
pub async fn apply(store: &LeaseStore, path: &Path) -> anyhow::Result<()> {
    store.check_table().await?;
    let (manifests, errors) = crate::manifest::load(path);
    for e in &errors {
        eprintln!("error: {e}");
    }
    let mut refused = 0;
    for m in &manifests {
        let current = store.get(&m.key).await?;
        let desired_state: DesiredState = m.spec.desired_state.into();
        let spec_json = serde_json::to_value(&m.spec)?;
        // Standalone mode has no API server counting generations: bump on change.
        let (generation, verb) = match &current {
            Some(c)
                if !c.is_tombstone()
                    && c.spec.as_ref() == Some(&spec_json)
                    && c.desired_state == desired_state =>
            {
                (c.generation, "unchanged")
            }
            Some(c) if !c.is_tombstone() => (c.generation + 1, "configured"),
            Some(c) => (c.generation + 1, "created"),
            None => (1, "created"),
        };
        match store
            .upsert_desired(&m.spec.to_desired(m.key.clone(), generation, None))
            .await?
        {
            UpsertOutcome::Applied | UpsertOutcome::Unchanged => {
                println!("streamconnection {} {verb}", m.key)
            }
            UpsertOutcome::Refused { reason } => {
                refused += 1;
                let why = match reason {
                    UpsertRefusal::StaleGeneration { stored } => {
                        format!("changed concurrently (generation {stored}); re-run apply")
                    }
                    UpsertRefusal::NewerResource { stored_uid } => {
                        format!("owned by Kubernetes resource {stored_uid}; change it there")
                    }
                    UpsertRefusal::Deleted => "deleted".to_string(),
                    UpsertRefusal::OtherInstallation { stored } => {
                        format!("mirrored by operator installation '{stored}'; change it there")
                    }
                };
                eprintln!("error: streamconnection {}: {why}", m.key);
            }
        }
    }
    if !errors.is_empty() || refused > 0 {
        bail!(
            "{} invalid document(s), {refused} refused write(s)",
            errors.len()
        );
    }
    Ok(())
}

/// `tether delete NAME`: marks the stream STOPPED, waits for its owner to
/// release it (so nothing is deleted under a live session), then deletes it,
/// keeping its fencing token in a tombstone.
pub async fn delete(store: &LeaseStore, name: &str) -> anyhow::Result<()> {
    store.check_table().await?;
    let key =
        StreamKey::parse(name).with_context(|| format!("'{name}' is not a valid stream name"))?;
    match store.delete_stream(&key, DELETE_WAIT).await? {
        DeleteOutcome::Deleted => {
            println!("streamconnection {key} deleted");
            Ok(())
        }
        DeleteOutcome::NotFound => bail!("stream {key} not found in table {}", store.table()),
        DeleteOutcome::StillOwned { owner } => bail!(
            "{key} is STOPPED but {owner} has not released it within {DELETE_WAIT:?}; run delete again"
        ),
    }
}
