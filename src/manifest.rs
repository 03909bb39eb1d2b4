//! Reading `StreamConnection` manifests for `tether apply`: multi-document YAML
//! files or directories of them, each problem reported with its file, document
//! index and field, without stopping the valid documents from applying.

use crate::crd::StreamConnectionSpec;
use crate::lease::StreamKey;
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

pub const API_VERSION: &str = "tether.dev/v1alpha1";
pub const KIND: &str = "StreamConnection";

/// One valid manifest.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub file: PathBuf,
    /// 1-based index of the document within its file.
    pub document: usize,
    pub key: StreamKey,
    pub spec: StreamConnectionSpec,
}

/// One invalid document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    pub file: PathBuf,
    pub document: usize,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} document {}: {}: {}",
            self.file.display(),
            self.document,
            self.field,
            self.message
        )
    }
}

#[derive(Deserialize)]
struct Metadata {
    name: Option<String>,
    namespace: Option<String>,
}

/// Reads every `.yaml`/`.yml`/`.json` file at `path` (a file or a directory,
/// not recursive, in name order).
pub fn load(path: &Path) -> (Vec<Manifest>, Vec<ManifestError>) {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    let file_error = |file: &Path, message: String| ManifestError {
        file: file.to_path_buf(),
        document: 0,
        field: "-".into(),
        message,
    };
    if path.is_dir() {
        match std::fs::read_dir(path) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    let p = entry.path();
                    if matches!(
                        p.extension().and_then(|e| e.to_str()),
                        Some("yaml" | "yml" | "json")
                    ) {
                        files.push(p);
                    }
                }
            }
            Err(e) => errors.push(file_error(path, format!("cannot read directory: {e}"))),
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut manifests = Vec::new();
    for file in files {
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                let (m, e) = parse(&file, &text);
                manifests.extend(m);
                errors.extend(e);
            }
            Err(e) => errors.push(file_error(&file, format!("cannot read file: {e}"))),
        }
    }
    (manifests, errors)
}

/// Parses the documents of one file.
pub fn parse(file: &Path, text: &str) -> (Vec<Manifest>, Vec<ManifestError>) {
    let mut manifests = Vec::new();
    let mut errors = Vec::new();
    for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let index = i + 1;
        let error = |field: &str, message: String| ManifestError {
            file: file.to_path_buf(),
            document: index,
            field: field.to_string(),
            message,
        };
        let value = match serde_yaml::Value::deserialize(document) {
            Ok(serde_yaml::Value::Null) => continue, // empty document (e.g. trailing `---`)
            Ok(v) => v,
            Err(e) => {
                errors.push(error("-", format!("not valid YAML: {e}")));
                // A syntax error leaves the rest of the stream unreadable.
                break;
            }
        };
        match document_to_manifest(file, index, value) {
            Ok(m) => manifests.push(m),
            Err(mut e) => errors.append(&mut e),
        }
    }
    (manifests, errors)
}

fn document_to_manifest(
    file: &Path,
    index: usize,
    value: serde_yaml::Value,
) -> Result<Manifest, Vec<ManifestError>> {
    let error = |field: &str, message: String| ManifestError {
        file: file.to_path_buf(),
        document: index,
        field: field.to_string(),
        message,
    };
    let get = |k: &str| value.get(k);
    let api_version = get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    if api_version != API_VERSION {
        return Err(vec![error(
            "apiVersion",
            format!("must be {API_VERSION}, got '{api_version}'"),
        )]);
    }
    let kind = get("kind").and_then(|v| v.as_str()).unwrap_or_default();
    if kind != KIND {
        return Err(vec![error("kind", format!("must be {KIND}, got '{kind}'"))]);
    }
    let metadata: Metadata = match get("metadata").cloned().map(serde_yaml::from_value) {
        Some(Ok(m)) => m,
        Some(Err(e)) => return Err(vec![error("metadata", e.to_string())]),
        None => return Err(vec![error("metadata.name", "is required".into())]),
    };
    let name = metadata.name.unwrap_or_default();
    if !is_dns_subdomain(&name) {
        return Err(vec![error(
            "metadata.name",
            format!(
                "'{name}' must be a DNS subdomain (lowercase letters, digits, '-', '.'; at most 253)"
            ),
        )]);
    }
    let namespace = metadata.namespace.unwrap_or_else(|| "default".into());
    if !is_dns_label(&namespace) {
        return Err(vec![error(
            "metadata.namespace",
            format!("'{namespace}' must be a DNS label"),
        )]);
    }
    let Some(spec_value) = get("spec").cloned() else {
        return Err(vec![error("spec", "is required".into())]);
    };
    let spec: StreamConnectionSpec = serde_path_to_error::deserialize(spec_value).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "spec".to_string()
        } else {
            format!("spec.{path}")
        };
        vec![error(&field, e.into_inner().to_string())]
    })?;
    spec.validate().map_err(|errs| {
        errs.into_iter()
            .map(|e| error(&e.field, e.message))
            .collect::<Vec<_>>()
    })?;
    Ok(Manifest {
        file: file.to_path_buf(),
        document: index,
        key: StreamKey::new(namespace, name),
        spec,
    })
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOCS: &str = r#"
apiVersion: tether.dev/v1alpha1
kind: StreamConnection
metadata: {name: good, namespace: feeds}
spec:
  url: wss://feed.example/a?after={last_seq}
  sink: {log: {}}
---
apiVersion: tether.dev/v1alpha1
kind: StreamConnection
metadata: {name: bad-url}
spec:
  url: https://not-ws.example/
  sink: {log: {}}
---
apiVersion: tether.dev/v1alpha1
kind: StreamConnection
metadata: {name: bad-type}
spec:
  url: ws://x.example/
  keepalive: {intervalSeconds: "often"}
  sink: {log: {}}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: other}
---
"#;

    #[test]
    fn every_bad_document_is_named_and_the_good_ones_survive() {
        let (ok, errors) = parse(Path::new("streams.yaml"), DOCS);
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].key, StreamKey::new("feeds", "good"));
        let summary: Vec<(usize, &str)> = errors
            .iter()
            .map(|e| (e.document, e.field.as_str()))
            .collect();
        assert_eq!(
            summary,
            [
                (2, "spec.url"),
                (3, "spec.keepalive.intervalSeconds"),
                (4, "apiVersion")
            ]
        );
        assert!(
            errors[0]
                .to_string()
                .starts_with("streams.yaml document 2: spec.url:")
        );
    }

    #[test]
    fn names_must_be_kubernetes_names() {
        let doc = "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: Bad_Name}\nspec: {url: 'ws://x/', sink: {log: {}}}\n";
        let (_, errors) = parse(Path::new("f.yaml"), doc);
        assert_eq!(errors[0].field, "metadata.name");
    }
}

#[cfg(test)]
mod examples {
    /// Every sample under `examples/` is a valid manifest (the chart CI also
    /// validates them against the generated CRD's OpenAPI schema).
    #[test]
    fn shipped_examples_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        let (manifests, errors) = super::load(&dir);
        let errors: Vec<String> = errors
            .iter()
            .filter(|e| e.field != "apiVersion") // the Secret in the auth example
            .map(ToString::to_string)
            .collect();
        assert!(errors.is_empty(), "{errors:#?}");
        assert_eq!(manifests.len(), 3);
    }
}
