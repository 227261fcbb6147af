//! File operations on the backing filesystem: sparse images, reflink clones,
//! sparse-aware copies, the immutable inode flag, and atomic state writes.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// `FS_IMMUTABLE_FL` from linux/fs.h: what `chattr +i` sets.
pub const FS_IMMUTABLE_FL: libc::c_long = 0x0000_0010;

// The ioctl numbers encode sizeof(long) but the kernel reads and writes an int.
// We hand it a zeroed long: on the little-endian targets we build for, the int
// the kernel touches is the long's low half.
nix::ioctl_read!(fs_ioc_getflags, b'f', 1, libc::c_long);
nix::ioctl_write_ptr!(fs_ioc_setflags, b'f', 2, libc::c_long);
nix::ioctl_write_int!(ficlone, 0x94, 9);

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloneKind {
    /// O(1) shared-extent clone (xfs, btrfs).
    Reflink,
    /// Data ranges copied, holes kept (ext4 and other non-reflink backends).
    SparseCopy,
}

fn flags_of(file: &File) -> io::Result<libc::c_int> {
    let mut flags: libc::c_long = 0;
    // SAFETY: valid fd, and a buffer at least as large as the int the kernel writes.
    unsafe { fs_ioc_getflags(file.as_raw_fd(), &mut flags) }.map_err(io::Error::from)?;
    Ok(flags as libc::c_int)
}

fn set_flags(file: &File, flags: libc::c_int) -> io::Result<()> {
    let value: libc::c_long = flags as libc::c_long;
    // SAFETY: valid fd and pointer; the kernel reads an int from it.
    unsafe { fs_ioc_setflags(file.as_raw_fd(), &value) }.map_err(io::Error::from)?;
    Ok(())
}

/// Sets or clears the immutable flag and reads it back. Setting it takes the
/// inode lock in the kernel, so it also waits out buffered writers already
/// inside a write call on this inode.
pub fn set_immutable(path: &Path, on: bool) -> io::Result<()> {
    let file = File::open(path)?;
    let flags = flags_of(&file)?;
    let want = if on {
        flags | FS_IMMUTABLE_FL as libc::c_int
    } else {
        flags & !(FS_IMMUTABLE_FL as libc::c_int)
    };
    if want != flags {
        set_flags(&file, want)?;
    }
    let now = flags_of(&file)? & FS_IMMUTABLE_FL as libc::c_int != 0;
    if now != on {
        return Err(io::Error::other(format!(
            "immutable flag on {} reads back as {now} after setting {on}",
            path.display()
        )));
    }
    Ok(())
}

pub fn is_immutable(path: &Path) -> io::Result<bool> {
    let file = File::open(path)?;
    Ok(flags_of(&file)? & FS_IMMUTABLE_FL as libc::c_int != 0)
}

/// Creates a sparse file of `size` bytes, durably; fails if it exists.
pub fn create_sparse(path: &Path, size: u64) -> io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.set_len(size)?;
    file.sync_all()?;
    fsync_parent(path)
}

/// Grows (never shrinks) a file to `size` bytes, durably.
pub fn grow(path: &Path, size: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    if file.metadata()?.len() < size {
        file.set_len(size)?;
        file.sync_all()?;
    }
    Ok(())
}

/// The time a copy's source holds still (its writers frozen, see
/// `controller::quiesce`), as a copy sees it: the copy asks whether the window
/// is still open before the reflink and before each range it copies, stops at
/// once when it is not, and says when it has read the whole source, so that
/// the writers can go on before the copy's own flush.
pub trait SourceWindow {
    /// Whether the source still holds still. A copy that finds the window
    /// closed fails with [`io::ErrorKind::TimedOut`] and leaves nothing.
    fn open(&self) -> bool;
    /// The source has been read in full (a reflink made, or the last range
    /// copied): returns whether the window was still open until then. When it
    /// was not, the copy is not one instant and fails as above.
    fn close(&self) -> bool;
}

/// The window of a source that holds still by itself (fenced, a snapshot):
/// always open.
pub struct Unbounded;

impl SourceWindow for Unbounded {
    fn open(&self) -> bool {
        true
    }
    fn close(&self) -> bool {
        true
    }
}

fn window_closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the source's writers were let go before the copy had read it (the freeze bound passed)",
    )
}

/// Clones the first `data_len` bytes of `src` into a new file `dst` of
/// `final_len` bytes (anything past `data_len` reads as zeros): a reflink
/// where the filesystem can, else a copy of the data ranges only. `dst` is
/// written under a temporary name and renamed into place, so a crash never
/// leaves a half copy at `dst`.
pub fn clone_file(src: &Path, dst: &Path, data_len: u64, final_len: u64) -> io::Result<CloneKind> {
    clone_file_in(src, dst, data_len, final_len, &Unbounded)
}

/// [`clone_file`] of a source that holds still only while `window` is open.
pub fn clone_file_in(
    src: &Path,
    dst: &Path,
    data_len: u64,
    final_len: u64,
    window: &dyn SourceWindow,
) -> io::Result<CloneKind> {
    let tmp = dst.with_extension("partial");
    let _ = std::fs::remove_file(&tmp);
    let source = File::open(src)?;
    let target = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    let result = (|| {
        if !window.open() {
            return Err(window_closed());
        }
        // SAFETY: both fds are valid for the duration of the call.
        let kind = match unsafe { ficlone(target.as_raw_fd(), source.as_raw_fd() as libc::c_ulong) }
        {
            Ok(_) => CloneKind::Reflink,
            Err(
                nix::errno::Errno::EOPNOTSUPP
                | nix::errno::Errno::EXDEV
                | nix::errno::Errno::EINVAL
                | nix::errno::Errno::ENOTTY,
            ) => {
                sparse_copy(&source, &target, data_len, window)?;
                CloneKind::SparseCopy
            }
            Err(e) => return Err(io::Error::from(e)),
        };
        // The source is read: its writers may go on while this copy is flushed.
        if !window.close() {
            return Err(window_closed());
        }
        // Whatever lay past the data (a fence trailer) is not copied: cut, then extend.
        target.set_len(data_len)?;
        target.set_len(final_len)?;
        target.sync_all()?;
        Ok(kind)
    })();
    match result {
        Ok(kind) => {
            std::fs::rename(&tmp, dst)?;
            fsync_parent(dst)?;
            Ok(kind)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Whether `dir`'s filesystem makes reflink clones (tried on a scratch file).
pub fn can_reflink(dir: &Path) -> bool {
    let a = dir.join(format!(".reflink-probe-{}", std::process::id()));
    let b = a.with_extension("clone");
    let ok = (|| -> io::Result<bool> {
        // The source of FICLONE must be open for reading.
        let src = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&a)?;
        src.set_len(4096)?;
        let dst = File::create(&b)?;
        // SAFETY: both fds valid for the call.
        Ok(unsafe { ficlone(dst.as_raw_fd(), src.as_raw_fd() as libc::c_ulong) }.is_ok())
    })()
    .unwrap_or(false);
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    ok
}

/// The most [`sparse_copy`] copies between two looks at its window: at a few
/// hundred MB/s, a window that closes stops the copy within a fraction of a second.
const COPY_CHUNK: u64 = 64 << 20;

/// The first offset at or after `from` that holds data (SEEK_DATA), None when
/// only holes follow.
pub fn first_data_at_or_after(path: &Path, from: u64) -> io::Result<Option<u64>> {
    let f = std::fs::File::open(path)?;
    // SAFETY: lseek on a descriptor this function owns.
    let at = unsafe { libc::lseek(f.as_raw_fd(), from as libc::off_t, libc::SEEK_DATA) };
    if at >= 0 {
        return Ok(Some(at as u64));
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
        e => Err(e),
    }
}

/// Copies only the data extents (SEEK_DATA/SEEK_HOLE), keeping holes; stops
/// when `window` closes (checked before each range of at most [`COPY_CHUNK`]).
fn sparse_copy(src: &File, dst: &File, limit: u64, window: &dyn SourceWindow) -> io::Result<()> {
    let len = src.metadata()?.len().min(limit);
    dst.set_len(len)?;
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: plain lseek on a valid fd.
        let data = unsafe { libc::lseek(sfd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos: the rest is a hole
            }
            return Err(err);
        }
        if data as u64 >= len {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let hole = hole.min(len as i64);
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            if !window.open() {
                return Err(window_closed());
            }
            let chunk = (hole - off_in).min(COPY_CHUNK as i64) as usize;
            // SAFETY: valid fds and offset pointers owned by this frame.
            let n = unsafe { libc::copy_file_range(sfd, &mut off_in, dfd, &mut off_out, chunk, 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "source shrank during copy",
                ));
            }
        }
        pos = hole;
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically and durably: temp file, fsync,
/// rename over the old file, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("path has no parent"))?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fencecsi_failpoint::hit("write-atomic:after-temp");
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    fsync_dir(dir)
}

pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

pub fn fsync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(p) => fsync_dir(p),
        None => Ok(()),
    }
}

/// (device, inode) of a file: how loop devices report their backing file.
pub fn dev_ino(path: &Path) -> io::Result<(u64, u64)> {
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Bytes actually allocated to a file.
pub fn allocated_bytes(path: &Path) -> io::Result<u64> {
    Ok(std::fs::metadata(path)?.blocks() * 512)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom};

    #[test]
    fn reflink_support_is_detected() {
        // The temp dir's filesystem decides; the answer must match a real clone.
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("s");
        std::fs::write(&src, b"data").unwrap();
        let kind = clone_file(&src, &dir.path().join("d"), 4, 4).unwrap();
        assert_eq!(can_reflink(dir.path()), kind == CloneKind::Reflink);
    }

    #[test]
    fn sparse_clone_keeps_data_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a.img");
        create_sparse(&src, 64 << 20).unwrap();
        let mut f = OpenOptions::new().write(true).open(&src).unwrap();
        f.seek(SeekFrom::Start(10 << 20)).unwrap();
        f.write_all(&[0xabu8; 8192]).unwrap();
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(b"tail").unwrap();
        f.sync_all().unwrap();
        let dst = dir.path().join("b.img");
        clone_file(&src, &dst, 64 << 20, 64 << 20).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        // Holes stay holes: far less than the 64 MiB apparent size is allocated.
        assert!(
            allocated_bytes(&dst).unwrap() < 4 << 20,
            "{}",
            allocated_bytes(&dst).unwrap()
        );
        assert!(!dir.path().join("b.partial").exists());

        // Only the data region is copied: bytes past it (a fence trailer)
        // are not, and the copy is extended with zeros.
        let cut = dir.path().join("c.img");
        clone_file(&src, &cut, 40 << 20, 48 << 20).unwrap();
        let c = std::fs::read(&cut).unwrap();
        assert_eq!(c.len(), 48 << 20);
        assert_eq!(&c[10 << 20..(10 << 20) + 8192], &[0xabu8; 8192][..]);
        assert!(
            c[40 << 20..].iter().all(|b| *b == 0),
            "the tail past the data was copied"
        );
    }

    /// A window that closes during the copy (or before the copy says it has
    /// read the source) fails the copy and leaves nothing; an open one is
    /// told once, after the source was read.
    #[test]
    fn a_copy_stops_when_its_window_closes() {
        use std::cell::Cell;
        struct Counting {
            opens_left: Cell<u32>,
            closes: Cell<u32>,
            close_answer: bool,
        }
        impl SourceWindow for Counting {
            fn open(&self) -> bool {
                let left = self.opens_left.get();
                self.opens_left.set(left.saturating_sub(1));
                left > 0
            }
            fn close(&self) -> bool {
                self.closes.set(self.closes.get() + 1);
                self.close_answer
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a.img");
        // Three data ranges of more than one chunk in all, so the copy looks
        // at its window several times.
        create_sparse(&src, 3 * COPY_CHUNK).unwrap();
        let f = OpenOptions::new().write(true).open(&src).unwrap();
        for i in 0..3u64 {
            use std::os::unix::fs::FileExt;
            f.write_all_at(&[0x5a; 4096], i * COPY_CHUNK + 8192)
                .unwrap();
        }
        f.sync_all().unwrap();
        let reflinks = can_reflink(dir.path());
        let w = |opens_left, close_answer| Counting {
            opens_left: Cell::new(opens_left),
            closes: Cell::new(0),
            close_answer,
        };
        let dst = dir.path().join("b.img");
        for (window, what) in [
            (w(0, true), "closed before the copy"),
            (w(2, true), "closed during the copy"),
            (w(100, false), "closed before the copy said it had read"),
        ] {
            if reflinks && what == "closed during the copy" {
                continue; // one reflink: nothing in between to stop
            }
            let err =
                clone_file_in(&src, &dst, 3 * COPY_CHUNK, 3 * COPY_CHUNK, &window).expect_err(what);
            assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{what}: {err}");
            assert!(
                !dst.exists() && !dir.path().join("b.partial").exists(),
                "{what}"
            );
        }
        let open = w(100, true);
        clone_file_in(&src, &dst, 3 * COPY_CHUNK, 3 * COPY_CHUNK, &open).unwrap();
        assert_eq!(open.closes.get(), 1);
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
    }

    #[test]
    fn immutable_flag_blocks_writes_and_clears() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("frozen.img");
        create_sparse(&p, 1 << 20).unwrap();
        set_immutable(&p, true).unwrap();
        assert!(is_immutable(&p).unwrap());
        let err = OpenOptions::new().write(true).open(&p).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        set_immutable(&p, false).unwrap();
        assert!(!is_immutable(&p).unwrap());
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn atomic_write_replaces_whole_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        write_atomic(&p, b"first version, long").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
