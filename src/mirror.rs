//! What the control plane (the controller and `tether apply`) writes into the
//! lease table for a resource: the resource API on one side, the store's
//! record on the other, and the spec through its one codec. Kept apart from
//! both so neither the API types nor the store know of each other.

use crate::crd::{DesiredStateSpec, StreamConnectionSpec, stored};
use crate::lease::{DesiredState, DesiredStream, OwnerRequests, ResourceIdentity, StreamKey};
use std::collections::BTreeMap;

/// Set to a new value (a timestamp, a counter) to have the owner close the
/// session and open it again, once.
pub(crate) const RECONNECT_ANNOTATION: &str = "tether.dev/reconnect";
/// Set to a new value to have the owner hand the stream to another worker,
/// once.
pub(crate) const MOVE_ANNOTATION: &str = "tether.dev/move";

/// What a resource's annotations ask of its owner. Mirrored into the item
/// beside the spec, not in it: asking is not a spec change, and the value is
/// what the owner compares with the one it last acted on.
pub(crate) fn requests_of(annotations: &BTreeMap<String, String>) -> OwnerRequests {
    let value = |name: &str| annotations.get(name).filter(|v| !v.is_empty()).cloned();
    OwnerRequests {
        reconnect: value(RECONNECT_ANNOTATION),
        move_away: value(MOVE_ANNOTATION),
    }
}

impl From<DesiredStateSpec> for DesiredState {
    fn from(value: DesiredStateSpec) -> Self {
        match value {
            DesiredStateSpec::Started => DesiredState::Started,
            DesiredStateSpec::Stopped => DesiredState::Stopped,
        }
    }
}

impl StreamConnectionSpec {
    /// What the control plane writes into the table for this spec; `resource`
    /// identifies the Kubernetes object (none in standalone mode).
    pub fn to_desired(
        &self,
        key: StreamKey,
        generation: i64,
        resource: Option<ResourceIdentity>,
    ) -> DesiredStream {
        DesiredStream {
            key,
            desired_state: self.desired_state.into(),
            ws_url: self.url.clone(),
            spec: stored::encode(self),
            generation,
            resource,
            requests: Default::default(),
        }
    }
}
