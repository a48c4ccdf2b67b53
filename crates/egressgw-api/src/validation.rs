//! Validation results and the strict address parsers every spec check uses.
//!
//! The parsers wrap [`egressgw_core::net`] (the one definition of address
//! syntax) and add what Kubernetes' CEL IP library also rejects, so a value
//! the apiserver admits passes here and the other way round: whitespace
//! anywhere (around a value, inside it, around the dash of a range) and
//! IPv4-mapped IPv6 addresses (`::ffff:10.0.0.1`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egressgw_core::net::{self, AddrError, Family, IpRange};
use ipnet::IpNet;

/// One problem with one field.
///
/// Displays as `path: message`, e.g.
/// `spec.egressIP.ipv4: "10.0.0.300" is not an IP address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Where the problem is, as a JSON path from the object root:
    /// `spec.ippools.ipv4[1]`.
    pub path: String,
    /// What is wrong, as a sentence fragment that follows the path.
    pub message: String,
}

impl FieldError {
    /// An error at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in one object, in the order the fields were checked.
///
/// A check never stops at the first problem: fix them all in one go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ValidationErrors {
    errors: Vec<FieldError>,
}

impl ValidationErrors {
    /// No errors yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a problem at `path`.
    pub fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError::new(path, message));
    }

    /// Whether nothing was found.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// How many problems were found.
    pub fn len(&self) -> usize {
        self.errors.len()
    }

    /// The problems, in check order.
    pub fn errors(&self) -> &[FieldError] {
        &self.errors
    }

    /// Each problem as `path: message`.
    pub fn messages(&self) -> Vec<String> {
        self.errors.iter().map(ToString::to_string).collect()
    }

    /// `Ok(())` when nothing was found, else `Err(self)`.
    pub fn into_result(self) -> Result<(), Self> {
        if self.is_empty() { Ok(()) } else { Err(self) }
    }
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ValidationErrors {}

impl Extend<FieldError> for ValidationErrors {
    fn extend<I: IntoIterator<Item = FieldError>>(&mut self, iter: I) {
        self.errors.extend(iter);
    }
}

impl IntoIterator for ValidationErrors {
    type Item = FieldError;
    type IntoIter = std::vec::IntoIter<FieldError>;

    fn into_iter(self) -> Self::IntoIter {
        self.errors.into_iter()
    }
}

/// A JSON path being built while walking a spec: `spec.ippools.ipv4[1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldPath(String);

impl FieldPath {
    /// The path of a top-level field such as `spec`.
    pub(crate) fn root(name: &str) -> Self {
        Self(name.to_owned())
    }

    /// The path of the field `name` below this one.
    pub(crate) fn field(&self, name: &str) -> Self {
        Self(format!("{}.{name}", self.0))
    }

    /// The path of list item `index` of this field.
    pub(crate) fn index(&self, index: usize) -> Self {
        Self(format!("{}[{index}]", self.0))
    }

    /// The path of the entry `key` of this map field, written as the
    /// apiserver writes it: `matchLabels[app]`.
    pub(crate) fn key(&self, key: &str) -> Self {
        Self(format!("{}[{key}]", self.0))
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&FieldPath> for String {
    fn from(path: &FieldPath) -> Self {
        path.0.clone()
    }
}

impl From<FieldPath> for String {
    fn from(path: FieldPath) -> Self {
        path.0
    }
}

/// The bounds of an integer field, inclusive: the CRD's `minimum` and
/// `maximum`, and what `validate()` and the loader check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IntRange {
    /// The lowest value allowed.
    pub(crate) min: i64,
    /// The highest value allowed.
    pub(crate) max: i64,
}

impl IntRange {
    /// Every value of an `int32`.
    pub(crate) const INT32: Self = Self {
        min: i32::MIN as i64,
        max: i32::MAX as i64,
    };

    /// The largest bound of an `int64` field: 2^53 - 1, the largest integer
    /// that a float64 (the apiserver's `maximum`) and JSON clients that read
    /// numbers as doubles hold exactly, as Kubernetes' API conventions ask of
    /// int64 values. `i64::MAX` cannot be a bound: as a float it is 2^63,
    /// which the apiserver turns back into `i64::MIN` and then refuses every
    /// value (seen on the lab's kube-apiserver 1.34).
    pub(crate) const MAX_EXACT: i64 = (1 << 53) - 1;

    /// Whether `value` lies within the bounds, compared as a float, as the
    /// apiserver compares a value with `minimum`/`maximum` (exact up to
    /// [`Self::MAX_EXACT`]).
    pub(crate) fn contains(self, value: f64) -> bool {
        // Lossy beyond 2^53, as the CRD's own float bounds are.
        let (min, max) = (self.min as f64, self.max as f64);
        (min..=max).contains(&value)
    }

    /// What is wrong with `value`, written as in the object, when it lies
    /// outside the bounds.
    pub(crate) fn out_of_range(self, value: impl fmt::Display) -> String {
        format!(
            "{value} is out of range: must be between {} and {}",
            self.min, self.max
        )
    }
}

/// An optional string field: `None` and `""` both mean unset (the Go
/// convention that manifests written for spidernet-io/egressgateway use).
pub(crate) fn non_empty(value: Option<&String>) -> Option<&str> {
    value.map(String::as_str).filter(|s| !s.is_empty())
}

/// Parses an IP address strictly (see the module docs).
pub(crate) fn ip(s: &str) -> Result<IpAddr, String> {
    reject_whitespace(s)?;
    let ip = net::parse_ip(s).map_err(|e| e.to_string())?;
    reject_mapped(s, ip)?;
    Ok(ip)
}

/// Parses an IP address of `family` strictly.
pub(crate) fn ip_of(s: &str, family: Family) -> Result<IpAddr, String> {
    let ip = ip(s)?;
    expect_family(s, Family::of(ip), family)?;
    Ok(ip)
}

/// Parses a CIDR strictly: no host bits, no whitespace, no IPv4-mapped prefix.
pub(crate) fn cidr(s: &str) -> Result<IpNet, String> {
    reject_whitespace(s)?;
    let net = net::parse_cidr(s).map_err(|e| e.to_string())?;
    reject_mapped(s, net.network())?;
    Ok(net)
}

/// Parses a pool entry (`a`, `a-b` or `a/len`) of `family` strictly: no
/// whitespace anywhere, not even around the dash of a range, as admission
/// checks each half of a range with `isIP` as written.
pub(crate) fn range_of(s: &str, family: Family) -> Result<IpRange, String> {
    reject_whitespace(s)?;
    let range: IpRange = s.parse().map_err(|e: AddrError| e.to_string())?;
    reject_mapped(s, range.first())?;
    reject_mapped(s, range.last())?;
    expect_family(s, range.family(), family)?;
    Ok(range)
}

/// `ip` if it is IPv4.
pub(crate) fn as_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(_) => None,
    }
}

/// `ip` if it is IPv6.
pub(crate) fn as_v6(ip: IpAddr) -> Option<Ipv6Addr> {
    match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    }
}

fn expect_family(s: &str, found: Family, expected: Family) -> Result<(), String> {
    if found == expected {
        Ok(())
    } else {
        Err(AddrError::WrongFamily {
            value: s.to_owned(),
            expected,
        }
        .to_string())
    }
}

/// Kubernetes' CEL `isIP` and `isCIDR` refuse any whitespace; so do we,
/// with a message that says so.
fn reject_whitespace(s: &str) -> Result<(), String> {
    if s.contains(char::is_whitespace) {
        Err(format!(
            "{s:?} contains whitespace; write it without spaces"
        ))
    } else {
        Ok(())
    }
}

fn reject_mapped(s: &str, ip: IpAddr) -> Result<(), String> {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => Err(format!(
            "{s:?} is an IPv4-mapped IPv6 address; write the IPv4 address instead"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_display_as_path_then_message_joined_by_semicolons() {
        let mut errors = ValidationErrors::new();
        errors.push("spec.a", "is bad");
        errors.push("spec.b[2]", "is worse");
        assert_eq!(errors.to_string(), "spec.a: is bad; spec.b[2]: is worse");
        assert_eq!(
            errors.messages(),
            vec!["spec.a: is bad", "spec.b[2]: is worse"]
        );
    }

    #[test]
    fn paths_nest_fields_and_indexes() {
        let path = FieldPath::root("spec")
            .field("ippools")
            .field("ipv4")
            .index(1);
        assert_eq!(path.to_string(), "spec.ippools.ipv4[1]");
    }

    #[test]
    fn whitespace_anywhere_is_not_an_ip_or_a_cidr() {
        for s in [" 10.0.0.1", "10.0.0.1\n", "fd00:: 1"] {
            assert_eq!(
                ip(s),
                Err(format!(
                    "{s:?} contains whitespace; write it without spaces"
                )),
            );
        }
        for s in ["10.0.0.0/8 ", "10.0.0.0 /8", "\t10.0.0.0/8"] {
            assert!(cidr(s).unwrap_err().contains("whitespace"), "{s:?}");
        }
    }

    #[test]
    fn an_ipv4_mapped_ipv6_address_is_rejected() {
        let err = ip("::ffff:10.0.0.1").unwrap_err();
        assert!(err.contains("IPv4-mapped"), "{err}");
    }

    #[test]
    fn a_pool_entry_with_whitespace_anywhere_is_rejected() {
        for s in [
            "10.0.0.1 - 10.0.0.3",
            "10.0.0.1-10.0.0.3 ",
            " 10.6.1.60-10.6.1.65",
            "10.0.0.0/ 24",
            "\u{a0}10.0.0.1",
        ] {
            assert!(
                range_of(s, Family::Ipv4)
                    .unwrap_err()
                    .contains("whitespace"),
                "{s:?}"
            );
        }
        assert_eq!(
            range_of("10.0.0.1-10.0.0.3", Family::Ipv4).unwrap().len(),
            3
        );
    }

    #[test]
    fn an_empty_string_counts_as_unset() {
        assert_eq!(non_empty(Some(&String::new())), None);
        assert_eq!(non_empty(Some(&"x".to_owned())), Some("x"));
        assert_eq!(non_empty(None), None);
    }
}
