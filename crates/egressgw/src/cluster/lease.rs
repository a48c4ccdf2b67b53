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
    let lease = renewal(name, holder, duration, Timestamp::now());
    let params = PatchParams::apply("egressgw-agent").force();
    requests
        .send(Verb::Patch, api.patch(name, &params, &Patch::Apply(&lease)))
        .await
        .with_context(|| format!("renewing Lease {name}"))?;
    Ok(())
}

/// The server-side apply body that renews the Lease `name` for `holder`
/// at `wall`, valid for `duration` (at least a second).
pub fn renewal(name: &str, holder: &str, duration: Duration, wall: Timestamp) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": name },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": seconds(duration),
            "renewTime": MicroTime(wall),
        },
    })
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
        let round = election_round(
            current.as_ref().map(|l| l.spec.clone().unwrap_or_default()),
            self.observed.as_ref(),
            &self.identity,
            self.duration,
            now,
            Timestamp::now(),
        );
        self.observed = round.observed;
        match round.write {
            ElectionWrite::Wait => Ok(false),
            ElectionWrite::Create(spec) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                let created = self
                    .requests
                    .send(
                        Verb::Create,
                        self.api.create(&PostParams::default(), &lease),
                    )
                    .await;
                match created {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e).context(format!("creating Lease {}", self.name)),
                }
            }
            ElectionWrite::Update(spec) => {
                let mut updated = current.context("an update follows a read Lease")?;
                updated.spec = Some(spec);
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
}

/// What one round of leader election writes.
#[derive(Debug, Clone, PartialEq)]
pub enum ElectionWrite {
    /// Nothing: another holder renews the Lease.
    Wait,
    /// The Lease does not exist: create it, held by this process.
    Create(LeaseSpec),
    /// Renew the Lease this process holds, or take over one that expired
    /// or was released (compare-and-swap on the version read).
    Update(LeaseSpec),
}

/// One round's decision and what to remember of the Lease for the next.
#[derive(Debug, Clone, PartialEq)]
pub struct ElectionRound {
    pub write: ElectionWrite,
    /// The record read and when this process first saw it unchanged.
    pub observed: Option<(LeaseSpec, Instant)>,
}

/// Decides one round of leader election for `identity` from the Lease as
/// read (`None`: it does not exist) and what the last round `observed`.
/// Another holder's Lease counts as expired once its record has not
/// changed for its duration on this process's clock (`now`); `wall` is the
/// time written into the Lease.
pub fn election_round(
    current: Option<LeaseSpec>,
    observed: Option<&(LeaseSpec, Instant)>,
    identity: &str,
    duration: Duration,
    now: Instant,
    wall: Timestamp,
) -> ElectionRound {
    let Some(spec) = current else {
        return ElectionRound {
            write: ElectionWrite::Create(held_spec(None, identity, duration, wall)),
            observed: None,
        };
    };
    let since = match observed {
        Some((old, since))
            if old.renew_time == spec.renew_time && old.holder_identity == spec.holder_identity =>
        {
            *since
        }
        _ => now,
    };
    let held_by_me = spec.holder_identity.as_deref() == Some(identity);
    let held = spec
        .holder_identity
        .as_deref()
        .is_some_and(|h| !h.is_empty());
    let lease_duration = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(duration, Duration::from_secs);
    let expired = now.saturating_duration_since(since) > lease_duration;
    let write = if !held_by_me && held && !expired {
        ElectionWrite::Wait
    } else {
        ElectionWrite::Update(held_spec(Some(&spec), identity, duration, wall))
    };
    ElectionRound {
        write,
        observed: Some((spec, since)),
    }
}

/// The Lease record with `identity` holding it, renewed at `wall`, after `old`.
fn held_spec(
    old: Option<&LeaseSpec>,
    identity: &str,
    duration: Duration,
    wall: Timestamp,
) -> LeaseSpec {
    let now = MicroTime(wall);
    let same_holder = old.and_then(|o| o.holder_identity.as_deref()) == Some(identity);
    let transitions = old.and_then(|o| o.lease_transitions).unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(identity.to_owned()),
        lease_duration_seconds: Some(seconds(duration)),
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

    fn wall(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    fn held_by(holder: &str, renewed_at: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(MicroTime(wall(1))),
            renew_time: Some(MicroTime(wall(renewed_at))),
            lease_transitions: Some(2),
            ..LeaseSpec::default()
        }
    }

    const LEASE: Duration = Duration::from_secs(15);

    #[test]
    fn a_missing_lease_is_created_held_by_this_replica() {
        let round = election_round(None, None, "me", LEASE, Instant::now(), wall(50));
        let ElectionWrite::Create(spec) = round.write else {
            panic!("{:?}", round.write);
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.renew_time, Some(MicroTime(wall(50))));
        assert_eq!(spec.acquire_time, Some(MicroTime(wall(50))));
        assert_eq!(spec.lease_transitions, Some(0));
    }

    #[test]
    fn another_holders_lease_is_taken_only_once_it_stood_still_for_its_duration() {
        let t0 = Instant::now();
        let theirs = held_by("other", 10);
        let first = election_round(Some(theirs.clone()), None, "me", LEASE, t0, wall(100));
        assert_eq!(first.write, ElectionWrite::Wait);
        // Renewed meanwhile: the clock starts again.
        let renewed = held_by("other", 11);
        let later = t0 + Duration::from_secs(14);
        let second = election_round(
            Some(renewed.clone()),
            first.observed.as_ref(),
            "me",
            LEASE,
            later,
            wall(114),
        );
        assert_eq!(second.write, ElectionWrite::Wait);
        assert_eq!(
            second.observed.as_ref().map(|(_, since)| *since),
            Some(later)
        );
        // Unchanged for 15 s on this clock is not yet expired; 16 s is.
        let at_15 = later + LEASE;
        let third = election_round(
            Some(renewed.clone()),
            second.observed.as_ref(),
            "me",
            LEASE,
            at_15,
            wall(129),
        );
        assert_eq!(third.write, ElectionWrite::Wait);
        let at_16 = later + Duration::from_secs(16);
        let taken = election_round(
            Some(renewed),
            second.observed.as_ref(),
            "me",
            LEASE,
            at_16,
            wall(130),
        );
        let ElectionWrite::Update(spec) = taken.write else {
            panic!("{:?}", taken.write);
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.acquire_time, Some(MicroTime(wall(130))));
        assert_eq!(
            spec.lease_transitions,
            Some(3),
            "a new holder is a transition"
        );
    }

    #[test]
    fn this_replicas_own_lease_is_renewed_keeping_its_acquire_time() {
        let mine = held_by("me", 10);
        let round = election_round(Some(mine), None, "me", LEASE, Instant::now(), wall(12));
        let ElectionWrite::Update(spec) = round.write else {
            panic!("{:?}", round.write);
        };
        assert_eq!(spec.renew_time, Some(MicroTime(wall(12))));
        assert_eq!(spec.acquire_time, Some(MicroTime(wall(1))));
        assert_eq!(spec.lease_transitions, Some(2));
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let released = LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            ..held_by("other", 10)
        };
        let round = election_round(Some(released), None, "me", LEASE, Instant::now(), wall(11));
        assert!(
            matches!(round.write, ElectionWrite::Update(_)),
            "{:?}",
            round.write
        );
    }

    #[test]
    fn an_agents_renewal_names_the_holder_its_duration_and_the_time() {
        let body = renewal(
            "egressgw-agent-n1",
            "n1",
            Duration::from_millis(300),
            wall(7),
        );
        assert_eq!(body["metadata"]["name"], "egressgw-agent-n1");
        assert_eq!(body["spec"]["holderIdentity"], "n1");
        assert_eq!(body["spec"]["leaseDurationSeconds"], 1, "at least a second");
        assert_eq!(body["spec"]["renewTime"], "1970-01-01T00:00:07.000000Z");
    }

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
