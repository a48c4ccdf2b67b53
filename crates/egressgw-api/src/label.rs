//! Kubernetes label syntax, as label selectors must use it: one definition
//! that the CRDs' CEL rules (`schema`) and `validate()` both read, so
//! admission and the loaders cannot disagree.
//!
//! A **key** is an optional prefix and `/`, then a name (Kubernetes'
//! `IsQualifiedName`): the prefix is a lowercase DNS subdomain of at most
//! 253 characters; the name has 1 to 63 characters of `[A-Za-z0-9-_.]`,
//! beginning and ending with a letter or digit. A **value** is empty or has
//! the form of a name (`IsValidLabelValue`).
//!
//! The patterns are written in the subset where Go's RE2 (the apiserver's
//! CEL `matches`) and the `regex` crate agree: ASCII classes, counted
//! repetition, anchors, no escapes (a literal dot is `[.]`), so they can sit
//! inside a CEL string literal as they are. The one rule a pattern cannot
//! say, the prefix's length, is [`MAX_PREFIX_LEN`], checked beside it on
//! both sides.

use std::sync::LazyLock;

use regex::Regex;

/// A label name: 1 to 63 characters, alphanumeric at both ends.
macro_rules! name_pattern {
    () => {
        "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
    };
}

/// A lowercase DNS subdomain (RFC 1123), without its length limit.
macro_rules! prefix_pattern {
    () => {
        "[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    };
}

/// A label key, apart from the length of its prefix ([`MAX_PREFIX_LEN`]).
pub(crate) const KEY_PATTERN: &str = concat!("^(", prefix_pattern!(), "/)?", name_pattern!(), "$");

/// A label value, length included.
pub(crate) const VALUE_PATTERN: &str = concat!("^(", name_pattern!(), ")?$");

/// Longest prefix of a key (a DNS subdomain): the text before its `/`.
pub(crate) const MAX_PREFIX_LEN: usize = 253;

/// Longest key: the longest prefix, `/`, the longest name.
pub(crate) const MAX_KEY_LEN: usize = MAX_PREFIX_LEN + 1 + 63;

/// Longest value.
pub(crate) const MAX_VALUE_LEN: usize = 63;

/// What a key must look like, for error messages on both sides.
pub(crate) const KEY_RULE: &str = "an optional prefix (a lowercase DNS subdomain of at most 253 characters) and '/', then a name of 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";

/// What a value must look like, for error messages on both sides.
pub(crate) const VALUE_RULE: &str = "empty, or 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";

static KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(KEY_PATTERN).expect("KEY_PATTERN is a regex"));
static VALUE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(VALUE_PATTERN).expect("VALUE_PATTERN is a regex"));

/// Whether `key` is a label key.
pub(crate) fn is_key(key: &str) -> bool {
    KEY.is_match(key) && key.find('/').is_none_or(|slash| slash <= MAX_PREFIX_LEN)
}

/// Whether `value` is a label value.
pub(crate) fn is_value(value: &str) -> bool {
    VALUE.is_match(value)
}

/// `Err` naming `key` and the rule when it is not a label key.
pub(crate) fn check_key(key: &str) -> Result<(), String> {
    if is_key(key) {
        Ok(())
    } else {
        Err(format!("{key:?} is not a label key: write {KEY_RULE}"))
    }
}

/// `Err` naming `value` and the rule when it is not a label value.
pub(crate) fn check_value(value: &str) -> Result<(), String> {
    if is_value(value) {
        Ok(())
    } else {
        Err(format!(
            "{value:?} is not a label value: write {VALUE_RULE}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest name: 63 characters.
    fn name_63() -> String {
        format!("a{}z", "-".repeat(61))
    }

    /// A DNS subdomain of exactly `len` characters.
    fn prefix_of_len(len: usize) -> String {
        let label = "a".repeat(63);
        let mut prefix = [label.as_str(); 4].join(".");
        prefix.truncate(len);
        assert!(prefix.ends_with('a'), "{prefix}");
        prefix
    }

    #[test]
    fn keys_that_kubernetes_accepts_are_keys() {
        let long_prefix = format!("{}/app", prefix_of_len(MAX_PREFIX_LEN));
        let longest = format!("{}/{}", prefix_of_len(MAX_PREFIX_LEN), name_63());
        assert_eq!(longest.len(), MAX_KEY_LEN);
        for key in [
            "app",
            "a",
            "1",
            "App.Name_2-x",
            "kubernetes.io/hostname",
            "node-role.kubernetes.io/control-plane",
            "example.com/Web_App",
            "a/b",
            "0-x.y/Z",
            &name_63(),
            &long_prefix,
            &longest,
        ] {
            assert!(is_key(key), "{key:?} should be a key");
            assert_eq!(check_key(key), Ok(()));
        }
    }

    #[test]
    fn keys_that_kubernetes_refuses_are_not_keys() {
        let name_64 = format!("{}a", name_63());
        let prefix_254 = format!("{}/app", prefix_of_len(MAX_PREFIX_LEN + 1));
        for key in [
            "",
            "app web!",
            "app web",
            " app",
            "app ",
            "app\n",
            "-app",
            "app-",
            "_app",
            "app.",
            ".app",
            "ä",
            "a/b/c",
            "/app",
            "example.com/",
            "Example.com/app",
            "example_com/app",
            "-example.com/app",
            "example.com-/app",
            "example..com/app",
            ".example.com/app",
            "example.com./app",
            "example.com/-app",
            "app:web",
            "app=web",
            "app*",
            &name_64,
            &prefix_254,
        ] {
            assert!(!is_key(key), "{key:?} should not be a key");
        }
        assert_eq!(
            check_key("app web!"),
            Err(format!("\"app web!\" is not a label key: write {KEY_RULE}"))
        );
    }

    #[test]
    fn values_that_kubernetes_accepts_are_values() {
        for value in ["", "web", "x", "9", "v1.2.3", "Web_App-2", &name_63()] {
            assert!(is_value(value), "{value:?} should be a value");
            assert_eq!(check_value(value), Ok(()));
        }
    }

    #[test]
    fn values_that_kubernetes_refuses_are_not_values() {
        let value_64 = format!("{}a", name_63());
        for value in [
            "x/y/z", "a/b", " ", "web ", " web", "-web", "web-", ".web", "web.", "_web", "web_",
            "a b", "a\tb", "web!", "ü", "a:b", "web\n", &value_64,
        ] {
            assert!(!is_value(value), "{value:?} should not be a value");
        }
        assert_eq!(
            check_value("x/y/z"),
            Err(format!(
                "\"x/y/z\" is not a label value: write {VALUE_RULE}"
            ))
        );
    }

    #[test]
    fn the_longest_value_and_name_are_63_characters() {
        assert_eq!(name_63().len(), MAX_VALUE_LEN);
        assert!(is_value(&name_63()) && is_key(&name_63()));
    }
}
