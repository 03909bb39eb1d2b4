//! Strict field validation, as `kubectl apply` does it: every field of a
//! manifest must be one the CRD's schema declares. A typo such as
//! `desiredstate: Stopped` would otherwise be dropped silently and the stream
//! applied as STARTED.

use serde_json::Value;
use std::sync::OnceLock;

/// One field the schema does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnknownField {
    /// `spec.desiredstate`
    pub path: String,
    /// A declared field that differs only in case (`desiredState`).
    pub did_you_mean: Option<String>,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown field \"{}\"", self.path)?;
        if let Some(s) = &self.did_you_mean {
            write!(f, " (did you mean \"{s}\"?)")?;
        }
        Ok(())
    }
}

/// The CRD's OpenAPI schema, generated once.
fn schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let crd = crate::crd::crd();
        crd.spec
            .versions
            .first()
            .and_then(|v| v.schema.as_ref())
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| serde_json::to_value(s).ok())
            .unwrap_or(Value::Null)
    })
}

/// Every field of `document` (a whole manifest) that the CRD does not declare.
/// `metadata` is Kubernetes' own and is not checked here.
pub(crate) fn unknown_fields(document: &Value) -> Vec<UnknownField> {
    let mut out = Vec::new();
    let Some(map) = document.as_object() else {
        return out;
    };
    let properties = schema().get("properties");
    for (key, value) in map {
        match key.as_str() {
            // The type's identity and Kubernetes' own object metadata.
            "apiVersion" | "kind" | "metadata" => {}
            _ => match properties.and_then(|p| p.get(key)) {
                Some(field_schema) => walk(value, field_schema, key, &mut out),
                None => out.push(UnknownField {
                    path: key.clone(),
                    did_you_mean: ["apiVersion", "kind", "metadata", "spec", "status"]
                        .iter()
                        .find(|k| k.eq_ignore_ascii_case(key))
                        .map(|k| k.to_string()),
                }),
            },
        }
    }
    out
}

fn walk(value: &Value, schema: &Value, path: &str, out: &mut Vec<UnknownField>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            for (key, child) in map {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                if let Some(p) = properties.and_then(|p| p.get(key)) {
                    walk(child, p, &child_path, out);
                } else if let Some(a) = additional.filter(|a| a.is_object()) {
                    walk(child, a, &child_path, out);
                } else if properties.is_some() && additional != Some(&Value::Bool(true)) {
                    out.push(UnknownField {
                        did_you_mean: properties
                            .and_then(|p| p.keys().find(|k| k.eq_ignore_ascii_case(key)).cloned()),
                        path: child_path,
                    });
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item, item_schema, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_typo_is_named_with_its_path_and_the_field_meant() {
        let doc = json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": "StreamConnection",
            "metadata": {"name": "x", "labels": {"a": "b"}},
            "spec": {
                "url": "ws://x/",
                "desiredstate": "Stopped",
                "sink": {"http": {"url": "http://s/", "maxBatch": 3}},
                "headers": [{"name": "A", "valueFrom": {"env": "X"}, "valeu": "c"}]
            },
            "extra": 1
        });
        let found: Vec<String> = unknown_fields(&doc)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            found,
            [
                "unknown field \"extra\"",
                "unknown field \"spec.desiredstate\" (did you mean \"desiredState\"?)",
                "unknown field \"spec.headers[0].valeu\"",
                "unknown field \"spec.sink.http.maxBatch\"",
            ]
        );
    }

    #[test]
    fn a_complete_valid_manifest_has_none() {
        let doc = json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": "StreamConnection",
            "metadata": {"name": "x", "namespace": "y", "annotations": {"k": "v"}},
            "spec": {"url": "ws://x/", "desiredState": "Stopped", "sink": {"log": {}}}
        });
        assert_eq!(unknown_fields(&doc), []);
    }
}
