//! Loop devices driven directly by ioctl.
//!
//! Why hand-written ioctls rather than `loopdev-3` or `losetup`: loopdev-3 binds
//! with LOOP_SET_FD + LOOP_SET_STATUS64 (two steps, so another process can see
//! a half-configured device), never uses LOOP_CONFIGURE, does not retry the
//! LOOP_CTL_GET_FREE race and needs libclang to build. Shelling out to losetup
//! would make error handling string parsing. The kernel ABI used here is small
//! and stable (include/uapi/linux/loop.h), so it is defined below.
//!
//! Rule kept by every function that changes a device (attach, detach,
//! set_capacity, remap, drain): the caller only passes devices this driver attached.
//! `list`/`status`/`find_by_inode` only read.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use serde::{Deserialize, Serialize};

use crate::lock::{BackingLock, NODE_LOCK_WAIT};

/// `LO_NAME_SIZE`: lo_file_name is 64 bytes, the kernel forces the last to NUL.
pub const LO_NAME_SIZE: usize = 64;
/// Longest tag that fits into lo_file_name.
pub const MAX_TAG_LEN: usize = LO_NAME_SIZE - 1;
const LO_KEY_SIZE: usize = 32;

/// Block major of loop devices (LOOP_MAJOR in include/uapi/linux/major.h).
const LOOP_MAJOR: u32 = 7;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// How often attach retries get-free + configure when another process takes
/// the device it was given between the two calls (EBUSY/EAGAIN).
const ATTACH_TRIES: u32 = 20;

/// `struct loop_info64` from include/uapi/linux/loop.h.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

impl LoopInfo64 {
    fn zeroed() -> Self {
        // All-zero is a valid value for every field (plain integers and bytes).
        unsafe { std::mem::zeroed() }
    }
}

/// `struct loop_config` (LOOP_CONFIGURE, Linux >= 5.8).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// The loop ioctls are "bad" ones: plain numbers without size/direction bits.
mod ioc {
    use super::{LoopConfig, LoopInfo64};
    nix::ioctl_write_int_bad!(loop_set_fd, 0x4C00);
    nix::ioctl_none_bad!(loop_clr_fd, 0x4C01);
    nix::ioctl_write_ptr_bad!(loop_set_status64, 0x4C04, LoopInfo64);
    nix::ioctl_read_bad!(loop_get_status64, 0x4C05, LoopInfo64);
    nix::ioctl_none_bad!(loop_set_capacity, 0x4C07);
    nix::ioctl_write_int_bad!(loop_set_direct_io, 0x4C08);
    nix::ioctl_write_int_bad!(loop_set_block_size, 0x4C09);
    nix::ioctl_write_ptr_bad!(loop_configure, 0x4C0A, LoopConfig);
    nix::ioctl_none_bad!(loop_ctl_get_free, 0x4C82);
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t); size_t is u64 on 64-bit Linux.
    nix::ioctl_read!(blkgetsize64, 0x12, 114, u64);
}

/// BLKGETSIZE64 on an open block device (shared with `filesystem`).
pub fn blkgetsize64(file: &File) -> Result<u64, Errno> {
    let mut size: u64 = 0;
    unsafe { ioc::blkgetsize64(file.as_raw_fd(), &mut size) }?;
    Ok(size)
}

#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{op} on {device}: {source}")]
    Ioctl {
        op: &'static str,
        device: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("{0} is not bound to a backing file")]
    NotBound(PathBuf),
    #[error("{0} is not a loop device")]
    NotLoopDevice(PathBuf),
    #[error("invalid tag {tag:?}: {reason}")]
    InvalidTag { tag: String, reason: &'static str },
    #[error("{device} (stacked on gate {gate}) does not use direct I/O, which the fence needs; it is released, and the gate with it")]
    NotDirect { device: PathBuf, gate: PathBuf },
    #[error("no free loop device after {0} attempts: other processes kept taking them")]
    NoFreeDevice(u32),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl LoopError {
    fn ioctl(op: &'static str, device: &Path, source: Errno) -> Self {
        LoopError::Ioctl {
            op,
            device: device.to_path_buf(),
            source,
        }
    }
}

/// A bound loop device as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopInfo {
    /// `/dev/loopN`.
    pub device: PathBuf,
    pub number: u32,
    /// st_dev of the backing file (same encoding as `MetadataExt::dev`).
    pub backing_dev: u64,
    /// st_ino of the backing file.
    pub backing_ino: u64,
    /// lo_file_name: whatever the attacher stored there (up to 63 bytes).
    pub tag: String,
    pub read_only: bool,
    pub direct_io: bool,
    pub autoclear: bool,
    pub size_bytes: u64,
    /// Where the device's window starts in the backing file (lo_offset).
    pub offset: u64,
    /// The window's length limit (lo_sizelimit; 0: up to the end of the file).
    pub size_limit: u64,
    /// The gate this device writes through (see [`super::loop_gate`]): for a
    /// device stacked on a gate, the gate, whose backing file, window and
    /// I/O mode the fields above then report (`size_bytes` is the smaller
    /// of the two capacities); for a gate nothing is stacked on, itself.
    /// None for a plain device over its file.
    #[serde(default)]
    pub gate: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttachOptions {
    pub read_only: bool,
    /// Ask for direct I/O on the backing file; silently dropped (with a log
    /// line) when the backing filesystem refuses it. See `LoopInfo::direct_io`.
    pub direct_io: bool,
    /// Stored in lo_file_name; at most 63 bytes, no NUL.
    pub tag: String,
    /// lo_sizelimit: the device shows only `[0, size_limit)` of the file
    /// (0: the whole file). Volumes use it to keep their fence trailer out.
    pub size_limit: u64,
    /// The device's logical block size (LOOP_CONFIGURE's `block_size`;
    /// 0: the kernel's default, 512). The driver uses the default: the loop
    /// I/O benchmark measured no gain from 4096 (BENCHMARKS.md), and a
    /// filesystem made on one size may not mount on another.
    pub logical_block_size: u32,
}

fn device_path(number: u32) -> PathBuf {
    PathBuf::from(format!("/dev/loop{number}"))
}

pub(crate) fn sys_loop_dir(number: u32) -> PathBuf {
    PathBuf::from(format!("/sys/block/loop{number}"))
}

/// Opens a path that must be a loop block device. Checked first because the
/// loop ioctl numbers are "bad" (no type bits) and could mean something else
/// to another driver.
fn open_loop(path: &Path, write: bool) -> Result<File, LoopError> {
    let meta = std::fs::metadata(path).map_err(|source| LoopError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_block_device() || libc::major(meta.rdev()) != LOOP_MAJOR {
        return Err(LoopError::NotLoopDevice(path.to_path_buf()));
    }
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| LoopError::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// Makes sure /dev/loopN exists. devtmpfs normally creates it when the kernel
/// adds the disk, but containers with a static /dev do not get new nodes.
fn ensure_node(number: u32) -> Result<PathBuf, LoopError> {
    let path = device_path(number);
    if path.exists() {
        return Ok(path);
    }
    // The minor is N only when max_part=0; sysfs has the real one.
    let (major, minor) = std::fs::read_to_string(sys_loop_dir(number).join("dev"))
        .ok()
        .and_then(|s| {
            let (a, b) = s.trim().split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((LOOP_MAJOR, number));
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o660);
    match nix::sys::stat::mknod(
        &path,
        nix::sys::stat::SFlag::S_IFBLK,
        mode,
        libc::makedev(major, minor),
    ) {
        Ok(()) | Err(Errno::EEXIST) => Ok(path),
        Err(e) => Err(LoopError::Io {
            path,
            source: e.into(),
        }),
    }
}

fn get_status_raw(file: &File, path: &Path) -> Result<LoopInfo64, LoopError> {
    let mut info = LoopInfo64::zeroed();
    match unsafe { ioc::loop_get_status64(file.as_raw_fd(), &mut info) } {
        Ok(_) => Ok(info),
        Err(Errno::ENXIO) => Err(LoopError::NotBound(path.to_path_buf())),
        Err(Errno::ENOTTY) => Err(LoopError::NotLoopDevice(path.to_path_buf())),
        Err(e) => Err(LoopError::ioctl("LOOP_GET_STATUS64", path, e)),
    }
}

fn tag_of(info: &LoopInfo64) -> String {
    let end = info
        .lo_file_name
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(LO_NAME_SIZE);
    String::from_utf8_lossy(&info.lo_file_name[..end]).into_owned()
}

fn validate_tag(tag: &str) -> Result<(), LoopError> {
    if tag.len() > MAX_TAG_LEN {
        return Err(LoopError::InvalidTag {
            tag: tag.to_string(),
            reason: "longer than 63 bytes",
        });
    }
    if tag.as_bytes().contains(&0) {
        return Err(LoopError::InvalidTag {
            tag: tag.to_string(),
            reason: "contains a NUL byte",
        });
    }
    Ok(())
}

fn fill_name(info: &mut LoopInfo64, tag: &str) {
    info.lo_file_name = [0; LO_NAME_SIZE];
    info.lo_file_name[..tag.len()].copy_from_slice(tag.as_bytes());
}

/// Atomic bind + configure (Linux >= 5.8).
fn configure(
    dev: &File,
    backing: &File,
    flags: u32,
    tag: &str,
    size_limit: u64,
    block_size: u32,
) -> Result<(), Errno> {
    let mut cfg = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        // 0 keeps the kernel's default logical block size.
        block_size,
        info: LoopInfo64::zeroed(),
        reserved: [0; 8],
    };
    cfg.info.lo_flags = flags;
    cfg.info.lo_sizelimit = size_limit;
    fill_name(&mut cfg.info, tag);
    unsafe { ioc::loop_configure(dev.as_raw_fd(), &cfg) }.map(drop)
}

/// Pre-5.8 path: bind, then set the name. Not atomic: if the second step
/// fails, the device is unbound again so nothing half-made stays behind.
fn legacy_bind(
    dev: &File,
    dev_path: &Path,
    backing: &File,
    tag: &str,
    size_limit: u64,
    autoclear: bool,
) -> Result<(), Errno> {
    unsafe { ioc::loop_set_fd(dev.as_raw_fd(), backing.as_raw_fd()) }?;
    let mut info = LoopInfo64::zeroed();
    info.lo_sizelimit = size_limit;
    if autoclear {
        info.lo_flags = LO_FLAGS_AUTOCLEAR;
    }
    fill_name(&mut info, tag);
    if let Err(e) = unsafe { ioc::loop_set_status64(dev.as_raw_fd(), &info) } {
        if let Err(e2) = unsafe { ioc::loop_clr_fd(dev.as_raw_fd()) } {
            tracing::warn!(device = %dev_path.display(), error = %e2, "could not unbind after LOOP_SET_STATUS64 failed");
        }
        return Err(e);
    }
    Ok(())
}

/// Binds `file` to a free loop device and returns what the kernel actually set.
///
/// Direct I/O is best effort: when the kernel refuses it, the device is bound
/// without it and `LoopInfo::direct_io` is false.
pub fn attach(file: &Path, opts: &AttachOptions) -> Result<LoopInfo, LoopError> {
    attach_inner(file, opts, true)
}

/// `try_configure = false` forces the pre-5.8 path (so tests can cover it).
fn attach_inner(
    file: &Path,
    opts: &AttachOptions,
    try_configure: bool,
) -> Result<LoopInfo, LoopError> {
    bind(file, opts, try_configure, false).map(|(info, _)| info)
}

/// Binds `file` to a free loop device; also returns the descriptor the
/// device was configured through. With `autoclear` the kernel unbinds the
/// device at its last close, so the caller keeps that descriptor open until
/// something else holds the device (see `loop_gate::attach_gated`).
pub(crate) fn bind(
    file: &Path,
    opts: &AttachOptions,
    try_configure: bool,
    autoclear: bool,
) -> Result<(LoopInfo, File), LoopError> {
    validate_tag(&opts.tag)?;
    let backing = open_cloexec(file, !opts.read_only)?;
    let ctl_path = Path::new("/dev/loop-control");
    let ctl = open_cloexec(ctl_path, true)?;
    let mut mode = BindMode {
        configure: try_configure,
        direct_io: opts.direct_io,
    };
    let mut bound: Option<(PathBuf, File)> = None;
    for attempt in 0..ATTACH_TRIES {
        let Some((dev_path, dev)) = free_device(&ctl, ctl_path)? else {
            continue;
        };
        match bind_device(&dev, &dev_path, &backing, opts, &mode, autoclear)? {
            Ok(()) => {
                bound = Some((dev_path, dev));
                break;
            }
            Err(errno) => mode = mode.after(errno, opts, file, &dev_path, attempt)?,
        }
    }
    let (dev_path, dev) = bound.ok_or(LoopError::NoFreeDevice(ATTACH_TRIES))?;
    // The device's own mode (a device on a gate reports its gate's otherwise).
    let (raw, rdevice) = raw_status_of(&dev, &dev_path)?;
    if opts.direct_io && !raw.direct_io {
        tracing::warn!(device = %dev_path.display(), file = %file.display(), "direct I/O not in effect; the backing file is used with buffered I/O");
    }
    tracing::info!(device = %dev_path.display(), file = %file.display(), tag = %raw.tag, read_only = raw.read_only, direct_io = raw.direct_io, "loop device attached");
    let info = resolve(raw, rdevice)?;
    Ok((info, dev))
}

/// Opens `path` close-on-exec, read-only or read-write.
fn open_cloexec(path: &Path, write: bool) -> Result<File, LoopError> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| LoopError::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// A free loop device, opened for writing (the kernel makes the device
/// read-only when the loop device itself was opened without write access);
/// None when someone removed it (LOOP_CTL_REMOVE) between get-free and open.
fn free_device(ctl: &File, ctl_path: &Path) -> Result<Option<(PathBuf, File)>, LoopError> {
    let number = match unsafe { ioc::loop_ctl_get_free(ctl.as_raw_fd()) } {
        Ok(n) => n as u32,
        Err(e) => return Err(LoopError::ioctl("LOOP_CTL_GET_FREE", ctl_path, e)),
    };
    let dev_path = ensure_node(number)?;
    Ok(open_if_present(&dev_path, true)?.map(|f| (dev_path, f)))
}

/// [`open_loop`], or None when the device node or the device is gone.
fn open_if_present(path: &Path, write: bool) -> Result<Option<File>, LoopError> {
    match open_loop(path, write) {
        Ok(f) => Ok(Some(f)),
        Err(LoopError::Open { source, .. })
            if matches!(source.raw_os_error(), Some(libc::ENOENT | libc::ENXIO)) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// How the next try binds: `LOOP_CONFIGURE` or the legacy pair, with or
/// without direct I/O.
#[derive(Clone, Copy)]
struct BindMode {
    configure: bool,
    direct_io: bool,
}

impl BindMode {
    /// The mode of the next try after the kernel refused this one with
    /// `errno`, or the error when no other try can help.
    fn after(
        self,
        errno: Errno,
        opts: &AttachOptions,
        file: &Path,
        dev_path: &Path,
        attempt: u32,
    ) -> Result<BindMode, LoopError> {
        match errno {
            Errno::EBUSY | Errno::EAGAIN => {
                // Another process bound this device after we were given it.
                tracing::debug!(device = %dev_path.display(), attempt, "loop device taken concurrently; retrying");
                std::thread::sleep(Duration::from_millis(2 + 3 * attempt as u64));
                Ok(self)
            }
            Errno::EINVAL if self.configure && self.direct_io => {
                tracing::warn!(file = %file.display(), "LOOP_CONFIGURE refused direct I/O; retrying with buffered I/O");
                Ok(BindMode {
                    direct_io: false,
                    ..self
                })
            }
            Errno::EINVAL | Errno::ENOTTY if self.configure => {
                tracing::info!(
                    "LOOP_CONFIGURE unsupported; falling back to LOOP_SET_FD + LOOP_SET_STATUS64"
                );
                Ok(BindMode {
                    configure: false,
                    direct_io: opts.direct_io,
                })
            }
            e => {
                let op = if self.configure {
                    "LOOP_CONFIGURE"
                } else {
                    "LOOP_SET_FD/LOOP_SET_STATUS64"
                };
                Err(LoopError::ioctl(op, dev_path, e))
            }
        }
    }
}

/// One try at binding `backing` to `dev`: the kernel's refusal as the inner
/// error (the caller decides whether to try again), a failure after the
/// bind (undone) as the outer one.
fn bind_device(
    dev: &File,
    dev_path: &Path,
    backing: &File,
    opts: &AttachOptions,
    mode: &BindMode,
    autoclear: bool,
) -> Result<Result<(), Errno>, LoopError> {
    if mode.configure {
        let mut flags = 0;
        if opts.read_only {
            flags |= LO_FLAGS_READ_ONLY;
        }
        if mode.direct_io {
            flags |= LO_FLAGS_DIRECT_IO;
        }
        if autoclear {
            flags |= LO_FLAGS_AUTOCLEAR;
        }
        return Ok(configure(
            dev,
            backing,
            flags,
            &opts.tag,
            opts.size_limit,
            opts.logical_block_size,
        ));
    }
    if let Err(e) = legacy_bind(
        dev,
        dev_path,
        backing,
        &opts.tag,
        opts.size_limit,
        autoclear,
    ) {
        return Ok(Err(e));
    }
    if mode.direct_io {
        // The legacy path can only ask for direct I/O afterwards.
        if let Err(e) = unsafe { ioc::loop_set_direct_io(dev.as_raw_fd(), 1) } {
            tracing::warn!(device = %dev_path.display(), error = %e, "direct I/O refused; using buffered I/O");
        }
    }
    if opts.logical_block_size != 0 {
        let size = opts.logical_block_size as i32;
        if let Err(e) = unsafe { ioc::loop_set_block_size(dev.as_raw_fd(), size) } {
            let _ = unsafe { ioc::loop_clr_fd(dev.as_raw_fd()) };
            return Err(LoopError::ioctl("LOOP_SET_BLOCK_SIZE", dev_path, e));
        }
    }
    Ok(Ok(()))
}

/// Unbinds a loop device (LOOP_CLR_FD).
///
/// Returns Ok when the device is already unbound (ENXIO). When the device is
/// still open elsewhere (a mounted filesystem, a lazily unmounted one with
/// open files, another process reading it), the kernel only marks it
/// autoclear and unbinds it at the last close: that is Ok too, and the backing
/// file stays held until then. Check `status()` if that matters.
pub fn detach(device: &Path) -> Result<(), LoopError> {
    let dev = open_loop(device, false)?;
    // Serialised with a fence's remap of this device (see `remap`), which
    // would otherwise overwrite the autoclear flag this call may set.
    let _guard = match get_status_raw(&dev, device) {
        Ok(raw) => image_lock_for(raw),
        Err(LoopError::NotBound(_)) => None,
        Err(e) => return Err(e),
    };
    match unsafe { ioc::loop_clr_fd(dev.as_raw_fd()) } {
        Ok(_) | Err(Errno::ENXIO) => {
            tracing::info!(device = %device.display(), "loop device detached");
            Ok(())
        }
        Err(e) => Err(LoopError::ioctl("LOOP_CLR_FD", device, e)),
    }
}

/// The image lock for a device's backing file; for a device stacked on a
/// gate, the lock of the gate's file (the image), which the fence holds.
fn image_lock_for(raw: LoopInfo64) -> Option<BackingLock> {
    let raw = if is_loop_rdev(raw.lo_rdevice) {
        let (gate, path) = open_by_rdev(raw.lo_rdevice).ok().flatten()?;
        get_status_raw(&gate, &path).ok()?
    } else {
        raw
    };
    backing_file_lock(raw.lo_number, raw.lo_device, raw.lo_inode)
}

/// Exclusive lock on the backing file of loop device `number`, if that
/// file can still be reached at the path sysfs reports (checked by device
/// and inode, so a renamed or replaced path is never locked by mistake) and
/// the lock can be had within [`NODE_LOCK_WAIT`]. Without it a detach still
/// goes on: at worst a remap running meanwhile drops its autoclear flag, and
/// the device stays bound (fenced or idle) until released again.
fn backing_file_lock(number: u32, dev: u64, ino: u64) -> Option<BackingLock> {
    let raw = std::fs::read_to_string(sys_loop_dir(number).join("loop/backing_file")).ok()?;
    let path = PathBuf::from(raw.trim_end_matches('\n'));
    let meta = std::fs::metadata(&path).ok()?;
    if meta.dev() != dev || meta.ino() != ino {
        return None;
    }
    match BackingLock::on_path(&path, true, NODE_LOCK_WAIT) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "detaching without the image lock");
            None
        }
    }
}

/// Switches a bound device's direct I/O on or off (`LOOP_SET_DIRECT_IO`). The kernel
/// refuses (EINVAL) when the backing file cannot do direct I/O at the device's block size.
/// On a device stacked on a gate it is the gate that switches: the gate is
/// what reads and writes the image, and the device above always uses direct
/// I/O (see `loop_gate`).
pub fn set_direct_io(device: &Path, on: bool) -> Result<(), LoopError> {
    let target = status(device)?.gate.unwrap_or_else(|| device.to_path_buf());
    set_direct_io_raw(&target, on)
}

pub(crate) fn set_direct_io_raw(device: &Path, on: bool) -> Result<(), LoopError> {
    let dev = open_loop(device, false)?;
    unsafe { ioc::loop_set_direct_io(dev.as_raw_fd(), on as i32) }
        .map(|_| ())
        .map_err(|e| LoopError::ioctl("LOOP_SET_DIRECT_IO", device, e))
}

/// What the kernel reports for one bound device. `NotBound` when it is free.
pub fn status(device: &Path) -> Result<LoopInfo, LoopError> {
    status_of(&open_loop(device, false)?, device)
}

/// [`status`] of the device itself, not seen through a gate it is stacked on.
pub fn open_raw_status(device: &Path) -> Result<LoopInfo, LoopError> {
    raw_status_of(&open_loop(device, false)?, device).map(|(info, _)| info)
}

fn status_of(dev: &File, device: &Path) -> Result<LoopInfo, LoopError> {
    let (info, rdevice) = raw_status_of(dev, device)?;
    resolve(info, rdevice)
}

/// What the kernel reports for the device itself, not resolved through a
/// gate, and the device number of its backing file (0 for a regular file).
pub(crate) fn raw_status_of(dev: &File, device: &Path) -> Result<(LoopInfo, u64), LoopError> {
    let raw = get_status_raw(dev, device)?;
    let size_bytes = blkgetsize64(dev).map_err(|e| LoopError::ioctl("BLKGETSIZE64", device, e))?;
    let number = raw.lo_number;
    // sysfs is what the loop driver itself uses for dio; the flag is a fallback.
    let direct_io = match std::fs::read_to_string(sys_loop_dir(number).join("loop/dio")) {
        Ok(s) => s.trim() == "1",
        Err(_) => raw.lo_flags & LO_FLAGS_DIRECT_IO != 0,
    };
    let info = LoopInfo {
        device: device_path(number),
        number,
        backing_dev: raw.lo_device,
        backing_ino: raw.lo_inode,
        tag: tag_of(&raw),
        read_only: raw.lo_flags & LO_FLAGS_READ_ONLY != 0,
        direct_io,
        autoclear: raw.lo_flags & LO_FLAGS_AUTOCLEAR != 0,
        size_bytes,
        offset: raw.lo_offset,
        size_limit: raw.lo_sizelimit,
        gate: None,
    };
    Ok((info, raw.lo_rdevice))
}

/// Whether a device number (as `lo_rdevice` reports it) is a loop device's.
pub(crate) fn is_loop_rdev(rdev: u64) -> bool {
    rdev != 0 && libc::major(rdev) == LOOP_MAJOR
}

/// The loop device whose block device number is `rdev`, opened read-only;
/// None when it is gone. Any other failure is an error: a caller that could
/// not look must not take the device for something else.
pub(crate) fn open_by_rdev(rdev: u64) -> Result<Option<(File, PathBuf)>, LoopError> {
    let sys = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    let link = match std::fs::read_link(&sys) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(LoopError::Io { path: sys, source }),
    };
    let number: u32 = link
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("loop"))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| LoopError::NotLoopDevice(link.clone()))?;
    let path = ensure_node(number)?;
    Ok(open_if_present(&path, false)?.map(|f| (f, path)))
}

/// LOOP_CLR_FD on a device this process just bound and nobody used yet
/// (an attach undoing itself): without the image lock, which the attach
/// may hold shared.
pub(crate) fn clear_unused(device: &Path) -> Result<(), LoopError> {
    let dev = open_loop(device, false)?;
    match unsafe { ioc::loop_clr_fd(dev.as_raw_fd()) } {
        Ok(_) | Err(Errno::ENXIO) => Ok(()),
        Err(e) => Err(LoopError::ioctl("LOOP_CLR_FD", device, e)),
    }
}

// Devices stacked on a gate (see `loop_gate`): the tag format, and how such
// a device is reported (through its gate, as one device per attachment).

/// Tag prefix of a gate; the rest is the tag of the device stacked on it.
pub const GATE_TAG_PREFIX: &str = "gate:";
/// The gate's tag for a device tagged `tag` (cut to the kernel's limit).
pub fn gate_tag(tag: &str) -> String {
    let mut t = format!("{GATE_TAG_PREFIX}{tag}");
    while t.len() > MAX_TAG_LEN {
        t.pop();
    }
    t
}

pub fn is_gate_tag(tag: &str) -> bool {
    tag.starts_with(GATE_TAG_PREFIX)
}

/// A device as the kernel reports it (`info`, its backing file's device
/// number `rdevice`), seen through its gate when it is stacked on one.
pub(crate) fn resolve(info: LoopInfo, rdevice: u64) -> Result<LoopInfo, LoopError> {
    if is_gate_tag(&info.tag) {
        let device = info.device.clone();
        return Ok(LoopInfo {
            gate: Some(device),
            ..info
        });
    }
    if !is_loop_rdev(rdevice) {
        return Ok(info);
    }
    // Gone: the device above holds its gate open, so it is being released
    // itself; report it as is. Any other failure to look is an error.
    let Some((file, path)) = open_by_rdev(rdevice)? else {
        return Ok(info);
    };
    let (gate, _) = match raw_status_of(&file, &path) {
        Ok(g) => g,
        Err(LoopError::NotBound(_)) => return Ok(info),
        Err(e) => return Err(e),
    };
    Ok(through(info, &gate))
}

/// A device stacked on the loop device `under` (both as the kernel reports
/// them), seen through it when it is a gate; as it is otherwise (someone's
/// loop device over another loop device).
pub(crate) fn through(info: LoopInfo, under: &LoopInfo) -> LoopInfo {
    if !is_gate_tag(&under.tag) {
        return info;
    }
    LoopInfo {
        backing_dev: under.backing_dev,
        backing_ino: under.backing_ino,
        read_only: info.read_only || under.read_only,
        direct_io: under.direct_io,
        size_bytes: info.size_bytes.min(under.size_bytes),
        offset: under.offset,
        size_limit: under.size_limit,
        gate: Some(under.device.clone()),
        ..info
    }
}

/// Every bound loop device on the machine, sorted by number; a device
/// stacked on a gate is reported through it (see [`resolve`]) and
/// the gate itself is then left out.
pub fn list() -> Result<Vec<LoopInfo>, LoopError> {
    let raws = raw_list()?;
    let mut out = Vec::new();
    for raw in &raws {
        // The gate is normally in the same scan: no second look at it.
        let under = is_loop_rdev(raw.backing_rdev)
            .then(|| raws.iter().find(|g| g.rdev == raw.backing_rdev))
            .flatten();
        match under {
            Some(g) => out.push(through(raw.info.clone(), &g.info)),
            None => match resolve(raw.info.clone(), raw.backing_rdev) {
                Ok(info) => out.push(info),
                Err(LoopError::NotBound(_)) => {}
                Err(e) => return Err(e),
            },
        }
    }
    // A gate with a device stacked on it is listed as that device.
    let covered: Vec<PathBuf> = out
        .iter()
        .filter_map(|i| i.gate.clone().filter(|g| *g != i.device))
        .collect();
    out.retain(|i| !covered.contains(&i.device));
    out.sort_by_key(|i| i.number);
    Ok(out)
}

/// A bound loop device as the kernel reports it, not through a gate.
struct RawDevice {
    info: LoopInfo,
    /// Its own block device number.
    rdev: u64,
    /// Its backing file's device number (0 for a regular file).
    backing_rdev: u64,
}

/// Every bound loop device as the kernel reports it (not through a gate).
fn raw_list() -> Result<Vec<RawDevice>, LoopError> {
    let sys = Path::new("/sys/block");
    let entries = std::fs::read_dir(sys).map_err(|source| LoopError::Io {
        path: sys.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| LoopError::Io {
            path: sys.to_path_buf(),
            source,
        })?;
        let name = entry.file_name();
        let Some(number) = name
            .to_str()
            .and_then(|n| n.strip_prefix("loop"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // The "loop" subdirectory exists only while the device is bound.
        if !entry.path().join("loop").exists() {
            continue;
        }
        let path = ensure_node(number)?;
        let opened = match open_loop(&path, false) {
            Ok(f) => f,
            // Removed since the scan: not an error.
            Err(LoopError::Open { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ENOENT | libc::ENXIO)) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        let rdev = opened
            .metadata()
            .map_err(|source| LoopError::Io {
                path: path.clone(),
                source,
            })?
            .rdev();
        match raw_status_of(&opened, &path) {
            Ok((info, backing_rdev)) => out.push(RawDevice {
                info,
                rdev,
                backing_rdev,
            }),
            // Unbound since the scan: not an error.
            Err(LoopError::NotBound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The bound devices stacked on `gate` (whose backing file is that block
/// device), read from each device's own status: found even where a device
/// cannot be seen through its gate.
pub fn stacked_on(gate: &Path) -> Result<Vec<PathBuf>, LoopError> {
    let rdev = std::fs::metadata(gate)
        .map_err(|source| LoopError::Open {
            path: gate.to_path_buf(),
            source,
        })?
        .rdev();
    Ok(raw_list()?
        .into_iter()
        .filter(|d| d.backing_rdev == rdev)
        .map(|d| d.info.device)
        .collect())
}

/// Loop devices whose backing file is inode `ino` on device `dev` (values as
/// from `std::os::unix::fs::MetadataExt`): who holds a generation file.
pub fn find_by_inode(dev: u64, ino: u64) -> Result<Vec<LoopInfo>, LoopError> {
    Ok(list()?
        .into_iter()
        .filter(|i| i.backing_dev == dev && i.backing_ino == ino)
        .collect())
}

/// Re-reads the backing file's size after it grew; returns the new size.
pub fn set_capacity(device: &Path) -> Result<u64, LoopError> {
    // Read-only open is enough as root and cannot clash with a mounted fs's
    // exclusive claim.
    let dev = open_loop(device, false)?;
    match unsafe { ioc::loop_set_capacity(dev.as_raw_fd()) } {
        Ok(_) => {}
        Err(Errno::ENXIO) => return Err(LoopError::NotBound(device.to_path_buf())),
        Err(e) => return Err(LoopError::ioctl("LOOP_SET_CAPACITY", device, e)),
    }
    blkgetsize64(&dev).map_err(|e| LoopError::ioctl("BLKGETSIZE64", device, e))
}

/// Changes the window a bound device shows of its backing file, keeping
/// every other setting (flags as read just now, name, encryption fields).
///
/// LOOP_SET_STATUS64 freezes the device's request queue (waiting for the
/// requests already in it, buffered or async direct I/O), applies the new
/// offset and size limit, sets the new capacity and unfreezes. So when this
/// returns, every request still to run sees the new window, including one
/// that passed the end-of-device check with the old size but was not yet in
/// the queue (the fence's settle is for those). With the same window it is a
/// barrier for the requests in the queue.
///
/// The kernel rewrites the autoclear flag from what we pass, so a
/// concurrent LOOP_CLR_FD (which sets autoclear on a busy device) could be
/// lost between our read and our write: callers hold [`BackingLock`] on the
/// backing file, and `detach` takes the same lock.
pub fn remap(device: &Path, offset: u64, size_limit: u64) -> Result<LoopInfo, LoopError> {
    let dev = open_loop(device, false)?;
    let info = get_status_raw(&dev, device)?;
    set_window(&dev, device, info, offset, size_limit)?;
    status(device)
}

/// LOOP_SET_STATUS64 with `info` (as just read) moved to the window
/// `(offset, size_limit)`: the one write behind [`remap`] and
/// [`HeldDevice::remap`].
fn set_window(
    dev: &File,
    device: &Path,
    mut info: LoopInfo64,
    offset: u64,
    size_limit: u64,
) -> Result<(), LoopError> {
    info.lo_offset = offset;
    info.lo_sizelimit = size_limit;
    // SAFETY: the fd is an open loop device and `info` a whole loop_info64.
    match unsafe { ioc::loop_set_status64(dev.as_raw_fd(), &info) } {
        Ok(_) => Ok(()),
        Err(Errno::ENXIO) => Err(LoopError::NotBound(device.to_path_buf())),
        Err(e) => Err(LoopError::ioctl("LOOP_SET_STATUS64", device, e)),
    }
}

/// One bound device held open across several remaps (the fence's shrink,
/// settle and move), so that it stays the same device throughout: while a
/// descriptor is open a detach only marks it for autoclear, so its number
/// cannot be handed to another file meanwhile.
pub struct HeldDevice {
    file: File,
    path: PathBuf,
    backing: (u64, u64),
}

impl HeldDevice {
    /// Opens `device` if it is still bound to the file `(backing_dev,
    /// backing_ino)`; `NotBound` when it is free or backs another file now.
    pub fn open(device: &Path, backing: (u64, u64)) -> Result<HeldDevice, LoopError> {
        let held = HeldDevice {
            file: open_loop(device, false)?,
            path: device.to_path_buf(),
            backing,
        };
        held.status()?;
        Ok(held)
    }

    /// What the kernel reports for it now; `NotBound` if it no longer backs
    /// the file it was opened for.
    pub fn status(&self) -> Result<LoopInfo, LoopError> {
        let now = status_of(&self.file, &self.path)?;
        if (now.backing_dev, now.backing_ino) != self.backing {
            return Err(LoopError::NotBound(self.path.clone()));
        }
        Ok(now)
    }

    /// [`remap`] on the held descriptor, after checking it still backs the
    /// same file.
    pub fn remap(&self, offset: u64, size_limit: u64) -> Result<LoopInfo, LoopError> {
        let info = get_status_raw(&self.file, &self.path)?;
        if (info.lo_device, info.lo_inode) != self.backing {
            return Err(LoopError::NotBound(self.path.clone()));
        }
        set_window(&self.file, &self.path, info, offset, size_limit)?;
        self.status()
    }

    /// A barrier on the held device: LOOP_SET_STATUS64 with its own window
    /// unchanged, which returns once every request in its queue completed
    /// (see [`remap`]). Also for a device stacked on a gate, whose own window
    /// is not the gate's; it must still back the same file (through its gate).
    pub fn barrier(&self) -> Result<LoopInfo, LoopError> {
        self.status()?;
        let info = get_status_raw(&self.file, &self.path)?;
        set_window(
            &self.file,
            &self.path,
            info,
            info.lo_offset,
            info.lo_sizelimit,
        )?;
        self.status()
    }

    /// The device itself as the kernel reports it (not through its gate).
    pub fn raw_status(&self) -> Result<LoopInfo, LoopError> {
        raw_status_of(&self.file, &self.path).map(|(info, _)| info)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A barrier on one device ([`HeldDevice::barrier`]): its own window
/// unchanged, also for a device stacked on a gate.
pub fn drain(device: &Path) -> Result<(), LoopError> {
    let now = status(device)?;
    HeldDevice::open(device, (now.backing_dev, now.backing_ino))?
        .barrier()
        .map(drop)
}

/// Test helpers shared with the driver's mounts and filesystem tests (the
/// `test-support` feature, which only the driver's dev-dependency turns on).
#[cfg(any(test, feature = "test-support"))]
pub mod test_support {
    use super::*;

    pub fn is_root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    /// Skips (loudly) when not root: the tests need real kernel objects.
    #[macro_export]
    macro_rules! require_root {
        () => {
            if !$crate::kernel::loop_device::test_support::is_root() {
                eprintln!("SKIPPED: needs root for loop devices and mounts");
                return;
            }
        };
    }
    pub use require_root;

    /// A unique tag per test so nothing is confused with other devices.
    pub fn test_tag(name: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let t = format!("fcsi-t-{}-{nanos}-{name}", std::process::id());
        t[..t.len().min(MAX_TAG_LEN)].to_string()
    }

    /// A sparse image file of `size` bytes.
    pub fn sparse_image(dir: &Path, name: &str, size: u64) -> PathBuf {
        let p = dir.join(name);
        let f = File::create(&p).unwrap();
        f.set_len(size).unwrap();
        p
    }

    /// Detaches the device it holds when dropped, panic or not.
    pub struct LoopGuard(pub LoopInfo);

    impl LoopGuard {
        pub fn attach(file: &Path, opts: &AttachOptions) -> Self {
            LoopGuard(attach(file, opts).expect("attach"))
        }
        pub fn path(&self) -> &Path {
            &self.0.device
        }
    }

    impl Drop for LoopGuard {
        fn drop(&mut self) {
            // Only detach if the device still carries our tag: after an
            // explicit detach in the test the number may belong to someone else.
            match status(&self.0.device) {
                Ok(i) if i.tag == self.0.tag && i.backing_ino == self.0.backing_ino => {
                    if let Err(e) = detach(&self.0.device) {
                        eprintln!("cleanup: detach {}: {e}", self.0.device.display());
                    }
                }
                _ => {}
            }
        }
    }

    /// Waits until `device` no longer carries `info`'s binding (the kernel may
    /// defer the unbind while a parallel test has the device open briefly).
    pub fn wait_unbound(info: &LoopInfo) -> bool {
        for _ in 0..200 {
            match status(&info.device) {
                Ok(i) if i.tag == info.tag && i.backing_ino == info.backing_ino => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => return true,
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    /// Lazily unmounts its path when dropped, panic or not.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            if let Err(e) = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH) {
                eprintln!("cleanup: umount {}: {e}", self.0.display());
            }
        }
    }

    #[test]
    fn kernel_struct_sizes() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn tag_validation() {
        assert!(validate_tag(&"x".repeat(63)).is_ok());
        assert!(matches!(
            validate_tag(&"x".repeat(64)),
            Err(LoopError::InvalidTag { .. })
        ));
        assert!(matches!(
            validate_tag("a\0b"),
            Err(LoopError::InvalidTag { .. })
        ));
    }

    #[test]
    fn loopdev_attach_detach_round_trip() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "rt.img", 64 * MIB);
        let meta = std::fs::metadata(&img).unwrap();
        let tag = test_tag("rt");
        let guard = LoopGuard::attach(
            &img,
            &AttachOptions {
                read_only: true,
                direct_io: false,
                tag: tag.clone(),
                size_limit: 0,
                logical_block_size: 0,
            },
        );
        let info = status(guard.path()).unwrap();
        assert_eq!(info, guard.0);
        assert_eq!(info.tag, tag);
        assert!(info.read_only);
        assert!(!info.autoclear);
        assert!(!info.direct_io);
        assert_eq!(info.size_bytes, 64 * MIB);
        assert_eq!(
            (info.backing_dev, info.backing_ino),
            (meta.dev(), meta.ino())
        );
        assert_eq!(
            info.device,
            PathBuf::from(format!("/dev/loop{}", info.number))
        );
        assert!(list().unwrap().iter().any(|i| i == &info));

        detach(guard.path()).unwrap();
        assert!(wait_unbound(&info), "device still bound after detach");
        assert!(!list().unwrap().iter().any(|i| i.tag == tag));
    }

    #[test]
    fn loopdev_detach_of_unbound_device_is_ok() {
        require_root!();
        // Hold a free device with O_EXCL so nobody can bind it meanwhile
        // (binding needs an exclusive claim): detach must then see ENXIO.
        let ctl = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/loop-control")
            .unwrap();
        for _ in 0..20 {
            let n = unsafe { ioc::loop_ctl_get_free(ctl.as_raw_fd()) }.unwrap() as u32;
            let path = ensure_node(n).unwrap();
            let Ok(excl) = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
                .open(&path)
            else {
                continue;
            };
            if get_status_raw(&excl, &path).is_ok() {
                continue; // bound by someone just now; try another
            }
            detach(&path).unwrap();
            assert!(matches!(status(&path), Err(LoopError::NotBound(_))));
            drop(excl);
            return;
        }
        panic!("could not hold a free loop device");
    }

    #[test]
    fn loopdev_not_a_loop_device() {
        require_root!();
        assert!(matches!(
            status(Path::new("/dev/null")),
            Err(LoopError::NotLoopDevice(_))
        ));
        assert!(matches!(
            detach(Path::new("/dev/null")),
            Err(LoopError::NotLoopDevice(_))
        ));
    }

    #[test]
    fn loopdev_find_by_inode_finds_exactly_the_holders() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let a = sparse_image(dir.path(), "a.img", 64 * MIB);
        let b = sparse_image(dir.path(), "b.img", 64 * MIB);
        let opts = AttachOptions {
            tag: test_tag("fbi"),
            ..Default::default()
        };
        let a1 = LoopGuard::attach(&a, &opts);
        let a2 = LoopGuard::attach(&a, &opts);
        let b1 = LoopGuard::attach(&b, &opts);
        let ma = std::fs::metadata(&a).unwrap();
        let mut found: Vec<PathBuf> = find_by_inode(ma.dev(), ma.ino())
            .unwrap()
            .into_iter()
            .map(|i| i.device)
            .collect();
        found.sort();
        let mut want = vec![a1.0.device.clone(), a2.0.device.clone()];
        want.sort();
        assert_eq!(found, want);
        let mb = std::fs::metadata(&b).unwrap();
        let found_b: Vec<PathBuf> = find_by_inode(mb.dev(), mb.ino())
            .unwrap()
            .into_iter()
            .map(|i| i.device)
            .collect();
        assert_eq!(found_b, vec![b1.0.device.clone()]);
        // Renaming the path changes nothing: the device holds the inode.
        std::fs::rename(&a, dir.path().join("renamed.img")).unwrap();
        assert_eq!(find_by_inode(ma.dev(), ma.ino()).unwrap().len(), 2);
    }

    #[test]
    fn loopdev_legacy_attach_path() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "legacy.img", 64 * MIB);
        let tag = test_tag("legacy");
        let opts = AttachOptions {
            read_only: true,
            direct_io: true,
            tag: tag.clone(),
            size_limit: 0,
            logical_block_size: 0,
        };
        let g = LoopGuard(attach_inner(&img, &opts, false).unwrap());
        let st = status(g.path()).unwrap();
        assert_eq!(st.tag, tag);
        assert!(st.read_only);
        assert_eq!(st, g.0);
        eprintln!(
            "MEASURE legacy attach (SET_FD+SET_STATUS64+SET_DIRECT_IO): direct_io={}",
            st.direct_io
        );
    }

    #[test]
    fn loopdev_parallel_attach_races_resolve() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "par.img", 64 * MIB);
        let tag = test_tag("par");
        let barrier = Arc::new(std::sync::Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (img, tag, barrier) = (img.clone(), tag.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    attach(
                        &img,
                        &AttachOptions {
                            tag,
                            ..Default::default()
                        },
                    )
                    .map(LoopGuard)
                })
            })
            .collect();
        let guards: Vec<LoopGuard> = handles
            .into_iter()
            .map(|h| h.join().unwrap().expect("parallel attach"))
            .collect();
        let mut numbers: Vec<u32> = guards.iter().map(|g| g.0.number).collect();
        numbers.sort();
        numbers.dedup();
        assert_eq!(numbers.len(), 8, "two attaches got the same device");
        let m = std::fs::metadata(&img).unwrap();
        assert_eq!(find_by_inode(m.dev(), m.ino()).unwrap().len(), 8);
    }

    /// Backends that can reflink (xfs, btrfs): the backing st_dev the loop
    /// driver reports must match stat() (btrfs uses anonymous devices), and
    /// direct I/O should be possible.
    #[test]
    fn loopdev_backing_on_xfs_and_btrfs() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        for (kind, size, mkfs) in [
            ("xfs", 300 * MIB, "mkfs.xfs"),
            ("btrfs", 256 * MIB, "mkfs.btrfs"),
        ] {
            let outer = sparse_image(dir.path(), &format!("{kind}.img"), size);
            let st = std::process::Command::new(mkfs)
                .args(["-f", "-q"])
                .arg(&outer)
                .output();
            if !st.as_ref().is_ok_and(|o| o.status.success()) {
                eprintln!("SKIPPED {kind} backing: {mkfs} unavailable or failed: {st:?}");
                continue;
            }
            let og = LoopGuard::attach(
                &outer,
                &AttachOptions {
                    tag: test_tag(kind),
                    ..Default::default()
                },
            );
            let mnt = dir.path().join(format!("{kind}-mnt"));
            std::fs::create_dir(&mnt).unwrap();
            let mounted = std::process::Command::new("mount")
                .args(["-t", kind])
                .arg(og.path())
                .arg(&mnt)
                .status();
            assert!(mounted.is_ok_and(|s| s.success()), "mounting {kind}");
            let _mg = Unmount(mnt.clone());
            let inner = sparse_image(&mnt, "gen-1.img", 64 * MIB);
            let ig = LoopGuard::attach(
                &inner,
                &AttachOptions {
                    direct_io: true,
                    tag: test_tag("inner"),
                    ..Default::default()
                },
            );
            let m = std::fs::metadata(&inner).unwrap();
            assert_eq!(
                (ig.0.backing_dev, ig.0.backing_ino),
                (m.dev(), m.ino()),
                "{kind}"
            );
            let found = find_by_inode(m.dev(), m.ino()).unwrap();
            assert_eq!(found.len(), 1);
            assert_eq!(found[0].device, ig.0.device);
            eprintln!(
                "MEASURE backing on {kind}: direct_io={} st_dev={:#x}",
                ig.0.direct_io,
                m.dev()
            );
            drop(ig);
        }
    }

    #[test]
    fn loopdev_read_only_device_refuses_writes() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "ro.img", 64 * MIB);
        let g = LoopGuard::attach(
            &img,
            &AttachOptions {
                read_only: true,
                tag: test_tag("ro"),
                ..Default::default()
            },
        );
        assert!(g.0.read_only);
        let refused = |e: &io::Error| {
            matches!(
                e.raw_os_error(),
                Some(libc::EPERM | libc::EROFS | libc::EACCES)
            )
        };
        match OpenOptions::new().write(true).open(g.path()) {
            Err(e) => assert!(refused(&e), "open for write: unexpected {e}"),
            Ok(mut f) => {
                let err = f
                    .write_all(&[0xAA; 4096])
                    .and_then(|_| f.sync_all())
                    .expect_err("write to ro loop device succeeded");
                assert!(refused(&err), "unexpected write error {err}");
            }
        }
        // And the image stayed zero.
        let mut buf = vec![0u8; 4096];
        File::open(&img).unwrap().read_exact(&mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn loopdev_set_capacity_after_grow() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "grow.img", 64 * MIB);
        let g = LoopGuard::attach(
            &img,
            &AttachOptions {
                tag: test_tag("cap"),
                ..Default::default()
            },
        );
        assert_eq!(g.0.size_bytes, 64 * MIB);
        OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(96 * MIB)
            .unwrap();
        // The loop device keeps its old size until told.
        assert_eq!(status(g.path()).unwrap().size_bytes, 64 * MIB);
        assert_eq!(set_capacity(g.path()).unwrap(), 96 * MIB);
        assert_eq!(status(g.path()).unwrap().size_bytes, 96 * MIB);
    }

    /// A 4 KiB-aligned buffer for O_DIRECT.
    struct Aligned {
        ptr: *mut u8,
        len: usize,
    }
    unsafe impl Send for Aligned {}
    impl Aligned {
        fn new(len: usize, fill: u8) -> Self {
            let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
            let ptr = unsafe { std::alloc::alloc(layout) };
            assert!(!ptr.is_null());
            unsafe { std::ptr::write_bytes(ptr, fill, len) };
            Aligned { ptr, len }
        }
        fn as_slice(&self) -> &[u8] {
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }
    impl Drop for Aligned {
        fn drop(&mut self) {
            unsafe {
                std::alloc::dealloc(
                    self.ptr,
                    std::alloc::Layout::from_size_align(self.len, 4096).unwrap(),
                )
            }
        }
    }

    #[test]
    fn loopdev_direct_io_attach_reports_what_kernel_set() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "dio.img", 64 * MIB);
        let g = LoopGuard::attach(
            &img,
            &AttachOptions {
                direct_io: true,
                tag: test_tag("dio"),
                ..Default::default()
            },
        );
        let lbs = std::fs::read_to_string(format!(
            "/sys/block/loop{}/queue/logical_block_size",
            g.0.number
        ))
        .unwrap_or_default();
        eprintln!(
            "MEASURE direct_io attach: direct_io={} logical_block_size={}",
            g.0.direct_io,
            lbs.trim()
        );
        assert_eq!(status(g.path()).unwrap().direct_io, g.0.direct_io);
    }

    fn logical_block_size(number: u32) -> u32 {
        std::fs::read_to_string(format!("/sys/block/loop{number}/queue/logical_block_size"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Both attach paths apply a requested logical block size; 0 keeps the
    /// kernel's 512 (the control).
    #[test]
    fn loopdev_logical_block_size_is_what_was_asked() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "lbs.img", 64 * MIB);
        for (configure, size, want) in [(true, 0, 512), (true, 4096, 4096), (false, 4096, 4096)] {
            let opts = AttachOptions {
                tag: test_tag("lbs"),
                logical_block_size: size,
                ..Default::default()
            };
            let g = LoopGuard(attach_inner(&img, &opts, configure).unwrap());
            assert_eq!(
                logical_block_size(g.0.number),
                want,
                "LOOP_CONFIGURE={configure} asked {size}"
            );
        }
    }

    #[test]
    fn loopdev_drain_with_io_in_flight() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "drain.img", 128 * MIB);
        let g = LoopGuard::attach(
            &img,
            &AttachOptions {
                direct_io: true,
                tag: test_tag("drain"),
                ..Default::default()
            },
        );
        let before = status(g.path()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let mut writers = Vec::new();
        for t in 0..4u64 {
            let (dev, stop, written) = (g.0.device.clone(), stop.clone(), written.clone());
            writers.push(std::thread::spawn(move || -> io::Result<()> {
                let mut f = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&dev)?;
                let buf = Aligned::new(256 * 1024, t as u8 + 1);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = ((i * 4 + t) % 400) * 256 * 1024;
                    f.seek(SeekFrom::Start(off))?;
                    f.write_all(buf.as_slice())?;
                    written.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            }));
        }
        while written.load(Ordering::Relaxed) < 8 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut worst = Duration::ZERO;
        for _ in 0..20 {
            let t0 = std::time::Instant::now();
            drain(g.path()).unwrap();
            worst = worst.max(t0.elapsed());
            assert_eq!(status(g.path()).unwrap(), before, "drain changed a setting");
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap().expect("writer failed during drain");
        }
        eprintln!(
            "MEASURE drain under load: direct_io={} writes={} worst drain={:?}",
            before.direct_io,
            written.load(Ordering::Relaxed),
            worst
        );
        assert_eq!(status(g.path()).unwrap(), before);
    }

    #[test]
    fn loopdev_drain_keeps_autoclear_and_tag() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "ac.img", 64 * MIB);
        let g = LoopGuard::attach(
            &img,
            &AttachOptions {
                tag: test_tag("ac"),
                ..Default::default()
            },
        );
        // Keep the device open so detach only marks it autoclear.
        let hold = File::open(g.path()).unwrap();
        detach(g.path()).unwrap();
        let marked = status(g.path()).unwrap();
        assert!(marked.autoclear);
        drain(g.path()).unwrap();
        assert_eq!(status(g.path()).unwrap(), marked);
        drop(hold);
        assert!(wait_unbound(&marked));
    }

    /// A node's detach of a busy device (which only sets autoclear) racing a
    /// fence's remap (which reads the flags, then writes them back) must never
    /// leave the device bound after its last user closed it: both hold the
    /// backing file's lock. The race is made deterministic: the remapper reads
    /// the status, lets the detach run, then writes. Control: without the lock
    /// the device does linger, so the test exercises the window.
    #[test]
    fn loopdev_detach_racing_a_remap_never_lingers() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "race.img", 4 * MIB);
        for locked in [false, true] {
            let g = LoopGuard::attach(
                &img,
                &AttachOptions {
                    tag: test_tag("race"),
                    ..Default::default()
                },
            );
            let hold = File::open(g.path()).unwrap();
            let (dev, file) = (g.0.device.clone(), img.clone());
            let (read_tx, read_rx) = std::sync::mpsc::channel();
            let remapper = std::thread::spawn(move || {
                let _l = locked.then(|| BackingLock::on_path(&file, true, NODE_LOCK_WAIT).unwrap());
                let f = open_loop(&dev, false).unwrap();
                let raw = get_status_raw(&f, &dev).unwrap();
                read_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                unsafe { ioc::loop_set_status64(f.as_raw_fd(), &raw) }.unwrap();
            });
            read_rx.recv().unwrap();
            detach(g.path()).unwrap();
            remapper.join().unwrap();
            drop(hold);
            let gone = wait_unbound(&g.0);
            if locked {
                assert!(
                    gone,
                    "the device lingers after a detach raced a remap under the lock"
                );
            } else {
                assert!(
                    !gone,
                    "control: without the lock the race must lose the autoclear"
                );
                detach(g.path()).unwrap();
                assert!(wait_unbound(&g.0));
            }
        }
    }
}
