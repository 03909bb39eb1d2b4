//! Controller call sequences against a tower-test mock of the Kubernetes API,
//! with the real (embedded) DynamoDB-compatible store behind the lease table.

use http::{Method, Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tether::controller::{Context, ControllerSettings, FINALIZER, reconcile};
use tether::crd::{StreamConnection, StreamConnectionSpec};
use tether::lease::{AcquireFrom, DesiredState, Incarnation, LeaseStore, StreamKey};
use tower_test::mock::{Handle, pair};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn sc(name: &str, url: &str) -> StreamConnection {
    let spec: StreamConnectionSpec =
        serde_json::from_value(json!({"url": url, "sink": {"log": {}}})).unwrap();
    let mut obj = StreamConnection::new(name, spec);
    obj.metadata.namespace = Some("ns".into());
    obj.metadata.generation = Some(3);
    obj.metadata.uid = Some(format!("uid-{name}"));
    obj.metadata.resource_version = Some("1".into());
    obj
}

/// With the finalizer on, and claimed for `table` (as the controller leaves
/// a resource it mirrors).
fn finalized(table: &str, mut obj: StreamConnection) -> StreamConnection {
    obj.metadata.finalizers = Some(vec![FINALIZER.into()]);
    obj.metadata.annotations = Some([("tether.dev/table".to_string(), table.to_string())].into());
    obj
}

fn deleting(mut obj: StreamConnection) -> StreamConnection {
    obj.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    obj
}

fn settings(installation: &str) -> ControllerSettings {
    ControllerSettings {
        instance: "test-pod".into(),
        installation: installation.into(),
        namespaces: Vec::new(),
        status_refresh: Duration::from_secs(10),
        progress_interval: Duration::from_secs(300),
        leader_namespace: "default".into(),
        leader_lease: Duration::from_secs(15),
        gc_grace: Duration::from_secs(600),
    }
}

async fn setup() -> (Arc<Context>, ApiHandle, LeaseStore) {
    let store = tether_testkit::store::fresh_store(None).await;
    let (service, handle) = pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    (
        Arc::new(Context::new(
            client,
            store.clone(),
            settings(""),
            Arc::default(),
        )),
        handle,
        store,
    )
}

/// Takes the next API call, checks method and path, answers `reply`, and
/// returns the request body as JSON.
async fn expect(
    handle: &mut ApiHandle,
    method: Method,
    path_prefix: &str,
    reply: Value,
) -> (String, Value) {
    expect_answering(handle, method, path_prefix, 200, reply).await
}

/// [`expect`], answering with HTTP status `status`.
async fn expect_answering(
    handle: &mut ApiHandle,
    method: Method,
    path_prefix: &str,
    status: u16,
    reply: Value,
) -> (String, Value) {
    let (request, send) = handle.next_request().await.expect("an API call");
    assert_eq!(
        request.method(),
        method,
        "{} {}",
        request.method(),
        request.uri()
    );
    let uri = request.uri().to_string();
    assert!(
        uri.starts_with(path_prefix),
        "expected {path_prefix}…, got {uri}"
    );
    let content_type = request
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    send.send_response(
        Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap(),
    );
    (format!("{content_type} {uri}"), body)
}

const OBJ_PATH: &str = "/apis/tether.dev/v1alpha1/namespaces/ns/streamconnections/";

/// After the calls a test answered: no further API call, and nothing
/// mirrored for `name` (`why` says why not).
async fn no_further_calls_and_not_mirrored(
    handle: &mut ApiHandle,
    store: &LeaseStore,
    name: &str,
    why: &str,
) {
    let next =
        tokio::time::timeout(std::time::Duration::from_millis(200), handle.next_request()).await;
    assert!(!matches!(next, Ok(Some(_))), "no further calls");
    assert_eq!(
        store.get(&StreamKey::new("ns", name)).await.unwrap(),
        None,
        "{why}"
    );
}

#[tokio::test]
async fn a_new_resource_first_gets_the_finalizer_and_nothing_else() {
    let (ctx, mut handle, store) = setup().await;
    let obj = sc("fresh", "ws://127.0.0.1:9/x");
    let table = store.identity();
    let server = tokio::spawn(async move {
        let reply =
            serde_json::to_value(finalized(&table, sc("fresh", "ws://127.0.0.1:9/x"))).unwrap();
        let (_, body) = expect(
            &mut handle,
            Method::PATCH,
            &format!("{OBJ_PATH}fresh"),
            reply,
        )
        .await;
        assert!(
            body.to_string().contains(FINALIZER),
            "finalizer patch: {body}"
        );
        handle
    });
    reconcile(Arc::new(obj), ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    no_further_calls_and_not_mirrored(
        &mut handle,
        &store,
        "fresh",
        "not mirrored before the finalizer is on",
    )
    .await;
}

#[tokio::test]
async fn a_finalized_resource_is_mirrored_and_its_status_applied() {
    let (ctx, mut handle, store) = setup().await;
    let obj = finalized(&store.identity(), sc("feed", "ws://127.0.0.1:9/x"));
    let reply = serde_json::to_value(&obj).unwrap();
    let server = tokio::spawn(async move {
        let (call, body) = expect(
            &mut handle,
            Method::PATCH,
            &format!("{OBJ_PATH}feed/status"),
            reply,
        )
        .await;
        assert!(
            call.starts_with("application/apply-patch+yaml"),
            "server-side apply: {call}"
        );
        assert!(
            call.contains("fieldManager=tether-controller") && call.contains("force=true"),
            "{call}"
        );
        assert_eq!(body["status"]["phase"], "Pending");
        assert_eq!(body["status"]["observedGeneration"], 3);
        let owned = body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Owned")
            .unwrap();
        assert_eq!(owned["reason"], "NoOwner");
    });
    reconcile(Arc::new(obj), ctx).await.unwrap();
    server.await.unwrap();
    let item = store
        .get(&StreamKey::new("ns", "feed"))
        .await
        .unwrap()
        .expect("mirrored");
    assert_eq!(
        (item.desired_state, item.generation, item.lease_owner),
        (DesiredState::Started, 3, None)
    );
}

#[tokio::test]
async fn at_steady_state_a_reconcile_is_one_read_and_no_write_anywhere() {
    let metrics = tether::metrics::Metrics::new();
    let store = LeaseStore::connect(
        tether_testkit::store::store_config(&tether_testkit::store::unique_table("t")),
        metrics.store.clone(),
    )
    .await
    .unwrap();
    store.create_table().await.unwrap();
    let (service, mut handle) = pair::<Request<Body>, Response<Body>>();
    let ctx = Arc::new(Context::new(
        Client::new(service, "default"),
        store.clone(),
        settings(""),
        Arc::default(),
    ));
    let obj = finalized(&store.identity(), sc("steady", "ws://127.0.0.1:9/x"));
    let reply = serde_json::to_value(&obj).unwrap();
    let server = tokio::spawn(async move {
        let (_, body) = expect(
            &mut handle,
            Method::PATCH,
            &format!("{OBJ_PATH}steady/status"),
            reply,
        )
        .await;
        (handle, body)
    });
    reconcile(Arc::new(obj.clone()), ctx.clone()).await.unwrap();
    let (mut handle, body) = server.await.unwrap();
    // The next reconcile sees the status it wrote and an item that matches.
    let mut current = obj;
    current.status = Some(serde_json::from_value(body["status"].clone()).unwrap());
    let count = |op: &str| {
        tether_testkit::processes::metric_sum(
            &metrics.encode(),
            "tether_dynamodb_requests_total",
            &format!("operation=\"{op}\""),
        )
    };
    let (reads, writes) = (count("get_item"), count("upsert_desired"));
    reconcile(Arc::new(current), ctx).await.unwrap();
    let next = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(!matches!(next, Ok(Some(_))), "no API call at steady state");
    assert_eq!(count("upsert_desired"), writes, "no table write");
    assert_eq!(count("get_item"), reads + 1.0, "one read of the item");
}

/// Reconciles `obj`, expecting `Ready=False/InvalidSpec` naming `field`, a
/// Warning event, no table write and no retry until the object changes.
async fn assert_refused_as_invalid(obj: StreamConnection, field: &'static str) {
    let (ctx, mut handle, store) = setup().await;
    let name = obj.metadata.name.clone().unwrap();
    let obj = finalized(&store.identity(), obj);
    let reply = serde_json::to_value(&obj).unwrap();
    let status_path = format!("{OBJ_PATH}{name}/status");
    let server = tokio::spawn(async move {
        let (_, body) = expect(&mut handle, Method::PATCH, &status_path, reply.clone()).await;
        let ready = body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()
            .clone();
        assert_eq!(
            (ready["status"].as_str(), ready["reason"].as_str()),
            (Some("False"), Some("InvalidSpec"))
        );
        assert!(
            ready["message"].as_str().unwrap().contains(field),
            "{ready}"
        );
        // A Warning event says the same.
        let (_, event) = expect(
            &mut handle,
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/ns/events",
            json!({}),
        )
        .await;
        assert_eq!(
            (event["type"].as_str(), event["reason"].as_str()),
            (Some("Warning"), Some("InvalidSpec"))
        );
    });
    let action = reconcile(Arc::new(obj), ctx).await.unwrap();
    server.await.unwrap();
    assert_eq!(
        action,
        kube::runtime::controller::Action::await_change(),
        "waits for a change, no hot loop"
    );
    assert_eq!(store.get(&StreamKey::new("ns", &name)).await.unwrap(), None);
}

#[tokio::test]
async fn an_invalid_spec_gets_a_condition_and_no_table_write() {
    assert_refused_as_invalid(sc("bad", "http://not-a-websocket/"), "spec.url").await;
}

#[tokio::test]
async fn a_resource_cannot_read_the_operators_environment_through_a_header() {
    let mut obj = sc("exfiltrate", "wss://attacker.example/feed");
    obj.spec.headers = vec![tether::crd::HeaderSpec {
        name: "X-Key".into(),
        value_from: tether::crd::HeaderValueSource {
            env: Some("AWS_SECRET_ACCESS_KEY".into()),
            secret_key_ref: None,
        },
    }];
    assert_refused_as_invalid(obj, "spec.headers[0].valueFrom.env").await;
}

#[tokio::test]
async fn deletion_stops_the_stream_removes_the_item_then_the_finalizer() {
    let (ctx, mut handle, store) = setup().await;
    let obj = deleting(finalized(
        &store.identity(),
        sc("gone", "ws://127.0.0.1:9/x"),
    ));
    let key = StreamKey::new("ns", "gone");
    store
        .upsert_desired(&obj.spec.to_desired(key.clone(), 3, None))
        .await
        .unwrap();
    let reply = serde_json::to_value(sc("gone", "ws://127.0.0.1:9/x")).unwrap();
    let server = tokio::spawn(async move {
        let (_, event) = expect(
            &mut handle,
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/ns/events",
            json!({}),
        )
        .await;
        assert_eq!(event["reason"], "Deleted");
        let (_, body) = expect(
            &mut handle,
            Method::PATCH,
            &format!("{OBJ_PATH}gone"),
            reply,
        )
        .await;
        assert!(
            body.to_string().contains("remove"),
            "finalizer removal: {body}"
        );
    });
    reconcile(Arc::new(obj), ctx).await.unwrap();
    server.await.unwrap();
    let tombstone = store
        .get(&key)
        .await
        .unwrap()
        .expect("a tombstone keeps the token");
    assert!(tombstone.is_tombstone(), "item deleted");
}

#[tokio::test]
async fn deletion_waits_while_a_worker_still_holds_the_lease() {
    let (ctx, handle, store) = setup().await;
    let obj = deleting(finalized(
        &store.identity(),
        sc("held", "ws://127.0.0.1:9/x"),
    ));
    let key = StreamKey::new("ns", "held");
    store
        .upsert_desired(&obj.spec.to_desired(key.clone(), 3, None))
        .await
        .unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    let w1 = Incarnation::new("w1");
    store.register(&w1, None).await.unwrap();
    store
        .acquire(&record, &AcquireFrom::Free, &w1)
        .await
        .unwrap();
    let err = reconcile(Arc::new(obj), ctx).await.unwrap_err();
    assert!(
        matches!(err, tether::controller::Error::WaitingForRelease { ref owner } if owner == w1.as_str()),
        "{err}"
    );
    let item = store.get(&key).await.unwrap().expect("kept until released");
    assert_eq!(
        item.desired_state,
        DesiredState::Stopped,
        "the owner is told to stop"
    );
    assert_eq!(
        item.lease_owner.as_deref(),
        Some(w1.as_str()),
        "the mirror never touches the lease"
    );
    drop(handle);
}

#[tokio::test]
async fn an_unclaimed_resource_is_claimed_for_this_table_before_anything_is_mirrored() {
    let (ctx, mut handle, store) = setup().await;
    let mut obj = sc("unclaimed", "ws://127.0.0.1:9/x");
    obj.metadata.finalizers = Some(vec![FINALIZER.into()]);
    obj.metadata.resource_version = Some("7".into());
    let table = store.identity();
    let probe = store.clone();
    let server = tokio::spawn(async move {
        // Another writer came first: the claim is refused on the version.
        let conflict = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "reason": "Conflict", "code": 409, "message": "conflict"});
        let (call, body) = expect_answering(
            &mut handle,
            Method::PATCH,
            &format!("{OBJ_PATH}unclaimed"),
            409,
            conflict,
        )
        .await;
        assert!(call.starts_with("application/merge-patch+json"), "{call}");
        assert_eq!(
            body["metadata"]["resourceVersion"], "7",
            "conditioned on the version read"
        );
        assert_eq!(
            body["metadata"]["annotations"]["tether.dev/table"],
            table.as_str()
        );
        assert_eq!(
            probe.get(&StreamKey::new("ns", "unclaimed")).await.unwrap(),
            None,
            "nothing mirrored before the claim"
        );
        handle
    });
    // The 409 is not an error: the reconcile comes back shortly to look again.
    reconcile(Arc::new(obj), ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    no_further_calls_and_not_mirrored(
        &mut handle,
        &store,
        "unclaimed",
        "not mirrored without the claim",
    )
    .await;
}
