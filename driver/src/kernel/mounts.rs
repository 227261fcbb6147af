//! The mount table (/proc/self/mountinfo) and mount/unmount.
//!
//! Mounting uses `nix::mount` (thin wrappers over mount(2)/umount2(2)) rather
//! than sys-mount: we need the raw errno to tell EBUSY from EINVAL, exact
//! control over the two-step read-only bind, and none of sys-mount's
//! filesystem guessing or loop-device handling.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use procfs::FromBufRead;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The target is in use (open files, a cwd, a submount): nothing changed.
    #[error("{0} is busy")]
    Busy(PathBuf),
    #[error("{op} {path}: {source}")]
    Sys {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parse mountinfo: {0}")]
    Parse(String),
    #[error("{path}: still mounted after {tries} unmount attempts")]
    StillMounted { path: PathBuf, tries: u32 },
}

impl MountError {
    /// The kernel's answer, when there was one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Sys { source, .. } => Some(*source),
            MountError::Busy(_) => Some(Errno::EBUSY),
            _ => None,
        }
    }
}

/// One line of /proc/self/mountinfo, with octal escapes decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountEntry {
    pub mount_id: i32,
    pub parent_id: i32,
    /// st_dev of the filesystem. Block filesystems show their device here,
    /// btrfs shows an anonymous device instead.
    pub major: u32,
    pub minor: u32,
    /// Directory of the filesystem that is mounted (not "/" for bind mounts).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub fs_type: String,
    /// The mount source ("none" when the kernel has none).
    pub source: String,
    /// Per-mount read-only flag (the superblock may be ro on its own).
    pub read_only: bool,
}

const MOUNTINFO: &str = "/proc/self/mountinfo";

/// Decodes the kernel's `\ooo` escapes (space, tab, newline, backslash).
fn unmangle(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = (b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)))
        .then(|| {
            b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'))
        })
        .filter(|&v| v <= 0xff);
        if let Some(v) = code {
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn unmangle_path(s: &str) -> PathBuf {
    PathBuf::from(OsString::from_vec(unmangle(s)))
}

/// procfs reads lines as UTF-8 and would reject the whole table for one path
/// with other bytes. Re-escaping those bytes as `\ooo` keeps the text ASCII
/// for procfs and lets `unmangle` restore the exact bytes.
fn escape_non_utf8(raw: &[u8]) -> String {
    let mut out = String::with_capacity(raw.len());
    for chunk in raw.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\{b:03o}"));
        }
    }
    out
}

/// Parses mountinfo text (as the kernel writes it).
pub fn parse_mountinfo(raw: &[u8]) -> Result<Vec<MountEntry>, MountError> {
    let text = escape_non_utf8(raw);
    let infos = procfs::process::MountInfos::from_buf_read(text.as_bytes())
        .map_err(|e| MountError::Parse(e.to_string()))?;
    infos
        .into_iter()
        .map(|m| {
            let (major, minor) = m
                .majmin
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                .ok_or_else(|| MountError::Parse(format!("bad major:minor {:?}", m.majmin)))?;
            let mount_point = m
                .mount_point
                .to_str()
                .map(unmangle_path)
                .unwrap_or(m.mount_point);
            Ok(MountEntry {
                mount_id: m.mnt_id,
                parent_id: m.pid,
                major,
                minor,
                root: unmangle_path(&m.root),
                mount_point,
                fs_type: String::from_utf8_lossy(&unmangle(&m.fs_type)).into_owned(),
                source: m
                    .mount_source
                    .map(|s| String::from_utf8_lossy(&unmangle(&s)).into_owned())
                    .unwrap_or_else(|| "none".into()),
                read_only: m.mount_options.contains_key("ro"),
            })
        })
        .collect()
}

/// Every mount in this process's mount namespace, in mountinfo order (a
/// mount stacked on top of another comes after it).
pub fn mounts() -> Result<Vec<MountEntry>, MountError> {
    let mut raw = Vec::new();
    std::fs::File::open(MOUNTINFO)
        .and_then(|mut f| f.read_to_end(&mut raw))
        .map_err(|source| MountError::Read {
            path: MOUNTINFO.into(),
            source,
        })?;
    parse_mountinfo(&raw)
}

/// The path as mountinfo spells it: absolute, symlinks resolved. The last
/// component is not resolved when that fails (a stale or missing mountpoint).
fn normalize(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    // Lexical clean-up of "." and trailing slashes; ".." is left to the parent's canonicalize.
    let clean: PathBuf = abs
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    match (clean.parent(), clean.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or(clean),
        _ => clean,
    }
}

/// Entries mounted exactly at `path`, bottom first (stacked mounts give several).
pub fn mounts_at(path: &Path) -> Result<Vec<MountEntry>, MountError> {
    let want = normalize(path);
    Ok(mounts()?
        .into_iter()
        .filter(|m| m.mount_point == want)
        .collect())
}

pub fn is_mountpoint(path: &Path) -> Result<bool, MountError> {
    Ok(!mounts_at(path)?.is_empty())
}

/// Mounts that use block device major:minor. Also matches mounts whose source
/// is that device node, because btrfs reports an anonymous st_dev instead,
/// and bind mounts of the device node (raw block staging files and targets).
pub fn mounts_of_device(major: u32, minor: u32) -> Result<Vec<MountEntry>, MountError> {
    let rdev = libc::makedev(major, minor);
    Ok(mounts()?
        .into_iter()
        .filter(|m| {
            (m.major == major && m.minor == minor)
                || (m.source.starts_with("/dev/")
                    && std::fs::metadata(&m.source)
                        .map(|md| md.file_type().is_block_device() && md.rdev() == rdev)
                        .unwrap_or(false))
                // A bind mount of the device node itself (a raw block
                // volume's staging file or target): it shows the /dev
                // filesystem, not the device, so look at the node.
                || (matches!(m.fs_type.as_str(), "devtmpfs" | "tmpfs")
                    && m.root != Path::new("/")
                    && std::fs::metadata(&m.mount_point)
                        .map(|md| md.file_type().is_block_device() && md.rdev() == rdev)
                        .unwrap_or(false))
        })
        .collect())
}

/// Splits CSI mount flags into MS_* flags (applied in order on top of `base`)
/// and filesystem data. Entries may themselves be comma-separated lists.
pub fn parse_options(base: MsFlags, options: &[String]) -> (MsFlags, Vec<String>) {
    let mut flags = base;
    let mut data = Vec::new();
    for word in options
        .iter()
        .flat_map(|o| o.split(','))
        .map(str::trim)
        .filter(|w| !w.is_empty())
    {
        let (set, f) = match word {
            "ro" => (true, MsFlags::MS_RDONLY),
            "rw" => (false, MsFlags::MS_RDONLY),
            "noatime" => (true, MsFlags::MS_NOATIME),
            "atime" => (false, MsFlags::MS_NOATIME),
            "nodiratime" => (true, MsFlags::MS_NODIRATIME),
            "diratime" => (false, MsFlags::MS_NODIRATIME),
            "relatime" => (true, MsFlags::MS_RELATIME),
            "norelatime" => (false, MsFlags::MS_RELATIME),
            "strictatime" => (true, MsFlags::MS_STRICTATIME),
            "nostrictatime" => (false, MsFlags::MS_STRICTATIME),
            "lazytime" => (true, MsFlags::MS_LAZYTIME),
            "nolazytime" => (false, MsFlags::MS_LAZYTIME),
            "nosuid" => (true, MsFlags::MS_NOSUID),
            "suid" => (false, MsFlags::MS_NOSUID),
            "nodev" => (true, MsFlags::MS_NODEV),
            "dev" => (false, MsFlags::MS_NODEV),
            "noexec" => (true, MsFlags::MS_NOEXEC),
            "exec" => (false, MsFlags::MS_NOEXEC),
            "sync" => (true, MsFlags::MS_SYNCHRONOUS),
            "async" => (false, MsFlags::MS_SYNCHRONOUS),
            "dirsync" => (true, MsFlags::MS_DIRSYNC),
            "silent" => (true, MsFlags::MS_SILENT),
            "loud" => (false, MsFlags::MS_SILENT),
            "defaults" => continue,
            other => {
                data.push(other.to_string());
                continue;
            }
        };
        if set {
            flags |= f;
        } else {
            flags &= !f;
        }
    }
    (flags, data)
}

fn sys<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> MountError + 'a {
    move |source| MountError::Sys {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Mounts a block device. `read_only` wins over an "rw" in `options`.
pub fn mount_device(
    device: &Path,
    target: &Path,
    fs_type: &str,
    options: &[String],
    read_only: bool,
) -> Result<(), MountError> {
    let (mut flags, data) = parse_options(MsFlags::empty(), options);
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    let data = data.join(",");
    let data_arg = if data.is_empty() {
        None
    } else {
        Some(data.as_str())
    };
    nix::mount::mount(Some(device), target, Some(fs_type), flags, data_arg)
        .map_err(sys("mount", target))?;
    tracing::info!(device = %device.display(), target = %target.display(), fs_type, ?flags, data, "mounted");
    Ok(())
}

/// Per-mount flags the remount must keep: a bind remount replaces them all,
/// so nosuid/nodev/ro inherited from the source would otherwise be dropped.
fn current_mount_flags(target: &Path) -> Result<MsFlags, MountError> {
    use nix::sys::statvfs::FsFlags;
    let st = nix::sys::statvfs::statvfs(target).map_err(sys("statvfs", target))?;
    let f = st.flags();
    let mut out = MsFlags::empty();
    for (fs, ms) in [
        (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(fs) {
            out |= ms;
        }
    }
    Ok(out)
}

/// Bind-mounts `source` (a directory, or a file such as a device node) on
/// `target`. The kernel ignores flags on the MS_BIND call itself, so read-only
/// and flag words need a second MS_REMOUNT|MS_BIND call.
///
/// A read-only bind is made read-only before it appears at `target` where the
/// kernel has the new mount API (see [`bind_read_only_atomic`]): with the
/// two-step form, a plugin killed between the steps leaves a *writable* bind
/// that a retried read-only publish can only refuse (ALREADY_EXISTS).
pub fn bind_mount(
    source: &Path,
    target: &Path,
    read_only: bool,
    options: &[String],
) -> Result<(), MountError> {
    let mut made_read_only = false;
    if read_only {
        match bind_read_only_atomic(source, target) {
            Ok(()) => made_read_only = true,
            // Older kernel, or a seccomp profile without the new mount calls.
            Err(Errno::ENOSYS | Errno::EPERM) => {}
            Err(e) => return Err(sys("bind mount (read-only)", target)(e)),
        }
    }
    if !made_read_only {
        nix::mount::mount(
            Some(source),
            target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(sys("bind mount", target))?;
    }
    let (want, data) = parse_options(MsFlags::empty(), options);
    if !data.is_empty() {
        tracing::warn!(target = %target.display(), ?data, "filesystem options ignored on a bind mount");
    }
    if made_read_only && want.is_empty() {
        tracing::info!(source = %source.display(), target = %target.display(), read_only, "bind mounted");
        return Ok(());
    }
    if !read_only
        && want.is_empty()
        && !options
            .iter()
            .any(|o| o.split(',').any(|w| w.trim() == "rw"))
    {
        return Ok(());
    }
    let remount = (|| {
        let (mut flags, _) = parse_options(current_mount_flags(target)?, options);
        if read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        nix::mount::mount(
            None::<&str>,
            target,
            None::<&str>,
            flags | MsFlags::MS_REMOUNT | MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(sys("remount bind", target))
    })();
    if let Err(e) = remount {
        // Do not leave a writable bind behind when read-only was asked for.
        if let Err(u) = nix::mount::umount2(target, MntFlags::MNT_DETACH) {
            tracing::error!(target = %target.display(), error = %u, "could not undo bind mount after failed remount");
        }
        return Err(e);
    }
    tracing::info!(source = %source.display(), target = %target.display(), read_only, "bind mounted");
    Ok(())
}

/// A read-only bind mount in one step: `open_tree(OPEN_TREE_CLONE)` makes a
/// detached copy of the source mount, `mount_setattr` makes it read-only, and
/// only then `move_mount` attaches it at `target` (Linux >= 5.12). If the
/// process dies before the move, the detached copy vanishes with its fd.
fn bind_read_only_atomic(source: &Path, target: &Path) -> Result<(), Errno> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOUNT_ATTR_RDONLY: u64 = 1;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

    let src = CString::new(source.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    let dst = CString::new(target.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    let empty = c"";
    // SAFETY: valid NUL-terminated paths; the returned fd is owned below.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: open_tree returned a new fd that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as std::os::fd::RawFd) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `attr` outlives the call and its size is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    // SAFETY: valid fd and paths.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmount {
    NotMounted,
    Unmounted,
}

/// Plain unmount of the topmost mount at `target`. Busy -> `MountError::Busy`
/// with nothing changed; a path that is not a mountpoint (or does not exist)
/// -> `NotMounted`. Stacked mounts need one call each.
pub fn unmount(target: &Path) -> Result<Unmount, MountError> {
    match nix::mount::umount2(target, MntFlags::empty()) {
        Ok(()) => {
            tracing::info!(target = %target.display(), "unmounted");
            Ok(Unmount::Unmounted)
        }
        Err(Errno::EBUSY) => Err(MountError::Busy(target.to_path_buf())),
        Err(Errno::EINVAL | Errno::ENOENT) => Ok(Unmount::NotMounted),
        Err(e) => Err(sys("umount", target)(e)),
    }
}

/// Removes every mount stacked at `target`, whatever its state: busy,
/// aborted (EIO) or stale. Each layer gets MNT_FORCE first (lets network
/// filesystems abort requests), then MNT_DETACH (lazy: gone from the
/// namespace now, the filesystem is released when its last user goes, so a
/// loop device under it may stay held until then).
pub fn force_unmount(target: &Path) -> Result<Unmount, MountError> {
    // The kernel, not mountinfo, decides when we are done: EINVAL means "not
    // a mountpoint" whatever spelling of the path the table uses. umount2
    // does not revalidate the last component, so it works on stale mounts.
    const MAX_LAYERS: u32 = 64;
    let not_mounted = |e: Errno| matches!(e, Errno::EINVAL | Errno::ENOENT);
    for removed in 0..MAX_LAYERS {
        let done = match nix::mount::umount2(target, MntFlags::MNT_FORCE) {
            Ok(()) => false,
            Err(e) if not_mounted(e) => true,
            Err(force_err) => match nix::mount::umount2(target, MntFlags::MNT_DETACH) {
                Ok(()) => {
                    tracing::warn!(target = %target.display(), %force_err, "lazily unmounted");
                    false
                }
                Err(e) if not_mounted(e) => true,
                Err(e) => return Err(sys("umount (lazy)", target)(e)),
            },
        };
        if done {
            return Ok(if removed > 0 {
                Unmount::Unmounted
            } else {
                Unmount::NotMounted
            });
        }
    }
    Err(MountError::StillMounted {
        path: target.to_path_buf(),
        tries: MAX_LAYERS,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    Missing,
    Ok,
    /// stat() failed on an existing name: EIO, ENOTCONN and ESTALE are what
    /// aborted or stale mountpoints give; any other errno is reported here
    /// too, since the path is there but unusable.
    Stale(Errno),
}

/// stat() that turns broken mountpoints into a value instead of an error.
pub fn path_state(path: &Path) -> PathState {
    match nix::sys::stat::stat(path) {
        Ok(_) => PathState::Ok,
        Err(Errno::ENOENT | Errno::ENOTDIR) => PathState::Missing,
        Err(e) => PathState::Stale(e),
    }
}

/// Test helpers shared with the filesystem tests.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// [`unmount`], again while it answers Busy, within a bound. Other tests in this
    /// process spawn children: one forked while a file of this mount was open holds that
    /// descriptor until it execs, and the mount is busy until then.
    pub(crate) fn unmount_once_free(target: &Path) -> Result<Unmount, MountError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match unmount(target) {
                Err(MountError::Busy(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                other => return other,
            }
        }
    }

    /// Lazily unmounts everything at its path when dropped, panic or not.
    pub(crate) struct MountGuard(pub PathBuf);

    impl Drop for MountGuard {
        fn drop(&mut self) {
            for _ in 0..16 {
                match mounts_at(&self.0) {
                    Ok(v) if !v.is_empty() => {
                        if let Err(e) = nix::mount::umount2(&self.0, MntFlags::MNT_DETACH) {
                            eprintln!("cleanup: umount {}: {e}", self.0.display());
                            return;
                        }
                    }
                    _ => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{unmount_once_free, MountGuard};
    use super::*;
    use crate::kernel::loop_device::test_support::{
        require_root, sparse_image, test_tag, LoopGuard,
    };
    use crate::kernel::loop_device::AttachOptions;
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    const FIXTURE: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
95 27 7:3 / /var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv\\040one/mount ro,nosuid,nodev,noatime master:7 - ext4 /dev/loop3 rw
96 95 7:3 /sub\\011dir /mnt/tab\\134slash rw,relatime - ext4 /dev/loop3 rw
97 27 0:55 / /mnt/btr rw,relatime - btrfs /dev/loop4 rw,space_cache=v2
98 27 0:56 / /mnt/none rw - tmpfs none rw
";

    #[test]
    fn mounts_parse_fixture_with_escapes() {
        let v = parse_mountinfo(FIXTURE.as_bytes()).unwrap();
        assert_eq!(v.len(), 6);
        let pv = &v[2];
        assert_eq!(pv.mount_id, 95);
        assert_eq!(pv.parent_id, 27);
        assert_eq!((pv.major, pv.minor), (7, 3));
        assert_eq!(
            pv.mount_point,
            Path::new("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv one/mount")
        );
        assert_eq!(pv.fs_type, "ext4");
        assert_eq!(pv.source, "/dev/loop3");
        assert!(pv.read_only);
        assert_eq!(pv.root, Path::new("/"));
        let sub = &v[3];
        assert_eq!(sub.root, Path::new("/sub\tdir"));
        assert_eq!(sub.mount_point, Path::new("/mnt/tab\\slash"));
        assert!(!sub.read_only);
        assert_eq!(v[1].mount_point, Path::new("/"));
        assert_eq!(v[5].source, "none");
    }

    #[test]
    fn mounts_parse_non_utf8_path() {
        let mut raw = b"50 27 0:60 / /mnt/x".to_vec();
        raw.push(0xff);
        raw.extend_from_slice(b"y rw - tmpfs tmpfs rw\n");
        let v = parse_mountinfo(&raw).unwrap();
        assert_eq!(
            v[0].mount_point,
            PathBuf::from(OsString::from_vec(b"/mnt/x\xffy".to_vec()))
        );
    }

    #[test]
    fn mounts_unmangle_edge_cases() {
        assert_eq!(unmangle("a\\040b"), b"a b");
        assert_eq!(unmangle("trail\\"), b"trail\\");
        assert_eq!(unmangle("short\\04"), b"short\\04");
        assert_eq!(unmangle("\\134\\040"), b"\\ ");
        assert_eq!(unmangle("\\777"), b"\\777");
    }

    #[test]
    fn mounts_option_translation() {
        let opts: Vec<String> = [
            "ro",
            "noatime,discard",
            "errors=remount-ro",
            "nosuid",
            "nouuid",
            "defaults",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (flags, data) = parse_options(MsFlags::empty(), &opts);
        assert_eq!(
            flags,
            MsFlags::MS_RDONLY | MsFlags::MS_NOATIME | MsFlags::MS_NOSUID
        );
        assert_eq!(data, vec!["discard", "errors=remount-ro", "nouuid"]);
        let (flags, _) = parse_options(
            MsFlags::MS_RDONLY | MsFlags::MS_NODEV,
            &["rw".to_string(), "sync".to_string()],
        );
        assert_eq!(flags, MsFlags::MS_NODEV | MsFlags::MS_SYNCHRONOUS);
    }

    #[test]
    fn mounts_live_table_has_root() {
        let all = mounts().unwrap();
        assert!(all.iter().any(|m| m.mount_point == Path::new("/")));
        assert!(
            is_mountpoint(Path::new("/proc")).unwrap_or(false) || !Path::new("/proc/self").exists()
        );
    }

    #[test]
    fn mounts_path_state() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(path_state(dir.path()), PathState::Ok);
        assert_eq!(path_state(&dir.path().join("nope")), PathState::Missing);
        File::create(dir.path().join("f")).unwrap();
        assert_eq!(path_state(&dir.path().join("f/below")), PathState::Missing);
    }

    fn tmpfs(target: &Path) -> MountGuard {
        nix::mount::mount(
            Some("fencecsi-test"),
            target,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("size=4m"),
        )
        .unwrap();
        MountGuard(target.to_path_buf())
    }

    #[test]
    fn mounts_bind_read_only_refuses_writes() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let dst = dir.path().join("dst");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(src.join("data"), b"hello").unwrap();
        bind_mount(&src, &dst, true, &["nosuid".into(), "nodev".into()]).unwrap();
        let _g = MountGuard(dst.clone());
        let at = mounts_at(&dst).unwrap();
        assert_eq!(at.len(), 1);
        assert!(at[0].read_only);
        assert!(is_mountpoint(&dst).unwrap());
        assert_eq!(std::fs::read(dst.join("data")).unwrap(), b"hello");
        let err = File::create(dst.join("new")).expect_err("write on ro bind succeeded");
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        // The source stays writable: the flag is per mount.
        std::fs::write(src.join("data2"), b"x").unwrap();
        let st = nix::sys::statvfs::statvfs(&dst).unwrap();
        assert!(st.flags().contains(
            nix::sys::statvfs::FsFlags::ST_NOSUID | nix::sys::statvfs::FsFlags::ST_NODEV
        ));
        assert_eq!(unmount_once_free(&dst).unwrap(), Unmount::Unmounted);
        assert_eq!(unmount(&dst).unwrap(), Unmount::NotMounted);
        assert!(!is_mountpoint(&dst).unwrap());
    }

    #[test]
    fn mounts_bind_of_a_file() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.dat");
        let dst = dir.path().join("dst.dat");
        std::fs::write(&src, b"block").unwrap();
        File::create(&dst).unwrap();
        bind_mount(&src, &dst, false, &[]).unwrap();
        let _g = MountGuard(dst.clone());
        assert_eq!(std::fs::read(&dst).unwrap(), b"block");
        let at = mounts_at(&dst).unwrap();
        assert_eq!(at.len(), 1);
        assert!(!at[0].read_only);
    }

    #[test]
    fn mounts_busy_unmount_then_force() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("busy");
        std::fs::create_dir(&target).unwrap();
        let _g = tmpfs(&target);
        let mut open = File::create(target.join("held")).unwrap();
        open.write_all(b"x").unwrap();
        assert!(matches!(unmount(&target), Err(MountError::Busy(_))));
        assert!(
            is_mountpoint(&target).unwrap(),
            "busy unmount must leave it mounted"
        );
        assert_eq!(force_unmount(&target).unwrap(), Unmount::Unmounted);
        assert!(!is_mountpoint(&target).unwrap());
        // The open file still works: lazy unmount only hid the filesystem.
        open.write_all(b"y").unwrap();
        assert_eq!(force_unmount(&target).unwrap(), Unmount::NotMounted);
    }

    #[test]
    fn mounts_force_unmount_stacked() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("stack");
        std::fs::create_dir(&target).unwrap();
        let g1 = tmpfs(&target);
        let g2 = tmpfs(&target);
        let at = mounts_at(&target).unwrap();
        assert_eq!(at.len(), 2);
        assert_eq!(at[1].parent_id, at[0].mount_id);
        assert_eq!(force_unmount(&target).unwrap(), Unmount::Unmounted);
        assert!(mounts_at(&target).unwrap().is_empty());
        drop((g2, g1));
    }

    /// A FUSE mount whose "daemon" (our /dev/fuse fd) is gone: the kernel
    /// answers ENOTCONN on the mountpoint, like a crashed fuse daemon.
    #[test]
    fn mounts_stale_fuse_mountpoint() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("stale");
        std::fs::create_dir(&target).unwrap();
        let Ok(fuse) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
        else {
            eprintln!("SKIPPED: no /dev/fuse");
            return;
        };
        let data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            fuse.as_raw_fd()
        );
        if let Err(e) = nix::mount::mount(
            Some("fencecsi-test"),
            &target,
            Some("fuse"),
            MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
            Some(data.as_str()),
        ) {
            eprintln!("SKIPPED: fuse mount refused: {e}");
            return;
        }
        let _g = MountGuard(target.clone());
        drop(fuse); // the daemon "dies" before answering anything
        let state = path_state(&target);
        eprintln!("MEASURE dead fuse mountpoint: path_state={state:?}");
        assert!(
            matches!(
                state,
                PathState::Stale(Errno::ENOTCONN | Errno::EIO | Errno::ESTALE)
            ),
            "{state:?}"
        );
        assert!(is_mountpoint(&target).unwrap());
        assert_eq!(force_unmount(&target).unwrap(), Unmount::Unmounted);
        assert!(!is_mountpoint(&target).unwrap());
        assert_eq!(path_state(&target), PathState::Ok);
    }

    fn make_ext4(dir: &Path, name: &str) -> (LoopGuard, PathBuf) {
        let img = sparse_image(dir, name, 64 << 20);
        let lg = LoopGuard::attach(
            &img,
            &AttachOptions {
                tag: test_tag(name),
                ..Default::default()
            },
        );
        crate::kernel::filesystem::mkfs(lg.path(), "ext4").unwrap();
        (lg, img)
    }

    #[test]
    fn mounts_device_mount_with_options() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let (lg, _img) = make_ext4(dir.path(), "md.img");
        let target = dir.path().join("mnt");
        std::fs::create_dir(&target).unwrap();
        let opts = vec![
            "noatime".to_string(),
            "nodev".to_string(),
            "errors=remount-ro".to_string(),
        ];
        mount_device(lg.path(), &target, "ext4", &opts, false).unwrap();
        let _mg = MountGuard(target.clone());
        let at = mounts_at(&target).unwrap();
        assert_eq!(at.len(), 1);
        assert_eq!(at[0].fs_type, "ext4");
        assert_eq!(at[0].source, lg.path().to_str().unwrap());
        assert!(!at[0].read_only);
        let (maj, min) = (7, {
            let md = std::fs::metadata(lg.path()).unwrap();
            libc::minor(md.rdev())
        });
        let users = mounts_of_device(maj, min).unwrap();
        assert_eq!(users.len(), 1);
        assert_eq!(users[0].mount_point, target);
        std::fs::write(target.join("f"), b"data").unwrap();
        assert_eq!(unmount_once_free(&target).unwrap(), Unmount::Unmounted);
        assert!(mounts_of_device(maj, min).unwrap().is_empty());
        // Read-only mount: writes fail with EROFS.
        mount_device(lg.path(), &target, "ext4", &[], true).unwrap();
        assert!(mounts_at(&target).unwrap()[0].read_only);
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"data");
        assert_eq!(
            File::create(target.join("g")).unwrap_err().raw_os_error(),
            Some(libc::EROFS)
        );
    }

    /// The fence scenario: the backing inode is made immutable under a mounted
    /// ext4, the writer's fsync fails with EIO, the journal aborts, and the
    /// node must still be able to tear the mount down.
    #[test]
    fn mounts_force_unmount_aborted_filesystem() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let (lg, img) = make_ext4(dir.path(), "abort.img");
        let target = dir.path().join("mnt");
        std::fs::create_dir(&target).unwrap();
        mount_device(lg.path(), &target, "ext4", &[], false).unwrap();
        let _mg = MountGuard(target.clone());

        struct Immutable(PathBuf);
        fn set_flags(p: &Path, on: bool) -> nix::Result<()> {
            nix::ioctl_read!(getflags, b'f', 1, libc::c_long);
            nix::ioctl_write_ptr!(setflags, b'f', 2, libc::c_long);
            let f = File::open(p).map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))?;
            let mut flags: libc::c_long = 0;
            unsafe { getflags(f.as_raw_fd(), &mut flags) }?;
            const FS_IMMUTABLE_FL: libc::c_long = 0x10;
            flags = if on {
                flags | FS_IMMUTABLE_FL
            } else {
                flags & !FS_IMMUTABLE_FL
            };
            unsafe { setflags(f.as_raw_fd(), &flags) }.map(drop)
        }
        impl Drop for Immutable {
            fn drop(&mut self) {
                let _ = set_flags(&self.0, false);
            }
        }
        let mut f = File::create(target.join("w")).unwrap();
        f.write_all(b"before").unwrap();
        f.sync_all().unwrap();
        if let Err(e) = set_flags(&img, true) {
            eprintln!("SKIPPED: backing fs refuses FS_IMMUTABLE_FL: {e}");
            return;
        }
        let _imm = Immutable(img.clone());
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        let r = f.sync_all();
        eprintln!("MEASURE fsync after immutable: {r:?}");
        assert!(r.is_err());
        let state = path_state(&target);
        let plain = unmount(&target);
        eprintln!(
            "MEASURE aborted ext4: path_state={state:?} plain unmount with open file={plain:?}"
        );
        assert!(matches!(force_unmount(&target), Ok(Unmount::Unmounted)));
        assert!(!is_mountpoint(&target).unwrap());
        drop(f);
    }
}
