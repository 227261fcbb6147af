//! What an inline volume asks for: the volume context's attributes, checked, and the
//! Kubernetes quantity parser for its `size`.

use std::collections::HashMap;

use crate::capability::{self, FS_TYPES};
use crate::error::{CsiError, CsiResult};

/// The volume context key kubelet sets (with `podInfoOnMount`) on every NodePublishVolume:
/// "true" for an inline ephemeral volume, "false" otherwise.
pub const CTX_EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";
/// Keys kubelet owns (pod name, namespace, UID, service account, the ephemeral flag):
/// accepted and not interpreted.
pub(super) const KUBELET_PREFIX: &str = "csi.storage.k8s.io/";
/// `volumeAttributes` an inline volume may set.
pub const ATTR_SIZE: &str = "size";
pub const ATTR_FS_TYPE: &str = "fsType";
const ATTRIBUTES: [&str; 2] = [ATTR_SIZE, ATTR_FS_TYPE];

/// Size when `size` is not given (images are sparse: only what is written takes space).
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest `size` accepted: the space comes from the kubelet's filesystem.
pub const MAX_SIZE: u64 = 64 << 30;
const MIB: u64 = 1 << 20;

/// Whether a NodePublishVolume is for an inline ephemeral volume.
pub fn is_ephemeral(ctx: &HashMap<String, String>) -> bool {
    ctx.get(CTX_EPHEMERAL).is_some_and(|v| v == "true")
}

/// What an inline volume asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// Bytes, a whole number of MiB.
    pub size: u64,
    pub fs_type: String,
}

/// Checks the volume context of an ephemeral publish: `size` and `fsType` are the only
/// attributes (besides kubelet's own `csi.storage.k8s.io/` keys); the capability's fs type
/// (a pod's `csi.fsType`) and the attribute must agree when both are set.
pub fn parse_params(
    ctx: &HashMap<String, String>,
    cap_fs: Option<&str>,
    default_fs: &str,
) -> CsiResult<Params> {
    let mut unknown: Vec<&str> = ctx
        .keys()
        .map(String::as_str)
        .filter(|k| !k.starts_with(KUBELET_PREFIX) && !ATTRIBUTES.contains(k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        return Err(CsiError::InvalidArgument(format!(
            "unknown volume attributes {unknown:?} for an ephemeral volume (supported: {ATTRIBUTES:?})"
        )));
    }
    let attr_fs = ctx
        .get(ATTR_FS_TYPE)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty());
    let fs_type = match (attr_fs, cap_fs.filter(|s| !s.is_empty())) {
        (Some(a), Some(c)) if a != c => {
            return Err(CsiError::InvalidArgument(format!(
                "volume attribute fsType={a:?} contradicts the volume capability's fs_type {c:?}"
            )))
        }
        (Some(a), _) => a,
        (None, Some(c)) => c,
        (None, None) => default_fs,
    }
    .to_string();
    if !FS_TYPES.contains(&fs_type.as_str()) {
        return Err(CsiError::InvalidArgument(format!(
            "fsType {fs_type:?} is not supported (supported: {FS_TYPES:?})"
        )));
    }
    let min = capability::min_size(&fs_type, false);
    let size = match ctx.get(ATTR_SIZE).map(|s| s.trim()) {
        None | Some("") => DEFAULT_SIZE.max(min),
        Some(raw) => {
            let bytes = parse_quantity(raw).map_err(|why| {
                CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is not a size: {why} (a quantity such as \"64Mi\", \"1Gi\", \"500M\" or plain bytes)"
                ))
            })?;
            let size = bytes.div_ceil(MIB).saturating_mul(MIB);
            if size > MAX_SIZE {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is more than the {} GiB an ephemeral volume may have",
                    MAX_SIZE >> 30
                )));
            }
            if size < min {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is less than the {} MiB {fs_type} needs",
                    min / MIB
                )));
            }
            size
        }
    };
    Ok(Params { size, fs_type })
}

/// A Kubernetes quantity as a number of bytes, rounded up: `123`, `1.5Gi`, `64Mi`,
/// `500M`, `1e9`. Binary suffixes Ki..Ei, decimal k..E, or an exponent. No sign, no milli.
pub fn parse_quantity(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err("no number".into());
    }
    if frac.len() > 18 {
        return Err("too many decimals".into());
    }
    let digits = |d: &str| -> Result<u128, String> {
        if d.is_empty() {
            return Ok(0);
        }
        d.parse::<u128>()
            .map_err(|_| "number too large".to_string())
    };
    let scale = 10u128.pow(frac.len() as u32);
    let mantissa = digits(int)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(digits(frac).ok()?))
        .ok_or("number too large")?;
    let pow = |base: u128, exp: u32| base.checked_pow(exp).ok_or("exponent too large");
    let mult: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => pow(10, 3)?,
        "M" => pow(10, 6)?,
        "G" => pow(10, 9)?,
        "T" => pow(10, 12)?,
        "P" => pow(10, 15)?,
        "E" => pow(10, 18)?,
        e if e.len() > 1 && (e.starts_with('e') || e.starts_with('E')) => {
            let exp: u32 = e[1..].parse().map_err(|_| format!("bad exponent {e:?}"))?;
            if exp > 30 {
                return Err("exponent too large".into());
            }
            pow(10, exp)?
        }
        other => return Err(format!("unknown suffix {other:?}")),
    };
    let bytes = mantissa
        .checked_mul(mult)
        .ok_or("number too large")?
        .div_ceil(scale);
    if bytes == 0 {
        return Err("a size must be more than zero".into());
    }
    u64::try_from(bytes).map_err(|_| "number too large".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn quantities() {
        for (s, want) in [
            ("1", 1),
            ("64Mi", 64 << 20),
            ("1Gi", 1 << 30),
            ("1.5Gi", 3 << 29),
            ("500M", 500_000_000),
            ("2k", 2000),
            ("1e9", 1_000_000_000),
            ("1E3", 1000),
            ("0.5Ki", 512),
            (" 3Ti ", 3 << 40),
            ("1.", 1),
            (".5Mi", 1 << 19),
            ("0.0001", 1),
        ] {
            assert_eq!(parse_quantity(s), Ok(want), "{s}");
        }
        for bad in [
            "",
            "Mi",
            "-1Gi",
            "+1",
            "0",
            "0Mi",
            "1.2.3",
            "1mi",
            "100m",
            "1GB",
            "abc",
            "1e",
            "1e99",
            "99999999999999999999Ei",
            "1 Gi",
            "16Ei",
        ] {
            assert!(parse_quantity(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn params_are_checked() {
        let p = parse_params(&ctx(&[(CTX_EPHEMERAL, "true")]), None, "ext4").unwrap();
        assert_eq!(
            p,
            Params {
                size: DEFAULT_SIZE,
                fs_type: "ext4".into()
            }
        );
        let p = parse_params(
            &ctx(&[
                (CTX_EPHEMERAL, "true"),
                ("csi.storage.k8s.io/pod.name", "p"),
                (ATTR_SIZE, "100M"),
                (ATTR_FS_TYPE, "ext4"),
            ]),
            Some("ext4"),
            "xfs",
        )
        .unwrap();
        assert_eq!(p.size, 96 * MIB, "rounded up to whole MiB");
        assert_eq!(p.fs_type, "ext4");
        assert_eq!(
            parse_params(&ctx(&[]), Some("xfs"), "ext4").unwrap(),
            Params {
                size: DEFAULT_SIZE,
                fs_type: "xfs".into()
            }
        );
        for (bad, cap_fs) in [
            (ctx(&[("sizee", "1Gi")]), None),
            (ctx(&[(ATTR_SIZE, "big")]), None),
            (ctx(&[(ATTR_SIZE, "65Gi")]), None),
            (ctx(&[(ATTR_SIZE, "8Mi")]), None),
            (ctx(&[(ATTR_SIZE, "64Mi"), (ATTR_FS_TYPE, "xfs")]), None),
            (ctx(&[(ATTR_SIZE, "64Mi")]), Some("xfs")),
            (ctx(&[(ATTR_FS_TYPE, "btrfs")]), None),
            (ctx(&[]), Some("btrfs")),
            (ctx(&[(ATTR_FS_TYPE, "xfs")]), Some("ext4")),
        ] {
            assert!(
                matches!(
                    parse_params(&bad, cap_fs, "ext4"),
                    Err(CsiError::InvalidArgument(_))
                ),
                "{bad:?} with {cap_fs:?} accepted"
            );
        }
    }
}
