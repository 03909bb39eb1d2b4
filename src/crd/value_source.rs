//! Where a secret value comes from (a header of the handshake, a sink's
//! credentials): a Secret's key in the stream's namespace, or, standalone
//! only, the worker's environment.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Exactly one source for a header value.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
// The schema is the cluster's (the CRD): there `env` is refused at admission,
// as it would read the operator's own environment. Standalone manifests are
// checked by `validate` instead, where `env` is allowed.
#[schemars(extend("x-kubernetes-validations" = [{"rule": "has(self.secretKeyRef) != has(self.env)", "message": "set exactly one of secretKeyRef and env"}, {"rule": "!has(self.env)", "message": "env is not available to resources in Kubernetes mode (it would read the operator's own environment); use secretKeyRef"}]))]
pub struct HeaderValueSource {
    /// A key of a Secret in the stream's namespace (Kubernetes mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<SecretKeyRef>,
    /// An environment variable of the worker process (standalone mode only:
    /// refused in Kubernetes mode, where it would expose the operator's environment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[A-Za-z_][A-Za-z0-9_]*$"))]
    pub env: Option<String>,
}

/// Selects a key of a Secret.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct SecretKeyRef {
    /// Secret name.
    pub name: String,
    /// Key within the Secret.
    pub key: String,
}
