//! Reading `StreamConnection` manifests for `tether apply` and `tether
//! delete -f`: multi-document YAML or JSON from files, directories (optionally
//! recursive) or standard input, each problem reported with its file, document
//! index and field, without stopping the valid documents from applying.
//! Fields the CRD does not declare are refused (strict, as kubectl), warned
//! about, or ignored.

mod unknown;

pub(crate) use unknown::unknown_fields;

use crate::crd::StreamConnectionSpec;
use crate::lease::StreamKey;
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

pub(crate) const API_VERSION: &str = "tether.dev/v1alpha1";
pub(crate) const KIND: &str = "StreamConnection";

/// One valid manifest.
#[derive(Debug, Clone)]
pub(crate) struct Manifest {
    pub key: StreamKey,
    pub spec: StreamConnectionSpec,
}

/// One invalid document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ManifestError {
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

/// What to do with fields the CRD does not declare (`--validate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Validation {
    /// Refuse the document (kubectl's default).
    #[default]
    #[value(alias = "true")]
    Strict,
    /// Apply it and print a warning per field.
    Warn,
    /// Apply it silently (the unknown fields are dropped).
    #[value(alias = "false")]
    Ignore,
}

/// Where manifests come from and how they are read.
#[derive(Clone, Debug, Default)]
pub(crate) struct LoadOptions {
    /// Descend into subdirectories (`-R`).
    pub recursive: bool,
    pub validation: Validation,
}

/// Everything read from the sources.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    pub manifests: Vec<Manifest>,
    pub errors: Vec<ManifestError>,
    /// Unknown fields under `--validate=warn`.
    pub warnings: Vec<ManifestError>,
}

/// The name standard input goes by in `-f -` and in messages.
pub(crate) const STDIN: &str = "-";

#[derive(Deserialize)]
struct Metadata {
    name: Option<String>,
    namespace: Option<String>,
}

/// Reads every source: `-` is standard input, a directory contributes its
/// `.yaml`/`.yml`/`.json` files in name order (recursively with `-R`).
pub(crate) fn load(sources: &[PathBuf], options: &LoadOptions) -> Loaded {
    let mut loaded = Loaded::default();
    let file_error = |file: &Path, message: String| ManifestError {
        file: file.to_path_buf(),
        document: 0,
        field: "-".into(),
        message,
    };
    let mut files = Vec::new();
    for source in sources {
        if source.as_os_str() == STDIN {
            files.push(source.clone());
        } else if source.is_dir() {
            if let Err(e) = collect(source, options.recursive, &mut files) {
                loaded
                    .errors
                    .push(file_error(source, format!("cannot read directory: {e}")));
            }
        } else {
            files.push(source.clone());
        }
    }
    for file in files {
        let text = if file.as_os_str() == STDIN {
            std::io::read_to_string(std::io::stdin())
        } else {
            std::fs::read_to_string(&file)
        };
        match text {
            Ok(text) => {
                let one = parse_with(&file, &text, options.validation);
                loaded.manifests.extend(one.manifests);
                loaded.errors.extend(one.errors);
                loaded.warnings.extend(one.warnings);
            }
            Err(e) => loaded
                .errors
                .push(file_error(&file, format!("cannot read file: {e}"))),
        }
    }
    loaded
}

/// The manifest files of `dir`, sorted, descending when `recursive`.
fn collect(dir: &Path, recursive: bool, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if recursive {
                collect(&p, true, files)?;
            }
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            files.push(p);
        }
    }
    Ok(())
}

/// Parses the documents of one file, strictly.
#[cfg(test)]
pub(crate) fn parse(file: &Path, text: &str) -> (Vec<Manifest>, Vec<ManifestError>) {
    let loaded = parse_with(file, text, Validation::Strict);
    (loaded.manifests, loaded.errors)
}

/// Parses the documents of one file.
pub(crate) fn parse_with(file: &Path, text: &str, validation: Validation) -> Loaded {
    let mut manifests = Vec::new();
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
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
        match document_to_manifest(file, index, value, validation, &mut warnings) {
            Ok(m) => manifests.push(m),
            Err(mut e) => errors.append(&mut e),
        }
    }
    Loaded {
        manifests,
        errors,
        warnings,
    }
}

/// One document: its type, then (unless ignored) fields the CRD does not
/// declare, then names and spec. Other types are reported by kind, not by field.
fn document_to_manifest(
    file: &Path,
    index: usize,
    value: serde_yaml::Value,
    validation: Validation,
    warnings: &mut Vec<ManifestError>,
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
    if validation != Validation::Ignore {
        let json = serde_json::to_value(&value).unwrap_or_default();
        let unknown: Vec<ManifestError> = unknown_fields(&json)
            .into_iter()
            .map(|u| {
                let message = match &u.did_you_mean {
                    Some(s) => format!("unknown field (did you mean \"{s}\"?)"),
                    None => "unknown field".to_string(),
                };
                error(&u.path, message)
            })
            .collect();
        if !unknown.is_empty() {
            if validation == Validation::Strict {
                return Err(unknown);
            }
            warnings.extend(unknown);
        }
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
    fn a_misspelt_field_is_refused_strictly_warned_or_ignored_on_request() {
        let doc = "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: typo}\nspec: {url: 'ws://x/', desiredstate: Stopped, sink: {log: {}}}\n";
        let strict = parse_with(Path::new("f.yaml"), doc, Validation::Strict);
        assert!(strict.manifests.is_empty());
        assert_eq!(strict.errors[0].field, "spec.desiredstate");
        assert!(strict.errors[0].message.contains("desiredState"));
        let warn = parse_with(Path::new("f.yaml"), doc, Validation::Warn);
        assert_eq!((warn.manifests.len(), warn.warnings.len()), (1, 1));
        let ignore = parse_with(Path::new("f.yaml"), doc, Validation::Ignore);
        assert_eq!((ignore.manifests.len(), ignore.warnings.len()), (1, 0));
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
        let loaded = super::load(&[dir], &super::LoadOptions::default());
        let (manifests, errors) = (loaded.manifests, loaded.errors);
        let errors: Vec<String> = errors
            .iter()
            .filter(|e| e.field != "apiVersion") // the Secret in the auth example
            .map(ToString::to_string)
            .collect();
        assert!(errors.is_empty(), "{errors:#?}");
        assert_eq!(manifests.len(), 5);
    }
}
