//! Linux capabilities of a container, computed from its `securityContext`
//! the way containerd's CRI plugin computes them.
//!
//! The set starts from the runtime's default set; `add: [ALL]` makes it every
//! capability, `drop: [ALL]` empties it, then single names are added, then
//! single names dropped (so `drop: [ALL], add: [NET_ADMIN]` is NET_ADMIN
//! alone, and `add: [ALL], drop: [CHOWN]` is all but CHOWN). `privileged`
//! is every capability. The result is the bounding, permitted and effective
//! set; inheritable and ambient are empty. A process that runs as root keeps
//! that set across exec; one that runs as another user keeps nothing unless
//! its program has file capabilities, as with containerd and runc.

use std::collections::BTreeSet;

use anyhow::bail;
use k8s_openapi::api::core::v1::SecurityContext;

/// Every capability this kernel interface knows, by number.
pub const ALL: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// containerd's default set for a container that asks for nothing.
pub const DEFAULT: [&str; 14] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
];

/// A set of capabilities, by kernel name without `CAP_` (`NET_ADMIN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapSet(BTreeSet<&'static str>);

impl CapSet {
    pub fn all() -> Self {
        Self(ALL.into_iter().collect())
    }

    pub fn default_set() -> Self {
        Self(DEFAULT.into_iter().collect())
    }

    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.0.iter().copied()
    }

    /// The capabilities of a `/proc/<pid>/status` mask (`CapEff: 0000...3000`).
    pub fn from_mask(mask: u64) -> Self {
        Self(
            ALL.iter()
                .enumerate()
                .filter(|(bit, _)| mask & 1 << bit != 0)
                .map(|(_, name)| *name)
                .collect(),
        )
    }
}

/// `setpriv --bounding-set` for `names`: `-all,+net_admin,...` (everything
/// dropped, then these kept).
pub fn setpriv_bounding<S: AsRef<str>>(names: &[S]) -> String {
    std::iter::once("-all".to_owned())
        .chain(
            names
                .iter()
                .map(|c| format!("+{}", c.as_ref().to_lowercase())),
        )
        .collect::<Vec<_>>()
        .join(",")
}

/// The kernel name of a capability as a Pod spec writes it
/// (`NET_ADMIN`, `CAP_NET_ADMIN`, `net_admin`), or `ALL`.
fn canonical(name: &str) -> anyhow::Result<&'static str> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
    if bare == "ALL" {
        return Ok("ALL");
    }
    match ALL.iter().find(|c| **c == bare) {
        Some(found) => Ok(found),
        None => bail!("unknown capability {name:?}"),
    }
}

/// The capabilities of a container with this security context.
pub fn of(context: Option<&SecurityContext>) -> anyhow::Result<CapSet> {
    let Some(context) = context else {
        return Ok(CapSet::default_set());
    };
    if context.privileged == Some(true) {
        return Ok(CapSet::all());
    }
    let (add, drop) = context
        .capabilities
        .as_ref()
        .map(|c| {
            (
                c.add.clone().unwrap_or_default(),
                c.drop.clone().unwrap_or_default(),
            )
        })
        .unwrap_or_default();
    let add = add
        .iter()
        .map(|c| canonical(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let drop = drop
        .iter()
        .map(|c| canonical(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut set = CapSet::default_set();
    if add.contains(&"ALL") {
        set = CapSet::all();
    }
    if drop.contains(&"ALL") {
        set.0.clear();
    }
    set.0.extend(add.iter().filter(|c| **c != "ALL"));
    for c in drop.iter().filter(|c| **c != "ALL") {
        set.0.remove(c);
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Capabilities;

    use super::*;

    fn context(add: &[&str], drop: &[&str]) -> SecurityContext {
        let list = |names: &[&str]| Some(names.iter().map(|n| (*n).to_owned()).collect());
        SecurityContext {
            capabilities: Some(Capabilities {
                add: list(add),
                drop: list(drop),
            }),
            ..SecurityContext::default()
        }
    }

    fn names(set: &CapSet) -> Vec<&'static str> {
        set.names().collect()
    }

    fn mask(set: &CapSet) -> u64 {
        ALL.iter()
            .enumerate()
            .filter(|(_, name)| set.names().any(|n| n == **name))
            .fold(0, |mask, (bit, _)| mask | 1 << bit)
    }

    #[test]
    fn a_container_that_asks_for_nothing_gets_the_runtime_default() {
        assert_eq!(of(None).unwrap(), CapSet::default_set());
        assert_eq!(
            of(Some(&SecurityContext::default())).unwrap(),
            CapSet::default_set()
        );
        assert!(!names(&of(None).unwrap()).contains(&"NET_ADMIN"));
    }

    #[test]
    fn drop_all_then_add_keeps_only_what_is_added() {
        let set = of(Some(&context(&["NET_ADMIN", "CAP_NET_RAW"], &["ALL"]))).unwrap();
        assert_eq!(names(&set), ["NET_ADMIN", "NET_RAW"]);
        assert_eq!(mask(&set), 0x3000);
    }

    #[test]
    fn add_all_then_drop_removes_what_is_dropped() {
        let set = of(Some(&context(&["ALL"], &["chown"]))).unwrap();
        let names = names(&set);
        assert!(!names.contains(&"CHOWN"));
        assert!(names.contains(&"SYS_ADMIN") && names.contains(&"BPF"));
    }

    #[test]
    fn privileged_is_every_capability_whatever_is_dropped() {
        let mut ctx = context(&[], &["ALL"]);
        ctx.privileged = Some(true);
        assert_eq!(of(Some(&ctx)).unwrap(), CapSet::all());
    }

    #[test]
    fn an_unknown_capability_is_an_error_naming_it() {
        let err = of(Some(&context(&["NET_WIZARD"], &[]))).unwrap_err();
        assert!(err.to_string().contains("NET_WIZARD"), "{err}");
    }

    #[test]
    fn masks_read_back_as_the_same_set() {
        let set = of(Some(&context(&["BPF", "PERFMON"], &["ALL"]))).unwrap();
        assert_eq!(CapSet::from_mask(mask(&set)), set);
        assert_eq!(mask(&set), 1 << 38 | 1 << 39);
    }

    #[test]
    fn setpriv_gets_the_set_after_clearing_everything() {
        let set: Vec<&str> = of(Some(&context(&["NET_ADMIN"], &["ALL"])))
            .unwrap()
            .names()
            .collect();
        assert_eq!(setpriv_bounding(&set), "-all,+net_admin");
        assert_eq!(setpriv_bounding::<&str>(&[]), "-all");
    }
}
