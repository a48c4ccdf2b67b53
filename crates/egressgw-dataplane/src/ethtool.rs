//! Transmit checksum offload through the ethtool generic-netlink family.
//!
//! Kernels older than 5.7 compute a wrong checksum for VXLAN packets that
//! are SNATed after encapsulation when the device offloads the transmit
//! checksum; `vxlan.disableChecksumOffload` turns tx checksumming off on
//! `egress.vxlan`, and the reconcile warns when it is on with such a kernel
//! (see [`kernel_has_vxlan_snat_checksum_bug`]). Turning it off also turns
//! off the features that depend on it (TSO), so every change reports the
//! effective feature set read back from the kernel.
//!
//! Both requests are written here on top of `genetlink`: the `ethtool` crate
//! has no `ETHTOOL_MSG_FEATURES_SET`, and its reader drops feature bit 0.
//! Bitsets are requested in the verbose form (with names), so nothing here
//! depends on the kernel's numbering of features.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use futures_util::StreamExt;
use genetlink::GenetlinkHandle;
use netlink_packet_core::{
    DecodeError, Emitable, NLA_F_NESTED, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage,
    NetlinkPayload, Nla, NlasIterator, ParseableParametrized, parse_string,
};
use netlink_packet_generic::{GenlFamily, GenlHeader, GenlMessage};
use serde::Serialize;

use crate::{Error, Result};

// Numbers from include/uapi/linux/ethtool_netlink.h.
const ETHTOOL_MSG_FEATURES_GET: u8 = 11;
const ETHTOOL_MSG_FEATURES_SET: u8 = 12;

const ETHTOOL_A_HEADER_DEV_NAME: u16 = 2;
const ETHTOOL_A_HEADER_FLAGS: u16 = 3;
const ETHTOOL_FLAG_OMIT_REPLY: u32 = 1 << 1;

const ETHTOOL_A_FEATURES_HEADER: u16 = 1;
const ETHTOOL_A_FEATURES_HW: u16 = 2;
const ETHTOOL_A_FEATURES_WANTED: u16 = 3;
const ETHTOOL_A_FEATURES_ACTIVE: u16 = 4;

const ETHTOOL_A_BITSET_NOMASK: u16 = 1;
const ETHTOOL_A_BITSET_BITS: u16 = 3;
const ETHTOOL_A_BITSET_BITS_BIT: u16 = 1;
const ETHTOOL_A_BITSET_BIT_NAME: u16 = 2;
const ETHTOOL_A_BITSET_BIT_VALUE: u16 = 3;

/// Prefix of the features `ethtool -K dev tx on|off` changes.
const TX_CHECKSUM_PREFIX: &str = "tx-checksum-";

/// The offload features of one device that matter to egressgw, as the kernel
/// reports them active (not merely wanted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Offloads {
    /// Any `tx-checksum-*` feature is active (`ethtool -k`: tx-checksumming).
    pub tx_checksum: bool,
    /// Any `tx-scatter-gather*` feature is active (scatter-gather).
    pub scatter_gather: bool,
    /// Any `tx-tcp*-segmentation` feature is active (tcp-segmentation-offload).
    pub tcp_segmentation: bool,
    /// `tx-generic-segmentation` is active (generic-segmentation-offload).
    pub generic_segmentation: bool,
    /// `rx-gro` is active (generic-receive-offload).
    pub generic_receive: bool,
    /// Every relevant feature the device knows, by kernel name, and whether
    /// it is active.
    pub features: BTreeMap<String, bool>,
}

impl Offloads {
    /// One line in `ethtool -k`'s words, e.g. `tx-checksumming off,
    /// scatter-gather off, tcp-segmentation-offload off,
    /// generic-segmentation-offload on, generic-receive-offload on`.
    pub fn summary(&self) -> String {
        let on_off = |b: bool| if b { "on" } else { "off" };
        [
            ("tx-checksumming", self.tx_checksum),
            ("scatter-gather", self.scatter_gather),
            ("tcp-segmentation-offload", self.tcp_segmentation),
            ("generic-segmentation-offload", self.generic_segmentation),
            ("generic-receive-offload", self.generic_receive),
        ]
        .iter()
        .map(|(name, state)| format!("{name} {}", on_off(*state)))
        .collect::<Vec<_>>()
        .join(", ")
    }

    /// Builds the report from every feature name the device knows and the
    /// set of active ones.
    fn from_features<'a>(known: impl Iterator<Item = &'a str>, active: &BTreeSet<String>) -> Self {
        let features: BTreeMap<String, bool> = known
            .filter(|name| is_relevant(name))
            .map(|name| (name.to_owned(), active.contains(name)))
            .collect();
        let any = |pred: &dyn Fn(&str) -> bool| features.iter().any(|(name, on)| *on && pred(name));
        Self {
            tx_checksum: any(&|n| n.starts_with(TX_CHECKSUM_PREFIX)),
            scatter_gather: any(&|n| n.starts_with("tx-scatter-gather")),
            tcp_segmentation: any(&is_tcp_segmentation),
            generic_segmentation: any(&|n| n == "tx-generic-segmentation"),
            generic_receive: any(&|n| n == "rx-gro"),
            features,
        }
    }
}

fn is_tcp_segmentation(name: &str) -> bool {
    name.starts_with("tx-tcp") && name.ends_with("segmentation")
}

fn is_relevant(name: &str) -> bool {
    name.starts_with(TX_CHECKSUM_PREFIX)
        || name.starts_with("tx-scatter-gather")
        || is_tcp_segmentation(name)
        || matches!(name, "tx-generic-segmentation" | "rx-gro" | "rx-checksum")
}

/// Reads the active offload features of `ifname`.
pub async fn read_offloads(ifname: &str) -> Result<Offloads> {
    let mut conn = Conn::open(ifname)?;
    Ok(conn.features(ifname).await?.offloads())
}

/// Turns the device's changeable `tx-checksum-*` features on or off (what
/// `ethtool -K dev tx on|off` does) and returns the effective features read
/// back afterwards. Setting the current value again changes nothing.
///
/// Fails, naming the device, when the kernel refuses the request or when the
/// effective tx checksumming differs from `enabled` afterwards (a feature
/// the driver does not let userspace change).
pub async fn set_tx_checksum(ifname: &str, enabled: bool) -> Result<Offloads> {
    let what = format!(
        "{ifname}: set tx-checksumming {}",
        if enabled { "on" } else { "off" }
    );
    let mut conn = Conn::open(ifname)?;
    let before = conn.features(ifname).await?;
    let bits: Vec<(String, bool)> = before
        .changeable
        .iter()
        .filter(|name| name.starts_with(TX_CHECKSUM_PREFIX))
        .map(|name| (name.clone(), enabled))
        .collect();
    if !bits.is_empty() {
        conn.exchange(&what, features_set_request(ifname, &bits))
            .await?;
    }
    let after = conn.features(ifname).await?.offloads();
    if after.tx_checksum != enabled {
        return Err(Error::Ethtool {
            what,
            message: format!(
                "the device keeps tx-checksumming {} (changeable tx-checksum features: {})",
                if after.tx_checksum { "on" } else { "off" },
                if bits.is_empty() {
                    "none".to_owned()
                } else {
                    names(&bits)
                }
            ),
        });
    }
    Ok(after)
}

fn names(bits: &[(String, bool)]) -> String {
    bits.iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether the running kernel is older than 5.7, whose VXLAN transmit path
/// gets the checksum of SNATed encapsulated packets wrong unless tx
/// checksum offload is off on the VXLAN device. An unreadable release is
/// taken as a recent kernel.
pub fn kernel_has_vxlan_snat_checksum_bug() -> bool {
    nix::sys::utsname::uname()
        .ok()
        .and_then(|u| u.release().to_str().map(release_is_before_5_7))
        .unwrap_or(false)
}

/// `release` is a kernel release string such as `5.4.0-150-generic`.
fn release_is_before_5_7(release: &str) -> bool {
    kernel_version(release).is_some_and(|v| v < (5, 7))
}

/// Major and minor number of a kernel release string.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-', '+', '_']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?;
    let digits = minor
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(minor.len());
    Some((major, minor[..digits].parse().ok()?))
}

/// What a FEATURES_GET reply says about one device.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct FeatureSets {
    /// Every feature the kernel knows.
    pub(crate) known: BTreeSet<String>,
    /// Features userspace may change on this device.
    changeable: BTreeSet<String>,
    /// Active features.
    active: BTreeSet<String>,
}

impl FeatureSets {
    fn offloads(&self) -> Offloads {
        Offloads::from_features(self.known.iter().map(String::as_str), &self.active)
    }
}

/// One generic-netlink socket with its connection task; the task ends with
/// the value.
struct Conn {
    handle: GenetlinkHandle,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Conn {
    fn open(ifname: &str) -> Result<Self> {
        let (conn, handle, _) = genetlink::new_connection().map_err(|e| Error::Ethtool {
            what: format!("{ifname}: open generic netlink socket"),
            message: e.to_string(),
        })?;
        Ok(Self {
            handle,
            task: tokio::spawn(conn),
        })
    }

    async fn features(&mut self, ifname: &str) -> Result<FeatureSets> {
        let what = format!("{ifname}: read features");
        let replies = self.exchange(&what, features_get_request(ifname)).await?;
        let Some(reply) = replies.first() else {
            return Err(Error::Ethtool {
                what,
                message: "no reply".to_owned(),
            });
        };
        parse_features_reply(&reply.payload).map_err(|message| Error::Ethtool { what, message })
    }

    /// Sends one request with an ACK wanted; returns the replies before the
    /// ACK, or the kernel's error.
    async fn exchange(&mut self, what: &str, msg: EthtoolMsg) -> Result<Vec<EthtoolMsg>> {
        let fail = |message: String| Error::Ethtool {
            what: what.to_owned(),
            message,
        };
        let mut nl = NetlinkMessage::from(GenlMessage::from_payload(msg));
        nl.header.flags = NLM_F_REQUEST | NLM_F_ACK;
        let mut answers = self
            .handle
            .request(nl)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut replies = Vec::new();
        while let Some(answer) = answers.next().await {
            match answer.map_err(|e| fail(e.to_string()))?.payload {
                NetlinkPayload::InnerMessage(genl) => replies.push(genl.payload),
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    return Err(fail(e.to_io().to_string()));
                }
                _ => {}
            }
        }
        Ok(replies)
    }
}

/// A netlink attribute of the few shapes these requests use.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Attr {
    Nested(u16, Vec<Attr>),
    Str(u16, String),
    U32(u16, u32),
    Flag(u16),
}

impl Nla for Attr {
    fn value_len(&self) -> usize {
        match self {
            Self::Nested(_, attrs) => attrs.as_slice().buffer_len(),
            Self::Str(_, s) => s.len() + 1,
            Self::U32(..) => 4,
            Self::Flag(_) => 0,
        }
    }

    fn kind(&self) -> u16 {
        match self {
            Self::Nested(kind, _) => kind | NLA_F_NESTED,
            Self::Str(kind, _) | Self::U32(kind, _) | Self::Flag(kind) => *kind,
        }
    }

    fn emit_value(&self, buffer: &mut [u8]) {
        match self {
            Self::Nested(_, attrs) => attrs.as_slice().emit(buffer),
            Self::Str(_, s) => {
                buffer[..s.len()].copy_from_slice(s.as_bytes());
                buffer[s.len()] = 0;
            }
            Self::U32(_, v) => buffer[..4].copy_from_slice(&v.to_ne_bytes()),
            Self::Flag(_) => {}
        }
    }
}

/// An ethtool generic-netlink message: a request built from attributes, or a
/// reply kept as raw attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EthtoolMsg {
    cmd: u8,
    attrs: Vec<Attr>,
    payload: Vec<u8>,
}

impl GenlFamily for EthtoolMsg {
    fn family_name() -> &'static str {
        "ethtool"
    }

    fn command(&self) -> u8 {
        self.cmd
    }

    fn version(&self) -> u8 {
        1
    }
}

impl Emitable for EthtoolMsg {
    fn buffer_len(&self) -> usize {
        self.attrs.as_slice().buffer_len() + self.payload.len()
    }

    fn emit(&self, buffer: &mut [u8]) {
        let n = self.attrs.as_slice().buffer_len();
        self.attrs.as_slice().emit(&mut buffer[..n]);
        buffer[n..n + self.payload.len()].copy_from_slice(&self.payload);
    }
}

impl ParseableParametrized<[u8], GenlHeader> for EthtoolMsg {
    fn parse_with_param(buf: &[u8], header: GenlHeader) -> Result<Self, DecodeError> {
        Ok(Self {
            cmd: header.cmd,
            attrs: Vec::new(),
            payload: buf.to_vec(),
        })
    }
}

fn request_header(ifname: &str, flags: u32) -> Attr {
    let mut attrs = vec![Attr::Str(ETHTOOL_A_HEADER_DEV_NAME, ifname.to_owned())];
    if flags != 0 {
        attrs.push(Attr::U32(ETHTOOL_A_HEADER_FLAGS, flags));
    }
    Attr::Nested(ETHTOOL_A_FEATURES_HEADER, attrs)
}

fn features_get_request(ifname: &str) -> EthtoolMsg {
    EthtoolMsg {
        cmd: ETHTOOL_MSG_FEATURES_GET,
        attrs: vec![request_header(ifname, 0)],
        payload: Vec::new(),
    }
}

/// FEATURES_SET with a verbose, masked WANTED bitset: only the listed
/// features change, each to its value.
fn features_set_request(ifname: &str, bits: &[(String, bool)]) -> EthtoolMsg {
    let bit = |(name, on): &(String, bool)| {
        let mut attrs = vec![Attr::Str(ETHTOOL_A_BITSET_BIT_NAME, name.clone())];
        if *on {
            attrs.push(Attr::Flag(ETHTOOL_A_BITSET_BIT_VALUE));
        }
        Attr::Nested(ETHTOOL_A_BITSET_BITS_BIT, attrs)
    };
    let wanted = Attr::Nested(
        ETHTOOL_A_FEATURES_WANTED,
        vec![Attr::Nested(
            ETHTOOL_A_BITSET_BITS,
            bits.iter().map(bit).collect(),
        )],
    );
    EthtoolMsg {
        cmd: ETHTOOL_MSG_FEATURES_SET,
        attrs: vec![request_header(ifname, ETHTOOL_FLAG_OMIT_REPLY), wanted],
        payload: Vec::new(),
    }
}

/// Reads HW (with mask: every known feature, value = changeable) and ACTIVE
/// (no mask: the active features) from a verbose FEATURES_GET reply.
pub(crate) fn parse_features_reply(payload: &[u8]) -> Result<FeatureSets, String> {
    let mut sets = FeatureSets::default();
    for nla in NlasIterator::new(payload) {
        let nla = nla.map_err(|e| e.to_string())?;
        match nla.kind() & NLA_TYPE_MASK {
            ETHTOOL_A_FEATURES_HW => {
                for (name, value) in parse_bitset(nla.value())? {
                    if value {
                        sets.changeable.insert(name.clone());
                    }
                    sets.known.insert(name);
                }
            }
            ETHTOOL_A_FEATURES_ACTIVE => {
                for (name, value) in parse_bitset(nla.value())? {
                    if value {
                        sets.active.insert(name.clone());
                    }
                    sets.known.insert(name);
                }
            }
            _ => {}
        }
    }
    Ok(sets)
}

/// The bits of a verbose bitset as (name, value). A bitset with a mask lists
/// the bits of the mask, the set ones with the value flag; one without
/// (NOMASK) lists only the set bits, without the flag.
fn parse_bitset(payload: &[u8]) -> Result<Vec<(String, bool)>, String> {
    let mut nomask = false;
    let mut bits_attr = None;
    for nla in NlasIterator::new(payload) {
        let nla = nla.map_err(|e| e.to_string())?;
        match nla.kind() & NLA_TYPE_MASK {
            ETHTOOL_A_BITSET_NOMASK => nomask = true,
            ETHTOOL_A_BITSET_BITS => bits_attr = Some(nla),
            _ => {}
        }
    }
    let Some(bits_attr) = bits_attr else {
        return Err("a compact bitset where a verbose one was asked for".to_owned());
    };
    let mut bits = Vec::new();
    for bit in NlasIterator::new(bits_attr.value()) {
        let bit = bit.map_err(|e| e.to_string())?;
        if bit.kind() & NLA_TYPE_MASK != ETHTOOL_A_BITSET_BITS_BIT {
            continue;
        }
        let (mut name, mut value) = (None, nomask);
        for field in NlasIterator::new(bit.value()) {
            let field = field.map_err(|e| e.to_string())?;
            match field.kind() & NLA_TYPE_MASK {
                ETHTOOL_A_BITSET_BIT_NAME => {
                    name = Some(parse_string(field.value()).map_err(|e| e.to_string())?);
                }
                ETHTOOL_A_BITSET_BIT_VALUE => value = true,
                _ => {}
            }
        }
        bits.push((name.ok_or("a feature bit without a name")?, value));
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testns::{block_on_in_new_netns, root_or_skip, sh};

    #[test]
    fn kernel_releases_before_5_7_have_the_vxlan_snat_checksum_bug() {
        for old in [
            "4.19.0-17-amd64",
            "5.4.0-150-generic",
            "5.6.19",
            "3.10.0-1160.el7.x86_64",
        ] {
            assert!(release_is_before_5_7(old), "{old}");
        }
        for new in [
            "5.7.0",
            "5.10.0-23-cloud-amd64",
            "6.18.44-fc-v657",
            "6.1",
            "10.0.1",
        ] {
            assert!(!release_is_before_5_7(new), "{new}");
        }
    }

    #[test]
    fn unreadable_kernel_releases_count_as_recent() {
        for odd in ["", "linux", "5", "x.y"] {
            assert!(!release_is_before_5_7(odd), "{odd:?}");
        }
        assert_eq!(kernel_version("5.15rc3"), Some((5, 15)));
    }

    #[test]
    fn set_request_lists_only_the_named_bits_with_values() {
        let msg = features_set_request("vx0", &[("tx-checksum-ipv4".into(), true)]);
        let mut buf = vec![0; msg.buffer_len()];
        msg.emit(&mut buf);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            // FEATURES_HEADER (nested): DEV_NAME "vx0", FLAGS OMIT_REPLY
            &[20, 0, 0x01, 0x80][..],
            &[8, 0, 2, 0], b"vx0\0",
            &[8, 0, 3, 0], &2u32.to_ne_bytes(),
            // FEATURES_WANTED (nested) > BITS (nested) > BIT (nested)
            &[40, 0, 0x03, 0x80],
            &[36, 0, 0x03, 0x80],
            &[32, 0, 0x01, 0x80],
            &[21, 0, 2, 0], b"tx-checksum-ipv4\0", &[0, 0, 0],
            &[4, 0, 3, 0],
        ]
        .concat();
        assert_eq!(buf, expected);
    }

    /// A verbose bitset as the kernel writes it: with a mask, every bit of
    /// the mask with the value flag when set; without, only the set bits.
    fn bitset(kind: u16, bits: &[(&str, bool)], masked: bool) -> Attr {
        let bit = |(name, on): &(&str, bool)| {
            let mut attrs = vec![
                Attr::U32(1, 0),
                Attr::Str(ETHTOOL_A_BITSET_BIT_NAME, (*name).into()),
            ];
            if *on && masked {
                attrs.push(Attr::Flag(ETHTOOL_A_BITSET_BIT_VALUE));
            }
            Attr::Nested(ETHTOOL_A_BITSET_BITS_BIT, attrs)
        };
        let mut attrs = vec![Attr::U32(2, 64)];
        if !masked {
            attrs.push(Attr::Flag(ETHTOOL_A_BITSET_NOMASK));
        }
        let listed = bits.iter().filter(|(_, on)| masked || *on);
        attrs.push(Attr::Nested(
            ETHTOOL_A_BITSET_BITS,
            listed.map(bit).collect(),
        ));
        Attr::Nested(kind, attrs)
    }

    #[test]
    fn reply_gives_changeable_and_active_features_and_offload_summary() {
        let reply = vec![
            request_header("vx0", 0),
            bitset(
                ETHTOOL_A_FEATURES_HW,
                &[
                    ("tx-scatter-gather", true),
                    ("tx-checksum-ipv4", false),
                    ("tx-checksum-ip-generic", true),
                    ("tx-tcp-segmentation", true),
                    ("tx-generic-segmentation", true),
                    ("rx-gro", true),
                    ("tx-vlan-hw-insert", true),
                ],
                true,
            ),
            bitset(
                ETHTOOL_A_FEATURES_WANTED,
                &[("tx-checksum-ip-generic", true)],
                false,
            ),
            bitset(
                ETHTOOL_A_FEATURES_ACTIVE,
                &[
                    ("tx-checksum-ipv4", false),
                    ("tx-generic-segmentation", true),
                    ("rx-gro", true),
                ],
                false,
            ),
        ];
        let mut buf = vec![0; reply.as_slice().buffer_len()];
        reply.as_slice().emit(&mut buf);

        let sets = parse_features_reply(&buf).unwrap();
        assert!(sets.changeable.contains("tx-checksum-ip-generic"));
        assert!(!sets.changeable.contains("tx-checksum-ipv4"));
        let offloads = sets.offloads();
        assert!(!offloads.tx_checksum);
        assert_eq!(offloads.features.get("tx-checksum-ipv4"), Some(&false));
        assert!(!offloads.features.contains_key("tx-vlan-hw-insert"));
        assert_eq!(
            offloads.summary(),
            "tx-checksumming off, scatter-gather off, tcp-segmentation-offload off, \
             generic-segmentation-offload on, generic-receive-offload on"
        );
    }

    fn ethtool_k(dev: &str) -> String {
        sh(&format!("ethtool -k {dev}"))
    }

    fn ethtool_cmd_available() -> bool {
        let found = std::process::Command::new("ethtool")
            .arg("--version")
            .output()
            .is_ok();
        if !found {
            eprintln!("ethtool(8) not installed: checking through read_offloads only");
        }
        found
    }

    async fn toggles_tx_checksum_on(dev: &str) {
        let off = set_tx_checksum(dev, false).await.unwrap();
        assert!(!off.tx_checksum, "{off:?}");
        assert!(
            off.features
                .iter()
                .all(|(n, on)| !n.starts_with("tx-checksum-") || !on)
        );
        assert_eq!(read_offloads(dev).await.unwrap(), off);
        if ethtool_cmd_available() {
            assert!(
                ethtool_k(dev).contains("tx-checksumming: off"),
                "{}",
                ethtool_k(dev)
            );
        }
        assert_eq!(
            set_tx_checksum(dev, false).await.unwrap(),
            off,
            "second off"
        );

        let on = set_tx_checksum(dev, true).await.unwrap();
        assert!(on.tx_checksum, "{on:?}");
        assert_eq!(read_offloads(dev).await.unwrap(), on);
        if ethtool_cmd_available() {
            assert!(
                ethtool_k(dev).contains("tx-checksumming: on"),
                "{}",
                ethtool_k(dev)
            );
        }
        assert_eq!(set_tx_checksum(dev, true).await.unwrap(), on, "second on");
    }

    #[test]
    fn tx_checksum_turns_off_and_on_again_on_vxlan_and_veth() {
        if !root_or_skip("tx_checksum_turns_off_and_on_again_on_vxlan_and_veth") {
            return;
        }
        block_on_in_new_netns(async || {
            sh("ip link add vx0 type vxlan id 42 dstport 4789 local 127.0.0.1 dev lo");
            sh("ip link add va type veth peer name vb");
            let initial = read_offloads("vx0").await.unwrap();
            assert!(
                initial.tx_checksum,
                "a new vxlan device offloads checksums: {initial:?}"
            );
            toggles_tx_checksum_on("vx0").await;
            toggles_tx_checksum_on("va").await;
        });
    }

    #[test]
    fn turning_tx_checksum_off_reports_segmentation_off_too() {
        if !root_or_skip("turning_tx_checksum_off_reports_segmentation_off_too") {
            return;
        }
        block_on_in_new_netns(async || {
            sh("ip link add va type veth peer name vb");
            let off = set_tx_checksum("va", false).await.unwrap();
            // Not `off.tcp_segmentation`: Linux 6.18 leaves the new
            // tx-tcp-accecn-segmentation on, and `ethtool -k` then shows
            // tcp-segmentation-offload on as well.
            for tso in ["tx-tcp-segmentation", "tx-tcp6-segmentation"] {
                assert_eq!(off.features.get(tso), Some(&false), "{tso}: {off:?}");
            }
            assert!(
                off.summary().starts_with("tx-checksumming off, "),
                "{}",
                off.summary()
            );
        });
    }

    #[test]
    fn unknown_device_is_an_error_naming_it() {
        if !root_or_skip("unknown_device_is_an_error_naming_it") {
            return;
        }
        block_on_in_new_netns(async || {
            let err = set_tx_checksum("nosuchdev0", false).await.unwrap_err();
            assert!(err.to_string().contains("nosuchdev0"), "{err}");
            let err = read_offloads("nosuchdev0").await.unwrap_err();
            assert!(err.to_string().contains("nosuchdev0"), "{err}");
        });
    }
}
