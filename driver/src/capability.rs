//! Volume capabilities: what the driver supports and how a CSI
//! `VolumeCapability` maps onto it. Single-node writer modes and
//! multi-node read-only are supported; multi-node writers are refused, since
//! two writers on one ext4/xfs image corrupt it.

use fencecsi_proto::v1::volume_capability::{access_mode::Mode, AccessType};
use fencecsi_proto::v1::VolumeCapability;

use crate::error::CsiError;

pub const FS_TYPES: [&str; 2] = ["ext4", "xfs"];

/// Smallest sizes the filesystems accept (xfs refuses anything under 300 MiB).
pub fn min_size(fs_type: &str, block: bool) -> u64 {
    match (block, fs_type) {
        (true, _) => 1 << 20,
        (false, "xfs") => 300 << 20,
        (false, _) => 16 << 20,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub block: bool,
    /// Filesystem named by the capability (None: unspecified).
    pub fs_type: Option<String>,
    pub mount_flags: Vec<String>,
    pub mode: Mode,
}

impl Access {
    /// Whether the mode only ever reads.
    pub fn read_only_mode(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
        )
    }

    /// Whether the mode allows attachments on several nodes at once.
    pub fn multi_node(&self) -> bool {
        matches!(self.mode, Mode::MultiNodeReaderOnly)
    }
}

/// Parses and checks one capability: INVALID_ARGUMENT for a malformed or
/// unsupported one, with a message saying which.
pub fn parse(cap: &VolumeCapability) -> Result<Access, CsiError> {
    let mode_raw =
        cap.access_mode.as_ref().map(|m| m.mode).ok_or_else(|| {
            CsiError::InvalidArgument("volume capability has no access_mode".into())
        })?;
    let mode = Mode::try_from(mode_raw)
        .map_err(|_| CsiError::InvalidArgument(format!("unknown access mode {mode_raw}")))?;
    match mode {
        Mode::Unknown => return Err(CsiError::InvalidArgument("access mode UNKNOWN is not a mode".into())),
        Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter => {
            return Err(CsiError::InvalidArgument(format!(
                "access mode {} is not supported: an ext4/xfs image can have one writing node only (use SINGLE_NODE_* or MULTI_NODE_READER_ONLY)",
                mode.as_str_name()
            )))
        }
        _ => {}
    }
    match &cap.access_type {
        Some(AccessType::Block(_)) => Ok(Access {
            block: true,
            fs_type: None,
            mount_flags: Vec::new(),
            mode,
        }),
        Some(AccessType::Mount(m)) => {
            let fs = (!m.fs_type.is_empty()).then(|| m.fs_type.clone());
            if let Some(fs) = &fs {
                if !FS_TYPES.contains(&fs.as_str()) {
                    return Err(CsiError::InvalidArgument(format!(
                        "filesystem {fs:?} is not supported (supported: ext4, xfs)"
                    )));
                }
            }
            if m.mount_flags.iter().map(String::len).sum::<usize>() > 4096 {
                return Err(CsiError::InvalidArgument("mount_flags exceed 4 KiB".into()));
            }
            for flag in m.mount_flags.iter().flat_map(|f| f.split(',')) {
                check_mount_flag(flag)?;
            }
            if !m.volume_mount_group.is_empty() {
                return Err(CsiError::InvalidArgument(
                    "volume_mount_group is not supported".into(),
                ));
            }
            Ok(Access {
                block: false,
                fs_type: fs,
                mount_flags: m.mount_flags.clone(),
                mode,
            })
        }
        None => Err(CsiError::InvalidArgument(
            "volume capability has neither block nor mount access type".into(),
        )),
    }
}

/// Refuses mount options the kernel can never take here, before anything
/// is attached: options of the mount(8) program rather than the kernel
/// (`X-…`, `x-…`, `nofail`, `_netdev`, `auto`, `user`…), SELinux contexts on a
/// kernel without SELinux, and malformed ones.
fn check_mount_flag(flag: &str) -> Result<(), CsiError> {
    let f = flag.trim();
    let bad = |why: &str| {
        Err(CsiError::InvalidArgument(format!(
            "mount option {flag:?} is not supported: {why}"
        )))
    };
    if f.is_empty() || f.contains('\0') || f.chars().any(char::is_whitespace) {
        return bad("empty or contains whitespace or NUL");
    }
    if f.starts_with("X-") || f.starts_with("x-") {
        return bad("X-/x- options are read by the mount program, never by the kernel");
    }
    const USERSPACE: [&str; 8] = [
        "nofail", "_netdev", "auto", "noauto", "user", "nouser", "users", "owner",
    ];
    if USERSPACE.contains(&f) {
        return bad("an fstab option of the mount program, not a filesystem option");
    }
    let key = f.split('=').next().unwrap_or(f);
    if ["context", "fscontext", "defcontext", "rootcontext"].contains(&key)
        && !std::path::Path::new("/sys/fs/selinux/enforce").exists()
    {
        return bad("SELinux is not enabled on this kernel");
    }
    Ok(())
}

/// Parses a required list of capabilities.
pub fn parse_all(caps: &[VolumeCapability]) -> Result<Vec<Access>, CsiError> {
    if caps.is_empty() {
        return Err(CsiError::InvalidArgument(
            "volume_capabilities is required".into(),
        ));
    }
    caps.iter().map(parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_proto::v1::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, fs: Option<&str>) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(match fs {
                Some(f) => AccessType::Mount(MountVolume {
                    fs_type: f.into(),
                    ..Default::default()
                }),
                None => AccessType::Block(BlockVolume {}),
            }),
        }
    }

    #[test]
    fn writer_modes_and_reader_many_are_accepted_multi_writer_refused() {
        assert!(parse(&cap(Mode::SingleNodeWriter, Some("ext4"))).is_ok());
        assert!(parse(&cap(Mode::SingleNodeMultiWriter, Some(""))).is_ok());
        assert!(parse(&cap(Mode::MultiNodeReaderOnly, None))
            .unwrap()
            .multi_node());
        for bad in [
            Mode::MultiNodeMultiWriter,
            Mode::MultiNodeSingleWriter,
            Mode::Unknown,
        ] {
            assert!(matches!(
                parse(&cap(bad, Some("ext4"))),
                Err(CsiError::InvalidArgument(_))
            ));
        }
        assert!(matches!(
            parse(&cap(Mode::SingleNodeWriter, Some("ntfs"))),
            Err(CsiError::InvalidArgument(_))
        ));
        assert!(parse_all(&[]).is_err());
    }
}
