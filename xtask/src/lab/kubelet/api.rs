//! The stand-in's requests to the API server, made with the lab's kubectl
//! (admin credentials, as the lab plays the node): list Pods, read
//! ConfigMaps and Secrets, request ServiceAccount tokens, write Pod status
//! and the final delete.

use std::time::{Duration, SystemTime};

use anyhow::Context;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::lab::kubectl::Kubectl;

/// How long one request may take before the stand-in gives up on it (and
/// tries again on its next round).
const REQUEST_TIMEOUT: &str = "--request-timeout=10s";
/// The same for the list of each round: while the API does not answer,
/// running Pods go on between these attempts.
const LIST_TIMEOUT: &str = "--request-timeout=4s";

#[derive(Debug, Clone)]
pub struct Api {
    kubectl: Kubectl,
}

#[derive(Deserialize)]
struct Items<T> {
    items: Vec<T>,
}

/// A token from the TokenRequest API.
#[derive(Debug, Clone)]
pub struct Token {
    pub token: String,
    /// When the token was asked to expire (the API server may extend it).
    pub expires: SystemTime,
}

impl Api {
    pub fn new(kubectl: Kubectl) -> Self {
        Self { kubectl }
    }

    fn get<T: DeserializeOwned>(&self, args: &[&str]) -> anyhow::Result<T> {
        let mut all = vec!["get", LIST_TIMEOUT, "-o", "json"];
        all.extend_from_slice(args);
        let out = self.kubectl.run(&all)?;
        serde_json::from_str(&out)
            .with_context(|| format!("parsing `kubectl get {}`", args.join(" ")))
    }

    /// The Pods bound to `node`.
    pub fn bound_pods(&self, node: &str) -> anyhow::Result<Vec<Pod>> {
        let selector = format!("--field-selector=spec.nodeName={node}");
        let list: Items<Pod> = self.get(&["pods", "--all-namespaces", &selector])?;
        Ok(list.items)
    }

    /// ConfigMap `name` of `namespace`, `None` if there is none.
    pub fn config_map(&self, namespace: &str, name: &str) -> anyhow::Result<Option<ConfigMap>> {
        self.optional("configmap", namespace, name)
    }

    pub fn secret(&self, namespace: &str, name: &str) -> anyhow::Result<Option<Secret>> {
        self.optional("secret", namespace, name)
    }

    /// Object `name` of `kind` in `namespace`, `None` if there is none.
    pub fn optional<T: DeserializeOwned>(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Option<T>> {
        let out = self.kubectl.run(&[
            "get",
            REQUEST_TIMEOUT,
            kind,
            name,
            "--namespace",
            namespace,
            "--ignore-not-found",
            "-o",
            "json",
        ])?;
        if out.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&out)
            .map(Some)
            .with_context(|| format!("parsing {kind} {namespace}/{name}"))
    }

    /// A token for ServiceAccount `account`, bound to the Pod (`pod`,
    /// `uid`): the API server checks the Pod exists, puts its name, uid and
    /// node in the claims, and invalidates the token when the Pod goes.
    pub fn request_token(
        &self,
        namespace: &str,
        account: &str,
        audience: Option<&str>,
        expiration_seconds: i64,
        pod: &str,
        uid: &str,
    ) -> anyhow::Result<Token> {
        let request = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": audience.map(|a| vec![a]).unwrap_or_default(),
                "expirationSeconds": expiration_seconds,
                "boundObjectRef": { "apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid },
            },
        });
        let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token");
        let out = self
            .kubectl
            .run_with_input(
                &["create", "--raw", &path, "-f", "-"],
                Some(&request.to_string()),
            )
            .with_context(|| format!("requesting a token for {namespace}/{account}"))?;
        let response: Value = serde_json::from_str(&out).context("parsing the TokenRequest")?;
        let token = response["status"]["token"]
            .as_str()
            .context("the TokenRequest answer holds no token")?
            .to_owned();
        let seconds = u64::try_from(expiration_seconds).unwrap_or(3600);
        Ok(Token {
            token,
            expires: SystemTime::now() + Duration::from_secs(seconds),
        })
    }

    /// Writes `status` (a JSON merge patch of the status) through the
    /// status subresource.
    pub fn patch_status(&self, namespace: &str, name: &str, status: &Value) -> anyhow::Result<()> {
        let patch = json!({ "status": status }).to_string();
        self.kubectl
            .run(&[
                "patch",
                REQUEST_TIMEOUT,
                "pod",
                name,
                "--namespace",
                namespace,
                "--subresource=status",
                "--type=merge",
                "--patch",
                &patch,
            ])
            .map(drop)
    }

    /// The delete with grace period 0 that kubelet sends once a Pod's
    /// containers have stopped, for that Pod only (its uid); a Pod already
    /// gone is no error.
    pub fn final_delete(&self, namespace: &str, name: &str, uid: &str) -> anyhow::Result<()> {
        let options = json!({
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": { "uid": uid },
        });
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}");
        match self.kubectl.run_with_input(
            &["delete", "--raw", &path, "-f", "-"],
            Some(&options.to_string()),
        ) {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn is_not_found(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    text.contains("NotFound") || text.contains("not found") || text.contains("Precondition failed")
}
