//! CNI spec versions rivet-cni speaks, and the VERSION verb.

use std::fmt;

use serde_json::{Value, json};

use crate::error::{CniError, codes};

/// A spec version rivet-cni accepts in a netconf and renders results for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    /// 0.3.0
    V0_3_0,
    /// 0.3.1
    V0_3_1,
    /// 0.4.0 (adds CHECK)
    V0_4_0,
    /// 1.0.0 (drops `ips[].version`)
    V1_0_0,
    /// 1.1.0 (adds STATUS, GC, interface `mtu`)
    V1_1_0,
}

impl CniVersion {
    /// Every supported version, oldest first.
    pub const ALL: [CniVersion; 5] = [Self::V0_3_0, Self::V0_3_1, Self::V0_4_0, Self::V1_0_0, Self::V1_1_0];

    /// The newest supported version.
    pub const LATEST: CniVersion = Self::V1_1_0;

    /// Parses a version string; `None` when it is not one rivet-cni supports.
    ///
    /// ```
    /// use rivet_cni::version::CniVersion;
    /// assert_eq!(CniVersion::parse("0.4.0"), Some(CniVersion::V0_4_0));
    /// assert_eq!(CniVersion::parse("0.2.0"), None);
    /// ```
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == text)
    }

    /// The version as written in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V0_3_0 => "0.3.0",
            Self::V0_3_1 => "0.3.1",
            Self::V0_4_0 => "0.4.0",
            Self::V1_0_0 => "1.0.0",
            Self::V1_1_0 => "1.1.0",
        }
    }

    /// Whether results carry `ips[].version` (before 1.0.0).
    pub fn ips_have_version(self) -> bool {
        self < Self::V1_0_0
    }

    /// Whether CHECK exists (0.4.0 and later).
    pub fn has_check(self) -> bool {
        self >= Self::V0_4_0
    }

    /// Whether STATUS and GC exist (1.1.0 and later).
    pub fn has_status_and_gc(self) -> bool {
        self >= Self::V1_1_0
    }

    /// Whether interfaces in results may carry `mtu` (1.1.0 and later).
    pub fn interfaces_have_mtu(self) -> bool {
        self >= Self::V1_1_0
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The supported versions as a comma-separated list, for messages.
pub fn supported_list() -> String {
    CniVersion::ALL.map(CniVersion::as_str).join(", ")
}

/// The error for a netconf version rivet-cni does not support.
pub fn unsupported(version: &str) -> CniError {
    CniError::new(
        codes::INCOMPATIBLE_VERSION,
        format!(
            "incompatible CNI versions: config is {version:?}, rivet-cni supports {}",
            supported_list()
        ),
    )
}

/// The VERSION verb's output. `stdin` is `{"cniVersion": "..."}` (may be
/// empty); it only has to be valid JSON.
///
/// ```
/// let out = rivet_cni::version::version_output(br#"{"cniVersion":"0.4.0"}"#).unwrap();
/// assert_eq!(out["cniVersion"], "1.1.0");
/// assert_eq!(out["supportedVersions"].as_array().unwrap().len(), 5);
/// ```
pub fn version_output(stdin: &[u8]) -> Result<Value, CniError> {
    if !stdin.iter().all(u8::is_ascii_whitespace) {
        let value: Value = serde_json::from_slice(stdin)
            .map_err(|e| CniError::decode(format!("decoding the VERSION request on stdin: {e}")))?;
        if let Some(v) = value.get("cniVersion")
            && !v.is_string()
        {
            return Err(CniError::decode(format!("cniVersion: expected a string, found {v}")));
        }
    }
    Ok(json!({
        "cniVersion": CniVersion::LATEST.as_str(),
        "supportedVersions": CniVersion::ALL.map(CniVersion::as_str),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_and_features() {
        assert!(CniVersion::V0_3_1 < CniVersion::V0_4_0);
        assert!(CniVersion::V0_3_1.ips_have_version());
        assert!(CniVersion::V0_4_0.ips_have_version());
        assert!(!CniVersion::V1_0_0.ips_have_version());
        assert!(!CniVersion::V0_3_1.has_check());
        assert!(CniVersion::V0_4_0.has_check());
        assert!(!CniVersion::V1_0_0.has_status_and_gc());
        assert!(CniVersion::V1_1_0.has_status_and_gc());
        for v in CniVersion::ALL {
            assert_eq!(CniVersion::parse(v.as_str()), Some(v));
        }
        for bad in ["", "1.1", "0.2.0", "1.2.0", "v1.0.0"] {
            assert_eq!(CniVersion::parse(bad), None, "{bad}");
        }
        assert_eq!(unsupported("0.2.0").code, codes::INCOMPATIBLE_VERSION);
    }

    #[test]
    fn version_verb() {
        let out = version_output(b"").unwrap();
        assert_eq!(
            out["supportedVersions"],
            json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
        );
        assert_eq!(version_output(b"{not json").unwrap_err().code, codes::DECODE);
        assert_eq!(version_output(br#"{"cniVersion": 1}"#).unwrap_err().code, codes::DECODE);
        // An unsupported requested version is not an error: VERSION says what is supported.
        assert!(version_output(br#"{"cniVersion": "0.1.0"}"#).is_ok());
    }
}
