//! Proof that this container's predecessor is gone, from the kubelet's own
//! record: when a container restarts inside its pod, the API server shows the
//! new container's `restartCount`, and the previous process (which recorded a
//! lower count in its worker item) cannot be running — containers of one name
//! in one pod run one at a time. Its streams are then taken back at once
//! instead of after a lease. Without that proof (standalone, a stale status),
//! nothing is assumed and peers wait for the lease as usual.
//!
//! The proof holds only for a process that really is that pod's container.
//! `POD_NAME` is just an environment variable: a process elsewhere with a
//! copied or hard-coded one would read another pod's status, record its
//! restart count, and be declared dead (while alive) when that pod's
//! container next restarts. So the pod and container are also read from this
//! process's own mount table: the kubelet bind-mounts each container's
//! termination log from `<kubelet root>/pods/<pod uid>/containers/<container
//! name>/<id>`, which no environment can claim. The proof is used only when
//! the mounted pod UID is the UID the API server gives `POD_NAME`, and the
//! container name is taken from the mount.

use crate::lease::PodIdentity;
use k8s_openapi::api::core::v1::Pod;

/// This process's own mount table.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// Where to read this process's own pod.
#[derive(Clone)]
pub struct PodLookup {
    client: kube::Client,
    namespace: String,
    name: String,
}

impl PodLookup {
    /// From the downward API variables the chart sets (`POD_NAME`,
    /// `POD_NAMESPACE`); `None` outside a pod.
    pub fn from_env(client: kube::Client) -> Option<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Some(Self {
            client,
            namespace: var("POD_NAMESPACE")?,
            name: var("POD_NAME")?,
        })
    }

    /// This container's identity, if its own mounts say it runs in the pod
    /// named `POD_NAME` and the API server says that container is running.
    pub async fn identity(&self) -> Option<PodIdentity> {
        let mounts = std::fs::read_to_string(MOUNTINFO).unwrap_or_default();
        let Some(mounted) = kubelet_mount(&mounts) else {
            tracing::info!(pod = %self.name, "no kubelet mount in this process's mount table (not a container a kubelet started): a container restart will wait for the lease");
            return None;
        };
        let api: kube::Api<Pod> = kube::Api::namespaced(self.client.clone(), &self.namespace);
        let pod = match api.get(&self.name).await {
            Ok(pod) => pod,
            Err(e) => {
                tracing::warn!(pod = %self.name, error = %e, "cannot read this pod; a container restart will wait for the lease");
                return None;
            }
        };
        if pod.metadata.uid.as_deref() != Some(mounted.pod_uid.as_str()) {
            tracing::warn!(pod = %self.name, api_uid = ?pod.metadata.uid, mounted_uid = %mounted.pod_uid, "POD_NAME names a pod this process does not run in (a copied or hard-coded POD_NAME?): a container restart will wait for the lease");
            return None;
        }
        let identity = identity_of(&pod, &mounted.container);
        match &identity {
            Some(id) => {
                tracing::info!(pod = %self.name, container = %id.container, restarts = id.restart_count, "running in a pod: a restart of this container can prove its predecessor gone")
            }
            None => {
                tracing::warn!(pod = %self.name, container = %mounted.container, "this pod's status shows no running container of that name; a container restart will wait for the lease")
            }
        }
        identity
    }
}

/// The pod and container a kubelet started this process in, as its mount
/// table shows them.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct KubeletMount {
    pub pod_uid: String,
    pub container: String,
}

/// Finds the kubelet's per-container mount (the termination log, from
/// `…/pods/<uid>/containers/<name>/<id>`) in a `/proc/self/mountinfo` text.
/// The path is matched on its tail, since the kubelet's root directory is
/// configurable and may be a file system of its own (then the mount's root
/// starts at `/pods/`). `None` when there is none, or more than one
/// container's (nothing to trust).
pub(super) fn kubelet_mount(mountinfo: &str) -> Option<KubeletMount> {
    let mut found: Option<KubeletMount> = None;
    for line in mountinfo.lines() {
        // Fields: id, parent, major:minor, root, mount point, ...
        let Some(root) = line.split(' ').nth(3) else {
            continue;
        };
        let Some((_, tail)) = root.rsplit_once("/pods/") else {
            continue;
        };
        let mut parts = tail.split('/');
        let (Some(uid), Some("containers"), Some(container), Some(_id)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if uid.is_empty() || container.is_empty() {
            continue;
        }
        let this = KubeletMount {
            pod_uid: uid.to_string(),
            container: container.to_string(),
        };
        match &found {
            Some(seen) if *seen != this => return None,
            _ => found = Some(this),
        }
    }
    found
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

    /// Lines as a kubelet's container shows them (containerd, kubelet root on
    /// the root file system, and on a file system of its own).
    const CONTAINERD: &str = "\
1510 1420 0:391 / / rw,relatime master:610 - overlay overlay rw,lowerdir=/var/lib/containerd/snapshots/1/fs
1516 1510 259:1 /var/lib/kubelet/pods/8f3c2a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c/etc-hosts /etc/hosts rw,relatime - ext4 /dev/nvme0n1p1 rw
1517 1510 259:1 /var/lib/kubelet/pods/8f3c2a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c/containers/tether/5d1e0a9c /dev/termination-log rw,relatime - ext4 /dev/nvme0n1p1 rw
1518 1510 259:1 /var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/abc/hostname /etc/hostname rw,relatime - ext4 /dev/nvme0n1p1 rw
1519 1510 0:380 / /var/run/secrets/kubernetes.io/serviceaccount ro,relatime - tmpfs tmpfs rw
";

    #[test]
    fn the_kubelets_termination_log_mount_names_the_pod_and_container() {
        let mine = KubeletMount {
            pod_uid: "8f3c2a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c".into(),
            container: "tether".into(),
        };
        assert_eq!(kubelet_mount(CONTAINERD), Some(mine));
        let own_fs = "42 30 8:17 /pods/u-9/containers/worker/0a1b /dev/termination-log rw - xfs /dev/sdb1 rw\n";
        assert_eq!(
            kubelet_mount(own_fs),
            Some(KubeletMount {
                pod_uid: "u-9".into(),
                container: "worker".into()
            })
        );
    }

    #[test]
    fn no_kubelet_mount_or_two_containers_mounts_prove_nothing() {
        // A process on a laptop, or in a container no kubelet started.
        let plain = "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
                     23 22 0:5 / /dev rw - devtmpfs udev rw\n";
        assert_eq!(kubelet_mount(plain), None);
        // Only the pod-level hosts file: no container named.
        let pod_only =
            "1516 1510 259:1 /var/lib/kubelet/pods/u-1/etc-hosts /etc/hosts rw - ext4 /dev/x rw\n";
        assert_eq!(kubelet_mount(pod_only), None);
        // Two containers' mounts: which one this is cannot be told.
        let two = "1 0 8:1 /var/lib/kubelet/pods/u-1/containers/a/1 /dev/termination-log rw - ext4 /dev/x rw\n\
                   2 0 8:1 /var/lib/kubelet/pods/u-1/containers/b/2 /mnt/log rw - ext4 /dev/x rw\n";
        assert_eq!(kubelet_mount(two), None);
    }
}
