//! `tether apply` and `tether delete`: the standalone control plane.

use crate::lease::{
    DeleteOutcome, DesiredState, LeaseStore, StreamKey, UpsertOutcome, UpsertRefusal,
};
use crate::manifest::{LoadOptions, Loaded, Validation};
use anyhow::{Context, bail};
use std::path::PathBuf;
use std::time::Duration;

/// How long `tether delete` waits for the owner to release the stream.
const DELETE_WAIT: Duration = Duration::from_secs(30);

/// `tether apply -f`: upsert every valid manifest; report every invalid one.
/// Fails (after applying the valid ones) when any document was invalid or a
/// write was refused.
pub(super) async fn apply(
    store: &LeaseStore,
    sources: &[PathBuf],
    options: &LoadOptions,
) -> anyhow::Result<()> {
    store.check_table().await?;
    let Loaded {
        manifests,
        errors,
        warnings,
    } = crate::manifest::load(sources, options);
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    for e in &errors {
        eprintln!("error: {e}");
    }
    let mut refused = 0;
    for m in &manifests {
        let current = store.get(&m.key).await?;
        let desired_state: DesiredState = m.spec.desired_state.into();
        let spec_text = crate::crd::stored::encode(&m.spec);
        // Standalone mode has no API server counting generations: bump on change.
        let (generation, verb) = match &current {
            Some(c)
                if !c.is_tombstone()
                    && c.spec.as_deref() == Some(spec_text.as_str())
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

/// `tether delete`: for each stream named (or named by a manifest), marks it
/// STOPPED, waits for its owner to release it (so nothing is deleted under a
/// live session), then deletes it, keeping its fencing token in a tombstone.
/// Every stream is attempted; fails if any could not be deleted.
pub(super) async fn delete(
    store: &LeaseStore,
    names: &[String],
    namespace: Option<&str>,
    sources: &[PathBuf],
    recursive: bool,
    ignore_not_found: bool,
) -> anyhow::Result<()> {
    store.check_table().await?;
    let mut keys = Vec::new();
    for name in names {
        keys.push(qualified(name, namespace)?);
    }
    if !sources.is_empty() {
        // Only the names matter here: a manifest with a typo still names a stream.
        let loaded = crate::manifest::load(
            sources,
            &LoadOptions {
                recursive,
                validation: Validation::Ignore,
            },
        );
        for e in &loaded.errors {
            eprintln!("error: {e}");
        }
        if !loaded.errors.is_empty() {
            bail!(
                "{} unreadable document(s); nothing deleted",
                loaded.errors.len()
            );
        }
        keys.extend(loaded.manifests.into_iter().map(|m| m.key));
    }
    if keys.is_empty() {
        bail!("name at least one stream, or -f a manifest");
    }
    let mut failed = 0;
    for key in keys {
        match store.delete_stream(&key, DELETE_WAIT).await {
            Ok(DeleteOutcome::Deleted) => println!("streamconnection {key} deleted"),
            Ok(DeleteOutcome::NotFound) if ignore_not_found => {}
            Ok(DeleteOutcome::NotFound) => {
                failed += 1;
                eprintln!("error: stream {key} not found in table {}", store.table());
            }
            Ok(DeleteOutcome::StillOwned { owner }) => {
                failed += 1;
                eprintln!(
                    "error: {key} is STOPPED but {owner} has not released it within {DELETE_WAIT:?}; run delete again"
                );
            }
            Err(e) => {
                failed += 1;
                eprintln!("error: {key}: {e}");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} stream(s) not deleted");
    }
    Ok(())
}

/// `name` in `namespace` (default `default`), or `namespace/name` as given.
pub(super) fn qualified(name: &str, namespace: Option<&str>) -> anyhow::Result<StreamKey> {
    let full = match (name.contains('/'), namespace) {
        (false, Some(ns)) => format!("{ns}/{name}"),
        _ => name.to_string(),
    };
    StreamKey::parse(&full).with_context(|| format!("'{full}' is not a valid stream name"))
}
