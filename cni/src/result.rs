//! The ADD result: built by rivet-cni, rendered in the netconf's version, and
//! parsed from a `prevResult` or a delegated IPAM plugin's output (0.3.0 to
//! 1.1.0; both shapes of `ips`).

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};

use crate::error::CniError;
use crate::version::CniVersion;

/// An interface of a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Interface name.
    pub name: String,
    /// MAC address, `aa:bb:cc:dd:ee:ff`.
    pub mac: Option<String>,
    /// Network namespace path for interfaces inside the container.
    pub sandbox: Option<String>,
    /// MTU (rendered from 1.1.0 on).
    pub mtu: Option<u32>,
}

/// An address of a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpConfig {
    /// Address with prefix length.
    pub address: IpNet,
    /// The gateway for this address.
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    pub interface: Option<usize>,
}

/// A route of a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Destination.
    pub dst: IpNet,
    /// Next hop; absent means the plugin's default gateway.
    pub gw: Option<IpAddr>,
}

/// A CNI result (everything but `cniVersion`, which rendering adds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CniResult {
    /// `interfaces`.
    pub interfaces: Vec<Interface>,
    /// `ips`.
    pub ips: Vec<IpConfig>,
    /// `routes`.
    pub routes: Vec<Route>,
    /// `dns`, as given.
    pub dns: Option<Value>,
}

impl CniResult {
    /// Renders the result as JSON in `version`: before 1.0.0 every `ips`
    /// entry carries `version` ("4"/"6"); from 1.1.0 interfaces carry `mtu`.
    pub fn render(&self, version: CniVersion) -> Value {
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut o = Map::new();
                o.insert("name".into(), json!(i.name));
                if let Some(mac) = &i.mac {
                    o.insert("mac".into(), json!(mac));
                }
                if let Some(mtu) = i.mtu.filter(|_| version.interfaces_have_mtu()) {
                    o.insert("mtu".into(), json!(mtu));
                }
                if let Some(sandbox) = &i.sandbox {
                    o.insert("sandbox".into(), json!(sandbox));
                }
                Value::Object(o)
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|ip| {
                let mut o = Map::new();
                if version.ips_have_version() {
                    o.insert(
                        "version".into(),
                        json!(if ip.address.addr().is_ipv4() { "4" } else { "6" }),
                    );
                }
                o.insert("address".into(), json!(ip.address.to_string()));
                if let Some(gw) = ip.gateway {
                    o.insert("gateway".into(), json!(gw.to_string()));
                }
                if let Some(index) = ip.interface {
                    o.insert("interface".into(), json!(index));
                }
                Value::Object(o)
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|r| {
                let mut o = Map::new();
                o.insert("dst".into(), json!(r.dst.to_string()));
                if let Some(gw) = r.gw {
                    o.insert("gw".into(), json!(gw.to_string()));
                }
                Value::Object(o)
            })
            .collect();
        let mut out = Map::new();
        out.insert("cniVersion".into(), json!(version.as_str()));
        out.insert("interfaces".into(), Value::Array(interfaces));
        out.insert("ips".into(), Value::Array(ips));
        out.insert("routes".into(), Value::Array(routes));
        out.insert("dns".into(), self.dns.clone().unwrap_or_else(|| json!({})));
        Value::Object(out)
    }

    /// Parses a result of any supported version (`prevResult`, or the output
    /// of a delegated IPAM plugin). `what` names it in errors.
    pub fn parse(value: &Value, what: &str) -> Result<Self, CniError> {
        let bad = |msg: String| CniError::decode(format!("{what}: {msg}"));
        let obj = value
            .as_object()
            .ok_or_else(|| bad(format!("expected an object, found {value}")))?;
        if obj.contains_key("ip4") || obj.contains_key("ip6") {
            return Err(bad("a CNI 0.2.0 result (ip4/ip6) is not supported".into()));
        }
        let list = |key: &str| -> Result<Vec<Value>, CniError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(items)) => Ok(items.clone()),
                Some(other) => Err(bad(format!("{key}: expected a list, found {other}"))),
            }
        };
        let text = |item: &Value, field: &str, key: &str| -> Result<Option<String>, CniError> {
            match item.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s.is_empty() => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(format!("{field}.{key}: expected a string, found {other}"))),
            }
        };
        let mut result = CniResult::default();
        for (i, item) in list("interfaces")?.iter().enumerate() {
            let field = format!("interfaces[{i}]");
            let name = text(item, &field, "name")?.ok_or_else(|| bad(format!("{field}.name: required")))?;
            let mtu = match item.get("mtu") {
                None | Some(Value::Null) => None,
                Some(v) => Some(
                    v.as_u64()
                        .and_then(|m| u32::try_from(m).ok())
                        .ok_or_else(|| bad(format!("{field}.mtu: expected a number, found {v}")))?,
                ),
            };
            result.interfaces.push(Interface {
                name,
                mac: text(item, &field, "mac")?,
                sandbox: text(item, &field, "sandbox")?,
                mtu,
            });
        }
        for (i, item) in list("ips")?.iter().enumerate() {
            let field = format!("ips[{i}]");
            let address = text(item, &field, "address")?.ok_or_else(|| bad(format!("{field}.address: required")))?;
            let address: IpNet = address.parse().map_err(|_| {
                bad(format!(
                    "{field}.address={address:?}: expected an address with prefix length"
                ))
            })?;
            if let Some(v) = text(item, &field, "version")? {
                let expected = if address.addr().is_ipv4() { "4" } else { "6" };
                if v != expected {
                    return Err(bad(format!("{field}.version={v:?} does not match {address}")));
                }
            }
            let gateway = match text(item, &field, "gateway")? {
                None => None,
                Some(g) => Some(
                    g.parse::<IpAddr>()
                        .map_err(|_| bad(format!("{field}.gateway={g:?}: not an IP address")))?,
                ),
            };
            let interface = match item.get("interface") {
                None | Some(Value::Null) => None,
                Some(v) => {
                    let index = v
                        .as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| bad(format!("{field}.interface: expected an index, found {v}")))?;
                    if index >= result.interfaces.len() {
                        return Err(bad(format!(
                            "{field}.interface={index}: there are only {} interfaces",
                            result.interfaces.len()
                        )));
                    }
                    Some(index)
                }
            };
            result.ips.push(IpConfig {
                address,
                gateway,
                interface,
            });
        }
        for (i, item) in list("routes")?.iter().enumerate() {
            let field = format!("routes[{i}]");
            let dst = text(item, &field, "dst")?.ok_or_else(|| bad(format!("{field}.dst: required")))?;
            let dst: IpNet = dst
                .parse()
                .map_err(|_| bad(format!("{field}.dst={dst:?}: expected a CIDR")))?;
            let gw = match text(item, &field, "gw")? {
                None => None,
                Some(g) => Some(
                    g.parse::<IpAddr>()
                        .map_err(|_| bad(format!("{field}.gw={g:?}: not an IP address")))?,
                ),
            };
            result.routes.push(Route { dst, gw });
        }
        result.dns = obj.get("dns").filter(|d| d.is_object()).cloned();
        Ok(result)
    }

    /// Index of the interface named `name` inside a sandbox.
    pub fn container_interface(&self, name: &str) -> Option<usize> {
        self.interfaces
            .iter()
            .position(|i| i.name == name && i.sandbox.is_some())
    }

    /// Addresses of the interface at `index` (entries without an index count
    /// when the result has exactly one sandbox interface).
    pub fn ips_of(&self, index: usize) -> Vec<&IpConfig> {
        let sandboxes = self.interfaces.iter().filter(|i| i.sandbox.is_some()).count();
        self.ips
            .iter()
            .filter(|ip| match ip.interface {
                Some(i) => i == index,
                None => sandboxes == 1,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "lxc0123456789ab".into(),
                    mac: Some("02:00:00:00:00:01".into()),
                    sandbox: None,
                    mtu: Some(1500),
                },
                Interface {
                    name: "eth0".into(),
                    mac: Some("02:00:00:00:00:02".into()),
                    sandbox: Some("/run/netns/p".into()),
                    mtu: Some(1500),
                },
            ],
            ips: vec![
                IpConfig {
                    address: "198.18.0.2/22".parse().unwrap(),
                    gateway: Some("198.18.0.1".parse().unwrap()),
                    interface: Some(1),
                },
                IpConfig {
                    address: "2001:2::2/64".parse().unwrap(),
                    gateway: Some("2001:2::1".parse().unwrap()),
                    interface: Some(1),
                },
            ],
            routes: vec![
                Route {
                    dst: "0.0.0.0/0".parse().unwrap(),
                    gw: Some("198.18.0.1".parse().unwrap()),
                },
                Route {
                    dst: "::/0".parse().unwrap(),
                    gw: Some("2001:2::1".parse().unwrap()),
                },
            ],
            dns: None,
        }
    }

    #[test]
    fn render_per_version() {
        let r = sample();
        for version in CniVersion::ALL {
            let v = r.render(version);
            assert_eq!(v["cniVersion"], version.as_str());
            assert_eq!(v["interfaces"][1]["sandbox"], "/run/netns/p");
            assert_eq!(v["interfaces"][0]["mac"], "02:00:00:00:00:01");
            assert!(v["interfaces"][0].get("sandbox").is_none());
            assert_eq!(v["ips"][0]["address"], "198.18.0.2/22");
            assert_eq!(v["ips"][0]["gateway"], "198.18.0.1");
            assert_eq!(v["ips"][1]["interface"], 1);
            assert_eq!(v["routes"][1]["dst"], "::/0");
            assert_eq!(v["routes"][1]["gw"], "2001:2::1");
            assert_eq!(v["dns"], json!({}));
            if version < CniVersion::V1_0_0 {
                assert_eq!(v["ips"][0]["version"], "4", "{version}");
                assert_eq!(v["ips"][1]["version"], "6", "{version}");
            } else {
                assert!(v["ips"][0].get("version").is_none(), "{version}");
            }
            if version >= CniVersion::V1_1_0 {
                assert_eq!(v["interfaces"][1]["mtu"], 1500);
            } else {
                assert!(v["interfaces"][1].get("mtu").is_none(), "{version}");
            }
            // Every rendering parses back to the same result (less what the version drops).
            let mut back = CniResult::parse(&v, "result").unwrap();
            if !version.interfaces_have_mtu() {
                for i in &mut back.interfaces {
                    i.mtu = Some(1500);
                }
            }
            back.dns = None;
            assert_eq!(back, r, "{version}");
        }
    }

    #[test]
    fn parse_reference_plugin_output() {
        // What ptp + host-local print for 0.4.0.
        let v = json!({
            "cniVersion": "0.4.0",
            "interfaces": [
                {"name": "veth1a2b3c4d", "mac": "aa:bb:cc:dd:ee:01"},
                {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "sandbox": "/var/run/netns/p"}
            ],
            "ips": [{"version": "4", "interface": 1, "address": "198.18.8.2/24", "gateway": "198.18.8.1"}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["198.18.8.1"]}
        });
        let r = CniResult::parse(&v, "prevResult").unwrap();
        assert_eq!(r.container_interface("eth0"), Some(1));
        assert_eq!(r.container_interface("veth1a2b3c4d"), None);
        assert_eq!(r.ips_of(1).len(), 1);
        assert_eq!(r.routes[0].gw, None);
        assert_eq!(r.dns, Some(json!({"nameservers": ["198.18.8.1"]})));
        // host-local alone: no interfaces, no index.
        let ipam = json!({"cniVersion": "1.0.0", "ips": [{"address": "198.18.8.3/24", "gateway": "198.18.8.1"}]});
        let r = CniResult::parse(&ipam, "ipam").unwrap();
        assert_eq!(r.ips[0].interface, None);
    }

    #[test]
    fn parse_errors_are_decode_errors() {
        for bad in [
            json!([]),
            json!({"ip4": {"ip": "198.18.0.2/24"}}),
            json!({"interfaces": {}}),
            json!({"interfaces": [{"mac": "x"}]}),
            json!({"ips": [{"address": "198.18.0.2"}]}),
            json!({"ips": [{"version": "6", "address": "198.18.0.2/24"}]}),
            json!({"ips": [{"address": "198.18.0.2/24", "interface": 0}]}),
            json!({"ips": [{"address": "198.18.0.2/24", "gateway": "x"}]}),
            json!({"routes": [{"gw": "198.18.0.1"}]}),
        ] {
            let err = CniResult::parse(&bad, "prevResult").unwrap_err();
            assert_eq!(err.code, crate::error::codes::DECODE, "{bad}");
            assert!(err.msg.starts_with("prevResult: "), "{err}");
        }
    }
}
