//! Kubernetes label selectors, evaluated without a client.

use std::collections::BTreeSet;

use crate::model::Labels;

/// A label selector: every `match_labels` pair and every expression must hold.
/// The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct LabelSelector {
    /// `matchLabels`.
    pub match_labels: Labels,
    /// `matchExpressions`.
    pub match_expressions: Vec<Requirement>,
}

/// One `matchExpressions` entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// `key In (values)`.
    In(String, BTreeSet<String>),
    /// `key NotIn (values)`: also true when the label is absent.
    NotIn(String, BTreeSet<String>),
    /// `key Exists`.
    Exists(String),
    /// `key DoesNotExist`.
    DoesNotExist(String),
}

impl Requirement {
    /// Whether `labels` satisfy this requirement.
    pub fn matches(&self, labels: &Labels) -> bool {
        match self {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        }
    }
}

impl LabelSelector {
    /// The selector `key=value`.
    pub fn eq(key: &str, value: &str) -> Self {
        Self {
            match_labels: [(key.to_owned(), value.to_owned())].into(),
            match_expressions: Vec::new(),
        }
    }

    /// Whether `labels` satisfy the selector.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_empty_selector_matches_everything() {
        assert!(LabelSelector::default().matches(&Labels::new()));
    }

    #[test]
    fn match_labels_need_every_pair() {
        let mut s = LabelSelector::eq("app", "web");
        s.match_labels.insert("tier".into(), "front".into());
        assert!(s.matches(&labels(&[("app", "web"), ("tier", "front"), ("x", "y")])));
        assert!(!s.matches(&labels(&[("app", "web")])));
    }

    #[test]
    fn not_in_holds_for_an_absent_label() {
        let r = Requirement::NotIn("env".into(), ["prod".to_owned()].into());
        assert!(r.matches(&Labels::new()));
        assert!(!r.matches(&labels(&[("env", "prod")])));
        assert!(r.matches(&labels(&[("env", "dev")])));
    }

    #[test]
    fn exists_and_does_not_exist_look_only_at_the_key() {
        let l = labels(&[("gw", "")]);
        assert!(Requirement::Exists("gw".into()).matches(&l));
        assert!(!Requirement::DoesNotExist("gw".into()).matches(&l));
    }
}
