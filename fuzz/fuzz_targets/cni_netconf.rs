//! rivet-cni's inputs: the netconf on stdin, the `CNI_*` environment and a
//! `prevResult` / delegated IPAM result, through the functions main.rs calls.
//!
//! Input: `KEY=VALUE` lines of environment, a NUL byte, then stdin (no NUL:
//! all of it is stdin, with no environment).

#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use rivet_cni::env::{self, CniArgs};
use rivet_cni::netconf::{self, NetConf};
use rivet_cni::result::CniResult;
use rivet_cni::version::{self, CniVersion};
use rivet_common::labels::Label;

fuzz_target!(|data: &[u8]| {
    let (env_text, stdin) = match data.iter().position(|b| *b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (&[][..], data),
    };
    let vars: HashMap<String, String> = String::from_utf8_lossy(env_text)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();

    check_env(&vars);
    check_netconf(stdin);
    check_result(stdin);
});

fn check_env(vars: &HashMap<String, String>) {
    if let Ok(env) = env::parse(|k| vars.get(k).cloned()) {
        if env.command.is_attachment() {
            assert!(env::check_container_id(&env.container_id).is_ok());
            assert!(env::check_ifname(&env.ifname).is_ok());
            assert!(env.netns.as_ref().is_none_or(|p| p.is_absolute()));
        }
        assert!(env.path.iter().all(|p| !p.as_os_str().is_empty()));
    }
    if let Some(args) = vars.get("CNI_ARGS")
        && let Ok(parsed) = CniArgs::parse(args)
    {
        // Only keys that were there, each once.
        assert!(parsed.ignored.iter().all(|k| args.contains(k.as_str())));
        assert!(parsed.ignore_unknown || parsed.ignored.is_empty());
    }
}

fn check_netconf(stdin: &[u8]) {
    let _ = netconf::sniff_logging(stdin);
    if let Some(endpoint) = netconf::sniff_otlp_endpoint(stdin) {
        assert!(
            netconf::check_otlp_endpoint(&endpoint).is_ok(),
            "sniffed an invalid {endpoint:?}"
        );
    }
    let sniffed = netconf::sniff_version(stdin);
    let _ = version::version_output(stdin);
    match NetConf::parse(stdin) {
        Ok(conf) => {
            assert_eq!(
                sniffed,
                Some(conf.cni_version),
                "the error result's version is the netconf's"
            );
            assert!((68..=65535).contains(&conf.mtu));
            let timeout = conf.timeout.as_secs();
            assert!((1..=netconf::MAX_TIMEOUT_SECONDS).contains(&timeout));
            assert!(conf.socket_dir.is_absolute());
            assert!(conf.log_file.as_ref().is_none_or(|p| p.is_absolute()));
            assert!(!conf.host_interface_prefix.is_empty());
            assert!(conf.host_interface_prefix.len() <= netconf::HOST_PREFIX_MAX);
            assert!((1..=63).contains(&conf.ipam_pool.len()));
            // Labels reach svc-endpoint as `source:key=value`: each one must
            // parse there, and normalising it again changes nothing.
            for label in &conf.labels {
                let parsed: Label = label.parse().unwrap_or_else(|e| panic!("netconf label {label:?}: {e}"));
                assert_eq!(&parsed.to_string(), label);
                assert_eq!(netconf::normalize_label(label).as_deref(), Ok(label.as_str()));
            }
            let v4 = conf.requested_ips.iter().filter(|a| a.is_ipv4()).count();
            assert!(
                v4 <= 1 && conf.requested_ips.len() - v4 <= 1,
                "one requested address per family"
            );
            for port in &conf.named_ports {
                assert!(port.port != 0);
                assert!(["TCP", "UDP", "SCTP"].contains(&port.protocol.as_str()), "{port:?}");
            }
            if let Some(endpoint) = &conf.otlp_endpoint {
                assert!(netconf::check_otlp_endpoint(endpoint).is_ok());
            }
        }
        Err(e) => check_error(&e),
    }
}

/// A refusal carries a known code and a message, and renders as the spec's
/// error JSON.
fn check_error(e: &rivet_cni::error::CniError) {
    assert!(!e.msg.is_empty(), "an error without a message: {e:?}");
    assert!(
        (1..=11).contains(&e.code) || e.code == 50 || (100..=199).contains(&e.code),
        "unknown code {e:?}"
    );
    let (text, status) = rivet_cni::render_outcome(&Err(e.clone()), CniVersion::LATEST);
    assert_eq!(status, 1);
    let json: serde_json::Value = serde_json::from_str(&text.expect("an error prints")).expect("error JSON");
    assert_eq!(json["code"], e.code);
}

/// `prevResult` and delegated IPAM output: what parses renders back in
/// every version and parses to the same result (less the MTU before 1.1.0
/// and an absent `dns`, rendered as `{}`).
fn check_result(stdin: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(stdin) else {
        return;
    };
    let candidates = [Some(&value), value.get("prevResult")];
    for candidate in candidates.into_iter().flatten() {
        let Ok(result) = CniResult::parse(candidate, "prevResult") else {
            continue;
        };
        for version in CniVersion::ALL {
            let rendered = result.render(version);
            let back = CniResult::parse(&rendered, "rendered")
                .unwrap_or_else(|e| panic!("{version:?} rendering does not parse: {e:?}\n{rendered}"));
            let mut expected = result.clone();
            if !version.interfaces_have_mtu() {
                expected.interfaces.iter_mut().for_each(|i| i.mtu = None);
            }
            expected.dns = Some(expected.dns.unwrap_or_else(|| serde_json::json!({})));
            assert_eq!(back, expected, "{version:?} round trip\n{rendered}");
        }
    }
}
