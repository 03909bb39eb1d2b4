//! Upgrading from tether 0.1 (per-stream leases) in place: the table gets its
//! new index while 0.1 workers run, old and new workers share one table
//! during a rolling upgrade without ever both owning a stream, and the old
//! index is dropped at the end. The 0.1 binary is built from this
//! repository's history (`scripts/legacy-binary`). And a rolling upgrade
//! from 0.2, whose workers do not move the change counter: the new workers
//! make full passes while one of them runs, and go quiet once none does.

use aws_sdk_dynamodb::types::AttributeValue;
use nix::sys::signal::Signal;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{
    AcquireFrom, AcquireOutcome, Incarnation, LeaseStore, Ownership, StoreError, StreamKey,
    TableChange,
};
use tether::metrics::StoreMetrics;
use tether_testkit::bed::{Bed, loopback, names};
use tether_testkit::fixtures::http_spec;
use tether_testkit::processes::FleetConfig;
use tether_testkit::sink::VerifyingSink;
use tether_testkit::store::{endpoint, raw_client, store_config, unique_table};
use tether_testkit::upstream::start as start_upstream;

const EXE: &str = env!("CARGO_BIN_EXE_tether");

/// The 0.1 binary: `$TETHER_LEGACY_BIN`, else built (once) by the script.
fn legacy_binary() -> PathBuf {
    release_binary("TETHER_LEGACY_BIN", "0.1")
}

/// An earlier release: the binary `$variable` names, else built (once) by
/// `scripts/legacy-binary`.
fn release_binary(variable: &str, version: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return path.into();
    }
    let out = std::process::Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/legacy-binary"
    ))
    .args(["debug", version])
    .stderr(Stdio::inherit())
    .output()
    .expect("scripts/legacy-binary runs");
    assert!(out.status.success(), "building tether {version} failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn cli(exe: &std::path::Path, table: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(exe)
        .args(["--table", table])
        .args(args)
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_from_0_1_never_serves_a_stream_twice_and_loses_nothing() {
    tether::install_crypto_provider();
    let legacy = legacy_binary();
    let table = unique_table("rolling");
    let upstream = start_upstream(loopback(), 20).await.unwrap();
    let sink = VerifyingSink::start(loopback()).await.unwrap();
    let logs = std::env::temp_dir().join(format!("tether-upgrade-{:08x}", rand::random::<u32>()));
    std::fs::create_dir_all(&logs).unwrap();

    // A 0.1 deployment: its table, its streams, two 0.1 workers.
    let created = cli(&legacy, &table, &["table", "create"]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let names = names("up", 12);
    let manifests: Vec<String> = names
        .iter()
        .map(|n| {
            let spec = serde_json::to_value(http_spec(&upstream.url(n), &sink.url())).unwrap();
            serde_json::to_string(&serde_json::json!({
                "apiVersion": "tether.dev/v1alpha1", "kind": "StreamConnection",
                "metadata": {"name": n, "namespace": "up"}, "spec": spec,
            }))
            .unwrap()
        })
        .collect();
    let manifest = logs.join("streams.yaml");
    std::fs::write(&manifest, manifests.join("\n---\n")).unwrap();
    let applied = cli(
        &legacy,
        &table,
        &["apply", "-f", manifest.to_str().unwrap()],
    );
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    let mut v1 = FleetConfig::fast(&legacy, endpoint().0, &table, &logs);
    v1.workers.lease_duration = Duration::from_secs(4);
    v1.workers.heartbeat_interval = Duration::from_secs(1);
    v1.extra_args = vec!["--max-clock-skew".into(), "500ms".into()];
    let mut old: Vec<_> = ["old-a", "old-b"]
        .iter()
        .map(|id| v1.spawn(id).unwrap())
        .collect();
    let connected_once = || {
        let open = upstream.open_sessions();
        names.iter().all(|n| open.get(n) == Some(&1))
    };
    Bed::wait(
        Duration::from_secs(30),
        "0.1 serves every stream",
        || async { connected_once() },
    )
    .await
    .unwrap();

    // Upgrade the table in place while 0.1 runs.
    let upgraded = cli(std::path::Path::new(EXE), &table, &["table", "create"]);
    let said = String::from_utf8_lossy(&upgraded.stdout);
    assert!(
        upgraded.status.success() && said.contains("upgraded in place"),
        "{said}{}",
        String::from_utf8_lossy(&upgraded.stderr)
    );

    // Roll: a new worker starts, then an old one stops, twice.
    let v2 = FleetConfig::fast(EXE, endpoint().0, &table, &logs);
    let mut new = Vec::new();
    for (i, mut stopping) in old.drain(..).enumerate() {
        new.push(v2.spawn(&format!("new-{i}")).unwrap());
        tokio::time::sleep(Duration::from_secs(3)).await;
        stopping.signal(Signal::SIGTERM).unwrap();
        assert!(
            stopping
                .wait(Duration::from_secs(15))
                .await
                .unwrap()
                .success()
        );
        Bed::wait(
            Duration::from_secs(30),
            "every stream is served once again",
            || async { connected_once() },
        )
        .await
        .unwrap();
    }
    // Everything is on the new protocol now.
    let store = LeaseStore::connect(store_config(&table), Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    Bed::wait(
        Duration::from_secs(30),
        "the new workers own every stream",
        || async {
            let (views, _) = store.view_all().await.unwrap();
            views.len() == names.len()
                && views.iter().all(|v| {
                    matches!(v.record.ownership(), Ownership::Owned(_)) && v.live_owner().is_some()
                })
        },
    )
    .await
    .unwrap();
    let finished = cli(
        std::path::Path::new(EXE),
        &table,
        &["table", "finish-upgrade"],
    );
    assert!(
        finished.status.success(),
        "{}",
        String::from_utf8_lossy(&finished.stderr)
    );
    assert!(!store.check_table().await.unwrap().legacy_index);
    // The workers that started during the upgrade still serve what needs an
    // owner (they looked for version-1 leases in the index just dropped,
    // and every acquisition pass failed): a stream applied now is served.
    let late = StreamKey::new("up", "up-late");
    let spec = http_spec(&upstream.url("up-late"), &sink.url());
    store
        .upsert_desired(&spec.to_desired(late, 1, None))
        .await
        .unwrap();
    Bed::wait(
        Duration::from_secs(20),
        "a stream applied after finish-upgrade is served",
        || async { upstream.open_sessions().get("up-late") == Some(&1) },
    )
    .await
    .unwrap();
    // And it keeps running on the upgraded table.
    let before: Vec<_> = names
        .iter()
        .map(|n| sink.log(&format!("up/{n}")).max_seq())
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (n, b) in names.iter().zip(before) {
        assert!(
            sink.log(&format!("up/{n}")).max_seq() > b,
            "{n} stalled after the upgrade"
        );
    }
    let overlaps = upstream.overlaps();
    assert!(
        overlaps.is_empty(),
        "two owners served one stream during the upgrade: {overlaps:#?}"
    );
    for n in &names {
        let log = sink.log(&format!("up/{n}"));
        assert_eq!(log.gaps(1), Vec::<u64>::new(), "{n}: gaps");
        assert_eq!(log.stale_messages, 0, "{n}: stale deliveries");
    }
    drop(new);
    let _ = std::fs::remove_dir_all(&logs);
}

#[tokio::test]
async fn a_version_1_table_is_upgraded_in_place_and_its_leases_are_honoured() {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType,
        Projection, ProjectionType, ScalarAttributeType,
    };
    tether::install_crypto_provider();
    let table = unique_table("v1");
    let client = raw_client().await;
    let key = |name: &str, kind| {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(kind)
            .build()
            .unwrap()
    };
    let def = |name: &str, t| {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(t)
            .build()
            .unwrap()
    };
    client
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(def("Pk", ScalarAttributeType::S))
        .attribute_definitions(def("desired_state", ScalarAttributeType::S))
        .attribute_definitions(def("lease_expires_at_ms", ScalarAttributeType::N))
        .key_schema(key("Pk", KeyType::Hash))
        .global_secondary_indexes(
            GlobalSecondaryIndex::builder()
                .index_name("by_state")
                .key_schema(key("desired_state", KeyType::Hash))
                .key_schema(key("lease_expires_at_ms", KeyType::Range))
                .projection(
                    Projection::builder()
                        .projection_type(ProjectionType::All)
                        .build(),
                )
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let store = LeaseStore::connect(store_config(&table), Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    assert!(
        matches!(
            store.check_table().await,
            Err(StoreError::NeedsUpgrade { .. })
        ),
        "refused until upgraded"
    );
    // A version-1 worker holds one stream; another lease has lapsed.
    let now = tether::lease::now_ms();
    for (name, owner, expires) in [
        ("held", "old-worker", now + 600_000),
        ("lapsed", "old-worker", now - 1_000),
    ] {
        let mut item = std::collections::HashMap::new();
        item.insert(
            "Pk".to_string(),
            AttributeValue::S(format!("CONN#v1/{name}")),
        );
        item.insert(
            "desired_state".to_string(),
            AttributeValue::S("STARTED".into()),
        );
        item.insert(
            "ws_url".to_string(),
            AttributeValue::S("ws://127.0.0.1:1/x".into()),
        );
        item.insert("lease_owner".to_string(), AttributeValue::S(owner.into()));
        item.insert(
            "lease_expires_at_ms".to_string(),
            AttributeValue::N(expires.to_string()),
        );
        item.insert("lease_counter".to_string(), AttributeValue::N("4".into()));
        item.insert("last_seq".to_string(), AttributeValue::N("40".into()));
        item.insert("generation".to_string(), AttributeValue::N("1".into()));
        client
            .put_item()
            .table_name(&table)
            .set_item(Some(item))
            .send()
            .await
            .unwrap();
    }
    assert_eq!(store.create_table().await.unwrap(), TableChange::Upgraded);
    let layout = store.check_table().await.unwrap();
    assert!(
        layout.legacy_index,
        "by_state is kept for version-1 workers"
    );
    let orphans = store.legacy_orphans(now).await.unwrap();
    let names: Vec<_> = orphans
        .records
        .iter()
        .map(|r| r.key.name.as_str())
        .collect();
    assert_eq!(
        names,
        vec!["lapsed"],
        "a live version-1 lease is not an orphan"
    );
    let lapsed = &orphans.records[0];
    let me = Incarnation::new("new");
    store.register(&me, None).await.unwrap();
    let Ownership::Legacy {
        owner,
        expires_at_ms,
    } = lapsed.ownership()
    else {
        panic!()
    };
    match store
        .acquire(
            lapsed,
            &AcquireFrom::LegacyExpired {
                owner,
                expires_at_ms,
            },
            &me,
        )
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, record } => {
            assert_eq!(lease.counter, 5);
            assert_eq!(record.checkpoint, Some(40));
            assert_eq!(
                record.lease_expires_at_ms,
                tether::lease::OWNED_EXPIRY_MS,
                "never expires for version 1"
            );
        }
        other => panic!("{other:?}"),
    }
    let held = store
        .get(&StreamKey::new("v1", "held"))
        .await
        .unwrap()
        .unwrap();
    let Ownership::Legacy {
        owner,
        expires_at_ms,
    } = held.ownership()
    else {
        panic!()
    };
    assert!(matches!(
        store
            .acquire(
                &held,
                &AcquireFrom::LegacyExpired {
                    owner,
                    expires_at_ms: expires_at_ms - 1
                },
                &me
            )
            .await
            .unwrap(),
        AcquireOutcome::Taken { .. }
    ));
    assert_eq!(store.finish_upgrade().await.unwrap(), 0);
    assert!(!store.check_table().await.unwrap().legacy_index);
}

/// Rolling from 0.2 (the release before the change counter) on one table:
/// while a 0.2 worker is LIVE the new ones make full passes (0.2 releases
/// move no counter), its drained streams are taken at once, nothing is
/// served twice or lost, and once the fleet is all new it goes quiet and
/// still takes a new stream at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_from_0_2_keeps_full_passes_until_every_worker_moves_the_counter() {
    let previous = release_binary("TETHER_PREVIOUS_BIN", "0.2");
    let bed = Bed::start(
        EXE,
        tether_testkit::bed::BedOptions {
            rate: 10,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut names = bed.apply("roll", 8).await.unwrap();
    let mut old_fleet = bed.fleet.clone();
    old_fleet.workers.exe = previous;
    let mut old_a = old_fleet.spawn("old-a").unwrap();
    let mut old_b = old_fleet.spawn("old-b").unwrap();
    Bed::wait(Duration::from_secs(30), "0.2 serves 4 each", || async {
        let load = bed.loads().await;
        load.len() == 2 && load.values().all(|n| *n == 4) && bed.connected_once(&names)
    })
    .await
    .unwrap();

    // A new worker beside 0.2 ones keeps making full passes.
    let new_c = bed.fleet.spawn("new-c").unwrap();
    Bed::wait(Duration::from_secs(20), "new-c takes its share", || async {
        bed.owned_by("new-c").await >= 2
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        new_c.queries_the_fleet(Duration::from_secs(3)).await,
        "a new worker went quiet beside a 0.2 worker, whose releases move no counter"
    );
    // A 0.2 worker drains: its streams are taken at once.
    old_a.signal(Signal::SIGTERM).unwrap();
    assert!(old_a.wait(Duration::from_secs(15)).await.unwrap().success());
    Bed::wait(
        Duration::from_secs(5),
        "old-a's streams are served again",
        || async { bed.owned_by("old-a").await == 0 && bed.all_connected_once(&names).await },
    )
    .await
    .unwrap();

    let new_d = bed.fleet.spawn("new-d").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    old_b.signal(Signal::SIGTERM).unwrap();
    assert!(old_b.wait(Duration::from_secs(15)).await.unwrap().success());
    Bed::wait(
        Duration::from_secs(10),
        "the new workers serve everything",
        || async {
            let load = bed.loads().await;
            load.len() == 2
                && load.values().sum::<usize>() == 8
                && bed.all_connected_once(&names).await
        },
    )
    .await
    .unwrap();

    // All new: quiet, and still quick to take a new stream.
    tether_testkit::processes::until_quiet(&[&new_c, &new_d], Duration::from_secs(30))
        .await
        .unwrap();
    bed.apply_one_served_within(
        "late",
        &mut names,
        Duration::from_secs(5),
        "a stream applied to the quiet fleet is served",
    )
    .await
    .unwrap();
    bed.assert_safe(&names, 0);
}

/// Rolling from 0.3 (whose workers read checkpoints by name only) on one
/// table: while a 0.3 worker is LIVE a new worker packs its checkpoints by
/// name, so when it is SIGKILLed the 0.3 worker resumes its busy streams
/// from them rather than from where they were taken; once every worker is
/// new, checkpoints go by slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_from_0_3_packs_by_name_while_a_0_3_worker_may_take_over() {
    let previous = release_binary("TETHER_RELEASE_0_3_BIN", "0.3");
    let bed = Bed::start(EXE, Default::default()).await.unwrap();
    let names = bed.apply("roll", 6).await.unwrap();
    let victim = bed
        .fleet
        .spawn_with("new-victim", bed.fleet.endpoint(), &["--no-rebalance"])
        .unwrap();
    Bed::wait(
        Duration::from_secs(20),
        "new-victim serves everything, by slot while alone",
        || async {
            bed.owned_by("new-victim").await == names.len()
                && bed.connected_once(&names)
                && bed.packs_by_slot("new-victim").await
        },
    )
    .await
    .unwrap();
    let mut old_fleet = bed.fleet.clone();
    old_fleet.workers.exe = previous;
    let mut old = old_fleet.spawn("old-a").unwrap();
    Bed::wait(
        Duration::from_secs(15),
        "new-victim packs by name beside a 0.3 worker",
        || bed.packs_by_name("new-victim", names.len()),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(bed.packs_by_name("new-victim", names.len()).await);
    victim.signal(Signal::SIGKILL).unwrap();
    Bed::wait(
        Duration::from_secs(15),
        "the 0.3 worker holds every stream",
        || async {
            bed.owned_by("old-a").await == names.len() && bed.all_connected_once(&names).await
        },
    )
    .await
    .unwrap();
    bed.until_data_flows_again(&names, Duration::from_secs(10))
        .await
        .unwrap();
    let replayed = bed.most_replayed(&names);
    assert!(
        replayed <= 50,
        "a stream replayed {replayed} messages: the 0.3 worker did not find its checkpoint"
    );

    // The fleet rolls on: a new worker takes over from the draining 0.3 one
    // and, alone with new workers, packs by slot.
    let _new_b = bed.fleet.spawn("new-b").unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    old.signal(Signal::SIGTERM).unwrap();
    assert!(old.wait(Duration::from_secs(15)).await.unwrap().success());
    Bed::wait(
        Duration::from_secs(15),
        "new-b serves everything, by slot",
        || async {
            bed.owned_by("new-b").await == names.len()
                && bed.all_connected_once(&names).await
                && bed.packs_by_slot("new-b").await
        },
    )
    .await
    .unwrap();
    bed.assert_safe(&names, 100);
}
