//! The config file shared by every subcommand, with the keys of the Helm
//! chart's `feature` values. Every key is optional; defaults match the
//! reference system (`egress.vxlan`, VNI 100, UDP 7789).

use egressgw_core::model::{Config, DatapathChoice, VxlanSettings};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Deserialize;

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    /// `egress.vxlan` settings.
    #[serde(default)]
    pub vxlan: VxlanFile,
    /// IPv4 egress on (default true).
    #[serde(rename = "enableIPv4")]
    pub enable_ipv4: Option<bool>,
    /// IPv6 egress on (default false).
    #[serde(rename = "enableIPv6")]
    pub enable_ipv6: Option<bool>,
    /// Tunnel IPv4 subnet (default 172.31.0.0/16). The chart spells it
    /// `tunnelIpv4Subnet`, as the reference system does.
    #[serde(rename = "tunnelIPv4Subnet", alias = "tunnelIpv4Subnet")]
    pub tunnel_ipv4_subnet: Option<Ipv4Net>,
    /// Tunnel IPv6 subnet (default fd11::/112).
    #[serde(rename = "tunnelIPv6Subnet", alias = "tunnelIpv6Subnet")]
    pub tunnel_ipv6_subnet: Option<Ipv6Net>,
    /// Service CIDRs (default 10.96.0.0/12).
    #[serde(rename = "serviceCIDRs")]
    pub service_cidrs: Option<Vec<IpNet>>,
    /// Further in-cluster prefixes.
    #[serde(rename = "extraClusterCIDRs")]
    pub extra_cluster_cidrs: Option<Vec<IpNet>>,
    /// Mark settings.
    #[serde(default)]
    pub mark: MarkFile,
    /// Policy-routing settings.
    #[serde(default)]
    pub route: RouteFile,
    /// What classifies pod traffic: `auto` (default), `ebpf` or
    /// `nftables`.
    pub datapath: Option<DatapathChoice>,
    /// eBPF datapath settings.
    #[serde(default)]
    pub ebpf: EbpfFile,
}

/// `ebpf.*`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EbpfFile {
    /// The fast path for TCP connections pods open, on their node and on
    /// the gateway node (default true).
    pub fast_path: Option<bool>,
}

/// `vxlan.*`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VxlanFile {
    /// Device name.
    pub name: Option<String>,
    /// VNI.
    pub id: Option<u32>,
    /// UDP port.
    pub port: Option<u16>,
    /// Turn tx checksum offload off.
    pub disable_checksum_offload: Option<bool>,
}

/// `mark.*`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MarkFile {
    /// The mark bits egressgw owns, e.g. `0xff000000`.
    pub mask: Option<HexU32>,
}

/// `route.*`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteFile {
    /// First routing table number.
    pub table_base: Option<u32>,
    /// Priority of the `ip rule`s.
    pub rule_priority: Option<u32>,
}

/// A u32 written as a number or as a `0x...` string.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "serde_yaml::Value")]
pub struct HexU32(pub u32);

impl TryFrom<serde_yaml::Value> for HexU32 {
    type Error = String;

    fn try_from(v: serde_yaml::Value) -> Result<Self, String> {
        let parsed = match &v {
            serde_yaml::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            serde_yaml::Value::String(s) => {
                let s = s.trim();
                match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                    Some(hex) => u32::from_str_radix(hex, 16).ok(),
                    None => s.parse().ok(),
                }
            }
            _ => None,
        };
        parsed
            .map(HexU32)
            .ok_or_else(|| format!("{v:?} is not a 32-bit number (e.g. 0xff000000)"))
    }
}

/// A config whose values do not go together (each problem named).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid config:\n  {}", .0.join("\n  "))]
pub struct InvalidConfig(pub Vec<String>);

impl FileConfig {
    /// Parses the file's text; a key the file format does not have is an
    /// error naming it.
    pub fn parse(text: &str) -> Result<Self, serde_yaml::Error> {
        serde_yaml::from_str(text)
    }

    /// The planner's config: defaults filled in, then validated.
    pub fn resolve(self) -> Result<Config, InvalidConfig> {
        let d = Config::default();
        let dv = VxlanSettings::default();
        let config = Config {
            datapath: self.datapath.unwrap_or(d.datapath),
            ebpf_fast_path: self.ebpf.fast_path.unwrap_or(d.ebpf_fast_path),
            vxlan: VxlanSettings {
                name: self.vxlan.name.unwrap_or(dv.name),
                id: self.vxlan.id.unwrap_or(dv.id),
                port: self.vxlan.port.unwrap_or(dv.port),
                disable_checksum_offload: self
                    .vxlan
                    .disable_checksum_offload
                    .unwrap_or(dv.disable_checksum_offload),
            },
            enable_ipv4: self.enable_ipv4.unwrap_or(d.enable_ipv4),
            enable_ipv6: self.enable_ipv6.unwrap_or(d.enable_ipv6),
            tunnel_ipv4_subnet: self.tunnel_ipv4_subnet.unwrap_or(d.tunnel_ipv4_subnet),
            tunnel_ipv6_subnet: self.tunnel_ipv6_subnet.unwrap_or(d.tunnel_ipv6_subnet),
            service_cidrs: self.service_cidrs.unwrap_or(d.service_cidrs),
            extra_cluster_cidrs: self.extra_cluster_cidrs.unwrap_or(d.extra_cluster_cidrs),
            mark_mask: self.mark.mask.map_or(d.mark_mask, |m| m.0),
            route_table_base: self.route.table_base.unwrap_or(d.route_table_base),
            rule_priority: self.route.rule_priority.unwrap_or(d.rule_priority),
        };
        config.validate().map_err(InvalidConfig)?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let c: FileConfig = serde_yaml::from_str("{}").unwrap();
        assert_eq!(c.resolve().unwrap(), Config::default());
    }

    #[test]
    fn helm_style_keys_are_read() {
        let c: FileConfig = serde_yaml::from_str(
            "vxlan: {name: eg0, id: 7, port: 4789, disableChecksumOffload: true}\n\
             enableIPv6: true\nserviceCIDRs: [10.43.0.0/16]\nmark: {mask: '0x0f000000'}\n",
        )
        .unwrap();
        let c = c.resolve().unwrap();
        assert_eq!(
            (c.vxlan.name.as_str(), c.vxlan.id, c.vxlan.port),
            ("eg0", 7, 4789)
        );
        assert!(c.vxlan.disable_checksum_offload && c.enable_ipv6);
        assert_eq!(c.mark_mask, 0x0f00_0000);
    }

    #[test]
    fn the_charts_feature_block_is_a_config_file() {
        let values = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/helm/egressgw/values.yaml"
        ))
        .unwrap();
        let values: serde_yaml::Value = serde_yaml::from_str(&values).unwrap();
        let feature = serde_yaml::to_string(&values["feature"]).unwrap();
        let c: FileConfig = serde_yaml::from_str(&feature).unwrap();
        assert_eq!(
            c.resolve().unwrap(),
            Config::default(),
            "the chart's defaults are the daemons' defaults"
        );
    }

    #[test]
    fn the_reference_spelling_of_the_tunnel_subnets_is_read() {
        let c: FileConfig =
            serde_yaml::from_str("tunnelIpv4Subnet: 10.9.0.0/16\ntunnelIpv6Subnet: fd12::/112\n")
                .unwrap();
        let c = c.resolve().unwrap();
        assert_eq!(c.tunnel_ipv4_subnet.to_string(), "10.9.0.0/16");
        assert_eq!(c.tunnel_ipv6_subnet.to_string(), "fd12::/112");
    }

    #[test]
    fn the_datapath_is_auto_unless_chosen_and_a_wrong_one_is_named() {
        let c: FileConfig = serde_yaml::from_str("{}").unwrap();
        assert_eq!(c.resolve().unwrap().datapath, DatapathChoice::Auto);
        let c: FileConfig = serde_yaml::from_str("datapath: nftables").unwrap();
        assert_eq!(c.resolve().unwrap().datapath, DatapathChoice::Nftables);
        let c: FileConfig = serde_yaml::from_str("{}").unwrap();
        assert!(
            c.resolve().unwrap().ebpf_fast_path,
            "the fast path is on by default"
        );
        let c: FileConfig = serde_yaml::from_str("ebpf:\n  fastPath: false").unwrap();
        assert!(!c.resolve().unwrap().ebpf_fast_path);
        assert!(serde_yaml::from_str::<FileConfig>("ebpf:\n  fastpath: false").is_err());
        let err = serde_yaml::from_str::<FileConfig>("datapath: xdp").unwrap_err();
        assert!(
            err.to_string().contains("xdp") && err.to_string().contains("ebpf"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_key_is_an_error_naming_it() {
        let err = serde_yaml::from_str::<FileConfig>("vxlan: {nmae: x}").unwrap_err();
        assert!(err.to_string().contains("nmae"), "{err}");
    }

    #[test]
    fn an_invalid_value_is_reported_by_key() {
        let c: FileConfig =
            serde_yaml::from_str("vxlan: {id: 0}\nmark: {mask: 0x0f0f0000}").unwrap();
        let err = c.resolve().unwrap_err().to_string();
        assert!(
            err.contains("vxlan.id") && err.contains("mark.mask"),
            "{err}"
        );
    }
}
