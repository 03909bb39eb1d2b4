//! kstatus, the status algorithm GitOps tools run on custom resources
//! (sigs.k8s.io/cli-utils `pkg/kstatus/status`: Flux's health checks, Argo
//! CD's and `kapp`'s are built on it), written out for resources without a
//! built-in rule: terminating first, then the generation check, then the
//! abnormal-true `Reconciling` and `Stalled` conditions, else Current.
//! Also `kubectl wait --for=condition=…`'s rule, which additionally refuses a
//! condition whose `observedGeneration` is behind `metadata.generation`.

use serde_json::Value;

/// kstatus's verdicts (the ones a custom resource can get).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kstatus {
    InProgress,
    Failed,
    Current,
    Terminating,
}

/// kstatus on one object as the API server returns it.
pub fn compute(obj: &Value) -> Kstatus {
    if obj["metadata"]["deletionTimestamp"]
        .as_str()
        .is_some_and(|t| !t.is_empty())
    {
        return Kstatus::Terminating;
    }
    // The generation check runs only when both numbers exist.
    if let (Some(generation), Some(observed)) = (
        obj["metadata"]["generation"].as_i64(),
        obj["status"]["observedGeneration"].as_i64(),
    ) && generation != observed
    {
        return Kstatus::InProgress;
    }
    for c in obj["status"]["conditions"].as_array().into_iter().flatten() {
        if c["status"] != "True" {
            continue;
        }
        if c["type"] == "Reconciling" {
            return Kstatus::InProgress;
        }
        if c["type"] == "Stalled" {
            return Kstatus::Failed;
        }
    }
    Kstatus::Current
}

/// Whether `kubectl wait --for=condition=<name>` (status True) is satisfied:
/// the first condition of that type decides, unless the condition's (or the
/// status's) `observedGeneration` is behind the object's generation.
pub fn kubectl_wait_satisfied(obj: &Value, name: &str) -> bool {
    let Some(c) = obj["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| {
            c["type"]
                .as_str()
                .is_some_and(|t| t.eq_ignore_ascii_case(name))
        })
    else {
        return false;
    };
    if let Some(generation) = obj["metadata"]["generation"].as_i64() {
        let observed = c["observedGeneration"]
            .as_i64()
            .or_else(|| obj["status"]["observedGeneration"].as_i64());
        if observed.is_some_and(|o| o < generation) {
            return false;
        }
    }
    c["status"]
        .as_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("True"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(generation: i64, observed: Option<i64>, conditions: Value) -> Value {
        let mut status = json!({"conditions": conditions});
        if let Some(o) = observed {
            status["observedGeneration"] = json!(o);
        }
        json!({"metadata": {"generation": generation}, "status": status})
    }

    #[test]
    fn the_documented_rules_in_their_order() {
        let ready = json!([{"type": "Ready", "status": "True", "observedGeneration": 2}]);
        assert_eq!(compute(&obj(2, Some(2), ready.clone())), Kstatus::Current);
        assert_eq!(
            compute(&obj(3, Some(2), ready.clone())),
            Kstatus::InProgress
        );
        assert_eq!(
            compute(&obj(2, None, json!([]))),
            Kstatus::Current,
            "no observedGeneration: the generation check is skipped"
        );
        let reconciling = json!([{"type": "Reconciling", "status": "True"}]);
        assert_eq!(compute(&obj(2, Some(2), reconciling)), Kstatus::InProgress);
        let stalled = json!([{"type": "Stalled", "status": "True"}]);
        assert_eq!(compute(&obj(2, Some(2), stalled.clone())), Kstatus::Failed);
        assert_eq!(
            compute(&obj(3, Some(2), stalled)),
            Kstatus::InProgress,
            "the generation check comes first"
        );
        let mut deleting = obj(2, Some(2), ready);
        deleting["metadata"]["deletionTimestamp"] = json!("2026-12-04T00:00:00Z");
        assert_eq!(compute(&deleting), Kstatus::Terminating);
    }

    #[test]
    fn kubectl_wait_ignores_a_condition_about_an_older_generation() {
        let ready = |g: i64| json!([{"type": "Ready", "status": "True", "observedGeneration": g}]);
        assert!(kubectl_wait_satisfied(&obj(2, Some(2), ready(2)), "Ready"));
        assert!(!kubectl_wait_satisfied(&obj(3, Some(2), ready(2)), "Ready"));
        assert!(!kubectl_wait_satisfied(
            &obj(2, Some(2), json!([])),
            "Ready"
        ));
        let not_ready = json!([{"type": "Ready", "status": "False", "observedGeneration": 2}]);
        assert!(!kubectl_wait_satisfied(
            &obj(2, Some(2), not_ready),
            "ready"
        ));
    }
}
