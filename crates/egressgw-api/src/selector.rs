//! Label selectors: Kubernetes' `metav1.LabelSelector` in, the planner's
//! [`egressgw_core::selector::LabelSelector`] out.

use std::collections::BTreeSet;

use egressgw_core::selector::{LabelSelector, Requirement};
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;

use crate::label;
use crate::validation::{FieldPath, ValidationErrors};

/// Converts `selector`, which lives at `path`, recording every problem in
/// `errors`, as admission does: a key or value that is not Kubernetes label
/// syntax (in `matchLabels` and in requirements, see `label`), an unknown
/// operator, `In` / `NotIn` without values, `Exists` / `DoesNotExist` with
/// values, an empty key.
///
/// The result holds the valid requirements only; use it when `errors` stayed
/// empty.
pub(crate) fn convert(
    selector: &meta::LabelSelector,
    path: &FieldPath,
    errors: &mut ValidationErrors,
) -> LabelSelector {
    let match_labels = selector.match_labels.clone().unwrap_or_default();
    let labels_path = path.field("matchLabels");
    for (key, value) in &match_labels {
        if let Err(message) = label::check_key(key) {
            errors.push(&labels_path, message);
        }
        if let Err(message) = label::check_value(value) {
            errors.push(labels_path.key(key), message);
        }
    }
    let expressions_path = path.field("matchExpressions");
    let match_expressions = selector
        .match_expressions
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, req)| requirement(req, &expressions_path.index(i), errors))
        .collect();
    LabelSelector {
        match_labels: match_labels.into(),
        match_expressions,
    }
}

/// Converts a selector, returning every problem instead of a partial result.
pub fn to_core(
    selector: &meta::LabelSelector,
    path: &str,
) -> Result<LabelSelector, ValidationErrors> {
    let mut errors = ValidationErrors::new();
    let converted = convert(selector, &FieldPath::root(path), &mut errors);
    errors.into_result().map(|()| converted)
}

fn requirement(
    req: &meta::LabelSelectorRequirement,
    path: &FieldPath,
    errors: &mut ValidationErrors,
) -> Option<Requirement> {
    if req.key.is_empty() {
        errors.push(path.field("key"), "must not be empty");
    } else if let Err(message) = label::check_key(&req.key) {
        errors.push(path.field("key"), message);
    }
    let values_path = path.field("values");
    for (i, value) in req.values.iter().flatten().enumerate() {
        if let Err(message) = label::check_value(value) {
            errors.push(values_path.index(i), message);
        }
    }
    let values: BTreeSet<String> = req.values.iter().flatten().cloned().collect();
    let key = req.key.clone();
    let converted = match req.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => {
            errors.push(
                &values_path,
                format!("operator {} needs at least one value", req.operator),
            );
            None
        }
        "In" => Some(Requirement::In(key, values)),
        "NotIn" => Some(Requirement::NotIn(key, values)),
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            errors.push(
                &values_path,
                format!("operator {} takes no values", req.operator),
            );
            None
        }
        "Exists" => Some(Requirement::Exists(key)),
        "DoesNotExist" => Some(Requirement::DoesNotExist(key)),
        other => {
            errors.push(
                path.field("operator"),
                format!("{other:?} is not one of In, NotIn, Exists, DoesNotExist"),
            );
            None
        }
    };
    converted.filter(|_| !req.key.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, operator: &str, values: &[&str]) -> meta::LabelSelectorRequirement {
        meta::LabelSelectorRequirement {
            key: key.into(),
            operator: operator.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    fn selector(reqs: Vec<meta::LabelSelectorRequirement>) -> meta::LabelSelector {
        meta::LabelSelector {
            match_labels: Some([("app".to_owned(), "web".to_owned())].into()),
            match_expressions: Some(reqs),
        }
    }

    #[test]
    fn every_operator_converts_to_its_requirement() {
        let converted = to_core(
            &selector(vec![
                req("a", "In", &["x", "y"]),
                req("b", "NotIn", &["z"]),
                req("c", "Exists", &[]),
                req("d", "DoesNotExist", &[]),
            ]),
            "spec.podSelector",
        )
        .unwrap();
        assert_eq!(
            converted.match_labels.get("app").map(String::as_str),
            Some("web")
        );
        assert_eq!(
            converted.match_expressions,
            vec![
                Requirement::In("a".into(), ["x".to_owned(), "y".to_owned()].into()),
                Requirement::NotIn("b".into(), ["z".to_owned()].into()),
                Requirement::Exists("c".into()),
                Requirement::DoesNotExist("d".into()),
            ]
        );
    }

    #[test]
    fn an_unknown_operator_is_an_error_naming_its_index() {
        let errors = to_core(
            &selector(vec![req("a", "Equals", &["x"])]),
            "spec.podSelector",
        )
        .unwrap_err();
        assert_eq!(
            errors.messages(),
            vec![
                "spec.podSelector.matchExpressions[0].operator: \"Equals\" is not one of In, NotIn, Exists, DoesNotExist"
            ]
        );
    }

    #[test]
    fn in_without_values_and_exists_with_values_are_both_reported() {
        let errors = to_core(
            &selector(vec![req("a", "In", &[]), req("b", "Exists", &["x"])]),
            "spec.nodeSelector.selector",
        )
        .unwrap_err();
        assert_eq!(
            errors.messages(),
            vec![
                "spec.nodeSelector.selector.matchExpressions[0].values: operator In needs at least one value",
                "spec.nodeSelector.selector.matchExpressions[1].values: operator Exists takes no values",
            ]
        );
    }

    #[test]
    fn match_labels_with_a_bad_key_or_value_are_errors_naming_the_map_or_the_entry() {
        let selector = meta::LabelSelector {
            match_labels: Some(
                [
                    ("app web!".to_owned(), "x/y/z".to_owned()),
                    ("example.com/tier".to_owned(), String::new()),
                ]
                .into(),
            ),
            match_expressions: None,
        };
        assert_eq!(
            to_core(&selector, "spec.appliedTo.podSelector")
                .unwrap_err()
                .messages(),
            vec![
                format!(
                    "spec.appliedTo.podSelector.matchLabels: \"app web!\" is not a label key: write {}",
                    label::KEY_RULE
                ),
                format!(
                    "spec.appliedTo.podSelector.matchLabels[app web!]: \"x/y/z\" is not a label value: write {}",
                    label::VALUE_RULE
                ),
            ]
        );
    }

    #[test]
    fn a_requirement_with_a_bad_key_or_value_is_an_error_naming_it() {
        let errors = to_core(
            &selector(vec![
                req("a/b/c", "Exists", &[]),
                req("tier", "In", &["ok", "not ok", "-x"]),
            ]),
            "spec.nodeSelector.selector",
        )
        .unwrap_err();
        let paths: Vec<&str> = errors.errors().iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                "spec.nodeSelector.selector.matchExpressions[0].key",
                "spec.nodeSelector.selector.matchExpressions[1].values[1]",
                "spec.nodeSelector.selector.matchExpressions[1].values[2]",
            ]
        );
    }

    #[test]
    fn an_empty_key_is_rejected() {
        let errors = to_core(&selector(vec![req("", "Exists", &[])]), "s").unwrap_err();
        assert_eq!(
            errors.messages(),
            vec!["s.matchExpressions[0].key: must not be empty"]
        );
    }
}
