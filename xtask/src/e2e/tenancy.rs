//! Tenancy: what one namespace's policies may take from a gateway, checked
//! with real traffic.

use anyhow::{Context, ensure};
use serde_json::json;

use super::objects::{app, gateway, policy};
use super::run::{PolicyStatus, Run};
use super::traffic::Expect;

const TARGET_NET: &str = "198.51.100.0/24";

pub fn a_namespace_cannot_take_another_namespaces_eip_or_an_unadmitted_gateway(
    run: &mut Run,
) -> anyhow::Result<()> {
    let [first, second, third] = run.pool[..] else {
        anyhow::bail!("the run's pool should have 3 addresses: {:?}", run.pool);
    };
    run.apply(&gateway("e2e-tenancy", &format!("{first}-{second}"), first))?;
    // Team a's own EIP (rr: not the shared default).
    let mut web = policy("team-a", "web", "e2e-tenancy", &app("web"), &[TARGET_NET]);
    web["spec"]["egressIP"]["allocatorPolicy"] = json!("rr");
    run.apply(&web)?;
    let status = run.wait_policy_ready("egresspolicy", Some("team-a"), "web")?;
    let eip = status.eip.context("team a's policy has no EIP")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;

    // Team b pins it: refused in its status; team a keeps it.
    let mut thief = policy(
        "team-b",
        "thief",
        "e2e-tenancy",
        &app("batch"),
        &[TARGET_NET],
    );
    thief["spec"]["egressIP"] = json!({ "ipv4": eip.to_string() });
    run.apply(&thief)?;
    let refused = run.wait_reason("egresspolicy", Some("team-b"), "thief", "EipTaken")?;
    let message = refused["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["reason"] == "EipTaken")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    ensure!(
        message.contains("spec.egressIP.ipv4") && message.contains("team-a"),
        "the refusal should name the field and the owner: {message}"
    );
    let after = PolicyStatus::of(&run.get("egresspolicy", Some("team-a"), "web")?);
    ensure!(
        after.eip == Some(eip),
        "team a's policy lost {eip}: {after}"
    );
    run.expect_steady("web-3", Expect::Source(eip.into()), 5)?;
    let batch_normal = run.normal_way("batch-1")?;
    run.expect_sources(&[("batch-1", batch_normal)])?;

    // A gateway open to team a only: team b's policy is told so.
    run.apply(&json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressGateway",
        "metadata": { "name": "e2e-tenancy-a" },
        "spec": {
            "nodeSelector": { "selector": { "matchLabels": { "egressgw.io/gateway": "true" } } },
            "namespaceSelector": { "matchLabels": { "team": "a" } },
            "ippools": { "ipv4": [third.to_string()] },
        },
    }))?;
    run.apply(&policy(
        "team-b",
        "outsider",
        "e2e-tenancy-a",
        &app("batch"),
        &[TARGET_NET],
    ))?;
    run.wait_reason(
        "egresspolicy",
        Some("team-b"),
        "outsider",
        "NamespaceNotAllowed",
    )?;
    run.expect_sources(&[("batch-1", batch_normal)])?;
    run.note(format!(
        "team b pinning team a's {eip}: refused ({message:?}), team a kept it (web-3 still seen as {eip}); \
         a gateway admitting team=a only refused team b's policy with NamespaceNotAllowed"
    ));
    Ok(())
}

/// Stores an EgressPolicy whose priority is out of int32 range, as clusters
/// that ran an egressgw without the bound may hold: the controller reports
/// it by name, and policies created afterwards still work.
pub fn an_undecodable_stored_policy_is_reported_and_stops_no_other(
    run: &mut Run,
) -> anyhow::Result<()> {
    const CRD: &str = "egresspolicies.egressgw.io";
    let eip = crate::e2e::scenarios::setup_gateway(run, "e2e-undecodable")?;
    crate::e2e::scenarios::setup_web_policy(run, "e2e-undecodable")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;

    // The CRD as an older egressgw had it: no bound on priority.
    let original = run.lab.kubectl.run(&["get", "crd", CRD, "-o", "json"])?;
    let mut loose: serde_json::Value = serde_json::from_str(&original)?;
    let priority = loose["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["priority"]
        .as_object_mut()
        .context("the CRD has no spec.priority")?;
    priority.remove("minimum");
    priority.remove("maximum");
    let replace = |text: &str| {
        run.lab
            .kubectl
            .run_with_input(&["replace", "-f", "-"], Some(text))
            .map(drop)
    };
    replace(&loose.to_string())?;
    let mut huge = policy(
        "team-a",
        "huge",
        "e2e-undecodable",
        &app("batch"),
        &[TARGET_NET],
    );
    huge["spec"]["priority"] = json!(99_999_999_999_u64);
    let stored = run.apply(&huge);
    // Back to the bounded CRD whatever happened.
    let mut bounded: serde_json::Value = serde_json::from_str(&original)?;
    bounded["metadata"]
        .as_object_mut()
        .context("the CRD has no metadata")?
        .remove("resourceVersion");
    let restored = run
        .lab
        .kubectl
        .run_with_input(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            Some(&bounded.to_string()),
        )
        .map(drop);
    stored.context("storing the out-of-range policy with the loose CRD")?;
    restored.context("restoring the CRD")?;

    let reported = run.wait_reason("egresspolicy", Some("team-a"), "huge", "Invalid")?;
    let message = reported["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(message.contains("cannot be read"), "{message}");
    // The watch of policies goes on: a new policy becomes Ready, and web-3
    // still leaves with its EIP.
    let later = policy(
        "team-a",
        "later",
        "e2e-undecodable",
        &app("batch"),
        &[TARGET_NET],
    );
    run.apply(&later)?;
    run.wait_policy_ready("egresspolicy", Some("team-a"), "later")?;
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    run.note(format!(
        "a stored policy with priority 99999999999 is reported Invalid ({message:?}); a policy created after it became Ready"
    ));
    Ok(())
}
