//! Leases (`coordination.k8s.io/v1`): the agents' liveness and the
//! controller's leader election.
//!
//! Expiry is judged by the observer's own clock: a Lease has expired when
//! its `renewTime` has not changed for its duration *as this process saw
//! it*, so clocks of different machines never have to agree.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};

use crate::cluster::metrics::{ApiRequests, Verb};

/// Name of an agent's Lease.
pub fn agent_lease_name(node: &str) -> String {
    format!("egressgw-agent-{node}")
}

/// Renews (creating it if needed) the Lease `name` held by `holder`.
pub async fn renew(
    api: &Api<Lease>,
    requests: &ApiRequests,
    name: &str,
    holder: &str,
    duration: Duration,
) -> anyhow::Result<()> {
    let lease = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": name },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": seconds(duration),
            "renewTime": MicroTime(Timestamp::now()),
        },
    });
    let params = PatchParams::apply("egressgw-agent").force();
    requests
        .send(Verb::Patch, api.patch(name, &params, &Patch::Apply(&lease)))
        .await
        .with_context(|| format!("renewing Lease {name}"))?;
    Ok(())
}

fn seconds(duration: Duration) -> i32 {
    i32::try_from(duration.as_secs().max(1)).unwrap_or(i32::MAX)
}

/// Watches renewals of Leases and says which ones stopped.
///
/// A Lease is alive while it was renewed within the observer's timeout,
/// or within its own `leaseDurationSeconds` when that is longer: an agent
/// that stops for a restart (a rolling upgrade) renews its Lease one last
/// time with a longer duration, so that its node keeps its EIPs while the
/// replacement starts.
#[derive(Debug, Default)]
pub struct Liveness {
    /// Lease name -> what was last seen of it.
    seen: HashMap<String, Seen>,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The last renewTime seen.
    renewed: Option<Timestamp>,
    /// When this process first saw that renewTime.
    since: Instant,
    /// The Lease's own duration.
    duration: Option<Duration>,
}

impl Liveness {
    /// Records the Leases as they are now; forgets Leases that are gone.
    pub fn observe<'a>(&mut self, leases: impl IntoIterator<Item = &'a Lease>, now: Instant) {
        let mut current = HashMap::new();
        for lease in leases {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let spec = lease.spec.as_ref();
            let renewed = spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0);
            let duration = spec
                .and_then(|s| s.lease_duration_seconds)
                .and_then(|d| u64::try_from(d).ok())
                .map(Duration::from_secs);
            let since = match self.seen.get(&name) {
                Some(seen) if seen.renewed == renewed => seen.since,
                _ => now,
            };
            current.insert(
                name,
                Seen {
                    renewed,
                    since,
                    duration,
                },
            );
        }
        self.seen = current;
    }

    /// Whether `name` was renewed within `timeout` (or the Lease's own,
    /// longer duration) of `now`; `None` for a Lease never seen.
    pub fn alive(&self, name: &str, timeout: Duration, now: Instant) -> Option<bool> {
        self.seen.get(name).map(|seen| {
            let limit = seen.duration.map_or(timeout, |d| d.max(timeout));
            now.saturating_duration_since(seen.since) <= limit
        })
    }
}

/// Leader election on one Lease: at most one holder at a time, taken over
/// only after the holder stopped renewing for the Lease's duration.
#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    requests: ApiRequests,
    /// The record last read and when it was first seen unchanged.
    observed: Option<(LeaseSpec, Instant)>,
}

impl Elector {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
        requests: ApiRequests,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            requests,
            observed: None,
        }
    }

    /// One round: takes or renews the Lease when it may. Returns whether
    /// this process holds it now.
    pub async fn try_acquire_or_renew(&mut self) -> anyhow::Result<bool> {
        let now = Instant::now();
        let current = self
            .requests
            .send(Verb::Get, self.api.get_opt(&self.name))
            .await
            .with_context(|| format!("reading Lease {}", self.name))?;
        let Some(lease) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(None)),
            };
            let created = self
                .requests
                .send(
                    Verb::Create,
                    self.api.create(&PostParams::default(), &lease),
                )
                .await;
            return match created {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e).context(format!("creating Lease {}", self.name)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let since = match &self.observed {
            Some((old, since))
                if old.renew_time == spec.renew_time
                    && old.holder_identity == spec.holder_identity =>
            {
                *since
            }
            _ => now,
        };
        self.observed = Some((spec.clone(), since));
        let held_by_me = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let held = spec
            .holder_identity
            .as_deref()
            .is_some_and(|h| !h.is_empty());
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.duration, Duration::from_secs);
        let expired = now.saturating_duration_since(since) > duration;
        if !held_by_me && held && !expired {
            return Ok(false);
        }
        let mut updated = lease;
        updated.spec = Some(self.spec(Some(&spec)));
        // The resourceVersion in `updated` makes this a compare-and-swap.
        match self
            .requests
            .send(
                Verb::Update,
                self.api
                    .replace(&self.name, &PostParams::default(), &updated),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e).context(format!("updating Lease {}", self.name)),
        }
    }

    /// Gives the Lease up if this process holds it, so that another
    /// replica takes over at once instead of after the Lease's duration.
    pub async fn release(&self) -> anyhow::Result<()> {
        let Some(mut lease) = self
            .requests
            .send(Verb::Get, self.api.get_opt(&self.name))
            .await?
        else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        self.requests
            .send(
                Verb::Update,
                self.api.replace(&self.name, &PostParams::default(), &lease),
            )
            .await
            .with_context(|| format!("releasing Lease {}", self.name))?;
        Ok(())
    }

    fn spec(&self, old: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let same_holder =
            old.and_then(|o| o.holder_identity.as_deref()) == Some(self.identity.as_str());
        let transitions = old.and_then(|o| o.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(seconds(self.duration)),
            acquire_time: if same_holder {
                old.and_then(|o| o.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if same_holder || old.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..LeaseSpec::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, renewed_at: i64) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                renew_time: Some(MicroTime(
                    Timestamp::from_second(renewed_at).unwrap_or(Timestamp::UNIX_EPOCH),
                )),
                ..LeaseSpec::default()
            }),
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(3);

    #[test]
    fn a_lease_renewed_within_the_timeout_is_alive_and_one_left_alone_longer_is_not() {
        let t0 = Instant::now();
        let mut liveness = Liveness::default();
        liveness.observe([&lease("a", 100)], t0);
        liveness.observe([&lease("a", 101)], t0 + Duration::from_secs(2));
        assert_eq!(
            liveness.alive("a", TIMEOUT, t0 + Duration::from_secs(4)),
            Some(true)
        );
        // Unchanged from t0+2 s to t0+6 s: 4 s without a renewal.
        liveness.observe([&lease("a", 101)], t0 + Duration::from_secs(6));
        assert_eq!(
            liveness.alive("a", TIMEOUT, t0 + Duration::from_secs(6)),
            Some(false)
        );
    }

    #[test]
    fn expiry_follows_the_observers_clock_not_the_renew_time_written_in_the_lease() {
        // A renewTime far in the past (a skewed clock) still counts as a
        // renewal when it changes.
        let t0 = Instant::now();
        let mut liveness = Liveness::default();
        liveness.observe([&lease("a", 1)], t0);
        liveness.observe([&lease("a", 2)], t0 + Duration::from_secs(10));
        assert_eq!(
            liveness.alive("a", TIMEOUT, t0 + Duration::from_secs(11)),
            Some(true)
        );
    }

    #[test]
    fn a_lease_never_seen_or_deleted_is_unknown() {
        let t0 = Instant::now();
        let mut liveness = Liveness::default();
        assert_eq!(liveness.alive("a", TIMEOUT, t0), None);
        liveness.observe([&lease("a", 1)], t0);
        liveness.observe(std::iter::empty(), t0);
        assert_eq!(liveness.alive("a", TIMEOUT, t0), None);
    }

    #[test]
    fn a_lease_renewed_with_a_longer_duration_stays_alive_that_long() {
        let start = Instant::now();
        let mut liveness = Liveness::default();
        let mut lease = lease("a", 1);
        lease.spec.as_mut().unwrap().lease_duration_seconds = Some(30);
        liveness.observe([&lease], start);
        let timeout = Duration::from_secs(3);
        assert_eq!(
            liveness.alive("a", timeout, start + Duration::from_secs(20)),
            Some(true)
        );
        assert_eq!(
            liveness.alive("a", timeout, start + Duration::from_secs(31)),
            Some(false)
        );
    }

    #[test]
    fn a_shorter_lease_duration_does_not_shorten_the_timeout() {
        let start = Instant::now();
        let mut liveness = Liveness::default();
        let mut lease = lease("a", 1);
        lease.spec.as_mut().unwrap().lease_duration_seconds = Some(1);
        liveness.observe([&lease], start);
        assert_eq!(
            liveness.alive("a", Duration::from_secs(3), start + Duration::from_secs(2)),
            Some(true)
        );
    }
}
