//! What the control plane (the controller and `tether apply`) writes into the
//! lease table for a resource: the resource API on one side, the store's
//! record on the other, and the spec through its one codec. Kept apart from
//! both so neither the API types nor the store know of each other.

use crate::crd::{DesiredStateSpec, StreamConnectionSpec, stored};
use crate::lease::{DesiredState, DesiredStream, ResourceIdentity, StreamKey};

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
        }
    }
}
