//! The crate's error type.

use std::fmt;

use crate::ValidationErrors;

/// Where an object is in a YAML file: its document (counted from 1) and,
/// inside a list document, its item (counted from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The document, counted from 1.
    pub document: usize,
    /// The item of a list document, counted from 0.
    pub item: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}", self.document)?;
        if let Some(item) = self.item {
            write!(f, ", item {item}")?;
        }
        Ok(())
    }
}

/// Errors of this crate: reading objects from YAML.
///
/// Invalid specs are not errors here: validation returns
/// [`ValidationErrors`](crate::ValidationErrors), and a snapshot carries
/// invalid objects in `Snapshot::invalid`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A document is not valid YAML, or holds something JSON cannot (such
    /// as a mapping with non-string keys).
    #[error("document {document}: invalid YAML")]
    Yaml {
        /// The document, counted from 1.
        document: usize,
        /// The parser's error, with line and column.
        #[source]
        source: serde_yaml::Error,
    },
    /// A document or list item is not a Kubernetes object.
    #[error("{location}: not a Kubernetes object: {problem}")]
    NotAnObject {
        /// Where it is.
        location: Location,
        /// What is missing.
        problem: &'static str,
    },
    /// An object in the egressgw.io group whose kind or version egressgw
    /// does not know.
    #[error(
        "{location}: unknown kind {kind} in {api_version}; egressgw reads EgressGateway, EgressPolicy, EgressClusterPolicy and EgressTunnel in egressgw.io/v1alpha1"
    )]
    UnknownKind {
        /// Where it is.
        location: Location,
        /// Its `apiVersion`.
        api_version: String,
        /// Its `kind`.
        kind: String,
    },
    /// An object of a kind egressgw reads does not have that kind's shape
    /// (a missing required field, a string where a list belongs, an unknown
    /// enum value).
    #[error("{location}: {kind} {name} does not decode{}", schema_note(.schema_errors))]
    Decode {
        /// Where it is.
        location: Location,
        /// Its `kind`.
        kind: String,
        /// Its `metadata.name`, or `(unnamed)`.
        name: String,
        /// What the apiserver would refuse by the kind's schema (egressgw's
        /// kinds only): the fields it has that its kind does not (a missing
        /// required field is often one of them misspelled), then its
        /// integers outside the CRD's bounds (`spec.priority: 99999999999`,
        /// which no `i32` holds).
        schema_errors: ValidationErrors,
        /// What does not fit.
        #[source]
        source: serde_json::Error,
    },
}

/// The schema errors, after the message of a decode error.
fn schema_note(schema_errors: &ValidationErrors) -> String {
    if schema_errors.is_empty() {
        String::new()
    } else {
        format!(" ({schema_errors})")
    }
}

/// The error of [`objects_from_yaml`](crate::objects_from_yaml).
pub type LoadError = Error;
