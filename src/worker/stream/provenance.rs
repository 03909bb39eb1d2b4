//! Whether a stream item came from a resource of this cluster, checked before
//! a session dials anything or resolves any secret.
//!
//! In operator mode the lease table is written by the controller, but also by
//! anyone with write access to it (`tether apply`, the CLI's IAM policy, a
//! mistake). Without this check a worker would serve any STARTED item, and
//! resolve its `secretKeyRef`s in whatever namespace the item names: write
//! access to the table would read every Secret the workers may read. So an
//! item is served only when it names this installation and a resource with
//! its UID exists under its name and namespace (one GET the first time,
//! remembered after). Standalone workers keep serving whatever the table
//! holds: whoever writes their table runs their fleet.

use crate::crd::StreamConnection;
use crate::lease::StreamKey;
use crate::support::lock;
use std::collections::HashSet;
use std::sync::Mutex;

/// Where an item says it came from (its resource's UID and installation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Origin {
    pub uid: Option<String>,
    pub installation: Option<String>,
}

/// Why a stream is not served (yet).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unverified {
    /// The item does not come from a resource of this installation: refused
    /// until it changes.
    Refused(String),
    /// The API server could not say: asked again after a backoff.
    Unavailable(String),
}

/// Who may have a stream served.
pub enum Provenance {
    /// Standalone: every item of the table.
    AnyItem,
    /// Operator mode: items of this installation's resources only.
    Resources {
        client: kube::Client,
        /// As items record it (`default` for the unnamed installation).
        installation: String,
        /// (namespace, name, uid) of resources found: a UID is never reused.
        verified: Mutex<HashSet<(String, String, String)>>,
    },
}

impl Provenance {
    /// Items of the resources of `installation` (as items record it).
    pub fn resources(client: kube::Client, installation: &str) -> Self {
        Self::Resources {
            client,
            installation: installation.to_string(),
            verified: Mutex::default(),
        }
    }

    pub(crate) async fn check(&self, key: &StreamKey, origin: &Origin) -> Result<(), Unverified> {
        let Self::Resources {
            client,
            installation,
            verified,
        } = self
        else {
            return Ok(());
        };
        let Some(uid) = origin.uid.as_deref() else {
            return Err(Unverified::Refused(format!(
                "{key} names no resource UID: in operator mode only items the controller wrote for a StreamConnection are served"
            )));
        };
        if origin.installation.as_deref() != Some(installation.as_str()) {
            return Err(Unverified::Refused(format!(
                "{key} belongs to installation '{}', not '{installation}'",
                origin.installation.as_deref().unwrap_or("")
            )));
        }
        let id = (key.namespace.clone(), key.name.clone(), uid.to_string());
        if lock(verified).contains(&id) {
            return Ok(());
        }
        let api: kube::Api<StreamConnection> =
            kube::Api::namespaced(client.clone(), &key.namespace);
        match api.get_opt(&key.name).await {
            Ok(Some(resource)) if resource.metadata.uid.as_deref() == Some(uid) => {
                lock(verified).insert(id);
                Ok(())
            }
            Ok(_) => Err(Unverified::Refused(format!(
                "no StreamConnection {key} with UID {uid} exists in this cluster"
            ))),
            Err(e) => Err(Unverified::Unavailable(format!(
                "cannot verify {key} with the API server: {e}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn standalone_serves_every_item() {
        let key = StreamKey::new("any", "thing");
        assert_eq!(
            Provenance::AnyItem.check(&key, &Origin::default()).await,
            Ok(())
        );
    }
}
