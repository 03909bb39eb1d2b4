//! `tether table create` and `tether table finish-upgrade`.

use crate::lease::{CHANGE_INDEX, HOLDER_INDEX, LEGACY_INDEX, LeaseStore, TableChange};

pub(super) async fn create(store: &LeaseStore) -> anyhow::Result<()> {
    let change = store.create_table().await?;
    let layout = store.describe().await?;
    let what = match change {
        TableChange::Created => "created",
        TableChange::Upgraded => "upgraded in place (missing indexes added)",
        TableChange::Unchanged => "already exists",
    };
    println!(
        "table {} {what} at {} (indexes {HOLDER_INDEX}: holder, {CHANGE_INDEX}: change_shard/changed_at_ms; ACTIVE)",
        store.table(),
        store.endpoint()
    );
    if layout.legacy_index {
        println!(
            "  version 0.1's index {LEGACY_INDEX} is kept while 0.1 workers may run; once none do: tether table finish-upgrade"
        );
    }
    Ok(())
}

pub(super) async fn finish_upgrade(store: &LeaseStore) -> anyhow::Result<()> {
    let fixed = store.finish_upgrade().await?;
    println!(
        "table {}: {fixed} free stream(s) indexed; index {LEGACY_INDEX} dropped (version 0.1 workers can no longer use this table)",
        store.table()
    );
    Ok(())
}
