//! The one codec of a spec as the lease table stores it. The controller and
//! `tether apply` encode with it, the worker decodes with it, and "did the spec
//! change?" is answered one way: the stored texts differ.
//!
//! The stored form is JSON text with object keys sorted (it goes through
//! `serde_json::Value`, whose maps are ordered), so equal specs are equal
//! texts whoever wrote them, and the store can keep the text opaque.

use super::spec::StreamConnectionSpec;
use std::hash::{Hash, Hasher};

/// The spec as stored: canonical JSON text.
pub fn encode(spec: &StreamConnectionSpec) -> String {
    // Serialising plain data into a Value and printing it cannot fail.
    serde_json::to_value(spec)
        .and_then(|v| serde_json::to_string(&v))
        .unwrap_or_default()
}

/// The spec a worker serves: the stored text with the item's `ws_url` as its
/// URL, validated. Items written by the seed carried only `ws_url`: they get a
/// log sink and the defaults.
pub fn decode(stored: Option<&str>, ws_url: &str) -> Result<StreamConnectionSpec, String> {
    let mut value = match stored {
        Some(text) => {
            serde_json::from_str(text).map_err(|e| format!("stored spec is not JSON: {e}"))?
        }
        None => serde_json::json!({"sink": {"log": {}}}),
    };
    if let Some(obj) = value.as_object_mut() {
        obj.insert("url".into(), serde_json::Value::String(ws_url.to_string()));
    }
    let spec: StreamConnectionSpec =
        serde_json::from_value(value).map_err(|e| format!("stored spec is invalid: {e}"))?;
    spec.validate().map_err(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    Ok(spec)
}

/// A digest of the stored text, for a holder that keeps the parsed spec and
/// not the text but must notice a change.
pub fn fingerprint(stored: Option<&str>) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    stored.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_survives_the_table_and_equal_specs_are_equal_texts() {
        let spec = StreamConnectionSpec::test("wss://feed.example/a");
        let text = encode(&spec);
        assert_eq!(decode(Some(&text), &spec.url).unwrap(), spec);
        // Keys sorted: the text does not depend on field order.
        let reordered: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(serde_json::to_string(&reordered).unwrap(), text);
        assert_eq!(fingerprint(Some(&text)), fingerprint(Some(&encode(&spec))));
    }

    #[test]
    fn a_changed_spec_has_another_fingerprint_and_bad_text_a_clear_error() {
        let a = StreamConnectionSpec::test("wss://feed.example/a");
        let mut b = a.clone();
        b.subscribe = vec!["{\"op\":\"sub\"}".into()];
        assert_ne!(
            fingerprint(Some(&encode(&a))),
            fingerprint(Some(&encode(&b)))
        );
        assert_ne!(fingerprint(None), fingerprint(Some(&encode(&a))));
        let err = decode(Some("{not json"), "wss://feed.example/a").unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
    }

    #[test]
    fn a_seed_item_without_a_spec_gets_a_log_sink() {
        let spec = decode(None, "ws://feed.example/x").unwrap();
        assert_eq!(spec.url, "ws://feed.example/x");
    }
}
