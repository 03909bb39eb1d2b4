//! Which Kinesis data streams a stream's sink may write to. A worker writes
//! with its own IAM role, which a tenant does not choose; `--kinesis-streams`
//! narrows what one namespace's resources can reach with it, e.g.
//! `{namespace}-*` gives each namespace only the data streams named after it.

/// `--kinesis-streams` patterns: `*` matches any run of characters and
/// `{namespace}` is the stream's namespace. Empty: no Kinesis sink allowed.
#[derive(Clone, Debug)]
pub struct KinesisStreams {
    patterns: Vec<String>,
}

impl KinesisStreams {
    pub fn new(patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            patterns: patterns
                .into_iter()
                .map(|p| p.into().trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
        }
    }

    /// Whether a resource in `namespace` may write to `stream_name`.
    pub fn allows(&self, namespace: &str, stream_name: &str) -> bool {
        self.patterns
            .iter()
            .any(|p| glob(&p.replace("{namespace}", namespace), stream_name))
    }
}

/// `*` matches any run of characters; everything else matches itself.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_reaches_only_the_streams_its_pattern_names() {
        let scope = KinesisStreams::new(["{namespace}-*", "shared-audit"]);
        assert!(scope.allows("team-a", "team-a-transcripts"));
        assert!(!scope.allows("team-b", "team-a-transcripts"));
        assert!(scope.allows("team-b", "shared-audit"));
        assert!(!scope.allows("team-b", "shared-audit-2"));
        assert!(KinesisStreams::new(["*"]).allows("any", "thing"));
        assert!(!KinesisStreams::new(Vec::<String>::new()).allows("any", "thing"));
        assert!(glob("a*b*c", "a-x-b-y-c") && !glob("a*b*c", "a-x-c-y-b") && !glob("ab*ba", "aba"));
    }
}
