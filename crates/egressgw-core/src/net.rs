//! Address types shared by the API validation and the planner: pool entries
//! (`a`, `a-b`, `a/len`), IP families, and prefix helpers.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// An IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// IPv4.
    Ipv4,
    /// IPv6.
    Ipv6,
}

impl Family {
    /// Both families, IPv4 first.
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::Ipv4,
            IpAddr::V6(_) => Family::Ipv6,
        }
    }

    /// The family of `net`.
    pub fn of_net(net: IpNet) -> Self {
        match net {
            IpNet::V4(_) => Family::Ipv4,
            IpNet::V6(_) => Family::Ipv6,
        }
    }

    /// Address length in bits.
    pub fn bits(self) -> u32 {
        match self {
            Family::Ipv4 => 32,
            Family::Ipv6 => 128,
        }
    }

    /// The prefix that covers every address of this family.
    pub fn everything(self) -> IpNet {
        match self {
            Family::Ipv4 => IpNet::V4(Ipv4Net::default()),
            Family::Ipv6 => IpNet::V6(Ipv6Net::default()),
        }
    }

    /// The host prefix (`/32` or `/128`) of `ip`.
    pub fn host(ip: IpAddr) -> IpNet {
        IpNet::from(ip)
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Ipv4 => "ipv4",
            Family::Ipv6 => "ipv6",
        })
    }
}

/// Why an address, prefix or range string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// Not an IP address.
    #[error("{0:?} is not an IP address")]
    BadIp(String),
    /// Not a prefix in `address/length` form, or the length is out of range.
    #[error("{0:?} is not a CIDR (address/length)")]
    BadCidr(String),
    /// A CIDR with host bits set, such as `10.0.0.1/24`.
    #[error("{given:?} has host bits set; did you mean {network}?")]
    HostBitsSet {
        /// The string as written.
        given: String,
        /// The prefix with the host bits cleared.
        network: IpNet,
    },
    /// Not a single IP, an `a-b` range or a CIDR.
    #[error("{0:?} is not an IP, a range (a-b) or a CIDR")]
    BadRange(String),
    /// A range whose end lies before its start.
    #[error("range {0:?} is reversed: its end is lower than its start")]
    Reversed(String),
    /// A range whose ends are of different families.
    #[error("range {0:?} mixes IPv4 and IPv6")]
    MixedFamilies(String),
    /// An address or prefix of the wrong family for the field.
    #[error("{value:?} is not {expected}")]
    WrongFamily {
        /// The string as written.
        value: String,
        /// The family the field takes.
        expected: Family,
    },
}

/// Parses an IP address.
pub fn parse_ip(s: &str) -> Result<IpAddr, AddrError> {
    IpAddr::from_str(s.trim()).map_err(|_| AddrError::BadIp(s.to_owned()))
}

/// Parses a CIDR strictly: host bits must be zero (`10.0.0.0/24`, not `10.0.0.1/24`).
pub fn parse_cidr(s: &str) -> Result<IpNet, AddrError> {
    let net = IpNet::from_str(s.trim()).map_err(|_| AddrError::BadCidr(s.to_owned()))?;
    if net.trunc() != net {
        return Err(AddrError::HostBitsSet {
            given: s.to_owned(),
            network: net.trunc(),
        });
    }
    Ok(net)
}

/// An inclusive range of addresses of one family, as written in a pool:
/// `10.0.0.1`, `10.0.0.1-10.0.0.9` or `10.0.0.0/28`.
///
/// A CIDR stands for every address in it, network and broadcast included: a
/// pool holds addresses to SNAT to, not a subnet to put hosts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IpRange {
    first: IpAddr,
    last: IpAddr,
}

impl IpRange {
    /// The range `first..=last`; `None` when the families differ or `last < first`.
    pub fn new(first: IpAddr, last: IpAddr) -> Option<Self> {
        (Family::of(first) == Family::of(last) && first <= last).then_some(Self { first, last })
    }

    /// Every address of `net`.
    pub fn of_net(net: IpNet) -> Self {
        Self {
            first: net.network(),
            last: net.broadcast(),
        }
    }

    /// The prefix covering exactly this range, if there is one.
    pub fn as_prefix(&self) -> Option<IpNet> {
        let (first, last) = (to_u128(self.first), to_u128(self.last));
        let bits = Family::of(self.first).bits();
        let host_bits = match (last - first).checked_add(1) {
            None => 128,
            Some(n) if n.is_power_of_two() && first % n == 0 => n.trailing_zeros(),
            Some(_) => return None,
        };
        IpNet::new(self.first, u8::try_from(bits - host_bits).ok()?).ok()
    }

    /// The single address `ip`.
    pub fn single(ip: IpAddr) -> Self {
        Self {
            first: ip,
            last: ip,
        }
    }

    /// The lowest address.
    pub fn first(&self) -> IpAddr {
        self.first
    }

    /// The highest address.
    pub fn last(&self) -> IpAddr {
        self.last
    }

    /// The family of the range.
    pub fn family(&self) -> Family {
        Family::of(self.first)
    }

    /// Whether `ip` lies in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.first <= ip && ip <= self.last
    }

    /// The number of addresses in the range (at most 2^128, saturating).
    pub fn len(&self) -> u128 {
        (to_u128(self.last) - to_u128(self.first)).saturating_add(1)
    }

    /// Always false: a range holds at least one address.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the two ranges share an address.
    pub fn overlaps(&self, other: &IpRange) -> bool {
        self.first <= other.last && other.first <= self.last
    }

    /// The `n`th address of the range, counting from 0.
    pub fn nth(&self, n: u128) -> Option<IpAddr> {
        (n < self.len()).then(|| from_u128(self.family(), to_u128(self.first) + n))
    }

    /// Every address of the range, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let (first, last) = (to_u128(self.first), to_u128(self.last));
        let family = self.family();
        (first..=last).map(move |n| from_u128(family, n))
    }
}

impl FromStr for IpRange {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        let t = s.trim();
        if let Some((a, b)) = t.split_once('-') {
            let bad = || AddrError::BadRange(s.to_owned());
            let first = IpAddr::from_str(a.trim()).map_err(|_| bad())?;
            let last = IpAddr::from_str(b.trim()).map_err(|_| bad())?;
            if Family::of(first) != Family::of(last) {
                return Err(AddrError::MixedFamilies(s.to_owned()));
            }
            return IpRange::new(first, last).ok_or_else(|| AddrError::Reversed(s.to_owned()));
        }
        if t.contains('/') {
            let net = parse_cidr(t).map_err(|e| match e {
                AddrError::BadCidr(_) => AddrError::BadRange(s.to_owned()),
                other => other,
            })?;
            return Ok(IpRange {
                first: net.network(),
                last: net.broadcast(),
            });
        }
        IpAddr::from_str(t)
            .map(IpRange::single)
            .map_err(|_| AddrError::BadRange(s.to_owned()))
    }
}

/// `10.0.0.1` for one address, `10.0.0.0/24` when the range is exactly one
/// prefix, `10.0.0.1-10.0.0.9` otherwise: forms that parse back, and that
/// nftables accepts.
impl fmt::Display for IpRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else if let Some(net) = self.as_prefix() {
            write!(f, "{net}")
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// An ordered list of ranges of one family: an EIP pool.
///
/// Order is the order written; allocation walks it front to back, so the
/// first free address of the first range is handed out first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpPool {
    ranges: Vec<IpRange>,
}

impl IpPool {
    /// A pool over `ranges`, in the order given.
    pub fn new(ranges: Vec<IpRange>) -> Self {
        Self { ranges }
    }

    /// The ranges, in pool order.
    pub fn ranges(&self) -> &[IpRange] {
        &self.ranges
    }

    /// Whether `ip` is in the pool.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// The number of distinct addresses in the pool (overlapping ranges count once).
    pub fn len(&self) -> u128 {
        let mut sorted = self.ranges.clone();
        sorted.sort();
        let mut total: u128 = 0;
        let mut covered_to: Option<u128> = None;
        for r in sorted {
            let (a, b) = (to_u128(r.first), to_u128(r.last));
            let start = match covered_to {
                Some(c) if c >= b => continue,
                Some(c) if c >= a => c + 1,
                _ => a,
            };
            total = total.saturating_add(b - start).saturating_add(1);
            covered_to = Some(b);
        }
        total
    }

    /// Whether the pool holds no address.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Every address of the pool in pool order; an address that two ranges
    /// share comes up twice.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.ranges.iter().flat_map(IpRange::iter)
    }

    /// The first address of the pool.
    pub fn first(&self) -> Option<IpAddr> {
        self.ranges.first().map(IpRange::first)
    }
}

/// Whether `outer` contains every address of `inner`.
pub fn net_contains(outer: &IpNet, inner: &IpNet) -> bool {
    outer.prefix_len() <= inner.prefix_len() && outer.contains(&inner.network())
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn from_u128(family: Family, n: u128) -> IpAddr {
    match family {
        Family::Ipv4 => IpAddr::V4(Ipv4Addr::from(
            u32::try_from(n).expect("an IPv4 range stays within u32"),
        )),
        Family::Ipv6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_single_ip_is_a_range_of_one() {
        let r: IpRange = "10.0.0.7".parse().unwrap();
        assert_eq!(
            (r.first(), r.last(), r.len()),
            (ip("10.0.0.7"), ip("10.0.0.7"), 1)
        );
    }

    #[test]
    fn a_dash_range_includes_both_ends() {
        let r: IpRange = "10.0.0.1 - 10.0.0.3".parse().unwrap();
        assert_eq!(
            r.iter().collect::<Vec<_>>(),
            vec![ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3")]
        );
    }

    #[test]
    fn a_cidr_range_covers_the_whole_prefix() {
        let r: IpRange = "10.0.0.0/30".parse().unwrap();
        assert_eq!(
            (r.first(), r.last(), r.len()),
            (ip("10.0.0.0"), ip("10.0.0.3"), 4)
        );
    }

    #[test]
    fn a_reversed_range_is_rejected() {
        assert_eq!(
            "10.0.0.9-10.0.0.1".parse::<IpRange>(),
            Err(AddrError::Reversed("10.0.0.9-10.0.0.1".into()))
        );
    }

    #[test]
    fn a_range_mixing_families_is_rejected() {
        assert!(matches!(
            "10.0.0.1-fd00::1".parse::<IpRange>(),
            Err(AddrError::MixedFamilies(_))
        ));
    }

    #[test]
    fn garbage_is_not_a_range() {
        for s in [
            "",
            "10.0.0",
            "10.0.0.1-",
            "abc",
            "10.0.0.0/33",
            "10.0.0.1-10.0.0.x",
        ] {
            assert!(s.parse::<IpRange>().is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn a_cidr_with_host_bits_names_the_network_it_meant() {
        let err = parse_cidr("10.1.2.3/16").unwrap_err();
        assert_eq!(
            err.to_string(),
            "\"10.1.2.3/16\" has host bits set; did you mean 10.1.0.0/16?"
        );
    }

    #[test]
    fn pool_length_counts_overlapping_ranges_once() {
        let pool = IpPool::new(vec![
            "10.0.0.0/30".parse().unwrap(),
            "10.0.0.2-10.0.0.5".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        ]);
        assert_eq!(pool.len(), 6);
    }

    #[test]
    fn ipv6_ranges_count_and_index() {
        let r: IpRange = "fd00::/126".parse().unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r.nth(3), Some(ip("fd00::3")));
        assert_eq!(r.nth(4), None);
    }

    #[test]
    fn net_contains_is_prefix_inclusion() {
        let a: IpNet = "10.0.0.0/8".parse().unwrap();
        let b: IpNet = "10.1.0.0/16".parse().unwrap();
        assert!(net_contains(&a, &b));
        assert!(!net_contains(&b, &a));
        assert!(net_contains(&a, &a));
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn parsing_any_string_never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<IpRange>();
            let _ = parse_cidr(&s);
            let _ = parse_ip(&s);
        }

        #[test]
        fn a_range_reads_back_from_its_display(a in any::<u32>(), b in any::<u32>()) {
            let (lo, hi) = (a.min(b), a.max(b));
            let r = IpRange::new(IpAddr::from(Ipv4Addr::from(lo)), IpAddr::from(Ipv4Addr::from(hi))).unwrap();
            prop_assert_eq!(r.to_string().parse::<IpRange>(), Ok(r));
            prop_assert_eq!(r.len(), u128::from(hi - lo) + 1);
        }
    }
}
