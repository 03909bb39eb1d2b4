//! Proof that this container's predecessor is gone, from the kubelet's own
//! record: when a container restarts inside its pod, the API server shows the
//! new container's `restartCount`, and the previous process (which recorded a
//! lower count in its worker item) cannot be running — containers of one name
//! in one pod run one at a time. Its streams are then taken back at once
//! instead of after a lease. Without that proof (standalone, a stale status),
//! nothing is assumed and peers wait for the lease as usual.

use crate::lease::PodIdentity;
use k8s_openapi::api::core::v1::Pod;

/// Container name assumed when `TETHER_CONTAINER_NAME` is not set (the chart's).
pub(super) const DEFAULT_CONTAINER: &str = "tether";

/// Where to read this process's own pod.
#[derive(Clone)]
pub struct PodLookup {
    client: kube::Client,
    namespace: String,
    name: String,
    container: String,
}

impl PodLookup {
    /// From the downward API variables the chart sets (`POD_NAME`,
    /// `POD_NAMESPACE`, optionally `TETHER_CONTAINER_NAME`); `None` outside a pod.
    pub fn from_env(client: kube::Client) -> Option<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Some(Self {
            client,
            namespace: var("POD_NAMESPACE")?,
            name: var("POD_NAME")?,
            container: var("TETHER_CONTAINER_NAME").unwrap_or_else(|| DEFAULT_CONTAINER.into()),
        })
    }

    /// This container's identity, if the API server says it is running.
    pub async fn identity(&self) -> Option<PodIdentity> {
        let api: kube::Api<Pod> = kube::Api::namespaced(self.client.clone(), &self.namespace);
        let pod = match api.get(&self.name).await {
            Ok(pod) => pod,
            Err(e) => {
                tracing::warn!(pod = %self.name, error = %e, "cannot read this pod; a container restart will wait for the lease");
                return None;
            }
        };
        let identity = identity_of(&pod, &self.container);
        match &identity {
            Some(id) => {
                tracing::info!(pod = %self.name, container = %id.container, restarts = id.restart_count, "running in a pod: a restart of this container can prove its predecessor gone")
            }
            None => {
                tracing::warn!(pod = %self.name, container = %self.container, "this pod's status shows no running container of that name; a container restart will wait for the lease")
            }
        }
        identity
    }
}

/// The identity in a pod's status: its UID and the running container's
/// restart count.
pub(super) fn identity_of(pod: &Pod, container: &str) -> Option<PodIdentity> {
    let uid = pod.metadata.uid.clone()?;
    let status = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == container)?;
    status.state.as_ref()?.running.as_ref()?;
    Some(PodIdentity {
        uid,
        container: container.to_string(),
        restart_count: status.restart_count.max(0) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(state: serde_json::Value, restarts: i32) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "tether-0", "uid": "u-1"},
            "status": {"containerStatuses": [{
                "name": "tether", "image": "x", "imageID": "", "ready": true,
                "restartCount": restarts, "state": state
            }]}
        }))
        .unwrap()
    }

    #[test]
    fn only_a_running_container_has_an_identity() {
        let running = pod(
            serde_json::json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}}),
            3,
        );
        assert_eq!(
            identity_of(&running, "tether"),
            Some(PodIdentity {
                uid: "u-1".into(),
                container: "tether".into(),
                restart_count: 3
            })
        );
        assert_eq!(identity_of(&running, "sidecar"), None);
        let waiting = pod(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            3,
        );
        assert_eq!(identity_of(&waiting, "tether"), None);
    }
}
