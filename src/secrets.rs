//! Resolving header value references at connect time. Values are held only for
//! the handshake: never written to the table, never logged.

use crate::crd::HeaderValueSource;
use k8s_openapi::api::core::v1::Secret;

/// Where header references are resolved.
#[derive(Clone)]
pub enum SecretSource {
    /// Standalone workers: only `env` references work (the operator of a
    /// standalone fleet writes every stream, so its environment is theirs).
    Standalone,
    /// `tether operator`: `secretKeyRef` reads a Secret in the stream's namespace.
    Kubernetes(kube::Client),
}

impl SecretSource {
    /// The value a reference points at, or a message saying what is missing
    /// (without the value, which may be partly present).
    pub async fn resolve(
        &self,
        namespace: &str,
        source: &HeaderValueSource,
    ) -> Result<String, String> {
        if let Some(var) = &source.env {
            if let Self::Kubernetes(_) = self {
                // The controller refuses such resources; an item written into
                // a shared table by `tether apply` must not get around it.
                return Err(format!(
                    "valueFrom.env ({var}) is refused in Kubernetes mode: it would read the operator's own environment; use secretKeyRef"
                ));
            }
            return std::env::var(var)
                .map_err(|_| format!("environment variable {var} is not set on the worker"));
        }
        let Some(sel) = &source.secret_key_ref else {
            return Err("header has no value source".into());
        };
        let client = match self {
            Self::Kubernetes(client) => client,
            Self::Standalone => {
                return Err(format!(
                    "secretKeyRef {}/{} needs Kubernetes mode (tether operator); use valueFrom.env in standalone mode",
                    sel.name, sel.key
                ));
            }
        };
        let api: kube::Api<Secret> = kube::Api::namespaced(client.clone(), namespace);
        let secret = api
            .get_opt(&sel.name)
            .await
            .map_err(|e| format!("cannot read Secret {namespace}/{}: {e}", sel.name))?
            .ok_or_else(|| format!("Secret {namespace}/{} not found", sel.name))?;
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&sel.key))
            .ok_or_else(|| format!("Secret {namespace}/{} has no key {}", sel.name, sel.key))?;
        String::from_utf8(bytes.0.clone()).map_err(|_| {
            format!(
                "Secret {namespace}/{} key {} is not UTF-8",
                sel.name, sel.key
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn kubernetes_mode_never_reads_the_operators_environment() {
        // PATH is set in every test process: standalone mode reads it.
        let (service, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let source = SecretSource::Kubernetes(kube::Client::new(service, "default"));
        let reference = HeaderValueSource {
            env: Some("PATH".into()),
            secret_key_ref: None,
        };
        let refused = source.resolve("tenant", &reference).await.unwrap_err();
        assert!(refused.contains("refused in Kubernetes mode"), "{refused}");
        assert!(
            SecretSource::Standalone
                .resolve("tenant", &reference)
                .await
                .is_ok()
        );
    }
}
